"""`refbert verify`'s noise model measured: honest dumps pass, a 1e-3 change of any one tensor fails.

    python benchmarks/verify_noise.py                          # tiny, mini, base -> benchmarks/results/verify_noise.md
    python benchmarks/verify_noise.py --sizes tiny --out /tmp/vn   # a quick look

Models: BERT tiny (refbert.check.tiny_config: vocab 23, H 12, L 2, 3 heads), mini (L4 H256) and base (L12 H768), the
last two with BERT's vocabulary of 30,522, all BertForPreTraining, each with three sets of weights:
  init     transformers' own init (torch.manual_seed(0)), saved by save_pretrained: what the README's snippet loads;
  trained  the same, then trained by refbert (AdamW, lr LR[size], weight decay 0.01, clip 1.0, dropout on;
           STEPS[size] steps on 8 synthetic batches other than the checked one, float32) and saved: every weight
           moved (the table gives |w - w0| / |w0| over all weights), LayerNorm gains and biases off 1 and 0, the
           heads confident (the loss on its batches falls from 3.8 to 1.7 nats on tiny, from ~11 to under 0.03 on
           mini and base), which is what real weights do to the conditioning: softmaxes that are sure, large
           logits, gradients of every size. Base at lr 1e-3 (the small models' rate) collapsed: uniform attention
           in layers 2-11, their query and key gradients ~1e-30, nothing like real weights; 1e-4 is BERT's own;
  sharp    trained, then every layer's query and key weights and biases x3: attention scores x9, so that heads
           are peaked as many of a real BERT's are (on [CLS], [SEP], a neighbour), where softmax's exp turns the
           scores' rounding into a relative error of the probabilities;
and, for tiny only, `memorized`: trained on the checked batch itself until it is sure of its labels, a stress case
outside the claim: a softmax sure of the right class leaves p - onehot ~ 0, computed from p ~ 1 whose float32
rounding stays, so some gradients (the NSP and pooler biases') carry float32 noise larger than 1e-3 of themselves,
and their tolerance says so. The exit status counts the other models only. No download is possible here.

Batch: `refbert dump`'s default (B = 3, T = 16: padding, two segments, -100 labels, NSP labels 0, 1, 1). Honest
dumps: transformers + torch as the README's snippet writes them (default attention, eval), computed in float64,
float32, float16 and bfloat16; refbert's own float32 (NumPy) and, with numba installed, its numba kernels in
float32. For each: the worst error in units of noise (max|x - r| / n) over its tensors, against K =
verify.FACTOR[dtype]. Detection: each tensor of the torch dump scaled alone by 1 + 1e-3 (float32) or 1 + 1e-9
(float64): the smallest max|x - r| / n among them (caught when > K); layer 0's key bias (0 in exact arithmetic), a
deviation of 1e-3 x the largest entry of the same layer's query-bias gradient added. 16-bit dumps: the smallest
relative change each tensor can show (its tolerance), median and worst over the tensors. Cost: refbert's float64
pass and the three Monte Carlo runs in CPU seconds, and `verify_dump` of the float32 torch dump, whole.
Needs the dev extra (torch, transformers).
"""
import argparse
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np

from refbert import BertConfig, safetensors_io, verify
from refbert.check import tiny_config
from refbert.fileio import write_text
from refbert.optim import AdamW, clip_grad_norm

HEAD = "BertForPreTraining"
STEPS = {"tiny": 300, "mini": 150, "base": 100}
LR = {"tiny": 1e-3, "mini": 1e-3, "base": 1e-4}
CHANGE = {"float64": 1e-9, "float32": 1e-3}


def config(size):
    return tiny_config() if size == "tiny" else BertConfig.preset(size)


def make_checkpoint(size, weights, folder, steps):
    """`folder` with the model (see the module docstring); returns |w - w0| / |w0| over all weights (0 for init)."""
    import torch
    import transformers
    cfg = config(size)
    hf_cfg = transformers.BertConfig(**{k: getattr(cfg, k) for k in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
        "max_position_embeddings", "type_vocab_size")})
    torch.manual_seed(0)
    transformers.BertForPreTraining(hf_cfg).save_pretrained(folder)
    if weights == "init":
        return 0.0
    model = verify.load(folder, HEAD, np.float32).train()        # dropout on, as in pretraining
    w0 = {k: v.astype(np.float64) for k, v in model.parameters().items()}
    if weights == "sharp":                                      # the trained weights, attention sharpened
        trained = verify.load(os.path.join(os.path.dirname(folder), f"{size}-trained"), HEAD, np.float32)
        for k, v in model.parameters().items():
            v[...] = trained.parameters()[k] * (3 if ".attention.self.query." in k or ".attention.self.key." in k
                                                else 1)
        model.save_pretrained(folder)
        return _moved(model.parameters(), w0)
    opt = AdamW(model.parameters(), lr=LR[size], weight_decay=0.01)
    seeds = [0] * 8 if weights == "memorized" else range(1, 9)       # the checked batch is seed 0
    batches = [verify.default_batch(model.config, HEAD, seed=s)[0] for s in seeds]
    for step in range(steps):
        out = model(**batches[step % len(batches)])
        grads = model.backward()
        clip_grad_norm(grads, 1.0)
        opt.step(grads)
        if step in (0, steps - 1):
            print(f"    {size} {weights}: step {step + 1} loss {float(out.loss):.3f}", flush=True)
    model.save_pretrained(folder)
    return _moved(model.parameters(), w0)


def _moved(w, w0):
    return float(np.sqrt(sum(((w[k] - w0[k]) ** 2).sum() for k in w) / sum((w0[k] ** 2).sum() for k in w)))


def torch_dump(folder, batch, dtype):
    """The README's snippet in `dtype` on `batch`: {key: float64 array} (16-bit values widened exactly)."""
    import torch
    import transformers
    model = transformers.BertForPreTraining.from_pretrained(folder).eval().to(getattr(torch, dtype))
    out = model(**{k: torch.from_numpy(v) for k, v in batch.items()}, output_hidden_states=True)
    out.loss.backward()
    d = {f"output/{k}": v for k, v in out.items() if k != "hidden_states"}
    d |= {f"hidden_states/{i}": h for i, h in enumerate(out.hidden_states)}
    d |= {f"grad/{k}": p.grad for k, p in model.named_parameters()}
    return {k: v.detach().double().numpy() for k, v in d.items()}


def refbert_dump(folder, batch, backend):
    model = verify.load(folder, HEAD, np.float32)
    if backend != "numpy":
        from refbert.model import get_backend
        model.ops = get_backend(backend)
    return {k: v.astype(np.float64) for k, v in verify.reference(model, batch, {}).items()}


def units(x, r, n):
    return float(np.abs(x.reshape(r.shape) - r).max()) / max(n, np.finfo(np.float64).tiny)


def measure(size, weights, folder, moved, dumps_dir):
    model = verify.load(folder, HEAD, np.float64)
    batch, up = verify.default_batch(model.config, HEAD)
    res = dict(model=size, weights=weights, moved=moved, honest=[], detect=[], sixteen=[])
    dumps = {d: torch_dump(folder, batch, d) for d in ("float64", "float32", "float16", "bfloat16")}
    others = {"refbert numpy": refbert_dump(folder, batch, "numpy")}
    try:
        others["refbert numba"] = refbert_dump(folder, batch, "numba")
    except ValueError as e:
        print(f"    numba skipped: {e}")
    for dtype in ("float64", "float32", "float16", "bfloat16"):
        ref, n = verify.expected(model, folder, HEAD, batch, up, dtype, "bench")
        K, zeros = verify.FACTOR[dtype], verify.exact_zeros(HEAD, ref)
        honest = [(f"torch {dtype}", dumps[dtype])] + (list(others.items()) if dtype == "float32" else [])
        for name, d in honest:
            worst = max((units(d[k], r, n[k]), k) for k, r in ref.items())
            res["honest"].append(dict(dump=name, dtype=dtype, K=K, worst=worst[0], key=worst[1], ok=worst[0] <= K))
        if dtype in CHANGE:
            d, c = dumps[dtype], CHANGE[dtype]
            weakest = min((units(d[k] * (1 + c), r, n[k]), k) for k, r in ref.items() if k not in zeros)
            kb = "grad/bert.encoder.layer.0.attention.self.key.bias"
            dev = 1e-3 * float(np.abs(ref[kb.replace("key", "query")]).max())
            key = units(d[kb] + dev, ref[kb], n[kb])
            res["detect"].append(dict(dtype=dtype, change=c, K=K, weakest=weakest[0], key=weakest[1],
                                      ok=weakest[0] > K, key_bias=key, key_bias_ok=key > K))
        else:
            tol = sorted((K * n[k] / float(np.abs(r).max()), k) for k, r in ref.items() if k not in zeros)
            res["sixteen"].append(dict(dtype=dtype, K=K, median=tol[len(tol) // 2][0], worst=tol[-1][0],
                                       key=tol[-1][1], best=tol[0][0]))
    # the cost, in CPU seconds (the cores are shared): the float64 pass against the three Monte Carlo runs
    cpu = time.process_time()
    ref = verify.reference(model, batch, up)
    res["reference_cpu"] = time.process_time() - cpu
    model32 = verify.load(folder, HEAD, np.float32)
    cpu = time.process_time()
    verify.noise(model32, batch, up, ref, "float32")
    res["noise_cpu"] = time.process_time() - cpu
    # the whole command's work on the float32 torch dump (read, reference, noise, compare)
    path = os.path.join(dumps_dir, f"{size}-{weights}.safetensors")
    safetensors_io.save_file({**{f"input/{k}": v for k, v in batch.items()},
                              **{k: v.astype(np.float32) for k, v in dumps["float32"].items()}}, path)
    t, cpu = time.perf_counter(), time.process_time()
    rep = verify.verify_dump(folder, path)
    res["verify_seconds"], res["verify_cpu"] = time.perf_counter() - t, time.process_time() - cpu
    res["verify_failed"] = rep["failed"]
    return res


def report(results, argv):
    import torch
    import transformers
    lines = ["# `refbert verify`: honest dumps against their noise, and the smallest change caught", "",
             "Command (--work, where the checkpoints are kept, left out):", "",
             "    python benchmarks/verify_noise.py " + " ".join(_without_work(argv)), "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; Python "
             f"{platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}, transformers "
             f"{transformers.__version__}. Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", "",
             "Method: the docstring of benchmarks/verify_noise.py. Units: max|x - refbert| / noise, the noise of "
             f"each tensor from verify.noise ({verify.PROBES} Monte Carlo runs); a dump passes when every tensor is "
             "<= K, a change is caught when its tensor is > K.", "",
             "## Honest dumps: the worst tensor, in units of its noise", "",
             "| model | weights | dump | worst | tensor | K | pass |", "|---|---|---|---|---|---|---|"]
    for r in results:
        for h in r["honest"]:
            lines.append(f"| {r['model']} | {r['weights']} | {h['dump']} | {h['worst']:.2f} | {h['key']} | {h['K']} | "
                         f"{'yes' if h['ok'] else '**no**'} |")
    lines += ["", "## One tensor changed: the weakest signal, in units of its noise", "",
              "Each tensor of the torch dump scaled alone by 1 + change; the key bias (0 in exact arithmetic) "
              "shifted by 1e-3 x the largest entry of layer 0's query-bias gradient.", "",
              "| model | weights | dtype | change | weakest | tensor | K | all caught | key bias | caught |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for d in r["detect"]:
            lines.append(f"| {r['model']} | {r['weights']} | {d['dtype']} | {d['change']:g} | {d['weakest']:.1f} | "
                         f"{d['key']} | {d['K']} | {'yes' if d['ok'] else '**no**'} | {d['key_bias']:.3g} | "
                         f"{'yes' if d['key_bias_ok'] else '**no**'} |")
    lines += ["", "## 16-bit dumps: the smallest relative change each tensor can show (its tolerance)", "",
              "| model | weights | dtype | best | median | worst | worst tensor |", "|---|---|---|---|---|---|---|"]
    for r in results:
        for s in r["sixteen"]:
            lines.append(f"| {r['model']} | {r['weights']} | {s['dtype']} | {s['best']:.2g} | {s['median']:.2g} | "
                         f"{s['worst']:.2g} | {s['key']} |")
    lines += ["", "## Weights and cost", "",
              "CPU seconds (process time: every thread of this process, not the other jobs on the shared cores) "
              "of refbert's float64 pass and of verify.noise's three float32 Monte Carlo runs; then the whole "
              "`verify_dump` of the float32 torch dump (read, both, compare), in wall-clock and CPU seconds.", "",
              "| model | weights | \\|w - w0\\| / \\|w0\\| | float64 pass (CPU s) | 3 Monte Carlo runs (CPU s) | "
              "verify_dump (s) | verify_dump (CPU s) | its failures |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['model']} | {r['weights']} | {r['moved']:.2f} | {r['reference_cpu']:.2f} | "
                     f"{r['noise_cpu']:.2f} | {r['verify_seconds']:.2f} | {r['verify_cpu']:.2f} | "
                     f"{r['verify_failed']} |")
    return "\n".join(lines) + "\n"


def _without_work(argv):
    return [a for i, a in enumerate(argv) if a != "--work" and (i == 0 or argv[i - 1] != "--work")
            and not a.startswith("--work=")]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="tiny,mini,base")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--work", help="keep the checkpoints here (reused when present)")
    a = ap.parse_args(argv)
    work = a.work or tempfile.mkdtemp(prefix="verify_noise.")
    results = []
    for size in a.sizes.split(","):
        for weights in ("init", "trained", "sharp") + (("memorized",) if size == "tiny" else ()):
            folder = os.path.join(work, f"{size}-{weights}")
            moved_file = os.path.join(folder, "moved.json")
            if not os.path.exists(moved_file):
                print(f"  {size} {weights}: checkpoint", flush=True)
                moved = make_checkpoint(size, weights, folder, STEPS[size])
                write_text(moved_file, json.dumps(moved))
            with open(moved_file) as f:
                moved = json.load(f)
            print(f"  {size} {weights}: measuring", flush=True)
            results.append(measure(size, weights, folder, moved, work))
            r = results[-1]
            print("   ", [(h["dump"], round(h["worst"], 2)) for h in r["honest"]],
                  [(d["dtype"], round(d["weakest"], 1), round(d["key_bias"], 1)) for d in r["detect"]],
                  f"verify {r['verify_seconds']:.1f} s", flush=True)
    os.makedirs(a.out, exist_ok=True)
    write_text(os.path.join(a.out, "verify_noise.md"), report(results, argv))
    write_text(os.path.join(a.out, "verify_noise.json"), json.dumps(results, indent=1) + "\n")
    bad = [r for r in results if not all(h["ok"] for h in r["honest"]) or r["weights"] != "memorized" and
           not all(d["ok"] and d["key_bias_ok"] for d in r["detect"])]
    print(f"{a.out}/verify_noise.md: {len(results)} models, {len(bad)} with a failure")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
