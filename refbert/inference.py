"""Using a trained model: `refbert predict`, `refbert fill-mask`, `refbert embed`, on a refbert run's model or any
HF BERT folder (config.json + model.safetensors + vocab.txt). Results are printed as JSON, one line per input.
"""
import json
import os

import numpy as np

from . import model as M
from . import ops
from .config import BertConfig
from .errors import UserError
from .fileio import utf8_named


def _probs(z):
    """Probabilities from logits, in float64 (the oracle's softmax)."""
    return ops.softmax_forward(np.asarray(z, np.float64))[0]


def _load(path, default_head, backend="numpy"):
    from .tokenization import BertTokenizer
    if not os.path.isdir(path):
        raise UserError(f"model: expected a model folder (config.json, model.safetensors, vocab.txt), got {path!r}")
    config = BertConfig.from_pretrained(path)
    head = (config.architectures or [default_head])[0]
    if not hasattr(M, head):
        raise UserError(f"{path}: architecture {head!r} is not one refbert implements")
    return getattr(M, head).from_pretrained(path, backend=backend), BertTokenizer.from_pretrained(path)


def _require(model, prefix, path, what):
    """Refuse to answer with weights from_pretrained had to initialise at random."""
    if any(k.startswith(prefix) for k in model.loading_info["missing_keys"]):
        raise UserError(f"{path}: expected {what}; its weights are not in this checkpoint")


def _max_len(args, model):
    return min(args.max_seq_length, model.config.max_position_embeddings)


def predict(args):
    """Classification / pair: label and probabilities; ner: a tag per word; qa: the answer span."""
    from .train import qa_context_mask
    model, tok = _load(args.model, "BertForSequenceClassification", args.backend)
    id2label = model.config.id2label
    name = type(model).__name__
    if name == "BertForQuestionAnswering":
        if not (args.question and args.context):
            raise UserError("predict: a question-answering model needs --question and --context")
        enc = tok(args.question, args.context, truncation="longest_first", max_length=_max_len(args, model),
                  return_tensors="np", return_offsets_mapping=True)
        o = model(input_ids=enc["input_ids"], token_type_ids=enc["token_type_ids"], attention_mask=enc["attention_mask"])
        ctx = qa_context_mask(enc)
        s, e, score = M.decode_qa_span(o.start_logits, o.end_logits, context_mask=ctx,
                                       null_score_diff_threshold=args.null_threshold)[0]
        off = enc["offset_mapping"][0]
        answer = args.context[off[s][0]:off[e][1]] if s > 0 else ""
        print(json.dumps({"answer": answer, "start": int(off[s][0]) if s else None, "score": score}))
        return 0
    if name not in ("BertForSequenceClassification", "BertForNextSentencePrediction", "BertForTokenClassification"):
        raise UserError(f"predict: {args.model} holds a {name}, which has no classification head; use "
                        f"fill-mask or embed with it, or fine-tune it first")
    if not args.text:
        raise UserError(f"predict: a {name} needs --text")
    if args.text_pair and len(args.text_pair) != len(args.text):
        raise UserError(f"predict: expected one --text-pair per --text, got {len(args.text_pair)} for "
                        f"{len(args.text)}")
    for i, text in enumerate(args.text):
        pair = args.text_pair[i] if args.text_pair else None
        if name == "BertForTokenClassification":
            words = text.split()
            enc = tok(" ".join(words), return_tensors="np", return_offsets_mapping=True, truncation=True,
                      max_length=_max_len(args, model))
            o = model(input_ids=enc["input_ids"], token_type_ids=enc["token_type_ids"],
                      attention_mask=enc["attention_mask"])
            starts, pos = [], 0
            for w in words:
                starts.append(pos)
                pos += len(w) + 1
            tags = []
            for ws in starts:                            # the tag of a word is its first piece's
                t = next((t for t, (s, e) in enumerate(enc["offset_mapping"][0]) if e > s and s == ws), None)
                tags.append(id2label[int(o.logits[0, t].argmax())] if t is not None else "O")
            print(json.dumps({"tokens": words, "tags": tags}, ensure_ascii=False))
            continue
        enc = tok(text, pair, truncation=True, max_length=_max_len(args, model), return_tensors="np")
        o = model(input_ids=enc["input_ids"], token_type_ids=enc["token_type_ids"], attention_mask=enc["attention_mask"])
        p = _probs(o.logits[0])
        print(json.dumps({"label": id2label[int(p.argmax())],
                          "probabilities": {id2label[j]: round(float(v), 4) for j, v in enumerate(p)}}))
    return 0


def fill_mask(args):
    """The top-k tokens for each [MASK] of each text."""
    model, tok = _load(args.model, "BertForMaskedLM", args.backend)
    if type(model).__name__ not in ("BertForMaskedLM", "BertForPreTraining"):
        model = M.BertForMaskedLM.from_pretrained(args.model, backend=args.backend)
    _require(model, "cls.predictions.", args.model, "an MLM head (a pretrained model, not a fine-tuned one)")
    for text in args.text:
        enc = tok(text, return_tensors="np", truncation=True, max_length=_max_len(args, model))
        ids = enc["input_ids"][0]
        where = np.flatnonzero(ids == tok.mask_token_id) if tok.mask_token is not None else np.zeros(0, int)
        if not where.size:
            whole = tok(text)["input_ids"] if tok.mask_token is not None else []
            if tok.mask_token is not None and tok.mask_token_id in whole:
                raise UserError(f"fill-mask: expected a {tok.mask_token} within the first {len(ids)} tokens "
                                f"(--max-seq-length), got one at token {whole.index(tok.mask_token_id)} of "
                                f"{len(whole)}: truncated away")
            raise UserError(f"fill-mask: expected a {tok.mask_token or 'mask token (this tokenizer has none)'} in the "
                            f"text, got {text!r}")
        o = model(input_ids=enc["input_ids"], token_type_ids=enc["token_type_ids"], attention_mask=enc["attention_mask"])
        logits = o["prediction_logits"] if "prediction_logits" in o else o["logits"]
        res = []
        for t in where:
            p = _probs(logits[0, t])
            top = np.argsort(-p)[:args.top_k]
            res.append([{"token": tok.convert_ids_to_tokens([int(j)])[0], "score": round(float(p[j]), 4)} for j in top])
        print(json.dumps({"text": text, "masks": res}, ensure_ascii=False))
    return 0


def embed(args):
    """Sentence embeddings (mean of the last hidden states over real tokens, or the pooler output), saved as .npy."""
    from .tokenization import BertTokenizer
    tok = BertTokenizer.from_pretrained(args.model)
    model = M.BertModel.from_pretrained(args.model, backend=args.backend)
    if args.pooling == "cls":
        _require(model, "pooler.", args.model, "a pooler (use --pooling mean)")
    texts = list(args.text or [])
    if args.file:
        with open(args.file, encoding="utf-8") as f, utf8_named(args.file):
            texts += [ln.strip() for ln in f if ln.strip()]
    if not texts:
        raise UserError("embed: expected --text or --file with at least one line")
    vecs = []
    for i in range(0, len(texts), 32):
        enc = tok(texts[i:i + 32], padding=True, truncation=True, max_length=_max_len(args, model), return_tensors="np")
        o = model(input_ids=enc["input_ids"], token_type_ids=enc["token_type_ids"], attention_mask=enc["attention_mask"])
        if args.pooling == "cls":
            vecs.append(o.pooler_output)
        else:
            m = enc["attention_mask"][..., None].astype(o.last_hidden_state.dtype)
            vecs.append((o.last_hidden_state * m).sum(1) / m.sum(1))
    vecs = np.concatenate(vecs)
    if args.out:
        np.save(args.out, vecs)
        print(json.dumps({"saved": args.out, "shape": list(vecs.shape)}))
    else:
        for t, v in zip(texts, vecs):
            print(json.dumps({"text": t, "embedding": [round(float(x), 5) for x in v]}, ensure_ascii=False))
    return 0
