#!/usr/bin/env bash
# Everything refbert does on a GPU, in one go, for a lent H100 / H200 (CUDA 13, cupy-cuda13x, numba-cuda, PyTorch,
# transformers and nvcc installed there; no network): the whole report in one run (421 s on the H200 at commit
# 2f0feb7, 492 s on the H100 at 719a3b9, each with steps cut short by the limits of then; at the limits below, 442 s
# on the H200 at b87c638, no step cut short: over issue 13's 6 minutes). Run from anywhere:
#
#     OUT=/some/dir bash benchmarks/gpu_all.sh        (OUT defaults to ./gpu_out; on the device machine: OUT=$OUT)
#
# Steps, each under its own timeout (seconds), each logged to report/<step>.log, one line per step in summary.txt:
#   preflight   FAILS EARLY (exit 3, nothing else runs) unless: nvidia-smi sees a GPU; python imports numpy, numba,
#               numba.cuda (with a GPU), cupy (a device), torch (CUDA), transformers; nvcc is on PATH. Versions and
#               the cuda backend's description go to report/env.txt. Beside it, benchmarks/numba_cache_check.py: if
#               a Numba kernel compiled and cached by one process is loaded by the next on this GPU, the run keeps
#               its Numba kernels in a disk cache of its own (REFBERT_NUMBA_CACHE=1, NUMBA_CACHE_DIR a fresh temp
#               directory), so its processes stop compiling the same kernels over and over; if not, each compiles
#               as before (report/numba_cache.txt, a line in summary.txt either way). Written 2026-12-07, not yet
#               run on a GPU.
#   mains       every kernels/cuda/csrc/*.cu built standalone (nvcc -O3 -arch=sm_90) and run: each main validates
#               every version against its CPU reference, then times it (the kernels' own report); the 16-bit
#               attention mains a second time without dropout ("512 0": their kernels for p = 0)
#   warm        benchmarks/warm_cache.py: every csrc/*.cu compiled by NVRTC into CuPy's on-disk kernel cache, a
#               process a file, the largest first, beside the steps that need them: each file's compile holds a lock
#               (kernels/cuda/cuda_c.py compile_lock), so a process that needs a file being compiled waits and loads
#               it, where before every step compiled what it used itself (`refbert check` all twelve files; nvcc -O3
#               takes 128 s for them in one thread on the project's CPU, 38.6 s the largest). Written 2026-12-07,
#               not yet timed on a GPU
#   tests       pytest on the CUDA test files, real-GPU variants only (-k "gpu or cuda_c_matches_oracle": every
#               Numba version incl. attention's, every CUDA C version through versions.validate, the whole model
#               equal to the numpy backend with what ran asserted, training, DLPack)
#   check       the GPU half of refbert check --device cuda (python -m refbert.precision --device cuda): every CUDA
#               kernel version against the oracle in fp64 / fp32 / fp16 / bf16, then the precision study; beside
#               it (step "study") the mixed-precision step study: the GPU's float32 / bf16 / fp16 steps against
#               float64, beside the spec's and HF autocast's (report/precision_step.md)
#   verify      benchmarks/verify_noise_gpu.py --sizes $VERIFY_SIZES (tiny,mini): `refbert verify` judging torch's
#               own GPU dumps (float64, float32, float32 with TF32, float16, bfloat16) in units of refbert's noise
#   graphdiag   (not in the default STEPS: STEPS="... graphdiag ..." runs it) benchmarks/graph_diag.py: the small
#               model whose CUDA graphs replayed NaN on the H100 before their slots moved out of the capture, replay
#               by replay, then op by op (--trace: the first op whose replayed output differs from the eager one);
#               on the H100 at 719a3b9 every replay equalled its eager step, so it no longer shares the machine with
#               every run
#   train       benchmarks/mixed_train.py --backend cuda --cuda-graph --steps $TRAIN_STEPS (300): `refbert pretrain
#               --backend cuda --cuda-graph` (each step one CUDA graph replay; eager if the graph is refused)
#               on the demo corpus in fp32, bf16-mixed and fp16-mixed, the held-out losses side by side (issue 14:
#               bf16-mixed within 2% of fp32), and each run trained again by HF + PyTorch on its data and initial
#               weights (--torch-peer: benchmarks/torch_pretrain.py; issue 13: refbert's faster?)
#   bench       python -m refbert.bench_cuda: kernels (validated, timed, PyTorch peers, cuda_order.json), the
#               training step at B=32 T=128 and B=8 T=512 against HF sdpa / eager with the GEMM floor and memory,
#               the mixed-precision step (bf16-mixed, fp16-mixed) against HF sdpa under torch.autocast with the
#               16-bit GEMM floor, the optimizer step (clip + AdamW: refbert's multi-tensor kernels and per-array
#               code against torch.optim.AdamW foreach / fused), the launch probe with the step's own arguments
#               (each kernel as the model launches it, launch version 2, and through CuPy's RawKernel call),
#               the torch.profiler table
#               (The mixed section's A/B rows time the bf16-mixed graph step with the attention as S3's and S4's
#               tensor-core flash kernels, csrc/mixed.cu s3_* / s4_*, beside the default S2: in the same run, where
#               a separate s3 step used to run the whole section again.)
#   ncu         Nsight Compute (where installed; --clock-control none) on one call of each flash attention
#               version's forward and backward at B=4 H=12 T=2048 (benchmarks/ncu_attention.py): speed of light,
#               tensor-pipe and shared-memory load, bank conflicts, stall reasons, occupancy: report/ncu.log
# mains, tests, check, verify and train run side by side (they time nothing that is reported; 16 cores, each
# process's BLAS, OpenMP and Numba threads capped: CPU_THREADS, 4, and one a pytest worker; Numba compiles on the
# CPU); bench runs alone after them, its threads uncapped. A step that fails or times out is recorded and the next
# one still runs; the exit status is the number of failed steps. Beside each step's line, summary.txt quotes where
# the time went (issue 13's 6 minutes, "the numba compile included"; kernels/cuda/compile_time.py): the mains'
# build and each main's seconds (an attention main's second run after a +), train's runs and their peers', warm's
# total, check's and study's compile time (Numba's kernels, the CUDA C modules and the waits for their locks) and the
# bench's sections ("bench sections: ...", each with its compiling in cuda_probes.md, which report.tgz holds; a
# bench cut off before that line: the lines of the sections it finished).
# What comes back is at most 8 files in $OUT:
# summary.txt, report.tgz (every log and result file), and, for reading without unpacking, cuda_step.md,
# cuda_mixed.md, cuda_profile.md, cuda_kernels.md, cuda_order.json and mains.txt.
# Overrides: PYTHON=..., T_MAINS=... T_WARM=... T_TESTS=... T_CHECK=... T_VERIFY=... T_TRAIN=... T_BENCH=...
# T_NCU=... (s), BENCH_ARGS="...", TRAIN_STEPS=..., CPU_THREADS=..., STEPS="mains warm tests check verify train bench
# ncu" (a subset, or more: graphdiag). DRY=1:
# the plumbing on a machine without a GPU (no preflight, the mains on CPU threads through csrc/cpusim.cuh, warm
# builds the emulator's libraries, the GPU tests skip, check's study runs the Numba CUDA kernels in Numba's
# simulator, verify its own dry run on the CPU, the bench says SKIPPED (not counted as a failure), train, study,
# graphdiag and ncu are skipped): exit status 0 when all of that works.
set -u
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
R="$OUT/report"
rm -rf "$R"
mkdir -p "$R"
PY=${PYTHON:-python3}
# (limits as measured on the H200, 2026-11-27, commit 2f0feb7: the parallel steps share 16 cores, Numba compiling
# in each; all together, mains, train and check ran past 120, 180 and 200 s; run again, four side by side, mains
# took 126 s, train 151, check 175; tests 166 s, bench 172, ncu 35 (since then the bench validates the attention in
# float16 too and times C5's backward versions 6 and 7 beside 5, and ncu profiles those two: 230 and 80 s given).
# On the H100 at 719a3b9 (2026-11-28), seven steps side by side (graphdiag among them) and every process's BLAS
# threads as many as the cores: mains 221 s, tests 228, verify 91, study 119, graphdiag 124, and check and train
# cut off at 240 (train in its third of three runs); bench 186 (its CUDA graph rows failing at once), ncu 48.
# Hence graphdiag out of the default steps, the threads capped, check and train 260 s, ncu 60, and the bench 240
# (its graph rows run again, and an A/B row of C6's backward version 4 beside version 6 came in).
# Worst case with these, each stage's 5 s of --kill-after counted, after a preflight of the usual ~17 s:
# 17 + 265 + 245 + 65 = 592 s, inside one 600-s device call (the preflight may take up to 120 s: then it is not))
# (At b87c638, H200, 2026-11-28, no step was cut: mains 142 s, tests 147, check 171, train 182, bench 195, ncu 49.)
T_MAINS=${T_MAINS:-240}
T_WARM=${T_WARM:-240}
T_TESTS=${T_TESTS:-240}
T_CHECK=${T_CHECK:-260}
T_BENCH=${T_BENCH:-240}
T_VERIFY=${T_VERIFY:-150}
T_TRAIN=${T_TRAIN:-260}
T_NCU=${T_NCU:-60}
CPU_THREADS=${CPU_THREADS:-4}
TRAIN_STEPS=${TRAIN_STEPS:-300}
VERIFY_SIZES=${VERIFY_SIZES:-tiny,mini}
STEPS=${STEPS:-"mains warm tests check verify train bench ncu"}
BENCH_ARGS=${BENCH_ARGS:-"--repeats 10 --attention-T 128 512 2048 --step 32x128 8x512 --validate-dtypes float32 --only kernels step mixed optim profile"}
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
START=$(date +%s)

step() {            # step NAME TIMEOUT COMMAND...
    local name=$1 limit=$2 t0 rc
    shift 2
    t0=$(date +%s)
    echo "== $name (timeout ${limit}s): $*"
    timeout --kill-after=5 "$limit" "$@" > "$R/$name.log" 2>&1
    rc=$?
    local msg="$name: rc=$rc, $(( $(date +%s) - t0 )) s"
    [ "$rc" = 124 ] && msg="$msg (TIMED OUT)"
    echo "$msg" | tee -a "$SUMMARY"
    tail -n 25 "$R/$name.log"
    return 0
}
wants() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
finish() {          # the report: one tarball and the files worth reading at once (at most 8 in $OUT)
    for f in bench/cuda_step.md bench/cuda_mixed.md bench/cuda_profile.md bench/cuda_kernels.md \
             bench/cuda_order.json; do
        [ -f "$R/$f" ] && cp "$R/$f" "$OUT/"
    done
    [ -f "$R/mains.log" ] && grep -E "^==|FAILED|mismatch|every version ok|bit for bit|skipped|TFLOP|GB/s| ms" "$R/mains.log" > "$OUT/mains.txt"
    tar czf "$OUT/report.tgz" -C "$OUT" report && rm -rf "$R" "$PKGS" "${NCACHE:-}"
    echo "report: $(ls "$OUT" | tr '\n' ' ')"
}

# refbert_kernels is the installed name of kernels/ (setup.py package_dir): a symlink makes it importable without
# an install, and the repo root makes refbert importable
PKGS=$(mktemp -d)                                   # (outside $OUT: a symlink would not come back)
ln -sfn "$ROOT/kernels" "$PKGS/refbert_kernels"
export PYTHONPATH="$ROOT:$PKGS${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONWARNINGS=ignore
unset NUMBA_ENABLE_CUDASIM REFBERT_CUDA_EMULATE REFBERT_CUDA_VERSIONS REFBERT_CUDA_ORDER \
    REFBERT_NUMBA_CACHE NUMBA_CACHE_DIR          # (the Numba cache only as this run's preflight decides, below)

# ---- preflight: an environment problem stops everything here, loudly
if [ -n "${DRY:-}" ]; then
    echo "preflight: skipped (DRY=1: no GPU expected)" | tee -a "$SUMMARY"
else
{ nvidia-smi; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; } \
    > "$R/nvidia-smi.txt" 2>&1
if ! nvidia-smi -L 2>/dev/null | grep -q "GPU 0"; then
    echo "preflight: FAILED, nvidia-smi sees no GPU" | tee -a "$SUMMARY"; cat "$R/nvidia-smi.txt"; finish; exit 3
fi
if ! command -v nvcc > /dev/null; then
    echo "preflight: FAILED, nvcc is not on PATH (the standalone mains need it)" | tee -a "$SUMMARY"; finish; exit 3
fi
NCACHE=$(mktemp -d)     # Numba's disk cache for this run, if the check beside the environment's finds it works here
timeout -k 5 90 "$PY" benchmarks/numba_cache_check.py "$NCACHE/check" > "$R/numba_cache.txt" 2>&1 &
NCACHE_PID=$!
if ! timeout 120 "$PY" - > "$R/env.txt" 2>&1 <<'PYEOF'
import sys
from importlib import metadata
print("python", sys.version.split()[0])
for d in ("numpy", "scipy", "numba", "numba-cuda", "cupy-cuda13x", "cupy-cuda12x", "ml_dtypes", "torch",
          "transformers", "pytest", "pytest-xdist"):
    try:
        print(d, metadata.version(d))
    except metadata.PackageNotFoundError:
        print(d, "-")
problems = []
try:
    import refbert_kernels.cuda                      # (its NumPy 2.5 fix for numba-cuda, before any compile)
    from numba import cuda
    if not cuda.is_available():
        problems.append("numba.cuda.is_available() is False")
except Exception as e:
    problems.append(f"numba / numba-cuda: {type(e).__name__}: {e}")
try:
    import cupy
    print("cupy runtime", cupy.cuda.runtime.runtimeGetVersion(), "devices", cupy.cuda.runtime.getDeviceCount())
    (cupy.arange(4, dtype=cupy.float32) * 2).get()
except Exception as e:
    problems.append(f"cupy: {type(e).__name__}: {e}")
try:
    import torch
    print("torch cuda", torch.version.cuda, torch.cuda.is_available())
    if not torch.cuda.is_available():
        problems.append("torch.cuda.is_available() is False")
    import transformers  # noqa: F401
except Exception as e:
    problems.append(f"torch / transformers: {type(e).__name__}: {e}")
try:
    from refbert.model import get_backend
    b = get_backend("cuda")
    print(b.describe())
    from refbert_kernels.cuda import cuda_c as K
    K.module("colsum.cu")                              # NVRTC compiles a CUDA C file through CuPy
except Exception as e:
    problems.append(f"refbert's cuda backend: {type(e).__name__}: {e}")
if not problems:                  # launch version 2 (packed parameters) against CuPy's call on one kernel
    import numpy as np
    got = {}
    for v in ("1", "2"):
        try:
            K.LAUNCH = v
            k = K.kernel("colsum.cu", "colsum_partial_v1")
            if (v == "2") != isinstance(k, K.Packed):
                raise RuntimeError(f"REFBERT_LAUNCH={v} made a {type(k).__name__} ({K.LAUNCH_FELL_BACK})")
            x = cupy.asarray(np.random.default_rng(0).standard_normal((300, 70)).astype(np.float32))
            parts = cupy.zeros((3, 70), cupy.float32)
            k((1, 3), (256,), (x, np.int32(300), np.int32(70), np.int32(100), parts))
            got[v] = parts.get()
        except Exception as e:
            print(f"launch version {v}: FAILED ({type(e).__name__}: {e})")
    K.LAUNCH = "2"
    if "1" not in got:
        problems.append("a CUDA C kernel through CuPy's RawKernel call (launch version 1) failed")
    elif "2" in got:
        want = x.get().reshape(3, 100, 70).sum(axis=1, dtype=np.float64)
        if got["1"].tobytes() != got["2"].tobytes() or not np.allclose(got["2"], want, rtol=1e-5, atol=1e-4):
            print(f"launch version 2: FAILED (its sums differ from CuPy's call's by up to "
                  f"{float(np.abs(got['1'] - got['2']).max())}, from float64's by "
                  f"{float(np.abs(got['2'] - want).max())})")
        else:
            print("launch version 2: ok (the same bits as CuPy's RawKernel call, float64's sums within 1e-5)")
if problems:
    print("PREFLIGHT PROBLEMS:\n  " + "\n  ".join(problems))
    sys.exit(1)
print("preflight ok")
PYEOF
then
    echo "preflight: FAILED (report/env.txt):" | tee -a "$SUMMARY"; tail -n 20 "$R/env.txt" | tee -a "$SUMMARY"
    kill "$NCACHE_PID" 2> /dev/null; wait "$NCACHE_PID" 2> /dev/null
    finish; exit 3
fi
if wait "$NCACHE_PID"; then        # the run's processes share their Numba compiles (a timeout: 124, compiles as before)
    export REFBERT_NUMBA_CACHE=1 NUMBA_CACHE_DIR="$NCACHE/run"
    echo "preflight: $(tail -n 1 "$R/numba_cache.txt"); the run keeps its Numba kernels in a disk cache" \
        "(REFBERT_NUMBA_CACHE=1)" | tee -a "$SUMMARY"
else
    echo "preflight: $(tail -n 1 "$R/numba_cache.txt"); the run compiles its Numba kernels in each process" \
        | tee -a "$SUMMARY"
fi
echo "preflight: ok, $(( $(date +%s) - START )) s" | tee -a "$SUMMARY"
if grep -q "^launch version 2: FAILED" "$R/env.txt"; then     # the rest of the run launches as CuPy does
    export REFBERT_LAUNCH=1
    echo "preflight: $(grep '^launch version 2: FAILED' "$R/env.txt"); the run pins REFBERT_LAUNCH=1" \
        | tee -a "$SUMMARY"
fi
fi

# ---- the standalone mains, the GPU tests and the GPU half of check, side by side, each process's CPU threads capped
# (seven processes, a pytest worker each of ten among them, each with as many BLAS threads as the 16 cores, had
# check and train run out of time on the H100)
export OMP_NUM_THREADS=$CPU_THREADS OPENBLAS_NUM_THREADS=$CPU_THREADS MKL_NUM_THREADS=$CPU_THREADS \
    NUMBA_NUM_THREADS=$CPU_THREADS
mains() {
    local dir="$R/mains" rc=0 src
    mkdir -p "$dir"
    local cc="nvcc -O3 -arch=sm_90 -std=c++17"
    [ -n "${DRY:-}" ] && cc="g++ -std=c++20 -O1 -pthread -ffp-contract=off -DCPUSIM -DCPUSIM_SMALL -DCPUSIM_HALF -x c++"
    local t0 times
    t0=$(date +%s)
    ls kernels/cuda/csrc/*.cu | xargs -P 9 -I{} sh -c \
        "$cc"' -Ikernels/cuda/csrc -o "$0/$(basename {} .cu)" {} > "$0/$(basename {} .cu).build" 2>&1' "$dir"
    times="build $(( $(date +%s) - t0 )) s"       # (where the step's time goes: the summary quotes the last line)
    echo "mains times: $times"
    local again="512 0"                             # the attention mains again without dropout (their kernels
    [ -n "${DRY:-}" ] && again="72 0"                # for p = 0: the forward's v6, the backward's v8, fp32's v8)
    for src in kernels/cuda/csrc/*.cu; do
        local name; name=$(basename "$src" .cu)
        echo "== $name"
        cat "$dir/$name.build"
        t0=$(date +%s)
        if [ -x "$dir/$name" ]; then "$dir/$name" || { echo "MAIN FAILED $name (rc $?)"; rc=1; }
        else echo "BUILD FAILED $name"; rc=1; fi
        times="$times, $name $(( $(date +%s) - t0 ))"
        if [ -x "$dir/$name" ] && [ "${name#attention_}" != "$name" ]; then
            echo "== $name $again"
            t0=$(date +%s)
            # shellcheck disable=SC2086
            "$dir/$name" $again || { echo "MAIN FAILED $name $again (rc $?)"; rc=1; }
            times="$times+$(( $(date +%s) - t0 ))"
        fi
        times="$times s"
        echo "mains times: $times"                  # (so far: the summary quotes the last, as far as the step got)
    done
    return $rc
}
if wants mains; then
    step mains "$T_MAINS" bash -c "R='$R'; DRY='${DRY:-}'; $(declare -f mains); mains" &
fi
if wants warm; then   # every .cu compiled at once, a process a file, into CuPy's disk cache; the steps beside it
    # wait on each file's compile lock (cuda_c.compile_lock) and load what it compiled (DRY: the emulator's CPU
    # libraries instead, two processes)
    if [ -n "${DRY:-}" ]; then
        step warm "$T_WARM" env REFBERT_CUDA_EMULATE=1 NUMBA_ENABLE_CUDASIM=1 "$PY" benchmarks/warm_cache.py --jobs 2 &
    else
        step warm "$T_WARM" "$PY" benchmarks/warm_cache.py --jobs 12 &
    fi
fi
if wants tests; then
    XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 10")    # pytest-xdist: the test children in parallel
    # shellcheck disable=SC2046
    step tests "$T_TESTS" env OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 NUMBA_NUM_THREADS=1 \
        "$PY" -m pytest -q -rs -k "gpu or cuda_c_matches_oracle" -p no:cacheprovider \
        --durations=15 $XDIST $(ls tests/test_cuda*.py) &
fi
if wants verify; then   # refbert verify against torch's own GPU dumps (benchmarks/verify_noise_gpu.py; rows as they come)
    if [ -n "${DRY:-}" ]; then     # DRY: the script's own dry run (torch on the CPU, the tiny model)
        step verify "$T_VERIFY" "$PY" benchmarks/verify_noise_gpu.py --out "$R/verify" --sizes tiny --device cpu &
    else
        step verify "$T_VERIFY" "$PY" benchmarks/verify_noise_gpu.py --out "$R/verify" --sizes "$VERIFY_SIZES" &
    fi
fi
if wants graphdiag && [ -z "${DRY:-}" ]; then   # the small model's CUDA graph fault, replay by replay and op by op
    step graphdiag "$T_TRAIN" bash -c "'$PY' benchmarks/graph_diag.py; '$PY' benchmarks/graph_diag.py --trace; \
        '$PY' benchmarks/graph_diag.py --trace --labelled 3 --precisions fp32; \
        REFBERT_GRAPH_SLOTS_IN_CAPTURE=1 '$PY' benchmarks/graph_diag.py; \
        REFBERT_GRAPH_NO_REUSE=1 '$PY' benchmarks/graph_diag.py; \
        REFBERT_BLAS_ZERO_OUT=1 '$PY' benchmarks/graph_diag.py; \
        '$PY' benchmarks/graph_diag.py --poison" &
fi
if wants train && [ -z "${DRY:-}" ]; then    # the demo corpus trained on the GPU in each precision (losses side by side)
    step train "$T_TRAIN" "$PY" benchmarks/mixed_train.py --backend cuda --cuda-graph --torch-peer \
        --steps "$TRAIN_STEPS" --out "$R/mixed_train_cuda.md" &
fi
if wants check; then    # the GPU half of `refbert check --device cuda` (the CPU half needs no GPU; CI runs it)
    # (DRY: the same study of the Numba CUDA kernels in Numba's CUDA simulator)
    step check "$T_CHECK" env ${DRY:+NUMBA_ENABLE_CUDASIM=1} "$PY" -m refbert.precision --device cuda --no-step \
        --json "$R/precision.json" &
    # its mixed-precision step study (the GPU's float32 / bf16 / fp16 steps against float64 beside the spec's and
    # HF autocast's), alongside
    [ -z "${DRY:-}" ] && step study "$T_CHECK" "$PY" -m refbert.precision --device cuda --no-validate --no-ops \
        --json "$R/precision_step.json" --report "$R/precision_step.md" &
fi
wait
unset OMP_NUM_THREADS OPENBLAS_NUM_THREADS MKL_NUM_THREADS NUMBA_NUM_THREADS
quote() {           # quote STEP PATTERN [all]: a log's last line saying where a step's time went (every such line
    # with "all"), into the summary (the mains and train print theirs after each part: a step cut off keeps its last)
    [ -f "$R/$1.log" ] || return 0
    if [ "${3:-}" = all ]; then grep -E "$2" "$R/$1.log"; else grep -E "$2" "$R/$1.log" | tail -n 1; fi \
        | sed "s/^/$1: /" | tee -a "$SUMMARY"
    return 0
}
quote warm "^[0-9]+ files, [0-9]+ failed"
quote mains "^mains times:"
quote train "^train times:"
quote check "^compile time of this check:"
quote study "^compile time of this check:"

# ---- the bench, alone on the machine
if wants bench; then
    # shellcheck disable=SC2086
    step bench "$T_BENCH" "$PY" -m refbert.bench_cuda --out "$R/bench" $BENCH_ARGS
    if grep -q "^bench sections:" "$R/bench.log" 2>/dev/null; then
        quote bench "^bench sections:"
    else            # (cut off or failed before its last line: the sections it finished, as they were printed)
        quote bench "^== .*: [0-9.]+ s \(compiling" all
    fi
fi

if wants ncu && [ -z "${DRY:-}" ]; then   # where the flash kernels' time goes: Nsight Compute's counters, one call each
    if command -v ncu > /dev/null; then
        step ncu "$T_NCU" ncu --clock-control none -k 'regex:^attn_(fwd|bwd_(dkdv|dq|fused))' \
            --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
            --section MemoryWorkloadAnalysis_Tables --section Occupancy --section LaunchStats \
            --section WarpStateStats --section InstructionStats "$PY" benchmarks/ncu_attention.py
    else
        echo "ncu: not on PATH, skipped" | tee -a "$SUMMARY"
    fi
fi

FAILED=$(grep -E "^[a-z]+: rc=" "$SUMMARY" | grep -vc "rc=0,")
if [ -n "${DRY:-}" ] && grep -q "^bench: rc=2," "$SUMMARY" && grep -q "SKIPPED, no GPU" "$R/bench.log" 2>/dev/null; then
    FAILED=$((FAILED - 1))          # DRY: the bench saying it has no GPU is what it should say
    echo "bench: SKIPPED without a GPU, as DRY expects" | tee -a "$SUMMARY"
fi
echo "total: $(( $(date +%s) - START )) s, $FAILED step(s) failed" | tee -a "$SUMMARY"
finish
exit "$FAILED"
