"""Run the README's demo end to end and write what it gave: benchmarks/results/demo/demo.md (the README's demo
figures come from there; tests/test_readme_figures.py holds them equal).

    python benchmarks/demo_run.py                 # everything (~1 hour on 2 cores)
    python benchmarks/demo_run.py --only main     # demo data, pretraining, classification, pair, ner, predict
    python benchmarks/demo_run.py --only qa       # the QA recipe (pretraining at 128, task-adaptive, fine-tuning)

The commands are the README's own: the ```bash blocks of its section "From raw text to a trained model" (the first
is the main demo, the second the QA recipe), run as written from --workdir (default: the repository root, so
`demo/` and `runs/` land where the README says), plus the pair and ner fine-tunings the README describes (the
classification command with its task and files swapped). Each command's wall time is measured; its output goes to
a log beside demo.md (progress bars off: TQDM_DISABLE=1); the tables are read from the runs' eval.csv files.
Needs the `train` extra (and `kernels`, for the QA recipe's --backend numba). A run folder that exists is an error
of the command itself: delete runs/ first to start over.
"""
import argparse
import csv
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "## From raw text to a trained model"


def readme_blocks(readme=os.path.join(ROOT, "README.md")):
    """The ```bash blocks of the README's demo section, each as a list of commands (continuations joined)."""
    text = open(readme, encoding="utf-8").read()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    blocks = re.findall(r"```bash\n(.*?)```", text[start:end if end > 0 else None], re.S)
    return [[c.strip() for c in b.replace("\\\n", " ").splitlines() if c.strip()] for b in blocks]


def commands(only=None):
    """[(name, command)] in the order they run."""
    main, qa = readme_blocks()[:2]
    named = []
    for c in main:
        words = shlex.split(c)
        if words[0] != "refbert":
            continue                                   # `pip install`: this script runs where refbert is installed
        name = words[1]
        if name == "finetune":
            name = "finetune-" + words[words.index("--task") + 1]
        named.append((name, c))
        if name == "finetune-classification":          # pair and ner: the same command on their own files
            for task in ("pair", "ner"):
                named.append((f"finetune-{task}", c.replace("classification", task).replace("runs/cls", f"runs/{task}")))
    qa_named = []
    for c in qa:
        words = shlex.split(c)
        out = words[words.index("--out") + 1]
        qa_named.append((f"{words[1]}-{os.path.basename(out)}", c))
    if only == "main":
        return named
    if only == "qa":
        return qa_named
    return named + qa_named


def run(cmds, workdir, logdir):
    """Run each command; {name: (seconds, output)}. Stops at the first failure."""
    env = dict(os.environ, TQDM_DISABLE="1", PYTHONUNBUFFERED="1")
    done = {}
    for name, c in cmds:
        print(f"$ {c}", flush=True)
        t = time.perf_counter()
        p = subprocess.run(c, shell=True, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
        sec = time.perf_counter() - t
        with open(os.path.join(logdir, f"{name}.log"), "w", encoding="utf-8") as f:
            f.write(f"$ {c}\n{p.stdout}\n[exit {p.returncode}, {sec:.1f} s]\n")
        print(f"  {sec:.1f} s, exit {p.returncode}", flush=True)
        if p.returncode != 0:
            sys.exit(f"{name} failed: see {os.path.join(logdir, name + '.log')}")
        done[name] = (sec, p.stdout)
    return done


def _out(c):
    """The --out folder of a command (None without one)."""
    words = shlex.split(c)
    return words[words.index("--out") + 1] if "--out" in words else None


def _csv(path):
    with open(path, encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _pct(x):
    return f"{100 * float(x):.1f}%"


def report(done, cmds, workdir, command="python benchmarks/demo_run.py"):
    """demo.md's text from the runs' files and the commands' outputs; command: how this script was run."""
    lines = ["# The README's demo, run end to end", "", "Command:", "", f"    {command}", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; Python "
             f"{platform.python_version()}; numpy {_version('numpy')}, numba {_version('numba')}, tokenizers "
             f"{_version('tokenizers')}. Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", "",
             "## Commands and wall time", "", "| step | command | wall time |", "|---|---|---|"]
    for name, c in cmds:
        if name in done:
            sec = done[name][0]
            lines.append(f"| {name} | `{c}` | {sec:.1f} s ({sec / 60:.1f} min) |")
    out = dict(done)
    for name, c in cmds:
        if not name.startswith("pretrain") or name not in out:
            continue
        folder, text = _out(c), out[name][1]
        m = re.search(r"on (\d+) sequences \((\d+) documents; (\d+) held out\).*?baseline for the MLM loss: "
                      r"([\d.]+) nats", text)
        params = re.search(r"pretraining ([\d,]+) parameters", text)
        ev = _csv(os.path.join(workdir, folder, "eval.csv"))
        log = _csv(os.path.join(workdir, folder, "log.csv"))
        tps = sorted(int(r["tokens_per_s"]) for r in log[1:])
        base = float(m.group(4))
        last = float(ev[-1]["mlm_loss"])
        lines += ["", f"## {name} ({folder})", "",
                  f"{params.group(1)} parameters; {int(m.group(1)):,} training sequences from {int(m.group(2)):,} "
                  f"documents, {m.group(3)} documents held out; {len(log):,} steps at a median of "
                  f"{tps[len(tps) // 2]:,} tokens/s ({len(log) / out[name][0]:.1f} steps/s over the whole command).",
                  "", f"Unigram baseline of the held-out MLM loss: {base:.2f} nats (perplexity {math.exp(base):.0f}). "
                  f"Final held-out MLM loss {last:.2f} nats (perplexity {math.exp(last):.0f}): "
                  f"{base - last:.2f} nats under the baseline.", "",
                  "| step | held-out MLM loss (nats) | held-out MLM accuracy | held-out NSP loss | NSP accuracy |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['step']} | {float(r['mlm_loss']):.2f} | {_pct(r['mlm_acc'])} | {float(r['nsp_loss']):.2f} | "
                  f"{_pct(r['nsp_acc'])} |" for r in ev]
    tasks = [(n[len("finetune-"):], n, _out(c)) for n, c in cmds if n.startswith("finetune-") and n in out]
    if tasks:
        lines += ["", "## Fine-tuning (best dev epoch; the best model is kept)", "",
                  "| task | dev rows | baseline | best dev | by epoch | wall time |", "|---|---|---|---|---|---|"]
        for task, name, folder in tasks:
            text = out[name][1]
            dev = re.search(r"dev (\d+) rows; baseline (\{.*\})", text)
            baseline = {k: float(v) for k, v in re.findall(r"'(\w+)': ([\d.e-]+)", dev.group(2))}
            ev = _csv(os.path.join(workdir, folder, "eval.csv"))
            keys = [k for k in ("accuracy", "exact_match", "f1", "token_accuracy") if k in ev[0]]
            metric = {"classification": "accuracy", "pair": "accuracy", "ner": "f1", "qa": "f1"}[task]
            best = max(ev, key=lambda r: float(r[metric]))
            fmt = lambda k, v: f"{float(v):.2f} {k}" if k == "f1" else f"{_pct(v)} {k.replace('_', ' ')}"  # noqa: E731
            lines.append(f"| {task} | {dev.group(1)} | {', '.join(fmt(k, v) for k, v in baseline.items())} | "
                         f"{', '.join(fmt(k, best[k]) for k in keys)} (epoch {best['epoch']}) | "
                         f"{'; '.join(', '.join(fmt(k, r[k]) for k in keys) for r in ev)} | "
                         f"{out[name][0]:.0f} s ({out[name][0] / 60:.1f} min) |")
    for name in ("predict", "fill-mask"):
        if name in out:
            lines += ["", f"## {name}", "", "```", out[name][1].strip(), "```"]
    return "\n".join(lines) + "\n"


def _version(name):
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:  # noqa: BLE001 — a missing package is reported as such
        return "not installed"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["main", "qa"])
    ap.add_argument("--workdir", default=ROOT)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "demo"))
    ap.add_argument("--report-only", action="store_true", help="rewrite demo.md from the logs and runs already there")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    cmds = commands()
    if a.report_only:
        done = {}
        for name, _ in cmds:
            path = os.path.join(a.out, f"{name}.log")
            if os.path.isfile(path):
                text = open(path, encoding="utf-8").read()
                sec = float(re.search(r"\[exit 0, ([\d.]+) s\]\s*$", text).group(1))
                done[name] = (sec, text.split("\n", 1)[1])
    else:
        done = run(commands(a.only), a.workdir, a.out)
        for name, _ in cmds:                           # the other part's earlier logs keep their figures
            path = os.path.join(a.out, f"{name}.log")
            if name not in done and os.path.isfile(path):
                text = open(path, encoding="utf-8").read()
                m = re.search(r"\[exit 0, ([\d.]+) s\]\s*$", text)
                if m:
                    done[name] = (float(m.group(1)), text.split("\n", 1)[1])
    with open(os.path.join(a.out, "demo.md"), "w", encoding="utf-8") as f:
        f.write(report(done, cmds, a.workdir, " ".join(["python benchmarks/demo_run.py", *sys.argv[1:]])))
    print(f"wrote {os.path.join(a.out, 'demo.md')}")


if __name__ == "__main__":
    main()
