"""Host time of one eager training step on the cuda backend, measured without a GPU: refbert's own Python per launch.

On the H200 (benchmarks/results/cuda-nvidia-h200/2026-11-27/cuda_mixed.md) the eager bf16-mixed step took 60.1 ms at
B=32 T=128 with the GPU busy 18 ms of it: host-bound, about 60 us of host time per launch. Part of that is CuPy's
and cuBLAS's own launch cost, part is refbert's Python around each launch (its checks, the mixed rule's marks and
twins, imports inside functions, array-module lookups). This script measures the second part on any machine:

    NUMBA_ENABLE_CUDASIM=1 REFBERT_CUDA_EMULATE=1 python benchmarks/host_overhead.py [--layers 2] [--repeats 20]

It builds BertForPreTraining (tiny widths, so the arrays cost nothing) on backend="cuda" over the emulated CuPy
(kernels/cuda/emulate.py), runs two real steps (versions chosen, kernels built), then replaces every kernel launch
by a counter and times forward + backward (fp32 and bf16-mixed): no device work is left, only the host code. The
launch call itself is what the counter replaces, in either launch version (kernels/cuda/cuda_c.py: CuPy's RawKernel
call, or version 2's packing and cuLaunchKernel): the bench's launch probe times that on a GPU. The
step reads nothing back from the device (tests/test_cuda_emu.py asserts it), so values cannot change its path.
cProfile then splits one step's time by where the code lives: refbert and refbert_kernels (ours), the emulated
CuPy and NumPy (stand-ins for CuPy's own cost, which on a GPU is CuPy's C code instead), import statements run
inside functions. Timings are this machine's; the calls per launch are the machine-independent part.

--optimizer adds a second table: what one optimizer step (clip_grad_norm to 1, then AdamW.step, as pretrain runs
them) asks of the device for a model of --layers layers (the tensor count of BERT at that depth; tiny widths),
counted on the emulator: operations on device arrays through NumPy's functions (each one CuPy kernel on a GPU:
an element-wise op or a reduction), CUDA C launches, reads back to the host (each a synchronisation) and copies to
the device, for refbert.optim's per-array code (REFBERT_FUSED_OPTIM=0) and its multi-tensor kernels
(csrc/optim.cu). These counts depend on the code alone, not on the machine.
"""
import argparse
import cProfile
import os
import pstats
import sys
import time
from collections import Counter


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16-mixed"])
    p.add_argument("--optimizer", action="store_true", help="also count one optimizer step's device work")
    args = p.parse_args(argv)
    if os.environ.get("REFBERT_CUDA_EMULATE") != "1" or os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        sys.exit("host_overhead.py: run with NUMBA_ENABLE_CUDASIM=1 REFBERT_CUDA_EMULATE=1 (the emulated CuPy)")
    import refbert
    from refbert.check import model_batch, tiny_config
    from refbert_kernels.cuda import blas as BL
    from refbert_kernels.cuda import emulate as E

    print("| precision | layers | host ms / step | launches / step (kernels + GEMMs) | us / launch | Python calls "
          "/ launch | ours: refbert + refbert_kernels | emulated CuPy + NumPy | imports in functions |")
    print("|---|---|---|---|---|---|---|---|---|")
    from refbert_kernels.cuda import cuda_c as K
    real_call, real = E.RawKernel.__call__, {n: getattr(BL, n) for n in ("gemm", "gemm_batched")}
    real_packed = K.Packed.__call__
    for prec in args.precisions:
        cfg = tiny_config("BertForPreTraining", num_hidden_layers=args.layers, hidden_size=128,
                          num_attention_heads=2, intermediate_size=96)
        m = refbert.BertForPreTraining(cfg, seed=1, backend="cuda", precision=prec).train(True)
        x = model_batch(cfg, "BertForPreTraining", B=2, T=8)
        E.RawKernel.__call__, K.Packed.__call__ = real_call, real_packed
        for n, f in real.items():
            setattr(BL, n, f)
        for _ in range(2):                                   # real steps first: versions chosen, kernels built
            m(**x)
            m.backward()
        count = [0]

        def stub(self, grid, block, args, shared_mem=0, stream=None):
            count[0] += 1
        E.RawKernel.__call__ = K.Packed.__call__ = stub          # (launch version 1 or 2: the call replaced)
        for n, f in real.items():                            # (the GEMM still runs: a tiny NumPy matmul)
            def counted(*a, _f=f, **k):
                count[0] += 1
                return _f(*a, **k)
            setattr(BL, n, counted)

        def step():
            m(**x)
            m.backward()
        step()
        count[0] = 0
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            step()
        dt = (time.perf_counter() - t0) / args.repeats
        launches = count[0] / args.repeats
        prof = cProfile.Profile()
        prof.enable()
        step()
        prof.disable()
        calls, where = 0, Counter()
        for (fn, _, name), (_, nc, tt, _, _) in pstats.Stats(prof).stats.items():
            calls += nc
            if "emulate.py" in fn or "numpy" in fn:
                where["emu"] += tt
            elif "importlib" in fn or name in ("<method 'rpartition' of 'str' objects>",):
                where["import"] += tt
            elif "refbert" in fn:
                where["ours"] += tt
            else:
                where["other"] += tt
        total = sum(where.values())
        share = {k: f"{100 * v / total:.0f}%" for k, v in where.items()}
        print(f"| {prec} | {args.layers} | {dt * 1e3:.2f} | {launches:.0f} | {dt / launches * 1e6:.1f} | "
              f"{calls / launches:.0f} | {share.get('ours', '0%')} | {share.get('emu', '0%')} | "
              f"{share.get('import', '0%')} |", flush=True)
    E.RawKernel.__call__, K.Packed.__call__ = real_call, real_packed
    for n, f in real.items():
        setattr(BL, n, f)
    if args.optimizer:
        optimizer_counts(args.layers)


def optimizer_counts(layers):
    """Print the --optimizer table (module docstring)."""
    import numpy as np
    import refbert
    from refbert import optim
    from refbert.check import tiny_config
    from refbert_kernels.cuda import emulate as E
    cfg = tiny_config("BertForPreTraining", num_hidden_layers=layers, hidden_size=128, num_attention_heads=2,
                      intermediate_size=96)
    host = refbert.BertForPreTraining(cfg, seed=1).parameters()
    rng = np.random.default_rng(0)
    grads_h = {k: rng.standard_normal(a.shape).astype(np.float32) for k, a in host.items()}
    ops = [0]
    real = {n: getattr(E.DevArray, n) for n in ("__array_ufunc__", "__array_function__")}

    def counting(name):
        def f(self, *a, **k):
            ops[0] += 1
            return real[name](self, *a, **k)
        return f
    print()
    print(f"| optimizer step (clip to 1 + AdamW), {len(host)} tensors | device operations (NumPy functions: a CuPy "
          "kernel each) | CUDA C launches | reads to the host | copies to the device |")
    print("|---|---|---|---|---|")
    try:
        for name in real:
            setattr(E.DevArray, name, counting(name))
        for fused in ("0", "1"):
            os.environ[optim.FUSED_ENV] = fused
            params = {k: E.cupy.asarray(a) for k, a in host.items()}
            opt = optim.AdamW(params, lr=1e-4)
            for _ in range(2):                      # the second step: tables and kernels built by the first
                grads = {k: E.cupy.asarray(g) for k, g in grads_h.items()}   # new arrays, as a backward makes
                ops[0] = 0
                E.COUNTS.reset()
                norm = optim.clip_grad_norm(grads, 1.0)
                opt.step(grads, lr=1e-4)
                assert norm > 1.0                   # (the clipping scaled the gradients)
            print(f"| {optim.LAST_PATH['AdamW.step']} | {ops[0]} | {E.COUNTS.launched()} | {E.COUNTS.d2h} | "
                  f"{E.COUNTS.h2d} |", flush=True)
    finally:
        for name, f in real.items():
            setattr(E.DevArray, name, f)
        os.environ.pop(optim.FUSED_ENV, None)


if __name__ == "__main__":
    main()
