"""refbert against Hugging Face transformers + torch autograd, the independent peer, for every head class.

A random HF model (float64, eager attention, eval) is saved with HF's save_pretrained, loaded with refbert's
from_pretrained, and both run one batch with padding, two segments and -100 labels. Tolerances:
- float64 outputs: 1e-10 absolute — the same float64 math in another order (matmul blocking, reduction order)
  differs by ~1e-15 per op; a few hundred ops keep it far below 1e-10;
- float64 gradients: 1e-8 relative (normwise), for the same reason with more accumulation;
- float32 refbert against float64 HF: 1e-5 (float32 carries ~6e-8 relative per op).
"""
import json
import os

import numpy as np
import pytest

import refbert
from peers import peer
from refbert.check import HEADS, model_batch as batch, tiny_config as tiny
from refbert.gradcheck import rel_error

OUTPUTS = {"BertModel": ["last_hidden_state", "pooler_output"],
           "BertForPreTraining": ["prediction_logits", "seq_relationship_logits", "loss"],
           "BertForQuestionAnswering": ["start_logits", "end_logits", "loss"]}


def hf_model(head, cfg, tmp_path, act="gelu"):
    torch, transformers = peer("torch"), peer("transformers")
    hf_cfg = transformers.BertConfig(**{k: getattr(cfg, k) for k in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
        "max_position_embeddings", "type_vocab_size")}, num_labels=cfg.num_labels, hidden_act=act,
        attn_implementation="eager")
    torch.manual_seed(0)
    m = getattr(transformers, head)(hf_cfg).double().eval()
    with torch.no_grad():  # off HF's init (LayerNorm 1/0, zero biases) so every parameter matters
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    m.save_pretrained(tmp_path)
    return m


def torch_inputs(x):
    return {k: peer("torch").tensor(v) for k, v in x.items()}


@pytest.mark.parametrize("head", HEADS)
def test_outputs_and_every_gradient_match_hf(head, tmp_path, torch):
    cfg = tiny(head)
    act = "gelu_new" if head == "BertForMaskedLM" else "gelu"  # both activations, across the heads
    hf = hf_model(head, cfg, tmp_path, act)
    x = batch(cfg, head)
    ours = getattr(refbert, head).from_pretrained(tmp_path, dtype=np.float64)
    assert not ours.training and not ours.loading_info["missing_keys"]
    out = ours(**x)
    theirs = hf(**torch_inputs(x))
    for field in OUTPUTS.get(head, ["logits", "loss"]):
        a, b = np.asarray(out[field]), theirs[field].detach().numpy()
        assert np.abs(a - b).max() <= 1e-10, (field, np.abs(a - b).max())

    if head == "BertModel":  # features: differentiate sum(D1 * last_hidden_state) + sum(D2 * pooler_output)
        r = np.random.default_rng(1)
        d1, d2 = r.standard_normal(out.last_hidden_state.shape), r.standard_normal(out.pooler_output.shape)
        grads = ours.backward(d1, d2)
        (theirs.last_hidden_state * torch.tensor(d1)).sum().add((theirs.pooler_output * torch.tensor(d2)).sum()).backward()
    else:
        grads = ours.backward()
        theirs.loss.backward()
    hf_grads = {k: p.grad.numpy() for k, p in hf.named_parameters()}
    assert list(hf_grads) == list(grads)
    # a gradient that is 0 by symmetry (the multiple-choice bias shifts every choice alike) comes out as 0 here
    # and 1e-16 in torch: the floor, a millionth of the model's largest gradient, keeps such noise from reading
    # as a 100% error while every gradient of ordinary size is held to 1e-8 relative
    floor = 1e-6 * max(np.abs(g).max() for g in grads.values())
    for k, g in grads.items():
        assert rel_error(g, hf_grads[k], floor) <= 1e-8, (k, rel_error(g, hf_grads[k], floor))


@pytest.mark.parametrize("head", ["BertForNextSentencePrediction", "BertForPreTraining"])
def test_ignored_next_sentence_labels_match_hf(head, tmp_path, torch):
    """A next-sentence label of -100 is ignored, as HF's CrossEntropyLoss ignores it: the loss and every gradient
    equal HF's on a batch whose first row's label is -100 (tolerances as the module's: float64 in another order)."""
    cfg = tiny(head)
    hf = hf_model(head, cfg, tmp_path)
    x = batch(cfg, head)
    x["labels" if head == "BertForNextSentencePrediction" else "next_sentence_label"] = np.array([-100, 1])
    ours = getattr(refbert, head).from_pretrained(tmp_path, dtype=np.float64)
    out, theirs = ours(**x), hf(**torch_inputs(x))
    assert abs(float(out.loss) - theirs.loss.item()) <= 1e-10
    grads = ours.backward()
    theirs.loss.backward()
    floor = 1e-6 * max(np.abs(g).max() for g in grads.values())    # (as test_outputs_and_every_gradient_match_hf)
    for k, p in hf.named_parameters():
        assert rel_error(grads[k], p.grad.numpy(), floor) <= 1e-8, k


def test_float32_load_matches_float64_hf(tmp_path):
    cfg = tiny()
    hf = hf_model("BertForPreTraining", cfg, tmp_path)
    x = batch(cfg, "BertForPreTraining")
    ours = refbert.BertForPreTraining.from_pretrained(tmp_path, dtype=np.float32)
    out, theirs = ours(**x), hf(**torch_inputs(x))
    assert out.prediction_logits.dtype == np.float32
    np.testing.assert_allclose(out.prediction_logits, theirs.prediction_logits.detach().numpy(), rtol=1e-5, atol=1e-5)


def test_a_sharded_checkpoint_loads_as_the_whole_file(tmp_path, torch):
    """HF's save_pretrained with a small max_shard_size writes model-0000k-of-0000n.safetensors and
    model.safetensors.index.json: refbert reads every shard the index names, the same tensors as HF's own
    single-file save, and the outputs HF gives."""
    cfg = tiny()
    hf = hf_model("BertForPreTraining", cfg, tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    files = os.listdir(tmp_path / "sharded")
    assert "model.safetensors.index.json" in files and "model.safetensors" not in files
    assert sum(f.endswith(".safetensors") for f in files) >= 2, files
    one = refbert.BertForPreTraining.from_pretrained(tmp_path / "one", dtype=np.float64)
    sharded = refbert.BertForPreTraining.from_pretrained(tmp_path / "sharded", dtype=np.float64)
    assert one.params.keys() == sharded.params.keys() and not sharded.loading_info["missing_keys"]
    assert all(np.array_equal(one.params[k], sharded.params[k]) for k in one.params)
    x = batch(cfg, "BertForPreTraining")
    out, theirs = sharded(**x), hf(**torch_inputs(x))
    assert np.abs(np.asarray(out.prediction_logits) - theirs.prediction_logits.detach().numpy()).max() <= 1e-10


@pytest.mark.parametrize("head", ["BertForPreTraining", "BertForSequenceClassification", "BertForQuestionAnswering"])
def test_refbert_to_hf_round_trip(head, tmp_path, transformers):
    cfg = tiny(head)
    ours = getattr(refbert, head)(cfg, seed=7, dtype=np.float64).eval()
    for p in ours.parameters().values():
        p += np.random.default_rng(8).standard_normal(p.shape) * 0.1
    ours.save_pretrained(tmp_path / "ckpt")
    assert json.load(open(tmp_path / "ckpt" / "config.json"))["architectures"] == [head]
    hf = getattr(transformers, head).from_pretrained(tmp_path / "ckpt", attn_implementation="eager").double().eval()
    x = batch(cfg, head)
    out, theirs = ours(**x), hf(**torch_inputs(x))
    field = OUTPUTS.get(head, ["logits"])[0]
    assert np.abs(np.asarray(out[field]) - theirs[field].detach().numpy()).max() <= 1e-10
    for k, p in hf.named_parameters():
        np.testing.assert_array_equal(p.detach().numpy(), ours.parameters()[k])  # bit-exact through the file
    again = getattr(refbert, head).from_pretrained(tmp_path / "ckpt", dtype=np.float64)
    for k, p in ours.parameters().items():
        np.testing.assert_array_equal(again.parameters()[k], p)


def test_prefix_either_way_and_fresh_head(tmp_path, capsys):
    """An encoder saved by HF's BertModel (no 'bert.' prefix) loads into a head class, the head initialised fresh
    and listed; a pretraining checkpoint loads into BertModel with the cls.* keys listed as unused: one line on
    stderr each, in the words of transformers' logger."""
    cfg = tiny()
    hf_model("BertModel", cfg, tmp_path / "enc")
    capsys.readouterr()
    clf = refbert.BertForSequenceClassification.from_pretrained(tmp_path / "enc")
    assert clf.loading_info["missing_keys"] == ["classifier.weight", "classifier.bias"]
    assert capsys.readouterr().err == (f"Some weights of BertForSequenceClassification were not initialized from the "
                                       f"model checkpoint at {tmp_path / 'enc'} and are newly initialized: "
                                       f"['classifier.weight', 'classifier.bias']\n")
    hf_model("BertForPreTraining", cfg, tmp_path / "pre")
    capsys.readouterr()
    enc = refbert.BertModel.from_pretrained(tmp_path / "pre")
    assert all(k.startswith("cls.") for k in enc.loading_info["unexpected_keys"])
    err = capsys.readouterr().err
    assert err == (f"Some weights of the model checkpoint at {tmp_path / 'pre'} were not used when initializing "
                   f"BertModel: {enc.loading_info['unexpected_keys']}\n")


def test_bad_checkpoints_name_file_and_key(tmp_path):
    cfg = tiny()
    good = tmp_path / "good"
    hf_model("BertModel", cfg, good)
    weights = good / "model.safetensors"
    data = weights.read_bytes()

    trunc = tmp_path / "trunc"
    trunc.mkdir()
    (trunc / "config.json").write_bytes((good / "config.json").read_bytes())
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="trunc.*model.safetensors"):
        refbert.BertModel.from_pretrained(trunc)

    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "model.safetensors").write_bytes(data)
    c = json.load(open(good / "config.json"))
    c["intermediate_size"] = 21
    (wrong / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match=r"wrong.*model.safetensors: key 'encoder.layer.0.intermediate.dense.(bias|weight)' "
                       r"expected shape \(21,( 12)?\).*got \(20,( 12)?\)"):
        refbert.BertModel.from_pretrained(wrong)

    noconf = tmp_path / "noconf"
    noconf.mkdir()
    (noconf / "model.safetensors").write_bytes(data)
    with pytest.raises(ValueError, match=r"noconf.config\.json: expected the checkpoint's config, found no such file "
                                         r"\(the folder holds \['model.safetensors'\]\)"):
        refbert.BertModel.from_pretrained(noconf)

    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "config.json").write_bytes((good / "config.json").read_bytes())
    from refbert import safetensors_io
    t = safetensors_io.load_file(weights)
    del t["encoder.layer.1.output.dense.weight"]
    safetensors_io.save_file(t, missing / "model.safetensors")
    with pytest.raises(ValueError, match="missing 1 .*encoder.layer.1.output.dense.weight"):
        refbert.BertModel.from_pretrained(missing)

    os.remove(weights)
    with pytest.raises(ValueError, match="expected model.safetensors"):
        refbert.BertModel.from_pretrained(good)
