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
No atomics: dk, dv are owned by key tiles and dq by query tiles (two passes that each recompute p).

Versions:
  1  scalar, fp32 accumulation for any storage (f32 / f16 / bf16), hs in {32, 64, 128}:
       attn_bwd_D:        a warp per row, D_i = dout_i . out_i
       attn_bwd_dkdv_v1:  a block per (b, h, 64-key tile), a thread per key row with k_j, v_j, dk_j, dv_j in
                          registers; 32-row query tiles (q, dout, m, 1/l, D) staged in shared memory
       attn_bwd_dq_v1:    a block per (b, h, 64-query tile), a thread per query row; 32-key K/V tiles in shared

Build and run standalone (validates against the CPU reference, then times):
    nvcc -O3 -arch=sm_90 -std=c++17 -o attention_backward attention_backward.cu && ./attention_backward [T]
Compile check only (tests/test_cuda_nvcc.py):  nvcc -arch=sm_90 -std=c++17 -c attention_backward.cu
*/
#include "common.cuh"

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

// the names cuda_c.py loads: attn_bwd_D_<dtype> (block 256, grid ceil(B*H*T / 8)),
// attn_bwd_dkdv_v1_<dtype>_hs<hs>, attn_bwd_dq_v1_<dtype>_hs<hs> (block 64, grid (ceil(T / 64), B * H))
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

static float* dev_copy(const float* h, size_t n) {
    float* d;
    cudaCheck(cudaMalloc(&d, n * sizeof(float)));
    if (h) cudaCheck(cudaMemcpy(d, h, n * sizeof(float), cudaMemcpyHostToDevice));
    return d;
}

int main(int argc, char** argv) {
#ifdef CPUSIM_SMALL
    int B = 2, H = 2, hs = 64, Tn = argc > 1 ? atoi(argv[1]) : 70;   // 2 tiles and a tail, one real token in b = 1
#else
    int B = 2, H = 12, hs = 64, Tn = argc > 1 ? atoi(argv[1]) : 512;
#endif
    float p = 0.1f;
    u64 seed = 1234, stream = 7, thresh = (u64)llround(p * 4294967296.0);
    float dscale = 1.f / (1.f - p), scale = 1.f / sqrtf((float)hs);
    size_t n = (size_t)B * Tn * H * hs, nr = (size_t)B * H * Tn;
    float *q = make_random_float(n, 1), *k = make_random_float(n, 2), *v = make_random_float(n, 3);
    float* dout = make_random_float(n, 4);
    float* mask = (float*)malloc((size_t)B * Tn * sizeof(float));   // (B, 1, 1, T) padding, one real token in b=1
    for (int b = 0; b < B; b++)
        for (int j = 0; j < Tn; j++) mask[b * Tn + j] = j < (b == B - 1 ? 1 : Tn - 37) ? 0.f : -3.4028235e38f;
    // forward statistics and out on the CPU (the forward's reference, inlined: m, 1/l per row, out)
    std::vector<float> m(nr), linv(nr), out(n, 0.f), s(Tn);
    int C = H * hs;
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
    std::vector<float> rq(n), rk(n), rv(n);
    printf("attention backward B=%d T=%d H=%d hs=%d dropout %.2f: CPU reference...\n", B, Tn, H, hs, p);
    attention_backward_cpu(q, k, v, mask, Tn, 0, 0, 1, B, Tn, H, hs, scale, seed, stream, thresh, dscale, dout,
                           rq.data(), rk.data(), rv.data());
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
    return 0;
}
#endif
