"""Compile every kernels/cuda/csrc/*.cu through CuPy (NVRTC), one process per file, at once: gpu_all.sh's warm step.

CuPy keeps each compiled module on disk (~/.cupy/kernel_cache, keyed by the source and its options) and a later
process loads it from there in milliseconds. gpu_all.sh's side-by-side steps (the GPU tests' workers, check, study,
train, verify) start cold together; each used to compile the files it needs itself: single-threaded, nvcc -O3 for
sm_90 takes 0.5 to 39 s a file and 128 s for all twelve on this project's CPU (2026-12-07, the largest
attention_backward.cu 38.6 s, layernorm.cu 32.9, mixed.cu 19.6, attention_forward.cu 18.0), and `refbert check
--device cuda` needs every one of them. Now each file's compile holds a lock (kernels/cuda/cuda_c.py compile_lock):
a process that needs a file another is compiling waits and then loads it. This script starts every file's compile
at once, the largest first, so that the files are compiled in parallel, each once, while the steps beside it wait
for the ones they need.

    python benchmarks/warm_cache.py [--jobs 12] [--only a.cu,b.cu]

With REFBERT_CUDA_EMULATE=1 it builds the emulator's CPU libraries instead (its own cache; the tooling check CI
runs). Prints one line a file with its seconds; exit status 1 if any file failed to compile.
"""
import argparse
import concurrent.futures as cf
import multiprocessing
import os
import sys
import time
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "kernels" / "cuda" / "csrc"
def build(name):
    """Compile csrc/<name> as the cuda backend does (cuda_c.module) -> (name, seconds, error text or None)."""
    t = time.perf_counter()
    try:
        from refbert_kernels.cuda import cuda_c as K
        if os.environ.get("REFBERT_CUDA_EMULATE") == "1":
            from refbert_kernels.cuda.emulate import cupy as xp
        else:
            import cupy as xp
        K.module(name, xp)          # compiled there, under the file's lock (the emulator's: its library built)
        return name, time.perf_counter() - t, None
    except Exception as e:                            # (reported by name; the others still compile)
        return name, time.perf_counter() - t, f"{type(e).__name__}: {str(e)[-600:]}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1))
    ap.add_argument("--only", default="", help="comma-separated file names (default: every csrc/*.cu)")
    a = ap.parse_args(argv)
    names = [n for n in a.only.split(",") if n] or [p.name for p in CSRC.glob("*.cu")]
    missing = [n for n in names if not (CSRC / n).is_file()]
    if missing:
        ap.error(f"--only: no such file in {CSRC}: {', '.join(missing)}")
    names.sort(key=lambda n: -(CSRC / n).stat().st_size)     # the largest first: they set the wall time
    t = time.perf_counter()
    failed = 0
    ctx = multiprocessing.get_context("spawn")                # (no CUDA state inherited by a fork)
    with cf.ProcessPoolExecutor(max_workers=max(1, a.jobs), mp_context=ctx) as ex:
        for fut in cf.as_completed([ex.submit(build, n) for n in names]):
            name, s, err = fut.result()
            failed += err is not None
            print(f"{name}: {'FAILED ' + err if err else 'compiled'} ({s:.1f} s)", flush=True)
    print(f"{len(names)} files, {failed} failed, {time.perf_counter() - t:.1f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
