"""`refbert trace`: one forward and backward of a tiny BertForPreTraining, printed op by op and layer by layer.

For every op call: where it sits (the parameter it reads, or the block it belongs to), its input and output shapes,
the norm of the gradient that reached its output and of the gradients it sent back, and a finite-difference spot
check of that very call (float64, centred differences along one random direction, on the inputs it really saw).
The reading companion of docs/backprop.md: run it, then follow a row's gradient through the derivation.
"""
import inspect

import numpy as np

from . import ops as numpy_ops
from .config import BertConfig
from .gradcheck import TOLERANCE, check_pair
from .model import BertForPreTraining, get_backend
from .philox import DropoutRNG


class TracingOps:
    """A backend that wraps another (refbert.ops by default) and records each call. Forwards are recorded with
    their arguments; each cache is tagged with its record, so the matching backward can be found."""

    def __init__(self, names, ops=numpy_ops):
        self.ops, self.names, self.records, self.where = ops, names, [], "embeddings"

    def __getattr__(self, attr):
        fn = getattr(self.ops, attr)
        if attr.endswith("_forward"):
            return lambda *a, **kw: self._forward(attr[:-len("_forward")], fn, a, kw)
        if attr.endswith("_backward"):
            return lambda dout, cache: self._backward(fn, dout, cache)
        return lambda cache, *a: fn(cache[1], *a)      # helpers that read a cache (attention_probs)

    def _forward(self, op, fn, args, kwargs):
        bound = inspect.signature(fn).bind(*args, **kwargs)
        params = [self.names[id(v)] for v in bound.arguments.values() if id(v) in self.names]
        if params:                                       # the module this op belongs to, e.g. encoder.layer.1
            self.where = params[0].rsplit(".", 2)[0] if op != "embedding" else "embeddings"
        rng = bound.arguments.get("rng")
        where = params[0].rsplit(".", 1)[0] if params else self.where    # the module: strip .weight/.bias
        if op == "linear" and params and params[0].endswith("word_embeddings.weight"):
            where = "cls.predictions.decoder (tied to word_embeddings)"
            self.where = "cls.predictions"              # the gather and the loss that follow belong to the head
        rec = dict(op=op, fn=fn, backward=getattr(self.ops, f"{op}_backward"), args=dict(bound.arguments), where=where,
                   rng_state=rng.state if isinstance(rng, DropoutRNG) else None)
        out, cache = fn(*args, **kwargs)
        rec["shapes"] = [np.shape(v) for v in bound.arguments.values() if isinstance(v, np.ndarray)]
        rec["out"] = np.shape(out)
        self.records.append(rec)
        return out, (len(self.records) - 1, cache)

    def _backward(self, fn, dout, cache):
        i, inner = cache
        grads = fn(dout, inner)
        grads_t = grads if isinstance(grads, tuple) else (grads,)
        self.records[i].update(dout_norm=float(np.linalg.norm(dout)), grad_norms=[float(np.linalg.norm(g)) for g in grads_t],
                               n_grads=len(grads_t))
        return grads


def spot_check(rec, seed=0):
    """Directional finite-difference check of one recorded call, on its own inputs, in float64."""
    if "n_grads" not in rec:
        return None                                      # never reached by the backward
    fn, args = rec["fn"], dict(rec["args"])
    floats = [k for k, v in args.items() if isinstance(v, np.ndarray) and v.dtype.kind == "f"]
    wrt = tuple(floats[:rec["n_grads"]])                 # the differentiable inputs lead the signature
    fixed = {k: v for k, v in args.items() if k not in wrt}
    state = rec["rng_state"]
    backward = rec["backward"]                           # the same backend's (a composed op's: its composition)

    def forward(**x):
        kw = dict(fixed)
        if state is not None:                            # replay the same dropout draw at every evaluation
            kw["rng"] = DropoutRNG(**state)
        return fn(**x, **kw)
    # the step follows the inputs' scale: layernorm is scale-invariant, and at BERT's init (std 0.02) a fixed
    # h = 1e-5 would leave its linear regime
    rms = min(float(np.sqrt(np.mean(args[k] ** 2))) or 1.0 for k in wrt)
    errs = check_pair(forward, backward, {k: args[k] for k in wrt}, wrt, seed=seed, mode="directional", n_dirs=1,
                      h=1e-5 * min(1.0, rms))
    return max(errs.values())


def trace(config=None, B=2, T=8, seed=0, dtype=np.float64, backend="numpy"):
    """Run one traced training step on `backend`; returns (records, loss)."""
    config = config or BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32)
    model = BertForPreTraining(config, seed=seed, dtype=dtype)
    names = {id(v): k for k, v in model.parameters().items()}
    model.ops = tracer = TracingOps(names, get_backend(backend))
    r = np.random.default_rng(seed)
    ids = r.integers(5, config.vocab_size, (B, T))
    ids[:, 0], ids[:, T // 2], ids[:, -1] = 1, 2, 2     # [CLS]-like and [SEP]-like ids
    am = np.ones((B, T), np.int64)
    am[-1, T - 2:] = 0
    labels = np.where(r.random((B, T)) < 0.3, ids, -100)
    labels[0, 1] = ids[0, 1]
    tt = (np.arange(T) > T // 2).astype(np.int64)[None].repeat(B, 0)
    out = model(input_ids=ids, attention_mask=am, token_type_ids=tt, labels=labels,
                next_sentence_label=np.arange(B) % 2)
    model.backward()
    return tracer.records, float(out.loss)


def noise_floor(dtype=np.float64):
    """A gradient whose norm is below this fraction of the largest one leaving the same op call is rounding noise
    around an exact zero: 1000 eps of the dtype (float64: 2.2e-13), far below any gradient the math makes nonzero
    in these calls (the smallest, a pooler bias, is ~1e-2 of its call's largest) and far above the noise of a
    zero sum (~eps times the terms summed)."""
    return 1e3 * np.finfo(dtype).eps


def main(args=None):
    backend = getattr(args, "backend", "numpy") or "numpy"
    records, loss = trace(backend=backend)
    print(f"one training step of a tiny BertForPreTraining (L2 H16 A2, B2 T8, float64, dropout on, backend "
          f"{backend}); loss {loss:.4f}")
    print("rows in forward order; |dout| reached the op's output, |d in| left through its inputs (backward order is "
          "bottom to top)\n")
    W = max(len(r["where"]) for r in records) + 2
    O = max(len(r["op"]) for r in records) + 2
    print(f"{'op':<{O}}{'where':<{W}}{'inputs -> output':<46}{'|dout|':>9}  {'|d in|':<28}{'FD err':>8}")
    block, failed, zeros, forward_only = None, 0, [], []
    for rec in records:
        w = rec["where"]
        b = w.split(".layer.")[1].split(".")[0] if ".layer." in w else ("heads" if w.startswith("cls") else "embeddings"
                                                                         if "embeddings" in w else "pooler")
        if b != block:
            block = b
            print(f"-- {'encoder layer ' + b if b.isdigit() else b} " + "-" * 40)
        err = spot_check(rec)
        failed += err is not None and err > TOLERANCE
        shapes = " ".join(str(s).replace(" ", "") for s in rec["shapes"]) + f" -> {str(rec['out']).replace(' ', '')}"
        norms = rec.get("grad_norms", [])
        grads = []
        for i, g in enumerate(norms):               # "*": zero in exact arithmetic, what is left is rounding
            zero = g <= noise_floor() * max(norms)
            grads.append(f"{g:.2e}{'*' if zero else ''}")
            if zero:
                zeros.append((rec, i))
        if "n_grads" not in rec:
            forward_only.append(rec)
        dout = f"{rec['dout_norm']:>9.2e}" if "dout_norm" in rec else f"{'—':>9}"
        fd = "-" if err is None else f"{err:.1e}"
        print(f"{rec['op']:<{O}}{rec['where']:<{W}}{shapes:<46}{dout}  {' '.join(grads) or 'forward only':<28}{fd:>8}")
    print(f"\n{len(records)} op calls, {failed} spot check(s) above {TOLERANCE:g}")
    for line in notes(zeros, forward_only):
        print(line)
    return 1 if failed else 0


def notes(zeros, forward_only):
    """The footnotes of the table: what a "*" and a "forward only" row mean, and why."""
    lines = []
    if zeros:
        which = sorted({rec["where"] + (".bias" if rec["op"] == "linear" and i == 2 else f" input {i}")
                        for rec, i in zeros})
        lines += ["", f"* zero in exact arithmetic; the norm printed is float64 rounding (below {noise_floor():.1e} "
                      f"of the largest gradient of its call):"] + [f"    {w}" for w in which]
        if any(rec["where"].endswith("attention.self.key") for rec, _ in zeros):
            lines += ["  The key bias b_k adds q_i . b_k to every score s_ij of query i, the same for every key j, and",
                      "  softmax ignores a constant added to a row: softmax(s + c) = softmax(s). So the loss does not",
                      "  depend on b_k: dL/db_k = sum_i q_i (sum_j ds_ij) = 0, since softmax's backward leaves every row",
                      "  of ds summing to zero. Computed, each such sum is ~eps times its terms instead of 0; AdamW's",
                      "  eps (1e-6) outweighs that noise, so b_k barely moves from its initial value. (docs/backprop.md,",
                      "  section 4.)"]
    if forward_only:
        lines += ["", "forward only: a call whose output no loss reads, so no gradient comes back to it: "
                      + ", ".join(sorted({r["where"] for r in forward_only})) + "."]
        if any("decoder" in r["where"] for r in forward_only):
            lines += ["  The decoder's call on all B*T rows makes prediction_logits (HF's output); the MLM loss reads",
                      "  the labelled rows, decoded again below it (mlm_decode=\"labelled\" skips the full call)."]
    return lines
