"""Oracle: refbert.ops.embedding_forward / refbert.ops.embedding_backward — out = w[ids]; the backward scatters
dout back into the rows of dw, summing repeated ids.

    ids: (...) integers in [0, V)   w: (V, C)   ->   out: (..., C)
    backward:  dw = 0;  dw[ids[n]] += dout[n] for n = 0, 1, ... in order;  dw[padding_idx] = 0

The oracle's scatter is np.add.at, which handles one (index, row) pair at a time through a generic ufunc loop:
~3.5 ms for the word embeddings of a mini batch (1024 rows of 256 into 30522), 1.7 ms for the token types (1024
rows into 2). A Numba loop over the same pairs in the same order adds the same numbers in the same order.

Versions (python -m refbert_kernels.embedding validates each against the oracle, then times it):
    1  the forward is the oracle's lookup; the backward's scatter is one Numba loop, in np.add.at's order
    2  as 1, with a dw of POOL_MIN bytes and more zeroed in the previous dw of its shape once no one holds it

Tolerance (the spec's tol): none needed — each dw entry is the same sum in the same order: bit for bit.
"""
import numpy as np
from numba import njit

from refbert import ops
from refbert import validate as V

from . import _pool
from ._harness import KernelSpec, main


@njit(cache=True)
def _scatter_add(dw, ids, d):
    """dw[ids[n]] += d[n] for n = 0, 1, ... (no fast-math: each addition rounded as NumPy's)."""
    for n in range(ids.size):
        row, src = dw[ids[n]], d[n]
        for j in range(src.size):
            row[j] += src[j]


def embedding_forward_v1(ids, w, padding_idx=None):
    return ops.embedding_forward(ids, w, padding_idx)   # a fancy-index gather: already one NumPy call


def embedding_backward_v1(dout, cache):
    ids, w_shape, dtype, padding_idx = ops._cache("embedding", cache, 4)
    V.dout("embedding", dout, (*ids.shape, w_shape[1]), dtype)
    dw = np.zeros(w_shape, dtype)
    if ids.size and w_shape[1]:
        _scatter_add(dw, np.ascontiguousarray(ids).reshape(-1).astype(np.int64, copy=False),
                     np.ascontiguousarray(dout).reshape(-1, w_shape[1]))
    if padding_idx is not None:
        dw[padding_idx] = 0
    return dw


# ----------------------------------------------------------------------------------------------------------------
# version 2: dw of POOL_MIN bytes and more (the word table's: 31 MB at V 30522, C 256) zeroed in the previous call's
# array of its shape once no one holds it (kernels/_pool.py: a fresh one took 2.7 ms on most mini steps, 65 ms on
# some). The model adds dw into the tied decoder's gradient and drops it, so it is free again at the next step.

POOL_MIN = 4 << 20


def _zeros(shape, dtype):
    a = _pool.empty(shape, dtype, "embedding", POOL_MIN)
    a.fill(0)
    return a


def embedding_forward_v2(ids, w, padding_idx=None):
    return ops.embedding_forward(ids, w, padding_idx)


def embedding_backward_v2(dout, cache):
    ids, w_shape, dtype, padding_idx = ops._cache("embedding", cache, 4)
    V.dout("embedding", dout, (*ids.shape, w_shape[1]), dtype)
    dw = _zeros(w_shape, dtype)
    if ids.size and w_shape[1]:
        _scatter_add(dw, np.ascontiguousarray(ids).reshape(-1).astype(np.int64, copy=False),
                     np.ascontiguousarray(dout).reshape(-1, w_shape[1]))
    if padding_idx is not None:
        dw[padding_idx] = 0
    return dw


embedding_forward_v1.__doc__ = embedding_forward_v2.__doc__ = ops.embedding_forward.__doc__
embedding_backward_v1.__doc__ = embedding_backward_v2.__doc__ = ops.embedding_backward.__doc__

# the best version
embedding_forward, embedding_backward = embedding_forward_v2, embedding_backward_v2


# ----------------------------------------------------------------------------------------------------------------
# spec

def make_inputs(shape, dtype, seed):
    """shape: dict(lead=tuple, V=int, C=int, padding_idx=int or None)."""
    r = np.random.default_rng(seed)
    w = r.standard_normal((shape["V"], shape["C"])).astype(dtype)
    ids = r.integers(0, shape["V"], shape["lead"])
    return dict(ids=ids, w=w), dict(padding_idx=shape.get("padding_idx"))


def _torch_peer(inputs, kwargs):
    import torch
    ids = torch.from_numpy(inputs["ids"])
    w = torch.from_numpy(inputs["w"]).requires_grad_()
    dout = torch.randn((*inputs["ids"].shape, inputs["w"].shape[1]), dtype=w.dtype)

    def step():
        out = torch.nn.functional.embedding(ids, w, padding_idx=kwargs["padding_idx"])
        torch.autograd.grad(out, [w], dout)
    return step


SPEC = KernelSpec(
    name="embedding",
    oracle=(ops.embedding_forward, ops.embedding_backward),
    versions={1: (embedding_forward_v1, embedding_backward_v1), 2: (embedding_forward_v2, embedding_backward_v2)},
    make_inputs=make_inputs,
    wrt=("w",),
    shapes=[dict(lead=(1,), V=1, C=1), dict(lead=(3, 5), V=7, C=9, padding_idx=0), dict(lead=(64,), V=2, C=33),
            dict(lead=(2, 3), V=1031, C=5, padding_idx=1030), dict(lead=(0,), V=4, C=3)],
    # the word embeddings of mini's batch (B 8, T 128, V 30522, C 256)
    bench_shape=dict(lead=(8, 128), V=30522, C=256, padding_idx=0),
    tol={np.float64: (1e-300, 0.0), np.float32: (1e-300, 0.0)},   # bit for bit; 1e-300 keeps the ratio finite
    # forward reads N rows of w and writes them; backward writes dw (V C) and reads dout (N C)
    nbytes=lambda inp, kw: (3 * inp["ids"].size + inp["w"].shape[0]) * inp["w"].shape[1] * inp["w"].itemsize,
    torch_peer=_torch_peer,
    notes={1: "the scatter as one Numba loop in np.add.at's order",
           2: "dw >= 4 MiB zeroed in the last one of its shape once nobody holds it"},
)

if __name__ == "__main__":
    main(SPEC)
