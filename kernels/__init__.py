"""refbert_kernels: the fast path — fused softmax, layernorm, attention and friends in Numba (CPU), Numba CUDA and
CuPy (GPU). Installed under the import name `refbert_kernels` (setup.py package_dir), never as a top-level
`kernels`, which is an unrelated PyPI package.

Every kernel names its oracle in refbert.ops (e.g. `Oracle: refbert.ops.layernorm_forward`), keeps its numbered
versions from simplest to fastest, and is validated against the oracle before it is timed.
`python -m refbert_kernels.<op>` validates then times one file; `refbert bench` all of them.

Imported as a top-level `kernels` (from the repository's root, where `python -m ...` and `python -c ...` put the
working directory first on sys.path, so `import kernels` finds this folder before site-packages), this file steps
aside: `kernels` is Hugging Face's package, which transformers >= 5.25 requires and imports whenever it is installed
(`from kernels import CUDAProperties, ...`), and it gets that package, or, where none is installed, an empty namespace
(_hand_over).
"""

import os as _os
import sys as _sys


def _hand_over(name):
    """Load the installed package `name` in this module's place: the first that a finder on sys.meta_path gives
    for it, with this repository's root taken off sys.path (so an editable install of it is found too).

    A module may replace itself in sys.modules while it is being imported: the import system returns what
    sys.modules holds under the name once the module's code has run. The replacement is marked as initializing
    while it runs, as the import system marks a module, so another thread importing `name` meanwhile waits for it
    instead of taking it half made. With no such package installed, `name` becomes what Python makes of a folder
    without a package: an empty namespace (no __file__, nothing in it), which is how transformers' availability
    checks read "not installed" (importlib.util.find_spec finds this folder first, then they import it), and
    `from kernels import x` fails with ImportError as it would for a missing module."""
    import importlib.machinery
    import importlib.util
    import types
    here = _os.path.realpath(_os.path.dirname(_os.path.abspath(__file__)))
    root = _os.path.dirname(here)
    rest = [p for p in _sys.path if _os.path.realpath(_os.path.abspath(p or _os.curdir)) != root]
    spec = None
    for finder in _sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        found = find(name, rest) if finder is importlib.machinery.PathFinder else find(name, None)
        origin = getattr(found, "origin", None)
        if found is not None and not (origin and _os.path.realpath(origin).startswith(here + _os.sep)):
            spec = found
            break
    if spec is None or spec.loader is None:
        empty = types.ModuleType(name, f"No installed {name!r}: this repository's {name}/ folder (imported as "
                                       "refbert_kernels) read as an empty namespace")
        empty.__file__, empty.__path__ = None, []
        empty.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)   # (a namespace's: no loader)
        _sys.modules[name] = empty
        return
    module = importlib.util.module_from_spec(spec)
    spec._initializing = True
    _sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        spec._initializing = False


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
    _cache.lock_saves()     # (every process: two that compile the same kernel at once must not cross its entries)
