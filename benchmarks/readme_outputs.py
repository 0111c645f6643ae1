"""Regenerate the sample outputs the README shows, by running their commands (tests/readme_figures.py holds every
line the README quotes from them equal to a line of these files):

    python benchmarks/readme_outputs.py [--only check trace ops noise exercise verify]

    benchmarks/results/check.txt               refbert check
    benchmarks/results/trace.txt               refbert trace
    benchmarks/results/check_ops_torch.txt     refbert check --ops tests/data/torch_ops.py --model
    benchmarks/results/check_ops_noise.md      the two halves of that table's float32 "noise" column
                                               (refbert.testing.noise_parts) for every edge case and tensor:
                                               refbert's own float32 error and how far a 1-ulp move of the
                                               inputs moves the exact result
    benchmarks/results/exercise_layernorm.txt  refbert exercise init, the backwards solved from the oracle's but
                                               LayerNorm's without the mean's path (tests/test_exercise.py's
                                               mistake), then refbert check --ops that file --model
    benchmarks/results/verify_example.txt      the README's verify example: its HF-init snippet, `refbert dump`, its
                                               torch-dump snippet, its 1 + 1e-3 snippet, `refbert verify ckpt
                                               --against bad.safetensors`

Each file starts with the command line ("$ ..."); the output follows as the command printed it (stdout; progress
and compile messages go to stderr). Needs the dev extra (torch, transformers, numba).
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def run(cmd, out, cwd=ROOT, shown=None):
    """Run cmd (a list), write '$ <shown or cmd>' and its stdout to out; the exit status is kept in the file."""
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=dict(os.environ, TQDM_DISABLE="1"))
    with open(out, "w", encoding="utf-8") as f:
        f.write(f"$ {shown or ' '.join(cmd)}\n{p.stdout.rstrip()}\n[exit {p.returncode}]\n")
    print(f"wrote {out} (exit {p.returncode})", flush=True)
    return p


def readme_snippets():
    """The ```py blocks of the README's verify section, in order."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    start = text.index("## Verify another implementation")
    end = text.index("\n## ", start + 10)
    return re.findall(r"```py\n(.*?)```", text[start:end], re.S)


def exercise(out):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_exercise import MISTAKES, SOLVED
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["refbert", "exercise", "init", "mybert"], cwd=tmp, check=True, capture_output=True)
        ops = os.path.join(tmp, "mybert", "ops.py")
        with open(ops, "a", encoding="utf-8") as f:
            f.write(SOLVED + MISTAKES["layernorm"][2])
        run(["refbert", "check", "--ops", "mybert/ops.py", "--model"], out, cwd=tmp)


def verify(out):
    snippets = readme_snippets()
    init = next(c for c in snippets if "save_pretrained" in c)                  # the tiny model, HF's init
    bad = next(c for c in snippets if "1 + 1e-3" in c)                          # one gradient scaled
    dump = next(c for c in snippets if c not in (init, bad) and "save_file" in c)   # torch's dump on ref's batch
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-c", init], cwd=tmp, check=True, capture_output=True)
        subprocess.run(["refbert", "dump", "ckpt", "--out", "ref.safetensors"], cwd=tmp, check=True,
                       capture_output=True)
        for code in (dump, bad):
            subprocess.run([sys.executable, "-c", code], cwd=tmp, check=True, capture_output=True)
        run(["refbert", "verify", "ckpt", "--against", "bad.safetensors"], out, cwd=tmp)


def noise(out):
    """check_ops_noise.md: refbert.testing's float32 noise split into its halves (noise_parts), for every edge
    case of every op and each of its tensors."""
    from refbert import testing as T
    lines = ["# The float32 noise of `refbert check --ops`, in its two halves", "",
             "Command: `python benchmarks/readme_outputs.py --only noise` (refbert.testing.noise_parts; no timing: "
             "the same numbers on any machine with the same NumPy).", "",
             "noise = max(own, moved), in ulps of float32 at the tensor's scale (a tensor 0 in exact arithmetic at "
             "its largest sibling's): own is refbert's float32 oracle against float64 (the inputs as given and "
             f"{T.SAMPLES - 1} draws moved by a random +-1 ulp, the worst), moved the most the exact result moves "
             "under those moves (the case's conditioning). One row per edge case and tensor (the edge cases "
             "`refbert check --ops` runs, seeded as it seeds them).", "",
             "| op | edge case | tensor | own (ulps) | moved (ulps) | noise (ulps) |", "|---|---|---|---|---|---|"]
    for op in sorted(T.SPECS):
        for case in T.edge_cases(op):
            for name, (own, moved) in T.noise_parts(T.SPECS[op], case).items():
                lines.append(f"| {op} | {case.label} | {name} | {own:.3g} | {moved:.3g} | {max(own, moved):.3g} |")
    with open(out, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {out}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="+", choices=["check", "trace", "ops", "noise", "exercise", "verify"])
    a = ap.parse_args()
    want = set(a.only or ["check", "trace", "ops", "noise", "exercise", "verify"])
    if "check" in want:
        run(["refbert", "check"], os.path.join(RESULTS, "check.txt"))
    if "trace" in want:
        run(["refbert", "trace"], os.path.join(RESULTS, "trace.txt"))
    if "ops" in want:
        run(["refbert", "check", "--ops", "tests/data/torch_ops.py", "--model"],
            os.path.join(RESULTS, "check_ops_torch.txt"))
    if "noise" in want:
        noise(os.path.join(RESULTS, "check_ops_noise.md"))
    if "exercise" in want:
        exercise(os.path.join(RESULTS, "exercise_layernorm.txt"))
    if "verify" in want:
        verify(os.path.join(RESULTS, "verify_example.txt"))


if __name__ == "__main__":
    main()
