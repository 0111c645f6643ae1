"""Softmax cross-entropy (the MLM and classification loss) fused with log-softmax over the vocabulary, on the CPU.

Oracle: refbert.ops.cross_entropy_forward / cross_entropy_backward (mean over the rows whose label is not
ignore_index; every row ignored -> loss 0 and a zero gradient).

    logits: (..., V) -> z (N, V) rows;  labels: (...) -> y (N,);  kept = rows with y != ignore_index, n of them
    forward:   m = max_j z_j,  ls = log sum_j exp(z_j - m)          (per kept row: lse = m + ls, all that is kept)
               loss = (1/n) sum_kept (ls - (z_y - m))               (z_y - m, not lse - z_y: no 1e4 cancellation)
    backward:  dz = (exp(z - m - ls) - onehot(y)) * dloss / n       (one pass per kept row, written once)
               ignored rows: dz = 0
Nothing of size (N, V) is made but the gradient itself (the oracle builds zs = z - m and exp(zs) as well). The
kernels index rows through `kept`, so the logits are never gathered or copied: the model calls this on the
labelled MLM rows only (every row kept), where the forward reads z twice per row (max, then sum: the second read
hits L2, a 30522-float32 row is 122 kB) and the backward reads z once and writes dz once.

Versions (run: python -m refbert_kernels.cross_entropy):
  1: one kept row per prange iteration, math.exp (scalar libm), max / sum / backward passes
  2: _math.exp (a polynomial that vectorises for float32), sums of exp in float64, 1/ dloss scale folded
  3: v2 with an online max+sum (one read of the row in the forward: s rescaled by exp(m_old - m_new) per
     block of 512 columns, so the exp count stays ~V)
  4: float32 lanes: _math.exp_f32 (16 lanes; _math.exp reduces in float64, 8), the row max by llvm.maximum
     (NaN-propagating, so m alone shows a NaN, +inf or all -inf row: v2's row-sum check pass goes), the sum of
     exp in float32 within blocks of _SUM_BLOCK columns on 1-d views (a view indexed from 0 vectorises) and in
     float64 across blocks; float64 rows as v2 (math.exp, float64 sums); the backward's kept and ignored rows
     in one prange (v2 starts a second parallel region for the ignored rows, empty or not), into a dlogits of
     POOL_MIN bytes and more reused once nobody holds it (kernels/_pool.py: in the mini step a fresh 19 MB one
     cost 8-12 ms of page faults, the whole backward 0.5 ms without them)

Tolerances (|got - ref| <= atol + rtol |ref|):
  float64 atol 1e-12, rtol 1e-10: libm exp vs NumPy's exp, summation order of V ~ 3e4 terms (~1e-16 V^0.5
          relative), log; loss terms of size ~10 and logits up to 1e4 (z - m exact either way).
  float32 atol 1e-6, rtol 1e-5: the oracle sums exp in float32 (NumPy pairwise, ~1e-7 log V relative), the
          kernels in float64 (v4: float32 over ~16 terms per SIMD accumulator, then float64); exp to 1 ulp;
          gradient entries are ~1/V, far below atol where they differ.
"""
import math

import numpy as np
from numba import njit, prange

from refbert import ops, validate as V

from . import _pool
from ._harness import KernelSpec, main
from ._math import _FAST, exp, fexp, fmaximum

_BLOCK = 512                      # v3: columns per online-max block
# The backwards keep reassociation off: (z - m) - ls must not become z - (m + ls), which rounds away the digits
# of ls when the logits are ~1e4 (z - m is exact, m + ls is not). They have no reduction, so they vectorise anyway.
_GRAD_FAST = {"contract", "arcp", "nsz"}


# ----------------------------------------------------------------------------------------------------------------
# v1: math.exp per element

@njit(parallel=True, cache=True, fastmath=_FAST, error_model="numpy")
def _forward_v1(z2, y, kept):
    n = kept.size
    m = np.empty(n, z2.dtype)
    ls = np.empty(n, z2.dtype)
    terms = np.empty(n, np.float64)
    check = np.empty(n, np.float64)
    for i in prange(n):
        row = z2[kept[i]]
        mi = row[0]
        zsum = 0.0
        for j in range(row.size):
            mi = max(mi, row[j])
            zsum += row[j]                                   # NaN / +-inf anywhere makes this non-finite
        s = 0.0
        for j in range(row.size):
            s += math.exp(row[j] - mi)
        m[i] = mi
        ls[i] = math.log(s)
        terms[i] = math.log(s) - (row[y[kept[i]]] - mi)
        check[i] = zsum + mi
    return m, ls, terms, check


@njit(parallel=True, cache=True, fastmath=_GRAD_FAST, error_model="numpy")
def _backward_v1(z2, y, kept, ignored, m, ls, g):
    N, Vn = z2.shape
    dz = np.empty_like(z2)
    for i in prange(kept.size):
        r = kept[i]
        row, out = z2[r], dz[r]
        for j in range(Vn):
            out[j] = math.exp((row[j] - m[i]) - ls[i]) * g
        out[y[r]] -= g
    for i in prange(ignored.size):
        dz[ignored[i]] = 0
    return dz


# ----------------------------------------------------------------------------------------------------------------
# v2: vectorising exp, float64 sums

@njit(parallel=True, cache=True, fastmath=_FAST, error_model="numpy")
def _forward_v2(z2, y, kept):
    n = kept.size
    m = np.empty(n, z2.dtype)
    ls = np.empty(n, z2.dtype)
    terms = np.empty(n, np.float64)
    check = np.empty(n, np.float64)
    for i in prange(n):
        row = z2[kept[i]]
        mi = row[0]
        zsum = row[0] - row[0]
        for j in range(row.size):
            mi = max(mi, row[j])
            zsum += row[j]
        s = 0.0
        for j in range(row.size):
            s += np.float64(exp(row[j] - mi))               # float32: the polynomial exp, 16 lanes
        lsd = math.log(s)
        m[i] = mi
        ls[i] = lsd
        terms[i] = lsd - np.float64(row[y[kept[i]]] - mi)
        check[i] = np.float64(zsum) + np.float64(mi)
    return m, ls, terms, check


@njit(parallel=True, cache=True, fastmath=_GRAD_FAST, error_model="numpy")
def _backward_v2(z2, y, kept, ignored, m, ls, g):
    N, Vn = z2.shape
    dz = np.empty_like(z2)
    for i in prange(kept.size):
        r = kept[i]
        row, out = z2[r], dz[r]
        mi, lsi = m[i], ls[i]
        for j in range(Vn):
            out[j] = exp((row[j] - mi) - lsi) * g            # softmax * dloss / n, one read and one write
        out[y[r]] -= g
    for i in prange(ignored.size):
        dz[ignored[i]] = 0
    return dz


# ----------------------------------------------------------------------------------------------------------------
# v3: online max + sum (one read of the row in the forward)

@njit(parallel=True, cache=True, fastmath=_FAST, error_model="numpy")
def _forward_v3(z2, y, kept):
    n = kept.size
    Vn = z2.shape[1]
    m = np.empty(n, z2.dtype)
    ls = np.empty(n, z2.dtype)
    terms = np.empty(n, np.float64)
    check = np.empty(n, np.float64)
    for i in prange(n):
        row = z2[kept[i]]
        mi = row[0]
        zsum = row[0] - row[0]
        s = 0.0
        for j0 in range(0, Vn, _BLOCK):                      # the block (2 kB) stays in L1 between its passes
            j1 = min(Vn, j0 + _BLOCK)
            mb = mi
            for j in range(j0, j1):
                mb = max(mb, row[j])
                zsum += row[j]
            s *= np.float64(exp(mi - mb))                   # rescale the running sum to the new max
            for j in range(j0, j1):
                s += np.float64(exp(row[j] - mb))
            mi = mb
        lsd = math.log(s)
        m[i] = mi
        ls[i] = lsd
        terms[i] = lsd - np.float64(row[y[kept[i]]] - mi)
        check[i] = np.float64(zsum) + np.float64(mi)
    return m, ls, terms, check


# ----------------------------------------------------------------------------------------------------------------
# v4: float32 lanes. The max is llvm.maximum (NaN-propagating, so a NaN or +inf anywhere, or an all -inf row, shows
# in m alone: no row-sum check pass); exp is _math.exp_f32 (16 float32 lanes; _math.exp runs 8 float64 lanes);
# the sum of exp is float32 within blocks of _SUM_BLOCK columns (~_SUM_BLOCK / 64 terms per SIMD accumulator) and
# float64 across blocks. float64 rows run the same loops with math.exp and float64 sums.

_SUM_BLOCK = 1024


@njit(cache=True, fastmath=_FAST, error_model="numpy")
def _row_max(row):
    m = row[0]
    for j in range(row.size):
        m = fmaximum(m, row[j])
    return m


@njit(cache=True, fastmath=_FAST, error_model="numpy")
def _sum_exp(block, m):
    """sum of exp(block - m), in the block's dtype (indices from 0 on a view: no wraparound test, so it vectorises)."""
    s = m - m
    for j in range(block.size):
        s += fexp(block[j] - m)
    return s


@njit(parallel=True, cache=True, fastmath=_FAST, error_model="numpy")
def _forward_v4(z2, y, kept):
    n = kept.size
    Vn = z2.shape[1]
    m = np.empty(n, z2.dtype)
    ls = np.empty(n, z2.dtype)
    terms = np.empty(n, np.float64)
    check = np.empty(n, np.float64)
    for i in prange(n):
        row = z2[kept[i]]
        mi = _row_max(row)
        s = 0.0
        for j0 in range(0, Vn, _SUM_BLOCK):
            s += np.float64(_sum_exp(row[j0:j0 + _SUM_BLOCK], mi))
        lsd = math.log(s)
        m[i] = mi
        ls[i] = lsd
        terms[i] = lsd - np.float64(row[y[kept[i]]] - mi)
        check[i] = np.float64(mi) - np.float64(mi)             # NaN unless m is finite
    return m, ls, terms, check


@njit(cache=True, fastmath=_GRAD_FAST, error_model="numpy")
def _grad_row(row, mi, lsi, g, out):
    for j in range(row.size):
        out[j] = fexp((row[j] - mi) - lsi) * g


@njit(parallel=True, cache=True, fastmath=_GRAD_FAST, error_model="numpy")
def _backward_v4_into(z2, y, kept, m, ls, g, dz):
    N, Vn = z2.shape
    pos = np.full(N, -1, np.int64)                          # row -> its index in kept, -1 if ignored
    for i in range(kept.size):
        pos[kept[i]] = i
    for r in prange(N):                                     # one parallel region (v2 launches two)
        i = pos[r]
        if i < 0:
            dz[r] = 0
        else:
            _grad_row(z2[r], m[i], ls[i], g, dz[r])         # softmax * dloss / n, one read and one write
            dz[r, y[r]] -= g


POOL_MIN = 4 << 20   # v4: dlogits of this many bytes and more go into the last one of their shape (kernels/_pool.py)


def _backward_v4(z2, y, kept, ignored, m, ls, g):
    dz = _pool.empty(z2.shape, z2.dtype, "cross_entropy", POOL_MIN)   # every entry written by the kernel
    _backward_v4_into(z2, y, kept, m, ls, g, dz)
    return dz


# ----------------------------------------------------------------------------------------------------------------
# the public signatures

def _wrap(version, fwd_kernel, bwd_kernel):
    def cross_entropy_forward(logits, labels, ignore_index=-100):
        # the oracle's checks, in its order
        V.required("cross_entropy", logits=logits)
        V.floats("cross_entropy", logits=logits)
        V.min_ndim("cross_entropy", "logits", logits, 1, "(..., V)")
        if not isinstance(labels, np.ndarray) or labels.shape != logits.shape[:-1]:
            raise ValueError(f"cross_entropy: argument 'labels' expected an integer array of shape "
                             f"{logits.shape[:-1]} (logits.shape[:-1]), got {V._desc(labels)}")
        Vn = logits.shape[-1]
        V.ids("cross_entropy", "labels", labels, Vn, allow=ignore_index)
        N = int(np.prod(logits.shape[:-1]))
        z2 = np.ascontiguousarray(logits).reshape(N, Vn)       # (N, V): a view for contiguous logits
        y = labels.reshape(N).astype(np.int64, copy=False)     # (N,)
        keep = y != ignore_index
        kept = np.flatnonzero(keep)                            # (n,) row indices: the logits are never gathered
        m, ls, terms, check = fwd_kernel(z2, y, kept)
        if not np.isfinite(check).all():                       # some row holds a NaN or an inf: the oracle's test
            rows = z2[kept[~np.isfinite(check)]]
            if not np.isfinite(rows.max(-1)).all():
                raise ValueError("cross_entropy: argument 'logits' expected finite rows, "
                                 "got a NaN, +inf or all -inf row")
        loss = terms.sum() / max(kept.size, 1)
        ignored = np.flatnonzero(~keep)
        return np.asarray(loss, dtype=logits.dtype), (logits.shape, z2, y, kept, ignored, m, ls)

    def cross_entropy_backward(dloss, cache):
        shape, z2, y, kept, ignored, m, ls = ops._cache("cross_entropy", cache, 7)
        dloss = ops._scalar_dout("cross_entropy", dloss, z2.dtype)
        g = dloss / max(kept.size, 1)                          # a scalar of the logits' dtype, as in the oracle
        return bwd_kernel(z2, y, kept, ignored, m, ls, g).reshape(shape)

    for f in (cross_entropy_forward, cross_entropy_backward):
        f.__doc__ = getattr(ops, f.__name__).__doc__
        f.__qualname__ = f.__name__ = f"{f.__name__}_v{version}"
    return cross_entropy_forward, cross_entropy_backward


cross_entropy_forward_v1, cross_entropy_backward_v1 = _wrap(1, _forward_v1, _backward_v1)
cross_entropy_forward_v2, cross_entropy_backward_v2 = _wrap(2, _forward_v2, _backward_v2)
cross_entropy_forward_v3, cross_entropy_backward_v3 = _wrap(3, _forward_v3, _backward_v2)
cross_entropy_forward_v4, cross_entropy_backward_v4 = _wrap(4, _forward_v4, _backward_v4)

# the public API: the fastest version
cross_entropy_forward, cross_entropy_backward = cross_entropy_forward_v4, cross_entropy_backward_v4


# ----------------------------------------------------------------------------------------------------------------
# validate-then-benchmark (python -m refbert_kernels.cross_entropy)

def _make(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    lead, Vn = shape["lead"], shape["V"]
    logits = (3 * rng.standard_normal((*lead, Vn))).astype(dtype)
    labels = rng.integers(0, Vn, size=lead)
    ignored = rng.random(lead) < shape.get("ignored", 0.0)   # MLM: most rows ignored; the model: none
    labels[ignored] = -100
    if shape.get("big") and logits.size:
        logits.reshape(-1, Vn)[0] += 1e4                       # one row of logits near 1e4
    return {"logits": logits, "labels": labels}, {"ignore_index": -100}


def _torch_ce(inputs, kwargs):
    import torch
    import torch.nn.functional as F
    z = torch.from_numpy(inputs["logits"]).requires_grad_()
    y = torch.from_numpy(inputs["labels"])

    def step():
        z.grad = None
        F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), ignore_index=kwargs["ignore_index"]).backward()
    return step


SPEC = KernelSpec(
    name="cross_entropy", oracle=(ops.cross_entropy_forward, ops.cross_entropy_backward),
    versions={1: (cross_entropy_forward_v1, cross_entropy_backward_v1),
              2: (cross_entropy_forward_v2, cross_entropy_backward_v2),
              3: (cross_entropy_forward_v3, cross_entropy_backward_v3),
              4: (cross_entropy_forward_v4, cross_entropy_backward_v4)},
    make_inputs=_make, wrt=("logits",),
    shapes=[{"lead": (1,), "V": 1}, {"lead": (1,), "V": 7}, {"lead": (37,), "V": 52, "ignored": 0.5},
            {"lead": (3, 5), "V": 1031, "ignored": 0.85, "big": True}, {"lead": (4,), "V": 13, "ignored": 1.0},
            {"lead": (2, 3), "V": 600, "big": True}],
    bench_shape={"lead": (77,), "V": 30522},
    tol={np.float64: (1e-12, 1e-10), np.float32: (1e-6, 1e-5)},       # reasons: the module docstring
    # forward reads z (N V); backward reads z, writes dz (2 N V): 3 N V items (the second forward read is L2)
    nbytes=lambda inp, kw: 3 * inp["logits"].nbytes,
    torch_peer=_torch_ce,
    notes={1: "math.exp, max / sum / grad passes", 2: "_math.exp vectorised, float64 sums",
           3: "online max+sum per 512-column block",
           4: "float32 lanes: exp_f32, llvm.maximum (no check pass), float32 block sums"})
SPEC_512 = KernelSpec(**{**SPEC.__dict__, "bench_shape": {"lead": (512,), "V": 30522}})

if __name__ == "__main__":
    main(SPEC)
    print("cross_entropy at N = 512 (validation repeated)")
    main(SPEC_512)
