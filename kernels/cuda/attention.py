"""Oracle: refbert.ops.attention_forward / attention_backward / attention_probs — softmax(q k^T / sqrt(hs) + mask),
dropped out, times v, per head, in Numba CUDA (same signatures, same ValueErrors, same dropout elements).

    attention_forward(q, k, v, n_heads, mask=None, dropout_p=0.0, rng=None, train=True) -> (out, cache)
    attention_backward(dout, cache) -> (dq, dk, dv)
    attention_probs(cache) -> (B, H, T, T) probabilities after dropout, recomputed (output_attentions)

q, k, v, out: (B, T, C), head h is columns h*hs:(h+1)*hs.  Per row i of one head (b, h), scale = 1/sqrt(hs):
    s_ij = scale * q_i . k_j + mask_ij        m_i = max_j s_ij       l_i = sum_j exp(s_ij - m_i)
    p_ij = exp(s_ij - m_i) / l_i              z_ij = keep_ij / (1 - p_drop)        out_i = sum_j p_ij z_ij v_j
keep_ij is refbert.philox's: element e = ((b*H + h)*T + i)*T + j of the call's (seed, stream) is kept iff its
Philox4x32-10 word >= round(p_drop * 2^32) — an integer comparison, so every version and dtype keeps exactly the
oracle's elements, and the backward regenerates the mask instead of storing it.
As kernels/attention.py, the cache keeps the per-row statistics m and 1/l (not their logsumexp m + log l: with HF's
finfo.min padding a row of only padding has m = finfo.min and finfo.min + log T rounds back to finfo.min).
Backward (FlashAttention-2, Dao 2023, Algorithm 2), recomputing p from (m, 1/l) and z from Philox:
    dv_j = sum_i p_ij z_ij dout_i                 dp_ij = z_ij (dout_i . v_j)
    D_i  = dout_i . out_i  (= sum_j p_ij dp_ij)   ds_ij = p_ij (dp_ij - D_i)
    dq_i = scale sum_j ds_ij k_j                  dk_j = scale sum_i ds_ij q_i

Versions (llm.c dev/cuda style; `python -m refbert_kernels.cuda.attention` validates every version; set
NUMBA_ENABLE_CUDASIM=1 to run them on the CPU in Numba's simulator):
    1  materialised (B, H, T, T): separate kernels, a thread per score (q.k + mask), per row (max, sum -> m, 1/l),
       per probability (softmax, then dropout from Philox), per output element (sum_j p v); the backward likewise:
       dp = (dout . v) z, softmax backward per row with D = sum_j p dp, then dv, dq, dk as one thread per element
    2  flash forward: a block per (b, h, BQ-query tile), a thread per query row holding q_i and its accumulator in
       registers; K and V tiles of BK keys staged in shared memory; online softmax (running max m and sum l,
       rescaled by exp(m - m') when the max grows); out and (m, 1/l) written, never the scores.
       Backward: version 1's (reads the cached m, 1/l)
    3  flash backward with recomputation, no atomics: D_i = dout_i . out_i (a thread per row); a block per
       (b, h, BK-key tile) with a thread per key row accumulates dk_j, dv_j over query tiles staged in shared
       memory; a second kernel, a block per (b, h, BQ-query tile), accumulates dq_i over key tiles.
       Forward: version 2's
The CUDA C versions (tensor cores, cp.async double buffering) are kernels/cuda/csrc/attention_*.cu, launched by
kernels/cuda/cuda_c.py.

Precisions: f64 and f32 compute in their own dtype; f16 / bf16 storage (bf16 as its uint16 bit pattern inside the
kernel, _common.dev) read into float32, every dot product, exp and sum in float32, one rounding on the store;
m and 1/l are kept in the accumulation type (float32) whatever the storage.
Tolerances (stated in SPEC): f64 atol 1e-12, rtol 1e-10 (only the order of sums and exp differ from NumPy's);
f32 atol 2e-5, rtol 1e-4 (CUDA's expf is within 2 ulp, sums over T and hs in another order, online rescaling adds
one rounded exp per key tile, and NVVM may contract q.k * scale + mask into an fma: ~1e-6 relative on O(1)
outputs, and gradients are sums of T such terms); f16 / bf16: 8 ulp of the storage type against the float64 oracle
on the same rounded inputs (one rounding on the store, and the backward reads out rounded to storage for D, whose
0.5 ulp error reaches ds through p * D).
"""
import functools
import math

import numpy as np
from numba import cuda, float32, float64, uint16
from numba.core.types import float16

from refbert import ops
from refbert import validate as V
from refbert.philox import DropoutRNG, threshold

from refbert_kernels._harness import KernelSpec, main  # noqa: F401
from refbert_kernels.attention import _flops, _nbytes
from refbert_kernels.attention import make_inputs as _cpu_make_inputs

from . import _common as C
from ._common import acc_np, ldst

SIM = C.SIM
BQ = 4 if SIM else 64                  # query rows per block of versions 2 and 3 (a thread each)
BKMAX = 4 if SIM else 32               # keys per shared-memory tile (fewer when 2 tiles of hs would pass 32 KiB)
TPB = 32 if SIM else 256               # threads per block of version 1's one-thread-per-element kernels
_SOFTMAX_ERROR = ("softmax: argument 'x' (with 'mask') expected every row to have a finite maximum, got a row "
                  "that is entirely -inf, or a NaN/+inf score")


def _bk(kind, hs):
    """Keys per tile: BKMAX, halved while the K and V tiles (2 * BK * hs storage elements) exceed 32 KiB."""
    size = {"f64": 8, "f32": 4, "f16": 2, "bf16": 2}[kind]
    bk = BKMAX
    while bk > 1 and 2 * bk * hs * size > 32 * 1024:
        bk //= 2
    return bk


def _storage_nb(kind):
    return {"f64": float64, "f32": float32, "f16": float16, "bf16": uint16}[kind]


# ----------------------------------------------------------------------------------------------------------------
# device helpers: the mask entry of (b, h, i, j) from a 4-D mask whose axes are 1 or full; the keep factor z

@cuda.jit(device=True)
def _mask_at(mask, b, h, i, j):
    return mask[b if mask.shape[0] != 1 else 0, h if mask.shape[1] != 1 else 0,
                i if mask.shape[2] != 1 else 0, j if mask.shape[3] != 1 else 0]


# ----------------------------------------------------------------------------------------------------------------
# kernels, compiled per (storage kind, head size hs): hs sizes the registers (local arrays) and shared tiles

@functools.lru_cache(maxsize=None)
def _kernels(kind, hs):
    ld, st = ldst(kind)
    A = acc_np(kind)
    acc = C.acc_nb(kind)
    sto = _storage_nb(kind)
    zero, one, ninf = A(0), A(1), A(-np.inf)
    HS = hs
    BK = _bk(kind, hs)
    K = {}

    @cuda.jit(device=True)
    def zfac(e, seed, stream, thresh, dscale):
        """z of flat element e: dscale if kept (or no dropout), else 0."""
        if thresh == 0:
            return dscale
        return dscale if C.philox_word(e, stream, seed) >= thresh else zero

    # ---- version 1: materialised scores ------------------------------------------------------------------------
    @C.jit_kernel
    def scores(q, k, mask, H, scale, S):
        """S[b, h, i, j] = scale * q_i . k_j + mask_ij   (a thread per score)"""
        e = cuda.grid(1)
        B, Hh, T, _ = S.shape
        if e >= B * H * T * T:
            return
        j = e % T
        i = (e // T) % T
        bh = e // (T * T)
        b, h = bh // H, bh % H
        c0 = h * HS
        a = zero
        for d in range(HS):
            a += ld(q[b, i, c0 + d]) * ld(k[b, j, c0 + d])
        S[b, h, i, j] = a * A(scale) + ld(_mask_at(mask, b, h, i, j))

    @C.jit_kernel
    def rowstats(S, m, linv):
        """m_i = max_j S_ij, 1/l_i = 1 / sum_j exp(S_ij - m_i)   (a thread per row)"""
        r = cuda.grid(1)
        B, H, T, _ = S.shape
        if r >= B * H * T:
            return
        b, h, i = r // (H * T), (r // T) % H, r % T
        mx = ninf
        l = zero
        for j in range(T):
            s = S[b, h, i, j]
            if s != s:
                mx = s                                         # NaN: poisons l below, the wrapper raises
                break
            mx = max(mx, s)
        for j in range(T):
            l += math.exp(S[b, h, i, j] - mx)
        m[b, h, i] = mx
        linv[b, h, i] = one / l

    @C.jit_kernel
    def probs(S, m, linv, seed, stream, thresh, dscale, P, PD):
        """P = exp(S - m) / l (softmax), PD = P * z (after dropout)   (a thread per probability)"""
        e = cuda.grid(1)
        B, H, T, _ = S.shape
        if e >= B * H * T * T:
            return
        j = e % T
        i = (e // T) % T
        bh = e // (T * T)
        b, h = bh // H, bh % H
        p = math.exp(S[b, h, i, j] - m[b, h, i]) * linv[b, h, i]
        P[b, h, i, j] = p
        PD[b, h, i, j] = p * zfac(e, seed, stream, thresh, A(dscale))

    @C.jit_kernel
    def context(PD, v, out):
        """out[b, i, h*hs + d] = sum_j PD[b, h, i, j] v[b, j, h*hs + d]   (a thread per output element)"""
        e = cuda.grid(1)
        B, T, Cc = out.shape
        if e >= B * T * Cc:
            return
        c = e % Cc
        i = (e // Cc) % T
        b = e // (T * Cc)
        h = c // HS
        a = zero
        for j in range(T):
            a += PD[b, h, i, j] * ld(v[b, j, c])
        out[b, i, c] = st(a)

    @C.jit_kernel
    def dprobs(dout, v, seed, stream, thresh, dscale, dP):
        """dP[b, h, i, j] = z_ij (dout_i . v_j)   (dropout backward of dpd = dout v^T; a thread per entry)"""
        e = cuda.grid(1)
        B, H, T, _ = dP.shape
        if e >= B * H * T * T:
            return
        j = e % T
        i = (e // T) % T
        bh = e // (T * T)
        b, h = bh // H, bh % H
        c0 = h * HS
        a = zero
        for d in range(HS):
            a += ld(dout[b, i, c0 + d]) * ld(v[b, j, c0 + d])
        dP[b, h, i, j] = a * zfac(e, seed, stream, thresh, A(dscale))

    @C.jit_kernel
    def softmax_bwd(P, dP, scale):
        """dP <- dS = scale * P (dP - D), D_i = sum_j P_ij dP_ij   (a thread per row, in place)"""
        r = cuda.grid(1)
        B, H, T, _ = P.shape
        if r >= B * H * T:
            return
        b, h, i = r // (H * T), (r // T) % H, r % T
        D = zero
        for j in range(T):
            D += P[b, h, i, j] * dP[b, h, i, j]
        for j in range(T):
            dP[b, h, i, j] = A(scale) * P[b, h, i, j] * (dP[b, h, i, j] - D)

    @C.jit_kernel
    def matmul_t(W, x, trans, out):
        """out[b, i, h*hs + d] = sum_j W'[b, h, i, j] x[b, j, h*hs + d], W' = W or W^T (trans)   (a thread per
        element): dv = PD^T dout, dq = dS k, dk = dS^T q."""
        e = cuda.grid(1)
        B, T, Cc = out.shape
        if e >= B * T * Cc:
            return
        c = e % Cc
        i = (e // Cc) % T
        b = e // (T * Cc)
        h = c // HS
        a = zero
        if trans:
            for j in range(T):
                a += W[b, h, j, i] * ld(x[b, j, c])
        else:
            for j in range(T):
                a += W[b, h, i, j] * ld(x[b, j, c])
        out[b, i, c] = st(a)

    K[1] = dict(scores=scores, rowstats=rowstats, probs=probs, context=context, dprobs=dprobs,
                softmax_bwd=softmax_bwd, matmul_t=matmul_t)

    # ---- version 2: flash forward --------------------------------------------------------------------------------
    @C.jit_kernel
    def flash_fwd(q, k, v, mask, H, scale, seed, stream, thresh, dscale, out, m, linv):
        """grid (ceil(T / BQ), B * H), BQ threads: thread t owns query row i = tile * BQ + t."""
        ks = cuda.shared.array((BK, HS), sto)                 # the K tile
        vs = cuda.shared.array((BK, HS), sto)                 # the V tile
        qr = cuda.local.array(HS, acc)                        # q_i * scale, in registers
        o = cuda.local.array(HS, acc)                         # unnormalised sum_j exp(s_ij - m_i) z_ij v_j
        sr = cuda.local.array(BK, acc)                        # the scores of row i against the tile
        t = cuda.threadIdx.x
        bh = cuda.blockIdx.y
        b, h = bh // H, bh % H
        T = q.shape[1]
        i = cuda.blockIdx.x * BQ + t
        active = i < T                                        # a tail thread still loads tiles and syncs
        c0 = h * HS
        sc, ds = A(scale), A(dscale)
        for d in range(HS):
            qr[d] = ld(q[b, i, c0 + d]) if active else zero
            o[d] = zero
        mi, li = ninf, zero
        row = (bh * T + i) * T                                # flat index of (b, h, i, 0)
        for j0 in range(0, T, BK):
            nk = min(BK, T - j0)
            cuda.syncthreads()                                # the previous tile is consumed
            for x in range(t, nk * HS, BQ):                   # cooperative load of the K and V tiles
                jj, d = x // HS, x % HS
                ks[jj, d] = k[b, j0 + jj, c0 + d]
                vs[jj, d] = v[b, j0 + jj, c0 + d]
            cuda.syncthreads()
            if active:
                mb = mi
                for jj in range(nk):                          # s_ij for the tile, and its max
                    a = zero
                    for d in range(HS):
                        a += qr[d] * ld(ks[jj, d])
                    s = a * sc + ld(_mask_at(mask, b, h, i, j0 + jj))
                    sr[jj] = s
                    if s != s:
                        mb = s
                    elif mb == mb:
                        mb = max(mb, s)
                if mb != ninf:                                # only -inf so far: nothing to add yet
                    alpha = math.exp(mi - mb) if mi != ninf else zero   # rescale what was summed under mi
                    li *= alpha
                    for d in range(HS):
                        o[d] *= alpha
                    cur = np.uint64(0xFFFFFFFFFFFFFFFF)
                    w0 = w1 = w2 = w3 = np.uint64(0)
                    for jj in range(nk):
                        p = math.exp(sr[jj] - mb)
                        li += p
                        if thresh != 0:                       # Philox: one call per 4 consecutive elements
                            e = np.uint64(row + j0 + jj)
                            blk = e >> np.uint64(2)
                            if blk != cur:
                                w0, w1, w2, w3 = C.philox_block(blk, stream, seed)
                                cur = blk
                            lane = e & np.uint64(3)
                            w = w0 if lane == 0 else (w1 if lane == 1 else (w2 if lane == 2 else w3))
                            if w < thresh:
                                p = zero
                        for d in range(HS):
                            o[d] += p * ld(vs[jj, d])
                    mi = mb
        if active:
            inv = one / li
            for d in range(HS):
                out[b, i, c0 + d] = st(o[d] * (inv * ds))
            m[b, h, i] = mi
            linv[b, h, i] = inv

    K[2] = dict(flash_fwd=flash_fwd)

    # ---- version 3: flash backward -------------------------------------------------------------------------------
    @C.jit_kernel
    def rowdot(dout, out, H, Dr):
        """D[b, h, i] = dout_i . out_i   (a thread per row)"""
        r = cuda.grid(1)
        B, _, T = Dr.shape
        if r >= B * H * T:
            return
        b, h, i = r // (H * T), (r // T) % H, r % T
        c0 = h * HS
        a = zero
        for d in range(HS):
            a += ld(dout[b, i, c0 + d]) * ld(out[b, i, c0 + d])
        Dr[b, h, i] = a

    @C.jit_kernel
    def flash_dkdv(q, k, v, mask, H, scale, seed, stream, thresh, dscale, m, linv, dout, Dr, dk, dv):
        """grid (ceil(T / BQ), B * H), BQ threads: thread t owns key row j = tile * BQ + t; query tiles of BK rows
        (q, dout, m, 1/l, D) are staged in shared memory. dv_j = sum_i p z dout_i, dk_j = scale sum_i ds q_i."""
        qs = cuda.shared.array((BK, HS), sto)
        dos = cuda.shared.array((BK, HS), sto)
        ms = cuda.shared.array(BK, acc)
        lis = cuda.shared.array(BK, acc)
        Ds = cuda.shared.array(BK, acc)
        kr = cuda.local.array(HS, acc)
        vr = cuda.local.array(HS, acc)
        dka = cuda.local.array(HS, acc)
        dva = cuda.local.array(HS, acc)
        t = cuda.threadIdx.x
        bh = cuda.blockIdx.y
        b, h = bh // H, bh % H
        T = q.shape[1]
        j = cuda.blockIdx.x * BQ + t
        active = j < T
        c0 = h * HS
        sc, dsc = A(scale), A(dscale)
        for d in range(HS):
            kr[d] = ld(k[b, j, c0 + d]) if active else zero
            vr[d] = ld(v[b, j, c0 + d]) if active else zero
            dka[d] = zero
            dva[d] = zero
        for i0 in range(0, T, BK):
            ni = min(BK, T - i0)
            cuda.syncthreads()
            for x in range(t, ni * HS, BQ):
                ii, d = x // HS, x % HS
                qs[ii, d] = q[b, i0 + ii, c0 + d]
                dos[ii, d] = dout[b, i0 + ii, c0 + d]
            for ii in range(t, ni, BQ):
                ms[ii] = m[b, h, i0 + ii]
                lis[ii] = linv[b, h, i0 + ii]
                Ds[ii] = Dr[b, h, i0 + ii]
            cuda.syncthreads()
            if active:
                for ii in range(ni):
                    i = i0 + ii
                    a = zero
                    dpd = zero
                    for d in range(HS):
                        a += ld(qs[ii, d]) * kr[d]
                        dpd += ld(dos[ii, d]) * vr[d]
                    p = math.exp(a * sc + ld(_mask_at(mask, b, h, i, j)) - ms[ii]) * lis[ii]   # recomputed p_ij
                    z = zfac(np.uint64((bh * T + i) * T + j), seed, stream, thresh, dsc)
                    ds = p * (dpd * z - Ds[ii])
                    pz = p * z
                    for d in range(HS):
                        dva[d] += pz * ld(dos[ii, d])
                        dka[d] += ds * ld(qs[ii, d])
        if active:
            for d in range(HS):
                dk[b, j, c0 + d] = st(dka[d] * sc)
                dv[b, j, c0 + d] = st(dva[d])

    @C.jit_kernel
    def flash_dq(q, k, v, mask, H, scale, seed, stream, thresh, dscale, m, linv, dout, Dr, dq):
        """grid (ceil(T / BQ), B * H), BQ threads: thread t owns query row i; key tiles of BK rows (k, v) in shared
        memory. dq_i = scale sum_j ds_ij k_j."""
        ks = cuda.shared.array((BK, HS), sto)
        vs = cuda.shared.array((BK, HS), sto)
        qr = cuda.local.array(HS, acc)
        dor = cuda.local.array(HS, acc)
        dqa = cuda.local.array(HS, acc)
        t = cuda.threadIdx.x
        bh = cuda.blockIdx.y
        b, h = bh // H, bh % H
        T = q.shape[1]
        i = cuda.blockIdx.x * BQ + t
        active = i < T
        c0 = h * HS
        sc, dsc = A(scale), A(dscale)
        for d in range(HS):
            qr[d] = ld(q[b, i, c0 + d]) if active else zero
            dor[d] = ld(dout[b, i, c0 + d]) if active else zero
            dqa[d] = zero
        mi = m[b, h, i] if active else zero
        lii = linv[b, h, i] if active else zero
        Di = Dr[b, h, i] if active else zero
        for j0 in range(0, T, BK):
            nk = min(BK, T - j0)
            cuda.syncthreads()
            for x in range(t, nk * HS, BQ):
                jj, d = x // HS, x % HS
                ks[jj, d] = k[b, j0 + jj, c0 + d]
                vs[jj, d] = v[b, j0 + jj, c0 + d]
            cuda.syncthreads()
            if active:
                for jj in range(nk):
                    j = j0 + jj
                    a = zero
                    dpd = zero
                    for d in range(HS):
                        a += qr[d] * ld(ks[jj, d])
                        dpd += dor[d] * ld(vs[jj, d])
                    p = math.exp(a * sc + ld(_mask_at(mask, b, h, i, j)) - mi) * lii
                    z = zfac(np.uint64((bh * T + i) * T + j), seed, stream, thresh, dsc)
                    ds = p * (dpd * z - Di)
                    for d in range(HS):
                        dqa[d] += ds * ld(ks[jj, d])
        if active:
            for d in range(HS):
                dq[b, i, c0 + d] = st(dqa[d] * sc)

    K[3] = dict(rowdot=rowdot, flash_dkdv=flash_dkdv, flash_dq=flash_dq)
    return K


# ----------------------------------------------------------------------------------------------------------------
# host side: the oracle's checks (in the oracle's order), the dropout stream, scratch arrays, launches

def _scratch(xp, shape, dtype):
    """A device array no caller reads back: CuPy's for CuPy inputs, Numba's otherwise (no copy to the host)."""
    return xp.empty(shape, dtype) if xp is not np else cuda.device_array(shape, dtype)


def _mask4(xp, mask, B, H, T, dtype):
    """The mask as a contiguous 4-D array with each axis 1 or full (its own size, never broadcast to B*H*T*T)."""
    if mask is None:
        return xp.zeros((1, 1, 1, 1), dtype)
    m = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    return xp.ascontiguousarray(m)


def _checks(q, k, v, n_heads, mask):
    C.floats("attention", q=q, k=k, v=v, mask=mask)
    V.shape("attention", "q", C.stub(q), (None, None, None), "(B, T, C)")
    V.shape("attention", "k", C.stub(k), q.shape, "(B, T, C) as q")
    V.shape("attention", "v", C.stub(v), q.shape, "(B, T, C) as q")
    B, T, Cc = q.shape
    if not isinstance(n_heads, (int, np.integer)) or n_heads < 1 or Cc % n_heads:
        raise ValueError(f"attention: argument 'n_heads' expected a positive divisor of C = {Cc}, got {n_heads}")
    H = int(n_heads)
    if mask is not None:
        V.broadcasts_to("attention", "mask", C.stub(mask), (B, H, T, T))
    C.heads_grid("attention", B, H)
    return B, T, Cc, H


def _drop(dropout_p, rng, train):
    """(dropping, p_ok, (seed, stream, thresh, dscale)) without drawing the stream yet."""
    p_ok = isinstance(dropout_p, (int, float, np.integer, np.floating)) and 0.0 <= dropout_p <= 1.0
    dropping = p_ok and train and dropout_p > 0.0 and isinstance(rng, DropoutRNG)
    seed, stream, thresh, dscale = 0, 0, 0, 1.0
    if dropping:
        seed, stream = rng.seed, rng.calls          # the stream next_stream() hands out, drawn once checks pass
        thresh, dscale = threshold(dropout_p), (1.0 / (1.0 - dropout_p) if dropout_p < 1.0 else 0.0)
    return dropping, p_ok, (np.uint64(seed), np.uint64(stream), np.uint64(thresh), float(dscale))


def _degenerate(q, k, v, n_heads, mask, dropout_p, rng, train):
    """Empty shapes: the oracle's own behaviour on host copies, the output moved back to q's array module."""
    xp = C.xp_of(q)
    h = lambda a: None if a is None else C.to_host(a)  # noqa: E731
    out, _ = ops.attention_forward(h(q), h(k), h(v), n_heads, h(mask), dropout_p, rng, train)
    out = C.to_xp(xp, out)
    return out, (q, k, v, None, int(n_heads), out, None, None, (np.uint64(0),) * 3 + (1.0,))


def _forward(version, q, k, v, n_heads, mask, dropout_p, rng, train):
    """Checks as the oracle does, runs the version's forward, returns (out, cache).
    cache = (q, k, v, mask4, H, out, m, linv, (seed, stream, thresh, dscale))."""
    B, T, Cc, H = _checks(q, k, v, n_heads, mask)
    if q.size == 0 or T == 0:
        return _degenerate(q, k, v, n_heads, mask, dropout_p, rng, train)
    xp = C.xp_of(q)
    kind, hs = C.kind_of(q.dtype), Cc // H
    K = _kernels(kind, hs)
    adt = acc_np(kind)
    mask4 = _mask4(xp, mask, B, H, T, q.dtype)
    scale = 1.0 / math.sqrt(hs)
    dropping, p_ok, drop = _drop(dropout_p, rng, train)
    qd, kd, vd, md = C.din(q), C.din(k), C.din(v), C.din(mask4)
    out = xp.empty(q.shape, q.dtype)
    m = xp.empty((B, H, T), adt)
    linv = xp.empty((B, H, T), adt)
    if version == 1:
        S = _scratch(xp, (B, H, T, T), adt)
        n = B * H * T * T
        K[1]["scores"][C.grid_for(n, TPB), TPB](qd, kd, md, H, scale, S)
        K[1]["rowstats"][C.grid_for(B * H * T, TPB), TPB](S, m, linv)
        P, PD = _scratch(xp, (B, H, T, T), adt), _scratch(xp, (B, H, T, T), adt)
        K[1]["probs"][C.grid_for(n, TPB), TPB](S, m, linv, *drop, P, PD)
        K[1]["context"][C.grid_for(B * T * Cc, TPB), TPB](PD, vd, C.dev(out))
    else:
        grid = (C.grid_for(T, BQ), B * H)
        K[2]["flash_fwd"][grid, BQ](qd, kd, vd, md, H, scale, *drop, C.dev(out), m, linv)
    if C.checks_on(m) and not (bool(xp.isfinite(m).all()) and bool(xp.isfinite(linv).all())):
        raise ValueError(_SOFTMAX_ERROR)         # (device arrays: a sync, so only with REFBERT_CUDA_CHECKS=1)
    if not p_ok or (train and dropout_p > 0.0 and not isinstance(rng, DropoutRNG)):
        ops.dropout_forward(np.zeros(0, np.float32), dropout_p, rng, train)  # raises the oracle's dropout error
    if dropping:
        assert rng.next_stream() == (int(drop[0]), int(drop[1]))
    return out, (q, k, v, mask4, H, out, m, linv, drop)


def _backward(version, dout, cache):
    q, k, v, mask4, H, out, m, linv, drop = cache
    C.dout("attention", dout, out.shape, out.dtype)
    xp = C.xp_of(q)
    if q.size == 0:
        return xp.zeros_like(q), xp.zeros_like(k), xp.zeros_like(v)
    B, T, Cc = q.shape
    kind, hs = C.kind_of(q.dtype), Cc // H
    K = _kernels(kind, hs)
    adt = acc_np(kind)
    scale = 1.0 / math.sqrt(hs)
    qd, kd, vd, md, dod = C.din(q), C.din(k), C.din(v), C.din(mask4), C.din(C.contiguous(dout))
    md_, ld_ = C.din(m), C.din(linv)
    dq, dk, dv = (xp.empty(q.shape, q.dtype) for _ in range(3))
    if version in (1, 2):
        n = B * H * T * T
        S = _scratch(xp, (B, H, T, T), adt)
        K[1]["scores"][C.grid_for(n, TPB), TPB](qd, kd, md, H, scale, S)
        P, PD = _scratch(xp, (B, H, T, T), adt), _scratch(xp, (B, H, T, T), adt)
        K[1]["probs"][C.grid_for(n, TPB), TPB](S, md_, ld_, *drop, P, PD)
        dP = S                                                      # S is no longer needed: reuse it for dP, dS
        K[1]["dprobs"][C.grid_for(n, TPB), TPB](dod, vd, *drop, dP)
        K[1]["softmax_bwd"][C.grid_for(B * H * T, TPB), TPB](P, dP, scale)
        g = (C.grid_for(B * T * Cc, TPB), TPB)
        K[1]["matmul_t"][g](PD, dod, True, C.dev(dv))             # dv = PD^T dout
        K[1]["matmul_t"][g](dP, kd, False, C.dev(dq))             # dq = dS k
        K[1]["matmul_t"][g](dP, qd, True, C.dev(dk))              # dk = dS^T q
    else:
        Dr = _scratch(xp, (B, H, T), adt)
        K[3]["rowdot"][C.grid_for(B * H * T, TPB), TPB](dod, C.din(out), H, Dr)
        grid = (C.grid_for(T, BQ), B * H)
        K[3]["flash_dkdv"][grid, BQ](qd, kd, vd, md, H, scale, *drop, md_, ld_, dod, Dr, C.dev(dk), C.dev(dv))
        K[3]["flash_dq"][grid, BQ](qd, kd, vd, md, H, scale, *drop, md_, ld_, dod, Dr, C.dev(dq))
    return dq, dk, dv


def attention_probs(cache):
    """The attention probabilities after dropout, (B, H, T, T), recomputed from the cache (output_attentions);
    in the storage dtype, the same for every version's cache."""
    q, k, v, mask4, H, out, m, linv, drop = cache
    xp = C.xp_of(q)
    B, T, Cc = q.shape
    if q.size == 0:
        return xp.zeros((B, H, T, T), q.dtype)
    kind, hs = C.kind_of(q.dtype), Cc // H
    K = _kernels(kind, hs)
    adt = acc_np(kind)
    n = B * H * T * T
    S = _scratch(xp, (B, H, T, T), adt)
    K[1]["scores"][C.grid_for(n, TPB), TPB](C.din(q), C.din(k), C.din(mask4), H, 1.0 / math.sqrt(hs), S)
    P = _scratch(xp, (B, H, T, T), adt)
    PD = xp.empty((B, H, T, T), adt)
    K[1]["probs"][C.grid_for(n, TPB), TPB](S, C.din(m), C.din(linv), *drop, P, PD)
    if PD.dtype != q.dtype:                                          # f16 / bf16 storage: round once
        if C.BF16 is not None and q.dtype == np.dtype(C.BF16):
            return PD.astype(C.BF16)
        return PD.astype(q.dtype)
    return PD


def attention_forward_v1(q, k, v, n_heads, mask=None, dropout_p=0.0, rng=None, train=True):
    return _forward(1, q, k, v, n_heads, mask, dropout_p, rng, train)


def attention_backward_v1(dout, cache):
    return _backward(1, dout, cache)


def attention_forward_v2(q, k, v, n_heads, mask=None, dropout_p=0.0, rng=None, train=True):
    return _forward(2, q, k, v, n_heads, mask, dropout_p, rng, train)


def attention_backward_v2(dout, cache):
    return _backward(2, dout, cache)


def attention_forward_v3(q, k, v, n_heads, mask=None, dropout_p=0.0, rng=None, train=True):
    return _forward(3, q, k, v, n_heads, mask, dropout_p, rng, train)


def attention_backward_v3(dout, cache):
    return _backward(3, dout, cache)


attention_forward, attention_backward = attention_forward_v3, attention_backward_v3   # the best version


# ----------------------------------------------------------------------------------------------------------------
# spec

VERSIONS = {1: (attention_forward_v1, attention_backward_v1),
            2: (attention_forward_v2, attention_backward_v2),
            3: (attention_forward_v3, attention_backward_v3)}
NOTES = {1: "materialised (B, H, T, T): a thread per score / row / probability / output element",
         2: "flash forward: block per (b, h, query tile), K/V tiles in shared memory, online softmax; v1 backward",
         3: "flash backward: D = rowsum(dout * out), dk/dv per key tile, dq per query tile (two kernels, no atomics)",
         # simulator: T = 1, 5, 17 (tails of the 4-row tiles), one real token (make_inputs' last sequence),
         # dropout 0.2 in training, -inf and finfo.min padding, a full causal mask, hs 4..8
         "gpu_shapes": [dict(B=2, T=37, H=3, hs=64, mask="hf", p=0.2), dict(B=1, T=130, H=2, hs=32, mask="full"),
                        dict(B=2, T=300, H=4, hs=64, mask="hf", p=0.0, train=False),
                        dict(B=1, T=1, H=1, hs=64, mask="hf")],
         "bench_T": [512, 1024, 2048, 4096]}

def make_inputs(shape, dtype, seed):
    """kernels/attention.py's inputs (dict(B, T, H, hs, mask, p, train)), with the mask moved from kwargs into
    inputs, so that _common.validate_lowp rounds it to fp16 / bf16 with q, k, v (the oracle and the kernels want
    one dtype for all four); the call is the same."""
    inputs, kwargs = _cpu_make_inputs(shape, dtype, seed)
    inputs["mask"] = kwargs.pop("mask")
    return inputs, kwargs


SHAPES = [
    dict(B=1, T=1, H=1, hs=4, mask="none", p=0.0, train=False),
    dict(B=2, T=5, H=2, hs=4, mask="hf", p=0.2),               # the last sequence has one real token
    dict(B=1, T=17, H=2, hs=8, mask="ninf", p=0.2),
    dict(B=2, T=17, H=1, hs=5, mask="full", p=0.0, train=False),
]

SPEC = KernelSpec(
    name="attention",
    oracle=(ops.attention_forward, ops.attention_backward),
    versions=VERSIONS,
    make_inputs=make_inputs,
    wrt=("q", "k", "v"),
    shapes=SHAPES,
    bench_shape=dict(B=4, T=512, H=12, hs=64, mask="hf", p=0.0, train=True),
    # reasons: module docstring ("Tolerances")
    tol={np.float64: (1e-12, 1e-10), np.float32: (2e-5, 1e-4), np.float16: C.lowp_tol(np.float16, 8),
         **({np.dtype(C.BF16).type: C.lowp_tol(C.BF16, 8)} if C.BF16 is not None else {})},
    nbytes=_nbytes,
    flops=_flops,
    notes=NOTES,
)

SPECS = [SPEC]

if __name__ == "__main__":
    C.check_specs(SPECS, "sim" if C.SIM else "gpu")
