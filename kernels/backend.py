"""The "numba" backend: refbert.ops with every fused op replaced by its Numba kernel (refbert.model.get_backend).

The model calls `ctx.ops.<op>_forward / <op>_backward`; this module has the same names, signatures and semantics
as refbert.ops, so `backend="numba"` swaps the kernels in without the model knowing. The matrix products (linear,
and the decoder) stay on NumPy's BLAS (kernels/linear.py adds the bias on both cores), the embeddings' backward
scatter is a Numba loop (kernels/embedding.py), and the ops whose cost is negligible or already a single NumPy call
(tanh of the pooler, mse, the row gather of the MLM decoder) are the oracle's own functions.
Each kernel is the fastest numbered version of its file; `refbert check` and tests/test_kernels_*.py validate every
version against the oracle, and tests/test_backend_parity.py the whole model against the numpy backend.
"""
from refbert.ops import (add_backward, add_forward, bce_with_logits_backward, bce_with_logits_forward,  # noqa: F401
                         gather_rows_backward, gather_rows_forward, mse_backward, mse_forward, tanh_backward,
                         tanh_forward)

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
