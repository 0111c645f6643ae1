/*
Inverted dropout with refbert.philox's counter-based keep-mask, forward and backward (the same kernel: the backward
regenerates the mask from (seed, stream) and applies it to dout), float32.
Oracle: refbert.ops.dropout_forward / dropout_backward (Python launchers: kernels/cuda/cuda_c.py; the Numba
versions: kernels/cuda/dropout.py).
    x, out: n elements (any shape, seen flat; e = the C-order index)
    keep[e] = philox_word(e, stream, seed) >= thresh  (thresh = round(p 2^32): an integer comparison, so exactly
    the oracle's elements);  out = x * (keep ? scale : 0), scale = 1 / (1 - p)  (p = 1: scale 0)

Versions:
  1  a thread per Philox block of 4 elements (one Philox4x32-10 call gives the 4 words of elements 4b .. 4b + 3,
     as the Numba version 2); 128-bit loads and stores when vec (every pointer 16-byte aligned), the last partial
     block element by element

Build and run standalone (validates against the CPU reference, then times):
    nvcc -O3 -arch=sm_90 -std=c++17 -o dropout dropout.cu && ./dropout
On CPU threads:  g++ -std=c++20 -O1 -pthread -ffp-contract=off -DCPUSIM -DCPUSIM_SMALL -x c++ dropout.cu -o d && ./d
*/
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256) dropout_v1(const float* __restrict__ x, long long n, u64 seed,
                                                             u64 stream, u64 thresh, float scale, int vec,
                                                             float* __restrict__ out) {
    const long long blk = (long long)blockIdx.x * blockDim.x + threadIdx.x, e = 4 * blk;
    if (e >= n) return;
    const float4 z = keep4((u64)e, seed, stream, thresh, scale);
    if (vec && e + 3 < n) {
        const float4 v = ld4(x + e);
        st4(out + e, make_float4(v.x * z.x, v.y * z.y, v.z * z.z, v.w * z.w));
        return;
    }
    const float zz[4] = {z.x, z.y, z.z, z.w};
    for (int k = 0; k < 4 && e + k < n; k++) out[e + k] = x[e + k] * zz[k];
}

#ifdef HOST_CODE
int main() {
#ifdef CPUSIM_SMALL
    const long long sizes[] = {1, 7, 33, 1030};
#else
    const long long sizes[] = {1, 7, 33, 4099, 4LL * 12 * 512 * 512};
#endif
    const float ps[] = {0.1f, 0.5f, 1.0f};
    for (long long n : sizes)
        for (float p : ps) {
            const u64 seed = 0xDEADBEEF12345ull, stream = 3, thresh = (u64)llround((double)p * 4294967296.0);
            const float scale = p < 1.f ? 1.f / (1.f - p) : 0.f;
            float* x = make_random_float(n, 1);
            std::vector<float> ref(n);
            for (long long e = 0; e < n; e++) ref[e] = x[e] * (philox_word_host(e, stream, seed) >= thresh ? scale : 0.f);
            float *dx, *dout;
            cudaCheck(cudaMalloc(&dx, n * 4)); cudaCheck(cudaMalloc(&dout, n * 4));
            cudaCheck(cudaMemcpy(dx, x, n * 4, cudaMemcpyHostToDevice));
            const int grid = (int)(((n + 3) / 4 + 255) / 256);
            printf("dropout v1 n=%lld p=%.1f\n", n, p);
            for (int vec = 0; vec < 2; vec++) {
                LAUNCH(dropout_v1, grid, 256, dx, n, seed, stream, thresh, scale, vec, dout);
                cudaCheck(cudaDeviceSynchronize());
                validate_result(dout, ref.data(), vec ? "out (float4)" : "out", n, 1e-30f, 0.f);  // bit for bit
            }
            if (n >= (1 << 20) && p == 0.1f) {
                float ms = benchmark_kernel(20, [&]() { LAUNCH(dropout_v1, grid, 256, dx, n, seed, stream, thresh,
                                                               scale, 1, dout); });
                printf("  %.4f ms, %.0f GB/s\n", ms, 2.0 * n * 4 / ms / 1e6);
            }
            free(x); cudaFree(dx); cudaFree(dout);
        }
    printf("dropout: every version ok\n");
    return 0;
}
#endif
