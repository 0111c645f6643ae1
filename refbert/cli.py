"""The `refbert` command line (also `python -m refbert ...`): check, trace."""
import argparse
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(prog="refbert", description="BERT in NumPy with hand-written, proven backward passes.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="check every op's backward against finite differences (float64) and print a table")
    sub.add_parser("trace", help="one forward and backward of a tiny model, op by op, with finite-difference spot checks")
    args = parser.parse_args(argv)
    if args.command == "check":
        from . import check
        return check.main(args)
    if args.command == "trace":
        from . import trace
        return trace.main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
