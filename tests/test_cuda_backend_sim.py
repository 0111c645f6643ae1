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
import ast
import functools
import importlib.util
import json
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
    """kernels/cuda/cuda_c.py runs its CUDA C kernels on float32 device arrays only; for anything else (NumPy arrays,
    here in the simulator; float64, float16) each forward falls back to the Numba kernel and its backward must take
    that kernel's cache. The first H200 run found layernorm_backward unpacking Numba's cache as its own (a ValueError
    in `refbert bench --device cuda`): forward and backward of every launcher through the fallback, against the
    oracle, each output keeps the input's dtype, and each fallback is recorded (cuda_c.FELL_BACK: never silent).
    Tolerances: float64, summation order only (1e-10); float16, against the float64 oracle on the same rounded
    inputs, 4 ulp of fp16 on O(1) values (one rounding on the store, cached fp16 values in the backward), twice that
    for sums of a few rounded terms and attention's output (P is stored in fp16 before P V), four times for
    attention's gradients (sums over T products of rounded values). The CUDA C paths themselves run in
    tests/test_cuda_emu.py (emulated) and test_cuda_nvcc.py (GPU)."""
    code = """
    import numpy as np
    from refbert import ops
    from refbert.philox import DropoutRNG
    from refbert_kernels.cuda import cuda_c as K, _common as C
    assert C.SIM
    r = np.random.default_rng(0)
    up = lambda *a: tuple(v.astype(np.float64) for v in a)

    def close(got, ref, tol, what):
        assert got.dtype == dt, (what, got.dtype)
        np.testing.assert_allclose(got.astype(np.float64), ref, atol=tol, rtol=tol, err_msg=what)

    def pair(name, fwd, bwd, ofwd, obwd, args, kw, tol, rng=False):
        kw_k = dict(kw, rng=DropoutRNG(3)) if rng else kw
        kw_o = dict(kw, rng=DropoutRNG(3)) if rng else kw
        o, c = fwd(*args, **kw_k)
        arrays = [a.astype(np.float64) if isinstance(a, np.ndarray) else a for a in args]
        o_ref, c_ref = ofwd(*arrays, **kw_o)
        close(np.asarray(o), o_ref, tol, name + " out")
        d = r.standard_normal(np.shape(o)).astype(dt)
        g, g_ref = bwd(d, c), obwd(d.astype(np.float64), c_ref)
        g, g_ref = (g if isinstance(g, tuple) else (g,)), (g_ref if isinstance(g_ref, tuple) else (g_ref,))
        for i, (a_, b_) in enumerate(zip(g, g_ref)):
            close(a_, b_, tol, f"{name} grad {i}")

    for dt, tol in ((np.float64, 1e-10), (np.float16, 4 * 2.0 ** -10)):
        x, a, d = (r.standard_normal((3, 8)).astype(dt) for _ in range(3))
        w, b = (r.standard_normal(8).astype(dt) for _ in range(2))
        pair("layernorm C1", K.layernorm_forward, K.layernorm_backward, ops.layernorm_forward,
             ops.layernorm_backward, (x, w, b), {}, tol)
        pair("layernorm C2", K.layernorm_forward_c2, K.layernorm_backward_c2, ops.layernorm_forward,
             ops.layernorm_backward, (x, w, b), {}, tol)
        pair("residual_layernorm C2", K.residual_layernorm_forward_c2, K.residual_layernorm_backward_c2,
             ops.residual_layernorm_forward, ops.residual_layernorm_backward, (x, a, w, b), {}, tol)
        pair("dropout_residual_layernorm C2", K.dropout_residual_layernorm_forward_c2,
             K.dropout_residual_layernorm_backward_c2, ops.dropout_residual_layernorm_forward,
             ops.dropout_residual_layernorm_backward, (x, a, w, b), dict(p=0.3), tol, rng=True)
        pair("dropout C1", K.dropout_forward_c1, K.dropout_backward_c1, ops.dropout_forward, ops.dropout_backward,
             (x, 0.4), {}, tol, rng=True)
        pair("gelu C1", K.gelu_forward_c1, K.gelu_backward_c1, ops.gelu_forward, ops.gelu_backward, (x,), {}, tol)
        pair("bias_gelu C1", K.bias_gelu_forward_c1, K.bias_gelu_backward_c1, ops.bias_gelu_forward,
             ops.bias_gelu_backward, (x, b), dict(approximate="tanh"), tol)
        pair("softmax C2", K.softmax_forward, K.softmax_backward, ops.softmax_forward, ops.softmax_backward,
             (x, 0.5), {}, tol)
        labels = np.array([1, -100, 7])
        o, c = K.cross_entropy_forward_c1(x, labels)
        o_ref, c_ref = ops.cross_entropy_forward(x.astype(np.float64), labels)
        close(np.asarray(o), o_ref, tol, "cross_entropy C1 loss")
        close(K.cross_entropy_backward_c1(1.0, c), ops.cross_entropy_backward(1.0, c_ref), tol, "cross_entropy dz")
        close(K.column_sum_c1(x), x.astype(np.float64).sum(0), 2 * tol, "column_sum C1")
        ids = np.array([[1, 2, 1], [0, 1, 2]])
        dout = r.standard_normal((2, 3, 8)).astype(dt)
        _, c_ref = ops.embedding_forward(ids, np.zeros((4, 8)), 0)
        close(K.embedding_backward_c1(dout, (ids, (4, 8), np.dtype(dt), 0)),
              ops.embedding_backward(dout.astype(np.float64), c_ref), 2 * tol, "embedding C1")
        q, k, v = (r.standard_normal((1, 3, 4)).astype(dt) for _ in range(3))
        dd = r.standard_normal((1, 3, 4)).astype(dt)
        att, c = K.attention_forward(q, k, v, 2, dropout_p=0.2, rng=DropoutRNG(3), train=True)
        assert att.dtype == dt and all(g.dtype == dt for g in K.attention_backward(dd, c))
        a_ref, c_ref = ops.attention_forward(*up(q, k, v), n_heads=2, dropout_p=0.2, rng=DropoutRNG(3), train=True)
        np.testing.assert_allclose(att.astype(np.float64), a_ref, atol=2 * tol, rtol=2 * tol)
        for g, g_ref in zip(K.attention_backward(dd, c), ops.attention_backward(*up(dd), c_ref)):
            np.testing.assert_allclose(g.astype(np.float64), g_ref, atol=4 * tol, rtol=4 * tol)
    fell = sorted({op for op, _ in K.FELL_BACK})
    assert fell == sorted(["layernorm", "residual_layernorm", "dropout_residual_layernorm", "dropout", "gelu",
                           "bias_gelu", "softmax", "cross_entropy", "column_sum", "embedding", "attention"]), fell
    print("OK")
    """
    assert "OK" in _check(_run(code))


_VERSIONS = """
import json, os, warnings
import numpy as np
from refbert.philox import DropoutRNG
from refbert_kernels.cuda import backend as B, versions as VV
assert B.MODE == "sim"
x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
w, b = np.ones(8, np.float32), np.zeros(8, np.float32)
"""

_PINNED = """
B.layernorm_forward(x, w, b)
B.dropout_forward(x, 0.5, DropoutRNG(1))
B.gelu_forward(x)
VV.pin("attention", 2)
B.attention_forward(x.reshape(1, 3, 8), x.reshape(1, 3, 8), x.reshape(1, 3, 8), 2)
print("RAN", sorted(VV.RAN))
print(B.describe())
for bad in (("nope", 1), ("layernorm", "C9")):
    try:
        VV.pin(*bad)
    except ValueError as e:
        print("ERR", e)
"""


@needs_numba_cuda
def test_sim_versions_pinned_measured_and_built_in(tmp_path):
    """The version of each (op, dtype): a pin (REFBERT_CUDA_VERSIONS or versions.pin) first, then a measured order
    written for this device (REFBERT_CUDA_ORDER), then the built-in one (CUDA C skipped in the simulator); a bad pin
    is a ValueError naming what was expected."""
    order = tmp_path / "order.json"
    order.write_text(json.dumps({"device": "Numba CUDA simulator (CPU)", "orders": {"gelu": {"float32": ["1", "2"]}}}))
    env = (f"import os\nos.environ['REFBERT_CUDA_VERSIONS'] = 'layernorm=1,dropout:float32=1'\n"
           f"os.environ['REFBERT_CUDA_ORDER'] = {str(order)!r}\n")
    out = _check(_run(env + _VERSIONS + _PINNED))
    ran_ = set(ast.literal_eval(next(line for line in out.splitlines() if line.startswith("RAN "))[4:]))
    assert ran_ == {("layernorm", "float32", "1"), ("dropout", "float32", "1"), ("gelu", "float32", "1"),
                    ("attention", "float32", "2")}, ran_            # pinned, pinned, measured, pinned
    assert ("layernorm                   order C4 > C3 > C2 > C1 > 2 > 1; runs float32: 1; pinned every dtype=1"
            in out), out
    assert "ERR pin: expected an op among" in out and "ERR pin: layernorm has no version 'C9'" in out, out


_DEMOTE = """
vs = VV.versions()["layernorm"]
i = next(i for i, v in enumerate(vs) if v.key == "2")
good = vs[i].forward
def wrong(x, w, b, eps=1e-12):                          # off by 1e-3: beyond float32's tolerance
    out, cache = good(x, w, b, eps)
    return out + 1e-3, cache
vs[i] = vs[i]._replace(forward=wrong)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    B.layernorm_forward(x, w, b)
print("WARN", [str(c.message) for c in caught])
print("CHOSEN", VV.CHOSEN[("layernorm", "float32")].key)
print(B.describe())
print("ROWS", [(r[0], r[3]) for r in B.version_rows() if "FALLBACK" in r[0]])
"""


@needs_numba_cuda
def test_sim_a_version_failing_validation_is_demoted_and_reported():
    """With validation at first use (REFBERT_CUDA_VALIDATE=1; on by default on a GPU) a version whose result is off
    is demoted to the next one, and the demotion is reported: a RuntimeWarning, problems(), describe(), and a
    failing row of version_rows() (what `refbert check --device cuda` prints)."""
    out = _check(_run("import os\nos.environ['REFBERT_CUDA_VALIDATE'] = '1'\n" + _VERSIONS + _DEMOTE))
    assert "CHOSEN 1" in out, out
    assert "layernorm float32 version 2 failed validation" in out and "demoted to the next version" in out, out
    assert "FALLBACK layernorm: float32: version 2 demoted" in out, out
    assert "ROWS [('layernorm FALLBACK', False)]" in out, out


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


@needs_numba_cuda
def test_bench_cuda_order_ranks_by_device_time(tmp_path):
    """cuda_order.json ranks an op's versions by forward + backward on the device alone where a call has both (the
    step keeps the GPU busy: what a version costs there is its device time), by its time as called where it has
    none; the file keeps the milliseconds and says what they are, and the backend reads the order back."""
    from refbert import bench_cuda as BC
    from refbert_kernels.cuda import versions as VV
    row = dict(fwd_ms=0.30, bwd_ms=0.20, fwd_dev_ms=0.05, bwd_dev_ms=0.10)
    assert BC.order_seconds(row) == pytest.approx(0.15e-3)                     # (float sums: 1e-12 relative)
    assert BC.order_seconds(dict(row, bwd_dev_ms=None)) == pytest.approx(0.5e-3)
    assert BC.order_seconds(dict(fwd_ms=None, bwd_ms=None)) is None
    # C4's call the faster, C6's device time the faster (the H200's case at T=128): C6 ranks first; the Numba
    # version's call synchronises inside, so its time as called ranks it
    rows = {"C4": dict(fwd_ms=0.137, bwd_ms=0.134, fwd_dev_ms=0.0262, bwd_dev_ms=0.0636),
            "C6": dict(fwd_ms=0.181, bwd_ms=0.141, fwd_dev_ms=0.0239, bwd_dev_ms=0.0635),
            "3": dict(fwd_ms=0.316, bwd_ms=1.07, fwd_dev_ms=None, bwd_dev_ms=None)}
    timings = {("attention", "float32"): {k: BC.order_seconds(r) for k, r in rows.items()}}
    path = tmp_path / "cuda_order.json"
    VV.write_order(str(path), VV.device_name(), timings)
    data = json.loads(path.read_text())
    assert data["orders"]["attention"]["float32"] == ["C6", "C4", "3"], data
    assert data["ms"]["attention"]["float32"]["C6"] == pytest.approx(0.0874) and "device alone" in data["by"], data
    assert VV.load_order(str(path))[("attention", "float32")] == ["C6", "C4", "3"]
    # a Numba version ranks after every other however fast on the device (its launch's host time; a CUDA graph
    # cannot capture it): the H100's embedding rows of 2026-11-28, where Numba's v1 was the faster on the device
    emb = {"1": dict(fwd_ms=0.0328, bwd_ms=0.804, fwd_dev_ms=0.0243, bwd_dev_ms=0.159),
           "C1": dict(fwd_ms=0.0307, bwd_ms=0.443, fwd_dev_ms=0.0246, bwd_dev_ms=0.17),
           "atomic": dict(fwd_ms=0.0307, bwd_ms=0.5, fwd_dev_ms=0.0246, bwd_dev_ms=0.3)}
    VV.write_order(str(path), VV.device_name(),
                   {("embedding", "float32"): {k: BC.order_seconds(r) for k, r in emb.items()}})
    assert VV.load_order(str(path))[("embedding", "float32")] == ["C1", "atomic", "1"]
    assert "every Numba version after every other" in json.loads(path.read_text())["by"]
    assert not (tmp_path / "cuda_order.json.tmp").exists()


@needs_numba_cuda
def test_describe_names_kernel_variants_off_their_default():
    """describe() names each kernel variant an environment variable chose away from its default (REFBERT_ATTN_BWD16
    and the like: A/B runs must say what ran), and none at the defaults."""
    import importlib
    import os
    from refbert_kernels.cuda import _common as C, cuda_c as K, versions as VV
    # every variant's default written once (_common.VARIANT_DEFAULTS), each variable with one home, and the modules'
    # attributes at import those defaults where the environment sets nothing
    assert sorted(var for *_, var, _ in VV.VARIANTS) == sorted(C.VARIANT_DEFAULTS), VV.VARIANTS
    for mod, attr, default, var, _ in VV.VARIANTS:
        got = getattr(importlib.import_module(f"refbert_kernels.cuda.{mod}"), attr)
        assert default == C.VARIANT_DEFAULTS[var] and (var in os.environ or got == default), (mod, attr, got)
    was = K.ATTN_BWD16, K.LN_DWDB
    try:
        K.ATTN_BWD16, K.LN_DWDB = "6", "3"
        assert not any("variant" in line for line in VV.describe()), VV.describe()
        K.ATTN_BWD16, K.LN_DWDB = "7", "4"
        lines = [line for line in VV.describe() if "variant" in line]
        assert lines == ["  variant REFBERT_ATTN_BWD16=7 (attention C5's backward kernels; not the default)",
                         "  variant REFBERT_LN_DWDB=4 (layernorm's dw, db partials; not the default)"], lines
        # kernel_variant (the bench's A/B rows): set inside the block, put back after, even through an exception
        with pytest.raises(RuntimeError, match="inside"):
            with VV.kernel_variant("REFBERT_ATTN_BWD16", "6"):
                assert K.ATTN_BWD16 == "6"
                raise RuntimeError("inside")
        assert K.ATTN_BWD16 == "7"
        with pytest.raises(ValueError, match="kernel_variant: expected one of REFBERT_ATTN_BWD16, .*got 'X'"):
            with VV.kernel_variant("X", "1"):
                pass
    finally:
        K.ATTN_BWD16, K.LN_DWDB = was


def test_bench_cuda_arguments():
    from refbert import bench_cuda as BC
    a = BC.defaults(BC.parse([]))
    assert a.repeats == 20 and a.attention_T == [512, 1024, 2048] and BC.step_shapes(a) == [(32, 128), (8, 512)]
    assert a.validate_dtypes == ["float32", "float16"]
    q = BC.defaults(BC.parse(["--quick", "--only", "kernels", "--kernels", "softmax", "--attention-T", "256"]))
    assert q.repeats == 5 and q.only == ["kernels"] and q.kernels == ["softmax"] and q.attention_T == [256]
    assert BC.step_shapes(q) == [(4, 128)]
    assert BC.command_line(q) == ("refbert bench --device cuda --attention-T 256 --kernels softmax --only kernels "
                                  "--quick --repeats 5")
    assert BC.step_shapes(BC.parse(["--step", "16x256", "2X64"])) == [(16, 256), (2, 64)]
    assert BC.step_shapes(BC.parse(["--step-T", "128", "512", "2048"])) == [(32, 128), (8, 512), (2, 2048)]
    with pytest.raises(ValueError, match="--step expected BxT"):
        BC.step_shapes(BC.parse(["--step", "32-128"]))
    with pytest.raises(SystemExit):
        BC.parse(["--only", "memory"])


def test_bench_cuda_step_gemms_count_every_matrix_product():
    """The GEMM floor's list against the step's FLOPs written out by hand (2 m k n per product): per layer 6 linear
    layers x 3 products (forward, dx, dW), attention's 2 forward and 4 backward products per head; pooler, NSP,
    MLM transform; the decoder per decode mode."""
    from refbert import bench_cuda as BC
    from refbert.config import BertConfig
    cfg = BertConfig.preset("base")
    C, I, V, H, L = 768, 3072, cfg.vocab_size, 12, 12
    B, T, n = 32, 128, 614
    N, hs = B * T, C // H
    layer = 3 * 2 * N * (4 * C * C + 2 * C * I) + 6 * 2 * B * H * T * T * hs
    heads = 3 * 2 * B * (C * C + 2 * C)
    allrows = L * layer + heads + 3 * 2 * N * C * C + 2 * N * C * V + 2 * n * C * V + 2 * 2 * n * V * C
    labelled = L * layer + heads + 3 * 2 * n * C * C + 3 * 2 * n * C * V
    hf = L * layer + heads + 3 * 2 * N * C * C + 3 * 2 * N * C * V
    assert BC.gemm_flops(BC.step_gemms(cfg, B, T, n, "all")) == allrows
    assert BC.gemm_flops(BC.step_gemms(cfg, B, T, n, "labelled")) == labelled
    assert BC.gemm_flops(BC.step_gemms(cfg, B, T, n, "all", who="hf")) == hf
    assert len(BC.step_gemms(cfg, B, T, n, "labelled")) == L * 24 + 6 + 3 + 3


def test_bench_cuda_profile_aggregation():
    from refbert import bench_cuda as BC
    events = [("gemm", 100.0, "kernel")] * 4 + [("ln", 10.0, "kernel")] * 6 + [("Memcpy HtoD", 5.0, "memcpy")] * 2 \
        + [("Memset", 1.0, "memset")] * 2
    s, rows = BC.profile_table(events, steps=2, wall_s=0.001)
    assert s["launches_per_step"] == 7 and s["kernels_per_step"] == 5 and s["copies_per_step"] == 1
    assert s["gpu_busy_ms"] == (400 + 60 + 10 + 2) / 1e3 / 2 and s["wall_ms"] == 0.5
    assert rows[0] == dict(name="gemm", calls_per_step=2, ms_per_step=0.2, pct=100 * 0.2 / s["gpu_busy_ms"])
    md = BC.profile_md({"refbert": (s, rows), "HF": "RuntimeError: no CUPTI"})
    assert "7 device events per step (5 kernels, 1 copies, 1 memsets)" in md[2] and "failed: RuntimeError" in md[-2]


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
    assert ("| softmax | B=4, H=12, T=512 | float32 | v1 | 0.5 | 0.25 | — | — | 1.5e+03 | 50 | — | — | call |  |"
            in md)
    assert any("| 200 | 180 | call |" in line for line in md)
    rows.append(dict(spec="softmax", shape="B=4, H=12, T=512", dtype="float32", impl="v2", fwd_ms=0.05, bwd_ms=0.06,
                     fwd_dev_ms=0.01, bwd_dev_ms=0.02, rates_of="device", gbps=1e5, pct_copy=80.0, note=""))
    assert ("| softmax | B=4, H=12, T=512 | float32 | v2 | 0.05 | 0.06 | 0.01 | 0.02 | 1e+05 | 80 | — | — | device "
            "|  |") in BC.kernels_md(rows, 3e12)
    step = BC.step_md([dict(impl="refbert cuda fp32 (all)", shape="B=4 T=128", ms=50.0, tokens_per_s=10240.0,
                            vs_sdpa=1.25, floor_ms=40.0, held_mb=900.4),
                       dict(impl="check", shape="B=4 T=128", note="ok")])
    assert step[0] == ("| impl | shape | ms (fwd + bwd) | tokens/s | x HF sdpa | GEMM floor ms | x floor | "
                       "MiB held after fwd | note |")
    assert "| refbert cuda fp32 (all) | B=4 T=128 | 50 | 10240 | 1.25 | 40 | 1.25 | 900 |  |" in step
    launch = BC.launch_md([dict(kernel="ce_fwd_v1", calls_per_step=2, host_us=4.25, launch="v2 packed",
                                rawkernel_us=7.5),
                           dict(kernel="ce_bwd_v1", calls_per_step=2, host_us=6.5, launch="v1 RawKernel",
                                rawkernel_us=None)])
    assert "| ce_fwd_v1 | 2 | v2 packed | 4.25 | 7.5 |" in launch, launch
    assert "| ce_bwd_v1 | 2 | v1 RawKernel | 6.5 | — |" in launch, launch
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


def test_bench_cuda_skips_the_materialising_attention_versions_at_long_T(monkeypatch):
    """At T > 1024 the bench does not time attention's versions 1 and 2 (version 2's backward is version 1's, which
    materialises (B, H, T, T): 371 ms a call at T = 2048 on the H200), and says why in their rows; version 3 is timed
    there, and at T = 512 all three are (the control)."""
    from refbert import bench_cuda as BC
    timed = []
    monkeypatch.setattr(BC, "_on_gpu", lambda inputs, kwargs, dtype: (inputs, kwargs))
    monkeypatch.setattr(BC, "cuda_c_versions", lambda op: {})
    monkeypatch.setattr(BC, "time_pair", lambda timer, f, b, inputs, kwargs: timed.append(f) or (1e-3,) * 4)
    spec = types.SimpleNamespace(name="attention", versions={v: (f"fwd{v}", f"bwd{v}") for v in (1, 2, 3)}, notes={},
                                 make_inputs=lambda shape, dtype, seed: ({}, {}), nbytes=None)
    args = types.SimpleNamespace(no_torch=True)
    for T, want in ((2048, ["fwd3"]), (512, ["fwd1", "fwd2", "fwd3"])):
        timed.clear()
        rows = BC.time_spec(args, None, 1e12, spec, [1, 2, 3], dict(B=8, H=12, hs=64, T=T), np.float32)
        assert timed == want, (T, timed)
        skipped = [r for r in rows if r.get("note", "").startswith("skipped: materialises")]
        assert [r["impl"] for r in skipped] == (["v1", "v2"] if T > 1024 else []), rows
        assert all("fwd_ms" not in r for r in skipped), skipped
