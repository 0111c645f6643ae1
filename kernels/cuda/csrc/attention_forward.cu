/*
Flash attention forward: out = dropout(softmax(q k^T / sqrt(hs) + mask)) v per head, keeping (m, 1/l) per row.
Oracle: refbert.ops.attention_forward (Python launchers: kernels/cuda/cuda_c.py; Numba versions and the math:
kernels/cuda/attention.py).

q, k, v, out: (B, T, C) storage T (float / __half / __nv_bfloat16), head h = columns h*hs .. h*hs + hs - 1.
mask: float32, indexed mask[b*sb + h*sh + i*si + j*sj] (a stride is 0 on a broadcast axis; nullptr = no mask).
m, linv: (B, H, T) float32, the row max of s = scale q.k + mask and 1 / sum_j exp(s_ij - m_i) — what the
backward needs to recompute p (not the logsumexp: finfo.min padding rows would lose their 1/T, see attention.py).
Dropout keeps element e = ((b*H + h)*T + i)*T + j of (B, H, T, T) iff its Philox4x32-10 word (seed, stream)
>= thresh (refbert/philox.py); kept probabilities are scaled by dscale = 1/(1-p); thresh = 0: no dropout.

Versions:
  1  scalar flash (any storage, hs in {32, 64, 128}): a block per (b, h, 64-query tile), a thread per query row
     with q_i and its output accumulator in registers, 32-key K/V tiles in shared memory, online softmax
     (running max m and sum l, rescaled by exp(m - m') when the max grows). The Numba version 2 in C.
  2  tensor cores, FlashAttention-2 structure (fp16 / bf16, hs = 64): a CTA of 4 warps per (b, h, 64-query tile),
     each warp owning 16 query rows; Q kept as mma A fragments in registers; 64-key K/V tiles double-buffered in
     shared memory with cp.async (the next tile streams in while this one is used); S = Q K^T and O += P V by
     mma.sync.m16n8k16 with fp32 accumulators; online softmax on the S fragments (row max / sum over the 4 threads
     of a quad by shuffles); P re-packed from the S accumulators straight into A fragments (no shared memory);
     the padding mask added to S; dropout from Philox on the fragments (one Philox call per pair of elements).
  3  version 2 with BERT's padding skipped: under a mask constant along the queries (si == 0), a key tile whose 64
     keys are all padding (mask <= -1e30: finfo(float32).min, -inf) is not computed once every row of the block has
     met a real key (common.cuh keys_all_padding: exp gives exact zeros there), so the same bits as version 2
     (the main compares them bit for bit) for less work on padded batches.
  4, 5  version 3's arithmetic and bits with less shared-memory and integer work (ldmatrix fragments, the mask row
     once a key tile, a Philox call per 4 keys; 5: 128 query rows a block): see flash_fwd_tc4.
  6  version 5 without dropout with each score's work cut to its arithmetic (no bounds tests, the key tile's
     additive terms read once per two columns, exp by ex2.approx.ftz): version 5's bits wherever no probability
     falls below 2^-126; flash_fwd_tc4<T, 2, true>. Written without a GPU (2026-11-28), not yet timed.

Build and run standalone (validates every version against the CPU reference, then times them):
    nvcc -O3 -arch=sm_90 -std=c++17 -o attention_forward attention_forward.cu && ./attention_forward [T [p]]
Compile check only (what tests/test_cuda_nvcc.py does):  nvcc -arch=sm_90 -std=c++17 -c attention_forward.cu
*/
#include "common.cuh"

// ----------------------------------------------------------------------------------------------------------------
// CPU code reference

#ifdef HOST_CODE
void attention_forward_cpu(const float* q, const float* k, const float* v, const float* mask, long long sb,
                           long long sh, long long si, long long sj, int B, int T, int H, int hs, float scale,
                           u64 seed, u64 stream, u64 thresh, float dscale, float* out, float* m, float* linv) {
    int C = H * hs;
    std::vector<float> s(T);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < T; i++) {
                const float* qi = q + ((size_t)b * T + i) * C + h * hs;
                float mx = -INFINITY;
                for (int j = 0; j < T; j++) {                 // s_ij = scale q_i . k_j + mask_ij
                    const float* kj = k + ((size_t)b * T + j) * C + h * hs;
                    float a = 0.f;
                    for (int d = 0; d < hs; d++) a += qi[d] * kj[d];
                    s[j] = a * scale + (mask ? mask[b * sb + h * sh + i * si + j * sj] : 0.f);
                    mx = fmaxf(mx, s[j]);
                }
                float l = 0.f;
                for (int j = 0; j < T; j++) { s[j] = expf(s[j] - mx); l += s[j]; }
                float* o = out + ((size_t)b * T + i) * C + h * hs;
                for (int d = 0; d < hs; d++) o[d] = 0.f;
                for (int j = 0; j < T; j++) {                 // out_i = sum_j p_ij z_ij v_j
                    u64 e = (((u64)b * H + h) * T + i) * T + j;
                    float pz = s[j] / l * (thresh == 0 || philox_word_host(e, stream, seed) >= thresh ? dscale : 0.f);
                    const float* vj = v + ((size_t)b * T + j) * C + h * hs;
                    for (int d = 0; d < hs; d++) o[d] += pz * vj[d];
                }
                m[((size_t)b * H + h) * T + i] = mx;
                linv[((size_t)b * H + h) * T + i] = 1.f / l;
            }
}
#endif

// ----------------------------------------------------------------------------------------------------------------
// GPU kernels

#define FWD_ARGS(T)                                                                                             \
    const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v, const float *__restrict__ mask,   \
        long long sb, long long sh, long long si, long long sj, int B, int Tn, int H, float scale, u64 seed,     \
        u64 stream, u64 thresh, float dscale, T *__restrict__ out, float *__restrict__ m_out,                    \
        float *__restrict__ linv_out

// version 1: a thread per query row, K/V tiles in shared memory
template <typename T, int HS>
__device__ __forceinline__ void flash_fwd_scalar(FWD_ARGS(T)) {
    constexpr int BQ = 64, BK = 32;
    __shared__ T Ks[BK][HS];
    __shared__ T Vs[BK][HS];
    const int t = threadIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;
    const int C = H * HS, i = blockIdx.x * BQ + t;
    const bool active = i < Tn;                               // tail threads still load tiles and sync
    const size_t base = (size_t)b * Tn * C + h * HS;
    float qr[HS], o[HS];
#pragma unroll
    for (int d = 0; d < HS; d++) { qr[d] = active ? to_f(q[base + (size_t)i * C + d]) : 0.f; o[d] = 0.f; }
    float mi = -INFINITY, li = 0.f;
    const u64 row = ((u64)bh * Tn + i) * Tn;                   // flat dropout index of (b, h, i, 0)
    for (int j0 = 0; j0 < Tn; j0 += BK) {
        const int nk = min(BK, Tn - j0);
        __syncthreads();                                      // the previous tile is consumed
        for (int x = t; x < nk * HS; x += BQ) {
            int jj = x / HS, d = x % HS;
            Ks[jj][d] = k[base + (size_t)(j0 + jj) * C + d];
            Vs[jj][d] = v[base + (size_t)(j0 + jj) * C + d];
        }
        __syncthreads();
        if (!active) continue;
        float s[BK];
        float mb = mi;
        for (int jj = 0; jj < nk; jj++) {                     // s_ij of the tile and its max
            float a = 0.f;
#pragma unroll
            for (int d = 0; d < HS; d++) a += qr[d] * to_f(Ks[jj][d]);
            a = a * scale + (mask ? mask[b * sb + h * sh + i * si + (j0 + jj) * sj] : 0.f);
            s[jj] = a;
            mb = fmaxf(mb, a);
        }
        if (mb == -INFINITY) continue;                        // only -inf so far: nothing to add
        float alpha = __expf(mi - mb);                        // rescale what was summed under mi (exp(-inf) = 0)
        li *= alpha;
#pragma unroll
        for (int d = 0; d < HS; d++) o[d] *= alpha;
        for (int jj = 0; jj < nk; jj++) {
            float p = __expf(s[jj] - mb);                     // NaN scores stay NaN in l: the launcher raises
            li += p;
            if (thresh && (u64)philox_word(row + j0 + jj, stream, seed) < thresh) p = 0.f;
#pragma unroll
            for (int d = 0; d < HS; d++) o[d] += p * to_f(Vs[jj][d]);
        }
        mi = mb;
    }
    if (active) {
        float inv = 1.f / li;
#pragma unroll
        for (int d = 0; d < HS; d++) out[base + (size_t)i * C + d] = from_f<T>(o[d] * (inv * dscale));
        m_out[(size_t)bh * Tn + i] = mi;
        linv_out[(size_t)bh * Tn + i] = inv;
    }
}

#ifdef HALF_TYPES   // (not under cpusim: inline PTX and 16-bit storage)
// The tensor-core forwards' steps on one m-tile (16 query rows: the thread's rows rr[0], rr[1]; its key columns
// j0 + 8 n + 2 t4 + 0 / 1), shared by versions 2-5 so that they compute the same bits.
// the online softmax's second half, S holding the scaled and masked scores and mx the rows' running max over this
// thread's columns: the row max over the quad (shuffles 1, 2), O and l rescaled by exp(m - m'), S replaced by
// P = exp(S - m), l summing P. FTZ (version 6): P by exp_ftz (0 below 2^-126), else __expf
template <bool FTZ = false>
__device__ __forceinline__ void tc_softmax_rescale(float (&s)[8][4], float (&o)[8][4], float (&mrow)[2],
                                                   float (&lrow)[2], float (&mx)[2]) {
    float mu[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        mu[r] = mx[r] == -INFINITY ? 0.f : mx[r];             // a row of only -inf so far: exp(-inf - 0) = 0
        float alpha = __expf(mrow[r] - mu[r]);
        lrow[r] *= alpha;
#pragma unroll
        for (int n = 0; n < 8; n++) { o[n][2 * r] *= alpha; o[n][2 * r + 1] *= alpha; }
        mrow[r] = mx[r];
    }
    // P = exp(S - m); l sums the undropped P (dropout zeroes P after, before P V)
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            float p = FTZ ? exp_ftz(s[n][e] - mu[e >> 1]) : __expf(s[n][e] - mu[e >> 1]);
            lrow[e >> 1] += p;
            s[n][e] = p;
        }
}

// The online softmax of a 16 x 64 S tile: scale, mask (mask_at(row, col) where has_mask and row < T), keys past T;
// the row max over the quad (shuffles 1, 2), O and l rescaled, S replaced by P = exp(S - m), l summing P
template <class MaskAt>
__device__ __forceinline__ void tc_softmax_tile(float (&s)[8][4], float (&o)[8][4], float (&mrow)[2],
                                                float (&lrow)[2], const int (&rr)[2], int j0, int Tn, float scale,
                                                bool has_mask, MaskAt mask_at, int t4) {
    float mx[2] = {mrow[0], mrow[1]};
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int row = rr[e >> 1], col = j0 + n * 8 + t4 * 2 + (e & 1);
            float x = s[n][e] * scale;
            if (col >= Tn) x = -INFINITY;
            else if (has_mask && row < Tn) x += mask_at(row, col);
            s[n][e] = x;
            mx[e >> 1] = fmaxf(mx[e >> 1], x);
        }
    tc_softmax_rescale(s, o, mrow, lrow, mx);
}

// dropout on P, one Philox call per pair of keys (the fourth word of a block and the next block's first where a
// pair straddles two)
__device__ __forceinline__ void tc_drop_pairs(float (&s)[8][4], const int (&rr)[2], int j0, int Tn, int bh,
                                              u64 seed, u64 stream, u64 thresh, int t4) {
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int row = rr[r], col = j0 + n * 8 + t4 * 2;
            if (row >= Tn || col >= Tn) continue;
            const u64 e0 = ((u64)bh * Tn + row) * Tn + col;   // and e0 + 1 (col + 1 may be past T: p = 0)
            uint4 w = philox4x32_10(e0 >> 2, stream, seed);
            const u32 l0 = (u32)(e0 & 3);
            u32 w0 = l0 == 0 ? w.x : l0 == 1 ? w.y : l0 == 2 ? w.z : w.w;
            u32 w1 = l0 == 0 ? w.y : l0 == 1 ? w.z : l0 == 2 ? w.w : philox4x32_10((e0 >> 2) + 1, stream, seed).x;
            if ((u64)w0 < thresh) s[n][2 * r] = 0.f;
            if ((u64)w1 < thresh) s[n][2 * r + 1] = 0.f;
        }
}

// finish: l over the quad, out = O / l * dscale, m and 1/l per row below T
template <typename T>
__device__ __forceinline__ void tc_fwd_store(const float (&o)[8][4], const float (&mrow)[2], float (&lrow)[2],
                                             const int (&rr)[2], T* __restrict__ out, float* __restrict__ m_out,
                                             float* __restrict__ linv_out, size_t obase, int bh, int Tn, int C,
                                             float dscale, int t4) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 1);
        lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 2);
        const int row = rr[r];
        if (row >= Tn) continue;
        const float inv = 1.f / lrow[r], f = inv * dscale;
        T* op = out + obase + (size_t)row * C + t4 * 2;
#pragma unroll
        for (int n = 0; n < 8; n++) {
            op[n * 8] = from_f<T>(o[n][2 * r] * f);
            op[n * 8 + 1] = from_f<T>(o[n][2 * r + 1] * f);
        }
        if (t4 == 0) {
            m_out[(size_t)bh * Tn + row] = mrow[r];
            linv_out[(size_t)bh * Tn + row] = inv;
        }
    }
}

// version 2: tensor cores (mma.sync m16n8k16), cp.async double-buffered K/V, FlashAttention-2 layout
// version 3 (SKIP): version 2 with key tiles of padding skipped (common.cuh's keys_all_padding: the same bits)
template <typename T, bool SKIP>
__device__ __forceinline__ void flash_fwd_tc(FWD_ARGS(T)) {
    constexpr int HS = 64, BQ = 64, BK = 64, LD = HS + 8;    // rows padded by 16 bytes: no bank conflicts on
    __shared__ __align__(16) T Qs[BQ * LD];                   // the fragment loads, rows stay 16-byte aligned
    __shared__ __align__(16) T Ks[2][BK * LD];
    __shared__ __align__(16) T Vs[2][BK * LD];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, q0 = blockIdx.x * BQ;
    const int C = H * HS;
    const T* qb = q + (size_t)b * Tn * C + h * HS;
    const T* kb = k + (size_t)b * Tn * C + h * HS;
    const T* vb = v + (size_t)b * Tn * C + h * HS;

    // 64 rows x 128 bytes = 512 chunks of 16 bytes, 4 per thread; rows past T are zero-filled
    auto load_tile = [&](T* dst, const T* src, int r0) {
#pragma unroll
        for (int c = tid; c < 64 * 8; c += 128) {
            int r = c >> 3, col = (c & 7) * 8, row = r0 + r;
            bool ok = row < Tn;
            cp_async16(dst + r * LD + col, src + (size_t)(ok ? row : 0) * C + col, ok ? 16 : 0);
        }
    };
    load_tile(Qs, qb, q0);
    load_tile(Ks[0], kb, 0);
    load_tile(Vs[0], vb, 0);
    cp_async_commit();

    const int rr[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};   // the two query rows of its fragments
    u32 qa[4][4];                                             // Q as A fragments, 4 k-steps over hs = 64
    float o[8][4];                                            // O: 16 rows x 64 dims, 8 n-tiles of 8
#pragma unroll
    for (int n = 0; n < 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.f, 0.f};   // l: this thread's partial sums
    const int ntiles = (Tn + BK - 1) / BK;

    for (int it = 0; it < ntiles; it++) {
        const int cur = it & 1, j0 = it * BK;
        if (it + 1 < ntiles) {                                // stream the next tile in while this one is used
            load_tile(Ks[cur ^ 1], kb, j0 + BK);
            load_tile(Vs[cur ^ 1], vb, j0 + BK);
        }
        cp_async_commit();
        cp_async_wait<1>();                                   // everything but the newest group has landed
        __syncthreads();
        if (SKIP && mask && si == 0 && it > 0 &&                // (block-uniform: every thread votes or none)
            keys_all_padding(mask, b * sb + h * sh, sj, j0, Tn, tid) &&
            !__syncthreads_or(mrow[0] <= PAD_MIN || mrow[1] <= PAD_MIN)) {
            COUNT_SKIP(tid);
            __syncthreads();
            continue;
        }
        if (it == 0) {
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                const T* p0 = Qs + (warp * 16 + g) * LD + kk * 16 + t4 * 2;
                qa[kk][0] = *reinterpret_cast<const u32*>(p0);
                qa[kk][1] = *reinterpret_cast<const u32*>(p0 + 8 * LD);
                qa[kk][2] = *reinterpret_cast<const u32*>(p0 + 8);
                qa[kk][3] = *reinterpret_cast<const u32*>(p0 + 8 * LD + 8);
            }
        }
        // S = Q K^T: 16 x 64 per warp (8 n-tiles of 8 keys)
        float s[8][4];
#pragma unroll
        for (int n = 0; n < 8; n++) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                const T* kp = Ks[cur] + (n * 8 + g) * LD + kk * 16 + t4 * 2;
                u32 bf[2] = {*reinterpret_cast<const u32*>(kp), *reinterpret_cast<const u32*>(kp + 8)};
                mma16816(s[n], qa[kk], bf, T());
            }
        }
        tc_softmax_tile(s, o, mrow, lrow, rr, j0, Tn, scale, mask != nullptr,
                        [&](int row, int col) { return mask[b * sb + h * sh + row * si + col * sj]; }, t4);
        if (thresh) tc_drop_pairs(s, rr, j0, Tn, bh, seed, stream, thresh, t4);
        // O += P V: P's C fragments re-packed as A fragments (key k-step kk = n-tiles 2kk, 2kk+1)
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            u32 pa[4] = {pack2(s[2 * kk][0], s[2 * kk][1], T()), pack2(s[2 * kk][2], s[2 * kk][3], T()),
                         pack2(s[2 * kk + 1][0], s[2 * kk + 1][1], T()), pack2(s[2 * kk + 1][2], s[2 * kk + 1][3], T())};
#pragma unroll
            for (int n = 0; n < 8; n++) {                     // B[k][n] = V[key kk*16 + k][dim n*8 + n]
                const unsigned short* vp =
                    reinterpret_cast<const unsigned short*>(Vs[cur] + (kk * 16 + t4 * 2) * LD + n * 8 + g);
                u32 bf[2] = {(u32)vp[0] | ((u32)vp[LD] << 16), (u32)vp[8 * LD] | ((u32)vp[9 * LD] << 16)};
                mma16816(o[n], pa, bf, T());
            }
        }
        __syncthreads();                                      // this tile's buffers may be refilled next
    }
    tc_fwd_store<T>(o, mrow, lrow, rr, out, m_out, linv_out, (size_t)b * Tn * C + h * HS, bh, Tn, C, dscale, t4);
}


// version 6: version 5 (128 query rows a block) with each score's work cut to its arithmetic, the forward's
// counterpart of attention_backward.cu version 8. Version 5's loop spends most of its instructions on the 64 scores
// a thread a key tile (beside 128 mma.sync a warp): a test of the key against T and of the mask's presence and the
// row against T per score, the mask read from shared memory per score, __expf's subnormal path; built without its
// dropout code it is 3,250 SASS instructions statically, version 6's 1,140 (sm_90, cuobjdump). Here:
//   - compiled for one case: no dropout, a mask constant along the queries or none (the launcher runs version 5
//     for any other case: this kernel with version 5's dropout added spilled 32 bytes at 255 registers, where
//     version 5 takes 250 and none; dropout would need its words drawn in fewer registers first);
//   - the thread's 16 key columns' additive terms read once a tile (the mask row, 0 without a mask, -inf past T:
//     exp gives the 0 version 5 gets by setting such a score to -inf), shared by its 2 MT rows;
//   - no bounds test on a score: a row past T is computed and never stored, a key past T has p 0;
//   - exp by exp_ftz (common.cuh: __expf's value, 0 below 2^-126) for the scores' P.
// Each score is version 5's expression otherwise (scale q.k rounded, then the mask added: __fmul_rn / __fadd_rn,
// as version 5 compiles them, unfused), so out, m and 1/l are version 5's bits wherever no p falls below 2^-126
// (the main compares them).
// (Mt: the key tile's 64 additive terms in shared memory; the thread's columns 8 n + 2 t4, + 1 read as a float2)
__device__ __forceinline__ void tc_softmax_tile6(float (&s)[8][4], float (&o)[8][4], float (&mrow)[2],
                                                 float (&lrow)[2], const float* Mt, float scale, int t4) {
    float mx[2] = {mrow[0], mrow[1]};
#pragma unroll
    for (int n = 0; n < 8; n++) {
        const float2 mk = *reinterpret_cast<const float2*>(Mt + n * 8 + t4 * 2);
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float x = __fadd_rn(__fmul_rn(s[n][e], scale), (e & 1) ? mk.y : mk.x);
            s[n][e] = x;
            mx[e >> 1] = fmaxf(mx[e >> 1], x);
        }
    }
    tc_softmax_rescale<true>(s, o, mrow, lrow, mx);
}

// versions 4 and 5: version 3's arithmetic (the same bits: the main compares them) with less work per tile on the
// shared-memory port and the integer pipes, where version 3 spends more issue slots than its tensor cores take:
//   - the K and V B fragments by ldmatrix (x4: two mma's worth in one instruction; V with .trans) instead of
//     32-bit (K) and 16-bit (V: four per fragment) shared loads;
//   - version 5 gives each warp 32 query rows (two m-tiles, MT = 2; 128 rows a block), so every B fragment read
//     from shared memory feeds two mma.sync instead of one: half the shared traffic per product (version 4: MT = 1,
//     64 rows a block, for grids that 128-row blocks would leave short of the SMs);
//   - a mask constant along the queries (si == 0, BERT's (B, 1, 1, T)) read once per key tile into shared memory
//     (64 floats, the next tile's fetched into a register while this one is computed) instead of a 64-bit index
//     and a global load per score; the padding-skip vote reads it there;
//   - dropout: one Philox call per 4 consecutive keys (T % 4 == 0): the lanes t4 = 2G, 2G + 1 of a quad draw the
//     words of keys 4G .. 4G + 3 of the lower and the upper row and swap the halves the other needs by two
//     shuffles (version 3: a call per pair of keys); the same words, so the same keep-mask.
// Q is staged through the second K / V buffers (static shared memory stays under 48 KB at 128 rows).
// LEAN (version 6, with MT = 2): tc_softmax_tile6's scores and no dropout; the key tile's row in shared memory holds
// the additive terms (the mask, 0 without one, -inf past T); its caller guarantees no dropout and si == 0.
template <typename T, int MT, bool LEAN = false>
__device__ __forceinline__ void flash_fwd_tc4(FWD_ARGS(T)) {
    constexpr int HS = 64, BQ = 64 * MT, BK = 64, LD = HS + 8;
    __shared__ __align__(16) T Ks[2][BK * LD];
    __shared__ __align__(16) T Vs[2][BK * LD];
    __shared__ float Ms[2][BK];                               // the key tile's mask row (si == 0)
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, q0 = blockIdx.x * BQ;
    const int C = H * HS;
    const T* qb = q + (size_t)b * Tn * C + h * HS;
    const T* kb = k + (size_t)b * Tn * C + h * HS;
    const T* vb = v + (size_t)b * Tn * C + h * HS;
    const bool staged = mask && si == 0;                      // (block-uniform)
    const float* mrow_g = mask + (staged ? b * sb + h * sh : 0);

    auto load_tile = [&](T* dst, const T* src, int r0) {      // 64 rows of 128 bytes, 4 cp.async a thread
#pragma unroll
        for (int c = tid; c < 64 * 8; c += 128) {
            int r = c >> 3, col = (c & 7) * 8, row = r0 + r;
            bool ok = row < Tn;
            cp_async16(dst + r * LD + col, src + (size_t)(ok ? row : 0) * C + col, ok ? 16 : 0);
        }
    };
    auto mask_at = [&](int j) {
        if constexpr (LEAN) return j < Tn ? (staged ? mrow_g[j * sj] : 0.f) : -INFINITY;
        else return staged && j < Tn ? mrow_g[j * sj] : 0.f;
    };
    // prologue: Q's 64 MT rows through Ks[1] (and Vs[1]), the first K / V tile into buffers 0
    load_tile(Ks[1], qb, q0);
    if (MT == 2) load_tile(Vs[1], qb, q0 + 64);
    load_tile(Ks[0], kb, 0);
    load_tile(Vs[0], vb, 0);
    cp_async_commit();
    if (tid < 64) Ms[0][tid] = mask_at(tid);
    cp_async_wait<0>();
    __syncthreads();
    u32 qa[MT][4][4];                                         // Q as A fragments: m-tile mt, k-step kk
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            const T* p0 = (mt ? Vs[1] : Ks[1]) + (warp * 16 + g) * LD + kk * 16 + t4 * 2;
            qa[mt][kk][0] = *reinterpret_cast<const u32*>(p0);
            qa[mt][kk][1] = *reinterpret_cast<const u32*>(p0 + 8 * LD);
            qa[mt][kk][2] = *reinterpret_cast<const u32*>(p0 + 8);
            qa[mt][kk][3] = *reinterpret_cast<const u32*>(p0 + 8 * LD + 8);
        }
    __syncthreads();                                          // the staging buffers are refilled next

    // m-tile mt of warp w holds rows q0 + 64 mt + 16 w + g (+ 8): with MT = 2 a warp's rows are 16 w .. and
    // 64 + 16 w .., as Q was staged (rows 0-63 in Ks[1], 64-127 in Vs[1])
    int rr[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) { rr[mt][0] = q0 + 64 * mt + warp * 16 + g; rr[mt][1] = rr[mt][0] + 8; }
    float o[MT][8][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int n = 0; n < 8; n++) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
    float mrow[MT][2], lrow[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) mrow[mt][0] = mrow[mt][1] = -INFINITY, lrow[mt][0] = lrow[mt][1] = 0.f;
    const int ntiles = (Tn + BK - 1) / BK;
    const bool quad_philox = (Tn & 3) == 0;                   // keys 4G.. of a row start a Philox block

    for (int it = 0; it < ntiles; it++) {
        const int cur = it & 1, j0 = it * BK;
        if (it + 1 < ntiles) {                                // stream the next tile in while this one is used
            load_tile(Ks[cur ^ 1], kb, j0 + BK);
            load_tile(Vs[cur ^ 1], vb, j0 + BK);
        }
        cp_async_commit();
        const float mnext = tid < 64 ? mask_at(j0 + BK + tid) : 0.f;   // (the load lands while this tile runs)
        cp_async_wait<1>();
        __syncthreads();
        bool skip = false;
        if (staged && it > 0) {               // version 3's skip: a tile of padding keys, every
            bool any = false;                                 // row of the block has met a real key
#pragma unroll
            for (int mt = 0; mt < MT; mt++) any |= mrow[mt][0] <= PAD_MIN || mrow[mt][1] <= PAD_MIN;
            skip = !__syncthreads_or(tid < 64 && j0 + tid < Tn && Ms[cur][tid] > PAD_MIN) && !__syncthreads_or(any);
        }
        if (!skip) {
            // S = Q K^T: per warp MT x 16 rows x 64 keys; a K fragment pair (two k-steps) per ldmatrix
            float s[MT][8][4];
#pragma unroll
            for (int n = 0; n < 8; n++) {
#pragma unroll
                for (int mt = 0; mt < MT; mt++) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#pragma unroll
                for (int k2 = 0; k2 < 2; k2++) {
                    u32 bf[4];                                // k-steps 2 k2, 2 k2 + 1 of key rows n 8 ..
                    ldsm_x4(bf, Ks[cur] + (n * 8 + (lane & 7)) * LD + k2 * 32 + (lane >> 3) * 8);
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        mma16816(s[mt][n], qa[mt][2 * k2], bf, T());
                        mma16816(s[mt][n], qa[mt][2 * k2 + 1], bf + 2, T());
                    }
                }
            }
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                if constexpr (LEAN) {
                    tc_softmax_tile6(s[mt], o[mt], mrow[mt], lrow[mt], Ms[cur], scale, t4);
                    continue;
                }
                tc_softmax_tile(s[mt], o[mt], mrow[mt], lrow[mt], rr[mt], j0, Tn, scale, mask != nullptr,
                                [&](int row, int col) {
                                    return staged ? Ms[cur][col - j0] : mask[b * sb + h * sh + row * si + col * sj];
                                }, t4);
                if (thresh && quad_philox) {
#pragma unroll
                    for (int n = 0; n < 8; n++) {
                        // lane t4 draws keys 4 (t4 >> 1) .. + 3 of row rr[mt][t4 & 1]; it keeps the half of its
                        // own pair of keys and swaps the other half with lane t4 ^ 1
                        const int myrow = (t4 & 1) ? rr[mt][1] : rr[mt][0], key4 = j0 + n * 8 + (t4 >> 1) * 4;
                        const uint4 w = philox4x32_10((((u64)bh * Tn + myrow) * Tn + key4) >> 2, stream, seed);
                        const bool odd = t4 & 1;
                        const u32 give0 = odd ? w.x : w.z, give1 = odd ? w.y : w.w;
                        const u32 got0 = __shfl_xor_sync(0xffffffffu, give0, 1);
                        const u32 got1 = __shfl_xor_sync(0xffffffffu, give1, 1);
                        const u32 lo0 = odd ? got0 : w.x, lo1 = odd ? got1 : w.y;     // row rr[mt][0]
                        const u32 hi0 = odd ? w.z : got0, hi1 = odd ? w.w : got1;     // row rr[mt][1]
                        const int col = j0 + n * 8 + t4 * 2;
                        if (rr[mt][0] < Tn && col < Tn) {
                            if ((u64)lo0 < thresh) s[mt][n][0] = 0.f;
                            if ((u64)lo1 < thresh) s[mt][n][1] = 0.f;
                        }
                        if (rr[mt][1] < Tn && col < Tn) {
                            if ((u64)hi0 < thresh) s[mt][n][2] = 0.f;
                            if ((u64)hi1 < thresh) s[mt][n][3] = 0.f;
                        }
                    }
                } else if (thresh) {                          // T % 4 != 0: version 3's call per pair of keys
                    tc_drop_pairs(s[mt], rr[mt], j0, Tn, bh, seed, stream, thresh, t4);
                }
            }
            // O += P V: P's C fragments as A fragments (key k-step kk = n-tiles 2 kk, 2 kk + 1); the B fragments
            // of dims n 8 .. and (n + 1) 8 .. by one ldmatrix.trans (matrices: keys kk 16 + 0 / 8, dims n / n + 1)
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                u32 pa[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    pa[mt][0] = pack2(s[mt][2 * kk][0], s[mt][2 * kk][1], T());
                    pa[mt][1] = pack2(s[mt][2 * kk][2], s[mt][2 * kk][3], T());
                    pa[mt][2] = pack2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1], T());
                    pa[mt][3] = pack2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3], T());
                }
#pragma unroll
                for (int n = 0; n < 8; n += 2) {
                    u32 bf[4];
                    const int mi = lane >> 3;
                    ldsm_x4_t(bf, Vs[cur] + (kk * 16 + (mi & 1) * 8 + (lane & 7)) * LD + (n + (mi >> 1)) * 8);
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        mma16816(o[mt][n], pa[mt], bf, T());
                        mma16816(o[mt][n + 1], pa[mt], bf + 2, T());
                    }
                }
            }
        } else {
            COUNT_SKIP(tid);
        }
        if (tid < 64) Ms[cur ^ 1][tid] = mnext;               // read from the next iteration on, after its barrier
        __syncthreads();                                      // this tile's buffers may be refilled next
    }
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
        tc_fwd_store<T>(o[mt], mrow[mt], lrow[mt], rr[mt], out, m_out, linv_out, (size_t)b * Tn * C + h * HS, bh, Tn,
                        C, dscale, t4);
}


#endif  // HALF_TYPES

// the names cuda_c.py loads: attn_fwd_v1_<dtype>_hs<hs> (block 64), attn_fwd_v2_<dtype>_hs64 (block 128);
// grid (ceil(T / 64), B * H)
#define INST_V1(T, NAME, HS)                                                                                     \
    extern "C" __global__ void __launch_bounds__(64) attn_fwd_v1_##NAME##_hs##HS(FWD_ARGS(T)) {                 \
        flash_fwd_scalar<T, HS>(q, k, v, mask, sb, sh, si, sj, B, Tn, H, scale, seed, stream, thresh, dscale,   \
                                out, m_out, linv_out);                                                          \
    }
INST_V1(float, f32, 32)
INST_V1(float, f32, 64)
INST_V1(float, f32, 128)
#ifdef HALF_TYPES
INST_V1(__half, f16, 32)
INST_V1(__half, f16, 64)
INST_V1(__half, f16, 128)
INST_V1(__nv_bfloat16, bf16, 32)
INST_V1(__nv_bfloat16, bf16, 64)
INST_V1(__nv_bfloat16, bf16, 128)

#define INST_TC(T, NAME, V, SKIP)                                                                                \
    extern "C" __global__ void __launch_bounds__(128) attn_fwd_v##V##_##NAME##_hs64(FWD_ARGS(T)) {             \
        flash_fwd_tc<T, SKIP>(q, k, v, mask, sb, sh, si, sj, B, Tn, H, scale, seed, stream, thresh, dscale, out, \
                              m_out, linv_out);                                                                 \
    }
INST_TC(__half, f16, 2, false)
INST_TC(__nv_bfloat16, bf16, 2, false)
INST_TC(__half, f16, 3, true)
INST_TC(__nv_bfloat16, bf16, 3, true)
// versions 4 (64 query rows a block) and 5 (128): grid (ceil(T / (64 MT)), B * H), 128 threads
#define INST_TC4(T, NAME, V, MT)                                                                                 \
    extern "C" __global__ void __launch_bounds__(128) attn_fwd_v##V##_##NAME##_hs64(FWD_ARGS(T)) {             \
        flash_fwd_tc4<T, MT>(q, k, v, mask, sb, sh, si, sj, B, Tn, H, scale, seed, stream, thresh, dscale, out,  \
                             m_out, linv_out);                                                                  \
    }
INST_TC4(__half, f16, 4, 1)
INST_TC4(__nv_bfloat16, bf16, 4, 1)
INST_TC4(__half, f16, 5, 2)
INST_TC4(__nv_bfloat16, bf16, 5, 2)
// version 6 (128 query rows a block, version 5's grid and block): no dropout; a mask constant along the queries or
// none
#define INST_TC6(T, NAME)                                                                                        \
    extern "C" __global__ void __launch_bounds__(128) attn_fwd_v6_##NAME##_hs64(FWD_ARGS(T)) {                 \
        flash_fwd_tc4<T, 2, true>(q, k, v, mask, sb, sh, si, sj, B, Tn, H, scale, seed, stream, thresh, dscale, \
                                  out, m_out, linv_out);                                                        \
    }
INST_TC6(__half, f16)
INST_TC6(__nv_bfloat16, bf16)
#endif

// ----------------------------------------------------------------------------------------------------------------
// kernel launcher, version switch, main

#ifdef HOST_CODE
template <typename T>
void attention_forward(int version, const T* q, const T* k, const T* v, const float* mask, long long sb,
                       long long sh, long long si, long long sj, int B, int Tn, int H, float scale, u64 seed,
                       u64 stream, u64 thresh, float dscale, T* out, float* m, float* linv);

#define LAUNCHER(T, NAME)                                                                                          \
    template <>                                                                                                 \
    void attention_forward<T>(int version, const T* q, const T* k, const T* v, const float* mask, long long sb,  \
                              long long sh, long long si, long long sj, int B, int Tn, int H, float scale,       \
                              u64 seed, u64 stream, u64 thresh, float dscale, T* out, float* m, float* linv) {   \
        dim3 grid((Tn + 63) / 64, B * H);                                                                       \
        if (version == 1)                                                                                       \
            LAUNCH(attn_fwd_v1_##NAME##_hs64, grid, 64, q, k, v, mask, sb, sh, si, sj, B, Tn, H, scale, seed,    \
                   stream, thresh, dscale, out, m, linv);                                                       \
        else if (version == 2)                                                                                  \
            LAUNCH_V2_##NAME;                                                                                   \
        else if (version == 3)                                                                                  \
            LAUNCH_V3_##NAME;                                                                                   \
        else                                                                                                    \
            LAUNCH_V45_##NAME;                                                                                  \
        cudaCheck(cudaGetLastError());                                                                          \
    }
#define LAUNCH_V2_f32 (printf("version 2 has no float32 kernel\n"), exit(1))
#define LAUNCH_V3_f32 (printf("version 3 has no float32 kernel\n"), exit(1))
#define LAUNCH_V45_f32 (printf("versions 4, 5, 6 have no float32 kernel\n"), exit(1))
#define LAUNCH_V45(NAME)                                                                                         \
    if (version == 4)                                                                                           \
        LAUNCH(attn_fwd_v4_##NAME##_hs64, grid, 128, q, k, v, mask, sb, sh, si, sj, B, Tn, H, scale, seed,       \
               stream, thresh, dscale, out, m, linv);                                                           \
    else if (version == 6 && si == 0 && !thresh)     /* (with dropout: version 5's kernel) */                   \
        LAUNCH(attn_fwd_v6_##NAME##_hs64, dim3((Tn + 127) / 128, B * H), 128, q, k, v, mask, sb, sh, si, sj, B,  \
               Tn, H, scale, seed, stream, thresh, dscale, out, m, linv);                                       \
    else                                                                                                        \
        LAUNCH(attn_fwd_v5_##NAME##_hs64, dim3((Tn + 127) / 128, B * H), 128, q, k, v, mask, sb, sh, si, sj, B,  \
               Tn, H, scale, seed, stream, thresh, dscale, out, m, linv)
#define LAUNCH_V45_f16 LAUNCH_V45(f16)
#define LAUNCH_V45_bf16 LAUNCH_V45(bf16)
#define LAUNCH_V3_f16                                                                                            \
    LAUNCH(attn_fwd_v3_f16_hs64, grid, 128, q, k, v, mask, sb, sh, si, sj, B, Tn, H, scale, seed, stream, thresh, \
           dscale, out, m, linv)
#define LAUNCH_V3_bf16                                                                                           \
    LAUNCH(attn_fwd_v3_bf16_hs64, grid, 128, q, k, v, mask, sb, sh, si, sj, B, Tn, H, scale, seed, stream,       \
           thresh, dscale, out, m, linv)
#define LAUNCH_V2_f16                                                                                            \
    LAUNCH(attn_fwd_v2_f16_hs64, grid, 128, q, k, v, mask, sb, sh, si, sj, B, Tn, H, scale, seed, stream, thresh, \
           dscale, out, m, linv)
#define LAUNCH_V2_bf16                                                                                           \
    LAUNCH(attn_fwd_v2_bf16_hs64, grid, 128, q, k, v, mask, sb, sh, si, sj, B, Tn, H, scale, seed, stream,       \
           thresh, dscale, out, m, linv)
LAUNCHER(float, f32)
#ifdef HALF_TYPES
LAUNCHER(__half, f16)
LAUNCHER(__nv_bfloat16, bf16)
#endif

template <typename T>
T* to_device(const float* h, size_t n) {
    std::vector<T> c(n);
    for (size_t i = 0; i < n; i++) c[i] = (T)h[i];
    T* d;
    cudaCheck(cudaMalloc(&d, n * sizeof(T)));
    cudaCheck(cudaMemcpy(d, c.data(), n * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}

// one version: validated against the CPU reference, timed; its out, m and 1/l bits appended to `bits` when given
template <typename T>
void run(const char* label, int version, int B, int Tn, int H, int hs, const float* q, const float* k,
         const float* v, const float* mask, float scale, u64 seed, u64 stream, u64 thresh, float dscale,
         const float* ref_out, float atol, float rtol, std::vector<unsigned char>* bits = nullptr) {
    size_t n = (size_t)B * Tn * H * hs;
    T *dq = to_device<T>(q, n), *dk = to_device<T>(k, n), *dv = to_device<T>(v, n), *dout;
    float *dmask, *dm, *dl;
    cudaCheck(cudaMalloc(&dout, n * sizeof(T)));
    cudaCheck(cudaMalloc(&dmask, (size_t)B * Tn * sizeof(float)));
    cudaCheck(cudaMemcpy(dmask, mask, (size_t)B * Tn * sizeof(float), cudaMemcpyHostToDevice));
    cudaCheck(cudaMalloc(&dm, (size_t)B * H * Tn * sizeof(float)));
    cudaCheck(cudaMalloc(&dl, (size_t)B * H * Tn * sizeof(float)));
    auto launch = [&]() {
        attention_forward<T>(version, dq, dk, dv, dmask, Tn, 0, 0, 1, B, Tn, H, scale, seed, stream, thresh,
                             dscale, dout, dm, dl);
    };
    launch();
    cudaCheck(cudaDeviceSynchronize());
    validate_result(dout, ref_out, label, n, atol, rtol);
    if (bits) {
        const size_t nr = (size_t)B * H * Tn;
        bits->resize(n * sizeof(T) + 2 * nr * sizeof(float));
        cudaCheck(cudaMemcpy(bits->data(), dout, n * sizeof(T), cudaMemcpyDeviceToHost));
        cudaCheck(cudaMemcpy(bits->data() + n * sizeof(T), dm, nr * sizeof(float), cudaMemcpyDeviceToHost));
        cudaCheck(cudaMemcpy(bits->data() + n * sizeof(T) + nr * sizeof(float), dl, nr * sizeof(float),
                             cudaMemcpyDeviceToHost));
    }
    float ms = benchmark_kernel(20, launch);
    double flops = 4.0 * B * H * (double)Tn * Tn * hs;
    printf("  %s: %.4f ms, %.1f TFLOP/s\n", label, ms, flops / ms / 1e9);
    cudaFree(dq); cudaFree(dk); cudaFree(dv); cudaFree(dout); cudaFree(dmask); cudaFree(dm); cudaFree(dl);
}

int main(int argc, char** argv) {
#ifdef CPUSIM_SMALL
    int B = 3, H = 2, hs = 64, Tn = argc > 1 ? atoi(argv[1]) : 70;   // 2 query tiles, a 6-row tail, 3 key tiles
#else
    int B = 4, H = 12, hs = 64, Tn = argc > 1 ? atoi(argv[1]) : 512;
#endif
    float p = argc > 2 ? (float)atof(argv[2]) : 0.1f;                 // dropout (0: none)
    u64 seed = 1234, stream = 7, thresh = (u64)llround(p * 4294967296.0);
    float dscale = 1.f / (1.f - p), scale = 1.f / sqrtf((float)hs);
    size_t n = (size_t)B * Tn * H * hs;
    float *q = make_random_float(n, 1), *k = make_random_float(n, 2), *v = make_random_float(n, 3);
    float* mask = (float*)malloc((size_t)B * Tn * sizeof(float));   // (B, 1, 1, T): right padding, HF style
    for (int b = 0; b < B; b++)
        for (int j = 0; j < Tn; j++) mask[b * Tn + j] = j < (b == B - 1 ? 1 : Tn - 37 * b) ? 0.f : -3.4028235e38f;
    float *out = (float*)malloc(n * sizeof(float)), *m = (float*)malloc((size_t)B * H * Tn * sizeof(float));
    float* linv = (float*)malloc((size_t)B * H * Tn * sizeof(float));
    printf("attention forward B=%d T=%d H=%d hs=%d dropout %.2f: CPU reference...\n", B, Tn, H, hs, p);
    attention_forward_cpu(q, k, v, mask, Tn, 0, 0, 1, B, Tn, H, hs, scale, seed, stream, thresh, dscale, out, m,
                          linv);
    // float32: summation order and __expf (2 ulp); fp16 / bf16: inputs and P rounded to 11 / 8 bits
    run<float>("v1 f32", 1, B, Tn, H, hs, q, k, v, mask, scale, seed, stream, thresh, dscale, out, 1e-5f, 1e-4f);
#ifdef HALF_TYPES
    run<__half>("v1 f16", 1, B, Tn, H, hs, q, k, v, mask, scale, seed, stream, thresh, dscale, out, 5e-3f, 1e-2f);
    std::vector<unsigned char> b2, b3, b4, b5, b6;
    run<__half>("v2 f16", 2, B, Tn, H, hs, q, k, v, mask, scale, seed, stream, thresh, dscale, out, 5e-3f, 1e-2f, &b2);
    run<__half>("v3 f16", 3, B, Tn, H, hs, q, k, v, mask, scale, seed, stream, thresh, dscale, out, 5e-3f, 1e-2f, &b3);
    run<__half>("v4 f16", 4, B, Tn, H, hs, q, k, v, mask, scale, seed, stream, thresh, dscale, out, 5e-3f, 1e-2f, &b4);
    run<__half>("v5 f16", 5, B, Tn, H, hs, q, k, v, mask, scale, seed, stream, thresh, dscale, out, 5e-3f, 1e-2f, &b5);
    run<__half>("v6 f16", 6, B, Tn, H, hs, q, k, v, mask, scale, seed, stream, thresh, dscale, out, 5e-3f, 1e-2f, &b6);
    int same = b2 == b3, same45 = b4 == b3 && b5 == b3, same6 = b6 == b5;
    run<__nv_bfloat16>("v1 bf16", 1, B, Tn, H, hs, q, k, v, mask, scale, seed, stream, thresh, dscale, out, 3e-2f,
                       3e-2f);
    run<__nv_bfloat16>("v2 bf16", 2, B, Tn, H, hs, q, k, v, mask, scale, seed, stream, thresh, dscale, out, 3e-2f,
                       3e-2f, &b2);
    run<__nv_bfloat16>("v3 bf16", 3, B, Tn, H, hs, q, k, v, mask, scale, seed, stream, thresh, dscale, out, 3e-2f,
                       3e-2f, &b3);
    run<__nv_bfloat16>("v4 bf16", 4, B, Tn, H, hs, q, k, v, mask, scale, seed, stream, thresh, dscale, out, 3e-2f,
                       3e-2f, &b4);
    run<__nv_bfloat16>("v5 bf16", 5, B, Tn, H, hs, q, k, v, mask, scale, seed, stream, thresh, dscale, out, 3e-2f,
                       3e-2f, &b5);
    run<__nv_bfloat16>("v6 bf16", 6, B, Tn, H, hs, q, k, v, mask, scale, seed, stream, thresh, dscale, out, 3e-2f,
                       3e-2f, &b6);
    same &= b2 == b3;
    same45 &= b4 == b3 && b5 == b3;
    same6 &= b6 == b5;
    // version 3 skips padding tiles: exact zeros skipped, so version 2's bits (out, m, 1/l), or it is wrong;
    // versions 4 and 5 reorganise version 3's loads, not its arithmetic: its bits, or they are wrong
    printf("v3 = v2 bit for bit (f16, bf16): %s\n", same ? "yes" : "NO");
    printf("v4 = v5 = v3 bit for bit (f16, bf16): %s\n", same45 ? "yes" : "NO");
    // version 6 computes each score as version 5 does (its own kernel without dropout; with dropout version 5's
    // kernel): version 5's bits wherever no p falls below 2^-126
    printf("v6 = v5 bit for bit (f16, bf16; %s): %s\n", !thresh ? "its kernel, no dropout" : "version 5's kernel",
           same6 ? "yes" : "NO");
    same &= same45 && same6;
#ifdef CPUSIM
    printf("v3, v4, v5, v6 skipped %lld key tiles of padding in all\n", (long long)cpusim_skipped_tiles.load());
#endif
    if (!same) return 1;
#endif
    free(q); free(k); free(v); free(mask); free(out); free(m); free(linv);
    return 0;
}
#endif
