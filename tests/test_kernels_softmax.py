"""refbert_kernels.softmax: every version against the oracle refbert.ops.softmax_forward / softmax_backward on
hypothesis-drawn shapes (odd T, T = 1, B = 1, a padded row with one real token, masks None / (B,1,1,T) / full),
both dtypes; the oracle's ValueErrors, word for word; no aliasing, no writes into arguments."""
import re

import numpy as np
import pytest

pytest.importorskip("numba")
from hypothesis import example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from refbert import ops  # noqa: E402
from refbert_kernels import softmax as K  # noqa: E402
from refbert_kernels._harness import compare  # noqa: E402

VERSIONS = sorted(K.SPEC.versions)


def check_version(v, x, scale, mask):
    """Forward and backward of version v against the oracle, within the spec's tolerance: |got - ref| <= atol +
    rtol |ref| (float64: summation order only; float32: polynomial exp <= 1 ulp and float32 sums in another order)."""
    fwd, bwd = K.SPEC.versions[v]
    atol, rtol = K.SPEC.tol[x.dtype.type]
    ref, rc = ops.softmax_forward(x, scale, mask)
    x0 = x.copy()
    p, c = fwd(x, scale, mask)
    assert compare(f"v{v} p", p, ref, atol, rtol) <= 1
    dout = np.random.default_rng(1).standard_normal(x.shape).astype(x.dtype)
    d0 = dout.copy()
    dx = bwd(dout, c)
    assert compare(f"v{v} dx", dx, ops.softmax_backward(dout, rc), atol, rtol) <= 1
    assert np.array_equal(x, x0) and np.array_equal(dout, d0)            # arguments untouched
    assert not np.shares_memory(p, x) and not np.shares_memory(dx, dout) and not np.shares_memory(dx, p)


def make(B, H, T, kind, dtype, seed):
    return K.make_inputs(dict(B=B, H=H, T=T, mask=kind), dtype, seed)[0]


@given(B=st.integers(1, 3), H=st.integers(1, 4), T=st.integers(1, 70), kind=st.sampled_from([None, "pad", "one",
       "full"]), scale=st.sampled_from([1.0, 0.125, 0.37]), dtype=st.sampled_from([np.float32, np.float64]),
       seed=st.integers(0, 2 ** 16))
@example(B=1, H=1, T=1, kind=None, scale=1.0, dtype=np.float32, seed=0)         # T = 1, B = 1
@example(B=1, H=1, T=1, kind="pad", scale=0.125, dtype=np.float64, seed=0)
@example(B=2, H=3, T=37, kind="one", scale=0.125, dtype=np.float32, seed=1)     # row 0: one real token, rest -inf
@example(B=2, H=5, T=52, kind="full", scale=0.125, dtype=np.float64, seed=2)
def test_versions_match_oracle(B, H, T, kind, scale, dtype, seed):
    inp = make(B, H, T, kind, dtype, seed)
    for v in VERSIONS:
        check_version(v, inp["x"], scale, inp["mask"])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mask_shapes_broadcast(dtype):
    """Masks of every broadcastable layout: (T,), (B, 1, T, 1)-style columns, x's full shape, and a 1-d x."""
    r = np.random.default_rng(0)
    x = r.standard_normal((2, 3, 5, 7)).astype(dtype)
    big = np.finfo(dtype).min       # HF's padding value: a (B, 1, T, 1) mask pads whole rows, whose p is uniform
    masks = [None, r.standard_normal(7).astype(dtype),
             np.where(r.random((2, 1, 5, 1)) < .3, -1e9, 0).astype(dtype),
             np.where(r.random((2, 1, 5, 1)) < .5, big, 0).astype(dtype),
             r.standard_normal((3, 1, 7)).astype(dtype), r.standard_normal(x.shape).astype(dtype),
             np.asfortranarray(r.standard_normal((5, 7)).astype(dtype))]
    for mask in masks:
        for v in VERSIONS:
            check_version(v, x, 0.5, mask)
    for v in VERSIONS:                                # 1-d scores, and a non-contiguous x
        check_version(v, x[0, 0, 0], 1.0, None)
        check_version(v, x[:, ::2, :, 1:], 0.5, masks[1][1:])
        check_version(v, x, 0.125, np.full((2, 1, 1, 7), big, dtype))


def _bad_inputs():
    F = lambda s, dt=np.float32: np.zeros(s, dt)  # noqa: E731
    nan = np.zeros((2, 3), np.float32)
    nan[1, 1] = np.nan
    inf = np.zeros((2, 3))
    inf[0, 2] = np.inf
    return [
        (F((2, 3)).tolist(), 1.0, None),                          # not an array
        (F((2, 3), np.int64), 1.0, None),                         # not a float
        (F((2, 3)), 1.0, F((2, 3), np.float64)),                  # mask dtype differs
        (np.zeros((), np.float32), 1.0, None),                    # 0-d x
        (F((2, 3, 4)), 1.0, F((2, 3))),                           # mask does not broadcast
        (F((2, 4)), 1.0, F((3, 1, 4))),                           # mask would enlarge x
        (F((1, 2)), 1.0, np.full((1, 2), -np.inf, np.float32)),   # a row entirely -inf
        (nan, 1.0, None),                                         # a NaN score
        (inf, 1.0, None),                                         # a +inf score
        (F((3, 0)), 1.0, None),                                   # T = 0: nothing to normalise over
    ]


@pytest.mark.parametrize("case", range(len(_bad_inputs())))
def test_value_errors_match_oracle(case):
    x, scale, mask = _bad_inputs()[case]
    with pytest.raises(ValueError) as ref:
        ops.softmax_forward(x, scale, mask)
    for v in VERSIONS:
        with pytest.raises(ValueError, match=re.escape(str(ref.value))):
            K.SPEC.versions[v][0](x, scale, mask)


def test_backward_errors_match_oracle():
    x = np.zeros((2, 3), np.float32)
    _, rc = ops.softmax_forward(x)
    for dout in (np.zeros((2, 3)), np.zeros((3, 2), np.float32), [[0.0] * 3] * 2):
        with pytest.raises(ValueError) as ref:
            ops.softmax_backward(dout, rc)
        for v in VERSIONS:
            fwd, bwd = K.SPEC.versions[v]
            with pytest.raises(ValueError, match=re.escape(str(ref.value))):
                bwd(dout, fwd(x)[1])


def test_empty_and_float64_scale_follow_the_oracle():
    """An empty input, and a float32 x with an np.float64 scale: float32 out (the scale is taken as a Python float,
    which NumPy's promotion does not let widen x), as the oracle."""
    for x, scale in ((np.zeros((0, 4), np.float32), 1.0), (np.ones((2, 3), np.float32), np.float64(0.5))):
        ref, rc = ops.softmax_forward(x, scale)
        assert ref.dtype == np.float32
        for v in VERSIONS:
            fwd, bwd = K.SPEC.versions[v]
            p, c = fwd(x, scale)
            assert p.dtype == ref.dtype and p.shape == ref.shape
            assert bwd(np.ones_like(p), c).dtype == ops.softmax_backward(np.ones_like(ref), rc).dtype


def test_public_names_are_the_best_version():
    assert K.softmax_forward is K.SPEC.versions[max(VERSIONS)][0]
    assert K.softmax_backward is K.SPEC.versions[max(VERSIONS)][1]


def test_one_compiled_kernel_per_dtype_whatever_the_mask():
    """A read-only and a writable mask are two Numba argument types (two compiles of each kernel, a cold cache's
    seconds each); the mask rows and the row index reach the kernels read-only whatever the user passed: one
    float64 signature per forward kernel."""
    r = np.random.default_rng(0)
    x = r.standard_normal((2, 2, 5, 5))
    pad = np.zeros((2, 1, 1, 5))
    full = r.standard_normal((2, 2, 5, 5))
    full_ro = full.copy()
    full_ro.flags.writeable = False
    for v in VERSIONS:
        fwd, bwd = K.SPEC.versions[v]
        for mask in (None, pad, full, full_ro, np.broadcast_to(pad, x.shape)):
            p, cache = fwd(x, 1.0, mask)
            bwd(np.ones_like(p), cache)
    kernels = [K._forward_v1, K._forward_v2, K._forward_v3]
    for f in kernels:
        f64 = [s for s in f.signatures if "float64" in str(s[0])]
        assert len(f64) == 1, (f.py_func.__name__, [str(s) for s in f64])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_masked_scores_get_exactly_zero_probability(dtype):
    """A key masked by -inf or by HF's finfo.min has p exactly 0 in every version, as in the oracle (exp of
    -inf or of ~finfo.min is 0): not the smallest normal number that a clamped exp would give."""
    r = np.random.default_rng(7)
    x = (3 * r.standard_normal((2, 3, 5, 70))).astype(dtype)
    for big in (-np.inf, np.finfo(dtype).min):
        mask = np.zeros((2, 1, 1, 70), dtype)
        mask[0, ..., 40:] = big
        mask[1, ..., 1:] = big
        ref, _ = ops.softmax_forward(x, 0.125, mask)
        masked = np.broadcast_to(mask == big, x.shape)
        assert (ref[masked] == 0).all()
        for v in VERSIONS:
            p, _ = K.SPEC.versions[v][0](x, 0.125, mask)
            assert (p[masked] == 0).all(), (v, big, p[masked].max())
