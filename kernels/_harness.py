"""Validate-then-benchmark, shared by every kernel file (llm.c's dev/cuda pattern, in Python).

A kernel file `kernels/<op>.py` defines numbered versions of one fused op and a `SPEC = KernelSpec(...)` naming its
oracle in refbert.ops. `python -m refbert_kernels.<op>` calls `main(SPEC)`, which
  1. runs every version forward and backward on small irregular shapes in float64 and float32 and compares every
     output and gradient with the oracle's: |got - ref| <= atol + rtol * |ref| elementwise (the spec states both
     per dtype, with the reason); on a mismatch it prints the first offending pairs and their index, and stops;
  2. only then times each version (forward + backward, median of repeats, JIT compilation excluded by a warm-up
     call), next to the NumPy oracle and, when torch is installed, the PyTorch CPU peer on the same inputs, and
     prints one line per measurement: time, GB/s from the spec's byte count, and the ratios.
refbert's `refbert bench` and `refbert check` reuse validate() and time_call() from here; the timer and the
bandwidth probe live in refbert.testing, whose check_op / bench_op grade and time anyone's ops the same way.
"""
from dataclasses import dataclass, field

import numpy as np

from refbert.philox import DropoutRNG
from refbert.testing import copy_bandwidth, time_call  # noqa: F401 (the timer refbert.testing.bench_op uses too)


@dataclass
class KernelSpec:
    name: str                       # "softmax"
    oracle: tuple                   # (forward, backward) from refbert.ops
    versions: dict                  # {1: (forward, backward), 2: ...}: same signatures and semantics as the oracle
    make_inputs: callable           # make_inputs(shape: dict, dtype, seed) -> (inputs: dict, kwargs: dict)
    wrt: tuple                      # names of the differentiable inputs, in the backward's return order
    shapes: list                    # small irregular shapes for validation: list of dicts passed to make_inputs
    bench_shape: dict               # the shape timed by main() / refbert bench
    tol: dict                       # {np.float32: (atol, rtol), np.float64: (atol, rtol)}; reason in the spec's file
    nbytes: callable = None         # nbytes(inputs, kwargs) -> bytes a forward + backward must move (napkin count)
    flops: callable = None          # flops(inputs, kwargs) -> floating-point operations of forward + backward
    torch_peer: callable = None     # torch_peer(inputs, kwargs) -> zero-argument callable running torch fwd + bwd
    notes: dict = field(default_factory=dict)  # {version: one-line idea}, printed by main()


def read_only(a):
    """A read-only view of `a` (the array itself is left as it was). The kernels take their masks so: Numba compiles
    a kernel once per argument type, and a writable and a read-only array are two types (a user's mask may come
    either way), so one compile per dtype."""
    v = a.view()
    v.flags.writeable = False
    return v


def _fresh(kwargs, seed=1234):
    """kwargs with a fresh DropoutRNG, so oracle and kernel draw the same dropout streams."""
    return {k: (DropoutRNG(seed) if k == "rng" else v) for k, v in kwargs.items()}


def run_pair(forward, backward, inputs, kwargs, dout_seed=0):
    """forward then backward with a fixed random upstream gradient. -> (out, grads tuple)"""
    out, cache = forward(**inputs, **_fresh(kwargs))
    dout = np.random.default_rng(dout_seed).standard_normal(np.shape(out)).astype(np.asarray(out).dtype)
    if np.ndim(out) == 0:
        dout = np.asarray(out).dtype.type(1.0)
    grads = backward(dout, cache)
    return out, grads if isinstance(grads, tuple) else (grads,)


def compare(label, got, ref, atol, rtol, show=5):
    """Max of |got - ref| / (atol + rtol |ref|) (<= 1 passes); prints the first offending entries when it fails.
    Where ref is not finite the entry must be identical: +-inf only the same infinity, NaN only NaN (inf / inf
    would be NaN, which must not pass); a non-finite got against a finite ref is inf."""
    got, ref = np.asarray(got), np.asarray(ref)
    if got.shape != ref.shape:
        raise AssertionError(f"{label}: shape {got.shape}, expected {ref.shape}")
    if got.dtype != ref.dtype:
        raise AssertionError(f"{label}: dtype {got.dtype}, expected {ref.dtype}")
    if got.size == 0:
        return 0.0
    g, r = got.astype(np.float64), ref.astype(np.float64)
    same = (g == r) | (np.isnan(g) & np.isnan(r))
    finite = np.isfinite(g) & np.isfinite(r)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        ratio = np.abs(g - r) / (atol + rtol * np.abs(r))
    err = np.where(same, 0.0, np.where(finite, ratio, np.inf))
    worst = float(err.max())
    if worst > 1:
        bad = np.argwhere(err > 1)[:show]
        lines = [f"  at {tuple(int(i) for i in idx)}: got {got[tuple(idx)]!r}, expected {ref[tuple(idx)]!r}"
                 for idx in bad]
        print(f"MISMATCH {label}: {int((err > 1).sum())} of {err.size} entries outside atol {atol:g} + rtol {rtol:g}"
              + "\n" + "\n".join(lines))
    return worst


def validate(spec, version, dtype, shape, seed=0):
    """Worst error ratio (<= 1 passes) of one version against the oracle over outputs and gradients, and the
    largest absolute difference seen. -> (ratio, max_abs_diff)"""
    atol, rtol = spec.tol[np.dtype(dtype).type]
    inputs, kwargs = spec.make_inputs(shape, dtype, seed)
    ref_out, ref_grads = run_pair(*spec.oracle, inputs, kwargs)
    out, grads = run_pair(*spec.versions[version], inputs, kwargs)
    if len(grads) != len(ref_grads):
        raise AssertionError(f"{spec.name} v{version}: backward returned {len(grads)} gradients, "
                             f"the oracle {len(ref_grads)}")
    worst, diff = 0.0, 0.0
    for label, g, r in [("out", out, ref_out), *zip((f"d{w}" for w in spec.wrt), grads, ref_grads)]:
        worst = max(worst, compare(f"{spec.name} v{version} {np.dtype(dtype).name} {shape} {label}", g, r, atol, rtol))
        if np.size(r):
            diff = max(diff, float(np.max(np.abs(np.asarray(g, np.float64) - r))))
    return worst, diff


def fwd_bwd(forward, backward, inputs, kwargs):
    """A zero-argument callable: forward + backward with a fixed upstream gradient (made once, outside the timing)."""
    out, _ = forward(**inputs, **_fresh(kwargs))
    dout = np.asarray(out).dtype.type(1.0) if np.ndim(out) == 0 else \
        np.random.default_rng(0).standard_normal(np.shape(out)).astype(np.asarray(out).dtype)

    def step():
        _, cache = forward(**inputs, **_fresh(kwargs))
        backward(dout, cache)
    return step


def main(spec, dtypes=(np.float64, np.float32)):
    """Validate every version on every small shape and dtype, then time every version at spec.bench_shape."""
    print(f"{spec.name}: oracle refbert.ops.{spec.oracle[0].__name__} / {spec.oracle[1].__name__}")
    for v in sorted(spec.versions):
        for dtype in dtypes:
            worst = max(validate(spec, v, dtype, s)[0] for s in spec.shapes)
            print(f"  validate v{v} {np.dtype(dtype).name:8s} worst err/tol {worst:.3f}  "
                  f"{'ok' if worst <= 1 else 'FAIL'}   {spec.notes.get(v, '')}")
            if worst > 1:
                raise SystemExit(1)
    inputs, kwargs = spec.make_inputs(spec.bench_shape, np.float32, 0)
    nbytes = spec.nbytes(inputs, kwargs) if spec.nbytes else None
    bw = copy_bandwidth()
    print(f"timing float32 at {spec.bench_shape} (forward + backward, median); copy bandwidth {bw / 1e9:.1f} GB/s")
    t_ref = time_call(fwd_bwd(*spec.oracle, inputs, kwargs))
    rows = [("numpy oracle", t_ref)]
    if spec.torch_peer is not None:
        try:
            rows.append(("pytorch", time_call(spec.torch_peer(inputs, kwargs))))
        except ImportError:
            pass
    rows += [(f"v{v}", time_call(fwd_bwd(*spec.versions[v], inputs, kwargs))) for v in sorted(spec.versions)]
    for label, t in rows:
        extra = ""
        if nbytes:
            extra += f"  {nbytes / t / 1e9:7.2f} GB/s ({100 * nbytes / t / bw:5.1f}% of copy)"
        if spec.flops:
            extra += f"  {spec.flops(inputs, kwargs) / t / 1e9:7.1f} GFLOP/s"
        print(f"  {label:14s} {t * 1e3:9.3f} ms  {t_ref / t:6.2f}x numpy{extra}")
    return rows
