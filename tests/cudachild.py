"""Child processes for the CUDA tests: Numba's CUDA simulator must be switched on (NUMBA_ENABLE_CUDASIM=1) before
numba.cuda is first imported and cannot be switched off afterwards, so every CUDA check runs in a child of its
own, with the simulator on (CI) or off (the real numba.cuda: a GPU, or NVVM alone for compile checks), and the
pytest process never imports numba.cuda."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (children once set sys.setswitchinterval(1e-4): the simulator's blocks polled their threads for barriers, holding
# the GIL; kernels/cuda/_common.py's event-driven blocks hand over at each barrier, and the default 5 ms is faster)
PRELUDE = "import sys\n"                              # (children's code may use sys)


def child_env(sim):
    """os.environ with the simulator switched on (sim) or off, warnings silenced."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    if sim:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    env["PYTHONWARNINGS"] = "ignore"
    return env


def run(code, sim=True, timeout=600):
    """python -c PRELUDE + code (dedented) in the repo root; the CompletedProcess. A child that runs past `timeout`
    seconds is killed and comes back as a CompletedProcess with returncode TIMED_OUT and what it printed, so that
    check() fails the one test that waited on it (children run side by side from a shared fixture would otherwise
    all error on one TimeoutExpired)."""
    args = [sys.executable, "-c", PRELUDE + textwrap.dedent(code)]
    try:
        return subprocess.run(args, cwd=ROOT, env=child_env(sim), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        text = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr)]
        return subprocess.CompletedProcess(args, TIMED_OUT, text[0], text[1] + f"\n(killed: ran past {timeout} s)")


TIMED_OUT = -9          # (the returncode of a child killed by SIGKILL, which subprocess.run's timeout sends)


def check(r):
    """The child's stdout; the test fails with the ends of both streams if it exited non-zero."""
    if r.returncode != 0:
        pytest.fail(f"subprocess failed (rc {r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    return r.stdout


def on(mode, code, timeout=600):
    """`code` (dedented already) in a child on the emulated GPU (mode "emu": CuPy and the GPU emulated on CPU
    threads, kernels/cuda/emulate.py; skipped without g++) or on a real one (mode "gpu": skipped without a CUDA GPU
    and CuPy) -> the child's stdout, the test failed if it exited non-zero."""
    if mode == "emu":
        if shutil.which("g++") is None:
            pytest.skip("needs g++ (the CUDA C kernels on CPU threads)")
        return check(run("import os\nos.environ['REFBERT_CUDA_EMULATE'] = '1'\n" + code, timeout=timeout))
    r = run("import cupy; assert cupy.cuda.runtime.getDeviceCount() > 0", sim=False, timeout=120)
    if r.returncode != 0:
        pytest.skip("needs a CUDA GPU with CuPy")
    return check(run(code, sim=False, timeout=timeout))
