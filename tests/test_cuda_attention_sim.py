"""Every Numba CUDA attention version (kernels/cuda/attention.py) against the oracle refbert.ops.attention_*, run
in Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1: one Python thread per GPU thread, so tiny shapes only).

The simulator must be switched on before numba.cuda is first imported, so the checks run in child processes
(`python tests/test_cuda_attention_sim.py <part>`) and the main pytest process keeps the real numba.cuda. Two
children run side by side (fp64/fp32 + probabilities + errors, and fp16/bf16), ~35 s each on 2 cores.

What is checked, at A.SHAPES (T = 1, 5, 17 against 4-row tiles; B, H = 1..2; hs 4..8; HF finfo.min padding with
a sequence of one real token; -inf padding; a causal mask; dropout 0.2 in training):
  - out, dq, dk, dv of each version: fp64 / fp32 against the oracle in the same dtype, tolerances in A.SPEC.tol
    (reasons in kernels/cuda/attention.py's docstring); fp16 / bf16 against the float64 oracle on the same rounded
    inputs, 8 ulp of the storage type;
  - attention_probs(cache): the dropped elements are exactly the oracle's (same zeros), values within tolerance;
  - the oracle's ValueErrors, raised before any launch, with the oracle's messages.
"""
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("full", "lowp")


def _child(part):
    import numpy as np
    from refbert import ops
    from refbert.philox import DropoutRNG
    from refbert_kernels.cuda import _common as C
    from refbert_kernels.cuda import attention as A
    assert C.SIM, "the simulator must be on (NUMBA_ENABLE_CUDASIM=1)"

    if part == "lowp":
        C.check_specs(A.SPECS, "sim", [np.float16] + ([C.BF16] if C.BF16 is not None else []))
        return

    C.check_specs(A.SPECS, "sim", [np.float64, np.float32])

    # attention_probs: the zeros (dropped elements) are exactly the oracle's; the values within tolerance
    for dtype in (np.float64, np.float32):
        atol, rtol = A.SPEC.tol[dtype]
        for shape in (dict(B=2, T=17, H=2, hs=4, mask="hf", p=0.2), dict(B=1, T=5, H=1, hs=8, mask="ninf", p=0.5)):
            inputs, kw = A.make_inputs(shape, dtype, 3)
            kw = dict(kw, rng=DropoutRNG(77))
            _, ref_cache = ops.attention_forward(**inputs, **kw)
            ref = ops.attention_probs(ref_cache)
            for v, (fwd, _) in A.VERSIONS.items():
                rng = DropoutRNG(77)
                _, cache = fwd(**inputs, **dict(kw, rng=rng))
                assert rng.calls == 1, "one dropout stream per call"
                got = A.attention_probs(cache)
                assert got.shape == ref.shape and got.dtype == ref.dtype
                assert np.array_equal(got == 0, ref == 0), f"v{v} {shape}: dropped elements differ from the oracle"
                assert (ref == 0).any() and (ref != 0).any()
                np.testing.assert_allclose(got, ref, atol=atol, rtol=rtol)   # the forward's tolerance (p <= 1/(1-p))
    print("  attention_probs: dropped elements identical to the oracle's, fp64 and fp32", flush=True)

    # the oracle's ValueErrors, same messages
    r = np.random.default_rng(0)
    x = r.standard_normal((2, 5, 6)).astype(np.float32)
    bad = [
        ((x, x, x.astype(np.float64), 3), {}),
        ((x, x, x[:, :4], 3), {}),
        ((x, x, x, 4), {}),
        ((x, x, x, 3), dict(mask=np.zeros((2, 1, 5, 4), np.float32))),
        ((x, x, x, 3), dict(dropout_p=1.5)),
        ((x, x, x, 3), dict(dropout_p=0.1, rng=None)),
        ((x, x, x, 3), dict(mask=np.full((2, 1, 1, 5), -np.inf, np.float32))),
        ((x[0], x[0], x[0], 3), {}),
    ]
    for args, kw in bad:
        with_oracle = None
        try:
            ops.attention_forward(*args, **kw)
        except ValueError as e:
            with_oracle = str(e)
        assert with_oracle is not None, (args[3], kw)
        for v, (fwd, _) in A.VERSIONS.items():
            try:
                fwd(*args, **kw)
            except ValueError as e:
                assert str(e) == with_oracle, (v, str(e), with_oracle)
            else:
                raise AssertionError(f"v{v}: no ValueError for {kw}, the oracle says {with_oracle}")
    out, cache = A.attention_forward(x, x, x, 3)
    for d in (x.astype(np.float64), x[:, :4]):
        with pytest.raises(ValueError, match="argument 'dout'"):
            A.attention_backward(d, cache)
    assert type(out) is np.ndarray and out.dtype == np.float32
    print("  ValueErrors: the oracle's, before any launch", flush=True)


def _run(part):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, __file__, part], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def test_attention_versions_in_simulator():
    pytest.importorskip("numba")
    with ThreadPoolExecutor(len(PARTS)) as ex:
        results = list(ex.map(_run, PARTS))
    for part, res in zip(PARTS, results):
        print(res.stdout)
        assert res.returncode == 0, f"simulator part {part!r} failed:\n{res.stdout}\n{res.stderr[-4000:]}"


if __name__ == "__main__":
    _child(sys.argv[1])
