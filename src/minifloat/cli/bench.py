"""`minifloat bench quantize`: quantize/dequantize throughput vs the read bound and torchao."""

from __future__ import annotations

import argparse
import json

from minifloat.errors import MinifloatError


def _size(text: str) -> tuple[int, int]:
    try:
        r, c = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size must look like 4096x8192, got {text!r}") from None
    return r, c


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="side-by-side timings")
    p.add_argument("what", choices=["quantize"], help="what to time")
    p.add_argument("--size", type=_size, default=(4096, 8192), help="input ROWSxCOLS (default 4096x8192)")
    p.add_argument("--schemes", default=None, help="comma-separated schemes (default: all)")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions (median reported)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from minifloat.bench import DEFAULT_SCHEMES, bench_quantize
    from minifloat.schemes import get_scheme

    schemes = DEFAULT_SCHEMES if not args.schemes else tuple(get_scheme(s).name for s in args.schemes.split(","))
    if args.reps < 1:
        raise MinifloatError(f"--reps must be ≥ 1, got {args.reps}")
    out = bench_quantize(*args.size, schemes=schemes, reps=args.reps)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"input {out['shape'][0]}x{out['shape'][1]} float32, {out['threads']} threads, "
          f"median of {out['reps']}; read bound (sum) {out['read_bound_gelem_s']:.2f} Gelem/s")
    if not out["torchao"]:
        print("torchao is not installed: no comparison (pip install 'minifloat[bench]')")
    print(f"{'scheme':18} {'quant Gelem/s':>13} {'x read':>7} {'dequant Gelem/s':>15} {'x read':>7} {'torchao':>8} {'speedup':>8}")
    for r in out["results"]:
        ta = "-" if r["torchao_gelem_s"] is None else f"{r['torchao_gelem_s']:.3f}"
        sp = "-" if r["speedup_vs_torchao"] is None else f"{r['speedup_vs_torchao']:.1f}x"
        print(f"{r['scheme']:18} {r['quantize_gelem_s']:13.2f} {r['quantize_vs_read']:7.2f} "
              f"{r['dequantize_gelem_s']:15.2f} {r['dequantize_vs_read']:7.2f} {ta:>8} {sp:>8}")
    return 0
