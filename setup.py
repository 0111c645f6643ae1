from pathlib import Path

from setuptools import setup

setup(
    name="refbert",
    version="0.1.0",
    description="BERT in NumPy with every backward written by hand and proven by finite differences, "
                "and fused kernels checked against it",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # kernels/ is installed as `refbert_kernels`: a top-level `kernels` is an unrelated PyPI package that
    # transformers imports, and must never be shadowed.
    packages=["refbert", "refbert_kernels", "refbert_kernels.cuda"],
    package_dir={"refbert": "refbert", "refbert_kernels": "kernels"},
    package_data={"refbert_kernels": ["cuda/csrc/*.cu", "cuda/csrc/*.cuh"]},  # CUDA C, compiled at run time by CuPy
    install_requires=[
        "numpy>=1.24",  # alone: refbert.special computes the normal CDF of the exact GELU; README "Dependencies"
    ],
    extras_require={
        # the training commands (refbert vocab/pretrain/finetune): WordPiece trainer, progress bars, loss plots
        "train": ["tokenizers>=0.15", "tqdm", "matplotlib"],
        # tests, the training commands, and the peers that parity tests compare against; torch pinned to the CPU
        # build this project tests with; scipy and mpmath: oracles for refbert.special; pytest-xdist: the suite's
        # worker processes (README: -n auto --dist worksteal, which came in 3.2; most tests keep one core busy)
        "dev": ["pytest>=7", "pytest-xdist>=3.2", "hypothesis>=6.80", "torch==2.13.0", "transformers>=4.40",
                "safetensors", "tokenizers>=0.15", "tqdm", "matplotlib", "numba>=0.59", "scipy>=1.10", "mpmath",
                # the CUDA kernels' tests run in Numba's CUDA simulator; bfloat16 arrays for the precision study;
                # NVRTC (with a CUDA toolkit's NVVM) lets tests/test_cuda_ptx.py compile every kernel without a GPU
                # (it skips where no libnvvm is found; NVRTC has no macOS wheel)
                "numba-cuda", "ml_dtypes", "nvidia-cuda-nvrtc>=13,<14; platform_system != 'Darwin'"],
        # the fused CPU kernels: backend="numba", refbert bench; scipy because Numba's np.dot (attention v3-v5's
        # BLAS tiles and gemm calls) calls SciPy's BLAS, and fails at run time without it
        "kernels": ["numba>=0.59", "scipy>=1.10"],
        # a prebuilt CuPy wheel for CUDA 13, never the source package `cupy` (CUDA 12: install cupy-cuda12x instead);
        # the CUDA kernels import the CPU kernels' files, and `refbert check` runs those too: scipy as for kernels
        "cuda": ["numba>=0.59", "scipy>=1.10", "numba-cuda", "cupy-cuda13x", "ml_dtypes"],
    },
    entry_points={"console_scripts": ["refbert=refbert.cli:main"]},
)
