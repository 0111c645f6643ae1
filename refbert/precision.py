"""What reduced precision costs: each fused op's error in ULPs of a 16-bit storage dtype, against the float64 oracle.

For every fused op (softmax with scale and padding mask, layernorm, residual layernorm, dropout + residual
layernorm, bias + GELU, attention with padding and dropout, cross-entropy with ignored rows) and every storage dtype
(float16: NumPy's IEEE half, 10 stored mantissa bits; bfloat16: ml_dtypes', 7 bits, float32's exponent range):

    inputs    drawn in float64 and rounded once to the storage dtype: every implementation, and the reference, sees
              the same (rounded) numbers, so what is measured is the op's own error, not the inputs' rounding
    reference the float64 oracle (refbert.ops) on those rounded inputs, and on the rounded upstream gradient
    "oracle"  mode: the oracle itself computed in float32 on the rounded inputs, every output and gradient rounded
              to the storage dtype once at the end: what storing activations in 16 bits costs when everything in
              between runs in float32 (the best a kernel with float32 accumulation can do, up to its own float32
              error). No GPU is needed.
    device    mode (device="cuda"): the Numba CUDA kernels (refbert_kernels.cuda, through the cuda backend) in their
              fp16 / bf16 storage modes: they read 16-bit inputs, compute in float32 and round once on each store;
              their caches hold what they keep in storage (softmax's p, the attention output read back for D), so
              the backward sees those roundings too. On a GPU the arrays are CuPy's, and CuPy has no bfloat16:
              bf16 runs only in Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, NumPy arrays).

The error of one element is |got - ref| / ulp(ref), ulp(v) = 2^(max(floor(log2|v|), emin) - mantissa bits) of the
storage dtype (1 ulp of 1.0 is 2^-10 in float16 and 2^-7 in bfloat16; below the normal range the subnormal
spacing). A correctly rounded result is within 0.5 ulp. Reported per tensor: the max and the mean over elements,
and "norm" = max |got - ref| / ulp(max |ref|), the error against the tensor's scale: where a gradient is a sum of
cancelling terms (layernorm's dx, softmax's dx) an element far smaller than its terms has a tiny ulp of its own, and
its elementwise ULP error says more about the cancellation than about the op. In the oracle mode the column
"f32 max" is the float32 computation's own error before the final rounding, in the same units: rounding then adds
at most 0.5 ulp (of the rounded value's binade) to it.

`refbert check --precision` prints the oracle table; `refbert check --device cuda` adds the kernels' (main()).
"""
import argparse
import json
import math
from dataclasses import dataclass, field

import numpy as np

from . import ops
from .philox import DropoutRNG
from .tables import text_table

try:
    from ml_dtypes import bfloat16 as _BF16
    from ml_dtypes import finfo as _ml_finfo
except ImportError:                       # pragma: no cover - ml_dtypes comes with the cuda extra
    _BF16 = _ml_finfo = None


# ----------------------------------------------------------------------------------------------------------------
# storage dtypes and ULPs

def storage_dtypes():
    """{name: dtype} of the reduced storage dtypes available here (bfloat16 needs ml_dtypes)."""
    out = {"float16": np.dtype(np.float16)}
    if _BF16 is not None:
        out["bfloat16"] = np.dtype(_BF16)
    return out


def _finfo(dtype):
    dtype = np.dtype(dtype)
    if _BF16 is not None and dtype == np.dtype(_BF16):
        return _ml_finfo(_BF16)
    return np.finfo(dtype)


def dtype_of(name):
    if name in ("float32", "float64"):
        return np.dtype(name)
    d = storage_dtypes()
    if name not in d:
        raise ValueError(f"precision: dtype expected one of {', '.join(['float32', *d])}, got {name!r}"
                         + (" (bfloat16 needs ml_dtypes: pip install ml_dtypes)" if name == "bfloat16" else ""))
    return d[name]


def round_to(x, dtype):
    """x (any float array) rounded to nearest (ties to even) in `dtype`, returned as float64."""
    return np.asarray(x, np.float64).astype(dtype).astype(np.float64)


def ulp(v, dtype):
    """The spacing of `dtype` in the binade of |v| (elementwise, float64): 2^(max(floor(log2|v|), emin) - nmant).
    ulp(1.0, float16) = 2^-10, ulp(1.0, bfloat16) = 2^-7; ulp(0) = the smallest subnormal."""
    fi = _finfo(dtype)
    v = np.abs(np.asarray(v, np.float64))
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(v > 0, v, 1.0)))
    e = np.where(v > 0, np.maximum(e, fi.minexp), fi.minexp)
    e = np.where(np.isfinite(v), e, int(math.log2(float(fi.max))))   # inf: the top binade's spacing
    return np.ldexp(1.0, (e - fi.nmant).astype(np.int64))


def ulp_error(got, ref, dtype):
    """|got - ref| / ulp(ref) elementwise (float64). Equal infinities (a -inf masked score) count 0, a NaN or an
    infinity on one side only counts inf."""
    g, r = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    with np.errstate(invalid="ignore"):
        err = np.abs(g - r) / ulp(r, dtype)
    same = (g == r) | (np.isnan(g) & np.isnan(r))
    return np.where(same, 0.0, np.where(np.isnan(err), np.inf, err))


def summarize(got, ref, dtype):
    """(max ulp, mean ulp, norm ulp) of one tensor: elementwise max and mean, and max |diff| / ulp(max |ref|)."""
    g, r = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if r.size == 0:
        return 0.0, 0.0, 0.0
    e = ulp_error(g, r, dtype)
    fin = np.isfinite(r)
    scale = float(np.abs(r[fin]).max()) if fin.any() else 0.0
    with np.errstate(invalid="ignore"):
        d = np.abs(g - r)
    d = np.where((g == r), 0.0, d)
    norm = float(np.nanmax(d) / ulp(scale, dtype)) if d.size else 0.0
    return float(e.max()), float(e.mean()), norm


# ----------------------------------------------------------------------------------------------------------------
# the ops and their inputs

SIZES = {
    # tiny: the tests (and the simulator); small: the default on a CPU; base: BERT-base-like rows (GPU)
    "tiny": dict(B=1, H=2, T=5, hs=4, R=6, C=16, I=24, V=37),
    "small": dict(B=2, H=4, T=64, hs=32, R=128, C=256, I=512, V=1000),
    "base": dict(B=4, H=12, T=128, hs=64, R=512, C=768, I=3072, V=30522),
}


@dataclass
class Case:
    op: str                 # the table's name, as the KERNELS names of the backends
    forward: str            # the function names in refbert.ops / the device backend
    backward: str
    inputs: dict            # float64 arrays before rounding (the differentiable ones and the masks)
    wrt: tuple              # differentiable inputs, in the backward's order
    kwargs: dict = field(default_factory=dict)   # everything else (rng: a fresh DropoutRNG(seed) per call)
    scalar: bool = False    # the output is a scalar loss: dloss = 1


def _pad_mask(B, T, lengths, lowest):
    m = np.zeros((B, 1, 1, T))
    for b, n in enumerate(lengths):
        m[b, ..., n:] = lowest
    return m


def cases(size="small", seed=0, storage=np.float16):
    """The fused ops at SIZES[size]. Masks use the storage dtype's most negative number, as HF builds its mask
    from finfo(dtype).min (float32's would round to -inf in either 16-bit type)."""
    s = SIZES[size]
    r = np.random.default_rng(seed)
    f = r.standard_normal
    B, H, T, hs, R, C, I, V = (s[k] for k in ("B", "H", "T", "hs", "R", "C", "I", "V"))
    lowest = float(_finfo(storage).min)
    lengths = [T] + [max(1, T // (b + 2)) for b in range(1, B)]
    mask = _pad_mask(B, T, lengths, lowest)
    labels = r.integers(0, V, R)
    labels[r.random(R) < 0.5] = -100
    labels[0] = 1
    p = 0.1
    return [
        Case("softmax", "softmax_forward", "softmax_backward",
             dict(x=f((B, H, T, T)) * math.sqrt(hs), mask=mask), ("x",), dict(scale=1 / math.sqrt(hs))),
        Case("layernorm", "layernorm_forward", "layernorm_backward",
             dict(x=f((R, C)) * 3 + 1, w=1 + 0.1 * f(C), b=0.1 * f(C)), ("x", "w", "b"), dict(eps=1e-12)),
        Case("residual_layernorm", "residual_layernorm_forward", "residual_layernorm_backward",
             dict(x=f((R, C)) * 2, a=f((R, C)) + 0.5, w=1 + 0.1 * f(C), b=0.1 * f(C)), ("x", "a", "w", "b"),
             dict(eps=1e-12)),
        Case("dropout_residual_layernorm", "dropout_residual_layernorm_forward", "dropout_residual_layernorm_backward",
             dict(x=f((R, C)) * 2, a=f((R, C)) + 0.5, w=1 + 0.1 * f(C), b=0.1 * f(C)), ("x", "a", "w", "b"),
             dict(eps=1e-12, p=p, rng=seed + 1, train=True)),
        Case("bias_gelu", "bias_gelu_forward", "bias_gelu_backward",
             dict(x=2 * f((R, I)), b=0.5 * f(I)), ("x", "b"), dict(approximate="none")),
        Case("attention", "attention_forward", "attention_backward",
             dict(q=f((B, T, H * hs)), k=f((B, T, H * hs)), v=f((B, T, H * hs)), mask=mask), ("q", "k", "v"),
             dict(n_heads=H, dropout_p=p, rng=seed + 2, train=True)),
        Case("cross_entropy", "cross_entropy_forward", "cross_entropy_backward",
             dict(logits=3 * f((R, V))), ("logits",), dict(labels=labels), scalar=True),
    ]


OPS = ("softmax", "layernorm", "residual_layernorm", "dropout_residual_layernorm", "bias_gelu", "attention",
       "cross_entropy")


def _kw(case):
    return {k: (DropoutRNG(v) if k == "rng" else v) for k, v in case.kwargs.items()}


def _as_tuple(g):
    return g if isinstance(g, tuple) else (g,)


def _reference(case, rounded, storage, seed):
    """The float64 oracle on the rounded inputs, and on an upstream gradient drawn and rounded to storage (dloss = 1
    for a loss): (out, grads, dout)."""
    fwd, bwd = getattr(ops, case.forward), getattr(ops, case.backward)
    out, cache = fwd(**rounded, **_kw(case))
    dout = np.float64(1.0) if case.scalar else \
        round_to(np.random.default_rng(seed + 100).standard_normal(np.shape(out)), storage)
    g = bwd(dout, cache)
    return np.asarray(out, np.float64), [np.asarray(a, np.float64) for a in _as_tuple(g)], dout


def run_oracle(case, storage, seed=0):
    """The "oracle" mode of one case: [(tensor, max, mean, norm, f32 max)] for out and each gradient."""
    rounded = {k: round_to(v, storage) for k, v in case.inputs.items()}
    ref_out, ref_g, dout = _reference(case, rounded, storage, seed)
    f32 = {k: v.astype(np.float32) for k, v in rounded.items()}
    out, cache = getattr(ops, case.forward)(**f32, **_kw(case))
    g = _as_tuple(getattr(ops, case.backward)(np.asarray(dout).astype(np.float32)[()], cache))
    rows = []
    for name, got, ref in [("out", out, ref_out), *zip((f"d{w}" for w in case.wrt), g, ref_g)]:
        got = np.asarray(got, np.float64)
        mx, mean, norm = summarize(round_to(got, storage), ref, storage)
        rows.append((name, mx, mean, norm, float(ulp_error(got, ref, storage).max()) if ref.size else 0.0))
    return rows


def run_device(case, storage, backend, seed=0):
    """The "device" mode of one case with backend (refbert_kernels.cuda.backend): the kernels in storage dtype.
    [(tensor, max, mean, norm, None)] for out and each gradient."""
    rounded = {k: round_to(v, storage) for k, v in case.inputs.items()}
    ref_out, ref_g, dout = _reference(case, rounded, storage, seed)
    dev = {k: backend.to_device(v.astype(storage)) for k, v in rounded.items()}
    out, cache = getattr(backend, case.forward)(**dev, **_kw(case))
    d = 1.0 if case.scalar else backend.to_device(np.asarray(dout).astype(storage))
    g = _as_tuple(getattr(backend, case.backward)(d, cache))
    rows = []
    for name, got, ref in [("out", out, ref_out), *zip((f"d{w}" for w in case.wrt), g, ref_g)]:
        got = backend.to_host(got)
        if np.asarray(got).dtype != storage:
            raise AssertionError(f"{case.op} {name}: the kernel returned {np.asarray(got).dtype}, expected {storage}")
        rows.append((name, *summarize(np.asarray(got).astype(np.float64), ref, storage), None))
    return rows


def device_backend(device):
    """The backend module of a device name ("cuda"), or the module itself."""
    if not isinstance(device, str):
        return device
    if device != "cuda":
        raise ValueError(f"precision: device expected 'cuda', got {device!r}")
    from .model import get_backend
    return get_backend("cuda")


def _device_skip(backend, op, storage):
    """Why a (device, op, dtype) cannot run, or None."""
    if op in getattr(backend, "FALLBACKS", {}):
        return f"no kernel ({backend.FALLBACKS[op]})"
    if _BF16 is not None and np.dtype(storage) == np.dtype(_BF16) and not getattr(backend, "SIM", True):
        return "CuPy has no bfloat16 arrays: bf16 storage runs in the simulator only"
    return None


def study(dtypes=None, size="small", device=None, ops_=None, seed=0, modes=None):
    """Rows (mode, op, dtype, tensor, max ulp, mean ulp, norm ulp, f32 max ulp or None, note) for every op and
    storage dtype: the "oracle" mode always (unless modes excludes it), the "device" mode when a device is given."""
    dtypes = list(storage_dtypes()) if dtypes is None else list(dtypes)
    modes = modes or (("oracle", "device") if device is not None else ("oracle",))
    backend = device_backend(device) if device is not None and "device" in modes else None
    rows = []
    for name in dtypes:
        storage = dtype_of(name)
        for case in cases(size, seed, storage):
            if ops_ is not None and case.op not in ops_:
                continue
            if "oracle" in modes:
                for t, mx, mean, norm, f32 in run_oracle(case, storage, seed):
                    rows.append(("oracle f32", case.op, name, t, mx, mean, norm, f32, ""))
            if backend is not None:
                why = _device_skip(backend, case.op, storage)
                if why:
                    rows.append((f"{getattr(backend, 'MODE', 'device')} kernel", case.op, name, "—", None, None, None,
                                 None, why))
                    continue
                for t, mx, mean, norm, _ in run_device(case, storage, backend, seed):
                    rows.append((f"{getattr(backend, 'MODE', 'device')} kernel", case.op, name, t, mx, mean, norm,
                                 None, ""))
    return rows


def _f(x, spec):
    return "—" if x is None else ("inf" if x == math.inf else format(x, spec))


def format_table(rows):
    """A plain-text table of study() rows."""
    head = ("mode", "op", "dtype", "tensor", "max ulp", "mean ulp", "norm ulp", "f32 max", "note")
    body = [(m, op, dt, t, _f(mx, ".2f"), _f(mean, ".3f"), _f(norm, ".2f"), _f(f32, ".3f"), note)
            for m, op, dt, t, mx, mean, norm, f32, note in rows]
    return text_table(head, body)


LEGEND = ("ULPs of the storage dtype against the float64 oracle on the same rounded inputs (0.5 = correctly "
          "rounded). max/mean: elementwise; norm: max |diff| / ulp(max |ref|), the error at the tensor's scale; "
          "f32 max: the float32 computation before its final rounding (oracle mode).")


# ----------------------------------------------------------------------------------------------------------------
# command line: refbert check --precision / --device cuda

def validate_kernels(backend, dtypes=None):
    """Every version of every CUDA kernel the backend runs, against its oracle (refbert_kernels.cuda._common.validate:
    fp64 / fp32 against the oracle in the same dtype, fp16 / bf16 against the float64 oracle on the same rounded
    inputs), on each spec's GPU shapes (its simulator shapes in the simulator). -> [(kernel, dtype, err/tol, ok,
    error)]"""
    from refbert_kernels.cuda import _common as C
    rows = []
    for spec in backend.specs():
        shapes = spec.shapes if getattr(backend, "SIM", False) else spec.notes.get("gpu_shapes", spec.shapes)
        for v in sorted(spec.versions):
            for dt in dtypes or C.dtypes():
                err = None
                try:
                    worst = max(C.validate(spec, v, dt, s) for s in shapes)
                except Exception as e:              # a launch or compile failure is a failed row, not a crash
                    worst, err = math.inf, f"{type(e).__name__}: {e}"
                rows.append((f"{spec.name} v{v}", np.dtype(dt).name, worst, worst <= 1, err))
    return rows


def format_validation(rows):
    head = ("kernel (cuda) vs oracle", "dtype", "err/tol", "", "error")
    body = [(k, d, _f(w, ".3f"), "pass" if ok else "FAIL", (e or "")[:100]) for k, d, w, ok, e in rows]
    return text_table(head, body)


def add_arguments(p):
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: the oracle in float32 with 16-bit storage; cuda: also the GPU kernels' fp16/bf16 modes")
    p.add_argument("--dtypes", nargs="+", choices=["float16", "bfloat16", "float32"],
                   help="storage dtypes (default: float16 and, with ml_dtypes, bfloat16)")
    p.add_argument("--size", choices=list(SIZES), default=None,
                   help="shapes (default: small on cpu, base on a GPU, tiny in the simulator)")
    p.add_argument("--ops", nargs="+", choices=list(OPS), help="only these ops")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--validate", dest="validate", action="store_true", default=None,
                   help="with --device cuda: validate every kernel version against the oracle first (default on a "
                        "GPU; off in the simulator, where tests/test_cuda_sim.py does it)")
    p.add_argument("--no-validate", dest="validate", action="store_false")
    return p


def main(args=None):
    """Print the table; args: an argparse.Namespace from refbert's CLI, or argv (a list), or None (sys.argv)."""
    if args is None or isinstance(args, (list, tuple)):
        args = add_arguments(argparse.ArgumentParser(prog="refbert check --precision",
                                                     description=__doc__.split("\n")[0])).parse_args(args)
    device = getattr(args, "device", "cpu")
    device = None if device in (None, "cpu", "numpy") else device
    size = getattr(args, "size", None)
    if device is not None:
        try:
            backend = device_backend(device)
        except ValueError as e:
            print(f"precision: device {device!r} UNAVAILABLE, the oracle study only (exit status 2): {e}\n")
            backend = None
        device = backend
    if size is None:
        size = "small" if device is None else ("tiny" if getattr(device, "SIM", False) else "base")
    status = 2 if getattr(args, "device", "cpu") not in (None, "cpu", "numpy") and device is None else 0
    validate = getattr(args, "validate", None)
    if device is not None and (validate or (validate is None and not getattr(device, "SIM", False))):
        print(device.describe() + "\n")
        vrows = validate_kernels(device)
        print("every CUDA kernel version against the oracle (err/tol <= 1 passes; tolerances in each kernel file):\n")
        print(format_validation(vrows) + "\n")
        failed = sum(not r[3] for r in vrows)
        print(f"{len(vrows) - failed} passed, {failed} failed\n")
        status = 1 if failed else 0
    rows = study(getattr(args, "dtypes", None), size, device, getattr(args, "ops", None))
    where = "" if device is None else f"; kernels on {device.device_name()}"
    print(f"precision study ({size} shapes{where})\n{LEGEND}\n")
    print(format_table(rows))
    if getattr(args, "json", None):
        keys = ("mode", "op", "dtype", "tensor", "max_ulp", "mean_ulp", "norm_ulp", "f32_max_ulp", "note")
        with open(args.json, "w") as fh:
            json.dump(dict(size=size, sizes=SIZES[size], rows=[dict(zip(keys, r)) for r in rows]), fh, indent=1)
            fh.write("\n")
    return status


if __name__ == "__main__":                 # pragma: no cover
    raise SystemExit(main())
