"""Training runs: `refbert pretrain` (MLM + NSP) and `refbert finetune` (classification, pair, ner, qa).

A run directory holds
    log.csv, eval.csv          one row per step / per evaluation
    loss.png                   the curves, redrawn at every evaluation
    checkpoint-{step}/         an HF folder (config.json, model.safetensors, vocab.txt, tokenizer_config.json)
                               plus optimizer.safetensors (AdamW moments) and trainer_state.json (step, epoch,
                               batch, RNG states, arguments; with --mixed-precision fp16 the loss scaler's)
    latest.json                {"checkpoint": "checkpoint-..."}: the newest complete checkpoint
    model (pretrain), best (finetune)      the final / best model: a symbolic link to the HF folder model-{n} /
                                           best-{n} of its newest version, swapped atomically on each save
Checkpoints are written into a temporary folder beside their final place and renamed into it, and latest.json is
replaced atomically after that, so a run killed at any moment leaves the previous checkpoint intact and pointed to.
`--resume` continues from latest.json bit-exactly: the same parameters, optimizer moments, dropout generator and
data order, hence the same losses as a run that was never interrupted. A new run that fails, or is interrupted,
before its first checkpoint (finetune: before its first best model) has nothing to resume: it removes what it wrote
(FirstCheckpoint), so that the same command can run again.
"""
import contextlib
import csv
import json
import math
import os
import re
import shutil
import string
import sys
import tempfile
import time

import numpy as np

from . import model as M
from . import ops, safetensors_io
from .config import PRESETS, BertConfig
from .defaults import CONTROL, PRETRAIN, SCHEDULE
from .errors import UserError
from .fileio import utf8_named, write_text
from .mixed import FLAGS as MIXED_FLAGS
from . import optim
from .optim import AdamW, GradScaler, LinearWarmupDecay, clip_grad_norm
from .philox import DropoutRNG


# ----------------------------------------------------------------------------------------------------------------
# run folders, checkpoints, logs

def check_out(out, resume, overwrite=False, resumable=True):
    """Refuse a run folder that cannot be used, writing nothing: a resumed run needs its latest.json; a new one a
    new or empty folder (any folder with overwrite)."""
    if resume:
        if not os.path.isfile(os.path.join(out, "latest.json")):
            raise UserError(f"--resume: expected a run folder with latest.json, got {out!r} without one")
        return
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"--out: expected a folder, got {out!r}, which is a file")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise UserError(f"--out: {out!r} exists and is not empty; choose a new folder"
                        f"{', or pass --resume to continue that run' if resumable else ''} (nothing in it was touched)")


def prepare_out(out, resume, overwrite=False, resumable=True):
    """The run folder: new, or resumed. An existing non-empty folder is never written over by accident."""
    check_out(out, resume, overwrite, resumable)
    if not resume:
        os.makedirs(out, exist_ok=True)


class FirstCheckpoint:
    """`with FirstCheckpoint(out) as run:` around a new run, from before its first write; set `run.kept = True`
    once it has saved something worth keeping (pretrain: its first checkpoint, which --resume continues; finetune:
    its first best model). A failure before that (an exception, Ctrl-C) removes what the run wrote — the whole
    folder if the run made it, else the entries it added to a folder that was there (empty, or --overwrite) — so
    that the same command can simply be run again: a folder holding only logs would be refused as a new run, and
    --resume would not recognise it. A resumed run (new_run=False) has its checkpoint already: nothing is removed."""

    def __init__(self, out, new_run=True, command="run"):
        self.out, self.command, self.kept = out, command, not new_run
        self.before = set(os.listdir(out)) if os.path.isdir(out) else None    # None: the run makes the folder

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if kind is not None and not self.kept:
            self.discard()
        return False

    def discard(self):
        """Remove what the run wrote (see the class), and say so on stderr."""
        if not os.path.isdir(self.out):
            return
        if self.before is None:
            shutil.rmtree(self.out, ignore_errors=True)
            what = f"removed {self.out!r}"
        else:
            added = sorted(set(os.listdir(self.out)) - self.before)
            for name in added:
                path = os.path.join(self.out, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(path)
            what = f"removed what it had written into {self.out!r} ({', '.join(added) or 'nothing'})"
        print(f"refbert {self.command}: the run stopped before its first "
              f"{'checkpoint' if self.command == 'pretrain' else 'saved model'}; {what}, so the same command can run "
              f"again", file=sys.stderr)


def _write_json(path, obj):
    write_text(path, json.dumps(obj, indent=2))


def save_checkpoint(out, name, model, tokenizer, opt=None, state=None, keep=2):
    """Write the HF folder out/name atomically; returns its path.

    checkpoint-{step}: written into a temporary folder and renamed into place, then latest.json is pointed at it
    and the oldest checkpoints are dropped (keep the newest `keep`).
    best, model (saved again and again): each version is a folder name-{n}, and out/name is a symbolic link that is
    swapped onto the new version in one os.replace, so at every moment out/name is a whole model."""
    versioned = not name.startswith("checkpoint-")
    final = os.path.join(out, name)
    target = os.path.join(out, f"{name}-{_next_version(out, name):04d}") if versioned else final
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=out)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)                     # mkdtemp makes 0700
    try:
        model.save_pretrained(os.path.join(tmp, "m"))
        for f in os.listdir(os.path.join(tmp, "m")):
            os.replace(os.path.join(tmp, "m", f), os.path.join(tmp, f))
        os.rmdir(os.path.join(tmp, "m"))
        tokenizer.save_pretrained(tmp)
        if opt is not None:
            sd = opt.state_dict()                     # NumPy copies, whatever device the moments live on
            arrays = {f"{k}.{n}": a for k in ("m", "v") for n, a in sd[k].items()}
            safetensors_io.save_file(arrays, os.path.join(tmp, "optimizer.safetensors"))
            state = {**state, "optimizer": {k: v for k, v in sd.items() if k not in ("m", "v")}}
        if state is not None:
            _write_json(os.path.join(tmp, "trainer_state.json"), state)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if versioned:
        previous = os.path.realpath(final) if os.path.islink(final) else None
        link = os.path.join(out, f".tmp-link-{name}")
        with contextlib.suppress(FileNotFoundError):
            os.remove(link)
        os.symlink(os.path.basename(target), link)
        os.replace(link, final)                       # atomic: out/name is the old version or the new one
        if previous and previous != os.path.realpath(target):
            shutil.rmtree(previous, ignore_errors=True)
        return final
    _write_json(os.path.join(out, "latest.json"), {"checkpoint": name})
    old = sorted(d for d in os.listdir(out) if d.startswith("checkpoint-") and d != name)
    for d in old[:max(0, len(old) - (keep - 1))]:
        shutil.rmtree(os.path.join(out, d), ignore_errors=True)
    return final


def _next_version(out, name):
    taken = [int(d.rsplit("-", 1)[1]) for d in os.listdir(out)
             if d.startswith(f"{name}-") and d.rsplit("-", 1)[1].isdigit()]
    return max(taken, default=0) + 1


def load_checkpoint(out, model_cls, dtype=np.float32, backend="numpy"):
    """(folder, model, optimizer state dict, trainer state) of the checkpoint latest.json points at. The model is
    on `backend` (its parameters on the device for "cuda"); the state dict's moments are NumPy arrays, which
    AdamW.load_state_dict copies to the parameters' device."""
    with open(os.path.join(out, "latest.json")) as f:
        folder = os.path.join(out, json.load(f)["checkpoint"])
    model = model_cls.from_pretrained(folder, dtype=dtype, backend=backend)
    with open(os.path.join(folder, "trainer_state.json")) as f:
        state = json.load(f)
    arrays = safetensors_io.load_file(os.path.join(folder, "optimizer.safetensors"))
    sd = dict(state["optimizer"], m={}, v={})
    for key, a in arrays.items():
        which, name = key.split(".", 1)
        sd[which][name] = a.astype(model.dtype)
    return folder, model, sd, state


class CsvLog:
    """Append-only CSV; on resume, rows past the checkpoint's step are dropped first (they were never saved)."""

    def __init__(self, path, fields, resume_step=None):
        self.path, self.fields = path, fields
        rows = []
        if resume_step is not None and os.path.exists(path):
            with open(path, newline="") as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= resume_step]
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fields)
            w.writeheader()
            w.writerows(rows)

    def write(self, row):
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, self.fields).writerow({k: row.get(k, "") for k in self.fields})


def plot(out, title, baseline=None):
    """loss.png from log.csv and eval.csv (matplotlib, no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, style in (("log.csv", "-"), ("eval.csv", "o-")):
        path = os.path.join(out, name)
        if not os.path.exists(path):
            continue
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        keys = [k for k in (rows[0].keys() if rows else []) if k.endswith("loss") and rows[0][k] != ""]
        for k in keys:
            ax.plot([int(r["step"]) for r in rows], [float(r[k]) for r in rows], style,
                    label=f"{'eval ' if name == 'eval.csv' else ''}{k}", lw=1, ms=3)
    if baseline is not None:
        ax.axhline(baseline, color="gray", ls="--", lw=1, label="unigram baseline (MLM)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss.png"), dpi=100)
    plt.close(fig)


def _progress(total, initial, desc):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)


# ----------------------------------------------------------------------------------------------------------------
# pretraining

def pretraining_metrics(out, batch):
    """MLM and NSP loss and accuracy from the logits of BertForPreTraining (the loss is their sum); the MLM logits
    are every position's (prediction_logits) or the labelled positions' alone (mlm_decode="labelled"). A device
    backend's outputs ("cuda": CuPy arrays) are brought to the host first; the metrics are NumPy's on either."""
    out = M.to_numpy(out)
    labels, nsp = batch["labels"], batch["next_sentence_label"]
    kept = labels != -100
    if out.prediction_logits is not None:
        logits, targets = out.prediction_logits[kept], labels[kept]             # (n, V), (n,)
    else:
        pos = out.masked_lm_positions
        real = pos >= 0                                 # (model.mlm_rows: the rows padded with position -1)
        logits, targets = out.masked_lm_logits[real], labels.reshape(-1)[pos[real]]
    mlm_loss = float(ops.cross_entropy_forward(logits, targets)[0])
    nsp_loss = float(ops.cross_entropy_forward(out.seq_relationship_logits, nsp)[0])
    mlm_acc = float((logits.argmax(-1) == targets).mean()) if kept.any() else 0.0
    nsp_acc = float((out.seq_relationship_logits.argmax(-1) == nsp).mean())
    return dict(mlm_loss=mlm_loss, nsp_loss=nsp_loss, mlm_acc=mlm_acc, nsp_acc=nsp_acc, n_masked=int(kept.sum()))


def unigram_baseline(data, tokenizer, batch_size):
    """Cross-entropy (nats) of predicting each masked token from the corpus's unigram frequencies alone: the
    loss an MLM that ignores context would reach. Frequencies from the training batches of epoch 0."""
    counts = np.zeros(len(tokenizer.vocab), np.float64)
    for b in data.batches(0, batch_size):
        counts += np.bincount(b["labels"][b["labels"] != -100], minlength=counts.size)
    p = counts / counts.sum()
    nz = p > 0
    return float(-(p[nz] * np.log(p[nz])).sum())


def _flag(name):
    return "--" + name.replace("_", "-")


def _check_pretrain_args(a, given):
    """Every mistake in the arguments of a new pretraining run, found before anything is written."""
    if not a["corpus"]:
        raise UserError("--corpus: expected a text file to pretrain on (one sentence per line, a blank line between "
                        "documents), got none")
    for name, want in (("corpus", os.path.isfile), ("vocab", os.path.isfile), ("config", os.path.isfile),
                       ("init", os.path.isdir)):
        if a[name] and not want(a[name]):
            raise UserError(f"{_flag(name)}: expected an existing {'folder' if name == 'init' else 'file'}, "
                            f"got {a[name]!r}")
    if a["init"]:
        clash = [_flag(k) for k in ("vocab", "config", "preset") if k in given]
        if clash:
            raise UserError(f"--init: the folder brings its own vocabulary and config; drop {', '.join(clash)}")
        if not os.path.isfile(os.path.join(a["init"], "config.json")):
            raise UserError(f"--init: expected an HF BERT folder with config.json, got {a['init']!r} without one")
    elif not a["config"] and a["preset"] not in PRESETS:
        raise UserError(f"--preset: expected one of {', '.join(PRESETS)}, got {a['preset']!r}")
    for name, ok, want in (("short_seq_prob", 0 <= a["short_seq_prob"] <= 1, "a probability in [0, 1]"),
                           ("mlm_prob", 0 < a["mlm_prob"] <= 1, "a probability in (0, 1]"),
                           ("lr", 0 < a["lr"] < math.inf, "a positive finite learning rate"),
                           ("warmup", 0 <= a["warmup"] < math.inf, "a number of steps (or a fraction) >= 0"),
                           ("steps", a["steps"] >= 0, "an integer >= 0 (0: --epochs over the data)"),
                           ("stop_after", a["stop_after"] >= 0, "an integer >= 0 (0: never)"),
                           ("seed", a["seed"] >= 0, "an integer >= 0")):
        if not ok:
            raise UserError(f"{_flag(name)}: expected {want}, got {a[name]}")
    if a["steps"] and a["warmup"] >= 1 and a["warmup"] > a["steps"]:
        raise UserError(f"--warmup: expected at most --steps ({a['steps']}) warmup steps (or a fraction of them, "
                        f"below 1), got {a['warmup']:g}")


def _resumed_args(saved, given, step):
    """The arguments of a resumed run: the run's own. A given argument that differs from the run's is refused (the
    run would no longer be the one it was), except the schedule's with --allow-changed-schedule."""
    a = {**PRETRAIN, **saved}
    if given.get("steps") and given["steps"] < step:
        raise UserError(f"--steps: expected at least {step} (the checkpoint's step) to resume, got {given['steps']}")

    def same(k, v):
        if k in ("corpus", "config", "init", "vocab") and v and a[k]:
            return os.path.abspath(v) == os.path.abspath(a[k])
        return v == a[k]
    changed = {k: v for k, v in given.items() if k not in CONTROL and not same(k, v)}
    allowed = given.get("allow_changed_schedule", False)
    refused = {k: v for k, v in changed.items() if not (allowed and k in SCHEDULE)}
    if refused:
        hint = (" (--allow-changed-schedule lets --steps, --save-every, --eval-every and --stop-after change)"
                if any(k in SCHEDULE for k in refused) and not allowed else "")
        raise UserError("--resume: the run was started with other arguments; refusing to change " +
                        ", ".join(f"{_flag(k)} from {a[k]!r} to {v!r}" for k, v in refused.items()) +
                        f"; a resumed run continues exactly as it started{hint}")
    a.update(changed)
    a.update({k: given[k] for k in CONTROL if k in given})
    if "stop_after" not in given:
        a["stop_after"] = 0                          # the interruption was that invocation's: now run to the end
    return a


def pretrain(args):
    from .tokenization import BertTokenizer

    given = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    out, resume = given["out"], given.get("resume", False)
    # every check comes before the first write: a mistake leaves --out as it was (or absent)
    check_out(out, resume, given.get("overwrite", False))
    vocab_tmp = None
    try:
        if resume:
            folder, model, opt_state, state = load_checkpoint(out, M.BertForPreTraining,
                                                              backend=given.get("backend", "numpy"))
            a = _resumed_args(state["args"], given, state["step"])
            tokenizer = BertTokenizer.from_pretrained(folder)
        else:
            a = {**PRETRAIN, **given}
            _check_pretrain_args(a, given)
            tokenizer, vocab_tmp = _pretrain_tokenizer(a, BertTokenizer)
        if a.get("cuda_graph") and a["backend"] != "cuda":
            raise UserError(f"--cuda-graph: expected --backend cuda (the training step captured as a CUDA graph), "
                            f"got --backend {a['backend']}")
        data, eval_data, n_train_docs, n_eval = pretraining_data(a, tokenizer)
        if not resume:
            model = _pretrain_model(a, tokenizer, a["backend"])
            opt_state, state = None, dict(step=0, epoch=0, batch=0)
        model.precision = MIXED_FLAGS[a["mixed_precision"]]   # the run's own: --resume refuses a change
    except BaseException:
        if vocab_tmp is not None:
            shutil.rmtree(vocab_tmp, ignore_errors=True)
        raise
    with FirstCheckpoint(out, new_run=not resume, command="pretrain") as run:
        try:
            prepare_out(out, resume, a["overwrite"])
            if vocab_tmp is not None:                   # the vocabulary trained on the corpus joins the run
                shutil.move(os.path.join(vocab_tmp, "tokenizer"), os.path.join(out, "tokenizer"))
        finally:
            if vocab_tmp is not None:
                shutil.rmtree(vocab_tmp, ignore_errors=True)
        return _pretrain_steps(out, a, resume, model, tokenizer, opt_state, state, data, eval_data,
                               n_train_docs, n_eval, run)


def pretraining_data(a, tokenizer):
    """(data, eval_data or None, training documents, held-out documents) of a pretrain run's arguments `a` (the
    checkpoint's state["args"]): the corpus's documents split by the run's seed, 1 in 20 held out, each side's
    instances and masks drawn from the seed (the held-out side's from seed + 1). The same arguments give the same
    batches, masks included: benchmarks/torch_pretrain.py trains HF + PyTorch on exactly a run's data."""
    from .data import PretrainingData, read_documents
    docs = read_documents(a["corpus"])
    rng = np.random.default_rng(a["seed"])
    order = rng.permutation(len(docs))
    n_eval = min(max(1, len(docs) // 20), len(docs) - 1) if len(docs) > 1 else 0
    eval_docs = [docs[i] for i in order[:n_eval]]
    train_docs = [docs[i] for i in order[n_eval:]] or docs
    data_kw = dict(max_seq_length=a["max_seq_length"], short_seq_prob=a["short_seq_prob"],
                   next_sentence=a["objective"], masked_lm_prob=a["mlm_prob"],
                   max_predictions_per_seq=a["max_predictions"], whole_word=a["whole_word"], ngram=a["ngram"],
                   dynamic=not a["static_masking"], dupe_factor=a["dupe_factor"])
    data = PretrainingData(train_docs, tokenizer, seed=a["seed"], **data_kw)
    eval_data = PretrainingData(eval_docs, tokenizer, seed=a["seed"] + 1, **data_kw) if eval_docs else None
    return data, eval_data, len(train_docs), n_eval


def _pretrain_steps(out, a, resume, model, tokenizer, opt_state, state, data, eval_data, n_train_docs, n_eval, run):
    """pretrain's loop, from the run folder's first write on (`run` learns when the first checkpoint is saved)."""
    steps_per_epoch = max(1, math.ceil(len(data) / a["batch_size"]))
    total = a["steps"] or a["epochs"] * steps_per_epoch
    model.mlm_decode = "labelled"                       # decode the masked positions alone, as the original BERT
    opt = AdamW(model.parameters(), lr=a["lr"], weight_decay=0.01, correct_bias=not a["no_bias_correction"])
    if opt_state is not None:
        opt.load_state_dict(opt_state)
        model.dropout_rng.state = state["dropout_rng"]
    sched = LinearWarmupDecay(a["lr"], int(a["warmup"] * total) if a["warmup"] < 1 else int(a["warmup"]), total)
    scaler = _scaler(a["mixed_precision"], state.get("grad_scaler") if resume else None)
    baseline = unigram_baseline(data, tokenizer, a["batch_size"])
    # tokens_per_s: the batch's real tokens over the whole iteration (the next batch's masking, the metrics, the
    # logs included); step_ms: the step alone, from a batch in hand to its loss read back after the update (what
    # benchmarks/torch_pretrain.py times of HF + PyTorch's loop)
    fields = ["step", "epoch", "lr", "loss", "mlm_loss", "nsp_loss", "mlm_acc", "nsp_acc", "grad_norm", "tokens_per_s",
              "step_ms"]
    fields += ["loss_scale"] if scaler.is_enabled() else []
    log = CsvLog(os.path.join(out, "log.csv"), fields, state["step"] if resume else None)
    elog = CsvLog(os.path.join(out, "eval.csv"), ["step", "mlm_loss", "nsp_loss", "mlm_acc", "nsp_acc"],
                  state["step"] if resume else None)
    print(f"pretraining {model.num_parameters():,} parameters on {len(data)} sequences "
          f"({n_train_docs} documents; {n_eval} held out), {total} steps of {a['batch_size']}; "
          f"unigram baseline for the MLM loss: {baseline:.3f} nats")
    step, epoch, skip = state["step"], state["epoch"], state["batch"]
    stop = min(total, a["stop_after"]) if a["stop_after"] else total
    graph = _step_graph(model, a)
    bar = _progress(total, step, "pretrain")
    t0 = time.perf_counter()
    while step < stop:
        for bi, batch in enumerate(data.batches(epoch, a["batch_size"])):
            if bi < skip:
                continue                                # resumed mid-epoch: these batches were already seen
            if step >= stop:
                break
            t_step = time.perf_counter()
            model.train()
            lr, scale = sched.lr(step), scaler.get_scale()
            # an epoch's last batch, when smaller, runs eagerly: a capture of its own shapes would drop the run's
            # graph, and the next full batch would capture again (on the H200: 9 captures in 300 steps of the demo)
            short = graph is not None and len(batch["input_ids"]) != a["batch_size"]
            o = _graph_step(graph, batch, scaler) if graph is not None and not short else None
            if o is None:
                if not short:
                    graph = None                        # (refused: eager from here on)
                o = model(**batch)
                norm = _update(model, opt, scaler, lr)
            else:
                norm = _apply(o.pop("grads"), opt, scaler, lr)
            step += 1
            loss = float(o.loss)                        # (the read waits for the step's device work, the update's too)
            step_ms = 1e3 * (time.perf_counter() - t_step)
            met = pretraining_metrics(o, batch)
            tps = int(batch["attention_mask"].sum() / max(time.perf_counter() - t0, 1e-9))
            t0 = time.perf_counter()
            log.write(dict(step=step, epoch=epoch, lr=f"{lr:.6g}", loss=f"{loss:.6f}", grad_norm=f"{norm:.4f}",
                           tokens_per_s=tps, step_ms=f"{step_ms:.3f}", loss_scale=f"{scale:.17g}",
                           **{k: f"{v:.6f}" for k, v in met.items() if k != "n_masked"}))
            bar.set_postfix(loss=f"{loss:.3f}", mlm_acc=f"{met['mlm_acc']:.2f}", nsp_acc=f"{met['nsp_acc']:.2f}",
                            tok_s=tps)
            bar.update(1)
            done_epoch = bi + 1 >= steps_per_epoch
            position = dict(step=step, epoch=epoch + done_epoch, batch=0 if done_epoch else bi + 1)
            if eval_data is not None and (step % a["eval_every"] == 0 or step == total):
                elog.write(dict(step=step, **{k: f"{v:.6f}" for k, v in evaluate_pretraining(model, eval_data,
                                                                                             a["batch_size"]).items()}))
                plot(out, f"refbert pretrain ({a['preset'] or 'config'})", baseline)
            if step % a["save_every"] == 0 or step == total:
                st = dict(position, args=a, dropout_rng=model.dropout_rng.state)
                if scaler.is_enabled():
                    st["grad_scaler"] = scaler.state_dict()
                save_checkpoint(out, f"checkpoint-{step:07d}", model, tokenizer, opt, st)
                run.kept = True                          # a run --resume continues: it stays, whatever follows
        else:
            epoch, skip = epoch + 1, 0
            continue
        break
    bar.close()
    if graph is not None:
        print(f"CUDA graph: {graph.captures} capture(s), {graph.replays} replays")
    print(f"optimizer: {optim.describe()}")
    if step >= total:
        save_checkpoint(out, "model", model, tokenizer)
        plot(out, f"refbert pretrain ({a['preset'] or 'config'})", baseline)
        print(f"done: {step} steps; the model is in {os.path.join(out, 'model')}")
    elif run.kept:
        print(f"stopped after step {step} (--stop-after); continue with --resume")
    else:                                              # nothing --resume could start from
        print(f"stopped after step {step} (--stop-after), before the first checkpoint (--save-every "
              f"{a['save_every']})")
        run.discard()
    return 0


def _scaler(flag, state=None):
    """The loss scaler of a run: torch's dynamic fp16 loss scaling for --mixed-precision fp16 (its state restored
    on --resume), a pass-through otherwise (bf16 has float32's range)."""
    scaler = GradScaler(enabled=flag == "fp16")
    if state is not None:
        scaler.load_state_dict(state)
    return scaler


def _update(model, opt, scaler, lr):
    """Backward, then _apply. Returns the gradient norm before clipping (NaN for a skipped step)."""
    return _apply(model.backward(scaler.get_scale()), opt, scaler, lr)    # dloss = the loss scale (1 unless fp16)


def _apply(grads, opt, scaler, lr):
    """Unscale, clip to norm 1, AdamW step (skipped with fp16 when a gradient overflowed: the scaler then halves its
    scale), scaler update. Returns the gradient norm before clipping (NaN for a skipped step)."""
    norm = math.nan if scaler.unscale_(grads) else clip_grad_norm(grads, 1.0)
    scaler.step(opt, grads, lr=lr)
    scaler.update()
    return norm


def _step_graph(model, a):
    """--cuda-graph: the run's StepGraph (kernels/cuda/graph.py), the MLM rows padded to batch size x
    --max-predictions (model.mlm_rows: every batch the same shapes, one capture); None without the flag."""
    if not a.get("cuda_graph"):
        return None
    from refbert_kernels.cuda.graph import StepGraph
    model.mlm_rows = a["batch_size"] * a["max_predictions"]
    return StepGraph(model)


def _graph_step(graph, batch, scaler):
    """One step as a replay: the outputs with "grads" added, the masked positions this batch's (the graph's own are
    the capture's host array), or None when the graph was refused (a warning: the caller goes on eagerly)."""
    rng = graph.model.dropout_rng
    calls = rng.calls
    try:
        _, grads = graph(dloss=scaler.get_scale(), **batch)
    except RuntimeError as e:
        rng.calls = calls                               # the eager step draws the streams this one would have
        print(f"--cuda-graph: {e}; the steps run eagerly from here on", file=sys.stderr)
        return None
    o = type(graph.output)(graph.output)
    K = graph.model.mlm_rows
    rows = np.flatnonzero(batch["labels"].reshape(-1) != -100)
    if o.get("masked_lm_positions") is not None:
        o["masked_lm_positions"] = np.concatenate([rows, np.full(K - len(rows), -1, rows.dtype)])
    o["grads"] = grads
    return o


def evaluate_pretraining(model, data, batch_size):
    """Mean MLM/NSP loss and accuracy over the held-out sequences, masks fixed (epoch 0), eval mode."""
    model.eval()
    tot, n = {}, 0
    for b in data.batches(0, batch_size):
        with M.no_grad():
            met = pretraining_metrics(model(**b), b)
        w = len(b["input_ids"])
        for k, v in met.items():
            tot[k] = tot.get(k, 0.0) + v * w
        n += w
    model.train()
    return {k: tot[k] / n for k in ("mlm_loss", "nsp_loss", "mlm_acc", "nsp_acc")}


def _pretrain_tokenizer(a, BertTokenizer):
    """(tokenizer, None), or (tokenizer, a temporary folder holding tokenizer/) when one is trained on the corpus:
    it moves into the run folder once every check has passed."""
    if a["init"]:
        return BertTokenizer.from_pretrained(a["init"]), None
    if a["vocab"]:
        return BertTokenizer(a["vocab"], do_lower_case=not a["cased"]), None
    from .tokenization import train_vocab
    tmp = tempfile.mkdtemp(prefix="refbert-vocab-")
    try:
        train_vocab([a["corpus"]], os.path.join(tmp, "tokenizer"), vocab_size=a["vocab_size"],
                    lowercase=not a["cased"])
        return BertTokenizer.from_pretrained(os.path.join(tmp, "tokenizer")), tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _pretrain_model(a, tokenizer, backend="numpy"):
    if a["init"]:                                       # continue pretraining any HF BERT on in-domain text
        return M.BertForPreTraining.from_pretrained(a["init"], backend=backend).train()
    if a["config"]:
        config = BertConfig.from_json_file(a["config"])
    else:
        config = BertConfig.preset(a["preset"], vocab_size=len(tokenizer.vocab),
                                   max_position_embeddings=max(512, a["max_seq_length"]))
    if config.max_position_embeddings < a["max_seq_length"]:
        raise UserError(f"--max-seq-length: expected at most {config.max_position_embeddings} (the config's "
                        f"max_position_embeddings), got {a['max_seq_length']}")
    if config.vocab_size != len(tokenizer.vocab):
        raise UserError(f"--config: vocab_size {config.vocab_size} does not match the tokenizer's "
                        f"{len(tokenizer.vocab)} tokens")
    attention_fits(a["batch_size"], config.num_attention_heads, a["max_seq_length"])
    return M.BertForPreTraining(config, seed=a["seed"], backend=backend)


def attention_fits(B, H, T):
    """Refuse (by the flags that set them) a batch whose one layer's attention probabilities (B, H, T, T) float32
    would not fit in this machine's memory: --max-seq-length 100000 asked for 2.3 TiB and died in NumPy."""
    need = 4 * B * H * T * T
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):        # (no sysconf: nothing to compare with)
        return
    if need > have:
        raise UserError(f"--max-seq-length / --batch-size: one layer's attention probabilities (B, H, T, T) = "
                        f"({B}, {H}, {T}, {T}) would take {need / 2 ** 30:.1f} GiB of float32, more than this "
                        f"machine's {have / 2 ** 30:.1f} GiB of memory; lower --max-seq-length or --batch-size")


# ----------------------------------------------------------------------------------------------------------------
# fine-tuning: data files, encoding, metrics

TASKS = {  # task -> (model class, required fields of a row)
    "classification": ("BertForSequenceClassification", ("text", "label")),
    "pair": ("BertForSequenceClassification", ("text_a", "text_b", "label")),
    "ner": ("BertForTokenClassification", ("tokens", "tags")),
    "qa": ("BertForQuestionAnswering", ("question", "context", "answer_text", "answer_start")),
}


def read_rows(path, task):
    """Rows of a .jsonl (one JSON object a line) or .csv (a header row) file, checked against the task's schema;
    a malformed row is reported with its line number."""
    if task not in TASKS:
        raise UserError(f"--task: expected one of {', '.join(TASKS)}, got {task!r}")
    fields = TASKS[task][1]
    if not os.path.isfile(path):
        raise UserError(f"{path}: no such file")
    rows = []
    with open(path, encoding="utf-8-sig", newline="") as f, utf8_named(path):   # -sig: a byte-order mark (Excel)
        if path.endswith(".csv"):
            if task in ("ner", "qa"):
                raise UserError(f"{path}: task {task!r} reads .jsonl files (its rows hold lists or offsets)")
            items = [(i + 2, r) for i, r in enumerate(csv.DictReader(f))]
        else:
            items = []
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    items.append((i, json.loads(line)))
                except json.JSONDecodeError as e:
                    raise UserError(f"{path}, line {i}: expected a JSON object, got invalid JSON ({e.msg})") from None
    for line, r in items:
        if not isinstance(r, dict) or any(k not in r for k in fields):
            raise UserError(f"{path}, line {line}: expected the fields {list(fields)}, got "
                            f"{sorted(r) if isinstance(r, dict) else type(r).__name__}")
        if task in ("classification", "pair") and any(r[k] is None or str(r[k]) == "" for k in fields):
            raise UserError(f"{path}, line {line}: expected a value in each of {list(fields)}, got an empty one")
        texts = {"classification": ("text",), "pair": ("text_a", "text_b"), "qa": ("question", "context",
                                                                                "answer_text")}.get(task, ())
        for k in texts:
            if not isinstance(r[k], str):
                raise UserError(f"{path}, line {line}: expected '{k}' to be a string, got {type(r[k]).__name__} "
                                f"{r[k]!r:.40}")
        if task == "ner":
            tokens, tags = r["tokens"], r["tags"]
            if not (isinstance(tokens, list) and isinstance(tags, list)
                    and all(isinstance(x, str) for x in tokens + tags)):
                raise UserError(f"{path}, line {line}: expected 'tokens' and 'tags' to be lists of strings")
            if len(tokens) != len(tags):
                raise UserError(f"{path}, line {line}: expected 'tokens' and 'tags' lists of equal length")
        if task == "qa":
            s = r["answer_start"]
            # (an unanswerable row, answer_text "", may carry SQuAD 2.0's answer_start -1)
            if r["answer_text"] and isinstance(s, int) and not isinstance(s, bool) and s < 0:
                raise UserError(f"{path}, line {line}: expected 'answer_start' >= 0 (a character offset into "
                                f"'context'), got {s}")
            if not isinstance(s, int) or (r["answer_text"] and (s < 0 or r["context"][s:s + len(r["answer_text"])]
                                                                != r["answer_text"])):
                raise UserError(f"{path}, line {line}: expected context[answer_start:][:len(answer_text)] == "
                                f"answer_text, got {r['context'][s:s + len(r['answer_text'])]!r}" if isinstance(s, int)
                                else f"{path}, line {line}: expected an integer 'answer_start', got {s!r}")
        rows.append(r)
    if not rows:
        raise UserError(f"{path}: expected at least one row, got none")
    return rows


def label_set(rows, task):
    if task == "qa":
        return None
    if task == "ner":
        return sorted({t for r in rows for t in r["tags"]} | {"O"})
    return sorted({str(r["label"]) for r in rows})


def encode_rows(rows, task, tokenizer, max_len, label2id):
    """Arrays for a list of rows; for ner and qa also what evaluation needs to map tokens back to text."""
    if task in ("classification", "pair"):
        enc = tokenizer([r["text"] if task == "classification" else r["text_a"] for r in rows],
                        [r["text_b"] for r in rows] if task == "pair" else None,
                        padding="max_length", truncation=True, max_length=max_len, return_tensors="np")
        labels = np.array([label2id.get(str(r["label"]), -1) for r in rows])
        if (labels < 0).any():
            bad = rows[int(np.flatnonzero(labels < 0)[0])]["label"]
            raise UserError(f"label {bad!r} does not occur in the training file (labels: {sorted(label2id)})")
        return dict(input_ids=enc["input_ids"], token_type_ids=enc["token_type_ids"],
                    attention_mask=enc["attention_mask"], labels=labels), None
    if task == "ner":
        texts, spans = [], []
        for r in rows:                                  # words joined by spaces; remember each word's span
            pos, sp = 0, []
            for w in r["tokens"]:
                sp.append((pos, pos + len(w)))
                pos += len(w) + 1
            texts.append(" ".join(r["tokens"]))
            spans.append(sp)
        enc = tokenizer(texts, padding="max_length", truncation=True, max_length=max_len, return_tensors="np",
                        return_offsets_mapping=True)
        labels = np.full(enc["input_ids"].shape, -100)
        word_of = np.full(enc["input_ids"].shape, -1)
        for b, r in enumerate(rows):
            seen = set()
            for t, (s, e) in enumerate(enc["offset_mapping"][b]):
                if e <= s:
                    continue                            # special or padding
                w = next((i for i, (ws, we) in enumerate(spans[b]) if ws <= s < we), None)
                if w is not None and w not in seen:     # the first piece of a word carries its tag (HF's recipe)
                    seen.add(w)
                    labels[b, t] = label2id.get(r["tags"][w], label2id["O"])
                    word_of[b, t] = w
        return dict(input_ids=enc["input_ids"], token_type_ids=enc["token_type_ids"],
                    attention_mask=enc["attention_mask"], labels=labels), dict(word_of=word_of)
    # longest_first rather than HF's only_second: a long question is cut too, instead of failing the row
    enc = tokenizer([r["question"] for r in rows], [r["context"] for r in rows], padding="max_length",
                    truncation="longest_first", max_length=max_len, return_tensors="np", return_offsets_mapping=True)
    starts, ends = np.zeros(len(rows), np.int64), np.zeros(len(rows), np.int64)
    ctx = qa_context_mask(enc)
    for b, r in enumerate(rows):
        if not r["answer_text"]:
            continue                                    # unanswerable: both positions at [CLS]
        cs, ce = r["answer_start"], r["answer_start"] + len(r["answer_text"])
        off = enc["offset_mapping"][b]
        toks = [t for t in np.flatnonzero(ctx[b]) if off[t][1] > cs and off[t][0] < ce]
        # the answer must lie whole in the window; truncated away, even in part: [CLS], as HF's recipe
        if toks and off[toks[0]][0] <= cs and off[toks[-1]][1] >= ce:
            starts[b], ends[b] = toks[0], toks[-1]
    return dict(input_ids=enc["input_ids"], token_type_ids=enc["token_type_ids"], attention_mask=enc["attention_mask"],
                start_positions=starts, end_positions=ends), dict(offsets=enc["offset_mapping"], context_mask=ctx)


def qa_context_mask(enc):
    """(B, T) bool: the tokens an answer may lie in: the context's (segment 1, real), not its [SEP] (a special
    token covers no character: its offsets are (0, 0))."""
    off = np.asarray(enc["offset_mapping"])
    return (enc["token_type_ids"] == 1) & (enc["attention_mask"] == 1) & (off[..., 1] > off[..., 0])


def _entities(tags):
    """BIO spans (type, start, end) of a tag sequence."""
    spans, cur = set(), None
    for i, t in enumerate(list(tags) + ["O"]):
        if cur and not (t.startswith("I-") and t[2:] == cur[0]):
            spans.add((cur[0], cur[1], i))
            cur = None
        if t.startswith("B-") or (t.startswith("I-") and cur is None):
            cur = (t[2:], i)
    return spans


def _f1(pred, gold):
    tp = len(pred & gold)
    p, r = tp / max(len(pred), 1), tp / max(len(gold), 1)
    return 2 * p * r / (p + r) if p + r else 0.0


def _qa_normalize(text):
    """SQuAD's normalize_answer: lower case, no punctuation, no articles (a, an, the), single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


_PUNCTUATION = set(string.punctuation)


def _qa_em(pred, gold):
    return float(_qa_normalize(pred) == _qa_normalize(gold))


def _qa_f1(pred, gold):
    """SQuAD's token F1 over normalised words."""
    p, g = _qa_normalize(pred).split(), _qa_normalize(gold).split()
    common = sum(min(p.count(w), g.count(w)) for w in set(p))
    if not p or not g:
        return float(p == g)
    return 0.0 if common == 0 else 2 * common / (len(p) + len(g))


def evaluate(model, task, rows, arrays, extra, batch_size, id2label):
    """The task's metrics on a dev set: accuracy (classification, pair); entity F1 and token accuracy (ner, BIO
    spans as conlleval counts them); exact match and token F1 (qa, SQuAD's definitions)."""
    model.eval()
    n = len(rows)
    with M.no_grad():                                   # no backward follows: keep no activations
        outs = [M.to_numpy(model(**{k: v[i:i + batch_size] for k, v in arrays.items()}))   # ("cuda": to the host)
                for i in range(0, n, batch_size)]
    if task in ("classification", "pair"):
        pred = np.concatenate([o.logits.argmax(-1) for o in outs])
        return dict(accuracy=float((pred == arrays["labels"]).mean()))
    if task == "ner":
        pred = np.concatenate([o.logits.argmax(-1) for o in outs])
        gold_spans, pred_spans, correct, total = set(), set(), 0, 0
        for b, r in enumerate(rows):
            words = {int(w): t for t, w in enumerate(extra["word_of"][b]) if w >= 0}
            ptags = [id2label[int(pred[b, words[w]])] if w in words else "O" for w in range(len(r["tags"]))]
            gold_spans |= {(b, *s) for s in _entities(r["tags"])}
            pred_spans |= {(b, *s) for s in _entities(ptags)}
            correct += sum(p == g for p, g in zip(ptags, r["tags"]))
            total += len(r["tags"])
        return dict(f1=_f1(pred_spans, gold_spans), token_accuracy=correct / max(total, 1))
    start = np.concatenate([o.start_logits for o in outs])
    end = np.concatenate([o.end_logits for o in outs])
    ctx = extra["context_mask"]
    # the null answer competes only when the data has unanswerable questions (SQuAD 2.0 style)
    has_null = any(not r["answer_text"] for r in rows)
    spans = M.decode_qa_span(start, end, max_answer_length=30, context_mask=ctx,
                             null_score_diff_threshold=0.0 if has_null else float("inf"))
    em = f1 = 0.0
    for b, (s, e, _) in enumerate(spans):
        off = extra["offsets"][b]
        text = rows[b]["context"][off[s][0]:off[e][1]] if e >= s > 0 else ""  # (0, 0): the null answer
        em += _qa_em(text, rows[b]["answer_text"])
        f1 += _qa_f1(text, rows[b]["answer_text"])
    return dict(exact_match=em / n, f1=f1 / n)


def baseline(task, train_rows, dev_rows):
    """What a model that ignores its input scores: the majority class (classification, pair), all "O" (ner:
    F1 0), the first sentence of the context after its first ": " (qa: the demo's first summary)."""
    if task in ("classification", "pair"):
        labels = [str(r["label"]) for r in train_rows]
        major = max(set(labels), key=labels.count)
        return dict(accuracy=float(np.mean([str(r["label"]) == major for r in dev_rows])))
    if task == "ner":
        return dict(f1=0.0)
    first = [re.split(r"(?<=\.)\s", r["context"].split(": ", 1)[-1])[0] for r in dev_rows]
    return dict(exact_match=float(np.mean([_qa_em(p, r["answer_text"]) for p, r in zip(first, dev_rows)])),
                f1=float(np.mean([_qa_f1(p, r["answer_text"]) for p, r in zip(first, dev_rows)])))


def finetune(args):
    from .tokenization import BertTokenizer

    out, task = args.out, args.task
    if task not in TASKS:
        raise UserError(f"--task: expected one of {', '.join(TASKS)}, got {task!r}")
    train_rows, dev_rows = read_rows(args.train, task), read_rows(args.dev, task)
    tokenizer = BertTokenizer.from_pretrained(args.init)
    max_pos = BertConfig.from_pretrained(args.init).max_position_embeddings
    if args.max_seq_length > max_pos:
        raise UserError(f"--max-seq-length: expected at most {max_pos} (the model's max_position_embeddings), "
                        f"got {args.max_seq_length}")
    need = 5 if task in ("pair", "qa") else 3            # [CLS] text [SEP] (text [SEP]), a token of each text
    if args.max_seq_length < need:
        raise UserError(f"--max-seq-length: expected at least {need} for task {task!r} ([CLS], [SEP] and one token "
                        f"of each text), got {args.max_seq_length}")
    check_out(out, False, args.overwrite, resumable=False)
    labels = label_set(train_rows, task)
    if task in ("classification", "pair") and len(labels) < 2:
        raise UserError(f"{args.train}: expected at least two labels to tell apart, got one ({labels[0]!r}): a "
                        f"one-label classifier would be HF's regression (num_labels == 1), not a classifier")
    cls = getattr(M, TASKS[task][0])
    id2label = dict(enumerate(labels)) if labels else {0: "start", 1: "end"}
    model = cls.from_pretrained(args.init, id2label=id2label, backend=args.backend,
                                precision=MIXED_FLAGS[getattr(args, "mixed_precision", "no")])
    if args.seed is not None:
        model.dropout_rng = DropoutRNG(args.seed)
    label2id = {v: k for k, v in id2label.items()}
    tr, _ = encode_rows(train_rows, task, tokenizer, args.max_seq_length, label2id)
    dv, dv_extra = encode_rows(dev_rows, task, tokenizer, args.max_seq_length, label2id)
    n, B = len(train_rows), args.batch_size
    total = math.ceil(n / B) * args.epochs
    base = baseline(task, train_rows, dev_rows)
    print(f"fine-tuning {TASKS[task][0]} on {n} rows ({args.epochs} epochs, {total} steps); dev {len(dev_rows)} rows; "
          f"baseline {base}")
    with FirstCheckpoint(out, new_run=True, command="finetune") as run:
        prepare_out(out, False, args.overwrite, resumable=False)   # every check done: the first write
        return _finetune_epochs(args, task, model, tokenizer, tr, (dev_rows, dv, dv_extra), id2label, base, total,
                                run)


def _finetune_epochs(args, task, model, tokenizer, tr, dev, id2label, base, total, run):
    """finetune's loop, from the run folder's first write on (`run` learns when the first best model is saved)."""
    out, (dev_rows, dv, dv_extra) = args.out, dev
    n, B = len(tr["input_ids"]), args.batch_size
    opt = AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = LinearWarmupDecay(args.lr, int(0.1 * total), total)
    scaler = _scaler(getattr(args, "mixed_precision", "no"))
    metric = {"classification": "accuracy", "pair": "accuracy", "ner": "f1", "qa": "f1"}[task]
    log = CsvLog(os.path.join(out, "log.csv"), ["step", "epoch", "lr", "loss"])
    elog = CsvLog(os.path.join(out, "eval.csv"), ["step", "epoch", "loss", *sorted(evaluate_keys(task))])
    rng = np.random.default_rng(args.seed or 0)
    bar = _progress(total, 0, f"finetune {task}")
    step, best = 0, -1.0
    for epoch in range(args.epochs):
        order = rng.permutation(n)
        losses = []
        for i in range(0, n, B):
            idx = order[i:i + B]
            model.train()
            o = model(**{k: v[idx] for k, v in tr.items()})
            lr = sched.lr(step)
            _update(model, opt, scaler, lr)
            step += 1
            losses.append(float(o.loss))
            log.write(dict(step=step, epoch=epoch, lr=f"{lr:.6g}", loss=f"{float(o.loss):.6f}"))
            bar.set_postfix(loss=f"{float(o.loss):.3f}")
            bar.update(1)
        scores = evaluate(model, task, dev_rows, dv, dv_extra, B, id2label)
        elog.write(dict(step=step, epoch=epoch + 1, loss=f"{np.mean(losses):.6f}", **{k: f"{v:.4f}" for k, v in scores.items()}))
        bar.write(f"epoch {epoch + 1}: train loss {np.mean(losses):.4f}, dev " +
                  ", ".join(f"{k} {v:.4f}" for k, v in scores.items()))
        if scores[metric] > best:
            best = scores[metric]
            save_checkpoint(out, "best", model, tokenizer)
            run.kept = True                              # a model worth keeping: the folder stays
        plot(out, f"refbert finetune {task}")
    bar.close()
    print(f"optimizer: {optim.describe()}")
    print(f"best dev {metric} {best:.4f} (baseline {base}); the best model is in {os.path.join(out, 'best')}")
    return 0


def evaluate_keys(task):
    return {"classification": ["accuracy"], "pair": ["accuracy"], "ner": ["f1", "token_accuracy"],
            "qa": ["exact_match", "f1"]}[task]
