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
its elementwise ULP error says more about the cancellation than about the op. "cond" tells the two apart element by
element: max |got - ref| / ulp(M), with M the sum of the magnitudes of the terms the element adds up (terms():
the same expression evaluated on absolute values, every subtraction an addition, in float64; for an element
that is not a sum, its own magnitude). Rounding the terms once to the storage dtype, or the result, moves an
element by at most u M (u = half an ulp of 1: 2^-11 in float16), which is less than ulp(M): so a computation in
float32 that stores its result once (and any intermediate once) scores cond <= 0.5 (+ 1 per rounded
intermediate), however much the sum cancels, while an element that is wrong by more than its terms' rounding (a
term dropped, counted twice, or rounded coarser) scores far above it, even where its elementwise max ulp is
hidden among the cancelling elements and its norm by a larger element of the tensor. In the oracle mode the
column "f32 max" is the float32 computation's own error before the final rounding, in the same units: rounding
then adds at most 0.5 ulp (of the rounded value's binade) to it.

Then, on the CPU, the whole mixed-precision training step (model_study): one BertForPreTraining forward and backward
on the same weights and batch in float64 (the truth), float32, refbert's spec in bf16-mixed and fp16-mixed
(refbert.ops, "mixed precision: the spec"), and HF + PyTorch under torch.autocast("cpu") in bfloat16 and float16:
the loss and every gradient against float64, at each tensor's scale, in units of half an ulp of 1 of the compute
dtype (fp16 runs through a loss scale, as GradScaler would).

`refbert check --precision` prints the oracle table and the step; `refbert check --device cuda` adds the kernels'
(main()); `--report FILE` writes what it printed.
"""
import argparse
import json
import math
import textwrap
from dataclasses import dataclass, field

import numpy as np

from . import ops
from .philox import DropoutRNG
from .special import ndtr
from .fileio import write_text
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


def summarize(got, ref, dtype, terms=None):
    """(max ulp, mean ulp, norm ulp, cond ulp) of one tensor: elementwise max and mean, max |diff| / ulp(max |ref|),
    and max |diff| / ulp(terms) elementwise (terms: the magnitude of the terms each element sums, terms(); None:
    |ref| itself, so that cond is the elementwise max)."""
    g, r = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if r.size == 0:
        return 0.0, 0.0, 0.0, 0.0
    e = ulp_error(g, r, dtype)
    fin = np.isfinite(r)
    scale = float(np.abs(r[fin]).max()) if fin.any() else 0.0
    with np.errstate(invalid="ignore"):
        d = np.abs(g - r)
    d = np.where((g == r), 0.0, d)
    norm = float(np.nanmax(d) / ulp(scale, dtype)) if d.size else 0.0
    m = np.abs(r) if terms is None else np.broadcast_to(np.asarray(terms, np.float64), r.shape)
    cond = np.where(e == 0, 0.0, np.where(np.isfinite(e), d / ulp(np.where(np.isfinite(m), m, 0.0), dtype), np.inf))
    return float(e.max()), float(e.mean()), norm, float(cond.max())


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


# ----------------------------------------------------------------------------------------------------------------
# the magnitude of the terms each element sums: the op's expression on absolute values (see the module docstring)

def _ln_terms(s_abs, cache, d):
    """LayerNorm of s (= x, x + a or x + dropout(a)) whose terms have magnitude s_abs, d = |dout|: (out without
    b, ds, dw, db).  xhat = (s - mean) rstd: (|s| + mean |s|) rstd;  out = xhat w + b;  with wdy = dout w,
    ds = rstd (wdy - xhat c1 - c2), c1 = mean(wdy xhat), c2 = mean(wdy);  dw = sum dout xhat;  db = sum dout."""
    _, w, _, rstd = cache
    lead = tuple(range(s_abs.ndim - 1))
    xa = rstd * (s_abs + s_abs.mean(-1, keepdims=True))                   # (..., C) |xhat|'s terms
    wdy = d * np.abs(w)
    ds = rstd * (wdy + xa * (wdy * xa).mean(-1, keepdims=True) + wdy.mean(-1, keepdims=True))
    return xa * np.abs(w), ds, (d * xa).sum(lead), d.sum(lead)


def terms(case, rounded, dout, storage):
    """[out, *gradients] of the case: for every element, the sum of the magnitudes of the terms it adds up, from
    the float64 oracle on the rounded inputs and upstream gradient (float64 arrays of the outputs' shapes).
    Where a term passes through exp or erf, its argument's float32 rounding (u32 times
    the magnitude of the argument's own terms) moves it by the function's derivative times that: counted in units
    of the storage's rounding, r = u32 / u (1 in float32, 2^-13 in float16, 2^-16 in bfloat16)."""
    r = float(np.finfo(np.float32).eps) / (2.0 ** -_finfo(storage).nmant)
    f = {k: np.asarray(v, np.float64) for k, v in rounded.items()}
    out, cache = getattr(ops, case.forward)(**f, **_kw(case))
    d = np.abs(np.asarray(dout, np.float64))

    def probs(p, arg):
        """p = exp(s - m) / sum exp(s - m) and its terms: p (1 + r (|arg| + sum_j p_j |arg_j|)), arg the
        magnitude of s - m's terms (the normaliser's error moves every p of the row by the same factor)."""
        arg = np.where(p > 0, arg, 0.0)
        return p * (1 + r * (arg + (p * arg).sum(-1, keepdims=True)))

    if case.op == "softmax":
        p, scale = cache
        z = f["x"] * scale + f["mask"]
        pa = probs(p, np.abs(f["x"] * scale) + np.abs(f["mask"]) + np.abs(z.max(-1, keepdims=True)))
        # dx_i = scale (p_i dout_i - sum_j p_i p_j dout_j): p_i p_j is two roundings of p, so its share counts twice
        return [pa, abs(scale) * (pa * (d + (p * d).sum(-1, keepdims=True)) + p * (pa * d).sum(-1, keepdims=True))]
    if case.op in ("layernorm", "residual_layernorm", "dropout_residual_layernorm"):
        x = f["x"]
        if case.op == "layernorm":
            ln, keep, s_abs = cache, 1.0, np.abs(x)
        else:
            ln = cache[-1]
            keep = 1.0 if case.op == "residual_layernorm" or cache[0].keep is None else cache[0].keep * cache[0].scale
            s_abs = np.abs(x) + np.abs(f["a"]) * keep
        o, ds, dw, db = _ln_terms(s_abs, ln, d)
        o = o + np.abs(f["b"])
        return [o, ds, dw, db] if case.op == "layernorm" else [o, ds, ds * keep, dw, db]
    if case.op == "bias_gelu":
        x, b = f["x"], f["b"]
        u, u_abs = x + b, np.abs(x) + np.abs(b)
        if case.kwargs.get("approximate", "none") == "none":
            phi = np.exp(-0.5 * u * u) / math.sqrt(2 * math.pi)
            g1, g1_terms, g2 = ndtr(u) + u * phi, ndtr(u) + np.abs(u) * phi, phi * (2 - u * u)   # gelu', gelu''
        else:
            c, k = math.sqrt(2 / math.pi), 0.044715
            sg = lambda v: 1 / (1 + np.exp(-2 * c * (v + k * v ** 3)))                          # noqa: E731
            dg = lambda v: sg(v) + 2 * v * sg(v) * (1 - sg(v)) * c * (1 + 3 * k * v * v)       # noqa: E731
            g1 = dg(u)
            g1_terms = sg(u) + np.abs(2 * u * sg(u) * (1 - sg(u)) * c * (1 + 3 * k * u * u))
            h = 1e-5 * (1 + np.abs(u))
            g2 = (dg(u + h) - dg(u - h)) / (2 * h)
        o = np.abs(out) + r * np.abs(g1) * u_abs                                # gelu(u), u rounded in float32
        du = d * (g1_terms + r * np.abs(g2) * u_abs)                            # dout gelu'(u)
        return [o, du, du.reshape(-1, du.shape[-1]).sum(0)]
    if case.op == "attention":
        qh, kh, vh, _, sm, do = cache                                          # (p: sm holds it too)
        B, H, T, hs = qh.shape
        p, scale = sm
        mask = 0.0 if f.get("mask") is None else np.abs(f["mask"])
        s = np.abs(scale) * (np.abs(qh) @ np.abs(kh).transpose(0, 1, 3, 2))    # (B, H, T, T) |q_i| . |k_j| scale
        z = 1.0 if do.keep is None else do.keep * do.scale                      # (B, H, T, T)
        pa = probs(p, s + mask + np.max(np.where(p > 0, s + mask, 0.0), -1, keepdims=True))
        dh = d.reshape(B, T, H, hs).transpose(0, 2, 1, 3)                       # (B, H, T, hs)
        o = (pa * z) @ np.abs(vh)                                               # out = sum_j p_ij z_ij v_j
        dv = (pa * z).transpose(0, 1, 3, 2) @ dh                                # dv_j = sum_i p_ij z_ij dout_i
        dp = z * (dh @ np.abs(vh).transpose(0, 1, 3, 2))                        # dp_ij = z_ij dout_i . v_j
        D = (dh * o).sum(-1, keepdims=True)                                     # D_i = dout_i . out_i
        ds = pa * (dp + D)                                                      # ds_ij = p_ij (dp_ij - D_i)
        dq = abs(scale) * ds @ np.abs(kh)                                       # dq_i = scale sum_j ds_ij k_j
        dk = abs(scale) * ds.transpose(0, 1, 3, 2) @ np.abs(qh)                 # dk_j = scale sum_i ds_ij q_i
        merge = lambda a: a.transpose(0, 2, 1, 3).reshape(B, T, H * hs)        # noqa: E731
        return [merge(o), merge(dq), merge(dk), merge(dv)]
    if case.op == "cross_entropy":
        shape, _, zs, yk, kept, lse = cache
        n, rows = max(kept.size, 1), np.arange(kept.size)
        z = f["logits"].reshape(-1, shape[-1])[kept]                            # (n, V)
        m = np.abs(z).max(-1, keepdims=True) if kept.size else np.zeros((0, 1))
        loss = (np.abs(lse[:, 0]) + np.abs(z[rows, yk]) + m[:, 0]).sum() / n   # lse - z_label, both shifted by m
        g = probs(np.exp(zs - lse), np.abs(z) + m + np.abs(lse))               # softmax, + onehot
        g[rows, yk] += 1
        dz = np.zeros((int(np.prod(shape[:-1])), shape[-1]))
        dz[kept] = g * float(d) / n
        return [np.asarray(loss), dz.reshape(shape)]
    raise ValueError(f"precision: no terms for op {case.op!r}")


def run_oracle(case, storage, seed=0):
    """The "oracle" mode of one case: [(tensor, max, mean, norm, cond, f32 max)] for out and each gradient."""
    rounded = {k: round_to(v, storage) for k, v in case.inputs.items()}
    ref_out, ref_g, dout = _reference(case, rounded, storage, seed)
    mags = terms(case, rounded, dout, storage)
    f32 = {k: v.astype(np.float32) for k, v in rounded.items()}
    out, cache = getattr(ops, case.forward)(**f32, **_kw(case))
    g = _as_tuple(getattr(ops, case.backward)(np.asarray(dout).astype(np.float32)[()], cache))
    rows = []
    for (name, got, ref), m in zip([("out", out, ref_out), *zip((f"d{w}" for w in case.wrt), g, ref_g)], mags):
        got = np.asarray(got, np.float64)
        mx, mean, norm, cond = summarize(round_to(got, storage), ref, storage, m)
        rows.append((name, mx, mean, norm, cond, float(ulp_error(got, ref, storage).max()) if ref.size else 0.0))
    return rows


def run_device(case, storage, backend, seed=0):
    """The "device" mode of one case with backend (refbert_kernels.cuda.backend): the kernels in storage dtype.
    [(tensor, max, mean, norm, cond, None)] for out and each gradient."""
    rounded = {k: round_to(v, storage) for k, v in case.inputs.items()}
    ref_out, ref_g, dout = _reference(case, rounded, storage, seed)
    mags = terms(case, rounded, dout, storage)
    dev = {k: backend.to_device(v.astype(storage)) for k, v in rounded.items()}
    out, cache = getattr(backend, case.forward)(**dev, **_kw(case))
    d = 1.0 if case.scalar else backend.to_device(np.asarray(dout).astype(storage))
    g = _as_tuple(getattr(backend, case.backward)(d, cache))
    rows = []
    for (name, got, ref), m in zip([("out", out, ref_out), *zip((f"d{w}" for w in case.wrt), g, ref_g)], mags):
        got = backend.to_host(got)
        if np.asarray(got).dtype != storage:
            raise AssertionError(f"{case.op} {name}: the kernel returned {np.asarray(got).dtype}, expected {storage}")
        rows.append((name, *summarize(np.asarray(got).astype(np.float64), ref, storage, m), None))
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
    """Rows (mode, op, dtype, tensor, max ulp, mean ulp, norm ulp, cond ulp, f32 max ulp or None, note) for every op and
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
                for t, mx, mean, norm, cond, f32 in run_oracle(case, storage, seed):
                    rows.append(("oracle f32", case.op, name, t, mx, mean, norm, cond, f32, ""))
            if backend is not None:
                why = _device_skip(backend, case.op, storage)
                if why:
                    rows.append((f"{getattr(backend, 'MODE', 'device')} kernel", case.op, name, "—", None, None, None,
                                 None, None, why))
                    continue
                for t, mx, mean, norm, cond, _ in run_device(case, storage, backend, seed):
                    rows.append((f"{getattr(backend, 'MODE', 'device')} kernel", case.op, name, t, mx, mean, norm,
                                 cond, None, ""))
    return rows


def _f(x, spec):
    return "—" if x is None else ("inf" if x == math.inf else format(x, spec))


def format_table(rows):
    """A plain-text table of study() rows."""
    head = ("mode", "op", "dtype", "tensor", "max ulp", "mean ulp", "norm ulp", "cond ulp", "f32 max", "note")
    body = [(m, op, dt, t, _f(mx, ".2f"), _f(mean, ".3f"), _f(norm, ".2f"), _f(cond, ".2f"), _f(f32, ".3f"), note)
            for m, op, dt, t, mx, mean, norm, cond, f32, note in rows]
    return text_table(head, body)


LEGEND = ("ULPs of the storage dtype against the float64 oracle on the same rounded inputs (0.5 = correctly "
          "rounded). max/mean: elementwise; norm: max |diff| / ulp(max |ref|), the error at the tensor's scale; "
          "cond: max |diff| / ulp(the magnitude of the terms the element sums), <= 0.5 per rounding whatever the "
          "cancellation, far above it for a wrong element; f32 max: the float32 computation before its final "
          "rounding (oracle mode).")


# ----------------------------------------------------------------------------------------------------------------
# the whole mixed-precision step: refbert's spec and HF + PyTorch autocast against float64

MODEL_SIZES = {
    # config overrides of a preset, and the batch; tiny: the tests; small: the CPU default; base: BERT-base
    "tiny": dict(preset="tiny", vocab_size=211, B=2, T=16),
    "small": dict(preset="mini", vocab_size=2000, B=4, T=64),
    "base": dict(preset="base", vocab_size=30522, B=8, T=128),
}
PRECISIONS = ("bf16-mixed", "fp16-mixed")
FP16_SCALE = 2.0 ** 16          # the fp16 step's first loss scale (GradScaler's initial one); halved while a
                                # gradient overflows, as GradScaler would on the following steps


def _batch(B, T, V, seed):
    """ids, half the rows padded to 3/4, two segments, 15% MLM labels (at least one), NSP labels."""
    r = np.random.default_rng(seed)
    ids = r.integers(min(5, V - 1), V, (B, T))
    am = np.ones((B, T), np.int64)
    am[1::2, T * 3 // 4:] = 0
    tt = np.zeros((B, T), np.int64)
    tt[:, T // 2:] = 1
    labels = np.where((r.random((B, T)) < 0.15) & (am == 1), ids, -100)
    labels[0, 1] = ids[0, 1]
    return dict(input_ids=ids, attention_mask=am, token_type_ids=tt, labels=labels,
                next_sentence_label=r.integers(0, 2, B))


def _scaled(step, precision):
    """step(scale) -> (loss, {name: gradient of scale * loss}) run as GradScaler would: fp16 from FP16_SCALE,
    halved while any gradient is inf or NaN (bf16 and float32: scale 1). -> (loss, unscaled float64 gradients,
    the scale used)."""
    scale = FP16_SCALE if precision == "fp16-mixed" else 1.0
    while True:
        loss, grads = step(scale)
        if all(np.isfinite(g).all() for g in grads.values()) or scale < 1:
            return loss, {k: np.asarray(g, np.float64) / scale for k, g in grads.items()}, scale
        scale /= 2


def _torch_step(folder, batch, precision, device="cpu"):
    """HF + PyTorch (sdpa attention, float32 parameters) under torch.autocast(device, dtype) on the batch: (loss,
    {name: float64 gradient}, loss scale), the fp16 gradients through a scaled loss (_scaled), or (None, reason,
    None) where this torch cannot run it."""
    try:
        import torch
        import transformers
    except ImportError as e:
        return None, f"needs torch and transformers: {e}", None
    transformers.utils.logging.disable_progress_bar()
    hf = transformers.BertForPreTraining.from_pretrained(folder, attn_implementation="sdpa").float().eval()
    dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}[precision]
    try:
        hf = hf.to(device)
        tb = {k: torch.tensor(v, device=device) for k, v in batch.items()}
    except Exception as e:
        return None, f"torch on {device}: {type(e).__name__}: {str(e)[:80]}", None

    def step(scale):
        hf.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=dtype):
            out = hf(**tb)
        (out.loss.float() * scale).backward()
        return float(out.loss.detach()), {k: p.grad.double().cpu().numpy() for k, p in hf.named_parameters()
                                          if p.grad is not None}
    try:
        return _scaled(step, precision)
    except Exception as e:                                   # e.g. an op without a CPU kernel in that dtype
        return None, f"torch.autocast('{device}', {dtype}) failed: {type(e).__name__}: {str(e)[:80]}", None


def model_study(size="small", seed=0, precisions=PRECISIONS, peer=True, backend="numpy"):
    """One BertForPreTraining step (eval: dropout off, so every run sees the same function) on the same weights
    and batch: refbert in float64 (the truth), refbert in float32, refbert's spec in each mixed precision (numpy
    backend; fp16 through a loss scale of 2^16, divided out), and HF + PyTorch under torch.autocast (peer=True).
    backend="cuda" adds the GPU: refbert's cuda backend in float32 and each mixed precision (the kernels), and HF
    under torch.autocast("cuda") instead of "cpu"; `vs_spec` then holds, per cuda mixed run, the worst gradient
    difference from the spec run of its precision (relative to the tensor's scale), which must come from
    accumulation order alone (a few u at most, u = half an ulp of 1 in the compute dtype).
    -> dict(config, loss: {run: (value, rel err)}, tensors: [dict(name, shape, scale, errs: {run: rel err})],
    notes, scales, vs_spec)
    Each gradient's error is max |g - g64| / scale, scale = its largest |g64| floored at 1% of the model's largest
    gradient (as refbert verify judges a cancelling gradient, e.g. the key bias, exactly 0 in exact arithmetic)."""
    import tempfile

    from . import model as M
    from .config import BertConfig
    s = MODEL_SIZES[size]
    cfg = BertConfig.preset(s["preset"], vocab_size=s["vocab_size"], max_position_embeddings=max(512, s["T"]))
    batch = _batch(s["B"], s["T"], cfg.vocab_size, seed)
    m64 = M.BertForPreTraining(cfg, seed=seed, dtype=np.float64).eval()
    o64 = m64(**batch)
    g64 = m64.backward()
    losses, grads, notes, scales = {"refbert float64": float(o64.loss)}, {}, {}, {}
    for prec in ("fp32", *precisions):
        name = f"refbert {'float32' if prec == 'fp32' else prec}"
        m = M.BertForPreTraining(cfg, seed=seed, dtype=np.float32, precision=prec).eval()
        for k in m.params:
            m.params[k][...] = m64.params[k]                  # the float32 masters: the float64 weights, rounded once

        def step(scale, m=m):
            loss = float(m(**batch).loss)
            return loss, m.backward(scale)
        losses[name], grads[name], scales[name] = _scaled(step, prec)
    if backend == "cuda":
        from refbert_kernels.cuda import backend as CB
        for prec in ("fp32", *precisions):
            name = f"refbert cuda {'float32' if prec == 'fp32' else prec}"
            try:
                m = M.BertForPreTraining(cfg, seed=seed, dtype=np.float32, backend="cuda", precision=prec).eval()
                for k in m.params:
                    m.params[k] = CB.to_device(np.asarray(m64.params[k], np.float32))

                def step(scale, m=m):
                    loss = float(M.to_numpy(m(**batch).loss))
                    return loss, M.to_numpy(m.backward(scale))
                losses[name], grads[name], scales[name] = _scaled(step, prec)
            except Exception as e:
                notes[name] = f"{type(e).__name__}: {str(e)[:120]}"
    if peer:
        with tempfile.TemporaryDirectory(prefix="refbert-precision-") as d:
            m64.save_pretrained(d)                            # (float64 weights; HF reads them as float32)
            for p in precisions:
                dev = "cuda" if backend == "cuda" else "cpu"
                loss, g, scale = _torch_step(d, batch, p, dev)
                name = f"HF autocast {p.split('-')[0]}" + (" (cuda)" if dev == "cuda" else "")
                if loss is None:
                    notes[name] = g
                    continue
                losses[name], grads[name], scales[name] = loss, g, scale
    floor = 0.01 * max(float(np.abs(v).max()) for v in g64.values())
    tensors = []
    for k, ref in g64.items():
        sc = max(float(np.abs(ref).max()), floor)
        tensors.append(dict(name=k, shape=tuple(ref.shape), scale=sc,
                            errs={r: float(np.abs(g[k] - ref).max()) / sc for r, g in grads.items() if k in g}))
    ref_loss = losses["refbert float64"]
    vs_spec = {}
    for p in precisions:
        gpu, spec = grads.get(f"refbert cuda {p}"), grads.get(f"refbert {p}")
        if gpu is not None and spec is not None:
            vs_spec[f"refbert cuda {p}"] = max(float(np.abs(gpu[t["name"]] - spec[t["name"]]).max()) / t["scale"]
                                               for t in tensors)
    return dict(size=size, vs_spec=vs_spec, config=dict(preset=s["preset"], layers=cfg.num_hidden_layers, hidden=cfg.hidden_size,
                                       heads=cfg.num_attention_heads, vocab=cfg.vocab_size, B=s["B"], T=s["T"],
                                       labelled=int((batch["labels"] != -100).sum())),
                loss={r: (v, abs(v - ref_loss) / abs(ref_loss)) for r, v in losses.items()},
                tensors=tensors, notes=notes, scales=scales)


def _u(run):
    """Half an ulp of 1 in the run's compute dtype (None for float32 / float64 runs)."""
    if "bf16" in run:
        return 2.0 ** -8
    if "fp16" in run:
        return 2.0 ** -11
    return None


def format_model_study(d):
    """The model study as plain-text lines: the loss, a summary per run, then every gradient tensor."""
    c = d["config"]
    runs = [r for r in d["loss"] if r != "refbert float64"]
    head = [f"One BertForPreTraining step (eval, dropout off), {c['preset']} (L{c['layers']} H{c['hidden']} "
            f"A{c['heads']}, V {c['vocab']}), B{c['B']} T{c['T']}, {c['labelled']} labelled positions; the same "
            f"weights and batch for every run. Error = max |x - float64| / scale (a gradient's scale: its largest "
            f"float64 entry, floored at 1% of the model's largest gradient); in parentheses in units of u, half an "
            f"ulp of 1 of the run's compute dtype (bfloat16 2^-8, float16 2^-11). fp16 runs: loss scaled as "
            f"GradScaler would (2^16, halved while a gradient overflows), divided out: "
            + ", ".join(f"{r} 2^{int(math.log2(v))}" for r, v in d["scales"].items() if "fp16" in r)
            + ". HF: transformers' BertForPreTraining (sdpa), float32 parameters, under torch.autocast('cpu'), or "
              "'cuda' where the run's name says so.",
            ""]
    head = textwrap.wrap(head[0], 118) + head[1:]
    for r, why in d["notes"].items():
        head.append(f"{r}: not run ({why})")
    def cell(r, e):
        u = _u(r)
        return f"{e:.2e}" + (f" ({e / u:.2g} u)" if u else "")
    rows = [("loss", *[cell(r, d["loss"][r][1]) for r in runs])]
    errs = {r: [t["errs"][r] for t in d["tensors"] if r in t["errs"]] for r in runs}
    rows.append(("gradients: median", *[cell(r, float(np.median(errs[r]))) if errs[r] else "—" for r in runs]))
    rows.append(("gradients: worst", *[cell(r, max(errs[r])) if errs[r] else "—" for r in runs]))
    summary = text_table(("", *runs), rows)
    body = [(t["name"], "x".join(map(str, t["shape"])), *[cell(r, t["errs"][r]) if r in t["errs"] else "—"
                                                          for r in runs]) for t in d["tensors"]]
    spec = [f"{r} against the spec run of its precision (refbert {r.split()[-1]}, numpy): worst gradient "
            f"difference {cell(r, e)} of the tensor's scale (accumulation order alone: a few u at most)"
            for r, e in d.get("vs_spec", {}).items()]
    return head + summary.splitlines() + ([""] + spec if spec else []) + ["", "every gradient:", ""] + \
        text_table(("tensor", "shape", *runs), body).splitlines()


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
    if callable(getattr(backend, "version_rows", None)):   # the CUDA C versions on the device, then every fallback
        rows += backend.version_rows()                      # (a demotion, a call handed to Numba): failing rows
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
    p.add_argument("--report", metavar="FILE", help="also write the printed study to FILE (markdown), e.g. "
                                                    "benchmarks/results/precision.md")
    p.add_argument("--no-step", dest="step", action="store_false",
                   help="skip the mixed-precision training step (refbert's spec and HF + PyTorch autocast against "
                        "float64; on the CPU)")
    p.add_argument("--validate", dest="validate", action="store_true", default=None,
                   help="with --device cuda: validate every kernel version against the oracle first (default on a "
                        "GPU; off in the simulator, where tests/test_cuda_sim.py does it)")
    p.add_argument("--no-validate", dest="validate", action="store_false")
    p.add_argument("--no-ops", dest="op_study", action="store_false",
                   help="skip the per-op study (the mixed-precision step alone, e.g. beside a kernels-only run)")
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
    rows, lines = [], []
    if getattr(args, "op_study", True):
        rows = study(getattr(args, "dtypes", None), size, device, getattr(args, "ops", None))
        where = "" if device is None else f"; kernels on {device.device_name()}"
        lines = [f"precision study ({size} shapes{where})", LEGEND, "", *format_table(rows).splitlines()]
        print("\n".join(lines))
    step = None
    if getattr(args, "step", True) and (device is None or not getattr(device, "SIM", False)):
        # the mixed-precision step against float64: the spec (CPU), and with a GPU the cuda kernels beside it
        # (BERT mini on the GPU: the kernels' CUDA C paths at head size 64, and minutes, not hours, of float64)
        step = model_study(size if device is None else "small", backend="numpy" if device is None else "cuda")
        more = ["", "mixed-precision training step: refbert's spec (refbert.ops, README \"Mixed precision\")"
                    + ("" if device is None else ", refbert's cuda kernels") + " and HF + PyTorch autocast against "
                    "float64", "", *format_model_study(step)]
        print("\n".join(more))
        lines += more
    if getattr(args, "json", None):
        keys = ("mode", "op", "dtype", "tensor", "max_ulp", "mean_ulp", "norm_ulp", "cond_ulp", "f32_max_ulp", "note")
        with open(args.json, "w") as fh:
            json.dump(dict(size=size, sizes=SIZES[size], rows=[dict(zip(keys, r)) for r in rows], step=step), fh,
                      indent=1, default=lambda o: None if isinstance(o, float) and not math.isfinite(o) else o)
            fh.write("\n")
    if getattr(args, "report", None):
        what = size if getattr(args, "op_study", True) else f"the mixed-precision step, {step['size'] if step else '-'}"
        write_text(args.report, f"# refbert check --precision ({what})\n\n```\n" + "\n".join(lines) + "\n```\n")
    if device is not None:             # what this run spent compiling kernels (gpu_all.sh's summary quotes it)
        from refbert_kernels.cuda import compile_time
        print(f"\ncompile time of this check: {compile_time.summary()}")
    return status


if __name__ == "__main__":                 # pragma: no cover
    raise SystemExit(main())
