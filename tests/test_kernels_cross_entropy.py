"""Every version of the fused cross-entropy kernel against refbert.ops.cross_entropy_forward / _backward on
hypothesis-drawn shapes: odd vocabularies, one row, logits near 1e4, rows labelled -100 (some, most, all) or a
custom ignore_index, both dtypes; and the oracle's ValueErrors."""
import numpy as np
import pytest

pytest.importorskip("numba")
from hypothesis import given, strategies as st  # noqa: E402

from refbert import ops  # noqa: E402
from refbert_kernels import _pool as P  # noqa: E402
from refbert_kernels import cross_entropy as CE  # noqa: E402

VERSIONS = sorted(CE.SPEC.versions)
# float64: libm vs NumPy exp and the order of ~V-term sums; float32: the oracle sums exp in float32 (pairwise),
# the kernels in float64, and both exp are within ~1 ulp
TOL = {np.float64: (1e-12, 1e-10), np.float32: (1e-6, 1e-5)}


def close(got, ref, dtype, what):
    atol, rtol = TOL[dtype]
    assert got.dtype == ref.dtype and got.shape == ref.shape, what
    bad = np.abs(got.astype(np.float64) - ref) > atol + rtol * np.abs(ref.astype(np.float64))
    assert not bad.any(), f"{what}: first mismatch at {np.argwhere(bad)[0]}: {got[bad][:3]} vs {ref[bad][:3]}"


@given(lead=st.lists(st.integers(1, 9), min_size=1, max_size=2).map(tuple), V=st.integers(1, 300),
       dtype=st.sampled_from([np.float32, np.float64]), ignored=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
       big=st.booleans(), ignore_index=st.sampled_from([-100, -1]), seed=st.integers(0, 2**16),
       dloss=st.sampled_from([1.0, 0.25, -3.0]))
def test_versions_match_oracle(lead, V, dtype, ignored, big, ignore_index, seed, dloss):
    rng = np.random.default_rng(seed)
    logits = (4 * rng.standard_normal((*lead, V))).astype(dtype)
    if big:
        logits[..., : (V + 1) // 2] += 1e4                     # logits of 1e4: z - m must stay exact
    labels = rng.integers(0, V, size=lead)
    labels[rng.random(lead) < ignored] = ignore_index
    z0 = logits.copy()
    loss, rc = ops.cross_entropy_forward(logits, labels, ignore_index)
    dz = ops.cross_entropy_backward(dtype(dloss), rc)
    for v in VERSIONS:
        fwd, bwd = CE.SPEC.versions[v]
        got, cache = fwd(logits, labels, ignore_index)
        close(got, loss, dtype, f"v{v} loss")
        g = bwd(dtype(dloss), cache)
        close(g, dz, dtype, f"v{v} dlogits")
        if (labels == ignore_index).all():
            assert got == 0 and not g.any()                     # all ignored: loss 0, zero gradient
    np.testing.assert_array_equal(logits, z0)                  # nothing writes into its arguments


def test_the_model_path_reads_the_logits_in_place():
    # every row kept (the MLM decoder's labelled rows): the cache holds the caller's logits, not a copy
    logits = np.random.default_rng(0).standard_normal((7, 31)).astype(np.float32)
    labels = np.arange(7)
    _, cache = CE.cross_entropy_forward(logits, labels)
    assert np.shares_memory(cache[1], logits)


def _message(fn, *args):
    with pytest.raises(ValueError) as e:
        fn(*args)
    return str(e.value)


@pytest.mark.parametrize("v", VERSIONS)
def test_same_value_errors_as_oracle(v):
    fwd, bwd = CE.SPEC.versions[v]
    z = np.zeros((3, 5))
    y = np.array([0, 4, -100])
    nan_row, inf_row, ninf_row = z.copy(), z.copy(), z.copy()
    nan_row[1, 2], inf_row[0, 0], ninf_row[1] = np.nan, np.inf, -np.inf
    cases = [(z.astype(int), y), (np.zeros(()), np.zeros(())), (z, y[:2]), (z, y.astype(float)), (z, [0, 1, 2]),
             (z, np.array([0, 5, 1])), (z, np.array([0, -1, 1])), (nan_row, y), (inf_row, y), (ninf_row, y)]
    for args in cases:
        assert _message(fwd, *args) == _message(ops.cross_entropy_forward, *args)
    # a NaN in an ignored row is fine, as is -inf beside a finite maximum
    for zz in (np.where(np.arange(3)[:, None] == 2, np.nan, z), np.where(np.arange(5) == 3, -np.inf, z)):
        np.testing.assert_allclose(fwd(zz, y)[0], ops.cross_entropy_forward(zz, y)[0], rtol=1e-12)
    _, cache = fwd(z, y)
    _, rcache = ops.cross_entropy_forward(z, y)
    assert _message(bwd, np.ones(2), cache) == _message(ops.cross_entropy_backward, np.ones(2), rcache)


def test_v4_reuses_dlogits_only_once_nobody_holds_it(monkeypatch):
    monkeypatch.setattr(CE, "POOL_MIN", 0)                       # every dlogits "large"
    monkeypatch.setattr(P, "_pool", {})                          # an empty pool for this test
    logits = np.random.default_rng(0).standard_normal((2, 3, 11)).astype(np.float32)
    labels = np.array([[1, -100, 4], [0, 10, -100]])
    ref = ops.cross_entropy_backward(np.float32(1), ops.cross_entropy_forward(logits, labels)[1])
    _, cache = CE.cross_entropy_forward_v4(logits, labels)
    first = CE.cross_entropy_backward_v4(np.float32(1), cache)
    second = CE.cross_entropy_backward_v4(np.float32(1), cache)  # `first` is held: a new array
    assert not np.shares_memory(first, second)
    first[:] = 5                                                 # a caller may write into its gradient
    address = second.__array_interface__["data"][0]
    del second
    third = CE.cross_entropy_backward_v4(np.float32(1), cache)   # nobody holds the pooled one: written again
    assert third.__array_interface__["data"][0] == address
    close(third, ref, np.float32, "reused dlogits")             # ignored rows written as zeros, not left over


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_vocabularies_over_several_blocks(dtype):
    """Rows longer than v3's online-max block (CE._BLOCK columns) and v4's float32 sum block (CE._SUM_BLOCK): the
    running sum rescaled when a later block holds a larger maximum, every column of every block summed. One row
    rises to its maximum in the last block, one peaks in the first, two at a block's last column, the rest random
    (the hypothesis test's V stays within one block)."""
    V = 2 * CE._SUM_BLOCK + 37
    assert V > 2 * CE._BLOCK
    rng = np.random.default_rng(3)
    logits = (4 * rng.standard_normal((5, V))).astype(dtype)
    logits[0] = np.linspace(-5.0, 20.0, V)                      # the max in the last block
    logits[1] = np.linspace(20.0, -5.0, V)                      # ... in the first
    logits[2, CE._SUM_BLOCK - 1] = logits[3, 2 * CE._SUM_BLOCK - 1] = 30.0   # ... at the end of a block
    labels = np.array([V - 1, 0, CE._SUM_BLOCK - 1, CE._BLOCK, -100])
    loss, rc = ops.cross_entropy_forward(logits, labels)
    dz = ops.cross_entropy_backward(dtype(1.0), rc)
    for v in VERSIONS:
        fwd, bwd = CE.SPEC.versions[v]
        got, cache = fwd(logits, labels)
        close(got, loss, dtype, f"v{v} loss")                  # TOL: the module's reasons (see close)
        close(bwd(dtype(1.0), cache), dz, dtype, f"v{v} dlogits")


@pytest.mark.parametrize("v", VERSIONS)
def test_an_ignore_index_inside_the_vocabulary(v):
    """ignore_index is any integer, a valid class too (torch's F.cross_entropy): rows labelled 2 are skipped when
    ignore_index=2, and counted when it is the default -100 (the hypothesis test draws only negative ones)."""
    rng = np.random.default_rng(5)
    logits = (2 * rng.standard_normal((6, 9))).astype(np.float64)
    labels = np.array([2, 0, 2, 8, 5, 2])
    fwd, bwd = CE.SPEC.versions[v]
    for ignore_index in (2, -100):
        loss, rc = ops.cross_entropy_forward(logits, labels, ignore_index)
        got, cache = fwd(logits, labels, ignore_index)
        close(got, loss, np.float64, f"v{v} loss, ignore_index {ignore_index}")   # TOL's float64 reasons
        g = bwd(np.float64(1.0), cache)
        close(g, ops.cross_entropy_backward(np.float64(1.0), rc), np.float64, f"v{v} dlogits")
        assert (g[labels == 2] == 0).all() == (ignore_index == 2)
