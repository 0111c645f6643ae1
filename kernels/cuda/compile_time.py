"""How long this process has spent compiling GPU code, so that a GPU run's logs say where its time went.

Issue 13 wants gpu_all.sh's whole report in under 6 minutes, "the numba compile included" (442 s on the H200 at
b87c638, with no record of how much of each step was compiling). Two compilers run in refbert's processes:

    Numba   numba-cuda compiles a kernel for each new argument signature, with its device functions, and links it
            for the current GPU, all while holding its compiler lock (numba.cuda.core.compiler_lock), which
            announces every acquire and release as a "numba-cuda:compiler_lock" event (numba.cuda.core.event). A
            launch of a kernel already compiled for its signature does not take the lock (the dispatcher finds it
            in C). Counted: the seconds from an outermost acquire to its release, and how many such holds, per
            thread; nested acquires (a kernel compiling its device functions) count once. (A thread's span includes
            any wait for the lock that the event announces before the acquire.) No compile happens in the
            simulator: there the count stays 0.
    CUDA C  cuda_c._module makes each csrc/*.cu's CuPy RawModule under the file's compile lock (cuda_c.compile_lock)
            and compiles it there (NVRTC, or a load from CuPy's disk cache if any process compiled it before).
            Counted per file: the seconds waited for the lock (another process compiling that file) and the seconds
            spent making and compiling it once it held the lock (the emulator's: building its CPU library).

    snapshot()   the counts now, to subtract for a section of a run (since(snap))
    summary()    one line for a log: "Numba: 41.2 s compiling (212 compiler-lock holds); CUDA C: 12 files, 55.0 s
                 (30.2 s of it waiting for another process's compile)"

Nothing here changes what runs; the Numba listener is registered once, when refbert_kernels.cuda._common (every
Numba kernel file's base) is imported.
"""
import threading
import time

clock = time.perf_counter          # (the tests replace it with a counter)

NUMBA = {"s": 0.0, "n": 0}         # seconds the compiler lock was held (outermost holds), and how many holds
CUDA_C = {}                        # csrc file name -> {"wait_s": ..., "compile_s": ..., "n": modules made}
_LOCK = threading.Lock()
_WATCHING = []                     # the registered listener, once


def watch_numba():
    """Register the listener on numba-cuda's compiler lock events (once a process). False where numba-cuda has no
    such events (another version, or not installed): the Numba figures then read "not counted"."""
    if _WATCHING:
        return _WATCHING[0] is not None
    try:
        from numba.cuda.core import event as ev
    except Exception:                                   # (numba-cuda absent or without the event module)
        _WATCHING.append(None)
        return False

    class Held(ev.Listener):
        """Seconds from an outermost start to its matching end, per thread (the depth counts nested acquires; a
        thread's start may fire before another thread's hold ends, where the lock is taken after the event)."""

        def __init__(self):
            self.mine = threading.local()

        def on_start(self, event):
            m = self.mine
            if getattr(m, "depth", 0) == 0:
                m.depth, m.t0 = 0, clock()
            m.depth += 1

        def on_end(self, event):
            m = self.mine
            m.depth = max(0, getattr(m, "depth", 0) - 1)
            if m.depth == 0 and hasattr(m, "t0"):
                with _LOCK:
                    NUMBA["s"] += clock() - m.t0
                    NUMBA["n"] += 1

    listener = Held()
    ev.register("numba-cuda:compiler_lock", listener)
    _WATCHING.append(listener)
    return True


def note_cuda_c(name, wait_s, compile_s):
    """cuda_c._module made csrc/<name>: wait_s waiting for its compile lock, compile_s making and compiling it."""
    with _LOCK:
        d = CUDA_C.setdefault(name, {"wait_s": 0.0, "compile_s": 0.0, "n": 0})
        d["wait_s"] += wait_s
        d["compile_s"] += compile_s
        d["n"] += 1


def snapshot():
    """{"numba_s", "numba_n", "cuda_c_files", "cuda_c_wait_s", "cuda_c_s"} now (cuda_c_s: waiting included)."""
    with _LOCK:
        wait = sum(d["wait_s"] for d in CUDA_C.values())
        return dict(numba_s=NUMBA["s"], numba_n=NUMBA["n"], cuda_c_files=sum(d["n"] for d in CUDA_C.values()),
                    cuda_c_wait_s=wait, cuda_c_s=wait + sum(d["compile_s"] for d in CUDA_C.values()))


def since(snap):
    """snapshot() minus an earlier snapshot: what a section of a run spent."""
    now = snapshot()
    return {k: now[k] - snap.get(k, 0) for k in now}


def describe(d=None, counted=None):
    """One line from a snapshot() / since() dict (default: the whole process so far)."""
    d = snapshot() if d is None else d
    counted = (_WATCHING and _WATCHING[0] is not None) if counted is None else counted
    numba = (f"Numba: {d['numba_s']:.1f} s compiling ({d['numba_n']} compiler-lock hold"
             f"{'s' if d['numba_n'] != 1 else ''})"
             if counted else "Numba: not counted (no numba-cuda compiler lock events)")
    files = d["cuda_c_files"]
    return (f"{numba}; CUDA C: {files} file{'s' if files != 1 else ''}, {d['cuda_c_s']:.1f} s "
            f"({d['cuda_c_wait_s']:.1f} s of it waiting for another process's compile)")


def summary():
    """The whole process's compile time so far, one line."""
    return describe()
