"""refbert.precision: the ULP arithmetic against hand-checked cases; the oracle study's rounding bound on every op,
element by element against the magnitude of the terms each element sums ("cond"); the float32 oracle's own error
against float64; the device study of the CUDA kernels' fp16 / bf16 storage modes in Numba's simulator (tiny
shapes); and the GPU study's largest ulp errors (bias_gelu db, attention dq) explained: the kernels' arithmetic,
written in NumPy, gives the GPU's numbers, each element within the rounding of its terms.
bfloat16 needs ml_dtypes (in the dev extra): without it the bfloat16 tests skip, by name (under CI they fail)."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from refbert import ops
from refbert import precision as P
from refbert.special import ndtr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STORAGE = ["float16", "bfloat16"]
H200 = os.path.join(ROOT, "benchmarks", "results", "cuda-nvidia-h200", "check_precision_first_run.json")  # Numba v3


def storage(name):
    """The storage dtype called `name`; bfloat16 skips without ml_dtypes (tests/conftest.py fails it under CI)."""
    if name == "bfloat16":
        pytest.importorskip("ml_dtypes", reason="bfloat16 storage needs ml_dtypes (pip install -e '.[dev]')")
    return P.dtype_of(name)


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
    # the spacing agrees with NumPy's own for float16 across the range
    xs = np.array([1e-6, 3e-5, 0.01, 0.3, 1.0, 7.5, 1000.0, 6e4])
    np.testing.assert_array_equal(P.ulp(xs, f16), np.spacing(xs.astype(f16)).astype(np.float64))


def test_ulp_hand_checked_bfloat16():
    bf16 = storage("bfloat16")
    assert P.ulp(1.0, bf16) == 2.0 ** -7                 # 7 stored mantissa bits
    assert P.ulp(3.0, bf16) == 2.0 ** -6
    assert P.ulp(2.0 ** -126, bf16) == 2.0 ** -133       # float32's exponent range
    assert P.ulp(0.0, bf16) == 2.0 ** -133
    assert P.ulp_error(1 + 2.0 ** -7, 1.0, bf16) == 1.0
    assert P.round_to(1 + 2.0 ** -9, bf16) == 1.0


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
    mx, mean, norm, cond = P.summarize(np.array([1.0, 2.0 ** -20]), np.array([1.0 + 2.0 ** -10, 0.0]), f16)
    assert mx == 2.0 ** 4 and mean == (1 + 2.0 ** 4) / 2  # 2^-20 against 0: 2^-20 / 2^-24 = 16 ulp
    assert norm == 1.0                                   # max |diff| = 2^-10 against ulp(1.0)
    assert cond == mx                                    # no terms given: each element's own magnitude
    # with terms: 2^-20 off an element whose terms add up to 1 (it cancelled to 0) is 2^-10 of an ulp of them
    _, _, _, cond = P.summarize(np.array([1.0, 2.0 ** -20]), np.array([1.0 + 2.0 ** -10, 0.0]), f16,
                                np.array([1.0 + 2.0 ** -10, 1.0]))
    assert cond == 1.0                                   # the first element's 2^-10 against ulp(1 + 2^-10)


def test_terms_are_the_oracle_on_absolute_values():
    """terms() by hand for the sums that cancel: softmax's dx, layernorm's db, dw and dx, bias_gelu's db, attention's
    dv (r = u32 / u of the storage only weighs the exp / erf arguments' float32 rounding: small in float16)."""
    cs = {c.op: c for c in P.cases("tiny", seed=1)}
    f16 = np.float16
    c = cs["softmax"]
    rounded = {k: P.round_to(v, f16) for k, v in c.inputs.items()}
    _, _, dout = P._reference(c, rounded, f16, 1)
    out, dx = P.terms(c, rounded, dout, f16)
    p = ops.softmax_forward(rounded["x"], c.kwargs["scale"], rounded["mask"])[0]
    # dx_i = scale (p_i dout_i - sum_j p_i p_j dout_j): scale p_i (|dout_i| + 2 sum_j p_j |dout_j|), as p_i p_j
    # holds two roundings of p
    want = c.kwargs["scale"] * p * (np.abs(dout) + 2 * (p * np.abs(dout)).sum(-1, keepdims=True))
    assert np.all(dx >= want) and np.allclose(dx, want, rtol=1e-2)   # + 2^-13 (|exp's argument| ~ 10) at most
    assert np.all(out >= p) and np.all(out[p == 0] == 0)
    c = cs["layernorm"]
    rounded = {k: P.round_to(v, f16) for k, v in c.inputs.items()}
    _, _, dout = P._reference(c, rounded, f16, 1)
    _, ds, dw, db = P.terms(c, rounded, dout, f16)
    np.testing.assert_array_equal(db, np.abs(dout).sum(0))                 # db = sum over rows of dout
    x = rounded["x"]
    rstd = 1 / np.sqrt(x.var(-1, keepdims=True) + 1e-12)
    xa = rstd * (np.abs(x) + np.abs(x).mean(-1, keepdims=True))             # |xhat|'s terms: (|x| + mean|x|) rstd
    np.testing.assert_allclose(dw, (np.abs(dout) * xa).sum(0))
    # ds = rstd (wdy - xhat mean(wdy xhat) - mean(wdy)), wdy = dout w: each of the three terms by magnitude
    wdy = np.abs(dout) * np.abs(rounded["w"])
    np.testing.assert_allclose(ds, rstd * (wdy + xa * (wdy * xa).mean(-1, keepdims=True) + wdy.mean(-1, keepdims=True)))
    c = cs["bias_gelu"]
    rounded = {k: P.round_to(v, f16) for k, v in c.inputs.items()}
    _, _, dout = P._reference(c, rounded, f16, 1)
    _, dx, db = P.terms(c, rounded, dout, f16)
    np.testing.assert_allclose(db, dx.sum(0))                               # db's terms: every row's du's
    c = cs["attention"]
    rounded = {k: P.round_to(v, f16) for k, v in c.inputs.items()}
    _, _, dout = P._reference(c, rounded, f16, 1)
    dv = P.terms(c, rounded, dout, f16)[3]
    _, cache = ops.attention_forward(**rounded, **P._kw(c))
    pd = ops.attention_probs(cache)                                           # p after dropout, (B, H, T, T)
    B, T, C = dout.shape
    H = c.kwargs["n_heads"]
    dh = np.abs(dout).reshape(B, T, H, C // H).transpose(0, 2, 1, 3)
    want = (pd.transpose(0, 1, 3, 2) @ dh).transpose(0, 2, 1, 3).reshape(B, T, C)
    assert np.all(dv >= want) and np.allclose(dv, want, rtol=1e-2)


@pytest.mark.parametrize("name", STORAGE)
def test_rounding_float32_costs_at_most_half_an_ulp_more(name):
    """Elementwise: |round(y) - x| <= 0.5 ulp(y) + |y - x|, with y the float32 result and x the float64 one; in
    units of ulp(x): 0.5 ulp(y) / ulp(x) + f32 error. Checked on every op, output and gradient, on the study's own
    numbers (which must also give a correctly rounded result wherever float32 alone is well under 0.01 ulp)."""
    dt = storage(name)
    for case in P.cases("tiny", seed=3, storage=dt):
        rounded = {k: P.round_to(v, dt) for k, v in case.inputs.items()}
        ref_out, ref_g, dout = P._reference(case, rounded, dt, 3)
        out, cache = getattr(P.ops, case.forward)(**{k: v.astype(np.float32) for k, v in rounded.items()},
                                                  **P._kw(case))
        g = P._as_tuple(getattr(P.ops, case.backward)(np.asarray(dout).astype(np.float32)[()], cache))
        for name_, y, x in [("out", out, ref_out), *zip(case.wrt, g, ref_g)]:
            y = np.asarray(y, np.float64)
            got = P.ulp_error(P.round_to(y, dt), x, dt)
            bound = 0.5 * P.ulp(y, dt) / P.ulp(x, dt) + P.ulp_error(y, x, dt)
            assert (got <= bound + 1e-12).all(), (case.op, name_, float((got - bound).max()))
            tight = P.ulp_error(y, x, dt) < 0.01
            assert (got[tight] <= 0.51).all(), (case.op, name_)


@pytest.mark.parametrize("name", STORAGE)
def test_study_every_element_within_half_an_ulp_of_its_terms(name):
    """The oracle study, every op, output and gradient: the float32 computation rounded once to the storage dtype.
    Elementwise ulps run far above 0.5 where a sum cancels (an element much smaller than its terms has a much
    smaller ulp), but against the magnitude of its terms no element may be more than one rounding off: cond <= 0.5
    plus the float32 computation's own share (u32 / u = 2^-13 of its terms per rounding in float16, 2^-16 in
    bfloat16: a few of them add 0.005 at most here). norm <= 0.5 + the same, a fortiori."""
    storage(name)
    rows = P.study(dtypes=[name], size="tiny")
    assert {r[1] for r in rows} == set(P.OPS)
    want = {c.op: ["out"] + [f"d{w}" for w in c.wrt] for c in P.cases("tiny")}   # every gradient of every op
    for op, tensors in want.items():
        assert [r[3] for r in rows if r[1] == op] == tensors
    for mode, op, dt, tensor, mx, mean, norm, cond, f32, note in rows:
        assert mode == "oracle f32" and dt == name and note == "" and f32 is not None, (op, tensor)
        assert 0 <= mean <= mx and 0 <= cond <= mx + 1e-12, (op, tensor, mean, mx, cond)   # cond: ulps of M >= |ref|
        assert cond <= 0.505 and norm <= 0.505, (op, dt, tensor, cond, norm)
    table = P.format_table(rows)
    assert table.splitlines()[0].split() == ["mode", "op", "dtype", "tensor", "max", "ulp", "mean", "ulp", "norm",
                                             "ulp", "cond", "ulp", "f32", "max", "note"]
    assert len(table.splitlines()) == len(rows) + 2


def test_cond_tells_a_wrong_element_from_cancellation():
    """An element off by 4 ulps of its own terms is a defect that neither norm (a larger element sets the scale)
    nor the elementwise max (cancelled elements elsewhere score higher) can single out: cond does."""
    f16 = np.float16
    case = next(c for c in P.cases("tiny", seed=0) if c.op == "bias_gelu")
    rounded = {k: P.round_to(v, f16) for k, v in case.inputs.items()}
    _, ref_g, dout = P._reference(case, rounded, f16, 0)
    m = P.terms(case, rounded, dout, f16)[2]                     # db's terms: sum over rows of |du|
    out, cache = ops.bias_gelu_forward(*(rounded[k].astype(np.float32) for k in ("x", "b")))
    db = P.round_to(ops.bias_gelu_backward(dout.astype(np.float32), cache)[1], f16)
    right = P.summarize(db, ref_g[1], f16, m)
    i = int(np.argmin(m))                                        # the column with the smallest terms
    wrong = db.copy()
    wrong[i] = P.round_to(wrong[i] + 4 * P.ulp(m[i], f16), f16)
    bad = P.summarize(wrong, ref_g[1], f16, m)
    assert right[3] <= 0.5 < 3.5 <= bad[3], (right, bad)        # cond: one rounding, then the defect
    assert bad[2] <= 2.0, bad                                    # norm would still pass it (its bound: 2)
    assert m.max() > 8 * m[i]                                    # because larger columns set the norm's scale


def test_float32_oracle_is_as_accurate_as_its_terms_allow():
    """--dtypes float32: the float32 oracle against the float64 oracle in float32 ulps ("rounding to float32" is
    the identity: max = f32 max). Elementwise errors reach hundreds of ulps where sums cancel (softmax dx), but
    against the magnitude of each element's terms (cond, the exp / erf arguments' rounding counted at full weight)
    the float32 oracle stays within a few roundings: a sum of n float32 terms is off by at most n/2 ulps of their
    magnitude, and a few ulps is what random rounding gives on these tiny shapes (n <= 24)."""
    rows = P.study(dtypes=["float32"], size="tiny")
    assert {r[1] for r in rows} == set(P.OPS)
    for mode, op, dt, tensor, mx, mean, norm, cond, f32, note in rows:
        assert mx == f32, (op, tensor)                   # rounding float32 to float32 changes nothing
        assert cond <= 4.0, (op, tensor, cond)
    assert max(r[4] for r in rows) > 100                 # the elementwise ulps that cond explains (cancellation)
    # independently of the study's plumbing: softmax's dx in float32 against float64, by hand
    case = next(c for c in P.cases("tiny", seed=0, storage=np.float32) if c.op == "softmax")
    x, mask, scale = case.inputs["x"], case.inputs["mask"], case.kwargs["scale"]
    x32 = x.astype(np.float32)
    d = P.round_to(np.random.default_rng(100).standard_normal(x.shape), np.float32)
    p64, c64 = ops.softmax_forward(x32.astype(np.float64), scale, mask.astype(np.float32).astype(np.float64))
    p32, c32 = ops.softmax_forward(x32, scale, mask.astype(np.float32))
    dx64, dx32 = ops.softmax_backward(d, c64), ops.softmax_backward(d.astype(np.float32), c32)
    row = next(r for r in rows if r[1] == "softmax" and r[3] == "dx")
    assert float(P.ulp_error(dx32, dx64, np.float32).max()) == pytest.approx(row[4], rel=1e-12)


def test_gpu_study_large_ulps_are_cancellation():
    """The first H200 study (cuda-nvidia-h200/check_precision_first_run.json, base shapes, fp16) found
    bias_gelu db 4655 ulp and attention dq 1388 ulp where norm was ~0.7 and ~0.5: a defect, or rounding of
    cancelling sums? The kernels' arithmetic written in NumPy float32 — bias_gelu v2: du stored in fp16 and summed
    as stored, 64 chunks of rows then the chunks in order; attention v3: out stored in fp16 and read back for
    D_i = dout_i . out_i — gives the GPU's numbers (db's max to 0.01%, dq's within one float16 ulp: its replica sums
    in BLAS's order; means to 1%: libdevice's erfc is not NumPy's),
    and every element within its terms' rounding: cond <= 1.5 (0.5 for the store, 1 for the one rounded
    intermediate). Cancellation, not a defect: with D from the float32 out, dq's max falls to a few ulps."""
    f16 = np.float16
    gpu = {(r["op"], r["tensor"]): r for r in json.load(open(H200))["rows"]
           if r["mode"] == "gpu kernel" and r["dtype"] == "float16"}
    cs = {c.op: c for c in P.cases("base", seed=0, storage=f16)}

    c = cs["bias_gelu"]
    rounded = {k: P.round_to(v, f16) for k, v in c.inputs.items()}
    _, ref_g, dout = P._reference(c, rounded, f16, 0)
    u = (rounded["x"] + rounded["b"]).astype(np.float32)
    phi = np.exp(np.float32(-0.5) * u * u) * np.float32(1 / math.sqrt(2 * math.pi))
    du = (dout.astype(np.float32) * (ndtr(u).astype(np.float32) + u * phi)).astype(f16)   # dx as stored
    R = du.shape[0]
    per = max(1, -(-R // 64))
    db = np.zeros(du.shape[1], np.float32)
    for start in range(0, R, per):                               # a chunk's rows in order, then the chunks in order
        part = np.zeros_like(db)
        for r in range(start, min(R, start + per)):
            part += du[r].astype(np.float32)
        db += part
    mx, mean, norm, cond = P.summarize(db.astype(f16), ref_g[1], f16, P.terms(c, rounded, dout, f16)[2])
    want = gpu[("bias_gelu", "db")]
    assert mx == pytest.approx(want["max_ulp"], rel=1e-4) and mean == pytest.approx(want["mean_ulp"], rel=1e-2)
    assert norm == pytest.approx(want["norm_ulp"], rel=1e-2) and mx > 1000 and cond <= 1.5, (mx, mean, norm, cond)

    c = cs["attention"]
    rounded = {k: P.round_to(v, f16) for k, v in c.inputs.items()}
    _, ref_g, dout = P._reference(c, rounded, f16, 0)
    m = P.terms(c, rounded, dout, f16)[1]
    out, (qh, kh, vh, _, sm, do) = ops.attention_forward(**{k: v.astype(np.float32) for k, v in rounded.items()},
                                                         **P._kw(c))
    B, H, T, hs = qh.shape
    heads = lambda a: a.reshape(B, T, H, hs).transpose(0, 2, 1, 3)          # noqa: E731  (B, H, T, hs)
    dh = heads(dout.astype(np.float32))
    dp = (do.keep * np.float32(do.scale)) * (dh @ vh.transpose(0, 1, 3, 2))  # (B, H, T, T)
    for o, bound in ((out.astype(f16).astype(np.float32), None), (out, 4.0)):  # out as stored; as computed
        D = (dh * heads(o)).sum(-1, keepdims=True)                           # (B, H, T, 1)
        dq = (np.float32(sm.scale) * (sm.p * (dp - D)) @ kh).transpose(0, 2, 1, 3).reshape(B, T, H * hs)
        mx, mean, norm, cond = P.summarize(dq.astype(f16), ref_g[0], f16, m)
        assert cond <= 1.5, (mx, cond)
        if bound is None:
            want = gpu[("attention", "dq")]
            # the replica's float32 products (dh @ vh, (p (dp - D)) @ kh) sum in the order of NumPy's BLAS, which
            # is neither the GPU's nor the same in every OpenBLAS build (numpy 2.4.6's gives 1387.41 where others
            # gave the GPU's 1387.91): an element's float16 store may then round the other way, moving its error
            # by up to one float16 ulp, so the largest error is held to the GPU's within 1 ulp
            assert abs(mx - want["max_ulp"]) <= 1.0 and mean == pytest.approx(want["mean_ulp"], rel=1e-2), (mx, mean)
            assert norm == pytest.approx(want["norm_ulp"], rel=1e-2) and mx > 1000, norm
        else:
            assert mx <= bound, mx                                               # D's rounding made the 1388


def test_main_prints_and_writes_json(tmp_path, capsys):
    path = tmp_path / "p.json"
    assert P.main(["--size", "tiny", "--dtypes", "float16", "--ops", "softmax", "bias_gelu", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "precision study (tiny shapes)" in out and "bias_gelu" in out and "layernorm" not in out
    data = json.loads(path.read_text())
    assert data["size"] == "tiny" and {r["op"] for r in data["rows"]} == {"softmax", "bias_gelu"}
    assert set(data["rows"][0]) == {"mode", "op", "dtype", "tensor", "max_ulp", "mean_ulp", "norm_ulp", "cond_ulp",
                                    "f32_max_ulp", "note"}


@pytest.mark.skipif(__import__("importlib.util").util.find_spec("numba_cuda") is None,
                    reason="needs numba-cuda (pip install 'refbert[cuda]')")
def test_device_study_in_simulator():
    """The kernels' fp16 / bf16 storage modes through the cuda backend in Numba's simulator, every op (~20 s):
    every element within the rounding of its terms (cond <= 1.5: 0.5 for the store, 1 for the one intermediate a
    kernel keeps in storage — softmax's p, attention's out read back for D, bias_gelu's du summed as stored —
    whatever the cancellation: the elementwise max reaches ~90 ulp on softmax's dx), forward outputs rounded
    once from float32."""
    storage("bfloat16")
    code = """
import numpy as np
from refbert import precision as P
rows = P.study(size="tiny", device="cuda", modes=("device",))
for r in rows:
    print(r)
dev = [r for r in rows if r[0] == "sim kernel"]
assert {r[1] for r in dev} == set(P.OPS), {r[1] for r in dev}
assert {r[2] for r in dev} == {"float16", "bfloat16"}, {r[2] for r in dev}
assert not [r for r in dev if r[9]], [r for r in dev if r[9]]
for mode, op, dt, tensor, mx, mean, norm, cond, f32, note in dev:
    assert cond <= 1.5, (op, dt, tensor, cond)
    if tensor == "out" and op not in ("cross_entropy",):
        assert mx <= 0.5 + 1e-3, (op, dt, tensor, mx)     # forward outputs: rounded once from float32
print("OK", len(dev), "max ulp", max(r[4] for r in dev))
"""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "OK 50" in r.stdout, r.stdout[-3000:]


def test_gpu_bench_report_carries_the_study():
    """`refbert bench --device cuda` writes the same study as a markdown table (rendered here from the CPU rows)."""
    from refbert import bench_cuda, precision
    rows = precision.study(size="tiny", dtypes=["float16"], ops_=["layernorm"])
    md = bench_cuda.precision_md(rows, precision)
    assert md[2].startswith("| mode | op | dtype | tensor | max ulp") and "| cond ulp |" in md[2]
    assert len(md) == 4 + len(rows) and all(r[1] in line for r, line in zip(rows, md[4:]))


def test_summarize_mean_and_nan_by_hand():
    """Three elements off by 0, 1 and 8 float16 ulps: max 8, mean 3 (not the median, 1); a NaN on both sides
    counts 0 (as equal infinities do), a NaN on one side inf."""
    f16 = np.float16
    ref = np.array([1.0, 1.0, 2.0])
    got = ref + np.array([0.0, 2.0 ** -10, 8 * 2.0 ** -9])
    mx, mean, norm, _ = P.summarize(got, ref, f16)
    assert (mx, mean) == (8.0, 3.0)
    assert norm == 8.0                                   # the largest |diff|, 2^-6, against ulp(2.0) = 2^-9
    assert P.ulp_error(np.nan, np.nan, f16) == 0.0 and P.ulp_error(1.0, np.nan, f16) == np.inf


def test_summarize_matched_infinities_and_a_nan_on_one_side():
    """A tensor that is all -inf on both sides (a fully masked row of scores) summarizes to four zeros, not a NaN
    from inf - inf; a NaN on one side makes every measure that sees it inf (cond too: not NaN, which max() would
    spread and a reader could not tell from "no data")."""
    f16 = np.float16
    with np.errstate(all="raise"):
        assert P.summarize(np.array([-np.inf, -np.inf]), np.array([-np.inf, -np.inf]), f16) == (0.0, 0.0, 0.0, 0.0)
    mx, mean, _, cond = P.summarize(np.array([np.nan, 1.0]), np.array([1.0, 1.0]), f16)
    assert mx == mean == cond == np.inf


def test_softmax_out_terms_count_the_normaliser_by_hand():
    """terms() for softmax's output, as the docstring of its probs() writes it: p (1 + r (|arg_i| + sum_j p_j
    |arg_j|)), arg = the magnitudes of s - m's terms (|x scale| + |mask| + |max z|) and r = u32 / u (2^-23 / 2^-10 in
    float16): the normaliser's rounding moves every p of a row by the same factor, so the row's sum enters each
    element."""
    c = {c.op: c for c in P.cases("tiny", seed=1)}["softmax"]
    f16 = np.float16
    rounded = {k: P.round_to(v, f16) for k, v in c.inputs.items()}
    _, _, dout = P._reference(c, rounded, f16, 1)
    out = P.terms(c, rounded, dout, f16)[0]
    x, mask, scale = rounded["x"], rounded["mask"], c.kwargs["scale"]
    p = ops.softmax_forward(x, scale, mask)[0]
    z = x * scale + mask
    arg = np.where(p > 0, np.abs(x * scale) + np.abs(mask) + np.abs(z.max(-1, keepdims=True)), 0.0)
    r = 2.0 ** -23 / 2.0 ** -10
    np.testing.assert_allclose(out, p * (1 + r * (arg + (p * arg).sum(-1, keepdims=True))), rtol=1e-12)


def test_dtype_of_refuses_an_unknown_name():
    """A dtype that is not one of the study's: a ValueError naming the argument, the choices and what came."""
    with pytest.raises(ValueError, match=r"dtype expected one of float32, float16.*got 'float8'"):
        P.dtype_of("float8")


def test_terms_bound_every_reference_element():
    """A sum's magnitude is at most the sum of its terms' magnitudes: for every op, output and gradient,
    terms() >= |the float64 reference| element by element (a term left out of terms(), e.g. cross-entropy's
    one-hot or softmax's row sum in attention, breaks it where that term dominates). Exact arithmetic holds with
    equality at most; float64 rounding of both sides: 1e-12 relative."""
    for name, dt in (("float16", np.float16), ("float32", np.float32)):
        for c in P.cases("tiny", seed=2, storage=dt):
            rounded = {k: P.round_to(v, dt) for k, v in c.inputs.items()}
            ref_out, ref_g, dout = P._reference(c, rounded, dt, 2)
            mags = P.terms(c, rounded, dout, dt)
            assert len(mags) == 1 + len(ref_g), c.op
            for tensor, ref, m in zip(["out", *c.wrt], [ref_out, *ref_g], mags):
                ref = np.abs(ref[np.isfinite(ref)]) if tensor == "out" else np.abs(ref)
                m = np.asarray(m)[np.isfinite(ref_out)] if tensor == "out" else np.broadcast_to(m, ref.shape)
                assert (m >= ref * (1 - 1e-12)).all(), (name, c.op, tensor, float((ref - m).max()))


@pytest.mark.parametrize("op", ["layernorm", "softmax", "cross_entropy"])
def test_oracle_rows_are_float32_rounded_once_to_storage(op):
    """run_oracle's row for each tensor, recomputed by hand from refbert.ops: the float32 result rounded once to
    float16 against the float64 reference on the same rounded inputs (max, mean, norm), and the "f32 max" column
    the float32 result before that rounding. The same arithmetic on the same numbers: equal to 1e-12."""
    f16 = np.float16
    c = next(c for c in P.cases("tiny", seed=4) if c.op == op)
    rounded = {k: P.round_to(v, f16) for k, v in c.inputs.items()}
    ref_out, ref_g, dout = P._reference(c, rounded, f16, 4)
    out, cache = getattr(ops, c.forward)(**{k: v.astype(np.float32) for k, v in rounded.items()}, **P._kw(c))
    g = P._as_tuple(getattr(ops, c.backward)(np.asarray(dout).astype(np.float32)[()], cache))
    rows = P.run_oracle(c, f16, 4)
    assert [r[0] for r in rows] == ["out", *(f"d{w}" for w in c.wrt)]
    for row, y, x in zip(rows, [out, *g], [ref_out, *ref_g]):
        y = np.asarray(y, np.float64)
        e = P.ulp_error(P.round_to(y, f16), x, f16)
        diff = np.abs(P.round_to(y, f16) - x)[np.isfinite(x)]
        norm = diff.max() / P.ulp(np.abs(x[np.isfinite(x)]).max(), f16)
        assert row[1:4] == pytest.approx((e.max(), e.mean(), norm), rel=1e-12), (op, row[0])
        assert row[5] == pytest.approx(P.ulp_error(y, x, f16).max(), rel=1e-12), (op, row[0])
    assert any(r[1] != r[5] for r in rows)               # the final rounding shows: the two columns differ


def test_model_study_errors_recomputed_by_hand():
    """model_study's float32 and fp16-mixed runs, recomputed from the model directly: one eval-mode step of
    BertForPreTraining on the study's batch, float32 (and the fp16 spec through the study's reported loss scale,
    divided out) against float64, every parameter's gradient reported, its error max |g - g64| / max(max |g64|,
    1% of the largest |g64| of the model), the loss's |l - l64| / |l64|. The same arithmetic: equal to 1e-12.
    u (half an ulp of 1): 2^-8 for bfloat16, 2^-11 for float16, none for float32."""
    from refbert import model as M
    from refbert.config import BertConfig
    d = P.model_study("tiny", precisions=("fp16-mixed",), peer=False)
    s = P.MODEL_SIZES["tiny"]
    cfg = BertConfig.preset("tiny", vocab_size=s["vocab_size"], max_position_embeddings=512)
    batch = P._batch(s["B"], s["T"], cfg.vocab_size, 0)
    m64 = M.BertForPreTraining(cfg, seed=0, dtype=np.float64).eval()
    l64 = float(m64(**batch).loss)
    g64 = m64.backward()
    floor = 0.01 * max(np.abs(v).max() for v in g64.values())
    assert [t["name"] for t in d["tensors"]] == list(M.BertForPreTraining(cfg).parameters())
    for run, prec, scale in (("refbert float32", "fp32", 1.0), ("refbert fp16-mixed", "fp16-mixed",
                                                                d["scales"]["refbert fp16-mixed"])):
        m = M.BertForPreTraining(cfg, seed=0, dtype=np.float32, precision=prec).eval()
        for k in m.params:
            m.params[k][...] = m64.params[k]
        loss = float(m(**batch).loss)
        g = {k: np.asarray(v, np.float64) / scale for k, v in m.backward(scale).items()}
        assert d["loss"][run][1] == pytest.approx(abs(loss - l64) / abs(l64), rel=1e-12), run
        for t in d["tensors"]:
            sc = max(np.abs(g64[t["name"]]).max(), floor)
            assert t["errs"][run] == pytest.approx(np.abs(g[t["name"]] - g64[t["name"]]).max() / sc, rel=1e-12), \
                (run, t["name"])
    assert (P._u("refbert bf16-mixed"), P._u("refbert fp16-mixed"), P._u("refbert float32")) == \
        (2.0 ** -8, 2.0 ** -11, None)
