"""Finite-difference checks for any forward/backward pair — refbert's own or yours.

Take a pair `forward(**inputs) -> (out, cache)` and `backward(dout, cache) -> grads`. Draw a random upstream
gradient `dout` and look at the scalar L(x) = sum(forward(x) * dout): its gradient with respect to each input is
exactly what backward(dout) must return. Centred differences measure it in float64,

    dL/dx_i ~ (L(x + h e_i) - L(x - h e_i)) / ((x_i + h) - (x_i - h))     (error O(h^2) + O(eps |L| / h))

either one element at a time ("full") or, for big inputs, along a few random directions d ("directional",
comparing L(x + h d) - L(x - h d) with <grad, (x + h d) - (x - h d)>). The denominators are the steps that were
actually taken, so inputs of magnitude 1e4 lose nothing to rounding of x + h.

    from refbert.gradcheck import check_pair
    errs = check_pair(my_forward, my_backward, {"x": x, "w": w}, wrt=("x", "w"))   # {"x": 3e-11, "w": 8e-12}

A correct op in float64 gives ~1e-9 or less; refbert's bar is 1e-7 (TOLERANCE).
"""
import numpy as np

TOLERANCE = 1e-7    # max relative error a float64 backward may show against centred differences
STEP = 1e-5         # h: balances truncation error h^2 (~1e-10) against rounding eps/h (~1e-11)


def rel_error(a, b, floor=1e-8):
    """Normwise relative error max|a - b| / max(max|a| + max|b|, floor).

    Scaled by the largest magnitude rather than per element, so a gradient entry that is truly ~0 does not turn
    finite-difference noise into a 100% error; the floor makes two all-zero gradients agree.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"rel_error: arguments 'a' and 'b' expected equal shapes, got {a.shape} and {b.shape}")
    if a.size == 0:
        return 0.0
    return float(np.abs(a - b).max() / max(np.abs(a).max() + np.abs(b).max(), floor))


def numerical_gradient(f, x, h=STEP):
    """Centred differences of the scalar function f at x (float64), one element at a time. Returns an array like x.

    x is perturbed in place and restored, so f must read x afresh on each call.
    """
    x = np.array(x, dtype=np.float64)
    grad = np.zeros_like(x)
    flat, gflat = x.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        xp, xm = old + h, old - h
        flat[i] = xp
        fp = f(x)
        flat[i] = xm
        fm = f(x)
        flat[i] = old
        gflat[i] = (fp - fm) / (xp - xm)
    return grad


def check_pair(forward, backward, inputs, wrt, seed=0, h=STEP, mode="auto", max_full=600, n_dirs=4, only=None):
    """Compare backward() with centred finite differences for each input named in `wrt`.

    forward(**inputs) -> (out, cache); backward(dout, cache) -> one gradient per name in `wrt`, in that order
    (a single array when `wrt` has one name). Float inputs are cast to float64. mode: "full" (every element),
    "directional" (n_dirs random directions) or "auto" (full up to max_full elements). `only` restricts the check to
    some of the names in `wrt`. Returns {name: rel_error}.
    """
    rng = np.random.default_rng(seed)
    inputs = {k: (v.astype(np.float64) if isinstance(v, np.ndarray) and v.dtype.kind == "f" else v)
              for k, v in inputs.items()}
    out, cache = forward(**inputs)
    dout = rng.standard_normal(np.shape(out))
    grads = backward(dout if np.ndim(out) else float(dout), cache)
    grads = grads if isinstance(grads, tuple) else (grads,)
    if len(grads) != len(wrt):
        raise ValueError(f"check_pair: backward returned {len(grads)} gradient(s) but 'wrt' names {len(wrt)}: {wrt}")

    # What finite differences cannot resolve is not an error: each L evaluation rounds by ~eps * sum|out * dout|,
    # so the numerical gradient carries ~eps * S / h of noise. A gradient smaller than that (a saturated tanh, a
    # masked position) is compared against this floor, scaled so that noise alone scores TOLERANCE / 4.
    S = float(np.sum(np.abs(np.asarray(out, np.float64) * dout)))
    floor = max(1e-8, 4 * np.finfo(np.float64).eps * S / h / TOLERANCE)
    errors = {}
    for name, g in zip(wrt, grads):
        if only is not None and name not in only:
            continue

        def loss(x, name=name):
            out_x, _ = forward(**{**inputs, name: x})
            return float(np.sum(out_x * dout))

        x = inputs[name]
        if g is None or np.shape(g) != x.shape:
            raise ValueError(f"check_pair: gradient for '{name}' expected shape {x.shape}, got {np.shape(g)}")
        if mode == "full" or (mode == "auto" and x.size <= max_full):
            errors[name] = rel_error(g, numerical_gradient(loss, x, h), floor)
            continue
        err = 0.0
        for _ in range(n_dirs):
            d = rng.standard_normal(x.shape)
            xp, xm = x + h * d, x - h * d
            numeric = (loss(xp) - loss(xm)) / (2 * h)
            analytic = float(np.sum(g * (xp - xm))) / (2 * h)
            err = max(err, rel_error(analytic, numeric, floor))
        errors[name] = err
    return errors
