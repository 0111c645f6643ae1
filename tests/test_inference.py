"""`refbert predict`, `refbert fill-mask` and `refbert embed` against an independent peer: HF transformers + PyTorch
running the very folder refbert reads (a randomly initialised HF model, saved by HF), with HF's own fast tokenizer.
Each printed number must be the peer's; everything stays on this machine (no download)."""
import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")

from refbert import cli  # noqa: E402

WORDS = ("open read write close file path line text name data list dict key value table row column sort find "
         "load save send copy move").split()
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, "##s", "##ed", "##ing", "the", "a", "of", "to"]
MAX_POS = 24            # small, so that a long text must be cut to the model's positions


def hf_folder(tmp_path, head, **config):
    """An HF BERT of class `head` with random weights (a wide initializer_range spreads the logits, so that no two
    scores tie within float32 noise), saved with its tokenizer; returns (folder, the HF model in eval mode, the
    HF tokenizer)."""
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    tok = transformers.BertTokenizerFast.from_pretrained(tmp_path / "tok")
    assert len(tok) == len(VOCAB) and tok("open the files")["input_ids"] == [2, 5, 32, 9, 29, 3]
    cfg = transformers.BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=MAX_POS, initializer_range=0.5,
                                  **config)
    torch.manual_seed(0)
    model = getattr(transformers, head)(cfg).eval()
    folder = tmp_path / head
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder, model, tok


def printed(capsys):
    """The JSON lines the command printed."""
    return [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]


def test_predict_gives_the_peers_label_and_probabilities(tmp_path, capsys):
    """Sequence classification, text pairs included, and a text longer than the model's positions (cut to
    MAX_POS): the label is the peer's argmax and each probability its softmax, printed to 4 decimals (so within
    5e-5, plus float32 noise ~1e-6 between two float32 forwards: tolerance 1e-4)."""
    labels = {0: "neg", 1: "neu", 2: "pos"}
    folder, hf, tok = hf_folder(tmp_path, "BertForSequenceClassification", id2label=labels,
                                label2id={v: k for k, v in labels.items()})
    texts = ["open the file", "sort a list of rows", " ".join(WORDS * 3)]
    pairs = ["close it", "find the key", "save data"]
    capsys.readouterr()
    argv = ["predict", str(folder)]
    for t, p in zip(texts, pairs):
        argv += ["--text", t, "--text-pair", p]
    assert cli.main(argv) == 0
    got = printed(capsys)
    assert len(got) == len(texts)
    for res, t, p in zip(got, texts, pairs):
        enc = tok(t, p, truncation=True, max_length=MAX_POS, return_tensors="pt")
        with torch.no_grad():
            prob = torch.softmax(hf(**enc).logits[0].double(), -1).numpy()
        assert res["label"] == labels[int(prob.argmax())], (t, res, prob)
        assert sorted(res["probabilities"]) == sorted(labels.values())
        for j, name in labels.items():
            assert res["probabilities"][name] == pytest.approx(prob[j], abs=1e-4), (t, name)


def test_predict_tags_each_word_by_its_first_piece(tmp_path, capsys):
    """Token classification: each word's tag is the peer's argmax at the word's first word piece (words split
    into pieces: "files" -> file ##s); words past the model's positions (cut away) are tagged "O"."""
    labels = {0: "O", 1: "B-X", 2: "I-X"}
    folder, hf, tok = hf_folder(tmp_path, "BertForTokenClassification", id2label=labels,
                                label2id={v: k for k, v in labels.items()})
    words = ("opened files reading rows sorted lists " + " ".join(WORDS)).split()   # > MAX_POS pieces
    capsys.readouterr()
    assert cli.main(["predict", str(folder), "--text", " ".join(words)]) == 0
    (res,) = printed(capsys)
    enc = tok(" ".join(words), truncation=True, max_length=MAX_POS, return_tensors="pt")
    with torch.no_grad():
        pred = hf(**enc).logits[0].argmax(-1).tolist()
    first = {}
    for t, w in enumerate(enc.word_ids(0)):
        if w is not None:
            first.setdefault(w, t)
    want = [labels[pred[first[w]]] if w in first else "O" for w in range(len(words))]
    assert len(first) < len(words)                      # some words were cut away
    assert len(set(want[:len(first)])) > 1              # the tags differ: a wrong piece would show
    assert res == {"tokens": words, "tags": want}


def test_fill_mask_gives_the_peers_top_tokens_and_probabilities(tmp_path, capsys):
    """The top-k tokens of each [MASK], in order, and their probabilities: the peer's softmax at that position
    (4 decimals printed: tolerance 1e-4)."""
    folder, hf, tok = hf_folder(tmp_path, "BertForMaskedLM")
    text = "open the [MASK] and read a [MASK]"
    capsys.readouterr()
    assert cli.main(["fill-mask", str(folder), text, "--top-k", "4"]) == 0
    (res,) = printed(capsys)
    enc = tok(text, return_tensors="pt")
    with torch.no_grad():
        logits = hf(**enc).logits[0].double()
    where = (enc["input_ids"][0] == tok.mask_token_id).nonzero().flatten().tolist()
    assert len(res["masks"]) == len(where) == 2
    for got, t in zip(res["masks"], where):
        p = torch.softmax(logits[t], -1).numpy()
        top = np.argsort(-p)[:4]
        assert [g["token"] for g in got] == tok.convert_ids_to_tokens(top.tolist())
        assert [g["score"] for g in got] == pytest.approx(p[top].tolist(), abs=1e-4)


def test_embed_mean_and_cls_pooling_are_the_peers(tmp_path, capsys):
    """--pooling mean: the mean of the last hidden states over each text's real tokens (padding excluded), for
    texts of different lengths read from a file (blank lines skipped) over more than one batch of 32; --pooling
    cls: the pooler output. Against the peer's float32 forward: both are float32 sums of O(1) values in another
    order, so within 1e-5."""
    folder, hf, tok = hf_folder(tmp_path, "BertModel")
    texts = [" ".join(WORDS[i % 7:i % 7 + 1 + i % 5]) for i in range(37)]
    f = tmp_path / "texts.txt"
    f.write_text("\n".join(texts[:20]) + "\n\n   \n" + "\n".join(texts[20:]) + "\n")
    capsys.readouterr()
    assert cli.main(["embed", str(folder), "--file", str(f), "--out", str(tmp_path / "mean.npy")]) == 0
    assert cli.main(["embed", str(folder), "--text", texts[0], "--text", texts[4], "--pooling", "cls",
                     "--out", str(tmp_path / "cls.npy")]) == 0
    mean, cls = np.load(tmp_path / "mean.npy"), np.load(tmp_path / "cls.npy")
    enc = tok(texts, padding=True, return_tensors="pt")
    assert len(set(enc["attention_mask"].sum(1).tolist())) > 1        # lengths differ: padding matters
    with torch.no_grad():
        o = hf(**enc)
    m = enc["attention_mask"][..., None].float()
    want = ((o.last_hidden_state * m).sum(1) / m.sum(1)).numpy()
    assert mean.shape == (len(texts), 32)
    np.testing.assert_allclose(mean, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cls, o.pooler_output[[0, 4]].numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("side", [-0.5, 0.5, float("inf")])
def test_predict_answers_with_the_peers_best_span(tmp_path, capsys, side):
    """Question answering: the answer is the context's characters from the start of the best span's first token to
    the end of its last (the fast tokenizer's offsets), the best span the BERT paper's: start + end logits of the
    peer, start <= end, both in the context, at most 30 tokens; the null answer ("", start None) when the [CLS]
    score beats it by more than --null-threshold. The threshold is set half a logit either side of the peer's own
    margin (null - best), and at inf (never null). Spans are compared exactly: the peer's best beats the runner-up
    by more than float32 noise between the two forwards (1e-4, asserted), so both pick the same."""
    folder, hf, tok = hf_folder(tmp_path, "BertForQuestionAnswering")
    question, context = "find the key", "open the files sort a list of rows save data"
    enc = tok(question, context, truncation="longest_first", max_length=MAX_POS, return_offsets_mapping=True)
    off = enc.pop("offset_mapping")
    with torch.no_grad():
        out = hf(**{k: torch.tensor([v]) for k, v in enc.items()})
    start, end = out.start_logits[0].double().numpy(), out.end_logits[0].double().numpy()
    ctx = [t for t, (tt, (a, b)) in enumerate(zip(enc["token_type_ids"], off)) if tt == 1 and b > a]
    spans = sorted(((start[s] + end[e], s, e) for s in ctx for e in ctx if s <= e < s + 30), reverse=True)
    assert spans[0][0] - spans[1][0] > 1e-4
    best, s, e = spans[0]
    threshold = start[0] + end[0] - best + side                    # side < 0: null; side > 0: the span
    capsys.readouterr()
    assert cli.main(["predict", str(folder), "--question", question, "--context", context,
                     "--null-threshold", repr(float(threshold))]) == 0
    (res,) = printed(capsys)
    if side < 0:
        assert res["answer"] == "" and res["start"] is None, res
    else:
        assert res["answer"] == context[off[s][0]:off[e][1]] and res["start"] == off[s][0], (res, s, e)
        assert res["answer"]                                   # a span of at least one token's characters
