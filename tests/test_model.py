"""The whole model: finite differences for every parameter of every head, semantics, memory, bad input."""
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import refbert
from refbert import model as M
from refbert.check import HEADS, model_batch as batch, tiny_config as tiny
from refbert.gradcheck import TOLERANCE, check_model

@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("train", [False, True])
def test_every_parameter_against_finite_differences(head, train):
    cfg = tiny(head, hidden_act="gelu" if train else "gelu_new")
    model = getattr(refbert, head)(cfg, seed=1, dtype=np.float64).train(train)
    for p in model.parameters().values():  # move off HF's init (LayerNorm 1/0, zero biases) so no term hides
        p += np.random.default_rng(2).standard_normal(p.shape) * 0.05
    errs = check_model(model, batch(cfg, head), n_dirs=1)
    assert set(errs) == set(model.parameters())
    bad = {k: v for k, v in errs.items() if v > TOLERANCE}
    assert not bad, bad


def test_regression_head_is_mse_and_checks():
    cfg = tiny(num_labels=1)
    model = refbert.BertForSequenceClassification(cfg, dtype=np.float64)
    x = batch(cfg, "BertModel")
    x["labels"] = np.array([0.5, -1.0])
    out = model.forward(**x)
    assert out.loss == pytest.approx(np.mean((out.logits[:, 0] - x["labels"]) ** 2), rel=1e-14)  # MSE by definition
    errs = check_model(model, x, n_dirs=1)
    assert max(errs.values()) <= TOLERANCE


def test_parameter_names_and_shapes_match_torch():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for head in HEADS:
        cfg = tiny(head)
        hf_cfg = transformers.BertConfig(**{k: getattr(cfg, k) for k in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "max_position_embeddings", "type_vocab_size")}, num_labels=cfg.num_labels)
        with torch.device("meta"):
            hf = getattr(transformers, head)(hf_cfg)
        ours = getattr(refbert, head)(cfg).parameters()
        assert [(k, tuple(v.shape)) for k, v in hf.named_parameters()] == [(k, v.shape) for k, v in ours.items()], head


def test_init_follows_hf():
    cfg = tiny(initializer_range=0.5)
    P = refbert.BertForPreTraining(cfg, seed=3).parameters()
    assert not P["bert.embeddings.word_embeddings.weight"][cfg.pad_token_id].any()  # padding row zero
    assert (P["bert.embeddings.LayerNorm.weight"] == 1).all() and not P["bert.embeddings.LayerNorm.bias"].any()
    assert not P["cls.predictions.bias"].any() and not P["bert.pooler.dense.bias"].any()
    w = P["bert.encoder.layer.0.intermediate.dense.weight"]
    # 240 draws of normal(0, 0.5): the sample std is within 15% of 0.5 with overwhelming probability
    assert abs(w.std() / 0.5 - 1) < 0.15 and w.dtype == np.float32


def test_train_eval_dropout_reproducible():
    cfg = tiny(hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.3)
    x = batch(cfg, "BertModel")
    a, b = refbert.BertModel(cfg, seed=4), refbert.BertModel(cfg, seed=4)
    ha, hb = a(**x).last_hidden_state, b(**x).last_hidden_state
    np.testing.assert_array_equal(ha, hb)  # same seed, same dropout masks
    assert not np.array_equal(ha, a(**x).last_hidden_state)  # a new forward draws new masks
    a.eval()
    np.testing.assert_array_equal(a(**x).last_hidden_state, a(**x).last_hidden_state)  # eval: no dropout


def test_float32_matches_float64():
    cfg = tiny()
    x = batch(cfg, "BertForPreTraining")
    m32 = refbert.BertForPreTraining(cfg, seed=5, dtype=np.float32)
    m64 = refbert.BertForPreTraining(cfg, seed=5, dtype=np.float64)
    o32, o64 = m32(**x), m64(**x)
    assert o32.prediction_logits.dtype == np.float32 and o32.loss.dtype == np.float32
    # same init numbers (drawn in float64, cast), same dropout masks; float32 carries ~1e-7 relative per op
    np.testing.assert_allclose(o32.prediction_logits, o64.prediction_logits, rtol=1e-4, atol=1e-5)
    g32, g64 = m32.backward(), m64.backward()
    for k in g32:
        assert g32[k].dtype == np.float32
        scale = np.abs(g64[k]).max() + 1e-6
        assert np.abs(g32[k] - g64[k]).max() <= 1e-4 * scale, k


def test_outputs_hidden_states_and_attentions():
    cfg = tiny()
    x = batch(cfg, "BertModel")
    out = refbert.BertModel(cfg).eval()(**x, output_hidden_states=True, output_attentions=True)
    assert len(out.hidden_states) == cfg.num_hidden_layers + 1
    np.testing.assert_array_equal(out.hidden_states[-1], out.last_hidden_state)
    att = out.attentions[0]
    assert att.shape == (2, 3, 6, 6)
    np.testing.assert_allclose(att.sum(-1), 1, rtol=1e-6)  # rows are distributions (float32)
    assert (att[1, :, :, 4:] == 0).all()  # padded keys get no attention


def test_qa_span_decoder():
    s = np.array([[5.0, 0.0, 3.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0, 9.0]])
    e = np.array([[5.0, 0.0, 0.0, 2.0, 0.0], [0.0, 0.0, 0.0, 8.0, -5.0]])
    # row 0: best span (2, 3) scores 3 + 2 = 5 but null (0, 0) scores 10 -> null.
    # row 1: (4, 3) would score 17 but start > end is not a span; (1, 3) scores 1 + 8 = 9, beating (4, 4) = 4,
    # (3, 3) = 8 and null 0
    assert M.decode_qa_span(s, e) == [(0, 0, 10.0), (1, 3, 9.0)]
    assert M.decode_qa_span(s, e, null_score_diff_threshold=6.0)[0] == (2, 3, 5.0)
    # null 10 against the span's 5 is a difference of exactly 5: the null answer only when the difference is
    # greater than the threshold (BERT's run_squad.py and HF's postprocessing: score_diff > threshold)
    assert M.decode_qa_span(s, e, null_score_diff_threshold=5.0)[0] == (2, 3, 5.0)
    assert M.decode_qa_span(s, e, null_score_diff_threshold=4.5)[0] == (0, 0, 10.0)
    # at most 2 tokens: (2, 3) = 0 + 8 and (3, 3) = 8 tie; the first in reading order wins
    assert M.decode_qa_span(s, e, max_answer_length=2)[1] == (2, 3, 8.0)


def test_memory_per_token_per_layer():
    """The cache a layer keeps, measured, against the documented count (refbert.model.activation_floats)."""
    cfg = tiny(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    B, T = 2, 6
    model = refbert.BertModel(cfg, dtype=np.float64)
    model.forward(**batch(cfg, "BertModel", B, T))
    layer_cache = model._cache[1][1][1][0]
    params = {id(p) for p in model.parameters().values()}
    floats, mask_bytes = M.cache_nbytes(layer_cache, params)
    want_floats, want_bytes = M.activation_floats(cfg, T)
    assert floats == want_floats * B * T * 8 and mask_bytes == want_bytes * B * T
    model.backward(np.ones((B, T, cfg.hidden_size)))
    assert model._cache is None  # backward released the caches


# --- bad input ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, match", [
    (dict(input_ids=np.array([[1, 23]])), r"'input_ids' expected values in \[0, 23\), got 23"),
    (dict(input_ids=np.array([[-1, 2]])), r"'input_ids' expected values in \[0, 23\), got -1"),
    (dict(input_ids=np.ones((1, 17), np.int64)), r"'input_ids' expected a sequence length T in \[1, 16\].*got T = 17"),
    (dict(input_ids=np.ones(4, np.int64)), r"'input_ids' expected an integer array of shape \(B, T\)"),
    (dict(token_type_ids=np.array([[0, 2]])), r"'token_type_ids' expected values in \[0, 2\), got 2"),
    (dict(attention_mask=np.ones((1, 3))), r"'attention_mask' expected an array of shape \(1, 2\)"),
    (dict(attention_mask=np.array([[1, 2]])), r"'attention_mask' expected only 0 \(padding\) and 1"),
    (dict(position_ids=np.array([[0, 16]])), r"'position_ids' expected values in \[0, 16\), got 16"),
])
def test_bad_inputs_name_the_argument(change, match):
    x = {**dict(input_ids=np.array([[1, 2]])), **change}
    with pytest.raises(ValueError, match=match):
        refbert.BertModel(tiny())(**x)


def test_backward_misuse_and_bad_labels():
    cfg = tiny()
    m = refbert.BertForTokenClassification(cfg)
    with pytest.raises(ValueError, match="expected a forward"):
        m.backward()
    m(input_ids=np.array([[1, 2]]))
    with pytest.raises(ValueError, match="expected a forward with labels"):
        m.backward()
    with pytest.raises(ValueError, match=r"'labels' expected an integer array of shape \(1, 2\)"):
        m(input_ids=np.array([[1, 2]]), labels=np.array([1]))
    with pytest.raises(ValueError, match=r"'labels' expected values in \[0, 3\) or -100, got 3"):
        m(input_ids=np.array([[1, 2]]), labels=np.array([[1, 3]]))
    m(input_ids=np.array([[1, 2]]), labels=np.array([[1, 2]]))
    m.backward()
    with pytest.raises(ValueError, match="expected a forward"):
        m.backward()  # the caches were released
    e = refbert.BertModel(cfg)
    e(input_ids=np.array([[1, 2]]))
    with pytest.raises(ValueError, match=r"'dlast_hidden_state' expected an array of shape \(1, 2, 12\)"):
        e.backward(np.ones((1, 2, 11), np.float32))
    with pytest.raises(ValueError, match="backend: expected one of 'numpy', 'numba', 'cuda', got 'tpu'"):
        refbert.BertModel(cfg, backend="tpu")


def test_head_inputs_a_user_can_get_wrong_are_refused_by_name():
    """What used to pass silently: backward(None) (np.float32(None) is NaN: every gradient NaN), the multiple
    choice head's side inputs reshaped to any shape of the same size, regression labels matched by size only,
    NaN regression targets; the failed backward keeps the forward (it may be retried)."""
    cfg = tiny()
    m = refbert.BertForTokenClassification(cfg)
    m(input_ids=np.array([[1, 2]]), labels=np.array([[1, 2]]))
    for bad, got in ((None, "None"), ("1", "'1'"), (float("nan"), "nan"), (True, "True"), (np.float32("nan"), "nan"),
                     (np.array(np.inf), r"inf \(a 0-d array\)")):
        with pytest.raises(ValueError, match=rf"BertForTokenClassification.backward: argument 'dloss' expected a "
                                             rf"finite real number .*, got {got}$"):
            m.backward(bad)
    assert all(np.isfinite(g).all() for g in m.backward(np.float32(2.0)).values())
    mc = refbert.BertForMultipleChoice(cfg)
    ids = np.ones((3, 2, 4), np.int64)
    with pytest.raises(ValueError, match=r"'attention_mask' expected an array of shape \(B, num_choices, T\) = "
                                         r"\(3, 2, 4\) as input_ids, got array of shape \(2, 3, 4\)"):
        mc(input_ids=ids, attention_mask=np.ones((2, 3, 4), np.int64))
    with pytest.raises(ValueError, match=r"'token_type_ids' expected an array of shape .* got int"):
        mc(input_ids=ids, token_type_ids=1)
    bad = ids.copy()
    bad[2, 1, 3] = cfg.vocab_size                              # the index as the user's array has it, not flattened
    with pytest.raises(ValueError, match=rf"'input_ids' expected values in \[0, {cfg.vocab_size}\), got "
                                         rf"{cfg.vocab_size} at index \(2, 1, 3\)"):
        mc(input_ids=bad)
    sc = refbert.BertForSequenceClassification(tiny(num_labels=3, problem_type="regression"))
    with pytest.raises(ValueError, match=r"'labels' expected real regression targets of shape \(2, 3\), got array "
                                         r"of shape \(3, 2\)"):
        sc(input_ids=np.ones((2, 4), np.int64), labels=np.zeros((3, 2)))
    with pytest.raises(ValueError, match=r"'labels' expected finite regression targets, got a NaN"):
        sc(input_ids=np.ones((2, 4), np.int64), labels=np.full((2, 3), np.nan))
    one = refbert.BertForSequenceClassification(tiny(num_labels=1))
    for shape in ((2,), (2, 1)):                                # HF squeezes (B, 1) and (B,) alike
        assert np.isfinite(one(input_ids=np.ones((2, 4), np.int64), labels=np.zeros(shape)).loss)


@pytest.mark.parametrize("kw, match", [
    (dict(max_answer_length=0), r"'max_answer_length' expected a positive integer \(tokens\), got 0"),
    (dict(max_answer_length="a"), r"'max_answer_length' expected a positive integer \(tokens\), got 'a'"),
    (dict(context_mask=np.full((2, 5), 2)), r"'context_mask' expected a bool \(or 0/1\) array of shape \(B, T\) = "
                                           r"\(2, 5\), got .* with values other than 0 and 1"),
    (dict(context_mask=np.ones(5, bool)), r"'context_mask' expected .* got array of shape \(5,\)"),
    (dict(null_score_diff_threshold=float("nan")), r"'null_score_diff_threshold' expected a real number"),
    (dict(start_logits=np.full((2, 5), np.nan)), r"'start_logits' expected finite real logits, got a NaN"),
])
def test_qa_span_decoder_refuses_what_would_make_every_answer_null(kw, match):
    """A zero answer length or a mask of 2s (ok & 2 == 0) made every answer null; NaN logits gave (0, 0, nan)."""
    args = {**dict(start_logits=np.zeros((2, 5)), end_logits=np.zeros((2, 5))), **kw}
    with pytest.raises(ValueError, match=match):
        M.decode_qa_span(**args)


# --- the MLM decoder at the labelled positions; inference mode; outputs that are the user's --------------------

@pytest.mark.parametrize("head", ["BertForPreTraining", "BertForMaskedLM"])
@pytest.mark.parametrize("train", [False, True])
def test_labelled_decode_gives_the_full_decode_loss_and_gradients(head, train):
    cfg = tiny(head)
    x = batch(cfg, head)
    runs = {}
    for decode in M.MLM_DECODE:
        model = getattr(refbert, head)(cfg, seed=3, dtype=np.float64).train(train)  # same seed: same dropout masks
        out = model(**x, mlm_decode=decode)
        runs[decode] = out, model.backward()
    (full, g_full), (lab, g_lab) = runs["all"], runs["labelled"]
    # float64, the same sums in a different grouping (n rows instead of B*T): agreement to ~1e-15 relative
    assert float(lab.loss) == pytest.approx(float(full.loss), rel=1e-12)
    for k in g_full:
        np.testing.assert_allclose(g_lab[k], g_full[k], rtol=1e-10, atol=1e-13, err_msg=k)
    name = "prediction_logits" if head == "BertForPreTraining" else "logits"
    kept = np.flatnonzero(x["labels"].reshape(-1) != -100)
    np.testing.assert_array_equal(lab.masked_lm_positions, kept)
    assert lab[name] is None
    np.testing.assert_allclose(lab.masked_lm_logits, full[name].reshape(-1, cfg.vocab_size)[kept], rtol=1e-12)


@pytest.mark.parametrize("head", ["BertForPreTraining", "BertForMaskedLM"])
@pytest.mark.parametrize("decode", M.MLM_DECODE)
def test_mlm_rows_padding_gives_the_same_loss_and_gradients(head, decode):
    """model.mlm_rows = K pads the labelled rows to K (a CUDA graph's fixed shapes): the padded rows decode
    position 0 with label -100, which the cross-entropy ignores, so the loss and every gradient are the unpadded
    ones (float64: the same sums, the decoder's GEMM on more rows, ~1e-15 relative); the outputs mark the padding
    with position -1; more labelled positions than K is refused, naming the argument."""
    cfg = tiny(head)
    x = batch(cfg, head)
    n = int((x["labels"] != -100).sum())
    runs = {}
    for rows in (None, n + 3):
        model = getattr(refbert, head)(cfg, seed=3, dtype=np.float64).train(True)   # dropout on, the same masks
        model.mlm_decode, model.mlm_rows = decode, rows
        out = model(**x)
        runs[rows] = out, model.backward()
    (plain, g_plain), (padded, g_padded) = runs[None], runs[n + 3]
    assert float(padded.loss) == pytest.approx(float(plain.loss), rel=1e-12)
    for k in g_plain:
        np.testing.assert_allclose(g_padded[k], g_plain[k], rtol=1e-10, atol=1e-13, err_msg=k)
    if decode == "labelled":
        np.testing.assert_array_equal(padded.masked_lm_positions[:n], plain.masked_lm_positions)
        np.testing.assert_array_equal(padded.masked_lm_positions[n:], [-1, -1, -1])
        assert padded.masked_lm_logits.shape == (n + 3, cfg.vocab_size)
        np.testing.assert_allclose(padded.masked_lm_logits[:n], plain.masked_lm_logits, rtol=1e-12)
    model = getattr(refbert, head)(cfg, seed=3, dtype=np.float64)
    model.mlm_decode, model.mlm_rows = decode, n - 1
    with pytest.raises(ValueError, match=rf"'labels' expected at most mlm_rows={n - 1} labelled positions .*got {n}"):
        model(**x)


def test_paths_summed_in_the_gemm_or_by_the_model_give_the_same_bits(monkeypatch):
    """The model sums a tensor's gradient paths (the skip and q, k, v; the residual and the feed-forward) through
    linear_backward's dx_into where the backend says it takes it (refbert.ops does), else by adding them itself:
    the same additions in the same order, so every gradient is the same bits either way (float32, train mode)."""
    cfg = tiny("BertForPreTraining")
    x = batch(cfg, "BertForPreTraining")
    runs, took = [], []
    spy = M._takes_dx_into
    monkeypatch.setattr(M, "_takes_dx_into", lambda fn: took.append(spy(fn)) or took[-1])
    for into in (True, False):
        monkeypatch.setattr(refbert.ops.linear_backward, "dx_into", into)
        model = refbert.BertForPreTraining(cfg, seed=5, dtype=np.float32).train(True)
        out = model(**x)
        runs.append((float(out.loss), model.backward()))
        assert took and set(took) == {into}, took           # every sum went the way this run meant
        took.clear()
    (l1, g1), (l2, g2) = runs
    assert l1 == l2
    for k in g1:
        assert np.array_equal(g1[k], g2[k]), k


def test_labelled_decode_against_finite_differences():
    cfg = tiny("BertForPreTraining")
    model = refbert.BertForPreTraining(cfg, seed=1, dtype=np.float64)
    model.mlm_decode = "labelled"
    for p in model.parameters().values():
        p += np.random.default_rng(2).standard_normal(p.shape) * 0.05
    errs = check_model(model, batch(cfg, "BertForPreTraining"), n_dirs=1)
    assert max(errs.values()) <= TOLERANCE, errs


def test_no_grad_keeps_no_caches_and_gives_the_same_outputs():
    cfg = tiny("BertForPreTraining")
    x = batch(cfg, "BertForPreTraining")
    model = refbert.BertForPreTraining(cfg, seed=0, dtype=np.float64).eval()
    ref = model(**x)
    with refbert.no_grad():
        assert not refbert.is_grad_enabled()
        out = model(**x)
        enc = refbert.BertModel(cfg, seed=0, dtype=np.float64).eval()
        h = enc(input_ids=x["input_ids"], attention_mask=x["attention_mask"])
    assert refbert.is_grad_enabled()
    np.testing.assert_array_equal(out.prediction_logits, ref.prediction_logits)   # same ops, same order: exact
    assert model._cache is None and enc._cache is None
    with pytest.raises(ValueError, match="outside refbert.no_grad"):
        model.backward()
    with pytest.raises(ValueError, match="outside refbert.no_grad"):
        enc.backward(np.ones_like(h.last_hidden_state))


def test_a_head_without_labels_keeps_no_layer_caches(monkeypatch):
    kept = []
    real = M._Ctx.__init__

    def spy(self, *a, **kw):
        real(self, *a, **kw)
        kept.append(self.keep)
    monkeypatch.setattr(M._Ctx, "__init__", spy)
    cfg = tiny("BertForSequenceClassification")
    x = batch(cfg, "BertForSequenceClassification")
    model = refbert.BertForSequenceClassification(cfg)
    model(input_ids=x["input_ids"])               # no labels: no loss, no backward, no caches
    model(**x)                                    # labels: caches for the backward
    assert kept == [False, True]


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("decode", ["all", "labelled"])
def test_outputs_do_not_share_memory_with_what_the_backward_reads(backend, decode):
    """A user may write into any output array between forward and backward; the gradients stay bit for bit those
    of the untouched run. With the labelled decoder, masked_lm_positions are the rows the gather's backward
    scatters to and masked_lm_logits the loss's input (the numba cross-entropy keeps a view of its logits for the
    backward), so the model hands the user copies of both (the positions were shared until 2026-12-07)."""
    if backend == "numba":
        pytest.importorskip("numba")
    cfg = tiny("BertForPreTraining")
    x = batch(cfg, "BertForPreTraining")
    grads = []
    for scribble in (False, True):
        model = refbert.BertForPreTraining(cfg, seed=0, dtype=np.float64, backend=backend).eval()
        out = model(**x, output_hidden_states=True, output_attentions=True, mlm_decode=decode)
        if scribble:                              # a user writing into every output array
            for v in out.values():
                for a in (v if isinstance(v, tuple) else (v,)):
                    if isinstance(a, np.ndarray) and a.ndim:
                        a[...] = 7.0
        grads.append(model.backward())
    for k in grads[0]:
        np.testing.assert_array_equal(grads[1][k], grads[0][k], err_msg=k)


@settings(max_examples=8)                  # each example checks every parameter tensor: kept to a few
@given(B=st.integers(1, 3), T=st.integers(1, 5), H=st.integers(1, 3), seed=st.integers(0, 2 ** 16))
@example(B=1, T=1, H=1, seed=0)            # one sequence of one token through one head
@example(B=2, T=1, H=2, seed=1)
def test_every_parameter_on_drawn_shapes(B, T, H, seed):
    cfg = tiny(num_hidden_layers=1, num_attention_heads=H, hidden_size=4 * H, intermediate_size=7,
               max_position_embeddings=8)
    model = refbert.BertForSequenceClassification(cfg, seed=1, dtype=np.float64).train(True)
    r = np.random.default_rng(seed)
    for p in model.parameters().values():
        p += r.standard_normal(p.shape) * 0.05
    am = (np.arange(T) < r.integers(1, T + 1, (B, 1))).astype(np.int64)    # >= 1 real token per row
    am[-1] = np.arange(T) < 1                                                # and a row with exactly one
    x = dict(input_ids=r.integers(1, cfg.vocab_size, (B, T)), attention_mask=am,
             token_type_ids=(np.arange(T) >= T // 2).astype(np.int64)[None].repeat(B, 0),
             labels=r.integers(0, cfg.num_labels, B))
    errs = check_model(model, x, n_dirs=1)
    assert max(errs.values()) <= TOLERANCE, errs


@pytest.mark.parametrize("head", ["BertForSequenceClassification", "BertForTokenClassification",
                                  "BertForMultipleChoice"])
def test_classifier_dropout_is_its_own_rate(head):
    """HF's classifier_dropout: the rate of the dropout before the classifier, hidden_dropout_prob's when None.
    (a) classifier_dropout=0 beside hidden and attention dropout 0.5, train mode: the logits are the classifier
    applied to this very forward's undropped features (the last hidden state, pooled for the pooled heads), equal
    within float64 rounding (the same products, ~1e-15 relative; 1e-12 allows for the order of their sums).
    (b) classifier_dropout=0.5 with every other rate 0: train mode's logits differ from eval mode's (the encoder
    is the same in both, so only that dropout can move them; all 2 x 12 features kept has probability 2^-24).
    (c) classifier_dropout=None with hidden_dropout_prob=0.5: the same bits as classifier_dropout=0.5 (the same
    seed draws the same masks), not those of 0."""
    x = batch(tiny(head), head)
    x.pop("labels")
    cfg = tiny(head, hidden_dropout_prob=0.5, attention_probs_dropout_prob=0.5, classifier_dropout=0.0)
    model = getattr(refbert, head)(cfg, seed=0, dtype=np.float64).train(True)
    out = model(**x, output_hidden_states=True)
    h, P = out.hidden_states[-1], model.params
    feats = h if head == "BertForTokenClassification" else \
        np.tanh(h[:, 0] @ P["bert.pooler.dense.weight"].T + P["bert.pooler.dense.bias"])
    want = feats @ P["classifier.weight"].T + P["classifier.bias"]
    got = np.asarray(out.logits).reshape(want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    cfg = tiny(head, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.5)
    model = getattr(refbert, head)(cfg, seed=0, dtype=np.float64)
    train, ev = model.train(True)(**x).logits, model.eval()(**x).logits
    assert not np.array_equal(np.asarray(train), np.asarray(ev))
    runs = {}
    for rate in (None, 0.5, 0.0):
        cfg = tiny(head, hidden_dropout_prob=0.5, classifier_dropout=rate)
        runs[rate] = np.asarray(getattr(refbert, head)(cfg, seed=0, dtype=np.float64).train(True)(**x).logits)
    assert np.array_equal(runs[None], runs[0.5]) and not np.array_equal(runs[None], runs[0.0])


@pytest.mark.parametrize("head", ["BertForSequenceClassification", "BertForTokenClassification",
                                  "BertForMultipleChoice", "BertForNextSentencePrediction"])
def test_a_label_past_the_classes_is_refused_by_the_head(head):
    """A class label equal to the number of classes (one past the last) is refused by the head, in its own name,
    before any op sees it: the message names the class, the argument and the valid range, [0, n) or -100."""
    cfg = tiny(head)
    x = batch(cfg, head)
    n = {"BertForMultipleChoice": x["input_ids"].shape[1], "BertForNextSentencePrediction": 2}.get(head, cfg.num_labels)
    x["labels"] = x["labels"].copy()
    x["labels"].reshape(-1)[-1] = n
    with pytest.raises(ValueError, match=rf"^{head}: argument 'labels' expected values in \[0, {n}\) or -100, got {n}"):
        getattr(refbert, head)(cfg, dtype=np.float64)(**x)
