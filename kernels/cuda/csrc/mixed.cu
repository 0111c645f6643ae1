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
                    operations on the host and CPU threads (no cuda_fp16.h there), by the hardware's cvt on the GPU
                    (common.cuh HW_HALF; the main below compares the two bit for bit)
    bias_round_v1   y[r, c] = R(y[r, c] + R(b[c])) in place: linear's epilogue, out = R(x2 @ R(w)^T + R(b)) (the
                    product summed in float32 by cuBLAS, the bias added in float32, one rounding); o16 non-null:
                    y's twin (its 16-bit storage) beside it
    bias_round_v3   bias_round_v1 with float4 loads and stores from each row's first 16-byte boundary: rows of any
                    length (v2 needs cols % 4 == 0)
    add_round_v1    out = acc + R(y): a linear's backward with dx_into (refbert.ops.linear_backward), the gradient
                    of its input from the other paths plus R(dx), the spec's rounded dx, in one pass (where a round
                    pass and an add read and wrote the array twice); float32, not rounded (the sum of two terms
                    on the grid is not: the next op rounds it as it reads it)

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
#include "flash_tc.cuh"

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

// y = R(y + R(b)) in place, b along the rows; o16 non-null: y's twin (its 16-bit storage) written beside it
extern "C" __global__ void __launch_bounds__(256) bias_round_v2(float* __restrict__ y, const float* __restrict__ b,
                                                                long long rows, int cols, int kind,
                                                                unsigned short* __restrict__ o16) {
    const int c4 = cols >> 2;
    const long long n4 = rows * c4;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n4; e += (long long)gridDim.x * blockDim.x) {
        const float4 bb = round4(reinterpret_cast<const float4*>(b)[e % c4], kind);
        const float4 v = reinterpret_cast<const float4*>(y)[e];
        const float4 r = round4(make_float4(v.x + bb.x, v.y + bb.y, v.z + bb.z, v.w + bb.w), kind);
        reinterpret_cast<float4*>(y)[e] = r;
        put16x4(o16, 4 * e, r, kind);
    }
}

extern "C" __global__ void __launch_bounds__(256) bias_round_v1(float* __restrict__ y, const float* __restrict__ b,
                                                                long long rows, int cols, int kind,
                                                                unsigned short* __restrict__ o16) {
    for (long long r = blockIdx.x; r < rows; r += gridDim.x)              // a block per row (grid-stride)
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            const float v = round_kind(y[r * cols + c] + round_kind(b[c], kind), kind);
            y[r * cols + c] = v;
            put16(o16, r * cols + c, v, kind);
        }
}

// bias_round_v3: version 1 (a block per row) for rows whose length is no multiple of 4 (the MLM decoder's logits,
// cols = 30522: there version 2 cannot run), with float4 loads and stores of y from the row's first 16-byte boundary
// (the head before it and the tail after the last whole quad element by element; y 16-byte aligned: the launcher's
// condition), b read element by element (cols floats: cached). Version 1's arithmetic: the same bits (the main
// compares them). On the H200 (2026-11-27) version 1 took 0.74 ms of the bf16-mixed step on 4096 x 30522 logits,
// at a third of the bandwidth.
extern "C" __global__ void __launch_bounds__(256) bias_round_v3(float* __restrict__ y, const float* __restrict__ b,
                                                                long long rows, int cols, int kind,
                                                                unsigned short* __restrict__ o16) {
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const long long e0 = r * cols;
        int head = (int)((4 - (e0 & 3)) & 3);                 // elements before the row's first quad boundary
        if (head > cols) head = cols;
        const int quads = (cols - head) >> 2, tail0 = head + 4 * quads;
        for (int c = threadIdx.x; c < head; c += blockDim.x) {
            const float v = round_kind(y[e0 + c] + round_kind(b[c], kind), kind);
            y[e0 + c] = v;
            put16(o16, e0 + c, v, kind);
        }
        float4* const y4 = reinterpret_cast<float4*>(y + e0 + head);       // e0 + head: a multiple of 4
        for (int q = threadIdx.x; q < quads; q += blockDim.x) {
            const int c = head + 4 * q;
            const float4 v = y4[q];
            const float4 r4 = round4(make_float4(v.x + round_kind(b[c], kind), v.y + round_kind(b[c + 1], kind),
                                                 v.z + round_kind(b[c + 2], kind), v.w + round_kind(b[c + 3], kind)),
                                     kind);
            y4[q] = r4;
            put16x4(o16, e0 + c, r4, kind);
        }
        for (int c = tail0 + threadIdx.x; c < cols; c += blockDim.x) {
            const float v = round_kind(y[e0 + c] + round_kind(b[c], kind), kind);
            y[e0 + c] = v;
            put16(o16, e0 + c, v, kind);
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) add_round_v1(const float* __restrict__ y,
                                                               const float* __restrict__ acc, long long n, int kind,
                                                               float* __restrict__ out) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x)
        out[e] = acc[e] + round_kind(y[e], kind);
}

extern "C" __global__ void __launch_bounds__(256) add_round_v2(const float* __restrict__ y,
                                                               const float* __restrict__ acc, long long n, int kind,
                                                               float* __restrict__ out) {
    const long long n4 = n >> 2;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n4; e += (long long)gridDim.x * blockDim.x) {
        const float4 r = round4(reinterpret_cast<const float4*>(y)[e], kind), a = reinterpret_cast<const float4*>(acc)[e];
        reinterpret_cast<float4*>(out)[e] = make_float4(a.x + r.x, a.y + r.y, a.z + r.z, a.w + r.w);
    }
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
// normalisation: (1 / l) (1 / (1 - p))), else f = g; o16 (null: none): out's twin, its bits (the next linear's
// GEMM operand)
extern "C" __global__ void __launch_bounds__(256) merge_v1(const float* __restrict__ y, long long n, int T, int H,
                                                           int hs, const float* __restrict__ l, int rows, float g,
                                                           int kind, float* __restrict__ out,
                                                           unsigned short* __restrict__ o16) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) {
        const float f = rows ? __fmul_rn(1.0f / l[e / hs], g) : g;    // l's row e / hs = (b H + h) T + t
        const long long o = btc(e, T, H, hs);
        const float r = round_kind(__fmul_rn(y[e], f), kind);
        out[o] = r;
        put16(o16, o, r, kind);
    }
}

// heads_v2, merge_v2: versions 1 with four consecutive elements of a head's row a thread (hs a multiple of 4, the
// arrays 16-byte aligned, n / 4 < 2^31 quads: the launcher's conditions, kernels/cuda/mixed.py), float4 loads and
// stores (the 16-bit patterns as one 8-byte store), the row's b, h, t from 32-bit divisions once per four elements.
// Version 1 divides 64-bit integers three times an element (bht, btc): on the H200 (2026-11-27) heads_v1 and
// merge_v1 took 13% of the bf16-mixed step's GPU time, 26 and 22 us a call on 4096 x 768 elements, where the
// bytes alone take a few. The same values, the same roundings: the same bits (the main compares them).
extern "C" __global__ void __launch_bounds__(256) heads_v2(const float* __restrict__ x, long long n, int T, int H,
                                                           int hs, int kind, int as16, float* __restrict__ out32,
                                                           unsigned short* __restrict__ bits) {
    const unsigned q4 = (unsigned)hs >> 2;                          // quads a row
    for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < n >> 2;
         g += (long long)gridDim.x * blockDim.x) {
        const unsigned r = (unsigned)g / q4, c = ((unsigned)g - r * q4) * 4, bh = r / (unsigned)T,
                       t = r - bh * (unsigned)T, b = bh / (unsigned)H, h = bh - b * (unsigned)H;
        const long long src = (((long long)b * T + t) * H + h) * hs + c, e = 4 * g;   // e = r hs + c
        const float4 v = round4(*reinterpret_cast<const float4*>(x + src), kind);
        if (as16) put16x4(bits, e, v, kind);
        else *reinterpret_cast<float4*>(out32 + e) = v;
    }
}
extern "C" __global__ void __launch_bounds__(256) merge_v2(const float* __restrict__ y, long long n, int T, int H,
                                                           int hs, const float* __restrict__ l, int rows, float g,
                                                           int kind, float* __restrict__ out,
                                                           unsigned short* __restrict__ o16) {
    const unsigned q4 = (unsigned)hs >> 2;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n >> 2;
         i += (long long)gridDim.x * blockDim.x) {
        const unsigned r = (unsigned)i / q4, c = ((unsigned)i - r * q4) * 4, bh = r / (unsigned)T,
                       t = r - bh * (unsigned)T, b = bh / (unsigned)H, h = bh - b * (unsigned)H;
        const float f = rows ? __fmul_rn(1.0f / l[r], g) : g;      // l's row r = (b H + h) T + t
        const float4 v = *reinterpret_cast<const float4*>(y + 4 * i);
        const float4 o = round4(make_float4(__fmul_rn(v.x, f), __fmul_rn(v.y, f), __fmul_rn(v.z, f),
                                            __fmul_rn(v.w, f)), kind);
        const long long dst = (((long long)b * T + t) * H + h) * hs + c;
        *reinterpret_cast<float4*>(out + dst) = o;
        put16x4(o16, dst, o, kind);
    }
}

// D_v1: D[b, h, t] = (sum_c R(dout)[b, t, h c] O[b, t, h c]) (1 - p), a warp per (b, h, t); dout and O (B, T, H hs);
// O16 non-null: O as the forward kept it, in 16 bits (O is then not read)
template <int IN16>
__device__ __forceinline__ void D_body(const float* __restrict__ dout, const float* __restrict__ O,
                                       const unsigned short* __restrict__ O16, long long rows, int T, int H, int hs,
                                       float kp, int kind, float* __restrict__ D) {
    const long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);   // (b H + h) T + t
    const int lane = threadIdx.x & 31;
    if (r >= rows) return;
    const BHT q = bht(r, H, T);
    const long long base = ((q.b * T + q.t) * H + q.h) * hs;
    float acc = 0.f;
    for (int c = lane; c < hs; c += 32)
        acc += __fmul_rn(round_kind(dout[base + c], kind), IN16 ? from16(O16[base + c], kind) : O[base + c]);
    acc = warp_sum(acc);
    if (lane == 0) D[r] = __fmul_rn(acc, kp);
}
extern "C" __global__ void __launch_bounds__(256) D_v1(const float* __restrict__ dout, const float* __restrict__ O,
                                                       long long rows, int T, int H, int hs, float kp, int kind,
                                                       float* __restrict__ D, const unsigned short* __restrict__ O16) {
    if (O16) D_body<1>(dout, O, O16, rows, T, H, hs, kp, kind, D);
    else D_body<0>(dout, O, O16, rows, T, H, hs, kp, kind, D);
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

// Version 2 of the row kernels: version 1's arithmetic in version 1's order (lane L takes the row's elements
// j = L, L + 32, ..., the same per-lane sums, the same warp tree: the same bits; the main compares them), with the
// Philox keep-mask drawn once per four elements instead of once per element: for each 128 elements of a row, lane L
// draws the four words of the chunk's quad L (one philox4x32_10 call; version 1 made one per element and used one
// of its four words) and hands each word to the lane that needs it (__shfl_sync: element 32 k + L of the chunk is
// word L % 4 of quad 8 k + L / 4). A call runs 10 rounds of 32-bit multiplies: on the H200 (2026-11-27) the two
// version-1 kernels took 1.4 ms of the bf16-mixed step (8%) at B=32 T=128, at a fraction of the bandwidth; and the
// row's mask offset is computed once (version 1: three 64-bit products an element). The launcher's condition:
// T % 4 == 0 (a row's chunks then start on a quad: e = r T + j).
__device__ __forceinline__ uint4 rows_draw(long long e0, u64 seed, u64 stream, u64 thresh, int lane) {
    return thresh ? philox4x32_10((u64)(e0 >> 2) + lane, stream, seed) : make_uint4(0u, 0u, 0u, 0u);
}
__device__ __forceinline__ bool rows_kept(uint4 w, int k, int lane, u64 thresh) {   // element 32 k + lane
    const int src = 8 * k + (lane >> 2);                      // every lane shuffles: the caller's loop is uniform
    const u32 x = __shfl_sync(0xffffffffu, w.x, src), y = __shfl_sync(0xffffffffu, w.y, src),
              z = __shfl_sync(0xffffffffu, w.z, src), v = __shfl_sync(0xffffffffu, w.w, src);
    const int a = lane & 3;
    return thresh == 0 || (u64)(a == 0 ? x : a == 1 ? y : a == 2 ? z : v) >= thresh;
}
// f(j, e, keep) for every element j < T of row r (e = r T + j) in version 1's per-lane order (lane L: j = L, L + 32,
// ...), the keep words drawn once per 128 elements and handed out; every lane runs every iteration (the shuffles)
template <typename F>
__device__ __forceinline__ void rows_each(long long r, int T, u64 seed, u64 stream, u64 thresh, int lane, F f) {
    for (int j0 = 0; j0 < T; j0 += 128) {
        const uint4 w = rows_draw(r * T + j0, seed, stream, thresh, lane);
#pragma unroll                               // (the backward partly unrolled: ptxas spilled 4 bytes, sm_90)
        for (int k = 0; k < 4; k++) {
            const int j = j0 + 32 * k + lane;
            const bool keep = rows_kept(w, k, lane, thresh);
            if (j < T) f(j, r * T + j, keep);
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) attn_rows_fwd_v2(
        const float* __restrict__ s, const float* __restrict__ mask, long long mb, long long mh, long long mi,
        long long mj, long long rows, int H, int T, float scale, u64 seed, u64 stream, u64 thresh, int kind, int as16,
        float* __restrict__ P32, unsigned short* __restrict__ P16, float* __restrict__ m_out,
        float* __restrict__ l_out) {
    const long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= rows) return;                                    // warp-uniform
    const BHT q = bht(r, H, T);
    const float* row = s + r * T;
    const float* mrow = mask + q.b * mb + q.h * mh + q.t * mi;
    float m = -INFINITY;
    for (int j = lane; j < T; j += 32)
        m = fmaxf(m, __fadd_rn(__fmul_rn(row[j], scale), mrow[j * mj]));
    m = warp_max(m);
    float l = 0.f;
    rows_each(r, T, seed, stream, thresh, lane, [&](int j, long long e, bool keep) {
        const float pt = expf(__fadd_rn(__fmul_rn(row[j], scale), mrow[j * mj]) - m);
        l += pt;
        put(keep ? round_kind(pt, kind) : 0.f, e, kind, as16, P32, P16);
    });
    l = warp_sum(l);
    if (lane == 0) { m_out[r] = m; l_out[r] = l; }
}

extern "C" __global__ void __launch_bounds__(256) attn_rows_bwd_v2(
        const float* __restrict__ s, const float* __restrict__ dP, const float* __restrict__ mask, long long mb,
        long long mh, long long mi, long long mj, long long rows, int H, int T, float scale, u64 seed, u64 stream,
        u64 thresh, const float* __restrict__ m_in, const float* __restrict__ l_in, const float* __restrict__ D,
        int kind, int as16, float* __restrict__ dS32, unsigned short* __restrict__ dS16, float* __restrict__ Pk32,
        unsigned short* __restrict__ Pk16) {
    const long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= rows) return;
    const BHT q = bht(r, H, T);
    const float* mrow = mask + q.b * mb + q.h * mh + q.t * mi;
    const float m = m_in[r], l = l_in[r], d = D[r];
    rows_each(r, T, seed, stream, thresh, lane, [&](int j, long long e, bool keep) {
        const float P = expf(__fadd_rn(__fmul_rn(s[e], scale), mrow[j * mj]) - m) / l;
        put(round_kind(__fmul_rn(P, (keep ? dP[e] : 0.f) - d), kind), e, kind, as16, dS32, dS16);
        put(keep ? round_kind(P, kind) : 0.f, e, kind, as16, Pk32, Pk16);
    });
}

#ifdef HALF_TYPES
// ----------------------------------------------------------------------------------------------------------------
// attention S3: the spec (refbert.ops.attention_forward_mixed / attention_backward_mixed) as tensor-core flash
// kernels, hs = 64, with no (B, H, T, T) array: q, k, v, dout in 16-bit storage (B, T, C) (round16: R(x) exactly),
// a CTA of 4 warps per (b, h, 64-row tile), flash_tc.cuh's tiles and fragments. The spec's rounding sites: the
// forward walks the keys twice, the first time for the row max alone, so R(pt) = R(exp(s' - m)) with the row's
// final m as the spec has it (a one-pass flash rescales already-rounded terms); R(P) keep and R(dS') in the
// backward, packed into 16 bits where a tensor core reads them; out, dq, dk, dv rounded once as they are stored
// (float32 values on the compute grid, (B, T, C)). What differs from the spec is float32 noise, as in S2: the order
// of the sums (the tensor cores', the row sums'), the tensor cores' own accumulation (not an IEEE add per term),
// and the last bits of exp (CUDA's expf and NumPy's are both within ~2 ulp, not correctly rounded), each able to
// move a value across a compute-dtype rounding boundary. s' = s scale + mask rounds twice (__fmul_rn, __fadd_rn:
// never an FMA), P divides by l, out multiplies by (1 / l) rp: as NumPy does.

#define S3_ARGS(T)                                                                                              \
    const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v, const float *__restrict__ mask,   \
        long long sb, long long sh, long long si, long long sj, int Tn, int H, float scale, u64 seed,            \
        u64 stream, u64 thresh, int kind

// s' of score s at (query i, key j): -inf past T; the mask only where both are real (rows past T are computed but
// never stored)
__device__ __forceinline__ float s3_score(float s, float scale, const float* mask, long long mb, long long si,
                                          long long sj, int i, int j, int Tn) {
    if (j >= Tn) return -INFINITY;
    const float x = __fmul_rn(s, scale);
    return mask && i < Tn ? __fadd_rn(x, mask[mb + i * si + j * sj]) : x;
}

// S4 (QUAD): S3 with dropout's keep-mask drawn a Philox call per 4 scores where T % 4 == 0 (keys 4G .. 4G + 3 of a
// row are one Philox block: flash_tc.cuh tc_words_rows in the forward and the dq pass, tc_words_cols in the dk, dv
// pass), where S3 makes a call a score (in the forward and again in each backward pass) and uses one of its four
// words: the same words, so S3's bits (tests/test_cuda_mixed.py compares them).

// forward: out = R((sum_j keep R(pt) v_j) (1 / l) rp), m, l per row; grid (ceil(T / 64), B H), block 128
template <typename T, bool QUAD = false>
__device__ __forceinline__ void s3_fwd(S3_ARGS(T), float rp, float* __restrict__ out,
                                       unsigned short* __restrict__ o16, float* __restrict__ m_out,
                                       float* __restrict__ l_out) {
    __shared__ __align__(16) T Ks[2][64 * TC_LD];
    __shared__ __align__(16) T Vs[2][64 * TC_LD];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, i0 = blockIdx.x * 64, C = H * 64;
    const size_t base = (size_t)b * Tn * C + h * 64;
    const long long mb = b * sb + h * sh;
    u32 qa[4][4], unused[4][4];                               // the query tile, staged, kept as A fragments
    tc_stage_frags<T>(qa, unused, Ks[1], nullptr, q + base, nullptr, i0, Tn, C);
    const int ir[2] = {i0 + warp * 16 + g, i0 + warp * 16 + g + 8};
    // pass 1: the row max of s'
    float mrow[2] = {-INFINITY, -INFINITY};
    tc_key_tiles<T>(Ks, nullptr, k + base, nullptr, Tn, C, [&](int cur, int j0) {
        float s[8][4];
        tc_rows_times_t<T>(s, qa, Ks[cur], g, t4);
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                mrow[e >> 1] = fmaxf(mrow[e >> 1], s3_score(s[n][e], scale, mask, mb, si, sj, ir[e >> 1],
                                                            j0 + n * 8 + t4 * 2 + (e & 1), Tn));
    });
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mrow[r] = fmaxf(mrow[r], __shfl_xor_sync(0xffffffffu, mrow[r], 1));
        mrow[r] = fmaxf(mrow[r], __shfl_xor_sync(0xffffffffu, mrow[r], 2));
    }
    // pass 2: pt = exp(s' - m), l = sum pt (dropped ones too), y += keep R(pt) v
    float y[8][4], lrow[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < 8; n++) y[n][0] = y[n][1] = y[n][2] = y[n][3] = 0.f;
    const bool quad = QUAD && thresh && (Tn & 3) == 0;       // (uniform: every lane draws, or none)
    tc_key_tiles<T>(Ks, Vs, k + base, v + base, Tn, C, [&](int cur, int j0) {
        float s[8][4];
        tc_rows_times_t<T>(s, qa, Ks[cur], g, t4);
#pragma unroll
        for (int n = 0; n < 8; n++) {
            u32 w[4] = {0u, 0u, 0u, 0u};
            if (quad) tc_words_rows(w, bh, Tn, ir[0], ir[1], j0 + n * 8, t4, seed, stream);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = e >> 1, j = j0 + n * 8 + t4 * 2 + (e & 1);
                float pt = 0.f;
                if (j < Tn) {
                    pt = expf(s3_score(s[n][e], scale, mask, mb, si, sj, ir[r], j, Tn) - mrow[r]);
                    lrow[r] += pt;
                    if (quad ? (u64)w[e] < thresh : !kept(((u64)bh * Tn + ir[r]) * Tn + j, seed, stream, thresh))
                        pt = 0.f;
                }
                s[n][e] = pt;                                 // rounded to 16 bits as the P V operand
            }
        }
        tc_acc_times<T>(y, s, Vs[cur], g, t4);
    });
#pragma unroll
    for (int r = 0; r < 2; r++) {
        lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 1);
        lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 2);
        if (ir[r] >= Tn) continue;
        const float f = __fmul_rn(1.0f / lrow[r], rp);
        const size_t o = base + (size_t)ir[r] * C + t4 * 2;
#pragma unroll
        for (int n = 0; n < 8; n++) {
            const float r0 = round_kind(__fmul_rn(y[n][2 * r], f), kind);
            const float r1 = round_kind(__fmul_rn(y[n][2 * r + 1], f), kind);
            out[o + n * 8] = r0;
            out[o + n * 8 + 1] = r1;
            put16x2(o16, o + n * 8, r0, r1, kind);
        }
        if (t4 == 0) {
            m_out[(size_t)bh * Tn + ir[r]] = mrow[r];
            l_out[(size_t)bh * Tn + ir[r]] = lrow[r];
        }
    }
}

// backward pass 1, per 64-key tile: dv = R((sum_i keep R(P) dO_i) rp), dk = R((sum_i R(dS') q_i) g) with
// P = exp(s' - m) / l and dS' = P (keep dP - D) (D: D_v1's, (1 - p) already in); block 128
template <typename T, bool QUAD = false>
__device__ __forceinline__ void s3_dkdv(S3_ARGS(T), const float* __restrict__ m, const float* __restrict__ l,
                                        const T* __restrict__ dout, const float* __restrict__ Dr, float rp, float gq,
                                        float* __restrict__ dk, float* __restrict__ dv,
                                        unsigned short* __restrict__ dk16, unsigned short* __restrict__ dv16) {
    const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t4 = lane & 3, warp = tid >> 5;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, j0 = blockIdx.x * 64, C = H * 64;
    const size_t base = (size_t)b * Tn * C + h * 64;
    const long long mb = b * sb + h * sh;
    float dka[8][4], dva[8][4];
    // (flash_tc.cuh: S^T, dP^T per query tile; here P = exp(s' - m) / l, pz = keep P, dS' = P (keep dP - D))
    auto score = [&](float s, float dp, int i, int j, float mi, float li, float D, bool z, float& pz, float& ds) {
        const float P = expf(s3_score(s, scale, mask, mb, si, sj, i, j, Tn) - mi) / li;
        pz = z ? P : 0.f;
        ds = __fmul_rn(P, (z ? dp : 0.f) - D);
    };
    if constexpr (QUAD) {
        const bool quad = thresh && (Tn & 3) == 0;            // (uniform: every lane draws, or none)
        tc_bwd_keys<T, false, true>(q, k, v, dout, m, l, Dr, 1.f, Tn, C, base, bh, j0, false, dka, dva,
                                    [&](float s, float dp, int i, int j, float mi, float li, float D, float& pz,
                                        float& ds, u32 w) {
                                        score(s, dp, i, j, mi, li, D,
                                              quad ? (u64)w >= thresh
                                                   : kept(((u64)bh * Tn + i) * Tn + j, seed, stream, thresh),
                                              pz, ds);
                                    },
                                    [&](int n, int i0, u32 (&w)[4]) {
                                        if (quad)
                                            tc_words_cols(w, bh, Tn, j0 + warp * 16 + (g & ~3), i0 + n * 8 + t4 * 2,
                                                          g & 3, seed, stream);
                                    });
    } else {
        tc_bwd_keys<T>(q, k, v, dout, m, l, Dr, 1.f, Tn, C, base, bh, j0, false, dka, dva,
                       [&](float s, float dp, int i, int j, float mi, float li, float D, float& pz, float& ds) {
                           score(s, dp, i, j, mi, li, D, kept(((u64)bh * Tn + i) * Tn + j, seed, stream, thresh), pz,
                                 ds);
                       });
    }
    const int jr[2] = {j0 + warp * 16 + g, j0 + warp * 16 + g + 8};
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (jr[r] >= Tn) continue;
        const size_t o = base + (size_t)jr[r] * C + t4 * 2;
#pragma unroll
        for (int n = 0; n < 8; n++) {
            const float k0 = round_kind(__fmul_rn(dka[n][2 * r], gq), kind);
            const float k1 = round_kind(__fmul_rn(dka[n][2 * r + 1], gq), kind);
            const float v0 = round_kind(__fmul_rn(dva[n][2 * r], rp), kind);
            const float v1 = round_kind(__fmul_rn(dva[n][2 * r + 1], rp), kind);
            dk[o + n * 8] = k0;
            dk[o + n * 8 + 1] = k1;
            dv[o + n * 8] = v0;
            dv[o + n * 8 + 1] = v1;
            put16x2(dk16, o + n * 8, k0, k1, kind);
            put16x2(dv16, o + n * 8, v0, v1, kind);
        }
    }
}

// backward pass 2, per 64-query tile: dq = R((sum_j R(dS') k_j) g); block 128
template <typename T, bool QUAD = false>
__device__ __forceinline__ void s3_dq(S3_ARGS(T), const float* __restrict__ m, const float* __restrict__ l,
                                      const T* __restrict__ dout, const float* __restrict__ Dr, float gq,
                                      float* __restrict__ dq, unsigned short* __restrict__ dq16) {
    const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t4 = lane & 3, warp = tid >> 5;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, i0 = blockIdx.x * 64, C = H * 64;
    const size_t base = (size_t)b * Tn * C + h * 64;
    const long long mb = b * sb + h * sh;
    const int ir[2] = {i0 + warp * 16 + g, i0 + warp * 16 + g + 8};
    float mi[2], li[2], Di[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const bool ok = ir[r] < Tn;
        mi[r] = ok ? m[(size_t)bh * Tn + ir[r]] : 0.f;
        li[r] = ok ? l[(size_t)bh * Tn + ir[r]] : 1.f;
        Di[r] = ok ? Dr[(size_t)bh * Tn + ir[r]] : 0.f;
    }
    float dqa[8][4];
    // (flash_tc.cuh: S, dP per key tile; here dS' = P (keep dP - D), P = exp(s' - m) / l)
    auto score = [&](float s, float dp, int i, int j, float mr, float lr, float D, bool z) {
        const float P = expf(s3_score(s, scale, mask, mb, si, sj, i, j, Tn) - mr) / lr;
        return __fmul_rn(P, (z ? dp : 0.f) - D);
    };
    if constexpr (QUAD) {
        const bool quad = thresh && (Tn & 3) == 0;            // (uniform: every lane draws, or none)
        tc_bwd_queries<T, false, true>(q, k, v, dout, mi, li, Di, Tn, C, base, i0, dqa, [](int) { return false; },
                                       [&](float s, float dp, int i, int j, float mr, float lr, float D, u32 w) {
                                           return score(s, dp, i, j, mr, lr, D,
                                                        quad ? (u64)w >= thresh
                                                             : kept(((u64)bh * Tn + i) * Tn + j, seed, stream,
                                                                    thresh));
                                       },
                                       [&](int n, int j0, u32 (&w)[4]) {
                                           if (quad) tc_words_rows(w, bh, Tn, ir[0], ir[1], j0 + n * 8, t4, seed,
                                                                   stream);
                                       });
    } else {
        tc_bwd_queries<T>(q, k, v, dout, mi, li, Di, Tn, C, base, i0, dqa, [](int) { return false; },
                          [&](float s, float dp, int i, int j, float mr, float lr, float D) {
                              return score(s, dp, i, j, mr, lr, D,
                                           kept(((u64)bh * Tn + i) * Tn + j, seed, stream, thresh));
                          });
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (ir[r] >= Tn) continue;
        const size_t o = base + (size_t)ir[r] * C + t4 * 2;
#pragma unroll
        for (int n = 0; n < 8; n++) {
            const float q0 = round_kind(__fmul_rn(dqa[n][2 * r], gq), kind);
            const float q1 = round_kind(__fmul_rn(dqa[n][2 * r + 1], gq), kind);
            dq[o + n * 8] = q0;
            dq[o + n * 8 + 1] = q1;
            put16x2(dq16, o + n * 8, q0, q1, kind);
        }
    }
}

#define S3_CALL q, k, v, mask, sb, sh, si, sj, Tn, H, scale, seed, stream, thresh, kind
#define INST_S3(S, QUAD, T, NAME)                                                                                \
    extern "C" __global__ void __launch_bounds__(128) S##_fwd_##NAME(S3_ARGS(T), float rp, float* out,           \
                                                                     unsigned short* o16, float* m, float* l) { \
        s3_fwd<T, QUAD>(S3_CALL, rp, out, o16, m, l);                                                           \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(128) S##_dkdv_##NAME(S3_ARGS(T), const float* m, const float* l,\
                                                                      const T* dout, const float* Dr, float rp,  \
                                                                      float gq, float* dk, float* dv,            \
                                                                      unsigned short* dk16, unsigned short* dv16) {\
        s3_dkdv<T, QUAD>(S3_CALL, m, l, dout, Dr, rp, gq, dk, dv, dk16, dv16);                                  \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(128) S##_dq_##NAME(S3_ARGS(T), const float* m, const float* l,  \
                                                                    const T* dout, const float* Dr, float gq,    \
                                                                    float* dq, unsigned short* dq16) {          \
        s3_dq<T, QUAD>(S3_CALL, m, l, dout, Dr, gq, dq, dq16);                                                  \
    }
INST_S3(s3, false, __nv_bfloat16, bf16)
INST_S3(s3, false, __half, f16)
INST_S3(s4, true, __nv_bfloat16, bf16)     // S4: S3 with a Philox call per 4 scores (above)
INST_S3(s4, true, __half, f16)
#endif  // HALF_TYPES

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
    {   // add_round: out = acc + R(y), against the host's float32 sum of the same terms
        float* acc = make_random_float(n, 8);
        float* dacc;
        cudaCheck(cudaMalloc(&dacc, n * 4));
        cudaCheck(cudaMemcpy(dacc, acc, n * 4, cudaMemcpyHostToDevice));
        const int grid4 = (int)std::min<long long>((n / 4 + 255) / 256, 65536);
        for (int kind = 0; kind < 2; kind++)
            for (int version = 1; version <= 2; version++) {
                if (version == 1) LAUNCH(add_round_v1, grid, 256, dx, dacc, n, kind, dout);
                else LAUNCH(add_round_v2, grid4, 256, dx, dacc, n, kind, dout);
                cudaCheck(cudaDeviceSynchronize());
                cudaCheck(cudaMemcpy(got.data(), dout, n * 4, cudaMemcpyDeviceToHost));
                long long wrong = 0;
                for (long long e = 0; e < n; e++) {
                    const float want = ADD_RN(acc[e], round_kind(x[e], kind));
                    wrong += std::memcmp(&got[e], &want, 4) != 0;
                }
                printf("add_round_v%d kind %d: %lld of %lld elements differ from the host's sums\n", version, kind,
                       wrong, n);
                bad += (int)wrong;
            }
        free(acc); cudaFree(dacc);
    }
    {   // bias_round versions 1, 2 (cols % 4 == 0) and 3: the same bits, y's and its twin's, against the host's
#ifdef CPUSIM_SMALL
        const int shapes[][2] = {{5, 37}, {3, 50}, {4, 48}, {3, 2}, {2, 1}};   // heads, tails, rows shorter than a quad
#else
        const int shapes[][2] = {{4096, 30522}, {4096, 768}, {77, 37}};
#endif
        for (const auto& sh : shapes) {
            const int R = sh[0], Cc = sh[1];
            const long long m = (long long)R * Cc;
            float *bias = make_random_float(Cc, 13), *yh = make_random_float(m, 14);
            float *db, *y1, *yv;
            unsigned short *t1, *tv;
            cudaCheck(cudaMalloc(&db, Cc * 4)); cudaCheck(cudaMalloc(&y1, m * 4)); cudaCheck(cudaMalloc(&yv, m * 4));
            cudaCheck(cudaMalloc(&t1, m * 2)); cudaCheck(cudaMalloc(&tv, m * 2));
            cudaCheck(cudaMemcpy(db, bias, Cc * 4, cudaMemcpyHostToDevice));
            std::vector<float> h1(m), hv(m);
            std::vector<unsigned short> b1(m), bv(m);
            const int grows = (int)std::min<long long>(R, 65536);
            for (int kind = 0; kind < 2; kind++)
                for (int version = 2; version <= 3; version++) {
                    if (version == 2 && Cc % 4) continue;
                    cudaCheck(cudaMemcpy(y1, yh, m * 4, cudaMemcpyHostToDevice));
                    cudaCheck(cudaMemcpy(yv, yh, m * 4, cudaMemcpyHostToDevice));
                    LAUNCH(bias_round_v1, grows, 256, y1, db, (long long)R, Cc, kind, t1);
                    if (version == 2)
                        LAUNCH(bias_round_v2, (int)std::min<long long>((m / 4 + 255) / 256, 65536), 256, yv, db,
                               (long long)R, Cc, kind, tv);
                    else LAUNCH(bias_round_v3, grows, 256, yv, db, (long long)R, Cc, kind, tv);
                    cudaCheck(cudaDeviceSynchronize());
                    cudaCheck(cudaMemcpy(h1.data(), y1, m * 4, cudaMemcpyDeviceToHost));
                    cudaCheck(cudaMemcpy(hv.data(), yv, m * 4, cudaMemcpyDeviceToHost));
                    cudaCheck(cudaMemcpy(b1.data(), t1, m * 2, cudaMemcpyDeviceToHost));
                    cudaCheck(cudaMemcpy(bv.data(), tv, m * 2, cudaMemcpyDeviceToHost));
                    long long wrong = 0;
                    for (long long e = 0; e < m; e++) {
                        const float want = round_kind(yh[e] + round_kind(bias[e % Cc], kind), kind);
                        wrong += std::memcmp(&h1[e], &want, 4) != 0 || std::memcmp(&hv[e], &want, 4) != 0 ||
                                 b1[e] != bits16(want, kind) || bv[e] != b1[e];
                    }
                    printf("bias_round_v%d kind %d, %d x %d: %lld of %lld elements differ from version 1 or the "
                           "host\n", version, kind, R, Cc, wrong, m);
                    bad += (int)wrong;
                    if (m >= (1 << 24) && kind == 0) {
                        float ms[2];
                        for (int i = 0; i < 2; i++)
                            ms[i] = benchmark_kernel(20, [&]() {
                                if (i == 0) LAUNCH(bias_round_v1, grows, 256, y1, db, (long long)R, Cc, 0, t1);
                                else LAUNCH(bias_round_v3, grows, 256, yv, db, (long long)R, Cc, 0, tv);
                            });
                        printf("  v1 %.4f ms (%.0f GB/s), v3 %.4f ms (%.0f GB/s): 10 bytes an element\n", ms[0],
                               10.0 * m / ms[0] / 1e6, ms[1], 10.0 * m / ms[1] / 1e6);
                    }
                }
            free(bias); free(yh); cudaFree(db); cudaFree(y1); cudaFree(yv); cudaFree(t1); cudaFree(tv);
        }
    }
    {   // heads and merge, versions 1 and 2: the same bits, and heads against the host's R(x) in (B, H, T, hs)
#ifdef CPUSIM_SMALL
        const int B = 2, T = 5, H = 3, hs = 8;
#else
        const int B = 32, T = 128, H = 12, hs = 64;
#endif
        const long long m = (long long)B * T * H * hs;
        float* l = make_random_float(B * H * T, 9);
        for (int r = 0; r < B * H * T; r++) l[r] = 1.f + std::fabs(l[r]);              // row sums: >= 1
        float *dl, *o1, *o2;
        unsigned short *b1, *b2;
        cudaCheck(cudaMalloc(&dl, (size_t)B * H * T * 4));
        cudaCheck(cudaMemcpy(dl, l, (size_t)B * H * T * 4, cudaMemcpyHostToDevice));
        cudaCheck(cudaMalloc(&o1, m * 4)); cudaCheck(cudaMalloc(&o2, m * 4));
        cudaCheck(cudaMalloc(&b1, m * 2)); cudaCheck(cudaMalloc(&b2, m * 2));
        std::vector<float> g1(m), g2(m);
        std::vector<unsigned short> c1(m), c2(m);
        const int gm = (int)std::min<long long>((m + 255) / 256, 65536),
                  gm4 = (int)std::min<long long>((m / 4 + 255) / 256, 65536);
        auto fetch = [&]() {
            cudaCheck(cudaDeviceSynchronize());
            cudaCheck(cudaMemcpy(g1.data(), o1, m * 4, cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(g2.data(), o2, m * 4, cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(c1.data(), b1, m * 2, cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(c2.data(), b2, m * 2, cudaMemcpyDeviceToHost));
        };
        for (int kind = 0; kind < 2; kind++) {
            long long wrong = 0;
            for (int as16 = 0; as16 < 2; as16++) {
                cudaCheck(cudaMemset(o1, 0xFF, m * 4)); cudaCheck(cudaMemset(o2, 0xFF, m * 4));
                cudaCheck(cudaMemset(b1, 0xFF, m * 2)); cudaCheck(cudaMemset(b2, 0xFF, m * 2));
                LAUNCH(heads_v1, gm, 256, dx, m, T, H, hs, kind, as16, o1, b1);
                LAUNCH(heads_v2, gm4, 256, dx, m, T, H, hs, kind, as16, o2, b2);
                fetch();
                for (long long e = 0; e < m; e++) {                  // e = ((b H + h) T + t) hs + c
                    const long long c = e % hs, t = e / hs % T, h = e / hs / T % H, b = e / hs / T / H;
                    const float want = round_kind(x[((b * T + t) * H + h) * hs + c], kind);
                    if (as16) wrong += c1[e] != c2[e] || c1[e] != bits16(want, kind);
                    else wrong += std::memcmp(&g1[e], &g2[e], 4) != 0 || std::memcmp(&g1[e], &want, 4) != 0;
                }
            }
            for (int rows = 0; rows < 2; rows++) {
                LAUNCH(merge_v1, gm, 256, dx, m, T, H, hs, dl, rows, 1.f / 0.9f, kind, o1, b1);
                LAUNCH(merge_v2, gm4, 256, dx, m, T, H, hs, dl, rows, 1.f / 0.9f, kind, o2, b2);
                fetch();
                for (long long e = 0; e < m; e++)
                    wrong += std::memcmp(&g1[e], &g2[e], 4) != 0 || c1[e] != c2[e] || c1[e] != bits16(g1[e], kind);
            }
            printf("heads_v2, merge_v2 kind %d: %lld of %lld elements differ from version 1 or the host\n", kind,
                   wrong, 6 * m);
            bad += (int)wrong;
            if (m >= (1 << 20))
                for (int version = 1; version <= 2; version++) {
                    float hms = benchmark_kernel(20, [&]() {
                        if (version == 1) LAUNCH(heads_v1, gm, 256, dx, m, T, H, hs, kind, 1, o1, b1);
                        else LAUNCH(heads_v2, gm4, 256, dx, m, T, H, hs, kind, 1, o2, b2);
                    });
                    float mms = benchmark_kernel(20, [&]() {
                        if (version == 1) LAUNCH(merge_v1, gm, 256, dx, m, T, H, hs, dl, 1, 1.f / 0.9f, kind, o1, b1);
                        else LAUNCH(merge_v2, gm4, 256, dx, m, T, H, hs, dl, 1, 1.f / 0.9f, kind, o2, b2);
                    });
                    printf("  v%d: heads %.4f ms (%.0f GB/s), merge %.4f ms (%.0f GB/s)\n", version, hms,
                           6.0 * m / hms / 1e6, mms, 10.0 * m / mms / 1e6);
                }
        }
        free(l); cudaFree(dl); cudaFree(o1); cudaFree(o2); cudaFree(b1); cudaFree(b2);
    }
    {   // the attention's row kernels, versions 1 and 2: the same bits (P, m, l; dS, Pk), dropout on and off, BERT's
        // (B, 1, 1, T) padding mask (a quarter of the keys at float32's minimum); T % 4 == 0 (version 2's condition)
#ifdef CPUSIM_SMALL
        const int H = 1, BTs[][2] = {{2, 36}, {1, 132}};         // (CPU threads: a warp's shuffle is a barrier)
#else
        const int H = 12, BTs[][2] = {{32, 128}, {8, 512}};
#endif
        for (const auto& bt : BTs) {
            const int B = bt[0], T = bt[1];
            const long long rows = (long long)B * H * T, m2 = rows * T;
            float* sc = make_random_float(m2, 11);
            float* gp = make_random_float(m2, 12);
            std::vector<float> mk((size_t)B * T, 0.f), Dh(rows);
            for (int b = 0; b < B; b++)
                for (int j = T - T / 4 * (b % 2); j < T; j++) mk[(size_t)b * T + j] = -3.4028234663852886e38f;
            for (long long r = 0; r < rows; r++) Dh[r] = 0.01f * (float)(r % 7);
            float *ds, *dg, *dm, *dD, *m1, *l1, *mo2, *lo2, *f1, *f2, *h1, *h2;
            unsigned short *u1, *u2, *w1, *w2;
            const size_t by = (size_t)m2 * 4;
            for (float** q : {&ds, &dg, &f1, &f2, &h1, &h2}) cudaCheck(cudaMalloc(q, by));
            for (unsigned short** q : {&u1, &u2, &w1, &w2}) cudaCheck(cudaMalloc(q, by / 2));
            for (float** q : {&m1, &l1, &mo2, &lo2, &dD}) cudaCheck(cudaMalloc(q, rows * 4));
            cudaCheck(cudaMalloc(&dm, mk.size() * 4));
            cudaCheck(cudaMemcpy(ds, sc, by, cudaMemcpyHostToDevice));
            cudaCheck(cudaMemcpy(dg, gp, by, cudaMemcpyHostToDevice));
            cudaCheck(cudaMemcpy(dm, mk.data(), mk.size() * 4, cudaMemcpyHostToDevice));
            cudaCheck(cudaMemcpy(dD, Dh.data(), rows * 4, cudaMemcpyHostToDevice));
            const long long mb = T, mh = 0, mi = 0, mj = 1;            // the (B, 1, 1, T) mask's strides
            const int grid_rows = (int)((rows + 7) / 8);
            const float scale = 0.125f;
            const u64 seed = 0x243F6A8885A308D3ull;
            auto same = [&](const void* a, const void* b2, size_t bytes) {
                std::vector<unsigned char> x1(bytes), x2(bytes);
                cudaCheck(cudaMemcpy(x1.data(), a, bytes, cudaMemcpyDeviceToHost));
                cudaCheck(cudaMemcpy(x2.data(), b2, bytes, cudaMemcpyDeviceToHost));
                return std::memcmp(x1.data(), x2.data(), bytes) == 0;
            };
            long long wrong = 0;
            const int cases[][3] = {{0, 0, 1}, {0, 1, 1}, {1, 1, 0}, {1, 1, 1}};   // kind, p = 0.1 or none, as16
            for (const auto& cs : cases) {
                const int kind = cs[0], as16 = cs[2];
                const u64 thresh = cs[1] ? 429496730ull : 0ull;
                for (float* q : {f1, f2, h1, h2}) cudaCheck(cudaMemset(q, 0xFF, by));
                for (unsigned short* q : {u1, u2, w1, w2}) cudaCheck(cudaMemset(q, 0xFF, by / 2));
                LAUNCH(attn_rows_fwd_v1, grid_rows, 256, ds, dm, mb, mh, mi, mj, rows, H, T, scale, seed, 5ull,
                       thresh, kind, as16, f1, u1, m1, l1);
                LAUNCH(attn_rows_fwd_v2, grid_rows, 256, ds, dm, mb, mh, mi, mj, rows, H, T, scale, seed, 5ull,
                       thresh, kind, as16, f2, u2, mo2, lo2);
                cudaCheck(cudaDeviceSynchronize());
                wrong += !same(m1, mo2, rows * 4) + !same(l1, lo2, rows * 4) +
                         !(as16 ? same(u1, u2, by / 2) : same(f1, f2, by));
                LAUNCH(attn_rows_bwd_v1, grid_rows, 256, ds, dg, dm, mb, mh, mi, mj, rows, H, T, scale, seed,
                       5ull, thresh, m1, l1, dD, kind, as16, f1, u1, h1, w1);
                LAUNCH(attn_rows_bwd_v2, grid_rows, 256, ds, dg, dm, mb, mh, mi, mj, rows, H, T, scale, seed,
                       5ull, thresh, m1, l1, dD, kind, as16, f2, u2, h2, w2);
                cudaCheck(cudaDeviceSynchronize());
                wrong += as16 ? !same(u1, u2, by / 2) + !same(w1, w2, by / 2)
                              : !same(f1, f2, by) + !same(h1, h2, by);
            }
            printf("attn_rows_fwd_v2, attn_rows_bwd_v2 T=%d: %lld of 20 outputs differ from version 1's bits\n", T,
                   wrong);
            bad += (int)wrong;
            if (m2 >= (1 << 22))
                for (int version = 1; version <= 2; version++) {
                    const u64 th = 429496730;
                    float fms = benchmark_kernel(20, [&]() {
                        if (version == 1) LAUNCH(attn_rows_fwd_v1, grid_rows, 256, ds, dm, mb, mh, mi, mj, rows, H, T,
                                                 scale, seed, 5ull, th, 0, 1, f1, u1, m1, l1);
                        else LAUNCH(attn_rows_fwd_v2, grid_rows, 256, ds, dm, mb, mh, mi, mj, rows, H, T, scale, seed,
                                    5ull, th, 0, 1, f1, u1, m1, l1);
                    });
                    float bms = benchmark_kernel(20, [&]() {
                        if (version == 1) LAUNCH(attn_rows_bwd_v1, grid_rows, 256, ds, dg, dm, mb, mh, mi, mj, rows, H,
                                                 T, scale, seed, 5ull, th, m1, l1, dD, 0, 1, f1, u1, h1, w1);
                        else LAUNCH(attn_rows_bwd_v2, grid_rows, 256, ds, dg, dm, mb, mh, mi, mj, rows, H, T, scale,
                                    seed, 5ull, th, m1, l1, dD, 0, 1, f1, u1, h1, w1);
                    });
                    // forward reads s twice, writes P16; backward reads s and dP, writes dS16 and Pk16
                    printf("  T=%d v%d bf16, p = 0.1: forward %.4f ms (%.0f GB/s), backward %.4f ms (%.0f GB/s)\n", T,
                           version, fms, 10.0 * m2 / fms / 1e6, bms, 12.0 * m2 / bms / 1e6);
                }
            free(sc); free(gp);
            for (float* q : {ds, dg, f1, f2, h1, h2, m1, l1, mo2, lo2, dD, dm}) cudaFree(q);
            for (unsigned short* q : {u1, u2, w1, w2}) cudaFree(q);
        }
    }
    free(x); cudaFree(dx); cudaFree(dout); cudaFree(dbits);
    if (bad) { printf("mixed: FAILED\n"); return 1; }
    printf("mixed: every version ok\n");
    return 0;
}
#endif
