"""The float32 polynomials of refbert_kernels._math, measured in ulps on dense grids: benchmarks/results/ulp.md,
where the README's figures come from. The table, the grids and the stated bounds are those of
tests/test_kernels_math.py (the test holds each measurement within its bound; this writes what it measured).

    python benchmarks/bench_ulp.py            # needs numba and scipy (the dev extra)
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def main(out=os.path.join(ROOT, "benchmarks", "results", "ulp.md")):
    import test_kernels_math as T

    from refbert.bench import results_header

    rows = []
    for label in T._measured():
        err, bound, (n, lo, hi) = T.measure(label)
        rows.append(f"| {label} | {n:,} points on [{lo:g}, {hi:g}] | {err:.2f} ulp | {bound:g} ulp | "
                    f"{'ok' if err <= bound else 'OVER'} |")
        print(rows[-1], flush=True)
    text = "\n".join([
        *results_header("The float32 polynomials of refbert_kernels._math, in ulps", "python benchmarks/bench_ulp.py"),
        "max |f(x) - exact| in units of the float32 spacing at the exact value (float64 references: NumPy's exp, "
        "scipy.special's erf, erfc, ndtr, expit), over references in the float32 normal range; grids: evenly spaced "
        "points plus +-geometric points from 1e-38 to 1 (tests/test_kernels_math.py). The stated bound is the one "
        "the test holds each function to.", "",
        "| function | grid | measured | stated bound | |", "|---|---|---|---|---|", *rows, ""])
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
