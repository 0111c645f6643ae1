/*
The embedding backward as a sorted segment sum: deterministic (the same bits every run), no atomics.
Oracle: refbert.ops.embedding_backward (Python launcher: kernels/cuda/cuda_c.py; the Numba versions and the
math: kernels/cuda/embedding.py).
    dout: (N, C) contiguous   ids: (N,) in [0, V)   dw: (V, C), zero-filled by the launcher
    dw[v] = sum_{n : ids[n] = v} dout[n]   (dw[padding_idx] stays 0)
The launcher sorts the positions by the unique key ids[n] * N + n (any sort gives the same order: ties are
impossible), so each id's positions form one segment of the sorted order, in increasing position:
    sid[k] = ids[pos[k]]   (k = 0 .. N - 1)

Versions:
  1  two passes over chunks of 32 sorted positions: (a) a thread per (chunk, column) adds dout[pos[k], column] down
     its chunk, writing each run's sum (a run: a segment's stretch inside one chunk) at the run's first k:
     part[k, column]; (b) a thread per (segment head k, column) adds its segment's runs, part[k] then part[kb] at
     every chunk start kb inside the segment, into dw[sid[k], column]. Work per thread is bounded by 32 positions
     (a) and by the segment's chunk count (b), whatever the id distribution (2 token types over 4096 positions
     included); columns are consecutive threads (coalesced). The order of the additions is fixed by the sorted
     order alone: bitwise reproducible, which the atomic scatter-add (cupyx.scatter_add) is not.

Build and run standalone (validates against the CPU reference, then times):
    nvcc -O3 -arch=sm_90 -std=c++17 -o embedding embedding.cu && ./embedding
On CPU threads:  g++ -std=c++20 -O1 -pthread -ffp-contract=off -DCPUSIM -DCPUSIM_SMALL -x c++ embedding.cu -o e && ./e
*/
#include "common.cuh"

#define EMB_CHUNK 32

// (a) grid (ceil(N / 32), ceil(C / 256)): runs of one chunk (chunks on x: no 65535 limit on N)
extern "C" __global__ void __launch_bounds__(256) emb_bwd_runs_v1(const long long* __restrict__ sid,
                                                                  const long long* __restrict__ pos,
                                                                  const float* __restrict__ dout, int N, int C,
                                                                  float* __restrict__ part) {
    const int c = blockIdx.y * blockDim.x + threadIdx.x, k0 = blockIdx.x * EMB_CHUNK;
    if (c >= C) return;
    const int k1 = min(N, k0 + EMB_CHUNK);
    int head = k0;
    float acc = 0.f;
    for (int k = k0; k < k1; k++) {
        acc += dout[(size_t)pos[k] * C + c];
        if (k + 1 == k1 || sid[k + 1] != sid[k]) {                 // the run ends here
            part[(size_t)head * C + c] = acc;
            acc = 0.f;
            head = k + 1;
        }
    }
}

// (b) grid (N, ceil(C / 256)): a segment per head k
extern "C" __global__ void __launch_bounds__(256) emb_bwd_segments_v1(const long long* __restrict__ sid,
                                                                      const float* __restrict__ part, int N, int C,
                                                                      long long padding_idx,
                                                                      float* __restrict__ dw) {
    const int c = blockIdx.y * blockDim.x + threadIdx.x, k = blockIdx.x;
    if (c >= C) return;
    const long long id = sid[k];
    if ((k > 0 && sid[k - 1] == id) || id == padding_idx) return;  // not a segment head, or the padding row
    float tot = part[(size_t)k * C + c];
    for (int kb = (k / EMB_CHUNK + 1) * EMB_CHUNK; kb < N && sid[kb] == id; kb += EMB_CHUNK)
        tot += part[(size_t)kb * C + c];
    dw[(size_t)id * C + c] = tot;
}

#ifdef HOST_CODE
int main() {
    struct Case { int N, C, V; long long pad; };
#ifdef CPUSIM_SMALL
    const Case cases[] = {{1, 3, 2, -1}, {37, 5, 7, 0}, {100, 33, 2, -1}, {70, 4, 40, 3}};
#else
    const Case cases[] = {{1, 3, 2, -1}, {37, 5, 7, 0}, {4096, 768, 2, -1}, {4096, 768, 512, -1},
                          {4096, 768, 30522, 0}};
#endif
    for (const Case& cs : cases) {
        const int N = cs.N, C = cs.C, V = cs.V;
        float* dout = make_random_float((size_t)N * C, 1);
        std::vector<long long> ids(N), key(N), sid(N), pos(N);
        unsigned st = 12345;
        for (int n = 0; n < N; n++) { st = st * 1664525u + 1013904223u; ids[n] = (st >> 8) % V; }
        for (int n = 0; n < N; n++) key[n] = ids[n] * N + n;
        std::sort(key.begin(), key.end());
        for (int k = 0; k < N; k++) { sid[k] = key[k] / N; pos[k] = key[k] % N; }
        std::vector<float> ref((size_t)V * C, 0.f);
        for (int n = 0; n < N; n++)                                // the oracle's order: position order
            if (ids[n] != cs.pad)
                for (int c = 0; c < C; c++) ref[(size_t)ids[n] * C + c] += dout[(size_t)n * C + c];
        float *ddo, *part, *dw;
        long long *dsid, *dpos;
        cudaCheck(cudaMalloc(&ddo, (size_t)N * C * 4)); cudaCheck(cudaMalloc(&part, (size_t)N * C * 4));
        cudaCheck(cudaMalloc(&dw, (size_t)V * C * 4)); cudaCheck(cudaMalloc(&dsid, N * 8));
        cudaCheck(cudaMalloc(&dpos, N * 8));
        cudaCheck(cudaMemcpy(ddo, dout, (size_t)N * C * 4, cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(dsid, sid.data(), N * 8, cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(dpos, pos.data(), N * 8, cudaMemcpyHostToDevice));
        auto run = [&]() {
            cudaCheck(cudaMemset(dw, 0, (size_t)V * C * 4));
            LAUNCH(emb_bwd_runs_v1, dim3((N + EMB_CHUNK - 1) / EMB_CHUNK, (C + 255) / 256), 256, dsid, dpos, ddo, N, C,
                   part);
            LAUNCH(emb_bwd_segments_v1, dim3(N, (C + 255) / 256), 256, dsid, part, N, C, cs.pad, dw);
        };
        run();
        cudaCheck(cudaDeviceSynchronize());
        printf("embedding v1 N=%d C=%d V=%d padding_idx=%lld\n", N, C, V, cs.pad);
        validate_result(dw, ref.data(), "dw", (size_t)V * C, 1e-6f * N / V + 1e-6f, 1e-5f);  // float32 sums, other order
        if ((size_t)N * C >= (1 << 20)) {
            float ms = benchmark_kernel(20, run);
            printf("  %.4f ms (zero fill of (V, C) included)\n", ms);
        }
        free(dout); cudaFree(ddo); cudaFree(part); cudaFree(dw); cudaFree(dsid); cudaFree(dpos);
    }
    printf("embedding: every version ok\n");
    return 0;
}
#endif
