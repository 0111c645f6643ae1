"""What launch version 2 (kernels/cuda/cuda_c.py `Packed`) adds to a launch on the host, measured without a GPU.

A GPU launch costs the host CuPy's or the driver's call plus whatever Python runs before it. Version 2 replaces
CuPy's RawKernel call (which looks at every argument's type at every call) by refbert's own packing (one
struct.pack_into into this thread's slots) and cupy.cuda.driver.launchKernel. The driver call needs a GPU
(benchmarks/launch_cost.py timed it on the H200: 4.25-5.48 us on parameters packed ahead); the packing does not,
and this script times it:

    NUMBA_ENABLE_CUDASIM=1 REFBERT_CUDA_EMULATE=1 python benchmarks/pack_cost.py [--repeats 100000]

It records every CUDA C launch of one eager training step (BertForPreTraining, 2 layers, hidden 128, head size 64
as BERT-base's, B=2 T=8, train mode; fp32 and bf16-mixed) on the emulator, then replays each kernel's first launch
through Packed.__call__ with its real argument list, the driver call replaced by a no-op and the emulator's
signature check off (a GPU has neither), the device arrays replaced by stand-ins whose `.data.ptr` is a plain
attribute (CuPy's is a C property; the emulated array's goes through NumPy's ctypes interface, ~1 us, which a GPU
never pays). The row "a no-op launch call" is the same loop calling the no-op directly: the Python call itself.
Not in these times: the driver call, and the CuPy runtime calls around it (the current stream; kernel()'s lookup of
the current device), which the emulator answers for free. Timings are this machine's.
"""
import argparse
import os
import sys
import time


class _Ptr:
    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr


class StandIn:
    """A device array as the packer sees it: `.data.ptr` (an int)."""
    __slots__ = ("data",)

    def __init__(self, ptr):
        self.data = _Ptr(ptr)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=100000)
    a = ap.parse_args(argv)
    if os.environ.get("REFBERT_CUDA_EMULATE") != "1" or os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        sys.exit("pack_cost.py: run with NUMBA_ENABLE_CUDASIM=1 REFBERT_CUDA_EMULATE=1 (the emulated CuPy)")
    import refbert
    from refbert.bench_cuda import _recorded
    from refbert.check import model_batch, tiny_config
    from refbert_kernels.cuda import _common as C
    from refbert_kernels.cuda import cuda_c as K
    if K.LAUNCH != "2":
        sys.exit("pack_cost.py: times launch version 2 (unset REFBERT_LAUNCH)")
    cfg = tiny_config("BertForPreTraining", num_hidden_layers=2, hidden_size=128, num_attention_heads=2,
                      intermediate_size=96)
    x = model_batch(cfg, "BertForPreTraining", B=2, T=8)
    first = {}
    for precision in ("fp32", "bf16-mixed"):
        m = refbert.BertForPreTraining(cfg, seed=1, backend="cuda", precision=precision).train(True)

        def step():
            m(**x)
            m.backward()
        step()                                           # (versions chosen, kernels built)
        for name, fn, grid, block, args, kw in _recorded(step):
            first.setdefault(name, (fn, grid, block, args, kw))

    def noop(*args):
        pass
    on_device = C.on_device
    rows = []
    for name, (fn, grid, block, args, kw) in sorted(first.items(), key=lambda kv: len(kv[1][3])):
        stand = tuple(StandIn(4096 * (i + 1)) if on_device(v) else v for i, v in enumerate(args))
        p = K.Packed(fn.raw, name, fn.xp)
        p._check, p._launch = None, noop
        p._layout(args)                                  # the layout from the real arguments, as at a first call
        for _ in range(1000):
            p(grid, block, stand, **kw)
        t = time.perf_counter()
        for _ in range(a.repeats):
            p(grid, block, stand, **kw)
        rows.append((name, len(args), sum(on_device(v) for v in args), (time.perf_counter() - t) / a.repeats * 1e6))
    t = time.perf_counter()
    for _ in range(a.repeats):
        noop(0, 1, 1, 1, 256, 1, 1, 0, 0, 0, 0)
    base = (time.perf_counter() - t) / a.repeats * 1e6
    print(f"host us per launch of version 2's packing (driver call a no-op), {a.repeats} calls each, "
          f"{len(rows)} kernels of the step")
    print("| kernel | arguments | of them arrays | us / call |")
    print("|---|---|---|---|")
    for name, n, arrays, us in rows:
        print(f"| {name} | {n} | {arrays} | {us:.2f} |")
    print(f"| a no-op launch call | 11 | — | {base:.2f} |")
    us = [r[3] for r in rows]
    print(f"\nrange over the step's kernels: {min(us):.2f} to {max(us):.2f} us")


if __name__ == "__main__":
    main()
