"""What mixed precision costs refbert's spec on the CPU: training quality and step time, float32 against
bf16-mixed and fp16-mixed (the README's "Mixed precision" section quotes benchmarks/results/mixed_train.md).

    python benchmarks/mixed_train.py [--steps 300] [--out benchmarks/results/mixed_train.md]
    python benchmarks/mixed_train.py --backend cuda --out DIR/mixed_train_cuda.md     (a GPU; benchmarks/gpu_all.sh)
    python benchmarks/mixed_train.py --backend cuda --cuda-graph ...                   (each step one CUDA graph)

1. Training: the demo's tiny preset, `refbert pretrain --corpus demo/corpus.txt --preset tiny --vocab-size 2000
   --max-seq-length 64 --batch-size 64 --lr 2e-3 --steps 300 --eval-every 100 --mixed-precision no|bf16|fp16`
   (numpy backend, the same seed, so the same data, vocabulary and masks), on demo data made afresh in a
   temporary folder: the held-out MLM and MLM + NSP losses at the last step (eval.csv), the mean training loss of
   the last 50 steps (log.csv), and for fp16 the loss scale at the end and the steps the scaler skipped.
   With --backend cuda the same three runs train on the GPU (`--backend cuda`: the CUDA kernels, cuBLAS's 16-bit
   GEMMs): issue 14's test that bf16-mixed on the GPU ends within 2% of the fp32 run's loss; no step times.
   With --torch-peer each run is trained again by HF transformers + PyTorch on exactly its data and initial
   weights (benchmarks/torch_pretrain.py: the same recipe in PyTorch's idiom, torch.autocast for the mixed ones,
   on the GPU with --backend cuda, else the CPU): its losses beside the run's, and the median milliseconds of a
   step on both sides, from a batch in hand to its loss read back (refbert's log.csv step_ms), with refbert's
   whole loop iteration beside them (a batch's tokens over its logged tokens/s: the next batch's masking, the
   metrics and the logs too, which the PyTorch loop's timed steps leave out). Under benchmarks/gpu_all.sh
   these runs share the machine with its other parallel steps (mains, tests, check), each side at another moment:
   the milliseconds are for orientation there; the bench's step and optim sections are the uncontended figures.
   The table is written again after each run (atomically), so a run cut off by a time limit keeps the rows
   before it, the unfinished ones saying so.
2. Step time (numpy backend only): one BertForPreTraining training step (forward + backward, dropout 0.1) of BERT mini (L4 H256 A4,
   V 2000) at B=4 T=64 on the numpy backend, in each precision: 7 rounds, each running the three precisions once
   in turn (interleaved, so a busy moment of the machine hits all three alike), the median per precision.
"""
import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRECISIONS = (("no", "fp32"), ("bf16", "bf16-mixed"), ("fp16", "fp16-mixed"))


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _refbert(args, env):
    """`refbert ARGS` as `python -m refbert` (the package need not be installed: gpu_all.sh runs from the tree)."""
    r = subprocess.run([sys.executable, "-m", "refbert", *args], env=env, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"refbert {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r.stdout + r.stderr


def torch_peer(run, device):
    """benchmarks/torch_pretrain.py's result (a dict) for a finished run, or {"error": ...}."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "peer.json")
        r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "torch_pretrain.py"), run, "--device",
                            device, "--json", out], capture_output=True, text=True)
        if r.returncode:
            return {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"rc {r.returncode}"}
        with open(out) as f:
            return json.load(f)


def train(work, steps, backend="numpy", graph=False, peer=False, done=None):
    """{flag: dict(mlm, total, train_last50, scale, skipped, seconds[, peer])} of the three pretraining runs;
    done(runs so far) after each (the table written as the runs finish: a run cut off by a time limit keeps the
    rows before it)."""
    env = dict(os.environ, TQDM_DISABLE="1")
    t = time.perf_counter()
    _refbert(["demo-data", os.path.join(work, "demo")], env)
    times = [f"demo-data {time.perf_counter() - t:.0f} s"]    # (where the time goes: gpu_all.sh quotes the last
    print("train times: " + ", ".join(times), flush=True)     # such line, so a run cut off keeps the parts before)
    out = {}
    for flag, _ in PRECISIONS:
        run = os.path.join(work, f"run-{flag}")
        t = time.perf_counter()
        said = _refbert(["pretrain", "--corpus", os.path.join(work, "demo", "corpus.txt"), "--out", run,
                  "--preset", "tiny", "--vocab-size", "2000", "--max-seq-length", "64", "--batch-size", "64",
                  "--lr", "2e-3", "--steps", str(steps), "--eval-every", "100", "--mixed-precision", flag,
                  "--backend", backend] + (["--cuda-graph"] if graph else []), env)
        seconds = time.perf_counter() - t
        ev, log = _rows(os.path.join(run, "eval.csv"))[-1], _rows(os.path.join(run, "log.csv"))
        last = [float(r["loss"]) for r in log[-50:]]
        scales = [float(r["loss_scale"]) for r in log if r.get("loss_scale")]
        skipped = sum(1 for r in log if r.get("grad_norm", "") in ("nan", "inf"))
        out[flag] = dict(mlm=float(ev["mlm_loss"]), total=float(ev["mlm_loss"]) + float(ev["nsp_loss"]),
                         train_last50=sum(last) / len(last), scale=scales[-1] if scales else None,
                         skipped=skipped, seconds=seconds, step=int(ev["step"]),
                         graph=" ".join(ln.strip() for ln in said.splitlines()
                                        if ln.startswith(("CUDA graph:", "--cuda-graph:"))))
        times.append(f"{flag} {seconds:.0f} s")
        if peer:
            t = time.perf_counter()
            out[flag]["peer"] = torch_peer(run, "cuda" if backend == "cuda" else "cpu")
            times[-1] += f" (its HF + PyTorch peer {time.perf_counter() - t:.0f} s)"
        print(flag, out[flag], flush=True)
        print("train times: " + ", ".join(times), flush=True)
        if done is not None:
            done(out)
    return out


def step_times(rounds=7):
    """{precision: median seconds of one mini training step at B=4 T=64, numpy backend}."""
    import refbert
    from refbert.bench import batch
    cfg = refbert.BertConfig(vocab_size=2000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                             intermediate_size=1024, max_position_embeddings=512)
    x = batch(4, 64, cfg.vocab_size, seed=0)
    models = {p: refbert.BertForPreTraining(cfg, seed=0, dtype=np.float32, precision=p).train()
              for _, p in PRECISIONS}
    times = {p: [] for p in models}
    for r in range(rounds + 1):                        # round 0 warms up (first-touch allocations)
        for p, m in models.items():
            t = time.perf_counter()
            m(**x)
            m.backward()
            if r:
                times[p].append(time.perf_counter() - t)
    return {p: statistics.median(v) for p, v in times.items()}


def report(a, runs, times):
    """The results file's lines for the runs that finished (runs: {flag: ...}, fp32's first; a precision not in it
    is a row saying so)."""
    from refbert.bench import results_header
    f32 = runs["no"]

    def rel(v, ref):
        return f"{100 * (v - ref) / ref:+.2f}%"
    where = "on the CPU: what refbert's spec costs" if a.backend == "numpy" else \
        "on the GPU (--backend cuda): what the kernels' mixed step costs"
    lines = [*results_header(f"Mixed precision {where}", f"python benchmarks/mixed_train.py --steps {a.steps}"
                             + ("" if a.backend == "numpy" else " --backend cuda")
                             + (" --cuda-graph" if a.cuda_graph else "") + (" --torch-peer" if a.torch_peer else "")),
             "Method: the script's docstring.", "",
             f"## Training: the demo's tiny preset, {a.steps} steps", "",
             "| run | held-out MLM loss (nats) | vs fp32 | held-out MLM + NSP (nats) | vs fp32 | mean training loss, "
             "last 50 steps (nats) | vs fp32 | final loss scale | skipped steps | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    unfinished = "not finished (the run did not end: cut off, or still running)"
    for flag, name in PRECISIONS:
        if flag not in runs:
            lines.append(f"| {name} | {unfinished} | | | | | | | | |")
            continue
        r = runs[flag]
        scale = "—" if r["scale"] is None else f"2^{np.log2(r['scale']):.0f}"
        lines.append(f"| {name} | {r['mlm']:.3f} | {rel(r['mlm'], f32['mlm'])} | {r['total']:.3f} | "
                     f"{rel(r['total'], f32['total'])} | {r['train_last50']:.3f} | "
                     f"{rel(r['train_last50'], f32['train_last50'])} | "
                     f"{scale} | {r['skipped']} | "
                     f"{r['seconds']:.0f} |")
    if a.torch_peer:
        lines += ["", "## The same runs in HF transformers + PyTorch (benchmarks/torch_pretrain.py: the same data and "
                  "initial weights)", "", "(Milliseconds a step as measured, beside whatever else ran on the machine "
                  "then: under gpu_all.sh, its other parallel steps.)", "",
                  "| run | refbert held-out MLM | HF + PyTorch held-out MLM | refbert MLM + NSP | HF + PyTorch MLM + "
                  "NSP | refbert ms / step | HF + PyTorch ms / step | x HF + PyTorch | refbert loop ms / step | "
                  "HF + PyTorch loop s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for flag, name in PRECISIONS:
            if flag not in runs:
                lines.append(f"| {name} | {unfinished} | | | | | | | | |")
                continue
            r, q = runs[flag], runs[flag].get("peer", {})
            if "error" in q:
                lines.append(f"| {name} | {r['mlm']:.3f} | failed: {q['error']} | | | | | | | |")
                continue
            ours, loop = q.get("refbert_step_ms"), q.get("refbert_loop_ms")
            ms, x = ("—", "—") if ours is None else (f"{ours:.2f}", f"{ours / q['step_ms']:.2f}")
            lines.append(f"| {name} | {r['mlm']:.3f} | {q['mlm']:.3f} | {r['total']:.3f} | {q['mlm'] + q['nsp']:.3f} | "
                         f"{ms} | {q['step_ms']:.2f} | {x} | {'—' if loop is None else f'{loop:.2f}'} | "
                         f"{q['loop_s']:.1f} |")
    if a.cuda_graph:
        lines += ["", "CUDA graphs (pretrain's own report per run): " +
                  "; ".join(f"{name}: {runs[flag]['graph'] or 'none reported'}" for flag, name in PRECISIONS
                            if flag in runs)]
    if times:
        lines += ["", "## Step time: BERT mini, B=4 T=64, numpy backend (median of 7 interleaved rounds)", "",
                  "| precision | ms per step | x fp32 |", "|---|---|---|"]
        for _, p in PRECISIONS:
            lines.append(f"| {p} | {times[p] * 1e3:.1f} | {times[p] / times['fp32']:.2f} |")
    elif "bf16" in runs:
        bf = 100 * abs(runs["bf16"]["mlm"] - f32["mlm"]) / f32["mlm"]
        lines += ["", f"bf16-mixed against fp32, held-out MLM loss: {bf:.2f}% (issue 14's bound: 2%): "
                  f"{'within' if bf <= 2 else 'OUTSIDE'}"]
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "mixed_train.md"))
    ap.add_argument("--backend", choices=["numpy", "cuda"], default="numpy")
    ap.add_argument("--cuda-graph", action="store_true", help="with --backend cuda: pretrain --cuda-graph")
    ap.add_argument("--torch-peer", action="store_true", help="each run trained again by HF + PyTorch, compared")
    a = ap.parse_args()
    times = step_times() if a.backend == "numpy" else None
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)

    def write(runs):                                   # (atomically: a cut-off run leaves the last whole table)
        tmp = f"{a.out}.tmp"
        with open(tmp, "w") as f:
            f.write("\n".join(report(a, runs, times)) + "\n")
        os.replace(tmp, a.out)
    with tempfile.TemporaryDirectory() as work:
        runs = train(work, a.steps, a.backend, a.cuda_graph, a.torch_peer, done=write)
    print("\n".join(report(a, runs, times)))


if __name__ == "__main__":
    sys.exit(main())
