"""The optimizer's multi-tensor kernels (csrc/optim.cu through refbert_kernels.cuda.optim) against the spec, the
per-array NumPy code of refbert.optim run on host copies: on the emulator (CI: CuPy and the GPU emulated on CPU
threads, optim.cu compiled by g++) and on a real GPU when one is present.

What must hold, and why these bounds:
  * AdamW.step (both forms, float32, float64 and both in one dict, decayed and exempt tensors, λ = 0, a learning
    rate that changes every step, tensors of 0, 1 and several chunks of elements): p, m and v equal the spec's bit
    for bit. The
    kernel does NumPy's operations in NumPy's order with NumPy's casts of the Python scalars, each rounded once
    (no FMA): there is no rounding freedom, so any difference is a bug.
  * GradScaler.unscale_: the same bits (g times float32(1 / S), S = 1000 so that this differs from g / S) and the
    same found_inf, an inf among them.
  * clip_grad_norm: the norm is a float64 sum of squares (exact squares for float32) in another order than NumPy's
    pairwise sum; both sums are of positive terms, each with fewer than 64 additions on its longest chain, so each
    lies within 64 * 2^-53 (< 1e-14) of the exact sum relative: 1e-13 apart at most. The clipped gradients are
    then g times the dtype's cast of max_norm / (norm + 1e-6) from the kernels' own norm, bit for bit.
  * Bad gradients (NaN, inf, a square that overflows) are refused with the spec's error, naming the key, before
    anything is written; what ran is what was meant (refbert.optim.LAST_PATH names the kernels), and device arrays
    the kernels do not take (a non-contiguous one) warn and take the per-array code, with the spec's bits.
"""
import importlib.util
import textwrap

import pytest

import cudachild

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None, reason="needs numba-cuda")]


def _child(code, mode):
    return cudachild.on(mode, _PRELUDE + textwrap.dedent(code))


_PRELUDE = """
import os, warnings
import numpy as np
from refbert import optim
if os.environ.get("REFBERT_CUDA_EMULATE") == "1":
    from refbert_kernels.cuda.emulate import cupy as xp
else:
    import cupy as xp
FUSED = optim.FUSED
CHUNK = 4096
SHAPES = {"l.weight": (5, 7), "l.bias": (7,), "LayerNorm.weight": (CHUNK + 3,), "w2.weight": (3, CHUNK - 1),
          "empty.weight": (0,), "one.bias": (1,)}

def host(a):
    return np.asarray(a.get())

def same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))

def dtypes(dt):          # each tensor's dtype: dt, or for "mixed" float32 and float64 in turn (two launches)
    return {k: (dt if dt != "mixed" else (np.float32, np.float64)[i % 2]) for i, k in enumerate(SHAPES)}

def grads_at(step, dt, scale=1.0):
    r = np.random.default_rng(100 + step)
    return {k: (r.standard_normal(s) * r.choice([1e-3, 1.0, 30.0], s) * scale).astype(dtypes(dt)[k])
            for k, s in SHAPES.items()}
"""


@pytest.mark.parametrize("mode", ["emu", "gpu"])
def test_adamw_and_unscale_are_the_spec_bit_for_bit(mode):
    out = _child("""
        n = 0
        for dt in (np.float32, np.float64, "mixed"):
            for correct in (True, False):
                for wd in (0.01, 0.0):
                    p0 = {k: np.random.default_rng(1).standard_normal(s).astype(dtypes(dt)[k])
                          for k, s in SHAPES.items()}
                    spec = {k: v.copy() for k, v in p0.items()}
                    dev = {k: xp.asarray(v) for k, v in p0.items()}
                    o_spec = optim.AdamW(spec, lr=1e-3, weight_decay=wd, correct_bias=correct)
                    o_dev = optim.AdamW(dev, lr=1e-3, weight_decay=wd, correct_bias=correct)
                    # (a scale whose inverse is inexact: g * float32(1 / S) is not g / S, so the unscaling bites)
                    s_spec, s_dev = optim.GradScaler(init_scale=1000.0), optim.GradScaler(init_scale=1000.0)
                    for step in range(4):
                        g = grads_at(step, dt, scale=1000.0)
                        if step == 2:
                            g["l.weight"][1, 2] = np.inf            # the scaler must skip this step on both
                        gd = {k: xp.asarray(v) for k, v in g.items()}
                        lr = 1e-3 * (step + 1)
                        f_spec, f_dev = s_spec.unscale_(g), s_dev.unscale_(gd)
                        assert optim.LAST_PATH["GradScaler.unscale_"] == FUSED, optim.LAST_PATH
                        assert f_spec == f_dev == (step == 2), (f_spec, f_dev, step)
                        assert all(same(host(gd[k]), g[k]) for k in g), "unscaled gradients differ"
                        assert s_spec.step(o_spec, g, lr=lr) == s_dev.step(o_dev, gd, lr=lr)
                        s_spec.update(); s_dev.update()
                        if step != 2:
                            assert optim.LAST_PATH["AdamW.step"] == FUSED, optim.LAST_PATH
                    for k in SHAPES:
                        assert same(host(dev[k]), spec[k]), (dt, correct, wd, k, "p")
                        assert same(host(o_dev.m[k]), o_spec.m[k]), (dt, correct, wd, k, "m")
                        assert same(host(o_dev.v[k]), o_spec.v[k]), (dt, correct, wd, k, "v")
                    assert not same(spec["l.weight"], p0["l.weight"])      # (it moved)
                    n += 1
        print("SAME", n)
    """, mode)
    assert "SAME 12" in out, out


@pytest.mark.parametrize("mode", ["emu", "gpu"])
def test_clip_grad_norm_norm_and_scaling(mode):
    out = _child("""
        import math
        for dt in (np.float32, np.float64):
            for max_norm in (1.0, 1e9):                           # clipped, and left alone (factor 1)
                g = grads_at(0, dt)
                gd = {k: xp.asarray(v) for k, v in g.items()}
                n_spec = optim.clip_grad_norm({k: v.copy() for k, v in g.items()}, max_norm)
                n_dev = optim.clip_grad_norm(gd, max_norm)
                assert optim.LAST_PATH["clip_grad_norm"] == FUSED, optim.LAST_PATH
                assert abs(n_dev - n_spec) <= 1e-13 * n_spec, (n_dev, n_spec)   # two float64 orders (docstring)
                coef = min(max_norm / (n_dev + 1e-6), 1.0)
                for k in g:
                    want = g[k] * dt(coef) if coef < 1.0 else g[k]
                    assert same(host(gd[k]), want), (dt, max_norm, k)
                print("CLIP", dt.__name__, max_norm, coef < 1.0, abs(n_dev - n_spec) / n_spec)
    """, mode)
    assert out.count("CLIP") == 4 and "float32 1.0 True" in out and "1000000000.0 False" in out, out


@pytest.mark.parametrize("mode", ["emu", "gpu"])
def test_bad_gradients_refused_by_name_before_anything_is_written(mode):
    out = _child("""
        for what, value in (("nan", np.nan), ("inf", -np.inf), ("square", 1e20)):
            p0 = {k: np.ones(s, np.float32) for k, s in SHAPES.items()}
            dev = {k: xp.asarray(v) for k, v in p0.items()}
            opt = optim.AdamW(dev, lr=1e-3)
            g = grads_at(0, np.float32)
            g["w2.weight"][2, CHUNK - 2] = value                  # the last chunk of a tensor of two
            try:
                opt.step({k: xp.asarray(v) for k, v in g.items()})
            except ValueError as e:
                msg = str(e)
            else:
                raise AssertionError("not refused: " + what)
            assert "'w2.weight'" in msg and ("square is finite" in msg) == (what == "square"), msg
            assert optim.LAST_PATH["AdamW.step"] == FUSED
            assert all(same(host(dev[k]), p0[k]) for k in SHAPES) and opt.step_count == 0
            assert all(not host(m).any() for m in opt.m.values())
            if what != "square":
                try:
                    optim.clip_grad_norm({k: xp.asarray(v) for k, v in g.items()})
                except ValueError as e:
                    assert "'w2.weight'" in str(e) and "finite" in str(e), str(e)
                else:
                    raise AssertionError("clip_grad_norm took " + what)
            print("REFUSED", what)
    """, mode)
    assert out.count("REFUSED") == 3, out


def test_arrays_the_kernels_do_not_take_warn_and_keep_the_spec():
    out = _child("""
        base = np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32)
        spec = {"w": base[:, ::2].copy()}
        dev = {"w": xp.asarray(base)[:, ::2]}                   # a strided view: not the kernels' layout
        assert not dev["w"].flags.c_contiguous
        o_spec, o_dev = optim.AdamW(spec, lr=1e-2), optim.AdamW(dev, lr=1e-2)
        g = np.random.default_rng(1).standard_normal((6, 4)).astype(np.float32)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            o_spec.step({"w": g.copy()})
            o_dev.step({"w": xp.asarray(g)})
        assert any("non-contiguous" in str(x.message) for x in w), [str(x.message) for x in w]
        assert optim.LAST_PATH["AdamW.step"].startswith(optim.PER_ARRAY), optim.LAST_PATH
        assert same(host(xp.ascontiguousarray(dev["w"])), spec["w"])
        os.environ["REFBERT_FUSED_OPTIM"] = "0"
        d2 = {k: xp.asarray(v) for k, v in {"a": base}.items()}
        optim.AdamW(d2, lr=1e-2).step({"a": xp.asarray(base)})
        assert optim.LAST_PATH["AdamW.step"] == optim.PER_ARRAY + " (REFBERT_FUSED_OPTIM=0)", optim.LAST_PATH
        print("PATHS OK")
    """, "emu")
    assert "PATHS OK" in out, out
