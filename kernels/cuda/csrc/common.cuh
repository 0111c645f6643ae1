// Shared by every kernels/cuda/csrc/*.cu: storage conversions, the Philox4x32-10 of refbert/philox.py, warp
// reductions, mma.sync / cp.async wrappers, and (standalone builds only) host helpers for the validating mains.
//
// The .cu files compile two ways:
//   standalone:  nvcc -O3 -arch=sm_90 -o x file.cu && ./x      (a main validates against a CPU reference, times)
//   CuPy:        cupy.RawModule(code=..., options=("-I<csrc>", "-DNO_MAIN", "-std=c++17"))  (NVRTC; see cuda_c.py)
//   cpusim:      g++ -std=c++20 -pthread -ffp-contract=off -DCPUSIM -x c++ file.cu  (CPU threads; cpusim.cuh)
// Under NVRTC (__CUDACC_RTC__) no host headers exist, so everything host-side sits behind HOST_CODE. Under CPUSIM
// there is no inline PTX: HALF_TYPES (fp16 / bf16 storage, tensor cores, cp.async) is defined only with
// -DCPUSIM_HALF, where cpusim.cuh emulates them (tests/test_cuda_cpusim.py builds every main both ways).
#pragma once
#include "cpusim.cuh"

#if !defined(__CUDACC_RTC__) && !defined(NO_MAIN)
#define HOST_CODE 1
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <vector>
#include <algorithm>
#ifndef CPUSIM
#include <cuda_runtime.h>
#endif
#endif

#ifndef CPUSIM
#define HALF_TYPES 1
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#elif defined(CPUSIM_HALF)
#define HALF_TYPES 1                                      // cpusim.cuh's 16-bit types, mma.sync and cp.async
#endif

#ifndef INFINITY                                          // NVRTC has no <cmath>
#define INFINITY __int_as_float(0x7f800000)
#endif
#ifndef NAN
#define NAN __int_as_float(0x7fffffff)
#endif

typedef unsigned int u32;
typedef unsigned long long u64;

// ----------------------------------------------------------------------------------------------------------------
// storage <-> float32 (every sum and exp runs in float32; one rounding on the store)

__device__ __forceinline__ float to_f(float x) { return x; }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
#ifdef HALF_TYPES
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
#endif

#ifdef HALF_TYPES
// two floats -> one 32-bit register of two 16-bit values (low half = first), the A/B operand format of mma
__device__ __forceinline__ u32 pack2(float lo, float hi, __half) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<u32*>(&h);
}
__device__ __forceinline__ u32 pack2(float lo, float hi, __nv_bfloat16) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<u32*>(&h);
}
#endif

// ----------------------------------------------------------------------------------------------------------------
// mixed precision's rounding R (refbert.ops.round_bfloat16 / round_float16; the bit tricks: mixed.cu's header):
// round_kind(x, 0) to bfloat16, (x, 1) to float16, as float32 on that grid. rnd(x, rk) is what a float32 kernel
// applies to every compute-dtype value it reads and writes when it runs inside mixed precision: rk = -1 leaves x
// as it is (plain float32), 0 / 1 rounds.
// the same functions on the device and on the host (the standalone main's reference)
#if defined(__CUDA_ARCH__) || defined(CPUSIM)
#define BITS_F(x) __float_as_uint(x)
#define F_BITS(u) __uint_as_float(u)
#define ADD_RN(a, b) __fadd_rn(a, b)
#else
static inline u32 host_bits(float x) { u32 u; __builtin_memcpy(&u, &x, 4); return u; }
static inline float host_float(u32 u) { float x; __builtin_memcpy(&x, &u, 4); return x; }
#define BITS_F(x) host_bits(x)
#define F_BITS(u) host_float(u)
#define ADD_RN(a, b) ((a) + (b))
#endif

__host__ __device__ __forceinline__ float round_bf16(float x) {
    const u32 u = BITS_F(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return F_BITS((u & 0x80000000u) | 0x7FC00000u);   // NaN
    return F_BITS((u + (0x7FFFu + ((u >> 16) & 1u))) & 0xFFFF0000u);
}

// HW_HALF: on the GPU (the device pass of nvcc and NVRTC) the float16 conversions below are the hardware's cvt
// (cvt.rn.f16.f32: IEEE round to nearest even, subnormals kept, 65520 and up to inf; cvt.f32.f16 exact), NaN
// still as the bit code says; on the host (the mains' reference) and on CPU threads (CPUSIM) the bit code itself.
// Why: the bit code's branches and integer steps made the fp16 bodies of memory-bound kernels compute-bound (an
// H200, 2026-11-27: layernorm's dw, db partials 114 us a call in fp16-mixed against 24 us in bf16-mixed at
// 4096 x 768). The mains check the device's conversions bit for bit against the host's bit code.
#if defined(__CUDA_ARCH__) && !defined(CPUSIM)
#define HW_HALF 1
#endif

__host__ __device__ __forceinline__ float round_f16(float x) {
    const u32 u = BITS_F(x), sign = u & 0x80000000u, a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return F_BITS(sign | 0x7FC00000u);                                  // NaN
#ifdef HW_HALF
    return __half2float(__float2half_rn(x));
#else
    if (a < 0x38800000u) {                                                 // |x| < 2^-14: the subnormal halves
        const float s = ADD_RN(ADD_RN(F_BITS(a), 0.5f), -0.5f);
        return F_BITS(BITS_F(s) | sign);
    }
    u32 r = (u + (0xFFFu + ((u >> 13) & 1u))) & 0xFFFFE000u;
    if ((r & 0x7FFFFFFFu) >= 0x47800000u) r = sign | 0x7F800000u;          // rounds to 2^16 or more: inf
    return F_BITS(r);
#endif
}

__host__ __device__ __forceinline__ float round_kind(float x, int kind) {
    return kind == 0 ? round_bf16(x) : round_f16(x);
}

__host__ __device__ __forceinline__ float rnd(float x, int rk) { return rk < 0 ? x : round_kind(x, rk); }

// r on the compute grid (r == R(r)) -> its 16-bit storage pattern (exact): the tensor-core GEMM operand's bits
__host__ __device__ __forceinline__ unsigned short bits16(float r, int kind) {
    const u32 u = BITS_F(r);
    if (kind == 0) return (unsigned short)(u >> 16);
    const u32 sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (unsigned short)(sign | 0x7E00u);          // NaN: the quiet half NaN
#ifdef HW_HALF
    return __half_as_ushort(__float2half_rn(r));                           // (exact: r is on the grid)
#else
    if (a >= 0x7F800000u) return (unsigned short)(sign | 0x7C00u);         // inf
    if (a >= 0x38800000u) return (unsigned short)(sign | ((a >> 13) - (112u << 10)));   // normal: exponent -112
    return (unsigned short)(sign | (u32)(F_BITS(a) * 16777216.0f));   // subnormal: r / 2^-24, exact
#endif
}

// A kernel's "twin": beside a float32 output on the grid, its 16-bit bits for the GEMM that reads it next
// (kernels/cuda/mixed.py twin), o16 non-null and rk >= 0. Four consecutive ones (e % 4 == 0) in one 8-byte store.
__device__ __forceinline__ void put16(unsigned short* o16, size_t e, float r, int rk) {
    if (rk >= 0 && o16) o16[e] = bits16(r, rk);
}
__device__ __forceinline__ void put16x2(unsigned short* o16, size_t e, float r0, float r1, int rk) {   // e even
    if (rk >= 0 && o16) *reinterpret_cast<u32*>(o16 + e) = bits16(r0, rk) | ((u32)bits16(r1, rk) << 16);
}
__device__ __forceinline__ void put16x4(unsigned short* o16, size_t e, float4 r, int rk) {
    if (rk >= 0 && o16)
        *reinterpret_cast<uint2*>(o16 + e) = make_uint2(bits16(r.x, rk) | ((u32)bits16(r.y, rk) << 16),
                                                        bits16(r.z, rk) | ((u32)bits16(r.w, rk) << 16));
}

// 16-bit storage -> its float32 value (exact): bits16's inverse, bf16 (kind 0) or IEEE half (kind 1)
__host__ __device__ __forceinline__ float from16(unsigned short h, int kind) {
    if (kind == 0) return F_BITS((u32)h << 16);
    const u32 sign = (u32)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, f = h & 0x3FFu;
    if (e == 0x1Fu) return F_BITS(sign | 0x7F800000u | (f << 13));                   // inf, NaN
#ifdef HW_HALF
    return __half2float(__ushort_as_half(h));
#else
    if (e) return F_BITS(sign | ((e + 112u) << 23) | (f << 13));                      // normal: exponent + 112
    return F_BITS(sign | BITS_F((float)f * 5.9604644775390625e-8f));                  // subnormal, 0: f 2^-24
#endif
}

// An input a mixed-precision kernel reads either as float32 (p16 null: rounded by rnd on the way in) or as the
// 16-bit storage its forward kept (kernels/cuda/mixed.py "kept in 16 bits"): IN16 says which, a compile-time
// constant (RK16_DISPATCH below); the values are the same, R(x).
template <int IN16>
__device__ __forceinline__ float ld_in(const float* p, const unsigned short* p16, size_t e, int rk) {
    return IN16 ? from16(p16[e], rk) : rnd(p[e], rk);
}

// A kernel taking rk at run time calls its (force-inlined) body with rk a literal, RKC, in each branch: the body is
// compiled three times with rk constant, so the float32 one (-1) is the code it was before mixed precision (a
// run-time rk left in the body tripled its size in branches, and made the dropout kinds of layernorm v2 3.5x
// slower on an H200)
#define RK_DISPATCH(...)                                                                                         \
    if (rk < 0) { constexpr int RKC = -1; __VA_ARGS__; }                                                        \
    else if (rk == 0) { constexpr int RKC = 0; __VA_ARGS__; }                                                   \
    else { constexpr int RKC = 1; __VA_ARGS__; }

// RK_DISPATCH with IN16 too: 1 where in16 (the kernel's inputs given as 16-bit storage) and rk >= 0, else 0 (five
// bodies: the float32 one never reads 16-bit storage)
#define RK16_DISPATCH(in16, ...)                                                                                 \
    if (rk < 0) { constexpr int RKC = -1, IN16 = 0; __VA_ARGS__; }                                              \
    else if (rk == 0) {                                                                                         \
        if (in16) { constexpr int RKC = 0, IN16 = 1; __VA_ARGS__; }                                             \
        else { constexpr int RKC = 0, IN16 = 0; __VA_ARGS__; }                                                  \
    } else {                                                                                                    \
        if (in16) { constexpr int RKC = 1, IN16 = 1; __VA_ARGS__; }                                             \
        else { constexpr int RKC = 1, IN16 = 0; __VA_ARGS__; }                                                  \
    }


// ----------------------------------------------------------------------------------------------------------------
// Philox4x32-10, exactly refbert/philox.py: element e of dropout call (seed, stream) gets word e % 4 of
//   philox(counter = (lo(e/4), hi(e/4), lo(stream), hi(stream)), key = (lo(seed), hi(seed)))
// and is kept iff word >= thresh = round(p * 2^32) (thresh == 0: no dropout; thresh = 2^32: drop all).
//
// refbert_stream_shift is added to every stream a kernel is given: 0 always, but while a CUDA graph replays a
// captured training step (kernels/cuda/graph.py). The graph holds the streams of the step it captured as launch
// arguments; the replay sets the shift (one 8-byte copy per module) to (the dropout generator's calls now) - (its
// calls at the capture), so each replay draws the streams an eager step would at that point, and resets it to 0
// after. In constant memory: the same value for every thread, read through the constant cache, and no kernel can
// write it, so the compiler may keep it in a register.
__constant__ u64 refbert_stream_shift;

__device__ __forceinline__ uint4 philox4x32_10(u64 block, u64 stream, u64 seed) {
    stream += refbert_stream_shift;
    u32 c0 = (u32)block, c1 = (u32)(block >> 32), c2 = (u32)stream, c3 = (u32)(stream >> 32);
    u32 k0 = (u32)seed, k1 = (u32)(seed >> 32);
#pragma unroll
    for (int r = 0; r < 10; r++) {
        u32 hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        u32 hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        u32 n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
        k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
    }
    return make_uint4(c0, c1, c2, c3);
}

__device__ __forceinline__ u32 philox_word(u64 e, u64 stream, u64 seed) {
    uint4 w = philox4x32_10(e >> 2, stream, seed);
    u32 lane = (u32)(e & 3);
    return lane == 0 ? w.x : lane == 1 ? w.y : lane == 2 ? w.z : w.w;
}

// exp(x) as __expf computes it (ex2.approx of x times float32's log2 e) except that a result below float32's normal
// range (2^-126) is 0: ex2.approx.ftz, where __expf's ex2 without ftz spends a compare and two multiplies a call on
// keeping those subnormals (attention_backward.cu version 8). On CPU threads: cpusim's __expf, subnormals to 0.
#ifdef CPUSIM
__device__ __forceinline__ float exp_ftz(float x) {
    const float r = __expf(x);
    return r < 1.17549435e-38f ? 0.f : r;
}
#else
__device__ __forceinline__ float exp_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.44269504f));
    return y;
}
#endif

// keep factor of element e: dscale when kept (or no dropout), else 0
__device__ __forceinline__ float keep_z(u64 e, u64 seed, u64 stream, u64 thresh, float dscale) {
    if (thresh == 0) return dscale;
    return (u64)philox_word(e, stream, seed) >= thresh ? dscale : 0.0f;
}

// ----------------------------------------------------------------------------------------------------------------
// attention's padding skip (the tensor-core flash kernels): a key tile whose mask entries are all <= PAD_MIN (HF's
// float32 padding finfo.min, or -inf) adds exactly nothing to a row whose running max already came from a key above
// it: exp(x - m) with x <= PAD_MIN + scale q.k and m far above is 0 in float32 (for scores below 1e29 in size), the
// max does not move. Only for masks constant along the queries (si == 0: BERT's (B, 1, 1, T) padding mask), where a
// tile's 64 keys decide it. Every thread of the block calls it (a barrier); 64 keys from j0, keys past T padding.
// Limits: a float16 model's mask (finfo(float16).min = -65504) is above PAD_MIN, so its tiles are not skipped
// (exactness would need a bound on the scores); and a skipped tile's K / V are never read, so an inf or NaN there
// does not reach the output as it would without the skip (0 * inf).
#define PAD_MIN (-1e30f)
#ifdef CPUSIM
inline std::atomic<long long> cpusim_skipped_tiles{0};   // the mains print it: the skip is taken, not only written
#define COUNT_SKIP(tid) do { if ((tid) == 0) cpusim_skipped_tiles++; } while (0)
#else
#define COUNT_SKIP(tid) do {} while (0)
#endif
__device__ __forceinline__ bool keys_all_padding(const float* mask, long long base, long long sj, int j0, int Tn,
                                                 int tid) {
    const int j = j0 + tid;
    return !__syncthreads_or(tid < 64 && j < Tn && mask[base + j * sj] > PAD_MIN);
}

// ----------------------------------------------------------------------------------------------------------------
// warp reductions (butterfly: every lane gets the result)

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// fixed-order block sum for blockDim.x a multiple of 32 (<= 1024): warp sums, then every warp adds the warp totals
// in warp order through buf (shared, >= 32 floats); every thread gets the same total, the same bits every run.
__device__ __forceinline__ float block_sum(float v, float* buf) {
    v = warp_sum(v);
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    __syncthreads();                                               // buf is free (a previous call has read it)
    if (lane == 0) buf[w] = v;
    __syncthreads();
    return warp_sum(lane < nw ? buf[lane] : 0.f);
}

// ----------------------------------------------------------------------------------------------------------------
// 128-bit accesses (the launchers pass vec = 1 only when C % 4 == 0 and every pointer is 16-byte aligned) and the
// keep factors of four consecutive elements e .. e + 3 with e % 4 == 0: the four words of one Philox block

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void st4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ float4 rnd4(float4 v, int rk) {                  // rnd on each of four
    return rk < 0 ? v : make_float4(rnd(v.x, rk), rnd(v.y, rk), rnd(v.z, rk), rnd(v.w, rk));
}

template <int IN16>
__device__ __forceinline__ float4 ld_in4(const float* p, const unsigned short* p16, size_t e, int rk) {
    if (IN16) {                                                     // e % 4 == 0, p16 8-byte aligned
        const uint2 u = *reinterpret_cast<const uint2*>(p16 + e);
        return make_float4(from16((unsigned short)(u.x & 0xFFFFu), rk), from16((unsigned short)(u.x >> 16), rk),
                           from16((unsigned short)(u.y & 0xFFFFu), rk), from16((unsigned short)(u.y >> 16), rk));
    }
    return rnd4(ld4(p + e), rk);
}

// a hint that p's cache line will be read soon: it is fetched into L2 while the thread goes on (no register holds
// it; a later load of it finds it there). On CPU threads (CPUSIM) nothing: a hint changes no value.
#ifdef CPUSIM
__device__ __forceinline__ void prefetch_l2(const void*) {}
#else
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(__cvta_generic_to_global(p)));     // (a global address)
}
#endif

// what a forward keeps for its backward in 16 bits (k16 non-null, rk >= 0): the bits of R(p[e]) (of four at e)
__device__ __forceinline__ void keep16(const float* p, unsigned short* k16, size_t e, int rk) {
    if (rk >= 0 && k16) k16[e] = bits16(rnd(p[e], rk), rk);
}
__device__ __forceinline__ void keep16x4(const float* p, unsigned short* k16, size_t e, int rk) {
    if (rk >= 0 && k16) put16x4(k16, e, rnd4(ld4(p + e), rk), rk);
}

__device__ __forceinline__ float4 keep4(u64 e, u64 seed, u64 stream, u64 thresh, float dscale) {
    const uint4 w = philox4x32_10(e >> 2, stream, seed);
    return make_float4((u64)w.x >= thresh ? dscale : 0.f, (u64)w.y >= thresh ? dscale : 0.f,
                       (u64)w.z >= thresh ? dscale : 0.f, (u64)w.w >= thresh ? dscale : 0.f);
}

#ifdef HALF_TYPES
// ----------------------------------------------------------------------------------------------------------------
// tensor cores (sm_80+): mma.sync m16n8k16, fp16 / bf16 inputs, fp32 accumulators.  Fragments, with
// g = lane / 4 (groupID), t = lane % 4 (thread in group):
//   A 16x16 row-major: a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]
//   B 16x8 (k x n):    b0 = B[2t..2t+1][g],  b1 = B[2t+8..2t+9][g]        (each a pair along k)
//   C 16x8 fp32:       c0, c1 = C[g][2t..2t+1],  c2, c3 = C[g+8][2t..2t+1]

#ifdef CPUSIM
__device__ __forceinline__ void mma16816(float* c, const u32* a, const u32* b, __half) {
    cpusim::mma16816<__half>(c, a, b);
}
__device__ __forceinline__ void mma16816(float* c, const u32* a, const u32* b, __nv_bfloat16) {
    cpusim::mma16816<__nv_bfloat16>(c, a, b);
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
    cpusim::cp_async16(smem, gmem, src_bytes);
}
__device__ __forceinline__ void cp_async_commit() {}
template <int N> __device__ __forceinline__ void cp_async_wait() {}
__device__ __forceinline__ void ldsm_x4(u32* r, const void* smem) { cpusim::ldsm_x4<false>(r, smem); }
__device__ __forceinline__ void ldsm_x4_t(u32* r, const void* smem) { cpusim::ldsm_x4<true>(r, smem); }
#else
__device__ __forceinline__ void mma16816(float* c, const u32* a, const u32* b, __half) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma16816(float* c, const u32* a, const u32* b, __nv_bfloat16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// cp.async: 16 bytes global -> shared, bypassing registers; src_bytes = 0 zero-fills (rows past T)
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
    u32 s = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ldmatrix x4: four 8 x 8 matrices of 16-bit values from shared memory in one instruction; lane L gives the address
// of row L % 8 of matrix L / 8 (16 bytes, 16-byte aligned), register i of lane L gets matrix i's row L / 4, columns
// 2 (L % 4) .. + 1: the layout of an mma A or B fragment. _t (.trans): column L / 4, rows 2 (L % 4) .. + 1
// (a B fragment of a matrix stored k-major, V for P V). asm volatile: ordered with the barriers around it.
__device__ __forceinline__ void ldsm_x4(u32* r, const void* smem) {
    const u32 s = (u32)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}
__device__ __forceinline__ void ldsm_x4_t(u32* r, const void* smem) {
    const u32 s = (u32)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}
#endif  // CPUSIM
#endif  // HALF_TYPES

// ----------------------------------------------------------------------------------------------------------------
// host helpers for the standalone mains

#ifdef HOST_CODE
#define cudaCheck(err) cuda_check((err), __FILE__, __LINE__)
inline void cuda_check(cudaError_t e, const char* file, int line) {
    if (e != cudaSuccess) {
        printf("[CUDA ERROR] at %s:%d\n%s\n", file, line, cudaGetErrorString(e));
        exit(EXIT_FAILURE);
    }
}

inline float* make_random_float(size_t n, unsigned seed) {   // uniform in [-1, 1), reproducible
    float* a = (float*)malloc(n * sizeof(float));
    unsigned s = seed * 2654435761u + 1u;
    for (size_t i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        a[i] = (float)((s >> 8) & 0xFFFFFF) / 8388608.0f - 1.0f;
    }
    return a;
}

// host Philox (the same function, for the CPU references)
inline u32 philox_word_host(u64 e, u64 stream, u64 seed) {
    u64 block = e >> 2;
    u32 c0 = (u32)block, c1 = (u32)(block >> 32), c2 = (u32)stream, c3 = (u32)(stream >> 32);
    u32 k0 = (u32)seed, k1 = (u32)(seed >> 32);
    for (int r = 0; r < 10; r++) {
        u64 p0 = (u64)0xD2511F53u * c0, p1 = (u64)0xCD9E8D57u * c2;
        u32 n0 = (u32)(p1 >> 32) ^ c1 ^ k0, n2 = (u32)(p0 >> 32) ^ c3 ^ k1;
        c0 = n0; c1 = (u32)p1; c2 = n2; c3 = (u32)p0;
        k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
    }
    u32 w[4] = {c0, c1, c2, c3};
    return w[e & 3];
}

// |got - ref| <= atol + rtol |ref| everywhere, else print the first few mismatches and exit (llm.c style)
template <typename T>
inline void validate_result(const T* d_got, const float* ref, const char* name, size_t n, float atol, float rtol) {
    std::vector<T> h(n);
    cudaCheck(cudaMemcpy(h.data(), d_got, n * sizeof(T), cudaMemcpyDeviceToHost));
    int bad = 0;
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        float g = (float)h[i];
        double err = fabs((double)g - ref[i]) / (atol + rtol * fabs((double)ref[i]));
        if (!(err <= 1.0)) {
            if (bad < 5) printf("  %s mismatch at %zu: got %f, expected %f\n", name, i, g, ref[i]);
            bad++;
        }
        if (err > worst || err != err) worst = err;
    }
    if (bad) {
        printf("%s: %d of %zu entries outside atol %g + rtol %g\n", name, bad, n, atol, rtol);
        exit(EXIT_FAILURE);
    }
    printf("  %s ok (worst err/tol %.3f)\n", name, worst);
}

template <class F>
inline float benchmark_kernel(int repeats, F launch) {       // mean ms per launch, after one warm-up
#ifdef CPUSIM
    (void)repeats;                  // CPU threads: no timing runs (a time there means nothing, and each run of a
    (void)launch;                   // kernel on CPU threads costs what its validation did: most of a main's time)
    return 0.f;
#else
    cudaEvent_t a, b;
    cudaCheck(cudaEventCreate(&a));
    cudaCheck(cudaEventCreate(&b));
    launch();
    cudaCheck(cudaEventRecord(a));
    for (int i = 0; i < repeats; i++) launch();
    cudaCheck(cudaEventRecord(b));
    cudaCheck(cudaEventSynchronize(b));
    float ms = 0.f;
    cudaCheck(cudaEventElapsedTime(&ms, a, b));
    cudaCheck(cudaGetLastError());
    return ms / repeats;
#endif
}
#endif
