"""Input checks shared by every op and model: each failure is a ValueError that names the op, the argument,
what was expected and what came, so bad input never reaches NumPy as a silent broadcast or a NaN."""
import math

import numpy as np

FLOATS = (np.float32, np.float64)


def _desc(x):
    if isinstance(x, np.ndarray):
        return f"array of shape {x.shape} and dtype {x.dtype}"
    return f"{type(x).__name__}"


def floats(op, **arrays):
    """Each array must be a float32/float64 ndarray, and all must share one dtype. Returns that dtype."""
    dtype = None
    for name, x in arrays.items():
        if x is None:
            continue
        if not isinstance(x, np.ndarray) or x.dtype.type not in FLOATS:
            raise ValueError(f"{op}: argument '{name}' expected a float32 or float64 numpy array, got {_desc(x)}")
        if dtype is None:
            dtype, first = x.dtype, name
        elif x.dtype != dtype:
            raise ValueError(f"{op}: argument '{name}' expected dtype {dtype} (the dtype of '{first}'), got {x.dtype}")
    return dtype


def shape(op, name, x, expected, letters=None):
    """x.shape must equal `expected` (None entries match anything). `letters` spells the expected shape
    symbolically for the message, e.g. "(C_out, C_in)"."""
    ok = x.ndim == len(expected) and all(e is None or e == s for e, s in zip(expected, x.shape))
    if not ok:
        parts = ["*" if e is None else str(e) for e in expected]
        want = "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"
        sym = f" {letters}" if letters else ""
        raise ValueError(f"{op}: argument '{name}' expected shape{sym} = {want}, got {x.shape}")


def min_ndim(op, name, x, n, letters):
    if x.ndim < n:
        raise ValueError(f"{op}: argument '{name}' expected at least {n} dimension(s) {letters}, got shape {x.shape}")


def ids(op, name, x, upper, allow=None):
    """Integer array with 0 <= x < upper (and, optionally, the extra value `allow`, e.g. ignore_index)."""
    if not isinstance(x, np.ndarray) or not np.issubdtype(x.dtype, np.integer):
        raise ValueError(f"{op}: argument '{name}' expected an integer numpy array, got {_desc(x)}")
    if x.size == 0:
        return
    bad = (x < 0) | (x >= upper)
    if allow is not None:
        bad &= x != allow
    if bad.any():
        i = tuple(int(j) for j in np.argwhere(bad)[0])
        extra = f" or {allow}" if allow is not None else ""
        raise ValueError(f"{op}: argument '{name}' expected values in [0, {upper}){extra}, got {int(x[i])} at index {i}")


def broadcasts_to(op, name, x, target):
    """x must broadcast to `target` without changing it (a mask may not enlarge the scores)."""
    try:
        ok = np.broadcast_shapes(x.shape, target) == tuple(target)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{op}: argument '{name}' expected a shape that broadcasts to {tuple(target)}, got {x.shape}")


def dout(op, d, out_shape, dtype, name="dout", what="the forward output"):
    """The upstream gradient must match the forward output in shape and dtype (or another array its own shape)."""
    if not isinstance(d, np.ndarray) or d.shape != tuple(out_shape) or d.dtype != dtype:
        raise ValueError(f"{op}: argument '{name}' expected an array of shape {tuple(out_shape)} and dtype {dtype} "
                         f"({what}), got {_desc(d)}")


def number(op, name, x, low=None, high=None, low_open=False, integer=False, what=None):
    """A real scalar argument (a Python or NumPy number, or a 0-d array; not a bool, a string, None or an array),
    finite, within [low, high] (low excluded when low_open), an integer when `integer`: returned as a Python float
    (or int). A Python float, unlike np.float64, keeps a float32 computation float32 (NumPy's promotion rules)."""
    kind = "an integer" if integer else "a finite real number"
    desc = what or kind
    v = x[()] if isinstance(x, np.ndarray) and x.ndim == 0 else x           # a 0-d array: its scalar
    ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
    if not ok and isinstance(v, np.generic) and v.dtype.kind == "V" and v.dtype.names is None:
        try:                                            # ml_dtypes' scalars (bfloat16, ...): real, not np.floating
            v, ok = float(v), True
        except (TypeError, ValueError):
            pass
    if ok and integer:
        ok = isinstance(v, (int, np.integer)) or (isinstance(v, (float, np.floating)) and float(v).is_integer())
    if ok:
        try:
            v = int(v) if integer else float(v)
        except OverflowError:                           # (an int past float's range: not finite)
            v, ok = math.inf, False
        ok = ok and (integer or math.isfinite(v)) and (low is None or (v > low if low_open else v >= low)) and \
            (high is None or v <= high)
    if not ok:
        scalar = isinstance(x, (int, float, np.generic, type(None)))
        got = repr(x) if isinstance(x, (str, bytes)) else str(x) if scalar else _desc(x)
        if isinstance(x, np.ndarray) and x.ndim == 0 and x.dtype.kind in "biufcV":
            got = f"{x[()]} (a 0-d array)"
        raise ValueError(f"{op}: argument '{name}' expected {desc}, got {got}")
    return v


def probability(op, name, p):
    """A dropout probability: number() in [0, 1], the message every backend gives."""
    return number(op, name, p, low=0.0, high=1.0, what="a probability in [0, 1]")


def padding_row(op, padding_idx, rows):
    """An embedding's padding_idx: None, or an integer row of the table's `rows` (returned as an int)."""
    if padding_idx is None:
        return None
    return number(op, "padding_idx", padding_idx, low=0, high=rows - 1, integer=True, what=f"a row in [0, {rows})")


def required(op, **arrays):
    """Arguments that may not be None (floats() passes None by: optional arrays)."""
    for name, x in arrays.items():
        if x is None:
            raise ValueError(f"{op}: argument '{name}' expected a float32 or float64 array, got None")


def layernorm_eps(op, x, eps):
    """After a layernorm's array checks: a row to normalise (C >= 1), and eps a positive finite number (as a
    Python float: an np.float64 eps would turn a float32 layernorm into float64)."""
    if x.shape[-1] == 0:
        raise ValueError(f"{op}: argument 'x' expected at least one channel to normalise over (C >= 1), got shape "
                         f"{x.shape}")
    return number(op, "eps", eps, low=0, low_open=True, what="a positive finite number (added to the variance)")

