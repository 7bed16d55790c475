"""`minifloat validate`: every example checked, timed and profiled into one report (the work is
in `minifloat.validate.runner` and its examples)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from minifloat.errors import MinifloatError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="run the examples (formats, quantize, GEMMs, FP4 inference, a transformer layer, "
                       "compile, training, serving) with checks, timings and profiles into one report")  # fmt: skip
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--profile-all", action="store_true", help="run every example, profiled")
    what.add_argument("--all", action="store_true", help="run every example, not profiled")
    what.add_argument("--example", action="append", metavar="NAME", help="run this example (repeatable)")
    what.add_argument("--list", action="store_true", help="list the examples")
    what.add_argument("--generate-report", metavar="DIR", help="re-render DIR/report.md from DIR/metrics.json")
    p.add_argument("--profile", action="store_true", help="with --example: write its profiler trace")
    p.add_argument("--size", default=None, choices=("tiny", "default", "full"),
                   help="problem sizes (default: full on a GPU, default on a CPU)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per case (medians)")
    p.add_argument("--nvtx", action="store_true", help="NVTX ranges on CUDA, for nsys")
    p.add_argument("--out", default="runs/validate", help="output folder")
    p.add_argument("--no-plots", action="store_true", help="skip the plots")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from minifloat.validate import runner

    if args.list:
        for name in runner.EXAMPLES:
            m = runner.load(name)
            print(f"{name:18} {m.TITLE}")
        return 0
    if args.generate_report:
        from minifloat.report.validate import write_validate_report

        src = Path(args.generate_report) / "metrics.json"
        if not src.is_file():
            raise MinifloatError(f"{src} does not exist: --generate-report takes a folder a validate run wrote")
        try:
            metrics = json.loads(src.read_text())
            path = write_validate_report(metrics, args.generate_report, plots=not args.no_plots)
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise MinifloatError(f"{src} is not a validate metrics file ({type(err).__name__}: {err})") from None
        print(f"report: {path}")
        return 0 if metrics.get("passed", False) else 1
    if args.reps < 1:
        raise MinifloatError(f"--reps must be ≥ 1, got {args.reps}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise MinifloatError("--device cuda: this machine has no CUDA device (use --device cpu)")
    size = args.size or ("full" if device.type == "cuda" else "default")
    names = list(runner.EXAMPLES) if (args.profile_all or args.all) else args.example
    ctx = runner.Context(device=device, size=size, reps=args.reps, nvtx=args.nvtx)
    metrics = runner.validate(names, args.out, ctx, profile=args.profile_all or args.profile, plots=not args.no_plots)
    from minifloat.report.validate import summary_table

    print(summary_table(metrics))
    failed = [f"{e['name']}: {c['name']}" for e in metrics["examples"] for c in e["checks"] if not c["passed"]]
    for f in failed:
        print(f"FAILED {f}")
    print(f"\n{len(metrics['examples'])} examples in {metrics['wall_s']:.0f} s; report: {args.out}/report.md")
    return 0 if metrics["passed"] else 1
