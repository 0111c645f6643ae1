"""Peak extra memory of attention forward + backward: the NumPy oracle (refbert.ops) against the fused kernel
(refbert_kernels.attention, its default version), float32, B = 1, H = 12, hs = 64, a (B, 1, 1, T) mask of real
tokens (no padding, so no key block is skipped), eval (no dropout: the oracle's keep-mask would only add to it).

Each measurement runs in its own subprocess, after the inputs exist and the kernel is compiled:
  tracemalloc: peak of traced allocations (NumPy's arrays are traced; Numba's own allocations inside a kernel are not)
  RSS: the process's peak resident set (VmHWM, reset through /proc/self/clear_refs) minus the resident set before
The oracle holds several (B, H, T, T) arrays (scores, exp, p, their gradients: 805 MB each at T = 4096); the fused
kernel holds O(B T C) plus O(threads * tile) and never a (T, T) one.

    python benchmarks/bench_attention_memory.py [T ...]
"""
import subprocess
import sys


def child(impl, T):
    import tracemalloc

    import numpy as np

    from refbert import ops
    from refbert_kernels import attention as A

    fwd, bwd = (ops.attention_forward, ops.attention_backward) if impl == "oracle" else \
        (A.attention_forward, A.attention_backward)
    r = np.random.default_rng(0)
    B, H, hs = 1, 12, 64
    q, k, v, dout = (r.standard_normal((B, T, H * hs)).astype(np.float32) for _ in range(4))
    mask = np.zeros((B, 1, 1, T), np.float32)
    bwd(dout[:, :8], fwd(q[:, :8], k[:, :8], v[:, :8], H, mask[..., :8])[1])   # compile / warm up
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                                      # reset the peak RSS (VmHWM)
    rss0 = _status("VmRSS")
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    out, cache = fwd(q, k, v, H, mask)
    grads = bwd(dout, cache)
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    print(peak, _status("VmHWM") - rss0)
    del out, cache, grads


def _status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def main(Ts):
    print("attention forward + backward, float32, B=1, H=12, hs=64: peak extra memory (MB)")
    print(f"{'T':>6} | {'oracle traced':>13} {'oracle RSS':>10} | {'fused traced':>12} {'fused RSS':>9} | "
          f"{'ratio (RSS)':>11}")
    for T in Ts:
        res = {}
        for impl in ("oracle", "fused"):
            p = subprocess.run([sys.executable, __file__, "--child", impl, str(T)], capture_output=True, text=True)
            if p.returncode:
                raise SystemExit(p.stderr)
            res[impl] = [int(x) / 2 ** 20 for x in p.stdout.split()[-2:]]
        (ot, orss), (ft, frss) = res["oracle"], res["fused"]
        print(f"{T:6d} | {ot:13.1f} {orss:10.1f} | {ft:12.1f} {frss:9.1f} | {frss / orss:11.3f}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], int(sys.argv[3]))
    else:
        main([int(t) for t in sys.argv[1:]] or [512, 1024, 2048, 4096])
