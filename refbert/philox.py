"""Counter-based random numbers for dropout: Philox4x32-10, so every backend drops exactly the same elements.

A `np.random.Generator` hands out numbers in sequence, which a kernel (a parallel loop, a CUDA block, a flash
attention backward that must regenerate the mask of one tile) cannot reproduce. A counter-based generator is a
pure function of (key, counter): element i of a dropout call gets its random word from

    words = philox4x32_10(counter = (i // 4, 0, stream_lo, stream_hi), key = (seed_lo, seed_hi))
    word  = words[i % 4]                                  uint32
    keep  = word >= threshold(p),   threshold(p) = round(p * 2^32)   (P(keep) = 1 - p to within 2^-32)

where `stream` counts the dropout calls of a model (one per call, drawn even when the tensor is tiny) and i is the
element's C-order index in the tensor (for attention: the flat index into (B, H, T, T)). The comparison is on
integers, so float32 and float64 runs, the NumPy oracle and every kernel keep the same elements, bit for bit.

Philox4x32-10 (Salmon, Moraes, Dror & Shaw 2011, "Parallel random numbers: as easy as 1, 2, 3", SC'11): ten
rounds of, on a counter (c0, c1, c2, c3) and key (k0, k1),
    hi0:lo0 = 0xD2511F53 * c0        hi1:lo1 = 0xCD9E8D57 * c2        (32 x 32 -> 64-bit products)
    (c0, c1, c2, c3) <- (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)
    (k0, k1) <- (k0 + 0x9E3779B9, k1 + 0xBB67AE85)   (mod 2^32; between rounds)
Known-answer vectors from the authors' Random123 distribution (kat_vectors) are tested in tests/test_philox.py.
"""
import numpy as np

M0, M1 = 0xD2511F53, 0xCD9E8D57        # round multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85        # key schedule: golden ratio and sqrt(3) - 1, as 32-bit fractions
ROUNDS = 10
_MASK32 = np.uint64(0xFFFFFFFF)


def philox4x32(c0, c1, c2, c3, k0, k1, rounds=ROUNDS):
    """Philox4x32 on arrays of 32-bit words (any integer dtype, values < 2^32, broadcastable): 4 uint32 arrays."""
    c = [np.asarray(a, np.uint64) & _MASK32 for a in (c0, c1, c2, c3)]
    k0, k1 = np.uint64(int(k0) & 0xFFFFFFFF), np.uint64(int(k1) & 0xFFFFFFFF)
    for r in range(rounds):
        p0 = np.uint64(M0) * c[0]                      # exact: both factors < 2^32
        p1 = np.uint64(M1) * c[2]
        c = [((p1 >> np.uint64(32)) ^ c[1] ^ k0) & _MASK32, p1 & _MASK32,
             ((p0 >> np.uint64(32)) ^ c[3] ^ k1) & _MASK32, p0 & _MASK32]
        if r < rounds - 1:
            k0, k1 = (k0 + np.uint64(W0)) & _MASK32, (k1 + np.uint64(W1)) & _MASK32
    return [a.astype(np.uint32) for a in c]


def threshold(p):
    """The integer cut for drop probability p: an element is kept when its word >= round(p * 2^32)."""
    return int(round(float(p) * 2.0 ** 32))


def random_words(seed, stream, n, start=0):
    """uint32 words for elements start .. start + n - 1 of one dropout call (seed, stream).  -> (n,) uint32"""
    first, last = start // 4, (start + n + 3) // 4            # the Philox blocks that cover the range
    block = np.arange(first, last, dtype=np.uint64)           # 4 words per Philox call: block b holds 4b .. 4b+3
    words = philox4x32(block & _MASK32, block >> np.uint64(32), stream & 0xFFFFFFFF, stream >> 32,
                       seed & 0xFFFFFFFF, seed >> 32)
    flat = np.stack(words, -1).reshape(-1)                    # (4 * blocks,): element 4b + j is word j of block b
    return flat[start - 4 * first: start - 4 * first + n]


def keep_mask(seed, stream, shape, p):
    """Boolean keep-mask of a dropout call: element i (C order) kept iff its word >= threshold(p).  -> shape, bool

    The same function as `random_words(seed, stream, n) >= threshold(p)`, computed by `_keep_blocks` in chunks of
    CHUNK Philox blocks (tests/test_philox.py checks the two agree, bit for bit)."""
    n = int(np.prod(shape))
    thr = threshold(p)
    if thr == 0 or thr >= 2 ** 32:                             # p = 0 keeps every word, p = 1 none
        return np.full(shape, thr == 0)
    nb = (n + 3) // 4                                          # Philox blocks: block b holds elements 4b .. 4b + 3
    keep = np.empty((nb, 4), np.bool_)
    bufs = [np.empty(min(nb, CHUNK), np.uint64) for _ in range(5)]
    consts = _constants(seed, thr)
    b0 = 0
    while b0 < nb:                                             # a chunk never crosses a multiple of 2^32 blocks,
        m = min(CHUNK, nb - b0, (((b0 >> 32) + 1) << 32) - b0)  # so the counter's high word is one number in it
        _keep_blocks(keep[b0:b0 + m], b0, seed, stream, thr, bufs, consts)
        b0 += m
    return keep.reshape(-1)[:n].reshape(shape)


# ----------------------------------------------------------------------------------------------------------------
# the fast path of keep_mask: Philox4x32-10 on chunks of blocks, every operation one in-place NumPy call on uint64

CHUNK = 1 << 14          # Philox blocks per chunk: five uint64 buffers of 128 KiB stay in a core's L2 cache
_U = np.uint64
_M0, _M1, _LO = np.array(M0, _U), np.array(M1, _U), np.array(0xFFFFFFFF, _U)   # 0-d operands (_c)
_S32 = np.array(32, _U)
_M0_IOTA = np.arange(CHUNK, dtype=_U) * _M0           # M0 i: round 1's products, less the chunk's M0 b0


def _constants(seed, thr):
    """The 0-d operands every chunk of one call shares: the round keys (k0, k1) of rounds 1 .. 10 and thr."""
    k0, k1 = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    keys = [(_c((k0 + r * W0) & 0xFFFFFFFF), _c((k1 + r * W1) & 0xFFFFFFFF)) for r in range(ROUNDS)]
    return keys, _c(thr), np.array(thr, np.uint32)


def _keep_blocks(kb, b0, seed, stream, thr, bufs, consts=None):
    """kb (m, 4) bool <- (word j of Philox block b0 + i) >= thr, for the m blocks b0 .. b0 + m - 1, which share the
    counter's high word b0 >> 32; 0 < thr < 2^32. bufs: five uint64 arrays of >= m entries (scratch); consts:
    _constants(seed, thr), made once per call.

    The round on (c0, c1, c2, c3) keeps the multiplicands c0, c2 and the low words c1 = lo(p1), c3 = lo(p0) in four
    arrays, each update one ufunc call into an existing array (no temporaries; out given positionally and every
    constant a 0-d uint64 array, the cheapest call NumPy makes):
        p0 = M0 c0, p1 = M1 c2 (uint64, exact);   c0 <- (p1 >> 32) ^ c1 ^ k0,  c1 <- p1 & LO,
                                                  c2 <- (p0 >> 32) ^ c3 ^ k1,  c3 <- p0 & LO
    The counter's c1 (= b0 >> 32), c2 and c3 (the stream) are one number for the whole chunk, so round 1 multiplies
    one vector (its p1 is a number) and so does round 2 (its p0 is a number): 90 array calls per chunk where every
    word a vector would take 104 (the last round's low words are compared where they lie, as uint32 views)."""
    m = kb.shape[0]
    keys, thr64, thr32 = _constants(seed, thr) if consts is None else consts
    a, b, t, c3, c1 = (x[:m] for x in bufs)                    # a: c0, b: c2, t: scratch
    k0, k1 = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    s0, s1 = stream & 0xFFFFFFFF, (stream >> 32) & 0xFFFFFFFF
    # round 1: c0 = b0 + i (a vector), c1 = b0 >> 32, c2 = s0, c3 = s1 (numbers)
    np.add(_M0_IOTA[:m], _c(M0 * (b0 & 0xFFFFFFFF)), a)        # p0 = M0 (b0 + i) = M0 b0 + M0 i (< 2^64: exact)
    p1 = M1 * s0
    x0 = (p1 >> 32) ^ (b0 >> 32) ^ k0                          # c0 (a number)
    x1 = p1 & 0xFFFFFFFF                                       # c1 (a number)
    np.right_shift(a, _S32, b)
    np.bitwise_xor(b, _c(s1 ^ k1), b)                          # c2 = hi(p0) ^ s1 ^ k1
    np.bitwise_and(a, _LO, c3)                                 # c3 = lo(p0)
    k0, k1 = (k0 + W0) & 0xFFFFFFFF, (k1 + W1) & 0xFFFFFFFF
    # round 2: p0 = M0 c0 (a number), p1 = M1 c2 (a vector)
    p0 = M0 * x0
    np.multiply(b, _M1, b)                                     # p1
    np.right_shift(b, _S32, a)
    np.bitwise_xor(a, _c(x1 ^ k0), a)                          # c0 = hi(p1) ^ c1 ^ k0
    np.bitwise_and(b, _LO, c1)                                 # c1 = lo(p1)
    np.bitwise_xor(c3, _c((p0 >> 32) ^ k1), b)                 # c2 = hi(p0) ^ c3 ^ k1
    x3 = p0 & 0xFFFFFFFF                                       # c3 (a number, for round 3)
    for r in range(2, ROUNDS):                                 # rounds 3 .. 10: every word a vector
        k0, k1 = (k0 + W0) & 0xFFFFFFFF, (k1 + W1) & 0xFFFFFFFF
        last = r == ROUNDS - 1
        np.multiply(a, _M0, a)                                 # p0
        np.multiply(b, _M1, b)                                 # p1
        np.right_shift(b, _S32, t)
        np.bitwise_xor(t, c1, t)
        np.bitwise_xor(t, keys[r][0], t)                       # t = c0' = hi(p1) ^ c1 ^ k0
        if not last:
            np.bitwise_and(b, _LO, c1)                         # c1' = lo(p1)
        else:                                                  # the last c1' = lo(p1) is only compared: read
            np.greater_equal(b.view(np.uint32)[0::2], thr32, kb[:, 1])   # as the low uint32 of p1
        np.right_shift(a, _S32, b)
        if r == 2:
            np.bitwise_xor(b, _c(x3 ^ k1), b)                  # c2' = hi(p0) ^ c3 ^ k1, c3 a number
        else:
            np.bitwise_xor(b, c3, b)
            np.bitwise_xor(b, keys[r][1], b)                   # c2' = hi(p0) ^ c3 ^ k1
        if not last:
            np.bitwise_and(a, _LO, c3)                         # c3' = lo(p0)
        else:
            np.greater_equal(a.view(np.uint32)[0::2], thr32, kb[:, 3])
        a, t = t, a
    np.greater_equal(a, thr64, kb[:, 0])                       # element 4 (b0 + i) + j is word j of block b0 + i
    np.greater_equal(b, thr64, kb[:, 2])


def _c(v):
    """v as a 0-d uint64 array (a ufunc operand NumPy converts faster than a scalar)."""
    return np.array(v, _U)




class DropoutRNG:
    """The model's dropout generator: a 64-bit seed and a count of dropout calls so far.

    `next_stream()` gives the (seed, stream) of the next call and advances the count; the oracle and every kernel
    turn that pair into the same mask. The whole state is two integers (`state`), so a checkpoint restores it
    exactly and a resumed run drops the same elements as an uninterrupted one.
    """

    def __init__(self, seed=0, calls=0):
        if not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 2 ** 64:
            raise ValueError(f"DropoutRNG: argument 'seed' expected an integer in [0, 2^64), got {seed!r}")
        self.seed, self.calls = int(seed), int(calls)

    @classmethod
    def from_seed_sequence(cls, ss):
        return cls(int(ss.generate_state(1, np.uint64)[0]))

    def next_stream(self):
        s = self.calls
        self.calls += 1
        return self.seed, s

    @property
    def state(self):
        return {"seed": self.seed, "calls": self.calls}

    @state.setter
    def state(self, st):
        self.seed, self.calls = int(st["seed"]), int(st["calls"])

    def __repr__(self):
        return f"DropoutRNG(seed={self.seed}, calls={self.calls})"
