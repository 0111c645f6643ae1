/*
Flash attention backward with recomputation: dq, dk, dv from dout, q, k, v, out and the forward's per-row (m, 1/l).
Oracle: refbert.ops.attention_backward (Python launchers: kernels/cuda/cuda_c.py; the math and the Numba versions:
kernels/cuda/attention.py). Layouts as attention_forward.cu: q, k, v, out, dout, dq, dk, dv (B, T, C) storage T;
mask float32 with element strides (sb, sh, si, sj); m, linv, D (B, H, T) float32. Per (b, h), scale = 1/sqrt(hs):
    p_ij = exp(scale q_i . k_j + mask_ij - m_i) / l_i         (recomputed, never stored)
    z_ij = dscale if Philox word of e = ((b*H + h)*T + i)*T + j >= thresh else 0      (regenerated, never stored)
    dv_j = sum_i p_ij z_ij dout_i                 dp_ij = z_ij (dout_i . v_j)
    D_i  = dout_i . out_i  (= sum_j p_ij dp_ij)   ds_ij = p_ij (dp_ij - D_i)
    dq_i = scale sum_j ds_ij k_j                  dk_j = scale sum_i ds_ij q_i
No atomics (versions 1-6): dk, dv are owned by key tiles and dq by query tiles (two passes that each recompute p);
version 7 makes one pass and adds dq's shares by atomics.

Versions:
  1  scalar, fp32 accumulation for any storage (f32 / f16 / bf16), hs in {32, 64, 128}:
       attn_bwd_D:        a warp per row, D_i = dout_i . out_i
       attn_bwd_dkdv_v1:  a block per (b, h, 64-key tile), a thread per key row with k_j, v_j, dk_j, dv_j in
                          registers; 32-row query tiles (q, dout, m, 1/l, D) staged in shared memory
       attn_bwd_dq_v1:    a block per (b, h, 64-query tile), a thread per query row; 32-key K/V tiles in shared
  2  tensor cores (mma.sync m16n8k16, fp16 / bf16, hs = 64), version 1's two passes on 64 x 64 tiles, 4 warps of
     16 rows each: attn_bwd_dkdv_v2 (per key tile: S^T = K Q^T, dP^T = V dout^T, dV += (z P)^T dout,
     dK += dS^T Q) and attn_bwd_dq_v2 (per query tile: S, dP, dq += dS K); the tile's own rows as register
     fragments, the other side's tiles double-buffered with cp.async; P and dS rounded to 16 bits for the
     tensor cores (FlashAttention-2's choice), everything else float32. Still no atomics: two passes recompute P.
  3  version 2 with BERT's padding skipped (attention_forward.cu version 3's rule, common.cuh keys_all_padding):
     under a mask constant along the queries, a key tile of padding meets only rows that have a real key, whose
     p there is exactly 0, so it is skipped; the same bits as version 2 (the main compares them).
  4  version 3 with B fragments by ldmatrix (flash_tc.cuh LDSM: two fragments an instruction; the transposed
     ones (dout for dV, Q for dK, K for dq) one ldmatrix.trans for two where version 3 took eight 16-bit loads;
     the dk, dv pass keeps version 3's loads for S^T and dP^T, where ldmatrix made ptxas spill)
     and a mask constant along the queries read once (the dk, dv pass: the thread's two key rows into registers;
     the dq pass: the (b, h) row into shared memory, T <= 2048) instead of once per score with a 64-bit index:
     version 3's values in version 3's order, so its bits (the main compares them).
  5  version 4 with dropout's keep-mask drawn a Philox call per 4 scores instead of one a score (T % 4 == 0, where
     keys 4G .. 4G + 3 of a row are one Philox block; otherwise as version 4). Version 4 spends a whole
     philox4x32_10 (10 rounds of two 32-bit multiplies and their high halves) on each score's one word, twice
     (both passes recompute z). The dq pass (S: rows x keys) trades as the forward's version 5 does: lanes
     t4 = 2G, 2G + 1 hold keys 4G .. 4G + 3 of the same two rows, each draws one row's block and they swap two
     words. The dk, dv pass (S^T: keys x queries) holds 4 consecutive keys in the lanes g = 4A .. 4A + 3 of one
     t4, for two queries and two key rows: 4 blocks, one drawn by each of the four lanes, then a 4 x 4 transpose by
     three xor shuffles (flash_tc.cuh tc_words_cols). The same words, so version 4's bits (the main compares them,
     at T % 4 == 0 and not).
  6  version 5 in fewer registers, for occupancy. On the H200 (ncu, 2f0feb7) version 5's two passes take 250 and
     252 registers a thread: two blocks of 4 warps an SM (12.5% occupancy), IPC 0.8-1.0, latency-bound. Version 6
     works each 64-wide tile of the other side in four chunks of 16 (flash_tc.cuh SPLIT: S^T / S and dP^T / dP
     of 16 columns, their scores, then those columns' k-step of dV, dK or dq, before the next chunk), so 2 x 32
     accumulator floats a thread become 2 x 8, and asks ptxas for three blocks an SM (__launch_bounds__(128, 3)):
     168 registers in both passes (the dk, dv pass spills 40 bytes, the dq pass none). Every accumulator takes
     its k-steps in the whole tile's order, so version 5's bits (the main compares them; a negative control in
     tests/test_cuda_cpusim.py takes the chunks last to first and must be caught). What it gives up: each chunk's
     four chains of mma.sync in flight a warp where version 5 had sixteen. Not yet timed on a GPU (the .cu's main
     and the bench's "vC5 (backward v6)" row time it beside version 5; REFBERT_ATTN_BWD16=6 runs it in C5).
  7  one pass, FlashAttention-2's way: version 5's dk, dv pass (its code: the same dk, dv bits) also forms each
     query tile's share of dq from its key tile, dq_i += scale sum_j ds_ij k_j: the warps' dS^T fragments go
     to shared memory transposed (the tile's q buffer, free once dK's product has read it; rounded to 16 bits as
     that product reads them), each warp takes its 16 query rows' A fragments from there and K (the block's k
     tile, kept in shared memory: 47.6 KB in all) as B, and adds the 16 x 64 result to a float32 buffer with
     atomicAdd; attn_bwd_dqcast rounds the buffer to storage. 5 tile products a tile pair where versions 2-6 take
     7 (S and dP computed once), no dq pass, and 32 float atomics a thread a tile pair (B H T^2 in all, as
     FlashAttention-2's). No longer the same bits every run: the atomics' order of additions is the GPU's (the
     embedding's "atomic" version's trade); dq within a float16 / bfloat16 rounding of version 5's (the emulator
     compares them). 255 registers, 16 bytes spilled. Not yet timed (the main and the bench's "vC5 (backward v7)"
     row time it; REFBERT_ATTN_BWD16=7 runs it in C5).
  8  version 7's one pass with each score's work cut to its arithmetic. ncu on the H100 found version 7
     latency-bound (two blocks of 4 warps an SM, IPC 0.91); its SASS spends some 40 instructions on each of a
     thread's 32 scores a tile pair, beside 160 mma.sync a warp: m, 1/l, D loaded per score, a bounds test, the
     mask's kind and dropout's threshold tested, an index formed for a Philox call per score that T % 4 == 0 never
     makes.
     Version 8 is compiled per case (attn_bwd_fused_v8: no dropout, z = 1 folded away; attn_bwd_fused_v8d:
     dropout's words a Philox call per 4 scores, their selects without branches), reads the mask terms of its two
     key rows once, m, 1/l and D once per two columns, takes exp by ex2.approx.ftz (common.cuh exp_ftz: __expf's
     value but 0 below 2^-126, where __expf spends a compare and two multiplies keeping subnormals), and drops the
     bounds tests on tiles whole inside T (and dq's atomics' too): its loop on a whole tile pair is 967 SASS
     instructions without dropout (160 of them mma.sync; sm_90, cuobjdump of a build with the tail tiles' path
     compiled out), where version 7's loop, built with its dropout paths cut, is 3,220 (statically: its per-score
     tests and both mask paths among them), 235 registers, no spills;
     the dropout kernel 1,725, 255 registers, 12 bytes spilled (its Philox calls). Each score is version 7's
     expression, so dk, dv are version 7's bits wherever no p falls below 2^-126 (the main compares them with and
     without dropout, and a negative control unmasks its whole tiles). It takes masks constant along the queries
     (or none), and dropout only at T % 4 == 0: otherwise the launchers run version 7's kernel. Written without a GPU
     (2026-11-28): not yet timed (the main and the bench's "vC5 (backward v8)" row time it; REFBERT_ATTN_BWD16=8 runs
     it in C5).

Build and run standalone (validates against the CPU reference, then times; fp16 / bf16: versions 1 and 2 against
the reference of the same rounded inputs):
    nvcc -O3 -arch=sm_90 -std=c++17 -o attention_backward attention_backward.cu && ./attention_backward [T [p]]
On CPU threads, the tensor-core kernels included:
    g++ -std=c++20 -O1 -pthread -ffp-contract=off -DCPUSIM -DCPUSIM_SMALL -DCPUSIM_HALF -x c++ attention_backward.cu
Compile check only (tests/test_cuda_nvcc.py):  nvcc -arch=sm_90 -std=c++17 -c attention_backward.cu
*/
#include "common.cuh"
#include "flash_tc.cuh"

// ----------------------------------------------------------------------------------------------------------------
// CPU code reference (the forward's statistics are recomputed here too)

#ifdef HOST_CODE
void attention_backward_cpu(const float* q, const float* k, const float* v, const float* mask, long long sb,
                            long long sh, long long si, long long sj, int B, int T, int H, int hs, float scale,
                            u64 seed, u64 stream, u64 thresh, float dscale, const float* dout, float* dq, float* dk,
                            float* dv) {
    int C = H * hs;
    size_t n = (size_t)B * T * C;
    std::fill(dq, dq + n, 0.f); std::fill(dk, dk + n, 0.f); std::fill(dv, dv + n, 0.f);
    std::vector<float> p(T), dp(T);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < T; i++) {
                const float* qi = q + ((size_t)b * T + i) * C + h * hs;
                const float* doi = dout + ((size_t)b * T + i) * C + h * hs;
                float mx = -INFINITY, l = 0.f, D = 0.f;
                for (int j = 0; j < T; j++) {
                    const float* kj = k + ((size_t)b * T + j) * C + h * hs;
                    float a = 0.f;
                    for (int d = 0; d < hs; d++) a += qi[d] * kj[d];
                    p[j] = a * scale + (mask ? mask[b * sb + h * sh + i * si + j * sj] : 0.f);
                    mx = fmaxf(mx, p[j]);
                }
                for (int j = 0; j < T; j++) { p[j] = expf(p[j] - mx); l += p[j]; }
                for (int j = 0; j < T; j++) {
                    p[j] /= l;
                    u64 e = (((u64)b * H + h) * T + i) * T + j;
                    float z = thresh == 0 || philox_word_host(e, stream, seed) >= thresh ? dscale : 0.f;
                    const float* vj = v + ((size_t)b * T + j) * C + h * hs;
                    float a = 0.f;
                    for (int d = 0; d < hs; d++) a += doi[d] * vj[d];
                    dp[j] = a * z;
                    D += p[j] * dp[j];
                    float* dvj = dv + ((size_t)b * T + j) * C + h * hs;
                    for (int d = 0; d < hs; d++) dvj[d] += p[j] * z * doi[d];
                }
                float* dqi = dq + ((size_t)b * T + i) * C + h * hs;
                for (int j = 0; j < T; j++) {
                    float ds = p[j] * (dp[j] - D) * scale;
                    const float* kj = k + ((size_t)b * T + j) * C + h * hs;
                    float* dkj = dk + ((size_t)b * T + j) * C + h * hs;
                    for (int d = 0; d < hs; d++) { dqi[d] += ds * kj[d]; dkj[d] += ds * qi[d]; }
                }
            }
}
#endif

// ----------------------------------------------------------------------------------------------------------------
// GPU kernels

#define BWD_MROW 2048           // version 4's dq pass stages the mask row in shared memory up to this T
#define BWD_ARGS(T)                                                                                             \
    const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v, const float *__restrict__ mask,   \
        long long sb, long long sh, long long si, long long sj, int B, int Tn, int H, float scale, u64 seed,     \
        u64 stream, u64 thresh, float dscale, const float *__restrict__ m, const float *__restrict__ linv,       \
        const T *__restrict__ dout, const float *__restrict__ Dr

// D_i = dout_i . out_i: a warp per (b, h, i) row, block 256 (8 rows), grid ceil(B*H*T / 8)
template <typename T>
__device__ __forceinline__ void bwd_D(const T* __restrict__ dout, const T* __restrict__ out, int B, int Tn, int H,
                                      int hs, float* __restrict__ Dr) {
    const int r = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (r >= B * H * Tn) return;                              // warp-uniform
    const int i = r % Tn, h = (r / Tn) % H, b = r / (Tn * H);
    const size_t base = ((size_t)b * Tn + i) * H * hs + h * hs;
    float a = 0.f;
    for (int d = lane; d < hs; d += 32) a += to_f(dout[base + d]) * to_f(out[base + d]);
    a = warp_sum(a);
    if (lane == 0) Dr[r] = a;
}

// version 1, pass 1: dk, dv per key tile (a thread per key row)
template <typename T, int HS>
__device__ __forceinline__ void bwd_dkdv_scalar(BWD_ARGS(T), T* __restrict__ dk, T* __restrict__ dv) {
    constexpr int BKEY = 64, BQT = 32;
    __shared__ T Qs[BQT][HS];
    __shared__ T Ds_[BQT][HS];                                // dout tile
    __shared__ float Ms[BQT], Ls[BQT], Dsum[BQT];
    const int t = threadIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;
    const int C = H * HS, j = blockIdx.x * BKEY + t;
    const bool active = j < Tn;
    const size_t base = (size_t)b * Tn * C + h * HS;
    float kr[HS], vr[HS], dka[HS], dva[HS];
#pragma unroll
    for (int d = 0; d < HS; d++) {
        kr[d] = active ? to_f(k[base + (size_t)j * C + d]) : 0.f;
        vr[d] = active ? to_f(v[base + (size_t)j * C + d]) : 0.f;
        dka[d] = dva[d] = 0.f;
    }
    for (int i0 = 0; i0 < Tn; i0 += BQT) {
        const int ni = min(BQT, Tn - i0);
        __syncthreads();
        for (int x = t; x < ni * HS; x += BKEY) {
            int ii = x / HS, d = x % HS;
            Qs[ii][d] = q[base + (size_t)(i0 + ii) * C + d];
            Ds_[ii][d] = dout[base + (size_t)(i0 + ii) * C + d];
        }
        for (int ii = t; ii < ni; ii += BKEY) {
            Ms[ii] = m[(size_t)bh * Tn + i0 + ii];
            Ls[ii] = linv[(size_t)bh * Tn + i0 + ii];
            Dsum[ii] = Dr[(size_t)bh * Tn + i0 + ii];
        }
        __syncthreads();
        if (!active) continue;
        for (int ii = 0; ii < ni; ii++) {
            const int i = i0 + ii;
            float a = 0.f, dpd = 0.f;
#pragma unroll
            for (int d = 0; d < HS; d++) { a += to_f(Qs[ii][d]) * kr[d]; dpd += to_f(Ds_[ii][d]) * vr[d]; }
            float s = a * scale + (mask ? mask[b * sb + h * sh + i * si + j * sj] : 0.f);
            float p = __expf(s - Ms[ii]) * Ls[ii];            // recomputed p_ij
            float z = keep_z(((u64)bh * Tn + i) * Tn + j, seed, stream, thresh, dscale);
            float ds = p * (dpd * z - Dsum[ii]), pz = p * z;
#pragma unroll
            for (int d = 0; d < HS; d++) { dva[d] += pz * to_f(Ds_[ii][d]); dka[d] += ds * to_f(Qs[ii][d]); }
        }
    }
    if (active) {
#pragma unroll
        for (int d = 0; d < HS; d++) {
            dk[base + (size_t)j * C + d] = from_f<T>(dka[d] * scale);
            dv[base + (size_t)j * C + d] = from_f<T>(dva[d]);
        }
    }
}

// version 1, pass 2: dq per query tile (a thread per query row)
template <typename T, int HS>
__device__ __forceinline__ void bwd_dq_scalar(BWD_ARGS(T), T* __restrict__ dq) {
    constexpr int BQ = 64, BK = 32;
    __shared__ T Ks[BK][HS];
    __shared__ T Vs[BK][HS];
    const int t = threadIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;
    const int C = H * HS, i = blockIdx.x * BQ + t;
    const bool active = i < Tn;
    const size_t base = (size_t)b * Tn * C + h * HS;
    float qr[HS], dor[HS], dqa[HS];
#pragma unroll
    for (int d = 0; d < HS; d++) {
        qr[d] = active ? to_f(q[base + (size_t)i * C + d]) : 0.f;
        dor[d] = active ? to_f(dout[base + (size_t)i * C + d]) : 0.f;
        dqa[d] = 0.f;
    }
    const float mi = active ? m[(size_t)bh * Tn + i] : 0.f, li = active ? linv[(size_t)bh * Tn + i] : 0.f;
    const float Di = active ? Dr[(size_t)bh * Tn + i] : 0.f;
    for (int j0 = 0; j0 < Tn; j0 += BK) {
        const int nk = min(BK, Tn - j0);
        __syncthreads();
        for (int x = t; x < nk * HS; x += BQ) {
            int jj = x / HS, d = x % HS;
            Ks[jj][d] = k[base + (size_t)(j0 + jj) * C + d];
            Vs[jj][d] = v[base + (size_t)(j0 + jj) * C + d];
        }
        __syncthreads();
        if (!active) continue;
        for (int jj = 0; jj < nk; jj++) {
            const int j = j0 + jj;
            float a = 0.f, dpd = 0.f;
#pragma unroll
            for (int d = 0; d < HS; d++) { a += qr[d] * to_f(Ks[jj][d]); dpd += dor[d] * to_f(Vs[jj][d]); }
            float s = a * scale + (mask ? mask[b * sb + h * sh + i * si + j * sj] : 0.f);
            float p = __expf(s - mi) * li;
            float z = keep_z(((u64)bh * Tn + i) * Tn + j, seed, stream, thresh, dscale);
            float ds = p * (dpd * z - Di);
#pragma unroll
            for (int d = 0; d < HS; d++) dqa[d] += ds * to_f(Ks[jj][d]);
        }
    }
    if (active) {
#pragma unroll
        for (int d = 0; d < HS; d++) dq[base + (size_t)i * C + d] = from_f<T>(dqa[d] * scale);
    }
}

#ifdef HALF_TYPES
// ----------------------------------------------------------------------------------------------------------------
// version 2: tensor cores (mma.sync m16n8k16, fp16 / bf16 inputs, fp32 accumulators), hs = 64, the two passes of
// version 1 with 64 x 64 tiles: a CTA of 4 warps per (b, h, 64-row tile), each warp owning 16 rows; the tile's own
// rows (k, v for pass 1; q, dout for pass 2) kept as A fragments in registers, the other side's 64-row tiles
// double-buffered in shared memory with cp.async. Every product is a tensor-core GEMM on 16-bit operands:
//   pass 1 (per key tile):    S^T = K Q^T, dP^T = V dout^T            (16 keys x 64 queries per warp)
//                             P^T = exp(scale S^T + mask - m) / l,  dS^T = P^T (z dP^T - D)
//                             dV += (z P)^T dout,  dK += dS^T q        (z P and dS rounded to 16 bits first)
//   pass 2 (per query tile):  S = q K^T, dP = dout V^T, P, dS as above, dq += dS K
// P and dS are rounded to the storage dtype where a tensor core reads them (as FlashAttention-2 does); the
// statistics, exp, the products' sums and dk / dv / dq stay float32 until the one rounding of the store.

// pass 1: dk, dv per 64-key tile; grid (ceil(T / 64), B * H), block 128. SKIP (version 3): a key tile of padding
// (common.cuh keys_all_padding) skips every query tile whose rows all met a real key in the forward (m > PAD_MIN)
// V4 (version 4): version 3 with the B fragments by ldmatrix (flash_tc.cuh LDSM) and, under a mask constant along
// the queries (si == 0), the mask of the thread's two key rows read once into registers instead of once per score:
// the same values in the same order, so version 3's bits
// V5 (version 5): version 4 with dropout's words drawn a Philox call per 4 scores when T % 4 == 0 (flash_tc.cuh
// tc_words_cols: the four lanes of 4 consecutive keys draw a block each and trade by three shuffles), a call per
// score otherwise: the same words, so version 4's bits
// SPLIT (version 6: 4): version 5 with each query tile worked in SPLIT chunks (flash_tc.cuh tc_bwd_keys): its bits
// FUSED (version 7): version 5's dk, dv (its bits) and in the same pass each query tile's share of dq from this key
// tile, dq_i += scale sum_j ds_ij k_j over the block's 64 keys, added to dqacc ((B, T, C) float32, zeroed by the
// launcher) with atomicAdd: dS^T goes through the tile's q buffer transposed (rows = queries, rounded to 16 bits as
// the dK product reads it), each warp takes 16 query rows' A fragments from it and K (Kres, the block's k tile kept
// in shared memory) as B; 32 float atomics a thread a query tile
// dk = scale dK and dv of the thread's two key rows (jr: those below T), each rounded once to storage
template <typename T>
__device__ __forceinline__ void tc_store_keys(T* __restrict__ dk, T* __restrict__ dv, const float (&dka)[8][4],
                                              const float (&dva)[8][4], const int (&jr)[2], size_t base, int C,
                                              int Tn, int t4, float scale) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (jr[r] >= Tn) continue;
        T* kp = dk + base + (size_t)jr[r] * C + t4 * 2;
        T* vp = dv + base + (size_t)jr[r] * C + t4 * 2;
#pragma unroll
        for (int n = 0; n < 8; n++) {
            kp[n * 8] = from_f<T>(dka[n][2 * r] * scale);
            kp[n * 8 + 1] = from_f<T>(dka[n][2 * r + 1] * scale);
            vp[n * 8] = from_f<T>(dva[n][2 * r]);
            vp[n * 8 + 1] = from_f<T>(dva[n][2 * r + 1]);
        }
    }
}

template <typename T, bool SKIP, bool V4 = false, bool V5 = false, int SPLIT = 1, bool FUSED = false>
__device__ __forceinline__ void bwd_dkdv_tc(BWD_ARGS(T), T* __restrict__ dk, T* __restrict__ dv,
                                            float* __restrict__ dqacc = nullptr, T* Kres = nullptr) {
    const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t4 = lane & 3, warp = tid >> 5;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, j0 = blockIdx.x * 64, C = H * 64;
    const size_t base = (size_t)b * Tn * C + h * 64;
    const bool keypad = SKIP && mask && si == 0 && keys_all_padding(mask, b * sb + h * sh, sj, j0, Tn, tid);
    const int jr[2] = {j0 + warp * 16 + g, j0 + warp * 16 + g + 8};   // this thread's two key rows
    const bool staged = V4 && mask && si == 0;
    float mk[2] = {0.f, 0.f};
    if (staged)
#pragma unroll
        for (int r = 0; r < 2; r++) mk[r] = jr[r] < Tn ? mask[b * sb + h * sh + jr[r] * sj] : 0.f;
    float dka[8][4], dva[8][4];
    // (flash_tc.cuh: S^T, dP^T per query tile; here p = exp(x - m) linv, pz = p z, ds = p (dp z - D))
    auto score = [&](float s, float dp, int i, int j, float mi, float li, float D, float z, float& pz, float& ds) {
        const float x = s * scale + (mask ? (staged ? (j == jr[0] ? mk[0] : mk[1])
                                                    : mask[b * sb + h * sh + i * si + j * sj])
                                          : 0.f);
        const float p = __expf(x - mi) * li;
        pz = p * z;
        ds = p * (dp * z - D);
    };
    if constexpr (V5) {
        const bool quad = thresh && (Tn & 3) == 0;            // (uniform: every lane draws, or none)
        auto elem = [&](float s, float dp, int i, int j, float mi, float li, float D, float& pz, float& ds,
                        u32 w) {
            const float z = quad ? ((u64)w >= thresh ? dscale : 0.f)
                                 : keep_z(((u64)bh * Tn + i) * Tn + j, seed, stream, thresh, dscale);
            score(s, dp, i, j, mi, li, D, z, pz, ds);
        };
        auto words = [&](int n, int i0, u32 (&w)[4]) {
            if (quad) tc_words_cols(w, bh, Tn, j0 + warp * 16 + (g & ~3), i0 + n * 8 + t4 * 2, g & 3, seed, stream);
        };
        if constexpr (FUSED) {
            tc_load_tile(Kres, k + base, j0, Tn, C, tid);  // (tc_bwd_keys' staging commits and awaits it)
            auto after = [&](int i0, const float (&ds)[8][4], T* DS) {
                __syncthreads();                           // every warp done with this tile's q (DS) and dout
#pragma unroll
                for (int n = 0; n < 8; n++)
#pragma unroll
                    for (int e = 0; e < 4; e++)            // DS[query][key]: dS, the transpose of the warps' dS^T
                        DS[(n * 8 + t4 * 2 + (e & 1)) * TC_LD + warp * 16 + g + 8 * (e >> 1)] = from_f<T>(ds[n][e]);
                __syncthreads();
                u32 a[4][4];                               // this warp's 16 query rows of dS, 4 k-steps of keys
#pragma unroll
                for (int kk = 0; kk < 4; kk++) tc_frag_a(a[kk], DS, warp * 16, kk * 16, g, t4);
#pragma unroll
                for (int nb = 0; nb < 8; nb += 4) {        // two halves of the head's 64 columns
                    float acc[4][4];
                    tc_frags_times<T, 4>(acc, a, Kres, nb);
#pragma unroll
                    for (int c = 0; c < 4; c++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            const int i = i0 + warp * 16 + g + 8 * (e >> 1);
                            if (i < Tn)
                                atomicAdd(dqacc + base + (size_t)i * C + (nb + c) * 8 + t4 * 2 + (e & 1),
                                          acc[c][e] * scale);
                        }
                }
            };
            tc_bwd_keys<T, V4, true, 1>(q, k, v, dout, m, linv, Dr, 0.f, Tn, C, base, bh, j0, keypad, dka, dva, elem,
                                        words, after);
        } else {
            tc_bwd_keys<T, V4, true, SPLIT>(q, k, v, dout, m, linv, Dr, 0.f, Tn, C, base, bh, j0, keypad, dka, dva,
                                            elem, words);
        }
    } else {
        tc_bwd_keys<T, V4>(q, k, v, dout, m, linv, Dr, 0.f, Tn, C, base, bh, j0, keypad, dka, dva,
                           [&](float s, float dp, int i, int j, float mi, float li, float D, float& pz, float& ds) {
                               score(s, dp, i, j, mi, li, D,
                                     keep_z(((u64)bh * Tn + i) * Tn + j, seed, stream, thresh, dscale), pz, ds);
                           });
    }
    tc_store_keys<T>(dk, dv, dka, dva, jr, base, C, Tn, t4, scale);
}

// pass 2: dq per 64-query tile; grid (ceil(T / 64), B * H), block 128. SKIP (version 3): when every row of the
// tile met a real key in the forward (m > PAD_MIN), key tiles of padding are skipped
// V4 (version 4): the B fragments by ldmatrix; under a mask constant along the queries with T <= 2048, the (b, h)
// mask row read once into shared memory (Mrow, the kernel's) instead of once per score: version 3's bits
// V5 (version 5): version 4 with dropout's words a Philox call per 4 scores when T % 4 == 0 (flash_tc.cuh
// tc_words_rows: lanes t4 = 2G, 2G + 1 draw a row each and trade two words), a call per score otherwise: its bits
// SPLIT (version 6: 4): version 5 with each key tile worked in SPLIT chunks (flash_tc.cuh tc_bwd_queries): its bits
template <typename T, bool SKIP, bool V4 = false, bool V5 = false, int SPLIT = 1>
__device__ __forceinline__ void bwd_dq_tc(BWD_ARGS(T), T* __restrict__ dq, float* Mrow = nullptr) {
    const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t4 = lane & 3, warp = tid >> 5;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, i0 = blockIdx.x * 64, C = H * 64;
    const size_t base = (size_t)b * Tn * C + h * 64;
    const int ir[2] = {i0 + warp * 16 + g, i0 + warp * 16 + g + 8};   // this thread's two query rows
    float mi[2], li[2], Di[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const bool ok = ir[r] < Tn;
        mi[r] = ok ? m[(size_t)bh * Tn + ir[r]] : 0.f;
        li[r] = ok ? linv[(size_t)bh * Tn + ir[r]] : 0.f;
        Di[r] = ok ? Dr[(size_t)bh * Tn + ir[r]] : 0.f;
    }
    const bool rows_real = SKIP && mask && si == 0 && !__syncthreads_or(mi[0] <= PAD_MIN || mi[1] <= PAD_MIN);
    const bool staged = V4 && mask && si == 0 && Tn <= BWD_MROW;
    if (staged)                                           // (read after tc_bwd_queries' first barrier)
        for (int j = tid; j < Tn; j += 128) Mrow[j] = mask[b * sb + h * sh + j * sj];
    float dqa[8][4];
    // (flash_tc.cuh: S, dP per key tile; here ds = p (dp z - D), p = exp(x - m) linv)
    auto skip = [&](int j0) {                                 // (rows_real: block-uniform)
        return rows_real && keys_all_padding(mask, b * sb + h * sh, sj, j0, Tn, tid);
    };
    auto score = [&](float s, float dp, int i, int j, float mr, float lr, float D, float z) {
        const float x = s * scale + (mask ? (staged ? Mrow[j] : mask[b * sb + h * sh + i * si + j * sj]) : 0.f);
        const float p = __expf(x - mr) * lr;
        return p * (dp * z - D);
    };
    if constexpr (V5) {
        const bool quad = thresh && (Tn & 3) == 0;            // (uniform: every lane draws, or none)
        auto elem = [&](float s, float dp, int i, int j, float mr, float lr, float D, u32 w) {
            const float z = quad ? ((u64)w >= thresh ? dscale : 0.f)
                                 : keep_z(((u64)bh * Tn + i) * Tn + j, seed, stream, thresh, dscale);
            return score(s, dp, i, j, mr, lr, D, z);
        };
        auto words = [&](int n, int j0, u32 (&w)[4]) {
            if (quad) tc_words_rows(w, bh, Tn, ir[0], ir[1], j0 + n * 8, t4, seed, stream);
        };
        tc_bwd_queries<T, V4, true, SPLIT>(q, k, v, dout, mi, li, Di, Tn, C, base, i0, dqa, skip, elem, words);
    } else {
        tc_bwd_queries<T, V4>(q, k, v, dout, mi, li, Di, Tn, C, base, i0, dqa, skip,
                              [&](float s, float dp, int i, int j, float mr, float lr, float D) {
                                  return score(s, dp, i, j, mr, lr, D,
                                               keep_z(((u64)bh * Tn + i) * Tn + j, seed, stream, thresh, dscale));
                              });
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (ir[r] >= Tn) continue;
        T* qp = dq + base + (size_t)ir[r] * C + t4 * 2;
#pragma unroll
        for (int n = 0; n < 8; n++) {
            qp[n * 8] = from_f<T>(dqa[n][2 * r] * scale);
            qp[n * 8 + 1] = from_f<T>(dqa[n][2 * r + 1] * scale);
        }
    }
}

// version 8: version 7's one pass with the per-score work cut to its arithmetic. ncu on the H100 (719a3b9) found
// version 7 latency-bound (2 blocks of 4 warps an SM, IPC 0.91), and its SASS spends some 40 instructions on each
// score's generic path (its m, 1/l, D loaded from shared memory, its bounds test, the mask's kind and pointer
// tested, the dropout threshold and Philox path tested, an index computed for a Philox call a score that T % 4 == 0
// never makes), 32 scores a thread a tile pair beside 160 mma.sync a warp. Here, per query tile:
//   - the kernel is compiled for one case: DROP (dropout's words a Philox call per 4 scores, T % 4 == 0) or no
//     dropout (thresh 0, dscale 1); the mask constant along the queries or none (the launcher runs version 7 for
//     any other case);
//   - the thread's two key rows' mask terms in registers (mk), its 2 x 8 query columns' m, 1/l and D read as
//     float2 once an n-tile (3 loads for 4 scores, where version 7 takes 12);
//   - tiles whole inside T (block-uniform) take the scores without bounds tests (the tail tiles keep them: a score
//     outside T is 0);
//   - dq's atomics through two row pointers a thread, unguarded on whole tiles.
// Each score is version 7's expression (x = s scale + mask, p = exp(x - m) / l, pz = p z, ds = p (dp z - D); no
// dropout: z = dscale = 1, folded away, exactly), with exp_ftz for __expf (the same value but 0 where it falls below
// 2^-126), so dk and dv are version 7's (and 5's) bits wherever no p is that small, and dq's shares the same terms
// (the main compares dk, dv bit for bit and validates dq).
template <bool V> struct BoolTag { static constexpr bool value = V; };   // (a compile-time flag as an argument)
template <typename T, bool DROP>
__device__ __forceinline__ void bwd_fused_v8(BWD_ARGS(T), T* __restrict__ dk, T* __restrict__ dv,
                                             float* __restrict__ dqacc) {
    __shared__ __align__(16) T Qs[2][64 * TC_LD];
    __shared__ __align__(16) T Os[2][64 * TC_LD];             // dout tiles
    __shared__ __align__(16) T Kres[64 * TC_LD];              // the block's k tile, B of dq's share
    __shared__ __align__(16) float R[2][3][64];               // the query tile's m, 1/l, D
    const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t4 = lane & 3, warp = tid >> 5;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, j0 = blockIdx.x * 64, C = H * 64;
    const size_t base = (size_t)b * Tn * C + h * 64;
    const bool keypad = mask && keys_all_padding(mask, b * sb + h * sh, sj, j0, Tn, tid);
    const int jr[2] = {j0 + warp * 16 + g, j0 + warp * 16 + g + 8};   // this thread's two key rows
    float mk[2];
#pragma unroll
    for (int r = 0; r < 2; r++) mk[r] = mask && jr[r] < Tn ? mask[b * sb + h * sh + jr[r] * sj] : 0.f;
    u32 ka[4][4], va[4][4];                                   // the key tile's k and v, through the second buffers
    tc_load_tile(Kres, k + base, j0, Tn, C, tid);             // (tc_stage_frags commits and awaits it)
    tc_stage_frags(ka, va, Qs[1], Os[1], k + base, v + base, j0, Tn, C);
    float dka[8][4], dva[8][4];
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) dka[n][e] = dva[n][e] = 0.f;
    auto load = [&](int buf, int i0) {
        tc_load_tile(Qs[buf], q + base, i0, Tn, C, tid);
        tc_load_tile(Os[buf], dout + base, i0, Tn, C, tid);
        if (tid < 64) {
            const bool ok = i0 + tid < Tn;
            const size_t r = (size_t)bh * Tn + i0 + tid;
            R[buf][0][tid] = ok ? m[r] : 0.f;
            R[buf][1][tid] = ok ? linv[r] : 0.f;
            R[buf][2][tid] = ok ? Dr[r] : 0.f;
        }
    };
    // the scores of one query tile: s (S^T) becomes pz, dp (dP^T) becomes ds; CHECK: zero outside T
    auto scores = [&](auto check, float (&s)[8][4], float (&dp)[8][4], int cur, int i0) {
        constexpr bool CHECK = decltype(check)::value;
#pragma unroll
        for (int n = 0; n < 8; n++) {
            const int ii = n * 8 + t4 * 2;                    // the thread's columns ii, ii + 1 of the tile
            u32 w[4] = {};                                    // (every lane draws: the words are traded by shuffles)
            (void)w;
            if constexpr (DROP)
                tc_words_cols<true>(w, bh, Tn, j0 + warp * 16 + (g & ~3), i0 + ii, g & 3, seed, stream);
            const float2 mi = *reinterpret_cast<const float2*>(&R[cur][0][ii]);
            const float2 li = *reinterpret_cast<const float2*>(&R[cur][1][ii]);
            const float2 Di = *reinterpret_cast<const float2*>(&R[cur][2][ii]);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float x = s[n][e] * scale + mk[e >> 1];
                const float p = exp_ftz(x - (e & 1 ? mi.y : mi.x)) * (e & 1 ? li.y : li.x);
                float pz, ds;
                if constexpr (DROP) {
                    const float z = (u64)w[e] >= thresh ? dscale : 0.f;
                    pz = p * z;
                    ds = p * (dp[n][e] * z - (e & 1 ? Di.y : Di.x));
                } else {                                      // (z = dscale = 1: p z = p, dp z - D = dp - D exactly)
                    pz = p;
                    ds = p * (dp[n][e] - (e & 1 ? Di.y : Di.x));
                }
                if (CHECK && !(i0 + ii + (e & 1) < Tn && jr[e >> 1] < Tn)) pz = ds = 0.f;
                s[n][e] = pz;
                dp[n][e] = ds;
            }
        }
    };
    load(0, 0);
    cp_async_commit();
    const int ntiles = (Tn + 63) / 64;
    for (int it = 0; it < ntiles; it++) {
        const int cur = it & 1, i0 = it * 64;
        if (it + 1 < ntiles) load(cur ^ 1, i0 + 64);          // the next query tile streams in meanwhile
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        if (keypad && !__syncthreads_or(tid < 64 && R[cur][0][tid] <= PAD_MIN)) {   // (keypad: block-uniform)
            COUNT_SKIP(tid);
            __syncthreads();
            continue;
        }
        float s[8][4], dp[8][4];
        tc_rows_times_t<T, false, 8>(s, ka, Qs[cur], g, t4);  // S^T: keys x queries
        tc_rows_times_t<T, false, 8>(dp, va, Os[cur], g, t4); // dP^T = V dout^T
        const bool whole = i0 + 64 <= Tn && j0 + 64 <= Tn;    // (block-uniform)
        if (whole)
            scores(BoolTag<false>(), s, dp, cur, i0);
        else
            scores(BoolTag<true>(), s, dp, cur, i0);
        tc_acc_times<T, true, 8>(dva, s, Os[cur], g, t4);     // dV += pz^T dout
        tc_acc_times<T, true, 8>(dka, dp, Qs[cur], g, t4);    // dK += ds^T q
        // dq's share of this key tile, dq_i += scale sum_j ds_ij k_j: dS^T through Qs[cur] transposed (version 7's)
        T* DS = Qs[cur];
        __syncthreads();                                      // every warp done with this tile's q
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++)                       // DS[query][key]
                DS[(n * 8 + t4 * 2 + (e & 1)) * TC_LD + warp * 16 + g + 8 * (e >> 1)] = from_f<T>(dp[n][e]);
        __syncthreads();
        u32 a[4][4];                                          // this warp's 16 query rows of dS, 4 k-steps of keys
#pragma unroll
        for (int kk = 0; kk < 4; kk++) tc_frag_a(a[kk], DS, warp * 16, kk * 16, g, t4);
        const int i = i0 + warp * 16 + g;                     // the thread's query rows i, i + 8
        float* row[2] = {dqacc + base + (size_t)i * C + t4 * 2, dqacc + base + (size_t)(i + 8) * C + t4 * 2};
        auto dq_share = [&](auto check) {                     // CHECK: rows past T left out
            constexpr bool CHECK = decltype(check)::value;
#pragma unroll
            for (int nb = 0; nb < 8; nb += 4) {               // two halves of the head's 64 columns
                float acc[4][4];
                tc_frags_times<T, 4>(acc, a, Kres, nb);
#pragma unroll
                for (int c = 0; c < 4; c++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        if (!CHECK || i + 8 * (e >> 1) < Tn)
                            atomicAdd(row[e >> 1] + (nb + c) * 8 + (e & 1), acc[c][e] * scale);
            }
        };
        if (whole)
            dq_share(BoolTag<false>());
        else
            dq_share(BoolTag<true>());
        __syncthreads();                                      // this tile's buffers may be refilled next
    }
    tc_store_keys<T>(dk, dv, dka, dva, jr, base, C, Tn, t4, scale);
}
#endif  // HALF_TYPES

// the names cuda_c.py loads: attn_bwd_D_<dtype> (block 256, grid ceil(B*H*T / 8)),
// attn_bwd_dkdv_v1_<dtype>_hs<hs>, attn_bwd_dq_v1_<dtype>_hs<hs> (block 64, grid (ceil(T / 64), B * H)),
// attn_bwd_dkdv_v<2-6>_<f16|bf16>_hs64, attn_bwd_dq_v<2-6>_<f16|bf16>_hs64 (block 128, the same grid),
// attn_bwd_fused_v7_<f16|bf16>_hs64 (block 128, the same grid) and attn_bwd_dqcast_<f16|bf16> (block 256),
// attn_bwd_fused_v8_<f16|bf16>_hs64 and attn_bwd_fused_v8d_<f16|bf16>_hs64 (version 7's arguments, grid and block)
#define FWD_CALL q, k, v, mask, sb, sh, si, sj, B, Tn, H, scale, seed, stream, thresh, dscale, m, linv, dout, Dr
#define INST_D(T, NAME)                                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                                           \
        attn_bwd_D_##NAME(const T* dout, const T* out, int B, int Tn, int H, int hs, float* Dr) {               \
        bwd_D<T>(dout, out, B, Tn, H, hs, Dr);                                                                  \
    }
#define INST_V1(T, NAME, HS)                                                                                     \
    extern "C" __global__ void __launch_bounds__(64) attn_bwd_dkdv_v1_##NAME##_hs##HS(BWD_ARGS(T), T* dk,      \
                                                                                       T* dv) {                 \
        bwd_dkdv_scalar<T, HS>(FWD_CALL, dk, dv);                                                               \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(64) attn_bwd_dq_v1_##NAME##_hs##HS(BWD_ARGS(T), T* dq) {      \
        bwd_dq_scalar<T, HS>(FWD_CALL, dq);                                                                     \
    }
INST_D(float, f32)
INST_V1(float, f32, 32)
INST_V1(float, f32, 64)
INST_V1(float, f32, 128)
#ifdef HALF_TYPES
INST_D(__half, f16)
INST_D(__nv_bfloat16, bf16)
INST_V1(__half, f16, 32)
INST_V1(__half, f16, 64)
INST_V1(__half, f16, 128)
INST_V1(__nv_bfloat16, bf16, 32)
INST_V1(__nv_bfloat16, bf16, 64)
INST_V1(__nv_bfloat16, bf16, 128)
#define INST_TC(T, NAME, V, SKIP)                                                                                \
    extern "C" __global__ void __launch_bounds__(128) attn_bwd_dkdv_v##V##_##NAME##_hs64(BWD_ARGS(T), T* dk,     \
                                                                                        T* dv) {                \
        bwd_dkdv_tc<T, SKIP>(FWD_CALL, dk, dv);                                                                 \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(128) attn_bwd_dq_v##V##_##NAME##_hs64(BWD_ARGS(T), T* dq) {   \
        bwd_dq_tc<T, SKIP>(FWD_CALL, dq);                                                                       \
    }
INST_TC(__half, f16, 2, false)
INST_TC(__nv_bfloat16, bf16, 2, false)
INST_TC(__half, f16, 3, true)
INST_TC(__nv_bfloat16, bf16, 3, true)
// version 4: version 3 with ldmatrix fragments and the mask read once (the same grid and block)
#define INST_TC4(T, NAME)                                                                                        \
    extern "C" __global__ void __launch_bounds__(128) attn_bwd_dkdv_v4_##NAME##_hs64(BWD_ARGS(T), T* dk,        \
                                                                                    T* dv) {                    \
        bwd_dkdv_tc<T, true, true>(FWD_CALL, dk, dv);                                                           \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(128) attn_bwd_dq_v4_##NAME##_hs64(BWD_ARGS(T), T* dq) {       \
        __shared__ float Mrow[BWD_MROW];                                                                        \
        bwd_dq_tc<T, true, true>(FWD_CALL, dq, Mrow);                                                           \
    }
INST_TC4(__half, f16)
INST_TC4(__nv_bfloat16, bf16)
// version 5: version 4 with dropout's words a Philox call per 4 scores (the same grid and block)
#define INST_TC5(T, NAME)                                                                                        \
    extern "C" __global__ void __launch_bounds__(128) attn_bwd_dkdv_v5_##NAME##_hs64(BWD_ARGS(T), T* dk,        \
                                                                                    T* dv) {                    \
        bwd_dkdv_tc<T, true, true, true>(FWD_CALL, dk, dv);                                                     \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(128) attn_bwd_dq_v5_##NAME##_hs64(BWD_ARGS(T), T* dq) {       \
        __shared__ float Mrow[BWD_MROW];                                                                        \
        bwd_dq_tc<T, true, true, true>(FWD_CALL, dq, Mrow);                                                     \
    }
INST_TC5(__half, f16)
INST_TC5(__nv_bfloat16, bf16)
// version 6: version 5 with each 64-wide tile worked in four chunks of 16 (SPLIT 4) and at least three blocks an SM
// asked of ptxas (__launch_bounds__(128, 3): at most 168 registers, against version 5's 250 / 252 and its two)
#define INST_TC6(T, NAME)                                                                                        \
    extern "C" __global__ void __launch_bounds__(128, 3) attn_bwd_dkdv_v6_##NAME##_hs64(BWD_ARGS(T), T* dk,     \
                                                                                       T* dv) {                 \
        bwd_dkdv_tc<T, true, true, true, 4>(FWD_CALL, dk, dv);                                                  \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(128, 3) attn_bwd_dq_v6_##NAME##_hs64(BWD_ARGS(T), T* dq) {    \
        __shared__ float Mrow[BWD_MROW];                                                                        \
        bwd_dq_tc<T, true, true, true, 4>(FWD_CALL, dq, Mrow);                                                  \
    }
INST_TC6(__half, f16)
INST_TC6(__nv_bfloat16, bf16)
// version 7: one pass, dk and dv as version 5 (its bits) and dq by float atomics into dqacc (zeroed first), then
// attn_bwd_dqcast_<dtype> rounds dqacc to storage: n elements, a thread each, block 256
#define INST_TC7(T, NAME)                                                                                        \
    extern "C" __global__ void __launch_bounds__(128) attn_bwd_fused_v7_##NAME##_hs64(BWD_ARGS(T), T* dk,       \
                                                                                     T* dv, float* dqacc) {     \
        __shared__ __align__(16) T Kres[64 * TC_LD];                                                            \
        bwd_dkdv_tc<T, true, true, true, 1, true>(FWD_CALL, dk, dv, dqacc, Kres);                               \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(256) attn_bwd_dqcast_##NAME(const float* dqacc, T* dq,        \
                                                                             long long n) {                     \
        const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;                                   \
        if (i < n) dq[i] = from_f<T>(dqacc[i]);                                                                 \
    }
INST_TC7(__half, f16)
INST_TC7(__nv_bfloat16, bf16)
// version 8: version 7's one pass compiled for one case each: no dropout (attn_bwd_fused_v8) or dropout's words a
// Philox call per 4 scores (attn_bwd_fused_v8d, T % 4 == 0); a mask constant along the queries or none; dq through
// dqacc and attn_bwd_dqcast as version 7
#define INST_TC8(T, NAME)                                                                                        \
    extern "C" __global__ void __launch_bounds__(128) attn_bwd_fused_v8_##NAME##_hs64(BWD_ARGS(T), T* dk,       \
                                                                                     T* dv, float* dqacc) {     \
        bwd_fused_v8<T, false>(FWD_CALL, dk, dv, dqacc);                                                        \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(128) attn_bwd_fused_v8d_##NAME##_hs64(BWD_ARGS(T), T* dk,      \
                                                                                      T* dv, float* dqacc) {    \
        bwd_fused_v8<T, true>(FWD_CALL, dk, dv, dqacc);                                                         \
    }
INST_TC8(__half, f16)
INST_TC8(__nv_bfloat16, bf16)
#endif

// ----------------------------------------------------------------------------------------------------------------
// kernel launcher, main (float32, hs = 64; the forward's m, 1/l and out come from the CPU reference)

#ifdef HOST_CODE
void attention_backward(const float* q, const float* k, const float* v, const float* mask, long long sb,
                        long long sh, long long si, long long sj, int B, int Tn, int H, float scale, u64 seed,
                        u64 stream, u64 thresh, float dscale, const float* m, const float* linv, const float* out,
                        const float* dout, float* Dr, float* dq, float* dk, float* dv) {
    LAUNCH(attn_bwd_D_f32, (B * H * Tn + 7) / 8, 256, dout, out, B, Tn, H, 64, Dr);
    dim3 grid((Tn + 63) / 64, B * H);
    LAUNCH(attn_bwd_dkdv_v1_f32_hs64, grid, 64, q, k, v, mask, sb, sh, si, sj, B, Tn, H, scale, seed, stream, thresh,
           dscale, m, linv, dout, Dr, dk, dv);
    LAUNCH(attn_bwd_dq_v1_f32_hs64, grid, 64, q, k, v, mask, sb, sh, si, sj, B, Tn, H, scale, seed, stream, thresh,
           dscale, m, linv, dout, Dr, dq);
    cudaCheck(cudaGetLastError());
}

#ifdef HALF_TYPES
// 16-bit storage: version 1 (scalar) or 2-7 (tensor cores), D by attn_bwd_D_<dtype>
template <typename T>
void attention_backward_16(int version, const T* q, const T* k, const T* v, const float* mask, int B, int Tn, int H,
                           float scale, u64 seed, u64 stream, u64 thresh, float dscale, const float* m,
                           const float* linv, const T* out, const T* dout, float* Dr, T* dq, T* dk, T* dv);
#define LAUNCHER16(T, NAME)                                                                                      \
    template <>                                                                                                 \
    void attention_backward_16<T>(int version, const T* q, const T* k, const T* v, const float* mask, int B,     \
                                  int Tn, int H, float scale, u64 seed, u64 stream, u64 thresh, float dscale,    \
                                  const float* m, const float* linv, const T* out, const T* dout, float* Dr,     \
                                  T* dq, T* dk, T* dv) {                                                        \
        LAUNCH(attn_bwd_D_##NAME, (B * H * Tn + 7) / 8, 256, dout, out, B, Tn, H, 64, Dr);                      \
        dim3 grid((Tn + 63) / 64, B * H);                                                                       \
        if (version == 1) {                                                                                     \
            LAUNCH(attn_bwd_dkdv_v1_##NAME##_hs64, grid, 64, q, k, v, mask, (long long)Tn, 0LL, 0LL, 1LL, B, Tn, \
                   H, scale, seed, stream, thresh, dscale, m, linv, dout, Dr, dk, dv);                          \
            LAUNCH(attn_bwd_dq_v1_##NAME##_hs64, grid, 64, q, k, v, mask, (long long)Tn, 0LL, 0LL, 1LL, B, Tn,   \
                   H, scale, seed, stream, thresh, dscale, m, linv, dout, Dr, dq);                              \
        } else if (version == 2) {                                                                              \
            LAUNCH(attn_bwd_dkdv_v2_##NAME##_hs64, grid, 128, q, k, v, mask, (long long)Tn, 0LL, 0LL, 1LL, B,    \
                   Tn, H, scale, seed, stream, thresh, dscale, m, linv, dout, Dr, dk, dv);                      \
            LAUNCH(attn_bwd_dq_v2_##NAME##_hs64, grid, 128, q, k, v, mask, (long long)Tn, 0LL, 0LL, 1LL, B, Tn,  \
                   H, scale, seed, stream, thresh, dscale, m, linv, dout, Dr, dq);                              \
        } else if (version == 3) {                                                                              \
            LAUNCH(attn_bwd_dkdv_v3_##NAME##_hs64, grid, 128, q, k, v, mask, (long long)Tn, 0LL, 0LL, 1LL, B,    \
                   Tn, H, scale, seed, stream, thresh, dscale, m, linv, dout, Dr, dk, dv);                      \
            LAUNCH(attn_bwd_dq_v3_##NAME##_hs64, grid, 128, q, k, v, mask, (long long)Tn, 0LL, 0LL, 1LL, B, Tn,  \
                   H, scale, seed, stream, thresh, dscale, m, linv, dout, Dr, dq);                              \
        } else if (version == 4) {                                                                              \
            LAUNCH(attn_bwd_dkdv_v4_##NAME##_hs64, grid, 128, q, k, v, mask, (long long)Tn, 0LL, 0LL, 1LL, B,    \
                   Tn, H, scale, seed, stream, thresh, dscale, m, linv, dout, Dr, dk, dv);                      \
            LAUNCH(attn_bwd_dq_v4_##NAME##_hs64, grid, 128, q, k, v, mask, (long long)Tn, 0LL, 0LL, 1LL, B, Tn,  \
                   H, scale, seed, stream, thresh, dscale, m, linv, dout, Dr, dq);                              \
        } else if (version == 5) {                                                                              \
            LAUNCH(attn_bwd_dkdv_v5_##NAME##_hs64, grid, 128, q, k, v, mask, (long long)Tn, 0LL, 0LL, 1LL, B,    \
                   Tn, H, scale, seed, stream, thresh, dscale, m, linv, dout, Dr, dk, dv);                      \
            LAUNCH(attn_bwd_dq_v5_##NAME##_hs64, grid, 128, q, k, v, mask, (long long)Tn, 0LL, 0LL, 1LL, B, Tn,  \
                   H, scale, seed, stream, thresh, dscale, m, linv, dout, Dr, dq);                              \
        } else if (version == 6) {                                                                              \
            LAUNCH(attn_bwd_dkdv_v6_##NAME##_hs64, grid, 128, q, k, v, mask, (long long)Tn, 0LL, 0LL, 1LL, B,    \
                   Tn, H, scale, seed, stream, thresh, dscale, m, linv, dout, Dr, dk, dv);                      \
            LAUNCH(attn_bwd_dq_v6_##NAME##_hs64, grid, 128, q, k, v, mask, (long long)Tn, 0LL, 0LL, 1LL, B, Tn,  \
                   H, scale, seed, stream, thresh, dscale, m, linv, dout, Dr, dq);                              \
        } else {              /* versions 7 and 8: one pass, dq through a float32 buffer by atomics */          \
            static float* acc = nullptr;                                                                        \
            static size_t have = 0;                                                                             \
            const size_t n = (size_t)B * Tn * H * 64;                                                           \
            if (have < n) {                                                                                     \
                if (acc) cudaCheck(cudaFree(acc));                                                              \
                cudaCheck(cudaMalloc(&acc, n * sizeof(float)));                                                 \
                have = n;                                                                                       \
            }                                                                                                   \
            cudaCheck(cudaMemset(acc, 0, n * sizeof(float)));                                                   \
            if (version == 8 && !thresh && dscale == 1.f)                                                       \
                LAUNCH(attn_bwd_fused_v8_##NAME##_hs64, grid, 128, q, k, v, mask, (long long)Tn, 0LL, 0LL, 1LL,  \
                       B, Tn, H, scale, seed, stream, thresh, dscale, m, linv, dout, Dr, dk, dv, acc);          \
            else if (version == 8 && Tn % 4 == 0)  /* (dropout at T % 4 != 0: version 7's kernel) */           \
                LAUNCH(attn_bwd_fused_v8d_##NAME##_hs64, grid, 128, q, k, v, mask, (long long)Tn, 0LL, 0LL, 1LL, \
                       B, Tn, H, scale, seed, stream, thresh, dscale, m, linv, dout, Dr, dk, dv, acc);          \
            else                                                                                                \
                LAUNCH(attn_bwd_fused_v7_##NAME##_hs64, grid, 128, q, k, v, mask, (long long)Tn, 0LL, 0LL, 1LL,  \
                       B, Tn, H, scale, seed, stream, thresh, dscale, m, linv, dout, Dr, dk, dv, acc);          \
            LAUNCH(attn_bwd_dqcast_##NAME, (unsigned)((n + 255) / 256), 256, acc, dq, (long long)n);            \
        }                                                                                                       \
        cudaCheck(cudaGetLastError());                                                                          \
    }
LAUNCHER16(__half, f16)
LAUNCHER16(__nv_bfloat16, bf16)
#endif

static float* dev_copy(const float* h, size_t n) {
    float* d;
    cudaCheck(cudaMalloc(&d, n * sizeof(float)));
    if (h) cudaCheck(cudaMemcpy(d, h, n * sizeof(float), cudaMemcpyHostToDevice));
    return d;
}

#ifdef HALF_TYPES
// versions 1 and 2 in 16-bit storage against the reference of the same inputs rounded to it (q, k, v, dout, and the
// forward's out for D): what differs is the kernels' own rounding, P and dS to `bits` significant bits where a
// tensor core reads them (version 2), and the outputs' one rounding to storage.
template <typename T, class Ref>
void run16(const char* name, int bits, int B, int Tn, int H, int hs, const float* q, const float* k, const float* v,
           const float* dout, const float* mask, float scale, u64 seed, u64 stream, u64 thresh, float dscale,
           Ref reference) {
    size_t n = (size_t)B * Tn * H * hs, nr = (size_t)B * H * Tn;
    auto rounded = [&](const float* x) {
        std::vector<float> r(n);
        for (size_t i = 0; i < n; i++) r[i] = (float)(T)x[i];
        return r;
    };
    std::vector<float> q16 = rounded(q), k16 = rounded(k), v16 = rounded(v), do16 = rounded(dout);
    std::vector<float> m, linv, out, rq, rk, rv;
    reference(q16.data(), k16.data(), v16.data(), do16.data(), m, linv, out, rq, rk, rv);
    auto dev16 = [&](const float* x) {
        std::vector<T> c(n);
        for (size_t i = 0; i < n; i++) c[i] = (T)x[i];
        T* d;
        cudaCheck(cudaMalloc(&d, n * sizeof(T)));
        cudaCheck(cudaMemcpy(d, c.data(), n * sizeof(T), cudaMemcpyHostToDevice));
        return d;
    };
    T *dq_ = dev16(q16.data()), *dk_ = dev16(k16.data()), *dv_ = dev16(v16.data()), *ddo = dev16(do16.data());
    T* dout_ = dev16(out.data());
    float *dmask = dev_copy(mask, (size_t)B * Tn), *dm = dev_copy(m.data(), nr), *dl = dev_copy(linv.data(), nr);
    float* dD = dev_copy(nullptr, nr);
    T *gq, *gk, *gv;
    cudaCheck(cudaMalloc(&gq, n * sizeof(T))); cudaCheck(cudaMalloc(&gk, n * sizeof(T)));
    cudaCheck(cudaMalloc(&gv, n * sizeof(T)));
    // the bound: a few units of the storage's rounding (2^-bits relative) on each gradient's scale, the largest
    // |reference| of the three: P and dS each rounded once per product term, the sums' terms of random sign, the
    // output rounded once (version 1 rounds only the output: its errors sit well inside)
    double scale_ref = 0.0;
    for (size_t i = 0; i < n; i++)
        scale_ref = std::max({scale_ref, (double)fabsf(rq[i]), (double)fabsf(rk[i]), (double)fabsf(rv[i])});
    const float u = std::ldexp(1.f, -bits), atol = (float)(4.0 * u * scale_ref), rtol = 2.f * u;
    std::vector<std::vector<T>> got(9);
    for (int version = 1; version <= 8; version++) {
        auto launch = [&]() {
            attention_backward_16<T>(version, dq_, dk_, dv_, dmask, B, Tn, H, scale, seed, stream, thresh, dscale,
                                     dm, dl, dout_, ddo, dD, gq, gk, gv);
        };
        launch();
        cudaCheck(cudaDeviceSynchronize());
        char label[32];
        snprintf(label, sizeof label, "v%d %s dq", version, name);
        validate_result(gq, rq.data(), label, n, atol, rtol);
        snprintf(label, sizeof label, "v%d %s dk", version, name);
        validate_result(gk, rk.data(), label, n, atol, rtol);
        snprintf(label, sizeof label, "v%d %s dv", version, name);
        validate_result(gv, rv.data(), label, n, atol, rtol);
        got[version].resize(3 * n);
        cudaCheck(cudaMemcpy(got[version].data(), gq, n * sizeof(T), cudaMemcpyDeviceToHost));
        cudaCheck(cudaMemcpy(got[version].data() + n, gk, n * sizeof(T), cudaMemcpyDeviceToHost));
        cudaCheck(cudaMemcpy(got[version].data() + 2 * n, gv, n * sizeof(T), cudaMemcpyDeviceToHost));
        float ms = benchmark_kernel(10, launch);
        printf("  v%d %s: %.4f ms, %.1f TFLOP/s (2.5 x 4 B H T^2 hs)\n", version, name, ms,
               2.5 * 4.0 * B * H * (double)Tn * Tn * hs / ms / 1e9);
    }
    // version 3 skips padding tiles: exact zeros skipped, so version 2's bits, or it is wrong
    const bool same = std::memcmp(got[2].data(), got[3].data(), 3 * n * sizeof(T)) == 0;
    printf("v3 = v2 bit for bit (%s dq, dk, dv): %s\n", name, same ? "yes" : "NO");
    // version 4 loads version 3's values another way: its bits, or it is wrong
    const bool same4 = std::memcmp(got[3].data(), got[4].data(), 3 * n * sizeof(T)) == 0;
    printf("v4 = v3 bit for bit (%s dq, dk, dv): %s\n", name, same4 ? "yes" : "NO");
    // version 5 draws version 4's dropout words with fewer Philox calls (T % 4 == 0; else as version 4): its bits
    const bool same5 = std::memcmp(got[4].data(), got[5].data(), 3 * n * sizeof(T)) == 0;
    printf("v5 = v4 bit for bit (%s dq, dk, dv, T %% 4 %s 0): %s\n", name, Tn % 4 ? "!=" : "==", same5 ? "yes" : "NO");
    // version 6 works version 5's tiles in chunks, each product's terms in the same order: its bits
    const bool same6 = std::memcmp(got[5].data(), got[6].data(), 3 * n * sizeof(T)) == 0;
    printf("v6 = v5 bit for bit (%s dq, dk, dv): %s\n", name, same6 ? "yes" : "NO");
    // version 7 computes version 5's dk, dv with the same code (its bits) and dq in one pass by atomics: dq in
    // another order of sums (validated above against the reference), not compared bit for bit
    const bool same7 = std::memcmp(got[5].data() + n, got[7].data() + n, 2 * n * sizeof(T)) == 0;
    printf("v7 = v5 bit for bit (%s dk, dv): %s\n", name, same7 ? "yes" : "NO");
    // version 8 computes each score as version 7 does (its own kernels without dropout, or with it at T % 4 == 0;
    // else version 7's kernel): version 7's dk, dv bits
    const bool same8 = std::memcmp(got[7].data() + n, got[8].data() + n, 2 * n * sizeof(T)) == 0;
    printf("v8 = v7 bit for bit (%s dk, dv; %s): %s\n", name,
           !thresh ? "its kernel, no dropout" : Tn % 4 ? "version 7's kernel: dropout, T % 4 != 0"
                                                       : "its kernel, dropout", same8 ? "yes" : "NO");
    if (!same || !same4 || !same5 || !same6 || !same7 || !same8) exit(EXIT_FAILURE);
    cudaFree(dq_); cudaFree(dk_); cudaFree(dv_); cudaFree(ddo); cudaFree(dout_); cudaFree(dmask); cudaFree(dm);
    cudaFree(dl); cudaFree(dD); cudaFree(gq); cudaFree(gk); cudaFree(gv);
}
#endif

int main(int argc, char** argv) {
#ifdef CPUSIM_SMALL
    int B = 2, H = 2, hs = 64, Tn = argc > 1 ? atoi(argv[1]) : 70;   // 2 tiles and a tail, one real token in b = 1
#else
    int B = 2, H = 12, hs = 64, Tn = argc > 1 ? atoi(argv[1]) : 512;
#endif
    float p = argc > 2 ? (float)atof(argv[2]) : 0.1f;                 // dropout (0: none)
    u64 seed = 1234, stream = 7, thresh = (u64)llround(p * 4294967296.0);
    float dscale = 1.f / (1.f - p), scale = 1.f / sqrtf((float)hs);
    size_t n = (size_t)B * Tn * H * hs, nr = (size_t)B * H * Tn;
    float *q = make_random_float(n, 1), *k = make_random_float(n, 2), *v = make_random_float(n, 3);
    float* dout = make_random_float(n, 4);
    float* mask = (float*)malloc((size_t)B * Tn * sizeof(float));   // (B, 1, 1, T) padding, one real token in b=1
    for (int b = 0; b < B; b++)
        for (int j = 0; j < Tn; j++) mask[b * Tn + j] = j < (b == B - 1 ? 1 : Tn - 37) ? 0.f : -3.4028235e38f;
    // the references of one set of inputs: the forward's m, 1/l per row and out, then the backward's dq, dk, dv
    int C = H * hs;
    auto reference = [&](const float* q, const float* k, const float* v, const float* dout, std::vector<float>& m,
                         std::vector<float>& linv, std::vector<float>& out, std::vector<float>& rq,
                         std::vector<float>& rk, std::vector<float>& rv) {
        m.assign(nr, 0.f); linv.assign(nr, 0.f); out.assign(n, 0.f); rq.assign(n, 0.f); rk.assign(n, 0.f);
        rv.assign(n, 0.f);
        std::vector<float> s(Tn);
        for (int b = 0; b < B; b++)
            for (int h = 0; h < H; h++)
                for (int i = 0; i < Tn; i++) {
                    float mx = -INFINITY, l = 0.f;
                    for (int j = 0; j < Tn; j++) {
                        float a = 0.f;
                        for (int d = 0; d < hs; d++)
                            a += q[((size_t)b * Tn + i) * C + h * hs + d] * k[((size_t)b * Tn + j) * C + h * hs + d];
                        s[j] = a * scale + mask[b * Tn + j];
                        mx = fmaxf(mx, s[j]);
                    }
                    for (int j = 0; j < Tn; j++) { s[j] = expf(s[j] - mx); l += s[j]; }
                    for (int j = 0; j < Tn; j++) {
                        u64 e = (((u64)b * H + h) * Tn + i) * Tn + j;
                        float pz = s[j] / l * (philox_word_host(e, stream, seed) >= thresh ? dscale : 0.f);
                        for (int d = 0; d < hs; d++)
                            out[((size_t)b * Tn + i) * C + h * hs + d] += pz * v[((size_t)b * Tn + j) * C + h * hs + d];
                    }
                    m[((size_t)b * H + h) * Tn + i] = mx;
                    linv[((size_t)b * H + h) * Tn + i] = 1.f / l;
                }
        attention_backward_cpu(q, k, v, mask, Tn, 0, 0, 1, B, Tn, H, hs, scale, seed, stream, thresh, dscale, dout,
                               rq.data(), rk.data(), rv.data());
    };
    std::vector<float> m, linv, out, rq, rk, rv;
    printf("attention backward B=%d T=%d H=%d hs=%d dropout %.2f: CPU reference...\n", B, Tn, H, hs, p);
    reference(q, k, v, dout, m, linv, out, rq, rk, rv);
    float *dq_ = dev_copy(q, n), *dk_ = dev_copy(k, n), *dv_ = dev_copy(v, n), *ddo = dev_copy(dout, n);
    float *dmask = dev_copy(mask, (size_t)B * Tn), *dm = dev_copy(m.data(), nr), *dl = dev_copy(linv.data(), nr);
    float *dout_ = dev_copy(out.data(), n), *dD = dev_copy(nullptr, nr);
    float *gq = dev_copy(nullptr, n), *gk = dev_copy(nullptr, n), *gv = dev_copy(nullptr, n);
    auto launch = [&]() {
        attention_backward(dq_, dk_, dv_, dmask, Tn, 0, 0, 1, B, Tn, H, scale, seed, stream, thresh, dscale, dm, dl,
                           dout_, ddo, dD, gq, gk, gv);
    };
    launch();
    cudaCheck(cudaDeviceSynchronize());
    // float32: order of T-term sums and __expf (2 ulp) against the CPU's expf
    validate_result(gq, rq.data(), "v1 dq", n, 1e-4f, 1e-3f);
    validate_result(gk, rk.data(), "v1 dk", n, 1e-4f, 1e-3f);
    validate_result(gv, rv.data(), "v1 dv", n, 1e-4f, 1e-3f);
    float ms = benchmark_kernel(10, launch);
    printf("  v1 f32: %.4f ms, %.1f TFLOP/s (2.5 x 4 B H T^2 hs)\n", ms, 2.5 * 4.0 * B * H * (double)Tn * Tn * hs / ms / 1e9);
#ifdef HALF_TYPES
    run16<__half>("f16", 11, B, Tn, H, hs, q, k, v, dout, mask, scale, seed, stream, thresh, dscale, reference);
    run16<__nv_bfloat16>("bf16", 8, B, Tn, H, hs, q, k, v, dout, mask, scale, seed, stream, thresh, dscale,
                         reference);
#ifdef CPUSIM
    printf("v3-v8 skipped %lld tiles of padding in all\n", (long long)cpusim_skipped_tiles.load());
#endif
#endif
    return 0;
}
#endif
