"""The CUDA C sources (kernels/cuda/csrc/*.cu) compile for sm_90, and, on a machine with a GPU, match the oracle.

1. test_cu_compiles: every .cu is compiled with nvcc as a standalone file (`nvcc -arch=sm_90 -std=c++17 -c`,
   the validating main included, so host code is checked too; ptxas assembles the inline mma.sync / cp.async)
   and preprocessed as NVRTC will see it through cupy.RawModule (`-E -DNO_MAIN`: no main, no host headers).
   All run in parallel; ~16 s of CPU, ~20-40 s wall on 2 cores. Skips when nvcc is not on PATH. Needs no GPU: syntax, type and PTX-assembly errors (the inline mma.sync /
   cp.async) are caught here.
2. test_cuda_c_matches_oracle: skips unless CuPy and a CUDA device are present; then runs kernels/cuda/cuda_c.py's
   launchers (NVRTC-compiled .cu kernels) against the oracle: attention fp32 (scalar flash v1) and fp16 (tensor
   core v2 forward, scalar backward) with padding, dropout and identical dropped elements, softmax and layernorm
   fp32.
"""
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

CSRC = Path(__file__).resolve().parents[1] / "kernels" / "cuda" / "csrc"
SOURCES = sorted(CSRC.glob("*.cu"))


def _nvcc(args):
    res = subprocess.run(args, capture_output=True, text=True, timeout=600)
    return args, res


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH: the CUDA C sources are not compiled")
def test_cu_compiles():
    assert {p.name for p in SOURCES} >= {"attention_forward.cu", "attention_backward.cu", "softmax.cu",
                                         "layernorm.cu"}
    with tempfile.TemporaryDirectory() as tmp:
        jobs = []
        for src in SOURCES:
            base = ["nvcc", "-arch=sm_90", "-std=c++17", f"-I{CSRC}"]
            jobs.append(base + ["-c", str(src), "-o", f"{tmp}/{src.stem}.o"])
            # NVRTC's view (-DNO_MAIN): preprocessing only, so it stays cheap; the kernels are the same text
            jobs.append(base + ["-E", "-DNO_MAIN", "--cuda", str(src), "-o", f"{tmp}/{src.stem}.ii"])
        with ThreadPoolExecutor(4) as ex:
            results = list(ex.map(_nvcc, jobs))
    failed = [f"{' '.join(a)}\n{r.stderr}" for a, r in results if r.returncode != 0]
    assert not failed, "nvcc failed:\n" + "\n".join(failed)


def _gpu():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception as e:  # noqa: BLE001  (no driver, no device: CuPy raises its runtime error)
        pytest.skip(f"no CUDA device: {e}")
    return cupy


def test_cuda_c_matches_oracle():
    cupy = _gpu()
    from refbert import ops
    from refbert.philox import DropoutRNG
    from refbert_kernels.attention import make_inputs
    from refbert_kernels.cuda import cuda_c as K

    # attention: float32 against the float32 oracle (scalar flash: order of sums, __expf 2 ulp), float16 against
    # the float64 oracle on the same rounded inputs (P rounded to 11 bits before P V in the tensor-core kernel,
    # inputs 11 bits: ~1e-3 relative on O(1) outputs, gradients sum T such terms)
    for dtype, (atol, rtol) in ((np.float32, (5e-5, 5e-4)), (np.float16, (2e-2, 2e-2))):
        for shape in (dict(B=2, T=37, H=3, hs=64, mask="hf", p=0.2), dict(B=2, T=130, H=2, hs=64, mask="full"),
                      dict(B=1, T=70, H=2, hs=32, mask="ninf", p=0.1), dict(B=1, T=1, H=1, hs=64, mask="hf")):
            inputs, kw = make_inputs(shape, np.float32, 0)
            inputs = {n: a.astype(dtype) for n, a in inputs.items()}
            mask = None if kw["mask"] is None else kw["mask"].astype(dtype)
            ref64 = {n: a.astype(np.float64) for n, a in inputs.items()}
            ref_mask = None if mask is None else mask.astype(np.float64 if dtype == np.float16 else dtype)
            ref_in = ref64 if dtype == np.float16 else inputs
            kwr = dict(n_heads=kw["n_heads"], dropout_p=kw["dropout_p"], train=kw["train"])
            ref, ref_cache = ops.attention_forward(**ref_in, mask=ref_mask, rng=DropoutRNG(5), **kwr)
            dout = np.random.default_rng(1).standard_normal(ref.shape).astype(dtype)
            ref_g = ops.attention_backward(dout.astype(ref.dtype), ref_cache)
            dev = {n: cupy.asarray(a) for n, a in inputs.items()}
            out, cache = K.attention_forward(**dev, mask=None if mask is None else cupy.asarray(mask),
                                             rng=DropoutRNG(5), **kwr)
            got_g = K.attention_backward(cupy.asarray(dout), cache)
            for label, g, r in (("out", out, ref), *zip(("dq", "dk", "dv"), got_g, ref_g)):
                np.testing.assert_allclose(cupy.asnumpy(g).astype(np.float64), r, atol=atol, rtol=rtol,
                                           err_msg=f"{np.dtype(dtype).name} {shape} {label}")
            probs = cupy.asnumpy(K.attention_probs(cache))
            assert np.array_equal(probs == 0, ops.attention_probs(ref_cache) == 0), "dropped elements differ"

    # softmax and layernorm, float32 (expf 2 ulp, sums in another order)
    r = np.random.default_rng(0)
    x = r.standard_normal((2, 3, 37, 37)).astype(np.float32)
    mask = np.where(np.arange(37) < 20, 0.0, np.finfo(np.float32).min).astype(np.float32)[None, None, None, :]
    p_ref, c_ref = ops.softmax_forward(x, 0.125, mask)
    p, c = K.softmax_forward(cupy.asarray(x), 0.125, cupy.asarray(mask))
    np.testing.assert_allclose(cupy.asnumpy(p), p_ref, atol=1e-6, rtol=1e-5)
    d = r.standard_normal(x.shape).astype(np.float32)
    np.testing.assert_allclose(cupy.asnumpy(K.softmax_backward(cupy.asarray(d), c)), ops.softmax_backward(d, c_ref),
                               atol=1e-6, rtol=1e-5)
    x = r.standard_normal((3, 37, 52)).astype(np.float32)
    w, b = r.standard_normal(52).astype(np.float32), r.standard_normal(52).astype(np.float32)
    o_ref, lc = ops.layernorm_forward(x, w, b)
    o, c = K.layernorm_forward(*(cupy.asarray(a) for a in (x, w, b)))
    np.testing.assert_allclose(cupy.asnumpy(o), o_ref, atol=1e-5, rtol=1e-5)
    d = r.standard_normal(x.shape).astype(np.float32)
    for g, gr in zip(K.layernorm_backward(cupy.asarray(d), c), ops.layernorm_backward(d, lc)):
        np.testing.assert_allclose(cupy.asnumpy(g), gr, atol=1e-4, rtol=1e-4)   # dw, db: sums of 111 rows
