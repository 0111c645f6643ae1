"""refbert.precision: the ULP arithmetic against hand-checked cases, the oracle study's rounding bound on every op,
and the device study of the CUDA kernels' fp16 / bf16 storage modes in Numba's simulator (tiny shapes)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from refbert import precision as P

HAVE_BF16 = "bfloat16" in P.storage_dtypes()
STORAGE = [np.float16] + ([P.storage_dtypes()["bfloat16"]] if HAVE_BF16 else [])
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ulp_hand_checked():
    f16 = np.float16
    assert P.ulp(1.0, f16) == 2.0 ** -10                 # 10 stored mantissa bits
    assert P.ulp(1.999, f16) == 2.0 ** -10               # same binade
    assert P.ulp(2.0, f16) == 2.0 ** -9
    assert P.ulp(0.75, f16) == 2.0 ** -11
    assert P.ulp(-0.75, f16) == 2.0 ** -11               # sign-free
    assert P.ulp(65504.0, f16) == 32.0                   # float16's largest finite number: 2^15 binade
    assert P.ulp(2.0 ** -14, f16) == 2.0 ** -24          # smallest normal
    assert P.ulp(1e-7, f16) == 2.0 ** -24                # subnormal: the fixed spacing
    assert P.ulp(0.0, f16) == 2.0 ** -24
    assert P.ulp(np.inf, f16) == 32.0
    np.testing.assert_array_equal(P.ulp(np.array([1.0, 3.0, 0.1]), f16), [2.0 ** -10, 2.0 ** -9, 2.0 ** -14])
    if HAVE_BF16:
        bf16 = P.storage_dtypes()["bfloat16"]
        assert P.ulp(1.0, bf16) == 2.0 ** -7             # 7 stored mantissa bits
        assert P.ulp(3.0, bf16) == 2.0 ** -6
        assert P.ulp(2.0 ** -126, bf16) == 2.0 ** -133   # float32's exponent range
        assert P.ulp(0.0, bf16) == 2.0 ** -133
    # the spacing agrees with NumPy's own for float16 across the range
    xs = np.array([1e-6, 3e-5, 0.01, 0.3, 1.0, 7.5, 1000.0, 6e4])
    np.testing.assert_array_equal(P.ulp(xs, f16), np.spacing(xs.astype(f16)).astype(np.float64))


def test_ulp_error_hand_checked():
    f16 = np.float16
    assert P.ulp_error(1 + 2.0 ** -10, 1.0, f16) == 1.0
    assert P.ulp_error(1.0, 1 + 2.0 ** -11, f16) == 0.5
    assert P.round_to(1 + 2.0 ** -11, f16) == 1.0        # a tie rounds to even: 0.5 ulp away
    assert P.round_to(1 + 3 * 2.0 ** -11, f16) == 1 + 2.0 ** -9
    assert P.ulp_error(np.float16(1.0), 1 + 2.0 ** -12, f16) == 0.25
    assert P.ulp_error(-np.inf, -np.inf, f16) == 0.0     # a masked score on both sides
    assert P.ulp_error(np.nan, 1.0, f16) == np.inf
    assert P.ulp_error(np.inf, 1.0, f16) == np.inf
    mx, mean, norm = P.summarize(np.array([1.0, 2.0 ** -20]), np.array([1.0 + 2.0 ** -10, 0.0]), f16)
    assert mx == 2.0 ** 4 and mean == (1 + 2.0 ** 4) / 2  # 2^-20 against 0: 2^-20 / 2^-24 = 16 ulp
    assert norm == 1.0                                   # max |diff| = 2^-10 against ulp(1.0)
    if HAVE_BF16:
        bf16 = P.storage_dtypes()["bfloat16"]
        assert P.ulp_error(1 + 2.0 ** -7, 1.0, bf16) == 1.0
        assert P.round_to(1 + 2.0 ** -9, bf16) == 1.0


@pytest.mark.parametrize("storage", STORAGE, ids=lambda d: np.dtype(d).name)
def test_rounding_float32_costs_at_most_half_an_ulp_more(storage):
    """Elementwise: |round(y) - x| <= 0.5 ulp(y) + |y - x|, with y the float32 result and x the float64 one; in
    units of ulp(x): 0.5 ulp(y) / ulp(x) + f32 error. Checked on every op, output and gradient, on the study's own
    numbers (which must also give a correctly rounded result wherever float32 alone is well under 0.01 ulp)."""
    for case in P.cases("tiny", seed=3, storage=storage):
        rounded = {k: P.round_to(v, storage) for k, v in case.inputs.items()}
        ref_out, ref_g, dout = P._reference(case, rounded, storage, 3)
        out, cache = getattr(P.ops, case.forward)(**{k: v.astype(np.float32) for k, v in rounded.items()},
                                                  **P._kw(case))
        g = P._as_tuple(getattr(P.ops, case.backward)(np.asarray(dout).astype(np.float32)[()], cache))
        for name, y, x in [("out", out, ref_out), *zip(case.wrt, g, ref_g)]:
            y = np.asarray(y, np.float64)
            got = P.ulp_error(P.round_to(y, storage), x, storage)
            bound = 0.5 * P.ulp(y, storage) / P.ulp(x, storage) + P.ulp_error(y, x, storage)
            assert (got <= bound + 1e-12).all(), (case.op, name, float((got - bound).max()))
            tight = P.ulp_error(y, x, storage) < 0.01
            assert (got[tight] <= 0.51).all(), (case.op, name)


def test_study_runs_for_every_op_and_dtype():
    rows = P.study(size="tiny")
    ops = {r[1] for r in rows}
    assert ops == set(P.OPS)
    assert {r[2] for r in rows} == set(P.storage_dtypes())
    for mode, op, dt, tensor, mx, mean, norm, f32, note in rows:
        assert mode == "oracle f32" and note == ""
        assert 0 <= mean <= mx < 1e6 and np.isfinite(norm) and f32 is not None, (op, dt, tensor)
        assert norm <= 2.0, (op, dt, tensor, norm)      # against the tensor's scale: a rounding or so
    # every gradient of every op is there
    want = {c.op: ["out"] + [f"d{w}" for w in c.wrt] for c in P.cases("tiny")}
    for op, tensors in want.items():
        assert [r[3] for r in rows if r[1] == op and r[2] == "float16"] == tensors
    table = P.format_table(rows)
    assert table.splitlines()[0].split() == ["mode", "op", "dtype", "tensor", "max", "ulp", "mean", "ulp", "norm",
                                             "ulp", "f32", "max", "note"]
    assert len(table.splitlines()) == len(rows) + 2


def test_main_prints_and_writes_json(tmp_path, capsys):
    path = tmp_path / "p.json"
    assert P.main(["--size", "tiny", "--dtypes", "float16", "--ops", "softmax", "bias_gelu", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "precision study (tiny shapes)" in out and "bias_gelu" in out and "layernorm" not in out
    data = json.loads(path.read_text())
    assert data["size"] == "tiny" and {r["op"] for r in data["rows"]} == {"softmax", "bias_gelu"}
    assert set(data["rows"][0]) == {"mode", "op", "dtype", "tensor", "max_ulp", "mean_ulp", "norm_ulp",
                                    "f32_max_ulp", "note"}


def test_float32_baseline_is_exact_in_float32_units():
    """--dtypes float32: the float32 oracle rounded to float32 is the float32 oracle: its error is its own."""
    rows = P.study(dtypes=["float32"], size="tiny", ops_=["bias_gelu"])
    for r in rows:
        assert r[4] == pytest.approx(r[7])


@pytest.mark.skipif(__import__("importlib.util").util.find_spec("numba_cuda") is None,
                    reason="needs numba-cuda (pip install 'refbert[cuda]')")
def test_device_study_in_simulator():
    """The kernels' fp16 / bf16 storage modes through the cuda backend in Numba's simulator, every op (~20 s)."""
    code = """
import sys; sys.setswitchinterval(1e-4)
import numpy as np
from refbert import precision as P
rows = P.study(size="tiny", device="cuda", modes=("device",))
for r in rows:
    print(r)
dev = [r for r in rows if r[0] == "sim kernel"]
assert {r[1] for r in dev} == set(P.OPS), {r[1] for r in dev}
assert not [r for r in dev if r[8]], [r for r in dev if r[8]]
for mode, op, dt, tensor, mx, mean, norm, f32, note in dev:
    # against the tensor's scale, one rounding on the store plus what the stored caches add: a few ulp at most
    assert norm <= 4.0, (op, dt, tensor, norm)
    if tensor == "out" and op not in ("cross_entropy",):
        assert mx <= 1.0, (op, dt, tensor, mx)            # forward outputs: rounded once from float32
print("OK", len(dev))
"""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "OK" in r.stdout


def test_gpu_bench_report_carries_the_study():
    """`refbert bench --device cuda` writes the same study as a markdown table (rendered here from the CPU rows)."""
    from refbert import bench_cuda, precision
    rows = precision.study(size="tiny", dtypes=["float16"], ops_=["layernorm"])
    md = bench_cuda.precision_md(rows, precision)
    assert md[2].startswith("| mode | op | dtype | tensor | max ulp")
    assert len(md) == 4 + len(rows) and all(r[1] in line for r, line in zip(rows, md[4:]))
