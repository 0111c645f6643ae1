"""BERT's basic ops written with PyTorch, as a kernel author would bring them to refbert: each forward runs torch
with autograd recording, its cache is the graph, and each backward is torch.autograd.grad on it. Dropout draws
refbert's own Philox mask (refbert.ops.dropout_mask), so its masks are the oracle's. tests/test_testing.py grades
this file with `refbert check --ops` (every op, float32 and float64) and runs the whole model on it (`--model`);
the composed ops (residual and dropout + residual LayerNorm, bias + GELU) are built from its layernorm, dropout
and gelu by refbert.backends."""
import math

import torch
import torch.nn.functional as F

from refbert.ops import dropout_mask

ARRAY_LIBRARY = "torch"


def _forward(fn, *xs):
    """fn on leaf copies of xs with autograd recording: (out, cache = (out with its graph, the leaves))."""
    leaves = [x.detach().requires_grad_() for x in xs]
    with torch.enable_grad():
        out = fn(*leaves)
    return out.detach(), (out, leaves)


def _backward(dout, cache):
    out, leaves = cache
    d = torch.as_tensor(dout, dtype=out.dtype)
    grads = torch.autograd.grad(out, leaves, d.expand_as(out) if out.dim() == 0 else d, allow_unused=True)
    grads = tuple(torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads))
    return grads[0] if len(grads) == 1 else grads


def _keep(rng, shape, p, train):
    """refbert's keep-mask (a bool tensor) and the scale 1 / (1 - p), or None when dropout is the identity."""
    if not train or p == 0.0:
        return None
    keep = torch.from_numpy(dropout_mask(rng, tuple(shape), p, "dropout"))
    return keep, (1.0 / (1.0 - p) if p < 1.0 else 0.0)


def _drop(x, keep):
    """x * keep * scale in x's dtype (a Python float scale: a float32 one would round 1 / (1 - p) in float64)."""
    return x if keep is None else x * keep[0].to(x.dtype) * keep[1]


def linear_forward(x, w, b=None):
    if b is None:
        return _forward(F.linear, x, w)
    return _forward(F.linear, x, w, b)


linear_backward = _backward


def layernorm_forward(x, w, b, eps=1e-12):
    return _forward(lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, eps), x, w, b)


layernorm_backward = _backward


def softmax_forward(x, scale=1.0, mask=None):
    return _forward(lambda x: torch.softmax(x * scale + (0 if mask is None else mask.to(x.dtype)), -1), x)


softmax_backward = _backward


def gelu_forward(x, approximate="none"):
    return _forward(lambda x: F.gelu(x, approximate=approximate), x)


gelu_backward = _backward


def dropout_forward(x, p, rng=None, train=True):
    keep = _keep(rng, x.shape, p, train)
    return _forward(lambda x: _drop(x, keep), x)


def dropout_backward(dout, cache):
    g = _backward(dout, cache)
    return g.clone()                                   # a fresh array even where dropout was the identity


def attention_forward(q, k, v, n_heads, mask=None, dropout_p=0.0, rng=None, train=True):
    B, T, C = q.shape
    H, hs = n_heads, C // n_heads
    keep = _keep(rng, (B, H, T, T), dropout_p, train)

    def attend(q, k, v):
        heads = lambda a: a.reshape(B, T, H, hs).transpose(1, 2)  # noqa: E731  (B, H, T, hs)
        att = heads(q) @ heads(k).transpose(-1, -2) / math.sqrt(hs)
        if mask is not None:
            att = att + mask.to(q.dtype)
        p = torch.softmax(att, -1)
        p = _drop(p, keep)
        return (p @ heads(v)).transpose(1, 2).reshape(B, T, C)
    return _forward(attend, q, k, v)


attention_backward = _backward


def cross_entropy_forward(logits, labels, ignore_index=-100):
    y = labels.reshape(-1)
    n = int((y != ignore_index).sum())

    def ce(z):
        total = F.cross_entropy(z.reshape(-1, z.shape[-1]), y, ignore_index=ignore_index, reduction="sum")
        return total / max(n, 1)                       # refbert's semantics: every label ignored -> 0
    return _forward(ce, logits)


cross_entropy_backward = _backward
