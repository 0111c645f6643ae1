"""kernels/cuda/compile_time.py: how long a process spends compiling GPU code (Numba's kernels, the CUDA C modules
and the waits for other processes' compiles of them), and the bench's Spent, which says section by section where a
run's wall time went. Issue 13 wants gpu_all.sh's whole report in under 6 minutes, "the numba compile included";
these figures are how a GPU run says what to cut, so each is checked against a known answer: a real Numba compile
(NVVM, no GPU) counted once with its device function, synthetic lock events with a counting clock, a CUDA C module
whose wait and compile take known clock ticks."""
import importlib.util
import re
import types

import pytest

import cudachild

NEEDS_NUMBA_CUDA = pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None, reason="numba-cuda not installed")


@NEEDS_NUMBA_CUDA
def test_a_real_numba_compile_is_counted_once_with_its_device_function():
    """numba.cuda.compile_ptx (NVVM; no GPU or driver needed) of a kernel that calls a device function: one outermost
    hold of numba-cuda's compiler lock (the device function's compile nests inside the kernel's), a positive number
    of seconds, and the summary line says so. The control: before the compile, nothing counted (importing the
    kernel files' base compiles nothing). Skipped where NVVM is not found."""
    code = """
        import refbert_kernels.cuda._common                  # (registers the listener, as every kernel file does)
        from refbert_kernels.cuda import compile_time as CT
        from numba import cuda, float32
        from numba.cuda import dispatcher as D             # (a device function compiles for the current device's
        D.get_current_device = lambda: type("Target", (), {"compute_capability": (9, 0)})()   # cc: no driver here,
        before = CT.snapshot()                                                 # so sm_90's, as compile_check does

        @cuda.jit(device=True)
        def twice(v):
            return v * 2

        def k(x):
            i = cuda.grid(1)
            if i < x.size:
                x[i] = twice(x[i])
        try:
            cuda.compile_ptx(k, (float32[:],), cc=(9, 0))
        except Exception as e:
            print("NO NVVM", type(e).__name__, e)
            raise SystemExit(0)
        after = CT.snapshot()
        print("BEFORE", before["numba_n"], before["numba_s"])
        print("AFTER", after["numba_n"], after["numba_s"])
        print("LINE", CT.summary())
    """
    out = cudachild.check(cudachild.run(code, sim=False, timeout=300))
    if "NO NVVM" in out:
        pytest.skip(out.split("NO NVVM", 1)[1][:200])
    assert "BEFORE 0 0.0" in out, out
    n, s = re.search(r"AFTER (\d+) ([\d.e-]+)", out).groups()
    assert int(n) == 1 and float(s) > 0, out
    assert re.search(r"LINE Numba: \d+\.\d s compiling \(1 compiler-lock hold\); CUDA C: 0 files", out), out


@NEEDS_NUMBA_CUDA
def test_lock_holds_are_timed_from_the_outermost_acquire_to_its_release():
    """Synthetic numba-cuda:compiler_lock events, the clock set by hand between them: a nested acquire inside a hold
    counts as one hold, timed from the outer acquire (clock 0) to the outer release (10), not from the inner one (5);
    two threads whose holds overlap (one's start announced before the other's release, as where the event fires
    before the lock is taken) are two holds, each timed from its own start: 25 - 20 and 30 - 22."""
    code = """
        from concurrent.futures import ThreadPoolExecutor
        import refbert_kernels.cuda._common
        from refbert_kernels.cuda import compile_time as CT
        from numba.cuda.core import event as ev
        now = [0.0]
        CT.clock = lambda: now[0]
        K = "numba-cuda:compiler_lock"

        def at(t, what, pool=None):
            now[0] = t
            fn = ev.start_event if what == "start" else ev.end_event
            if pool is None:
                fn(K)
            else:
                pool.submit(fn, K).result()              # (on that pool's one thread)
        for t, what in ((0, "start"), (5, "start"), (7, "end"), (10, "end")):
            at(t, what)
        print("NESTED", CT.NUMBA["n"], CT.NUMBA["s"])
        with ThreadPoolExecutor(1) as a, ThreadPoolExecutor(1) as b:
            at(20, "start", a)
            at(22, "start", b)
            at(25, "end", a)
            at(30, "end", b)
        print("THREADS", CT.NUMBA["n"], CT.NUMBA["s"])
    """
    out = cudachild.check(cudachild.run(code, sim=True, timeout=120))
    assert "NESTED 1 10.0" in out, out
    assert "THREADS 3 23.0" in out, out


def test_cuda_c_module_time_is_split_into_waiting_and_compiling(monkeypatch):
    """cuda_c._module's time for one file: the clock ticks spent before the compile lock was granted (another process
    compiling) are the wait, those spent making and compiling the module under it are the compile; snapshot, since
    and describe add them up."""
    import contextlib

    from refbert_kernels.cuda import compile_time as CT
    from refbert_kernels.cuda import cuda_c as K
    now = [0.0]
    monkeypatch.setattr(CT, "clock", lambda: now[0])
    monkeypatch.setattr(CT, "CUDA_C", {})

    @contextlib.contextmanager
    def slow_lock(name):                                # another process held it for 3 s
        now[0] += 3.0
        yield

    class Module:
        def __init__(self, code, options):
            now[0] += 1.0                               # making it: 1 s

        def compile(self):
            now[0] += 4.0                               # NVRTC: 4 s

    class FakeCupy:
        RawModule = Module

    monkeypatch.setattr(K, "compile_lock", slow_lock)
    snap = CT.snapshot()
    K.module("colsum.cu", FakeCupy())
    assert CT.CUDA_C == {"colsum.cu": {"wait_s": 3.0, "compile_s": 5.0, "n": 1}}, CT.CUDA_C
    d = CT.since(snap)
    assert (d["cuda_c_files"], d["cuda_c_s"], d["cuda_c_wait_s"]) == (1, 8.0, 3.0), d
    assert "CUDA C: 1 file, 8.0 s (3.0 s of it waiting for another process's compile)" in CT.describe(d), d


def test_bench_sections_time_each_part_and_list_the_outer_ones(monkeypatch):
    """refbert.bench_cuda.Spent: each section's seconds by the clock and the compiling inside it (what
    compile_time counted meanwhile); a nested section ("kernels: attention") is a row of the table but not of the
    one-line summary."""
    from refbert import bench_cuda as BC
    from refbert_kernels.cuda import compile_time as CT
    now = [100.0]
    monkeypatch.setattr(BC, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))    # (BC's clock alone)
    monkeypatch.setattr(CT, "NUMBA", {"s": 0.0, "n": 0})
    monkeypatch.setattr(CT, "CUDA_C", {})
    spent = BC.Spent()
    with spent.section("kernels"):
        now[0] += 2.0
        with spent.section("kernels: attention"):
            now[0] += 5.0
            CT.NUMBA.update(s=4.0, n=3)                 # (as the listener would: 4 s compiling in 3 holds)
    with spent.section("step"):
        now[0] += 1.5
        CT.note_cuda_c("mixed.cu", 0.5, 0.25)
    rows = {r["section"]: r for r in spent.rows}
    assert rows["kernels: attention"]["s"] == 5.0 and rows["kernels: attention"]["numba_n"] == 3
    assert rows["kernels"]["s"] == 7.0 and rows["kernels"]["numba_s"] == 4.0
    assert rows["step"]["s"] == 1.5 and rows["step"]["numba_n"] == 0 and rows["step"]["cuda_c_s"] == 0.75
    line = spent.line()
    assert line.startswith("bench sections: kernels 7.0 s, step 1.5 s; total 8.5 s; compiling in all: Numba: 4.0 s"
                           ), line
    assert "attention" not in line, line
    table = "\n".join(spent.md())
    assert "| kernels: attention | 5.0 | 4.0 | 3 | 0.0 | 0.0 |" in table, table
    assert "| step | 1.5 | 0.0 | 0 | 0.8 | 0.5 |" in table, table
