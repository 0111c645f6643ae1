"""The CUDA C versions and the cuda backend's device-side host logic, proven without a GPU: CuPy and the GPU
emulated on the CPU (refbert_kernels.cuda.emulate: device arrays that refuse host arrays and count every transfer;
the kernels of kernels/cuda/csrc/*.cu compiled by g++ under csrc/cpusim.cuh, each CUDA thread an OS thread, and
every launch checked against the kernel's C signature). Children run with REFBERT_CUDA_EMULATE=1 and
NUMBA_ENABLE_CUDASIM=1 (the Numba kernels in the simulator beside the emulated CUDA C ones).

1. every CUDA C version of every op (kernels/cuda/versions.py) against the oracle through its launcher, float32,
   on the op's GPU shapes (head sizes 32 and 64, rows past every warp and float4 tail, dropout, padding, ignored
   labels, segments of one id over many positions), and no call handed to the Numba version on the way;
2. the launch checks fail where a GPU would misread: a Python scalar, a wrong dtype, a host array, a strided view,
   too many threads, a wrong argument count;
3. one training step of BertForPreTraining (train mode, dropout 0.1, head size 64) on the cuda backend equals the
   numpy backend in float64 (tests/test_cuda_backend_sim.py's comparison), every op of the step ran a CUDA C
   version, and the step moved its inputs once: 4 host-to-device copies per forward (the staged batch, the MLM
   rows, the two label arrays), whatever the number of layers, none in the backward, and not one device-to-host
   read or synchronisation in either;
4. the value checks that would need a read back run with REFBERT_CUDA_CHECKS=1 only: without, a NaN logit gives a
   NaN loss and no read; with, the oracle's ValueError.
Needs g++ with C++20 and numba-cuda; ~1-2 min on 2 cores the first time (the kernels' CPU builds are cached).
"""
import functools
import importlib.util
import shutil
import textwrap

import pytest

import cudachild
from test_cuda_backend_sim import CASES_HS32, _COMPARE, assert_ran_cuda_c

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None, reason="needs numba-cuda"),
              pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (the CUDA C kernels on CPU threads)")]


def _env(code, checks=False):
    code = textwrap.dedent(code)
    prefix = "import os\nos.environ['REFBERT_CUDA_EMULATE'] = '1'\n"
    if checks:
        prefix += "os.environ['REFBERT_CUDA_CHECKS'] = '1'\n"
    return prefix + code


_run = functools.partial(cudachild.run, timeout=900)


def test_emu_every_cuda_c_version_matches_oracle():
    out = cudachild.check(_run(_env("""
        import warnings
        import numpy as np
        from refbert_kernels.cuda import backend as B, versions as VV, cuda_c as K, emulate as E
        assert B.MODE == "emu"
        # the GPU shapes, but attention's and the embedding's at sizes CPU threads run in seconds: head sizes 64 and
        # 32 with padding, -inf masks, dropout and T = 1; segments of one id across two chunks of 32, a padding row
        # (C3 has kernels for head size 64 only: a full causal mask (mask rows), 3 tiles, T % 4 != 0 (a Philox call
        # per element), one real token)
        hs64 = [dict(B=2, T=37, H=3, hs=64, mask="hf", p=0.2), dict(B=1, T=70, H=2, hs=64, mask="ninf", p=0.1),
                dict(B=1, T=1, H=1, hs=64, mask="hf")]
        own = {("attention", "C2"): hs64,
               ("attention", "C1"): [dict(B=2, T=37, H=3, hs=64, mask="hf", p=0.2),
                                     dict(B=1, T=70, H=2, hs=32, mask="ninf", p=0.1), dict(B=1, T=1, H=1, hs=64, mask="hf")],
               ("attention", "C3"): [dict(B=2, T=37, H=3, hs=64, mask="hf", p=0.2),
                                     dict(B=1, T=70, H=2, hs=64, mask="full"),
                                     dict(B=1, T=130, H=1, hs=64, mask="ninf", p=0.1),
                                     dict(B=1, T=1, H=1, hs=64, mask="hf")],
               # (C4: C3's forward, its one-pass backward: dq partials of 3 key tiles summed, a tile tail)
               ("attention", "C4"): [dict(B=2, T=37, H=3, hs=64, mask="hf", p=0.2),
                                     dict(B=1, T=130, H=1, hs=64, mask="ninf", p=0.1)],
               # (C6: C4 with the forward's double buffer refilled over 3 key tiles, and a mask with rows (not staged))
               ("attention", "C6"): [dict(B=1, T=130, H=1, hs=64, mask="ninf", p=0.1),
                                     dict(B=1, T=70, H=2, hs=64, mask="full")],
               ("embedding", "C1"): [dict(N=(2, 45), V=2, C=37), dict(N=(37,), V=30, C=52, pad=0),
                                     dict(N=(1,), V=1, C=1)]}
        for op, vs in VV.versions().items():
            for v in vs:
                if not v.cuda_c:
                    continue
                for dtype in [d for d in ("float32", "float16") if v.dtypes is None and d == "float32"
                              or v.dtypes is not None and d in v.dtypes]:
                    E.COUNTS.reset()
                    K.FELL_BACK.clear()
                    spec = VV.spec_of(op)
                    shapes = own.get((op, v.key)) or (spec.notes["gpu_shapes"] if spec else None)
                    if op == "attention" and dtype == "float16":
                        # (C1's float16 at hs = 32 on one real token, T = 70, reaches 1.03 of the 8-ulp bound: with
                        # one key every p is 1 and ds = dp - D cancels exactly, but D comes from the stored
                        # float16 out, so dk collects ~70 terms of half an ulp each where the reference is 0; the
                        # bound scales with |dk|, not with its terms. Measured 2026-11-26; the float16 runs take
                        # the head size 64 shapes the tensor-core kernels have, as on a GPU.)
                        shapes = hs64
                    worst, err = VV.validate(v, dtype, shapes)
                    assert err is None and worst <= 1, (op, v.key, dtype, worst, err)
                    assert not K.FELL_BACK, (op, v.key, K.FELL_BACK)      # the CUDA C path ran, not the Numba one
                    assert E.COUNTS.launched() > 0 and E.COUNTS.d2h == 0, (op, v.key, E.COUNTS)
                    print(f"OK {op} {v.key} {dtype} worst err/tol {worst:.3f}, kernels {sorted(E.COUNTS.launches)}")
        # C5 (attention_forward.cu v5 and v4, attention_backward.cu v6 by default) reorganises C2 (v3, v3): out, m,
        # 1/l and dq, dk, dv the same bits, with dropout at T % 4 == 0 (a Philox call per 4 keys shared by two
        # lanes, and in the backward per 4 scores) and not (a call per pair; per score), padding (whole key tiles
        # skipped) and a mask with query rows (read per score)
        from refbert_kernels.cuda.attention import DropoutRNG
        r = np.random.default_rng(5)
        for (Bn, T, H), mk in (((2, 132, 2), "pad"), ((1, 70, 2), "rows")):
            q, k, v = (E.cupy.asarray(r.standard_normal((Bn, T, H * 64)).astype(np.float16)) for _ in range(3))
            if mk == "pad":
                host = np.zeros((Bn, 1, 1, T), np.float16)
                host[1, ..., 75:] = -np.inf                       # (finfo(float16).min is above PAD_MIN)
            else:
                host = np.triu(np.full((T, T), -np.inf, np.float32), 1)[None, None].astype(np.float16)
            mask = E.cupy.asarray(host)
            ref = K.attention_forward_c2(q, k, v, H, mask, 0.1, DropoutRNG(9), True)
            dout = E.cupy.asarray(r.standard_normal((Bn, T, H * 64)).astype(np.float16))
            ref_d = K.attention_backward_c2(dout, ref[1])
            for rows, bwd in ((64, None), (128, "5"), (128, "6"), (128, "7"), (128, "8")):   # REFBERT_ATTN_BWD16
                E.COUNTS.reset()
                got = K.attention_forward_c5(q, k, v, H, mask, 0.1, DropoutRNG(9), True, rows=rows)
                K.ATTN_BWD16 = bwd or "6"
                with warnings.catch_warnings(record=True) as said:
                    warnings.simplefilter("always")
                    got_d = K.attention_backward_c5(dout, got[1]) if bwd else ref_d
                K.ATTN_BWD16 = "6"
                said = [str(w.message) for w in said if "version 8" in str(w.message)]
                assert said == ([] if bwd != "8" or mk == "pad" else      # (version 7's kernel, said once a case)
                                ["refbert cuda: attention C5's backward version 8 (REFBERT_ATTN_BWD16=8) does not take "
                                 "a mask that varies along the queries: version 7's kernel runs"]), said
                assert f"attn_fwd_v{5 if rows == 128 else 4}_f16_hs64" in E.COUNTS.launches, E.COUNTS.launches
                ran = {"5": {"attn_bwd_dkdv_v5_f16_hs64", "attn_bwd_dq_v5_f16_hs64"},
                       "6": {"attn_bwd_dkdv_v6_f16_hs64", "attn_bwd_dq_v6_f16_hs64"},
                       "7": {"attn_bwd_fused_v7_f16_hs64", "attn_bwd_dqcast_f16"},
                       # (version 8's dropout kernel under the padding mask at T % 4 == 0; version 7's under a mask
                       # that varies along the queries)
                       "8": {"attn_bwd_fused_v8d_f16_hs64" if mk == "pad" else "attn_bwd_fused_v7_f16_hs64",
                             "attn_bwd_dqcast_f16"}}.get(bwd, set())
                one_pass = bwd in ("7", "8")
                assert ran <= set(E.COUNTS.launches) and (not one_pass or not any(
                    n.startswith(("attn_bwd_dkdv", "attn_bwd_dq_")) for n in E.COUNTS.launches)), E.COUNTS.launches
                assert bwd != "8" or mk != "pad" or "attn_bwd_fused_v7_f16_hs64" not in E.COUNTS.launches
                same = ((ref[0], got[0]), (ref[1][6], got[1][6]), (ref[1][7], got[1][7]),
                        *zip(ref_d[1:] if one_pass else ref_d, got_d[1:] if one_pass else got_d))
                for a, b in same:
                    assert np.array_equal(a.get().view(np.uint16 if a.dtype == np.float16 else np.uint32),
                                          b.get().view(np.uint16 if b.dtype == np.float16 else np.uint32)), (T, bwd)
                if one_pass:
                    # versions 7 and 8's dq: the same products summed in another order (each key tile's share
                    # scaled and added in float32), then one rounding to float16: at most one float16 ulp from
                    # version 3's dq (2^-10 of the larger magnitude, 2^-24 for subnormals)
                    a, b = (x.get().astype(np.float64) for x in (ref_d[0], got_d[0]))
                    assert np.all(np.abs(a - b) <= 2.0 ** -10 * np.maximum(np.abs(a), np.abs(b)) + 2.0 ** -24), \
                        (T, np.max(np.abs(a - b)))
            if mk == "pad":     # version 8's kernel without dropout: version 7's dk, dv bits, dq within an ulp
                fwd = K.attention_forward_c5(q, k, v, H, mask, 0.0, None, True, rows=128)
                E.COUNTS.reset()                     # (and the forward's version 6 without dropout: version 5's bits)
                K.ATTN_FWD16 = "6"
                fwd6 = K.attention_forward_c5(q, k, v, H, mask, 0.0, None, True, rows=128)
                with warnings.catch_warnings(record=True) as said:  # (with dropout: version 5, said once)
                    warnings.simplefilter("always")
                    for _ in range(2):
                        K.attention_forward_c5(q, k, v, H, mask, 0.1, DropoutRNG(9), True, rows=128)
                K.ATTN_FWD16 = "5"
                said = [str(w.message) for w in said if "version 6" in str(w.message)]
                assert said == ["refbert cuda: attention C5's forward version 6 (REFBERT_ATTN_FWD16=6) does not take "
                                "dropout: version 5's kernel runs"], said
                assert set(E.COUNTS.launches) >= {"attn_fwd_v6_f16_hs64"}, E.COUNTS.launches
                for a, b in ((fwd[0], fwd6[0]), (fwd[1][6], fwd6[1][6]), (fwd[1][7], fwd6[1][7])):
                    assert np.array_equal(a.get().view(np.uint16 if a.dtype == np.float16 else np.uint32),
                                          b.get().view(np.uint16 if b.dtype == np.float16 else np.uint32)), "fwd v6"
                d = {}
                for bwd in ("7", "8"):
                    E.COUNTS.reset()
                    K.ATTN_BWD16 = bwd
                    d[bwd] = K.attention_backward_c5(dout, fwd[1])
                    K.ATTN_BWD16 = "6"
                    assert f"attn_bwd_fused_v{bwd}_f16_hs64" in E.COUNTS.launches, E.COUNTS.launches
                for a, b in zip(d["7"][1:], d["8"][1:]):
                    assert np.array_equal(a.get().view(np.uint16), b.get().view(np.uint16)), "no dropout"
                a, b = (x.get().astype(np.float64) for x in (d["7"][0], d["8"][0]))
                assert np.all(np.abs(a - b) <= 2.0 ** -10 * np.maximum(np.abs(a), np.abs(b)) + 2.0 ** -24), \
                    np.max(np.abs(a - b))
        print("C5 = C2 bit for bit (its backward's versions 5 and 6; version 7's and 8's dk, dv, their dq within an "
              "ulp; its forward's version 6 = 5 without dropout)")
        K.ATTN_BWD16 = "9"
        try:
            K.attention_backward_c5(dout, got[1])
            print("UNKNOWN RAN")
        except ValueError as e:
            print("ERR", e)
        K.ATTN_BWD16 = "6"
        # C6's forward (attention_f32.cu v5) moves C3's (v3) loads: out, m and 1/l the same bits (3 key tiles, padding,
        # dropout with T % 4 == 0)
        q, k, v = (E.cupy.asarray(r.standard_normal((2, 132, 128)).astype(np.float32)) for _ in range(3))
        host = np.zeros((2, 1, 1, 132), np.float32)
        host[1, ..., 70:] = np.finfo(np.float32).min
        ref = K.attention_forward_c3(q, k, v, 2, E.cupy.asarray(host), 0.1, DropoutRNG(4), True)
        got = K.attention_forward_c6(q, k, v, 2, E.cupy.asarray(host), 0.1, DropoutRNG(4), True)
        for a, b in ((ref[0], got[0]), (ref[1][6], got[1][6]), (ref[1][7], got[1][7])):
            assert np.array_equal(a.get().view(np.uint32), b.get().view(np.uint32))
        print("C6 forward = C3 forward bit for bit")
        # C4 over its dq partials' limit (C4_PARTS_MAX bytes; REFBERT_C4_PARTS_MB) runs C3's dq kernel instead,
        # saying so once a shape: C3's backward bit for bit (dk, dv too: C4's are C3's), no fused kernel launched
        import os
        import warnings
        cache = K.attention_forward_c3(q[:1, :70], k[:1, :70], v[:1, :70], 2, E.cupy.asarray(host[:1, ..., :70]),
                                       0.1, DropoutRNG(4), True)[1]
        dout = E.cupy.asarray(r.standard_normal((1, 70, 128)).astype(np.float32))
        ref_d = K.attention_backward_c3(dout, cache)
        E.COUNTS.reset()
        K.C4_PARTS_MAX = 0
        try:
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                got_d = [K.attention_backward_c4(dout, cache) for _ in range(2)]
        finally:
            K.C4_PARTS_MAX = None
        said = [str(w.message) for w in said if "REFBERT_C4_PARTS_MB" in str(w.message)]
        assert len(said) == 1 and "version 3's dq kernel" in said[0] and "one key tile over it" in said[0], said
        assert "attn_bwd_dq_v3_f32_hs64" in E.COUNTS.launches and "attn_bwd_dkdv_v6_f32_hs64" in E.COUNTS.launches \
            and not any(n.startswith("attn_bwd_fused") for n in E.COUNTS.launches), E.COUNTS.launches
        for got in got_d:
            for a, b in zip(ref_d, got):
                assert np.array_equal(a.get().view(np.uint32), b.get().view(np.uint32))
        os.environ["REFBERT_C4_PARTS_MB"] = "1.5"
        try:
            K.attention_backward_c4(dout, cache)
            raise AssertionError("REFBERT_C4_PARTS_MB=1.5 taken")
        except ValueError as e:
            assert "REFBERT_C4_PARTS_MB expected a whole number of MiB, got '1.5'" in str(e), e
        finally:
            del os.environ["REFBERT_C4_PARTS_MB"]
        print("C4 over its limit = C3 bit for bit, said once")
        # C4's backward kernels: version 6 (the default, REFBERT_F32_BWD) and version 4 the same bits, each having
        # launched its own fused kernel (at 3 key tiles, a padded one among them, dropout on)
        cache = K.attention_forward_c6(q, k, v, 2, E.cupy.asarray(host), 0.1, DropoutRNG(4), True)[1]
        dout = E.cupy.asarray(r.standard_normal((2, 132, 128)).astype(np.float32))
        both = {}
        for bwd in ("6", "4"):
            E.COUNTS.reset()
            K.F32_BWD = bwd
            try:
                both[bwd] = K.attention_backward_c4(dout, cache)
            finally:
                K.F32_BWD = "6"
            assert f"attn_bwd_fused_v{bwd}_f32_hs64" in E.COUNTS.launches, (bwd, E.COUNTS.launches)
        for a, b in zip(both["6"], both["4"]):
            assert np.array_equal(a.get().view(np.uint32), b.get().view(np.uint32))
        K.F32_BWD = "5"
        try:
            K.attention_backward_c4(dout, cache)
            print("UNKNOWN RAN")
        except ValueError as e:
            print("ERR", e)
        K.F32_BWD = "6"
        print("C4 backward v6 = v4 bit for bit")
        # C4 with room for 1 or 2 key tiles' dq partials (of 3) runs version 7, version 6 a group at a time with
        # dq's sum carried over: version 6's bits, its own kernels alone, nothing said; with REFBERT_F32_BWD=4
        # (version 4 has no groups) version 3's dq kernel runs, said
        tile = 2 * 2 * 132 * 64 * 4                                   # (B H T 64 floats: one key tile's partials)
        for G in (1, 2):
            E.COUNTS.reset()
            K.C4_PARTS_MAX = G * tile + tile // 2
            try:
                with warnings.catch_warnings(record=True) as said:
                    warnings.simplefilter("always")
                    got7 = K.attention_backward_c4(dout, cache)
            finally:
                K.C4_PARTS_MAX = None
            assert not [w for w in said if "REFBERT_C4_PARTS_MB" in str(w.message)], [str(w.message) for w in said]
            assert E.COUNTS.launches.get("attn_bwd_fused_v7_f32_hs64") == -(-3 // G) and \
                E.COUNTS.launches.get("attn_bwd_dqsum_v7_f32") == -(-3 // G) and \
                not any(n.startswith(("attn_bwd_fused_v6", "attn_bwd_dq_v3", "attn_bwd_dqsum_v4"))
                        for n in E.COUNTS.launches), (G, E.COUNTS.launches)
            for a, b in zip(both["6"], got7):
                assert np.array_equal(a.get().view(np.uint32), b.get().view(np.uint32)), G
        E.COUNTS.reset()
        K.C4_PARTS_MAX, K.F32_BWD = tile, "4"
        try:
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                K.attention_backward_c4(dout, cache)
        finally:
            K.C4_PARTS_MAX, K.F32_BWD = None, "6"
        said = [str(w.message) for w in said if "REFBERT_C4_PARTS_MB" in str(w.message)]
        assert len(said) == 1 and "version 4 has no groups" in said[0], said
        assert "attn_bwd_dq_v3_f32_hs64" in E.COUNTS.launches, E.COUNTS.launches
        print("C4 in groups (version 7) = version 6 bit for bit")
        # C4's backward version 8 (REFBERT_F32_BWD=8): without dropout under the (B, 1, 1, T) mask, version 6's bits
        # from its own kernel alone, all 3 key tiles at once and in groups of 1 and 2 (dq summed as version 6's and
        # 7's); with dropout, or a mask that varies along the queries, version 6's kernels, said once for each
        K._SAID.clear()
        plain = K.attention_forward_c6(q, k, v, 2, E.cupy.asarray(host), 0.0, None, True)[1]
        full = K.attention_forward_c6(q, k, v, 2, E.cupy.asarray(np.broadcast_to(host, (2, 1, 132, 132)).copy()),
                                      0.0, None, True)[1]
        ref = {name: K.attention_backward_c4(dout, c) for name, c in (("plain", plain), ("full", full))}
        ref["dropout"] = both["6"]
        K.F32_BWD = "8"
        try:
            for G in (None, 1, 2):
                E.COUNTS.reset()
                K.C4_PARTS_MAX = None if G is None else G * tile + tile // 2
                with warnings.catch_warnings(record=True) as said:
                    warnings.simplefilter("always")
                    got8 = K.attention_backward_c4(dout, plain)
                assert not said, [str(w.message) for w in said]
                assert E.COUNTS.launches.get("attn_bwd_fused_v8_f32_hs64") == (1 if G is None else -(-3 // G)) \
                    and not any(n.startswith(("attn_bwd_fused_v6", "attn_bwd_fused_v7")) for n in E.COUNTS.launches), \
                    (G, E.COUNTS.launches)
                for a, b in zip(ref["plain"], got8):
                    assert np.array_equal(a.get().view(np.uint32), b.get().view(np.uint32)), G
            K.C4_PARTS_MAX = None
            for name, c, why in (("dropout", cache, "dropout"), ("full", full, "a mask that varies along the queries")):
                for _ in range(2):                                    # (said the first time only)
                    E.COUNTS.reset()
                    with warnings.catch_warnings(record=True) as said:
                        warnings.simplefilter("always")
                        got = K.attention_backward_c4(dout, c)
                    said = [str(w.message) for w in said if "REFBERT_F32_BWD=8" in str(w.message)]
                    assert len(said) == (_ == 0) and all(f"does not take {why}: version 6's backward runs" in w
                                                         for w in said), said
                    assert "attn_bwd_fused_v6_f32_hs64" in E.COUNTS.launches and \
                        "attn_bwd_fused_v8_f32_hs64" not in E.COUNTS.launches, E.COUNTS.launches
                    for a, b in zip(ref[name], got):
                        assert np.array_equal(a.get().view(np.uint32), b.get().view(np.uint32)), name
        finally:
            K.F32_BWD, K.C4_PARTS_MAX = "6", None
        print("C4 backward version 8 = version 6 bit for bit")
        # the layernorms' C4 (layernorm.cu v6: dx and the dw, db partials in one pass) over a grid of 2 blocks, so
        # each warp takes 2-3 of the 37 rows (the grid stride and its tail): dx, da C2's bits (version 2's code per
        # row); dw, db the same terms in another order, so within twice the float32 rounding bound of a sum of R
        # terms of C2's: 2 R 2^-24 sum_rows |term| (the terms bounded by |g| sqrt(C), per column)
        xh, ah, gh = (r.standard_normal((37, 52)).astype(np.float32) for _ in range(3))
        wh, bh = r.standard_normal(52).astype(np.float32), r.standard_normal(52).astype(np.float32)
        x, a, g, w, b = (E.cupy.asarray(t) for t in (xh, ah, gh, wh, bh))
        K.LN6_BLOCKS = 2
        for op, args in (("layernorm", (x, w, b)), ("residual_layernorm", (x, a, w, b)),
                         ("dropout_residual_layernorm", (x, a, w, b, 1e-12, 0.2))):
            fwd = getattr(K, op + "_forward_c3")
            got, ref = {}, {}
            for key, bwd in (("C4", getattr(K, op + "_backward_c4")), ("C2", getattr(K, op + "_backward_c2"))):
                kw = dict(rng=DropoutRNG(3)) if op.startswith("dropout") else {}
                out, cache = fwd(*args, **kw)
                E.COUNTS.reset()
                (got if key == "C4" else ref)["g"] = [t.get() for t in bwd(g, cache)]
                if key == "C4":
                    kind = {"layernorm": "ln", "residual_layernorm": "res"}.get(op, "drop")
                    assert set(E.COUNTS.launches) >= {f"layernorm_bwd_fused_v6_{kind}_nv2", "column_sum2_v6"} \
                        and not any("dwdb" in n for n in E.COUNTS.launches), E.COUNTS.launches
            g4, g2 = got["g"], ref["g"]
            for t4, t2 in zip(g4[:-2], g2[:-2]):                     # dx (and da)
                assert np.array_equal(t4.view(np.uint32), t2.view(np.uint32)), op
            mag_w = np.abs(gh.astype(np.float64)).sum(0) * 10.0       # |g xhat| <= |g| |xhat|, |xhat| < sqrt(C) < 10
            mag_b = np.abs(gh.astype(np.float64)).sum(0)
            for t4, t2, mag in ((g4[-2], g2[-2], mag_w), (g4[-1], g2[-1], mag_b)):    # (each order's sum within
                assert np.all(np.abs(t4.astype(np.float64) - t2) <= 2 * 37 * 2.0 ** -24 * mag), op  # (R-1) u sum|t|)
        K.LN6_BLOCKS = 256
        print("layernorm C4 dx = C2 bit for bit, dw db within rounding")
        # gelu C2 / bias_gelu C3 (gelu.cu v3's forward: a grid of at most 8 blocks of 256 here, the emulator's one
        # SM, striding over the float4 groups) = C1 bit for bit: 2600 groups on 2048 threads (a thread's second
        # group's column wraps past I = 260), and 41 rows of I = 30 (not float4 groups, with the bias or without:
        # version 1's kernel); x holds -0s (without a bias both form u = x + 0: +0)
        rg = np.random.default_rng(11)
        for R, I in ((40, 260), (41, 30)):
            xh = (4 * rg.standard_normal((R, I))).astype(np.float32)
            xh.reshape(-1)[3::7] = -0.0
            x = E.cupy.asarray(xh)
            bias = E.cupy.asarray(rg.standard_normal(I).astype(np.float32))
            for approx in ("none", "tanh"):
                E.COUNTS.reset()
                pairs = ((K.gelu_forward_c1(x, approx)[0], K.gelu_forward_c2(x, approx)[0]),
                         (K.bias_gelu_forward_c1(x, bias, approx)[0], K.bias_gelu_forward_c3(x, bias, approx)[0]))
                for want, got in pairs:
                    assert np.array_equal(want.get().view(np.uint32), got.get().view(np.uint32)), (I, approx)
                name = "erf" if approx == "none" else "tanh"
                assert (f"gelu_fwd_v3_{name}" in E.COUNTS.launches) == (I % 4 == 0), (I, approx, E.COUNTS.launches)
        print("gelu C2 / bias_gelu C3 forward = C1 bit for bit")
    """)))
    # every CUDA C version of every op in float32, and attention C1 / C2 in float16 (their tensor-core kernels:
    # cpusim.cuh's mma.sync)
    assert out.count("OK ") == 29, out
    assert "gelu C2 / bias_gelu C3 forward = C1 bit for bit" in out, out
    for op, v in (("gelu", "C2"), ("bias_gelu", "C3")):      # version 3's forward ran (the specs' shapes: I % 4 == 0)
        line = next(x for x in out.splitlines() if x.startswith(f"OK {op} {v} "))
        assert "gelu_fwd_v3_erf" in line, line
    # bias_gelu C2: version 2's kernels where I % 4 == 0, version 1's where not (the specs' shapes hold both)
    line = next(x for x in out.splitlines() if x.startswith("OK bias_gelu C2 "))
    assert "bias_gelu_bwd_v2_erf" in line and "bias_gelu_bwd_v2_tanh" in line, line
    assert "layernorm C4 dx = C2 bit for bit, dw db within rounding" in out, out
    for kind, op in (("ln", "layernorm"), ("res", "residual_layernorm"), ("drop", "dropout_residual_layernorm")):
        line = next(x for x in out.splitlines() if x.startswith(f"OK {op} C4 "))    # the fused kernels ran (C = 52,
        assert f"layernorm_bwd_fused_v6_{kind}_nv2" in line and f"_{kind}_nv6" in line, line   # 768; C % 4: v2's)
    assert "OK attention C6 float32" in out and "attn_fwd_v5_f32_hs64" in out, out
    assert "OK attention C5 float16" in out and "attn_fwd_v5_f16_hs64" in out, out
    assert ("C5 = C2 bit for bit (its backward's versions 5 and 6; version 7's and 8's dk, dv, their dq within an "
            "ulp; its forward's version 6 = 5 without dropout)") in out, out
    assert "ERR attention C5: REFBERT_ATTN_BWD16 expected one of 5, 6, 7, 8, got '9'" in out, out
    assert "C6 forward = C3 forward bit for bit" in out, out
    assert "C4 over its limit = C3 bit for bit, said once" in out, out
    assert "C4 backward v6 = v4 bit for bit" in out, out
    assert "C4 in groups (version 7) = version 6 bit for bit" in out, out
    assert "C4 backward version 8 = version 6 bit for bit" in out, out
    assert "ERR attention C4: REFBERT_F32_BWD expected one of 4, 6, 8, got '5'" in out, out
    assert "OK attention C4 float32" in out and "attn_bwd_fused_v6_f32_hs64" in out and "attn_bwd_dqsum_v4_f32" in out, out
    assert "OK attention C2 float16" in out and "attn_bwd_dkdv_v3_f16_hs64" in out and "attn_fwd_v3_f16_hs64" in out, out
    for kind in ("ln", "res", "drop"):                    # C3's row-in-registers forward ran (C <= 1024, float4)
        assert f"layernorm_fwd_v3_{kind}" in out, out


def test_emu_cross_entropy_c2_split_rows_match_oracle():
    """cross_entropy C2 with its rows split across 2, 3 and 8 blocks (the emulator's one SM makes the launcher take
    version 1's kernel by itself): the oracle's loss and dlogits, ignored rows, a large logit, a NaN row made loud.
    Tolerance 1e-5 relative: float32 sums in another order and CUDA's expf / logf within 2 ulp. C3 (one launch,
    the last block finishing) at the same splits and at 1: C2's loss, count, m, s bit for bit, called twice in a row
    (its ticket counter back at 0 after each call), a NaN row loud as C2's."""
    out = cudachild.check(_run(_env("""
        import numpy as np
        from refbert import ops
        from refbert_kernels.cuda import backend as B, cuda_c as K, emulate as E
        r = np.random.default_rng(0)
        for N, V in ((5, 2053), (3, 4100), (1, 1031)):
            z = (r.standard_normal((N, V)) * 4).astype(np.float32)
            z[0, 7] = 1e4
            y = r.integers(0, V, N)
            y[1 % N] = -100 if N > 1 else y[0]
            ref, rc = ops.cross_entropy_forward(z, y)
            dref = ops.cross_entropy_backward(np.float32(1.0), rc)
            for splits in (2, 3, 8):
                E.COUNTS.reset()
                loss, cache = K.cross_entropy_forward_c2(B.to_device(z), y, splits=splits)
                assert "ce_part_v2" in E.COUNTS.launches and "ce_fin_v2" in E.COUNTS.launches, E.COUNTS.launches
                dz = K.cross_entropy_backward_c1(np.float32(1.0), cache).get()
                assert abs(float(loss) - float(ref)) <= 1e-5 * abs(float(ref)), (N, V, splits, float(loss), ref)
                assert np.abs(dz - dref).max() <= 1e-5 * np.abs(dref).max(), (N, V, splits)
                bits = lambda lc: [np.atleast_1d(t.get()).view(np.uint8)
                                   for t in (lc[0], lc[1].m, lc[1].s, lc[1].count)]
                for _ in range(2):
                    E.COUNTS.reset()
                    got = K.cross_entropy_forward_c3(B.to_device(z), y, splits=splits)
                    assert set(E.COUNTS.launches) == {"ce_fwd_v3"}, E.COUNTS.launches
                    assert all(np.array_equal(a, b) for a, b in zip(bits((loss, cache)), bits(got))), (N, V, splits)
                    assert int(K._ce_done(E.cupy).get()[0]) == 0
            got = K.cross_entropy_forward_c3(B.to_device(z), y, splits=1)     # (one block a row)
            assert abs(float(got[0]) - float(ref)) <= 1e-5 * abs(float(ref)), (N, V, float(got[0]), ref)
        z = r.standard_normal((4, 2048)).astype(np.float32)
        z[2, 1500] = np.nan
        loss, _ = K.cross_entropy_forward_c2(B.to_device(z), np.array([1, 2, 3, 4]), splits=4)
        assert np.isnan(float(loss))
        assert np.isnan(float(K.cross_entropy_forward_c3(B.to_device(z), np.array([1, 2, 3, 4]), splits=4)[0]))
        print("C2 OK")
    """)))
    assert "C2 OK" in out, out


def test_emu_layernorm_partials_versions_4_and_5_are_version_3s_bits():
    """REFBERT_LN_DWDB=4 / 5 (the dw, db partials with 4 / 8 rows' loads in flight) through the launchers: dx (da),
    dw, db the default's (version 3's) bits, at 577 rows (10 a chunk: full groups of 4 and of 8, and tails) for the
    plain, the residual and the dropout + residual kinds (each run from its own DropoutRNG at the same state: the
    same keep-mask); version 2's partials (a column a thread) too, since the emulator's g++ contracts nothing (the
    main compares version 3's partials with version 2's bit for bit on CPU threads); an unknown value is an error
    naming the variable."""
    out = cudachild.check(_run(_env("""
        import numpy as np
        from refbert.philox import DropoutRNG
        from refbert_kernels.cuda import backend as B, cuda_c as K, emulate as E
        rng = np.random.default_rng(0)
        R, C = 577, 12
        x, a, dout = (B.to_device(rng.standard_normal((R, C)).astype(np.float32)) for _ in range(3))
        w, b = (B.to_device(rng.standard_normal(C).astype(np.float32)) for _ in range(2))
        runs = {}
        for kind in ("ln", "res", "drop"):
            for v in ("3", "4", "5", "2"):
                K.LN_DWDB = v
                E.COUNTS.reset()
                if kind == "ln":
                    out_, cache = K.layernorm_forward_c3(x, w, b)
                    grads = K.layernorm_backward_c2(dout, cache)
                elif kind == "res":
                    out_, cache = K.residual_layernorm_forward_c3(x, a, w, b)
                    grads = K.residual_layernorm_backward_c2(dout, cache)
                else:
                    out_, cache = K.dropout_residual_layernorm_forward_c3(x, a, w, b, p=0.1, rng=DropoutRNG(7))
                    grads = K.dropout_residual_layernorm_backward_c2(dout, cache)
                runs[kind, v] = [t.get() for t in grads]
                print(kind, v, "ran", f"layernorm_bwd_dwdb_partial_v{v}_{kind}" in E.COUNTS.launches)
            for v in ("4", "5", "2"):
                same = all(np.array_equal(p.view(np.uint32), q.view(np.uint32))
                           for p, q in zip(runs[kind, v], runs[kind, "3"]))
                print(kind, v, "bits of 3:", same)
        K.LN_DWDB = "6"
        try:
            K.layernorm_backward_c2(dout, K.layernorm_forward_c3(x, w, b)[1])
            print("UNKNOWN RAN")
        except ValueError as e:
            print("ERR", e)
    """)))
    for kind in ("ln", "res", "drop"):
        assert all(f"{kind} {v} ran True" in out for v in "2345"), out      # (what each run meant to run, ran)
        assert all(f"{kind} {v} bits of 3: True" in out for v in "452"), out
    assert "ERR layernorm: REFBERT_LN_DWDB expected one of 2, 3, 4, 5, got '6'" in out, out


def test_emu_tanh_gelu_at_huge_x_takes_its_limits():
    """The CUDA kernels' tanh GELU where u^3 overflows float32 (|u| ~ 1e13 up) and past the branch at |u| = 1e4
    (where s (1 - s) is exactly 0): out = u or (-)0, du = 1 or 0, db their column sums, never NaN from inf * 0, for
    the CUDA C C1 launchers (gelu.cu on CPU threads) and the Numba CUDA versions (the simulator): the oracle's
    limits (tests/test_kernels_gelu.py holds the Numba CPU versions to the same)."""
    out = cudachild.check(_run(_env("""
        import numpy as np
        from refbert_kernels.cuda import backend as B, cuda_c as K, gelu as G
        x = np.array([[1e14, -1e14, 1e20, -1e20, 3e38, -3e38, 1e4, -1e4],
                      [2e4, -2e4, 1.5e13, -1.5e13, 1e30, -1e30, 3e5, -3e5]], np.float32)
        b = np.zeros(x.shape[-1], np.float32)
        want_out, want_du = np.where(x > 0, x, 0).astype(np.float32), (x > 0).astype(np.float32)
        runs = {"C1": (K.gelu_forward_c1, K.gelu_backward_c1, K.bias_gelu_forward_c1, K.bias_gelu_backward_c1),
                "1": (G.gelu_forward_v1, G.gelu_backward_v1, G.bias_gelu_forward_v1, G.bias_gelu_backward_v1),
                "2": (G.gelu_forward_v2, G.gelu_backward_v2, G.bias_gelu_forward_v2, G.bias_gelu_backward_v2)}
        for name, (gf, gb, bf, bb) in runs.items():
            dx_, bx_ = B.to_device(x), B.to_device(b)
            out1, c1 = gf(dx_, approximate="tanh")
            du1 = gb(B.to_device(np.ones_like(x)), c1)
            out2, c2 = bf(dx_, bx_, approximate="tanh")
            du2, db2 = bb(B.to_device(np.ones_like(x)), c2)
            got = [np.asarray(B.to_host(t)) for t in (out1, du1, out2, du2, db2)]
            ok = (all(np.array_equal(g, want_out) for g in got[0:3:2]) and all(np.array_equal(g, want_du)
                  for g in got[1:4:2]) and np.array_equal(got[4], want_du.sum(0)))
            print(name, "limits:", ok, "finite:", all(np.isfinite(g).all() for g in got))
    """)))
    for name in ("C1", "1", "2"):
        assert f"{name} limits: True finite: True" in out, out


def test_emu_launches_are_checked_as_a_gpu_takes_them():
    out = cudachild.check(_run(_env("""
        import numpy as np
        from refbert_kernels.cuda import emulate as E
        cp = E.cupy
        k = cp.RawModule(code=(E.CSRC / "colsum.cu").read_text()).get_function("colsum_partial_v1")
        x, parts = cp.ones((5, 7), np.float32), cp.empty((5, 7), np.float32)
        good = (x, np.int32(5), np.int32(7), np.int32(1), parts)
        k((1, 5), (256,), good)
        assert float(parts.sum()) == 35.0
        bad = {"Python int": ((x, 5, np.int32(7), np.int32(1), parts), TypeError),
               "wrong scalar type": ((x, np.int64(5), np.int32(7), np.int32(1), parts), TypeError),
               "wrong pointer dtype": ((x.astype(np.float64), *good[1:]), TypeError),
               "host array": ((np.ones((5, 7), np.float32), *good[1:]), TypeError),
               "strided view": ((cp.ones((5, 14), np.float32)[:, ::2], *good[1:]), ValueError),
               "too few arguments": (good[:4], TypeError)}
        for what, (args, err) in bad.items():
            try:
                k((1, 5), (256,), args)
            except err as e:
                print("OK", what, "->", e)
            else:
                raise SystemExit(f"{what}: accepted")
        for grid, block in (((1, 5), (512,)), ((1, 70000), (256,)), ((0, 5), (256,))):
            try:
                k(grid, block, good)
            except ValueError as e:
                print("OK launch", grid, block, "->", e)
            else:
                raise SystemExit(f"grid {grid} block {block}: accepted")
        try:
            x + np.ones(7, np.float32)                    # a host array in a device operation
        except TypeError:
            print("OK mixing")
        # a Python float for a `float` parameter: CuPy would pass a double (8 bytes) the kernel reads as a float
        drop = cp.RawModule(code=(E.CSRC / "dropout.cu").read_text()).get_function("dropout_v1")
        xs, out = cp.ones(8, np.float32), cp.empty(8, np.float32)
        args = [xs, np.int64(8), np.uint64(1), np.uint64(2), np.uint64(0), np.float32(1.0), np.int32(0), out]
        drop((1,), (256,), tuple(args))
        args[5] = 1.0
        try:
            drop((1,), (256,), tuple(args))
        except TypeError as e:
            print("OK Python float ->", e)
    """)))
    assert out.count("OK ") == 11 and "OK Python float" in out, out


_COUNT = """
import numpy as np, refbert
from refbert.check import model_batch, tiny_config
from refbert_kernels.cuda import emulate as E
for L in (1, 2):
    cfg = tiny_config("BertForPreTraining", num_hidden_layers=L, hidden_size=128, num_attention_heads=2,
                      intermediate_size=96)
    m = refbert.BertForPreTraining(cfg, seed=1, backend="cuda").train(True)
    x = model_batch(cfg, "BertForPreTraining", B=2, T=8)
    m(**x)                                               # a first step: versions chosen, kernels built
    m.backward()
    E.COUNTS.reset()
    out = m(**x)
    f = (E.COUNTS.h2d, E.COUNTS.d2h, E.COUNTS.syncs, E.COUNTS.launched(), [e[1] for e in E.COUNTS.events])
    E.COUNTS.reset()
    g = m.backward()
    b = (E.COUNTS.h2d, E.COUNTS.d2h, E.COUNTS.syncs, E.COUNTS.launched(), [e[1] for e in E.COUNTS.events])
    assert isinstance(out.loss, E.DevArray) and out.loss.ndim == 0, type(out.loss)   # the loss stays on the device
    print(f"COUNT L={L} forward h2d={f[0]} d2h={f[1]} syncs={f[2]} launches={f[3]} | backward h2d={b[0]} "
          f"d2h={b[1]} syncs={b[2]} launches={b[3]}")
    print("  forward:", f[4], " backward:", b[4])
"""


def test_emu_training_step_equals_numpy_runs_cuda_c_and_moves_its_inputs_once():
    # head size 64: the attention runs its register-tiled fp32 flash (C6, first in the built-in order: C4's one-pass
    # backward, the forward's loads pipelined)
    cases = CASES_HS32.replace("CASES = [", "HS64 = dict(hidden_size=128, num_attention_heads=2, intermediate_size=96)\n"
                                             "CASES = [(\"BertForPreTraining\", np.float32, HS64)]\n_unused = [")
    out = cudachild.check(_run(_env(cases + _COMPARE + _COUNT)))
    assert out.count("OK ") == 1, out
    assert_ran_cuda_c(out)
    assert "('attention', 'float32', 'C6')" in out, out              # the register-tiled flash ran
    counts = {}
    for line in out.splitlines():
        if line.startswith("COUNT"):
            fwd, bwd = line.split("|")
            counts[line.split()[1][2:]] = dict(w.split("=") for w in fwd.split() if "=" in w)
            assert "h2d=0" in bwd and "d2h=0" in bwd and "syncs=0" in bwd, line      # nothing crosses in a backward
            assert "d2h=0" in fwd and "syncs=0" in fwd, line                        # the forward reads nothing back
    # the forward's copies: the staged batch (ids, token types, positions, mask and the ids' sorted orders in one),
    # the MLM rows, the MLM labels, the NSP labels: 4 whatever the depth (were L + 10)
    assert counts["1"]["h2d"] == counts["2"]["h2d"] == "4", out
    assert int(counts["2"]["launches"]) > int(counts["1"]["launches"]), out


def test_emu_value_checks_need_refbert_cuda_checks():
    code = """
        import numpy as np
        from refbert_kernels.cuda import backend as B, emulate as E
        z = np.zeros((3, 5), np.float32)
        z[1, 2] = np.nan
        E.COUNTS.reset()
        try:
            loss, _ = B.cross_entropy_forward(B.to_device(z), np.array([1, 2, -100]))
            print("LOSS", float(loss), "reads before float()", E.COUNTS.d2h - 1)
        except ValueError as e:
            print("ERR", e)
    """
    plain = cudachild.check(_run(_env(code)))
    assert "LOSS nan reads before float() 0" in plain, plain
    strict = cudachild.check(_run(_env(code, checks=True)))
    assert "ERR cross_entropy: argument 'logits' expected finite rows" in strict, strict


def test_emu_bench_backward_ab_rows():
    """The bench's A/B rows of a version's backward kernels (bench_cuda.ab_backward) run on the emulator through
    the launchers, each seeing its own kernels launched (a row whose kernels did not run is a FAIL row): C5's
    versions 5, 7 and 8 beside its default, 6, and its forward's version 6 beside 5 (float16 is not the emulator's
    to validate, so their err/tol here is of nothing; the GPU run's is real: 0.88 on the H100; at this shape the
    forward's grid takes 64 rows a block, version 4, the row's second kernel set), and C6's versions 4 and 8 beside
    its default, 6, validated here in float32 against the oracle, also where C4's dq partials do not fit (version
    3's dk, dv kernel then runs for version 4, as at T=2048 on the H200 at b87c638, where the row failed by naming
    only the fused kernels; version 8 runs the default's kernels there, so its row fails rather than time them
    under its name). The variables are put back after the rows. A kernel name no file defines is refused."""
    code = """
        import numpy as np
        from refbert import bench_cuda as BC
        from refbert.model import get_backend
        from refbert_kernels.cuda import cuda_c as K
        get_backend("cuda")
        spec = BC.with_cuda_c(BC.kernel_specs(["attention"])[0][0][1])
        try:                                               # --kernels with a typo: refused, naming it
            BC.kernel_specs(["attentoin"])
        except ValueError as e:
            assert "argument --kernels expected names among" in str(e) and "'attentoin'" in str(e), e
        else:
            raise AssertionError("bench_cuda.kernel_specs took a kernel name no file defines")
        inputs_h, kwargs_h = spec.make_inputs(dict(spec.bench_shape, B=1, H=1, hs=64, T=70), np.float32, 0)
        for version, dt, parts in (("C5", np.float16, None), ("C6", np.float32, None), ("C6", np.float32, 0)):
            K.C4_PARTS_MAX = parts                        # (0: C4's dq partials never fit, as at T=2048 B=8)
            inputs, kwargs = BC._on_gpu(inputs_h, kwargs_h, dt)
            rows = []
            for side in ("backward", "forward") if version == "C5" else ("backward",):
                BC.ab_backward(rows, lambda impl, *t, note="": rows.append(dict(impl=impl, note=note)), BC.Timer(1),
                               spec, version, dt, inputs, kwargs, {}, side=side)
            for r in rows:
                print("ROW", r["impl"], "|", r.get("status"), "|", r["note"])
        print("DEFAULTS", K.ATTN_BWD16, K.F32_BWD)
    """
    out = cudachild.check(_run(_env(code)))
    rows = [line for line in out.splitlines() if line.startswith("ROW")]
    assert [r.split(" | ")[0] for r in rows] == ["ROW vC5 (backward v5)", "ROW vC5 (backward v7)",
                                                 "ROW vC5 (backward v8)", "ROW vC5 (forward v6)",
                                                 "ROW vC6 (backward v4)", "ROW vC6 (backward v8)",
                                                 "ROW vC6 (backward v4)", "ROW vC6 (backward v8)"], out
    assert all(" | None | C5 with its backward's version" in r for r in rows[:3]), out
    assert " | None | C5 with its forward's version 6" in rows[3], out
    for r, v in zip(rows[4:7], "484"):                                                 # (validated: err/tol < 1)
        assert f" | None | C6 with its backward's version {v} (err/tol 0." in r, out
    # where not one key tile's partials fit, version 8 runs the default's kernels: its row fails, naming them
    assert " | FAIL | FAIL: version 8's kernels did not run (" in rows[7] and "attn_bwd_dq_v3_f32_hs64" in rows[7], out
    assert "DEFAULTS 6 6" in out, out


def test_emu_bench_step_section_runs_end_to_end(tmp_path):
    """refbert bench --device cuda's step section (both decoders, the GEMM floor, memory, the launch probe with the
    step's own arguments), its mixed-precision and its optimizer sections run on the emulator: a tooling check of
    the code the GPU run will execute (its times mean nothing here). Every CUDA C kernel of the step shows in the
    launch probe. (The tiny config has base's head size, 64: the step runs the attention kernels base does, C6's, and
    the mixed section's S3 / S4 rows their flash kernels.)"""
    import json
    code = f"""
        import sys
        from refbert import bench_cuda as BC
        sys.exit(BC.main(["--config", "tiny", "--no-torch", "--only", "step", "mixed", "optim", "--step", "2x8",
                          "--repeats", "1", "--no-plot", "--out", {str(tmp_path)!r}]))
    """
    out = cudachild.check(_run(_env(code)))
    mixed = json.loads((tmp_path / "cuda_mixed.json").read_text())["rows"]
    assert [r["impl"] for r in mixed] == [f"refbert cuda {p}-mixed (all){g}" for p in ("bf16", "fp16")
                                          for g in ("", " + CUDA graph") + ((", no twins + CUDA graph",
                                                                              ", attention S3 + CUDA graph",
                                                                              ", attention S4 + CUDA graph",
                                                                              ", layernorm forward v2 + CUDA graph",
                                                                              ", layernorm backward v6 + CUDA graph",
                                                                              ", bias_gelu backward v2 + CUDA graph",
                                                                              ", GELU forward v3 + CUDA graph")
                                                                             if p == "bf16" else ())], mixed
    # (the layernorm A/B row ran version 2's forwards alone: the default, version 3, did not run in it)
    ab = next(r for r in mixed if r["impl"].endswith("layernorm forward v2 + CUDA graph"))
    assert ab["layernorm_v2_ran"] and "layernorm_fwd_v2_drop" in ab["note"] and "v3" not in ab["note"], ab
    ab = next(r for r in mixed if r["impl"].endswith("layernorm backward v6 + CUDA graph"))   # (v6's, not v2's)
    assert ab["layernorm_bwd_v6_ran"] and "layernorm_bwd_fused_v6_drop_nv2" in ab["note"], ab
    assert "_v2_" not in ab["note"], ab
    ab = next(r for r in mixed if r["impl"].endswith("bias_gelu backward v2 + CUDA graph"))  # (v2's, not v1's)
    assert ab["bias_gelu_bwd_v2_ran"] and "bias_gelu_bwd_v2_erf" in ab["note"] and "_v1_" not in ab["note"], ab
    ab = next(r for r in mixed if r["impl"].endswith("GELU forward v3 + CUDA graph"))          # (v3's, not v1's)
    assert ab["gelu_fwd_v3_ran"] and "gelu_fwd_v3_erf" in ab["note"] and "_v1_" not in ab["note"], ab
    # (the A/B rows' attention ran as asked: the tiny config's head size is 64, as base's)
    assert all(r["note"].startswith(f"attention {a} ran;") for r in mixed for a in ("S3", "S4")
               if r["impl"].endswith(f"attention {a} + CUDA graph")), mixed
    assert all(r["ms"] > 0 and ("eval loss" in r["note"] or "replay = eager step within 0.0e+00" in r["note"])
               for r in mixed), mixed
    assert all("held_mb" in r for r in mixed if r["impl"].endswith(("(all)", "no twins + CUDA graph"))), mixed
    data = json.loads((tmp_path / "cuda_step.json").read_text())
    impls = [r["impl"] for r in data["rows"]]
    assert {"refbert cuda fp32 (all)", "refbert cuda fp32 (labelled)", "refbert cuda fp32 (all) + CUDA graph",
            "refbert cuda fp32 (all), adds unfused"} <= set(impls), impls
    graph = next(r for r in data["rows"] if r["impl"].endswith("CUDA graph"))
    assert graph["ms"] > 0 and "replay = eager step within 0.0e+00" in graph["note"], graph
    for r in data["rows"]:
        if r["impl"].startswith("refbert"):
            assert r["ms"] > 0 and r["floor_ms"] > 0 and r["gemm_tflop"] > 0, r
    assert not any(r["impl"] == "FALLBACK" for r in data["rows"]), data["rows"]
    versions = next(r for r in data["rows"] if r["impl"] == "versions")
    assert versions["note"].endswith("; launch v2 (packed parameters)"), versions     # how the kernels were launched
    kernels = {r["kernel"] for r in data["launch"]}
    assert {"ce_fwd_v1", "ce_loss_v1", "ce_bwd_v1", "emb_bwd_runs_v1", "emb_bwd_segments_v1", "layernorm_fwd_v3_drop",
            "layernorm_bwd_fused_v6_drop_nv2", "column_sum2_v6", "gelu_fwd_v1_erf", "bias_gelu_bwd_v1_erf",
            "dropout_v1", "colsum_partial_v1",
            "attn_fwd_v5_f32_hs64", "attn_bwd_fused_v6_f32_hs64"} <= kernels, sorted(kernels)
    # each kernel replayed as the model launches it (version 2, packed parameters) and through CuPy's RawKernel call
    assert all(r["launch"] == "v2 packed" and r["host_us"] > 0 and r["rawkernel_us"] > 0 for r in data["launch"]), \
        data["launch"]
    optim = json.loads((tmp_path / "cuda_optim.json").read_text())["rows"]     # the optimizer section
    assert [r["impl"] for r in optim] == ["check", "refbert multi-tensor kernels (optim.cu v1)",
                                          "refbert per-array code"], optim
    assert "bit for bit: yes" in optim[0]["note"] and "multi-tensor kernels" in optim[1]["note"], optim
    assert optim[2]["note"].endswith("(REFBERT_FUSED_OPTIM=0)") and all(r["ms"] > 0 for r in optim[1:]), optim
    # where the run's time went (Spent), rewritten into cuda_probes at the end: every section that ran, in order,
    # and the CUDA C modules the step made (on the emulator: its CPU libraries, built or loaded) counted in the
    # section that made them; the one-line summary last but for the "wrote" lines
    sections = json.loads((tmp_path / "cuda_probes.json").read_text())["sections"]
    assert [r["section"] for r in sections] == ["setup", "probes", "step", "mixed", "optim", "launch probe"], sections
    assert all(r["s"] >= 0 for r in sections) and sum(r["cuda_c_files"] for r in sections) > 0, sections
    assert next(r for r in sections if r["section"] == "step")["cuda_c_files"] > 0, sections
    summary = [line for line in out.splitlines() if not line.startswith("wrote ")][-1]
    assert summary.startswith("bench sections: setup ") and ", launch probe " in summary, summary
    assert "Where this run's wall time went" in (tmp_path / "cuda_probes.md").read_text()
    assert "wrote" in out


def test_emu_ncu_attention_driver_runs():
    """benchmarks/ncu_attention.py (what gpu_all.sh's ncu step hands Nsight Compute) runs every flash version's
    forward and backward through the launchers, at a tiny shape on the emulator: the kernels it names are the fast
    ones of each version (so the profile is of what the bench times), every output finite."""
    code = """
        import runpy, sys
        sys.argv = ["ncu_attention.py", "--B", "1", "--H", "1", "--T", "40"]
        runpy.run_path("benchmarks/ncu_attention.py", run_name="__main__")
    """
    import re
    out = cudachild.check(_run(_env(code)))
    # (C5's forward is version 5 where its grid fills the SMs twice, else version 4: here 4)
    for version, kernels in (("C2", "attn_fwd_v3_f16_hs64 attn_bwd_D_f16 attn_bwd_dkdv_v3_f16_hs64 attn_bwd_dq_v3"),
                             ("C5", "attn_fwd_v[45]_f16_hs64 attn_bwd_D_f16 attn_bwd_dkdv_v6_f16_hs64 attn_bwd_dq_v6"),
                             ("C5b8", "attn_fwd_v[456]_f16_hs64 attn_bwd_D_f16 attn_bwd_fused_v8_f16_hs64 "
                                      "attn_bwd_dqcast_f16"),
                             ("C4", "attn_fwd_v3_f32_hs64 attn_bwd_D_v3_f32 attn_bwd_fused_v6_f32_hs64"),
                             ("C6", "attn_fwd_v5_f32_hs64 attn_bwd_D_v3_f32 attn_bwd_fused_v6_f32_hs64")):
        assert re.search(rf"^{version} \w+ B=1 .*kernels {kernels}.*\|out, dq, dk, dv\| \d", out, re.M), (version, out)
