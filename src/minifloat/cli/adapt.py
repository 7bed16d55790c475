"""`minifloat adapt --strategy auto` (and `minifloat sensitivity`): per-layer precision of a
trained model under a bit budget (the work is in `minifloat.measure.adapt`)."""

from __future__ import annotations

import argparse

from minifloat.cli.defaults import print_result
from minifloat.errors import MinifloatError

STRATEGIES = ("auto", "layer", "token", "confidence", "memory")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a `minifloat train` output folder or checkpoint, or a transformers model folder")
    p.add_argument("--candidates", default="fp8-dynamic,mxfp6,mxfp4,nvfp4,nvfp4-4over6",
                   help="comma-separated PTQ configs (the first and the last: the rules of thumb's high and low)")
    p.add_argument("--data", default=None, help="UTF-8 text file or folder (default: the Python stdlib sources)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per batch")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--calib-batches", type=int, default=4, help="training-split batches for sensitivity")
    p.add_argument("--eval-batches", type=int, default=None,
                   help="held-out batches for the comparison (default 16; auto: 4 past 64 quantizable layers, where "
                        "each of its ten or so evaluations is a pass of the real model over them)")
    p.add_argument("--out", default="runs/adapt", help="output folder (metrics.json, report.md, plots)")
    p.add_argument("--no-plots", action="store_true", help="skip the plots")
    p.add_argument("--json", action="store_true", help="print metrics.json instead of the table")
    p.add_argument("--measure", default="auto", choices=("auto", "all", "close"),
                   help="measure every layer's KL, or only the layers whose choice is close at a budget "
                        "(the Fisher estimate for the rest: a real model's hundreds of layers); auto: close "
                        "past 64 quantizable layers, else all")
    p.add_argument("--method", default="rtn", choices=("rtn", "gptq"),
                   help="how each candidate quantizes the weights: round to nearest, or GPTQ over the whole model "
                        "(the weights a user would ship; uniform rows and rules of thumb too)")
    p.add_argument("--measure-most", type=int, default=None,
                   help="with --measure close: at most this many layers measured per budget, those nearest the margin "
                        "(default 12; 4 when --measure auto chose close)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    a = sub.add_parser("adapt", help="adaptive precision (auto per-layer under a bit budget, layer rules, per token, "
                       "confidence cascade, memory pressure) against uniform schemes")
    _common(a)
    a.add_argument("--strategy", default="auto", choices=STRATEGIES, help="how precision is chosen")
    a.add_argument("--budget-bits", default="4.5,5,6", help="auto: comma-separated average bits per weight")
    a.add_argument("--high", default="fp8-dynamic", help="layer/token/confidence/memory: the high-precision config")
    a.add_argument("--low", default="nvfp4", help="layer/token/confidence/memory: the low-precision config")
    a.set_defaults(run=run)
    s = sub.add_parser("sensitivity", help="per-layer sensitivity (measured KL, Fisher estimate) of a trained model")
    _common(s)
    s.set_defaults(run=run, budget_bits="")


def run(args: argparse.Namespace) -> int:
    from minifloat.data.text import TextSource
    from minifloat.measure.adapt import run_adapt
    from minifloat.report.adapt import adapt_table

    for name in ("batch_size", "seq_len", "calib_batches", "eval_batches"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise MinifloatError(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    try:
        budgets = [float(b) for b in args.budget_bits.split(",") if b.strip()]
    except ValueError:
        raise MinifloatError(f"--budget-bits takes numbers, e.g. 4.5,5,6; got {args.budget_bits!r}") from None
    source = TextSource(data=args.data, batch_size=args.batch_size, seq_len=args.seq_len,
                        calib_batches=args.calib_batches, eval_batches=args.eval_batches or 16)  # fmt: skip
    candidates = [c.strip() for c in args.candidates.split(",") if c.strip()]
    echo = (lambda s: None) if args.json else print
    if getattr(args, "strategy", "auto") != "auto" and args.method != "rtn":
        raise MinifloatError(f"--method {args.method} goes with --strategy auto (the runtime strategies quantize by RTN)")
    if getattr(args, "strategy", "auto") != "auto":
        from minifloat.measure.adapt import run_strategy
        from minifloat.report.adapt import strategy_table

        metrics = run_strategy(args.model, args.out, args.strategy, high=args.high, low=args.low, source=source,
                               plots=not args.no_plots, echo=echo)  # fmt: skip
        print_result(metrics, strategy_table(metrics), args.out, args.json)
        return 0
    metrics = run_adapt(args.model, args.out, candidates=candidates, budgets=budgets, source=source,
                        plots=not args.no_plots, echo=echo, measure=args.measure, most=args.measure_most,
                        method=args.method, few_eval_batches=args.eval_batches is None)  # fmt: skip
    print_result(metrics, adapt_table(metrics), args.out, args.json)
    return 0
