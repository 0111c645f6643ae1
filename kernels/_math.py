"""Elementary functions that vectorise inside Numba loops, and the Philox generator of refbert.philox in Numba.

Pip's llvmlite links no SVML, so `math.exp` in a Numba loop is a scalar libm call per element and stops LLVM from
vectorising the loop. `exp(x)` below is a polynomial for float32 (branch-free, so a loop of it becomes SIMD code)
and `math.exp` for float64, where the kernels must match the float64 oracle to ~1e-15 and speed is secondary.
The dispatch is by argument type at compile time (numba.extending.overload), so one kernel source serves both.

float32 exp, Cody & Waite range reduction then a minimax-style polynomial:
    k = round(x / ln 2),  r = x - k * ln2_hi - k * ln2_lo      |r| <= ln2 / 2, ln2_hi exact in 16 bits
    exp(r) ~ 1 + r + r^2/2! + ... + r^7/7!                     Taylor to degree 7: truncation < 2.5e-9 relative
    exp(x) = 2^k * exp(r),  2^k = 2^(k >> 1) * 2^(k - (k >> 1)), each built from its exponent bits (two factors,
                            so k = 128, near the top of the range, does not overflow)
Measured maximum error over x in [-87.3, 88.7] (10^7 points, tests/test_kernels_math.py): 0.50 ulp (Numba's
math.floor returns an int64, so r and the polynomial run in float64 registers, which still vectorise); stated as
EXP32_MAX_ULP below, which the test re-measures. Below -87.34 (and at -inf) the result is exactly 0, as a softmax
over a padding mask needs.

Philox4x32-10: the same function of (counter, key) as refbert.philox, on uint64 scalars holding 32-bit words
(Numba promotes mixed signed/unsigned integer arithmetic to float64, so every constant here is a np.uint64).
"""
import math

import numpy as np
from numba import njit, types
from numba.core import cgutils  # noqa: F401  (llvmlite is reached through numba)
from numba.extending import intrinsic, overload

EXP32_MAX_ULP = 1          # worst error of exp() in float32 units in the last place, re-measured by the tests


# ----------------------------------------------------------------------------------------------------------------
# bit casts (one LLVM instruction each; no memory round trip)

@intrinsic
def bits_to_f32(typingctx, i):
    """Reinterpret the low 32 bits of an integer as a float32."""
    def codegen(context, builder, sig, args):
        from llvmlite import ir
        v = builder.trunc(args[0], ir.IntType(32)) if args[0].type.width > 32 else args[0]
        return builder.bitcast(v, ir.FloatType())
    return types.float32(i), codegen


# ----------------------------------------------------------------------------------------------------------------
# exp

def exp(x):
    """exp(x): a polynomial for float32 (vectorises), math.exp for float64. Use inside @njit code."""
    return math.exp(x)


_LOG2E = 1.4426950408889634
_LN2_HI = 0.693145751953125            # ln 2 rounded to 16 significant bits: k * _LN2_HI is exact for |k| < 2^8
_LN2_LO = 1.4286068203094172e-06       # ln 2 - _LN2_HI


@overload(exp, jit_options={"error_model": "numpy"})
def _exp_overload(x):
    if isinstance(x, types.Float) and x.bitwidth == 32:
        def impl(x):
            xc = min(max(x, np.float32(-87.33654)), np.float32(88.72283))  # exp of these is the float32 range
            k = math.floor(xc * np.float32(_LOG2E) + np.float32(0.5))       # nearest integer
            r = (xc - k * np.float32(_LN2_HI)) - k * np.float32(_LN2_LO)     # |r| <= ln2 / 2
            p = np.float32(1.0 / 5040)                                      # Horner: sum r^n / n!, n <= 7
            p = p * r + np.float32(1.0 / 720)
            p = p * r + np.float32(1.0 / 120)
            p = p * r + np.float32(1.0 / 24)
            p = p * r + np.float32(1.0 / 6)
            p = p * r + np.float32(0.5)
            p = p * r + np.float32(1.0)
            p = p * r + np.float32(1.0)
            k1 = np.int32(k) >> np.int32(1)                                  # 2^k = 2^k1 * 2^k2, both normal for
            k2 = np.int32(k) - k1                                            # k in [-126, 128] (2^128 is not)
            y = (p * bits_to_f32((k1 + np.int32(127)) << np.int32(23))) * bits_to_f32((k2 + np.int32(127)) << np.int32(23))
            return np.float32(0.0) if x < np.float32(-87.33654) else y      # underflow (and -inf) -> 0, a select
        return impl
    if isinstance(x, types.Float):
        return lambda x: math.exp(x)


# ----------------------------------------------------------------------------------------------------------------
# Philox4x32-10 (refbert.philox)

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_MASK32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)


@njit(cache=True, inline="always")
def philox_block(block, stream, seed):
    """The 4 words of Philox block `block` of dropout call (seed, stream): elements 4*block .. 4*block + 3.
    All arguments are uint64; returns 4 uint64 holding uint32 values."""
    c0, c1 = block & _MASK32, block >> _S32
    c2, c3 = stream & _MASK32, stream >> _S32
    k0, k1 = seed & _MASK32, seed >> _S32
    for r in range(10):
        p0 = _M0 * c0
        p1 = _M1 * c2
        c0, c1, c2, c3 = ((p1 >> _S32) ^ c1 ^ k0) & _MASK32, p1 & _MASK32, ((p0 >> _S32) ^ c3 ^ k1) & _MASK32, \
            p0 & _MASK32
        k0 = (k0 + _W0) & _MASK32
        k1 = (k1 + _W1) & _MASK32
    return c0, c1, c2, c3


@njit(cache=True, inline="always")
def philox_word(i, stream, seed):
    """The uint32 word (as uint64) of element i of dropout call (seed, stream): word i % 4 of block i // 4."""
    i = np.uint64(i)
    w0, w1, w2, w3 = philox_block(i >> np.uint64(2), np.uint64(stream), np.uint64(seed))
    lane = i & np.uint64(3)
    if lane == 0:
        return w0
    if lane == 1:
        return w1
    if lane == 2:
        return w2
    return w3


# ----------------------------------------------------------------------------------------------------------------
# erf, erfc, ndtr (normal CDF), sigmoid                                         (added with the GELU / CE kernels)
#
# float32: evaluated in float64 registers (which vectorise like float32 ones, 8 lanes of AVX-512 instead of 16),
# from float64 approximations about 100x more accurate than float32 needs, then rounded once to float32. This
# makes every argument reduction exact without Dekker splits that fast-math reassociation would undo (x^2 of a
# float32 is exact in float64), keeps *relative* accuracy in both tails, and leaves only the final rounding:
#     _exp_wide(y)   exp of a float64 to ~3e-10 relative: y = k ln2 + r, |r| <= ln2/2, Taylor to degree 8
#                    (truncation 0.347^9 / 9! = 2e-10), 2^k from its exponent bits; y clamped to [-708, 709]
#     erfcx          erfc(a) = exp(-a^2) * P(q) / (1 + 2a),  q = (a - 2) / (a + 2),  a in [0, 11]: the variable
#                    and the factor (1 + 2a) are N. Juffa's (his float32 erfcf, StackOverflow 2015/2020); P of
#                    degree 11 self-fitted in float64 to (1 + 2a) erfcx(a) (scipy.special.erfcx) on 4e5 points,
#                    Chebyshev least squares with 40 Lawson reweightings towards minimax relative error:
#                    max relative error 1.02e-9. For a > 11 erfc(a) < 2e-54 and the float32 result is 0.
#     erf small      erf(x) = x * Q(x^2) for |x| < 0.75 (where 1 - erfc would lose relative accuracy), Q of
#                    degree 5 fitted the same way to erf(x)/x: max relative error 1.4e-9.
#     ndtr(x)        Phi(x) = erfc(-x/sqrt2) / 2 through the same erfcx, so the left tail keeps its relative
#                    accuracy: x * Phi(x) at x = -10 is right to float32 rounding, as is every x down to where it
#                    underflows float32 (x ~ -13.2); the right side is 1 - erfc/2.
#     sigmoid(x)     1 / (1 + e) or e / (1 + e) with e = exp(-|x|) (no overflow, relative accuracy for x -> -inf).
# Measured max error over the float32 range (tests/test_kernels_math.py, 2.4*10^6 points each, math.* and scipy
# as reference): erf 0.52, erfc 0.52, ndtr 0.52, sigmoid 0.50 ulp (the final rounding plus ~1e-9 relative), stated
# as 1 ulp below; x * ndtr(x) (GELU) over [-13, -5]: 2.1 ulp (two roundings), tested against 3.
# Normal results only: below the float32 normal range (erfc(x > 9.2),
# sigmoid(x < -87.3)) the error is bounded by the denormal spacing, 1.4e-45 absolute.
# float64: math.erf / math.erfc / math.exp (the oracle's reference to ~1e-16, so kernels match it to ~1e-13).

ERF32_MAX_ULP = 1          # the stated bounds, re-measured by tests/test_kernels_math.py
ERFC32_MAX_ULP = 1
NDTR32_MAX_ULP = 1
SIGMOID32_MAX_ULP = 1


@intrinsic
def bits_to_f64(typingctx, i):
    """Reinterpret a 64-bit integer as a float64."""
    def codegen(context, builder, sig, args):
        from llvmlite import ir
        return builder.bitcast(args[0], ir.DoubleType())
    return types.float64(i), codegen


_LN2 = 0.6931471805599453
_ERFCX_P = (8.0625796659860728e-05, 1.7221381303262519e-04, -3.9992376463454351e-04, -1.4231625009672850e-03,
            1.2512140672789503e-03, 8.7096940163940619e-03, -8.0303348825008902e-03, -5.4217868693199257e-02,
            1.6405097537051525e-01, -1.6603052241427724e-01, -9.2763818638443171e-02, 1.2769783827114616e+00)
_ERF_Q = (-6.74991077559662688e-04, 5.11439745532295698e-03, -2.68346481092045890e-02, 1.12833770060912233e-01,
          -3.76126187841257953e-01, 1.12837916549919104e+00)
_SQRT_HALF = 0.7071067811865476
_FAST = {"reassoc", "contract", "arcp", "nsz"}   # no nnan / ninf: infinities and NaN pass through
_OPTS = {"fastmath": _FAST, "error_model": "numpy"}  # numpy: x / 0 is inf, no ZeroDivisionError branch (blocks SIMD)


@njit(cache=True, fastmath=_FAST, error_model="numpy")
def _exp_wide(y):
    """exp(y) for float64 y, relative error ~3e-10: the float32 functions' internal exponential."""
    y = min(max(y, -708.0), 709.0)
    k = math.floor(y * 1.4426950408889634 + 0.5)
    r = y - k * _LN2                                   # |r| <= ln2/2 (+ k ulp(ln2) ~ 1e-13: harmless here)
    p = 1.0 / 40320
    p = p * r + 1.0 / 5040
    p = p * r + 1.0 / 720
    p = p * r + 1.0 / 120
    p = p * r + 1.0 / 24
    p = p * r + 1.0 / 6
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    return p * bits_to_f64((np.int64(k) + np.int64(1023)) << np.int64(52))


@njit(cache=True, fastmath=_FAST, error_model="numpy")
def _erfcx_wide(a):
    """erfcx(a) = exp(a^2) erfc(a) for float64 a in [0, 11], relative error 1.0e-9."""
    q = (a - 2.0) / (a + 2.0)
    p = _ERFCX_P[0]                       # Horner, written out: a loop over the tuple would not vectorise
    p = p * q + _ERFCX_P[1]
    p = p * q + _ERFCX_P[2]
    p = p * q + _ERFCX_P[3]
    p = p * q + _ERFCX_P[4]
    p = p * q + _ERFCX_P[5]
    p = p * q + _ERFCX_P[6]
    p = p * q + _ERFCX_P[7]
    p = p * q + _ERFCX_P[8]
    p = p * q + _ERFCX_P[9]
    p = p * q + _ERFCX_P[10]
    p = p * q + _ERFCX_P[11]
    return p / (1.0 + 2.0 * a)


@njit(cache=True, fastmath=_FAST, error_model="numpy")
def _erfc_pos(a):
    """erfc(a) for float64 a >= 0 (a > 11 is treated as 11: erfc < 2e-54 there), relative error ~1.5e-9."""
    a = min(a, 11.0)
    return _exp_wide(-a * a) * _erfcx_wide(a)


@njit(cache=True, fastmath=_FAST, error_model="numpy")
def _erf_wide(x):
    """erf(x) for float64 x, relative error ~2e-9."""
    a = abs(x)
    s = x * x
    p = _ERF_Q[0]
    p = p * s + _ERF_Q[1]
    p = p * s + _ERF_Q[2]
    p = p * s + _ERF_Q[3]
    p = p * s + _ERF_Q[4]
    p = p * s + _ERF_Q[5]
    big = 1.0 - _erfc_pos(a)
    return x * p if a < 0.75 else (big if x >= 0 else -big)


def erf(x):
    """erf(x): float64-register approximation rounded once for float32 (vectorises), math.erf for float64."""
    return math.erf(x)


def erfc(x):
    """erfc(x) = 1 - erf(x), accurate relative to itself in the right tail. math.erfc for float64."""
    return math.erfc(x)


def ndtr(x):
    """Phi(x), the standard normal CDF (scipy.special.ndtr), relative accuracy in the left tail."""
    return 0.5 * math.erfc(-x * _SQRT_HALF)


def sigmoid(x):
    """1 / (1 + exp(-x)) (scipy.special.expit) without overflow, relative accuracy for x -> -inf."""
    e = math.exp(-abs(x))
    return 1.0 / (1.0 + e) if x >= 0 else e / (1.0 + e)


def _f32(x):
    return isinstance(x, types.Float) and x.bitwidth == 32


@overload(erf, jit_options=_OPTS)
def _erf_overload(x):
    if _f32(x):
        return lambda x: np.float32(_erf_wide(np.float64(x)))
    if isinstance(x, types.Float):
        return lambda x: math.erf(x)


@overload(erfc, jit_options=_OPTS)
def _erfc_overload(x):
    if _f32(x):
        def impl(x):
            xd = np.float64(x)
            r = _erfc_pos(abs(xd))
            return np.float32(r if xd >= 0 else 2.0 - r)
        return impl
    if isinstance(x, types.Float):
        return lambda x: math.erfc(x)


@njit(cache=True, fastmath=_FAST, error_model="numpy")
def _ndtr_wide(x):
    """Phi(x) for float64 x through the float32-grade erfc (relative error ~2e-9 in both tails)."""
    r = 0.5 * _erfc_pos(abs(x) * _SQRT_HALF)
    return r if x < 0 else 1.0 - r


@overload(ndtr, jit_options=_OPTS)
def _ndtr_overload(x):
    if _f32(x):
        return lambda x: np.float32(_ndtr_wide(np.float64(x)))
    if isinstance(x, types.Float):
        def impl(x):
            # Cephes ndtr: erf near 0 (no erfc cancellation at 1 - erfc), erfc in the tails
            z = x * _SQRT_HALF
            if abs(z) < _SQRT_HALF:
                return 0.5 + 0.5 * math.erf(z)
            r = 0.5 * math.erfc(abs(z))
            return r if x < 0 else 1.0 - r
        return impl


@njit(cache=True, fastmath=_FAST, error_model="numpy")
def _sigmoid_wide(x):
    e = _exp_wide(-abs(x))
    r = 1.0 / (1.0 + e)
    return r if x >= 0 else e * r


@overload(sigmoid, jit_options=_OPTS)
def _sigmoid_overload(x):
    if _f32(x):
        return lambda x: np.float32(_sigmoid_wide(np.float64(x)))
    if isinstance(x, types.Float):
        def impl(x):
            e = math.exp(-abs(x))
            return 1.0 / (1.0 + e) if x >= 0 else e / (1.0 + e)
        return impl


# ----------------------------------------------------------------------------------------------------------------
# float32 lanes: exp, Phi and phi, sigmoid in float32 arithmetic (16 lanes of AVX-512; the *_wide functions above
# run 8 float64 lanes and two divisions per Phi)                                    (added with gelu v4)
#
#     exp_f32(x)     k = rint(x / ln 2) in float32 (np.rint vectorises; math.floor gives an int64), r = x - k ln2
#                    by two fmas (ln2 split in float32 hi + lo: the first product is exact to one rounding), the
#                    degree-7 Taylor polynomial of _math.exp (truncation < 2.5e-9), times 2^k from its exponent bits
#                    (k = 128, the top of the range, as 2p 2^127: a product of two powers, as _math.exp builds it,
#                    would be regrouped by 'reassoc' into 2^128 = inf). x < -87.34 (and -inf) gives exactly 0,
#                    x > 88.73 inf.
#     phi_parts_f32  (Phi(u), exp(-u^2 / 2)): u^2 = s + e exactly (e = fma(u, u, -s)), exp(-u^2/2) =
#                    exp_f32(-s/2) (1 - e/2), so the Gaussian keeps its relative accuracy to |u| = 13 (a rounded
#                    u^2 would cost u^2/2 ulps there); Phi(-|u|) = exp(-u^2/2) erfcx(a) / 2, a = |u| / sqrt 2, with
#                    erfcx(a) = P(q) / (1 + 2a), q = (a - 2) / (a + 2) (the variable of the float64 erfcx above) and
#                    both quotients from ONE reciprocal d = 1 / ((a + 2)(1 + 2a)); P of degree 9, self-fitted in
#                    float64 to (1 + 2a) erfcx(a) (scipy.special.erfcx) on 4e5 points of [0, 10.5], Chebyshev least
#                    squares with 40 Lawson reweightings: relative error 1.5e-8 in float64, 2.1 ulp evaluated in
#                    float32. u is clamped to [-14, 14] (Phi(-14) underflows float32; the Gaussian is 0 there).
#     sigmoid_f32    1 / (1 + e) or e / (1 + e), e = exp_f32(-|x|): one division.
# Measured over dense float32 grids (2e6 - 2e7 points against float64 numpy / scipy): exp_f32 0.91 ulp on
# [-87.3, 88.7]; Phi 5.8 ulp on [-13.2, 9] (relative in the left tail: the Gaussian ~1-2, erfcx 2.1, the reciprocal
# and three products; v3's float64-register Phi is 0.5 ulp), u Phi(u) 6.5 ulp on [-13, -5], exp(-u^2/2) 2.0 ulp on
# [-13, 13], sigmoid_f32 2.5 ulp on [-90, 30]. tests/test_kernels_math.py re-measures them against the bounds below.

EXP_F32_MAX_ULP = 2
PHI_F32_MAX_ULP = 6
GAUSS_F32_MAX_ULP = 3
SIGMOID_F32_MAX_ULP = 3

_ERFCX9 = (-3.961376763e-04, -1.222403948e-03, 1.312566531e-03, 8.625408748e-03, -8.060872671e-03,
           -5.420263529e-02, 1.640556506e-01, -1.660315707e-01, -9.276399717e-02, 1.276978396e+00)
_LN2_HI32 = 0.693359375                # ln 2 rounded to 10 significant bits: k * _LN2_HI32 is exact for |k| < 2^14
_LN2_LO32 = -2.12194440e-4             # ln 2 - _LN2_HI32


@intrinsic
def fmaximum(typingctx, a, b):
    """max(a, b) as llvm.maximum: NaN if either is NaN (as np.max), and a reduction of it vectorises, which the
    compare-and-select of Python's max does not without 'nnan'. (Written for kernels/softmax.py v2.)"""
    if not (isinstance(a, types.Float) and a == b):
        return None

    def codegen(context, builder, sig, args):
        from llvmlite import ir
        t = args[0].type
        fn = builder.module.declare_intrinsic("llvm.maximum", [t], ir.FunctionType(t, [t, t]))
        return builder.call(fn, args)
    return a(a, b), codegen


@intrinsic
def fma(typingctx, a, b, c):
    """a * b + c with one rounding (llvm.fma): the exact residual fma(u, u, -u*u), which fast-math cannot fold."""
    if not (isinstance(a, types.Float) and a == b == c):
        return None

    def codegen(context, builder, sig, args):
        from llvmlite import ir
        t = args[0].type
        fn = builder.module.declare_intrinsic("llvm.fma", [t], ir.FunctionType(t, [t, t, t]))
        return builder.call(fn, args)
    return a(a, b, c), codegen


@njit(cache=True, fastmath=_FAST, error_model="numpy")
def exp_f32(x):
    """exp(x) for float32 x in float32 arithmetic (vectorises 16 lanes wide)."""
    f = np.float32
    xc = min(max(x, f(-87.33654)), f(88.72283))
    k = np.rint(xc * f(1.4426950408889634))
    r = fma(-k, f(_LN2_HI32), xc)
    r = fma(-k, f(_LN2_LO32), r)
    p = f(1.0 / 5040)
    p = p * r + f(1.0 / 720)
    p = p * r + f(1.0 / 120)
    p = p * r + f(1.0 / 24)
    p = p * r + f(1.0 / 6)
    p = p * r + f(0.5)
    p = p * r + f(1.0)
    p = p * r + f(1.0)
    top = k > f(127.0)                                    # k = 128: 2^128 is not a float32, 2 p 2^127 is
    p = p + p if top else p
    ki = np.int32(k) - np.int32(1) if top else np.int32(k)
    y = p * bits_to_f32((ki + np.int32(127)) << np.int32(23))
    y = np.float32(np.inf) if x > f(88.72283) else y
    return f(0.0) if x < f(-87.33654) else y


@njit(cache=True, fastmath=_FAST, error_model="numpy")
def exp_f32_nonpos(x):
    """exp_f32 for x <= 0 (the Gaussian's -u^2/2, the sigmoid's -|x|): k <= 0, so neither the k = 128 case nor
    the overflow test is needed (8 fewer instructions of ~26); x > 0 is read as 0."""
    f = np.float32
    xc = min(max(x, f(-87.33654)), f(0.0))
    k = np.rint(xc * f(1.4426950408889634))
    r = fma(-k, f(_LN2_HI32), xc)
    r = fma(-k, f(_LN2_LO32), r)
    p = f(1.0 / 5040)
    p = p * r + f(1.0 / 720)
    p = p * r + f(1.0 / 120)
    p = p * r + f(1.0 / 24)
    p = p * r + f(1.0 / 6)
    p = p * r + f(0.5)
    p = p * r + f(1.0)
    p = p * r + f(1.0)
    y = p * bits_to_f32((np.int32(k) + np.int32(127)) << np.int32(23))
    return f(0.0) if x < f(-87.33654) else y


@njit(cache=True, fastmath=_FAST, error_model="numpy")
def phi_parts_f32(u):
    """(Phi(u), exp(-u^2 / 2)) for float32 u in float32 arithmetic: the normal CDF with relative accuracy in both
    tails and the unnormalised Gaussian that its derivative phi(u) = exp(-u^2/2) / sqrt(2 pi) needs."""
    f = np.float32
    uc = min(max(u, f(-14.0)), f(14.0))
    s = uc * uc
    e = fma(uc, uc, -s)                                   # uc^2 = s + e exactly
    g = exp_f32_nonpos(f(-0.5) * s) * (f(1.0) - f(0.5) * e)   # exp(-uc^2 / 2)
    a = abs(uc) * f(_SQRT_HALF)
    t = f(1.0) + f(2.0) * a
    d = f(1.0) / ((a + f(2.0)) * t)
    q = (a - f(2.0)) * t * d                              # (a - 2) / (a + 2)
    p = f(_ERFCX9[0])
    p = p * q + f(_ERFCX9[1])
    p = p * q + f(_ERFCX9[2])
    p = p * q + f(_ERFCX9[3])
    p = p * q + f(_ERFCX9[4])
    p = p * q + f(_ERFCX9[5])
    p = p * q + f(_ERFCX9[6])
    p = p * q + f(_ERFCX9[7])
    p = p * q + f(_ERFCX9[8])
    p = p * q + f(_ERFCX9[9])
    r = f(0.5) * g * (p * (a + f(2.0)) * d)              # Phi(-|u|) = exp(-a^2) erfcx(a) / 2
    return (r if u < f(0.0) else f(1.0) - r), g


@njit(cache=True, fastmath=_FAST, error_model="numpy")
def sigmoid_f32(x):
    """1 / (1 + exp(-x)) for float32 x in float32 arithmetic, relative accuracy for x -> -inf."""
    f = np.float32
    e = exp_f32_nonpos(-abs(x))
    r = f(1.0) / (f(1.0) + e)
    return r if x >= f(0.0) else e * r


def fexp(x):
    """exp(x): exp_f32 for float32 (16 lanes), math.exp for float64. Use inside @njit code."""
    return math.exp(x)


@overload(fexp, jit_options=_OPTS)
def _fexp_overload(x):
    if _f32(x):
        return lambda x: exp_f32(x)
    if isinstance(x, types.Float):
        return lambda x: math.exp(x)


def serial_twin(kernel, **options):
    """The Python source of the @njit(parallel=True) `kernel` compiled again without parallel=True (prange runs
    as range, on the calling thread), with `options` (cache=True, fastmath, ...). The copy gets its own qualified
    name: Numba's cache keeps one index per qualified name and keys its entries by signature, code and closure
    only, so a second dispatcher over the same function would load whichever of the two compilations was saved
    first."""
    import types as pytypes
    fn = kernel.py_func
    twin = pytypes.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial", fn.__defaults__, fn.__closure__)
    twin.__qualname__ = fn.__qualname__ + "_serial"
    twin.__module__ = fn.__module__
    return njit(**options)(twin)
