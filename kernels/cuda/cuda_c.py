"""CuPy launchers for the CUDA C kernels in kernels/cuda/csrc/*.cu, with the oracle's signatures and ValueErrors.

Every launcher takes its CUDA C path on float32 device arrays (CuPy's, or refbert_kernels.cuda.emulate's on a
machine without a GPU) and falls back to the op's Numba version for anything else (NumPy arrays in the
simulator, fp64, fp16 / bf16, a head size the kernels lack); such a fallback is recorded in FELL_BACK and warned
about once, never silent (refbert_kernels.cuda.versions reports it). Oracle: refbert.ops (the same ValueErrors,
raised by the same checks before any launch; the same dropout elements).

    op                           version  kernels (csrc/)                                     fast path
    attention                    C1       attention_forward.cu v1 (scalar flash), v2 (tensor   f32 / f16, hs in
                                          cores, f16 hs = 64), attention_backward.cu v1         {32, 64, 128}
                                 C2       attention_forward.cu v3 (v2, padding tiles skipped),  f16, hs = 64
                                          attention_backward.cu v3 (tensor cores)
                                 C5       attention_forward.cu v5 / v4 (v3's bits: ldmatrix,    f16, hs = 64
                                          128 / 64 query rows a block), attention_backward.cu
                                          v5 (v3's bits: ldmatrix, the mask read once, a
                                          Philox call per 4 scores)
                                 C3       attention_f32.cu v3 (register-tiled fp32 flash,      f32, hs = 64
                                          forward and backward, dynamic shared memory)
                                 C4       C3's forward; attention_f32.cu v4 backward (dk, dv,  f32, hs = 64
                                          dq in one pass: dq partials summed in key order;
                                          v7: in groups of key tiles where they do not fit)
                                 C6       attention_f32.cu v5 forward (C3's bits: cp.async,    f32, hs = 64
                                          K / V double-buffered, the mask staged), C4's backward
    softmax                      C2       softmax.cu v2 (a warp per row, float4)               f32
    layernorm                    C1-C4    layernorm.cu v1, v2, v3 (kind ln); C4: v3's forward  f32
                                          and v6's backward (dx and the dw, db partials in
                                          one pass over dout, x, a)
    residual_layernorm           C2-C4    layernorm.cu v2, v3, C4 as above (kind res)          f32
    dropout_residual_layernorm   C2-C4    layernorm.cu v2 (kind drop: Philox in every pass),   f32
                                          v3 (the forward's row in registers: one pass), C4
    dropout                      C1       dropout.cu v1 (a thread per Philox block, float4)    f32
    gelu, bias_gelu              C1       gelu.cu v1 (fused db partials + colsum_final)        f32
    bias_gelu                    C2       C1's forward; gelu.cu v2's backward (a thread per    f32
                                          (chunk, 4 columns), 4 rows of loads at a time: C1's
                                          bits)
    gelu C2, bias_gelu C3        C2 / C3  gelu.cu v3's forward (a grid-stride loop, the next   f32
                                          groups prefetched into L2 during this one's math:
                                          C1's bits); C1's backward
    cross_entropy                C1-C3    cross_entropy.cu v1 (kept rows found on the device,  f32
                                          the loss and its count stay there), v2 (rows split
                                          across blocks when few), v3 (v2 in one launch)
    column_sum (bias gradients)  C1       colsum.cu v1 (chunk partials, then a fixed-order sum) f32
                                          (mixed precision: from the 16-bit operand, the same bits)
    embedding (backward)         C1       embedding.cu v1 (sorted segment sum: deterministic)  f32
The CUDA C caches are their own NamedTuples (a forward that fell back leaves the Numba version's cache, which its
backward hands to the Numba backward); attention's is kernels/cuda/attention.py's tuple (q, k, v, mask4, H, out,
m, linv, drop), so attention_probs and either backward read it.

Launch arguments are NumPy scalars of the kernel's exact C type (np.int32 for int, np.float32 for float, np.int64
for long long, np.uint64 for u64): CuPy packs a Python int as 8 bytes and a float as a double, which a kernel
would misread, and launch version 2 (the default: `Packed`, the section "launches" below) refuses anything else
at a kernel's first call (the layout is fixed then; later calls are packed by it).
refbert_kernels.cuda.emulate checks every launch against the kernel's signature.

No device-to-host reads: checks that need values (a NaN logit, a row of -inf scores) run only on host arrays or
with REFBERT_CUDA_CHECKS=1 (_common.STRICT). Each .cu is compiled once per process by NVRTC through
xp.RawModule with -DNO_MAIN (the standalone validating main and every host header sit behind it) and -I csrc.
"""
import contextlib
import ctypes
import functools
import math
import os
import struct
import threading
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from refbert import ops
from refbert import validate as V

from . import _common as C
from . import compile_time

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("attention_forward.cu", "attention_backward.cu", "attention_f32.cu", "softmax.cu", "layernorm.cu", "gelu.cu",
           "dropout.cu", "cross_entropy.cu", "colsum.cu", "embedding.cu", "optim.cu")
_DT = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16"}
F32 = np.dtype(np.float32)
FELL_BACK = {}          # (op, version) -> why the last call took the Numba version instead
FELL_BACK_CALLS = {}    # (op, version) -> how many calls did (graph.py: a captured step must make none)
H2D = None              # the backend's host-to-device copy (pinned, asynchronous on a GPU); None: xp.asarray


MODULES = {}        # (csrc file, array module) -> its RawModule, every one compiled so far (graph.py sets a global
#                     in each: refbert_stream_shift)


@contextlib.contextmanager
def compile_lock(name):
    """An exclusive lock on compiling csrc/<name> among the processes of this machine (an flock on a file beside
    CuPy's disk cache), so that processes starting together (gpu_all.sh's steps, pytest's workers) compile each file
    once: the first takes the lock and compiles into CuPy's cache, the others wait and then load that. Without
    fcntl (not Linux) or a writable cache directory: no lock, each process compiles for itself as CuPy would."""
    try:
        import fcntl
        where = Path(os.environ.get("CUPY_CACHE_DIR") or Path.home() / ".cupy" / "kernel_cache")
        where.mkdir(parents=True, exist_ok=True)
        f = open(where / f"refbert-{name}.lock", "w")
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield
    finally:
        f.close()                                       # (closing releases the flock)


@functools.lru_cache(maxsize=None)
def _module(name, xp):
    code = (CSRC / name).read_text()
    options = ("-std=c++17", "-DNO_MAIN", f"-I{CSRC}")
    t0 = compile_time.clock()
    if getattr(xp, "EMULATED", False):                  # (the emulator builds its library when the module is made)
        t1 = t0
        mod = xp.RawModule(code=code, options=options)
    else:
        with compile_lock(name):                        # CuPy compiles lazily: here, under the lock, instead
            t1 = compile_time.clock()
            mod = xp.RawModule(code=code, options=options)
            if hasattr(mod, "compile"):                 # (CuPy >= 9; an older one compiles at first use, unlocked)
                mod.compile()
    compile_time.note_cuda_c(name, t1 - t0, compile_time.clock() - t1)
    MODULES[(name, xp)] = mod
    return mod


def module(name, xp=None):
    """The compiled RawModule of csrc/<name> (NVRTC, for the current device; or the emulated one)."""
    if xp is None:
        import cupy as xp
    return _module(name, xp)


RECORD = None       # a list while the bench's launch probe records: (name, kernel, grid, block, args, kw) per launch
                    # (kw: the launch's keywords, shared_mem above all: a replay without it reads outside shared memory)


_FUNCTIONS = {}     # (source, name, xp, launch version) -> the kernel: made once, not at every launch


# ----------------------------------------------------------------------------------------------------------------
# launches: how the host hands a kernel its arguments (issue 13: at most 10 us of host time a launch)
#
# version 1  CuPy's RawKernel call, kernel(grid, block, args, shared_mem=...): at every call CuPy looks at each
#            argument's Python type, wraps it (an array: its pointer; an np.int32: 4 bytes) and launches. On the
#            H200 (2f0feb7) 12-21 us a launch with the step's own arguments, 8.7-13.3 us for an empty kernel with
#            16 arguments (benchmarks/launch_cost.py).
# version 2  Packed: the kernel's argument layout is fixed at its first call (one 8-byte slot an argument: a pointer
#            or u64 / long long / double fills it, an int or float its low 4 bytes, as CUDA reads a kernelParams
#            entry of that type on a little-endian host), each later call writes all values with one
#            struct.pack_into into this thread's slots and calls cuLaunchKernel (cupy.cuda.driver.launchKernel)
#            with the slots' addresses, made once. launch_cost.py timed that call alone at 4.3-5.5 us (its "driver,
#            no repack" column). CUDA copies the values during cuLaunchKernel, so the slots are free again when it
#            returns (and a CUDA graph capture records the values, not the slots).
# REFBERT_LAUNCH=1 pins version 1 (A/B runs; the bench's launch probe times both on the step's own launches).
# The emulator (emulate.py) runs version 2 for real: its launchKernel hands the same slot addresses to the kernel's
# trampoline, which reads each argument by the kernel's C signature, after RawKernel.refbert_check has checked the
# call's argument types against that signature, so CI proves the layout the GPU is given.

LAUNCH = os.environ.get("REFBERT_LAUNCH", "2")
if LAUNCH not in ("1", "2"):
    raise ValueError(f"REFBERT_LAUNCH: expected 1 (CuPy's RawKernel call) or 2 (packed parameters), got {LAUNCH!r}")
LAUNCH_FELL_BACK = {}   # kernel name -> why version 2 could not be used for it (version 1 runs; warned once)

# an argument's slot by its NumPy scalar's dtype, as a struct format of 8 bytes: int, unsigned, float (4 bytes, 4 of
# padding), long long, u64, double (8); a device array's pointer is "Q"
_SLOT = {np.dtype(np.int32): "i4x", np.dtype(np.uint32): "I4x", np.dtype(np.float32): "f4x",
         np.dtype(np.int64): "q", np.dtype(np.uint64): "Q", np.dtype(np.float64): "d"}


def _dims3(d, _cache={}):
    """A grid or block as CuPy takes it (an int, or a tuple of 1 to 3) -> three ints, each at least 1 as CuPy's call
    makes them (cached: the same few come back at every launch)."""
    try:
        return _cache[d]
    except (KeyError, TypeError):
        pass
    t = (d,) if isinstance(d, (int, np.integer)) else tuple(d)
    if not 1 <= len(t) <= 3:
        raise ValueError(f"launch: grid and block expected an int or 1 to 3 ints, got {d!r}")
    out = tuple(max(1, int(v)) for v in t) + (1,) * (3 - len(t))
    if isinstance(d, (int, np.integer, tuple)):
        _cache[d] = out
    return out


class Packed:
    """Launch version 2 of one kernel (the section's comment): packed(grid, block, args, shared_mem=0, stream=None)
    as CuPy's RawKernel takes it. `raw` is the RawKernel (version 1), kept for the launch probe's comparison."""

    def __init__(self, raw, name, xp):
        self.raw, self.name, self.xp = raw, name, xp
        self.fptr = getattr(raw, "kernel", raw).ptr            # the CUfunction on the current device (CuPy:
        #                                                        RawKernel.kernel.ptr); kernel() keys it by device
        self._launch = xp.cuda.driver.launchKernel
        self._stream = xp.cuda.get_current_stream
        self._check = getattr(raw, "refbert_check", None)      # the emulator's signature check; None on a GPU
        self._pack = None
        self._tls = threading.local()

    def _layout(self, args):
        """The slot format and packer for this kernel, from its first call's argument types."""
        fmt, vals = ["<"], []
        for i, a in enumerate(args):
            if C.on_device(a):
                fmt.append("Q")
                vals.append(f"a[{i}].data.ptr")
                continue
            code = _SLOT.get(a.dtype) if isinstance(a, np.generic) else None
            if code is None:
                raise TypeError(f"launch of {self.name}: argument {i} expected a device array or a NumPy scalar of "
                                f"the parameter's C type (np.int32, np.uint32, np.float32, np.int64, np.uint64, "
                                f"np.float64), got {type(a).__name__}")
            fmt.append(code)
            vals.append(f"a[{i}]")
        st = struct.Struct("".join(fmt))
        ns = {"pack_into": st.pack_into}
        exec(f"def pack(buf, a):\n    pack_into(buf, 0, {', '.join(vals)})\n", ns)     # one call, no loop
        self.n = len(args)
        self._pack = ns["pack"]

    def _slots(self):
        """This thread's slots and the address of their address array (made at the thread's first launch, when the
        thread is also given the device's context if it has none yet: CuPy's own launch makes sure of it too, a
        cuLaunchKernel on a thread without a context fails)."""
        ensure = getattr(self.xp.cuda.runtime, "memGetInfo", None)
        if ensure is not None:
            ensure()                                            # (a runtime call: it makes the primary context current)
        tls = self._tls
        slots = (ctypes.c_uint64 * max(self.n, 1))()
        base = ctypes.addressof(slots)
        addrs = (ctypes.c_void_p * max(self.n, 1))(*[base + 8 * i for i in range(max(self.n, 1))])
        tls.slots, tls.addrs, tls.ptr = slots, addrs, ctypes.addressof(addrs) if self.n else 0
        return slots

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        if self._check is not None:
            self._check(grid, block, args, shared_mem)
        if self._pack is None:
            self._layout(args)
        elif len(args) != self.n:
            raise TypeError(f"launch of {self.name}: {len(args)} arguments, its first launch had {self.n}")
        tls = self._tls
        slots = getattr(tls, "slots", None)
        if slots is None:
            slots = self._slots()
        self._pack(slots, args)
        g, b = _dims3(grid), _dims3(block)
        s = (stream if stream is not None else self._stream()).ptr
        self._launch(self.fptr, g[0], g[1], g[2], b[0], b[1], b[2], int(shared_mem), s, tls.ptr, 0)


def _packed(raw, name, xp):
    """Version 2 of raw's launch, or raw itself (version 1) where version 2 cannot be made, said once."""
    try:
        return Packed(raw, name, xp)
    except (AttributeError, TypeError) as e:          # no driver.launchKernel / no function pointer in this CuPy
        why = f"{type(e).__name__}: {e}"
        if name not in LAUNCH_FELL_BACK:
            warnings.warn(f"refbert cuda: {name} launches through CuPy's RawKernel call (launch version 1), not "
                          f"packed parameters ({why})", RuntimeWarning, stacklevel=3)
        LAUNCH_FELL_BACK[name] = why
        return raw


def kernel(source, name, xp=None):
    if xp is None:
        import cupy as xp
    # (version 2 holds the CUfunction of one device: keyed by the device current at the call, as CuPy's call looks
    # its function up per device)
    key = (source, name, xp, LAUNCH, xp.cuda.runtime.getDevice() if LAUNCH == "2" else None)
    fn = _FUNCTIONS.get(key)
    if fn is None:
        raw = module(source, xp).get_function(name)
        fn = _FUNCTIONS[key] = _packed(raw, name, xp) if LAUNCH == "2" else raw
    if RECORD is None:
        return fn

    def recorded(grid, block, args, **kw):
        RECORD.append((name, fn, grid, block, args, kw))
        return fn(grid, block, args, **kw)
    return recorded


@functools.lru_cache(maxsize=4096)
def _i(n):
    """n as the kernels' C int (np.int32: CuPy packs a Python int as 8 bytes); the same few ints come back at every
    launch, so they are made once."""
    return np.int32(n)


def _f(x):
    return np.float32(x)


def _c_ok(*arrays, dtypes=(F32,)):
    """The CUDA C path applies: every array on a device (CuPy or emulated) with a dtype the kernels take."""
    return all(a is not None and C.on_device(a) and a.dtype in dtypes for a in arrays)


def _is_cupy(*arrays):
    return all(a is not None and C.on_device(a) for a in arrays)


def _aligned(*arrays):
    """Every array's data 16-byte aligned (the float4 paths)."""
    return all(a is None or a.data.ptr % 16 == 0 for a in arrays)


def _fallback(op, version, why, fn, *args, **kwargs):
    """Run the Numba version instead, recording (and warning once) why: a slow path is never silent."""
    FELL_BACK_CALLS[(op, version)] = FELL_BACK_CALLS.get((op, version), 0) + 1
    if FELL_BACK.get((op, version)) != why:
        FELL_BACK[(op, version)] = why
        if any(C.on_device(a) for a in args if C.is_array(a)):       # device arrays: it matters (not the simulator)
            warnings.warn(f"refbert cuda: {op} {version} took the Numba kernel instead ({why})", RuntimeWarning,
                          stacklevel=3)
    return fn(*args, **kwargs)


def _tc_fell_back(op, why, ran):
    """A pinned tensor-core attention version (C2, C5) called with what its kernels cannot take (float16, hs 64,
    16-byte rows): `ran`, a scalar kernel, runs instead, recorded, counted and warned (a slow path is never silent).
    op: "C2 forward", "C5 backward", ..."""
    FELL_BACK[("attention", op)] = why
    FELL_BACK_CALLS[("attention", op)] = FELL_BACK_CALLS.get(("attention", op), 0) + 1
    warnings.warn(f"refbert cuda: attention {op} took {ran} ({why})", RuntimeWarning, stacklevel=4)


def _why(*arrays):
    a = next((a for a in arrays if a is not None), None)
    if a is None:
        return "no arrays"
    if not C.on_device(a):
        return "host (NumPy) arrays"
    return f"dtype {a.dtype} (the CUDA C kernels take float32)"


_NODROP = (np.uint64(0), np.uint64(0), np.uint64(0), 1.0)


# ----------------------------------------------------------------------------------------------------------------
# attention (C1)

def _mask_strides(mask4):
    """Element strides of the contiguous (1 or full)^4 mask for index (b, h, i, j): 0 on axes of length 1."""
    s = [int(x) for x in np.cumprod((1,) + tuple(mask4.shape[::-1]))[:4][::-1]]
    return [np.int64(0 if mask4.shape[a] == 1 else s[a]) for a in range(4)]


def _numba():
    A = C.sibling("attention")
    return A


def attention_forward(q, k, v, n_heads, mask=None, dropout_p=0.0, rng=None, train=True):
    return _attention_forward(q, k, v, n_heads, mask, dropout_p, rng, train, 2)


def attention_forward_c2(q, k, v, n_heads, mask=None, dropout_p=0.0, rng=None, train=True):
    """C2's forward: attention_forward.cu version 3 (C1's tensor-core forward with key tiles of padding skipped: the
    same bits) for float16 at hs 64; elsewhere as C1."""
    return _attention_forward(q, k, v, n_heads, mask, dropout_p, rng, train, 3)


def attention_forward_c5(q, k, v, n_heads, mask=None, dropout_p=0.0, rng=None, train=True, rows=None):
    """C5's forward: attention_forward.cu version 5 (128 query rows a block: each K / V fragment read from shared
    memory feeds two mma.sync) or version 4 (64 rows), both version 3's arithmetic and bits with ldmatrix fragments,
    the key tile's mask row in shared memory and a Philox call per 4 keys. rows (64 or 128) pins one; None takes
    128 when that grid still gives every SM two blocks (version 5 holds 250 registers a thread: two blocks an SM),
    else 64. float16 at hs 64; elsewhere as C1. With REFBERT_ATTN_FWD16=6, version 6 where version 5 would run
    without dropout under a mask constant along the rows (or none): version 5 with each score's work cut, its bits
    wherever no probability falls below 2^-126."""
    if rows not in (None, 64, 128):
        raise ValueError(f"attention_forward_c5: argument 'rows' expected None, 64 or 128, got {rows!r}")
    return _attention_forward(q, k, v, n_heads, mask, dropout_p, rng, train, 5, rows)


def _attention_forward(q, k, v, n_heads, mask, dropout_p, rng, train, tc_version, rows=None):
    A = _numba()
    B, T, Cc, H = A._checks(q, k, v, n_heads, mask)
    hs = Cc // H
    if not (_c_ok(q, k, v, dtypes=tuple(_DT)) and hs in (32, 64, 128)) or q.size == 0:
        why = _why(q) if not _c_ok(q, k, v, dtypes=tuple(_DT)) else (f"head size {hs} (kernels for 32, 64, 128)"
                                                                     if q.size else "an empty input")
        return _fallback("attention", "C1", why, A.attention_forward, q, k, v, n_heads, mask, dropout_p, rng, train)
    xp = C.xp_of(q)
    dt = _DT[q.dtype]
    q, k, v = (xp.ascontiguousarray(a) for a in (q, k, v))
    mask4 = A._mask4(xp, mask, B, H, T, q.dtype)
    m32 = xp.ascontiguousarray(mask4.astype(np.float32) if mask4.dtype != F32 else mask4)
    dropping, p_ok, (seed, stream, thresh, dscale) = A._drop(dropout_p, rng, train)
    out = xp.empty(q.shape, q.dtype)
    m = xp.empty((B, H, T), np.float32)
    linv = xp.empty((B, H, T), np.float32)
    tc = dt == "f16" and hs == 64
    if not tc and tc_version in (3, 5):                           # C2's or C5's forward (a pin): C1's kernel runs
        _tc_fell_back(f"C{2 if tc_version == 3 else 5} forward",
                      f"dtype {q.dtype}, head size {hs} (tensor cores: float16, hs 64): C1's ran", "C1's kernel")
    if tc and not _aligned(q, k, v):                              # cp.async moves 16-byte rows
        tc = False
        FELL_BACK[("attention", "C1 tensor cores")] = "q, k or v not 16-byte aligned: the scalar kernel ran"
        warnings.warn("refbert cuda: attention C1 float16 took the scalar kernel (q, k or v not 16-byte aligned)",
                      RuntimeWarning, stacklevel=2)
    qrows = 64
    if tc and tc_version == 5:                                   # version 5: 128 query rows a block; 4: 64
        qrows = rows or (128 if (T + 127) // 128 * B * H >= 2 * _sm_count(xp) else 64)
        tc_version = 5 if qrows == 128 else 4
        if C.variant("attention C5", "REFBERT_ATTN_FWD16", ATTN_FWD16, ATTN_FWD16S) == "6":
            along = int(_mask_strides(mask4)[2]) != 0
            if tc_version == 5 and not along and not thresh:
                tc_version = 6                                   # (without dropout, a mask constant along the rows)
            else:
                _say_once("attention C5's forward version 6 (REFBERT_ATTN_FWD16=6)",
                          "a grid of 64-row blocks" if tc_version == 4 else
                          "a mask that varies along the rows" if along else "dropout",
                          f"version {tc_version}'s kernel")
    name = f"attn_fwd_v{tc_version}_{dt}_hs64" if tc else f"attn_fwd_v1_{dt}_hs{hs}"
    args = (q, k, v, m32, *_mask_strides(mask4), _i(B), _i(T), _i(H), _f(1.0 / math.sqrt(hs)), seed, stream, thresh,
            _f(dscale), out, m, linv)
    kernel("attention_forward.cu", name, xp)(((T + qrows - 1) // qrows, B * H), (128 if tc else 64,), args)
    if C.checks_on(m) and not (bool(xp.isfinite(m).all()) and bool(xp.isfinite(linv).all())):
        raise ValueError(A._SOFTMAX_ERROR)               # (a read back: only with REFBERT_CUDA_CHECKS=1)
    if not p_ok or (train and dropout_p > 0.0 and not isinstance(rng, A.DropoutRNG)):
        ops.dropout_forward(np.zeros(0, np.float32), dropout_p, rng, train)  # the oracle's dropout error
    if dropping:
        assert rng.next_stream() == (int(seed), int(stream))
    return out, (q, k, v, mask4, H, out, m, linv, (seed, stream, thresh, float(dscale)))


def attention_backward(dout, cache):
    return _attention_backward(dout, cache, 1)


def _attention_backward(dout, cache, version):
    """dq, dk, dv by attention_backward.cu: version 1 (scalar, any storage and head size), 3 (tensor cores with
    padding tiles skipped) or 5 (C5's: version 3 with ldmatrix fragments and dropout's words a Philox call per 4
    scores, its bits, run as REFBERT_ATTN_BWD16 says: 6 by default, or 5, 7 or 8); 3 and 5 need float16, hs = 64,
    16-byte aligned rows, otherwise version 1 runs, recorded in FELL_BACK."""
    A = _numba()
    q, k, v, mask4, H, out, m, linv, drop = cache
    C.dout("attention", dout, out.shape, out.dtype)
    B, T, Cc = q.shape
    hs = Cc // H
    if not (_c_ok(q, dout, dtypes=tuple(_DT)) and hs in (32, 64, 128) and m is not None
            and m.dtype == np.float32) or q.size == 0:
        return _fallback("attention", "C1", _why(q, dout) if not _c_ok(q, dout, dtypes=tuple(_DT))
                         else f"head size {hs} or the forward's cache", A.attention_backward, dout, cache)
    xp = C.xp_of(q)
    dt = _DT[q.dtype]
    dout = xp.ascontiguousarray(dout)
    m32 = xp.ascontiguousarray(mask4.astype(np.float32) if mask4.dtype != F32 else mask4)
    seed, stream, thresh, dscale = drop
    Dr = xp.empty((B, H, T), np.float32)
    kernel("attention_backward.cu", f"attn_bwd_D_{dt}", xp)(((B * H * T + 7) // 8,), (256,),
                                                              (dout, out, _i(B), _i(T), _i(H), _i(hs), Dr))
    dq, dk, dv = xp.empty(q.shape, q.dtype), xp.empty(k.shape, k.dtype), xp.empty(v.shape, v.dtype)
    args = (q, k, v, m32, *_mask_strides(mask4), _i(B), _i(T), _i(H), _f(1.0 / math.sqrt(hs)), seed, stream, thresh,
            _f(dscale), m, linv, dout, Dr)
    grid = ((T + 63) // 64, B * H)
    assert version in (1, 3, 5), version                      # (version 4: timed by the .cu's main alone)
    if version in (3, 5) and not (dt == "f16" and hs == 64 and _aligned(q, k, v, dout, dq, dk, dv)):
        _tc_fell_back("C2 backward" if version == 3 else "C5 backward",
                      f"dtype {q.dtype}, head size {hs} or rows not 16-byte aligned (tensor cores: float16, hs 64): "
                      f"the scalar backward ran", "the scalar backward")
        version = 1
    if version == 5:
        version = int(C.variant("attention C5", "REFBERT_ATTN_BWD16", ATTN_BWD16, ATTN_BWD16S))
    if version in (7, 8):                         # one pass: dq's shares added by atomics to a float32 buffer
        acc = xp.zeros(q.shape, np.float32)
        kernel("attention_backward.cu", _one_pass_kernel(version, mask4, thresh, dscale, T), xp)(
            grid, (128,), args + (dk, dv, acc))
        kernel("attention_backward.cu", "attn_bwd_dqcast_f16", xp)(((acc.size + 255) // 256,), (256,),
                                                                   (acc, dq, np.int64(acc.size)))
    elif version in (3, 5, 6):
        kernel("attention_backward.cu", f"attn_bwd_dkdv_v{version}_f16_hs64", xp)(grid, (128,), args + (dk, dv))
        kernel("attention_backward.cu", f"attn_bwd_dq_v{version}_f16_hs64", xp)(grid, (128,), args + (dq,))
    else:
        kernel("attention_backward.cu", f"attn_bwd_dkdv_v1_{dt}_hs{hs}", xp)(grid, (64,), args + (dk, dv))
        kernel("attention_backward.cu", f"attn_bwd_dq_v1_{dt}_hs{hs}", xp)(grid, (64,), args + (dq,))
    return dq, dk, dv


def _one_pass_kernel(version, mask4, thresh, dscale, T):
    """The one-pass backward's kernel: version 8's where it applies, under a mask constant along the queries (or
    none): its kernel without dropout (thresh 0 and dscale 1) or with dropout's words a Philox call per 4 scores
    (T % 4 == 0); version 7's otherwise (and for version 7), said once for each reason."""
    if version != 8:
        return "attn_bwd_fused_v7_f16_hs64"
    along = int(_mask_strides(mask4)[2]) != 0
    if not along and not thresh and float(dscale) == 1.0:
        return "attn_bwd_fused_v8_f16_hs64"
    if not along and T % 4 == 0:
        return "attn_bwd_fused_v8d_f16_hs64"
    _say_once("attention C5's backward version 8 (REFBERT_ATTN_BWD16=8)",
              "a mask that varies along the queries" if along else "dropout at T % 4 != 0", "version 7's kernel")
    return "attn_bwd_fused_v7_f16_hs64"


_SAID = set()


def _say_once(who, what, instead):
    """A variant that does not take a call's case, and what runs instead: a RuntimeWarning once per (who, what)."""
    if (who, what) not in _SAID:
        _SAID.add((who, what))
        warnings.warn(f"refbert cuda: {who} does not take {what}: {instead} runs", RuntimeWarning, stacklevel=4)


def attention_backward_c2(dout, cache):
    """C2's backward: attention_backward.cu version 3 (tensor cores, padding tiles skipped) for float16 at hs 64:
    S^T, dP^T, dV, dK per key tile and S, dP, dq per query tile as mma.sync GEMMs; P and dS rounded to float16 where
    a tensor core reads them."""
    return _attention_backward(dout, cache, 3)


# C5's backward kernels: "6" (the default: version 5's bits, each tile worked in four chunks and three blocks an SM
# asked of ptxas), "5" or "7" (one pass: version 5's dk, dv and dq's shares added by float atomics, so dq's bits may
# differ from run to run), attention_backward.cu. On the H100 (2026-11-28, the bench at B=8 H=12 hs=64, device ms
# of the backward): T=128 v5 0.066, v6 0.070, v7 0.054; T=512 0.293, 0.231, 0.225; T=2048 2.89, 2.16, 2.11. Version
# 6 is the fastest of the bitwise-reproducible ones where the time is (T >= 512), and within 3% of version 7 there.
# "8" (written 2026-11-28 without a GPU, not yet timed): version 7 with each score's work cut to its arithmetic,
# compiled per case (no dropout; dropout at T % 4 == 0), version 7's dk, dv bits (_one_pass_kernel: where it applies)
ATTN_BWD16 = C.variant_env("REFBERT_ATTN_BWD16")
ATTN_BWD16S = ("5", "6", "7", "8")
# C5's forward at 128 rows a block: "5" (the default) or "6" (written 2026-11-28 without a GPU, not yet timed:
# version 5 with each score's work cut, for the no-dropout case, where version 5 runs otherwise)
ATTN_FWD16 = C.variant_env("REFBERT_ATTN_FWD16")
ATTN_FWD16S = ("5", "6")


def attention_backward_c5(dout, cache):
    """C5's backward: attention_backward.cu version 6 (version 5's work and bits in 168 registers: version 3 with
    ldmatrix fragments, the mask read once per key row (dk, dv) or per (b, h) row (dq), and dropout's words a Philox
    call per 4 scores where T % 4 == 0: version 3's bits) for float16 at hs 64, or version 5 itself with
    REFBERT_ATTN_BWD16=5, or version 7 with REFBERT_ATTN_BWD16=7 (one pass, dq by atomics: not bitwise
    reproducible), or version 8 with REFBERT_ATTN_BWD16=8 (version 7's one pass with the per-score work cut: its
    dk, dv bits; version 7 runs where version 8 does not apply, see _one_pass_kernel).
    (Version 4, without the shared Philox calls, is timed beside them by the .cu's main.)"""
    return _attention_backward(dout, cache, 5)


def attention_probs(cache):
    return _numba().attention_probs(cache)


# ----------------------------------------------------------------------------------------------------------------
# attention (C3): the register-tiled fp32 flash of attention_f32.cu (hs = 64)

A3_FWD_SMEM = 3 * 64 * 68 * 4                 # q, k (then p), v tiles of 64 rows padded to 68 floats
A3_BWD_SMEM = (6 * 64 * 68 + 3 * 64) * 4      # four input tiles, two product tiles, three row vectors
A5_FWD_SMEM = (5 * 64 * 68 + 2 * 64) * 4      # q, two k (then p) and two v tiles, two mask rows (forward v5)
_SMEM_SET = set()


def kernel_smem(source, name, xp, nbytes):
    """kernel(source, name) with its dynamic shared memory limit raised to nbytes (once per process): a launch
    asking for more than 48 KiB fails on a GPU without it."""
    key = (id(xp), _device_id(xp), source, name)          # (the limit belongs to one device's loaded function)
    if key not in _SMEM_SET:
        module(source, xp).get_function(name).max_dynamic_shared_size_bytes = nbytes
        _SMEM_SET.add(key)
    return kernel(source, name, xp)


def _c3_ok(*arrays, hs):
    return _c_ok(*arrays) and hs == 64 and _aligned(*arrays)


def attention_forward_c3(q, k, v, n_heads, mask=None, dropout_p=0.0, rng=None, train=True):
    return _attention_forward_f32(q, k, v, n_heads, mask, dropout_p, rng, train, 3)


def attention_forward_c6(q, k, v, n_heads, mask=None, dropout_p=0.0, rng=None, train=True):
    """C6's forward: attention_f32.cu version 5, version 3's arithmetic and bits with Q, K and V by cp.async (K, V
    double-buffered: the next tile lands while this one computes) and the mask row of each key tile staged in
    shared memory (87 KB of dynamic shared memory)."""
    return _attention_forward_f32(q, k, v, n_heads, mask, dropout_p, rng, train, 5)


def _attention_forward_f32(q, k, v, n_heads, mask, dropout_p, rng, train, version):
    A = _numba()
    B, T, Cc, H = A._checks(q, k, v, n_heads, mask)
    hs = Cc // H
    xp = C.xp_of(q)
    if _c_ok(q, k, v):
        q, k, v = (xp.ascontiguousarray(a) for a in (q, k, v))
    if not _c3_ok(q, k, v, hs=hs) or q.size == 0:
        why = _why(q) if not _c_ok(q, k, v) else (f"head size {hs} (kernels for 64)" if hs != 64 else
                                                  "an empty input" if not q.size else "q, k or v not 16-byte aligned")
        return _fallback("attention", "C3" if version == 3 else "C6", why, attention_forward, q, k, v, n_heads, mask,
                         dropout_p, rng, train)
    mask4 = A._mask4(xp, mask, B, H, T, q.dtype)
    m32 = xp.ascontiguousarray(mask4)
    dropping, p_ok, (seed, stream, thresh, dscale) = A._drop(dropout_p, rng, train)
    out = xp.empty(q.shape, np.float32)
    m = xp.empty((B, H, T), np.float32)
    linv = xp.empty((B, H, T), np.float32)
    args = (q, k, v, m32, *_mask_strides(mask4), _i(B), _i(T), _i(H), _f(1.0 / math.sqrt(hs)), seed, stream, thresh,
            _f(dscale), out, m, linv)
    smem = A3_FWD_SMEM if version == 3 else A5_FWD_SMEM
    kernel_smem("attention_f32.cu", f"attn_fwd_v{version}_f32_hs64", xp, smem)(((T + 63) // 64, B * H), (128,), args,
                                                                             shared_mem=smem)
    if C.checks_on(m) and not (bool(xp.isfinite(m).all()) and bool(xp.isfinite(linv).all())):
        raise ValueError(A._SOFTMAX_ERROR)               # (a read back: only with REFBERT_CUDA_CHECKS=1)
    if not p_ok or (train and dropout_p > 0.0 and not isinstance(rng, A.DropoutRNG)):
        ops.dropout_forward(np.zeros(0, np.float32), dropout_p, rng, train)  # the oracle's dropout error
    if dropping:
        assert rng.next_stream() == (int(seed), int(stream))
    return out, (q, k, v, mask4, H, out, m, linv, (seed, stream, thresh, float(dscale)))


def attention_backward_c3(dout, cache):
    """C3's backward: attention_f32.cu version 3, D by a warp per row, then dk, dv by a block per key tile and dq by
    a block per query tile (each recomputes the tile's scores and dP: 7 tile products a tile pair)."""
    return _attention_backward_f32(dout, cache, 3)


def _parts_max():
    """Bytes of dq partials C4 may hold: REFBERT_C4_PARTS_MB (MiB, default 1024)."""
    text = os.environ.get("REFBERT_C4_PARTS_MB", "1024")
    try:
        return int(text) << 20
    except ValueError:
        raise ValueError(f"attention C4: REFBERT_C4_PARTS_MB expected a whole number of MiB, got {text!r}") from None


C4_PARTS_MAX = None      # (None: REFBERT_C4_PARTS_MB, read at each call; a number of bytes set here wins)


def attention_backward_c4(dout, cache):
    """C4's backward: attention_f32.cu version 4, one pass over the scores (5 tile products a tile pair): each key
    tile's block writes dk, dv and its share of dq for every query tile into partials (nkt, B H, T, 64) float32,
    which a second kernel sums in key-tile order (no atomics: the same bits every run). The partials take
    B H T^2 floats (100 MB at B=8 H=12 T=512, 805 MB at B=4 H=12 T=2048, 1.6 GB at B=8): above 1 GiB
    (REFBERT_C4_PARTS_MB, or C4_PARTS_MAX in bytes) the call runs version 7, version 6 a group of key tiles at a
    time with dq's sum carried over in dq (the same bits; as many tiles a group as fit), or, where not even one key
    tile's partials fit or under REFBERT_F32_BWD=4, version 3's dq kernel, saying so once per shape. The kernels are
    version 6's by default (F32_BWD: version 4's and version 3's dk, dv kernel with conflict-free shared stores in
    their transposing pass, the same bits), version 4's own with REFBERT_F32_BWD=4, version 8's with
    REFBERT_F32_BWD=8 (version 6's bits without dropout's pass, for calls without dropout under a mask constant along
    the queries; version 6's kernels otherwise, said once)."""
    return _attention_backward_f32(dout, cache, 4)


# C4's (and C6's) backward kernels: "6" (the default: attention_f32.cu version 6, version 4's bits with the
# transposing pass's shared stores free of bank conflicts, where ncu measured version 4's 4.5-way on the H100),
# "4" (version 4's own kernels, for A/B runs) or "8" (version 8: version 6's bits without dropout's pass between
# the scores and the products, under no dropout and a mask constant along the queries; version 6 elsewhere, said
# once); where the partials do not fit, version 3's dk, dv kernel or version 6's, the same way
F32_BWD = C.variant_env("REFBERT_F32_BWD")
F32_BWDS = ("4", "6", "8")


def _f32_lean(mask4, thresh, dscale):
    """"8" where C4's version 8 takes the call (no dropout: thresh 0 and dscale 1; a mask constant along the
    queries, or none), else "6", said once for each reason."""
    along = int(_mask_strides(mask4)[2]) != 0
    if not along and not thresh and float(dscale) == 1.0:
        return "8"
    _say_once("attention C4's backward version 8 (REFBERT_F32_BWD=8)",
              "a mask that varies along the queries" if along else "dropout", "version 6's backward")
    return "6"


def _attention_backward_f32(dout, cache, version):
    key = f"C{version}"
    q, k, v, mask4, H, out, m, linv, drop = cache
    C.dout("attention", dout, out.shape, out.dtype)
    B, T, Cc = q.shape
    hs = Cc // H
    xp = C.xp_of(q)
    if _c_ok(dout):
        dout = xp.ascontiguousarray(dout)
    if not (_c3_ok(q, k, v, dout, hs=hs) and m is not None and m.dtype == np.float32) or q.size == 0:
        return _fallback("attention", key, _why(q, dout) if not _c_ok(q, dout) else
                         f"head size {hs}, alignment or the forward's cache", attention_backward, dout, cache)
    m32 = xp.ascontiguousarray(mask4.astype(np.float32) if mask4.dtype != F32 else mask4)
    seed, stream, thresh, dscale = drop
    Dr = xp.empty((B, H, T), np.float32)
    kernel("attention_f32.cu", "attn_bwd_D_v3_f32", xp)(((B * H * T + 7) // 8,), (256,),
                                                        (dout, out, _i(B), _i(T), _i(H), Dr))
    dq, dk, dv = (xp.empty(q.shape, np.float32) for _ in range(3))
    scale = _f(1.0 / math.sqrt(hs))
    args = (q, k, v, m32, *_mask_strides(mask4), _i(B), _i(T), _i(H), scale, seed, stream, thresh, _f(dscale), m,
            linv, dout, Dr)
    nkt = (T + 63) // 64
    grid = (nkt, B * H)
    bwd = C.variant("attention C4", "REFBERT_F32_BWD", F32_BWD, F32_BWDS) if version == 4 else "3"
    if bwd == "8":
        bwd = _f32_lean(mask4, thresh, dscale)
    kv = "v6" if bwd in ("6", "8") else "v3"                          # (version 3, C3's own: its own kernels)
    if version == 4:
        nbytes, limit = nkt * B * H * T * 64 * 4, C4_PARTS_MAX if C4_PARTS_MAX is not None else _parts_max()
        sum_grid = (-(-(B * T * Cc // 4) // 256),)
        if nbytes <= limit and bwd != "8":
            parts = xp.empty((nkt, B * H, T, 64), np.float32)
            kernel_smem("attention_f32.cu", f"attn_bwd_fused_v{bwd}_f32_hs64", xp, A3_BWD_SMEM)(
                grid, (128,), args + (dk, dv, parts), shared_mem=A3_BWD_SMEM)
            kernel("attention_f32.cu", "attn_bwd_dqsum_v4_f32", xp)(
                sum_grid, (256,), (parts, _i(nkt), _i(B), _i(T), _i(H), scale, dq))
            return dq, dk, dv
        G = min(nkt, limit // (nbytes // nkt))          # key tiles whose partials fit at once
        if bwd in ("6", "8") and G >= 1:                # version 7: version 6 a group of G key tiles at a time;
            parts = xp.empty((G, B * H, T, 64), np.float32)   # version 8's kernel is version 7's, all nkt if they fit
            for kt0 in range(0, nkt, G):
                ng = min(G, nkt - kt0)
                kernel_smem("attention_f32.cu", f"attn_bwd_fused_v{7 if bwd == '6' else 8}_f32_hs64", xp,
                            A3_BWD_SMEM)(
                    (ng, B * H), (128,), args + (dk, dv, parts, _i(kt0)), shared_mem=A3_BWD_SMEM)
                kernel("attention_f32.cu", "attn_bwd_dqsum_v7_f32", xp)(
                    sum_grid, (256,), (parts, _i(ng), _i(kt0 == 0), _i(kt0 + ng >= nkt), _i(B), _i(T), _i(H), scale,
                                       dq))
            return dq, dk, dv
        if (B, H, T) not in _C4_SAID:                   # (once per shape)
            _C4_SAID.add((B, H, T))
            warnings.warn(f"refbert cuda: attention C4's dq partials would take {nbytes >> 20} MiB (B={B} H={H} T={T}),"
                          f" over its limit of {limit >> 20} MiB (REFBERT_C4_PARTS_MB), "
                          f"{'version 4 has no groups' if G >= 1 else 'one key tile over it'}: version 3's dq kernel "
                          "runs instead", RuntimeWarning, stacklevel=3)
    kernel_smem("attention_f32.cu", f"attn_bwd_dkdv_{kv}_f32_hs64", xp, A3_BWD_SMEM)(grid, (128,), args + (dk, dv),
                                                                                  shared_mem=A3_BWD_SMEM)
    kernel_smem("attention_f32.cu", "attn_bwd_dq_v3_f32_hs64", xp, A3_BWD_SMEM)(grid, (128,), args + (dq,),
                                                                               shared_mem=A3_BWD_SMEM)
    return dq, dk, dv


_C4_SAID = set()


# ----------------------------------------------------------------------------------------------------------------
# softmax (C2)

def softmax_forward(x, scale=1.0, mask=None):
    S = C.sibling("softmax")
    scale = V.number("softmax", "scale", scale)
    if not (_c_ok(x) and x.ndim >= 1 and x.size and (mask is None or _c_ok(mask))):
        return _fallback("softmax", "C2", _why(x, mask) if not _c_ok(x) or (mask is not None and not _c_ok(mask))
                         else "an empty input", S.softmax_forward, x, scale, mask)
    xp = C.xp_of(x)
    V.broadcasts_to("softmax", "mask", C.stub(mask), x.shape) if mask is not None else None
    T = x.shape[-1]
    x2 = xp.ascontiguousarray(x).reshape(-1, T)
    R = x2.shape[0]
    if mask is None:
        m2, mrow = xp.zeros((1, T), np.float32), xp.zeros(R, np.int64)
    else:
        mk = mask.reshape((1,) * (x.ndim - mask.ndim) + mask.shape)
        m2 = xp.ascontiguousarray(xp.broadcast_to(mk, mk.shape[:-1] + (T,))).reshape(-1, T)
        mrow = xp.ascontiguousarray(xp.broadcast_to(xp.arange(m2.shape[0]).reshape(mk.shape[:-1]),
                                                    x.shape[:-1]).reshape(-1), np.int64)
    p = xp.empty(x.shape, np.float32)
    bad = xp.zeros(R, np.int32)
    kernel("softmax.cu", "softmax_fwd_v2", xp)(((R + 7) // 8,), (256,),
                                              (x2, _f(scale), m2, mrow, _i(R), _i(T), p, bad))
    if C.checks_on(bad) and int(bad.max()):
        raise ValueError("softmax: argument 'x' (with 'mask') expected every row to have a finite maximum, got a row "
                         "that is entirely -inf, or a NaN/+inf score")
    return p, ops.SoftmaxCache(p, scale)


def softmax_backward(dout, cache):
    S = C.sibling("softmax")
    p, scale = cache
    if not (_c_ok(p, dout) and p.size):
        return _fallback("softmax", "C2", _why(p, dout), S.softmax_backward, dout, cache)
    xp = C.xp_of(p)
    C.dout("softmax", dout, p.shape, p.dtype)
    T = p.shape[-1]
    R = p.size // T
    dx = xp.empty(p.shape, np.float32)
    kernel("softmax.cu", "softmax_bwd_v2", xp)(((R + 7) // 8,), (256,),
                                              (xp.ascontiguousarray(dout), p, _f(scale), _i(R), _i(T), dx))
    return dx


# ----------------------------------------------------------------------------------------------------------------
# layernorm (C1: plain; C2: plain, residual, dropout + residual)

class LayerNormCacheC(NamedTuple):
    """The CUDA C layernorm's cache (float32 device arrays; mean, rstd of shape x.shape[:-1] + (1,)). Its own type:
    a forward that fell back to Numba leaves Numba's cache, and the backward must tell the two apart."""
    x: Any
    w: Any
    mean: Any
    rstd: Any


def layernorm_forward(x, w, b, eps=1e-12):
    L = C.sibling("layernorm")
    if not (_c_ok(x, w, b) and x.ndim >= 1 and x.size):
        return _fallback("layernorm", "C1", _why(x, w, b) if not _c_ok(x, w, b) else "an empty input",
                         L.layernorm_forward, x, w, b, eps)
    xp = C.xp_of(x)
    L._check_ln(x, w, b, eps)                          # (C2's and the Numba versions' checks: eps among them)
    Cc = x.shape[-1]
    x = xp.ascontiguousarray(x)
    R = x.size // Cc
    out = xp.empty(x.shape, np.float32)
    mean = xp.empty(x.shape[:-1] + (1,), np.float32)
    rstd = xp.empty(x.shape[:-1] + (1,), np.float32)
    kernel("layernorm.cu", "layernorm_fwd_v1", xp)(((R + 7) // 8,), (256,),
                                                   (x, xp.ascontiguousarray(w), xp.ascontiguousarray(b), _f(eps),
                                                    _i(R), _i(Cc), out, mean, rstd))
    return out, LayerNormCacheC(x, w, mean, rstd)


def layernorm_backward(dout, cache):
    L = C.sibling("layernorm")
    if isinstance(cache, LayerNormCacheC2):
        return layernorm_backward_c2(dout, cache)
    if not isinstance(cache, LayerNormCacheC):          # the forward fell back to Numba (not float32 device arrays)
        return L.layernorm_backward(dout, cache)
    x, w, mean, rstd = cache
    xp = C.xp_of(x)
    C.dout("layernorm", dout, x.shape, x.dtype)
    Cc = x.shape[-1]
    R = x.size // Cc
    per, chunks = C.chunks(R)
    dout = xp.ascontiguousarray(dout)
    w = xp.ascontiguousarray(w)
    dx = xp.empty(x.shape, np.float32)
    kernel("layernorm.cu", "layernorm_bwd_dx_v1", xp)(((R + 7) // 8,), (256,),
                                                      (dout, x, w, mean, rstd, _i(R), _i(Cc), dx))
    pw, pb = xp.empty((chunks, Cc), np.float32), xp.empty((chunks, Cc), np.float32)
    kernel("layernorm.cu", "layernorm_bwd_dwdb_partial", xp)(((Cc + 255) // 256, chunks), (256,),
                                                             (dout, x, mean, rstd, _i(R), _i(Cc), _i(per), pw, pb))
    dw, db = xp.empty(Cc, np.float32), xp.empty(Cc, np.float32)
    kernel("layernorm.cu", "column_sum2", xp)(((Cc + 255) // 256,), (256,), (pw, pb, _i(chunks), _i(Cc), dw, db))
    return dx, dw, db


class LayerNormCacheC2(NamedTuple):
    """Version C2's cache: kind ("ln", "res", "drop"), the rows of x and a (float32 device arrays, or in mixed
    precision their 16-bit storage, uint16; a None for ln),
    the dropout call (seed, stream, thresh, scale) or None, w, mean and rstd (R,), and the shape of x. s is
    recomputed by the backward (and the keep factors regenerated), never stored."""
    kind: str
    x2: Any
    a2: Any
    drop: Any
    w: Any
    mean: Any
    rstd: Any
    shape: tuple
    rk: int = -1        # mixed precision's rounding inside the kernels: -1 none, 0 bfloat16, 1 float16 (csrc rnd)


def _null(xp, dtype):
    """A zero-size device array of dtype, made once per array module: its pointer is null (CuPy's and the
    emulator's alike)."""
    key = (id(xp), dtype)                       # (dtype as given: np.uint16 and dtype("uint16") each get one)
    a = _NULLS.get(key)
    if a is None:
        a = _NULLS[key] = xp.empty(0, dtype)
    return a


_NULLS = {}


def null16(xp):
    """A kernel's "no twin" argument (a null uint16 pointer): the kernels write a twin only through a non-null
    pointer (common.cuh put16), and read an input's 16-bit storage only through one (ld_in)."""
    return _null(xp, np.uint16)


def null32(xp):
    """A float32 kernel argument the kernel does not read (its input comes as 16-bit storage instead): null."""
    return _null(xp, np.float32)


def _in16(a, xp):
    """(float32 argument, 16-bit argument) of a kernel input a forward kept either as float32 or, in mixed
    precision, as its 16-bit storage (uint16: kernels/cuda/mixed.py "kept in 16 bits"); the other one null."""
    if a is not None and a.dtype == np.uint16:
        return null32(xp), a
    return a, null16(xp)


def _f32(a):
    """The dtype a kept input stands for: float32 for 16-bit storage, else its own."""
    return np.dtype(np.float32) if a.dtype == np.uint16 else a.dtype


def _twin16(o16, like, xp):
    """o16 for a kernel: a uint16 array of like's size (the twin, kernels/cuda/mixed.py), or null16."""
    if o16 is None:
        return null16(xp)
    if o16.dtype != np.uint16 or o16.size != like.size or not o16.flags.c_contiguous:
        raise ValueError(f"twin: expected a contiguous uint16 array of {like.size} elements, got {o16.dtype} "
                         f"{o16.shape}")
    return o16


def _ln2_forward(kind, x, a, w, b, eps, drop, rk=-1, version=2, o16=None, k16=(None, None)):
    """Version 2's forward (layernorm.cu v2), or version 3's (v3: the row in registers, nv = ceil(C / 128) float4 a
    lane rounded up to even: the kernel has bodies for 2, 4, 6, 8) where it applies: the float4 path and C <= 1024.
    Either leaves version 2's cache (the backward is version 2's). o16 (rk >= 0): out's twin, written beside it;
    k16 (rk >= 0): uint16 buffers (or None) the kernel writes the 16-bit storage of R(x), R(a) into (what the
    backward may read instead of x, a: the caller puts them in the cache)."""
    xp = C.xp_of(x)
    Cc = x.shape[-1]
    x2 = xp.ascontiguousarray(x).reshape(-1, Cc)
    a2 = None if a is None else xp.ascontiguousarray(a).reshape(-1, Cc)
    w, b = xp.ascontiguousarray(w), xp.ascontiguousarray(b)
    R = x2.shape[0]
    out = xp.empty(x.shape, np.float32)
    mean, rstd = xp.empty(R, np.float32), xp.empty(R, np.float32)
    seed, stream, thr, scale = drop or _NODROP
    if R and Cc:
        out2 = out.reshape(R, Cc)
        vec = Cc % 4 == 0 and _aligned(x2, a2, w, b, out2)
        v3 = version == 3 and vec and Cc <= 1024
        kernel("layernorm.cu", f"layernorm_fwd_v{3 if v3 else 2}_{kind}", xp)(
            ((R + 7) // 8,), (256,), (x2, x2 if a2 is None else a2, seed, stream, thr, _f(scale), _i(rk), w, b,
                                      _f(eps), _i(R), _i(Cc), _i(2 * -(-Cc // 256) if v3 else vec), out2, mean, rstd,
                                      _twin16(o16, out2, xp), _twin16(k16[0], out2, xp), _twin16(k16[1], out2, xp)))
    return out, LayerNormCacheC2(kind, x2, a2, drop, w, mean, rstd, x.shape, rk)


# layernorm's dw, db partials on the float4 path (A/B runs): "3" (the default), "2" (version 2's: a column a thread),
# "4" / "5" (version 3's bits with 4 / 8 rows' loads in flight: layernorm.cu; the default once a GPU times them)
LN_DWDB = C.variant_env("REFBERT_LN_DWDB")
LN_DWDBS = ("2", "3", "4", "5")


# layernorm.cu version 6's grid (C4's backward): at most this many blocks of 8 warps, each block one partial row
LN6_BLOCKS = 256


def _ln2_backward(dout, cache, o16=None, fused=False):
    """(dx, da or None, dw, db) of version C2. o16 (rk >= 0): the twin of da (kind drop), else of dx. The cache's x2,
    a2 may be 16-bit storage (uint16, mixed precision): the kernels read them so. fused (C4; mixed precision under
    REFBERT_MIXED_LN_BWD=6): layernorm.cu version 6, dx (da, the twin) and the dw, db partials in one kernel, then
    column_sum2_v6, where it applies (the float4 path, C <= 1024); elsewhere version 2's kernels, as without it."""
    kind, x2, a2, drop, w, mean, rstd, shape, rk = cache
    C.dout("layernorm", dout, shape, _f32(x2))
    xp = C.xp_of(x2)
    R, Cc = x2.shape
    dx = xp.empty(shape, np.float32)
    da = xp.empty(shape, np.float32) if kind == "drop" else None
    if R == 0 or Cc == 0:
        return dx, da, xp.zeros(Cc, np.float32), xp.zeros(Cc, np.float32)
    seed, stream, thr, scale = drop or _NODROP
    d2 = xp.ascontiguousarray(dout).reshape(R, Cc)
    dx2 = dx.reshape(R, Cc)
    da2 = dx2 if da is None else da.reshape(R, Cc)
    vec = Cc % 4 == 0 and _aligned(d2, x2, a2, w, dx2, da2)
    (x32, x16), (a32, a16) = _in16(x2, xp), _in16(x2 if a2 is None else a2, xp)
    if fused and vec and Cc <= 1024:
        G = min(-(-R // 8), LN6_BLOCKS)
        pw, pb = xp.empty((G, Cc), np.float32), xp.empty((G, Cc), np.float32)
        nv = 2 if Cc <= 256 else 6 if Cc <= 768 else 8                # (the kernels' float4 accumulators a lane)
        kernel("layernorm.cu", f"layernorm_bwd_fused_v6_{kind}_nv{nv}", xp)(
            (G,), (256,), (d2, x32, a32, seed, stream, thr, _f(scale), _i(rk), w, mean, rstd, _i(R), _i(Cc), dx2, da2,
                           _twin16(o16, dx2, xp), x16, a16, pw, pb))
        dw, db = xp.empty(Cc, np.float32), xp.empty(Cc, np.float32)
        kernel("layernorm.cu", "column_sum2_v6", xp)((-(-Cc // 32),), (256,), (pw, pb, _i(G), _i(Cc), dw, db))
        return dx, da, dw, db
    kernel("layernorm.cu", f"layernorm_bwd_dx_v2_{kind}", xp)(
        ((R + 7) // 8,), (256,), (d2, x32, a32, seed, stream, thr, _f(scale), _i(rk), w, mean, rstd, _i(R), _i(Cc),
                                  _i(vec), dx2, da2, _twin16(o16, dx2, xp), x16, a16))
    per, chunks = C.chunks(R)
    pw, pb = xp.empty((chunks, Cc), np.float32), xp.empty((chunks, Cc), np.float32)
    args = (d2, x32, a32, seed, stream, thr, _f(scale), _i(rk), mean, rstd, _i(R), _i(Cc), _i(per), pw, pb, x16, a16)
    C.variant("layernorm", "REFBERT_LN_DWDB", LN_DWDB, LN_DWDBS)
    if vec and LN_DWDB != "2":                       # versions 3-5's partials: four columns a thread (the float4 path)
        kernel("layernorm.cu", f"layernorm_bwd_dwdb_partial_v{LN_DWDB}_{kind}", xp)(((Cc // 4 + 63) // 64, chunks),
                                                                                   (64,), args)
    else:
        kernel("layernorm.cu", f"layernorm_bwd_dwdb_partial_v2_{kind}", xp)(((Cc + 255) // 256, chunks), (256,), args)
    dw, db = xp.empty(Cc, np.float32), xp.empty(Cc, np.float32)
    kernel("layernorm.cu", "column_sum2", xp)(((Cc + 255) // 256,), (256,), (pw, pb, _i(chunks), _i(Cc), dw, db))
    return dx, da, dw, db


def layernorm_forward_c2(x, w, b, eps=1e-12):
    return _layernorm_c(2, x, w, b, eps)


def layernorm_forward_c3(x, w, b, eps=1e-12):
    """Version 3: version 2 with the forward's row in registers (layernorm.cu v3); version 2's backward."""
    return _layernorm_c(3, x, w, b, eps)


def _layernorm_c(version, x, w, b, eps):
    L = C.sibling("layernorm")
    if not (_c_ok(x, w, b) and x.ndim >= 1):
        return _fallback("layernorm", f"C{version}", _why(x, w, b), L.layernorm_forward_v2, x, w, b, eps)
    L._check_ln(x, w, b, eps)
    return _ln2_forward("ln", x, None, w, b, eps, None, version=version)


def layernorm_backward_c2(dout, cache):
    L = C.sibling("layernorm")
    if not isinstance(cache, LayerNormCacheC2):
        return L.layernorm_backward(dout, cache)
    dx, _, dw, db = _ln2_backward(dout, cache)
    return dx, dw, db


def layernorm_backward_c4(dout, cache):
    """C4's backward (C3's forward): dx and the dw, db partials in one pass (layernorm.cu version 6; _ln2_backward)."""
    L = C.sibling("layernorm")
    if not isinstance(cache, LayerNormCacheC2):
        return L.layernorm_backward(dout, cache)
    dx, _, dw, db = _ln2_backward(dout, cache, fused=True)
    return dx, dw, db


def residual_layernorm_forward_c2(x, a, w, b, eps=1e-12):
    return _residual_layernorm_c(2, x, a, w, b, eps)


def residual_layernorm_forward_c3(x, a, w, b, eps=1e-12):
    return _residual_layernorm_c(3, x, a, w, b, eps)


def _residual_layernorm_c(version, x, a, w, b, eps):
    L = C.sibling("layernorm")
    if not (_c_ok(x, a, w, b) and x.ndim >= 1):
        return _fallback("residual_layernorm", f"C{version}", _why(x, a, w, b), L.residual_layernorm_forward_v2,
                         x, a, w, b, eps)
    C.floats("residual_layernorm", x=x, a=a)
    V.shape("residual_layernorm", "a", C.stub(a), x.shape, "(same as x)")
    L._check_ln(x, w, b, eps)
    return _ln2_forward("res", x, a, w, b, eps, None, version=version)


def residual_layernorm_backward_c2(dout, cache):
    L = C.sibling("layernorm")
    if not isinstance(cache, LayerNormCacheC2):
        return L.residual_layernorm_backward(dout, cache)
    ds, _, dw, db = _ln2_backward(dout, cache)
    return ds, ds, dw, db                            # the sum copies ds to both inputs: one array, as the oracle


def residual_layernorm_backward_c4(dout, cache):
    """C4's backward: layernorm.cu version 6 (residual_layernorm_backward_c2's, dx and the partials in one pass)."""
    L = C.sibling("layernorm")
    if not isinstance(cache, LayerNormCacheC2):
        return L.residual_layernorm_backward(dout, cache)
    ds, _, dw, db = _ln2_backward(dout, cache, fused=True)
    return ds, ds, dw, db


def dropout_residual_layernorm_forward_c2(x, a, w, b, eps=1e-12, p=0.0, rng=None, train=True):
    return _dropout_residual_layernorm_c(2, x, a, w, b, eps, p, rng, train)


def dropout_residual_layernorm_forward_c3(x, a, w, b, eps=1e-12, p=0.0, rng=None, train=True):
    return _dropout_residual_layernorm_c(3, x, a, w, b, eps, p, rng, train)


def _dropout_residual_layernorm_c(version, x, a, w, b, eps, p, rng, train):
    L = C.sibling("layernorm")
    draw = C.sibling("dropout").draw
    if not (_c_ok(x, a, w, b) and x.ndim >= 1):
        return _fallback("dropout_residual_layernorm", f"C{version}", _why(x, a, w, b),
                         L.dropout_residual_layernorm_forward_v2, x, a, w, b, eps, p, rng, train)
    C.floats("dropout_residual_layernorm", x=x, a=a)
    V.shape("dropout_residual_layernorm", "a", C.stub(a), x.shape, "(same as x)")
    C.floats("dropout", x=a)
    drop = draw(rng, p, train)                       # the oracle draws the stream before layernorm's checks
    L._check_ln(x, w, b, eps)
    return _ln2_forward("res" if drop is None else "drop", x, a, w, b, eps, drop, version=version)


def dropout_residual_layernorm_backward_c2(dout, cache):
    L = C.sibling("layernorm")
    if not isinstance(cache, LayerNormCacheC2):
        return L.dropout_residual_layernorm_backward(dout, cache)
    ds, da, dw, db = _ln2_backward(dout, cache)
    return ds, (ds.copy() if da is None else da), dw, db   # eval / p = 0: da is a copy of ds, as dropout_backward


def dropout_residual_layernorm_backward_c4(dout, cache):
    """C4's backward: layernorm.cu version 6 (dropout_residual_layernorm_backward_c2's, one pass)."""
    L = C.sibling("layernorm")
    if not isinstance(cache, LayerNormCacheC2):
        return L.dropout_residual_layernorm_backward(dout, cache)
    ds, da, dw, db = _ln2_backward(dout, cache, fused=True)
    return ds, (ds.copy() if da is None else da), dw, db


# ----------------------------------------------------------------------------------------------------------------
# dropout (C1)

def _dropout_apply(x, drop):
    xp = C.xp_of(x)
    seed, stream, thr, scale = drop
    x = xp.ascontiguousarray(x)
    out = xp.empty(x.shape, np.float32)
    n = x.size
    if n:
        blocks = -(-n // 4)
        kernel("dropout.cu", "dropout_v1", xp)(((blocks + 255) // 256,), (256,),
                                               (x.reshape(-1), np.int64(n), seed, stream, thr, _f(scale),
                                                _i(_aligned(x, out)), out.reshape(-1)))
    return out


def dropout_forward_c1(x, p, rng=None, train=True):
    D = C.sibling("dropout")
    if not _c_ok(x):
        return _fallback("dropout", "C1", _why(x), D.dropout_forward_v2, x, p, rng, train)
    C.floats("dropout", x=x)
    drop = D.draw(rng, p, train)
    if drop is None:
        return x, ops.DropoutCache(None, 1.0, x.shape, x.dtype)
    return _dropout_apply(x, drop), ops.DropoutCache(("C1", drop), drop[3], x.shape, x.dtype)


def dropout_backward_c1(dout, cache):
    D = C.sibling("dropout")
    keep, scale, shape, dtype = cache
    if not (isinstance(keep, tuple) and keep[0] == "C1"):
        return D.dropout_backward_v1(dout, cache)
    C.dout("dropout", dout, shape, dtype)
    return _dropout_apply(dout, keep[1])


# ----------------------------------------------------------------------------------------------------------------
# gelu, bias + gelu (C1)

class GeluCacheC(NamedTuple):
    """x as rows (R, I) (float32, or in mixed precision its 16-bit storage, uint16), the bias (None: gelu),
    approximate, the shape of x."""
    x2: Any
    b: Any
    approximate: str
    shape: tuple
    rk: int = -1        # mixed precision's rounding inside the kernels (LayerNormCacheC2.rk)


def _gelu_name(approximate):
    return "tanh" if approximate == "tanh" else "erf"


GELU_FWD3_BLOCKS = 8     # gelu.cu version 3's blocks of 256 an SM: its __launch_bounds__(256, 8), all resident at once


def _gelu_run(x, b, approximate, rk=-1, o16=None, k16=None, fwd=1):
    """The forward (gelu.cu v1, or fwd=3: version 3, a grid of at most GELU_FWD3_BLOCKS blocks an SM striding over
    the float4 groups with the next loads in flight; version 1's bits, and version 1 where the rows are not float4
    groups) and its cache. o16 (rk >= 0): out's twin; k16 (rk >= 0): a uint16 buffer the kernel writes the 16-bit
    storage of R(x) into (what the backward may read instead of x: the caller caches it)."""
    xp = C.xp_of(x)
    I = x.shape[-1] if b is not None else max(x.size, 1)
    x2 = xp.ascontiguousarray(x).reshape(-1, I)
    out = xp.empty(x.shape, np.float32)
    n = x.size
    if n:
        bb = x2 if b is None else xp.ascontiguousarray(b)
        out2 = out.reshape(x2.shape)
        vec = I % 4 == 0 and _aligned(x2, bb, out2)
        twins = (_twin16(o16, out2, xp), _twin16(k16, out2, xp))
        if fwd == 3 and vec:
            groups = n // 4
            grid = min((groups + 255) // 256, GELU_FWD3_BLOCKS * _sm_count(xp))
            kernel("gelu.cu", f"gelu_fwd_v3_{_gelu_name(approximate)}", xp)(
                (grid,), (256,), (x2, bb, _i(b is not None), np.int64(n), _i(I), _i(rk), out2, *twins))
        else:
            threads = n // 4 if vec else n
            kernel("gelu.cu", f"gelu_fwd_v1_{_gelu_name(approximate)}", xp)(
                ((threads + 255) // 256,), (256,), (x2, bb, _i(b is not None), np.int64(n), _i(I), _i(vec), _i(rk),
                                                    out2, *twins))
    return out, GeluCacheC(x2, b, approximate, x.shape, rk)


def _gelu_forward(version, fwd, x, approximate):
    G = C.sibling("gelu")
    if not _c_ok(x):
        return _fallback("gelu", version, _why(x), G.gelu_forward_v2, x, approximate)
    C.floats("gelu", x=x)
    G._check_approximate(approximate)
    return _gelu_run(x, None, approximate, fwd=fwd)


def gelu_forward_c1(x, approximate="none"):
    return _gelu_forward("C1", 1, x, approximate)


def gelu_forward_c2(x, approximate="none"):
    """C2: gelu_forward_c1 with gelu.cu version 3's forward (C1's bits); C1's backward."""
    return _gelu_forward("C2", 3, x, approximate)


def gelu_backward_c1(dout, cache):
    G = C.sibling("gelu")
    if not isinstance(cache, GeluCacheC):
        return G.gelu_backward_v2(dout, cache)
    x2, _, approximate, shape, rk = cache
    C.dout("gelu", dout, shape, _f32(x2))
    xp = C.xp_of(x2)
    dx = xp.empty(shape, np.float32)
    n = x2.size
    if n:
        d2 = xp.ascontiguousarray(dout).reshape(x2.shape)
        dx2 = dx.reshape(x2.shape)
        I = x2.shape[1]
        vec = I % 4 == 0 and _aligned(d2, x2, dx2)
        threads = n // 4 if vec else n
        x32, x16 = _in16(x2, xp)
        kernel("gelu.cu", f"gelu_bwd_v1_{_gelu_name(approximate)}", xp)(
            ((threads + 255) // 256,), (256,), (d2, x32, null32(xp), _i(0), np.int64(n), _i(I), _i(vec), _i(rk), dx2,
                                                x16))
    return dx


def _bias_gelu_forward(version, fwd, x, b, approximate):
    G = C.sibling("gelu")
    if not (_c_ok(x, b) and x.ndim >= 1):
        return _fallback("bias_gelu", version, _why(x, b), G.bias_gelu_forward_v2, x, b, approximate)
    C.floats("bias_gelu", x=x, b=b)
    V.min_ndim("bias_gelu", "x", x, 1, "(..., I)")
    V.shape("bias_gelu", "b", C.stub(b), (x.shape[-1],), "(I,)")
    G._check_approximate(approximate)
    return _gelu_run(x, b, approximate, fwd=fwd)


def bias_gelu_forward_c1(x, b, approximate="none"):
    return _bias_gelu_forward("C1", 1, x, b, approximate)


def bias_gelu_forward_c3(x, b, approximate="none"):
    """C3: bias_gelu_forward_c1 with gelu.cu version 3's forward (C1's bits); C1's backward."""
    return _bias_gelu_forward("C3", 3, x, b, approximate)


def bias_gelu_backward_c1(dout, cache, o16=None, version=1):
    """dx, db (gelu.cu's bias + GELU backward, then colsum_final_v1 over the chunks' partials). version 2: a thread
    per (chunk, 4 columns) (float4, rows 4 at a time; version 1's bits) where I % 4 == 0 and every pointer is
    aligned, else version 1's kernel (the same bits: nothing slower than C1 runs)."""
    G = C.sibling("gelu")
    if not isinstance(cache, GeluCacheC):
        return G.bias_gelu_backward_v2(dout, cache)
    x2, b, approximate, shape, rk = cache
    C.dout("gelu", dout, shape, _f32(x2))            # the oracle's bias_gelu backward checks as gelu_backward
    xp = C.xp_of(x2)
    R, I = x2.shape
    dx = xp.empty(shape, np.float32)
    if x2.size == 0:
        return dx, xp.zeros(I, np.float32)
    per, chunks = C.chunks(R)
    parts = xp.empty((chunks, I), np.float32)
    db = xp.empty(I, np.float32)
    x32, x16 = _in16(x2, xp)
    d2, t16 = xp.ascontiguousarray(dout).reshape(R, I), _twin16(o16, dx, xp)
    args = (d2, x32, b, _i(R), _i(I), _i(per), _i(rk), dx.reshape(R, I), parts, t16, x16)
    if version == 2 and I % 4 == 0 and _aligned(d2, x32, b, dx, parts) and x16.data.ptr % 8 == t16.data.ptr % 8 == 0:
        kernel("gelu.cu", f"bias_gelu_bwd_v2_{_gelu_name(approximate)}", xp)(((I // 4 + 63) // 64, chunks), (64,), args)
    else:
        kernel("gelu.cu", f"bias_gelu_bwd_v1_{_gelu_name(approximate)}", xp)(((I + 255) // 256, chunks), (256,), args)
    kernel("gelu.cu", "colsum_final_v1", xp)(((I + 255) // 256,), (256,), (parts, _i(chunks), _i(I), db))
    return dx, db


def bias_gelu_backward_c2(dout, cache, o16=None):
    """C2: bias_gelu_backward_c1 with gelu.cu version 2's kernel (C1's bits)."""
    return bias_gelu_backward_c1(dout, cache, o16, version=2)


# ----------------------------------------------------------------------------------------------------------------
# cross-entropy (C1): no host round trip

class CrossEntropyCacheC(NamedTuple):
    """The logits as rows (N, V), the labels (N,) int64 on the device, ignore_index, the per-row m and log-sum s,
    the kept-row count (1,) float32 on the device, and the logits' shape."""
    z2: Any
    y: Any
    ignore: int
    m: Any
    s: Any
    count: Any
    shape: tuple


def cross_entropy_forward_c1(logits, labels, ignore_index=-100):
    return _ce_forward("C1", logits, labels, ignore_index)


def cross_entropy_forward_c2(logits, labels, ignore_index=-100, splits=None):
    """Version 2: each row split across `splits` blocks (cross_entropy.cu v2) when the rows alone would not fill
    the GPU; splits None: 4 blocks per SM over the rows, at most one per 1024 columns (1: version 1's kernel)."""
    return _ce_forward("C2", logits, labels, ignore_index, splits)


def cross_entropy_forward_c3(logits, labels, ignore_index=-100, splits=None):
    """Version 3: version 2's blocks and merges in one launch (cross_entropy.cu v3: the last block to finish merges
    the rows' pairs and sums the loss, in version 2's order: its bits); splits as version 2's (1 included)."""
    return _ce_forward("C3", logits, labels, ignore_index, splits)


_CE_DONE = {}


def _ce_done(xp):
    """Version 3's ticket counter: one zeroed uint32 per array module and device, made at its first use; every
    call's last block puts it back to 0. (Two calls in flight at once on two streams would share it: the model
    runs one stream.)"""
    key = (id(xp), _device_id(xp))                    # (None: an array module without devices)
    done = _CE_DONE.get(key)
    if done is None:
        done = _CE_DONE[key] = xp.zeros(1, np.uint32)
    return done


def _device_id(xp):
    """The current device's ordinal (None where the array module has none to ask)."""
    try:
        return int(xp.cuda.runtime.getDevice())       # (a direct call: this is on the launch path)
    except Exception:
        return None


def _sm_count(xp):
    """Streaming multiprocessors of the current device (the emulator says 1): asked once per device, since a
    process can switch devices between calls (`with cupy.cuda.Device(1):`)."""
    return _sm_count_of(xp, _device_id(xp))


@functools.lru_cache(maxsize=None)
def _sm_count_of(xp, device):
    if device is None:
        return 1
    try:
        return int(xp.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"])
    except Exception:
        return 1


def _ce_forward(version, logits, labels, ignore_index, splits=None):
    X = C.sibling("cross_entropy")
    if not _c_ok(logits):
        return _fallback("cross_entropy", version, _why(logits), X.cross_entropy_forward_v2, logits, labels,
                         ignore_index)
    C.floats("cross_entropy", logits=logits)
    V.min_ndim("cross_entropy", "logits", logits, 1, "(..., V)")
    xp = C.xp_of(logits)
    lead, Vn = logits.shape[:-1], logits.shape[-1]
    if not C.is_array(labels) or labels.shape != lead or np.dtype(labels.dtype).kind not in "iu":
        got = C.stub(labels) if C.is_array(labels) else labels
        raise ValueError(f"cross_entropy: argument 'labels' expected an integer array of shape {lead} "
                         f"(logits.shape[:-1]), got {V._desc(got)}")
    if C.checks_on(labels):                          # host labels: the oracle's range check, free before they move
        V.ids("cross_entropy", "labels", C.to_host(labels), Vn, allow=ignore_index)
    if C.on_device(labels):
        y = xp.ascontiguousarray(labels.reshape(-1))
    else:                                            # one copy, through the backend's pinned buffer on a GPU
        y = (H2D or xp.asarray)(np.ascontiguousarray(labels.reshape(-1), np.int64))
    if y.dtype != np.int64:
        y = y.astype(np.int64)
    z2 = xp.ascontiguousarray(logits).reshape(-1, Vn)
    N = z2.shape[0]
    m, s, term = (xp.empty(N, np.float32) for _ in range(3))
    kept = xp.empty(N, np.int32)
    loss, count = xp.empty((), np.float32), xp.empty(1, np.float32)
    if N:
        vec = Vn % 4 == 0 and _aligned(z2)
        if version in ("C2", "C3") and splits is None:
            splits = min(max(1, -(-4 * _sm_count(xp) // N)), max(1, Vn // 1024))
        cw = -(-Vn // (splits or 1))
        cw = -(-cw // 4) * 4                          # whole float4s per chunk
        sp = -(-Vn // cw) if Vn else 1
        one = version == "C3" and N * sp < 2 ** 32    # one launch (the ticket counter is 32 bits)
        if one:
            pm, ps = xp.empty((N, sp), np.float32), xp.empty((N, sp), np.float32)
            kernel("cross_entropy.cu", "ce_fwd_v3", xp)(
                (N, sp), (256,), (z2, y, _i(N), _i(Vn), np.int64(ignore_index), _i(cw), _i(vec), pm, ps, m, s, term,
                                  kept, loss.reshape(1), count, _ce_done(xp)))
        elif version == "C1" or sp <= 1:
            kernel("cross_entropy.cu", "ce_fwd_v1", xp)((N,), (256,), (z2, y, _i(N), _i(Vn), np.int64(ignore_index),
                                                                       _i(vec), m, s, term, kept))
        else:
            pm, ps = xp.empty((N, sp), np.float32), xp.empty((N, sp), np.float32)
            kernel("cross_entropy.cu", "ce_part_v2", xp)((N, sp), (256,), (z2, y, _i(Vn), np.int64(ignore_index),
                                                                          _i(cw), _i(vec), pm, ps))
            kernel("cross_entropy.cu", "ce_fin_v2", xp)(((N + 255) // 256,), (256,),
                                                        (z2, y, _i(N), _i(Vn), np.int64(ignore_index), _i(sp), pm,
                                                         ps, m, s, term, kept))
        if not one:
            kernel("cross_entropy.cu", "ce_loss_v1", xp)((1,), (256,), (term, kept, _i(N), loss.reshape(1), count))
        if C.checks_on(m):                           # a read back: only with REFBERT_CUDA_CHECKS=1
            keep = C.to_host(kept).astype(bool)
            if not np.isfinite(C.to_host(m)[keep]).all():
                raise ValueError("cross_entropy: argument 'logits' expected finite rows, got a NaN, +inf or all -inf "
                                 "row")
    else:
        loss, count = xp.zeros((), np.float32), xp.zeros(1, np.float32)
    return loss, CrossEntropyCacheC(z2, y, int(ignore_index), m, s, count, logits.shape)


def cross_entropy_backward_c1(dloss, cache, rk=-1, o16=None):
    """dz (the logits' shape) of version C1 / C2. rk >= 0 (mixed precision): dz rounded to the compute dtype in the
    kernel, o16 its twin; the cache's z2 may be 16-bit storage (uint16), read so."""
    X = C.sibling("cross_entropy")
    if not isinstance(cache, CrossEntropyCacheC):
        return X.cross_entropy_backward_v2(dloss, cache)
    z2, y, ignore, m, s, count, shape = cache
    if np.ndim(dloss) != 0:
        raise ValueError(f"cross_entropy: argument 'dloss' expected a scalar (the loss is a scalar), got shape "
                         f"{np.shape(dloss)}")
    xp = C.xp_of(z2)
    N, Vn = z2.shape
    dz = xp.empty((N, Vn), np.float32)
    if N:
        if C.on_device(dloss):                       # the loss's own gradient array: read on the device
            dptr, on_dev, dval = xp.ascontiguousarray(dloss.astype(np.float32)).reshape(1), 1, 0.0
        else:
            dptr, on_dev, dval = count, 0, float(np.float32(dloss))
        vec = Vn % 4 == 0 and _aligned(z2, dz)
        z32, z16 = _in16(z2, xp)
        kernel("cross_entropy.cu", "ce_bwd_v1", xp)((N,), (256,), (z32, y, _i(N), _i(Vn), np.int64(ignore), _i(vec), m,
                                                                   s, count, dptr, _i(on_dev), _f(dval), dz, _i(rk),
                                                                   z16, _twin16(o16, dz, xp)))
    return dz.reshape(shape)


# ----------------------------------------------------------------------------------------------------------------
# column sums (C1): the bias gradient of a linear layer

def column_sum_c1(x2):
    """out[c] = sum_r x2[r, c] of a (R, C) float32 device array, deterministic (chunk partials in a fixed order)."""
    if not _c_ok(x2):
        return _fallback("column_sum", "C1", _why(x2), lambda a: a.sum(0), x2)
    xp = C.xp_of(x2)
    R, Cc = x2.shape
    if R == 0 or Cc == 0:
        return xp.zeros(Cc, x2.dtype)
    x2 = xp.ascontiguousarray(x2)
    per, chunks = C.chunks(R)
    parts = xp.empty((chunks, Cc), np.float32)
    out = xp.empty(Cc, np.float32)
    kernel("colsum.cu", "colsum_partial_v1", xp)(((Cc + 255) // 256, chunks), (256,),
                                                 (x2, _i(R), _i(Cc), _i(per), parts))
    kernel("colsum.cu", "colsum_final_v1", xp)(((Cc + 255) // 256,), (256,), (parts, _i(chunks), _i(Cc), out))
    return out


def column_sum16_c1(x16, kind):
    """column_sum_c1 on the values of 16-bit storage x16 ((R, C) uint16 device array of bfloat16 (kind 0) or
    float16 (kind 1) bits; colsum.cu colsum16_partial_v1): the same chunks and order on the same values, so
    column_sum_c1's bits on the float32 array holding them, from 2 bytes an element instead of 4."""
    xp = C.xp_of(x16)
    R, Cc = x16.shape
    if R == 0 or Cc == 0:
        return xp.zeros(Cc, np.float32)
    per, chunks = C.chunks(R)
    parts = xp.empty((chunks, Cc), np.float32)
    out = xp.empty(Cc, np.float32)
    kernel("colsum.cu", "colsum16_partial_v1", xp)(((Cc + 255) // 256, chunks), (256,),
                                                   (xp.ascontiguousarray(x16), _i(kind), _i(R), _i(Cc), _i(per), parts))
    kernel("colsum.cu", "colsum_final_v1", xp)(((Cc + 255) // 256,), (256,), (parts, _i(chunks), _i(Cc), out))
    return out


# ----------------------------------------------------------------------------------------------------------------
# the embedding backward (C1): sorted segment sum

def embedding_backward_c1(dout, cache, sorted_ids=None):
    """dw of the cuda backend's embedding (cache (ids, w_shape, dtype, padding_idx)): a sorted segment sum, the same
    bits every run. sorted_ids: (sid, pos) if the caller has them (the backend's stage())."""
    ids, w_shape, dtype, padding_idx = cache
    if not (_c_ok(dout) and np.dtype(dtype) == F32):
        backward = C.sibling("embedding").backward
        return _fallback("embedding", "C1", _why(dout), backward, 2, dout, cache, sorted_ids)
    xp = C.xp_of(dout)
    C.dout("embedding", dout, (*ids.shape, w_shape[1]), dtype)
    N, Cc = ids.size, w_shape[1]
    dw = xp.zeros(w_shape, np.float32)
    if N == 0 or Cc == 0:
        return dw
    sort_ids = C.sibling("embedding").sort_ids
    sid, pos = sorted_ids if sorted_ids is not None else sort_ids(xp, ids)
    d2 = xp.ascontiguousarray(dout).reshape(N, Cc)
    part = xp.empty((N, Cc), np.float32)
    kernel("embedding.cu", "emb_bwd_runs_v1", xp)(((N + 31) // 32, (Cc + 255) // 256), (256,),
                                                  (sid, pos, d2, _i(N), _i(Cc), part))
    kernel("embedding.cu", "emb_bwd_segments_v1", xp)((N, (Cc + 255) // 256), (256,),
                                                      (sid, part, _i(N), _i(Cc),
                                                       np.int64(-1 if padding_idx is None else padding_idx), dw))
    return dw
