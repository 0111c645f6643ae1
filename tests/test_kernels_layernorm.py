"""refbert_kernels.layernorm: every version of layernorm, residual_layernorm and dropout_residual_layernorm against
its oracle in refbert.ops on hypothesis-drawn shapes (C = 1, odd C, one row, no leading dims), both dtypes; the
dropout path keeps exactly the oracle's elements and draws the same streams; dw, db are bit-reproducible across
thread counts; the oracle's ValueErrors, word for word; no writes into arguments."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

numba = pytest.importorskip("numba")
from hypothesis import example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from refbert import ops  # noqa: E402
from refbert.philox import DropoutRNG, keep_mask  # noqa: E402
from refbert_kernels import layernorm as K  # noqa: E402
from refbert_kernels._harness import compare  # noqa: E402

SPECS = {"ln": K.SPEC, "res": K.SPEC_RESIDUAL, "drop": K.SPEC_DROPOUT}
VERSIONS = sorted(K.SPEC.versions)


def run_both(kind, v, inputs, kwargs, seed=21):
    """Oracle and version v, forward then backward with one random dout; each side gets its own DropoutRNG(seed)."""
    spec = SPECS[kind]
    kw_ref = dict(kwargs, rng=DropoutRNG(seed)) if "rng" in kwargs else kwargs
    kw_k = dict(kwargs, rng=DropoutRNG(seed)) if "rng" in kwargs else kwargs
    ref, rc = spec.oracle[0](**inputs, **kw_ref)
    saved = {k: a.copy() for k, a in inputs.items()}
    out, c = spec.versions[v][0](**inputs, **kw_k)
    if "rng" in kwargs:
        assert kw_k["rng"].state == kw_ref["rng"].state              # one stream iff train and p > 0
    dout = np.random.default_rng(1).standard_normal(ref.shape).astype(ref.dtype)
    d0 = dout.copy()
    grads = spec.versions[v][1](dout, c)
    assert all(np.array_equal(inputs[k], saved[k]) for k in inputs) and np.array_equal(dout, d0)
    assert not any(np.shares_memory(g, a) for g in (out, *grads) for a in (*inputs.values(), dout))
    return (ref, *spec.oracle[1](dout, rc)), (out, *grads)


def check(kind, v, inputs, kwargs):
    """|got - ref| <= atol + rtol |ref| with the spec's tolerance: float64 1e-12 / 1e-11 (summation order only);
    float32 1e-5 / 1e-4 (float32 sums in another order; dx cancels O(1) terms into values near 0)."""
    atol, rtol = SPECS[kind].tol[inputs["x"].dtype.type]
    refs, gots = run_both(kind, v, inputs, kwargs)
    names = ("out",) + tuple(f"d{w}" for w in SPECS[kind].wrt)
    assert len(gots) == len(refs)
    for name, g, r in zip(names, gots, refs):
        assert compare(f"{kind} v{v} {name}", g, r, atol, rtol) <= 1


shapes = dict(lead=st.lists(st.integers(1, 7), min_size=0, max_size=2), C=st.integers(1, 80),
              dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 2 ** 16))


@given(kind=st.sampled_from(["ln", "res"]), **shapes)
@example(kind="ln", lead=[1], C=1, dtype=np.float32, seed=0)        # C = 1: xhat = 0, rstd = 1/sqrt(eps)
@example(kind="res", lead=[1], C=1, dtype=np.float32, seed=0)
@example(kind="res", lead=[2, 5], C=52, dtype=np.float64, seed=1)
@example(kind="ln", lead=[], C=37, dtype=np.float64, seed=2)       # no leading dims
def test_layernorm_and_residual_match_oracle(kind, lead, C, dtype, seed):
    inputs, kwargs = K.make_inputs(dict(lead=tuple(lead), C=C, kind=kind), dtype, seed)
    for v in VERSIONS:
        check(kind, v, inputs, kwargs)


@given(p=st.sampled_from([0.0, 0.1, 0.5, 1.0]), train=st.booleans(), **shapes)
@example(p=0.1, lead=[3], C=37, train=True, dtype=np.float32, seed=0)
@example(p=1.0, lead=[2, 3], C=7, train=True, dtype=np.float64, seed=0)   # p = 1: out = LN(x), da = 0
@example(p=0.5, lead=[1], C=1, train=True, dtype=np.float32, seed=0)
@example(p=0.5, lead=[3], C=37, train=False, dtype=np.float64, seed=0)    # eval: no stream, da = a copy of ds
def test_dropout_residual_matches_oracle(p, train, lead, C, dtype, seed):
    inputs, kwargs = K.make_inputs(dict(lead=tuple(lead), C=C, kind="drop", p=p, train=train), dtype, seed)
    for v in VERSIONS:
        check("drop", v, inputs, kwargs)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("v", VERSIONS)
def test_dropout_keeps_exactly_the_oracles_elements(v, dtype):
    """da = ds * keep / (1 - p): its zeros are exactly the dropped elements of keep_mask(seed, stream)."""
    inputs, kwargs = K.make_inputs(dict(lead=(5, 3), C=29, kind="drop", p=0.4), dtype, 0)
    rng = DropoutRNG(77, 3)
    _, c = K.SPEC_DROPOUT.versions[v][0](**inputs, **dict(kwargs, rng=rng))
    keep = keep_mask(77, 3, inputs["a"].shape, 0.4)
    _, da, _, _ = K.SPEC_DROPOUT.versions[v][1](np.ones(inputs["x"].shape, dtype), c)
    assert np.array_equal(da != 0, keep)
    _, c = ops.dropout_residual_layernorm_forward(**inputs, **dict(kwargs, rng=DropoutRNG(77, 3)))
    _, da_ref, _, _ = ops.dropout_residual_layernorm_backward(np.ones(inputs["x"].shape, dtype), c)
    assert np.array_equal(da != 0, da_ref != 0)


_THREADS = """
import numba
import numpy as np
from refbert.philox import DropoutRNG
from refbert_kernels import layernorm as K
assert numba.config.NUMBA_NUM_THREADS == 4, numba.config.NUMBA_NUM_THREADS
K.PARALLEL_MIN = 0      # v3's parallel kernels at this size too (below 2^19 elements it runs its one-thread twins)
inputs, kwargs = K.make_inputs(dict(lead=(300,), C=41, kind="drop", p=0.2), np.float32, 0)
dout = np.random.default_rng(5).standard_normal(inputs["x"].shape).astype(np.float32)
for v in sorted(K.SPEC_DROPOUT.versions):
    runs = {}
    for n in (1, 2, 3, 4):                       # 60 chunks of 5 rows: split evenly, unevenly, one thread
        numba.set_num_threads(n)
        assert numba.get_num_threads() == n
        _, c = K.SPEC_DROPOUT.versions[v][0](**inputs, **dict(kwargs, rng=DropoutRNG(1)))
        runs[n] = K.SPEC_DROPOUT.versions[v][1](dout, c)
    for n in (2, 3, 4):
        for name, g, h in zip(("dx", "da", "dw", "db"), runs[1], runs[n]):
            assert np.array_equal(g, h), (v, n, name)
print("OK")
"""


def test_dw_db_do_not_depend_on_threads():
    """Every version's gradients (dw, db: sums over rows by chunk) are the same bits on 1, 2, 3 and 4 threads. In a
    child with NUMBA_NUM_THREADS=4 (the pool's size is fixed when numba starts), so that more than one thread runs
    whatever this machine's core count, and PARALLEL_MIN = 0, so that version 3 runs its parallel kernels (at this
    size it would run their one-thread twins, on any thread count)."""
    env = dict(os.environ, NUMBA_NUM_THREADS="4")
    r = subprocess.run([sys.executable, "-c", _THREADS], env=env, capture_output=True, text=True,
                       timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stdout[-3000:] + r.stderr[-3000:]


def _bad_calls():
    F = lambda *s, dt=np.float32: np.ones(s, dt)  # noqa: E731
    x, w, b = F(2, 3), F(3), F(3)
    return [
        ("ln", (x.tolist(), w, b)), ("ln", (x, F(3, dt=np.float64), b)), ("ln", (x, F(4), b)), ("ln", (x, w, F(2))),
        ("ln", (np.ones((), np.float32), F(1), F(1))),
        ("res", (x, F(3, 2), w, b)), ("res", (x, F(2, 3, dt=np.float64), w, b)), ("res", (x, x, F(4), b)),
        ("drop", (x, F(2, 2), w, b)), ("drop", (x, x, F(4), b, 1e-12, 0.1, DropoutRNG(0))),
        ("drop", (x, x, w, b, 1e-12, 1.5, DropoutRNG(0))), ("drop", (x, x, w, b, 1e-12, 0.1, 42)),
        ("drop", (x, x, w, b, 1e-12, 0.1, None)), ("drop", (x, x, w, b, 1e-12, -1.0, None, False)),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_value_errors_match_oracle(case):
    kind, args = _bad_calls()[case]
    with pytest.raises(ValueError) as ref:
        SPECS[kind].oracle[0](*args)
    for v in VERSIONS:
        with pytest.raises(ValueError, match=re.escape(str(ref.value))):
            SPECS[kind].versions[v][0](*_bad_calls()[case][1])


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_backward_errors_match_oracle(kind):
    inputs, kwargs = K.make_inputs(dict(lead=(2,), C=3, kind=kind), np.float32, 0)
    for dout in (np.ones((2, 3)), np.ones((3, 2), np.float32)):
        _, rc = SPECS[kind].oracle[0](**inputs, **dict(kwargs, **({"rng": DropoutRNG(0)} if kwargs else {})))
        with pytest.raises(ValueError) as ref:
            SPECS[kind].oracle[1](dout, rc)
        for v in VERSIONS:
            fwd, bwd = SPECS[kind].versions[v]
            _, c = fwd(**inputs, **dict(kwargs, **({"rng": DropoutRNG(0)} if kwargs else {})))
            with pytest.raises(ValueError, match=re.escape(str(ref.value))):
                bwd(dout, c)


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_empty_rows_follow_the_oracle(kind):
    inputs, kwargs = K.make_inputs(dict(lead=(0, 2), C=5, kind=kind), np.float64, 0)
    for v in VERSIONS:
        refs, gots = run_both(kind, v, inputs, dict(kwargs, p=0.3) if kwargs else kwargs)
        assert [g.shape for g in gots] == [r.shape for r in refs]
        assert all(np.array_equal(g, r) for g, r in zip(gots, refs))


def test_public_names_are_the_best_version():
    best = max(VERSIONS)
    assert (K.layernorm_forward, K.layernorm_backward) == K.SPEC.versions[best]
    assert (K.residual_layernorm_forward, K.residual_layernorm_backward) == K.SPEC_RESIDUAL.versions[best]
    assert (K.dropout_residual_layernorm_forward, K.dropout_residual_layernorm_backward) == \
        K.SPEC_DROPOUT.versions[best]


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_small_inputs_on_one_thread_match_the_oracle_and_repeat(kind, dtype, monkeypatch):
    """Below K.PARALLEL_MIN elements v3 runs its kernels compiled without parallel=True on the calling thread, which
    the hypothesis shapes above always take: both paths are forced here on one shape, each checked against the
    oracle and for the same bits on a second run and on one thread (the two paths may differ in the last bit: LLVM
    may split a row's float32 sums over SIMD lanes differently in the two compilations)."""
    inputs, kwargs = K.make_inputs(dict(lead=(67,), C=41, kind=kind, p=0.3), dtype, 4)
    n0 = numba.get_num_threads()
    for threshold in (0, 1 << 62):                                   # every size parallel, then none
        monkeypatch.setattr(K, "PARALLEL_MIN", threshold)
        for v in VERSIONS:
            check(kind, v, inputs, kwargs)
        runs = [run_both(kind, max(VERSIONS), inputs, kwargs)[1]]
        try:
            numba.set_num_threads(1)
            runs.append(run_both(kind, max(VERSIONS), inputs, kwargs)[1])
        finally:
            numba.set_num_threads(n0)
        for g, h in zip(*runs):
            np.testing.assert_array_equal(g, h)


@pytest.mark.parametrize("v", VERSIONS)
def test_dropout_residual_without_dropout_gives_da_its_own_array(v):
    """In eval or at p = 0 da equals dx, and is a copy, as the oracle's (dropout_backward returns dout.copy()):
    a caller writing into one gradient must not change the other."""
    inputs, _ = K.make_inputs(dict(lead=(3,), C=7, kind="drop"), np.float32, 0)
    dout = np.random.default_rng(2).standard_normal(inputs["x"].shape).astype(np.float32)
    for p, train in ((0.3, False), (0.0, True)):
        for fwd, bwd in ((ops.dropout_residual_layernorm_forward, ops.dropout_residual_layernorm_backward),
                         K.SPEC_DROPOUT.versions[v]):
            _, c = fwd(**inputs, p=p, rng=DropoutRNG(0), train=train)
            dx, da, _, _ = bwd(dout, c)
            assert np.array_equal(dx, da) and not np.shares_memory(dx, da), (p, train)
