"""How the CUDA C kernels are launched (kernels/cuda/cuda_c.py, "launches"): version 2 packs each call's arguments
into 8-byte slots and calls cuLaunchKernel; version 1 is CuPy's RawKernel call. On the emulator (CI) and on a GPU
when one is present.

What must hold, and why:
  * The two versions launch the same kernels on the same arguments, so a training step (fp32 and bf16-mixed, train
    mode: dropout, the masked rows, every CUDA C kernel of the step) gives the same bits under either: any
    difference is a misread argument. What ran is asserted: the version 2 step's launches went through the packed
    path and the version 1 step's did not.
  * On the emulator, every slot holds exactly the bytes the kernel's C signature reads there (the emulator checks
    each argument's type against the signature, then its trampoline reads the slots by that signature): compared
    byte for byte for every launch of both steps, with a negative control (a float packed as a double is caught).
  * A call the layout cannot take is a TypeError naming the kernel and the argument; a CuPy without
    driver.launchKernel is a warned, recorded fallback to version 1, which describe() names and versions.problems()
    reports (a failing row of check --device cuda and of the bench). Grid and block read as
    CuPy's call reads them; a scalar's slot chosen by its dtype.
  * Each .cu compiles under its lock (cuda_c.compile_lock): of two processes that take it at once, the second
    enters after the first has left (an unlocked run of the same children overlaps: the control), and module()
    makes and compiles a CuPy RawModule while holding it.
"""
import importlib.util
import textwrap

import pytest

import cudachild

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None, reason="needs numba-cuda")]


def _child(code, mode, prelude=""):
    return cudachild.on(mode, prelude + textwrap.dedent(code), timeout=900)


_STEP = """
import numpy as np, refbert
from refbert.check import model_batch, tiny_config
from refbert_kernels.cuda import backend as B, cuda_c as K

PACKED = [0]
_call = K.Packed.__call__
def counted(self, *a, **k):
    PACKED[0] += 1
    return _call(self, *a, **k)
K.Packed.__call__ = counted

cfg = tiny_config("BertForPreTraining", num_hidden_layers=2, hidden_size=128, num_attention_heads=2,
                  intermediate_size=96)                  # head size 64: the attention runs C6, as BERT-base's
x = model_batch(cfg, "BertForPreTraining", B=2, T=8)

def step(launch, precision):
    K.LAUNCH = launch
    PACKED[0] = 0
    m = refbert.BertForPreTraining(cfg, seed=1, backend="cuda", precision=precision).train(True)
    out = m(**x)
    g = m.backward()
    host = lambda a: np.asarray(a.get() if hasattr(a, "get") else a)
    return host(out.loss), {k: host(v) for k, v in g.items()}, PACKED[0]
"""


@pytest.mark.parametrize("mode", ["emu", "gpu"])
def test_launch_versions_give_the_same_bits(mode):
    out = _child("""
        for precision in ("fp32", "bf16-mixed"):
            l1, g1, p1 = step("1", precision)
            l2, g2, p2 = step("2", precision)
            assert p1 == 0 and p2 > 50, (precision, p1, p2)                # what ran is what was meant
            assert l1.tobytes() == l2.tobytes(), (precision, l1, l2)
            assert g1.keys() == g2.keys() and len(g1) > 20, sorted(g1)
            diff = [k for k in g1 if g1[k].tobytes() != g2[k].tobytes()]
            assert not diff, (precision, diff)
            print(f"OK {precision}: loss {float(l2):.6f}, {len(g2)} gradients the same bits, {p2} packed launches")
        assert "launch version 2" in B.describe(), B.describe()
    """, mode, _STEP)
    assert out.count("OK ") == 2, out


def test_emu_packed_slots_hold_what_the_signature_reads():
    out = _child("""
        import ctypes

        def compare(launches):
            def checked(self, grid, block, args, shared_mem=0, stream=None):
                want = self.raw._values(args)                        # the emulator's typed values of this call
                r = _call(self, grid, block, args, shared_mem, stream)
                got = bytes(self._tls.slots)
                for i, v in enumerate(want):
                    if got[8 * i: 8 * i + ctypes.sizeof(v)] != bytes(v):
                        launches.setdefault("mismatch", []).append((self.name, i, self.raw.params[i].text))
                launches[self.name] = launches.get(self.name, 0) + 1
                return r
            return checked

        for precision in ("fp32", "bf16-mixed"):
            seen = {}
            K.Packed.__call__ = compare(seen)
            K._FUNCTIONS.clear()                                     # layouts made anew under the check
            step("2", precision)
            assert "mismatch" not in seen, seen["mismatch"][:5]
            assert len(seen) > 10 and sum(seen.values()) > 50, seen
            print(f"OK {precision}: {sum(seen.values())} launches of {len(seen)} kernels, every slot as read")
        # the negative control: a float packed as a double (what CuPy does with a Python float) is caught
        K._SLOT[np.dtype(np.float32)] = "d"
        K._FUNCTIONS.clear()
        seen = {}
        K.Packed.__call__ = compare(seen)
        try:
            step("2", "fp32")
        except Exception as e:                                        # a misread size may also fail a kernel
            print("control raised", type(e).__name__)
        assert seen.get("mismatch"), "the comparison saw no difference"
        print("OK control:", seen["mismatch"][0])
    """, "emu", _STEP)
    assert out.count("OK ") == 3, out


def test_emu_packed_launch_errors_and_fallback():
    out = _child("""
        import warnings
        import numpy as np
        from refbert_kernels.cuda import backend as B, cuda_c as K, emulate as E
        cp = E.cupy
        raw = K.module("colsum.cu", cp).get_function("colsum_partial_v1")
        x, parts = cp.ones((5, 7), np.float32), cp.empty((5, 7), np.float32)
        good = (x, np.int32(5), np.int32(7), np.int32(1), parts)
        p = K.Packed(raw, "colsum_partial_v1", cp)
        p((1, 5), (256,), good)
        assert float(parts.sum()) == 35.0                              # the kernel ran on the packed slots
        p._check = None                                                # as on a GPU: Packed's own checks alone
        q = K.Packed(raw, "colsum_partial_v1", cp)
        q._check = None
        for what, call in {"Python int": lambda: q((1, 5), (256,), (x, 5, *good[2:])),
                           "argument count": lambda: p((1, 5), (256,), good[:4]),
                           "grid of four": lambda: p((1, 5, 1, 1), (256,), good)}.items():
            try:
                call()
            except (TypeError, ValueError) as e:
                assert "colsum_partial_v1" in str(e) or "grid" in str(e), e
                print("OK", what, "->", e)
            else:
                raise SystemExit(f"{what}: accepted")
        # a CuPy without driver.launchKernel: version 1, warned once and recorded, describe() names it
        class NoDriver:
            cuda = type("cuda", (), {"get_current_stream": staticmethod(cp.cuda.get_current_stream)})
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            fn = K._packed(raw, "colsum_partial_v1", NoDriver)
        assert fn is raw and "colsum_partial_v1" in K.LAUNCH_FELL_BACK, K.LAUNCH_FELL_BACK
        assert any("RawKernel call" in str(m.message) for m in w), [str(m.message) for m in w]
        assert "FALLBACK  launch of colsum_partial_v1" in B.describe(), B.describe()
        from refbert_kernels.cuda import versions as VV              # a failing row of check --device cuda, bench
        assert any(op == "launch" and "colsum_partial_v1" in why for op, why in VV.problems()), VV.problems()
        print("OK fallback")
    """, "emu")
    assert out.count("OK ") == 4, out


_LOCKER = """
import os, sys, time
from pathlib import Path
from refbert_kernels.cuda import cuda_c as K
d, me, locked = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
(d / f"ready-{me}").touch()
while not (d / "go").exists():                         # both start together
    time.sleep(0.01)
def hold():
    with open(d / "log", "a") as f:
        f.write(f"enter {me}\\n")
    time.sleep(1.0)
    with open(d / "log", "a") as f:
        f.write(f"exit {me}\\n")
if locked:
    with K.compile_lock("some.cu"):
        hold()
else:
    hold()
"""


@pytest.mark.parametrize("locked", [True, False])
def test_compile_lock_lets_one_process_compile_a_file_at_a_time(tmp_path, locked):
    """Two processes entering compile_lock for the same file at once: the second enters after the first has left
    (their log reads enter, exit, enter, exit). The unlocked run is the control: both enter before either leaves,
    so the log can show an overlap."""
    import os
    import subprocess
    import sys
    import time
    env = {**os.environ, "CUPY_CACHE_DIR": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", _LOCKER, str(tmp_path), str(i), "1" if locked else "0"],
                              env=env) for i in (0, 1)]
    deadline = time.time() + 120
    while not all((tmp_path / f"ready-{i}").exists() for i in (0, 1)):
        assert time.time() < deadline and all(p.poll() is None for p in procs), "the children did not start"
        time.sleep(0.01)
    (tmp_path / "go").touch()
    assert all(p.wait(timeout=120) == 0 for p in procs)
    events = [line.split()[0] for line in (tmp_path / "log").read_text().splitlines()]
    if locked:
        assert events == ["enter", "exit", "enter", "exit"], events
        assert (tmp_path / "cache" / "refbert-some.cu.lock").exists()
    else:
        assert events == ["enter", "enter", "exit", "exit"], events


def test_module_compiles_under_the_lock(tmp_path, monkeypatch):
    """cuda_c.module on a CuPy (not the emulator) makes the RawModule and compiles it while holding the file's
    lock: a second taker of the lock (a non-blocking flock) is refused during the compile, and granted after."""
    import fcntl
    from refbert_kernels.cuda import cuda_c as K
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    seen = []

    def try_lock():
        with open(tmp_path / "refbert-colsum.cu.lock", "w") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return "free"
            except BlockingIOError:
                return "held"

    class Module:
        def __init__(self, code, options):
            assert code == (K.CSRC / "colsum.cu").read_text() and "-DNO_MAIN" in options
            seen.append(("made", try_lock()))

        def compile(self):
            seen.append(("compiled", try_lock()))

    class FakeCupy:                                     # (hashable: module() caches per array module)
        RawModule = Module

    K.module("colsum.cu", FakeCupy())
    assert seen == [("made", "held"), ("compiled", "held")], seen
    assert try_lock() == "free"


def test_packed_dims_and_scalar_kinds_as_cupy_takes_them():
    """Grid and block as CuPy's call takes them (an int or 1 to 3 ints, a zero raised to 1 as CuPy does); the slot of
    a scalar chosen by its dtype (np.longlong is a class apart from np.int64 on Linux, the same 8 bytes)."""
    import struct

    import numpy as np
    from refbert_kernels.cuda import cuda_c as K
    assert K._dims3(7) == (7, 1, 1) and K._dims3((2, 3)) == (2, 3, 1) and K._dims3((0, 5)) == (1, 5, 1)
    assert K._dims3([4, 1, 2]) == (4, 1, 2)                             # (a list: not cached, still read)
    with pytest.raises(ValueError, match="1 to 3 ints"):
        K._dims3((1, 2, 3, 4))

    p = K.Packed.__new__(K.Packed)                                      # (the layout alone: no kernel behind it)
    p.name, p._pack = "k", None
    p._layout((np.longlong(-3), np.int32(5), np.float32(0.5), np.uint64(2 ** 63)))
    buf = bytearray(32)
    p._pack(buf, (np.longlong(-3), np.int32(5), np.float32(0.5), np.uint64(2 ** 63)))
    assert struct.unpack("<qi4xf4xQ", buf) == (-3, 5, 0.5, 2 ** 63)
    with pytest.raises(TypeError, match=r"launch of k: argument 0 .* got float"):
        p._layout((0.5,))


def test_gelu_v3_grid_takes_the_blocks_its_launch_bounds_promise():
    """gelu.cu version 3 strides a grid of at most GELU_FWD3_BLOCKS blocks an SM over its groups, on the promise that
    they are all resident at once (no block waits for a second wave): its __launch_bounds__(256, N) asks ptxas for N
    blocks of 256 an SM, so the launcher's constant must be that N (test_cuda_nvcc checks that ptxas kept it, with
    no spills)."""
    import re
    from refbert_kernels.cuda import cuda_c as K
    text = (K.CSRC / "gelu.cu").read_text()
    bounds = re.search(r"__launch_bounds__\(256, (\d+)\) gelu_fwd_v3_##NAME", text)
    assert bounds and int(bounds.group(1)) == K.GELU_FWD3_BLOCKS, bounds


def test_sm_count_and_smem_limit_follow_the_current_device():
    """The launchers size grids by the current device's SM count (gelu v3, cross-entropy's splits, attention's query
    rows) and raise a kernel's shared-memory limit once: both are per device, so a process that switches devices
    (`with cupy.cuda.Device(1):`) asks again rather than reusing the first device's answer. A stand-in CuPy with two
    devices of different SM counts; the emulator's one device counts one."""
    from refbert_kernels.cuda import cuda_c as K, emulate as E
    current = [0]
    asked = []

    class Function:
        max_dynamic_shared_size_bytes = 0

    class FakeCupy:                                     # (hashable: the caches key by array module)
        class cuda:
            class runtime:
                @staticmethod
                def getDeviceProperties(d):
                    asked.append(d)
                    return {"multiProcessorCount": (132, 114)[d]}

                @staticmethod
                def getDevice():
                    return current[0]

    fake = FakeCupy()
    assert [K._sm_count(fake) for current[0] in (0, 1, 0, 1)] == [132, 114, 132, 114]
    assert asked == [0, 1], asked                       # (asked once a device)
    assert K._sm_count(E.cupy) == 1

    made = []
    real = (K.module, K.kernel)
    try:
        K.module = lambda source, xp: type("M", (), {"get_function": lambda self, name: made.append(current[0])
                                                     or Function()})()
        K.kernel = lambda source, name, xp: "launcher"
        for current[0] in (0, 0, 1, 1):
            assert K.kernel_smem("some.cu", "k", fake, 99999) == "launcher"
    finally:
        K.module, K.kernel = real
    assert made == [0, 1], made                         # (the limit raised once on each device)
