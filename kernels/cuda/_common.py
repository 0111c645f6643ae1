"""What every Numba CUDA kernel file here shares: storage dtypes (fp32/fp64, and fp16/bf16 storage with fp32
accumulation), the device Philox of refbert.philox, warp and block reductions that also run in Numba's CUDA
simulator, the oracle's input checks for arrays that are not NumPy arrays, array-module dispatch (CuPy or NumPy),
and the low-precision validation that compares against the float64 oracle.

Storage and accumulation ("kind" names what a kernel reads and writes; factories compile one kernel per kind):
    f64   float64 arrays, float64 arithmetic                 (validated against the float64 oracle)
    f32   float32 arrays, float32 arithmetic                 (validated against the float32 oracle)
    f16   numpy.float16 arrays; loads widen to float32, every sum and exp runs in float32, one rounding on store
    bf16  ml_dtypes.bfloat16 arrays at the API. Numba (CPU, CUDA and the simulator) has no bfloat16 array dtype,
          so the host wrapper hands the kernel a uint16 *view* of the same buffer and the kernel converts:
              load   f32 = bits_as_f32(u16 << 16)                               (exact: bf16 is float32's top half)
              store  u16 = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16          (round to nearest even; NaN -> 0x7FC0)
          The wrapper views the uint16 output back as bfloat16, so callers only ever see bfloat16 arrays.
          (CuPy has no bfloat16 dtype: on CuPy, bf16 storage is not offered; a uint16 CuPy array is not taken
          for bf16, it is rejected like any other integer array.)

Simulator shims (NUMBA_ENABLE_CUDASIM=1, checked once at import): the simulator makes a block's cuda.shared.array
by looking its line up in a dict and adding it when missing, unlocked, so two threads of a block could each make
their own "shared" array (a rare wrong result, seen once in CI: one thread's K tile its own); a lock makes it once
(_lock_sim_shared). The simulator has no warp shuffles and no
libdevice, so `shfl_xor` becomes a shared-memory exchange between two __syncthreads (every thread of the block
must call it the same number of times: the kernels here keep shuffles in block-uniform control flow, with
inactive warps still taking part, which a real warp shuffle with a full mask requires anyway), and the bit casts
become numpy views. On a GPU the same names are cuda.shfl_xor_sync and libdevice's float_as_int / int_as_float.
"""
import functools
import os

import numpy as np

from numba import cuda, float32, float64, int32, uint16, uint32, uint64
from numba.core.types import float16
from numba.core import config

from refbert import validate as V

from . import compile_time

SIM = bool(config.ENABLE_CUDASIM)
compile_time.watch_numba()             # (how long this process compiles Numba kernels: the bench and check report it)

# Numba's disk cache for the kernels, off by default: REFBERT_NUMBA_CACHE=1 (read at import) keeps each kernel's
# compile (PTX and cubin) in Numba's cache directory (NUMBA_CACHE_DIR, else __pycache__ beside the source) and a later
# process whose kernel has the same bytecode, closure values and signature loads it there instead of compiling.
# Numba keys an entry by the kernel's own file's stamp, its bytecode and its closure's values (every closure here
# that compile_check reaches pickles, the same bytes in every process: tests/test_cuda_ptx.py), not by the code of
# device functions it reaches through another file's globals, so a cache kept across edits can hand back a stale
# kernel: hence off unless asked, and benchmarks/gpu_all.sh asks in
# a fresh directory for its own run only, after its preflight saw a kernel compiled and cached by one process and
# loaded by another on that GPU (issue 13: its processes compiled the same kernels over and over).
NUMBA_CACHE = os.environ.get("REFBERT_NUMBA_CACHE") == "1" and not SIM


def jit_kernel(fn):
    """@cuda.jit for a kernel (not a device function), with Numba's disk cache where NUMBA_CACHE is on."""
    return cuda.jit(cache=True)(fn) if NUMBA_CACHE else cuda.jit(fn)


def lock_numba_cache_saves():
    """Numba's cache keeps one index file a kernel function (every closure a factory makes shares it) and saves an
    entry by reading the index, taking the first free data-file number, writing the index, then the data, with no
    lock: two processes saving at once both take the same number, and one key can end up naming the other's
    compiled kernel, which a later process loads without a check (4 processes saving 40 entries each lost a quarter
    and mismatched 23 on this project's CPU: tests/test_cuda_ptx.py). Here each save holds an flock on a file beside
    the index (once a process; only where NUMBA_CACHE is on, or a test asks)."""
    import fcntl
    from numba.cuda.core import caching
    save = caching.IndexDataCacheFile.save
    if getattr(save, "refbert_locked", False):
        return

    def locked(self, key, data):
        with open(self._index_path + ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            save(self, key, data)
    locked.refbert_locked = True
    caching.IndexDataCacheFile.save = locked


if NUMBA_CACHE:
    lock_numba_cache_saves()

try:                                   # bfloat16 storage dtype (pip install ml_dtypes); absent: no bf16 kind
    from ml_dtypes import bfloat16 as BF16
except ImportError:                    # pragma: no cover
    BF16 = None

WARP = 32
BLOCK = 32 if SIM else 256             # threads per block of the block-per-row versions (a power of 2)
WARPS = 2 if SIM else 8                # rows per block of the warp-per-row versions (the simulator: 2 warps, so
#                                        a block with a tail row that has no work is always exercised)
CHUNKS = 64                            # row chunks of a deterministic column reduction (dw, db): partial rows


# ----------------------------------------------------------------------------------------------------------------
# storage kinds

def kind_of(dtype):
    t = np.dtype(dtype).type
    if t is np.float64:
        return "f64"
    if t is np.float32:
        return "f32"
    if t is np.float16:
        return "f16"
    if BF16 is not None and t is np.dtype(BF16).type:
        return "bf16"
    raise TypeError(f"no CUDA storage kind for dtype {np.dtype(dtype)}")


def acc_np(kind):
    """The accumulation type of a kind as a NumPy scalar type (closure constants of this type keep device
    arithmetic in it: a Python float literal would be typed float64)."""
    return np.float64 if kind == "f64" else np.float32


def acc_nb(kind):
    return float64 if kind == "f64" else float32


def dev(a):
    """The array a kernel sees: bf16 arrays as their uint16 bit patterns, anything else as is."""
    if BF16 is not None and a is not None and a.dtype == np.dtype(BF16):
        return a.view(np.uint16)
    return a


def din(a):
    """An input as a kernel argument: NumPy arrays go to the device once (no copy back, so read-only inputs
    work), device arrays (CuPy, emulated) are passed as they are. Outputs are passed with dev() (NumPy: Numba
    copies back)."""
    a = dev(a)
    if isinstance(a, np.ndarray) and not on_device(a):
        return cuda.to_device(np.ascontiguousarray(a))
    return a


# bit casts: libdevice on a GPU, numpy views in the simulator

if SIM:
    def f32_bits(v):
        return np.uint32(np.float32(v).view(np.uint32))

    def bits_f32(b):
        return np.uint32(b).view(np.float32)
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def f32_bits(v):
        return uint32(libdevice.float_as_int(float32(v)))

    @cuda.jit(device=True)
    def bits_f32(b):
        return libdevice.int_as_float(int32(b))


# a * b rounded once and never fused: on a GPU the compiler contracts `a * b - c` into fma(a, b, -c), which skips
# the product's rounding. Where c is a sum of those very products (layernorm's backward: wdy - mean(wdy)), the
# difference is then the rounding error instead of the exact 0 (at C = 1), and the backward
# multiplies it by rstd = 1/sqrt(eps) = 1e6 (seen on the H200: dx 1.2e-12 in float64, 2e-3 in float32, where the
# oracle's is 0). libdevice's __fmul_rn / __dmul_rn are multiplications the compiler may not contract; the
# simulator never contracts.

def mul_rn(kind):
    """The non-contractible product in kind's accumulation type (f64: double, others: float32)."""
    if SIM:
        return _mul_sim
    return _dmul_rn if kind == "f64" else _fmul_rn


def _mul_sim(a, b):
    return a * b


if not SIM:
    @cuda.jit(device=True)
    def _fmul_rn(a, b):
        return libdevice.fmul_rn(float32(a), float32(b))

    @cuda.jit(device=True)
    def _dmul_rn(a, b):
        return libdevice.dmul_rn(float64(a), float64(b))


_BF16_NAN = np.uint32(0x7FC0)
_RND = np.uint32(0x7FFF)
_ONE32 = np.uint32(1)
_S16 = np.uint32(16)


@cuda.jit(device=True)
def ld_bf16(u):
    return bits_f32(uint32(u) << _S16)


@cuda.jit(device=True)
def st_bf16(v):
    v = float32(v)
    if v != v:
        return uint16(_BF16_NAN)
    b = f32_bits(v)
    return uint16((b + _RND + ((b >> _S16) & _ONE32)) >> _S16)


@cuda.jit(device=True)
def ld_f32(v):
    return float32(v)


@cuda.jit(device=True)
def ld_f64(v):
    return float64(v)


@cuda.jit(device=True)
def st_f16(v):
    return float16(float32(v))


def ldst(kind):
    """(load, store) device functions of a storage kind: load widens to the accumulation type, store rounds."""
    return {"f64": (ld_f64, ld_f64), "f32": (ld_f32, ld_f32), "f16": (ld_f32, st_f16),
            "bf16": (ld_bf16, st_bf16)}[kind]


# ----------------------------------------------------------------------------------------------------------------
# Philox4x32-10 (refbert.philox): the same words as refbert.philox.random_words, on uint64 holding 32-bit values

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_MASK32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)
_TWO, _THREE = np.uint64(2), np.uint64(3)
_U0, _U1, _U2 = np.uint64(0), np.uint64(1), np.uint64(2)


@cuda.jit(device=True)
def philox_block(block, stream, seed):
    """The 4 words of Philox block `block` of dropout call (seed, stream): elements 4*block .. 4*block + 3."""
    block, stream, seed = uint64(block), uint64(stream), uint64(seed)
    c0, c1 = block & _MASK32, block >> _S32
    c2, c3 = stream & _MASK32, stream >> _S32
    k0, k1 = seed & _MASK32, seed >> _S32
    for _ in range(10):
        p0 = _M0 * c0                                # exact: both factors < 2^32
        p1 = _M1 * c2
        c0, c1, c2, c3 = ((p1 >> _S32) ^ c1 ^ k0) & _MASK32, p1 & _MASK32, ((p0 >> _S32) ^ c3 ^ k1) & _MASK32, \
            p0 & _MASK32
        k0 = (k0 + _W0) & _MASK32
        k1 = (k1 + _W1) & _MASK32
    return c0, c1, c2, c3


@cuda.jit(device=True)
def philox_word(i, stream, seed):
    """The word of element i of dropout call (seed, stream): word i % 4 of block i // 4."""
    i = uint64(i)
    w0, w1, w2, w3 = philox_block(i >> _TWO, stream, seed)
    lane = i & _THREE
    if lane == _U0:
        return w0
    if lane == _U1:
        return w1
    if lane == _U2:
        return w2
    return w3


# ----------------------------------------------------------------------------------------------------------------
# warp and block reductions (block-uniform control flow: every thread of the block calls them)

def _lock_sim_shared():
    """cuda.shared.array in the simulator (numba-cuda's FakeCUDAShared.array, to 0.30 at least: get, then set, no
    lock) made under one lock: the same array for every thread of a block. The caller's line identifies the array,
    as there. Left alone where the simulator's internals are not what this reads."""
    import sys
    import threading
    try:
        from numba.cuda.simulator import kernelapi
    except ImportError:                                 # pragma: no cover
        return
    cls = kernelapi.FakeCUDAShared
    orig = cls.array
    if getattr(orig, "locked", False):
        return
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0 or not hasattr(self, "_allocations") or \
                not hasattr(kernelapi, "types") or not hasattr(kernelapi, "numpy_support"):
            return orig(self, shape, dtype, alignment)  # (dynamic shared memory: one buffer, no race)
        if isinstance(dtype, kernelapi.types.Type):     # (as the simulator: a Numba type -> its NumPy dtype)
            dtype = kernelapi.numpy_support.as_dtype(dtype)
        f = sys._getframe(1)                            # the caller's (file, line), as the simulator keys it
        caller = (f.f_code.co_filename, f.f_lineno)
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = self._allocations[caller] = np.empty(shape, dtype)
        return res
    array.locked = True
    cls.array = array


class _Gate:
    """One simulated block's barrier, event-driven (_event_driven_sim_blocks): `live` threads not yet finished,
    `waiting` of them at the barrier, `generation` counts the barriers passed, `failed` the first thread that raised."""

    def __init__(self, threads):
        import threading
        self.cond = threading.Condition()
        self.threads, self.live, self.waiting, self.generation, self.failed = threads, len(threads), 0, 0, None

    def open(self):                                     # (under cond) every live thread is waiting: all pass
        self.waiting = 0
        self.generation += 1
        self.cond.notify_all()


def _event_driven_sim_blocks():
    """The simulator's blocks run without a polling thread. numba-cuda's BlockManager.run (to 0.30 at least) starts
    one Python thread per CUDA thread, then loops over every live thread asking `is_alive()` and whether it waits at
    a __syncthreads, until all have finished: tens of millions of calls a training step, holding the GIL the
    simulated threads need (measured: a one-step pretrain of a one-layer model in the simulator, 107 s, two thirds
    of the main thread's time in that loop). Here a barrier is a condition variable: the last live thread to arrive
    opens it, a thread that finishes counts itself out (and opens it if every other live thread waits there, as the
    loop did), the first exception stops the block as the loop did (every other thread's abort flag set, the
    exception raised with the failing thread's ids), and the launching thread sleeps until the block is done.
    Same semantics, same threads; left alone where the simulator's internals are not what this reads."""
    try:
        from numba.cuda.simulator import kernel as simk
    except ImportError:                                 # pragma: no cover
        return
    BM, BT = getattr(simk, "BlockManager", None), getattr(simk, "BlockThread", None)
    if BM is None or BT is None or getattr(BM.run, "event_driven", False):
        return
    need = ("syncthreads", "run", "__init__")
    if not all(callable(getattr(BT, a, None)) for a in need) or not callable(getattr(BM, "run", None)):
        return                                          # pragma: no cover
    thread_run = BT.run

    def syncthreads(self):
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads call")
        gate = self._manager._gate
        with gate.cond:
            gen = gate.generation
            gate.waiting += 1
            if gate.waiting == gate.live:
                gate.open()
            else:
                while gate.generation == gen and not self.abort:
                    gate.cond.wait()
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads clear")

    def run_thread(self):
        try:
            thread_run(self)                            # the simulator's: keeps an exception in self.exception
        finally:
            gate = self._manager._gate
            with gate.cond:
                gate.live -= 1
                if self.exception is not None and gate.failed is None:
                    gate.failed = self
                    for t in gate.threads:
                        t.abort = True
                    gate.cond.notify_all()
                elif gate.live == 0:
                    gate.cond.notify_all()
                elif gate.waiting and gate.waiting == gate.live:
                    gate.open()

    def run(self, grid_point, *args):
        def target():
            self._f(*args)
        threads = [BT(target, self, grid_point, block_point, self._debug)
                   for block_point in np.ndindex(*self._block_dim)]
        gate = self._gate = _Gate(threads)
        for t in threads:
            t.start()
        with gate.cond:
            while gate.live and gate.failed is None:
                gate.cond.wait()
        failed = gate.failed or next((t for t in threads if t.exception), None)
        if failed is not None:
            raise failed.exception[0].with_traceback(failed.exception[1])

    run.event_driven = True
    BT.syncthreads, BT.run, BM.run = syncthreads, run_thread, run


if SIM:
    _lock_sim_shared()
    _event_driven_sim_blocks()

if SIM:
    import threading
    _phase = threading.local()         # per simulated thread: which of two exchange buffers its next call uses

    @cuda.jit(device=True)
    def shfl_xor(v, lanemask):
        """Simulator stand-in for cuda.shfl_xor_sync(0xffffffff, v, lanemask): an exchange through shared
        memory, double-buffered so one barrier per call suffices (a buffer is rewritten two calls later, after
        every thread has passed the barrier in between, hence finished reading it)."""
        buf = cuda.shared.array((2, 1024), float64)
        ph = getattr(_phase, "k", 0)
        _phase.k = 1 - ph
        t = cuda.threadIdx.x
        buf[ph, t] = v
        cuda.syncthreads()
        return type(v)(buf[ph, t ^ lanemask])
else:
    @cuda.jit(device=True)
    def shfl_xor(v, lanemask):
        return cuda.shfl_xor_sync(0xFFFFFFFF, v, lanemask)


@cuda.jit(device=True)
def warp_sum(v):
    """Butterfly sum over the 32 lanes; every lane gets the total, added in the same order on every lane."""
    for k in (16, 8, 4, 2, 1):
        v += shfl_xor(v, k)
    return v


@cuda.jit(device=True)
def warp_max(v):
    for k in (16, 8, 4, 2, 1):
        v = max(v, shfl_xor(v, k))
    return v


@cuda.jit(device=True)
def block_sum(v, buf):
    """Tree sum over a block of blockDim.x (a power of 2) threads through buf (shared, >= blockDim.x entries);
    every thread gets the total. Fixed order: the same bits every run."""
    t = cuda.threadIdx.x
    buf[t] = v
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if t < s:
            buf[t] = buf[t] + buf[t + s]
        cuda.syncthreads()
        s //= 2
    r = buf[0]
    cuda.syncthreads()
    return r


@cuda.jit(device=True)
def block_max(v, buf):
    t = cuda.threadIdx.x
    buf[t] = v
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if t < s:
            buf[t] = max(buf[t], buf[t + s])
        cuda.syncthreads()
        s //= 2
    r = buf[0]
    cuda.syncthreads()
    return r


@functools.lru_cache(maxsize=None)
def column_sum_kernel(kind_in, kind_out):
    """out[j] = sum_c parts[c, j] in c order (the second pass of a deterministic reduction; no atomics)."""
    _, st = ldst(kind_out)
    ld, _ = ldst(kind_in)
    zero = acc_np(kind_out)(0)

    @jit_kernel
    def k(parts, out):
        j = cuda.grid(1)
        if j < out.shape[0]:
            s = zero
            for c in range(parts.shape[0]):
                s += ld(parts[c, j])
            out[j] = st(s)
    return k


# The kernel variants an environment variable picks inside a version (A/B runs): each variable's default, written
# here once. The modules read their value at import by variant_env (cuda_c.ATTN_BWD16, mixed.MIXED_LN, ...);
# versions.VARIANTS says which module attribute holds each, and what it chooses.
VARIANT_DEFAULTS = {"REFBERT_ATTN_BWD16": "6", "REFBERT_ATTN_FWD16": "5", "REFBERT_LN_DWDB": "3",
                    "REFBERT_F32_BWD": "6",
                    "REFBERT_MIXED_ATTENTION": "S2", "REFBERT_MIXED_LN": "3", "REFBERT_MIXED_LN_BWD": "2",
                    "REFBERT_MIXED_GELU_BWD": "1", "REFBERT_MIXED_GELU_FWD": "1"}


def variant_env(var):
    """Kernel variant `var`'s value at import: the environment's, else its default (VARIANT_DEFAULTS)."""
    return os.environ.get(var, VARIANT_DEFAULTS[var])


def variant(who, var, value, allowed):
    """value, a kernel variant an environment variable `var` chose (REFBERT_ATTN_BWD16 and the like), or a
    ValueError naming the variable, what it takes and what came; who: the op and version that reads it."""
    if value not in allowed:
        raise ValueError(f"{who}: {var} expected one of {', '.join(allowed)}, got {value!r}")
    return value


def chunks(R):
    """(rows per chunk, number of chunks): a function of R alone, so column sums add in the same order."""
    per = max(1, -(-R // CHUNKS))
    return per, max(1, -(-R // per))


def grid_for(n, block):
    return max(1, -(-n // block))


GRID_Y_MAX = 65535                     # CUDA's limit on a grid's y (and z) extent


def heads_grid(op, B, H):
    """B * H, checked against the grid's y limit: the attention kernels launch a block row per (batch, head)."""
    if B * H > GRID_Y_MAX:
        raise ValueError(f"{op}: batch x n_heads expected at most {GRID_Y_MAX} (the kernels' grid has a y row per "
                         f"(batch, head), CUDA's limit), got {B} x {H} = {B * H}: split the batch")
    return B * H


# ----------------------------------------------------------------------------------------------------------------
# array modules and the oracle's checks on any array

def is_array(a):
    return isinstance(a, np.ndarray) or hasattr(a, "__cuda_array_interface__")


_EMU = "refbert_kernels.cuda.emulate"
_XP = {}            # type -> its array module: xp_of runs several times around every launch


def xp_of(a):
    """The array module of a: cupy for a CuPy array (imported only when one is seen), the emulated cupy of
    refbert_kernels.cuda.emulate for its device arrays, else numpy. It depends on type(a) alone, so it is looked
    up once per type."""
    t = type(a)
    xp = _XP.get(t)
    if xp is None:
        if issubclass(t, np.ndarray):
            if t is not np.ndarray and t.__module__ == _EMU:
                from .emulate import cupy as xp
            else:
                xp = np
        elif t.__module__.split(".")[0] == "cupy":
            import cupy as xp
        else:
            xp = np
        _XP[t] = xp
    return xp


_SIBLINGS = {}


def sibling(name):
    """The module refbert_kernels.cuda.<name>, imported on first use and kept: for code that must not import it at
    its top (an import cycle, or a Numba kernel module whose failure to import must not take the CUDA C path with
    it), without an import statement's cost (about a microsecond) on every call."""
    m = _SIBLINGS.get(name)
    if m is None:
        import importlib
        m = _SIBLINGS[name] = importlib.import_module(f"{__package__}.{name}")
    return m


def on_device(a):
    """True for a CuPy array or an emulated device array (refbert_kernels.cuda.emulate), False for NumPy."""
    return a is not None and xp_of(a) is not np


# Value checks that need a device array's values on the host (a NaN logit, an id out of range, a row of -inf
# scores) synchronise the device: on device arrays they run only with REFBERT_CUDA_CHECKS=1. On host arrays (the
# model's inputs before they move, the simulator's NumPy arrays) they always run, as the oracle's do.
STRICT = os.environ.get("REFBERT_CUDA_CHECKS", "0") not in ("", "0")


def checks_on(*arrays):
    """Whether value checks on these arrays run here: they are all on the host, or REFBERT_CUDA_CHECKS=1."""
    return STRICT or not any(on_device(a) for a in arrays)


def stub(a):
    """A zero-byte NumPy array with a's shape and dtype, for refbert.validate's shape checks (which want numpy)."""
    if a is None or isinstance(a, np.ndarray) or not is_array(a):
        return a
    return np.broadcast_to(np.zeros((), a.dtype), a.shape)


def _storage_types():
    ts = [np.float32, np.float64, np.float16]
    if BF16 is not None:
        ts.append(np.dtype(BF16).type)
    return tuple(ts)


STORAGE = _storage_types()


def floats(op, **arrays):
    """refbert.validate.floats, widened to fp16/bf16 storage and device arrays; for what the oracle rejects the
    message is the oracle's own."""
    dtype = None
    for name, x in arrays.items():
        if x is None:
            continue
        if not is_array(x) or np.dtype(x.dtype).type not in STORAGE:
            V.floats(op, **{name: x if isinstance(x, np.ndarray) or not is_array(x) else stub(x)})
            raise ValueError(f"{op}: argument '{name}' expected a float32 or float64 numpy array, got {V._desc(x)}")
        if dtype is None:
            dtype, first = x.dtype, name
        elif x.dtype != dtype:
            raise ValueError(f"{op}: argument '{name}' expected dtype {dtype} (the dtype of '{first}'), got {x.dtype}")
    return dtype


def dout(op, d, out_shape, dtype):
    V.dout(op, stub(d), out_shape, dtype)


def contiguous(a):
    return xp_of(a).ascontiguousarray(a)


def to_xp(xp, a):
    """A host NumPy array onto xp's device (numpy: itself)."""
    return a if xp is np else xp.asarray(a)


def to_host(a):
    return a if isinstance(a, np.ndarray) else (a.get() if hasattr(a, "get") else np.asarray(a))


def scalar_dout(op, d, dtype):
    """refbert.ops._scalar_dout for a NumPy or CuPy scalar."""
    if np.ndim(d) != 0:
        raise ValueError(f"{op}: argument 'dloss' expected a scalar (the loss is a scalar), got shape {np.shape(d)}")
    if hasattr(d, "get"):
        d = d.get()
    return float(np.dtype(dtype).type(V.number(op, "dloss", d, what="a finite real number (the loss is a scalar)")))


# ----------------------------------------------------------------------------------------------------------------
# validation against the oracle: fp32/fp64 by refbert_kernels._harness.validate (the oracle in the same dtype);
# fp16/bf16 against the float64 oracle run on the same rounded inputs

def eps_of(dtype):
    return {"f16": 2.0 ** -10, "bf16": 2.0 ** -7, "f32": 2.0 ** -23, "f64": 2.0 ** -52}[kind_of(dtype)]


def lowp_tol(dtype, ulps=4):
    """(atol, rtol) = ulps units of the storage dtype's epsilon, for O(1) data: the kernel rounds once on the
    store (0.5 ulp) and backwards read cached values rounded to storage (softmax's p, the dropout input), whose
    0.5 ulp errors pass through a few multiplications; fp32 accumulation adds ~1e-6, nothing at this scale."""
    e = eps_of(dtype)
    return ulps * e, ulps * e


def _is_float_array(v):
    return isinstance(v, np.ndarray) and v.dtype.type in STORAGE


def validate_lowp(spec, version, dtype, shape, seed=0):
    """Worst err/tol of one version in fp16/bf16 storage against the float64 oracle on the same rounded inputs."""
    from refbert_kernels._harness import _fresh, compare
    atol, rtol = spec.tol.get(np.dtype(dtype).type, lowp_tol(dtype))
    inputs32, kwargs = spec.make_inputs(shape, np.float32, seed)
    ins = {k: (v.astype(dtype) if _is_float_array(v) else v) for k, v in inputs32.items()}
    ins64 = {k: (v.astype(np.float64) if _is_float_array(v) else v) for k, v in ins.items()}
    ref_out, ref_cache = spec.oracle[0](**ins64, **_fresh(kwargs))
    out, cache = spec.versions[version][0](**ins, **_fresh(kwargs))
    if np.ndim(ref_out) == 0:
        d64 = np.float64(1.0)
        d = np.dtype(dtype).type(1.0)
    else:
        d = np.random.default_rng(0).standard_normal(np.shape(ref_out)).astype(dtype)
        d64 = d.astype(np.float64)
    ref_g = spec.oracle[1](d64, ref_cache)
    got_g = spec.versions[version][1](d, cache)
    ref_g = ref_g if isinstance(ref_g, tuple) else (ref_g,)
    got_g = got_g if isinstance(got_g, tuple) else (got_g,)
    worst = 0.0
    for label, g, r in [("out", out, ref_out), *zip((f"d{w}" for w in spec.wrt), got_g, ref_g)]:
        g = to_host(g)
        if g.dtype != np.dtype(dtype):
            raise AssertionError(f"{spec.name} v{version} {label}: dtype {g.dtype}, expected {np.dtype(dtype)}")
        worst = max(worst, compare(f"{spec.name} v{version} {np.dtype(dtype).name} {shape} {label}",
                                   g.astype(np.float64), np.asarray(r, np.float64), atol, rtol))
    return worst


def validate(spec, version, dtype, shape, seed=0):
    """Worst err/tol (<= 1 passes) of one version on one shape and dtype."""
    if np.dtype(dtype).type in (np.float32, np.float64):
        from refbert_kernels._harness import validate as harness_validate
        return harness_validate(spec, version, dtype, shape, seed)[0]
    return validate_lowp(spec, version, dtype, shape, seed)


def dtypes():
    """The dtypes every CUDA kernel here is validated in."""
    return [np.float64, np.float32, np.float16] + ([BF16] if BF16 is not None else [])


def check_specs(specs, shapes="sim", dtype_list=None, verbose=True):
    """Validate every version of every spec on its simulator shapes (`shapes="sim"`) or GPU shapes ("gpu"), in
    every dtype. Prints one line per (spec, version, dtype); raises AssertionError on the first failure."""
    for spec in specs:
        todo = spec.shapes if shapes == "sim" else spec.notes.get("gpu_shapes", spec.shapes)
        for v in sorted(spec.versions):
            for dt in dtype_list or dtypes():
                worst = max(validate(spec, v, dt, s) for s in todo)
                if verbose:
                    print(f"  {spec.name:28s} v{v} {np.dtype(dt).name:9s} worst err/tol {worst:.3f} "
                          f"{'ok' if worst <= 1 else 'FAIL'}", flush=True)
                if not worst <= 1:
                    raise AssertionError(f"{spec.name} v{v} {np.dtype(dt).name}: err/tol {worst}")
