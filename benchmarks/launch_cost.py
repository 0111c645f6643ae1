"""What one kernel launch costs the host, by how its arguments are passed (a GPU probe; prints a table).

The bench's launch probe (refbert bench --device cuda, "host us / launch") replays the step's own launches through
CuPy's RawKernel call, which packs every argument at every call (a CuPy array: its pointer; an np.int32 / np.float32:
its value). This script times empty kernels with 0, 4 and 16 arguments three ways, back to back, the device drained
before and after (wall time of the loop / repeats):

  rawkernel      f(grid, block, args): CuPy packs the tuple (arrays, np.int32, np.float32)
  rawkernel-int  the same with Python ints and floats where the C types are int / float (CuPy packs an int as 8 bytes:
                 the kernel's int reads the low half, so this is timing only, never how refbert calls)
  driver         cupy.cuda.driver.launchKernel on a params buffer packed ahead (one uint64 slot an argument and an
                 array of their addresses, both made once): per call only the changing values are written

    python benchmarks/launch_cost.py [--repeats 2000]
"""
import argparse
import time

import numpy as np

SRC = r"""
extern "C" __global__ void k0() {}
extern "C" __global__ void k4(const float* a, const float* b, float* c, float* d) {
    if (threadIdx.x == 1000) c[0] = a[0] + b[0] + d[0];
}
extern "C" __global__ void k16(const float* a, const float* b, float* c, float* d, const float* e, float* f,
                               int n0, int n1, int n2, int n3, int n4, int n5, float s0, float s1,
                               unsigned long long u0, unsigned long long u1) {
    if (threadIdx.x == 1000) c[0] = a[0] + b[0] + d[0] + e[0] + f[0] + n0 + n1 + n2 + n3 + n4 + n5 + s0 + s1 + u0 + u1;
}
"""


def timed(cp, fn, repeats):
    fn()
    cp.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    host = (time.perf_counter() - t) / repeats * 1e6
    cp.cuda.Device().synchronize()
    return host


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2000)
    a = ap.parse_args()
    import cupy as cp
    from cupy.cuda import driver
    mod = cp.RawModule(code=SRC)
    ks = {n: mod.get_function(n) for n in ("k0", "k4", "k16")}
    arrs = [cp.zeros(4, cp.float32) for _ in range(6)]
    ints = [np.int32(i + 1) for i in range(6)]
    flts = [np.float32(0.5), np.float32(2.0)]
    u64s = [np.uint64(7), np.uint64(9)]
    args = {"k0": (), "k4": tuple(arrs[:4]), "k16": tuple(arrs) + tuple(ints) + tuple(flts) + tuple(u64s)}
    pyargs = {"k0": (), "k4": tuple(arrs[:4]),
              "k16": tuple(arrs) + tuple(range(1, 7)) + (0.5, 2.0) + (7, 9)}
    stream = cp.cuda.get_current_stream().ptr
    rows = []
    for name, k in ks.items():
        r = dict(kernel=f"{name} ({len(args[name])} args)")
        r["rawkernel"] = timed(cp, lambda: k((1,), (32,), args[name]), a.repeats)
        r["rawkernel-int"] = timed(cp, lambda: k((1,), (32,), pyargs[name]), a.repeats)
        try:
            fptr = getattr(k, "kernel", k).ptr
            n = len(args[name])
            slots = np.zeros(max(n, 1), np.uint64)                  # one 8-byte slot an argument
            addrs = (slots.ctypes.data + 8 * np.arange(max(n, 1))).astype(np.uint64)
            f32 = slots.view(np.float32)                            # float args: the low 4 bytes of a slot
            i32 = slots.view(np.int32)
            ptrs = [x.data.ptr for x in args[name][:6]]

            def launch():
                for i, p in enumerate(ptrs):                        # the changing values: array pointers
                    slots[i] = p
                if n == 16:
                    i32[2 * 6:2 * 12:2] = ints
                    f32[2 * 12] = flts[0]
                    f32[2 * 13] = flts[1]
                    slots[14:16] = u64s
                driver.launchKernel(fptr, 1, 1, 1, 32, 1, 1, 0, stream, addrs.ctypes.data if n else 0, 0)
            r["driver"] = timed(cp, launch, a.repeats)

            def launch_fixed():                                     # nothing rewritten: the call alone
                driver.launchKernel(fptr, 1, 1, 1, 32, 1, 1, 0, stream, addrs.ctypes.data if n else 0, 0)
            r["driver, no repack"] = timed(cp, launch_fixed, a.repeats)
        except Exception as e:                                      # (say why, keep the other columns)
            r["driver"] = f"{type(e).__name__}: {e}"
        rows.append(r)
    cols = ["kernel", "rawkernel", "rawkernel-int", "driver", "driver, no repack"]
    print(f"host us per launch, {a.repeats} back to back, {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print("| " + " | ".join(c if c == "kernel" else f"{c} us" for c in cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r.get(c):.2f}" if isinstance(r.get(c), float) else str(r.get(c, "—"))
                                for c in cols) + " |")


if __name__ == "__main__":
    main()
