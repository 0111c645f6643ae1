"""refbert.special.ndtr (NumPy) against scipy.special.ndtr (C, Cephes) on a (4096, 3072) array, the size of BERT-base's
intermediate activations for 4096 tokens, in float64 and float32.

    python benchmarks/bench_special.py                  # N(0, 1) and N(0, 3) inputs, 7 repeats
    python benchmarks/bench_special.py --sd 1 --repeats 11
    python benchmarks/bench_special.py --sd 0.3 1 3 --repeats 9 --out benchmarks/results/special.md
                                                        # the README's figures

Method: the two alternate, so that drift in the machine's speed hits both alike; one warm-up call each is excluded;
the median and the minimum of the repeats are printed, one line per measurement. The results are compared before
anything is timed. The cost depends on the inputs (refbert's formulas for |x| > 1.19 cost about twice its central
one, plus the gathering of their values), so each spread is its own line. Needs scipy (the dev extra).
"""
import argparse
import statistics
import sys
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sd", type=float, nargs="+", default=[1.0, 3.0], help="standard deviations of the inputs")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", help="also write the lines, with the command and the machine, to this Markdown file")
    args = ap.parse_args()
    lines = []
    from scipy.special import ndtr as scipy_ndtr

    from refbert.special import ndtr
    r = np.random.default_rng(0)
    for sd in args.sd:
        x64 = r.standard_normal((4096, 3072)) * sd
        for x in (x64, x64.astype(np.float32)):
            ours, theirs = ndtr(x), scipy_ndtr(x)                  # warm-up, and the comparison
            assert ours.dtype == theirs.dtype == x.dtype
            ok = x > -0.6                                          # where Cephes is itself within 2 ulp
            np.testing.assert_allclose(ours[ok], theirs[ok], rtol=4 * np.finfo(x.dtype).eps, atol=0)
            times = {"refbert": [], "scipy": []}
            for _ in range(args.repeats):
                for name, f in (("refbert", ndtr), ("scipy", scipy_ndtr)):
                    t = time.perf_counter()
                    f(x)
                    times[name].append(time.perf_counter() - t)
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            low = {k: min(v) * 1e3 for k, v in times.items()}
            lines.append(f"ndtr N(0, {sd:g}) {x.dtype}: refbert {med['refbert']:.0f} ms (min {low['refbert']:.0f}), "
                         f"scipy {med['scipy']:.0f} ms (min {low['scipy']:.0f}), ratio "
                         f"{med['refbert'] / med['scipy']:.2f}x")
            print(lines[-1], flush=True)
    if args.out:
        from refbert.bench import results_header
        head = [*results_header("refbert.special.ndtr against scipy.special.ndtr, (4096, 3072) arrays",
                                " ".join(["python benchmarks/bench_special.py", *sys.argv[1:]])),
                "Method: the script's docstring (ratio: refbert's median / scipy's; < 1: refbert faster).", ""]
        with open(args.out, "w") as f:
            f.write("\n".join(head + [f"    {line}" for line in lines]) + "\n")


if __name__ == "__main__":
    main()
