"""Which version of each op the cuda backend runs, per op and dtype: the fastest one that validated on this device.

Ops with versions: the fused ops of refbert.ops (softmax, layernorm, residual_layernorm, dropout_residual_layernorm,
dropout, gelu, bias_gelu, attention, cross_entropy) and two of the backend's own: column_sum (the bias gradient of
every linear layer) and embedding (its backward; the forward is a gather). A version is a numbered Numba CUDA
kernel set (1, 2, 3: kernels/cuda/<op>.py), a CUDA C one (C1, C2: the .cu file's version, launched by
kernels/cuda/cuda_c.py), or an array-library one (column_sum "gemv": a product with a ones vector on cuBLAS, "sum":
the array module's reduction; embedding "atomic": cupyx.scatter_add, whose order of additions is not fixed).

The order for (op, dtype), first that applies:
    1. pinned: pin(op, version, dtype=None) or REFBERT_CUDA_VERSIONS="layernorm=2,attention:float16=3" — that
       version runs, not validated at first use (A/B runs, the precision study); describe() marks it "pinned";
    2. measured: REFBERT_CUDA_ORDER=<cuda_order.json> as `refbert bench --device cuda` writes it (each op's validated
       versions per dtype, fastest first, on a named device; used only on a device of that name);
    3. built in (ORDER): CUDA C first where it exists, then the Numba versions from the highest number down.
A CUDA C version takes float32 device arrays (attention float16 too); in the simulator, whose arrays are NumPy's,
it is skipped. At the first call of (op, dtype) the first candidate is validated on this device against the
oracle (the op's KernelSpec: its GPU shapes on a GPU, in that dtype); one that fails, or raises, is demoted: the
next candidate is tried, and the demotion is reported (a RuntimeWarning now, DEMOTED and describe() afterwards,
a failing row in `refbert check --device cuda` and the bench). A CUDA C launcher that hands a call to its Numba
version (a head size it has no kernel for, a misaligned fp16 input) is reported the same way (cuda_c.FELL_BACK).
Validation at first use is on on a GPU (REFBERT_CUDA_VALIDATE=0 turns it off), off in the simulator and the
emulator, whose tests validate every version themselves (REFBERT_CUDA_VALIDATE=1 turns it on).
RAN counts the calls of each (op, dtype, version): the GPU tests assert that what ran is what they meant to run.
"""
import contextlib
import json
import math
import os
import warnings
from typing import Any, NamedTuple

import numpy as np

from . import _common as C

OPS = ("softmax", "layernorm", "residual_layernorm", "dropout_residual_layernorm", "dropout", "gelu", "bias_gelu",
       "attention", "cross_entropy", "column_sum", "embedding")
# the built-in preference per op (CUDA C first, then Numba from the highest number down), as the GPUs timed them
# (benchmarks/results/cuda-nvidia-h200/2026-11-27-2f0feb7/cuda_kernels.md, device ms at the step's shapes):
# attention C2 (float16 alone) before C1 (its backward 2.69 ms at B=8 H=12 T=2048 against C1's 27.2); C5 (C2's
# bits, fragments by ldmatrix) after C2: its forward the faster at T = 2048 (0.431 against 0.576 ms), its backward
# the slower at T = 512 and 2048 (0.292 / 2.92 against 0.27 / 2.69 ms); C6 (C4's bits, the forward's loads
# pipelined) before C4: its forward the faster on the device at every T (0.214 against 0.244 ms at T = 512), the
# backward C4's own kernels (its call as timed was the slower at T = 128, 0.322 against 0.271 ms: the bench's
# measured order now ranks by device time, what a step that keeps the GPU busy pays); layernorm's and dropout +
# residual layernorm's C3 (the row in registers) before C2: the faster forward on the H100 (2026-11-26, as called:
# 0.00882 / 0.0135 against 0.01 / 0.0156 ms) and on the H200 (the device alone: 0.00782 / 0.0104 against 0.00909 /
# 0.0144), the backward the same kernels; the plain residual's C2 stays first: its C3 forward was called in 0.0705
# ms against C2's 0.0251 on the H100, and the H200 had it the faster (0.00952 against 0.0111 device ms))
# The layernorms' C4 (C3's forward, dx and the dw, db partials in one backward pass: layernorm.cu v6) first: on
# the H200 (2026-11-28, benchmarks/results/cuda-nvidia-h200/2026-11-28-d9453d2, device ms at (2048, 768)) its
# backward took 0.0185 / 0.021 / 0.0218 (ln / res / drop) against C3's 0.0238 / 0.0295 / 0.0332 (and PyTorch's
# 0.019 / 0.0192 / 0.0232), its forward C3's; the bench's measured order had picked it for the step already (the
# plain residual's C4 forward, C3's, was called there in 0.0192 ms against C2's 0.0186, 0.00917 against 0.0112 on the
# device; the H100's slow call of C3's forward, above, not checked again: the step runs no plain residual)
# bias_gelu's C2 (gelu.cu v2's backward, C1's bits) after C1 until a GPU times it: written 2026-11-28 from the SASS
# (65 instructions an element in its loop against C1's 82, four independent elements a thread, the next row's loads
# issued during this row's arithmetic) against C1's 0.0426 ms and PyTorch's 0.0356 at (2048, 3072) on the H200; the
# bench's measured order picks it for the step where it is the faster; cross_entropy's C3 (cross_entropy.cu v3: C2's
# three launches in one, C2's bits) after C2 likewise, written against C2's 0.0233 ms and PyTorch's 0.0198 at 77
# rows of 30522 on the H200; gelu's C2 and bias_gelu's C3 (gelu.cu v3's forward, C1's bits) after C1 likewise,
# written 2026-12-07 against C1's forward 0.0195 ms and PyTorch's 0.0168 at (2048, 3072) on the H200
ORDER = {"softmax": ["C2", "3", "2", "1"], "layernorm": ["C4", "C3", "C2", "C1", "2", "1"],
         "residual_layernorm": ["C4", "C2", "C3", "2", "1"], "dropout_residual_layernorm": ["C4", "C3", "C2", "2", "1"],
         "dropout": ["C1", "2", "1"], "gelu": ["C1", "C2", "2", "1"], "bias_gelu": ["C1", "C2", "C3", "2", "1"],
         "attention": ["C6", "C4", "C3", "C2", "C5", "C1", "3", "2", "1"], "cross_entropy": ["C2", "C3", "C1", "2", "1"],
         "column_sum": ["C1", "gemv", "sum"], "embedding": ["C1", "2", "1", "atomic"]}
MODULE = {"softmax": "softmax", "layernorm": "layernorm", "residual_layernorm": "layernorm",
          "dropout_residual_layernorm": "layernorm", "dropout": "dropout", "gelu": "gelu", "bias_gelu": "gelu",
          "attention": "attention", "cross_entropy": "cross_entropy", "embedding": "embedding"}


class Version(NamedTuple):
    """One way to run an op: forward(...) -> (out, cache) and backward(dout, cache) with the oracle's signatures
    (column_sum: forward(x2) -> sums, no backward), the dtypes it takes on device arrays (None: every storage
    dtype), where it comes from, attention's probs(cache), and the variants it has kernels for (attention: head
    sizes; None: every variant)."""
    op: str
    key: str
    forward: Any
    backward: Any
    dtypes: Any
    note: str
    probs: Any = None
    variants: Any = None

    @property
    def cuda_c(self):
        return self.key.startswith("C")


# ----------------------------------------------------------------------------------------------------------------
# the state: set by refbert_kernels.cuda.backend (configure), read by describe()

MODE, XP = "sim", np
CHOSEN = {}         # (op, dtype name) -> Version
DEMOTED = {}        # (op, dtype name) -> [(version key, why)]
RAN = {}            # (op, dtype name, version key) -> calls
PINS = {}           # (op, dtype name or None) -> version key
IMPORT_ERRORS = {}  # module -> why it did not import
_VERSIONS = None


def configure(mode, xp):
    """The device the backend runs on: mode "gpu" (CuPy), "sim" (Numba's simulator, NumPy arrays) or "emu"
    (refbert_kernels.cuda.emulate's device arrays, the simulator for the Numba kernels)."""
    global MODE, XP
    MODE, XP = mode, xp
    reset()


def reset():
    """Forget every choice (the next call of each op chooses, and validates, again)."""
    CHOSEN.clear()
    DEMOTED.clear()
    RAN.clear()
    PINS.clear()
    _ORDER_CACHE.clear()                               # (a measured order is read again: the bench rewrites it)
    PINS.update(_env_pins())


def validate_first_use():
    env = os.environ.get("REFBERT_CUDA_VALIDATE")
    if env is not None:
        return env not in ("", "0")
    return MODE == "gpu"


def _env_pins():
    """REFBERT_CUDA_VERSIONS="op=version,op:dtype=version" as {(op, dtype or None): version}."""
    out = {}
    for item in filter(None, (s.strip() for s in os.environ.get("REFBERT_CUDA_VERSIONS", "").split(","))):
        if "=" not in item:
            raise ValueError(f"REFBERT_CUDA_VERSIONS: expected op=version or op:dtype=version, got {item!r}")
        left, key = (s.strip() for s in item.split("=", 1))
        op, _, dt = left.partition(":")
        _check_op(op, "REFBERT_CUDA_VERSIONS")
        out[(op, _check_dtype(dt, "REFBERT_CUDA_VERSIONS") if dt else None)] = \
            _check_version(op, key, "REFBERT_CUDA_VERSIONS")
    return out


def _check_op(op, what):
    if op not in OPS:
        raise ValueError(f"{what}: expected an op among {', '.join(OPS)}, got {op!r}")


def _check_dtype(dtype, what):
    """The name of a storage dtype (a pin for another dtype would never apply: a pin that silently does nothing)."""
    names = [np.dtype(t).name for t in C.STORAGE]
    try:
        name = np.dtype(dtype).name
    except TypeError:                                  # ("bfloat16" where NumPy alone does not know the name)
        name = dtype if isinstance(dtype, str) else repr(dtype)
    if name not in names:
        raise ValueError(f"{what}: expected a dtype among {', '.join(names)}, got {dtype!r}")
    return name


def _check_version(op, version, what):
    v = str(version).strip().lstrip("v")
    if v not in {x.key for x in versions()[op]}:
        raise ValueError(f"{what}: {op} has no version {version!r} here "
                         f"(has {', '.join(x.key for x in versions()[op])})")
    return v


def pin(op, version, dtype=None):
    """Run `version` ("C2", "3", 2, ...) of `op` (for `dtype` only, or every dtype) from the next call on, without
    validating it at first use; version=None removes the pin."""
    _check_op(op, "pin")
    key = (op, None if dtype is None else _check_dtype(dtype, "pin"))
    if version is None:
        PINS.pop(key, None)
    else:
        PINS[key] = _check_version(op, version, "pin")
    for k in [k for k in CHOSEN if k[0] == op]:
        del CHOSEN[k]


# ----------------------------------------------------------------------------------------------------------------
# the versions of every op

def _array_versions():
    """column_sum and embedding versions written with the array module alone."""
    def gemv(x2):                      # ones (1, R) @ x2 (R, C): one cuBLAS product, deterministic
        xp = C.xp_of(x2)
        return xp.matmul(xp.ones((1, x2.shape[0]), x2.dtype), x2).reshape(-1)

    def total(x2):
        return x2.sum(0)

    def atomic_backward(dout, cache):
        ids, w_shape, dtype, padding_idx = cache
        xp = C.xp_of(dout)
        C.dout("embedding", dout, (*ids.shape, w_shape[1]), dtype)
        dw = xp.zeros(w_shape, dtype)
        idx = ids.reshape(-1)
        src = xp.ascontiguousarray(dout).reshape(-1, w_shape[1])
        if xp is np:
            np.add.at(dw, idx, src)
        else:
            cupyx = getattr(xp, "cupyx", None)
            if cupyx is None:
                import cupyx
            cupyx.scatter_add(dw, idx, src)
        if padding_idx is not None:
            dw[padding_idx] = 0
        return dw
    from .embedding import embedding_forward_v2
    return [Version("column_sum", "gemv", gemv, None, None, "ones (1, R) @ x (cuBLAS; NumPy in the simulator)"),
            Version("column_sum", "sum", total, None, None, "the array module's sum over rows (a generic reduction)"),
            Version("embedding", "atomic", embedding_forward_v2, atomic_backward, None,
                    "scatter-add with atomics (cupyx.scatter_add): the order of additions is not fixed")]


def _build():
    import importlib
    vs = {op: [] for op in OPS}
    mods = {}
    for op, mod in MODULE.items():
        if mod not in mods:
            try:
                mods[mod] = importlib.import_module(f"refbert_kernels.cuda.{mod}")
            except Exception as e:                     # missing, half-written, failing to compile
                mods[mod] = None
                IMPORT_ERRORS[mod] = f"{type(e).__name__}: {e}"
        m = mods[mod]
        if m is None:
            continue
        spec = next(s for s in m.SPECS if s.name == op)
        for v, (fwd, bwd) in spec.versions.items():
            vs[op].append(Version(op, str(v), fwd, bwd, None, spec.notes.get(v, ""),
                                  getattr(m, "attention_probs", None) if op == "attention" else None))
    try:
        from . import cuda_c as K
    except Exception as e:                             # pragma: no cover
        K = None
        IMPORT_ERRORS["cuda_c"] = f"{type(e).__name__}: {e}"
    if K is not None:
        f32, f16 = ("float32",), ("float32", "float16")
        c = [("softmax", "C2", K.softmax_forward, K.softmax_backward, f32, "a warp per row, float4 (softmax.cu v2)"),
             ("layernorm", "C1", K.layernorm_forward, K.layernorm_backward, f32, "a warp per row, float4 "
              "(layernorm.cu v1)"),
             ("layernorm", "C2", K.layernorm_forward_c2, K.layernorm_backward_c2, f32, "layernorm.cu v2 (kind ln)"),
             ("residual_layernorm", "C2", K.residual_layernorm_forward_c2, K.residual_layernorm_backward_c2, f32,
              "s = x + a formed in every pass (layernorm.cu v2)"),
             ("dropout_residual_layernorm", "C2", K.dropout_residual_layernorm_forward_c2,
              K.dropout_residual_layernorm_backward_c2, f32, "s = x + a * keep / (1 - p), Philox in every pass "
              "(layernorm.cu v2)"),
             ("layernorm", "C3", K.layernorm_forward_c3, K.layernorm_backward_c2, f32, "C2 with the forward's row "
              "in registers (layernorm.cu v3; C <= 1024)"),
             ("residual_layernorm", "C3", K.residual_layernorm_forward_c3, K.residual_layernorm_backward_c2, f32,
              "C2 with the forward's row in registers: x, a read once (layernorm.cu v3)"),
             ("dropout_residual_layernorm", "C3", K.dropout_residual_layernorm_forward_c3,
              K.dropout_residual_layernorm_backward_c2, f32, "C2 with the forward's row in registers: x, a read "
              "and Philox drawn once (layernorm.cu v3)"),
             ("layernorm", "C4", K.layernorm_forward_c3, K.layernorm_backward_c4, f32, "C3's forward; dx and the "
              "dw, db partials in one pass (layernorm.cu v6 backward)"),
             ("residual_layernorm", "C4", K.residual_layernorm_forward_c3, K.residual_layernorm_backward_c4, f32,
              "C3's forward; dx and the dw, db partials in one pass (layernorm.cu v6 backward)"),
             ("dropout_residual_layernorm", "C4", K.dropout_residual_layernorm_forward_c3,
              K.dropout_residual_layernorm_backward_c4, f32, "C3's forward; dx, da and the dw, db partials in one "
              "pass over dout, x, a (layernorm.cu v6 backward)"),
             ("dropout", "C1", K.dropout_forward_c1, K.dropout_backward_c1, f32, "a thread per Philox block, float4"),
             ("gelu", "C1", K.gelu_forward_c1, K.gelu_backward_c1, f32, "elementwise, float4 (gelu.cu v1)"),
             ("bias_gelu", "C1", K.bias_gelu_forward_c1, K.bias_gelu_backward_c1, f32, "fused backward with db "
              "partials, then a fixed-order column sum (gelu.cu v1)"),
             ("bias_gelu", "C2", K.bias_gelu_forward_c1, K.bias_gelu_backward_c2, f32, "C1 with the backward a "
              "thread per (chunk, 4 columns), 4 rows of loads at a time: C1's bits (gelu.cu v2)"),
             ("gelu", "C2", K.gelu_forward_c2, K.gelu_backward_c1, f32, "C1 with the forward a grid-stride loop, "
              "the next groups prefetched into L2 during this one's math: C1's bits (gelu.cu v3)"),
             ("bias_gelu", "C3", K.bias_gelu_forward_c3, K.bias_gelu_backward_c1, f32, "C1 with the forward a "
              "grid-stride loop, the next groups prefetched into L2 during this one's math: C1's bits (gelu.cu v3)"),
             ("attention", "C1", K.attention_forward, K.attention_backward, f16, "scalar flash forward and backward "
              "(fp16 hs 64: tensor-core forward); attention_*.cu"),
             ("attention", "C2", K.attention_forward_c2, K.attention_backward_c2, ("float16",),
              "tensor-core flash forward and backward, padding tiles skipped (mma.sync, fp16 hs 64; "
              "attention_forward.cu v3, attention_backward.cu v3)"),
             ("attention", "C5", K.attention_forward_c5, K.attention_backward_c5, ("float16",),
              "C2's bits with less shared-memory and integer work: fragments by ldmatrix, the mask read once a "
              "tile or row, 128 (or 64) query rows a block, a Philox call per 4 keys in the forward and per 4 "
              "scores in the backward where T % 4 == 0 (attention_forward.cu v5 / v4, attention_backward.cu v6, "
              "or 5 or 7 by REFBERT_ATTN_BWD16)"),
             ("attention", "C3", K.attention_forward_c3, K.attention_backward_c3, f32, "register-tiled fp32 flash "
              "forward and backward, 64 x 64 tiles, 4 x 8 products per thread (attention_f32.cu v3)"),
             ("attention", "C4", K.attention_forward_c3, K.attention_backward_c4, f32, "C3's forward; the backward "
              "in one pass over the scores, dq partials summed in key-tile order (attention_f32.cu v6: v4's bits "
              "with conflict-free shared stores; v4 by REFBERT_F32_BWD=4, v8 (no dropout) by REFBERT_F32_BWD=8; v7, v6 "
              "in groups of key tiles, where the partials do not fit)"),
             ("attention", "C6", K.attention_forward_c6, K.attention_backward_c4, f32, "C4 with the forward's "
              "loads off its critical path: cp.async, K and V double-buffered, the mask row staged; C3's forward "
              "bits (attention_f32.cu v5, v6 or v4 as C4)"),
             ("cross_entropy", "C1", K.cross_entropy_forward_c1, K.cross_entropy_backward_c1, f32,
              "a block per row, online max/sum; kept rows and the loss on the device"),
             ("cross_entropy", "C2", K.cross_entropy_forward_c2, K.cross_entropy_backward_c1, f32,
              "C1 with each row split across blocks while the rows alone do not fill the GPU (cross_entropy.cu v2)"),
             ("cross_entropy", "C3", K.cross_entropy_forward_c3, K.cross_entropy_backward_c1, f32,
              "C2 in one launch: the last block to finish merges the rows and sums the loss, C2's bits "
              "(cross_entropy.cu v3)"),
             ("column_sum", "C1", K.column_sum_c1, None, f32, "chunk partials, then a fixed-order sum (colsum.cu)"),
             ("embedding", "C1", mods["embedding"].embedding_forward_v2 if mods.get("embedding") else None,
              K.embedding_backward_c1, f32, "sorted segment sum, runs of 32 (embedding.cu): deterministic")]
        for op, key, fwd, bwd, dts, note in c:
            if fwd is None or (op in MODULE and mods.get(MODULE[op]) is None):
                continue                               # (its launchers hand calls to that module's kernels)
            var = {"C1": ("hs32", "hs64", "hs128"), "C2": ("hs64",), "C3": ("hs64",), "C4": ("hs64",),
                   "C5": ("hs64",), "C6": ("hs64",)}.get(key) \
                if op == "attention" else None
            vs[op].append(Version(op, key, fwd, bwd, dts, note, K.attention_probs if op == "attention" else None,
                                  var))
    for v in _array_versions():
        vs[v.op].append(v)
    for op in vs:                                      # the built-in order
        rank = {k: i for i, k in enumerate(ORDER[op])}
        vs[op].sort(key=lambda v: (rank.get(v.key, len(rank)), v.key))
    return vs


def versions():
    """{op: [Version, ...]} in the built-in order (built once; the modules imported then)."""
    global _VERSIONS
    if _VERSIONS is None:
        _VERSIONS = _build()
    return _VERSIONS


def variant(op, args, kwargs):
    """What, besides the dtype, decides which versions have kernels for a call: attention's head size ("hs64"),
    None for every other op. (A version without kernels for a variant is not a candidate for it: no fallback.)"""
    if op != "attention":
        return None
    q = kwargs.get("q", args[0] if args else None)
    H = kwargs.get("n_heads", args[3] if len(args) > 3 else None)
    try:
        return f"hs{q.shape[-1] // int(H)}"
    except Exception:                                  # a bad argument: the version's own checks say so
        return None


def takes(v, dtype, var=None):
    """Whether version v runs this dtype (and variant) natively here: CUDA C only on device arrays (not the
    simulator's NumPy arrays) of the dtypes and variants it has kernels for."""
    dt = np.dtype(dtype).name
    if var is not None and v.variants is not None and var not in v.variants:
        return False
    if v.dtypes is None:
        return True
    if MODE == "emu":                                 # cpusim has no 16-bit storage: float32 kernels only
        return dt == "float32" and dt in v.dtypes
    return MODE == "gpu" and dt in v.dtypes


# ----------------------------------------------------------------------------------------------------------------
# measured orders (refbert bench --device cuda writes them)

def load_order(path=None):
    """{(op, dtype): [version keys]} from REFBERT_CUDA_ORDER (or path) if it names this device, else {}."""
    path = path or os.environ.get("REFBERT_CUDA_ORDER")
    if not path:
        return {}
    with open(path) as f:
        data = json.load(f)
    dev = device_name()
    if data.get("device") != dev:
        warnings.warn(f"refbert cuda: REFBERT_CUDA_ORDER={path} was measured on {data.get('device')!r}, this is "
                      f"{dev!r}: the built-in order is used", RuntimeWarning, stacklevel=2)
        return {}
    return {(op, dt): list(keys) for op, per in data.get("orders", {}).items() for dt, keys in per.items()}


ORDER_BY = ("forward + backward ms on the device alone where the call has both (its launches queued behind a "
            "blocking kernel), else as called (a call that synchronises inside); every Numba version after every "
            "other (its launch costs 20-170 us of host time, a CUDA graph cannot capture it)")


def numba_key(key):
    """Whether a version key names a Numba version ("1", "2", ...: launched by Numba on its own stream, at 20-170 us
    of host time a launch on the H100 and H200, and never inside a CUDA graph) rather than a CUDA C ("C1", ...) or
    an array-library one ("gemv", "sum", "atomic": CuPy's kernels and cuBLAS, on the current stream)."""
    return str(key).isdigit()


def rank(per):
    """[(key, seconds)] of {key: seconds}, the order cuda_order.json keeps: every version that launches cheaply and
    can be captured in a CUDA graph first, fastest first, then the Numba versions, fastest first. (On the H100,
    2026-11-28, Numba's embedding v1 ran 0.183 ms on the device to CUDA C C1's 0.195: ranked by device time alone
    it came first, and every CUDA graph step of the bench then failed its capture.)"""
    return sorted(per.items(), key=lambda kv: (numba_key(kv[0]), kv[1]))


def write_order(path, device, timings, by=ORDER_BY):
    """Write {op: {dtype: [keys fastest first]}} from timings {(op, dtype): {key: seconds}} (passing versions only),
    with the seconds themselves (ms, "ms") and what they are ("by"), atomically."""
    orders, ms = {}, {}
    for (op, dt), per in timings.items():
        ranked = rank(per)
        orders.setdefault(op, {})[dt] = [k for k, _ in ranked]
        ms.setdefault(op, {})[dt] = {k: round(sec * 1e3, 6) for k, sec in ranked}
    tmp = f"{path}.tmp"
    _ORDER_CACHE.pop(path, None)                       # (read again at the next choice)
    with open(tmp, "w") as f:
        json.dump({"device": device, "by": by, "orders": orders, "ms": ms}, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


_ORDER_CACHE = {}


def _measured(op, dt):
    path = os.environ.get("REFBERT_CUDA_ORDER")
    if not path:
        return None
    if path not in _ORDER_CACHE:
        _ORDER_CACHE[path] = load_order(path)
    return _ORDER_CACHE[path].get((op, dt))


def device_name():
    if MODE == "sim":
        return "Numba CUDA simulator (CPU)"
    if MODE == "emu":
        return "emulated GPU (CPU threads)"
    props = XP.cuda.runtime.getDeviceProperties(XP.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


# ----------------------------------------------------------------------------------------------------------------
# choosing, validating, reporting

def order(op, dtype, var=None):
    """(candidate Versions for (op, dtype, variant) in the order they are tried, where the order came from)."""
    dt = np.dtype(dtype).name
    by_key = {v.key: v for v in versions()[op]}
    key = PINS.get((op, dt), PINS.get((op, None)))
    if key is not None:
        return [by_key[key]], "pinned"
    measured = _measured(op, dt)
    if measured:
        first = [by_key[k] for k in measured if k in by_key]
        rest = [v for v in versions()[op] if v.key not in measured]
        return [v for v in first + rest if takes(v, dt, var)], "measured"
    return [v for v in versions()[op] if takes(v, dt, var)], "built in"


_DT_NAMES = {}


def _dt_name(dtype):
    """np.dtype(dtype).name, looked up once per dtype object (choose and ran run at every op call)."""
    n = _DT_NAMES.get(dtype)
    if n is None:
        n = _DT_NAMES[dtype] = np.dtype(dtype).name
    return n


def choose(op, dtype, var=None):
    """The Version that runs (op, dtype, variant) here, chosen (and validated) at the first call."""
    dt = _dt_name(dtype)
    key = (op, dt) if var is None else (op, f"{dt} {var}")
    v = CHOSEN.get(key)
    if v is not None:
        return v
    cands, source = order(op, dt, var)
    if not cands:
        raise RuntimeError(f"refbert cuda: no version of {op} takes {dt} here")
    if source == "pinned" or not validate_first_use():
        CHOSEN[key] = cands[0]
        return cands[0]
    for v in cands:
        worst, err = validate(v, dt)
        if err is None and worst <= 1:
            CHOSEN[key] = v
            return v
        why = err or f"err/tol {worst:.3g} > 1 against the oracle"
        DEMOTED.setdefault(key, []).append((v.key, why))
        warnings.warn(f"refbert cuda: {op} {dt} version {v.key} failed validation on {device_name()} ({why}); "
                      f"demoted to the next version", RuntimeWarning, stacklevel=3)
    raise RuntimeError(f"refbert cuda: every version of {op} in {dt} failed validation here: {DEMOTED[key]}")


def ran(op, dtype, key):
    k = (op, _dt_name(dtype), key)
    RAN[k] = RAN.get(k, 0) + 1


def problems():
    """[(op, text)] of everything that did not run as the order meant: demotions, CUDA C calls handed to Numba,
    kernel modules that did not import, kernels launched through CuPy's call where launch version 2 was meant
    (cuda_c.LAUNCH_FELL_BACK). Each is a failing row in check --device cuda and the bench."""
    out = [(op, f"{dt}: version {k} demoted ({why})") for (op, dt), ds in DEMOTED.items() for k, why in ds]
    try:
        from .cuda_c import FELL_BACK, LAUNCH_FELL_BACK
    except Exception:                                  # pragma: no cover
        FELL_BACK, LAUNCH_FELL_BACK = {}, {}
    out += [(op, f"{ver} took the Numba kernel ({why})") for (op, ver), why in FELL_BACK.items()
            if not why.startswith("host (NumPy)") or MODE != "sim"]
    out += [("launch", f"{name} through CuPy's RawKernel call, not launch version 2 ({why})")
            for name, why in sorted(LAUNCH_FELL_BACK.items())]
    out += [(mod, f"refbert_kernels.cuda.{mod} did not import: {why}") for mod, why in IMPORT_ERRORS.items()]
    return out


# kernel variants chosen inside a version by an environment variable (A/B runs): (module, attribute, default,
# variable, what it chooses), the default _common.VARIANT_DEFAULTS's; describe() names every one not at its default
VARIANTS = tuple((mod, attr, C.VARIANT_DEFAULTS[var], var, what) for mod, attr, var, what in (
    ("cuda_c", "ATTN_BWD16", "REFBERT_ATTN_BWD16", "attention C5's backward kernels"),
    ("cuda_c", "ATTN_FWD16", "REFBERT_ATTN_FWD16", "attention C5's forward kernel at 128 rows a block"),
    ("cuda_c", "LN_DWDB", "REFBERT_LN_DWDB", "layernorm's dw, db partials"),
    ("cuda_c", "F32_BWD", "REFBERT_F32_BWD", "attention C4's and C6's backward kernels"),
    ("mixed", "ATTENTION", "REFBERT_MIXED_ATTENTION", "the mixed path's attention"),
    ("mixed", "MIXED_LN", "REFBERT_MIXED_LN", "the mixed residual layernorms' forward"),
    ("mixed", "MIXED_LN_BWD", "REFBERT_MIXED_LN_BWD", "the mixed layernorms' backward"),
    ("mixed", "MIXED_GELU_BWD", "REFBERT_MIXED_GELU_BWD", "the mixed bias + GELU backward"),
    ("mixed", "MIXED_GELU_FWD", "REFBERT_MIXED_GELU_FWD", "the mixed GELUs' forward")))


@contextlib.contextmanager
def kernel_variant(var, value):
    """The kernel variant `var` (a VARIANTS variable, e.g. "REFBERT_ATTN_BWD16") set to `value` inside the block, as
    the variable would set it at import (an A/B run), and what it was put back after."""
    import importlib
    found = [(mod, attr) for mod, attr, _, v, _ in VARIANTS if v == var]
    if not found:
        raise ValueError(f"kernel_variant: expected one of {', '.join(v for *_, v, _ in VARIANTS)}, "
                         f"got {var!r}")
    m = importlib.import_module(f"{__package__}.{found[0][0]}")
    had = getattr(m, found[0][1])
    setattr(m, found[0][1], value)
    try:
        yield
    finally:
        setattr(m, found[0][1], had)


def kernel_variants():
    """[(variable, value, what it chooses)] of the VARIANTS not at their default (in the modules as imported)."""
    import sys
    out = []
    for mod, attr, default, var, what in VARIANTS:
        m = sys.modules.get(f"{__package__}.{mod}")
        value = getattr(m, attr, default) if m is not None else os.environ.get(var, default)
        if value != default:
            out.append((var, value, what))
    return out


def describe():
    """Lines: per op, the version each dtype runs (and the order it came from), pins, demotions, fallbacks, and the
    kernel variants not at their default."""
    lines = []
    for op in OPS:
        chosen = sorted((dt, v.key) for (o, dt), v in CHOSEN.items() if o == op)
        builtin = " > ".join(v.key for v in versions()[op])
        pins = [f"{dt or 'every dtype'}={k}" for (o, dt), k in PINS.items() if o == op]
        text = f"  {op:27s} order {builtin}"
        if chosen:
            text += "; runs " + ", ".join(f"{dt}: {k}" for dt, k in chosen)
        if pins:
            text += "; pinned " + ", ".join(pins) + " (not validated)"
        lines.append(text)
    for op, why in problems():
        lines.append(f"  FALLBACK {op}: {why}")
    for var, value, what in kernel_variants():
        lines.append(f"  variant {var}={value} ({what}; not the default)")
    return lines


# ----------------------------------------------------------------------------------------------------------------
# validation on this device

def spec_of(op):
    import importlib
    if op == "column_sum":
        return None
    m = importlib.import_module(f"refbert_kernels.cuda.{MODULE[op]}")
    return next(s for s in m.SPECS if s.name == op)


def _to_dev(a, dtype):
    if isinstance(a, np.ndarray) and a.dtype.kind == "f":
        with np.errstate(over="ignore"):           # float32's most negative mask value is -inf in float16
            a = a.astype(dtype)
    return XP.asarray(a) if MODE != "sim" and isinstance(a, np.ndarray) else a


def validate(v, dtype, shapes=None, seed=0):
    """(worst err/tol over the op's validation shapes, None) or (inf, error text) of version v in dtype on this
    device: float32 / float64 against the oracle in the same dtype (the spec's tolerance), float16 / bfloat16
    against the float64 oracle on the same rounded inputs (the spec's, else 4 ulp of storage)."""
    from refbert_kernels._harness import _fresh, compare
    dt = np.dtype(dtype)
    try:
        if v.op == "column_sum":
            return _validate_colsum(v, dt), None
        spec = spec_of(v.op)
        low = dt.itemsize < 4
        atol, rtol = spec.tol.get(dt.type) or C.lowp_tol(dt)
        shapes = shapes or (spec.notes.get("gpu_shapes", spec.shapes) if MODE == "gpu" else spec.shapes)
        if v.variants is not None and v.op == "attention":    # the head sizes it has kernels for
            shapes = [s for s in shapes if f"hs{s['hs']}" in v.variants]
        worst = 0.0
        for shape in shapes:
            inputs, kwargs = spec.make_inputs(shape, np.float32 if low else dt, seed)
            if low:
                inputs = {k: (a.astype(dt) if isinstance(a, np.ndarray) and a.dtype.kind == "f" else a)
                          for k, a in inputs.items()}
            ref_in = {k: (a.astype(np.float64) if low and isinstance(a, np.ndarray) and a.dtype.kind == "f" else a)
                      for k, a in inputs.items()}
            ref_out, ref_cache = spec.oracle[0](**ref_in, **_fresh(kwargs))
            d_in = {k: _to_dev(a, dt) for k, a in inputs.items()}
            d_kw = {k: (_to_dev(a, dt) if isinstance(a, np.ndarray) else a) for k, a in kwargs.items()}
            out, cache = v.forward(**d_in, **_fresh(d_kw))
            if np.ndim(ref_out) == 0:
                d_h = np.float64(1.0)
                d = dt.type(1.0)
            else:
                d_h = np.random.default_rng(seed).standard_normal(np.shape(ref_out)).astype(dt)
                d = _to_dev(d_h, dt)
            ref_g = spec.oracle[1](d_h.astype(np.float64) if low else d_h, ref_cache)
            got_g = v.backward(d, cache)
            ref_g = ref_g if isinstance(ref_g, tuple) else (ref_g,)
            got_g = got_g if isinstance(got_g, tuple) else (got_g,)
            for label, g, r in [("out", out, ref_out), *zip((f"d{w}" for w in spec.wrt), got_g, ref_g)]:
                g = C.to_host(g)
                if low:
                    g, r = np.asarray(g).astype(np.float64), np.asarray(r, np.float64)
                worst = max(worst, compare(f"{v.op} {v.key} {dt.name} {shape} {label}", g, r, atol, rtol))
        return worst, None
    except Exception as e:                            # a launch or compile failure is a failed validation
        text = str(e).splitlines()[0] if str(e) else ""
        return math.inf, f"{type(e).__name__}: {text[:300]}"


def _validate_colsum(v, dt):
    """Column sums against float64 sums of the same values: |got - ref| <= R eps max|x| (a sum of R rounded
    terms, in any order) plus the storage's rounding of the result."""
    worst = 0.0
    for R, Cn in ((1, 1), (7, 37), (130, 33), (300, 5)):
        x = np.random.default_rng(R).standard_normal((R, Cn)).astype(dt)
        ref = x.astype(np.float64).sum(0)
        got = np.asarray(C.to_host(v.forward(_to_dev(x, dt))), np.float64)
        eps = C.eps_of(dt)
        tol = R * eps * float(np.abs(x).max()) + eps * np.abs(ref)
        worst = max(worst, float((np.abs(got - ref) / tol).max()))
    return worst
