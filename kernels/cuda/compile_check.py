"""Compile every Numba CUDA kernel of refbert_kernels.cuda to PTX for a real GPU, on a machine without one.

Why: Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, what CI runs) executes the kernels as Python, so it never
types them. Code the simulator runs happily can still fail Numba's CUDA typing or NVVM on a GPU: a float64 that
creeps into float32 arithmetic, a function the CUDA target lacks, a shared array with a non-constant shape. This
module finds those without a GPU: it runs every host wrapper of every spec, in every storage dtype, with each
launch replaced by `numba.cuda.compile_ptx(kernel, argument types, cc)` (NVVM only; no driver), and reports each
distinct (kernel, signature) that fails to compile.

    python -m refbert_kernels.cuda.compile_check [--cc 9.0] [--shapes sim|gpu]

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
import sys
import traceback
import warnings

import numpy as np


def _install_hooks(cc, compiled, failures):
    from numba import cuda, typeof
    from numba.cuda import dispatcher as D

    def compile_launch(disp, args):
        sig = tuple(typeof(a) for a in args)
        key = (disp.py_func.__qualname__, disp.py_func.__code__.co_firstlineno, id(disp), sig)
        if key in compiled or key in failures:
            return
        try:
            PTX[key], _ = cuda.compile_ptx(disp.py_func, sig, cc=cc)
            compiled.add(key)
        except Exception as e:  # noqa: BLE001  (NVVM / typing errors of every kind are the findings)
            failures[key] = f"{type(e).__name__}: {e}"

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


PTX = {}        # (kernel qualname, first line, dispatcher id, signature) -> PTX text, of every kernel compiled


def run(cc=(9, 0), shapes="sim", out=sys.stdout, names=None):
    """Compile every kernel reached by every spec's versions (or the specs named in `names`) in every storage dtype;
    their PTX goes to PTX. Returns (compiled, failures, host_errors): a set of keys, {key: message} of kernels that
    did not compile, {(spec, version, dtype, shape): message} of runs that stopped in host code."""
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
                n0 = len(compiled) + len(failures)
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
                print(f"  {spec.name:28s} v{v} {np.dtype(dt).name:9s} "
                      f"{len(compiled) + len(failures) - n0:3d} kernel signatures", file=out, flush=True)
    return compiled, failures, host_errors


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m refbert_kernels.cuda.compile_check", description=__doc__.split("\n")[0])
    ap.add_argument("--cc", default="9.0", help="compute capability to compile for (default 9.0: H100/H200)")
    ap.add_argument("--shapes", choices=("sim", "gpu"), default="sim",
                    help="the specs' simulator shapes (fast) or their GPU shapes (more launch configurations)")
    a = ap.parse_args(argv)
    cc = tuple(int(p) for p in a.cc.split("."))
    compiled, failures, host_errors = run(cc, a.shapes)
    for key, msg in failures.items():
        print(f"FAILED {key[0]} (line {key[1]}) {key[3]}:\n    {msg.splitlines()[0] if msg else ''}")
        for line in msg.splitlines()[1:12]:
            print("    " + line)
    for key, msg in host_errors.items():
        print(f"host code after a skipped launch: {key}: {msg.splitlines()[-1]}")
    print(f"{len(compiled)} kernel signatures compiled for sm_{cc[0]}{cc[1]}, {len(failures)} failed, "
          f"{len(host_errors)} spec/version/dtype/shape runs stopped in host code")
    return 1 if failures or host_errors else 0


if __name__ == "__main__":
    sys.exit(main())
