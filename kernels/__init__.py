"""refbert_kernels: the fast path — fused softmax, layernorm, attention and friends in Numba (CPU), Numba CUDA and
CuPy (GPU). Installed under the import name `refbert_kernels` (setup.py package_dir), never as a top-level
`kernels`, which is an unrelated PyPI package.

Every kernel names its oracle in refbert.ops (e.g. `Oracle: refbert.ops.layernorm_forward`), keeps its numbered
versions from simplest to fastest, and is validated against the oracle before it is timed. The kernels arrive
in their own issue; this package is the place they go.
"""
