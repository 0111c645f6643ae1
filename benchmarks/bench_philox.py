"""The numpy backend's dropout mask: refbert.philox.keep_mask (Philox4x32-10 in NumPy, the masks every backend
reproduces) in nanoseconds per element, beside NumPy's own generator drawing the same number of uniforms.

    python benchmarks/bench_philox.py [--out benchmarks/results/philox.md]

Method: a (4, 12, 512, 512) mask (12.6M elements: one attention-probability dropout of BERT at B=4 T=512) and a
(4096, 768) one (a hidden-state dropout at 4096 tokens), p = 0.1; keep_mask and
`np.random.default_rng(0).random(shape, dtype=np.float32) >= p` alternate, one warm-up call each, 9 repeats, the
median; ns per element = median seconds / elements * 1e9. Issue 16's target: at most 3 ns an element.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "philox.md"))
    ap.add_argument("--repeats", type=int, default=9)
    a = ap.parse_args()
    from refbert.bench import results_header
    from refbert.philox import keep_mask
    lines = [*results_header("Dropout masks in NumPy: Philox4x32-10 (refbert.philox.keep_mask) against "
                             "np.random.Generator", " ".join(["python benchmarks/bench_philox.py", *sys.argv[1:]])),
             "Method: the script's docstring.", "",
             "| shape | elements | keep_mask ms | keep_mask ns / element | Generator ms | Generator ns / element |",
             "|---|---|---|---|---|---|"]
    for shape in ((4, 12, 512, 512), (4096, 768)):
        n = int(np.prod(shape))
        gen = np.random.default_rng(0)
        runs = {"philox": lambda: keep_mask(1234, 7, shape, 0.1),
                "generator": lambda: gen.random(shape, dtype=np.float32) >= 0.1}
        times = {k: [] for k in runs}
        for r in range(a.repeats + 1):
            for k, f in runs.items():
                t = time.perf_counter()
                f()
                if r:
                    times[k].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        lines.append(f"| {'×'.join(map(str, shape))} | {n:,} | {med['philox'] * 1e3:.1f} | "
                     f"{med['philox'] / n * 1e9:.2f} | {med['generator'] * 1e3:.1f} | "
                     f"{med['generator'] / n * 1e9:.2f} |")
        print(lines[-1], flush=True)
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
