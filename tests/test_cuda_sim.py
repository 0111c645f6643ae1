"""The Numba CUDA kernels (refbert_kernels.cuda) against the oracle, in Numba's CUDA simulator (no GPU needed),
and on a real GPU when one is present.

The simulator must be switched on (NUMBA_ENABLE_CUDASIM=1) before numba.cuda is first imported, and it cannot be
switched off in a process that has it, so every check runs in a subprocess with that environment: the pytest
process itself never imports numba.cuda. The simulator runs one Python thread per GPU thread and its barriers
poll, so the shapes are tiny (rows of 1-37, blocks of 32 threads, 2 warps per block for the warp versions).
Version 1 (a thread per row or element) and float32 run every simulator shape of each spec; the block / warp
versions (2, 3) run float64 / float16 / bfloat16 on the shapes that reach their tails and edge rows (lowp_shapes
in _DRIVER: each spec's block or warp tail, padded and -inf rows, ignored rows, dropout), at least two per spec. What
the shapes cover: T = 1, one row, odd sizes, warp and block tails (33 = 32 + 1, 37 = 32 + 5, a tail warp without a
row), a padded row with one real token, -inf masks, ignored rows, p = 0 / 0.5 / 1 / eval.
Needs numba-cuda and ml_dtypes (bfloat16 storage), both in the dev and cuda extras.
"""
import functools
import importlib.util
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

import cudachild

for _module, _why in (("numba_cuda", "numba-cuda"), ("ml_dtypes", "ml_dtypes (the bfloat16 storage dtype)")):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"needs {_why}: pip install -e '.[dev]'", allow_module_level=True)

_run = functools.partial(cudachild.run, timeout=600)
_check = cudachild.check


_DRIVER = """
import numpy as np
from refbert_kernels.cuda import _common as C
import importlib
assert C.SIM == {sim}


def lowp_shapes(spec):
    # versions >= 2 in float64 / float16 / bfloat16 in the simulator: the shapes that reach their tails and edges
    if spec.name == "softmax":             # a padded row with one real token, 3 rows (v3: a tail warp without a
        keep = lambda s: s.get("mask") in ("one", "pad", "full")    # row), T = 33 = 32 + 1 under a full -inf mask
    elif spec.name in ("gelu", "bias_gelu"):
        keep = lambda s: np.prod(s["shape"]) > 1                  # (3, 5, 7): erf and tanh, chunked db
    elif "layernorm" in spec.name:
        keep = lambda s: "p" not in s and "train" not in s        # C = 1 (xhat = 0) and C = 37 (block tail)
    else:
        keep = lambda s: True                                     # dropout, cross_entropy: every shape (cheap)
    return [s for s in spec.shapes if keep(s)]


specs = importlib.import_module("refbert_kernels.cuda.{module}").SPECS
for spec in specs:
    for v in sorted(spec.versions):
        for dt in C.dtypes():
            shapes = spec.shapes if {sim} else spec.notes["gpu_shapes"]
            if {sim} and v > 1 and np.dtype(dt) != np.float32:
                shapes = lowp_shapes(spec)
            worst = max(C.validate(spec, v, dt, s) for s in shapes)
            print(f"{{spec.name}} v{{v}} {{np.dtype(dt).name}} {{len(shapes)}}/{{len(spec.shapes)}} shapes "
                  f"worst {{worst:.3f}}", flush=True)
            assert worst <= 1, (spec.name, v, np.dtype(dt).name, worst)
"""

# module -> its specs (each checked in every version and dtype)
MODULES = {"softmax": ["softmax"], "dropout": ["dropout"], "gelu": ["gelu", "bias_gelu"],
           "layernorm": ["layernorm", "residual_layernorm", "dropout_residual_layernorm"],
           "cross_entropy": ["cross_entropy"], "embedding": ["embedding"]}
# the GPU variant runs attention's Numba versions too (their simulator test is tests/test_cuda_attention_sim.py)
GPU_MODULES = {**MODULES, "attention": ["attention"]}
DTYPES = {"float64", "float32", "float16", "bfloat16"}


def _lines(out):
    """{(spec, version, dtype): (shapes run, simulator shapes)} of the driver's output."""
    return {(n, int(v), d): (int(k), int(m)) for n, v, d, k, m in
            re.findall(r"^(\w+) v(\d+) (\w+) (\d+)/(\d+) shapes worst", out, re.M)}


@pytest.fixture(scope="module")
def sim_runs():
    """{module: the simulator child's CompletedProcess} for every module, two children at a time (the simulator
    holds its GIL: one core a child), the largest first; each module's test reads its own."""
    with ThreadPoolExecutor(2) as ex:
        order = ["softmax", "layernorm"] + [m for m in sorted(MODULES) if m not in ("softmax", "layernorm")]
        return dict(zip(order, ex.map(lambda m: _run(_DRIVER.format(sim=True, module=m)), order)))


@pytest.mark.parametrize("module", sorted(MODULES))
def test_sim_every_version_matches_oracle(module, sim_runs):
    """Every version of every op of the module, fp64 / fp32 against the oracle in the same dtype, fp16 / bf16
    against the float64 oracle on the same rounded inputs (tolerances: each module's docstring)."""
    lines = _lines(_check(sim_runs[module]))
    assert {n for n, _, _ in lines} == set(MODULES[module]), lines
    for name in MODULES[module]:
        versions = {v for n, v, _ in lines if n == name}
        assert 1 in versions and len(versions) >= 2, (name, versions)    # a thread-per-row and a block/warp version
        for v in versions:
            assert {d for n, w, d in lines if (n, w) == (name, v)} == DTYPES, (name, v)
    for (name, v, dtype), (k, m) in lines.items():
        assert k >= 2, (name, v, dtype, k)                                  # never one shape alone (C = 1)
        assert k == m or (v > 1 and dtype != "float32"), (name, v, dtype, k, m)


def test_sim_dropout_masks_are_the_oracles():
    """The kept elements of every dropout kernel (dropout, the dropout of dropout_residual_layernorm) are exactly
    refbert.philox's keep_mask, and the backward regenerates the same mask."""
    _check(_run("""
        import numpy as np
        from refbert.philox import DropoutRNG, keep_mask
        from refbert_kernels.cuda import dropout as D, layernorm as L
        x = np.random.default_rng(0).standard_normal((3, 13)).astype(np.float32) + 5   # no zeros in x
        for f in (D.dropout_forward_v1, D.dropout_forward_v2):
            rng = DropoutRNG(2 ** 40 + 3, calls=5)
            out, cache = f(x, 0.3, rng)
            want = keep_mask(2 ** 40 + 3, 5, x.shape, 0.3)
            assert np.array_equal(out != 0, want) and rng.calls == 6
            dx = D.dropout_backward_v1(np.ones_like(x), cache)
            assert np.array_equal(dx != 0, want)
        a = np.ones((3, 13), np.float32)
        for f in (L.dropout_residual_layernorm_forward_v1, L.dropout_residual_layernorm_forward_v2):
            out, cache = f(np.zeros_like(a), a, np.ones(13, np.float32), np.zeros(13, np.float32), p=0.4,
                           rng=DropoutRNG(7))
            ds, da, dw, db = L.dropout_residual_layernorm_backward_v1(np.ones_like(a), cache)
            keep = keep_mask(7, 0, a.shape, 0.4)
            assert np.array_equal(da == 0, ~keep | (ds == 0))
    """))


def test_sim_value_errors_are_the_oracles():
    """Bad input raises the oracle's ValueError, word for word, before any launch (and bf16 / fp16 are accepted
    where the oracle accepts float32 / float64)."""
    _check(_run("""
        import numpy as np
        from refbert import ops
        from refbert.philox import DropoutRNG
        from refbert_kernels.cuda import softmax as S, layernorm as L, dropout as D, gelu as G, cross_entropy as X

        def _msg(f, *a):
            try:
                f(*a)
            except ValueError as e:
                return e
        f32 = np.zeros((2, 3), np.float32)
        w3 = np.ones(3, np.float32)
        cases = [
            ("softmax", S.softmax_forward_v1, (np.zeros((2, 3), np.int64),), {}),
            ("softmax", S.softmax_forward_v2, (f32,), dict(mask=np.zeros((2, 3), np.float64))),
            ("softmax", S.softmax_forward_v3, (f32,), dict(mask=np.zeros((3, 3), np.float32))),
            ("softmax", S.softmax_forward_v3, (np.full((1, 3), -np.inf, np.float32),), {}),
            ("softmax", S.softmax_forward_v1, (np.array([[1.0, np.nan]], np.float32),), {}),
            ("softmax", S.softmax_forward_v2, (np.zeros((), np.float32),), {}),
            ("layernorm", L.layernorm_forward_v1, (f32, np.ones(4, np.float32), w3), {}),
            ("layernorm", L.layernorm_forward_v2, (f32, w3, w3.astype(np.float64)), {}),
            ("residual_layernorm", L.residual_layernorm_forward_v1, (f32, np.zeros((2, 4), np.float32), w3, w3), {}),
            ("dropout_residual_layernorm", L.dropout_residual_layernorm_forward_v2, (f32, f32, w3, w3),
             dict(p=1.5, rng=DropoutRNG(0))),
            ("dropout_residual_layernorm", L.dropout_residual_layernorm_forward_v1, (f32, f32, w3, w3),
             dict(p=0.5, rng=None)),
            ("dropout", D.dropout_forward_v1, (f32, -0.1), {}),
            ("dropout", D.dropout_forward_v2, (f32, 0.5), dict(rng=3)),
            ("dropout", D.dropout_forward_v2, ([1.0], 0.5), {}),
            ("gelu", G.gelu_forward_v1, (f32,), dict(approximate="erf")),
            ("bias_gelu", G.bias_gelu_forward_v2, (f32, np.ones(2, np.float32)), {}),
            ("bias_gelu", G.bias_gelu_forward_v1, (np.zeros((), np.float32), np.ones(1, np.float32)), {}),
            ("cross_entropy", X.cross_entropy_forward_v1, (f32, np.array([0, 3])), {}),
            ("cross_entropy", X.cross_entropy_forward_v2, (f32, np.array([0, 1, 2])), {}),
            ("cross_entropy", X.cross_entropy_forward_v2, (np.array([[0.0, np.nan, 1.0]], np.float32),
                                                           np.array([1])), {}),
        ]
        for op, f, args, kw in cases:
            oracle = getattr(ops, op + "_forward")
            with_rng = lambda kw: {k: (DropoutRNG(0) if isinstance(v, DropoutRNG) else v) for k, v in kw.items()}
            try:
                oracle(*args, **with_rng(kw))
                raise SystemExit(f"oracle accepted {op} {args}")
            except ValueError as e:
                want = str(e)
            try:
                f(*args, **with_rng(kw))
                raise SystemExit(f"{f.__name__} accepted what the oracle rejects: {want}")
            except ValueError as e:
                assert str(e) == want, (f.__name__, str(e), want)
        # backward: dout of the wrong shape / dtype
        p, cache = S.softmax_forward_v3(f32)
        for bad in (np.zeros((2, 4), np.float32), np.zeros((2, 3), np.float64)):
            try:
                S.softmax_backward_v3(bad, cache)
                raise SystemExit("softmax backward accepted a bad dout")
            except ValueError as e:
                assert str(e) == str(_msg(ops.softmax_backward, bad, ops.softmax_forward(f32)[1]))
        print("ok")
    """))


def test_sim_storage_dtypes_returned():
    """fp16 / bf16 in, the same storage dtype out (bf16 = ml_dtypes.bfloat16, handed to the kernels as uint16)."""
    _check(_run("""
        import numpy as np
        from ml_dtypes import bfloat16
        from refbert.philox import DropoutRNG
        from refbert_kernels.cuda import softmax as S, layernorm as L, dropout as D, gelu as G, cross_entropy as X
        for dt in (np.float16, bfloat16):
            x = np.random.default_rng(0).standard_normal((2, 5)).astype(dt)
            w = np.ones(5, dt)
            assert S.softmax_forward_v1(x, 0.5)[0].dtype == dt
            assert L.layernorm_forward_v1(x, w, w)[0].dtype == dt
            assert D.dropout_forward_v2(x, 0.5, DropoutRNG(1))[0].dtype == dt
            assert G.bias_gelu_forward_v1(x, w, "tanh")[0].dtype == dt
            loss, cache = X.cross_entropy_forward_v1(x, np.array([1, -100]))
            assert loss.dtype == dt and loss.ndim == 0 and X.cross_entropy_backward_v1(dt(1.0), cache).dtype == dt
        print("ok")
    """))


def test_sim_shared_arrays_are_one_per_block_under_a_thread_switch():
    """The simulator makes a block's cuda.shared.array by a look-up and a store, unlocked: a thread switch between
    the two (forced here by a slow np.empty) gave each thread its own array, so a kernel reading its neighbour's
    slot read garbage (it failed CI once, in attention v2's K tile). With refbert_kernels.cuda._common imported (the
    lock) every thread of the block shares the one array; without it, the same kernel reads its own zeros."""
    out = _check(_run("""
        import sys, time
        import numpy as np
        from numba import cuda
        from numba.cuda.simulator import kernelapi
        unlocked = kernelapi.FakeCUDAShared.array
        from refbert_kernels.cuda import _common  # noqa: F401  (the lock)
        slow = np.empty

        def empty(*a, **k):
            time.sleep(0.01)                               # a switch between the look-up and the store
            return slow(*a, **k)

        @cuda.jit
        def neighbour(out):
            a = cuda.shared.array(8, np.int32)
            t = cuda.threadIdx.x
            a[t] = t
            cuda.syncthreads()
            out[t] = a[(t + 1) % 8]

        for locked in (True, False):
            if not locked:
                kernelapi.FakeCUDAShared.array = unlocked
            out = np.zeros(8, np.int32)
            np.empty = empty
            neighbour[1, 8](out)
            np.empty = slow
            print("LOCKED" if locked else "UNLOCKED", (out == (np.arange(8) + 1) % 8).all())
    """))
    assert "LOCKED True" in out and "UNLOCKED False" in out, out   # the fix, and the race it fixes


def test_sim_blocks_are_event_driven_with_the_simulators_semantics():
    """kernels/cuda/_common.py replaces the simulator's polling block loop by condition-variable barriers. The same
    kernels under both give the same results: a neighbour's slot read after a barrier, phase after phase; half a
    block returning before a barrier the other half then passes (the loop let it); a thread that raises between
    two barriers stops the launch with that thread's ids, and the launch returns instead of hanging."""
    out = _check(_run("""
        import numpy as np
        from numba import cuda
        from numba.cuda.simulator import kernel as simk
        polling = (simk.BlockManager.run, simk.BlockThread.run, simk.BlockThread.syncthreads)
        from refbert_kernels.cuda import _common  # noqa: F401  (the event-driven blocks)
        driven = (simk.BlockManager.run, simk.BlockThread.run, simk.BlockThread.syncthreads)
        assert getattr(driven[0], "event_driven", False) and driven != polling

        @cuda.jit
        def phases(out):
            a = cuda.shared.array(32, np.int32)
            t = cuda.threadIdx.x
            for k in range(out.shape[1]):
                a[t] = 1000 * cuda.blockIdx.x + 100 * k + t
                cuda.syncthreads()
                out[cuda.blockIdx.x, k, t] = a[(t + 1) % 32]
                cuda.syncthreads()

        @cuda.jit
        def early_exit(out):
            a = cuda.shared.array(32, np.int32)
            t = cuda.threadIdx.x
            a[t] = t + 1
            if t >= 16:
                return
            cuda.syncthreads()
            out[t] = a[t + 16]

        @cuda.jit
        def fails(out):
            t = cuda.threadIdx.x
            cuda.syncthreads()
            out[t + 100 * (t == 5)] = 1
            cuda.syncthreads()

        def launch(which):
            simk.BlockManager.run, simk.BlockThread.run, simk.BlockThread.syncthreads = which
            p, e = np.zeros((3, 4, 32), np.int32), np.zeros(16, np.int32)
            phases[3, 32](p)
            early_exit[1, 32](e)
            try:
                fails[1, 8](np.zeros(8, np.int32))
                err = "no error"
            except IndexError as ex:
                err = str(ex).split(":")[0]
            return p, e, err

        (p0, e0, err0), (p1, e1, err1) = launch(polling), launch(driven)
        want = 1000 * np.arange(3)[:, None, None] + 100 * np.arange(4)[None, :, None] + (np.arange(32) + 1) % 32
        print("PHASES", (p1 == want).all(), (p0 == p1).all())
        print("EARLY", (e1 == np.arange(17, 33)).all(), (e0 == e1).all())
        print("FAILS", repr(err1), err0 == err1)
    """, timeout=120))
    assert "PHASES True True" in out and "EARLY True True" in out, out
    assert "FAILS 'tid=[5, 0, 0] ctaid=[0, 0, 0]' True" in out, out


@functools.lru_cache(maxsize=None)
def _gpu_present():
    r = _run("from numba import cuda; print(cuda.is_available())", sim=False, timeout=120)
    return r.returncode == 0 and r.stdout.strip().endswith("True")


@pytest.mark.parametrize("module", sorted(GPU_MODULES))
def test_gpu_every_version_matches_oracle(module):
    """The same checks on a real GPU at moderate shapes (each spec's notes["gpu_shapes"]), attention's Numba
    versions included; skipped without one. Every (spec, version, dtype) must have run: a version that stopped
    early would leave its line out."""
    if not _gpu_present():
        pytest.skip("no CUDA GPU (numba.cuda.is_available() is False outside the simulator)")
    lines = _lines(_check(_run(_DRIVER.format(sim=False, module=module), sim=False)))
    assert {n for n, _, _ in lines} == set(GPU_MODULES[module]), lines
    for name in GPU_MODULES[module]:
        versions = {v for n, v, _ in lines if n == name}
        assert len(versions) >= 2 and all({d for n, w, d in lines if (n, w) == (name, v)} == DTYPES
                                          for v in versions), (name, lines)


def test_a_child_past_its_timeout_fails_only_the_test_that_waited_on_it():
    """cudachild.run kills a child at its timeout and hands back what it printed with returncode TIMED_OUT, so a
    shared fixture's children (sim_runs above) fail one module's test, not all of them with a TimeoutExpired."""
    r = cudachild.run("print('started', flush=True); import time; time.sleep(60)", sim=False, timeout=2)
    assert r.returncode == cudachild.TIMED_OUT and "started" in r.stdout and "ran past 2 s" in r.stderr, r
    with pytest.raises(pytest.fail.Exception, match="ran past 2 s"):
        cudachild.check(r)
