"""The "cuda" backend: refbert.ops' op names, signatures and semantics with every array on a GPU
(refbert.model.get_backend("cuda"); `BertForPreTraining(cfg, backend="cuda")`).

Where the arrays live
    parameters    CuPy arrays on the current device: the model moves them there once, when it is built or loaded
                  (refbert.model calls `to_device` on each), and writes them back through `to_host` when it saves.
    activations   CuPy arrays; every op allocates its outputs with the array module of its inputs, so a forward
                  and a backward never leave the device.
    inputs        input_ids, token types, positions and the attention mask are validated on the host by the model
                  (as the numpy backend does), then moved in one copy per forward (`stage`: one pinned buffer,
                  one asynchronous transfer; the ids' sorted order for the embedding backward rides along). Labels
                  and the MLM rows move once each, at the op that reads them. Nothing moves per layer.
    outputs       stay on the device, as torch's do: logits, hidden states, the loss (a 0-d CuPy array, never read
                  back by the step) and every gradient are CuPy arrays. Back to NumPy: `refbert.model.to_numpy(x)`
                  (any nesting of dicts, tuples and model outputs), `x.get()`, or `cupy.asnumpy(x)`.
    no syncs      no op reads a device array back in a forward or backward: the checks that need values (ids and
                  labels in range) run on the host arrays before they move; the ones that would need a read back
                  (a NaN logit, a row of -inf scores) run only with REFBERT_CUDA_CHECKS=1 (without it a NaN gives
                  a NaN loss, as PyTorch's). A copy from pageable host memory would synchronise the stream too,
                  hence the pinned staging buffer.
    zero copies   a CuPy array exports DLPack (`__dlpack__`) and the CUDA array interface
                  (`__cuda_array_interface__`): `torch.from_dlpack(out.logits)` is a torch CUDA tensor on the same
                  memory, `cupy.from_dlpack(tensor)` the way back, and `numba.cuda.as_cuda_array(a)` a Numba
                  device array on the same memory (to_torch / from_torch / to_numba below).

What runs where
    matmuls       cuBLAS (linear forward and backward, the tied MLM decoder): cublasGemmEx called through ctypes on
                  CuPy's handle (blas.py: CuPy's own wrappers refuse to run while a CUDA graph is captured), with
                  CUBLAS_COMPUTE_32F for float32 (no TF32) and 64F for float64; cupy.matmul where that library is
                  not found (blas.usable() says why). The float32 linear forward's bias is added in the GEMM's
                  epilogue (cublasLtMatmul, CUBLASLT_EPILOGUE_BIAS: no add kernel), where blas.lt_usable().
    fused ops     per op and dtype, the fastest version that validated on this device (refbert_kernels.cuda.versions:
                  CUDA C launched by CuPy first, then the Numba CUDA versions; pinned with REFBERT_CUDA_VERSIONS or
                  versions.pin, ordered by the bench's measurements with REFBERT_CUDA_ORDER): softmax, layernorm /
                  residual / dropout + residual layernorm, dropout, gelu / bias + gelu, attention (flash forward
                  and backward, Philox dropout regenerated in the backward), cross_entropy.
    bias grads    linear_backward's db by the column_sum versions (a deterministic two-pass column-sum kernel, a
                  product with a ones vector, or the array module's sum), never a generic reduction per call.
    embeddings    the lookup is a gather; its backward the embedding versions: a sorted segment sum (C1, and the
                  Numba 2 and 1: the same bits every run) before the atomic scatter-add (cupyx.scatter_add, whose
                  order of additions into a repeated id's row is not fixed). The bitwise-reproducible choice is
                  the default: every kernel here adds in a fixed order (no float atomics), and cuBLAS gives the
                  same bits for the same shapes on the same GPU and library (NVIDIA's cuBLAS documentation).
    small ops     the pooler's tanh, add, gather_rows, mse and bce_with_logits: a few CuPy element-wise calls each,
                  written here (the oracle's checks and messages, on any array module).
    fallbacks     nothing slows down in silence: a version that fails validation at first use is demoted and
                  reported (a RuntimeWarning; describe(); a failing row of `refbert check --device cuda` and of the
                  bench), a CUDA C launcher that hands a call to its Numba version likewise, and a kernel module
                  that fails to import leaves its ops undefined here (FALLBACKS, warned when the backend is built):
                  get_backend("cuda") then runs the oracle on host copies (refbert.backends.Backend) — slow, but
                  the model still runs and stays correct.

Three ways to run (MODE): "gpu" (CuPy, a CUDA GPU); "sim" (NUMBA_ENABLE_CUDASIM=1: the array module is NumPy, the
Numba kernels run simulated on the CPU, one Python thread per GPU thread: tiny shapes only; CUDA C versions do not
run); "emu" (REFBERT_CUDA_EMULATE=1 with the simulator: the array module is refbert_kernels.cuda.emulate's CuPy
stand-in, the CUDA C kernels run on CPU threads and every transfer is counted). tests/test_cuda_backend_sim.py
and tests/test_cuda_emu.py test the whole model in CI without a GPU that way.

Importing this module without a GPU + CuPy and without the simulator raises ImportError with the reason
(refbert.model.get_backend turns it into a ValueError).
"""
import os
import warnings
from typing import Any, NamedTuple

import numpy as np

from refbert import validate as V

from . import _common as C
from . import blas, versions


# ----------------------------------------------------------------------------------------------------------------
# the device: a GPU through CuPy, or Numba's simulator on NumPy

def _device():
    """("emu", emulated cupy) under REFBERT_CUDA_EMULATE=1 (with the simulator), ("sim", numpy) under
    NUMBA_ENABLE_CUDASIM=1, ("gpu", cupy) with a visible GPU; ImportError otherwise."""
    try:
        from numba.core import config
    except ImportError as e:                              # pragma: no cover
        raise ImportError(f"the cuda backend needs numba and numba-cuda (pip install 'refbert[cuda]'): {e}") from None
    if os.environ.get("REFBERT_CUDA_EMULATE", "0") not in ("", "0"):
        if not config.ENABLE_CUDASIM:
            raise ImportError("REFBERT_CUDA_EMULATE=1 needs NUMBA_ENABLE_CUDASIM=1 too (the Numba kernels run "
                              "in the simulator beside the emulated CUDA C ones)")
        from .emulate import cupy
        return "emu", cupy
    if config.ENABLE_CUDASIM:
        return "sim", np
    try:
        import cupy
    except ImportError as e:
        raise ImportError(f"the cuda backend needs CuPy and a CUDA GPU (pip install 'refbert[cuda]'; or set "
                          f"NUMBA_ENABLE_CUDASIM=1 before importing numba for the CPU simulator): {e}") from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:                                # CUDARuntimeError: no driver, no device
        raise ImportError(f"the cuda backend found no CUDA GPU through CuPy ({type(e).__name__}: {e}); set "
                          f"NUMBA_ENABLE_CUDASIM=1 before importing numba for the CPU simulator") from None
    if n < 1:
        raise ImportError("the cuda backend found no CUDA GPU (cupy.cuda.runtime.getDeviceCount() == 0)")
    return "gpu", cupy


MODE, xp = _device()
SIM = MODE == "sim"
EMU = MODE == "emu"
ARRAY_LIBRARY = "cupy" if MODE == "gpu" else "numpy"   # the library of the model's arrays (the emulator's device
#                                                        arrays are NumPy arrays to refbert.backends)
versions.configure(MODE, xp)


def device_name():
    """A readable name of the device the backend runs on."""
    return versions.device_name()


# ----------------------------------------------------------------------------------------------------------------
# moving arrays: to the device at op entry, back on request

def _on_device(a):
    return isinstance(a, xp.ndarray) and (xp is np or C.on_device(a))


_PINNED = []        # (event, pinned memory) of copies in flight: kept alive until the device has read them
CAPTURE = None      # a list while kernels/cuda/graph.py captures a step: each host-to-device copy of the step
#                     becomes a slot (device array, the host array it was given), filled before each replay
WARMUP = None       # a list while graph.py warms a capture up: the device array of each host-to-device copy
HELD = None         # a list during that capture: the warm-up's arrays not yet handed out, in the order they came
REPLAY = None       # a list while the emulator replays a step (graph.py, emulate): ((slot, rule), host array) each


def _held_slot(a):
    """The capture's slot for host array `a`: the device array the warm-up's copy at the same place made. Why not
    a new array: a replay fills the slots BEFORE the graph runs, but a copy made inside the capture would take its
    memory from the graph's pool at that point of the step, possibly a block the step used earlier for something
    else and freed (stream order makes that safe for a real copy, which runs after; not for a slot filled first).
    The warm-up's arrays are alive from before the capture to the graph's end: no array of the step shares them."""
    if not HELD:
        raise RuntimeError(f"StepGraph: the captured step copies more arrays to the device than its warm-up did "
                           f"(one more of shape {a.shape}, {a.dtype}): the step is not the same step twice")
    out = HELD.pop(0)
    if out.shape != a.shape or out.dtype != a.dtype:
        raise RuntimeError(f"StepGraph: the captured step copies an array of shape {a.shape} and dtype {a.dtype} to "
                           f"the device where its warm-up copied {out.shape} {out.dtype}")
    if os.environ.get("REFBERT_GRAPH_SLOTS_IN_CAPTURE", "0") not in ("", "0"):
        return xp.empty(a.shape, a.dtype)              # a diagnostic (graph_diag.py): the slot made as it was before
    return out


def _h2d(a, out=None):
    """A contiguous host array on the device (into `out`, a device array of its shape and dtype, when given). On a
    GPU the bytes go through pinned memory with an asynchronous copy: a copy from pageable memory would synchronise
    the stream (CUDA's rule for pageable transfers) and stop the host from queueing ahead. While a step is captured
    (CAPTURE), nothing is copied: the step reads a slot the replay fills (the warm-up's array, _held_slot)."""
    a = np.ascontiguousarray(a)
    if CAPTURE is not None and out is None:
        out = _held_slot(a)
        CAPTURE.append((out, a.copy()))
        if MODE != "gpu":                              # the emulator's capture runs the step: give it the values
            out[...] = xp.asarray(a)
        return out
    if REPLAY is not None and out is None:             # the emulator's replay: the next slot, filled by its rule
        (out, rule), want = REPLAY.pop(0)
        if out.shape != a.shape or out.dtype != a.dtype or not np.array_equal(want, a):
            raise RuntimeError(f"StepGraph: slot rule {rule!r} gave other values than the step copies "
                               f"({want.shape} {want.dtype} vs {a.shape} {a.dtype})")
        return out
    if WARMUP is not None and out is None:             # a future slot: a device array of its own
        out = xp.empty(a.shape, a.dtype)
        WARMUP.append(out)
    if MODE != "gpu" or a.nbytes == 0:
        if out is None:
            return xp.asarray(a)
        out[...] = xp.asarray(a)
        return out
    while _PINNED and _PINNED[0][0].done:
        _PINNED.pop(0)
    mem = xp.cuda.alloc_pinned_memory(a.nbytes)
    host = np.frombuffer(mem, a.dtype, a.size).reshape(a.shape)
    host[...] = a
    out = xp.empty(a.shape, a.dtype) if out is None else out
    stream = xp.cuda.get_current_stream()
    out.set(host, stream=stream)
    ev = xp.cuda.Event()
    ev.record(stream)
    _PINNED.append((ev, mem))
    return out


if MODE != "sim":                                      # the CUDA C launchers move host labels the same way
    from . import cuda_c as _cuda_c
    _cuda_c.H2D = _h2d


def _dev(a):
    """An array on the device: NumPy arrays (read-only broadcast views too) copied there; device arrays, scalars
    (a backward's dloss) and None as they are."""
    if not isinstance(a, np.ndarray) or _on_device(a):
        return a
    return _h2d(a)                                     # (a broadcast view, e.g. position_ids, made whole first)


_SORTED = []        # (device ids, (sid, pos)) of the last stage(): the embedding backward's sorted order


def stage(*arrays):
    """The model's host inputs (ids, token types, positions, the mask; None passes) on the device in ONE copy: packed
    at 256-byte offsets into one buffer, moved once, viewed back with their dtypes and shapes. Integer 2-D arrays
    (ids) also get their positions sorted by id on the host, moved in the same copy, for the embedding backward
    (a sorted segment sum needs the order, and sorting on the device could synchronise)."""
    if xp is np:
        return arrays
    packed = stage_buffer(*arrays)
    if packed is None:
        return arrays
    buf, host, parts, offs = packed
    dev = _h2d(buf)
    views = [dev[o:o + a.nbytes].view(a.dtype).reshape(a.shape) for a, o in zip(parts, offs)]
    out, k, j = [], 0, len(host)
    _SORTED.clear()
    for a in arrays:
        if isinstance(a, np.ndarray) and not _on_device(a):
            d = views[k]
            k += 1
            if a.dtype.kind in "iu" and a.ndim == 2:
                _SORTED.append((d, (views[j][0], views[j][1])))
                j += 1
            out.append(d)
        else:
            out.append(a)
    return tuple(out)


def stage_buffer(*arrays):
    """stage()'s host half: (the packed uint8 buffer, the host arrays, every part packed, their offsets), or None
    when no argument is a host array. Pure: the same inputs give the same bytes (a captured step's replay packs
    each new batch with it)."""
    host, extra = [], []
    for a in arrays:
        if isinstance(a, np.ndarray) and not _on_device(a):
            a = np.ascontiguousarray(a)
            host.append(a)
            if a.dtype.kind in "iu" and a.ndim == 2:
                flat = a.reshape(-1).astype(np.int64)
                key = np.sort(flat * flat.size + np.arange(flat.size, dtype=np.int64))
                extra.append(np.stack([key // flat.size, key % flat.size]))
    if not host:
        return None
    parts = host + extra
    offs, total = [], 0
    for a in parts:
        offs.append(total)
        total += -(-a.nbytes // 256) * 256
    buf = np.zeros(max(total, 1), np.uint8)
    for a, o in zip(parts, offs):
        buf[o:o + a.nbytes] = a.view(np.uint8).reshape(-1)
    return buf, host, parts, offs


def _sorted_of(ids):
    """The (sid, pos) staged with these very ids, or None."""
    for d, sp in _SORTED:
        if d is ids:
            return sp
    return None


def to_device(a, dtype=None):
    """A host array as a contiguous device array (the model's parameters on build and load); a device array as is."""
    a = a if _on_device(a) else _dev(np.asarray(a))
    if dtype is not None and a.dtype != np.dtype(dtype):
        a = a.astype(dtype)
    return xp.ascontiguousarray(a)


def to_host(a):
    """A NumPy copy of a device array (NumPy arrays and scalars as they are; the emulator's device arrays, NumPy
    subclasses, copied as CuPy's are)."""
    if a is None or isinstance(a, (np.generic, int, float, bool)) or (isinstance(a, np.ndarray)
                                                                      and not C.on_device(a)):
        return a
    if hasattr(a, "get"):
        return a.get()
    return np.asarray(a)


def to_torch(a):
    """A torch tensor on the same memory (DLPack; a CUDA tensor for a CuPy array, a CPU tensor for a NumPy one)."""
    import torch
    return torch.from_dlpack(a)


def from_torch(t):
    """A device array on the same memory as torch tensor t (DLPack): CuPy for a CUDA tensor (NumPy in the
    simulator, for a CPU tensor)."""
    return xp.from_dlpack(t)


def to_numba(a):
    """A Numba device array on the same memory (the CUDA array interface); in the simulator, a as it is (Numba's
    simulated kernels take NumPy arrays)."""
    if SIM:
        return a
    from numba import cuda
    return cuda.as_cuda_array(a)


def synchronize():
    """Wait for the device (timings; a no-op in the simulator)."""
    if not SIM:
        xp.cuda.Device().synchronize()


# ----------------------------------------------------------------------------------------------------------------
# the oracle's checks on any array module (refbert.validate wants NumPy arrays: shapes are checked on zero-byte stubs)

def _stub(a):
    if a is None or isinstance(a, np.ndarray):
        return a
    return np.broadcast_to(np.zeros((), a.dtype), a.shape)


def _floats(op, **arrays):
    return V.floats(op, **{k: _stub(v) for k, v in arrays.items()})


def _dout(op, d, shape, dtype):
    V.dout(op, _stub(d), shape, dtype)


def _scalar_dout(op, d, dtype):
    if np.ndim(d) != 0:
        raise ValueError(f"{op}: argument 'dloss' expected a scalar (the loss is a scalar), got shape {np.shape(d)}")
    return np.dtype(dtype).type(V.number(op, "dloss", to_host(d), what="a finite real number (the loss is a scalar)"))


def _ids(op, name, x, upper, allow=None):
    """The oracle's range check of integer inputs: on host arrays always (before they move), on device arrays only
    with REFBERT_CUDA_CHECKS=1 (a read back; the model checks its inputs on the host before staging them)."""
    if not _on_device(x) or xp is np:
        V.ids(op, name, x, upper, allow)
    elif C.STRICT:
        V.ids(op, name, to_host(x), upper, allow)


# ----------------------------------------------------------------------------------------------------------------
# the ops written here: matmuls (cuBLAS), lookups, small element-wise ops

def check_linear(x, w, b):
    """linear's argument checks (the oracle's, on any array module)."""
    _floats("linear", x=x, w=w, b=b)
    V.min_ndim("linear", "x", x, 1, "(..., C_in)")
    V.shape("linear", "w", _stub(w), (None, x.shape[-1]), "(C_out, C_in)")
    if b is not None:
        V.shape("linear", "b", _stub(b), (w.shape[0],), "(C_out,)")


def linear_forward(x, w, b=None):
    """out = x @ w.T + b (refbert.ops.linear_forward): one cuBLAS GEMM over all leading positions, the bias added in
    its epilogue (cublasLt) where blas.lt_usable(), else by an add after it."""
    check_linear(x, w, b)
    x2, w2 = xp.ascontiguousarray(x.reshape(-1, x.shape[-1])), xp.ascontiguousarray(w)
    if b is None:
        out = blas.gemm(x2, w2, False, True)
    else:                                             # cublasLt adds b in the GEMM's epilogue (blas.gemm_bias)
        out = blas.gemm_bias(x2, w2, xp.ascontiguousarray(b))
    return out.reshape(*x.shape[:-1], w.shape[0]), (x, w, b is not None)


def linear_backward(dout, cache, dx_into=None):
    """dx = dout @ w, dw = dout2.T @ x2 (two GEMMs), db = the column sums of dout2 (a column_sum version: one
    deterministic kernel pair, not a generic reduction). (Unlike the oracle no rows of zeros are skipped: finding
    them would cost a device-to-host sync; the sums are the same.) dx_into (refbert.ops.linear_backward): dx is
    summed into it by the GEMM itself (cuBLAS's beta = 1), no add kernel."""
    x, w, has_b = cache
    dout = _dev(dout)
    _dout("linear", dout, (*x.shape[:-1], w.shape[0]), x.dtype)
    dout2 = xp.ascontiguousarray(dout.reshape(-1, w.shape[0]))
    x2 = xp.ascontiguousarray(x.reshape(-1, x.shape[-1]))
    w = xp.ascontiguousarray(w)
    dw = blas.gemm(dout2, x2, True, False)
    db = column_sum(dout2) if has_b else None         # (both before dx_into is written: it may be dout itself)
    if dx_into is not None:
        dx_into = _dev(dx_into)
        V.dout("linear", _stub(dx_into), x.shape, x.dtype, name="dx_into", what="x's, the input")
        acc = dx_into.reshape(-1, x.shape[-1]) if dx_into.flags.c_contiguous else None
        dx = blas.gemm(dout2, w, acc=acc).reshape(x.shape) if acc is not None else dx_into + blas.gemm(dout2, w)
    else:
        dx = blas.gemm(dout2, w).reshape(x.shape)
    return (dx, dw) if not has_b else (dx, dw, db)


linear_backward.dx_into = True


def column_sum(x2):
    """The sums over the rows of a (R, C) array, by the column_sum version chosen for its dtype."""
    v = versions.choose("column_sum", x2.dtype)
    versions.ran("column_sum", x2.dtype, v.key)
    return v.forward(x2)


def embedding_forward(ids, w, padding_idx=None):
    """out = w[ids] (refbert.ops.embedding_forward); ids (host or device) moved to the device. The cache carries
    the ids' sorted order when stage() made it (the embedding versions' backward is a sorted segment sum)."""
    _floats("embedding", w=w)
    V.shape("embedding", "w", _stub(w), (None, None), "(V, C)")
    _ids("embedding", "ids", ids, w.shape[0])
    padding_idx = V.padding_row("embedding", padding_idx, w.shape[0])
    ids_d = _dev(ids)
    v = versions.choose("embedding", w.dtype)
    versions.ran("embedding", w.dtype, v.key)
    return w[ids_d], Chosen(v, (ids_d, w.shape, w.dtype, padding_idx), _sorted_of(ids_d))


def embedding_backward(dout, cache):
    v, inner, sorted_ids = _unwrap("embedding", cache)
    dout = _dev(dout)
    if v.key == "C1":
        from .cuda_c import embedding_backward_c1
        return embedding_backward_c1(dout, inner, sorted_ids)
    if v.key in ("1", "2"):
        from .embedding import backward
        return backward(int(v.key), dout, inner, sorted_ids)
    return v.backward(dout, inner)


def _scatter_add(dst, index, src):
    """dst[index[n]] += src[n] for every n, repeated indices summed (np.add.at / cupyx.scatter_add)."""
    if xp is np:
        np.add.at(dst, index, src)
    elif EMU:
        xp.cupyx.scatter_add(dst, index, src)
    else:
        import cupyx
        cupyx.scatter_add(dst, index, src)


def gather_rows_forward(x, rows):
    """out = x2[rows] (refbert.ops.gather_rows_forward); rows (host or device) moved to the device."""
    _floats("gather_rows", x=x)
    V.min_ndim("gather_rows", "x", x, 1, "(..., C)")
    N = int(np.prod(x.shape[:-1]))
    _ids("gather_rows", "rows", rows, N)
    if rows.ndim != 1:
        raise ValueError(f"gather_rows: argument 'rows' expected a 1-d integer array, got shape {rows.shape}")
    rows_d = _dev(rows)
    return x.reshape(N, x.shape[-1])[rows_d], (x.shape, x.dtype, rows_d)


def gather_rows_backward(dout, cache):
    """dx2[rows] = dout: rows are distinct (the labelled positions), so the scatter has no collisions and no
    order to fix."""
    shape, dtype, rows = cache
    dout = _dev(dout)
    _dout("gather_rows", dout, (rows.size, shape[-1]), dtype)
    dx = xp.zeros((int(np.prod(shape[:-1])), shape[-1]), dtype)
    _scatter_add(dx, rows, dout)
    return dx.reshape(shape)


def tanh_forward(x):
    _floats("tanh", x=x)
    out = xp.tanh(x)
    return out, (out,)


def tanh_backward(dout, cache):
    (out,) = cache
    dout = _dev(dout)
    _dout("tanh", dout, out.shape, out.dtype)
    return dout * (1 - out * out)


def add_forward(a, b):
    _floats("add", a=a, b=b)
    V.shape("add", "b", _stub(b), a.shape, "(same as a)")
    return a + b, (a.shape, a.dtype)


def add_backward(dout, cache):
    shape, dtype = cache
    dout = _dev(dout)
    _dout("add", dout, shape, dtype)
    return dout.copy(), dout.copy()


def mse_forward(pred, target):
    target = _dev(target)
    _floats("mse", pred=pred, target=target)
    V.shape("mse", "target", _stub(target), pred.shape, "(same as pred)")
    diff = pred - target
    return xp.asarray((diff * diff).mean() if diff.size else 0.0, dtype=pred.dtype), (diff,)


def mse_backward(dloss, cache):
    (diff,) = cache
    dloss = _scalar_dout("mse", dloss, diff.dtype)
    dpred = diff * (2 * dloss / max(diff.size, 1))
    return dpred, -dpred


def bce_with_logits_forward(logits, targets):
    if isinstance(targets, np.ndarray) and not _on_device(targets) and targets.size and \
            not ((targets >= 0) & (targets <= 1)).all():          # the range check on the host, before the move
        raise ValueError(f"bce_with_logits: argument 'targets' expected values in [0, 1], got values in "
                         f"[{float(targets.min())}, {float(targets.max())}]")
    targets = _dev(targets)
    _floats("bce_with_logits", logits=logits, targets=targets)
    V.shape("bce_with_logits", "targets", _stub(targets), logits.shape, "(same as logits)")
    if C.STRICT and targets.size and not bool(((targets >= 0) & (targets <= 1)).all()):
        raise ValueError(f"bce_with_logits: argument 'targets' expected values in [0, 1], got values in "
                         f"[{float(targets.min())}, {float(targets.max())}]")
    if C.STRICT and not bool(xp.isfinite(logits).all()):     # (a read back: with REFBERT_CUDA_CHECKS=1 only)
        raise ValueError("bce_with_logits: argument 'logits' expected finite values, got a NaN or an infinity")
    e = xp.exp(-xp.abs(logits))
    loss = (xp.maximum(logits, 0) - logits * targets + xp.log1p(e)).mean() if logits.size else 0.0
    s = xp.where(logits >= 0, 1 / (1 + e), e / (1 + e))
    return xp.asarray(loss, dtype=logits.dtype), (s, targets)


def bce_with_logits_backward(dloss, cache):
    s, targets = cache
    dloss = _scalar_dout("bce_with_logits", dloss, s.dtype)
    return (s - targets) * (dloss / max(s.size, 1))


# ----------------------------------------------------------------------------------------------------------------
# the fused ops: the version refbert_kernels.cuda.versions chose for (op, dtype), or the oracle on host copies
# where no kernel module imports

class Chosen(NamedTuple):
    """A fused op's cache here: the Version that ran the forward (its backward reads the rest), the version's own
    cache, and anything the backend adds (the embedding's sorted ids)."""
    version: Any
    cache: Any
    extra: Any = None


def _unwrap(op, cache):
    if not isinstance(cache, Chosen):
        raise ValueError(f"{op}: argument 'cache' expected the cache of the cuda backend's {op}_forward, got "
                         f"{type(cache).__name__}")
    return cache


# op -> (the argument that fixes the dtype, its position)
_FUSED = {"softmax": ("x", 0), "layernorm": ("x", 0), "residual_layernorm": ("x", 0),
          "dropout_residual_layernorm": ("x", 0), "dropout": ("x", 0), "gelu": ("x", 0), "bias_gelu": ("x", 0),
          "attention": ("q", 0), "cross_entropy": ("logits", 0)}
# forwards whose additive mask may come from the host: (keyword, position) moved to the device
_MOVE = {"softmax": ("mask", 2), "attention": ("mask", 4)}

KERNELS = {}        # op -> the versions it has here (refbert_kernels.cuda.versions)
FALLBACKS = {}      # op -> why it has no kernel here (refbert.backends runs the oracle on host copies instead)


def _forward(op):
    key, pos = _FUSED[op]
    move = _MOVE.get(op)

    def forward(*args, **kw):
        x = kw[key] if key in kw else args[pos]
        if move is not None and xp is not np:
            mk, mp = move
            if kw.get(mk) is not None:
                kw[mk] = _dev(kw[mk])
            elif len(args) > mp and args[mp] is not None:
                args = (*args[:mp], _dev(args[mp]), *args[mp + 1:])
        if not C.is_array(x) or np.dtype(x.dtype).type not in C.STORAGE:
            return versions.versions()[op][-1].forward(*args, **kw)   # the oracle's error, from a Numba version
        v = versions.choose(op, x.dtype, versions.variant(op, args, kw))
        out, cache = v.forward(*args, **kw)
        versions.ran(op, x.dtype, v.key)
        return out, Chosen(v, cache)
    forward.__name__ = f"{op}_forward"
    forward.__doc__ = f"refbert.ops.{op}_forward by the version chosen for the input's dtype (versions.choose)."
    return forward


def _backward(op):
    def backward(dout, cache):
        v, inner, _ = _unwrap(op, cache)
        return v.backward(_dev(dout), inner)
    backward.__name__ = f"{op}_backward"
    return backward


def attention_probs(cache):
    v, inner, _ = _unwrap("attention", cache)
    return v.probs(inner)


def _load():
    vs = versions.versions()
    for op in _FUSED:
        if not vs.get(op):
            why = "; ".join(f"refbert_kernels.cuda.{m}: {e}" for m, e in versions.IMPORT_ERRORS.items()
                            if versions.MODULE.get(op) == m) or "no version"
            FALLBACKS[op] = why
            continue                                      # left undefined: the Backend runs the oracle on the host
        KERNELS[op] = [v.key for v in vs[op]]
        globals()[f"{op}_forward"] = _forward(op)
        globals()[f"{op}_backward"] = _backward(op)
    if "attention" in FALLBACKS:
        del globals()["attention_probs"]
    if FALLBACKS:
        warnings.warn("refbert cuda backend: no kernel for " + "; ".join(f"{op} ({why})" for op, why in
                                                                         FALLBACKS.items())
                      + ": the oracle runs these on host copies (slow)", RuntimeWarning, stacklevel=2)


_load()


def specs():
    """Every KernelSpec of every refbert_kernels.cuda module this backend runs (each op's numbered Numba versions;
    the CUDA C ones are validated on the device by version_rows())."""
    import importlib
    out, seen = [], set()
    for op in KERNELS:
        mod = versions.MODULE[op]
        if mod in seen:
            continue
        seen.add(mod)
        out += list(getattr(importlib.import_module(f"refbert_kernels.cuda.{mod}"), "SPECS", []))
    if "embedding" not in seen and not versions.IMPORT_ERRORS.get("embedding"):
        out += list(importlib.import_module("refbert_kernels.cuda.embedding").SPECS)
    return out


def version_rows(dtypes=("float32",)):
    """[(label, dtype, err/tol, ok, error)]: every CUDA C version validated on this device against the oracle, then
    one failing row per problem (a demotion, a CUDA C call handed to Numba, a module that did not import): the rows
    `refbert check --device cuda` and the bench add to the Numba versions'."""
    import math
    rows = []
    for op, vs in versions.versions().items():
        for v in vs:
            if not v.cuda_c:
                continue
            for dt in dtypes:
                if not versions.takes(v, dt):
                    continue
                worst, err = versions.validate(v, dt)
                rows.append((f"{op} {v.key}", dt, worst, err is None and worst <= 1, err))
    for op, why in versions.problems():
        rows.append((f"{op} FALLBACK", "—", math.inf, False, why))
    return rows


# ----------------------------------------------------------------------------------------------------------------
# mixed precision (refbert.mixed finds these): R on device arrays, linear on tensor cores, the spec's attention,
# the layernorms, GELUs and the cross-entropy's backward with the rounding inside their CUDA C kernels

from .mixed import (round_compute, linear_forward_mixed, linear_backward_mixed,  # noqa: E402,F401
                    attention_forward_mixed, attention_backward_mixed, attention_probs_mixed,
                    layernorm_forward_mixed, layernorm_backward_mixed, residual_layernorm_forward_mixed,
                    residual_layernorm_backward_mixed, dropout_residual_layernorm_forward_mixed,
                    dropout_residual_layernorm_backward_mixed, gelu_forward_mixed, gelu_backward_mixed,
                    bias_gelu_forward_mixed, bias_gelu_backward_mixed, cross_entropy_forward_mixed,
                    cross_entropy_backward_mixed, embedding_forward_mixed, embedding_backward_mixed)


def _launch_line():
    """How the CUDA C kernels are launched (cuda_c.py's launch versions) and every kernel that could not be."""
    from . import cuda_c
    line = ("  launches:  CUDA C kernels with parameters packed once a call, cuLaunchKernel (launch version 2; "
            "REFBERT_LAUNCH=1 pins CuPy's RawKernel call)" if cuda_c.LAUNCH == "2" else
            "  launches:  CUDA C kernels through CuPy's RawKernel call (launch version 1, REFBERT_LAUNCH=1)")
    for name, why in sorted(cuda_c.LAUNCH_FELL_BACK.items()):
        line += f"\n  FALLBACK  launch of {name}: CuPy's RawKernel call ({why})"
    return line


def describe():
    """The device, which version of each op runs (per dtype, once chosen) and why, every fallback."""
    lines = [f"cuda backend on {device_name()} (array module: {xp.__name__}; mode {MODE})",
             "  cuBLAS:    linear (and the tied MLM decoder)" if not SIM else "  matmuls:   NumPy (simulator)",
             *([f"  cublasLt:  linear's bias in the GEMM epilogue (float32)" if blas.lt_usable()[0] else
                f"  cublasLt:  not used, the bias added after the GEMM ({blas.lt_usable()[1]})"] if MODE == "gpu" else []),
             "  array ops: embedding lookup, gather_rows, tanh, add, mse, bce_with_logits",
             *([_launch_line()] if MODE != "sim" else []),
             "  versions (chosen per dtype at the first call; order: pinned, measured, or built in):"]
    lines += versions.describe()
    for op, why in FALLBACKS.items():
        lines.append(f"  FALLBACK  {op}: oracle on the host ({why})")
    return "\n".join(lines)
