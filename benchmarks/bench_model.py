"""One pretraining step (forward + backward of BertForPreTraining, MLM + NSP loss) of refbert against HF
transformers + PyTorch on the CPU (eager attention), on the same weights and the same batch, next to the step's
GEMM floor: `refbert bench --only step` (refbert/bench.py has the method), which writes
benchmarks/results/step.{md,json,png}.

    python benchmarks/bench_model.py                 # mini (L4 H256 A4, B8 T128) and base (L12 H768 A12, B4 T128)
    python benchmarks/bench_model.py --sizes mini --repeats 5
    python benchmarks/bench_model.py --quick         # tooling check -> benchmarks/results/quick/

Method: refbert's numpy and numba backends (MLM decoder on all rows as HF, and on the labelled rows only) and HF +
PyTorch, in eval mode with dropout 0 on both (the losses must agree to 1e-4 before anything is timed) and in train
mode with dropout 0.1 on both; float32, 15% of positions carry MLM labels. Warm-up steps are excluded; the runs
alternate so that drift in the machine's speed hits all alike; the median of the repeats is reported. Peak memory
is measured in a fresh subprocess per framework (growth of the resident-set high-water mark over one eval step).
--json PATH also appends one line per size (eval, refbert numpy vs torch), as this script did before.
Needs the dev extra (torch, transformers).
"""
import argparse
import json
import os
import sys

from refbert import bench


def main():
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--json")
    known, rest = ap.parse_known_args()
    rc = bench.main(argv=["--only", "step", *rest])
    if known.json:
        out = next((rest[i + 1] for i, a in enumerate(rest[:-1]) if a == "--out"), None) or \
            os.path.join(bench.DEFAULT_OUT, "quick" if "--quick" in rest else "")
        with open(os.path.join(out, "step.json")) as f:
            data = json.load(f)
        with open(known.json, "a") as f:
            for r in data["results"]:
                if r["mode"] != "eval":
                    continue
                ms = {x["run"]: x["ms"] for x in r["rows"]}
                f.write(json.dumps(dict(size=r["size"], B=r["B"], T=r["T"], repeats=r["repeats"],
                                        seconds=dict(refbert=ms.get("refbert numpy (all)", 0) / 1e3,
                                                     torch=ms.get("HF + PyTorch", 0) / 1e3),
                                        peak_mib=r.get("peak_mib_eval"), numpy=data["machine"]["numpy"],
                                        torch=data["machine"]["torch"])) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
