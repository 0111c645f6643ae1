/*
LayerNorm over the last axis, forward and backward, float32.
Oracle: refbert.ops.layernorm_forward / layernorm_backward (Python launchers: kernels/cuda/cuda_c.py).
    x, out, dout, dx: (R, C) contiguous rows   w, b, dw, db: (C,)   mean, rstd: (R,)
    forward:  mean = x.mean(), rstd = 1/sqrt(var + eps) (biased var), xhat = (x - mean) rstd, out = xhat w + b
    backward: wdy = dout w;  c1 = mean(wdy xhat);  c2 = mean(wdy);  dx = (wdy - (xhat c1 + c2)) rstd
              wdy is __fmul_rn(dout, w) in both passes: rounded once and never contracted into an fma with the
              subtraction, so at C = 1 wdy - c2 is exactly 0 as in the oracle, not the product's
              rounding error times rstd = 1/sqrt(eps) = 1e6 (the first H200 run: dx 2e-3 where the oracle has 0)
              dw = sum_rows dout xhat,  db = sum_rows dout   (deterministic: per-chunk partials, then a column sum)

Versions:
  1  a warp per row (8 rows per 256-thread block), 128-bit loads (float4) when C % 4 == 0: two-pass mean and
     variance (the row is re-read from L1/L2, not kept in registers, so any C works); backward likewise for dx,
     and dw/db by a thread per column over a chunk of rows (coalesced) into (chunks, C) partials, then a
     column-sum kernel in chunk order — no atomics, the same bits every run

Build and run standalone (validates against the CPU reference, then times):
    nvcc -O3 -arch=sm_90 -std=c++17 -o layernorm layernorm.cu && ./layernorm
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
            *reinterpret_cast<float4*>(orow + c) = make_float4((a.x - m) * rs * ww.x + bb.x, (a.y - m) * rs * ww.y + bb.y,
                                                               (a.z - m) * rs * ww.z + bb.z, (a.w - m) * rs * ww.w + bb.w);
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
// launcher, main

#ifdef HOST_CODE
int main() {
    const int R = 4 * 512, C = 768, per = 32, chunks = (R + per - 1) / per;
    const float eps = 1e-12f;
    size_t n = (size_t)R * C;
    float *x = make_random_float(n, 1), *dout = make_random_float(n, 2), *w = make_random_float(C, 3);
    float* b = make_random_float(C, 4);
    std::vector<float> out(n), mean(R), rstd(R), dx(n), dw(C), db(C);
    layernorm_forward_cpu(x, w, b, eps, R, C, out.data(), mean.data(), rstd.data());
    layernorm_backward_cpu(dout, x, w, mean.data(), rstd.data(), R, C, dx.data(), dw.data(), db.data());
    float *dx_, *ddo, *dw_, *db_, *dout_, *dm, *dr, *ddx, *ddw, *ddb, *pw, *pb;
    cudaCheck(cudaMalloc(&dx_, n * 4)); cudaCheck(cudaMalloc(&ddo, n * 4)); cudaCheck(cudaMalloc(&dout_, n * 4));
    cudaCheck(cudaMalloc(&ddx, n * 4)); cudaCheck(cudaMalloc(&dw_, C * 4)); cudaCheck(cudaMalloc(&db_, C * 4));
    cudaCheck(cudaMalloc(&ddw, C * 4)); cudaCheck(cudaMalloc(&ddb, C * 4)); cudaCheck(cudaMalloc(&dm, R * 4));
    cudaCheck(cudaMalloc(&dr, R * 4)); cudaCheck(cudaMalloc(&pw, (size_t)chunks * C * 4));
    cudaCheck(cudaMalloc(&pb, (size_t)chunks * C * 4));
    cudaCheck(cudaMemcpy(dx_, x, n * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(ddo, dout, n * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(dw_, w, C * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(db_, b, C * 4, cudaMemcpyHostToDevice));
    auto fwd = [&]() { layernorm_fwd_v1<<<(R + 7) / 8, 256>>>(dx_, dw_, db_, eps, R, C, dout_, dm, dr); };
    auto bwd = [&]() {
        layernorm_bwd_dx_v1<<<(R + 7) / 8, 256>>>(ddo, dx_, dw_, dm, dr, R, C, ddx);
        layernorm_bwd_dwdb_partial<<<dim3((C + 255) / 256, chunks), 256>>>(ddo, dx_, dm, dr, R, C, per, pw, pb);
        column_sum<<<(C + 255) / 256, 256>>>(pw, chunks, C, ddw);
        column_sum<<<(C + 255) / 256, 256>>>(pb, chunks, C, ddb);
    };
    fwd(); bwd();
    cudaCheck(cudaDeviceSynchronize());
    // float32 sums in another order than the CPU's (double mean/var there): ~1e-6 relative on O(1) values;
    // dw, db sum R = 2048 rows
    validate_result(dout_, out.data(), "out", n, 1e-5f, 1e-5f);
    validate_result(ddx, dx.data(), "dx", n, 1e-5f, 1e-4f);
    validate_result(ddw, dw.data(), "dw", C, 1e-3f, 1e-4f);
    validate_result(ddb, db.data(), "db", C, 1e-3f, 1e-4f);
    float ms_f = benchmark_kernel(20, fwd), ms_b = benchmark_kernel(20, bwd);
    // forward reads x, writes out; backward reads x, dout twice (dx pass, dw/db pass), writes dx
    printf("version 1 | forward %.4f ms %.1f GB/s | backward %.4f ms %.1f GB/s\n", ms_f, 2.0 * n * 4 / ms_f / 1e6,
           ms_b, 5.0 * n * 4 / ms_b / 1e6);
    return 0;
}
#endif
