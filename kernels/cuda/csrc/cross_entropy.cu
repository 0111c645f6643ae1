/*
Mean softmax cross-entropy over the rows whose label is not ignore_index (torch's F.cross_entropy), float32, with
no host round trip: the kept rows are found on the device, the loss and its count stay there.
Oracle: refbert.ops.cross_entropy_forward / cross_entropy_backward (Python launchers: kernels/cuda/cuda_c.py; the
Numba versions and the math: kernels/cuda/cross_entropy.py).
    z, dz: (N, V) contiguous rows   y: (N,) int64 labels in [0, V) or ignore   m, s, term: (N,)   kept: (N,) int
    forward, per row r with y[r] != ignore:  m = max(z);  s = log(sum exp(z - m));  term = s - (z[y] - m)
                                             (= lse - z[y], no cancellation of lse against a 1e4 logit)
             rows with y[r] == ignore: term = 0, kept = 0;  a label outside [0, V): term = NaN (a loud loss)
             loss = (sum of terms, in row order, in double) / n, n = number of kept rows (0 when n = 0);
             count = n (float)
    backward, per row:  dz = (exp(z - m - s) - onehot(y)) * dloss / n;  ignored rows: 0 (written, not memset)
             dloss is read from device memory (dloss_on_dev: the loss's own gradient array) or passed by value
A NaN anywhere in a kept row makes its m NaN (so the loss is NaN, as in PyTorch; the oracle raises a ValueError,
which the launcher does only where the logits are on the host, or with REFBERT_CUDA_CHECKS=1).

Versions:
  1  a block of 256 threads per row, one pass: each thread keeps an online (max, sum) over its strided elements
     (float4 when vec: V % 4 == 0 and aligned pointers), merged across lanes by shuffles and across the 8 warps
     in warp order through shared memory (deterministic); a one-block kernel sums the terms in a fixed order;
     the backward a block per row. expf, logf (not __expf): the oracle's float32 tolerance.
  2  the forward with each row split across `splits` blocks (grid N x splits: a row's chunk of ceil(V / splits)
     columns each, its online (max, sum) merged in warp order as version 1's), then a thread per row merges the
     chunks' pairs in chunk order and writes what version 1 writes: for few rows (the MLM rows of a small batch)
     version 1 runs N blocks on a GPU with over a hundred SMs; the launcher takes splits = 1 (version 1's
     kernel) once N fills the GPU. Deterministic: every merge in a fixed order.
  3  version 2 in one launch: ce_part_v2's blocks, every one (an ignored row's too) then taking a ticket from a
     counter; the block holding the last ticket merges each row's chunk pairs in chunk order and sums the loss as
     ce_fin_v2 and ce_loss_v1 do (thread t: rows t, t + 256, ..., then the same tree), and puts the counter back to
     0 for the next call. Version 2's three launches, each waiting for the one before to drain, become one (the
     pattern of the CUDA samples' threadFenceReduction: a __threadfence before the ticket, the other blocks' pairs
     read through L2). The same values in the same order: version 2's m, s, term, kept, loss and count bit for bit
     (the main compares them, at splits 1, 2, 3 and 8, twice in a row: the counter reset). One counter per device
     (the launcher's): calls on two streams at once would share it.
  mixed precision (the backward's rk >= 0): dz rounded to the compute dtype in the kernel with its twin (o16), the
     logits read from the 16-bit storage the forward's input already had (z16: IN16), the same values

Build and run standalone (validates against the CPU reference, then times):
    nvcc -O3 -arch=sm_90 -std=c++17 -o cross_entropy cross_entropy.cu && ./cross_entropy
On CPU threads:  g++ -std=c++20 -O1 -pthread -ffp-contract=off -DCPUSIM -DCPUSIM_SMALL -x c++ cross_entropy.cu -o c && ./c
*/
#include "common.cuh"

__device__ __forceinline__ void ce_online(float z, float& m, float& s, bool& nan) {
    if (z != z) nan = true;
    else if (z > m) { s = s * expf(m - z) + 1.f; m = z; }         // m = -inf at first: expf(-inf) = 0
    else if (z > -INFINITY) s += expf(z - m);
}
__device__ __forceinline__ void ce_merge(float& m, float& s, float m2, float s2) {
    const float mn = fmaxf(m, m2);
    s = mn > -INFINITY ? (m > -INFINITY ? s * expf(m - mn) : 0.f) + (m2 > -INFINITY ? s2 * expf(m2 - mn) : 0.f) : 0.f;
    m = mn;
}

// a block's online pairs merged: lanes by shuffles, then the 8 warps in warp order through shared memory (the same
// order every run); thread 0 gets the block's (m, s), and the return says whether any thread saw a NaN (there)
__device__ __forceinline__ bool ce_block_merge(float& m, float& s, bool nan, float* wm, float* ws, int* wnan) {
    const int t = threadIdx.x, lane = t & 31, w = t >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        ce_merge(m, s, m2, s2);
    }
    nan = __any_sync(0xffffffffu, nan);
    if (lane == 0) { wm[w] = m; ws[w] = s; wnan[w] = nan; }
    __syncthreads();
    bool bad = false;
    if (t == 0) {
        m = wm[0]; s = ws[0];
        for (int k = 0; k < 8; k++) {
            if (k) ce_merge(m, s, wm[k], ws[k]);
            bad |= wnan[k] != 0;
        }
    }
    return bad;
}

// thread t's online pair over columns [j0, j1) of row zr, strided by the block (float4 when vec: j0, j1 % 4 == 0)
__device__ __forceinline__ void ce_scan(const float* zr, int j0, int j1, int vec, float& m, float& s, bool& nan) {
    const int t = threadIdx.x;
    if (vec) {
        for (int j = j0 + 4 * t; j < j1; j += 1024) {
            const float4 v = ld4(zr + j);
            ce_online(v.x, m, s, nan); ce_online(v.y, m, s, nan); ce_online(v.z, m, s, nan); ce_online(v.w, m, s, nan);
        }
    } else {
        for (int j = j0 + t; j < j1; j += 256) ce_online(zr[j], m, s, nan);
    }
}

extern "C" __global__ void __launch_bounds__(256) ce_fwd_v1(const float* __restrict__ z,
                                                            const long long* __restrict__ y, int N, int V,
                                                            long long ignore, int vec, float* __restrict__ m_out,
                                                            float* __restrict__ s_out, float* __restrict__ term,
                                                            int* __restrict__ kept) {
    __shared__ float wm[8], ws[8];
    __shared__ int wnan[8];
    const int r = blockIdx.x, t = threadIdx.x;
    const long long label = y[r];
    if (label == ignore) {                                         // block-uniform
        if (t == 0) { m_out[r] = 0.f; s_out[r] = 0.f; term[r] = 0.f; kept[r] = 0; }
        return;
    }
    const float* zr = z + (size_t)r * V;
    float m = -INFINITY, s = 0.f;
    bool nan = false;
    ce_scan(zr, 0, V, vec, m, s, nan);
    const bool bad = ce_block_merge(m, s, nan, wm, ws, wnan);
    if (t == 0) {
        if (bad) m = NAN;
        const float ls = logf(s);
        m_out[r] = m;
        s_out[r] = ls;
        term[r] = (label >= 0 && label < V) ? ls - (zr[label] - m) : NAN;
        kept[r] = 1;
    }
}

// version 2: ce_part_v2, grid (N, splits): block (r, k) reduces columns [k cw, min(V, (k + 1) cw)) of row r to its
// online pair (m, s) (m NaN when a NaN was seen); ce_fin_v2, a thread per row, merges the row's pairs in k order

// block (r, k)'s chunk of row r, columns [k cw, min(V, (k + 1) cw)), reduced to its online pair, written to
// (pm, ps)[r splits + k] (m NaN when a NaN was seen); ignored rows write nothing (block-uniform)
__device__ __forceinline__ void ce_part(const float* __restrict__ z, const long long* __restrict__ y, int V,
                                        long long ignore, int cw, int vec, float* pm, float* ps) {
    __shared__ float wm[8], ws[8];
    __shared__ int wnan[8];
    const int r = blockIdx.x, k = blockIdx.y, splits = gridDim.y;
    if (y[r] == ignore) return;
    const float* zr = z + (size_t)r * V;
    const int j0 = k * cw, j1 = min(V, j0 + cw);
    float m = -INFINITY, s = 0.f;
    bool nan = false;
    ce_scan(zr, j0, j1, vec, m, s, nan);                           // (vec: cw % 4 == 0 and V % 4 == 0)
    const bool bad = ce_block_merge(m, s, nan, wm, ws, wnan);
    if (threadIdx.x == 0) {
        pm[(size_t)r * splits + k] = bad ? NAN : m;
        ps[(size_t)r * splits + k] = s;
    }
}

extern "C" __global__ void __launch_bounds__(256) ce_part_v2(const float* __restrict__ z,
                                                             const long long* __restrict__ y, int V, long long ignore,
                                                             int cw, int vec, float* __restrict__ pm,
                                                             float* __restrict__ ps) {
    ce_part(z, y, V, ignore, cw, vec, pm, ps);                      // (ce_fin_v2 writes an ignored row)
}

// row r's chunk pairs merged in chunk order: what ce_fwd_v1 writes for the row (m, log s, term, kept), and the term
// returned; L2: the pairs read through L2 (__ldcg: version 3's last block reads what other blocks wrote)
template <bool L2>
__device__ __forceinline__ float ce_fin_row(const float* __restrict__ z, long long label, int r, int V,
                                            long long ignore, int splits, const float* pm, const float* ps,
                                            float* __restrict__ m_out, float* __restrict__ s_out,
                                            float* __restrict__ term, int* __restrict__ kept) {
    if (label == ignore) { m_out[r] = 0.f; s_out[r] = 0.f; term[r] = 0.f; kept[r] = 0; return 0.f; }
    float m = -INFINITY, s = 0.f;
    bool bad = false;
    for (int k = 0; k < splits; k++) {
        const size_t e = (size_t)r * splits + k;
        const float m2 = L2 ? __ldcg(pm + e) : pm[e], s2 = L2 ? __ldcg(ps + e) : ps[e];
        if (m2 != m2) bad = true;
        else ce_merge(m, s, m2, s2);
    }
    if (bad) m = NAN;
    const float ls = logf(s);
    const float t = (label >= 0 && label < V) ? ls - (z[(size_t)r * V + label] - m) : NAN;
    m_out[r] = m;
    s_out[r] = ls;
    term[r] = t;
    kept[r] = 1;
    return t;
}

extern "C" __global__ void __launch_bounds__(256) ce_fin_v2(const float* __restrict__ z,
                                                            const long long* __restrict__ y, int N, int V,
                                                            long long ignore, int splits,
                                                            const float* __restrict__ pm, const float* __restrict__ ps,
                                                            float* __restrict__ m_out, float* __restrict__ s_out,
                                                            float* __restrict__ term, int* __restrict__ kept) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= N) return;
    ce_fin_row<false>(z, y[r], r, V, ignore, splits, pm, ps, m_out, s_out, term, kept);
}

// loss = sum(term) / n in a fixed order (thread t sums rows t, t + 256, ...; then a tree), count = n: from the
// thread's (sum, count) on (ce_loss_v1 and version 3's last block)
__device__ __forceinline__ void ce_loss_tree(double tot, int n, float* __restrict__ loss, float* __restrict__ count) {
    __shared__ double tb[256];
    __shared__ int kb[256];
    const int t = threadIdx.x;
    tb[t] = tot;
    kb[t] = n;
    __syncthreads();
    for (int h = 128; h > 0; h >>= 1) {
        if (t < h) { tb[t] += tb[t + h]; kb[t] += kb[t + h]; }
        __syncthreads();
    }
    if (t == 0) {
        loss[0] = kb[0] ? (float)(tb[0] / kb[0]) : 0.f;
        count[0] = (float)kb[0];
    }
}

extern "C" __global__ void __launch_bounds__(256) ce_loss_v1(const float* __restrict__ term,
                                                             const int* __restrict__ kept, int N,
                                                             float* __restrict__ loss, float* __restrict__ count) {
    double tot = 0.0;
    int n = 0;
    for (int r = threadIdx.x; r < N; r += 256) { tot += term[r]; n += kept[r]; }
    ce_loss_tree(tot, n, loss, count);
}

// version 3: grid (N, splits) as ce_part_v2, then the last block to finish (done: a zeroed counter) does ce_fin_v2
// and ce_loss_v1's work and zeroes the counter
extern "C" __global__ void __launch_bounds__(256) ce_fwd_v3(const float* __restrict__ z,
                                                            const long long* __restrict__ y, int N, int V,
                                                            long long ignore, int cw, int vec, float* pm, float* ps,
                                                            float* __restrict__ m_out, float* __restrict__ s_out,
                                                            float* __restrict__ term, int* __restrict__ kept,
                                                            float* __restrict__ loss, float* __restrict__ count,
                                                            unsigned int* done) {
    __shared__ int last;
    const int splits = gridDim.y, t = threadIdx.x;
    ce_part(z, y, V, ignore, cw, vec, pm, ps);                      // (ce_part_v2's work)
    if (t == 0) {
        __threadfence();                                            // the pair visible before the ticket
        last = atomicAdd(done, 1u) == (unsigned int)(N * splits - 1);
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    double tot = 0.0;
    int n = 0;
    for (int rr = t; rr < N; rr += 256) {                           // ce_fin_v2's rows, in ce_loss_v1's order
        tot += ce_fin_row<true>(z, y[rr], rr, V, ignore, splits, pm, ps, m_out, s_out, term, kept);
        n += y[rr] != ignore;
    }
    ce_loss_tree(tot, n, loss, count);
    if (t == 0) *done = 0u;                                         // for the next call
}

// rk >= 0 (mixed precision): z comes from z16 when IN16 (the forward's logits kept in 16 bits; z is not read), dz
// is written rounded to the compute dtype (the spec's rounding of an activation's gradient) and, o16 non-null, its
// twin beside it; rk = -1: float32, as before
template <int IN16>
__device__ __forceinline__ void ce_bwd(const float* __restrict__ z, const long long* __restrict__ y, int N, int V,
                                       long long ignore, int vec, const float* __restrict__ m_in,
                                       const float* __restrict__ s_in, const float* __restrict__ count,
                                       const float* __restrict__ dloss_ptr, int dloss_on_dev, float dloss_val,
                                       float* __restrict__ dz, int rk, const unsigned short* __restrict__ z16,
                                       unsigned short* __restrict__ o16) {
    const int r = blockIdx.x, t = threadIdx.x;
    const long long label = y[r];
    const size_t row = (size_t)r * V;
    float* dr = dz + row;
    unsigned short* const t16 = rk >= 0 && o16 ? o16 + row : nullptr;    // the twin's row (or none)
    if (label == ignore) {
        if (vec) {
            for (int j = 4 * t; j < V; j += 1024) {
                st4(dr + j, make_float4(0.f, 0.f, 0.f, 0.f));
                put16x4(t16, j, make_float4(0.f, 0.f, 0.f, 0.f), rk);
            }
        } else {
            for (int j = t; j < V; j += 256) { dr[j] = 0.f; put16(t16, j, 0.f, rk); }
        }
        return;
    }
    const float g = (dloss_on_dev ? dloss_ptr[0] : dloss_val) / fmaxf(count[0], 1.f);
    const float m = m_in[r], s = s_in[r];
    const bool ok = label >= 0 && label < V;
    if (vec) {
        for (int j = 4 * t; j < V; j += 1024) {
            const float4 v = ld_in4<IN16>(z, z16, row + j, rk);
            float4 o = make_float4(expf((v.x - m) - s), expf((v.y - m) - s), expf((v.z - m) - s), expf((v.w - m) - s));
            if (j == label) o.x -= 1.f;
            if (j + 1 == label) o.y -= 1.f;
            if (j + 2 == label) o.z -= 1.f;
            if (j + 3 == label) o.w -= 1.f;
            const float4 d = rnd4(ok ? make_float4(o.x * g, o.y * g, o.z * g, o.w * g)
                                     : make_float4(NAN, NAN, NAN, NAN), rk);
            st4(dr + j, d);
            put16x4(t16, j, d, rk);
        }
    } else {
        for (int j = t; j < V; j += 256) {
            const float p = expf((ld_in<IN16>(z, z16, row + j, rk) - m) - s) - (j == label ? 1.f : 0.f);
            const float d = rnd(ok ? p * g : NAN, rk);                // (z - m first: m + s would round away s's
            dr[j] = d;                                                // bits near a 1e4 logit)
            put16(t16, j, d, rk);
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) ce_bwd_v1(const float* __restrict__ z,
                                                            const long long* __restrict__ y, int N, int V,
                                                            long long ignore, int vec, const float* __restrict__ m_in,
                                                            const float* __restrict__ s_in,
                                                            const float* __restrict__ count,
                                                            const float* __restrict__ dloss_ptr, int dloss_on_dev,
                                                            float dloss_val, float* __restrict__ dz, int rk,
                                                            const unsigned short* __restrict__ z16,
                                                            unsigned short* __restrict__ o16) {
    RK16_DISPATCH(z16 != nullptr, ce_bwd<IN16>(z, y, N, V, ignore, vec, m_in, s_in, count, dloss_ptr, dloss_on_dev,
                                               dloss_val, dz, RKC, z16, o16))
}

#ifdef HOST_CODE
int main() {
#ifdef CPUSIM_SMALL
    const int shapes[][2] = {{1, 1}, {5, 33}, {7, 1028}, {3, 13}};
#else
    const int shapes[][2] = {{1, 7}, {37, 52}, {15, 1031}, {6, 600}, {77, 30522}, {614, 30522}, {4096, 30522}};
#endif
    const long long ignore = -100;
    for (int si = 0; si < (int)(sizeof(shapes) / sizeof(shapes[0])); si++) {
        const int N = shapes[si][0], V = shapes[si][1];
        const size_t n = (size_t)N * V;
        const int vec = (V & 3) == 0;
        float *z = make_random_float(n, 1), *dl = make_random_float(1, 5);
        for (size_t i = 0; i < n; i++) z[i] *= 8.f;
        std::vector<long long> y(N);
        int kept_n = 0;
        for (int r = 0; r < N; r++) {
            y[r] = (si == 3 || (r % 3 == 1)) ? ignore : (r * 7919) % V;   // the last shape ignores every row
            kept_n += y[r] != ignore;
        }
        if (N > 1) z[(size_t)1 * V + 0] = 1e4f;                        // a large logit (its row is ignored or not)
        std::vector<float> dz(n, 0.f);
        double tot = 0;
        for (int r = 0; r < N; r++) {
            if (y[r] == ignore) continue;
            double mx = -INFINITY, s = 0;
            for (int j = 0; j < V; j++) mx = fmax(mx, z[(size_t)r * V + j]);
            for (int j = 0; j < V; j++) s += exp(z[(size_t)r * V + j] - mx);
            tot += log(s) - (z[(size_t)r * V + y[r]] - mx);
            for (int j = 0; j < V; j++)
                dz[(size_t)r * V + j] = (float)((exp(z[(size_t)r * V + j] - mx) / s - (j == y[r])) * dl[0] /
                                                std::max(kept_n, 1));
        }
        float loss_ref = kept_n ? (float)(tot / kept_n) : 0.f, count_ref = (float)kept_n;
        float *dz_, *ddz, *m, *s, *term, *loss, *count, *ddl;
        long long* dy;
        int* kept;
        cudaCheck(cudaMalloc(&dz_, n * 4)); cudaCheck(cudaMalloc(&ddz, n * 4)); cudaCheck(cudaMalloc(&dy, N * 8));
        cudaCheck(cudaMalloc(&m, N * 4)); cudaCheck(cudaMalloc(&s, N * 4)); cudaCheck(cudaMalloc(&term, N * 4));
        cudaCheck(cudaMalloc(&kept, N * 4)); cudaCheck(cudaMalloc(&loss, 4)); cudaCheck(cudaMalloc(&count, 4));
        cudaCheck(cudaMalloc(&ddl, 4));
        cudaCheck(cudaMemcpy(dz_, z, n * 4, cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(dy, y.data(), N * 8, cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(ddl, dl, 4, cudaMemcpyHostToDevice));
        auto fwd = [&]() {
            LAUNCH(ce_fwd_v1, N, 256, dz_, dy, N, V, ignore, vec, m, s, term, kept);
            LAUNCH(ce_loss_v1, 1, 256, term, kept, N, loss, count);
        };
        float *pm, *ps;
        unsigned int* done;
        cudaCheck(cudaMalloc(&pm, (size_t)N * 8 * 4)); cudaCheck(cudaMalloc(&ps, (size_t)N * 8 * 4));
        cudaCheck(cudaMalloc(&done, 4));
        cudaCheck(cudaMemset(done, 0, 4));
        // m, s, term, kept, loss, count as the kernels left them (bits)
        auto outs = [&]() {
            std::vector<u32> o(4 * (size_t)N + 2);
            cudaCheck(cudaDeviceSynchronize());
            cudaCheck(cudaMemcpy(o.data(), m, N * 4, cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(o.data() + N, s, N * 4, cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(o.data() + 2 * N, term, N * 4, cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(o.data() + 3 * N, kept, N * 4, cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(o.data() + 4 * N, loss, 4, cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(o.data() + 4 * N + 1, count, 4, cudaMemcpyDeviceToHost));
            return o;
        };
        for (int splits : {1, 2, 3, 8}) {                              // version 2: the same m, s, term and loss
            const int cw = ((V + splits - 1) / splits + 3) / 4 * 4;
            const int sp = (V + cw - 1) / cw;
            LAUNCH(ce_part_v2, dim3(N, sp), 256, dz_, dy, V, ignore, cw, vec, pm, ps);
            LAUNCH(ce_fin_v2, (N + 255) / 256, 256, dz_, dy, N, V, ignore, sp, pm, ps, m, s, term, kept);
            LAUNCH(ce_loss_v1, 1, 256, term, kept, N, loss, count);
            cudaCheck(cudaDeviceSynchronize());
            printf("cross_entropy v2 N=%d V=%d splits=%d\n", N, V, sp);
            validate_result(loss, &loss_ref, "loss", 1, 1e-6f, 1e-5f);
            validate_result(count, &count_ref, "count", 1, 1e-30f, 0.f);
            LAUNCH(ce_bwd_v1, N, 256, dz_, dy, N, V, ignore, vec, m, s, count, ddl, 1, dl[0], ddz, -1,
                   (const unsigned short*)nullptr, (unsigned short*)nullptr);   // its m, s
            cudaCheck(cudaDeviceSynchronize());
            validate_result(ddz, dz.data(), "dz from its m, s", n, 1e-7f, 1e-5f);
            // version 3 (one launch, the last block finishing): version 2's bits, twice (the counter put back)
            const std::vector<u32> o2 = outs();
            bool same3 = true;
            for (int rep = 0; rep < 2; rep++) {
                cudaCheck(cudaMemset(m, 0xFF, N * 4)); cudaCheck(cudaMemset(loss, 0xFF, 4));
                LAUNCH(ce_fwd_v3, dim3(N, sp), 256, dz_, dy, N, V, ignore, cw, vec, pm, ps, m, s, term, kept, loss,
                       count, done);
                same3 &= outs() == o2;
            }
            u32 left = 1;
            cudaCheck(cudaMemcpy(&left, done, 4, cudaMemcpyDeviceToHost));
            printf("  v3 = v2 bit for bit (m, s, term, kept, loss, count; twice): %s\n",
                   same3 && left == 0 ? "yes" : "NO");
            if (!same3 || left) exit(EXIT_FAILURE);
            if (n >= (1 << 20) && N <= 1024) {
                float ms2 = benchmark_kernel(20, [&]() {
                    LAUNCH(ce_part_v2, dim3(N, sp), 256, dz_, dy, V, ignore, cw, vec, pm, ps);
                    LAUNCH(ce_fin_v2, (N + 255) / 256, 256, dz_, dy, N, V, ignore, sp, pm, ps, m, s, term, kept);
                    LAUNCH(ce_loss_v1, 1, 256, term, kept, N, loss, count); });
                float ms3 = benchmark_kernel(20, [&]() {
                    LAUNCH(ce_fwd_v3, dim3(N, sp), 256, dz_, dy, N, V, ignore, cw, vec, pm, ps, m, s, term, kept,
                           loss, count, done); });
                printf("  forward v2 %.4f ms %.0f GB/s | v3 %.4f ms %.0f GB/s\n", ms2, n * 4.0 / ms2 / 1e6, ms3,
                       n * 4.0 / ms3 / 1e6);
            }
        }
        cudaFree(pm); cudaFree(ps); cudaFree(done);
        printf("cross_entropy v1 N=%d V=%d kept=%d\n", N, V, kept_n);
        fwd();
        for (int on_dev = 0; on_dev < 2; on_dev++) {
            LAUNCH(ce_bwd_v1, N, 256, dz_, dy, N, V, ignore, vec, m, s, count, ddl, on_dev, dl[0], ddz, -1,
                   (const unsigned short*)nullptr, (unsigned short*)nullptr);
            cudaCheck(cudaDeviceSynchronize());
            // expf / logf within 2 ulp, float32 sums in another order (and an online max): 1e-5 relative
            validate_result(ddz, dz.data(), on_dev ? "dz (dloss on the device)" : "dz", n, 1e-7f, 1e-5f);
        }
        validate_result(loss, &loss_ref, "loss", 1, 1e-6f, 1e-5f);
        validate_result(count, &count_ref, "count", 1, 1e-30f, 0.f);
        {   // mixed precision (rk 0 / 1): dz rounded to the compute dtype with its twin; the logits read from their
            // 16-bit storage give the same bits as from float32 (the grid's values both ways)
            std::vector<float> zr(n), d1(n), d2(n);
            std::vector<unsigned short> zb(n), t1(n), t2(n);
            unsigned short *z16, *o16;
            cudaCheck(cudaMalloc(&z16, n * 2)); cudaCheck(cudaMalloc(&o16, n * 2));
            size_t bad = 0;
            for (int rk = 0; rk < 2; rk++) {
                for (size_t e = 0; e < n; e++) { zr[e] = round_kind(z[e], rk); zb[e] = bits16(zr[e], rk); }
                cudaCheck(cudaMemcpy(dz_, zr.data(), n * 4, cudaMemcpyHostToDevice));
                cudaCheck(cudaMemcpy(z16, zb.data(), n * 2, cudaMemcpyHostToDevice));
                fwd();
                LAUNCH(ce_bwd_v1, N, 256, dz_, dy, N, V, ignore, vec, m, s, count, ddl, 1, dl[0], ddz, rk,
                       (const unsigned short*)nullptr, o16);
                cudaCheck(cudaMemcpy(d1.data(), ddz, n * 4, cudaMemcpyDeviceToHost));
                cudaCheck(cudaMemcpy(t1.data(), o16, n * 2, cudaMemcpyDeviceToHost));
                cudaCheck(cudaMemset(ddz, 0, n * 4));
                LAUNCH(ce_bwd_v1, N, 256, dz_, dy, N, V, ignore, vec, m, s, count, ddl, 1, dl[0], ddz, rk,
                       (const unsigned short*)z16, o16);
                cudaCheck(cudaMemcpy(d2.data(), ddz, n * 4, cudaMemcpyDeviceToHost));
                cudaCheck(cudaMemcpy(t2.data(), o16, n * 2, cudaMemcpyDeviceToHost));
                for (size_t e = 0; e < n; e++)
                    bad += (BITS_F(d1[e]) != BITS_F(d2[e])) + (t1[e] != t2[e]) + (t1[e] != bits16(d1[e], rk)) +
                           (round_kind(d1[e], rk) != d1[e] && d1[e] == d1[e]);
            }
            printf("  mixed dz (rounded, twin; logits kept in 16 bits): %s\n", bad ? "WRONG" : "the same bits");
            if (bad) exit(EXIT_FAILURE);
            cudaFree(z16); cudaFree(o16);
            cudaCheck(cudaMemcpy(dz_, z, n * 4, cudaMemcpyHostToDevice));
        }
        if (n >= (1 << 20)) {
            float ms_f = benchmark_kernel(20, fwd);
            float ms_b = benchmark_kernel(20, [&]() {
                LAUNCH(ce_bwd_v1, N, 256, dz_, dy, N, V, ignore, vec, m, s, count, ddl, 0, 1.f, ddz, -1,
                       (const unsigned short*)nullptr, (unsigned short*)nullptr); });
            printf("  forward %.4f ms %.0f GB/s | backward %.4f ms %.0f GB/s\n", ms_f, n * 4.0 / ms_f / 1e6, ms_b,
                   2.0 * n * 4 / ms_b / 1e6);
        }
        free(z); free(dl);
        cudaFree(dz_); cudaFree(ddz); cudaFree(dy); cudaFree(m); cudaFree(s); cudaFree(term); cudaFree(kept);
        cudaFree(loss); cudaFree(count); cudaFree(ddl);
    }
    printf("cross_entropy: every version ok\n");
    return 0;
}
#endif
