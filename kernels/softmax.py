"""Oracle: refbert.ops.softmax_forward / refbert.ops.softmax_backward — p = softmax(x * scale + mask) over the last
axis, and dx = scale * p * (dout - sum(dout * p)), fused into one Numba kernel per direction.

    x: (..., T) seen as (R, T) rows   mask: additive, broadcastable to x (the model's (B, 1, 1, T), None, or x's shape)
    forward, per row:   z = x * scale + mask;  m = max(z);  e = exp(z - m);  p = e / sum(e)
    backward, per row:  d = sum(dout * p);  dx = scale * p * (dout - d)

The mask is never broadcast to x's size: its own rows (prod of its leading dims, e.g. B) are made contiguous at
length T, and `mrow[r]` names the mask row of score row r. A row of T <= a few thousand stays in L1, so each pass
after the first reads it from cache: a forward moves x in and p out, a backward p and dout in and dx out.

Versions (python -m refbert_kernels.softmax validates each against the oracle, then times it):
    1  one row per prange iteration, math.exp (a scalar libm call: the exp loop does not vectorise), 3 passes that
       recompute z from x and the mask, float64 sums, no fast-math
    2  SIMD passes: the max pass stores z into p's row (L1) and reduces it with llvm.maximum (a max reduction LLVM
       vectorises, NaN-propagating like np.max); e = exp(z - m) with _math.exp (float32 polynomial) reads z back;
       multiply by 1/sum; row sums in the dtype (v1's are float64: half the SIMD width for float32)
    3  as 2, with exp_lanes: the same polynomial in float32 arithmetic with np.rint range reduction, so float32
       rows run 16 lanes wide instead of 8 (the exp pass is ~90% of the forward's compute); <= 4.2 ulp

Tolerance (the spec's tol): float64 atol 1e-12, rtol 1e-11 — math.exp as the oracle; only summation order (LLVM
splits each row sum over SIMD lanes) and p * (1/s) for e / s differ. float32 atol 1e-6, rtol 1e-5 — the polynomial
exp is within 1 ulp (v3's within 4.2 ulp, 5e-7 relative) and the row sums are float32 in a different order
(T / 16 terms per lane: ~1e-7 relative); p <= 1, so 1e-6 absolute is ~8 ulp of the largest entry.
Row sums: v1 accumulates in float64; v2 and v3 in the input's dtype (float32 for float32, 16 SIMD lanes): the error
above is far inside the tolerance.
fastmath (v2): {'reassoc', 'contract', 'arcp', 'nsz'} — never 'nnan'/'ninf': masks hold -inf (or the dtype's most
negative number), and a NaN/+inf/all -inf row must reach the same ValueError as the oracle's. In a row masked
everywhere by finfo.min, z = finfo.min for every entry and p is uniform; 'reassoc' applied to z - m written as one
expression would compute x * scale + (mask - m) = x * scale and give softmax(x * scale) instead, so v2 subtracts m
from z read back from memory, never from the expression that made it. ('contract' only fuses x * scale + mask
into an fma, which rounds like the oracle's two steps wherever the mask is 0 and to the same mask value where it
is huge; it also lets the exp polynomial use FMAs: Numba compiles callees with the caller's flags.) v1 has none.
"""
import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from refbert import ops
from refbert import validate as V

from ._harness import KernelSpec, main, read_only
from ._math import bits_to_f32, exp, fmaximum
from .dropout import like

FASTMATH = {"reassoc", "contract", "arcp", "nsz"}   # no 'nnan'/'ninf': -inf masks, and bad rows must be seen


def exp_lanes(x):
    """exp(x) for v3: float32 arithmetic throughout (16 lanes of AVX-512; _math.exp reduces in float64, 8 lanes),
    math.exp for float64. (A candidate for _math.py.)"""
    return math.exp(x)


@overload(exp_lanes)
def _exp_lanes(x):
    if isinstance(x, types.Float) and x.bitwidth == 32:
        def impl(x):
            # k = rint(x / ln2) in float32 (np.rint vectorises; math.floor returns int64 and widens to float64),
            # r = x - k ln2 (Cody-Waite, ln2_hi exact in 16 bits), then the degree-7 Taylor polynomial of _math.exp,
            # all in float32: measured <= 4.2 ulp over [-87, 88], against 0.5 ulp for _math.exp
            xc = min(max(x, np.float32(-87.33654)), np.float32(88.72283))
            k = np.rint(xc * np.float32(1.4426950408889634))
            r = (xc - k * np.float32(0.693145751953125)) - k * np.float32(1.4286068203094172e-06)
            p = np.float32(1.0 / 5040)
            p = p * r + np.float32(1.0 / 720)
            p = p * r + np.float32(1.0 / 120)
            p = p * r + np.float32(1.0 / 24)
            p = p * r + np.float32(1.0 / 6)
            p = p * r + np.float32(0.5)
            p = p * r + np.float32(1.0)
            p = p * r + np.float32(1.0)
            y = p * bits_to_f32((np.int32(k) + np.int32(127)) << np.int32(23))
            return np.float32(0.0) if x < np.float32(-87.33654) else y     # underflow and -inf -> 0
        return impl
    if isinstance(x, types.Float):
        return lambda x: math.exp(x)


# ----------------------------------------------------------------------------------------------------------------
# kernels: x, mask, out are C-contiguous (R, T), (Rm, T), (R, T); mrow (R,) int64; return the number of bad rows

@njit(parallel=True, cache=True)               # no fast-math: z is recomputed, and must round as the oracle's
def _forward_v1(x, scale, mask, mrow, out):
    R, T = x.shape
    nbad = 0
    for r in prange(R):
        mk = mask[mrow[r]]
        m = -np.inf
        nan = False
        for j in range(T):                       # pass 1: the row maximum (and whether a NaN is present)
            z = x[r, j] * scale + mk[j]
            if z != z:
                nan = True
            elif z > m:
                m = z
        if nan or not (-np.inf < m < np.inf):
            nbad += 1
            continue
        s = 0.0
        for j in range(T):                       # pass 2: e = exp(z - m), summed
            e = math.exp(x[r, j] * scale + mk[j] - m)
            out[r, j] = e
            s += e
        for j in range(T):                       # pass 3: p = e / s
            out[r, j] = out[r, j] / s
    return nbad


@njit(parallel=True, cache=True)
def _backward_v1(dout, p, scale, dx):
    R, T = p.shape
    for r in prange(R):
        d = 0.0
        for j in range(T):                       # d = sum(dout * p), in float64
            d += dout[r, j] * p[r, j]
        for j in range(T):                       # dx = scale * p * (dout - d)
            dx[r, j] = scale * p[r, j] * (dout[r, j] - d)


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def _backward_v2(dout, p, scale, dx):
    R, T = p.shape
    for r in prange(R):
        pr, dy, g = p[r], dout[r], dx[r]
        d = like(scale, 0)
        for j in range(T):                       # d = sum(dout * p) in the dtype: full-width SIMD
            d += dy[j] * pr[j]
        for j in range(T):
            g[j] = scale * pr[j] * (dy[j] - d)


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def _forward_v2(x, scale, mask, mrow, out):
    R, T = x.shape
    nbad = 0
    for r in prange(R):
        xr, mk, o = x[r], mask[mrow[r]], out[r]
        m = xr[0] * scale + mk[0]
        for j in range(T):                       # z into p's row (L1), its max NaN-propagating (llvm.maximum)
            z = xr[j] * scale + mk[j]
            o[j] = z
            m = fmaximum(m, z)
        if not (-np.inf < m < np.inf):           # NaN, +inf, or a row that is entirely -inf
            nbad += 1
            continue
        s = like(m, 0)
        for j in range(T):                       # e = exp(z - m), z read back rounded (see the docstring)
            e = exp(o[j] - m)
            o[j] = e
            s += e
        inv = like(s, 1) / s
        for j in range(T):
            o[j] *= inv
    return nbad


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def _forward_v3(x, scale, mask, mrow, out):
    R, T = x.shape
    nbad = 0
    for r in prange(R):
        xr, mk, o = x[r], mask[mrow[r]], out[r]
        m = xr[0] * scale + mk[0]
        for j in range(T):
            z = xr[j] * scale + mk[j]
            o[j] = z
            m = fmaximum(m, z)
        if not (-np.inf < m < np.inf):
            nbad += 1
            continue
        s = like(m, 0)
        for j in range(T):                       # as v2, with the float32-lane exp
            e = exp_lanes(o[j] - m)
            o[j] = e
            s += e
        inv = like(s, 1) / s
        for j in range(T):
            o[j] *= inv
    return nbad


# ----------------------------------------------------------------------------------------------------------------
# launchers: the oracle's checks, then rows

def _check_forward(x, scale, mask):
    """The oracle's checks; the scale as the oracle takes it (a Python float)."""
    V.required("softmax", x=x)
    V.floats("softmax", x=x, mask=mask)
    V.min_ndim("softmax", "x", x, 1, "(..., T)")
    scale = V.number("softmax", "scale", scale)
    if mask is not None:
        V.broadcasts_to("softmax", "mask", mask, x.shape)
    return scale


def _oracle_case(x, scale):
    """Inputs the kernels leave to the oracle: empty arrays (the oracle's own behaviour, errors included). (A scale
    that would upcast x cannot come any more: the forward takes it as a Python float, as the oracle does.)"""
    return x.size == 0 or (scale != 1.0 and np.result_type(x, scale) != x.dtype)


def _rows(x, mask):
    """x as (R, T) contiguous; the mask as its own rows (Rm, T) contiguous, and mrow (R,): score row -> mask row.
    The mask rows and mrow are always read-only views: Numba compiles a kernel once per argument type, and a
    writable and a read-only array are two types (a user's mask may come either way), so one compile per dtype."""
    T = x.shape[-1]
    x2 = np.ascontiguousarray(x).reshape(-1, T)                 # (R, T)
    if mask is None:
        return x2, read_only(np.zeros((1, T), x.dtype)), read_only(np.zeros(len(x2), np.int64))
    m = mask.reshape((1,) * (x.ndim - mask.ndim) + mask.shape)  # left-pad to x.ndim dims
    m2 = np.ascontiguousarray(np.broadcast_to(m, m.shape[:-1] + (T,))).reshape(-1, T)  # (Rm, T)
    mrow = np.broadcast_to(np.arange(len(m2)).reshape(m.shape[:-1]), x.shape[:-1]).reshape(-1)  # (R,)
    return x2, read_only(m2), read_only(np.ascontiguousarray(mrow, np.int64))


def _forward(kernel, x, scale, mask):
    scale = _check_forward(x, scale, mask)
    if _oracle_case(x, scale):
        return ops.softmax_forward(x, scale, mask)
    x2, m2, mrow = _rows(x, mask)
    p = np.empty(x.shape, x.dtype)
    if kernel(x2, x.dtype.type(scale), m2, mrow, p.reshape(x2.shape)):
        raise ValueError("softmax: argument 'x' (with 'mask') expected every row to have a finite maximum, got a row "
                         "that is entirely -inf, or a NaN/+inf score")
    return p, (p, scale)


def _backward(kernel, dout, cache):
    p, scale = ops._cache("softmax", cache, 2)
    V.dout("softmax", dout, p.shape, p.dtype)
    if _oracle_case(p, scale):
        return ops.softmax_backward(dout, cache)
    T = p.shape[-1]
    dx = np.empty(p.shape, p.dtype)
    kernel(np.ascontiguousarray(dout).reshape(-1, T), p.reshape(-1, T), p.dtype.type(scale), dx.reshape(-1, T))
    return dx


def softmax_forward_v1(x, scale=1.0, mask=None):
    return _forward(_forward_v1, x, scale, mask)


def softmax_backward_v1(dout, cache):
    return _backward(_backward_v1, dout, cache)


def softmax_forward_v2(x, scale=1.0, mask=None):
    return _forward(_forward_v2, x, scale, mask)


def softmax_backward_v2(dout, cache):
    return _backward(_backward_v2, dout, cache)


def softmax_forward_v3(x, scale=1.0, mask=None):
    return _forward(_forward_v3, x, scale, mask)


softmax_backward_v3 = softmax_backward_v2          # v3 changes the forward's exp only

softmax_forward, softmax_backward = softmax_forward_v3, softmax_backward_v3   # the best version


# ----------------------------------------------------------------------------------------------------------------
# spec: validation shapes, tolerances, napkin bytes, torch peer

def make_inputs(shape, dtype, seed):
    """shape: dict(B, H, T, mask) with mask in {None, "pad", "full", "one"}: "pad" is HF's (B, 1, 1, T) with the
    dtype's most negative number on a random tail, "one" leaves row 0 a single real token (the rest -inf),
    "full" is a mask of x's shape with -inf entries."""
    r = np.random.default_rng(seed)
    B, H, T = shape["B"], shape["H"], shape["T"]
    x = (r.standard_normal((B, H, T, T)) * 3).astype(dtype)
    kind, mask = shape.get("mask"), None
    if kind == "pad":
        mask = np.zeros((B, 1, 1, T), dtype)
        for b in range(B):
            mask[b, ..., r.integers(1, T + 1):] = np.finfo(dtype).min
    elif kind == "one":
        mask = np.zeros((B, 1, 1, T), dtype)
        mask[0, ..., 1:] = -np.inf
    elif kind == "full":
        mask = np.where(r.random((B, H, T, T)) < 0.3, -np.inf, 0).astype(dtype)
        mask[..., 0] = 0
    return dict(x=x, scale=shape.get("scale", 0.125), mask=mask), {}


def _nbytes(inputs, kwargs):
    # forward reads x and writes p; backward reads p and dout and writes dx: 5 arrays of x's size (mask: B*T, small)
    return 5 * inputs["x"].nbytes


def _torch_peer(inputs, kwargs):
    import torch
    x = torch.from_numpy(inputs["x"]).requires_grad_()
    mask = None if inputs["mask"] is None else torch.from_numpy(inputs["mask"])
    scale = inputs["scale"]
    dout = torch.randn(x.shape, dtype=x.dtype)

    def step():
        z = x * scale if mask is None else x * scale + mask
        p = torch.softmax(z, -1)
        (dx,) = torch.autograd.grad(p, x, dout)
    return step


SPEC = KernelSpec(
    name="softmax",
    oracle=(ops.softmax_forward, ops.softmax_backward),
    versions={1: (softmax_forward_v1, softmax_backward_v1), 2: (softmax_forward_v2, softmax_backward_v2),
              3: (softmax_forward_v3, softmax_backward_v3)},
    make_inputs=make_inputs,
    wrt=("x",),
    shapes=[dict(B=1, H=1, T=1), dict(B=1, H=1, T=1, mask="pad"), dict(B=3, H=1, T=37, mask="pad"),
            dict(B=2, H=5, T=52, mask="full"), dict(B=2, H=3, T=17, mask="one"), dict(B=1, H=3, T=33, scale=1.0),
            dict(B=2, H=1, T=130, mask="pad")],
    bench_shape=dict(B=4, H=12, T=512, mask="pad"),
    tol={np.float64: (1e-12, 1e-11), np.float32: (1e-6, 1e-5)},
    nbytes=_nbytes,
    torch_peer=_torch_peer,
    notes={1: "one row per prange, math.exp, 3 passes", 2: "llvm.maximum, z kept in p, polynomial exp: SIMD",
           3: "as 2 with a float32-lane exp (np.rint): 16 lanes"},
)

if __name__ == "__main__":
    main(SPEC)
