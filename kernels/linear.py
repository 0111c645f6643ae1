"""Oracle: refbert.ops.linear_forward / refbert.ops.linear_backward — out = x @ w.T + b over the last axis; the
matrix products stay on NumPy's BLAS, the kernels here do what NumPy would do around them on one thread.

    x: (..., C_in) seen as (N, C_in)   w: (C_out, C_in)   b: (C_out,) or None   ->   out: (..., C_out)
    forward:   out = x2 @ w.T (BLAS), then out += b row by row
    backward:  the oracle's (dx = dout @ w, dw = dout2.T @ x2, db = dout2.sum(0), rows of zeros skipped)

NumPy's `out += b` is one thread: on the MLM decoder's (B T, V) logits (125 MB at mini's B 8, T 128) it is a
read and a write of the whole output after the GEMM, the largest elementwise pass of a pretraining step.

Versions (python -m refbert_kernels.linear validates each against the oracle, then times it):
    1  the GEMM as the oracle's (np.matmul), the bias added in place by a prange over row chunks: both cores
       (outputs under PARALLEL_MIN entries: NumPy's `out += b`, which costs less than waking the threads)
    2  as 1, with outputs of POOL_MIN bytes and more written into the previous output of their shape once no one
       holds it (no fresh mmap, page faults and zeroing of 125 MB of logits every step)

Tolerance (the spec's tol): none needed — the same GEMM, and x @ w.T + b rounded once per entry as the oracle
rounds it: bit for bit in both dtypes (atol 1e-300, rtol 0 keep the ratio finite).
"""
import numpy as np
from numba import njit, prange

from refbert import ops
from refbert import validate as V

from . import _pool
from ._harness import KernelSpec, main

_ROWS = 8                        # rows of the output per prange iteration
PARALLEL_MIN = 1 << 20           # outputs smaller than this add the bias with NumPy on the calling thread


@njit(parallel=True, cache=True)
def _add_bias(out, b):
    """out[n, :] += b for every row n (no fast-math: one rounded addition, as NumPy's)."""
    N, C = out.shape
    for c in prange((N + _ROWS - 1) // _ROWS):
        for n in range(c * _ROWS, min(N, (c + 1) * _ROWS)):
            o = out[n]
            for j in range(C):
                o[j] += b[j]


def linear_forward_v1(x, w, b=None):
    V.required("linear", x=x, w=w)
    V.floats("linear", x=x, w=w, b=b)
    V.min_ndim("linear", "x", x, 1, "(..., C_in)")
    V.shape("linear", "w", w, (None, x.shape[-1]), "(C_out, C_in)")
    if b is not None:
        V.shape("linear", "b", b, (w.shape[0],), "(C_out,)")
    out = x.reshape(-1, x.shape[-1]) @ w.T            # (N, C_out): NumPy's GEMM, a fresh C-contiguous array
    if b is not None and out.size >= PARALLEL_MIN:
        _add_bias(out, np.ascontiguousarray(b))
    elif b is not None:
        out += b                                      # small: NumPy on this thread (no workqueue wake-up)
    out = out.reshape(*x.shape[:-1], w.shape[0])      # (..., C_out)
    return out, (x, w, b is not None)


linear_backward_v1 = ops.linear_backward               # the oracle's: the cache is the oracle's


# ----------------------------------------------------------------------------------------------------------------
# version 2: outputs of POOL_MIN bytes and more (the MLM decoder's logits: 125 MB at mini's B 8, T 128) written
# into the previous call's output of the same shape once no one holds it (kernels/_pool.py: a fresh one costs page
# faults and the kernel's zeroing of every page, ~10 ms of CPU for those 125 MB).

POOL_MIN = 32 << 20


def linear_forward_v2(x, w, b=None):
    V.required("linear", x=x, w=w)
    V.floats("linear", x=x, w=w, b=b)
    V.min_ndim("linear", "x", x, 1, "(..., C_in)")
    V.shape("linear", "w", w, (None, x.shape[-1]), "(C_out, C_in)")
    if b is not None:
        V.shape("linear", "b", b, (w.shape[0],), "(C_out,)")
    x2 = x.reshape(-1, x.shape[-1])
    out = _pool.empty((x2.shape[0], w.shape[0]), x.dtype, "linear", POOL_MIN)
    np.matmul(x2, w.T, out=out)                       # (N, C_out): NumPy's GEMM
    if b is not None and out.size >= PARALLEL_MIN:
        _add_bias(out, np.ascontiguousarray(b))
    elif b is not None:
        out += b
    out = out.reshape(*x.shape[:-1], w.shape[0])      # (..., C_out)
    return out, (x, w, b is not None)


linear_backward_v2 = ops.linear_backward

linear_forward_v1.__doc__ = linear_forward_v2.__doc__ = ops.linear_forward.__doc__

# the best version
linear_forward, linear_backward = linear_forward_v2, linear_backward_v2


# ----------------------------------------------------------------------------------------------------------------
# spec

def make_inputs(shape, dtype, seed):
    """shape: dict(lead=tuple, C_in=int, C_out=int, bias=bool)."""
    r = np.random.default_rng(seed)
    x = r.standard_normal((*shape["lead"], shape["C_in"])).astype(dtype)
    w = (0.02 * r.standard_normal((shape["C_out"], shape["C_in"]))).astype(dtype)
    b = r.standard_normal(shape["C_out"]).astype(dtype) if shape.get("bias", True) else None
    return dict(x=x, w=w, b=b), {}


def _torch_peer(inputs, kwargs):
    import torch
    t = {k: torch.from_numpy(v).requires_grad_() for k, v in inputs.items() if v is not None}
    dout = torch.randn((*inputs["x"].shape[:-1], inputs["w"].shape[0]), dtype=t["x"].dtype)

    def step():
        out = torch.nn.functional.linear(t["x"], t["w"], t.get("b"))
        torch.autograd.grad(out, list(t.values()), dout)
    return step


def _nbytes(inputs, kwargs):
    # forward: x, w in, out written (and read + written again by the bias); backward: dout, x, w in, dx, dw out
    x, w = inputs["x"], inputs["w"]
    out = x.nbytes // x.shape[-1] * w.shape[0]
    return 2 * x.nbytes + 2 * w.nbytes + 4 * out


def _flops(inputs, kwargs):
    x, w = inputs["x"], inputs["w"]
    return 3 * 2 * (x.size // x.shape[-1]) * w.shape[0] * w.shape[1]   # forward and two backward GEMMs


SPEC = KernelSpec(
    name="linear",
    oracle=(ops.linear_forward, ops.linear_backward),
    versions={1: (linear_forward_v1, linear_backward_v1), 2: (linear_forward_v2, linear_backward_v2)},
    make_inputs=make_inputs,
    wrt=("x", "w", "b"),
    shapes=[dict(lead=(1,), C_in=1, C_out=1), dict(lead=(3, 5), C_in=7, C_out=37), dict(lead=(19,), C_in=52,
            C_out=9), dict(lead=(2, 3), C_in=5, C_out=11, bias=False), dict(lead=(40,), C_in=16, C_out=1031)],
    # the MLM decoder with HF's full logits at B 4, T 128 (512 rows, V = 30522: 62 MB of logits, more than L3)
    bench_shape=dict(lead=(4, 128), C_in=256, C_out=30522),
    tol={np.float64: (1e-300, 0.0), np.float32: (1e-300, 0.0)},   # bit for bit; 1e-300 keeps the ratio finite
    nbytes=_nbytes,
    flops=_flops,
    torch_peer=_torch_peer,
    notes={1: "NumPy's GEMM, the bias added in place on both cores",
           2: "outputs >= 32 MiB written into the last one of their shape when no one holds it"},
)

if __name__ == "__main__":
    main(SPEC)
