"""Inputs where HF's semantics are easy to get wrong, against transformers + torch autograd (float64, eager):
an attention-mask row with no real token."""
import numpy as np
import pytest

import refbert
from refbert.check import model_batch, tiny_config
from refbert.gradcheck import rel_error


def _hf(head, cfg, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.BertConfig(**{k: getattr(cfg, k) for k in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
        "max_position_embeddings", "type_vocab_size", "num_labels")}, attn_implementation="eager",
        **({"problem_type": cfg.problem_type} if cfg.problem_type else {}))
    torch.manual_seed(0)
    m = getattr(transformers, head)(hf_cfg).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    m.save_pretrained(tmp_path)
    return torch, m


def _compare(head, cfg, x, tmp_path, fields, backend="numpy"):
    torch, hf = _hf(head, cfg, tmp_path)
    ours = getattr(refbert, head).from_pretrained(tmp_path, dtype=np.float64, backend=backend)
    out = ours(**x)
    theirs = hf(**{k: torch.tensor(v) for k, v in x.items()})
    for f in fields:  # float64, same math in another order: 1e-10 absolute (as tests/test_hf_parity.py)
        a, b = np.asarray(out[f]), theirs[f].detach().numpy()
        assert np.isfinite(a).all() and np.abs(a - b).max() <= 1e-10, (f, np.abs(a - b).max())
    grads = ours.backward()
    theirs.loss.backward()
    floor = 1e-6 * max(np.abs(g).max() for g in grads.values())  # see tests/test_hf_parity.py
    for k, p in hf.named_parameters():
        assert rel_error(grads[k], p.grad.numpy(), floor) <= 1e-8, k


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_a_row_with_no_real_token_matches_hf(backend, tmp_path):
    if backend == "numba":
        pytest.importorskip("numba")
    cfg = tiny_config("BertForSequenceClassification")
    x = model_batch(cfg, "BertForSequenceClassification")
    x["attention_mask"][1] = 0                     # row 1: every position is padding
    _compare("BertForSequenceClassification", cfg, x, tmp_path, ["logits", "loss"], backend)


@pytest.mark.parametrize("problem, labels", [
    ("multi_label_classification", np.array([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])),
    (None, np.array([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])),          # float labels, num_labels > 1: HF infers multi-label
    ("regression", np.array([[0.5, -1.0, 2.0], [0.0, 1.5, -0.5]])),
])
def test_problem_types_match_hf(problem, labels, tmp_path):
    cfg = tiny_config("BertForSequenceClassification", problem_type=problem)
    x = model_batch(cfg, "BertForSequenceClassification")
    x["labels"] = labels
    _compare("BertForSequenceClassification", cfg, x, tmp_path, ["logits", "loss"])


@pytest.mark.parametrize("problem", ["multi_label_classification", "regression"])
def test_problem_types_against_finite_differences(problem):
    from refbert.gradcheck import TOLERANCE, check_model
    cfg = tiny_config("BertForSequenceClassification", problem_type=problem)
    model = refbert.BertForSequenceClassification(cfg, seed=1, dtype=np.float64)
    for p in model.parameters().values():
        p += np.random.default_rng(2).standard_normal(p.shape) * 0.05
    x = model_batch(cfg, "BertForSequenceClassification")
    x["labels"] = np.array([[1.0, 0.0, 0.3], [0.0, 0.9, 1.0]])
    errs = check_model(model, x, n_dirs=1)
    assert max(errs.values()) <= TOLERANCE, errs


def test_multi_label_bad_targets_name_the_argument():
    cfg = tiny_config("BertForSequenceClassification", problem_type="multi_label_classification")
    model = refbert.BertForSequenceClassification(cfg)
    x = model_batch(cfg, "BertForSequenceClassification")
    with pytest.raises(ValueError, match=r"'labels' expected multi-label targets of shape \(2, 3\)"):
        model(**{**x, "labels": np.ones(2)})
    with pytest.raises(ValueError, match=r"'targets' expected values in \[0, 1\], got values in \[0.0, 2.0\]"):
        model(**{**x, "labels": np.array([[0.0, 2.0, 1.0], [1.0, 1.0, 1.0]])})
    with pytest.raises(ValueError, match="problem_type expected one of"):
        cfg.problem_type = "ranking"
        model(**x)
