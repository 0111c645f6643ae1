"""benchmarks/gpu_all.sh, the one script a lent GPU machine runs, exercised here in its DRY mode (no GPU): the steps
that have a CPU stand-in run it (check's study in Numba's CUDA simulator, verify's dry run on the CPU), the bench
says it has no GPU, and the summary, exit status and report come out as on a GPU, so that a device's few minutes
are never spent on a broken script. The mains and the GPU tests, its other DRY steps, are the suite's own
(tests/test_cuda_cpusim.py, the tests themselves)."""
import os
import subprocess
import sys
import tarfile
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def _dry(out, steps, **env):
    """gpu_all.sh in DRY mode with `steps`, the GPU hidden (CUDA_VISIBLE_DEVICES empty), so that on a GPU machine
    too the bench finds none: (the finished process, summary.txt's text)."""
    full = {**os.environ, "DRY": "1", "OUT": str(out), "PYTHON": sys.executable, "STEPS": steps,
            "CUDA_VISIBLE_DEVICES": "", **env}
    res = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_all.sh")], env=full, capture_output=True,
                         text=True, timeout=600)
    return res, (out / "summary.txt").read_text()


def test_dry_run_passes_and_writes_its_report(tmp_path):
    res, summary = _dry(tmp_path, "warm verify check bench")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    for name in ("warm", "verify", "check"):
        assert f"\n{name}: rc=0," in summary, summary
    assert "bench: rc=2," in summary and "bench: SKIPPED without a GPU, as DRY expects" in summary, summary
    assert "total:" in summary and " 0 step(s) failed" in summary, summary
    # where the time went, quoted from the logs: warm's total; check's compiling (in DRY the Numba kernels run in
    # the simulator, which compiles nothing, and the check's study launches no CUDA C: zeros, yet said)
    files = len(list((ROOT / "kernels" / "cuda" / "csrc").glob("*.cu")))
    assert f"\nwarm: {files} files, 0 failed, " in summary, summary
    assert ("\ncheck: compile time of this check: Numba: 0.0 s compiling (0 compiler-lock holds); CUDA C: 0 files"
            in summary), summary
    with tarfile.open(tmp_path / "report.tgz") as t:
        names = set(t.getnames())
    assert {"report/precision.json", "report/verify/verify_noise_gpu.md", "report/bench.log"} <= names, names


def test_dry_run_counts_a_step_that_runs_out_of_time(tmp_path):
    """The exit status is the number of failed steps: verify given one second is cut off (rc 124), said so."""
    res, summary = _dry(tmp_path, "verify", T_VERIFY="1")
    assert res.returncode == 1, summary
    assert "verify: rc=124," in summary and "(TIMED OUT)" in summary and " 1 step(s) failed" in summary, summary


def test_warm_cache_builds_each_file_once_and_names_a_bad_one():
    """benchmarks/warm_cache.py (gpu_all.sh's warm step: every csrc file compiled once, in parallel, before the steps
    that load them) on the emulator, whose CPU libraries stand in for CuPy's cache: one line a file, exit 0; a file
    that is not there is refused by name before anything runs (argparse's exit status 2)."""
    env = {**os.environ, "REFBERT_CUDA_EMULATE": "1", "NUMBA_ENABLE_CUDASIM": "1"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "warm_cache.py"), "--jobs", "2"]
    res = subprocess.run(cmd + ["--only", "colsum.cu,dropout.cu"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert sorted(line.split(":")[0] for line in lines[:-1]) == ["colsum.cu", "dropout.cu"], res.stdout
    assert all(": compiled (" in line for line in lines[:-1]) and lines[-1].startswith("2 files, 0 failed"), lines
    res = subprocess.run(cmd + ["--only", "colsum.cu,nope.cu"], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "nope.cu" in res.stderr and "compiled" not in res.stdout, res.stdout + res.stderr
