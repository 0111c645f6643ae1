"""CuPy launchers for the CUDA C kernels in kernels/cuda/csrc/*.cu, with the oracle's signatures.

    attention_forward(q, k, v, n_heads, mask=None, dropout_p=0.0, rng=None, train=True) -> (out, cache)
    attention_backward(dout, cache) -> (dq, dk, dv);   attention_probs(cache) (Numba's, kernels/cuda/attention.py)
    softmax_forward(x, scale=1.0, mask=None) / softmax_backward(dout, cache)
    layernorm_forward(x, w, b, eps=1e-12) / layernorm_backward(dout, cache)
Oracle: refbert.ops (same ValueErrors, raised by the same checks before any launch; same dropout elements).

Which kernel runs (anything else falls back to the Numba CUDA version of the op, which takes every dtype):
    attention forward: CuPy float16, hs = 64  -> attn_fwd_v2 (tensor cores, cp.async; attention_forward.cu v2)
                       CuPy float32 / float16, hs in {32, 64, 128} -> attn_fwd_v1 (scalar flash)
    attention backward: CuPy float32 / float16, hs in {32, 64, 128} -> attn_bwd_D, attn_bwd_dkdv_v1, attn_bwd_dq_v1
    softmax, layernorm: CuPy float32 -> the warp-per-row float4 kernels (softmax.cu v2, layernorm.cu v1)
(CuPy has no bfloat16 dtype, so bf16 storage is the Numba path's, on NumPy arrays viewed as uint16.)
The attention cache is kernels/cuda/attention.py's tuple (q, k, v, mask4, H, out, m, linv, drop), so its
attention_probs and either backward read it.

Each .cu is compiled once per process by NVRTC through cupy.RawModule with -DNO_MAIN (the standalone validating
main and every host header sit behind it) and -I csrc (common.cuh). cupy is imported on first use only.
"""
import functools
import math
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from refbert import ops
from refbert import validate as V

from . import _common as C

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("attention_forward.cu", "attention_backward.cu", "softmax.cu", "layernorm.cu")
_DT = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16"}


@functools.lru_cache(maxsize=None)
def module(name):
    """The compiled cupy.RawModule of csrc/<name> (NVRTC, sm of the current device)."""
    import cupy
    code = (CSRC / name).read_text()
    return cupy.RawModule(code=code, options=("-std=c++17", "-DNO_MAIN", f"-I{CSRC}"))


def kernel(source, name):
    return module(source).get_function(name)


def _is_cupy(*arrays):
    return all(a is not None and C.xp_of(a) is not np for a in arrays)


# ----------------------------------------------------------------------------------------------------------------
# attention

def _mask_strides(mask4):
    """Element strides of the contiguous (1 or full)^4 mask for index (b, h, i, j): 0 on axes of length 1."""
    s = [int(x) for x in np.cumprod((1,) + tuple(mask4.shape[::-1]))[:4][::-1]]
    return [np.int64(0 if mask4.shape[a] == 1 else s[a]) for a in range(4)]


def _numba():
    from . import attention as A
    return A


def attention_forward(q, k, v, n_heads, mask=None, dropout_p=0.0, rng=None, train=True):
    A = _numba()
    B, T, Cc, H = A._checks(q, k, v, n_heads, mask)
    hs = Cc // H
    if not (_is_cupy(q, k, v) and q.dtype in _DT and hs in (32, 64, 128)) or q.size == 0:
        return A.attention_forward(q, k, v, n_heads, mask, dropout_p, rng, train)
    import cupy
    dt = _DT[q.dtype]
    q, k, v = (cupy.ascontiguousarray(a) for a in (q, k, v))
    mask4 = A._mask4(cupy, mask, B, H, T, q.dtype)
    m32 = cupy.ascontiguousarray(mask4, np.float32)
    dropping, p_ok, (seed, stream, thresh, dscale) = A._drop(dropout_p, rng, train)
    out = cupy.empty_like(q)
    m = cupy.empty((B, H, T), np.float32)
    linv = cupy.empty((B, H, T), np.float32)
    tc = dt == "f16" and hs == 64 and all(a.data.ptr % 16 == 0 for a in (q, k, v))   # cp.async: 16-byte rows
    name = f"attn_fwd_v2_{dt}_hs64" if tc else f"attn_fwd_v1_{dt}_hs{hs}"
    args = (q, k, v, m32, *_mask_strides(mask4), np.int32(B), np.int32(T), np.int32(H),
            np.float32(1.0 / math.sqrt(hs)), seed, stream, thresh, np.float32(dscale), out, m, linv)
    kernel("attention_forward.cu", name)(((T + 63) // 64, B * H), (128 if tc else 64,), args)
    if not (bool(cupy.isfinite(m).all()) and bool(cupy.isfinite(linv).all())):
        raise ValueError(A._SOFTMAX_ERROR)
    if not p_ok or (train and dropout_p > 0.0 and not isinstance(rng, A.DropoutRNG)):
        ops.dropout_forward(np.zeros(0, np.float32), dropout_p, rng, train)  # the oracle's dropout error
    if dropping:
        assert rng.next_stream() == (int(seed), int(stream))
    return out, (q, k, v, mask4, H, out, m, linv, (seed, stream, thresh, float(dscale)))


def attention_backward(dout, cache):
    A = _numba()
    q, k, v, mask4, H, out, m, linv, drop = cache
    C.dout("attention", dout, out.shape, out.dtype)
    B, T, Cc = q.shape
    hs = Cc // H
    if not (_is_cupy(q, dout) and q.dtype in _DT and hs in (32, 64, 128) and m is not None
            and m.dtype == np.float32) or q.size == 0:
        return A.attention_backward(dout, cache)
    import cupy
    dt = _DT[q.dtype]
    dout = cupy.ascontiguousarray(dout)
    m32 = cupy.ascontiguousarray(mask4, np.float32)
    seed, stream, thresh, dscale = drop
    Dr = cupy.empty((B, H, T), np.float32)
    kernel("attention_backward.cu", f"attn_bwd_D_{dt}")(((B * H * T + 7) // 8,), (256,),
                                                          (dout, out, np.int32(B), np.int32(T), np.int32(H),
                                                           np.int32(hs), Dr))
    dq, dk, dv = cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v)
    args = (q, k, v, m32, *_mask_strides(mask4), np.int32(B), np.int32(T), np.int32(H),
            np.float32(1.0 / math.sqrt(hs)), seed, stream, thresh, np.float32(dscale), m, linv, dout, Dr)
    grid = ((T + 63) // 64, B * H)
    kernel("attention_backward.cu", f"attn_bwd_dkdv_v1_{dt}_hs{hs}")(grid, (64,), args + (dk, dv))
    kernel("attention_backward.cu", f"attn_bwd_dq_v1_{dt}_hs{hs}")(grid, (64,), args + (dq,))
    return dq, dk, dv


def attention_probs(cache):
    return _numba().attention_probs(cache)


# ----------------------------------------------------------------------------------------------------------------
# softmax (float32 CuPy arrays; anything else: refbert_kernels.cuda.softmax)

def softmax_forward(x, scale=1.0, mask=None):
    from . import softmax as S
    if not (_is_cupy(x) and x.dtype == np.float32 and x.ndim >= 1 and x.size
            and (mask is None or (_is_cupy(mask) and mask.dtype == np.float32))):
        return S.softmax_forward(x, scale, mask)
    import cupy
    V.broadcasts_to("softmax", "mask", C.stub(mask), x.shape) if mask is not None else None
    T = x.shape[-1]
    x2 = cupy.ascontiguousarray(x).reshape(-1, T)
    R = x2.shape[0]
    if mask is None:
        m2, mrow = cupy.zeros((1, T), np.float32), cupy.zeros(R, np.int64)
    else:
        mk = mask.reshape((1,) * (x.ndim - mask.ndim) + mask.shape)
        m2 = cupy.ascontiguousarray(cupy.broadcast_to(mk, mk.shape[:-1] + (T,))).reshape(-1, T)
        rows = np.broadcast_to(np.arange(m2.shape[0]).reshape(mk.shape[:-1]), x.shape[:-1]).reshape(-1)
        mrow = cupy.asarray(np.ascontiguousarray(rows, np.int64))
    p = cupy.empty(x.shape, np.float32)
    bad = cupy.zeros(R, np.int32)
    kernel("softmax.cu", "softmax_fwd_v2")(((R + 7) // 8,), (256,),
                                           (x2, np.float32(scale), m2, mrow, np.int32(R), np.int32(T), p, bad))
    if int(bad.max()):
        raise ValueError("softmax: argument 'x' (with 'mask') expected every row to have a finite maximum, got a row "
                         "that is entirely -inf, or a NaN/+inf score")
    return p, ops.SoftmaxCache(p, scale)


def softmax_backward(dout, cache):
    from . import softmax as S
    p, scale = cache
    if not (_is_cupy(p, dout) and p.dtype == np.float32 and p.size):
        return S.softmax_backward(dout, cache)
    import cupy
    C.dout("softmax", dout, p.shape, p.dtype)
    T = p.shape[-1]
    R = p.size // T
    dx = cupy.empty(p.shape, np.float32)
    kernel("softmax.cu", "softmax_bwd_v2")(((R + 7) // 8,), (256,),
                                           (cupy.ascontiguousarray(dout), p, np.float32(scale), np.int32(R),
                                            np.int32(T), dx))
    return dx


# ----------------------------------------------------------------------------------------------------------------
# layernorm (float32 CuPy arrays; anything else: refbert_kernels.cuda.layernorm)

class LayerNormCacheC(NamedTuple):
    """The CUDA C layernorm's cache (float32 CuPy arrays; mean, rstd of shape x.shape[:-1] + (1,)). Its own type:
    a forward that fell back to Numba leaves Numba's cache, and the backward must tell the two apart."""
    x: Any
    w: Any
    mean: Any
    rstd: Any


def layernorm_forward(x, w, b, eps=1e-12):
    from . import layernorm as L
    if not (_is_cupy(x, w, b) and x.dtype == w.dtype == b.dtype == np.float32 and x.ndim >= 1 and x.size):
        return L.layernorm_forward(x, w, b, eps)
    import cupy
    V.shape("layernorm", "w", C.stub(w), (x.shape[-1],), "(C,)")
    V.shape("layernorm", "b", C.stub(b), (x.shape[-1],), "(C,)")
    Cc = x.shape[-1]
    x = cupy.ascontiguousarray(x)
    R = x.size // Cc
    out = cupy.empty_like(x)
    mean = cupy.empty(x.shape[:-1] + (1,), np.float32)
    rstd = cupy.empty(x.shape[:-1] + (1,), np.float32)
    kernel("layernorm.cu", "layernorm_fwd_v1")(((R + 7) // 8,), (256,),
                                               (x, cupy.ascontiguousarray(w), cupy.ascontiguousarray(b),
                                                np.float32(eps), np.int32(R), np.int32(Cc), out, mean, rstd))
    return out, LayerNormCacheC(x, w, mean, rstd)


def layernorm_backward(dout, cache):
    from . import layernorm as L
    if not isinstance(cache, LayerNormCacheC):          # the forward fell back to Numba (not float32 CuPy)
        return L.layernorm_backward(dout, cache)
    x, w, mean, rstd = cache
    import cupy
    C.dout("layernorm", dout, x.shape, x.dtype)
    Cc = x.shape[-1]
    R = x.size // Cc
    per, chunks = C.chunks(R)
    dout = cupy.ascontiguousarray(dout)
    w = cupy.ascontiguousarray(w)
    dx = cupy.empty_like(x)
    kernel("layernorm.cu", "layernorm_bwd_dx_v1")(((R + 7) // 8,), (256,),
                                                  (dout, x, w, mean, rstd, np.int32(R), np.int32(Cc), dx))
    pw, pb = cupy.empty((chunks, Cc), np.float32), cupy.empty((chunks, Cc), np.float32)
    kernel("layernorm.cu", "layernorm_bwd_dwdb_partial")(((Cc + 255) // 256, chunks), (256,),
                                                         (dout, x, mean, rstd, np.int32(R), np.int32(Cc),
                                                          np.int32(per), pw, pb))
    dw, db = cupy.empty(Cc, np.float32), cupy.empty(Cc, np.float32)
    colsum = kernel("layernorm.cu", "column_sum")
    colsum(((Cc + 255) // 256,), (256,), (pw, np.int32(chunks), np.int32(Cc), dw))
    colsum(((Cc + 255) // 256,), (256,), (pb, np.int32(chunks), np.int32(Cc), db))
    return dx, dw, db
