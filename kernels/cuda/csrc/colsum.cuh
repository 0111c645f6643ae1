// The second pass of every deterministic column sum here (bias gradients, LayerNorm's dw / db, GELU's db):
// out[c] = sum_k parts[k, c] in chunk order k = 0, 1, ... (no atomics: the same bits every run). Included by the
// .cu files whose launchers need it (each CuPy module is compiled on its own).
#pragma once
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256) colsum_final_v1(const float* __restrict__ parts, int chunks, int C,
                                                                  float* __restrict__ out) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float s = 0.f;
    for (int k = 0; k < chunks; k++) s += parts[(size_t)k * C + c];
    out[c] = s;
}
