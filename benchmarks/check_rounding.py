"""Every float32 bit pattern (all 2^32) through refbert's roundings, against independent conversions.

    refbert.ops.round_bfloat16  vs ml_dtypes' float32 -> bfloat16 -> float32, bit for bit (NaN included: both give
                                the quiet NaN 0x7FC00000 with the input's sign)
    refbert.ops.round_float16   vs torch's float32 -> float16 -> float32 (c10::Half, its own code), bit for bit on
                                every non-NaN pattern; NaN stays NaN

tests/test_mixed.py checks a structured sample (every exponent, ties, subnormals, the overflow edge, NaN and inf);
this is the exhaustive version, too slow for the suite (about a minute per rounding on this project's machine).

    python benchmarks/check_rounding.py [--chunk-bits 24] [--out benchmarks/results/rounding.md]
"""
import argparse
import os
import platform
import sys
import time

import numpy as np

from refbert.ops import round_bfloat16, round_float16


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunk-bits", type=int, default=24, help="patterns per chunk: 2^N (default 24)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "rounding.md"))
    args = ap.parse_args(argv)
    import ml_dtypes
    import torch

    n = 1 << args.chunk_bits
    mismatch = {"bfloat16": [], "float16": []}
    seconds = {"bfloat16": 0.0, "float16": 0.0}
    for start in range(0, 1 << 32, n):
        u = np.arange(start, start + n, dtype=np.uint64).astype(np.uint32)
        x = u.view(np.float32)
        t0 = time.perf_counter()
        got = round_bfloat16(x).view(np.uint32)
        seconds["bfloat16"] += time.perf_counter() - t0
        want = x.astype(ml_dtypes.bfloat16).astype(np.float32).view(np.uint32)
        bad = np.flatnonzero(got != want)
        mismatch["bfloat16"] += [(int(u[i]), int(got[i]), int(want[i])) for i in bad[:5]]
        t0 = time.perf_counter()
        got = round_float16(x)
        seconds["float16"] += time.perf_counter() - t0
        want = torch.from_numpy(x.copy()).half().float().numpy()
        nan = np.isnan(want)
        bad = np.flatnonzero((got.view(np.uint32) != want.view(np.uint32)) & ~nan | (np.isnan(got) != nan))
        mismatch["float16"] += [(int(u[i]), int(got.view(np.uint32)[i]), int(want.view(np.uint32)[i]))
                                for i in bad[:5]]
        print(f"\r{(start + n) / 2 ** 32:6.1%}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    lines = ["# Every float32 bit pattern through refbert's roundings", "",
             f"`python benchmarks/check_rounding.py`; numpy {np.__version__}, ml_dtypes {ml_dtypes.__version__}, "
             f"torch {torch.__version__}, {platform.machine()}.", "",
             "| rounding | peer | patterns | mismatches | refbert's time |", "|---|---|---|---|---|"]
    for name, peer in (("bfloat16", "ml_dtypes, bit for bit"), ("float16", "torch .half(), bit for bit (NaN: NaN)")):
        lines.append(f"| round_{name} | {peer} | 2^32 | {len(mismatch[name])} | {seconds[name]:.1f} s |")
        for u, g, w in mismatch[name][:10]:
            lines.append(f"|  | 0x{u:08x}: got 0x{g:08x}, expected 0x{w:08x} | | | |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if any(mismatch.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
