"""Every op against PyTorch (an independent peer) in float64: forward and autograd gradients.

Tolerance: 1e-12 relative (normwise) — both sides compute the same float64 math in a different order, which moves
results by a few ulps times the length of the reductions, far below 1e-12.
"""
import math

import numpy as np
import pytest

from peers import peer as import_peer
from refbert import ops
from refbert.check import _mask
from refbert.gradcheck import rel_error
from refbert.philox import DropoutRNG

torch = F = None     # set per test by _torch: every test here needs torch (tests/peers.py: skip, or fail under CI)


@pytest.fixture(autouse=True)
def _torch():
    global torch, F
    torch = import_peer("torch")
    F = torch.nn.functional


TOL = 1e-12


def peer(fn, *arrays):
    """Run fn on torch copies of `arrays` (float ones require grad); return (out, grad_fn(dout) -> grads)."""
    ts = [torch.tensor(a, requires_grad=a.dtype.kind == "f") for a in arrays]
    out = fn(*ts)

    def grads(dout):
        out.backward(torch.tensor(dout))
        return [t.grad.numpy() if t.grad is not None else np.zeros(t.shape) for t in ts if t.requires_grad]
    return out.detach().numpy(), grads


def compare(ours, cache, backward, theirs, grads, dout):
    assert rel_error(ours, theirs) <= TOL
    g = backward(dout, cache)
    for a, b in zip(g if isinstance(g, tuple) else (g,), grads(dout)):
        assert rel_error(a, b) <= TOL


r = np.random.default_rng(0)
x3 = r.standard_normal((2, 7, 12))
dout3 = r.standard_normal((2, 7, 12))


def test_linear():
    w, b = r.standard_normal((5, 12)), r.standard_normal(5)
    d = r.standard_normal((2, 7, 5))
    compare(*ops.linear_forward(x3, w, b), ops.linear_backward, *peer(F.linear, x3, w, b), d)


def test_embedding_padding_idx():
    ids = np.array([[0, 4, 4, 1], [2, 0, 4, 3]])
    w = r.standard_normal((5, 3))
    d = r.standard_normal((2, 4, 3))
    out, cache = ops.embedding_forward(ids, w, padding_idx=0)
    theirs, grads = peer(lambda w: F.embedding(torch.tensor(ids), w, padding_idx=0), w)
    compare(out, cache, ops.embedding_backward, theirs, grads, d)


def test_layernorm():
    w, b = r.standard_normal(12), r.standard_normal(12)
    compare(*ops.layernorm_forward(x3, w, b), ops.layernorm_backward,
            *peer(lambda x, w, b: F.layer_norm(x, (12,), w, b, eps=1e-12), x3, w, b), dout3)


def test_softmax_scale_mask():
    mask = _mask(2, 12, [12, 3], np.float64, np.finfo(np.float64).min)[:, 0]  # (2, 1, 12)
    compare(*ops.softmax_forward(x3, 0.25, mask), ops.softmax_backward,
            *peer(lambda x: torch.softmax(x * 0.25 + torch.tensor(mask), -1), x3), dout3)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(approximate):
    x = 5 * x3
    compare(*ops.gelu_forward(x, approximate), ops.gelu_backward,
            *peer(lambda x: F.gelu(x, approximate=approximate), x), dout3)


def test_tanh():
    compare(*ops.tanh_forward(x3), ops.tanh_backward, *peer(torch.tanh, x3), dout3)


def test_attention_against_torch_composition():
    B, T, H, hs = 2, 7, 3, 4
    q, k, v = (r.standard_normal((B, T, H * hs)) for _ in range(3))
    mask = _mask(B, T, [7, 2], np.float64, np.finfo(np.float64).min)

    def torch_attention(q, k, v):  # HF's eager path: split, scores / sqrt(hs) + mask, softmax, @ v, merge
        split = lambda t: t.view(B, T, H, hs).transpose(1, 2)  # noqa: E731
        s = split(q) @ split(k).transpose(-1, -2) / math.sqrt(hs) + torch.tensor(mask)
        return (torch.softmax(s, -1) @ split(v)).transpose(1, 2).reshape(B, T, H * hs)
    d = r.standard_normal((B, T, H * hs))
    compare(*ops.attention_forward(q, k, v, H, mask), ops.attention_backward, *peer(torch_attention, q, k, v), d)


def test_cross_entropy_ignore_index():
    logits = r.standard_normal((2, 7, 12))
    labels = r.integers(0, 12, (2, 7))
    labels[0, :5] = -100
    theirs, grads = peer(lambda z: F.cross_entropy(z.reshape(-1, 12), torch.tensor(labels).reshape(-1)), logits)
    compare(*ops.cross_entropy_forward(logits, labels), ops.cross_entropy_backward, theirs, grads, np.array(0.7))


def test_mse():
    p, t = r.standard_normal((4, 3)), r.standard_normal((4, 3))
    compare(*ops.mse_forward(p, t), ops.mse_backward, *peer(F.mse_loss, p, t), np.array(1.3))


def test_dropout_is_inverted_like_torch():
    # torch draws its own mask, so compare the semantics: kept units are x / (1 - p), dropped are 0, eval is identity
    x = np.abs(r.standard_normal((50, 40))) + 1
    ours, _ = ops.dropout_forward(x, 0.25, DropoutRNG(0))
    theirs = F.dropout(torch.tensor(x), 0.25, training=True).numpy()
    for out in (ours, theirs):
        kept = out != 0
        np.testing.assert_allclose(out[kept], x[kept] / 0.75, rtol=1e-15)


def test_linear_backward_with_mostly_zero_rows():
    # an MLM loss leaves ~85% of rows of dout exactly 0; linear_backward skips them: same gradients as torch's
    x, w, b = r.standard_normal((4, 10, 12)), r.standard_normal((7, 12)), r.standard_normal(7)
    d = r.standard_normal((4, 10, 7))
    d[r.random((4, 10)) < 0.85] = 0
    compare(*ops.linear_forward(x, w, b), ops.linear_backward, *peer(F.linear, x, w, b), d)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_gelu_gradient_near_zero_and_in_the_tails(dtype):
    # the backward reads Phi(x) as out / x, with a series for |x| < 1e-6: check the switch and the tails
    x = np.array([0.0, 1e-7, -1e-7, 9e-7, 1.1e-6, -1e-5, 1e-3, -8.0, -30.0, -40.0, 40.0], dtype)
    t = torch.tensor(x, requires_grad=True)
    F.gelu(t).backward(torch.ones_like(t))
    ours = ops.gelu_backward(np.ones_like(x), ops.gelu_forward(x)[1])
    # float64: a few ulps; float32: out / x carries two roundings of ~6e-8 each
    tol = 1e-15 if dtype == np.float64 else 3e-7
    np.testing.assert_allclose(ours, t.grad.numpy(), rtol=tol, atol=tol)
