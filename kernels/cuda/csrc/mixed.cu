/*
Mixed precision's roundings on the device (the spec: refbert/ops.py, "mixed precision: the spec"), float32 in,
bit for bit refbert.ops.round_bfloat16 / round_float16. Python launchers: kernels/cuda/mixed.py.

    kind 0: bfloat16 (ulp(1) = 2^-7)        kind 1: float16 (ulp(1) = 2^-10, largest finite 65504)
    R(x)  the float32 on the compute grid nearest to x, ties to even; NaN -> the quiet NaN with its sign

Kernels (v1 each: a thread per element, n elements seen flat, grid-stride; bias_round a block per row; v2 each:
four elements a thread, float4, where n is a multiple of 4 and the arrays 16-byte aligned):
    round_v1        out = R(x)   (out may be x: in place)
    round16_v1      bits = R(x) in 16-bit storage, the tensor-core GEMM's operand; out32 = R(x) too when want32 (else
                    out32 is never written: any float array, x itself). bfloat16: the upper half of R(x)'s float32
                    pattern; float16: the IEEE half of R(x) (exact: R(x) is on the half grid), from integer
                    operations, so the CPU emulator runs it too (it has no cuda_fp16.h)
    bias_round_v1   y[r, c] = R(y[r, c] + R(b[c])) in place: linear's epilogue, out = R(x2 @ R(w)^T + R(b)) (the
                    product summed in float32 by cuBLAS, the bias added in float32, one rounding)

The bit tricks, on the pattern u of x (uint32):
    bfloat16   u + 0x7FFF + ((u >> 16) & 1), low 16 bits cleared: a low half above 0x8000 carries into the kept
               bits, below does not, exactly 0x8000 carries when the kept lowest bit is 1 (ties to even); a carry
               out of the mantissa raises the exponent, past the largest finite value it gives inf
    float16    the same with 13 dropped bits where the result is a normal half (|x| >= 2^-14); a magnitude that
               rounds to 2^16 or more is inf; below 2^-14 the halves are spaced 2^-24 apart and (|x| + 1/2) - 1/2
               in float32 (spacing 2^-24 at 1/2) rounds |x| to that grid, ties to even (__fadd_rn: never fused
               or re-associated)

Build and run standalone (validates the roundings against the CPU reference, then times; the attention kernels are
validated against refbert.ops by tests/test_cuda_mixed.py, on the emulator and on a GPU):
    nvcc -O3 -arch=sm_90 -std=c++17 -o mixed mixed.cu && ./mixed
On CPU threads:  g++ -std=c++20 -O1 -pthread -ffp-contract=off -DCPUSIM -DCPUSIM_SMALL -x c++ mixed.cu -o m && ./m
*/
#include "common.cuh"

// r on the compute grid (r == R(r)) -> its 16-bit storage pattern
__host__ __device__ __forceinline__ unsigned short bits16(float r, int kind) {
    const u32 u = BITS_F(r);
    if (kind == 0) return (unsigned short)(u >> 16);
    const u32 sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (unsigned short)(sign | 0x7E00u);          // NaN: the quiet half NaN
    if (a >= 0x7F800000u) return (unsigned short)(sign | 0x7C00u);         // inf
    if (a >= 0x38800000u) return (unsigned short)(sign | ((a >> 13) - (112u << 10)));   // normal: exponent -112
    return (unsigned short)(sign | (u32)(F_BITS(a) * 16777216.0f));   // subnormal: r / 2^-24, exact
}

extern "C" __global__ void __launch_bounds__(256) round_v1(const float* x, long long n, int kind, float* out) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x)
        out[e] = round_kind(x[e], kind);
}

extern "C" __global__ void __launch_bounds__(256) round16_v1(const float* x, long long n, int kind, int want32,
                                                             float* out32, unsigned short* __restrict__ bits) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) {
        const float r = round_kind(x[e], kind);
        if (want32) out32[e] = r;
        bits[e] = bits16(r, kind);
    }
}

// version 2 of each: version 1 on four consecutive elements a thread, a float4 load and store (round16: the four
// 16-bit patterns as one 8-byte store), grid-stride over n / 4. The launcher's conditions (kernels/cuda/mixed.py):
// n (bias_round: cols) a multiple of 4 and every array 16-byte aligned; otherwise version 1 runs.
__device__ __forceinline__ float4 round4(float4 v, int kind) {
    return make_float4(round_kind(v.x, kind), round_kind(v.y, kind), round_kind(v.z, kind), round_kind(v.w, kind));
}

extern "C" __global__ void __launch_bounds__(256) round_v2(const float* x, long long n, int kind, float* out) {
    const long long n4 = n >> 2;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n4; e += (long long)gridDim.x * blockDim.x)
        reinterpret_cast<float4*>(out)[e] = round4(reinterpret_cast<const float4*>(x)[e], kind);
}

extern "C" __global__ void __launch_bounds__(256) round16_v2(const float* x, long long n, int kind, int want32,
                                                             float* out32, unsigned short* __restrict__ bits) {
    const long long n4 = n >> 2;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n4; e += (long long)gridDim.x * blockDim.x) {
        const float4 r = round4(reinterpret_cast<const float4*>(x)[e], kind);
        if (want32) reinterpret_cast<float4*>(out32)[e] = r;
        reinterpret_cast<uint2*>(bits)[e] = make_uint2((u32)bits16(r.x, kind) | ((u32)bits16(r.y, kind) << 16),
                                                       (u32)bits16(r.z, kind) | ((u32)bits16(r.w, kind) << 16));
    }
}

extern "C" __global__ void __launch_bounds__(256) bias_round_v2(float* __restrict__ y, const float* __restrict__ b,
                                                                long long rows, int cols, int kind) {
    const int c4 = cols >> 2;
    const long long n4 = rows * c4;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n4; e += (long long)gridDim.x * blockDim.x) {
        const float4 bb = round4(reinterpret_cast<const float4*>(b)[e % c4], kind);
        const float4 v = reinterpret_cast<const float4*>(y)[e];
        reinterpret_cast<float4*>(y)[e] = round4(make_float4(v.x + bb.x, v.y + bb.y, v.z + bb.z, v.w + bb.w), kind);
    }
}

extern "C" __global__ void __launch_bounds__(256) bias_round_v1(float* __restrict__ y, const float* __restrict__ b,
                                                                long long rows, int cols, int kind) {
    for (long long r = blockIdx.x; r < rows; r += gridDim.x)              // a block per row (grid-stride)
        for (int c = threadIdx.x; c < cols; c += blockDim.x)
            y[r * cols + c] = round_kind(y[r * cols + c] + round_kind(b[c], kind), kind);
}

// ----------------------------------------------------------------------------------------------------------------
// attention S2: refbert.ops.attention_forward_mixed / attention_backward_mixed with the (B, H, T, T) products on
// cuBLAS (16-bit operands, float32 results) and everything between them in the kernels below. A 16-bit operand is
// written as bits (as16 = 1: the GEMM's input on a GPU) or as its float32 value (as16 = 0: the emulator's matmul).

__device__ __forceinline__ void put(float v, long long e, int kind, int as16, float* out32, unsigned short* bits) {
    if (as16) bits[e] = bits16(v, kind);
    else out32[e] = v;
}

// row r = (b H + h) T + t of a (B, H, T, ...) array -> b, h, t
struct BHT { long long b; int h, t; };
__device__ __forceinline__ BHT bht(long long r, int H, int T) {
    const long long bh = r / T;
    return {bh / H, (int)(bh % H), (int)(r % T)};
}
// element e = ((b H + h) T + t) hs + c of (B, H, T, hs) -> its offset in (B, T, H hs)
__device__ __forceinline__ long long btc(long long e, int T, int H, int hs) {
    const BHT q = bht(e / hs, H, T);
    return ((q.b * T + q.t) * H + q.h) * hs + (int)(e % hs);
}

// heads_v1: x (B, T, H hs) float32 -> R(x) as (B, H, T, hs)
extern "C" __global__ void __launch_bounds__(256) heads_v1(const float* __restrict__ x, long long n, int T, int H,
                                                           int hs, int kind, int as16, float* __restrict__ out32,
                                                           unsigned short* __restrict__ bits) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x)
        put(round_kind(x[btc(e, T, H, hs)], kind), e, kind, as16, out32, bits);
}

// merge_v1: y (B, H, T, hs) float32 -> out (B, T, H hs) = R(y f), f = (1 / l[b, h, t]) g with rows (the forward's
// normalisation: (1 / l) (1 / (1 - p))), else f = g
extern "C" __global__ void __launch_bounds__(256) merge_v1(const float* __restrict__ y, long long n, int T, int H,
                                                           int hs, const float* __restrict__ l, int rows, float g,
                                                           int kind, float* __restrict__ out) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) {
        const float f = rows ? __fmul_rn(1.0f / l[e / hs], g) : g;    // l's row e / hs = (b H + h) T + t
        out[btc(e, T, H, hs)] = round_kind(__fmul_rn(y[e], f), kind);
    }
}

// D_v1: D[b, h, t] = (sum_c R(dout)[b, t, h c] O[b, t, h c]) (1 - p), a warp per (b, h, t); dout and O (B, T, H hs)
extern "C" __global__ void __launch_bounds__(256) D_v1(const float* __restrict__ dout, const float* __restrict__ O,
                                                       long long rows, int T, int H, int hs, float kp, int kind,
                                                       float* __restrict__ D) {
    const long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);   // (b H + h) T + t
    const int lane = threadIdx.x & 31;
    if (r >= rows) return;
    const BHT q = bht(r, H, T);
    const long long base = ((q.b * T + q.t) * H + q.h) * hs;
    float acc = 0.f;
    for (int c = lane; c < hs; c += 32) acc += __fmul_rn(round_kind(dout[base + c], kind), O[base + c]);
    acc = warp_sum(acc);
    if (lane == 0) D[r] = __fmul_rn(acc, kp);
}

__device__ __forceinline__ float mask_at(const float* mask, long long mb, long long mh, long long mi, long long mj,
                                         long long b, int h, int i, int j) {
    return mask[b * mb + h * mh + i * mi + j * mj];
}

__device__ __forceinline__ bool kept(long long e, u64 seed, u64 stream, u64 thresh) {
    return thresh == 0 || (u64)philox_word((u64)e, stream, seed) >= thresh;
}

// attn_rows_fwd_v1: a warp per score row r = (b H + h) T + i of s (rows of T):
//   s' = s scale + mask;  m = max_j s';  pt = exp(s' - m);  l = sum_j pt;  P = R(pt) keep  (16-bit, or its value)
extern "C" __global__ void __launch_bounds__(256) attn_rows_fwd_v1(
        const float* __restrict__ s, const float* __restrict__ mask, long long mb, long long mh, long long mi,
        long long mj, long long rows, int H, int T, float scale, u64 seed, u64 stream, u64 thresh, int kind, int as16,
        float* __restrict__ P32, unsigned short* __restrict__ P16, float* __restrict__ m_out,
        float* __restrict__ l_out) {
    const long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= rows) return;
    const BHT q = bht(r, H, T);
    const float* row = s + r * T;
    float m = -INFINITY;
    for (int j = lane; j < T; j += 32)
        m = fmaxf(m, __fadd_rn(__fmul_rn(row[j], scale), mask_at(mask, mb, mh, mi, mj, q.b, q.h, q.t, j)));
    m = warp_max(m);
    float l = 0.f;
    for (int j = lane; j < T; j += 32) {
        const float pt =
            expf(__fadd_rn(__fmul_rn(row[j], scale), mask_at(mask, mb, mh, mi, mj, q.b, q.h, q.t, j)) - m);
        l += pt;
        const long long e = r * T + j;
        put(kept(e, seed, stream, thresh) ? round_kind(pt, kind) : 0.f, e, kind, as16, P32, P16);
    }
    l = warp_sum(l);
    if (lane == 0) { m_out[r] = m; l_out[r] = l; }
}

// attn_rows_bwd_v1: a warp per row; P = exp(s' - m) / l (s' as above), then
//   dS' = P (dP keep - D) -> R(dS');   Pk = R(P) keep   (each 16-bit, or its value)
extern "C" __global__ void __launch_bounds__(256) attn_rows_bwd_v1(
        const float* __restrict__ s, const float* __restrict__ dP, const float* __restrict__ mask, long long mb,
        long long mh, long long mi, long long mj, long long rows, int H, int T, float scale, u64 seed, u64 stream,
        u64 thresh, const float* __restrict__ m_in, const float* __restrict__ l_in, const float* __restrict__ D,
        int kind, int as16, float* __restrict__ dS32, unsigned short* __restrict__ dS16, float* __restrict__ Pk32,
        unsigned short* __restrict__ Pk16) {
    const long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= rows) return;
    const BHT q = bht(r, H, T);
    const float m = m_in[r], l = l_in[r], d = D[r];
    for (int j = lane; j < T; j += 32) {
        const long long e = r * T + j;
        const float P =
            expf(__fadd_rn(__fmul_rn(s[e], scale), mask_at(mask, mb, mh, mi, mj, q.b, q.h, q.t, j)) - m) / l;
        const bool k = kept(e, seed, stream, thresh);
        put(round_kind(__fmul_rn(P, (k ? dP[e] : 0.f) - d), kind), e, kind, as16, dS32, dS16);
        put(k ? round_kind(P, kind) : 0.f, e, kind, as16, Pk32, Pk16);
    }
}

#ifdef HOST_CODE
// the reference: the same bit tricks on the host (round_bf16 / round_f16 are __host__ too), checked here against
// every float16 the 16-bit patterns can name (float16: the host's half packing would need <cuda_fp16.h>; the
// round trip R(half(v)) == half(v) for every finite half, and rounding midpoints to even, covers it)
static float half_value(unsigned short h) {                 // the value of a half pattern, by its definition
    const int e = (h >> 10) & 31, m = h & 1023;
    const float s = (h & 0x8000) ? -1.f : 1.f;
    if (e == 31) return m ? NAN : s * INFINITY;
    return s * (e ? std::ldexp(1.f + m / 1024.f, e - 15) : std::ldexp((float)m, -24));
}

int main() {
    int bad = 0;
    for (u32 h = 0; h < 65536; h++) {                        // every half: R is the identity, bits16 its pattern
        const float v = half_value((unsigned short)h);
        if (std::isnan(v)) continue;
        if (round_f16(v) != v || bits16(v, 1) != h) bad++;
        if (((h >> 10) & 31) < 30 && !(h & 0x8000)) {        // the midpoint to the next half rounds to the even one
            const float next = half_value((unsigned short)(h + 1)), mid = (float)(((double)v + next) / 2);
            if (round_f16(mid) != ((h & 1) ? next : v)) bad++;
        }
    }
    printf("float16: %d wrong over every half pattern and midpoint\n", bad);
#ifdef CPUSIM_SMALL
    const long long n = 1000;
#else
    const long long n = 32LL * 128 * 3072;
#endif
    float* x = make_random_float(n, 7);
    for (long long e = 0; e < n; e++) x[e] = std::ldexp(x[e], (int)(e % 41) - 30);   // 2^-30 .. 2^10: subnormals too
    float *dx, *dout; unsigned short* dbits;
    cudaCheck(cudaMalloc(&dx, n * 4)); cudaCheck(cudaMalloc(&dout, n * 4)); cudaCheck(cudaMalloc(&dbits, n * 2));
    cudaCheck(cudaMemcpy(dx, x, n * 4, cudaMemcpyHostToDevice));
    std::vector<float> ref(n), got(n);
    std::vector<unsigned short> bits(n);
    const int grid = (int)std::min<long long>((n + 255) / 256, 65536);
    for (int kind = 0; kind < 2; kind++) {
        for (long long e = 0; e < n; e++) ref[e] = round_kind(x[e], kind);
        const int grid4 = (int)std::min<long long>((n / 4 + 255) / 256, 65536);
        for (int version = 1; version <= 2; version++) {
            auto launch = [&]() {
                if (version == 1) LAUNCH(round16_v1, grid, 256, dx, n, kind, 1, dout, dbits);
                else LAUNCH(round16_v2, grid4, 256, dx, n, kind, 1, dout, dbits);
            };
            cudaCheck(cudaMemset(dout, 0xFF, n * 4));
            cudaCheck(cudaMemset(dbits, 0xFF, n * 2));
            launch();
            cudaCheck(cudaDeviceSynchronize());
            cudaCheck(cudaMemcpy(got.data(), dout, n * 4, cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(bits.data(), dbits, n * 2, cudaMemcpyDeviceToHost));
            long long wrong = 0;
            for (long long e = 0; e < n; e++)
                wrong += std::memcmp(&got[e], &ref[e], 4) != 0 || bits[e] != bits16(ref[e], kind);
            printf("round16_v%d kind %d (%s): %lld of %lld elements differ from the host's bits\n", version, kind,
                   kind ? "float16" : "bfloat16", wrong, n);
            bad += (int)wrong;
            if (n >= (1 << 20)) {
                float ms = benchmark_kernel(20, launch);
                printf("  %.4f ms, %.0f GB/s (4 bytes read, 4 + 2 written an element)\n", ms, 10.0 * n / ms / 1e6);
            }
        }
    }
    free(x); cudaFree(dx); cudaFree(dout); cudaFree(dbits);
    if (bad) { printf("mixed: FAILED\n"); return 1; }
    printf("mixed: every version ok\n");
    return 0;
}
#endif
