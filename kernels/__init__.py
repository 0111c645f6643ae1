"""refbert_kernels: the fast path — fused softmax, layernorm, attention and friends in Numba (CPU), Numba CUDA and
CuPy (GPU). Installed under the import name `refbert_kernels` (setup.py package_dir), never as a top-level
`kernels`, which is an unrelated PyPI package.

Every kernel names its oracle in refbert.ops (e.g. `Oracle: refbert.ops.layernorm_forward`), keeps its numbered
versions from simplest to fastest, and is validated against the oracle before it is timed.
`python -m refbert_kernels.<op>` validates then times one file; `refbert bench` all of them.

Imported as a top-level `kernels` (from the repository's root, where `python -m ...` and `python -c ...` put the
working directory first on sys.path, so `import kernels` finds this folder before site-packages), this file steps
aside: `kernels` is Hugging Face's package, which transformers >= 5.25 requires and imports whenever it is installed
(`from kernels import CUDAProperties, ...`), and it gets that package (_hand_over).
"""

import os as _os
import sys as _sys


def _hand_over(name):
    """Load the installed package `name` from sys.path without this repository's root, in this module's place.

    A module may replace itself in sys.modules while it is being imported: the import system returns what
    sys.modules holds under the name once the module's code has run. With no such package installed, the import
    fails as that of a missing module does (ModuleNotFoundError), saying where this folder belongs."""
    import importlib.machinery
    import importlib.util
    root = _os.path.realpath(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
    rest = [p for p in _sys.path if _os.path.realpath(_os.path.abspath(p or _os.curdir)) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, rest)
    if spec is None:
        raise ModuleNotFoundError(f"No module named {name!r}: the folder {_os.path.dirname(__file__)} is refbert's "
                                  f"kernels, imported as refbert_kernels (pip install -e .), not as {name!r}",
                                  name=name)
    module = importlib.util.module_from_spec(spec)
    _sys.modules[name] = module
    spec.loader.exec_module(module)


if __name__ == "kernels":
    _hand_over(__name__)
else:
    if "NUMBA_THREADING_LAYER" not in _os.environ:
        # Numba's OpenMP pool spins after each parallel kernel, and OpenBLAS's threads spin after each GEMM: in a
        # model step the two alternate, and on 2 cores each pool's spinning steals the other's second core (measured
        # on the mini step here: the numba backend took 584 ms with the OpenMP pool, 306 ms with workqueue, whose
        # threads sleep when idle). Set NUMBA_THREADING_LAYER to choose another layer.
        try:
            import numba as _numba
            _numba.config.THREADING_LAYER = "workqueue"
        except ImportError:
            pass

    from . import _cache as _cache  # noqa: E402  (Numba's cache follows what the kernels import: _cache.py)

    _cache.install()
