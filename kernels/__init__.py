"""refbert_kernels: the fast path — fused softmax, layernorm, attention and friends in Numba (CPU), Numba CUDA and
CuPy (GPU). Installed under the import name `refbert_kernels` (setup.py package_dir), never as a top-level
`kernels`, which is an unrelated PyPI package.

Every kernel names its oracle in refbert.ops (e.g. `Oracle: refbert.ops.layernorm_forward`), keeps its numbered
versions from simplest to fastest, and is validated against the oracle before it is timed.
`python -m refbert_kernels.<op>` validates then times one file; `refbert bench` all of them.
"""

import os as _os

if "NUMBA_THREADING_LAYER" not in _os.environ:
    # Numba's OpenMP pool spins after each parallel kernel, and OpenBLAS's threads spin after each GEMM: in a
    # model step the two alternate, and on 2 cores each pool's spinning steals the other's second core (measured on
    # the mini step here: the numba backend took 584 ms with the OpenMP pool, 306 ms with workqueue, whose threads
    # sleep when idle). Set NUMBA_THREADING_LAYER to choose another layer.
    try:
        import numba as _numba
        _numba.config.THREADING_LAYER = "workqueue"
    except ImportError:
        pass

from . import _cache as _cache  # noqa: E402  (Numba's cache of these kernels follows what they import: _cache.py)

_cache.install()
