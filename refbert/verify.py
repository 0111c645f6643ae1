"""`refbert verify` and `refbert dump`: another BERT's outputs and gradients, checked tensor by tensor against refbert.

The implementation under test writes one file, the *dump*: a batch, what its model computed on that batch with
dropout off (eval mode, so anyone can reproduce it), and the gradient of the loss for every parameter, under Hugging
Face's names. refbert loads the same checkpoint in float64, recomputes the same, and prints one row per tensor; then
where to look first (the earliest tensor that goes wrong, in the order the computation produces them).

    refbert dump CKPT --out ref.safetensors          refbert's own dump: the format's reference
    refbert verify CKPT --against dump.safetensors   someone else's dump against refbert
    refbert verify CKPT                              refbert's backward against finite differences and, when
                                                     transformers and torch are installed, against torch autograd

The dump: one .safetensors file (F64, F32, F16 or BF16) or .npz, keys

    input/input_ids              (B, T) int    required (BertForMultipleChoice: (B, N, T), as HF)
    input/token_type_ids         (B, T) int    optional, as HF's forward (default 0)
    input/attention_mask         (B, T) 0/1    optional (default all 1)
    input/position_ids           (B, T) int    optional
    input/<label>                the head's labels, HF's argument names (LABELS below); all of them, or none
    upstream/last_hidden_state   (B, T, C)     BertModel only: its "loss" is sum(upstream * output) over both
    upstream/pooler_output       (B, C)
    output/<field>               HF's output fields: logits, prediction_logits, start_logits, last_hidden_state, ...
    output/loss                  ()            when there are labels
    hidden_states/<i>            (B, T, C)     optional; HF's tuple: i = 0 the embeddings, i = l + 1 layer l's output
    grad/<parameter>             every parameter, named as torch's named_parameters(), when there is a loss

Comparison. A tensor x of the dump against refbert's float64 r of the same key, and its noise n: how far an honest
implementation computing in the dump's dtype strays from r on this very tensor, measured by Monte Carlo arithmetic
(`noise`): refbert reruns the batch PROBES times with every op's result rounded at random as an implementation in
that dtype would round it, and n is the largest deviation from r it saw. Then

    error = max |x - r| / s,   tolerance = K n / s,   s = max |r|  (n for a tensor 0 in exact arithmetic),
    pass: max |x - r| <= K n          K = FACTOR[dtype]: 8 (float64, float32), 16 (float16, bfloat16)

So error is the relative error, and tolerance the smallest relative change of that tensor the check can see: it
follows each tensor's own conditioning (a gradient that cancels has more noise than one that adds up). Measured
(benchmarks/verify_noise.py; BERT tiny, mini, base; HF's init, trained, trained with peaked attention): a change of
1e-3 in any one tensor of a float32 dump, and of 1e-9 in a float64 one, fails; float16 dumps see changes of a few
percent, bfloat16 ones of tens of percent. A gradient 0 in exact arithmetic (`exact_zeros`) holds only rounding
noise: it is judged in absolute terms, its error in units of noise. A missing tensor, a wrong shape, an integer
tensor or an unknown key fails its row; a batch refbert cannot run raises a ValueError naming the dump.

References: Hugging Face transformers, models/bert/modeling_bert.py (names, outputs, labels); Higham & Mary,
"A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019 (the sqrt(n) growth);
D. Stott Parker, "Monte Carlo Arithmetic: exploiting randomness in floating-point arithmetic", UCLA CSD-970002, 1997,
and Denis, de Oliveira Castro & Petit, "Verificarlo", ARITH 2016 (rounding errors estimated by random rounding).
"""
import contextlib
import io
import json
import math
import os
import tempfile
import time
import warnings
import zipfile

import numpy as np

from . import model as M
from . import ops as O
from . import safetensors_io
from .config import HEADS, BertConfig
from .fileio import write_text
from .gradcheck import TOLERANCE, check_model
from .tables import text_table

# the labels of each head, HF's argument names: with all of them the forward has a loss, with none it has not
LABELS = {"BertModel": (), "BertForPreTraining": ("labels", "next_sentence_label"), "BertForMaskedLM": ("labels",),
          "BertForNextSentencePrediction": ("labels",), "BertForSequenceClassification": ("labels",),
          "BertForTokenClassification": ("labels",), "BertForQuestionAnswering": ("start_positions", "end_positions"),
          "BertForMultipleChoice": ("labels",)}
INPUTS = ("input_ids", "token_type_ids", "attention_mask", "position_ids")
UPSTREAM = ("last_hidden_state", "pooler_output")
# torch's named_parameters(remove_duplicate=False) also lists the tied MLM decoder; its gradient is the tensor's
ALIASES = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
           "cls.predictions.decoder.bias": "cls.predictions.bias"}

# Finite differences along a random direction d: its n entries give it length sqrt(n), so the step is h sqrt(n) long
# (0.8e-3 for a 768 x 768 weight at h = 1e-6) and centred differences err by O((h sqrt(n))^2), rounding by
# O(eps |L| / h). On BERT-base's MLM transform weight, h = 1e-5 (gradcheck's default, right for small tensors) errs
# by 8e-8, at the 1e-7 bar, and h = 1e-6 by 8e-10; rounding at 1e-6 stays near 1e-9.
FD_STEP = 1e-6

# Machine epsilon, the gap between 1 and the next float: 52, 23, 10 and 7 stored mantissa bits.
EPS = {"float64": 2.0 ** -52, "float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}
_CODES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
          "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool"}

# 16-bit kernels (torch's on CPU and GPU, cuBLAS's) sum in float32 and round the result to 16 bits.
ACCUMULATOR = {"float64": "float64", "float32": "float32", "float16": "float32", "bfloat16": "float32"}

# Monte Carlo runs per check. A tensor of one or two numbers (the loss, the NSP bias) gets one random draw of its
# noise per run, about normal: one run falls under 1/8 of its typical size 1 time in 10, the largest of 3 runs
# 1 time in 1,000.
PROBES = 3

# K, the error a tensor may show in units of its noise. The noise model rounds more coarsely than careful
# kernels do (a sqrt(n) u sum, where pairwise or blocked sums err less): on BERT tiny, mini and base (HF's init,
# trained, peaked; benchmarks/results/verify_noise.md) honest dumps strayed at most 1.6 n in float64 and float32
# (torch; refbert's NumPy float32 and numba kernels) and 3.9 n in float16 and bfloat16 (torch), while a change of
# 1e-3 of any one tensor of a float32 dump showed as 30 n or more. 16-bit dumps get 16: their model is cruder.
FACTOR = {"float64": 8, "float32": 8, "float16": 16, "bfloat16": 16}


# ----------------------------------------------------------------------------------------------------------------
# files

def read_dump(path):
    """({key: array}, {key: dtype name}) from a .safetensors or .npz file (told apart by the zip magic bytes).
    BF16 arrives as float32 (exact), its dtype name kept as "bfloat16". A damaged file is a ValueError naming it."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"verify: dump '{path}' expected a file, got {'a folder' if os.path.isdir(path) else 'nothing'}")
    with open(path, "rb") as f:
        is_zip = f.read(4) in (b"PK\x03\x04", b"PK\x05\x06")     # a file's record, or an empty zip's end
    if not is_zip:
        tensors = safetensors_io.load_file(path)   # its errors name the file (and the tensor)
        return tensors, {k: _CODES[c] for k, c in safetensors_io.load_dtypes(path).items()}
    try:
        with np.load(path, allow_pickle=False) as z:
            tensors = {k: z[k] for k in z.files}
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, KeyError) as e:   # truncated, corrupt, pickled
        raise ValueError(f"verify: dump '{path}' expected a readable .npz file, got {type(e).__name__}: {e} "
                         f"(truncated?)") from None
    for k, a in tensors.items():
        if a.dtype.kind not in "fiub":
            raise ValueError(f"verify: dump '{path}', tensor '{k}' expected a numeric array, got dtype {a.dtype}")
    return tensors, {k: a.dtype.name for k, a in tensors.items()}


DUMP_SUFFIXES = (".safetensors", ".npz")


def dump_format(path):
    """"safetensors" or "npz", from the suffix of `path`; any other suffix is a ValueError (a dump written under a
    name that hides its format would be read as the wrong thing)."""
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    if suffix not in DUMP_SUFFIXES:
        raise ValueError(f"dump: --out '{os.fspath(path)}' expected a file name ending in .safetensors or .npz, got "
                         f"{repr(suffix) if suffix else 'no suffix'}")
    return suffix[1:]


def write_dump(path, tensors, metadata=None):
    """{key: array} to `path`, atomically (the old file or the whole new one, never half), in the format its suffix
    names (`dump_format`)."""
    path = os.fspath(path)
    if dump_format(path) == "safetensors":
        safetensors_io.save_file(tensors, path, metadata=metadata)
        return
    buf = io.BytesIO()
    np.savez(buf, **tensors)
    directory, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(buf.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())                 # mkstemp made it 0600
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ----------------------------------------------------------------------------------------------------------------
# model and batch

def resolve_head(folder, head=None):
    """The class to check: `head`, else the first of config.json's architectures."""
    if head is None:
        arch = BertConfig.from_pretrained(folder).architectures or []
        if not arch:
            raise ValueError(f"verify: {os.path.join(folder, 'config.json')} names no architectures: "
                             f"expected --head, one of {', '.join(HEADS)}")
        head = arch[0]
    if head not in HEADS:
        raise ValueError(f"verify: head expected one of {', '.join(HEADS)}, got {head!r}")
    return head


def load(folder, head, dtype=np.float64, need_head=True):
    """head.from_pretrained(folder) in eval mode. need_head: refuse a checkpoint without the head's weights,
    which refbert would initialise at random and the implementation under test differently."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                  # the same news is in loading_info
        model = getattr(M, head).from_pretrained(folder, dtype=dtype)
    missing = model.loading_info["missing_keys"]
    if need_head and missing:
        raise ValueError(f"verify: checkpoint '{folder}' lacks {len(missing)} weight(s) of {head} (first: "
                         f"'{missing[0]}'), which refbert would initialise at random: expected a checkpoint saved "
                         f"with its head, or --head naming the class it holds")
    return model.eval()


def default_batch(config, head, B=3, T=16, seed=0):
    """The batch `refbert dump` and `refbert verify` use when none is given, deterministic in `seed`:
    B rows of T tokens (T at most max_position_embeddings), row 0 full and the others padded after 2T/3 tokens,
    segment A then B, the pad id only on padding; labels under HF's names, -100 on padding and on ~85% of MLM
    positions, a row's class 0 for row 0 and the last class for the others; BertForMultipleChoice gets 2 choices
    per row (the second the rows reversed). Returns ({name: array}, {upstream name: array}): BertModel's random
    upstream gradients, {} for a head."""
    r = np.random.default_rng(seed)
    V, T = config.vocab_size, min(T, config.max_position_embeddings)
    real = max(1, 2 * T // 3)
    ids = r.integers(0, V, (B, T))                                   # (B, T)
    am = np.ones((B, T), np.int64)
    am[1:, real:] = 0
    if config.pad_token_id is not None:
        ids[ids == config.pad_token_id] = (config.pad_token_id + 1) % V
        ids[am == 0] = config.pad_token_id
    tt = np.zeros((B, T), np.int64)
    tt[:, T // 2:] = min(1, config.type_vocab_size - 1)             # two segments where the config has them
    batch = dict(input_ids=ids, token_type_ids=tt, attention_mask=am)
    mlm = np.where((r.random((B, T)) < 0.15) & (am == 1), r.integers(0, V, (B, T)), -100)
    mlm[0, 1] = r.integers(0, V)                                     # at least one masked position
    # a row's class: 0 for row 0, the last class for the others. A head's bias gradient is sum_b softmax_b - the
    # class counts: with each of 2 classes once, an undecided head (softmax ~ (1/2, 1/2), as at init) cancels it to
    # ~1e-3 of its terms; with one class only, a head sure of it does; 1 row against 2 leaves ~1/2 either way,
    # where float32 noise cannot hide a change of 1e-3 in it
    K = config.num_labels
    last = lambda k: np.where(np.arange(B) == 0, 0, k - 1)  # noqa: E731
    if head == "BertForPreTraining":
        batch.update(labels=mlm, next_sentence_label=last(2))
    elif head == "BertForMaskedLM":
        batch.update(labels=mlm)
    elif head == "BertForNextSentencePrediction":
        batch.update(labels=last(2))
    elif head == "BertForSequenceClassification":
        regression = K == 1 or config.problem_type == "regression"
        batch.update(labels=r.standard_normal(B) if regression else last(K))
    elif head == "BertForTokenClassification":
        batch.update(labels=np.where(am == 1, r.integers(0, K, (B, T)), -100))
    elif head == "BertForQuestionAnswering":
        start = np.minimum(1 + np.arange(B), real - 1)
        batch.update(start_positions=start, end_positions=np.minimum(start + 2, real - 1))
    elif head == "BertForMultipleChoice":
        batch = {k: np.stack([v, v[::-1]], 1) for k, v in batch.items()}   # (B, 2, T)
        batch.update(labels=last(2))
    upstream = {}
    if head == "BertModel":
        C = config.hidden_size
        upstream = dict(last_hidden_state=r.standard_normal((B, T, C)), pooler_output=r.standard_normal((B, C)))
    return batch, upstream


def split_batch(tensors, head, config, source):
    """The forward's arguments and BertModel's upstream gradients out of a dump's tensors (input/*, upstream/*).
    Integer-valued inputs become int64 (regression labels stay float). Returns (batch, upstream, keys used)."""
    names = INPUTS + LABELS[head]
    batch, upstream, used = {}, {}, set()
    for name in names:
        a = tensors.get(f"input/{name}")
        if a is None:
            continue
        used.add(f"input/{name}")
        regression = head == "BertForSequenceClassification" and name == "labels" and \
            (config.num_labels == 1 or config.problem_type == "regression")
        if regression:
            batch[name] = a.astype(np.float64)
        elif a.dtype.kind in "iub" or (a.dtype.kind == "f" and np.all(a == np.round(a))):
            batch[name] = a.astype(np.int64)
        else:
            raise ValueError(f"verify: {source}, tensor 'input/{name}' expected integers, got dtype {a.dtype} "
                             f"with fractional values")
    if "input_ids" not in batch:
        raise ValueError(f"verify: {source} expected a tensor 'input/input_ids', got none (keys: "
                         f"{', '.join(sorted(tensors)[:6])}{', ...' if len(tensors) > 6 else ''})")
    labels = [n for n in LABELS[head] if n in batch]
    if labels and len(labels) < len(LABELS[head]):
        lacking = [f"input/{n}" for n in LABELS[head] if n not in batch]
        raise ValueError(f"verify: {source} expected all of {head}'s labels or none, got "
                         f"{', '.join('input/' + n for n in labels)} without {', '.join(lacking)}")
    if head == "BertModel":
        for name in UPSTREAM:
            if f"upstream/{name}" in tensors:
                upstream[name] = tensors[f"upstream/{name}"].astype(np.float64)
                used.add(f"upstream/{name}")
    return batch, upstream, used


def read_batch(path, head, config):
    """(batch, upstream) from a .npz/.safetensors file: a dump's input/* and upstream/* tensors, or the same names
    without the prefix; default_batch when path is None."""
    if path is None:
        return default_batch(config, head)
    tensors, _ = read_dump(path)
    if not any(k.startswith("input/") for k in tensors):           # bare names: input_ids, labels, ...
        tensors = {(k if "/" in k else ("upstream/" if k in UPSTREAM else "input/") + k): v for k, v in tensors.items()}
    batch, upstream, used = split_batch(tensors, head, config, f"batch '{os.fspath(path)}'")
    unknown = sorted(k for k in tensors if k not in used and k.startswith(("input/", "upstream/")))
    if unknown:                                     # a misspelt name ("label") would drop the loss, unsaid (a dump's
        #                                             outputs and gradients are not the batch: passed by)
        raise ValueError(f"verify: batch '{os.fspath(path)}' holds tensors {head} does not take: {unknown[:4]} "
                         f"(it takes {', '.join(INPUTS + LABELS[head])}"
                         f"{', upstream/' + ', upstream/'.join(UPSTREAM) if head == 'BertModel' else ''})")
    return batch, upstream


def reference(model, batch, upstream):
    """What the dump must hold, computed by `model` (in its dtype): {key: array} in the order outputs (loss last),
    hidden_states/0..L, grad/<name> in parameters() order. No gradients when there is no loss (no labels; BertModel
    without upstream)."""
    out = model(**batch, output_hidden_states=True)
    ref = {f"output/{k}": np.asarray(v) for k, v in out.items()
           if v is not None and k not in ("loss", "hidden_states", "attentions")}
    if out.get("loss") is not None:
        ref["output/loss"] = np.asarray(out.loss)
    ref.update({f"hidden_states/{i}": h for i, h in enumerate(out.hidden_states)})
    grads = {}
    if isinstance(model, M.BertModel):
        if upstream:
            grads = model.backward(*(None if upstream.get(k) is None else upstream[k].astype(model.dtype)
                                     for k in UPSTREAM))
    elif out.get("loss") is not None:
        grads = model.backward()
    ref.update({f"grad/{k}": g for k, g in grads.items()})
    return ref


# ----------------------------------------------------------------------------------------------------------------
# the noise: Monte Carlo arithmetic over refbert's ops

class MonteCarloOps:
    """refbert.ops with every result rounded at random as an implementation computing in `dtype` would round it:
    Monte Carlo arithmetic (Parker) at the level of the ops, a model of an honest implementation's noise.

    An op whose entries each sum n terms of size |t| returns y + d, per entry
        d = (max(u |t|, tiny) + sqrt(n) u_acc |t|) r,      r uniform in [-1, 1], drawn from `seed`
    u = eps/2 of `dtype` (the rounding of the stored result), u_acc that of its ACCUMULATOR (a sum of n terms errs by
    ~sqrt(n) u_acc of their size: Higham & Mary), tiny = 2^-25 in float16 (half its subnormal spacing: gradients
    under 2^-14 lose their relative precision; float32 and bfloat16 reach 1e-38). |t| is |y|, except where an op
    rounds its terms before they cancel: cross-entropy's softmax before "- onehot", BCE's sigmoid before "- target",
    MSE's prediction before "- target", the loss's logsumexp before "- logit". Rounded results feed the next op,
    and the caches a backward reads (softmax's p, gelu's and tanh's outputs) hold them rounded, as a kernel's would,
    so each rounding travels through the rest of the computation with its own conditioning: softmax's exp turns
    the scores' absolute error into a relative one, a gradient that cancels keeps its terms' error.
    Lookups, gathers and eval dropout are exact; attention is its matmuls and softmax, each rounded. Eval only. An op
    not listed here raises AttributeError rather than run unrounded. scale multiplies u and u_acc (0: refbert.ops).
    """
    EXACT = ("embedding_forward", "gather_rows_forward", "gather_rows_backward", "dropout_forward",
             "dropout_backward")

    def __init__(self, dtype, seed=0, scale=1.0):
        if dtype not in EPS:
            raise ValueError(f"MonteCarloOps: argument 'dtype' expected one of {', '.join(EPS)}, got {dtype!r}")
        self.u, self.u_acc = scale * EPS[dtype] / 2, scale * EPS[ACCUMULATOR[dtype]] / 2
        self.tiny = scale * 2.0 ** -25 if dtype == "float16" else 0.0
        self.rng = np.random.default_rng(seed)

    def __getattr__(self, name):
        if name in MonteCarloOps.EXACT:
            return getattr(O, name)
        raise AttributeError(f"MonteCarloOps has no rounding model for op '{name}'")

    def _round(self, y, n, t=None):
        """y + d as above, in y's dtype; t: the size of the terms (default |y|)."""
        y = np.asarray(y)
        r = self.rng.random(y.shape, y.dtype)
        r *= 2
        r -= 1                                                           # uniform in [-1, 1)
        if t is None and not self.tiny:
            r *= self.u + math.sqrt(n) * self.u_acc
            r *= y                                                       # d = c |y| r, as c y r: r is symmetric
        else:
            t = np.abs(y) if t is None else t
            r *= np.maximum(self.u * t, self.tiny) + (math.sqrt(n) * self.u_acc) * t
        r += y
        return r

    def linear_forward(self, x, w, b=None):
        out, c = O.linear_forward(x, w, b)
        return self._round(out, x.shape[-1] + (b is not None)), c

    def linear_backward(self, dout, c):
        dx, *dwb = O.linear_backward(dout, c)
        N = dout.size // dout.shape[-1]                                  # dw, db: sums over every position
        return (self._round(dx, dout.shape[-1]), *(self._round(g, N) for g in dwb))

    def layernorm_forward(self, x, w, b, eps=1e-12):
        out, c = O.layernorm_forward(x, w, b, eps)
        return self._round(out, x.shape[-1]), c

    def layernorm_backward(self, dout, c):
        dx, dw, db = O.layernorm_backward(dout, c)
        N = dout.size // dout.shape[-1]
        return self._round(dx, dout.shape[-1]), self._round(dw, N), self._round(db, N)

    def dropout_residual_layernorm_forward(self, x, a, w, b, eps=1e-12, p=0.0, rng=None, train=True):
        self._eval(p, train)
        out, c = O.dropout_residual_layernorm_forward(x, a, w, b, eps, p, rng, train)
        return self._round(out, x.shape[-1]), c

    def dropout_residual_layernorm_backward(self, dout, c):
        ds, _, dw, db = O.dropout_residual_layernorm_backward(dout, c)   # eval: the skip and the branch get ds
        N = dout.size // dout.shape[-1]
        ds = self._round(ds, dout.shape[-1])
        return ds, ds.copy(), self._round(dw, N), self._round(db, N)

    def bias_gelu_forward(self, x, b, approximate="none"):
        out, ((u, _, approx),) = O.bias_gelu_forward(x, b, approximate)
        out = self._round(out, 2)                                        # x + b, then gelu's own rounding
        return out, ((u, out, approx),)

    def bias_gelu_backward(self, dout, c):
        du, _ = O.bias_gelu_backward(dout, c)
        du = self._round(du, 2)
        return du, self._round(du.reshape(-1, du.shape[-1]).sum(0), du.size // du.shape[-1])

    def tanh_forward(self, x):
        out, _ = O.tanh_forward(x)
        out = self._round(out, 1)
        return out, (out,)

    def tanh_backward(self, dout, c):
        return self._round(O.tanh_backward(dout, c), 2)

    def embedding_backward(self, dout, c):
        ids = c[0]
        dw = O.embedding_backward(dout, c)                               # row v sums the positions holding id v
        rows, count = np.unique(ids, return_counts=True)                 # the other rows are exact zeros
        dw[rows] = self._round(dw[rows], 1, np.abs(dw[rows]) * np.sqrt(count)[:, None])
        return dw

    def attention_forward(self, q, k, v, n_heads, mask=None, dropout_p=0.0, rng=None, train=True):
        self._eval(dropout_p, train)
        B, T, C = q.shape
        hs = C // n_heads
        qh, kh, vh = (a.reshape(B, T, n_heads, hs).transpose(0, 2, 1, 3) for a in (q, k, v))   # (B, H, T, hs)
        att = self._round(qh @ kh.transpose(0, 1, 3, 2), hs)             # (B, H, T, T)
        p, sm = O.softmax_forward(att, 1.0 / math.sqrt(hs), mask)
        p = self._round(p, T)                                            # each row's sum of T exps
        y = self._round(p @ vh, T)                                       # (B, H, T, hs)
        return y.transpose(0, 2, 1, 3).reshape(B, T, C), (qh, kh, vh, sm._replace(p=p))

    def attention_backward(self, dout, c):
        qh, kh, vh, sm = c
        B, H, T, hs = qh.shape
        dy = dout.reshape(B, T, H, hs).transpose(0, 2, 1, 3)            # (B, H, T, hs)
        dp = self._round(dy @ vh.transpose(0, 1, 3, 2), hs)              # (B, H, T, T)
        dvh = self._round(sm.p.transpose(0, 1, 3, 2) @ dy, T)
        datt = self._round(O.softmax_backward(dp, sm), T)
        dqh = self._round(datt @ kh, T)
        dkh = self._round(datt.transpose(0, 1, 3, 2) @ qh, T)
        merge = lambda g: g.transpose(0, 2, 1, 3).reshape(B, T, H * hs)  # noqa: E731
        return merge(dqh), merge(dkh), merge(dvh)

    def attention_probs(self, c):
        return c[3].p

    def cross_entropy_forward(self, logits, labels, ignore_index=-100):
        loss, c = O.cross_entropy_forward(logits, labels, ignore_index)
        kept, s = c[4], c[5]
        Vn = logits.shape[-1]
        lse = logits.reshape(-1, Vn)[kept].max(-1) + s[:, 0]             # (n,) each kept row's logsumexp
        t = max(float(np.abs(lse).mean()) if kept.size else 0.0, abs(float(loss)))
        return self._round(loss, Vn + kept.size, np.asarray(t)), c      # mean(lse - z[label]): terms of size |lse|

    def cross_entropy_backward(self, dloss, c):
        dz = O.cross_entropy_backward(dloss, c)                          # (p - onehot) dloss / n on kept rows
        shape, zs, kept, s = c[0], c[2], c[4], c[5]
        p = np.exp(zs - s) * (float(dloss) / max(kept.size, 1))         # the softmax, rounded before "- onehot"
        dz2 = dz.reshape(-1, shape[-1])
        dz2[kept] = self._round(dz2[kept], shape[-1], np.abs(p))
        return dz

    def bce_with_logits_forward(self, logits, targets):
        loss, c = O.bce_with_logits_forward(logits, targets)
        return self._round(loss, logits.size + 2, np.asarray(max(float(np.abs(logits).mean()), abs(float(loss))))), c

    def bce_with_logits_backward(self, dloss, c):
        s, targets = c
        dz = O.bce_with_logits_backward(dloss, c)
        return self._round(dz, 1, (np.abs(s) + np.abs(targets)) * abs(float(dloss)) / max(s.size, 1))

    def mse_forward(self, pred, target):
        loss, c = O.mse_forward(pred, target)
        return self._round(loss, pred.size + 1), (c, np.abs(pred) + np.abs(target))

    def mse_backward(self, dloss, c):
        c, t = c
        dpred, _ = O.mse_backward(dloss, c)
        dpred = self._round(dpred, 1, t * (2 * abs(float(dloss)) / max(t.size, 1)))
        return dpred, -dpred

    @staticmethod
    def _eval(p, train):
        if train and p > 0:
            raise ValueError("MonteCarloOps: expected eval mode (dropout off), got train mode with dropout")


def noise(model, batch, upstream, ref, dtype, probes=PROBES):
    """{key: n} for the keys of `ref` (refbert's float64 reference on this batch): the largest max|q - r| over
    `probes` runs q of `model` with MonteCarloOps(dtype, seed) in place of its ops. `model` computes in float64 for a
    float64 dump and in float32 for the others (whose rounding then counts as well); its ops are restored after."""
    n, ops = dict.fromkeys(ref, 0.0), model.ops
    try:
        for seed in range(probes):
            model.ops = MonteCarloOps(dtype, seed)
            q = reference(model, batch, upstream)
            for k, r in ref.items():
                if k in q:
                    n[k] = max(n[k], float(np.abs(q[k] - r).max(initial=0.0)))   # in float64, as r
    finally:
        model.ops = ops
    return n


# ----------------------------------------------------------------------------------------------------------------
# comparison, and where to look

def exact_zeros(head, keys):
    """The gradients among `keys` that are 0 in exact arithmetic, because softmax ignores a shift shared by all its
    inputs: every layer's key bias (shared by every key: its gradient sum_t dk_t = sum_q q_q sum_t dS_qt sums rows
    of dS, each 0), BertForQuestionAnswering's qa_outputs.bias (by every position of the start, and of the end,
    softmax) and BertForMultipleChoice's classifier.bias (by every choice). A dump holds only their rounding noise:
    no relative change of them can be seen, so they are judged in absolute terms, against refbert's noise."""
    shared = {"BertForQuestionAnswering": "grad/qa_outputs.bias",
              "BertForMultipleChoice": "grad/classifier.bias"}.get(head)
    return {k for k in keys if k.startswith("grad/") and (k.endswith(".attention.self.key.bias") or k == shared)}


def compare(ref, got, dtypes, noise, factor, zeros=(), optional=("hidden_states/",)):
    """One row per key of `ref` (refbert's float64 tensors), `noise` its noise n (`noise()`): pass when
    max|got - ref| <= factor * n; the row shows error = max|got - ref| / s and tolerance = factor * n / s with
    s = max|ref|, or n for a key in `zeros` (`exact_zeros`: its error in units of noise) and for a tensor whose
    largest entry is under its noise. A key starting with one of `optional` is compared only when `got` has it.
    Then the keys of `got` that refbert does not know, failed. Rows are dicts: key, dtype, shape, error (None when
    not compared), tolerance, noise, ok, note."""
    rows = []
    for k, r in ref.items():
        x = got.get(k)
        if x is None and k.startswith(optional):
            continue
        n = noise[k]
        zero = k in zeros
        s = max(n if zero else max(float(np.abs(r).max(initial=0.0)), n), np.finfo(np.float64).tiny)
        row = dict(key=k, dtype=dtypes.get(k, "-"), shape=list(r.shape), error=None, tolerance=factor * n / s,
                   noise=n, ok=False, note="")
        if x is None:
            row["note"] = "missing"
        elif x.dtype.kind != "f":
            row["note"] = f"expected a float tensor, got {dtypes.get(k, x.dtype)}"
        elif x.shape != r.shape and not (k == "output/loss" and x.size == 1):   # a loss of shape (1,) is a loss
            row["note"] = f"shape {list(x.shape)}, expected {list(r.shape)}"
        else:
            diff = float(np.abs(x.astype(np.float64).reshape(r.shape) - r).max(initial=0.0))
            row.update(error=diff / s, ok=bool(diff <= factor * n),
                       note="not finite" if not np.isfinite(diff) else "0 in exact arithmetic" if zero else "")
        rows.append(row)
    for k in got:
        if k not in ref:
            rows.append(dict(key=k, dtype=dtypes.get(k, "-"), shape=list(np.shape(got[k])), error=None,
                             tolerance=None, noise=None, ok=False, note="unexpected key"))
    return rows


def _group(name, n_layers):
    """(rank in the backward pass, label) of a parameter: the head first, then the pooler, the layers from last
    to first, the embeddings last."""
    bare = name[len("bert."):] if name.startswith("bert.") else name
    if bare.startswith("embeddings."):
        return n_layers + 2, "embeddings"
    if bare.startswith("encoder.layer."):
        l = int(bare.split(".")[2])
        return n_layers - l + 1, f"layer {l}"
    if bare.startswith("pooler."):
        return 1, "pooler"
    return 0, "head"


def _owner(where):
    return {"embeddings": "the embeddings'", "head": "the head's", "pooler": "the pooler's"}.get(where, f"{where}'s")


def locate(rows, n_layers):
    """Where to look first: the earliest failing tensor in the order the computation makes them, or None.

    Forward: hidden_states/0 is the embeddings' output and hidden_states/l+1 layer l's, so the first failing one
    names the block that went wrong; with all of them right, a failing output is the pooler's or the head's. When
    the forward is right, the gradients are walked in the order the backward computes them (head, pooler, layer
    L-1, ..., layer 0, embeddings): a bug in layer l's backward spoils the gradients of layer l and of everything
    before it, never those after, so the first failing one in that order names the layer. Returns a dict: where,
    key, why."""
    bad = [r for r in rows if not r["ok"]]
    if not bad:
        return None
    hidden = [r for r in rows if r["key"].startswith("hidden_states/") and r["note"] != "unexpected key"]
    for r in hidden:
        if not r["ok"]:
            i = int(r["key"].split("/")[1])
            where = "embeddings" if i == 0 else f"layer {i - 1}"
            return dict(where=where, key=r["key"], why=f"{_owner(where)} forward; the hidden states before it agree")
    outs = [r for r in rows if r["key"].startswith("output/") and not r["ok"]]
    if outs:
        r = next((o for o in outs if o["key"] != "output/loss"), outs[0])
        if r["key"] == "output/loss":
            return dict(where="the loss", key=r["key"], why="the outputs agree, the loss does not")
        if hidden and hidden[-1]["key"] == f"hidden_states/{n_layers}":
            return dict(where="the head", key=r["key"], why=f"the pooler or the head: hidden_states/{n_layers} agrees")
        return dict(where="the forward", key=r["key"],
                    why="add hidden_states/0..L to the dump to find the layer")
    grads = [r for r in rows if r["key"].startswith("grad/") and r["note"] != "unexpected key"]
    order = sorted(range(len(grads)), key=lambda i: (_group(grads[i]["key"][5:], n_layers)[0], i))
    for i in order:
        r = grads[i]
        if not r["ok"]:
            where = _group(r["key"][5:], n_layers)[1]
            return dict(where=where, key=r["key"], why=f"{_owner(where)} backward or the gradient it receives; "
                                                       f"the gradients computed before it agree")
    r = bad[0]
    return dict(where=r["note"], key=r["key"], why="not a tensor of this model: a misspelt or extra name")


# ----------------------------------------------------------------------------------------------------------------
# the two checks

def expected(model, folder, head, batch, upstream, dtype, source):
    """(ref, noise): refbert's float64 tensors on the batch (`reference`, by `model`, float64) and the noise of each
    for an implementation computing in `dtype` (`noise`: float64 arithmetic for float64, float32 for the others)."""
    try:
        ref = reference(model, batch, upstream)
        arith = model if dtype == "float64" else load(folder, head, np.float32, need_head=False)
        return ref, noise(arith, batch, upstream, ref, dtype)
    except ValueError as e:                              # a batch that does not fit the model: the model says why
        raise ValueError(f"verify: {source}: {e}") from None


def verify_dump(folder, dump_path, head=None, dtype=None, factor=None):
    """Check the dump at `dump_path` against refbert on checkpoint `folder` as class `head` (default: the config's
    architectures). dtype: the precision the dump was computed in (default: that of its least precise tensor);
    factor replaces FACTOR[dtype]. Returns the report (a dict): rows, passed, failed, first_failure, ..."""
    t0 = time.perf_counter()
    head = resolve_head(folder, head)
    tensors, dtypes = read_dump(dump_path)
    model = load(folder, head, np.float64)
    source = f"dump '{os.fspath(dump_path)}'"
    batch, upstream, used = split_batch(tensors, head, model.config, source)
    got = {k: v for k, v in tensors.items() if k not in used}
    if dtype is None:
        compared = [dtypes[k] for k in got if dtypes[k] in EPS]
        dtype = max(compared, key=EPS.get, default="float64")   # the least precise tensor sets the precision
    if dtype not in EPS:
        raise ValueError(f"verify: argument 'dtype' expected one of {', '.join(EPS)}, got {dtype!r}")
    ref, n = expected(model, folder, head, batch, upstream, dtype, source)
    for alias, name in ALIASES.items():                  # the tied decoder, when listed: compared as its tensor
        if f"grad/{alias}" in got and f"grad/{name}" in ref:
            ref[f"grad/{alias}"], n[f"grad/{alias}"] = ref[f"grad/{name}"], n[f"grad/{name}"]
    factor = FACTOR[dtype] if factor is None else factor
    rows = compare(ref, got, dtypes, n, factor, exact_zeros(head, ref))
    return dict(checkpoint=os.fspath(folder), dump=os.fspath(dump_path), head=head, dtype=dtype, factor=factor,
                probes=PROBES, batch_shape=list(batch["input_ids"].shape), rows=rows, passed=sum(r["ok"] for r in rows),
                failed=sum(not r["ok"] for r in rows), first_failure=locate(rows, model.config.num_hidden_layers),
                seconds=round(time.perf_counter() - t0, 2))


def hf_reference(folder, head, batch, params, upstream):
    """The dump transformers + torch autograd write, in float64, with refbert's weights copied in (so a head the
    checkpoint lacks is the same random head in both): {key: array}, keyed as `reference`."""
    import torch
    import transformers
    from transformers.utils import logging as hf_logging
    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()                     # its load report: refbert's loading_info says the same
    hf_logging.disable_progress_bar()
    try:
        model = getattr(transformers, head).from_pretrained(folder, attn_implementation="eager")
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
    model = model.double().eval()
    named = dict(model.named_parameters())
    if list(named) != list(params):
        raise ValueError(f"verify: transformers' {head} has parameters {sorted(set(named) ^ set(params))[:3]} "
                         f"that refbert's has not, or the reverse")
    with torch.no_grad():
        for k, p in named.items():
            p.copy_(torch.from_numpy(params[k]))
    out = model(**{k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.items()}, output_hidden_states=True)
    loss = out.get("loss")
    if upstream:
        loss = sum((out[k] * torch.from_numpy(u)).sum() for k, u in upstream.items())
    if loss is not None:
        loss.backward()
    res = {f"output/{k}": v.detach().numpy() for k, v in out.items() if k not in ("hidden_states", "attentions")}
    res.update({f"hidden_states/{i}": h.detach().numpy() for i, h in enumerate(out.hidden_states)})
    if loss is not None:
        res.update({f"grad/{k}": (p.grad if p.grad is not None else torch.zeros_like(p)).numpy()
                    for k, p in named.items()})
    return res


def verify_self(folder, head=None, batch_path=None, log=lambda line: print(line, flush=True)):
    """refbert's backward on checkpoint `folder` (float64, eval) against finite differences, each parameter tensor
    along one random direction (gradcheck.check_model), and against transformers + torch autograd in float64 when
    both are installed. Returns the report (a dict)."""
    head = resolve_head(folder, head)
    t0 = time.perf_counter()
    model = load(folder, head, np.float64, need_head=False)
    batch, upstream = read_batch(batch_path, head, model.config)
    if head != "BertModel" and not all(n in batch for n in LABELS[head]):
        raise ValueError(f"verify: the batch expected {head}'s labels ({', '.join(LABELS[head])}) to have a loss "
                         f"to differentiate, got none")
    L, n = model.config.num_hidden_layers, len(model.parameters())
    log(f"refbert verify: {folder} as {head} ({L} layers, {model.num_parameters():,} parameters), float64, eval, "
        f"batch {tuple(batch['input_ids'].shape)}; {n} parameter tensors, one direction each, 2 forwards each")
    try:
        errs = check_model(model, batch, n_dirs=1, h=FD_STEP)
    except ValueError as e:
        raise ValueError(f"verify: {e}") from None
    P = model.parameters()
    fd = [dict(key=f"grad/{k}", dtype="float64", shape=list(P[k].shape), error=e, tolerance=TOLERANCE,
               ok=bool(e <= TOLERANCE), note="") for k, e in errs.items()]
    report = dict(checkpoint=os.fspath(folder), head=head, batch_shape=list(batch["input_ids"].shape),
                  finite_differences=dict(tolerance=TOLERANCE, rows=fd, first_failure=locate(fd, L),
                                          seconds=round(time.perf_counter() - t0, 2)))
    t1 = time.perf_counter()
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        report["hf"] = dict(skipped=f"{e.name or e} is not installed")
    else:
        ref, n = expected(model, folder, head, batch, upstream, "float64", "the batch")
        theirs = hf_reference(folder, head, batch, P, upstream)
        rows = compare(ref, theirs, {k: "float64" for k in theirs}, n, FACTOR["float64"], exact_zeros(head, ref))
        report["hf"] = dict(dtype="float64", factor=FACTOR["float64"], probes=PROBES, rows=rows,
                            first_failure=locate(rows, L), seconds=round(time.perf_counter() - t1, 1))
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


# ----------------------------------------------------------------------------------------------------------------
# printing and the commands

def format_rows(rows):
    head = ("tensor", "dtype", "shape", "error", "tolerance", "")
    num = lambda x: "-" if x is None else f"{x:.2e}"  # noqa: E731
    body = [(r["key"], r["dtype"], "(" + ", ".join(map(str, r["shape"])) + ("," if len(r["shape"]) == 1 else "") + ")",
             num(r["error"]), num(r["tolerance"]),
             ("pass" if r["ok"] else "FAIL") + (f" ({r['note']})" if r["note"] else "")) for r in rows]
    return text_table(head, body)


def rule(dtype, factor, probes=PROBES):
    """The report's header: how error and tolerance are computed."""
    return (f"error = max|x - refbert| / max|refbert|, refbert in float64 (a gradient 0 in exact arithmetic: / noise)\n"
            f"tolerance = {factor:g} x noise / the same; pass: error <= tolerance\n"
            f"noise: the largest deviation from refbert of {probes} runs of refbert rounding every op's result at "
            f"random as {dtype} would (Monte Carlo arithmetic)")


def _summary(rows, first):
    failed = sum(not r["ok"] for r in rows)
    text = f"{len(rows) - failed} passed, {failed} failed"
    if first:
        text += f"\nfirst failure: {first['where']} ({first['key']}): {first['why']}"
    return text


def _json(report):
    """The report with non-finite errors as null: strict JSON has no NaN."""
    def clean(x):
        if isinstance(x, float) and not np.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x
    return json.dumps(clean(report), indent=1) + "\n"


def main(args):
    """refbert verify. Exit 0: every row passed; 1: a row failed."""
    if args.against is not None:
        if args.batch is not None:
            raise ValueError("verify: --batch is for verify without --against (a dump carries its own batch)")
        rep = verify_dump(args.model, args.against, args.head, args.dtype)
        print(f"refbert verify: {rep['dump']} against {rep['checkpoint']} as {rep['head']}, batch "
              f"{tuple(rep['batch_shape'])}, computed in {rep['dtype']}; {rep['seconds']} s")
        print(rule(rep["dtype"], rep["factor"], rep["probes"]) + "\n")
        print(format_rows(rep["rows"]))
        print("\n" + _summary(rep["rows"], rep["first_failure"]))
        ok = rep["failed"] == 0
    else:
        if args.dtype is not None:
            raise ValueError("verify: --dtype is for a dump (--against); refbert checks itself in float64")
        rep = verify_self(args.model, args.head, args.batch)
        fd = rep["finite_differences"]
        print(f"\nrefbert backward against centred finite differences along one random direction per tensor "
              f"(h = {FD_STEP:g}, relative error as gradcheck.check_model), {fd['seconds']} s\n")
        print(format_rows(fd["rows"]))
        print("\n" + _summary(fd["rows"], fd["first_failure"]))
        ok = all(r["ok"] for r in fd["rows"])
        hf = rep["hf"]
        if "skipped" in hf:
            print(f"\nrefbert against transformers + torch autograd: skipped ({hf['skipped']})")
        else:
            print(f"\nrefbert against transformers + torch autograd, both float64, same weights, {hf['seconds']} s")
            print(rule(hf["dtype"], hf["factor"], hf["probes"]) + "\n")
            print(format_rows(hf["rows"]))
            print("\n" + _summary(hf["rows"], hf["first_failure"]))
            ok = ok and all(r["ok"] for r in hf["rows"])
        print(f"\n{'all passed' if ok else 'FAILED'} in {rep['seconds']} s")
    rep["ok"] = ok
    if args.json:
        write_text(args.json, _json(rep))
    return 0 if ok else 1


def dump(folder, out, head=None, batch_path=None, dtype="float64"):
    """Write refbert's dump of checkpoint `folder` on a batch (the file at batch_path, or default_batch) to `out`:
    the format's reference. Returns {key: array} as written."""
    if dtype not in ("float64", "float32"):
        raise ValueError(f"dump: argument 'dtype' expected float64 or float32, got {dtype!r}")
    dump_format(out)                                     # before the work: a name it cannot write
    head = resolve_head(folder, head)
    model = load(folder, head, np.dtype(dtype))
    batch, upstream = read_batch(batch_path, head, model.config)
    try:
        ref = reference(model, batch, upstream)
    except ValueError as e:
        raise ValueError(f"dump: {e}") from None
    tensors = {f"input/{k}": np.asarray(v) for k, v in batch.items()}
    tensors.update({f"upstream/{k}": np.asarray(v, model.dtype) for k, v in upstream.items()})
    tensors.update({k: np.ascontiguousarray(v) for k, v in ref.items()})
    write_dump(out, tensors, metadata={"producer": "refbert dump", "head": head, "dtype": dtype})
    return tensors


NO_GRADIENTS = ": nothing to differentiate, the batch has no labels (BertModel: no upstream/*)"


def dump_main(args):
    t = dump(args.model, args.out, args.head, args.batch, args.dtype)
    count = lambda p: sum(k.startswith(p) for k in t)  # noqa: E731
    print(f"{args.out}: {len(t)} tensors ({count('input/')} inputs, {count('output/')} outputs, "
          f"{count('hidden_states/')} hidden states, {count('grad/')} gradients"
          f"{'' if count('grad/') else NO_GRADIENTS}), batch "
          f"{tuple(t['input/input_ids'].shape)}, {args.dtype}, {dump_format(args.out)} format")
    return 0
