"""The counter-based dropout generator: Philox4x32-10 against its authors' known answers, and the mask's law.

Known-answer vectors: Random123's kat_vectors (Salmon et al., SC'11), the lines "philox4x32 10 <ctr x4> <key x2>
<out x4>"; an independent implementation either matches them bit for bit or is wrong.
"""
import math
import re

import numpy as np
import pytest

from refbert import philox
from refbert.philox import DropoutRNG, keep_mask, philox4x32, random_words, threshold

KAT = [  # counter (4 words), key (2 words) -> output (4 words)
    ((0, 0, 0, 0), (0, 0), (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
    ((0xffffffff,) * 4, (0xffffffff,) * 2, (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
    ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
     (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1)),
]


@pytest.mark.parametrize("ctr, key, want", KAT)
def test_philox4x32_10_known_answers(ctr, key, want):
    assert tuple(int(w) for w in philox4x32(*ctr, *key)) == want


def test_words_are_a_function_of_the_element_index_alone():
    seed, stream = 2 ** 40 + 17, 3
    whole = random_words(seed, stream, 103)
    for start in (0, 1, 5, 50):                       # any window, aligned to a Philox block or not
        np.testing.assert_array_equal(random_words(seed, stream, 20, start=start), whole[start:start + 20])
    block = philox4x32(7, 0, stream, 0, seed & 0xFFFFFFFF, seed >> 32)  # element 4*7 + j is word j of block 7
    np.testing.assert_array_equal(whole[28:32], block)
    assert not np.array_equal(whole, random_words(seed, stream + 1, 103))   # another call, another mask
    assert not np.array_equal(whole, random_words(seed + 1, stream, 103))


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_keep_rate_is_binomial(p):
    n = 200_000
    kept = int(keep_mask(5, 0, (n,), p).sum())
    # binomial(n, 1 - p): 5 sd is a bound a correct generator passes except with probability ~6e-7
    assert abs(kept - (1 - p) * n) <= 5 * math.sqrt(n * p * (1 - p)) + (threshold(p) == 2 ** 32)
    if p == 1.0:
        assert kept == 0
    if p == 0.0:
        assert kept == n


def test_dropout_rng_counts_calls_and_restores_its_state():
    r = DropoutRNG(9)
    assert [r.next_stream() for _ in range(3)] == [(9, 0), (9, 1), (9, 2)]
    again = DropoutRNG(0)
    again.state = r.state
    assert again.next_stream() == r.next_stream() == (9, 3)
    with pytest.raises(ValueError, match=r"'seed' expected an integer in \[0, 2\^64\), got -1"):
        DropoutRNG(-1)


@pytest.mark.parametrize("seed, stream", [(0, 0), (5, 3), (2 ** 40 + 17, 2 ** 33 + 5), (2 ** 64 - 1, 2 ** 64 - 1)])
def test_keep_mask_is_the_words_compared_with_the_threshold(seed, stream):
    # keep_mask's chunked fast path against philox4x32 itself (random_words), bit for bit: sizes that end inside a
    # Philox block, exactly at a chunk boundary and one past it; p at the ends and a word-exact threshold
    for n in (1, 5, 4 * philox.CHUNK, 4 * philox.CHUNK + 1, 4 * 20_001 + 3):
        words = random_words(seed, stream, n)
        for p in (0.0, 0.1, 0.5, 1.0, int(words[n // 2]) / 2 ** 32):
            np.testing.assert_array_equal(keep_mask(seed, stream, (n,), p), words >= np.uint64(threshold(p)))
    assert keep_mask(seed, stream, (3, 0, 2), 0.5).shape == (3, 0, 2)


def test_keep_blocks_carry_the_counter_high_word():
    # blocks past 2^32 set the counter's second word (c1 = block >> 32), which keep_mask's chunks hold constant
    thr = threshold(0.5)
    for b0, m in ((2 ** 32 - 3, 3), (2 ** 32, 5), (3 * 2 ** 32 + 7, 4)):
        kb = np.empty((m, 4), np.bool_)
        philox._keep_blocks(kb, b0, 77, 9, thr, [np.empty(m, np.uint64) for _ in range(5)])
        np.testing.assert_array_equal(kb.reshape(-1), random_words(77, 9, 4 * m, start=4 * b0) >= np.uint64(thr))


def test_threshold_is_p_times_2_to_the_32_rounded_to_nearest():
    """threshold(p) is round(p * 2^32), the cut the module docstring defines and every kernel must reproduce: the
    expected integers come from exact rational arithmetic (Fraction holds the float p exactly), so truncating instead
    of rounding, or any off-by-one, shows. None of these p lands on a half, so the tie rule plays no part."""
    from fractions import Fraction
    for p in (0.05, 0.1, 1 / 3, 0.9, 2.0 ** -32 * 7.75):
        want = round(Fraction(p) * 2 ** 32)
        assert Fraction(p) * 2 ** 32 % 1 != Fraction(1, 2), p
        assert threshold(p) == want, p
    assert threshold(0.5) == 2 ** 31 and threshold(0.0) == 0 and threshold(1.0) == 2 ** 32


@pytest.mark.parametrize("seed", [2 ** 64, 2 ** 70, 1.5, "7", None])
def test_dropout_rng_refuses_a_seed_that_is_not_a_64_bit_integer(seed):
    """The whole state is a 64-bit seed (two 32-bit Philox key words): 2^64 would wrap onto seed 0's masks, and a
    float or a string must not be silently converted. Each is a ValueError naming the argument and the value."""
    with pytest.raises(ValueError, match=rf"'seed' expected an integer in \[0, 2\^64\), got {re.escape(repr(seed))}"):
        DropoutRNG(seed)
    assert DropoutRNG(2 ** 64 - 1).seed == 2 ** 64 - 1 and DropoutRNG(np.uint64(3)).seed == 3


def test_dropout_rng_resumes_from_a_given_call_count():
    """DropoutRNG(seed, calls) continues a run: its next dropout call is number `calls`, as after that many calls."""
    assert DropoutRNG(5, calls=3).next_stream() == (5, 3)
    assert DropoutRNG(5, 3).state == {"seed": 5, "calls": 3}


def test_seed_from_a_seed_sequence_fills_64_bits():
    """from_seed_sequence must draw a full 64-bit seed, not a 32-bit one: over 16 seed sequences a uniform 64-bit
    draw stays below 2^32 every time with probability 2^-512. The same sequence gives the same seed (reproducible),
    different sequences different seeds."""
    seeds = [DropoutRNG.from_seed_sequence(np.random.SeedSequence(i)).seed for i in range(16)]
    assert max(seeds) >= 2 ** 32 and len(set(seeds)) == 16 and all(0 <= s < 2 ** 64 for s in seeds)
    assert DropoutRNG.from_seed_sequence(np.random.SeedSequence(3)).seed == seeds[3]
