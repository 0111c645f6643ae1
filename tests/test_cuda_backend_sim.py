"""backend="cuda" (refbert_kernels.cuda.backend), whole model, against the numpy backend (the oracle): in Numba's CUDA
simulator on the CPU (CI), and on a real GPU when one is present; and refbert.bench_cuda's pieces that need no GPU.

The simulator must be switched on (NUMBA_ENABLE_CUDASIM=1) before numba.cuda is first imported and cannot be
switched off, so the model runs in child processes; the pytest process never imports numba.cuda. In the simulator
the backend's array module is NumPy (kernels simulated, matmuls NumPy's); on a GPU it is CuPy (cuBLAS), and the
outputs are CuPy arrays, compared after refbert.model.to_numpy.

What is compared (train mode, dropout 0.1 on hidden states and attention probabilities, so both backends must
draw the same Philox masks; parameters moved off HF's init so that no gradient term hides behind a zero):
    BertForPreTraining            L=2, C=12, 3 heads, T=6, B=2, padding, ignored MLM labels, mlm_decode "all"
    BertForSequenceClassification L=1, C=8, 2 heads, T=5, B=2 (and the classifier's own dropout)
every output (loss, logits, hidden states, attention probabilities) and every parameter gradient.
Tolerance (README "Backends", as tests/test_backend_parity.py), per tensor against the numpy backend's float64
result b: |a - b|max <= rtol * max(|b|max, 1e-3 * G), G the largest gradient of the model:
    float32 1e-5: float32 sums in another order (tree / warp reductions, cuBLAS or NumPy's BLAS), CUDA's expf / erfcf
                  within 2 ulp, online-softmax rescaling in the flash attention, through 2 layers and a loss.
                  Where a gradient sums cancelling terms float32 itself cannot do 1e-5 (the NSP bias of a batch of
                  2: the float32 numpy backend is 1.1e-5 off): there the bound is twice the float32 numpy backend's
                  own distance from float64, which must itself be within 2e-5;
    float64 1e-10: only the order of sums and libdevice's exp / erf differ from NumPy's.
A gradient that is 0 in exact arithmetic (the key bias: softmax ignores a per-row shift) is held to rtol * G
absolutely. The dropout masks are checked exactly: after the forward both models' DropoutRNGs have drawn the same
number of streams, and an element the numpy backend's attention dropped is 0 in the cuda backend's probabilities.
"""
import functools
import importlib.util
import types

import numpy as np
import pytest

import cudachild
needs_numba_cuda = pytest.mark.skipif(importlib.util.find_spec("numba") is None
                                      or importlib.util.find_spec("numba_cuda") is None,
                                      reason="needs numba and numba-cuda (pip install 'refbert[cuda]')")


_run = functools.partial(cudachild.run, timeout=900)
_check = cudachild.check


def _gpu_present():
    """A CUDA GPU usable through CuPy (checked in a child: the CUDA runtime stays out of the pytest process)."""
    r = _run("import cupy; assert cupy.cuda.runtime.getDeviceCount() > 0", sim=False, timeout=120)
    return r.returncode == 0


_COMPARE = """
import time
import numpy as np
import refbert
from refbert.check import model_batch, tiny_config
from refbert.model import get_backend, to_numpy

RTOL = {np.float32: 1e-5, np.float64: 1e-10}
B_ = get_backend("cuda")
print(B_.describe())


def run(head, dtype, backend, **cfg_kw):
    cfg = tiny_config(head, **cfg_kw)
    model = getattr(refbert, head)(cfg, seed=4, dtype=dtype, backend=backend).train(True)
    r = np.random.default_rng(5)
    for k, p in model.parameters().items():    # off HF's init (numpy noise, moved to the backend's device)
        p += B_.to_device((r.standard_normal(p.shape) * 0.05).astype(dtype)) if backend == "cuda" \\
            else (r.standard_normal(p.shape) * 0.05).astype(dtype)
    x = model_batch(cfg, head, B=2, T=T_[head])
    out = model(**x, output_hidden_states=True, output_attentions=True)
    calls = model.dropout_rng.calls
    g = model.backward()
    return out, g, calls


def close(got, ref, rtol, floor, what):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    scale = max(float(np.abs(ref).max()), floor) if ref.size else 1.0
    err = float(np.abs(got - ref).max()) / scale if ref.size else 0.0
    assert err <= rtol, f"{what}: max |diff| / scale = {err:.2e} > {rtol:g}"
    return err


def compare(head, dtype, **cfg_kw):
    t = time.time()
    ref_out, ref_g, ref_calls = run(head, np.float64, "numpy", **cfg_kw)   # the float64 result, for both dtypes
    out, g, calls = run(head, dtype, "cuda", **cfg_kw)
    own = run(head, dtype, "numpy", **cfg_kw)[1] if dtype == np.float32 else None
    on_device = (np.ndarray, np.generic) if B_.SIM else B_.xp.ndarray   # NumPy: a 0-d sum is a scalar
    assert isinstance(out.loss, on_device) and all(isinstance(v, on_device) for v in g.values()), \\
        "outputs and gradients stay on the device"
    out, g = to_numpy(out), to_numpy(g)
    assert calls == ref_calls > 0, ("dropout streams drawn", calls, ref_calls)
    rtol = RTOL[dtype]
    worst = 0.0
    assert set(out) == set(ref_out)
    for k, v in ref_out.items():
        if v is None:
            assert out[k] is None, k
            continue
        for i, (a, b) in enumerate(zip(out[k] if isinstance(v, tuple) else (out[k],),
                                       v if isinstance(v, tuple) else (v,))):
            assert np.asarray(a).dtype == dtype, (k, i, np.asarray(a).dtype)
            worst = max(worst, close(a, b, rtol, 1e-30, f"{head} {dtype.__name__} {k}[{i}]"))
            if k == "attentions":                # the same elements dropped (p = 0 exactly where dropped)
                assert np.array_equal(np.asarray(a) == 0, np.asarray(b) == 0), f"{head} attentions[{i}] zeros"
                assert (np.asarray(b) == 0).any()
    assert list(g) == list(ref_g)
    G = max(float(np.abs(v).max()) for v in ref_g.values())
    for k in ref_g:
        assert g[k].dtype == dtype, k
        if float(np.abs(ref_g[k]).max()) <= 1e-12 * G:      # 0 in exact arithmetic: rounding noise, absolute
            d = float(np.abs(g[k].astype(np.float64) - ref_g[k]).max())
            assert d <= rtol * G, f"{head} d{k} (0 in exact arithmetic): {d:.2e} > {rtol:g} * {G:.2e}"
            continue
        tol = rtol          # float32: or twice the float32 numpy backend's own distance (a sum that cancels)
        if own is not None:
            tol = max(rtol, 2 * close(own[k], ref_g[k], 2 * rtol, 1e-3 * G, f"{head} d{k} (float32 numpy backend)"))
        worst = max(worst, close(g[k], ref_g[k], tol, 1e-3 * G, f"{head} {dtype.__name__} d{k}"))
    print(f"OK {head} {dtype.__name__}: {len(g)} gradients and every output within rtol {rtol:g} "
          f"(worst {worst:.1e}), {calls} dropout streams, {time.time() - t:.1f} s")


T_ = {"BertForPreTraining": 6, "BertForSequenceClassification": 5}
SMALL = dict(num_hidden_layers=1, hidden_size=8, num_attention_heads=2, intermediate_size=12)
CASES = globals().get("CASES") or ([("BertForPreTraining", np.float32, {}),
                                    ("BertForSequenceClassification", np.float32, SMALL)]
                                   + ([("BertForSequenceClassification", np.float64, SMALL)] if FLOAT64 else []))
for head, dtype, kw in CASES:
    compare(head, dtype, **kw)
from refbert_kernels.cuda import versions as VV
print("RAN", sorted({(op, dt, k) for op, dt, k in VV.RAN}))       # what ran: (op, dtype, version)
print("PROBLEMS", VV.problems())
"""


def ran(out):
    """{(op, dtype, version)} from a _COMPARE child's output."""
    import ast
    line = next(line for line in out.splitlines() if line.startswith("RAN "))
    return set(ast.literal_eval(line[4:]))


# every op with versions that one training step of BertForPreTraining runs (softmax, residual_layernorm and gelu
# are fused into attention, the LayerNorms with their residuals, and bias + GELU)
STEP_OPS = {"layernorm", "dropout_residual_layernorm", "dropout", "bias_gelu", "attention", "cross_entropy",
            "column_sum", "embedding"}


@needs_numba_cuda
def test_sim_whole_model_equals_numpy_backend():
    """BertForPreTraining (float32) and BertForSequenceClassification (float32, float64), train mode with dropout:
    outputs and every gradient as the numpy backend's, in the simulator (~30 s on 2 cores)."""
    out = _check(_run("FLOAT64 = True\n" + _COMPARE))
    assert out.count("OK ") == 3, out
    assert "fallback" not in out, f"an op fell back to the oracle:\n{out}"


@needs_numba_cuda
def test_gpu_whole_model_equals_numpy_backend():
    """The same on a real GPU (CuPy arrays, cuBLAS, the compiled kernels); skipped without one."""
    if not _gpu_present():
        pytest.skip("no CUDA GPU usable through CuPy")
    out = _check(_run(CASES_HS32 + _COMPARE, sim=False))
    assert out.count("OK ") == 3, out
    assert_ran_cuda_c(out)


# models whose heads have size 32, which the CUDA C attention has kernels for (tiny_config's are of size 4)
CASES_HS32 = """
import numpy as np
FLOAT64 = True
HS32 = dict(hidden_size=64, num_attention_heads=2, intermediate_size=96)
CASES = [("BertForPreTraining", np.float32, HS32),
         ("BertForSequenceClassification", np.float32, dict(HS32, num_hidden_layers=1)),
         ("BertForSequenceClassification", np.float64, dict(HS32, num_hidden_layers=1))]
"""


def assert_ran_cuda_c(out):
    """What ran is what was meant to: a CUDA C version of every op of the step in float32 (STEP_OPS), the Numba
    versions in float64 (CUDA C is float32 only); no demotion, no CUDA C call handed to Numba."""
    assert "PROBLEMS []" in out, out
    ran_ = ran(out)
    for op in STEP_OPS:
        assert any(o == op and dt == "float32" and k.startswith("C") for o, dt, k in ran_), (op, sorted(ran_))
    assert all(not k.startswith("C") for o, dt, k in ran_ if dt == "float64"), sorted(ran_)


_DLPACK_GPU = """
import numpy as np, cupy, torch, refbert
from numba import cuda
from refbert.check import model_batch, tiny_config
from refbert_kernels.cuda import backend as B
cfg = tiny_config("BertForSequenceClassification")
m = refbert.BertForSequenceClassification(cfg, backend="cuda").eval()
out = m(**{k: v for k, v in model_batch(cfg, "BertForSequenceClassification").items() if k != "labels"})
t = torch.from_dlpack(out.logits)                 # zero copy: the same device memory
assert t.is_cuda and t.data_ptr() == out.logits.data.ptr
t += 1                                            # a write through torch is seen by CuPy
assert float(abs(out.logits.get() - t.cpu().numpy()).max()) == 0.0
back = B.from_torch(torch.ones(3, device="cuda"))
assert isinstance(back, cupy.ndarray) and float(back.sum()) == 3.0
nb = B.to_numba(out.logits)
assert nb.__cuda_array_interface__["data"][0] == out.logits.data.ptr
print("OK dlpack")
"""


@needs_numba_cuda
def test_gpu_outputs_pass_to_torch_and_numba_without_copies():
    if not _gpu_present():
        pytest.skip("no CUDA GPU usable through CuPy")
    r = _run("import torch\nassert torch.cuda.is_available()", sim=False, timeout=120)
    if r.returncode:
        pytest.skip("no PyTorch with CUDA")
    assert "OK dlpack" in _check(_run(_DLPACK_GPU, sim=False))


@needs_numba_cuda
def test_sim_outputs_pass_to_torch_without_copies_and_checkpoints_roundtrip(tmp_path):
    """In the simulator the outputs are NumPy arrays: torch.from_dlpack shares their memory (CPU tensors); and a
    cuda-backend model saves and loads an HF checkpoint (parameters through to_host / to_device)."""
    code = f"""
    import numpy as np, refbert
    from refbert.check import model_batch, tiny_config
    from refbert.model import get_backend
    B = get_backend("cuda")
    assert B.SIM and B.xp is np and not B.FALLBACKS, B.describe()
    cfg = tiny_config("BertForSequenceClassification", num_hidden_layers=1)
    m = refbert.BertForSequenceClassification(cfg, seed=1, backend="cuda")
    m.save_pretrained({str(tmp_path)!r})
    m2 = refbert.BertForSequenceClassification.from_pretrained({str(tmp_path)!r}, backend="cuda")
    for k, p in m.parameters().items():
        assert np.array_equal(B.to_host(p), B.to_host(m2.parameters()[k])), k
    x = {{k: v for k, v in model_batch(cfg, "BertForSequenceClassification").items() if k != "labels"}}
    out = m2(**x)
    try:
        import torch
    except ImportError:
        print("OK (no torch)")
        raise SystemExit
    t = B.to_torch(out.logits)
    t += 1
    assert np.array_equal(t.numpy(), out.logits), "torch.from_dlpack shares the array's memory"
    assert np.shares_memory(B.from_torch(t), out.logits)
    print("OK")
    """
    assert "OK" in _check(_run(code))


@needs_numba_cuda
def test_sim_cuda_c_launchers_fall_back_to_numba_and_match_the_oracle():
    """kernels/cuda/cuda_c.py runs its CUDA C kernels on float32 CuPy arrays only; for anything else (NumPy arrays,
    here in the simulator; float16) each forward falls back to the Numba kernel and its backward must take that
    kernel's cache. The first H200 run found layernorm_backward unpacking Numba's cache as its own (a ValueError in
    `refbert bench --device cuda`): forward and backward of every launcher through the fallback, against the
    oracle, and each output keeps the input's dtype. Tolerances: float64, summation order only (1e-10); float16,
    against the float64 oracle on the same rounded inputs, 4 ulp of fp16 on O(1) values (one rounding on the store,
    cached fp16 values in the backward), twice that for attention's output (P is stored in fp16 before P V) and four
    times for its gradients (sums over T products of rounded values)."""
    code = """
    import numpy as np
    from refbert import ops
    from refbert.philox import DropoutRNG
    from refbert_kernels.cuda import cuda_c as K, _common as C
    assert C.SIM
    r = np.random.default_rng(0)
    for dt, tol in ((np.float64, 1e-10), (np.float16, 4 * 2.0 ** -10)):
        x = r.standard_normal((3, 5)).astype(dt)
        w, b = (r.standard_normal(5).astype(dt) for _ in range(2))
        d = r.standard_normal((3, 5)).astype(dt)
        up = lambda *a: tuple(v.astype(np.float64) for v in a)
        o, c = K.layernorm_forward(x, w, b)
        assert o.dtype == dt
        o_ref, c_ref = ops.layernorm_forward(*up(x, w, b))
        np.testing.assert_allclose(o.astype(np.float64), o_ref, atol=tol, rtol=tol)
        for g, g_ref in zip(K.layernorm_backward(d, c), ops.layernorm_backward(*up(d), c_ref)):
            assert g.dtype == dt
            np.testing.assert_allclose(g.astype(np.float64), g_ref, atol=tol, rtol=tol)
        p, c = K.softmax_forward(x, 0.5)
        assert p.dtype == dt and K.softmax_backward(d, c).dtype == dt
        p_ref, c_ref = ops.softmax_forward(*up(x), 0.5)
        np.testing.assert_allclose(p.astype(np.float64), p_ref, atol=tol, rtol=tol)
        np.testing.assert_allclose(K.softmax_backward(d, c).astype(np.float64),
                                   ops.softmax_backward(*up(d), c_ref), atol=tol, rtol=tol)
        q, k, v = (r.standard_normal((1, 3, 4)).astype(dt) for _ in range(3))
        dd = r.standard_normal((1, 3, 4)).astype(dt)
        a, c = K.attention_forward(q, k, v, 2, dropout_p=0.2, rng=DropoutRNG(3), train=True)
        assert a.dtype == dt and all(g.dtype == dt for g in K.attention_backward(dd, c))
        a_ref, c_ref = ops.attention_forward(*up(q, k, v), n_heads=2, dropout_p=0.2, rng=DropoutRNG(3), train=True)
        np.testing.assert_allclose(a.astype(np.float64), a_ref, atol=2 * tol, rtol=2 * tol)
        for g, g_ref in zip(K.attention_backward(dd, c), ops.attention_backward(*up(dd), c_ref)):
            np.testing.assert_allclose(g.astype(np.float64), g_ref, atol=4 * tol, rtol=4 * tol)
    print("OK")
    """
    assert "OK" in _check(_run(code))


@needs_numba_cuda
def test_cuda_backend_without_gpu_or_simulator_is_a_clear_error():
    """No simulator and no GPU: get_backend("cuda") raises a ValueError that says what is needed."""
    if _gpu_present():
        pytest.skip("a GPU is present")
    r = _run("""
    import refbert
    try:
        refbert.get_backend("cuda")
    except ValueError as e:
        print("ERR", e)
    """, sim=False, timeout=120)
    out = _check(r)
    assert "ERR backend: 'cuda' needs a CUDA GPU" in out and "NUMBA_ENABLE_CUDASIM=1" in out, out


def test_numpy_backend_has_no_device_hooks():
    """The numpy and numba backends keep their parameters as they are (to_device is the cuda backend's alone)."""
    import refbert.ops
    from refbert.model import to_device, to_numpy
    assert not hasattr(refbert.ops, "to_device")
    p = {"w": np.ones(3, np.float32)}
    assert to_device(refbert.ops, p) is p
    assert to_numpy(p) == p and to_numpy(p)["w"] is p["w"]
    assert to_numpy((np.float32(1), None))[1] is None


# ----------------------------------------------------------------------------------------------------------------
# refbert.bench_cuda: the pieces that need no GPU

def test_bench_cuda_formulas():
    from refbert import bench_cuda as BC
    assert BC.attention_flops(4, 12, 512, 64) == 4 * 4 * 12 * 512 * 512 * 64
    assert BC.attention_flops(1, 1, 2, 3, backward=True) == 2.5 * 4 * 1 * 1 * 4 * 3
    assert BC.gbps(2e9, 0.5) == 4.0 and BC.gbps(None, 1.0) is None and BC.gbps(1, 0) is None
    assert BC.tflops(3e12, 1.5) == 2.0
    assert BC.pct(1.5, 3.0) == 50.0 and BC.pct(None, 3.0) is None
    assert BC.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert BC.fmt(None) == "—" and BC.fmt(float("nan")) == "—" and BC.fmt(1234.5, ".0f") == "1234"


def test_bench_cuda_arguments():
    from refbert import bench_cuda as BC
    a = BC.defaults(BC.parse([]))
    assert a.repeats == 20 and a.attention_T == [512, 1024, 2048] and a.step_T == [128, 512]
    assert a.validate_dtypes == ["float32", "float16"]
    q = BC.defaults(BC.parse(["--quick", "--only", "kernels", "--kernels", "softmax", "--attention-T", "256"]))
    assert q.repeats == 5 and q.only == ["kernels"] and q.kernels == ["softmax"] and q.attention_T == [256]
    assert q.step_T == [128]
    assert BC.command_line(q) == ("refbert bench --device cuda --attention-T 256 --kernels softmax --only kernels "
                                  "--quick --repeats 5 --step-T 128")
    with pytest.raises(SystemExit):
        BC.parse(["--only", "memory"])


def test_bench_cuda_tables():
    from refbert import bench_cuda as BC
    rows = [dict(spec="softmax", version=1, status="ok", err_tol=0.25, error=None, note="a thread per row"),
            dict(spec="softmax", shape="B=4, H=12, T=512", dtype="float32", impl="v1", fwd_ms=0.5, bwd_ms=0.25,
                 gbps=1500.0, pct_copy=50.0, note=""),
            dict(spec="attention", shape="B=4, T=512, H=12, hs=64", dtype="float16", impl="torch sdpa flash (no mask)",
                 fwd_ms=0.1, bwd_ms=0.3, gbps=None, pct_copy=None, fwd_tflops=200.0, bwd_tflops=180.0, note="")]
    md = BC.kernels_md(rows, 3e12)
    assert md[0].startswith("Copy bandwidth") and "3000 GB/s" in md[0]
    assert "| softmax | v1 | ok | 0.25 | a thread per row |" in md
    assert "| softmax | B=4, H=12, T=512 | float32 | v1 | 0.5 | 0.25 | 1.5e+03 | 50 | — | — |  |" in md
    assert any("| 200 | 180 |" in line for line in md)
    step = BC.step_md([dict(impl="refbert cuda fp32", shape="B=4 T=128", ms=50.0, tokens_per_s=10240.0),
                       dict(impl="check", shape="B=4 T=128", note="ok")])
    assert step[0] == "| impl | shape | ms (fwd + bwd) | tokens/s | note |"
    assert "| refbert cuda fp32 | B=4 T=128 | 50 | 10240 |  |" in step
    probes = BC.probes_md(3.2e12, {"numba empty kernel, no arguments": (4.5, 2.0)})
    assert "| numba empty kernel, no arguments | 4.5 | 2 |" in probes


def test_bench_cuda_skips_cleanly_without_gpu(capsys):
    from refbert import bench_cuda as BC
    ok, why = BC.gpu_available()
    if ok:
        pytest.skip("a GPU is present")
    assert BC.main(["--quick"]) == 2
    assert "SKIPPED" in capsys.readouterr().out
    ns = types.SimpleNamespace(device="cuda")          # a Namespace from refbert's CLI without this module's flags
    assert BC.main(ns) == 2
