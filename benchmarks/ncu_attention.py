"""One call of each flash attention version's forward and backward at one training shape, and nothing else: the
program benchmarks/gpu_all.sh's `ncu` step hands to Nsight Compute, which replays each kernel it matches to read
the hardware counters (tensor-pipe and shared-memory utilisation, bank conflicts, warp stall reasons, occupancy).
The bench times these kernels; this says where their time goes, which no timing here can (the next version of each
is designed from it).

    ncu --clock-control none -k regex:'^attn_' --section SpeedOfLight ... python benchmarks/ncu_attention.py
    python benchmarks/ncu_attention.py [--B 4 --H 12 --T 2048 --hs 64 --p 0.0 --versions C2 C5 C5b5 C5b7 C5b8 ...]

C5 runs its backward's default, attention_backward.cu version 6 (version 5's work in 168 registers); C5b5, C5b7 and
C5b8 are C5 with its backward's version 5, 7 or 8 (REFBERT_ATTN_BWD16: v5, the same work in 250 registers; v7, one
pass with dq by atomics; v8, version 7's pass with the per-score work cut), for the counters ncu reports beside
version 6's; C5b8 also runs the forward's version 6 (REFBERT_ATTN_FWD16: version 5 with the per-score work cut,
without dropout) where version 5 would run.
Each version runs in the dtype its fast kernels take (C2, C5: float16, tensor cores; C3, C4, C6: float32), on
kernels/cuda/attention.py's inputs (BERT's padding mask, p = 0 by default as the bench's timings), one forward and
one backward on its cache, the device synchronised after each; it prints the kernels each version ran
(versions.RAN is not involved: the launchers are called directly) and the output's checksum. On the emulator
(NUMBA_ENABLE_CUDASIM=1 REFBERT_CUDA_EMULATE=1, tiny shapes) it is the CI's check that this script runs.
"""
import argparse
import contextlib
import os

import numpy as np

PAIRS = {"C2": ("attention_forward_c2", "attention_backward_c2", np.float16),
         "C5": ("attention_forward_c5", "attention_backward_c5", np.float16),
         "C5b5": ("attention_forward_c5", "attention_backward_c5", np.float16),
         "C5b7": ("attention_forward_c5", "attention_backward_c5", np.float16),
         "C5b8": ("attention_forward_c5", "attention_backward_c5", np.float16),
         "C3": ("attention_forward_c3", "attention_backward_c3", np.float32),
         "C4": ("attention_forward_c3", "attention_backward_c4", np.float32),
         "C6": ("attention_forward_c6", "attention_backward_c4", np.float32)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--H", type=int, default=12)
    p.add_argument("--T", type=int, default=2048)
    p.add_argument("--hs", type=int, default=64)
    p.add_argument("--p", type=float, default=0.0, help="dropout probability (train mode)")
    # (C5b5 and C5b7 not by default: gpu_all.sh's ncu step has a minute, and their counters are in the H100 run's
    # ncu.txt; their place went to C5b8)
    p.add_argument("--versions", nargs="+", default=[v for v in PAIRS if v not in ("C5b5", "C5b7")],
                   choices=list(PAIRS))
    args = p.parse_args(argv)
    if os.environ.get("REFBERT_CUDA_EMULATE") == "1":
        from refbert_kernels.cuda.emulate import cupy as xp
    else:
        import cupy as xp
    from refbert.philox import DropoutRNG
    from refbert_kernels.cuda import attention as A
    from refbert_kernels.cuda import cuda_c as K
    from refbert_kernels.cuda import versions as VV
    shape = dict(B=args.B, T=args.T, H=args.H, hs=args.hs, mask="hf", p=args.p, train=True)
    inputs_h, kwargs_h = A.make_inputs(shape, np.float32, 0)
    ran = []
    real_kernel = K.kernel

    def recording(source, name, xp_=None):
        ran.append(name)
        return real_kernel(source, name, xp_)
    K.kernel = recording
    try:
        for v in args.versions:
            fwd, bwd, dt = PAIRS[v]
            with np.errstate(over="ignore"):      # float32's most negative mask value is -inf in float16: intended
                inputs = {k: xp.asarray(a.astype(dt)) for k, a in inputs_h.items()}
            kwargs = dict(kwargs_h, rng=DropoutRNG(1234))
            ran.clear()
            with VV.kernel_variant("REFBERT_ATTN_FWD16", "6") if v == "C5b8" else contextlib.nullcontext():
                out, cache = getattr(K, fwd)(**inputs, **kwargs)
            xp.cuda.Device().synchronize()
            dout = xp.asarray(np.random.default_rng(1).standard_normal(out.shape).astype(dt))
            with VV.kernel_variant("REFBERT_ATTN_BWD16", v[-1]) if v.startswith("C5b") else contextlib.nullcontext():
                dq, dk, dv = getattr(K, bwd)(dout, cache)
            xp.cuda.Device().synchronize()
            total = float(sum(float(xp.abs(a.astype(np.float32)).sum().get()) for a in (out, dq, dk, dv)))
            print(f"{v} {np.dtype(dt).name} B={args.B} H={args.H} T={args.T} hs={args.hs} p={args.p}: "
                  f"kernels {' '.join(dict.fromkeys(ran))}; sum |out, dq, dk, dv| {total:.6g}", flush=True)
            assert np.isfinite(total), v
    finally:
        K.kernel = real_kernel


if __name__ == "__main__":
    main()
