"""BERT's WordPiece tokenizer in plain Python, with Hugging Face's names, arguments and outputs.

`BertTokenizer(vocab_file)` gives the ids, token types, attention masks and character offsets that transformers 5's
`BertTokenizer` (the `tokenizers`-backed "fast" one, which `BertTokenizerFast` now names too) gives for the same
vocabulary and options; `BasicTokenizer` and `WordpieceTokenizer` are its two stages under HF's names.

The pipeline, per stretch of text between special tokens (which are matched in the raw text, as HF does):
1. clean: drop U+0000, U+FFFD and control characters (`_is_control`), turn whitespace (`_is_whitespace`) into " ";
2. put spaces around CJK ideographs (`_is_chinese_char`) when `tokenize_chinese_chars`;
3. split on spaces; a word in `never_split` is kept as it is (and not split into word pieces);
4. strip accents (NFD, then drop nonspacing marks, category Mn) when `strip_accents`, which None ties to
   `do_lower_case`; then lower-case, one character at a time, when `do_lower_case`;
5. split each punctuation character (`_is_punctuation`) off as a word of its own;
6. WordPiece: greedy longest match first, "##" marking a continuation; a word longer than
   `max_input_chars_per_word`, or with a piece no vocabulary entry matches, becomes the unknown token.

Every character after step 4 remembers the character of the original text it came from, and a token's offsets
(start, end) run from its first character's source to the end of its last's, as HF's fast tokenizer computes them:
"é" lower-cased and stripped to "e" still covers the "é"; a Hangul syllable decomposed into jamo maps every jamo
to the syllable; a character the cleaning drops (a zero-width space, a control) belongs to no token, though it
lies inside the span of a token whose characters surround it; a combining mark stripped after a word's last
letter ("cafe" + U+0301) lies outside the word's span. This is what question-answering spans and NER label
alignment need.

Where HF's two tokenizers disagree, refbert follows the fast one, which is what transformers 5 gives by default:
- no NFC: the Python tokenizer (`BertTokenizerLegacy`) composes the text with NFC first, so "e" + U+0301 is one
  character there and two here (the words differ unless accents are stripped);
- lower-casing is per character: a final capital sigma becomes "σ", not the "ς" of Python's `str.lower`;
- accents are stripped before lower-casing (which gives the same result on every code point);
- CJK Extension E starts at U+2B920 (the Python tokenizer starts it at U+2B820);
- unassigned code points (category Cn) are kept, private-use ones (Co) dropped; U+2028 and U+2029 count as
  whitespace (the Python tokenizer drops every C* category and splits on U+2028/9 without counting them as spaces);
- pairs truncated with "longest_first" that must end unequal give the extra token to the sequence that was longer
  (the first on a tie); the Python tokenizer always gives it to the first.
Character classes come from this Python's `unicodedata`. The fast tokenizer's Rust crates carry category tables
from about Unicode 8 (and a newer one for lower-casing), so on characters assigned or re-categorised since 2015
(a few hundred marks of minority scripts, a hundred punctuation signs, 13 format characters) the two can differ;
the tests compare on every character where the tables agree.
"""
import collections
import functools
import itertools
import json
import os
import unicodedata
from collections.abc import Mapping

import numpy as np

from .fileio import folder, write_text

VOCAB_FILES_NAMES = {"vocab_file": "vocab.txt"}
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]   # ids 0..4 of a vocabulary from train_vocab
VERY_LARGE_INTEGER = int(1e30)     # HF's "no maximum length" for model_max_length

_PADDING = {False: None, "do_not_pad": None, True: "longest", "longest": "longest", "max_length": "max_length"}
_TRUNCATION = {None: None, False: None, "do_not_truncate": None, True: "longest_first",
               "longest_first": "longest_first", "only_first": "only_first", "only_second": "only_second"}


# ---------------------------------------------------------------------------------------------------------------
# Character classes
# ---------------------------------------------------------------------------------------------------------------

def _is_whitespace(ch):
    """True for " ", "\\t", "\\n", "\\r" and the separators (categories Zs, Zl, Zp). Tab, newline and carriage
    return are control characters to Unicode, but BERT treats them as spaces."""
    if ch in " \t\n\r":
        return True
    return unicodedata.category(ch) in ("Zs", "Zl", "Zp")


def _is_control(ch):
    """True for control, format, private-use and surrogate characters (categories Cc, Cf, Co, Cs), except
    "\\t", "\\n" and "\\r", which count as whitespace. Unassigned code points (Cn) are not control characters."""
    if ch in "\t\n\r":
        return False
    return unicodedata.category(ch) in ("Cc", "Cf", "Co", "Cs")


def _is_punctuation(ch):
    """True for every non-alphanumeric printable ASCII character (code points 33-47, 58-64, 91-96, 123-126:
    "$", "+", "^", "`" are symbols to Unicode but punctuation to BERT) and for Unicode punctuation (categories P*)."""
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_chinese_char(cp):
    """True for a code point in the CJK Unified Ideographs blocks BERT spaces out (the main block, Extensions A to
    E, the compatibility ideographs and their supplement). Hiragana, Katakana and Hangul are not among them: those
    scripts write space-separated words."""
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B920 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def _strip_accents(chars):
    """NFD of a word given as [(character, source index)], then without its nonspacing marks (category Mn).

    NFD is each character's canonical decomposition followed by the canonical ordering of every run of combining
    characters (a stable sort by combining class). Sources follow HF's alignment rules: the first character of each
    decomposition stands for the character decomposed and the others are "inserted" after it; after the reordering
    the k-th standing character takes the k-th source and an inserted one takes the source of the character now
    before it. (Only a kept mark, category Mc, moved inside a word that WordPiece then cuts can tell this apart.)

    An ASCII word comes back as it is: no ASCII character decomposes, combines or is a mark."""
    if all(ch < "\x80" for ch, _ in chars):
        return chars
    out = []
    for ch, _ in chars:
        out.extend((d, k > 0) for k, d in enumerate(unicodedata.normalize("NFD", ch)))
    i = 0
    while i < len(out):
        if unicodedata.combining(out[i][0]) == 0:
            i += 1
            continue
        j = i
        while j < len(out) and unicodedata.combining(out[j][0]) != 0:
            j += 1
        out[i:j] = sorted(out[i:j], key=lambda pair: unicodedata.combining(pair[0]))
        i = j
    sources, placed, src = iter(src for _, src in chars), [], None
    for ch, inserted in out:
        src = src if inserted else next(sources)
        placed.append((ch, src))
    return [(ch, src) for ch, src in placed if unicodedata.category(ch) != "Mn"]


@functools.lru_cache(maxsize=None)
def _char_kind(ch):
    """What splitting does with a character: _DROP (NUL, U+FFFD, control), _SPACE (whitespace), _ALONE (a CJK
    ideograph, a word of its own), _KEEP. Remembered per character: the Unicode lookups once per distinct character
    of a corpus, not once per occurrence (the demo's QA rows: 2.1 million characters, a few hundred distinct)."""
    cp = ord(ch)
    if cp == 0 or cp == 0xFFFD or _is_control(ch):
        return _DROP
    if _is_whitespace(ch):
        return _SPACE
    return _ALONE if _is_chinese_char(cp) else _KEEP


_DROP, _SPACE, _ALONE, _KEEP = range(4)
_is_punctuation_seen = functools.lru_cache(maxsize=None)(_is_punctuation)   # the same answers, remembered


def _lower(chars):
    """Each character lower-cased on its own (so without the final-sigma rule of str.lower); a character whose
    lower case is longer ("İ" -> "i" + U+0307) maps every result character to its source."""
    return [(low, src) for ch, src in chars for low in ch.lower()]


def load_vocab(vocab_file):
    """An ordered dict token -> id from a vocab.txt, one token per line, the id being the line number (0-based).
    Only the line break is stripped, so a token may contain spaces; a repeated token keeps its last line, as in HF."""
    return _read_vocab(vocab_file)[0]


def _read_vocab(vocab_file):
    """(load_vocab's dict, the list of lines)."""
    try:
        with open(vocab_file, "r", encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f]
    except UnicodeDecodeError as e:
        raise ValueError(f"BertTokenizer: argument 'vocab_file' expected a UTF-8 text file (vocab.txt, one token per "
                         f"line), got '{vocab_file}', which is not UTF-8 text (byte {e.start}: {e.reason})") from None
    return collections.OrderedDict((token, index) for index, token in enumerate(lines)), lines


def _lines_of(vocab, where):
    """The tokens of a token -> id mapping in id order; the ids must be 0..n-1."""
    lines = [None] * len(vocab)
    for token, index in vocab.items():
        if not isinstance(token, str) or not isinstance(index, (int, np.integer)) or not 0 <= index < len(vocab) \
                or lines[index] is not None:
            raise ValueError(f"BertTokenizer: argument 'vocab_file' expected a mapping of str tokens to the ids "
                             f"0..{len(vocab) - 1}, each once ({where}), got {token!r}: {index!r}")
        lines[index] = token
    return lines


# ---------------------------------------------------------------------------------------------------------------
# The two stages
# ---------------------------------------------------------------------------------------------------------------

class BasicTokenizer:
    """Cleaning, CJK spacing, whitespace and punctuation splitting, lower-casing and accent stripping: steps 1-5 of
    the module docstring. `tokenize(text)` gives the words WordPiece then splits.

    `strip_accents`: None strips accents exactly when `do_lower_case` (the original BERT), True or False forces it.
    `never_split`: words (after cleaning, compared whole) that are neither lower-cased nor split."""

    def __init__(self, do_lower_case=True, never_split=None, tokenize_chinese_chars=True, strip_accents=None):
        self.do_lower_case = bool(do_lower_case)
        self.never_split = set(never_split) if never_split else set()
        self.tokenize_chinese_chars = bool(tokenize_chinese_chars)
        self.strip_accents = strip_accents

    def tokenize(self, text, never_split=None):
        """The list of words of `text`; `never_split` adds to the constructor's set for this call."""
        return ["".join(ch for ch, _ in word) for word in self.split_with_sources(text, never_split)]

    def split_with_sources(self, text, never_split=None):
        """The words of `text`, each a list of (character, index of the character of `text` it came from)."""
        if not isinstance(text, str):
            raise ValueError(f"BasicTokenizer: argument 'text' expected a str, got {type(text).__name__}")
        never = self.never_split.union(never_split) if never_split else self.never_split
        strip = self.do_lower_case if self.strip_accents is None else bool(self.strip_accents)
        words, word = [], []
        cjk = self.tokenize_chinese_chars
        for i, ch in enumerate(text):
            kind = _char_kind(ch)
            if kind == _DROP:
                continue
            if kind == _SPACE or (cjk and kind == _ALONE):
                if word:
                    words.append(word)
                word = []
                if kind == _ALONE:                  # an ideograph is a word of its own
                    words.append([(ch, i)])
                continue
            word.append((ch, i))
        if word:
            words.append(word)

        out = []
        for word in words:
            if never and "".join(ch for ch, _ in word) in never:
                out.append(word)
                continue
            if strip:
                word = _strip_accents(word)
            if self.do_lower_case:
                word = _lower(word)
            piece = []
            for ch, src in word:
                if _is_punctuation_seen(ch):
                    if piece:
                        out.append(piece)
                    out.append([(ch, src)])
                    piece = []
                else:
                    piece.append((ch, src))
            if piece:
                out.append(piece)
        return out


class WordpieceTokenizer:
    """Greedy longest-match-first WordPiece over a vocabulary (token -> id): a word becomes the longest vocabulary
    entry it starts with, then the longest "##"-prefixed entry the rest starts with, and so on. A word longer than
    `max_input_chars_per_word` characters, or with a remainder that no entry starts, becomes [unk_token] whole."""

    def __init__(self, vocab, unk_token="[UNK]", max_input_chars_per_word=100):
        self.vocab = vocab
        self.unk_token = unk_token
        self.max_input_chars_per_word = max_input_chars_per_word

    def tokenize(self, text):
        """Word pieces of every whitespace-separated word of `text` (already basic-tokenized)."""
        if not isinstance(text, str):
            raise ValueError(f"WordpieceTokenizer: argument 'text' expected a str, got {type(text).__name__}")
        out = []
        for word in text.split():
            spans = self.word_spans(word)
            out.extend([self.unk_token] if spans is None else [word_piece for word_piece, _, _ in spans])
        return out

    def word_spans(self, word):
        """[(piece, start, end)] with [start, end) the characters of `word` the piece covers, or None when the word
        is unknown (too long, or unsplittable)."""
        if len(word) > self.max_input_chars_per_word:
            return None
        pieces, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.vocab:
                    break
                end -= 1
            if end == start:
                return None
            pieces.append((piece, start, end))
            start = end
        return pieces


# ---------------------------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------------------------

def _cleanup(token):
    """The clean-up HF's WordPiece decoder applies to each token (with its leading space) as it decodes."""
    return (token.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",").replace(" ' ", "'")
            .replace(" n't", "n't").replace(" 'm", "'m").replace(" do not", " don't").replace(" 's", "'s")
            .replace(" 've", "'ve").replace(" 're", "'re"))


class BatchEncoding(dict):
    """The dict `BertTokenizer.__call__` returns (input_ids, token_type_ids, attention_mask[, offset_mapping]);
    its keys read as attributes too, as in HF."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class BertTokenizer:
    """BERT's tokenizer: `tok(text)` gives HF's input_ids, token_type_ids and attention_mask, and on request the
    offset_mapping into the original text.

    vocab_file: path of a vocab.txt (one token per line, id = line number), or a mapping token -> id (ids 0..n-1).
    do_lower_case, never_split, tokenize_chinese_chars, strip_accents: as in `BasicTokenizer`.
    unk_token, sep_token, pad_token, cls_token, mask_token: matched whole in the raw text (so "[MASK]" in a sentence
    is the mask token, "[mask]" is not), as HF's special tokens are. As in transformers, a vocabulary need not hold
    them: the ones it lacks are added after it (ids len(vocab), len(vocab) + 1, ... in the order unk, sep, pad, cls,
    mask; `len(tok)` counts them, `vocab_size` does not), and pad_token and mask_token may be None (then padding
    raises, as in transformers). Only an operation that needs a missing token fails: a word with no word pieces
    when the vocabulary lacks unk_token (transformers: "WordPiece error: Missing [UNK] token"), and the pretraining
    data, which needs every special token inside the model's vocabulary (refbert.data).
    model_max_length: the length `truncation=True` and `padding="max_length"` use when max_length is None.
    clean_up_tokenization_spaces: the default of `decode`'s argument (False, as transformers 5 for BERT)."""

    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "token_type_ids", "attention_mask"]

    def __init__(self, vocab_file, do_lower_case=True, never_split=None, tokenize_chinese_chars=True,
                 strip_accents=None, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]", cls_token="[CLS]",
                 mask_token="[MASK]", model_max_length=None, clean_up_tokenization_spaces=False):
        if isinstance(vocab_file, Mapping):
            where = "a mapping"
            self._lines = _lines_of(vocab_file, where)
            self.vocab = collections.OrderedDict((token, index) for index, token in enumerate(self._lines))
        else:
            if not isinstance(vocab_file, (str, bytes, os.PathLike)):
                raise ValueError(f"BertTokenizer: argument 'vocab_file' expected a path to a vocab.txt or a mapping "
                                 f"token -> id, got {type(vocab_file).__name__}")
            where = os.fsdecode(os.fspath(vocab_file))
            if not os.path.isfile(where):
                what = "is a directory" if os.path.isdir(where) else "does not exist"
                raise ValueError(f"BertTokenizer: argument 'vocab_file' expected a vocabulary file (vocab.txt, one "
                                 f"token per line), got '{where}', which {what}")
            self.vocab, self._lines = _read_vocab(where)
        self.vocab_file = where
        self.ids_to_tokens = collections.OrderedDict((index, token) for token, index in self.vocab.items())

        # transformers' order of the special tokens (SPECIAL_TOKENS_ATTRIBUTES), which is also the order in which
        # it adds those a vocabulary lacks
        specials = {"unk_token": unk_token, "sep_token": sep_token, "pad_token": pad_token,
                    "cls_token": cls_token, "mask_token": mask_token}
        for name, token in specials.items():
            optional = name in ("pad_token", "mask_token")
            if not (isinstance(token, str) and token) and not (optional and token is None):
                raise ValueError(f"BertTokenizer: argument '{name}' expected a non-empty str"
                                 f"{' or None' if optional else ''}, got {token!r}")
        self.added_tokens = collections.OrderedDict()    # special tokens the vocabulary lacks -> ids after it
        for token in specials.values():
            if token is not None and token not in self.vocab and token not in self.added_tokens:
                self.added_tokens[token] = len(self.vocab) + len(self.added_tokens)
        self.ids_to_tokens.update((index, token) for token, index in self.added_tokens.items())
        self.unk_token, self.sep_token, self.pad_token = unk_token, sep_token, pad_token
        self.cls_token, self.mask_token = cls_token, mask_token

        if model_max_length is None:
            model_max_length = VERY_LARGE_INTEGER
        if isinstance(model_max_length, bool) or not isinstance(model_max_length, int) or model_max_length < 1:
            raise ValueError(f"BertTokenizer: argument 'model_max_length' expected a positive int or None, "
                             f"got {model_max_length!r}")
        self.model_max_length = model_max_length
        self.clean_up_tokenization_spaces = bool(clean_up_tokenization_spaces)
        self.do_lower_case = bool(do_lower_case)
        self.strip_accents = strip_accents
        self.tokenize_chinese_chars = bool(tokenize_chinese_chars)
        self.basic_tokenizer = BasicTokenizer(do_lower_case=do_lower_case, never_split=never_split,
                                              tokenize_chinese_chars=tokenize_chinese_chars,
                                              strip_accents=strip_accents)
        self.wordpiece_tokenizer = WordpieceTokenizer(vocab=self.vocab, unk_token=unk_token)
        # matched longest first where two start at the same place
        self._special_by_length = sorted({t for t in specials.values() if t is not None}, key=len, reverse=True)

    # -- vocabulary ------------------------------------------------------------------------------------------------

    def __len__(self):
        """The number of ids: the vocabulary and the special tokens added after it (transformers' len)."""
        return len(self.vocab) + len(self.added_tokens)

    @property
    def vocab_size(self):
        """The vocabulary's size, without added tokens (transformers' vocab_size)."""
        return len(self.vocab)

    def get_vocab(self):
        """token -> id for every id, added tokens included (transformers' get_vocab)."""
        return {**self.vocab, **self.added_tokens}

    def get_added_vocab(self):
        return dict(self.added_tokens)

    @property
    def never_split(self):
        return self.basic_tokenizer.never_split

    @property
    def all_special_tokens(self):
        """The special tokens that are set, in transformers' order."""
        return [t for t in (self.unk_token, self.sep_token, self.pad_token, self.cls_token, self.mask_token)
                if t is not None]

    @property
    def all_special_ids(self):
        return [self._token_id(t) for t in self.all_special_tokens]

    def _token_id(self, token):
        """The id of a token of the vocabulary or of the added ones; None for None or a token that is neither."""
        index = self.vocab.get(token)
        return self.added_tokens.get(token) if index is None else index

    @property
    def unk_token_id(self):
        return self._token_id(self.unk_token)

    @property
    def sep_token_id(self):
        return self._token_id(self.sep_token)

    @property
    def pad_token_id(self):
        """None when pad_token is None, as in transformers."""
        return self._token_id(self.pad_token)

    @property
    def cls_token_id(self):
        return self._token_id(self.cls_token)

    @property
    def mask_token_id(self):
        """None when mask_token is None, as in transformers."""
        return self._token_id(self.mask_token)

    def convert_tokens_to_ids(self, tokens):
        """The id of a token (a str), or the list of ids of a list of tokens; unknown tokens give unk_token_id."""
        if isinstance(tokens, str):
            index = self._token_id(tokens)
            return self.unk_token_id if index is None else index
        if not hasattr(tokens, "__iter__") or isinstance(tokens, (bytes, dict)):
            raise ValueError(f"BertTokenizer: argument 'tokens' expected a str or an iterable of str, got "
                             f"{type(tokens).__name__} {tokens!r:.40}")
        tokens = list(tokens)                           # (a list, a tuple, an array of str, a generator, ...)
        bad = [t for t in tokens if not isinstance(t, str)]
        if bad:
            raise ValueError(f"BertTokenizer: argument 'tokens' expected a str or an iterable of str, got "
                             f"{type(bad[0]).__name__} {bad[0]!r:.40}")
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids, skip_special_tokens=False):
        """The token of an id (an int), or the list of tokens of a sequence of ids, without the special tokens
        when `skip_special_tokens`. An id outside the vocabulary raises a ValueError."""
        return self._tokens_of(ids, skip_special_tokens, "ids")

    def _tokens_of(self, ids, skip_special_tokens, name):
        if isinstance(ids, (int, np.integer)):
            return self._id_to_token(int(ids), name)
        special = set(self.all_special_ids) if skip_special_tokens else ()
        return [self._id_to_token(int(i), name) for i in self._id_list(ids, name) if int(i) not in special]

    def _id_list(self, ids, name):
        if isinstance(ids, np.ndarray):
            if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
                raise ValueError(f"BertTokenizer: argument '{name}' expected a 1-D integer array, got shape "
                                 f"{ids.shape} and dtype {ids.dtype}")
            return ids.tolist()
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise ValueError(f"BertTokenizer: argument '{name}' expected an int or a sequence of ints, got "
                             f"{type(ids).__name__}")
        ids = list(ids)
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
                raise ValueError(f"BertTokenizer: argument '{name}' expected ints, got {type(i).__name__} {i!r}")
        return ids

    def _id_to_token(self, index, name):
        token = self.ids_to_tokens.get(index)
        if token is None:
            raise ValueError(f"BertTokenizer: argument '{name}' expected ids of this vocabulary "
                             f"(0..{len(self) - 1}), got {index}")
        return token

    # -- tokenizing ------------------------------------------------------------------------------------------------

    def _split_special(self, text):
        """[(segment, start, is_special)]: the special tokens of `text`, found leftmost first (longest first where
        two start at the same place), and the stretches between them."""
        parts, pos = [], 0
        found = {token: text.find(token) for token in self._special_by_length}     # next occurrence of each
        while True:
            for token, i in found.items():
                if 0 <= i < pos:
                    found[token] = text.find(token, pos)
            hits = [(i, -len(token), token) for token, i in found.items() if i >= 0]
            if not hits:
                break
            i, _, token = min(hits)
            if i > pos:
                parts.append((text[pos:i], pos, False))
            parts.append((token, i, True))
            pos = i + len(token)
        if pos < len(text):
            parts.append((text[pos:], pos, False))
        return parts

    def _encode_text(self, text, name):
        """(tokens, ids, offsets) of one text, without [CLS]/[SEP]."""
        if not isinstance(text, str):
            raise ValueError(f"BertTokenizer: argument '{name}' expected a str or a list of str, "
                             f"got {type(text).__name__}")
        tokens, offsets = [], []
        for segment, start, is_special in self._split_special(text):
            if is_special:
                tokens.append(segment)
                offsets.append((start, start + len(segment)))
                continue
            for word in self.basic_tokenizer.split_with_sources(segment):
                chars = "".join(ch for ch, _ in word)
                if chars in self.basic_tokenizer.never_split:       # kept whole, as HF's Python tokenizer does
                    spans = [(chars, 0, len(word))]
                else:
                    spans = self.wordpiece_tokenizer.word_spans(chars)
                    if spans is None:
                        if self.unk_token not in self.vocab:
                            raise ValueError(
                                f"BertTokenizer: argument '{name}' expected words this vocabulary can split into "
                                f"word pieces (it lacks the unknown token {self.unk_token!r}), got {chars!r} "
                                f"(transformers fails here too: 'WordPiece error: Missing {self.unk_token} token "
                                f"from the vocabulary')")
                        spans = [(self.unk_token, 0, len(word))]
                for piece, a, b in spans:
                    tokens.append(piece)
                    offsets.append((start + word[a][1], start + word[b - 1][1] + 1))
        return tokens, self.convert_tokens_to_ids(tokens), offsets

    def tokenize(self, text):
        """The word-piece tokens of `text` (no [CLS]/[SEP] added; special tokens in the text stay whole)."""
        return self._encode_text(text, "text")[0]

    def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
        """[CLS] A [SEP], or [CLS] A [SEP] B [SEP] for a pair."""
        a = self._id_list(token_ids_0, "token_ids_0")
        if token_ids_1 is None:
            return [self.cls_token_id] + a + [self.sep_token_id]
        return [self.cls_token_id] + a + [self.sep_token_id] + self._id_list(token_ids_1, "token_ids_1") + \
            [self.sep_token_id]

    def create_token_type_ids_from_sequences(self, token_ids_0, token_ids_1=None):
        """0 for "[CLS] A [SEP]", 1 for "B [SEP]"."""
        first = [0] * (len(token_ids_0) + 2)
        return first if token_ids_1 is None else first + [1] * (len(token_ids_1) + 1)

    def get_special_tokens_mask(self, token_ids_0, token_ids_1=None):
        """1 where build_inputs_with_special_tokens puts a special token, else 0."""
        mask = [1] + [0] * len(token_ids_0) + [1]
        return mask if token_ids_1 is None else mask + [0] * len(token_ids_1) + [1]

    def num_special_tokens_to_add(self, pair=False):
        return 3 if pair else 2

    def encode(self, text, text_pair=None, add_special_tokens=True, **kwargs):
        """The input_ids of `tok(text, text_pair, ...)` for one text (or pair)."""
        return self(text, text_pair, add_special_tokens=add_special_tokens, **kwargs)["input_ids"]

    @staticmethod
    def _truncate_pair(n0, n1, budget, strategy):
        """Lengths (k0, k1) to keep of two sequences of n0 and n1 tokens (n1 None for a single one) so that at most
        `budget` remain, as HF's fast tokenizer truncates; a ValueError (as HF's) where the strategy cannot."""
        total = n0 + (n1 or 0)
        if budget == 0:
            return 0, (None if n1 is None else 0)
        if total <= budget:
            return n0, n1
        remove = total - budget
        if n1 is None:
            if strategy == "only_second":
                raise ValueError("BertTokenizer: argument 'truncation' = 'only_second' needs a text_pair; the text "
                                 "alone is too long for max_length")
            return budget, None
        if strategy == "longest_first":
            # Remove one token at a time from the longer sequence; when they end up equal and one more must go,
            # it comes from the one that was shorter (the first on a tie). In closed form:
            short = min(n0, n1)
            if 2 * short <= budget:
                keep_short, keep_long = short, budget - short
            else:
                keep_short, keep_long = budget // 2, budget - budget // 2
            return (keep_short, keep_long) if n0 <= n1 else (keep_long, keep_short)
        target = n0 if strategy == "only_first" else n1
        if target <= remove:     # HF's fast tokenizer never truncates a sequence of the pair to nothing
            which = "text" if strategy == "only_first" else "text_pair"
            raise ValueError(f"BertTokenizer: argument 'max_length' is too small for truncation={strategy!r}: the "
                             f"{which} has {target} tokens, {remove} would have to go")
        return (n0 - remove, n1) if strategy == "only_first" else (n0, n1 - remove)

    def __call__(self, text, text_pair=None, add_special_tokens=True, padding=False, truncation=None,
                 max_length=None, return_tensors=None, return_token_type_ids=None, return_attention_mask=None,
                 return_offsets_mapping=False):
        """Encode a text, a pair, or a batch (a list of texts, and optionally a list of pairs of the same length).

        padding: False / "do_not_pad"; True / "longest" (to the longest of the batch); "max_length" (to
            max_length, or model_max_length when None). Pads on the right: pad_token_id, token type 0, mask 0,
            offsets (0, 0). A sequence longer than the target is not cut (that is truncation's job).
        truncation: False / "do_not_truncate"; True / "longest_first"; "only_first"; "only_second". None (the
            default) means "longest_first" when max_length is given and padding is off, else no truncation, as HF.
            The limit counts the special tokens; it is max_length, or model_max_length when None.
        return_tensors: None (lists) or "np" (int64 arrays of shape (batch, length), a batch axis added to a single
            text; the lengths must be equal, so pad a ragged batch).
        Returns a BatchEncoding with input_ids, token_type_ids (0 for "[CLS] A [SEP]", 1 for "B [SEP]"),
        attention_mask, and offset_mapping when asked: (start, end) character spans into the original text,
        (0, 0) for [CLS], [SEP] and padding."""
        pad = _PADDING.get(padding, "bad") if isinstance(padding, (bool, str)) else "bad"
        if pad == "bad":
            raise ValueError(f"BertTokenizer: argument 'padding' expected one of False, True, 'longest', "
                             f"'max_length', 'do_not_pad', got {padding!r}")
        trunc = _TRUNCATION.get(truncation, "bad") if truncation is None or isinstance(truncation, (bool, str)) \
            else "bad"
        if trunc == "bad":
            raise ValueError(f"BertTokenizer: argument 'truncation' expected one of None, False, True, "
                             f"'longest_first', 'only_first', 'only_second', 'do_not_truncate', got {truncation!r}")
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer))
                                       or max_length < 0):
            raise ValueError(f"BertTokenizer: argument 'max_length' expected a non-negative int or None, "
                             f"got {max_length!r}")
        if return_tensors not in (None, "np"):
            raise ValueError(f"BertTokenizer: argument 'return_tensors' expected None or 'np', got {return_tensors!r}")
        max_length = None if max_length is None else int(max_length)
        if truncation is None and max_length is not None and pad is None:
            trunc = "longest_first"       # HF: a max_length alone means truncate to it
        return_token_type_ids = True if return_token_type_ids is None else return_token_type_ids
        return_attention_mask = True if return_attention_mask is None else return_attention_mask

        batched = isinstance(text, (list, tuple))
        if batched:
            texts = list(text)
            if text_pair is None:
                pairs = [None] * len(texts)
            elif isinstance(text_pair, (list, tuple)) and len(text_pair) == len(texts):
                pairs = list(text_pair)
            else:
                got = (f"a list of {len(text_pair)}" if isinstance(text_pair, (list, tuple))
                       else type(text_pair).__name__)
                raise ValueError(f"BertTokenizer: argument 'text_pair' expected None or a list of {len(texts)} str "
                                 f"(one per text), got {got}")
        else:
            if text_pair is not None and not isinstance(text_pair, str):
                raise ValueError(f"BertTokenizer: argument 'text_pair' expected a str (text is a str), "
                                 f"got {type(text_pair).__name__}")
            texts, pairs = [text], [text_pair]

        limit = max_length if max_length is not None else self.model_max_length
        rows = []
        for a, b in zip(texts, pairs):
            _, ids0, off0 = self._encode_text(a, "text")
            _, ids1, off1 = self._encode_text(b, "text_pair") if b is not None else (None, None, None)
            if trunc is not None:
                n_special = self.num_special_tokens_to_add(b is not None) if add_special_tokens else 0
                if limit < n_special:
                    raise ValueError(f"BertTokenizer: argument 'max_length' = {limit} leaves no room for the "
                                     f"{n_special} special tokens")
                k0, k1 = self._truncate_pair(len(ids0), None if ids1 is None else len(ids1), limit - n_special, trunc)
                ids0, off0 = ids0[:k0], off0[:k0]
                if ids1 is not None:
                    ids1, off1 = ids1[:k1], off1[:k1]
            if add_special_tokens:
                ids = self.build_inputs_with_special_tokens(ids0, ids1)
                types = self.create_token_type_ids_from_sequences(ids0, ids1)
                offsets = [(0, 0)] + off0 + [(0, 0)] + ([] if ids1 is None else off1 + [(0, 0)])
            else:
                ids = ids0 + (ids1 or [])
                types = [0] * len(ids0) + [1] * len(ids1 or [])
                offsets = off0 + (off1 or [])
            rows.append([ids, types, [1] * len(ids), offsets])

        if pad is not None and self.pad_token is None:
            raise ValueError(f"BertTokenizer: argument 'padding' = {padding!r} needs a pad token, and this tokenizer "
                             f"has pad_token=None (transformers: 'Asking to pad but the tokenizer does not have a "
                             f"padding token')")
        if pad is not None and rows:
            if pad == "longest":
                target = max(len(r[0]) for r in rows)
            elif max_length is not None:
                target = max_length
            elif self.model_max_length < VERY_LARGE_INTEGER:
                target = self.model_max_length
            else:
                raise ValueError("BertTokenizer: argument 'max_length' is needed for padding='max_length' (this "
                                 "tokenizer has no model_max_length)")
            for r in rows:
                n = max(0, target - len(r[0]))
                r[0] += [self.pad_token_id] * n
                r[1] += [0] * n
                r[2] += [0] * n
                r[3] += [(0, 0)] * n

        keys = ["input_ids"] + (["token_type_ids"] if return_token_type_ids else []) \
            + (["attention_mask"] if return_attention_mask else []) \
            + (["offset_mapping"] if return_offsets_mapping else [])
        column = {"input_ids": 0, "token_type_ids": 1, "attention_mask": 2, "offset_mapping": 3}
        out = BatchEncoding()
        if return_tensors == "np":
            lengths = sorted({len(r[0]) for r in rows})
            if len(lengths) > 1:
                raise ValueError(f"BertTokenizer: argument 'return_tensors' = 'np' needs sequences of one length, "
                                 f"got lengths {[len(r[0]) for r in rows]}; pass padding=True or 'max_length'")
            width = lengths[0] if lengths else 0
            for k in keys:
                shape = (len(rows), width, 2) if k == "offset_mapping" else (len(rows), width)
                out[k] = np.array([r[column[k]] for r in rows], dtype=np.int64).reshape(shape)
        else:
            for k in keys:
                values = [r[column[k]] for r in rows]
                out[k] = values if batched else values[0]
        return out

    # -- decoding --------------------------------------------------------------------------------------------------

    def convert_tokens_to_string(self, tokens):
        """HF's: the tokens joined with spaces, " ##" joins removed."""
        return " ".join(tokens).replace(" ##", "").strip()

    @staticmethod
    def clean_up_tokenization(text):
        """HF's clean-up of tokenization spaces: no space before . ? ! , and English contractions glued."""
        return (text.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",")
                .replace(" ' ", "'").replace(" n't", "n't").replace(" 'm", "'m").replace(" 's", "'s")
                .replace(" 've", "'ve").replace(" 're", "'re"))

    def decode(self, token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=None):
        """The text of a sequence of ids, as HF's (fast) BertTokenizer decodes it: each token after the first gets a
        space before it, or loses its "##" if it is a continuation, and then each token goes through `_cleanup`
        (so ". ? ! ," glue to the word before). `skip_special_tokens` drops [CLS], [SEP], [PAD], [UNK], [MASK];
        `clean_up_tokenization_spaces` (None: the tokenizer's setting) then applies `clean_up_tokenization` to the
        whole text, which also glues contractions ("don ' t" -> "don't")."""
        if isinstance(token_ids, (int, np.integer)):
            token_ids = [token_ids]
        tokens = self._tokens_of(token_ids, skip_special_tokens, "token_ids")
        parts = []
        for i, token in enumerate(tokens):
            if i > 0:
                token = token[2:] if token.startswith("##") else " " + token
            parts.append(_cleanup(token))
        text = "".join(parts)
        if self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces:
            text = self.clean_up_tokenization(text)
        return text

    def batch_decode(self, sequences, skip_special_tokens=False, clean_up_tokenization_spaces=None):
        return [self.decode(s, skip_special_tokens, clean_up_tokenization_spaces) for s in sequences]

    # -- files -----------------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path, **kwargs):
        """Load a tokenizer folder: vocab.txt (or, without it, the WordPiece vocabulary of an HF tokenizer.json)
        and tokenizer_config.json if present (do_lower_case, strip_accents, tokenize_chinese_chars, never_split,
        the special tokens, model_max_length, clean_up_tokenization_spaces). `kwargs` override the file."""
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise ValueError(f"BertTokenizer.from_pretrained: argument 'path' expected a folder with vocab.txt, "
                             f"got '{path}', which is not a folder")
        config, keys = {}, ("do_lower_case", "never_split", "tokenize_chinese_chars", "strip_accents", "unk_token",
                            "sep_token", "pad_token", "cls_token", "mask_token", "model_max_length",
                            "clean_up_tokenization_spaces")
        vocab = os.path.join(path, VOCAB_FILES_NAMES["vocab_file"])
        fast = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(vocab):
            if not os.path.isfile(fast):
                raise ValueError(f"BertTokenizer.from_pretrained: vocabulary file '{vocab}' not found (nor "
                                 f"'{fast}')")
            vocab, config = cls._read_tokenizer_json(fast)
        for name in ("special_tokens_map.json", CONFIG_FILE):     # the later file wins
            file = os.path.join(path, name)
            if os.path.isfile(file):
                try:
                    with open(file, "r", encoding="utf-8") as f:
                        data = json.load(f)
                except (OSError, ValueError) as e:
                    raise ValueError(f"BertTokenizer.from_pretrained: '{file}' is not valid JSON: {e}") from None
                for k in keys:
                    if k in data:
                        value = data[k]
                        config[k] = value["content"] if isinstance(value, dict) and "content" in value else value
        longest = config.get("model_max_length")
        if isinstance(longest, (int, float)) and longest >= VERY_LARGE_INTEGER:
            config["model_max_length"] = None        # HF's "no limit"
        config.update(kwargs)
        return cls(vocab, **config)

    @staticmethod
    def _read_tokenizer_json(file):
        """(vocab, options) from the WordPiece model and BertNormalizer of an HF tokenizer.json."""
        try:
            with open(file, "r", encoding="utf-8") as f:
                data = json.load(f)
            model = data["model"]
            if model.get("type") != "WordPiece":
                raise ValueError(f"a {model.get('type')} model, not WordPiece")
            vocab = dict(model["vocab"])
            if sorted(vocab.values()) != list(range(len(vocab))):
                raise ValueError("its ids are not 0..n-1, each once (a vocab.txt with repeated tokens?)")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"BertTokenizer.from_pretrained: '{file}' holds no usable WordPiece vocabulary: "
                             f"{e}") from None
        options, norm = {}, data.get("normalizer") or {}
        if norm.get("type") == "BertNormalizer":
            options = {"do_lower_case": norm.get("lowercase", True), "strip_accents": norm.get("strip_accents"),
                       "tokenize_chinese_chars": norm.get("handle_chinese_chars", True)}
        return vocab, options

    def _config(self):
        never = sorted(self.basic_tokenizer.never_split) or None
        return {"tokenizer_class": "BertTokenizer", "do_lower_case": self.do_lower_case,
                "strip_accents": self.strip_accents, "tokenize_chinese_chars": self.tokenize_chinese_chars,
                "never_split": never, "unk_token": self.unk_token, "sep_token": self.sep_token,
                "pad_token": self.pad_token, "cls_token": self.cls_token, "mask_token": self.mask_token,
                "model_max_length": self.model_max_length,
                "clean_up_tokenization_spaces": self.clean_up_tokenization_spaces}

    def save_pretrained(self, path):
        """Write vocab.txt and tokenizer_config.json into the folder `path`, which transformers' BertTokenizer
        (and BertTokenizerFast) from_pretrained load. A new folder appears whole (written beside it, then renamed);
        in an existing one both files are written first, then renamed over the old ones (refbert.fileio.folder).
        Returns the paths."""
        _write_folder(path, {VOCAB_FILES_NAMES["vocab_file"]: "".join(t + "\n" for t in self._lines),
                             CONFIG_FILE: json.dumps(self._config(), indent=2, ensure_ascii=False) + "\n"})
        return (os.path.join(path, VOCAB_FILES_NAMES["vocab_file"]), os.path.join(path, CONFIG_FILE))


def _write_folder(path, files):
    """Write {name: text} into the folder `path` atomically (refbert.fileio.folder: a new folder appears whole; in
    an existing one every file is written before any old one is replaced)."""
    with folder(path) as target:
        for name, text in files.items():
            write_text(os.path.join(target, name), text)


# ---------------------------------------------------------------------------------------------------------------
# Training a vocabulary
# ---------------------------------------------------------------------------------------------------------------

def train_vocab(files, out_dir, vocab_size=8000, lowercase=True, min_frequency=2, limit_alphabet=1000):
    """Train a WordPiece vocabulary on text files with the `tokenizers` package's trainer (the one HF's BERT
    vocabularies come from) and write vocab.txt and tokenizer_config.json into `out_dir`, which
    `BertTokenizer.from_pretrained(out_dir)` and transformers' load. The special tokens [PAD] [UNK] [CLS] [SEP]
    [MASK] get ids 0..4. `lowercase` also strips accents (BERT "uncased"). Returns the path of vocab.txt."""
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    files = [os.fspath(f) for f in files]
    if not files:
        raise ValueError("train_vocab: argument 'files' expected at least one text file, got none")
    for f in files:
        if not os.path.isfile(f):
            raise ValueError(f"train_vocab: argument 'files' expected existing text files, got '{f}', which does "
                             f"not exist")
    if not any(_has_text(f) for f in files):
        raise ValueError(f"train_vocab: argument 'files' expected some text, got only empty or blank files {files}")
    for name, value, low in (("vocab_size", vocab_size, len(SPECIAL_TOKENS) + 1), ("min_frequency", min_frequency, 0),
                             ("limit_alphabet", limit_alphabet, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"train_vocab: argument '{name}' expected an int >= {low}, got {value!r}")
    try:
        from tokenizers import BertWordPieceTokenizer
    except ImportError:
        raise ImportError("train_vocab needs the 'tokenizers' package (pip install tokenizers); refbert's "
                          "tokenizer itself does not") from None

    trainer = BertWordPieceTokenizer(lowercase=lowercase, strip_accents=None, clean_text=True,
                                     handle_chinese_chars=True)
    alphabet, continuing = _fixed_alphabet(files, trainer, limit_alphabet)
    # The trainer (a BPE trainer underneath) breaks ties between equally frequent pairs by their ids, and numbers
    # the "##c" pieces in the order it walks a hash map of the corpus's words, which differs from process to
    # process: the same corpus gave different vocabularies. Naming every "##c" piece up front, in sorted order,
    # after the special tokens fixes all ids before the first merge; the alphabet is fixed the same way (the
    # trainer cuts it at limit_alphabet by count with ties in hash order). The tokens learned are the trainer's.
    trainer.train(files, vocab_size=vocab_size, min_frequency=min_frequency, limit_alphabet=limit_alphabet,
                  initial_alphabet=alphabet, special_tokens=SPECIAL_TOKENS + continuing, show_progress=False,
                  wordpieces_prefix="##")
    vocab = trainer.get_vocab()
    lines = _lines_of(vocab, "from the trainer")
    if lines[:len(SPECIAL_TOKENS)] != SPECIAL_TOKENS:
        raise RuntimeError(f"train_vocab: the trainer put {lines[:5]} first, not {SPECIAL_TOKENS}")
    # the trainer orders tokens that tie in frequency differently from run to run (a hash map inside); sort the
    # rest — single characters, then word starts, then ## pieces, each alphabetically — so that the ids depend
    # only on the set of tokens learned (ties at the vocab_size cut-off can still change that set: a pretraining
    # run saves its vocab.txt, and --vocab reuses one)
    rest = sorted(lines[len(SPECIAL_TOKENS):], key=lambda t: (len(t.removeprefix("##")) > 1, t.startswith("##"), t))
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + rest)}
    tok = BertTokenizer(vocab, do_lower_case=lowercase)
    tok.save_pretrained(out_dir)
    return os.path.join(os.fspath(out_dir), VOCAB_FILES_NAMES["vocab_file"])


def _fixed_alphabet(files, trainer, limit_alphabet, chunk=4096):
    """The alphabet the WordPiece trainer would keep (the `limit_alphabet` most frequent characters of the
    normalised, pre-tokenised words; ties by code point) and the "##c" pieces it would create (each kept character
    that occurs after the first character of a word), both sorted: computed with the trainer's own normaliser and
    pre-tokeniser, so that they are the trainer's, in an order that does not depend on hashing."""
    normalize, split = trainer.normalizer.normalize_str, trainer.pre_tokenizer.pre_tokenize_str
    words = collections.Counter()
    for file in files:
        try:
            with open(file, encoding="utf-8") as f:
                while lines := list(itertools.islice(f, chunk)):
                    words.update(w for w, _ in split(normalize("".join(lines))))
        except UnicodeDecodeError as e:
            raise ValueError(f"train_vocab: argument 'files' expected UTF-8 text, got '{file}', which is not "
                             f"({e.reason})") from None
    counts = collections.Counter()                     # character -> occurrences in the corpus's words
    inner = set()                                      # characters seen after a word's first
    for word, n in words.items():
        for ch in word:
            counts[ch] += n
        inner.update(word[1:])
    kept = sorted(counts, key=lambda ch: (-counts[ch], ch))[:limit_alphabet]
    return sorted(kept), ["##" + ch for ch in sorted(inner.intersection(kept))]


def _has_text(file):
    with open(file, "r", encoding="utf-8", errors="replace") as f:
        return any(line.strip() for line in f)


__all__ = ["BasicTokenizer", "WordpieceTokenizer", "BertTokenizer", "BatchEncoding", "load_vocab", "train_vocab"]
