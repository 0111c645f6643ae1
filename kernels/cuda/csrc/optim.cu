/*
The optimizer's step as multi-tensor kernels: AdamW, the per-tensor gradient statistics that AdamW's checks,
clip_grad_norm and GradScaler read, and an in-place scale (clipping, unscaling). One launch covers every tensor of
the model, where the per-array code of refbert/optim.py launches about 15 element-wise kernels a parameter and reads
a value back per check (BERT-base: ~200 tensors, ~3,000 launches a step, more than its forward and backward).
Oracle: refbert.optim.AdamW.step, clip_grad_norm, GradScaler.unscale_ (their per-array NumPy code is the spec;
Python launchers: kernels/cuda/optim.py, which builds the tables below once per set of arrays).

Tables (device arrays; N tensors, nb blocks, CHUNK = 4096 elements a block):
    ptr    (k, N) u64   the data pointers of the k arrays of every tensor (AdamW: p, g, m, v; the others: g)
    size   (N,)   i64   elements of tensor t
    btens  (nb,)  i32   the tensor of block b;   bfirst (nb,) i64: block b's first element in that tensor
    first  (N + 1,) i32 tensor t's blocks are first[t] .. first[t + 1] - 1 (a tensor of no elements has none)
Thread i of a block takes the chunk's elements i, i + 256, ... (consecutive threads, consecutive addresses; OPT_THREADS
below).

AdamW (adamw_v1_f32 / _f64: T = float / double, the parameter's dtype; refbert.optim.AdamW's docstring has the
math). Every operation is NumPy's, in NumPy's order, rounded once to T: the per-array code's scalars are Python
floats, which NumPy casts to the array's dtype (b1, 1 - b1, b2, 1 - b2, eps, lr, the decay factor 1 - lr λ, the
step size lr / (1 - b1^t) and sqrt(1 - b2^t) arrive here already cast), and __fmul_rn / __fadd_rn / __fdiv_rn /
__fsqrt_rn keep nvcc from fusing a product into an FMA, which NumPy never does. So the update is the spec's bit for
bit (the main checks it against a host loop of the same operations; tests/test_cuda_optim.py against
refbert.optim.AdamW on the emulator):
    m = m b1 + (1 - b1) g                          v = v b2 + (1 - b2) (g g)
    correct_bias:  p = p (1 - lr λ) if decayed;    p = p - step (m / (sqrt(v) / bc2 + eps))
    otherwise:     u = m / (sqrt(v) + eps) (+ λ p if decayed);   p = p - lr u
decay (per tensor): decayed and λ != 0 (the per-array code skips the decay when λ is 0).

Statistics (grad_stats_partial_v1 / grad_stats_final_v1): for every tensor, sum g^2 in float64 (each square exact
in float64 for float32 g) and max |g| (NaN when any element is NaN: NumPy's np.max(np.abs(g))). The maximum is
NumPy's exactly (a maximum does not depend on order); the sum is in a fixed order (each thread its elements in
turn, a fixed shuffle tree, the warps in order, the blocks of a tensor by a fixed warp tree), so the same bits
every run, but not NumPy's pairwise order: positive terms along chains of fewer than 300 additions (a 23M-element
embedding), so within 4e-14 relative of the exact sum, and clip_grad_norm's norm agrees with the per-array code's
that closely (at test sizes, a few 1e-16); only through it can the clipped gradients differ (by an ulp, where
the dtype's rounding of the factor falls the other way).

scale_v1_f32 / _f64: g = g f in place (f cast to T: clip's factor, the scaler's 1 / S), NumPy's g *= f.

Versions:
  1  the above: 4-byte loads, 16 elements a thread (enough in flight to stream), no atomics.

Build and run standalone (validates against host loops of the same operations, then times):
    nvcc -O3 -arch=sm_90 -std=c++17 -o optim optim.cu && ./optim
On CPU threads:  g++ -std=c++20 -O1 -pthread -ffp-contract=off -DCPUSIM -DCPUSIM_SMALL -x c++ optim.cu -o o && ./o
*/
#include "common.cuh"

#define OPT_CHUNK 4096
// (256 on CPU threads too, since cpusim.cuh runs a block's threads as fibers: the mains and the emulator take the
// GPU's blocks and the statistics' sums the GPU's order. When every CUDA thread was an OS thread, 256 made a tiny
// model's emulated step take seconds, and the CPU build had 64.)
#define OPT_THREADS 256

// one correctly rounded operation each (no contraction into an FMA): NumPy's element-wise arithmetic
__device__ __forceinline__ float o_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float o_add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float o_sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float o_div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float o_sqrt(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double o_mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double o_add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double o_sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ double o_div(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ double o_sqrt(double a) { return __dsqrt_rn(a); }

template <class T>
__device__ __forceinline__ void adamw_body(const u64* __restrict__ ptr, const long long* __restrict__ size,
                                           const int* __restrict__ btens, const long long* __restrict__ bfirst,
                                           const int* __restrict__ decay, int N, T b1, T omb1, T b2, T omb2, T eps,
                                           T lr, T wd, T dfac, T step, T bc2, int correct) {
    const int t = btens[blockIdx.x];
    const long long e0 = bfirst[blockIdx.x], e1 = min(size[t], e0 + OPT_CHUNK);
    T* __restrict__ p = (T*)ptr[t];
    const T* __restrict__ g = (const T*)ptr[N + t];
    T* __restrict__ m = (T*)ptr[2 * N + t];
    T* __restrict__ v = (T*)ptr[3 * N + t];
    const bool dec = decay[t] != 0;
#pragma unroll 4
    for (long long e = e0 + threadIdx.x; e < e1; e += OPT_THREADS) {
        const T gi = g[e];
        const T mi = o_add(o_mul(m[e], b1), o_mul(omb1, gi));
        const T vi = o_add(o_mul(v[e], b2), o_mul(omb2, o_mul(gi, gi)));
        T pi = p[e];
        if (correct) {                                            // torch.optim.AdamW
            if (dec) pi = o_mul(pi, dfac);
            const T den = o_add(o_div(o_sqrt(vi), bc2), eps);
            pi = o_sub(pi, o_mul(step, o_div(mi, den)));
        } else {                                                  // google-research/bert
            T u = o_div(mi, o_add(o_sqrt(vi), eps));
            if (dec) u = o_add(u, o_mul(wd, pi));
            pi = o_sub(pi, o_mul(lr, u));
        }
        m[e] = mi;
        v[e] = vi;
        p[e] = pi;
    }
}

// grid nb, OPT_THREADS threads; ptr (4, N): p, g, m, v
extern "C" __global__ void __launch_bounds__(OPT_THREADS)
    adamw_v1_f32(const u64* ptr, const long long* size, const int* btens, const long long* bfirst, const int* decay,
                 int N, float b1, float omb1, float b2, float omb2, float eps, float lr, float wd, float dfac,
                 float step, float bc2, int correct) {
    adamw_body<float>(ptr, size, btens, bfirst, decay, N, b1, omb1, b2, omb2, eps, lr, wd, dfac, step, bc2, correct);
}
extern "C" __global__ void __launch_bounds__(OPT_THREADS)
    adamw_v1_f64(const u64* ptr, const long long* size, const int* btens, const long long* bfirst, const int* decay,
                 int N, double b1, double omb1, double b2, double omb2, double eps, double lr, double wd, double dfac,
                 double step, double bc2, int correct) {
    adamw_body<double>(ptr, size, btens, bfirst, decay, N, b1, omb1, b2, omb2, eps, lr, wd, dfac, step, bc2, correct);
}

// g = g f in place; grid nb, OPT_THREADS threads; ptr (1, N)
template <class T>
__device__ __forceinline__ void scale_body(const u64* __restrict__ ptr, const long long* __restrict__ size,
                                           const int* __restrict__ btens, const long long* __restrict__ bfirst, T f) {
    const int t = btens[blockIdx.x];
    const long long e0 = bfirst[blockIdx.x], e1 = min(size[t], e0 + OPT_CHUNK);
    T* __restrict__ g = (T*)ptr[t];
#pragma unroll 4
    for (long long e = e0 + threadIdx.x; e < e1; e += OPT_THREADS) g[e] = o_mul(g[e], f);
}
extern "C" __global__ void __launch_bounds__(OPT_THREADS)
    scale_v1_f32(const u64* ptr, const long long* size, const int* btens, const long long* bfirst, float f) {
    scale_body<float>(ptr, size, btens, bfirst, f);
}
extern "C" __global__ void __launch_bounds__(OPT_THREADS)
    scale_v1_f64(const u64* ptr, const long long* size, const int* btens, const long long* bfirst, double f) {
    scale_body<double>(ptr, size, btens, bfirst, f);
}

// a fixed-order warp reduction (the same tree every run): sum, and max with a NaN flag
__device__ __forceinline__ double o_warp_sum(double s) {
    for (int o = 16; o > 0; o >>= 1) s = o_add(s, __shfl_xor_sync(0xffffffffu, s, o));
    return s;
}
__device__ __forceinline__ double o_warp_max(double x) {
    for (int o = 16; o > 0; o >>= 1) x = fmax(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
__device__ __forceinline__ int o_warp_any(int f) {
    for (int o = 16; o > 0; o >>= 1) f |= __shfl_xor_sync(0xffffffffu, f, o);
    return f;
}

// partials of each block: psum[b] = sum of g^2 over its chunk (float64), pmax[b] = max |g| (NaN if any NaN);
// grid nb, OPT_THREADS threads; ptr (1, N)
template <class T>
__device__ __forceinline__ void stats_body(const u64* __restrict__ ptr, const long long* __restrict__ size,
                                           const int* __restrict__ btens, const long long* __restrict__ bfirst,
                                           double* __restrict__ psum, double* __restrict__ pmax) {
    __shared__ double ws[OPT_THREADS / 32], wm[OPT_THREADS / 32];
    __shared__ int wn[OPT_THREADS / 32];
    const int t = btens[blockIdx.x], lane = threadIdx.x % 32, w = threadIdx.x / 32;
    const long long e0 = bfirst[blockIdx.x], e1 = min(size[t], e0 + OPT_CHUNK);
    const T* __restrict__ g = (const T*)ptr[t];
    double s = 0.0, mx = 0.0;
    int nan = 0;
#pragma unroll 4
    for (long long e = e0 + threadIdx.x; e < e1; e += OPT_THREADS) {
        const double x = (double)g[e];
        s = o_add(s, o_mul(x, x));                    // x x exact for float32 g (float64 g: NumPy's g²)
        const double a = fabs(x);
        nan |= a != a;
        mx = fmax(mx, a);                             // (fmax ignores a NaN: the flag keeps it)
    }
    s = o_warp_sum(s);
    mx = o_warp_max(mx);
    nan = o_warp_any(nan);
    if (lane == 0) { ws[w] = s; wm[w] = mx; wn[w] = nan; }
    __syncthreads();
    if (threadIdx.x == 0) {
        double S = 0.0, M = 0.0;
        int any = 0;
        for (int k = 0; k < OPT_THREADS / 32; k++) { S = o_add(S, ws[k]); M = fmax(M, wm[k]); any |= wn[k]; }
        psum[blockIdx.x] = S;
        pmax[blockIdx.x] = any ? (double)NAN : M;
    }
}
extern "C" __global__ void __launch_bounds__(OPT_THREADS)
    grad_stats_partial_v1_f32(const u64* ptr, const long long* size, const int* btens, const long long* bfirst,
                              double* psum, double* pmax) {
    stats_body<float>(ptr, size, btens, bfirst, psum, pmax);
}
extern "C" __global__ void __launch_bounds__(OPT_THREADS)
    grad_stats_partial_v1_f64(const u64* ptr, const long long* size, const int* btens, const long long* bfirst,
                              double* psum, double* pmax) {
    stats_body<double>(ptr, size, btens, bfirst, psum, pmax);
}

// out[t] = (sum of tensor t's psum, max of its pmax), a warp per tensor: lane l takes its blocks l, l + 32, ... in
// order, then the fixed tree; grid ceil(N / (OPT_THREADS / 32)), OPT_THREADS threads
extern "C" __global__ void __launch_bounds__(OPT_THREADS)
    grad_stats_final_v1(const double* __restrict__ psum, const double* __restrict__ pmax, const int* __restrict__ first,
                        int N, double* __restrict__ out) {
    const int t = blockIdx.x * (OPT_THREADS / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (t >= N) return;                               // (a whole warp leaves together)
    double s = 0.0, mx = 0.0;
    int nan = 0;
    for (int b = first[t] + lane; b < first[t + 1]; b += 32) {
        s = o_add(s, psum[b]);
        nan |= pmax[b] != pmax[b];
        mx = fmax(mx, pmax[b]);
    }
    s = o_warp_sum(s);
    mx = o_warp_max(mx);
    nan = o_warp_any(nan);
    if (lane == 0) {
        out[2 * t] = s;
        out[2 * t + 1] = nan ? (double)NAN : mx;
    }
}

#ifdef HOST_CODE
// ----------------------------------------------------------------------------------------------------------------
// main: host loops of the same operations (bit for bit), float64 sums for the statistics

struct Tables {
    int N, nb;
    std::vector<long long> size, bfirst;
    std::vector<int> btens, first;
    long long *d_size, *d_bfirst;
    int *d_btens, *d_first;
};

static Tables make_tables(const std::vector<long long>& sizes) {
    Tables tb;
    tb.N = (int)sizes.size();
    tb.size = sizes;
    for (int t = 0; t < tb.N; t++) {
        tb.first.push_back((int)tb.btens.size());
        for (long long e = 0; e < sizes[t]; e += OPT_CHUNK) { tb.btens.push_back(t); tb.bfirst.push_back(e); }
    }
    tb.first.push_back((int)tb.btens.size());
    tb.nb = (int)tb.btens.size();
    cudaCheck(cudaMalloc(&tb.d_size, tb.N * 8)); cudaCheck(cudaMalloc(&tb.d_bfirst, std::max(1, tb.nb) * 8));
    cudaCheck(cudaMalloc(&tb.d_btens, std::max(1, tb.nb) * 4)); cudaCheck(cudaMalloc(&tb.d_first, (tb.N + 1) * 4));
    cudaCheck(cudaMemcpy(tb.d_size, tb.size.data(), tb.N * 8, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(tb.d_bfirst, tb.bfirst.data(), tb.nb * 8, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(tb.d_btens, tb.btens.data(), tb.nb * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(tb.d_first, tb.first.data(), (tb.N + 1) * 4, cudaMemcpyHostToDevice));
    return tb;
}

template <class T> struct Hyper { T b1, omb1, b2, omb2, eps, lr, wd, dfac, step, bc2; };

template <class T>
static void adamw_host(T* p, const T* g, T* m, T* v, long long n, bool dec, const Hyper<T>& h, bool correct) {
    for (long long e = 0; e < n; e++) {                 // refbert.optim.AdamW.step's NumPy lines, in their order
        m[e] = m[e] * h.b1;
        m[e] = m[e] + h.omb1 * g[e];
        v[e] = v[e] * h.b2;
        v[e] = v[e] + h.omb2 * (g[e] * g[e]);
        if (correct) {
            if (dec) p[e] = p[e] * h.dfac;
            const T den = std::sqrt(v[e]) / h.bc2 + h.eps;
            p[e] = p[e] - h.step * (m[e] / den);
        } else {
            T u = m[e] / (std::sqrt(v[e]) + h.eps);
            if (dec) u = u + h.wd * p[e];
            p[e] = p[e] - h.lr * u;
        }
    }
}

template <class T> static void launch_adamw(const Tables& tb, const u64* dptr, const int* ddec, const Hyper<T>& h,
                                            int correct);
template <> void launch_adamw<float>(const Tables& tb, const u64* dptr, const int* ddec, const Hyper<float>& h,
                                     int correct) {
    LAUNCH(adamw_v1_f32, tb.nb, OPT_THREADS, dptr, tb.d_size, tb.d_btens, tb.d_bfirst, ddec, tb.N, h.b1, h.omb1, h.b2,
           h.omb2, h.eps, h.lr, h.wd, h.dfac, h.step, h.bc2, correct);
}
template <> void launch_adamw<double>(const Tables& tb, const u64* dptr, const int* ddec, const Hyper<double>& h,
                                      int correct) {
    LAUNCH(adamw_v1_f64, tb.nb, OPT_THREADS, dptr, tb.d_size, tb.d_btens, tb.d_bfirst, ddec, tb.N, h.b1, h.omb1,
           h.b2, h.omb2, h.eps, h.lr, h.wd, h.dfac, h.step, h.bc2, correct);
}

template <class T>
static void check_adamw(const char* tname, const std::vector<long long>& sizes, int correct, int steps) {
    Tables tb = make_tables(sizes);
    const int N = tb.N;
    std::vector<std::vector<T>> P(N), G(N), M(N), V(N);
    std::vector<u64> hptr(4 * N);
    std::vector<int> dec(N);
    std::vector<T*> dP(N), dG(N), dM(N), dV(N);
    for (int t = 0; t < N; t++) {
        const long long n = sizes[t];
        float* r = make_random_float(std::max(1LL, n), 11 + t);
        P[t].assign(r, r + n); M[t].assign(n, T(0)); V[t].assign(n, T(0)); G[t].resize(n);
        free(r);
        dec[t] = t % 3 != 1;                                  // some tensors exempt from the decay
        const size_t nbytes = std::max(1LL, n) * sizeof(T);   // (a tensor of no elements gets a byte-sized buffer)
        cudaCheck(cudaMalloc(&dP[t], nbytes)); cudaCheck(cudaMalloc(&dG[t], nbytes));
        cudaCheck(cudaMalloc(&dM[t], nbytes)); cudaCheck(cudaMalloc(&dV[t], nbytes));
        cudaCheck(cudaMemcpy(dP[t], P[t].data(), n * sizeof(T), cudaMemcpyHostToDevice));
        cudaCheck(cudaMemset(dM[t], 0, nbytes)); cudaCheck(cudaMemset(dV[t], 0, nbytes));
        hptr[t] = (u64)dP[t]; hptr[N + t] = (u64)dG[t]; hptr[2 * N + t] = (u64)dM[t]; hptr[3 * N + t] = (u64)dV[t];
    }
    u64* dptr;
    int* ddec;
    cudaCheck(cudaMalloc(&dptr, 4 * N * 8)); cudaCheck(cudaMalloc(&ddec, N * 4));
    cudaCheck(cudaMemcpy(dptr, hptr.data(), 4 * N * 8, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(ddec, dec.data(), N * 4, cudaMemcpyHostToDevice));
    const double b1 = 0.9, b2 = 0.999, eps = 1e-6, wd = 0.01;
    for (int s = 1; s <= steps; s++) {
        const double lr = 1e-3 * s;                           // a schedule: the scalars change every step
        Hyper<T> h{(T)b1, (T)(1.0 - b1), (T)b2, (T)(1.0 - b2), (T)eps, (T)lr, (T)wd, (T)(1.0 - lr * wd),
                   (T)(lr / (1.0 - std::pow(b1, s))), (T)std::sqrt(1.0 - std::pow(b2, s))};
        for (int t = 0; t < N; t++) {
            float* r = make_random_float(std::max(1LL, sizes[t]), 100 * s + t);
            for (long long e = 0; e < sizes[t]; e++) G[t][e] = (T)(r[e] * (e % 7 == 0 ? 1e-3f : 1.f));
            free(r);
            cudaCheck(cudaMemcpy(dG[t], G[t].data(), sizes[t] * sizeof(T), cudaMemcpyHostToDevice));
            adamw_host<T>(P[t].data(), G[t].data(), M[t].data(), V[t].data(), sizes[t], dec[t], h, correct);
        }
        launch_adamw<T>(tb, dptr, ddec, h, correct);
        cudaCheck(cudaDeviceSynchronize());
    }
    bool same = true;
    for (int t = 0; t < N; t++) {
        std::vector<T> a(sizes[t]), b(sizes[t]), c(sizes[t]);
        cudaCheck(cudaMemcpy(a.data(), dP[t], sizes[t] * sizeof(T), cudaMemcpyDeviceToHost));
        cudaCheck(cudaMemcpy(b.data(), dM[t], sizes[t] * sizeof(T), cudaMemcpyDeviceToHost));
        cudaCheck(cudaMemcpy(c.data(), dV[t], sizes[t] * sizeof(T), cudaMemcpyDeviceToHost));
        const size_t nb = sizes[t] * sizeof(T);
        if (std::memcmp(a.data(), P[t].data(), nb) || std::memcmp(b.data(), M[t].data(), nb) ||
            std::memcmp(c.data(), V[t].data(), nb)) {
            for (long long e = 0; e < sizes[t]; e++)
                if (a[e] != P[t][e]) { printf("  p mismatch: tensor %d element %lld: %.9g vs %.9g\n", t, e,
                                              (double)a[e], (double)P[t][e]); break; }
            same = false;
        }
    }
    printf("adamw_v1_%s (%s, %d tensors, %d steps) = the host loop bit for bit (p, m, v): %s\n", tname,
           correct ? "correct_bias" : "google", N, steps, same ? "yes" : "NO");
    if (!same) exit(EXIT_FAILURE);
#ifndef CPUSIM_SMALL
    if (sizeof(T) == 4) {                                      // time one step over every tensor
        Hyper<T> h{(T)b1, (T)(1.0 - b1), (T)b2, (T)(1.0 - b2), (T)eps, (T)1e-4, (T)wd, (T)(1.0 - 1e-6), (T)1e-4, (T)1};
        long long n = 0;
        for (long long x : sizes) n += x;
        const float ms = benchmark_kernel(20, [&]() { launch_adamw<T>(tb, dptr, ddec, h, correct); });
        printf("  %lld elements: %.4f ms, %.0f GB/s (28 bytes an element)\n", n, ms, n * 28.0 / ms / 1e6);
    }
#endif
    for (int t = 0; t < N; t++) { cudaFree(dP[t]); cudaFree(dG[t]); cudaFree(dM[t]); cudaFree(dV[t]); }
    cudaFree(dptr); cudaFree(ddec);
}

template <class T>
static void check_stats_and_scale(const char* tname, const std::vector<long long>& sizes) {
    Tables tb = make_tables(sizes);
    const int N = tb.N;
    std::vector<std::vector<T>> G(N);
    std::vector<u64> hptr(N);
    for (int t = 0; t < N; t++) {
        float* r = make_random_float(std::max(1LL, sizes[t]), 7 + t);
        G[t].assign(r, r + sizes[t]);
        free(r);
        if (t == 1 && sizes[t] > 3) G[t][3] = (T)NAN;           // a NaN: its tensor's max must say so
        if (t == 2 && sizes[t] > 5) G[t][sizes[t] - 1] = (T)-7.5;  // the largest magnitude at the very end
        T* d;
        cudaCheck(cudaMalloc(&d, std::max(1LL, sizes[t]) * sizeof(T)));
        cudaCheck(cudaMemcpy(d, G[t].data(), sizes[t] * sizeof(T), cudaMemcpyHostToDevice));
        hptr[t] = (u64)d;
    }
    u64* dptr;
    double *psum, *pmax, *out;
    cudaCheck(cudaMalloc(&dptr, N * 8));
    cudaCheck(cudaMemcpy(dptr, hptr.data(), N * 8, cudaMemcpyHostToDevice));
    cudaCheck(cudaMalloc(&psum, std::max(1, tb.nb) * 8)); cudaCheck(cudaMalloc(&pmax, std::max(1, tb.nb) * 8));
    cudaCheck(cudaMalloc(&out, 2 * N * 8));
    auto stats = [&]() {
        if (sizeof(T) == 4)
            LAUNCH(grad_stats_partial_v1_f32, tb.nb, OPT_THREADS, dptr, tb.d_size, tb.d_btens, tb.d_bfirst, psum, pmax);
        else
            LAUNCH(grad_stats_partial_v1_f64, tb.nb, OPT_THREADS, dptr, tb.d_size, tb.d_btens, tb.d_bfirst, psum, pmax);
        const int warps = OPT_THREADS / 32;                    // a warp a tensor
        LAUNCH(grad_stats_final_v1, (N + warps - 1) / warps, OPT_THREADS, psum, pmax, tb.d_first, N, out);
    };
    if (tb.nb) stats();
    cudaCheck(cudaDeviceSynchronize());
    std::vector<double> got(2 * N);
    cudaCheck(cudaMemcpy(got.data(), out, 2 * N * 8, cudaMemcpyDeviceToHost));
    for (int t = 0; t < N; t++) {
        if (!sizes[t]) continue;
        // the reference sum compensated (Neumaier: within 2 ulp of the exact sum whatever n), the kernels' a plain
        // float64 sum of positive terms along chains of at most 16 + 5 + 8 + ceil(blocks / 32) + 5 additions
        // (< 300 for 23M elements): within 300 * 2^-53 < 4e-14 relative, so 1e-13
        double s = 0.0, c = 0.0, mx = 0.0;
        bool nan = false;
        for (T x : G[t]) {
            const double y = (double)x * (double)x, u = s + y;
            c += std::fabs(s) >= std::fabs(y) ? (s - u) + y : (y - u) + s;
            s = u;
            nan |= x != x;
            mx = std::max(mx, std::fabs((double)x));
        }
        s += c;
        const bool sum_ok = nan ? got[2 * t] != got[2 * t] : std::fabs(got[2 * t] - s) <= 1e-13 * s;
        const bool max_ok = nan ? got[2 * t + 1] != got[2 * t + 1] : got[2 * t + 1] == mx;   // a max is exact
        if (!sum_ok || !max_ok) {
            printf("  stats mismatch: tensor %d: sum %.17g vs %.17g, max %.9g vs %.9g\n", t, got[2 * t], s,
                   got[2 * t + 1], mx);
            exit(EXIT_FAILURE);
        }
    }
    printf("grad_stats_v1_%s (%d tensors, a NaN among them): sums to 1e-13, maxima exact: ok\n", tname, N);
    // scale: g f bit for bit
    const T f = (T)0.123456789;
    if (tb.nb) {
        if (sizeof(T) == 4)
            LAUNCH(scale_v1_f32, tb.nb, OPT_THREADS, dptr, tb.d_size, tb.d_btens, tb.d_bfirst, (float)f);
        else
            LAUNCH(scale_v1_f64, tb.nb, OPT_THREADS, dptr, tb.d_size, tb.d_btens, tb.d_bfirst, (double)f);
    }
    cudaCheck(cudaDeviceSynchronize());
    bool same = true;
    for (int t = 0; t < N; t++) {
        std::vector<T> a(sizes[t]);
        cudaCheck(cudaMemcpy(a.data(), (T*)hptr[t], sizes[t] * sizeof(T), cudaMemcpyDeviceToHost));
        for (long long e = 0; e < sizes[t]; e++) {
            const T want = G[t][e] * f;
            if (std::memcmp(&a[e], &want, sizeof(T)) && !(want != want && a[e] != a[e])) same = false;
        }
    }
    printf("scale_v1_%s = g f bit for bit: %s\n", tname, same ? "yes" : "NO");
    if (!same) exit(EXIT_FAILURE);
#ifndef CPUSIM_SMALL
    if (sizeof(T) == 4) {
        long long n = 0;
        for (long long x : sizes) n += x;
        const float ms = benchmark_kernel(20, stats);
        printf("  stats of %lld elements: %.4f ms, %.0f GB/s\n", n, ms, n * 4.0 / ms / 1e6);
    }
#endif
    // (the tensors freed only now: the timing above reads them; freed before it, as they once were, the timed
    // launches read freed memory: an illegal address on the H200 of 2026-11-27)
    for (int t = 0; t < N; t++) cudaFree((T*)hptr[t]);
    cudaFree(dptr); cudaFree(psum); cudaFree(pmax); cudaFree(out);
}

int main() {
    // tails everywhere: a tensor of one element, none, a chunk and one, several chunks, a warp's worth
    std::vector<long long> sizes = {1, 5, 0, OPT_CHUNK + 1, 3 * OPT_CHUNK - 17, 33, 768};
#ifndef CPUSIM_SMALL
    // BERT-base's tensors at their sizes (one layer of each kind, the embeddings): the timing
    std::vector<long long> big = {30522LL * 768, 512 * 768, 2 * 768, 768, 768};
    for (int l = 0; l < 12; l++)
        for (long long x : {768LL * 768, 768LL, 768LL * 768, 768LL, 768LL * 768, 768LL, 768LL * 768, 768LL, 768LL,
                            768LL, 3072LL * 768, 3072LL, 768LL * 3072, 768LL, 768LL, 768LL})
            big.push_back(x);
    sizes.insert(sizes.end(), big.begin(), big.end());
#endif
    for (int correct = 0; correct < 2; correct++) {
        check_adamw<float>("f32", sizes, correct, 3);
        check_adamw<double>("f64", sizes, correct, 3);
    }
    check_stats_and_scale<float>("f32", sizes);
    check_stats_and_scale<double>("f64", sizes);
    printf("optim: every version ok\n");
    return 0;
}
#endif
