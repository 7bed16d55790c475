"""The `minifloat` command line: one module per subcommand, each thin (parse, call, print)."""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence

import torch

from minifloat import __version__
from minifloat.cli import (
    adapt,
    bench,
    compare,
    error,
    formats,
    generate,
    info,
    memory,
    quantize,
    train,
    validate,
)
from minifloat.errors import MinifloatError
from minifloat.kernels.allocator import keep_freed_memory

SUBCOMMANDS = (formats, error, bench, info, train, compare, quantize, generate, adapt, validate, memory)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that ends each option with its default, unless the option has none (None, a switch
    that is off) or its help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        off = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if off or not action.option_strings or "default" in text:
            return text
        return f"{text} (default: %(default)s)".lstrip()

    def _split_lines(self, text: str, width: int) -> list[str]:
        # a config name (mxfp4-weight-only) or an option (--budget-bits) is never cut at a hyphen
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minifloat",
        description="Bit-exact FP8 / FP6 / FP4 formats and low-precision training for PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"minifloat {__version__} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    for command in sub.choices.values():
        command.formatter_class = DefaultsHelpFormatter
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; user mistakes print one line on stderr and return exit code 2.
    As a command (argv None) it owns its process, so large freed buffers stay in its heap
    (`keep_freed_memory`) unless ``--default-allocator`` says otherwise."""
    args = build_parser().parse_args(argv)
    args.owns_process = argv is None
    if argv is None and not getattr(args, "default_allocator", False):
        keep_freed_memory()
    try:
        return args.run(args) or 0
    except MinifloatError as err:
        print(f"minifloat {args.command}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"minifloat {args.command}: error: {err}", file=sys.stderr)
        return 1
