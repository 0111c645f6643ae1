"""BertConfig against transformers.BertConfig (defaults, config.json both ways) and count_parameters against the
parameters of the real Hugging Face classes, built on torch's meta device (shapes only, no memory, fast). The tests
that need no peer (presets, parameter counts against the paper, bad values) run without torch and transformers."""
import dataclasses
import json
import math
import os
import re

import pytest

from peers import peer
from refbert.config import HEADS, PRESETS, BertConfig, count_parameters

# Fields that HF's BertConfig defines and refbert keeps in `extra` (it has no use for them, but writes them back).
HF_ONLY = {"use_cache", "is_decoder", "add_cross_attention", "bos_token_id", "eos_token_id", "tie_word_embeddings"}
OURS = [f.name for f in dataclasses.fields(BertConfig) if f.name != "extra"] + ["num_labels"]


def to_hf(cfg):
    """The transformers.BertConfig with the same fields (and extras) as `cfg`."""
    d = cfg.to_dict()
    del d["model_type"]
    return peer("transformers").BertConfig(**d)


def assert_same_fields(ours, hf):
    for name in OURS:
        assert getattr(ours, name) == getattr(hf, name), name


def hf_count(cfg, head):
    torch, transformers = peer("torch"), peer("transformers")
    with torch.device("meta"):
        model = getattr(transformers, head)(to_hf(cfg))
    return sum(p.numel() for _, p in model.named_parameters())


# ---- defaults -------------------------------------------------------------------------------------------------------

def test_defaults_equal_hf(transformers):
    assert_same_fields(BertConfig(), transformers.BertConfig())


def test_every_hf_bert_field_is_ours_or_extra(transformers):
    # If HF adds a BERT field, this fails, and we decide whether refbert needs it.
    assert set(transformers.BertConfig.__annotations__) <= set(OURS) | HF_ONLY


def test_gelu_names_follow_hf():
    ACT2CLS = peer("transformers.activations").ACT2CLS
    assert BertConfig().gelu_approximate == "none"
    assert BertConfig(hidden_act="gelu_new").gelu_approximate == "tanh"
    assert BertConfig(hidden_act="gelu_pytorch_tanh").gelu_approximate == "tanh"
    # What HF runs for each name: the exact GELU, and two spellings of the tanh approximation.
    assert ACT2CLS["gelu"].__name__ == "GELUActivation"
    assert ACT2CLS["gelu_new"].__name__ == "NewGELUActivation"
    assert ACT2CLS["gelu_pytorch_tanh"].__name__ == "GELUTanh"


# ---- labels ---------------------------------------------------------------------------------------------------------

def test_num_labels_like_hf(transformers):
    for k in (1, 2, 3, 7):
        ours, hf = BertConfig(num_labels=k), transformers.BertConfig(num_labels=k)
        assert ours.num_labels == k
        assert ours.id2label == hf.id2label and ours.label2id == hf.label2id
    cfg = BertConfig(id2label={"0": "neg", "1": "pos", "2": "neu"})
    assert cfg.id2label == {0: "neg", 1: "pos", 2: "neu"} and cfg.label2id == {"neg": 0, "pos": 1, "neu": 2}
    cfg.num_labels = 3  # same count: names kept
    assert cfg.id2label[2] == "neu"
    cfg.num_labels = 4  # new count: reset, as HF does
    assert cfg.id2label == {i: f"LABEL_{i}" for i in range(4)} and cfg.label2id["LABEL_3"] == 3
    assert BertConfig(label2id={"a": 1, "b": 0}).id2label == {0: "b", 1: "a"}


# ---- presets --------------------------------------------------------------------------------------------------------

def test_presets():
    assert BertConfig.preset("base") == BertConfig()
    shapes = {name: (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.intermediate_size)
              for name in PRESETS for c in [BertConfig.preset(name)]}
    assert shapes == {"tiny": (2, 128, 2, 512), "mini": (4, 256, 4, 1024), "small": (4, 512, 8, 2048),
                      "medium": (8, 512, 8, 2048), "base": (12, 768, 12, 3072), "large": (24, 1024, 16, 4096)}
    assert all(BertConfig.preset(name).vocab_size == 30522 for name in PRESETS)
    cfg = BertConfig.preset("tiny", vocab_size=1000, num_labels=3)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_labels) == (1000, 128, 3)
    with pytest.raises(ValueError, match="tiny, mini, small, medium, base, large, got 'huge'"):
        BertConfig.preset("huge")


# ---- count_parameters -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("name", list(PRESETS))
def test_count_parameters_equals_hf(name, head):
    cfg = BertConfig.preset(name)
    assert count_parameters(cfg, head) == hf_count(cfg, head)


# An odd shape, so that no term can hide behind another (T != 2, P != 512, I != 4H, a tiny vocabulary).
ODD = dict(vocab_size=1000, max_position_embeddings=77, type_vocab_size=5, hidden_size=48, num_attention_heads=3,
           intermediate_size=100, num_hidden_layers=3)


@pytest.mark.parametrize("head", HEADS)
def test_count_parameters_odd_shape_and_three_labels(head):
    cfg = BertConfig(**ODD, num_labels=3)
    n = hf_count(cfg, head)
    assert count_parameters(cfg, head) == n
    # num_labels= overrides the config's count.
    assert count_parameters(BertConfig(**ODD), head, num_labels=3) == n
    tiny = BertConfig.preset("tiny", num_labels=3)
    assert count_parameters(tiny, head) == hf_count(tiny, head)


@pytest.mark.parametrize("head", ["BertForPreTraining", "BertForMaskedLM"])
def test_count_parameters_untied_decoder(head):
    cfg = BertConfig(**ODD, extra={"tie_word_embeddings": False})
    tied = count_parameters(BertConfig(**ODD), head)
    assert count_parameters(cfg, head) == hf_count(cfg, head) == tied + (1000 * 48 + 1000)


def test_paper_sizes():
    # Devlin et al. (2019), section 3: BERT_BASE "Total Parameters=110M", BERT_LARGE "Total Parameters=340M", i.e.
    # rounded to the nearest 10M. The paper does not say which heads it counts; the encoder alone and the full
    # pre-training model both round to the published numbers.
    for head in ("BertModel", "BertForPreTraining"):
        assert 105e6 <= count_parameters(BertConfig.preset("base"), head) < 115e6
        assert 335e6 <= count_parameters(BertConfig.preset("large"), head) < 345e6
    assert count_parameters(BertConfig()) == 109_482_240


def test_count_parameters_bad_arguments():
    with pytest.raises(ValueError, match="argument 'head' expected one of BertModel, .*got 'BertLMHeadModel'"):
        count_parameters(BertConfig(), "BertLMHeadModel")
    with pytest.raises(ValueError, match="argument 'num_labels' expected a positive int, got 0"):
        count_parameters(BertConfig(), "BertForSequenceClassification", num_labels=0)


# ---- config.json, both ways -----------------------------------------------------------------------------------------

def custom():
    return BertConfig.preset("small", hidden_act="gelu_new", hidden_dropout_prob=0.2, classifier_dropout=0.3,
                             id2label={0: "neg", 1: "pos", 2: "neu"}, problem_type="single_label_classification",
                             architectures=["BertForSequenceClassification"], pad_token_id=3, vocab_size=1234)


@pytest.mark.parametrize("make", [BertConfig, lambda: BertConfig(num_labels=3), custom])
def test_hf_reads_ours(tmp_path, make, transformers):
    ours = make()
    written = ours.to_json_file(tmp_path)
    assert written == os.path.join(tmp_path, "config.json")
    assert os.listdir(tmp_path) == ["config.json"]  # the temporary file was renamed, not left behind
    hf = transformers.BertConfig.from_pretrained(tmp_path)
    assert_same_fields(ours, hf)
    assert BertConfig.from_pretrained(tmp_path) == ours


@pytest.mark.parametrize("kwargs", [{}, {"num_labels": 3},
                                    {"id2label": {0: "neg", 1: "pos", 2: "neu"}, "label2id": {"neg": 0, "pos": 1,
                                     "neu": 2}, "hidden_act": "gelu_pytorch_tanh", "type_vocab_size": 1,
                                     "architectures": ["BertForMaskedLM"], "problem_type": "regression"}])
def test_ours_reads_hf(tmp_path, kwargs, transformers):
    hf = transformers.BertConfig(**kwargs)
    hf.save_pretrained(tmp_path / "hf")
    ours = BertConfig.from_pretrained(tmp_path / "hf")
    assert_same_fields(ours, hf)
    # Everything HF wrote that refbert does not use is kept and written back with the same value.
    assert ours.extra["transformers_version"] == transformers.__version__
    assert ours.extra["use_cache"] is True and ours.extra["is_decoder"] is False
    ours.to_json_file(tmp_path / "ours.json")
    theirs = json.loads((tmp_path / "hf" / "config.json").read_text())
    again = json.loads((tmp_path / "ours.json").read_text())
    assert {k: again[k] for k in theirs} == theirs


def test_json_layout(tmp_path):
    path = tmp_path / "c.json"
    BertConfig(num_labels=3, extra={"zzz": [1, 2]}).to_json_file(path)
    text = path.read_text()
    d = json.loads(text)
    assert text == json.dumps(d, indent=2, sort_keys=True) + "\n"
    assert d["model_type"] == "bert" and d["id2label"] == {"0": "LABEL_0", "1": "LABEL_1", "2": "LABEL_2"}
    assert "num_labels" not in d and d["zzz"] == [1, 2]
    BertConfig(num_labels=5).to_json_file(path)  # over an existing file
    assert BertConfig.from_json_file(path).num_labels == 5
    assert sorted(os.listdir(tmp_path)) == ["c.json"]


def test_from_dict_keeps_unknown_keys():
    d = {"model_type": "bert", "hidden_size": 64, "num_attention_heads": 4, "torch_dtype": "float32",
         "position_embedding_type": "absolute", "output_hidden_states": False, "id2label": {"0": "a", "1": "b"},
         "gradient_checkpointing": False}
    cfg = BertConfig.from_dict(d)
    assert cfg.hidden_size == 64 and cfg.id2label == {0: "a", 1: "b"}
    assert cfg.extra == {"torch_dtype": "float32", "position_embedding_type": "absolute",
                         "output_hidden_states": False, "gradient_checkpointing": False}
    assert BertConfig.from_dict(cfg.to_dict()) == cfg
    assert BertConfig.from_dict({"num_labels": 4}).num_labels == 4
    assert d["id2label"] == {"0": "a", "1": "b"}  # the input dict is left alone


# ---- bad input ------------------------------------------------------------------------------------------------------

BAD = [
    ("vocab_size", 0), ("vocab_size", 3.0), ("hidden_size", -8), ("num_hidden_layers", 0), ("num_attention_heads", 0),
    ("intermediate_size", True), ("max_position_embeddings", 0), ("type_vocab_size", 0),
    ("hidden_size", 100),  # not a multiple of 12 heads
    ("hidden_act", "relu"), ("hidden_act", "gelu_fast"),
    ("hidden_dropout_prob", 1.0), ("hidden_dropout_prob", -0.1), ("attention_probs_dropout_prob", 1),
    ("classifier_dropout", 1.5), ("initializer_range", -0.02), ("layer_norm_eps", 0.0),
    ("pad_token_id", -1), ("pad_token_id", 30522), ("problem_type", "ranking"), ("architectures", "BertModel"),
    ("id2label", {1: "a", 2: "b"}), ("id2label", {"x": "a"}), ("id2label", {0: 5}), ("label2id", {"a": "0"}),
    ("num_labels", 0), ("num_labels", 2.0),
]


@pytest.mark.parametrize("name,value", BAD)
def test_bad_value_names_the_field(name, value):
    with pytest.raises(ValueError, match=f"BertConfig: field '{name}' expected .*, got"):
        BertConfig(**{name: value})


@pytest.mark.parametrize("key,value", [("is_decoder", True), ("add_cross_attention", True),
                                       ("is_encoder_decoder", True), ("position_embedding_type", "relative_key"),
                                       ("model_type", "roberta")])
def test_not_an_encoder_names_the_key(key, value):
    with pytest.raises(ValueError, match=f"field '{key}' expected"):
        BertConfig.from_dict({key: value})


def test_other_bad_labels_and_extras():
    with pytest.raises(ValueError, match="field 'num_labels' expected len\\(id2label\\) = 2"):
        BertConfig(id2label={0: "a", 1: "b"}, num_labels=3)
    with pytest.raises(ValueError, match="field 'problem_type'"):
        BertConfig(num_labels=1, problem_type="single_label_classification")
    cfg = BertConfig(problem_type="single_label_classification")
    with pytest.raises(ValueError, match="field 'num_labels'"):
        cfg.num_labels = 1
    with pytest.raises(ValueError, match="field 'extra' .*'hidden_size'"):
        BertConfig(extra={"hidden_size": 5})
    with pytest.raises(ValueError, match="field 'extra\\['x'\\]' expected a JSON-serialisable value"):
        BertConfig(extra={"x": object()})
    cfg = BertConfig()
    cfg.hidden_size = 7  # changed by hand: validate() and to_json_file catch it
    with pytest.raises(ValueError, match="field 'hidden_size'"):
        cfg.validate()


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json' does not exist"):
        BertConfig.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="nope.json"):
        BertConfig.from_json_file(tmp_path / "nope.json")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="config.json' is not valid JSON"):
        BertConfig.from_pretrained(tmp_path)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json' expected a JSON object, got list"):
        BertConfig.from_pretrained(bad)
    bad.write_text('{"hidden_act": "swish"}')
    with pytest.raises(ValueError, match="field 'hidden_act'.*config.json"):
        BertConfig.from_pretrained(bad)


# ---- the constructor takes what to_dict gives, as HF's does ---------------------------------------------------------

def test_constructor_takes_its_own_to_dict():
    # transformers.BertConfig(**config.to_dict()) works (model_type included, unknown keys kept as attributes); so
    # does refbert's, and the known fields are still checked
    for cfg in (BertConfig(), custom(), BertConfig(num_labels=3, extra={"zzz": [1, 2]})):
        assert BertConfig(**cfg.to_dict()) == cfg
    cfg = BertConfig(num_labels=3, foo=1, extra={"zzz": 2})
    assert cfg.foo == 1 and cfg.zzz == 2 and cfg.extra == {"zzz": 2, "foo": 1} and cfg.to_dict()["foo"] == 1
    cfg.bar = [3]                                       # a new attribute is a key of the config, as in HF
    assert cfg.to_dict()["bar"] == [3] and BertConfig(**cfg.to_dict()).bar == [3]
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        cfg.nope
    with pytest.raises(ValueError, match="field 'model_type' expected 'bert', got 'roberta'"):
        BertConfig(model_type="roberta")
    with pytest.raises(ValueError, match="field 'hidden_size' expected a positive int, got 0"):
        BertConfig(hidden_size=0, foo=1)
    with pytest.raises(ValueError, match="field 'is_decoder' expected False"):
        BertConfig(is_decoder=True)
    with pytest.raises(ValueError, match=r"field 'extra\['f'\]' expected a JSON-serialisable value"):
        BertConfig(f=object())


def test_constructor_takes_hf_to_dict_both_ways(transformers):
    hf = transformers.BertConfig(num_labels=3, hidden_act="gelu_new", foo=1)
    ours = BertConfig(**hf.to_dict())                   # model_type, transformers_version, use_cache, ... kept
    assert_same_fields(ours, hf)
    assert ours.foo == hf.foo == 1 and ours.extra["use_cache"] is True
    back = transformers.BertConfig(**ours.to_dict())
    assert_same_fields(ours, back) and back.foo == 1
    assert {k: v for k, v in back.to_dict().items() if k != "transformers_version"} == \
        {k: v for k, v in hf.to_dict().items() if k != "transformers_version"}


# ---- what a mutation audit found uncaught ---------------------------------------------------------------------------

MORE_BAD = [
    ("initializer_range", math.inf), ("initializer_range", math.nan), ("layer_norm_eps", math.inf),
    ("layer_norm_eps", True),                  # a bool is not a number here, though Python's bool is an int
    ("attention_probs_dropout_prob", False),
    ("hidden_dropout_prob", None),             # None means "use hidden_dropout_prob" for classifier_dropout only
    ("id2label", {}),                          # zero labels: no classifier to build
]


@pytest.mark.parametrize("name,value", MORE_BAD)
def test_more_bad_values_name_the_field(name, value):
    """Values outside a field's documented range (an infinite std or epsilon, a bool where a real number is meant, a
    missing dropout probability, an empty label map) are refused with a ValueError naming the field, what it
    expected and the value that came."""
    got = re.escape(repr(sorted(value)) if isinstance(value, dict) else repr(value))
    with pytest.raises(ValueError, match=f"BertConfig: field '{name}' expected .*, got {got}$"):
        BertConfig(**{name: value})


def test_preset_overrides_beat_the_preset():
    """preset(name, **overrides) takes the preset's sizes and then the caller's: an override of a field the preset
    itself sets (hidden_size, heads, layers) wins, as the docstring's "with any field overridden" promises."""
    cfg = BertConfig.preset("tiny", hidden_size=64, num_attention_heads=4, num_hidden_layers=3)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size) == (3, 64, 4, 512)


def test_to_json_file_refuses_a_config_made_invalid_by_hand(tmp_path):
    """A field changed by hand after construction is checked again before writing: no invalid config.json (one HF or
    refbert would refuse to load) reaches the disk."""
    cfg = BertConfig()
    cfg.hidden_size = 7
    with pytest.raises(ValueError, match="field 'hidden_size' expected a multiple of num_attention_heads = 12, got 7"):
        cfg.to_json_file(tmp_path / "config.json")
    assert os.listdir(tmp_path) == []


def test_extra_cannot_carry_model_type():
    """model_type is written by to_dict itself ("bert"); an extra key of that name would overwrite it in config.json
    and turn the file into another model's, so it is refused like any other key that is not extra's to hold."""
    with pytest.raises(ValueError, match="field 'extra' expected no key that is a field of BertConfig.*'model_type'"):
        BertConfig(extra={"model_type": "roberta"})


def test_config_keeps_its_own_copies():
    """The config holds its own architectures list (a tuple becomes a list, as JSON has no tuples) and to_dict hands
    out a deep copy of the extra keys, so editing what went in or came out never changes the config."""
    arch = ["BertForMaskedLM"]
    cfg = BertConfig(architectures=arch, extra={"zzz": [1, 2]})
    arch.append("BertModel")
    assert cfg.architectures == ["BertForMaskedLM"]
    assert BertConfig(architectures=("BertModel",)).architectures == ["BertModel"]
    cfg.to_dict()["zzz"].append(3)
    assert cfg.extra == {"zzz": [1, 2]}
