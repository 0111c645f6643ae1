"""Oracle: refbert.ops.gelu_forward / gelu_backward and refbert.ops.bias_gelu_forward / bias_gelu_backward
(approximate="none": exact u Phi(u), HF "gelu"; "tanh": HF "gelu_new"), in Numba CUDA.

    x: (..., I) seen as (R, I)   b: (I,) (gelu: no bias, u = x)
    forward:   u = x + b;  out = u Phi(u),  Phi(u) = erfc(-u / sqrt 2) / 2     (tanh: Phi ~ s = sigmoid(2a),
               a = sqrt(2/pi) (u + 0.044715 u^3), computed without overflow on either side)
    backward:  du = dout (Phi(u) + u phi(u)),  phi(u) = exp(-u^2 / 2) / sqrt(2 pi)
               tanh: du = dout (s + 2 u s (1 - s) sqrt(2/pi) (1 + 3 * 0.044715 u^2))
               dx = du;  db[j] = sum over rows of du[:, j]: per-chunk partials (CHUNKS fixed chunks of rows, a
               function of R only), then a second kernel adds the partials in chunk order — no float atomics,
               the same bits every run.
The cache keeps x (and b): the backward recomputes u and Phi, nothing of size R I is stored besides x.

Versions (`python -m refbert_kernels.cuda.gelu` validates every version):
    1  forward a thread per element; backward a thread per element writes du, then a thread per (chunk,
       column) sums du's rows of its chunk (du read back), then the fixed-order column sum
    2  forward as 1 (elementwise is already one read and one write); backward fused: a thread per (chunk,
       column) computes du down its chunk's rows, writes dx and keeps db's partial in a register (consecutive
       threads, consecutive columns: coalesced), then the fixed-order column sum

Precisions: f64 / f32 compute in their dtype (math.erfc / exp / are CUDA's libdevice, within 2 ulp in float32),
f16 / bf16 storage in float32. Tolerance: f64 atol 1e-12, rtol 1e-11 (erfc vs scipy's ndtr and the oracle's
Phi = out / x; db's summation order); f32 atol 1e-6, rtol 2e-5 (the oracle rounds u, u^3 and each step to float32:
a few ulp, and libdevice's expf / erfcf up to 2 ulp); f16 / bf16 4 ulp of storage (_common.lowp_tol).
"""
import functools
import math

import numpy as np
from numba import cuda

from refbert import ops
from refbert import validate as V

from refbert_kernels._harness import KernelSpec
from refbert_kernels.gelu import _make_bias_gelu, _make_gelu

from . import _common as C
from ._common import BLOCK, acc_np, ldst

_C = math.sqrt(2.0 / math.pi)
_K = 0.044715
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_HALF = math.sqrt(0.5)


@functools.lru_cache(maxsize=None)
def _kernels(kind, tanh, version):
    ld, st = ldst(kind)
    A = acc_np(kind)
    zero, half, one, two, three = A(0), A(0.5), A(1), A(2), A(3)
    c, k, inv_sqrt_2pi, sqrt_half = A(_C), A(_K), A(_INV_SQRT_2PI), A(_SQRT_HALF)
    lim = A(1e4)

    @cuda.jit(device=True)
    def sig(a):                                      # sigmoid(a) without exp of a large positive number
        if a >= zero:
            return one / (one + math.exp(-a))
        e = math.exp(a)
        return e / (one + e)

    @cuda.jit(device=True)
    def gelu(u):
        if tanh:
            return u * sig(two * c * (u + k * u * u * u))
        return u * (half * math.erfc(-u * sqrt_half))

    @cuda.jit(device=True)
    def dgelu(u):
        if tanh:
            s = sig(two * c * (u + k * u * u * u))
            if abs(u) > lim:                         # past |u| = 1e4, s (1 - s) is exactly 0: so is the term, not inf * 0
                return s
            return s + two * u * s * (one - s) * c * (one + three * k * u * u)
        return half * math.erfc(-u * sqrt_half) + u * math.exp(-half * u * u) * inv_sqrt_2pi

    @C.jit_kernel
    def forward(x, b, out):
        i = cuda.grid(1)
        R, I = x.shape
        if i < R * I:
            r, j = i // I, i % I
            out[r, j] = st(gelu(ld(x[r, j]) + ld(b[j])))

    @C.jit_kernel
    def backward_du(dout, x, b, dx):                 # v1: a thread per element
        i = cuda.grid(1)
        R, I = x.shape
        if i < R * I:
            r, j = i // I, i % I
            dx[r, j] = st(ld(dout[r, j]) * dgelu(ld(x[r, j]) + ld(b[j])))

    @C.jit_kernel
    def partials(du, per, parts):                    # v1: parts[c, j] = sum of du[r, j] over chunk c's rows
        i = cuda.grid(1)
        n, I = parts.shape
        if i < n * I:
            ch, j = i // I, i % I
            s = zero
            for r in range(ch * per, min(du.shape[0], (ch + 1) * per)):
                s += ld(du[r, j])
            parts[ch, j] = s

    @C.jit_kernel
    def backward_fused(dout, x, b, per, dx, parts):  # v2: du and db's partial in one pass down a chunk
        i = cuda.grid(1)
        n, I = parts.shape
        if i < n * I:
            ch, j = i // I, i % I
            bj = ld(b[j])
            s = zero
            for r in range(ch * per, min(x.shape[0], (ch + 1) * per)):
                d = ld(dout[r, j]) * dgelu(ld(x[r, j]) + bj)
                dx[r, j] = st(d)
                s += ld(st(d))                        # db sums du as stored (fp16: the rounded du, as v1)
            parts[ch, j] = s
    return forward, backward_du, partials, backward_fused


def _check_approximate(approximate):
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: argument 'approximate' expected 'none' or 'tanh', got {approximate!r}")


def _run_forward(version, x, b, approximate, with_bias):
    xp = C.xp_of(x)
    I = x.shape[-1] if (with_bias and x.ndim) else max(x.size, 1)
    x2 = xp.ascontiguousarray(x).reshape(-1, I)
    bb = b if with_bias else xp.zeros(I, x.dtype)
    out = xp.empty(x.shape, x.dtype)
    if x.size:
        fwd = _kernels(C.kind_of(x.dtype), approximate == "tanh", version)[0]
        fwd[C.grid_for(x.size, BLOCK), BLOCK](C.din(x2), C.din(bb), C.dev(out.reshape(x2.shape)))
    return out, (version, x2, bb, approximate, x.shape, with_bias)


def _run_backward(dout, cache, op):
    version, x2, bb, approximate, shape, with_bias = cache
    C.dout(op, dout, shape, x2.dtype)
    xp = C.xp_of(x2)
    R, I = x2.shape
    dx = xp.empty(shape, x2.dtype)
    db = xp.zeros(I, x2.dtype)
    if dx.size == 0:
        return dx, db
    kind = C.kind_of(x2.dtype)
    _, backward_du, partials, fused = _kernels(kind, approximate == "tanh", version)
    per, n = C.chunks(R)
    parts = xp.empty((n, I), C.acc_np(kind))
    d2 = C.din(xp.ascontiguousarray(dout).reshape(R, I))
    if version == 1:
        backward_du[C.grid_for(R * I, BLOCK), BLOCK](d2, C.din(x2), C.din(bb), C.dev(dx.reshape(R, I)))
        if with_bias:
            partials[C.grid_for(n * I, BLOCK), BLOCK](C.din(dx.reshape(R, I)), per, parts)
    else:
        fused[C.grid_for(n * I, BLOCK), BLOCK](d2, C.din(x2), C.din(bb), per, C.dev(dx.reshape(R, I)), parts)
    if with_bias:
        C.column_sum_kernel("f64" if kind == "f64" else "f32", kind)[C.grid_for(I, BLOCK), BLOCK](
            C.din(parts), C.dev(db))
    return dx, db


def _gelu_forward(version, x, approximate):
    C.floats("gelu", x=x)
    _check_approximate(approximate)
    return _run_forward(version, x, None, approximate, False)


def _gelu_backward(dout, cache):
    return _run_backward(dout, cache, "gelu")[0]


def _bias_gelu_forward(version, x, b, approximate):
    C.floats("bias_gelu", x=x, b=b)
    V.min_ndim("bias_gelu", "x", x, 1, "(..., I)")
    V.shape("bias_gelu", "b", C.stub(b), (x.shape[-1],), "(I,)")
    _check_approximate(approximate)
    return _run_forward(version, x, b, approximate, True)


def _bias_gelu_backward(dout, cache):
    return _run_backward(dout, cache, "gelu")        # the oracle's bias_gelu backward checks as gelu_backward


def gelu_forward_v1(x, approximate="none"):
    return _gelu_forward(1, x, approximate)


def gelu_forward_v2(x, approximate="none"):
    return _gelu_forward(2, x, approximate)


def bias_gelu_forward_v1(x, b, approximate="none"):
    return _bias_gelu_forward(1, x, b, approximate)


def bias_gelu_forward_v2(x, b, approximate="none"):
    return _bias_gelu_forward(2, x, b, approximate)


gelu_backward_v1 = gelu_backward_v2 = _gelu_backward                 # the cache names the version
bias_gelu_backward_v1 = bias_gelu_backward_v2 = _bias_gelu_backward
gelu_forward, gelu_backward = gelu_forward_v2, gelu_backward_v2
bias_gelu_forward, bias_gelu_backward = bias_gelu_forward_v2, bias_gelu_backward_v2

_SHAPES = [{"shape": s, "approximate": a} for a in ("none", "tanh") for s in [(1,), (3, 5, 7)]]
_TOL = {np.float64: (1e-12, 1e-11), np.float32: (1e-6, 2e-5)}
_GPU = [{"shape": s, "approximate": a} for a in ("none", "tanh") for s in [(1, 52), (37, 52), (17, 781), (130, 33)]]
_NOTES = {1: "elementwise; db from du read back, chunk partials + fixed-order sum",
          2: "backward fused: a thread per (chunk, column), du and db partial in one pass"}

SPEC_GELU = KernelSpec(
    name="gelu", oracle=(ops.gelu_forward, ops.gelu_backward),
    versions={1: (gelu_forward_v1, gelu_backward_v1), 2: (gelu_forward_v2, gelu_backward_v2)},
    make_inputs=_make_gelu, wrt=("x",), shapes=_SHAPES,
    bench_shape={"shape": (4 * 512, 3072), "approximate": "none"}, tol=_TOL,
    nbytes=lambda inp, kw: 5 * inp["x"].nbytes,          # forward x -> out; backward dout, x -> dx
    notes={**_NOTES, "gpu_shapes": _GPU})

SPEC_BIAS_GELU = KernelSpec(
    name="bias_gelu", oracle=(ops.bias_gelu_forward, ops.bias_gelu_backward),
    versions={1: (bias_gelu_forward_v1, bias_gelu_backward_v1), 2: (bias_gelu_forward_v2, bias_gelu_backward_v2)},
    make_inputs=_make_bias_gelu, wrt=("x", "b"),
    shapes=[{"shape": s, "approximate": a} for a in ("none", "tanh") for s in [(1, 1), (3, 5, 7)]],
    bench_shape={"shape": (4 * 512, 3072), "approximate": "none"}, tol=_TOL,
    nbytes=lambda inp, kw: 5 * inp["x"].nbytes + 3 * inp["b"].nbytes,
    notes={**_NOTES, "gpu_shapes": _GPU})

SPECS = [SPEC_GELU, SPEC_BIAS_GELU]

if __name__ == "__main__":
    C.check_specs(SPECS, "sim" if C.SIM else "gpu")
