"""The whole BERT in NumPy: embeddings, post-LN encoder, pooler and every head, with a hand-written backward.

Everything is built from the op pairs of refbert.ops (or a backend with the same names): each block below is a
`<block>_forward(P, name, ...) -> (out, cache)` / `<block>_backward(dout, cache, grads) -> dinput` pair that reads
its parameters from the dict P and adds its parameter gradients to `grads` under the same names. The classes at
the bottom wire blocks together with Hugging Face's class names, argument names, output fields and semantics.

Parameters (HF names and layouts; heads prefix the encoder with "bert."; V vocab, P max positions, S segment
types, C hidden, I intermediate, L layers, K labels):

    embeddings.word_embeddings.weight                    (V, C)   lookup; row pad_token_id gets no gradient
    embeddings.position_embeddings.weight                (P, C)   learned absolute positions
    embeddings.token_type_embeddings.weight              (S, C)   segment A / B
    embeddings.LayerNorm.{weight,bias}                   (C,)
    encoder.layer.{l}.attention.self.{query,key,value}.weight (C, C), .bias (C,)
    encoder.layer.{l}.attention.output.dense.weight      (C, C), .bias (C,)
    encoder.layer.{l}.attention.output.LayerNorm.{weight,bias} (C,)
    encoder.layer.{l}.intermediate.dense.weight          (I, C), .bias (I,)
    encoder.layer.{l}.output.dense.weight                (C, I), .bias (C,)
    encoder.layer.{l}.output.LayerNorm.{weight,bias}     (C,)
    pooler.dense.weight                                  (C, C), .bias (C,)   tanh(dense(h[:, 0]))
    cls.predictions.transform.dense.weight               (C, C), .bias (C,)   MLM: dense -> act -> LayerNorm
    cls.predictions.transform.LayerNorm.{weight,bias}    (C,)
    cls.predictions.bias                                 (V,)     decoder weight = word_embeddings.weight (tied)
    cls.seq_relationship.weight                          (2, C), .bias (2,)   NSP: 0 = "B follows A", 1 = random
    classifier.weight                                    (K, C), .bias (K,)   sequence/token classification
    qa_outputs.weight                                    (2, C), .bias (2,)   QA start/end logits

References: Devlin et al. 2019 (arXiv:1810.04805); HF transformers models/bert/modeling_bert.py.
"""
import contextlib
import inspect
from typing import NamedTuple

import numpy as np

from .backends import get_backend as _backend
from .mixed import MixedOps, compute_dtype, mixed_ops
from .philox import DropoutRNG
from . import validate as V
from .config import BertConfig


BACKENDS = ("numpy", "numba", "cuda")


def get_backend(name):
    """The namespace whose <op>_forward/<op>_backward the model calls (a refbert.backends.Backend): "numpy" is the
    oracle, refbert.ops; "numba" is refbert_kernels.backend, the fused CPU kernels with the same names, signatures
    and semantics (matmuls stay on NumPy's BLAS), which needs the `kernels` extra; "cuda" is
    refbert_kernels.cuda.backend, the same on a GPU (CuPy arrays, cuBLAS matmuls, Numba CUDA kernels; the `cuda`
    extra), or on NumPy under Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1). A module object or a path to a .py
    file is a backend too: the ops it defines are its, a composed op it does not define is composed from its basic
    ops, the rest are the oracle's (refbert.backends; `model.ops.describe()` says which). A backend may define
    to_device / to_host: the model then keeps its parameters where to_device puts them, and its outputs stay there
    (refbert.model.to_numpy brings them back)."""
    return _backend(name)


def to_device(ops, params):
    """{name: array} moved to where the backend `ops` keeps its arrays (its to_device; the NumPy backends: as is)."""
    move = getattr(ops, "to_device", None)
    return params if move is None else {k: move(v) for k, v in params.items()}


def to_numpy(x):
    """NumPy copies of a device backend's arrays ("cuda": CuPy arrays), through dicts, tuples, lists and model
    outputs; NumPy arrays and anything else come back as they are."""
    if isinstance(x, dict):
        return type(x)({k: to_numpy(v) for k, v in x.items()})
    if isinstance(x, (tuple, list)):
        return type(x)(to_numpy(v) for v in x)
    if type(x) is not np.ndarray and hasattr(x, "__cuda_array_interface__"):   # (an emulated device array is
        return x.get() if hasattr(x, "get") else x.copy_to_host()               # a NumPy subclass: it comes too)
    return x


def _shape_of(a):
    """a for NumPy; a zero-byte NumPy stand-in with a's shape and dtype for a device array (for refbert.validate)."""
    if isinstance(a, np.ndarray) or not hasattr(a, "__cuda_array_interface__"):
        return a
    return np.broadcast_to(np.zeros((), a.dtype), a.shape)


# ----------------------------------------------------------------------------------------------------------------
# inference mode: no caches when no backward can follow

_GRAD_ENABLED = [True]


@contextlib.contextmanager
def no_grad():
    """`with refbert.no_grad(): model(...)` keeps no activations for a backward (as torch.no_grad): each layer's
    cache is dropped as soon as the layer returns, so memory stays at one layer's worth. A head's forward without
    labels keeps none either way (no loss, so no backward)."""
    before = _GRAD_ENABLED[0]
    _GRAD_ENABLED[0] = False
    try:
        yield
    finally:
        _GRAD_ENABLED[0] = before


def is_grad_enabled():
    return _GRAD_ENABLED[0]


# ----------------------------------------------------------------------------------------------------------------
# parameters: names, shapes, initialisation

def parameter_shapes(config, head="BertModel"):
    """{name: shape} in the order of torch's named_parameters() for the HF class `head` (tied decoder counted once)."""
    c = config
    C, I = c.hidden_size, c.intermediate_size
    pre = "" if head == "BertModel" else "bert."
    pooler = head in ("BertModel", "BertForPreTraining", "BertForNextSentencePrediction",
                      "BertForSequenceClassification", "BertForMultipleChoice")
    lin = lambda n, o, i: {f"{n}.weight": (o, i), f"{n}.bias": (o,)}  # noqa: E731
    ln = lambda n: {f"{n}.weight": (C,), f"{n}.bias": (C,)}  # noqa: E731
    s = {f"{pre}embeddings.word_embeddings.weight": (c.vocab_size, C),
         f"{pre}embeddings.position_embeddings.weight": (c.max_position_embeddings, C),
         f"{pre}embeddings.token_type_embeddings.weight": (c.type_vocab_size, C),
         **ln(f"{pre}embeddings.LayerNorm")}
    for l in range(c.num_hidden_layers):
        p = f"{pre}encoder.layer.{l}."
        s.update({**lin(p + "attention.self.query", C, C), **lin(p + "attention.self.key", C, C),
                  **lin(p + "attention.self.value", C, C), **lin(p + "attention.output.dense", C, C),
                  **ln(p + "attention.output.LayerNorm"), **lin(p + "intermediate.dense", I, C),
                  **lin(p + "output.dense", C, I), **ln(p + "output.LayerNorm")})
    if pooler:
        s.update(lin(f"{pre}pooler.dense", C, C))
    if head in ("BertForPreTraining", "BertForMaskedLM"):
        s.update({"cls.predictions.bias": (c.vocab_size,), **lin("cls.predictions.transform.dense", C, C),
                  **ln("cls.predictions.transform.LayerNorm")})
    if head in ("BertForPreTraining", "BertForNextSentencePrediction"):
        s.update(lin("cls.seq_relationship", 2, C))
    if head in ("BertForSequenceClassification", "BertForTokenClassification"):
        s.update(lin("classifier", c.num_labels, C))
    if head == "BertForMultipleChoice":
        s.update(lin("classifier", 1, C))
    if head == "BertForQuestionAnswering":
        s.update(lin("qa_outputs", c.num_labels, C))  # HF sizes it by num_labels, which must be 2 (start, end)
    return s


def init_parameters(config, shapes, rng, dtype):
    """HF's init: weights ~ normal(0, initializer_range), biases 0, LayerNorm 1 / 0, the padding row 0.
    Drawn in float64 and cast, so a float32 and a float64 model from one seed hold the same numbers."""
    params = {}
    for name, shape in shapes.items():
        if "LayerNorm" in name:
            params[name] = (np.ones if name.endswith("weight") else np.zeros)(shape, dtype)
        elif name.endswith("bias"):
            params[name] = np.zeros(shape, dtype)
        else:
            params[name] = (rng.standard_normal(shape) * config.initializer_range).astype(dtype)
            if name.endswith("word_embeddings.weight") and config.pad_token_id is not None:
                params[name][config.pad_token_id] = 0
    return params


# ----------------------------------------------------------------------------------------------------------------
# blocks: forward/backward pairs over the parameter dict. `ctx` carries ops, dropout rng and train flag.

class _Ctx:
    """What every block needs besides its parameters: the op backend, the dropout generator, train mode, and
    whether caches are kept for a backward (`keep`)."""

    def __init__(self, ops, rng, train, keep=True):
        self.ops, self.rng, self.train, self.keep = ops, rng, train, keep

    def dropout(self, x, p):
        return self.ops.dropout_forward(x, p, self.rng, self.train)


def _add_grads(grads, name, dw, db=None):
    """Parameter gradients: set on first sight; the tied word embedding is the one place a sum happens."""
    for key, g in ((f"{name}.weight", dw), (f"{name}.bias", db)):
        if g is None:
            continue
        if key in grads:
            grads[key] += g                             # in place: backwards return fresh arrays we own
        else:
            grads[key] = g


def dense_forward(ctx, P, name, x, bias=True):
    """The HF module `name` (an nn.Linear): ops.linear_forward with its weight, and its bias unless the bias is
    fused into the next op (bias_gelu)."""
    out, cache = ctx.ops.linear_forward(x, P[name + ".weight"], P[name + ".bias"] if bias else None)
    return out, (name, cache)


def _takes_dx_into(fn):
    """fn says dx_into = True (read at every call: an A/B run may switch it) and its own signature has that
    parameter or **kwargs (a wrapper that copied the attribute through functools.wraps but takes (dout, cache)
    does not; the signature is read once per function)."""
    if not getattr(fn, "dx_into", False):
        return False
    hit = _DX_INTO.get(id(fn))
    if hit is None or hit[0] is not fn:
        try:
            params = inspect.signature(fn, follow_wrapped=False).parameters
            ok = "dx_into" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())
        except (TypeError, ValueError):
            ok = False
        hit = _DX_INTO[id(fn)] = (fn, ok)
    return hit[1]


_DX_INTO = {}


def dense_backward(ctx, dout, cache, grads, into=None):
    """The linear's backward: its parameter gradients into grads, dx returned. into: the gradient its input x has
    from its other paths, which dx is added to (returned as into + dx); a backend whose linear_backward says
    `dx_into = True` sums it in the GEMM (refbert.ops.linear_backward), any other here."""
    name, c = cache
    fn = ctx.ops.linear_backward
    if into is not None and _takes_dx_into(fn):
        dx, dw, *db = fn(dout, c, dx_into=into)
    else:
        dx, dw, *db = fn(dout, c)
        dx = dx if into is None else into + dx
    _add_grads(grads, name, dw, db[0] if db else None)
    return dx


def norm_forward(ctx, P, name, x, eps):
    """The HF module `name` (an nn.LayerNorm): ops.layernorm_forward with its weight and bias."""
    out, cache = ctx.ops.layernorm_forward(x, P[name + ".weight"], P[name + ".bias"], eps)
    return out, (name, cache)


def norm_backward(ctx, dout, cache, grads):
    name, c = cache
    dx, dw, db = ctx.ops.layernorm_backward(dout, c)
    _add_grads(grads, name, dw, db)
    return dx


def embeddings_forward(ctx, P, pre, cfg, input_ids, token_type_ids, position_ids):
    """h = dropout(LayerNorm(word[input_ids] + token_type[token_type_ids] + position[position_ids])).  (B, T, C)"""
    o = ctx.ops
    we, c_w = o.embedding_forward(input_ids, P[pre + "word_embeddings.weight"], cfg.pad_token_id)
    te, c_t = o.embedding_forward(token_type_ids, P[pre + "token_type_embeddings.weight"])
    pe, c_p = o.embedding_forward(position_ids, P[pre + "position_embeddings.weight"])
    x = we + te + pe                                    # (B, T, C): three lookups, summed
    h, c_ln = norm_forward(ctx, P, pre + "LayerNorm", x, cfg.layer_norm_eps)
    h, c_do = ctx.dropout(h, cfg.hidden_dropout_prob)
    return h, (pre, c_w, c_t, c_p, c_ln, c_do)


def embeddings_backward(ctx, dh, cache, grads):
    pre, c_w, c_t, c_p, c_ln, c_do = cache
    o = ctx.ops
    dx = norm_backward(ctx, o.dropout_backward(dh, c_do), c_ln, grads)
    # the sum sends dx unchanged to all three tables; each lookup scatters it back into its rows
    _add_grads(grads, pre + "word_embeddings", o.embedding_backward(dx, c_w))
    _add_grads(grads, pre + "token_type_embeddings", o.embedding_backward(dx, c_t))
    _add_grads(grads, pre + "position_embeddings", o.embedding_backward(dx, c_p))


class LayerCache(NamedTuple):
    """What layer_backward reads, by name (forward order)."""
    q: tuple            # query projection (dense cache)
    k: tuple
    v: tuple
    attention: tuple    # the attention core's cache (ops.attention_probs reads it for output_attentions)
    attn_out: tuple     # attention.output.dense
    ln1: tuple          # (name, dropout_residual_layernorm cache) of attention.output.LayerNorm
    ffn_in: tuple       # intermediate.dense, without its bias
    act: tuple          # (bias name, bias_gelu cache)
    ffn_out: tuple      # output.dense
    ln2: tuple          # (name, dropout_residual_layernorm cache) of output.LayerNorm


def layer_forward(ctx, P, pre, cfg, x, mask):
    """One post-LN encoder layer (B, T, C) -> (B, T, C):
        a  = attention(x W_q^T + b_q, x W_k^T + b_k, x W_v^T + b_v)   multi-head self-attention core
        h1 = LayerNorm(x + dropout(a W_o^T + b_o))                     residual, then LayerNorm (post-LN, as BERT)
        h2 = LayerNorm(h1 + dropout(gelu(h1 W_i^T + b_i) W_out^T + b_out))   feed-forward C -> I -> C
    Each LayerNorm line is one fused op (dropout_residual_layernorm); gelu(. + b_i) is bias_gelu, the linear
    before it running without its bias: the ops a fused kernel computes in one pass.
    """
    o, eps, p = ctx.ops, cfg.layer_norm_eps, cfg.hidden_dropout_prob
    q, c_q = dense_forward(ctx, P, pre + "attention.self.query", x)
    k, c_k = dense_forward(ctx, P, pre + "attention.self.key", x)
    v, c_v = dense_forward(ctx, P, pre + "attention.self.value", x)
    a, c_att = o.attention_forward(q, k, v, cfg.num_attention_heads, mask, cfg.attention_probs_dropout_prob,
                                   ctx.rng, ctx.train)
    a, c_ao = dense_forward(ctx, P, pre + "attention.output.dense", a)
    ln1 = pre + "attention.output.LayerNorm"
    h1, c_ln1 = o.dropout_residual_layernorm_forward(x, a, P[ln1 + ".weight"], P[ln1 + ".bias"], eps, p,
                                                     ctx.rng, ctx.train)
    fi = pre + "intermediate.dense"
    f, c_fi = dense_forward(ctx, P, fi, h1, bias=False)              # (B, T, I)
    f, c_act = o.bias_gelu_forward(f, P[fi + ".bias"], cfg.gelu_approximate)
    f, c_fo = dense_forward(ctx, P, pre + "output.dense", f)         # (B, T, C)
    ln2 = pre + "output.LayerNorm"
    h2, c_ln2 = o.dropout_residual_layernorm_forward(h1, f, P[ln2 + ".weight"], P[ln2 + ".bias"], eps, p,
                                                     ctx.rng, ctx.train)
    return h2, LayerCache(c_q, c_k, c_v, c_att, c_ao, (ln1, c_ln1), c_fi, (fi, c_act), c_fo, (ln2, c_ln2))


def layer_backward(ctx, dh2, cache, grads):
    c = cache
    o = ctx.ops
    ln2, c_ln2 = c.ln2
    dh1, df, dw, db = o.dropout_residual_layernorm_backward(dh2, c_ln2)   # dh1: the skip's share
    _add_grads(grads, ln2, dw, db)
    df = dense_backward(ctx, df, c.ffn_out, grads)
    fi, c_act = c.act
    df, db_i = o.bias_gelu_backward(df, c_act)
    _add_grads(grads, fi, None, db_i)
    dh1 = dense_backward(ctx, df, c.ffn_in, grads, into=dh1)   # h1 fed both the skip and the feed-forward: sum
    ln1, c_ln1 = c.ln1
    dx, da, dw, db = o.dropout_residual_layernorm_backward(dh1, c_ln1)
    _add_grads(grads, ln1, dw, db)
    da = dense_backward(ctx, da, c.attn_out, grads)
    dq, dk, dv = o.attention_backward(da, c.attention)
    # x fed the skip and all three projections: four paths, summed in this order, ((dx + dx_q) + dx_k) + dx_v
    dx = dense_backward(ctx, dq, c.q, grads, into=dx)
    dx = dense_backward(ctx, dk, c.k, grads, into=dx)
    return dense_backward(ctx, dv, c.v, grads, into=dx)


def pooler_forward(ctx, P, pre, h):
    """pooled = tanh(h[:, 0] W^T + b): the [CLS] position.  (B, T, C) -> (B, C)"""
    z, c_d = dense_forward(ctx, P, pre + "pooler.dense", h[:, 0])
    out, c_t = ctx.ops.tanh_forward(z)
    return out, (h.shape, c_d, c_t)


def pooler_backward(ctx, dout, cache, grads):
    shape, c_d, c_t = cache
    dh = np.zeros_like(dout, shape=shape)               # only position 0 was read (zeros_like: any array library)
    dh[:, 0] = dense_backward(ctx, ctx.ops.tanh_backward(dout, c_t), c_d, grads)
    return dh


MLM_DECODE = ("all", "labelled")


def mlm_head_forward(ctx, P, cfg, h, word_emb_name, labels, decode="all", pad_rows=None):
    """The MLM head and its loss. transform(h) = LayerNorm(gelu(h W_t^T + b_t)); logits = transform(h) E^T + bias,
    with E the word embeddings (tied).  h: (B, T, C), labels: (B, T) with -100 where no prediction is asked.

    decode="all" (HF): logits at every position, (B, T, V); the loss reads the labelled rows of them.
    decode="labelled" (the original BERT's gather_indexes): h is gathered at the n labelled positions first, so
    transform, decoder and loss run on (n, C) -> (n, V) alone: the same loss and gradients, ~n/(B T) of the work.
    Either way the loss is CE over the labelled rows only, and the decoder's backward runs on those rows: the
    (B T, V) gradient, zero on every unlabelled row, is never written (with "all", the labelled rows of the
    transform's output are decoded a second time for the loss, ~15% of the decoder's forward).
    pad_rows=K (the models' mlm_rows): the labelled rows padded to K, so every batch has the same shapes (a CUDA
    graph's replays: kernels/cuda/graph.py): K - n more rows decoded at position 0 with the label -100, which the
    cross-entropy ignores (its mean is over the n labelled rows; their gradient is exactly 0), as the original
    BERT pads to max_predictions_per_seq with weight 0. The returned rows are then K long, -1 where padding.
    Returns (logits, rows, loss or None, cache); rows: the flat indices of the labelled positions (or None).
    """
    o = ctx.ops
    E, bias = P[word_emb_name], P["cls.predictions.bias"]
    rows = None if labels is None else np.flatnonzero(labels.reshape(-1) != -100)   # (n,)
    targets = None if rows is None else labels.reshape(-1)[rows]
    shown = None if rows is None else rows.copy()                   # the user's; the gather's backward reads rows
    if pad_rows is not None and (isinstance(pad_rows, (bool, np.bool_)) or not isinstance(pad_rows, (int, np.integer))
                                 or pad_rows < 1):
        raise ValueError(f"mlm: attribute 'mlm_rows' expected None or a positive integer (the labelled rows padded "
                         f"to that count), got {pad_rows!r}")
    if rows is not None and pad_rows is not None:
        n = len(rows)
        if n > pad_rows:
            raise ValueError(f"mlm: argument 'labels' expected at most mlm_rows={pad_rows} labelled positions (the "
                             f"rows padded to a fixed count), got {n}")
        extra = pad_rows - n
        rows = np.concatenate([rows, np.zeros(extra, rows.dtype)])               # (K,): padding decodes row 0
        targets = np.concatenate([targets, np.full(extra, -100, targets.dtype)])  # ... and is ignored by the loss
        shown = np.concatenate([shown, np.full(extra, -1, shown.dtype)])
    x, c_g = h, None
    if decode == "labelled":
        if rows is None:
            raise ValueError("mlm: decode='labelled' expected labels (the positions to decode), got none")
        x, c_g = o.gather_rows_forward(h, rows)                       # (n, C)
    t, c_d = dense_forward(ctx, P, "cls.predictions.transform.dense", x, bias=False)
    t, c_a = o.bias_gelu_forward(t, P["cls.predictions.transform.dense.bias"], cfg.gelu_approximate)
    t, c_ln = norm_forward(ctx, P, "cls.predictions.transform.LayerNorm", t, cfg.layer_norm_eps)
    logits, c_dec = o.linear_forward(t, E, bias)                      # (B, T, V) or (n, V)
    if rows is None:
        return logits, None, None, None
    c_r, lk = None, logits
    if decode == "labelled" and ctx.keep:
        logits = logits.copy()                                        # the output stays the user's, lk the loss's
    if decode == "all":                                               # the loss reads the labelled rows:
        tk, c_r = o.gather_rows_forward(t, rows)                      # (n, C)
        lk, c_dec = o.linear_forward(tk, E, bias)                     # (n, V) = logits at those rows, decoded again
        # (n/(B T) ~ 15% of the decoder's forward, so that its backward sees only the labelled rows; the cache is
        # the backend's own, opaque to the model: a wrapping backend (trace, mixed, a user's) tags or reshapes it)
    loss, c_l = o.cross_entropy_forward(lk, targets)
    return logits, shown, loss, (c_g, c_d, c_a, c_ln, c_dec, c_r, c_l, word_emb_name)


def mlm_head_backward(ctx, dloss, cache, grads):
    c_g, c_d, c_a, c_ln, c_dec, c_r, c_l, word_emb_name = cache
    o = ctx.ops
    dlk = o.cross_entropy_backward(dloss, c_l)                        # (n, V): every row labelled
    dt, dE, dbias = o.linear_backward(dlk, c_dec)
    grads["cls.predictions.bias"] = dbias
    _add_grads(grads, word_emb_name[:-len(".weight")], dE)  # tied: the decoder's share of the embedding gradient
    if c_r is not None:
        dt = o.gather_rows_backward(dt, c_r)                          # scatter to (B, T, C); 0 where unlabelled
    dt = norm_backward(ctx, dt, c_ln, grads)
    dt, db_t = o.bias_gelu_backward(dt, c_a)
    _add_grads(grads, "cls.predictions.transform.dense", None, db_t)
    dh = dense_backward(ctx, dt, c_d, grads)
    return dh if c_g is None else o.gather_rows_backward(dh, c_g)


# ----------------------------------------------------------------------------------------------------------------
# outputs: HF's field names; attribute and key access

class ModelOutput(dict):
    """A dict with attribute access, like transformers.utils.ModelOutput (fields that are None are kept)."""
    __getattr__ = dict.__getitem__

    def __repr__(self):
        show = {k: (v.shape if hasattr(v, "shape") else v) for k, v in self.items()}
        return f"{type(self).__name__}({show})"


class BaseModelOutputWithPooling(ModelOutput): pass          # noqa: E701
class BertForPreTrainingOutput(ModelOutput): pass            # noqa: E701
class MaskedLMOutput(ModelOutput): pass                      # noqa: E701
class NextSentencePredictorOutput(ModelOutput): pass         # noqa: E701
class SequenceClassifierOutput(ModelOutput): pass            # noqa: E701
class TokenClassifierOutput(ModelOutput): pass               # noqa: E701
class QuestionAnsweringModelOutput(ModelOutput): pass        # noqa: E701
class MultipleChoiceModelOutput(ModelOutput): pass           # noqa: E701


# ----------------------------------------------------------------------------------------------------------------
# the models

class BertPreTrainedModel:
    """Shared machinery: parameters, train/eval, the encoder pass, backward bookkeeping, checkpoints."""
    prefix = "bert."

    def __init__(self, config, seed=0, dtype=np.float32, backend="numpy", precision="fp32"):
        if not isinstance(config, BertConfig):
            raise ValueError(f"{type(self).__name__}: argument 'config' expected a refbert.BertConfig, "
                             f"got {type(config).__name__}")
        given = dtype
        try:
            dtype = np.dtype(dtype) if dtype is not None else None     # (np.dtype(None) would be float64)
        except TypeError:                                               # ("bogus": not a dtype at all)
            dtype = None
        if dtype is None or dtype.type not in V.FLOATS:
            raise ValueError(f"{type(self).__name__}: argument 'dtype' expected float32 or float64, got "
                             f"{dtype if dtype is not None else repr(given)}")
        if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"{type(self).__name__}: argument 'seed' expected a non-negative integer, got {seed!r}")
        self.config, self.dtype, self.backend = config, dtype, backend
        self.ops = get_backend(backend)
        init_ss, dropout_ss = np.random.SeedSequence(seed).spawn(2)
        self.params = to_device(self.ops, init_parameters(config, parameter_shapes(config, type(self).__name__),
                                                          np.random.default_rng(init_ss), dtype))
        self.dropout_rng = DropoutRNG.from_seed_sequence(dropout_ss)  # counter-based: same masks on every backend
        self.training = True                                  # as a freshly built torch module
        self._cache = None
        self.precision = precision

    @property
    def precision(self):
        """"fp32" (the default), "bf16-mixed" or "fp16-mixed": what the forward and backward compute (refbert.ops,
        "mixed precision: the spec"; refbert.mixed). Mixed precision keeps the parameters (the float32 masters)
        as they are and wraps the backend's ops; assigning another value switches the next forward."""
        return self._precision

    @precision.setter
    def precision(self, precision):
        name = type(self).__name__
        compute = compute_dtype(precision, name)
        if compute is not None and self.dtype != np.float32:
            raise ValueError(f"{name}: argument 'precision' {precision!r} expected dtype float32 (the masters), "
                             f"got dtype {self.dtype}")
        base = self.ops.base if isinstance(self.ops, MixedOps) else self.ops
        self.ops, self._precision = mixed_ops(base, precision), precision

    # -- the API that carries the backward --
    def parameters(self):
        """{name: array}: the live arrays (edit them in place to change the model), keyed as torch's named_parameters()."""
        return self.params

    def train(self, mode=True):
        self.training = bool(mode)
        return self

    def eval(self):
        return self.train(False)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def num_parameters(self):
        return sum(p.size for p in self.params.values())

    def backward(self, dloss=1.0):
        """Gradients of the loss of the last forward (which must have had labels): {name: array}, same keys as
        parameters(). Releases the forward's caches."""
        name = type(self).__name__
        if self._cache is None:
            raise ValueError(f"{name}.backward: expected a forward() first, outside refbert.no_grad() (each forward "
                             f"allows one backward), got none")
        if self._cache[0] is None:
            raise ValueError(f"{name}.backward: expected a forward with labels (the loss to differentiate), "
                             f"got a forward without them")
        if not hasattr(dloss, "ndim") or isinstance(dloss, (np.ndarray, np.generic)):   # (a device array: the loss's
            #                                                                             backward checks it)
            dloss = V.number(f"{name}.backward", "dloss", dloss,
                             what="a finite real number (the loss's upstream gradient, 1.0 by default)")
        loss_backward, cache = self._cache
        self._cache = None
        grads = {}
        loss_backward(dloss, cache, grads)
        return _ordered(grads, self.params)

    # -- the encoder, shared by every class --
    def _ctx(self, keep=True):
        return _Ctx(self.ops, self.dropout_rng, self.training, keep and is_grad_enabled())

    def _encode(self, ctx, input_ids, attention_mask, token_type_ids, position_ids, pooler, want_hidden, want_att):
        """Embeddings, layers, pooler. With ctx.keep the caches are returned for a backward, and the outputs are
        copies (a user writing into them cannot change what the backward reads); without, each layer's cache
        is dropped when the next layer starts and nothing is copied."""
        cfg, P, pre = self.config, self.params, self.prefix
        ids, tt, pos, mask = _check_inputs(type(self).__name__, cfg, self.dtype, input_ids, attention_mask,
                                           token_type_ids, position_ids)
        stage = getattr(ctx.ops, "stage", None)         # a device backend: the checked inputs move in one copy,
        if stage is not None:                           # not once per op that reads them ("cuda": one per layer)
            ids, tt, pos, mask = stage(ids, tt, pos, mask)
        own = (lambda a: a.copy()) if ctx.keep else (lambda a: a)  # noqa: E731
        h, c_emb = embeddings_forward(ctx, P, pre + "embeddings.", cfg, ids, tt, pos)
        hidden, atts, c_layers = [own(h)], [], []
        for l in range(cfg.num_hidden_layers):
            h, c = layer_forward(ctx, P, f"{pre}encoder.layer.{l}.", cfg, h, mask)
            if want_hidden:
                hidden.append(own(h))
            if want_att:
                atts.append(own(ctx.ops.attention_probs(c.attention)))
            if ctx.keep:
                c_layers.append(c)
        pooled, c_pool = pooler_forward(ctx, P, pre, h) if pooler else (None, None)
        out = dict(last_hidden_state=own(h), pooler_output=pooled,
                   hidden_states=tuple(hidden) if want_hidden else None, attentions=tuple(atts) if want_att else None)
        return out, ((c_emb, c_layers, c_pool) if ctx.keep else None)

    def _encode_backward(self, ctx, dseq, dpooled, cache, grads):
        c_emb, c_layers, c_pool = cache
        if dpooled is not None:
            dp = pooler_backward(ctx, dpooled, c_pool, grads)
            dseq = dp if dseq is None else dseq + dp
        for c in reversed(c_layers):
            dseq = layer_backward(ctx, dseq, c, grads)
        embeddings_backward(ctx, dseq, c_emb, grads)

    # -- checkpoints (refbert.checkpoint) --
    @classmethod
    def from_pretrained(cls, path, dtype=np.float32, backend="numpy", id2label=None, precision="fp32"):
        from .checkpoint import load_pretrained
        compute_dtype(precision, f"{cls.__name__}.from_pretrained")     # a bad value fails before any file is read
        model = load_pretrained(cls, path, dtype=dtype, backend=backend, id2label=id2label)
        model.precision = precision
        return model

    def save_pretrained(self, path):
        from .checkpoint import save_pretrained
        save_pretrained(self, path)


def _ordered(grads, params):
    """Gradients in parameters() order; a parameter the loss never reached (the pooler, when only
    last_hidden_state has a gradient) gets zeros."""
    return {k: grads[k] if k in grads else np.zeros_like(p) for k, p in params.items()}


def _check_inputs(who, cfg, dtype, input_ids, attention_mask, token_type_ids, position_ids):
    """Validate the encoder inputs and fill HF's defaults. Returns ids, token types, positions (B, T) and the
    additive mask (B, 1, 1, T) or None."""
    if not isinstance(input_ids, np.ndarray) or input_ids.ndim != 2 or not np.issubdtype(input_ids.dtype, np.integer):
        raise ValueError(f"{who}: argument 'input_ids' expected an integer array of shape (B, T), got {V._desc(input_ids)}")
    B, T = input_ids.shape
    if T == 0 or T > cfg.max_position_embeddings:
        raise ValueError(f"{who}: argument 'input_ids' expected a sequence length T in [1, {cfg.max_position_embeddings}]"
                         f" (max_position_embeddings), got T = {T}")
    V.ids(who, "input_ids", input_ids, cfg.vocab_size)
    if token_type_ids is None:
        token_type_ids = np.zeros((B, T), np.int64)
    if isinstance(token_type_ids, np.ndarray):        # (anything else: V.ids refuses it by name, a ragged list too)
        V.shape(who, "token_type_ids", token_type_ids, (B, T), "(B, T) as input_ids")
    V.ids(who, "token_type_ids", token_type_ids, cfg.type_vocab_size)
    if position_ids is None:
        position_ids = np.arange(T)
    try:
        position_ids = np.asarray(position_ids)
    except ValueError:                                 # (a ragged list: NumPy's own error would name nothing)
        raise ValueError(f"{who}: argument 'position_ids' expected an integer array that broadcasts to {(B, T)}, "
                         f"got a ragged {type(position_ids).__name__}") from None
    try:
        position_ids = np.broadcast_to(position_ids, (B, T))
    except ValueError:
        raise ValueError(f"{who}: argument 'position_ids' expected a shape that broadcasts to {(B, T)}, "
                         f"got {position_ids.shape}") from None
    V.ids(who, "position_ids", position_ids, cfg.max_position_embeddings)
    if attention_mask is None:
        return input_ids, token_type_ids, position_ids, None
    am = attention_mask
    if not isinstance(am, np.ndarray) or am.shape != (B, T):
        raise ValueError(f"{who}: argument 'attention_mask' expected an array of shape {(B, T)} (as input_ids), "
                         f"got {V._desc(am)}")
    if not np.isin(am, (0, 1)).all():
        raise ValueError(f"{who}: argument 'attention_mask' expected only 0 (padding) and 1 (real token), "
                         f"got values {np.unique(am)[:5]}")
    # HF's extended mask: 0 where attended, the dtype's most negative number where padded. A row with no real token
    # is valid input, as in HF: every score of it becomes that same number (|score| is far below its ulp), so its
    # queries attend uniformly to every position — finite, no NaN, and the same numbers as transformers.
    mask = ((1 - am.astype(dtype)) * np.finfo(dtype).min)[:, None, None, :]  # (B, 1, 1, T)
    return input_ids, token_type_ids, position_ids, mask


class BertModel(BertPreTrainedModel):
    """The encoder: last_hidden_state (B, T, C) and pooler_output (B, C)."""
    prefix = ""

    def __init__(self, config, seed=0, dtype=np.float32, backend="numpy", add_pooling_layer=True, precision="fp32"):
        self.add_pooling_layer = add_pooling_layer
        super().__init__(config, seed, dtype, backend, precision)
        if not add_pooling_layer:
            for k in ("pooler.dense.weight", "pooler.dense.bias"):
                del self.params[k]

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
                output_hidden_states=False, output_attentions=False):
        ctx = self._ctx()
        out, cache = self._encode(ctx, input_ids, attention_mask, token_type_ids, position_ids,
                                  self.add_pooling_layer, output_hidden_states, output_attentions)
        self._cache = (None, (ctx, cache, out["last_hidden_state"].shape)) if ctx.keep else None
        return BaseModelOutputWithPooling(out)

    def backward(self, dlast_hidden_state=None, dpooler_output=None):
        """Gradients of sum(dlast_hidden_state * last_hidden_state) + sum(dpooler_output * pooler_output):
        {name: array} with the keys of parameters(). At least one of the two must be given."""
        if self._cache is None:
            raise ValueError("BertModel.backward: expected a forward() first, outside refbert.no_grad() (each forward "
                             "allows one backward), got none")
        if dlast_hidden_state is None and dpooler_output is None:
            raise ValueError("BertModel.backward: expected dlast_hidden_state and/or dpooler_output, got neither")
        _, (ctx, cache, shape) = self._cache
        if dpooler_output is not None and not self.add_pooling_layer:
            raise ValueError("BertModel.backward: argument 'dpooler_output' given, but the model has no pooler")
        if dlast_hidden_state is not None:
            V.dout("BertModel.backward", _shape_of(dlast_hidden_state), shape, self.dtype, name="dlast_hidden_state",
                   what="last_hidden_state's")
        if dpooler_output is not None:
            V.dout("BertModel.backward", _shape_of(dpooler_output), (shape[0], shape[2]), self.dtype,
                   name="dpooler_output", what="pooler_output's")
        self._cache = None
        grads = {}
        self._encode_backward(ctx, dlast_hidden_state, dpooler_output, cache, grads)
        return _ordered(grads, self.params)


class _Head(BertPreTrainedModel):
    """A task head on the encoder. Subclasses define forward(); a loss, when labels are given, stores its backward."""
    pooler = True

    def _run(self, kw):
        labelled = any(kw.get(k) is not None for k in ("labels", "next_sentence_label", "start_positions",
                                                       "end_positions"))
        ctx = self._ctx(keep=labelled)                 # no labels, no loss, no backward: keep no caches
        enc, cache = self._encode(ctx, kw["input_ids"], kw.get("attention_mask"), kw.get("token_type_ids"),
                                  kw.get("position_ids"), self.pooler, kw.get("output_hidden_states", False),
                                  kw.get("output_attentions", False))
        return ctx, enc, cache

    def _finish(self, out_cls, ctx, enc, enc_cache, loss, head_backward, **fields):
        """Store what backward needs and build the output. head_backward(dloss, grads) -> (dseq, dpooled)."""
        def loss_backward(dloss, _cache, grads):
            dseq, dpooled = head_backward(dloss, grads)
            self._encode_backward(ctx, dseq, dpooled, enc_cache, grads)
        if loss is None:
            self._cache = (None, None)                   # backward() says a loss needs labels
        else:
            self._cache = (loss_backward, None) if ctx.keep else None   # under no_grad(): no backward
        return out_cls(loss=loss, **fields, hidden_states=enc["hidden_states"], attentions=enc["attentions"])

    def _labels(self, name, labels, shape, upper, allow=-100):
        if not isinstance(labels, np.ndarray) or labels.shape != shape:
            raise ValueError(f"{type(self).__name__}: argument '{name}' expected an integer array of shape {shape}, "
                             f"got {V._desc(labels)}")
        V.ids(type(self).__name__, name, labels, upper, allow=allow)


class BertForPreTraining(_Head):
    """MLM + NSP, as BERT was pretrained: loss = CE(prediction_logits, labels) + CE(seq_relationship_logits,
    next_sentence_label) (both labels are needed for a loss, as in HF).

    mlm_decode="labelled" (an attribute, or forward's argument) decodes only the labelled positions, as the original
    BERT does: the same loss and gradients, a fraction of the MLM head's work; the output then has
    prediction_logits=None and masked_lm_logits (n, V) at masked_lm_positions (n,), flat indices into (B*T).
    mlm_rows=K (an attribute; None: off): the labelled rows padded to K with ignored ones (mlm_head_forward), so
    every batch has the same shapes, as a CUDA graph needs; with "labelled", masked_lm_logits is then (K, V) and
    masked_lm_positions K long, -1 at the padding."""
    mlm_decode = "all"
    mlm_rows = None

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                next_sentence_label=None, output_hidden_states=False, output_attentions=False, mlm_decode=None):
        decode = _decode_arg(type(self).__name__, self.mlm_decode if mlm_decode is None else mlm_decode)
        kw = locals()
        ctx, enc, cache = self._run(kw)
        P, cfg, o = self.params, self.config, self.ops
        have = labels is not None and next_sentence_label is not None
        if have:
            self._labels("labels", labels, input_ids.shape, cfg.vocab_size)
            self._labels("next_sentence_label", next_sentence_label, (input_ids.shape[0],), 2)
        logits, rows, l_mlm, c_mlm = mlm_head_forward(ctx, P, cfg, enc["last_hidden_state"],
                                                      "bert.embeddings.word_embeddings.weight",
                                                      labels if have else None, decode, self.mlm_rows)
        nsp, c_nsp = dense_forward(ctx, P, "cls.seq_relationship", enc["pooler_output"])
        loss = head_backward = None
        if have:
            l_nsp, c_l2 = o.cross_entropy_forward(nsp.copy(), next_sentence_label)  # the output stays the user's
            loss = l_mlm + l_nsp                         # summed, as in the paper and HF

            def head_backward(dloss, grads):
                dseq = mlm_head_backward(ctx, dloss, c_mlm, grads)
                dpooled = dense_backward(ctx, o.cross_entropy_backward(dloss, c_l2), c_nsp, grads)
                return dseq, dpooled
        return self._finish(BertForPreTrainingOutput, ctx, enc, cache, loss, head_backward,
                            **_mlm_fields("prediction_logits", logits, rows, decode), seq_relationship_logits=nsp)


class BertForMaskedLM(_Head):
    """MLM only (no pooler): logits (B, T, V); loss = CE over positions whose label is not -100.
    mlm_decode="labelled": as BertForPreTraining (logits=None, masked_lm_logits at masked_lm_positions); mlm_rows
    too."""
    pooler = False
    mlm_decode = "all"
    mlm_rows = None

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                output_hidden_states=False, output_attentions=False, mlm_decode=None):
        decode = _decode_arg(type(self).__name__, self.mlm_decode if mlm_decode is None else mlm_decode)
        ctx, enc, cache = self._run(locals())
        if labels is not None:
            self._labels("labels", labels, input_ids.shape, self.config.vocab_size)
        logits, rows, loss, c_mlm = mlm_head_forward(ctx, self.params, self.config, enc["last_hidden_state"],
                                                     "bert.embeddings.word_embeddings.weight", labels, decode,
                                                     self.mlm_rows)
        head_backward = None
        if labels is not None:
            def head_backward(dloss, grads):
                return mlm_head_backward(ctx, dloss, c_mlm, grads), None
        return self._finish(MaskedLMOutput, ctx, enc, cache, loss, head_backward,
                            **_mlm_fields("logits", logits, rows, decode))


def _decode_arg(who, decode):
    if decode not in MLM_DECODE:
        raise ValueError(f"{who}: argument 'mlm_decode' expected one of {MLM_DECODE}, got {decode!r}")
    return decode


def _mlm_fields(name, logits, rows, decode):
    if decode == "all":
        return {name: logits}
    return {name: None, "masked_lm_logits": logits, "masked_lm_positions": rows}


class BertForNextSentencePrediction(_Head):
    """NSP: logits (B, 2) from the pooled [CLS]; label 0 = "B follows A", 1 = "B is random"."""

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                output_hidden_states=False, output_attentions=False):
        ctx, enc, cache = self._run(locals())
        o = self.ops
        logits, c_nsp = dense_forward(ctx, self.params, "cls.seq_relationship", enc["pooler_output"])
        loss = head_backward = None
        if labels is not None:
            self._labels("labels", labels, (input_ids.shape[0],), 2)     # -100: ignored, as HF's CrossEntropyLoss
            loss, c_l = o.cross_entropy_forward(logits.copy(), labels)  # a copy: the output stays the user's

            def head_backward(dloss, grads):
                return None, dense_backward(ctx, o.cross_entropy_backward(dloss, c_l), c_nsp, grads)
        return self._finish(NextSentencePredictorOutput, ctx, enc, cache, loss, head_backward, logits=logits)


class BertForSequenceClassification(_Head):
    """Single sentences and sentence pairs (NLI): logits = classifier(dropout(pooled)), (B, num_labels).
    Loss as HF selects it (config.problem_type, or when that is None: num_labels == 1 -> "regression", integer
    labels -> "single_label_classification", float labels -> "multi_label_classification"):
        regression                  MSE(logits, labels)                       labels: (B,) or (B, num_labels) floats
        single_label_classification CE(logits, labels)                        labels: (B,) integers
        multi_label_classification  BCE-with-logits(logits, labels), mean     labels: (B, num_labels) in [0, 1]"""

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                output_hidden_states=False, output_attentions=False):
        ctx, enc, cache = self._run(locals())
        cfg, o = self.config, self.ops
        pooled, c_do = ctx.dropout(enc["pooler_output"], _classifier_dropout(cfg))
        logits, c_cls = dense_forward(ctx, self.params, "classifier", pooled)
        loss = head_backward = None
        if labels is not None:
            B = input_ids.shape[0]
            problem = problem_type(cfg, labels)
            if problem == "regression":
                shapes = [logits.shape] + ([(B,)] if cfg.num_labels == 1 else [])   # HF squeezes (B, 1) to (B,)
                if not (isinstance(labels, np.ndarray) and labels.shape in shapes and labels.dtype.kind in "iuf"):
                    want = " or ".join(str(t) for t in shapes)
                    raise ValueError(f"BertForSequenceClassification: argument 'labels' expected real regression "
                                     f"targets of shape {want}, got {V._desc(labels)}")
                if labels.dtype.kind == "f" and not np.isfinite(labels).all():
                    raise ValueError("BertForSequenceClassification: argument 'labels' expected finite regression "
                                     "targets, got a NaN or an infinity")
                loss, c_l = o.mse_forward(logits, labels.reshape(logits.shape).astype(self.dtype))
                dlogits_of = lambda d: o.mse_backward(d, c_l)[0]  # noqa: E731
            elif problem == "multi_label_classification":
                if not isinstance(labels, np.ndarray) or labels.shape != logits.shape:
                    raise ValueError(f"BertForSequenceClassification: argument 'labels' expected multi-label "
                                     f"targets of shape {logits.shape} (B, num_labels), got {V._desc(labels)}")
                loss, c_l = o.bce_with_logits_forward(logits, labels.astype(self.dtype))
                dlogits_of = lambda d: o.bce_with_logits_backward(d, c_l)  # noqa: E731
            else:
                self._labels("labels", labels, (B,), cfg.num_labels)
                loss, c_l = o.cross_entropy_forward(logits.copy(), labels)  # a copy: the output stays the user's
                dlogits_of = lambda d: o.cross_entropy_backward(d, c_l)  # noqa: E731

            def head_backward(dloss, grads):
                dp = dense_backward(ctx, dlogits_of(dloss), c_cls, grads)
                return None, o.dropout_backward(dp, c_do)
        return self._finish(SequenceClassifierOutput, ctx, enc, cache, loss, head_backward, logits=logits)


class BertForTokenClassification(_Head):
    """Token tagging (NER, slot filling): logits (B, T, num_labels); loss = CE over labels that are not -100."""
    pooler = False

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                output_hidden_states=False, output_attentions=False):
        ctx, enc, cache = self._run(locals())
        o = self.ops
        h, c_do = ctx.dropout(enc["last_hidden_state"], _classifier_dropout(self.config))
        logits, c_cls = dense_forward(ctx, self.params, "classifier", h)
        loss = head_backward = None
        if labels is not None:
            self._labels("labels", labels, input_ids.shape, self.config.num_labels)
            loss, c_l = o.cross_entropy_forward(logits.copy(), labels)  # a copy: the output stays the user's

            def head_backward(dloss, grads):
                dh = dense_backward(ctx, o.cross_entropy_backward(dloss, c_l), c_cls, grads)
                return o.dropout_backward(dh, c_do), None
        return self._finish(TokenClassifierOutput, ctx, enc, cache, loss, head_backward, logits=logits)


class BertForQuestionAnswering(_Head):
    """Extractive QA: start_logits, end_logits (B, T). loss = (CE(start) + CE(end)) / 2; as HF, positions are
    clamped to [0, T] and T (outside the input) is ignored."""
    pooler = False

    def __init__(self, config, seed=0, dtype=np.float32, backend="numpy", precision="fp32"):
        if isinstance(config, BertConfig) and config.num_labels != 2:     # (any other config: the base class says)
            raise ValueError(f"BertForQuestionAnswering: config.num_labels expected 2 (start and end logits), "
                             f"got {config.num_labels}")
        super().__init__(config, seed, dtype, backend, precision)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, start_positions=None,
                end_positions=None, output_hidden_states=False, output_attentions=False):
        ctx, enc, cache = self._run(locals())
        o = self.ops
        logits, c_qa = dense_forward(ctx, self.params, "qa_outputs", enc["last_hidden_state"])  # (B, T, 2)
        start, end = logits[..., 0].copy(), logits[..., 1].copy()
        loss = head_backward = None
        if start_positions is not None and end_positions is not None:
            B, T = input_ids.shape
            for name, pos in (("start_positions", start_positions), ("end_positions", end_positions)):
                if not isinstance(pos, np.ndarray) or pos.reshape(-1).shape != (B,) \
                        or not np.issubdtype(pos.dtype, np.integer):
                    raise ValueError(f"BertForQuestionAnswering: argument '{name}' expected {B} integer positions, "
                                     f"got {V._desc(pos)}")
            sp = np.clip(start_positions.reshape(B), 0, T)
            ep = np.clip(end_positions.reshape(B), 0, T)
            l_s, c_s = o.cross_entropy_forward(start, sp, ignore_index=T)
            l_e, c_e = o.cross_entropy_forward(end, ep, ignore_index=T)
            loss = (l_s + l_e) / 2

            def head_backward(dloss, grads):
                half = dloss / 2
                dlogits = np.stack([o.cross_entropy_backward(half, c_s), o.cross_entropy_backward(half, c_e)], -1)
                return dense_backward(ctx, dlogits, c_qa, grads), None
        return self._finish(QuestionAnsweringModelOutput, ctx, enc, cache, loss, head_backward,
                            start_logits=start, end_logits=end)


class BertForMultipleChoice(_Head):
    """Multiple choice: inputs (B, N, T) flattened to (B*N, T); one score per choice from the pooled [CLS];
    logits (B, N); loss = CE over the choices."""

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                output_hidden_states=False, output_attentions=False):
        if not isinstance(input_ids, np.ndarray) or input_ids.ndim != 3:
            raise ValueError(f"BertForMultipleChoice: argument 'input_ids' expected an integer array of shape "
                             f"(B, num_choices, T), got {V._desc(input_ids)}")
        B, N, T = input_ids.shape
        for name, a in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids),
                        ("position_ids", position_ids)):
            ok = isinstance(a, np.ndarray) and (a.shape == input_ids.shape or name == "position_ids" and a.ndim
                                                 and a.shape[-1] == T and a.size == T)
            if a is not None and not ok:               # (position_ids (T,) or (1, T) as well, BertModel's broadcast)
                raise ValueError(f"BertForMultipleChoice: argument '{name}' expected an array of shape "
                                 f"(B, num_choices, T) = {input_ids.shape} as input_ids, got {V._desc(a)}")
        if position_ids is not None and position_ids.size == T:
            position_ids = np.broadcast_to(position_ids.reshape(T), input_ids.shape)
        V.ids("BertForMultipleChoice", "input_ids", input_ids, self.config.vocab_size)   # (indices in (B, N, T))
        flat = lambda a: None if a is None else a.reshape(B * N, T)  # noqa: E731
        ctx, enc, cache = self._run(dict(input_ids=flat(input_ids), attention_mask=flat(attention_mask),
                                         token_type_ids=flat(token_type_ids), position_ids=flat(position_ids),
                                         output_hidden_states=output_hidden_states,
                                         output_attentions=output_attentions, labels=labels))
        o = self.ops
        pooled, c_do = ctx.dropout(enc["pooler_output"], _classifier_dropout(self.config))
        scores, c_cls = dense_forward(ctx, self.params, "classifier", pooled)  # (B*N, 1)
        logits = scores.reshape(B, N)
        loss = head_backward = None
        if labels is not None:
            self._labels("labels", labels, (B,), N)
            loss, c_l = o.cross_entropy_forward(logits.copy(), labels)  # a copy: the output stays the user's

            def head_backward(dloss, grads):
                ds = o.cross_entropy_backward(dloss, c_l).reshape(B * N, 1)
                return None, o.dropout_backward(dense_backward(ctx, ds, c_cls, grads), c_do)
        return self._finish(MultipleChoiceModelOutput, ctx, enc, cache, loss, head_backward, logits=logits)


PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")


def problem_type(cfg, labels):
    """HF's choice of loss for sequence classification: config.problem_type when set, else from num_labels and
    the labels' dtype (integers -> single-label, anything else -> multi-label)."""
    if cfg.problem_type is not None:
        if cfg.problem_type not in PROBLEM_TYPES:
            raise ValueError(f"BertForSequenceClassification: config.problem_type expected one of {PROBLEM_TYPES} "
                             f"or None, got {cfg.problem_type!r}")
        return cfg.problem_type
    if cfg.num_labels == 1:
        return "regression"
    integer = isinstance(labels, np.ndarray) and np.issubdtype(labels.dtype, np.integer)
    return "single_label_classification" if integer else "multi_label_classification"


def _classifier_dropout(cfg):
    return cfg.hidden_dropout_prob if cfg.classifier_dropout is None else cfg.classifier_dropout


def decode_qa_span(start_logits, end_logits, max_answer_length=30, context_mask=None, null_score_diff_threshold=0.0):
    """Best answer span per example from QA logits, as the BERT paper's SQuAD recipe.

    start_logits, end_logits: (B, T). context_mask: (B, T) bool, True where an answer may lie (e.g. the passage
    tokens; default: everywhere but position 0). A span (s, e) scores start[s] + end[e] with s <= e and
    e - s + 1 <= max_answer_length; the null answer is (0, 0) at [CLS] with score start[0] + end[0] (SQuAD 2.0).
    Returns a list of (start, end, score): the null answer when its score beats the best span's by more than
    null_score_diff_threshold.
    """
    who = "decode_qa_span"
    start_logits, end_logits = np.asarray(start_logits), np.asarray(end_logits)
    if start_logits.ndim != 2 or end_logits.shape != start_logits.shape or start_logits.shape[1] == 0:
        raise ValueError(f"{who}: arguments 'start_logits' and 'end_logits' expected equal shapes (B, T), T >= 1, "
                         f"got {start_logits.shape} and {end_logits.shape}")
    for name, a in (("start_logits", start_logits), ("end_logits", end_logits)):
        if a.dtype.kind not in "iuf" or (a.dtype.kind == "f" and not np.isfinite(a).all()):
            raise ValueError(f"{who}: argument '{name}' expected finite real logits, got "
                             f"{'a NaN or an infinity' if a.dtype.kind == 'f' else f'dtype {a.dtype}'}")
    max_answer_length = V.number(who, "max_answer_length", max_answer_length, low=1, integer=True,
                                 what="a positive integer (tokens)")
    t = null_score_diff_threshold                      # +inf: never the null answer (SQuAD 1.1 data)
    t = t[()] if isinstance(t, np.ndarray) and t.ndim == 0 else t
    if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, float, np.integer, np.floating)) or t != t:
        raise ValueError(f"{who}: argument 'null_score_diff_threshold' expected a real number (inf: never the null "
                         f"answer), got {t!r}")
    B, T = start_logits.shape
    if context_mask is None:
        context_mask = np.ones((B, T), bool)
        context_mask[:, 0] = False
    elif not (isinstance(context_mask, np.ndarray) and context_mask.shape == (B, T) and
              (context_mask.dtype == bool or (context_mask.dtype.kind in "iu" and
                                              ((context_mask == 0) | (context_mask == 1)).all()))):
        raise ValueError(f"{who}: argument 'context_mask' expected a bool (or 0/1) array of shape (B, T) = {(B, T)}, "
                         f"got {V._desc(context_mask)}" + (" with values other than 0 and 1" if
                                                            isinstance(context_mask, np.ndarray) and
                                                            context_mask.shape == (B, T) else ""))
    context_mask = context_mask.astype(bool)
    span = start_logits[:, :, None] + end_logits[:, None, :]          # (B, T_start, T_end)
    s_idx, e_idx = np.arange(T)[:, None], np.arange(T)[None, :]
    ok = (s_idx <= e_idx) & (e_idx - s_idx < max_answer_length)        # (T, T)
    ok = ok[None] & context_mask[:, :, None] & context_mask[:, None, :]
    span = np.where(ok, span, -np.inf)
    results = []
    for b in range(B):
        flat = int(np.argmax(span[b]))
        s, e = divmod(flat, T)
        best = float(span[b, s, e])
        null = float(start_logits[b, 0] + end_logits[b, 0])
        results.append((0, 0, null) if not np.isfinite(best) or null - best > null_score_diff_threshold
                       else (s, e, best))
    return results


# ----------------------------------------------------------------------------------------------------------------
# activation memory

def activation_floats(config, T):
    """What one encoder layer keeps for its backward, per token, in training: (floats, bytes of dropout masks).

        input x (shared by the q/k/v projections)   C
        q, k, v (split into heads as views)         3C
        attention probabilities p                   H*T      (B, H, T, T) / (B*T)
        attention context (input of output.dense)   C
        s1 = x + ao, and LayerNorm mean, rstd       C + 2
        h1 (input of intermediate.dense)            C
        u (pre-GELU, bias included), g = GELU(u)    2I
        s2 = h1 + fo, and LayerNorm mean, rstd      C + 2
        total                                       8C + 2I + H*T + 4 floats
        dropout keep-masks (bool)                   H*T + 2C bytes (none in eval)
    BERT-base at T = 128 in float32: (8*768 + 2*3072 + 12*128 + 4) * 4 = 55.3 kB per token per layer.
    """
    C, I, H = config.hidden_size, config.intermediate_size, config.num_attention_heads
    return 8 * C + 2 * I + H * T + 4, H * T + 2 * C


def cache_nbytes(cache, exclude_ids=()):
    """(bytes of float arrays, bytes of bool arrays) held by a nested cache, each buffer counted once (views share
    their base) and arrays whose id is in exclude_ids (the parameters) left out."""
    seen, sizes = set(), {"f": 0, "b": 0}

    def walk(c):
        if isinstance(c, (tuple, list)):
            for item in c:
                walk(item)
        elif isinstance(c, np.ndarray) and id(c) not in exclude_ids:
            base = c
            while base.base is not None and isinstance(base.base, np.ndarray):
                base = base.base
            if id(base) not in seen and id(base) not in exclude_ids:
                seen.add(id(base))
                sizes[base.dtype.kind] = sizes.get(base.dtype.kind, 0) + base.nbytes
    walk(cache)
    return sizes["f"], sizes["b"]
