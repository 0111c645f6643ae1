"""A CUDA graph's replays against the eager steps, step by step, on the small model where an H100 showed them
differ (kernels/cuda/graph.py, "checked"): two identical models (cuda backend, the same seed), one run eagerly,
one through StepGraph(validate=False), over batches whose count of labelled positions changes (3, 3, 4, 4, 3: a new
capture at each change), the parameters scaled in place after every step; printed per step: both losses, the worst
gradient difference, the captures so far, and the tensors that are not finite on each side.

    python benchmarks/graph_diag.py [--hidden 128] [--layers 1] [--precisions fp32 bf16-mixed]
    REFBERT_CUBLAS_WORKSPACE_MB=0 python benchmarks/graph_diag.py      (cuBLAS's own workspace instead of ours)
    python benchmarks/graph_diag.py --trace [--labelled 4]             (op by op: where a replay first differs)

The fault's cause, fixed since (reproduced on the H200, 2026-11-27: made the old way the slots overlap and the
bf16-mixed replays are NaN; made as now every replay equals its eager step bit for bit): the slots (the step's
host-to-device copies, filled before each replay) were made inside the capture from the graph's pool, so a slot
could get a block the step had used and freed earlier in the same step; a replay then filled the slot first and the
earlier kernel overwrote it (the labels, the labelled positions) before it was read. Now the slots are the warm-up's
arrays, alive through the graph (backend._held_slot), and StepGraph refuses a capture where a slot shares memory
with the step's arrays.

Diagnostics as environment variables (each changes one thing; gpu_all.sh's step graphdiag runs them in turn):
    REFBERT_GRAPH_SLOTS_IN_CAPTURE=1  the slots made inside the capture, as before the fix (the overlaps it makes
                                are printed instead of refused): the NaN coming back with them confirms the cause
    REFBERT_GRAPH_NO_REUSE=1    no memory reused inside the warm-up and the capture (two live arrays sharing the
                                graph pool's memory would show as a difference that goes away)
    REFBERT_BLAS_ZERO_OUT=1     every GEMM output zeroed before cuBLAS writes it (a small GEMM reading its output)
    --poison                    every allocation filled with 0xFF bytes (float32 NaN) as it is made, eager and
                                captured: a kernel reading memory nothing wrote gives NaN in the eager step too

--trace records every op's outputs (the model's ops wrapped) in an eager step and in the captured step, replays
the graph once at the eager step's dropout position, and prints each op whose replayed output differs from the
eager one (the first is the culprit, or the op after the culprit if a cuBLAS call inside it went wrong).

Needs a GPU (on the emulator StepGraph runs its replays eagerly: every row equal).
"""
import argparse
import os
import sys

import numpy as np


def _case(precision, hidden, layers):
    """(batch(n), the eager model, the model to replay: the same seed): the small model and its batches (B=2,
    T=8, row 1 padded from position 6, n labelled positions)."""
    from refbert import BertConfig
    from refbert.model import BertForPreTraining
    cfg = BertConfig(vocab_size=60, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                     intermediate_size=64, max_position_embeddings=16)
    B, T = 2, 8
    data = np.random.default_rng(0)

    def batch(n):
        ids = data.integers(4, 60, (B, T))
        am = np.ones((B, T), np.int64)
        am[1, 6:] = 0
        lab = np.full((B, T), -100)
        lab.reshape(-1)[data.permutation(B * T)[:n]] = data.integers(0, 60, n)
        return dict(input_ids=ids, attention_mask=am, labels=lab, next_sentence_label=data.integers(0, 2, B))
    return batch, *(BertForPreTraining(cfg, backend="cuda", precision=precision, seed=3) for _ in range(2))


def run(precision, hidden, layers, out=print):
    from refbert.model import to_numpy
    from refbert_kernels.cuda import graph as G
    batch, eager, replayed = _case(precision, hidden, layers)
    step = G.StepGraph(replayed, validate=False)
    for i, n in enumerate((3, 3, 4, 4, 3)):
        x = batch(n)
        la = eager(**x).loss
        ga = eager.backward()
        lb, gb = step(**x)
        bad_e = [k for k in ga if not np.isfinite(to_numpy(ga[k])).all()]
        bad_g = [k for k in gb if not np.isfinite(to_numpy(gb[k])).all()]
        d = max(float(np.abs(to_numpy(ga[k]) - to_numpy(gb[k])).max()) for k in ga)
        out(f"{precision} step {i} n={n}: eager loss {float(la):.6f}, replay {float(lb):.6f}, worst gradient "
            f"difference {d:.3e}, captures {step.captures}; not finite: eager {len(bad_e)} tensors, replay "
            f"{len(bad_g)} of {len(gb)} {bad_g[:2]}; slots sharing the step's memory: {step.overlaps}")
        for m in (eager, replayed):
            for p in m.params.values():
                p *= np.float32(0.999)
    step.close()


class Recorder:
    """The model's ops with every forward's output and every backward's gradients appended to `log` as (op name,
    [arrays]) (what a captured step's arrays hold after a replay, or an eager step's values)."""

    def __init__(self, ops, log):
        self._ops, self._log = ops, log

    def __getattr__(self, name):
        f = getattr(self._ops, name)
        if not callable(f) or not name.endswith(("_forward", "_backward")):
            return f

        def wrapped(*args, **kwargs):
            r = f(*args, **kwargs)
            outs = r[0] if name.endswith("_forward") else r
            outs = outs if isinstance(outs, tuple) else (outs,)
            self._log.append((name, [o for o in outs if hasattr(o, "shape") and hasattr(o, "dtype")]))
            return r
        return wrapped


def trace(precision, hidden, layers, labelled, out=print):
    from refbert.model import to_numpy
    from refbert_kernels.cuda import graph as G
    batch, eager, replayed = _case(precision, hidden, layers)
    x = batch(labelled)
    log_e, log_g = [], []
    eager.ops = Recorder(eager.ops, log_e)
    eager(**x)
    eager.backward()
    step = G.StepGraph(replayed, validate=False)
    replayed.ops = Recorder(replayed.ops, log_g)
    step._step = lambda batch: (log_g.clear(), G.StepGraph._step(step, batch))[1]   # keep the capture's arrays
    step(**x)
    if len(log_e) != len(log_g):
        out(f"{precision}: {len(log_e)} ops eager, {len(log_g)} captured: not comparable")
        return
    bad = 0
    for i, ((name, a), (name_g, g)) in enumerate(zip(log_e, log_g)):
        for j, (ae, ag) in enumerate(zip(a, g)):
            he, hg = np.asarray(to_numpy(ae), np.float64), np.asarray(to_numpy(ag), np.float64)
            d = float(np.abs(he - hg).max(initial=0.0))
            if not np.isfinite(hg).all() or d > 0:
                out(f"{precision} labelled={labelled}: op {i} {name} output {j} {tuple(ae.shape)} {ae.dtype}: "
                    f"max |replay - eager| {d:.3e}, replay finite {bool(np.isfinite(hg).all())}, eager finite "
                    f"{bool(np.isfinite(he).all())}")
                bad += 1
        if bad >= 8:
            break
    out(f"{precision} labelled={labelled}: {len(log_e)} ops compared, {bad} outputs differ (first 8 shown)")
    step.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16-mixed"])
    ap.add_argument("--trace", action="store_true", help="op by op, one step (see above)")
    ap.add_argument("--labelled", type=int, default=4, help="with --trace: labelled positions in the batch")
    ap.add_argument("--poison", action="store_true", help="fill every new allocation with NaN bytes (see above)")
    a = ap.parse_args(argv)
    if a.poison:
        import cupy
        pool = cupy.get_default_memory_pool()

        def poisoned(n):
            p = pool.malloc(n)
            if n:
                cupy.cuda.runtime.memsetAsync(p.ptr, 0xFF, n, cupy.cuda.get_current_stream().ptr)
            return p
        cupy.cuda.set_allocator(poisoned)
        print("allocations poisoned with 0xFF bytes", flush=True)
    print(*(f"{v}={os.environ.get(v)}" for v in ("REFBERT_GRAPH_SLOTS_IN_CAPTURE", "REFBERT_GRAPH_NO_REUSE",
                                                  "REFBERT_BLAS_ZERO_OUT", "REFBERT_CUBLAS_WORKSPACE_MB")), flush=True)
    for p in a.precisions:
        try:
            if a.trace:
                trace(p, a.hidden, a.layers, a.labelled, out=lambda s: print(s, flush=True))
            else:
                run(p, a.hidden, a.layers, out=lambda s: print(s, flush=True))
        except Exception as e:
            print(p, "ERROR", type(e).__name__, str(e)[:300], flush=True)


if __name__ == "__main__":
    sys.exit(main())
