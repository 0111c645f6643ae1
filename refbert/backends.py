"""What runs the model's ops: the oracle, refbert's kernels, or any module of yours (`backend=` on every model class).

A backend is a namespace with the oracle's names: `<op>_forward` / `<op>_backward` for every op of refbert.ops, and
`attention_probs`. `Backend(module)` builds one from any module, and every backend is built that way: "numpy" from
refbert.ops itself, "numba" from refbert_kernels.backend (the fused CPU kernels), "cuda" from
refbert_kernels.cuda.backend, and yours from a module object or a .py file:

    - an op function the module defines (named as the oracle's, with the oracle's signature) is the module's;
    - a composed op it does not define (refbert.ops.COMPOSED: residual_layernorm, dropout_residual_layernorm,
      bias_gelu, attention) is built by refbert.ops.compose over this backend's own basic ops, exactly as the oracle
      builds its own: a module that defines gelu_backward changes the model's bias + GELU, one that defines only
      layernorm every residual LayerNorm, one that defines softmax every attention;
    - every other op is the oracle's.
`backend.describe()` says which is which (`model.ops.describe()` for a model).

Arrays. The model hands NumPy arrays to every op. A module whose functions take another array library says so with
`ARRAY_LIBRARY = "torch"` (or "torch.cuda", "cupy", "numpy"; a function's own `array_library` attribute overrides
it), or is probed: its first call is tried with NumPy arrays, then with torch CPU tensors, CuPy arrays and torch CUDA
tensors (whichever are installed and have a device), the dropout generators' state restored between tries. Array
arguments (inside caches too) are converted to the function's library and the arrays it returns back to NumPy
(`convert`): through DLPack where the memory can be shared (NumPy and torch CPU, CuPy and torch CUDA), by a copy
to or from the device otherwise. A forward's cache is kept as the function made it; a backward reading a cache made
in another library (your backward after the oracle's forward) gets it converted.
A module that defines `to_device` (the cuda backend) keeps the model's arrays itself, in its ARRAY_LIBRARY: the
oracle's functions then run on host copies, their outputs moved back (the cuda backend's fallback for a kernel that
fails to load), and a composed op it lacks is the oracle's too (refbert.validate checks NumPy arrays only).
"""
import functools
import importlib
import importlib.util
import os
import sys

import numpy as np

from . import ops as oracle
from .philox import DropoutRNG

BUILTIN = {"numpy": "refbert.ops", "numba": "refbert_kernels.backend", "cuda": "refbert_kernels.cuda.backend"}
LIBRARIES = ("numpy", "torch", "cupy", "torch.cuda")
# every op of the oracle (a pair of functions), and the helper that reads attention's cache
OPS = tuple(n[:-len("_forward")] for n in dir(oracle) if n.endswith("_forward") and callable(getattr(oracle, n)))
NAMES = tuple(f"{op}_{half}" for op in OPS for half in ("forward", "backward")) + ("attention_probs",)


# ----------------------------------------------------------------------------------------------------------------
# array libraries

def library_of(x):
    """"numpy", "torch", "torch.cuda" or "cupy" for an array of that library; None for anything else."""
    if isinstance(x, np.ndarray):
        return "numpy"
    top = type(x).__module__.split(".")[0]
    if top == "torch" and hasattr(x, "device") and hasattr(x, "dtype"):
        return "torch.cuda" if x.device.type == "cuda" else "torch"
    if top == "cupy" and hasattr(x, "get"):
        return "cupy"
    return None


def convert(x, lib):
    """The array x in library `lib` ("numpy", "torch", "torch.cuda", "cupy"); non-arrays as they are. Memory is
    shared through DLPack where both sides can reach it (NumPy / torch CPU; CuPy / torch CUDA), copied otherwise
    (a read-only or broadcast NumPy view is copied first: DLPack cannot mark it read-only for every consumer)."""
    src = library_of(x)
    if src is None or src == lib:
        return x
    if lib == "numpy":
        if src == "cupy":
            return x.get()
        x = x.detach()
        if src == "torch.cuda":
            x = x.cpu()
        try:
            return np.from_dlpack(x)
        except (BufferError, RuntimeError, TypeError):
            return x.numpy()
    if lib == "cupy":
        import cupy
        if src == "numpy":
            return cupy.asarray(x)
        if src == "torch":
            return cupy.asarray(x.detach().numpy())
        return cupy.from_dlpack(x.detach())
    import torch
    if src == "cupy":
        t = torch.from_dlpack(x)
    elif src == "numpy":
        try:
            t = torch.from_dlpack(x) if x.flags.writeable else torch.from_numpy(np.array(x))
        except (BufferError, RuntimeError, TypeError):
            t = torch.from_numpy(np.array(x))
    else:
        t = x
    return t.cuda() if lib == "torch.cuda" else t.cpu()


def convert_tree(obj, lib):
    """convert() through tuples (NamedTuples kept), lists and dicts."""
    if isinstance(obj, tuple):
        items = [convert_tree(v, lib) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [convert_tree(v, lib) for v in obj]
    if isinstance(obj, dict):
        return {k: convert_tree(v, lib) for k, v in obj.items()}
    return convert(obj, lib)


@functools.lru_cache(maxsize=None)
def available_libraries():
    """The array libraries this process can use, in the order a probe tries them."""
    out = ["numpy"]
    try:
        import torch
        out.append("torch")
        cuda_torch = torch.cuda.is_available()
    except ImportError:
        cuda_torch = False
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            out.append("cupy")
    except Exception:                                   # not installed, or no driver / device
        pass
    if cuda_torch:
        out.append("torch.cuda")
    return tuple(out)


def _rngs(obj, found):
    """The DropoutRNGs among a call's arguments (their state is restored between probe tries)."""
    if isinstance(obj, DropoutRNG):
        found.append(obj)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            _rngs(v, found)
    elif isinstance(obj, dict):
        for v in obj.values():
            _rngs(v, found)
    return found


class ProbeError(RuntimeError):
    """A function that ran with none of the array libraries tried; the message has each try's error."""


def adapt(fn, lib, home="numpy", force=False):
    """fn (taking arrays of library `lib`, or None: probed on its first call) as a function called with arrays of
    `home`: array arguments converted to lib, returned arrays to home (a forward's cache as fn made it). Returns fn
    itself when lib == home and not force."""
    if lib is not None and lib not in LIBRARIES:
        raise ValueError(f"backend: {getattr(fn, '__name__', fn)!r} declares array library {lib!r}, expected one "
                         f"of {', '.join(LIBRARIES)}")
    if lib == home and not force:
        return fn
    forward = getattr(fn, "__name__", "").endswith("_forward")
    state = {"lib": lib}

    def run(use, args, kwargs):
        res = fn(*convert_tree(args, use), **convert_tree(kwargs, use))
        if forward and isinstance(res, tuple) and len(res) == 2:
            return convert_tree(res[0], home), res[1]
        return convert_tree(res, home)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if state["lib"] is not None:
            return run(state["lib"], args, kwargs)
        rngs = _rngs((args, kwargs), [])
        saved = [r.state for r in rngs]
        errors = []
        for use in available_libraries():             # (a tuple, cached: found once per process)
            try:
                res = run(use, args, kwargs)
            except Exception as e:                       # this library's arrays are not what fn takes: the next
                errors.append((use, e))
                for r, s in zip(rngs, saved):
                    r.state = s
                continue
            state["lib"] = use
            call.array_library = use
            return res
        if len({(type(e), str(e)) for _, e in errors}) == 1:    # the same error whatever the arrays: its own
            raise errors[0][1]
        raise ProbeError(f"{fn.__name__} ran with none of " + "; ".join(
            f"{use}: {type(e).__name__}: {e}" for use, e in errors)) from errors[0][1]
    call.array_library = lib
    return call


# ----------------------------------------------------------------------------------------------------------------
# modules from paths

_LOADED = {}


def load_module(spec, what="backend", names=False):
    """The module a spec names: a module object as it is, a path to a .py file (executed once per file version),
    or, with names=True, an importable module name. A spec that cannot be loaded is a ValueError naming it."""
    if not isinstance(spec, (str, os.PathLike)):
        return spec
    text = os.fspath(spec)
    if text.endswith(".py") or os.path.sep in text or os.path.isfile(text):
        path = os.path.abspath(text)
        if not os.path.isfile(path):
            raise ValueError(f"{what}: '{text}' expected a .py file, got "
                             f"{'a folder' if os.path.isdir(path) else 'nothing'}")
        if not path.endswith(".py"):             # (importlib finds no loader for another suffix)
            raise ValueError(f"{what}: '{text}' expected a .py file, got a file whose name does not end in .py")
        key = (path, os.stat(path).st_mtime_ns)
        if key in _LOADED:
            return _LOADED[key]
        name = "refbert_user_" + "".join(c if c.isalnum() else "_" for c in os.path.splitext(path)[0][-40:])
        folder = os.path.dirname(path)
        sys.path.insert(0, folder)                        # the file may import its neighbours
        try:
            mod_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[name] = module
            mod_spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(name, None)
            raise ValueError(f"{what}: '{text}' could not be loaded: {type(e).__name__}: {e}") from None
        finally:
            sys.path.remove(folder)
        _LOADED[key] = module
        return module
    if not names:
        raise ValueError(f"{what}: expected one of {', '.join(map(repr, BUILTIN))}, got {text!r} (or a module, or "
                         f"a path to a .py file)")
    try:
        return importlib.import_module(text)
    except Exception as e:
        raise ValueError(f"{what}: '{text}' expected a .py file or an importable module, got {type(e).__name__}: "
                         f"{e}") from None


# ----------------------------------------------------------------------------------------------------------------
# the backend

def _op(name):
    return "attention" if name == "attention_probs" else name.rsplit("_", 1)[0]


class Backend:
    """The model's ops from `module`: its own functions, composed ops over them, the oracle's for the rest (see the
    module docstring). Attributes: every name of NAMES; `origin` {function name: "own" | "composed" | "oracle"};
    `library` the module's declared array library (None: probed); `home` the library of the model's arrays. Any
    other attribute is the module's (to_device, to_host, describe, ...)."""

    def __init__(self, module, name=None):
        self.module = module
        self.name = name or getattr(module, "__file__", None) or getattr(module, "__name__", repr(module))
        self.library = getattr(module, "ARRAY_LIBRARY", None)
        self.home = (self.library or "numpy") if hasattr(module, "to_device") else "numpy"
        theirs = {n: getattr(module, n) for n in NAMES
                  if callable(getattr(module, n, None)) and getattr(module, n) is not getattr(oracle, n)}
        self.origin = {}
        fns = {}
        for n in NAMES:
            op = _op(n)
            if n in theirs:
                fns[n], self.origin[n] = adapt(theirs[n], getattr(theirs[n], "array_library", self.library),
                                               self.home), "own"
            elif op in oracle.COMPOSED and self.home == "numpy" and \
                    any(f"{b}_{h}" in theirs for b in oracle.COMPOSED[op] for h in ("forward", "backward")):
                self.origin[n] = "composed"
            else:
                # the oracle's half of a pair whose other half is theirs reads (or makes) their cache: convert it
                mixed = op != "attention" and any(f"{op}_{h}" in theirs for h in ("forward", "backward"))
                fns[n], self.origin[n] = adapt(getattr(oracle, n), "numpy", self.home, force=mixed), "oracle"
        if "attention_forward" in theirs and "attention_probs" not in theirs:
            fns["attention_probs"] = self._no_probs
            self.origin["attention_probs"] = "own"
        composed = oracle.compose(self)
        for n, where in self.origin.items():
            if where == "composed" and n not in fns:
                fns[n] = composed[n]
        self.__dict__.update(fns)

    def _no_probs(self, cache):
        raise ValueError(f"backend {self.name}: defines attention_forward but not attention_probs(cache), which "
                         f"output_attentions needs (the probabilities after dropout, (B, H, T, T))")

    def __getattr__(self, attr):                          # only called for what __init__ did not set
        if attr.startswith("__") or attr == "module":
            raise AttributeError(attr)
        return getattr(self.module, attr)

    def ops_of(self, where):
        """The ops (not functions) with any function of that origin ("own", "composed", "oracle"), in OPS order."""
        return [op for op in OPS if any(self.origin.get(f"{op}_{h}") == where for h in ("forward", "backward"))]

    def describe(self):
        """Which ops are the module's own, which are composed from its own, which are the oracle's: one line (after
        the module's own describe(), where it has one: the cuda backend's device and kernels)."""
        lines = [self.module.describe()] if callable(getattr(self.module, "describe", None)) else []
        own, mine = [], self.ops_of("own")
        for op in mine:
            halves = [h for h in ("forward", "backward") if self.origin[f"{op}_{h}"] == "own"]
            own.append(op if len(halves) == 2 else f"{op} ({halves[0]} only)")
        comp = [f"{op} (from {', '.join(b for b in oracle.COMPOSED[op] if b in mine)})"
                for op in self.ops_of("composed")]
        rest = [op for op in OPS if op not in mine and op not in self.ops_of("composed")]
        text = f"backend {self.name}: own ops: {', '.join(own) or 'none'}"
        if own:
            text += f" (arrays: {self.library or 'probed on the first call'})"
        if comp:
            text += f"; composed from its own: {', '.join(comp)}"
        lines.append(text + f"; the oracle's: {', '.join(rest) or 'none'}")
        return "\n".join(lines)

    def __repr__(self):
        return f"Backend({self.name!r}, own ops {self.ops_of('own')})"


_BUILTINS = {}


def get_backend(spec):
    """The Backend for "numpy" (the oracle), "numba" (refbert_kernels.backend), "cuda" (refbert_kernels.cuda.backend),
    a module object, a path to a .py file, or a Backend (as it is). Errors are ValueErrors that say what is needed."""
    if isinstance(spec, Backend):
        return spec
    if isinstance(spec, str) and spec in BUILTIN:
        if spec not in _BUILTINS:
            try:
                module = importlib.import_module(BUILTIN[spec])
            except ImportError as e:
                if spec == "numba":
                    raise ValueError(f"backend: 'numba' needs numba (pip install 'refbert[kernels]'): {e}") from None
                raise ValueError(f"backend: 'cuda' needs a CUDA GPU with CuPy and numba-cuda (pip install "
                                 f"'refbert[cuda]'), or Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1 set before "
                                 f"numba is imported): {e}") from None
            _BUILTINS[spec] = Backend(module, spec)
        return _BUILTINS[spec]
    if isinstance(spec, (str, os.PathLike)):
        return Backend(load_module(spec))
    if hasattr(spec, "__dict__") or hasattr(spec, "__getattr__"):
        return Backend(spec)
    raise ValueError(f"backend: expected one of {', '.join(map(repr, BUILTIN))}, got {spec!r} (or a module, or a "
                     f"path to a .py file)")
