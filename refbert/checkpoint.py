"""Hugging Face checkpoint folders in and out: config.json + model.safetensors (or a sharded index).

Loading is all-or-nothing: every file is read and every key and shape checked before a model is returned, so a
corrupt file, a shape mismatch or a missing encoder weight raises a ValueError naming the file and the key, and never
yields a half-loaded model. As in HF, head weights the file does not have (a classifier on a pretrained encoder) are
freshly initialised and keys the class does not use are ignored; each list is printed as one line on stderr, as
transformers' logger does, and both land in `model.loading_info`.
"""
import copy
import json
import os
import sys

import numpy as np

from . import safetensors_io
from .config import BertConfig
from .fileio import folder

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
ENCODER = ("embeddings.", "encoder.")      # must be in the file; anything else may be (re)initialised


def _read_tensors(path, dtype):
    """{key: array} from model.safetensors or the shards named by model.safetensors.index.json."""
    single, index = os.path.join(path, WEIGHTS), os.path.join(path, INDEX)
    if os.path.isfile(single):
        return safetensors_io.load_file(single, dtype=dtype), single
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: expected a JSON object with a 'weight_map', got an unreadable file ({e})") from None
        tensors = {}
        for shard in shards:
            tensors.update(safetensors_io.load_file(os.path.join(path, shard), dtype=dtype))
        return tensors, index
    found = sorted(os.listdir(path))
    hint = " (PyTorch pickles are not read: re-save with safe_serialization=True)" \
        if "pytorch_model.bin" in found else ""
    raise ValueError(f"{path}: expected {WEIGHTS} or {INDEX}, found {found}{hint}")


def _normalise(tensors, prefix):
    """Map a file's keys to refbert's: old TF-era LayerNorm names, the 'bert.' prefix either way, buffers dropped."""
    out = {}
    for key, t in tensors.items():
        key = key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        if key.endswith("position_ids") or key.endswith("token_type_ids"):
            continue                                    # buffers some checkpoints carry, not parameters
        if prefix and key.startswith(("embeddings.", "encoder.", "pooler.")):
            key = prefix + key                          # a bare BertModel file into a head class
        elif not prefix and key.startswith("bert."):
            key = key[len("bert."):]                    # a head's file into BertModel
        out[key] = t
    # the MLM decoder is tied: its weight is the word embedding, its bias is cls.predictions.bias
    out.pop("cls.predictions.decoder.weight", None)
    bias = out.pop("cls.predictions.decoder.bias", None)
    if bias is not None:
        out.setdefault("cls.predictions.bias", bias)
    return out


def _label_id(i):
    """A label id as HF's config takes it: an integer, or its decimal text (JSON's keys are strings). int() alone
    would also take 1.7 (as 1) and True (as 1): those are refused (ValueError)."""
    if isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_)):
        return int(i)
    if isinstance(i, str) and i.strip().lstrip("-").isdigit():
        return int(i)
    raise ValueError(f"not an integer id: {i!r}")


def load_pretrained(cls, path, dtype=np.float32, backend="numpy", id2label=None):
    """cls.from_pretrained(path): a model in eval mode, as HF's from_pretrained returns. id2label ({id: name})
    replaces the checkpoint's labels, as for a classifier head about to be fine-tuned (HF's num_labels= / id2label=)."""
    if not os.path.isdir(path):
        raise ValueError(f"{cls.__name__}.from_pretrained: argument 'path' expected a checkpoint folder, got {path!r}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{os.path.join(path, 'config.json')}: expected the checkpoint's config, found no such file "
                         f"(the folder holds {sorted(os.listdir(path))})")
    config = BertConfig.from_pretrained(path)
    if id2label is not None:
        try:
            ids = sorted(_label_id(i) for i in id2label) if isinstance(id2label, dict) else None
        except (TypeError, ValueError):
            ids = None
        if not ids or ids != list(range(len(ids))):
            raise ValueError(f"{cls.__name__}.from_pretrained: argument 'id2label' expected a dict {{id: name}} "
                             f"with ids 0 .. n - 1, got {id2label!r:.80}")
        config.id2label = {_label_id(i): str(n) for i, n in id2label.items()}
        config.label2id = {n: i for i, n in config.id2label.items()}
        config.validate()
    if not config.extra.get("tie_word_embeddings", True):
        raise ValueError(f"{os.path.join(path, 'config.json')}: tie_word_embeddings=false is not supported "
                         f"(BERT ties the MLM decoder to the word embeddings)")
    tensors, source = _read_tensors(path, np.dtype(dtype))
    model = cls(config, dtype=dtype, backend=backend)
    want = model.params
    tensors = _normalise(tensors, model.prefix)
    for key, t in tensors.items():
        if key in want and t.shape != want[key].shape:
            head = not key[len(model.prefix):].startswith(ENCODER)
            why = (f"the {len(config.id2label)} labels of argument 'id2label'" if id2label is not None and head
                   else "config.json")
            raise ValueError(f"{source}: key '{key}' expected shape {want[key].shape} (from {why}), got {t.shape}"
                             + (": the checkpoint's head was trained for other labels (start from a folder without "
                                "that head, e.g. a pretraining run's)" if why != "config.json" else ""))
    missing = [k for k in want if k not in tensors]
    encoder_missing = [k for k in missing if k[len(model.prefix):].startswith(ENCODER)]
    if encoder_missing:
        raise ValueError(f"{source}: expected every encoder weight, missing {len(encoder_missing)} "
                         f"(first: '{encoder_missing[0]}')")
    unexpected = sorted(k for k in tensors if k not in want)
    to_device = getattr(model.ops, "to_device", None)      # a device backend ("cuda") keeps its parameters there
    for key in want:
        if key in tensors:
            want[key] = np.ascontiguousarray(tensors[key], dtype=model.dtype)
            if to_device is not None:
                want[key] = to_device(want[key])
    # one line each on stderr, in the words of transformers' (4.x) logger, rather than warnings with file paths
    if missing:
        print(f"Some weights of {cls.__name__} were not initialized from the model checkpoint at {path} and are "
              f"newly initialized: {missing}", file=sys.stderr)
    if unexpected:
        print(f"Some weights of the model checkpoint at {path} were not used when initializing {cls.__name__}: "
              f"{unexpected}", file=sys.stderr)
    model.loading_info = {"missing_keys": missing, "unexpected_keys": unexpected}
    return model.eval()


def save_pretrained(model, path):
    """Write config.json and model.safetensors so that transformers' from_pretrained loads an equal model.
    A new folder appears whole (written beside it, then renamed); in an existing folder both files are written
    first and then renamed over the old ones (refbert.fileio.folder), so a failed save leaves the old checkpoint
    whole: never a truncated file, nor new weights beside an old config."""
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    with folder(path) as target:
        to_host = getattr(model.ops, "to_host", None)       # a device backend's parameters, copied back first
        params = dict(model.params) if to_host is None else {k: to_host(v) for k, v in model.params.items()}
        safetensors_io.save_file(params, os.path.join(target, WEIGHTS), metadata={"format": "pt"})
        config.to_json_file(os.path.join(target, "config.json"))

__all__ = ["load_pretrained", "save_pretrained"]
