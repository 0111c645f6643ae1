"""The special functions the core needs, in NumPy alone: erf, erfc, the normal CDF ndtr, and the sigmoid expit.

Method and coefficients: fdlibm's s_erf.c (Sun Microsystems, 1993; the erf/erfc of FreeBSD's msun and of musl).
The coefficients below are that file's, digit for digit (tests/test_special.py checks each against the bit pattern
printed beside it there); the code is written here, vectorised. With a = |x| and erf(-x) = -erf(x):

    region 1  a < 0.84375   erf(a) = a + a P(a^2)/Q(a^2)                 (P/Q ~ (erf(a) - a)/a, degree 4/5)
    region 2  a < 1.25      erf(a) = erx + P(s)/Q(s),  s = a - 1          (erx = 0.84506291151 to 24 bits, 6/6)
    region 3  a < 1/0.35    erfc(a) = exp(-a^2 - 0.5625 + R(w)/S(w)) / a,  w = 1/a^2          (7/8)
    region 4  a < 28        the same with another R/S                                        (6/7); erfc = 0 beyond
and erfc = 1 - erf in regions 1 and 2, erf = 1 - erfc in 3 and 4. Each form adds a small rational term to an exact
one, so that the rounding errors shrink with it, and this module keeps it that way:
- region 1: erfc(x) = (1 - x) - x P/Q, where 1 - x is exact for x >= 1/2 (Sterbenz);
- region 2: 1 -+ erx are exact (erx has 24 bits); P(s) is summed with its largest term pa1 s split into an exact
  26 x 26-bit product and a remainder, and P/Q is taken as P - P (Q - 1)/Q, so each rounds about once;
- regions 3, 4: with z = a cut to 21 bits, A = -z^2 - 0.5625 is exact, B = (z - a)(z + a) + R/S is small, and
      exp(A + B) / a = E (1 + d) / a = q + (q d + r / a),  E = exp(S),  q = E / a,  r = E - q a,
  where A + B = S + d exactly (Fast2Sum: S rounded, |d| <= 2^-44, so that exp(d) = 1 + d to 2^-88; fdlibm takes
  exp(A) exp(B) instead, two exps) and r is the division's rounding, computed exactly from 21- and 26-bit halves.
  A whole exp(-a^2) would carry the rounding of a^2, a^2 2^-53 relative: 100 ulp at a = 27. erf there is
  1 - erfc with erfc < 0.078, and takes the plain form (see _fast): its error, a few 1e-16 of erfc, is below 0.3 ulp
  of erf.
ndtr(x) = erfc(-x / sqrt 2) / 2, but x / sqrt 2 rounds, and erfc amplifies that 2 (x / sqrt 2)^2 times (700 ulp at
x = -38, as in scipy's ndtr). So in regions 1 and 2 ndtr carries y = |x| / sqrt 2 as a double-double y = yh + yl
(an exact 26 x 26-bit product plus the rest) and adds the first-order term yl d/dy to each form (whose derivative
needs a percent of accuracy: yl is 2^-53 of y); in region 1 the same split makes 1/2 + y/2 exact where it cancels.
In regions 3 and 4 it needs no y at all: erfc(y) / 2 = exp(-x^2/2 - 0.5625 - ln(2)/2 + R/S(2/x^2)) / |x|, the same
form in x itself, with z = x cut to 21 bits and c = 0.5625 + ln(2)/2 split into 20 bits and a rest (see _tail).

Accuracy, against mpmath at 120 bits on dense grids (tests/test_special.py): erf, erfc and ndtr within 2 ulp of the
exact value (largest seen on the tests' grids plus 200,000 random ndtr points: 0.83 ulp for erf, 1.75 for erfc, 1.88
for ndtr), ndtr down to x = -38 (Phi = 3e-316, subnormal). float32 is computed in float64 without the steps only
float64 needs, and rounded once: correctly rounded on every tested value. ints become float64.

Speed (benchmarks/bench_special.py): NumPy has no per-value branch. The values of each region are found by
comparisons, gathered into a batch, run through their region's formula (50-60 array passes in float64) and
scattered back; region 1, the cheapest formula, runs on whole chunks instead when it holds 70% of the values.
Chunks of 131072 values keep the working arrays in the shared cache and Python's per-call cost small (a batch of a
few values costs as much as one of thousands, so small ones wait and run together at the end), and the working
arrays are allocated once per call (temporaries of 64 kB and more, allocated and freed thousands of times, make
glibc hand pages back to the system and fault them in again: 5-10x slower). On a (4096, 3072) array this takes
0.84-0.96x the time of scipy's compiled ndtr in float64 on N(0, 1) and N(0, 3) inputs, 0.64-0.68x in float32, on a
shared 2-core machine (README, Dependencies).

expit(x) = 1 / (1 + exp(-x)), as exp(-|x|) / (1 + exp(-|x|)) for x < 0 so that nothing overflows.
"""

import numpy as np

# --- fdlibm s_erf.c, ascending powers ------------------------------------------------------------------------------
ERX = 8.45062911510467529297e-01                   # (float) 0.84506291151
PP = (1.28379167095512558561e-01, -3.25042107247001499370e-01, -2.84817495755985104766e-02,
      -5.77027029648944159157e-03, -2.37630166566501626084e-05)
QQ = (1.0, 3.97917223959155352819e-01, 6.50222499887672944485e-02, 5.08130628187576562776e-03,
      1.32494738004321644526e-04, -3.96022827877536812320e-06)
PA = (-2.36211856075265944077e-03, 4.14856118683748331666e-01, -3.72207876035701323847e-01,
      3.18346619901161753674e-01, -1.10894694282396677476e-01, 3.54783043256182359371e-02,
      -2.16637559486879084300e-03)
QA = (1.0, 1.06420880400844228286e-01, 5.40397917702171048937e-01, 7.18286544141962662868e-02,
      1.26171219808761642112e-01, 1.36370839120290507362e-02, 1.19844998467991074170e-02)
RA = (-9.86494403484714822705e-03, -6.93858572707181764372e-01, -1.05586262253232909814e+01,
      -6.23753324503260060396e+01, -1.62396669462573470355e+02, -1.84605092906711035994e+02,
      -8.12874355063065934246e+01, -9.81432934416914548592e+00)
SA = (1.0, 1.96512716674392571292e+01, 1.37657754143519042600e+02, 4.34565877475229228821e+02,
      6.45387271733267880336e+02, 4.29008140027567833386e+02, 1.08635005541779435134e+02,
      6.57024977031928170135e+00, -6.04244152148580987438e-02)
RB = (-9.86494292470009928597e-03, -7.99283237680523006574e-01, -1.77579549177547519889e+01,
      -1.60636384855821916062e+02, -6.37566443368389627722e+02, -1.02509513161107724954e+03,
      -4.83519191608651397019e+02)
SB = (1.0, 3.03380607434824582924e+01, 3.25792512996573918826e+02, 1.53672958608443695994e+03,
      3.19985821950859553908e+03, 2.55305040643316442583e+03, 4.74528541206955367215e+02,
      -2.24409524465858183362e+01)
PA1_HI = float((np.array([PA[1]]).view(np.int64) & np.int64(-(1 << 27))).view(np.float64)[0])
PA1_LO = PA[1] - PA1_HI                            # exact
BOUNDS = (0.84375, 1.25, 1 / 0.35, 28.0)           # the upper ends of R1..R4

_CHUNK = 131072
_SMALL = 4096                                      # batches smaller than this wait (see _evaluate)
_TOP21 = np.int64(-(1 << 32))                      # keeps sign, exponent and the top 20 stored bits: 21 bits
_TOP26 = np.int64(-(1 << 27))                      # 26 bits: the product of two such numbers is exact
_SIGN_BIT = np.int64(-(1 << 63))
# 1/sqrt 2 = K_HI + K_LO to 106 bits (K_LO is what float64 rounding leaves), K_HI = K_HI26 + K_HI_REST
_K_HI = 0.7071067811865476
_K_LO = -4.833646656726457e-17
_K_HI26 = float((np.array([_K_HI]).view(np.int64) & _TOP26).view(np.float64)[0])
_K_HI_REST = _K_HI - _K_HI26                       # exact
_K_R = 0.7071067811865476 - _K_HI26 + _K_LO        # 1/sqrt 2 - K_HI26 (to 2^-80 absolute; used on 26-bit values)
_NPP = tuple(_K_HI / 2 * c / 2 ** j for j, c in enumerate(PP))   # region 1 of ndtr, in x^2 (see _r1)
_NQQ = tuple(c / 2 ** j for j, c in enumerate(QQ))
_ROWS = 16                                         # working arrays: 0-11 the formulas, 12-13 a chunk, 14-15 a batch
# c = 0.5625 + ln(2)/2 = C_HI + C_LO (the constant of ndtr's tail form, see _tail): C_HI of 20 fractional bits
_C_HI = 0.9090728759765625
_C_LO = 7.143034101547086e-07


def _horner(c, x, out):
    """out = sum_j c[j] x^j (c ascending, at least two terms), evaluated in place from the top."""
    np.multiply(x, c[-1], out=out)
    out += c[-2]
    for cj in c[-3::-1]:
        out *= x
        out += cj
    return out


def _top(x, mask, out):
    """out = x with the low bits of its significand cleared (mask _TOP21 or _TOP26)."""
    np.bitwise_and(x.view(np.int64), mask, out=out.view(np.int64))
    return out


# --- the four regions, written into `out` with the working arrays w -------------------------------------------------
# Region 1 works on the signed argument (every term of erf is odd in it). Regions 2-4 work on a = ah + al >= 0 (al:
# the low part of a double-double argument, for ndtr, or None) and give erfc(sgn * a) for sgn = +-1.0 per value,
# or erf(a) when sgn is None.

def _r1(x, kind, out, w):
    """erf, erfc or ndtr by region 1 at signed float64 x (x is none of w[0:3])."""
    z, num, den = w[0], w[1], w[2]
    np.multiply(x, x, out=z)
    if kind != "ndtr":
        _horner(PP, z, num)
        num /= _horner(QQ, z, den)
        num *= x                                     # e1 = x R(x^2): erf(x) = x + e1
        if kind == "erf":
            np.add(x, num, out=out)
        else:
            np.subtract(1, x, out=out)               # exact for 1/2 <= x <= 1 (Sterbenz)
            out -= num
        return
    # Phi(x) = (1 + erf(y)) / 2 = 1/2 + y/2 + y R(y^2) / 2, y = x / sqrt 2, in terms of x: _NPP and _NQQ are P and
    # Q in x^2 = 2 y^2 (coefficients times 2^-j, exact), with 1/(2 sqrt 2) folded into P. y / 2 = p + rest: x =
    # xh + xl with xh of 26 bits, p = xh * K26 / 2 exact, rest = xh * K_R / 2 + xl * K_HI / 2; 1/2 + p is exact
    # where it cancels (p <= -1/4, Sterbenz).
    _horner(_NPP, z, num)
    num /= _horner(_NQQ, z, den)
    num *= x                                         # y R(y^2) / 2
    xh = _top(x, _TOP26, z)
    np.subtract(x, xh, out=den)
    den *= _K_HI / 2
    num += den
    np.multiply(xh, _K_R / 2, out=den)
    num += den                                       # rest + y R(y^2) / 2
    np.multiply(xh, _K_HI26 / 2, out=out)
    out += 0.5
    out += num


def _unit(x, sign, out):
    """out = 1.0 with the sign of x (sign = 1.0) or the opposite one (sign = -1.0): the sign bit of x, xor the bits
    of sign (copysign costs twice as much)."""
    o = out.view(np.int64)
    np.bitwise_and(x.view(np.int64), _SIGN_BIT, out=o)
    np.bitwise_xor(o, np.array(sign).view(np.int64), out=o)
    return out


def _prep(x, kind, w):
    """(ah, al, sgn) in w[0], w[1], w[2]: a = |x| (ndtr: |x| / sqrt 2 as a normalised double-double) and the sign
    of the argument of erfc (ndtr: Phi(x) = erfc(-x / sqrt 2) / 2), for the finite values of region 2."""
    ah, al, sgn, t = w[0], w[1], w[2], w[3]
    np.abs(x, out=ah)
    if kind != "ndtr":
        return ah, None, (_unit(x, 1.0, sgn) if kind == "erfc" else None)
    xh = _top(ah, _TOP26, al)                        # a = xh + xl, and p = xh * K_HI26 exact
    np.subtract(ah, xh, out=sgn)
    sgn *= _K_HI
    np.multiply(xh, _K_HI_REST, out=t)
    sgn += t
    np.multiply(ah, _K_LO, out=t)
    sgn += t                                         # rest = xh K_HI_REST + xl K_HI + a K_LO
    np.multiply(xh, _K_HI26, out=t)                  # p
    np.add(t, sgn, out=ah)                           # ah = p + rest
    np.subtract(t, ah, out=al)
    al += sgn                                        # al = (p - ah) + rest: Fast2Sum, ah + al = p + rest exactly
    _unit(x, -1.0, sgn)
    return ah, al, sgn


def _r2(ah, al, sgn, out, w):
    s, p, t, sh = w[3], w[4], w[5], w[6]
    np.subtract(ah, 1, out=s)                        # exact (Sterbenz)
    # P(s) = pa1 s + [pa0 + s^2 (pa2 + ...)] holds terms up to 0.1 that Horner would round at each step; with
    # pa1 = PA1_HI + PA1_LO (26 bits + rest) and s = sh + sl (26 bits + rest), PA1_HI * sh is exact and the rest
    # is below 0.03, so P rounds about once.
    _horner(PA[2:], s, p)
    p *= s
    p *= s
    p += PA[0]
    _top(s, _TOP26, sh)
    np.subtract(s, sh, out=t)
    t *= PA1_HI
    p += t
    np.multiply(s, PA1_LO, out=t)
    p += t
    np.multiply(sh, PA1_HI, out=t)
    p += t
    # P / Q = P - P t with t = (Q - 1) / Q < 0.1, so Q's rounding of 1 + (Q - 1) reaches the result only through t
    qm = _horner(QA[1:], s, t)
    qm *= s
    np.add(qm, 1, out=sh)
    qm /= sh
    qm *= p
    p -= qm                                          # erf(a) - erx
    if al is not None:                               # + al * erf'(1 + s), 2/sqrt(pi) exp(-(1+s)^2) to second order
        np.subtract(2, s, out=t)
        t *= s
        np.subtract(1, t, out=t)
        t *= 0.4151074974205947
        t *= al
        p += t
    if sgn is None:
        np.add(p, ERX, out=out)
        return
    np.multiply(sgn, -ERX, out=out)
    out += 1                                         # 1 -+ erx: exact (erx has 24 bits)
    p *= sgn
    out -= p


def _tail(v, kind, r, s_, cap, out, w):
    """erfc or ndtr of the float64 values v by the form of regions 3 and 4 (R/S = r/s_), for both signs of v.

    Phi(-|x|) = erfc(a) / 2 with a = |x| / sqrt 2, and 1/(2a) = 1/(sqrt 2 |x|): fdlibm's form, written in x itself,
        tail(x) = exp(-h x^2 - c + R/S(w)) / |x|,  w = 1/(h x^2) = 1/a^2,  h = 1/2,  c = 0.5625 + ln(2)/2
    (erfc: h = 1, c = 0.5625, and x = a), needs no rounded argument x / sqrt 2. As in fdlibm, x^2 is split: with xh =
    x cut to 21 bits, A = -h xh^2 - c_hi is exact (at most 43 bits; c = c_hi + c_lo, c_hi of 20 fractional bits),
        B = R/S - h (x - xh)(x + xh) - c_lo
    is below 0.3, with an absolute error of ~1e-17 (the roundings of R/S, times |R/S| < 0.22), and where fdlibm
    takes exp(A) exp(B), one exp does: A + B = S + d exactly (S = A + B rounded, d = (A - S) + B: Fast2Sum, as |A| >
    2 > |B|), |d| <= 2^-44 (|S| < 2^10), so exp(A + B) = exp(S)(1 + d) to 2^-88. Then
        tail = E (1 + d) / x = q + (q d + r / x),  E = exp(S),  q = E / x rounded,  r = E - q x,
    where r, the division's rounding, is formed from q = qh + ql (qh: 26 bits): E - qh xh is exact (qh xh has 47
    bits and lies within 2^-20 of E: Sterbenz), and q xl and ql xh, 2^-20 of E, round at 2^-73 of E, so that
    r / x corrects q to a few parts in 10^6 of its own size. What is left is exp's rounding, B's error and the last
    sum's, as in fdlibm's own form: within 2 ulp (tests/test_special.py; largest seen: 1.75 ulp for erfc, 1.88 for
    ndtr, whose final subtraction from 1 adds its own rounding: a thin margin, as fdlibm's own).

    Signs: q, r / x and the sum take the sign of x, so the sum is sgn(x) tail(|x|), and one operation gives
    ndtr(x) = [x > 0] - sgn(x) Phi(-|x|), erfc(x) = 2 [x < 0] + sgn(x) erfc(|x|): rounded once where the tail is the
    result (ndtr(x < 0), erfc(x > 0)), and where it is 1 or 2 minus the tail (< 0.08), a second time 0.04 ulp away.
    cap: |x| is clipped to it first (region 4: the tail underflows to 0 before it; keeps inf out of the split)."""
    h, c_hi, c_lo = (0.5, _C_HI, _C_LO) if kind == "ndtr" else (1.0, 0.5625, 0.0)
    t, b, xh, xl, e, q, u = w[0:7]
    if cap:
        v = np.clip(v, -cap, cap, out=w[7])
    np.multiply(v, v, out=t)
    np.divide(1 / h, t, out=t)                       # w = 1/a^2
    _horner(r, t, b)
    b /= _horner(s_, t, u)                           # R/S
    _top(v, _TOP21, xh)
    np.subtract(v, xh, out=xl)
    np.add(v, xh, out=t)
    t *= xl                                          # x^2 - xh^2, to 2^-70 x^2
    if h != 1:
        t *= h
    b -= t
    if c_lo:
        b -= c_lo                                    # B
    np.multiply(xh, -h, out=u)
    u *= xh
    u -= c_hi                                        # A, exact
    np.add(u, b, out=e)                              # S
    u -= e
    u += b                                           # d = (A - S) + B
    np.exp(e, out=e)                                 # E = exp(S)
    np.divide(e, v, out=q)                           # q = E / x, with the sign of x
    _top(q, _TOP26, t)                               # qh
    np.multiply(t, xh, out=b)
    e -= b                                           # E - qh xh: exact
    np.subtract(q, t, out=t)                         # ql
    t *= xh
    xl *= q
    e -= xl
    e -= t                                           # r = E - q x (to 2^-73 E)
    e /= v                                           # r / x
    u *= q
    u += e
    u += q                                           # sgn(x) tail(|x|)
    if kind == "ndtr":
        np.greater(v, 0, out=t)
        np.subtract(t, u, out=out)
    else:
        np.less(v, 0, out=t)
        t *= 2
        np.add(t, u, out=out)


def _fast(x, kind, region, out, w):
    """The same regions in their plain form, for float32 results (x float64, holding float32 values) and for erf
    beyond region 2: without the steps that only a float64 result needs where the rational term is most of it (the
    double-double argument of ndtr, the exact splits, the division's residual), whose absence leaves errors near
    1e-16 relative, far below float32's 6e-8, and below 0.3 ulp of erf = 1 - erfc when erfc < 0.078."""
    y, a, t, u, half = x, w[0], w[1], w[2], kind == "ndtr"
    if half:                                         # Phi(x) = erfc(-x / sqrt 2) / 2
        y = np.multiply(x, -_K_HI, out=w[3])
        kind = "erfc"
    if region == 0:
        np.multiply(y, y, out=t)
        _horner(PP, t, u)
        u /= _horner(QQ, t, a)
        u *= y                                       # erf(y) = y + u
        if kind == "erf":
            np.add(y, u, out=out)
        else:
            np.subtract(1, y, out=out)
            out -= u
    else:
        np.abs(y, out=a)
        if region == 1:
            np.subtract(a, 1, out=t)
            _horner(PA, t, u)
            u /= _horner(QA, t, a)                   # erf(|y|) - erx
            if kind == "erf":
                np.add(u, ERX, out=out)
                np.copysign(out, y, out=out)
            else:                                    # erfc(y) = (1 -+ erx) -+ u
                np.copysign(1.0, y, out=a)
                np.multiply(a, -ERX, out=out)
                out += 1
                u *= a
                out -= u
        else:
            np.multiply(a, a, out=t)
            np.divide(1, t, out=u)
            _horner(RA if region == 2 else RB, u, w[4])
            w[4] /= _horner(SA if region == 2 else SB, u, w[5])
            np.subtract(w[4], 0.5625, out=u)
            u -= t
            np.exp(u, out=u)
            u /= a                                   # erfc(|y|) = exp(-y^2 - 0.5625 + R/S) / |y|
            if kind == "erf":
                np.subtract(1, u, out=out)
                np.copysign(out, y, out=out)
            else:                                    # erfc(y) = erfc(|y|) or 2 - erfc(|y|)
                np.copysign(1.0, y, out=a)
                np.subtract(1, a, out=out)
                u *= a
                out += u
    if half:
        out *= 0.5


def _region_into(x, kind, region, out, w, fast=False):
    """out = erf, erfc or ndtr of the float64 values x, all of one region (0..3), by that region's formulas; x is
    none of w[0:13]. fast: a float32 result (see _fast)."""
    if fast or (region >= 2 and kind == "erf"):        # erf = +-(1 - erfc(|x|)), erfc(|x|) < 0.078: see _fast
        _fast(x, kind, region, out, w)
    elif region == 0:
        _r1(x, kind, out, w)
    elif region == 1:
        ah, al, sgn = _prep(x, kind, w)
        _r2(ah, al, sgn, out, w)
        if kind == "erf":
            np.copysign(out, x, out=out)             # erf(-x) = -erf(x)
        elif kind == "ndtr":
            out *= 0.5
    else:
        cap = None if region == 2 else (BOUNDS[3] / _K_HI if kind == "ndtr" else BOUNDS[3])
        _tail(x, kind, RA if region == 2 else RB, SA if region == 2 else SB, cap, out, w)


def _real(x, name):
    """x as a native-endian array of float32 or float64 (float16 and ints become float64)."""
    a = np.asarray(x)
    if a.dtype.kind in "biu" or (a.dtype.kind == "f" and a.dtype.itemsize not in (4, 8)):
        return a.astype(np.float64)
    if a.dtype.kind != "f":
        raise ValueError(f"{name}: argument 'x' expected real numbers (a float or integer array), got dtype {a.dtype}")
    return a if a.dtype.isnative else a.astype(a.dtype.newbyteorder("="))


def _chunks(n):
    return ((i, min(i + _CHUNK, n)) for i in range(0, n, _CHUNK))


def _evaluate(x, kind):
    """erf, erfc or ndtr over an array, chunk by chunk. NumPy has no per-value branch: the values of each region
    are found by comparisons and gathered into a batch, the batch runs its region's formula, and the results are
    scattered back. When region 1, the cheapest formula, holds most values (judged on a sample), it runs on whole
    chunks instead, and only the other values are gathered. A formula costs about 50 NumPy calls, so a batch of a
    few values costs as much as one of thousands: batches below _SMALL values wait, and run together at the end."""
    x = _real(x, kind)
    flat = np.ravel(x)
    n = flat.size
    out = np.empty(n, x.dtype)
    m = min(n, _CHUNK)
    ws = np.empty((_ROWS, m))
    fast = x.dtype == np.float32
    scale = _K_HI if kind == "ndtr" else 1.0        # the region is picked on |x| / sqrt 2 for ndtr (to an ulp)
    bounds = [b / scale for b in BOUNDS[:3]]
    sample = np.abs(flat[::max(1, n // 4096)], dtype=np.float64)
    main = np.count_nonzero(sample < bounds[0]) >= 0.7 * sample.size
    # results in order go straight to out; scattered ones go to a buffer first (scattered into fresh output
    # memory, they cost twice as much)
    direct = main and x.dtype == np.float64
    code, flag = np.empty(m, np.int8), np.empty(m, bool)
    waiting = {r: [] for r in range(4)}              # small batches: (values, their positions in flat)

    def run(r, vals):
        """Region r's formula on the float64 values vals (at most m): a view of its results."""
        batch = [row[:vals.size] for row in ws]
        _region_into(vals, kind, r, batch[15], batch, fast)
        return batch[15]

    first = 1 if main else 0                         # the first region that is gathered
    with np.errstate(all="ignore"):                  # junk in the values a formula does not own
        for i, j in _chunks(n):
            c = j - i
            rows = [row[:c] for row in ws]
            xs = flat[i:j] if x.dtype == np.float64 else np.copyto(rows[12], flat[i:j]) or rows[12]
            o = out[i:j] if direct else rows[13]
            a, found = np.abs(xs, out=rows[14]), None
            if main:                                 # the values beyond region 1 (NaN compares False: region 1)
                found = np.flatnonzero(np.greater_equal(a, bounds[0], out=flag[:c]))
                a = np.take(a, found, out=rows[0][:found.size], mode="wrap")
            # k = the region of each value, minus first
            k, f = code[:a.size], flag[:a.size]
            np.greater_equal(a, bounds[first], out=k.view(bool))
            for b in bounds[first + 1:]:
                k += np.greater_equal(a, b, out=f).view(np.int8)
            if main:
                _region_into(xs, kind, 0, o, rows, fast)
            for r in range(first, 4):
                loc = np.flatnonzero(np.equal(k, r - first, out=f))
                if found is not None:
                    loc = found[loc]
                if loc.size >= _SMALL:
                    o[loc] = run(r, np.take(xs, loc, out=ws[14, :loc.size], mode="wrap"))   # (loc is in range)
                elif loc.size:
                    waiting[r].append((xs[loc], loc + i))
            if not direct:
                out[i:j] = o
        for r, parts in waiting.items():
            if parts:
                vals, pos = (np.concatenate([p[e] for p in parts]) for e in (0, 1))
                for s in range(0, vals.size, m):
                    piece = ws[14, :min(m, vals.size - s)]
                    np.copyto(piece, vals[s:s + m])
                    out[pos[s:s + m]] = run(r, piece)
    out = out.reshape(x.shape)
    return out[()] if out.ndim == 0 else out


def erf(x):
    """The error function erf(x) = 2/sqrt(pi) * integral_0^x exp(-t^2) dt, elementwise.

    x: array-like of real numbers   ->   array of x's shape, float32 for float32 input, else float64."""
    return _evaluate(x, "erf")


def erfc(x):
    """The complementary error function erfc(x) = 1 - erf(x), accurate where it is tiny (x up to 27)."""
    return _evaluate(x, "erfc")


def ndtr(x):
    """The standard normal CDF Phi(x) = (1 + erf(x / sqrt 2)) / 2 = erfc(-x / sqrt 2) / 2, with its relative
    accuracy kept in the left tail (down to Phi(-37.5) = 5e-308, the smallest normal float64)."""
    return _evaluate(x, "ndtr")


def expit(x):
    """The logistic sigmoid 1 / (1 + exp(-x)), elementwise, without overflow for large |x|; float32 stays float32
    (and is computed in float32, as scipy does).

    sigmoid(|x|) = 1 / (1 + e) and sigmoid(-|x|) = e / (1 + e), with e = exp(-|x|) in (0, 1]."""
    x = _real(x, "expit")
    flat = np.ravel(x)
    out = np.empty(flat.size, x.dtype)
    e = np.empty(min(flat.size, _CHUNK), x.dtype)
    for i, j in _chunks(flat.size):
        xs, o, ec = flat[i:j], out[i:j], e[:j - i]
        np.abs(xs, out=ec)
        np.negative(ec, out=ec)
        np.exp(ec, out=ec)
        np.add(ec, 1, out=o)
        np.divide(1, o, out=o)                       # sigmoid(|x|)
        ec *= o                                      # sigmoid(-|x|)
        np.copyto(o, ec, where=xs < 0)
    out = out.reshape(x.shape)
    return out[()] if out.ndim == 0 else out


__all__ = ["erf", "erfc", "ndtr", "expit"]
