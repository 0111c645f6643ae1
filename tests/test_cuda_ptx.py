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
import re
import subprocess
import sys
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
