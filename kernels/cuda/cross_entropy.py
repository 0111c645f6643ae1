"""Oracle: refbert.ops.cross_entropy_forward / refbert.ops.cross_entropy_backward — mean softmax cross-entropy over
the rows whose label is not ignore_index (torch's F.cross_entropy), fused in Numba CUDA over the labelled rows only.

    logits: (..., V) seen as (N, V)   labels: (...) integers in [0, V) or ignore_index
    kept = the n rows with a label (found on the host: the labels are N integers, and the oracle's checks of
    them need the host anyway); the kernels run over kept rows only (MLM: ~15% of N)
    forward, per kept row k:  m = max(z);  s = log(sum(exp(z - m)));  term = s - (z[label] - m)   (= lse - z[label],
                              no cancellation of lse against a 1e4 logit)
                              loss = (sum of terms, added in row order by a second kernel) / n
    backward, per kept row:   dz = (exp(z - m - s) - onehot(label)) * dloss / n, written in one pass;
                              ignored rows are zeros (the output is allocated zeroed)
The cache keeps the logits, the kept rows and labels, and (m, s) per kept row (the logsumexp), in the accumulation
dtype; every label ignored gives loss 0 and dz 0 (as the oracle). A NaN / +inf / all -inf kept row raises the
oracle's ValueError after the forward (its m is checked on the host).

Versions (`python -m refbert_kernels.cuda.cross_entropy` validates every version):
    1  a thread per kept row: max, sum, term passes; backward a thread per kept row
    2  a block per kept row: threads stride over V, shared-memory tree max and sum; backward a block per row

Precisions: f64 / f32 in their dtype; f16 / bf16 logits read into float32, (m, s) and the loss sum in float32; the
loss is returned as a 0-d array of the logits' dtype on their device, dz in the logits' dtype.
Tolerance: f64 atol 1e-12, rtol 1e-10; f32 atol 1e-6, rtol 1e-5 (as kernels/cross_entropy.py: exp and log within
2 ulp, sums in another order); f16 / bf16: 4 ulp of storage (_common.lowp_tol).
"""
import functools
import math

import numpy as np
from numba import cuda

from refbert import ops
from refbert import validate as V

from refbert_kernels._harness import KernelSpec
from refbert_kernels.cross_entropy import _make

from . import _common as C
from ._common import BLOCK, acc_np, ldst


@functools.lru_cache(maxsize=None)
def _kernels(kind, version):
    ld, st = ldst(kind)
    A = acc_np(kind)
    zero, one, ninf, nan = A(0), A(1), A(-np.inf), A(np.nan)
    acc = C.acc_nb(kind)

    if version == 1:
        @C.jit_kernel
        def forward(z, kept, yk, m_out, s_out, term):
            k = cuda.grid(1)
            if k >= kept.shape[0]:
                return
            r, V_ = kept[k], z.shape[1]
            m = ninf
            bad = False
            for j in range(V_):
                v = ld(z[r, j])
                if v != v:
                    bad = True
                elif v > m:
                    m = v
            if bad:
                m = nan
            s = zero
            for j in range(V_):
                s += math.exp(ld(z[r, j]) - m)
            s = math.log(s)
            m_out[k] = m
            s_out[k] = s
            term[k, 0] = s - (ld(z[r, yk[k]]) - m)

        @C.jit_kernel
        def backward(z, kept, yk, m_in, s_in, g, dz):
            k = cuda.grid(1)
            if k >= kept.shape[0]:
                return
            r = kept[k]
            mk, sk = m_in[k], s_in[k]
            gg = A(g)
            for j in range(z.shape[1]):
                p = math.exp((ld(z[r, j]) - mk) - sk)       # z - m first: m + s would round away s's bits near 1e4
                dz[r, j] = st((p - (one if j == yk[k] else zero)) * gg)
        return forward, backward

    @C.jit_kernel
    def forward(z, kept, yk, m_out, s_out, term):
        buf = cuda.shared.array(BLOCK, acc)
        k = cuda.blockIdx.x                          # a block per kept row
        t = cuda.threadIdx.x
        r, V_ = kept[k], z.shape[1]
        m = ninf
        bad = 0
        for j in range(t, V_, BLOCK):
            v = ld(z[r, j])
            if v != v:
                bad = 1
            elif v > m:
                m = v
        bad = cuda.syncthreads_or(bad)
        m = C.block_max(m, buf)
        if bad:
            m = nan
        s = zero
        for j in range(t, V_, BLOCK):
            s += math.exp(ld(z[r, j]) - m)
        s = math.log(C.block_sum(s, buf))
        if t == 0:
            m_out[k] = m
            s_out[k] = s
            term[k, 0] = s - (ld(z[r, yk[k]]) - m)

    @C.jit_kernel
    def backward(z, kept, yk, m_in, s_in, g, dz):
        k = cuda.blockIdx.x
        r = kept[k]
        mk, sk = m_in[k], s_in[k]
        gg = A(g)
        for j in range(cuda.threadIdx.x, z.shape[1], BLOCK):
            p = math.exp((ld(z[r, j]) - mk) - sk)
            dz[r, j] = st((p - (one if j == yk[k] else zero)) * gg)
    return forward, backward


def _launch(version, n):
    return (C.grid_for(n, BLOCK), BLOCK) if version == 1 else (n, BLOCK)


def _forward(version, logits, labels, ignore_index):
    C.floats("cross_entropy", logits=logits)
    V.min_ndim("cross_entropy", "logits", logits, 1, "(..., V)")
    if C.is_array(labels) and not isinstance(labels, np.ndarray):
        labels = C.to_host(labels)                   # N integers: the checks and the kept rows run on the host
    if not isinstance(labels, np.ndarray) or labels.shape != logits.shape[:-1]:
        raise ValueError(f"cross_entropy: argument 'labels' expected an integer array of shape {logits.shape[:-1]} "
                         f"(logits.shape[:-1]), got {V._desc(labels)}")
    Vn = logits.shape[-1]
    V.ids("cross_entropy", "labels", labels, Vn, allow=ignore_index)
    xp = C.xp_of(logits)
    kind = C.kind_of(logits.dtype)
    y = labels.reshape(-1)
    kept_h = np.flatnonzero(y != ignore_index)
    n = kept_h.size
    z2 = xp.ascontiguousarray(logits).reshape(-1, Vn)
    m = xp.zeros(n, acc_np(kind))
    s = xp.zeros(n, acc_np(kind))
    kept, yk = C.to_xp(xp, kept_h.astype(np.int64)), C.to_xp(xp, y[kept_h].astype(np.int64))
    loss = 0.0
    if n:
        term = xp.empty((n, 1), acc_np(kind))
        fwd, _ = _kernels(kind, version)
        grid, block = _launch(version, n)
        kd, yd = C.din(kept), C.din(yk)
        fwd[grid, block](C.din(z2), kd, yd, C.dev(m), C.dev(s), C.dev(term))
        if C.checks_on(m) and not np.isfinite(C.to_host(m)).all():     # (device: a sync, REFBERT_CUDA_CHECKS=1)
            raise ValueError("cross_entropy: argument 'logits' expected finite rows, got a NaN, +inf or all -inf row")
        total = xp.empty(1, acc_np(kind))
        acc_kind = "f64" if kind == "f64" else "f32"
        C.column_sum_kernel(acc_kind, acc_kind)[1, 1](C.din(term), C.dev(total))   # row order: deterministic
        if xp is not np:                                 # the loss stays on the device: no read back
            return (total[0] / n).astype(logits.dtype), (version, logits.shape, z2, kept, yk, m, s)
        loss = float(C.to_host(total)[0]) / n
    out = xp.zeros((), logits.dtype) if xp is not np else np.asarray(loss, logits.dtype)   # (n = 0 on a device)
    return out, (version, logits.shape, z2, kept, yk, m, s)


def _backward(dloss, cache):
    version, shape, z2, kept, yk, m, s = cache
    dl = C.scalar_dout("cross_entropy", dloss, z2.dtype)
    xp = C.xp_of(z2)
    dz = xp.zeros(z2.shape, z2.dtype)                # ignored rows stay 0
    n = kept.shape[0]
    if n:
        g = float(np.dtype(z2.dtype).type(dl) / n) if z2.dtype.type in (np.float32, np.float64) else dl / n
        _, bwd = _kernels(C.kind_of(z2.dtype), version)
        grid, block = _launch(version, n)
        bwd[grid, block](C.din(z2), C.din(kept), C.din(yk), C.din(m), C.din(s), g, C.dev(dz))
    return dz.reshape(shape)


def cross_entropy_forward_v1(logits, labels, ignore_index=-100):
    return _forward(1, logits, labels, ignore_index)


def cross_entropy_forward_v2(logits, labels, ignore_index=-100):
    return _forward(2, logits, labels, ignore_index)


cross_entropy_backward_v1 = cross_entropy_backward_v2 = _backward   # the cache names the version
cross_entropy_forward, cross_entropy_backward = cross_entropy_forward_v2, cross_entropy_backward_v2


SPEC = KernelSpec(
    name="cross_entropy", oracle=(ops.cross_entropy_forward, ops.cross_entropy_backward),
    versions={1: (cross_entropy_forward_v1, cross_entropy_backward_v1),
              2: (cross_entropy_forward_v2, cross_entropy_backward_v2)},
    make_inputs=_make, wrt=("logits",),
    shapes=[{"lead": (1,), "V": 1}, {"lead": (5,), "V": 33, "ignored": 0.5, "big": True},
            {"lead": (4,), "V": 13, "ignored": 1.0}],
    bench_shape={"lead": (77,), "V": 30522},
    tol={np.float64: (1e-12, 1e-10), np.float32: (1e-6, 1e-5)},
    nbytes=lambda inp, kw: 3 * inp["logits"].nbytes,     # forward reads z; backward reads z, writes dz
    notes={1: "a thread per kept row", 2: "a block per kept row, shared-memory tree max and sum",
           "gpu_shapes": [{"lead": (1,), "V": 7}, {"lead": (37,), "V": 52, "ignored": 0.5},
                          {"lead": (3, 5), "V": 1031, "ignored": 0.85, "big": True},
                          {"lead": (2, 3), "V": 600, "big": True}, {"lead": (4,), "V": 13, "ignored": 1.0}]})

SPECS = [SPEC]

if __name__ == "__main__":
    C.check_specs(SPECS, "sim" if C.SIM else "gpu")
