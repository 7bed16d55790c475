"""The `minifloat` command line: one module per subcommand, each thin (parse, call, print)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from minifloat.cli import bench, compare, error, formats, info, train
from minifloat.errors import MinifloatError

SUBCOMMANDS = (formats, error, bench, info, train, compare)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minifloat",
        description="Bit-exact FP8 / FP6 / FP4 formats and low-precision training for PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; user mistakes print one line on stderr and return exit code 2."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except MinifloatError as err:
        print(f"minifloat {args.command}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"minifloat {args.command}: error: {err}", file=sys.stderr)
        return 1
