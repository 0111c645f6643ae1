// The tensor-core flash kernels' building blocks (mma.sync m16n8k16 on 64 x 64 tiles of head size 64, fragments as
// common.cuh's mma16816 documents) and the backward's two passes built on them (tc_bwd_keys, tc_bwd_queries):
// attention_backward.cu versions 2-7 and mixed.cu's S3 and S4 (the spec's attention).
// 128 threads a block, 4 warps of 16 rows; g = lane / 4, t4 = lane % 4.
#pragma once
#include "common.cuh"

#ifdef HALF_TYPES
constexpr int TC_LD = 64 + 8;     // shared tile rows padded by 16 bytes: fragment loads without bank conflicts

// 64 rows x 64 columns of (B, T, C) storage from row r0 into a padded shared tile, 16 bytes per cp.async
// (rows past T zero-filled); 128 threads, 4 chunks each
template <typename T>
__device__ __forceinline__ void tc_load_tile(T* dst, const T* src, int r0, int Tn, int C, int tid) {
#pragma unroll
    for (int u = 0; u < 4; u++) {                              // (a fixed trip count: unrolled whole)
        const int c = tid + 128 * u, r = c >> 3, col = (c & 7) * 8, row = r0 + r;
        const bool ok = row < Tn;
        cp_async16(dst + r * TC_LD + col, src + (size_t)(ok ? row : 0) * C + col, ok ? 16 : 0);
    }
}
// A fragment (16 x 16, row-major) of a shared tile: rows r0.., columns k0..
template <typename T>
__device__ __forceinline__ void tc_frag_a(u32* a, const T* X, int r0, int k0, int g, int t4) {
    const T* p = X + (r0 + g) * TC_LD + k0 + t4 * 2;
    a[0] = *reinterpret_cast<const u32*>(p);
    a[1] = *reinterpret_cast<const u32*>(p + 8 * TC_LD);
    a[2] = *reinterpret_cast<const u32*>(p + 8);
    a[3] = *reinterpret_cast<const u32*>(p + 8 * TC_LD + 8);
}
// B fragment (16 x 8) with B[k][n] = Y[n0 + n][k0 + k] (Y's rows are B's columns: K for S = q K^T)
template <typename T>
__device__ __forceinline__ void tc_frag_b_t(u32* b, const T* Y, int n0, int k0, int g, int t4) {
    const T* p = Y + (n0 + g) * TC_LD + k0 + t4 * 2;
    b[0] = *reinterpret_cast<const u32*>(p);
    b[1] = *reinterpret_cast<const u32*>(p + 8);
}
// B fragment (16 x 8) with B[k][n] = Y[k0 + k][n0 + n] (Y's rows are B's rows: V for P V)
template <typename T>
__device__ __forceinline__ void tc_frag_b(u32* b, const T* Y, int k0, int n0, int g, int t4) {
    const unsigned short* p = reinterpret_cast<const unsigned short*>(Y + (k0 + t4 * 2) * TC_LD + n0 + g);
    b[0] = (u32)p[0] | ((u32)p[TC_LD] << 16);
    b[1] = (u32)p[8 * TC_LD] | ((u32)p[9 * TC_LD] << 16);
}
// acc (16 x 64: 8 n-tiles) = A (16 x 64, as 4 k-steps of register fragments) times Y^T, Y a 64 x 64 shared tile.
// LDSM: the B fragments of two k-steps by one ldmatrix (lane L: row n 8 + L % 8, columns 32 k2 + 8 (L / 8)), the
// same values in the same order of products (so the same bits) for half the load instructions.
// NN < 8 (attention_backward.cu version 6): the NN n-tiles nb .. nb + NN - 1 alone (16 x 8 NN: Y's rows 8 nb ..),
// into acc[0 .. NN - 1]; each is the same 4 k-steps in the same order as in the whole tile, so the same bits
template <typename T, bool LDSM = false, int NN = 8>
__device__ __forceinline__ void tc_rows_times_t(float (*acc)[4], const u32 (*a)[4], const T* Y, int g, int t4,
                                                int nb = 0) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int c = 0; c < NN; c++) {
        const int n = nb + c;
        acc[c][0] = acc[c][1] = acc[c][2] = acc[c][3] = 0.f;
        if (LDSM) {
#pragma unroll
            for (int k2 = 0; k2 < 2; k2++) {
                u32 b[4];
                ldsm_x4(b, Y + (n * 8 + (lane & 7)) * TC_LD + k2 * 32 + (lane >> 3) * 8);
                mma16816(acc[c], a[2 * k2], b, T());
                mma16816(acc[c], a[2 * k2 + 1], b + 2, T());
            }
        } else {
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                u32 b[2];
                tc_frag_b_t(b, Y, n * 8, kk * 16, g, t4);
                mma16816(acc[c], a[kk], b, T());
            }
        }
    }
}
// acc (16 x 64) += X (16 x 64 float32 C fragments, rounded to 16 bits as A fragments) times Y (64 x 64 shared).
// LDSM: the B fragments of two n-tiles by one ldmatrix.trans (matrices: rows 16 kk + 0 / 8, columns 8 n / 8 n + 8)
// where tc_frag_b takes four 16-bit loads for one; the same values, the same order of products.
// NN < 8 (even): X is the NN n-tiles nb .. (16 x 8 NN, nb even), the k-steps nb / 2 .. (nb + NN) / 2 - 1 of the
// product (Y's rows 8 nb ..); called for nb = 0, NN, 2 NN, .. in turn, every acc element takes its k-steps in the
// whole tile's order, so the same bits
template <typename T, bool LDSM = false, int NN = 8>
__device__ __forceinline__ void tc_acc_times(float (*acc)[4], const float (*x)[4], const T* Y, int g, int t4,
                                             int nb = 0) {
    static_assert(NN % 2 == 0 && NN <= 8, "whole k-steps: an even number of n-tiles");
    const int lane = threadIdx.x & 31, mi = lane >> 3;
#pragma unroll
    for (int c = 0; c < NN / 2; c++) {
        const int kk = nb / 2 + c;
        const u32 a[4] = {pack2(x[2 * c][0], x[2 * c][1], T()), pack2(x[2 * c][2], x[2 * c][3], T()),
                          pack2(x[2 * c + 1][0], x[2 * c + 1][1], T()),
                          pack2(x[2 * c + 1][2], x[2 * c + 1][3], T())};
        if (LDSM) {
#pragma unroll
            for (int n = 0; n < 8; n += 2) {
                u32 b[4];
                ldsm_x4_t(b, Y + (kk * 16 + (mi & 1) * 8 + (lane & 7)) * TC_LD + (n + (mi >> 1)) * 8);
                mma16816(acc[n], a, b, T());
                mma16816(acc[n + 1], a, b + 2, T());
            }
        } else {
#pragma unroll
            for (int n = 0; n < 8; n++) {
                u32 b[2];
                tc_frag_b(b, Y, kk * 16, n * 8, g, t4);
                mma16816(acc[n], a, b, T());
            }
        }
    }
}

// acc (16 x 8 NN: the n-tiles nb .. nb + NN - 1) = A (16 x 64, as 4 k-steps of register fragments) times Y (64 x 64
// shared, Y's rows are the k index: K for dq = dS K), the B fragments of two n-tiles by one ldmatrix.trans as
// tc_acc_times' LDSM path takes them (attention_backward.cu version 7)
template <typename T, int NN = 8>
__device__ __forceinline__ void tc_frags_times(float (*acc)[4], const u32 (*a)[4], const T* Y, int nb = 0) {
    static_assert(NN % 2 == 0 && NN <= 8, "n-tiles in pairs");
    const int lane = threadIdx.x & 31, mi = lane >> 3;
#pragma unroll
    for (int c = 0; c < NN; c++) acc[c][0] = acc[c][1] = acc[c][2] = acc[c][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
#pragma unroll
        for (int c = 0; c < NN; c += 2) {
            u32 b[4];
            ldsm_x4_t(b, Y + (kk * 16 + (mi & 1) * 8 + (lane & 7)) * TC_LD + (nb + c + (mi >> 1)) * 8);
            mma16816(acc[c], a[kk], b, T());
            mma16816(acc[c + 1], a[kk], b + 2, T());
        }
}


// rows r0.. of x (and of y, where y is given) staged through X (Y) and kept as A fragments xa (ya): the 64 rows a
// block holds fixed while it streams the other side's tiles; X and Y are free again on return
template <typename T>
__device__ __forceinline__ void tc_stage_frags(u32 (&xa)[4][4], u32 (&ya)[4][4], T* X, T* Y, const T* x, const T* y,
                                               int r0, int Tn, int C) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    tc_load_tile(X, x, r0, Tn, C, tid);
    if (y) tc_load_tile(Y, y, r0, Tn, C, tid);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        tc_frag_a(xa[kk], X, warp * 16, kk * 16, g, t4);
        if (y) tc_frag_a(ya[kk], Y, warp * 16, kk * 16, g, t4);
    }
    __syncthreads();                                          // the staging buffers may be refilled next
}

// every 64-key tile j0 of k (and of v, where Vs is given) in turn, double-buffered through cp.async: tile it + 1
// streams in while body(cur, j0) works on Ks[cur] (Vs[cur]); a barrier before each body and one after it (its
// buffers are refilled next)
template <typename T, class Body>
__device__ __forceinline__ void tc_key_tiles(T (*Ks)[64 * TC_LD], T (*Vs)[64 * TC_LD], const T* k, const T* v, int Tn,
                                             int C, Body body) {
    const int tid = threadIdx.x;
    tc_load_tile(Ks[0], k, 0, Tn, C, tid);
    if (Vs) tc_load_tile(Vs[0], v, 0, Tn, C, tid);
    cp_async_commit();
    const int ntiles = (Tn + 63) / 64;
    for (int it = 0; it < ntiles; it++) {
        const int cur = it & 1, j0 = it * 64;
        if (it + 1 < ntiles) {
            tc_load_tile(Ks[cur ^ 1], k, j0 + 64, Tn, C, tid);
            if (Vs) tc_load_tile(Vs[cur ^ 1], v, j0 + 64, Tn, C, tid);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        body(cur, j0);
        __syncthreads();
    }
}

// Dropout words a Philox call per 4 scores (attention_backward.cu version 5): the words of a thread's four scores of
// one n-tile, w[e] for fragment element e (row / key r = e >> 1, column c = e & 1), each the word philox_word gives
// that score's flat index (so the same keep-mask), one philox4x32_10 call a lane where a call a score drew them.
// Needs T % 4 == 0 (keys 4G .. 4G + 3 of a row are the four words of one Philox block) and every lane of the warp.
// A block index past T is harmless: its words are drawn and never used.
__device__ __forceinline__ u32 tc_word(uint4 b, int i) { return i == 0 ? b.x : i == 1 ? b.y : i == 2 ? b.z : b.w; }
// word i (0..3) of a Philox block by two selects on i's bits (tc_words_cols<true>, attention_backward.cu version 8:
// tc_word's chain of comparisons on a lane's own index compiles to divergent branches, a reconvergence region each)
__device__ __forceinline__ u32 tc_pick(uint4 b, int i) {
    const u32 lo = (i & 1) ? b.y : b.x, hi = (i & 1) ? b.w : b.z;
    return (i & 2) ? hi : lo;
}

// pass 2 (S: query rows x keys): rows row0, row1, keys k0 + 2 t4 + 0 / 1 (k0 = j0 + 8 n). Lanes t4 = 2G, 2G + 1 hold
// keys 4G .. 4G + 3 of both rows: lane t4 draws the block of row (t4 & 1 ? row1 : row0), keeps the two words of its
// own keys and trades the other two with lane t4 ^ 1 (attention_forward.cu version 5's trade)
__device__ __forceinline__ void tc_words_rows(u32 (&w)[4], int bh, int Tn, int row0, int row1, int k0, int t4,
                                              u64 seed, u64 stream) {
    const bool odd = t4 & 1;
    const uint4 b = philox4x32_10((((u64)bh * Tn + (odd ? row1 : row0)) * Tn + k0 + (t4 >> 1) * 4) >> 2, stream, seed);
    const u32 got0 = __shfl_xor_sync(0xffffffffu, odd ? b.x : b.z, 1);
    const u32 got1 = __shfl_xor_sync(0xffffffffu, odd ? b.y : b.w, 1);
    w[0] = odd ? got0 : b.x; w[1] = odd ? got1 : b.y;         // row0: keys k0 + 2 t4, + 1
    w[2] = odd ? b.z : got0; w[3] = odd ? b.w : got1;         // row1
}

// pass 1 (S^T: key rows x queries): key rows key0 + a and key0 + 8 + a (key0 = j0 + 16 warp + 4 (g >> 2), a = g & 3),
// queries c0 + 0 / 1 (c0 = i0 + 8 n + 2 t4). The four lanes a = 0..3 of one t4 and g >> 2 hold four consecutive keys
// of each key row: their 16 words are 4 Philox blocks, block 2 r + c = (query c0 + c, keys key0 + 8 r ..), and lane
// a needs word a of each. Lane a draws block a; a 4 x 4 transpose by three xor shuffles (lanes 4 x apart: round x
// sends word a ^ x, receives word a of block a ^ x) gives each lane its four
// SEL (attention_backward.cu version 8): the words picked by tc_pick (selects) instead of tc_word: the same words
template <bool SEL = false>
__device__ __forceinline__ void tc_words_cols(u32 (&w)[4], int bh, int Tn, int key0, int c0, int a, u64 seed,
                                              u64 stream) {
    const uint4 b = philox4x32_10((((u64)bh * Tn + c0 + (a & 1)) * Tn + key0 + 8 * (a >> 1)) >> 2, stream, seed);
    auto pick = [](uint4 x, int i) { return SEL ? tc_pick(x, i) : tc_word(x, i); };
    uint4 got;                                                // got[x]: word a of block a ^ x
    got.x = pick(b, a);
    got.y = __shfl_xor_sync(0xffffffffu, pick(b, a ^ 1), 4);
    got.z = __shfl_xor_sync(0xffffffffu, pick(b, a ^ 2), 8);
    got.w = __shfl_xor_sync(0xffffffffu, pick(b, a ^ 3), 12);
#pragma unroll
    for (int e = 0; e < 4; e++) w[e] = pick(got, e ^ a);
}

// what a caller passes for `words` when it has none (versions 2-4, S3: elem draws its own)
struct TcNoWords {
    __device__ void operator()(int, int, u32 (&)[4]) const {}
};
// what a caller passes for `after` when it has nothing to do with a query tile's dS (every version but 7)
struct TcNoAfter {
    template <typename T> __device__ void operator()(int, const float (&)[8][4], T*) const {}
};
template <class A> struct TcHasAfter { static constexpr bool value = true; };
template <> struct TcHasAfter<TcNoAfter> { static constexpr bool value = false; };

// The two passes of a tensor-core flash backward, shared by attention_backward.cu versions 2-7 (float16 / bfloat16
// storage, __expf, linv) and mixed.cu's S3 (the spec's roundings, expf, l): what differs is the arithmetic of one
// score (elem) and what a caller does with the accumulators; the tiles, fragments and the double buffering are
// these. LDSM (attention_backward.cu version 4): B fragments by ldmatrix (pass 1: the transposed ones of dV and dK
// alone; pass 2: all), the same bits. WORDS (version 5): before the scores of each n-tile, words(n, i0 or j0, w)
// fills the thread's four dropout words (tc_words_cols / tc_words_rows, every lane together) and elem takes the
// score's word as its last argument. q, k, v, dout: (B, T, C) storage at base (the head's column 0), C = H * 64;
// rows past T read as zeros.

// pass 1, per 64-key tile j0 (grid (ceil(T / 64), B * H), block 128): the block's k and v kept as A fragments; for
// each 64-query tile (q, dout and the rows' r0, r1, r2 double-buffered through cp.async), S^T = k q^T and
// dP^T = v dout^T, then elem(s, dp, i, j, r0_i, r1_i, r2_i, pz, ds) for every real (key j, query i) pair gives the
// operands of dV += pz^T dout and dK += ds^T q (pz = ds = 0 elsewhere). keypad (block-uniform: this key tile is
// all padding, attention_backward.cu v3): a query tile whose rows all met a real key in the forward
// (r0 = m > PAD_MIN) is skipped, its p exactly 0.
// SPLIT (attention_backward.cu version 6: 1, 2 or 4): the query tile worked in SPLIT chunks of 64 / SPLIT queries,
// each chunk's S^T, dP^T, scores and its k-steps of dV and dK before the next chunk's: S^T and dP^T's registers
// (2 x 32 floats a thread) cut to 2 x 32 / SPLIT, the products' terms in the same order, so the same bits.
// after (version 7; SPLIT 1): once a query tile's dV and dK products are issued, after(i0, ds, scratch) with the
// thread's dS^T fragments (keys x queries, as float32 before their rounding) and this tile's q buffer, free for it
// once every warp has passed a barrier (after's own first): the same dk and dv as without it
template <typename T, bool LDSM = false, bool WORDS = false, int SPLIT = 1, class Elem, class Words = TcNoWords,
          class After = TcNoAfter>
__device__ __forceinline__ void tc_bwd_keys(const T* __restrict__ q, const T* __restrict__ k,
                                            const T* __restrict__ v, const T* __restrict__ dout,
                                            const float* __restrict__ r0, const float* __restrict__ r1,
                                            const float* __restrict__ r2, float r1_pad, int Tn, int C, size_t base,
                                            int bh, int j0, bool keypad, float (&dka)[8][4], float (&dva)[8][4],
                                            Elem elem, Words words = Words(), After after = After()) {
    static_assert(SPLIT == 1 || !TcHasAfter<After>::value, "after takes the whole tile's dS: one chunk");
    __shared__ __align__(16) T Qs[2][64 * TC_LD];
    __shared__ __align__(16) T Os[2][64 * TC_LD];             // dout tiles
    __shared__ float R0[2][64], R1[2][64], R2[2][64];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    u32 ka[4][4], va[4][4];                                   // the key tile's k and v, through the second buffers
    tc_stage_frags(ka, va, Qs[1], Os[1], k + base, v + base, j0, Tn, C);
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) dka[n][e] = dva[n][e] = 0.f;
    const int jr[2] = {j0 + warp * 16 + g, j0 + warp * 16 + g + 8};   // this thread's two key rows
    auto load = [&](int buf, int i0) {
        tc_load_tile(Qs[buf], q + base, i0, Tn, C, tid);
        tc_load_tile(Os[buf], dout + base, i0, Tn, C, tid);
        if (tid < 64) {
            const bool ok = i0 + tid < Tn;
            R0[buf][tid] = ok ? r0[(size_t)bh * Tn + i0 + tid] : 0.f;
            R1[buf][tid] = ok ? r1[(size_t)bh * Tn + i0 + tid] : r1_pad;
            R2[buf][tid] = ok ? r2[(size_t)bh * Tn + i0 + tid] : 0.f;
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
        if (keypad && !__syncthreads_or(tid < 64 && R0[cur][tid] <= PAD_MIN)) {   // (keypad: block-uniform)
            COUNT_SKIP(tid);
            __syncthreads();
            continue;
        }
        constexpr int NN = 8 / SPLIT;                         // n-tiles (of 8 queries) a chunk
#pragma unroll
        for (int nb = 0; nb < 8; nb += NN) {                  // (SPLIT 1: the whole query tile at once)
            float s[NN][4], dp[NN][4];
            // (LDSM takes ldmatrix for the two products below, not for these: here it left ptxas 255 registers
            // and 40 bytes of spills, against 247 and none)
            tc_rows_times_t<T, false, NN>(s, ka, Qs[cur], g, t4, nb);     // S^T: keys x queries
            tc_rows_times_t<T, false, NN>(dp, va, Os[cur], g, t4, nb);    // dP^T = V dout^T: keys x queries
#pragma unroll
            for (int c = 0; c < NN; c++) {
                const int n = nb + c;
                u32 w[4] = {};                                // (read only where words filled it)
                if constexpr (WORDS) words(n, i0, w);         // (every lane: words may shuffle)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int ii = n * 8 + t4 * 2 + (e & 1), i = i0 + ii, j = jr[e >> 1];
                    float pz = 0.f, ds = 0.f;
                    if (i < Tn && j < Tn) {
                        if constexpr (WORDS)
                            elem(s[c][e], dp[c][e], i, j, R0[cur][ii], R1[cur][ii], R2[cur][ii], pz, ds, w[e]);
                        else
                            elem(s[c][e], dp[c][e], i, j, R0[cur][ii], R1[cur][ii], R2[cur][ii], pz, ds);
                    }
                    s[c][e] = pz;
                    dp[c][e] = ds;
                }
            }
            tc_acc_times<T, LDSM, NN>(dva, s, Os[cur], g, t4, nb);        // dV += pz^T dout
            tc_acc_times<T, LDSM, NN>(dka, dp, Qs[cur], g, t4, nb);       // dK += ds^T q
            if constexpr (TcHasAfter<After>::value) after(i0, dp, Qs[cur]); // (SPLIT 1: the whole tile's dS^T)
        }
        __syncthreads();                                      // this tile's buffers may be refilled next
    }
}

// pass 2, per 64-query tile i0 (the same grid and block): the block's q and dout kept as A fragments, the rows'
// r0, r1, r2 in registers (ri[r], r = 0, 1: the thread's rows i0 + warp * 16 + g + 8 r); for each 64-key tile (k, v
// double-buffered) that skip(j0) does not pass (block-uniform), S = q k^T and dP = dout v^T, elem(s, dp, i, j,
// r0_i, r1_i, r2_i) gives ds for every real pair (0 elsewhere), dQ += ds k.
// SPLIT (version 6): the key tile in SPLIT chunks of 64 / SPLIT keys, as tc_bwd_keys' chunks of queries: the same bits
template <typename T, bool LDSM = false, bool WORDS = false, int SPLIT = 1, class Skip, class Elem,
          class Words = TcNoWords>
__device__ __forceinline__ void tc_bwd_queries(const T* __restrict__ q, const T* __restrict__ k,
                                               const T* __restrict__ v, const T* __restrict__ dout,
                                               const float (&r0)[2], const float (&r1)[2], const float (&r2)[2],
                                               int Tn, int C, size_t base, int i0, float (&dqa)[8][4], Skip skip,
                                               Elem elem, Words words = Words()) {
    __shared__ __align__(16) T Ks[2][64 * TC_LD];
    __shared__ __align__(16) T Vs[2][64 * TC_LD];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    u32 qa[4][4], oa[4][4];                                   // the query tile's q and dout, through the second buffers
    tc_stage_frags(qa, oa, Ks[1], Vs[1], q + base, dout + base, i0, Tn, C);
    const int ir[2] = {i0 + warp * 16 + g, i0 + warp * 16 + g + 8};   // this thread's two query rows
#pragma unroll
    for (int n = 0; n < 8; n++) dqa[n][0] = dqa[n][1] = dqa[n][2] = dqa[n][3] = 0.f;
    tc_key_tiles<T>(Ks, Vs, k + base, v + base, Tn, C, [&](int cur, int j0) {
        if (skip(j0)) {                                       // (block-uniform)
            COUNT_SKIP(tid);
            return;
        }
        constexpr int NN = 8 / SPLIT;                         // n-tiles (of 8 keys) a chunk
#pragma unroll
        for (int nb = 0; nb < 8; nb += NN) {                  // (SPLIT 1: the whole key tile at once)
            float s[NN][4], dp[NN][4];
            tc_rows_times_t<T, LDSM, NN>(s, qa, Ks[cur], g, t4, nb);      // S: queries x keys
            tc_rows_times_t<T, LDSM, NN>(dp, oa, Vs[cur], g, t4, nb);     // dP = dout V^T
#pragma unroll
            for (int c = 0; c < NN; c++) {
                const int n = nb + c;
                u32 w[4] = {};                                // (read only where words filled it)
                if constexpr (WORDS) words(n, j0, w);         // (every lane: words may shuffle)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int j = j0 + n * 8 + t4 * 2 + (e & 1), r = e >> 1, i = ir[r];
                    float ds = 0.f;
                    if (i < Tn && j < Tn) {
                        if constexpr (WORDS)
                            ds = elem(s[c][e], dp[c][e], i, j, r0[r], r1[r], r2[r], w[e]);
                        else
                            ds = elem(s[c][e], dp[c][e], i, j, r0[r], r1[r], r2[r]);
                    }
                    dp[c][e] = ds;
                }
            }
            tc_acc_times<T, LDSM, NN>(dqa, dp, Ks[cur], g, t4, nb);       // dq += ds K
        }
    });
}

#endif  // HALF_TYPES
