"""Oracle: refbert.ops.dropout_forward / refbert.ops.dropout_backward — inverted dropout with the counter-based
keep-mask of refbert.philox, so a kernel drops exactly the oracle's elements, in float32 and float64.

    x: (...) seen flat, i = C-order index   (seed, stream) = rng.next_stream(), once per training call with p > 0
    keep[i] = philox_word(i, stream, seed) >= threshold(p)    (an integer comparison: no dtype can change it)
    out = x * keep * scale,  scale = 1 / (1 - p)  (0 when p = 1)        Backward: dx = dout * keep * scale
    Eval or p == 0: out is x itself, dx = dout.copy(), and no stream is drawn.

Philox4x32-10 gives 4 words per call (block b holds elements 4b .. 4b + 3), so the fast versions run one call per
block of 4 elements over chunks of blocks: the 10 rounds become 8-lane vpmuludq code, and nothing depends on the
thread that runs a chunk.

Versions (python -m refbert_kernels.dropout validates each against the oracle, then times it):
    1  one element per prange iteration, philox_word (a whole Philox block per element, 4x the work); the bool
       keep-mask is cached for the backward, as the oracle does
    2  one Philox block per 4 elements, chunks of blocks per prange iteration (vectorised); bool mask cached
    3  as 2, but nothing cached: the backward regenerates the mask from (seed, stream) — one byte per element less
       written and read, for a second Philox pass (a pure function of the index, so it is the same mask)

Tolerance (the spec's tol): none needed — out = (x * 1) * scale or x * 0 is one rounding, the oracle's, so every
version matches bit for bit in both dtypes (atol = rtol = 0); the kept set itself is an integer comparison.
fastmath: {'reassoc', 'contract', 'arcp', 'nsz'}: no 'nnan'/'ninf', so a dropped inf/NaN gives NaN as x * 0 does.
"""
import numpy as np
from numba import njit, prange, types
from numba.extending import overload
from numba.np.numpy_support import as_dtype

from refbert import ops
from refbert import validate as V
from refbert.philox import DropoutRNG, threshold

from ._harness import KernelSpec, main
from ._math import philox_block, philox_word

FASTMATH = {"reassoc", "contract", "arcp", "nsz"}
BLOCKS = 1024                      # Philox blocks (4 elements each) per prange iteration: 16 KiB of float32


# ----------------------------------------------------------------------------------------------------------------
# shared with kernels/softmax.py and kernels/layernorm.py

def like(v, c):
    """c as a number of v's float type. In Numba, float32 op int64 is float64 (x * 0, 1 / x, s / C all are), which
    would silently widen a float32 kernel's accumulators to float64 and halve its SIMD width. (Belongs in _math.)"""
    return type(v)(c)


@overload(like)
def _like(v, c):
    if isinstance(v, types.Float):
        t = as_dtype(v).type
        return lambda v, c: t(c)


@njit(cache=True, fastmath=FASTMATH)
def fill_multipliers(buf, b0, nb, seed, stream, thr, scale):
    """buf[4k + l] = scale if element 4(b0 + k) + l is kept else 0, for k < nb (Philox block b0 + k, word l)."""
    zero = like(scale, 0)
    for k in range(nb):
        w0, w1, w2, w3 = philox_block(np.uint64(b0 + k), stream, seed)
        buf[4 * k] = scale if w0 >= thr else zero
        buf[4 * k + 1] = scale if w1 >= thr else zero
        buf[4 * k + 2] = scale if w2 >= thr else zero
        buf[4 * k + 3] = scale if w3 >= thr else zero


def draw(rng, p, train, op="dropout"):
    """The oracle's checks on p and rng, then (seed, stream, thr, scale) of this call as Numba-ready scalars, or
    None in eval / p == 0 (no stream drawn). Messages as refbert.ops.dropout_forward / dropout_mask."""
    p = V.probability("dropout", "p", p)
    if not train or p == 0.0:
        return None
    if not isinstance(rng, DropoutRNG):
        raise ValueError(f"{op}: argument 'rng' expected a refbert.philox.DropoutRNG in training, "
                         f"got {type(rng).__name__}")
    seed, stream = rng.next_stream()
    scale = 1.0 / (1.0 - p) if p < 1.0 else 0.0
    return np.uint64(seed), np.uint64(stream), np.uint64(threshold(p)), scale


# ----------------------------------------------------------------------------------------------------------------
# kernels on flat (n,) contiguous arrays

@njit(parallel=True, cache=True, fastmath=FASTMATH)
def _apply_v1(x, out, keep, seed, stream, thr, scale):
    for i in prange(x.size):
        k = philox_word(i, stream, seed) >= thr
        keep[i] = k
        out[i] = x[i] * scale if k else x[i] * like(scale, 0)


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def _apply_keep(x, out, keep, scale):
    """out = x * keep * scale from a cached bool mask (the v1 and v2 backward)."""
    zero = like(scale, 0)
    for i in prange(x.size):
        out[i] = x[i] * (scale if keep[i] else zero)


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def _apply_v2(x, out, keep, seed, stream, thr, scale):
    n = x.size
    nfull = n // 4                                   # whole Philox blocks; the last < 4 elements go one by one
    zero = like(scale, 0)
    for c in prange((nfull + BLOCKS - 1) // BLOCKS):
        b0 = c * BLOCKS
        nb = min(nfull, b0 + BLOCKS) - b0
        xs, os, ks = x[4 * b0: 4 * (b0 + nb)], out[4 * b0: 4 * (b0 + nb)], keep[4 * b0: 4 * (b0 + nb)]
        for k in range(nb):                          # indices from 0 on views: LLVM vectorises (no wraparound)
            w0, w1, w2, w3 = philox_block(np.uint64(b0 + k), stream, seed)
            ks[4 * k], ks[4 * k + 1], ks[4 * k + 2], ks[4 * k + 3] = w0 >= thr, w1 >= thr, w2 >= thr, w3 >= thr
            os[4 * k] = xs[4 * k] * (scale if w0 >= thr else zero)
            os[4 * k + 1] = xs[4 * k + 1] * (scale if w1 >= thr else zero)
            os[4 * k + 2] = xs[4 * k + 2] * (scale if w2 >= thr else zero)
            os[4 * k + 3] = xs[4 * k + 3] * (scale if w3 >= thr else zero)
    for i in range(4 * nfull, n):
        k = philox_word(i, stream, seed) >= thr
        keep[i] = k
        out[i] = x[i] * (scale if k else zero)


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def _apply_v3(x, out, seed, stream, thr, scale):
    n = x.size
    nfull = n // 4
    zero = like(scale, 0)
    for c in prange((nfull + BLOCKS - 1) // BLOCKS):
        b0 = c * BLOCKS
        nb = min(nfull, b0 + BLOCKS) - b0
        xs, os = x[4 * b0: 4 * (b0 + nb)], out[4 * b0: 4 * (b0 + nb)]
        for k in range(nb):
            w0, w1, w2, w3 = philox_block(np.uint64(b0 + k), stream, seed)
            os[4 * k] = xs[4 * k] * (scale if w0 >= thr else zero)
            os[4 * k + 1] = xs[4 * k + 1] * (scale if w1 >= thr else zero)
            os[4 * k + 2] = xs[4 * k + 2] * (scale if w2 >= thr else zero)
            os[4 * k + 3] = xs[4 * k + 3] * (scale if w3 >= thr else zero)
    for i in range(4 * nfull, n):
        out[i] = x[i] * (scale if philox_word(i, stream, seed) >= thr else zero)


# ----------------------------------------------------------------------------------------------------------------
# launchers

def _forward(x, p, rng, train, kernel, keep_mask):
    V.required("dropout", x=x)
    V.floats("dropout", x=x)
    d = draw(rng, p, train)
    if d is None:
        return x, (None, 1.0, x.shape, x.dtype)
    seed, stream, thr, scale = d
    x1 = np.ascontiguousarray(x).reshape(-1)
    out = np.empty(x.shape, x.dtype)
    sc = x.dtype.type(scale)
    if keep_mask:
        keep = np.empty(x.shape, np.bool_)
        kernel(x1, out.reshape(-1), keep.reshape(-1), seed, stream, thr, sc)
        return out, (keep, scale, x.shape, x.dtype)
    kernel(x1, out.reshape(-1), seed, stream, thr, sc)
    return out, ((seed, stream, thr), scale, x.shape, x.dtype)


def _backward(dout, cache):
    keep, scale, shape, dtype = ops._cache("dropout", cache, 4)
    V.dout("dropout", dout, shape, dtype)
    if keep is None:
        return dout.copy()
    dx = np.empty(shape, dtype)
    d1 = np.ascontiguousarray(dout).reshape(-1)
    if isinstance(keep, tuple):                      # v3: regenerate the mask from (seed, stream, thr)
        _apply_v3(d1, dx.reshape(-1), *keep, dtype.type(scale))
    else:
        _apply_keep(d1, dx.reshape(-1), keep.reshape(-1), dtype.type(scale))
    return dx


def dropout_forward_v1(x, p, rng=None, train=True):
    return _forward(x, p, rng, train, _apply_v1, True)


def dropout_forward_v2(x, p, rng=None, train=True):
    return _forward(x, p, rng, train, _apply_v2, True)


def dropout_forward_v3(x, p, rng=None, train=True):
    return _forward(x, p, rng, train, _apply_v3, False)


dropout_backward_v1 = dropout_backward_v2 = dropout_backward_v3 = _backward   # the cache says which mask it holds

dropout_forward, dropout_backward = dropout_forward_v3, dropout_backward_v3   # the best version


# ----------------------------------------------------------------------------------------------------------------
# spec

def make_inputs(shape, dtype, seed):
    """shape: dict(shape=tuple, p=float, train=bool)."""
    x = np.random.default_rng(seed).standard_normal(shape["shape"]).astype(dtype)
    return dict(x=x), dict(p=shape.get("p", 0.1), rng=DropoutRNG(0), train=shape.get("train", True))


def _nbytes(inputs, kwargs):
    # forward reads x and writes out; backward reads dout and writes dx (the mask is recomputed, not stored)
    return 4 * inputs["x"].nbytes


def _torch_peer(inputs, kwargs):
    import torch
    x = torch.from_numpy(inputs["x"]).requires_grad_()
    dout = torch.randn(x.shape, dtype=x.dtype)

    def step():
        out = torch.nn.functional.dropout(x, kwargs["p"], training=kwargs["train"])
        (dx,) = torch.autograd.grad(out, x, dout)
    return step


SPEC = KernelSpec(
    name="dropout",
    oracle=(ops.dropout_forward, ops.dropout_backward),
    versions={1: (dropout_forward_v1, dropout_backward_v1), 2: (dropout_forward_v2, dropout_backward_v2),
              3: (dropout_forward_v3, dropout_backward_v3)},
    make_inputs=make_inputs,
    wrt=("x",),
    shapes=[dict(shape=(1,)), dict(shape=(3, 37)), dict(shape=(2, 5, 52), p=0.5), dict(shape=(7,), p=1.0),
            dict(shape=(4099,), p=0.3), dict(shape=(3, 5), train=False), dict(shape=(2, 3), p=0.0),
            dict(shape=(0, 3))],
    bench_shape=dict(shape=(4, 12, 512, 512), p=0.1),
    tol={np.float64: (1e-300, 0.0), np.float32: (1e-300, 0.0)},   # exact; 1e-300 keeps the ratio finite
    nbytes=_nbytes,
    torch_peer=_torch_peer,
    notes={1: "philox_word per element, bool mask cached", 2: "one Philox block per 4 elements, SIMD; mask cached",
           3: "as 2, mask regenerated in the backward: nothing cached"},
)

if __name__ == "__main__":
    main(SPEC)
