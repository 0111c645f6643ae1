"""refbert_kernels.linear: every version against the oracle refbert.ops.linear_forward / linear_backward on
hypothesis-drawn shapes (one row, odd widths, no bias, rows the decoder's size), both dtypes: the same bits out and
the same gradients (the GEMM is NumPy's and the bias one rounded addition per entry, as the oracle's), the oracle's
ValueErrors word for word, and no writes into the arguments."""
import numpy as np
import pytest

pytest.importorskip("numba")
from hypothesis import example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from refbert import ops  # noqa: E402
from refbert_kernels import _pool as P  # noqa: E402
from refbert_kernels import linear as K  # noqa: E402

VERSIONS = sorted(K.SPEC.versions)


@given(lead=st.lists(st.integers(1, 9), min_size=1, max_size=3), c_in=st.integers(1, 40), c_out=st.integers(1, 70),
       bias=st.booleans(), dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 2 ** 16))
@example(lead=[1], c_in=1, c_out=1, bias=True, dtype=np.float32, seed=0)
@example(lead=[3, 17], c_in=8, c_out=1031, bias=True, dtype=np.float32, seed=1)    # rows over several prange chunks
def test_versions_match_oracle_bit_for_bit(lead, c_in, c_out, bias, dtype, seed):
    inputs, _ = K.make_inputs(dict(lead=tuple(lead), C_in=c_in, C_out=c_out, bias=bias), dtype, seed)
    before = {k: None if v is None else v.copy() for k, v in inputs.items()}
    ref, rc = ops.linear_forward(**inputs)
    dout = np.random.default_rng(seed + 1).standard_normal(ref.shape).astype(dtype)
    dout[..., :1, :] = 0                                         # a row of zeros: the oracle skips such rows
    ref_grads = ops.linear_backward(dout, rc)
    for v in VERSIONS:
        fwd, bwd = K.SPEC.versions[v]
        out, c = fwd(**inputs)
        assert out.dtype == ref.dtype and out.shape == ref.shape
        np.testing.assert_array_equal(out, ref)
        grads = bwd(dout, c)
        assert len(grads) == len(ref_grads)
        for g, r in zip(grads, ref_grads):
            assert g.dtype == r.dtype
            np.testing.assert_array_equal(g, r)
    for k, v in inputs.items():
        assert (v is None and before[k] is None) or np.array_equal(v, before[k]), k


def _message(fn, *args):
    with pytest.raises(ValueError) as e:
        fn(*args)
    return str(e.value)


@pytest.mark.parametrize("v", VERSIONS)
def test_same_value_errors_as_oracle(v):
    fwd, bwd = K.SPEC.versions[v]
    x, w, b = np.ones((2, 3)), np.ones((4, 3)), np.ones(4)
    cases = [(x.astype(int), w, b), (np.ones(()), w, b), (x, np.ones((4, 2)), b), (x, w, np.ones(3)),
             (x, w.astype(np.float32), b)]
    for args in cases:
        assert _message(fwd, *args) == _message(ops.linear_forward, *args)
    _, cache = fwd(x, w, b)
    _, rcache = ops.linear_forward(x, w, b)
    assert _message(bwd, np.ones((2, 3)), cache) == _message(ops.linear_backward, np.ones((2, 3)), rcache)


def test_empty_rows():
    for v in VERSIONS:
        out, _ = K.SPEC.versions[v][0](np.ones((0, 3), np.float32), np.ones((4, 3), np.float32),
                                       np.ones(4, np.float32))
        assert out.shape == (0, 4) and out.dtype == np.float32


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_both_bias_paths_are_the_oracles_bits(dtype, monkeypatch):
    """The bias is added by a prange kernel from K.PARALLEL_MIN entries on, by NumPy below: both forced here."""
    inputs, _ = K.make_inputs(dict(lead=(3, 17), C_in=8, C_out=1031), dtype, 2)
    ref, _ = ops.linear_forward(**inputs)
    for threshold in (0, 1 << 62):
        monkeypatch.setattr(K, "PARALLEL_MIN", threshold)
        np.testing.assert_array_equal(K.linear_forward(**inputs)[0], ref)


def test_v2_reuses_a_large_output_only_once_nobody_holds_it(monkeypatch):
    monkeypatch.setattr(K, "POOL_MIN", 0)                        # every output "large"
    monkeypatch.setattr(P, "_pool", {})                         # an empty pool for this test
    inputs, _ = K.make_inputs(dict(lead=(4, 6), C_in=5, C_out=9), np.float32, 3)
    ref, _ = ops.linear_forward(**inputs)
    first, _ = K.linear_forward_v2(**inputs)
    second, _ = K.linear_forward_v2(**inputs)                    # `first` is held: a new array
    assert not np.shares_memory(first, second)
    np.testing.assert_array_equal(first, ref)
    np.testing.assert_array_equal(second, ref)
    row = second[1]                                              # a view keeps its base held too
    del second
    third, _ = K.linear_forward_v2(**inputs)
    assert not np.shares_memory(third, row)
    address = third.__array_interface__["data"][0]
    del third, row
    fourth, _ = K.linear_forward_v2(**inputs)                    # nobody holds the pooled one: written again
    assert fourth.__array_interface__["data"][0] == address
    np.testing.assert_array_equal(fourth, ref)
