"""benchmarks/torch_pretrain.py trains HF + PyTorch on exactly a refbert pretrain run's job: the same initial
weights and the same held-out data (so its losses and step times can stand beside the run's), on the CPU here.

Tolerance: refbert's numpy backend and torch both evaluate the same float32 weights on the same batches in float32,
summing the same products in other orders: ~1e-6 relative apart in a loss; 1e-5 allows for it. The run's initial
model drawn from another seed moves the held-out losses by far more (checked: the comparison can fail).
"""
import importlib.util
import json
import math
import os
import types
from pathlib import Path

from refbert import cli
from refbert import train as T

ROOT = Path(__file__).resolve().parents[1]


def _peer():
    spec = importlib.util.spec_from_file_location("torch_pretrain", ROOT / "benchmarks" / "torch_pretrain.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_torch_peer_trains_the_runs_job(tmp_path, torch, transformers, monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert cli.main(["demo-data", str(tmp_path / "demo")]) == 0
    docs = (tmp_path / "demo" / "corpus.txt").read_text().strip().split("\n\n")
    (tmp_path / "corpus.txt").write_text("\n\n".join(docs[:200]) + "\n")       # 10 held out: a quick eval
    run = tmp_path / "run"
    assert cli.main(["pretrain", "--corpus", str(tmp_path / "corpus.txt"), "--out", str(run), "--preset",
                     "tiny", "--vocab-size", "500", "--max-seq-length", "32", "--batch-size", "8", "--steps", "2",
                     "--save-every", "2", "--eval-every", "2"]) == 0
    P = _peer()
    a = P.run_args(str(run))
    tok = P.tokenizer_of(str(run), a)
    _, eval_data, _, _ = T.pretraining_data(a, tok)
    cpu = torch.device("cpu")
    ours = T.evaluate_pretraining(T._pretrain_model(a, tok), eval_data, a["batch_size"])
    mlm, nsp = P.held_out(P.initial_model(str(run), a, tok, cpu), eval_data, a["batch_size"], cpu)
    assert abs(mlm - ours["mlm_loss"]) <= 1e-5 * ours["mlm_loss"], (mlm, ours)
    assert abs(nsp - ours["nsp_loss"]) <= 1e-5 * ours["nsp_loss"], (nsp, ours)
    other = P.held_out(P.initial_model(str(run), dict(a, seed=a["seed"] + 1), tok, cpu), eval_data,
                       a["batch_size"], cpu)
    assert abs(other[0] - ours["mlm_loss"]) > 1e-3 * ours["mlm_loss"], (other, ours)   # another init: caught
    out = tmp_path / "peer.json"
    assert P.main([str(run), "--device", "cpu", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["steps"] == 2 and res["precision"] == "fp32" and res["device"] == "cpu", res
    assert all(math.isfinite(res[k]) and res[k] > 0 for k in ("mlm", "nsp", "train_last50", "step_ms",
                                                               "refbert_step_ms", "refbert_loop_ms")), res
    # refbert's step (its log's step_ms) is a part of its loop's iteration: never the longer (medians of the same
    # steps; the iteration read back from a truncated tokens/s is never shorter than it was)
    assert res["refbert_step_ms"] <= res["refbert_loop_ms"], res


def test_mixed_train_writes_the_runs_that_finished(tmp_path, monkeypatch):
    """benchmarks/mixed_train.py writes its table after each run (atomically), so a run cut off by a time limit
    (gpu_all.sh's train step at 719a3b9 on the H100, in its third run) keeps the rows before it: each unfinished
    precision is a row saying so, and the bf16 bound is judged only once bf16 has run. train() is replaced here by
    one that reports two finished runs and is then cut off."""
    spec = importlib.util.spec_from_file_location("mixed_train", ROOT / "benchmarks" / "mixed_train.py")
    M = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(M)
    run = dict(mlm=5.0, total=5.5, train_last50=6.0, scale=None, skipped=0, seconds=1.0, graph="")

    def cut_off(work, steps, backend, graph, peer, done):
        done({"no": run})
        done({"no": run, "bf16": dict(run, mlm=5.05)})
        raise TimeoutError("cut off")
    monkeypatch.setattr(M, "train", cut_off)
    out = tmp_path / "mixed_train_cuda.md"
    monkeypatch.setattr("sys.argv", ["mixed_train.py", "--backend", "cuda", "--out", str(out)])
    try:
        M.main()
        raise AssertionError("the cut-off run was not cut off")
    except TimeoutError:
        pass
    text = out.read_text()
    assert "| fp32 | 5.000 | +0.00% |" in text and "| bf16-mixed | 5.050 | +1.00% |" in text, text
    assert "| fp16-mixed | not finished" in text, text
    assert "bf16-mixed against fp32, held-out MLM loss: 1.00% (issue 14's bound: 2%): within" in text, text
    assert not (tmp_path / "mixed_train_cuda.md.tmp").exists()


def test_mixed_train_says_where_its_time_went(tmp_path, monkeypatch, capsys):
    """train() prints a line of its parts' seconds after each part (gpu_all.sh quotes the last in its summary, so a
    run cut off keeps the parts it finished: issue 13's 6 minutes): the demo data, each precision's run, each run's
    HF + PyTorch peer. The refbert commands and the peer are replaced here by stand-ins that write what train() reads
    (eval.csv, log.csv), and the clock by one that moves 10 s at every reading: each part is read at its start and
    its end, so each takes 10 s."""
    spec = importlib.util.spec_from_file_location("mixed_train", ROOT / "benchmarks" / "mixed_train.py")
    M = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(M)

    def refbert(args, env):
        if args[0] == "pretrain":
            run = args[args.index("--out") + 1]
            os.makedirs(run)
            with open(os.path.join(run, "eval.csv"), "w") as f:
                f.write("step,mlm_loss,nsp_loss\n300,5.0,0.5\n")
            with open(os.path.join(run, "log.csv"), "w") as f:
                f.write("step,loss,loss_scale,grad_norm\n1,6.0,,1.0\n")
        return ""
    monkeypatch.setattr(M, "_refbert", refbert)
    monkeypatch.setattr(M, "torch_peer", lambda run, device: {"mlm": 5.0})
    ticks = iter(range(0, 10000, 10))
    monkeypatch.setattr(M, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))   # (M's alone)
    seen = []
    runs = M.train(str(tmp_path), 300, backend="cuda", peer=True, done=lambda r: seen.append(len(r)))
    assert seen == [1, 2, 3] and set(runs) == {"no", "bf16", "fp16"}, (seen, runs)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("train times:")]
    assert lines[0] == "train times: demo-data 10 s", lines
    assert lines[-1] == ("train times: demo-data 10 s, no 10 s (its HF + PyTorch peer 10 s), bf16 10 s (its HF + "
                         "PyTorch peer 10 s), fp16 10 s (its HF + PyTorch peer 10 s)"), lines
    assert len(lines) == 4, lines                       # (after the data and after each run)
