"""argparse types shared by the command line (refbert/cli.py) and the benches' own parsers (refbert/bench.py,
refbert/bench_cuda.py), which the library side may import without the command line."""
import argparse


def positive(text):
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def positive_float(text):
    """argparse type: a finite number > 0 (a learning rate)."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def non_negative(text):
    """argparse type: an integer >= 0 (a seed)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value
