#!/usr/bin/env bash
# Everything refbert does on a GPU, in one go, for a lent H100 / H200 (CUDA 13, cupy-cuda13x, numba-cuda, PyTorch
# and nvcc installed there; no network). Run from anywhere:
#
#     OUT=/some/dir bash benchmarks/gpu_all.sh        (OUT defaults to ./gpu_out)
#
# Steps, each under its own timeout (seconds; the whole run stays well under 8 minutes), each logged to
# $OUT/<step>.log, one line per step in $OUT/summary.txt:
#   nvidia-smi       the device, first
#   install          pip install -e . --no-deps (offline); refbert_kernels is also put on PYTHONPATH through a
#                    symlink, so the steps work even where the editable install does not
#   env              versions of python, numpy, numba, numba-cuda, cupy, torch; the cuda backend's description
#   tests            pytest on the CUDA test files, real-GPU variants only (-k "gpu or cuda_c_matches_oracle": the Numba
#                    kernels, the whole model, training, DLPack, and the CUDA C kernels through CuPy)
#   check            the GPU half of refbert check --device cuda (python -m refbert.precision --device cuda): every
#                    CUDA kernel version against the oracle in fp64 / fp32 / fp16 / bf16, then the precision study
#                    (oracle and kernels, fp16 / bf16), JSON in $OUT
#   bench            refbert bench --device cuda: validate, then time every kernel version, PyTorch peers,
#                    probes (copy bandwidth, launch overhead), the pretraining step; md / JSON / PNG in $OUT/bench
# A step that fails or times out is recorded and the next one still runs; the exit status is the number of steps
# that failed (a failed install is not counted: PYTHONPATH serves instead). tests and check run side by side (they
# time nothing; the machine has cores to spare and Numba compiles on the CPU); bench runs alone after them.
# Overrides: PYTHON=..., SKIP_INSTALL=1, T_INSTALL=... T_ENV=... T_TESTS=... T_CHECK=... T_BENCH=... (seconds),
# BENCH_ARGS="...", STEPS="tests check bench" (a subset, in that order).
set -u
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
T_INSTALL=${T_INSTALL:-60}
T_ENV=${T_ENV:-45}
T_TESTS=${T_TESTS:-150}
T_CHECK=${T_CHECK:-90}
T_BENCH=${T_BENCH:-200}
STEPS=${STEPS:-"tests check bench"}
BENCH_ARGS=${BENCH_ARGS:-"--repeats 10 --attention-T 512 2048 --step-T 128 512"}
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
START=$(date +%s)

step() {            # step NAME TIMEOUT COMMAND...
    local name=$1 limit=$2 t0 rc
    shift 2
    t0=$(date +%s)
    echo "== $name (timeout ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    local msg="$name: rc=$rc, $(( $(date +%s) - t0 )) s"
    [ "$rc" = 124 ] && msg="$msg (TIMED OUT)"
    echo "$msg" | tee -a "$SUMMARY"
    tail -n 25 "$OUT/$name.log"
    return 0
}
wants() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }

echo "== nvidia-smi"
nvidia-smi 2>&1 | tee "$OUT/nvidia-smi.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv >> "$OUT/nvidia-smi.txt" 2>&1

# refbert_kernels is the installed name of kernels/ (setup.py package_dir): a symlink makes it importable without
# the install, and the repo root makes refbert importable
mkdir -p "$OUT/.pkgs"
ln -sfn "$ROOT/kernels" "$OUT/.pkgs/refbert_kernels"
export PYTHONPATH="$ROOT:$OUT/.pkgs${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONWARNINGS=ignore
unset NUMBA_ENABLE_CUDASIM

if [ -z "${SKIP_INSTALL:-}" ]; then
    step install "$T_INSTALL" "$PY" -m pip install --no-deps --no-build-isolation --no-index -e .
    if ! grep -q "^install: rc=0" "$SUMMARY"; then     # not fatal: PYTHONPATH above serves instead
        echo "install: failed, continuing with PYTHONPATH=$PYTHONPATH" | tee -a "$SUMMARY"
    fi
fi

step env "$T_ENV" "$PY" -c '
import importlib, sys
from importlib import metadata
print("python", sys.version.split()[0])
for d in ("numpy", "scipy", "numba", "numba-cuda", "cupy-cuda13x", "cupy-cuda12x", "ml_dtypes", "torch", "transformers"):
    try:
        print(d, metadata.version(d))
    except metadata.PackageNotFoundError:
        print(d, "-")
import cupy, torch
print("cupy runtime", cupy.cuda.runtime.runtimeGetVersion(), "devices", cupy.cuda.runtime.getDeviceCount())
print("torch cuda", torch.version.cuda, torch.cuda.is_available())
from refbert.model import get_backend
print(get_backend("cuda").describe())
'

# the real-GPU variants of every CUDA test file (each skips itself without a GPU; the selection leaves the simulator
# ones), side by side with the GPU half of refbert check --device cuda
TESTS=$(ls tests/test_cuda*.py 2>/dev/null | tr '\n' ' ')
if wants tests; then
    XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 6")    # pytest-xdist: the test children in parallel
    step tests "$T_TESTS" "$PY" -m pytest -q -rs -k "gpu or cuda_c_matches_oracle" -p no:cacheprovider \
        --durations=15 $XDIST $TESTS &
fi
if wants check; then    # the GPU half of `refbert check --device cuda` (the CPU half needs no GPU; CI runs it)
    step check "$T_CHECK" "$PY" -m refbert.precision --device cuda --json "$OUT/precision.json" &
fi
wait

# refbert bench --device cuda, alone on the machine
# shellcheck disable=SC2086
if wants bench; then
    if "$PY" -m refbert bench --help 2>/dev/null | grep -q -- "--device"; then
        step bench "$T_BENCH" "$PY" -m refbert bench --device cuda --out "$OUT/bench" $BENCH_ARGS
    else
        step bench "$T_BENCH" "$PY" -m refbert.bench_cuda --out "$OUT/bench" $BENCH_ARGS
    fi
fi

# failed steps, read back from the summary (the side-by-side steps ran in subshells); install does not count
FAILED=$(grep -E "^[a-z]+: rc=" "$SUMMARY" | grep -v "^install:" | grep -vc "rc=0,")
echo "total: $(( $(date +%s) - START )) s, $FAILED step(s) failed" | tee -a "$SUMMARY"
exit "$FAILED"
