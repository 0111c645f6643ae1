"""GELU and bias + GELU (the feed-forward's first activation), forward and backward fused on the CPU (Numba).

Oracle: refbert.ops.gelu_forward / gelu_backward and refbert.ops.bias_gelu_forward / bias_gelu_backward
(approximate="none": exact x Phi(x), HF "gelu"; approximate="tanh": HF "gelu_new").

    forward:   u = x + b;  out = u * Phi(u)      tanh: Phi(u) ~ s = sigmoid(2 sqrt(2/pi) (u + 0.044715 u^3))
    backward:  du = dout * (Phi(u) + u * phi(u)),  phi(u) = exp(-u^2 / 2) / sqrt(2 pi)
               tanh: du = dout * (s + 2 u s (1 - s) sqrt(2/pi) (1 + 3 * 0.044715 u^2))
               dx = du;  db = sum of du over every row: per-chunk partials (fixed chunks of _ROWS rows, float64),
               then one fixed-order sum over the chunks, so db is the same bits whatever the thread count.
The cache is (x, b, approximate): the backward recomputes u = x + b and Phi on the fly, so neither u, out nor
Phi is stored: the forward moves x -> out, the backward dout, x -> dx, the minimum (5 N I items).

Versions (run: python -m refbert_kernels.gelu):
  1: a prange over row chunks, math.erfc / math.exp per element (scalar libm calls: the loop stays scalar)
  2: the same loops with _math.ndtr / _math.sigmoid / _math.exp, which vectorise (float32); float64 as v1
  3: float32 computes Phi and phi from ONE exponential in float64 registers (v2 pays two: one inside ndtr and
     one for phi), so the backward costs one exp + one short polynomial per element; float64 as v1
  4: float32 in float32 registers (16 lanes, not 8): _math.phi_parts_f32 gives Phi and exp(-u^2/2) from one
     exp_f32 and one reciprocal (v3: two float64 divisions), Phi to 5.8 ulp instead of 0.5; plain gelu runs on
     the flat array in blocks of _BLOCK elements (v1-v3 ran it as ONE row of numel entries, which their row
     chunks gave to a single thread); db's float64 partials added in a loop of their own; below PARALLEL_MIN
     elements the same loops on the calling thread (no workqueue wake-up); float64 as v2

Tolerances (|got - ref| <= atol + rtol |ref|):
  float64 atol 1e-12, rtol 1e-11: math.erfc vs scipy ndtr (~1e-16 relative, x 1/sqrt 2 rounding grows it by
          u^2 in the tails), the oracle's Phi = out / x in its backward, and db's summation order (float64
          partials vs NumPy's pairwise sum).
  float32 atol 1e-6, rtol 1e-5: the oracle rounds u, u^3 and every step to float32 (tanh: the argument of the
          sigmoid carries ~3 ulp), the kernels compute Phi to 0.5 ulp (v4: 5.8 ulp, 3.5e-7 relative); NumPy sums
          db in float32 over the rows (the kernels in float64), log2(N) eps-sized relative differences.
"""
import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from refbert import ops, validate as V

from ._math import (_FAST, _OPTS, _erfcx_wide, _exp_wide, _sigmoid_wide, exp, ndtr, phi_parts_f32, serial_twin,
                    sigmoid, sigmoid_f32)
from ._harness import KernelSpec, main

_ROWS = 16                                 # rows per db partial: fixed, so db does not depend on the thread count
_BLOCK = 16384                             # v4's plain gelu: elements per prange iteration (64 KiB of float32)
_C = math.sqrt(2.0 / math.pi)               # tanh form: u -> sqrt(2/pi) (u + 0.044715 u^3)
_K = 0.044715
_L = 1e4                                    # tanh form: past |u| = L, s (1 - s) is exactly 0 in both dtypes, so the
                                            # derivative is s there, returned as such: its second term would be
                                            # inf * 0 = NaN once u^2 overflows (u = 1e14 in float32); below L the
                                            # expression is untouched (the same bits as before the branch)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_HALF = math.sqrt(0.5)


# ----------------------------------------------------------------------------------------------------------------
# per-element math, one stub per version, resolved per dtype at compile time (numba.extending.overload)

def _f32(x):
    return isinstance(x, types.Float) and x.bitwidth == 32


def _gelu1(u, tanh):
    """v1 forward value: u Phi(u) through libm (math.erfc, math.exp)."""


def _dgelu1(u, tanh):
    """v1 derivative d gelu / du through libm."""


@overload(_gelu1, jit_options=_OPTS)
def _gelu1_ov(u, tanh):
    def impl(u, tanh):
        ud = np.float64(u)
        if tanh:
            return ud / (1.0 + math.exp(-2.0 * _C * (ud + _K * ud * ud * ud)))
        return ud * 0.5 * math.erfc(-ud * _SQRT_HALF)
    return impl


@overload(_dgelu1, jit_options=_OPTS)
def _dgelu1_ov(u, tanh):
    def impl(u, tanh):
        ud = np.float64(u)
        if tanh:
            s = 1.0 / (1.0 + math.exp(-2.0 * _C * (ud + _K * ud * ud * ud)))
            if abs(ud) > _L:                                   # (see _L)
                return s
            return s + 2.0 * ud * s * (1.0 - s) * _C * (1.0 + 3.0 * _K * ud * ud)
        return 0.5 * math.erfc(-ud * _SQRT_HALF) + ud * math.exp(-0.5 * ud * ud) * _INV_SQRT_2PI
    return impl


def _gelu2(u, tanh):
    """v2 forward value through _math.ndtr / _math.sigmoid (polynomials for float32)."""


def _dgelu2(u, tanh):
    """v2 derivative through _math.ndtr / _math.sigmoid / _math.exp."""


@overload(_gelu2, jit_options=_OPTS)
def _gelu2_ov(u, tanh):
    if _f32(u):
        f = np.float32

        def impl(u, tanh):
            if tanh:
                return u * sigmoid(f(2 * _C) * (u + f(_K) * u * u * u))
            return u * ndtr(u)
        return impl

    def impl64(u, tanh):
        if tanh:
            return u * sigmoid(2 * _C * (u + _K * u * u * u))
        return u * ndtr(u)
    return impl64


@overload(_dgelu2, jit_options=_OPTS)
def _dgelu2_ov(u, tanh):
    if _f32(u):
        f = np.float32

        def impl(u, tanh):
            if tanh:
                s = sigmoid(f(2 * _C) * (u + f(_K) * u * u * u))
                if abs(u) > f(_L):
                    return s
                return s + f(2) * u * s * (f(1) - s) * f(_C) * (f(1) + f(3 * _K) * u * u)
            return ndtr(u) + u * exp(f(-0.5) * u * u) * f(_INV_SQRT_2PI)
        return impl

    def impl64(u, tanh):
        if tanh:
            s = sigmoid(2 * _C * (u + _K * u * u * u))
            if abs(u) > _L:
                return s
            return s + 2 * u * s * (1 - s) * _C * (1 + 3 * _K * u * u)
        return ndtr(u) + u * math.exp(-0.5 * u * u) * _INV_SQRT_2PI
    return impl64


def _gelu3(u, tanh):
    """v3 forward value: float32 in float64 registers (one exp), float64 as v2."""


def _dgelu3(u, tanh):
    """v3 derivative: float32 Phi and phi from one shared float64 exponential, float64 as v2."""


@overload(_gelu3, jit_options=_OPTS)
def _gelu3_ov(u, tanh):
    if _f32(u):
        def impl(u, tanh):
            ud = np.float64(u)
            if tanh:
                z = 2 * _C * (ud + _K * ud * ud * ud)
                # below z = -700 u s rounds to 0 in float32; s is 0 there so that -inf * s(-inf) is NaN, as the
                # oracle's (_exp_wide clamps at -708: s(-inf) was e^-708, and gelu(-inf) -inf)
                return np.float32(ud * (_sigmoid_wide(z) if z > -700.0 else 0.0))
            a = min(abs(ud) * _SQRT_HALF, 11.0)
            r = 0.5 * _exp_wide(-a * a) * _erfcx_wide(a)       # Phi(-|u|)
            r = r if a < 11.0 else 0.0                         # (see the backward): -inf * Phi(-inf) is NaN
            return np.float32(ud * (r if ud < 0 else 1.0 - r))
        return impl
    return lambda u, tanh: _gelu2(u, tanh)


@overload(_dgelu3, jit_options=_OPTS)
def _dgelu3_ov(u, tanh):
    if _f32(u):
        def impl(u, tanh):
            ud = np.float64(u)
            if tanh:
                s = _sigmoid_wide(2 * _C * (ud + _K * ud * ud * ud))
                if abs(ud) > _L:
                    return np.float32(s)
                return np.float32(s + 2 * ud * s * (1 - s) * _C * (1 + 3 * _K * ud * ud))
            a = min(abs(ud) * _SQRT_HALF, 11.0)
            # exp(-u^2 / 2), shared by Phi and phi; 0 from a = 11 on (|u| > 15.5, where Phi(-|u|) and u phi(u) are 0
            # in float32 anyway), so that +-inf * phi(+-inf) is NaN, as the oracle's (the clamp gave e^-121: +-inf)
            e = _exp_wide(-a * a) if a < 11.0 else 0.0
            r = 0.5 * e * _erfcx_wide(a)                       # Phi(-|u|) = erfc(|u| / sqrt 2) / 2
            return np.float32((r if ud < 0 else 1.0 - r) + ud * e * _INV_SQRT_2PI)
        return impl
    return lambda u, tanh: _dgelu2(u, tanh)


def _gelu4(u, tanh):
    """v4 forward value: float32 in float32 arithmetic (_math.phi_parts_f32 / sigmoid_f32), float64 as v2."""


def _dgelu4(u, tanh):
    """v4 derivative: Phi and exp(-u^2/2) from phi_parts_f32 (one exp, one reciprocal), float64 as v2."""


@overload(_gelu4, jit_options=_OPTS)
def _gelu4_ov(u, tanh):
    if _f32(u):
        f = np.float32

        def impl(u, tanh):
            if tanh:
                return u * sigmoid_f32(f(2 * _C) * (u + f(_K) * u * u * u))
            return u * phi_parts_f32(u)[0]
        return impl
    return lambda u, tanh: _gelu2(u, tanh)


@overload(_dgelu4, jit_options=_OPTS)
def _dgelu4_ov(u, tanh):
    if _f32(u):
        f = np.float32

        def impl(u, tanh):
            if tanh:
                s = sigmoid_f32(f(2 * _C) * (u + f(_K) * u * u * u))
                if abs(u) > f(_L):
                    return s
                return s + f(2 * _C) * u * s * (f(1) - s) * (f(1) + f(3 * _K) * u * u)
            cdf, g = phi_parts_f32(u)                          # Phi(u), exp(-u^2 / 2)
            return cdf + u * g * f(_INV_SQRT_2PI)
        return impl
    return lambda u, tanh: _dgelu2(u, tanh)


# ----------------------------------------------------------------------------------------------------------------
# kernels: x2 (N, I) contiguous rows, b (I,) (zeros for plain gelu: x + 0 is exact, a constant-time price)
# One kernel source per version; `g` / `dg` are the version's element functions (a numba first-class function
# would block inlining, so each version gets its own copy through the factory).

def _make(g, dg, tanh, with_db):
    """The forward and backward kernels of one version for one mode. `tanh` and `with_db` are closure constants,
    so each mode compiles to its own branch-free loop (a runtime flag inside the loop blocks vectorisation)."""
    @njit(parallel=True, cache=True, fastmath=_FAST, error_model="numpy")
    def forward(x2, b):
        N, I = x2.shape
        out = np.empty_like(x2)
        for c in prange((N + _ROWS - 1) // _ROWS):
            for i in range(c * _ROWS, min(N, (c + 1) * _ROWS)):
                xi, oi = x2[i], out[i]
                for j in range(I):
                    oi[j] = g(xi[j] + b[j], tanh)
        return out

    @njit(parallel=True, cache=True, fastmath=_FAST, error_model="numpy")
    def backward(dout2, x2, b):
        N, I = x2.shape
        dx = np.empty_like(x2)
        nc = (N + _ROWS - 1) // _ROWS
        part = np.zeros((nc if with_db else 0, I), np.float64)     # per-chunk db partials
        for c in prange(nc):
            for i in range(c * _ROWS, min(N, (c + 1) * _ROWS)):
                xi, di, gi = x2[i], dout2[i], dx[i]
                if with_db:
                    pc = part[c]
                    for j in range(I):
                        d = di[j] * dg(xi[j] + b[j], tanh)
                        gi[j] = d
                        pc[j] += d
                else:
                    for j in range(I):
                        gi[j] = di[j] * dg(xi[j] + b[j], tanh)
        db = np.zeros(I, np.float64)
        if with_db:
            for c in range(nc):                                     # fixed order: chunk 0, 1, 2, ...
                for j in range(I):
                    db[j] += part[c, j]
        return dx, db.astype(x2.dtype)
    return forward, backward


def _make_rows(g, dg, tanh):
    """v4's bias_gelu kernels: as _make's, but the backward writes dx's row in one loop and adds it to the float64
    db partial in a second (one loop writing a float32 row and a float64 partial stayed scalar)."""
    @njit(parallel=True, cache=True, fastmath=_FAST, error_model="numpy")
    def forward(x2, b):
        N, I = x2.shape
        out = np.empty_like(x2)
        for c in prange((N + _ROWS - 1) // _ROWS):
            for i in range(c * _ROWS, min(N, (c + 1) * _ROWS)):
                xi, oi = x2[i], out[i]
                for j in range(I):
                    oi[j] = g(xi[j] + b[j], tanh)
        return out

    @njit(parallel=True, cache=True, fastmath=_FAST, error_model="numpy")
    def backward(dout2, x2, b):
        N, I = x2.shape
        dx = np.empty_like(x2)
        nc = (N + _ROWS - 1) // _ROWS
        part = np.zeros((nc, I), np.float64)                       # per-chunk db partials, as v1-v3's
        for c in prange(nc):
            pc = part[c]
            for i in range(c * _ROWS, min(N, (c + 1) * _ROWS)):
                xi, di, gi = x2[i], dout2[i], dx[i]
                for j in range(I):
                    gi[j] = di[j] * dg(xi[j] + b[j], tanh)
                for j in range(I):                                  # a loop of its own: one dtype per loop
                    pc[j] += gi[j]
        db = np.zeros(I, np.float64)
        for c in range(nc):                                         # fixed order: chunk 0, 1, 2, ...
            for j in range(I):
                db[j] += part[c, j]
        return dx, db.astype(x2.dtype)
    return forward, backward


def _make_flat(g, dg, tanh):
    """Plain gelu's kernels on a flat array: prange over blocks of _BLOCK elements, whatever the shape (v1-v3 ran
    it as one row of numel entries, which the row chunks above gave to a single thread)."""
    @njit(parallel=True, cache=True, fastmath=_FAST, error_model="numpy")
    def forward(x1):
        n = x1.size
        out = np.empty_like(x1)
        for c in prange((n + _BLOCK - 1) // _BLOCK):
            xs, os = x1[c * _BLOCK:(c + 1) * _BLOCK], out[c * _BLOCK:(c + 1) * _BLOCK]
            for j in range(xs.size):
                os[j] = g(xs[j], tanh)
        return out

    @njit(parallel=True, cache=True, fastmath=_FAST, error_model="numpy")
    def backward(d1, x1):
        n = x1.size
        dx = np.empty_like(x1)
        for c in prange((n + _BLOCK - 1) // _BLOCK):
            lo, hi = c * _BLOCK, (c + 1) * _BLOCK
            xs, ds, gs = x1[lo:hi], d1[lo:hi], dx[lo:hi]
            for j in range(xs.size):
                gs[j] = ds[j] * dg(xs[j], tanh)
        return dx
    return forward, backward


PARALLEL_MIN = 1 << 19    # v4: below this many elements the kernels run on the calling thread (layernorm.py's reason)


def _small_on_one_thread(kernels):
    """(forward, backward) of v4 that run their own code compiled without parallel=True below PARALLEL_MIN
    elements (the first argument's size; the bits do not change: the db chunks are fixed rows)."""
    fwd, bwd = kernels
    opts = dict(cache=True, fastmath=_FAST, error_model="numpy")
    fwd1, bwd1 = serial_twin(fwd, **opts), serial_twin(bwd, **opts)

    def forward(x, *rest):
        return (fwd if x.size >= PARALLEL_MIN else fwd1)(x, *rest)

    def backward(d, *rest):
        return (bwd if d.size >= PARALLEL_MIN else bwd1)(d, *rest)
    return forward, backward


def _kernels(g, dg):
    """{(tanh, with_db): (forward, backward)} for one version."""
    return {(t, w): _make(g, dg, t, w) for t in (False, True) for w in (False, True)}


def _rows(a):
    """a (..., I) as contiguous rows (N, I): a view when a is C-contiguous (also when N or I is 0)."""
    return np.ascontiguousarray(a).reshape(int(np.prod(a.shape[:-1])), a.shape[-1])


def _check_approximate(approximate):
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: argument 'approximate' expected 'none' or 'tanh', got {approximate!r}")


def _wrap(version, kernels, flat=None):
    """The four public-signature functions of one version around its kernels (`flat`: {tanh: (forward, backward)}
    of plain gelu on a flat array; without it plain gelu runs the bias kernels with b = 0 on one long row)."""
    def gelu_forward(x, approximate="none"):
        V.required("gelu", x=x)
        V.floats("gelu", x=x)
        _check_approximate(approximate)
        if flat is not None:
            out = flat[approximate == "tanh"][0](np.ascontiguousarray(x).reshape(-1))
            return out.reshape(x.shape), (x, approximate)
        x2 = np.ascontiguousarray(x).reshape(1, -1)                   # (1, numel): elementwise, one long row
        out = kernels[approximate == "tanh", False][0](x2, np.zeros(x2.shape[1], x.dtype))
        return out.reshape(x.shape), (x, approximate)

    def gelu_backward(dout, cache):
        x, approximate = ops._cache("gelu", cache, 2)
        V.dout("gelu", dout, x.shape, x.dtype)
        if flat is not None:
            dx = flat[approximate == "tanh"][1](np.ascontiguousarray(dout).reshape(-1),
                                                np.ascontiguousarray(x).reshape(-1))
            return dx.reshape(x.shape)
        x2 = np.ascontiguousarray(x).reshape(1, -1)
        d2 = np.ascontiguousarray(dout).reshape(1, -1)
        dx, _ = kernels[approximate == "tanh", False][1](d2, x2, np.zeros(x2.shape[1], x.dtype))
        return dx.reshape(x.shape)

    def bias_gelu_forward(x, b, approximate="none"):
        V.required("bias_gelu", x=x, b=b)
        V.floats("bias_gelu", x=x, b=b)
        V.min_ndim("bias_gelu", "x", x, 1, "(..., I)")
        V.shape("bias_gelu", "b", b, (x.shape[-1],), "(I,)")
        _check_approximate(approximate)
        x2 = _rows(x)                                                 # (N, I), a view when x is contiguous
        out = kernels[approximate == "tanh", True][0](x2, np.ascontiguousarray(b))
        return out.reshape(x.shape), (x, b, approximate)

    def bias_gelu_backward(dout, cache):
        x, b, approximate = ops._cache("bias_gelu", cache, 3)
        V.dout("gelu", dout, x.shape, x.dtype)
        x2 = _rows(x)
        d2 = _rows(dout)
        dx, db = kernels[approximate == "tanh", True][1](d2, x2, np.ascontiguousarray(b))
        return dx.reshape(x.shape), db

    fns = (gelu_forward, gelu_backward, bias_gelu_forward, bias_gelu_backward)
    for f in fns:
        f.__doc__ = getattr(ops, f.__name__).__doc__
        f.__qualname__ = f.__name__ = f"{f.__name__}_v{version}"      # gelu_forward_v1, bias_gelu_backward_v3, ...
    return fns


(gelu_forward_v1, gelu_backward_v1, bias_gelu_forward_v1, bias_gelu_backward_v1) = _wrap(1, _kernels(_gelu1, _dgelu1))
(gelu_forward_v2, gelu_backward_v2, bias_gelu_forward_v2, bias_gelu_backward_v2) = _wrap(2, _kernels(_gelu2, _dgelu2))
(gelu_forward_v3, gelu_backward_v3, bias_gelu_forward_v3, bias_gelu_backward_v3) = _wrap(3, _kernels(_gelu3, _dgelu3))
(gelu_forward_v4, gelu_backward_v4, bias_gelu_forward_v4, bias_gelu_backward_v4) = _wrap(
    4, {(t, True): _small_on_one_thread(_make_rows(_gelu4, _dgelu4, t)) for t in (False, True)},
    {t: _small_on_one_thread(_make_flat(_gelu4, _dgelu4, t)) for t in (False, True)})

# the public API: the fastest version
gelu_forward, gelu_backward = gelu_forward_v4, gelu_backward_v4
bias_gelu_forward, bias_gelu_backward = bias_gelu_forward_v4, bias_gelu_backward_v4


# ----------------------------------------------------------------------------------------------------------------
# validate-then-benchmark (python -m refbert_kernels.gelu)

_TAILS = (-10.0, 10.0, -6.5, 1e-7, -3e-8, 0.0, -1e-300)   # GELU tails and |x| < 1e-6 (the oracle's 0/0 branch)


def _x(shape, dtype, rng):
    x = (3 * rng.standard_normal(shape)).astype(dtype)
    flat = x.reshape(-1)                                    # a view: plant the tails in the first entries
    k = min(flat.size, len(_TAILS))
    flat[:k] = np.array(_TAILS[:k]).astype(dtype)
    return x


def _make_gelu(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    return {"x": _x(shape["shape"], dtype, rng)}, {"approximate": shape["approximate"]}


def _make_bias_gelu(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    x = _x(shape["shape"], dtype, rng)
    b = (0.1 * rng.standard_normal(x.shape[-1])).astype(dtype)
    b[:1] = 0                                               # keep the planted tails exact in u = x + b
    return {"x": x, "b": b}, {"approximate": shape["approximate"]}


def _torch_gelu(inputs, kwargs):
    import torch
    import torch.nn.functional as F
    x = torch.from_numpy(inputs["x"]).requires_grad_()
    b = torch.from_numpy(inputs["b"]).requires_grad_() if "b" in inputs else None
    dout = torch.from_numpy(np.random.default_rng(0).standard_normal(inputs["x"].shape).astype(inputs["x"].dtype))

    def step():
        x.grad = None
        if b is not None:
            b.grad = None
        F.gelu(x + b if b is not None else x, approximate=kwargs["approximate"]).backward(dout)
    return step


_SHAPES = [{"shape": s, "approximate": a} for a in ("none", "tanh")
           for s in [(1,), (1, 1), (1, 52), (37, 52), (3, 5, 7), (17, 781)]]
_TOL = {np.float64: (1e-12, 1e-11), np.float32: (1e-6, 1e-5)}       # reasons: the module docstring

SPEC_GELU = KernelSpec(
    name="gelu", oracle=(ops.gelu_forward, ops.gelu_backward),
    versions={1: (gelu_forward_v1, gelu_backward_v1), 2: (gelu_forward_v2, gelu_backward_v2),
              3: (gelu_forward_v3, gelu_backward_v3), 4: (gelu_forward_v4, gelu_backward_v4)},
    make_inputs=_make_gelu, wrt=("x",), shapes=_SHAPES,
    bench_shape={"shape": (4 * 512, 3072), "approximate": "none"}, tol=_TOL,
    # forward reads x, writes out; backward reads dout, x, writes dx: 5 N I items
    nbytes=lambda inp, kw: 5 * inp["x"].nbytes,
    torch_peer=_torch_gelu,
    notes={1: "math.erfc / math.exp (scalar libm)", 2: "_math polynomials (vectorised)",
           3: "one float64-register exp for Phi and phi",
           4: "float32 lanes: one exp, one reciprocal; plain gelu on flat blocks (all threads)"})

SPEC_BIAS_GELU = KernelSpec(
    name="bias_gelu", oracle=(ops.bias_gelu_forward, ops.bias_gelu_backward),
    versions={1: (bias_gelu_forward_v1, bias_gelu_backward_v1), 2: (bias_gelu_forward_v2, bias_gelu_backward_v2),
              3: (bias_gelu_forward_v3, bias_gelu_backward_v3), 4: (bias_gelu_forward_v4, bias_gelu_backward_v4)},
    make_inputs=_make_bias_gelu, wrt=("x", "b"), shapes=_SHAPES[1:6] + _SHAPES[7:],   # b needs x.ndim >= 1
    bench_shape={"shape": (4 * 512, 3072), "approximate": "none"}, tol=_TOL,
    # forward reads x, b, writes out; backward reads dout, x, b, writes dx, db: 5 N I + 3 I items
    nbytes=lambda inp, kw: 5 * inp["x"].nbytes + 3 * inp["b"].nbytes,
    torch_peer=_torch_gelu, notes=SPEC_GELU.notes)

SPECS = (SPEC_GELU, SPEC_BIAS_GELU)
SPEC = SPEC_BIAS_GELU                                       # the op the model calls (feed-forward bias + GELU)

if __name__ == "__main__":
    for spec in SPECS:
        main(spec)
