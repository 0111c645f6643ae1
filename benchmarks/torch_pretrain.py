"""A finished `refbert pretrain` run trained again by HF transformers + PyTorch, on exactly its data: what PyTorch
would have done with the same job (issue 13: refbert's `pretrain --backend cuda` should train the demo faster).

    python benchmarks/torch_pretrain.py RUN [--device cuda] [--precision fp32|bf16-mixed|fp16-mixed] [--json F]

RUN is a refbert pretrain output folder. From its last checkpoint's arguments (trainer_state.json) the script
rebuilds what the run trained on (refbert.train.pretraining_data: the same documents held out, the same
instances and masks, batch for batch) and its initial weights (the same config and seed, handed to
BertForPreTraining.from_pretrained as an HF folder), then trains HF's BertForPreTraining for the run's steps with
the run's recipe in PyTorch's own idiom: the same linear warm-up and decay (refbert.optim.LinearWarmupDecay, set
on the optimizer each step), clip_grad_norm_ to 1, torch.optim.AdamW (fused on CUDA, foreach otherwise; weight
decay 0.01 except on biases and LayerNorm weights, eps 1e-6 as refbert's), dropout 0.1 from torch's generator (so
other masks than refbert's Philox), and for mixed precision torch.autocast with bf16 or fp16 (then
torch.amp.GradScaler). HF decodes every position (its MLM head has no labelled-only path; refbert pretrain decodes
the masked ones).

Printed (and with --json written): the held-out MLM and NSP losses at the end (the run's eval set, masks fixed,
eval mode), the mean training loss of the last 50 steps, the median milliseconds of one step (the batches made
before the loop; a step from a batch in hand to its loss read back, the device synchronised, as refbert's
step_ms is timed) and the loop's seconds; beside them the refbert run's own median step (its log.csv's step_ms)
and its median loop iteration (the batch's tokens over the logged tokens/s: the next batch's masking, the metrics
and the logs included, which PyTorch's timed steps here leave out).
"""
import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def run_args(run):
    """The run's arguments (its last checkpoint's trainer_state.json), with "trained" set to the steps it took (a
    run stopped early by --stop-after took fewer than --steps). Runs torch.optim.AdamW cannot repeat are refused."""
    ckpts = sorted(glob.glob(os.path.join(run, "checkpoint-*", "trainer_state.json")))
    if not ckpts:
        raise SystemExit(f"torch_pretrain.py: {run} holds no checkpoint-*/trainer_state.json (a refbert pretrain run "
                         f"folder is expected)")
    with open(ckpts[-1]) as f:
        state = json.load(f)
    a = state["args"]
    if a.get("no_bias_correction"):
        raise SystemExit("torch_pretrain.py: the run used --no-bias-correction (the original BERT's AdamW); "
                         "torch.optim.AdamW always corrects the bias, so PyTorch would train another job")
    return dict(a, trained=int(state["step"]))


def tokenizer_of(run, a):
    from refbert.tokenization import BertTokenizer
    if a.get("init"):
        return BertTokenizer.from_pretrained(a["init"])
    if a.get("vocab"):
        return BertTokenizer(a["vocab"], do_lower_case=not a["cased"])
    return BertTokenizer.from_pretrained(os.path.join(run, "tokenizer"))


def epochs_of_batches(data, batch_size, steps):
    """The run's batches in its order (epoch by epoch), `steps` of them."""
    out, epoch = [], 0
    while len(out) < steps:
        for b in data.batches(epoch, batch_size):
            out.append(b)
            if len(out) == steps:
                break
        epoch += 1
    return out


def refbert_step_ms(run, batches):
    """{"refbert_step_ms": median ms of the refbert run's steps, "refbert_loop_ms": median ms of its loop's
    iterations}, each None where its log lacks them: the step from its log.csv's step_ms (from a batch in hand to its loss read back after the update: what
    this script times of PyTorch's loop), the iteration from each logged tokens/s against its batch's real tokens
    (the next batch's masking, the metrics and the logs included). The first of each left out (compiles, capture)."""
    import csv
    with open(os.path.join(run, "log.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    step = [float(r["step_ms"]) for r in rows if r.get("step_ms")]
    loop = [1e3 * float(b["attention_mask"].sum()) / float(r["tokens_per_s"])
            for r, b in zip(rows, batches) if float(r.get("tokens_per_s") or 0) > 0]
    return {k: statistics.median(ms[1:] if len(ms) > 1 else ms) if ms else None
            for k, ms in (("refbert_step_ms", step), ("refbert_loop_ms", loop))}


def initial_model(run, a, tok, dev):
    """HF's BertForPreTraining with the run's initial weights (refbert's config and seed), on dev, train mode."""
    import transformers
    from refbert import train as T
    with tempfile.TemporaryDirectory() as tmp:
        T._pretrain_model(a, tok, "numpy").save_pretrained(tmp)
        return transformers.BertForPreTraining.from_pretrained(tmp, attn_implementation="sdpa").to(dev).train()


def held_out(model, eval_data, batch_size, dev, dtype=None):
    """(MLM loss, NSP loss) over the held-out set as refbert.train.evaluate_pretraining takes them: masks fixed
    (epoch 0), eval mode, each batch's mean loss weighted by its sequences."""
    import torch
    model.eval()
    tot, n = [0.0, 0.0], 0
    with torch.no_grad():
        for b in eval_data.batches(0, batch_size):
            x = {k: torch.as_tensor(b[k], device=dev) for k in b}
            with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
                o = model(input_ids=x["input_ids"], token_type_ids=x["token_type_ids"],
                          attention_mask=x["attention_mask"])
            pl, sl = o.prediction_logits.float(), o.seq_relationship_logits.float()
            w = len(b["input_ids"])
            tot[0] += w * float(torch.nn.functional.cross_entropy(pl.reshape(-1, pl.shape[-1]), x["labels"].reshape(-1),
                                                                  ignore_index=-100))
            tot[1] += w * float(torch.nn.functional.cross_entropy(sl, x["next_sentence_label"]))
            n += w
    model.train()
    return tot[0] / max(n, 1), tot[1] / max(n, 1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run")
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", choices=["fp32", "bf16-mixed", "fp16-mixed"], default=None,
                   help="default: the run's own (--mixed-precision)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    import torch
    import transformers
    from refbert import train as T
    from refbert.optim import LinearWarmupDecay
    a = run_args(args.run)
    prec = args.precision or {"no": "fp32", "bf16": "bf16-mixed", "fp16": "fp16-mixed"}[a["mixed_precision"]]
    tok = tokenizer_of(args.run, a)
    data, eval_data, _, _ = T.pretraining_data(a, tok)
    steps = a["steps"] or a["epochs"] * max(1, -(-len(data) // a["batch_size"]))   # the schedule's length
    batches = epochs_of_batches(data, a["batch_size"], min(steps, a["trained"]))    # the steps the run took
    dev = torch.device(args.device)
    torch.set_float32_matmul_precision("highest")          # fp32 stays fp32 (no TF32), as refbert's
    model = initial_model(args.run, a, tok, dev)
    no_decay = ("bias", "LayerNorm.weight")
    groups = [dict(params=[q for n, q in model.named_parameters() if not any(s in n for s in no_decay)],
                   weight_decay=0.01),
              dict(params=[q for n, q in model.named_parameters() if any(s in n for s in no_decay)],
                   weight_decay=0.0)]
    fast = dict(fused=True) if dev.type == "cuda" else dict(foreach=True)
    opt = torch.optim.AdamW(groups, lr=a["lr"], betas=(0.9, 0.999), eps=1e-6, **fast)
    warm = int(a["warmup"] * steps) if a["warmup"] < 1 else int(a["warmup"])
    sched = LinearWarmupDecay(a["lr"], warm, steps)
    dtype = {"fp32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}[prec]
    scaler = torch.amp.GradScaler(dev.type, enabled=dtype is torch.float16)
    keys = ("input_ids", "token_type_ids", "attention_mask", "labels", "next_sentence_label")

    def on_dev(b):
        return {k: torch.as_tensor(b[k], device=dev) for k in keys if k in b}

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()
    losses, times = [], []
    t_loop = time.perf_counter()
    for step, b in enumerate(batches):
        t = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = sched.lr(step)
        x = on_dev(b)
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
            loss = model(**x).loss
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))               # (the read synchronises, as refbert's loop does)
        sync()
        times.append(time.perf_counter() - t)
    loop_s = time.perf_counter() - t_loop
    mlm, nsp = held_out(model, eval_data, a["batch_size"], dev, dtype) if eval_data is not None else (np.nan,) * 2
    res = dict(precision=prec, device=str(dev), steps=len(batches), mlm=mlm, nsp=nsp,
               train_last50=float(np.mean(losses[-50:])), step_ms=1e3 * statistics.median(times[1:] or times),
               loop_s=loop_s, **refbert_step_ms(args.run, batches),
               torch=torch.__version__, transformers=transformers.__version__)
    print(json.dumps(res), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
