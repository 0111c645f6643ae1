"""The "cuda" backend: refbert.ops' op names, signatures and semantics with every array on a GPU
(refbert.model.get_backend("cuda"); `BertForPreTraining(cfg, backend="cuda")`).

Where the arrays live
    parameters    CuPy arrays on the current device: the model moves them there once, when it is built or loaded
                  (refbert.model calls `to_device` on each), and writes them back through `to_host` when it saves.
    activations   CuPy arrays; every op allocates its outputs with the array module of its inputs, so a forward
                  and a backward never leave the device.
    inputs        input_ids, token types, positions, the attention mask, labels, the MLM rows: the model builds
                  them as NumPy arrays (it validates them on the host, as the numpy backend does) and each op moves
                  what it reads to the device at entry (`_dev`): one small host-to-device copy per op and call.
    outputs       stay on the device, as torch's do: logits, hidden states, the loss (a 0-d CuPy array) and every
                  gradient are CuPy arrays. Back to NumPy: `refbert.model.to_numpy(x)` (any nesting of dicts,
                  tuples and model outputs), `x.get()`, or `cupy.asnumpy(x)`.
    zero copies   a CuPy array exports DLPack (`__dlpack__`) and the CUDA array interface
                  (`__cuda_array_interface__`): `torch.from_dlpack(out.logits)` is a torch CUDA tensor on the same
                  memory, `cupy.from_dlpack(tensor)` the way back, and `numba.cuda.as_cuda_array(a)` a Numba
                  device array on the same memory (to_torch / from_torch / to_numba below).

What runs where
    matmuls       cuBLAS through cupy.matmul (linear forward and backward, the tied MLM decoder); fp32 stays fp32
                  (CuPy uses TF32 only when CUPY_TF32=1 is set, which this backend never does).
    fused ops     the Numba CUDA kernels of refbert_kernels.cuda (each module's best version, see KERNELS):
                  softmax, layernorm / residual / dropout + residual layernorm, dropout, gelu / bias + gelu,
                  attention (flash forward and backward, Philox dropout regenerated in the backward),
                  cross_entropy.
    small ops     embedding lookups (a gather; the backward a scatter-add, cupyx.scatter_add: atomics, so the
                  order of additions into a repeated id's row is not fixed), the pooler's tanh, add, gather_rows,
                  mse and bce_with_logits: a few CuPy element-wise calls each, written here (the oracle's checks
                  and messages, on any array module).
    fallbacks     a kernel module that is missing or fails to import leaves its ops undefined here (FALLBACKS
                  names each and why), and get_backend("cuda") fills them in as it does for any module
                  (refbert.backends.Backend): the oracle, run on host copies of its inputs, its outputs moved back
                  to the device — slow, but the model still runs and stays correct.

Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, set before numba is first imported): the array module is NumPy,
the kernels run simulated on the CPU (one Python thread per GPU thread: tiny shapes only) and the matmuls are
NumPy's. This is how tests/test_cuda_backend_sim.py tests the whole model in CI without a GPU.

Importing this module without a GPU + CuPy and without the simulator raises ImportError with the reason
(refbert.model.get_backend turns it into a ValueError).
"""
import importlib

import numpy as np

from refbert import validate as V


# ----------------------------------------------------------------------------------------------------------------
# the device: a GPU through CuPy, or Numba's simulator on NumPy

def _device():
    """("sim", numpy) under NUMBA_ENABLE_CUDASIM=1, ("gpu", cupy) with a visible GPU; ImportError otherwise."""
    try:
        from numba.core import config
    except ImportError as e:                              # pragma: no cover
        raise ImportError(f"the cuda backend needs numba and numba-cuda (pip install 'refbert[cuda]'): {e}") from None
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
ARRAY_LIBRARY = "numpy" if SIM else "cupy"   # the library of the model's arrays (to_device keeps them there)


def device_name():
    """A readable name of the device the backend runs on."""
    if SIM:
        return "Numba CUDA simulator (CPU)"
    props = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


# ----------------------------------------------------------------------------------------------------------------
# moving arrays: to the device at op entry, back on request

def _on_device(a):
    return isinstance(a, xp.ndarray)


def _dev(a):
    """An array on the device: NumPy arrays (read-only broadcast views too) copied there; device arrays, scalars
    (a backward's dloss) and None as they are."""
    if not isinstance(a, np.ndarray) or _on_device(a):
        return a
    return xp.asarray(np.ascontiguousarray(a))         # (a broadcast view, e.g. position_ids, made whole first)


def to_device(a, dtype=None):
    """A host array as a contiguous device array (the model's parameters on build and load); a device array as is."""
    a = a if _on_device(a) else _dev(np.asarray(a))
    if dtype is not None and a.dtype != np.dtype(dtype):
        a = a.astype(dtype)
    return xp.ascontiguousarray(a)


def to_host(a):
    """A NumPy copy of a device array (NumPy arrays and scalars as they are)."""
    if a is None or isinstance(a, (np.ndarray, np.generic, int, float, bool)):
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
    return np.dtype(dtype).type(to_host(d))


def _ids(op, name, x, upper, allow=None):
    V.ids(op, name, to_host(x) if _on_device(x) and xp is not np else x, upper, allow)


# ----------------------------------------------------------------------------------------------------------------
# the ops written here: matmuls (cuBLAS), lookups, small element-wise ops

def linear_forward(x, w, b=None):
    """out = x @ w.T + b (refbert.ops.linear_forward): one cuBLAS GEMM over all leading positions."""
    _floats("linear", x=x, w=w, b=b)
    V.min_ndim("linear", "x", x, 1, "(..., C_in)")
    V.shape("linear", "w", _stub(w), (None, x.shape[-1]), "(C_out, C_in)")
    if b is not None:
        V.shape("linear", "b", _stub(b), (w.shape[0],), "(C_out,)")
    out = xp.matmul(x.reshape(-1, x.shape[-1]), w.T)
    if b is not None:
        out += b
    return out.reshape(*x.shape[:-1], w.shape[0]), (x, w, b is not None)


def linear_backward(dout, cache):
    """dx = dout @ w, dw = dout2.T @ x2, db = dout2.sum(0): two GEMMs and a reduction. (Unlike the oracle no rows
    of zeros are skipped: finding them would cost a device-to-host sync; the sums are the same.)"""
    x, w, has_b = cache
    dout = _dev(dout)
    _dout("linear", dout, (*x.shape[:-1], w.shape[0]), x.dtype)
    dout2 = dout.reshape(-1, w.shape[0])
    x2 = x.reshape(-1, x.shape[-1])
    dx = xp.matmul(dout2, w).reshape(x.shape)
    dw = xp.matmul(dout2.T, x2)
    if not has_b:
        return dx, dw
    return dx, dw, dout2.sum(0)


def embedding_forward(ids, w, padding_idx=None):
    """out = w[ids] (refbert.ops.embedding_forward); ids (host or device) moved to the device."""
    _floats("embedding", w=w)
    V.shape("embedding", "w", _stub(w), (None, None), "(V, C)")
    _ids("embedding", "ids", ids, w.shape[0])
    if padding_idx is not None and not 0 <= padding_idx < w.shape[0]:
        raise ValueError(f"embedding: argument 'padding_idx' expected a row in [0, {w.shape[0]}), got {padding_idx}")
    ids_d = _dev(ids)
    return w[ids_d], (ids_d, w.shape, w.dtype, padding_idx)


def _scatter_add(dst, index, src):
    """dst[index[n]] += src[n] for every n, repeated indices summed (np.add.at / cupyx.scatter_add)."""
    if xp is np:
        np.add.at(dst, index, src)
    else:
        import cupyx
        cupyx.scatter_add(dst, index, src)


def embedding_backward(dout, cache):
    ids, w_shape, dtype, padding_idx = cache
    dout = _dev(dout)
    _dout("embedding", dout, (*ids.shape, w_shape[1]), dtype)
    dw = xp.zeros(w_shape, dtype)
    _scatter_add(dw, ids.reshape(-1), dout.reshape(-1, w_shape[1]))
    if padding_idx is not None:
        dw[padding_idx] = 0
    return dw


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
    return xp.asarray((diff * diff).mean(), dtype=pred.dtype), (diff,)


def mse_backward(dloss, cache):
    (diff,) = cache
    dloss = _scalar_dout("mse", dloss, diff.dtype)
    dpred = diff * (2 * dloss / max(diff.size, 1))
    return dpred, -dpred


def bce_with_logits_forward(logits, targets):
    targets = _dev(targets)
    _floats("bce_with_logits", logits=logits, targets=targets)
    V.shape("bce_with_logits", "targets", _stub(targets), logits.shape, "(same as logits)")
    if targets.size and not bool(((targets >= 0) & (targets <= 1)).all()):
        raise ValueError(f"bce_with_logits: argument 'targets' expected values in [0, 1], got values in "
                         f"[{float(targets.min())}, {float(targets.max())}]")
    e = xp.exp(-xp.abs(logits))
    loss = (xp.maximum(logits, 0) - logits * targets + xp.log1p(e)).mean() if logits.size else 0.0
    s = xp.where(logits >= 0, 1 / (1 + e), e / (1 + e))
    return xp.asarray(loss, dtype=logits.dtype), (s, targets)


def bce_with_logits_backward(dloss, cache):
    s, targets = cache
    dloss = _scalar_dout("bce_with_logits", dloss, s.dtype)
    return (s - targets) * (dloss / max(s.size, 1))


# ----------------------------------------------------------------------------------------------------------------
# the fused ops: refbert_kernels.cuda's kernels, or the oracle on host copies where a kernel module is missing

# op -> (kernel module, the public names it must provide)
_FUSED = {
    "softmax": ("softmax", ("softmax_forward", "softmax_backward")),
    "layernorm": ("layernorm", ("layernorm_forward", "layernorm_backward")),
    "residual_layernorm": ("layernorm", ("residual_layernorm_forward", "residual_layernorm_backward")),
    "dropout_residual_layernorm": ("layernorm", ("dropout_residual_layernorm_forward",
                                                 "dropout_residual_layernorm_backward")),
    "dropout": ("dropout", ("dropout_forward", "dropout_backward")),
    "gelu": ("gelu", ("gelu_forward", "gelu_backward")),
    "bias_gelu": ("gelu", ("bias_gelu_forward", "bias_gelu_backward")),
    "attention": ("attention", ("attention_forward", "attention_backward", "attention_probs")),
    "cross_entropy": ("cross_entropy", ("cross_entropy_forward", "cross_entropy_backward")),
}

KERNELS = {}        # op -> "refbert_kernels.cuda.<module>": ops whose Numba CUDA kernel runs
FALLBACKS = {}      # op -> why it has no kernel here (refbert.backends runs the oracle on host copies instead)

# forwards whose additive mask comes from the model as a host array: (keyword, position) moved to the device
_MOVE = {"softmax_forward": ("mask", 2), "attention_forward": ("mask", 4)}


def _entry(name, fn):
    """The exported op: what the model hands over from the host moved to the device at entry (a backward's dout,
    a forward's mask, by keyword or position)."""
    if name.endswith("_backward"):
        def backward(dout, cache):
            return fn(_dev(dout), cache)
        backward.__name__, backward.__doc__ = name, fn.__doc__
        return backward
    if name not in _MOVE or xp is np:
        return fn
    key, pos = _MOVE[name]

    def forward(*args, **kw):
        if kw.get(key) is not None:
            kw[key] = _dev(kw[key])
        elif len(args) > pos and args[pos] is not None:
            args = (*args[:pos], _dev(args[pos]), *args[pos + 1:])
        return fn(*args, **kw)
    forward.__name__, forward.__doc__ = name, fn.__doc__
    return forward


def _load():
    modules = {}
    for op, (mod, names) in _FUSED.items():
        if mod not in modules:
            try:
                modules[mod] = importlib.import_module(f"refbert_kernels.cuda.{mod}")
            except Exception as e:                        # missing, half-written, or failing to compile
                modules[mod] = e
        m = modules[mod]
        missing = [] if isinstance(m, Exception) else [n for n in names if not hasattr(m, n)]
        if isinstance(m, Exception) or missing:
            FALLBACKS[op] = (f"refbert_kernels.cuda.{mod}: {type(m).__name__}: {m}" if isinstance(m, Exception)
                             else f"refbert_kernels.cuda.{mod} has no {', '.join(missing)}")
            continue                                      # left undefined: the Backend runs the oracle on the host
        KERNELS[op] = f"refbert_kernels.cuda.{mod}"
        for n in names:
            globals()[n] = _entry(n, getattr(m, n))


_load()


def specs():
    """Every KernelSpec of every refbert_kernels.cuda module this backend runs (each op's numbered versions)."""
    out = []
    for mod in dict.fromkeys(v.rsplit(".", 1)[1] for v in KERNELS.values()):
        m = importlib.import_module(f"refbert_kernels.cuda.{mod}")
        out += list(getattr(m, "SPECS", []))
    return out


def describe():
    """One paragraph: the device, which ops run as kernels, which fall back to the oracle and why."""
    lines = [f"cuda backend on {device_name()} (array module: {xp.__name__})",
             "  kernels:   " + ", ".join(f"{op} ({mod.rsplit('.', 1)[1]})" for op, mod in KERNELS.items()),
             "  cuBLAS:    linear (and the tied MLM decoder)" if not SIM else "  matmuls:   NumPy (simulator)",
             "  array ops: embedding, gather_rows, tanh, add, mse, bce_with_logits"]
    for op, why in FALLBACKS.items():
        lines.append(f"  fallback:  {op}: oracle on the host ({why})")
    return "\n".join(lines)
