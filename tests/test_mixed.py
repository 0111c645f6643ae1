"""Mixed precision (refbert.ops "mixed precision: the spec", refbert.mixed, refbert.optim.GradScaler): the roundings
bit for bit against independent conversions, each op against the float64 oracle on the same rounded inputs with
its output rounded once, FlashAttention-2's roundings against an independent float64 evaluation of the formula,
the whole model against float64, the numba backend against the numpy one, the loss scaler step for step against
torch's, and the commands."""
import math
import struct

import numpy as np
import pytest

import refbert
from refbert import mixed, ops
from refbert.optim import AdamW, GradScaler

COMPUTE = ("bfloat16", "float16")
ULP1 = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}     # ulp(1): 7 and 10 stored mantissa bits
EMIN = {"bfloat16": -126, "float16": -14}                 # the smallest normal exponent


def ulp(v, compute):
    """The compute dtype's spacing at |v| (float64; subnormal spacing below the normal range)."""
    v = np.abs(np.asarray(v, np.float64))
    e = np.floor(np.log2(np.where(v > 0, v, 1.0)))
    e = np.where(v > 0, np.maximum(e, EMIN[compute]), EMIN[compute])
    return ULP1[compute] * np.exp2(e)


def on_grid(x, compute):
    return np.array_equal(ops.ROUND[compute](x), x, equal_nan=True)


# ----------------------------------------------------------------------------------------------------------------
# the roundings

def patterns():
    """float32 bit patterns: every sign and exponent (subnormals, inf and NaN's exponent included) with the
    mantissas around every rounding decision of bfloat16 (low 16 bits 0x7FFF, 0x8000 = a tie, 0x8001, with the kept
    lowest bit 0 and 1, all ones) and of float16 (the same around bit 13), plus 2^20 random patterns."""
    m = [0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x17FFF, 0x18000, 0x18001, 0x10000, 0x7F8000, 0x7FFFFF, 0x7F7FFF,
         0xFFF, 0x1000, 0x1001, 0x2FFF, 0x3000, 0x3001, 0x7FE000, 0x7FF000, 0x400000, 0x400001]
    sign_exp = np.arange(512, dtype=np.uint32) << np.uint32(23)
    u = (sign_exp[:, None] | np.array(m, np.uint32)[None, :]).ravel()
    rnd = np.random.default_rng(0).integers(0, 2 ** 32, 2 ** 20, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([u, rnd])


def test_round_bfloat16_is_ml_dtypes_bit_for_bit():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = patterns().view(np.float32)
    with np.errstate(invalid="ignore"):                     # (NaN patterns: ml_dtypes warns, then converts)
        want = x.astype(ml_dtypes.bfloat16).astype(np.float32).view(np.uint32)
    got = ops.round_bfloat16(x).view(np.uint32)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(hex(x.view(np.uint32)[i]), hex(got[i]), hex(want[i])) for i in bad[:5]]
    assert (got & 0xFFFF == 0).all()                        # bfloat16 = the upper half of a float32


def test_round_bfloat16_by_hand():
    """The cases the bit trick must get right, from the definition (1 + k 2^-7 spacing above 1)."""
    f = lambda *v: np.array(v, np.float32)  # noqa: E731
    u = 2.0 ** -8                                           # half an ulp of 1
    top = (2 - 2.0 ** -7) * 2.0 ** 127                       # the largest finite bfloat16
    got = ops.round_bfloat16(f(1 + u, 1 + 3 * u, 1 + u * 1.0001, 1 - u / 2, 1 - 3 * u / 4, top * (1 + 2.0 ** -10),
                               top * (1 + 2.0 ** -8), -0.0, 2.0 ** -133, 2.0 ** -134, 3 * 2.0 ** -134, np.inf, -np.inf))
    want = [1.0, 1 + 4 * u, 1 + 2 * u, 1.0, 1 - u, top, np.inf, -0.0, 2.0 ** -133, 0.0, 2.0 ** -132,
            np.inf, -np.inf]
    # ties to even: 1 + u -> 1, 1 + 3u -> 1 + 4u; below 1 the spacing halves (2^-8), so 1 - u/2 is the tie there
    assert got.tolist() == want
    assert np.signbit(got[7])
    nan = ops.round_bfloat16(np.array([0x7F800001, 0xFFFFFFFF], np.uint32).view(np.float32))
    assert nan.view(np.uint32).tolist() == [0x7FC00000, 0xFFC00000]   # quiet NaN, sign kept (never inf)


def test_round_float16_is_correctly_rounded():
    """Against Python's own float -> half packing (struct 'e', round half to even), an independent conversion;
    past 65504 the halfway point 65520 decides between the largest half and inf."""
    x = patterns().view(np.float32)
    x = x[np.isfinite(x)][::7]
    got = ops.round_float16(x)

    def pack(v):
        if abs(v) >= 65520.0:
            return math.copysign(math.inf, v)
        return struct.unpack("<e", struct.pack("<e", v))[0]
    want = np.array([pack(float(v)) for v in x], np.float32)
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, [(float(x[i]), float(got[i]), float(want[i])) for i in bad[:5]]
    assert ops.round_float16(np.array([65519.99, 65520.0, np.nan], np.float32))[:2].tolist() == [65504.0, np.inf]
    assert np.isnan(ops.round_float16(np.array([np.nan], np.float32)))[0]
    # and NumPy's own cast, on every pattern of the sample (NaN: NaN, sign kept)
    x = patterns().view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        cast = x.astype(np.float16).astype(np.float32)
    got = ops.round_float16(x)
    nan = np.isnan(cast)
    assert np.array_equal(got[~nan].view(np.uint32), cast[~nan].view(np.uint32))
    assert np.isnan(got[nan]).all() and np.array_equal(np.signbit(got[nan]), np.signbit(x[nan]))


@pytest.mark.parametrize("compute", COMPUTE)
def test_rounding_is_idempotent_and_keeps_shape(compute):
    x = np.random.default_rng(1).standard_normal((3, 4, 5)).astype(np.float32)[:, ::2]   # non-contiguous
    r = ops.round_compute(x, compute)
    assert r.shape == x.shape and r.dtype == np.float32 and on_grid(r, compute)
    assert np.array_equal(ops.round_compute(r, compute), r)
    assert np.abs(r - x).max() <= 0.5 * ulp(np.abs(x).max(), compute)


def test_rounding_errors():
    with pytest.raises(ValueError, match="round_bfloat16: argument 'x' expected a float32"):
        ops.round_bfloat16(np.ones(3))
    with pytest.raises(ValueError, match="argument 'compute' expected one of bfloat16, float16, got 'int8'"):
        ops.round_compute(np.ones(3, np.float32), "int8")


# ----------------------------------------------------------------------------------------------------------------
# each op: the backend's float32 op on rounded inputs, its output rounded once; parameter gradients float32

def _inputs(op, r):
    """(forward args, kwargs) of an op at small irregular shapes, float32."""
    f = lambda *s, sd=1.0: (r.standard_normal(s) * sd).astype(np.float32)  # noqa: E731
    C = 13
    return {
        "linear": ((f(2, 7, C), f(11, C, sd=0.3), f(11)), {}),
        "layernorm": ((f(5, C, sd=3) + 1, 1 + f(C, sd=0.1), f(C, sd=0.1)), {}),
        "residual_layernorm": ((f(5, C), f(5, C), 1 + f(C, sd=0.1), f(C, sd=0.1)), {}),
        "bias_gelu": ((f(6, C, sd=2), f(C, sd=0.5)), {"approximate": "none"}),
        "gelu": ((f(6, C, sd=2),), {"approximate": "tanh"}),
        "softmax": ((f(2, 3, 9, sd=3),), {"scale": 0.5}),
        "tanh": ((f(4, C),), {}),
        "cross_entropy": ((f(9, 17, sd=3), r.integers(0, 17, 9)), {}),
    }[op]


PARAM_GRADS = {"linear": (1, 2), "layernorm": (1, 2), "residual_layernorm": (2, 3), "bias_gelu": (1,)}


@pytest.mark.parametrize("compute", COMPUTE)
@pytest.mark.parametrize("op", ["linear", "layernorm", "residual_layernorm", "bias_gelu", "gelu", "softmax", "tanh",
                                "cross_entropy"])
def test_each_op_rounds_inputs_and_outputs_once(op, compute):
    """Reference: the float64 oracle on the rounded inputs (and rounded upstream gradient), its result rounded to
    the compute dtype once. The mixed op computes in float32, so it may land one ulp away where the float32 value
    falls within float32 noise of a rounding boundary (1e-5 of the tensor's largest entry: the float32 parity bound
    of the backends); at least 90% of the elements must be exactly the reference (a missed rounding of an input or
    an extra rounding inside moves most of them). Activation outputs and gradients lie on the compute grid;
    parameter gradients are float32 (the masters'), within the float32 bound of the float64 value."""
    R = ops.ROUND[compute]
    args, kw = _inputs(op, np.random.default_rng(3))
    mops = mixed.MixedOps(refbert.model.get_backend("numpy"), compute)
    out, cache = getattr(mops, f"{op}_forward")(*args, **kw)
    r64 = [R(a).astype(np.float64) if isinstance(a, np.ndarray) and a.dtype == np.float32 else a for a in args]
    ref, ref_cache = getattr(ops, f"{op}_forward")(*r64, **kw)
    if op == "cross_entropy":                               # the loss: float32, not rounded
        assert out.dtype == np.float32 and abs(float(out) - float(ref)) <= 1e-6 * abs(float(ref))
        dout = 1.0
    else:
        _close_to_rounded(out, ref, compute, "out")
        dout = R(np.random.default_rng(4).standard_normal(out.shape).astype(np.float32))
    # the upstream gradient as a float32 sum hands it (off the grid: the spec's rule 4 rounds it on entry; the
    # reference reads the rounded one)
    d_in = dout if op == "cross_entropy" else np.random.default_rng(4).standard_normal(out.shape).astype(np.float32)
    assert op == "cross_entropy" or not on_grid(d_in, compute)
    g = getattr(mops, f"{op}_backward")(d_in, cache)
    gref = getattr(ops, f"{op}_backward")(np.float64(dout) if op == "cross_entropy" else dout.astype(np.float64),
                                          ref_cache)
    g, gref = (g, gref) if isinstance(g, tuple) else ((g,), (gref,))
    for i, (a, b) in enumerate(zip(g, gref)):
        assert a.dtype == np.float32
        if i in PARAM_GRADS.get(op, ()):
            assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), (op, i)
            assert not on_grid(a, compute), (op, i)         # a master's gradient is never rounded
        else:
            _close_to_rounded(a, b, compute, f"grad {i}")


@pytest.mark.parametrize("compute", COMPUTE)
def test_regression_targets_are_constants_never_rounded(compute):
    """mse and bce_with_logits read their targets as given (MIXED_CONSTANTS: a target is data, not a compute-dtype
    activation): the loss equals the float32 loss of the rounded predictions against the unrounded targets, bit
    for bit (the same float32 function on the same float32 inputs), and not the one with rounded targets."""
    R = ops.ROUND[compute]
    r = np.random.default_rng(5)
    pred = r.standard_normal((4, 3)).astype(np.float32)
    target = np.full((4, 3), 0.1, np.float32) + r.standard_normal((4, 3)).astype(np.float32) * 0.01
    assert not on_grid(target, compute)
    mops = mixed.MixedOps(refbert.model.get_backend("numpy"), compute)
    for op, t in (("mse", target), ("bce_with_logits", np.clip(target * 5, 0, 1))):
        got = getattr(mops, f"{op}_forward")(pred, t)[0]
        want = getattr(ops, f"{op}_forward")(R(pred), t)[0]
        rounded = getattr(ops, f"{op}_forward")(R(pred), R(t))[0]
        assert got.dtype == np.float32 and got == want and rounded != want, (op, got, want, rounded)


def test_numpy_backend_runs_the_spec_attention_and_says_so():
    """On the numpy backend the attention is the spec's own code (ops.attention_*_mixed, FA2's arithmetic: "spec"),
    every other op the float32 op between roundings ("rounded"); nothing is "own". A float64 q is refused by the
    attention in its own name."""
    mops = mixed.MixedOps(refbert.model.get_backend("numpy"), "bfloat16")
    spec = {"attention_forward", "attention_backward", "attention_probs"}
    assert {n for n, how in mops.how.items() if how == "spec"} == spec
    assert all(how == "rounded" for n, how in mops.how.items() if n not in spec), mops.how
    q = np.zeros((1, 2, 4))
    with pytest.raises(ValueError, match=r"^attention: argument 'q' expected float32 \(mixed precision\), got float64"):
        ops.attention_forward_mixed(q, q, q, 2)


def _close_to_rounded(got, ref64, compute, what):
    want = ops.ROUND[compute](ref64.astype(np.float32))     # (float64 -> float32 -> R: a double rounding only
    assert on_grid(got, compute), what                      # within float32's 2^-24 of a tie, noise here)
    tol = ulp(want, compute) + 1e-5 * np.abs(ref64).max()
    bad = np.abs(got - want) > tol
    assert not bad.any(), (what, got[bad][:3], want[bad][:3])
    assert (got == want).mean() >= 0.9, (what, (got == want).mean())


def test_dropout_is_rounded_where_stored_and_not_inside_the_fused_sum():
    """A standalone dropout writes R(x * keep / (1 - p)) (1/0.9 takes x off the grid); inside
    dropout_residual_layernorm dropout(a) stays float32 (not rounded before the sum): rounding it first gives
    other bits here, so the comparison can tell the two apart."""
    compute = "bfloat16"
    R = ops.ROUND[compute]
    r = np.random.default_rng(5)
    x = R(r.standard_normal((4, 8)).astype(np.float32))
    mops = mixed.MixedOps(refbert.model.get_backend("numpy"), compute)
    out, _ = mops.dropout_forward(x, 0.1, refbert.DropoutRNG(7))
    plain, _ = ops.dropout_forward(x, 0.1, refbert.DropoutRNG(7))
    assert not on_grid(plain, compute) and np.array_equal(out, R(plain))
    a, w, b = (R(v) for v in (r.standard_normal((4, 8)).astype(np.float32), np.ones(8, np.float32),
                              np.zeros(8, np.float32)))
    fused, _ = mops.dropout_residual_layernorm_forward(x, a, w, b, 1e-12, 0.1, refbert.DropoutRNG(7))
    rounded_first = ops.layernorm_forward(x + R(ops.dropout_forward(a, 0.1, refbert.DropoutRNG(7))[0]), w, b)[0]
    want = R(ops.layernorm_forward(x + ops.dropout_forward(a, 0.1, refbert.DropoutRNG(7))[0], w, b)[0])
    assert np.array_equal(fused, want)
    assert not np.array_equal(R(rounded_first), want)                 # (the control: R(dropout(a)) is told apart)


def test_grads_of_tables_cover_every_op():
    from refbert.backends import OPS
    assert set(ops.GRADS_OF) == set(OPS)
    assert set(ops.MIXED_PARAMS) <= set(OPS) and set(ops.MIXED_LOSSES) <= set(OPS)


# ----------------------------------------------------------------------------------------------------------------
# attention: FlashAttention-2's roundings

def fa2_reference(q, k, v, H, mask, keep, p, dout, compute):
    """The formulas of ops.attention_forward_mixed / attention_backward_mixed evaluated in float64, rounding with
    ml_dtypes (bfloat16) or NumPy's float16 at the documented places: an independent evaluation of the spec
    (compute None: no rounding at all)."""
    if compute is None:                         # no rounding: the float64 formulas alone
        R = lambda a: np.asarray(a, np.float64)  # noqa: E731
    else:
        ml_dtypes = pytest.importorskip("ml_dtypes")
        dt = ml_dtypes.bfloat16 if compute == "bfloat16" else np.float16
        R = lambda a: np.asarray(a, np.float64).astype(dt).astype(np.float64)  # noqa: E731
    B, T, C = q.shape
    hs = C // H
    sp = lambda a: R(a).reshape(B, T, H, hs).transpose(0, 2, 1, 3)  # noqa: E731
    qh, kh, vh = sp(q), sp(k), sp(v)
    scale = 1 / math.sqrt(hs)
    s = np.einsum("bhid,bhjd->bhij", qh, kh) * scale + mask
    m = s.max(-1, keepdims=True)
    pt = np.exp(s - m)
    l = pt.sum(-1, keepdims=True)
    o = R(np.einsum("bhij,bhjd->bhid", R(pt) * keep, vh) / l / (1 - p))
    dO = R(dout).reshape(B, T, H, hs).transpose(0, 2, 1, 3)
    P = pt / l
    D = (1 - p) * (dO * o).sum(-1, keepdims=True)
    dP = np.einsum("bhid,bhjd->bhij", dO, vh)
    dS = R(P * (dP * keep - D))
    dv = R(np.einsum("bhij,bhid->bhjd", R(P) * keep, dO) / (1 - p))
    dq = R(np.einsum("bhij,bhjd->bhid", dS, kh) * scale / (1 - p))
    dk = R(np.einsum("bhij,bhid->bhjd", dS, qh) * scale / (1 - p))
    merge = lambda a: a.transpose(0, 2, 1, 3).reshape(B, T, C)  # noqa: E731
    return merge(o), merge(dq), merge(dk), merge(dv)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_flash_attention_2s_backward_is_the_attention_gradient(p):
    """docs/backprop.md's derivation of the mixed attention's backward: FA2's form (D_i = (1 - p) dO_i . O_i,
    dS' = P (keep dP - D), the 1/(1 - p) beside the scale), evaluated in float64 without its roundings, is
    ops.attention_backward's gradient on the same keep-mask (the next Philox stream of the same DropoutRNG), padding
    and a fully padded sequence included: within 1e-12 of each tensor's scale (float64 sums in two orders). (D
    without its (1 - p) fails the p = 0.3 case.)"""
    r = np.random.default_rng(5)
    B, T, H, C = 3, 9, 2, 8
    q, k, v, dout = (r.standard_normal((B, T, C)) for _ in range(4))
    mask = np.zeros((B, 1, 1, T))
    mask[1, ..., 5:] = np.finfo(np.float64).min
    mask[2, ...] = np.finfo(np.float64).min
    out, cache = ops.attention_forward(q, k, v, H, mask, p, refbert.DropoutRNG(3), True)
    keep = ops.dropout_mask(refbert.DropoutRNG(3), (B, H, T, T), p, "attention") if p else np.ones((B, H, T, T))
    want = (out, *ops.attention_backward(dout, cache))
    got = fa2_reference(q, k, v, H, mask, keep, p, dout, None)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert np.abs(a - b).max() <= 1e-12 * np.abs(b).max(), (name, np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("compute", COMPUTE)
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_attention_is_flash_attention_2s_arithmetic(compute, p):
    """Against the float64 evaluation: each output within one ulp plus float32 noise of the terms it sums (a float32
    score or probability within float32 noise of a rounding boundary rounds the other way, moving one term by one
    ulp of it), and at least 90% exactly equal (P or dS left unrounded, or rounded after normalising, changes most
    of them). Padding includes a fully padded sequence: it attends uniformly, as HF's mask gives."""
    r = np.random.default_rng(11)
    B, T, H, C = 3, 11, 2, 12
    q, k, v = (r.standard_normal((B, T, C)).astype(np.float32) for _ in range(3))
    mask = np.zeros((B, 1, 1, T), np.float32)
    mask[1, ..., 7:] = np.finfo(np.float32).min
    mask[2, ...] = np.finfo(np.float32).min
    rng = refbert.DropoutRNG(3)
    out, cache = ops.attention_forward_mixed(q, k, v, H, mask, p, rng, True, compute=compute)
    keep = np.ones((B, H, T, T)) if cache.keep is None else cache.keep
    assert (cache.keep is None) == (p == 0.0)
    dout = r.standard_normal((B, T, C)).astype(np.float32)
    got = (out, *ops.attention_backward_mixed(ops.ROUND[compute](dout), cache))
    want = fa2_reference(q, k, v, H, mask.astype(np.float64), keep, p, dout, compute)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == np.float32 and on_grid(a, compute), name
        tol = ulp(b, compute) + ULP1[compute] * 2.0 ** -8 * np.abs(b).max() + 1e-6 * np.abs(b).max()
        assert (np.abs(a - b) <= tol).all(), (name, np.abs(a - b).max())
        assert (a == b).mean() >= 0.9, (name, (a == b).mean())
    # the same Philox stream as the float32 attention's dropout: a mixed and a float32 model drop the same units
    _, c32 = ops.attention_forward(q, k, v, H, mask, p, refbert.DropoutRNG(3), True)
    assert (c32.dropout.keep is None) == (p == 0.0)
    if p:
        assert np.array_equal(c32.dropout.keep, cache.keep)
    pr = ops.attention_probs_mixed(cache)
    assert np.allclose(pr, ops.attention_probs(c32), atol=2 * ULP1[compute] / (1 - p))
    assert np.allclose(pr[2], 1.0 / T * keep[2] / (1 - p), atol=ULP1[compute])   # the empty row: uniform


def one_pass_flash(q, k, v, H, mask, compute, tile=64):
    """A one-pass flash forward (p = 0): key tiles of `tile`, a running max m', R(exp(s - m')) as the P V operand,
    the accumulator and l rescaled by exp(m'_old - m'_new) when the max grows. The spec (ops.attention_forward_mixed)
    rounds exp(s - m) with the row's final max instead: the two differ wherever a later tile raised the max."""
    R = ops.ROUND[compute]
    B, T, C = q.shape
    hs = C // H
    heads = lambda a: R(a).reshape(B, T, H, hs).transpose(0, 2, 1, 3)  # noqa: E731
    qh, kh, vh = heads(q), heads(k), heads(v)
    s = (qh @ kh.transpose(0, 1, 3, 2)) * np.float32(1.0 / math.sqrt(hs)) + mask
    m = np.full((B, H, T, 1), -np.inf, np.float32)
    l, acc = np.zeros((B, H, T, 1), np.float32), np.zeros((B, H, T, hs), np.float32)
    for j in range(0, T, tile):
        st = s[..., j:j + tile]
        mn = np.maximum(m, st.max(-1, keepdims=True))
        alpha = np.exp(m - mn)
        pt = np.exp(st - mn)
        l = l * alpha + pt.sum(-1, keepdims=True)
        acc = acc * alpha + R(pt) @ vh[:, :, j:j + tile]
        m = mn
    return R(acc * (np.float32(1.0) / l)).transpose(0, 2, 1, 3).reshape(B, T, C)


@pytest.mark.parametrize("compute", COMPUTE)
def test_the_s3_bound_tells_the_spec_from_a_one_pass_flash(compute):
    """tests/test_cuda_mixed.py bounds the share of S3's elements that differ from the spec at all by 3% (float32
    noise moves a value across a rounding boundary now and then). That bound has power: on S3's own shape with
    three key tiles (T = 130), a one-pass flash (rounding exp(s - running max)) differs from the spec in many more
    of the forward's outputs; with one key tile it is the spec, up to float32 sum order (the control)."""
    r = np.random.default_rng(0)
    for T, far in ((130, True), (37, False)):
        q, k, v = (ops.round_compute(r.standard_normal((2, T, 64)).astype(np.float32), compute) for _ in range(3))
        mask = np.zeros((2, 1, 1, T), np.float32)
        mask[-1, ..., T // 2:] = np.finfo(np.float32).min
        ref, _ = ops.attention_forward_mixed(q, k, v, 1, mask, 0.0, None, True, compute)
        frac = float((one_pass_flash(q, k, v, 1, mask, compute) != ref).mean())
        assert (frac > 0.03) if far else (frac <= 0.03), (compute, T, frac)


# ----------------------------------------------------------------------------------------------------------------
# the whole model

CFG = dict(vocab_size=61, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
           max_position_embeddings=32)


def batch(B=3, T=10, V=61, seed=0):
    r = np.random.default_rng(seed)
    ids = r.integers(5, V, (B, T))
    am = np.ones((B, T), np.int64)
    am[1, 6:] = 0
    tt = np.zeros((B, T), np.int64)
    tt[:, 5:] = 1
    labels = np.where(r.random((B, T)) < 0.3, ids, -100)
    labels[0, 1] = ids[0, 1]
    return dict(input_ids=ids, attention_mask=am, token_type_ids=tt, labels=labels,
                next_sentence_label=r.integers(0, 2, B))


def run(precision, dtype=np.float32, backend="numpy", train=False, dloss=1.0, seed=0, params=None):
    cfg = refbert.BertConfig(**CFG)
    m = refbert.BertForPreTraining(cfg, seed=seed, dtype=dtype, backend=backend, precision=precision).train(train)
    if params is not None:
        for k in m.params:
            m.params[k][...] = params[k]
    m.dropout_rng = refbert.DropoutRNG(5)
    o = m(**batch(), output_hidden_states=True)
    return m, o, m.backward(dloss)


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_model_against_float64(precision):
    """The mixed model on float32 masters that hold the float64 model's values: its loss within 1 u of float64's
    (u = 2^-8 in bfloat16, 2^-11 in float16: half an ulp of 1; the loss averages well-conditioned terms, each moved
    by a few roundings of its logits: measured 0.01-0.02 u), each gradient within 8 u of its tensor's scale (the
    largest entry, floored at 1% of the model's largest gradient, as refbert verify judges a cancelling gradient):
    two layers of ~10 roundings in sequence, measured at most 2.3 u (bf16) and 2.7 u (fp16). Hidden states and
    logits lie on the compute grid, the loss and every gradient are float32, and the gradients are not those of the
    float32 model (which are within 2e-5: the mixed error is measured, not the float32 one)."""
    compute = mixed.PRECISIONS[precision]
    u = ULP1[compute] / 2
    m64, o64, g64 = run("fp32", np.float64)
    _, o32, g32 = run("fp32", params=m64.params)
    m, o, g = run(precision, params=m64.params)
    assert m.precision == precision and m.ops.compute == compute
    assert abs(float(o.loss) - float(o64.loss)) <= u * float(o64.loss)
    assert o.loss.dtype == np.float32 and not on_grid(np.asarray(o.loss), compute)
    assert all(on_grid(h, compute) for h in (*o.hidden_states, o.prediction_logits, o.seq_relationship_logits))
    floor = 0.01 * max(np.abs(v).max() for v in g64.values())
    worst32 = worst = 0.0
    for k in g64:
        scale = max(np.abs(g64[k]).max(), floor)
        err = np.abs(g[k] - g64[k]).max() / scale
        worst32 = max(worst32, np.abs(g32[k] - g64[k]).max() / scale)
        worst = max(worst, err)
        assert g[k].dtype == np.float32 and err <= 8 * u, (k, err / u)
    assert worst32 <= 2e-5 < worst


def test_precision_argument_everywhere(tmp_path):
    cfg = refbert.BertConfig(**CFG)
    for cls in (refbert.BertModel, refbert.BertForPreTraining, refbert.BertForMaskedLM,
                refbert.BertForNextSentencePrediction, refbert.BertForSequenceClassification,
                refbert.BertForTokenClassification, refbert.BertForQuestionAnswering, refbert.BertForMultipleChoice):
        m = cls(cfg, precision="bf16-mixed")
        assert m.precision == "bf16-mixed" and isinstance(m.ops, mixed.MixedOps)
    m = refbert.BertModel(cfg, precision="fp16-mixed")
    m.save_pretrained(tmp_path / "m")
    back = refbert.BertModel.from_pretrained(tmp_path / "m", precision="bf16-mixed")
    assert back.precision == "bf16-mixed" and back.ops.compute == "bfloat16"
    back.precision = "fp32"                                  # switching back unwraps the backend
    assert not isinstance(back.ops, mixed.MixedOps) and back.ops is refbert.model.get_backend("numpy")
    with pytest.raises(ValueError, match=r"BertModel: argument 'precision' expected one of 'fp32', 'bf16-mixed', "
                                         r"'fp16-mixed', got 'bf16'"):
        refbert.BertModel(cfg, precision="bf16")
    with pytest.raises(ValueError, match="'bf16-mixed' expected dtype float32 \\(the masters\\), got dtype float64"):
        refbert.BertModel(cfg, dtype=np.float64, precision="bf16-mixed")
    with pytest.raises(ValueError, match="BertModel.from_pretrained: argument 'precision'"):
        refbert.BertModel.from_pretrained(tmp_path / "nowhere", precision="half")


def test_fp32_precision_is_the_float32_model():
    m = refbert.BertForPreTraining(refbert.BertConfig(**CFG))
    assert m.precision == "fp32" and m.ops is refbert.model.get_backend("numpy")


def test_a_power_of_two_loss_scale_scales_every_bfloat16_gradient_exactly():
    """dloss = 2^k multiplies every gradient by 2^k exactly: scaling by a power of two commutes with rounding
    (bfloat16 has float32's exponent range: no overflow or underflow at 2^10). So the scale reaches every gradient,
    the loss is unscaled, and nothing rounds dloss."""
    m64, _, _ = run("fp32", np.float64)
    _, o1, g1 = run("bf16-mixed", params=m64.params)
    _, o2, g2 = run("bf16-mixed", params=m64.params, dloss=2.0 ** 10)
    assert float(o1.loss) == float(o2.loss)
    assert all(np.array_equal(g2[k], g1[k] * 2.0 ** 10) for k in g1)


def test_fp16_overflow_is_found_and_the_step_skipped():
    """In float16 a loss scale of 2^40 overflows the activation gradients (65504 at most): inf / NaN reach the
    float32 gradients, the scaler finds them, skips AdamW and halves its scale; the parameters are untouched."""
    m, _, _ = run("fp16-mixed")
    before = {k: v.copy() for k, v in m.params.items()}
    m(**batch())
    scaler = GradScaler(init_scale=2.0 ** 40)
    grads = m.backward(scaler.get_scale())
    assert scaler.unscale_(grads) is True
    assert scaler.step(AdamW(m.parameters()), grads, lr=1e-3) is False
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 39 and all(np.array_equal(before[k], m.params[k]) for k in before)


def test_numba_backend_gives_the_numpy_spec():
    """The numba kernels wrapped by the same rule, against the numpy backend (the spec), train mode with dropout:
    the same roundings at the same places, so the two differ only where a float32 value lies within float32
    accumulation noise of a rounding boundary: the loss within float32 rounding (measured: equal in bf16, one
    float32 ulp apart in fp16), every gradient within a quarter of the spec's own error against float64 (a missing
    rounding is as large as that error, so it fails) and within one ulp of the compute dtype at its tensor's scale.
    How close depends on whether a boundary is met, which depends on the CPU (Numba's vector width and its sums'
    order): on an AVX-512 machine at most 2e-4 of the spec's error; on this project's AVX2 (Zen 3) machine one
    float16 rounding in layer 0's feed-forward lands the other way, and that layer's gradients move by up to 0.083
    of it (0.125 ulp of the tensor's scale; bf16: 3.5e-5). A quarter leaves three times that."""
    pytest.importorskip("numba")
    for precision in ("bf16-mixed", "fp16-mixed"):
        compute = mixed.PRECISIONS[precision]
        m64, _, g64 = run("fp32", np.float64, train=True)
        _, o_np, g_np = run(precision, train=True, params=m64.params)
        mb, o_nb, g_nb = run(precision, backend="numba", train=True, params=m64.params)
        assert mb.ops.how["layernorm_forward"] == "rounded" and mb.ops.how["attention_forward"] == "spec"
        assert abs(float(o_nb.loss) - float(o_np.loss)) <= 1e-5 * float(o_np.loss)
        floor = 0.01 * max(np.abs(v).max() for v in g64.values())
        for k in g64:
            scale = max(np.abs(g64[k]).max(), floor)
            spec_err = np.abs(g_np[k] - g64[k]).max()
            diff = np.abs(g_nb[k] - g_np[k]).max()
            assert diff <= max(0.25 * spec_err, 1e-6 * scale) and diff <= ulp(scale, compute), (precision, k)


# ----------------------------------------------------------------------------------------------------------------
# the loss scaler: torch's state machine step for step

def test_grad_scaler_follows_torch_step_for_step(torch):
    """A scripted run of finite and overflowing steps through torch.amp.GradScaler("cpu") and refbert's, with a
    growth interval of 3 so that growth happens: after every step the same scale, growth tracker, skip decision,
    unscaled gradients and parameters (SGD-like AdamW stand-in: torch's own SGD on torch's side, the same update
    written out on ours)."""
    script = ["ok", "ok", "ok", "inf", "ok", "nan", "ok", "ok", "ok", "ok", "ok", "ok", "inf", "inf", "ok"]
    kw = dict(init_scale=2.0 ** 10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    ts = torch.amp.GradScaler("cpu", **kw)
    ours = GradScaler(**kw)
    tp = torch.nn.Parameter(torch.ones(4))
    topt = torch.optim.SGD([tp], lr=0.1)
    p = {"w": np.ones(4, np.float32)}

    class SGD:
        def step(self, grads, lr=None):
            p["w"] -= np.float32(0.1) * grads["w"]
    r = np.random.default_rng(0)
    for i, what in enumerate(script):
        g = r.standard_normal(4).astype(np.float32)
        before = p["w"].copy()
        if what != "ok":
            g[i % 4] = np.inf if what == "inf" else np.nan
        ts.scale(torch.ones(()))                             # (torch creates its scale tensor lazily here)
        with torch.no_grad():
            tp.copy_(torch.from_numpy(p["w"]))               # the same parameters before every step
        scaled = g * np.float32(ours.get_scale())
        assert ours.get_scale() == ts.get_scale()
        tp.grad = torch.from_numpy(scaled.copy())
        ts.unscale_(topt)
        grads = {"w": scaled.copy()}
        found = ours.unscale_(grads)
        assert found == (what != "ok")
        assert np.array_equal(grads["w"], tp.grad.numpy(), equal_nan=True)
        ts.step(topt)
        assert ours.step(SGD(), grads) == (what == "ok")
        ts.update()
        ours.update()
        # (torch's SGD may fuse p - lr g into one rounding: equal to a float32 ulp)
        assert np.allclose(p["w"], tp.detach().numpy(), rtol=2 ** -23, atol=0), i
        assert np.array_equal(p["w"], before) == (what != "ok"), i
        assert ours.get_scale() == ts.get_scale() and ours.state_dict() == ts.state_dict(), (i, ts.state_dict())
    assert ours.get_scale() != kw["init_scale"]             # the script moved the scale both ways


def test_grad_scaler_defaults_state_and_errors():
    s = GradScaler()
    assert (s.get_scale(), s.growth_factor, s.backoff_factor, s.growth_interval) == (65536.0, 2.0, 0.5, 2000)
    for _ in range(1999):
        s.unscale_({"w": np.ones(2, np.float32)})
        s.update()
    assert s.get_scale() == 65536.0 and s.state_dict()["_growth_tracker"] == 1999
    s.unscale_({"w": np.ones(2, np.float32)})
    s.update()
    assert s.get_scale() == 131072.0 and s.state_dict()["_growth_tracker"] == 0
    t = GradScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    off = GradScaler(enabled=False)
    g = {"w": np.array([np.nan], np.float32)}
    assert off.get_scale() == 1.0 and off.unscale_(g) is False and off.state_dict() == {}
    with pytest.raises(ValueError, match="expected one call per step, got a second before update"):
        s.unscale_({"w": np.ones(1, np.float32)})
        s.unscale_({"w": np.ones(1, np.float32)})
    with pytest.raises(ValueError, match="GradScaler: argument 'backoff_factor' expected a finite number in \\(0.0, "
                                         "1.0\\), got 1.5"):
        GradScaler(backoff_factor=1.5)
    with pytest.raises(ValueError, match="GradScaler.load_state_dict: argument 'state' expected a dict with keys"):
        GradScaler().load_state_dict({"scale": 2.0})


# ----------------------------------------------------------------------------------------------------------------
# the precision study's training step (refbert check --precision)

def test_precision_study_of_the_mixed_step(tmp_path, capsys):
    """`refbert check --precision`'s step section at the tiny size, through the command's main (the op table
    limited to one op): refbert's spec in both precisions within 8 u of float64 on every gradient at its tensor's
    scale and within 1 u on the loss (measured: at most 3.4 u and 0.05 u), float32 within 1e-5; the report file
    and the JSON hold the same study; HF + PyTorch autocast beside it where torch runs it."""
    from refbert import precision as P
    report, js = tmp_path / "precision.md", tmp_path / "p.json"
    assert P.main(["--size", "tiny", "--dtypes", "float16", "--ops", "softmax", "--report", str(report),
                   "--json", str(js)]) == 0
    out = capsys.readouterr().out
    text = report.read_text()
    assert "mixed-precision training step" in out and "refbert bf16-mixed" in text and "gradients: worst" in text
    step = __import__("json").loads(js.read_text())["step"]
    assert len(step["tensors"]) == len(refbert.model.parameter_shapes(refbert.BertConfig.preset("tiny"),
                                                                       "BertForPreTraining"))
    for run, u in (("refbert bf16-mixed", 2.0 ** -8), ("refbert fp16-mixed", 2.0 ** -11), ("refbert float32", None)):
        errs = [t["errs"][run] for t in step["tensors"]]
        bound = 1e-5 if u is None else 8 * u
        assert max(errs) <= bound and step["loss"][run][1] <= (1e-6 if u is None else u), run
    torch_ran = [r for r in step["loss"] if r.startswith("HF")]
    assert len(torch_ran) + len(step["notes"]) == 2
    for r in torch_ran:
        assert all(t["errs"][r] is not None and t["errs"][r] <= 8 * P._u(r) for t in step["tensors"] if r in t["errs"])


def test_a_backend_plugs_in_its_own_16_bit_ops():
    """A module's `<name>_mixed` is called instead of the rounding around its float32 op (how a GPU backend's
    16-bit kernels will plug in); a device backend without them is refused by name, never run unrounded."""
    import types

    from refbert.backends import Backend
    calls = []
    mod = types.ModuleType("my16")

    def attention_forward_mixed(*args, compute, **kw):
        calls.append(compute)
        return ops.attention_forward_mixed(*args, compute=compute, **kw)
    mod.attention_forward_mixed = attention_forward_mixed
    m = refbert.BertForPreTraining(refbert.BertConfig(**CFG), backend=mod, precision="fp16-mixed")
    assert m.ops.how["attention_forward"] == "own" and m.ops.how["attention_backward"] == "spec"
    assert "the backend's 16-bit ops: attention" in m.ops.describe()
    m(**batch())
    assert calls == ["float16"] * CFG["num_hidden_layers"]
    dev = types.ModuleType("mydevice")
    dev.ARRAY_LIBRARY, dev.to_device = "torch", (lambda a: a)
    with pytest.raises(ValueError, match=r"keeps its arrays on a device \(torch\); expected its own rounding "
                                         r"\(round_compute\(x, compute\)\) or its own 16-bit ops \(<name>_mixed\) "
                                         r"for every op, got neither for add, attention"):
        mixed.MixedOps(Backend(dev), "bfloat16")
    # with its own rounding the rule runs around a backend's float32 ops (here NumPy's arrays), rounding with it,
    # and skipping an input that one of its ops wrote (marked): R is idempotent
    seen = []

    def round_compute(x, compute):
        seen.append(compute)
        return ops.round_compute(x, compute)
    dev.round_compute = round_compute
    mixed.MixedOps(Backend(dev), "bfloat16")            # no error now: it rounds its own arrays
    own = types.ModuleType("myrounding")
    own.round_compute = round_compute
    mo = mixed.MixedOps(Backend(own), "bfloat16")
    assert mo.how["gelu_forward"] == "rounded"
    x = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4)
    out, _ = mo.gelu_forward(x)
    assert seen == ["bfloat16", "bfloat16"] and np.array_equal(ops.round_compute(out, "bfloat16"), out)
    out2, _ = mo.gelu_forward(out)                      # out is marked: only the output is rounded
    assert len(seen) == 3 and mixed.on_grid(out2, "bfloat16") and not mixed.on_grid(x, "bfloat16")
