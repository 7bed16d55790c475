"""`minifloat compare`: train the built-in GPT in several precisions and write a report."""

from __future__ import annotations

import argparse

from minifloat.cli.defaults import print_result
from minifloat.cli.train import add_training_arguments, config_from_args
from minifloat.measure.compare import DEFAULT_PRECISIONS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="train in several precisions; write metrics.json, report.md and plots")
    p.add_argument("--precisions", default=",".join(DEFAULT_PRECISIONS),
                   help="comma-separated, the first is the reference; each may add training options after @ "
                        "(fp8@states=fp8-dre@master=bf16-sr: FP8 optimizer states and BF16 masters)")  # fmt: skip
    add_training_arguments(p, eval_zero="only the one at the end")
    p.add_argument(
        "--out", default="runs/compare", help="output folder (metrics.json, report.md, *.png, runs/)"
    )
    p.add_argument("--seeds", type=int, default=1,
                   help="train every precision with this many seeds (--seed, --seed + 1, …) and report each Δ "
                        "as mean ± std, marking those within noise")  # fmt: skip
    p.add_argument("--peers", default="", help="with MODEL --lora: the LoRA runs users know, side by side on the same "
                   "windows: peft-bf16 (transformers + PEFT, BF16 base), bnb-nf4 (bitsandbytes NF4 base, QLoRA)")
    p.add_argument("--peer-python", default=None, metavar="PYTHON",
                   help="the python of the peers' own venv (transformers, peft, bitsandbytes); minifloat never imports them")
    p.add_argument("--overwrite", action="store_true", help="delete an earlier comparison in --out first")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots (no matplotlib needed)")
    p.add_argument("--json", action="store_true", help="print metrics.json instead of the table")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from minifloat.measure.compare import compare, parse_precisions, run_fields
    from minifloat.report.comparison import summary_table

    precisions = parse_precisions(args.precisions)
    # the command line's options; each precision's own @options replace them for its runs
    from minifloat.recipes import RECIPES
    from minifloat.train.config import PACKED_FORMATS

    # the precision the command line's options are checked against: --base-policy is the packed bases', --precision-switch
    # and --outlier-channels the recipes'
    packed = [p for p in precisions if run_fields(p)["precision"] in PACKED_FORMATS]
    recipes = [p for p in precisions if run_fields(p)["precision"] in RECIPES]
    lead = packed[0] if packed and args.base_policy else recipes[0] if recipes and (args.precision_switch or args.outlier_channels) else precisions[0]
    base = config_from_args(args, precision=run_fields(lead)["precision"])
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    metrics = compare(precisions, base, args.out, plots=not args.no_plots, overwrite=args.overwrite, seeds=args.seeds,
                      peers=peers, peer_python=args.peer_python)  # fmt: skip
    print_result(metrics, summary_table(metrics), args.out, args.json)
    return 0 if all(m["status"] != "failed" for m in metrics["runs"]) else 1
