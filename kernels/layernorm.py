"""Oracle: refbert.ops.layernorm_forward / layernorm_backward, residual_layernorm_forward / _backward and
dropout_residual_layernorm_forward / _backward — LayerNorm over the last axis of x, x + a, or x + dropout(a),
each direction one Numba kernel over rows.

    x, a: (..., C) seen as (R, C) rows   w, b: (C,)
    forward, per row:  s = x (+ a * keep * scale);  mean = sum(s) / C;  rstd = 1 / sqrt(sum((s - mean)^2) / C + eps)
                       out = (s - mean) * rstd * w + b
    backward, per row, with xhat = (s - mean) * rstd and wdy = dout * w:
                       c1 = sum(wdy * xhat) / C,  c2 = sum(wdy) / C,  ds = (wdy - (xhat * c1 + c2)) * rstd
                       dx = ds,  da = ds (residual) or ds * keep * scale (dropout);  dw += dout * xhat,  db += dout
dw and db are summed per chunk of rows into their own partial row (the chunks depend on R only, never on the
threads), then the partials are added in chunk order: the same bits on every run.
The cache keeps x, a, mean and rstd; the backward recomputes s (and, for dropout, regenerates the keep-mask from
(seed, stream): it is a pure function of the element index, refbert.philox) instead of storing s or a mask.

Versions (python -m refbert_kernels.layernorm validates each against the oracle, then times it):
    1  one row per prange iteration, three passes each recomputing s from the inputs, float64 row sums; the
       dropout mask is a bool array made first (philox_word per element) and cached, as the oracle does
    2  s written once into the output row (it stays in L1) and normalised in place, row sums in the dtype
       (SIMD), chunks of rows per prange iteration; dropout multipliers one Philox block per 4 elements into a
       row buffer, regenerated in the backward (no mask in memory)
    3  as 2, but plain layernorm reads x where v2 first copies it (into the output row, into dx's row); the
       backward takes rows in pairs, so each dw, db partial entry is read and written once per two rows (those
       stores bounded v2), keeps no xhat row (pass 1: c1, c2 and the partials; pass 2 recomputes xhat from s),
       has each loop in a function of its own over 1-d views (one plain loop LLVM vectorises), and adds the
       partials inside the kernel; below PARALLEL_MIN elements the same code runs on the calling thread

Tolerance (the spec's tol): float64 atol 1e-12, rtol 1e-11 — summation order only (SIMD lanes and chunked dw, db
against NumPy's pairwise row means and sequential column sums). float32 atol 1e-5, rtol 1e-4 — float32 sums in
another order: out and dx are O(1) with ~1e-7 relative error each, but dx = (wdy - xhat c1 - c2) rstd cancels
terms of size |wdy| ~ 3 into results near 0, and dw, db add R float32 terms (the oracle sequentially), so
1e-5 absolute is what float32 order differences reach on the validation shapes (err/tol printed stays < 0.3).
fastmath: {'reassoc', 'arcp', 'nsz'} — no 'nnan'/'ninf', so NaN/inf inputs propagate as in NumPy; and no 'contract':
an fma would turn dout * w - c2 into the exact product minus its rounded copy, so where the oracle cancels to
exactly 0 (C = 1, or a constant row: xhat = 0, rstd = 1/sqrt(eps) = 1e6) the kernel would give 1e-17 * 1e6.
"""
import math

import numpy as np
from numba import njit, prange

from refbert import ops
from refbert import validate as V
from refbert.philox import DropoutRNG

from ._harness import KernelSpec, main
from ._math import philox_word, serial_twin
from .dropout import draw, fill_multipliers, like

FASTMATH = {"reassoc", "arcp", "nsz"}            # no 'contract': see the docstring
CHUNKS = 64                      # row chunks of the backward: each owns one partial row of dw and of db


def _chunks(R):
    """(rows per chunk, number of chunks): a function of R alone, so dw, db sum in the same order every run."""
    per = max(1, -(-R // CHUNKS))
    return per, -(-R // per)


@njit(cache=True)
def _chunks_nb(R):
    per = max(1, -(-R // CHUNKS))
    return per, -(-R // per)


# ----------------------------------------------------------------------------------------------------------------
# version 1: x (R, C); a (R, C) or None; keep (R, C) bool or None; every `is None` branch is pruned at compile time.
# No fast-math at all: every s is recomputed from the inputs, and with 'reassoc' LLVM may turn (x + a) - mean into
# x + (a - mean) (for C = 1 the oracle's s - mean is exactly 0, and rstd = 1e6 magnifies any difference)

@njit(parallel=True, cache=True)
def _keep_v1(keep, seed, stream, thr):
    k1 = keep.reshape(-1)
    for i in prange(k1.size):
        k1[i] = philox_word(i, stream, seed) >= thr


@njit(cache=True)
def _s_v1(x, a, keep, scale, r, j):
    v = x[r, j]
    if a is not None:
        if keep is not None:
            v = v + a[r, j] * (scale if keep[r, j] else like(scale, 0))
        else:
            v = v + a[r, j]
    return v


@njit(parallel=True, cache=True)
def _forward_v1(x, a, keep, scale, w, b, eps, out, mean, rstd):
    R, C = x.shape
    for r in prange(R):
        s = 0.0
        for j in range(C):                           # pass 1: mean (float64 sum)
            s += _s_v1(x, a, keep, scale, r, j)
        m = s / C
        q = 0.0
        for j in range(C):                           # pass 2: biased variance about the mean
            d = _s_v1(x, a, keep, scale, r, j) - m
            q += d * d
        rs = 1 / math.sqrt(q / C + eps)
        for j in range(C):                           # pass 3: normalise, scale, shift
            out[r, j] = (_s_v1(x, a, keep, scale, r, j) - m) * rs * w[j] + b[j]
        mean[r] = m
        rstd[r] = rs


@njit(parallel=True, cache=True)
def _backward_v1(dout, x, a, keep, scale, w, mean, rstd, dx, da, dwp, dbp):
    R, C = x.shape
    per, n = _chunks_nb(R)
    for c in prange(n):
        for r in range(c * per, min(R, (c + 1) * per)):
            m, rs = mean[r], rstd[r]
            c1 = 0.0
            c2 = 0.0
            for j in range(C):
                xh = (_s_v1(x, a, keep, scale, r, j) - m) * rs
                wdy = dout[r, j] * w[j]
                c1 += wdy * xh
                c2 += wdy
                dwp[c, j] += dout[r, j] * xh
                dbp[c, j] += dout[r, j]
            c1 /= C
            c2 /= C
            for j in range(C):
                xh = (_s_v1(x, a, keep, scale, r, j) - m) * rs
                d = (dout[r, j] * w[j] - (xh * c1 + c2)) * rs
                dx[r, j] = d
                if da is not None:
                    da[r, j] = d * scale if keep[r, j] else d * like(scale, 0)


# ----------------------------------------------------------------------------------------------------------------
# version 2: drop = (seed, stream, thr, scale) or None; rows of a chunk share one multiplier buffer; sums in the
# dtype (like(): a float32 row stays float32, 16 SIMD lanes). s = x + a is stored to a row in L1 before anything
# subtracts the mean from it: a value read back from memory is rounded, and 'reassoc' cannot regroup across it

@njit(cache=True, fastmath=FASTMATH)
def _multipliers(buf, drop, r, C):
    """The drop multipliers (scale or 0) of row r's elements r*C .. r*C + C - 1, as a view into buf."""
    seed, stream, thr, scale = drop
    b0 = (r * C) // 4                                # element i is word i % 4 of Philox block i // 4
    fill_multipliers(buf, b0, (r * C + C + 3) // 4 - b0, seed, stream, thr, scale)
    return buf[r * C - 4 * b0: r * C - 4 * b0 + C]


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def _forward_v2(x, a, drop, w, b, eps, out, mean, rstd):
    R, C = x.shape
    cf = like(eps, C)
    per, n = _chunks_nb(R)
    for c in prange(n):
        buf = np.empty(C + 8, x.dtype)               # multipliers of the Philox blocks that cover one row
        for r in range(c * per, min(R, (c + 1) * per)):
            xr, o = x[r], out[r]
            mr = buf[:C]
            if drop is not None:
                mr = _multipliers(buf, drop, r, C)
            s = like(eps, 0)
            for j in range(C):                       # s = x + a * keep * scale, kept in the output row
                v = xr[j]
                if a is not None:
                    if drop is not None:
                        v = v + a[r, j] * mr[j]
                    else:
                        v = v + a[r, j]
                o[j] = v
                s += v
            m = s / cf
            q = like(eps, 0)
            for j in range(C):
                d = o[j] - m
                q += d * d
            rs = like(eps, 1) / math.sqrt(q / cf + eps)
            for j in range(C):
                o[j] = (o[j] - m) * rs * w[j] + b[j]
            mean[r] = m
            rstd[r] = rs


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def _backward_v2(dout, x, a, drop, w, mean, rstd, dx, da, dwp, dbp):
    R, C = x.shape
    cf = like(w[0], C)
    per, n = _chunks_nb(R)
    for c in prange(n):
        buf = np.empty(C + 8, x.dtype)
        dwc, dbc = dwp[c], dbp[c]
        for r in range(c * per, min(R, (c + 1) * per)):
            xr, dy, g = x[r], dout[r], dx[r]
            m, rs = mean[r], rstd[r]
            mr = buf[:C]
            if drop is not None:
                mr = _multipliers(buf, drop, r, C)
            if a is not None:                        # s into dx's row (L1), rounded there exactly as in the
                for j in range(C):                   # forward; s - mean in one expression would let 'reassoc'
                    if drop is not None:             # compute x + (a - mean) instead
                        g[j] = xr[j] + a[r, j] * mr[j]
                    else:
                        g[j] = xr[j] + a[r, j]
            else:
                g[:] = xr
            c1 = like(m, 0)
            c2 = like(m, 0)
            for j in range(C):                       # xhat into dx's row; c1, c2 and the dw, db partials
                xh = (g[j] - m) * rs
                g[j] = xh
                wdy = dy[j] * w[j]
                c1 += wdy * xh
                c2 += wdy
                dwc[j] += dy[j] * xh
                dbc[j] += dy[j]
            c1 /= cf
            c2 /= cf
            for j in range(C):
                g[j] = (dy[j] * w[j] - (g[j] * c1 + c2)) * rs
            if da is not None:
                for j in range(C):
                    da[r, j] = g[j] * mr[j]


# ----------------------------------------------------------------------------------------------------------------
# version 3: as 2, but plain layernorm reads x where v2 first copies it (into out, into dx); the backward takes rows
# in pairs, so each dw, db partial entry is read and written once per two rows (its stores were the bottleneck),
# and keeps no xhat row: pass 1 computes c1, c2 and the partials, pass 2 recomputes xhat from s for dx; dw, db
# partials are summed (in chunk order) inside the kernel. Residual rows of s are formed in pass 1 and stored into
# dx's rows for pass 2; s - mean goes through _minus, which carries no fast-math flag, so it is never regrouped.

@njit(parallel=True, cache=True, fastmath=FASTMATH)
def _forward_v3(x, a, drop, w, b, eps, out, mean, rstd):
    R, C = x.shape
    cf = like(eps, C)
    per, n = _chunks_nb(R)
    for c in prange(n):
        buf = np.empty(C + 8, x.dtype)
        for r in range(c * per, min(R, (c + 1) * per)):
            o = out[r]
            sr = x[r]                                # plain layernorm: s is x itself
            s = like(eps, 0)
            if a is not None:
                mr = buf[:C]
                if drop is not None:
                    mr = _multipliers(buf, drop, r, C)
                xr = x[r]
                for j in range(C):                   # s = x + a (* keep * scale), kept in the output row
                    v = xr[j] + a[r, j] * mr[j] if drop is not None else xr[j] + a[r, j]
                    o[j] = v
                    s += v
                sr = o
            else:
                for j in range(C):
                    s += sr[j]
            m = s / cf
            q = like(eps, 0)
            for j in range(C):
                d = sr[j] - m
                q += d * d
            rs = like(eps, 1) / math.sqrt(q / cf + eps)
            for j in range(C):
                o[j] = (sr[j] - m) * rs * w[j] + b[j]
            mean[r] = m
            rstd[r] = rs


@njit(cache=True)
def _minus(s, m):
    """s - m without fast-math flags: inlined into a fast-math loop, 'reassoc' still cannot regroup (x + a) - m
    into x + (a - m) (for C = 1 or a constant row s - m is exactly 0, and rstd = 1/sqrt(eps) magnifies any
    difference)."""
    return s - m


# the backward's loops, one function each, so that each is a plain loop over a few 1-d views that LLVM vectorises

@njit(cache=True, fastmath=FASTMATH)
def _sums_pair(s0, s1, y0, y1, w, m0, rs0, m1, rs1, dwc, dbc):
    """c1 * C, c2 * C of rows 0 and 1 of plain layernorm (s = x); dwc += dout xhat and dbc += dout of both rows
    (one update of each partial per pair)."""
    c10, c20, c11, c21 = like(m0, 0), like(m0, 0), like(m0, 0), like(m0, 0)
    for j in range(s0.size):
        xh0 = (s0[j] - m0) * rs0
        xh1 = (s1[j] - m1) * rs1
        wd0 = y0[j] * w[j]
        wd1 = y1[j] * w[j]
        c10 += wd0 * xh0
        c20 += wd0
        c11 += wd1 * xh1
        c21 += wd1
        dwc[j] += y0[j] * xh0 + y1[j] * xh1
        dbc[j] += y0[j] + y1[j]
    return c10, c20, c11, c21


@njit(cache=True, fastmath=FASTMATH)
def _sums_row(s0, y0, w, m0, rs0, dwc, dbc):
    c10, c20 = like(m0, 0), like(m0, 0)
    for j in range(s0.size):
        xh0 = (s0[j] - m0) * rs0
        wd0 = y0[j] * w[j]
        c10 += wd0 * xh0
        c20 += wd0
        dwc[j] += y0[j] * xh0
        dbc[j] += y0[j]
    return c10, c20


@njit(cache=True, fastmath=FASTMATH)
def _sums_pair_s(x0, a0, k0, x1, a1, k1, g0, g1, y0, y1, w, m0, rs0, m1, rs1, dwc, dbc):
    """_sums_pair of residual rows, s = x + a (* k, the dropout multipliers, when k is not None) formed in the
    same loop and stored into g (dx's rows) for the dx pass: one read of x and a."""
    c10, c20, c11, c21 = like(m0, 0), like(m0, 0), like(m0, 0), like(m0, 0)
    for j in range(x0.size):
        if k0 is None:
            v0 = x0[j] + a0[j]
            v1 = x1[j] + a1[j]
        else:
            v0 = x0[j] + a0[j] * k0[j]
            v1 = x1[j] + a1[j] * k1[j]
        g0[j] = v0
        g1[j] = v1
        xh0 = _minus(v0, m0) * rs0
        xh1 = _minus(v1, m1) * rs1
        wd0 = y0[j] * w[j]
        wd1 = y1[j] * w[j]
        c10 += wd0 * xh0
        c20 += wd0
        c11 += wd1 * xh1
        c21 += wd1
        dwc[j] += y0[j] * xh0 + y1[j] * xh1
        dbc[j] += y0[j] + y1[j]
    return c10, c20, c11, c21


@njit(cache=True, fastmath=FASTMATH)
def _sums_row_s(x0, a0, k0, g0, y0, w, m0, rs0, dwc, dbc):
    c10, c20 = like(m0, 0), like(m0, 0)
    for j in range(x0.size):
        if k0 is None:
            v0 = x0[j] + a0[j]
        else:
            v0 = x0[j] + a0[j] * k0[j]
        g0[j] = v0
        xh0 = _minus(v0, m0) * rs0
        wd0 = y0[j] * w[j]
        c10 += wd0 * xh0
        c20 += wd0
        dwc[j] += y0[j] * xh0
        dbc[j] += y0[j]
    return c10, c20


@njit(cache=True, fastmath=FASTMATH)
def _dx_row(s, y, w, m, rs, c1, c2, g):
    """g = (dout w - (xhat c1 + c2)) rstd with xhat = (s - m) rstd recomputed (s may be g itself)."""
    for j in range(s.size):
        g[j] = (y[j] * w[j] - ((s[j] - m) * rs * c1 + c2)) * rs


@njit(cache=True, fastmath=FASTMATH)
def _dx_row_inplace(g, y, w, m, rs, c1, c2):
    """_dx_row with s read from g: one array read and written, so no overlap check stands in the vectoriser's way."""
    for j in range(g.size):
        g[j] = (y[j] * w[j] - ((g[j] - m) * rs * c1 + c2)) * rs


@njit(cache=True, fastmath=FASTMATH)
def _scaled(g, mr, out):
    for j in range(g.size):
        out[j] = g[j] * mr[j]


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def _backward_v3(dout, x, a, drop, w, mean, rstd, dx, da, dwp, dbp, dw, db):
    R, C = x.shape
    cf = like(w[0], C)
    per, n = _chunks_nb(R)
    for c in prange(n):
        buf0 = np.empty(C + 8, x.dtype)              # the dropout multipliers of the pair's two rows
        buf1 = np.empty(C + 8, x.dtype)
        dwc, dbc = dwp[c], dbp[c]
        end = min(R, (c + 1) * per)
        for r in range(c * per, end, 2):
            two = r + 1 < end                        # else the last row of an odd chunk, alone
            if drop is None:
                k0 = k1 = None
            else:
                k0 = _multipliers(buf0, drop, r, C)
                k1 = _multipliers(buf1, drop, min(r + 1, end - 1), C)
            if two:
                if a is None:
                    c10, c20, c11, c21 = _sums_pair(x[r], x[r + 1], dout[r], dout[r + 1], w, mean[r], rstd[r],
                                                    mean[r + 1], rstd[r + 1], dwc, dbc)
                else:
                    c10, c20, c11, c21 = _sums_pair_s(x[r], a[r], k0, x[r + 1], a[r + 1], k1, dx[r], dx[r + 1],
                                                      dout[r], dout[r + 1], w, mean[r], rstd[r], mean[r + 1],
                                                      rstd[r + 1], dwc, dbc)
            else:
                if a is None:
                    c10, c20 = _sums_row(x[r], dout[r], w, mean[r], rstd[r], dwc, dbc)
                else:
                    c10, c20 = _sums_row_s(x[r], a[r], k0, dx[r], dout[r], w, mean[r], rstd[r], dwc, dbc)
                c11, c21 = c10, c20
            for k in range(2 if two else 1):
                c1, c2 = (c10, c20) if k == 0 else (c11, c21)
                if a is None:
                    _dx_row(x[r + k], dout[r + k], w, mean[r + k], rstd[r + k], c1 / cf, c2 / cf, dx[r + k])
                else:                                # s is in dx's row
                    _dx_row_inplace(dx[r + k], dout[r + k], w, mean[r + k], rstd[r + k], c1 / cf, c2 / cf)
                if da is not None:
                    _scaled(dx[r + k], k0 if k == 0 else k1, da[r + k])
    for c in range(n):                               # the partials in chunk order: the same bits every run
        for j in range(C):
            dw[j] += dwp[c, j]
            db[j] += dbp[c, j]


# v3 on fewer than PARALLEL_MIN elements: the same kernels compiled without parallel=True (prange runs as range),
# on the calling thread. Waking the two workqueue threads costs 0.03-0.08 ms, 0.2-0.3 ms right after a NumPy GEMM
# (OpenBLAS's threads still spin on both cores): more than the whole of a (1024, 256) layernorm's work (~0.15 ms
# backward, one thread), the size of every layernorm of the mini pretraining step. The rows and chunks are the same;
# LLVM may split a row's float32 sums over its SIMD lanes differently in the two compilations (a last-bit
# difference, inside the tolerance); each path gives the same bits on every run, whatever the thread count.
PARALLEL_MIN = 1 << 19
_forward_v3_serial = serial_twin(_forward_v3, cache=True, fastmath=FASTMATH)
_backward_v3_serial = serial_twin(_backward_v3, cache=True, fastmath=FASTMATH)


# ----------------------------------------------------------------------------------------------------------------
# launchers: the oracle's checks in the oracle's order, then rows

def _check_ln(x, w, b, eps):
    V.required("layernorm", x=x, w=w, b=b)
    V.floats("layernorm", x=x, w=w, b=b)
    V.min_ndim("layernorm", "x", x, 1, "(..., C)")
    V.shape("layernorm", "w", w, (x.shape[-1],), "(C,)")
    V.shape("layernorm", "b", b, (x.shape[-1],), "(C,)")
    V.layernorm_eps("layernorm", x, eps)


def _rows(x):
    return np.ascontiguousarray(x).reshape(-1, x.shape[-1])


def _run_forward(version, x, a, drop, w, b, eps):
    """-> out, (x2, a2, drop-or-keep, w, mean, rstd, shape): the kernel's forward on (R, C) rows."""
    x2 = _rows(x)
    a2 = None if a is None else _rows(a)
    R, C = x2.shape
    out = np.empty(x.shape, x.dtype)
    mean, rstd = np.empty(R, x.dtype), np.empty(R, x.dtype)
    dt = x.dtype.type
    w, b = np.ascontiguousarray(w), np.ascontiguousarray(b)
    if version == 1:
        keep, scale = None, dt(1.0)
        if drop is not None:
            keep = np.empty((R, C), np.bool_)
            _keep_v1(keep, drop[0], drop[1], drop[2])
            scale = dt(drop[3])
        _forward_v1(x2, a2, keep, scale, w, b, dt(eps), out.reshape(R, C), mean, rstd)
        mask = (keep, scale)
    else:
        mask = None if drop is None else (drop[0], drop[1], drop[2], dt(drop[3]))
        kernel = _forward_v2 if version == 2 else (_forward_v3 if x2.size >= PARALLEL_MIN else _forward_v3_serial)
        kernel(x2, a2, mask, w, b, dt(eps), out.reshape(R, C), mean, rstd)
    return out, (version, x2, a2, mask, w, mean, rstd, x.shape)


def _run_backward(dout, cache, with_da, op="layernorm"):
    version, x2, a2, mask, w, mean, rstd, shape = ops._cache(op, cache, 8)
    V.dout("layernorm", dout, shape, x2.dtype)
    R, C = x2.shape
    d2 = _rows(dout)
    per, n = _chunks(R)
    dwp, dbp = np.zeros((n, C), x2.dtype), np.zeros((n, C), x2.dtype)  # one partial row per chunk
    dx = np.empty(shape, x2.dtype)
    da = np.empty(shape, x2.dtype) if with_da else None
    da2 = None if da is None else da.reshape(R, C)
    if version == 3:
        dw, db = np.zeros(C, x2.dtype), np.zeros(C, x2.dtype)
        kernel = _backward_v3 if x2.size >= PARALLEL_MIN else _backward_v3_serial
        kernel(d2, x2, a2, mask, w, mean, rstd, dx.reshape(R, C), da2, dwp, dbp, dw, db)
        return dx, da, dw, db
    if version == 1:
        keep, scale = mask
        _backward_v1(d2, x2, a2, keep, scale, w, mean, rstd, dx.reshape(R, C), da2, dwp, dbp)
    else:
        _backward_v2(d2, x2, a2, mask, w, mean, rstd, dx.reshape(R, C), da2, dwp, dbp)
    return dx, da, dwp.sum(0), dbp.sum(0)            # partials added in chunk order: deterministic


def _layernorm_forward(version, x, w, b, eps):
    _check_ln(x, w, b, eps)
    if x.size == 0:                                  # empty rows or C = 0: the oracle's own behaviour
        return ops.layernorm_forward(x, w, b, eps)
    return _run_forward(version, x, None, None, w, b, eps)


def _layernorm_backward(dout, cache):
    if isinstance(cache, tuple) and len(cache) == 4:                 # the oracle's cache (empty input)
        return ops.layernorm_backward(dout, cache)
    dx, _, dw, db = _run_backward(dout, cache, False)
    return dx, dw, db


def _residual_forward(version, x, a, w, b, eps):
    V.required("residual_layernorm", x=x, a=a)
    V.floats("residual_layernorm", x=x, a=a)
    V.shape("residual_layernorm", "a", a, x.shape, "(same as x)")
    _check_ln(x, w, b, eps)
    if x.size == 0:
        return ops.residual_layernorm_forward(x, a, w, b, eps)
    return _run_forward(version, x, a, None, w, b, eps)


def _residual_backward(dout, cache):
    if isinstance(cache, tuple) and len(cache) == 1:
        return ops.residual_layernorm_backward(dout, cache)
    ds, _, dw, db = _run_backward(dout, cache, False, "residual_layernorm")
    return ds, ds, dw, db                            # the sum copies ds to both inputs: one array, read-only use


def _dropout_residual_forward(version, x, a, w, b, eps, p, rng, train):
    V.required("dropout_residual_layernorm", x=x, a=a)
    V.floats("dropout_residual_layernorm", x=x, a=a)
    V.shape("dropout_residual_layernorm", "a", a, x.shape, "(same as x)")
    if x.size == 0:
        return ops.dropout_residual_layernorm_forward(x, a, w, b, eps, p, rng, train)
    drop = draw(rng, p, train)                       # the oracle draws the stream before layernorm's checks
    _check_ln(x, w, b, eps)
    return _run_forward(version, x, a, drop, w, b, eps)


def _dropout_residual_backward(dout, cache):
    if isinstance(cache, tuple) and len(cache) == 2:
        return ops.dropout_residual_layernorm_backward(dout, cache)
    mask = ops._cache("dropout_residual_layernorm", cache, 8)[3]
    dropped = mask is not None and mask[0] is not None
    ds, da, dw, db = _run_backward(dout, cache, dropped, "dropout_residual_layernorm")
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


def layernorm_forward_v3(x, w, b, eps=1e-12):
    return _layernorm_forward(3, x, w, b, eps)


def residual_layernorm_forward_v3(x, a, w, b, eps=1e-12):
    return _residual_forward(3, x, a, w, b, eps)


def dropout_residual_layernorm_forward_v3(x, a, w, b, eps=1e-12, p=0.0, rng=None, train=True):
    return _dropout_residual_forward(3, x, a, w, b, eps, p, rng, train)


# the cache names its version, so one backward serves every version of an op
layernorm_backward_v1 = layernorm_backward_v2 = layernorm_backward_v3 = _layernorm_backward
residual_layernorm_backward_v1 = residual_layernorm_backward_v2 = residual_layernorm_backward_v3 = _residual_backward
dropout_residual_layernorm_backward_v1 = dropout_residual_layernorm_backward_v2 = _dropout_residual_backward
dropout_residual_layernorm_backward_v3 = _dropout_residual_backward

# the best versions
layernorm_forward, layernorm_backward = layernorm_forward_v3, layernorm_backward_v3
residual_layernorm_forward, residual_layernorm_backward = residual_layernorm_forward_v3, residual_layernorm_backward_v3
dropout_residual_layernorm_forward = dropout_residual_layernorm_forward_v3
dropout_residual_layernorm_backward = dropout_residual_layernorm_backward_v3


# ----------------------------------------------------------------------------------------------------------------
# specs: one per op

def make_inputs(shape, dtype, seed):
    """shape: dict(lead=tuple, C=int, kind in {"ln", "res", "drop"}, p, train)."""
    r = np.random.default_rng(seed)
    lead, C, kind = shape["lead"], shape["C"], shape.get("kind", "ln")
    x = (r.standard_normal((*lead, C)) * 2 + 0.5).astype(dtype)
    w, b = (1 + 0.1 * r.standard_normal(C)).astype(dtype), (0.1 * r.standard_normal(C)).astype(dtype)
    if kind == "ln":
        return dict(x=x, w=w, b=b), {}
    a = r.standard_normal((*lead, C)).astype(dtype)
    if kind == "res":
        return dict(x=x, a=a, w=w, b=b), {}
    return dict(x=x, a=a, w=w, b=b), dict(p=shape.get("p", 0.1), rng=DropoutRNG(3), train=shape.get("train", True))


def _nbytes(inputs, kwargs):
    # forward reads x (and a), writes out; backward reads dout, x (and a), writes dx (and da for dropout)
    n = inputs["x"].nbytes
    if "a" not in inputs:
        return 5 * n
    return (8 if kwargs.get("p", 0) > 0 and kwargs.get("train", True) else 7) * n


def _torch_peer(inputs, kwargs):
    import torch
    F = torch.nn.functional
    t = {k: torch.from_numpy(v).requires_grad_() for k, v in inputs.items()}
    C = inputs["x"].shape[-1]
    dout = torch.randn(inputs["x"].shape, dtype=t["x"].dtype)

    def step():
        s = t["x"]
        if "a" in t:
            s = s + (F.dropout(t["a"], kwargs["p"], training=kwargs["train"]) if kwargs else t["a"])
        out = F.layer_norm(s, (C,), t["w"], t["b"], 1e-12)
        torch.autograd.grad(out, list(t.values()), dout)
    return step


_TOL = {np.float64: (1e-12, 1e-11), np.float32: (1e-5, 1e-4)}
_SHAPES = [dict(lead=(1,), C=1), dict(lead=(3,), C=37), dict(lead=(2, 5), C=52), dict(lead=(), C=9),
           dict(lead=(1, 1), C=768), dict(lead=(67,), C=5), dict(lead=(130,), C=33)]
_BENCH = dict(lead=(4 * 512,), C=768)


def _spec(name, kind, versions, oracle, wrt, extra=()):
    return KernelSpec(
        name=name, oracle=oracle, versions=versions, make_inputs=make_inputs, wrt=wrt,
        shapes=[dict(s, kind=kind) for s in _SHAPES] + list(extra), bench_shape=dict(_BENCH, kind=kind),
        tol=_TOL, nbytes=_nbytes, torch_peer=_torch_peer,
        notes={1: "one row per prange, 3 passes from the inputs, float64 sums",
               2: "s kept in the output row (L1), SIMD dtype sums, Philox blocks, chunked rows",
               3: "x read in place (no s copy for plain layernorm); backward rows in pairs, no xhat row"})


SPEC = _spec("layernorm", "ln",
             {1: (layernorm_forward_v1, layernorm_backward_v1), 2: (layernorm_forward_v2, layernorm_backward_v2),
              3: (layernorm_forward_v3, layernorm_backward_v3)},
             (ops.layernorm_forward, ops.layernorm_backward), ("x", "w", "b"))
SPEC_RESIDUAL = _spec("residual_layernorm", "res",
                      {1: (residual_layernorm_forward_v1, residual_layernorm_backward_v1),
                       2: (residual_layernorm_forward_v2, residual_layernorm_backward_v2),
                       3: (residual_layernorm_forward_v3, residual_layernorm_backward_v3)},
                      (ops.residual_layernorm_forward, ops.residual_layernorm_backward), ("x", "a", "w", "b"))
SPEC_DROPOUT = _spec("dropout_residual_layernorm", "drop",
                     {1: (dropout_residual_layernorm_forward_v1, dropout_residual_layernorm_backward_v1),
                      2: (dropout_residual_layernorm_forward_v2, dropout_residual_layernorm_backward_v2),
                      3: (dropout_residual_layernorm_forward_v3, dropout_residual_layernorm_backward_v3)},
                     (ops.dropout_residual_layernorm_forward, ops.dropout_residual_layernorm_backward),
                     ("x", "a", "w", "b"),
                     extra=[dict(lead=(3,), C=37, kind="drop", p=0.5), dict(lead=(2, 3), C=7, kind="drop", p=1.0),
                            dict(lead=(3,), C=37, kind="drop", train=False), dict(lead=(2,), C=5, kind="drop", p=0.0)])

# the second shape of the speed target, (8192, 768): 24 MB a tensor, more than L3 (refbert bench times it too)
SPEC_8192 = KernelSpec(**{**SPEC.__dict__, "bench_shape": dict(lead=(8192,), C=768, kind="ln")})
SPEC_RESIDUAL_8192 = KernelSpec(**{**SPEC_RESIDUAL.__dict__, "bench_shape": dict(lead=(8192,), C=768, kind="res")})

if __name__ == "__main__":
    for spec in (SPEC, SPEC_RESIDUAL, SPEC_DROPOUT, SPEC_8192, SPEC_RESIDUAL_8192):
        main(spec)
