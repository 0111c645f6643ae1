"""refbert.validate and the checks that call it: every bad input is a ValueError that names the op, the argument,
what was expected and what came (never a NaN, a silent broadcast or a NumPy traceback). Each case here is one that a
mutation audit of validate.py and its call sites in ops.py and model.py found uncaught, or a bug it found."""
import math
import re

import numpy as np
import pytest

import refbert
from refbert import model as M
from refbert import ops
from refbert import validate as V
from refbert.check import model_batch as batch, tiny_config as tiny
from refbert.philox import DropoutRNG

F = np.zeros
I64 = np.int64


def fwd_then(forward, backward, *args):
    """backward(dout, cache) bound to the cache of forward(*args), and the forward output."""
    out, cache = forward(*args)
    return out, (lambda d: backward(d, cache))


# --- ops: one bad argument each -----------------------------------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    # float16 (and anything but float32 / float64) is refused, not computed in a dtype the ops never promise
    (lambda: ops.gelu_forward(F(3, np.float16)),
     r"^gelu: argument 'x' expected a float32 or float64 numpy array, got array of shape \(3,\) and dtype float16$"),
    # integer arrays: every op that reads floats says so (an int x would compute in float64 silently)
    (lambda: ops.gelu_forward(F(3, I64)), r"^gelu: argument 'x' expected a float32 or float64 .*dtype int64$"),
    (lambda: ops.tanh_forward(F(3, I64)), r"^tanh: argument 'x' expected a float32 or float64 .*dtype int64$"),
    (lambda: ops.cross_entropy_forward(F((2, 3), I64), np.array([0, 1])),
     r"^cross_entropy: argument 'logits' expected a float32 or float64 .*shape \(2, 3\) and dtype int64$"),
    (lambda: ops.bias_gelu_forward(F((2, 3)), F(3, I64)),
     r"^bias_gelu: argument 'b' expected a float32 or float64 .*dtype int64$"),
    # mixed float dtypes: refused, not promoted to float64
    (lambda: ops.bias_gelu_forward(F((2, 3)), F(3, np.float32)),
     r"^bias_gelu: argument 'b' expected dtype float64 \(the dtype of 'x'\), got float32$"),
    (lambda: ops.softmax_forward(F((2, 3)), 1.0, F(3, np.float32)),
     r"^softmax: argument 'mask' expected dtype float64 \(the dtype of 'x'\), got float32$"),
    (lambda: ops.attention_forward(F((1, 2, 4)), F((1, 2, 4)), F((1, 2, 4)), 2, F((1, 1, 1, 2), np.float32)),
     r"^attention: argument 'mask' expected dtype float64 \(the dtype of 'q'\), got float32$"),
    # a weight with an extra axis: x (2, 3) @ w.T with w (4, 3, 1) would broadcast to a (2, 4) of the same size
    (lambda: ops.linear_forward(F((2, 3)), F((4, 3, 1))),
     r"^linear: argument 'w' expected shape \(C_out, C_in\) = \(\*, 3\), got \(4, 3, 1\)$"),
    (lambda: ops.embedding_forward(np.array([0]), F(7)),
     r"^embedding: argument 'w' expected shape \(V, C\) = \(\*, \*\), got \(7,\)$"),
    # 0-d arrays where an axis is needed
    (lambda: ops.softmax_forward(np.array(1.0)),
     r"^softmax: argument 'x' expected at least 1 dimension\(s\) \(\.\.\., T\), got shape \(\)$"),
    (lambda: ops.layernorm_forward(np.array(1.0), F(1), F(1)),
     r"^layernorm: argument 'x' expected at least 1 dimension\(s\) \(\.\.\., C\), got shape \(\)$"),
    (lambda: ops.gather_rows_forward(np.array(1.0), np.array([0])),
     r"^gather_rows: argument 'x' expected at least 1 dimension\(s\) \(\.\.\., C\), got shape \(\)$"),
    # shapes that would broadcast silently
    (lambda: ops.layernorm_forward(F((2, 3)), F(3), F(1)),
     r"^layernorm: argument 'b' expected shape \(C,\) = \(3,\), got \(1,\)$"),
    (lambda: ops.residual_layernorm_forward(F((2, 3)), F((1, 3)), F(3), F(3)),
     r"^residual_layernorm: argument 'a' expected shape \(same as x\) = \(2, 3\), got \(1, 3\)$"),
    (lambda: ops.dropout_residual_layernorm_forward(F((2, 3)), F((1, 3)), F(3), F(3)),
     r"^dropout_residual_layernorm: argument 'a' expected shape \(same as x\) = \(2, 3\), got \(1, 3\)$"),
    (lambda: ops.bias_gelu_forward(F((2, 3)), F(1)),
     r"^bias_gelu: argument 'b' expected shape \(I,\) = \(3,\), got \(1,\)$"),
    (lambda: ops.bce_with_logits_forward(F(2), F(1)),
     r"^bce_with_logits: argument 'targets' expected shape \(same as logits\) = \(2,\), got \(1,\)$"),
    (lambda: ops.attention_forward(F((1, 2, 6)), F((1, 2, 6)), F((1, 2, 4)), 2),
     r"^attention: argument 'v' expected shape \(B, T, C\) as q = \(1, 2, 6\), got \(1, 2, 4\)$"),
    # labels of the right size but transposed: refused, not read in the wrong order
    (lambda: ops.cross_entropy_forward(F((2, 3, 4)), np.zeros((3, 2), I64)),
     r"^cross_entropy: argument 'labels' expected an integer array of shape \(2, 3\) \(logits.shape\[:-1\]\), "
     r"got array of shape \(3, 2\) and dtype int64$"),
    # ids: bool is not an index (w[bool array] would select rows by mask); the first bad entry is the one named
    (lambda: ops.embedding_forward(np.array([True, False]), F((7, 2))),
     r"^embedding: argument 'ids' expected an integer numpy array, got array of shape \(2,\) and dtype bool$"),
    (lambda: ops.embedding_forward(np.array([[0, 9], [8, 1]]), F((7, 2))),
     r"^embedding: argument 'ids' expected values in \[0, 7\), got 9 at index \(0, 1\)$"),
    (lambda: ops.gather_rows_forward(F((2, 3, 4)), np.array([0, 6])),
     r"^gather_rows: argument 'rows' expected values in \[0, 6\), got 6 at index \(1,\)$"),
    (lambda: ops.gather_rows_forward(F((2, 3, 4)), np.array([[0, 1]])),
     r"^gather_rows: argument 'rows' expected a 1-d integer array, got shape \(1, 2\)$"),
    # the ends of each range: padding_idx in [0, V), p in [0, 1], eps > 0 and finite, targets in [0, 1]
    (lambda: ops.embedding_forward(np.array([0]), F((7, 2)), padding_idx=7),
     r"^embedding: argument 'padding_idx' expected a row in \[0, 7\), got 7$"),
    (lambda: ops.embedding_forward(np.array([0]), F((7, 2)), padding_idx=-1),
     r"^embedding: argument 'padding_idx' expected a row in \[0, 7\), got -1$"),
    (lambda: ops.dropout_forward(F(3), -0.1, DropoutRNG(0)),
     r"^dropout: argument 'p' expected a probability in \[0, 1\], got -0.1$"),
    (lambda: ops.layernorm_forward(F((2, 3)), F(3), F(3), eps=0),
     r"^layernorm: argument 'eps' expected a positive finite number \(added to the variance\), got 0$"),
    (lambda: ops.layernorm_forward(F((2, 3)), F(3), F(3), eps=math.nan),
     r"^layernorm: argument 'eps' expected a positive finite number \(added to the variance\), got nan$"),
    (lambda: ops.bce_with_logits_forward(F(2), np.array([-0.5, 1.0])),
     r"^bce_with_logits: argument 'targets' expected values in \[0, 1\], got values in \[-0.5, 1.0\]$"),
    (lambda: ops.attention_forward(F((1, 2, 6)), F((1, 2, 6)), F((1, 2, 6)), 0),
     r"^attention: argument 'n_heads' expected a positive divisor of C = 6, got 0$"),
    # bugs this audit fixed: a bool n_heads was one head; C = 0 divided by zero (1 / sqrt(hs))
    (lambda: ops.attention_forward(F((1, 2, 4)), F((1, 2, 4)), F((1, 2, 4)), True),
     r"^attention: argument 'n_heads' expected a positive divisor of C = 4, got True$"),
    (lambda: ops.attention_forward(F((1, 2, 0)), F((1, 2, 0)), F((1, 2, 0)), 1),
     r"^attention: argument 'q' expected at least one channel \(C >= 1\), got shape \(1, 2, 0\)$"),
    # the mixed-precision attention's own checks
    (lambda: ops.attention_forward_mixed(F((1, 2, 4), np.float32), F((1, 2, 4), np.float32),
                                         F((1, 2, 4), np.float32), 2, F((3, 1, 1, 2), np.float32)),
     r"^attention: argument 'mask' expected a shape that broadcasts to \(1, 2, 2, 2\), got \(3, 1, 1, 2\)$"),
    (lambda: ops.attention_forward_mixed(F((1, 2, 4), np.float32), F((1, 2, 4), np.float32),
                                         F((1, 2, 4), np.float32), 2, dropout_p=1.5, rng=DropoutRNG(0)),
     r"^attention: argument 'dropout_p' expected a probability in \[0, 1\], got 1.5$"),
])
def test_bad_argument_is_named_with_what_was_expected_and_what_came(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# a bug this audit fixed: floats() passes None by (for the optional b and mask), so a required array given as None
# reached `.shape` or `.ndim` and raised AttributeError; now it is refused by name
@pytest.mark.parametrize("op, call, arg", [
    ("linear", lambda: ops.linear_forward(F((2, 3)), None), "w"),
    ("linear", lambda: ops.linear_forward(None, F((4, 3))), "x"),
    ("embedding", lambda: ops.embedding_forward(np.array([0]), None), "w"),
    ("layernorm", lambda: ops.layernorm_forward(None, F(3), F(3)), "x"),
    ("softmax", lambda: ops.softmax_forward(None), "x"),
    ("gelu", lambda: ops.gelu_forward(None), "x"),
    ("tanh", lambda: ops.tanh_forward(None), "x"),
    ("dropout", lambda: ops.dropout_forward(None, 0.1, DropoutRNG(0)), "x"),
    ("add", lambda: ops.add_forward(None, F(2)), "a"),
    ("add", lambda: ops.add_forward(F(2), None), "b"),
    ("gather_rows", lambda: ops.gather_rows_forward(None, np.array([0])), "x"),
    ("residual_layernorm", lambda: ops.residual_layernorm_forward(F((2, 3)), None, F(3), F(3)), "a"),
    ("dropout_residual_layernorm", lambda: ops.dropout_residual_layernorm_forward(None, F((2, 3)), F(3), F(3)), "x"),
    ("bias_gelu", lambda: ops.bias_gelu_forward(F((2, 3)), None), "b"),
    ("attention", lambda: ops.attention_forward(F((1, 2, 4)), None, F((1, 2, 4)), 2), "k"),
    ("cross_entropy", lambda: ops.cross_entropy_forward(None, np.array([0])), "logits"),
    ("bce_with_logits", lambda: ops.bce_with_logits_forward(F(2), None), "targets"),
    ("mse", lambda: ops.mse_forward(F(2), None), "target"),
])
def test_a_required_array_given_as_none_is_refused_by_name(op, call, arg):
    with pytest.raises(ValueError, match=rf"^{op}: argument '{arg}' expected a float32 or float64 array, got None$"):
        call()


def _backward_cases():
    """(op, backward bound to a float64 forward's cache, the forward output): every op whose backward checks dout."""
    x, w, r = np.ones((2, 3)), np.ones((4, 3)), np.ones(3)
    q = np.ones((1, 2, 4))
    q32 = q.astype(np.float32)
    return [
        ("linear", *fwd_then(ops.linear_forward, ops.linear_backward, x, w)),
        ("embedding", *fwd_then(ops.embedding_forward, ops.embedding_backward, np.array([0, 1]), w)),
        ("layernorm", *fwd_then(ops.layernorm_forward, ops.layernorm_backward, x, r, r)),
        ("softmax", *fwd_then(ops.softmax_forward, ops.softmax_backward, x)),
        ("gelu", *fwd_then(ops.gelu_forward, ops.gelu_backward, x)),
        ("tanh", *fwd_then(ops.tanh_forward, ops.tanh_backward, x)),
        ("dropout", *fwd_then(ops.dropout_forward, ops.dropout_backward, x, 0.5, DropoutRNG(0))),
        ("add", *fwd_then(ops.add_forward, ops.add_backward, x, x)),
        ("gather_rows", *fwd_then(ops.gather_rows_forward, ops.gather_rows_backward, x, np.array([1]))),
        ("attention", *fwd_then(ops.attention_forward, ops.attention_backward, q, q, q, 2)),
        ("attention", *fwd_then(ops.attention_forward_mixed, ops.attention_backward_mixed, q32, q32, q32, 2)),
    ]


@pytest.mark.parametrize("case", range(len(_backward_cases())),
                         ids=[f"{c[0]}-{c[1].dtype}" for c in _backward_cases()])
def test_every_backward_refuses_a_dout_unlike_its_output(case):
    """A dout of another shape (even of the same size, transposed), another dtype, or not an array: refused by the
    backward in its own name, with the forward output's shape and dtype as what was expected."""
    op, out, backward = _backward_cases()[case]
    want = rf"^{op}: argument 'dout' expected an array of shape {re.escape(str(out.shape))} and dtype {out.dtype} "
    other = np.float64 if out.dtype == np.float32 else np.float32
    bad = [np.ones(out.shape + (1,), out.dtype), np.ones(out.shape, other), np.ones(out.shape, out.dtype).tolist()]
    if out.ndim >= 2 and out.shape[0] != out.shape[-1]:
        bad.append(np.ones(out.shape[::-1], out.dtype))             # the same size, transposed
    for dout in bad:
        got = "list" if isinstance(dout, list) else re.escape(f"array of shape {dout.shape} and dtype {dout.dtype}")
        with pytest.raises(ValueError, match=want + rf"\(.*\), got {got}$"):
            backward(dout)


# --- ops: what must be accepted -----------------------------------------------------------------------------------

def test_zero_d_arrays_are_numbers():
    """number() takes a 0-d array as its scalar: the same result as the Python float."""
    x = np.random.default_rng(0).standard_normal((3, 5))
    w, b = np.ones(5), np.zeros(5)
    np.testing.assert_array_equal(ops.softmax_forward(x, np.array(0.5))[0], ops.softmax_forward(x, 0.5)[0])
    np.testing.assert_array_equal(ops.layernorm_forward(x, w, b, np.array(1e-5))[0],
                                  ops.layernorm_forward(x, w, b, 1e-5)[0])
    np.testing.assert_array_equal(ops.dropout_forward(x, np.array(0.5), DropoutRNG(3))[0],
                                  ops.dropout_forward(x, 0.5, DropoutRNG(3))[0])
    assert V.number("op", "n", np.array(3), integer=True) == 3


def test_ml_dtypes_scalars_are_numbers():
    """A bfloat16 scalar (ml_dtypes: not an np.floating) is a real number, returned as a Python float."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    v = V.number("op", "x", ml_dtypes.bfloat16(0.5))
    assert v == 0.5 and type(v) is float


def test_bce_targets_at_both_ends_of_the_range():
    """Targets exactly 0 and 1 are valid: the loss is the definition's, mean(log(1 + exp(-z)) or log(1 + exp(z)))."""
    z = np.array([0.3, -1.2])
    loss, _ = ops.bce_with_logits_forward(z, np.array([1.0, 0.0]))
    assert loss == pytest.approx((np.logaddexp(0, -z[0]) + np.logaddexp(0, z[1])) / 2, rel=1e-14)


# --- validate's functions directly (the kernels call them too) ----------------------------------------------------

def test_floats_checks_every_array_past_a_none_and_returns_the_dtype():
    with pytest.raises(ValueError, match=r"^op: argument 'b' expected a float32 or float64 numpy array, got array of "
                                         r"shape \(2,\) and dtype int64$"):
        V.floats("op", a=None, b=F(2, I64))
    assert V.floats("op", a=None, b=F(2, np.float32), c=None) == np.float32
    assert V.floats("op", a=None) is None


# --- the model's inputs ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, match", [
    (dict(token_type_ids=np.array([[0, 1, 0]])),
     r"^BertModel: argument 'token_type_ids' expected shape \(B, T\) as input_ids = \(1, 2\), got \(1, 3\)$"),
    (dict(token_type_ids=np.array([[True, False]])),
     r"^BertModel: argument 'token_type_ids' expected an integer numpy array, got array of shape \(1, 2\) and "
     r"dtype bool$"),
    # bugs this audit fixed: a ragged list gave NumPy's "inhomogeneous shape" error, naming nothing
    (dict(token_type_ids=[[0], [0, 1]]), r"^BertModel: argument 'token_type_ids' expected an integer numpy array, "
                                         r"got list$"),
    (dict(position_ids=[[0], [0, 1]]), r"^BertModel: argument 'position_ids' expected an integer array that "
                                       r"broadcasts to \(1, 2\), got a ragged list$"),
])
def test_bad_encoder_inputs_name_the_argument(change, match):
    with pytest.raises(ValueError, match=match):
        refbert.BertModel(tiny())(input_ids=np.array([[1, 2]]), **change)


def test_the_longest_sequence_is_accepted():
    """T = max_position_embeddings is valid (positions 0 .. max - 1)."""
    cfg = tiny()
    out = refbert.BertModel(cfg)(input_ids=np.ones((1, cfg.max_position_embeddings), I64))
    assert out["last_hidden_state"].shape == (1, cfg.max_position_embeddings, cfg.hidden_size)


def test_model_dtype_and_seed_are_checked():
    with pytest.raises(ValueError, match=r"^BertModel: argument 'dtype' expected float32 or float64, got float16$"):
        refbert.BertModel(tiny(), dtype=np.float16)
    with pytest.raises(ValueError, match=r"^BertModel: argument 'seed' expected a non-negative integer, got -1$"):
        refbert.BertModel(tiny(), seed=-1)


def test_bert_model_backward_names_the_gradient_it_refuses():
    """A bug this audit fixed: both gradients were called 'dout', the name of neither argument."""
    cfg = tiny()
    m = refbert.BertModel(cfg)
    m(input_ids=np.array([[1, 2]]))
    with pytest.raises(ValueError, match=r"^BertModel.backward: argument 'dpooler_output' expected an array of shape "
                                         r"\(1, 12\) and dtype float32 .*, got array of shape \(1, 2, 12\)"):
        m.backward(dpooler_output=np.ones((1, 2, cfg.hidden_size), np.float32))
    with pytest.raises(ValueError, match=r"^BertModel.backward: argument 'dlast_hidden_state' expected an array of "
                                         r"shape \(1, 2, 12\) and dtype float32 .*, got array of shape \(1, 2, 12\) "
                                         r"and dtype float64$"):
        m.backward(dlast_hidden_state=np.ones((1, 2, cfg.hidden_size)))


@pytest.mark.parametrize("head, name, bad, match", [
    # labels of the right size, transposed: refused by the head, not read in another order
    ("BertForTokenClassification", "labels", lambda x: x["labels"].T.copy(),
     r"expected an integer array of shape \(2, 6\), got array of shape \(6, 2\) and dtype int64"),
    # BertForPreTraining's NSP label has two classes: 2 is refused by the head, in its own name
    ("BertForPreTraining", "next_sentence_label", lambda x: np.array([0, 2]),
     r"expected values in \[0, 2\) or -100, got 2 at index \(1,\)"),
    # QA positions must be integers (floats reached cross_entropy, which named its own 'labels')
    ("BertForQuestionAnswering", "start_positions", lambda x: x["start_positions"].astype(np.float64),
     r"expected 2 integer positions, got array of shape \(2,\) and dtype float64"),
])
def test_bad_labels_are_refused_by_the_head(head, name, bad, match):
    cfg = tiny(head)
    x = batch(cfg, head)
    x[name] = bad(x)
    with pytest.raises(ValueError, match=rf"^{head}: argument '{name}' {match}$"):
        getattr(refbert, head)(cfg, dtype=np.float64)(**x)


def test_multiple_choice_position_ids_are_its_shape_or_one_row():
    """A bug this audit fixed: position_ids (num_choices, B, T), the same size as (B, num_choices, T), were
    reshaped silently into the wrong rows; (T,) and (1, T) are still broadcast, as BertModel does."""
    cfg = tiny("BertForMultipleChoice")
    mc = refbert.BertForMultipleChoice(cfg, dtype=np.float64).eval()
    ids = np.random.default_rng(0).integers(1, cfg.vocab_size, (3, 2, 4))
    pos = np.broadcast_to(np.arange(4), ids.shape).copy()
    with pytest.raises(ValueError, match=r"^BertForMultipleChoice: argument 'position_ids' expected an array of shape "
                                         r"\(B, num_choices, T\) = \(3, 2, 4\) as input_ids, got array of shape "
                                         r"\(2, 3, 4\) and dtype int64$"):
        mc(input_ids=ids, position_ids=pos.transpose(1, 0, 2))
    want = mc(input_ids=ids, position_ids=pos).logits
    for row in (np.arange(4), np.arange(4)[None]):
        np.testing.assert_array_equal(mc(input_ids=ids, position_ids=row).logits, want)


def test_decode_qa_span_refuses_a_fractional_answer_length():
    with pytest.raises(ValueError, match=r"^decode_qa_span: argument 'max_answer_length' expected a positive integer "
                                         r"\(tokens\), got 1.5$"):
        M.decode_qa_span(F((2, 5)), F((2, 5)), max_answer_length=1.5)


def test_config_accepts_a_zero_initializer_range():
    """initializer_range is a standard deviation: 0 is valid (HF's check is >= 0), only negatives are refused."""
    assert refbert.BertConfig(initializer_range=0.0).initializer_range == 0.0
