"""Mixed precision on the cuda backend: the spec of refbert.ops ("mixed precision: the spec") with tensor-core
GEMMs. refbert.mixed calls these in place of its generic rule (a function `<name>_mixed` of a backend is its own
16-bit op; `round_compute` its rounding of device arrays), so `BertForPreTraining(cfg, backend="cuda",
precision="bf16-mixed")` runs:

    round_compute     R on device arrays: csrc/mixed.cu round_v2 (float4; round_v1 where n % 4 or the alignment
                      forbids, or under REFBERT_CUDA_ROUND=1), bit for bit refbert.ops.round_bfloat16 /
                      round_float16 (NumPy arrays: those functions themselves). refbert.mixed's rule rounds every
                      fused op's inputs and outputs with it: the fused ops run their float32 versions in between.
    linear (M1)       out = R(x2 @ R(w)^T + R(b)): x2 and w rounded into 16-bit storage (csrc/mixed.cu round16_v2,
                      v1 where it must), one cuBLAS GEMM with 16-bit inputs, float32 accumulation and a float32
                      result (cublasGemmEx, CUBLAS_COMPUTE_32F: tensor cores), then bias_round_v2 (rows of any
                      length: v3; v1 where neither runs) adds R(b) and rounds, in place (and writes the output's
                      twin). Backward: dout rounded into 16-bit storage (and into float32 for the bias),
                      dx = R(dout2 @ R(w)) (a GEMM, then round_v2; with dx_into, the gradient of x from its other
                      paths, dx_into + R(...) in one add_round pass), dw = dout2^T @ x2 in float32 (a GEMM with a
                      float32 result: a parameter's gradient is never rounded), db = the column sums of R(dout2) (the
                      column_sum version; C1 reads the 16-bit operand, colsum16_partial_v1: the same bits). The
                      16-bit copies of x and w are the forward's cache: made once per call, never per use.
    attention (S2)    the spec's arithmetic (refbert.ops.attention_forward_mixed / attention_backward_mixed):
                      csrc/mixed.cu's kernels (the heads' R and layout, one warp per score row for the scale,
                      mask, row max, exp, row sum, R(P) and the Philox keep-mask, the normalisation and R of the
                      output) around five batched GEMMs on 16-bit operands; P and dS rounded where a tensor core
                      reads them. It writes the (B, H, T, T) scores to memory: the reference the flash kernels of
                      issue 14 item 4 will be checked against, not one of them. S1: the same steps as array
                      operations (any array module: the simulator's NumPy). S3 (REFBERT_MIXED_ATTENTION=S3, head
                      size 64): the same spec as tensor-core flash kernels (csrc/mixed.cu s3_fwd, s3_dkdv, s3_dq),
                      no (B, H, T, T) array; the forward walks the keys twice so that R(pt) uses the row's final
                      max as the spec does; opt-in: on the H200 its step was the slower (below). S4
                      (REFBERT_MIXED_ATTENTION=S4): S3 with dropout's keep-mask a Philox call per 4 scores where
                      T % 4 == 0 (s4_fwd, s4_dkdv, s4_dq; S3 makes a call a score, three times over a step): S3's
                      bits.
    fused ops (K1)    layernorm, residual_layernorm, dropout_residual_layernorm, gelu, bias_gelu: their CUDA C
                      versions (layernorm.cu v2, gelu.cu v1) with the rounding inside (rk: every compute-dtype
                      value rounded as it is loaded, every activation written rounded as it is stored): the
                      generic rule's arithmetic without its rounding passes; cross_entropy: version C2's forward
                      on R(logits), its backward (cross_entropy.cu ce_bwd_v1 with rk) writing R(dz) and its twin.
                      The other fused ops (softmax, dropout) and the small ones run the generic rule around their
                      float32 versions.
    marks             every array these functions write is on the compute grid: refbert.mixed.mark remembers it
                      (weakly), and the rule's R skips it when it comes back as an input.
    twins             the ops whose output a linear reads next (the K1 layernorms and bias + GELU, their backwards'
                      da and dx, S2's and S3's outputs and dq, dk, dv, the cross-entropy's dz) also write that
                      output's 16-bit bits, in the same kernel (common.cuh put16): the linear takes them as its
                      GEMM operand instead of a round16 pass over the float32 array (a pass that read 4 bytes and
                      wrote 2 an element; the producer writes 2 more). A linear's own output has one too (its
                      bias_round / round16 epilogue writes it): what its reader keeps (below), and S3's q, k, v
                      operands. twin() / twin_of() keep them while the float32 array lives;
                      REFBERT_MIXED_TWINS=0 turns them off (the same bits either way: round16 of an array on the
                      grid is exact). The weights have none (round16 once a step, in the forward).
    kept in 16 bits   what a forward keeps for its backward is 16-bit storage, not float32 (issue 14 item 3): the
                      K1 layernorms keep x and a, the GELUs x, the attention its output (for D), the cross-entropy
                      its logits, each as the input's twin where it has one (a linear reading the same array shares
                      it: a layer's input is kept once, for q, k, v and the residual), else (the layernorms and
                      GELUs) written by the forward kernel as it reads the input (common.cuh keep16); their
                      backward kernels read 2 bytes an element (ld_in, IN16) where they read 4, and the float32
                      activation is freed once the forward has read it. The same values (R(x) in either form), so
                      the same bits: REFBERT_MIXED_TWINS=0 keeps float32 again.

Where the arrays are the emulator's, everything runs as on a GPU (csrc/mixed.cu, the K1 kernels, the 16-bit GEMM
operands and twins) but the GEMM itself: the array module's float32 matmul of the operands' values (blas.gemm,
the same products and float32 sums). In the simulator (NumPy arrays) the GEMMs take the rounded float32 operands,
and S1 and the rule run. Agreement with the spec: the
roundings are the spec's bit for bit; the float32 sums inside a GEMM, a reduction or exp come in another order or
from another library (an FMA where NumPy rounds twice), so a compute-dtype value can differ by one ulp where its
float32 value sits within float32 noise of a rounding boundary (tests/test_cuda_mixed.py: every op and the whole
model against the numpy backend's spec, on the emulator, the simulator and a GPU; `refbert bench --device cuda`'s
mixed section times it).
"""
import functools
import math
import os
import weakref
from typing import Any, NamedTuple

import numpy as np

from refbert import ops
from refbert import validate as V
from refbert.mixed import mark, on_grid

from . import _common as C
from . import blas, cuda_c, versions
from .cuda_c import (_c_ok, _ce_forward, _dropout_apply, _gelu_run, _in16, _ln2_backward, _ln2_forward,
                     _mask_strides, bias_gelu_backward_c1, column_sum16_c1, cross_entropy_backward_c1,
                     gelu_backward_c1, null16)

# the backend (it imports this module at its end) and the Numba kernel modules (one that fails to import must not
# take mixed precision with it) through C.sibling: imported on first use and kept, since an import statement inside
# these functions, which run around every launch, costs about a microsecond a call (benchmarks/host_overhead.py)


def _backend():
    return C.sibling("backend")


def _dev(x):
    return C.sibling("backend")._dev(x)


def check_linear(x, w, b):
    return C.sibling("backend").check_linear(x, w, b)


def column_sum(x2):
    return C.sibling("backend").column_sum(x2)


def dropout_forward(*args, **kwargs):
    return C.sibling("backend").dropout_forward(*args, **kwargs)


def _mask4(*args):
    return C.sibling("attention")._mask4(*args)


def draw(*args):
    return C.sibling("dropout").draw(*args)


def _check_approximate(*args):
    return C.sibling("gelu")._check_approximate(*args)


def _check_ln(*args):
    return C.sibling("layernorm")._check_ln(*args)

KIND = {"bfloat16": 0, "float16": 1}       # csrc/mixed.cu's kind
F32 = np.dtype(np.float32)


def _kind(compute):
    if compute not in KIND:
        raise ValueError(f"mixed: argument 'compute' expected one of {', '.join(KIND)}, got {compute!r}")
    return np.int32(KIND[compute])


def _ran(op, compute, key):
    k = (op, compute, key)
    versions.RAN[k] = versions.RAN.get(k, 0) + 1


def _launch(name, threads, args, xp):
    grid = (min(C.grid_for(threads, 256), 65536),)
    cuda_c.kernel("mixed.cu", name, xp)(grid, (256,), args)


ROUND_VERSION = os.environ.get("REFBERT_CUDA_ROUND", "2")   # the rounding kernels' version: "1" pins version 1
#                                                             (A/B runs); version 2 runs where it applies


def _v2(n, arrays):
    """A rounding kernel's version 2 applies: not pinned to 1, n (its float4 axis) a multiple of 4, every array
    16-byte aligned."""
    return ROUND_VERSION != "1" and n % 4 == 0 and all(a.data.ptr % 16 == 0 for a in arrays)


def _rounding(name, n, args, arrays, xp):
    """csrc/mixed.cu `name`_v2 (four elements a thread, float4) where _v2 applies, else `name`_v1 (a thread per
    element)."""
    if _v2(n, arrays):
        _launch(f"{name}_v2", n // 4, args, xp)
    else:
        _launch(f"{name}_v1", n, args, xp)


# ----------------------------------------------------------------------------------------------------------------
# R on the device

def round_compute(x, compute):
    """R(x): x (float32) rounded to the compute dtype's grid, as float32 (refbert.ops.round_compute's bits). A device
    array is rounded by csrc/mixed.cu round_v1 into a new array; anything else by refbert.ops."""
    if not C.on_device(x):
        return ops.round_compute(x, compute)
    if x.dtype != F32:
        raise ValueError(f"round_compute: argument 'x' expected float32, got {x.dtype}")
    xp = C.xp_of(x)
    x = xp.ascontiguousarray(x)
    out = xp.empty(x.shape, F32)
    if x.size:
        _rounding("round", x.size, (x, np.int64(x.size), _kind(compute), out), (x, out), xp)
    return out


def settle(x, compute):
    """R(x), skipping an array a mixed op wrote (refbert.mixed.mark: on the grid already); the result marked."""
    return x if on_grid(x, compute) else mark(round_compute(x, compute), compute)


def _round_(y, compute, o16=None):
    """R(y) in place (y a contiguous float32 device array), y returned; o16 (uint16, y's size): y's twin written
    beside it in the same pass (round16 with its float32 output in place)."""
    if not C.on_device(y):
        y[...] = ops.round_compute(y, compute)
        return y
    if y.size and o16 is not None:
        _rounding("round16", y.size, (y, np.int64(y.size), _kind(compute), np.int32(1), y, o16), (y, o16),
                  C.xp_of(y))
    elif y.size:
        _rounding("round", y.size, (y, np.int64(y.size), _kind(compute), y), (y,), C.xp_of(y))
    return y


def _gemm_ex():
    """GEMM operands in 16-bit storage (round16's bits): on a GPU, and on the emulator (blas.gemm reads the bits'
    values there), so that it runs the GPU's own path; the simulator (NumPy) passes R(x) as float32."""
    return versions.MODE in ("gpu", "emu")


# twins: a float32 activation on the grid and its 16-bit bits, written by the same kernel (the K1 layernorms and
# GELUs, S2's merge), so that the linear reading it next takes the bits as its GEMM operand without a round16 pass
# (4 bytes read and 2 written an element, and a launch, saved; the producer writes 2 bytes more). Held while the
# float32 array lives (a weak reference), for the compute dtype it was written in.

_TWINS = {}


def _twins_on(like):
    """Twins (and 16-bit kept inputs) for an array like `like`: GEMM operands are 16-bit (not the simulator), twins
    are on (REFBERT_MIXED_TWINS unset or 1) and it has elements."""
    return _gemm_ex() and os.environ.get("REFBERT_MIXED_TWINS", "1") != "0" and like.size > 0


def _new16(like, compute):
    """A twin buffer for an output like `like` (uint16, its size), or None where twins are off (_twins_on)."""
    return C.xp_of(like).empty(like.shape, np.uint16) if _twins_on(like) else None


def _kept16(x, compute):
    """(what a forward keeps of its input x for the backward in 16 bits, the buffer its kernel must write that into
    or None): x's twin where it has one (nothing to write), else a new buffer the kernel fills from R(x) as it reads
    x (common.cuh keep16); (None, None) where twins are off (the backward then reads x as float32)."""
    bits = twin_of(x, compute)
    if bits is not None:
        return bits, None
    buf = _new16(x, compute)
    return buf, buf


def _or_null(bits, xp):
    """A twin buffer, or the kernels' null pointer (cuda_c.null16) where there is none."""
    return null16(xp) if bits is None else bits


def twin(x, bits, compute):
    """Remember bits (uint16, x's size, contiguous, any shape: readers reshape them) as x's 16-bit storage in
    `compute` (x on the grid: round16(x)'s bits); x returned. bits None: nothing remembered."""
    if bits is not None:
        key = id(x)
        try:
            ref = weakref.ref(x, lambda _r, key=key: _TWINS.pop(key, None))
        except TypeError:                               # (an array type without weak references: no twin)
            return x
        _TWINS[key] = (ref, bits, compute)
    return x


def twin_of(x, compute):
    """x's twin bits in `compute` (twin()), or None."""
    t = _TWINS.get(id(x))
    return t[1] if t is not None and t[0]() is x and t[2] == compute else None


def operand(x, compute, want32=False):
    """x rounded for a GEMM: (R(x) as float32 or None, the GEMM operand). On a GPU the operand is R(x) in 16-bit
    storage (uint16 bit patterns: the GEMM reads them as bfloat16 / float16) and R(x) float32 is made only when
    want32; elsewhere the operand is R(x) float32 itself."""
    x = C.xp_of(x).ascontiguousarray(x)
    if not _gemm_ex():
        r = round_compute(x, compute)
        return r, r
    xp = C.xp_of(x)
    bits = xp.empty(x.shape, np.uint16)
    r = xp.empty(x.shape, F32) if want32 else x
    if x.size:
        _rounding("round16", x.size, (x, np.int64(x.size), _kind(compute), np.int32(want32), r, bits), (x, r, bits),
                  xp)
    return (r if want32 else None), bits


def gemm(a, b, ta, tb, compute):
    """op(a) @ op(b) (op: transpose when ta / tb), a float32 (M, N) array, from two GEMM operands (operand()):
    on a GPU one cublasGemmEx with 16-bit inputs, CUBLAS_COMPUTE_32F (float32 accumulation, tensor cores) and a
    float32 result (blas.gemm); elsewhere the array module's float32 matmul of the rounded operands."""
    if not _gemm_ex():
        return C.xp_of(a).matmul(a.T if ta else a, b.T if tb else b)
    return blas.gemm(a, b, ta, tb, kind=compute)


def gemm_batched(a, b, ta, tb, compute):
    """op(a[i]) @ op(b[i]) for every i of the leading axis (a, b: (N, rows, cols) GEMM operands, contiguous), a
    float32 (N, M, N') array: on a GPU one cublasGemmStridedBatchedEx (16-bit inputs, float32 accumulation and
    result; blas.gemm_batched), elsewhere the array module's batched matmul."""
    if not _gemm_ex():
        return C.xp_of(a).matmul(a.transpose(0, 2, 1) if ta else a, b.transpose(0, 2, 1) if tb else b)
    return blas.gemm_batched(a, b, ta, tb, kind=compute)


# ----------------------------------------------------------------------------------------------------------------
# linear (M1)

class LinearCache(NamedTuple):
    x2: Any          # (N, C_in) the GEMM operand of R(x2)
    w: Any           # (C_out, C_in) the GEMM operand of R(w)
    has_b: bool
    shape: tuple     # x's shape
    compute: str


_LAST_X = [None]    # (weak reference to the last x a linear read, compute, its GEMM operand)


def _shared_operand(x, x2, compute):
    """operand(x2, compute)[1], made once for consecutive linears that read the same activation x (the query, key
    and value projections: one rounding pass instead of three). The operand is read-only and ops never change an
    input in place (refbert.mixed.mark's premise), so the same x gives the same operand."""
    last = _LAST_X[0]
    if last is not None and last[0]() is x and last[1] == compute:
        return last[2]
    bits = twin_of(x, compute)                          # written beside x by the op that made it
    if bits is not None:
        return bits.reshape(x2.shape)
    _, x16 = operand(x2, compute)
    if on_grid(x, compute) and _twins_on(x):
        twin(x, x16.reshape(x.shape), compute)          # x on the grid: x16 is its storage (a later op may keep it)
    try:
        _LAST_X[0] = (weakref.ref(x), compute, x16)
    except TypeError:                                   # (an array type without weak references: no sharing)
        _LAST_X[0] = None
    return x16


def linear_forward_mixed(x, w, b=None, compute="bfloat16"):
    """out = R(x2 @ R(w)^T + R(b)) (the spec's linear) with one tensor-core GEMM; see the module docstring."""
    x = _dev(x)
    check_linear(x, w, b)
    xp = C.xp_of(w)
    x2 = x.reshape(-1, x.shape[-1])
    x16 = _shared_operand(x, x2, compute)
    _, w16 = operand(w, compute)
    out = gemm(x16, w16, False, True, compute)                          # (N, C_out) float32
    o16 = _new16(out, compute)                       # out's twin: what its reader keeps (or a linear reads) in 16 bits
    if b is None:
        _round_(out, compute, o16)
    elif C.on_device(out):
        b = xp.ascontiguousarray(b)
        args = (out, b, np.int64(out.shape[0]), np.int32(out.shape[1]), _kind(compute), _or_null(o16, xp))
        if _v2(out.shape[1], (out, b)):
            _launch("bias_round_v2", out.size // 4, args, xp)
        elif ROUND_VERSION != "1" and out.data.ptr % 16 == 0:     # rows of any length (the decoder's 30522)
            _launch("bias_round_v3", out.shape[0] * 256, args, xp)
        else:
            _launch("bias_round_v1", out.shape[0] * 256, args, xp)
    else:
        out = ops.round_compute(out + ops.round_compute(b, compute), compute)
    _ran("linear", compute, "M1")
    out = mark(out.reshape(*x.shape[:-1], w.shape[0]), compute)
    return twin(out, o16, compute), LinearCache(x16, w16, b is not None, x.shape, compute)


def linear_backward_mixed(dout, cache, dx_into=None):
    """dx = R(R(dout2) @ R(w)), dw = R(dout2)^T @ R(x2) (float32), db = column sums of R(dout2) (float32). A dout
    that a mixed op wrote (refbert.mixed.mark: on the grid) is its own R(dout2) for db: only its 16-bit operand is
    made. dx_into (refbert.ops.linear_backward; x's shape, float32): dx is returned as dx_into + R(dout2 @ R(w)),
    the spec's sum of the rounded gradient and the other paths', in one pass (add_round) into a new array (float32,
    off the grid: the next op rounds it as it reads it); dx_into itself is not changed (it may be marked on the
    grid, or have a twin)."""
    if not isinstance(cache, LinearCache):
        raise ValueError(f"linear: argument 'cache' expected the cache of the cuda backend's linear_forward_mixed, "
                         f"got {type(cache).__name__}")
    x16, w16, has_b, shape, compute = cache
    dout = _dev(dout)
    C.dout("linear", dout, (*shape[:-1], w16.shape[0]), F32)
    dout2 = dout.reshape(-1, w16.shape[0])
    bits = twin_of(dout, compute) if on_grid(dout, compute) else None
    if bits is not None:
        d32, d16 = dout2, bits.reshape(dout2.shape)      # written beside dout by the op that made it
    elif has_b and on_grid(dout, compute) and C.on_device(dout):
        d32, d16 = dout2, operand(dout2, compute)[1]     # R(dout) is dout (a mixed op's output): no float32 copy
    else:
        d32, d16 = operand(dout2, compute, want32=has_b)
    y = gemm(d16, w16, False, False, compute)                         # (N, C_in) float32
    if dx_into is None:
        dx = mark(_round_(y, compute).reshape(shape), compute)
    else:
        dx = _add_round(y, dx_into, shape, compute)
    dw = gemm(d16, x16, True, False, compute)
    return (dx, dw, _bias_grad(d32, d16, compute)) if has_b else (dx, dw)


def _bias_grad(d32, d16, compute):
    """db = the column sums of R(dout2) (float32). d16, the GEMM operand, holds R(dout2)'s values in 16 bits: where
    the float32 column sum chosen here is C1, its 16-bit twin (colsum.cu colsum16_partial_v1: the same chunks and
    order on the same values, so C1's bits) reads those 2 bytes an element instead of d32's 4."""
    if d16.dtype == np.uint16 and C.on_device(d16) and versions.choose("column_sum", F32).key == "C1":
        versions.ran("column_sum", F32, "C1")
        return column_sum16_c1(d16, int(_kind(compute)))
    return column_sum(d32)


linear_backward_mixed.dx_into = True


def _add_round(y, into, shape, compute):
    """into + R(y) as a new float32 array of `shape` (csrc/mixed.cu add_round_v2, v1 where it must)."""
    into = _dev(into)
    V.dout("linear", C.stub(into), shape, F32, name="dx_into", what="x's, the input")
    xp = C.xp_of(y)
    if not C.on_device(y):
        return into + ops.round_compute(y.reshape(shape), compute)
    acc = xp.ascontiguousarray(into).reshape(y.shape)
    out = xp.empty(y.shape, F32)
    if y.size:
        _rounding("add_round", y.size, (y, acc, np.int64(y.size), _kind(compute), out), (y, acc, out), xp)
    return out.reshape(shape)


# ----------------------------------------------------------------------------------------------------------------
# attention: the spec's arithmetic (refbert.ops.attention_forward_mixed / attention_backward_mixed)
#   S1  array operations (the array module's batched matmuls and element-wise calls): any array module, the
#       simulator's NumPy included; ~20 launches a forward, ~30 a backward
#   S2  csrc/mixed.cu's kernels around five batched GEMMs on 16-bit operands (cublasGemmStridedBatchedEx): heads
#       (R, and the (B, H, T, hs) layout, into 16-bit), attn_rows_fwd (scale, mask, row max, exp, row sum,
#       R(pt), the Philox keep-mask: one warp per score row), merge (the normalisation, R, and the (B, T, C)
#       layout), D_v1 and attn_rows_bwd (P recomputed, dS' and R(P) keep); device arrays only. heads and merge
#       run version 2 (four elements a thread) where hs is a multiple of 4 and the arrays 16-byte aligned
#       (_heads_v2), the row kernels version 2 (one Philox call per four elements) where T % 4 == 0 (_rows_v), else
#       version 1; REFBERT_CUDA_ROUND=1 pins version 1 (the same bits: csrc/mixed.cu's main)

class AttentionCache(NamedTuple):     # refbert.ops.MixedAttentionCache's fields, device arrays
    qh: Any
    kh: Any
    vh: Any
    out: Any
    m: Any
    l: Any
    keep: Any
    scale: float
    mask: Any
    dropout_p: float
    compute: str


def _scores(qh, kh, scale, mask):
    s = C.xp_of(qh).matmul(qh, kh.transpose(0, 1, 3, 2)) * np.float32(scale)     # (B, H, T, T)
    return s if mask is None else s + mask


def _keep(rng, shape, p, xp):
    """The keep-mask (bool, `shape`) of the next dropout call of rng: the chosen dropout version applied to ones
    (its elements are the oracle's: refbert.ops.dropout_mask)."""
    kept, _ = dropout_forward(xp.ones(shape, F32), p, rng, True)
    return kept != 0


def _attention_checks(q, k, v, n_heads, mask, dropout_p):
    """The spec's checks (refbert.ops.attention_forward_mixed), on any array module. -> (B, T, C, H, hs)"""
    B, T, Cw, H, hs = ops.attention_shapes(C.stub(q), C.stub(k), C.stub(v), n_heads, C.stub(mask))
    if q.dtype != F32:
        raise ValueError(f"attention: argument 'q' expected float32 (mixed precision), got {q.dtype}")
    if mask is not None:
        V.broadcasts_to("attention", "mask", C.stub(mask), (B, H, T, T))
    dropout_p = V.probability("attention", "dropout_p", dropout_p)
    return B, T, Cw, H, hs


def attention_forward_mixed(q, k, v, n_heads, mask=None, dropout_p=0.0, rng=None, train=True, compute="bfloat16"):
    """refbert.ops.attention_forward_mixed: S2 on device arrays (a GPU's, the emulator's; S3 / S4 where
    REFBERT_MIXED_ATTENTION (ATTENTION) asks and the head size is 64), S1 on NumPy's."""
    mask = _dev(mask)
    if C.on_device(q):
        C.variant("attention", "REFBERT_MIXED_ATTENTION", ATTENTION, ATTENTIONS)
        if ATTENTION in ("S3", "S4") and q.shape[-1] == 64 * int(n_heads):
            return attention_forward_s3(q, k, v, n_heads, mask, dropout_p, rng, train, compute, ATTENTION.lower())
        return attention_forward_s2(q, k, v, n_heads, mask, dropout_p, rng, train, compute)
    return attention_forward_s1(q, k, v, n_heads, mask, dropout_p, rng, train, compute)


def attention_backward_mixed(dout, cache):
    if isinstance(cache, S3Cache):
        return attention_backward_s3(dout, cache)
    if isinstance(cache, S2Cache):
        return attention_backward_s2(dout, cache)
    return attention_backward_s1(dout, cache)


def attention_probs_mixed(cache):
    if isinstance(cache, S3Cache):
        return attention_probs_s3(cache)
    if isinstance(cache, S2Cache):
        return attention_probs_s2(cache)
    return attention_probs_s1(cache)


def _check_rows(m, l=None):
    """The spec's error for a row without a finite maximum score (refbert.ops.attention_forward_mixed): on host
    arrays always, on device arrays under REFBERT_CUDA_CHECKS=1 (a read back). The kernels' row max skips a NaN
    score (fmaxf), which then shows in the row sum l: both are checked."""
    xp = C.xp_of(m)
    if C.checks_on(m) and not (bool(xp.isfinite(m).all()) and (l is None or bool(xp.isfinite(l).all()))):
        raise ValueError("attention: argument 'q' (with 'mask') expected every row to have a finite maximum score, "
                         "got a row that is entirely -inf, or a NaN/+inf score")


def attention_forward_s1(q, k, v, n_heads, mask=None, dropout_p=0.0, rng=None, train=True, compute="bfloat16"):
    """S1: refbert.ops.attention_forward_mixed's steps as array operations (see there for the arithmetic)."""
    xp = C.xp_of(q)
    B, T, Cw, H, hs = _attention_checks(q, k, v, n_heads, mask, dropout_p)
    R = lambda a: round_compute(a, compute)                           # noqa: E731
    scale = 1.0 / math.sqrt(hs)
    # (B, H, T, hs), contiguous once: every batched GEMM below then reads them (and their transposes) in place
    heads = lambda a: xp.ascontiguousarray(settle(a, compute).reshape(B, T, H, hs).transpose(0, 2, 1, 3))  # noqa
    qh, kh, vh = heads(q), heads(k), heads(v)
    s = _scores(qh, kh, scale, mask)                                  # (B, H, T, T) float32
    m = s.max(-1, keepdims=True)
    _check_rows(m)
    pt = xp.exp(s - m)
    l = pt.sum(-1, keepdims=True)                                     # (B, H, T, 1)
    p = float(dropout_p) if train else 0.0
    keep = _keep(rng, s.shape, p, xp) if p > 0 else None
    P = R(pt) if keep is None else R(pt) * keep
    rp = np.float32(1.0 / (1.0 - p)) if p < 1.0 else np.float32(0.0)
    oh = R(xp.matmul(P, vh) * ((np.float32(1.0) / l) * rp))           # (B, H, T, hs)
    out = mark(oh.transpose(0, 2, 1, 3).reshape(B, T, Cw), compute)   # (a copy: the (B, T, C) layout)
    _ran("attention", compute, "S1")
    return out, AttentionCache(qh, kh, vh, oh, m, l, keep, scale, mask, p, compute)


def attention_backward_s1(dout, cache):
    """S1: refbert.ops.attention_backward_mixed's steps as array operations."""
    if not isinstance(cache, AttentionCache):
        raise ValueError(f"attention: argument 'cache' expected the cache of the cuda backend's "
                         f"attention_forward_mixed, got {type(cache).__name__}")
    qh, kh, vh, oh, m, l, keep, scale, mask, p, compute = cache
    xp = C.xp_of(qh)
    R = lambda a: round_compute(xp.ascontiguousarray(a), compute)     # noqa: E731
    B, H, T, hs = qh.shape
    dout = _dev(dout)
    C.dout("attention", dout, (B, T, H * hs), F32)
    dO = xp.ascontiguousarray(settle(dout, compute).reshape(B, T, H, hs).transpose(0, 2, 1, 3))  # (B, H, T, hs)
    P = xp.exp(_scores(qh, kh, scale, mask) - m) / l
    kp = np.float32(1.0 - p)
    D = (dO * oh).sum(-1, keepdims=True) * kp                         # (B, H, T, 1)
    dP = xp.matmul(dO, vh.transpose(0, 1, 3, 2))                      # (B, H, T, T)
    rp = np.float32(1.0 / kp) if kp > 0 else np.float32(0.0)
    if keep is None:
        dS, Pk = P * (dP - D), R(P)
    else:
        dS, Pk = P * (dP * keep - D), R(P) * keep
    dvh = R(xp.matmul(Pk.transpose(0, 1, 3, 2), dO) * rp)
    dS = R(dS)
    g = np.float32(scale) * rp
    dqh = R(xp.matmul(dS, kh) * g)
    dkh = R(xp.matmul(dS.transpose(0, 1, 3, 2), qh) * g)
    merge = lambda a: mark(a.transpose(0, 2, 1, 3).reshape(B, T, H * hs), compute)  # noqa: E731
    return merge(dqh), merge(dkh), merge(dvh)


def attention_probs_s1(cache):
    """R(keep * P / (1 - p)) (B, H, T, T), for output_attentions."""
    qh, kh, _, _, m, l, keep, scale, mask, p, compute = cache
    P = C.xp_of(qh).exp(_scores(qh, kh, scale, mask) - m) / l
    if keep is not None:
        P = P * keep * np.float32(1.0 / (1.0 - p) if p < 1 else 0.0)
    return round_compute(P, compute)


class S2Cache(NamedTuple):
    q: Any           # (B H, T, hs) GEMM operands of R(q), R(k), R(v) (16-bit bits on a GPU, float32 values elsewhere)
    k: Any
    v: Any
    out: Any         # (B, T, C) the compute-dtype output, read back for D
    m: Any           # (B H T,) float32 row max of the scores
    l: Any           # (B H T,) float32 row sum of exp(s - m)
    mask4: Any       # the mask as a contiguous 4-D array, each axis 1 or full (float32)
    drop: Any        # (seed, stream, thresh, scale) of the keep-mask, or None
    scale: float
    p: float
    compute: str
    shape: tuple     # (B, T, H, hs)


def _rows_v(T):
    """The attention's row kernels' version: v2 (the Philox words drawn once per four elements, shared by shuffles;
    version 1's bits) where T % 4 == 0, unless REFBERT_CUDA_ROUND=1 pins version 1; else v1."""
    return "v2" if ROUND_VERSION != "1" and T % 4 == 0 else "v1"


def _warps(name, rows, args, xp):
    """A kernel with a warp per row, 8 rows a block (no grid-stride: as many blocks as it takes)."""
    if rows:
        cuda_c.kernel("mixed.cu", name, xp)((-(-rows // 8),), (256,), args)


def _buffers(xp, shape, as16):
    """(float32 values, 16-bit bits) output buffers of a kernel that writes one or the other; the unused one is a
    one-element stand-in (a kernel argument must be a device array)."""
    if as16:
        return xp.empty((1,), F32), xp.empty(shape, np.uint16)
    return xp.empty(shape, F32), xp.empty((1,), np.uint16)


def _heads(a, shape, compute, xp):
    """(B, T, H hs) -> R(a) as (B H, T, hs), a GEMM operand."""
    B, T, H, hs = shape
    as16 = _gemm_ex()
    a = xp.ascontiguousarray(a)
    f32, bits = _buffers(xp, (B * H, T, hs), as16)
    if a.size:
        args = (a, np.int64(a.size), np.int32(T), np.int32(H), np.int32(hs), _kind(compute), np.int32(as16), f32, bits)
        if _heads_v2(a.size, hs, (a, bits if as16 else f32)):
            _launch("heads_v2", a.size // 4, args, xp)
        else:
            _launch("heads_v1", a.size, args, xp)
    return bits if as16 else f32


def _heads_v2(n, hs, arrays):
    """heads_v2 / merge_v2 (four elements of a head's row a thread, 32-bit index arithmetic) apply: a rounding
    kernel's version 2 would (_v2) on rows of hs, and n / 4 fits in 31 bits."""
    return _v2(hs, arrays) and n // 4 < 2 ** 31


def _merge(y, shape, l, g, compute, xp):
    """(B H, T, hs) float32 -> R(y f) as (B, T, H hs), f = (1 / l) g per row when l is given, else g; marked, with
    its twin (the bits the linear after it reads) where GEMM operands are 16-bit."""
    B, T, H, hs = shape
    out = xp.empty((B, T, H * hs), F32)
    o16 = _new16(out, compute)
    if out.size:
        args = (y, np.int64(out.size), np.int32(T), np.int32(H), np.int32(hs), y if l is None else l,
                np.int32(l is not None), np.float32(g), _kind(compute), out, _or_null(o16, xp))
        if _heads_v2(out.size, hs, (y, out) if o16 is None else (y, out, o16)):
            _launch("merge_v2", out.size // 4, args, xp)
        else:
            _launch("merge_v1", out.size, args, xp)
    return twin(mark(out, compute), o16, compute)


def _kept_out(out, compute):
    """What the attention cache keeps of its output for D (the backward's row sums of dO o O): the output's twin
    (16-bit storage) where it has one, else the float32 output."""
    bits = twin_of(out, compute)
    return out if bits is None else bits


def _D(dout, out, shape, kp, compute, xp):
    """D = rowsum(R(dO) o O) (1 - p) per (b, h, t), (B H T,) float32 (csrc/mixed.cu D_v1): dout and out (B, T, C),
    out float32 or its 16-bit storage (_kept_out)."""
    B, T, H, hs = shape
    rows = B * H * T
    D = xp.empty(rows, F32)
    o32, o16 = _in16(out, xp)
    _warps("D_v1", rows, (dout, o32, np.int64(rows), np.int32(T), np.int32(H), np.int32(hs), kp, _kind(compute), D,
                          o16), xp)
    return D


def _mask_args(mask4):
    return (mask4, *_mask_strides(mask4))


def attention_forward_s2(q, k, v, n_heads, mask=None, dropout_p=0.0, rng=None, train=True, compute="bfloat16"):
    """S2: the spec's attention forward with csrc/mixed.cu's kernels and batched 16-bit GEMMs (see above)."""
    xp = C.xp_of(q)
    B, T, Cw, H, hs = _attention_checks(q, k, v, n_heads, mask, dropout_p)
    p = float(dropout_p) if train else 0.0
    drop = draw(rng, dropout_p, train, "attention") if p > 0 else None
    shape, rows, as16 = (B, T, H, hs), B * H * T, _gemm_ex()
    qh, kh, vh = (_heads(a, shape, compute, xp) for a in (q, k, v))
    s = gemm_batched(qh, kh, False, True, compute)                    # (B H, T, T) float32
    mask4 = xp.ascontiguousarray(_mask4(xp, mask, B, H, T, F32).astype(F32))
    P32, P16 = _buffers(xp, (B * H, T, T), as16)
    m, l = xp.empty(rows, F32), xp.empty(rows, F32)
    seed, stream, thresh = drop[:3] if drop is not None else (np.uint64(0),) * 3
    _warps(f"attn_rows_fwd_{_rows_v(T)}", rows, (s, *_mask_args(mask4), np.int64(rows), np.int32(H), np.int32(T),
                                                 np.float32(1.0 / math.sqrt(hs)), seed, stream, thresh,
                                                 _kind(compute), np.int32(as16), P32, P16, m, l), xp)
    _check_rows(m, l)
    O = gemm_batched(P16 if as16 else P32, vh, False, False, compute)  # (B H, T, hs) float32
    rp = np.float32(1.0 / (1.0 - p)) if p < 1.0 else np.float32(0.0)
    out = _merge(O, shape, l, rp, compute, xp)
    _ran("attention", compute, "S2")
    return out, S2Cache(qh, kh, vh, _kept_out(out, compute), m, l, mask4, drop, 1.0 / math.sqrt(hs), p, compute,
                        shape)


def attention_backward_s2(dout, cache):
    """S2: the spec's attention backward (refbert.ops.attention_backward_mixed) with csrc/mixed.cu's kernels."""
    qh, kh, vh, out, m, l, mask4, drop, scale, p, compute, shape = cache
    xp = C.xp_of(qh)
    B, T, H, hs = shape
    dout = _dev(dout)
    C.dout("attention", dout, (B, T, H * hs), F32)
    rows, as16 = B * H * T, _gemm_ex()
    dO = _heads(dout, shape, compute, xp)
    kp = np.float32(1.0 - p)
    D = _D(xp.ascontiguousarray(dout), out, shape, kp, compute, xp)
    s = gemm_batched(qh, kh, False, True, compute)                    # (B H, T, T)
    dP = gemm_batched(dO, vh, False, True, compute)                   # (B H, T, T)
    dS32, dS16 = _buffers(xp, (B * H, T, T), as16)
    Pk32, Pk16 = _buffers(xp, (B * H, T, T), as16)
    seed, stream, thresh = drop[:3] if drop is not None else (np.uint64(0),) * 3
    _warps(f"attn_rows_bwd_{_rows_v(T)}", rows, (s, dP, *_mask_args(mask4), np.int64(rows), np.int32(H),
                                                 np.int32(T), np.float32(scale), seed, stream, thresh, m, l, D,
                                                 _kind(compute), np.int32(as16), dS32, dS16, Pk32, Pk16), xp)
    dS, Pk = (dS16, Pk16) if as16 else (dS32, Pk32)
    rp = np.float32(1.0) / kp if kp > 0 else np.float32(0.0)
    g = np.float32(scale) * rp
    dv = _merge(gemm_batched(Pk, dO, True, False, compute), shape, None, rp, compute, xp)
    dq = _merge(gemm_batched(dS, kh, False, False, compute), shape, None, g, compute, xp)
    dk = _merge(gemm_batched(dS, qh, True, False, compute), shape, None, g, compute, xp)
    return dq, dk, dv


def attention_probs_s2(cache):
    """R(keep * P / (1 - p)) (B, H, T, T) from S2's cache (array operations: output_attentions only)."""
    qh, kh, _, _, m, l, mask4, drop, scale, p, compute, (B, T, H, hs) = cache
    xp = C.xp_of(qh)
    s = gemm_batched(qh, kh, False, True, compute).reshape(B, H, T, T)
    P = xp.exp(s * np.float32(scale) + mask4 - m.reshape(B, H, T, 1)) / l.reshape(B, H, T, 1)
    if drop is not None:
        keep = _dropout_apply(xp.ones(P.shape, F32), drop) != 0
        P = P * keep * np.float32(1.0 / (1.0 - p) if p < 1 else 0.0)
    return round_compute(xp.ascontiguousarray(P), compute)


# ----------------------------------------------------------------------------------------------------------------
# attention S3: csrc/mixed.cu's tensor-core flash kernels (hs = 64): the spec's rounding sites (float32 noise apart:
# sum order, the tensor cores' accumulation, exp's last bits, as S2), no (B, H, T, T) array, q / k / v / dout
# rounded into 16-bit storage by round16 first. Chosen by REFBERT_MIXED_ATTENTION=S3 (head
# size 64, device arrays); S2 otherwise: on the H200 (2026-11-27, commit 2f0feb7, the bench's mixed section) the
# bf16-mixed graph step took 18.1 (S3) and 17.9 ms (S4) against S2's 16.9 at B=32 T=128, 27 and 25.1 against 21 ms
# at B=8 T=512. S4 (REFBERT_MIXED_ATTENTION=S4): S3's kernels drawing dropout's words a Philox call per 4 scores
# (csrc/mixed.cu s4_*): S3's bits.

ATTENTION = C.variant_env("REFBERT_MIXED_ATTENTION")   # "S3" / "S4": the flash kernels where they apply
ATTENTIONS = ("S2", "S3", "S4")


class S3Cache(NamedTuple):
    q: Any           # (B, T, C) R(q), R(k), R(v) in 16-bit storage
    k: Any
    v: Any
    out: Any         # (B, T, C) the compute-dtype output (float32 values), read back for D
    m: Any           # (B H T,) float32 row max of the scores
    l: Any           # (B H T,) float32 row sum of exp(s - m)
    mask4: Any
    drop: Any
    scale: float
    p: float
    compute: str
    shape: tuple     # (B, T, H, hs)
    kernels: str = "s3"   # "s3" / "s4": csrc/mixed.cu's kernels of that name (S4: S3's bits)


def _storage16(x, compute):
    """R(x) in 16-bit storage, (x's shape): round16 (the kernels' __nv_bfloat16 / __half operands). The emulator
    checks a pointer's dtype: there the bits are viewed as ml_dtypes' bfloat16 or NumPy's float16."""
    xp = C.xp_of(x)
    bits = twin_of(x, compute)                         # written beside x by the op that made it
    if bits is None:
        x = xp.ascontiguousarray(x)
        bits = xp.empty(x.shape, np.uint16)
        if x.size:
            _rounding("round16", x.size, (x, np.int64(x.size), _kind(compute), np.int32(0), x, bits), (x, bits),
                      xp)
    if versions.MODE != "gpu":
        from ml_dtypes import bfloat16
        return bits.view(bfloat16 if compute == "bfloat16" else np.float16)
    return bits


def _s3(name, compute, grid, args, xp):
    fn = f"{name}_{'bf16' if compute == 'bfloat16' else 'f16'}"
    cuda_c.kernel("mixed.cu", fn, xp)(grid, (128,), args)


def attention_forward_s3(q, k, v, n_heads, mask=None, dropout_p=0.0, rng=None, train=True, compute="bfloat16",
                         kernels="s3"):
    """S3: the spec's attention forward as one tensor-core flash kernel (csrc/mixed.cu s3_fwd; see above).
    kernels="s4": S4's (s4_fwd: a Philox call per 4 scores; S3's bits), and S4's backward after it."""
    if kernels not in ("s3", "s4"):
        raise ValueError(f"attention_forward_s3: argument 'kernels' expected 's3' or 's4', got {kernels!r}")
    xp = C.xp_of(q)
    B, T, Cw, H, hs = _attention_checks(q, k, v, n_heads, mask, dropout_p)
    C.heads_grid("attention", B, H)
    p = float(dropout_p) if train else 0.0
    drop = draw(rng, dropout_p, train, "attention") if p > 0 else None
    q16, k16, v16 = (_storage16(a, compute) for a in (q, k, v))
    mask4 = xp.ascontiguousarray(_mask4(xp, mask, B, H, T, F32).astype(F32))
    out = xp.empty((B, T, Cw), F32)
    o16 = _new16(out, compute)
    m, l = xp.empty(B * H * T, F32), xp.empty(B * H * T, F32)
    seed, stream, thresh = drop[:3] if drop is not None else (np.uint64(0),) * 3
    rp = np.float32(1.0 / (1.0 - p)) if p < 1.0 else np.float32(0.0)
    scale = 1.0 / math.sqrt(hs)
    if out.size:
        _s3(f"{kernels}_fwd", compute, (-(-T // 64), B * H), (q16, k16, v16, *_mask_args(mask4), np.int32(T),
                                                              np.int32(H), np.float32(scale), seed, stream, thresh,
                                                              _kind(compute), rp, out, _or_null(o16, xp), m, l), xp)
    _check_rows(m, l)
    _ran("attention", compute, kernels.upper())
    cache = S3Cache(q16, k16, v16, _kept_out(out, compute), m, l, mask4, drop, scale, p, compute, (B, T, H, hs),
                    kernels)
    return twin(mark(out, compute), o16, compute), cache


def attention_backward_s3(dout, cache):
    """S3: the spec's attention backward as two tensor-core flash kernels (s3_dkdv per key tile, s3_dq per query
    tile), D by D_v1 as S2; S4's (s4_dkdv, s4_dq) where the forward ran S4."""
    q16, k16, v16, out, m, l, mask4, drop, scale, p, compute, shape, kernels = cache
    xp = C.xp_of(out)
    B, T, H, hs = shape
    dout = _dev(dout)
    C.dout("attention", dout, (B, T, H * hs), F32)
    dout = xp.ascontiguousarray(dout)
    kp = np.float32(1.0 - p)
    D = _D(dout, out, shape, kp, compute, xp)
    d16 = _storage16(dout, compute)
    rp = np.float32(1.0) / kp if kp > 0 else np.float32(0.0)
    g = np.float32(scale) * rp
    seed, stream, thresh = drop[:3] if drop is not None else (np.uint64(0),) * 3
    dq, dk, dv = (xp.empty((B, T, H * hs), F32) for _ in range(3))
    dq16, dk16, dv16 = (_new16(a, compute) for a in (dq, dk, dv))
    common = (q16, k16, v16, *_mask_args(mask4), np.int32(T), np.int32(H), np.float32(scale), seed, stream, thresh,
              _kind(compute), m, l, d16, D)
    if dq.size:
        _s3(f"{kernels}_dkdv", compute, (-(-T // 64), B * H), common + (rp, g, dk, dv, _or_null(dk16, xp),
                                                                           _or_null(dv16, xp)), xp)
        _s3(f"{kernels}_dq", compute, (-(-T // 64), B * H), common + (g, dq, _or_null(dq16, xp)), xp)
    return tuple(twin(mark(a, compute), a16, compute) for a, a16 in ((dq, dq16), (dk, dk16), (dv, dv16)))


def _values16(a16, compute):
    """float32 values of 16-bit storage."""
    bits = a16.view(np.uint16)
    if compute == "bfloat16":
        return (bits.astype(np.uint32) << np.uint32(16)).view(F32)
    return bits.view(np.float16).astype(F32)


def attention_probs_s3(cache):
    """R(keep * P / (1 - p)) (B, H, T, T) from S3's cache (array operations: output_attentions only)."""
    q16, k16, _, _, m, l, mask4, drop, scale, p, compute, (B, T, H, hs), _ = cache
    xp = C.xp_of(m)
    qh, kh = (_values16(a, compute).reshape(B, T, H, hs).transpose(0, 2, 1, 3) for a in (q16, k16))
    s = xp.matmul(qh, kh.transpose(0, 1, 3, 2))
    P = xp.exp(s * np.float32(scale) + mask4 - m.reshape(B, H, T, 1)) / l.reshape(B, H, T, 1)
    if drop is not None:
        keep = _dropout_apply(xp.ones(P.shape, F32), drop) != 0
        P = P * keep * np.float32(1.0 / (1.0 - p) if p < 1 else 0.0)
    return round_compute(xp.ascontiguousarray(P), compute)


# ----------------------------------------------------------------------------------------------------------------
# the fused ops with the rounding inside the kernel (K1): the CUDA C version (layernorm.cu v2, gelu.cu v1) with
# rk = the compute dtype: every compute-dtype value it reads (x, a, dout, and the parameters w, b: R(master)) is
# rounded as it is loaded, every activation or activation gradient it writes as it is stored; statistics (mean,
# rstd), the float32 sums inside and the parameter gradients (dw, db: bias_gelu's db sums the float32 du before
# its rounding) stay float32: the generic rule's arithmetic (refbert.mixed) without its separate rounding passes.
# Where the CUDA C version does not apply (NumPy arrays: the simulator; a dtype other than float32), the generic
# rule around the backend's float32 op instead.

class Fused(NamedTuple):
    """A fused mixed op's cache: how its forward ran ("K1": the kernel rounds; "rule": refbert.mixed's rule around
    the float32 op; "gather": the embedding's rows rounded after the lookup), that path's cache, the compute dtype."""
    how: str
    cache: Any
    compute: str


@functools.lru_cache(maxsize=None)
def _rule(name, compute):
    """refbert.mixed's generic rule around this backend's float32 op `name` (forward or backward)."""
    from refbert import mixed as MX
    backend = _backend()
    R = MX.rounder(backend, compute)
    wrap = MX.wrap_forward if name.endswith("_forward") else MX.wrap_backward
    return wrap(getattr(backend, name), name, compute, R)


def _k1_ok(*arrays):
    return _c_ok(*arrays) and arrays[0].ndim >= 1


def _k1(op, compute):
    _ran(op, compute, "K1")
    return int(_kind(compute))


def _keep_ln(cache, kx, ka):
    """Version C2's cache with x and a (where kept: kx, ka not None) as their 16-bit storage: the float32 arrays
    are no longer held, and the backward kernels read 2 bytes an element where they read 4."""
    if kx is not None:
        cache = cache._replace(x2=kx.reshape(cache.x2.shape))
    if ka is not None and cache.a2 is not None:
        cache = cache._replace(a2=ka.reshape(cache.a2.shape))
    return cache


def _keep_gelu(cache, kx):
    """The GELU cache with x as its 16-bit storage (kx not None): see _keep_ln."""
    return cache if kx is None else cache._replace(x2=kx.reshape(cache.x2.shape))


def layernorm_forward_mixed(x, w, b, eps=1e-12, compute="bfloat16"):
    if not _k1_ok(x, w, b):
        out, cache = _rule("layernorm_forward", compute)(x, w, b, eps)
        return out, Fused("rule", cache, compute)
    _check_ln(x, w, b, eps)
    o16 = _new16(x, compute)
    (kx, wx) = _kept16(x, compute)
    out, cache = _ln2_forward("ln", x, None, w, b, eps, None, _k1("layernorm", compute), o16=o16, k16=(wx, None))
    return twin(mark(out, compute), o16, compute), Fused("K1", _keep_ln(cache, kx, None), compute)


# which layernorm.cu forward the residual and dropout + residual kinds run in mixed precision: version 3 (the row in
# registers: x, a read and the keep factors drawn once; version 2's bits) unless REFBERT_MIXED_LN=2. The H200's
# layernorm main (2026-11-27, 2f0feb7, 2048 x 768) timed the forward's bf16-mixed bodies at 0.0116 / 0.0133 ms
# (version 3, res / drop) against 0.0123 / 0.0165 (version 2), fp16-mixed 0.0117 / 0.0128 against 0.0125 / 0.0161;
# the plain kind was as fast either way (0.0092 against 0.0090) and keeps version 2. Not yet timed in a whole step.
MIXED_LN = C.variant_env("REFBERT_MIXED_LN")


def _mixed_ln_version():
    if MIXED_LN not in ("2", "3"):
        raise ValueError(f"layernorm: REFBERT_MIXED_LN expected 2 or 3, got {MIXED_LN!r}")
    return int(MIXED_LN)


def residual_layernorm_forward_mixed(x, a, w, b, eps=1e-12, compute="bfloat16"):
    if not _k1_ok(x, a, w, b):
        out, cache = _rule("residual_layernorm_forward", compute)(x, a, w, b, eps)
        return out, Fused("rule", cache, compute)
    C.floats("residual_layernorm", x=x, a=a)
    V.shape("residual_layernorm", "a", C.stub(a), x.shape, "(same as x)")
    _check_ln(x, w, b, eps)
    o16 = _new16(x, compute)
    (kx, wx), (ka, wa) = _kept16(x, compute), _kept16(a, compute)
    out, cache = _ln2_forward("res", x, a, w, b, eps, None, _k1("residual_layernorm", compute), o16=o16,
                              k16=(wx, wa), version=_mixed_ln_version())
    return twin(mark(out, compute), o16, compute), Fused("K1", _keep_ln(cache, kx, ka), compute)


def dropout_residual_layernorm_forward_mixed(x, a, w, b, eps=1e-12, p=0.0, rng=None, train=True,
                                             compute="bfloat16"):
    if not _k1_ok(x, a, w, b):
        out, cache = _rule("dropout_residual_layernorm_forward", compute)(x, a, w, b, eps, p, rng, train)
        return out, Fused("rule", cache, compute)
    C.floats("dropout_residual_layernorm", x=x, a=a)
    V.shape("dropout_residual_layernorm", "a", C.stub(a), x.shape, "(same as x)")
    C.floats("dropout", x=a)
    drop = draw(rng, p, train)                       # the oracle draws the stream before layernorm's checks
    _check_ln(x, w, b, eps)
    o16 = _new16(x, compute)
    (kx, wx), (ka, wa) = _kept16(x, compute), _kept16(a, compute)
    out, cache = _ln2_forward("res" if drop is None else "drop", x, a, w, b, eps, drop,
                              _k1("dropout_residual_layernorm", compute), o16=o16, k16=(wx, wa),
                              version=_mixed_ln_version())
    return twin(mark(out, compute), o16, compute), Fused("K1", _keep_ln(cache, kx, ka), compute)


def embedding_forward_mixed(ids, w, padding_idx=None, compute="bfloat16"):
    """The spec's embedding, R(w)[ids] (the rule rounds the table, then gathers), as R(w[ids]): rounding is element
    by element, so it commutes with the gather and the bits are the same, with one rounding pass over the B T rows
    gathered instead of the V rows of the table (BERT-base's words: 23M elements a forward, against 3M at B=32
    T=128). The backward is the rule's (dout rounded on entry; dw a parameter's gradient, float32)."""
    backend = _backend()
    if not C.on_device(w):
        out, cache = _rule("embedding_forward", compute)(ids, w, padding_idx)
        return out, Fused("rule", cache, compute)
    out, cache = backend.embedding_forward(ids, w, padding_idx)       # w[ids]: a new array, float32
    out = _round_(C.xp_of(out).ascontiguousarray(out), compute)
    return mark(out, compute), Fused("gather", cache, compute)


def embedding_backward_mixed(dout, cache):
    how, inner, compute = _fused_cache("embedding", cache)
    return _rule("embedding_backward", compute)(dout, inner)


# which gelu.cu forward the mixed GELUs run: version 1 unless REFBERT_MIXED_GELU_FWD=3 (a grid-stride loop of 8
# resident blocks an SM, the next groups prefetched into L2 during this one's arithmetic: version 1's bits, the twin
# and the 16-bit x included; the float32 gelu C2's / bias_gelu C3's kernel). Written 2026-12-07 from the SASS, not
# yet timed on a GPU: the bench's mixed A/B row "GELU forward v3" times it
MIXED_GELU_FWD = C.variant_env("REFBERT_MIXED_GELU_FWD")


def _gelu_fwd(op):
    return int(C.variant(op, "REFBERT_MIXED_GELU_FWD", MIXED_GELU_FWD, ("1", "3")))


def gelu_forward_mixed(x, approximate="none", compute="bfloat16"):
    if not _k1_ok(x):
        out, cache = _rule("gelu_forward", compute)(x, approximate)
        return out, Fused("rule", cache, compute)
    C.floats("gelu", x=x)
    _check_approximate(approximate)
    kx, wx = _kept16(x, compute)
    out, cache = _gelu_run(x, None, approximate, _k1("gelu", compute), k16=wx, fwd=_gelu_fwd("gelu"))
    return mark(out, compute), Fused("K1", _keep_gelu(cache, kx), compute)


def bias_gelu_forward_mixed(x, b, approximate="none", compute="bfloat16"):
    if not _k1_ok(x, b):
        out, cache = _rule("bias_gelu_forward", compute)(x, b, approximate)
        return out, Fused("rule", cache, compute)
    C.floats("bias_gelu", x=x, b=b)
    V.min_ndim("bias_gelu", "x", x, 1, "(..., I)")
    V.shape("bias_gelu", "b", C.stub(b), (x.shape[-1],), "(I,)")
    _check_approximate(approximate)
    o16 = _new16(x, compute)
    kx, wx = _kept16(x, compute)
    out, cache = _gelu_run(x, b, approximate, _k1("bias_gelu", compute), o16=o16, k16=wx, fwd=_gelu_fwd("bias_gelu"))
    return twin(mark(out, compute), o16, compute), Fused("K1", _keep_gelu(cache, kx), compute)


def cross_entropy_forward_mixed(logits, labels, ignore_index=-100, compute="bfloat16"):
    """The spec's cross-entropy (refbert.mixed's rule: R(logits) in, the float32 loss out) with CUDA C version 2's
    forward; its cache keeps the logits' twin (16-bit storage) where they have one (a linear's output does), so the
    float32 logits (B T V in HF's full-logits mode) are not held for the backward."""
    logits = _dev(logits)
    if not _k1_ok(logits):
        loss, cache = _rule("cross_entropy_forward", compute)(logits, labels, ignore_index)
        return loss, Fused("rule", cache, compute)
    logits = settle(logits, compute)                 # R(logits): a mixed op's output is on the grid already
    loss, cache = _ce_forward("C2", logits, labels, ignore_index)
    bits = twin_of(logits, compute)
    if bits is not None:
        cache = cache._replace(z2=bits.reshape(cache.z2.shape))
    _k1("cross_entropy", compute)
    return loss, Fused("K1", cache, compute)


def cross_entropy_backward_mixed(dloss, cache):
    """dz = R((softmax - onehot) dloss / n), rounded in the kernel (cross_entropy.cu ce_bwd_v1 with rk) with its
    twin beside it (the decoder's GEMM operand); dloss stays float32 (a loss's gradient)."""
    how, inner, compute = _fused_cache("cross_entropy", cache)
    if how == "rule":
        return _rule("cross_entropy_backward", compute)(dloss, inner)
    o16 = _new16(inner.z2, compute)
    dz = cross_entropy_backward_c1(dloss, inner, rk=int(_kind(compute)), o16=o16)
    return twin(mark(dz, compute), o16, compute)


def _fused_cache(op, cache):
    if not isinstance(cache, Fused):
        raise ValueError(f"{op}: argument 'cache' expected the cache of the cuda backend's {op}_forward_mixed, "
                         f"got {type(cache).__name__}")
    return cache


# which layernorm.cu backward the mixed layernorms run: version 2's dx kernel and version 3's dw, db partials unless
# REFBERT_MIXED_LN_BWD=6 (dx, da and the partials in one pass over dout, x, a; dx, da version 2's bits, dw, db
# summed in another order: the float32 C4's backward, whose mixed bodies take rk at run time). Version 6 is the
# faster in float32 (H200, 2026-11-28, d9453d2: 0.0185 / 0.021 / 0.0218 device ms at (2048, 768) against 0.0238 /
# 0.0295 / 0.0332) but not in the mixed bodies (6d0eeea: the dropout kind's bf16 backward 0.0233 + 0.0040 ms
# against 0.0123 + 0.0117, its fp16 0.0291 + 0.0040 against 0.0131 + 0.0132; the bf16-mixed graph step at B=32
# T=128 17.85 ms with version 6, 17.06 ms with version 2): most likely the run-time rounding (version 2 has a body
# per rk). The bench's mixed A/B row "layernorm backward v6" times it
MIXED_LN_BWD = C.variant_env("REFBERT_MIXED_LN_BWD")


def _ln_bwd_fused():
    return C.variant("layernorm", "REFBERT_MIXED_LN_BWD", MIXED_LN_BWD, ("2", "6")) == "6"


def layernorm_backward_mixed(dout, cache):
    how, inner, compute = _fused_cache("layernorm", cache)
    if how == "rule":
        return _rule("layernorm_backward", compute)(dout, inner)
    dx, _, dw, db = _ln2_backward(_dev(dout), inner, fused=_ln_bwd_fused())
    return mark(dx, compute), dw, db


def residual_layernorm_backward_mixed(dout, cache):
    how, inner, compute = _fused_cache("residual_layernorm", cache)
    if how == "rule":
        return _rule("residual_layernorm_backward", compute)(dout, inner)
    ds, _, dw, db = _ln2_backward(_dev(dout), inner, fused=_ln_bwd_fused())
    ds = mark(ds, compute)
    return ds, ds, dw, db                            # the sum copies ds to both inputs: one array, as the oracle


def dropout_residual_layernorm_backward_mixed(dout, cache):
    how, inner, compute = _fused_cache("dropout_residual_layernorm", cache)
    if how == "rule":
        return _rule("dropout_residual_layernorm_backward", compute)(dout, inner)
    dout = _dev(dout)
    o16 = _new16(dout, compute)                      # da's twin (kind drop), else ds's: da feeds a linear
    ds, da, dw, db = _ln2_backward(dout, inner, o16=o16, fused=_ln_bwd_fused())
    if da is None:
        return mark(ds, compute), twin(mark(ds.copy(), compute), o16, compute), dw, db
    return mark(ds, compute), twin(mark(da, compute), o16, compute), dw, db


def gelu_backward_mixed(dout, cache):
    how, inner, compute = _fused_cache("gelu", cache)
    if how == "rule":
        return _rule("gelu_backward", compute)(dout, inner)
    return mark(gelu_backward_c1(_dev(dout), inner), compute)


# which gelu.cu backward the mixed bias + GELU runs: version 1 unless REFBERT_MIXED_GELU_BWD=2 (a thread per (chunk,
# 4 columns), 4 rows of loads at a time: version 1's bits, the twin and the 16-bit x included; the float32 C2's
# kernel). Written 2026-11-28 from the SASS, not yet timed on a GPU (version 1's was 5.5% of the bf16-mixed graph
# step's GPU time on the H200): the bench's mixed A/B row "bias_gelu backward v2" times it
MIXED_GELU_BWD = C.variant_env("REFBERT_MIXED_GELU_BWD")


def bias_gelu_backward_mixed(dout, cache):
    how, inner, compute = _fused_cache("bias_gelu", cache)
    if how == "rule":
        return _rule("bias_gelu_backward", compute)(dout, inner)
    dout = _dev(dout)
    o16 = _new16(dout, compute)
    version = int(C.variant("bias_gelu", "REFBERT_MIXED_GELU_BWD", MIXED_GELU_BWD, ("1", "2")))
    dx, db = bias_gelu_backward_c1(dout, inner, o16=o16, version=version)
    return twin(mark(dx, compute), o16, compute), db
