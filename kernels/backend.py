"""The "numba" backend: refbert.ops with every fused op replaced by its Numba kernel (refbert.model.get_backend).

The model calls `ctx.ops.<op>_forward / <op>_backward`; this module defines the kernel-backed ops with the same
names, signatures and semantics as refbert.ops, and `get_backend("numba")` builds the backend from it exactly as
from any module of yours (refbert.backends.Backend): every op not defined here is the oracle's own function. The
matrix products (linear, and the decoder) stay on NumPy's BLAS (kernels/linear.py adds the bias on both cores), the
embeddings' backward scatter is a Numba loop (kernels/embedding.py), and the ops whose cost is negligible or already
a single NumPy call (tanh of the pooler, add, mse, bce_with_logits, the row gather of the MLM decoder) run as
refbert.ops writes them.
Each kernel is the fastest numbered version of its file; `refbert check` and tests/test_kernels_*.py validate every
version against the oracle, and tests/test_backend_parity.py the whole model against the numpy backend.
"""
from .attention import attention_backward, attention_forward, attention_probs  # noqa: F401
from .cross_entropy import cross_entropy_backward, cross_entropy_forward  # noqa: F401
from .dropout import dropout_backward, dropout_forward  # noqa: F401
from .embedding import embedding_backward, embedding_forward  # noqa: F401
from .gelu import bias_gelu_backward, bias_gelu_forward, gelu_backward, gelu_forward  # noqa: F401
from .layernorm import (dropout_residual_layernorm_backward, dropout_residual_layernorm_forward,  # noqa: F401
                        layernorm_backward, layernorm_forward, residual_layernorm_backward,
                        residual_layernorm_forward)
from .linear import linear_backward, linear_forward  # noqa: F401
from .softmax import softmax_backward, softmax_forward  # noqa: F401

ARRAY_LIBRARY = "numpy"          # the kernels take and return NumPy arrays (refbert.backends)


def _keep_freed_memory():
    """glibc's malloc, tuned for a training step: freed memory stays in the process (M_TRIM_THRESHOLD at its
    maximum, so the heap's top is not handed back to the kernel) and blocks up to 32 MiB come from that heap
    (M_MMAP_THRESHOLD at its maximum; it starts at 128 KiB and only grows as large blocks are freed). A step makes
    and drops the same few-MB temporaries every layer; by default glibc trims and maps them afresh, and each first
    touch of a fresh page is a fault (~3 us here, with the kernel zeroing the page): the mini step's bias_gelu
    backward took ~5 ms with fresh pages and ~1.3 ms with reused ones, and the whole step 1.27x the GEMM floor
    (median) against 1.14x tuned. The cost: the process keeps its peak heap (what a training run reaches anyway).
    Process-wide (every library's allocations); Linux with glibc only; REFBERT_MALLOC_TUNE=0 leaves malloc alone.
    Returns whether both settings were applied."""
    import os
    import sys
    if os.environ.get("REFBERT_MALLOC_TUNE", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version                              # glibc (musl has no mallopt thresholds)
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(libc.mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1)) and bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20))


MALLOC_TUNED = _keep_freed_memory()

# the ops computed by kernels here, and the file of each: every other name is refbert.ops' own function
KERNELS = {"softmax": "softmax", "layernorm": "layernorm", "residual_layernorm": "layernorm",
           "dropout_residual_layernorm": "layernorm", "dropout": "dropout", "gelu": "gelu", "bias_gelu": "gelu",
           "attention": "attention", "cross_entropy": "cross_entropy", "linear": "linear",
           "embedding": "embedding"}


def specs():
    """Every KernelSpec of every kernel file, in file order (each op's numbered versions and how to validate and
    time them)."""
    import importlib

    from ._harness import KernelSpec
    out, seen = [], set()
    for module in dict.fromkeys(KERNELS.values()):
        m = importlib.import_module(f"refbert_kernels.{module}")
        for v in vars(m).values():
            if isinstance(v, KernelSpec) and id(v) not in seen:
                seen.add(id(v))
                out.append(v)
    return out
