"""cuBLAS GEMMs called through ctypes on the handle CuPy made: the very calls CuPy's wrappers make (cublasGemmEx,
cublasGemmStridedBatchedEx), minus the wrappers' refusal to run while a stream is captured (cupy_backends'
cublas.setStream raises NotImplementedError then, "currently unsupported" in CuPy; cuBLAS itself supports stream
capture, and from CUDA 12.2 allocates its workspace stream-ordered). The cuda backend's GEMMs go through here on a
GPU, eager or captured (kernels/cuda/graph.py), so a captured step replays the eager step's own calls.

    gemm(a, b, ta, tb, out_dtype)        op(a) @ op(b), a and b C-contiguous 2-D device arrays (op: transpose)
    gemm_batched(a, b, ta, tb, out_dtype)   the same per index of the leading axis of 3-D arrays

a and b are float32 / float64 arrays (computed in their own precision: CUBLAS_COMPUTE_32F / 64F, never TF32), or
uint16 arrays holding bfloat16 / float16 bit patterns (kind="bfloat16" / "float16": tensor cores with float32
accumulation and a float32 result, the mixed-precision GEMM).

Row-major arrays seen by column-major cuBLAS are their transposes: C = op(a) op(b) is computed as
C^T = op(b)^T op(a)^T, so cuBLAS's first operand is b (transposed iff tb), its second a (iff ta), and m, n = the
columns and rows of C.

The library is the libcublas CuPy loaded (found in /proc/self/maps); its workspace is a buffer of ours
(WORKSPACE_MB). At the first call a self-check compares a
small GEMM of every transposition with cupy.matmul; if the library is not found or the check fails, `usable()`
says why, the GEMMs go through CuPy (cupy.matmul, or CuPy's wrapper of the same cuBLAS call for 16-bit operands:
eager steps unchanged) and a graph capture refuses.
"""
import ctypes
import ctypes.util
import os
import re

import numpy as np

from . import _common as C

CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUDA_R_32F, CUDA_R_64F, CUDA_R_16F, CUDA_R_16BF = 0, 1, 2, 14
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_64F = 68, 70
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_POINTER_MODE_HOST = 0
_TYPES = {"float32": (CUDA_R_32F, CUBLAS_COMPUTE_32F), "float64": (CUDA_R_64F, CUBLAS_COMPUTE_64F),
          "bfloat16": (CUDA_R_16BF, CUBLAS_COMPUTE_32F), "float16": (CUDA_R_16F, CUBLAS_COMPUTE_32F)}

_STATE = {"lib": None, "why": None, "checked": False, "workspace": None}
WORKSPACE_MB = 32   # cuBLAS's scratch memory, ours (cublasSetWorkspace after every setStream): one cudaMalloc made
#                     outside any capture, so a captured GEMM never allocates (cuBLAS's own pool inside a capture
#                     gave garbage on the H100 when the GEMM shapes changed: tiny shapes, split-K). 32 MiB: NVIDIA's
#                     size for Hopper. REFBERT_CUBLAS_WORKSPACE_MB=0 leaves cuBLAS its own.


def _find():
    """The libcublas CuPy's cuBLAS module loaded (its path from /proc/self/maps), opened again (the same copy)."""
    from cupy_backends.cuda.libs import cublas  # noqa: F401  (loads libcublas)
    path = None
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                m = re.search(r"(/\S*/libcublas\.so[.\d]*)$", line.strip())
                if m:
                    path = m.group(1)
                    break
    except OSError:
        pass
    path = path or ctypes.util.find_library("cublas")
    if path is None:
        raise OSError("no libcublas in this process's memory map and none on the library path")
    lib = ctypes.CDLL(path)
    vp, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.cublasSetStream_v2.argtypes = [vp, vp]
    lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
    lib.cublasGetPointerMode_v2.argtypes = [vp, ctypes.POINTER(i)]
    lib.cublasSetPointerMode_v2.argtypes = [vp, i]
    lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
    lib.cublasGemmStridedBatchedEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, ll, vp, i, i, ll, vp, vp, i, i, ll,
                                               i, i, i]
    for fn in ("cublasSetStream_v2", "cublasSetWorkspace_v2", "cublasGetPointerMode_v2", "cublasSetPointerMode_v2",
               "cublasGemmEx", "cublasGemmStridedBatchedEx"):
        getattr(lib, fn).restype = i
    return lib


def _check(status, what):
    if status != 0:
        raise RuntimeError(f"cuBLAS {what} returned status {status}")


_WRAPPERS = {"cublasGemmEx": "gemmEx", "cublasGemmStridedBatchedEx": "gemmStridedBatchedEx"}


def _call(fn, *args):
    """fn(handle, *args) on CuPy's handle and current stream, host pointer mode (restored after): through ctypes,
    or, where usable() found no library, through CuPy's own wrapper of the same function (the same arguments;
    eager only: it refuses to run during a capture)."""
    import cupy
    lib = _STATE["lib"]
    if lib is None:
        from cupy_backends.cuda.libs import cublas
        h = cupy.cuda.device.get_cublas_handle()
        mode = cublas.getPointerMode(h)
        cublas.setPointerMode(h, CUBLAS_POINTER_MODE_HOST)
        try:
            getattr(cublas, _WRAPPERS[fn])(h, *(a.value if isinstance(a, ctypes.c_void_p) else a for a in args))
        finally:
            cublas.setPointerMode(h, mode)
        return
    handle = ctypes.c_void_p(cupy.cuda.device.get_cublas_handle())
    _check(lib.cublasSetStream_v2(handle, ctypes.c_void_p(cupy.cuda.get_current_stream().ptr)), "setStream")
    ws = _STATE.get("workspace")
    if ws is not None:                          # (setStream resets the workspace to cuBLAS's own: set it after)
        _check(lib.cublasSetWorkspace_v2(handle, ctypes.c_void_p(ws.ptr), ws.size), "setWorkspace")
    mode = ctypes.c_int()
    _check(lib.cublasGetPointerMode_v2(handle, ctypes.byref(mode)), "getPointerMode")
    _check(lib.cublasSetPointerMode_v2(handle, CUBLAS_POINTER_MODE_HOST), "setPointerMode")
    try:
        _check(getattr(lib, fn)(handle, *args), fn)
    finally:
        lib.cublasSetPointerMode_v2(handle, mode.value)


def _scalars(out_dtype):
    t = ctypes.c_double if np.dtype(out_dtype) == np.float64 else ctypes.c_float
    one, zero = t(1.0), t(0.0)                 # (kept alive by the caller until the call returns)
    return one, zero, ctypes.c_void_p(ctypes.addressof(one)), ctypes.c_void_p(ctypes.addressof(zero))


def _kind(a, kind):
    k = kind or np.dtype(a.dtype).name
    if k not in _TYPES:
        raise ValueError(f"gemm: argument 'a' expected float32, float64, or uint16 bits with kind 'bfloat16' / "
                         f"'float16', got dtype {a.dtype} with kind {kind!r}")
    return _TYPES[k]


def _raw_gemm(a, b, ta, tb, out, kind=None):
    dt, compute = _kind(a, kind)
    M, K = (a.shape[1], a.shape[0]) if ta else a.shape
    N = b.shape[0] if tb else b.shape[1]
    keep = _scalars(out.dtype)
    _call("cublasGemmEx", CUBLAS_OP_T if tb else CUBLAS_OP_N, CUBLAS_OP_T if ta else CUBLAS_OP_N, N, M, K, keep[2],
          ctypes.c_void_p(b.data.ptr), dt, b.shape[1], ctypes.c_void_p(a.data.ptr), dt, a.shape[1], keep[3],
          ctypes.c_void_p(out.data.ptr), _TYPES[np.dtype(out.dtype).name][0], N, compute, CUBLAS_GEMM_DEFAULT)
    return out


def _raw_batched(a, b, ta, tb, out, kind=None):
    dt, compute = _kind(a, kind)
    nb = a.shape[0]
    M, K = (a.shape[2], a.shape[1]) if ta else a.shape[1:]
    N = b.shape[1] if tb else b.shape[2]
    keep = _scalars(out.dtype)
    _call("cublasGemmStridedBatchedEx", CUBLAS_OP_T if tb else CUBLAS_OP_N, CUBLAS_OP_T if ta else CUBLAS_OP_N,
          N, M, K, keep[2], ctypes.c_void_p(b.data.ptr), dt, b.shape[2], b.shape[1] * b.shape[2],
          ctypes.c_void_p(a.data.ptr), dt, a.shape[2], a.shape[1] * a.shape[2], keep[3],
          ctypes.c_void_p(out.data.ptr), _TYPES[np.dtype(out.dtype).name][0], N, M * N, nb, compute,
          CUBLAS_GEMM_DEFAULT)
    return out


def usable():
    """(True, None) when the GEMMs run through ctypes here; (False, why) otherwise. Checked once per process:
    every transposition of a 5 x 7 x 3 float32 GEMM and a batched one against cupy.matmul (the same sums of three
    products: rtol 1e-6)."""
    if not _STATE["checked"]:
        _STATE["checked"] = True
        try:
            import cupy
            _STATE["lib"] = _find()
            mb = int(os.environ.get("REFBERT_CUBLAS_WORKSPACE_MB", WORKSPACE_MB))
            _STATE["workspace"] = cupy.cuda.Memory(mb << 20) if mb > 0 else None
            rng = np.random.default_rng(0)
            for ta in (False, True):
                for tb in (False, True):
                    a = rng.standard_normal((3, 5) if ta else (5, 3)).astype(np.float32)
                    b = rng.standard_normal((7, 3) if tb else (3, 7)).astype(np.float32)
                    want = (a.T if ta else a) @ (b.T if tb else b)
                    got = _raw_gemm(cupy.asarray(a), cupy.asarray(b), ta, tb, cupy.empty((5, 7), np.float32)).get()
                    if not np.allclose(got, want, rtol=1e-6, atol=1e-6):
                        raise RuntimeError(f"the self-check GEMM (ta={ta}, tb={tb}) differs from NumPy's")
                    a3, b3 = np.stack([a, -a]), np.stack([b, 2 * b])
                    got = _raw_batched(cupy.asarray(a3), cupy.asarray(b3), ta, tb,
                                       cupy.empty((2, 5, 7), np.float32)).get()
                    if not np.allclose(got, np.stack([want, -2 * want]), rtol=1e-6, atol=1e-6):
                        raise RuntimeError(f"the self-check batched GEMM (ta={ta}, tb={tb}) differs from NumPy's")
        except Exception as e:
            _STATE["lib"], _STATE["why"] = None, f"{type(e).__name__}: {e}"
    return _STATE["lib"] is not None, _STATE["why"]


def _out(xp, shape, dtype):
    """A GEMM's output array: uninitialised (beta = 0: cuBLAS never reads it), or zeroed first with
    REFBERT_BLAS_ZERO_OUT=1 (a diagnostic of benchmarks/graph_diag.py: does a small GEMM read its output?)."""
    if os.environ.get("REFBERT_BLAS_ZERO_OUT", "0") not in ("", "0"):
        return xp.zeros(shape, dtype)
    return xp.empty(shape, dtype)


def _gpu(a):
    from . import versions
    return versions.MODE == "gpu" and C.on_device(a)


def _product(a, b, ta, tb, out_dtype, kind, raw):
    """gemm() and gemm_batched(): op(a) @ op(b) over the last two axes (a leading batch axis or none)."""
    xp = C.xp_of(a)
    if not _gpu(a) or (kind is None and not usable()[0]):
        if kind is not None:
            raise ValueError("gemm: 16-bit operands need cuBLAS (a GPU)")
        return xp.matmul(xp.swapaxes(a, -1, -2) if ta else a, xp.swapaxes(b, -1, -2) if tb else b)
    usable()                                   # (16-bit operands without the ctypes library: CuPy's wrapper)
    out_dtype = np.dtype(out_dtype or (np.float32 if kind else a.dtype))
    M, K = (a.shape[-1], a.shape[-2]) if ta else a.shape[-2:]
    N = b.shape[-2] if tb else b.shape[-1]
    out = _out(xp, (*a.shape[:-2], M, N), out_dtype)
    if out.size == 0:
        return out
    if K == 0:
        out.fill(0)
        return out
    return raw(a, b, ta, tb, out, kind)


def gemm(a, b, ta=False, tb=False, out_dtype=None, kind=None):
    """op(a) @ op(b) as a new (M, N) array of out_dtype (default: a's dtype; float32 for 16-bit bits). a, b:
    C-contiguous 2-D arrays. Off a GPU: the array module's matmul (16-bit bits are then not accepted: the mixed
    path passes float32 operands there); on a GPU where usable() is False: cupy.matmul for float32 / float64,
    CuPy's cublasGemmEx wrapper for 16-bit bits."""
    return _product(a, b, ta, tb, out_dtype, kind, _raw_gemm)


def gemm_batched(a, b, ta=False, tb=False, out_dtype=None, kind=None):
    """op(a[i]) @ op(b[i]) for every i, a new (nb, M, N) array; a, b: C-contiguous 3-D arrays. As gemm()."""
    return _product(a, b, ta, tb, out_dtype, kind, _raw_batched)
