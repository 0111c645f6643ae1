"""Oracle: refbert.ops.layernorm_forward / layernorm_backward, residual_layernorm_forward / _backward and
dropout_residual_layernorm_forward / _backward — LayerNorm over the last axis of x, x + a, or x + dropout(a), in
Numba CUDA.

    x, a: (..., C) seen as (R, C) rows   w, b: (C,)
    forward, per row:  s = x (+ a * keep * scale);  mean = sum(s) / C;  rstd = 1 / sqrt(sum((s - mean)^2) / C + eps)
                       out = (s - mean) * rstd * w + b          (two passes for the variance: no E[s^2] - mean^2
                       cancellation)
    backward, per row, with xhat = (s - mean) * rstd and wdy = dout * w:
                       c1 = sum(wdy * xhat) / C,  c2 = sum(wdy) / C,  ds = (wdy - (xhat * c1 + c2)) * rstd
                       dx = ds,  da = ds (residual) or ds * keep * scale (dropout)
                       wdy is rounded once and never contracted into an fma with the subtraction (_common.mul_rn):
                       at C = 1 wdy - c2 is then exactly 0, as in the oracle, instead of the
                       product's rounding error times rstd = 1/sqrt(eps) (found on the first real GPU run)
    dw = sum over rows of dout * xhat, db = sum over rows of dout: a thread per (chunk, column) sums its chunk's
    rows (CHUNKS chunks, a function of R only) into a partial row, then a second kernel adds the partials in chunk
    order — no float atomics, the same bits on every run.
The cache keeps x, a, mean and rstd (accumulation dtype) and, for dropout, (seed, stream, threshold): the
backward recomputes s and regenerates the keep-mask (refbert.philox: a pure function of the element index
r * C + j), so neither s nor a mask is stored.

Versions (`python -m refbert_kernels.cuda.layernorm` validates every version):
    1  a thread per row: three passes over the row (mean, variance, write), s recomputed each time
    2  a block per row: the threads stride over the row, mean / variance / c1 / c2 by shared-memory tree sums
    (the dw, db reduction is the same two kernels in both)

Precisions: f64 / f32 in their dtype; f16 / bf16 storage with float32 sums, mean and rstd cached in float32.
Tolerance: f64 atol 1e-12, rtol 1e-11 (summation order only); f32 atol 1e-5, rtol 1e-4 (as kernels/layernorm.py:
float32 sums in another order, and dx cancels terms of size |wdy| into results near 0); f16 / bf16: 4 ulp of
storage (_common.lowp_tol) on O(1) outputs — one rounding on the store; dw, db of sums over R rows are rounded once.
"""
import functools
import math

import numpy as np
from numba import cuda

from refbert import ops
from refbert import validate as V

from refbert_kernels._harness import KernelSpec
from refbert_kernels.layernorm import make_inputs as _cpu_make_inputs

from . import _common as C
from ._common import BLOCK, acc_np, ldst, philox_word
from .dropout import draw


@functools.lru_cache(maxsize=None)
def _kernels(kind, has_a, has_drop, version):
    ld, st = ldst(kind)
    A = acc_np(kind)
    zero, one = A(0), A(1)
    acc = C.acc_nb(kind)
    mul = C.mul_rn(kind)        # wdy = dout * w: the same rounded product in both passes, never fused into an fma

    @cuda.jit(device=True)
    def sval(x, a, r, j, seed, stream, thr, sc):     # s = x + a * keep * scale, in the accumulation type
        v = ld(x[r, j])
        if has_a:
            av = ld(a[r, j])
            if has_drop:
                av = av * (sc if philox_word(r * x.shape[1] + j, stream, seed) >= thr else zero)
            v = v + av
        return v

    if version == 1:
        @C.jit_kernel
        def forward(x, a, seed, stream, thr, scale, w, b, eps, out, mean, rstd):
            r = cuda.grid(1)
            R, Cn = x.shape
            if r >= R:
                return
            sc = A(scale)
            s = zero
            for j in range(Cn):
                s += sval(x, a, r, j, seed, stream, thr, sc)
            m = s / A(Cn)
            q = zero
            for j in range(Cn):
                d = sval(x, a, r, j, seed, stream, thr, sc) - m
                q += d * d
            rs = one / math.sqrt(q / A(Cn) + A(eps))
            for j in range(Cn):
                out[r, j] = st((sval(x, a, r, j, seed, stream, thr, sc) - m) * rs * ld(w[j]) + ld(b[j]))
            mean[r] = m
            rstd[r] = rs

        @C.jit_kernel
        def backward(dout, x, a, seed, stream, thr, scale, w, mean, rstd, dx, da):
            r = cuda.grid(1)
            R, Cn = x.shape
            if r >= R:
                return
            sc = A(scale)
            m, rs = mean[r], rstd[r]
            c1, c2 = zero, zero
            for j in range(Cn):
                xh = (sval(x, a, r, j, seed, stream, thr, sc) - m) * rs
                wdy = mul(ld(dout[r, j]), ld(w[j]))
                c1 += wdy * xh
                c2 += wdy
            c1 /= A(Cn)
            c2 /= A(Cn)
            for j in range(Cn):
                xh = (sval(x, a, r, j, seed, stream, thr, sc) - m) * rs
                d = (mul(ld(dout[r, j]), ld(w[j])) - (xh * c1 + c2)) * rs
                dx[r, j] = st(d)
                if has_drop:
                    da[r, j] = st(d * (sc if philox_word(r * Cn + j, stream, seed) >= thr else zero))
    else:
        @C.jit_kernel
        def forward(x, a, seed, stream, thr, scale, w, b, eps, out, mean, rstd):
            buf = cuda.shared.array(BLOCK, acc)
            r = cuda.blockIdx.x
            t = cuda.threadIdx.x
            Cn = x.shape[1]
            sc = A(scale)
            s = zero
            for j in range(t, Cn, BLOCK):
                s += sval(x, a, r, j, seed, stream, thr, sc)
            m = C.block_sum(s, buf) / A(Cn)
            q = zero
            for j in range(t, Cn, BLOCK):
                d = sval(x, a, r, j, seed, stream, thr, sc) - m
                q += d * d
            rs = one / math.sqrt(C.block_sum(q, buf) / A(Cn) + A(eps))
            for j in range(t, Cn, BLOCK):
                out[r, j] = st((sval(x, a, r, j, seed, stream, thr, sc) - m) * rs * ld(w[j]) + ld(b[j]))
            if t == 0:
                mean[r] = m
                rstd[r] = rs

        @C.jit_kernel
        def backward(dout, x, a, seed, stream, thr, scale, w, mean, rstd, dx, da):
            buf = cuda.shared.array(BLOCK, acc)
            r = cuda.blockIdx.x
            t = cuda.threadIdx.x
            Cn = x.shape[1]
            sc = A(scale)
            m, rs = mean[r], rstd[r]
            c1, c2 = zero, zero
            for j in range(t, Cn, BLOCK):
                xh = (sval(x, a, r, j, seed, stream, thr, sc) - m) * rs
                wdy = mul(ld(dout[r, j]), ld(w[j]))
                c1 += wdy * xh
                c2 += wdy
            c1 = C.block_sum(c1, buf) / A(Cn)
            c2 = C.block_sum(c2, buf) / A(Cn)
            for j in range(t, Cn, BLOCK):
                xh = (sval(x, a, r, j, seed, stream, thr, sc) - m) * rs
                d = (mul(ld(dout[r, j]), ld(w[j])) - (xh * c1 + c2)) * rs
                dx[r, j] = st(d)
                if has_drop:
                    da[r, j] = st(d * (sc if philox_word(r * Cn + j, stream, seed) >= thr else zero))

    @C.jit_kernel
    def partials(dout, x, a, seed, stream, thr, scale, mean, rstd, per, pw, pb):
        i = cuda.grid(1)
        n, Cn = pw.shape
        if i >= n * Cn:
            return
        ch, j = i // Cn, i % Cn
        sc = A(scale)
        sw, sb = zero, zero
        for r in range(ch * per, min(x.shape[0], (ch + 1) * per)):
            dy = ld(dout[r, j])
            sw += dy * (sval(x, a, r, j, seed, stream, thr, sc) - mean[r]) * rstd[r]
            sb += dy
        pw[ch, j] = sw
        pb[ch, j] = sb
    return forward, backward, partials


def _launch(version, R):
    return (C.grid_for(R, BLOCK), BLOCK) if version == 1 else (R, BLOCK)


def _check_ln(x, w, b, eps):
    V.required("layernorm", w=w, b=b)
    C.floats("layernorm", x=x, w=w, b=b)
    V.min_ndim("layernorm", "x", x, 1, "(..., C)")
    V.shape("layernorm", "w", C.stub(w), (x.shape[-1],), "(C,)")
    V.shape("layernorm", "b", C.stub(b), (x.shape[-1],), "(C,)")
    V.layernorm_eps("layernorm", x, eps)


_NODROP = (np.uint64(0), np.uint64(0), np.uint64(0), 1.0)


def _run_forward(version, x, a, drop, w, b, eps):
    xp = C.xp_of(x)
    Cn = x.shape[-1]
    x2 = xp.ascontiguousarray(x).reshape(-1, Cn)
    a2 = None if a is None else xp.ascontiguousarray(a).reshape(-1, Cn)
    R = x2.shape[0]
    kind = C.kind_of(x.dtype)
    out = xp.empty(x.shape, x.dtype)
    mean, rstd = xp.empty(R, acc_np(kind)), xp.empty(R, acc_np(kind))
    seed, stream, thr, scale = drop or _NODROP
    if R and Cn:
        fwd = _kernels(kind, a is not None, drop is not None, version)[0]
        grid, block = _launch(version, R)
        dx2 = C.din(x2)
        fwd[grid, block](dx2, dx2 if a2 is None else C.din(a2), seed, stream, thr, float(scale), C.din(w), C.din(b),
                         float(eps), C.dev(out.reshape(R, Cn)), C.dev(mean), C.dev(rstd))
    return out, (version, x2, a2, drop, w, mean, rstd, x.shape)


def _run_backward(dout, cache, with_da):
    version, x2, a2, drop, w, mean, rstd, shape = cache
    C.dout("layernorm", dout, shape, x2.dtype)
    xp = C.xp_of(x2)
    R, Cn = x2.shape
    kind = C.kind_of(x2.dtype)
    dx = xp.empty(shape, x2.dtype)
    da = xp.empty(shape, x2.dtype) if with_da else None
    dw, db = xp.zeros(Cn, x2.dtype), xp.zeros(Cn, x2.dtype)
    if R == 0 or Cn == 0:
        return dx, da, dw, db
    seed, stream, thr, scale = drop or _NODROP
    fwd, bwd, partials = _kernels(kind, a2 is not None, drop is not None, version)
    d2, xd = C.din(xp.ascontiguousarray(dout).reshape(R, Cn)), C.din(x2)
    ad = xd if a2 is None else C.din(a2)
    md, rd = C.din(mean), C.din(rstd)
    grid, block = _launch(version, R)
    bwd[grid, block](d2, xd, ad, seed, stream, thr, float(scale), C.din(w), md, rd, C.dev(dx.reshape(R, Cn)),
                     C.dev(da.reshape(R, Cn) if with_da else xp.empty((1, 1), x2.dtype)))
    per, n = C.chunks(R)
    pw, pb = xp.empty((n, Cn), acc_np(kind)), xp.empty((n, Cn), acc_np(kind))
    partials[C.grid_for(n * Cn, BLOCK), BLOCK](d2, xd, ad, seed, stream, thr, float(scale), md, rd, per,
                                               C.dev(pw), C.dev(pb))
    colsum = C.column_sum_kernel("f64" if kind == "f64" else "f32", kind)
    colsum[C.grid_for(Cn, BLOCK), BLOCK](C.din(pw), C.dev(dw))
    colsum[C.grid_for(Cn, BLOCK), BLOCK](C.din(pb), C.dev(db))
    return dx, da, dw, db


def _layernorm_forward(version, x, w, b, eps):
    _check_ln(x, w, b, eps)
    return _run_forward(version, x, None, None, w, b, eps)


def _layernorm_backward(dout, cache):
    dx, _, dw, db = _run_backward(dout, cache, False)
    return dx, dw, db


def _residual_forward(version, x, a, w, b, eps):
    C.floats("residual_layernorm", x=x, a=a)
    V.shape("residual_layernorm", "a", C.stub(a), x.shape, "(same as x)")
    _check_ln(x, w, b, eps)
    return _run_forward(version, x, a, None, w, b, eps)


def _residual_backward(dout, cache):
    ds, _, dw, db = _run_backward(dout, cache, False)
    return ds, ds, dw, db                            # the sum copies ds to both inputs: one array, as the oracle


def _dropout_residual_forward(version, x, a, w, b, eps, p, rng, train):
    C.floats("dropout_residual_layernorm", x=x, a=a)
    V.shape("dropout_residual_layernorm", "a", C.stub(a), x.shape, "(same as x)")
    C.floats("dropout", x=a)
    drop = draw(rng, p, train)                       # the oracle draws the stream before layernorm's checks
    _check_ln(x, w, b, eps)
    return _run_forward(version, x, a, drop, w, b, eps)


def _dropout_residual_backward(dout, cache):
    dropped = cache[3] is not None
    ds, da, dw, db = _run_backward(dout, cache, dropped)
    return ds, (da if dropped else ds.copy()), dw, db   # eval / p = 0: da is a copy of ds, as dropout_backward


def layernorm_forward_v1(x, w, b, eps=1e-12):
    return _layernorm_forward(1, x, w, b, eps)


def layernorm_forward_v2(x, w, b, eps=1e-12):
    return _layernorm_forward(2, x, w, b, eps)


def residual_layernorm_forward_v1(x, a, w, b, eps=1e-12):
    return _residual_forward(1, x, a, w, b, eps)


def residual_layernorm_forward_v2(x, a, w, b, eps=1e-12):
    return _residual_forward(2, x, a, w, b, eps)


def dropout_residual_layernorm_forward_v1(x, a, w, b, eps=1e-12, p=0.0, rng=None, train=True):
    return _dropout_residual_forward(1, x, a, w, b, eps, p, rng, train)


def dropout_residual_layernorm_forward_v2(x, a, w, b, eps=1e-12, p=0.0, rng=None, train=True):
    return _dropout_residual_forward(2, x, a, w, b, eps, p, rng, train)


# the cache names its version, so one backward serves every version of an op
layernorm_backward_v1 = layernorm_backward_v2 = _layernorm_backward
residual_layernorm_backward_v1 = residual_layernorm_backward_v2 = _residual_backward
dropout_residual_layernorm_backward_v1 = dropout_residual_layernorm_backward_v2 = _dropout_residual_backward

layernorm_forward, layernorm_backward = layernorm_forward_v2, layernorm_backward_v2
residual_layernorm_forward, residual_layernorm_backward = residual_layernorm_forward_v2, residual_layernorm_backward_v2
dropout_residual_layernorm_forward = dropout_residual_layernorm_forward_v2
dropout_residual_layernorm_backward = dropout_residual_layernorm_backward_v2


def make_inputs(shape, dtype, seed):
    """As kernels/layernorm.py's make_inputs: dict(lead=tuple, C=int, kind in {"ln", "res", "drop"}, p, train)."""
    return _cpu_make_inputs(shape, dtype, seed)


def _nbytes(inputs, kwargs):
    n = inputs["x"].nbytes                           # as kernels/layernorm.py's napkin count
    if "a" not in inputs:
        return 5 * n
    return (8 if kwargs.get("p", 0) > 0 and kwargs.get("train", True) else 7) * n


_TOL = {np.float64: (1e-12, 1e-11), np.float32: (1e-5, 1e-4)}
_SHAPES = [dict(lead=(1,), C=1), dict(lead=(3,), C=37)]
_GPU = [dict(lead=(1,), C=1), dict(lead=(3,), C=37), dict(lead=(2, 5), C=52), dict(lead=(1, 1), C=768),
        dict(lead=(67,), C=5), dict(lead=(130,), C=33)]
_NOTES = {1: "a thread per row, 3 passes", 2: "a block per row, shared-memory tree sums"}


def _spec(name, kind, versions, oracle, wrt, extra=()):
    return KernelSpec(
        name=name, oracle=oracle, versions=versions, make_inputs=make_inputs, wrt=wrt,
        shapes=[dict(s, kind=kind) for s in _SHAPES] + list(extra), bench_shape=dict(lead=(4 * 512,), C=768, kind=kind),
        tol=_TOL, nbytes=_nbytes,
        notes={**_NOTES, "gpu_shapes": [dict(s, kind=kind) for s in _GPU] + list(extra)})


SPEC = _spec("layernorm", "ln",
             {1: (layernorm_forward_v1, layernorm_backward_v1), 2: (layernorm_forward_v2, layernorm_backward_v2)},
             (ops.layernorm_forward, ops.layernorm_backward), ("x", "w", "b"))
SPEC_RESIDUAL = _spec("residual_layernorm", "res",
                      {1: (residual_layernorm_forward_v1, residual_layernorm_backward_v1),
                       2: (residual_layernorm_forward_v2, residual_layernorm_backward_v2)},
                      (ops.residual_layernorm_forward, ops.residual_layernorm_backward), ("x", "a", "w", "b"))
SPEC_DROPOUT = _spec("dropout_residual_layernorm", "drop",
                     {1: (dropout_residual_layernorm_forward_v1, dropout_residual_layernorm_backward_v1),
                      2: (dropout_residual_layernorm_forward_v2, dropout_residual_layernorm_backward_v2)},
                     (ops.dropout_residual_layernorm_forward, ops.dropout_residual_layernorm_backward),
                     ("x", "a", "w", "b"),
                     extra=[dict(lead=(2, 3), C=7, kind="drop", p=1.0), dict(lead=(2,), C=5, kind="drop", train=False)])

SPECS = [SPEC, SPEC_RESIDUAL, SPEC_DROPOUT]

if __name__ == "__main__":
    C.check_specs(SPECS, "sim" if C.SIM else "gpu")
