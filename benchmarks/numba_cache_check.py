"""Numba's disk cache for refbert's kernels on this GPU, end to end: a kernel compiled and cached by one process is
loaded, not compiled, by the next, and computes the same bits. benchmarks/gpu_all.sh's preflight runs this before it
turns REFBERT_NUMBA_CACHE on for its run (kernels/cuda/_common.py NUMBA_CACHE: off by default), so that a cache that
fails on the machine costs the run nothing but the compiles it would have made anyway.

    python benchmarks/numba_cache_check.py DIR        (DIR: an empty directory, the cache's; exit status 0 if ok)

Two child processes, each with REFBERT_NUMBA_CACHE=1 and NUMBA_CACHE_DIR=DIR, run the softmax's Numba version 3
forward (a kernel made by a factory, its closure holding the storage kind and the device functions it calls, as
every kernel here) on the same inputs, then count, over every Numba kernel of refbert_kernels.cuda in
the process, the signatures compiled (cache misses) and loaded (cache hits): the first must compile and load
nothing, the second load and compile nothing, and both give the same output bits.
"""
import json
import os
import subprocess
import sys

CHILD = r"""
import gc, hashlib, json
import numpy as np
from refbert_kernels.cuda import _common as C, softmax as S
from numba.cuda.dispatcher import CUDADispatcher
assert C.NUMBA_CACHE, "REFBERT_NUMBA_CACHE=1 did not turn the cache on"
spec = S.SPECS[0]
inputs, kwargs = spec.make_inputs(spec.shapes[-1], np.float32, 0)
out, _ = spec.versions[3][0](**inputs, **kwargs)
h = hashlib.sha256(np.ascontiguousarray(out).tobytes())
hits = misses = 0
for o in gc.get_objects():
    if isinstance(o, CUDADispatcher) and o.py_func.__module__.startswith("refbert_kernels.cuda"):
        hits += sum(o.stats.cache_hits.values())
        misses += sum(o.stats.cache_misses.values())
print(json.dumps(dict(hits=hits, misses=misses, out=h.hexdigest())))
"""


def child(where):
    env = dict(os.environ, REFBERT_NUMBA_CACHE="1", NUMBA_CACHE_DIR=where)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=150)
    if r.returncode:
        last = " | ".join(r.stderr.strip().splitlines()[-4:])              # (one line: the summary quotes it)
        raise RuntimeError(f"a child failed (rc {r.returncode}): {last[-600:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1].strip())
        return 2
    where = argv[0]
    os.makedirs(where, exist_ok=True)
    if os.listdir(where):
        print(f"numba cache: FAILED, {where} is not empty (the first process must find nothing cached)")
        return 1
    try:
        first, second = child(where), child(where)
    except Exception as e:                              # (any failure: the run goes on without the cache)
        print(f"numba cache: FAILED ({type(e).__name__}: {e})")
        return 1
    ok = (first["misses"] > 0 and first["hits"] == 0 and second["hits"] == first["misses"]
          and second["misses"] == 0 and first["out"] == second["out"])
    what = (f"first process {first['misses']} compiled, {first['hits']} loaded; second {second['misses']} "
            f"compiled, {second['hits']} loaded; outputs {'the same bits' if first['out'] == second['out'] else 'DIFFER'}")
    print(f"numba cache: {'ok' if ok else 'FAILED'} ({what})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
