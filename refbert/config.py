"""BertConfig: the hyperparameters of a BERT encoder, with Hugging Face's field names and defaults, so that a
`config.json` moves between refbert and `transformers.BertConfig` unchanged in both directions.

Presets name the published sizes (Google's BERT miniatures, BERT-base and BERT-large), and `count_parameters` spells
out, as an explicit sum, how many trainable parameters each Hugging Face BERT class has for a config.
"""
import json
import math
import os
from dataclasses import InitVar, dataclass, field, fields

from .fileio import write_text

# HF's ACT2FN names we implement, and the `approximate` argument of ops.gelu_forward each one means.
# "gelu" is the exact x·Φ(x); "gelu_new" (HF's Python formula) and "gelu_pytorch_tanh" (torch's kernel) are both the
# tanh approximation 0.5·x·(1 + tanh(√(2/π)(x + 0.044715x³))).
GELU_APPROXIMATE = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}

PROBLEM_TYPES = (None, "regression", "single_label_classification", "multi_label_classification")

# L layers, H hidden, A heads, and the feed-forward width 4H. tiny..medium are Google's BERT miniatures
# (Turc et al., 2019); base and large are the two models of the BERT paper.
PRESETS = {
    "tiny": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, intermediate_size=512),
    "mini": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024),
    "small": dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8, intermediate_size=2048),
    "medium": dict(num_hidden_layers=8, hidden_size=512, num_attention_heads=8, intermediate_size=2048),
    "base": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072),
    "large": dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16, intermediate_size=4096),
}

# Keys a config.json may carry that refbert cannot honour, because refbert is an encoder with absolute positions.
# Each maps to the only value accepted (a missing key is fine).
_ENCODER_ONLY = {"is_decoder": False, "add_cross_attention": False, "is_encoder_decoder": False,
                 "position_embedding_type": "absolute"}


def _fail(name, expected, got):
    raise ValueError(f"BertConfig: field '{name}' expected {expected}, got {got!r}")


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(kw_only=True)
class BertConfig:
    """The hyperparameters of BERT. Field names, meanings and defaults are those of `transformers.BertConfig`
    (BERT-base, uncased). `num_labels` is not stored: like HF it is len(id2label), and setting it to k replaces the
    label maps by LABEL_0..LABEL_{k-1}. Keys of a config.json that refbert does not use live in `extra`, verbatim,
    so that they are written back."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int | None = 0
    classifier_dropout: float | None = None
    problem_type: str | None = None
    architectures: list[str] | None = None
    id2label: dict[int, str] | None = None
    label2id: dict[str, int] | None = None
    num_labels: InitVar[int | None] = None  # replaced by a property below the class
    extra: dict = field(default_factory=dict)

    def __post_init__(self, num_labels):
        if num_labels is not None and not (_is_int(num_labels) and num_labels >= 1):
            _fail("num_labels", "a positive int", num_labels)
        if self.id2label is None and self.label2id is not None:
            self.id2label = _invert("label2id", self.label2id)
        if self.id2label is None:
            # HF's default: a two-way classifier, so that a config saved without labels still builds one.
            self.id2label = _default_labels(2 if num_labels is None else num_labels)
        else:
            # JSON object keys are always strings; the ids are ints.
            self.id2label = _int_keys("id2label", self.id2label)
            if num_labels is not None and num_labels != len(self.id2label):
                _fail("num_labels", f"len(id2label) = {len(self.id2label)} when id2label is given", num_labels)
        if self.label2id is None:
            self.label2id = {v: k for k, v in self.id2label.items()}
        elif isinstance(self.label2id, dict):
            self.label2id = dict(self.label2id)
        # Our own copies, not the caller's (a tuple becomes a list: JSON has no tuples). validate() rejects the rest.
        if isinstance(self.architectures, (list, tuple)):
            self.architectures = list(self.architectures)
        if isinstance(self.extra, dict):
            self.extra = dict(self.extra)
        self.validate()

    def validate(self):
        """Check every field; raise ValueError naming the first bad one. Runs on construction; call it again after
        changing fields by hand."""
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                     "max_position_embeddings", "type_vocab_size"):
            v = getattr(self, name)
            if not (_is_int(v) and v >= 1):
                _fail(name, "a positive int", v)
        if self.hidden_size % self.num_attention_heads:
            _fail("hidden_size", f"a multiple of num_attention_heads = {self.num_attention_heads}", self.hidden_size)
        if self.hidden_act not in GELU_APPROXIMATE:
            _fail("hidden_act", "one of " + ", ".join(map(repr, GELU_APPROXIMATE)), self.hidden_act)
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"):
            v = getattr(self, name)
            if v is None and name == "classifier_dropout":
                continue  # None means: use hidden_dropout_prob
            if not (_is_real(v) and 0 <= v < 1):
                _fail(name, "a probability p with 0 <= p < 1", v)
        if not (_is_real(self.initializer_range) and 0 <= self.initializer_range < math.inf):
            _fail("initializer_range", "a finite float >= 0", self.initializer_range)
        if not (_is_real(self.layer_norm_eps) and 0 < self.layer_norm_eps < math.inf):
            _fail("layer_norm_eps", "a finite float > 0", self.layer_norm_eps)
        if self.pad_token_id is not None and not (_is_int(self.pad_token_id) and
                                                  0 <= self.pad_token_id < self.vocab_size):
            _fail("pad_token_id", f"None or an int in [0, vocab_size = {self.vocab_size})", self.pad_token_id)
        if self.problem_type not in PROBLEM_TYPES:
            _fail("problem_type", "one of " + ", ".join(map(repr, PROBLEM_TYPES)), self.problem_type)
        if self.problem_type == "single_label_classification" and len(self.id2label) == 1:
            # Same rule as HF: one output with single-label classification is a softmax over one class.
            _fail("problem_type", "not 'single_label_classification' when num_labels = 1 (use 'regression')",
                  self.problem_type)
        if self.architectures is not None and not (isinstance(self.architectures, list) and
                                                   all(isinstance(a, str) for a in self.architectures)):
            _fail("architectures", "None or a list of str", self.architectures)
        _check_labels(self.id2label, self.label2id)
        self._check_extra()

    def _check_extra(self):
        if not isinstance(self.extra, dict):
            _fail("extra", "a dict", self.extra)
        own = {f.name for f in fields(self)} | {"num_labels", "model_type"}
        for key, value in self.extra.items():
            if key in own:
                _fail("extra", f"no key that is a field of BertConfig, but it holds '{key}'", key)
            if key in _ENCODER_ONLY and value != _ENCODER_ONLY[key]:
                # A decoder, cross-attention or relative positions would silently become a different model.
                _fail(key, f"{_ENCODER_ONLY[key]!r} (refbert is BERT's encoder with absolute positions)", value)
            if not _jsonable(value):
                _fail(f"extra['{key}']", "a JSON-serialisable value", value)

    # ---- labels -------------------------------------------------------------------------------------------------

    def _get_num_labels(self):
        return len(self.id2label)

    def _set_num_labels(self, k):
        if not (_is_int(k) and k >= 1):
            _fail("num_labels", "a positive int", k)
        if k == 1 and self.problem_type == "single_label_classification":
            _fail("num_labels", "> 1 with problem_type 'single_label_classification'", k)
        # As HF: the same count keeps custom label names, a new count resets them.
        if k != len(self.id2label):
            self.id2label = _default_labels(k)
            self.label2id = {v: i for i, v in self.id2label.items()}

    @property
    def gelu_approximate(self):
        """The `approximate` argument of ops.gelu_forward that hidden_act means: "none" or "tanh"."""
        return GELU_APPROXIMATE[self.hidden_act]

    # ---- dicts and files ----------------------------------------------------------------------------------------

    def to_dict(self):
        """A flat dict in config.json's layout: model_type "bert", every field, and the extra keys beside them.
        id2label keeps int keys (json writes them as strings)."""
        d = {"model_type": "bert"}
        for f in fields(self):
            if f.name != "extra":
                d[f.name] = getattr(self, f.name)
        d["id2label"] = dict(self.id2label)
        d["label2id"] = dict(self.label2id)
        if self.architectures is not None:
            d["architectures"] = list(self.architectures)
        d.update(json.loads(json.dumps(self.extra)))  # a deep copy: the caller may edit the result freely
        return d

    @classmethod
    def from_dict(cls, d):
        """Build from a dict such as a parsed config.json (HF's or ours). Keys that are not fields go to `extra`;
        `num_labels` is honoured; model_type must be "bert" if present."""
        if not isinstance(d, dict):
            raise ValueError(f"BertConfig.from_dict: argument 'd' expected a dict, got {type(d).__name__}")
        d = dict(d)
        model_type = d.pop("model_type", "bert")
        if model_type != "bert":
            # RoBERTa, DistilBERT, ... share field names but not the model; reading one as BERT would be wrong.
            _fail("model_type", "'bert'", model_type)
        own = {f.name for f in fields(cls)} - {"extra"}
        kwargs = {k: d.pop(k) for k in list(d) if k in own}
        return cls(**kwargs, num_labels=d.pop("num_labels", None), extra=d)

    def to_json_file(self, path):
        """Write config.json, sorted and indented like HF's save_pretrained. `path` is a file, or an existing
        directory to write config.json into. The write is atomic: a temporary file in the same directory is
        renamed over the target, so a crash never leaves half a config. Returns the path written."""
        self.validate()
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"
        write_text(path, text)
        return path

    @classmethod
    def from_json_file(cls, path):
        """Read a config.json. Missing file: FileNotFoundError; not JSON, not an object, or a bad field: ValueError;
        both name the file."""
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise FileNotFoundError(f"BertConfig: config file '{path}' does not exist") from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"BertConfig: config file '{path}' is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"BertConfig: config file '{path}' expected a JSON object, got {type(d).__name__}")
        try:
            return cls.from_dict(d)
        except ValueError as e:
            raise ValueError(f"{e} (in '{path}')") from None

    @classmethod
    def from_pretrained(cls, path):
        """Read `path`/config.json if `path` is a directory (a checkpoint saved by HF or refbert), else the file
        `path`. Local paths only: nothing is downloaded."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        return cls.from_json_file(path)

    # ---- presets ------------------------------------------------------------------------------------------------

    @classmethod
    def preset(cls, name, **overrides):
        """A named size from PRESETS (e.g. "base"), with any field overridden: preset("tiny", vocab_size=1000)."""
        if name not in PRESETS:
            raise ValueError(f"BertConfig.preset: argument 'name' expected one of {', '.join(PRESETS)}, got {name!r}")
        return cls(**{**PRESETS[name], **overrides})


# A dataclass field cannot also be a property, so num_labels is an InitVar (a constructor argument handed to
# __post_init__) and the property takes its name once the dataclass has read the default.
BertConfig.num_labels = property(BertConfig._get_num_labels, BertConfig._set_num_labels,
                                 doc="Number of classifier outputs: len(id2label). Setting k resets the label "
                                     "maps to LABEL_0..LABEL_{k-1} unless k is already the count.")

_dataclass_init = BertConfig.__init__
_FIELDS = frozenset(f.name for f in fields(BertConfig))


def _init(self, **kwargs):
    """BertConfig(**fields) as transformers.BertConfig takes them, so that BertConfig(**config.to_dict()) works:
    model_type (which must be "bert") is accepted, and a key that is no field is kept in `extra` (read back as an
    attribute, written back by to_dict), as HF keeps unknown keys; the known fields are validated."""
    model_type = kwargs.pop("model_type", "bert")
    if model_type != "bert":
        _fail("model_type", "'bert'", model_type)
    unknown = {k: kwargs.pop(k) for k in list(kwargs) if k not in _FIELDS and k != "num_labels"}
    if unknown:
        extra = kwargs.get("extra")
        kwargs["extra"] = {**extra, **unknown} if isinstance(extra, dict) else unknown if extra is None else extra
    _dataclass_init(self, **kwargs)


def _getattr(self, name):
    """An unknown key of the config (in `extra`) reads as an attribute, as in transformers."""
    extra = self.__dict__.get("extra")
    if isinstance(extra, dict) and name in extra:
        return extra[name]
    raise AttributeError(f"'BertConfig' object has no attribute '{name}'")


def _setattr(self, name, value):
    """Setting an attribute that is no field (nor a property) stores it in `extra`, so that to_dict writes it."""
    if name.startswith("_") or name in _FIELDS or hasattr(type(self), name) or "extra" not in self.__dict__:
        object.__setattr__(self, name, value)
    else:
        self.extra[name] = value


BertConfig.__init__ = _init
BertConfig.__getattr__ = _getattr
BertConfig.__setattr__ = _setattr


def _jsonable(value):
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _default_labels(k):
    return {i: f"LABEL_{i}" for i in range(k)}


def _int_keys(name, mapping):
    if not isinstance(mapping, dict):
        _fail(name, "a dict", mapping)
    try:
        return {int(k): v for k, v in mapping.items()}
    except (TypeError, ValueError):
        pass
    _fail(name, "int keys (or strings of ints, as in JSON)", list(mapping))


def _invert(name, mapping):
    if not isinstance(mapping, dict):
        _fail(name, "a dict", mapping)
    return {v: k for k, v in mapping.items()}


def _check_labels(id2label, label2id):
    k = len(id2label)
    if k == 0 or sorted(id2label) != list(range(k)):
        # Label i names output i of the classifier, so the ids must be exactly 0..k-1.
        _fail("id2label", "keys 0..num_labels-1", sorted(id2label))
    if not all(isinstance(v, str) for v in id2label.values()):
        _fail("id2label", "str values", id2label)
    if not isinstance(label2id, dict) or not all(isinstance(n, str) and _is_int(i) for n, i in label2id.items()):
        _fail("label2id", "a dict from str to int", label2id)


# ---- parameter count ------------------------------------------------------------------------------------------------

HEADS = ("BertModel", "BertForPreTraining", "BertForMaskedLM", "BertForNextSentencePrediction",
         "BertForSequenceClassification", "BertForTokenClassification", "BertForQuestionAnswering",
         "BertForMultipleChoice")


def _linear(n_in, n_out):
    return n_in * n_out + n_out  # weight (n_out, n_in) and bias


def count_parameters(config, head="BertModel", num_labels=None):
    """Trainable parameters of the Hugging Face class `head` built on `config`, as torch's named_parameters() counts
    them: a tied weight once. `num_labels` (default config.num_labels) sizes the classifier of the
    SequenceClassification, TokenClassification and QuestionAnswering heads; the other heads ignore it.

    BERT-base (V = 30522, P = 512, H = 768, I = 3072, L = 12) as BertModel: embeddings 23.8M (of which the vocabulary
    23.4M) + 12 layers × 7.1M (attention 2.4M, feed-forward 4.7M) + pooler 0.6M = 109,482,240.
    """
    if head not in HEADS:
        raise ValueError(f"count_parameters: argument 'head' expected one of {', '.join(HEADS)}, got {head!r}")
    if num_labels is None:
        num_labels = config.num_labels
    elif not (_is_int(num_labels) and num_labels >= 1):
        raise ValueError(f"count_parameters: argument 'num_labels' expected a positive int, got {num_labels!r}")
    V, P, T = config.vocab_size, config.max_position_embeddings, config.type_vocab_size
    H, I, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    layernorm = 2 * H  # weight and bias

    # Embeddings: one H-vector per token, position and segment, summed and layer-normed.
    embeddings = V * H + P * H + T * H + layernorm

    # One encoder layer: self-attention (query, key, value, output projection; all heads together are H wide),
    # then the feed-forward H -> I -> H, each sublayer followed by a LayerNorm.
    attention = 4 * _linear(H, H) + layernorm
    feed_forward = _linear(H, I) + _linear(I, H) + layernorm
    encoder = L * (attention + feed_forward)

    # Pooler: a dense tanh layer on the [CLS] vector. HF builds it only for heads that read [CLS].
    pooler = _linear(H, H)
    uses_pooler = head in ("BertModel", "BertForPreTraining", "BertForNextSentencePrediction",
                           "BertForSequenceClassification", "BertForMultipleChoice")
    total = embeddings + encoder + (pooler if uses_pooler else 0)

    # Masked-LM head: a dense + GELU + LayerNorm transform, then the decoder H -> V. The decoder's weight is the
    # word-embedding matrix and its bias is `cls.predictions.bias`, both tied, so only the bias is new; HF unties
    # both when tie_word_embeddings is False.
    mlm = _linear(H, H) + layernorm + V
    if not config.extra.get("tie_word_embeddings", True):
        mlm += V * H + V
    nsp = _linear(H, 2)  # is-next / not-next, from the pooled [CLS]

    if head == "BertForPreTraining":
        total += mlm + nsp
    elif head == "BertForMaskedLM":
        total += mlm
    elif head == "BertForNextSentencePrediction":
        total += nsp
    elif head in ("BertForSequenceClassification", "BertForTokenClassification"):
        total += _linear(H, num_labels)
    elif head == "BertForQuestionAnswering":
        # Start and end logits per token. HF sizes this layer by num_labels (2 by default), not by a constant 2.
        total += _linear(H, num_labels)
    elif head == "BertForMultipleChoice":
        total += _linear(H, 1)  # one score per choice; the softmax runs across the choices
    return total
