"""kernels/cuda/blas.py without a GPU: the cublasLt bias GEMM's calls, read by a stand-in library that computes what
cuBLAS documents for them (column-major layouts, op(A) op(B), the BIAS epilogue along D's rows) on host memory, must
give x2 @ w^T + b; the ctypes struct matches cublasLt.h where the header is on this machine; off a GPU gemm_bias is
the GEMM and the add. (On a GPU, lt_usable() checks the real library against NumPy at its first call.)"""
import ctypes
import os
import shutil
import subprocess
import types
from pathlib import Path

import numpy as np
import pytest

import cudachild
from refbert_kernels.cuda import blas


class FakeLt:
    """cublasLt's calls as its documentation defines them, on host memory. Matrices are column-major (rows, cols,
    leading dimension), D = alpha op(A) op(B) + beta C, and CUBLASLT_EPILOGUE_BIAS adds bias[r] to every element of
    row r of D. Handles are integers; arguments come as the ctypes objects blas passes (byref, c_void_p, ints)."""

    def __init__(self):
        self.objs, self.calls = {}, []

    @staticmethod
    def _val(x):
        x = getattr(x, "_obj", x)                          # byref(obj) -> obj
        return x.value if hasattr(x, "value") else x

    def _new(self, out, obj):
        key = len(self.objs) + 1
        self.objs[key] = obj
        out._obj.value = key
        return 0

    def cublasLtCreate(self, out):
        return self._new(out, {"kind": "handle"})

    def cublasLtMatmulDescCreate(self, out, compute, scale):
        assert (compute, scale) == (blas.CUBLAS_COMPUTE_32F, blas.CUDA_R_32F)   # float32, never TF32
        return self._new(out, {"kind": "desc", blas.LT_DESC_TRANSA: 0, blas.LT_DESC_TRANSB: 0,
                               blas.LT_DESC_EPILOGUE: 1})

    # each attribute's type as cublasLt.h states it: TRANSA / TRANSB int32, EPILOGUE uint32, BIAS_POINTER a pointer;
    # the preference's MAX_WORKSPACE_BYTES uint64, MIN_ALIGNMENT_A..D_BYTES uint32
    DESC_SIZES = {3: 4, 4: 4, 7: 4, 8: 8}
    PREF_SIZES = {1: 8, 5: 4, 6: 4, 7: 4, 8: 4}

    def cublasLtMatmulDescSetAttribute(self, desc, attr, buf, size):
        assert ctypes.sizeof(buf._obj) == size == self.DESC_SIZES[attr], (attr, size)
        self.objs[self._val(desc)][attr] = self._val(buf)
        return 0

    def cublasLtMatrixLayoutCreate(self, out, dtype, rows, cols, ld):
        assert dtype == blas.CUDA_R_32F and ld >= rows
        return self._new(out, {"kind": "layout", "rows": rows, "cols": cols, "ld": ld})

    def cublasLtMatmulPreferenceCreate(self, out):
        return self._new(out, {"kind": "pref"})

    def cublasLtMatmulPreferenceSetAttribute(self, pref, attr, buf, size):
        assert ctypes.sizeof(buf._obj) == size == self.PREF_SIZES[attr], (attr, size)
        self.objs[self._val(pref)][attr] = self._val(buf)
        return 0

    algorithms = 1                                        # how many the heuristic finds (0: none, for the fallback)

    def cublasLtMatmulAlgoGetHeuristic(self, handle, desc, a, b, c, d, pref, count, results, n):
        assert count >= 1
        p = self.objs[self._val(pref)]
        assert all(p[k] in (16, 32, 64, 128, 256) for k in (5, 6, 7, 8)), p   # the pointers' own alignments
        n._obj.value = self.algorithms
        return 0

    def _matrix(self, ptr, layout):
        rows, cols, ld = layout["rows"], layout["cols"], layout["ld"]
        mem = np.ctypeslib.as_array((ctypes.c_float * (ld * cols)).from_address(ptr))
        return mem.reshape(cols, ld)[:, :rows].T                         # (rows, cols), column-major storage

    def cublasLtMatmul(self, handle, desc, alpha, A, a_l, B, b_l, beta, C, c_l, D, d_l, algo, ws, ws_size, stream):
        dsc = self.objs[self._val(desc)]
        la, lb, lc, ld = (self.objs[self._val(x)] for x in (a_l, b_l, c_l, d_l))
        opA = self._matrix(self._val(A), la)
        opB = self._matrix(self._val(B), lb)
        opA = opA.T if dsc[blas.LT_DESC_TRANSA] == 1 else opA          # cublasOperation_t: N = 0, T = 1
        opB = opB.T if dsc[blas.LT_DESC_TRANSB] == 1 else opB
        res = self._val(alpha) * (opA.astype(np.float64) @ opB.astype(np.float64))
        if self._val(beta) != 0:
            res += self._val(beta) * self._matrix(self._val(C), lc)
        if dsc[blas.LT_DESC_EPILOGUE] == blas.LT_EPILOGUE_BIAS:
            bias = np.ctypeslib.as_array((ctypes.c_float * ld["rows"]).from_address(dsc[blas.LT_DESC_BIAS_POINTER]))
            res += bias[:, None]
        assert res.shape == (ld["rows"], ld["cols"]), (res.shape, ld)
        self._matrix(self._val(D), ld)[...] = res
        self.calls.append(dsc[blas.LT_DESC_EPILOGUE])
        return 0


class _Dev:
    """A host array dressed as a device array for blas's raw calls (shape, dtype, data.ptr)."""

    def __init__(self, a):
        self.a, self.shape, self.dtype = a, a.shape, a.dtype
        self.data = types.SimpleNamespace(ptr=a.ctypes.data)


@pytest.fixture
def fake_lt(monkeypatch):
    lt = FakeLt()
    monkeypatch.setitem(blas._LT, "lib", lt)
    monkeypatch.setitem(blas._LT, "plans", {})
    monkeypatch.setitem(blas._STATE, "workspace", None)
    monkeypatch.setattr(blas, "_stream_ptr", lambda: 0)
    h = ctypes.c_void_p()
    lt.cublasLtCreate(ctypes.byref(h))
    monkeypatch.setitem(blas._LT, "handle", h)
    return lt


def _run(M, N, K, seed=0):
    r = np.random.default_rng(seed)
    x2, w, b = (r.standard_normal(s).astype(np.float32) for s in ((M, K), (N, K), (N,)))
    out = np.full((M, N), np.nan, np.float32)
    blas._raw_lt_bias(_Dev(x2), _Dev(w), _Dev(b), _Dev(out))
    return out, x2.astype(np.float64) @ w.T.astype(np.float64) + b


@pytest.mark.parametrize("M, N, K", [(5, 7, 3), (1, 33, 17), (37, 65, 129), (64, 96, 32)])
def test_lt_bias_gemm_calls_mean_x_wT_plus_b(fake_lt, M, N, K):
    out, want = _run(M, N, K)
    # the stand-in sums in float64 and rounds once to float32: half an ulp of float32 (6e-8 relative) at each
    # element's own size, and the sums of K products can cancel below their terms: atol 1e-6 * sqrt(K)
    assert np.all(np.abs(out - want) <= 1e-6 * np.sqrt(K) + 6e-8 * np.abs(want)), np.abs(out - want).max()
    assert fake_lt.calls == [blas.LT_EPILOGUE_BIAS]                # the bias in the epilogue: one call, no add


def test_lt_bias_gemm_stand_in_can_tell_a_wrong_transpose(fake_lt, monkeypatch):
    """The check above can fail: the same call with w not transposed (TRANSA = N) gives another product."""
    monkeypatch.setattr(blas, "CUBLAS_OP_T", blas.CUBLAS_OP_N)
    out, want = _run(6, 6, 6)                                   # square: the wrong call still runs
    assert not np.allclose(out, want, rtol=1e-3, atol=1e-3)


def test_lt_without_an_algorithm_falls_back_to_the_gemm_and_the_add(fake_lt, monkeypatch):
    """A shape cublasLt finds no algorithm for: gemm_bias says so once and runs the GEMM and the add (bit for bit the
    same operations as off a GPU); the answer is kept per shape and alignment, never a crash."""
    fake_lt.algorithms = 0
    monkeypatch.setattr(blas, "_gpu", lambda a: True)
    monkeypatch.setattr(blas, "lt_usable", lambda: (True, None))
    monkeypatch.setattr(blas, "_out", lambda xp, shape, dtype: np.empty(shape, dtype).view(_DevNP))
    monkeypatch.setattr(blas, "gemm", lambda a, b, ta, tb: np.asarray(a) @ np.asarray(b).T)
    r = np.random.default_rng(2)
    x2, w, b = (r.standard_normal(s).astype(np.float32).view(_DevNP) for s in ((8, 4), (4, 4), (4,)))
    for i in range(2):
        with pytest.warns(RuntimeWarning, match="cublasLt found no algorithm") if i == 0 else _no_warning():
            out = blas.gemm_bias(x2, w, b)
        ref = np.asarray(x2) @ np.asarray(w).T
        ref += np.asarray(b)
        assert np.array_equal(out, ref)
    plans = list(blas._LT["plans"].values())   # (one per alignment of the pointers: a fresh output may differ)
    assert plans and all(isinstance(p, str) for p in plans) and fake_lt.calls == []


class _DevNP(np.ndarray):
    """A NumPy array with a device array's data.ptr (what gemm_bias reads)."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


class _no_warning:
    def __enter__(self):
        import warnings
        self.w = warnings.catch_warnings()
        self.w.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        return self.w.__exit__(*exc)


def test_gemm_bias_off_a_gpu_is_the_gemm_and_the_add():
    r = np.random.default_rng(1)
    x2, w, b = (r.standard_normal(s).astype(np.float32) for s in ((9, 5), (4, 5), (4,)))
    out = blas.gemm_bias(x2, w, b)
    ref = x2 @ w.T
    ref += b
    assert out.dtype == np.float32 and np.array_equal(out, ref)     # the same operations: the same bits


def test_lt_heuristic_struct_layout():
    """cublasLtMatmulHeuristicResult_t: 96 bytes, workspaceSize at 64, state at 72, wavesCount at 76 (cublasLt.h of
    CUDA 13 as gcc lays it out; test_lt_constants_match_the_header reads the header itself where it is)."""
    S = blas._LtHeuristic
    assert (ctypes.sizeof(S), S.workspaceSize.offset, S.state.offset, S.wavesCount.offset) == (96, 64, 72, 76)


def test_lt_constants_match_the_header(tmp_path):
    """The struct's layout and every enum value blas passes, printed by a C program compiled against cublasLt.h
    (CUBLASLT_H=<path>, or a CUDA include directory; the pip wheel nvidia-cublas carries it too)."""
    places = [os.environ.get("CUBLASLT_H", ""), "/usr/local/cuda/include/cublasLt.h", "/usr/include/cublasLt.h"]
    header = next((Path(p) for p in places if p and Path(p).exists()), None)
    if header is None or shutil.which("gcc") is None:
        pytest.skip("cublasLt.h is not on this machine (CUBLASLT_H=<path>)")
    src = tmp_path / "lt.c"
    values = ["sizeof(cublasLtMatmulHeuristicResult_t)", "O(workspaceSize)", "O(state)", "O(wavesCount)",
              "CUBLASLT_MATMUL_DESC_TRANSA", "CUBLASLT_MATMUL_DESC_TRANSB", "CUBLASLT_MATMUL_DESC_EPILOGUE",
              "CUBLASLT_MATMUL_DESC_BIAS_POINTER", "CUBLASLT_EPILOGUE_BIAS", "CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES",
              "CUBLAS_COMPUTE_32F", "CUDA_R_32F"] + [f"CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_{m}_BYTES" for m in "ABCD"]
    src.write_text("#include <stdio.h>\n#include <stddef.h>\n#include <cublasLt.h>\n"
                   "#define O(f) offsetof(cublasLtMatmulHeuristicResult_t, f)\nint main() {\n"
                   + "".join(f'    printf("%lld ", (long long)({v}));\n' for v in values) + "    return 0;\n}\n")
    inc = ["-I", str(header.parent)] + [a for d in ("/usr/local/cuda/include", "/usr/local/cuda-13.0/include")
                                        if Path(d).exists() for a in ("-I", d)]
    res = subprocess.run(["gcc", str(src), *inc, "-o", str(tmp_path / "lt")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    got = [int(t) for t in subprocess.run([str(tmp_path / "lt")], capture_output=True, text=True).stdout.split()]
    assert got == [96, 64, 72, 76, blas.LT_DESC_TRANSA, blas.LT_DESC_TRANSB, blas.LT_DESC_EPILOGUE,
                   blas.LT_DESC_BIAS_POINTER, blas.LT_EPILOGUE_BIAS, blas.LT_PREF_MAX_WORKSPACE_BYTES,
                   blas.CUBLAS_COMPUTE_32F, blas.CUDA_R_32F, *(blas.LT_PREF_MIN_ALIGNMENT[m] for m in "ABCD")], got


def test_gpu_lt_bias_gemm_equals_gemm_and_add():
    """On a GPU: cublasLt loads and passes its self-check, and gemm_bias at BERT-base's linear shapes equals cuBLAS's
    GEMM followed by the add (float32 sums of 768 / 3072 products in possibly another order: 1e-5 relative to
    the largest output)."""
    if cudachild.run("import cupy; assert cupy.cuda.runtime.getDeviceCount() > 0", sim=False, timeout=120).returncode:
        pytest.skip("no CUDA GPU usable through CuPy")
    out = cudachild.check(cudachild.run("""
        import numpy as np
        from refbert_kernels.cuda import backend as B, blas
        assert B.MODE == "gpu", B.MODE
        ok, why = blas.lt_usable()
        assert ok, why
        xp = B.xp
        rng = np.random.default_rng(0)
        for M, N, K in ((4096, 768, 768), (4096, 3072, 768), (4096, 768, 3072), (77, 30522, 768)):
            x2, w, b = (xp.asarray(rng.standard_normal(s).astype(np.float32)) for s in ((M, K), (N, K), (N,)))
            got = blas.gemm_bias(x2, w, b)
            ref = blas.gemm(x2, w, False, True) + b
            err = float(xp.abs(got - ref).max()) / float(xp.abs(ref).max())
            assert err <= 1e-5, (M, N, K, err)
        print("LT OK")
    """, sim=False, timeout=300))
    assert "LT OK" in out, out
