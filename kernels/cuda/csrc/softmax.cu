/*
Softmax over the last axis with the score scale and additive mask fused in, forward and backward, float32.
Oracle: refbert.ops.softmax_forward / softmax_backward (Python launchers: kernels/cuda/cuda_c.py).
    x, p, dout, dx: (R, T) contiguous rows   mask: (Rm, T) float32 rows, mrow[r] names the mask row of row r
    (mask = nullptr: none)   bad: (R,) int, set to 1 where a row's max is not finite (the launcher raises the
    oracle's ValueError), else 0
    forward:  z = x * scale + mask;  m = max(z);  p = exp(z - m) / sum(exp(z - m))
    backward: d = sum(dout * p);  dx = scale * p * (dout - d)

Versions:
  1  a thread per row, three passes (max, sum, write) — the explanation
  2  a warp per row (8 rows per 256-thread block): one pass keeps an online (max, sum) per lane, merged by
     shuffles; 128-bit loads/stores (float4) when T % 4 == 0, scalar otherwise; backward: warp-shuffle dot, write

Build and run standalone (validates against the CPU reference, then times):
    nvcc -O3 -arch=sm_90 -std=c++17 -o softmax softmax.cu && ./softmax
Compile check only (tests/test_cuda_nvcc.py):  nvcc -arch=sm_90 -std=c++17 -c softmax.cu
*/
#include "common.cuh"

#ifdef HOST_CODE
void softmax_forward_cpu(const float* x, float scale, const float* mask, const long long* mrow, int R, int T,
                         float* p) {
    for (int r = 0; r < R; r++) {
        const float* mk = mask ? mask + mrow[r] * T : nullptr;
        float m = -INFINITY, s = 0.f;
        for (int j = 0; j < T; j++) m = fmaxf(m, x[(size_t)r * T + j] * scale + (mk ? mk[j] : 0.f));
        for (int j = 0; j < T; j++) s += expf(x[(size_t)r * T + j] * scale + (mk ? mk[j] : 0.f) - m);
        for (int j = 0; j < T; j++) p[(size_t)r * T + j] = expf(x[(size_t)r * T + j] * scale + (mk ? mk[j] : 0.f) - m) / s;
    }
}
void softmax_backward_cpu(const float* dout, const float* p, float scale, int R, int T, float* dx) {
    for (int r = 0; r < R; r++) {
        float d = 0.f;
        for (int j = 0; j < T; j++) d += dout[(size_t)r * T + j] * p[(size_t)r * T + j];
        for (int j = 0; j < T; j++) dx[(size_t)r * T + j] = scale * p[(size_t)r * T + j] * (dout[(size_t)r * T + j] - d);
    }
}
#endif

// ----------------------------------------------------------------------------------------------------------------
// GPU kernels

extern "C" __global__ void softmax_fwd_v1(const float* __restrict__ x, float scale, const float* __restrict__ mask,
                                          const long long* __restrict__ mrow, int R, int T, float* __restrict__ p,
                                          int* __restrict__ bad) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= R) return;
    const float* xr = x + (size_t)r * T;
    const float* mk = mask ? mask + mrow[r] * T : nullptr;
    float m = -INFINITY;
    bool nan = false;
    for (int j = 0; j < T; j++) {
        float z = xr[j] * scale + (mk ? mk[j] : 0.f);
        nan |= z != z;
        m = fmaxf(m, z);
    }
    if (nan || !(m > -INFINITY && m < INFINITY)) { bad[r] = 1; return; }
    float s = 0.f;
    for (int j = 0; j < T; j++) s += expf(xr[j] * scale + (mk ? mk[j] : 0.f) - m);
    const float inv = 1.f / s;
    for (int j = 0; j < T; j++) p[(size_t)r * T + j] = expf(xr[j] * scale + (mk ? mk[j] : 0.f) - m) * inv;
    bad[r] = 0;
}

__device__ __forceinline__ void online(float z, float& m, float& s, bool& nan) {
    if (z != z) nan = true;
    else if (z > m) { s = s * __expf(m - z) + 1.f; m = z; }       // m = -inf at first: exp(-inf) = 0
    else if (z > -INFINITY) s += __expf(z - m);
}

extern "C" __global__ void __launch_bounds__(256) softmax_fwd_v2(const float* __restrict__ x, float scale,
                                                                 const float* __restrict__ mask,
                                                                 const long long* __restrict__ mrow, int R, int T,
                                                                 float* __restrict__ p, int* __restrict__ bad) {
    const int r = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (r >= R) return;                                           // warp-uniform
    const float* xr = x + (size_t)r * T;
    const float* mk = mask ? mask + mrow[r] * T : nullptr;
    float* pr = p + (size_t)r * T;
    const bool vec = (T & 3) == 0;                                // rows 16-byte aligned: float4
    float m = -INFINITY, s = 0.f;
    bool nan = false;
    if (vec) {
        for (int j = lane * 4; j < T; j += 128) {
            float4 a = *reinterpret_cast<const float4*>(xr + j);
            float4 b = mk ? *reinterpret_cast<const float4*>(mk + j) : make_float4(0.f, 0.f, 0.f, 0.f);
            online(a.x * scale + b.x, m, s, nan); online(a.y * scale + b.y, m, s, nan);
            online(a.z * scale + b.z, m, s, nan); online(a.w * scale + b.w, m, s, nan);
        }
    } else {
        for (int j = lane; j < T; j += 32) online(xr[j] * scale + (mk ? mk[j] : 0.f), m, s, nan);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {                            // merge (m, s) across lanes
        float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        float mn = fmaxf(m, m2);
        if (mn > -INFINITY) s = (m > -INFINITY ? s * __expf(m - mn) : 0.f) + (m2 > -INFINITY ? s2 * __expf(m2 - mn) : 0.f);
        m = mn;
    }
    nan = __any_sync(0xffffffffu, nan);
    if (nan || !(m > -INFINITY && m < INFINITY)) { if (lane == 0) bad[r] = 1; return; }
    const float inv = 1.f / s;
    if (vec) {
        for (int j = lane * 4; j < T; j += 128) {
            float4 a = *reinterpret_cast<const float4*>(xr + j);
            float4 b = mk ? *reinterpret_cast<const float4*>(mk + j) : make_float4(0.f, 0.f, 0.f, 0.f);
            float4 o = make_float4(__expf(a.x * scale + b.x - m) * inv, __expf(a.y * scale + b.y - m) * inv,
                                   __expf(a.z * scale + b.z - m) * inv, __expf(a.w * scale + b.w - m) * inv);
            *reinterpret_cast<float4*>(pr + j) = o;
        }
    } else {
        for (int j = lane; j < T; j += 32) pr[j] = __expf(xr[j] * scale + (mk ? mk[j] : 0.f) - m) * inv;
    }
    if (lane == 0) bad[r] = 0;
}

extern "C" __global__ void softmax_bwd_v1(const float* __restrict__ dout, const float* __restrict__ p, float scale,
                                          int R, int T, float* __restrict__ dx) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= R) return;
    float d = 0.f;
    for (int j = 0; j < T; j++) d += dout[(size_t)r * T + j] * p[(size_t)r * T + j];
    for (int j = 0; j < T; j++) dx[(size_t)r * T + j] = scale * p[(size_t)r * T + j] * (dout[(size_t)r * T + j] - d);
}

extern "C" __global__ void __launch_bounds__(256) softmax_bwd_v2(const float* __restrict__ dout,
                                                                 const float* __restrict__ p, float scale, int R,
                                                                 int T, float* __restrict__ dx) {
    const int r = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (r >= R) return;
    const float *gr = dout + (size_t)r * T, *pr = p + (size_t)r * T;
    float* xr = dx + (size_t)r * T;
    const bool vec = (T & 3) == 0;
    float d = 0.f;
    if (vec) {
        for (int j = lane * 4; j < T; j += 128) {
            float4 a = *reinterpret_cast<const float4*>(gr + j), b = *reinterpret_cast<const float4*>(pr + j);
            d += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
        }
    } else {
        for (int j = lane; j < T; j += 32) d += gr[j] * pr[j];
    }
    d = warp_sum(d);
    if (vec) {
        for (int j = lane * 4; j < T; j += 128) {
            float4 a = *reinterpret_cast<const float4*>(gr + j), b = *reinterpret_cast<const float4*>(pr + j);
            *reinterpret_cast<float4*>(xr + j) = make_float4(scale * b.x * (a.x - d), scale * b.y * (a.y - d),
                                                             scale * b.z * (a.z - d), scale * b.w * (a.w - d));
        }
    } else {
        for (int j = lane; j < T; j += 32) xr[j] = scale * pr[j] * (gr[j] - d);
    }
}

// ----------------------------------------------------------------------------------------------------------------
// launcher, main

#ifdef HOST_CODE
void softmax_forward(int version, const float* x, float scale, const float* mask, const long long* mrow, int R,
                     int T, float* p, int* bad) {
    if (version == 1) LAUNCH(softmax_fwd_v1, (R + 255) / 256, 256, x, scale, mask, mrow, R, T, p, bad);
    else LAUNCH(softmax_fwd_v2, (R + 7) / 8, 256, x, scale, mask, mrow, R, T, p, bad);
    cudaCheck(cudaGetLastError());
}
void softmax_backward(int version, const float* dout, const float* p, float scale, int R, int T, float* dx) {
    if (version == 1) LAUNCH(softmax_bwd_v1, (R + 255) / 256, 256, dout, p, scale, R, T, dx);
    else LAUNCH(softmax_bwd_v2, (R + 7) / 8, 256, dout, p, scale, R, T, dx);
    cudaCheck(cudaGetLastError());
}

int main() {
#ifdef CPUSIM_SMALL
    const int B = 2, H = 3, T = 44, R = B * H * T;                   // T % 4 == 0: the float4 path, 2 rows of tail
#else
    const int B = 4, H = 12, T = 512, R = B * H * T;
#endif
    const float scale = 0.125f;
    size_t n = (size_t)R * T;
    float *x = make_random_float(n, 1), *dout = make_random_float(n, 2);
    float* mask = (float*)malloc((size_t)B * T * sizeof(float));
    std::vector<long long> mrow(R);
    for (int b = 0; b < B; b++)
        for (int j = 0; j < T; j++) mask[b * T + j] = j < T - 37 * b ? 0.f : -3.4028235e38f;
    for (int r = 0; r < R; r++) mrow[r] = r / (H * T);
    std::vector<float> p(n), dx(n);
    softmax_forward_cpu(x, scale, mask, mrow.data(), R, T, p.data());
    softmax_backward_cpu(dout, p.data(), scale, R, T, dx.data());
    float *dx_, *ddo, *dmask, *dp, *ddx;
    long long* dmrow;
    int* dbad;
    cudaCheck(cudaMalloc(&dx_, n * 4)); cudaCheck(cudaMalloc(&ddo, n * 4)); cudaCheck(cudaMalloc(&dp, n * 4));
    cudaCheck(cudaMalloc(&ddx, n * 4)); cudaCheck(cudaMalloc(&dmask, B * T * 4)); cudaCheck(cudaMalloc(&dmrow, R * 8));
    cudaCheck(cudaMalloc(&dbad, R * 4));
    cudaCheck(cudaMemcpy(dx_, x, n * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(ddo, dout, n * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(dmask, mask, B * T * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(dmrow, mrow.data(), R * 8, cudaMemcpyHostToDevice));
    for (int version = 1; version <= 2; version++) {
        printf("softmax version %d\n", version);
        softmax_forward(version, dx_, scale, dmask, dmrow, R, T, dp, dbad);
        softmax_backward(version, ddo, dp, scale, R, T, ddx);
        cudaCheck(cudaDeviceSynchronize());
        // __expf (2 ulp) vs expf, float32 sums in another order; p <= 1
        validate_result(dp, p.data(), "p", n, 1e-6f, 1e-5f);
        validate_result(ddx, dx.data(), "dx", n, 1e-6f, 1e-5f);
    }
    for (int version = 1; version <= 2; version++) {
        float ms_f = benchmark_kernel(20, [&]() { softmax_forward(version, dx_, scale, dmask, dmrow, R, T, dp, dbad); });
        float ms_b = benchmark_kernel(20, [&]() { softmax_backward(version, ddo, dp, scale, R, T, ddx); });
        // forward reads x, writes p; backward reads p, dout, writes dx (mask rows stay in cache)
        printf("version %d | forward %.4f ms %.1f GB/s | backward %.4f ms %.1f GB/s\n", version, ms_f,
               2.0 * n * 4 / ms_f / 1e6, ms_b, 3.0 * n * 4 / ms_b / 1e6);
    }
    return 0;
}
#endif
