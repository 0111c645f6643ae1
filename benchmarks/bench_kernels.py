"""Every fused kernel of refbert_kernels validated against its oracle in refbert.ops, then timed next to the NumPy
oracle and PyTorch CPU on the same inputs, and each kernel file's first-call compile time: `refbert bench --only
kernels` (refbert/bench.py has the method), which writes benchmarks/results/kernels.{md,json,png}.

    python benchmarks/bench_kernels.py                         # every KernelSpec
    python benchmarks/bench_kernels.py --kernels softmax attention --repeats 20
    python benchmarks/bench_kernels.py --quick                 # tooling check -> benchmarks/results/quick/
Needs the kernels extra (numba); torch for the PyTorch column.
"""
import sys

from refbert import bench

if __name__ == "__main__":
    sys.exit(bench.main(argv=["--only", "kernels", *sys.argv[1:]]))
