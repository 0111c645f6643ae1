"""The `refbert` command line: `refbert check` (and `python -m refbert check`)."""
import argparse
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(prog="refbert", description="BERT in NumPy with hand-written, proven backward passes.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="check every op's backward against finite differences (float64) and print a table")
    args = parser.parse_args(argv)
    if args.command == "check":
        from . import check
        return check.main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
