"""The float32 approximations of refbert_kernels._math measured in ulps over dense grids of the float32 range,
against float64 references (math.*, scipy.special), and their float64 dispatch (which must be libm itself)."""
import math

import numpy as np
import pytest

pytest.importorskip("numba")
pytest.importorskip("scipy.special")       # the float64 references of erf, erfc, ndtr, expit
from numba import njit  # noqa: E402
from scipy.special import erf, erfc, expit, ndtr  # noqa: E402

from refbert_kernels import _math as M  # noqa: E402


def _loop(fn):
    @njit
    def run(x):
        out = np.empty_like(x)
        for i in range(x.size):
            out[i] = fn(x[i])
        return out
    return run


_RUN = {name: _loop(getattr(M, name)) for name in ("exp", "erf", "erfc", "ndtr", "sigmoid")}


def _loop2(fn):
    @njit
    def run(x):
        a, b = np.empty_like(x), np.empty_like(x)
        for i in range(x.size):
            a[i], b[i] = fn(x[i])
        return a, b
    return run


_EXP_F32 = _loop(M.exp_f32)
_SIGMOID_F32 = _loop(M.sigmoid_f32)
_PHI_F32 = _loop2(M.phi_parts_f32)


def _grid(lo, hi, n=2_000_000):
    """n evenly spaced float32 points in [lo, hi] plus +-geometric points near 0 (where relative error is hardest)."""
    small = np.geomspace(1e-38, 1.0, 200_001)
    return np.concatenate([np.linspace(lo, hi, n), small, -small]).astype(np.float32)


def max_ulp(got, ref):
    """Largest |got - ref| in units of the float32 spacing at ref, over references in the float32 normal range
    (below it the spacing is fixed at 1.4e-45 and the absolute error is what counts)."""
    ref32 = ref.astype(np.float32)
    normal = np.abs(ref32) >= np.finfo(np.float32).tiny
    err = np.abs(got.astype(np.float64) - ref) / np.spacing(np.abs(ref32)).astype(np.float64)
    return float(err[normal].max())


def _tail(lo, hi):
    """The left tail of x * Phi(x): n evenly spaced float32 points, no points near 0."""
    return lambda: np.linspace(lo, hi, 100_001).astype(np.float32)


def _x_phi(x):
    return x * _RUN["ndtr"](x)


def _measured():
    """What the README quotes from benchmarks/results/ulp.md (python benchmarks/bench_ulp.py writes it from this
    table): {label: (f(x) in float32, its float64 reference, the float32 grid, the stated bound in ulps)}."""
    return {
        "exp": (_RUN["exp"], np.exp, lambda: _grid(-87.33, 88.72), M.EXP32_MAX_ULP),
        "erf": (_RUN["erf"], erf, lambda: _grid(-6.0, 6.0), M.ERF32_MAX_ULP),
        # erfc(10.1) ~ 1e-46: through the whole float32 range
        "erfc": (_RUN["erfc"], erfc, lambda: _grid(-6.0, 10.1), M.ERFC32_MAX_ULP),
        "ndtr (Phi)": (_RUN["ndtr"], ndtr, lambda: _grid(-14.0, 9.0), M.NDTR32_MAX_ULP),
        "sigmoid": (_RUN["sigmoid"], expit, lambda: _grid(-90.0, 30.0), M.SIGMOID32_MAX_ULP),
        # x * Phi(x) at x -> -13 is ~1e-38: relative (not merely absolute) accuracy, to the last normal float32;
        # ndtr's relative error (<= 1 ulp of Phi, up to 2 ulp of a product at the bottom of its binade) plus the
        # rounding of the product
        "x Phi(x) on [-13, -5]": (_x_phi, lambda x: x * ndtr(x), _tail(-13.0, -5.0), 3),
        "exp_f32": (_EXP_F32, np.exp, lambda: _grid(-87.33, 88.72), M.EXP_F32_MAX_ULP),
        # Phi relative to itself in both tails (down to -13.2, where Phi nears the float32 normal range), and the
        # Gaussian exp(-u^2/2), whose argument is carried exactly (u^2 = s + fma residual), for |x| <= 13
        "Phi (phi_parts_f32)": (lambda x: _PHI_F32(x)[0], ndtr, lambda: _grid(-13.2, 9.0), M.PHI_F32_MAX_ULP),
        "exp(-u^2/2) (phi_parts_f32)": (lambda x: _PHI_F32(x)[1], lambda x: np.exp(-0.5 * x ** 2),
                                        lambda: _grid(-13.0, 13.0), M.GAUSS_F32_MAX_ULP),
        # Phi's error (<= PHI_F32_MAX_ULP) plus the product's rounding: a relative error, as in the tail of x Phi(x)
        "x Phi(x) on [-13, -5] (phi_parts_f32)": (lambda x: x * _PHI_F32(x)[0], lambda x: x * ndtr(x),
                                                  _tail(-13.0, -5.0), M.PHI_F32_MAX_ULP + 1),
        "sigmoid_f32": (_SIGMOID_F32, expit, lambda: _grid(-90.0, 30.0), M.SIGMOID_F32_MAX_ULP),
    }


def measure(label):
    """(max ulp of `label` over its grid, its stated bound, the grid's size and range)."""
    run, ref, grid, bound = _measured()[label]
    x = grid()
    got = run(x)
    assert got.dtype == np.float32, f"{label}: computed in {got.dtype}"
    return max_ulp(got, ref(x.astype(np.float64))), bound, (x.size, float(x.min()), float(x.max()))


@pytest.mark.parametrize("label", list(_measured()))
def test_float32_max_ulp_within_its_stated_bound(label):
    err, bound, _ = measure(label)
    assert err <= bound, f"{label}: {err:.3f} ulp > stated {bound}"


def test_exp_float32_top_of_range():
    # k = 128 near the top (2^128 alone overflows float32): exp must stay finite and as accurate as elsewhere
    x = np.linspace(88.0, 88.72, 1001).astype(np.float32)
    got = _RUN["exp"](x)
    assert np.isfinite(got).all()
    assert max_ulp(got, np.exp(x.astype(np.float64))) <= M.EXP32_MAX_ULP


@pytest.mark.parametrize("name, ref", [("erf", math.erf), ("erfc", math.erfc), ("exp", math.exp)])
def test_float64_is_libm(name, ref):
    x = np.linspace(-20.0, 20.0, 4001)
    got = _RUN[name](x)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, [ref(v) for v in x])


def test_float64_ndtr_and_sigmoid():
    x = np.linspace(-37.0, 37.0, 40001)
    # Cephes' own scheme in libm: within a few float64 ulps of scipy; the left tail relatively
    np.testing.assert_allclose(_RUN["ndtr"](x), ndtr(x), rtol=1e-13, atol=0)
    np.testing.assert_allclose(_RUN["sigmoid"](x), expit(x), rtol=1e-15, atol=0)


# float32-lane functions (_math.exp_f32, phi_parts_f32, sigmoid_f32: gelu v4, cross_entropy v4, attention v6): their
# ulp bounds are in the table above; here the ends of their ranges

def test_exp_f32_ends_of_the_range():
    # k = 128 (x > 127.5 ln 2) is built as 2 p 2^127; below the range 0, above it inf, -inf -> 0, NaN -> NaN
    top = np.linspace(88.3, 88.72, 1001).astype(np.float32)
    got = _EXP_F32(top)
    assert np.isfinite(got).all() and max_ulp(got, np.exp(top.astype(np.float64))) <= M.EXP_F32_MAX_ULP
    ends = _EXP_F32(np.array([-90.0, -np.inf, 89.0, np.inf, np.nan], np.float32))
    assert ends[0] == 0 and ends[1] == 0 and ends[2] == np.inf and ends[3] == np.inf and np.isnan(ends[4])


def test_phi_parts_f32_limits():
    phi, gauss = _PHI_F32(np.array([-np.inf, -20.0, 0.0, 20.0, np.inf], np.float32))
    np.testing.assert_array_equal(phi, [0.0, 0.0, 0.5, 1.0, 1.0])
    np.testing.assert_array_equal(gauss, [0.0, 0.0, 1.0, 0.0, 0.0])




def test_exp_float32_below_the_range_is_exactly_zero():
    # documented: below -87.34 (and at -inf) exp is exactly 0, as a softmax over a padding mask needs (the clamp
    # alone would give exp(-87.33654), the smallest normal float32, instead); NaN stays NaN
    x = np.array([-87.34, -87.5, -90.0, -1e4, np.finfo(np.float32).min, -np.inf, np.nan], np.float32)
    got = _RUN["exp"](x)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, [0, 0, 0, 0, 0, 0, np.nan])
