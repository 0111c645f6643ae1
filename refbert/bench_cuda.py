"""`refbert bench --device cuda`: validate, then time, refbert's CUDA kernels and its pretraining step on a GPU,
against PyTorch on the same GPU and the same inputs.

    refbert bench --device cuda [--quick] [--only kernels step profile] [--out DIR] [--repeats N]
                               [--kernels NAME ...] [--attention-T 512 2048] [--step 32x128 8x512] [--no-torch]
    python -m refbert.bench_cuda ... (the same, with every option)

Sections, written as cuda_<name>.md / .json / .png under --out (default benchmarks/results/cuda-<device>), the
device, the library versions and the command line in each header:

probes   the device's copy bandwidth (a CuPy device-to-device copy of a 1 GiB buffer: 2 bytes moved per byte,
         median of repeats), which every GB/s figure is a percentage of; the launch overhead, reported apart from
         the kernels: empty Numba and CuPy kernels, and (step section) every CUDA C kernel one training step
         launches, replayed with the step's own argument lists: host microseconds per launch. Rewritten at the
         end with where the run's wall time went (Spent): each section's seconds, the kernel section's op by op,
         and how much of each was compiling (Numba's kernels, the CUDA C modules; the last line of the output
         says the same in one line, "bench sections: ...", which gpu_all.sh copies into its summary).
kernels  every KernelSpec of every refbert_kernels.cuda module with its CUDA C versions (C1, C2: the versions
         kernels/cuda/versions.py knows): each version is validated against its oracle first (GPU shapes, in every
         dtype it is timed in and the --validate-dtypes; a version over tolerance is FAIL and never timed), then
         timed at the spec's bench_shape on CuPy arrays (attention: B=8, H=12, hs=64 at each --attention-T: B*H =
         96, issue 13's shapes): forward, and backward on one cached forward, each the median of --repeats
         CUDA-event timings after 2 warm-up calls, with the L2 cache flushed (a 256 MiB buffer written) before
         every timed call, twice: as called (events around the call, its host work included) and on the device
         alone (the call's launches queued while a blocking kernel holds the stream, nvbench's method: what a small
         kernel costs inside a CUDA graph or a busy stream, without its launch); GB/s of a napkin byte count, % of
         the copy bandwidth (of the device times where a call has them); attention TFLOP/s (4 B H T^2 hs forward,
         2.5x that backward). PyTorch peers on the same inputs (zero-copy through
         DLPack): F.softmax, F.layer_norm, F.gelu, F.dropout, F.cross_entropy, F.scaled_dot_product_attention (flash
         without a mask in float16, memory-efficient with the padding mask). The passing versions' float32 times
         order each op's versions (forward + backward on the device alone where a call has both, else as called:
         order_seconds; every Numba version after every other: versions.rank): cuda_order.json
         (REFBERT_CUDA_ORDER=<that file> makes the backend use it; the sections after it in the same run use it,
         unless REFBERT_CUDA_ORDER was set already).
step     one BertForPreTraining training step (forward + backward; train mode, dropout 0.1, MLM + NSP loss) at
         base size and training batches (--step, default B=32 T=128 and B=8 T=512: 4096 tokens each), float32 with
         TF32 off on both sides: refbert backend="cuda" with HF's full logits (mlm_decode "all") and with its labelled
         decoder ("labelled"), against HF transformers + PyTorch with attn_implementation "sdpa" (its default) and
         "eager", same weights (an HF model with random weights saved to a temp dir, refbert loaded from it) and
         batch; the eval losses of refbert and HF compared first. Beside each: the fp32 GEMM floor (the same step's
         matrix products alone on cuBLAS, step_gemms(), timed in the same run), the memory held after the forward
         (what the backward will read), and the ratios against sdpa and the floor. No optimizer update. Beside the
         first: the same step with the adds around the linears unfused (an A/B row: the bias after the GEMM, the
         gradient paths added by the model). The mixed section likewise times bf16-mixed's graph without twins,
         and with the attention as S3's and S4's flash kernels (REFBERT_MIXED_ATTENTION's choices) instead of S2,
         and with the residual layernorms' forward as layernorm.cu's version 2 (REFBERT_MIXED_LN=2) instead of 3,
         and with the layernorms' backward as version 6's one pass (REFBERT_MIXED_LN_BWD=6) instead of 2's kernels,
         and with the bias + GELU backward as gelu.cu's version 2 (REFBERT_MIXED_GELU_BWD=2) instead of 1, and
         with the GELUs' forward as gelu.cu's version 3 (REFBERT_MIXED_GELU_FWD=3) instead of 1.
optim    the optimizer's step on the model's parameters (base: 110M in ~200 tensors, float32): clip_grad_norm to 1
         and AdamW.step, as pretrain runs them, by refbert's multi-tensor kernels (csrc/optim.cu, through
         refbert.optim) and by its per-array code (REFBERT_FUSED_OPTIM=0: the spec's ~15 launches a tensor) on the
         same device arrays, against torch.optim.AdamW (foreach and fused) with torch.nn.utils.clip_grad_norm_ on
         tensors of the same shapes; the kernels' update first checked equal to the per-array code's bit for bit (on
         copies, one step). Each the median of CUDA-event timings around the whole call, host work included (the
         per-array code is host-bound: that is what it costs a training step).
profile  torch.profiler (CUPTI: it sees CuPy's and Numba's kernels too) over a few steps at the first --step shape:
         for refbert (both decoders) and HF sdpa, the device time per kernel name, launches per step (kernel, copy
         and memset events), GPU-busy time against wall time per step.
The backend's version choices and every fallback are printed and written; a validation failure, a fallback or a
failed loss check makes the exit status 1 (every file is still written).

Without a GPU (or without CuPy) main() prints why and returns 2; the pieces that need no GPU (argument parsing,
the FLOP, byte and GEMM formulas, the profile aggregation, the tables) are tested in tests/test_cuda_backend_sim.py.
"""
import argparse
import contextlib
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time

import numpy as np

DEFAULT_OUT = os.path.join("benchmarks", "results")
FLUSH_BYTES = 256 * 2 ** 20          # written between timed calls: larger than any GPU's L2 (H100 50 MB, H200 60)
COPY_BYTES = 2 ** 30                 # the copy-bandwidth probe's buffer
STEPS = [(32, 128), (8, 512)]        # base pretraining batches: 4096 tokens each
STEP_TOKENS = 4096
ATTENTION = dict(B=8, H=12, hs=64)     # B*H = 96: issue 13's fp32 attention target is at B*H >= 96
MODULES = ("softmax", "layernorm", "dropout", "gelu", "cross_entropy", "attention", "embedding")


# ----------------------------------------------------------------------------------------------------------------
# formulas and formatting (no GPU needed)

def attention_flops(B, H, T, hs, backward=False):
    """Matmul FLOPs of attention: forward q k^T and p v, 2 * 2 B H T^2 hs; the backward 2.5x that (dv, dp, dq, dk,
    and the recomputation of the scores in a flash backward: FlashAttention-2's count)."""
    f = 4.0 * B * H * T * T * hs
    return 2.5 * f if backward else f


def gbps(nbytes, seconds):
    return nbytes / seconds / 1e9 if seconds and seconds > 0 and nbytes else None


def tflops(flops, seconds):
    return flops / seconds / 1e12 if seconds and seconds > 0 and flops else None


def pct(x, ref):
    return 100.0 * x / ref if x is not None and ref else None


def slug(name):
    """A folder-safe device name: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", str(name).lower()).strip("-") or "gpu"


def fmt(x, spec=".3g", none="—"):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return none
    return format(x, spec)


def md_table(head, rows):
    """Markdown table lines."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + \
        ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def shape_str(shape):
    return ", ".join(f"{k}={v}" for k, v in shape.items() if k not in ("mask",)) if isinstance(shape, dict) \
        else str(shape)


def add_arguments(p):
    from .argtypes import positive
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)      # set by `refbert bench --device cuda`
    p.add_argument("--quick", action="store_true", help="a tooling check: few repeats, small shapes, B=4 T=128 only")
    p.add_argument("--only", nargs="+", choices=["kernels", "precision", "step", "mixed", "optim", "profile"],
                   help="run only these sections (probes always)")
    p.add_argument("--out", help=f"results folder (default {DEFAULT_OUT}/cuda-<device>)")
    p.add_argument("--repeats", type=positive, help="timed repeats per measurement (default 20; --quick 5)")
    p.add_argument("--kernels", nargs="+", metavar="NAME", help="only the KernelSpecs with these names")
    p.add_argument("--validate-dtypes", nargs="+", default=["float32", "float16"],
                   choices=["float64", "float32", "float16", "bfloat16"],
                   help="dtypes each version is validated in, beside every dtype it is timed in (always validated)")
    p.add_argument("--attention-T", nargs="+", type=positive, help="attention sequence lengths (default 512 1024 2048)")
    p.add_argument("--step", nargs="+", metavar="BxT", help="training-step batches (default 32x128 8x512)")
    p.add_argument("--step-T", nargs="+", type=positive,
                   help="training-step sequence lengths at 4096 tokens (B = 4096/T)")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch peers and HF's step")
    p.add_argument("--config", choices=["base", "tiny"], default="base",
                   help=argparse.SUPPRESS)          # tiny: the emulator's tooling check (tests/test_cuda_emu.py)
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    return p


def parse(argv=None):
    return add_arguments(argparse.ArgumentParser(prog="refbert bench --device cuda",
                                                 description=__doc__.split("\n")[0])).parse_args(argv)


def step_shapes(args):
    """[(B, T)] of the step section: --step "BxT" ..., else --step-T at 4096 tokens, else STEPS (--quick: 4x128)."""
    if getattr(args, "step", None):
        out = []
        for item in args.step:
            try:
                B, T = (int(v) for v in item.lower().split("x"))
            except ValueError:
                raise ValueError(f"bench: --step expected BxT (e.g. 32x128), got {item!r}") from None
            if B < 1 or T < 1:
                raise ValueError(f"bench: --step expected BxT with B and T >= 1, got {item!r}")
            out.append((B, T))
        return out
    if getattr(args, "step_T", None):
        return [(max(1, STEP_TOKENS // T), T) for T in args.step_T]
    return [(4, 128)] if getattr(args, "quick", False) else list(STEPS)


def defaults(args):
    """Fill the defaults that depend on --quick."""
    if args.repeats is None:
        args.repeats = 5 if args.quick else 20
    if args.attention_T is None:
        args.attention_T = [512] if args.quick else [512, 1024, 2048]
    return args


def command_line(args):
    parts = ["refbert bench --device cuda"]
    for key, value in sorted(vars(args).items()):
        if key in ("command", "device") or value in (None, False) or (key == "validate_dtypes"
                                                                      and value == ["float32", "float16"]) \
                or (key == "config" and value == "base"):
            continue
        flag = "--" + key.replace("_", "-")
        parts.append(flag if value is True else f"{flag} {' '.join(map(str, value))}" if isinstance(value, list)
                     else f"{flag} {value}")
    return " ".join(parts)


def emulated():
    """REFBERT_CUDA_EMULATE=1 (with NUMBA_ENABLE_CUDASIM=1): the bench's code paths run on
    refbert_kernels.cuda.emulate's CuPy stand-in (a tooling check: tests/test_cuda_emu.py; no timing means anything)."""
    return os.environ.get("REFBERT_CUDA_EMULATE", "0") not in ("", "0")


def _xp():
    """cupy, or its emulated stand-in."""
    if emulated():
        from refbert_kernels.cuda.emulate import cupy
        return cupy
    import cupy
    return cupy


def _randn(shape):
    """float32 standard normal values on the device."""
    cp = _xp()
    if emulated():
        return cp.asarray(np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32))
    return cp.random.standard_normal(shape, dtype=np.float32)


def gpu_available():
    """(True, device name) or (False, why)."""
    try:
        from numba.core import config
        if emulated() and config.ENABLE_CUDASIM:
            return True, "emulated GPU (CPU threads)"
        if config.ENABLE_CUDASIM:
            return False, "NUMBA_ENABLE_CUDASIM=1 is set: the simulator cannot be timed"
    except ImportError:
        return False, "numba is not installed (pip install 'refbert[cuda]')"
    try:
        import cupy
    except ImportError as e:
        return False, f"CuPy is not installed (pip install 'refbert[cuda]'): {e}"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return False, f"no CUDA device ({type(e).__name__}: {e})"
    if n < 1:
        return False, "no CUDA device"
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return True, name


# ----------------------------------------------------------------------------------------------------------------
# GPU timing

# a kernel that holds its stream until the host writes 1 to flag (pinned host memory the GPU reads through UVA) or
# limit_ns pass (then *timed_out = 1): nvbench's "blocking kernel". Queued before a measurement, it lets the host
# enqueue every launch of the call while the GPU waits, so the events around the call time the device work alone.
BLOCKER = r"""
extern "C" __global__ void refbert_block_until(volatile int* flag, unsigned long long limit_ns, int* timed_out) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    while (*flag == 0) {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if (t - t0 > limit_ns) { *timed_out = 1; return; }
        __nanosleep(1000);
    }
}
"""
BLOCK_LIMIT_NS = 200_000_000      # 0.2 s: a call longer to enqueue (or synchronising inside) is timed as called


class Blocker:
    """Holds the current stream behind BLOCKER until release(): the launches queued meanwhile then run back to back.
    A call that synchronises with the device inside (a read back, or Numba's wait on a foreign array's stream) would
    wait on the held stream: the kernel's time limit ends the hold, and release() then says so (False)."""

    def __init__(self, cp):
        import ctypes
        self.kernel = cp.RawKernel(BLOCKER, "refbert_block_until")
        self.kernel.compile()                             # (NVRTC now: a failure leaves the timer without it)
        self.cp = cp
        self.ptr = cp.cuda.runtime.hostAlloc(8, 3)        # cudaHostAllocPortable | cudaHostAllocMapped
        self.flag = ctypes.c_int.from_address(self.ptr)
        self.timed_out = ctypes.c_int.from_address(self.ptr + 4)

    def __del__(self):
        try:
            self.cp.cuda.runtime.freeHost(self.ptr)
        except Exception:                                 # pragma: no cover - at interpreter exit
            pass

    def hold(self):
        self.flag.value, self.timed_out.value = 0, 0
        self.kernel((1,), (1,), (np.uint64(self.ptr), np.uint64(BLOCK_LIMIT_NS), np.uint64(self.ptr + 4)))

    def release(self, end):
        """Let the stream go, wait for the event `end`; True when the hold lasted until now (a clean measurement)."""
        self.flag.value = 1
        end.synchronize()
        return self.timed_out.value == 0


class Timer:
    """CUDA-event timings with the L2 flushed (FLUSH_BYTES written) before every timed call: __call__ times a call
    as a user sees it (host work included: a small kernel's time is then mostly its launch), device() the GPU's
    work alone (the launches queued behind a Blocker)."""

    def __init__(self, repeats, warmup=2):
        cupy = _xp()
        self.cp, self.repeats, self.warmup = cupy, repeats, warmup
        self.flush_buf = cupy.empty((FLUSH_BYTES if not emulated() else 2 ** 16) // 4, np.float32)
        self.blocker = None
        if not emulated():
            try:
                self.blocker = Blocker(cupy)
            except Exception as e:            # pragma: no cover - no NVRTC, no mapped memory
                print(f"  (device-only timings off: {type(e).__name__}: {e})", flush=True)

    def flush(self):
        self.flush_buf.fill(0)

    def __call__(self, fn, repeats=None):
        """Median seconds of fn() (device time between events recorded around the call: includes the host-side
        work of the call, as a user sees it)."""
        emu = emulated()                               # the emulator: one run, its time means nothing
        for _ in range(0 if emu else self.warmup):
            fn()
        return self._median(fn, 1 if emu else (repeats or self.repeats), held=False)

    def device(self, fn, repeats=None):
        """Median seconds of fn()'s device work alone: its launches queued while a Blocker holds the stream, between
        events recorded inside the hold. None on the emulator, without a Blocker, or when a call synchronised
        inside (its hold timed out: fn's time as called is then all there is). Call it after __call__ (its warmup)."""
        if self.blocker is None or emulated():
            return None
        try:
            return self._median(fn, repeats or self.repeats, held=True)
        except Exception as e:                            # a device-only time is extra: never lose the row to it
            print(f"  (device-only timing failed: {_err(e)})", flush=True)
            return None

    def _median(self, fn, n, held):
        """The median of n timed calls of fn, the L2 flushed before each; held: queued behind the Blocker (None
        when a hold timed out)."""
        cp = self.cp
        times = []
        for _ in range(n):
            self.flush()
            start, end = cp.cuda.Event(), cp.cuda.Event()
            if held:
                self.blocker.hold()
            try:
                start.record()
                fn()
                end.record()
            finally:
                clean = self.blocker.release(end) if held else True
            if not clean:
                return None
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
        return statistics.median(times)


def copy_bandwidth(timer):
    """Bytes per second of a device-to-device copy of COPY_BYTES (read + write: 2 bytes moved per byte)."""
    cp = timer.cp
    a = cp.ones((COPY_BYTES if not emulated() else 2 ** 20) // 4, np.float32)
    b = cp.empty_like(a)
    t = timer(lambda: cp.copyto(b, a), repeats=max(5, timer.repeats // 2))
    return 2 * a.nbytes / t                 # (a, b freed on return, back to CuPy's pool)


def launch_overhead(n=2000):
    """{what: (wall us per launch, event us of one launch)} of empty kernels."""
    cp = _xp()
    n = n if not emulated() else 3
    import refbert_kernels.cuda  # noqa: F401  (before the first compile: its NumPy 2.5 fix for numba-cuda)
    from numba import cuda

    @cuda.jit
    def empty():
        pass

    @cuda.jit
    def empty4(a, b, c, d):
        pass

    arrays = [cp.zeros(16, np.float32) for _ in range(4)]
    runs = {"numba empty kernel, no arguments": lambda: empty[1, 32](),
            "numba empty kernel, 4 CuPy array arguments": lambda: empty4[1, 32](*arrays)}
    try:                                   # CuPy's own launch path (NVRTC-compiled), for comparison
        raw = cp.RawKernel('extern "C" __global__ void refbert_empty() {}', "refbert_empty")
        raw((1,), (32,), ())
        runs["cupy RawKernel, empty"] = lambda: raw((1,), (32,), ())
    except Exception as e:                 # pragma: no cover - no NVRTC
        print(f"  (cupy RawKernel probe skipped: {type(e).__name__}: {e})")
    out = {}
    for what, fn in runs.items():
        for _ in range(10):
            fn()
        cp.cuda.Device().synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        cp.cuda.Device().synchronize()
        wall = (time.perf_counter() - t) / n * 1e6
        start, end = cp.cuda.Event(), cp.cuda.Event()
        ev = []
        for _ in range(50 if not emulated() else 2):
            start.record()
            fn()
            end.record()
            end.synchronize()
            ev.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
        out[what] = (wall, statistics.median(ev))
    return out


# ----------------------------------------------------------------------------------------------------------------
# kernels

def kernel_specs(names=None):
    """[(module, spec)] of every refbert_kernels.cuda module, and [(module, error)] of those that fail to import."""
    import importlib
    from .bench import unknown_kernels
    found, errors, known = [], [], []
    for m in MODULES:
        try:
            mod = importlib.import_module(f"refbert_kernels.cuda.{m}")
        except Exception as e:
            errors.append((m, f"{type(e).__name__}: {e}"))
            continue
        for spec in getattr(mod, "SPECS", []):
            known.append(spec.name)
            if names is None or spec.name in names:
                found.append((m, spec))
    if names is not None:
        unknown_kernels(names, known, errors)
    return found, errors


def cuda_c_versions(op):
    """{key: Version} of the op's CUDA C versions (kernels/cuda/versions.py), {} where there are none."""
    from refbert_kernels.cuda import versions as VV
    return {v.key: v for v in VV.versions().get(op, []) if v.cuda_c}


def with_cuda_c(spec):
    """The spec with its CUDA C versions added under their keys ("C1", "C2": the .cu file's version)."""
    import dataclasses
    try:
        extra = cuda_c_versions(spec.name)
    except Exception:                                     # pragma: no cover - no kernels/cuda/versions
        return spec
    extra = {k: v for k, v in extra.items() if k not in spec.versions}
    if not extra:
        return spec
    return dataclasses.replace(spec, versions={**spec.versions, **{k: (v.forward, v.backward) for k, v in
                                                                   extra.items()}},
                               notes={**spec.notes, **{k: v.note for k, v in extra.items()}})


def _dtype(name):
    if name == "bfloat16":
        from ml_dtypes import bfloat16
        return np.dtype(bfloat16)
    return np.dtype(name)


def validate_version(spec, v, dtypes):
    """(worst err/tol over the spec's GPU shapes and dtypes, error text or None). CUDA C versions run on CuPy
    copies of the inputs (versions.validate: their fast path takes device arrays; CuPy has no bfloat16), and must
    not hand any call to a Numba version on the way; the Numba ones through _common.validate."""
    from refbert_kernels.cuda import _common as C
    worst = 0.0
    try:
        if isinstance(v, str) and v.startswith("C"):
            from refbert_kernels.cuda import cuda_c as K, versions as VV
            ver = cuda_c_versions(spec.name)[v]
            for dt in dtypes:
                if not VV.takes(ver, dt):
                    continue
                K.FELL_BACK.clear()
                w, err = VV.validate(ver, dt, spec.notes.get("gpu_shapes", spec.shapes))
                if err:
                    return math.inf, err
                if K.FELL_BACK:
                    return math.inf, f"handed to Numba: {K.FELL_BACK}"
                worst = max(worst, w)
            return worst, None
        for dt in dtypes:
            for shape in spec.notes.get("gpu_shapes", spec.shapes):
                worst = max(worst, C.validate(spec, v, _dtype(dt), shape))
    except Exception as e:
        return math.inf, _err(e, 300)
    return worst, None


def _on_gpu(inputs, kwargs, dtype):
    """A spec's host inputs on the GPU (float arrays in dtype), kwargs' arrays too (masks, labels stay as given)."""
    cp = _xp()
    conv = lambda v: cp.asarray(v.astype(dtype) if v.dtype.kind == "f" else v) \
        if isinstance(v, np.ndarray) else v  # noqa: E731
    with np.errstate(over="ignore"):       # float32's most negative mask value is -inf in float16, as intended
        return {k: conv(v) for k, v in inputs.items()}, \
            {k: (conv(v) if isinstance(v, np.ndarray) and v.dtype.kind == "f" else v) for k, v in kwargs.items()}


def _err(e, n=160):
    """One line of an exception, for a table cell."""
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text[:n]}"


def _fresh(kwargs):
    from refbert.philox import DropoutRNG
    return {k: (DropoutRNG(1234) if k == "rng" else v) for k, v in kwargs.items()}


def time_pair(timer, forward, backward, inputs, kwargs):
    """(forward s, backward s, forward device s, backward device s) of one implementation on device inputs;
    backward on one cached forward. The device times (Timer.device) are None where they cannot be separated."""
    cp = _xp()
    out, cache = forward(**inputs, **_fresh(kwargs))
    scalar = np.ndim(out) == 0
    dout = 1.0 if scalar else cp.asarray(np.random.default_rng(0).standard_normal(out.shape)).astype(out.dtype)
    tf = timer(lambda: forward(**inputs, **_fresh(kwargs)))
    tb = timer(lambda: backward(dout, cache))
    df = timer.device(lambda: forward(**inputs, **_fresh(kwargs)))
    return tf, tb, df, timer.device(lambda: backward(dout, cache))


def torch_peer(name, inputs, kwargs):
    """(forward(), backward()) closures of PyTorch's version of a spec's op on the same device memory (DLPack), or
    None where there is none. backward() differentiates one retained forward graph."""
    import torch
    import torch.nn.functional as F
    t = {k: torch.from_dlpack(v) if hasattr(v, "__dlpack__") and not isinstance(v, np.ndarray) else v
         for k, v in inputs.items()}
    kw = dict(kwargs)
    if name == "softmax":
        mask = kw.get("mask", inputs.get("mask"))
        mask = None if mask is None else torch.from_dlpack(mask) if not isinstance(mask, np.ndarray) \
            else torch.as_tensor(mask, device="cuda")
        x = t["x"].requires_grad_()
        fn = lambda: F.softmax(x * kw.get("scale", 1.0) + (0 if mask is None else mask), -1)  # noqa: E731
        wrt = [x]
    elif name in ("layernorm", "residual_layernorm", "dropout_residual_layernorm"):
        x, w, b = (t[k].requires_grad_() for k in ("x", "w", "b"))
        a = t["a"].requires_grad_() if "a" in t else None
        p = kw.get("p", 0.0) if kw.get("train", True) else 0.0
        s = (lambda: x) if a is None else (lambda: x + F.dropout(a, p)) if p else (lambda: x + a)
        fn = lambda: F.layer_norm(s(), (x.shape[-1],), w, b, kw.get("eps", 1e-12))  # noqa: E731
        wrt = [x, w, b] + ([a] if a is not None else [])
    elif name in ("gelu", "bias_gelu"):
        x = t["x"].requires_grad_()
        b = t["b"].requires_grad_() if "b" in t else None
        approx = kw.get("approximate", "none")
        fn = (lambda: F.gelu(x, approximate=approx)) if b is None else \
            (lambda: F.gelu(x + b, approximate=approx))
        wrt = [x] + ([b] if b is not None else [])
    elif name == "dropout":
        x = t["x"].requires_grad_()
        fn = lambda: F.dropout(x, kw.get("p", 0.1), kw.get("train", True))  # noqa: E731
        wrt = [x]
    elif name == "cross_entropy":
        z = t["logits"].requires_grad_()
        lab = kw.get("labels", inputs.get("labels"))         # the spec's inputs carry the labels (integer array)
        lab = torch.as_tensor(lab, device="cuda") if isinstance(lab, np.ndarray) else torch.from_dlpack(lab)
        ignore = kw.get("ignore_index", -100)
        fn = lambda: F.cross_entropy(z.reshape(-1, z.shape[-1]), lab.reshape(-1).long(),  # noqa: E731
                                     ignore_index=ignore)
        wrt = [z]
    else:
        return None
    y = fn()
    g = torch.randn_like(y) if y.ndim else torch.ones_like(y)
    return fn, lambda: torch.autograd.grad(y, wrt, g, retain_graph=True, allow_unused=True)


def sdpa_peers(B, T, H, hs, dtype, mask_host, p):
    """{name: (forward, backward)} of F.scaled_dot_product_attention with one backend each, on (B, H, T, hs)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    tdt = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16}[np.dtype(dtype)]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, T, hs, device="cuda", dtype=tdt, generator=g).requires_grad_() for _ in range(3))
    mask = torch.as_tensor(mask_host, device="cuda", dtype=tdt) if mask_host is not None else None
    peers = {}
    for name, backend, m in (("torch sdpa flash (no mask)", SDPBackend.FLASH_ATTENTION, None),
                             ("torch sdpa mem-efficient", SDPBackend.EFFICIENT_ATTENTION, mask)):
        if backend == SDPBackend.FLASH_ATTENTION and tdt == torch.float32:
            peers[name] = "not offered: PyTorch's flash backend takes float16 / bfloat16 only"
            continue

        def fwd(backend=backend, m=m):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=p)
        try:
            y = fwd()
        except RuntimeError as e:                                  # this backend refuses this dtype / mask
            peers[name] = _err(e)
            continue
        dy = torch.randn_like(y)
        peers[name] = (fwd, lambda y=y, dy=dy: torch.autograd.grad(y, (q, k, v), dy, retain_graph=True))
    return peers


class Spent:
    """Where a bench run's wall time goes, section by section, and how much of each section was compiling
    (refbert_kernels.cuda.compile_time: Numba's compiles, the CUDA C modules' NVRTC compiles and the waits for other
    processes' compiles of them). Issue 13 wants gpu_all.sh's whole report, this bench the largest of its steps
    (195 s on the H200 at b87c638), in under 6 minutes: these lines say what to cut. Sections nest (the kernel
    section's ops, "kernels: attention", inside "kernels"); line() lists the outer ones."""

    def __init__(self):
        from refbert_kernels.cuda import compile_time as CT
        CT.watch_numba()                                # (counting from here, before any kernel file is imported)
        self.t0 = time.perf_counter()
        self.rows = []

    @contextlib.contextmanager
    def section(self, name):
        from refbert_kernels.cuda import compile_time as CT
        snap, t = CT.snapshot(), time.perf_counter()
        try:
            yield
        finally:
            spent = CT.since(snap)
            self.rows.append(dict(section=name, s=time.perf_counter() - t, **spent))
            print(f"== {name}: {self.rows[-1]['s']:.1f} s (compiling: {CT.describe(spent)})", flush=True)

    def line(self):
        """One line for gpu_all.sh's summary: each outer section's seconds, the total, the whole run's compiling."""
        from refbert_kernels.cuda import compile_time as CT
        outer = [r for r in self.rows if ":" not in r["section"]]
        return ("bench sections: " + ", ".join(f"{r['section']} {r['s']:.1f} s" for r in outer)
                + f"; total {time.perf_counter() - self.t0:.1f} s; compiling in all: {CT.summary()}")

    def md(self):
        lines = ["Where this run's wall time went (seconds; compiling: Numba's kernel compiles, and the CUDA C "
                 "modules' NVRTC compiles or loads with the time spent waiting for another process compiling the "
                 "same file):", ""]
        return lines + md_table(("section", "s", "Numba compiling s", "Numba compiler-lock holds", "CUDA C s",
                                 "of it waiting s"),
                                [(r["section"], f"{r['s']:.1f}", f"{r['numba_s']:.1f}", r["numba_n"],
                                  f"{r['cuda_c_s']:.1f}", f"{r['cuda_c_wait_s']:.1f}") for r in self.rows]) \
            + ["", self.line()]


def run_kernels(args, timer, bw, spent=None):
    """Validate every version, then time it and its PyTorch peer. -> (rows, failed, timings): timings
    {(op, "float32"): {version key: seconds (order_seconds: on the device where the call has device times)}} of the
    passing versions at the bench shape (the first --attention-T for attention): what cuda_order.json orders.
    spent: a Spent, given each op's seconds as a section "kernels: <op>"."""
    from refbert_kernels.cuda import _common as C   # noqa: F401  (imports the CUDA stack once, before timing)
    found, errors = kernel_specs(args.kernels)
    rows, failed, timings = [], False, {}
    for m, err in errors:
        print(f"  kernels: refbert_kernels.cuda.{m} failed to import: {err}", flush=True)
        rows.append(dict(spec=m, version=None, status="IMPORT ERROR", error=err))
        failed = True
    for m, spec in found:
        spec = with_cuda_c(spec)
        with spent.section(f"kernels: {spec.name}") if spent else contextlib.nullcontext():
            got, bad = _run_spec(args, timer, bw, spec, timings)
        rows += got
        failed |= bad
    return rows, failed, timings


def _run_spec(args, timer, bw, spec, timings):
    """run_kernels for one spec: its validation rows and timing rows, and whether any failed; its float32 times at
    the bench shape added to timings."""
    rows, failed = [], False
    if spec.name == "attention":
        shapes = [dict(spec.bench_shape, B=ATTENTION["B"], H=ATTENTION["H"], hs=ATTENTION["hs"], T=T)
                  for T in args.attention_T]
        dtypes = [np.float32, np.float16]
    else:
        shapes, dtypes = [spec.bench_shape], [np.float32]
    # every version validated in every dtype it is timed in, and in the --validate-dtypes
    checked = list(dict.fromkeys(list(args.validate_dtypes) + [np.dtype(d).name for d in dtypes]))
    passing = []
    for v in sorted(spec.versions, key=str):
        worst, err = validate_version(spec, v, checked)
        ok = err is None and worst <= 1
        failed |= not ok
        print(f"  validate {spec.name} v{v} ({', '.join(checked)}): err/tol {fmt(worst)} "
              f"{'ok' if ok else 'FAIL'} {err or ''}", flush=True)
        rows.append(dict(spec=spec.name, version=v, status="ok" if ok else "FAIL", err_tol=worst, error=err,
                         note=spec.notes.get(v, "")))
        if ok:
            passing.append(v)
    for i, shape in enumerate(shapes):
        for dtype in dtypes:
            got = time_spec(args, timer, bw, spec, passing, shape, dtype)
            rows += got
            failed |= any(r.get("status") == "FAIL" for r in got)      # (an A/B row's own validation)
            if i == 0 and dtype == np.float32:
                for r in got:
                    sec = order_seconds(r)
                    if sec is not None and r["impl"].startswith("v"):
                        timings.setdefault((spec.name, "float32"), {})[r["impl"][1:]] = sec
    return rows, failed


def order_seconds(row):
    """The seconds a timing row of a version ranks it by in cuda_order.json: forward + backward on the device alone
    where the call has both (what the op costs inside a step that keeps the GPU busy, the training step's case: its
    launches are queued while earlier kernels run, or a graph replays them), else forward + backward as called (a
    call that synchronises inside, as Numba's launches on CuPy arrays do, has no device time; its time as called is
    at least its device time, so it is never ranked ahead of a version by its launch's absence). None: not timed."""
    if row.get("fwd_ms") is None or row.get("bwd_ms") is None:
        return None
    if row.get("fwd_dev_ms") is not None and row.get("bwd_dev_ms") is not None:
        return (row["fwd_dev_ms"] + row["bwd_dev_ms"]) / 1e3
    return (row["fwd_ms"] + row["bwd_ms"]) / 1e3


def time_spec(args, timer, bw, spec, versions, shape, dtype):
    """Timing rows of every passing version and the PyTorch peers at one shape and dtype."""
    inputs_h, kwargs_h = spec.make_inputs(shape, np.float32, 0)
    nbytes = spec.nbytes(inputs_h, kwargs_h) if spec.nbytes else None
    if nbytes and np.dtype(dtype).itemsize != 4:
        nbytes = nbytes * np.dtype(dtype).itemsize // 4
    inputs, kwargs = _on_gpu(inputs_h, kwargs_h, dtype)
    fl = None
    if spec.name == "attention":
        B, T, H, hs = shape["B"], shape["T"], shape["H"], shape["hs"]
        fl = (attention_flops(B, H, T, hs), attention_flops(B, H, T, hs, backward=True))
    base = dict(spec=spec.name, shape=shape_str(shape), dtype=np.dtype(dtype).name, bytes=nbytes)
    rows = []

    def add(impl, tf, tb, df=None, db=None, note=""):
        # GB/s, % copy and TFLOP/s of the device times where both were separated (Timer.device), else of the times
        # as called (host work included: a small kernel's launch then dominates them)
        dev = df is not None and db is not None
        f_, b_ = (df, db) if dev else (tf, tb)
        r = dict(base, impl=impl, fwd_ms=tf * 1e3, bwd_ms=tb * 1e3, fwd_dev_ms=df * 1e3 if df is not None else None,
                 bwd_dev_ms=db * 1e3 if db is not None else None, rates_of="device" if dev else "call", note=note,
                 gbps=gbps(nbytes, f_ + b_), pct_copy=pct(gbps(nbytes, f_ + b_), bw / 1e9))
        if fl:
            r.update(fwd_tflops=tflops(fl[0], f_), bwd_tflops=tflops(fl[1], b_))
        rows.append(r)
        print(f"  {spec.name:28s} {r['shape']:28s} {r['dtype']:8s} {impl:30s} fwd {fmt(r['fwd_ms'])} ms  "
              f"bwd {fmt(r['bwd_ms'])} ms  device {fmt(r['fwd_dev_ms'])} + {fmt(r['bwd_dev_ms'])} ms  "
              f"{fmt(r['gbps'])} GB/s ({fmt(r['pct_copy'], '.0f')}% copy)"
              + (f"  {fmt(r.get('fwd_tflops'))}/{fmt(r.get('bwd_tflops'))} TFLOP/s" if fl else ""), flush=True)

    c_versions = cuda_c_versions(spec.name)
    for v in versions:
        if v in c_versions:
            from refbert_kernels.cuda import versions as VV
            var = f"hs{shape['hs']}" if spec.name == "attention" else None
            if not VV.takes(c_versions[v], dtype, var):
                rows.append(dict(base, impl=f"v{v}", note=f"no kernel for {np.dtype(dtype).name}"
                                 + (f" {var}" if var else "")))
                continue
        if spec.name == "attention" and v in (1, 2) and shape["T"] > 1024:
            # (version 2's backward is version 1's: at T = 2048 it took 371 ms a call on the H200 at b87c638, about
            # 10 s of the bench a dtype for a row that says nothing T = 512's does not)
            rows.append(dict(base, impl=f"v{v}", note="skipped: materialises (B, H, T, T) three times"
                             + (" (its backward, version 1's)" if v == 2 else "")))
            continue
        try:
            add(f"v{v}", *time_pair(timer, *spec.versions[v], inputs, kwargs), note=spec.notes.get(v, ""))
        except Exception as e:
            rows.append(dict(base, impl=f"v{v}", note=_err(e)))
            print(f"  {spec.name} v{v}: {_err(e, 1000)}", flush=True)
        if spec.name == "attention" and (v, np.dtype(dtype).name) in AB_BACKWARD:
            ab_backward(rows, add, timer, spec, v, dtype, inputs, kwargs, base)
        if spec.name == "attention" and (v, np.dtype(dtype).name) in AB_FORWARD:
            ab_backward(rows, add, timer, spec, v, dtype, inputs, kwargs, base, side="forward")
    if args.no_torch:
        return rows
    try:
        if spec.name == "attention":
            mask = kwargs_h.get("mask", inputs_h.get("mask"))
            peers = sdpa_peers(shape["B"], shape["T"], shape["H"], shape["hs"], dtype, mask,
                               shape.get("p", 0.0) if shape.get("train", True) else 0.0)
        else:
            peer = torch_peer(spec.name, inputs, kwargs)
            peers = {} if peer is None else {"torch": peer}
        for name, pr in peers.items():
            if isinstance(pr, str):
                rows.append(dict(base, impl=name, note=pr))
                continue
            add(name, timer(pr[0]), timer(pr[1]), timer.device(pr[0]), timer.device(pr[1]))
    except ImportError as e:
        rows.append(dict(base, impl="torch", note=f"not installed: {e}"))
    except Exception as e:
        rows.append(dict(base, impl="torch", note=_err(e)))
    return rows


# The A/B rows of a version's backward kernels (an environment variable's values beside its default's row, in the
# dtype the variant's kernels take): {(version, dtype): (variable, {value: (kernels that must run, note)})}
AB_BACKWARD = {
    ("C5", "float16"): ("REFBERT_ATTN_BWD16", {
        "5": ({"attn_bwd_dkdv_v5_f16_hs64", "attn_bwd_dq_v5_f16_hs64"},
              "attention_backward.cu v5, version 6's bits with each 64-wide tile in one piece (250 registers, two "
              "blocks an SM)"),
        "7": ({"attn_bwd_fused_v7_f16_hs64", "attn_bwd_dqcast_f16"},
              "attention_backward.cu v7, one pass: version 6's dk, dv and each key tile's share of dq added by "
              "float atomics (5 tile products a tile pair where version 6 takes 7; dq's bits not fixed)"),
        # (version 8 runs its own kernels without dropout, or with it at T % 4 == 0, under a mask constant along the
        # queries; version 7's otherwise: the bench's rows are the first case)
        "8": (({"attn_bwd_fused_v8_f16_hs64", "attn_bwd_dqcast_f16"},
               {"attn_bwd_fused_v8d_f16_hs64", "attn_bwd_dqcast_f16"}),
              "attention_backward.cu v8, version 7's one pass with each score's work cut to its arithmetic "
              "(compiled per case: no dropout, or dropout's words a Philox call per 4 scores; the stats read once "
              "per two columns; exp by ex2.approx.ftz; no bounds tests on whole tiles): version 7's dk, dv bits "
              "wherever no probability falls below 2^-126")}),
    ("C6", "float32"): ("REFBERT_F32_BWD", {
        "4": (({"attn_bwd_fused_v4_f32_hs64", "attn_bwd_dqsum_v4_f32"},
               {"attn_bwd_dkdv_v3_f32_hs64", "attn_bwd_dq_v3_f32_hs64"}),   # (where C4's dq partials do not fit)
              "attention_f32.cu v4, version 6's bits with the transposing pass's shared stores 8-way bank "
              "conflicted (where the dq partials do not fit: version 3's dk, dv kernel against version 6's)"),
        # (version 8 runs its own kernel without dropout under a mask constant along the queries, as the bench's
        # rows are; all key tiles in one group, or in several where the partials do not fit. Where not one key
        # tile's partials fit it runs the default's kernels, version 6's dk, dv and version 3's dq: a row timing
        # those would time the default under version 8's name, so it fails instead)
        "8": ({"attn_bwd_fused_v8_f32_hs64", "attn_bwd_dqsum_v7_f32"},
              "attention_f32.cu v8, version 6's bits without dropout's pass: p and ds^T stored transposed from the "
              "registers of S^T and dP^T (three barriers a tile pair where version 6 has five), the key columns' mask "
              "read once per block, no bounds tests on the scores")}),
}
# (each entry: variable, {value: (the kernels that value launches, or a tuple of such sets where the launcher picks
# one by shape: the row passes when every kernel of one set ran), note})


# The A/B rows of a version's forward kernels, as AB_BACKWARD's for the backward
AB_FORWARD = {
    ("C5", "float16"): ("REFBERT_ATTN_FWD16", {
        # (version 6 where version 5 runs, 128 rows a block, without dropout; version 4 where the grid takes 64)
        "6": (({"attn_fwd_v6_f16_hs64"}, {"attn_fwd_v4_f16_hs64"}),
              "attention_forward.cu v6, version 5 with each score's work cut to its arithmetic (no dropout; the "
              "key tile's additive terms read once per two columns, exp by ex2.approx.ftz, no bounds tests): "
              "version 5's bits wherever no probability falls below 2^-126; version 4 where the grid takes 64 "
              "rows a block")}),
}


def ab_backward(rows, add, timer, spec, version, dtype, inputs, kwargs, base, side="backward"):
    """The A/B rows of `version`'s backward kernels (AB_BACKWARD) beside its default's row: C5's versions 5, 7 and 8
    beside 6 (REFBERT_ATTN_BWD16), C6's versions 4 and 8 beside 6 (REFBERT_F32_BWD), each validated against the
    oracle in `dtype` first (a failure is a row saying so, never timed: status "FAIL", which fails the bench) and
    checked to have launched its own kernels. side="forward": the forward's (AB_FORWARD: C5's version 6 beside 5,
    REFBERT_ATTN_FWD16)."""
    from refbert_kernels.cuda import versions as VV
    var, values = (AB_BACKWARD if side == "backward" else AB_FORWARD)[(version, np.dtype(dtype).name)]
    for value, (kernels, note) in values.items():
        impl = f"v{version} ({side} v{value})"
        try:
            with VV.kernel_variant(var, value):
                _ab_row(rows, add, timer, spec, version, dtype, inputs, kwargs, base, impl, var, value, kernels, note,
                        side)
        except Exception as e:
            rows.append(dict(base, impl=impl, note=_err(e)))


def _ab_row(rows, add, timer, spec, version, dtype, inputs, kwargs, base, impl, var, value, kernels, note,
            side="backward"):
    """One of ab_backward's rows, its variant set: validated, its kernels (the backward's, or the forward's) seen to
    run, then timed."""
    worst, err = validate_version(spec, version, [np.dtype(dtype).name])
    if err is not None or worst > 1:
        rows.append(dict(base, impl=impl, version=impl[1:], status="FAIL", err_tol=worst,
                         note=f"FAIL: err/tol {fmt(worst)} {err or ''}"))
        return
    forward, backward = spec.versions[version]
    if side == "forward":
        ran = {r[0] for r in _recorded(lambda: forward(**inputs, **_fresh(kwargs)))}
    else:
        out, cache = forward(**inputs, **_fresh(kwargs))
        ran = {r[0] for r in _recorded(lambda: backward(out, cache))}           # (out: a dout of the right shape)
    if not any(ks <= ran for ks in (kernels if isinstance(kernels, tuple) else (kernels,))):
        rows.append(dict(base, impl=impl, version=impl[1:], status="FAIL",
                         note=f"FAIL: version {value}'s kernels did not run ({sorted(ran)})"))
        return
    add(impl, *time_pair(timer, forward, backward, inputs, kwargs),
        note=f"{version} with its {side}'s version {value} (err/tol {fmt(worst)}): {note}; the A/B of {var}")


# ----------------------------------------------------------------------------------------------------------------
# the training step: refbert (both decoders) against HF + PyTorch (sdpa, eager), the GEMM floor, memory

def step_gemms(cfg, B, T, n, decode="all", who="refbert"):
    """The matrix products of one BertForPreTraining training step (forward and backward) as
    [(what, batch, m, k, n)]: out (batch, m, n) = a (batch, m, k) @ b (batch, k, n); 2 batch m k n FLOPs each.
    n: the labelled MLM rows. Per layer: q, k, v, output, intermediate and output denses (forward x W^T; backward
    dx = dout W and dW = dout^T x), attention's S = q k^T and O = P v per (b, h) and their backward (dP = dO v^T,
    dV = P^T dO, dQ = dS k, dK = dS^T q). Heads: pooler and NSP on B rows; the MLM transform and the tied decoder on
    N = B T rows (decode "all": the decoder again on the n labelled rows for the loss, its backward on those n
    rows, refbert's structure) or on the n labelled rows only ("labelled"); who="hf": HF's decoder, forward and
    backward on all N rows."""
    C, I, V, H, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_attention_heads, \
        cfg.num_hidden_layers
    hs, N = C // H, B * T
    out = []

    def dense(what, rows, cin, cout):
        out.extend([(what, 1, rows, cin, cout), (f"{what} dx", 1, rows, cout, cin), (f"{what} dW", 1, cout, rows, cin)])
    for _ in range(L):
        for what in ("query", "key", "value", "attention.output"):
            dense(what, N, C, C)
        dense("intermediate", N, C, I)
        dense("output", N, I, C)
        out += [("attention q k^T", B * H, T, hs, T), ("attention P v", B * H, T, T, hs),
                ("attention dP", B * H, T, hs, T), ("attention dV", B * H, T, T, hs),
                ("attention dQ", B * H, T, T, hs), ("attention dK", B * H, T, T, hs)]
    dense("pooler", B, C, C)
    dense("nsp", B, C, 2)
    rows = n if (decode == "labelled" and who == "refbert") else N
    dense("mlm transform", rows, C, C)
    if who == "hf":
        dense("decoder", N, C, V)
    else:
        out.append(("decoder", 1, rows, C, V))
        if decode == "all":
            out.append(("decoder (labelled rows, for the loss)", 1, n, C, V))
        out += [("decoder dx", 1, n, V, C), ("decoder dW", 1, V, n, C)]
    return out


def gemm_flops(gemms):
    return sum(2.0 * b * m * k * n for _, b, m, k, n in gemms)


def time_gemms(timer, gemms):
    """Seconds of every product of `gemms` on cuBLAS in float32 (cupy.matmul, TF32 off), one after another: the
    floor no implementation of the step can go under. Operands allocated once per distinct shape."""
    cp = _xp()
    shapes = {}
    for _, b, m, k, n in gemms:
        if (b, m, k, n) not in shapes:
            a = _randn((b, m, k))
            bb = _randn((b, k, n))
            shapes[(b, m, k, n)] = (a, bb, cp.empty((b, m, n), np.float32))
    seq = [shapes[(b, m, k, n)] for _, b, m, k, n in gemms]

    def run():
        for a, bb, o in seq:
            cp.matmul(a, bb, out=o)
    return timer(run, repeats=max(3, timer.repeats // 2))


def _tf32_off():
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def _pool_bytes():
    cp = _xp()
    return cp.get_default_memory_pool().used_bytes()


def run_step(args, timer):
    """The step rows (refbert all / labelled, HF sdpa / eager, the GEMM floors, memory). -> (rows, failed, models)
    with models what run_profile reuses and probe_step, one step of the first shape for main's launch probe."""
    cp = _xp()
    import refbert
    from refbert.bench import batch
    from refbert_kernels.cuda import versions as VV
    cfg = _config(args)
    rows, failed, probe_step = [], False, None
    tmp = tempfile.TemporaryDirectory()
    hf = {}
    if not args.no_torch:
        try:
            import torch
            import transformers
            from refbert.bench import hf_model
            _tf32_off()
            hf_model(cfg, tmp.name)
            for impl in ("sdpa", "eager"):
                hf[impl] = transformers.BertForPreTraining.from_pretrained(tmp.name, attn_implementation=impl).cuda()
        except Exception as e:
            rows.append(dict(impl="HF + PyTorch", note=_err(e)))
            hf = {}
    if hf:
        ours = refbert.BertForPreTraining.from_pretrained(tmp.name, backend="cuda")
    else:
        ours = refbert.BertForPreTraining(cfg, seed=0, backend="cuda")
    for si, (B, T) in enumerate(step_shapes(args)):
        x = batch(B, T, cfg.vocab_size, seed=T)
        n = int((x["labels"] != -100).sum())
        shape = f"B={B} T={T}"
        base = dict(shape=shape, B=B, T=T, labelled=n)
        tx = None
        if hf:                                          # the same loss before any timing (eval: no dropout)
            tx = {k: torch.as_tensor(v, device="cuda") for k, v in x.items()}
            ours.eval()
            hf["eager"].eval()
            with torch.no_grad():
                l_hf = float(hf["eager"](**tx).loss)
            l_ours = float(ours(**x).loss)
            rel = abs(l_ours - l_hf) / max(abs(l_hf), 1e-30)
            ok = rel <= 1e-4
            failed |= not ok
            rows.append(dict(base, impl="check", note=f"eval loss refbert {l_ours:.6f} vs HF fp32 {l_hf:.6f}: rel "
                             f"diff {rel:.1e} {'ok' if ok else 'FAIL'}"))
            print(f"  step {shape}: {rows[-1]['note']}", flush=True)
        ours.train()
        sdpa_ms = None
        if hf:
            for impl in ("sdpa", "eager"):
                m = hf[impl].train()

                def step_hf(m=m):
                    m.zero_grad(set_to_none=True)
                    m(**tx).loss.backward()
                t = timer(step_hf, repeats=max(3, args.repeats // 2))
                held = _hf_held_after_forward(torch, m, tx)
                floor = time_gemms(timer, step_gemms(cfg, B, T, n, "all", "hf"))
                if impl == "sdpa":
                    sdpa_ms = t * 1e3
                rows.append(dict(base, impl=f"HF + PyTorch {impl} fp32", ms=t * 1e3, tokens_per_s=B * T / t,
                                 floor_ms=floor * 1e3, held_mb=held / 2 ** 20))
                print(f"  step {shape} HF {impl}: {t * 1e3:.2f} ms (its GEMM floor {floor * 1e3:.2f} ms), "
                      f"{held / 2 ** 20:.0f} MiB held after the forward", flush=True)
                torch.cuda.empty_cache()
        for decode in ("all", "labelled"):
            def step_ours(decode=decode):
                ours(**x, mlm_decode=decode)
                ours.backward()
            t = timer(step_ours, repeats=max(3, args.repeats // 2))
            held = _held_after_forward(ours, x, decode)
            gemms = step_gemms(cfg, B, T, n, decode)
            floor = time_gemms(timer, gemms)
            rows.append(dict(base, impl=f"refbert cuda fp32 ({decode})", ms=t * 1e3, tokens_per_s=B * T / t,
                             floor_ms=floor * 1e3, held_mb=held / 2 ** 20, gemm_tflop=gemm_flops(gemms) / 1e12,
                             vs_sdpa=t * 1e3 / sdpa_ms if sdpa_ms else None, vs_floor=t / floor))
            print(f"  step {shape} refbert ({decode}): {t * 1e3:.2f} ms, {t / floor:.2f}x its GEMM floor "
                  f"({floor * 1e3:.2f} ms)" + (f", {t * 1e3 / sdpa_ms:.2f}x HF sdpa" if sdpa_ms else "")
                  + f"; {held / 2 ** 20:.0f} MiB held after the forward", flush=True)
            if decode == "all":                          # A/B: the adds around the linears as they were
                with _adds_unfused():
                    t2 = timer(step_ours, repeats=max(3, args.repeats // 2))
                rows.append(dict(base, impl="refbert cuda fp32 (all), adds unfused", ms=t2 * 1e3,
                                 tokens_per_s=B * T / t2, floor_ms=floor * 1e3, vs_floor=t2 / floor,
                                 gemm_tflop=gemm_flops(gemms) / 1e12,
                                 vs_sdpa=t2 * 1e3 / sdpa_ms if sdpa_ms else None))
                print(f"  step {shape} refbert (all), adds unfused (bias after the GEMM, paths added by the model):"
                      f" {t2 * 1e3:.2f} ms", flush=True)
                row = graph_row(timer, args, ours, dict(x, mlm_decode="all"), base, "refbert cuda fp32 (all)",
                                floor, sdpa_ms, "vs_sdpa", gemm_tflop=gemm_flops(gemms) / 1e12)
                rows.append(row)
                failed |= "ms" not in row
            if si == 0 and decode == "all":              # replayed last (main): a fault there ends the context
                def probe_step(x=x):
                    ours(**x, mlm_decode="all")
                    ours.backward()
        cp.get_default_memory_pool().free_all_blocks()
    from refbert_kernels.cuda import cuda_c as K
    launch = "launch v2 (packed parameters)" if K.LAUNCH == "2" else "launch v1 (CuPy's RawKernel call)"
    rows.append(dict(impl="versions", note="; ".join([f"{op} {dt}: {v.key}" for (op, dt), v in
                                                      sorted(VV.CHOSEN.items())] + [launch])))
    problems = VV.problems()
    for op, why in problems:
        rows.append(dict(impl="FALLBACK", shape=op, note=why))
    failed |= bool(problems)
    return rows, failed, dict(ours=ours, hf=hf, tmp=tmp, cfg=cfg, probe_step=probe_step)


@contextlib.contextmanager
def _adds_unfused():
    """The step as before the linears lost their adds (an A/B row): the bias added after the GEMM (cublasLt off) and
    the gradient paths added by the model (linear_backward's dx_into off)."""
    from refbert_kernels.cuda import backend as KB, blas
    saved, into = dict(blas._LT), KB.linear_backward.dx_into
    blas._LT.update(lib=None, checked=True, why="off for an A/B row")
    KB.linear_backward.dx_into = False
    try:
        yield
    finally:
        blas._LT.clear()
        blas._LT.update(saved)
        KB.linear_backward.dx_into = into


MIXED = (("bf16-mixed", "bfloat16"), ("fp16-mixed", "float16"))     # precision, torch.autocast dtype


def _mixed(args):
    """MIXED, or its one row that `refbert bench --device cuda --mixed-precision bf16 | fp16` asks for (args.mixed)."""
    want = getattr(args, "mixed", None)
    return [m for m in MIXED if want is None or m[0] == want]


def graph_row(timer, args, ours, x, base, name, floor, peer_ms, peer_key, **extra):
    """The step of `ours` captured as a CUDA graph (refbert_kernels.cuda.graph.StepGraph): validated before it is
    timed by StepGraph's own check, its first replay against the eager step at the same dropout position (a
    RuntimeError beyond graph.REPLAY_TOL). -> a row (with ms, or a note saying why not)."""
    cp = _xp()
    from refbert_kernels.cuda.graph import StepGraph
    impl = f"{name} + CUDA graph"
    g = None
    try:
        ours.train()
        g = StepGraph(ours)
        g(**x)                                       # capture, check, replay
        worst, calls = g.checked[0], g.calls
        t = timer(lambda: g(**x), repeats=max(3, args.repeats // 2))
    except Exception as e:
        print(f"  {base['shape']} {impl}: {_err(e)}", flush=True)
        return dict(base, impl=impl, note=_err(e))
    finally:
        if g is not None:
            g.close()
        cp.cuda.Device().synchronize()
    print(f"  {base['shape']} {impl}: {t * 1e3:.2f} ms" + (f", {t * 1e3 / peer_ms:.2f}x the peer" if peer_ms else "")
          + (f", {t / floor:.2f}x its GEMM floor" if floor else "") + f" (replay = eager within {worst:.1e})",
          flush=True)
    return dict(base, impl=impl, ms=t * 1e3, tokens_per_s=base["B"] * base["T"] / t,
                floor_ms=floor * 1e3 if floor else None, **{peer_key: t * 1e3 / peer_ms if peer_ms else None},
                vs_floor=t / floor if floor else None, **extra,
                note=f"one graph launch a step; replay = eager step within {worst:.1e} of scale, {calls} dropout "
                     f"calls a step")


def time_gemms16(timer, gemms, dtype):
    """Seconds of every product of `gemms` in `dtype` ("bfloat16" / "float16") on cuBLAS through torch, float32
    accumulation (torch's reduced-precision reductions off): the floor of a mixed-precision step."""
    import torch
    dt = getattr(torch, dtype)
    shapes = {}
    for _, b, m, k, n in gemms:
        if (b, m, k, n) not in shapes:
            shapes[(b, m, k, n)] = (torch.randn(b, m, k, device="cuda", dtype=dt),
                                    torch.randn(b, k, n, device="cuda", dtype=dt),
                                    torch.empty(b, m, n, device="cuda", dtype=dt))
    seq = [shapes[(b, m, k, n)] for _, b, m, k, n in gemms]

    def run():
        for a, bb, o in seq:
            torch.matmul(a, bb, out=o)
    return timer(run, repeats=max(3, timer.repeats // 2))


def run_mixed(args, timer):
    """The mixed-precision step rows: refbert backend="cuda" with precision="bf16-mixed" / "fp16-mixed" (refbert.ops'
    spec: 16-bit GEMMs on tensor cores, the fused ops' float32 versions between roundings, the spec's attention)
    against HF + PyTorch sdpa under torch.autocast in bfloat16 / float16, at the step shapes; the 16-bit GEMM floor;
    and each one's eval loss against the float32 model's (what the precision costs). Both sides accumulate 16-bit
    products in float32 (torch's reduced-precision reductions off). -> (rows, failed)"""
    cp = _xp()
    import refbert
    from refbert.bench import batch, hf_model
    cfg = _config(args)
    rows, failed = [], False
    tmp = tempfile.TemporaryDirectory()
    hf = None
    torch = None
    if not args.no_torch:
        try:
            import torch
            import transformers
            _tf32_off()
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
            hf_model(cfg, tmp.name)
            hf = transformers.BertForPreTraining.from_pretrained(tmp.name, attn_implementation="sdpa").cuda()
        except Exception as e:
            rows.append(dict(impl="HF + PyTorch", note=_err(e)))
            hf, torch = None, None
    try:
        ours = refbert.BertForPreTraining.from_pretrained(tmp.name, backend="cuda") if hf is not None else \
            refbert.BertForPreTraining(cfg, seed=0, backend="cuda")
    except Exception as e:
        return [dict(impl="refbert", note=_err(e))], True
    for B, T in step_shapes(args):
        x = batch(B, T, cfg.vocab_size, seed=T)
        n = int((x["labels"] != -100).sum())
        shape = f"B={B} T={T}"
        base = dict(shape=shape, B=B, T=T, labelled=n)
        tx = {k: torch.as_tensor(v, device="cuda") for k, v in x.items()} if hf is not None else None
        ours.precision = "fp32"
        l32 = float(ours.eval()(**x).loss)
        for precision, dtype in _mixed(args):
            hf_ms = None
            if hf is not None:
                with torch.no_grad(), torch.autocast("cuda", dtype=getattr(torch, dtype)):
                    l_hf = float(hf.eval()(**tx).loss)
                m = hf.train()

                def step_hf(m=m, dt=getattr(torch, dtype)):
                    m.zero_grad(set_to_none=True)
                    with torch.autocast("cuda", dtype=dt):
                        loss = m(**tx).loss
                    loss.backward()
                t = timer(step_hf, repeats=max(3, args.repeats // 2))
                held = _hf_held_after_forward(torch, m, tx, getattr(torch, dtype))
                hf_ms = t * 1e3
                floor = time_gemms16(timer, step_gemms(cfg, B, T, n, "all", "hf"), dtype)
                rows.append(dict(base, impl=f"HF + PyTorch sdpa autocast {dtype}", ms=hf_ms, tokens_per_s=B * T / t,
                                 floor_ms=floor * 1e3, held_mb=held / 2 ** 20, note=f"eval loss {l_hf:.5f} (fp32 "
                                 f"{l32:.5f}: rel {abs(l_hf - l32) / max(abs(l32), 1e-30):.1e})"))
                print(f"  mixed {shape} HF autocast {dtype}: {hf_ms:.2f} ms (GEMM floor {floor * 1e3:.2f} ms)",
                      flush=True)
                torch.cuda.empty_cache()
            try:
                ours.precision = precision
                l_ours = float(ours.eval()(**x).loss)
                ours.train()

                def step_ours():
                    ours(**x, mlm_decode="all")
                    ours.backward()
                t = timer(step_ours, repeats=max(3, args.repeats // 2))
            except Exception as e:
                rows.append(dict(base, impl=f"refbert cuda {precision}", note=_err(e)))
                failed = True
                print(f"  mixed {shape} refbert {precision}: {_err(e)}", flush=True)
                continue
            floor = time_gemms16(timer, step_gemms(cfg, B, T, n, "all"), dtype) if torch is not None else None
            rows.append(dict(base, impl=f"refbert cuda {precision} (all)", ms=t * 1e3, tokens_per_s=B * T / t,
                             floor_ms=floor * 1e3 if floor else None, vs_hf=t * 1e3 / hf_ms if hf_ms else None,
                             held_mb=_held_after_forward(ours, x) / 2 ** 20,
                             note=f"eval loss {l_ours:.5f} (fp32 {l32:.5f}: rel "
                             f"{abs(l_ours - l32) / max(abs(l32), 1e-30):.1e})"))
            print(f"  mixed {shape} refbert {precision}: {t * 1e3:.2f} ms" +
                  (f", {t * 1e3 / hf_ms:.2f}x HF autocast" if hf_ms else "") +
                  (f", {t / floor:.2f}x its 16-bit GEMM floor ({floor * 1e3:.2f} ms)" if floor else ""), flush=True)
            row = graph_row(timer, args, ours, dict(x, mlm_decode="all"), base, f"refbert cuda {precision} (all)",
                            floor, hf_ms, "vs_hf")
            rows.append(row)
            failed |= "ms" not in row
            if precision == "bf16-mixed":                # A/B: every GEMM operand made by a round16 pass
                had = os.environ.get("REFBERT_MIXED_TWINS")
                os.environ["REFBERT_MIXED_TWINS"] = "0"
                try:
                    row = graph_row(timer, args, ours, dict(x, mlm_decode="all"), base,
                                    f"refbert cuda {precision} (all), no twins", floor, hf_ms, "vs_hf")
                    row["held_mb"] = _held_after_forward(ours, x) / 2 ** 20     # what it keeps as float32
                finally:
                    if had is None:
                        del os.environ["REFBERT_MIXED_TWINS"]
                    else:
                        os.environ["REFBERT_MIXED_TWINS"] = had
                rows.append(row)
                failed |= "ms" not in row
                for attention in ("S3", "S4"):           # A/B: the attention as csrc/mixed.cu's flash kernels
                    row = attention_row(timer, args, ours, dict(x, mlm_decode="all"), base, precision, attention,
                                        floor, hf_ms)
                    rows.append(row)
                    failed |= "ms" not in row or not row["attention_ran"]
                row = layernorm_v2_row(timer, args, ours, dict(x, mlm_decode="all"), base, precision, floor, hf_ms)
                rows.append(row)
                failed |= "ms" not in row or not row["layernorm_v2_ran"]
                row = layernorm_bwd_v6_row(timer, args, ours, dict(x, mlm_decode="all"), base, precision, floor,
                                           hf_ms)
                rows.append(row)
                failed |= "ms" not in row or not row["layernorm_bwd_v6_ran"]
                row = bias_gelu_bwd_v2_row(timer, args, ours, dict(x, mlm_decode="all"), base, precision, floor,
                                           hf_ms)
                rows.append(row)
                failed |= "ms" not in row or not row["bias_gelu_bwd_v2_ran"]
                row = gelu_fwd_v3_row(timer, args, ours, dict(x, mlm_decode="all"), base, precision, floor, hf_ms)
                rows.append(row)
                failed |= "ms" not in row or not row["gelu_fwd_v3_ran"]
        cp.get_default_memory_pool().free_all_blocks()
    ours.precision = "fp32"
    return rows, failed


def _recorded(step):
    """Every CUDA C launch one call of step() makes, as cuda_c.RECORD holds them: [(name, kernel, grid, block, args,
    kw)] in launch order."""
    from refbert_kernels.cuda import cuda_c as K
    K.RECORD = []
    try:
        step()
    finally:
        recorded, K.RECORD = K.RECORD, None
    return recorded


def _kernels_of_step(ours, x):
    """The names of the CUDA C kernels one eager training step of `ours` on batch x launches."""
    def step():
        ours(**x)
        ours.backward()
    return {name for name, *_ in _recorded(step)}


def _variant_row(timer, args, ours, x, base, precision, floor, peer_ms, var, value, label, key, prefix, is_variant):
    """An A/B row of the mixed section: the step's CUDA graph with the kernel variant var=value, its label `label`
    (e.g. "layernorm forward v2"); the note names the kernels starting with `prefix` one eager step of it launched,
    and row[key] says whether every one of them is the variant's (is_variant(name))."""
    from refbert_kernels.cuda import versions as VV
    with VV.kernel_variant(var, value):
        names = _kernels_of_step(ours, x)
        row = graph_row(timer, args, ours, x, base, f"refbert cuda {precision} (all), {label}", floor, peer_ms,
                        "vs_hf")
    got = sorted(n for n in names if n.startswith(prefix))
    row[key] = ran = bool(got) and all(is_variant(n) for n in got)
    row["note"] = (f"{label.rsplit(' ', 1)[0]}s {', '.join(got)}" if ran else
                   f"{label} did NOT run alone: {', '.join(got) or 'none'}") + \
        ("; " + row["note"] if row.get("note") else "")
    return row


def layernorm_v2_row(timer, args, ours, x, base, precision, floor, peer_ms):
    """The residual layernorms' forward as layernorm.cu's version 2 (REFBERT_MIXED_LN=2) in place of the default
    version 3 (the same bits): _variant_row."""
    return _variant_row(timer, args, ours, x, base, precision, floor, peer_ms, "REFBERT_MIXED_LN", "2",
                        "layernorm forward v2", "layernorm_v2_ran", "layernorm_fwd_v",
                        lambda n: n.startswith("layernorm_fwd_v2_"))


def layernorm_bwd_v6_row(timer, args, ours, x, base, precision, floor, peer_ms):
    """The layernorms' backward as layernorm.cu's version 6 (dx and the dw, db partials in one pass:
    REFBERT_MIXED_LN_BWD=6) in place of the default, version 2's dx kernel and version 3's partials:
    _variant_row."""
    return _variant_row(timer, args, ours, x, base, precision, floor, peer_ms, "REFBERT_MIXED_LN_BWD", "6",
                        "layernorm backward v6", "layernorm_bwd_v6_ran", "layernorm_bwd_", lambda n: "fused_v6" in n)


def bias_gelu_bwd_v2_row(timer, args, ours, x, base, precision, floor, peer_ms):
    """The bias + GELU backward as gelu.cu's version 2 (a thread per (chunk, 4 columns), 4 rows of loads at a time:
    REFBERT_MIXED_GELU_BWD=2) in place of the default version 1 (the same bits): _variant_row."""
    return _variant_row(timer, args, ours, x, base, precision, floor, peer_ms, "REFBERT_MIXED_GELU_BWD", "2",
                        "bias_gelu backward v2", "bias_gelu_bwd_v2_ran", "bias_gelu_bwd_",
                        lambda n: n.startswith("bias_gelu_bwd_v2_"))


def gelu_fwd_v3_row(timer, args, ours, x, base, precision, floor, peer_ms):
    """The GELUs' forward as gelu.cu's version 3 (a grid-stride loop, the next groups prefetched into L2:
    REFBERT_MIXED_GELU_FWD=3) in place of the default version 1 (the same bits): _variant_row."""
    return _variant_row(timer, args, ours, x, base, precision, floor, peer_ms, "REFBERT_MIXED_GELU_FWD", "3",
                        "GELU forward v3", "gelu_fwd_v3_ran", "gelu_fwd_", lambda n: n.startswith("gelu_fwd_v3_"))


def attention_row(timer, args, ours, x, base, precision, attention, floor, peer_ms):
    """An A/B row of the mixed section: the step's CUDA graph with the mixed attention `attention` ("S3": the spec
    as csrc/mixed.cu's tensor-core flash kernels, no (B, H, T, T) array; "S4": S3 with a Philox call per 4 scores,
    S3's bits) in place of the default S2 (refbert_kernels.cuda.mixed.ATTENTION, REFBERT_MIXED_ATTENTION's).
    Its note says whether the flash kernels ran (they take head size 64: elsewhere S2 runs, and the row says so)."""
    from refbert_kernels.cuda import versions as VV
    key = ("attention", "bfloat16" if precision == "bf16-mixed" else "float16", attention)
    before = VV.RAN.get(key, 0)
    with VV.kernel_variant("REFBERT_MIXED_ATTENTION", attention):
        row = graph_row(timer, args, ours, x, base, f"refbert cuda {precision} (all), attention {attention}", floor,
                        peer_ms, "vs_hf")
    row["attention_ran"] = ran = VV.RAN.get(key, 0) > before
    row["note"] = (f"attention {attention} ran" if ran else f"attention {attention} did NOT run (S2 did: head size "
                   f"{ours.config.hidden_size // ours.config.num_attention_heads}, the flash kernels take 64)") + \
        ("; " + row["note"] if row.get("note") else "")
    return row


# ----------------------------------------------------------------------------------------------------------------
# the optimizer step: refbert's multi-tensor kernels and per-array code against torch.optim.AdamW

def _config(args):
    from refbert.config import BertConfig
    if getattr(args, "config", "base") == "base":
        return BertConfig.preset("base")
    return BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=1,
                      intermediate_size=96, max_position_embeddings=512)   # (head size 64, as base's)


def run_optim(args, timer):
    """Rows of the optim section (module docstring) -> (rows, failed)."""
    cp = _xp()
    import refbert
    from refbert import optim
    host = refbert.BertForPreTraining(_config(args), seed=0).parameters()      # names, shapes, initial values
    n_params = sum(int(a.size) for a in host.values())
    rng = np.random.default_rng(0)
    grads_h = {k: (rng.standard_normal(a.shape) * 1e-2).astype(np.float32) for k, a in host.items()}
    base = dict(tensors=len(host), parameters=n_params)
    rows, failed = [], False
    had = os.environ.get(optim.FUSED_ENV)

    def set_fused(on):
        os.environ[optim.FUSED_ENV] = "1" if on else "0"

    try:
        # validate: one step on copies, the kernels against the per-array code, bit for bit
        res = {}
        for on in (True, False):
            set_fused(on)
            params = {k: cp.asarray(a) for k, a in host.items()}
            optim.AdamW(params, lr=1e-4, weight_decay=0.01).step({k: cp.asarray(g) for k, g in grads_h.items()})
            res[on] = ({k: a.get() for k, a in params.items()},
                       optim.LAST_PATH.get("AdamW.step"))
        same = all(np.array_equal(res[True][0][k].view(np.uint32), res[False][0][k].view(np.uint32)) for k in host)
        ok = same and res[True][1] == optim.FUSED
        failed |= not ok
        rows.append(dict(base, impl="check", note=f"one AdamW step, kernels = per-array code bit for bit: "
                         f"{'yes' if same else 'NO'}; path {res[True][1]}"))
        print(f"  {rows[-1]['note']}", flush=True)
        params = {k: cp.asarray(a) for k, a in host.items()}
        grads = {k: cp.asarray(g) for k, g in grads_h.items()}
        opt = optim.AdamW(params, lr=1e-4, weight_decay=0.01)
        for on, impl in ((True, "refbert multi-tensor kernels (optim.cu v1)"), (False, "refbert per-array code")):
            set_fused(on)

            def step():
                optim.clip_grad_norm(grads, 1.0)
                opt.step(grads, lr=1e-4)
            step()
            path = optim.LAST_PATH.get("AdamW.step")
            t = timer(step, repeats=max(3, args.repeats // (1 if on else 4)))
            rows.append(dict(base, impl=impl, ms=t * 1e3, note=path))
            print(f"  {impl:44s} {t * 1e3:8.3f} ms  ({path})", flush=True)
    finally:
        if had is None:
            os.environ.pop(optim.FUSED_ENV, None)
        else:
            os.environ[optim.FUSED_ENV] = had
    if not args.no_torch:
        try:
            import torch
            tp = [torch.nn.Parameter(torch.as_tensor(a, device="cuda")) for a in host.values()]
            for p, g in zip(tp, grads_h.values()):
                p.grad = torch.as_tensor(g, device="cuda")
            decay = [p for (k, _), p in zip(host.items(), tp) if not any(s in k for s in ("bias", "LayerNorm.weight"))]
            exempt = [p for (k, _), p in zip(host.items(), tp) if any(s in k for s in ("bias", "LayerNorm.weight"))]
            groups = [dict(params=decay, weight_decay=0.01), dict(params=exempt, weight_decay=0.0)]
            for kw in (dict(foreach=True), dict(fused=True)):
                topt = torch.optim.AdamW(groups, lr=1e-4, eps=1e-6, **kw)

                def tstep(topt=topt):
                    torch.nn.utils.clip_grad_norm_(tp, 1.0, foreach=True)
                    topt.step()
                tstep()
                t = timer(tstep)
                name = "torch.optim.AdamW " + ", ".join(f"{k}=True" for k in kw)
                rows.append(dict(base, impl=name, ms=t * 1e3, note="clip_grad_norm_(foreach=True) + step"))
                print(f"  {name:44s} {t * 1e3:8.3f} ms", flush=True)
        except Exception as e:
            rows.append(dict(base, impl="torch.optim.AdamW", note=_err(e)))
    fused_ms = next((r["ms"] for r in rows if r["impl"] == "torch.optim.AdamW fused=True" and "ms" in r), None)
    for r in rows:
        if "ms" in r and fused_ms:
            r["x_torch_fused"] = r["ms"] / fused_ms
    return rows, failed


def optim_md(rows):
    return md_table(["impl", "tensors", "parameters", "ms (clip + AdamW step)", "x torch fused", "note"],
                    [[r["impl"], r.get("tensors", ""), f"{r.get('parameters', 0):,}", fmt(r.get("ms")),
                      fmt(r.get("x_torch_fused")), r.get("note", "")] for r in rows])


def _held_after_forward(ours, x, decode="all"):
    """Device bytes a training forward of refbert (mlm_decode=decode) leaves held for its backward (the memory pool's
    used bytes after it, less before); the backward then runs, releasing them."""
    cp = _xp()
    cp.cuda.Device().synchronize()
    before = _pool_bytes()
    ours(**x, mlm_decode=decode)
    cp.cuda.Device().synchronize()
    held = _pool_bytes() - before
    ours.backward()
    return held


def _hf_held_after_forward(torch, m, tx, autocast=None):
    """The same for HF's model m (torch's allocated bytes), its forward under torch.autocast(autocast) when given;
    the backward then runs and the gradients are dropped."""
    m.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    if autocast is None:
        out = m(**tx)
    else:
        with torch.autocast("cuda", dtype=autocast):
            out = m(**tx)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    out.loss.backward()
    del out
    m.zero_grad(set_to_none=True)
    return held


def mixed_md(rows):
    head = ("impl", "shape", "ms (fwd + bwd)", "tokens/s", "x HF autocast", "16-bit GEMM floor ms", "x floor",
            "MiB held after fwd", "note")
    return md_table(head, [(r["impl"], r.get("shape", ""), fmt(r.get("ms")), fmt(r.get("tokens_per_s"), ".0f"),
                            fmt(r.get("vs_hf"), ".2f"), fmt(r.get("floor_ms")),
                            fmt(r.get("ms") / r["floor_ms"] if r.get("ms") and r.get("floor_ms") else None, ".2f"),
                            fmt(r.get("held_mb"), ".0f"), r.get("note", "")) for r in rows])


def launch_probe(step, repeats=200):
    """Every CUDA C kernel one call of step() launches, replayed `repeats` times back to back with the step's own
    arguments: host microseconds per launch (the wall time of the loop / repeats, the device drained before and
    after), as the model launches it (cuda_c.LAUNCH: version 2, packed parameters, unless pinned) and through CuPy's
    RawKernel call (version 1), the two interleaved kernel by kernel. -> rows [dict(kernel, calls_per_step, host_us,
    launch, rawkernel_us)] (rawkernel_us None where the model's launch is version 1 already)."""
    cp = _xp()
    repeats = repeats if not emulated() else 2
    recorded = _recorded(step)
    first, calls = {}, {}
    for name, fn, grid, block, args, kw in recorded:
        calls[name] = calls.get(name, 0) + 1
        first.setdefault(name, (fn, grid, block, args, kw))

    def timed(fn, grid, block, args, kw):
        cp.cuda.Device().synchronize()
        t = time.perf_counter()
        for _ in range(repeats):
            fn(grid, block, args, **kw)               # kw: shared_mem (the attention kernels' ~100 KB) and the like
        host = (time.perf_counter() - t) / repeats * 1e6
        cp.cuda.Device().synchronize()
        return host
    rows = []
    for name, (fn, grid, block, args, kw) in first.items():
        raw = getattr(fn, "raw", None)                # cuda_c.Packed keeps the RawKernel it launches
        rows.append(dict(kernel=name, calls_per_step=calls[name], host_us=timed(fn, grid, block, args, kw),
                         launch="v2 packed" if raw is not None else "v1 RawKernel",
                         rawkernel_us=timed(raw, grid, block, args, kw) if raw is not None else None))
    return sorted(rows, key=lambda r: -r["calls_per_step"])


# ----------------------------------------------------------------------------------------------------------------
# the profile: device time by kernel, launches per step, busy against wall

def profile_table(events, steps, wall_s, top=25):
    """Aggregate device events [(name, device_us, kind)] (kind "kernel", "memcpy" or "memset") of `steps` steps
    that took wall_s seconds: -> (summary dict, rows [dict(name, calls_per_step, ms_per_step, pct)]) with rows the
    `top` names by device time."""
    by = {}
    for name, us, kind in events:
        d = by.setdefault(name, [0.0, 0, kind])
        d[0] += us
        d[1] += 1
    busy = sum(v[0] for v in by.values()) / 1e3 / max(steps, 1)
    count = {k: sum(v[1] for v in by.values() if v[2] == k) / max(steps, 1) for k in ("kernel", "memcpy", "memset")}
    summary = dict(steps=steps, launches_per_step=sum(count.values()), kernels_per_step=count["kernel"],
                   copies_per_step=count["memcpy"], memsets_per_step=count["memset"], gpu_busy_ms=busy,
                   wall_ms=wall_s * 1e3 / max(steps, 1),
                   busy_pct=100.0 * busy / (wall_s * 1e3 / steps) if wall_s > 0 and steps else None)
    rows = [dict(name=name, calls_per_step=c / max(steps, 1), ms_per_step=us / 1e3 / max(steps, 1),
                 pct=100.0 * us / 1e3 / max(steps, 1) / busy if busy else None)
            for name, (us, c, _) in sorted(by.items(), key=lambda kv: -kv[1][0])[:top]]
    return summary, rows


def _device_events(prof):
    """[(name, device_us, kind)] of a torch.profiler run: every CUDA-side event (CUPTI sees CuPy's and Numba's
    kernels too), from key_averages (one entry per name, with its count)."""
    from torch.autograd import DeviceType
    out = []
    for e in prof.key_averages():
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        name = e.key
        kind = "memcpy" if "memcpy" in name.lower() else "memset" if "memset" in name.lower() else "kernel"
        for _ in range(max(1, e.count) - 1):
            out.append((name, 0.0, kind))
        out.append((name, float(us), kind))
    return out


def run_profile(args, models, steps=3):
    """torch.profiler over `steps` steps of refbert (both decoders) and HF sdpa at the first --step shape.
    -> {impl: (summary, rows)} or {impl: error text}."""
    cp = _xp()
    from refbert.bench import batch
    if emulated():
        return {"profile": "not on the emulator (no CUPTI)"}
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError as e:
        return {"profile": f"torch.profiler unavailable: {e}"}
    B, T = step_shapes(args)[0]
    cfg, ours, hf = models["cfg"], models["ours"], models["hf"]
    x = batch(B, T, cfg.vocab_size, seed=T)
    runs = {f"refbert cuda fp32 ({d})": (lambda d=d: (ours(**x, mlm_decode=d), ours.backward()))
            for d in ("all", "labelled")}
    precisions = {}
    graphs = {}

    def graph_step(precision):                      # captured at its first call, under the precision set then
        from refbert_kernels.cuda.graph import StepGraph
        if precision not in graphs:
            graphs[precision] = StepGraph(ours)
        graphs[precision](**x, mlm_decode="all")
    runs["refbert cuda fp32 (all) + CUDA graph"] = lambda: graph_step("fp32")
    if "mixed" in (args.only or ["mixed"]):
        for precision, _ in _mixed(args):
            runs[f"refbert cuda {precision} (all)"] = lambda: (ours(**x, mlm_decode="all"), ours.backward())
            precisions[f"refbert cuda {precision} (all)"] = precision
        runs["refbert cuda bf16-mixed (all) + CUDA graph"] = lambda: graph_step("bf16-mixed")
        precisions["refbert cuda bf16-mixed (all) + CUDA graph"] = "bf16-mixed"
    ours.train()
    if "sdpa" in hf:
        tx = {k: torch.as_tensor(v, device="cuda") for k, v in x.items()}
        m = hf["sdpa"].train()
        runs["HF + PyTorch sdpa fp32"] = lambda: (m.zero_grad(set_to_none=True), m(**tx).loss.backward())

        def autocast_step(dt):
            m.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=dt):
                loss = m(**tx).loss
            loss.backward()
        if precisions:
            runs["HF + PyTorch sdpa autocast bfloat16"] = lambda: autocast_step(torch.bfloat16)
    out = {}
    for impl, fn in runs.items():
        try:
            ours.precision = precisions.get(impl, "fp32")
            fn()
            torch.cuda.synchronize()
            cp.cuda.Device().synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t = time.perf_counter()
                for _ in range(steps):
                    fn()
                torch.cuda.synchronize()
                cp.cuda.Device().synchronize()
                wall = time.perf_counter() - t
            out[impl] = profile_table(_device_events(prof), steps, wall)
            s = out[impl][0]
            print(f"  profile {impl} B={B} T={T}: {s['launches_per_step']:.0f} launches / step, GPU busy "
                  f"{s['gpu_busy_ms']:.1f} of {s['wall_ms']:.1f} ms", flush=True)
            if impl in precisions:                       # where the host time of a mixed step goes (the log only)
                import cProfile
                import pstats
                host = cProfile.Profile()
                host.enable()
                fn()
                cp.cuda.Device().synchronize()
                host.disable()
                pstats.Stats(host).sort_stats("tottime").print_stats(18)
        except Exception as e:
            out[impl] = _err(e, 300)
            print(f"  profile {impl}: {out[impl]}", flush=True)
        for g in graphs.values():                   # (each graph holds a step's memory)
            g.close()
        graphs.clear()
    ours.precision = "fp32"
    return out


# ----------------------------------------------------------------------------------------------------------------
# reports

def versions_info():
    from importlib import metadata
    out = {"python": sys.version.split()[0]}
    for dist in ("numpy", "numba", "numba-cuda", "cupy-cuda13x", "cupy-cuda12x", "torch", "transformers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def kernels_md(rows, bw):
    lines = [f"Copy bandwidth (device-to-device copy of {COPY_BYTES >> 20} MiB): {bw / 1e9:.0f} GB/s.", "",
             "Validation (err/tol <= 1 passes):", ""]
    lines += md_table(("kernel", "version", "status", "err/tol", "idea"),
                      [(r["spec"], f"v{r['version']}" if r.get("version") else "—", r["status"],
                        fmt(r.get("err_tol")), r.get("error") or r.get("note", ""))
                       for r in rows if "status" in r])
    lines += ["", "Timings (median CUDA-event ms, L2 flushed before each call): fwd / bwd ms as called (events around "
              "the call: its host work included), device ms the GPU's work alone (the call's launches queued while a "
              "blocking kernel held the stream; — where a call synchronises inside, as Numba's launches on CuPy "
              "arrays do); GB/s of forward + backward, % copy and TFLOP/s of the device times where there are both, "
              "else of the times as called (the column \"of\" says which):", ""]
    lines += md_table(("kernel", "shape", "dtype", "impl", "fwd ms", "bwd ms", "fwd device ms", "bwd device ms",
                       "GB/s", "% copy", "fwd TFLOP/s", "bwd TFLOP/s", "of", "note"),
                      [(r["spec"], r["shape"], r["dtype"], r["impl"], fmt(r.get("fwd_ms")), fmt(r.get("bwd_ms")),
                        fmt(r.get("fwd_dev_ms")), fmt(r.get("bwd_dev_ms")), fmt(r.get("gbps")),
                        fmt(r.get("pct_copy"), ".0f"), fmt(r.get("fwd_tflops")), fmt(r.get("bwd_tflops")),
                        r.get("rates_of", "call") if r.get("fwd_ms") is not None else "", r.get("note", ""))
                       for r in rows if "impl" in r])
    return lines


def step_md(rows):
    head = ("impl", "shape", "ms (fwd + bwd)", "tokens/s", "x HF sdpa", "GEMM floor ms", "x floor",
            "MiB held after fwd", "note")
    return md_table(head, [(r["impl"], r.get("shape", ""), fmt(r.get("ms")), fmt(r.get("tokens_per_s"), ".0f"),
                            fmt(r.get("vs_sdpa"), ".2f"), fmt(r.get("floor_ms")),
                            fmt(r.get("ms") / r["floor_ms"] if r.get("ms") and r.get("floor_ms") else None, ".2f"),
                            fmt(r.get("held_mb"), ".0f"), r.get("note", "")) for r in rows])


def launch_md(rows):
    lines = ["Host time per launch of every CUDA C kernel one step runs (the first shape, decode all), replayed "
             "with the step's own arguments (target: <= 10 us), as the model launches it (launch version 2: "
             "parameters packed once a call, cuLaunchKernel; REFBERT_LAUNCH=1 pins version 1) and through CuPy's "
             "RawKernel call (version 1):", ""]
    return lines + md_table(("kernel", "launches / step", "launch", "host us / launch", "v1 RawKernel us"),
                            [(r["kernel"], r["calls_per_step"], r.get("launch", "v1 RawKernel"), fmt(r["host_us"]),
                              fmt(r.get("rawkernel_us"))) for r in rows])


def profile_md(prof):
    lines = []
    for impl, res in prof.items():
        lines += [f"### {impl}", ""]
        if isinstance(res, str):
            lines += [f"failed: {res}", ""]
            continue
        s, rows = res
        lines += [f"{s['launches_per_step']:.0f} device events per step ({s['kernels_per_step']:.0f} kernels, "
                  f"{s['copies_per_step']:.0f} copies, {s['memsets_per_step']:.0f} memsets); GPU busy "
                  f"{s['gpu_busy_ms']:.2f} ms of {s['wall_ms']:.2f} ms wall per step ({fmt(s['busy_pct'], '.0f')}%), "
                  f"{s['steps']} steps profiled.", ""]
        lines += md_table(("kernel", "calls / step", "ms / step", "% of GPU time"),
                          [(r["name"][:90], fmt(r["calls_per_step"], ".3g"), fmt(r["ms_per_step"], ".3f"),
                            fmt(r["pct"], ".1f")) for r in rows]) + [""]
    return lines


def probes_md(bw, launch):
    lines = [f"Copy bandwidth: {bw / 1e9:.0f} GB/s (device-to-device, {COPY_BYTES >> 20} MiB).", "",
             "Launch overhead (reported apart from every kernel time):", ""]
    lines += md_table(("kernel", "wall us / launch (back to back)", "event us (one launch)"),
                      [(k, fmt(w), fmt(e)) for k, (w, e) in launch.items()])
    return lines


def plot_kernels(rows, path, device):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    timed = [r for r in rows if r.get("pct_copy") is not None and r["spec"] != "attention"]
    att = [r for r in rows if r.get("fwd_tflops") is not None]
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    if timed:
        labels = [f"{r['spec']} {r['impl']}" for r in timed]
        axes[0].barh(labels, [r["pct_copy"] for r in timed])
        axes[0].set_xlabel("% of copy bandwidth (forward + backward)")
    for impl in dict.fromkeys(r["impl"] for r in att):
        for dt in ("float32", "float16"):
            pts = [r for r in att if r["impl"] == impl and r["dtype"] == dt]
            if pts:
                axes[1].plot([int(re.search(r"T=(\d+)", p["shape"]).group(1)) for p in pts],
                             [p["fwd_tflops"] for p in pts], "o-", label=f"{impl} {dt}")
    axes[1].set_xlabel("T")
    axes[1].set_ylabel("forward TFLOP/s")
    axes[1].set_xscale("log", base=2)
    axes[1].legend(fontsize=7)
    fig.suptitle(f"refbert CUDA kernels on {device}")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write(out, name, title, header, md_lines, data, plot=None):
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, f"{name}.md"), os.path.join(out, f"{name}.json")]
    with open(paths[0], "w") as f:
        f.write("\n".join([f"# {title}", "", *header, "", *md_lines]) + "\n")
    with open(paths[1], "w") as f:
        json.dump(data, f, indent=1, default=lambda o: o.item() if isinstance(o, np.generic) else str(o))
        f.write("\n")
    if plot is not None:
        try:
            plot(os.path.join(out, f"{name}.png"))
            paths.append(os.path.join(out, f"{name}.png"))
        except ImportError:
            pass
    return paths


def precision_md(rows, precision):
    """The precision study's rows (refbert.precision.study) as markdown."""
    lines = [precision.LEGEND, "", "| mode | op | dtype | tensor | max ulp | mean ulp | norm ulp | cond ulp | f32 max "
             "| note |", "|---|---|---|---|---|---|---|---|---|---|"]
    f = precision._f
    for m, op, dt, t, mx, mean, norm, cond, f32, note in rows:
        lines.append(f"| {m} | {op} | {dt} | {t} | {f(mx, '.2f')} | {f(mean, '.3f')} | {f(norm, '.2f')} | "
                     f"{f(cond, '.2f')} | {f(f32, '.3f')} | {note} |")
    return lines


def main(args=None):
    """args: a Namespace from refbert's CLI, or argv (a list), or None (sys.argv). Returns 0, 1 (a validation, a
    fallback or a step check failed; every file is still written) or 2 (no GPU: nothing run). The measured order
    this run sets for its own later sections (REFBERT_CUDA_ORDER) is unset when it returns."""
    had = os.environ.get("REFBERT_CUDA_ORDER")
    try:
        return _main(args)
    finally:
        if had is None and os.environ.pop("REFBERT_CUDA_ORDER", None) is not None:
            from refbert_kernels.cuda import versions as VV
            VV.CHOSEN.clear()


def _main(args):
    spent = Spent()
    if args is None or isinstance(args, (list, tuple)):
        args = parse(args)
    for key, default in (("quick", False), ("only", None), ("out", None), ("repeats", None), ("kernels", None),
                         ("validate_dtypes", ["float32", "float16"]), ("attention_T", None), ("step", None),
                         ("step_T", None), ("no_torch", False), ("no_plot", False), ("mixed", None)):
        if not hasattr(args, key):
            setattr(args, key, default)
    args = defaults(args)
    step_shapes(args)                                   # a bad --step is a ValueError before anything runs
    import warnings
    warnings.filterwarnings("ignore", message=".*(under-utilization|copy overhead)")   # Numba's occupancy and
    #                                  host-array notes, printed at every small validation launch: noise here
    ok, device = gpu_available()
    if not ok:
        print(f"refbert bench --device cuda: SKIPPED, no GPU to run on: {device}")
        return 2
    out = args.out or os.path.join(DEFAULT_OUT, f"cuda-{slug(device)}")
    command = command_line(args)
    info = dict(device=device, **versions_info())
    header = ["Command:", "", f"    {command}", "",
              f"Device: {device}; " + ", ".join(f"{k} {v}" for k, v in info.items() if k != "device")
              + f". Date: {time.strftime('%Y-%m-%d %H:%M %Z')}."]
    if args.quick:
        header += ["", "**--quick: a tooling check with few repeats and small shapes; not results.**"]
    with spent.section("setup"):                        # (the backend, the timer and its blocking kernel)
        from refbert.model import get_backend
        backend = get_backend("cuda")
        print(backend.describe(), flush=True)
        timer = Timer(args.repeats)
    print(f"== probes on {device}", flush=True)
    with spent.section("probes"):
        bw = copy_bandwidth(timer)
        launch = launch_overhead()
    print(f"  copy bandwidth {bw / 1e9:.0f} GB/s; " + "; ".join(f"{k}: {w:.1f} us" for k, (w, _) in launch.items()))
    paths = write(out, "cuda_probes", f"refbert CUDA probes on {device}", header, probes_md(bw, launch),
                  dict(command=command, info=info, copy_bandwidth=bw, launch_us=launch))
    failed = False
    sections = args.only or ["kernels", "precision", "step", "mixed", "optim", "profile"]
    if "kernels" in sections:
        print("== kernels", flush=True)
        with spent.section("kernels"):
            rows, bad, timings = run_kernels(args, timer, bw, spent)
        failed |= bad
        paths += write(out, "cuda_kernels", f"refbert CUDA kernels on {device}", header, kernels_md(rows, bw),
                       dict(command=command, info=info, copy_bandwidth=bw, rows=rows),
                       None if args.no_plot else lambda p: plot_kernels(rows, p, device))
        if timings:
            from refbert_kernels.cuda import versions as VV
            path = os.path.join(out, "cuda_order.json")
            VV.write_order(path, device, timings)
            paths.append(path)
            print(f"  measured order: REFBERT_CUDA_ORDER={path} makes the backend use it", flush=True)
            if not os.environ.get("REFBERT_CUDA_ORDER"):   # the rest of this run uses it (a user's own order stays)
                os.environ["REFBERT_CUDA_ORDER"] = path
                VV.CHOSEN.clear()
                print("  the sections below run the measured order", flush=True)
    if "precision" in sections:
        print("== precision", flush=True)              # the same study as `refbert check --device cuda`
        from . import precision
        with spent.section("precision"):
            rows = precision.study(device="cuda", size="tiny" if args.quick else "base")
        paths += write(out, "cuda_precision", f"refbert reduced-precision study on {device}", header,
                       precision_md(rows, precision), dict(command=command, info=info, rows=rows))
    models = None
    if "step" in sections or "profile" in sections:
        print("== step", flush=True)
        with spent.section("step"):
            step_rows, bad, models = run_step(args, timer)
        failed |= bad
        paths += write(out, "cuda_step", f"refbert training step on {device}", header,    # (again with the probe)
                       step_md(step_rows), dict(command=command, info=info, rows=step_rows))
    if "mixed" in sections:
        print("== mixed precision step", flush=True)
        with spent.section("mixed"):
            mixed_rows, bad = run_mixed(args, timer)
        failed |= bad
        paths += write(out, "cuda_mixed", f"refbert mixed-precision training step on {device}", header,
                       mixed_md(mixed_rows), dict(command=command, info=info, rows=mixed_rows))
    if "optim" in sections:
        print("== optimizer step", flush=True)
        with spent.section("optim"):
            optim_rows, bad = run_optim(args, timer)
        failed |= bad
        paths += write(out, "cuda_optim", f"refbert optimizer step on {device}", header, optim_md(optim_rows),
                       dict(command=command, info=info, rows=optim_rows))
    if "profile" in sections and models is not None:
        print("== profile", flush=True)
        with spent.section("profile"):
            prof = run_profile(args, models)
        failed |= any(isinstance(v, str) for v in prof.values())
        paths += write(out, "cuda_profile", f"refbert training step profiled on {device}", header,
                       profile_md(prof), dict(command=command, info=info,
                                              profile={k: (v if isinstance(v, str) else dict(summary=v[0], rows=v[1]))
                                                       for k, v in prof.items()}))
    if models is not None and models["probe_step"] is not None:   # last: it replays raw launches (a bad one ends
        # the CUDA context, so it can cost nothing measured before it)
        print("== launch probe", flush=True)
        try:
            with spent.section("launch probe"):
                launch_rows = launch_probe(models["probe_step"])
        except Exception as e:
            launch_rows, failed = [dict(kernel=f"launch probe failed: {_err(e)}", calls_per_step=0,
                                        host_us=float("nan"))], True
            print(f"  launch probe: {_err(e)}", flush=True)
        paths += write(out, "cuda_step", f"refbert training step on {device}", header,
                       step_md(step_rows) + [""] + launch_md(launch_rows),
                       dict(command=command, info=info, rows=step_rows, launch=launch_rows))
    print(backend.describe(), flush=True)
    paths += write(out, "cuda_probes", f"refbert CUDA probes on {device}", header,   # (again, with the run's time)
                   probes_md(bw, launch) + [""] + spent.md(),
                   dict(command=command, info=info, copy_bandwidth=bw, launch_us=launch, sections=spent.rows))
    print(spent.line(), flush=True)
    for p in dict.fromkeys(paths):
        print(f"wrote {p}")
    return 1 if failed else 0


if __name__ == "__main__":          # pragma: no cover
    raise SystemExit(main())
