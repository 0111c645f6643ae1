"""Oracle: refbert.ops.softmax_forward / refbert.ops.softmax_backward — p = softmax(x * scale + mask) over the last
axis and dx = scale * p * (dout - sum(dout * p)), in Numba CUDA.

    x: (..., T) seen as (R, T) rows   mask: additive, broadcastable to x; never broadcast to x's size: its own rows
    (Rm, T) are made contiguous and mrow (R,) names the mask row of each score row (as kernels/softmax.py)
    forward, per row:   z = x * scale + mask;  m = max(z);  p = exp(z - m) / sum(exp(z - m))
    backward, per row:  d = sum(dout * p);  dx = scale * p * (dout - d)
A row whose maximum is not finite (NaN, +inf, or every entry -inf) sets bad[r]; the wrapper raises the oracle's
ValueError after the launch (the one check that needs the data).

Versions (llm.c dev/cuda style; `python -m refbert_kernels.cuda.softmax` validates every version):
    1  a thread per row: three passes (max, sum of exp, write), each recomputing z from x and the mask
    2  a block per row: each thread strides over the row, block max and block sum through shared memory (tree)
    3  a warp per row (WARPS rows per block): one pass keeps an online (max, sum) per lane — on a new max the
       sum is rescaled by exp(m_old - m_new) — merged across lanes with shuffles; a second pass writes p.
       Backward: warp-shuffle sum of dout * p, then the write.

Precisions: f64 and f32 compute in their own dtype; f16 / bf16 storage read into float32, every sum and exp in
float32, p rounded once on the store (the cache keeps p in storage, as a GPU training step would).
Tolerance: f64 atol 1e-12, rtol 1e-11 (summation order and exp vs NumPy's only); f32 atol 1e-6, rtol 1e-5
(CUDA's expf is within 2 ulp, float32 sums in another order, and NVVM may contract x * scale + mask into an fma:
one rounding fewer on z than the oracle, ~1 ulp of z; p <= 1 so 1e-6 absolute is ~8 ulp of the largest entry);
f16 / bf16: 4 ulp of the storage dtype (_common.lowp_tol: one rounding on the store, and the backward reads p
rounded to storage) against the float64 oracle on the same rounded inputs.
"""
import functools
import math

import numpy as np
from numba import cuda

from refbert import ops
from refbert import validate as V

from refbert_kernels._harness import KernelSpec, main  # noqa: F401
from refbert_kernels.softmax import make_inputs as _cpu_make_inputs

from . import _common as C
from ._common import BLOCK, WARP, WARPS, acc_np, ldst, shfl_xor

_NINF = -np.inf


# ----------------------------------------------------------------------------------------------------------------
# kernels, compiled per (storage kind, version): x (R, T), mask (Rm, T), mrow (R,) int64, out (R, T), bad (R,) int32

@functools.lru_cache(maxsize=None)
def _kernels(kind, version):
    ld, st = ldst(kind)
    A = acc_np(kind)
    zero, one, ninf, pinf = A(0), A(1), A(_NINF), A(np.inf)
    acc = C.acc_nb(kind)

    if version == 1:
        @C.jit_kernel
        def forward(x, scale, mask, mrow, out, bad):
            r = cuda.grid(1)
            R, T = x.shape
            if r >= R:
                return
            sc = A(scale)
            mr = mrow[r]
            m = ninf
            nan = False
            for j in range(T):                           # pass 1: the row maximum (and whether a NaN is present)
                z = ld(x[r, j]) * sc + ld(mask[mr, j])
                if z != z:
                    nan = True
                elif z > m:
                    m = z
            if nan or not (ninf < m < pinf):
                bad[r] = 1
                return
            bad[r] = 0
            s = zero
            for j in range(T):                           # pass 2: sum of exp(z - m)
                s += math.exp(ld(x[r, j]) * sc + ld(mask[mr, j]) - m)
            inv = one / s
            for j in range(T):                           # pass 3: p
                out[r, j] = st(math.exp(ld(x[r, j]) * sc + ld(mask[mr, j]) - m) * inv)

        @C.jit_kernel
        def backward(dout, p, scale, dx):
            r = cuda.grid(1)
            R, T = p.shape
            if r >= R:
                return
            d = zero
            for j in range(T):
                d += ld(dout[r, j]) * ld(p[r, j])
            sc = A(scale)
            for j in range(T):
                dx[r, j] = st(sc * ld(p[r, j]) * (ld(dout[r, j]) - d))
        return forward, backward

    if version == 2:
        @C.jit_kernel
        def forward(x, scale, mask, mrow, out, bad):
            buf = cuda.shared.array(BLOCK, acc)
            r = cuda.blockIdx.x                          # one block per row: R blocks
            t = cuda.threadIdx.x
            T = x.shape[1]
            sc = A(scale)
            mr = mrow[r]
            m = ninf
            nan = 0
            for j in range(t, T, BLOCK):                 # each thread: max over its strided entries
                z = ld(x[r, j]) * sc + ld(mask[mr, j])
                if z != z:
                    nan = 1
                elif z > m:
                    m = z
            nan = cuda.syncthreads_or(nan)
            m = C.block_max(m, buf)
            if nan or not (ninf < m < pinf):             # block-uniform: every thread returns together
                if t == 0:
                    bad[r] = 1
                return
            s = zero
            for j in range(t, T, BLOCK):
                s += math.exp(ld(x[r, j]) * sc + ld(mask[mr, j]) - m)
            s = C.block_sum(s, buf)
            inv = one / s
            for j in range(t, T, BLOCK):
                out[r, j] = st(math.exp(ld(x[r, j]) * sc + ld(mask[mr, j]) - m) * inv)
            if t == 0:
                bad[r] = 0

        @C.jit_kernel
        def backward(dout, p, scale, dx):
            buf = cuda.shared.array(BLOCK, acc)
            r = cuda.blockIdx.x
            t = cuda.threadIdx.x
            T = p.shape[1]
            d = zero
            for j in range(t, T, BLOCK):
                d += ld(dout[r, j]) * ld(p[r, j])
            d = C.block_sum(d, buf)
            sc = A(scale)
            for j in range(t, T, BLOCK):
                dx[r, j] = st(sc * ld(p[r, j]) * (ld(dout[r, j]) - d))
        return forward, backward

    @C.jit_kernel
    def forward(x, scale, mask, mrow, out, bad):
        lane = cuda.threadIdx.x % WARP
        r = cuda.blockIdx.x * WARPS + cuda.threadIdx.x // WARP
        R, T = x.shape
        active = r < R                                   # a tail warp still takes part in the shuffles
        sc = A(scale)
        mr = mrow[r] if active else 0
        m, s = ninf, zero
        if active:
            for j in range(lane, T, WARP):               # one pass: online max and rescaled sum per lane
                z = ld(x[r, j]) * sc + ld(mask[mr, j])
                if z != z:
                    m = pinf                             # a NaN makes the row bad, as +inf does: one flag less
                elif z > m:
                    s = s * math.exp(m - z) + one        # m = -inf at first: exp(-inf) = 0
                    m = z
                elif z > ninf:
                    s += math.exp(z - m)
        for k in (16, 8, 4, 2, 1):                       # merge (m, s) pairs across lanes
            m2 = shfl_xor(m, k)
            s2 = shfl_xor(s, k)
            mn = max(m, m2)
            if ninf < mn < pinf:
                s = s * math.exp(m - mn) + s2 * math.exp(m2 - mn)   # m, m2 > -inf unless that side's s = 0
            m = mn
        if not active:
            return
        if not (ninf < m < pinf):
            if lane == 0:
                bad[r] = 1
            return
        inv = one / s
        for j in range(lane, T, WARP):
            out[r, j] = st(math.exp(ld(x[r, j]) * sc + ld(mask[mr, j]) - m) * inv)
        if lane == 0:
            bad[r] = 0

    @C.jit_kernel
    def backward(dout, p, scale, dx):
        lane = cuda.threadIdx.x % WARP
        r = cuda.blockIdx.x * WARPS + cuda.threadIdx.x // WARP
        R, T = p.shape
        active = r < R
        d = zero
        if active:
            for j in range(lane, T, WARP):
                d += ld(dout[r, j]) * ld(p[r, j])
        d = C.warp_sum(d)
        if active:
            sc = A(scale)
            for j in range(lane, T, WARP):
                dx[r, j] = st(sc * ld(p[r, j]) * (ld(dout[r, j]) - d))
    return forward, backward


def _launch(version, R):
    """(grid, block) of a version over R rows."""
    if version == 1:
        return C.grid_for(R, BLOCK), BLOCK
    if version == 2:
        return R, BLOCK
    return C.grid_for(R, WARPS), WARPS * WARP


# ----------------------------------------------------------------------------------------------------------------
# host wrappers: the oracle's checks, then rows

def _rows(x, mask):
    """x as (R, T) contiguous; the mask's own rows (Rm, T) contiguous and mrow (R,) on x's device."""
    xp = C.xp_of(x)
    T = x.shape[-1]
    x2 = xp.ascontiguousarray(x).reshape(-1, T)
    R = x2.shape[0]
    if mask is None:
        return x2, xp.zeros((1, T), x.dtype), xp.zeros(R, np.int64)
    m = mask.reshape((1,) * (x.ndim - mask.ndim) + mask.shape)
    m2 = xp.ascontiguousarray(xp.broadcast_to(m, m.shape[:-1] + (T,))).reshape(-1, T)
    mrow = np.broadcast_to(np.arange(m2.shape[0]).reshape(m.shape[:-1]), x.shape[:-1]).reshape(-1)
    return x2, m2, C.to_xp(xp, np.ascontiguousarray(mrow, np.int64))


def _forward(version, x, scale, mask):
    C.floats("softmax", x=x, mask=mask)
    V.min_ndim("softmax", "x", x, 1, "(..., T)")
    scale = V.number("softmax", "scale", scale)
    if mask is not None:
        V.broadcasts_to("softmax", "mask", C.stub(mask), x.shape)
    if x.size == 0 or (isinstance(x, np.ndarray) and x.dtype.type in (np.float32, np.float64) and scale != 1.0
                       and np.result_type(x, scale) != x.dtype):
        return ops.softmax_forward(x, scale, mask)       # the oracle's own behaviour (empty, upcasting scale)
    xp = C.xp_of(x)
    x2, m2, mrow = _rows(x, mask)
    R, T = x2.shape
    p = xp.empty(x.shape, x.dtype)
    bad = xp.zeros(R, np.int32)
    grid, block = _launch(version, R)
    fwd, _ = _kernels(C.kind_of(x.dtype), version)
    fwd[grid, block](C.din(x2), float(scale), C.din(m2), C.din(mrow), C.dev(p.reshape(R, T)), bad)
    if int(bad.max()):
        raise ValueError("softmax: argument 'x' (with 'mask') expected every row to have a finite maximum, got a row "
                         "that is entirely -inf, or a NaN/+inf score")
    return p, ops.SoftmaxCache(p, scale)


def _backward(version, dout, cache):
    p, scale = cache
    C.dout("softmax", dout, p.shape, p.dtype)
    if p.size == 0 or (isinstance(p, np.ndarray) and p.dtype.type in (np.float32, np.float64) and scale != 1.0
                       and np.result_type(p, scale) != p.dtype):
        return ops.softmax_backward(dout, cache)
    xp = C.xp_of(p)
    T = p.shape[-1]
    R = p.size // T
    dx = xp.empty(p.shape, p.dtype)
    grid, block = _launch(version, R)
    _, bwd = _kernels(C.kind_of(p.dtype), version)
    bwd[grid, block](C.din(xp.ascontiguousarray(dout).reshape(R, T)), C.din(p.reshape(R, T)), float(scale),
                     C.dev(dx.reshape(R, T)))
    return dx


def softmax_forward_v1(x, scale=1.0, mask=None):
    return _forward(1, x, scale, mask)


def softmax_backward_v1(dout, cache):
    return _backward(1, dout, cache)


def softmax_forward_v2(x, scale=1.0, mask=None):
    return _forward(2, x, scale, mask)


def softmax_backward_v2(dout, cache):
    return _backward(2, dout, cache)


def softmax_forward_v3(x, scale=1.0, mask=None):
    return _forward(3, x, scale, mask)


def softmax_backward_v3(dout, cache):
    return _backward(3, dout, cache)


softmax_forward, softmax_backward = softmax_forward_v3, softmax_backward_v3   # the best version


# ----------------------------------------------------------------------------------------------------------------
# spec

def make_inputs(shape, dtype, seed):
    """As kernels/softmax.py's make_inputs (dict(B, H, T, mask, scale)); "pad" uses the dtype's most negative
    number (-inf once rounded to fp16 / bf16, which the oracle handles the same way). Tq, if given, keeps only the
    first Tq query rows of the (B, H, T, T) scores: rows of length T without T of them (the simulator's cost)."""
    inputs, kw = _cpu_make_inputs(shape, dtype, seed)
    tq = shape.get("Tq")
    if tq is not None:
        inputs["x"] = np.ascontiguousarray(inputs["x"][..., :tq, :])
        if inputs["mask"] is not None and inputs["mask"].shape[-2] > 1:
            inputs["mask"] = np.ascontiguousarray(inputs["mask"][..., :tq, :])
    return inputs, kw


SPEC = KernelSpec(
    name="softmax",
    oracle=(ops.softmax_forward, ops.softmax_backward),
    versions={1: (softmax_forward_v1, softmax_backward_v1), 2: (softmax_forward_v2, softmax_backward_v2),
              3: (softmax_forward_v3, softmax_backward_v3)},
    make_inputs=make_inputs,
    wrt=("x",),
    # simulator shapes: T = 1, a padded batch whose row 0 has one real token, rows of 5 .. 33 (warp and block
    # tails: 33 = 32 + 1), an odd row count (tail warp of v3), a full -inf mask, scale 1
    shapes=[dict(B=1, H=1, T=1), dict(B=2, H=1, T=5, mask="one", Tq=2), dict(B=1, H=3, T=7, mask="pad", Tq=1),
            dict(B=1, H=1, T=33, mask="full", Tq=3), dict(B=1, H=1, T=9, scale=1.0, Tq=1)],
    bench_shape=dict(B=4, H=12, T=512, mask="pad"),
    tol={np.float64: (1e-12, 1e-11), np.float32: (1e-6, 1e-5)},
    nbytes=lambda inp, kw: 5 * inp["x"].nbytes,   # forward reads x, writes p; backward reads p, dout, writes dx
    notes={1: "a thread per row, 3 passes", 2: "a block per row, shared-memory tree max and sum",
           3: "a warp per row, online max/sum in one pass, shuffles",
           "gpu_shapes": [dict(B=2, H=3, T=37, mask="pad"), dict(B=2, H=5, T=130, mask="full"),
                          dict(B=3, H=2, T=513, mask="one"), dict(B=1, H=1, T=1)]},
)

SPECS = [SPEC]

if __name__ == "__main__":
    C.check_specs(SPECS, "sim" if C.SIM else "gpu")
