"""refbert_kernels.dropout: every version against the oracle refbert.ops.dropout_forward / dropout_backward on
hypothesis-drawn shapes and rates, both dtypes: the same elements kept (compared with ==), the same bits out, the
same streams drawn, the oracle's ValueErrors word for word, no aliasing in training, no writes into arguments."""
import re

import numpy as np
import pytest

pytest.importorskip("numba")
from hypothesis import example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from refbert import ops  # noqa: E402
from refbert.philox import DropoutRNG, keep_mask  # noqa: E402
from refbert_kernels import dropout as K  # noqa: E402

VERSIONS = sorted(K.SPEC.versions)


def check_version(v, x, p, train, seed=11, calls=5):
    """Exact agreement (tolerance 0): out = x * keep * scale is one rounding, the oracle's; keep is an integer test."""
    fwd, bwd = K.SPEC.versions[v]
    r_ref, r_k = DropoutRNG(seed, calls), DropoutRNG(seed, calls)
    ref, rc = ops.dropout_forward(x, p, r_ref, train)
    x0 = x.copy()
    out, c = fwd(x, p, r_k, train)
    assert r_k.state == r_ref.state                                   # one stream drawn iff train and p > 0
    assert out.dtype == ref.dtype and out.shape == ref.shape
    np.testing.assert_array_equal(out, ref)
    if train and p > 0:
        keep = keep_mask(seed, calls, x.shape, p)
        fin = np.isfinite(x)                                           # (a dropped inf or NaN gives NaN, as x * 0)
        assert np.array_equal((out != 0)[fin], (keep & (x != 0))[fin])  # the kept elements are exactly the oracle's
        assert not np.shares_memory(out, x)
    else:
        assert out is x                                                # eval / p = 0: x itself, as the oracle
    dout = np.asarray(np.random.default_rng(2).standard_normal(x.shape)).astype(x.dtype)
    d0 = dout.copy()
    dx = bwd(dout, c)
    np.testing.assert_array_equal(dx, ops.dropout_backward(dout, rc))
    assert dx.dtype == x.dtype and not np.shares_memory(dx, dout)
    assert np.array_equal(x, x0) and np.array_equal(dout, d0)


@given(shape=st.lists(st.integers(1, 9), min_size=0, max_size=3), p=st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0, 0.37]),
       train=st.booleans(), dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 2 ** 64 - 1),
       calls=st.integers(0, 2 ** 40))
@example(shape=[1], p=0.1, train=True, dtype=np.float32, seed=0, calls=0)
@example(shape=[3, 37], p=0.5, train=True, dtype=np.float64, seed=2 ** 64 - 1, calls=2 ** 33)  # high words used
@example(shape=[2, 5, 52], p=1.0, train=True, dtype=np.float32, seed=5, calls=1)                 # p = 1 drops all
@example(shape=[4, 4], p=0.5, train=False, dtype=np.float64, seed=5, calls=1)                    # eval
def test_versions_match_oracle(shape, p, train, dtype, seed, calls):
    x = np.asarray(np.random.default_rng(0).standard_normal(shape)).astype(dtype)     # shape [] is a 0-d array
    for v in VERSIONS:
        check_version(v, x, p, train, seed, calls)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_large_chunks_tails_and_strides(dtype):
    """More than one chunk of Philox blocks, a tail of 1-3 elements, a non-contiguous x, inf/NaN inputs."""
    r = np.random.default_rng(3)
    for n in (4 * K.BLOCKS * 3 + 3, 4 * K.BLOCKS + 1, 4 * K.BLOCKS - 2):
        for v in VERSIONS:
            check_version(v, r.standard_normal(n).astype(dtype), 0.3, True)
    x = r.standard_normal((6, 9)).astype(dtype)
    x[1, 2], x[3, 3] = np.inf, np.nan
    for v in VERSIONS:
        check_version(v, x[::2, 1:], 0.5, True)
        check_version(v, np.zeros((0, 3), dtype), 0.5, True)


def test_float32_and_float64_keep_the_same_elements():
    x = np.random.default_rng(4).standard_normal((5, 33))
    for v in VERSIONS:
        fwd = K.SPEC.versions[v][0]
        o64, _ = fwd(x, 0.4, DropoutRNG(9))
        o32, _ = fwd(x.astype(np.float32), 0.4, DropoutRNG(9))
        assert np.array_equal(o64 != 0, o32 != 0)


def _bad_calls():
    x = np.ones(3, np.float32)
    return [
        (x.tolist(), 0.1, DropoutRNG(0), True),
        (np.ones(3, np.int32), 0.1, DropoutRNG(0), True),
        (x, 1.5, DropoutRNG(0), True),
        (x, -0.1, DropoutRNG(0), False),
        (x, float("nan"), DropoutRNG(0), True),
        (x, 0.5, 42, True),
        (x, 0.5, None, True),
        (x, 0.5, np.random.default_rng(0), True),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_value_errors_match_oracle(case):
    with pytest.raises(ValueError) as ref:
        ops.dropout_forward(*_bad_calls()[case])
    for v in VERSIONS:
        with pytest.raises(ValueError, match=re.escape(str(ref.value))):
            K.SPEC.versions[v][0](*_bad_calls()[case])


def test_backward_errors_match_oracle():
    x = np.ones((2, 3))
    for train in (True, False):
        _, rc = ops.dropout_forward(x, 0.5, DropoutRNG(0), train)
        for dout in (np.ones((2, 3), np.float32), np.ones((3, 2)), 1.0):
            with pytest.raises(ValueError) as ref:
                ops.dropout_backward(dout, rc)
            for v in VERSIONS:
                fwd, bwd = K.SPEC.versions[v]
                with pytest.raises(ValueError, match=re.escape(str(ref.value))):
                    bwd(dout, fwd(x, 0.5, DropoutRNG(0), train)[1])


def test_public_names_are_the_best_version():
    assert K.dropout_forward is K.SPEC.versions[max(VERSIONS)][0]
    assert K.dropout_backward is K.SPEC.versions[max(VERSIONS)][1]
