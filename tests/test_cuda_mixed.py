"""Mixed precision on the cuda backend (refbert_kernels.cuda.mixed) against the spec (refbert.ops, "mixed precision:
the spec", run by the numpy backend): on the emulator (CI: CuPy and the GPU emulated on CPU threads,
csrc/mixed.cu's kernels compiled by g++) and on a real GPU when one is present (there the GEMMs are cublasGemmEx
with 16-bit inputs on tensor cores).

What must hold, and why these bounds:
  * R on the device is refbert.ops.round_bfloat16 / round_float16 bit for bit (the same integer recipe), on every
    class of float32 pattern: ties both ways, carries into the exponent, overflow to inf, subnormal halves, NaN,
    +-0; and the 16-bit patterns the GEMM reads are ml_dtypes' bfloat16 / NumPy's float16 of those values.
  * An op (linear, attention, forward and backward) equals the spec up to float32 summation order: a value in the
    compute dtype may then differ by one ulp of the compute dtype, where its float32 value lies within float32
    noise of a rounding boundary, and only there: so every element within 1 ulp (of the compute dtype, at the
    spec's value) and at most 2% of the elements differing at all (a rounding or a term wrong anywhere moves far
    more: a missing R leaves values off the grid, checked too). A float32 gradient of a parameter (dw, db) is a
    float32 sum of the same exact products in another order: rtol 1e-5 of the tensor's scale (K <= 64 terms,
    float32's 2^-24 each, with margin).
  * The whole model (BertForPreTraining, train mode, dropout 0.1 on hidden states and attention, padding, ignored
    labels): the loss within 1e-3 relative and every gradient within 2 ulp of the compute dtype at the tensor's
    scale (ulp(1) = 2^-7 in bfloat16, 2^-10 in float16), against the numpy backend running the spec: the
    one-ulp flips of single activations propagate through two layers and a loss, each moving a gradient by about
    one compute-dtype ulp of its own size; an error in the recipe (a rounding left out or added) moves the loss
    and gradients by many ulps (tests/test_mixed.py shows fp32 against the spec differing by far more). Plus: every
    activation the model returns lies on the compute grid, what ran was the 16-bit ops (versions.RAN), and both
    models drew the same number of dropout streams.

Units (ulp(1) = 2^-7 in bfloat16, 2^-10 in float16). Three measures, each named where it is used:
  * an element's own ulp (close_ulp): the compute grid's spacing at that element, 2^floor(log2 |ref|) ulp(1);
  * the ulp at a tensor's scale (close_scale): the grid's spacing at its largest element, 2^floor(log2 max|ref|)
    ulp(1), the largest spacing any element of the tensor can have;
  * ulps of scale (the model's and S3's bounds, the precision study's u = ulp(1) / 2 of scale): |got - ref| in
    units of ulp(1) max|ref|, a relative error; 1 to 2 times the previous measure's unit (equal when max|ref| is a
    power of two), so a bound in these units is the looser by at most 2x.
"""
import functools
import importlib.util
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

import cudachild
from test_cuda_emu import _env
from test_cuda_train_sim import tiny  # noqa: F401  (the fixture: a corpus, its vocabulary, a one-layer config)

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None, reason="needs numba-cuda")]
_run = functools.partial(cudachild.run, timeout=900)


def _gpu_present():
    r = _run("import cupy; assert cupy.cuda.runtime.getDeviceCount() > 0", sim=False, timeout=120)
    return r.returncode == 0


def _child(code, mode):
    """Run `code` in the emulator ("emu": needs g++), in Numba's simulator ("sim": NumPy arrays) or on a GPU ("gpu":
    skipped without one)."""
    if mode == "sim":
        return cudachild.check(_run(code))
    if mode == "emu":
        if shutil.which("g++") is None:
            pytest.skip("needs g++ (the CUDA C kernels on CPU threads)")
        return cudachild.check(_run(_env(code)))
    if not _gpu_present():
        pytest.skip("needs a CUDA GPU with CuPy")
    return cudachild.check(_run(code, sim=False))


_ROUND = """
    import numpy as np
    from ml_dtypes import bfloat16
    from refbert import ops
    from refbert_kernels.cuda import backend as B, mixed as M
    xp = B.xp
    H = lambda a: a.get() if hasattr(a, "get") else a            # noqa: E731  (a device array's host copy)
    specials = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001,
                         0x3F808000, 0x3F818000, 0x3F80C000, 0x3F807FFF, 0x7F7FFFFF, 0x7F7F8000, 0x477FE000,
                         0x477FF000, 0x477FEFFF, 0x38800000, 0x387FFFFF, 0x33800000, 0x33000000, 0x33000001,
                         0x00000001, 0x80400000, 0x3F802000, 0x3F803000, 0x3F801000], np.uint32).view(np.float32)
    rng = np.random.default_rng(0)
    rand = (rng.standard_normal(3000) * np.exp2(rng.integers(-30, 20, 3000))).astype(np.float32)
    ties = (rng.integers(0, 2 ** 31, 500, dtype=np.uint64).astype(np.uint32) & np.uint32(0xFFFF0000)
            | np.uint32(0x8000)).view(np.float32)
    x = np.concatenate([specials, rand, ties, -rand])
    for compute, kind in (("bfloat16", 0), ("float16", 1)):
        want = ops.round_compute(x, compute)
        got = H(M.round_compute(B.to_device(x), compute))
        assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32)), compute
        # each version of each kernel on its own (version 2: four elements a thread, n a multiple of 4)
        for v, n in ((1, x.size), (2, x.size - x.size % 4)):
            xs, w = x[:n], want[:n]
            d = B.to_device(xs)
            bits, r32 = xp.empty(xs.shape, np.uint16), xp.empty(xs.shape, np.float32)
            M._launch(f"round16_v{v}", n if v == 1 else n // 4,
                      (d, np.int64(n), np.int32(kind), np.int32(1), r32, bits), xp)
            ref16 = w.astype(bfloat16) if compute == "bfloat16" else w.astype(np.float16)
            b = H(bits)
            finite = ~np.isnan(w)
            assert np.array_equal(b[finite], ref16.view(np.uint16)[finite]), (compute, v)
            nan_exp = 0x7F80 if compute == "bfloat16" else 0x7C00
            assert ((b[~finite] & nan_exp) == nan_exp).all() and \
                ((b[~finite] & ~np.uint16(nan_exp | 0x8000)) != 0).all(), (compute, v)
            assert np.array_equal(H(r32).view(np.uint32), w.view(np.uint32)), (compute, v)
            out = xp.empty(xs.shape, np.float32)
            M._launch(f"round_v{v}", n if v == 1 else n // 4, (d, np.int64(n), np.int32(kind), out), xp)
            assert np.array_equal(H(out).view(np.uint32), w.view(np.uint32)), (compute, v)
            cols = 50 if v == 1 else 48                        # (60 x cols of the 3000 random values)
            y = B.to_device(rand[:60 * cols].reshape(60, cols).copy())
            bias = B.to_device(rand[:cols].copy())
            y16 = xp.empty((60, cols), np.uint16)
            M._launch(f"bias_round_v{v}", 60 * 256 if v == 1 else 60 * cols // 4,
                      (y, bias, np.int64(60), np.int32(cols), np.int32(kind), y16), xp)
            ref = ops.round_compute(rand[:60 * cols].reshape(60, cols) + ops.round_compute(rand[:cols], compute),
                                    compute)
            assert np.array_equal(H(y).view(np.uint32), ref.view(np.uint32)), (compute, v)
            want16 = ref.astype(bfloat16).view(np.uint16) if compute == "bfloat16" else ref.astype(np.float16).view(
                np.uint16)                                   # its twin: the 16-bit patterns of the same values
            assert np.array_equal(H(y16), want16), (compute, v)
        # the bias gradient from 16-bit storage (colsum.cu colsum16_partial_v1, the mixed linear's db): column_sum
        # C1's bits on the float32 array of the same values (70 rows: chunks of 2 rows, a tail; 33 columns)
        from refbert_kernels.cuda import cuda_c as K
        vals = ops.round_compute((rng.standard_normal((70, 33)) * 100).astype(np.float32), compute)
        b16 = (vals.astype(bfloat16) if compute == "bfloat16" else vals.astype(np.float16)).view(np.uint16)
        got, want = H(K.column_sum16_c1(B.to_device(b16.copy()), kind)), H(K.column_sum_c1(B.to_device(vals)))
        assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32)), compute
        print("ROUND OK", compute)
"""


@pytest.mark.parametrize("mode", ["emu", "gpu"])
def test_device_rounding_is_the_spec_bit_for_bit(mode):
    out = _child(_ROUND, mode)
    assert "ROUND OK bfloat16" in out and "ROUND OK float16" in out, out


_OPS = """
    import numpy as np
    from refbert import ops
    from refbert.philox import DropoutRNG
    from refbert_kernels.cuda import backend as B, mixed as M, versions as VV
    H = lambda a: a.get() if hasattr(a, "get") else a            # noqa: E731  (a device array's host copy)

    def close_ulp(got, ref, compute, what):
        got, ref = np.asarray(H(got), np.float32), np.asarray(ref, np.float32)
        assert got.shape == ref.shape, (what, got.shape, ref.shape)
        assert np.array_equal(ops.round_compute(got, compute), got), what + ": off the compute grid"
        ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(ref), 1e-30)))) * (2.0 ** -7 if compute == "bfloat16"
                                                                           else 2.0 ** -10)
        diff = np.abs(got.astype(np.float64) - ref)
        assert (diff <= ulp * (1 + 1e-6)).all(), (what, float((diff / ulp).max()))
        frac = float((got != ref).mean())
        assert frac <= 0.02, (what, frac)
        return frac

    def close_scale(got, ref, compute, what):
        # the one-element paths' check (C = 37): within one compute-dtype ulp at the tensor's scale (an element that
        # cancels far below its tensor's largest carries the float32 noise of terms of that size, many of its own
        # ulps: LayerNorm's dx), at most 2% of elements apart at all (a rounding left out moves about a third)
        got, ref = np.asarray(H(got), np.float32), np.asarray(ref, np.float32)
        assert got.shape == ref.shape and np.array_equal(ops.round_compute(got, compute), got), what
        scale = max(float(np.abs(ref).max()), 1e-30)
        ulp = 2.0 ** np.floor(np.log2(scale)) * (2.0 ** -7 if compute == "bfloat16" else 2.0 ** -10)
        assert float(np.abs(got.astype(np.float64) - ref).max()) <= ulp, what
        assert float((got != ref).mean()) <= 0.02, (what, float((got != ref).mean()))

    def close_f32(got, ref, what):
        got, ref = np.asarray(H(got), np.float64), np.asarray(ref, np.float64)
        scale = max(float(np.abs(ref).max()), 1e-30)
        assert float(np.abs(got - ref).max()) <= 1e-5 * scale, (what, float(np.abs(got - ref).max()) / scale)

    r = np.random.default_rng(3)
    COMPUTES = ("bfloat16", "float16")                    # (the simulator's run: one child a dtype, side by side)
    for compute in COMPUTES:
        Rn = lambda a: ops.round_compute(np.asarray(a, np.float32), compute)   # noqa: E731
        # linear: 3 x 5 rows, 48 -> 40, with and without a bias
        x = r.standard_normal((3, 5, 48)).astype(np.float32)
        w = (r.standard_normal((40, 48)) * 0.2).astype(np.float32)
        b = r.standard_normal(40).astype(np.float32)
        d = r.standard_normal((3, 5, 40)).astype(np.float32)
        for bias in (b, None):
            out, cache = M.linear_forward_mixed(B.to_device(x), B.to_device(w),
                                                None if bias is None else B.to_device(bias), compute=compute)
            ref, rc = ops.linear_forward(Rn(x), Rn(w), None if bias is None else Rn(bias))
            close_ulp(out, Rn(ref), compute, f"linear out {compute}")
            g = M.linear_backward_mixed(B.to_device(d), cache)
            gr = ops.linear_backward(Rn(d), rc)
            close_ulp(g[0], Rn(gr[0]), compute, "linear dx")
            for got, want, name in zip(g[1:], gr[1:], ("dw", "db")):
                assert H(got).dtype == np.float32
                close_f32(got, want, f"linear {name}")
        # attention: B=2, T=9, 2 heads of 16, HF's padding mask, dropout 0.2
        Bq, T, Cq, nh = 2, 9, 32, 2
        q, k, v, dout = (r.standard_normal((Bq, T, Cq)).astype(np.float32) for _ in range(4))
        mask = np.zeros((Bq, 1, 1, T), np.float32)
        mask[1, ..., 6:] = np.finfo(np.float32).min
        for p in (0.0, 0.2):
            r1, r2 = DropoutRNG(11), DropoutRNG(11)
            out, cache = M.attention_forward_mixed(*(B.to_device(a) for a in (q, k, v)), nh, mask, p, r1, True,
                                                   compute=compute)
            ref, rc = ops.attention_forward_mixed(q, k, v, nh, mask, p, r2, True, compute=compute)
            assert r1.calls == r2.calls
            close_ulp(out, ref, compute, f"attention out p={p}")
            close_ulp(M.attention_probs_mixed(cache), ops.attention_probs_mixed(rc), compute, "attention probs")
            for got, want, name in zip(M.attention_backward_mixed(B.to_device(dout), cache),
                                       ops.attention_backward_mixed(Rn(dout), rc), ("dq", "dk", "dv")):
                close_ulp(got, want, compute, f"attention {name} p={p}")
        # the fused ops (K1 on device arrays: the rounding inside the CUDA C kernels; the rule on NumPy's), against
        # the spec: refbert.mixed's rule around the oracle's float32 op (dropout 0.2 draws the same Philox stream)
        from refbert import mixed as MX
        # embedding (the cuda backend's own op: R(w[ids]) where the rule rounds the table, R(w)[ids]): the same bits;
        # dw, a parameter's gradient, float32 as the rule's (padding row 1 zero)
        ids = r.integers(0, 50, (3, 7))
        ids[0, :2] = 1
        we, de = r.standard_normal((50, 24)).astype(np.float32), r.standard_normal((3, 7, 24)).astype(np.float32)
        out, cache = M.embedding_forward_mixed(B.to_device(ids), B.to_device(we), 1, compute=compute)
        ref, rc = MX.wrap_forward(ops.embedding_forward, "embedding_forward", compute)(ids, we, 1)
        assert np.array_equal(H(out).view(np.uint32), ref.view(np.uint32)), "embedding out"
        close_f32(M.embedding_backward_mixed(B.to_device(de), cache),
                  MX.wrap_backward(ops.embedding_backward, "embedding_backward", compute)(de, rc), "embedding dw")
        cases = []
        for width in (24, 37):                   # the kernels' float4 paths, and their one-element paths (C % 4 != 0)
            rw = r if width == 24 else np.random.default_rng(37)   # (the 37 draws its own: the others' inputs stay)
            xr = rw.standard_normal((4, 6, width)).astype(np.float32)
            ar = rw.standard_normal((4, 6, width)).astype(np.float32)
            wr = (1 + 0.1 * rw.standard_normal(width)).astype(np.float32)
            br = rw.standard_normal(width).astype(np.float32)
            dr = rw.standard_normal((4, 6, width)).astype(np.float32)
            ulps = close_ulp if width == 24 else close_scale
            cases += [("layernorm", (xr, wr, br), {}, ("w", "b"), dr, ulps),
                      ("residual_layernorm", (xr, ar, wr, br), {}, ("w", "b"), dr, ulps),
                      ("dropout_residual_layernorm", (xr, ar, wr, br), dict(p=0.2, train=True), ("w", "b"), dr, ulps),
                      ("dropout_residual_layernorm", (xr, ar, wr, br), dict(p=0.2, train=False), ("w", "b"), dr, ulps),
                      ("gelu", (xr,), {}, (), dr, ulps), ("bias_gelu", (xr, br), {}, ("b",), dr, ulps),
                      ("bias_gelu", (xr, br), dict(approximate="tanh"), ("b",), dr, ulps)]
        for op, args, kw, params, dr, ulps in cases:
            kd, ks = dict(kw), dict(kw)
            if "p" in kw:
                kd["rng"], ks["rng"] = DropoutRNG(5), DropoutRNG(5)
            fwd = getattr(M, op + "_forward_mixed")
            out, cache = fwd(*(B.to_device(a) for a in args), **kd, compute=compute)
            spec_f = MX.wrap_forward(getattr(ops, op + "_forward"), op + "_forward", compute)
            ref, rc = spec_f(*args, **ks)
            ulps(out, ref, compute, f"{op} {kw} out")
            got = getattr(M, op + "_backward_mixed")(B.to_device(dr), cache)
            want = MX.wrap_backward(getattr(ops, op + "_backward"), op + "_backward", compute)(dr, rc)
            got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
            names = ops.GRADS_OF[op]
            for g, w_, name in zip(got, want, names):
                if name in params:
                    assert H(g).dtype == np.float32
                    close_f32(g, w_, f"{op} d{name}")
                else:
                    ulps(g, w_, compute, f"{op} {kw} d{name}")
        # cross-entropy (K1 on device arrays: C2's forward on R(logits), the backward rounding dz in its kernel):
        # the loss float32 within float32 noise of the spec's, dz on the grid within one ulp; 9 rows of 37 (the
        # one-element path), an ignored label, logits of scale 3
        zl = (3 * r.standard_normal((9, 37))).astype(np.float32)
        lab = r.integers(0, 37, 9)
        lab[2] = -100
        loss, cache = M.cross_entropy_forward_mixed(B.to_device(zl), lab, compute=compute)
        ref, rc = MX.wrap_forward(ops.cross_entropy_forward, "cross_entropy_forward", compute)(zl, lab)
        close_f32(loss, ref, "cross_entropy loss")
        dl = np.float32(0.7)
        close_ulp(M.cross_entropy_backward_mixed(dl, cache),
                  MX.wrap_backward(ops.cross_entropy_backward, "cross_entropy_backward", compute)(dl, rc), compute,
                  "cross_entropy dlogits")
        print("OPS OK", compute)
    want = "S1" if B.MODE == "sim" else "S2"             # the array-operation version on NumPy arrays
    if B.MODE != "sim":                                   # the kernels rounded (no rule around them)
        assert "float16" not in COMPUTES or VV.RAN[("layernorm", "float16", "K1")] == 2, VV.RAN
        assert "bfloat16" not in COMPUTES or VV.RAN[("bias_gelu", "bfloat16", "K1")] == 4, VV.RAN
        assert "float16" not in COMPUTES or VV.RAN[("cross_entropy", "float16", "K1")] == 1, VV.RAN
    assert "bfloat16" not in COMPUTES or VV.RAN[("linear", "bfloat16", "M1")] == 2, VV.RAN
    assert "float16" not in COMPUTES or VV.RAN[("attention", "float16", want)] == 2, VV.RAN
"""


@pytest.mark.parametrize("mode", ["emu", "sim", "gpu"])
def test_linear_and_attention_equal_the_spec(mode):
    if mode == "sim":                      # the simulator holds the GIL, one core a child: a child a dtype, two at once
        one = '    COMPUTES = ("bfloat16", "float16")'
        assert _OPS.count(one) == 1
        with ThreadPoolExecutor(2) as ex:
            outs = list(ex.map(lambda c: _child(_OPS.replace(one, f"    COMPUTES = ({c!r},)"), mode),
                               ("bfloat16", "float16")))
        assert "OPS OK bfloat16" in outs[0] and "OPS OK float16" in outs[1], outs
        return
    out = _child(_OPS, mode)
    assert "OPS OK bfloat16" in out and "OPS OK float16" in out, out


_MODEL = """
    import numpy as np
    import refbert
    from refbert import ops
    from refbert.check import model_batch, tiny_config
    from refbert.model import get_backend, to_numpy
    from refbert_kernels.cuda import versions as VV
    B_ = get_backend("cuda")

    def run(backend, precision):
        cfg = tiny_config("BertForPreTraining")
        m = refbert.BertForPreTraining(cfg, seed=4, backend=backend, precision=precision).train(True)
        r = np.random.default_rng(5)
        for p in m.parameters().values():                   # off HF's init: no gradient hides behind a zero
            noise = (r.standard_normal(p.shape) * 0.05).astype(np.float32)
            p += B_.to_device(noise) if backend == "cuda" else noise
        x = model_batch(cfg, "BertForPreTraining", B=2, T=6)
        out = m(**x, output_hidden_states=True, output_attentions=True)
        calls = m.dropout_rng.calls
        return to_numpy(out), to_numpy(m.backward()), calls, m

    for precision, compute in (("bf16-mixed", "bfloat16"), ("fp16-mixed", "float16")):
        oc, gc, cc, mc = run("cuda", precision)
        on, gn, cn, _ = run("numpy", precision)
        assert cc == cn, (cc, cn)
        # the loss is float32 from compute-dtype logits, each of which may sit one compute ulp (bf16: 2^-7 relative)
        # off where its float32 value neared a rounding boundary: their mean moves it far less; 1e-3 relative is a
        # quarter of bf16's unit roundoff 2^-8
        assert abs(float(oc.loss) - float(on.loss)) <= 1e-3 * abs(float(on.loss)), (oc.loss, on.loss)
        for t in [oc.prediction_logits, oc.seq_relationship_logits, *oc.hidden_states, *oc.attentions]:
            assert np.array_equal(ops.round_compute(np.asarray(t, np.float32), compute), t)
        ulp1 = 2.0 ** -7 if compute == "bfloat16" else 2.0 ** -10

        def worst_of(gc, but=()):
            return max(float(np.abs(np.asarray(gc[name], np.float64) - ref).max())
                       / (max(float(np.abs(ref).max()), 1e-30) * ulp1) for name, ref in gn.items()
                       if not any(b in name for b in but))
        # a GPU: 2 ulps at each tensor's scale (module docstring); the emulator: its GEMMs are NumPy's float32
        # matmul of the same values as the spec's, only the kernels' own float32 sums (layernorm's statistics, the
        # softmax's row sums) come in another order: a quarter ulp (observed 0), which a rounding left out exceeds
        bound = 0.25 if B_.MODE == "emu" else 2.0
        worst = worst_of(gc)
        assert worst <= bound, (precision, worst)
        how = mc.ops.how
        assert how["linear_forward"] == how["attention_forward"] == "own", how
        assert VV.RAN.get(("linear", compute, "M1")) and VV.RAN.get(("attention", compute, "S2")), VV.RAN
        print("MODEL OK", precision, f"worst gradient {worst:.3f} ulp of the compute dtype at its scale")
    if B_.MODE == "emu":                                  # the bound can fail: every linear's R(b) left out
        from refbert_kernels.cuda import mixed as M
        launch = M._launch

        def unrounded_bias(name, threads, args, xp):
            if not name.startswith("bias_round"):
                return launch(name, threads, args, xp)
            y, b, o16 = args[0], args[1], args[5]
            y += b.reshape(1, -1)                           # R(y + b) below, b itself unrounded
            M._round_(y, compute, o16 if o16.size else None)   # (and its twin, as the kernel writes it)
        M._launch = unrounded_bias
        precision, compute = "bf16-mixed", "bfloat16"
        oc, gc, _, _ = run("cuda", precision)
        on, gn, _, _ = run("numpy", precision)
        M._launch = launch
        ulp1 = 2.0 ** -7
        # (judged without the key biases: their gradient is zero in exact arithmetic, its "scale" rounding noise)
        w = worst_of(gc, but=("attention.self.key.bias",))
        print("R(b) LEFT OUT", f"worst gradient {w:.3f} ulp", "caught" if w > 0.25 else "MISSED")
"""


@pytest.mark.parametrize("mode", ["emu", "gpu"])
def test_whole_model_mixed_equals_the_numpy_spec(mode):
    out = _child(_MODEL, mode)
    assert "MODEL OK bf16-mixed" in out and "MODEL OK fp16-mixed" in out, out
    assert mode != "emu" or ("R(b) LEFT OUT" in out and "caught" in out), out


# S3: the spec's attention as tensor-core flash kernels (csrc/mixed.cu s3_*: mma.sync, on the emulator through
# cpusim.cuh's emulation). The spec's rounding sites are the same, the float32 sums are not (the tensor cores sum a
# 16-term chunk, then the next, where NumPy's matmul sums otherwise; on a GPU also the tensor cores' own accumulation
# and expf's last bits), so an output can round to the neighbouring
# compute-dtype value where its float32 value sits near a rounding boundary, and P or dS' can too, moving an output
# by one such unit of one term. Bound: every output within one compute ulp at its tensor's scale (largest |ref|);
# observed at most 0.54 of it. And at most 3% of the elements differ at all (observed 1.7% at worst, float16 dk at
# T = 130): a one-pass flash, rounding exp(s - running max) and rescaling, differs from the spec in over 10% of the
# forward's outputs at T = 130 (three key tiles; tests/test_mixed.py test_the_s3_bound_tells_the_spec_from_a_one_
# pass_flash, in NumPy), so this bound tells the spec's two-pass forward from it.
_S3 = """
    import os
    import numpy as np
    from refbert import ops
    from refbert.philox import DropoutRNG
    from refbert_kernels.cuda import backend as B, mixed as M, versions as VV
    H = lambda a: a.get() if hasattr(a, "get") else a            # noqa: E731  (a device array's host copy)
    r = np.random.default_rng(0)
    for compute in ("bfloat16", "float16"):
        ulp1 = 2.0 ** (-7 if compute == "bfloat16" else -10)
        for (Bn, T, Hn, p) in ((2, 37, 2, 0.0), (2, 130, 1, 0.2)):   # 1 and 3 key tiles, tails, dropout
            C = Hn * 64
            q, k, v, dout = (ops.round_compute(r.standard_normal((Bn, T, C)).astype(np.float32), compute)
                             for _ in range(4))
            mask = np.zeros((Bn, 1, 1, T), np.float32)
            mask[-1, ..., T // 2:] = np.finfo(np.float32).min                        # padding, HF style
            ref, rc = ops.attention_forward_mixed(q, k, v, Hn, mask, p, DropoutRNG(5), True, compute)
            refs = (ref, *ops.attention_backward_mixed(dout, rc))
            got, gc = M.attention_forward_s3(*(B.to_device(a) for a in (q, k, v)), Hn, B.to_device(mask), p,
                                             DropoutRNG(5), True, compute)
            gots = (got, *M.attention_backward_s3(B.to_device(dout), gc))
            for name, a, b in zip(("out", "dq", "dk", "dv"), gots, refs):
                a, b = np.asarray(H(a), np.float64), np.asarray(b, np.float64)
                assert np.array_equal(ops.round_compute(a.astype(np.float32), compute), a), name  # on the grid
                err = float(np.abs(a - b).max()) / (ulp1 * float(np.abs(b).max()))
                frac = float((a != b).mean())
                assert err <= 1.0 and frac <= 0.03, (compute, T, p, name, err, frac)
                print("S3", compute, T, p, name, f"{err:.2f} ulp at scale, {frac:.4f} differ", flush=True)
            # m and l: float32 noise of their own sums
            assert np.abs(H(gc.m) - rc.m.reshape(-1)).max() <= 1e-5 * (1 + np.abs(rc.m).max())
            assert (np.abs(H(gc.l) - rc.l.reshape(-1)) / rc.l.reshape(-1)).max() <= 1e-5
    assert VV.RAN.get(("attention", "bfloat16", "S3")) and VV.RAN.get(("attention", "float16", "S3")), VV.RAN
    print("S3 OK")
"""


@pytest.mark.parametrize("mode", ["emu", "gpu"])
def test_attention_s3_flash_equals_the_spec(mode):
    out = _child(_S3, mode)
    assert "S3 OK" in out, out


# S4: S3's kernels with dropout's keep-mask drawn a Philox call per 4 scores (T % 4 == 0; a call per score
# otherwise): the same words, so S3's bits, which is the whole spec of S4 (S3's own bound against the spec is the
# test above). At T = 68 (two key tiles, the second a tail; padding in the last sequence) S4 shares its calls, at
# T = 70 it cannot; dropout 0.3 so that many scores of every tile are dropped; and at p = 0 (no words drawn).
_S4 = """
    import numpy as np
    from refbert import ops
    from refbert.philox import DropoutRNG
    from refbert_kernels.cuda import backend as B, mixed as M, versions as VV
    H = lambda a: a.get() if hasattr(a, "get") else a            # noqa: E731  (a device array's host copy)
    r = np.random.default_rng(3)
    for compute in ("bfloat16", "float16"):
        for (Bn, T, Hn, p) in ((2, 68, 1, 0.3), (1, 70, 2, 0.3), (1, 68, 1, 0.0)):
            q, k, v, dout = (B.to_device(ops.round_compute(r.standard_normal((Bn, T, Hn * 64)).astype(np.float32),
                                                           compute)) for _ in range(4))
            mask = np.zeros((Bn, 1, 1, T), np.float32)
            mask[-1, ..., T - 20:] = np.finfo(np.float32).min
            runs = []
            for kernels in ("s3", "s4"):
                out, c = M.attention_forward_s3(q, k, v, Hn, B.to_device(mask), p, DropoutRNG(11), True, compute,
                                                kernels)
                runs.append([H(a) for a in (out, c.m, c.l, *M.attention_backward_s3(dout, c))])
            for name, a, b in zip(("out", "m", "l", "dq", "dk", "dv"), *runs):
                assert np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32)), \
                    (compute, T, p, name)
            print("S4 = S3", compute, T, p, flush=True)
    assert VV.RAN.get(("attention", "bfloat16", "S4")) and VV.RAN.get(("attention", "float16", "S4")), VV.RAN
    M.ATTENTION = "S5"                                      # (REFBERT_MIXED_ATTENTION=S5): said, never S2 unsaid
    try:
        M.attention_forward_mixed(q, k, v, Hn)
        raise AssertionError("an unknown REFBERT_MIXED_ATTENTION ran")
    except ValueError as e:
        assert "REFBERT_MIXED_ATTENTION expected one of S2, S3, S4, got 'S5'" in str(e), e
    print("S4 OK")
"""


@pytest.mark.parametrize("mode", ["emu", "gpu"])
def test_attention_s4_gives_s3s_bits(mode):
    out = _child(_S4, mode)
    assert "S4 OK" in out, out


_MARKED = """
    import numpy as np
    from refbert import ops
    from refbert.mixed import mark
    from refbert_kernels.cuda import backend as B, cuda_c as K, emulate as E, mixed as M
    H = lambda a: a.get() if hasattr(a, "get") else a            # noqa: E731  (a device array's host copy)
    r = np.random.default_rng(2)
    calls = []
    operand = M.operand
    M.operand = lambda x, compute, want32=False: (calls.append(want32), operand(x, compute, want32))[1]
    for compute in ("bfloat16", "float16"):
        x = B.to_device(ops.round_compute(r.standard_normal((3, 5, 8)).astype(np.float32), compute))
        w = B.to_device(r.standard_normal((12, 8)).astype(np.float32))
        b = B.to_device(r.standard_normal(12).astype(np.float32))
        _, cache = M.linear_forward_mixed(x, w, b, compute)
        d = ops.round_compute(r.standard_normal((3, 5, 12)).astype(np.float32), compute)   # on the grid
        calls.clear()
        E.COUNTS.reset()
        plain = M.linear_backward_mixed(B.to_device(d), cache)                 # not marked: R(dout) made anew
        assert calls == [True], calls
        # db from the 16-bit operand (colsum16_partial_v1): column_sum C1's bits on the float32 values
        assert "colsum16_partial_v1" in E.COUNTS.launches, E.COUNTS.launches
        assert np.array_equal(H(plain[2]).view(np.uint32),
                              H(K.column_sum_c1(B.to_device(d.reshape(15, 12)))).view(np.uint32)), compute
        calls.clear()
        marked = M.linear_backward_mixed(mark(B.to_device(d), compute), cache)  # marked: its own R(dout)
        assert calls == [False], calls
        for a, c in zip(plain, marked):                                         # the same bits either way
            assert np.array_equal(H(a).view(np.uint32), H(c).view(np.uint32))
        # dx_into (the model's sum of a gradient's paths): into + R(dx) in one pass, the float32 sum of the same two
        # terms as the spec's (R(dx), then the add), into itself unchanged, dw and db as without
        into = B.to_device(r.standard_normal((3, 5, 8)).astype(np.float32))
        before = H(into).copy()
        summed = M.linear_backward_mixed(B.to_device(d), cache, dx_into=into)
        assert np.array_equal(H(summed[0]).view(np.uint32), (before + H(plain[0])).view(np.uint32)), compute
        assert np.array_equal(H(into).view(np.uint32), before.view(np.uint32))
        for a, c in zip(plain[1:], summed[1:]):
            assert np.array_equal(H(a).view(np.uint32), H(c).view(np.uint32))
    assert M.linear_backward_mixed.dx_into is True                              # the model sums through it
    print("MARKED OK")
"""


_ROWS = """
    import os
    os.environ["REFBERT_CUDA_CHECKS"] = "1"
    import numpy as np
    from refbert import ops
    from refbert_kernels.cuda import backend as B, mixed as M
    r = np.random.default_rng(3)
    q, k, v = (ops.round_compute(r.standard_normal((1, 5, 64)).astype(np.float32), "bfloat16") for _ in range(3))
    bad = {"an entirely -inf row": np.full((1, 1, 1, 5), -np.inf, np.float32),
           "a NaN score": np.where(np.arange(5) == 2, np.nan, 0.0).astype(np.float32).reshape(1, 1, 1, 5)}
    for name, fwd in (("S2", M.attention_forward_s2), ("S3", M.attention_forward_s3)):
        for what, mask in bad.items():
            try:
                fwd(*(B.to_device(a) for a in (q, k, v)), 1, B.to_device(mask), 0.0, None, True, "bfloat16")
            except ValueError as e:
                print("ERR", name, what, e)
            else:
                print("NO ERROR", name, what)
    # a grid row per (batch, head): B x H over CUDA's y limit is refused by name before any launch
    from refbert_kernels.cuda import cuda_c as K, attention as A, emulate as E
    E.COUNTS.reset()
    wide = B.to_device(np.zeros((65536, 1, 64), np.float32))
    for name, fwd in (("S3", lambda a: M.attention_forward_s3(a, a, a, 1)),
                      ("C3", lambda a: K.attention_forward_c3(a, a, a, 1)),
                      ("Numba", lambda a: A.attention_forward(a, a, a, 1))):
        try:
            fwd(wide)
        except ValueError as e:
            print("ERR", name, "wide", e)
        else:
            print("NO ERROR", name, "wide")
    assert E.COUNTS.launched() == 0, E.COUNTS.launches
"""


def test_s2_s3_refuse_a_row_without_a_finite_max_as_the_spec_does():
    """With REFBERT_CUDA_CHECKS=1 (the device read back), S2 and S3 raise the spec's ValueError for a row that is all
    -inf or has a NaN score, as refbert.ops.attention_forward_mixed does (emulator); and the attention launchers refuse
    batch x heads beyond the grid's y limit by name, before launching."""
    out = _child(_ROWS, "emu")
    assert "NO ERROR" not in out, out
    assert out.count("ERR S") == 5 and out.count("expected every row to have a finite maximum score") == 4, out
    # and B x H = 65536 rows of blocks, one over CUDA's grid y limit: the same clear error from S3, C3 and Numba
    assert out.count("batch x n_heads expected at most 65535") == 3 and "got 65536 x 1 = 65536" in out, out


def test_linear_backward_reads_a_marked_dout_as_its_own_rounding():
    """linear_backward_mixed with a dout a mixed op wrote (marked: on the compute grid) makes only its 16-bit operand
    (no float32 copy R(dout) for the bias sums), and gives the same dx, dw, db bits as with the same values
    unmarked (emulator)."""
    out = _child(_MARKED, "emu")
    assert "MARKED OK" in out, out


_S3_MODEL = """
    import os
    os.environ["REFBERT_MIXED_ATTENTION"] = "S3"
    import numpy as np
    import refbert
    from refbert import BertConfig
    from refbert.model import get_backend, to_numpy
    from refbert_kernels.cuda import versions as VV
    B_ = get_backend("cuda")
    cfg = BertConfig(vocab_size=60, hidden_size=128, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=16)               # head size 64: S3 applies
    r = np.random.default_rng(1)
    ids = r.integers(4, 60, (2, 8))
    am = np.ones((2, 8), np.int64)
    am[1, 5:] = 0
    lab = np.full((2, 8), -100)
    lab[0, 2], lab[1, 1] = 7, 9
    x = dict(input_ids=ids, attention_mask=am, labels=lab, next_sentence_label=np.array([0, 1]))

    def run(backend):
        m = refbert.BertForPreTraining(cfg, seed=4, backend=backend, precision="bf16-mixed").train(True)
        out = m(**x)
        return float(out.loss), to_numpy(m.backward())

    lc, gc = run("cuda")
    ln, gn = run("numpy")
    assert abs(lc - ln) <= 1e-3 * abs(ln), (lc, ln)
    worst = max(float(np.abs(np.asarray(gc[k], np.float64) - g).max()) / (2.0 ** -7 * max(float(np.abs(g).max()),
                                                                                           1e-30))
                for k, g in gn.items())
    assert worst <= 2.0, worst                             # the whole model's bound (test_whole_model_...): 2 ulps
    assert VV.RAN.get(("attention", "bfloat16", "S3")) and not VV.RAN.get(("attention", "bfloat16", "S2")), VV.RAN
    print("S3 MODEL OK", f"worst gradient {worst:.3f} ulp at its scale")
"""


def test_model_with_s3_attention_equals_the_numpy_spec():
    """REFBERT_MIXED_ATTENTION=S3: a bf16-mixed training step of a head-size-64 model runs S3 (not S2) and its loss
    and gradients stay within the whole-model bound of the numpy backend's spec (emulator)."""
    out = _child(_S3_MODEL, "emu")
    assert "S3 MODEL OK" in out, out


# `refbert pretrain --backend cuda --mixed-precision fp16` (the loss scaler on device arrays), stopped after step 2 and
# resumed, against the numpy backend's uninterrupted run of the same spec: the same steps, learning rates, loss
# scales and skipped steps (a step whose gradients overflowed logs grad_norm nan: both runs must skip the same ones;
# here step 3), and losses within 1e-4 relative: the loss is float32 arithmetic on logits that agree with the spec's
# up to one fp16 ulp (2^-10 relative) in a few elements of rows of 60, so it moves by ~1e-5 at most. Running float32
# instead of the spec fails both: it skips no step, and by step 4 its losses differ by 3.4e-4 (MLM + NSP) and 3.4e-3
# (NSP) relative.

def _pretrain_args(d, out, *extra):
    return ["pretrain", "--corpus", str(d / "corpus.txt"), "--vocab", str(d / "tok" / "vocab.txt"),
            "--config", str(d / "config.json"), "--max-seq-length", "8", "--batch-size", "2", "--steps", "4",
            "--lr", "1e-3", "--save-every", "1", "--mixed-precision", "fp16", "--out", str(out), *extra]


@pytest.mark.parametrize("mode", ["emu", "gpu"])        # (the simulator's path of each op: the ops test's [sim])
def test_pretrain_cuda_fp16_mixed_resumed_equals_numpy_spec(tiny, mode):
    import csv
    from refbert import cli
    ref, run = tiny / "numpy", tiny / "cuda"
    assert cli.main(_pretrain_args(tiny, ref)) == 0
    for extra in (["--stop-after", "2"], ["--resume"]):
        out = _child(f"""
            from refbert import cli
            rc = cli.main({_pretrain_args(tiny, run, "--backend", "cuda", *extra)!r})
            from refbert_kernels.cuda import backend, versions
            print("MODE", backend.MODE, "PROBLEMS", versions.problems())
            sys.exit(rc)
        """, mode)
        assert f"MODE {mode} PROBLEMS []" in out, out
    rows = [list(csv.DictReader(open(p / "log.csv", newline=""))) for p in (run, ref)]
    assert len(rows[0]) == len(rows[1]) == 4
    assert [w["grad_norm"] == "nan" for w in rows[1]] == [False, False, True, False]   # fp16 overflows at step 3
    for g, w in zip(*rows):
        assert {k: g[k] for k in ("step", "epoch", "lr", "mlm_acc", "nsp_acc", "loss_scale")} == \
            {k: w[k] for k in ("step", "epoch", "lr", "mlm_acc", "nsp_acc", "loss_scale")}
        assert (g["grad_norm"] == "nan") == (w["grad_norm"] == "nan"), (g, w)
        for k in ("loss", "mlm_loss", "nsp_loss"):
            assert abs(float(g[k]) - float(w[k])) <= 1e-4 * abs(float(w[k])), (k, g, w)


_STUDY = """
    from refbert import precision as P
    d = P.model_study("tiny", backend="cuda", peer=False)
    assert not d["notes"], d["notes"]
    worst = {r: max(t["errs"][r] for t in d["tensors"]) for r in d["loss"] if r != "refbert float64"}
    print("WORST", worst, "VS_SPEC", d["vs_spec"])
    # the GPU's float32 step against float64: float32 rounding (~1e-5 of a tensor's scale, as the numpy backend's)
    assert worst["refbert cuda float32"] < 1e-5, worst
    # each GPU mixed step against the spec's run of its precision: accumulation order alone, the whole-model bound
    # above (2 ulp of the compute dtype at the tensor's scale; ulp(1) = 2^-7 in bfloat16, 2^-10 in float16)
    ulp = {"bf16-mixed": 2.0 ** -7, "fp16-mixed": 2.0 ** -10}
    assert set(d["vs_spec"]) == {"refbert cuda bf16-mixed", "refbert cuda fp16-mixed"}, d["vs_spec"]
    for run, e in d["vs_spec"].items():
        assert e <= 2 * ulp[run.split()[-1]], (run, e)
    # and the precision each costs against float64 is the spec's: within those 2 ulp of the spec run's error
    for p in ulp:
        assert abs(worst[f"refbert cuda {p}"] - worst[f"refbert {p}"]) <= 2 * ulp[p], worst
    print("OK")
"""


@pytest.mark.parametrize("mode", ["emu", "gpu"])
def test_precision_study_of_the_cuda_mixed_step(mode):
    """refbert check --precision --device cuda's step study (precision.model_study(backend="cuda")): the GPU's
    float32 and mixed steps against float64 beside the spec's, each mixed one equal to the spec up to accumulation
    order."""
    out = _child(_STUDY, mode)
    assert "OK" in out, out


def test_mixed_layernorm_forward_version_3_is_version_2s_bits():
    """The mixed path's residual and dropout + residual layernorm forwards run layernorm.cu's version 3 (the row in
    registers) by default and version 2 under REFBERT_MIXED_LN=2: out, its twin, what the forward keeps in 16 bits
    for the backward and the backward's dx, da, dw, db the same bits either way (the same sums in the same order;
    the emulator's g++ contracts nothing), in bf16 and fp16, with what each run meant to run asserted; an unknown
    value is an error naming the variable. And the backward's version 6 (one pass, REFBERT_MIXED_LN_BWD=6) against
    version 2 (the default) on the same cache: dx, da and the twin the same bits, dw, db within rounding."""
    out = _child("""
        import numpy as np
        from refbert import ops
        from refbert.philox import DropoutRNG
        from refbert_kernels.cuda import backend as B, mixed as M, emulate as E
        r = np.random.default_rng(8)
        for compute in ("bfloat16", "float16"):
            R_ = lambda t: ops.round_compute(np.asarray(t, np.float32), compute)
            x, a, d = (B.to_device(R_(r.standard_normal((40, 64)))) for _ in range(3))
            w, b = (B.to_device(r.standard_normal(64).astype(np.float32)) for _ in range(2))
            for kind in ("res", "drop"):
                got = {}
                for v in ("3", "2"):
                    M.MIXED_LN = v
                    E.COUNTS.reset()
                    if kind == "res":
                        o, c = M.residual_layernorm_forward_mixed(x, a, w, b, compute=compute)
                        grads = M.residual_layernorm_backward_mixed(d, c)
                    else:
                        o, c = M.dropout_residual_layernorm_forward_mixed(x, a, w, b, 1e-12, 0.1, DropoutRNG(3), True,
                                                                          compute)
                        grads = M.dropout_residual_layernorm_backward_mixed(d, c)
                    ran = f"layernorm_fwd_v{v}_{kind}" in E.COUNTS.launches
                    kept = [t for t in c.cache[1:3] if hasattr(t, "get")]   # (x2, a2 of the cache: 16-bit kept)
                    mean_rstd = c.cache[5:7]
                    got[v] = [np.asarray(t.get()).view(np.uint8)
                              for t in (o, M.twin_of(o, compute), *kept, *mean_rstd, *grads)]
                    print(compute, kind, v, "ran", ran, "kept", len(kept))
                print(compute, kind, "same bits:", all(np.array_equal(p, q) for p, q in zip(got["3"], got["2"])))
        M.MIXED_LN = "4"
        try:
            M.residual_layernorm_forward_mixed(x, a, w, b, compute="bfloat16")
            print("UNKNOWN RAN")
        except ValueError as e:
            print("ERR", e)
        M.MIXED_LN = "3"
        # the backward: version 6 (REFBERT_MIXED_LN_BWD=6, one pass) against version 2's kernels (the default)
        # on one forward's cache, x and a read from their 16-bit storage, 40 rows over a grid of 2 blocks (each
        # warp 2-3 rows): dx, da and the twin the same bits; dw, db the same terms in another order, within twice
        # a float32 sum's rounding bound, 2 R 2^-24 sum_rows |term| (|dout xhat| <= |dout| sqrt(C), sqrt(64) = 8)
        from refbert_kernels.cuda import cuda_c as K
        K.LN6_BLOCKS = 2
        for compute in ("bfloat16", "float16"):
            for kind in ("ln", "res", "drop"):
                if kind == "ln":
                    o, c = M.layernorm_forward_mixed(x, w, b, compute=compute)
                    bwd = lambda: M.layernorm_backward_mixed(d, c)
                elif kind == "res":
                    o, c = M.residual_layernorm_forward_mixed(x, a, w, b, compute=compute)
                    bwd = lambda: M.residual_layernorm_backward_mixed(d, c)
                else:
                    o, c = M.dropout_residual_layernorm_forward_mixed(x, a, w, b, 1e-12, 0.1, DropoutRNG(3), True,
                                                                      compute)
                    bwd = lambda: M.dropout_residual_layernorm_backward_mixed(d, c)
                g = {}
                for v in ("6", "2"):
                    M.MIXED_LN_BWD = v
                    E.COUNTS.reset()
                    grads = bwd()
                    fused = any(n.startswith(f"layernorm_bwd_fused_v6_{kind}") for n in E.COUNTS.launches)
                    two = f"layernorm_bwd_dx_v2_{kind}" in E.COUNTS.launches
                    print(compute, kind, "bwd", v, "ran", fused == (v == "6") and two == (v == "2"))
                    tw = M.twin_of(grads[-3], compute)
                    g[v] = [t.get() for t in grads] + ([] if tw is None else [tw.get()])
                n = len(grads)                            # (dx or ds, ds or da; dw, db last; then da's twin)
                bits = all(np.array_equal(p.view(np.uint8), q.view(np.uint8))
                           for p, q in zip(g["6"][:n - 2] + g["6"][n:], g["2"][:n - 2] + g["2"][n:]))
                dh = np.abs(d.get().astype(np.float64)).sum(0)
                close = all(np.all(np.abs(p.astype(np.float64) - q) <= 2 * 40 * 2.0 ** -24 * m)
                            for p, q, m in zip(g["6"][n - 2:n], g["2"][n - 2:n], (8 * dh, dh)))
                print(compute, kind, "bwd v6 = v2:", bits, close, "twin", len(g["6"]) > n)
        M.MIXED_LN_BWD = "7"
        try:
            M.layernorm_backward_mixed(d, c)
            print("UNKNOWN RAN")
        except ValueError as e:
            print("ERR", e)
        M.MIXED_LN_BWD = "2"
        K.LN6_BLOCKS = 256
    """, "emu")
    for compute in ("bfloat16", "float16"):
        for kind in ("res", "drop"):
            assert f"{compute} {kind} 3 ran True kept 2" in out and f"{compute} {kind} 2 ran True kept 2" in out, out
            assert f"{compute} {kind} same bits: True" in out, out
    assert "ERR layernorm: REFBERT_MIXED_LN expected 2 or 3, got '4'" in out, out
    for compute in ("bfloat16", "float16"):
        for kind in ("ln", "res", "drop"):
            assert f"{compute} {kind} bwd 6 ran True" in out and f"{compute} {kind} bwd 2 ran True" in out, out
            assert f"{compute} {kind} bwd v6 = v2: True True twin {kind == 'drop'}" in out, out
    assert "ERR layernorm: REFBERT_MIXED_LN_BWD expected one of 2, 6, got '7'" in out, out


def test_mixed_bias_gelu_backward_version_2_is_version_1s_bits():
    """The mixed bias + GELU backward runs gelu.cu's version 1 by default and version 2 (a thread per (chunk, 4
    columns), 4 rows of loads at a time) under REFBERT_MIXED_GELU_BWD=2: dx, its twin and db the same bits either
    way (each column's rows added in row order by both; the emulator's g++ contracts nothing), with x read as
    float32 (twins off) and from the 16-bit storage the forward kept (twins on), in bf16 and fp16, erf and tanh; 389
    rows make chunks of 7 (4 rows at a time, then 3 alone). Where I % 4 != 0 version 2 hands the call to version 1's
    kernel (the same bits); what ran is asserted, and an unknown value is an error naming the variable."""
    out = _child("""
        import os
        import numpy as np
        from refbert import ops
        from refbert_kernels.cuda import backend as B, mixed as M, emulate as E
        r = np.random.default_rng(9)
        for I in (16, 6):
            for compute in ("bfloat16", "float16"):
                R_ = lambda t: ops.round_compute(np.asarray(t, np.float32), compute)
                x, d = (B.to_device(R_(2 * r.standard_normal((389, I)))) for _ in range(2))
                b = B.to_device(r.standard_normal(I).astype(np.float32))
                for twins in ("0", "1"):
                    os.environ["REFBERT_MIXED_TWINS"] = twins
                    for approximate in ("none", "tanh"):
                        o, c = M.bias_gelu_forward_mixed(x, b, approximate, compute)
                        got = {}
                        for v in ("1", "2"):
                            M.MIXED_GELU_BWD = v
                            E.COUNTS.reset()
                            dx, db = M.bias_gelu_backward_mixed(d, c)
                            names = [n for n in E.COUNTS.launches if n.startswith("bias_gelu_bwd_")]
                            tw = M.twin_of(dx, compute)
                            got[v] = [t.get().view(np.uint8) for t in (dx, db) + (() if tw is None else (tw,))]
                            print(I, compute, twins, approximate, v, "ran", names)
                        print(I, compute, twins, approximate, "same bits:", len(got["1"]) == len(got["2"]) and
                              all(np.array_equal(p, q) for p, q in zip(got["1"], got["2"])), "twin", len(got["1"]) == 3)
        M.MIXED_GELU_BWD = "3"
        try:
            M.bias_gelu_backward_mixed(d, c)
            print("UNKNOWN RAN")
        except ValueError as e:
            print("ERR", e)
        M.MIXED_GELU_BWD = "1"
    """, "emu")
    for I in (16, 6):
        for compute in ("bfloat16", "float16"):
            for twins in ("0", "1"):
                for approximate in ("none", "tanh"):
                    name = "erf" if approximate == "none" else "tanh"
                    head = f"{I} {compute} {twins} {approximate}"
                    assert f"{head} 1 ran ['bias_gelu_bwd_v1_{name}']" in out, out
                    assert f"{head} 2 ran ['bias_gelu_bwd_v{2 if I % 4 == 0 else 1}_{name}']" in out, out
                    assert f"{head} same bits: True twin {twins == '1'}" in out, out
    assert "ERR bias_gelu: REFBERT_MIXED_GELU_BWD expected one of 1, 2, got '3'" in out, out


def test_mixed_gelu_forward_version_3_is_version_1s_bits():
    """The mixed GELUs' forward runs gelu.cu's version 1 by default and version 3 (a grid-stride loop, the next groups
    prefetched into L2) under REFBERT_MIXED_GELU_FWD=3: out, its twin (bias + GELU's) and the 16-bit x the forward
    keeps for the backward the same bits either way, in bf16 and fp16, erf and tanh, twins on and off; 389 rows of
    I = 32 (float4 groups: 3112 of them, more than the emulator's grid of 8 blocks of 256 threads, so a thread's
    second group wraps its column) and of I = 6 (not float4 groups: version 1's kernel runs), x with -0s (without a
    bias both form u = x + 0: +0). What ran is asserted; an unknown value is an error naming the variable."""
    out = _child("""
        import os
        import numpy as np
        from refbert import ops
        from refbert_kernels.cuda import backend as B, mixed as M, emulate as E
        r = np.random.default_rng(10)
        for I in (32, 6):
            for compute in ("bfloat16", "float16"):
                R_ = lambda t: ops.round_compute(np.asarray(t, np.float32), compute)
                xh = R_(2 * r.standard_normal((389, I)))
                xh.reshape(-1)[3::7] = -0.0
                x = B.to_device(xh)
                b = B.to_device(r.standard_normal(I).astype(np.float32))
                for twins in ("0", "1"):
                    os.environ["REFBERT_MIXED_TWINS"] = twins
                    for approximate in ("none", "tanh"):
                        for op in ("gelu", "bias_gelu"):
                            got = {}
                            for v in ("1", "3"):
                                M.MIXED_GELU_FWD = v
                                E.COUNTS.reset()
                                if op == "gelu":
                                    o, c = M.gelu_forward_mixed(x, approximate, compute)
                                else:
                                    o, c = M.bias_gelu_forward_mixed(x, b, approximate, compute)
                                names = sorted(n for n in E.COUNTS.launches if n.startswith("gelu_fwd_"))
                                tw = M.twin_of(o, compute)
                                kept = c.cache.x2 if c.cache.x2.dtype == np.uint16 else None
                                got[v] = [t.get().view(np.uint8) for t in (o, tw, kept) if t is not None]
                                print(I, compute, twins, approximate, op, v, "ran", names, "parts", len(got[v]))
                            print(I, compute, twins, approximate, op, "same bits:",
                                  len(got["1"]) == len(got["3"]) and all(np.array_equal(p, q)
                                                                         for p, q in zip(got["1"], got["3"])))
        M.MIXED_GELU_FWD = "2"
        try:
            M.gelu_forward_mixed(x, "none", "bfloat16")
            print("UNKNOWN RAN")
        except ValueError as e:
            print("ERR", e)
        M.MIXED_GELU_FWD = "1"
    """, "emu")
    for I in (32, 6):
        for compute in ("bfloat16", "float16"):
            for twins in ("0", "1"):
                for approximate in ("none", "tanh"):
                    name = "erf" if approximate == "none" else "tanh"
                    for op in ("gelu", "bias_gelu"):
                        head = f"{I} {compute} {twins} {approximate} {op}"
                        v3 = 3 if (I * (389 if op == "gelu" else 1)) % 4 == 0 else 1   # (gelu: x flat, n = 389 I)
                        # out, and with twins on the 16-bit x kept (and bias + GELU's output twin)
                        parts = 1 + (twins == "1") * (2 if op == "bias_gelu" else 1)
                        assert f"{head} 1 ran ['gelu_fwd_v1_{name}'] parts {parts}" in out, (head, out)
                        assert f"{head} 3 ran ['gelu_fwd_v{v3}_{name}'] parts {parts}" in out, (head, out)
                        assert f"{head} same bits: True" in out, (head, out)
    assert "ERR gelu: REFBERT_MIXED_GELU_FWD expected one of 1, 3, got '2'" in out, out


_TWINS = """
    import os
    import numpy as np
    import refbert
    from refbert import BertConfig, ops
    from refbert.check import model_batch
    from refbert.model import to_numpy
    from refbert.philox import DropoutRNG
    from refbert_kernels.cuda import backend as B, mixed as M, emulate as E
    r = np.random.default_rng(5)
    for compute in ("bfloat16", "float16"):
        R_ = lambda a: ops.round_compute(np.asarray(a, np.float32), compute)
        x, a, d = (B.to_device(R_(r.standard_normal((6, 64)))) for _ in range(3))
        w, b = (B.to_device(r.standard_normal(64).astype(np.float32)) for _ in range(2))
        q, k, v, dq = (B.to_device(R_(r.standard_normal((1, 6, 64)))) for _ in range(4))
        ln, _ = M.layernorm_forward_mixed(x, w, b, compute=compute)
        res, _ = M.residual_layernorm_forward_mixed(x, a, w, b, compute=compute)
        drln, c2 = M.dropout_residual_layernorm_forward_mixed(x, a, w, b, 1e-12, 0.1, DropoutRNG(3), True, compute)
        _, da, _, _ = M.dropout_residual_layernorm_backward_mixed(d, c2)
        g, cg = M.bias_gelu_forward_mixed(x, w, compute=compute)
        dg, _ = M.bias_gelu_backward_mixed(d, cg)
        o, ca = M.attention_forward_s2(q, k, v, 2, None, 0.1, DropoutRNG(4), True, compute)
        grads = M.attention_backward_s2(dq, ca)
        o3, c3 = M.attention_forward_s3(q, k, v, 1, None, 0.1, DropoutRNG(5), True, compute)   # (head size 64)
        grads3 = M.attention_backward_s3(dq, c3)
        made = dict(ln=ln, res=res, drln=drln, da=da, bias_gelu=g, bias_gelu_dx=dg, attention=o, s3=o3,
                    **{f"attention_d{n}": t for n, t in zip("qkv", grads)},
                    **{f"s3_d{n}": t for n, t in zip("qkv", grads3)})
        for name, t in made.items():
            bits = M.twin_of(t, compute)
            assert bits is not None and M.twin_of(t, "float16" if compute == "bfloat16" else "bfloat16") is None, name
            want = M.operand(t, compute)[1]                  # round16's bits of the stored float32 values
            assert np.array_equal(np.asarray(bits).reshape(-1), np.asarray(want).reshape(-1)), (compute, name)
        E.COUNTS.reset()                                     # a linear reading a twin: no round16 pass for it, one
        lin, _ = M.linear_forward_mixed(ln, B.to_device(r.standard_normal((5, 64)).astype(np.float32)),  # for w
                                        B.to_device(r.standard_normal(5).astype(np.float32)), compute)
        assert sum(n for kn, n in E.COUNTS.launches.items() if kn.startswith("round16")) == 1, E.COUNTS.launches
        lin0, _ = M.linear_forward_mixed(ln, B.to_device(r.standard_normal((5, 64)).astype(np.float32)), None,
                                         compute)                # (no bias: its epilogue is round16)
        for name, t in (("linear", lin), ("linear, no bias", lin0)):    # the epilogue writes the output's twin
            bits = M.twin_of(t, compute)
            assert bits is not None and np.array_equal(np.asarray(bits).reshape(-1),
                                                       np.asarray(M.operand(t, compute)[1]).reshape(-1)), name
        print("TWINS OK", compute, len(made) + 2)
    cfg = BertConfig(vocab_size=60, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                     max_position_embeddings=16)
    batch = model_batch(cfg, "BertForPreTraining", B=2, T=8)      # (padding, two segments, -100 labels)
    runs = {}
    for on in ("1", "0"):
        os.environ["REFBERT_MIXED_TWINS"] = on
        m = refbert.BertForPreTraining(cfg, seed=4, backend="cuda", precision="bf16-mixed").train(True)
        E.COUNTS.reset()
        loss = float(m(**batch).loss)
        grads = to_numpy(m.backward())
        runs[on] = loss, grads, sum(n for kn, n in E.COUNTS.launches.items() if kn.startswith("round16"))
    assert runs["1"][0] == runs["0"][0], (runs["1"][0], runs["0"][0])
    for name in runs["0"][1]:
        assert np.array_equal(runs["1"][1][name], runs["0"][1][name]), name
    assert runs["1"][2] < runs["0"][2], (runs["1"][2], runs["0"][2])
    print("TWIN MODEL OK", f"round16 passes a step: {runs['1'][2]} with twins, {runs['0'][2]} without")
"""


def test_twins_are_round16_of_what_the_op_stored_and_replace_its_passes():
    """The mixed ops that write an activation a linear reads next (the K1 layernorms, bias + GELU and its backward,
    the layernorm backward's da, S2's and S3's outputs and input gradients) write its 16-bit bits beside it, in the same
    kernel: those bits equal round16's of the stored float32 values, for the compute dtype they were written in, and
    a linear takes them as its GEMM operand without a round16 pass. A bf16-mixed model step gives the same loss and
    gradients bit for bit with twins and without (REFBERT_MIXED_TWINS=0), with fewer round16 passes (emulator)."""
    out = _child(_TWINS, "emu")
    assert out.count("TWINS OK") == 2 and "TWIN MODEL OK" in out, out
    print(out.splitlines()[-1])



_KEPT = """
    import os, types
    import numpy as np
    import refbert
    from refbert import BertConfig, ops
    from refbert.check import model_batch

    def arrays(o, seen, out):
        # every array a forward's caches hold: through tuples, lists, dicts, objects and closures (loss_backward)
        if id(o) in seen or o is None or isinstance(o, (str, bytes, int, float, type, types.ModuleType)):
            return out
        seen.add(id(o))
        if isinstance(o, np.ndarray) or hasattr(o, "__cuda_array_interface__"):
            out.append(o)
        elif isinstance(o, (tuple, list)):
            for v in o:
                arrays(v, seen, out)
        elif isinstance(o, dict):
            for v in o.values():
                arrays(v, seen, out)
        elif isinstance(o, types.FunctionType):
            for c in o.__closure__ or ():
                arrays(c.cell_contents, seen, out)
        elif hasattr(o, "__dict__") and not type(o).__module__.startswith("numpy"):
            for v in vars(o).values():
                arrays(v, seen, out)
        return out

    L, Bn, T = 2, 2, 8
    cfg = BertConfig(vocab_size=96, hidden_size=64, num_hidden_layers=L, num_attention_heads=2, intermediate_size=128,
                     max_position_embeddings=16)
    batch = model_batch(cfg, "BertForPreTraining", B=Bn, T=T)
    held = {}
    for on in ("1", "0"):
        os.environ["REFBERT_MIXED_TWINS"] = on
        m = refbert.BertForPreTraining(cfg, seed=4, backend="cuda", precision="bf16-mixed").train(True)
        m(**batch)
        kept = arrays(m._cache, {id(p) for p in m.params.values()}, [])
        # the activations kept as float32: activation-sized (at least B T C elements), on the bfloat16 grid; the
        # cross-entropy's logits (last axis the vocabulary) aside: they stay float32 for now
        f32 = [a for a in kept if a.dtype == np.float32 and a.size >= Bn * T * cfg.hidden_size
               and a.shape[-1] != cfg.vocab_size
               and np.array_equal(ops.round_bfloat16(np.asarray(a)), np.asarray(a), equal_nan=True)]
        by_ptr = {}
        for a in kept:
            if a.size:
                ptr = a.__cuda_array_interface__["data"][0]
                by_ptr[ptr] = max(by_ptr.get(ptr, 0), a.nbytes)
        held[on] = sum(by_ptr.values()), len(f32)
    # twins on: none kept as float32. Off (the negative control: the walk finds them): per layer the attention's
    # output, both layernorms' x and a, the GELU's x: six float32 activations
    assert held["1"][1] == 0, held
    assert held["0"][1] >= 6 * L, held
    assert held["1"][0] < held["0"][0], held
    print("KEPT OK", f"the caches hold {held['1'][0]} bytes with 16-bit storage, {held['0'][0]} with float32")
"""


def test_what_a_mixed_forward_keeps_for_its_backward_is_16_bit_storage():
    """Issue 14 item 3's storage: what a bf16-mixed forward keeps for its backward (the layernorms' x and a, the
    GELU's x, the attention's output, the linears' x) is 16-bit storage (uint16 bits), not float32; with twins off
    (REFBERT_MIXED_TWINS=0) the same walk finds the six float32 activations a layer keeps otherwise, and the caches
    hold more bytes. The gradients are the same bits either way (the twins test above)."""
    out = _child(_KEPT, "emu")
    assert "KEPT OK" in out, out
    print(out.splitlines()[-1])
