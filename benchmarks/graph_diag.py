"""A CUDA graph's replays against the eager steps, step by step, on the small model where an H100 showed them
differ (kernels/cuda/graph.py, "checked"): two identical models (cuda backend, the same seed), one run eagerly,
one through StepGraph(validate=False), over batches whose count of labelled positions changes (3, 3, 4, 4, 3: a new
capture at each change), the parameters scaled in place after every step; printed per step: both losses, the worst
gradient difference, the captures so far, and the tensors that are not finite on each side.

    python benchmarks/graph_diag.py [--hidden 128] [--layers 1] [--precisions fp32 bf16-mixed]
    REFBERT_CUBLAS_WORKSPACE_MB=0 python benchmarks/graph_diag.py      (cuBLAS's own workspace instead of ours)

Needs a GPU (on the emulator StepGraph runs its replays eagerly: every row equal).
"""
import argparse
import sys

import numpy as np


def run(precision, hidden, layers, out=print):
    from refbert import BertConfig
    from refbert.model import BertForPreTraining, to_numpy
    from refbert_kernels.cuda import graph as G
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
    eager = BertForPreTraining(cfg, backend="cuda", precision=precision, seed=3)
    replayed = BertForPreTraining(cfg, backend="cuda", precision=precision, seed=3)
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
            f"{len(bad_g)} of {len(gb)} {bad_g[:2]}")
        for m in (eager, replayed):
            for p in m.params.values():
                p *= np.float32(0.999)
    step.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16-mixed"])
    a = ap.parse_args(argv)
    for p in a.precisions:
        try:
            run(p, a.hidden, a.layers, out=lambda s: print(s, flush=True))
        except Exception as e:
            print(p, "ERROR", type(e).__name__, str(e)[:300], flush=True)


if __name__ == "__main__":
    sys.exit(main())
