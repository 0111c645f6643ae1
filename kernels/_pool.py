"""Reuse of large output arrays between calls (linear v2, embedding v2, cross_entropy v4).

A large array (tens of MB) allocated afresh is, on most calls, a new mapping that NumPy asks the kernel to back with
2 MB pages: the first write of each page has the kernel zero it, and, when free memory is fragmented, compact memory
first (measured in the mini pretraining step here: the 31 MB embedding gradient took 2.7 ms on most steps and 65 ms
on some; the 125 MB logits ~10 ms of CPU every step). The training step makes the same large outputs every step and
drops them before the next one (the logits with the step's output, the word embeddings' gradient into the tied
decoder's, the loss's dlogits into the decoder's backward), so one array per shape is kept here and handed out
again once nothing but the pool refers to it. An output the caller still holds is never reused: a new one is made.
"""
import sys
import threading

import numpy as np

_pool = {}                                             # (tag, shape, dtype) -> the last array handed out
_lock = threading.Lock()


def empty(shape, dtype, tag, min_bytes):
    """An uninitialised array of shape: the pooled one for (tag, shape, dtype) when nothing else refers to it, else
    a new one (which becomes the pooled one). Below min_bytes: np.empty, no pooling."""
    shape = tuple(int(s) for s in shape)
    if int(np.prod(shape)) * np.dtype(dtype).itemsize < min_bytes:
        return np.empty(shape, dtype)
    key = (tag, shape, np.dtype(dtype).str)
    with _lock:
        a = _pool.get(key)
        if a is not None and sys.getrefcount(a) == 3:   # the pool's reference, `a` and getrefcount's argument: the
            return a                                   # caller's array (and every view of it) is gone
        a = np.empty(shape, dtype)
        _pool[key] = a
        return a


def clear():
    """Drop every pooled array (tests; or to give the memory back)."""
    with _lock:
        _pool.clear()
