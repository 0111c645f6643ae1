/*
Flash attention in float32, forward and backward, register-tiled for head size 64 (attention kernels v3: the op's
version C3; the backward's version 4: C4). fp32 stays fp32: every product is an FFMA on the CUDA cores (no TF32,
no tensor cores), as PyTorch's memory-efficient SDPA kernel runs fp32.
Oracle: refbert.ops.attention_forward / attention_backward (Python launchers: kernels/cuda/cuda_c.py
attention_forward_c3 / attention_backward_c3 / attention_backward_c4; the math and the Numba versions:
kernels/cuda/attention.py; the scalar flash v1 in attention_forward.cu / attention_backward.cu is the explanation
of this one).

q, k, v, out, dout, dq, dk, dv: (B, T, C) float32, C = H * 64, head h = columns h*64 .. h*64 + 63, every row 16-byte
aligned (the launcher checks). mask: float32 at mask[b*sb + h*sh + i*si + j*sj] (stride 0 on a broadcast axis;
a (1, 1, 1, 1) zero mask when there is none). m, linv: (B, H, T), the row max of s = scale q.k + mask and 1 / l,
l = sum_j exp(s_ij - m_i). Dropout keeps element e = ((b*H + h)*T + i)*T + j iff its Philox4x32-10 word (seed,
stream) >= thresh; kept probabilities are scaled by dscale = 1/(1-p); thresh = 0: no dropout.
    forward:   out_i = sum_j p_ij z_ij v_j,  p_ij = exp(s_ij - m_i) / l_i   (online over key tiles)
    backward:  D_i = dout_i . out_i;  dv_j = sum_i p_ij z_ij dout_i;  dp_ij = z_ij dout_i . v_j
               ds_ij = p_ij (dp_ij - D_i);  dq_i = scale sum_j ds_ij k_j;  dk_j = scale sum_i ds_ij q_i

Version 3:
  tiles of 64 query rows x 64 keys in shared memory (rows padded to 68 floats: the 128-bit reads below are free of
  bank conflicts), 128 threads: thread (ty = tid / 8, tx = tid % 8) computes the 4 x 8 products of rows ty + 16 i
  and columns tx + 8 j of a tile product (tile_dot: 128 FFMA per 12 shared 128-bit loads), and accumulates the
  4 x 8 outputs of rows ty + 16 i, head columns 4 tx + 32 k of a product with a value tile (tile_pv). The row max
  and sum of the online softmax by shuffles among the 8 lanes of a row. The dropout mask is regenerated over the
  tile in shared memory with one Philox call per 4 consecutive keys (T % 4 == 0; one per element otherwise), not
  per element of each thread.
  forward   a block per (b, h, 64 query rows), q resident, k and v tiles streamed; p overwrites the k tile.
            51 KB of dynamic shared memory.
  backward  D_i by a warp per row; dk, dv by a block per (b, h, 64 keys) streaming query tiles (k, v resident; p,
            dp written as tiles, then p z and ds transposed, so that dv += (p z)^T dout and dk += ds^T q are tile_pv
            products); dq by a block per (b, h, 64 query rows) streaming key tiles. No atomics; 103 KB each.
The launcher raises each kernel's dynamic shared memory limit (RawKernel.max_dynamic_shared_size_bytes).

Version 4 (the backward; the forward stays version 3's):
  version 3 computes each tile pair's S and dP twice (7 tile products: S, dP, dv, dk in dkdv; S, dP, dq in dq).
  Version 4 runs version 3's dk, dv kernel body with one more product per query tile, dq_part = ds k over the
  block's 64 keys (tile_tpv: ds^T is already in shared memory for dk; the thread's rows 4 ty .. 4 ty + 3, so one
  128-bit read serves 4 rows), stored to partials (nkt, B H, T, 64) float32: 5 products a tile pair. A second
  kernel sums the partials in key-tile order and scales: no atomics, so dq is the same bits every run (a float
  atomicAdd's order would not be), at the cost of B H T^2 floats of partials written and read once (100 MB at
  B=8 H=12 T=512: about 70 us of traffic at 3 TB/s against version 3's dq kernel, 3 of its 7 products). dk and dv
  are version 3's bit for bit (the same code).

Version 5 (the forward; the backward stays version 4's): version 3's arithmetic and bits with Q, K and V moved by
  cp.async, K and V double-buffered (the next tile is issued after the barrier that opens this one and lands while
  it computes: version 3 waited on global memory at every tile), a mask constant along the queries staged in
  shared memory a tile at a time (version 3: a 64-bit index and a global load per score), three barriers a tile.
  87 KB of dynamic shared memory, two blocks an SM as version 3. The main compares its out, m and 1/l with version
  3's bit for bit; op version C6 (C4's backward).

Version 7 (the backward, where version 4's / 6's partials would not fit: the launcher's REFBERT_C4_PARTS_MB, 1 GiB
  by default; B H T^2 floats are 1.6 GB at B=8 H=12 T=2048, where C4 ran version 3's dq kernel instead, 12.2 ms on
  the H200 against PyTorch's 7.61): version 6's one pass over groups of G key tiles at a time, the group's
  partials (G, B H, T, 64), then attn_bwd_dqsum_v7_f32 adds them to a running sum kept unscaled in dq itself: the
  first group starts it from its first partial, each later group reads it back (a float32 store and load are
  exact), the last scales it. The same additions in the same order as version 4's sum over all nkt partials, so
  version 6's dq, dk, dv bit for bit (the main compares them with G = 1 and 2), with G x B H T 64 floats of
  partials instead of nkt x; ceil(nkt / G) pairs of launches where version 6 makes one, and dq read and written
  once more per group.

Version 8 (the backward without dropout, under a mask constant along the queries or none; version 6 elsewhere):
  version 7's kernel (so all nkt key tiles at once where the partials fit, as version 6, or a group at a time)
  compiled without the dropout pass. Version 6 writes P and dP as tiles [query][key], reads them back row-wise to
  apply z, dscale and D, and writes p z and ds transposed: five barriers a tile pair (tiles free, tiles loaded, P
  and dP written, read, transposed) and three passes over shared memory. With z = 1 and dscale = 1, the thread
  that holds S^T and dP^T in registers computes p and ds = p (dp - D) and stores them transposed itself: three
  barriers a tile pair, the key columns' mask terms read once per block (-inf past T, and m = +inf on query rows
  past T, so exp gives 0 there without a bounds test). The same bits as version 6: p is the same expression
  (fma(s, scale, mask), minus m, exp, times 1/l), p z = p 1 = p exactly, and version 6's dp zs - D, whether ptxas
  fuses it into an fma or not, is dp 1 - D rounded once, which is dp - D rounded once. (The CPU-thread builds compile
  with -ffp-contract=off, so that argument, not they, covers the fma.) Its direct stores meet 2-way bank conflicts
  where version 6's passes had none: 64 stores of 2 wavefronts each (128) against version 6's 192 (64 stores, 64
  loads, 64 stores).

Build and run standalone (validates against the CPU reference, then times):
    nvcc -O3 -arch=sm_90 -std=c++17 -o attention_f32 attention_f32.cu && ./attention_f32 [T [p]]
  (T: the last shape's length, 2048 by default; p: the dropout rate, 0.1 by default; at p = 0 version 8 runs too)
On CPU threads:  g++ -std=c++20 -O1 -pthread -ffp-contract=off -DCPUSIM -DCPUSIM_SMALL -x c++ attention_f32.cu
*/
#include "common.cuh"

#define A3_HS 64
#define A3_LD 68                    // padded row: 272 bytes, 8 consecutive rows start in 8 distinct bank quads
#define A3_NT 128
#define A3_TILE (64 * A3_LD)
#define A3_FWD_SMEM (3 * A3_TILE * 4)
#define A3_BWD_SMEM ((6 * A3_TILE + 3 * 64) * 4)

#define A3_ARGS                                                                                                   \
    const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,                       \
        const float *__restrict__ mask, long long sb, long long sh, long long si, long long sj, int B, int Tn,    \
        int H, float scale, u64 seed, u64 stream, u64 thresh, float dscale
#define A3_PASS q, k, v, mask, sb, sh, si, sj, B, Tn, H, scale, seed, stream, thresh, dscale

// rows row0 .. row0 + 63 of head h of a (B, T, C) tensor into a tile (zeros past T): 1024 float4, 8 per thread
__device__ __forceinline__ void a3_load(float* __restrict__ dst, const float* __restrict__ src, size_t base,
                                        int row0, int T, int C) {
#pragma unroll
    for (int t = 0; t < 8; t++) {
        const int idx = threadIdx.x + A3_NT * t, r = idx >> 4, c4 = (idx & 15) * 4;
        const float4 val = row0 + r < T ? ld4(src + base + (size_t)(row0 + r) * C + c4) : make_float4(0.f, 0.f, 0.f, 0.f);
        st4(dst + r * A3_LD + c4, val);
    }
}

// acc[i][j] = A[ty + 16 i] . B[tx + 8 j] over the 64 columns (two tiles of rows)
__device__ __forceinline__ void tile_dot(float (&acc)[4][8], const float* __restrict__ A,
                                         const float* __restrict__ Bt) {
    const int ty = threadIdx.x >> 3, tx = threadIdx.x & 7;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[i][j] = 0.f;
#pragma unroll 2
    for (int d = 0; d < A3_HS; d += 4) {
        float4 a[4], b[8];
#pragma unroll
        for (int i = 0; i < 4; i++) a[i] = ld4(A + (ty + 16 * i) * A3_LD + d);
#pragma unroll
        for (int j = 0; j < 8; j++) b[j] = ld4(Bt + (tx + 8 * j) * A3_LD + d);
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 8; j++) {
                float s = acc[i][j];
                s = fmaf(a[i].x, b[j].x, s);
                s = fmaf(a[i].y, b[j].y, s);
                s = fmaf(a[i].z, b[j].z, s);
                s = fmaf(a[i].w, b[j].w, s);
                acc[i][j] = s;
            }
    }
}

// o[i][4 k + e] += sum_c P[ty + 16 i][c] V[c][4 tx + 32 k + e] over the 64 columns of P (rows of V)
__device__ __forceinline__ void tile_pv(float (&o)[4][8], const float* __restrict__ P, const float* __restrict__ V) {
    const int ty = threadIdx.x >> 3, tx = threadIdx.x & 7;
#pragma unroll 2
    for (int c = 0; c < 64; c += 4) {
        float4 p[4], w[4][2];
#pragma unroll
        for (int i = 0; i < 4; i++) p[i] = ld4(P + (ty + 16 * i) * A3_LD + c);
#pragma unroll
        for (int cc = 0; cc < 4; cc++)
#pragma unroll
            for (int kk = 0; kk < 2; kk++) w[cc][kk] = ld4(V + (c + cc) * A3_LD + 4 * tx + 32 * kk);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float pc[4] = {p[i].x, p[i].y, p[i].z, p[i].w};
#pragma unroll
            for (int kk = 0; kk < 2; kk++)
#pragma unroll
                for (int cc = 0; cc < 4; cc++) {
                    o[i][4 * kk + 0] = fmaf(pc[cc], w[cc][kk].x, o[i][4 * kk + 0]);
                    o[i][4 * kk + 1] = fmaf(pc[cc], w[cc][kk].y, o[i][4 * kk + 1]);
                    o[i][4 * kk + 2] = fmaf(pc[cc], w[cc][kk].z, o[i][4 * kk + 2]);
                    o[i][4 * kk + 3] = fmaf(pc[cc], w[cc][kk].w, o[i][4 * kk + 3]);
                }
        }
    }
}

// o[i][4 k + e] = sum_c At[c][4 ty + i] W[c][4 tx + 32 k + e] over the 64 rows of At and W: a product whose left
// operand is stored transposed (At[c][r] = A[r][c]); the thread's rows are 4 ty .. 4 ty + 3 (one 128-bit read of
// At per c, shared by the 8 lanes of a ty: no bank conflict), its columns tile_pv's
__device__ __forceinline__ void tile_tpv(float (&o)[4][8], const float* __restrict__ At,
                                         const float* __restrict__ W) {
    const int ty = threadIdx.x >> 3, tx = threadIdx.x & 7;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) o[i][j] = 0.f;
#pragma unroll 4
    for (int c = 0; c < 64; c++) {
        const float4 a = ld4(At + c * A3_LD + 4 * ty), w0 = ld4(W + c * A3_LD + 4 * tx), w1 = ld4(W + c * A3_LD + 4 * tx + 32);
        const float ar[4] = {a.x, a.y, a.z, a.w}, wr[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 8; j++) o[i][j] = fmaf(ar[i], wr[j], o[i][j]);
    }
}

// the keep factors (0 or 1) of elements e .. e + 3 (one Philox call when e % 4 == 0)
__device__ __forceinline__ float4 a3_keep(u64 e, u64 seed, u64 stream, u64 thresh) {
    if ((e & 3) == 0) return keep4(e, seed, stream, thresh, 1.f);
    return make_float4(keep_z(e, seed, stream, thresh, 1.f), keep_z(e + 1, seed, stream, thresh, 1.f),
                       keep_z(e + 2, seed, stream, thresh, 1.f), keep_z(e + 3, seed, stream, thresh, 1.f));
}

__device__ __forceinline__ float a3_mask(const float* mask, long long sb, long long sh, long long si, long long sj,
                                         int b, int h, int i, int j) {
    return mask[b * sb + h * sh + i * si + j * sj];
}

// the online softmax of one 64 x 64 score tile (forward versions 3 and 5, the same code so the same bits):
// s = scale q.k + mask (mask_at(j, row, col): the mask at the thread's column j), -inf past T; the running max mi
// and sum li of each of the thread's 4 rows updated, o rescaled, s replaced by exp(s - m)
template <class MaskAt>
__device__ __forceinline__ void a3_softmax_tile(float (&s)[4][8], float (&o)[4][8], float (&mi)[4], float (&li)[4],
                                                int q0, int k0, int Tn, float scale, MaskAt mask_at) {
    const int ty = threadIdx.x >> 3, tx = threadIdx.x & 7;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int row = min(q0 + ty + 16 * i, Tn - 1);               // (rows past T: any finite mask row)
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int col = k0 + tx + 8 * j;
            s[i][j] = col < Tn ? s[i][j] * scale + mask_at(j, row, col) : -INFINITY;
            mx = fmaxf(mx, s[i][j]);
        }
#pragma unroll
        for (int off = 1; off < 8; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        const float mn = fmaxf(mi[i], mx);
        float sum = 0.f;
        if (mn == -INFINITY) {                                        // only -inf so far: nothing to add
#pragma unroll
            for (int j = 0; j < 8; j++) s[i][j] = 0.f;
        } else {
            const float alpha = __expf(mi[i] - mn);                   // exp(-inf) = 0 on the first finite tile
#pragma unroll
            for (int j = 0; j < 8; j++) { s[i][j] = __expf(s[i][j] - mn); sum += s[i][j]; }
            li[i] *= alpha;
#pragma unroll
            for (int j = 0; j < 8; j++) o[i][j] *= alpha;
            mi[i] = mn;
        }
#pragma unroll
        for (int off = 1; off < 8; off <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        li[i] += sum;
    }
}

// the p tile (Ps, 64 x 64) times its keep factors z (0 or 1), 4 keys a Philox call; the caller's barriers around it
__device__ __forceinline__ void a3_drop_tile(float* Ps, int bh, int Tn, int q0, int k0, u64 seed, u64 stream,
                                             u64 thresh) {
#pragma unroll
    for (int t = 0; t < 8; t++) {
        const int g = threadIdx.x + A3_NT * t, r = g >> 4, c4 = (g & 15) * 4;
        const float4 z = a3_keep(((u64)bh * Tn + (q0 + r)) * Tn + k0 + c4, seed, stream, thresh);
        float4 p = ld4(Ps + r * A3_LD + c4);
        st4(Ps + r * A3_LD + c4, make_float4(p.x * z.x, p.y * z.y, p.z * z.z, p.w * z.w));
    }
}

// out = o / l * dscale, and m, 1/l, of the thread's rows below T
__device__ __forceinline__ void a3_store_out(const float (&o)[4][8], const float (&mi)[4], const float (&li)[4],
                                             float* __restrict__ out, float* __restrict__ m_out,
                                             float* __restrict__ linv_out, size_t base, int bh, int q0, int Tn, int C,
                                             float dscale) {
    const int ty = threadIdx.x >> 3, tx = threadIdx.x & 7;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int row = q0 + ty + 16 * i;
        if (row >= Tn) continue;
        const float inv = 1.f / li[i], f = inv * dscale;
#pragma unroll
        for (int kk = 0; kk < 2; kk++)
            st4(out + base + (size_t)row * C + 4 * tx + 32 * kk,
                make_float4(o[i][4 * kk] * f, o[i][4 * kk + 1] * f, o[i][4 * kk + 2] * f, o[i][4 * kk + 3] * f));
        if (tx == 0) {
            m_out[(size_t)bh * Tn + row] = mi[i];
            linv_out[(size_t)bh * Tn + row] = inv;
        }
    }
}

// ----------------------------------------------------------------------------------------------------------------
// forward: grid (ceil(T / 64), B * H), 128 threads, A3_FWD_SMEM bytes. (128, 2): up to 255 registers (left
// alone, ptxas chose 168 and spilled 48 bytes; 2 blocks of 51 KB fit an SM either way)

extern "C" __global__ void __launch_bounds__(A3_NT, 2) attn_fwd_v3_f32_hs64(A3_ARGS, float* __restrict__ out,
                                                                         float* __restrict__ m_out,
                                                                         float* __restrict__ linv_out) {
    DYN_SHARED(float, sm);
    float *Qs = sm, *Ks = sm + A3_TILE, *Vs = sm + 2 * A3_TILE;          // the p tile overwrites Ks
    const int tid = threadIdx.x, ty = tid >> 3, tx = tid & 7, bh = blockIdx.y, b = bh / H, h = bh % H;
    const int C = H * A3_HS, q0 = blockIdx.x * 64;
    const size_t base = (size_t)b * Tn * C + h * A3_HS;
    a3_load(Qs, q, base, q0, Tn, C);
    float o[4][8], mi[4], li[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        mi[i] = -INFINITY;
        li[i] = 0.f;
#pragma unroll
        for (int j = 0; j < 8; j++) o[i][j] = 0.f;
    }
    for (int k0 = 0; k0 < Tn; k0 += 64) {
        __syncthreads();                                              // the previous tile's p and v are used
        a3_load(Ks, k, base, k0, Tn, C);
        a3_load(Vs, v, base, k0, Tn, C);
        __syncthreads();
        float s[4][8];
        tile_dot(s, Qs, Ks);
        a3_softmax_tile(s, o, mi, li, q0, k0, Tn, scale,
                        [&](int, int row, int col) { return a3_mask(mask, sb, sh, si, sj, b, h, row, col); });
        __syncthreads();                                              // every thread is done reading Ks
        float* Ps = Ks;
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 8; j++) Ps[(ty + 16 * i) * A3_LD + tx + 8 * j] = s[i][j];
        __syncthreads();
        if (thresh) {                                                 // z (0 or 1) over the tile, 4 keys a call
            a3_drop_tile(Ps, bh, Tn, q0, k0, seed, stream, thresh);
            __syncthreads();
        }
        tile_pv(o, Ps, Vs);
    }
    a3_store_out(o, mi, li, out, m_out, linv_out, base, bh, q0, Tn, C, dscale);
}

#ifdef HALF_TYPES   // (cp.async: common.cuh's, beside the tensor-core helpers)
// ----------------------------------------------------------------------------------------------------------------
// forward version 5: version 3's arithmetic (the same bits: the main compares them) with the loads off the critical
// path. Version 3 loads each K / V tile through registers between two barriers, so every tile starts with the
// whole block waiting on global memory, and reads the mask with a 64-bit index and a global load per score. Here:
//   - Q and the K / V tiles by cp.async, K and V double-buffered: tile it + 1 is issued right after the barrier
//     that opens tile it (every thread is then done with the buffers it refills) and lands while tile it computes;
//   - a mask constant along the queries (si == 0, BERT's (B, 1, 1, T)): the tile's 64 entries staged in shared
//     memory (the next tile's fetched into a register meanwhile), 8 shared loads a thread a tile for its 32 scores;
//   - three barriers a tile (tile ready; K read, p may overwrite it; p written), four with dropout.
// 87 KB of dynamic shared memory (Q, two K and two V tiles; p overwrites the K tile it came from): two blocks an
// SM, as version 3's launch bounds ask.
#define A5_FWD_SMEM (5 * A3_TILE * 4 + 2 * 64 * 4)

__device__ __forceinline__ void a5_load(float* __restrict__ dst, const float* __restrict__ src, size_t base,
                                        int row0, int T, int C) {       // a3_load by cp.async (zeros past T)
#pragma unroll
    for (int t = 0; t < 8; t++) {
        const int idx = threadIdx.x + A3_NT * t, r = idx >> 4, c4 = (idx & 15) * 4;
        const bool ok = row0 + r < T;
        cp_async16(dst + r * A3_LD + c4, src + base + (size_t)(ok ? row0 + r : 0) * C + c4, ok ? 16 : 0);
    }
}

extern "C" __global__ void __launch_bounds__(A3_NT, 2) attn_fwd_v5_f32_hs64(A3_ARGS, float* __restrict__ out,
                                                                         float* __restrict__ m_out,
                                                                         float* __restrict__ linv_out) {
    DYN_SHARED(float, sm);
    // Q, then K tiles 0 and 1 (p overwrites the current one), V tiles 0 and 1, the tiles' mask rows [2][64]
    // (buffer cur at sm + (1 + cur) A3_TILE: arithmetic, since an array of pointers indexed by cur is local memory)
    float *Qs = sm, *Ms = sm + 5 * A3_TILE;
    auto Kb = [&](int c) { return sm + (1 + c) * A3_TILE; };
    auto Vb = [&](int c) { return sm + (3 + c) * A3_TILE; };
    const int tid = threadIdx.x, ty = tid >> 3, tx = tid & 7, bh = blockIdx.y, b = bh / H, h = bh % H;
    const int C = H * A3_HS, q0 = blockIdx.x * 64, ntiles = (Tn + 63) / 64;
    const size_t base = (size_t)b * Tn * C + h * A3_HS;
    const bool staged = si == 0;                                        // (block-uniform)
    const float* mrow = mask + b * sb + h * sh;
    auto mask_at = [&](int j) { return j < Tn ? mrow[j * sj] : 0.f; };
    a5_load(Qs, q, base, q0, Tn, C);
    a5_load(Kb(0), k, base, 0, Tn, C);
    a5_load(Vb(0), v, base, 0, Tn, C);
    cp_async_commit();
    if (staged && tid < 64) Ms[tid] = mask_at(tid);
    float o[4][8], mi[4], li[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        mi[i] = -INFINITY;
        li[i] = 0.f;
#pragma unroll
        for (int j = 0; j < 8; j++) o[i][j] = 0.f;
    }
    for (int it = 0; it < ntiles; it++) {
        const int cur = it & 1, k0 = it * 64;
        cp_async_wait<0>();                                           // tile it (issued a tile ago) has landed
        __syncthreads();                                              // ... for every thread; tile it - 1 is done
        if (it + 1 < ntiles) {
            a5_load(Kb(cur ^ 1), k, base, k0 + 64, Tn, C);
            a5_load(Vb(cur ^ 1), v, base, k0 + 64, Tn, C);
        }
        cp_async_commit();
        const float mnext = staged && tid < 64 ? mask_at(k0 + 64 + tid) : 0.f;
        float s[4][8];
        tile_dot(s, Qs, Kb(cur));
        float mk[8];                                                  // the thread's 8 columns' mask (si == 0)
        if (staged)
#pragma unroll
            for (int j = 0; j < 8; j++) mk[j] = Ms[cur * 64 + tx + 8 * j];
        a3_softmax_tile(s, o, mi, li, q0, k0, Tn, scale, [&](int j, int row, int col) {
            return staged ? mk[j] : a3_mask(mask, sb, sh, si, sj, b, h, row, col);
        });
        __syncthreads();                                              // every thread is done reading K
        float* Ps = Kb(cur);
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 8; j++) Ps[(ty + 16 * i) * A3_LD + tx + 8 * j] = s[i][j];
        if (staged && tid < 64) Ms[(cur ^ 1) * 64 + tid] = mnext;    // (read after the next tile's first barrier)
        __syncthreads();
        if (thresh) {                                                 // version 3's keep factors
            a3_drop_tile(Ps, bh, Tn, q0, k0, seed, stream, thresh);
            __syncthreads();
        }
        tile_pv(o, Ps, Vb(cur));
    }
    a3_store_out(o, mi, li, out, m_out, linv_out, base, bh, q0, Tn, C, dscale);
}
#endif  // HALF_TYPES

// ----------------------------------------------------------------------------------------------------------------
// backward

// D[bh, i] = dout_i . out_i: a warp per row, grid ceil(B H T / 8), 256 threads
extern "C" __global__ void __launch_bounds__(256) attn_bwd_D_v3_f32(const float* __restrict__ dout,
                                                                    const float* __restrict__ out, int B, int Tn,
                                                                    int H, float* __restrict__ Dr) {
    const int row = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= B * H * Tn) return;
    const int i = row % Tn, bh = row / Tn, b = bh / H, h = bh % H, C = H * A3_HS;
    const size_t off = ((size_t)b * Tn + i) * C + h * A3_HS;
    const float s = warp_sum(dout[off + lane] * out[off + lane] + dout[off + lane + 32] * out[off + lane + 32]);
    if (lane == 0) Dr[row] = s;
}

// Which (query row r, key group c4 .. c4 + 3) of the 64 x 64 tile the t-th float4 of thread tid is, in a3_dkdv's
// pass that reads P and dP row-wise and writes (p z)^T and ds^T column-wise. Versions 3 and 4 (XT false): 16
// threads along a row, r = g / 16, c4 = 4 (g % 16), g = tid + 128 t: a warp's transposed store then hits 4 banks
// (address (c4 + e) 68 + r; 68 = 4 mod 32, so bank 16 (c4 / 4 odd) + 4 e + r, r one of two rows), an 8-way
// conflict, which ncu measured on the H100 (2026-11-28: 70% of version 4's shared-store wavefronts, 4.5-way on
// average). Version 6 (XT true): a warp along a column, r = g % 64, c4 = 4 (g / 64): its row-wise float4 reads
// start at 8 distinct bank quads (r 68 = 4 r mod 32) and its transposed stores at 32 consecutive banks, both free
// of conflicts. Every element gets the same arithmetic either way, so the same bits; only who computes it moves.
template <bool XT>
__device__ __forceinline__ void a3_xt_cell(int g, int& r, int& c4) {
    if constexpr (XT) { r = g & 63; c4 = (g >> 6) * 4; }
    else { r = g >> 4; c4 = (g & 15) * 4; }
}

// dk, dv of the block's 64 keys (versions 3, 4, 6, 7 and 8); PARTS (versions 4, 6, 7 and 8): also the block's
// share of dq for every query tile, dq_part[kt][b H + h][i][:] = sum over its keys of ds_ij k_j (unscaled), kt =
// blockIdx.x; XT (versions 6, 7 and 8): the transposing pass's cells laid out for conflict-free shared stores
// (a3_xt_cell); kt0 (versions 7 and 8; 0 elsewhere): the block's keys are tile kt0 + blockIdx.x (its partials
// still at blockIdx.x); LEAN (version 8): no dropout (thresh 0, dscale 1) and a mask constant along the queries
// (si = 0): p and ds^T written transposed from the registers that hold S^T and dP^T, no pass between; sm: the
// kernel's dynamic shared memory (A3_BWD_SMEM bytes)
template <bool PARTS, bool XT, bool LEAN = false>
__device__ __forceinline__ void a3_dkdv(A3_ARGS, const float* __restrict__ m, const float* __restrict__ linv,
                                        const float* __restrict__ dout, const float* __restrict__ Dr,
                                        float* __restrict__ dk, float* __restrict__ dv, float* __restrict__ parts,
                                        float* sm, int kt0 = 0) {
    float *Ks = sm, *Vs = sm + A3_TILE, *Qs = sm + 2 * A3_TILE, *dOs = sm + 3 * A3_TILE, *Pa = sm + 4 * A3_TILE,
          *Pb = sm + 5 * A3_TILE, *mrow = sm + 6 * A3_TILE, *lrow = mrow + 64, *drow = lrow + 64;
    const int tid = threadIdx.x, ty = tid >> 3, tx = tid & 7, bh = blockIdx.y, b = bh / H, h = bh % H;
    const int C = H * A3_HS, k0 = (kt0 + blockIdx.x) * 64;
    const size_t base = (size_t)b * Tn * C + h * A3_HS;
    a3_load(Ks, k, base, k0, Tn, C);
    a3_load(Vs, v, base, k0, Tn, C);
    float dka[4][8], dva[4][8];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) { dka[i][j] = 0.f; dva[i][j] = 0.f; }
    // LEAN: the additive term of each of the thread's key columns ty + 16 i, read once for every query tile (the
    // mask, or 0 where there is none; -inf past T, so that p = exp(-inf) 1/l = 0 there without a test)
    float madd[4];
    if constexpr (LEAN) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int c = k0 + ty + 16 * i;
            madd[i] = c < Tn ? a3_mask(mask, sb, sh, 0, sj, b, h, 0, c) : -INFINITY;
        }
    }
    for (int q0 = 0; q0 < Tn; q0 += 64) {
        __syncthreads();
        a3_load(Qs, q, base, q0, Tn, C);
        a3_load(dOs, dout, base, q0, Tn, C);
        if (tid < 64) {                      // (LEAN: m = +inf past T, so exp(s - m) = 0 there without a test)
            const int r = q0 + tid;
            mrow[tid] = r < Tn ? m[(size_t)bh * Tn + r] : (LEAN ? INFINITY : 0.f);
            lrow[tid] = r < Tn ? linv[(size_t)bh * Tn + r] : 0.f;
            drow[tid] = r < Tn ? Dr[(size_t)bh * Tn + r] : 0.f;
        }
        __syncthreads();
        {
            float st[4][8], dpt[4][8];                                // [key ty + 16 i][query tx + 8 j]
            tile_dot(st, Ks, Qs);
            tile_dot(dpt, Vs, dOs);
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    const int cl = ty + 16 * i, rl = tx + 8 * j, c = k0 + cl, r = q0 + rl;
                    if constexpr (LEAN) {
                        // version 6's p and ds with z = 1, dscale = 1 (its p z = p 1 and ds = p (dp 1 - D): the
                        // same bits), stored where its transposing pass stores them, [key][query]
                        const float p = __expf(st[i][j] * scale + madd[i] - mrow[rl]) * lrow[rl];
                        Pa[cl * A3_LD + rl] = p;                      // (p z)^T
                        Pb[cl * A3_LD + rl] = p * (dpt[i][j] - drow[rl]);   // ds^T
                    } else {
                        const float p = (c < Tn && r < Tn)
                            ? __expf(st[i][j] * scale + a3_mask(mask, sb, sh, si, sj, b, h, r, c) - mrow[rl]) *
                                  lrow[rl]
                            : 0.f;
                        Pa[rl * A3_LD + cl] = p;                      // [query][key]: 4 keys share a Philox call
                        Pb[rl * A3_LD + cl] = dpt[i][j];
                    }
                }
        }
        if constexpr (!LEAN) {                                        // (versions 3-7: the pass between)
        __syncthreads();
        float pz[8][4], ds[8][4];
#pragma unroll
        for (int t = 0; t < 8; t++) {
            int r, c4;
            a3_xt_cell<XT>(tid + A3_NT * t, r, c4);
            const float4 p = ld4(Pa + r * A3_LD + c4), dp = ld4(Pb + r * A3_LD + c4);
            const float4 z = thresh ? a3_keep(((u64)bh * Tn + (q0 + r)) * Tn + k0 + c4, seed, stream, thresh)
                                    : make_float4(1.f, 1.f, 1.f, 1.f);
            const float D = drow[r];
            const float pp[4] = {p.x, p.y, p.z, p.w}, dd[4] = {dp.x, dp.y, dp.z, dp.w}, zz[4] = {z.x, z.y, z.z, z.w};
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float zs = zz[e] * dscale;
                pz[t][e] = pp[e] * zs;
                ds[t][e] = pp[e] * (dd[e] * zs - D);
            }
        }
        __syncthreads();                                              // every tile read: write them transposed
#pragma unroll
        for (int t = 0; t < 8; t++) {
            int r, c4;
            a3_xt_cell<XT>(tid + A3_NT * t, r, c4);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                Pa[(c4 + e) * A3_LD + r] = pz[t][e];                  // (p z)^T: [key][query]
                Pb[(c4 + e) * A3_LD + r] = ds[t][e];                  // ds^T
            }
        }
        }                                                             // (!LEAN)
        __syncthreads();
        tile_pv(dva, Pa, dOs);                                        // dv[key][:] += sum_r (p z)[r][key] dout_r
        tile_pv(dka, Pb, Qs);                                         // dk[key][:] += sum_r ds[r][key] q_r
        if constexpr (PARTS) {                                        // (no barrier: Pb and Ks are only read)
            float dqp[4][8];
            tile_tpv(dqp, Pb, Ks);                                    // dq_part[r][:] = sum_key ds[r][key] k_key
            float* dst = parts + (((size_t)blockIdx.x * gridDim.y + bh) * Tn + q0) * A3_HS;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int r = 4 * ty + i;
                if (q0 + r >= Tn) continue;
#pragma unroll
                for (int kk = 0; kk < 2; kk++)
                    st4(dst + r * A3_HS + 4 * tx + 32 * kk,
                        make_float4(dqp[i][4 * kk], dqp[i][4 * kk + 1], dqp[i][4 * kk + 2], dqp[i][4 * kk + 3]));
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int c = k0 + ty + 16 * i;
        if (c >= Tn) continue;
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            const size_t off = base + (size_t)c * C + 4 * tx + 32 * kk;
            st4(dk + off, make_float4(dka[i][4 * kk] * scale, dka[i][4 * kk + 1] * scale, dka[i][4 * kk + 2] * scale,
                                      dka[i][4 * kk + 3] * scale));
            st4(dv + off, make_float4(dva[i][4 * kk], dva[i][4 * kk + 1], dva[i][4 * kk + 2], dva[i][4 * kk + 3]));
        }
    }
}

// dk, dv: grid (ceil(T / 64), B * H), 128 threads, A3_BWD_SMEM bytes
extern "C" __global__ void __launch_bounds__(A3_NT) attn_bwd_dkdv_v3_f32_hs64(
    A3_ARGS, const float* __restrict__ m, const float* __restrict__ linv, const float* __restrict__ dout,
    const float* __restrict__ Dr, float* __restrict__ dk, float* __restrict__ dv) {
    DYN_SHARED(float, sm);
    a3_dkdv<false, false>(A3_PASS, m, linv, dout, Dr, dk, dv, nullptr, sm);
}

// dq: grid (ceil(T / 64), B * H), 128 threads, A3_BWD_SMEM bytes
extern "C" __global__ void __launch_bounds__(A3_NT) attn_bwd_dq_v3_f32_hs64(
    A3_ARGS, const float* __restrict__ m, const float* __restrict__ linv, const float* __restrict__ dout,
    const float* __restrict__ Dr, float* __restrict__ dq) {
    DYN_SHARED(float, sm);
    float *Qs = sm, *dOs = sm + A3_TILE, *Ks = sm + 2 * A3_TILE, *Vs = sm + 3 * A3_TILE, *Pa = sm + 4 * A3_TILE,
          *Pb = sm + 5 * A3_TILE, *drow = sm + 6 * A3_TILE;
    const int tid = threadIdx.x, ty = tid >> 3, tx = tid & 7, bh = blockIdx.y, b = bh / H, h = bh % H;
    const int C = H * A3_HS, q0 = blockIdx.x * 64;
    const size_t base = (size_t)b * Tn * C + h * A3_HS;
    a3_load(Qs, q, base, q0, Tn, C);
    a3_load(dOs, dout, base, q0, Tn, C);
    if (tid < 64) drow[tid] = q0 + tid < Tn ? Dr[(size_t)bh * Tn + q0 + tid] : 0.f;
    float mi[4], li[4], dqa[4][8];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int r = q0 + ty + 16 * i;
        mi[i] = r < Tn ? m[(size_t)bh * Tn + r] : 0.f;
        li[i] = r < Tn ? linv[(size_t)bh * Tn + r] : 0.f;
#pragma unroll
        for (int j = 0; j < 8; j++) dqa[i][j] = 0.f;
    }
    for (int k0 = 0; k0 < Tn; k0 += 64) {
        __syncthreads();
        a3_load(Ks, k, base, k0, Tn, C);
        a3_load(Vs, v, base, k0, Tn, C);
        __syncthreads();
        {
            float s[4][8], dp[4][8];                                  // [query ty + 16 i][key tx + 8 j]
            tile_dot(s, Qs, Ks);
            tile_dot(dp, dOs, Vs);
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    const int rl = ty + 16 * i, cl = tx + 8 * j, r = q0 + rl, c = k0 + cl;
                    Pa[rl * A3_LD + cl] = (r < Tn && c < Tn)
                        ? __expf(s[i][j] * scale + a3_mask(mask, sb, sh, si, sj, b, h, r, c) - mi[i]) * li[i] : 0.f;
                    Pb[rl * A3_LD + cl] = dp[i][j];
                }
        }
        __syncthreads();
#pragma unroll
        for (int t = 0; t < 8; t++) {                                 // ds in place (each group: one thread)
            const int g = tid + A3_NT * t, r = g >> 4, c4 = (g & 15) * 4;
            const float4 p = ld4(Pa + r * A3_LD + c4), d = ld4(Pb + r * A3_LD + c4);
            const float4 z = thresh ? a3_keep(((u64)bh * Tn + (q0 + r)) * Tn + k0 + c4, seed, stream, thresh)
                                    : make_float4(1.f, 1.f, 1.f, 1.f);
            const float D = drow[r];
            st4(Pa + r * A3_LD + c4, make_float4(p.x * (d.x * (z.x * dscale) - D), p.y * (d.y * (z.y * dscale) - D),
                                                 p.z * (d.z * (z.z * dscale) - D), p.w * (d.w * (z.w * dscale) - D)));
        }
        __syncthreads();
        tile_pv(dqa, Pa, Ks);                                         // dq[r][:] += sum_key ds[r][key] k_key
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int r = q0 + ty + 16 * i;
        if (r >= Tn) continue;
#pragma unroll
        for (int kk = 0; kk < 2; kk++)
            st4(dq + base + (size_t)r * C + 4 * tx + 32 * kk,
                make_float4(dqa[i][4 * kk] * scale, dqa[i][4 * kk + 1] * scale, dqa[i][4 * kk + 2] * scale,
                            dqa[i][4 * kk + 3] * scale));
    }
}

// ----------------------------------------------------------------------------------------------------------------
// backward version 4: dk, dv and dq in one pass over the scores (5 tile products a tile pair where version 3's two
// kernels compute 7: S and dP once, not twice), dq summed without atomics

// grid (ceil(T / 64), B * H) = (nkt, B H), 128 threads, A3_BWD_SMEM bytes; parts: (nkt, B H, T, 64) float32
extern "C" __global__ void __launch_bounds__(A3_NT) attn_bwd_fused_v4_f32_hs64(
    A3_ARGS, const float* __restrict__ m, const float* __restrict__ linv, const float* __restrict__ dout,
    const float* __restrict__ Dr, float* __restrict__ dk, float* __restrict__ dv, float* __restrict__ parts) {
    DYN_SHARED(float, sm);
    a3_dkdv<true, false>(A3_PASS, m, linv, dout, Dr, dk, dv, parts, sm);
}

// dq[b, i, h 64 + d] = scale * sum_kt parts[kt][b H + h][i][d], kt = 0, 1, .. in order (the same sum every run): a
// thread per 4 columns, g = ((b T + i) H + h) 16 + d / 4 (dq's own float4 index); grid ceil(B T H 16 / 256)
extern "C" __global__ void __launch_bounds__(256) attn_bwd_dqsum_v4_f32(const float* __restrict__ parts, int nkt,
                                                                        int B, int Tn, int H, float scale,
                                                                        float* __restrict__ dq) {
    const long long g = (long long)blockIdx.x * 256 + threadIdx.x;
    if (g >= (long long)B * Tn * H * 16) return;
    const int d4 = (int)(g & 15), h = (int)((g >> 4) % H), i = (int)((g >> 4) / H % Tn), b = (int)((g >> 4) / H / Tn);
    const size_t stride = (size_t)B * H * Tn * A3_HS;                // one key tile's partials
    const float* p = parts + ((size_t)(b * H + h) * Tn + i) * A3_HS + 4 * d4;
    float4 s = ld4(p);
    for (int kt = 1; kt < nkt; kt++) {
        const float4 t = ld4(p + kt * stride);
        s.x += t.x; s.y += t.y; s.z += t.z; s.w += t.w;
    }
    st4(dq + 4 * g, make_float4(s.x * scale, s.y * scale, s.z * scale, s.w * scale));
}

// ----------------------------------------------------------------------------------------------------------------
// backward version 6: version 4 (and version 3's dk, dv kernel, where C4's partials would not fit) with the
// transposing pass's cells laid out for conflict-free shared stores (a3_xt_cell): the same bits

// as attn_bwd_fused_v4_f32_hs64 (its dq summed by attn_bwd_dqsum_v4_f32)
extern "C" __global__ void __launch_bounds__(A3_NT) attn_bwd_fused_v6_f32_hs64(
    A3_ARGS, const float* __restrict__ m, const float* __restrict__ linv, const float* __restrict__ dout,
    const float* __restrict__ Dr, float* __restrict__ dk, float* __restrict__ dv, float* __restrict__ parts) {
    DYN_SHARED(float, sm);
    a3_dkdv<true, true>(A3_PASS, m, linv, dout, Dr, dk, dv, parts, sm);
}

// as attn_bwd_dkdv_v3_f32_hs64 (dq by attn_bwd_dq_v3_f32_hs64)
extern "C" __global__ void __launch_bounds__(A3_NT) attn_bwd_dkdv_v6_f32_hs64(
    A3_ARGS, const float* __restrict__ m, const float* __restrict__ linv, const float* __restrict__ dout,
    const float* __restrict__ Dr, float* __restrict__ dk, float* __restrict__ dv) {
    DYN_SHARED(float, sm);
    a3_dkdv<false, true>(A3_PASS, m, linv, dout, Dr, dk, dv, nullptr, sm);
}

// ----------------------------------------------------------------------------------------------------------------
// backward version 7: version 6 over groups of key tiles (where all nkt tiles' partials would not fit), dq's sum
// carried from group to group in dq itself: version 6's bits

// grid (G, B * H): key tiles kt0 .. kt0 + G - 1 (G <= nkt - kt0), 128 threads, A3_BWD_SMEM bytes; parts: (G, B H, T,
// 64) float32, the group's
extern "C" __global__ void __launch_bounds__(A3_NT) attn_bwd_fused_v7_f32_hs64(
    A3_ARGS, const float* __restrict__ m, const float* __restrict__ linv, const float* __restrict__ dout,
    const float* __restrict__ Dr, float* __restrict__ dk, float* __restrict__ dv, float* __restrict__ parts,
    int kt0) {
    DYN_SHARED(float, sm);
    a3_dkdv<true, true>(A3_PASS, m, linv, dout, Dr, dk, dv, parts, sm, kt0);
}

// one group's ng partials added in order to the running sum: first, s = parts[0] + parts[1] + ..., else s = dq +
// parts[0] + ...; stored unscaled, or times scale where last (attn_bwd_dqsum_v4_f32's sum, cut at the groups)
extern "C" __global__ void __launch_bounds__(256) attn_bwd_dqsum_v7_f32(const float* __restrict__ parts, int ng,
                                                                        int first, int last, int B, int Tn, int H,
                                                                        float scale, float* __restrict__ dq) {
    const long long g = (long long)blockIdx.x * 256 + threadIdx.x;
    if (g >= (long long)B * Tn * H * 16) return;
    const int d4 = (int)(g & 15), h = (int)((g >> 4) % H), i = (int)((g >> 4) / H % Tn), b = (int)((g >> 4) / H / Tn);
    const size_t stride = (size_t)B * H * Tn * A3_HS;                // one key tile's partials
    const float* p = parts + ((size_t)(b * H + h) * Tn + i) * A3_HS + 4 * d4;
    float4 s = first ? ld4(p) : ld4(dq + 4 * g);
    for (int kt = first ? 1 : 0; kt < ng; kt++) {
        const float4 t = ld4(p + kt * stride);
        s.x += t.x; s.y += t.y; s.z += t.z; s.w += t.w;
    }
    st4(dq + 4 * g, last ? make_float4(s.x * scale, s.y * scale, s.z * scale, s.w * scale) : s);
}

// ----------------------------------------------------------------------------------------------------------------
// backward version 8: version 7's kernel (any group of key tiles, all nkt of them from kt0 = 0 where the partials
// fit) compiled for no dropout and a mask constant along the queries (a3_dkdv LEAN): p and ds^T stored transposed
// straight from the registers of S^T and dP^T, three barriers a tile pair where version 6 has five, the key columns'
// mask read once per block, no bounds tests on the scores. Version 6's bits (its z = 1, dscale = 1 arithmetic).

// grid (ng, B * H): key tiles kt0 .. kt0 + ng - 1, 128 threads, A3_BWD_SMEM bytes; parts: (ng, B H, T, 64) float32;
// thresh 0 and dscale 1 (no dropout), si = 0 (the launcher's conditions; dq summed by attn_bwd_dqsum_v7_f32 group
// by group: one group of all nkt tiles where their partials fit, whose first and last sum is dqsum_v4's)
extern "C" __global__ void __launch_bounds__(A3_NT) attn_bwd_fused_v8_f32_hs64(
    A3_ARGS, const float* __restrict__ m, const float* __restrict__ linv, const float* __restrict__ dout,
    const float* __restrict__ Dr, float* __restrict__ dk, float* __restrict__ dv, float* __restrict__ parts,
    int kt0) {
    DYN_SHARED(float, sm);
    a3_dkdv<true, true, true>(A3_PASS, m, linv, dout, Dr, dk, dv, parts, sm, kt0);
}

// ----------------------------------------------------------------------------------------------------------------
// CPU reference (double sums), launcher, main

#ifdef HOST_CODE
void attention_cpu(const float* q, const float* k, const float* v, const float* mask, const float* dout, int B,
                   int T, int H, float scale, u64 seed, u64 stream, u64 thresh, float dscale, float* out, float* dq,
                   float* dk, float* dv) {
    const int C = H * A3_HS;
    std::vector<double> p(T), z(T), dp(T);
    std::fill(dq, dq + (size_t)B * T * C, 0.f);
    std::fill(dk, dk + (size_t)B * T * C, 0.f);
    std::fill(dv, dv + (size_t)B * T * C, 0.f);
    std::vector<double> gq((size_t)T * A3_HS), gk((size_t)T * A3_HS), gv((size_t)T * A3_HS);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            std::fill(gq.begin(), gq.end(), 0.0); std::fill(gk.begin(), gk.end(), 0.0); std::fill(gv.begin(), gv.end(), 0.0);
            auto at = [&](const float* x, int i, int d) { return (double)x[((size_t)b * T + i) * C + h * A3_HS + d]; };
            for (int i = 0; i < T; i++) {
                double mx = -INFINITY, l = 0, D = 0;
                for (int j = 0; j < T; j++) {
                    double s = 0;
                    for (int d = 0; d < A3_HS; d++) s += at(q, i, d) * at(k, j, d);
                    p[j] = s * scale + mask[b * T + j];
                    mx = std::max(mx, p[j]);
                }
                for (int j = 0; j < T; j++) { p[j] = exp(p[j] - mx); l += p[j]; }
                for (int j = 0; j < T; j++) {
                    p[j] /= l;
                    u64 e = (((u64)b * H + h) * T + i) * T + j;
                    z[j] = thresh == 0 || philox_word_host(e, stream, seed) >= thresh ? dscale : 0.0;
                }
                for (int d = 0; d < A3_HS; d++) {
                    double o = 0;
                    for (int j = 0; j < T; j++) o += p[j] * z[j] * at(v, j, d);
                    out[((size_t)b * T + i) * C + h * A3_HS + d] = (float)o;
                    D += o * at(dout, i, d);
                }
                for (int j = 0; j < T; j++) {
                    double s = 0;
                    for (int d = 0; d < A3_HS; d++) s += at(dout, i, d) * at(v, j, d);
                    dp[j] = s * z[j];
                }
                for (int j = 0; j < T; j++) {
                    const double ds = p[j] * (dp[j] - D);
                    for (int d = 0; d < A3_HS; d++) {
                        gv[(size_t)j * A3_HS + d] += p[j] * z[j] * at(dout, i, d);
                        gq[(size_t)i * A3_HS + d] += scale * ds * at(k, j, d);
                        gk[(size_t)j * A3_HS + d] += scale * ds * at(q, i, d);
                    }
                }
            }
            for (int i = 0; i < T; i++)
                for (int d = 0; d < A3_HS; d++) {
                    const size_t o = ((size_t)b * T + i) * C + h * A3_HS + d;
                    dq[o] = (float)gq[(size_t)i * A3_HS + d]; dk[o] = (float)gk[(size_t)i * A3_HS + d];
                    dv[o] = (float)gv[(size_t)i * A3_HS + d];
                }
        }
}

static float* dalloc(const float* h, size_t n) {
    float* d;
    cudaCheck(cudaMalloc(&d, n * sizeof(float)));
    if (h) cudaCheck(cudaMemcpy(d, h, n * sizeof(float), cudaMemcpyHostToDevice));
    return d;
}

int main(int argc, char** argv) {
#ifdef CPUSIM_SMALL
    // B, T, H: tails of both tiles, T % 4 != 0 (a Philox call per key), T = 1; T % 4 == 0 with a tile of padding
    // and three key tiles (a double buffer refilled while the other is in use)
    const int shapes[][3] = {{2, 70, 2}, {1, 1, 1}, {1, 66, 1}, {2, 136, 1}};
#else
    const int shapes[][3] = {{2, 70, 2}, {1, 1, 1}, {8, 512, 12}, {2, argc > 1 ? atoi(argv[1]) : 2048, 12}};
#endif
    for (auto& sh : shapes) {
        const int B = sh[0], T = sh[1], H = sh[2], C = H * A3_HS;
        const size_t n = (size_t)B * T * C, nr = (size_t)B * H * T;
        const float p = argc > 2 ? (float)atof(argv[2]) : 0.1f, dscale = 1.f / (1.f - p), scale = 0.125f;
        const u64 seed = 1234, stream = 7, thresh = (u64)llround(p * 4294967296.0);
        float *q = make_random_float(n, 1), *k = make_random_float(n, 2), *v = make_random_float(n, 3);
        float* dout = make_random_float(n, 4);
        std::vector<float> mask((size_t)B * T);                       // (B, 1, 1, T): right padding, HF's finfo.min
        for (int b = 0; b < B; b++)
            for (int j = 0; j < T; j++) mask[b * T + j] = j < (b % 2 ? (T + 1) / 2 : T) ? 0.f : -3.4028235e38f;
        const bool small = (double)B * H * T * T <= 4e7;
        std::vector<float> out(n), dq(n), dk(n), dv(n);
        if (small) attention_cpu(q, k, v, mask.data(), dout, B, T, H, scale, seed, stream, thresh, dscale, out.data(),
                                 dq.data(), dk.data(), dv.data());
        float *dq_ = dalloc(q, n), *dk_ = dalloc(k, n), *dv_ = dalloc(v, n), *ddo = dalloc(dout, n);
        float *dm = dalloc(mask.data(), (size_t)B * T), *o_ = dalloc(nullptr, n), *m_ = dalloc(nullptr, nr);
        float *l_ = dalloc(nullptr, nr), *D_ = dalloc(nullptr, nr), *gq = dalloc(nullptr, n), *gk = dalloc(nullptr, n);
        float* gv = dalloc(nullptr, n);
        cudaCheck(cudaFuncSetAttribute(attn_fwd_v3_f32_hs64, cudaFuncAttributeMaxDynamicSharedMemorySize, A3_FWD_SMEM));
        cudaCheck(cudaFuncSetAttribute(attn_bwd_dkdv_v3_f32_hs64, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       A3_BWD_SMEM));
        cudaCheck(cudaFuncSetAttribute(attn_bwd_dq_v3_f32_hs64, cudaFuncAttributeMaxDynamicSharedMemorySize, A3_BWD_SMEM));
        cudaCheck(cudaFuncSetAttribute(attn_bwd_fused_v4_f32_hs64, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       A3_BWD_SMEM));
        cudaCheck(cudaFuncSetAttribute(attn_bwd_fused_v6_f32_hs64, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       A3_BWD_SMEM));
        cudaCheck(cudaFuncSetAttribute(attn_bwd_dkdv_v6_f32_hs64, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       A3_BWD_SMEM));
        cudaCheck(cudaFuncSetAttribute(attn_bwd_fused_v7_f32_hs64, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       A3_BWD_SMEM));
        cudaCheck(cudaFuncSetAttribute(attn_bwd_fused_v8_f32_hs64, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       A3_BWD_SMEM));
        const int nkt = (T + 63) / 64;
        float* parts = dalloc(nullptr, (size_t)nkt * nr * A3_HS);
        const dim3 grid((T + 63) / 64, B * H);
        auto fwd = [&]() {
            LAUNCH_SMEM(attn_fwd_v3_f32_hs64, grid, A3_NT, A3_FWD_SMEM, dq_, dk_, dv_, dm, (long long)T, 0LL, 0LL, 1LL,
                        B, T, H, scale, seed, stream, thresh, dscale, o_, m_, l_);
        };
        auto bwd = [&]() {
            LAUNCH(attn_bwd_D_v3_f32, (int)((nr + 7) / 8), 256, ddo, o_, B, T, H, D_);
            LAUNCH_SMEM(attn_bwd_dkdv_v3_f32_hs64, grid, A3_NT, A3_BWD_SMEM, dq_, dk_, dv_, dm, (long long)T, 0LL, 0LL,
                        1LL, B, T, H, scale, seed, stream, thresh, dscale, m_, l_, ddo, D_, gk, gv);
            LAUNCH_SMEM(attn_bwd_dq_v3_f32_hs64, grid, A3_NT, A3_BWD_SMEM, dq_, dk_, dv_, dm, (long long)T, 0LL, 0LL,
                        1LL, B, T, H, scale, seed, stream, thresh, dscale, m_, l_, ddo, D_, gq);
        };
#ifdef HALF_TYPES
        cudaCheck(cudaFuncSetAttribute(attn_fwd_v5_f32_hs64, cudaFuncAttributeMaxDynamicSharedMemorySize, A5_FWD_SMEM));
        float *o5 = dalloc(nullptr, n), *m5 = dalloc(nullptr, nr), *l5 = dalloc(nullptr, nr);
        auto fwd5 = [&]() {
            LAUNCH_SMEM(attn_fwd_v5_f32_hs64, grid, A3_NT, A5_FWD_SMEM, dq_, dk_, dv_, dm, (long long)T, 0LL, 0LL, 1LL,
                        B, T, H, scale, seed, stream, thresh, dscale, o5, m5, l5);
        };
#endif
        auto bwd4 = [&]() {
            LAUNCH(attn_bwd_D_v3_f32, (int)((nr + 7) / 8), 256, ddo, o_, B, T, H, D_);
            LAUNCH_SMEM(attn_bwd_fused_v4_f32_hs64, grid, A3_NT, A3_BWD_SMEM, dq_, dk_, dv_, dm, (long long)T, 0LL,
                        0LL, 1LL, B, T, H, scale, seed, stream, thresh, dscale, m_, l_, ddo, D_, gk, gv, parts);
            LAUNCH(attn_bwd_dqsum_v4_f32, (int)((n / 4 + 255) / 256), 256, parts, nkt, B, T, H, scale, gq);
        };
        auto bwd6 = [&]() {                                           // version 4 with conflict-free transposes
            LAUNCH(attn_bwd_D_v3_f32, (int)((nr + 7) / 8), 256, ddo, o_, B, T, H, D_);
            LAUNCH_SMEM(attn_bwd_fused_v6_f32_hs64, grid, A3_NT, A3_BWD_SMEM, dq_, dk_, dv_, dm, (long long)T, 0LL,
                        0LL, 1LL, B, T, H, scale, seed, stream, thresh, dscale, m_, l_, ddo, D_, gk, gv, parts);
            LAUNCH(attn_bwd_dqsum_v4_f32, (int)((n / 4 + 255) / 256), 256, parts, nkt, B, T, H, scale, gq);
        };
        int G7 = 1;                                                   // the key tiles a group
        bool v8 = false;                                              // version 8's kernel (no dropout) or 7's
        auto bwd7 = [&]() {                                           // version 6 in groups of G7 key tiles
            LAUNCH(attn_bwd_D_v3_f32, (int)((nr + 7) / 8), 256, ddo, o_, B, T, H, D_);
            for (int kt0 = 0; kt0 < nkt; kt0 += G7) {
                const int ng = std::min(G7, nkt - kt0);
                auto* fused = v8 ? attn_bwd_fused_v8_f32_hs64 : attn_bwd_fused_v7_f32_hs64;   // (one signature)
                LAUNCH_SMEM(fused, dim3(ng, B * H), A3_NT, A3_BWD_SMEM, dq_, dk_, dv_, dm, (long long)T, 0LL, 0LL, 1LL,
                            B, T, H, scale, seed, stream, thresh, dscale, m_, l_, ddo, D_, gk, gv, parts, kt0);
                LAUNCH(attn_bwd_dqsum_v7_f32, (int)((n / 4 + 255) / 256), 256, parts, ng, (int)(kt0 == 0),
                       (int)(kt0 + ng >= nkt), B, T, H, scale, gq);
            }
        };
        auto dkdv6 = [&]() {                                          // version 3's dk, dv, the same way
            LAUNCH_SMEM(attn_bwd_dkdv_v6_f32_hs64, grid, A3_NT, A3_BWD_SMEM, dq_, dk_, dv_, dm, (long long)T, 0LL,
                        0LL, 1LL, B, T, H, scale, seed, stream, thresh, dscale, m_, l_, ddo, D_, gk, gv);
        };
        // dq, dk, dv as the kernels `run` launches leave them, read back (3 n floats: dq, then dk, then dv)
        auto grads = [&](auto run) {
            run();
            cudaCheck(cudaGetLastError());
            cudaCheck(cudaDeviceSynchronize());
            std::vector<float> g(3 * n);
            cudaCheck(cudaMemcpy(g.data(), gq, n * 4, cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(g.data() + n, gk, n * 4, cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(g.data() + 2 * n, gv, n * 4, cudaMemcpyDeviceToHost));
            return g;
        };
        fwd();
#ifdef HALF_TYPES
        // forward version 5 moves version 3's loads off the critical path: its out, m and 1/l bits, or it is wrong
        fwd5();
        cudaCheck(cudaDeviceSynchronize());
        bool same5 = true;
        for (auto pr : {std::make_pair(o_, o5), std::make_pair(m_, m5), std::make_pair(l_, l5)}) {
            const size_t cnt = pr.first == o_ ? n : nr;
            std::vector<float> a(cnt), c(cnt);
            cudaCheck(cudaMemcpy(a.data(), pr.first, cnt * 4, cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(c.data(), pr.second, cnt * 4, cudaMemcpyDeviceToHost));
            same5 &= std::memcmp(a.data(), c.data(), cnt * 4) == 0;
        }
        printf("  v5 forward = v3 forward bit for bit (out, m, 1/l): %s\n", same5 ? "yes" : "NO");
        if (!same5) exit(EXIT_FAILURE);
#endif
        // version 6 against version 4 (dq, dk, dv) and its dk, dv kernel against version 3's: the same bits, or the
        // transposing pass's cells are not all written, or written twice
        // (and version 7, version 6 in groups of 1 and 2 key tiles, against version 6: the same bits, or a group's
        // sum is not carried over in order)
        bool same7 = true;
        for (G7 = 1; G7 <= 2; G7++) {
            const std::vector<float> g7 = grads(bwd7), g6 = grads(bwd6);
            same7 &= std::memcmp(g7.data(), g6.data(), 3 * n * 4) == 0;
        }
        printf("  v7 = v6 bit for bit (dq, dk, dv; groups of 1 and 2 key tiles): %s\n", same7 ? "yes" : "NO");
        if (!same7) exit(EXIT_FAILURE);
        // version 8 (no dropout, the mask constant along the queries) against version 6: the same bits, all key
        // tiles at once and in groups of 1 and 2, or its p, ds or their transposed cells are not version 6's
        // (one group of all nkt: dqsum_v7's first and last sum is dqsum_v4's, as the launcher runs it)
        if (thresh == 0) {
            bool same8 = true;
            const std::vector<float> g6p = grads(bwd6);
            v8 = true;
            for (int g : {nkt, 1, 2}) {
                G7 = g;
                same8 &= std::memcmp(grads(bwd7).data(), g6p.data(), 3 * n * 4) == 0;
            }
            v8 = false;
            printf("  v8 = v6 bit for bit (dq, dk, dv; all key tiles, groups of 1 and 2): %s\n", same8 ? "yes" : "NO");
            if (!same8) exit(EXIT_FAILURE);
        } else {
            printf("  v8 skipped: its kernel runs without dropout (./attention_f32 T 0 runs it)\n");
        }
        const std::vector<float> g6 = grads(bwd6), g4 = grads(bwd4);   // (version 4 last: its results kept below)
        const std::vector<float> g6kv = grads(dkdv6);                 // (gq: still version 4's)
        const bool same6 = std::memcmp(g6.data(), g4.data(), 3 * n * 4) == 0;
        printf("  v6 = v4 bit for bit (dq, dk, dv): %s\n", same6 ? "yes" : "NO");
        if (!same6) exit(EXIT_FAILURE);
        const std::vector<float> gq4(g4.begin(), g4.begin() + n), gk4(g4.begin() + n, g4.begin() + 2 * n),
            gv4(g4.begin() + 2 * n, g4.end());
        bwd();
        cudaCheck(cudaGetLastError());
        cudaCheck(cudaDeviceSynchronize());
        printf("attention v3 f32 B=%d T=%d H=%d hs=64 dropout %.1f\n", B, T, H, p);
        if (small) {
            // float32 sums of 64 and T terms in another order than the double reference, __expf (2 ulp), online
            // rescaling: ~1e-6 relative on O(1) outputs; the gradients sum T such terms
            validate_result(o_, out.data(), "v3 out", n, 1e-5f, 1e-4f);
            validate_result(gq, dq.data(), "v3 dq", n, 1e-4f, 1e-3f);
            validate_result(gk, dk.data(), "v3 dk", n, 1e-4f, 1e-3f);
            validate_result(gv, dv.data(), "v3 dv", n, 1e-4f, 1e-3f);
        }
        // version 4 against version 3 (the reference where there is none: the big shapes): dk and dv are the same
        // kernel body's (the same bits), dq the same products summed in another order (key tiles, then x scale)
        std::vector<float> gq3(n), gk3(n), gv3(n);
        cudaCheck(cudaMemcpy(gq3.data(), gq, n * 4, cudaMemcpyDeviceToHost));
        cudaCheck(cudaMemcpy(gk3.data(), gk, n * 4, cudaMemcpyDeviceToHost));
        cudaCheck(cudaMemcpy(gv3.data(), gv, n * 4, cudaMemcpyDeviceToHost));
        size_t kv_diff = 0;
        for (size_t e = 0; e < n; e++) kv_diff += (gk4[e] != gk3[e]) + (gv4[e] != gv3[e]);
        printf("  v4 dk, dv = v3 dk, dv bit for bit: %s\n", kv_diff ? "NO" : "yes");
        if (kv_diff) { printf("  %zu elements differ\n", kv_diff); exit(EXIT_FAILURE); }
        const bool kv6 = std::memcmp(g6kv.data() + n, gk3.data(), n * 4) == 0 &&
                         std::memcmp(g6kv.data() + 2 * n, gv3.data(), n * 4) == 0;
        printf("  v6 dk, dv = v3 dk, dv bit for bit: %s\n", kv6 ? "yes" : "NO");
        if (!kv6) exit(EXIT_FAILURE);
        cudaCheck(cudaMemcpy(gq, gq4.data(), n * 4, cudaMemcpyHostToDevice));   // v4's dq, judged on the host
        validate_result(gq, small ? dq.data() : gq3.data(), small ? "v4 dq" : "v4 dq against v3", n, 1e-4f, 1e-3f);
        const float ms_f = benchmark_kernel(10, fwd), ms_b = benchmark_kernel(10, bwd);
        const float ms_b4 = benchmark_kernel(10, bwd4), ms_b6 = benchmark_kernel(10, bwd6);
        const double fl = 4.0 * B * H * (double)T * T * A3_HS;
        printf("  v3 f32: forward %.4f ms %.1f TFLOP/s | backward %.4f ms %.1f TFLOP/s (2.5x the forward's FLOPs)\n",
               ms_f, fl / ms_f / 1e9, ms_b, 2.5 * fl / ms_b / 1e9);
        printf("  v4 f32: backward %.4f ms %.1f TFLOP/s (dq partials %.0f MB)\n", ms_b4, 2.5 * fl / ms_b4 / 1e9,
               (double)nkt * nr * A3_HS * 4 / 1e6);
        printf("  v6 f32: backward %.4f ms %.1f TFLOP/s (version 4, conflict-free transposes)\n", ms_b6,
               2.5 * fl / ms_b6 / 1e9);
        G7 = (nkt + 1) / 2;                                           // (two groups: half the partials)
        const float ms_b7 = benchmark_kernel(10, bwd7);
        printf("  v7 f32: backward %.4f ms %.1f TFLOP/s (version 6 in %d groups of %d key tiles)\n", ms_b7,
               2.5 * fl / ms_b7 / 1e9, (nkt + G7 - 1) / G7, G7);
        if (thresh == 0) {
            G7 = nkt;                                                 // (all key tiles at once, as at T = 512)
            v8 = true;
            const float ms_b8 = benchmark_kernel(10, bwd7);
            v8 = false;
            printf("  v8 f32: backward %.4f ms %.1f TFLOP/s (version 6 without dropout's pass)\n", ms_b8,
                   2.5 * fl / ms_b8 / 1e9);
        }
#ifdef HALF_TYPES
        const float ms_f5 = benchmark_kernel(10, fwd5);
        printf("  v5 f32: forward %.4f ms %.1f TFLOP/s\n", ms_f5, fl / ms_f5 / 1e9);
        for (float* d : {o5, m5, l5}) cudaFree(d);
#endif
        free(q); free(k); free(v); free(dout);
        for (float* d : {dq_, dk_, dv_, ddo, dm, o_, m_, l_, D_, gq, gk, gv, parts}) cudaFree(d);
    }
    printf("attention_f32: every version ok\n");
    return 0;
}
#endif
