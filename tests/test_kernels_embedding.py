"""refbert_kernels.embedding: every version against the oracle refbert.ops.embedding_forward / _backward on
hypothesis-drawn ids (repeats, a padding row, one row, empty batches), both dtypes: the same rows out and the same
dw bit for bit (the oracle's np.add.at and the Numba scatter add the same numbers in the same order), and the
oracle's ValueErrors word for word."""
import numpy as np
import pytest

pytest.importorskip("numba")
from hypothesis import example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from refbert import ops  # noqa: E402
from refbert_kernels import _pool as P  # noqa: E402
from refbert_kernels import embedding as K  # noqa: E402

VERSIONS = sorted(K.SPEC.versions)


@given(lead=st.lists(st.integers(0, 9), min_size=1, max_size=2), V=st.integers(1, 40), C=st.integers(1, 20),
       pad=st.booleans(), dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 2 ** 16))
@example(lead=[64], V=2, C=7, pad=False, dtype=np.float32, seed=0)       # every id repeated ~32 times
@example(lead=[0], V=3, C=2, pad=True, dtype=np.float64, seed=1)         # no ids: dw = 0
def test_versions_match_oracle_bit_for_bit(lead, V, C, pad, dtype, seed):
    inputs, kw = K.make_inputs(dict(lead=tuple(lead), V=V, C=C, padding_idx=V - 1 if pad else None), dtype, seed)
    ref, rc = ops.embedding_forward(**inputs, **kw)
    dout = np.random.default_rng(seed + 1).standard_normal(ref.shape).astype(dtype)
    d0 = dout.copy()
    ref_dw = ops.embedding_backward(dout, rc)
    for v in VERSIONS:
        fwd, bwd = K.SPEC.versions[v]
        out, c = fwd(**inputs, **kw)
        np.testing.assert_array_equal(out, ref)
        dw = bwd(dout, c)
        assert dw.dtype == ref_dw.dtype and dw.shape == ref_dw.shape
        np.testing.assert_array_equal(dw, ref_dw)
    np.testing.assert_array_equal(dout, d0)


def _message(fn, *args):
    with pytest.raises(ValueError) as e:
        fn(*args)
    return str(e.value)


@pytest.mark.parametrize("v", VERSIONS)
def test_same_value_errors_as_oracle(v):
    fwd, bwd = K.SPEC.versions[v]
    w = np.ones((4, 3))
    for args in [(np.array([0, 4]), w), (np.array([0.0]), w), (np.array([0]), np.ones(3)), (np.array([1]), w, 7)]:
        assert _message(fwd, *args) == _message(ops.embedding_forward, *args)
    _, cache = fwd(np.array([[0, 1]]), w)
    _, rcache = ops.embedding_forward(np.array([[0, 1]]), w)
    assert _message(bwd, np.ones((2, 3)), cache) == _message(ops.embedding_backward, np.ones((2, 3)), rcache)


def test_v2_reuses_a_large_dw_only_once_nobody_holds_it(monkeypatch):
    monkeypatch.setattr(K, "POOL_MIN", 0)                        # every dw "large"
    monkeypatch.setattr(P, "_pool", {})                         # an empty pool for this test
    inputs, kw = K.make_inputs(dict(lead=(3, 5), V=11, C=4, padding_idx=0), np.float32, 1)
    out, cache = K.embedding_forward_v2(**inputs, **kw)
    dout = np.random.default_rng(2).standard_normal(out.shape).astype(np.float32)
    ref = ops.embedding_backward(dout, ops.embedding_forward(**inputs, **kw)[1])
    first = K.embedding_backward_v2(dout, cache)
    first += 7                                                   # a caller may write into its gradient
    second = K.embedding_backward_v2(dout, cache)                # `first` is held: a new array
    assert not np.shares_memory(first, second)
    np.testing.assert_array_equal(second, ref)
    address = second.__array_interface__["data"][0]
    second *= -3.0
    del second
    third = K.embedding_backward_v2(dout, cache)                 # nobody holds the pooled one: zeroed, reused
    assert third.__array_interface__["data"][0] == address
    np.testing.assert_array_equal(third, ref)
