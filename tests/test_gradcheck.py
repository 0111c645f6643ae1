"""The checker itself: it must measure true gradients and must catch wrong ones (a check that cannot fail is none)."""
import types

import numpy as np
import pytest

from refbert import ops
from refbert.gradcheck import TOLERANCE, check_model, check_pair, numerical_gradient, rel_error


def test_numerical_gradient_of_known_function():
    x = np.array([[0.3, -1.2], [2.0, 5.0]])
    g = numerical_gradient(lambda v: float(np.sum(v ** 3)), x)
    # d/dx sum x^3 = 3x^2; centred differences are exact for cubics up to h^2 * f''' / 6 = 1e-10 and rounding
    np.testing.assert_allclose(g, 3 * x ** 2, rtol=1e-8, atol=1e-9)


def test_rel_error_definition():
    assert rel_error(np.zeros(3), np.zeros(3)) == 0.0
    assert rel_error(np.array([1.0, 0.0]), np.array([1.0, 1e-3])) == pytest.approx(1e-3 / 2)  # max|a-b| / (max|a| + max|b|)
    with pytest.raises(ValueError, match="'a' and 'b'"):
        rel_error(np.zeros(2), np.zeros(3))


@pytest.mark.parametrize("mode", ["full", "directional"])
def test_check_pair_catches_a_wrong_backward(mode):
    rng = np.random.default_rng(0)
    x, w, b = rng.standard_normal((3, 4)), rng.standard_normal(4), rng.standard_normal(4)

    def off_by_a_little(dout, cache):  # dx wrong by 0.1% — far above FD noise, far below "obviously broken"
        dx, dw, db = ops.layernorm_backward(dout, cache)
        return dx * 1.001, dw, db

    errs = check_pair(ops.layernorm_forward, off_by_a_little, dict(x=x, w=w, b=b), ("x", "w", "b"), mode=mode)
    assert errs["x"] > 1e-4 and errs["w"] <= TOLERANCE and errs["b"] <= TOLERANCE


def test_check_pair_rejects_wrong_arity():
    x = np.ones((2, 2))
    with pytest.raises(ValueError, match="returned 1 gradient"):
        check_pair(ops.tanh_forward, ops.tanh_backward, dict(x=x), ("x", "y"))


def _steps_from(x0, c):
    """An affine op about x0: out = c * (x - x0), with c a power of two per element. Near x0 (~1e4), x - x0 is exact
    (Sterbenz) and so is c times it: the only rounding left is the step itself, which the module divides by the step
    actually taken. Its exact gradient is c * dout."""
    return (lambda x: (c * (x - x0), None)), (lambda dout, cache: c * dout)


def test_inputs_around_1e4_lose_nothing_to_rounding():
    """The docstring's promise: the denominators are the steps actually taken, so inputs of magnitude 1e4 lose
    nothing to rounding of x + h. On an affine loss the centred difference is then exact, error <= 1e-9; dividing by
    2h instead is off by the rounding of x + h, up to ulp(1e4) / 2h ~ 1e-7 relative."""
    rng = np.random.default_rng(1)
    x0 = 1e4 + rng.random(12)
    c = 2.0 ** rng.integers(-2, 3, 12)
    g = numerical_gradient(lambda v: float(np.sum(c * (v - x0))), x0)
    assert rel_error(g, c) <= 1e-9
    forward, backward = _steps_from(x0.reshape(3, 4), c.reshape(3, 4))
    errs = check_pair(forward, backward, dict(x=x0.reshape(3, 4)), ("x",), mode="directional")
    assert errs["x"] <= 1e-9, errs


class _AffineHead:
    """A stand-in head for check_model: loss = sum(c * (w - w0)), parameters() -> {"w": w}, backward -> {"w": g}."""
    _finish = None                                    # a head: check_model differentiates its loss

    def __init__(self, w0, c, g):
        self.w, self.w0, self.c, self.g = w0.copy(), w0, c, g
        self.config = types.SimpleNamespace(pad_token_id=None)

    def parameters(self):
        return {"w": self.w}

    def forward(self):
        return types.SimpleNamespace(loss=float(np.sum(self.c * (self.w - self.w0))))

    def backward(self):
        return {"w": self.g}


def test_check_model_parameters_around_1e4_and_a_wrong_gradient():
    """check_model on parameters around 1e4 with an affine loss and its exact gradient: error <= 1e-9 (the steps
    actually taken, as check_pair). A gradient off by 0.1%: |a - n| = 1e-3 |<g, d>| against max(|a| + |n|, |g|); in
    any of the 8 directions where |<g, d>| >= |g| / 2 that is 1e-3 / 2.001 ~ 5e-4, far above 1e-4."""
    rng = np.random.default_rng(2)
    w0, c = 1e4 + rng.random(10), 2.0 ** rng.integers(-2, 3, 10)
    assert check_model(_AffineHead(w0, c, c), {})["w"] <= 1e-9
    w0 = rng.standard_normal(10)
    assert check_model(_AffineHead(w0, c, 1.001 * c), {}, n_dirs=8)["w"] > 1e-4


def test_check_pair_casts_float32_inputs_to_float64():
    """Float inputs are cast to float64: tanh on float32 x in [-3, 3] checks to TOLERANCE. Kept in float32, the
    cached tanh carries ~6e-8 relative error, which 1 - tanh^2 (~0.01 at |x| = 3) magnifies ~100-fold."""
    x = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    errs = check_pair(ops.tanh_forward, ops.tanh_backward, dict(x=x), ("x",))
    assert errs["x"] <= TOLERANCE, errs


def test_check_pair_rejects_extra_gradients_and_wrong_shapes():
    """More gradients than `wrt` names fail with the count; a transposed gradient of a 2 x 3 input (right size,
    wrong shape) fails naming the expected shape; rel_error of two empty arrays is 0."""
    x = np.linspace(-1, 1, 6).reshape(2, 3)
    with pytest.raises(ValueError, match="returned 2 gradient"):
        check_pair(ops.tanh_forward, lambda d, c: (ops.tanh_backward(d, c),) * 2, dict(x=x), ("x",))
    with pytest.raises(ValueError, match=r"expected shape \(2, 3\), got \(3, 2\)"):
        check_pair(ops.tanh_forward, lambda d, c: ops.tanh_backward(d, c).T, dict(x=x), ("x",))
    assert rel_error(np.zeros((0, 3)), np.zeros((0, 3))) == 0.0


def test_directional_checks_take_n_dirs_directions():
    """The docstrings' "n_dirs random directions", counted: check_pair in directional mode evaluates the loss at
    x +- h d for each of n_dirs directions after the one forward that makes the cache (1 + 2 n_dirs calls);
    check_model perturbs every parameter along n_dirs directions after the one loss it differentiates
    (1 + 2 n_dirs n_params forwards)."""
    calls = []

    def forward(x):
        calls.append(1)
        return ops.tanh_forward(x)
    x = np.linspace(-1, 1, 12).reshape(3, 4)
    for n in (1, 5):
        calls.clear()
        check_pair(forward, ops.tanh_backward, dict(x=x), ("x",), mode="directional", n_dirs=n)
        assert len(calls) == 1 + 2 * n, (n, len(calls))

    class Counted(_AffineHead):
        def forward(self):
            calls.append(1)
            return super().forward()
    w0, c = np.arange(6.0), np.ones(6)
    for n in (1, 3):
        calls.clear()
        check_model(Counted(w0, c, c), {}, n_dirs=n)
        assert len(calls) == 1 + 2 * n, (n, len(calls))
