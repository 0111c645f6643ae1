"""cuBLAS GEMMs called through ctypes on the handle CuPy made: the very calls CuPy's wrappers make (cublasGemmEx,
cublasGemmStridedBatchedEx), minus the wrappers' refusal to run while a stream is captured (cupy_backends'
cublas.setStream raises NotImplementedError then, "currently unsupported" in CuPy; cuBLAS itself supports stream
capture, and from CUDA 12.2 allocates its workspace stream-ordered). The cuda backend's GEMMs go through here on a
GPU, eager or captured (kernels/cuda/graph.py), so a captured step replays the eager step's own calls.

    gemm(a, b, ta, tb, out_dtype)        op(a) @ op(b), a and b C-contiguous 2-D device arrays (op: transpose)
    gemm_batched(a, b, ta, tb, out_dtype)   the same per index of the leading axis of 3-D arrays
    gemm_bias(x2, w, b)                  x2 @ w^T + b in float32, the bias added in the GEMM's epilogue (cublasLt,
                                         CUBLASLT_EPILOGUE_BIAS: no separate add kernel; the linear forward)

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

gemm_bias runs cublasLtMatmul (libcublasLt, the library beside that libcublas; its own handle; the same workspace)
with D = x2 @ w^T + b, computed as cuBLAS's column-major D^T = op_T(w) x2^T with the bias along D^T's rows. The
epilogue adds b to the float32 product and rounds once, as the add it replaces does (the same bits where cuBLAS
picks the same product). lt_usable() loads it once per process and self-checks it against NumPy (shapes with tails
and M = 1); where it cannot (no library, no algorithm for a shape, a failed check, REFBERT_CUBLASLT=0, float64,
a pointer not 16-byte aligned) gemm_bias is gemm() and the add, and lt_usable() says why (the backend's describe()
prints it).
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


def _loaded(name):
    """lib<name>.so as this process already has it (its path from /proc/self/maps), opened again (the same copy), or
    else the one on the library path."""
    path = None
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                m = re.search(rf"(/\S*/lib{name}\.so[.\d]*)$", line.strip())
                if m:
                    path = m.group(1)
                    break
    except OSError:
        pass
    path = path or ctypes.util.find_library(name)
    if path is None:
        raise OSError(f"no lib{name} in this process's memory map and none on the library path")
    return ctypes.CDLL(path)


def _find():
    """The libcublas CuPy's cuBLAS module loaded."""
    from cupy_backends.cuda.libs import cublas  # noqa: F401  (loads libcublas)
    lib = _loaded("cublas")
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


def _raw_gemm(a, b, ta, tb, out, kind=None, accumulate=False):
    dt, compute = _kind(a, kind)
    M, K = (a.shape[1], a.shape[0]) if ta else a.shape
    N = b.shape[0] if tb else b.shape[1]
    keep = _scalars(out.dtype)
    _call("cublasGemmEx", CUBLAS_OP_T if tb else CUBLAS_OP_N, CUBLAS_OP_T if ta else CUBLAS_OP_N, N, M, K, keep[2],
          ctypes.c_void_p(b.data.ptr), dt, b.shape[1], ctypes.c_void_p(a.data.ptr), dt, a.shape[1],
          keep[2] if accumulate else keep[3],                     # beta = 1: out += product
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
    every transposition of a 5 x 7 x 3 float32 GEMM, the same summed into an array (beta = 1), and a batched one
    against NumPy (the same sums of three products: rtol 1e-6)."""
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
                    acc = rng.standard_normal((5, 7)).astype(np.float32)      # beta = 1 (gemm's acc)
                    got = _raw_gemm(cupy.asarray(a), cupy.asarray(b), ta, tb, cupy.asarray(acc), None, True).get()
                    if not np.allclose(got, want + acc, rtol=1e-6, atol=1e-6):
                        raise RuntimeError(f"the self-check GEMM into a sum (ta={ta}, tb={tb}) differs from NumPy's")
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


def _bits_f32(a, kind):
    """uint16 bit patterns of bfloat16 / float16 values -> those values as float32 (exact): off a GPU."""
    if a.dtype != np.uint16:
        raise ValueError(f"gemm: 16-bit operands expected uint16 bit patterns, got dtype {a.dtype}")
    if kind == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.view(np.float16).astype(np.float32)


def _gpu(a):
    return C.sibling("versions").MODE == "gpu" and C.on_device(a)


def _product(a, b, ta, tb, out_dtype, kind, raw):
    """gemm() and gemm_batched(): op(a) @ op(b) over the last two axes (a leading batch axis or none)."""
    xp = C.xp_of(a)
    if not _gpu(a) or (kind is None and not usable()[0]):
        if kind is not None:                   # (the emulator: the bits' values, exact in float32, as the tensor
            _kind(a, kind)                     # cores read them; float32 products and sums)
            a, b = _bits_f32(a, kind), _bits_f32(b, kind)
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


def gemm(a, b, ta=False, tb=False, out_dtype=None, kind=None, acc=None):
    """op(a) @ op(b) as a new (M, N) array of out_dtype (default: a's dtype; float32 for 16-bit bits). a, b:
    C-contiguous 2-D arrays. Off a GPU: the array module's matmul (16-bit bits converted to their float32 values
    first: the emulator runs the GPU's mixed path); on a GPU where usable() is False: cupy.matmul for float32 /
    float64, CuPy's cublasGemmEx wrapper for 16-bit bits.
    acc: a C-contiguous (M, N) array of a's float dtype: the product is added into it and acc returned, in the GEMM
    (beta = 1: one rounding of product + acc, as the add; cuBLAS may choose another algorithm than for beta = 0,
    so the product's own float32 sums may come in another order) where the ctypes library runs it, else by an add
    after."""
    if acc is None:
        return _product(a, b, ta, tb, out_dtype, kind, _raw_gemm)
    M, N = (a.shape[-1] if ta else a.shape[-2]), (b.shape[-2] if tb else b.shape[-1])
    K = a.shape[-2] if ta else a.shape[-1]
    if (kind is None and _gpu(a) and usable()[0] and acc.shape == (M, N) and acc.dtype == a.dtype
            and acc.flags.c_contiguous and acc.size and K):
        return _raw_gemm(a, b, ta, tb, acc, None, accumulate=True)
    acc += _product(a, b, ta, tb, out_dtype, kind, _raw_gemm)
    return acc


def gemm_batched(a, b, ta=False, tb=False, out_dtype=None, kind=None):
    """op(a[i]) @ op(b[i]) for every i, a new (nb, M, N) array; a, b: C-contiguous 3-D arrays. As gemm()."""
    return _product(a, b, ta, tb, out_dtype, kind, _raw_batched)


# ----------------------------------------------------------------------------------------------------------------
# cublasLt: the linear forward's GEMM with its bias in the epilogue (values from cublasLt.h, CUDA 13)

LT_DESC_TRANSA, LT_DESC_TRANSB, LT_DESC_EPILOGUE, LT_DESC_BIAS_POINTER = 3, 4, 7, 8
LT_EPILOGUE_BIAS = 4
LT_PREF_MAX_WORKSPACE_BYTES = 1
LT_PREF_MIN_ALIGNMENT = {"A": 5, "B": 6, "C": 7, "D": 8}      # uint32 bytes, default 256


class _LtHeuristic(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t: the algorithm (64 opaque bytes), its workspace, a status, waves, reserved
    (96 bytes; offsets 0, 64, 72, 76 as gcc lays out the header's struct)."""
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


_LT = {"lib": None, "handle": None, "why": None, "checked": False, "plans": {}}


def _find_lt():
    """The libcublasLt beside that libcublas (loaded with it)."""
    lib = _loaded("cublasLt")
    vp, i, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
    sig = {"cublasLtCreate": [vp], "cublasLtMatmulDescCreate": [vp, i, i],
           "cublasLtMatmulDescSetAttribute": [vp, i, vp, sz], "cublasLtMatrixLayoutCreate": [vp, i, u64, u64, i64],
           "cublasLtMatmulPreferenceCreate": [vp], "cublasLtMatmulPreferenceSetAttribute": [vp, i, vp, sz],
           "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i, vp, vp],
           "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp]}
    for name, args in sig.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = i
    return lib


def _lt_new(create, *args):
    h = ctypes.c_void_p()
    _check(getattr(_LT["lib"], create)(ctypes.byref(h), *args), create)
    return h


def _lt_set(setter, obj, attr, value):
    _check(getattr(_LT["lib"], setter)(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), f"{setter}({attr})")


def _align(ptr):
    """The alignment a pointer has, in bytes (its lowest set bit), up to 256 (cublasLt's default requirement)."""
    return min(256, ptr & -ptr) if ptr else 256


def _lt_plan(M, N, K, x_ptr, w_ptr, b_ptr, out_ptr):
    """(op desc, A, B, C/D layouts, algorithm) for D^T (N x M) = w^T-op (N x K) times x2^T (K x M), cached per
    shape and the pointers' alignments (the heuristic's choice depends on both: the preference states A's, B's and
    D's, the bias pointer's value its own). Where cublasLt has none the RuntimeError is cached too: raised again,
    the same words, without asking again."""
    key = (M, N, K, _align(x_ptr), _align(w_ptr), _align(b_ptr), _align(out_ptr))
    plan = _LT["plans"].get(key)
    if isinstance(plan, str):
        raise RuntimeError(plan)
    if plan is None:
        try:
            plan = _LT["plans"][key] = _lt_new_plan(M, N, K, b_ptr, x_ptr, w_ptr, out_ptr)
        except RuntimeError as e:
            _LT["plans"][key] = str(e)
            raise
    return plan


def _lt_new_plan(M, N, K, b_ptr, x_ptr, w_ptr, out_ptr):
    lib = _LT["lib"]
    desc = _lt_new("cublasLtMatmulDescCreate", CUBLAS_COMPUTE_32F, CUDA_R_32F)
    _lt_set("cublasLtMatmulDescSetAttribute", desc, LT_DESC_TRANSA, ctypes.c_int32(CUBLAS_OP_T))
    _lt_set("cublasLtMatmulDescSetAttribute", desc, LT_DESC_TRANSB, ctypes.c_int32(CUBLAS_OP_N))
    _lt_set("cublasLtMatmulDescSetAttribute", desc, LT_DESC_EPILOGUE, ctypes.c_uint32(LT_EPILOGUE_BIAS))
    _lt_set("cublasLtMatmulDescSetAttribute", desc, LT_DESC_BIAS_POINTER, ctypes.c_void_p(b_ptr))
    a_l = _lt_new("cublasLtMatrixLayoutCreate", CUDA_R_32F, K, N, K)      # w (N, K) row-major: K x N
    b_l = _lt_new("cublasLtMatrixLayoutCreate", CUDA_R_32F, K, M, K)      # x2 (M, K) row-major: K x M
    d_l = _lt_new("cublasLtMatrixLayoutCreate", CUDA_R_32F, N, M, N)      # out (M, N) row-major: N x M
    pref = _lt_new("cublasLtMatmulPreferenceCreate")
    ws = _STATE.get("workspace")
    _lt_set("cublasLtMatmulPreferenceSetAttribute", pref, LT_PREF_MAX_WORKSPACE_BYTES,
            ctypes.c_uint64(ws.size if ws is not None else 0))
    for m, ptr in (("A", w_ptr), ("B", x_ptr), ("C", out_ptr), ("D", out_ptr)):
        _lt_set("cublasLtMatmulPreferenceSetAttribute", pref, LT_PREF_MIN_ALIGNMENT[m],
                ctypes.c_uint32(_align(ptr)))
    res, n = _LtHeuristic(), ctypes.c_int(0)
    _check(lib.cublasLtMatmulAlgoGetHeuristic(_LT["handle"], desc, a_l, b_l, d_l, d_l, pref, 1,
                                              ctypes.byref(res), ctypes.byref(n)), "cublasLtMatmulAlgoGetHeuristic")
    if n.value < 1:
        raise RuntimeError(f"cublasLt found no algorithm for the bias GEMM M={M} N={N} K={K}")
    return desc, a_l, b_l, d_l, res


def _stream_ptr():
    import cupy
    return cupy.cuda.get_current_stream().ptr


def _raw_lt_bias(x2, w, b, out):
    M, K = x2.shape
    N = w.shape[0]
    desc, a_l, b_l, d_l, res = _lt_plan(M, N, K, x2.data.ptr, w.data.ptr, b.data.ptr, out.data.ptr)
    _lt_set("cublasLtMatmulDescSetAttribute", desc, LT_DESC_BIAS_POINTER, ctypes.c_void_p(b.data.ptr))
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    ws = _STATE.get("workspace")
    o = ctypes.c_void_p(out.data.ptr)                   # C (never read: beta = 0) and D
    _check(_LT["lib"].cublasLtMatmul(_LT["handle"], desc, ctypes.byref(one), ctypes.c_void_p(w.data.ptr), a_l,
                                     ctypes.c_void_p(x2.data.ptr), b_l, ctypes.byref(zero), o, d_l, o, d_l,
                                     ctypes.byref(res.algo),
                                     ctypes.c_void_p(ws.ptr if ws is not None else 0),
                                     ws.size if ws is not None else 0,
                                     ctypes.c_void_p(_stream_ptr())), "cublasLtMatmul")
    return out


def lt_usable():
    """(True, None) when gemm_bias runs cublasLt here; (False, why) otherwise. Checked once per process: x2 @ w^T + b
    at 5 x 7 x 3, 1 x 33 x 17 and 37 x 65 x 129 against NumPy in float64 (float32 sums of at most 129 products of
    standard normals: rtol 1e-5, atol 1e-5)."""
    if not _LT["checked"]:
        _LT["checked"] = True
        try:
            if os.environ.get("REFBERT_CUBLASLT", "1") == "0":
                raise RuntimeError("REFBERT_CUBLASLT=0")
            import cupy
            ok, why = usable()                          # (the workspace, and libcublas loaded)
            if not ok:
                raise RuntimeError(f"cuBLAS through ctypes is not usable ({why})")
            _LT["lib"] = _find_lt()
            _LT["handle"] = _lt_new("cublasLtCreate")
            rng = np.random.default_rng(1)
            for M, N, K in ((5, 7, 3), (1, 33, 17), (37, 65, 129)):
                x2, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((M, K), (N, K), (N,)))
                want = x2.astype(np.float64) @ w.T.astype(np.float64) + b
                got = _raw_lt_bias(cupy.asarray(x2), cupy.asarray(w), cupy.asarray(b),
                                   cupy.empty((M, N), np.float32)).get()
                if not np.allclose(got, want, rtol=1e-5, atol=1e-5):
                    raise RuntimeError(f"the self-check bias GEMM (M={M} N={N} K={K}) differs from NumPy's")
        except Exception as e:
            _LT["lib"], _LT["why"] = None, f"{type(e).__name__}: {e}"
    return _LT["lib"] is not None, _LT["why"]


def gemm_bias(x2, w, b):
    """x2 @ w^T + b: x2 (M, K), w (N, K), b (N,) C-contiguous float32 device arrays -> a new (M, N) array, one
    cublasLt GEMM with the bias in its epilogue where lt_usable() and every pointer is 16-byte aligned; else gemm()
    and the add (float64, off a GPU, or where cublasLt is not usable here)."""
    fits = (_gpu(x2) and x2.dtype == np.float32 and w.dtype == np.float32 and b.dtype == np.float32
            and x2.size and w.size and all(a.data.ptr % 16 == 0 for a in (x2, w, b)) and b.flags.c_contiguous)
    if fits and lt_usable()[0]:
        out = _out(C.xp_of(x2), (x2.shape[0], w.shape[0]), np.float32)
        try:
            return _raw_lt_bias(x2, w, b, out)
        except RuntimeError as e:                       # (no algorithm for this shape, a failed call: said once)
            if _LT.get("said") != str(e):
                _LT["said"] = str(e)
                import warnings
                warnings.warn(f"refbert cuda: {e}; the GEMM and an add instead", RuntimeWarning, stacklevel=2)
    out = gemm(x2, w, False, True)
    out += b
    return out
