"""Grade and time anyone's forward/backward against the oracle: your kernel, your port, your first backprop.

    from refbert.testing import check_op, bench_op
    report = check_op("layernorm", my_forward, my_backward)            # float32 by default; or dtype="float64"
    print(report)                  # one row per tensor: the worst case, its error, the tolerance, the yardsticks
    assert report.passed, report
    bench_op("layernorm", my_forward, my_backward).save("results")    # layernorm.md / .json / .png

`op` is any op of refbert.ops (the fused ones too); your functions have the oracle's signatures,
`<op>_forward(...) -> (out, cache)` and `<op>_backward(dout, cache) -> gradients in the order of the forward's
differentiable inputs`. Give both, or only a backward (the oracle's forward makes the cache it reads: write your
forward's cache the same way), or only a forward. They may take NumPy, torch (CPU or CUDA) or CuPy arrays: an
`ARRAY_LIBRARY` attribute on the function (or its module) says which, else the first call is probed
(refbert.backends.adapt: through DLPack where the memory can be shared). `refbert check --ops FILE` runs this on
every op a file defines (check_module), `--model` the whole BERT on them (check_model_ops).

The cases. Each op has the edge cases refbert's own kernels are validated on (SPECS below, after the shapes of
kernels/<op>.py's KernelSpecs, which need numba: one element, T = 1, C = 1, a fully padded row, one real token
under a -inf mask, constant rows, rows around 1e3, logits of 1e4, GELU's tails, p = 0 and p = 1, no rows, every
label ignored, ...), a non-contiguous input, and shapes drawn by hypothesis (when installed: a failing shape is
shrunk to a minimal one; else by a seeded NumPy generator). Every input is rounded to the dtype first, so
the float64 oracle sees exactly the values your code sees; the upstream gradient is random (0.75 for a loss).

The comparison. Every output and every gradient against the float64 oracle on those values, as an error in ulps of
the dtype at the tensor's scale:  ulps = max|x - oracle| / (eps * max|oracle|)  (eps = 2^-23 in float32, 2^-52 in
float64). A NaN, an infinity where the oracle is finite (a reference +-inf passes only with the same infinity), a
wrong shape or dtype, the wrong number of gradients, an exception, or an input written into fails the tensor.

The tolerance: the noise that rounding alone puts on that tensor, for those inputs, measured in the same run. As
`refbert verify`'s per-tensor noise scale, it starts from refbert's own computation in float32 against float64:
    noise = the largest of: refbert's own float32 ulps, over the inputs as given and twice with every input moved
            by a random +-1 ulp; how far the exact result moves under those moves (the case's conditioning: code
            that is exact on inputs an ulp away, i.e. backward stable, is that far off); and PyTorch's ulps on the
            same inputs in the checked dtype, where torch is installed
    tolerance = max(FACTOR * noise, FLOOR_ULPS)   (FACTOR 8, FLOOR_ULPS 16)
so a case whose result rounding makes fragile (a cross-entropy of logits near 1e4, whose loss moves ~10^3 ulps
when its logits move by one; an input row around 1e3) gets the slack it needs, and a well-conditioned one is held
to a few ulps. In float64 the float32 run measures the case's conditioning (its ulps carry over: the same algorithm rounds
at the same places) and PyTorch's float64 distance from the oracle is the second yardstick. FACTOR: implementations
that sum in another order land a few times above or below each other: refbert's own Numba kernels (every numbered
version of every kernel file, float32 and float64, the edge cases and 8 drawn shapes: 58 checks, all passing) came
at most 3.2x the larger of the noise, PyTorch's error and 2 ulps (6.4 ulps, attention v2-v5's dk in float64:
benchmarks/testing_calibration.py, benchmarks/results/testing_calibration.md); tests/test_testing.py runs the
versions the backend uses. A wrong term is 10^3 to 10^7 ulps off.

The shape of an error. A failing tensor is localised: which input, the worst elements with their indices, and what
the difference looks like, computed from the difference alone (`explain`): a sign flip, a uniform factor (named when
it matches a scalar of the call, e.g. 1 - p), a transpose, a constant along a row or a column, the forward's output
or the input times an amount per row, the upstream gradient times a function of the input alone (an elementwise
derivative that is off), errors only where the expected value is 0.

Timing (`bench_op`): as `refbert bench` times refbert's kernels (refbert/bench.py): a validation first, then forward
+ backward and forward alone, the median of time_call's medians over rounds that alternate the implementations
(warm-up call excluded), your pair, the NumPy oracle and the PyTorch peer on the same inputs, GB/s from the bytes
every input, output, upstream gradient and gradient must move once, and % of the copy bandwidth probed in the run.

References: refbert/verify.py (the noise-scale tolerance of a whole model); kernels/_harness.py (validate, then
time); Higham, "Accuracy and Stability of Numerical Algorithms" (2002), ch. 3-4 (rounding in sums).
"""
import inspect
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from . import ops as oracle
from .backends import OPS, adapt, convert_tree, load_module
from .philox import DropoutRNG
from .tables import text_table

EPS = {"float32": 2.0 ** -23, "float64": 2.0 ** -52}
FACTOR = 8            # tolerance = FACTOR x the measured noise ...
FLOOR_ULPS = 16       # ... and never under 16 ulps: an exact op rounds differently at one or two places
SAMPLES = 3           # the float32 noise: the inputs as given, and twice moved by a random +-1 ulp
DLOSS = 0.75          # the upstream gradient of a loss (not 1, so a backward that ignores it shows)
EXAMPLES = 12         # drawn shapes per op and dtype


# ----------------------------------------------------------------------------------------------------------------
# the ops: how to make each one's inputs, its edge cases, the shapes to draw, and the PyTorch peer

def _normal(r, shape, scale=1.0, shift=0.0):
    return r.standard_normal(shape) * scale + shift


def _pad_mask(B, T, lengths, fill):
    """HF's additive mask (B, 1, 1, T): 0 on the first lengths[b] positions, `fill` after."""
    m = np.zeros((B, 1, 1, T))
    for b, n in enumerate(lengths):
        m[b, ..., n:] = fill
    return m


def _min(dtype):
    return float(np.finfo(dtype).min)


_TAILS = (-10.0, 10.0, -6.5, 1e-7, -3e-8, 0.0, -1e-300, 5.5)   # GELU's tails and |x| < 1e-6 (the 0/0 branch)


def _plant(x, values):
    flat = x.reshape(-1)
    k = min(flat.size, len(values))
    flat[:k] = values[:k]
    return x


def make_linear(p, r, dtype):
    lead, Ci, Co = p["lead"], p["C_in"], p["C_out"]
    inputs = {"x": _normal(r, (*lead, Ci)), "w": _normal(r, (Co, Ci), max(Ci, 1) ** -0.5)}
    if p.get("bias", True):
        inputs["b"] = _normal(r, (Co,), 0.5)
    return inputs, {}


def make_embedding(p, r, dtype):
    V, C = p["V"], p["C"]
    ids = r.integers(0, V, p["ids"])
    if ids.size > 2 and V > 1:
        ids.reshape(-1)[1] = ids.reshape(-1)[0]          # a repeated id: its gradients must sum
    kw = {"ids": ids}
    if "pad" in p:
        ids.reshape(-1)[-1] = p["pad"]
        kw["padding_idx"] = p["pad"]
    return {"w": _normal(r, (V, C))}, kw


def make_layernorm(p, r, dtype, residual=False, dropout=False):
    lead, C, kind = p["lead"], p["C"], p.get("kind", "normal")
    if kind == "constant":                                # every row one value: var = 0, rstd = 1/sqrt(eps); the
        # values are multiples of 1/4, so that a row's mean is exact in float32 too (a mean off by 1 ulp would make
        # xhat = ulp * 1e6 ~ 0.1 where the truth is 0: a case no float32 code can get right)
        x = np.broadcast_to(r.integers(-12, 13, (*lead, 1)) * 0.25, (*lead, C)).copy()
    elif kind == "offset":                                # rows around 1e3: the mean cancels 3 digits
        x = _normal(r, (*lead, C), 1.0, 1e3)
    else:
        x = _normal(r, (*lead, C), 2.0, 0.5)
    inputs = {"x": x}
    kw = {}
    if residual or dropout:
        inputs["a"] = np.zeros_like(x) if kind == "constant" else _normal(r, (*lead, C))
    inputs["w"], inputs["b"] = _normal(r, (C,), 0.1, 1.0), _normal(r, (C,), 0.1)
    if dropout:
        kw = {"eps": 1e-12, "p": p.get("p", 0.1), "rng": DropoutRNG(3), "train": p.get("train", True)}
    return inputs, kw


def make_softmax(p, r, dtype):
    B, H, T, kind = p["B"], p["H"], p["T"], p.get("mask")
    x = _normal(r, (B, H, T, T), 3.0, 1e4 if p.get("big") else 0.0)
    mask = None
    if kind == "pad":                                     # HF: the dtype's most negative number on a tail
        mask = _pad_mask(B, T, [r.integers(1, T + 1) for _ in range(B)], _min(dtype))
    elif kind == "empty":                                 # the last sequence is padding only: uniform rows
        mask = _pad_mask(B, T, [T] * (B - 1) + [0], _min(dtype))
    elif kind == "one":                                   # row 0 a single real token, -inf elsewhere
        mask = _pad_mask(B, T, [1] + [T] * (B - 1), -np.inf)
    elif kind == "full":                                  # a mask of x's shape, -inf entries, column 0 kept
        mask = np.where(r.random((B, H, T, T)) < 0.3, -np.inf, 0.0)
        mask[..., 0] = 0
    kw = {"scale": p.get("scale", 0.125)}
    if mask is not None:
        kw["mask"] = mask
    return {"x": x}, kw


def make_gelu(p, r, dtype, bias=False):
    x = _plant(_normal(r, p["shape"], 3.0), _TAILS if p.get("tails", True) else ())
    inputs = {"x": x}
    if bias:
        b = _normal(r, (p["shape"][-1],), 0.1)
        b[:1] = 0                                         # the planted tails stay exact in u = x + b
        inputs["b"] = b
    return inputs, {"approximate": p.get("approximate", "none")}


def make_tanh(p, r, dtype):
    return {"x": _plant(_normal(r, p["shape"], 2.0), (20.0, -20.0, 0.0, 1e-8))}, {}


def make_dropout(p, r, dtype):
    return {"x": _normal(r, p["shape"])}, {"p": p.get("p", 0.1), "rng": DropoutRNG(0), "train": p.get("train", True)}


def make_add(p, r, dtype):
    return {"a": _normal(r, p["shape"]), "b": _normal(r, p["shape"])}, {}


def make_attention(p, r, dtype):
    B, T, H, hs, kind = p["B"], p["T"], p["H"], p["hs"], p.get("mask", "hf")
    q, k, v = (_normal(r, (B, T, H * hs)) for _ in range(3))
    mask = None
    if kind == "hf":                                      # HF's padding: the second sequence one real token
        mask = _pad_mask(B, T, [T, 1, *r.integers(1, T + 1, max(B - 2, 0))][:B], _min(dtype))
    elif kind == "empty_row":                             # the last sequence padding only: it attends uniformly
        mask = _pad_mask(B, T, [T] * (B - 1) + [0], _min(dtype))
    elif kind == "ninf":
        mask = _pad_mask(B, T, [max(1, T - 3)] * B, -np.inf)
    elif kind == "causal":                                # (H, T, T): -inf above the diagonal, per head
        mask = np.broadcast_to(np.triu(np.full((T, T), -np.inf), 1), (H, T, T)).copy()
    kw = {"n_heads": H, "mask": mask, "dropout_p": p.get("p", 0.1), "rng": DropoutRNG(5),
          "train": p.get("train", True)}
    return {"q": q, "k": k, "v": v}, kw


def make_cross_entropy(p, r, dtype):
    lead, V = p["lead"], p["V"]
    logits = _normal(r, (*lead, V), 3.0)
    if p.get("big") and logits.size:
        logits.reshape(-1, V)[0] += 1e4                   # a row of logits near 1e4
    labels = r.integers(0, V, lead)
    labels[r.random(lead) < p.get("ignored", 0.0)] = -100
    return {"logits": logits}, {"labels": labels}


def make_bce(p, r, dtype):
    z = _normal(r, p["shape"], p.get("scale", 3.0))
    t = (r.random(p["shape"]) < 0.5).astype(np.float64) if p.get("binary", True) else r.random(p["shape"])
    return {"logits": z}, {"targets": t}


def make_mse(p, r, dtype):
    return {"pred": _normal(r, p["shape"]), "target": _normal(r, p["shape"])}, {}


def make_gather_rows(p, r, dtype):
    x = _normal(r, (*p["lead"], p["C"]))
    N = int(np.prod(p["lead"]))
    return {"x": x}, {"rows": np.array(p["rows"] if "rows" in p else r.permutation(N)[:max(1, N // 3)], np.int64)}


class _Pick:
    """What a drawn case asks for: integers and choices, from hypothesis's data or from a NumPy generator."""

    def __init__(self, data=None, rng=None):
        self.data, self.rng = data, rng

    def int(self, lo, hi):
        if self.data is not None:
            from hypothesis import strategies as st
            return self.data.draw(st.integers(lo, hi))
        return int(self.rng.integers(lo, hi + 1))

    def choice(self, seq):
        return seq[self.int(0, len(seq) - 1)]

    def lead(self, n_max=2, hi=6):
        return tuple(self.int(1, hi) for _ in range(self.int(1, n_max)))


def _t(torch, a):
    return a if a is None else torch.from_numpy(np.ascontiguousarray(a))


def _torch_keep(torch, kw, shape, op):
    """The keep-multipliers the oracle's dropout draws for these arguments (a fresh generator), as a tensor."""
    if not kw.get("train", True) or kw["p"] == 0.0:
        return None
    rng = DropoutRNG(**kw["rng"].state)
    keep = oracle.dropout_mask(rng, shape, kw["p"], op)
    return torch.from_numpy(keep)


def _drop(torch, x, keep, p):
    return x if keep is None else x * keep * (1.0 / (1.0 - p) if p < 1.0 else 0.0)


def torch_attention(torch, t, kw):
    q, k, v = t["q"], t["k"], t["v"]
    B, T, C = q.shape
    H = kw["n_heads"]
    heads = lambda a: a.reshape(B, T, H, C // H).transpose(1, 2)  # noqa: E731  (B, H, T, hs)
    att = heads(q) @ heads(k).transpose(-1, -2) * (1.0 / math.sqrt(C // H))
    if kw["mask"] is not None:
        att = att + _t(torch, kw["mask"]).to(q.dtype)
    prob = torch.softmax(att, -1)
    prob = _drop(torch, prob, _torch_keep(torch, {**kw, "p": kw["dropout_p"]}, (B, H, T, T), "attention"),
                 kw["dropout_p"])
    return (prob @ heads(v)).transpose(1, 2).reshape(B, T, C)


def torch_layernorm(torch, s, w, b, eps):
    return torch.nn.functional.layer_norm(s, (s.shape[-1],), w, b, eps)


def torch_cross_entropy(torch, t, kw):
    z = t["logits"]
    y = _t(torch, kw["labels"]).reshape(-1)
    n = int((y != -100).sum())
    ce = torch.nn.functional.cross_entropy(z.reshape(-1, z.shape[-1]), y, ignore_index=-100, reduction="sum")
    return ce / max(n, 1)                              # refbert's semantics: every label ignored -> 0, not NaN


@dataclass
class OpSpec:
    """How refbert.testing exercises one op."""
    name: str
    make: callable                  # make(params, rng, dtype) -> (inputs: {name: float64 array}, kwargs)
    edges: list                     # [(label, params)]: the edge cases
    draw: callable                  # draw(pick) -> params: a drawn case
    torch: callable = None          # torch(torch, tensors, kwargs) -> output tensor (the PyTorch peer)
    bench: dict = None              # the params bench_op times by default
    noncontig: str = None           # the input made non-contiguous in the edge case that asks for it


def _F(torch):
    return torch.nn.functional


SPECS = {s.name: s for s in [
    OpSpec("linear", make_linear,
           [("one element, no bias", dict(lead=(1,), C_in=1, C_out=1, bias=False)),
            ("x 1-d", dict(lead=(), C_in=5, C_out=3)), ("no rows", dict(lead=(0,), C_in=5, C_out=4)),
            ("37 rows, 52 -> 7", dict(lead=(37,), C_in=52, C_out=7)),
            ("(2, 5, 6) -> 6, no bias", dict(lead=(2, 5), C_in=6, C_out=6, bias=False)),
            ("square w", dict(lead=(3, 4), C_in=9, C_out=9)),
            ("non-contiguous x", dict(lead=(3, 4), C_in=9, C_out=5, noncontig=True))],
           lambda d: dict(lead=d.lead(), C_in=d.int(1, 40), C_out=d.int(1, 40), bias=d.choice([True, False])),
           lambda torch, t, kw: _F(torch).linear(t["x"], t["w"], t.get("b")),
           bench=dict(lead=(2048,), C_in=768, C_out=768), noncontig="x"),
    OpSpec("embedding", make_embedding,
           [("V = 1", dict(V=1, C=3, ids=(2, 3))), ("one id, C = 1", dict(V=5, C=1, ids=(1, 1))),
            ("repeated ids", dict(V=7, C=4, ids=(2, 5))), ("padding_idx = 0", dict(V=7, C=4, ids=(2, 5), pad=0)),
            ("3-d ids", dict(V=11, C=6, ids=(2, 3, 4))),
            ("non-contiguous w", dict(V=9, C=5, ids=(3, 4), noncontig=True))],
           lambda d: dict(V=d.int(1, 30), C=d.int(1, 16), ids=d.lead()),
           lambda torch, t, kw: _F(torch).embedding(_t(torch, kw["ids"]), t["w"], kw.get("padding_idx")),
           bench=dict(V=30522, C=768, ids=(8, 128)), noncontig="w"),
    OpSpec("layernorm", make_layernorm,
           [("C = 1", dict(lead=(1,), C=1)), ("one row of 768", dict(lead=(1, 1), C=768)),
            ("x 1-d", dict(lead=(), C=9)), ("37 rows of 52", dict(lead=(37,), C=52)),
            ("67 rows of 5", dict(lead=(67,), C=5)), ("constant rows", dict(lead=(2, 5), C=7, kind="constant")),
            ("rows around 1e3", dict(lead=(4,), C=33, kind="offset")),
            ("non-contiguous x", dict(lead=(3, 4), C=13, noncontig=True))],
           lambda d: dict(lead=d.lead(), C=d.int(1, 64), kind=d.choice(["normal", "normal", "constant", "offset"])),
           lambda torch, t, kw: torch_layernorm(torch, t["x"], t["w"], t["b"], 1e-12),
           bench=dict(lead=(2048,), C=768), noncontig="x"),
    OpSpec("softmax", make_softmax,
           [("T = 1", dict(B=1, H=1, T=1)), ("T = 1, padding mask", dict(B=1, H=1, T=1, mask="pad")),
            ("T = 37, padding", dict(B=3, H=1, T=37, mask="pad")),
            ("a fully padded row", dict(B=2, H=2, T=9, mask="empty")),
            ("one real token (-inf)", dict(B=2, H=3, T=17, mask="one")),
            ("-inf mask of x's shape", dict(B=2, H=5, T=52, mask="full")),
            ("scale 1", dict(B=1, H=3, T=33, scale=1.0)), ("logits 1e4", dict(B=2, H=2, T=9, big=True, scale=1.0)),
            ("non-contiguous x", dict(B=2, H=2, T=11, mask="pad", noncontig=True))],
           lambda d: dict(B=d.int(1, 3), H=d.int(1, 4), T=d.int(1, 40), mask=d.choice([None, "pad", "empty", "full"]),
                          scale=d.choice([0.125, 1.0, 0.35])),
           lambda torch, t, kw: torch.softmax(t["x"] * kw["scale"] + (_t(torch, kw["mask"]).to(t["x"].dtype)
                                                                     if kw.get("mask") is not None else 0), -1),
           bench=dict(B=4, H=12, T=128, mask="pad"), noncontig="x"),
    OpSpec("gelu", make_gelu,
           [("one element", dict(shape=(1,))), ("tails and 0", dict(shape=(1, 52))),
            ("tails and 0, tanh", dict(shape=(1, 52), approximate="tanh")), ("37 x 52", dict(shape=(37, 52))),
            ("(3, 5, 7), tanh", dict(shape=(3, 5, 7), approximate="tanh")),
            ("non-contiguous x", dict(shape=(6, 11), noncontig=True))],
           lambda d: dict(shape=d.lead(3, 20), approximate=d.choice(["none", "tanh"])),
           lambda torch, t, kw: _F(torch).gelu(t["x"], approximate=kw["approximate"]),
           bench=dict(shape=(2048, 3072)), noncontig="x"),
    OpSpec("tanh", make_tanh,
           [("one element", dict(shape=(1,))), ("saturated and 0", dict(shape=(3, 7))),
            ("non-contiguous x", dict(shape=(4, 9), noncontig=True))],
           lambda d: dict(shape=d.lead(3, 20)), lambda torch, t, kw: torch.tanh(t["x"]),
           bench=dict(shape=(2048, 768)), noncontig="x"),
    OpSpec("dropout", make_dropout,
           [("one element", dict(shape=(1,))), ("p = 0.1", dict(shape=(3, 37))),
            ("p = 0.5", dict(shape=(2, 5, 52), p=0.5)), ("p = 1 (all dropped)", dict(shape=(7,), p=1.0)),
            ("p = 0.3, 4099 elements", dict(shape=(4099,), p=0.3)), ("eval", dict(shape=(3, 5), train=False)),
            ("p = 0", dict(shape=(2, 3), p=0.0)), ("no elements", dict(shape=(0, 3))),
            ("non-contiguous x", dict(shape=(4, 9), p=0.3, noncontig=True))],
           lambda d: dict(shape=d.lead(3, 20), p=d.choice([0.1, 0.3, 0.5, 0.9])),
           lambda torch, t, kw: _drop(torch, t["x"], _torch_keep(torch, kw, t["x"].shape, "dropout"), kw["p"]),
           bench=dict(shape=(4, 12, 128, 128), p=0.1), noncontig="x"),
    OpSpec("add", make_add,
           [("one element", dict(shape=(1,))), ("(2, 3, 4)", dict(shape=(2, 3, 4))),
            ("non-contiguous a", dict(shape=(3, 8), noncontig=True))],
           lambda d: dict(shape=d.lead(3, 20)), lambda torch, t, kw: t["a"] + t["b"],
           bench=dict(shape=(2048, 768)), noncontig="a"),
    OpSpec("attention", make_attention,
           [("T = 1, no mask, eval", dict(B=1, T=1, H=1, hs=4, mask=None, p=0.0, train=False)),
            ("T = 1", dict(B=1, T=1, H=1, hs=3)),
            ("T = 37, H = 3, one real token", dict(B=2, T=37, H=3, hs=4)),
            ("T = 37, eval", dict(B=2, T=37, H=3, hs=4, train=False)),
            ("-inf padding, p = 0.2", dict(B=3, T=12, H=1, hs=5, mask="ninf", p=0.2)),
            ("a fully padded sequence", dict(B=2, T=9, H=2, hs=3, mask="empty_row")),
            ("causal (H, T, T) mask", dict(B=1, T=10, H=3, hs=8, mask="causal")),
            ("head size 1", dict(B=2, T=6, H=4, hs=1)),
            ("non-contiguous q", dict(B=2, T=7, H=2, hs=3, noncontig=True))],
           lambda d: dict(B=d.int(1, 3), T=d.int(1, 24), H=d.int(1, 4), hs=d.int(1, 8),
                          mask=d.choice([None, "hf", "empty_row", "causal"]), p=d.choice([0.0, 0.1, 0.3])),
           torch_attention, bench=dict(B=4, T=128, H=12, hs=64, p=0.1), noncontig="q"),
    OpSpec("cross_entropy", make_cross_entropy,
           [("V = 1", dict(lead=(1,), V=1)), ("one row", dict(lead=(1,), V=7)),
            ("half the labels ignored", dict(lead=(37,), V=52, ignored=0.5)),
            ("every label ignored", dict(lead=(4,), V=13, ignored=1.0)),
            ("logits 1e4", dict(lead=(2, 3), V=60, big=True)),
            ("85% ignored, V = 1031", dict(lead=(3, 5), V=1031, ignored=0.85, big=True)),
            ("non-contiguous logits", dict(lead=(5,), V=9, noncontig=True))],
           lambda d: dict(lead=d.lead(), V=d.int(1, 60), ignored=d.choice([0.0, 0.5, 0.85]), big=d.choice([False, True])),
           lambda torch, t, kw: torch_cross_entropy(torch, t, kw),
           bench=dict(lead=(77,), V=30522), noncontig="logits"),
    OpSpec("bce_with_logits", make_bce,
           [("one element", dict(shape=(1,))), ("(3, 5)", dict(shape=(3, 5))),
            ("logits of +-30", dict(shape=(4, 6), scale=30.0)), ("soft targets", dict(shape=(2, 7), binary=False))],
           lambda d: dict(shape=d.lead(2, 12), scale=d.choice([1.0, 3.0, 30.0]), binary=d.choice([True, False])),
           lambda torch, t, kw: _F(torch).binary_cross_entropy_with_logits(t["logits"],
                                                                         _t(torch, kw["targets"]).to(t["logits"].dtype)),
           bench=dict(shape=(512, 64))),
    OpSpec("mse", make_mse,
           [("one element", dict(shape=(1,))), ("(4, 3)", dict(shape=(4, 3))),
            ("non-contiguous pred", dict(shape=(3, 8), noncontig=True))],
           lambda d: dict(shape=d.lead(2, 12)), lambda torch, t, kw: _F(torch).mse_loss(t["pred"], t["target"]),
           bench=dict(shape=(512, 64)), noncontig="pred"),
    OpSpec("residual_layernorm", lambda p, r, dt: make_layernorm(p, r, dt, residual=True),
           [("C = 1", dict(lead=(1,), C=1)), ("37 rows of 52", dict(lead=(37,), C=52)),
            ("constant rows", dict(lead=(2, 5), C=7, kind="constant")),
            ("non-contiguous a", dict(lead=(3, 4), C=13, noncontig=True))],
           lambda d: dict(lead=d.lead(), C=d.int(1, 64), kind=d.choice(["normal", "constant"])),
           lambda torch, t, kw: torch_layernorm(torch, t["x"] + t["a"], t["w"], t["b"], 1e-12),
           bench=dict(lead=(2048,), C=768), noncontig="a"),
    OpSpec("dropout_residual_layernorm", lambda p, r, dt: make_layernorm(p, r, dt, dropout=True),
           [("C = 1", dict(lead=(1,), C=1)), ("p = 0.1", dict(lead=(3,), C=37)),
            ("p = 0.5", dict(lead=(3,), C=37, p=0.5)), ("p = 1", dict(lead=(2, 3), C=7, p=1.0)),
            ("eval", dict(lead=(3,), C=37, train=False)), ("p = 0", dict(lead=(2,), C=5, p=0.0)),
            ("non-contiguous a", dict(lead=(3, 4), C=13, noncontig=True))],
           lambda d: dict(lead=d.lead(), C=d.int(1, 64), p=d.choice([0.0, 0.1, 0.5])),
           lambda torch, t, kw: torch_layernorm(
               torch, t["x"] + _drop(torch, t["a"], _torch_keep(torch, kw, t["a"].shape, "dropout"), kw["p"]),
               t["w"], t["b"], kw["eps"]),
           bench=dict(lead=(2048,), C=768), noncontig="a"),
    OpSpec("bias_gelu", lambda p, r, dt: make_gelu(p, r, dt, bias=True),
           [("one element", dict(shape=(1, 1))), ("tails and 0", dict(shape=(1, 52))),
            ("tails, tanh", dict(shape=(1, 52), approximate="tanh")), ("37 x 52", dict(shape=(37, 52))),
            ("(3, 5, 7), tanh", dict(shape=(3, 5, 7), approximate="tanh")),
            ("non-contiguous x", dict(shape=(6, 11), noncontig=True))],
           lambda d: dict(shape=d.lead(3, 20), approximate=d.choice(["none", "tanh"])),
           lambda torch, t, kw: _F(torch).gelu(t["x"] + t["b"], approximate=kw["approximate"]),
           bench=dict(shape=(2048, 3072)), noncontig="x"),
    OpSpec("gather_rows", make_gather_rows,
           [("one row", dict(lead=(1,), C=3, rows=[0])), ("labelled positions", dict(lead=(2, 4), C=3, rows=[5, 0, 6])),
            ("a repeated row", dict(lead=(6,), C=4, rows=[1, 1, 3])), ("no rows", dict(lead=(3,), C=2, rows=[])),
            ("non-contiguous x", dict(lead=(2, 5), C=4, rows=[9, 2], noncontig=True))],
           lambda d: dict(lead=d.lead(), C=d.int(1, 16)),
           lambda torch, t, kw: t["x"].reshape(-1, t["x"].shape[-1])[_t(torch, kw["rows"])],
           bench=dict(lead=(8, 128), C=768), noncontig="x"),
]}
assert set(SPECS) == set(OPS), set(SPECS) ^ set(OPS)


# ----------------------------------------------------------------------------------------------------------------
# one case: inputs in the dtype, the float64 truth, your pair, the yardsticks

@dataclass
class Case:
    """An edge case or a drawn one: the op's params and the seed of its random values."""
    label: str
    params: dict
    seed: int = 0


def _fresh(kw):
    """The case's keyword arguments with a fresh DropoutRNG (every implementation draws the same streams)."""
    return {k: (DropoutRNG(**v.state) if isinstance(v, DropoutRNG) else v) for k, v in kw.items()}


def _cast_kw(kw, dtype):
    return {k: (v.astype(dtype) if isinstance(v, np.ndarray) and v.dtype.kind == "f" else v) for k, v in kw.items()}


def _strided(a):
    """a as a non-contiguous view (every second column of a twice-as-wide array), same values."""
    if a.ndim == 0 or a.size == 0:
        return a
    big = np.zeros((*a.shape[:-1], 2 * a.shape[-1]), a.dtype)
    big[..., ::2] = a
    return big[..., ::2]


def _args(fn_oracle, values):
    """Positional arguments in the oracle's order (the model calls ops positionally): every parameter up to the
    last one given, the oracle's default filling a gap."""
    params = list(inspect.signature(fn_oracle).parameters.values())
    last = max((i for i, p in enumerate(params) if p.name in values), default=-1)
    return [values[p.name] if p.name in values else p.default for p in params[:last + 1]]


def _grads(g):
    return g if isinstance(g, tuple) else (g,)


def build(spec, case, dtype):
    """(inputs in dtype (the non-contiguous one a strided view), kwargs in dtype) for a case."""
    inputs, kw = spec.make(case.params, np.random.default_rng(case.seed), np.dtype(dtype))
    xd = {k: np.asarray(v, np.float64).astype(dtype) for k, v in inputs.items()}
    if case.params.get("noncontig") and spec.noncontig in xd:
        xd[spec.noncontig] = _strided(xd[spec.noncontig])
    return xd, _cast_kw(kw, dtype)


def _dout(shape, dtype, seed):
    if shape == ():
        return np.dtype(dtype).type(DLOSS)
    return np.random.default_rng(seed + 7919).standard_normal(shape).astype(dtype)


def run_oracle(op, inputs, kw, dout_seed):
    """The oracle on these inputs: (out, {d<name>: grad}, dout)."""
    f, b = getattr(oracle, f"{op}_forward"), getattr(oracle, f"{op}_backward")
    out, cache = f(*_args(f, {**inputs, **_fresh(kw)}))
    dout = _dout(np.shape(out), np.asarray(out).dtype, dout_seed)
    return out, dict(zip((f"d{k}" for k in inputs), _grads(b(dout, cache)))), dout


def _scale(ref):
    finite = np.isfinite(ref)
    return float(np.abs(ref[finite]).max(initial=0.0))


def ulps(got, ref, dtype, sibling=0.0):
    """max|got - ref| / (eps(dtype) * scale) over the finite entries of ref, scale = max|ref|; inf where got is not
    finite but ref is, or differs at ref's +-inf / NaN. A tensor that is 0 in exact arithmetic (max|ref| at most
    eps x `sibling`, the largest tensor of its kind: attention's dq at T = 1, LayerNorm's dw on constant rows, the key
    bias's gradient) has no scale of its own: its rounding residue is that of the terms it sums, so the sibling's
    scale is used (the smallest normal number when there is none)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if ref.size == 0:
        return 0.0
    fin = np.isfinite(ref)
    if not np.array_equal(got[~fin], ref[~fin], equal_nan=True) or not np.isfinite(got[fin]).all():
        return math.inf
    own = _scale(ref)
    scale = max(own if own > EPS[np.dtype(dtype).name] * sibling else sibling, float(np.finfo(dtype).tiny))
    return float(np.abs(got[fin] - ref[fin]).max(initial=0.0)) / scale / EPS[np.dtype(dtype).name]


def tolerance(*noise):
    """max(FACTOR x the largest finite yardstick, FLOOR_ULPS), in ulps (a yardstick that is itself not finite, e.g.
    PyTorch's NaN where the oracle is finite, sets nothing)."""
    finite = [v for v in noise if v is not None and math.isfinite(v)]
    return max(FACTOR * max(finite, default=0.0), FLOOR_ULPS)


@dataclass
class TensorResult:
    tensor: str                  # "out", "dx", ..., or "inputs" (written into)
    shape: tuple
    ulps: float = None           # error in ulps of the dtype at the tensor's scale (None: not compared)
    tolerance: float = None      # ulps
    refbert: float = None        # the float32 noise (refbert's own error, the inputs' 1-ulp sensitivity), ulps
    pytorch: float = None        # PyTorch's ulps on the same inputs, or None
    ok: bool = False
    note: str = ""
    detail: list = field(default_factory=list)


@dataclass
class CaseResult:
    label: str
    params: dict
    shape: str                   # the main input's shape, for the table
    tensors: list
    drawn: bool = False

    @property
    def ok(self):
        return all(t.ok for t in self.tensors)


_NOISE = {}


def noise(spec, case):
    """{tensor: ulps} of float32 noise on the case's values, the largest of: refbert's own float32 computation
    against float64 on the same values, over the inputs as given and SAMPLES - 1 draws that move every input by a
    random +-1 ulp; and how far the exact (float64) result moves under those moves (the case's conditioning: a
    backward-stable code, exact on inputs an ulp away, is that far off). Cached per case."""
    return {name: max(own, moved) for name, (own, moved) in noise_parts(spec, case).items()}


def noise_parts(spec, case):
    """{tensor: (own, moved)}: noise()'s two halves apart, in ulps at the tensor's scale. own: refbert's float32
    error against float64, the worst over the SAMPLES inputs; moved: the most the exact result moves when every
    input moves by a random +-1 ulp (0 where SAMPLES is 1). Cached per case."""
    key = (spec.name, repr(sorted(case.params.items())), case.seed)
    if key in _NOISE:
        return _NOISE[key]
    xd, kw = build(spec, case, np.float32)
    own, moved, exact = {}, {}, {}
    for s in range(SAMPLES):
        x = xd
        if s:
            r = np.random.default_rng(1000 + s)
            x = {k: np.where(r.random(v.shape) < 0.5, np.nextafter(v, np.float32(np.inf)),
                             np.nextafter(v, np.float32(-np.inf))).astype(np.float32) for k, v in xd.items()}
        out32, g32, _ = run_oracle(spec.name, x, kw, case.seed)
        out64, g64, _ = run_oracle(spec.name, {k: v.astype(np.float64) for k, v in x.items()},
                                   _cast_kw(kw, np.float64), case.seed)
        for name, got, ref in [("out", out32, out64), *((k, g32[k], g64[k]) for k in g64)]:
            sib = siblings(name, g64)
            own[name] = max(own.get(name, 0.0), ulps(got, ref, np.float32, sib))
            if s == 0:
                exact[name] = ref
                moved[name] = 0.0
            else:          # how far the exact result moves when every input moves by 1 ulp: no code does better
                moved[name] = max(moved[name], ulps(ref, exact[name], np.float32, sib))
    _NOISE[key] = {name: (own[name], moved[name]) for name in own}
    return _NOISE[key]


def siblings(name, grads):
    """The scale a tensor that is 0 in exact arithmetic is judged on: the largest gradient (for a gradient)."""
    return 0.0 if name == "out" else max((_scale(np.asarray(g, np.float64)) for g in grads.values()), default=0.0)


def torch_errors(spec, xd, kw, truth, dtype, dout):
    """{tensor: ulps} of the PyTorch peer on the same inputs in the dtype, or {} without torch (or a peer)."""
    if spec.torch is None:
        return {}
    try:
        import torch
    except ImportError:
        return {}
    t = {k: torch.from_numpy(np.ascontiguousarray(v)).requires_grad_() for k, v in xd.items()}
    try:
        out = spec.torch(torch, t, kw)
        d = torch.as_tensor(np.asarray(dout)) if np.ndim(dout) else torch.tensor(float(dout), dtype=out.dtype)
        grads = torch.autograd.grad(out, list(t.values()), d, allow_unused=True)
    except Exception:                                 # a peer that cannot run this case (none is expected)
        return {}
    res = {"out": ulps(out.detach().numpy(), truth["out"], dtype)}
    gt = {n: v for n, v in truth.items() if n != "out"}
    for k, g in zip(t, grads):
        res[f"d{k}"] = ulps(np.zeros(xd[k].shape) if g is None else g.numpy(), truth[f"d{k}"], dtype,
                            siblings(f"d{k}", gt))
    return res


def _shape_label(xd):
    k, v = next(iter(xd.items()))
    return f"{k} {tuple(v.shape)}"


def run_case(spec, case, forward, backward, dtype):
    """Your forward and/or backward on one case against the float64 oracle, with the yardsticks. -> CaseResult"""
    dtype = np.dtype(dtype)
    xd, kw = build(spec, case, dtype)
    out_t, g_t, dout_t = run_oracle(spec.name, {k: v.astype(np.float64) for k, v in xd.items()},
                                    _cast_kw(kw, np.float64), case.seed)
    truth = {"out": out_t, **g_t}
    dout = _dout(np.shape(out_t), dtype, case.seed)
    names = (["out"] if forward is not None else []) + (list(g_t) if backward is not None else [])
    shape = _shape_label(xd)
    res = CaseResult(case.label, case.params, shape, [], drawn=case.label.startswith("drawn"))
    before = {k: v.copy() for k, v in xd.items()}
    dout_before = np.copy(dout)
    f_or = getattr(oracle, f"{spec.name}_forward")
    got, failed, half = {}, None, "forward"
    try:
        out, cache = (forward or f_or)(*_args(f_or, {**xd, **_fresh(kw)}))
        got["out"] = out
        if backward is not None:
            half = "backward"
            g = _grads(backward(dout, cache))
            if len(g) != len(g_t):
                failed = (f"backward returned {len(g)} gradient(s), expected {len(g_t)} "
                          f"({', '.join(g_t)})")
            got.update(zip(g_t, g))
    except NotImplementedError as e:
        failed = f"not written yet (NotImplementedError{': ' + str(e) if str(e) else ''})"
    except Exception as e:
        failed = f"{half} raised {type(e).__name__}: {_short(e)}"
    got = convert_tree(got, "numpy")
    if failed:                     # what did not come back fails; a forward that ran is still graded
        res.tensors = [TensorResult(n, tuple(np.shape(truth[n])), note=failed) for n in names
                       if n not in got or n != "out"]
        names = [n for n in names if n == "out" and n in got]
    written = [k for k in xd if not np.array_equal(before[k], xd[k], equal_nan=True)]
    if not np.array_equal(dout_before, dout, equal_nan=True):
        written.append("dout")
    yard = noise(spec, case)
    peer = torch_errors(spec, xd, kw, truth, dtype, dout)
    for n in names:
        ref, x = np.asarray(truth[n]), got.get(n)
        tr = TensorResult(n, tuple(ref.shape), refbert=yard.get(n), pytorch=peer.get(n))
        tr.tolerance = tolerance(tr.refbert, tr.pytorch)
        scalars = _scalars(kw, xd)
        if np.ndim(out_t) == 0:
            scalars["dloss"] = DLOSS
        context = dict(op=spec.name, tensor=n, x=xd.get(n[1:]) if n != "out" else None,
                       out=np.asarray(out_t), dout=np.asarray(dout_t), scalars=scalars)
        a = None if x is None else np.asarray(x)
        if a is None or a.dtype.kind not in "fc":
            tr.note = f"expected a {dtype.name} array, got {type(x).__name__ if a is None else a.dtype}"
        elif a.shape != ref.shape:
            tr.note = f"shape {a.shape}, expected {ref.shape}"
            tr.detail = explain_shape(a, ref)
        elif a.dtype != dtype:
            tr.note = f"returned {a.dtype} for {dtype.name} inputs (outputs keep the input's dtype)"
        else:
            tr.ulps = ulps(a, ref, dtype, siblings(n, g_t))
            tr.ok = math.isfinite(tr.ulps) and tr.ulps <= tr.tolerance
            if not tr.ok:
                tr.note = "not finite where the oracle is" if math.isinf(tr.ulps) else ""
                tr.detail = explain(a, ref, context)
        res.tensors.append(tr)
    if written and not failed:
        res.tensors.append(TensorResult("inputs", (), note=f"wrote into its argument(s) {', '.join(written)} "
                                                           f"(forwards and backwards must not)"))
    return res


def _short(e, n=160):
    s = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return s if len(s) <= n else s[:n - 3] + "..."


def _scalars(kw, xd):
    """The call's numbers a uniform factor may be made of: p, scale, eps, and the sizes of the axes."""
    s = {k: float(v) for k, v in kw.items() if isinstance(v, (float, int)) and not isinstance(v, bool)
         and k not in ("ignore_index",)}
    for k, v in xd.items():
        for i, n in enumerate(v.shape):
            s.setdefault(f"{k}.shape[{i}]", float(n))
    return s


# ----------------------------------------------------------------------------------------------------------------
# the shape of an error, from the difference alone

def _rel(residual, D):
    nd = float(np.linalg.norm(D))
    return float(np.linalg.norm(residual)) / nd if nd else 0.0


FIT = 0.05            # a pattern "explains" the error when what it leaves is under 5% of it (in the 2-norm)


def explain_shape(got, ref):
    """Lines for a gradient of the wrong shape: a transpose, or leading axes that were not summed over."""
    if got.ndim == ref.ndim == 2 and got.shape == ref.shape[::-1]:
        err = _rel(got.T - ref, ref)
        return ["shape of the error: the expected shape transposed; got.T "
                + ("equals the expected gradient (within 1e-3): you computed the transpose" if err < 1e-3 else
                   f"is still {err:.2g} off (relative)")]
    if got.ndim > ref.ndim and got.shape[got.ndim - ref.ndim:] == ref.shape:
        s = got.reshape(-1, *ref.shape).sum(0)
        err = _rel(s - ref, ref)
        return [f"shape of the error: extra leading axes {got.shape[:got.ndim - ref.ndim]}; summed over them it "
                + ("equals the expected gradient (within 1e-3): sum over every leading position" if err < 1e-3
                   else f"is {err:.2g} off")]
    return []


def _worst(D, got, ref, k=3):
    flat = np.argsort(-np.abs(np.nan_to_num(D, nan=np.inf)).reshape(-1), kind="stable")[:k]
    out = []
    for f in flat:
        i = np.unravel_index(f, D.shape)
        out.append(f"[{', '.join(map(str, i))}] got {got[i]:.7g}, expected {ref[i]:.7g}")
    return "worst elements: " + "; ".join(out)


def _name_factor(c, scalars):
    """A scalar expression of the call that equals c (within 1e-3), e.g. '1 - p (p = 0.3)'."""
    cands = [("-1", -1.0), ("2", 2.0), ("1/2", 0.5)]
    for k, v in scalars.items():
        if v == 0:
            continue
        cands += [(k, v), (f"1/{k}", 1 / v)]
        if "shape" not in k:
            cands += [(f"1 - {k}", 1 - v), (f"sqrt({k})", math.sqrt(abs(v))), (f"1/sqrt({k})", 1 / math.sqrt(abs(v)))]
            if v != 1:
                cands.append((f"1/(1 - {k})", 1 / (1 - v)))
    for name, v in cands:
        if abs(c - v) <= 1e-3 * abs(v):
            detail = ", ".join(f"{k} = {scalars[k]:g}" for k in scalars if k in name)
            return f"{name}" + (f" ({detail})" if detail else "")
    return None


def _axis_name(axis, ndim):
    if axis == ndim - 1:
        return "within each row (along the last axis): every element of a row is off by that row's own amount"
    return f"along axis {axis} (the same for every index of that axis)"


def _elementwise(D, x, dout):
    """The error as dout * g(x) with g a function of x alone (an elementwise derivative off by g): a line, or None."""
    if x is None or dout is None or np.shape(x) != D.shape or np.shape(dout) != D.shape or D.size < 8:
        return None
    x, d = np.asarray(x, np.float64).reshape(-1), np.asarray(dout, np.float64).reshape(-1)
    use = np.abs(d) > 1e-3 * np.abs(d).max()
    if use.sum() < 8:
        return None
    g, xs = D.reshape(-1)[use] / d[use], x[use]
    order = np.argsort(xs, kind="stable")
    xs, g = xs[order], g[order]
    spread = np.abs(g).max()
    if spread == 0:
        return None
    # a function of x: neighbours in x have neighbouring g (interpolating each point from its two neighbours)
    mid = (g[:-2] + g[2:]) / 2
    if np.abs(g[1:-1] - mid).max() > 0.2 * spread:
        return None
    pts = [v for v in (-3.0, -1.0, 0.0, 1.0, 3.0) if xs[0] <= v <= xs[-1]]
    vals = ", ".join(f"g({v:g}) = {np.interp(v, xs, g):.3g}" for v in pts)
    sym = ""
    if xs[0] < -0.5 and xs[-1] > 0.5:
        grid = np.linspace(0.1, min(-xs[0], xs[-1]), 20)
        gp, gm = np.interp(grid, xs, g), np.interp(-grid, xs, g)
        if np.abs(gp + gm).max() < 0.05 * spread:
            sym = "; g is odd in x"
        elif np.abs(gp - gm).max() < 0.05 * spread:
            sym = "; g is even in x"
    tail = np.abs(g[np.abs(xs) > 4]) if (np.abs(xs) > 4).any() else None
    far = "; g -> 0 for |x| > 4 (the term matters near 0 only)" if tail is not None and tail.max() < 0.01 * spread \
        else ""
    lin = ""
    nz = np.abs(xs) > 1e-3
    if nz.sum() >= 4 and np.ptp(g[nz] / xs[nz]) < 0.02 * np.abs(g[nz] / xs[nz]).max():
        lin = f"; g(x) = {np.median(g[nz] / xs[nz]):.4g} x"
    return (f"the upstream gradient times a function of the input alone, (got - expected) = dout * g(x): the "
            f"local derivative is off by g ({vals}{sym}{far}{lin})")


def explain(got, ref, context=None):
    """Lines describing got - ref: the worst elements, then the first pattern that explains the difference (what
    it leaves is under 5% of it). context (optional): x (the input this gradient belongs to), out (the forward's
    output), dout (the upstream gradient), scalars ({name: number} of the call)."""
    c = context or {}
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    D = got - ref
    lines = [_worst(D, got, ref)]
    fin = np.isfinite(D)
    if not fin.all():
        i = np.unravel_index(int(np.argmin(fin.reshape(-1))), D.shape)
        return lines + [f"shape of the error: not finite at {list(map(int, i))} ({got[i]!r}) where the oracle is "
                        f"{ref[i]!r}; {int((~fin).sum())} of {D.size} such entries"]
    lines.append("shape of the error: " + _pattern(D, got, ref, c))
    return lines


def _pattern(D, got, ref, c):
    n, nz = D.size, int((np.abs(D) > 1e-6 * np.abs(D).max()).sum())
    if not np.abs(got).any():
        return "got zeros everywhere (a gradient never written, or multiplied by a zero)"
    if _rel(got + ref, D) < FIT:
        return "got = -expected: a sign flip"
    rr = float(np.sum(ref * ref))
    if rr:
        k = float(np.sum(got * ref)) / rr
        if _rel(got - k * ref, D) < FIT:
            named = _name_factor(k, c.get("scalars", {}))
            if abs(k - 1) < 1e-3:                     # a constant rounded in a lower precision, most often
                return (f"got = (1 {'+' if k > 1 else '-'} {abs(k - 1):.3g}) x expected everywhere: a uniform "
                        f"factor a few ulps from 1 (a constant computed in a lower precision?)")
            return f"got = {k:.5g} x expected everywhere: a uniform factor" + (f", = {named}" if named else "") + \
                f" (1/{k:.5g} = {1 / k:.5g})" * (k != 0)
    if D.ndim >= 2 and D.shape[-1] == D.shape[-2] and D.shape[-1] > 1 and \
            _rel(got - np.swapaxes(ref, -1, -2), D) < FIT:
        return "got is the expected tensor transposed (its last two axes swapped)"
    for axis in reversed(range(D.ndim)):
        if D.shape[axis] > 1 and _rel(D - D.mean(axis, keepdims=True), D) < FIT:
            return (f"the error is constant {_axis_name(axis, D.ndim)}: a term that is the same across that axis "
                    f"is missing or extra (a mean, a sum, a bias)")
    out, x = c.get("out"), c.get("x")
    for name, y in (("the forward's output", out), ("the input", x)):
        if y is None or np.shape(y) != D.shape or not np.abs(y).any():
            continue
        y = np.asarray(y, np.float64)
        k = float(np.sum(D * y)) / float(np.sum(y * y))
        if _rel(D - k * y, D) < FIT:
            return f"the error is {k:.4g} x {name}: a term proportional to {name} is missing or extra"
        if D.ndim >= 1 and D.shape[-1] > 1:
            yy = (y * y).sum(-1, keepdims=True)
            kr = np.divide((D * y).sum(-1, keepdims=True), yy, out=np.zeros_like(yy), where=yy > 0)
            if _rel(D - kr * y, D) < FIT:
                return (f"the error is {name} times an amount per row (got - expected = {name} * c_row): a term "
                        f"proportional to {name}, with a coefficient per row, is missing or extra (like out * "
                        f"sum(dout * out))" if name.endswith("output") else
                        f"the error is {name} times an amount per row: a term proportional to {name} is missing "
                        f"or extra")
            # per row an affine function of y: a * y + b (a centred term, like x - mean)
            yc = y - y.mean(-1, keepdims=True)
            Dc = D - D.mean(-1, keepdims=True)
            yy = (yc * yc).sum(-1, keepdims=True)
            ka = np.divide((Dc * yc).sum(-1, keepdims=True), yy, out=np.zeros_like(yy), where=yy > 0)
            if _rel(Dc - ka * yc, D) < FIT:
                return (f"per row, the error is an affine function of {name} (a_row * {name} + b_row): a term "
                        f"in {name} minus its row mean is missing or extra (like a variance or mean term)")
    el = _elementwise(D, x, c.get("dout"))
    if el:
        return el
    if nz < n:
        where = ref.reshape(-1)[np.abs(D.reshape(-1)) > 1e-6 * np.abs(D).max()]
        if not where.any():
            return f"the error sits at {nz} of {n} elements only, all where the expected value is 0"
        lead = sorted({tuple(i[:-1]) for i in np.argwhere(np.abs(D) > 1e-6 * np.abs(D).max())}) if D.ndim > 1 else []
        if lead and len(lead) <= 4:
            return f"the error sits in the rows {', '.join(str(list(i)) for i in lead)} only ({nz} of {n} elements)"
        return f"the error sits at {nz} of {n} elements only"
    return f"no simple pattern: every element is off, |got - expected| up to {np.abs(D).max():.3g} (max |expected| " \
           f"{np.abs(ref).max():.3g})"


# ----------------------------------------------------------------------------------------------------------------
# check_op and its report

def edge_cases(op):
    """The op's edge cases as Case objects."""
    return [Case(label, params, seed=i) for i, (label, params) in enumerate(SPECS[op].edges)]


def _spec(op):
    if op not in SPECS:
        raise ValueError(f"check_op: argument 'op' expected one of {', '.join(OPS)}, got {op!r}")
    return SPECS[op]


class _Failed(Exception):
    def __init__(self, res):
        super().__init__(res.label)
        self.res = res


def drawn_results(spec, run, n, seed=0):
    """n drawn cases through run(case) -> CaseResult. With hypothesis installed it draws them, and shrinks a
    failing one to a minimal case (the results: every generated case until the first failure, then that first
    failure and the minimal one); without it, a seeded NumPy generator draws them."""
    if n <= 0:
        return []
    try:
        from hypothesis import HealthCheck, Phase, Verbosity, given, settings, strategies as st
    except ImportError:
        r = np.random.default_rng(seed)
        out = []
        for i in range(n):
            params = spec.draw(_Pick(rng=r))
            out.append(run(Case(f"drawn #{i + 1}", params, seed=100 + i)))
        return out
    results, first = [], []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None, verbosity=Verbosity.quiet,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink])
    @given(st.data())
    def prop(data):
        params = spec.draw(_Pick(data=data))
        seed_ = data.draw(st.integers(0, 2 ** 16))
        res = run(Case(f"drawn #{len(results) + 1}", params, seed=seed_))
        if not first:
            results.append(res)
        if not res.ok:
            if not first:
                first.append(res)
            raise _Failed(res)
    try:
        prop()
    except _Failed as e:
        minimal = e.res
        minimal.label = "drawn, shrunk by hypothesis"
        if minimal is not first[0]:
            results.append(minimal)
    return results


@dataclass
class OpReport:
    """check_op's verdict: `cases` every CaseResult, `rows` one per tensor (the worst case), `passed`."""
    op: str
    dtype: str
    given: str                   # "forward and backward", "backward only", "forward only"
    cases: list
    library: str = None

    @property
    def rows(self):
        """One dict per tensor: the case where error/tolerance was worst (a failing one first)."""
        by = {}
        for c in self.cases:
            for t in c.tensors:
                by.setdefault(t.tensor, []).append((c, t))
        rows = []
        for name, items in by.items():
            def badness(ct):
                c, t = ct
                if t.ulps is None:
                    return math.inf
                return t.ulps / t.tolerance if t.tolerance else math.inf
            c, t = max(items, key=badness)
            failing = [ct for ct in items if not ct[1].ok]
            # explained on the largest failing case (a pattern needs elements; the smallest is named too)
            shown = max(failing, key=lambda ct: int(np.prod(ct[1].shape))) if failing else None
            rows.append(dict(op=self.op, tensor=name, dtype=self.dtype, cases=len(items), failed=len(failing),
                             worst_case=c.label, shape=c.shape, ulps=t.ulps, tolerance=t.tolerance,
                             refbert=t.refbert, pytorch=t.pytorch, ok=not failing, note=t.note,
                             first_failure=_failure(*shown) if failing else None,
                             smallest_failure=min(failing, key=lambda ct: int(np.prod(ct[1].shape)))[0].label
                             if failing else None))
        return rows

    @property
    def passed(self):
        return all(c.ok for c in self.cases) and bool(self.cases)

    def __str__(self):
        return format_reports([self])

    def to_json(self):
        return _dumps(dict(op=self.op, dtype=self.dtype, given=self.given, passed=self.passed, rows=self.rows,
                           cases=[dict(label=c.label, params=c.params, shape=c.shape, ok=c.ok,
                                       tensors=[t.__dict__ for t in c.tensors]) for c in self.cases]))


def _failure(case, t):
    return dict(case=case.label, shape=case.shape, params=case.params, tensor=t.tensor, note=t.note,
                ulps=t.ulps, tolerance=t.tolerance, detail=t.detail)


def _dumps(obj):
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        if isinstance(x, np.generic):
            return x.item()
        return x
    return json.dumps(clean(obj), indent=1, default=str) + "\n"


def _u(x):
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf"
    return f"{x:.3g}" if x < 1e4 else f"{x:.2e}"


def format_reports(reports):
    """refbert check's table: one row per op, tensor and dtype; then each failure, localised."""
    head = ("op", "tensor", "dtype", "cases", "worst on", "error (ulps)", "tolerance", "noise", "pytorch", "")
    body, fails = [], []
    for rep in reports:
        for r in rep.rows:
            body.append((r["op"], r["tensor"], r["dtype"], str(r["cases"]), f"{r['worst_case']} ({r['shape']})",
                         _u(r["ulps"]) if r["ulps"] is not None else "-", _u(r["tolerance"]), _u(r["refbert"]),
                         _u(r["pytorch"]), "pass" if r["ok"] else "FAIL"))
            if not r["ok"]:
                fails.append(r)
    lines = [text_table(head, body)]
    for r in fails:
        f = r["first_failure"]
        what = f["note"] or f"{_u(f['ulps'])} ulps against a tolerance of {_u(f['tolerance'])}"
        small = f" (the smallest: {r['smallest_failure']})" if r["smallest_failure"] != f["case"] else ""
        lines.append(f"\nFAIL {r['op']} {f['tensor']} ({r['dtype']}): {r['failed']} of {r['cases']} cases{small}; "
                     f"on {f['case']} ({f['shape']}): {what}")
        lines += [f"  {d}" for d in f["detail"]]
    return "\n".join(lines)


LEGEND = ("error: max|x - oracle| / (eps * max|oracle|) in ulps of the dtype, against the float64 oracle on the same "
          f"rounded inputs;\ntolerance = max({FACTOR} x noise, {FLOOR_ULPS}); noise: refbert's own float32 error on "
          f"the inputs as given and moved by +-1 ulp ({SAMPLES} runs), or how far those moves move the exact result, "
          f"whichever is larger;\npytorch: PyTorch's error on the same inputs in the dtype, a second yardstick "
          f"(the tolerance is at least {FACTOR} x it too)")


def check_op(op, forward=None, backward=None, *, dtype="float32", cases=None, examples=EXAMPLES, seed=0):
    """Grade your forward and/or backward of refbert.ops' `op` against the float64 oracle. -> OpReport

    forward(*args) -> (out, cache) and backward(dout, cache) -> grads take the oracle's arguments, positionally in
    its order. Give both, or one: without a forward the oracle's makes the cache your backward reads; without a
    backward only the output is graded. dtype: "float32" or "float64". cases: None for the op's edge cases and
    `examples` drawn shapes (hypothesis when installed), or a list of Case objects / params dicts. The arrays your
    functions take: their `array_library` attribute, or probed (refbert.backends.adapt)."""
    spec = _spec(op)
    dtype = np.dtype(dtype)
    if dtype.name not in EPS:
        raise ValueError(f"check_op: argument 'dtype' expected 'float32' or 'float64', got {dtype.name!r}")
    if forward is None and backward is None:
        raise ValueError("check_op: expected a forward, a backward or both, got neither")
    for name, fn in (("forward", forward), ("backward", backward)):
        if fn is not None and not callable(fn):
            raise ValueError(f"check_op: argument '{name}' expected a function, got {type(fn).__name__}")
    lib = lambda fn: None if fn is None else adapt(fn, getattr(fn, "array_library", None))  # noqa: E731
    fwd, bwd = lib(forward), lib(backward)

    def run(case):
        return run_case(spec, case, fwd, bwd, dtype)
    if cases is None:
        results = [run(c) for c in edge_cases(op)] + drawn_results(spec, run, examples, seed)
    else:
        results = [run(c if isinstance(c, Case) else Case(f"case #{i + 1}", dict(c), seed=i))
                   for i, c in enumerate(cases)]
    given = "forward and backward" if forward is not None and backward is not None else \
        "forward only" if backward is None else "backward only"
    libs = {getattr(f, "array_library", None) for f in (fwd, bwd) if f is not None}
    return OpReport(op, dtype.name, given, results, library=", ".join(sorted(x for x in libs if x)) or None)


# ----------------------------------------------------------------------------------------------------------------
# timing: as refbert bench (the timer lives here; kernels/_harness.py uses it)

def time_call(fn, repeats=10, min_time=0.2):
    """Median seconds of fn() over at least `repeats` calls and `min_time` seconds, after one warm-up call."""
    fn()
    times, total = [], 0.0
    while len(times) < repeats or total < min_time:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        total += times[-1]
        if len(times) >= 1000:
            break
    return statistics.median(times)


def copy_bandwidth(nbytes=256 * 2 ** 20, repeats=10):
    """Bytes per second of np.copyto on a buffer far larger than the caches (a read and a write per byte):
    the probe every GB/s figure is compared with."""
    a = np.ones(nbytes // 8)
    b = np.empty_like(a)
    t = time_call(lambda: np.copyto(b, a), repeats=repeats)
    return 2 * a.nbytes / t


def _pair_calls(op, forward, backward, xd, kw):
    """(forward + backward, forward alone) zero-argument callables; the upstream gradient made once, outside."""
    f_or = getattr(oracle, f"{op}_forward")
    fwd = forward or f_or
    args = lambda: _args(f_or, {**xd, **_fresh(kw)})  # noqa: E731
    out, _ = fwd(*args())
    dout = _dout(np.shape(out), np.asarray(convert_tree(out, "numpy")).dtype, 0)

    def both():
        _, cache = fwd(*args())
        if backward is not None:
            backward(dout, cache)
    return both, (lambda: fwd(*args()))


def _torch_calls(spec, xd, kw, backward=True):
    import torch
    t = {k: torch.from_numpy(np.ascontiguousarray(v)).requires_grad_() for k, v in xd.items()}
    out = spec.torch(torch, t, kw)
    d = torch.randn(out.shape, dtype=out.dtype) if out.dim() else torch.tensor(DLOSS, dtype=out.dtype)

    def both():
        o = spec.torch(torch, t, kw)
        if backward:
            torch.autograd.grad(o, list(t.values()), d, allow_unused=True)

    def fwd():
        with torch.no_grad():
            spec.torch(torch, t, kw)
    return both, fwd


def nbytes(xd, out, grads, dout):
    """Napkin bytes of forward + backward: every input read once, the output written once, the upstream gradient
    read once and every gradient written once (what no implementation can avoid moving)."""
    size = lambda a: int(np.asarray(a).nbytes)  # noqa: E731
    return sum(map(size, xd.values())) + size(out) + size(dout) + sum(map(size, grads))


@dataclass
class BenchReport:
    op: str
    dtype: str
    copy_bandwidth_Bps: float
    entries: list                # per shape: params, nbytes, validation, rows [{impl, fwd_bwd_s, fwd_s, GBps, ...}]
    repeats: int
    rounds: int

    def to_json(self):
        return _dumps(self.__dict__)

    def to_markdown(self):
        L = [f"# {self.op}: yours against the NumPy oracle and PyTorch ({self.dtype})", "",
             f"Copy bandwidth (np.copyto, read + write) measured in this run: {self.copy_bandwidth_Bps / 1e9:.2f} "
             f"GB/s. Forward + backward and forward alone, median over {self.rounds} alternating rounds of the "
             f"median of >= {self.repeats} calls after a warm-up call; GB/s from the bytes every input, output, "
             f"upstream gradient and gradient must move once.", ""]
        for e in self.entries:
            L += [f"## {e['params']}", "", f"validation: {e['validation']}", "",
                  "| impl | fwd+bwd ms | fwd ms | GB/s | % of copy | x numpy | x pytorch |", "|---|---|---|---|---|---|---|"]
            for r in e["rows"]:
                L.append(f"| {r['impl']} | {r['fwd_bwd_s'] * 1e3:.3f} | {r['fwd_s'] * 1e3:.3f} | {r['GBps']:.2f} | "
                         f"{r['pct_copy']:.1f} | {r['x_numpy']:.2f} | " + (f"{r['x_pytorch']:.2f}" if r["x_pytorch"]
                                                                            else "-") + " |")
            L.append("")
        return "\n".join(L)

    def save(self, folder, name=None):
        """Write <name>.md, <name>.json and (with matplotlib) <name>.png into folder. -> the paths written"""
        from .fileio import write_text
        os.makedirs(folder, exist_ok=True)
        name = name or self.op
        paths = [os.path.join(folder, f"{name}.md"), os.path.join(folder, f"{name}.json")]
        write_text(paths[0], self.to_markdown() + "\n")
        write_text(paths[1], self.to_json())
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return paths
        fig, ax = plt.subplots(figsize=(6, 0.6 + 0.5 * sum(len(e["rows"]) for e in self.entries)))
        labels, vals = [], []
        for e in self.entries:
            for r in e["rows"]:
                labels.append(f"{r['impl']} {e['params']}"[:60])
                vals.append(r["fwd_bwd_s"] * 1e3)
        ax.barh(labels[::-1], vals[::-1])
        ax.set_xlabel("forward + backward, ms (median)")
        ax.set_title(f"{self.op} ({self.dtype})")
        paths.append(os.path.join(folder, f"{name}.png"))
        fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
        plt.close(fig)
        return paths


def bench_op(op, forward=None, backward=None, *, shapes=None, dtype="float32", repeats=10, rounds=3, min_time=0.2,
             bandwidth=None):
    """Time your pair against the NumPy oracle and the PyTorch peer on the same inputs, after validating it there.

    shapes: a list of the op's params dicts (default: the op's bench shape, BERT-base sizes). -> BenchReport
    (to_markdown, to_json, save(folder): .md, .json, .png). A shape where your pair fails the check is not timed."""
    spec = _spec(op)
    dtype = np.dtype(dtype)
    lib = lambda fn: None if fn is None else adapt(fn, getattr(fn, "array_library", None))  # noqa: E731
    fwd, bwd = lib(forward), lib(backward)
    bw = bandwidth or copy_bandwidth(repeats=3)
    entries = []
    for params in shapes or [spec.bench]:
        case = Case("bench", dict(params), seed=0)
        check = run_case(spec, case, fwd, bwd, dtype)
        bad = [t for t in check.tensors if not t.ok]
        validation = "pass" if not bad else "FAIL: " + "; ".join(f"{t.tensor}: {t.note or _u(t.ulps) + ' ulps'}"
                                                                 for t in bad)
        xd, kw = build(spec, case, dtype)
        out, g, dout = run_oracle(op, xd, kw, 0)
        moved = nbytes(xd, out, g.values() if backward is not None else [], dout if backward is not None else ())
        calls = {"numpy oracle": _pair_calls(op, None, getattr(oracle, f"{op}_backward") if backward else None,
                                             xd, kw)}
        try:
            calls["pytorch"] = _torch_calls(spec, xd, kw, backward is not None)
        except Exception:                             # no torch
            pass
        if not bad:
            calls["yours"] = _pair_calls(op, fwd, bwd, xd, kw)
        samples = {k: ([], []) for k in calls}
        for _ in range(rounds):
            for k, (both, f) in calls.items():
                samples[k][0].append(time_call(both, repeats, min_time))
                samples[k][1].append(time_call(f, repeats, min_time))
        t = {k: statistics.median(s[0]) for k, s in samples.items()}
        rows = [dict(impl=k, fwd_bwd_s=t[k], fwd_s=statistics.median(samples[k][1]), GBps=moved / t[k] / 1e9,
                     pct_copy=100 * moved / t[k] / bw, x_numpy=t["numpy oracle"] / t[k],
                     x_pytorch=t["pytorch"] / t[k] if "pytorch" in t else None) for k in calls]
        entries.append(dict(params=params, nbytes=moved, validation=validation, rows=rows))
    return BenchReport(op, dtype.name, bw, entries, repeats, rounds)


# ----------------------------------------------------------------------------------------------------------------
# a module of ops: refbert check --ops PATH [--model]

def module_ops(module):
    """{op: (forward or None, backward or None)} for every op of refbert.ops the module defines (a function that is
    the oracle's own is not counted)."""
    found = {}
    for op in OPS:
        f, b = (getattr(module, f"{op}_{h}", None) for h in ("forward", "backward"))
        f = f if callable(f) and f is not getattr(oracle, f"{op}_forward") else None
        b = b if callable(b) and b is not getattr(oracle, f"{op}_backward") else None
        if f or b:
            found[op] = (f, b)
    return found


def check_module(spec, dtypes=("float32", "float64"), examples=EXAMPLES, log=None):
    """check_op on every op the module (object, .py path or importable name) defines, for each dtype.
    -> (module, [OpReport]). A module that cannot be loaded or defines no op is a ValueError."""
    module = load_module(spec, "check --ops", names=True)
    found = module_ops(module)
    if not found:
        raise ValueError(f"check --ops: '{spec}' defines no op: expected functions named <op>_forward / "
                         f"<op>_backward for ops of refbert.ops ({', '.join(OPS)})")
    library = getattr(module, "ARRAY_LIBRARY", None)
    reports = []
    for op, (f, b) in found.items():
        for dt in dtypes:
            if log:
                log(f"{op} {dt}")
            wrap = lambda fn: None if fn is None else declare(fn, library)  # noqa: E731
            reports.append(check_op(op, wrap(f), wrap(b), dtype=dt, examples=examples))
    return module, reports


def declare(fn, library):
    """fn with the module's ARRAY_LIBRARY as its own array_library (unless it declares one)."""
    if library is None or hasattr(fn, "array_library"):
        return fn
    wrapped = adapt(fn, library, force=True)
    return wrapped


# the whole model on a module's ops: two heads, a tiny and an uneven config, dropout on, both dtypes

MODEL_HEADS = ("BertForPreTraining", "BertForSequenceClassification")


def model_configs():
    """tiny: as refbert check's (2 layers, 3 heads of 4, vocabulary 23, HF's erf GELU); uneven: 5 heads of 3
    (C = 15), intermediate 17, vocabulary 29, the tanh GELU ("gelu_new")."""
    from .config import BertConfig
    return {"tiny": BertConfig(vocab_size=23, hidden_size=12, num_hidden_layers=2, num_attention_heads=3,
                               intermediate_size=20, max_position_embeddings=16, type_vocab_size=2, num_labels=3),
            "uneven": BertConfig(vocab_size=29, hidden_size=15, num_hidden_layers=2, num_attention_heads=5,
                                 intermediate_size=17, max_position_embeddings=16, type_vocab_size=2, num_labels=3,
                                 hidden_act="gelu_new")}


def _model_dump(head, config, backend, dtype, params, batch):
    """verify.reference of `head` on `backend` with these parameter values (cast to dtype), train mode, dropout
    drawn from DropoutRNG(1234): {key: NumPy array}."""
    from . import model as M
    from .verify import reference
    m = getattr(M, head)(config, seed=0, dtype=dtype, backend=backend).train()
    for k, p in m.parameters().items():
        p[...] = params[k].astype(dtype)
    m.dropout_rng = DropoutRNG(1234)
    return {k: np.asarray(convert_tree(v, "numpy")) for k, v in reference(m, batch, {}).items()}


def check_model_ops(spec, dtypes=("float32", "float64"), heads=MODEL_HEADS, configs=None, seed=0):
    """The whole model on a module's ops (the rest the oracle's, composed ops from its basic ones): every output,
    hidden state and parameter gradient against the float64 oracle with the same weights, batch and dropout masks,
    each tensor judged as check_op judges one (ulps at the tensor's scale; tolerance from refbert's own float32
    noise on that tensor, 3 runs). -> (the Backend, runs: [dict(head, config, dtype, rows (verify's row dicts),
    first_failure (verify.locate), ok, error)])"""
    from . import model as M
    from .backends import Backend
    from .verify import default_batch, locate
    module = load_module(spec, "check --model", names=True)
    backend = Backend(module)
    runs = []
    for cname, cfg in (configs or model_configs()).items():
        for head in heads:
            base = getattr(M, head)(cfg, seed=seed, dtype=np.float64)
            r = np.random.default_rng(seed + 1)
            params = {k: p + r.standard_normal(p.shape) * 0.05 for k, p in base.parameters().items()}
            batch, _ = default_batch(cfg, head, B=3, T=7, seed=seed)
            yard = _model_noise(head, cfg, params, batch)
            for dt in dtypes:
                dt = np.dtype(dt)
                vals = {k: v.astype(dt).astype(np.float64) for k, v in params.items()}
                truth = _model_dump(head, cfg, "numpy", np.float64, vals, batch)
                try:
                    got = _model_dump(head, cfg, backend, dt, vals, batch)
                    error = None
                except Exception as e:
                    got, error = {}, f"raised {type(e).__name__}: {_short(e)}"
                rows = []
                for k, ref in truth.items():
                    x = got.get(k)
                    tol = tolerance(yard.get(k))
                    row = dict(key=k, dtype=dt.name, shape=list(ref.shape), error=None,
                               tolerance=tol * EPS[dt.name], ok=False, note="")
                    if x is None:
                        row["note"] = error or "missing"
                    elif x.shape != ref.shape:
                        row["note"] = f"shape {list(x.shape)}"
                    else:
                        u = ulps(x, ref, dt, _model_sibling(k, truth))
                        row.update(error=u * EPS[dt.name], ok=bool(math.isfinite(u) and u <= tol),
                                   note="" if math.isfinite(u) else "not finite")
                    rows.append(row)
                runs.append(dict(head=head, config=cname, dtype=dt.name, rows=rows, error=error,
                                 first_failure=locate(rows, cfg.num_hidden_layers),
                                 ok=all(x["ok"] for x in rows)))
    return backend, runs


def _model_noise(head, cfg, params, batch):
    """{key: ulps}: refbert's own float32 model against float64 on the same values, the largest over the weights
    as given and twice moved by a random +-1 ulp, and how far the float64 model moves under those moves."""
    worst, exact = {}, None
    for s in range(SAMPLES):
        v32 = {k: v.astype(np.float32) for k, v in params.items()}
        if s:
            r = np.random.default_rng(2000 + s)
            v32 = {k: np.where(r.random(v.shape) < 0.5, np.nextafter(v, np.float32(np.inf)),
                               np.nextafter(v, np.float32(-np.inf))).astype(np.float32) for k, v in v32.items()}
        vals = {k: v.astype(np.float64) for k, v in v32.items()}
        a = _model_dump(head, cfg, "numpy", np.float32, vals, batch)
        b = _model_dump(head, cfg, "numpy", np.float64, vals, batch)
        for k in b:
            worst[k] = max(worst.get(k, 0.0), ulps(a[k], b[k], np.float32, _model_sibling(k, b)))
            if exact is not None:                       # the weights' conditioning, as noise() for one op
                worst[k] = max(worst[k], ulps(b[k], exact[k], np.float32, _model_sibling(k, exact)))
        exact = exact or b
    return worst


def _model_sibling(key, dump):
    """The largest tensor of the key's kind (gradients; the forward's values): what a tensor that is 0 in exact
    arithmetic (the key bias's gradient) is judged on."""
    kind = key.startswith("grad/")
    return max(_scale(np.asarray(v, np.float64)) for k, v in dump.items() if k.startswith("grad/") == kind)
