"""Oracle: refbert.ops.embedding_forward / embedding_backward — the lookup out = w[ids] and its backward, a
scatter-add of dout into the rows of dw, in Numba CUDA as a sorted segment sum: no atomics, the same bits every run.

    ids: (...) integers in [0, V), N of them   w, dw: (V, C)   dout: (..., C) seen as (N, C)
    dw[v] = sum over positions n with ids[n] = v of dout[n];   dw[padding_idx] = 0
    The positions are sorted by the unique key ids[n] * N + n (sort_ids: any sort gives this one order, ties being
    impossible), so each id's positions are one segment of the sorted order, in increasing position:
        sid[k] = ids[pos[k]],  k = 0 .. N - 1
    and the additions follow the sorted order alone. An atomic scatter-add (cupyx.scatter_add, the old cuda
    backend's) adds a repeated id's rows in whatever order the threads arrive: its last bits change from run to
    run. This is the bitwise-reproducible choice; kernels/cuda/csrc/embedding.cu is its CUDA C version (C1).
The forward is the gather w[ids] of the array module (CuPy's take on a GPU).

Versions (`python -m refbert_kernels.cuda.embedding` validates every version):
    1  a thread per (segment head k, column): it walks its whole segment (the explanation; a segment as long as
       the batch, as token types have, is one thread's loop)
    2  two passes over chunks of CHUNK sorted positions, as csrc/embedding.cu: a thread per (chunk, column) writes
       each run's sum (a segment's stretch inside one chunk) at the run's first k, then a thread per (segment head,
       column) adds its segment's runs (part[k], then part[kb] at every chunk start kb inside the segment) into dw:
       work per thread bounded by CHUNK positions, whatever the id distribution

Precisions: f64 / f32 in their dtype; f16 / bf16 storage with float32 sums, one rounding on the store.
Tolerance: f64 atol 1e-12, rtol 1e-11; f32 atol 3e-5, rtol 1e-5: a segment sums its positions' rows in another
order than np.add.at's (the runs per chunk first), and both orders round: with 2 token types over 1024 positions
(the GPU shapes) a segment adds 512 O(1) terms whose partial sums reach ~sqrt(512) = 23, where an ulp is 2e-6, and
the rounding errors of two orders differ by ~sqrt(512) such ulps (1.6e-5 seen); f16 / bf16: 4 ulp of storage
(_common.lowp_tol) on the simulator's short segments.
"""
import functools

import numpy as np
from numba import cuda

from refbert import ops

from refbert_kernels._harness import KernelSpec

from . import _common as C
from ._common import BLOCK, acc_np, ldst

CHUNK = 4 if C.SIM else 32          # sorted positions per chunk of version 2 (the simulator: segments span chunks)


def sort_ids(xp, ids):
    """(sid, pos) as int64 arrays of module xp: the flat positions of ids sorted by the unique key id * N + position,
    and their ids. Host ids are sorted on the host (and moved in one copy when xp is a device module); device ids
    on the device (cupy.argsort, which may synchronise: refbert_kernels.cuda.backend.stage sorts the model's ids on
    the host before they move, and hands the result to the backward)."""
    flat = ids.reshape(-1)
    N = flat.size
    if not C.on_device(flat):
        key = np.sort(np.asarray(flat, np.int64) * N + np.arange(N, dtype=np.int64))
        both = np.stack([key // N, key % N])
        both = both if xp is np else xp.asarray(both)
        return both[0], both[1]
    key = flat.astype(np.int64) * N + xp.arange(N, dtype=np.int64)
    key = key[xp.argsort(key)]
    return key // N, key % N


@functools.lru_cache(maxsize=None)
def _kernels(kind):
    ld, st = ldst(kind)
    A = acc_np(kind)
    zero = A(0)

    @C.jit_kernel
    def segments_v1(sid, pos, dout, pad, dw):
        i = cuda.grid(1)
        N, Cn = sid.shape[0], dout.shape[1]
        if i >= N * Cn:
            return
        k, c = i // Cn, i % Cn
        v = sid[k]
        if (k > 0 and sid[k - 1] == v) or v == pad:       # not a segment head, or the padding row (stays 0)
            return
        s = zero
        kk = k
        while kk < N and sid[kk] == v:
            s += ld(dout[pos[kk], c])
            kk += 1
        dw[v, c] = st(s)

    @C.jit_kernel
    def runs_v2(sid, pos, dout, part):
        i = cuda.grid(1)
        N, Cn = sid.shape[0], dout.shape[1]
        n_chunks = (N + CHUNK - 1) // CHUNK
        if i >= n_chunks * Cn:
            return
        ch, c = i // Cn, i % Cn
        k0 = ch * CHUNK
        k1 = min(N, k0 + CHUNK)
        head = k0
        acc = zero
        for k in range(k0, k1):
            acc += ld(dout[pos[k], c])
            if k + 1 == k1 or sid[k + 1] != sid[k]:      # the run ends here
                part[head, c] = acc
                acc = zero
                head = k + 1

    @C.jit_kernel
    def segments_v2(sid, part, pad, dw):
        i = cuda.grid(1)
        N, Cn = sid.shape[0], part.shape[1]
        if i >= N * Cn:
            return
        k, c = i // Cn, i % Cn
        v = sid[k]
        if (k > 0 and sid[k - 1] == v) or v == pad:
            return
        s = part[k, c]
        kb = (k // CHUNK + 1) * CHUNK
        while kb < N and sid[kb] == v:
            s += part[kb, c]
            kb += CHUNK
        dw[v, c] = st(s)
    return segments_v1, runs_v2, segments_v2


def _forward(ids, w, padding_idx):
    """The gather of the array module, with the oracle's checks (ids on the host checked for range; on a device
    only with REFBERT_CUDA_CHECKS=1)."""
    from refbert import validate as V
    C.floats("embedding", w=w)
    V.shape("embedding", "w", C.stub(w), (None, None), "(V, C)")
    if C.checks_on(ids):
        V.ids("embedding", "ids", C.to_host(ids), w.shape[0])
    padding_idx = V.padding_row("embedding", padding_idx, w.shape[0])
    return w[ids], (ids, w.shape, w.dtype, padding_idx)


def backward(version, dout, cache, sorted_ids=None):
    """dw of version 1 or 2 for the cache (ids, w_shape, dtype, padding_idx); sorted_ids = (sid, pos) if known."""
    ids, w_shape, dtype, padding_idx = cache
    C.dout("embedding", dout, (*ids.shape, w_shape[1]), dtype)
    xp = C.xp_of(dout)
    dw = xp.zeros(w_shape, dtype)
    N, Cn = ids.size, w_shape[1]
    if N == 0 or Cn == 0:
        return dw
    sid, pos = sorted_ids if sorted_ids is not None else sort_ids(xp, ids)
    kind = C.kind_of(dtype)
    seg1, runs2, seg2 = _kernels(kind)
    d2 = C.din(xp.ascontiguousarray(dout).reshape(N, Cn))
    pad = np.int64(-1 if padding_idx is None else padding_idx)
    sd, pd = C.din(sid), C.din(pos)
    if version == 1:
        seg1[C.grid_for(N * Cn, BLOCK), BLOCK](sd, pd, d2, pad, C.dev(dw))
    else:
        part = xp.empty((N, Cn), acc_np(kind))
        n_chunks = -(-N // CHUNK)
        runs2[C.grid_for(n_chunks * Cn, BLOCK), BLOCK](sd, pd, d2, C.dev(part))
        seg2[C.grid_for(N * Cn, BLOCK), BLOCK](sd, C.din(part), pad, C.dev(dw))
    return dw


def embedding_forward_v1(ids, w, padding_idx=None):
    return _forward(ids, w, padding_idx)


def embedding_backward_v1(dout, cache):
    return backward(1, dout, cache)


def embedding_forward_v2(ids, w, padding_idx=None):
    return _forward(ids, w, padding_idx)


def embedding_backward_v2(dout, cache):
    return backward(2, dout, cache)


embedding_forward, embedding_backward = embedding_forward_v2, embedding_backward_v2


def make_inputs(shape, dtype, seed):
    """shape: dict(N=tuple (the ids' shape), V, C, pad (padding_idx or None))."""
    r = np.random.default_rng(seed)
    ids = r.integers(0, shape["V"], shape["N"])
    w = r.standard_normal((shape["V"], shape["C"])).astype(dtype)
    return dict(ids=ids, w=w), dict(padding_idx=shape.get("pad"))


SPEC = KernelSpec(
    name="embedding",
    oracle=(ops.embedding_forward, ops.embedding_backward),
    versions={1: (embedding_forward_v1, embedding_backward_v1), 2: (embedding_forward_v2, embedding_backward_v2)},
    make_inputs=make_inputs,
    wrt=("w",),
    # one position; segments over several chunks of 4 (2 ids over 18 positions) with a padding row; many ids
    shapes=[dict(N=(1,), V=1, C=3), dict(N=(2, 9), V=2, C=5, pad=1), dict(N=(13,), V=9, C=4, pad=0)],
    bench_shape=dict(N=(32, 128), V=30522, C=768, pad=0),
    tol={np.float64: (1e-12, 1e-11), np.float32: (3e-5, 1e-5)},       # reasons: the module docstring
    nbytes=lambda inp, kw: 2 * inp["ids"].size * inp["w"].shape[1] * inp["w"].itemsize + inp["w"].nbytes,
    notes={1: "a thread per (segment, column) walks its whole segment",
           2: "sorted runs per chunk of 32 positions, then per segment: bounded work, no atomics",
           "gpu_shapes": [dict(N=(8, 128), V=2, C=768), dict(N=(37,), V=30, C=52, pad=0),
                          dict(N=(300,), V=512, C=33), dict(N=(1,), V=1, C=1)]},
)

SPECS = [SPEC]

if __name__ == "__main__":
    C.check_specs(SPECS, "sim" if C.SIM else "gpu")
