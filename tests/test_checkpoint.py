"""Checkpoint folders without a peer: the errors of a folder that lacks its config, and the one line each that
from_pretrained prints for newly initialised and unused weights (tests/test_hf_parity.py does both with HF files)."""
import os
import warnings

import numpy as np
import pytest

import refbert
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
