"""Pretraining data: documents -> sentence-pair instances -> masked-LM batches, as google-research/bert's
create_pretraining_data.py (plus ALBERT's sentence-order prediction and n-gram masking), with Hugging Face's array
names and label conventions.

The pipeline is four plain functions and one class:

    documents = read_documents("corpus.txt")          # blank line between documents, one sentence per line
    instances = create_instances(documents, tokenizer, max_seq_length=128, rng=np.random.default_rng(0))
    tokens, positions, labels = mask_tokens(instances[0].tokens, vocab_tokens, rng)
    arrays = encode([masked_instance], tokenizer, max_seq_length=128)   # int64 arrays, HF names
    data = PretrainingData(documents, tokenizer, seed=0)             # all of it, deterministic from the seed
    for batch in data.batches(epoch=0, batch_size=32): ...

The tokenizer is any object with `.tokenize(str) -> list[str]` and `.vocab` (a dict token -> id holding [CLS],
[SEP], [MASK], [PAD] and [UNK]); Hugging Face's BertTokenizer(Fast) qualifies. Randomness comes only from
`np.random.Generator`s passed in, or, in PretrainingData, seeded from (seed, purpose, epoch) through NumPy's
SeedSequence, so the same seed gives the same batches in any process (no set or hash order is ever iterated).

Where google and Hugging Face differ, this module follows google, and says so in the docstring concerned:
- the number of masked positions is fixed per sequence (google), not Bernoulli(masked_lm_prob) per token (HF's
  DataCollatorForLanguageModeling);
- a random replacement is drawn uniformly from the whole vocabulary, special tokens included ([CLS], [SEP], [PAD],
  [MASK], [unused*]); google and HF's collator both do this.
Labels follow both: next_sentence_label 0 = "B follows A" and 1 = "B is random" (NSP) or "A and B swapped" (SOP);
MLM labels are -100 except at masked positions.
"""
import os
from typing import NamedTuple

import numpy as np

SPECIAL_TOKENS = ("[CLS]", "[SEP]", "[MASK]", "[PAD]", "[UNK]")
NOT_MASKABLE = ("[CLS]", "[SEP]", "[PAD]")
NEXT_SENTENCE = ("nsp", "sop", None)
IGNORE_INDEX = -100


class Instance(NamedTuple):
    """One training sequence. `tokens` is [CLS] A [SEP] B [SEP] (or [CLS] A [SEP] without a sentence task);
    `segment_ids` is 0 over [CLS] A [SEP] and 1 over B [SEP]; `next_sentence_label` is 0/1 (None without a sentence
    task). After masking, `tokens` holds the masked tokens, `masked_positions` the sorted masked indices and
    `masked_labels` the original tokens there."""
    tokens: tuple
    segment_ids: tuple
    next_sentence_label: object
    masked_positions: tuple = ()
    masked_labels: tuple = ()


# --- argument checks ------------------------------------------------------------------------------------------

def _is_int(x):
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_int(fn, name, x, lo, why=""):
    if not _is_int(x) or x < lo:
        raise ValueError(f"{fn}: argument '{name}' expected an integer >= {lo}{why}, got {x!r}")


def _check_prob(fn, name, x, open_low, open_high):
    ok = isinstance(x, (int, float, np.floating, np.integer)) and not isinstance(x, bool)
    ok = ok and (0 < x if open_low else 0 <= x) and (x < 1 if open_high else x <= 1)
    if not ok:
        interval = ("(" if open_low else "[") + "0, 1" + (")" if open_high else "]")
        raise ValueError(f"{fn}: argument '{name}' expected a probability in {interval}, got {x!r}")


def _check_rng(fn, rng):
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"{fn}: argument 'rng' expected a numpy.random.Generator, got {type(rng).__name__}")


def _check_next_sentence(fn, next_sentence):
    if next_sentence not in NEXT_SENTENCE:
        raise ValueError(f"{fn}: argument 'next_sentence' expected one of 'nsp', 'sop' or None, got {next_sentence!r}")


def _check_max_seq_length(fn, max_seq_length):
    _check_int(fn, "max_seq_length", max_seq_length, 5, " ([CLS] A [SEP] B [SEP] with at least one token in A and B)")


def _vocab(fn, tokenizer):
    """The tokenizer's vocab dict, checked for `.tokenize` and the special tokens."""
    if not callable(getattr(tokenizer, "tokenize", None)):
        raise ValueError(f"{fn}: argument 'tokenizer' expected an object with .tokenize(str) -> list[str], "
                         f"got {type(tokenizer).__name__}")
    vocab = getattr(tokenizer, "vocab", None)
    if not isinstance(vocab, dict):
        raise ValueError(f"{fn}: argument 'tokenizer' expected a .vocab dict (token -> id), got {type(vocab).__name__}")
    missing = [t for t in SPECIAL_TOKENS if t not in vocab]
    if missing:
        raise ValueError(f"{fn}: argument 'tokenizer' expected a vocab containing {', '.join(SPECIAL_TOKENS)}, "
                         f"got a vocab of {len(vocab)} tokens without {', '.join(missing)}")
    return vocab


def _check_documents(fn, documents):
    if isinstance(documents, (str, bytes)) or not hasattr(documents, "__iter__"):
        raise ValueError(f"{fn}: argument 'documents' expected a list of documents (lists of sentence strings), "
                         f"got {type(documents).__name__}")
    documents = list(documents)
    for i, doc in enumerate(documents):
        if isinstance(doc, (str, bytes)) or not hasattr(doc, "__iter__"):
            raise ValueError(f"{fn}: argument 'documents' expected a list of documents (lists of sentence strings), "
                             f"got {type(doc).__name__} at index {i}")
        for s in doc:
            if not isinstance(s, str):
                raise ValueError(f"{fn}: argument 'documents' expected sentence strings, got {type(s).__name__} "
                                 f"in document {i}")
    return documents


# --- reading -------------------------------------------------------------------------------------------------

def read_documents(lines_or_path):
    """Split a corpus into documents: one sentence per line, documents separated by blank lines (google's input
    format). `lines_or_path` is a path (str or os.PathLike, read as UTF-8) or an iterable of lines (str or UTF-8
    bytes; to pass text, pass `text.splitlines()`). Each line is stripped of surrounding whitespace; runs of blank
    lines count as one separator, so no document is empty. Returns a list of documents, each a list of sentence
    strings. Raises ValueError if the corpus holds no non-blank line."""
    if isinstance(lines_or_path, (str, os.PathLike)):
        from .fileio import utf8_named
        with open(lines_or_path, encoding="utf-8") as f, utf8_named(lines_or_path):
            lines = f.read().splitlines()
    elif isinstance(lines_or_path, bytes) or not hasattr(lines_or_path, "__iter__"):
        raise ValueError(f"read_documents: argument 'lines_or_path' expected a path or an iterable of lines, "
                         f"got {type(lines_or_path).__name__}")
    else:
        lines = lines_or_path
    documents, current = [], []
    for line in lines:
        if isinstance(line, bytes):
            line = line.decode("utf-8")
        if not isinstance(line, str):
            raise ValueError(f"read_documents: argument 'lines_or_path' expected lines of text, "
                             f"got a {type(line).__name__}")
        line = line.strip()
        if line:
            current.append(line)
        elif current:
            documents.append(current)
            current = []
    if current:
        documents.append(current)
    if not documents:
        raise ValueError("read_documents: argument 'lines_or_path' expected at least one non-empty document "
                         "(sentences one per line, documents separated by blank lines), got no non-blank line")
    return documents


# --- instances -----------------------------------------------------------------------------------------------

def truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng):
    """google's truncate_seq_pair: while len(a) + len(b) > max_num_tokens, drop one token from the longer of the two
    (from b on a tie), from its front or its back with probability 1/2 each, so truncation does not always cut
    the same end. Returns new lists (a, b); the inputs are not modified. Each result is a contiguous slice of its
    input."""
    _check_int("truncate_seq_pair", "max_num_tokens", max_num_tokens, 0)
    _check_rng("truncate_seq_pair", rng)
    a, b = list(tokens_a), list(tokens_b)
    # Trimming by index bounds keeps this O(len) instead of O(len^2) for very long lines.
    bounds = [[0, len(a)], [0, len(b)]]
    while (bounds[0][1] - bounds[0][0]) + (bounds[1][1] - bounds[1][0]) > max_num_tokens:
        k = 0 if bounds[0][1] - bounds[0][0] > bounds[1][1] - bounds[1][0] else 1
        if rng.random() < 0.5:
            bounds[k][0] += 1
        else:
            bounds[k][1] -= 1
    return a[bounds[0][0]:bounds[0][1]], b[bounds[1][0]:bounds[1][1]]


def _instance(tokens_a, tokens_b, label):
    tokens = ["[CLS]"] + tokens_a + ["[SEP]"]
    segment_ids = [0] * len(tokens)
    if tokens_b is not None:
        tokens += tokens_b + ["[SEP]"]
        segment_ids += [1] * (len(tokens_b) + 1)
    return Instance(tuple(tokens), tuple(segment_ids), label)


def _instances_from_document(docs, d, max_seq_length, short_seq_prob, next_sentence, rng):
    """google's create_instances_from_document for document `docs[d]` (lists of token lists), with ALBERT's SOP
    and a no-sentence-task mode; see create_instances for the semantics."""
    document = docs[d]
    max_num_tokens = max_seq_length - (2 if next_sentence is None else 3)
    # Drawn once per document, as google does: every instance of a "short" document aims at the short length.
    target_seq_length = max_num_tokens
    if rng.random() < short_seq_prob:
        target_seq_length = int(rng.integers(2, max_num_tokens + 1))
    instances, chunk, length, i = [], [], 0, 0
    while i < len(document):
        chunk.append(document[i])
        length += len(document[i])
        # Under SOP a chunk closes only once it holds two sentences (or the document ends), see create_instances.
        if i == len(document) - 1 or (length >= target_seq_length and (next_sentence != "sop" or len(chunk) >= 2)):
            if next_sentence is None:
                tokens_a = [t for seg in chunk for t in seg]
                tokens_a, _ = truncate_seq_pair(tokens_a, [], max_num_tokens, rng)
                instances.append(_instance(tokens_a, None, None))
            elif next_sentence == "sop" and len(chunk) < 2:
                pass  # SOP needs two consecutive pieces of one document; ALBERT would take a random B here
            else:
                a_end = int(rng.integers(1, len(chunk))) if len(chunk) >= 2 else 1
                tokens_a = [t for seg in chunk[:a_end] for t in seg]
                if next_sentence == "nsp" and (len(chunk) == 1 or rng.random() < 0.5):
                    label = 1
                    target_b_length = target_seq_length - len(tokens_a)
                    # Uniform over the other documents (google retries up to 10 times for one that differs);
                    # a one-document corpus has no other, so B comes from the same document, at a random start.
                    r = d
                    if len(docs) > 1:
                        r = int(rng.integers(len(docs) - 1))
                        r += r >= d
                    random_document = docs[r]
                    tokens_b = []
                    for j in range(int(rng.integers(len(random_document))), len(random_document)):
                        tokens_b.extend(random_document[j])
                        if len(tokens_b) >= target_b_length:
                            break
                    i -= len(chunk) - a_end  # put the unused segments back: they start the next chunk
                else:
                    tokens_b = [t for seg in chunk[a_end:] for t in seg]
                    label = 0
                    if next_sentence == "sop" and rng.random() < 0.5:
                        tokens_a, tokens_b, label = tokens_b, tokens_a, 1
                tokens_a, tokens_b = truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng)
                instances.append(_instance(tokens_a, tokens_b, label))
            chunk, length = [], 0
        i += 1
    return instances


def create_instances(documents, tokenizer, max_seq_length=128, short_seq_prob=0.1, next_sentence="nsp", *, rng):
    """Sentence-pair instances from documents, as google's create_training_instances (one pass, dupe_factor 1)
    followed by a shuffle of the instances.

    Each sentence is tokenized; sentences that tokenize to nothing and documents left empty are dropped. Per
    document: max_num_tokens = max_seq_length - 3 ([CLS], [SEP], [SEP]); target_seq_length = max_num_tokens, or,
    with probability `short_seq_prob`, uniform in [2, max_num_tokens] (drawn once per document, as google). Sentences
    are gathered into a chunk until its length reaches the target or the document ends; then A = the chunk's first
    a_end sentences, a_end uniform in [1, len(chunk) - 1] (1 for a one-sentence chunk), and B depends on
    `next_sentence`:

    - "nsp" (BERT): with probability 1/2, or always for a one-sentence chunk, B is random (label 1): taken from a
      document drawn uniformly among the others, from a uniformly drawn sentence on, sentence by sentence until it
      holds target_seq_length - len(A) tokens or that document ends; the chunk's unused sentences are put back and
      start the next chunk. Otherwise B is the rest of the chunk (label 0, "B follows A"). Choice for a corpus of
      one document: it has no other document, so a random B comes from that same document (which google's 10
      retries also end up doing); it then may happen to be the true continuation, so its label is noisy.
    - "sop" (ALBERT): B is the rest of the chunk, and A and B are swapped with probability 1/2 (label 1 =
      swapped), so A and B are always consecutive text of one document. Two choices differ from ALBERT's code,
      which gives a one-sentence chunk a random B from another document (NSP's task, not SOP's): a chunk closes
      at the target length only once it holds two sentences (a sentence longer than the target takes the next
      one along, and truncation cuts the pair), and a one-sentence chunk at the end of a document is skipped, so
      a one-sentence document gives no instance.
    - None: no sentence task: the whole chunk is one segment, [CLS] A [SEP], with max_num_tokens = max_seq_length
      - 2; the label is None.

    The pair is cut to max_num_tokens by truncate_seq_pair, so a sentence longer than max_seq_length is cut, not
    rejected. Returns the list of unmasked Instances, shuffled with `rng` (a numpy.random.Generator, keyword-only);
    it may be empty under "sop" when no document has two sentences."""
    return _create_instances("create_instances", documents, tokenizer, max_seq_length, short_seq_prob,
                             next_sentence, rng)


def _create_instances(fn, documents, tokenizer, max_seq_length, short_seq_prob, next_sentence, rng):
    documents = _check_documents(fn, documents)
    _vocab(fn, tokenizer)
    _check_max_seq_length(fn, max_seq_length)
    _check_prob(fn, "short_seq_prob", short_seq_prob, False, False)
    _check_next_sentence(fn, next_sentence)
    _check_rng(fn, rng)
    docs = []
    for doc in documents:
        tokenized = [list(tokenizer.tokenize(s)) for s in doc]
        tokenized = [t for t in tokenized if t]
        if tokenized:
            docs.append(tokenized)
    if not docs:
        raise ValueError(f"{fn}: argument 'documents' expected at least one non-empty document, got "
                         f"{len(documents)} document(s) with no token")
    instances = []
    for d in range(len(docs)):
        instances.extend(_instances_from_document(docs, d, max_seq_length, short_seq_prob, next_sentence, rng))
    order = rng.permutation(len(instances))
    return [instances[k] for k in order]


# --- masking -------------------------------------------------------------------------------------------------

def _candidate_words(tokens, whole_word):
    """Maskable positions grouped into words, per segment. [CLS], [SEP] and [PAD] are never candidates and end a
    segment. With whole_word, a "##" piece joins the word of the position just before it (a "##" piece right after
    a special token starts a word of its own; google's code would glue it to the word before the [SEP])."""
    segments, words = [], []
    for i, tok in enumerate(tokens):
        if tok in NOT_MASKABLE:
            if words:
                segments.append(words)
                words = []
            continue
        if whole_word and tok.startswith("##") and words:   # words is reset at each special: words[-1] ends at i-1
            words[-1].append(i)
        else:
            words.append([i])
    if words:
        segments.append(words)
    return segments


def _choose_spans(segments, num_to_predict, ngram, rng):
    """Pick spans to mask, ALBERT's n-gram scheme. Every candidate word is a span start; the starts are shuffled;
    for each start (until num_to_predict positions are chosen) draw n in 1..min(ngram, words left in the segment)
    with P(n) proportional to 1/n, take the n words from the start, shorten n while the span would exceed the
    budget, skip it if even one word exceeds the budget or if it overlaps a chosen position. ngram=1 is google's
    scheme. Spans never cross [SEP]. Returns [(positions, n_drawn), ...] in the order chosen."""
    inv = 1.0 / np.arange(1, ngram + 1)
    starts = [(s, k) for s, words in enumerate(segments) for k in range(len(words))]
    covered = np.zeros(max((w[-1][-1] + 1 for w in segments), default=0), dtype=bool)
    chosen, n_chosen = [], 0
    for idx in rng.permutation(len(starts)):
        if n_chosen >= num_to_predict:
            break
        s, k = starts[idx]
        words = segments[s]
        avail = min(ngram, len(words) - k)
        n = 1 if avail == 1 else int(rng.choice(avail, p=inv[:avail] / inv[:avail].sum())) + 1
        n_drawn = n
        positions = [p for w in words[k:k + n] for p in w]
        while n_chosen + len(positions) > num_to_predict and n > 1:
            n -= 1
            positions = [p for w in words[k:k + n] for p in w]
        if n_chosen + len(positions) > num_to_predict or covered[positions].any():
            continue
        covered[positions] = True
        n_chosen += len(positions)
        chosen.append((positions, n_drawn))
    return chosen


def _mask(tokens, vocab_tokens, rng, masked_lm_prob, max_predictions_per_seq, whole_word, ngram):
    num_to_predict = min(max_predictions_per_seq, max(1, round(len(tokens) * masked_lm_prob)))
    spans = _choose_spans(_candidate_words(tokens, whole_word), num_to_predict, ngram, rng)
    output = list(tokens)
    positions = sorted(p for span, _ in spans for p in span)
    for p in positions:
        u = rng.random()
        if u < 0.8:
            output[p] = "[MASK]"
        elif u < 0.9:
            output[p] = vocab_tokens[int(rng.integers(len(vocab_tokens)))]
        # else: keep the original token
    return output, positions, [tokens[p] for p in positions]


def mask_tokens(tokens, vocab_tokens, rng, masked_lm_prob=0.15, max_predictions_per_seq=20, whole_word=False,
                ngram=1):
    """google's create_masked_lm_predictions, with ALBERT's n-gram option.

    Budget: num_to_predict = min(max_predictions_per_seq, max(1, round(len(tokens) * masked_lm_prob))), counting
    every token, [CLS] and [SEP] included (google; Python's round, half to even), a fixed count per sequence, where
    HF's collator masks each token with probability masked_lm_prob instead. Candidates: every position but [CLS],
    [SEP] and [PAD]. With `whole_word`, a word (a piece and the "##" pieces right after it) is masked whole or not
    at all, and a word that would overrun the budget is skipped (google), so fewer than num_to_predict positions
    may be chosen. With `ngram` > 1 (ALBERT), a span of n consecutive candidates (words, with whole_word) is
    masked, n drawn in 1..ngram with P(n) proportional to 1/n (fewer near the end of a segment), see _choose_spans.
    Each chosen position becomes [MASK] with probability 0.8, a token drawn uniformly from `vocab_tokens` (the
    whole vocabulary, special tokens included, as google and HF) with probability 0.1, and stays unchanged with
    probability 0.1.

    Returns (output_tokens, positions, labels): the masked copy of `tokens` (a list), the chosen positions in
    increasing order, and the original tokens there."""
    fn = "mask_tokens"
    if isinstance(tokens, (str, bytes)) or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{fn}: argument 'tokens' expected a sequence of token strings, got {type(tokens).__name__}")
    if isinstance(vocab_tokens, (str, bytes, dict)) or len(vocab_tokens) == 0 or "[MASK]" not in vocab_tokens:
        raise ValueError(f"{fn}: argument 'vocab_tokens' expected a non-empty sequence of vocabulary tokens "
                         f"containing '[MASK]', got {type(vocab_tokens).__name__} of {len(vocab_tokens)} tokens "
                         f"without it")
    _check_rng(fn, rng)
    _check_prob(fn, "masked_lm_prob", masked_lm_prob, True, True)
    _check_int(fn, "max_predictions_per_seq", max_predictions_per_seq, 1)
    _check_int(fn, "ngram", ngram, 1)
    vocab_tokens = list(vocab_tokens)
    return _mask(list(tokens), vocab_tokens, rng, masked_lm_prob, max_predictions_per_seq, bool(whole_word), ngram)


# --- arrays --------------------------------------------------------------------------------------------------

def encode(instances, tokenizer, max_seq_length):
    """Instances as HF-named int64 arrays, each sequence padded to max_seq_length with [PAD]:
    input_ids (B, T), token_type_ids (B, T) (0 on padding), attention_mask (B, T) (1 on real tokens),
    labels (B, T) (-100 except at masked positions, where it holds the original token's id; all -100 for an
    unmasked instance) and next_sentence_label (B,) (left out when the instances have no sentence task, i.e.
    labels None). Every token must be in tokenizer.vocab."""
    fn = "encode"
    vocab = _vocab(fn, tokenizer)
    _check_max_seq_length(fn, max_seq_length)
    instances = list(instances)
    if not instances or not all(isinstance(x, Instance) for x in instances):
        raise ValueError(f"{fn}: argument 'instances' expected a non-empty list of Instance, got "
                         f"{len(instances)} item(s) of types {sorted({type(x).__name__ for x in instances})}")
    with_label = [x.next_sentence_label is not None for x in instances]
    if any(with_label) and not all(with_label):
        raise ValueError(f"{fn}: argument 'instances' expected next_sentence_label on all instances or on none, "
                         f"got it on {sum(with_label)} of {len(instances)}")
    B, T = len(instances), max_seq_length
    out = {"input_ids": np.full((B, T), vocab["[PAD]"], dtype=np.int64),
           "token_type_ids": np.zeros((B, T), dtype=np.int64),
           "attention_mask": np.zeros((B, T), dtype=np.int64),
           "labels": np.full((B, T), IGNORE_INDEX, dtype=np.int64)}

    def ids(b, toks):
        try:
            return [vocab[t] for t in toks]
        except KeyError as e:
            raise ValueError(f"{fn}: argument 'instances' expected tokens in tokenizer.vocab, got {e.args[0]!r} "
                             f"in instance {b}") from None

    for b, x in enumerate(instances):
        n = len(x.tokens)
        if n > T or len(x.segment_ids) != n:
            raise ValueError(f"{fn}: argument 'instances' expected at most max_seq_length = {T} tokens and one "
                             f"segment id per token, got {n} tokens and {len(x.segment_ids)} segment ids "
                             f"in instance {b}")
        out["input_ids"][b, :n] = ids(b, x.tokens)
        out["token_type_ids"][b, :n] = x.segment_ids
        out["attention_mask"][b, :n] = 1
        if x.masked_positions:
            out["labels"][b, list(x.masked_positions)] = ids(b, x.masked_labels)
    if all(with_label):
        out["next_sentence_label"] = np.array([x.next_sentence_label for x in instances], dtype=np.int64)
    return out


# --- the whole pipeline --------------------------------------------------------------------------------------

_INSTANCES, _MASKS, _ORDER = 0, 1, 2   # SeedSequence streams: default_rng([seed, purpose, ...])


class PretrainingData:
    """Pretraining batches for BertForPreTraining, every draw determined by `seed`.

    The instances are built once by create_instances (from default_rng([seed, 0])). Masking (mask_tokens, with
    `masked_lm_prob`, `max_predictions_per_seq`, `whole_word`, `ngram`) is:
    - dynamic (default, RoBERTa-style): epoch e masks every instance afresh, from default_rng([seed, 1, e]);
    - static (google): dupe_factor masked copies are made up front, copy c from default_rng([seed, 1, c]), and
      epoch e uses copy e % dupe_factor. google's dupe_factor also re-draws the A/B split of each copy; here the
      instances are shared by all copies and only the masks differ.
    Within an epoch the instances are masked in index order, so the masks do not depend on batch_size; then
    `batches` visits them in the order default_rng([seed, 2, e]).permutation (e % dupe_factor under static masking,
    so a static epoch repeats exactly with period dupe_factor, as a reread file of dupe_factor copies would). Under
    static masking epoch e < dupe_factor equals dynamic epoch e. The same (seed, epoch) gives identical batches in
    any process, so a resumed run sees the same data.
    """

    def __init__(self, documents, tokenizer, max_seq_length=128, short_seq_prob=0.1, next_sentence="nsp",
                 masked_lm_prob=0.15, max_predictions_per_seq=20, whole_word=False, ngram=1, dynamic=True,
                 dupe_factor=10, seed=0):
        fn = "PretrainingData"
        vocab = _vocab(fn, tokenizer)
        _check_max_seq_length(fn, max_seq_length)
        _check_prob(fn, "masked_lm_prob", masked_lm_prob, True, True)
        _check_int(fn, "max_predictions_per_seq", max_predictions_per_seq, 1)
        _check_int(fn, "ngram", ngram, 1)
        _check_int(fn, "dupe_factor", dupe_factor, 1)
        _check_int(fn, "seed", seed, 0)
        _check_prob(fn, "short_seq_prob", short_seq_prob, False, False)
        _check_next_sentence(fn, next_sentence)
        self.tokenizer, self.max_seq_length, self.next_sentence = tokenizer, int(max_seq_length), next_sentence
        self.dynamic, self.dupe_factor, self.seed = bool(dynamic), int(dupe_factor), int(seed)
        self._mask_args = (masked_lm_prob, int(max_predictions_per_seq), bool(whole_word), int(ngram))
        self.vocab_tokens = sorted(vocab, key=vocab.__getitem__)   # ordered by id
        self.instances = _create_instances(fn, documents, tokenizer, max_seq_length, short_seq_prob, next_sentence,
                                           np.random.default_rng([self.seed, _INSTANCES]))
        if not self.instances:
            raise ValueError(f"{fn}: argument 'documents' expected documents that give at least one instance, got "
                             f"none (next_sentence='sop' needs a document of at least two sentences)")
        self._static = None if self.dynamic else [self._masked(c) for c in range(self.dupe_factor)]

    def __len__(self):
        return len(self.instances)

    def _masked(self, e):
        rng = np.random.default_rng([self.seed, _MASKS, e])
        out = []
        for x in self.instances:
            tokens, positions, labels = _mask(list(x.tokens), self.vocab_tokens, rng, *self._mask_args)
            out.append(x._replace(tokens=tuple(tokens), masked_positions=tuple(positions),
                                  masked_labels=tuple(labels)))
        return out

    def masked_instances(self, epoch):
        """The masked instances of `epoch`, in index order."""
        _check_int("PretrainingData.masked_instances", "epoch", epoch, 0)
        return self._masked(int(epoch)) if self.dynamic else self._static[int(epoch) % self.dupe_factor]

    def batches(self, epoch, batch_size, shuffle=True, drop_last=False):
        """Yield the batches of `epoch` as encode's dicts of int64 arrays (input_ids, token_type_ids,
        attention_mask, labels, next_sentence_label), each padded to max_seq_length. With `shuffle` the instances
        come in a seeded per-epoch order (see the class docstring), else in index order; with `drop_last` a final
        batch smaller than batch_size is left out."""
        fn = "PretrainingData.batches"
        _check_int(fn, "epoch", epoch, 0)
        _check_int(fn, "batch_size", batch_size, 1)
        masked = self.masked_instances(epoch)
        order = np.arange(len(masked))
        if shuffle:
            e = int(epoch) if self.dynamic else int(epoch) % self.dupe_factor
            order = np.random.default_rng([self.seed, _ORDER, e]).permutation(len(masked))
        stop = len(order) - len(order) % batch_size if drop_last else len(order)
        for start in range(0, stop, batch_size):
            yield encode([masked[k] for k in order[start:start + batch_size]], self.tokenizer, self.max_seq_length)
