"""The numba backend against the numpy backend (the oracle), whole model: every head, every output, every
parameter gradient, in train mode with dropout on (both backends draw the same Philox masks) and in eval mode.

Tolerance (README "Backends"): against the numpy backend's float64 result b, per tensor, relative to its largest
entry, |a - b|max <= rtol * |b|max (gradients: check_grads' scale), in both dtypes:
  float64 rtol 1e-10 — the kernels use exact math.exp/erf in float64 and differ from NumPy only in summation order
                       (~1e-16 per add), amplified through 2 layers and a loss;
  float32 rtol 1e-5  — float32 sums in another order and polynomial exp/erf of <= 2 ulp, through the same depth
                       (observed: <= 3.2e-6). Where a gradient sums cancelling terms float32 itself cannot do 1e-5:
                       the float32 numpy backend is 9.3e-6 off on the multiple-choice pooler bias (1.1e-5 on the
                       NSP bias of tests/test_cuda_backend_sim.py); there the bound is twice that own distance
                       (the kernels may round as far, on the other side) — never the sum of the two, and the float32
                       numpy backend must itself be within 2e-5, so no allowance exceeds 4e-5.
"""
import re

import numpy as np
import pytest

pytest.importorskip("numba")

import refbert  # noqa: E402
from refbert.check import HEADS, model_batch, tiny_config  # noqa: E402

RTOL = {np.float64: 1e-10, np.float32: 1e-5}


def close(got, ref, rtol, what, floor=1e-30):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, what
    scale = max(float(np.abs(ref).max()), floor) if ref.size else 1.0
    err = float(np.abs(got - ref).max()) / scale if ref.size else 0.0
    assert err <= rtol, f"{what}: max |diff| / max |ref| = {err:.2e} > {rtol:g}"
    return err


def run(head, dtype, backend, train, decode=None, **cfg_kw):
    cfg = tiny_config(head, hidden_act="gelu_new" if cfg_kw.pop("tanh", False) else "gelu", **cfg_kw)
    model = getattr(refbert, head)(cfg, seed=4, dtype=dtype, backend=backend).train(train)
    for p in model.parameters().values():          # off HF's init, so no term of the gradient hides behind a zero
        p += (np.random.default_rng(5).standard_normal(p.shape) * 0.05).astype(dtype)
    x = model_batch(cfg, head)
    kw = {} if decode is None else dict(mlm_decode=decode)
    out = model(**x, output_hidden_states=True, output_attentions=True, **kw)
    if head != "BertModel":
        return out, model.backward()
    r = np.random.default_rng(6)                   # the encoder: differentiate random projections of its outputs
    return out, model.backward(r.standard_normal(out.last_hidden_state.shape).astype(dtype),
                               r.standard_normal(out.pooler_output.shape).astype(dtype))


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("train", [True, False])
def test_numba_backend_equals_numpy_backend(head, dtype, train):
    ref_out, ref_g = run(head, np.float64, "numpy", train)          # the float64 result, for both dtypes
    out, g = run(head, dtype, "numba", train)
    own = run(head, dtype, "numpy", train)[1] if dtype == np.float32 else None
    rtol = RTOL[dtype]
    assert set(out) == set(ref_out)
    for k, v in ref_out.items():
        if v is None:
            assert out[k] is None, k
            continue
        for i, (a, b) in enumerate(zip(out[k] if isinstance(v, tuple) else (out[k],),
                                       v if isinstance(v, tuple) else (v,))):
            assert np.asarray(a).dtype == dtype, (k, i)
            close(a, b, rtol, f"{head} {k}[{i}]")
    assert list(g) == list(ref_g)
    assert all(a.dtype == dtype for a in g.values())
    check_grads(g, ref_g, rtol, head, own)


def check_grads(g, ref_g, rtol, what, own=None):
    """Every gradient within rtol of the float64 reference's, relative to its own size, with two floors:
    - a gradient that is 0 in exact arithmetic (the reference's is below 1e-12 of the largest gradient: the
      key bias, as softmax ignores a per-row shift; the QA and multiple-choice biases and the last LayerNorm bias
      under QA, which move every position or choice alike) is rounding noise, the sum of many cancelling terms of
      the model's scale: it is held to rtol times the largest gradient, absolutely;
    - every other gradient is compared relative to max(its largest entry, 1e-3 of the largest gradient): its
      rounding error comes from activations of the model's scale, not from its own size.
    own (float32): the float32 numpy backend's gradients. Where they are further than rtol from float64 (a sum of
    cancelling terms), the bound is twice their distance; they must be within 2 rtol themselves."""
    G = max(float(np.abs(v).max()) for v in ref_g.values())
    for k in ref_g:
        assert ref_g[k].dtype == np.float64, k
        if float(np.abs(ref_g[k]).max()) <= 1e-12 * G:
            diff = float(np.abs(g[k].astype(np.float64) - ref_g[k]).max())
            assert diff <= rtol * G, f"{what} d{k} (0 in exact arithmetic): max |diff| = {diff:.2e} > {rtol:g} * {G:.2e}"
            continue
        tol = rtol
        if own is not None:
            tol = max(rtol, 2 * close(own[k], ref_g[k], 2 * rtol, f"{what} d{k} (the float32 numpy backend)", 1e-3 * G))
        close(g[k], ref_g[k], tol, f"{what} d{k}", 1e-3 * G)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_same_dropout_masks_on_both_backends(dtype):
    """The attention probabilities after dropout are zero at exactly the same places on both backends."""
    ref, _ = run("BertModel", dtype, "numpy", True, attention_probs_dropout_prob=0.3)
    got, _ = run("BertModel", dtype, "numba", True, attention_probs_dropout_prob=0.3)
    for a, b in zip(got.attentions, ref.attentions):
        np.testing.assert_array_equal(a == 0, b == 0)
        assert (b == 0).mean() > 0.1               # dropout 0.3 did drop something (besides padding)


@pytest.mark.parametrize("decode", ["all", "labelled"])
def test_pretraining_both_decodes_tanh_gelu(decode):
    ref_out, ref_g = run("BertForPreTraining", np.float64, "numpy", True, decode, tanh=True)
    out, g = run("BertForPreTraining", np.float64, "numba", True, decode, tanh=True)
    close(out.loss, ref_out.loss, RTOL[np.float64], "loss")
    check_grads(g, ref_g, RTOL[np.float64], "BertForPreTraining")


def test_backend_has_every_op_of_the_oracle():
    from refbert import ops
    backend = refbert.get_backend("numba")           # refbert_kernels.backend, the oracle's functions filled in
    names = {n for n in dir(ops) if n.endswith(("_forward", "_backward"))} | {"attention_probs"}
    assert names <= set(dir(backend)), names - set(dir(backend))
    for op, module in backend.KERNELS.items():   # a kernel really replaced each fused op
        assert getattr(backend, f"{op}_forward").__module__ == f"refbert_kernels.{module}", op


def test_a_missing_array_is_refused_as_the_oracle_refuses_it():
    """None for a required array of a fused kernel's forward: the oracle's ValueError naming the op and the argument,
    word for word, on the numba backend (it met it as an AttributeError or a Numba typing error deep inside)."""
    from refbert import ops
    backend = refbert.get_backend("numba")
    one, row = np.ones(3), np.ones((2, 3))
    calls = {"linear_forward": (None, np.zeros((4, 3))), "embedding_forward": (np.array([0]), None),
             "layernorm_forward": (None, one, one), "residual_layernorm_forward": (None, row, one, one),
             "dropout_residual_layernorm_forward": (row, None, one, one), "softmax_forward": (None,),
             "gelu_forward": (None,), "bias_gelu_forward": (row, None), "dropout_forward": (None, 0.1),
             "attention_forward": (None, None, None, 1), "cross_entropy_forward": (None, np.array([0]))}
    assert {f"{op}_forward" for op in backend.KERNELS} <= set(calls)
    for name, args in calls.items():
        with pytest.raises(ValueError) as want:
            getattr(ops, name)(*args)
        assert "expected a float32 or float64 array, got None" in str(want.value), name
        with pytest.raises(ValueError, match=f"^{re.escape(str(want.value))}$"):
            getattr(backend, name)(*args)
