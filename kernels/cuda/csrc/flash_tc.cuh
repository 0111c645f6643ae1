// The tensor-core flash kernels' building blocks (mma.sync m16n8k16 on 64 x 64 tiles of head size 64, fragments as
// common.cuh's mma16816 documents): attention_backward.cu versions 2-3 and mixed.cu's S3 (the spec's attention).
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
// acc (16 x 64: 8 n-tiles) = A (16 x 64, as 4 k-steps of register fragments) times Y^T, Y a 64 x 64 shared tile
template <typename T>
__device__ __forceinline__ void tc_rows_times_t(float (*acc)[4], const u32 (*a)[4], const T* Y, int g, int t4) {
#pragma unroll
    for (int n = 0; n < 8; n++) {
        acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            u32 b[2];
            tc_frag_b_t(b, Y, n * 8, kk * 16, g, t4);
            mma16816(acc[n], a[kk], b, T());
        }
    }
}
// acc (16 x 64) += X (16 x 64 float32 C fragments, rounded to 16 bits as A fragments) times Y (64 x 64 shared)
template <typename T>
__device__ __forceinline__ void tc_acc_times(float (*acc)[4], const float (*x)[4], const T* Y, int g, int t4) {
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        const u32 a[4] = {pack2(x[2 * kk][0], x[2 * kk][1], T()), pack2(x[2 * kk][2], x[2 * kk][3], T()),
                          pack2(x[2 * kk + 1][0], x[2 * kk + 1][1], T()),
                          pack2(x[2 * kk + 1][2], x[2 * kk + 1][3], T())};
#pragma unroll
        for (int n = 0; n < 8; n++) {
            u32 b[2];
            tc_frag_b(b, Y, kk * 16, n * 8, g, t4);
            mma16816(acc[n], a, b, T());
        }
    }
}

#endif  // HALF_TYPES
