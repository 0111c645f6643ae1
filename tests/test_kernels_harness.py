"""refbert_kernels._harness.compare, through which every kernel version is validated against its oracle (CPU and
CUDA): err / tol by hand, and non-finite references compared exactly — a reference +-inf passes only against the
same infinity, a NaN only against a NaN (inf / inf is NaN, which once counted as a pass)."""
import numpy as np
import pytest

from refbert_kernels._harness import compare

INF, NAN = np.inf, np.nan


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rtol", [1e-5, 0.0])        # rtol 0 (the dropout kernels'): atol + 0 * inf is NaN too
def test_non_finite_references_pass_only_when_identical(dtype, rtol, capsys):
    ref = np.array([1.0, INF, -INF, NAN], dtype)
    assert compare("same", ref.copy(), ref, 1e-6, rtol) == 0.0
    for i, bad in ((1, 3.0), (1, -INF), (1, NAN), (1, np.finfo(dtype).max), (2, INF), (2, -1.0), (3, 0.0),
                   (3, INF), (0, INF), (0, NAN)):
        got = ref.copy()
        got[i] = bad
        assert compare("bad", got, ref, 1e-6, rtol) == INF, (i, bad)
        assert f"got {got[i]!r}, expected {ref[i]!r}" in capsys.readouterr().out    # the entry is named


def test_error_is_distance_over_tolerance():
    ref = np.array([1.0, -2.0, 0.0, 0.0])
    got = np.array([1.0 + 2e-5, -2.0, 3e-6, 0.0])
    # |2e-5| / (1e-6 + 1e-5 * 1) = 1.818...; 3e-6 / (1e-6 + 0) = 3
    assert compare("x", got, ref, 1e-6, 1e-5) == pytest.approx(3.0)
    assert compare("x", got[:2], ref[:2], 1e-6, 1e-5) == pytest.approx(2e-5 / 1.1e-5)
    assert compare("x", ref, ref, 0.0, 0.0) == 0.0       # equal entries with no tolerance at all: 0, not 0 / 0
    assert compare("x", np.zeros((0, 3)), np.zeros((0, 3)), 1e-6, 1e-5) == 0.0


def test_shape_and_dtype_must_match():
    with pytest.raises(AssertionError, match=r"x: shape \(3,\), expected \(2,\)"):
        compare("x", np.zeros(3), np.zeros(2), 1e-6, 1e-5)
    with pytest.raises(AssertionError, match="x: dtype float32, expected float64"):
        compare("x", np.zeros(2, np.float32), np.zeros(2), 1e-6, 1e-5)


def test_every_kernel_backward_refuses_a_cache_that_is_not_its_forwards():
    """Every version of every fused kernel, handed None, a list or a tuple of a length no forward returns, raises a
    ValueError naming its op and 'cache' (not NumPy's "not enough values to unpack"), as the oracle's ops
    (tests/test_ops.py). (A cache of the right length from another op is not told apart: only the length is read.)"""
    pytest.importorskip("numba")
    from refbert_kernels import backend
    for spec in backend.specs():
        for v, (_, bwd) in spec.versions.items():
            for cache in (None, (0,) * 5, [1, 2]):           # (no op's cache is a tuple of 5, or a list)
                with pytest.raises(ValueError, match=rf"^{spec.name}: argument 'cache' expected the cache"):
                    bwd(np.zeros(3), cache)
