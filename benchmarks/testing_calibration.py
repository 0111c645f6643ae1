"""How close refbert's own kernels come to refbert.testing's tolerance: the measurement behind its FACTOR.

Every numbered version of every Numba KernelSpec (refbert_kernels), float32 and float64, through
refbert.testing.check_op on the op's edge cases and --examples drawn shapes. For each tensor of each case:
ratio = error / max(noise, PyTorch's error, 2 ulps), the error measured against the yardsticks the tolerance is
built from (tolerance = max(FACTOR x the larger yardstick, FLOOR_ULPS)). Writes <out>/testing_calibration.md and
.json: the verdict of every (kernel, version, dtype) and the largest ratios.

    python benchmarks/testing_calibration.py [--examples 8] [--out benchmarks/results]
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from refbert import testing as T  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=8)
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"))
    args = ap.parse_args(argv)
    from refbert_kernels import backend
    t0 = time.perf_counter()
    verdicts, ratios = [], []
    for spec in backend.specs():
        for v in sorted(spec.versions):
            f, b = spec.versions[v]
            for dtype in ("float32", "float64"):
                rep = T.check_op(spec.name, f, b, dtype=dtype, examples=args.examples)
                verdicts.append(dict(kernel=spec.name, version=v, dtype=dtype, passed=rep.passed,
                                     cases=len(rep.cases)))
                for c in rep.cases:
                    for t in c.tensors:
                        if t.ulps is None:
                            continue
                        yard = max([x for x in (t.refbert, t.pytorch) if x is not None and math.isfinite(x)] + [2.0])
                        ratios.append(dict(ratio=t.ulps / yard, kernel=spec.name, version=v, dtype=dtype,
                                           case=c.label, tensor=t.tensor, ulps=t.ulps, noise=t.refbert,
                                           pytorch=t.pytorch, tolerance=t.tolerance))
                print(f"{spec.name} v{v} {dtype}: {'pass' if rep.passed else 'FAIL'}", flush=True)
    ratios.sort(key=lambda r: -r["ratio"])
    data = dict(command=" ".join(["python", "benchmarks/testing_calibration.py", *(argv or sys.argv[1:])]),
                factor=T.FACTOR, floor_ulps=T.FLOOR_ULPS, examples=args.examples, numpy=np.__version__,
                seconds=round(time.perf_counter() - t0, 1), verdicts=verdicts, largest=ratios[:20],
                checks=len(verdicts), passed=sum(v["passed"] for v in verdicts))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "testing_calibration.json"), "w") as fh:
        json.dump(data, fh, indent=1, default=str)
        fh.write("\n")
    md = ["# refbert's kernels against refbert.testing's tolerance", "",
          f"`{data['command']}`: every numbered version of every Numba KernelSpec, float32 and float64, the edge cases "
          f"and {args.examples} drawn shapes each. ratio = error / max(noise, PyTorch's error, 2 ulps); the "
          f"tolerance is max({T.FACTOR} x the larger yardstick, {T.FLOOR_ULPS} ulps).", "",
          f"**{data['passed']} of {data['checks']} (kernel, version, dtype) checks pass; the largest ratio is "
          f"{ratios[0]['ratio']:.2f}** ({ratios[0]['kernel']} v{ratios[0]['version']} {ratios[0]['dtype']}, "
          f"{ratios[0]['tensor']} on \"{ratios[0]['case']}\": {ratios[0]['ulps']:.3g} ulps).", "",
          "| ratio | kernel | dtype | case | tensor | error (ulps) | noise | pytorch | tolerance |", "|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x: "-" if x is None else f"{x:.3g}"  # noqa: E731
    md += [f"| {r['ratio']:.2f} | {r['kernel']} v{r['version']} | {r['dtype']} | {r['case']} | {r['tensor']} | "
           f"{fmt(r['ulps'])} | {fmt(r['noise'])} | {fmt(r['pytorch'])} | {fmt(r['tolerance'])} |" for r in ratios[:12]]
    with open(os.path.join(args.out, "testing_calibration.md"), "w") as fh:
        fh.write("\n".join(md) + "\n")
    print("\n".join(md[:5]))
    return 0 if data["passed"] == data["checks"] else 1


if __name__ == "__main__":
    sys.exit(main())
