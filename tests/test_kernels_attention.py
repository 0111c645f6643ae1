"""Every version of the fused attention kernel (kernels/attention.py) against the oracle refbert.ops.attention_*.

Tolerances (|got - ref| <= atol + rtol |ref|), stated once here and used at each call site:
  float64: (1e-12, 1e-10) — the kernels differ from the oracle only in the order of sums (loops and BLAS tiles vs
           one BLAS matmul, the online softmax's rescaling), exp is math.exp in both: errors ~1e-15 per op.
  float32: (2e-5, 1e-4) — sums of T and hs float32 products in another order (~sqrt(n) * 6e-8 relative), one
           extra rounding per key block from the online rescaling, and in v3 the polynomial exp (<= 1 ulp); values
           and gradients are O(1) for unit-normal inputs, atol covers entries that cancel to ~0.
Dropout elements must be identical (same Philox stream): the zeros of attention_probs match the oracle's exactly.
"""
import re

import numpy as np
import pytest

pytest.importorskip("numba")

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from refbert import ops  # noqa: E402
from refbert.philox import DropoutRNG  # noqa: E402
from refbert_kernels import attention as A  # noqa: E402

TOL = {np.float64: (1e-12, 1e-10), np.float32: (2e-5, 1e-4)}   # reasons in the module docstring
VERSIONS = sorted(A.VERSIONS)


def close(got, ref, dtype, what):
    atol, rtol = TOL[dtype]
    assert got.dtype == ref.dtype and got.shape == ref.shape, (what, got.dtype, got.shape, ref.shape)
    err = np.abs(got.astype(np.float64) - ref) - (atol + rtol * np.abs(ref.astype(np.float64)))
    assert err.max(initial=-1) <= 0, f"{what}: worst excess {err.max()} at {np.unravel_index(err.argmax(), err.shape)}"


def run_all(q, k, v, H, mask, p, train, dtype, seed=3):
    """Oracle and every version on the same inputs and the same dropout stream; compares out, grads and probs."""
    dout = np.random.default_rng(seed).standard_normal(q.shape).astype(dtype)
    rng = DropoutRNG(11)
    ref, ref_cache = ops.attention_forward(q, k, v, H, mask, p, rng, train)
    ref_grads = ops.attention_backward(dout, ref_cache)
    ref_probs = ops.attention_probs(ref_cache)
    for ver in VERSIONS:
        fwd, bwd = A.VERSIONS[ver]
        rng_v = DropoutRNG(11)
        args = [a.copy() for a in (q, k, v)]
        out, cache = fwd(*args, H, mask, p, rng_v, train)
        assert rng_v.calls == rng.calls                      # one stream per call in training, none in eval
        close(out, ref, dtype, f"v{ver} out")
        dout_copy = dout.copy()
        grads = bwd(dout_copy, cache)
        for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
            close(g, r, dtype, f"v{ver} {name}")
        assert np.array_equal(dout_copy, dout) and all(np.array_equal(a, b) for a, b in zip(args, (q, k, v)))
        probs = A.attention_probs(cache)
        close(probs, ref_probs, dtype, f"v{ver} probs")
        assert np.array_equal(probs == 0, ref_probs == 0), f"v{ver}: dropped / masked elements differ"


@given(B=st.integers(1, 3), T=st.integers(1, 40), H=st.integers(1, 3), hs=st.integers(1, 6),
       mask=st.sampled_from(["hf", "ninf", "none", "full"]), train=st.booleans(),
       dtype=st.sampled_from([np.float64, np.float32]), seed=st.integers(0, 2 ** 16))
def test_versions_match_oracle(B, T, H, hs, mask, train, dtype, seed):
    r = np.random.default_rng(seed)
    q, k, v = (r.standard_normal((B, T, H * hs)).astype(dtype) for _ in range(3))
    m = A.make_mask(r, mask, B, H, T, dtype)      # hf / ninf: the last sequence has one real token
    run_all(q, k, v, H, m, 0.1, train, dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_spec_shapes(dtype):
    """The validation shapes of `python -m refbert_kernels.attention`: tails of every tile (T = 70, 150), a
    sequence of only finfo.min padding (uniform rows, as the oracle gives), an (H, T, T) mask with -inf."""
    for shape in A.SHAPES:
        inputs, kw = A.make_inputs(shape, dtype, 0)
        run_all(inputs["q"], inputs["k"], inputs["v"], kw["n_heads"], kw["mask"], kw["dropout_p"], kw["train"],
                dtype)
    inputs, kw = A.make_inputs(dict(B=2, T=19, H=2, hs=3, mask="hf", empty_row=True), dtype, 0)
    probs = A.attention_probs(A.attention_forward(**inputs, **{**kw, "train": False})[1])
    assert np.allclose(probs[0], 1 / 19)


@pytest.mark.parametrize("p", [0.0, 1.0, 0.5])
def test_dropout_extremes(p):
    r = np.random.default_rng(0)
    q, k, v = (r.standard_normal((2, 9, 6)) for _ in range(3))
    run_all(q, k, v, 2, None, p, True, np.float64)


def bad_cases():
    r = np.random.default_rng(0)
    x = r.standard_normal((2, 5, 6))
    f32 = x.astype(np.float32)
    allinf = np.zeros((2, 1, 1, 5))
    allinf[1] = -np.inf
    nan_q = x.copy()
    nan_q[0, 2, 1] = np.nan
    rng = DropoutRNG(0)
    return {
        "int q": ((x.astype(int), x, x, 2), {}),
        "dtype mix": ((x, f32, x, 2), {}),
        "2-D q": ((x[0], x[0], x[0], 2), {}),
        "k shape": ((x, x[:, :4], x, 2), {}),
        "heads": ((x, x, x, 4), {}),
        "heads type": ((x, x, x, 2.0), {}),
        "mask shape": ((x, x, x, 2), dict(mask=np.zeros((2, 1, 1, 4)))),
        "mask dtype": ((x, x, x, 2), dict(mask=np.zeros((2, 1, 1, 5), np.float32))),
        "all -inf row": ((x, x, x, 2), dict(mask=allinf)),
        "nan score": ((nan_q, x, x, 2), {}),
        "p > 1": ((x, x, x, 2), dict(dropout_p=1.5, rng=rng)),
        "p > 1 eval": ((x, x, x, 2), dict(dropout_p=1.5, train=False)),
        "no rng": ((x, x, x, 2), dict(dropout_p=0.1)),
        "all -inf and p": ((x, x, x, 2), dict(mask=allinf, dropout_p=2.0)),
    }


@pytest.mark.parametrize("case", list(bad_cases()))
@pytest.mark.parametrize("ver", VERSIONS)
def test_same_value_errors_as_oracle(case, ver):
    args, kw = bad_cases()[case]
    with pytest.raises(ValueError) as ref:
        ops.attention_forward(*args, **kw)
    with pytest.raises(ValueError, match=re.escape(str(ref.value))):
        A.VERSIONS[ver][0](*args, **kw)


@pytest.mark.parametrize("ver", VERSIONS)
def test_backward_checks_dout(ver):
    x = np.random.default_rng(0).standard_normal((2, 5, 6))
    _, ref_cache = ops.attention_forward(x, x, x, 3)
    _, cache = A.VERSIONS[ver][0](x, x, x, 3)
    for dout in (x[:, :4], x.astype(np.float32), x.tolist()):
        with pytest.raises(ValueError) as ref:
            ops.attention_backward(dout, ref_cache)
        with pytest.raises(ValueError, match=re.escape(str(ref.value))):
            A.VERSIONS[ver][1](dout, cache)


def test_rng_state_untouched_by_a_raise():
    """The oracle raises in its softmax before drawing the dropout stream; so do the kernels."""
    x = np.zeros((1, 3, 2))
    mask = np.full((1, 1, 1, 3), -np.inf)
    for fwd, _ in [(ops.attention_forward, None), *A.VERSIONS.values()]:
        rng = DropoutRNG(0)
        with pytest.raises(ValueError):
            fwd(x, x, x, 1, mask, 0.1, rng)
        assert rng.calls == 0


def test_one_compiled_kernel_per_dtype_whatever_the_mask():
    """Numba compiles a kernel once per argument type, and a read-only or a writable mask, a (B, 1, 1, T) or a full
    (B, H, T, T) one, were each a type: v1-v5 compiled every kernel twice per dtype (a cold compile is minutes, the
    first `refbert check` a user runs). Every mask reaches the kernels as _compact_mask's read-only (mB, mH, mT, T)
    array: one float64 signature per kernel, whatever the mask (v6 two: no mask at all is its own loop)."""
    r = np.random.default_rng(0)
    B, T, H, hs = 2, 9, 2, 3
    q, k, v = (r.standard_normal((B, T, H * hs)) for _ in range(3))
    pad = np.zeros((B, 1, 1, T))
    pad[1, ..., 6:] = np.finfo(np.float64).min
    full = r.standard_normal((B, H, T, T))
    full_ro = full.copy()
    full_ro.flags.writeable = False
    masks = [None, pad, full, full_ro, np.broadcast_to(pad, (B, H, T, T))]
    for ver in VERSIONS:
        fwd, bwd = A.VERSIONS[ver]
        for mask in masks:
            out, cache = fwd(q, k, v, H, mask, 0.0, None, False)
            bwd(np.ones_like(out), cache)
            A.attention_probs(cache)
    kernels = [f for name, f in vars(A).items() if name.endswith("_kernel") and hasattr(f, "signatures")]
    assert len(kernels) >= 11, sorted(vars(A))
    for f in kernels:
        f64 = [s for s in f.signatures if "float64" in str(s[0])]
        want = 2 if f.py_func.__name__.startswith("_v6") else 1
        assert len(f64) == want, (f.py_func.__name__, [str(s[3]) for s in f64])
