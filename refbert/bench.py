"""`refbert bench`: validate, then time, refbert's kernels and its pretraining step against their peers.

    refbert bench                         kernels, step (mini and base), attention memory -> benchmarks/results/
    refbert bench --quick                 a tooling check: tiny repeats and shapes, mini only -> .../results/quick/
    refbert bench --only kernels|step|memory [--out DIR] [--sizes mini base] [--repeats N] [--kernels NAME ...]
(`python benchmarks/bench_kernels.py` and `python benchmarks/bench_model.py` are the same with --only set.)

Three sections, each written as <name>.md, <name>.json and <name>.png under --out, the machine and the command line
in the header (STYLE.md §6: warm-up excluded, medians, napkin byte/FLOP counts, % of a bandwidth probe measured in
the same run, the peers on the same inputs in the same run, a results file):

kernels  Every KernelSpec of refbert_kernels (kernels/_harness.py). Each numbered version is first validated against
         its oracle in refbert.ops on the spec's small irregular shapes in float64 and float32 (max err/tol and max
         |diff| are reported; a version above 1 is FAIL and is never timed); then, at the spec's bench_shape in
         float32, the NumPy oracle, the PyTorch CPU peer and every passing version run on the same inputs:
         forward + backward and forward alone, median of repeats after a warm-up call (Numba's JIT excluded),
         in rounds that alternate the implementations; GB/s from spec.nbytes, % of np.copyto's bandwidth measured
         once in this run, GFLOP/s from spec.flops, speed-up vs numpy and vs torch. And each kernel file's
         first-call compile time: a fresh process with an empty NUMBA_CACHE_DIR imports it and calls every version
         once on a tiny float32 shape, then a second process does the same on the now warm cache.
step     One pretraining step (BertForPreTraining forward + backward, MLM + NSP loss) of refbert (numpy and numba
         backends, mlm_decode "all" = HF's and "labelled") against HF transformers + PyTorch CPU (eager attention),
         same weights (an HF model with random weights saved to a temp dir, refbert loaded from it) and batch, in
         eval (dropout 0 on both) and train (dropout 0.1 on both) mode. The losses are compared before any timing.
         The GEMM floor is the same step's matrix products alone (gemm_products) on preallocated float32 arrays,
         timed in the same alternation: each step is reported as ms, x the floor and x PyTorch.
memory   Peak memory of attention forward + backward (B=1, H=12, hs=64, float32) at growing T, the oracle
         (refbert.ops) vs the fused kernel (refbert_kernels.attention), one fresh process per point: tracemalloc's
         peak (NumPy's allocations are traced; Numba's NRT allocations are not) and the growth of the resident-set
         high-water mark (VmHWM, which sees everything).

Every timed section also records the share of the machine's CPU time that other processes used while it ran
(/proc; `Interference`) and is marked unreliable above 10%: on a shared 2-core machine that, not the code, decides
the numbers (a --quick run once timed the same GEMM floor at 963 ms in one section and 40 ms in the next). The step
section also flags a GEMM floor whose eval and train times differ by more than 1.3x: the same work, so only the
machine can have changed.

The exit status is 1 when a kernel version or a step check failed validation (after writing every file), else 0.
"""
import argparse
import contextlib
import importlib
import io
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata

import numpy as np

DEFAULT_OUT = os.path.join("benchmarks", "results")
SIZES = {"mini": dict(preset="mini", B=8, T=128), "base": dict(preset="base", B=4, T=128)}
QUICK_BATCH = dict(B=2, T=64)        # --quick: the step's batch, whatever the size
MEMORY_T = (512, 1024, 2048, 4096)
# a pause before each timed run of another implementation: OpenBLAS, OpenMP (torch) and Numba worker threads
# spin-wait for a while after their last task, and would take cores from the next framework's threads
SETTLE_S = 0.2
MEMORY_LIMIT = 8 * 2 ** 30           # skip a memory point whose estimated peak exceeds this (or 60% of free RAM)


def add_arguments(p):
    """The options of `refbert bench` (refbert/cli.py) and of the two scripts in benchmarks/."""
    from .argtypes import positive
    p.add_argument("--quick", action="store_true",
                   help="tooling check: few repeats, small bench shapes, step: mini at B2 T64, memory: T 128 256 "
                        "(the numbers are noise)")
    p.add_argument("--only", nargs="+", choices=["kernels", "step", "memory", "precision", "mixed", "profile"],
                   help="run only these sections (precision: with --device cuda, the reduced-precision study; "
                        "mixed, profile: --device cuda only, the mixed-precision step and the torch.profiler table)")
    p.add_argument("--out", help=f"results folder (default {DEFAULT_OUT}, or {DEFAULT_OUT}/quick with --quick)")
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), help="step sizes (default mini base; --quick: mini)")
    p.add_argument("--repeats", type=positive, help="timed repeats per measurement (default 10 kernels, 7 step)")
    p.add_argument("--kernels", nargs="+", metavar="NAME", help="only the KernelSpecs with these names")
    p.add_argument("--memory-T", nargs="+", type=positive, help=f"sequence lengths of the memory section "
                                                           f"(default {' '.join(map(str, MEMORY_T))})")
    p.add_argument("--no-compile", action="store_true", help="skip the kernels' compile-time measurement")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: the CUDA kernels and the step on a GPU against PyTorch there (refbert/bench_cuda.py, "
                        "dispatched by refbert/cli.py)")
    p.add_argument("--attention-T", nargs="+", type=positive, help="--device cuda: attention sequence lengths")
    p.add_argument("--step-T", nargs="+", type=positive, help="--device cuda: pretraining-step sequence lengths at B=4")
    p.add_argument("--no-torch", action="store_true", help="--device cuda: skip the PyTorch peers")
    p.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default="no",
                   help="the step section in mixed precision: refbert's models with precision bf16-mixed / "
                        "fp16-mixed (the spec, on the CPU), HF + PyTorch under torch.autocast('cpu', bfloat16 / "
                        "float16); no: float32 (default)")
    p.add_argument("--validate-dtypes", nargs="+", default=["float32", "float16"],
                   choices=["float64", "float32", "float16", "bfloat16"],
                   help="--device cuda: dtypes each version is validated in")
    return p


# ----------------------------------------------------------------------------------------------------------------
# the machine, progress, output files

def _version(dist):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _blas():
    """BLAS that NumPy links, and its threads: threadpoolctl when installed, else numpy.show_config's build info."""
    try:
        import threadpoolctl
        libs = [i for i in threadpoolctl.threadpool_info() if i.get("user_api") == "blas"]
        if libs:
            return ", ".join(f"{i.get('internal_api')} {i.get('version')} ({i.get('num_threads')} threads)"
                             for i in libs)
    except ImportError:
        pass
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            cfg = np.show_config(mode="dicts")
        b = cfg["Build Dependencies"]["blas"]
        return f"{b.get('name')} {b.get('version', '')}".strip()
    except Exception as e:                                  # older NumPy: no dicts mode
        return f"unknown ({type(e).__name__})"


def _meminfo(field):
    """/proc/meminfo field in bytes, or None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return None


def machine():
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    mem = _meminfo("MemTotal")
    return dict(cpu=cpu, cores=os.cpu_count(), usable_cores=usable,
                memory_gib=round(mem / 2 ** 30, 1) if mem else None, python=platform.python_version(),
                numpy=np.__version__, numba=_version("numba"), torch=_version("torch"),
                transformers=_version("transformers"), scipy=_version("scipy"), blas=_blas(),
                numba_threads=os.environ.get("NUMBA_NUM_THREADS", "default (all cores)"))


class _Progress:
    """tqdm when installed (an optional import), else silent; lines go through write() either way."""

    def __init__(self, total, desc):
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, leave=False, file=sys.stderr, dynamic_ncols=True,
                            disable=None)            # None: no bar when stderr is not a terminal
        except ImportError:
            self.bar = None

    def step(self, n=1, what=None):
        if self.bar is not None:
            if what:
                self.bar.set_postfix_str(what, refresh=False)
            self.bar.update(n)

    def write(self, line):
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _cpu_ticks():
    """(ticks the whole machine spent busy or stolen, ticks this process ran), from /proc/stat's cpu line (user,
    nice, system, idle, iowait, irq, softirq, steal; the total of all 8 is cores x elapsed) and /proc/self/stat
    (utime, stime: every thread of this process). None off Linux."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()          # after the command name: fields 3, 4, ... of proc(5)
        return sum(v), sum(v) - v[3] - v[4], int(own[11]) + int(own[12])
    except (OSError, ValueError, IndexError):
        return None


class Interference:
    """`with Interference() as load:` around a timed section; then load.share is the fraction of the machine's CPU
    time (all cores) that other processes used (or the hypervisor stole) meanwhile: ~0 on a quiet machine. A timing
    is only as good as that: BLAS's threads wait for each other, so one descheduled thread stalls a GEMM, and on
    this project's shared 2-core machine the --quick step's GEMM floor (B2 T64 mini) took 963 ms in one section and
    40 ms in the next, and 5.2 s while other jobs kept the load average at ~15. None off Linux."""
    BUSY = 0.10                 # above this share, a section's times are flagged as measured on a busy machine

    def __enter__(self):
        self.start, self.share = _cpu_ticks(), None
        return self

    def __exit__(self, *exc):
        end = _cpu_ticks()
        if self.start and end and end[0] > self.start[0]:
            total, busy, own = (b - a for a, b in zip(self.start, end))
            self.share = max(0.0, (busy - own) / total)
        return False

    @property
    def busy(self):
        return self.share is not None and self.share > self.BUSY


def _busy_note(share):
    """The line a results file shows under a timed section."""
    if share is None:
        return "Other processes' CPU use while timed: unknown (no /proc)."
    if share > Interference.BUSY:
        return (f"**Unreliable: other processes used {100 * share:.0f}% of the machine's CPU time while these were "
                f"timed** (above {100 * Interference.BUSY:.0f}%); rerun on a quiet machine.")
    return f"Other processes used {100 * share:.0f}% of the machine's CPU time while these were timed (quiet)."


def results_header(title, command, info=None, quick=False):
    """The head of every results file: title, the command that wrote it, the machine (machine(), or info) and the
    date. -> [lines]"""
    info = machine() if info is None else info
    lines = [f"# {title}", "", "Command:", "", f"    {command}", "",
             f"Machine: {info['cpu']}, {info['cores']} cores ({info['usable_cores']} usable), "
             f"{info['memory_gib']} GiB; Python {info['python']}, numpy {info['numpy']} (BLAS: {info['blas']}), "
             f"numba {info['numba']} (threads: {info['numba_threads']}), torch {info['torch']}, "
             f"transformers {info['transformers']}, scipy {info['scipy']}. "
             f"Date: {time.strftime('%Y-%m-%d %H:%M %Z')}.", ""]
    if quick:
        lines += ["**--quick: tooling check with tiny repeats and shapes; the numbers are noise, not results.**", ""]
    return lines


def _write(out, name, title, info, command, quick, md_lines, data, plot=None):
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, f"{name}.md"), os.path.join(out, f"{name}.json")]
    with open(paths[0], "w") as f:
        f.write("\n".join(results_header(title, command, info, quick) + md_lines) + "\n")
    with open(paths[1], "w") as f:
        json.dump(dict(command=command, machine=info, quick=quick, **data), f, indent=1, default=_json_default)
        f.write("\n")
    if plot is not None:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:                             # an optional dependency: say what is missing
            print(f"{name}.png not written: {e.name or 'matplotlib'} is not installed (pip install matplotlib; "
                  f"--no-plot asks for no PNG)", flush=True)
            return paths
        fig = plot(plt)
        if fig is not None:
            paths.append(os.path.join(out, f"{name}.png"))
            fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
            plt.close(fig)
    return paths


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, type):
        return o.__name__
    return str(o)


def _fmt(x, spec=".3g", none="—"):
    return none if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _table(head, rows):
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


# ----------------------------------------------------------------------------------------------------------------
# kernels: discover, validate, time, compile time

def discover_specs():
    """Every KernelSpec: each kernel file scanned for KernelSpec objects (a file may define several), plus any
    that refbert_kernels.backend.specs() lists beyond them; a file that fails to import (missing, broken, no
    numba) is reported, not fatal. -> ([(module name, attribute, spec)], [(module name, error)])"""
    import pkgutil
    try:
        import refbert_kernels
        from refbert_kernels._harness import KernelSpec
    except ImportError as e:
        return [], [("refbert_kernels", f"{type(e).__name__}: {e}")]
    found, errors = {}, []
    for m in sorted(pkgutil.iter_modules(refbert_kernels.__path__), key=lambda m: m.name):
        if m.name.startswith("_") or m.name == "backend" or m.ispkg:
            continue
        name = f"refbert_kernels.{m.name}"
        try:
            mod = importlib.import_module(name)
        except Exception as e:
            errors.append((name, f"{type(e).__name__}: {e}"))
            continue
        for attr, v in vars(mod).items():
            if isinstance(v, KernelSpec) and id(v) not in found and attr != "SPEC":
                found[id(v)] = (name, attr, v)
        if isinstance(getattr(mod, "SPEC", None), KernelSpec):   # an alias (gelu: SPEC = SPEC_BIAS_GELU) keeps
            found.setdefault(id(mod.SPEC), (name, "SPEC", mod.SPEC))   # its own name
    try:
        from refbert_kernels import backend
        for s in backend.specs():
            found.setdefault(id(s), (_spec_module(s), "?", s))
    except Exception as e:                                  # a kernel file it imports is missing or broken
        errors.append(("refbert_kernels.backend", f"{type(e).__name__}: {e}"))
    return sorted(found.values(), key=lambda x: (x[0], x[2].name, x[1])), errors


def _spec_module(spec):
    """The module of a spec's versions (the kernel file), imported again by the compile-time subprocess."""
    return spec.versions[min(spec.versions)][0].__module__ if spec.versions else None


def shrink_shape(shape, t_max, elems):
    """A smaller shape dict of the same kind (same dtypes, ranks and options, so the same compiled signatures):
    B (and N, rows) -> 1 or as few as fit, T capped at t_max, a "shape" tuple cut to about `elems` elements."""
    s = dict(shape)
    for key in ("B",):
        if isinstance(s.get(key), int):
            s[key] = 1
    if isinstance(s.get("T"), int):
        s["T"] = min(s["T"], t_max)
    for key in ("N", "rows", "n"):
        if isinstance(s.get(key), int):
            s[key] = min(s[key], t_max)
    if isinstance(s.get("lead"), tuple) and math.prod(s["lead"]) > t_max:   # leading (row) dims of a (..., C) input
        s["lead"] = (t_max,)
    if isinstance(s.get("shape"), tuple):
        dims = list(s["shape"])
        for i in range(len(dims)):
            total = math.prod(dims)
            if total <= elems:
                break
            dims[i] = max(1, math.ceil(dims[i] * elems / total))
        s["shape"] = tuple(dims)
    return s


def unknown_kernels(asked, known, errors=()):
    """--kernels NAME...: a name that no kernel file defines is a ValueError naming it and the choices (a typo
    would otherwise time nothing and write an empty table), unless a file failed to import (the name may be
    its: the run reports that file's error instead)."""
    bad = sorted(set(asked) - set(known))
    if bad and not errors:
        raise ValueError(f"bench: argument --kernels expected names among {', '.join(sorted(set(known)))}, got "
                         f"{', '.join(map(repr, bad))}")


def bench_shape(spec, quick):
    return shrink_shape(spec.bench_shape, 128, 2 ** 18) if quick else spec.bench_shape


def tiny_shape(spec):
    return shrink_shape(spec.bench_shape, 8, 512)


def validate_version(spec, v):
    """Every small shape, float64 then float32: worst err/tol, max |diff| per dtype; PASS iff every ratio <= 1."""
    from refbert_kernels._harness import validate
    r = dict(version=v, note=spec.notes.get(v, ""), status="PASS", err_tol={}, max_abs={}, error=None, log="")
    log = io.StringIO()
    for dtype in (np.float64, np.float32):
        worst = diff = 0.0
        for shape in spec.shapes:
            try:
                with contextlib.redirect_stdout(log):        # compare() prints the first offending entries
                    w, d = validate(spec, v, dtype, shape)
            except Exception as e:
                r["status"], r["error"] = "FAIL", f"{np.dtype(dtype).name} {shape}: {type(e).__name__}: {e}"
                worst = math.inf
                break
            worst, diff = max(worst, w), max(diff, d)
        r["err_tol"][np.dtype(dtype).name], r["max_abs"][np.dtype(dtype).name] = worst, diff
        if not worst <= 1:                                   # NaN fails too
            r["status"] = "FAIL"
    r["log"] = "\n".join(log.getvalue().splitlines()[:8])
    return r


def time_spec(spec, shape, versions, repeats, rounds, min_time, bw, bar, settle=SETTLE_S):
    """The oracle, the torch peer and each version on the same float32 inputs: forward + backward and forward
    alone, each the median over `rounds` of time_call's median (rounds alternate the implementations)."""
    from refbert_kernels._harness import _fresh, fwd_bwd, time_call
    inputs, kwargs = spec.make_inputs(shape, np.float32, 0)
    impls, notes = [("numpy", spec.oracle)], []
    if spec.torch_peer is not None:
        try:
            impls.append(("torch", spec.torch_peer(inputs, kwargs)))
        except ImportError as e:
            notes.append(f"torch peer skipped: {e}")
    impls += [(f"v{v}", spec.versions[v]) for v in versions]
    calls = {}
    for label, impl in impls:
        if callable(impl):                                   # the torch peer: a forward + backward callable
            calls[label] = (impl, None)
        else:
            fwd = impl[0]
            calls[label] = (fwd_bwd(*impl, inputs, kwargs), lambda fwd=fwd: fwd(**inputs, **_fresh(kwargs)))
    samples = {label: ([], []) for label in calls}
    for _ in range(rounds):
        for label, (fb, f) in calls.items():
            time.sleep(settle)
            samples[label][0].append(time_call(fb, repeats, min_time))
            if f is not None:
                samples[label][1].append(time_call(f, repeats, min_time))
            bar.step(what=f"{spec.name} {label}")
    nbytes = spec.nbytes(inputs, kwargs) if spec.nbytes else None
    flops = spec.flops(inputs, kwargs) if spec.flops else None
    t = {label: statistics.median(s[0]) for label, s in samples.items()}
    rows = []
    for label, (fb_s, f_s) in samples.items():
        tfb = t[label]
        rows.append(dict(impl=label, fwd_bwd_s=tfb, fwd_s=statistics.median(f_s) if f_s else None,
                         rounds_fwd_bwd_s=fb_s, GBps=nbytes / tfb / 1e9 if nbytes else None,
                         pct_copy=100 * nbytes / tfb / bw if nbytes else None,
                         GFLOPs=flops / tfb / 1e9 if flops else None,
                         speedup_vs_numpy=t["numpy"] / tfb,
                         speedup_vs_torch=t["torch"] / tfb if "torch" in t else None))
    return dict(shape=shape, nbytes=nbytes, flops=flops, rows=rows, notes=notes)


_COMPILE_CODE = r"""
import importlib, json, sys, time
import numpy as np
t0 = time.perf_counter()
mod = importlib.import_module(sys.argv[1])
out = {"import_s": time.perf_counter() - t0, "calls": {}}
from refbert_kernels._harness import KernelSpec, run_pair
from refbert.bench import tiny_shape
specs = {id(v): v for v in vars(mod).values() if isinstance(v, KernelSpec)}
seen = set()
for spec in specs.values():
    inputs, kwargs = spec.make_inputs(tiny_shape(spec), np.float32, 0)
    for v in sorted(spec.versions):
        if spec.versions[v] in seen:    # a spec copied with another bench shape: its versions are compiled
            continue
        seen.add(spec.versions[v])
        t = time.perf_counter()
        try:
            run_pair(*spec.versions[v], inputs, kwargs)
            out["calls"][f"{spec.name} v{v}"] = time.perf_counter() - t
        except Exception as e:
            out["calls"][f"{spec.name} v{v}"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def compile_times(module, timeout=600):
    """First import + one forward/backward call of every version on a tiny float32 shape, in a fresh process with
    an empty NUMBA_CACHE_DIR (cold: everything compiles), then again in a second process on that cache (warm)."""
    res = {}
    with tempfile.TemporaryDirectory(prefix="refbert-numba-cache-") as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        for which in ("cold", "warm"):
            t = time.perf_counter()
            p = subprocess.run([sys.executable, "-c", _COMPILE_CODE, module], capture_output=True, text=True,
                               env=env, timeout=timeout)
            wall = time.perf_counter() - t
            if p.returncode != 0:
                res[which] = dict(error=(p.stderr.strip().splitlines() or ["?"])[-1], process_s=wall)
                continue
            r = json.loads(p.stdout.strip().splitlines()[-1])
            r["process_s"] = wall
            r["total_s"] = r["import_s"] + sum(v for v in r["calls"].values() if isinstance(v, float))
            res[which] = r
    return res


def run_kernels(args, info, command):
    quick = args.quick
    repeats = args.repeats or (2 if quick else 10)
    rounds, min_time, settle = (1, 0.0, 0.0) if quick else (3, 0.2, SETTLE_S)
    specs, errors = discover_specs()
    if args.kernels:
        unknown_kernels(args.kernels, [x[2].name for x in specs], errors)
        specs = [x for x in specs if x[2].name in args.kernels]
    names = [s.name for _, _, s in specs]
    from refbert_kernels._harness import copy_bandwidth
    bar = _Progress(sum(len(s.versions) + rounds * (2 + len(s.versions)) for _, _, s in specs) + 1, "kernels")
    bw = copy_bandwidth(nbytes=(32 if quick else 256) * 2 ** 20, repeats=3 if quick else 10)
    bar.step(what="copy bandwidth")
    bar.write(f"copy bandwidth (np.copyto, read + write): {bw / 1e9:.2f} GB/s")
    for m, e in errors:
        bar.write(f"unavailable: {m}: {e}")
    results, failed, validated = [], False, {}
    for module, attr, spec in specs:
        label = spec.name if names.count(spec.name) == 1 else f"{spec.name} [{attr}]"
        entry = dict(name=label, spec=spec.name, module=module, attribute=attr,
                     oracle=f"refbert.ops.{spec.oracle[0].__name__}", validation=[], timing=None)
        for v in sorted(spec.versions):
            key = (spec.oracle, spec.versions[v], repr(spec.shapes), repr(spec.tol))
            if key not in validated:                     # a spec copied with another bench shape: validated once
                validated[key] = validate_version(spec, v)
            r = validated[key]
            entry["validation"].append(r)
            failed |= r["status"] != "PASS"
            bar.step(what=f"{spec.name} v{v} validate")
            bar.write(f"{label:18s} v{v} validate  float64 err/tol {_fmt(r['err_tol'].get('float64'))}  "
                      f"float32 err/tol {_fmt(r['err_tol'].get('float32'))}  {r['status']}"
                      + (f"  ({r['error']})" if r["error"] else ""))
        ok = [r["version"] for r in entry["validation"] if r["status"] == "PASS"]
        shape = bench_shape(spec, quick)
        try:
            with Interference() as load:
                try:
                    entry["timing"] = time_spec(spec, shape, ok, repeats, rounds, min_time, bw, bar, settle)
                except Exception:
                    if shape == spec.bench_shape:
                        raise
                    shape = spec.shapes[-1]                  # a shrunk shape the spec rejects: its last small one
                    entry["timing"] = time_spec(spec, shape, ok, repeats, rounds, min_time, bw, bar, settle)
            entry["timing"]["others_cpu_share"] = load.share
            if load.busy:
                bar.write(f"{label}: {_busy_note(load.share).replace('**', '')}")
        except Exception as e:
            entry["timing"] = dict(shape=shape, error=f"{type(e).__name__}: {e}", rows=[])
            bar.write(f"{label}: timing failed: {entry['timing']['error']}")
        for row in entry["timing"]["rows"]:
            bar.write(f"{label:18s} {row['impl']:6s} {row['fwd_bwd_s'] * 1e3:9.3f} ms fwd+bwd  "
                      f"{_fmt(row['GBps'], '7.2f')} GB/s ({_fmt(row['pct_copy'], '5.1f')}% of copy)  "
                      f"{_fmt(row['GFLOPs'], '7.1f')} GFLOP/s  {row['speedup_vs_numpy']:6.2f}x numpy  "
                      f"{_fmt(row['speedup_vs_torch'], '6.2f')}x torch")
        results.append(entry)
    compile_res = {}
    if not args.no_compile:
        for module in dict.fromkeys(m for m, _, _ in specs if m):
            bar.write(f"compile time of {module} (two fresh processes)...")
            try:
                compile_res[module] = compile_times(module)
            except subprocess.TimeoutExpired:
                compile_res[module] = dict(cold=dict(error="timeout"), warm=dict(error="timeout"))
            c = compile_res[module]
            bar.write(f"  cold {_fmt(c['cold'].get('total_s'), '.2f')} s, "
                      f"warm {_fmt(c['warm'].get('total_s'), '.2f')} s")
    bar.close()
    data = dict(copy_bandwidth_Bps=bw, repeats=repeats, rounds=rounds, kernels=results, compile=compile_res,
                unavailable=[dict(module=m, error=e) for m, e in errors])
    paths = _write(args.out, "kernels", "Kernels: validated against refbert.ops, then timed (CPU, float32)", info,
                   command, quick, _kernels_md(data), data,
                   None if args.no_plot else lambda plt: _kernels_png(plt, data))
    return paths, failed


def _kernels_md(d):
    L = [f"Copy bandwidth (np.copyto on a buffer larger than the caches, read + write), measured in this run: "
         f"**{d['copy_bandwidth_Bps'] / 1e9:.2f} GB/s**. Timings: float32, forward + backward (and forward alone), "
         f"median over {d['rounds']} alternating round(s) of the median of >= {d['repeats']} calls after a warm-up "
         f"call (JIT compilation excluded). Speed-up = the peer's time / this time (> 1: faster). GB/s and GFLOP/s "
         f"are of forward + backward, from each spec's napkin counts (nbytes, flops in its kernel file).", ""]
    if d["unavailable"]:
        L += ["Import errors (every kernel file that imports was scanned for its KernelSpecs all the same):", ""]
        L += [f"- `{u['module']}`: {u['error']}" for u in d["unavailable"]]
        L += [""]
    for k in d["kernels"]:
        t = k["timing"]
        L += [f"## {k['name']}", "", f"Oracle `{k['oracle']}`; kernel file `{k['module']}`.", "",
              "Validation (every small shape of the spec; err/tol <= 1 passes):", ""]
        L += _table(["version", "float64 err/tol", "float64 max abs diff", "float32 err/tol", "float32 max abs diff",
                     "result", "idea"],
                    [[f"v{r['version']}", _fmt(r["err_tol"].get("float64")), _fmt(r["max_abs"].get("float64")),
                      _fmt(r["err_tol"].get("float32")), _fmt(r["max_abs"].get("float32")),
                      r["status"] if not r["error"] else f"{r['status']}: {r['error'][:120]}", r["note"]]
                     for r in k["validation"]])
        for r in k["validation"]:
            if r["status"] != "PASS" and r["log"]:
                L += ["", f"v{r['version']} mismatch (first entries):", "", "```", r["log"], "```"]
        L += ["", f"Timing at {t['shape']} (float32"
              + (f", {t['nbytes'] / 2 ** 20:.1f} MiB moved" if t.get("nbytes") else "")
              + (f", {t['flops'] / 1e9:.2f} GFLOP" if t.get("flops") else "") + "):", ""]
        if t.get("error"):
            L += [f"timing failed: {t['error']}"]
        L += _table(["impl", "fwd+bwd ms", "fwd ms", "GB/s", "% of copy", "GFLOP/s", "speed-up vs numpy",
                     "speed-up vs torch"],
                    [[r["impl"], _fmt(r["fwd_bwd_s"] * 1e3, ".3f"), _fmt(r["fwd_s"] and r["fwd_s"] * 1e3, ".3f"),
                      _fmt(r["GBps"], ".2f"), _fmt(r["pct_copy"], ".1f"), _fmt(r["GFLOPs"], ".1f"),
                      _fmt(r["speedup_vs_numpy"], ".2f") + "×", _fmt(r["speedup_vs_torch"], ".2f") + "×"]
                     for r in t["rows"]])
        if t["rows"]:
            L += ["", _busy_note(t.get("others_cpu_share"))]
        failed = [f"v{r['version']}" for r in k["validation"] if r["status"] != "PASS"]
        if failed:
            L += ["", f"Not timed (failed validation): {', '.join(failed)}."]
        L += [""] + [f"Note: {n}" for n in t.get("notes", [])]
    if d["compile"]:
        L += ["## First-call compile time", "",
              "Per kernel file: import + one forward/backward call of each version on a tiny float32 shape, in a "
              "fresh process with an empty NUMBA_CACHE_DIR (cold), then in a second fresh process on that cache "
              "(warm). Calls run in order, so a helper compiled by an earlier version is not counted again; "
              "process = the whole subprocess, interpreter start included.", ""]
        rows = []
        for module, c in d["compile"].items():
            names = list(dict.fromkeys([*c["cold"].get("calls", {}), *c["warm"].get("calls", {})]))
            sec = lambda w, n: (lambda x: _fmt(x, ".2f") if isinstance(x, float) else (x or "—"))(  # noqa: E731
                c[w].get("calls", {}).get(n))
            rows.append([f"`{module}`", "import", _fmt(c["cold"].get("import_s"), ".2f"),
                         _fmt(c["warm"].get("import_s"), ".2f")])
            rows += [["", n, sec("cold", n), sec("warm", n)] for n in names]
            rows.append(["", "**total** (process)",
                         f"{_fmt(c['cold'].get('total_s'), '.2f')} ({_fmt(c['cold'].get('process_s'), '.2f')})"
                         + (f" {c['cold']['error']}" if "error" in c["cold"] else ""),
                         f"{_fmt(c['warm'].get('total_s'), '.2f')} ({_fmt(c['warm'].get('process_s'), '.2f')})"
                         + (f" {c['warm']['error']}" if "error" in c["warm"] else "")])
        L += _table(["file", "step", "cold s", "warm s"], rows)
    return L


def _kernels_png(plt, d):
    ks = [k for k in d["kernels"] if k["timing"] and k["timing"]["rows"]]
    if not ks:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(ks) + 4), 4.5))
    for ax, key, title in ((axes[0], "speedup_vs_numpy", "speed-up vs NumPy oracle"),
                           (axes[1], "speedup_vs_torch", "speed-up vs PyTorch CPU")):
        labels = sorted({r["impl"] for k in ks for r in k["timing"]["rows"]} - {"numpy", "torch"},
                        key=lambda s: int(s[1:]) if s[1:].isdigit() else 0)
        w = 0.8 / max(1, len(labels))
        for i, lab in enumerate(labels):
            ys = [next((r[key] for r in k["timing"]["rows"] if r["impl"] == lab), None) for k in ks]
            ax.bar([j + i * w for j in range(len(ks))], [y if y else 0 for y in ys], w, label=lab)
        ax.axhline(1, color="k", lw=0.8)
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(ks))], [k["name"] for k in ks], rotation=30, ha="right")
        ax.set_yscale("log")
        ax.set_title(title + " (fwd+bwd, float32)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------------------------
# the GEMM floor: every matrix product of one pretraining step

def gemm_products(cfg, B, T, n_labelled, decode="all"):
    """The matrix products of one BertForPreTraining forward + backward, with their shapes (float32 here):
    [(name, (batch, m, k, n), a_transposed, b_transposed)] for C(m, n) = A(m, k) @ B(k, n), batch matrices each;
    a transposed operand is stored as the transpose (a view, as x @ W.T is, so BLAS reads it with its trans flag).

    N = B T tokens, C hidden, I intermediate, H heads, hs = C / H, V vocab, n labelled (MLM) rows. Each linear
    y = x W^T (W: (out, in), HF layout) gives 3 products: forward x @ W.T, backward dx = dy @ W, dW = dy.T @ x.
      per layer (x L):  q, k, v, attention.output.dense: 4 linears (N, C) -> (N, C)          12 products
                        intermediate.dense (N, C) -> (N, I), output.dense (N, I) -> (N, C)    6 products
                        attention core, batched over B H (T, hs) heads:
                          s = q k^T (T, hs)(hs, T), ctx = p v (T, T)(T, hs);
                          dp = dctx v^T, dv = p^T dctx, dq = ds k, dk = ds^T q                6 products
      pooler.dense (B, C) -> (B, C) and cls.seq_relationship (B, C) -> (B, 2)                 6 products
      cls.predictions.transform.dense (rows, C) -> (rows, C)                                  3 products
      decoder, tied to the word embeddings E (V, C): forward t @ E.T on the decoded rows; backward on the
        n labelled rows only (the loss's gradient is zero elsewhere): dt = dl @ E, dE = dl.T @ t   3 products
    total 24 L + 12. decode="all": the transform and the decoder's forward run on all N rows (HF's path);
    decode="labelled": on the n labelled rows (the original BERT's gather_indexes)."""
    C, I, H, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.vocab_size
    N, hs, BH = B * T, C // cfg.num_attention_heads, B * H
    P = []

    def linear(name, rows, c_in, c_out):
        P.append((f"{name} fwd x W^T", (1, rows, c_in, c_out), False, True))
        P.append((f"{name} bwd dx = dy W", (1, rows, c_out, c_in), False, False))
        P.append((f"{name} bwd dW = dy^T x", (1, c_out, rows, c_in), True, False))

    for l in range(cfg.num_hidden_layers):
        pre = f"layer{l}."
        for proj in ("query", "key", "value"):
            linear(pre + proj, N, C, C)
        P.append((pre + "attention s = q k^T", (BH, T, hs, T), False, True))
        P.append((pre + "attention ctx = p v", (BH, T, T, hs), False, False))
        P.append((pre + "attention dp = dctx v^T", (BH, T, hs, T), False, True))
        P.append((pre + "attention dv = p^T dctx", (BH, T, T, hs), True, False))
        P.append((pre + "attention dq = ds k", (BH, T, T, hs), False, False))
        P.append((pre + "attention dk = ds^T q", (BH, T, T, hs), True, False))
        linear(pre + "attention.output.dense", N, C, C)
        linear(pre + "intermediate.dense", N, C, I)
        linear(pre + "output.dense", N, I, C)
    linear("pooler.dense", B, C, C)
    linear("cls.seq_relationship", B, C, 2)
    rows = N if decode == "all" else n_labelled
    linear("cls.predictions.transform.dense", rows, C, C)
    P.append(("decoder fwd t E^T", (1, rows, C, V), False, True))
    P.append(("decoder bwd dt = dl E (labelled rows)", (1, n_labelled, V, C), False, False))
    P.append(("decoder bwd dE = dl^T t (labelled rows)", (1, V, n_labelled, C), True, False))
    return P


def gemm_flops(products):
    return sum(2 * b * m * k * n for _, (b, m, k, n), _, _ in products)


def gemm_floor(products, dtype=np.float32, seed=0):
    """A zero-argument callable running every product with np.matmul(a, b, out=c) on preallocated arrays.
    Arrays are shared by the layers' identical products (layerN. stripped from the name): these products are
    compute-bound (a C x C weight is reused by all N rows), so cache reuse across layers changes little, and a
    floor may be optimistic but never pessimistic."""
    r = np.random.default_rng(seed)
    bufs, ops = {}, []

    def operand(shape, transposed):                          # (batch, rows, cols) as the product sees it
        bt, rows, cols = shape
        a = r.standard_normal((bt, cols, rows) if transposed else shape, dtype=np.float64).astype(dtype)
        return a.swapaxes(1, 2) if transposed else a

    for name, (b, m, k, n), at, bt in products:
        key = (re.sub(r"^layer\d+\.", "", name), b, m, k, n, at, bt)
        if key not in bufs:
            A, Bm = operand((b, m, k), at), operand((b, k, n), bt)
            if b == 1:
                A, Bm = A[0], Bm[0]
            bufs[key] = (A, Bm, np.empty(((m, n) if b == 1 else (b, m, n)), dtype))
        ops.append(bufs[key])

    def run():
        for a, b_, c in ops:
            np.matmul(a, b_, out=c)
    return run


# ----------------------------------------------------------------------------------------------------------------
# the pretraining step: refbert (numpy, numba; decode all, labelled) vs HF + PyTorch, and the GEMM floor

def batch(B, T, vocab_size, seed=0):
    """ids, half the rows padded to 3/4 length, two segments, 15% MLM labels, NSP labels (as bench_model.py)."""
    r = np.random.default_rng(seed)
    ids = r.integers(min(1000, vocab_size // 2), vocab_size, (B, T))
    am = np.ones((B, T), np.int64)
    am[1::2, T * 3 // 4:] = 0
    tt = np.zeros((B, T), np.int64)
    tt[:, T // 2:] = 1
    labels = np.where(r.random((B, T)) < 0.15, ids, -100)
    return dict(input_ids=ids, attention_mask=am, token_type_ids=tt, labels=labels,
                next_sentence_label=r.integers(0, 2, B))


def hf_model(cfg, path, seed=0):
    """An HF BertForPreTraining with random weights (eager attention), saved to `path`."""
    import torch
    import transformers
    hf_cfg = transformers.BertConfig(**{k: v for k, v in cfg.to_dict().items() if k != "model_type"},
                                     attn_implementation="eager")
    torch.manual_seed(seed)
    hf = transformers.BertForPreTraining(hf_cfg)
    transformers.utils.logging.disable_progress_bar()       # no "Writing model shards" bar in the bench's output
    hf.save_pretrained(path)
    return hf


def step_refbert(model, x, decode="all"):
    out = model.forward(**x, mlm_decode=decode)
    model.backward()
    return float(out.loss)


def step_torch(model, tx, autocast=None):
    """One HF + PyTorch step; autocast: a torch dtype (bfloat16, float16) to run under torch.autocast("cpu")."""
    import torch
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext():
        out = model(**tx)
    out.loss.backward()
    return out.loss.item()


def set_dropout(ours, hf, train, p):
    """Dropout probability p (hidden and attention) and train/eval mode on every model alike."""
    import torch
    for m in ours:
        m.config.hidden_dropout_prob = m.config.attention_probs_dropout_prob = p
        m.train(train)
    hf.config.hidden_dropout_prob = hf.config.attention_probs_dropout_prob = p
    for mod in hf.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = p
    hf.train(train)


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def _status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))  # kB


def step_peak_memory(path, framework, size, decode="all"):
    """Peak RSS growth (MiB) over one eval step in a fresh process that loads only that model: Linux's high-water
    mark (VmHWM) is reset through /proc/self/clear_refs after loading, read after the step (torch's allocator is
    invisible to tracemalloc)."""
    code = (f"import refbert.bench as b\nb._step_peak_child({path!r}, {framework!r}, {size!r}, {decode!r})\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        return None
    return float(p.stdout.strip().splitlines()[-1])


def _step_peak_child(path, framework, size, decode):
    s = SIZES[size]
    x = batch(s["B"], s["T"], 30522)
    if framework == "torch":
        import torch
        import transformers
        m = transformers.BertForPreTraining.from_pretrained(path, attn_implementation="eager").eval()
        x = {k: torch.tensor(v) for k, v in x.items()}
    else:
        import refbert
        m = refbert.BertForPreTraining.from_pretrained(path, dtype=np.float32, backend=framework).eval()
    run = (lambda: step_torch(m, x)) if framework == "torch" else (lambda: step_refbert(m, x, decode))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    run()
    print((_status("VmHWM") - before) / 1024)


def run_step(args, info, command):
    quick = args.quick
    # --quick: 3 repeats, so that the median drops an outlier (of 2 it is their mean), and the same pause before
    # each run as a full bench: another framework's worker threads still spinning slow the next run down
    repeats = args.repeats or (3 if quick else 7)
    settle = SETTLE_S
    sizes = args.sizes or (["mini"] if quick else ["mini", "base"])
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"step: skipped: needs torch and transformers (pip install 'refbert[dev]'): {e}")
        return [], False
    import refbert
    from refbert.model import get_backend
    from refbert.philox import DropoutRNG
    torch.set_num_threads(os.cpu_count())
    backends, unavailable = ["numpy"], {}
    try:
        get_backend("numba")
        backends.append("numba")
    except Exception as e:
        unavailable["numba"] = f"{type(e).__name__}: {e}"
    precision = {"no": "fp32", "bf16": "bf16-mixed", "fp16": "fp16-mixed"}[getattr(args, "mixed_precision", "no")]
    autocast = {"fp32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}[precision]
    # the losses' agreement: float32 runs 1e-4; mixed ones within 4 u of each other (u = half an ulp of 1 of the
    # compute dtype: refbert's spec and autocast round at other places; the study measures ~0.05 u)
    loss_tol = {"fp32": 1e-4, "bf16-mixed": 4 * 2.0 ** -8, "fp16-mixed": 4 * 2.0 ** -11}[precision]
    n_runs = len(backends) * 2 + 3
    bar = _Progress(len(sizes) * 2 * (repeats + 1) * n_runs, "step")
    for k, e in unavailable.items():
        bar.write(f"refbert {k} backend unavailable: {e}")
    results, failed = [], False
    for size in sizes:
        s = {**SIZES[size], **(QUICK_BATCH if quick else {})}
        B, T = s["B"], s["T"]
        cfg = refbert.BertConfig.preset(s["preset"])
        with tempfile.TemporaryDirectory(prefix="refbert-bench-") as d:
            hf = hf_model(cfg, d)
            ours = {be: refbert.BertForPreTraining.from_pretrained(d, dtype=np.float32, backend=be,
                                                                   precision=precision)
                    for be in backends}
            x = batch(B, T, cfg.vocab_size)
            tx = {k: torch.tensor(v) for k, v in x.items()}
            n = int((x["labels"] != -100).sum())
            prods = {dec: gemm_products(cfg, B, T, n, dec) for dec in ("all", "labelled")}
            floors = {dec: gemm_floor(p) for dec, p in prods.items()}
            runs = {}                                        # label -> (callable, floor it is measured against)
            for be, m in ours.items():
                for dec in ("all", "labelled"):
                    runs[f"refbert {be} ({dec})"] = ((lambda m=m, dec=dec: step_refbert(m, x, dec)), dec)
            runs["HF + PyTorch"] = ((lambda: step_torch(hf, tx, autocast)), "all")
            runs["GEMM floor"] = (floors["all"], "all")
            runs["GEMM floor (labelled)"] = (floors["labelled"], "labelled")
            for mode, train, p in (("eval", False, 0.0), ("train", True, 0.1)):
                set_dropout(ours.values(), hf, train, p)
                # validate before timing; refbert's dropout masks come from its counter-based generator, so
                # every refbert run from the same seed draws the same masks (torch's are its own: train checks
                # refbert against itself, and torch's loss only for being finite)
                losses = {}
                for label, (fn, _) in runs.items():
                    if label.startswith("refbert"):
                        ours[label.split()[1]].dropout_rng = DropoutRNG(0)
                    if not label.startswith("GEMM"):
                        losses[label] = fn()
                checks = loss_checks(losses, mode, hf_rtol=loss_tol)
                bad = set()
                for c in checks:
                    if not c["ok"]:
                        # HF disagreeing in eval puts refbert's reference itself in doubt
                        bad.add("refbert numpy (all)" if c["run"] == "HF + PyTorch" and mode == "eval" else c["run"])
                        failed = True
                        bar.write(f"{size} {mode}: CHECK FAILED {_check_text(c)}")
                timed = {k: v for k, v in runs.items() if k not in bad}
                for fn, _ in timed.values():                 # warm-up (the validation call warmed refbert/torch)
                    fn()
                times = {k: [] for k in timed}
                order = list(timed)
                with Interference() as load:
                    for r in range(repeats):                 # interleaved, start rotated: drift hits all alike
                        for label in order[r % len(order):] + order[:r % len(order)]:
                            time.sleep(settle)
                            t0 = time.perf_counter()
                            timed[label][0]()
                            times[label].append(time.perf_counter() - t0)
                            bar.step(what=f"{size} {mode} {label}")
                if load.busy:
                    bar.write(f"{size} {mode}: {_busy_note(load.share).replace('**', '')}")
                med = {k: statistics.median(v) for k, v in times.items()}
                rows = []
                for label, t in med.items():
                    rows.append(dict(run=label, ms=t * 1e3, samples_ms=[v * 1e3 for v in times[label]],
                                     loss=losses.get(label),
                                     x_floor=t / med["GEMM floor"] if "GEMM floor" in med else None,
                                     x_own_floor=(t / med["GEMM floor (labelled)"]
                                                  if runs[label][1] == "labelled" and "GEMM floor (labelled)" in med
                                                  else None),
                                     x_torch=t / med["HF + PyTorch"] if "HF + PyTorch" in med else None))
                    bar.write(f"{size:4s} {mode:5s} {label:24s} {t * 1e3:9.1f} ms  "
                              f"{_fmt(rows[-1]['x_floor'], '.2f')}x floor  {_fmt(rows[-1]['x_torch'], '.2f')}x torch")
                rows += [dict(run=k, ms=None, loss=losses.get(k), error="failed validation: not timed")
                         for k in runs if k in bad]
                results.append(dict(size=size, preset=s["preset"], B=B, T=T, precision=precision,
                                    layers=cfg.num_hidden_layers,
                                    hidden=cfg.hidden_size, heads=cfg.num_attention_heads, vocab=cfg.vocab_size,
                                    n_labelled=n, mode=mode, dropout=p, repeats=repeats, checks=checks, rows=rows,
                                    others_cpu_share=load.share,
                                    floor_gflop={k: gemm_flops(v) / 1e9 for k, v in prods.items()},
                                    floor_products={k: len(v) for k, v in prods.items()}))
            mem = {}
            if not quick and precision == "fp32":        # (the children load float32 models)
                bar.write(f"{size}: peak memory of one eval step, each in a fresh process...")
                for fw, dec in [(be, dec) for be in backends for dec in ("all", "labelled")] + [("torch", "all")]:
                    mem[f"{fw} ({dec})" if fw != "torch" else "HF + PyTorch"] = step_peak_memory(d, fw, size, dec)
            results[-1]["peak_mib_eval"] = results[-2]["peak_mib_eval"] = mem
        del hf, ours
    bar.close()
    products = {}
    for size in sizes:
        r = next(r for r in results if r["size"] == size)
        products[size] = [dict(name=nm, batch=b, m=m, k=k, n=nn, a_T=at, b_T=bt) for nm, (b, m, k, nn), at, bt
                          in gemm_products(refbert.BertConfig.preset(r["preset"]), r["B"], r["T"], r["n_labelled"])]
    data = dict(sizes={k: SIZES[k] for k in sizes}, unavailable=unavailable, results=results, products=products,
                precision=precision)
    what = "float32" if precision == "fp32" else f"{precision}: refbert's spec, HF under torch.autocast"
    paths = _write(args.out, "step" if precision == "fp32" else f"step-{precision}",
                   f"One pretraining step: refbert vs HF + PyTorch (CPU, {what}) and the GEMM floor",
                   info, command, quick, _step_md(data), data,
                   None if args.no_plot else lambda plt: _step_png(plt, data))
    return paths, failed


def loss_checks(losses, mode, rtol=1e-4, hf_rtol=1e-4):
    """The checks made before any step is timed: every run's loss against refbert numpy (all)'s, relative
    difference <= rtol (float32 losses of one batch computed in other orders agree to ~1e-7; 1e-4 leaves room
    for the kernels' per-op float32 error), HF + PyTorch's in eval within hf_rtol (a mixed-precision step's loss:
    torch's autocast rounds in other places than refbert's spec), and in train mode, whose dropout masks are
    torch's own, only required to be finite. -> [dict(run, loss, ref, rel, check, ok)]"""
    ref = losses["refbert numpy (all)"]
    checks = []
    for label, loss in losses.items():
        if label == "refbert numpy (all)":
            continue
        if label == "HF + PyTorch" and mode != "eval":
            ok, what = math.isfinite(loss), "loss finite (its dropout masks are torch's own: not compared)"
        else:
            tol = hf_rtol if label == "HF + PyTorch" else rtol
            ok, what = _rel(loss, ref) <= tol, f"vs refbert numpy (all), rel <= {tol:.0e}".replace("e-0", "e-")
        checks.append(dict(run=label, loss=loss, ref=ref, rel=_rel(loss, ref), check=what, ok=bool(ok)))
    return checks


def _check_text(c):
    """One check as a clause: "refbert numba (all) vs refbert numpy (all), rel <= 1e-4: 8.5e-08 ok"."""
    value = f"{c['loss']:.6g}" if c["check"].startswith("loss finite") else f"{c['rel']:.1e}"
    return f"{c['run']} {c['check']}: {value} {'ok' if c['ok'] else 'FAIL'}"


def _step_md(d):
    prec = d.get("precision", "fp32")
    L = [] if prec == "fp32" else [
        f"Precision {prec}: refbert's models with precision={prec!r} (the spec of refbert.ops, on the CPU: every "
        f"op's inputs and output rounded in NumPy around its float32 arithmetic, so slower than float32 here), "
        f"HF + PyTorch under torch.autocast('cpu', {'bfloat16' if 'bf16' in prec else 'float16'}) (no loss "
        f"scaling in the timed step); the GEMM floor stays float32.", ""]
    L += ["BertForPreTraining forward + backward (MLM + NSP loss), float32, the same weights (an HF model with random "
         "weights, refbert loaded from its folder) and the same batch (15% MLM labels, half the rows padded to 3/4). "
         "eval: dropout 0 on both and eval mode; train: dropout 0.1 on both and train mode. (all) is HF's path "
         "(logits at every position); (labelled) decodes the labelled rows only. The losses are checked before "
         "timing. Times: median of interleaved repeats (a 0.2 s pause before each, so that the previous run's "
         "spinning worker threads go idle) after a warm-up step. × floor = time / the GEMM floor (the "
         "step's matrix products alone on np.matmul, same BLAS, same run: `refbert.bench.gemm_products`); "
         "× own floor = time / the labelled path's floor; × torch = time / HF + PyTorch's time (< 1: faster).", ""]
    if d["unavailable"]:
        L += [f"Unavailable: {k}: {v}" for k, v in d["unavailable"].items()] + [""]
    for r in d["results"]:
        L += [f"## {r['size']} (L{r['layers']} H{r['hidden']} A{r['heads']}, V {r['vocab']}), B{r['B']} T{r['T']}, "
              f"{r['mode']} (dropout {r['dropout']})", "",
              f"GEMM floor: {r['floor_products']['all']} products, {r['floor_gflop']['all']:.2f} GFLOP "
              f"(labelled decode: {r['floor_gflop']['labelled']:.2f} GFLOP); {r['n_labelled']} labelled rows; "
              f"{r['repeats']} repeats.", ""]
        L += _table(["run", "ms", "× floor", "× own floor", "× torch", "loss", "GFLOP/s of the floor's work"],
                    [[x["run"], _fmt(x["ms"], ".1f") if x["ms"] else x.get("error", "—"),
                      _fmt(x.get("x_floor"), ".2f"),
                      _fmt(x.get("x_own_floor"), ".2f"), _fmt(x.get("x_torch"), ".2f"), _fmt(x.get("loss"), ".6g"),
                      _fmt(r["floor_gflop"]["labelled" if "labelled" in x["run"] else "all"] / x["ms"] * 1e3, ".1f")
                      if x["ms"] else "—"]
                     for x in r["rows"]])
        L += ["", _busy_note(r.get("others_cpu_share"))]
        L += ["", "Checks, before timing:", ""] + [f"- {_check_text(c)}" for c in r["checks"]] + [""]
        floors = {x["mode"]: next((y["ms"] for y in x["rows"] if y["run"] == "GEMM floor" and y["ms"]), None)
                  for x in d["results"] if x["size"] == r["size"]}
        if r["mode"] == "train" and all(floors.get(m) for m in ("eval", "train")):
            lo, hi = sorted((floors["eval"], floors["train"]))
            if hi > 1.3 * lo:                # the same products on the same buffers: only the machine can differ
                L += [f"**Unsteady machine: the GEMM floor, the same products in eval and in train, took "
                      f"{floors['eval']:.1f} ms and {floors['train']:.1f} ms** (×{hi / lo:.1f}); compare ratios "
                      f"within one mode only, and rerun.", ""]
        if r.get("peak_mib_eval"):
            L += ["Peak memory of one eval step (resident-set high-water growth, fresh process per run): "
                  + ", ".join(f"{k} +{_fmt(v, '.0f')} MiB" for k, v in r["peak_mib_eval"].items()), ""]
    for size, prods in d["products"].items():
        L += [f"<details><summary>GEMM floor products, {size} ({len(prods)}; C = A(m, k) @ B(k, n), batch "
              f"matrices; (r, c)^T: the transposed view of an (r, c) array)</summary>", "", "```"]
        seen = set()
        for p in prods:
            key = re.sub(r"^layer\d+\.", "layer*.", p["name"])
            if key in seen:
                continue
            seen.add(key)
            a = f"({p['k']}, {p['m']})^T" if p["a_T"] else f"({p['m']}, {p['k']})"
            b = f"({p['n']}, {p['k']})^T" if p["b_T"] else f"({p['k']}, {p['n']})"
            L.append(f"{key:48s} batch {p['batch']:4d}  {a} @ {b}")
        L += ["```", "</details>", ""]
    return L


def _step_png(plt, d):
    res = [r for r in d["results"] if any(x["ms"] for x in r["rows"])]
    if not res:
        return None
    fig, axes = plt.subplots(1, len(res), figsize=(4.5 * len(res), 4.5), squeeze=False)
    for ax, r in zip(axes[0], res):
        rows = [x for x in r["rows"] if x["ms"] and x.get("x_floor")]
        ax.barh([x["run"] for x in rows], [x["x_floor"] for x in rows],
                color=["tab:gray" if x["run"].startswith("GEMM") else "tab:orange" if x["run"].startswith("HF")
                       else "tab:blue" for x in rows])
        ax.axvline(1, color="k", lw=0.8)
        ax.set_title(f"{r['size']} B{r['B']} T{r['T']} {r['mode']}\nstep time / GEMM floor", fontsize=9)
        ax.invert_yaxis()
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------------------------
# attention memory: oracle vs fused, one fresh process per point

def attention_memory_point(impl, T, B=1, H=12, hs=64):
    """Peak memory above the inputs of one attention forward + backward (float32, an HF padding mask, no
    dropout): tracemalloc's peak (NumPy arrays; not Numba's NRT allocations) and the growth of VmHWM."""
    import gc
    import tracemalloc
    if impl == "oracle":
        from refbert import ops as o
    else:
        from refbert_kernels import attention as o
    C = H * hs
    r = np.random.default_rng(0)

    def inputs(T):
        q, k, v, dout = (r.standard_normal((B, T, C), dtype=np.float32) for _ in range(4))   # (B, T, C)
        mask = np.zeros((B, 1, 1, T), np.float32)
        mask[..., T - T // 8:] = np.finfo(np.float32).min                                    # 1/8 padded
        return q, k, v, dout, mask

    def run(q, k, v, dout, mask):
        out, cache = o.attention_forward(q, k, v, H, mask, 0.0, None, True)
        grads = o.attention_backward(dout, cache)
        del out, cache
        return grads

    run(*inputs(min(T, 64)))                                 # warm-up: the same signatures compile here
    args = inputs(T)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                         # reset VmHWM to the current RSS
    rss0 = _status("VmRSS")
    tracemalloc.start()
    t = time.perf_counter()
    grads = run(*args)
    seconds = time.perf_counter() - t
    traced = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del grads
    return dict(impl=impl, T=T, traced_peak_mib=traced / 2 ** 20, rss_growth_mib=(_status("VmHWM") - rss0) / 1024,
                seconds=seconds)


def _attention_estimate(impl, T, B=1, H=12, hs=64):
    """Napkin peak in bytes: the oracle holds ~6 (B, H, T, T) float32 arrays at once (scores, probabilities and
    the mask broadcast in the forward, dp, ds and temporaries in the backward; 5.5 measured at T = 256); a fused
    kernel holds a few (B, T, C) arrays plus a row or tile of scores per thread."""
    if impl == "oracle":
        return 6 * B * H * T * T * 4
    return 16 * B * T * H * hs * 4


def run_memory(args, info, command):
    quick = args.quick
    Ts = args.memory_T or ((128, 256) if quick else MEMORY_T)
    impls = ["oracle"]
    unavailable = None
    try:
        importlib.import_module("refbert_kernels.attention")
        impls.append("fused")
    except Exception as e:
        unavailable = f"refbert_kernels.attention: {type(e).__name__}: {e}"
    avail = _meminfo("MemAvailable")
    limit = min(MEMORY_LIMIT, 0.6 * avail) if avail else MEMORY_LIMIT
    bar = _Progress(len(Ts) * len(impls), "memory")
    if unavailable:
        bar.write(f"fused attention unavailable: {unavailable}")
    points = []
    for T in Ts:
        for impl in impls:
            est = _attention_estimate(impl, T)
            if est > limit:
                points.append(dict(impl=impl, T=T, skipped=f"estimated {est / 2 ** 30:.1f} GiB > limit "
                                                           f"{limit / 2 ** 30:.1f} GiB"))
                bar.write(f"attention memory {impl} T={T}: skipped ({points[-1]['skipped']})")
                bar.step()
                continue
            code = (f"import json, refbert.bench as b\n"
                    f"print(json.dumps(b.attention_memory_point({impl!r}, {T})))\n")
            p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
            if p.returncode != 0:
                points.append(dict(impl=impl, T=T, error=(p.stderr.strip().splitlines() or ["?"])[-1]))
            else:
                points.append(json.loads(p.stdout.strip().splitlines()[-1]))
            points[-1]["estimate_mib"] = est / 2 ** 20
            pt = points[-1]
            bar.write(f"attention memory {impl:6s} T={T:5d}: traced peak {_fmt(pt.get('traced_peak_mib'), '.1f')} "
                      f"MiB, RSS growth {_fmt(pt.get('rss_growth_mib'), '.1f')} MiB" + (f"  {pt['error']}"
                                                                                       if "error" in pt else ""))
            bar.step(what=f"{impl} T={T}")
    bar.close()
    data = dict(B=1, H=12, hs=64, dtype="float32", unavailable=unavailable, limit_bytes=limit, points=points)
    paths = _write(args.out, "memory", "Attention forward + backward: peak memory, oracle vs fused", info, command,
                   quick, _memory_md(data), data, None if args.no_plot else lambda plt: _memory_png(plt, data))
    return paths, False


def _memory_md(d):
    L = ["Attention forward + backward, B=1, H=12, hs=64, float32, an HF padding mask (1/8 padded), no dropout; one "
         "fresh process per point, after a warm-up call at T = 64 (compilation excluded). traced = tracemalloc's peak "
         "above the inputs (every NumPy allocation; not Numba's own allocator); RSS = growth of the resident-set "
         "high-water mark (VmHWM, sees everything, page-granular). A (B, H, T, T) float32 array is "
         "B·H·T²·4 bytes (805 MB at T = 4096); estimate = the napkin peak used to skip points above "
         f"{d['limit_bytes'] / 2 ** 30:.1f} GiB.", ""]
    if d["unavailable"]:
        L += [f"Fused kernel unavailable: {d['unavailable']}", ""]
    rows = []
    for p in d["points"]:
        note = p.get("skipped") or p.get("error") or ""
        rows.append([p["impl"], str(p["T"]), _fmt(p.get("traced_peak_mib"), ".1f"),
                     _fmt(p.get("rss_growth_mib"), ".1f"),
                     _fmt(p.get("estimate_mib"), ".0f"), _fmt(p.get("seconds"), ".3f"), note])
    return L + _table(["impl", "T", "traced peak MiB", "RSS growth MiB", "estimate MiB", "seconds", "note"], rows)


def _memory_png(plt, d):
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for impl in ("oracle", "fused"):
        for key, style in (("traced_peak_mib", "-o"), ("rss_growth_mib", "--s")):
            pts = [p for p in d["points"] if p["impl"] == impl and p.get(key) is not None]
            if pts:
                ax.plot([p["T"] for p in pts], [max(p[key], 1e-3) for p in pts], style,
                        label=f"{impl} ({'traced' if key.startswith('traced') else 'RSS'})")
    if not ax.lines:
        plt.close(fig)
        return None
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("T")
    ax.set_ylabel("peak MiB above inputs")
    ax.set_title("attention fwd+bwd peak memory (B=1, H=12, hs=64, float32)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------------------------
# entry point

def _command(args):
    """The command line that reproduces this run, rebuilt from the parsed options."""
    parts = ["refbert bench"]
    cuda_only = ("device", "attention_T", "step_T", "no_torch", "validate_dtypes")   # options of --device cuda
    for key, value in sorted(vars(args).items()):
        if key in ("command",) or value in (None, False) or (key in cuda_only and args.device != "cuda"):
            continue
        flag = "--" + key.replace("_", "-")
        parts.append(flag if value is True else f"{flag} {' '.join(map(str, value))}" if isinstance(value, list)
                     else f"{flag} {value}")
    return " ".join(parts)


def main(args=None, argv=None):
    """Run the sections asked for; args from refbert/cli.py, or argv parsed here (the scripts in benchmarks/)."""
    if args is None:
        args = add_arguments(argparse.ArgumentParser(prog="refbert bench",
                                                     description=__doc__.split("\n")[0])).parse_args(argv)
    if args.out is None:
        args.out = os.path.join(DEFAULT_OUT, "quick") if args.quick else DEFAULT_OUT
    command = _command(args)
    info = machine()
    sections = args.only or ["kernels", "step", "memory"]
    failed = False
    for name, fn in (("kernels", run_kernels), ("step", run_step), ("memory", run_memory)):
        if name in sections:
            print(f"== {name}", flush=True)
            paths, bad = fn(args, info, command)
            failed |= bad
            for p in paths:
                print(f"wrote {p}")
    return 1 if failed else 0
