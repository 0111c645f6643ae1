/*
LayerNorm over the last axis, forward and backward, float32; version 2 fuses the residual sum and the residual's
dropout (refbert.ops.residual_layernorm / dropout_residual_layernorm: the post-LN step of every encoder layer).
Oracle: refbert.ops.layernorm_forward / layernorm_backward, residual_layernorm_*, dropout_residual_layernorm_*
(Python launchers: kernels/cuda/cuda_c.py; the Numba versions and the math: kernels/cuda/layernorm.py).
    x, a, out, dout, dx, da: (R, C) contiguous rows   w, b, dw, db: (C,)   mean, rstd: (R,)
    s = x (kind ln), x + a (res), x + a * keep * dscale (drop: keep of element r*C + j from Philox (seed, stream),
        refbert/philox.py, dscale = 1/(1-p))
    forward:  mean = s.mean(), rstd = 1/sqrt(var + eps) (biased var), xhat = (s - mean) rstd, out = xhat w + b
    backward: wdy = dout w;  c1 = mean(wdy xhat);  c2 = mean(wdy);  ds = (wdy - (xhat c1 + c2)) rstd
              dx = ds;  da = ds (res) or ds * keep * dscale (drop)
              wdy is __fmul_rn(dout, w) in both passes: rounded once and never contracted into an fma with the
              subtraction, so at C = 1 wdy - c2 is exactly 0 as in the oracle, not the product's
              rounding error times rstd = 1/sqrt(eps) = 1e6 (the first H200 run: dx 2e-3 where the oracle has 0)
              dw = sum_rows dout xhat,  db = sum_rows dout   (deterministic: per-chunk partials, then a column sum)

Versions:
  1  plain LayerNorm: a warp per row (8 rows per 256-thread block), 128-bit loads (float4) when C % 4 == 0: two-pass
     mean and variance (the row is re-read from L1/L2, not kept in registers, so any C works); backward likewise
     for dx, and dw/db by a thread per column over a chunk of rows (coalesced) into (chunks, C) partials, then a
     column-sum kernel in chunk order — no atomics, the same bits every run
  2  version 1 with s = x + a * keep * dscale formed in every pass (kinds ln, res, drop: one template), never
     stored: the backward re-reads x, a and regenerates the keep factors (one Philox call per 4 elements on the
     float4 path); dx and da written by one kernel; the partials recompute s; dw and db summed by one launch
     (column_sum2). The Numba version 2's arithmetic (kernels/cuda/layernorm.py), a warp per row instead of a
     block. `vec` (a launch argument) selects the float4 path: C % 4 == 0 and every pointer 16-byte aligned.
  3  the forward of version 2 with the row in registers (nv = ceil(C / 128) rounded up to even float4 per lane,
     C <= 1024 on the float4 path): x and a read once and the keep factors drawn once instead of in each of three
     passes; the same sums in the same order, so the same bits as version 2; its backward is version 2's, but for
     the dw, db partials (layernorm_bwd_dwdb_partial_v3, the float4 path): four consecutive columns a thread, one
     Philox call for their four keep factors (version 2's partials drew one per element), the same per-column sums
     in the same row order (the same bits where the compiler contracts both alike: CPU threads; on a GPU within float32
     rounding). The launchers run it wherever the float4 path applies, for versions 2 and 3 (REFBERT_LN_DWDB=2
     keeps version 2's partials); this main times version 2 with version 2's partials, version 3 with these
  dw, db partials versions 4 and 5 (REFBERT_LN_DWDB=4 / 5): version 3's partials with 4 / 8 rows' loads in flight
     before their adds, in row order (version 3's bits: the main compares the partials on CPU threads, and will on
     a GPU at its next run). The
     partials' order fixes their parallelism (64 chunks of rows, four columns a thread), so their pace is set by
     the loads in flight; on the H200 (2026-11-27) version 3's partials took more time than the dx kernel beside
     them, which reads and writes more. Not yet timed: this main times them beside version 3
  6  version 3's forward; the backward in one pass over dout, x, a: dx (da) by version 2's code per row
     (its bits) and, in the same pass, each lane's columns of dout xhat and dout added up over the block's rows
     (a warp per row, the rows grid-strided over at most 256 blocks), the 8 warps added in order in shared memory
     into one partial row a block, then column_sum2_v6 (32 columns x 8 groups a block) over those rows. Versions
     2-3 read dout, x, a a third time for the partials (on the H200 step profile of 2026-11-28 the partials kernel
     took longer than the dx kernel). dw, db: version 3's terms in another order, so within float32 rounding of
     version 3's, not its bits. Mixed precision too (rk a run-time argument; x, a read from their 16-bit storage or
     not; the twins). The float4 path and C <= 1024 (NV float4 accumulators a lane, NV = 2, 6 or 8: C <= 128 NV,
     a kernel per NV); otherwise the launchers run version 2's backward. On the H200 (2026-11-28, this main at
     2048 x 768) forward + backward in float32 0.0172 / 0.0188 / 0.0209 ms (ln / res / drop) against version 3's
     0.0212 / 0.0250 / 0.0309: the float32 C4's backward. Its mixed bodies were the slower (drop, bf16: 0.0233 +
     0.0040 ms against version 2's dx 0.0123 and version 3's partials 0.0117), most likely the rounding at run
     time where version 2 has a body per rk: the mixed path keeps versions 2 / 3 (REFBERT_MIXED_LN_BWD=6 runs it)
  mixed precision (rk >= 0): every version reads and writes on the compute grid; the forward may keep x and a in
     16 bits (kx16, ka16: common.cuh keep16) and the backward read them so (x16, a16: IN16), the same values

Build and run standalone (validates every version against the CPU reference, then times):
    nvcc -O3 -arch=sm_90 -std=c++17 -o layernorm layernorm.cu && ./layernorm
On CPU threads (kernels/cuda/csrc/cpusim.cuh; small shapes, no timing):
    g++ -std=c++20 -O1 -pthread -ffp-contract=off -DCPUSIM -DCPUSIM_SMALL -x c++ layernorm.cu -o ln && ./ln
Compile check only (tests/test_cuda_nvcc.py):  nvcc -arch=sm_90 -std=c++17 -c layernorm.cu
*/
#include "common.cuh"

#ifdef HOST_CODE
void layernorm_forward_cpu(const float* x, const float* w, const float* b, float eps, int R, int C, float* out,
                           float* mean, float* rstd) {
    for (int r = 0; r < R; r++) {
        const float* xr = x + (size_t)r * C;
        double m = 0, v = 0;
        for (int c = 0; c < C; c++) m += xr[c];
        m /= C;
        for (int c = 0; c < C; c++) v += (xr[c] - m) * (xr[c] - m);
        v /= C;
        float s = (float)(1.0 / sqrt(v + eps));
        for (int c = 0; c < C; c++) out[(size_t)r * C + c] = (float)((xr[c] - m) * s) * w[c] + b[c];
        mean[r] = (float)m;
        rstd[r] = s;
    }
}
void layernorm_backward_cpu(const float* dout, const float* x, const float* w, const float* mean, const float* rstd,
                            int R, int C, float* dx, float* dw, float* db) {
    std::fill(dw, dw + C, 0.f); std::fill(db, db + C, 0.f);
    for (int r = 0; r < R; r++) {
        const float *xr = x + (size_t)r * C, *g = dout + (size_t)r * C;
        float c1 = 0.f, c2 = 0.f;
        for (int c = 0; c < C; c++) {
            float xh = (xr[c] - mean[r]) * rstd[r];
            c1 += g[c] * w[c] * xh; c2 += g[c] * w[c];
            dw[c] += g[c] * xh; db[c] += g[c];
        }
        c1 /= C; c2 /= C;
        for (int c = 0; c < C; c++) {
            float xh = (xr[c] - mean[r]) * rstd[r];
            dx[(size_t)r * C + c] = (g[c] * w[c] - (xh * c1 + c2)) * rstd[r];
        }
    }
}
#endif

// ----------------------------------------------------------------------------------------------------------------
// GPU kernels: a warp per row, block 256, grid ceil(R / 8)

extern "C" __global__ void __launch_bounds__(256) layernorm_fwd_v1(const float* __restrict__ x,
                                                                   const float* __restrict__ w,
                                                                   const float* __restrict__ b, float eps, int R,
                                                                   int C, float* __restrict__ out,
                                                                   float* __restrict__ mean,
                                                                   float* __restrict__ rstd) {
    const int r = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (r >= R) return;
    const float* xr = x + (size_t)r * C;
    float* orow = out + (size_t)r * C;
    const bool vec = (C & 3) == 0;
    float s = 0.f;
    if (vec) {
        for (int c = lane * 4; c < C; c += 128) {
            float4 a = *reinterpret_cast<const float4*>(xr + c);
            s += (a.x + a.y) + (a.z + a.w);
        }
    } else {
        for (int c = lane; c < C; c += 32) s += xr[c];
    }
    const float m = warp_sum(s) / C;
    float v = 0.f;                                                // second pass: sum (x - m)^2 (no cancellation)
    if (vec) {
        for (int c = lane * 4; c < C; c += 128) {
            float4 a = *reinterpret_cast<const float4*>(xr + c);
            float d0 = a.x - m, d1 = a.y - m, d2 = a.z - m, d3 = a.w - m;
            v += (d0 * d0 + d1 * d1) + (d2 * d2 + d3 * d3);
        }
    } else {
        for (int c = lane; c < C; c += 32) { float d = xr[c] - m; v += d * d; }
    }
    const float rs = rsqrtf(warp_sum(v) / C + eps);
    if (vec) {
        for (int c = lane * 4; c < C; c += 128) {
            float4 a = *reinterpret_cast<const float4*>(xr + c);
            float4 ww = *reinterpret_cast<const float4*>(w + c), bb = *reinterpret_cast<const float4*>(b + c);
            *reinterpret_cast<float4*>(orow + c) = make_float4((a.x - m) * rs * ww.x + bb.x,
                                                               (a.y - m) * rs * ww.y + bb.y,
                                                               (a.z - m) * rs * ww.z + bb.z,
                                                               (a.w - m) * rs * ww.w + bb.w);
        }
    } else {
        for (int c = lane; c < C; c += 32) orow[c] = (xr[c] - m) * rs * w[c] + b[c];
    }
    if (lane == 0) { mean[r] = m; rstd[r] = rs; }
}

extern "C" __global__ void __launch_bounds__(256) layernorm_bwd_dx_v1(const float* __restrict__ dout,
                                                                      const float* __restrict__ x,
                                                                      const float* __restrict__ w,
                                                                      const float* __restrict__ mean,
                                                                      const float* __restrict__ rstd, int R, int C,
                                                                      float* __restrict__ dx) {
    const int r = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (r >= R) return;
    const float *xr = x + (size_t)r * C, *g = dout + (size_t)r * C;
    float* dr = dx + (size_t)r * C;
    const float m = mean[r], rs = rstd[r];
    const bool vec = (C & 3) == 0;
    float c1 = 0.f, c2 = 0.f;
    if (vec) {
        for (int c = lane * 4; c < C; c += 128) {
            float4 a = *reinterpret_cast<const float4*>(xr + c), d = *reinterpret_cast<const float4*>(g + c);
            float4 ww = *reinterpret_cast<const float4*>(w + c);
            float w0 = __fmul_rn(d.x, ww.x), w1 = __fmul_rn(d.y, ww.y), w2 = __fmul_rn(d.z, ww.z),
                  w3 = __fmul_rn(d.w, ww.w);
            c1 += w0 * (a.x - m) * rs + w1 * (a.y - m) * rs + w2 * (a.z - m) * rs + w3 * (a.w - m) * rs;
            c2 += (w0 + w1) + (w2 + w3);
        }
    } else {
        for (int c = lane; c < C; c += 32) {
            float wd = __fmul_rn(g[c], w[c]);
            c1 += wd * (xr[c] - m) * rs;
            c2 += wd;
        }
    }
    c1 = warp_sum(c1) / C;
    c2 = warp_sum(c2) / C;
    if (vec) {
        for (int c = lane * 4; c < C; c += 128) {
            float4 a = *reinterpret_cast<const float4*>(xr + c), d = *reinterpret_cast<const float4*>(g + c);
            float4 ww = *reinterpret_cast<const float4*>(w + c);
            *reinterpret_cast<float4*>(dr + c) = make_float4(
                (__fmul_rn(d.x, ww.x) - ((a.x - m) * rs * c1 + c2)) * rs,
                (__fmul_rn(d.y, ww.y) - ((a.y - m) * rs * c1 + c2)) * rs,
                (__fmul_rn(d.z, ww.z) - ((a.z - m) * rs * c1 + c2)) * rs,
                (__fmul_rn(d.w, ww.w) - ((a.w - m) * rs * c1 + c2)) * rs);
        }
    } else {
        for (int c = lane; c < C; c += 32) dr[c] = (__fmul_rn(g[c], w[c]) - ((xr[c] - m) * rs * c1 + c2)) * rs;
    }
}

// dw, db partials: grid (ceil(C / 256), chunks), a thread per column over rows [chunk * per, ...)
extern "C" __global__ void layernorm_bwd_dwdb_partial(const float* __restrict__ dout, const float* __restrict__ x,
                                                      const float* __restrict__ mean, const float* __restrict__ rstd,
                                                      int R, int C, int per, float* __restrict__ dw_part,
                                                      float* __restrict__ db_part) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x, chunk = blockIdx.y;
    if (c >= C) return;
    float sw = 0.f, sb = 0.f;
    const int r1 = min(R, (chunk + 1) * per);
    for (int r = chunk * per; r < r1; r++) {
        float g = dout[(size_t)r * C + c];
        sw += g * (x[(size_t)r * C + c] - mean[r]) * rstd[r];
        sb += g;
    }
    dw_part[(size_t)chunk * C + c] = sw;
    db_part[(size_t)chunk * C + c] = sb;
}

extern "C" __global__ void column_sum(const float* __restrict__ parts, int chunks, int C, float* __restrict__ out) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float s = 0.f;
    for (int k = 0; k < chunks; k++) s += parts[(size_t)k * C + c];
    out[c] = s;
}

// ----------------------------------------------------------------------------------------------------------------
// version 2: the residual sum and its dropout fused (KIND 0 = ln: s = x, 1 = res: s = x + a, 2 = drop)

template <int KIND, int IN16 = 0>
__device__ __forceinline__ float s1(const float* x, const float* a, size_t e, u64 seed, u64 stream, u64 thresh,
                                    float dscale, int rk, const unsigned short* x16 = nullptr,
                                    const unsigned short* a16 = nullptr) {
    float v = ld_in<IN16>(x, x16, e, rk);
    if (KIND >= 1) {
        const float u = ld_in<IN16>(a, a16, e, rk);
        v = v + (KIND == 2 ? __fmul_rn(u, keep_z(e, seed, stream, thresh, dscale)) : u);
    }
    return v;
}
template <int KIND, int IN16 = 0>
__device__ __forceinline__ float4 s4(const float* x, const float* a, size_t e, u64 seed, u64 stream, u64 thresh,
                                     float dscale, int rk, const unsigned short* x16 = nullptr,
                                     const unsigned short* a16 = nullptr) {   // elements e .. e + 3, e % 4 == 0
    float4 v = ld_in4<IN16>(x, x16, e, rk);
    if (KIND >= 1) {
        float4 u = ld_in4<IN16>(a, a16, e, rk);
        if (KIND == 2) {
            const float4 z = keep4(e, seed, stream, thresh, dscale);
            u = make_float4(__fmul_rn(u.x, z.x), __fmul_rn(u.y, z.y), __fmul_rn(u.z, z.z), __fmul_rn(u.w, z.w));
        }
        v = make_float4(v.x + u.x, v.y + u.y, v.z + u.z, v.w + u.w);
    }
    return v;
}

#define LN2_ARGS const float *__restrict__ x, const float *__restrict__ a, u64 seed, u64 stream, u64 thresh, \
    float dscale, int rk

template <int KIND>
__device__ __forceinline__ void ln_fwd_v2(LN2_ARGS, const float* __restrict__ w, const float* __restrict__ b,
                                          float eps, int R, int C, int vec, float* __restrict__ out,
                                          float* __restrict__ mean, float* __restrict__ rstd,
                                          unsigned short* __restrict__ o16, unsigned short* __restrict__ kx16,
                                          unsigned short* __restrict__ ka16) {
    const int r = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (r >= R) return;                                             // warp-uniform
    const size_t row = (size_t)r * C;
    float s = 0.f;
    if (vec) {
        for (int c = lane * 4; c < C; c += 128) {
            const float4 v = s4<KIND>(x, a, row + c, seed, stream, thresh, dscale, rk);
            s += (v.x + v.y) + (v.z + v.w);
            keep16x4(x, kx16, row + c, rk);                         // what the backward reads, in 16 bits (here,
            if (KIND >= 1) keep16x4(a, ka16, row + c, rk);          // where the fewest registers are live)
        }
    } else {
        for (int c = lane; c < C; c += 32) {
            s += s1<KIND>(x, a, row + c, seed, stream, thresh, dscale, rk);
            keep16(x, kx16, row + c, rk);
            if (KIND >= 1) keep16(a, ka16, row + c, rk);
        }
    }
    const float m = warp_sum(s) / C;
    float q = 0.f;                                                  // second pass: sum (s - m)^2
    if (vec) {
        for (int c = lane * 4; c < C; c += 128) {
            const float4 v = s4<KIND>(x, a, row + c, seed, stream, thresh, dscale, rk);
            const float d0 = v.x - m, d1 = v.y - m, d2 = v.z - m, d3 = v.w - m;
            q += (d0 * d0 + d1 * d1) + (d2 * d2 + d3 * d3);
        }
    } else {
        for (int c = lane; c < C; c += 32) {
            const float d = s1<KIND>(x, a, row + c, seed, stream, thresh, dscale, rk) - m;
            q += d * d;
        }
    }
    const float rs = 1.f / sqrtf(warp_sum(q) / C + eps);
    if (vec) {
        for (int c = lane * 4; c < C; c += 128) {
            const float4 v = s4<KIND>(x, a, row + c, seed, stream, thresh, dscale, rk);
            const float4 ww = rnd4(ld4(w + c), rk), bb = rnd4(ld4(b + c), rk);
            const float4 o = rnd4(make_float4((v.x - m) * rs * ww.x + bb.x, (v.y - m) * rs * ww.y + bb.y,
                                              (v.z - m) * rs * ww.z + bb.z, (v.w - m) * rs * ww.w + bb.w), rk);
            st4(out + row + c, o);
            put16x4(o16, row + c, o, rk);
        }
    } else {
        for (int c = lane; c < C; c += 32) {
            const float o = rnd((s1<KIND>(x, a, row + c, seed, stream, thresh, dscale, rk) - m) * rs * rnd(w[c], rk)
                                + rnd(b[c], rk), rk);
            out[row + c] = o;
            put16(o16, row + c, o, rk);
        }
    }
    if (lane == 0) { mean[r] = m; rstd[r] = rs; }
}

// Version 2's backward (and version 3's dw, db partials) round every product on its own (__fmul_rn): with the
// products written as a * b, ptxas may fuse a product and the add after it into one FMA in one of a kernel's bodies
// (RK16_DISPATCH: float32 inputs, or their 16-bit storage) and not in another, so the two ways of reading the same
// values gave dx, dw, db that differed in the last bits (seen on an H200: kind res at 67 x 52). Written so, every
// body computes the same roundings, and so do CPU threads (cpusim.cuh: -ffp-contract=off).
//   dx = (w dy - (xhat c1 + c2)) rstd,  xhat = (s - mean) rstd
__device__ __forceinline__ float ln_dx1(float wd, float s, float m, float rs, float c1, float c2) {
    return __fmul_rn(wd - (__fmul_rn(__fmul_rn(s - m, rs), c1) + c2), rs);
}

// the float4 path's pieces, shared by version 2's dx kernel and version 6's fused one (the same roundings):
// the row sums' terms of four columns (c1 += wdy xhat, c2 += wdy), and dx of four columns from c1, c2
__device__ __forceinline__ void ln_sums4(float4 v, float4 g, float4 ww, float m, float rs, float& c1, float& c2) {
    const float w0 = __fmul_rn(g.x, ww.x), w1 = __fmul_rn(g.y, ww.y), w2 = __fmul_rn(g.z, ww.z),
                w3 = __fmul_rn(g.w, ww.w);
    c1 += __fmul_rn(w0, __fmul_rn(v.x - m, rs)) + __fmul_rn(w1, __fmul_rn(v.y - m, rs)) +
          __fmul_rn(w2, __fmul_rn(v.z - m, rs)) + __fmul_rn(w3, __fmul_rn(v.w - m, rs));
    c2 += (w0 + w1) + (w2 + w3);
}
__device__ __forceinline__ float4 ln_dx4(float4 v, float4 g, float4 ww, float m, float rs, float c1, float c2) {
    return make_float4(ln_dx1(__fmul_rn(g.x, ww.x), v.x, m, rs, c1, c2),
                       ln_dx1(__fmul_rn(g.y, ww.y), v.y, m, rs, c1, c2),
                       ln_dx1(__fmul_rn(g.z, ww.z), v.z, m, rs, c1, c2),
                       ln_dx1(__fmul_rn(g.w, ww.w), v.w, m, rs, c1, c2));
}

// the float4 path's stores of four columns, shared likewise: dx = R(d); da = R(d keep dscale) (kind drop); the twin
// (t16, the row's, or none) of the last of them
template <int KIND>
__device__ __forceinline__ void ln_store4(float4 d, size_t e, int c, u64 seed, u64 stream, u64 thresh, float dscale,
                                          int rk, float* __restrict__ dx, float* __restrict__ da,
                                          unsigned short* __restrict__ t16) {
    float4 t = rnd4(d, rk);                                         // dx; then the twin's values
    st4(dx + e, t);
    if (KIND == 2) {
        const float4 z = keep4(e, seed, stream, thresh, dscale);
        t = rnd4(make_float4(__fmul_rn(d.x, z.x), __fmul_rn(d.y, z.y), __fmul_rn(d.z, z.z), __fmul_rn(d.w, z.w)),
                 rk);
        st4(da + e, t);
    }
    put16x4(t16, c, t, rk);
}

template <int KIND, int IN16>
__device__ __forceinline__ void ln_bwd_dx_v2(const float* __restrict__ dout, LN2_ARGS, const float* __restrict__ w,
                                             const float* __restrict__ mean, const float* __restrict__ rstd, int R,
                                             int C, int vec, float* __restrict__ dx, float* __restrict__ da,
                                             unsigned short* __restrict__ o16,     // da's twin (KIND 2), else dx's
                                             const unsigned short* __restrict__ x16,
                                             const unsigned short* __restrict__ a16) {
    const int r = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (r >= R) return;
    const size_t row = (size_t)r * C;
    const float m = mean[r], rs = rstd[r];
    float c1 = 0.f, c2 = 0.f;
    if (vec) {
        for (int c = lane * 4; c < C; c += 128) {
            const float4 v = s4<KIND, IN16>(x, a, row + c, seed, stream, thresh, dscale, rk, x16, a16);
            ln_sums4(v, rnd4(ld4(dout + row + c), rk), rnd4(ld4(w + c), rk), m, rs, c1, c2);
        }
    } else {
        for (int c = lane; c < C; c += 32) {
            const float wd = __fmul_rn(rnd(dout[row + c], rk), rnd(w[c], rk));
            c1 += __fmul_rn(wd, __fmul_rn(s1<KIND, IN16>(x, a, row + c, seed, stream, thresh, dscale, rk, x16, a16) - m,
                                          rs));
            c2 += wd;
        }
    }
    c1 = warp_sum(c1) / C;
    c2 = warp_sum(c2) / C;
    unsigned short* const t16 = rk >= 0 && o16 ? o16 + row : nullptr;     // the twin's row (or none)
    if (vec) {
        for (int c = lane * 4; c < C; c += 128) {
            const float4 v = s4<KIND, IN16>(x, a, row + c, seed, stream, thresh, dscale, rk, x16, a16);
            const float4 d = ln_dx4(v, rnd4(ld4(dout + row + c), rk), rnd4(ld4(w + c), rk), m, rs, c1, c2);
            ln_store4<KIND>(d, row + c, c, seed, stream, thresh, dscale, rk, dx, da, t16);
        }
    } else {
        for (int c = lane; c < C; c += 32) {
            const float v = s1<KIND, IN16>(x, a, row + c, seed, stream, thresh, dscale, rk, x16, a16);
            const float d = ln_dx1(__fmul_rn(rnd(dout[row + c], rk), rnd(w[c], rk)), v, m, rs, c1, c2);
            float t = rnd(d, rk);                                   // dx; then the twin's value
            dx[row + c] = t;
            if (KIND == 2) {
                t = rnd(__fmul_rn(d, keep_z(row + c, seed, stream, thresh, dscale)), rk);
                da[row + c] = t;
            }
            put16(t16, c, t, rk);
        }
    }
}

// dw, db partials: grid (ceil(C / 256), chunks), a thread per column over rows [chunk * per, ...), s recomputed.
// The parameters of every version (2, 3), their kernels' and their bodies'; LNDW_CALL passes them on.
#define LNDW_ARGS const float *__restrict__ dout, LN2_ARGS, const float *__restrict__ mean,                      \
    const float *__restrict__ rstd, int R, int C, int per, float *__restrict__ dw_part,                          \
    float *__restrict__ db_part, const unsigned short *__restrict__ x16, const unsigned short *__restrict__ a16
#define LNDW_CALL dout, x, a, seed, stream, thresh, dscale, RKC, mean, rstd, R, C, per, dw_part, db_part, x16, a16

template <int KIND, int IN16>
__device__ __forceinline__ void ln_dwdb_v2(LNDW_ARGS) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x, chunk = blockIdx.y;
    if (c >= C) return;
    float sw = 0.f, sb = 0.f;
    const int r1 = min(R, (chunk + 1) * per);
    for (int r = chunk * per; r < r1; r++) {
        const size_t e = (size_t)r * C + c;
        const float g = rnd(dout[e], rk);
        sw += __fmul_rn(__fmul_rn(g, s1<KIND, IN16>(x, a, e, seed, stream, thresh, dscale, rk, x16, a16) - mean[r]),
                        rstd[r]);
        sb += g;
    }
    dw_part[(size_t)chunk * C + c] = sw;
    db_part[(size_t)chunk * C + c] = sb;
}

// dw, db partials, version 3: version 2's sums, column by column in the same row order (the same bits), four
// consecutive columns a thread (C % 4 == 0, 16-byte aligned: the float4 path): one Philox call for the four keep
// factors where version 2 made one per element (four calls, three of their words unused), float4 loads of dout, x
// and a (or 8-byte loads of their 16-bit storage), two rows' loads in flight before the two rows' adds (in row
// order). Grid (ceil(C / 4 / 64), chunks), 64 threads: as many bytes in flight per SM as version 2's 256 threads
// of one float each, and a quarter of the threads' instructions. (__launch_bounds__(64, 8): with (64) or (128) or
// (256) ptxas spilled one kind's body or another at 40 registers, sm_90, CUDA 13.0; with a minimum of 8 blocks an
// SM it takes 54-72 and spills none.)
__device__ __forceinline__ void dwdb_add4(float4& sw, float4& sb, float4 g, float4 v, float m, float rs) {
    sw.x += __fmul_rn(__fmul_rn(g.x, v.x - m), rs);                // version 2's sw += g (s - m) rs, sb += g
    sw.y += __fmul_rn(__fmul_rn(g.y, v.y - m), rs);
    sw.z += __fmul_rn(__fmul_rn(g.z, v.z - m), rs);
    sw.w += __fmul_rn(__fmul_rn(g.w, v.w - m), rs);
    sb.x += g.x; sb.y += g.y; sb.z += g.z; sb.w += g.w;
}
template <int KIND, int IN16>
__device__ __forceinline__ void ln_dwdb_v3(LNDW_ARGS) {
    const int c = 4 * (blockIdx.x * blockDim.x + threadIdx.x), chunk = blockIdx.y;
    if (c >= C) return;
    float4 sw = make_float4(0.f, 0.f, 0.f, 0.f), sb = sw;
    const int r0 = chunk * per, r1 = min(R, (chunk + 1) * per);
    int r = r0;
    for (; r + 1 < r1; r += 2) {
        const size_t e0 = (size_t)r * C + c, e1 = e0 + C;
        const float4 g0 = rnd4(ld4(dout + e0), rk), g1 = rnd4(ld4(dout + e1), rk);
        const float4 v0 = s4<KIND, IN16>(x, a, e0, seed, stream, thresh, dscale, rk, x16, a16);
        const float4 v1 = s4<KIND, IN16>(x, a, e1, seed, stream, thresh, dscale, rk, x16, a16);
        dwdb_add4(sw, sb, g0, v0, mean[r], rstd[r]);
        dwdb_add4(sw, sb, g1, v1, mean[r + 1], rstd[r + 1]);
    }
    if (r < r1) {
        const size_t e = (size_t)r * C + c;
        dwdb_add4(sw, sb, rnd4(ld4(dout + e), rk), s4<KIND, IN16>(x, a, e, seed, stream, thresh, dscale, rk, x16, a16),
                  mean[r], rstd[r]);
    }
    st4(dw_part + (size_t)chunk * C + c, sw);
    st4(db_part + (size_t)chunk * C + c, sb);
}

// dw, db partials, versions 4 and 5: version 3's sums, column by column in the same row order (the same bits), with
// D rows' loads in flight before their adds (version 3: two; 4: four; 5: eight). Why: the partials' parallelism is
// fixed by their order (a thread's four columns over a chunk's rows, 64 chunks: at R = 4096, C = 768 that is 192
// blocks of 64 threads, about three warps an SM of an H200), so latency, not bandwidth, sets version 3's pace: 25.7
// us a call at B=32 T=128 in the H200's step profile (2026-11-27), 1.47 TB/s of its 37.7 MB read, where the dx
// kernel beside it moves 3 TB/s. Each row more in flight is 48 bytes more a thread (dout, x, a) towards the ~4 MB
// that an H200's bandwidth times its memory latency asks for.
template <int KIND, int IN16, int D>
__device__ __forceinline__ void ln_dwdb_deep(LNDW_ARGS) {
    const int c = 4 * (blockIdx.x * blockDim.x + threadIdx.x), chunk = blockIdx.y;
    if (c >= C) return;
    float4 sw = make_float4(0.f, 0.f, 0.f, 0.f), sb = sw;
    const int r0 = chunk * per, r1 = min(R, (chunk + 1) * per);
    int r = r0;
    for (; r + D <= r1; r += D) {
        float4 g[D], v[D];
        float m[D], rs[D];
#pragma unroll
        for (int i = 0; i < D; i++) {                        // every load of the D rows first ...
            const size_t e = (size_t)(r + i) * C + c;
            g[i] = rnd4(ld4(dout + e), rk);
            v[i] = s4<KIND, IN16>(x, a, e, seed, stream, thresh, dscale, rk, x16, a16);
            m[i] = mean[r + i];
            rs[i] = rstd[r + i];
        }
#pragma unroll
        for (int i = 0; i < D; i++) dwdb_add4(sw, sb, g[i], v[i], m[i], rs[i]);    // ... then the adds, in row order
    }
    for (; r < r1; r++) {                                    // the chunk's last rows, one at a time
        const size_t e = (size_t)r * C + c;
        dwdb_add4(sw, sb, rnd4(ld4(dout + e), rk), s4<KIND, IN16>(x, a, e, seed, stream, thresh, dscale, rk, x16, a16),
                  mean[r], rstd[r]);
    }
    st4(dw_part + (size_t)chunk * C + c, sw);
    st4(db_part + (size_t)chunk * C + c, sb);
}

#define LN2_KERNELS(NAME, KIND)                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) layernorm_fwd_v2_##NAME(                                   \
        LN2_ARGS, const float* __restrict__ w, const float* __restrict__ b, float eps, int R, int C, int vec,   \
        float* __restrict__ out, float* __restrict__ mean, float* __restrict__ rstd,                            \
        unsigned short* __restrict__ o16, unsigned short* __restrict__ kx16, unsigned short* __restrict__ ka16) { \
        RK_DISPATCH(ln_fwd_v2<KIND>(x, a, seed, stream, thresh, dscale, RKC, w, b, eps, R, C, vec, out, mean, rstd,  \
                                    o16, kx16, ka16))                                                           \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(256) layernorm_bwd_dx_v2_##NAME(                                \
        const float* __restrict__ dout, LN2_ARGS, const float* __restrict__ w, const float* __restrict__ mean,  \
        const float* __restrict__ rstd, int R, int C, int vec, float* __restrict__ dx, float* __restrict__ da,  \
        unsigned short* __restrict__ o16, const unsigned short* __restrict__ x16,                               \
        const unsigned short* __restrict__ a16) {                                                               \
        RK16_DISPATCH(x16 != nullptr, ln_bwd_dx_v2<KIND, IN16>(dout, x, a, seed, stream, thresh, dscale, RKC, w, mean, \
                                                                 rstd, R, C, vec, dx, da, o16, x16, a16))       \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(256) layernorm_bwd_dwdb_partial_v2_##NAME(LNDW_ARGS) {         \
        RK16_DISPATCH(x16 != nullptr, ln_dwdb_v2<KIND, IN16>(LNDW_CALL))                                        \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(64, 8) layernorm_bwd_dwdb_partial_v3_##NAME(LNDW_ARGS) {       \
        RK16_DISPATCH(x16 != nullptr, ln_dwdb_v3<KIND, IN16>(LNDW_CALL))                                        \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(64, 8) layernorm_bwd_dwdb_partial_v4_##NAME(LNDW_ARGS) {       \
        RK16_DISPATCH(x16 != nullptr, (ln_dwdb_deep<KIND, IN16, 4>(LNDW_CALL)))                                 \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(64, 8) layernorm_bwd_dwdb_partial_v5_##NAME(LNDW_ARGS) {       \
        RK16_DISPATCH(x16 != nullptr, (ln_dwdb_deep<KIND, IN16, 8>(LNDW_CALL)))                                 \
    }
LN2_KERNELS(ln, 0)
LN2_KERNELS(res, 1)
LN2_KERNELS(drop, 2)

// version 3 forward: version 2's arithmetic, in the same order (the same bits), with the row kept in registers:
// NV float4 per lane (C <= 128 NV, C % 4 == 0, 16-byte aligned), so x and a are read once and the keep factors
// drawn once, where version 2 re-reads them (and re-runs Philox) in each of its three passes. 256 threads a block;
// __maxnreg__(96) instead of __launch_bounds__(256) (which made ptxas keep 64 registers and spill the dropout
// kind's NV = 8 case). Its first H200 measurement (before RK_DISPATCH; 61-72 registers): the plain kind 0.0128 ms
// against version 2's 0.00995 at (2048, 768); with the twelve (nv, rk) bodies it takes 96 registers, and the H200
// run of 2026-11-27 at 2f0feb7 timed its forward at 0.0052 / 0.0050 / 0.0056 ms (ln / res / drop) against version
// 2's 0.0056 / 0.0064 / 0.0092 (this main, 2048 x 768), as the H100 had: first in the built-in order since.
template <int KIND, int NV>
__device__ __forceinline__ void ln_fwd_v3(LN2_ARGS, const float* __restrict__ w, const float* __restrict__ b,
                                          float eps, int R, int C, float* __restrict__ out, float* __restrict__ mean,
                                          float* __restrict__ rstd, unsigned short* __restrict__ o16,
                                          unsigned short* __restrict__ kx16, unsigned short* __restrict__ ka16) {
    const int r = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (r >= R) return;                                             // warp-uniform
    const size_t row = (size_t)r * C;
    float4 v[NV];
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < NV; i++) {
        const int c = lane * 4 + 128 * i;
        v[i] = c < C ? s4<KIND>(x, a, row + c, seed, stream, thresh, dscale, rk) : make_float4(0.f, 0.f, 0.f, 0.f);
        if (c < C) s += (v[i].x + v[i].y) + (v[i].z + v[i].w);
    }
    const float m = warp_sum(s) / C;
    float q = 0.f;
#pragma unroll
    for (int i = 0; i < NV; i++) {
        if (lane * 4 + 128 * i < C) {
            const float d0 = v[i].x - m, d1 = v[i].y - m, d2 = v[i].z - m, d3 = v[i].w - m;
            q += (d0 * d0 + d1 * d1) + (d2 * d2 + d3 * d3);
        }
    }
    const float rs = 1.f / sqrtf(warp_sum(q) / C + eps);
#pragma unroll
    for (int i = 0; i < NV; i++) {
        const int c = lane * 4 + 128 * i;
        if (c < C) {
            const float4 ww = rnd4(ld4(w + c), rk), bb = rnd4(ld4(b + c), rk);
            const float4 o = rnd4(make_float4((v[i].x - m) * rs * ww.x + bb.x, (v[i].y - m) * rs * ww.y + bb.y,
                                              (v[i].z - m) * rs * ww.z + bb.z, (v[i].w - m) * rs * ww.w + bb.w), rk);
            st4(out + row + c, o);
            put16x4(o16, row + c, o, rk);
            keep16x4(x, kx16, row + c, rk);                         // (x and a read again here: L1 / L2 hits)
            if (KIND >= 1) keep16x4(a, ka16, row + c, rk);
        }
    }
    if (lane == 0) { mean[r] = m; rstd[r] = rs; }
}

#define LN3_CASE(KIND, N)                                                                                        \
    case N: RK_DISPATCH(ln_fwd_v3<KIND, N>(x, a, seed, stream, thresh, dscale, RKC, w, b, eps, R, C, out, mean,  \
                                           rstd, o16, kx16, ka16)) break;
#define LN3_KERNEL(NAME, KIND)                                                                                   \
    extern "C" __global__ void __maxnreg__(96) layernorm_fwd_v3_##NAME(                                         \
        LN2_ARGS, const float* __restrict__ w, const float* __restrict__ b, float eps, int R, int C, int nv,    \
        float* __restrict__ out, float* __restrict__ mean, float* __restrict__ rstd,                            \
        unsigned short* __restrict__ o16, unsigned short* __restrict__ kx16, unsigned short* __restrict__ ka16) { \
        switch (nv) {                     /* even nv only: the launcher rounds ceil(C / 128) up (c < C masks) */ \
            LN3_CASE(KIND, 2) LN3_CASE(KIND, 4) LN3_CASE(KIND, 6) LN3_CASE(KIND, 8)                             \
        }                                                                                                       \
    }
LN3_KERNEL(ln, 0)
LN3_KERNEL(res, 1)
LN3_KERNEL(drop, 2)

// backward version 6 (4 and 5 are the dw, db partials' variants above): dx (da) and the dw, db partials in one
// pass. Version 2's dx kernel reads dout, x, a for its row sums and again for dx; the partials kernel beside it
// reads them all a third time (in the H200's step profile of 2026-11-28, B=32 T=128: 26.6 us a call for the
// dropout kind's partials against 21.0 for dx, 1.4 TB/s).
// Here each warp's second pass also adds dout xhat and dout into the lane's columns (float4 sw[i], sb[i]: columns
// lane * 4 + 128 i, NV of them, C <= 128 NV, the float4 path), over the rows r = blockIdx.x * 8 + warp + 8 G k
// (G = gridDim.x); the block's 8 warps are then added in warp order through shared memory into its partial row
// (pw, pb: (G, C)), and column_sum2_v6 adds the G rows in order. dx, da: version 2's code per row
// (ln_sums4, ln_dx4), so version 2's bits; dw, db: each term version 3's (dwdb_add4), summed in this order instead
// of version 3's chunks of consecutive rows, so within float32 rounding of version 3's (the main compares both with
// the double reference, and dx bit for bit with version 2's). Block 256; grid G <= ceil(R / 8) (the launcher:
// at most 256 blocks).
template <int KIND, int IN16, int NV>
__device__ __forceinline__ void ln_bwd_fused_v6(const float* __restrict__ dout, LN2_ARGS,
                                                const float* __restrict__ w, const float* __restrict__ mean,
                                                const float* __restrict__ rstd, int R, int C, float* __restrict__ dx,
                                                float* __restrict__ da, unsigned short* __restrict__ o16,
                                                const unsigned short* __restrict__ x16,
                                                const unsigned short* __restrict__ a16, float* __restrict__ pw,
                                                float* __restrict__ pb, float4* Sw, float4* Sb) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float4 sw[NV], sb[NV];
#pragma unroll
    for (int i = 0; i < NV; i++) sw[i] = sb[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int r = blockIdx.x * 8 + warp; r < R; r += gridDim.x * 8) {          // (warp-uniform)
        const size_t row = (size_t)r * C;
        const float m = mean[r], rs = rstd[r];
        float c1 = 0.f, c2 = 0.f;
#pragma unroll
        for (int i = 0; i < NV; i++) {                              // version 2's pass 1: the same order of adds
            const int c = lane * 4 + 128 * i;
            if (c < C)
                ln_sums4(s4<KIND, IN16>(x, a, row + c, seed, stream, thresh, dscale, rk, x16, a16),
                         rnd4(ld4(dout + row + c), rk), rnd4(ld4(w + c), rk), m, rs, c1, c2);
        }
        c1 = warp_sum(c1) / C;
        c2 = warp_sum(c2) / C;
        unsigned short* const t16 = rk >= 0 && o16 ? o16 + row : nullptr;     // the twin's row (or none)
#pragma unroll
        for (int i = 0; i < NV; i++) {                              // version 2's pass 2, and the partials' terms
            const int c = lane * 4 + 128 * i;
            if (c < C) {
                const float4 v = s4<KIND, IN16>(x, a, row + c, seed, stream, thresh, dscale, rk, x16, a16);
                const float4 g = rnd4(ld4(dout + row + c), rk);
                ln_store4<KIND>(ln_dx4(v, g, rnd4(ld4(w + c), rk), m, rs, c1, c2), row + c, c, seed, stream, thresh,
                                dscale, rk, dx, da, t16);
                dwdb_add4(sw[i], sb[i], g, v, m, rs);
            }
        }
    }
    for (int wp = 0; wp < 8; wp++) {                                // the warps' sums, in warp order
        if (warp == wp) {
#pragma unroll
            for (int i = 0; i < NV; i++) {
                const int c4 = lane + 32 * i;
                if (4 * c4 < C) {
                    if (wp == 0) {
                        Sw[c4] = sw[i];
                        Sb[c4] = sb[i];
                    } else {
                        const float4 u = Sw[c4], y = Sb[c4];
                        Sw[c4] = make_float4(u.x + sw[i].x, u.y + sw[i].y, u.z + sw[i].z, u.w + sw[i].w);
                        Sb[c4] = make_float4(y.x + sb[i].x, y.y + sb[i].y, y.z + sb[i].z, y.w + sb[i].w);
                    }
                }
            }
        }
        __syncthreads();
    }
    for (int c4 = threadIdx.x; 4 * c4 < C; c4 += 256) {
        st4(pw + (size_t)blockIdx.x * C + 4 * c4, Sw[c4]);
        st4(pb + (size_t)blockIdx.x * C + 4 * c4, Sb[c4]);
    }
}

// a kernel per (kind, NV): each takes the registers its own NV needs (one kernel with a switch over NV takes the
// largest case's); layernorm_bwd_fused_v6_<kind>_nv<NV>, NV in 2 (C <= 256), 6 (C <= 768: BERT-base) and 8 (C <=
// 1024: BERT-large; a kernel for NV 4 too would add compile time for no BERT size); two blocks an SM asked of
// ptxas (at most 128 registers) where NV <= 6. Two bodies a kernel (x, a read as float32 or as their 16-bit
// storage), rk a run-time argument (mixed precision: every value on the compute grid; version 2's dx kernel has a
// body per rk, five in all: here that would double the file's compile time for a memory-bound kernel)
#define LN6_KERNEL(NAME, KIND, N)                                                                                \
    extern "C" __global__ void __launch_bounds__(256, N == 8 ? 1 : 2) layernorm_bwd_fused_v6_##NAME##_nv##N(     \
        const float* __restrict__ dout, LN2_ARGS, const float* __restrict__ w, const float* __restrict__ mean,  \
        const float* __restrict__ rstd, int R, int C, float* __restrict__ dx, float* __restrict__ da,           \
        unsigned short* __restrict__ o16, const unsigned short* __restrict__ x16,                               \
        const unsigned short* __restrict__ a16, float* __restrict__ pw, float* __restrict__ pb) {               \
        __shared__ float4 Sw[256], Sb[256];                        /* the block's partial row (C <= 1024) */     \
        if (rk >= 0 && x16)                                                                                     \
            ln_bwd_fused_v6<KIND, 1, N>(dout, x, a, seed, stream, thresh, dscale, rk, w, mean, rstd, R, C, dx, da, \
                                        o16, x16, a16, pw, pb, Sw, Sb);                                         \
        else                                                                                                    \
            ln_bwd_fused_v6<KIND, 0, N>(dout, x, a, seed, stream, thresh, dscale, rk, w, mean, rstd, R, C, dx, da, \
                                        o16, x16, a16, pw, pb, Sw, Sb);                                         \
    }
#define LN6_KERNELS(NAME, KIND) LN6_KERNEL(NAME, KIND, 2) LN6_KERNEL(NAME, KIND, 6) LN6_KERNEL(NAME, KIND, 8)
LN6_KERNELS(ln, 0)
LN6_KERNELS(res, 1)
LN6_KERNELS(drop, 2)

// dw and db in one launch: out_w[c] = sum_k pw[k, c], out_b[c] = sum_k pb[k, c], in chunk order
extern "C" __global__ void __launch_bounds__(256) column_sum2(const float* __restrict__ pw,
                                                             const float* __restrict__ pb, int chunks, int C,
                                                             float* __restrict__ out_w, float* __restrict__ out_b) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float sw = 0.f, sb = 0.f;
    for (int k = 0; k < chunks; k++) { sw += pw[(size_t)k * C + c]; sb += pb[(size_t)k * C + c]; }
    out_w[c] = sw;
    out_b[c] = sb;
}

// version 6's dw and db: out_w[c] = sum_k pw[k, c] (and out_b from pb) over G partial rows in order, with more
// threads than column_sum2's one a column (G up to 256 rows, where version 3 has 64): block (32 columns, 8 groups),
// group y adds rows y, y + 8, ... in order, then group 0 adds the 8 groups' sums in group order. Grid ceil(C / 32).
extern "C" __global__ void __launch_bounds__(256) column_sum2_v6(const float* __restrict__ pw,
                                                                const float* __restrict__ pb, int G, int C,
                                                                float* __restrict__ out_w,
                                                                float* __restrict__ out_b) {
    __shared__ float Tw[8][32], Tb[8][32];
    const int x = threadIdx.x & 31, y = threadIdx.x >> 5, c = blockIdx.x * 32 + x;
    float sw = 0.f, sb = 0.f;
    if (c < C)
        for (int k = y; k < G; k += 8) { sw += pw[(size_t)k * C + c]; sb += pb[(size_t)k * C + c]; }
    Tw[y][x] = sw;
    Tb[y][x] = sb;
    __syncthreads();
    if (y == 0 && c < C) {
        float tw = Tw[0][x], tb = Tb[0][x];
        for (int k = 1; k < 8; k++) { tw += Tw[k][x]; tb += Tb[k][x]; }
        out_w[c] = tw;
        out_b[c] = tb;
    }
}

// ----------------------------------------------------------------------------------------------------------------
// launcher, main

#ifdef HOST_CODE
// CPU reference of every kind (double sums), the dropout keep factors from the host Philox
struct LnRef { std::vector<float> out, mean, rstd, dx, da, dw, db; };
LnRef layernorm_cpu(int kind, const float* x, const float* a, u64 seed, u64 stream, u64 thresh, float dscale,
                    const float* w, const float* b, const float* dout, float eps, int R, int C) {
    LnRef o{std::vector<float>((size_t)R * C), std::vector<float>(R), std::vector<float>(R),
            std::vector<float>((size_t)R * C), std::vector<float>((size_t)R * C), std::vector<float>(C),
            std::vector<float>(C)};
    std::vector<double> dw(C, 0.0), db(C, 0.0), sv(C), xh(C);
    for (int r = 0; r < R; r++) {
        double m = 0, v = 0;
        for (int c = 0; c < C; c++) {
            size_t e = (size_t)r * C + c;
            double z = kind == 2 ? (philox_word_host(e, stream, seed) >= thresh ? dscale : 0.0) : 1.0;
            sv[c] = x[e] + (kind >= 1 ? (double)a[e] * z : 0.0);
            m += sv[c];
        }
        m /= C;
        for (int c = 0; c < C; c++) v += (sv[c] - m) * (sv[c] - m);
        double rs = 1.0 / sqrt(v / C + eps), c1 = 0, c2 = 0;
        for (int c = 0; c < C; c++) {
            size_t e = (size_t)r * C + c;
            xh[c] = (sv[c] - m) * rs;
            o.out[e] = (float)(xh[c] * w[c] + b[c]);
            c1 += (double)dout[e] * w[c] * xh[c];
            c2 += (double)dout[e] * w[c];
            dw[c] += (double)dout[e] * xh[c];
            db[c] += dout[e];
        }
        c1 /= C; c2 /= C;
        for (int c = 0; c < C; c++) {
            size_t e = (size_t)r * C + c;
            double d = ((double)dout[e] * w[c] - (xh[c] * c1 + c2)) * rs;
            double z = kind == 2 ? (philox_word_host(e, stream, seed) >= thresh ? dscale : 0.0) : 1.0;
            o.dx[e] = (float)d;
            o.da[e] = (float)(d * z);
        }
        o.mean[r] = (float)m;
        o.rstd[r] = (float)rs;
    }
    for (int c = 0; c < C; c++) { o.dw[c] = (float)dw[c]; o.db[c] = (float)db[c]; }
    return o;
}

struct Dev { float *x, *a, *w, *b, *dout, *out, *mean, *rstd, *dx, *da, *dw, *db, *pw, *pb; };

// version 6's grid: at most 256 blocks (cuda_c.py's LN6_BLOCKS); on CPU threads 16, so that the small shapes'
// warps take several rows each (R = 257, 577: the grid stride and its tail)
#ifdef CPUSIM_SMALL
static int ln6_blocks(int R) { return std::min((R + 7) / 8, 16); }
#else
static int ln6_blocks(int R) { return std::min((R + 7) / 8, 256); }
#endif

static int g_dwdb = 3;      // which dw, db partials version 3 runs (3, 4 or 5: the same sums; the main compares them)

// one version's forward + backward; v1 has kind 0 only
void run(int version, int kind, const Dev& d, u64 seed, u64 stream, u64 thresh, float dscale, float eps, int R,
         int C, int per, int chunks, int rk = -1, unsigned short* o16 = nullptr, unsigned short* d16 = nullptr,
         unsigned short* kx = nullptr, unsigned short* ka = nullptr,        // kx, ka: x, a kept in 16 bits
         int parts = 7) {                  // which kernels: 1 the forward, 2 dx, 4 the dw, db partials and their sum
    const int vec = (C & 3) == 0, grid = (R + 7) / 8;
    const dim3 pgrid((C + 255) / 256, chunks);
    if (version == 6) {     // (C % 4 == 0, C <= 1024) version 3's forward, the fused backward
        const int nv = ((C + 255) / 256) * 2, G = ln6_blocks(R);              // (nv: version 3's forward's)
        decltype(&layernorm_bwd_fused_v6_ln_nv2) fused[3][3] = {
            {layernorm_bwd_fused_v6_ln_nv2, layernorm_bwd_fused_v6_ln_nv6, layernorm_bwd_fused_v6_ln_nv8},
            {layernorm_bwd_fused_v6_res_nv2, layernorm_bwd_fused_v6_res_nv6, layernorm_bwd_fused_v6_res_nv8},
            {layernorm_bwd_fused_v6_drop_nv2, layernorm_bwd_fused_v6_drop_nv6, layernorm_bwd_fused_v6_drop_nv8}};
        auto bf = fused[kind][C <= 256 ? 0 : C <= 768 ? 1 : 2];             // NV 2, 6 or 8 (cuda_c.py's rule)
        auto fwd3 = kind == 0 ? layernorm_fwd_v3_ln : kind == 1 ? layernorm_fwd_v3_res : layernorm_fwd_v3_drop;
        if (parts & 1)
            LAUNCH(fwd3, grid, 256, d.x, d.a, seed, stream, thresh, dscale, rk, d.w, d.b, eps, R, C, nv, d.out, d.mean,
                   d.rstd, o16, kx, ka);
        if (parts & 2)
            LAUNCH(bf, G, 256, d.dout, d.x, d.a, seed, stream, thresh, dscale, rk, d.w, d.mean, d.rstd, R, C, d.dx,
                   d.da, d16, (const unsigned short*)kx, (const unsigned short*)ka, d.pw, d.pb);
        if (parts & 4) LAUNCH(column_sum2_v6, (C + 31) / 32, 256, d.pw, d.pb, G, C, d.dw, d.db);
    } else if (version == 1) {
        if (parts & 1) LAUNCH(layernorm_fwd_v1, grid, 256, d.x, d.w, d.b, eps, R, C, d.out, d.mean, d.rstd);
        if (parts & 2) LAUNCH(layernorm_bwd_dx_v1, grid, 256, d.dout, d.x, d.w, d.mean, d.rstd, R, C, d.dx);
        if (parts & 4) {
            LAUNCH(layernorm_bwd_dwdb_partial, pgrid, 256, d.dout, d.x, d.mean, d.rstd, R, C, per, d.pw, d.pb);
            LAUNCH(column_sum, (C + 255) / 256, 256, d.pw, chunks, C, d.dw);
            LAUNCH(column_sum, (C + 255) / 256, 256, d.pb, chunks, C, d.db);
        }
    } else {
        auto fwd = kind == 0 ? layernorm_fwd_v2_ln : kind == 1 ? layernorm_fwd_v2_res : layernorm_fwd_v2_drop;
        auto fwd3 = kind == 0 ? layernorm_fwd_v3_ln : kind == 1 ? layernorm_fwd_v3_res : layernorm_fwd_v3_drop;
        auto bdx = kind == 0 ? layernorm_bwd_dx_v2_ln : kind == 1 ? layernorm_bwd_dx_v2_res : layernorm_bwd_dx_v2_drop;
        auto pw = kind == 0 ? layernorm_bwd_dwdb_partial_v2_ln
                : kind == 1 ? layernorm_bwd_dwdb_partial_v2_res : layernorm_bwd_dwdb_partial_v2_drop;
        auto pw3 = kind == 0 ? layernorm_bwd_dwdb_partial_v3_ln
                 : kind == 1 ? layernorm_bwd_dwdb_partial_v3_res : layernorm_bwd_dwdb_partial_v3_drop;
        if (g_dwdb == 4)
            pw3 = kind == 0 ? layernorm_bwd_dwdb_partial_v4_ln
                : kind == 1 ? layernorm_bwd_dwdb_partial_v4_res : layernorm_bwd_dwdb_partial_v4_drop;
        if (g_dwdb == 5)
            pw3 = kind == 0 ? layernorm_bwd_dwdb_partial_v5_ln
                : kind == 1 ? layernorm_bwd_dwdb_partial_v5_res : layernorm_bwd_dwdb_partial_v5_drop;
        if ((parts & 1) && version == 3)
            LAUNCH(fwd3, grid, 256, d.x, d.a, seed, stream, thresh, dscale, rk, d.w, d.b, eps, R, C,
                   ((C + 255) / 256) * 2, d.out, d.mean, d.rstd, o16, kx, ka);
        else if (parts & 1)
            LAUNCH(fwd, grid, 256, d.x, d.a, seed, stream, thresh, dscale, rk, d.w, d.b, eps, R, C, vec, d.out,
                   d.mean, d.rstd, o16, kx, ka);
        if (parts & 2)
            LAUNCH(bdx, grid, 256, d.dout, d.x, d.a, seed, stream, thresh, dscale, rk, d.w, d.mean, d.rstd, R, C, vec,
                   d.dx, d.da, d16, (const unsigned short*)kx, (const unsigned short*)ka);
        if ((parts & 4) && version == 3)     // (v3: C % 4 == 0) four columns a thread, 64 threads a block
            LAUNCH(pw3, dim3((C / 4 + 63) / 64, chunks), 64, d.dout, d.x, d.a, seed, stream, thresh, dscale, rk, d.mean,
                   d.rstd, R, C, per, d.pw, d.pb, (const unsigned short*)kx, (const unsigned short*)ka);
        else if (parts & 4)
            LAUNCH(pw, pgrid, 256, d.dout, d.x, d.a, seed, stream, thresh, dscale, rk, d.mean, d.rstd, R, C, per, d.pw,
                   d.pb, (const unsigned short*)kx, (const unsigned short*)ka);
        if (parts & 4) LAUNCH(column_sum2, (C + 255) / 256, 256, d.pw, d.pb, chunks, C, d.dw, d.db);
    }
    cudaCheck(cudaGetLastError());
}

int main() {
#ifdef CPUSIM_SMALL
    const int shapes[][2] = {{1, 1}, {3, 37}, {9, 52}, {2, 260}, {257, 52},   // C = 1; tails of warps and float4
                             {577, 12}};    // rows; 5 rows a chunk (v3: pairs, a tail); 10 (v4: 4 + 4 + 2, v5: 8 + 2)
    const bool timing = false;
#else
    const int shapes[][2] = {{1, 1}, {3, 37}, {67, 52}, {130, 772}, {4 * 512, 768}};
    const bool timing = true;
#endif
    const float eps = 1e-12f, p = 0.1f;
    const u64 seed = 0x123456789ABCDEFull, stream = 7, thresh = (u64)llround(p * 4294967296.0);
    const float dscale = 1.f / (1.f - p);
    for (auto& sh : shapes) {
        const int R = sh[0], C = sh[1], chunks_max = 64, per = (R + chunks_max - 1) / chunks_max,
                  chunks = (R + per - 1) / per;
        const size_t n = (size_t)R * C;
        float *x = make_random_float(n, 1), *a = make_random_float(n, 2), *dout = make_random_float(n, 3);
        float *w = make_random_float(C, 4), *b = make_random_float(C, 5);
        Dev d;
        float** bufs[] = {&d.x, &d.a, &d.dout, &d.out, &d.dx, &d.da};
        for (float** q : bufs) cudaCheck(cudaMalloc(q, n * 4));
        float** cbufs[] = {&d.w, &d.b, &d.dw, &d.db};
        for (float** q : cbufs) cudaCheck(cudaMalloc(q, C * 4));
        cudaCheck(cudaMalloc(&d.mean, R * 4)); cudaCheck(cudaMalloc(&d.rstd, R * 4));
        const size_t prow = std::max(chunks, ln6_blocks(R));                 // partial rows: v2-v3's or v6's
        cudaCheck(cudaMalloc(&d.pw, prow * C * 4)); cudaCheck(cudaMalloc(&d.pb, prow * C * 4));
        cudaCheck(cudaMemcpy(d.x, x, n * 4, cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(d.a, a, n * 4, cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(d.dout, dout, n * 4, cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(d.w, w, C * 4, cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(d.b, b, C * 4, cudaMemcpyHostToDevice));
        for (int version : {1, 2, 3, 6})
            for (int kind = 0; kind < (version == 1 ? 1 : 3); kind++) {
                if (version >= 3 && ((C & 3) || C > 1024)) continue;      // v3, v6: the float4 path, C <= 1024
#ifdef CPUSIM_SMALL
                if (R > 64 && version < 3) continue;         // (the 257-row shape: for v3's partials against v2's
                                                             // and v6's grid stride, 2 and 5 rows a warp)
#endif
                printf("layernorm v%d kind %s R=%d C=%d\n", version, kind == 0 ? "ln" : kind == 1 ? "res" : "drop",
                       R, C);
                LnRef ref = layernorm_cpu(kind, x, a, seed, stream, thresh, dscale, w, b, dout, eps, R, C);
                run(version, kind, d, seed, stream, thresh, dscale, eps, R, C, per, chunks);
                cudaCheck(cudaDeviceSynchronize());
                // float32 sums in another order than the double reference: ~1e-6 relative on O(1) values; dx cancels
                // terms of size |wdy| (C = 1: exactly 0 on both sides); dw, db sum R rows
                validate_result(d.out, ref.out.data(), "out", n, 1e-5f, 1e-5f);
                validate_result(d.mean, ref.mean.data(), "mean", R, 1e-6f, 1e-5f);
                validate_result(d.rstd, ref.rstd.data(), "rstd", R, 1e-6f, 1e-5f);
                validate_result(d.dx, ref.dx.data(), "dx", n, 1e-5f, 1e-4f);
                if (kind == 2) validate_result(d.da, ref.da.data(), "da", n, 1e-5f, 1e-4f);
                validate_result(d.dw, ref.dw.data(), "dw", C, 1e-4f + 1e-6f * R, 1e-4f);
                validate_result(d.db, ref.db.data(), "db", C, 1e-4f + 1e-6f * R, 1e-4f);
                if (version == 6) {                  // v6's dx, da: version 2's code per row, so its bits
                    std::vector<float> x4(n), a4(n), x2(n), a2(n);
                    cudaCheck(cudaMemcpy(x4.data(), d.dx, n * 4, cudaMemcpyDeviceToHost));
                    cudaCheck(cudaMemcpy(a4.data(), d.da, n * 4, cudaMemcpyDeviceToHost));
                    run(2, kind, d, seed, stream, thresh, dscale, eps, R, C, per, chunks);
                    cudaCheck(cudaDeviceSynchronize());
                    cudaCheck(cudaMemcpy(x2.data(), d.dx, n * 4, cudaMemcpyDeviceToHost));
                    cudaCheck(cudaMemcpy(a2.data(), d.da, n * 4, cudaMemcpyDeviceToHost));
                    size_t diff = 0;
                    for (size_t e = 0; e < n; e++)
                        diff += (BITS_F(x4[e]) != BITS_F(x2[e])) + (kind == 2 && BITS_F(a4[e]) != BITS_F(a2[e]));
                    printf("  dx%s v6 = v2 bit for bit: %s\n", kind == 2 ? ", da" : "", diff ? "NO" : "yes");
                    if (diff) exit(EXIT_FAILURE);
                }
                if (version == 3) {                  // v3's partials against v2's: the same sums in the same order
                    std::vector<float> w3(C), b3(C), w2(C), b2(C);
                    cudaCheck(cudaMemcpy(w3.data(), d.dw, C * 4, cudaMemcpyDeviceToHost));
                    cudaCheck(cudaMemcpy(b3.data(), d.db, C * 4, cudaMemcpyDeviceToHost));
                    run(2, kind, d, seed, stream, thresh, dscale, eps, R, C, per, chunks);
                    cudaCheck(cudaDeviceSynchronize());
                    cudaCheck(cudaMemcpy(w2.data(), d.dw, C * 4, cudaMemcpyDeviceToHost));
                    cudaCheck(cudaMemcpy(b2.data(), d.db, C * 4, cudaMemcpyDeviceToHost));
                    int diff = 0;                    // CPU threads: no contraction, bit for bit; a GPU's compiler may
                    float worst = 0.f;               // contract the two differently: float32 rounding of the sums
                    for (int c = 0; c < C; c++) {
                        diff += (BITS_F(w3[c]) != BITS_F(w2[c])) + (BITS_F(b3[c]) != BITS_F(b2[c]));
                        worst = std::max(worst, std::max(std::fabs(w3[c] - w2[c]), std::fabs(b3[c] - b2[c])));
                    }
#ifdef CPUSIM
                    const bool same = diff == 0;
#else
                    const bool same = worst <= 1e-5f * R;
#endif
                    printf("  dw, db partials v3 against v2: %d of %d differ (largest %.2e): %s\n", diff, 2 * C,
                           worst, same ? "ok" : "WRONG");
                    if (!same) exit(EXIT_FAILURE);
                    // versions 4 and 5 (D rows in flight): version 3's code for every add, so its bits, GPU too.
                    // The partials themselves compared (chunks x C), the buffers filled with NaN bytes before each
                    // run (a chunk, a column or a row left out shows), in float32 and in both 16-bit kinds with x
                    // and a read from the forward's 16-bit storage (the IN16 bodies)
                    const size_t np = (size_t)chunks * C;
                    std::vector<float> ref_w(np), ref_b(np), got_w(np), got_b(np);
                    unsigned short *kx, *ka;
                    cudaCheck(cudaMalloc(&kx, n * 2)); cudaCheck(cudaMalloc(&ka, n * 2));
                    for (int rk = -1; rk < 2; rk++) {
                        unsigned short *kx_ = rk < 0 ? nullptr : kx, *ka_ = rk < 0 ? nullptr : ka;
                        run(3, kind, d, seed, stream, thresh, dscale, eps, R, C, per, chunks, rk, nullptr, nullptr,
                            kx_, ka_);
                        cudaCheck(cudaDeviceSynchronize());
                        cudaCheck(cudaMemcpy(ref_w.data(), d.pw, np * 4, cudaMemcpyDeviceToHost));
                        cudaCheck(cudaMemcpy(ref_b.data(), d.pb, np * 4, cudaMemcpyDeviceToHost));
                        for (int dv = 4; dv <= 5; dv++) {
                            cudaCheck(cudaMemset(d.pw, 0xFF, np * 4)); cudaCheck(cudaMemset(d.pb, 0xFF, np * 4));
                            g_dwdb = dv;
                            run(3, kind, d, seed, stream, thresh, dscale, eps, R, C, per, chunks, rk, nullptr,
                                nullptr, kx_, ka_, 4);
                            g_dwdb = 3;
                            cudaCheck(cudaDeviceSynchronize());
                            cudaCheck(cudaMemcpy(got_w.data(), d.pw, np * 4, cudaMemcpyDeviceToHost));
                            cudaCheck(cudaMemcpy(got_b.data(), d.pb, np * 4, cudaMemcpyDeviceToHost));
                            size_t nd = 0;
                            for (size_t e = 0; e < np; e++)
                                nd += (BITS_F(got_w[e]) != BITS_F(ref_w[e])) + (BITS_F(got_b[e]) != BITS_F(ref_b[e]));
                            printf("  dw, db partials v%d = v3 bit for bit (rk %d): %s\n", dv, rk, nd ? "NO" : "yes");
                            if (nd) exit(EXIT_FAILURE);
                        }
                    }
                    cudaFree(kx); cudaFree(ka);
                }
#ifdef CPUSIM_SMALL
                const bool mixed_checks = R <= 64;           // (the 257-row shape: for v3's partials only)
#else
                const bool mixed_checks = true;
#endif
                if (version >= 2 && mixed_checks) {     // the twins (mixed precision, rk 0 / 1): bits16 of what is kept
                    unsigned short *o16, *d16, *kx, *ka;
                    cudaCheck(cudaMalloc(&o16, n * 2)); cudaCheck(cudaMalloc(&d16, n * 2));
                    cudaCheck(cudaMalloc(&kx, n * 2)); cudaCheck(cudaMalloc(&ka, n * 2));
                    std::vector<float> o(n), g(n);
                    std::vector<unsigned short> ob(n), gb(n);
                    for (int rk = 0; rk < 2; rk++) {
                        run(version, kind, d, seed, stream, thresh, dscale, eps, R, C, per, chunks, rk, o16, d16);
                        cudaCheck(cudaDeviceSynchronize());
                        cudaCheck(cudaMemcpy(o.data(), d.out, n * 4, cudaMemcpyDeviceToHost));
                        cudaCheck(cudaMemcpy(g.data(), kind == 2 ? d.da : d.dx, n * 4, cudaMemcpyDeviceToHost));
                        cudaCheck(cudaMemcpy(ob.data(), o16, n * 2, cudaMemcpyDeviceToHost));
                        cudaCheck(cudaMemcpy(gb.data(), d16, n * 2, cudaMemcpyDeviceToHost));
                        size_t bad = 0;
                        for (size_t e = 0; e < n; e++)
                            bad += (ob[e] != bits16(o[e], rk)) + (gb[e] != bits16(g[e], rk)) +
                                   (round_kind(o[e], rk) != o[e]);
                        printf("  twins rk=%d (out, %s): %s\n", rk, kind == 2 ? "da" : "dx",
                               bad ? "WRONG" : "the stored values' bits");
                        if (bad) exit(EXIT_FAILURE);
                        // x and a kept in 16 bits by the forward, read so by the backward: the same bits of
                        // dx, da, dw, db as from the float32 inputs, and the kept bits are bits16(R(x)), bits16(R(a))
                        std::vector<float> was[4] = {std::vector<float>(n), std::vector<float>(n),
                                                     std::vector<float>(C), std::vector<float>(C)};
                        const float* outs[4] = {d.dx, d.da, d.dw, d.db};
                        for (int i = 0; i < 4; i++)
                            cudaCheck(cudaMemcpy(was[i].data(), outs[i], was[i].size() * 4, cudaMemcpyDeviceToHost));
                        cudaCheck(cudaMemset(d.dx, 0, n * 4)); cudaCheck(cudaMemset(d.da, 0, n * 4));
                        run(version, kind, d, seed, stream, thresh, dscale, eps, R, C, per, chunks, rk, o16, d16,
                            kx, ka);
                        cudaCheck(cudaDeviceSynchronize());
                        std::vector<unsigned short> kb[2] = {std::vector<unsigned short>(n),
                                                             std::vector<unsigned short>(n)};
                        cudaCheck(cudaMemcpy(kb[0].data(), kx, n * 2, cudaMemcpyDeviceToHost));
                        cudaCheck(cudaMemcpy(kb[1].data(), ka, n * 2, cudaMemcpyDeviceToHost));
                        bad = 0;
                        const char* names[4] = {"dx", "da", "dw", "db"};
                        for (int i = 0; i < 4; i++) {
                            if (i == 1 && kind != 2) continue;                   // da: the dropout kind's only
                            std::vector<float> now(was[i].size());
                            cudaCheck(cudaMemcpy(now.data(), outs[i], now.size() * 4, cudaMemcpyDeviceToHost));
                            size_t nb = 0;
                            float big = 0.f;
                            for (size_t e = 0; e < now.size(); e++) {
                                nb += BITS_F(now[e]) != BITS_F(was[i][e]);
                                big = std::max(big, std::fabs(now[e] - was[i][e]));
                            }
                            if (nb) printf("    %s: %zu of %zu differ (largest %.3e)\n", names[i], nb, now.size(), big);
                            bad += nb;
                        }
                        size_t kbad[2] = {0, 0};
                        for (size_t e = 0; e < n; e++) {
                            kbad[0] += kb[0][e] != bits16(round_kind(x[e], rk), rk);
                            kbad[1] += kind >= 1 && kb[1][e] != bits16(round_kind(a[e], rk), rk);
                        }
                        if (kbad[0] + kbad[1])
                            printf("    kept bits wrong: x %zu, a %zu of %zu\n", kbad[0], kbad[1], n);
                        bad += kbad[0] + kbad[1];
                        printf("  kept in 16 bits rk=%d: %s\n", rk,
                               bad ? "WRONG" : "x, a kept; dx, da, dw, db the same bits");
                        if (bad) exit(EXIT_FAILURE);
                        if (timing && R * C >= 1 << 20) {   // the mixed bodies (twins written, x, a kept) part by part
                            float ms[3];
                            for (int i = 0; i < 3; i++)
                                ms[i] = benchmark_kernel(20, [&]() { run(version, kind, d, seed, stream, thresh, dscale,
                                                                         eps, R, C, per, chunks, rk, o16, d16, kx, ka,
                                                                         1 << i); });
                            printf("  v%d %s-mixed: forward %.4f ms, dx %.4f ms, dw db %.4f ms\n", version,
                                   rk == 0 ? "bf16" : "fp16", ms[0], ms[1], ms[2]);
                        }
                    }
                    cudaFree(o16); cudaFree(d16); cudaFree(kx); cudaFree(ka);
                }
                if (timing && R * C >= 1 << 20) {
                    float ms[4];
                    for (int i = 0; i < 4; i++) {      // the whole, then each part (1 forward, 2 dx, 4 dw db)
                        const int parts = i == 0 ? 7 : 1 << (i - 1);
                        ms[i] = benchmark_kernel(20, [&]() { run(version, kind, d, seed, stream, thresh, dscale, eps,
                                                                 R, C, per, chunks, -1, nullptr, nullptr, nullptr,
                                                                 nullptr, parts); });
                    }
                    // forward reads x (a), writes out; backward reads dout, x (a) twice, writes dx (da)
                    double bytes = (kind == 0 ? 7.0 : kind == 1 ? 9.0 : 10.0) * n * 4;
                    printf("  v%d forward + backward %.4f ms, %.0f GB/s (forward %.4f ms, %s %.4f ms, %s %.4f ms)\n",
                           version, ms[0], bytes / ms[0] / 1e6, ms[1], version == 6 ? "dx + partials" : "dx", ms[2],
                           version == 6 ? "their column sum" : "dw db", ms[3]);
                    if (version == 3) {                  // the partials' versions 4 and 5 (+ the column sum)
                        float m45[2];
                        for (int dv = 4; dv <= 5; dv++) {
                            g_dwdb = dv;
                            m45[dv - 4] = benchmark_kernel(20, [&]() { run(3, kind, d, seed, stream, thresh, dscale,
                                                                          eps, R, C, per, chunks, -1, nullptr, nullptr,
                                                                          nullptr, nullptr, 4); });
                            g_dwdb = 3;
                        }
                        const double mb = (kind == 0 ? 2.0 : 3.0) * n * 4 / 1e6;    // dout, x (, a) read
                        printf("  dw db with partials v3 %.4f ms, v4 %.4f ms, v5 %.4f ms (%.0f / %.0f / %.0f GB/s "
                               "read)\n", ms[3], m45[0], m45[1], mb / ms[3], mb / m45[0], mb / m45[1]);
                    }
                }
            }
        free(x); free(a); free(dout); free(w); free(b);
        for (float** q : bufs) cudaFree(*q);
        for (float** q : cbufs) cudaFree(*q);
        cudaFree(d.mean); cudaFree(d.rstd); cudaFree(d.pw); cudaFree(d.pb);
    }
    printf("layernorm: every version ok\n");
    return 0;
}
#endif
