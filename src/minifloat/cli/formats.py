"""`minifloat formats`: the format table, generated from the definitions."""

from __future__ import annotations

import argparse
import json

from minifloat.formats import FORMATS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("formats", help="print the table of element formats")
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="also draw rounding error and value grids")
    p.set_defaults(run=run)


def _num(v: float) -> str:
    return f"{v:.6g}" if 1e-3 <= abs(v) < 1e6 else f"{v:.3g}"


def format_table() -> str:
    """The table as aligned text, one row per format."""
    header = ("format", "bits", "E", "M", "bias", "inf", "NaN", "max", "min normal",
              "min subnormal", "range (binades)", "values in [1,2)", "vs FP16", "role")
    rows = [header]
    for f in FORMATS.values():
        rows.append((
            f.name, str(f.bits), str(f.exp_bits), str(f.man_bits), str(f.bias),
            "yes" if f.has_inf else "no", f.nan.value, _num(f.max), _num(f.min_normal),
            _num(f.min_subnormal), f"{f.dynamic_range_binades:.1f}", str(f.values_in_1_2),
            f"{f.memory_vs_fp16:.3g}x", f.role,
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps([f.describe() for f in FORMATS.values()], indent=2))
    else:
        print(format_table())
    if args.plot:
        from minifloat.report.format_plots import plot_formats

        plot_formats(args.plot)
        if not args.json:
            print(f"\nwrote {args.plot}")
    return 0
