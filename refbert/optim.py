"""Training: AdamW with decoupled weight decay, BERT's learning-rate schedule, global gradient-norm clipping, and
fp16 loss scaling (GradScaler, torch.amp.GradScaler's state machine).

Everything works on the plain dicts the models hand out: `model.parameters()` (name -> the live array) and
`model.backward()` (name -> gradient, the same keys). A training step is

    opt = AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    sched = LinearWarmupDecay(1e-4, warmup_steps=10_000, total_steps=1_000_000)
    for step in range(total_steps):
        model(**batch)
        grads = model.backward()
        clip_grad_norm(grads, 1.0)
        opt.step(grads, lr=sched.lr(step))      # updates model.parameters() in place

which is the recipe of the original BERT (google-research/bert, optimization.py: create_optimizer) with torch's
AdamW in place of its AdamWeightDecayOptimizer; `AdamW(..., correct_bias=False)` is that optimizer exactly.

References: Loshchilov & Hutter, "Decoupled Weight Decay Regularization" (arXiv:1711.05101); Kingma & Ba, "Adam"
(arXiv:1412.6980); torch.optim.AdamW and torch.nn.utils.clip_grad_norm_ (PyTorch 2.13);
google-research/bert optimization.py.

Arrays: NumPy's, or a device library's whose arrays take NumPy's functions (`np.sqrt(a)`, `np.sum(a)`, ... dispatched
through __array_ufunc__ / __array_function__) and expose __cuda_array_interface__: CuPy's, as the "cuda" backend's
parameters and gradients are. The arithmetic is the same calls on either; on a device it stays there, except for
the checks' few numbers (each gradient's largest magnitude, each one's sum of squares), which come to the host in one
copy per call. state_dict() hands out NumPy copies (a checkpoint writes them as they are); load_state_dict() takes
NumPy (or the parameters' library's) arrays and puts its copies beside the parameters, on their device.

Device arrays in a few launches. The per-array code above is the spec; on a device it costs 13 launches a
parameter for AdamW.step's update (14 with weight decay) and 5 more for its check and the clipping (BERT-base:
3,788 a step). Where every array of a call is a device array that refbert_kernels.cuda.optim takes (CuPy's or its
emulator's, float32 / float64, contiguous), AdamW.step, clip_grad_norm and GradScaler.unscale_ run its multi-tensor
kernels instead
(csrc/optim.cu: one launch for the update, two for the checks' numbers, one for a scaling): the same operations in
the same order, so the same bits as the per-array code, except the float64 sum of squares behind clip_grad_norm's
norm, taken in another fixed order (both within 4e-14 of the exact sum). REFBERT_FUSED_OPTIM=0 keeps the per-array
code; LAST_PATH says what the last call of each ran, and a device call that could not take the kernels warns once,
why.
"""
import contextlib
import importlib
import math
import numbers
import os
import warnings

import numpy as np

from .validate import FLOATS
from .validate import _desc as _desc_numpy


# ----------------------------------------------------------------------------------------------------------------
# argument checks

def _number(who, name, x, low, high=None, low_open=False, high_open=True):
    """A real, finite number in the interval low..high (open or closed at each end). Returns it as a Python float,
    so that NumPy keeps a float32 array float32 when it meets it."""
    lb, rb = ("(" if low_open else "["), (")" if high_open or high is None else "]")
    want = f"a finite number in {lb}{low}, {'inf' if high is None else high}{rb}"
    if not isinstance(x, numbers.Real) or isinstance(x, bool):
        raise ValueError(f"{who}: argument '{name}' expected {want}, got {type(x).__name__} {x!r}")
    v = float(x)
    ok = math.isfinite(v) and (v > low if low_open else v >= low)
    if high is not None:
        ok = ok and (v < high if high_open else v <= high)
    if not ok:
        raise ValueError(f"{who}: argument '{name}' expected {want}, got {x!r}")
    return v


def _integer(who, name, x, low):
    if not isinstance(x, numbers.Integral) or isinstance(x, bool) or x < low:
        raise ValueError(f"{who}: argument '{name}' expected an integer >= {low}, got {type(x).__name__} {x!r}")
    return int(x)


def _names(keys, limit=5):
    keys = sorted(keys)
    more = f" (and {len(keys) - limit} more)" if len(keys) > limit else ""
    return repr(keys[:limit]) + more


# ----------------------------------------------------------------------------------------------------------------
# arrays of any library: NumPy's, or a device's (CuPy) that takes NumPy's functions

def _is_device(x):
    """An array of another library that lives on a GPU (__cuda_array_interface__) and takes NumPy's functions
    (__array_ufunc__, __array_function__): CuPy's."""
    return (not isinstance(x, np.ndarray) and hasattr(x, "__cuda_array_interface__")
            and hasattr(type(x), "__array_ufunc__") and hasattr(type(x), "__array_function__")
            and hasattr(x, "dtype") and hasattr(x, "shape"))


def _is_array(x):
    return isinstance(x, np.ndarray) or _is_device(x)


def _on_device(x):
    """x lives on a device: _is_device's arrays, and a NumPy subclass standing for device memory (the emulated
    CuPy of refbert_kernels.cuda.emulate) too, whose reads back are counted as a GPU's."""
    return type(x) is not np.ndarray and hasattr(x, "__cuda_array_interface__")


def _lib(x):
    """The top-level module of x's type: "numpy", "cupy"."""
    return type(x).__module__.split(".")[0]


def _same_lib(a, p):
    """a is an array of p's library (a NumPy array for a NumPy parameter)."""
    return isinstance(a, np.ndarray) if isinstance(p, np.ndarray) else _is_device(a) and _lib(a) == _lib(p)


def _where(p):
    """Where a device parameter lives, for messages ("" for NumPy's)."""
    return "" if isinstance(p, np.ndarray) else f", a {_lib(p)} array"


def _desc(x):
    if _is_device(x):
        return f"{_lib(x)} array of shape {tuple(x.shape)} and dtype {x.dtype}"
    return _desc_numpy(x)


def _host(a):
    """A NumPy copy of a (a NumPy array: a.copy(); an array with .get(), CuPy's or a NumPy subclass standing for
    device memory as refbert_kernels.cuda.emulate's, by its get())."""
    if isinstance(a, np.ndarray) and not hasattr(a, "get"):
        return a.copy()
    return np.asarray(a.get() if hasattr(a, "get") else a.copy_to_host())


def _copy_like(a, p):
    """A copy of a (NumPy's or p's library's) in p's library, on p's device (p's __array_namespace__: a NumPy
    subclass standing for device memory, as refbert_kernels.cuda.emulate's, names its own)."""
    if type(p) is np.ndarray:
        return np.array(a, copy=True)
    ns = getattr(p, "__array_namespace__", None)
    xp = ns() if ns is not None else importlib.import_module(_lib(p))
    device = getattr(p, "device", None)
    with device if hasattr(device, "__enter__") else contextlib.nullcontext():   # CuPy: p's GPU current
        return xp.array(a, copy=True)


def _host_floats(values):
    """Python floats of a list of scalars / 0-d arrays: NumPy's read as they are, a device's brought over together
    in one copy (one synchronisation instead of one per value)."""
    out = [None] * len(values)
    groups = {}
    for i, v in enumerate(values):
        if _on_device(v):
            groups.setdefault(_lib(v), []).append(i)
        else:
            out[i] = float(v)
    for idx in groups.values():
        for i, x in zip(idx, _host(np.stack([values[i] for i in idx])).tolist()):
            out[i] = float(x)
    return out


# ----------------------------------------------------------------------------------------------------------------
# the multi-tensor kernels for device arrays

FUSED_ENV = "REFBERT_FUSED_OPTIM"
FUSED = "multi-tensor kernels (refbert_kernels.cuda.optim: csrc/optim.cu v1)"
PER_ARRAY = "per-array code"
LAST_PATH = {}          # "AdamW.step" / "clip_grad_norm" / "GradScaler.unscale_" -> what its last call ran
_WARNED = set()


def _fused(who, arrays, depth=3):
    """refbert_kernels.cuda.optim when it takes these arrays (every one a device array it handles, its kernels
    built) and REFBERT_FUSED_OPTIM is not "0"; None otherwise (the per-array code runs). CuPy arrays that cannot
    take the kernels say why, once per reason (the warning points `depth` frames up: the user's call): a slow path
    is never silent; another device library's arrays (which the kernels are not for) take the per-array code, as
    LAST_PATH records, without a warning."""
    dev = [_on_device(a) for a in arrays]
    if not arrays or not all(dev):
        LAST_PATH[who] = PER_ARRAY + ("" if not any(dev) else " (host and device arrays)")
        return None
    if os.environ.get(FUSED_ENV, "1") == "0":
        LAST_PATH[who] = PER_ARRAY + f" ({FUSED_ENV}=0)"
        return None
    ours = True                                 # (arrays refbert_kernels.cuda is for: CuPy's, the emulator's)
    try:
        mod = importlib.import_module("refbert_kernels.cuda.optim")
        ours = mod.owns(arrays)
        why = mod.why_not(arrays)
        if why is None:
            mod.prepare(arrays)
    except Exception as e:                      # no refbert_kernels, no numba or CuPy, a kernel that fails to build
        mod, why = None, f"refbert_kernels.cuda.optim: {type(e).__name__}: {e}"
    if why is None:
        LAST_PATH[who] = FUSED
        return mod
    LAST_PATH[who] = f"{PER_ARRAY} ({why})"
    if ours and (who, why) not in _WARNED:      # (another device library's arrays: the per-array code, unsaid)
        _WARNED.add((who, why))
        warnings.warn(f"{who}: device arrays took the per-array code, not the multi-tensor kernels ({why})",
                      RuntimeWarning, stacklevel=depth)
    return None


def describe():
    """One line: what the last call of AdamW.step, clip_grad_norm and GradScaler.unscale_ ran (LAST_PATH), those
    that ran at all."""
    return "; ".join(f"{k}: {v}" for k, v in sorted(LAST_PATH.items())) or "no optimizer step yet"


# ----------------------------------------------------------------------------------------------------------------
# argument checks on arrays

def _finite(who, arg, key, g, peak):
    """Every value of g is finite, and so is its square (the second moment must not overflow to inf). `peak` is
    float(np.max(np.abs(g))) (NaN if g holds a NaN, inf if an inf)."""
    if not math.isfinite(peak):
        bad = ~np.isfinite(g)
        i = tuple(int(j) for j in np.argwhere(bad)[0])
        raise ValueError(f"{who}: argument '{arg}' key {key!r} expected finite values, got {g[i]} at index {i}")
    if peak > math.sqrt(float(np.finfo(g.dtype).max)):
        raise ValueError(f"{who}: argument '{arg}' key {key!r} expected values whose square is finite in "
                         f"{g.dtype}, got a largest magnitude of {peak}")


def _float_array(who, arg, key, x, writeable=False):
    """x a float32/float64 array (NumPy's or a device library's); writeable: one this call changes in place, so a
    read-only one is refused before any array is changed."""
    if not _is_array(x) or np.dtype(x.dtype).type not in FLOATS:
        raise ValueError(f"{who}: argument '{arg}' key {key!r} expected a float32 or float64 numpy array, "
                         f"got {_desc(x)}")
    if writeable and not getattr(getattr(x, "flags", None), "writeable", True):    # (CuPy's arrays are always)
        raise ValueError(f"{who}: argument '{arg}' key {key!r} expected a writeable array (it is scaled in place), "
                         f"got a read-only one")


def _no_overlap(who, params):
    """No two parameters share memory (views of one array: a[:2] beside a would be updated twice, silently): their
    byte ranges, sorted by start, each compared with the earlier ones that end past its start (interleaved NumPy
    views, whose ranges overlap, then asked of np.shares_memory; a device array's bounds decide). Arrays of size 0
    hold nothing."""
    spans = []
    for name, p in params.items():
        if p.size == 0:
            continue
        face = getattr(p, "__array_interface__" if isinstance(p, np.ndarray) else "__cuda_array_interface__", None)
        if face is None:                                # (an array of no known layout: not compared)
            continue
        item = np.dtype(p.dtype).itemsize
        strides = face.get("strides") or tuple(int(np.prod(p.shape[i + 1:], dtype=np.int64)) * item
                                               for i in range(len(p.shape)))      # None: C-contiguous
        steps = [(n - 1) * st for n, st in zip(p.shape, strides)]
        ptr = face["data"][0]
        spans.append((ptr + sum(min(0, d) for d in steps), ptr + sum(max(0, d) for d in steps) + item, name))
    spans.sort()
    active = []                                         # earlier spans that end past the current start
    for lo, hi, n1 in spans:
        active = [(h, n) for h, n in active if h > lo]
        for _, n0 in active:
            a, b = params[n0], params[n1]
            # (bounds that overlap hold a shared element, but for interleaved views: NumPy's exact test decides)
            if not isinstance(a, np.ndarray) or np.shares_memory(a, b):
                raise ValueError(f"{who}: argument 'params' key {n1!r} expected its own memory, got an array that "
                                 f"overlaps key {n0!r}'s (views of one array would be updated twice)")
        active.append((hi, n1))


# ----------------------------------------------------------------------------------------------------------------
# AdamW

class AdamW:
    """Adam with decoupled weight decay, updating a dict of live NumPy arrays in place (or CuPy arrays: the "cuda"
    backend's parameters; the moments are then kept on their device too, see the module docstring).

    `params` is `model.parameters()`: name -> the model's own float32/float64 array. `step(grads)` takes a dict
    with exactly the same keys, shapes and dtypes (`model.backward()`) and overwrites the arrays, so the model sees
    the new values. The moments m, v are kept per name in the parameter's dtype, zero at the start.

    One step, with t the step count after this step (1, 2, ...), λ = weight_decay for a decayed name and 0 for an
    exempt one, and lr the learning rate of this step:

        m <- β1·m + (1 - β1)·g
        v <- β2·v + (1 - β2)·g²

    correct_bias=True (the default) is torch.optim.AdamW (PyTorch 2.13, its single-tensor CPU path), operation
    for operation:

        p <- p·(1 - lr·λ)                                              decay first, on the old p
        p <- p - (lr / (1 - β1^t)) · m / (√v / √(1 - β2^t) + ε)         ε added to the bias-corrected √v̂

    correct_bias=False is the original BERT optimizer, google-research/bert optimization.py
    AdamWeightDecayOptimizer, exactly:

        u = m / (√v + ε) + λ·p                                         the old p, before this step
        p <- p - lr·u

    How the two differ:
      * bias correction: google has none. Its Adam term is m/(√v + ε); torch's is m̂/(√v̂ + ε) with
        m̂ = m/(1 - β1^t), v̂ = v/(1 - β2^t). Ignoring ε, google's step is (1 - β1^t)/√(1 - β2^t) times torch's:
        for β = (0.9, 0.999) that is 3.16 at t = 1, a peak of 6.57 at t = 12, 3.24 at t = 100, 1.26 at t = 1000,
        tending to 1 (BERT's warmup, lr = 0 at step 0 then rising linearly, is what tames these early steps).
      * ε placement: both add ε to a square root, but torch adds it to √v̂ = √v/√(1 - β2^t), google to the raw √v.
        Written on the raw √v, torch's step is (√(1 - β2^t)/(1 - β1^t))·m/(√v + ε·√(1 - β2^t)): its ε acts
        smaller early in training (by √(1 - β2^t): 0.032 at t = 1).
      * weight decay: google adds λ·p_old to the Adam direction and multiplies the sum by lr; torch first
        multiplies p by (1 - lr·λ) and then takes the Adam step. Both are p_old - lr·λ·p_old - lr·(Adam term), the
        same number in exact arithmetic: they differ only in rounding order. In both, the decay is neither
        bias-corrected nor divided by √v (that is what "decoupled" means). (HF's old transformers.AdamW, whose
        argument `correct_bias` this class borrows, differed again: ε on the raw √v even with correction, and the
        decay applied after the Adam step, to the updated p.)

    Which names are decayed: a name is exempt from weight decay iff one of the strings in `no_decay` occurs in it
    as a substring (`any(s in name for s in no_decay)`, the rule of HF's examples). With the default
    ("bias", "LayerNorm.weight") that exempts every bias (every name containing "bias": the ".bias" of each
    linear and LayerNorm, and "cls.predictions.bias") and every LayerNorm weight: the same tensors as google's
    exclude_from_weight_decay=["LayerNorm", "layer_norm", "bias"]. `self.decay[name]` says which it is.

    Arguments: lr >= 0; betas (β1, β2) each in [0, 1); eps > 0 (torch also accepts 0, but then a gradient that
    has been exactly 0 so far gives 0/0); weight_decay >= 0; all finite. Bad gradients (missing or extra keys,
    another shape or dtype, a NaN or inf, a value whose square overflows the dtype) raise a ValueError naming the
    key before anything is written: the model and the optimizer state are then untouched.
    """

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, correct_bias=True,
                 no_decay=("bias", "LayerNorm.weight")):
        who = "AdamW"
        if not isinstance(params, dict) or not params:
            raise ValueError(f"{who}: argument 'params' expected a non-empty dict name -> numpy array "
                             f"(model.parameters()), got {type(params).__name__} of length "
                             f"{len(params) if hasattr(params, '__len__') else '?'}")
        seen = {}
        for name, p in params.items():
            if not isinstance(name, str):
                raise ValueError(f"{who}: argument 'params' expected str keys, got {type(name).__name__} {name!r}")
            _float_array(who, "params", name, p)
            if not getattr(getattr(p, "flags", None), "writeable", True):      # (CuPy's arrays are always)
                raise ValueError(f"{who}: argument 'params' key {name!r} expected a writeable array "
                                 f"(it is updated in place), got a read-only one")
            if id(p) in seen:
                raise ValueError(f"{who}: argument 'params' key {name!r} expected its own array, got the array "
                                 f"of key {seen[id(p)]!r} again (it would be updated twice)")
            seen[id(p)] = name
        _no_overlap(who, params)
        self.params = dict(params)      # our own dict of the model's arrays: the arrays themselves are shared
        self._set_hyper(who, lr, betas, eps, weight_decay, correct_bias, no_decay)
        self.step_count = 0
        self.m = {k: np.zeros_like(p) for k, p in self.params.items()}
        self.v = {k: np.zeros_like(p) for k, p in self.params.items()}

    def _set_hyper(self, who, lr, betas, eps, weight_decay, correct_bias, no_decay):
        lr = _number(who, "lr", lr, 0.0)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"{who}: argument 'betas' expected a pair (beta1, beta2), got {betas!r}")
        b1 = _number(who, "betas[0]", betas[0], 0.0, 1.0)
        b2 = _number(who, "betas[1]", betas[1], 0.0, 1.0)
        eps = _number(who, "eps", eps, 0.0, low_open=True)
        weight_decay = _number(who, "weight_decay", weight_decay, 0.0)
        if not isinstance(correct_bias, (bool, np.bool_)):
            raise ValueError(f"{who}: argument 'correct_bias' expected True or False, got {correct_bias!r}")
        if (isinstance(no_decay, str) or not isinstance(no_decay, (tuple, list))
                or not all(isinstance(s, str) and s for s in no_decay)):
            raise ValueError(f"{who}: argument 'no_decay' expected a tuple of non-empty name substrings, "
                             f"e.g. ('bias', 'LayerNorm.weight'), got {no_decay!r}")
        self.lr, self.betas, self.eps, self.weight_decay = lr, (b1, b2), eps, weight_decay
        self.correct_bias, self.no_decay = bool(correct_bias), tuple(no_decay)
        self.decay = {k: not any(s in k for s in self.no_decay) for k in self.params}

    def _check_grads(self, who, grads):
        """Refuse bad gradients (the class docstring) before anything is written; returns the multi-tensor kernels
        when they take this step's arrays (_fused), else None."""
        if not isinstance(grads, dict):
            raise ValueError(f"{who}: argument 'grads' expected a dict name -> gradient (model.backward()), "
                             f"got {type(grads).__name__}")
        missing, extra = set(self.params) - set(grads), set(grads) - set(self.params)
        if missing or extra:
            raise ValueError(f"{who}: argument 'grads' expected exactly the parameters' keys, got "
                             f"{len(missing)} missing {_names(missing)} and {len(extra)} unexpected {_names(extra)}")
        for name, p in self.params.items():
            g = grads[name]
            if not _same_lib(g, p) or g.shape != p.shape or g.dtype != p.dtype:
                raise ValueError(f"{who}: argument 'grads' key {name!r} expected an array of shape {p.shape} and "
                                 f"dtype {p.dtype} (the parameter's{_where(p)}), got {_desc(g)}")
        fused = _fused("AdamW.step", [*self.params.values(), *(grads[k] for k in self.params), *self.m.values(),
                                      *self.v.values()], depth=4)
        names = [name for name, g in grads.items() if g.size]
        if fused is not None and names:                 # every peak in one launch pair and one copy
            peaks = fused.grad_stats([grads[name] for name in names])[:, 1].tolist()
        else:
            peaks = _host_floats([np.max(np.abs(grads[name])) for name in names])
        for name, peak in zip(names, peaks):
            _finite(who, "grads", name, grads[name], peak)
        return fused

    def step(self, grads, lr=None):
        """One update of every parameter in place (the formulas in the class docstring). `lr` overrides the
        learning rate for this step only (pass the schedule's value); None uses self.lr."""
        who = "AdamW.step"
        lr = self.lr if lr is None else _number(who, "lr", lr, 0.0)
        fused = self._check_grads(who, grads)
        self.step_count += 1
        t = self.step_count
        b1, b2 = self.betas
        eps, wd = self.eps, self.weight_decay
        step_size, bc2_sqrt = 0.0, 1.0                      # (google's form uses neither)
        if self.correct_bias:
            step_size = lr / (1.0 - b1 ** t)
            bc2_sqrt = math.sqrt(1.0 - b2 ** t)
        if fused is not None:                               # the loop below, every tensor in one launch
            names = list(self.params)
            fused.adamw_([self.params[k] for k in names], [grads[k] for k in names], [self.m[k] for k in names],
                         [self.v[k] for k in names], [bool(self.decay[k] and wd) for k in names], b1, 1.0 - b1, b2,
                         1.0 - b2, eps, lr, wd, 1.0 - lr * wd, step_size, bc2_sqrt, self.correct_bias)
            return
        for name, p in self.params.items():
            g, m, v = grads[name], self.m[name], self.v[name]
            lam = wd if self.decay[name] else 0.0
            m *= b1
            m += (1.0 - b1) * g
            v *= b2
            v += (1.0 - b2) * np.square(g)
            if self.correct_bias:                           # torch.optim.AdamW
                if lam:
                    p *= 1.0 - lr * lam
                denom = np.sqrt(v) / bc2_sqrt + eps
                p -= step_size * (m / denom)
            else:                                           # google-research/bert AdamWeightDecayOptimizer
                update = m / (np.sqrt(v) + eps)
                if lam:
                    update += lam * p
                p -= lr * update

    def state_dict(self):
        """Everything needed to continue bit-exactly, as a plain dict of copies: the step count, m and v per name,
        and the hyperparameters. The parameters themselves are the model's: save them beside this."""
        return {"step_count": self.step_count,
                "m": {k: _host(a) for k, a in self.m.items()},
                "v": {k: _host(a) for k, a in self.v.items()},
                "lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay,
                "correct_bias": self.correct_bias, "no_decay": self.no_decay}

    def load_state_dict(self, state):
        """Restore a state_dict() (copies its arrays in). m and v must have exactly the parameters' keys, shapes
        and dtypes, be finite, and v >= 0; the hyperparameters are checked as in the constructor. Nothing is
        changed unless all of it is valid."""
        who = "AdamW.load_state_dict"
        keys = {"step_count", "m", "v", "lr", "betas", "eps", "weight_decay", "correct_bias", "no_decay"}
        if not isinstance(state, dict) or set(state) != keys:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"{who}: argument 'state' expected a dict with keys {sorted(keys)}, got {got}")
        step_count = _integer(who, "state['step_count']", state["step_count"], 0)
        for which in ("m", "v"):
            d = state[which]
            arg = f"state['{which}']"
            if not isinstance(d, dict) or set(d) != set(self.params):
                got = (f"{len(set(self.params) - set(d))} missing {_names(set(self.params) - set(d))} and "
                       f"{len(set(d) - set(self.params))} unexpected {_names(set(d) - set(self.params))}"
                       if isinstance(d, dict) else type(d).__name__)
                raise ValueError(f"{who}: argument '{arg}' expected exactly the parameters' keys, got {got}")
            for name, p in self.params.items():
                a = d[name]
                if not (isinstance(a, np.ndarray) or _same_lib(a, p)) or a.shape != p.shape or a.dtype != p.dtype:
                    raise ValueError(f"{who}: argument '{arg}' key {name!r} expected an array of shape {p.shape} "
                                     f"and dtype {p.dtype} (the parameter's), got {_desc(a)}")
                if not np.isfinite(a).all() or (which == "v" and (a < 0).any()):
                    raise ValueError(f"{who}: argument '{arg}' key {name!r} expected finite values"
                                     f"{', all >= 0' if which == 'v' else ''}, got others")
        self._set_hyper(who, state["lr"], state["betas"], state["eps"], state["weight_decay"],   # all-or-nothing
                        state["correct_bias"], state["no_decay"])
        self.step_count = step_count
        self.m = {k: _copy_like(a, self.params[k]) for k, a in state["m"].items()}
        self.v = {k: _copy_like(a, self.params[k]) for k, a in state["v"].items()}


# ----------------------------------------------------------------------------------------------------------------
# learning-rate schedule

def linear_warmup_decay(step, warmup_steps, total_steps):
    """The original BERT's learning-rate multiplier (google-research/bert optimization.py create_optimizer):

        step / warmup_steps                       if step < warmup_steps     (linear warmup from 0)
        max(0, 1 - step / total_steps)            otherwise                  (linear decay to 0 at total_steps)

    Steps count from 0, and the update made at step s uses the multiplier of s, so the very first update has
    lr = 0 whenever warmup_steps > 0 (google increments global_step after the update; torch's LambdaLR with
    scheduler.step() after optimizer.step() does the same). warmup_steps = 0 means no warmup.

    The decay is google's, not HF's get_linear_schedule_with_warmup: it is 1 - step/total_steps measured from
    step 0, so at the end of warmup the multiplier drops from (w - 1)/w to 1 - w/total_steps (HF instead decays
    (total_steps - step)/(total_steps - warmup_steps), continuous at 1). Computed in float64 (google: float32).
    """
    who = "linear_warmup_decay"
    step = _integer(who, "step", step, 0)
    warmup_steps = _integer(who, "warmup_steps", warmup_steps, 0)
    total_steps = _integer(who, "total_steps", total_steps, 1)
    if warmup_steps > total_steps:
        raise ValueError(f"{who}: argument 'warmup_steps' expected at most total_steps = {total_steps}, "
                         f"got {warmup_steps}")
    if step < warmup_steps:
        return step / warmup_steps
    return max(0.0, 1.0 - step / total_steps)


class LinearWarmupDecay:
    """base_lr times linear_warmup_decay: `LinearWarmupDecay(1e-4, 10_000, 1_000_000).lr(step)`."""

    def __init__(self, base_lr, warmup_steps, total_steps):
        who = "LinearWarmupDecay"
        self.base_lr = _number(who, "base_lr", base_lr, 0.0)
        self.warmup_steps = _integer(who, "warmup_steps", warmup_steps, 0)
        self.total_steps = _integer(who, "total_steps", total_steps, 1)
        if self.warmup_steps > self.total_steps:
            raise ValueError(f"{who}: argument 'warmup_steps' expected at most total_steps = {self.total_steps}, "
                             f"got {self.warmup_steps}")

    def lr(self, step):
        """The learning rate of the update made at `step` (0, 1, ...)."""
        return self.base_lr * linear_warmup_decay(step, self.warmup_steps, self.total_steps)

    def __repr__(self):
        return f"LinearWarmupDecay(base_lr={self.base_lr}, warmup_steps={self.warmup_steps}, " \
               f"total_steps={self.total_steps})"


# ----------------------------------------------------------------------------------------------------------------
# gradient clipping

def clip_grad_norm(grads, max_norm=1.0):
    """Scale all gradients together so their global L2 norm is at most about max_norm; returns the norm before.

        norm = sqrt(sum over every gradient of sum(g²))          (accumulated in float64)
        c    = min(max_norm / (norm + 1e-6), 1)                   every g <- c·g, in place, in g's dtype

    This is torch.nn.utils.clip_grad_norm_ (norm_type 2): its clip_coef = max_norm / (total_norm + 1e-6),
    clamped to at most 1. Two consequences of the 1e-6: a norm in (max_norm - 1e-6, max_norm] is already scaled
    (by a factor within 1e-6 of 1), and a clipped set ends with norm max_norm·norm/(norm + 1e-6), a hair under
    max_norm. (google-research/bert used tf.clip_by_global_norm: c = max_norm / max(norm, max_norm), no 1e-6.)
    torch sums a float32 set in float32; here the norm is always summed in float64, then the factor applied in
    each gradient's own dtype.

    `grads` is a dict name -> float32/float64 array (model.backward(): NumPy's, or CuPy's on the "cuda" backend,
    scaled where they are); a non-finite value raises a ValueError naming the key, before anything is scaled.
    Returns the pre-clip norm as a Python float.
    """
    who = "clip_grad_norm"
    max_norm = _number(who, "max_norm", max_norm, 0.0, low_open=True)
    if not isinstance(grads, dict):
        raise ValueError(f"{who}: argument 'grads' expected a dict name -> gradient, got {type(grads).__name__}")
    for name, g in grads.items():
        _float_array(who, "grads", name, g)
    fused = _fused(who, list(grads.values()))
    if fused is not None:                               # the sums in one launch pair and one copy
        sums = fused.grad_stats(list(grads.values()))[:, 0].tolist()
    else:
        sums = _host_floats([np.sum(np.square(g, dtype=np.float64)) for g in grads.values()])
    total = 0.0
    for (name, g), s in zip(grads.items(), sums):
        if not math.isfinite(s):                        # a NaN or inf in g (or float64 squares that overflow)
            bad = ~np.isfinite(g)
            if bad.any():
                i = tuple(int(j) for j in np.argwhere(bad)[0])
                raise ValueError(f"{who}: argument 'grads' key {name!r} expected finite values, got {g[i]} at "
                                 f"index {i}")
        total += s
    norm = math.sqrt(total)
    if not math.isfinite(norm):
        raise ValueError(f"{who}: argument 'grads' expected a global norm finite in float64, got one that overflows")
    coef = min(max_norm / (norm + 1e-6), 1.0)
    if coef < 1.0:
        for name, g in grads.items():                   # every one writeable before the first is scaled
            _float_array(who, "grads", name, g, writeable=True)
        if fused is not None:
            fused.scale_(list(grads.values()), coef)
        else:
            for g in grads.values():
                g *= coef
    return norm


# ----------------------------------------------------------------------------------------------------------------
# fp16 loss scaling

class GradScaler:
    """Dynamic loss scaling for fp16-mixed training, with torch.amp.GradScaler's state machine (PyTorch 2.13,
    torch/amp/grad_scaler.py and its _amp_update_scale_ kernel), on the gradient dicts of this module.

    float16's smallest subnormal is 2^-24 and its largest finite value 65504: gradients of activations that are
    smaller flush to 0. The loss is multiplied by a scale S before the backward (here: dloss = S, so every
    gradient is S times larger), and the float32 gradients of the masters are divided by S before clipping and the
    optimizer. A gradient that overflowed (inf, or NaN) skips the step and halves S; a run of growth_interval
    finite steps doubles it:

        grads = model.backward(scaler.get_scale())     # dloss = S
        found_inf = scaler.unscale_(grads)             # g *= float32(1 / S) in place; any inf/NaN?
        if not found_inf:
            clip_grad_norm(grads, 1.0)                 # on the unscaled gradients, as with torch
        scaler.step(opt, grads, lr=lr)                 # opt.step unless found_inf
        scaler.update()                                # found_inf: S *= backoff_factor, tracker = 0
                                                       # else tracker += 1; == growth_interval: S *= growth_factor
                                                       # (if that stays finite in float32), tracker = 0
    S is a float32 number (torch keeps it in a float32 tensor; each update rounds scale * factor to float32).
    enabled=False (bf16-mixed and fp32 runs: bfloat16 has float32's range) makes every call a pass-through:
    get_scale() is 1, unscale_ finds nothing (a NaN then reaches AdamW, which refuses it by name), step steps.
    state_dict() / load_state_dict(): torch's keys ("scale", "growth_factor", "backoff_factor",
    "growth_interval", "_growth_tracker"; {} when disabled), so --resume continues the same sequence of scales.
    """

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 enabled=True):
        who = "GradScaler"
        if not isinstance(enabled, (bool, np.bool_)):
            raise ValueError(f"{who}: argument 'enabled' expected True or False, got {enabled!r}")
        self.enabled = bool(enabled)
        with np.errstate(over="ignore"):                     # (an overflow is refused just below, by name)
            self._scale = float(np.float32(_number(who, "init_scale", init_scale, 0.0, low_open=True)))
        if not math.isfinite(self._scale):                   # (S is a float32 number)
            raise ValueError(f"{who}: argument 'init_scale' expected a scale finite in float32 (at most "
                             f"{float(np.finfo(np.float32).max):.4g}), got {init_scale}")
        self.growth_factor = _number(who, "growth_factor", growth_factor, 1.0, low_open=True)
        self.backoff_factor = _number(who, "backoff_factor", backoff_factor, 0.0, 1.0, low_open=True)
        self.growth_interval = _integer(who, "growth_interval", growth_interval, 1)
        self._growth_tracker = 0
        self._found_inf = None              # None: not unscaled since the last update

    def is_enabled(self):
        return self.enabled

    def get_scale(self):
        """The current scale S as a Python float (1.0 when disabled): pass it as the backward's dloss."""
        return self._scale if self.enabled else 1.0

    def unscale_(self, grads):
        """Divide every gradient by S in place (multiply by float32(1/S), as torch) and return whether any holds
        an inf or NaN. Call it once per step, before clipping; step() calls it when you did not."""
        who = "GradScaler.unscale_"
        if not isinstance(grads, dict):
            raise ValueError(f"{who}: argument 'grads' expected a dict name -> gradient (model.backward()), "
                             f"got {type(grads).__name__}")
        if not self.enabled:
            self._found_inf = False
            return False
        if self._found_inf is not None:
            raise ValueError(f"{who}: expected one call per step, got a second before update() (the gradients "
                             f"are already unscaled)")
        for name, g in grads.items():
            _float_array(who, "grads", name, g, writeable=True)
        inv = np.float32(1.0 / np.float64(np.float32(self._scale)))   # torch: scale.double().reciprocal().float()
        fused = _fused(who, list(grads.values()))
        if fused is not None:                           # inf / NaN found from the peaks; one scaling launch
            live = [g for g in grads.values() if g.size]
            bad = [not math.isfinite(x) for x in fused.grad_stats(live)[:, 1].tolist()] if live else []
            fused.scale_(list(grads.values()), inv)
            self._found_inf = any(bad)
            return self._found_inf
        bad = _host_floats([np.any(~np.isfinite(g)) for g in grads.values() if g.size])
        with np.errstate(invalid="ignore", over="ignore"):
            for g in grads.values():
                g *= g.dtype.type(inv)
        self._found_inf = any(bool(b) for b in bad)
        return self._found_inf

    def step(self, opt, grads, lr=None):
        """opt.step(grads, lr=lr) unless the unscaled gradients hold an inf or NaN. Returns True when it stepped."""
        if self._found_inf is None:
            self.unscale_(grads)
        if self.enabled and self._found_inf:
            return False
        opt.step(grads, lr=lr)
        return True

    def update(self):
        """The scale for the next step, from this step's found_inf (torch's _amp_update_scale_)."""
        if not self.enabled:
            self._found_inf = None
            return
        if self._found_inf is None:
            raise ValueError("GradScaler.update: expected unscale_() or step() first in this step, got neither")
        if self._found_inf:
            with np.errstate(under="ignore"):
                self._scale = float(np.float32(self._scale * self.backoff_factor))
            self._growth_tracker = 0
        else:
            successful = self._growth_tracker + 1
            if successful == self.growth_interval:
                with np.errstate(over="ignore"):
                    grown = float(np.float32(self._scale * self.growth_factor))   # float32, as torch's tensor
                if math.isfinite(grown):
                    self._scale = grown
                self._growth_tracker = 0
            else:
                self._growth_tracker = successful
        self._found_inf = None

    def state_dict(self):
        if not self.enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state):
        """Restore a state_dict() (all or nothing; {} for a disabled scaler)."""
        who = "GradScaler.load_state_dict"
        if not self.enabled:
            if state:
                raise ValueError(f"{who}: argument 'state' expected {{}} for a disabled scaler, got {sorted(state)}")
            return
        keys = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
        if not isinstance(state, dict) or set(state) != keys:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"{who}: argument 'state' expected a dict with keys {sorted(keys)}, got {got}")
        scale = _number(who, "state['scale']", state["scale"], 0.0, low_open=True)
        growth = _number(who, "state['growth_factor']", state["growth_factor"], 1.0, low_open=True)
        backoff = _number(who, "state['backoff_factor']", state["backoff_factor"], 0.0, 1.0, low_open=True)
        interval = _integer(who, "state['growth_interval']", state["growth_interval"], 1)
        tracker = _integer(who, "state['_growth_tracker']", state["_growth_tracker"], 0)
        self._scale, self.growth_factor, self.backoff_factor = float(np.float32(scale)), growth, backoff
        self.growth_interval, self._growth_tracker, self._found_inf = interval, tracker, None
