"""refbert_kernels.cuda: the GPU fast path in Numba CUDA — numbered kernel versions per op, llm.c style, each with
a host wrapper of exactly the oracle's signature and semantics (refbert.ops.<op>_forward / _backward) that takes
NumPy arrays (Numba moves them; or the CUDA simulator, NUMBA_ENABLE_CUDASIM=1) or CuPy arrays (outputs are
allocated with the input's own array module), in fp32, fp64, and fp16 / bf16 storage with fp32 accumulation.

Files: _common (storage kinds, device Philox, reductions, simulator shims, low-precision validation), softmax,
layernorm (plain, residual, dropout + residual), dropout, gelu (gelu, bias + gelu), cross_entropy, attention,
embedding (the backward as a sorted segment sum); cuda_c (the CUDA C versions, csrc/*.cu, launched by CuPy),
versions (which version runs, per op and dtype), emulate (CuPy and a GPU emulated on CPU threads), backend. Each
kernel file exposes
SPECS, a list of refbert_kernels._harness.KernelSpec whose `versions` are the host wrappers; `specs()` gathers
them for `refbert check --device cuda` / `refbert bench --device cuda`.
"""

import numpy as _np

if not hasattr(_np, "row_stack"):
    # numba-cuda <= 0.30 registers an overload for np.row_stack when it first types a kernel; NumPy 2.5 removed
    # that alias of np.vstack, and every first compile then fails with "module 'numpy' has no attribute
    # 'row_stack'" (seen on the lent H200: numpy 2.5.2, numba-cuda 0.30.4). Importing refbert_kernels.cuda (any
    # of its modules) before the first kernel compiles restores the alias it always was.
    _np.row_stack = _np.vstack

MODULES = ("softmax", "layernorm", "dropout", "gelu", "cross_entropy", "attention", "embedding")


def specs():
    """Every KernelSpec of every CUDA kernel file here (a module not present yet is skipped)."""
    import importlib
    out = []
    for m in MODULES:
        try:
            mod = importlib.import_module(f"refbert_kernels.cuda.{m}")
        except ModuleNotFoundError as e:
            if e.name != f"refbert_kernels.cuda.{m}":
                raise
            continue
        out += list(getattr(mod, "SPECS", []))
    return out
