"""Mixed precision around any backend: the spec of refbert.ops (the section "mixed precision: the spec") applied to
a backend's float32 ops, so that the model runs bf16-mixed or fp16-mixed on the numpy backend (the spec itself),
the numba backend, or a module of yours, unchanged.

    precision   compute dtype   what it is
    "fp32"      —               the backend as it is (the default)
    "bf16-mixed" bfloat16       float32 masters, bfloat16 activations and activation gradients, float32 inside ops
    "fp16-mixed" float16        the same in IEEE half; train it with loss scaling (refbert.optim.GradScaler)

`mixed_ops(backend, compute)` is the namespace the model calls: every function of the backend (refbert.backends
NAMES) wrapped by one rule, refbert.ops' generic one:
    forward:  every floating array argument rounded to the compute dtype (R) on entry, but the constants of
              ops.MIXED_CONSTANTS (the attention mask, regression targets); the output rounded on exit, but a loss
    backward: dout rounded on entry (a loss's dloss stays float32); each returned gradient rounded when it is an
              activation's, left float32 when it is a parameter's (ops.MIXED_PARAMS)
What the backend's function computes in between is its float32 arithmetic: the numba kernels' fused ops run as
they are, in float32 on rounded inputs. The attention core is the exception: the spec rounds inside it
(FlashAttention-2's P and dS, ops.attention_forward_mixed), which no float32 kernel can do from outside, so it is
the spec's own NumPy code unless the backend brings a 16-bit attention of its own.

Backends with 16-bit kernels (the cuda backend: refbert_kernels.cuda.mixed) plug in per op: a module that defines
`<name>_mixed` (for instance `attention_forward_mixed(q, k, v, n_heads, mask, dropout_p, rng, train, compute=...)`,
`attention_backward_mixed`, `linear_forward_mixed`, ...) gets that function called instead of the rounding around
its float32 op; it receives the model's arguments as they are (activations already in the compute dtype,
parameters as the float32 masters) and must itself compute what the spec says. A module whose arrays live on a
device brings `round_compute(x, compute)` too (refbert.ops.round_compute's bits on its arrays): the rule above
rounds with it. `describe()` says which op runs how.

Compute-dtype tensors are float32 arrays whose values lie on the compute grid (refbert.ops.round_bfloat16 /
round_float16): NumPy has no bfloat16, the float32 kernels run them as they are, and R is idempotent, so rounding an
input that is already a compute-dtype tensor changes nothing.
"""
import functools
import inspect
import weakref

import numpy as np

from . import ops as oracle
from .backends import NAMES, _op

PRECISIONS = {"fp32": None, "bf16-mixed": "bfloat16", "fp16-mixed": "float16"}   # precision -> compute dtype
# the command line's --mixed-precision (accelerate's names) -> precision
FLAGS = {"no": "fp32", "bf16": "bf16-mixed", "fp16": "fp16-mixed"}


def compute_dtype(precision, who="precision"):
    """The compute dtype of a precision ("bfloat16", "float16"; None for "fp32"), or a ValueError naming `who`."""
    if precision not in PRECISIONS:
        raise ValueError(f"{who}: argument 'precision' expected one of {', '.join(map(repr, PRECISIONS))}, "
                         f"got {precision!r}")
    return PRECISIONS[precision]


def _is_f32(v):
    """A float32 array of any array module: NumPy's, or a device array (CuPy's and torch's CUDA tensors export
    __cuda_array_interface__; torch spells its dtype torch.float32)."""
    if not (isinstance(v, np.ndarray) or hasattr(v, "__cuda_array_interface__")):
        return False
    return str(v.dtype).rsplit(".", 1)[-1] == "float32"


def _round_tree(obj, R):
    """R on every float32 array of obj (through tuples and lists); anything else as it is."""
    if _is_f32(obj):
        return R(obj)
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_round_tree(v, R) for v in obj)
    return obj


# Arrays a device backend's mixed op has just written, hence on the compute grid (R(x) == x): the rule skips R on
# them when they come back as inputs (a pass over memory saved; R is idempotent, so nothing changes). Keyed by id,
# holding weak references: an entry lives exactly as long as its array, so an id reused by a new array is never
# mistaken for it. Ops write fresh arrays and never change an input in place, so a marked array stays on the grid.
# The numpy backend (the spec itself) never skips: it rounds every input, as the spec reads.
_ON_GRID = {c: weakref.WeakValueDictionary() for c in oracle.ROUND}


def mark(x, compute):
    """Remember that x (an array a mixed op just wrote, rounded to `compute`) lies on the compute grid; x returned.
    An array type without weak references is not remembered (and simply rounded again)."""
    try:
        _ON_GRID[compute][id(x)] = x
    except TypeError:
        pass
    return x


def on_grid(x, compute):
    """True when x was marked by mark(x, compute) (and is alive: the very object)."""
    return _ON_GRID[compute].get(id(x)) is x


def rounder(base, compute):
    """R for the arrays a backend's ops see: the backend module's own `round_compute(x, compute)` where it has one
    (a device backend rounds its arrays where they are; it must give refbert.ops.round_compute's bits), else
    refbert.ops' (NumPy arrays)."""
    module = getattr(base, "module", base)
    own = getattr(module, "round_compute", None)
    if callable(own) and own is not oracle.round_compute:
        def R(x):                                         # marked arrays are on the grid already (see mark)
            return x if on_grid(x, compute) else mark(own(x, compute), compute)
        return R
    return oracle.ROUND[compute]


def _signature(name):
    return inspect.signature(getattr(oracle, name))


def wrap_forward(fn, name, compute, R=None):
    """The forward `fn` (the oracle's signature) under the spec's rule: inputs rounded on entry (but constants),
    the output rounded on exit (but a loss). R: the rounding (default refbert.ops')."""
    R, op, sig = R or oracle.ROUND[compute], _op(name), _signature(name)
    loss = op in oracle.MIXED_LOSSES

    @functools.wraps(fn)
    def forward(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        for k, v in bound.arguments.items():
            if k not in oracle.MIXED_CONSTANTS and _is_f32(v):
                bound.arguments[k] = R(v)
        with np.errstate(over="ignore", invalid="ignore"):   # fp16 overflow: inf, for the loss scaler to see
            out, cache = fn(*bound.args, **bound.kwargs)
        return (out if loss else _round_tree(out, R)), cache
    return forward


def wrap_backward(fn, name, compute, R=None):
    """The backward `fn` under the spec's rule: dout rounded on entry (a loss's dloss kept), each activation's
    gradient rounded on exit, each parameter's left float32. R: the rounding (default refbert.ops')."""
    R, op = R or oracle.ROUND[compute], _op(name)
    loss = op in oracle.MIXED_LOSSES
    params, wrt = oracle.MIXED_PARAMS.get(op, ()), oracle.GRADS_OF[op]

    @functools.wraps(fn)
    def backward(dout, cache):
        if not loss and _is_f32(dout):
            dout = R(dout)
        with np.errstate(over="ignore", invalid="ignore"):
            g = fn(dout, cache)
        one = not isinstance(g, tuple)
        gs = (g,) if one else g
        gs = tuple(gi if n in params else R(gi) for n, gi in zip(wrt, gs))
        return gs[0] if one else gs
    backward.dx_into = False                              # (not fn's: this wrapper takes (dout, cache) only)
    return backward


class MixedOps:
    """The namespace a mixed-precision model calls: every name of refbert.backends.NAMES, wrapped (see the module
    docstring). Attributes: `compute` ("bfloat16" / "float16"), `base` (the backend's own namespace), `how`
    {function name: "rounded" (the backend's float32 op between roundings) | "spec" (refbert.ops' mixed code) |
    "own" (the backend's <name>_mixed)}. Anything else is the base backend's (to_device, describe, ...)."""

    def __init__(self, base, compute):
        if compute not in oracle.ROUND:
            raise ValueError(f"mixed: argument 'compute' expected one of {', '.join(oracle.ROUND)}, got {compute!r}")
        self.base, self.compute, self.how = base, compute, {}
        module = getattr(base, "module", base)
        R = rounder(base, compute)
        spec = {"attention_forward": functools.partial(oracle.attention_forward_mixed, compute=compute),
                "attention_backward": oracle.attention_backward_mixed,
                "attention_probs": oracle.attention_probs_mixed}
        for name in NAMES:
            own = getattr(module, f"{name}_mixed", None)
            if own is not None and own is getattr(oracle, f"{name}_mixed", None):
                own = None                                # the numpy backend's module is the oracle: the spec
            if callable(own):
                fn = functools.partial(own, compute=compute) if name.endswith("_forward") else own
                self.how[name] = "own"
            elif name in spec:
                fn, self.how[name] = spec[name], "spec"
            elif name.endswith("_forward"):
                fn, self.how[name] = wrap_forward(getattr(base, name), name, compute, R), "rounded"
            else:
                fn, self.how[name] = wrap_backward(getattr(base, name), name, compute, R), "rounded"
            setattr(self, name, fn)
        rounded = [n for n, how in self.how.items() if how != "own"]
        if getattr(base, "home", "numpy") != "numpy" and rounded and R is oracle.ROUND[compute]:
            # refbert.ops' R works on NumPy arrays: a device backend (its arrays CuPy's) must round its own
            raise ValueError(f"mixed precision: backend {getattr(base, 'name', base)!r} keeps its arrays on a device "
                             f"({base.home}); expected its own rounding (round_compute(x, compute)) or its own 16-bit "
                             f"ops (<name>_mixed) for every op, got neither for "
                             f"{', '.join(dict.fromkeys(_op(n) for n in rounded))}")

    def __getattr__(self, attr):                          # only called for what __init__ did not set
        if attr.startswith("__") or attr == "base":
            raise AttributeError(attr)
        return getattr(self.base, attr)

    def describe(self):
        """The base backend's description, then one line: which ops run as the spec's code, which as the backend's
        own 16-bit functions, the rest the backend's float32 ops between roundings."""
        base = self.base.describe() if callable(getattr(self.base, "describe", None)) else str(self.base)
        by = {}
        for name, how in self.how.items():
            by.setdefault(how, []).append(_op(name))
        spell = lambda how: ", ".join(dict.fromkeys(by.get(how, []))) or "none"  # noqa: E731
        return (f"{base}\nmixed precision ({self.compute} compute, float32 masters): the spec's own code: "
                f"{spell('spec')}; the backend's 16-bit ops: {spell('own')}; every other op the backend's float32 "
                f"op on inputs rounded to {self.compute}, its output rounded (refbert.mixed)")


def mixed_ops(base, precision):
    """The namespace a model with `precision` calls over the backend `base`: base itself for "fp32"."""
    compute = compute_dtype(precision)
    return base if compute is None else MixedOps(base, compute)
