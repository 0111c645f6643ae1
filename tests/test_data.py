"""refbert.data: google-research/bert's pretraining data pipeline (NSP, ALBERT's SOP and n-gram masking).

Statistical checks. Every random check runs on a fixed seed, so it is deterministic; its bound is chosen so that a
correct implementation would pass for all but a negligible fraction of seeds, and a wrong rate fails. A count X of
N independent trials of probability p is Binomial(N, p): mean N p, standard deviation sqrt(N p (1 - p)); we accept
|X - N p| <= 5 sd. The two-sided normal tail beyond 5 sd is 5.7e-7 (N p and N (1 - p) are in the hundreds or more
everywhere below, so the normal approximation holds), and a test making K such comparisons fails a correct
implementation with probability <= K * 5.7e-7 (union bound), stated at each test.
"""
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from refbert import data
from refbert.data import (Instance, PretrainingData, create_instances, encode, mask_tokens, read_documents,
                          truncate_seq_pair)

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def within(count, n, p, k=5.0):
    """|count - n p| <= k standard deviations of Binomial(n, p)."""
    sd = math.sqrt(n * p * (1 - p))
    return abs(count - n * p) <= k * sd, (count, n * p, sd)


class Stub:
    """The least a tokenizer must offer: whitespace tokenize and a vocab dict."""

    def __init__(self, words=()):
        self.vocab = {t: i for i, t in enumerate(SPECIALS + sorted(set(words) - set(SPECIALS)))}

    def tokenize(self, text):
        return text.split()


class GrowingStub(Stub):
    """Whitespace tokenizer whose vocab admits every token it has produced (for synthetic corpora)."""

    def tokenize(self, text):
        toks = text.split()
        for t in toks:
            self.vocab.setdefault(t, len(self.vocab))
        return toks


HF_WORDS = ("the a cat dog sat ran on under mat house big small quick brown fox jump ##s ##ed ##ing ##ly "
            "over lazy play walk talk it was is and then . , !").split()
TEXT = """The cat sat on the mat.
Then the dog ran under the house!
It was a big, brown dog.

The quick brown fox jumped over the lazy dog.
The fox was quick and the dog was lazy.

A small cat played.
It walked and talked.
Then it jumps quickly over the big house.
The dog was playing on the mat.

The house was big.
"""


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("vocab")
    (folder / "vocab.txt").write_text("\n".join(SPECIALS + HF_WORDS) + "\n", encoding="utf-8")
    return transformers.BertTokenizerFast.from_pretrained(str(folder))


def two_sentence_corpus(n_docs, tokens_per_sentence=3):
    """Document d = two sentences whose tokens name their place: "d_0" and "d_1"."""
    return [[" ".join([f"{d}_{j}"] * tokens_per_sentence) for j in range(2)] for d in range(n_docs)]


def split(instance):
    """(A, B) of [CLS] A [SEP] B [SEP]."""
    toks = list(instance.tokens)
    assert toks[0] == "[CLS]" and toks[-1] == "[SEP]"
    sep = toks.index("[SEP]")
    return toks[1:sep], toks[sep + 1:-1]


# --- read_documents ------------------------------------------------------------------------------------------

def test_read_documents_lines_and_path(tmp_path):
    lines = ["  first one \n", "second\n", "\n", "   \n", "\n", "other doc\t\n", "", "last"]
    assert read_documents(lines) == [["first one", "second"], ["other doc"], ["last"]]
    p = tmp_path / "corpus.txt"
    p.write_text("\n\nA b.\nC d.\n\n\nE f.\n", encoding="utf-8")
    assert read_documents(p) == read_documents(str(p)) == [["A b.", "C d."], ["E f."]]
    assert read_documents([b"x\n", b"\n", "y"]) == [["x"], ["y"]]


@pytest.mark.parametrize("lines", [[], ["", "  ", "\n"]])
def test_read_documents_empty_corpus(lines):
    with pytest.raises(ValueError, match="'lines_or_path' expected at least one non-empty document"):
        read_documents(lines)


# --- truncate_seq_pair ---------------------------------------------------------------------------------------

def is_slice(part, whole):
    return any(whole[i:i + len(part)] == part for i in range(len(whole) - len(part) + 1))


def test_truncate_seq_pair_semantics():
    rng = np.random.default_rng(0)
    for _ in range(300):
        a = [f"a{i}" for i in range(rng.integers(1, 30))]
        b = [f"b{i}" for i in range(rng.integers(1, 30))]
        m = int(rng.integers(2, 60))
        a0, b0 = list(a), list(b)
        ta, tb = truncate_seq_pair(a, b, m, rng)
        assert (a, b) == (a0, b0)                                     # inputs untouched
        assert len(ta) + len(tb) == min(m, len(a) + len(b))           # trimmed just enough
        assert is_slice(ta, a) and is_slice(tb, b)                    # only the ends are cut
        assert ta and tb                                              # the longer is trimmed: none emptied
        if len(a) + len(b) > m:                                       # the longer one is cut first
            assert abs(len(ta) - len(tb)) <= max(abs(len(a) - len(b)), 1)
    # a tie trims B (google: a if len(a) > len(b) else b)
    ta, tb = truncate_seq_pair(["a", "b"], ["c", "d"], 3, rng)
    assert ta == ["a", "b"] and len(tb) == 1


def test_truncate_seq_pair_front_or_back_half_each():
    # One token must go from A (len 10 > len 2); it goes from the front with probability 1/2 per call:
    # X ~ Binomial(4000, 1/2), sd = 31.6; one comparison, false-failure probability 5.7e-7.
    rng = np.random.default_rng(1)
    a = list("abcdefghij")
    front = 0
    for _ in range(4000):
        ta, tb = truncate_seq_pair(a, ["x", "y"], 11, rng)
        assert tb == ["x", "y"] and ta in (a[1:], a[:-1])
        front += ta == a[1:]
    ok, info = within(front, 4000, 0.5)
    assert ok, info


# --- create_instances ----------------------------------------------------------------------------------------

def test_instances_structure_with_hf_tokenizer(hf_tokenizer):
    docs = read_documents(TEXT.splitlines())
    for next_sentence in ("nsp", "sop", None):
        for max_len in (5, 9, 24, 128):
            insts = create_instances(docs, hf_tokenizer, max_len, 0.3, next_sentence, rng=np.random.default_rng(2))
            assert insts
            for x in insts:
                assert len(x.tokens) <= max_len and len(x.segment_ids) == len(x.tokens)
                if next_sentence is None:
                    assert x.tokens[0] == "[CLS]" and x.tokens[-1] == "[SEP]" and x.tokens.count("[SEP]") == 1
                    assert set(x.segment_ids) == {0} and x.next_sentence_label is None and len(x.tokens) >= 3
                    continue
                a, b = split(x)
                assert a and b and x.tokens.count("[SEP]") == 2
                assert list(x.segment_ids) == [0] * (len(a) + 2) + [1] * (len(b) + 1)
                assert x.next_sentence_label in (0, 1)
                assert x.masked_positions == () and x.masked_labels == ()


def test_nsp_label_rate_and_put_back():
    # Each document is two 3-token sentences s0, s1 and the target (29 tokens) is never reached, so the chunk is
    # [s0, s1], A = s0. With probability 1/2 B = s1 (label 0: one instance); otherwise B is random (label 1), s1
    # is put back and forms a one-sentence chunk, whose B is random too (label 1): two label-1 instances.
    # So #label-0 ~ Binomial(n_docs, 1/2) (sd 50 for 10000 documents: a rate off by 0.03 is 6 sd away) and
    # #label-1 = 2 (n_docs - #label-0) exactly. One comparison: false-failure probability 5.7e-7.
    n = 10000
    insts = create_instances(two_sentence_corpus(n), Stub(), 32, 0.0, "nsp", rng=np.random.default_rng(3))
    zeros = [x for x in insts if x.next_sentence_label == 0]
    ones = [x for x in insts if x.next_sentence_label == 1]
    ok, info = within(len(zeros), n, 0.5)
    assert ok, info
    assert len(ones) == 2 * (n - len(zeros))
    for x in zeros:                                   # B follows A in the same document
        a, b = split(x)
        d = a[0].split("_")[0]
        assert a == [f"{d}_0"] * 3 and b == [f"{d}_1"] * 3
    starts = {}
    for x in ones:                                    # B from another document
        a, b = split(x)
        d = a[0].split("_")[0]
        assert {t.split("_")[0] for t in b} != {d} and len(b) >= 3
        starts[d] = starts.get(d, []) + [a[0]]
    for d, firsts in starts.items():                  # both sentences of the document led an instance
        assert sorted(firsts) == [f"{d}_0", f"{d}_1"]
    order = [split(x)[0][0] for x in insts]
    assert order != sorted(order, key=lambda t: int(t.split("_")[0]))    # shuffled


def test_sop_semantics():
    # Two-sentence documents under SOP: one instance each, A = s0, B = s1, swapped with probability 1/2 (label 1).
    # #label-1 ~ Binomial(10000, 1/2), sd 50; one comparison, false-failure probability 5.7e-7.
    n = 10000
    insts = create_instances(two_sentence_corpus(n), Stub(), 32, 0.0, "sop", rng=np.random.default_rng(4))
    assert len(insts) == n
    for x in insts:
        a, b = split(x)
        da, db = a[0].split("_")[0], b[0].split("_")[0]
        assert da == db
        assert (a[0], b[0]) == ((f"{da}_0", f"{da}_1") if x.next_sentence_label == 0 else (f"{da}_1", f"{da}_0"))
    ok, info = within(sum(x.next_sentence_label for x in insts), n, 0.5)
    assert ok, info
    # Longer documents: label 0 = A's sentences all precede B's and are consecutive, label 1 = swapped.
    tok = GrowingStub()
    docs = [[f"{d}_{j} " * int(1 + (d * 7 + j * 3) % 5) for j in range(12)] for d in range(60)]
    untruncated = 0
    for x in create_instances(docs, tok, 24, 0.2, "sop", rng=np.random.default_rng(5)):
        a, b = split(x)
        ia = sorted({int(t.split("_")[1]) for t in a})
        ib = sorted({int(t.split("_")[1]) for t in b})
        assert {t.split("_")[0] for t in a + b} == {a[0].split("_")[0]}
        first, second = (ia, ib) if x.next_sentence_label == 0 else (ib, ia)
        assert first[-1] < second[0]
        if len(a) + len(b) < 24 - 3:     # truncation leaves exactly max_num_tokens, so this pair is whole
            untruncated += 1
            assert first + second == list(range(first[0], second[-1] + 1))
    assert untruncated > 50
    # a sentence longer than the target still pairs with the next one (ALBERT would draw a random B)
    long_docs = [[" ".join([f"{d}_{j}"] * 40) for j in range(3)] for d in range(50)]
    insts = create_instances(long_docs, Stub(), 32, 0.0, "sop", rng=np.random.default_rng(13))
    assert len(insts) == 50
    for x in insts:
        a, b = split(x)
        assert len(x.tokens) == 32 and {a[0][:-1], b[0][:-1]} == {a[0][:-1]}
        assert {a[0][-1], b[0][-1]} == {"0", "1"} and (a[0][-1] == "1") == (x.next_sentence_label == 1)


def test_short_seq_prob_rate():
    # Documents of 29 one-token sentences, max_seq_length 32 (max_num_tokens 29), SOP (B is the rest of the chunk).
    # With the full target (29) the whole document is one chunk: one instance of exactly 29 tokens + 3. With a
    # short target t in [2, 28] every chunk has <= t tokens. The short draw is uniform over the 28 values 2..29,
    # so P(a 32-token instance) = (1 - p) + p / 28 per document, and the number of full-length instances is
    # Binomial(n_docs, that). p = 0.3, 2000 documents: sd 20.9. One comparison; false-failure 5.7e-7.
    n, p = 2000, 0.3
    docs = [["x"] * 29 for _ in range(n)]
    insts = create_instances(docs, Stub(), 32, p, "sop", rng=np.random.default_rng(6))
    assert all(len(x.tokens) <= 32 for x in insts)
    full = sum(len(x.tokens) == 32 for x in insts)
    ok, info = within(full, n, (1 - p) + p / 28)
    assert ok, info
    shorter = [len(x.tokens) - 3 for x in insts if len(x.tokens) < 32]
    assert min(shorter) == 2 and max(shorter) == 28


def test_one_sentence_documents_and_a_single_document(hf_tokenizer):
    rng = np.random.default_rng(7)
    singles = [["the cat sat."], ["the dog ran."], ["a fox."]]
    insts = create_instances(singles, hf_tokenizer, 16, 0.1, "nsp", rng=rng)
    assert len(insts) == 3 and all(x.next_sentence_label == 1 for x in insts)   # one-sentence chunk: random B
    for x in insts:
        a, b = split(x)
        assert a != b                                                            # B from another document
    assert create_instances(singles, hf_tokenizer, 16, 0.1, "sop", rng=rng) == []
    with pytest.raises(ValueError, match="'documents' expected documents that give at least one instance"):
        PretrainingData(singles, hf_tokenizer, 16, next_sentence="sop")
    # One document of one sentence: B can only come from itself.
    (x,) = create_instances([["the cat sat on the mat."]], hf_tokenizer, 32, 0.0, "nsp", rng=rng)
    a, b = split(x)
    assert x.next_sentence_label == 1 and is_slice(b, a)
    # One longer document: terminates, and every instance is well formed.
    doc = [TEXT.replace("\n\n", "\n").splitlines()]
    for ns in ("nsp", "sop", None):
        insts = create_instances(doc, hf_tokenizer, 12, 0.5, ns, rng=rng)
        assert insts and all(len(x.tokens) <= 12 for x in insts)
    batch = next(PretrainingData(doc, hf_tokenizer, 16, seed=1).batches(0, 4))
    assert batch["input_ids"].shape == (4, 16)


def test_over_long_lines_are_truncated(hf_tokenizer):
    long = " ".join(["the quick brown fox jumped over the lazy dog"] * 120)    # ~1100 pieces
    docs = [[long], ["a cat.", long, "the end."], [long, long]]
    for ns in ("nsp", "sop", None):
        insts = create_instances(docs, hf_tokenizer, 32, 0.1, ns, rng=np.random.default_rng(8))
        assert insts and all(len(x.tokens) <= 32 for x in insts)
    data_ = PretrainingData(docs, hf_tokenizer, 32, seed=3)
    for batch in data_.batches(0, 2):
        assert batch["input_ids"].shape[1] == 32


def test_no_sentence_task_fills_max_seq_length():
    """Without a sentence task an instance is [CLS] A [SEP]: two specials, so a chunk longer than the limit is cut
    to exactly max_seq_length tokens (max_num_tokens = max_seq_length - 2), not one short of it (the pair's - 3).
    max_seq_length 16, short_seq_prob 0: target 14. One 50-token sentence is one chunk; 9 sentences of 5 tokens
    close a chunk every 3 sentences (15 >= 14 tokens): 3 chunks, each cut from 15 tokens to 14."""
    tok = Stub()
    one_long = [" ".join(f"t{i}" for i in range(50))]
    five_each = [" ".join(f"s{j}_{i}" for i in range(5)) for j in range(9)]
    for doc, n_chunks in ((one_long, 1), (five_each, 3)):
        words = [t for s in doc for t in s.split()]
        for seed in range(5):
            insts = create_instances([doc], tok, 16, 0.0, None, rng=np.random.default_rng(seed))
            assert len(insts) == n_chunks
            for x in insts:
                assert x.tokens[0] == "[CLS]" and x.tokens[-1] == "[SEP]" and x.next_sentence_label is None
                assert len(x.tokens) == 16 and x.segment_ids == (0,) * 16
                assert is_slice(list(x.tokens[1:-1]), words)


def test_random_b_stops_at_the_sentence_that_reaches_its_target():
    """NSP's random B takes sentences until it holds target_seq_length - len(A) tokens: a sentence that brings it
    to exactly that many is the last one. Document 0 is one 15-token sentence (A: a one-sentence chunk always gets
    a random B from document 1); document 1 is 30 one-token sentences b0..b29. max_seq_length 23 and
    short_seq_prob 0 give target 20, so B = the 5 sentences from a uniform start j (fewer when j > 25), A + B fits
    and nothing is truncated. Taking one sentence more would make 21 tokens, and the truncation would cut A."""
    a_words = [f"a{i}" for i in range(15)]
    docs = [[" ".join(a_words)], [f"b{j}" for j in range(30)]]
    exact = 0
    for seed in range(20):
        insts = create_instances(docs, Stub(), 23, 0.0, "nsp", rng=np.random.default_rng(seed))
        (x,) = [x for x in insts if x.tokens[1].startswith("a")]     # document 0's only instance
        a, b = split(x)
        assert x.next_sentence_label == 1 and a == a_words
        j = int(b[0][1:])
        assert b == [f"b{k}" for k in range(j, min(j + 5, 30))]
        exact += j <= 24                 # a sentence after the fifth existed: the stop was the rule's, not the end's
    # The check above is not vacuous: exact ~ Binomial(20, 25/30), and P(exact < 5) = 8.7e-10 (binomial tail).
    assert exact >= 5


# --- mask_tokens ---------------------------------------------------------------------------------------------

def sequence(n_a=62, n_b=62):
    words = [f"w{i}" for i in range(n_a + n_b)]
    return ["[CLS]"] + words[:n_a] + ["[SEP]"] + words[n_a:] + ["[SEP]"], words


def test_masking_rate_per_position_and_specials():
    # 128 tokens, 124 candidates: num_to_predict = min(20, round(128 * 0.15) = 19) = 19, chosen uniformly without
    # replacement, so each candidate is chosen with probability 19/124 per call, independently across calls:
    # count ~ Binomial(2000, 19/124), sd 16.1. 124 comparisons: false-failure <= 124 * 5.7e-7 = 7e-5.
    tokens, words = sequence()
    vocab = SPECIALS + words
    rng = np.random.default_rng(9)
    counts = np.zeros(len(tokens), dtype=int)
    n = 2000
    for _ in range(n):
        out, pos, labels = mask_tokens(tokens, vocab, rng)
        assert len(pos) == 19 and pos == sorted(set(pos)) and labels == [tokens[p] for p in pos]
        assert all(out[i] == tokens[i] for i in range(len(tokens)) if i not in pos)
        counts[pos] += 1
    special = [i for i, t in enumerate(tokens) if t in ("[CLS]", "[SEP]")]
    assert counts[special].sum() == 0
    for i in set(range(len(tokens))) - set(special):
        ok, info = within(counts[i], n, 19 / 124)
        assert ok, (i, info)
    # the budget rule, google's: round(len * prob) counting [CLS]/[SEP], at least 1, at most max_predictions
    for length, prob, cap, want in [(10, 0.15, 20, 2), (3, 0.15, 20, 1), (128, 0.15, 5, 5), (20, 0.5, 100, 10)]:
        toks = ["[CLS]"] + [f"w{i}" for i in range(length - 2)] + ["[SEP]"]
        assert len(mask_tokens(toks, vocab, rng, prob, cap)[1]) == want
    # [PAD] is never a candidate, and with nothing to mask nothing is masked
    toks = ["[CLS]", "w1", "[SEP]", "w2", "[SEP]"] + ["[PAD]"] * 20
    for _ in range(200):
        out, pos, _ = mask_tokens(toks, vocab, rng, 0.5, 20)
        assert set(pos) == {1, 3}
    assert mask_tokens(["[CLS]", "[SEP]", "[PAD]"], vocab, rng) == (["[CLS]", "[SEP]", "[PAD]"], [], [])


def test_80_10_10_split_and_replacement_vocab():
    # Chosen positions are replaced independently: [MASK] w.p. 0.8, a uniform vocabulary token w.p. 0.1 (which is
    # itself [MASK] w.p. 1/V or the original w.p. 1/V), the original w.p. 0.1. Observed, with V = 129:
    #   [MASK]: 0.8 + 0.1/V;  unchanged: 0.1 + 0.1/V;  another token: 0.1 (1 - 2/V).
    # Over M = 2000 * 19 = 38000 positions each count is Binomial(M, p) (sd 78, 59, 58). 3 comparisons:
    # false-failure <= 1.7e-6. The ~3800 uniform draws hit each of the 129 tokens ~29 times, so every token but
    # [MASK] (seen as a mask) is seen as "another token" unless a Poisson(29) is 0: <= 129 e^-29 = 3e-11.
    tokens, words = sequence()
    vocab = SPECIALS + words
    V = len(vocab)
    rng = np.random.default_rng(10)
    n_mask = n_same = n_other = 0
    others = set()
    for _ in range(2000):
        out, pos, labels = mask_tokens(tokens, vocab, rng)
        for p, orig in zip(pos, labels):
            if out[p] == "[MASK]":
                n_mask += 1
            elif out[p] == orig:
                n_same += 1
            else:
                n_other += 1
                others.add(out[p])
    M = n_mask + n_same + n_other
    assert M == 2000 * 19
    for count, p in [(n_mask, 0.8 + 0.1 / V), (n_same, 0.1 + 0.1 / V), (n_other, 0.1 * (1 - 2 / V))]:
        ok, info = within(count, M, p)
        assert ok, info
    assert others == set(vocab) - {"[MASK]"}     # special tokens are drawn too, as google and HF do


def words_of(tokens):
    """Whole words (a piece and the ## pieces right after it) between special tokens, as position lists."""
    groups = []
    for i, t in enumerate(tokens):
        if t in ("[CLS]", "[SEP]", "[PAD]"):
            continue
        if t.startswith("##") and groups and groups[-1][-1] == i - 1:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def test_whole_word_masking(hf_tokenizer):
    a = hf_tokenizer.tokenize("the dog jumped quickly and walked then played it jumps talking and ran")
    b = hf_tokenizer.tokenize("walking talked the cat played quickly on the mat")
    tokens = ["[CLS]"] + a + ["[SEP]", "##s"] + b + ["[SEP]"]   # a "##" piece right after [SEP] is its own word
    assert any(t.startswith("##") for t in a)
    groups = words_of(tokens)
    segments = data._candidate_words(tokens, True)
    assert len(segments) == 2 and segments[0] + segments[1] == groups and segments[1][0] == [len(a) + 2]
    vocab = sorted(hf_tokenizer.vocab, key=hf_tokenizer.vocab.get)
    budget = min(20, max(1, round(len(tokens) * 0.15)))
    rng = np.random.default_rng(11)
    split_seen = False
    for ngram in (1, 3):
        for _ in range(500):
            _, pos, _ = mask_tokens(tokens, vocab, rng, whole_word=True, ngram=ngram)
            chosen = set(pos)
            assert 0 < len(pos) <= budget
            assert all(set(g) <= chosen or not set(g) & chosen for g in groups)
            assert not any(tokens[p] in ("[CLS]", "[SEP]") for p in pos)
            _, pos, _ = mask_tokens(tokens, vocab, rng, whole_word=False, ngram=ngram)
            split_seen |= any(0 < len(set(g) & set(pos)) < len(g) for g in groups)
    assert split_seen     # without whole_word, words do get split: the check above can fail


def test_ngram_lengths_follow_one_over_n():
    # ALBERT: n in 1..3 with P(n) = (1/n) / (1 + 1/2 + 1/3) = 6/11, 3/11, 2/11. Take the first span of each call
    # (nothing is covered yet and the budget 15 >= 3 words, so it is never shortened), only when it starts at
    # least 3 words before the end of its segment (else n is capped); those starts are a random subset chosen
    # independently of n, so each count is Binomial(N, p_n), N ~ 2900 of 3000 calls (sd <= 27).
    # 2 settings x 3 lengths = 6 comparisons: false-failure <= 3.4e-6.
    p = np.array([1, 1 / 2, 1 / 3]) / (1 + 1 / 2 + 1 / 3)
    for whole_word in (False, True):
        rng = np.random.default_rng(12)
        toks = ["[CLS]"]
        for i in range(50):
            toks += [f"w{i}"] + ["##x"] * (i % 3 if whole_word else 0)
        toks += ["[SEP]"]
        for i in range(40):
            toks += [f"v{i}"] + ["##y"] * (i % 2 if whole_word else 0)
        toks += ["[SEP]"]
        segments = data._candidate_words(toks, whole_word)
        assert [len(s) for s in segments] == [50, 40]
        counts, N = np.zeros(3, dtype=int), 0
        where = {w[0]: (seg, k) for seg in segments for k, w in enumerate(seg)}

        def start_of(positions):
            return where[positions[0]]

        for _ in range(3000):
            spans = data._choose_spans(segments, 15, 3, rng)
            for positions, n in spans:     # every span: 1..n whole consecutive words of one segment
                seg, k = start_of(positions)
                assert any([q for w in seg[k:k + m] for q in w] == positions for m in range(1, n + 1))
            positions, n = spans[0]
            seg, k = start_of(positions)
            if k <= len(seg) - 3:
                N += 1
                counts[n - 1] += 1
                assert positions == [q for w in seg[k:k + n] for q in w]
        assert N > 2500
        for c, pn in zip(counts, p):
            ok, info = within(c, N, pn)
            assert ok, (whole_word, info)


def test_candidate_words_hash_is_a_word_not_a_piece():
    """Only a "##"-prefixed piece continues a word. "#" alone is a whole token (BERT splits punctuation off:
    BertTokenizerFast gives "a # b" and "a#b" as ['a', '#', 'b']), so under whole_word it is a word of its own."""
    toks = ["[CLS]", "a", "#", "b", "##c", "#", "[SEP]", "##d", "e"]
    assert data._candidate_words(toks, True) == [[[1], [2], [3, 4], [5]], [[7], [8]]]
    assert data._candidate_words(toks, False) == [[[1], [2], [3], [4], [5]], [[7], [8]]]


def test_ngram_span_is_shortened_to_fit_the_budget():
    """[CLS] a b c [SEP] has a budget of one position (round(5 * 0.15) = 1). With ngram=3 the first shuffled start
    is uniform over the three words and any span drawn there is shortened to its first word, so each word is the
    masked one with probability 1/3 (a span not shortened to one word would be skipped, biasing to the last word,
    which only fits n = 1). 3000 calls: each count ~ Binomial(3000, 1/3), sd 25.8; the 5-sd bound (module
    docstring) over 3 comparisons fails a correct implementation with probability <= 1.7e-6."""
    tokens = ["[CLS]", "a", "b", "c", "[SEP]"]
    rng = np.random.default_rng(21)
    counts = {1: 0, 2: 0, 3: 0}
    n = 3000
    for _ in range(n):
        _, positions, labels = mask_tokens(tokens, SPECIALS + ["a", "b", "c"], rng, ngram=3)
        assert len(positions) == 1 and labels == [tokens[positions[0]]]
        counts[positions[0]] += 1
    for c in counts.values():
        ok, info = within(c, n, 1 / 3)
        assert ok, (counts, info)


def test_ngram_spans_never_overlap():
    """An n-gram span overlapping positions already chosen is skipped, so no position is masked twice: over 500
    calls with 3-grams (whole words or not), the positions are distinct, sorted, and within the budget."""
    tokens, words = sequence(30, 30)
    toks_ww = ["[CLS]"] + [t for i in range(40) for t in ([f"w{i}"] + ["##x"] * (i % 3))] + ["[SEP]"]
    rng = np.random.default_rng(22)
    for toks, whole_word in ((tokens, False), (toks_ww, True)):
        budget = min(20, round(len(toks) * 0.4))
        for _ in range(500):
            _, positions, _ = mask_tokens(toks, SPECIALS + words, rng, masked_lm_prob=0.4, whole_word=whole_word,
                                          ngram=3)
            assert positions == sorted(set(positions)) and 0 < len(positions) <= budget


def test_mask_tokens_bad_input():
    tokens, words = sequence(4, 4)
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="'vocab_tokens' expected .*containing '\\[MASK\\]'"):
        mask_tokens(tokens, ["[PAD]", "[CLS]", "[SEP]"] + words, rng)
    for bad in (0, 1, 1.5, -0.1):
        with pytest.raises(ValueError, match=r"'masked_lm_prob' expected a probability in \(0, 1\), got"):
            mask_tokens(tokens, SPECIALS + words, rng, masked_lm_prob=bad)
    with pytest.raises(ValueError, match="'ngram' expected an integer >= 1, got 0"):
        mask_tokens(tokens, SPECIALS + words, rng, ngram=0)
    with pytest.raises(ValueError, match="'rng' expected a numpy.random.Generator"):
        mask_tokens(tokens, SPECIALS + words, 0)


# --- encode ---------------------------------------------------------------------------------------------------

def test_encode_arrays():
    tok = Stub(["a", "b", "c"])
    v = tok.vocab
    x1 = Instance(("[CLS]", "a", "[MASK]", "[SEP]", "c", "[SEP]"), (0, 0, 0, 0, 1, 1), 1, (2, 4), ("b", "c"))
    x2 = Instance(("[CLS]", "a", "[SEP]", "b", "[SEP]"), (0, 0, 0, 1, 1), 0)
    out = encode([x1, x2], tok, 8)
    assert list(out) == ["input_ids", "token_type_ids", "attention_mask", "labels", "next_sentence_label"]
    assert all(a.dtype == np.int64 for a in out.values())
    pad = v["[PAD]"]
    np.testing.assert_array_equal(out["input_ids"], [
        [v["[CLS]"], v["a"], v["[MASK]"], v["[SEP]"], v["c"], v["[SEP]"], pad, pad],
        [v["[CLS]"], v["a"], v["[SEP]"], v["b"], v["[SEP]"], pad, pad, pad]])
    np.testing.assert_array_equal(out["token_type_ids"], [[0, 0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(out["attention_mask"], [[1] * 6 + [0] * 2, [1] * 5 + [0] * 3])
    np.testing.assert_array_equal(out["labels"], [[-100, -100, v["b"], -100, v["c"], -100, -100, -100],
                                                  [-100] * 8])
    np.testing.assert_array_equal(out["next_sentence_label"], [1, 0])
    assert "next_sentence_label" not in encode([x2._replace(next_sentence_label=None)], tok, 8)
    with pytest.raises(ValueError, match="'instances' expected at most max_seq_length = 5 tokens"):
        encode([x1], tok, 5)
    with pytest.raises(ValueError, match="'instances' expected tokens in tokenizer.vocab, got 'zzz'"):
        encode([x2._replace(tokens=("[CLS]", "zzz", "[SEP]", "b", "[SEP]"))], tok, 8)
    with pytest.raises(ValueError, match="'instances' expected next_sentence_label on all instances or on none"):
        encode([x1, x2._replace(next_sentence_label=None)], tok, 8)


def test_encode_refuses_segment_ids_of_another_length():
    """One segment id per token: a shorter tuple would otherwise be broadcast by NumPy (one id over five tokens)
    without a word, a longer one fail inside NumPy without naming the argument."""
    tok = Stub(["a", "b"])
    x = Instance(("[CLS]", "a", "[SEP]", "b", "[SEP]"), (0, 0, 0, 1, 1), 0)
    encode([x], tok, 8)                                                    # the right length passes
    for ids in ((1,), (0, 0, 0, 1), (0, 0, 0, 1, 1, 1)):
        with pytest.raises(ValueError, match=rf"encode: argument 'instances' expected .* one segment id per token, "
                                             rf"got 5 tokens and {len(ids)} segment ids in instance 1"):
            encode([x, x._replace(segment_ids=ids)], tok, 8)


# --- PretrainingData ------------------------------------------------------------------------------------------

def corpus(n_docs=40):
    rng = np.random.default_rng(123)
    words = [f"t{i}" for i in range(60)]
    docs = [[" ".join(rng.choice(words, size=rng.integers(2, 12))) for _ in range(rng.integers(1, 8))]
            for _ in range(n_docs)]
    return docs, Stub(words)


def stack(batches):
    batches = list(batches)
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def test_batches_are_consistent_with_instances():
    docs, tok = corpus()
    d = PretrainingData(docs, tok, 24, next_sentence="nsp", seed=5)
    v = tok.vocab
    arr = stack(d.batches(0, 7, shuffle=False))
    masked = d.masked_instances(0)
    assert arr["input_ids"].shape == (len(d), 24)
    for b, (x, y) in enumerate(zip(d.instances, masked)):
        n = len(x.tokens)
        lab = arr["labels"][b]
        assert set(np.flatnonzero(lab != -100)) == set(y.masked_positions)
        assert [lab[p] for p in y.masked_positions] == [v[x.tokens[p]] for p in y.masked_positions]
        assert list(arr["input_ids"][b, :n]) == [v[t] for t in y.tokens]
        assert arr["next_sentence_label"][b] == x.next_sentence_label
    assert (arr["attention_mask"].sum(1) == [len(x.tokens) for x in d.instances]).all()
    # the SOP and no-sentence-task variants
    assert set(stack(PretrainingData(docs, tok, 24, next_sentence="sop").batches(0, 8))["next_sentence_label"]) \
        == {0, 1}
    assert "next_sentence_label" not in next(PretrainingData(docs, tok, 24, next_sentence=None).batches(0, 8))


def test_determinism_dynamic_and_static():
    docs, tok = corpus()
    kw = dict(max_seq_length=32, whole_word=True, ngram=2)

    def epoch(d, e, bs=5, **k):
        return stack(d.batches(e, bs, **k))

    d1, d2 = PretrainingData(docs, tok, seed=7, **kw), PretrainingData(docs, tok, seed=7, **kw)
    for e in (0, 3):
        a, b = epoch(d1, e), epoch(d2, e)
        assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(epoch(d1, 0)["input_ids"], epoch(d1, 1)["input_ids"])            # dynamic: new masks
    assert not np.array_equal(epoch(d1, 0, shuffle=False)["labels"], epoch(d1, 1, shuffle=False)["labels"])
    other = PretrainingData(docs, tok, seed=8, **kw)
    assert len(other) != len(d1) or not np.array_equal(epoch(other, 0)["input_ids"], epoch(d1, 0)["input_ids"])
    # masks do not depend on batch_size; drop_last leaves out only the tail
    full = epoch(d1, 2, bs=len(d1))
    assert all(np.array_equal(full[k], epoch(d1, 2, bs=3)[k]) for k in full)
    dropped = epoch(d1, 2, bs=4, drop_last=True)
    n = len(d1) - len(d1) % 4
    assert all(np.array_equal(full[k][:n], dropped[k]) for k in full)
    # static: period dupe_factor, and epoch e < dupe_factor equals the dynamic epoch e
    s = PretrainingData(docs, tok, seed=7, dynamic=False, dupe_factor=3, **kw)
    ep = [epoch(s, e) for e in range(7)]
    for e in range(7):
        assert all(np.array_equal(ep[e][k], ep[e % 3][k]) for k in ep[e])
    assert not np.array_equal(ep[0]["labels"], ep[1]["labels"])
    assert not np.array_equal(ep[1]["labels"], ep[2]["labels"])
    for e in range(3):
        dyn = epoch(d1, e)
        assert all(np.array_equal(ep[e][k], dyn[k]) for k in dyn)


DIGEST_SCRIPT = textwrap.dedent("""
    import hashlib
    import numpy as np
    from refbert.data import PretrainingData

    class Tok:
        def __init__(self):
            words = [f"w{i}" for i in range(50)] + [f"w{i}" + "##a" for i in range(5)]
            self.vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words)}
        def tokenize(self, text):
            return text.split()

    rng = np.random.default_rng(99)
    docs = [[" ".join(f"w{j}" for j in rng.integers(0, 50, size=rng.integers(1, 9))) for _ in range(rng.integers(1, 6))]
            for _ in range(30)]
    h = hashlib.sha256()
    for dynamic in (True, False):
        d = PretrainingData(docs, Tok(), 24, whole_word=True, ngram=3, dynamic=dynamic, dupe_factor=2, seed=11)
        for epoch in (0, 1, 5):
            for batch in d.batches(epoch, 4):
                for k in sorted(batch):
                    h.update(k.encode()); h.update(batch[k].tobytes())
    print(h.hexdigest())
""")


def test_same_batches_in_a_fresh_process():
    ns = {}
    exec(compile(DIGEST_SCRIPT.replace("print(h.hexdigest())", "result = h.hexdigest()"), "<digest>", "exec"), ns)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for hashseed in ("1", "12345"):   # string hashing differs between these processes
        env["PYTHONHASHSEED"] = hashseed
        out = subprocess.run([sys.executable, "-c", DIGEST_SCRIPT], env=env, capture_output=True, text=True,
                             cwd=REPO, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == ns["result"]


# --- bad input ------------------------------------------------------------------------------------------------

class NoMask(Stub):
    def __init__(self):
        super().__init__(["a", "b"])
        del self.vocab["[MASK]"]


@pytest.mark.parametrize("make, match", [
    (lambda docs, tok: PretrainingData([], tok), "PretrainingData: argument 'documents' expected at least one"),
    (lambda docs, tok: PretrainingData([[], ["  "]], tok), "'documents' expected at least one non-empty document"),
    (lambda docs, tok: PretrainingData(["a b", "c"], tok), "'documents' expected a list of documents"),
    (lambda docs, tok: PretrainingData(docs, NoMask()), r"'tokenizer' expected a vocab containing .*without \[MASK\]"),
    (lambda docs, tok: PretrainingData(docs, object()), "'tokenizer' expected an object with .tokenize"),
    (lambda docs, tok: PretrainingData(docs, tok, max_seq_length=4), "'max_seq_length' expected an integer >= 5"),
    (lambda docs, tok: PretrainingData(docs, tok, masked_lm_prob=0), "'masked_lm_prob' expected a probability in"),
    (lambda docs, tok: PretrainingData(docs, tok, masked_lm_prob=1.0), "'masked_lm_prob' expected a probability in"),
    (lambda docs, tok: PretrainingData(docs, tok, short_seq_prob=1.5), "'short_seq_prob' expected a probability"),
    (lambda docs, tok: PretrainingData(docs, tok, next_sentence="mlm"), "'next_sentence' expected one of"),
    (lambda docs, tok: PretrainingData(docs, tok, dupe_factor=0), "'dupe_factor' expected an integer >= 1"),
    (lambda docs, tok: PretrainingData(docs, tok, seed=-1), "'seed' expected an integer >= 0"),
    (lambda docs, tok: next(PretrainingData(docs, tok).batches(0, 0)), "'batch_size' expected an integer >= 1"),
    (lambda docs, tok: next(PretrainingData(docs, tok).batches(-1, 2)), "'epoch' expected an integer >= 0"),
    (lambda docs, tok: create_instances(docs, tok, 4, rng=np.random.default_rng()), "'max_seq_length' expected"),
    (lambda docs, tok: create_instances([], tok, rng=np.random.default_rng()), "'documents' expected at least one"),
    (lambda docs, tok: create_instances(docs, tok, rng=0), "'rng' expected a numpy.random.Generator"),
    (lambda docs, tok: truncate_seq_pair(["a"], ["b"], -1, np.random.default_rng()), "'max_num_tokens' expected"),
])
def test_bad_input_names_the_argument(make, match):
    docs, tok = corpus(5)
    with pytest.raises(ValueError, match=match):
        make(docs, tok)
