"""Oracle: refbert.ops.dropout_forward / refbert.ops.dropout_backward — inverted dropout with the counter-based
keep-mask of refbert.philox, in Numba CUDA: a kernel keeps exactly the oracle's elements, in every dtype.

    x: (...) seen flat, i = C-order index   (seed, stream) = rng.next_stream(), once per training call with p > 0
    keep[i] = philox_word(i, stream, seed) >= round(p * 2^32)     (an integer comparison: no dtype can change it)
    out = x * keep * scale, scale = 1 / (1 - p) (0 when p = 1)     Backward: dx = dout * keep * scale
    Eval or p == 0: out is x itself, dx = dout.copy(), no stream drawn.
The cache holds (seed, stream, threshold), never a mask: the backward regenerates the mask (a pure function of i).

Versions (`python -m refbert_kernels.cuda.dropout` validates every version):
    1  a thread per element: philox_word (a whole Philox4x32-10 call per element, 4x the work)
    2  a thread per Philox block: one call gives the 4 words of elements 4b .. 4b + 3 (a tail block covers
       the last n % 4 elements)

Precisions: out = x * scale (or x * 0) in the accumulation type, rounded once on the store; f64 / f32 match the
oracle bit for bit (atol = rtol = 0; 1e-300 keeps the ratio finite); f16 / bf16: the scale is applied in float32
and rounded once, against the float64 oracle: 1 ulp of storage (_common.lowp_tol(ulps=1)).
"""
import functools

import numpy as np
from numba import cuda

from refbert import ops
from refbert import validate as V
from refbert.philox import DropoutRNG, threshold

from refbert_kernels._harness import KernelSpec

from . import _common as C
from ._common import BLOCK, acc_np, ldst, philox_block, philox_word


@functools.lru_cache(maxsize=None)
def _kernel(kind, version):
    ld, st = ldst(kind)
    A = acc_np(kind)
    zero = A(0)

    if version == 1:
        @C.jit_kernel
        def apply(x, out, seed, stream, thr, scale):
            i = cuda.grid(1)
            if i < x.shape[0]:
                k = philox_word(i, stream, seed) >= thr
                out[i] = st(ld(x[i]) * (A(scale) if k else zero))
        return apply

    @C.jit_kernel
    def apply(x, out, seed, stream, thr, scale):
        b = cuda.grid(1)                                 # Philox block b: elements 4b .. 4b + 3
        n = x.shape[0]
        if 4 * b >= n:
            return
        sc = A(scale)
        w0, w1, w2, w3 = philox_block(b, stream, seed)
        i = 4 * b
        out[i] = st(ld(x[i]) * (sc if w0 >= thr else zero))
        if i + 1 < n:
            out[i + 1] = st(ld(x[i + 1]) * (sc if w1 >= thr else zero))
        if i + 2 < n:
            out[i + 2] = st(ld(x[i + 2]) * (sc if w2 >= thr else zero))
        if i + 3 < n:
            out[i + 3] = st(ld(x[i + 3]) * (sc if w3 >= thr else zero))
    return apply


def draw(rng, p, train, op="dropout"):
    """The oracle's checks on p and rng, then (seed, stream, threshold, scale) of this call, or None in eval /
    p == 0 (no stream drawn). Messages as refbert.ops.dropout_forward / dropout_mask."""
    p = V.probability("dropout", "p", p)
    if not train or p == 0.0:
        return None
    if not isinstance(rng, DropoutRNG):
        raise ValueError(f"{op}: argument 'rng' expected a refbert.philox.DropoutRNG in training, "
                         f"got {type(rng).__name__}")
    seed, stream = rng.next_stream()
    return np.uint64(seed), np.uint64(stream), np.uint64(threshold(p)), 1.0 / (1.0 - p) if p < 1.0 else 0.0


def apply(version, a, drop):
    """a * keep * scale for the call drop = (seed, stream, thr, scale), on a's device, a's dtype."""
    xp = C.xp_of(a)
    out = xp.empty(a.shape, a.dtype)
    n = a.size
    if n:
        seed, stream, thr, scale = drop
        threads = n if version == 1 else -(-n // 4)
        _kernel(C.kind_of(a.dtype), version)[C.grid_for(threads, BLOCK), BLOCK](
            C.din(xp.ascontiguousarray(a).reshape(-1)), C.dev(out.reshape(-1)), seed, stream, thr, float(scale))
    return out


def _forward(version, x, p, rng, train):
    C.floats("dropout", x=x)
    drop = draw(rng, p, train)
    if drop is None:
        return x, ops.DropoutCache(None, 1.0, x.shape, x.dtype)
    return apply(version, x, drop), ops.DropoutCache((version, drop), drop[3], x.shape, x.dtype)


def dropout_backward_v1(dout, cache):
    keep, scale, shape, dtype = cache
    C.dout("dropout", dout, shape, dtype)
    if keep is None:
        return dout.copy()
    version, drop = keep                                 # the mask regenerated from (seed, stream, thr)
    return apply(version, dout, drop)


def dropout_forward_v1(x, p, rng=None, train=True):
    return _forward(1, x, p, rng, train)


def dropout_forward_v2(x, p, rng=None, train=True):
    return _forward(2, x, p, rng, train)


dropout_backward_v2 = dropout_backward_v1                # the cache names the version
dropout_forward, dropout_backward = dropout_forward_v2, dropout_backward_v2


def make_inputs(shape, dtype, seed):
    """shape: dict(shape=tuple, p=float, train=bool)."""
    x = np.random.default_rng(seed).standard_normal(shape["shape"]).astype(dtype)
    return dict(x=x), dict(p=shape.get("p", 0.1), rng=DropoutRNG(0), train=shape.get("train", True))


SPEC = KernelSpec(
    name="dropout",
    oracle=(ops.dropout_forward, ops.dropout_backward),
    versions={1: (dropout_forward_v1, dropout_backward_v1), 2: (dropout_forward_v2, dropout_backward_v2)},
    make_inputs=make_inputs,
    wrt=("x",),
    shapes=[dict(shape=(1,)), dict(shape=(3, 11), p=0.5), dict(shape=(7,), p=1.0), dict(shape=(3, 5), train=False),
            dict(shape=(2, 3), p=0.0), dict(shape=(0, 3)), dict(shape=(2, 3, 5), p=0.3)],
    bench_shape=dict(shape=(4, 12, 512, 512), p=0.1),
    tol={np.float64: (1e-300, 0.0), np.float32: (1e-300, 0.0), np.float16: C.lowp_tol(np.float16, 1),
         **({np.dtype(C.BF16).type: C.lowp_tol(C.BF16, 1)} if C.BF16 is not None else {})},
    nbytes=lambda inp, kw: 4 * inp["x"].nbytes,          # forward x -> out, backward dout -> dx; no mask stored
    notes={1: "a thread per element, philox_word", 2: "a thread per Philox block of 4 elements",
           "gpu_shapes": [dict(shape=(4099,), p=0.3), dict(shape=(2, 5, 52), p=0.5), dict(shape=(7,), p=1.0)]},
)

SPECS = [SPEC]

if __name__ == "__main__":
    C.check_specs(SPECS, "sim" if C.SIM else "gpu")
