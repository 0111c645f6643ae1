"""refbert.special against independent references: the C library's math.erf / math.erfc, mpmath's arbitrary
precision (the exact value), and scipy.special (a second oracle where it is itself accurate).

Accuracy is counted in ulps of the reference: |ours - ref| / spacing(ref). The bar for float64 is 2 ulp: fdlibm's
forms round three or four times on their way to a result (an exp, a division, a sum; see refbert/special.py), so a
correct implementation lands within about 2. glibc's erfc strays up to 3 ulp itself, so where ours and the C library
differ by more than 2 the exact value decides.
"""
import math
import struct

import numpy as np
import pytest

from refbert import special

F64_TOL = 2.0          # ulp, float64 (see the module docstring)


def ulps(got, ref):
    """|got - ref| in units of the spacing of ref (the smallest subnormal for ref = 0)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return np.abs(got - ref) / np.maximum(np.spacing(np.abs(ref)), 5e-324)


def exact(fn, xs, prec=120):
    """mpmath's value of fn at each float of xs, rounded to float64."""
    mpmath = pytest.importorskip("mpmath")
    with mpmath.workprec(prec):
        return np.array([float(getattr(mpmath, fn)(mpmath.mpf(float(v)))) for v in xs])


# --- the coefficients are fdlibm's --------------------------------------------------------------------------------

# s_erf.c prints each coefficient's two 32-bit words beside its decimal value; these are those words.
FDLIBM_WORDS = {
    "ERX": [(0x3FEB0AC1, 0x60000000)],
    "PP": [(0x3FC06EBA, 0x8214DB68), (0xBFD4CD7D, 0x691CB913), (0xBF9D2A51, 0xDBD7194F), (0xBF77A291, 0x236668E4),
           (0xBEF8EAD6, 0x120016AC)],
    "QQ": [(0x3FD97779, 0xCDDADC09), (0x3FB0A54C, 0x5536CEBA), (0x3F74D022, 0xC4D36B0F), (0x3F215DC9, 0x221C1A10),
           (0xBED09C43, 0x42A26120)],
    "PA": [(0xBF6359B8, 0xBEF77538), (0x3FDA8D00, 0xAD92B34D), (0xBFD7D240, 0xFBB8C3F1), (0x3FD45FCA, 0x805120E4),
           (0xBFBC6398, 0x3D3E28EC), (0x3FA22A36, 0x599795EB), (0xBF61BF38, 0x0A96073F)],
    "QA": [(0x3FBB3E66, 0x18EEE323), (0x3FE14AF0, 0x92EB6F33), (0x3FB2635C, 0xD99FE9A7), (0x3FC02660, 0xE763351F),
           (0x3F8BEDC2, 0x6B51DD1C), (0x3F888B54, 0x5735151D)],
    "RA": [(0xBF843412, 0x600D6435), (0xBFE63416, 0xE4BA7360), (0xC0251E04, 0x41B0E726), (0xC04F300A, 0xE4CBA38D),
           (0xC0644CB1, 0x84282266), (0xC067135C, 0xEBCCABB2), (0xC0545265, 0x57E4D2F2), (0xC023A0EF, 0xC69AC25C)],
    "SA": [(0x4033A6B9, 0xBD707687), (0x4061350C, 0x526AE721), (0x407B290D, 0xD58A1A71), (0x40842B19, 0x21EC2868),
           (0x407AD021, 0x57700314), (0x405B28A3, 0xEE48AE2C), (0x401A47EF, 0x8E484A93), (0xBFAEEFF2, 0xEE749A62)],
    "RB": [(0xBF843412, 0x39E86F4A), (0xBFE993BA, 0x70C285DE), (0xC031C209, 0x555F995A), (0xC064145D, 0x43C5ED98),
           (0xC083EC88, 0x1375F228), (0xC0900461, 0x6A2E5992), (0xC07E384E, 0x9BDC383F)],
    "SB": [(0x403E568B, 0x261D5190), (0x40745CAE, 0x221B9F0A), (0x409802EB, 0x189D5118), (0x40A8FFB7, 0x688C246A),
           (0x40A3F219, 0xCEDF3BE6), (0x407DA874, 0xE79FE763), (0xC03670E2, 0x42712D62)],
}


def test_coefficients_are_fdlibms_bit_for_bit():
    for name, words in FDLIBM_WORDS.items():
        ours = getattr(special, name)
        ours = [ours] if name == "ERX" else list(ours[1:] if name in ("QQ", "QA", "SA", "SB") else ours)  # Q(0) = 1
        want = [struct.unpack(">d", struct.pack(">II", hi, lo))[0] for hi, lo in words]
        assert ours == want, name


def test_one_over_sqrt2_split():
    from decimal import Decimal, getcontext
    getcontext().prec = 60
    k = Decimal(1) / Decimal(2).sqrt()
    assert abs(Decimal(special._K_HI) + Decimal(special._K_LO) - k) < Decimal(2) ** -106   # a double-double
    assert special._K_HI26 + special._K_HI_REST == special._K_HI                          # an exact split
    assert (np.array(special._K_HI26).view(np.int64) & ((1 << 27) - 1)) == 0             # 26 bits


def test_ndtr_tail_constant_split():
    # c = 0.5625 + ln(2)/2 = C_HI + C_LO to 2^-70, C_HI of 20 fractional bits (so that x^2/2 + C_HI is exact for x
    # cut to 21 bits: refbert.special._tail)
    from decimal import Decimal, getcontext
    getcontext().prec = 60
    c = Decimal("0.5625") + Decimal(2).ln() / 2
    assert abs(Decimal(special._C_HI) + Decimal(special._C_LO) - c) < Decimal(2) ** -70
    assert special._C_HI * 2 ** 20 == int(special._C_HI * 2 ** 20) and abs(special._C_LO) < 2 ** -20


# --- float64 accuracy on dense grids ------------------------------------------------------------------------------

def check_against_c_library(fn, cfn, xs):
    """Within F64_TOL ulp of the C library, or, where the C library is off (they differ by more), of the exact
    value. Returns the largest distance from the C library and the points the exact value decided."""
    ours = fn(xs)
    ref = np.array([cfn(v) for v in xs])
    d = ulps(ours, ref)
    off = np.flatnonzero(d > F64_TOL)
    if off.size:
        e = ulps(ours[off], exact(fn.__name__, xs[off]))
        assert e.max() <= F64_TOL, (xs[off][e.argmax()], e.max())
    return d.max(), off.size


def test_erf_within_2_ulp_of_math_erf():
    xs = np.concatenate([np.linspace(-6, 6, 240_001), np.geomspace(1e-300, 1e-3, 2_000), [5e-324, 1e-310]])
    xs = np.concatenate([xs, -xs])
    worst, decided = check_against_c_library(special.erf, math.erf, xs)
    assert worst <= F64_TOL and decided == 0          # glibc's erf is within 1 ulp, so no point needs the arbiter


def test_erfc_within_2_ulp_of_math_erfc_or_exact():
    xs = np.concatenate([np.linspace(-6, 27.3, 300_001), np.geomspace(1e-300, 1, 2_000)])
    check_against_c_library(special.erfc, math.erfc, xs)


def test_erf_erfc_random_points_against_exact():
    pytest.importorskip("mpmath")
    r = np.random.default_rng(0)
    xs = np.concatenate([r.uniform(-6, 6, 1500), r.uniform(0.4, 3, 1500), r.uniform(3, 27.2, 1000)])
    assert ulps(special.erf(xs[:1500]), exact("erf", xs[:1500])).max() <= F64_TOL
    assert ulps(special.erfc(xs), exact("erfc", xs)).max() <= F64_TOL


def test_ndtr_within_2_ulp_down_to_minus_38():
    # Phi against mpmath's ncdf: a grid over [-38.5, 9] (Phi(-38) = 2.9e-316 is subnormal, Phi(-38.5) rounds to 0)
    # plus the band [-1.9, 0] where the central form cancels and the regions meet
    pytest.importorskip("mpmath")
    r = np.random.default_rng(1)
    xs = np.concatenate([np.linspace(-38.5, 9, 2_001), r.uniform(-38.5, 9, 1_000), r.uniform(-1.9, 0, 1_500)])
    ref = exact("ncdf", xs)
    d = ulps(special.ndtr(xs), ref)
    assert d.max() <= F64_TOL, (xs[d.argmax()], d.max())


def test_ndtr_against_scipy_where_scipy_is_accurate():
    # scipy's ndtr rounds x / sqrt 2 first: 2 x^2 ulp of error in the left tail (1600 ulp at x = -38), so the
    # comparison is on x > -0.6, where Cephes is within 2 ulp: ours within 2 more
    sc = pytest.importorskip("scipy.special")
    xs = np.linspace(-0.6, 9, 100_001)
    assert ulps(special.ndtr(xs), sc.ndtr(xs)).max() <= 2 * F64_TOL


def test_ndtr_left_tail_keeps_relative_accuracy():
    # the point of carrying x / sqrt 2 as a double-double: where scipy is hundreds of ulp off, ours is not
    pytest.importorskip("mpmath")
    xs = np.array([-37.5, -30.0, -20.0, -10.5, -5.25])
    assert ulps(special.ndtr(xs), exact("ncdf", xs)).max() <= F64_TOL


# --- float32, special values, shapes --------------------------------------------------------------------------

@pytest.mark.parametrize("fn, ref, lo, hi", [("erf", "erf", -5, 5), ("erfc", "erfc", -5, 10),
                                             ("ndtr", "ncdf", -14, 7)])
def test_float32_stays_float32_and_rounds_once(fn, ref, lo, hi):
    # float32 is computed in float64 (to ~1e-16) and rounded once: within 1 float32 ulp of the exact value (the
    # half ulp of that rounding, plus a hair where the float64 value sits next to a half-way point)
    mpmath = pytest.importorskip("mpmath")
    xs = np.random.default_rng(2).uniform(lo, hi, 4_000).astype(np.float32)
    got = getattr(special, fn)(xs)
    assert got.dtype == np.float32
    with mpmath.workprec(80):
        want = np.array([float(getattr(mpmath, ref)(mpmath.mpf(float(v)))) for v in xs]).astype(np.float32)
    spacing = np.maximum(np.spacing(np.abs(want)), np.float32(1.4e-45)).astype(np.float64)
    assert (np.abs(got.astype(np.float64) - want.astype(np.float64)) / spacing).max() <= 1


def test_special_values():
    inf, nan = np.inf, np.nan
    for dtype in (np.float32, np.float64):
        x = np.array([-inf, -0.0, 0.0, inf, nan], dtype)
        erf, erfc, ndtr, expit = (getattr(special, f)(x) for f in ("erf", "erfc", "ndtr", "expit"))
        np.testing.assert_array_equal(erf, np.array([-1, 0, 0, 1, nan], dtype))
        assert np.signbit(erf[1]) and not np.signbit(erf[2])                      # erf(-0) = -0
        np.testing.assert_array_equal(erfc, np.array([2, 1, 1, 0, nan], dtype))
        np.testing.assert_array_equal(ndtr, np.array([0, 0.5, 0.5, 1, nan], dtype))
        np.testing.assert_array_equal(expit, np.array([0, 0.5, 0.5, 1, nan], dtype))
        assert all(a.dtype == dtype for a in (erf, erfc, ndtr, expit))
    assert special.ndtr(-40.0) == 0.0 and special.erfc(28.0) == 0.0 and special.ndtr(40.0) == 1.0
    assert special.erf(5e-324) == 5e-324 == math.erf(5e-324)                      # subnormal: erf(x) ~ 1.13 x
    assert 0 < special.ndtr(-38.0) < 2.3e-308                                      # subnormal, not flushed to 0


def test_region_boundaries_and_dispatch():
    # values on both sides of every region boundary, in a shuffled array larger than several chunks with a chunk
    # shrunk to 7 values, with batches run at once (_SMALL = 0), held back until the end (_SMALL = 8), or either
    # (_SMALL = 2); alone (most values beyond region 1: each region gathered) and among four times as many values
    # of region 1 (which then runs on whole chunks): the same numbers as one value at a time
    b = np.array(special.BOUNDS[:3])
    edges = np.concatenate([b, b * math.sqrt(2)])
    xs = np.concatenate([np.nextafter(edges, 0), edges, np.nextafter(edges, 9), np.linspace(-30, 30, 101)])
    r = np.random.default_rng(3)
    xs = r.permutation(np.concatenate([xs, -xs]))
    central = r.permutation(np.concatenate([xs, r.uniform(-0.8, 0.8, 4 * xs.size)]))
    cases = [x.astype(dtype) for x in (xs, central) for dtype in (np.float64, np.float32)]
    one_by_one = [(f, x, np.array([getattr(special, f)(v) for v in x])) for f in ("erf", "erfc", "ndtr")
                  for x in cases]
    old = special._CHUNK, special._SMALL
    try:
        special._CHUNK = 7
        for special._SMALL in (0, 2, 8):
            for f, x, want in one_by_one:
                np.testing.assert_array_equal(getattr(special, f)(x), want, err_msg=f"{f} {x.dtype} {x.size}")
    finally:
        special._CHUNK, special._SMALL = old


def test_shapes_dtypes_and_layouts():
    x = np.random.default_rng(4).standard_normal((3, 4, 5))
    for f in (special.erf, special.erfc, special.ndtr, special.expit):
        want = f(x)
        assert want.shape == (3, 4, 5) and want.dtype == np.float64
        np.testing.assert_array_equal(f(x[:, ::2].copy()), f(x[:, ::2]))        # a strided view
        np.testing.assert_array_equal(f(x.astype(">f8")), want)                  # big-endian
        assert f(np.zeros((0, 3))).shape == (0, 3)
        assert isinstance(f(0.5), np.float64) and f(np.float32(0.5)).dtype == np.float32
        assert f([1, 2]).dtype == np.float64                                     # ints become float64


@pytest.mark.parametrize("bad", [np.array([1j]), np.array(["a"]), np.array([None])])
def test_bad_input_names_the_argument(bad):
    for f in ("erf", "erfc", "ndtr", "expit"):
        with pytest.raises(ValueError, match=rf"{f}: argument 'x' expected real numbers .* got dtype"):
            getattr(special, f)(bad)


def test_expit_against_exact_and_scipy():
    # float64: exp, 1 + e, 1 / (1 + e) (and e * that for x < 0) each round once: within 3 ulp of the exact value
    mpmath = pytest.importorskip("mpmath")
    xs = np.concatenate([np.linspace(-745, 40, 2_001), np.random.default_rng(5).uniform(-20, 20, 2_000)])
    with mpmath.workprec(120):
        want = np.array([float(1 / (1 + mpmath.exp(-mpmath.mpf(float(v))))) for v in xs])
    assert ulps(special.expit(xs), want).max() <= 3
    sc = pytest.importorskip("scipy.special")
    ok = xs > -700                                   # scipy's 1 / (1 + exp(-x)) gives 0 once exp(-x) overflows
    assert ulps(special.expit(xs[ok]), sc.expit(xs[ok])).max() <= 3 + 3      # scipy's own formula rounds alike
    # float32 is computed in float32 (as scipy's): numpy's float32 exp is within 2 ulp, then two roundings
    x32 = xs.astype(np.float32)
    got = special.expit(x32)
    assert got.dtype == np.float32
    with mpmath.workprec(80):
        w32 = np.array([float(1 / (1 + mpmath.exp(-mpmath.mpf(float(v))))) for v in x32]).astype(np.float32)
    assert (np.abs(got.astype(np.float64) - w32) / np.maximum(np.spacing(np.abs(w32)), 1.4e-45)).max() <= 4


def test_float16_and_bool_inputs_are_computed_as_float64():
    """float16 and bool arrays are widened to float64 (as ints are), not computed or returned in float16 (whose 3
    significant digits would throw away the accuracy this module exists for). The expected values are mpmath's
    exact ones at the (exactly representable) float16 / bool values: erf, erfc, ndtr within F64_TOL, expit within
    the 3 ulp its three roundings allow (see test_expit_against_exact_and_scipy)."""
    mpmath = pytest.importorskip("mpmath")
    x16 = np.array([-2.5, -0.3, 0.0, 0.1, 1.0, 3.0], np.float16)
    xb = np.array([True, False, True])
    for x in (x16, xb):
        xs = x.astype(np.float64)
        for fn, ref, tol in (("erf", "erf", F64_TOL), ("erfc", "erfc", F64_TOL), ("ndtr", "ncdf", F64_TOL)):
            got = getattr(special, fn)(x)
            assert got.dtype == np.float64, (fn, x.dtype, got.dtype)
            assert ulps(got, exact(ref, xs)).max() <= tol, (fn, x.dtype)
        got = special.expit(x)
        with mpmath.workprec(120):
            want = np.array([float(1 / (1 + mpmath.exp(-mpmath.mpf(float(v))))) for v in xs])
        assert got.dtype == np.float64 and ulps(got, want).max() <= 3, x.dtype


def test_non_native_byte_order_gives_native_results():
    """A big-endian input (as read from some files) yields an array of the native float64 / float32 dtype, equal to
    the dtype a native input gives, so that callers comparing or concatenating dtypes see no byte-order variant."""
    x = np.linspace(-4, 4, 9)
    for f in (special.erf, special.erfc, special.ndtr, special.expit):
        for big, native in ((">f8", np.float64), (">f4", np.float32)):
            got = f(x.astype(big))
            assert got.dtype == np.dtype(native) and got.dtype.isnative, (f.__name__, big, got.dtype)
