"""One pretraining step (forward + backward of BertForPreTraining, MLM + NSP loss) of refbert against HF
transformers + PyTorch on the CPU (eager attention), on the same weights and the same batch.

    python benchmarks/bench_model.py                 # mini (L4 H256 A4, B8 T128) and base (L12 H768 A12, B4 T128)
    python benchmarks/bench_model.py --sizes mini --repeats 5

Method: both models in eval mode (dropout off, so the two compute the same numbers; dropout's cost is a few
elementwise passes), float32, 15% of positions carry MLM labels. Warm-up steps are excluded; the runs alternate
refbert / torch so that drift in the machine's speed hits both alike; the median of the repeats is reported.
Peak memory is measured in a fresh subprocess per framework that loads only that model: the growth of Linux's
resident-set high-water mark over one step (torch's allocator is invisible to tracemalloc). The outputs are compared before anything is timed.
Needs the dev extra (torch, transformers).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

SIZES = {"mini": dict(preset="mini", B=8, T=128), "base": dict(preset="base", B=4, T=128)}


def make(size, tmp):
    """An HF BertForPreTraining with random weights saved to tmp, refbert loaded from it, and a batch."""
    import torch
    import transformers

    import refbert
    cfg = refbert.BertConfig.preset(SIZES[size]["preset"])
    hf_cfg = transformers.BertConfig(**{k: v for k, v in cfg.to_dict().items() if k != "model_type"},
                                     attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.BertForPreTraining(hf_cfg).eval()
    hf.save_pretrained(tmp)
    return hf, load(tmp, "refbert"), batch(size, cfg.vocab_size)


def load(path, framework):
    if framework == "refbert":
        import refbert
        return refbert.BertForPreTraining.from_pretrained(path, dtype=np.float32)
    import transformers
    return transformers.BertForPreTraining.from_pretrained(path, attn_implementation="eager").eval()


def batch(size, vocab_size):
    r = np.random.default_rng(0)
    B, T = SIZES[size]["B"], SIZES[size]["T"]
    ids = r.integers(1000, vocab_size, (B, T))
    am = np.ones((B, T), np.int64)
    am[1::2, T * 3 // 4:] = 0                      # half the rows padded to 3/4 length
    tt = np.zeros((B, T), np.int64)
    tt[:, T // 2:] = 1
    labels = np.where(r.random((B, T)) < 0.15, ids, -100)
    return dict(input_ids=ids, attention_mask=am, token_type_ids=tt, labels=labels,
                next_sentence_label=r.integers(0, 2, B))


def step_refbert(model, x):
    out = model.forward(**x)
    model.backward()
    return float(out.loss)


def step_torch(model, tx):
    model.zero_grad(set_to_none=True)
    out = model(**tx)
    out.loss.backward()
    return out.loss.item()


def _status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))  # kB


def peak_memory(size, framework, path):
    """Peak RSS growth (MiB) during one step, in a fresh process that loads only `framework`'s model: Linux's
    high-water mark (VmHWM) is reset through /proc/self/clear_refs after loading, read after the step."""
    code = f"""
import sys, torch
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
import bench_model as b
m = b.load({path!r}, {framework!r})
x = b.batch({size!r}, 30522)
if {framework!r} == "torch":
    x = {{k: torch.tensor(v) for k, v in x.items()}}
open("/proc/self/clear_refs", "w").write("5")
before = b._status("VmRSS")
b.step_refbert(m, x) if {framework!r} == "refbert" else b.step_torch(m, x)
print((b._status("VmHWM") - before) / 1024)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["mini", "base"], choices=list(SIZES))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", help="append the results to this JSON-lines file")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(os.cpu_count())
    print(f"numpy {np.__version__}, torch {torch.__version__}, {os.cpu_count()} cores, torch threads "
          f"{torch.get_num_threads()}")
    for size in args.sizes:
        d = tempfile.mkdtemp()
        hf, ours, x = make(size, d)
        tx = {k: torch.tensor(v) for k, v in x.items()}
        # validate before timing: the same loss (float32 on both sides: ~1e-5 relative)
        l_ours, l_torch = step_refbert(ours, x), step_torch(hf, tx)
        assert abs(l_ours - l_torch) <= 1e-4 * abs(l_torch), (l_ours, l_torch)
        times = {"refbert": [], "torch": []}
        for _ in range(args.repeats):                # interleaved
            for name, fn, arg, m in (("refbert", step_refbert, x, ours), ("torch", step_torch, tx, hf)):
                t0 = time.perf_counter()
                fn(m, arg)
                times[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        mem = {k: peak_memory(size, k, d) for k in times}
        shutil.rmtree(d)
        s = SIZES[size]
        B, T = s["B"], s["T"]
        print(f"{size:5s} B{B} T{T} | refbert {med['refbert'] * 1e3:8.1f} ms | torch {med['torch'] * 1e3:8.1f} ms | "
              f"ratio {med['refbert'] / med['torch']:.2f}x | peak +MiB refbert {mem['refbert']:.0f} torch "
              f"{mem['torch']:.0f} | loss {l_ours:.4f} vs {l_torch:.4f}")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(dict(size=size, B=B, T=T, seconds=med, peak_mib=mem, repeats=args.repeats,
                                        numpy=np.__version__, torch=torch.__version__)) + "\n")


if __name__ == "__main__":
    main()
