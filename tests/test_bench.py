"""`refbert bench`: the tooling runs, writes its files, never times a version that fails validation, and its GEMM
floor holds every matrix product of the pretraining step. Speed is never tested, only measured."""
import json
import os

import numpy as np
import pytest

import refbert
from refbert import bench, cli, ops

# A kernel file built from refbert.ops itself: v1 is the oracle (passes), v2 is 1% off (fails the tolerance), v3
# raises. The torch peer is a NumPy callable, so the test needs no torch.
FAKE_KERNEL = '''
import numpy as np
from refbert import ops
from refbert_kernels._harness import KernelSpec


def forward_v1(x, scale=1.0, mask=None):
    return ops.softmax_forward(x, scale, mask)


def forward_v2(x, scale=1.0, mask=None):
    out, cache = ops.softmax_forward(x, scale, mask)
    return out * x.dtype.type(1.01), cache


def forward_v3(x, scale=1.0, mask=None):
    raise RuntimeError("boom")


def make_inputs(shape, dtype, seed):
    x = np.random.default_rng(seed).standard_normal((shape["B"], shape["T"])).astype(dtype)
    return dict(x=x), dict(scale=0.5)


def peer(inputs, kwargs):
    return lambda: ops.softmax_backward(np.ones_like(inputs["x"]), ops.softmax_forward(inputs["x"], **kwargs)[1])


SPEC = KernelSpec(name="fake_softmax", oracle=(ops.softmax_forward, ops.softmax_backward),
                  versions={1: (forward_v1, ops.softmax_backward), 2: (forward_v2, ops.softmax_backward),
                            3: (forward_v3, ops.softmax_backward)},
                  make_inputs=make_inputs, wrt=("x",), shapes=[dict(B=1, T=1), dict(B=3, T=37)],
                  bench_shape=dict(B=64, T=512), tol={np.float64: (1e-12, 1e-11), np.float32: (1e-6, 1e-5)},
                  nbytes=lambda i, k: 5 * i["x"].nbytes, flops=lambda i, k: 10 * i["x"].size, torch_peer=peer,
                  notes={1: "the oracle", 2: "1% off", 3: "raises"})
'''


@pytest.fixture
def fake_kernels(tmp_path, monkeypatch):
    (tmp_path / "fake_kernels.py").write_text(FAKE_KERNEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))  # subprocesses
    import fake_kernels
    monkeypatch.setattr(bench, "discover_specs", lambda: ([("fake_kernels", "SPEC", fake_kernels.SPEC)],
                                                          [("refbert_kernels.missing", "ModuleNotFoundError: x")]))
    return fake_kernels


def test_bench_kernels_quick_writes_results_and_never_times_a_failing_version(fake_kernels, tmp_path, capsys):
    out = tmp_path / "results"
    rc = cli.main(["bench", "--quick", "--only", "kernels", "--out", str(out), "--no-plot"])
    assert rc == 1                                            # a version failed validation
    md = (out / "kernels.md").read_text()
    data = json.loads((out / "kernels.json").read_text())
    assert data["quick"] and data["command"].startswith("refbert bench") and data["machine"]["numpy"]
    assert data["copy_bandwidth_Bps"] > 0
    (k,) = data["kernels"]
    status = {r["version"]: r["status"] for r in k["validation"]}
    assert status == {1: "PASS", 2: "FAIL", 3: "FAIL"}
    v1, v2, v3 = k["validation"]
    assert v1["err_tol"]["float64"] <= 1 and v1["err_tol"]["float32"] <= 1
    assert v2["err_tol"]["float32"] > 1 and v2["max_abs"]["float32"] > 0 and "MISMATCH" in v2["log"]
    assert "boom" in v3["error"]
    assert [r["impl"] for r in k["timing"]["rows"]] == ["numpy", "torch", "v1"]   # v2, v3 not timed
    assert k["timing"]["shape"]["B"] < 64                     # --quick shrinks the bench shape
    for r in k["timing"]["rows"]:
        assert r["fwd_bwd_s"] > 0 and r["GBps"] > 0 and r["pct_copy"] > 0 and r["GFLOPs"] > 0
        assert r["speedup_vs_numpy"] > 0 and r["speedup_vs_torch"] > 0
    assert "Not timed (failed validation): v2, v3." in md and "| v2 |" in md and "FAIL" in md
    assert "refbert_kernels.missing" in md                   # a missing kernel file is reported, not fatal
    # compile time: a cold (empty NUMBA_CACHE_DIR) and a warm process, every version called once
    c = data["compile"]["fake_kernels"]
    assert isinstance(c["cold"]["calls"]["fake_softmax v1"], float) and c["warm"]["import_s"] >= 0
    assert "boom" in c["cold"]["calls"]["fake_softmax v3"]
    assert "fake_softmax" in capsys.readouterr().out


@pytest.mark.parametrize("args, named", [(["--repeats", "0"], "--repeats"), (["--repeats", "-2"], "--repeats"),
                                         (["--memory-T", "128", "0"], "--memory-T"),
                                         (["--attention-T", "-1"], "--attention-T"), (["--step-T", "0"], "--step-T")])
def test_bench_refuses_counts_below_one_by_name(args, named, capsys):
    """Repeats and sequence lengths are integers >= 1: 0 or a negative is argparse's one-line error naming the
    option (it ran before: --repeats 0 fell back to the default unseen, -2 ended in "no median for empty data",
    --memory-T 0 wrote a table of errors)."""
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {named}: expected an integer >= 1, got {args[-1]}" in err, err


@pytest.mark.parametrize("args", [["--repeats", "0"], ["--attention-T", "512", "-1"], ["--step-T", "0"]])
def test_the_gpu_bench_refuses_counts_below_one_by_name(args, capsys):
    """The GPU bench's own parser (`python -m refbert.bench_cuda`, what benchmarks/gpu_all.sh runs) refuses the
    same counts as `refbert bench`, by argparse's one line naming the option; --step's B and T too, before any GPU
    is looked for."""
    from refbert import bench_cuda
    with pytest.raises(SystemExit) as e:
        bench_cuda.parse(args)
    assert e.value.code == 2 and f"argument {args[0]}: expected an integer >= 1, got {args[-1]}" in \
        capsys.readouterr().err
    for bad in ("0x128", "32x0"):
        with pytest.raises(ValueError, match=f"--step expected BxT with B and T >= 1, got '{bad}'"):
            bench_cuda.step_shapes(bench_cuda.parse(["--step", "32x128", bad]))
    assert bench_cuda.step_shapes(bench_cuda.parse(["--step", "32x128", "8X512"])) == [(32, 128), (8, 512)]


def test_bench_refuses_an_unknown_kernel_name(tmp_path, capsys):
    """--kernels with a name no kernel file defines: one line naming it and the choices, exit 2, nothing timed or
    written (it wrote an empty table before); with a file that failed to import the name may be its, so the run
    goes on and reports that file."""
    code = cli.main(["bench", "--only", "kernels", "--kernels", "layernorm", "layrenorm", "--quick",
                     "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "argument --kernels expected names among" in err and "'layrenorm'" in err, err
    assert "'layernorm'" not in err.split("got")[-1] and not (tmp_path / "out").exists()
    bench.unknown_kernels(["x"], ["layernorm"], errors=[("gelu", "ImportError: ...")])     # no raise


def test_shrink_shape_keeps_kind_and_cuts_size():
    assert bench.shrink_shape(dict(B=4, H=12, T=512, mask="pad"), 128, 2 ** 18) == dict(B=1, H=12, T=128,
                                                                                        mask="pad")
    s = bench.shrink_shape(dict(shape=(4, 12, 512, 512), p=0.1), 128, 2 ** 18)
    assert len(s["shape"]) == 4 and np.prod(s["shape"]) <= 2 ** 18 and s["p"] == 0.1
    assert np.prod(bench.shrink_shape(dict(shape=(2048, 3072)), 8, 512)["shape"]) <= 1024


class _Counting:
    """refbert.ops with the matmul-bearing ops recorded: (rows, in, out) of each linear, attention calls."""

    def __init__(self):
        self.fwd, self.bwd, self.attention = [], [], 0

    def __getattr__(self, name):
        return getattr(ops, name)

    def linear_forward(self, x, w, b=None):
        self.fwd.append((int(np.prod(x.shape[:-1])), w.shape[1], w.shape[0]))
        return ops.linear_forward(x, w, b)

    def linear_backward(self, dout, cache):
        x, w, _ = cache
        self.bwd.append((int(np.prod(x.shape[:-1])), w.shape[1], w.shape[0]))
        return ops.linear_backward(dout, cache)

    def attention_forward(self, *args, **kwargs):
        self.attention += 1
        return ops.attention_forward(*args, **kwargs)


def test_gemm_floor_covers_every_matmul_of_the_step():
    cfg = refbert.BertConfig.preset("tiny", vocab_size=100)  # L2 C128 I512 A2
    B, T = 2, 8
    x = bench.batch(B, T, cfg.vocab_size)
    n = int((x["labels"] != -100).sum())
    P = bench.gemm_products(cfg, B, T, n)
    # hand count: per layer q, k, v, attention.output, intermediate, output = 6 linears x 3 products (forward,
    # dx, dW) = 18, plus 6 attention products (q k^T, p v, dp, dv, dq, dk) = 24, x 2 layers = 48; pooler 3, NSP 3,
    # MLM transform 3, decoder 3 (forward on all rows, dt and dE on the labelled rows) = 12; total 60
    assert len(P) == 60 == 24 * cfg.num_hidden_layers + 12
    # the products of one real step: every linear forward and backward, every attention call
    model = refbert.BertForPreTraining(cfg, seed=0, dtype=np.float32)
    model.ops = counting = _Counting()
    model.forward(**x)
    model.backward()
    N, C, V = B * T, cfg.hidden_size, cfg.vocab_size
    fwd = sorted((m, k, nn) for name, (b, m, k, nn), _, _ in P if name.split()[1] == "fwd")
    step_fwd = list(counting.fwd)
    step_fwd.remove((n, C, V))                                # "all" decodes the labelled rows a second time for
    assert sorted(step_fwd) == fwd                            # the loss: not part of the floor
    dx = sorted((m, nn, k) for name, (b, m, k, nn), _, _ in P if "bwd dx" in name or "bwd dt" in name)
    assert sorted(counting.bwd) == dx                         # the decoder's backward: labelled rows only
    assert sum("bwd dW" in name or "bwd dE" in name for name, *_ in P) == len(counting.bwd)
    assert sum("attention " in name for name, *_ in P) == 6 * counting.attention == 6 * cfg.num_hidden_layers
    # and the floor runs them all, with consistent shapes
    bench.gemm_floor(P)()
    assert bench.gemm_flops(P) > bench.gemm_flops(bench.gemm_products(cfg, B, T, n, decode="labelled"))


def test_gemm_flops_by_hand():
    """2 b m k n per product (a multiply and an add per term of each of the b m n outputs), summed: (3, 4, 5, 6)
    is 720, (1, 2, 2, 2) 16."""
    assert bench.gemm_flops([("a", (3, 4, 5, 6), False, False), ("b", (1, 2, 2, 2), True, False)]) == 720 + 16


def test_step_checks_read_as_one_clause_each():
    """Every check line of step.md names the run, what it was compared with and the number that decided it."""
    losses = {"refbert numpy (all)": 11.0769, "refbert numba (all)": 11.0769 * (1 + 8.5e-8),
              "refbert numba (labelled)": 11.0769 * (1 + 3e-4), "HF + PyTorch": 11.0769 * (1 - 8.6e-8)}
    ev = {c["run"]: c for c in bench.loss_checks(losses, "eval")}
    assert ev["refbert numba (all)"]["ok"] and ev["HF + PyTorch"]["ok"]
    assert not ev["refbert numba (labelled)"]["ok"]                   # 3e-4 > 1e-4
    assert bench._check_text(ev["HF + PyTorch"]) == "HF + PyTorch vs refbert numpy (all), rel <= 1e-4: 8.6e-08 ok"
    assert bench._check_text(ev["refbert numba (labelled)"]).endswith("rel <= 1e-4: 3.0e-04 FAIL")
    tr = {c["run"]: c for c in bench.loss_checks({**losses, "HF + PyTorch": 11.0635}, "train")}
    assert tr["HF + PyTorch"]["ok"]                                   # torch's own masks: only finite
    assert bench._check_text(tr["HF + PyTorch"]) == ("HF + PyTorch loss finite (its dropout masks are torch's own: "
                                                     "not compared): 11.0635 ok")
    assert not bench.loss_checks({**losses, "HF + PyTorch": float("nan")}, "train")[-1]["ok"]
    result = dict(size="tiny", preset="tiny", B=2, T=8, layers=2, hidden=128, heads=2, vocab=100, n_labelled=3,
                  mode="eval", dropout=0.0, repeats=1, checks=list(ev.values()), rows=[],
                  floor_gflop=dict(all=1.0, labelled=0.5), floor_products=dict(all=60, labelled=60))
    md = "\n".join(bench._step_md(dict(unavailable={}, results=[result], products={})))
    assert "- HF + PyTorch vs refbert numpy (all), rel <= 1e-4: 8.6e-08 ok" in md
    assert "- refbert numba (all) vs refbert numpy (all), rel <= 1e-4: 8.5e-08 ok" in md


def test_bench_says_when_it_writes_no_png(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)     # import matplotlib -> ImportError
    paths = bench._write(str(tmp_path), "step", "title", bench.machine(), "refbert bench", False, ["x"], {},
                         plot=lambda plt: None)
    assert [os.path.basename(p) for p in paths] == ["step.md", "step.json"]
    assert "step.png not written: matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / "step.png").exists()


def test_timings_say_when_other_processes_used_the_machine(monkeypatch):
    """The share of CPU time others used while a section was timed: the measure behind the --quick bench's GEMM
    floor of 963 ms in one section and 40 ms in the next (another process held a core: BLAS's threads wait for each
    other). Our own ticks do not count; the hypervisor's steal does."""
    ticks = iter([(1000, 100, 50), (1400, 300, 250)])                # total, busy + steal, own: 400, 200, 200
    monkeypatch.setattr(bench, "_cpu_ticks", lambda: next(ticks))
    with bench.Interference() as load:
        pass
    assert load.share == 0.0 and not load.busy                       # all of the busy time was ours
    ticks = iter([(1000, 100, 50), (1400, 500, 150)])                # 400 busy, 100 ours: others 300 of 400
    with bench.Interference() as load:
        pass
    assert load.share == pytest.approx(0.75) and load.busy
    assert "Unreliable: other processes used 75%" in bench._busy_note(load.share)
    monkeypatch.undo()
    # measured for real: a child spinning on every core while this process sleeps is seen as others' use
    import subprocess
    import sys
    import time
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    spin = "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass\n"
    kids = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n)]
    time.sleep(0.3)                                                  # the children are up and spinning
    with bench.Interference() as load:
        time.sleep(0.8)
    for k in kids:
        k.wait()
    if bench._cpu_ticks() is not None:                               # Linux
        assert load.share > 0.5 and load.busy, load.share


def test_step_md_flags_a_floor_that_changed_between_modes():
    def result(mode, floor_ms):
        return dict(size="mini", preset="mini", B=2, T=64, layers=4, hidden=256, heads=4, vocab=30522, n_labelled=9,
                    mode=mode, dropout=0.0, repeats=3, checks=[], others_cpu_share=0.0,
                    rows=[dict(run="GEMM floor", ms=floor_ms, x_floor=1.0)],
                    floor_gflop=dict(all=1.0, labelled=0.5), floor_products=dict(all=108, labelled=108))
    steady = "\n".join(bench._step_md(dict(unavailable={}, products={},
                                           results=[result("eval", 41.0), result("train", 40.0)])))
    assert "Unsteady machine" not in steady and "(quiet)" in steady
    md = "\n".join(bench._step_md(dict(unavailable={}, products={}, results=[result("eval", 963.0),
                                                                             result("train", 40.0)])))
    assert "Unsteady machine: the GEMM floor, the same products in eval and in train, took 963.0 ms and 40.0 ms" in md


def test_bench_device_cuda_mixed_precision_runs_the_mixed_section(monkeypatch):
    """`refbert bench --device cuda --mixed-precision bf16` hands the GPU bench its mixed-precision section with
    that precision alone (bench_cuda._mixed); the bench itself is replaced here (no GPU)."""
    from refbert import bench_cuda
    seen = []
    monkeypatch.setattr(bench_cuda, "main", lambda args: seen.append(args) or 0)
    assert cli.main(["bench", "--device", "cuda", "--mixed-precision", "bf16"]) == 0
    assert seen[-1].only == ["mixed"] and seen[-1].mixed == "bf16-mixed"
    assert [p for p, _ in bench_cuda._mixed(seen[-1])] == ["bf16-mixed"]
    assert cli.main(["bench", "--device", "cuda", "--mixed-precision", "fp16"]) == 0
    assert [p for p, _ in bench_cuda._mixed(seen[-1])] == ["fp16-mixed"]
    assert cli.main(["bench", "--device", "cuda"]) == 0
    assert getattr(seen[-1], "mixed", None) is None and len(bench_cuda._mixed(seen[-1])) == 2
    assert cli.main(["bench", "--device", "cuda", "--only", "step", "mixed"]) == 0      # the README's line
    assert seen[-1].only == ["step", "mixed"]
    assert cli.main(["bench", "--only", "mixed"]) == 2                                  # a GPU section on the CPU
