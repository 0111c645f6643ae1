"""Every version of the GELU / bias+GELU kernels against its oracle in refbert.ops, on hypothesis-drawn shapes and
values (the tails at +-10, |x| < 1e-6, both dtypes, both approximations), and the oracle's ValueErrors."""
import numpy as np
import pytest

pytest.importorskip("numba")
from hypothesis import given, strategies as st  # noqa: E402

from refbert import ops  # noqa: E402
from refbert_kernels import gelu as G  # noqa: E402

VERSIONS = sorted(G.SPEC_GELU.versions)
# float64: libm erfc vs scipy ndtr and the oracle's Phi = out / x (~1e-15 relative, more in the tails), db's
#          summation order; float32: the oracle rounds every step to float32 and sums db in float32
TOL = {np.float64: (1e-12, 1e-11), np.float32: (1e-6, 1e-5)}

shapes = st.lists(st.integers(1, 41), min_size=1, max_size=3).map(tuple)
tails = st.sampled_from([-10.0, 10.0, -6.0, -1e-7, 3e-9, 0.0, -2.5, 1.3])


def close(got, ref, dtype, what):
    atol, rtol = TOL[dtype]
    assert got.dtype == ref.dtype and got.shape == ref.shape, what
    bad = np.abs(got.astype(np.float64) - ref) > atol + rtol * np.abs(ref.astype(np.float64))
    assert not bad.any(), f"{what}: first mismatch at {np.argwhere(bad)[0]}: {got[bad][:3]} vs {ref[bad][:3]}"


def draw_x(shape, dtype, seed, tail_values):
    rng = np.random.default_rng(seed)
    x = 3 * rng.standard_normal(shape)
    flat = x.reshape(-1)
    flat[:len(tail_values)] = tail_values[:flat.size]
    return x.astype(dtype)


@given(shape=shapes, dtype=st.sampled_from([np.float32, np.float64]), approximate=st.sampled_from(["none", "tanh"]),
       seed=st.integers(0, 2**16), tail_values=st.lists(tails, max_size=6))
def test_gelu_versions_match_oracle(shape, dtype, approximate, seed, tail_values):
    x = draw_x(shape, dtype, seed, tail_values)
    dout = np.random.default_rng(seed + 1).standard_normal(shape).astype(dtype)
    ref, rc = ops.gelu_forward(x, approximate)
    rdx = ops.gelu_backward(dout, rc)
    x0, d0 = x.copy(), dout.copy()
    for v in VERSIONS:
        fwd, bwd = G.SPEC_GELU.versions[v]
        out, cache = fwd(x, approximate)
        close(out, ref, dtype, f"v{v} out")
        close(bwd(dout, cache), rdx, dtype, f"v{v} dx")
    np.testing.assert_array_equal(x, x0)                      # nothing writes into its arguments
    np.testing.assert_array_equal(dout, d0)


@given(shape=shapes, dtype=st.sampled_from([np.float32, np.float64]), approximate=st.sampled_from(["none", "tanh"]),
       seed=st.integers(0, 2**16), tail_values=st.lists(tails, max_size=6))
def test_bias_gelu_versions_match_oracle(shape, dtype, approximate, seed, tail_values):
    x = draw_x(shape, dtype, seed, tail_values)
    b = (0.1 * np.random.default_rng(seed + 2).standard_normal(shape[-1])).astype(dtype)
    b[0] = 0                                                  # the planted tails stay tails in x + b
    dout = np.random.default_rng(seed + 1).standard_normal(shape).astype(dtype)
    ref, rc = ops.bias_gelu_forward(x, b, approximate)
    rdx, rdb = ops.bias_gelu_backward(dout, rc)
    for v in VERSIONS:
        fwd, bwd = G.SPEC_BIAS_GELU.versions[v]
        out, cache = fwd(x, b, approximate)
        close(out, ref, dtype, f"v{v} out")
        dx, db = bwd(dout, cache)
        close(dx, rdx, dtype, f"v{v} dx")
        # db: the oracle sums the rows in float32 (pairwise, error <= log2(N) eps sum_rows |du|), the kernels in
        # float64, so the gap scales with sum |du| (cancelling columns), not with |db|
        n_rows = max(1, rdx.size // shape[-1])
        slack = (np.log2(n_rows) + 2) * np.finfo(dtype).eps * np.abs(rdx).reshape(-1, shape[-1]).sum(0)
        assert (np.abs(db - rdb.astype(np.float64)) <= slack + TOL[dtype][0] + TOL[dtype][1] * np.abs(rdb)).all()


def test_noncontiguous_and_zero_d():
    x = np.random.default_rng(0).standard_normal((6, 10))[:, ::2]
    b = np.linspace(-1, 1, 5)
    for v in VERSIONS:
        out, cache = G.SPEC_BIAS_GELU.versions[v][0](x, b)
        np.testing.assert_allclose(out, ops.bias_gelu_forward(x, b)[0], rtol=1e-11, atol=1e-12)
        out, cache = G.SPEC_GELU.versions[v][0](np.full((), -10, np.float32))
        assert out.shape == () and out.dtype == np.float32


_THREADS = """
import numba
import numpy as np
from refbert_kernels import gelu as G
assert numba.config.NUMBA_NUM_THREADS == 4, numba.config.NUMBA_NUM_THREADS
G.PARALLEL_MIN = 0      # v4's parallel kernels at this size too (below 2^19 elements it runs its one-thread twins)
r = np.random.default_rng(0)
x = r.standard_normal((300, 33)).astype(np.float32)
b = r.standard_normal(33).astype(np.float32)
dout = r.standard_normal(x.shape).astype(np.float32)
for v in sorted(G.SPEC_BIAS_GELU.versions):
    fwd, bwd = G.SPEC_BIAS_GELU.versions[v][:2]
    runs = {}
    for n in (1, 2, 3, 4):
        numba.set_num_threads(n)
        assert numba.get_num_threads() == n
        _, cache = fwd(x, b)
        runs[n] = bwd(dout, cache)
    for n in (2, 3, 4):
        for name, g, h in zip(("dx", "db"), runs[1], runs[n]):
            assert np.array_equal(g, h), (v, n, name)
print("OK")
"""


def test_db_does_not_depend_on_threads():
    """Every version's dx and db (db: per-chunk float64 partials summed in a fixed order) are the same bits on 1, 2,
    3 and 4 threads: in a child with NUMBA_NUM_THREADS=4 (the pool's size is fixed when numba starts) and
    PARALLEL_MIN = 0 (at this size v4 would run its one-thread twins on any thread count)."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, NUMBA_NUM_THREADS="4")
    r = subprocess.run([sys.executable, "-c", _THREADS], env=env, capture_output=True, text=True, timeout=600,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stdout[-3000:] + r.stderr[-3000:]


def _message(fn, *args, **kwargs):
    with pytest.raises(ValueError) as e:
        fn(*args, **kwargs)
    return str(e.value)


@pytest.mark.parametrize("v", VERSIONS)
def test_same_value_errors_as_oracle(v):
    gf, gb = G.SPEC_GELU.versions[v]
    bf, bb = G.SPEC_BIAS_GELU.versions[v]
    x = np.ones((3, 4))
    cases = [
        (gf, ops.gelu_forward, (x.astype(int),), {}),
        (gf, ops.gelu_forward, ([1.0, 2.0],), {}),
        (gf, ops.gelu_forward, (x,), {"approximate": "erf"}),
        (bf, ops.bias_gelu_forward, (x, np.ones(3)), {}),
        (bf, ops.bias_gelu_forward, (x, np.ones(4, np.float32)), {}),
        (bf, ops.bias_gelu_forward, (np.ones(()), np.ones(1)), {}),
        (bf, ops.bias_gelu_forward, (x, np.ones(4)), {"approximate": "fast"}),
    ]
    for mine, oracle, args, kwargs in cases:
        assert _message(mine, *args, **kwargs) == _message(oracle, *args, **kwargs)
    for fwd, bwd, ofwd, obwd, args in [(gf, gb, ops.gelu_forward, ops.gelu_backward, (x,)),
                                       (bf, bb, ops.bias_gelu_forward, ops.bias_gelu_backward, (x, np.ones(4)))]:
        for bad in (np.ones((4, 3)), np.ones((3, 4), np.float32), [[1.0] * 4] * 3):
            assert _message(bwd, bad, fwd(*args)[1]) == _message(obwd, bad, ofwd(*args)[1])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_small_inputs_on_one_thread_give_the_parallel_bits(dtype, approximate, monkeypatch):
    """v4 runs its kernels compiled without parallel=True below G.PARALLEL_MIN elements: both paths forced on one
    shape (two flat blocks, five db chunks), checked against the oracle and against each other bit for bit."""
    x = draw_x((67, 301), dtype, 3, [-10.0, 10.0, -1e-7])
    b = (0.1 * np.random.default_rng(4).standard_normal(301)).astype(dtype)
    dout = np.random.default_rng(5).standard_normal(x.shape).astype(dtype)
    ref, rc = ops.gelu_forward(x, approximate)
    bref, brc = ops.bias_gelu_forward(x, b, approximate)
    results = []
    for threshold in (0, 1 << 62):                            # every size parallel, then none
        monkeypatch.setattr(G, "PARALLEL_MIN", threshold)
        out, c = G.gelu_forward(x, approximate)
        bout, bc = G.bias_gelu_forward(x, b, approximate)
        got = (out, G.gelu_backward(dout, c), bout, *G.bias_gelu_backward(dout, bc))
        for g, r, what in zip(got, (ref, ops.gelu_backward(dout, rc), bref, *ops.bias_gelu_backward(dout, brc)),
                              ("out", "dx", "bias out", "bias dx", "db")):
            close(g, r, dtype, f"{what} at threshold {threshold}")
        results.append(got)
    for g, h in zip(*results):
        np.testing.assert_array_equal(g, h)


@pytest.mark.parametrize("v", VERSIONS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tanh_form_at_huge_x_takes_its_limits(v, dtype):
    """Every version's tanh form, gelu and bias_gelu, where u^3 or u^2 overflows (|u| ~ 1e13 up in float32): out
    = u for u > 0 and 0 for u < 0, du = 1 and 0 (db their sums), the derivative's limits, as the oracle
    (tests/test_ops.py); never NaN from inf * 0 (versions 2 and 4 gave NaN from |u| = 1e14 in float32)."""
    big = 3e38 if dtype == np.float32 else 1e300
    x = np.array([[1e14, -1e14, 1e20, -1e20, big, -big, 1e4, -1e4]], dtype)
    for spec, args in ((G.SPEC_GELU, (x,)), (G.SPEC_BIAS_GELU, (x, np.zeros(x.shape[-1], dtype)))):
        fwd, bwd = spec.versions[v]
        out, cache = fwd(*args, approximate="tanh")
        grads = bwd(np.ones_like(x), cache)
        grads = grads if isinstance(grads, tuple) else (grads,)
        np.testing.assert_array_equal(out, np.where(x > 0, x, 0).astype(dtype))
        np.testing.assert_array_equal(grads[0], (x > 0).astype(dtype))
        if len(grads) > 1:                                 # bias_gelu's db: the column sums of du, 1 or 0 each
            np.testing.assert_array_equal(grads[1], (x > 0).sum(0).astype(dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_non_finite_and_far_tail_inputs_follow_the_oracle(dtype, approximate):
    """NaN, +-inf and |x| past 15.5 (where float32's Phi(-|x|) and x phi(x) are 0): the same NaN / infinities as
    the oracle in out, dx and db (-inf * Phi(-inf) and +-inf * phi(+-inf) are NaN), finite entries within TOL.
    (v3's float32 exact form once clamped the tail at e^-121, not 0: gelu(-inf) = -inf, gelu'(+-inf) = +-inf.)"""
    x = np.array([[np.nan, np.inf, -np.inf, 16.0, -16.0, -40.0, 1.5, -0.5]], dtype)
    b = np.zeros(x.shape[-1], dtype)
    dout = np.ones_like(x)
    with np.errstate(invalid="ignore", over="ignore"):
        ref, rc = ops.gelu_forward(x, approximate)
        rdx = ops.gelu_backward(dout, rc)
        bref, brc = ops.bias_gelu_forward(x, b, approximate)
        brdx, brdb = ops.bias_gelu_backward(dout, brc)
    for v in VERSIONS:
        out, cache = G.SPEC_GELU.versions[v][0](x, approximate)
        bout, bcache = G.SPEC_BIAS_GELU.versions[v][0](x, b, approximate)
        dx, (bdx, bdb) = G.SPEC_GELU.versions[v][1](dout, cache), G.SPEC_BIAS_GELU.versions[v][1](dout, bcache)
        for what, got, want in (("out", out, ref), ("dx", dx, rdx), ("bias out", bout, bref), ("bias dx", bdx, brdx),
                                ("db", bdb, brdb)):
            finite = np.isfinite(want)
            np.testing.assert_array_equal(got[~finite], want[~finite], err_msg=f"v{v} {what}")
            close(got[finite], want[finite], dtype, f"v{v} {what}")
