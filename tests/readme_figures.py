"""Every measured figure the README quotes, and the committed results file it comes from.

A figure is a number with a unit of measure (ns, ms, s, min, us, GB/s, GFLOP/s, TFLOP/s, MiB, kB, %, x or ×, ulp,
nats, tokens/s, steps/s): "72.4 ms", "0.77×", "24.5 GB/s", "14.0–41.1 ms" (a range is two figures). The README
cites its sources in blocks:

    <!-- figures: benchmarks/results/kernels.md benchmarks/results/step.md -->
    ... prose and tables quoting measurements ...
    <!-- /figures -->

Inside a block every figure must be found in one of the cited files with the same unit, at the precision the
README quotes it (the file's 72.392 ms is the README's 72.4 ms; 72.5 ms is a mismatch). A figure right after a
bound (≥, ≤, <, >, "at most", "within", "up to", ...) is a target or a bound, not a measurement, and is not looked
up. Outside the blocks a figure must be listed in ALLOWED with the reason it is no measurement (the masking rates of
the BERT paper, say).

A command's sample output is cited the same way, and each of its lines (but "...") must be a line of the file:

    <!-- output: benchmarks/results/check.txt -->
    ```
    ... lines of what the command printed ...
    ```
    <!-- /output -->

In a results file, a number's unit is the one written right after it, or, in a Markdown table, its column header's
("fwd+bwd ms", "× floor", "% of copy"). `python tests/readme_figures.py` prints every README figure with where it
was found (or why not): the way to update the README after re-running a benchmark.
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# unit spellings -> one canonical name; "x" and "×" are the same ratio, "min" and "minutes" the same minutes
UNITS = {"ns": "ns", "ms": "ms", "s": "s", "min": "min", "minutes": "min", "us": "us", "µs": "us", "GB/s": "GB/s",
         "GFLOP/s": "GFLOP/s", "TFLOP/s": "TFLOP/s", "MiB": "MiB", "GiB": "GiB", "kB": "kB", "%": "%", "×": "×",
         "x": "×", "ulp": "ulp", "ulps": "ulp", "u": "u", "nats": "nats", "tokens/s": "tokens/s", "steps/s": "steps/s",
         "CPU-minutes": "CPU-minutes", "CPU-seconds": "CPU-seconds"}
_NUM = r"\d[\d,]*(?:\.\d+)?"
_SPACED = "|".join(sorted((re.escape(u) for u in UNITS if u not in ("x", "×", "%")), key=len, reverse=True))
# a number, optionally "–number" (a range), then its unit: ratios and percentages stick to the number ("0.77×",
# "86%"), the others follow a space or not ("72.4 ms", "5 us"); never inside a word or a shape like 4×12×512
FIGURE = re.compile(rf"(?<![\w.,/=])(?P<a>{_NUM})(?:\s?[–-]\s?(?P<b>{_NUM}))?"
                    rf"(?:(?P<tight>[×x%])|\s?(?P<unit>{_SPACED}))(?![\w/])")
BOUND = re.compile(r"(?:[≥≤<>]|at most|at least|under|over|up to|within)\s*~?\s*$")
OUTPUT = re.compile(r"<!--\s*output:\s*(?P<file>\S+)\s*-->(?P<body>.*?)<!--\s*/output\s*-->", re.S)
BLOCK = re.compile(r"<!--\s*figures:\s*(?P<files>[^>]*?)\s*-->(?P<body>.*?)<!--\s*/figures\s*-->", re.S)

# Figures outside any block: each with the reason it is no measurement (matched against the figure's line).
ALLOWED = [
    (r"15% of tokens|15% of the tokens|each 80% \[MASK\] / 10% random / 10% kept|80% \[MASK\], 10% random",
     "BERT's masking rates: the paper's specification"),
    (r"moved by a random ±1 ulp", "check_op's method: each input moved by one ulp, a parameter of the check"),
    (r"max\(8 × that, 16 ulps\)|at most 8 times refbert's own, or 16 ulps",
     "refbert.testing's tolerance rule: FACTOR 8 and FLOOR_ULPS 16 are its parameters"),
    (r"the larger of their noise, PyTorch's error\s*$|^\s*and 2 ulps \(`python benchmarks/testing_calibration.py`",
     "the calibration's yardstick: 2 ulps is the floor it measures the kernels against, a parameter"),
    (r"55\.3 kB per token per layer for BERT-base at T = 128",
     "arithmetic: (8C + 2I + H T + 4) floats of 4 bytes at C 768, I 3072, H 12, T 128 (tests/test_model.py measures "
     "a real layer's cache against the formula)"),
]


def figures(text):
    """[(line number, value text, canonical unit, line)] of every figure in `text`."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in FIGURE.finditer(line):
            if BOUND.search(line[:m.start()]):
                continue                                   # a target or a bound, not a measurement
            unit = UNITS[m.group("tight") or m.group("unit")]
            for key in ("a", "b"):
                if m.group(key):
                    out.append((n, m.group(key), unit, line))
    return out


def _value(s):
    return float(s.replace(",", ""))


def _decimals(s):
    return len(s.split(".")[1]) if "." in s else 0


def file_numbers(path):
    """{canonical unit: [numbers as written]} of a results file: a number's unit is the one written after it,
    else (in a Markdown table) its column header's."""
    found = {}
    header = None
    for line in open(path, encoding="utf-8").read().splitlines():
        cells = re.split(r"(?<!\\)\|", line.strip().strip("|")) if line.lstrip().startswith("|") else None  # "\|": a pipe in a cell
        if cells is None:
            header = None
            for m in FIGURE.finditer(line):
                for key in ("a", "b"):
                    if m.group(key):
                        found.setdefault(UNITS[m.group("tight") or m.group("unit")], []).append(m.group(key))
            continue
        if header is None:
            header = [_header_unit(c) for c in cells]
            continue
        if set(line.replace("|", "").strip()) <= set("-: "):
            continue                                       # the |---|---| row
        for i, cell in enumerate(cells):
            own = list(FIGURE.finditer(cell))
            if own:
                for m in own:
                    for key in ("a", "b"):
                        if m.group(key):
                            found.setdefault(UNITS[m.group("tight") or m.group("unit")], []).append(m.group(key))
            elif i < len(header) and header[i]:
                for s in re.findall(rf"(?<![\w.]){_NUM}(?![\w])", cell):
                    found.setdefault(header[i], []).append(s)
    return found


def _header_unit(cell):
    words = cell.replace("(", " ").replace(")", " ").split()
    for w in words:
        if w in UNITS:
            return UNITS[w]
    if "speed-up" in cell or "×" in cell:
        return "×"
    return None


def match(value, unit, numbers):
    """The first of the file's numbers in `unit` that rounds to `value` at the README's precision, or None."""
    d, v = _decimals(value), _value(value)
    for s in numbers.get(unit, []):
        f = _value(s)
        if abs(round(f, d) - v) <= 10.0 ** -d / 1e6 or (_decimals(s) <= d and f == v):
            return s
    return None


def check(readme=os.path.join(ROOT, "README.md")):
    """[(line, figure, unit, problem or None, source)] for every figure of the README."""
    text = open(readme, encoding="utf-8").read()
    rows, covered = [], []
    for b in BLOCK.finditer(text):
        first = text.count("\n", 0, b.start("body"))
        covered.append((first, text.count("\n", 0, b.end("body")) + 1))
        paths = b.group("files").split()
        numbers, missing = {}, [p for p in paths if not os.path.isfile(os.path.join(ROOT, p))]
        for p in paths:
            if p not in missing:
                for u, ns in file_numbers(os.path.join(ROOT, p)).items():
                    numbers.setdefault(u, []).extend(ns)
        for n, value, unit, line in figures(b.group("body")):
            n += first
            if missing:
                rows.append((n, value, unit, f"cites missing file(s) {', '.join(missing)}", None))
                continue
            s = match(value, unit, numbers)
            rows.append((n, value, unit, None if s else f"not in {' or '.join(paths)} (as {unit})", s))
    for b in OUTPUT.finditer(text):
        first = text.count("\n", 0, b.start("body"))
        covered.append((first, text.count("\n", 0, b.end("body")) + 1))
        path = os.path.join(ROOT, b.group("file"))
        have = set(l.rstrip() for l in open(path, encoding="utf-8").read().splitlines()) if os.path.isfile(path) else None
        for n, line in enumerate(b.group("body").splitlines(), first + 1):
            line = line.rstrip()
            if not line or line.startswith("```") or line.strip() == "...":
                continue
            if have is None:
                rows.append((n, line[:40], "output", f"cites missing file {b.group('file')}", None))
            elif line not in have:
                rows.append((n, line[:40], "output", f"line not in {b.group('file')}", None))
    for n, value, unit, line in figures(text):
        if any(a < n <= b for a, b in covered):
            continue
        reason = next((why for pat, why in ALLOWED if re.search(pat, line)), None)
        rows.append((n, value, unit, None if reason else "outside any <!-- figures: FILE --> block", reason))
    return sorted(rows)


if __name__ == "__main__":
    bad = 0
    for n, value, unit, problem, source in check(*sys.argv[1:]):
        bad += problem is not None
        print(f"README.md:{n}: {value} {unit}: " + (f"MISMATCH: {problem}" if problem else f"ok ({source})"))
    print(f"{bad} figure(s) without their results")
    sys.exit(1 if bad else 0)
