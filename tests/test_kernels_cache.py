"""Numba's on-disk cache of refbert_kernels follows the files a kernel imports (refbert_kernels._cache).

A kernel compiles the njit helpers it calls from other modules into itself, and Numba stamps its cache with the
kernel's own file alone: change only the helper's file and the old machine code comes back. Shown here on a
two-file package in a temporary folder, each step a fresh interpreter (as a new session, or the next test run):
Numba's own locators return the stale value (the control: the hazard is real and this test can see it); with
refbert_kernels._cache's locators the kernel recompiles when its helper changed, is loaded from the cache when
nothing it imports did, and an unrelated sibling file's change leaves its cache alone.
"""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("numba")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = """
    import sys
    sys.path.insert(0, {folder!r})
    if {ours}:
        from refbert_kernels import _cache
        _cache.install({folder!r})
    import kern
    print("VALUE", kern.g(), "HITS", sum(kern.g.stats.cache_hits.values()))
"""


def _value(folder, ours):
    """(kern.g(), whether it came from the cache) in a fresh interpreter; with ours, refbert_kernels' locators
    take the folder."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(_CHILD.format(folder=str(folder), ours=ours))],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    words = r.stdout.split()
    return float(words[words.index("VALUE") + 1]), int(words[words.index("HITS") + 1]) > 0


def _package(folder, helper_value):
    (folder / "helper.py").write_text(f"from numba import njit\n\n\n@njit\ndef f():\n    return {helper_value}\n")
    (folder / "kern.py").write_text("from numba import njit\n\nfrom helper import f\n\n\n"
                                    "@njit(cache=True)\ndef g():\n    return f() + 0.5\n")
    (folder / "other.py").write_text("X = 1\n")                 # a sibling kern does not import


def test_numbas_own_cache_returns_a_stale_kernel(tmp_path):
    """The control: with Numba's locators, after helper.py changed, g() still adds the old helper's 1.0."""
    _package(tmp_path, 1.0)
    assert _value(tmp_path, ours=False) == (1.5, False)
    _package(tmp_path, 2.0)
    assert _value(tmp_path, ours=False) == (1.5, True)            # stale: 2.5 is right


def test_refbert_locators_recompile_when_an_import_changed_and_only_then(tmp_path):
    _package(tmp_path, 1.0)
    assert _value(tmp_path, ours=True) == (1.5, False)            # compiled, saved
    assert _value(tmp_path, ours=True) == (1.5, True)             # loaded
    _package(tmp_path, 2.0)                                       # the helper changed: recompiled
    assert _value(tmp_path, ours=True) == (2.5, False)
    (tmp_path / "other.py").write_text("X = 2\n")                 # a file kern does not import: still cached
    assert _value(tmp_path, ours=True) == (2.5, True)


def test_dependencies_follow_the_imports_of_the_kernel_files():
    """A kernel file's stamp covers the modules it imports from the package, through each other, and no others:
    layernorm.py imports _math, _harness and dropout (which imports _math too); softmax.py is none of its."""
    from refbert_kernels import _cache
    kernels = os.path.join(ROOT, "kernels")
    deps = {os.path.basename(p) for p in _cache.dependencies(os.path.join(kernels, "layernorm.py"))}
    assert {"layernorm.py", "_math.py", "_harness.py", "dropout.py"} <= deps, deps
    assert "softmax.py" not in deps and "attention.py" not in deps, deps
    assert _cache.stamp(os.path.join(kernels, "layernorm.py")) != _cache.stamp(os.path.join(kernels, "softmax.py"))


SAVES = """
import multiprocessing as mp, os, sys
from {caching} import IndexDataCacheFile
D, LOCK = sys.argv[1], sys.argv[2] == "1"
NAME = {name!r}                                       # (one kernel function's index, which all its signatures share)

def worker(w, start):
    if LOCK:
{lock}
    f = IndexDataCacheFile(D, NAME, ("stamp", 1))
    start.wait()
    for i in range(40):
        f.save(("key", w, i), ("data", w, i))

if __name__ == "__main__":
    os.makedirs(D)
    go = mp.get_context("fork").Event()
    ps = [mp.get_context("fork").Process(target=worker, args=(w, go)) for w in range(4)]
    [p.start() for p in ps]
    go.set()
    [p.join() for p in ps]
    assert all(p.exitcode == 0 for p in ps), [p.exitcode for p in ps]
    f = IndexDataCacheFile(D, NAME, ("stamp", 1))
    idx = f._load_index()
    wrong = sum(f.load(k) != ("data",) + k[1:] for k in idx)
    print("KEPT", len(idx), "WRONG", wrong)
"""


def saves_at_once(tmp_path, caching, name, lock, env=None):
    """A script for SAVES (Numba's caching module `caching`, kernel index `name`, `lock` the code that locks saves in
    each worker) and run(folder, "1" or "0"): (entries kept, entries loading another's data) of 4 processes saving
    40 entries each into one index at once, with or without the lock. Used here (the CPU kernels' cache) and by
    tests/test_cuda_ptx.py (Numba CUDA's)."""
    script = tmp_path / "saves.py"
    script.write_text(SAVES.format(caching=caching, name=name, lock=textwrap.indent(textwrap.dedent(lock), " " * 8)))

    def run(d, locked):
        r = subprocess.run([sys.executable, str(script), str(tmp_path / d), locked], capture_output=True, text=True,
                           cwd=ROOT, timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        words = r.stdout.split()
        return int(words[words.index("KEPT") + 1]), int(words[words.index("WRONG") + 1])
    return run


def test_cache_saves_from_processes_at_once_keep_every_entry(tmp_path):
    """Processes that compile the same kernel at once (refbert check's workers, the suite's workers, two commands)
    save into one index: importing refbert_kernels puts a lock around Numba's save (_cache.lock_saves), so four
    processes saving 40 signatures each keep all 160, each loading its own data. The control, Numba's save without
    the lock, loses entries or points a key at another's data in one of three tries at least (its save reads the
    index, takes the first free data file and writes, unlocked)."""
    run = saves_at_once(tmp_path, "numba.core.caching", "softmax._forward_v3-120.py311", """
        import refbert_kernels                        # (installs the lock on import)
        from numba.core import caching
        assert caching.IndexDataCacheFile.save.refbert_locked
    """)
    assert run("locked", "1") == (160, 0)
    assert any(run(f"bare{i}", "0") != (160, 0) for i in range(3))
