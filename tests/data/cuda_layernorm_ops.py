"""A layernorm as a GPU kernel author writes one: Numba CUDA kernels (one thread per row) launched on CuPy arrays,
the weight and bias gradients reduced by CuPy, declared with ARRAY_LIBRARY = "cupy" so that refbert hands it CuPy
arrays and takes CuPy arrays back (refbert.backends.convert). In Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, how
tests/test_testing.py runs it without a GPU) the simulated kernels take NumPy arrays and NumPy stands in for CuPy,
so the file declares "numpy" there: the kernels, launches and reductions are the same code."""
import math

import numpy as np
from numba import cuda
from numba.core import config

if config.ENABLE_CUDASIM:
    xp, ARRAY_LIBRARY = np, "numpy"
else:                                                  # pragma: no cover (a GPU)
    import cupy as xp
    ARRAY_LIBRARY = "cupy"

THREADS = 32


@cuda.jit
def _forward(x, w, b, eps, out, mean, rstd):
    r = cuda.grid(1)
    if r >= x.shape[0]:
        return
    C = x.shape[1]
    s = 0.0
    for j in range(C):
        s += x[r, j]
    m = s / C
    v = 0.0
    for j in range(C):
        d = x[r, j] - m
        v += d * d
    rs = 1.0 / math.sqrt(v / C + eps)
    mean[r] = m
    rstd[r] = rs
    for j in range(C):
        out[r, j] = (x[r, j] - m) * rs * w[j] + b[j]


@cuda.jit
def _backward(dout, x, w, mean, rstd, dx):
    r = cuda.grid(1)
    if r >= x.shape[0]:
        return
    C = x.shape[1]
    m, rs = mean[r], rstd[r]
    c1 = 0.0
    c2 = 0.0
    for j in range(C):
        wdy = dout[r, j] * w[j]
        c1 += wdy * (x[r, j] - m) * rs
        c2 += wdy
    c1 /= C
    c2 /= C
    for j in range(C):
        xhat = (x[r, j] - m) * rs
        dx[r, j] = (dout[r, j] * w[j] - (xhat * c1 + c2)) * rs


def layernorm_forward(x, w, b, eps=1e-12):
    C = x.shape[-1]
    x2 = xp.ascontiguousarray(x.reshape(-1, C))        # (R, C) rows
    R = x2.shape[0]
    out, mean, rstd = xp.empty_like(x2), xp.empty(R, x.dtype), xp.empty(R, x.dtype)
    if R:
        _forward[(R + THREADS - 1) // THREADS, THREADS](x2, w, b, eps, out, mean, rstd)
    return out.reshape(x.shape), (x2, w, mean, rstd, x.shape)


def layernorm_backward(dout, cache):
    x2, w, mean, rstd, shape = cache
    d2 = xp.ascontiguousarray(dout.reshape(x2.shape))
    dx = xp.empty_like(x2)
    if x2.shape[0]:
        _backward[(x2.shape[0] + THREADS - 1) // THREADS, THREADS](d2, x2, w, mean, rstd, dx)
    xhat = (x2 - mean[:, None]) * rstd[:, None]
    return dx.reshape(shape), (d2 * xhat).sum(0), d2.sum(0)
