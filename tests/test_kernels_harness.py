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


# validate() and main() on specs built from refbert.ops itself (no Numba): a version is the oracle, or the oracle
# with one planted fault; the oracle against itself is exact (err/tol 0), a planted fault far outside the tolerance

def _softmax_inputs(shape, dtype, seed):
    x = np.random.default_rng(seed).standard_normal((shape["B"], shape["T"])).astype(dtype)
    return dict(x=x), dict(scale=0.5)


def _spec(versions, shapes=(dict(B=1, T=1), dict(B=3, T=37))):
    from refbert import ops
    from refbert_kernels._harness import KernelSpec
    return KernelSpec(name="fake", oracle=(ops.softmax_forward, ops.softmax_backward), versions=versions,
                      make_inputs=_softmax_inputs, wrt=("x",), shapes=list(shapes), bench_shape=dict(B=2, T=8),
                      tol={np.float64: (1e-12, 1e-11), np.float32: (1e-6, 1e-5)})   # softmax's own (kernels/softmax.py)


def _scaled_forward(factor, when=lambda x: True):
    from refbert import ops

    def forward(x, scale=1.0, mask=None):
        out, cache = ops.softmax_forward(x, scale, mask)
        return (out * x.dtype.type(factor) if when(x) else out), cache
    return forward


def test_validate_checks_gradients_their_count_and_the_dtypes_own_tolerance():
    from refbert import ops
    from refbert_kernels._harness import validate

    def bwd_off(dout, cache):                       # the forward exact, dx 0.1% off: err/tol ~1e-3 / 1e-5 >> 1
        return ops.softmax_backward(dout, cache) * np.float64(1.001).astype(dout.dtype)

    def bwd_two(dout, cache):                       # one gradient too many
        dx = ops.softmax_backward(dout, cache)
        return dx, dx

    spec = _spec({1: (ops.softmax_forward, ops.softmax_backward), 2: (ops.softmax_forward, bwd_off),
                  3: (ops.softmax_forward, bwd_two), 4: (_scaled_forward(1 + 1e-9), ops.softmax_backward)})
    shape = dict(B=3, T=37)
    for dtype in (np.float32, np.float64):
        assert validate(spec, 1, dtype, shape)[0] == 0.0
        assert validate(spec, 2, dtype, shape)[0] > 1, dtype
        with pytest.raises(AssertionError, match="backward returned 2 gradients, the oracle 1"):
            validate(spec, 3, dtype, shape)
    # out 1e-9 relative off: 1e-9 * p > 1e-12 + 1e-11 p for p of ~0.03 and more, outside float64's tolerance; in
    # float32 1 + 1e-9 rounds to 1 (exact). Checked with float32's tolerance, float64 would pass.
    assert validate(spec, 4, np.float64, shape)[0] > 1
    assert validate(spec, 4, np.float32, shape)[0] == 0.0


def test_validate_gives_oracle_and_version_the_same_dropout_stream():
    """make_inputs hands one DropoutRNG to both sides: each must draw from a fresh copy (the same stream), so the
    oracle validated against itself is exact; sharing the object would give the version the next stream."""
    from refbert import ops
    from refbert.philox import DropoutRNG
    from refbert_kernels._harness import KernelSpec, validate

    def make(shape, dtype, seed):
        x = np.random.default_rng(seed).standard_normal(shape["n"]).astype(dtype)
        return dict(x=x), dict(p=0.5, rng=DropoutRNG(3), train=True)

    spec = KernelSpec(name="fake_dropout", oracle=(ops.dropout_forward, ops.dropout_backward),
                      versions={1: (ops.dropout_forward, ops.dropout_backward)}, make_inputs=make, wrt=("x",),
                      shapes=[dict(n=64)], bench_shape=dict(n=64), tol={np.float64: (0.0, 0.0), np.float32: (0.0, 0.0)})
    assert validate(spec, 1, np.float64, dict(n=64))[0] == 0.0


def test_main_validates_every_shape_and_never_times_a_failing_version(monkeypatch, capsys):
    from refbert import ops
    from refbert_kernels import _harness
    timed = []
    monkeypatch.setattr(_harness, "time_call", lambda f: timed.append(f) or 1e-3)
    monkeypatch.setattr(_harness, "copy_bandwidth", lambda: 1e9)
    # wrong (1% off) on the second validation shape only (T = 37)
    spec = _spec({1: (ops.softmax_forward, ops.softmax_backward),
                  2: (_scaled_forward(1.01, lambda x: x.shape[-1] == 37), ops.softmax_backward)})
    with pytest.raises(SystemExit) as e:
        _harness.main(spec)
    assert e.value.code == 1 and timed == []                    # refused before anything was timed
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "FAIL" in out
    rows = _harness.main(_spec({1: (ops.softmax_forward, ops.softmax_backward)}))
    assert [label for label, _ in rows] == ["numpy oracle", "v1"] and len(timed) == 2


def test_compare_names_a_mismatch_just_outside_the_tolerance(capsys):
    ref = np.array([1.0, 2.0])
    got = np.array([1.0, 2.0 + 1.5e-5])                          # 1.5e-5 / (1e-6 + 1e-5 * 2) = 0.714: inside
    assert compare("x", got, ref, 1e-6, 1e-5) == pytest.approx(1.5e-5 / 2.1e-5)
    assert capsys.readouterr().out == ""
    got[1] = 2.0 + 2.5e-5                                        # 2.5e-5 / 2.1e-5 = 1.19: outside, printed
    assert compare("x", got, ref, 1e-6, 1e-5) == pytest.approx(2.5e-5 / 2.1e-5)
    out = capsys.readouterr().out
    assert "MISMATCH x: 1 of 2 entries" in out and "at (1,)" in out


def test_the_backend_runs_each_ops_best_version_and_specs_reach_every_kernel_file():
    """refbert_kernels.backend (the numba backend the model runs) takes each fused op's best (highest numbered)
    version, and specs() (what `refbert check` and `refbert bench` validate) holds every KernelSpec of every kernel
    file: a file left out of backend.KERNELS would be neither run nor checked."""
    pytest.importorskip("numba")
    import importlib
    import os

    from refbert_kernels import backend
    from refbert_kernels._harness import KernelSpec
    specs = backend.specs()
    by_name = {s.name: s for s in specs}
    for op in backend.KERNELS:
        best = by_name[op].versions[max(by_name[op].versions)]
        assert (getattr(backend, f"{op}_forward"), getattr(backend, f"{op}_backward")) == best, op
    folder = os.path.dirname(backend.__file__)
    files = sorted(f[:-3] for f in os.listdir(folder) if f.endswith(".py") and not f.startswith("_")
                   and f != "backend.py")
    assert files and set(files) == set(backend.KERNELS.values())
    for name in files:
        module = importlib.import_module(f"refbert_kernels.{name}")
        for v in vars(module).values():
            if isinstance(v, KernelSpec):
                assert any(v is s for s in specs), (name, v.name)


def test_importing_the_kernels_picks_the_workqueue_threading_layer_unless_told_otherwise():
    """Without NUMBA_THREADING_LAYER the kernels run on Numba's workqueue layer (kernels/__init__.py: OpenMP's
    spinning threads and OpenBLAS's steal each other's cores); a layer named in the environment is left as it is."""
    pytest.importorskip("numba")
    import os
    import subprocess
    import sys
    code = "import numba, refbert_kernels; print(numba.config.THREADING_LAYER)"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for env_value, want in ((None, "workqueue"), ("forksafe", "forksafe")):
        env = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
        if env_value:
            env["NUMBA_THREADING_LAYER"] = env_value
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=root)
        assert r.returncode == 0 and r.stdout.strip() == want, r.stdout + r.stderr[-2000:]
