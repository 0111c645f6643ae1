"""Compile every Numba CUDA kernel of refbert_kernels.cuda to PTX for a real GPU, on a machine without one.

Why: Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, what CI runs) executes the kernels as Python, so it never
types them. Code the simulator runs happily can still fail Numba's CUDA typing or NVVM on a GPU: a float64 that
creeps into float32 arithmetic, a function the CUDA target lacks, a shared array with a non-constant shape. This
module finds those without a GPU: it runs every host wrapper of every spec, in every storage dtype, with each
launch replaced by `numba.cuda.compile_ptx(kernel, argument types, cc)` (NVVM only; no driver), and reports each
distinct (kernel, signature) that fails to compile.

    python -m refbert_kernels.cuda.compile_check [--cc 9.0] [--shapes sim|gpu] [--jobs N] [--ptx-dir DIR]

How the launches are intercepted (this process only, never in the library): `cuda.to_device` and
`cuda.device_array` return NumPy arrays (their Numba types are the device arrays' types: same dtype, layout and
rank), `dispatcher[grid, block](*args)` compiles instead of launching and leaves 1 in every float array it was
given (a finite placeholder for what the kernel would write), and the device functions a kernel calls are compiled
for the target's compute capability instead of asking a driver for the current device's. Nothing runs, so outputs hold those
placeholders; the host code after a launch (the next launch, the caches, the validation) runs on them. An exception
there skips that shape's remaining launches, so it fails the check too (exit status 1), as a compile failure does.

Needs numba-cuda with NVVM (libnvvm from a CUDA toolkit) and NVRTC (`pip install nvidia-cuda-nvrtc`) findable;
the CUDA driver is not needed. Must run in a process whose numba.cuda is not the simulator.
"""
import argparse
import io
import multiprocessing
import os
import sys
import traceback
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed

import numpy as np


def _install_hooks(cc, compiled, failures):
    from numba import cuda, typeof
    from numba.cuda import dispatcher as D

    def compile_launch(disp, args):
        sig = tuple(typeof(a) for a in args)
        f = disp.py_func
        if id(disp) not in CLOSURES:                    # (what a dispatcher closes over does not change)
            CLOSURES[id(disp)] = _closure(f)
        key = (f"{f.__module__}.{f.__qualname__}", f.__code__.co_firstlineno, id(disp), sig, CLOSURES[id(disp)], cc)
        REACHED.add(key)
        if key in compiled or key in failures:
            return
        if key not in PTX and key not in FAILED:       # compiled once a process, whichever run() reaches it
            try:
                PTX[key], _ = cuda.compile_ptx(f, sig, cc=cc)
            except Exception as e:  # noqa: BLE001  (NVVM / typing errors of every kind are the findings)
                FAILED[key] = f"{type(e).__name__}: {e}"
        if key in PTX:
            compiled.add(key)
        else:
            failures[key] = FAILED[key]

    class Launch:
        def __init__(self, disp):
            self.disp = disp

        def __call__(self, *args):
            compile_launch(self.disp, args)
            for a in args:          # what the kernel would have written: finite placeholders, so that host code
                if isinstance(a, np.ndarray) and a.dtype.kind == "f" and a.flags.writeable:   # after the launch
                    a.fill(1)       # (attention's row checks) passes and every later launch is reached

    D.CUDADispatcher.__getitem__ = lambda self, cfg: Launch(self)
    # a device function is typed when a kernel calling it is: Numba asks the current device for its compute
    # capability there, which without a driver raises; answer with the target's
    D.get_current_device = lambda: type("Target", (), {"compute_capability": cc})()
    cuda.to_device = lambda a, *_, **__: np.array(a, copy=True)
    cuda.device_array = lambda shape, dtype=np.float64, *_, **__: np.zeros(shape, dtype)


PTX = {}        # (kernel module.qualname, first line, dispatcher id, signature, closure, cc) -> PTX text, of
                # every kernel compiled
FAILED = {}     # the same keys -> the error, of every kernel that did not compile (this process)
CLOSURES = {}   # dispatcher id -> _closure of its function (the keys' part that takes a walk to make)
REACHED = set() # the keys launched since run() last cleared it: what one (spec, version, dtype) reaches


def run(cc=(9, 0), shapes="sim", out=sys.stdout, names=None, dtypes=None, lines=None):
    """Compile every kernel reached by every spec's versions (or the specs named in `names`) in every storage dtype
    (or those named in `dtypes`); their PTX goes to PTX, each (spec, version, dtype)'s progress line to `out` (and
    to the list `lines`, if given, as ((spec, version, dtype), line)). Returns (compiled, failures,
    host_errors): a set of keys, {key: message} of kernels that did not compile, {(spec, version, dtype, shape):
    message} of runs that stopped in host code. Hooks stay installed in this process (it compiles, never launches).
    A progress line counts the kernel signatures its (spec, version, dtype) reaches, compiled now or before (so the
    same in one process and in run_parallel's workers); the total is the distinct ones."""
    from numba.core import config
    if config.ENABLE_CUDASIM:
        raise RuntimeError("compile_check needs the real numba.cuda (unset NUMBA_ENABLE_CUDASIM)")
    compiled, failures, host_errors = set(), {}, {}
    _install_hooks(cc, compiled, failures)
    from refbert_kernels.cuda import _common as C, specs
    from refbert_kernels._harness import _fresh
    warnings.filterwarnings("ignore", "overflow encountered in cast", RuntimeWarning)   # ninf masks in fp16
    for spec in specs():
        if names is not None and spec.name not in names:
            continue
        todo = spec.shapes if shapes == "sim" else spec.notes.get("gpu_shapes", spec.shapes)
        for v in sorted(spec.versions):
            for dt in C.dtypes():
                if dtypes is not None and np.dtype(dt).name not in dtypes:
                    continue
                REACHED.clear()
                for shape in todo:
                    ins, kw = spec.make_inputs(shape, np.float32, 0)
                    ins = {k: (a.astype(dt) if isinstance(a, np.ndarray) and a.dtype.kind == "f" else a)
                           for k, a in ins.items()}
                    try:
                        o, cache = spec.versions[v][0](**ins, **_fresh(kw))
                        d = np.ones(np.shape(o), dt) if np.ndim(o) else np.dtype(dt).type(1.0)
                        spec.versions[v][1](d, cache)
                    except Exception as e:  # noqa: BLE001
                        host_errors[(spec.name, v, np.dtype(dt).name, repr(shape))] = "".join(
                            traceback.format_exception_only(type(e), e)).strip()
                line = (f"  {spec.name:28s} v{v} {np.dtype(dt).name:9s} "
                        f"{len(REACHED):3d} kernel signatures")
                print(line, file=out, flush=True)
                if lines is not None:
                    lines.append(((spec.name, v, np.dtype(dt).name), line))
    return compiled, failures, host_errors


def _closure(fn, depth=4):
    """What a kernel made by a factory closes over, as text: the values of its simple cells (the flags and kinds
    that make one factory's kernels differ), and for a function or device function, its qualname with what it
    closes over in turn (to `depth` levels): two kernels of one factory that differ only inside a device function
    they call (layernorm's sval, with or without a residual) get different names."""
    def cell(v, d):
        if isinstance(v, (bool, int, float, str, type(None), np.generic)):
            return repr(v)
        f = getattr(v, "py_func", v)
        name = getattr(f, "__qualname__", type(v).__name__)
        inner = _closure(f, d - 1) if d > 0 and getattr(f, "__code__", None) is not None else ""
        return f"{name}[{inner}]" if inner else name

    cells = zip(fn.__code__.co_freevars, fn.__closure__ or ())
    return ", ".join(f"{n}={cell(c.cell_contents, depth)}" for n, c in cells)


def _name(key):
    """A kernel signature's key as text, the same in every process (the dispatcher's id is not): module.qualname,
    first line, what it closes over, signature."""
    return f"{key[0]} (line {key[1]}) [{key[4]}] {key[3]}"


def _named(compiled, failures, host_errors):
    """run()'s results with text keys, the same in every process: ({name: PTX}, {name: message}, {run: message})."""
    return ({_name(k): PTX[k] for k in compiled}, {_name(k): m for k, m in failures.items()},
            {repr(k): m for k, m in host_errors.items()})


def _job(job):
    """One (spec, storage dtype), every version, in a worker process: (progress lines, {name: PTX} of what
    compiled, {name: message} of what did not, {run: message} of host-code stops). Split by dtype, not version:
    the versions of one file share device functions, which a process compiles once per signature."""
    from refbert_kernels.cuda import compile_time
    cc, shapes, name, dtype = job
    lines, snap = [], compile_time.snapshot()
    got = _named(*run(cc, shapes, io.StringIO(), names=(name,), dtypes=(dtype,), lines=lines))
    return (lines, *got, compile_time.since(snap))     # (this job's compiling: run_parallel adds them up)


def run_parallel(cc=(9, 0), shapes="sim", out=sys.stdout, jobs=2):
    """run() in `jobs` worker processes, one (spec, storage dtype) a job (NVVM's compiles are single-threaded and
    independent), the files with most versions first. Returns ({name: PTX} of every kernel signature compiled,
    {name: message} of those that failed, {run: message} of host-code stops, what the workers spent compiling:
    compile_time.snapshot()'s keys, summed over the jobs); the progress lines printed at the end, in run()'s order."""
    from refbert_kernels.cuda import _common as C, specs
    order = {s.name: i for i, s in enumerate(specs())}
    todo = [(cc, shapes, spec.name, np.dtype(dt).name)
            for spec in sorted(specs(), key=lambda s: -len(s.versions)) for dt in C.dtypes()]
    ptx, failures, host_errors, lines, spent = {}, {}, {}, [], {}
    # spawn: no forked Numba or driver state; a worker that dies breaks the pool (an error, never a wait)
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
        for fut in as_completed([ex.submit(_job, job) for job in todo]):
            ls, p, f, h, s = fut.result()
            spent = {k: spent.get(k, 0) + v for k, v in s.items()}
            lines += ls
            ptx.update(p)
            failures.update(f)
            host_errors.update(h)
    dts = [np.dtype(dt).name for dt in C.dtypes()]
    for (name, v, dt), line in sorted(lines, key=lambda x: (order[x[0][0]], x[0][1], dts.index(x[0][2]))):
        print(line, file=out, flush=True)
    for name in failures:                      # compiled in one process, failed in another: a failure
        ptx.pop(name, None)
    return ptx, failures, host_errors, spent


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m refbert_kernels.cuda.compile_check", description=__doc__.split("\n")[0])
    ap.add_argument("--cc", default="9.0", help="compute capability to compile for (default 9.0: H100/H200)")
    ap.add_argument("--shapes", choices=("sim", "gpu"), default="sim",
                    help="the specs' simulator shapes (fast) or their GPU shapes (more launch configurations)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="worker processes compiling side by side, a (kernel file, dtype) each (default 1: this "
                         "process)")
    ap.add_argument("--ptx-dir", help="write each compiled kernel signature's PTX to a file here (an index in "
                                      "index.txt: file name, then the signature)")
    a = ap.parse_args(argv)
    cc = tuple(int(p) for p in a.cc.split("."))
    from refbert_kernels.cuda import compile_time
    if a.jobs > 1:
        ptx, failures, host_errors, spent = run_parallel(cc, a.shapes, jobs=a.jobs)
    else:
        ptx, failures, host_errors = _named(*run(cc, a.shapes))
        spent = compile_time.snapshot()
    for name, msg in failures.items():
        print(f"FAILED {name}:\n    {msg.splitlines()[0] if msg else ''}")
        for line in msg.splitlines()[1:12]:
            print("    " + line)
    for key, msg in host_errors.items():
        print(f"host code after a skipped launch: {key}: {msg.splitlines()[-1]}")
    if a.ptx_dir:
        os.makedirs(a.ptx_dir, exist_ok=True)
        with open(os.path.join(a.ptx_dir, "index.txt"), "w") as index:
            for i, (name, text) in enumerate(sorted(ptx.items())):
                with open(os.path.join(a.ptx_dir, f"{i:04d}.ptx"), "w") as f:
                    f.write(text)
                index.write(f"{i:04d}.ptx {name}\n")
    print(f"{len(ptx)} kernel signatures compiled for sm_{cc[0]}{cc[1]}, {len(failures)} failed, "
          f"{len(host_errors)} spec/version/dtype/shape runs stopped in host code")
    print(f"Numba compiling in every process: {spent.get('numba_s', 0):.1f} s, "     # (compile_time)
          f"{spent.get('numba_n', 0)} compiler-lock holds")
    return 1 if failures or host_errors else 0


if __name__ == "__main__":
    sys.exit(main())
