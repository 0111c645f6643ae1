"""The optimizer: AdamW against torch.optim.AdamW (+ LambdaLR + clip_grad_norm_) step by step, the uncorrected form
against a transcription of google-research/bert's AdamWeightDecayOptimizer, convergence, the schedule, exact
resume, clipping, dtypes, and the error messages for bad input."""
import json
import math
import pickle
import re

import numpy as np
import pytest

import refbert
from refbert.check import model_batch, tiny_config
from refbert.optim import AdamW, GradScaler, LinearWarmupDecay, clip_grad_norm, linear_warmup_decay

# BERT-like names: two decayed weights, and biases / LayerNorm weights that the default no_decay exempts
SHAPES = {"bert.embeddings.word_embeddings.weight": (7, 5),
          "bert.embeddings.LayerNorm.weight": (5,),
          "bert.embeddings.LayerNorm.bias": (5,),
          "bert.encoder.layer.0.intermediate.dense.weight": (6, 5),
          "bert.encoder.layer.0.intermediate.dense.bias": (6,),
          "cls.predictions.bias": (7,)}
DECAYED = {"bert.embeddings.word_embeddings.weight", "bert.encoder.layer.0.intermediate.dense.weight"}


def make_params(rng, dtype=np.float64):
    return {k: rng.standard_normal(s).astype(dtype) for k, s in SHAPES.items()}


def make_grads(rng, params, norm=None):
    """Random gradients; with `norm`, rescaled to that global L2 norm (to land on either side of the clip)."""
    g = {k: rng.standard_normal(p.shape).astype(p.dtype) for k, p in params.items()}
    if norm is not None:
        now = math.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in g.values()))
        g = {k: (x * (norm / now)).astype(x.dtype) for k, x in g.items()}
    return g


def copy(d):
    return {k: v.copy() for k, v in d.items()}


def rel(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


# ----------------------------------------------------------------------------------------------------------------
# against torch

def test_matches_torch_adamw_lambdalr_and_clipping_for_50_steps():
    """Same random gradients, 50 steps, float64: torch.optim.AdamW with two param groups (decay / no decay),
    LambdaLR driven by our multiplier, clip_grad_norm_ at 1.0. Tolerance 1e-12 relative: both compute the same
    formula in float64 but with a few operations in another order (torch's first moment is m + (1-β1)(g - m), a
    lerp; its norm is a norm of per-tensor norms), so each step differs by a few ulps, and 50 steps of Adam,
    whose update divides by √v̂, could amplify that; measured worst: 4e-16, so 1e-12 is a bar with a wide margin
    that any real difference (ε placement, decay order, an off-by-one step) exceeds by orders of magnitude."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    P = make_params(rng)
    T = {k: torch.tensor(v.copy(), requires_grad=True) for k, v in P.items()}
    lr, wd, warmup, total = 1e-2, 0.1, 5, 45
    topt = torch.optim.AdamW([{"params": [T[k] for k in P if k in DECAYED], "weight_decay": wd},
                              {"params": [T[k] for k in P if k not in DECAYED], "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.999), eps=1e-6)
    tsched = torch.optim.lr_scheduler.LambdaLR(topt, lambda s: linear_warmup_decay(s, warmup, total))
    opt = AdamW(P, lr=lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=wd, correct_bias=True)
    sched = LinearWarmupDecay(lr, warmup, total)
    assert {k for k, d in opt.decay.items() if d} == DECAYED
    clipped = 0
    for step in range(50):
        g = make_grads(rng, P, norm=float(10 ** rng.uniform(-0.7, 0.7)))   # global norm 0.2 .. 5
        for k, t in T.items():
            t.grad = torch.tensor(g[k].copy())
        tnorm = torch.nn.utils.clip_grad_norm_(list(T.values()), 1.0)
        norm = clip_grad_norm(g, 1.0)
        clipped += norm > 1.0
        assert norm == pytest.approx(float(tnorm), rel=1e-14)
        for k in P:
            assert rel(g[k], T[k].grad.numpy()) <= 1e-14, (step, k)
        assert sched.lr(step) == topt.param_groups[0]["lr"] == topt.param_groups[1]["lr"]
        opt.step(g, lr=sched.lr(step))
        topt.step()
        tsched.step()
        for k in P:
            assert rel(P[k], T[k].detach().numpy()) <= 1e-12, (step, k)
    assert 10 <= clipped <= 40          # both branches of the clip were exercised
    assert opt.step_count == 50


def test_clip_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    P = make_params(rng)
    for dtype, tol in ((np.float64, 1e-14), (np.float32, 1e-6)):   # float32: torch sums in float32, we in float64
        for norm, max_norm in ((3.0, 1.0), (0.5, 1.0), (1.0 - 5e-7, 1.0), (40.0, 2.5)):
            g = {k: v.astype(dtype) for k, v in make_grads(rng, P, norm).items()}
            tg = [torch.tensor(v.copy()) for v in g.values()]
            ts = [torch.zeros(v.shape, dtype=tg[0].dtype, requires_grad=True) for v in g.values()]
            for t, x in zip(ts, tg):
                t.grad = x
            tnorm = float(torch.nn.utils.clip_grad_norm_(ts, max_norm))
            before = copy(g)
            out = clip_grad_norm(g, max_norm)
            assert isinstance(out, float) and out == pytest.approx(tnorm, rel=tol)
            for (k, x), t in zip(g.items(), ts):
                assert x.dtype == dtype
                assert rel(x, t.grad.numpy()) <= tol, (dtype, norm, k)
            if norm < max_norm - 1e-6:      # torch's coefficient is 1 exactly: gradients untouched, bit for bit
                assert all(np.array_equal(g[k], before[k]) for k in g)
            else:                           # scaled by max_norm / (norm + 1e-6), even just below max_norm
                coef = max_norm / (out + 1e-6)
                assert coef < 1
                assert all(np.allclose(g[k], before[k] * coef, rtol=4 * np.finfo(dtype).eps, atol=0) for k in g)


# ----------------------------------------------------------------------------------------------------------------
# the original BERT optimizer

def google_adam_weight_decay(p, m, v, grad, learning_rate, weight_decay_rate, beta_1, beta_2, epsilon, name):
    """google-research/bert optimization.py, AdamWeightDecayOptimizer.apply_gradients, one variable, transcribed
    from its formulas (and its _do_use_weight_decay with create_optimizer's exclude list)."""
    next_m = beta_1 * m + (1.0 - beta_1) * grad
    next_v = beta_2 * v + (1.0 - beta_2) * np.square(grad)
    update = next_m / (np.sqrt(next_v) + epsilon)
    use_decay = bool(weight_decay_rate) and not any(
        re.search(r, name) is not None for r in ["LayerNorm", "layer_norm", "bias"])
    if use_decay:
        update = update + weight_decay_rate * p
    update_with_lr = learning_rate * update
    return p - update_with_lr, next_m, next_v


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_uncorrected_form_is_googles_formula(dtype):
    """correct_bias=False against the transcription, 30 steps of google's warmup + decay schedule. Bit-exact: the
    same operations in the same order, each rounded once in the parameter's dtype (google's variables are float32,
    so the float32 case is the original's own arithmetic)."""
    rng = np.random.default_rng(2)
    P = make_params(rng, dtype)
    ref = {k: (v.copy(), np.zeros_like(v), np.zeros_like(v)) for k, v in P.items()}
    opt = AdamW(P, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, correct_bias=False)
    sched = LinearWarmupDecay(1e-2, 4, 30)
    for step in range(30):
        g = make_grads(rng, P)
        lr = sched.lr(step)
        ref = {k: google_adam_weight_decay(*ref[k], g[k], lr, 0.01, 0.9, 0.999, 1e-6, k) for k in P}
        opt.step(g, lr=lr)
        for k in P:
            assert P[k].dtype == dtype
            np.testing.assert_array_equal(P[k], ref[k][0], err_msg=f"step {step}, {k}")
            np.testing.assert_array_equal(opt.m[k], ref[k][1])
            np.testing.assert_array_equal(opt.v[k], ref[k][2])


def test_uncorrected_step_is_documented_multiple_of_corrected():
    """The docstring's claim: without ε and decay, google's step is (1 - β1^t)/√(1 - β2^t) times torch's
    (3.16 at t = 1, 6.57 at t = 12 for the default betas). ε = 1e-30 makes it negligible; tolerance 1e-10 for the
    cancellation in p_new - p_old (steps ~1e-3 on parameters ~1 leave ~1e-13 of relative precision)."""
    rng = np.random.default_rng(3)
    P0 = make_params(rng)
    Pa, Pb = copy(P0), copy(P0)
    a = AdamW(Pa, lr=1e-3, eps=1e-30, weight_decay=0.0, correct_bias=False)
    b = AdamW(Pb, lr=1e-3, eps=1e-30, weight_decay=0.0, correct_bias=True)
    for t in range(1, 13):
        before_a, before_b = copy(Pa), copy(Pb)
        g = make_grads(rng, P0)
        a.step(g)
        b.step(g)
        factor = (1 - 0.9 ** t) / math.sqrt(1 - 0.999 ** t)
        for k in P0:
            assert rel(Pa[k] - before_a[k], (Pb[k] - before_b[k]) * factor) <= 1e-10
    assert factor == pytest.approx(6.5685, abs=1e-4)


def test_decoupled_decay_applies_exactly_to_the_decayed_names():
    """With zero gradients the Adam term is 0/(0 + ε) = 0, so one step is the decay alone: decayed names are
    multiplied by 1 - lr·λ, exempt names (any no_decay substring) are untouched, in both forms."""
    for correct_bias in (True, False):
        P = make_params(np.random.default_rng(4))
        before = copy(P)
        opt = AdamW(P, lr=0.5, weight_decay=0.1, correct_bias=correct_bias)
        opt.step({k: np.zeros_like(v) for k, v in P.items()})
        for k in P:
            if k in DECAYED:
                np.testing.assert_allclose(P[k], before[k] * (1 - 0.5 * 0.1), rtol=1e-15, atol=0)
            else:
                np.testing.assert_array_equal(P[k], before[k])
    opt = AdamW(make_params(np.random.default_rng(4)), no_decay=("word_embeddings",))
    assert {k for k, d in opt.decay.items() if not d} == {"bert.embeddings.word_embeddings.weight"}
    P = make_params(np.random.default_rng(4))
    before = copy(P)
    AdamW(P, lr=0.5, weight_decay=0.0).step({k: np.zeros_like(v) for k, v in P.items()})
    assert all(np.array_equal(P[k], before[k]) for k in P)


# ----------------------------------------------------------------------------------------------------------------
# convergence

@pytest.mark.parametrize("correct_bias", [True, False])
def test_converges_on_ill_conditioned_quadratic(correct_bias):
    """f(x) = ½ (x - x*)ᵀ A (x - x*), A = Q diag(1 .. 100) Qᵀ with a random rotation Q (condition number 100 and
    not axis-aligned, so Adam's per-coordinate scaling does not solve it for free); minimum 0 at x*. The whole
    recipe: clip at 1, warmup then linear decay of lr = 0.1 over 2000 steps, no weight decay (decay would move the
    minimum). f falls from ~54 to below 1e-12 (measured: x lands on x* to the last bit in both forms); x is
    within 1e-5 of x*."""
    rng = np.random.default_rng(5)
    n = 8
    Q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    A = Q @ np.diag(np.logspace(0, 2, n)) @ Q.T
    x_star = rng.standard_normal(n)
    f = lambda x: 0.5 * (x - x_star) @ A @ (x - x_star)  # noqa: E731
    x = np.zeros(n)
    opt = AdamW({"x": x}, lr=0.1, weight_decay=0.0, correct_bias=correct_bias)
    sched = LinearWarmupDecay(0.1, 100, 2000)
    f0 = f(x)
    for step in range(2000):
        g = {"x": A @ (x - x_star)}
        clip_grad_norm(g, 1.0)
        opt.step(g, lr=sched.lr(step))
    assert f0 > 10
    assert f(x) <= 1e-12
    assert np.max(np.abs(x - x_star)) <= 1e-5


# ----------------------------------------------------------------------------------------------------------------
# schedule

def test_schedule_values_from_the_formula():
    w, T = 10, 100
    cases = {0: 0.0, 1: 0.1, 5: 0.5, 9: 0.9,        # warmup: step / w, step 0 has lr 0
             10: 0.9, 11: 0.89, 50: 0.5, 99: 0.01,  # after: 1 - step / T (google's, from step 0: 0.9 at w)
             100: 0.0, 150: 0.0}                    # floored at 0
    for step, want in cases.items():
        assert linear_warmup_decay(step, w, T) == pytest.approx(want, abs=1e-15), step
        assert LinearWarmupDecay(3e-4, w, T).lr(step) == pytest.approx(3e-4 * want, abs=1e-19), step
    assert linear_warmup_decay(0, 0, 10) == 1.0           # no warmup: full lr at once
    assert linear_warmup_decay(np.int64(5), 0, 10) == 0.5  # numpy integers are steps too
    assert linear_warmup_decay(4, 4, 4) == 0.0


# ----------------------------------------------------------------------------------------------------------------
# exact resume

@pytest.mark.parametrize("correct_bias", [True, False])
def test_state_dict_round_trip_continues_bit_exactly(correct_bias):
    rng = np.random.default_rng(6)
    P = make_params(rng)
    grads = [make_grads(rng, P) for _ in range(15)]
    sched = LinearWarmupDecay(1e-2, 3, 15)
    opt = AdamW(P, lr=1e-2, weight_decay=0.05, eps=1e-7, betas=(0.8, 0.99), correct_bias=correct_bias)
    for s in range(7):
        opt.step(copy(grads[s]), lr=sched.lr(s))
    state, saved = opt.state_dict(), copy(P)
    state = pickle.loads(pickle.dumps(state))   # a plain dict: it survives serialisation, and its non-array part
    scalars = json.loads(json.dumps({k: v for k, v in state.items() if k not in ("m", "v")}))   # JSON too
    state = dict(scalars, m=state["m"], v=state["v"])                                          # (tuples -> lists)
    frozen = pickle.loads(pickle.dumps(state))
    for s in range(7, 15):
        opt.step(copy(grads[s]), lr=sched.lr(s))
    # state_dict() handed out copies: the steps above did not reach into it
    assert all(np.array_equal(state[w][k], frozen[w][k]) for w in ("m", "v") for k in P)

    P2 = copy(saved)
    opt2 = AdamW(P2, lr=1.0, weight_decay=0.0, correct_bias=not correct_bias)   # hyperparameters come from state
    opt2.load_state_dict(state)
    assert (opt2.step_count, opt2.lr, opt2.betas, opt2.eps, opt2.weight_decay, opt2.correct_bias) == \
           (7, 1e-2, (0.8, 0.99), 1e-7, 0.05, correct_bias)
    for s in range(7, 15):
        opt2.step(copy(grads[s]), lr=sched.lr(s))
    for k in P:
        np.testing.assert_array_equal(P2[k], P[k])
        np.testing.assert_array_equal(opt2.m[k], opt.m[k])
        np.testing.assert_array_equal(opt2.v[k], opt.v[k])
    assert opt2.step_count == opt.step_count == 15


def test_load_state_dict_rejects_mismatch_and_changes_nothing():
    P = make_params(np.random.default_rng(7))
    opt = AdamW(P)
    good = opt.state_dict()
    bad = dict(good, m={**good["m"], "cls.predictions.bias": np.zeros(8)})
    with pytest.raises(ValueError, match=r"'state\['m'\]' key 'cls.predictions.bias' expected an array of shape"):
        opt.load_state_dict(bad)
    with pytest.raises(ValueError, match=r"'state\['v'\]' expected exactly the parameters' keys"):
        opt.load_state_dict(dict(good, v={}))
    with pytest.raises(ValueError, match=r"'eps'"):
        opt.load_state_dict(dict(good, eps=-1.0, step_count=3))
    with pytest.raises(ValueError, match=r"'state\['step_count'\]'"):
        opt.load_state_dict(dict(good, step_count=-1))
    with pytest.raises(ValueError, match=r"'state' expected a dict with keys"):
        opt.load_state_dict({"m": good["m"]})
    assert opt.step_count == 0 and opt.eps == 1e-6


def test_load_state_dict_refuses_negative_second_moment():
    """v is a running mean of squared gradients, so it is never negative; a negative entry would give sqrt(v) = NaN
    at the next step. load_state_dict refuses it by name and changes nothing (m may be negative: it is a mean of
    gradients)."""
    P = make_params(np.random.default_rng(7))
    opt = AdamW(P)
    opt.step(make_grads(np.random.default_rng(8), P))
    good = opt.state_dict()
    before = copy(opt.v)
    v = copy(good["v"])
    v["cls.predictions.bias"][2] = -1e-12
    with pytest.raises(ValueError, match=r"AdamW.load_state_dict: argument 'state\['v'\]' key 'cls.predictions.bias' "
                                         r"expected finite values, all >= 0, got others"):
        opt.load_state_dict(dict(good, v=v, step_count=5))
    assert opt.step_count == 1 and all(np.array_equal(opt.v[k], before[k]) for k in P)
    m = copy(good["m"])
    m["cls.predictions.bias"][2] = -1.0
    opt.load_state_dict(dict(good, m=m))
    assert opt.m["cls.predictions.bias"][2] == -1.0


# ----------------------------------------------------------------------------------------------------------------
# dtypes and the model

def test_float32_model_updates_in_place_and_stays_float32():
    cfg = tiny_config("BertForSequenceClassification")
    model = refbert.BertForSequenceClassification(cfg, seed=0, dtype=np.float32)
    params = model.parameters()
    ids = {k: id(v) for k, v in params.items()}
    before = copy(params)
    opt = AdamW(params, lr=1e-3, weight_decay=0.01)
    assert not opt.decay["bert.embeddings.LayerNorm.weight"] and not opt.decay["classifier.bias"]
    assert opt.decay["classifier.weight"]
    for _ in range(2):
        model(**model_batch(cfg, "BertForSequenceClassification"))
        grads = model.backward()
        clip_grad_norm(grads, 1.0)
        opt.step(grads)
    after = model.parameters()
    assert {k: id(v) for k, v in after.items()} == ids           # the same arrays, changed in place
    for k, p in after.items():
        assert p.dtype == np.float32 and opt.m[k].dtype == np.float32 and opt.v[k].dtype == np.float32
        assert np.isfinite(p).all()
    changed = [k for k in after if not np.array_equal(after[k], before[k])]
    assert len(changed) >= len(after) - 1   # every tensor moves (the padding row aside, all get gradient)


def test_nan_gradient_is_refused_before_anything_is_written():
    P = make_params(np.random.default_rng(8), np.float32)
    opt = AdamW(P)
    opt.step(make_grads(np.random.default_rng(9), P))
    before, state = copy(P), opt.state_dict()
    g = make_grads(np.random.default_rng(10), P)
    g["cls.predictions.bias"][3] = np.nan
    with pytest.raises(ValueError, match=r"AdamW.step: argument 'grads' key 'cls.predictions.bias' expected "
                                         r"finite values, got nan at index \(3,\)"):
        opt.step(g)
    g["cls.predictions.bias"][3] = np.inf
    with pytest.raises(ValueError, match="cls.predictions.bias"):
        opt.step(g)
    g["cls.predictions.bias"][3] = 1e30                         # finite, but its square overflows float32
    with pytest.raises(ValueError, match="cls.predictions.bias.*square"):
        opt.step(g)
    assert all(np.array_equal(P[k], before[k]) for k in P)       # the model is untouched...
    assert opt.step_count == 1                                    # ...and so is the optimizer
    assert all(np.array_equal(opt.m[k], state["m"][k]) and np.array_equal(opt.v[k], state["v"][k]) for k in P)


# ----------------------------------------------------------------------------------------------------------------
# bad input

def _P():
    return make_params(np.random.default_rng(11))


def _step(mutate, lr=None):
    P = _P()
    g = make_grads(np.random.default_rng(12), P)
    mutate(g)
    AdamW(P).step(g, lr=lr)


def _readonly():
    P = _P()
    P["cls.predictions.bias"].flags.writeable = False
    return AdamW(P)


BAD = [
    (lambda: AdamW(_P(), lr=-1e-3), r"AdamW: argument 'lr' expected a finite number in \[0.0, inf\), got -0.001"),
    (lambda: AdamW(_P(), lr=float("nan")), r"argument 'lr'"),
    (lambda: AdamW(_P(), lr="1e-3"), r"argument 'lr'"),
    (lambda: AdamW(_P(), betas=(1.0, 0.999)), r"argument 'betas\[0\]' expected a finite number in \[0.0, 1.0\)"),
    (lambda: AdamW(_P(), betas=(0.9, -0.1)), r"argument 'betas\[1\]'"),
    # beta2 = 1 would make the bias correction sqrt(1 - beta2^t) zero (v never moves from 0): open at 1, as beta1
    (lambda: AdamW(_P(), betas=(0.9, 1.0)), r"argument 'betas\[1\]' expected a finite number in \[0.0, 1.0\), got 1.0"),
    (lambda: AdamW(_P(), betas=(0.9,)), r"argument 'betas' expected a pair"),
    (lambda: AdamW(_P(), eps=0.0), r"argument 'eps' expected a finite number in \(0.0, inf\)"),
    (lambda: AdamW(_P(), weight_decay=-0.01), r"argument 'weight_decay'"),
    (lambda: AdamW(_P(), correct_bias="yes"), r"argument 'correct_bias'"),
    (lambda: AdamW(_P(), no_decay="bias"), r"argument 'no_decay' expected a tuple"),
    (lambda: AdamW({}), r"argument 'params' expected a non-empty dict"),
    (lambda: AdamW({"w": np.zeros(3, np.int64)}), r"argument 'params' key 'w' expected a float32 or float64"),
    (lambda: AdamW({"a": (x := np.zeros(3)), "b": x}), r"argument 'params' key 'b' expected its own array"),
    (_readonly, r"argument 'params' key 'cls.predictions.bias' expected a writeable array"),
    (lambda: _step(lambda g: g.pop("cls.predictions.bias")),
     r"AdamW.step: argument 'grads' expected exactly the parameters' keys, got 1 missing \['cls.predictions.bias'\]"),
    (lambda: _step(lambda g: g.update(extra=np.zeros(2))), r"argument 'grads' .* 1 unexpected \['extra'\]"),
    (lambda: _step(lambda g: g.update({"cls.predictions.bias": np.zeros(8)})),
     r"argument 'grads' key 'cls.predictions.bias' expected an array of shape \(7,\) and dtype float64"),
    (lambda: _step(lambda g: g.update({"cls.predictions.bias": np.zeros(7, np.float32)})),
     r"argument 'grads' key 'cls.predictions.bias' expected .* dtype float64 .* "
     r"got array of shape \(7,\) and dtype float32"),
    (lambda: _step(lambda g: None, lr=-1.0), r"AdamW.step: argument 'lr'"),
    (lambda: linear_warmup_decay(-1, 0, 10), r"linear_warmup_decay: argument 'step' expected an integer >= 0"),
    (lambda: linear_warmup_decay(1.5, 0, 10), r"argument 'step' expected an integer"),
    (lambda: linear_warmup_decay(0, -1, 10), r"argument 'warmup_steps'"),
    (lambda: linear_warmup_decay(0, 0, 0), r"argument 'total_steps' expected an integer >= 1"),
    (lambda: linear_warmup_decay(0, 11, 10), r"argument 'warmup_steps' expected at most total_steps = 10, got 11"),
    (lambda: LinearWarmupDecay(-1.0, 0, 10), r"LinearWarmupDecay: argument 'base_lr'"),
    (lambda: LinearWarmupDecay(1e-4, 20, 10), r"LinearWarmupDecay: argument 'warmup_steps'"),
    (lambda: clip_grad_norm({"a": np.ones(3)}, 0.0), r"clip_grad_norm: argument 'max_norm'"),
    (lambda: clip_grad_norm([np.ones(3)]), r"clip_grad_norm: argument 'grads' expected a dict"),
    (lambda: clip_grad_norm({"a": np.array([1.0, np.inf])}), r"argument 'grads' key 'a' expected finite values"),
    (lambda: clip_grad_norm({"a": np.arange(3)}), r"argument 'grads' key 'a' expected a float32 or float64"),
    # what used to pass silently or leave a half-done dict: views of one array updated twice, a read-only gradient
    # met after the earlier keys were scaled, a float32 scale that overflows to inf
    (lambda: AdamW({"a": (x := np.zeros(5)), "b": x[:2]}),
     r"AdamW: argument 'params' key 'a' expected its own memory, got an array that overlaps key 'b''s"),
    (lambda: AdamW({"a": (x := np.zeros(12))[::2], "b": x[1::2], "c": x[2:3]}),     # (a, b interleaved: disjoint)
     r"AdamW: argument 'params' key 'c' expected its own memory, got an array that overlaps key 'a''s"),
    (lambda: clip_grad_norm({"a": np.ones(3), "b": _frozen(np.ones(3))}, 0.1),
     r"clip_grad_norm: argument 'grads' key 'b' expected a writeable array \(it is scaled in place\)"),
    (lambda: GradScaler().unscale_({"a": np.ones(3), "b": _frozen(np.ones(3))}),
     r"GradScaler.unscale_: argument 'grads' key 'b' expected a writeable array"),
    (lambda: GradScaler(init_scale=1e39), r"GradScaler: argument 'init_scale' expected a scale finite in float32"),
]


def _frozen(a):
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("call, message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_input_raises_value_error_naming_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_clip_refuses_nan_before_scaling_anything():
    g = {"a": np.full(3, 10.0), "b": np.array([1.0, np.nan])}
    with pytest.raises(ValueError, match="key 'b'"):
        clip_grad_norm(g)
    np.testing.assert_array_equal(g["a"], np.full(3, 10.0))


def test_default_no_decay_exempts_the_same_tensors_as_google_on_every_head():
    """Our rule (a no_decay substring in the name) against google's (re.search of "LayerNorm", "layer_norm", "bias")
    on every parameter name of every model class."""
    from refbert.config import HEADS
    for head in HEADS:
        P = getattr(refbert, head)(tiny_config(head), dtype=np.float64).parameters()
        ours = AdamW(P).decay
        google = {k: not any(re.search(r, k) for r in ["LayerNorm", "layer_norm", "bias"]) for k in P}
        assert ours == google, head
        assert any(ours.values()) and not all(ours.values())


# ----------------------------------------------------------------------------------------------------------------
# the loss scaler at float32's top

def test_grad_scaler_keeps_its_scale_when_growth_would_overflow(torch):
    """torch's _amp_update_scale_ grows the scale only when scale * growth_factor is finite in float32, and resets
    the growth tracker either way: from 2**126 a growth step reaches 2**127, float32's largest power of two; the
    next one (2**128 = inf in float32) leaves it there. Compared with torch.amp.GradScaler("cpu") after each step,
    and with those powers of two (exact in float32, so ==)."""
    kw = dict(init_scale=2.0 ** 126, growth_factor=2.0, backoff_factor=0.5, growth_interval=1)
    ts, ours = torch.amp.GradScaler("cpu", **kw), GradScaler(**kw)
    tp = torch.nn.Parameter(torch.zeros(3))
    topt = torch.optim.SGD([tp], lr=0.0)
    for expected in (2.0 ** 127, 2.0 ** 127, 2.0 ** 127):
        ts.scale(torch.ones(()))                         # (torch creates its scale tensor lazily here)
        tp.grad = torch.ones(3)
        ts.unscale_(topt)
        ts.update()
        assert ours.unscale_({"w": np.ones(3, np.float32)}) is False
        ours.update()
        assert ours.get_scale() == expected == ts.get_scale()
        assert ours.state_dict() == ts.state_dict() and ours.state_dict()["_growth_tracker"] == 0


# ----------------------------------------------------------------------------------------------------------------
# another array library's arrays (the "cuda" backend's CuPy arrays), through a NumPy-backed stand-in

class DevArray(np.lib.mixins.NDArrayOperatorsMixin):
    """A stand-in for a CuPy array, NumPy inside: NumPy's functions reach it through __array_ufunc__ /
    __array_function__ and answer with DevArrays (reductions with 0-d ones, as CuPy's), it has the CUDA array
    interface and .get(), no `flags.writeable`, and refuses to become a NumPy array implicitly (np.asarray raises,
    as for CuPy), so any host round trip the optimizer forgot shows up here."""

    def __init__(self, a):
        self._a = np.asarray(a)

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    __cuda_array_interface__ = property(lambda self: {"shape": self.shape, "typestr": self.dtype.str,
                                                      "data": self._a.__array_interface__["data"],
                                                      "strides": self._a.__array_interface__["strides"],
                                                      "version": 3})       # (its memory's address, as CuPy's)

    def __array__(self, *args, **kwargs):
        raise TypeError("DevArray: implicit conversion to a NumPy array is not allowed (use .get())")

    def __array_namespace__(self):
        return _DEV

    def get(self):
        return self._a.copy()

    def copy(self):
        return DevArray(self._a.copy())

    def astype(self, dtype):
        return DevArray(self._a.astype(dtype))

    def any(self):
        return DevArray(self._a.any())

    def all(self):
        return DevArray(self._a.all())

    def __getitem__(self, i):
        return _wrap(self._a[_unwrap(i)])

    def __iter__(self):
        return (DevArray(x) for x in self._a)

    def __len__(self):
        return len(self._a)

    def __bool__(self):
        return bool(self._a)

    def __float__(self):
        return float(self._a)

    def __int__(self):
        return int(self._a)

    def __index__(self):
        return self._a.__index__()

    def __format__(self, spec):
        return format(self._a, spec)

    def __repr__(self):
        return f"DevArray({self._a!r})"

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kw):
        if out is not None:
            kw["out"] = tuple(_unwrap(o) for o in out)
        r = getattr(ufunc, method)(*_unwrap(inputs), **kw)
        return (out[0] if len(out) == 1 else out) if out is not None else _wrap(r)

    def __array_function__(self, func, types, args, kwargs):
        return _wrap(func(*_unwrap(args), **_unwrap(kwargs)))


def _unwrap(x):
    if isinstance(x, DevArray):
        return x._a
    if isinstance(x, (tuple, list)):
        return type(x)(_unwrap(v) for v in x)
    if isinstance(x, dict):
        return {k: _unwrap(v) for k, v in x.items()}
    return x


def _wrap(x):
    if isinstance(x, (np.ndarray, np.generic)):
        return DevArray(x)
    if isinstance(x, tuple):
        return tuple(_wrap(v) for v in x)
    return x


class _DevNamespace:
    @staticmethod
    def array(a, copy=True):
        return DevArray(np.array(a.get() if isinstance(a, DevArray) else a, copy=copy))


_DEV = _DevNamespace()


def dev(d):
    return {k: DevArray(v.copy()) for k, v in d.items()}


def host(d):
    return {k: v.get() for k, v in d.items()}


@pytest.mark.parametrize("correct_bias", [True, False])
def test_device_arrays_step_clip_and_resume_exactly_as_numpy(correct_bias):
    """AdamW and clip_grad_norm on a device library's arrays (the stand-in: NumPy's arithmetic by dispatch) give
    NumPy's results bit for bit, updating the device arrays in place; state_dict() hands out NumPy copies and
    load_state_dict() puts them back on the device."""
    rng = np.random.default_rng(13)
    P = make_params(rng, np.float32)
    grads = [make_grads(rng, P, norm=n) for n in (0.5, 3.0, 0.2, 8.0, 1.0, 0.7)]
    D = dev(P)
    ids = {k: id(v) for k, v in D.items()}
    kw = dict(lr=1e-2, weight_decay=0.05, correct_bias=correct_bias)
    opt, dopt = AdamW(P, **kw), AdamW(D, **kw)
    assert all(isinstance(a, DevArray) for a in (*dopt.m.values(), *dopt.v.values()))
    for s in range(3):
        g, dg = copy(grads[s]), dev(grads[s])
        assert clip_grad_norm(dg, 1.0) == clip_grad_norm(g, 1.0)
        for k in g:
            np.testing.assert_array_equal(dg[k].get(), g[k])
        opt.step(g, lr=1e-2 * (s + 1) / 3)
        dopt.step(dg, lr=1e-2 * (s + 1) / 3)
    assert {k: id(v) for k, v in D.items()} == ids                 # the same device arrays, changed in place
    for k in P:
        np.testing.assert_array_equal(D[k].get(), P[k])
    state = dopt.state_dict()
    assert all(type(a) is np.ndarray for w in ("m", "v") for a in state[w].values())
    for w in ("m", "v"):
        for k in P:
            np.testing.assert_array_equal(state[w][k], opt.state_dict()[w][k])
    D2 = dev(P)
    dopt2 = AdamW(D2, lr=1.0, correct_bias=not correct_bias)
    dopt2.load_state_dict(state)                                   # NumPy moments in, device moments kept
    assert all(isinstance(a, DevArray) for a in (*dopt2.m.values(), *dopt2.v.values()))
    for s in range(3, 6):
        g, dg = copy(grads[s]), dev(grads[s])
        clip_grad_norm(g, 1.0)
        clip_grad_norm(dg, 1.0)
        opt.step(g, lr=1e-2)
        dopt2.step(dg, lr=1e-2)
    for k in P:
        np.testing.assert_array_equal(D2[k].get(), P[k])
        np.testing.assert_array_equal(dopt2.m[k].get(), opt.m[k])
        np.testing.assert_array_equal(dopt2.v[k].get(), opt.v[k])


def test_device_arrays_keep_the_checks_and_messages():
    D = dev(make_params(np.random.default_rng(14), np.float32))
    opt = AdamW(D)
    opt.step(dev(make_grads(np.random.default_rng(15), D)))
    before, state = host(D), opt.state_dict()
    g = make_grads(np.random.default_rng(16), D)
    g["cls.predictions.bias"][3] = np.nan
    with pytest.raises(ValueError, match=r"AdamW.step: argument 'grads' key 'cls.predictions.bias' expected "
                                         r"finite values, got nan at index \(3,\)"):
        opt.step(dev(g))
    g["cls.predictions.bias"][3] = 1e30
    with pytest.raises(ValueError, match="cls.predictions.bias.*square"):
        opt.step(dev(g))
    g["cls.predictions.bias"][3] = 0.5
    with pytest.raises(ValueError, match=r"key 'cls.predictions.bias' expected an array of shape \(7,\) and dtype "
                                         r"float32 \(the parameter's, a \w+ array\), got array of shape"):
        opt.step({**dev(g), "cls.predictions.bias": g["cls.predictions.bias"]})     # a host array for a device one
    assert all(np.array_equal(D[k].get(), before[k]) for k in D) and opt.step_count == 1
    assert all(np.array_equal(opt.m[k].get(), state["m"][k]) for k in D)
    with pytest.raises(ValueError, match=r"clip_grad_norm: argument 'grads' key 'b' expected finite values, got inf"):
        clip_grad_norm({"a": DevArray(np.ones(3)), "b": DevArray(np.array([1.0, np.inf]))})
    with pytest.raises(ValueError, match=r"argument 'grads' key 'a' expected a float32 or float64 numpy array, got "
                                         r"\w+ array of shape \(3,\) and dtype int64"):
        clip_grad_norm({"a": DevArray(np.arange(3))})
    bad = dict(state, m={**state["m"], "cls.predictions.bias": np.zeros(8, np.float32)})
    with pytest.raises(ValueError, match=r"'state\['m'\]' key 'cls.predictions.bias' expected an array of shape"):
        opt.load_state_dict(bad)
