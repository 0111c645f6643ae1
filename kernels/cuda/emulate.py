"""A CPU stand-in for CuPy and a GPU: the cuda backend and the CUDA C launchers run their real code paths here,
the kernels of csrc/*.cu included, so that what only a GPU used to show is proven without one.

    REFBERT_CUDA_EMULATE=1 NUMBA_ENABLE_CUDASIM=1 python ...    the cuda backend's array module is `cupy` below

Three parts:
  DevArray   a NumPy array subclass that stands for device memory. What CuPy refuses, it refuses (a NumPy array
             with ndim >= 1 mixed into a device operation is a TypeError, as in CuPy); what costs a transfer, it
             counts in COUNTS: `h2d` host-to-device copies (cupy.asarray of host data, a host index or value given
             to a device array), `d2h` device-to-host reads (.get(), asnumpy, float(), int(), bool(), .item(),
             numpy functions whose result size depends on the data: nonzero, unique, ...). `empty` fills floats
             with NaN and integers with a sentinel, so an output a kernel forgets to write shows.
  cupy       the namespace the backend uses as `xp`: array creation, the NumPy functions on DevArrays,
             cuda.Device().synchronize() (counted), RawModule / RawKernel.
  RawModule  csrc/<file>.cu compiled by g++ with -DCPUSIM (csrc/cpusim.cuh: every CUDA thread an OS thread,
             __syncthreads and warp shuffles as barriers) into a shared library, cached by the sources' hash; each
             extern "C" kernel gets a trampoline, and a launch `kernel(grid, block, args)` is checked as the GPU
             would take it: the argument count and every argument's C type against the kernel's signature (read off
             the preprocessed source), pointers only from device arrays, contiguous, of the pointee's dtype, scalars
             only as NumPy scalars of the parameter's exact type (CuPy packs a Python int as 8 bytes and a Python
             float as a double: a silent misread on a GPU), grid and block within CUDA's limits and the kernel's
             __launch_bounds__. Then the kernel runs, on the arrays' memory.
fp16 / bf16 storage and the tensor-core kernels run too (-DCPUSIM_HALF: cpusim.cuh's 16-bit types, mma.sync by
fragments exchanged across the warp, cp.async as a copy): __half pointers take float16 arrays, __nv_bfloat16 ones
ml_dtypes.bfloat16 arrays.
What this cannot show: speed, races between blocks (blocks run one at a time), ldmatrix and other inline assembly,
NVRTC itself (tests/test_cuda_nvcc.py compiles every file with nvcc for sm_90 instead).

Needs g++ with C++20 (std::atomic_ref). The build cache: $REFBERT_CPUSIM_CACHE, else ~/.cache/refbert/cpusim.
"""
import ctypes
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import threading
import types
from pathlib import Path

import numpy as np

CSRC = Path(__file__).with_name("csrc")
FLAGS = ("-std=c++20", "-O1", "-pthread", "-fPIC", "-shared", "-ffp-contract=off", "-DCPUSIM", "-DCPUSIM_HALF",
         "-DCPUSIM_LIB", "-DNO_MAIN", "-w")


# ----------------------------------------------------------------------------------------------------------------
# what crossed the bus

class Counts:
    """Host-to-device copies, device-to-host reads (each one a synchronisation), explicit synchronisations and
    kernel launches (by name), since the last reset()."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.h2d, self.d2h, self.syncs, self.launches = 0, 0, 0, {}
        self.events = []

    def note(self, what, detail):
        setattr(self, what, getattr(self, what) + 1)
        if len(self.events) < 200:
            self.events.append((what, detail))

    def launched(self):
        return sum(self.launches.values())

    def __repr__(self):
        return f"Counts(h2d={self.h2d}, d2h={self.d2h}, syncs={self.syncs}, launches={self.launched()})"


COUNTS = Counts()


def _where():
    """The innermost frame outside numpy and this file: where a transfer was asked for."""
    f = sys._getframe(2)
    while f is not None and (f.f_code.co_filename == __file__ or "/numpy/" in f.f_code.co_filename):
        f = f.f_back
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} {f.f_code.co_name}" if f else "?"


# ----------------------------------------------------------------------------------------------------------------
# device arrays

def _is_host(a):
    return type(a) is np.ndarray and a.ndim > 0


def _host_args(objs):
    for o in objs:
        if _is_host(o):
            return o
        if isinstance(o, (list, tuple)):
            h = _host_args(o)
            if h is not None:
                return h
    return None


def _wrap(res):
    """NumPy results as device arrays (a reduction's scalar as a 0-d array, as CuPy returns)."""
    if isinstance(res, DevArray):
        return res
    if isinstance(res, np.ndarray):
        return res.view(DevArray)
    if isinstance(res, np.generic):
        return np.asarray(res).view(DevArray)
    if isinstance(res, tuple):
        return tuple(_wrap(r) for r in res)
    if isinstance(res, list):
        return [_wrap(r) for r in res]
    return res


def _unwrap(obj):
    if isinstance(obj, DevArray):
        return obj.view(np.ndarray)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unwrap(o) for o in obj)
    return obj


# numpy functions whose output size depends on the values: a device array must come back first (CuPy syncs)
_SYNCING = {"nonzero", "flatnonzero", "argwhere", "unique", "compress", "extract", "count_nonzero", "array_equal",
            "allclose", "isclose_all"}


class _Ptr:
    def __init__(self, ptr):
        self.ptr = ptr


class DevArray(np.ndarray):
    """Device memory, emulated: a NumPy array that refuses host arrays and counts transfers (module docstring)."""

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        host = _host_args(inputs) if _host_args(inputs) is not None else _host_args(kwargs.get("out", ()))
        if host is not None:
            raise TypeError(f"emulated CuPy: a NumPy array of shape {host.shape} in {ufunc.__name__}.{method} with a "
                            f"device array (CuPy raises TypeError: move it with cupy.asarray first)")
        args = _unwrap(inputs)
        if "out" in kwargs:
            kwargs["out"] = _unwrap(kwargs["out"])
        return _wrap(getattr(ufunc, method)(*args, **kwargs))

    def __array_function__(self, func, types_, args, kwargs):
        host = _host_args(args)
        if host is not None and func.__name__ not in ("shape", "ndim", "size"):
            raise TypeError(f"emulated CuPy: a NumPy array of shape {host.shape} given to numpy.{func.__name__} with "
                            f"a device array")
        if func.__name__ in _SYNCING:
            COUNTS.note("d2h", f"numpy.{func.__name__} {_where()}")
        res = func(*_unwrap(args), **{k: _unwrap(v) for k, v in kwargs.items()})
        if func.__name__ in ("shape", "ndim", "size"):
            return res
        return _wrap(res)

    def __array_namespace__(self, api_version=None):
        return cupy                                  # as CuPy's arrays name CuPy (refbert.optim copies moments so)

    def __getitem__(self, idx):
        items = idx if isinstance(idx, tuple) else (idx,)
        if any(_is_host(i) for i in items):
            COUNTS.note("h2d", f"host index {_where()}")
            idx = tuple(i.view(DevArray) if _is_host(i) else i for i in items) if isinstance(idx, tuple) \
                else idx.view(DevArray)
        res = super().__getitem__(_unwrap(idx) if isinstance(idx, DevArray) else idx)
        return _wrap(res) if isinstance(res, np.generic) else res     # CuPy: an element is a 0-d device array

    def __setitem__(self, idx, value):
        if _is_host(value):
            COUNTS.note("h2d", f"host value {_where()}")
        if _is_host(idx):
            COUNTS.note("h2d", f"host index {_where()}")
        super().__setitem__(idx, value)

    # reads that need the values on the host
    def get(self, stream=None, order="C", out=None):
        COUNTS.note("d2h", f".get() {_where()}")
        return np.array(self.view(np.ndarray), order=order)

    def _sync(self, what):
        COUNTS.note("d2h", f"{what} {_where()}")

    def __float__(self):
        self._sync("float()")
        return float(self.view(np.ndarray))

    def __int__(self):
        self._sync("int()")
        return int(self.view(np.ndarray))

    def __index__(self):
        self._sync("index")
        return int(self.view(np.ndarray))

    def __bool__(self):
        self._sync("bool()")
        return bool(self.view(np.ndarray))

    def item(self, *args):
        self._sync(".item()")
        return self.view(np.ndarray).item(*args)

    def tolist(self):
        self._sync(".tolist()")
        return self.view(np.ndarray).tolist()

    @property
    def data(self):
        return _Ptr(self.ctypes.data if self.size else 0)     # CuPy: an empty array's pointer is 0 (NULL)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ctypes.data, False), "version": 3,
                "strides": None if self.flags.c_contiguous else self.strides}

    def __repr__(self):
        return "DevArray(" + repr(self.view(np.ndarray))[6:]


# ----------------------------------------------------------------------------------------------------------------
# kernels: signatures, the shared library, launches

_TYPES = {"float": np.float32, "double": np.float64, "int": np.int32, "long long": np.int64, "u64": np.uint64,
          "unsigned long long": np.uint64, "u32": np.uint32, "unsigned int": np.uint32, "unsigned": np.uint32,
          "long long int": np.int64, "bool": np.bool_, "unsigned short": np.uint16, "__half": np.float16}
try:                                                    # bfloat16 storage: ml_dtypes' dtype, where it is installed
    from ml_dtypes import bfloat16 as _bf16
    _TYPES["__nv_bfloat16"] = _bf16
except ImportError:                                     # pragma: no cover  (those kernels are then left out)
    pass
_CTYPES = {np.float32: ctypes.c_float, np.float64: ctypes.c_double, np.int32: ctypes.c_int32,
           np.int64: ctypes.c_int64, np.uint64: ctypes.c_uint64, np.uint32: ctypes.c_uint32, np.bool_: ctypes.c_bool}


class Param:
    """One kernel parameter: its C type text, whether it is a pointer (and const), the NumPy dtype it carries."""

    def __init__(self, text):
        self.text = text.strip()
        t = re.sub(r"\b(__restrict__|__restrict|restrict)\b", " ", self.text)
        m = re.match(r"^(.*?)([A-Za-z_]\w*)$", t.strip())
        if not m:
            raise ValueError(f"emulate: cannot read the kernel parameter {text!r}")
        ctype, self.name = m.group(1).strip(), m.group(2)
        self.pointer = ctype.endswith("*")
        self.const = self.pointer and ctype.startswith("const")
        base = " ".join(ctype.replace("*", " ").replace("const", " ").split())
        if base not in _TYPES:
            raise ValueError(f"emulate: kernel parameter {text!r}: no NumPy dtype for C type {base!r}")
        self.base, self.dtype = base, np.dtype(_TYPES[base])
        self.ctype = ctype

    def cast(self):
        """The C expression that reads this parameter from a void* slot (a trampoline's argument)."""
        return f"*({self.ctype}*)"


_DECL = re.compile(r'extern\s+"C"\s+void\s+(?:cpusim_launch_bounds\(\s*(\d+)[^)]*\)\s+)?(\w+)\s*\(([^)]*)\)\s*\{')


def signatures(source):
    """{kernel name: (params, launch bound or None)} of csrc/<source>, read off g++'s preprocessed text under
    CPUSIM (macro-made kernels included)."""
    path = CSRC / source
    res = subprocess.run(["g++", "-std=c++20", "-E", "-P", "-DCPUSIM", "-DCPUSIM_HALF", "-DCPUSIM_PARSE", "-DNO_MAIN",
                          f"-I{CSRC}", "-x", "c++", str(path)], capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"emulate: g++ -E {source} failed:\n{res.stderr[-3000:]}")
    text = " ".join(res.stdout.split())
    out = {}
    for lb, name, params in _DECL.findall(text):
        if name.startswith("cpusim_"):
            continue
        try:
            ps = [Param(p) for p in params.split(",") if p.strip()]
        except ValueError:                              # a storage type without a NumPy dtype here: left out
            continue
        out[name] = (ps, int(lb) if lb else None)
    return out


def _digest():
    h = hashlib.sha256()
    for p in sorted(CSRC.glob("*")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(" ".join(FLAGS).encode())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()[:16]


def cache_dir():
    return Path(os.environ.get("REFBERT_CPUSIM_CACHE", Path.home() / ".cache" / "refbert" / "cpusim"))


_BUILD_LOCK = threading.Lock()


def build(source):
    """(ctypes library, signatures) of csrc/<source> compiled for CPU threads (cached by the sources' hash)."""
    sigs = signatures(source)
    out = cache_dir() / f"{Path(source).stem}-{_digest()}.so"
    with _BUILD_LOCK:
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            tramps = []
            for name, (ps, _) in sigs.items():
                call = ", ".join(f"{p.cast()}a[{i}]" for i, p in enumerate(ps))
                tramps.append(f'extern "C" void refbert_tramp_{name}(void** a) {{ {name}({call}); }}')
            with tempfile.TemporaryDirectory() as tmp:
                wrapper = Path(tmp) / "wrapper.cpp"
                wrapper.write_text(f'#include "{CSRC / source}"\n' + "\n".join(tramps) + "\n")
                part = Path(tmp) / out.name
                res = subprocess.run(["g++", *FLAGS, f"-I{CSRC}", str(wrapper), "-o", str(part)],
                                     capture_output=True, text=True)
                if res.returncode:
                    raise RuntimeError(f"emulate: g++ could not build {source} for CPU threads:\n{res.stderr[-4000:]}")
                os.replace(part, out)                       # atomic: a concurrent build never sees half a file
    lib = ctypes.CDLL(str(out))
    lib.cpusim_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_uint] * 6 + [ctypes.c_ulonglong]
    lib.cpusim_launch.restype = ctypes.c_int
    return lib, sigs


def _dims(d, what, name):
    d = (d,) if isinstance(d, (int, np.integer)) else tuple(d)
    if not 1 <= len(d) <= 3 or not all(isinstance(v, (int, np.integer)) for v in d):
        raise TypeError(f"emulated launch of {name}: {what} expected 1 to 3 integers, got {d!r}")
    d = tuple(int(v) for v in d) + (1,) * (3 - len(d))
    if min(d) < 1:
        raise ValueError(f"emulated launch of {name}: {what} {d} has a zero or negative dimension (CUDA: invalid "
                         f"configuration argument)")
    return d


_BY_PTR = {}            # an emulated kernel's "function pointer" (RawKernel.ptr) -> the kernel: driver.launchKernel


class RawKernel:
    """One kernel of an emulated RawModule: kernel(grid, block, args) checks the launch, then runs it. Its `ptr`
    stands for the CUfunction that cuda.driver.launchKernel takes (launch version 2 of cuda_c.py)."""

    def __init__(self, lib, name, params, bound, source):
        self.lib, self.name, self.params, self.bound, self.source = lib, name, params, bound, source
        self.tramp = ctypes.cast(getattr(lib, f"refbert_tramp_{name}"), ctypes.c_void_p).value
        self.max_dynamic_shared_size_bytes = 48 * 1024      # CUDA's default; more must be asked for, as on a GPU
        self.ptr = id(self)
        _BY_PTR[self.ptr] = self

    def _config(self, grid, block, shared_mem):
        """grid, block as three ints each, after the checks a GPU makes of a launch's configuration."""
        grid, block = _dims(grid, "grid", self.name), _dims(block, "block", self.name)
        if shared_mem > self.max_dynamic_shared_size_bytes or shared_mem > 227 * 1024:
            raise ValueError(f"emulated launch of {self.name}: {shared_mem} bytes of dynamic shared memory, beyond "
                             f"its limit {self.max_dynamic_shared_size_bytes} (set max_dynamic_shared_size_bytes; "
                             f"Hopper allows 227 KiB): CUDA fails the launch")
        threads = block[0] * block[1] * block[2]
        if threads > 1024 or grid[0] > 2 ** 31 - 1 or grid[1] > 65535 or grid[2] > 65535:
            raise ValueError(f"emulated launch of {self.name}: grid {grid}, block {block} beyond CUDA's limits")
        if self.bound is not None and threads > self.bound:
            raise ValueError(f"emulated launch of {self.name}: {threads} threads per block, beyond its "
                             f"__launch_bounds__({self.bound}) (CUDA: too many resources requested for launch)")
        return grid, block

    def _values(self, args):
        """Every argument checked against the kernel's signature -> its ctypes values (the slots' contents)."""
        args = tuple(args)
        if len(args) != len(self.params):
            raise TypeError(f"emulated launch of {self.name}: {len(args)} arguments, the kernel takes "
                            f"{len(self.params)} ({', '.join(p.text for p in self.params)})")
        values = []
        for i, (p, a) in enumerate(zip(self.params, args)):
            where = f"{self.name} argument {i} ({p.text})"
            if p.pointer:
                if not isinstance(a, DevArray):
                    raise TypeError(f"emulated launch of {where}: expected a device array, got {type(a).__name__}"
                                    + (" (a host NumPy array: CuPy cannot pass it)" if isinstance(a, np.ndarray)
                                       else ""))
                if a.dtype != p.dtype:
                    raise TypeError(f"emulated launch of {where}: expected dtype {p.dtype}, got {a.dtype}")
                if not a.flags.c_contiguous:
                    raise ValueError(f"emulated launch of {where}: the array is not C-contiguous (the kernel reads "
                                     f"its memory as rows; strides {a.strides})")
                if not p.const and not a.flags.writeable:
                    raise ValueError(f"emulated launch of {where}: a read-only array for an output")
                values.append(ctypes.c_void_p(a.ctypes.data if a.size else 0))
            else:
                if not isinstance(a, np.generic) or a.dtype != p.dtype:
                    raise TypeError(f"emulated launch of {where}: expected numpy.{p.dtype.name}, got "
                                    f"{type(a).__name__}" + (f" {a.dtype}" if isinstance(a, np.generic) else "")
                                    + " (CuPy passes a Python int as 8 bytes, a float as a double)")
                values.append(_CTYPES[p.dtype.type](a.item()))
        return values

    def refbert_check(self, grid, block, args, shared_mem=0):
        """Launch version 2's check (cuda_c.Packed calls it before packing): what __call__ checks, nothing run."""
        self._config(grid, block, shared_mem)
        self._values(args)

    def _run(self, grid, block, shared_mem, slots):
        COUNTS.launches[self.name] = COUNTS.launches.get(self.name, 0) + 1
        self.lib.cpusim_launch(self.tramp, slots, *grid, *block, int(shared_mem))

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        grid, block = self._config(grid, block, shared_mem)
        values = self._values(args)
        slots = (ctypes.c_void_p * max(1, len(values)))()
        for i, v in enumerate(values):
            slots[i] = ctypes.cast(ctypes.pointer(v), ctypes.c_void_p)
        self._run(grid, block, shared_mem, slots)


def _launch_kernel(f, gx, gy, gz, bx, by, bz, shared_mem, stream, kernel_params, extra):
    """cupy.cuda.driver.launchKernel emulated: the kernel `f` (a RawKernel's ptr) on the argument values whose
    addresses sit at kernel_params (one per parameter, as cuLaunchKernel reads them: the kernel's trampoline casts
    each to its parameter's C type)."""
    k = _BY_PTR.get(f)
    if k is None:
        raise ValueError(f"emulated launchKernel: {f!r} is no emulated kernel's ptr")
    if extra:
        raise ValueError("emulated launchKernel: `extra` is not emulated (pass kernel_params)")
    if kernel_params == 0 and k.params:
        raise ValueError(f"emulated launchKernel of {k.name}: no kernel_params for its {len(k.params)} parameters")
    grid, block = k._config((gx, gy, gz), (bx, by, bz), shared_mem)
    k._run(grid, block, shared_mem, ctypes.c_void_p(kernel_params or None))


class _Stream:
    """The current stream: the null stream (ptr 0); the emulated device runs each launch as it comes."""
    ptr = 0

    def synchronize(self):
        COUNTS.note("syncs", f"Stream.synchronize {_where()}")


_STREAM = _Stream()


class RawModule:
    """cupy.RawModule(code=..., options=...) of a csrc file: the emulated kernels of the file its code came from."""

    def __init__(self, code=None, options=(), path=None, name_expressions=None, backend=None):
        source = None
        for p in CSRC.glob("*.cu"):
            if code is not None and p.read_text() == code or path is not None and Path(path) == p:
                source = p.name
        if source is None:
            raise ValueError("emulated RawModule: only the sources of kernels/cuda/csrc can be emulated")
        self.source = source
        self.lib, self.sigs = build(source)
        self._kernels = {}

    def get_function(self, name):
        if name not in self._kernels:
            if name not in self.sigs:
                raise KeyError(f"emulated RawModule {self.source}: no kernel {name!r} (has {', '.join(self.sigs)})")
            params, bound = self.sigs[name]
            self._kernels[name] = RawKernel(self.lib, name, params, bound, self.source)
        return self._kernels[name]

    def get_global(self, name):
        """The module-scope variable `name` (a __constant__ or __device__ one: a plain global of the library): CuPy
        returns a MemoryPointer to it, this a DevArray of its 8 bytes (uint8) on the library's own memory, so a
        kernel launched after a write reads the value written."""
        try:
            var = ctypes.c_uint64.in_dll(self.lib, name)
        except ValueError:
            raise KeyError(f"emulated RawModule {self.source}: no global {name!r}") from None
        buf = (ctypes.c_uint8 * 8).from_address(ctypes.addressof(var))
        return np.frombuffer(buf, np.uint8).view(DevArray)


# ----------------------------------------------------------------------------------------------------------------
# the cupy namespace

def _poison(a):
    if a.dtype.kind == "f":
        a.fill(np.nan)
    elif a.dtype.kind in "iu":
        a.fill(np.iinfo(a.dtype).max)
    return a


def _to_device(a, dtype=None, what="cupy.asarray"):
    if isinstance(a, DevArray):
        return a if dtype is None or a.dtype == np.dtype(dtype) else a.astype(dtype)
    COUNTS.note("h2d", f"{what} {_where()}")
    return np.array(a, dtype=dtype, copy=True, order="C").view(DevArray)


class _Device:
    def __init__(self, i=0):
        self.id = i

    def synchronize(self):
        COUNTS.note("syncs", f"Device.synchronize {_where()}")

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class _Event:
    """Host wall time (the emulated device is synchronous): get_elapsed_time(a, b) is the time between the records."""
    t = 0.0

    def record(self, stream=None):
        import time
        self.t = time.perf_counter()

    def synchronize(self):
        COUNTS.note("syncs", f"Event.synchronize {_where()}")

    @property
    def done(self):
        return True


class _Pool:
    def used_bytes(self):
        return 0

    def total_bytes(self):
        return 0

    def free_all_blocks(self):
        pass


class _Runtime:
    @staticmethod
    def getDeviceCount():
        return 1

    @staticmethod
    def getDevice():
        return 0

    @staticmethod
    def memGetInfo():
        return 0, 0

    @staticmethod
    def getDeviceProperties(i):
        return {"name": b"emulated GPU (CPU threads)", "multiProcessorCount": 1, "totalGlobalMem": 0}

    @staticmethod
    def runtimeGetVersion():
        return 0


def _make_cupy():
    cp = types.ModuleType("cupy", "CuPy emulated on the CPU (refbert_kernels.cuda.emulate)")
    cp.EMULATED = True
    cp.ndarray = DevArray
    cp.COUNTS = COUNTS
    for name in ("float16", "float32", "float64", "int8", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                 "bool_", "dtype", "newaxis", "pi", "inf", "nan", "finfo", "iinfo"):
        setattr(cp, name, getattr(np, name))

    def creator(fn):
        def make(*args, **kwargs):
            return fn(*args, **kwargs).view(DevArray)
        make.__name__ = fn.__name__
        return make

    cp.empty = lambda shape, dtype=np.float64, order="C": _poison(np.empty(shape, dtype, order).view(DevArray))
    cp.empty_like = lambda a, dtype=None, order="K", shape=None: _poison(
        np.empty_like(np.asarray(a), dtype=dtype, shape=shape).view(DevArray))
    for name in ("zeros", "ones", "full", "arange", "linspace", "eye"):
        setattr(cp, name, creator(getattr(np, name)))
    cp.zeros_like = lambda a, dtype=None, shape=None: np.zeros_like(np.asarray(a), dtype=dtype, shape=shape).view(DevArray)
    cp.ones_like = lambda a, dtype=None, shape=None: np.ones_like(np.asarray(a), dtype=dtype, shape=shape).view(DevArray)
    cp.full_like = lambda a, v, dtype=None, shape=None: np.full_like(np.asarray(a), v, dtype=dtype,
                                                                     shape=shape).view(DevArray)
    cp.asarray = lambda a, dtype=None, order=None: _to_device(a, dtype)
    cp.array = lambda a, dtype=None, copy=True, order="K": (
        a.astype(dtype or a.dtype, copy=True) if isinstance(a, DevArray) else _to_device(a, dtype, "cupy.array"))

    def ascontiguousarray(a, dtype=None):
        if isinstance(a, DevArray):
            return np.ascontiguousarray(a.view(np.ndarray), dtype=dtype).view(DevArray)
        return _to_device(np.ascontiguousarray(a), dtype, "cupy.ascontiguousarray")
    cp.ascontiguousarray = ascontiguousarray

    def asnumpy(a, stream=None):
        if isinstance(a, DevArray):
            return a.get()
        return np.asarray(a)
    cp.asnumpy = asnumpy
    cp.get_array_module = lambda *args: cp if any(isinstance(a, DevArray) for a in args) else np
    cp.from_dlpack = lambda x: np.from_dlpack(x).view(DevArray)
    cp.RawModule = RawModule
    cp.cuda = types.SimpleNamespace(Device=_Device, Event=_Event, runtime=_Runtime,
                                    get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3,
                                    get_current_stream=lambda: _STREAM,
                                    driver=types.SimpleNamespace(launchKernel=_launch_kernel),
                                    alloc_pinned_memory=None)
    pool = _Pool()
    cp.get_default_memory_pool = lambda: pool

    def scatter_add(a, idx, b):
        np.add.at(a.view(np.ndarray), _unwrap(idx), _unwrap(b))
    cp.cupyx = types.SimpleNamespace(scatter_add=scatter_add)

    def fallback(name):
        fn = getattr(np, name)
        if not callable(fn):
            return fn

        def call(*args, **kwargs):
            host = _host_args(args)
            if host is not None:
                raise TypeError(f"emulated CuPy: cupy.{name} was given a NumPy array of shape {host.shape} (CuPy "
                                f"takes device arrays)")
            if name in _SYNCING:
                COUNTS.note("d2h", f"cupy.{name} {_where()}")
            return _wrap(fn(*_unwrap(args), **{k: _unwrap(v) for k, v in kwargs.items()}))
        call.__name__ = name
        return call
    cp.__getattr__ = fallback
    return cp


cupy = _make_cupy()
