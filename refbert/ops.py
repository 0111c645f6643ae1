"""The oracle: every op of BERT as a pair of plain NumPy functions, forward above backward.

    <op>_forward(...)       -> (out, cache)
    <op>_backward(dout, cache) -> the gradients of the forward's differentiable inputs, in the forward's order
                                  (one array when there is one such input, else a tuple)

Each op's math (the forward, then the backward's formulas and the step that derives them) is in its forward's
docstring; a backward's own docstring points there. The cache is a tuple unpacked on the backward's first line
(a NamedTuple where its fields are worth naming: SoftmaxCache, DropoutCache, AttentionCache; a composed op's holds
its parts' caches). Backwards return
fresh arrays and never write into their arguments (two exceptions: linear_backward's dx_into, an array its caller
gives up, as the model does with a gradient it got from another backward; and residual_layernorm_backward, whose
dx and da are one array returned twice, since d(x + a)/dx = d(x + a)/da). float32 and float64 both work and the
output keeps the input's dtype.
Shapes: B batch, T sequence, C channels (hidden), H heads, hs = C // H head size, I intermediate (feed-forward)
size, V classes/vocabulary, N rows (the leading dims flattened) or elements, as each op says.
Every backward is proven against centred finite differences by `refbert check` and tests/test_ops.py; the
derivations are collected in docs/backprop.md. The fused ops and the attention core are written once, in `compose(o)`,
over the basic ops of any namespace `o`: refbert.ops composes its own, a backend module its (refbert.backends).
The last section is the spec of mixed precision (precision="bf16-mixed" / "fp16-mixed"): where every rounding to
bfloat16 or float16 happens, the roundings themselves, and FlashAttention-2's attention arithmetic (refbert.mixed
runs it around any backend's ops).

References: Devlin et al. 2019, "BERT" (arXiv:1810.04805); Vaswani et al. 2017, "Attention is all you need";
Hendrycks & Gimpel 2016, "GELU"; Ba et al. 2016, "Layer normalization"; Micikevicius et al. 2018, "Mixed
precision training"; Dao 2023, "FlashAttention-2"; Hugging Face transformers
`models/bert/modeling_bert.py`, whose semantics (weight layout, eps, masks, ignore_index) these ops follow.
"""
import math
import sys
from typing import NamedTuple

import numpy as np
from .special import expit, ndtr  # NumPy-only normal CDF (<= 2 ulp) and stable sigmoid; README "Dependencies"

from . import validate as V
from .philox import DropoutRNG, keep_mask


# ----------------------------------------------------------------------------------------------------------------
# linear: out = x @ w.T + b   (HF / torch.nn.Linear layout: w is (C_out, C_in))

def linear_forward(x, w, b=None):
    """Affine map over the last axis, any leading dims.

    x: (..., C_in)   w: (C_out, C_in)   b: (C_out,) or None   ->   out: (..., C_out)
    Backward, with x2 = x flattened to (N, C_in) and dout2 to (N, C_out):
        dx = dout @ w                 (each out[n, o] = sum_i x[n, i] w[o, i] + b[o])
        dw = dout2.T @ x2             (sum over every leading position n)
        db = dout2.sum(0)
    """
    V.required("linear", x=x, w=w)
    V.floats("linear", x=x, w=w, b=b)
    V.min_ndim("linear", "x", x, 1, "(..., C_in)")
    V.shape("linear", "w", w, (None, x.shape[-1]), "(C_out, C_in)")
    if b is not None:
        V.shape("linear", "b", b, (w.shape[0],), "(C_out,)")
    out = x.reshape(-1, x.shape[-1]) @ w.T            # (N, C_out): one GEMM over all leading positions
    if b is not None:
        out += b
    out = out.reshape(*x.shape[:-1], w.shape[0])      # (..., C_out)
    return out, (x, w, b is not None)


def linear_backward(dout, cache, dx_into=None):
    """dx, dw[, db] as linear_forward's docstring derives them.

    dx_into (optional, x's shape and dtype): an array the caller gives up; dx is returned as dx_into + dout @ w,
    summed into its memory (into a new array where it is read-only). The model passes the gradient a tensor already
    has from its other paths (the skip beside q, k and v; the residual beside the feed-forward), so that a backend
    can sum in the GEMM (cuBLAS's beta = 1) instead of an add kernel: the same single rounding of the same two
    terms. A backend's linear_backward that takes it says so with the attribute `dx_into = True` (this one does);
    for any other the model adds the paths itself."""
    x, w, has_b = _cache("linear", cache, 3)
    V.dout("linear", dout, (*x.shape[:-1], w.shape[0]), x.dtype)
    if dx_into is not None:
        V.dout("linear", dx_into, x.shape, x.dtype, name="dx_into", what="x's, the input")
    dout2 = dout.reshape(-1, w.shape[0])              # (N, C_out)
    x2 = x.reshape(-1, x.shape[-1])                   # (N, C_in)
    rows = np.flatnonzero(dout2.any(1))               # positions a loss ignores (MLM: ~85%) send exact zeros;
    if rows.size < 0.5 * len(dout2):                  # skipping them leaves the same sums, minus zero terms (for
                                                      # finite x and w: 0 * inf would be NaN; up to BLAS's order)
        dx2 = np.zeros(x2.shape, x.dtype)
        dx2[rows] = dout2[rows] @ w
        dout2, x2 = dout2[rows], x2[rows]             # (n, C_out), (n, C_in)
    else:
        dx2 = dout2 @ w                               # (N, C_in)
    dx = dx2.reshape(x.shape)                         # (..., C_in)
    dw = dout2.T @ x2                                 # (C_out, C_in)
    db = dout2.sum(0) if has_b else None              # (C_out,)   (both before dx_into changes: it may be dout)
    if dx_into is not None and dx_into.flags.writeable:
        dx_into += dx                                 # the other paths' gradient, plus this one's
        dx = dx_into
    elif dx_into is not None:                         # (a read-only array: the same sum, in a new one)
        dx = dx_into + dx
    return (dx, dw) if not has_b else (dx, dw, db)


linear_backward.dx_into = True


# ----------------------------------------------------------------------------------------------------------------
# embedding: out = w[ids]

def embedding_forward(ids, w, padding_idx=None):
    """Row lookup, as torch.nn.Embedding(V, C, padding_idx=...) with padding_idx a row in [0, V) (torch also takes
    -V <= padding_idx < 0 for V + padding_idx; HF BERT passes pad_token_id, never negative: refused here).

    ids: (...) integers in [0, V)   w: (V, C)   ->   out: (..., C)
    Backward (ids are not differentiable): out[n] = w[ids[n]], so row v of dw collects every dout[n] whose id is
    v — a scatter-add, so a repeated id sums its gradients:
        dw[v] = sum_{n : ids[n] = v} dout[n]
        dw[padding_idx] = 0           (torch never updates the padding row; HF BERT uses pad_token_id here)
    """
    V.required("embedding", w=w)
    V.floats("embedding", w=w)
    V.shape("embedding", "w", w, (None, None), "(V, C)")
    V.ids("embedding", "ids", ids, w.shape[0])
    padding_idx = V.padding_row("embedding", padding_idx, w.shape[0])
    return w[ids], (ids, w.shape, w.dtype, padding_idx)


def embedding_backward(dout, cache):
    """dw (ids are not differentiable), as embedding_forward's docstring derives it."""
    ids, w_shape, dtype, padding_idx = _cache("embedding", cache, 4)
    V.dout("embedding", dout, (*ids.shape, w_shape[1]), dtype)
    dw = np.zeros(w_shape, dtype)
    np.add.at(dw, ids.reshape(-1), dout.reshape(-1, w_shape[1]))  # unbuffered: repeated ids accumulate
    if padding_idx is not None:
        dw[padding_idx] = 0
    return dw


# ----------------------------------------------------------------------------------------------------------------
# layernorm over the last axis: out = (x - mean) * rstd * w + b

def layernorm_forward(x, w, b, eps=1e-12):
    """LayerNorm over the last axis (eps 1e-12 as HF BERT's layer_norm_eps).

    x: (..., C)   w, b: (C,)   ->   out: (..., C)
    Forward: mean = x.mean(-1), rstd = 1/sqrt(var + eps) (biased var), xhat = (x - mean) * rstd, out = xhat*w + b.
    Backward, with wdy = dout * w (the gradient reaching xhat):
        db = sum over leading dims of dout
        dw = sum over leading dims of dout * xhat
        dx = (wdy - (xhat * c1 + c2)) * rstd,  c1 = mean(wdy * xhat, -1),  c2 = mean(wdy, -1)
    The step (one row, C entries): d mean / d x_j = 1/C; var = mean((x - mean)^2) gives d var / d x_j =
    (2/C) sum_k (x_k - mean) (delta_kj - 1/C) = 2 (x_j - mean) / C (as sum_k (x_k - mean) = 0), so with
    rstd = (var + eps)^(-1/2), d rstd / d x_j = -rstd^3 (x_j - mean) / C = -rstd^2 xhat_j / C; the product rule
    on xhat_i = (x_i - mean) rstd gives d xhat_i / d x_j = rstd (delta_ij - 1/C) + (x_i - mean) d rstd / d x_j, so
        d xhat_i / d x_j = rstd (delta_ij - 1/C - xhat_i xhat_j / C)
    and dx_j = sum_i wdy_i d xhat_i / d x_j = rstd (wdy_j - mean(wdy) - xhat_j mean(wdy * xhat)): the line above
    (c2 removes the part of wdy that moves the mean, c1 the part that moves the variance; eps enters through rstd
    alone, so the formula is exact with it).
    """
    V.required("layernorm", x=x, w=w, b=b)
    V.floats("layernorm", x=x, w=w, b=b)
    V.min_ndim("layernorm", "x", x, 1, "(..., C)")
    V.shape("layernorm", "w", w, (x.shape[-1],), "(C,)")
    V.shape("layernorm", "b", b, (x.shape[-1],), "(C,)")
    eps = V.layernorm_eps("layernorm", x, eps)
    mean = x.mean(-1, keepdims=True)                  # (..., 1)
    xc = x - mean
    var = (xc * xc).mean(-1, keepdims=True)           # (..., 1) biased, as torch
    rstd = 1 / np.sqrt(var + eps)                     # (..., 1); a constant row gives xhat = 0, finite
    out = xc * rstd * w + b
    return out, (x, w, mean, rstd)


def layernorm_backward(dout, cache):
    """(dx, dw, db), as layernorm_forward's docstring derives them."""
    x, w, mean, rstd = _cache("layernorm", cache, 4)
    V.dout("layernorm", dout, x.shape, x.dtype)
    xhat = (x - mean) * rstd                          # recompute rather than cache: one (..., C) array less
    lead = tuple(range(x.ndim - 1))
    db = dout.sum(lead)
    dw = (dout * xhat).sum(lead)
    wdy = dout * w
    c1 = (wdy * xhat).mean(-1, keepdims=True)
    c2 = wdy.mean(-1, keepdims=True)
    dx = (wdy - (xhat * c1 + c2)) * rstd
    return dx, dw, db


# ----------------------------------------------------------------------------------------------------------------
# softmax over the last axis, with the score scale and the additive attention mask fused in

def softmax_forward(x, scale=1.0, mask=None):
    """p = softmax(x * scale + mask) over the last axis.

    x: (..., T)   mask: additive, float, broadcastable to x (HF: 0 for real tokens, a large negative or -inf
    for padding; e.g. (B, 1, 1, T) against scores (B, H, T, T))   ->   p: same shape as x
    Backward (mask is a constant), with z = x * scale + mask:
        dz = p * (dout - sum(dout * p, -1))       (Jacobian of softmax: diag(p) - p p^T)
        dx = scale * dz
    The step: d p_i / d z_j = p_i (delta_ij - p_j), so dz_j = sum_i dout_i p_i (delta_ij - p_j)
    = p_j (dout_j - sum_i dout_i p_i), the line above; and d z / d x = scale.
    The max is subtracted before exp (softmax is shift-invariant), so logits of 1e4 do not overflow.
    """
    V.required("softmax", x=x)
    V.floats("softmax", x=x, mask=mask)
    V.min_ndim("softmax", "x", x, 1, "(..., T)")
    if x.shape[-1] == 0:
        raise ValueError(f"softmax: argument 'x' expected at least one entry on the last axis (T >= 1) to normalise "
                         f"over, got shape {x.shape}")
    scale = V.number("softmax", "scale", scale)       # a Python float: an np.float64 would make float32 x float64
    z = x * scale if scale != 1.0 else x
    if mask is not None:
        V.broadcasts_to("softmax", "mask", mask, x.shape)
        z = z + mask
    m = z.max(-1, keepdims=True)
    if not np.isfinite(m).all():
        raise ValueError("softmax: argument 'x' (with 'mask') expected every row to have a finite maximum, got a row "
                         "that is entirely -inf, or a NaN/+inf score")
    e = np.exp(z - m)
    p = e / e.sum(-1, keepdims=True)
    return p, SoftmaxCache(p, scale)


class SoftmaxCache(NamedTuple):
    p: np.ndarray          # the probabilities (..., T)
    scale: float


def softmax_backward(dout, cache):
    """dx, as softmax_forward's docstring derives it."""
    p, scale = _cache("softmax", cache, 2)
    V.dout("softmax", dout, p.shape, p.dtype)
    dz = p * (dout - (dout * p).sum(-1, keepdims=True))
    return dz * scale if scale != 1.0 else dz


# ----------------------------------------------------------------------------------------------------------------
# GELU: exact (HF "gelu") and tanh approximation (HF "gelu_new")

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_TANH_L = 1e4     # tanh form: past |x| = 1e4, s = sigmoid(2u) is exactly 1 or 0 in both dtypes (|2u| > 7e10) and the
                  # derivative's x s (1 - s) (1 + 3 * 0.044715 x^2) exactly 0; x clamped to [-1e4, 1e4] for s and
                  # that term gives the same s and the limits 1 and 0, where x^3 or x^2 would overflow to inf
                  # (inf * 0 = NaN) from |x| ~ 1e13 in float32


def gelu_forward(x, approximate="none"):
    """GELU(x) = x * Phi(x); approximate="none" is exact (HF "gelu"), "tanh" is HF "gelu_new" (torch's names).

    x: (...)   ->   out: (...)
    exact:  Phi(x) = (1 + erf(x / sqrt 2)) / 2, the normal CDF (refbert.special.ndtr, via erfc for x < 0,
            so the left tail keeps its relative accuracy where 1 + erf would cancel to 0),
            phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
            dx = dout * (Phi(x) + x * phi(x))     (the product rule on x Phi(x); Phi' = phi)
            The backward reads Phi(x) back as out / x from the cached output instead of a second ndtr (the
            slowest function here), with Phi(x) = 1/2 + x phi(0) + O(x^3) for |x| < 1e-6 (out / x is 0 / 0 at
            x = 0, and loses digits for subnormal x).
    tanh:   u = sqrt(2/pi) * (x + 0.044715 x^3),  t = tanh(u),  out = x * (1 + t) / 2
            dx = dout * ((1 + t) / 2 + x/2 * (1 - t^2) * sqrt(2/pi) * (1 + 3 * 0.044715 x^2))
            computed through s = (1 + t) / 2 = sigmoid(2u), so 1 - t^2 = 4 s (1 - s): the same numbers, without
            1 + t cancelling to 0 in the left tail. s is taken at x clamped to [-1e4, 1e4] (_TANH_L: the same s,
            saturated, without x^3 overflowing; beyond, dx = dout for x > 1e4 and 0 for x < -1e4).
    """
    V.required("gelu", x=x)
    V.floats("gelu", x=x)
    if approximate == "none":
        out = x * ndtr(x)
    elif approximate == "tanh":
        xc = np.clip(x, -_TANH_L, _TANH_L)
        out = x * expit(2 * _SQRT_2_OVER_PI * (xc + 0.044715 * xc ** 3))  # x * (1 + tanh(u)) / 2
    else:
        raise ValueError(f"gelu: argument 'approximate' expected 'none' or 'tanh', got {approximate!r}")
    return out, (x, out, approximate)


def gelu_backward(dout, cache):
    """dx, as gelu_forward's docstring derives it (exact or tanh, as the forward ran)."""
    x, out, approximate = _cache("gelu", cache, 3)
    V.dout("gelu", dout, x.shape, x.dtype)
    if approximate == "none":
        pdf = np.exp(-0.5 * x * x) * (1 / math.sqrt(2 * math.pi))
        small = np.abs(x) < 1e-6
        cdf = np.divide(out, x, out=0.5 + x * (1 / math.sqrt(2 * math.pi)), where=~small)  # Phi(x) = out / x
        return dout * (cdf + x * pdf)
    xc = np.clip(x, -_TANH_L, _TANH_L)                          # (the same s; see _TANH_L)
    s = expit(2 * _SQRT_2_OVER_PI * (xc + 0.044715 * xc ** 3))  # (1 + t) / 2
    du_dx = _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * xc * xc)
    return dout * (s + 2 * xc * s * (1 - s) * du_dx)            # (1+t)/2 + x/2 * (1-t^2) * du/dx


# ----------------------------------------------------------------------------------------------------------------
# tanh (the pooler's activation)

def tanh_forward(x):
    """out = tanh(x).   x: (...)   Backward: d tanh/dx = 1 - tanh^2, so dx = dout * (1 - out^2)."""
    V.required("tanh", x=x)
    V.floats("tanh", x=x)
    out = np.tanh(x)
    return out, (out,)


def tanh_backward(dout, cache):
    """dx, as tanh_forward's docstring derives it."""
    (out,) = _cache("tanh", cache, 1)
    V.dout("tanh", dout, out.shape, out.dtype)
    return dout * (1 - out * out)


# ----------------------------------------------------------------------------------------------------------------
# dropout, inverted: kept units are scaled by 1/(1-p) in training so that eval is the identity

def dropout_forward(x, p, rng=None, train=True):
    """Inverted dropout with a counter-based keep-mask (refbert.philox), the same on every backend.

    x: (...)   p: drop probability in [0, 1]   rng: refbert.philox.DropoutRNG (needed when train and p > 0)
    (seed, stream) = rng.next_stream();  keep = refbert.philox.keep_mask(seed, stream, x.shape, p), i.e.
    keep[i] = random_words(seed, stream, n)[i] >= threshold(p) = round(p * 2^32)  (i: C-order index, an integer
    comparison, so float32, float64 and every kernel keep the same units);
    out = x * keep / (1 - p)   (p = 1: out = 0, the scale taken as 0 rather than 0 * inf)
    Backward: the op is linear and diagonal, so dx = dout * keep / (1 - p) (p = 1: dx = 0). Eval or p = 0:
    out = x, dx = dout, and no stream is drawn.
    """
    V.required("dropout", x=x)
    V.floats("dropout", x=x)
    p = V.probability("dropout", "p", p)
    if not train or p == 0.0:
        return x, DropoutCache(None, 1.0, x.shape, x.dtype)
    keep = dropout_mask(rng, x.shape, p, "dropout")     # (...) bool: 1 byte per unit in the cache
    scale = 1.0 / (1.0 - p) if p < 1.0 else 0.0
    return _keep_scale(x, keep, scale), DropoutCache(keep, scale, x.shape, x.dtype)


class DropoutCache(NamedTuple):
    keep: np.ndarray       # bool keep-mask, or None when dropout was the identity (eval, p = 0)
    scale: float           # 1 / (1 - p); 0 when p = 1; 1.0 when keep is None
    shape: tuple
    dtype: np.dtype


def dropout_mask(rng, shape, p, op):
    """The keep-mask of the next dropout call of `rng`, shape `shape` (draws one stream)."""
    if not isinstance(rng, DropoutRNG):
        raise ValueError(f"{op}: argument 'rng' expected a refbert.philox.DropoutRNG in training, "
                         f"got {type(rng).__name__}")
    seed, stream = rng.next_stream()
    return keep_mask(seed, stream, shape, p)


def dropout_backward(dout, cache):
    """dx, as dropout_forward's docstring derives it (the forward's keep-mask, not a new draw)."""
    keep, scale, shape, dtype = _cache("dropout", cache, 4)
    V.dout("dropout", dout, shape, dtype)
    return dout.copy() if keep is None else _keep_scale(dout, keep, scale)


def _keep_scale(a, keep, scale):
    out = a * keep                                    # float * bool keeps a's dtype
    out *= a.dtype.type(scale)                        # a Python float would not upcast, a float64 scalar array would
    return out


# ----------------------------------------------------------------------------------------------------------------
# residual add (written out where it helps the reading: gradient flows unchanged into both branches)

def add_forward(a, b):
    """out = a + b with equal shapes (no broadcasting).   Backward: da = dout, db = dout."""
    V.required("add", a=a, b=b)
    V.floats("add", a=a, b=b)
    V.shape("add", "b", b, a.shape, "(same as a)")
    return a + b, (a.shape, a.dtype)


def add_backward(dout, cache):
    """(da, db), as add_forward's docstring derives them."""
    shape, dtype = _cache("add", cache, 2)
    V.dout("add", dout, shape, dtype)
    return dout.copy(), dout.copy()


# ----------------------------------------------------------------------------------------------------------------
# row gather (the labelled positions of an MLM batch)

def gather_rows_forward(x, rows):
    """out = x2[rows] with x2 = x flattened to (N, C): the labelled positions of an MLM batch, before the decoder.

    x: (..., C)   rows: (n,) integer indices into N = prod(x.shape[:-1])   ->   out: (n, C)
    Backward: a scatter-add, dx2 = 0; np.add.at(dx2, rows, dout), i.e. dx2[n] = sum_{j: rows[j] = n} dout[j]
    (rows repeat under mlm_rows' padding, and repeats sum); rows nobody picked get 0.
    Decoding only these rows gives the same loss and gradients as decoding every position and ignoring the
    unlabelled ones, whose logits never reach the loss (cross_entropy with ignore_index).
    """
    V.required("gather_rows", x=x)
    V.floats("gather_rows", x=x)
    V.min_ndim("gather_rows", "x", x, 1, "(..., C)")
    N = int(np.prod(x.shape[:-1]))
    V.ids("gather_rows", "rows", rows, N)
    if rows.ndim != 1:
        raise ValueError(f"gather_rows: argument 'rows' expected a 1-d integer array, got shape {rows.shape}")
    return x.reshape(N, x.shape[-1])[rows], (x.shape, x.dtype, rows)


def gather_rows_backward(dout, cache):
    """dx, as gather_rows_forward's docstring derives it."""
    shape, dtype, rows = _cache("gather_rows", cache, 3)
    V.dout("gather_rows", dout, (rows.size, shape[-1]), dtype)
    dx = np.zeros((int(np.prod(shape[:-1])), shape[-1]), dtype)
    np.add.at(dx, rows, dout)
    return dx.reshape(shape)


# ----------------------------------------------------------------------------------------------------------------
# composed ops: the fused ops (what a kernel computes in one pass) and the attention core, each written once in
# terms of the basic ops of a namespace `o`. refbert.ops binds compose(refbert.ops) below; a backend that defines
# layernorm but not residual_layernorm runs compose(that backend)'s, so its layernorm is what every residual
# LayerNorm of the model runs (refbert.backends).

COMPOSED = {"residual_layernorm": ("layernorm",), "dropout_residual_layernorm": ("dropout", "layernorm"),
            "bias_gelu": ("gelu",), "attention": ("softmax", "dropout")}   # op -> the basic ops it is made of


class AttentionCache(NamedTuple):
    qh: np.ndarray         # (B, H, T, hs) views of q, k, v split into heads
    kh: np.ndarray
    vh: np.ndarray
    p: np.ndarray          # (B, H, T, T) the probabilities before dropout (the softmax's output)
    softmax: tuple         # the softmax's cache (refbert.ops: SoftmaxCache, holding the same p)
    dropout: tuple         # the dropout's cache (refbert.ops: DropoutCache, its keep-mask over (B, H, T, T))


def compose(o):
    """The composed ops over the namespace `o` (a module or object with <op>_forward / <op>_backward of the basic
    ops), each looked up in `o` when called. -> {function name: function}, the names as in refbert.ops."""

    def residual_layernorm_forward(x, a, w, b, eps=1e-12):
        """out = LayerNorm(x + a): the residual sum and the post-LN of a BERT sublayer.

        x, a: (..., C) equal shapes   w, b: (C,)   ->   out: (..., C)
        Forward: s = x + a, out = layernorm(s).   Backward: ds = layernorm_backward(dout); the sum copies ds to both
        inputs, so dx = da = ds (returned as one array twice: a caller that writes into one, e.g. as
        linear_backward's dx_into, must first finish reading the other).
        """
        V.required("residual_layernorm", x=x, a=a)
        V.floats("residual_layernorm", x=x, a=a)
        V.shape("residual_layernorm", "a", a, x.shape, "(same as x)")
        out, ln_cache = o.layernorm_forward(x + a, w, b, eps)
        return out, (ln_cache,)

    def residual_layernorm_backward(dout, cache):
        """(dx, da, dw, db), as residual_layernorm_forward's docstring derives them (dx is da)."""
        (ln_cache,) = _cache("residual_layernorm", cache, 1)
        ds, dw, db = o.layernorm_backward(dout, ln_cache)
        return ds, ds, dw, db

    def dropout_residual_layernorm_forward(x, a, w, b, eps=1e-12, p=0.0, rng=None, train=True):
        """out = LayerNorm(x + dropout(a)): a post-LN encoder sublayer's output (a = the sublayer's projection).

        x, a: (..., C)   w, b: (C,)   p, rng, train: as dropout_forward   ->   out: (..., C)
        Backward: ds = layernorm_backward(dout);  dx = ds;  da = dropout_backward(ds) = ds * keep / (1 - p).
        """
        V.required("dropout_residual_layernorm", x=x, a=a)
        V.floats("dropout_residual_layernorm", x=x, a=a)
        V.shape("dropout_residual_layernorm", "a", a, x.shape, "(same as x)")
        ad, do_cache = o.dropout_forward(a, p, rng, train)
        out, ln_cache = o.layernorm_forward(x + ad, w, b, eps)
        return out, (do_cache, ln_cache)

    def dropout_residual_layernorm_backward(dout, cache):
        """(dx, da, dw, db), as dropout_residual_layernorm_forward's docstring derives them."""
        do_cache, ln_cache = _cache("dropout_residual_layernorm", cache, 2)
        ds, dw, db = o.layernorm_backward(dout, ln_cache)
        return ds, o.dropout_backward(ds, do_cache), dw, db

    def bias_gelu_forward(x, b, approximate="none"):
        """out = gelu(x + b): the feed-forward's first bias and activation (the linear before it runs without bias).

        x: (..., I)   b: (I,)   ->   out: (..., I)
        Backward: du = gelu_backward(dout) at u = x + b;  dx = du;  db = du summed over every leading dim.
        """
        V.required("bias_gelu", x=x, b=b)
        V.floats("bias_gelu", x=x, b=b)
        V.min_ndim("bias_gelu", "x", x, 1, "(..., I)")
        V.shape("bias_gelu", "b", b, (x.shape[-1],), "(I,)")
        out, g_cache = o.gelu_forward(x + b, approximate)
        return out, (g_cache,)

    def bias_gelu_backward(dout, cache):
        """(dx, db), as bias_gelu_forward's docstring derives them."""
        (g_cache,) = _cache("bias_gelu", cache, 1)
        du = o.gelu_backward(dout, g_cache)
        return du, du.reshape(-1, du.shape[-1]).sum(0)

    def attention_forward(q, k, v, n_heads, mask=None, dropout_p=0.0, rng=None, train=True):
        """softmax(q k^T / sqrt(hs) + mask), dropped out, times v, per head; heads split from and merged into C.

        q, k, v: (B, T, C)   n_heads: H with C % H == 0, hs = C // H
        mask: additive, broadcastable to (B, H, T, T) — HF BERT passes (B, 1, 1, T)   ->   out: (B, T, C)
        Forward per head: att = qh @ kh^T (B,H,T,T); p = softmax(att / sqrt(hs) + mask); pd = dropout(p); y = pd @ vh.
        Backward, with dy = dout split into heads (B, H, T, hs), reversing each matmul (y = pd @ vh gives
        dpd = dy @ vh^T and dvh = pd^T @ dy):
            dpd = dy @ vh^T          dvh = pd^T @ dy
            dp  = dropout_backward(dpd) = dpd * keep / (1 - dropout_p)
            datt = softmax_backward(dp) = p * (dp - sum(dp * p, -1)) / sqrt(hs)
            dqh = datt @ kh          dkh = datt^T @ qh
        then merge heads back: (B, H, T, hs) -> (B, T, C).  The cache keeps p (B,H,T,T) and the dropout's cache; the
        backward recomputes pd = dropout(p) as dropout_backward(p): dropout is linear and diagonal, so its backward
        applied to p is the same product p * keep / (1 - dropout_p).
        """
        B, T, C, H, hs = attention_shapes(q, k, v, n_heads, mask)
        qh = q.reshape(B, T, H, hs).transpose(0, 2, 1, 3)  # (B, H, T, hs)
        kh = k.reshape(B, T, H, hs).transpose(0, 2, 1, 3)  # (B, H, T, hs)
        vh = v.reshape(B, T, H, hs).transpose(0, 2, 1, 3)  # (B, H, T, hs)
        if mask is not None:
            V.broadcasts_to("attention", "mask", mask, (B, H, T, T))
        att = qh @ kh.transpose(0, 1, 3, 2)                  # (B, H, T, T)
        p, sm_cache = o.softmax_forward(att, 1.0 / math.sqrt(hs), mask)
        pd, do_cache = o.dropout_forward(p, dropout_p, rng, train)
        y = pd @ vh                                         # (B, H, T, hs)
        out = y.transpose(0, 2, 1, 3).reshape(B, T, C)     # (B, T, C)
        return out, AttentionCache(qh, kh, vh, p, sm_cache, do_cache)

    def attention_backward(dout, cache):
        """(dq, dk, dv), as attention_forward's docstring derives them."""
        qh, kh, vh, p, sm_cache, do_cache = _cache("attention", cache, 6)
        B, H, T, hs = qh.shape
        V.dout("attention", dout, (B, T, H * hs), qh.dtype)
        pd = o.dropout_backward(p, do_cache)                # recompute dropout(p): see the forward's docstring
        dy = dout.reshape(B, T, H, hs).transpose(0, 2, 1, 3)  # (B, H, T, hs)
        dpd = dy @ vh.transpose(0, 1, 3, 2)                 # (B, H, T, T)
        dvh = pd.transpose(0, 1, 3, 2) @ dy                 # (B, H, T, hs)
        datt = o.softmax_backward(o.dropout_backward(dpd, do_cache), sm_cache)  # (B, H, T, T)
        dqh = datt @ kh                                     # (B, H, T, hs)
        dkh = datt.transpose(0, 1, 3, 2) @ qh               # (B, H, T, hs)
        merge = lambda g: g.transpose(0, 2, 1, 3).reshape(B, T, H * hs)  # noqa: E731  (B, H, T, hs) -> (B, T, C)
        return merge(dqh), merge(dkh), merge(dvh)

    def attention_probs(cache):
        """The attention probabilities after dropout, (B, H, T, T), as HF returns under output_attentions."""
        _, _, _, p, _, do_cache = _cache("attention", cache, 6)
        return o.dropout_backward(p, do_cache)              # dropout(p), as in the backward

    return {f.__name__: f for f in (residual_layernorm_forward, residual_layernorm_backward,
                                    dropout_residual_layernorm_forward, dropout_residual_layernorm_backward,
                                    bias_gelu_forward, bias_gelu_backward, attention_forward, attention_backward,
                                    attention_probs)}


_composed = compose(sys.modules[__name__])        # over this module: the oracle's own basic ops
residual_layernorm_forward = _composed["residual_layernorm_forward"]
residual_layernorm_backward = _composed["residual_layernorm_backward"]
dropout_residual_layernorm_forward = _composed["dropout_residual_layernorm_forward"]
dropout_residual_layernorm_backward = _composed["dropout_residual_layernorm_backward"]
bias_gelu_forward = _composed["bias_gelu_forward"]
bias_gelu_backward = _composed["bias_gelu_backward"]
attention_forward = _composed["attention_forward"]
attention_backward = _composed["attention_backward"]
attention_probs = _composed["attention_probs"]


# ----------------------------------------------------------------------------------------------------------------
# losses

def cross_entropy_forward(logits, labels, ignore_index=-100):
    """Mean softmax cross-entropy over the positions whose label is not ignore_index: torch's F.cross_entropy on
    the logits flattened to (N, V) and the labels to (N,), as HF calls it (the classes on the last axis here; torch
    puts them on dim 1 of an input with more than two dims).

    logits: (..., V)   labels: (...) integers in [0, V) or ignore_index   ->   loss: scalar of logits' dtype
    With lse = log sum_j exp(z_j) per row and n = number of kept rows:
        loss = (1/n) * sum_{kept rows} (lse - z[label])
        dz = dloss / n * (softmax(z) - onehot(label)) on kept rows, 0 on ignored rows
    The step, per kept row: d lse / d z_j = exp(z_j) / sum_k exp(z_k) = softmax(z)_j, d z[label] / d z_j =
    [j = label]. Every label ignored: loss = 0 and dz = 0 (torch would return NaN here).
    The cache: zs = z[kept] - m (m the row max), the kept labels yk, their flat row indices kept, and
    s = log sum exp(zs) = lse - m; the backward's softmax is exp(zs - s).
    """
    V.required("cross_entropy", logits=logits)
    V.floats("cross_entropy", logits=logits)
    V.min_ndim("cross_entropy", "logits", logits, 1, "(..., V)")
    if not isinstance(labels, np.ndarray) or labels.shape != logits.shape[:-1]:
        raise ValueError(f"cross_entropy: argument 'labels' expected an integer array of shape {logits.shape[:-1]} "
                         f"(logits.shape[:-1]), got {V._desc(labels)}")
    Vn = logits.shape[-1]
    V.ids("cross_entropy", "labels", labels, Vn, allow=ignore_index)
    z = logits.reshape(-1, Vn)                          # (N, V)
    y = labels.reshape(-1)                              # (N,)
    kept = np.flatnonzero(y != ignore_index)            # (n,) rows that count
    zk, yk = z[kept], y[kept]                           # (n, V), (n,): MLM keeps ~15% of rows, so gather first
    m = zk.max(-1, keepdims=True) if kept.size else np.zeros((0, 1), z.dtype)
    if not np.isfinite(m).all():
        raise ValueError("cross_entropy: argument 'logits' expected finite rows, got a NaN, +inf or all -inf row")
    zs = zk - m                                         # (n, V) shifted logits <= 0, exact for nearby values
    s = np.log(np.exp(zs).sum(-1, keepdims=True))       # (n, 1): lse = m + s
    loss = (s[:, 0] - zs[np.arange(kept.size), yk]).sum() / max(kept.size, 1)  # lse - z[label], no 1e4 cancellation
    return np.asarray(loss, dtype=logits.dtype), (logits.shape, logits.dtype, zs, yk, kept, s)


def cross_entropy_backward(dloss, cache):
    """dlogits (labels are not differentiable), as cross_entropy_forward's docstring derives it."""
    shape, dtype, zs, yk, kept, s = _cache("cross_entropy", cache, 6)
    dloss = _scalar_dout("cross_entropy", dloss, dtype)
    dz = np.zeros((int(np.prod(shape[:-1])), shape[-1]), dtype)  # (N, V); ignored rows stay 0
    g = np.exp(zs - s)                                  # softmax of the kept rows, (n, V)
    g[np.arange(kept.size), yk] -= 1
    dz[kept] = g * (dloss / max(kept.size, 1))
    return dz.reshape(shape)


def bce_with_logits_forward(logits, targets):
    """Mean binary cross-entropy on logits (torch's F.binary_cross_entropy_with_logits; HF's multi-label loss).

    logits, targets: (...) same shape, targets in [0, 1] (float)   ->   loss: scalar of logits' dtype
    With s = sigmoid(z) and N = logits.size (the mean is over every element):
        loss = mean(-(y log s + (1 - y) log(1 - s))) = mean(max(z, 0) - z y + log(1 + exp(-|z|)))
    (the second form never takes the log of 0 nor the exp of a large positive number).
    Backward (targets are labels, not differentiated):  dz = dloss * (s - y) / N, since
    d/dz [max(z, 0) - z y + log(1 + exp(-|z|))] = sigmoid(z) - y (either sign of z).
    N = 0 (empty logits): loss = 0 and dz empty (torch would return NaN).
    """
    V.required("bce_with_logits", logits=logits, targets=targets)
    V.floats("bce_with_logits", logits=logits, targets=targets)
    V.shape("bce_with_logits", "targets", targets, logits.shape, "(same as logits)")
    if targets.size and not ((targets >= 0) & (targets <= 1)).all():
        raise ValueError(f"bce_with_logits: argument 'targets' expected values in [0, 1], got values in "
                         f"[{targets.min()}, {targets.max()}]")
    if not np.isfinite(logits).all():                   # (as cross_entropy: a NaN would make a NaN loss)
        raise ValueError("bce_with_logits: argument 'logits' expected finite values, got a NaN or an infinity")
    e = np.exp(-np.abs(logits))                         # in (0, 1]: no overflow
    loss = (np.maximum(logits, 0) - logits * targets + np.log1p(e)).mean() if logits.size else 0.0
    s = np.where(logits >= 0, 1 / (1 + e), e / (1 + e))  # sigmoid(z), each branch without overflow
    return np.asarray(loss, dtype=logits.dtype), (s, targets)


def bce_with_logits_backward(dloss, cache):
    """dlogits (targets are not differentiated), as bce_with_logits_forward's docstring derives it."""
    s, targets = _cache("bce_with_logits", cache, 2)
    dloss = _scalar_dout("bce_with_logits", dloss, s.dtype)
    return (s - targets) * (dloss / max(s.size, 1))


def mse_forward(pred, target):
    """Mean squared error (torch's F.mse_loss; HF's regression loss when num_labels == 1).

    pred, target: (...) same shape   ->   loss: scalar of pred's dtype;  N = pred.size
        loss = mean((pred - target)^2)
        dpred = dloss * 2 (pred - target) / N,   dtarget = -dpred
    N = 0 (empty pred): loss = 0 and empty gradients (torch would return NaN), as cross_entropy and bce.
    """
    V.required("mse", pred=pred, target=target)
    V.floats("mse", pred=pred, target=target)
    V.shape("mse", "target", target, pred.shape, "(same as pred)")
    diff = pred - target
    return np.asarray((diff * diff).mean() if diff.size else 0.0, dtype=pred.dtype), (diff,)


def mse_backward(dloss, cache):
    """(dpred, dtarget), as mse_forward's docstring derives them."""
    (diff,) = _cache("mse", cache, 1)
    dloss = _scalar_dout("mse", dloss, diff.dtype)
    dpred = diff * (2 * dloss / max(diff.size, 1))
    return dpred, -dpred


def attention_shapes(q, k, v, n_heads, mask=None):
    """attention's argument checks (every backend's, in this order: float arrays, q (B, T, C), k and v as q, n_heads a
    positive divisor of C), the mask's broadcast left to the caller. -> (B, T, C, H, hs)"""
    V.required("attention", q=q, k=k, v=v)
    V.floats("attention", q=q, k=k, v=v, mask=mask)
    V.shape("attention", "q", q, (None, None, None), "(B, T, C)")
    V.shape("attention", "k", k, q.shape, "(B, T, C) as q")
    V.shape("attention", "v", v, q.shape, "(B, T, C) as q")
    B, T, C = q.shape
    if T == 0:
        raise ValueError(f"attention: argument 'q' expected at least one position (T >= 1) to attend to, got shape "
                         f"{q.shape}")
    if C == 0:                                        # (hs = 0: the scale 1 / sqrt(hs) would divide by zero)
        raise ValueError(f"attention: argument 'q' expected at least one channel (C >= 1), got shape {q.shape}")
    if isinstance(n_heads, (bool, np.bool_)) or not isinstance(n_heads, (int, np.integer)) or n_heads < 1 \
            or C % n_heads:
        raise ValueError(f"attention: argument 'n_heads' expected a positive divisor of C = {C}, got {n_heads}")
    return B, T, C, int(n_heads), C // int(n_heads)


def _cache(op, cache, n, forward=None):
    """A backward's cache, checked before it is unpacked: a tuple of n entries, as `forward` (default
    <op>_forward) returns it; anything else is refused by name (not left to a failed unpack)."""
    if not isinstance(cache, tuple) or len(cache) != n:
        got = f"a tuple of {len(cache)}" if isinstance(cache, tuple) else V._desc(cache)
        raise ValueError(f"{op}: argument 'cache' expected the cache {forward or op + '_forward'} returned (a tuple "
                         f"of {n}), got {got}")
    return cache


def _scalar_dout(op, d, dtype):
    """dloss as a scalar of the loss's dtype: a finite real number (a Python or NumPy number, or a 0-d array)."""
    if isinstance(d, np.ndarray) and d.ndim != 0:
        raise ValueError(f"{op}: argument 'dloss' expected a scalar (the loss is a scalar), got shape {d.shape}")
    return dtype.type(V.number(op, "dloss", d, what="a finite real number (the loss is a scalar)"))


# ----------------------------------------------------------------------------------------------------------------
# mixed precision: the spec (refbert.mixed runs it around any backend's ops; README "Mixed precision")
#
# precision="bf16-mixed" | "fp16-mixed" on a model means exactly this, and nothing else:
#
#   1. Masters. The parameters and AdamW's moments are float32. An op reads a parameter rounded to the compute
#      dtype (bfloat16 or float16), the "compute copy": R(w), with R = round_bfloat16 or round_float16.
#   2. Compute-dtype tensors. Every activation an op reads or writes, and every gradient of an activation, is a
#      compute-dtype tensor: here a float32 array whose values lie on the compute dtype's grid (R(t) == t), so the
#      float32 oracle and kernels run it unchanged. An op's floating inputs are rounded on entry (every one but the
#      constants of MIXED_CONSTANTS: the additive attention mask, float32 as HF builds it, and regression targets),
#      its output is rounded once on exit; what happens in between is float32 (step 3).
#   3. Inside an op: float32. linear: x2 @ w^T summed in float32 (products of two 16-bit numbers are exact in
#      float32), the bias added in float32 (a GEMM epilogue), then one rounding: out = R(x2 @ R(w)^T + R(b)).
#      The fused ops keep every intermediate in float32 (layernorm's mean, rstd and x̂; residual_layernorm's x + a;
#      dropout_residual_layernorm's dropout(a) and x + dropout(a): the dropped-out sublayer output is never
#      stored; bias_gelu's u = x + b; softmax's max, exp and sum; the cross-entropy's log-sum-exp) and round only
#      their outputs, once. A standalone dropout (embeddings, classifier) writes R(x * keep / (1 - p)).
#   4. Between ops: float32 sums, rounded where they are read. The model's own arithmetic between ops (the
#      embedding sum word + type + position; a gradient reaching a tensor along several paths: the residual and
#      the feed-forward, the skip and the three projections, the sequence and the pooled [CLS]) adds the
#      compute-dtype terms in float32, left to right as the model writes them, and the next op's entry rounds
#      the sum once: x = R((we + te) + pe), dx = R(((dskip + dx_q) + dx_k) + dx_v) (dx_q: the query
#      projection's dx).
#   5. Losses: float32. The cross-entropy (mse, bce) reads compute-dtype logits and computes its log-sum-exp, the
#      loss and the sum of losses (MLM + NSP) in float32; the loss is not rounded. Its backward takes dloss in
#      float32 (1, or the fp16 loss scale: refbert.optim.GradScaler) and writes dlogits = R(dloss (softmax - onehot)
#      / n): compute dtype, the operand of the decoder's backward GEMMs.
#   6. Gradients. An activation's gradient is written in the compute dtype: R(dout @ R(w)) for linear's dx, R(dx)
#      of every fused op. A parameter's gradient is float32 and never rounded: linear's dw = dout2^T @ x2 and
#      db = sum(dout2), layernorm's dw, db, bias_gelu's db = sum of the float32 du (before du is rounded), the
#      embeddings' scatter-add, all accumulated in float32 from compute-dtype operands; the tied word embedding
#      sums its two float32 shares. AdamW and the gradient clipping run on the float32 masters and gradients.
#   7. Attention is FlashAttention-2's arithmetic (attention_forward_mixed below), one key block per row: scores
#      in float32, never stored; the row max and sum float32, kept for the backward; the probabilities and dS
#      rounded where a tensor core reads them; the output and the gradients of q, k, v rounded once; the additive
#      mask float32.
#   8. Backward caches: an op's backward reads its compute-dtype inputs and the float32 statistics its forward kept
#      (layernorm's mean and rstd, the attention's row max and sum); anything else it recomputes in float32 (so a
#      kernel that recomputes instead of storing agrees up to float32 rounding).
#
# An implementation (a GPU's) that rounds at these places and nowhere else agrees with this spec up to float32
# accumulation order: a compute-dtype value then differs by at most 1 ulp, and only where the float32 value sits
# within float32 noise of a rounding boundary.

def round_bfloat16(x):
    """x (float32) rounded to the nearest bfloat16, ties to even, returned as float32 on the bfloat16 grid.

    bfloat16 is float32's upper 16 bits: 1 sign, 8 exponent, 7 stored mantissa bits (ulp(1) = 2^-7), the same
    exponent range, subnormals included. On the bit pattern u (uint32): add 0x7FFF plus the lowest kept bit
    (u >> 16) & 1, then clear the low 16 bits. A low half above 0x8000 carries into the kept bits (rounds up),
    below it does not; exactly 0x8000 (a tie) carries only when the kept lowest bit is 1 (to even). A carry out of
    the mantissa raises the exponent (1.11..1 -> 10.0), and past the largest finite value gives inf, as rounding
    should. NaN is the one pattern the addition would corrupt (it could carry into inf or the sign): it becomes
    the quiet NaN 0x7FC00000 with its sign, as ml_dtypes' conversion does (tests check every class of pattern
    against ml_dtypes bit for bit; benchmarks/check_rounding.py all 2^32).
    """
    x = _f32("round_bfloat16", x)
    u = x.view(np.uint32)
    r = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) & np.uint32(0xFFFF0000)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        r = np.where(nan, (u & np.uint32(0x80000000)) | np.uint32(0x7FC00000), r)
    return r.view(np.float32)


def round_float16(x):
    """x (float32) rounded to the nearest IEEE half (float16: 5 exponent, 10 stored mantissa bits, ulp(1) = 2^-10,
    largest finite 65504, subnormals down to 2^-24), ties to even, returned as float32 on that grid.

    The same bit trick as round_bfloat16 where the result is a normal half (|x| >= 2^-14): add 0xFFF plus the
    lowest kept bit (u >> 13) & 1, clear the low 13 bits. A rounded magnitude of 2^16 or more is inf: |x| >= 65520,
    the halfway point past 65504, overflows, the overflow fp16 loss scaling watches for. Below 2^-14 the halves are
    evenly spaced by 2^-24: (|x| + 1/2) - 1/2 in float32 (whose spacing at 1/2 is 2^-24) rounds |x| to that grid,
    ties to even, exactly. NaN becomes the quiet NaN with its sign (0x7E00 as a half; NumPy's cast keeps the top
    bits of a NaN's payload instead). Otherwise bit for bit NumPy's own float32 -> float16 cast
    (x.astype(np.float16)), several times faster (tests: Python's half packing; benchmarks/check_rounding.py: torch's
    conversion on all 2^32 patterns).
    """
    x = _f32("round_float16", x)
    u = x.view(np.uint32)
    sign = u & np.uint32(0x80000000)
    r = (u + (np.uint32(0xFFF) + ((u >> np.uint32(13)) & np.uint32(1)))) & np.uint32(0xFFFFE000)
    r = np.where((r & np.uint32(0x7FFFFFFF)) >= np.uint32(0x47800000), sign | np.uint32(0x7F800000), r)
    a = u & np.uint32(0x7FFFFFFF)
    half = np.float32(0.5)
    with np.errstate(invalid="ignore"):                     # (a signalling NaN; replaced below)
        sub = ((a.view(np.float32) + half) - half).view(np.uint32) | sign
    r = np.where(a < np.uint32(0x38800000), sub, r)         # |x| < 2^-14: the subnormal halves (and 0)
    nan = a > np.uint32(0x7F800000)
    if nan.any():
        r[nan] = sign[nan] | np.uint32(0x7FC00000)
    return r.view(np.float32)


ROUND = {"bfloat16": round_bfloat16, "float16": round_float16}   # compute dtype -> R


def _f32(who, x):
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        if isinstance(x, (float, np.floating)) or (isinstance(x, np.ndarray) and x.ndim == 0 and
                                                  x.dtype.kind == "f"):
            return np.asarray(x, np.float32)
        raise ValueError(f"{who}: argument 'x' expected a float32 numpy array (the float32 value to round), "
                         f"got {V._desc(x)}")
    return x


def round_compute(x, compute):
    """R(x): x rounded to the compute dtype ("bfloat16" or "float16"), as float32."""
    if compute not in ROUND:
        raise ValueError(f"round_compute: argument 'compute' expected one of {', '.join(ROUND)}, got {compute!r}")
    return ROUND[compute](x)


# What the generic rule of the spec needs to know about each op (refbert.mixed applies it to any backend):
MIXED_PARAMS = {                 # op -> its inputs that are parameters: read as R(master), their gradient float32
    "linear": ("w", "b"), "embedding": ("w",), "layernorm": ("w", "b"), "residual_layernorm": ("w", "b"),
    "dropout_residual_layernorm": ("w", "b"), "bias_gelu": ("b",)}
MIXED_CONSTANTS = ("mask", "target", "targets")   # float inputs that are not compute-dtype tensors: never rounded
MIXED_LOSSES = ("cross_entropy", "mse", "bce_with_logits")   # loss and dloss in float32 (gradients: compute dtype)
GRADS_OF = {                     # op -> the inputs whose gradients its backward returns, in order
    "linear": ("x", "w", "b"), "embedding": ("w",), "layernorm": ("x", "w", "b"), "softmax": ("x",), "gelu": ("x",),
    "tanh": ("x",), "dropout": ("x",), "add": ("a", "b"), "gather_rows": ("x",), "attention": ("q", "k", "v"),
    "residual_layernorm": ("x", "a", "w", "b"), "dropout_residual_layernorm": ("x", "a", "w", "b"),
    "bias_gelu": ("x", "b"), "cross_entropy": ("logits",), "bce_with_logits": ("logits",), "mse": ("pred", "target")}


class MixedAttentionCache(NamedTuple):
    qh: np.ndarray         # (B, H, T, hs) compute-dtype q, k, v split into heads
    kh: np.ndarray
    vh: np.ndarray
    out: np.ndarray        # (B, H, T, hs) the compute-dtype output (read back for D = rowsum(dO * O))
    m: np.ndarray          # (B, H, T, 1) float32 row max of the scores
    l: np.ndarray          # (B, H, T, 1) float32 sum of exp(s - m)
    keep: np.ndarray       # (B, H, T, T) bool keep-mask, or None (eval, p = 0)
    scale: float           # 1 / sqrt(hs)
    mask: np.ndarray       # the additive float32 mask (or None)
    dropout_p: float       # the p applied: 0 in eval
    compute: str


def attention_forward_mixed(q, k, v, n_heads, mask=None, dropout_p=0.0, rng=None, train=True, compute="bfloat16"):
    """The attention core in mixed precision: FlashAttention-2's forward (Dao 2023, flash_fwd_kernel.h) with one
    key block per query row.

    q, k, v: (B, T, C) float32 on the compute grid (rounded here anyway)   mask: additive float32 (B, 1, 1, T)
    With R the rounding to `compute`, per head, everything float32 but what R writes:
        s   = (q k^T) * scale + mask          scores, never stored (products exact, sums in float32)
        m   = max_j s,  pt = exp(s - m),  l = sum_j pt          l sums the unrounded pt, dropped ones included
        out = R( (sum_j keep_ij R(pt_ij) v_j) * ((1 / l) * rp) )    (the two factors' product first)
                                              rp = float32(1 / (1 - p)), rounded once from double (0 at p = 1)
        m, l                                  kept (float32) for the backward
    R(pt) is the operand of the tensor-core product P V, as FA2 converts P to 16 bits before it; dropout zeroes
    elements of that rounded P and its 1 / (1 - p) joins the final normalisation. The keep-mask is the next
    Philox stream of rng, as ops.attention_forward's dropout draws it (so a mixed and a float32 model drop the
    same units). FA2 walks key blocks with a running max m' <= m and rounds exp(s - m') before rescaling: with
    more than one key block it differs from this by the rounding of the pt it rescales (<= 1 ulp of a term).
    """
    R = ROUND[compute]
    B, T, C, H, hs = attention_shapes(q, k, v, n_heads, mask)
    if q.dtype != np.float32:
        raise ValueError(f"attention: argument 'q' expected float32 (mixed precision), got {q.dtype}")
    if mask is not None:
        V.broadcasts_to("attention", "mask", mask, (B, H, T, T))
    scale = 1.0 / math.sqrt(hs)
    heads = lambda a: R(a).reshape(B, T, H, hs).transpose(0, 2, 1, 3)  # noqa: E731  (B, H, T, hs)
    qh, kh, vh = heads(q), heads(k), heads(v)
    s = _scores(qh, kh, scale, mask)                                  # (B, H, T, T) float32
    m = s.max(-1, keepdims=True)
    if not np.isfinite(m).all():
        raise ValueError("attention: argument 'q' (with 'mask') expected every row to have a finite maximum score, "
                         "got a row that is entirely -inf, or a NaN/+inf score")
    pt = np.exp(s - m)                                                # (B, H, T, T) in (0, 1], max 1 per row
    l = pt.sum(-1, keepdims=True)                                     # (B, H, T, 1) float32
    dropout_p = V.probability("attention", "dropout_p", dropout_p)
    p = float(dropout_p) if train else 0.0                            # eval: no dropout, no 1 / (1 - p)
    keep = dropout_mask(rng, s.shape, p, "attention") if p > 0 else None
    P = R(pt) if keep is None else R(pt) * keep                       # the 16-bit operand of P V
    rp = np.float32(1.0 / (1.0 - p)) if p < 1.0 else np.float32(0.0)
    oh = R((P @ vh) * ((np.float32(1.0) / l) * rp))                   # (B, H, T, hs)
    out = oh.transpose(0, 2, 1, 3).reshape(B, T, C)                   # (B, T, C)
    return out, MixedAttentionCache(qh, kh, vh, oh, m, l, keep, scale, mask, p, compute)


def _scores(qh, kh, scale, mask):
    s = (qh @ kh.transpose(0, 1, 3, 2)) * np.float32(scale)          # (B, H, T, T)
    return s if mask is None else s + mask


def attention_backward_mixed(dout, cache):
    """FlashAttention-2's backward (flash_bwd_kernel.h) on the cache of attention_forward_mixed.

    dout: (B, T, C) compute dtype.  With p the dropout probability, kp = float32(1 - p) and rp = float32(1 / kp)
    (divided in float32, 0 at p = 1: the forward's rp is rounded once from double, and the two can differ by an
    ulp, e.g. at p = 0.15), and everything float32 but what R writes:
        P   = exp(s - m) / l                  recomputed from q, k (s as in the forward) and the kept m, l
        D_i = kp sum_c dO_ic O_ic             from the compute-dtype dO and the stored compute-dtype O
        dP  = dO v^T
        dS' = P * (keep * dP - D)             = (1 - p) dS, dS the gradient of the scores: FA2 rounds this
        dv  = R( (sum_i keep_ij R(P_ij) dO_i) * rp )
        dq  = R( (sum_j R(dS'_ij) k_j) * (float32(scale) * rp) )
        dk  = R( (sum_i R(dS'_ij) q_i) * (float32(scale) * rp) )
    Without dropout (p = 0, keep = 1): dS' = dS = P (dP - rowsum(dO * O)), the softmax's backward, since
    sum_j P_ij dP_ij = dO_i . O_i. FA2 keeps lse = m + log(l) instead of m and l, the same P up to float32
    rounding but on a fully padded row: there m is float32's most negative number (HF's additive mask), which
    absorbs log(l), so exp(s - lse) would give 1 instead of 1 / T; keeping both is exact there too.
    """
    qh, kh, vh, oh, m, l, keep, scale, mask, p, compute = _cache("attention", cache, 11,
                                                                  "attention_forward_mixed")
    R = ROUND[compute]
    B, H, T, hs = qh.shape
    V.dout("attention", dout, (B, T, H * hs), qh.dtype)
    dO = R(dout).reshape(B, T, H, hs).transpose(0, 2, 1, 3)          # (B, H, T, hs)
    P = np.exp(_scores(qh, kh, scale, mask) - m) / l                  # (B, H, T, T)
    kp = np.float32(1.0 - p)
    D = (dO * oh).sum(-1, keepdims=True) * kp                         # (B, H, T, 1)
    dP = dO @ vh.transpose(0, 1, 3, 2)                                # (B, H, T, T)
    rp = np.float32(1.0 / kp) if kp > 0 else np.float32(0.0)
    if keep is None:
        dS, Pk = P * (dP - D), R(P)
    else:
        dS, Pk = P * (dP * keep - D), R(P) * keep
    dvh = R((Pk.transpose(0, 1, 3, 2) @ dO) * rp)                    # (B, H, T, hs)
    dS = R(dS)
    g = np.float32(scale) * rp
    dqh = R((dS @ kh) * g)                                            # (B, H, T, hs)
    dkh = R((dS.transpose(0, 1, 3, 2) @ qh) * g)                      # (B, H, T, hs)
    merge = lambda a: a.transpose(0, 2, 1, 3).reshape(B, T, H * hs)  # noqa: E731  (B, H, T, hs) -> (B, T, C)
    return merge(dqh), merge(dkh), merge(dvh)


def attention_probs_mixed(cache):
    """The probabilities after dropout, R(keep * P / (1 - p)) (B, H, T, T), for output_attentions."""
    qh, kh, _, _, m, l, keep, scale, mask, p, compute = _cache("attention", cache, 11, "attention_forward_mixed")
    P = np.exp(_scores(qh, kh, scale, mask) - m) / l
    if keep is not None:
        P = P * keep * np.float32(1.0 / (1.0 - p) if p < 1 else 0.0)
    return ROUND[compute](P)
