"""Regenerate the sample outputs the README shows, by running their commands (tests/readme_figures.py holds every
line the README quotes from them equal to a line of these files):

    python benchmarks/readme_outputs.py [--only check trace ops exercise verify]

    benchmarks/results/check.txt               refbert check
    benchmarks/results/trace.txt               refbert trace
    benchmarks/results/check_ops_torch.txt     refbert check --ops tests/data/torch_ops.py --model
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="+", choices=["check", "trace", "ops", "exercise", "verify"])
    a = ap.parse_args()
    want = set(a.only or ["check", "trace", "ops", "exercise", "verify"])
    if "check" in want:
        run(["refbert", "check"], os.path.join(RESULTS, "check.txt"))
    if "trace" in want:
        run(["refbert", "trace"], os.path.join(RESULTS, "trace.txt"))
    if "ops" in want:
        run(["refbert", "check", "--ops", "tests/data/torch_ops.py", "--model"],
            os.path.join(RESULTS, "check_ops_torch.txt"))
    if "exercise" in want:
        exercise(os.path.join(RESULTS, "exercise_layernorm.txt"))
    if "verify" in want:
        verify(os.path.join(RESULTS, "verify_example.txt"))


if __name__ == "__main__":
    main()
