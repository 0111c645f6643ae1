"""Every Numba CUDA kernel compiles for a real GPU (sm_90: H100 / H200), checked without one.

The simulator tests (test_cuda_*_sim.py) run the kernels as Python and never type them, so a kernel the simulator
runs can still fail Numba's CUDA typing or NVVM on the first real GPU. refbert_kernels.cuda.compile_check drives
every host wrapper of every CUDA spec, in fp64 / fp32 / fp16 / bf16 storage, with each launch replaced by
numba.cuda.compile_ptx (NVVM only, no driver). Runs in a child process (the real numba.cuda, not the simulator
this suite's other CUDA tests switch on in their own children), with 2 worker processes: ~30 s on 2 cores. Skips
when NVVM or NVRTC cannot be found (a machine without a CUDA toolkit's libnvvm; `pip install nvidia-cuda-nvrtc`,
in the dev extra, gives NVRTC).
"""
import importlib.util
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import cudachild

ROOT = Path(__file__).resolve().parents[1]


NEEDS = pytest.mark.skipif(importlib.util.find_spec("numba") is None or importlib.util.find_spec("numba_cuda") is None,
                           reason="numba-cuda not installed")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """One compile of every kernel, in 2 worker processes (NVVM's compiles are single-threaded), its PTX written
    out: (output, return code, {signature name: PTX})."""
    ptx_dir = tmp_path_factory.mktemp("ptx")
    res = subprocess.run([sys.executable, "-m", "refbert_kernels.cuda.compile_check", "--cc", "9.0", "--jobs", "2",
                          "--ptx-dir", str(ptx_dir)], capture_output=True, text=True,
                         env=cudachild.child_env(sim=False), cwd=ROOT, timeout=900)
    out = res.stdout + res.stderr
    ptx = {}
    if (ptx_dir / "index.txt").exists():
        for line in (ptx_dir / "index.txt").read_text().splitlines():
            file, name = line.split(" ", 1)
            ptx[name] = (ptx_dir / file).read_text()
    return out, res.returncode, ptx


def _skip_without_nvvm(out, ok):
    missing = re.search(r"DynamicLibNotFound.*|Failure finding.*|NvvmSupportError.*", out)  # a library not found,
    if ok == 0 and missing:                                                                # not a failed compile
        pytest.skip("NVVM / NVRTC not found: " + missing.group(0)[:200])


@NEEDS
def test_every_cuda_kernel_compiles_for_sm90(compiled):
    out, rc, ptx = compiled
    summary = re.search(r"(\d+) kernel signatures compiled for sm_90, (\d+) failed", out)
    assert summary, f"no summary line (rc {rc}):\n{out[-4000:]}"
    ok, failed = int(summary.group(1)), int(summary.group(2))
    _skip_without_nvvm(out, ok)
    assert failed == 0 and rc == 0, out[-8000:]
    assert " 0 spec/version/dtype/shape runs stopped in host code" in out, out[-8000:]   # no launch left unreached
    # (a wrapper that stopped launching would compile nothing and pass unseen)
    for name in ("softmax", "layernorm", "residual_layernorm", "dropout_residual_layernorm", "dropout", "gelu",
                 "bias_gelu", "cross_entropy", "attention", "embedding"):
        assert re.search(rf"^\s+{name}\s+v1 float32\s+[1-9]\d* kernel signatures", out, re.M), name
    # every version of every spec in every storage dtype, each reaching a kernel signature or more (bf16 needs
    # ml_dtypes, in the dev extra: were it missing, the bfloat16 lines would be too)
    lines = re.findall(r"^\s+(\w+)\s+v(\d+) (\w+)\s+(\d+) kernel signatures", out, re.M)
    dtypes = {}
    for name, v, dtype, n in lines:
        assert int(n) >= 1, (name, v, dtype)
        dtypes.setdefault((name, v), set()).add(dtype)
    assert len(dtypes) >= 20 and all(d == {"float64", "float32", "float16", "bfloat16"} for d in dtypes.values()), \
        dtypes
    assert ok >= 100 and len(ptx) == ok, f"{ok} kernel signatures compiled, {len(ptx)} PTX files"
    # what the workers spent compiling (kernels/cuda/compile_time.py): every signature compiled at least once in
    # some worker, each compile an outermost hold of Numba's compiler lock, so at least as many holds as signatures
    spent = re.search(r"Numba compiling in every process: ([\d.]+) s, (\d+) compiler-lock holds", out)
    assert spent and float(spent.group(1)) > 0 and int(spent.group(2)) >= ok, out[-2000:]


@NEEDS
def test_layernorm_backward_products_are_never_fused(compiled):
    """The layernorm family's backward computes wdy = dout * w with libdevice's round-to-nearest product
    (_common.mul_rn), which the compiler may not contract into an fma: PTX `mul.rn.f32` / `mul.rn.f64`. Without it
    a GPU gave dx = 2e-3 at C = 1 where the oracle's is exactly 0 (the first H200 run); the simulator cannot see it,
    so this looks at the PTX itself."""
    out, rc, ptx = compiled
    _skip_without_nvvm(out, len(ptx))
    backward = {k: p for k, p in ptx.items()      # names: "module.qualname (line N) signature"
                if k.startswith("refbert_kernels.cuda.layernorm.") and k.split(" (line")[0].endswith("backward")}
    assert len(backward) >= 24, sorted(backward)          # 2 versions x 3 ops x (f64, f32, f16, bf16 storage)
    for k, p in backward.items():
        assert "mul.rn.f32" in p or "mul.rn.f64" in p, k


@NEEDS
def test_a_progress_line_counts_what_its_version_reaches_not_what_is_new():
    """compile_check's line for a (spec, version, dtype) counts the kernel signatures that version launches, whether
    this process compiled them just now or before: the same in one process and in --jobs N's workers, which each
    run one spec. bias_gelu shares kernels with gelu: run after gelu in one run(), as --jobs 1 does, its lines must
    be those of a run of bias_gelu alone (counting only what was new, its version 2 said 0 after gelu, 4 alone)."""
    out = cudachild.check(cudachild.run("""
        import io
        from refbert_kernels.cuda import compile_check as CC
        lines = {}
        for names in (("gelu", "bias_gelu"), ("bias_gelu",)):
            got = []
            _, failures, _ = CC.run(out=io.StringIO(), names=names, dtypes=("float32",), lines=got)
            lines[names] = [line for (spec, _, _), line in got if spec == "bias_gelu"]
            print("FAILED", len(failures))
        print("SAME", lines[("gelu", "bias_gelu")] == lines[("bias_gelu",)])
        print("\\n".join(lines[("gelu", "bias_gelu")]))
    """, sim=False))
    _skip_without_nvvm(out, 1)
    assert out.count("FAILED 0") == 2 and "SAME True" in out, out
    counts = [int(n) for n in re.findall(r"bias_gelu\s+v\d+ float32\s+(\d+) kernel signatures", out)]
    assert len(counts) >= 2 and min(counts) >= 1, out


# What a kernel's closure holds, hashed as Numba's disk cache hashes it (numba.cuda.serialize.dumps of the cell
# values: the index key of a cached kernel), for every kernel compile_check's host wrappers reach at the simulator's
# shapes in every storage dtype; the compiles themselves stubbed (no NVVM needed)
_CLOSURES = """
import hashlib, json, sys
from numba import cuda
from numba.cuda import dispatcher as D
from numba.cuda.serialize import dumps
from refbert_kernels.cuda import compile_check as CC
cuda.compile_ptx = lambda f, sig, cc=None, **kw: ("", None)
seen, keys, bad, caches = set(), [], [], set()
hooks = CC._install_hooks

def install(cc, compiled, failures):
    hooks(cc, compiled, failures)
    launch = D.CUDADispatcher.__getitem__

    def getitem(self, cfg):
        if id(self) not in seen:
            seen.add(id(self))
            f = self.py_func
            name = f"{f.__module__}.{f.__qualname__}:{f.__code__.co_firstlineno}"
            caches.add(type(self._cache).__name__)
            try:
                cells = tuple(c.cell_contents for c in f.__closure__ or ())
                keys.append((name, hashlib.sha256(dumps(cells)).hexdigest()))
            except Exception as e:
                bad.append(f"{name}: {type(e).__name__}: {e}"[:300])
        return launch(self, cfg)
    D.CUDADispatcher.__getitem__ = getitem
CC._install_hooks = install
CC.run((9, 0), "sim", open("/dev/null", "w"))
print("CLOSURES " + json.dumps(dict(keys=keys, bad=bad, caches=sorted(caches))))
"""


@NEEDS
def test_every_kernels_closure_pickles_the_same_in_every_process(tmp_path):
    """REFBERT_NUMBA_CACHE=1 (kernels/cuda/_common.py) turns on Numba's disk cache, whose index key of a kernel holds a
    hash of its closure's pickled values: a value that does not pickle would fail the kernel's compile, and one that
    pickles differently from process to process would make every process miss what another cached. Two processes
    with the cache on (and different hash seeds) drive every host wrapper compile_check reaches (its hooks, compiles
    stubbed) and hash each kernel's closure: every kernel has Numba's disk cache, every closure pickles, and the two
    processes give the same hashes in the same order."""
    runs = []
    for seed in ("1", "2"):
        env = {**cudachild.child_env(sim=False), "REFBERT_NUMBA_CACHE": "1", "PYTHONHASHSEED": seed,
               "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
        r = subprocess.run([sys.executable, "-c", _CLOSURES], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600)
        out = cudachild.check(r)
        runs.append(json.loads(out.split("CLOSURES ", 1)[1].splitlines()[0]))
    assert runs[0]["bad"] == [] and runs[1]["bad"] == [], runs[0]["bad"][:5]
    assert runs[0]["caches"] == ["CUDACache"], runs[0]["caches"]
    assert len(runs[0]["keys"]) >= 100, len(runs[0]["keys"])
    assert runs[0]["keys"] == runs[1]["keys"], [a for a, b in zip(runs[0]["keys"], runs[1]["keys"]) if a != b][:5]


@NEEDS
def test_numba_cache_switch():
    """Off by default, a kernel made by jit_kernel has no disk cache; REFBERT_NUMBA_CACHE=1 gives it Numba's (the
    dispatcher's cache object, which makes no compile and needs no GPU); in the simulator the switch is off whatever
    the variable says (the simulator compiles nothing)."""
    code = """
        import os
        from refbert_kernels.cuda import _common as C
        k = C.column_sum_kernel("f32", "f32")
        print("CACHE", C.NUMBA_CACHE, type(getattr(k, "_cache", None)).__name__)
    """
    env = cudachild.child_env(sim=False)
    for value, sim, want in (("0", False, "CACHE False NullCache"), ("1", False, "CACHE True CUDACache"),
                             ("1", True, "CACHE False")):
        r = subprocess.run([sys.executable, "-c", cudachild.PRELUDE + textwrap.dedent(code)], cwd=ROOT,
                           env={**env, "REFBERT_NUMBA_CACHE": value, **({"NUMBA_ENABLE_CUDASIM": "1"} if sim else {})},
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert want in r.stdout, (value, sim, r.stdout)


@NEEDS
def test_numba_cache_round_trip_on_gpu(tmp_path):
    """benchmarks/numba_cache_check.py, gpu_all.sh's preflight for the cache, on a real GPU: a kernel compiled and
    cached by one process is loaded, not compiled, by the next, with the same output bits. Skipped without one."""
    r = cudachild.run("from numba import cuda\nassert cuda.is_available()", sim=False, timeout=120)
    if r.returncode:
        pytest.skip("needs a CUDA GPU (numba.cuda.is_available)")
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "numba_cache_check.py"), str(tmp_path / "c")],
                         capture_output=True, text=True, timeout=600, env=cudachild.child_env(sim=False), cwd=ROOT)
    assert res.returncode == 0 and "numba cache: ok" in res.stdout, res.stdout + res.stderr[-3000:]


@NEEDS
def test_numba_cache_saves_from_processes_at_once_keep_every_entry(tmp_path):
    """Four processes saving 40 entries each into one kernel's cache index at once, with refbert's lock on Numba's
    save (kernels/cuda/_common.py lock_numba_cache_saves, on wherever REFBERT_NUMBA_CACHE=1): all 160 kept, each key
    loading its own data. The control, without the lock, loses entries or mismatches them in one of three tries at
    least (Numba's save reads the index, takes the first free data file and writes, unlocked)."""
    from test_kernels_cache import saves_at_once
    run = saves_at_once(tmp_path, "numba.cuda.core.caching", "softmax.forward-144.py311", """
        from refbert_kernels.cuda import _common as C
        C.lock_numba_cache_saves()
    """, env=cudachild.child_env(sim=False))
    assert run("locked", "1") == (160, 0)
    assert any(run(f"bare{i}", "0") != (160, 0) for i in range(3))
