"""Every gradient of every op against centred finite differences in float64, on hypothesis-drawn shapes.

Tolerance: refbert.gradcheck.TOLERANCE = 1e-7 relative — float64 centred differences with h = 1e-5 carry
~1e-10 truncation and ~1e-11 rounding error, so a correct backward sits 3+ orders of magnitude below it.
"""
import math
import re

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from refbert import ops
from refbert.check import _mask, bind, op_cases, run, Case
from refbert.gradcheck import TOLERANCE, check_pair
from refbert.philox import DropoutRNG

dims = st.integers(1, 6)
seeds = st.integers(0, 2 ** 16)


def assert_grads(forward, backward, inputs, wrt, **kw):
    errs = check_pair(forward, backward, inputs, wrt, **kw)
    assert max(errs.values()) <= TOLERANCE, errs


def fresh_rng(forward, seed=7):
    """Bind a fresh DropoutRNG per call, so each finite-difference evaluation draws the same dropout mask."""
    return lambda **kw: forward(**kw, rng=DropoutRNG(seed))


# --- the table behind `refbert check` -------------------------------------------------------------------------

def test_check_table_covers_every_op_and_passes():
    rows = run(op_cases())
    assert all(ok for *_, ok in rows), [r for r in rows if not r[-1]]
    checked = {c.forward.__name__ for c in op_cases()} | {"embedding_forward"}  # padding case wraps the forward
    defined = {n for n in dir(ops) if n.endswith("_forward")}
    assert defined <= checked, defined - checked


# --- per-op gradients on drawn shapes ------------------------------------------------------------------------

@given(lead=st.lists(dims, min_size=0, max_size=2), cin=dims, cout=dims, bias=st.booleans(), seed=seeds)
def test_linear(lead, cin, cout, bias, seed):
    r = np.random.default_rng(seed)
    inputs = dict(x=r.standard_normal((*lead, cin)), w=r.standard_normal((cout, cin)))
    if bias:
        inputs["b"] = r.standard_normal(cout)
    assert_grads(ops.linear_forward, ops.linear_backward, inputs, ("x", "w", "b") if bias else ("x", "w"))


@given(vocab=st.integers(1, 9), C=dims, B=dims, T=dims, pad=st.booleans(), seed=seeds)
def test_embedding(vocab, C, B, T, pad, seed):
    r = np.random.default_rng(seed)
    ids = r.integers(0, vocab, (B, T))  # small vocab: repeats are the rule
    w = r.standard_normal((vocab, C))
    pad_idx = int(ids[0, 0]) if pad else None
    dw = ops.embedding_backward(*(lambda o, c: (r.standard_normal(o.shape), c))(*ops.embedding_forward(ids, w, pad_idx)))
    if pad:
        assert not dw[pad_idx].any(), "the padding row gets no gradient"
    fwd = lambda w: ops.embedding_forward(ids, w)  # noqa: E731  the plain lookup's true derivative
    bwd = lambda d, c: ops.embedding_backward(d, c)  # noqa: E731
    assert_grads(fwd, bwd, dict(w=w), ("w",))


@given(lead=st.lists(dims, min_size=1, max_size=2), C=st.integers(1, 9), scale=st.sampled_from([1.0, 1e-3, 1e3]),
       seed=seeds)
def test_layernorm(lead, C, scale, seed):
    r = np.random.default_rng(seed)
    x = (r.standard_normal((*lead, C)) + r.standard_normal()) * scale  # an offset, but no 1e3-fold cancellation
    # C <= 2: xhat is 0 (C = 1) or +-1 (C = 2) whatever x is, so dx is ~0 and only FD noise is left to compare
    only = ("w", "b") if C <= 2 else None
    # layernorm is scale-invariant in x, so the FD step scales with x's spread (h / scale = 1e-5 keeps the
    # truncation error at ~1e-10 relative for every scale)
    assert_grads(ops.layernorm_forward, ops.layernorm_backward,
                 dict(x=x, w=r.standard_normal(C), b=r.standard_normal(C)), ("x", "w", "b"), only=only,
                 h=1e-5 * scale)


@given(B=dims, T=dims, scale=st.sampled_from([1.0, 0.125]), big=st.booleans(),
       fill=st.sampled_from([-np.inf, np.finfo(np.float64).min, -1e4]), seed=seeds)
@example(B=1, T=1, scale=1.0, big=False, fill=-np.inf, seed=0)           # a single position: p = 1, dx = 0
def test_softmax_with_mask(B, T, scale, big, fill, seed):
    r = np.random.default_rng(seed)
    x = r.standard_normal((B, 3, T)) + (1e4 if big else 0.0)
    lengths = r.integers(1, T + 1, B)
    lengths[0] = 1  # always a row with a single real token
    mask = _mask(B, T, lengths, np.float64, fill)[:, 0]  # (B, 1, T)
    assert_grads(lambda x: ops.softmax_forward(x, scale, mask), ops.softmax_backward, dict(x=x), ("x",))


@given(shape=st.lists(dims, min_size=1, max_size=3), approximate=st.sampled_from(["none", "tanh"]), seed=seeds)
def test_gelu(shape, approximate, seed):
    x = 4 * np.random.default_rng(seed).standard_normal(shape)
    assert_grads(lambda x: ops.gelu_forward(x, approximate), ops.gelu_backward, dict(x=x), ("x",))


@given(shape=st.lists(dims, min_size=1, max_size=3), seed=seeds)
def test_tanh(shape, seed):
    x = 3 * np.random.default_rng(seed).standard_normal(shape)
    assert_grads(ops.tanh_forward, ops.tanh_backward, dict(x=x), ("x",))


@given(shape=st.lists(dims, min_size=1, max_size=3), p=st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]), seed=seeds)
def test_dropout(shape, p, seed):
    x = np.random.default_rng(seed).standard_normal(shape)
    assert_grads(fresh_rng(lambda x, rng: ops.dropout_forward(x, p, rng)), ops.dropout_backward, dict(x=x), ("x",))


@given(shape=st.lists(dims, min_size=1, max_size=3), seed=seeds)
def test_add(shape, seed):
    r = np.random.default_rng(seed)
    assert_grads(ops.add_forward, ops.add_backward, dict(a=r.standard_normal(shape), b=r.standard_normal(shape)),
                 ("a", "b"))


@given(B=st.integers(1, 2), T=st.integers(1, 5), H=st.integers(1, 8), hs=st.integers(1, 3),
       p=st.sampled_from([0.0, 0.3]), fill=st.sampled_from([-np.inf, np.finfo(np.float64).min]), seed=seeds)
@example(B=1, T=1, H=1, hs=1, p=0.0, fill=-np.inf, seed=0)              # one sequence of one token, one head
@example(B=1, T=1, H=1, hs=3, p=0.3, fill=np.finfo(np.float64).min, seed=1)
def test_attention(B, T, H, hs, p, fill, seed):
    r = np.random.default_rng(seed)
    q, k, v = (r.standard_normal((B, T, H * hs)) for _ in range(3))
    lengths = r.integers(1, T + 1, B)
    lengths[-1] = 1  # a sequence with one real token
    mask = _mask(B, T, lengths, np.float64, fill)
    fwd = fresh_rng(lambda q, k, v, rng: ops.attention_forward(q, k, v, H, mask, p, rng))
    assert_grads(fwd, ops.attention_backward, dict(q=q, k=k, v=v), ("q", "k", "v"))


@given(N=dims, Vc=st.integers(1, 9), frac_ignored=st.sampled_from([0.0, 0.5, 1.0]), big=st.booleans(), seed=seeds)
def test_cross_entropy(N, Vc, frac_ignored, big, seed):
    r = np.random.default_rng(seed)
    logits = r.standard_normal((2, N, Vc)) + (1e4 if big else 0.0)
    labels = r.integers(0, Vc, (2, N))
    labels[r.random((2, N)) < frac_ignored] = -100
    assert_grads(lambda logits: ops.cross_entropy_forward(logits, labels), ops.cross_entropy_backward,
                 dict(logits=logits), ("logits",))


@given(shape=st.lists(dims, min_size=1, max_size=3), seed=seeds)
def test_mse(shape, seed):
    r = np.random.default_rng(seed)
    assert_grads(ops.mse_forward, ops.mse_backward,
                 dict(pred=r.standard_normal(shape), target=r.standard_normal(shape)), ("pred", "target"))


# --- irregular sizes (tails, odd head sizes): directional derivatives, too many elements for one-at-a-time FD ----

def test_irregular_shapes_T37_C52():
    r = np.random.default_rng(3)
    B, T, C, H = 2, 37, 52, 4  # hs = 13
    x = r.standard_normal((B, T, C))
    mask = _mask(B, T, [37, 1], np.float64, np.finfo(np.float64).min)
    labels = r.integers(0, C, (B, T))
    labels[:, ::3] = -100
    cases = [
        Case("linear", ops.linear_forward, ops.linear_backward,
             dict(x=x, w=r.standard_normal((31, C)), b=r.standard_normal(31)), ("x", "w", "b")),
        Case("layernorm", ops.layernorm_forward, ops.layernorm_backward,
             dict(x=x, w=r.standard_normal(C), b=r.standard_normal(C)), ("x", "w", "b")),
        Case("softmax", ops.softmax_forward, ops.softmax_backward, dict(x=x), ("x",),
             dict(scale=0.3, mask=_mask(B, C, [C, 1], np.float64, -np.inf)[:, 0])),  # (B, 1, C)
        Case("gelu", ops.gelu_forward, ops.gelu_backward, dict(x=x), ("x",)),
        Case("attention", ops.attention_forward, ops.attention_backward,
             dict(q=x, k=r.standard_normal(x.shape), v=r.standard_normal(x.shape)), ("q", "k", "v"),
             dict(n_heads=H, mask=mask, dropout_p=0.1, rng=None)),
        Case("cross_entropy", ops.cross_entropy_forward, ops.cross_entropy_backward, dict(logits=x), ("logits",),
             dict(labels=labels)),
    ]
    for case in cases:
        errs = check_pair(bind(case), case.backward, case.inputs, case.wrt, mode="directional", n_dirs=3)
        assert max(errs.values()) <= TOLERANCE, (case.op, errs)


# --- float32: same math, own dtype -------------------------------------------------------------------------------

def _forward_outputs(dtype):
    """Every op's forward on the `refbert check` inputs cast to dtype (the mask and integer arguments as well)."""
    outs = []
    for case in op_cases():
        with np.errstate(over="ignore"):  # float64's finfo.min in a mask becomes -inf: still a mask
            cast = lambda a: a.astype(dtype) if isinstance(a, np.ndarray) and a.dtype.kind == "f" else a  # noqa: E731
            case.inputs = {k: cast(a) for k, a in case.inputs.items()}
            case.kwargs = {k: cast(a) for k, a in case.kwargs.items()}
        out, cache = bind(case)(**case.inputs)
        d = np.random.default_rng(0).standard_normal(np.shape(out)).astype(dtype)  # same upstream gradient in both
        grads = case.backward(d if np.ndim(out) else float(d), cache)
        outs.append((case.op, out, grads if isinstance(grads, tuple) else (grads,)))
    return outs


def test_float32_keeps_dtype_and_matches_float64():
    from refbert.gradcheck import rel_error
    for (op, o32, g32), (_, o64, g64) in zip(_forward_outputs(np.float32), _forward_outputs(np.float64)):
        assert np.asarray(o32).dtype == np.float32, op
        assert all(g.dtype == np.float32 for g in g32), op
        if "1e4" in op:
            continue  # float32 holds 1e4 + x to ~1e-3 absolute; the inputs themselves differ from float64's
        # float32 keeps ~7 digits; after a few reductions (sums over C, exp) agreement to ~1e-5 relative
        assert rel_error(o32, o64) <= 1e-5, (op, rel_error(o32, o64))
        for a, b in zip(g32, g64):
            assert rel_error(a, b) <= 1e-5, (op, rel_error(a, b))


# --- numerical stability ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_large_logits_and_single_real_token_stay_finite(dtype):
    r = np.random.default_rng(0)
    x = (1e4 * r.standard_normal((2, 4, 6))).astype(dtype)
    mask = _mask(2, 6, [6, 1], dtype, -np.inf)[:, 0]
    p, c = ops.softmax_forward(x, 1.0, mask)
    dx = ops.softmax_backward(np.ones_like(p), c)
    assert np.isfinite(p).all() and np.isfinite(dx).all()
    np.testing.assert_allclose(p.sum(-1), 1, rtol=1e-6)  # probabilities: every row sums to 1 (float32 rounding)
    assert (p[1, :, 1:] == 0).all() and (p[1, :, 0] == 1).all()  # the single real token takes all the mass
    labels = np.array([[0, 5, -100, 3], [1, -100, -100, 2]])
    loss, c = ops.cross_entropy_forward(x, labels)
    assert np.isfinite(loss) and np.isfinite(ops.cross_entropy_backward(1.0, c)).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_layernorm_constant_row_is_finite(dtype):
    x = np.full((3, 8), 7.25, dtype)
    out, c = ops.layernorm_forward(x, np.ones(8, dtype), np.zeros(8, dtype))
    dx, dw, db = ops.layernorm_backward(np.ones_like(out), c)
    assert all(np.isfinite(a).all() for a in (out, dx, dw, db))
    np.testing.assert_allclose(out, 0, atol=1e-6)  # (x - mean) = 0 up to rounding of the mean times rstd = 1e6


def test_cross_entropy_all_ignored_is_zero_not_nan():
    loss, c = ops.cross_entropy_forward(np.ones((4, 3)), np.full(4, -100))
    assert loss == 0.0 and not ops.cross_entropy_backward(1.0, c).any()


def test_cross_entropy_matches_definition():
    # -log softmax(z)[y] averaged over the kept rows, from the formula
    z = np.array([[1.0, 2.0, 3.0], [0.5, 0.5, 0.5], [9.0, 0.0, 0.0]])
    y = np.array([2, -100, 0])
    expect = np.mean([-math.log(math.exp(3) / (math.exp(1) + math.exp(2) + math.exp(3))),
                      -math.log(math.exp(9) / (math.exp(9) + 2))])
    assert ops.cross_entropy_forward(z, y)[0] == pytest.approx(expect, rel=1e-14)


# --- dropout semantics -------------------------------------------------------------------------------------------

def test_dropout_rate_and_reproducibility():
    x = np.ones((200, 500))
    out, _ = ops.dropout_forward(x, 0.1, DropoutRNG(5))
    n, dropped = x.size, int((out == 0).sum())
    # binomial(n=1e5, p=0.1): sd = sqrt(n p (1-p)) ~ 95; 5 sd is a bound a correct sampler passes ~always
    assert abs(dropped - 0.1 * n) <= 5 * math.sqrt(n * 0.1 * 0.9)
    np.testing.assert_array_equal(out[out != 0], 1 / 0.9)  # inverted: kept units are scaled by 1/(1-p)
    again, _ = ops.dropout_forward(x.astype(np.float32), 0.1, DropoutRNG(5))
    np.testing.assert_array_equal(again == 0, out == 0)  # same seed, same units, whatever the dtype
    same, _ = ops.dropout_forward(x, 0.1, DropoutRNG(5), train=False)
    assert same is x  # eval is the identity


# --- bad input: a ValueError naming the argument, what was expected and what came --------------------------------

F = np.zeros


@pytest.mark.parametrize("call, match", [
    (lambda: ops.linear_forward(F((2, 3)), F((4, 5)), F(4)), r"'w' expected shape \(C_out, C_in\) = \(\*, 3\), got \(4, 5\)"),
    (lambda: ops.linear_forward(F((2, 3)), F((4, 3)), F(5)), r"'b' expected shape \(C_out,\) = \(4,\), got \(5,\)"),
    (lambda: ops.linear_forward(F((2, 3), np.float32), F((4, 3)), F(4)), r"'w' expected dtype float32 .* got float64"),
    (lambda: ops.linear_forward([[1.0]], F((1, 1))), r"'x' expected a float32 or float64 numpy array, got list"),
    (lambda: ops.linear_forward(F((2, 3), np.int64), F((4, 3))), r"'x' expected a float32 or float64.*int64"),
    (lambda: ops.embedding_forward(np.array([0, 7]), F((7, 2))), r"'ids' expected values in \[0, 7\), got 7 at index \(1,\)"),
    (lambda: ops.embedding_forward(np.array([-1]), F((7, 2))), r"'ids' expected values in \[0, 7\), got -1"),
    (lambda: ops.embedding_forward(np.array([0.0]), F((7, 2))), r"'ids' expected an integer numpy array"),
    (lambda: ops.embedding_forward(np.array([0]), F((7, 2)), padding_idx=9), r"'padding_idx' expected a row in \[0, 7\)"),
    (lambda: ops.layernorm_forward(F((2, 3)), F(4), F(3)), r"'w' expected shape \(C,\) = \(3,\), got \(4,\)"),
    (lambda: ops.softmax_forward(F((2, 3, 4)), 1.0, F((2, 3))), r"'mask' expected a shape that broadcasts to \(2, 3, 4\), got \(2, 3\)"),
    (lambda: ops.softmax_forward(F((2, 4)), 1.0, F((3, 1, 4))), r"'mask' expected a shape that broadcasts to \(2, 4\), got \(3, 1, 4\)"),
    (lambda: ops.softmax_forward(F((1, 2)), 1.0, np.full((1, 2), -np.inf)), r"'x' \(with 'mask'\) expected every row to have a finite maximum"),
    (lambda: ops.gelu_forward(F(3), "erf"), r"'approximate' expected 'none' or 'tanh', got 'erf'"),
    (lambda: ops.dropout_forward(F(3), 1.5, DropoutRNG(0)), r"'p' expected a probability in \[0, 1\], got 1.5"),
    (lambda: ops.dropout_forward(F(3), 0.5, 42), r"'rng' expected a refbert.philox.DropoutRNG in training, got int"),
    (lambda: ops.add_forward(F((2, 3)), F((1, 3))), r"'b' expected shape \(same as a\) = \(2, 3\), got \(1, 3\)"),
    (lambda: ops.attention_forward(F((1, 2, 6)), F((1, 2, 6)), F((1, 2, 6)), 4), r"'n_heads' expected a positive divisor of C = 6, got 4"),
    (lambda: ops.attention_forward(F((1, 2, 6)), F((1, 3, 6)), F((1, 2, 6)), 2), r"'k' expected shape \(B, T, C\) as q = \(1, 2, 6\), got \(1, 3, 6\)"),
    (lambda: ops.attention_forward(F((2, 3, 4)), F((2, 3, 4)), F((2, 3, 4)), 2, F((2, 1, 1, 5))), r"'mask' expected a shape that broadcasts to \(2, 2, 3, 3\), got \(2, 1, 1, 5\)"),
    (lambda: ops.cross_entropy_forward(F((4, 3)), np.array([0, 1, 2])), r"'labels' expected an integer array of shape \(4,\)"),
    (lambda: ops.cross_entropy_forward(F((2, 3)), np.array([0, 3])), r"'labels' expected values in \[0, 3\) or -100, got 3"),
    (lambda: ops.cross_entropy_forward(np.array([[np.nan, 0.0]]), np.array([0])), r"'logits' expected finite rows"),
    (lambda: ops.mse_forward(F(3), F(4)), r"'target' expected shape \(same as pred\) = \(3,\), got \(4,\)"),
    (lambda: ops.tanh_backward(F(2), ops.tanh_forward(F(3))[1]), r"tanh: argument 'dout' expected an array of shape \(3,\)"),
    (lambda: ops.cross_entropy_backward(F(2), ops.cross_entropy_forward(F((1, 2)), np.array([0]))[1]), r"'dloss' expected a scalar"),
    # scalars: a finite real number, not None, a string, a bool or NaN (np.float32(None) would be a silent NaN)
    (lambda: ops.cross_entropy_backward(None, ops.cross_entropy_forward(F((1, 2)), np.array([0]))[1]), r"'dloss' expected a finite real number \(the loss is a scalar\), got None"),
    (lambda: ops.mse_backward("1", ops.mse_forward(F(2), F(2))[1]), r"'dloss' expected a finite real number .*, got '1'"),
    (lambda: ops.bce_with_logits_backward(np.nan, ops.bce_with_logits_forward(F(2), F(2))[1]), r"'dloss' expected a finite real number .*, got nan"),
    (lambda: ops.layernorm_forward(F((2, 3)), F(3), F(3), eps=-1.0), r"'eps' expected a positive finite number \(added to the variance\), got -1.0"),
    (lambda: ops.layernorm_forward(F((2, 3)), F(3), F(3), eps="1e-12"), r"'eps' expected a positive finite number .*, got '1e-12'"),
    (lambda: ops.layernorm_forward(F((2, 3)), F(3), None), r"'b' expected a float32 or float64 array, got None"),
    (lambda: ops.layernorm_forward(F((2, 0)), F(0), F(0)), r"'x' expected at least one channel to normalise over \(C >= 1\), got shape \(2, 0\)"),
    (lambda: ops.softmax_forward(F((2, 3)), "0.5"), r"'scale' expected a finite real number, got '0.5'"),
    (lambda: ops.softmax_forward(F((2, 3)), 10 ** 400), r"'scale' expected a finite real number, got 1000"),
    (lambda: ops.softmax_forward(F((2, 3)), F(3)), r"'scale' expected a finite real number, got array of shape \(3,\)"),
    (lambda: ops.dropout_forward(F(3), None, DropoutRNG(0)), r"'p' expected a probability in \[0, 1\], got None"),
    (lambda: ops.embedding_forward(np.array([0]), F((7, 2)), padding_idx=1.5), r"'padding_idx' expected a row in \[0, 7\), got 1.5"),
    (lambda: ops.bce_with_logits_forward(np.array([np.nan, 0.0]), F(2)), r"'logits' expected finite values, got a NaN"),
    (lambda: ops.softmax_forward(F((2, 0))), r"'x' expected at least one entry on the last axis \(T >= 1\)"),
    (lambda: ops.attention_forward(F((1, 0, 4)), F((1, 0, 4)), F((1, 0, 4)), 2), r"'q' expected at least one position \(T >= 1\)"),
    # a backward handed what is not its forward's cache
    (lambda: ops.layernorm_backward(F((2, 3)), ops.softmax_forward(F((2, 3)))[1]), r"'cache' expected the cache layernorm_forward returned \(a tuple of 4\), got a tuple of 2"),
    (lambda: ops.linear_backward(F((2, 3)), None), r"'cache' expected the cache linear_forward returned \(a tuple of 3\), got NoneType"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises(ValueError, match=match) as e:
        call()
    # and the op first: "linear: argument 'w' expected ..." (the op whose function the case calls)
    import inspect
    op = re.search(r"ops\.(\w+?)_(?:forward|backward)\(", inspect.getsource(call)).group(1)
    assert str(e.value).startswith(f"{op}: argument '"), (op, str(e.value))


@pytest.mark.parametrize("dtype", [np.float32])
def test_float64_scalars_keep_float32(dtype):
    """An np.float64 eps or scale (a config value read through NumPy, say) must not widen a float32 op: NumPy 2's
    promotion makes float32 array * np.float64 scalar float64, so the ops take such scalars as Python floats."""
    x = np.random.default_rng(0).standard_normal((2, 5)).astype(dtype)
    w, b = np.ones(5, dtype), np.zeros(5, dtype)
    assert ops.layernorm_forward(x, w, b, eps=np.float64(1e-12))[0].dtype == dtype
    assert ops.softmax_forward(x, np.float64(0.5))[0].dtype == dtype
    assert ops.dropout_forward(x, np.float64(0.5), DropoutRNG(0))[0].dtype == dtype


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_empty_mse_is_zero_not_nan(dtype):
    """N = 0: loss 0 and empty gradients, as cross_entropy and bce_with_logits (torch would give NaN), in the
    inputs' dtype like every other output (float32 stays float32)."""
    loss, cache = ops.mse_forward(np.zeros(0, dtype), np.zeros(0, dtype))
    grads = ops.mse_backward(1.0, cache)
    assert loss == 0.0 and [g.shape for g in grads] == [(0,), (0,)]
    assert np.asarray(loss).dtype == dtype and [g.dtype for g in grads] == [dtype, dtype]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tanh_gelu_at_huge_x_takes_its_limits(dtype):
    """The tanh form at |x| far past where x^3 or x^2 overflows: out = x for x > 0 (s = 1) and -0 for x < 0, and
    dx = 1 and 0, the limits of the derivative (x s (1 - s) -> 0 faster than x^3 grows); never NaN from inf * 0."""
    big = 3e38 if dtype == np.float32 else 1e300
    x = np.array([1e14, -1e14, 1e20, -1e20, big, -big, 1e4, -1e4], dtype)
    out, cache = ops.gelu_forward(x, "tanh")
    dx = ops.gelu_backward(np.ones_like(x), cache)
    np.testing.assert_array_equal(out, np.where(x > 0, x, 0).astype(dtype))
    assert np.signbit(out[x < 0]).all()                 # x * 0: -0, as the exact x * sigmoid(2u) rounds
    np.testing.assert_array_equal(dx, (x > 0).astype(dtype))


# --- the zero-row shortcut of linear_backward, under finite differences ------------------------------------------

def _rows_masked(nonzero, N=10):
    """linear with rows of its upstream gradient zeroed: out * m, m = 1 on `nonzero` of the N rows, 0 elsewhere.
    L = sum(out * m * dout), so finite differences see exactly the gradients linear_backward gets from dout * m."""
    m = np.zeros((2, N // 2, 1))
    m.reshape(-1)[:nonzero] = 1
    m = np.random.default_rng(nonzero).permutation(m.reshape(-1)).reshape(m.shape)    # scattered over the rows

    def forward(x, w, b):
        out, cache = ops.linear_forward(x, w, b)
        return out * m, cache

    def backward(dout, cache):
        return ops.linear_backward(dout * m, cache)
    return forward, backward


@pytest.mark.parametrize("nonzero", [0, 1, 4, 5, 6, 10])
def test_linear_backward_zero_row_shortcut_against_finite_differences(nonzero):
    # linear_backward skips the rows of dout that are all zero when fewer than half (0.5 N) carry a gradient, and
    # runs the plain GEMMs otherwise: 0, 1, 4 of 10 rows take the shortcut, 5 (the threshold), 6 and 10 do not
    N = 10
    r = np.random.default_rng(nonzero + 100)
    x, w, b = r.standard_normal((2, N // 2, 7)), r.standard_normal((3, 7)), r.standard_normal(3)
    forward, backward = _rows_masked(nonzero, N)
    rows = np.count_nonzero(forward(x, w, b)[0].reshape(N, 3).any(1))      # rows of dout * m that can be nonzero
    assert rows == nonzero and (rows < 0.5 * N) == (nonzero in (0, 1, 4))  # which branch linear_backward takes
    assert_grads(forward, backward, dict(x=x, w=w, b=b), ("x", "w", "b"))
    # and both branches give the same numbers: the shortcut only leaves out terms that are exactly zero
    out, cache = ops.linear_forward(x, w, b)
    d = r.standard_normal(out.shape) * _rows_masked(nonzero, N)[0](x, w, b)[0].astype(bool)
    dense = (d.reshape(-1, 3) @ w).reshape(x.shape), d.reshape(-1, 3).T @ x.reshape(-1, 7), d.reshape(-1, 3).sum(0)
    for got, want in zip(ops.linear_backward(d, cache), dense):
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)   # float64 sums in another grouping


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("nonzero", [2, 10])                 # the zero-row shortcut taken, and not
def test_linear_backward_dx_into_sums_into_the_given_array(dtype, nonzero):
    """dx_into: dx comes back as dx_into + dout @ w, in dx_into's own memory: bit for bit the separate add (the same
    single rounding of the same two terms), dw and db unchanged; a read-only dx_into gets the same sum in a new
    array; a wrong shape or dtype is refused by name."""
    r = np.random.default_rng(nonzero)
    x, w, b = (r.standard_normal(s).astype(dtype) for s in ((2, 5, 7), (3, 7), (3,)))
    out, cache = ops.linear_forward(x, w, b)
    d = r.standard_normal(out.shape).astype(dtype)
    d.reshape(10, 3)[nonzero:] = 0
    other = r.standard_normal(x.shape).astype(dtype)
    dx, dw, db = ops.linear_backward(d, cache)
    into = other.copy()
    got = ops.linear_backward(d, cache, dx_into=into)
    assert got[0] is into and got[0].dtype == dtype
    assert np.array_equal(got[0], other + dx) and np.array_equal(got[1], dw) and np.array_equal(got[2], db)
    frozen = other.copy()
    frozen.flags.writeable = False
    again = ops.linear_backward(d, cache, dx_into=frozen)[0]
    assert again is not frozen and np.array_equal(again, other + dx) and np.array_equal(frozen, other)
    with pytest.raises(ValueError, match=r"linear: argument 'dx_into' expected an array of shape \(2, 5, 7\)"):
        ops.linear_backward(d, cache, dx_into=other[:, :4])
    with pytest.raises(ValueError, match=r"'dx_into' expected .* dtype (float32|float64)"):
        ops.linear_backward(d, cache, dx_into=other.astype(np.float64 if dtype == np.float32 else np.float32))


# --- layernorm where its rows (nearly) do not vary --------------------------------------------------------------

@pytest.mark.parametrize("C", [1, 2, 3, 8])
@pytest.mark.parametrize("spread", [1e-3, 2e-6])
def test_layernorm_nearly_constant_rows(C, spread):
    # rows c + spread * noise: 1e-3 of c (eps = 1e-12 negligible beside the variance), and 2e-6 (variance ~ eps,
    # where eps shapes dx). The step follows the spread (layernorm is scale-invariant in x), so that finite
    # differences resolve dx, of order 1/spread.
    r = np.random.default_rng(C)
    x = 0.5 + r.random((3, 1)) + spread * r.standard_normal((3, C))
    w, b = r.standard_normal(C), r.standard_normal(C)
    out, cache = ops.layernorm_forward(x, w, b)
    dout = r.standard_normal(x.shape)
    dx = ops.layernorm_backward(dout, cache)[0]
    if C == 1:                                            # out = b whatever x is: dx is exactly 0
        assert not dx.any()
    if C == 2:
        # two values, d = x1 - x2: xhat1 = -xhat2 = d / sqrt(d^2 + 4 eps), so from the formula
        # dx1 = -dx2 = (dout1 w1 - dout2 w2) * 4 eps / (d^2 + 4 eps)^(3/2). At spread 1e-3 this is ~4e-3, below
        # what differences can see through the forward's own rounding of x - mean (1e-13 / 2h ~ 5e-6 here):
        # the formula is the proof there. rtol: the backward's (wdy - (xhat c1 + c2)) cancels to 4 eps / d^2 of
        # its terms, ~1e-10 relative rounding at spread 1e-3
        d = x[:, 0] - x[:, 1]
        dx1 = (dout[:, 0] * w[0] - dout[:, 1] * w[1]) * 4e-12 / (d * d + 4e-12) ** 1.5
        np.testing.assert_allclose(dx, np.stack([dx1, -dx1], 1), rtol=1e-7, atol=0)
        if spread > 1e-4:
            return
    assert_grads(ops.layernorm_forward, ops.layernorm_backward, dict(x=x, w=w, b=b), ("x", "w", "b"),
                 h=1e-5 * spread)
    if C > 2:
        assert np.abs(dx).max() > 0.1 / spread            # far from the 0 that any code would pass with


# --- GELU's small-|x| branch ------------------------------------------------------------------------------------

@given(shape=st.lists(dims, min_size=1, max_size=2), approximate=st.sampled_from(["none", "tanh"]), seed=seeds)
@example(shape=[4, 3], approximate="none", seed=0)
def test_gelu_small_x_branch(shape, approximate, seed):
    # |x| < 1e-6: the exact backward reads Phi(x) as 1/2 + x phi(0) instead of out / x (0 / 0 at x = 0); x = 0
    # itself is among the values
    x = 1e-7 * np.random.default_rng(seed).standard_normal(shape)
    x.reshape(-1)[0] = 0.0
    assert np.abs(x).max() < 1e-6
    assert_grads(lambda x: ops.gelu_forward(x, approximate), ops.gelu_backward, dict(x=x), ("x",))
    dx = ops.gelu_backward(np.ones_like(x), ops.gelu_forward(x, approximate)[1])
    # GELU'(x) = Phi(x) + x phi(x) = 1/2 + 2 x phi(0) + O(x^3), for the tanh form too (tanh'(0) = 1)
    np.testing.assert_allclose(dx, 0.5 + x * math.sqrt(2 / math.pi), rtol=1e-12)
