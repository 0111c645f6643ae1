"""The checker itself: it must measure true gradients and must catch wrong ones (a check that cannot fail is none)."""
import numpy as np
import pytest

from refbert import ops
from refbert.gradcheck import TOLERANCE, check_pair, numerical_gradient, rel_error


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
