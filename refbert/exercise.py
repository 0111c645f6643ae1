"""`refbert exercise init DIR`: backprop exercises — the backward passes of BERT's ops, written by you.

DIR/ops.py holds, for each chosen op, its forward (written, as refbert.ops computes it, with the same cache) and its
backward: the signature, the docstring (what arrives, what is in the cache and its shapes, what to return, what to
derive) and a body that raises NotImplementedError. DIR/README.md gives the order and how to check each step:
`refbert check --ops DIR/ops.py` grades every op the file defines against the float64 oracle and says which part of
a wrong gradient is wrong; `--model` then runs the whole BERT on your ops (refbert.backends: the ops you did not
write are the oracle's, and your softmax is what every attention runs, your layernorm every residual LayerNorm,
your gelu the feed-forward's bias + GELU). docs/backprop.md derives them all: read it after trying.

The idea is cs231n's assignments and Karpathy's "backprop ninja" exercise, for a whole BERT.
"""
import os

from .fileio import write_text

ORDER = ("linear", "gelu", "softmax", "layernorm", "dropout", "attention", "cross_entropy")

HEADER = '''"""Backprop through BERT, by hand: the backward passes are yours to write (refbert exercise init).

Each op is a pair of plain functions. The forward is written: `<op>_forward(...) -> (out, cache)`. The backward
`<op>_backward(dout, cache)` receives dout, the gradient of the loss with respect to out (same shape as out), and
the cache the forward made; it returns the gradient with respect to each differentiable input of the forward, in
the forward's order, each the shape of its input. Each raises NotImplementedError until you write it: the docstring
says what arrives and what to derive, not the answer.

Check, as you go:     refbert check --ops {path}
Then the whole BERT:  refbert check --ops {path} --model
Order: {order}; README.md beside this file. After trying: docs/backprop.md.
Rules of the game: NumPy only; the output keeps the input's dtype (float32 stays float32); never write into an
argument; both GELUs, every mask, p = 0 and p = 1, an empty row of labels must work (the check tries them all).
"""
import math

import numpy as np

from refbert.ops import dropout_mask  # the keep-mask every refbert backend draws (Philox), so your dropout matches
from refbert.special import expit, ndtr  # the sigmoid, and the normal CDF Phi(x) = (1 + erf(x / sqrt 2)) / 2
'''

FORWARDS = {}
BACKWARDS = {}

FORWARDS["linear"] = '''

# ----------------------------------------------------------------------------------------------------------------
# linear: out = x @ w.T + b   (torch.nn.Linear's layout: w is (C_out, C_in))

def linear_forward(x, w, b=None):
    """Affine map over the last axis, any leading dims.

    x: (..., C_in)   w: (C_out, C_in)   b: (C_out,) or None   ->   out: (..., C_out)
    cache = (x, w, has_b)
    """
    out = x @ w.T                                        # (..., C_out)
    if b is not None:
        out = out + b
    return out, (x, w, b is not None)
'''
BACKWARDS["linear"] = '''

def linear_backward(dout, cache):
    """dout: (..., C_out).   cache: x (..., C_in), w (C_out, C_in), has_b (bool).
    Return dx (..., C_in), dw (C_out, C_in), and db (C_out,) when has_b — else just dx, dw.

    Derive: write one element, out[n, o] = sum_i x[n, i] w[o, i] + b[o] (n runs over every leading position),
    and ask which elements of out each x[n, i], w[o, i] and b[o] reaches. w and b are shared by every n.
    Check: each gradient has the shape of what it differentiates.
    """
    x, w, has_b = cache
    raise NotImplementedError("linear_backward: derive dx, dw (and db)")
'''

FORWARDS["gelu"] = '''

# ----------------------------------------------------------------------------------------------------------------
# GELU: exact (HF "gelu") and its tanh approximation (HF "gelu_new")

def gelu_forward(x, approximate="none"):
    """GELU, elementwise.   x: (...)   ->   out: (...)

    "none":  out = x * Phi(x), Phi the normal CDF
    "tanh":  out = x * (1 + tanh(u)) / 2,  u = sqrt(2/pi) * (x + 0.044715 x^3)   [(1 + tanh u) / 2 = sigmoid(2u)]
    cache = (x, out, approximate)
    """
    if approximate == "none":
        out = x * ndtr(x)
    elif approximate == "tanh":
        out = x * expit(2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))
    else:
        raise ValueError(f"gelu: approximate expected 'none' or 'tanh', got {approximate!r}")
    return out, (x, out, approximate)
'''
BACKWARDS["gelu"] = '''

def gelu_backward(dout, cache):
    """dout: (...).   cache: x (...), out (...), approximate.   Return dx (...).

    The op is elementwise, so dx = dout * (d out / d x) at each x. Derive that derivative for both forms: for
    "none", the product rule on x * Phi(x) (what is the derivative of a CDF?); for "tanh", the chain rule through u.
    Check: at x = 0 both derivatives are 1/2; for large |x| they tend to 1 and 0.
    """
    x, out, approximate = cache
    raise NotImplementedError("gelu_backward: derive d gelu / dx for both forms")
'''

FORWARDS["softmax"] = '''

# ----------------------------------------------------------------------------------------------------------------
# softmax over the last axis, with the attention's score scale and additive mask

def softmax_forward(x, scale=1.0, mask=None):
    """p = softmax(x * scale + mask) over the last axis.

    x: (..., T)   mask: additive, broadcastable to x (0 where attended, a large negative number or -inf where
    not), or None   ->   p: (..., T)
    cache = (p, scale)
    """
    z = x * scale
    if mask is not None:
        z = z + mask
    e = np.exp(z - z.max(-1, keepdims=True))             # shift by the row's max: logits of 1e4 do not overflow
    p = e / e.sum(-1, keepdims=True)
    return p, (p, scale)
'''
BACKWARDS["softmax"] = '''

def softmax_backward(dout, cache):
    """dout: (..., T).   cache: p (..., T), scale.   Return dx (..., T).

    Derive the Jacobian of one row, d p_i / d z_j (the cases i = j and i != j), and contract it with dout:
    dz_j = sum_i dout_i * d p_i / d z_j. Then z = x * scale + mask (the mask is a constant).
    Check: every row of dx sums to 0 (softmax ignores a shift of its row: why does that force it?).
    """
    p, scale = cache
    raise NotImplementedError("softmax_backward: derive the Jacobian-vector product of one row")
'''

FORWARDS["layernorm"] = '''

# ----------------------------------------------------------------------------------------------------------------
# layernorm over the last axis

def layernorm_forward(x, w, b, eps=1e-12):
    """out = (x - mean) * rstd * w + b, per row of the last axis.

    x: (..., C)   w, b: (C,)   ->   out: (..., C)
    mean = x.mean(-1), var = ((x - mean)^2).mean(-1) (biased), rstd = 1 / sqrt(var + eps), xhat = (x - mean) * rstd
    cache = (x, w, mean (..., 1), rstd (..., 1))
    """
    mean = x.mean(-1, keepdims=True)
    xc = x - mean
    var = (xc * xc).mean(-1, keepdims=True)
    rstd = 1 / np.sqrt(var + eps)
    out = xc * rstd * w + b
    return out, (x, w, mean, rstd)
'''
BACKWARDS["layernorm"] = '''

def layernorm_backward(dout, cache):
    """dout: (..., C).   cache: x (..., C), w (C,), mean (..., 1), rstd (..., 1).   Return dx (..., C), dw (C,), db (C,).

    Recompute xhat = (x - mean) * rstd. dw and db: w and b are shared by every row (sum over every leading dim).
    dx: mean and rstd are functions of the whole row, so x_j moves every out_i of its row — directly through
    xhat_i, through the mean, and through rstd. Name the gradient reaching xhat (dout * w) and carry it through
    each of the three paths.
    Check: every row of dx sums to 0 and is orthogonal to that row of xhat (LayerNorm ignores a shift and a
    scaling of its row).
    """
    x, w, mean, rstd = cache
    raise NotImplementedError("layernorm_backward: derive dx (three paths), dw, db")
'''

FORWARDS["dropout"] = '''

# ----------------------------------------------------------------------------------------------------------------
# dropout, inverted: kept units scaled by 1 / (1 - p) in training, so that eval is the identity

def dropout_forward(x, p, rng=None, train=True):
    """out = x * keep / (1 - p) in training (p = 1: out = 0); out = x in eval or when p = 0.

    x: (...)   p: the drop probability   rng: refbert.DropoutRNG (refbert's masks are counter-based: the same on
    every backend)   ->   out: (...)
    cache = (keep (x's shape, bool) or None, scale = 1 / (1 - p), x.shape, x.dtype)
    """
    if not train or p == 0.0:
        return x, (None, 1.0, x.shape, x.dtype)
    keep = dropout_mask(rng, x.shape, p, "dropout")
    scale = 1.0 / (1.0 - p) if p < 1.0 else 0.0
    out = x * keep * x.dtype.type(scale)
    return out, (keep, scale, x.shape, x.dtype)
'''
BACKWARDS["dropout"] = '''

def dropout_backward(dout, cache):
    """dout: (...).   cache: keep (bool, or None in eval and when p = 0), scale, shape, dtype.   Return dx (...).

    Dropout is linear and elementwise: by what does it multiply each element? (Return a fresh array, even when
    dropout was the identity.)
    """
    keep, scale, shape, dtype = cache
    raise NotImplementedError("dropout_backward")
'''

FORWARDS["attention"] = '''

# ----------------------------------------------------------------------------------------------------------------
# multi-head self-attention core: (q, k, v) already projected -> the context, before the output projection

def attention_forward(q, k, v, n_heads, mask=None, dropout_p=0.0, rng=None, train=True):
    """Per head: p = softmax(q k^T / sqrt(hs) + mask), pd = dropout(p), y = pd @ v; heads split from and merged
    into C. Built from this file's softmax and dropout (or refbert's, for those you did not choose).

    q, k, v: (B, T, C), C = n_heads * hs   mask: broadcastable to (B, H, T, T) (HF: (B, 1, 1, T))   ->   out (B, T, C)
    cache = (qh, kh, vh (B, H, T, hs), p (B, H, T, T), the softmax's cache, the dropout's cache)
    """
    B, T, C = q.shape
    H, hs = n_heads, C // n_heads
    qh = q.reshape(B, T, H, hs).transpose(0, 2, 1, 3)    # (B, H, T, hs)
    kh = k.reshape(B, T, H, hs).transpose(0, 2, 1, 3)
    vh = v.reshape(B, T, H, hs).transpose(0, 2, 1, 3)
    att = qh @ kh.transpose(0, 1, 3, 2)                  # (B, H, T, T)
    p, sm_cache = softmax_forward(att, 1.0 / math.sqrt(hs), mask)
    pd, do_cache = dropout_forward(p, dropout_p, rng, train)
    y = pd @ vh                                          # (B, H, T, hs)
    out = y.transpose(0, 2, 1, 3).reshape(B, T, C)       # (B, T, C)
    return out, (qh, kh, vh, p, sm_cache, do_cache)
'''
BACKWARDS["attention"] = '''

def attention_backward(dout, cache):
    """dout: (B, T, C).   cache: qh, kh, vh (B, H, T, hs), p (B, H, T, T) (before dropout), sm_cache, do_cache.
    Return dq, dk, dv, each (B, T, C).

    Walk the forward backwards, one line at a time: undo the merge of heads; y = pd @ vh gives a gradient to pd
    and one to vh (the backward of a matrix product); then dropout_backward and softmax_backward (yours) on their
    caches — the softmax already holds the 1/sqrt(hs) scale; then att = qh @ kh^T; finally merge the heads of
    dq, dk, dv back to (B, T, C). pd = dropout(p) is not cached: recompute it from p (dropout is linear).
    """
    qh, kh, vh, p, sm_cache, do_cache = cache
    raise NotImplementedError("attention_backward: reverse every line of the forward")
'''

FORWARDS["cross_entropy"] = '''

# ----------------------------------------------------------------------------------------------------------------
# cross-entropy: the loss of the MLM, NSP and classification heads

def cross_entropy_forward(logits, labels, ignore_index=-100):
    """Mean softmax cross-entropy over the rows whose label is not ignore_index (torch's F.cross_entropy).

    logits: (..., V)   labels: (...) integers in [0, V), or ignore_index   ->   loss: a 0-d array of logits' dtype
    With n kept rows and lse = log sum_j exp(z_j):  loss = (1/n) sum_kept (lse - z[label]); no row kept: loss = 0.
    cache = (logits.shape, logits.dtype, zs (n, V) the kept rows minus their max, yk (n,) their labels,
             kept (n,) their row indices in the flattened (N, V) logits, s (n, 1) = log sum exp(zs))
    """
    V = logits.shape[-1]
    z = logits.reshape(-1, V)                            # (N, V)
    y = labels.reshape(-1)                               # (N,)
    kept = np.flatnonzero(y != ignore_index)             # (n,)
    zk, yk = z[kept], y[kept]
    m = zk.max(-1, keepdims=True) if kept.size else np.zeros((0, 1), z.dtype)
    zs = zk - m                                          # (n, V) <= 0: exp never overflows
    s = np.log(np.exp(zs).sum(-1, keepdims=True))        # (n, 1): lse = m + s
    loss = (s[:, 0] - zs[np.arange(kept.size), yk]).sum() / max(kept.size, 1)
    return np.asarray(loss, dtype=logits.dtype), (logits.shape, logits.dtype, zs, yk, kept, s)
'''
BACKWARDS["cross_entropy"] = '''

def cross_entropy_backward(dloss, cache):
    """dloss: a scalar (the gradient of the final loss with respect to this one).
    cache: shape, dtype, zs (n, V), yk (n,), kept (n,), s (n, 1) (see the forward).   Return dlogits (shape).

    Derive d loss / d z for one kept row: the derivative of log sum_j exp(z_j), and of -z[label]. Ignored rows
    get 0. Mind dloss and the 1/n. Check: each kept row of dlogits sums to 0.
    """
    shape, dtype, zs, yk, kept, s = cache
    raise NotImplementedError("cross_entropy_backward")
'''

README = """# Backprop through BERT, by hand

`ops.py` holds BERT's ops as forward/backward pairs. The forwards are written; the backward passes are yours.
Write them in this order, each a step up from the last:

{steps}
8. **the whole model**: when every op passes, run BERT on your ops (below). The ops you did not write are
   refbert's, and yours are used wherever the model needs them: your softmax in every attention, your layernorm in
   every residual LayerNorm, your gelu in the feed-forward's bias + GELU.

## How to check

```bash
refbert check --ops {dir}/ops.py            # every op in the file, float32 and float64, against the float64 oracle
refbert check --ops {dir}/ops.py --model    # then BertForPreTraining and a classifier on your ops, tensor by tensor
```

A row per op, tensor and dtype, with the error in ulps next to refbert's own and PyTorch's. A backward you have not
written yet fails with "not written yet". A wrong one fails on the cases that show it, with the worst elements and
the shape of the error, e.g.

    shape of the error: the error is constant within each row (along the last axis): ... a term that is the same
    across that axis is missing or extra (a mean, a sum, a bias)

which is what a LayerNorm backward without the mean's path looks like. `--model` names the first tensor that goes
wrong in the order the backward computes them (the head, the pooler, the last layer, ..., the embeddings). When it
passes, your BERT's every gradient equals refbert's, which equals Hugging Face's (`tests/test_hf_parity.py`).

## When you are stuck, or done

`docs/backprop.md` in refbert derives every one of these backward passes with the same names; read it after
trying. `refbert trace` prints one training step op by op, with each gradient's size.
"""

STEPS = {
    "linear": "**linear** — `x @ w.T + b`: three gradients, and which axes to sum over.",
    "gelu": "**gelu** — an elementwise derivative, two forms (HF's `gelu` and `gelu_new`).",
    "softmax": "**softmax** — the first Jacobian that is not diagonal: every output of a row depends on every input.",
    "layernorm": "**layernorm** — a row's mean and variance depend on every element: three paths into each x.",
    "dropout": "**dropout** — linear, with a random mask (refbert's, so yours matches the oracle's).",
    "attention": "**attention** — two matrix products, your softmax and your dropout, and the heads' reshapes.",
    "cross_entropy": "**cross_entropy** — the loss: the gradient that starts it all, ignored labels included.",
}


def render(ops=None, path="ops.py"):
    """The text of ops.py for the chosen ops (default all, in ORDER)."""
    chosen = [op for op in ORDER if op in (ops or ORDER)]
    bad = [op for op in (ops or ()) if op not in ORDER]
    if bad:
        raise ValueError(f"exercise: argument 'ops' expected some of {', '.join(ORDER)}, got {', '.join(bad)}")
    text = HEADER.format(path=path, order=", ".join(ORDER))
    if "attention" in chosen:
        missing = [op for op in ("softmax", "dropout") if op not in chosen]
        if missing:                                       # attention is built from these: refbert's, then
            names = ", ".join(f"{op}_{h}" for op in missing for h in ("backward", "forward"))
            text += f"from refbert.ops import {names}  # noqa: F401 (attention uses them)\n"
    for op in chosen:
        text += FORWARDS[op] + BACKWARDS[op]
    return text


def init(folder, ops=None, force=False):
    """Write folder/ops.py and folder/README.md (refusing to overwrite them unless force). -> the paths written"""
    paths = [os.path.join(folder, "ops.py"), os.path.join(folder, "README.md")]
    existing = [p for p in paths if os.path.exists(p)]
    if existing and not force:
        raise ValueError(f"exercise: '{existing[0]}' exists; expected a new folder (or --force to overwrite)")
    os.makedirs(folder, exist_ok=True)
    chosen = [op for op in ORDER if op in (ops or ORDER)]
    write_text(paths[0], render(ops, paths[0]))
    steps = "\n".join(f"{i}. {STEPS[op]}" + ("" if op in chosen else " (not chosen: refbert's)")
                      for i, op in enumerate(ORDER, 1))
    write_text(paths[1], README.format(steps=steps, dir=folder))
    return paths
