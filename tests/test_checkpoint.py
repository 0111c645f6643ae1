"""Checkpoint folders: the errors of a folder that lacks its config, the one line each that from_pretrained prints
for newly initialised and unused weights (tests/test_hf_parity.py does both with HF files), the key names of other
writers (TF-era LayerNorm names, the tied MLM decoder, torch buffers) and the refusals that name their cause. Files
are rewritten with the safetensors package, an independent reader and writer."""
import json
import os
import re
import warnings

import numpy as np
import pytest

import refbert
from peers import peer
from refbert.config import BertConfig

CFG = dict(vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8,
           max_position_embeddings=16)


def test_a_folder_without_config_json_is_a_value_error(tmp_path):
    refbert.BertModel(BertConfig(**CFG), seed=0).save_pretrained(tmp_path / "m")
    os.remove(tmp_path / "m" / "config.json")
    with pytest.raises(ValueError, match=r"m.config\.json: expected the checkpoint's config, found no such file "
                                         r"\(the folder holds \['model.safetensors'\]\)"):
        refbert.BertModel.from_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match=r"argument 'path' expected a checkpoint folder, got .*nowhere"):
        refbert.BertModel.from_pretrained(tmp_path / "nowhere")


def test_id2label_is_checked_and_a_head_trained_for_other_labels_is_named(tmp_path):
    """id2label as a list raised an AttributeError; a classifier saved with 2 labels loaded with 3 blamed
    config.json for the shape (the labels came from the argument)."""
    refbert.BertForSequenceClassification(BertConfig(**CFG), seed=0).save_pretrained(tmp_path / "clf")
    with pytest.raises(ValueError, match=r"argument 'id2label' expected a dict \{id: name\} with ids 0 .. n - 1, "
                                         r"got \['a', 'b'\]"):
        refbert.BertForSequenceClassification.from_pretrained(tmp_path / "clf", id2label=["a", "b"])
    with pytest.raises(ValueError, match=r"key 'classifier.(weight|bias)' expected shape \(3(, 8)?,?\) \(from the 3 "
                                         r"labels of argument 'id2label'\), got \(2(, 8)?,?\): the checkpoint's head "
                                         r"was trained for other labels"):
        refbert.BertForSequenceClassification.from_pretrained(tmp_path / "clf", id2label={0: "a", 1: "b", 2: "c"})
    same = refbert.BertForSequenceClassification.from_pretrained(tmp_path / "clf", id2label={"1": "y", "0": "x"})
    assert same.config.id2label == {0: "x", 1: "y"}


def test_new_and_unused_weights_are_one_line_each_on_stderr(tmp_path, capsys):
    refbert.BertModel(BertConfig(**CFG), seed=0).save_pretrained(tmp_path / "enc")
    refbert.BertForPreTraining(BertConfig(**CFG), seed=0).save_pretrained(tmp_path / "pre")
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # no Python warning (with its file path) any more
        clf = refbert.BertForSequenceClassification.from_pretrained(tmp_path / "enc")
        enc = refbert.BertModel.from_pretrained(tmp_path / "pre")
    new, unused = clf.loading_info["missing_keys"], enc.loading_info["unexpected_keys"]
    assert new == ["classifier.weight", "classifier.bias"] and unused and all(k.startswith("cls.") for k in unused)
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        f"Some weights of BertForSequenceClassification were not initialized from the model checkpoint at "
        f"{tmp_path / 'enc'} and are newly initialized: {new}",
        f"Some weights of the model checkpoint at {tmp_path / 'pre'} were not used when initializing BertModel: "
        f"{unused}"]
    refbert.BertForPreTraining.from_pretrained(tmp_path / "pre")          # nothing new, nothing unused: silent
    assert capsys.readouterr() == ("", "")
    assert np.isfinite(clf.parameters()["classifier.weight"]).all()


def _saved(tmp_path, head="BertForPreTraining"):
    """A tiny `head` with every parameter moved off its initial value (LayerNorm 1/0, zero biases), saved; returns
    the model, the folder, and the file's tensors read by the safetensors package (the independent reader)."""
    st = pytest.importorskip("safetensors.numpy")
    model = getattr(refbert, head)(BertConfig(**CFG), seed=0)
    rng = np.random.default_rng(1)
    for p in model.params.values():
        p += rng.standard_normal(p.shape).astype(p.dtype)
    model.save_pretrained(tmp_path / "saved")
    return model, tmp_path / "saved", st.load_file(str(tmp_path / "saved" / "model.safetensors"))


def _checkpoint(tmp_path, name, config_bytes, tensors, **config_edits):
    """A folder `name` holding `tensors` (written by the safetensors package) and the given config.json, with
    config_edits applied to its JSON."""
    st = pytest.importorskip("safetensors.numpy")
    path = tmp_path / name
    path.mkdir()
    config = json.loads(config_bytes)
    config.update(config_edits)
    (path / "config.json").write_text(json.dumps(config))
    st.save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _same_params(a, b):
    """Equal bit for bit: the float32 values go through a float32 file unchanged, so no tolerance is needed."""
    assert a.params.keys() == b.params.keys()
    for k in a.params:
        np.testing.assert_array_equal(a.params[k], b.params[k], err_msg=k)


def test_tf_era_layernorm_gamma_beta_names_load_as_weight_bias(tmp_path):
    """Checkpoints converted from the original TF BERT name LayerNorm's parameters gamma and beta; they load as
    the same file with weight/bias names does, with nothing missing or unused."""
    model, saved, tensors = _saved(tmp_path)
    old = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): t
           for k, t in tensors.items()}
    assert sum("gamma" in k for k in old) == sum("LayerNorm.weight" in k for k in tensors) == 4   # 2 per layer + 2
    loaded = refbert.BertForPreTraining.from_pretrained(
        _checkpoint(tmp_path, "tf", (saved / "config.json").read_bytes(), old))
    _same_params(loaded, model)
    assert loaded.loading_info == {"missing_keys": [], "unexpected_keys": []}


def test_mlm_decoder_bias_alone_loads_as_predictions_bias(tmp_path):
    """A file whose MLM bias is stored only as cls.predictions.decoder.bias (the tied alias) loads that bias into
    cls.predictions.bias instead of initialising a fresh one."""
    model, saved, tensors = _saved(tmp_path)
    tensors["cls.predictions.decoder.bias"] = tensors.pop("cls.predictions.bias")
    loaded = refbert.BertForPreTraining.from_pretrained(
        _checkpoint(tmp_path, "alias", (saved / "config.json").read_bytes(), tensors))
    np.testing.assert_array_equal(loaded.params["cls.predictions.bias"], model.params["cls.predictions.bias"])
    assert loaded.loading_info == {"missing_keys": [], "unexpected_keys": []}


def test_transformers_state_dict_with_buffers_and_tied_decoder_loads_with_nothing_unused(tmp_path):
    """transformers' own BertForPreTraining as the peer: its full state_dict (tied decoder weight and bias under
    both names) plus its buffers (position_ids, token_type_ids), as checkpoints converted from torch.save carry
    them, loads with no key missing or unused and every parameter equal to the peer's."""
    torch, transformers = peer("torch"), peer("transformers")
    config = transformers.BertConfig(**CFG)
    torch.manual_seed(0)
    hf = transformers.BertForPreTraining(config)
    tensors = {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}
    buffers = {k: v.numpy().copy() for k, v in hf.named_buffers()}
    assert {"bert.embeddings.position_ids", "bert.embeddings.token_type_ids"} <= buffers.keys()
    assert {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"} <= tensors.keys()
    tensors.update(buffers)
    path = _checkpoint(tmp_path, "hf", config.to_json_string(), tensors)
    ours = refbert.BertForPreTraining.from_pretrained(path)
    assert ours.loading_info == {"missing_keys": [], "unexpected_keys": []}
    for k, p in hf.named_parameters():                     # float32 in, float32 out: exact
        np.testing.assert_array_equal(ours.params[k], p.detach().numpy(), err_msg=k)
    np.testing.assert_array_equal(ours.params["bert.embeddings.word_embeddings.weight"],
                                  tensors["cls.predictions.decoder.weight"])


def test_id2label_with_a_gap_is_refused_by_name(tmp_path):
    """Label ids must be 0 .. n - 1: {0: 'a', 2: 'b'} is the argument's error, not a BertConfig field's; ids that
    int() would cut to one (1.7, True) are not ids; their decimal text ("1", as JSON keys come) is."""
    refbert.BertForSequenceClassification(BertConfig(**CFG), seed=0).save_pretrained(tmp_path / "clf")
    ok = refbert.BertForSequenceClassification.from_pretrained(tmp_path / "clf", id2label={"0": "a", 1: "b"})
    assert ok.config.id2label == {0: "a", 1: "b"}
    for bad in ({0: "a", 2: "b"}, {1: "a"}, {}, {0: "a", 1.7: "b"}, {0: "a", True: "b"}):
        with pytest.raises(ValueError, match=rf"^BertForSequenceClassification.from_pretrained: argument 'id2label' "
                                             rf"expected a dict \{{id: name\}} with ids 0 .. n - 1, got "
                                             rf"{re.escape(repr(bad))}$"):
            refbert.BertForSequenceClassification.from_pretrained(tmp_path / "clf", id2label=bad)


def test_untied_word_embeddings_are_refused_naming_config_json(tmp_path):
    """tie_word_embeddings=false in config.json (a decoder separate from the embeddings) is not something refbert
    can load faithfully: a ValueError naming the config file and the key."""
    _, saved, tensors = _saved(tmp_path)
    path = _checkpoint(tmp_path, "untied", (saved / "config.json").read_bytes(), tensors, tie_word_embeddings=False)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path / 'config.json'))}: tie_word_embeddings=false is "
                                         r"not supported"):
        refbert.BertForPreTraining.from_pretrained(path)


def test_encoder_shape_mismatch_blames_config_json_even_with_id2label(tmp_path):
    """With id2label given, only a head key's wrong shape comes from the labels; an encoder key's comes from
    config.json, and the message must say so (not send the user to the labels)."""
    _, saved, tensors = _saved(tmp_path, "BertForSequenceClassification")
    path = _checkpoint(tmp_path, "wider", (saved / "config.json").read_bytes(), tensors, intermediate_size=12)
    with pytest.raises(ValueError) as e:
        refbert.BertForSequenceClassification.from_pretrained(path, id2label={0: "x", 1: "y"})
    assert re.fullmatch(r".*model\.safetensors: key 'bert\.encoder\.layer\.0\.intermediate\.dense\.(weight|bias)' "
                        r"expected shape \(12,( 8)?\) \(from config\.json\), got \(8,( 8)?\)", str(e.value))


def test_saved_file_carries_format_pt_metadata(tmp_path):
    """transformers' loader refuses a safetensors file whose header lacks __metadata__ {"format": "pt"}; the
    safetensors package reads it back from the file save_pretrained wrote."""
    safetensors = pytest.importorskip("safetensors")
    _, saved, _ = _saved(tmp_path, "BertModel")
    with safetensors.safe_open(str(saved / "model.safetensors"), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
