"""Finite-difference checks for any forward/backward pair — refbert's own or yours.

Take a pair `forward(**inputs) -> (out, cache)` and `backward(dout, cache) -> grads`. Draw a random upstream
gradient `dout` and look at the scalar L(x) = sum(forward(x) * dout): its gradient with respect to each input is
exactly what backward(dout) must return. Centred differences measure it in float64,

    dL/dx_i ~ (L(x + h e_i) - L(x - h e_i)) / ((x_i + h) - (x_i - h))     (error O(h^2) + O(eps |L| / h))

either one element at a time ("full") or, for big inputs, along a few random directions d ("directional",
comparing L(x + h d) - L(x - h d) with <grad, (x + h d) - (x - h d)>, relative to |<grad, d>| + |numeric| or
|grad|, whichever is larger — the typical size of a directional derivative along a standard normal d). The denominators are the steps that were
actually taken, so inputs of magnitude 1e4 lose nothing to rounding of x + h.

    from refbert.gradcheck import check_pair
    errs = check_pair(my_forward, my_backward, {"x": x, "w": w}, wrt=("x", "w"))   # {"x": 3e-11, "w": 8e-12}

A correct op in float64 gives ~1e-9 or less; refbert's bar is 1e-7 (TOLERANCE).
"""
import numpy as np

from .philox import DropoutRNG

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
            # <g, d> ~ normal(0, |g|^2): scale by |g| too, so a direction nearly orthogonal to g by chance does
            # not turn rounding noise into a large relative error
            err = max(err, rel_error(analytic, numeric, max(floor, float(np.linalg.norm(g)))))
        errors[name] = err
    return errors


def check_model(model, inputs, seed=0, n_dirs=2, h=STEP, dropout_seed=1234):
    """Whole-model check: for each parameter tensor, directional derivatives of the loss along n_dirs random
    directions against model.backward(). Returns {parameter name: rel_error}.

    The model should be float64. Heads are differentiated through their loss (inputs must carry labels); a
    BertModel through L = sum(last_hidden_state * D1) + sum(pooler_output * D2) with random D1, D2. The dropout
    generator is re-seeded before every forward, so training-mode runs see the same masks at every step. The
    padding row of the word embeddings is held fixed, as torch's padding_idx treats it.
    """
    rng = np.random.default_rng(seed)
    is_encoder = not hasattr(model, "_finish")
    upstream = {}

    def loss():
        model.dropout_rng = DropoutRNG(dropout_seed)
        out = model.forward(**inputs)
        if not is_encoder:
            return float(out.loss)
        if not upstream:
            upstream["dlast_hidden_state"] = rng.standard_normal(out.last_hidden_state.shape)
            if out.pooler_output is not None:
                upstream["dpooler_output"] = rng.standard_normal(out.pooler_output.shape)
        return float(sum(np.sum(out[k[1:]] * d) for k, d in upstream.items()))

    L0 = loss()
    grads = model.backward(**upstream) if is_encoder else model.backward()
    floor = max(1e-8, 4 * np.finfo(np.float64).eps * max(abs(L0), 1.0) / h / TOLERANCE)
    errors = {}
    for name, p in model.parameters().items():
        err, old = 0.0, p.copy()
        for _ in range(n_dirs):
            d = rng.standard_normal(p.shape)
            if name.endswith("word_embeddings.weight") and model.config.pad_token_id is not None:
                d[model.config.pad_token_id] = 0  # torch's padding_idx: that row is a constant, its gradient 0
            p[...] = old + h * d
            step, lp = p.copy(), loss()
            p[...] = old - h * d
            step -= p
            lm = loss()
            p[...] = old
            numeric, analytic = (lp - lm) / (2 * h), float(np.sum(grads[name] * step)) / (2 * h)
            err = max(err, rel_error(analytic, numeric, max(floor, float(np.linalg.norm(grads[name])))))  # see check_pair
        errors[name] = err
    return errors
