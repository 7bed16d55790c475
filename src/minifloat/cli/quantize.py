"""`minifloat quantize`, `minifloat eval` and `minifloat ptq-compare`: post-training quantization
from the command line (the work is in `minifloat.infer` and `minifloat.experiments.ptq_compare`)."""

from __future__ import annotations

import argparse

from minifloat.cli.defaults import print_result
from minifloat.errors import MinifloatError
from minifloat.infer.config import QUANT_CONFIGS
from minifloat.infer.export import FORMATS
from minifloat.io import jsonio


def _text_arguments(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--data", default=None, help=f"UTF-8 text file or folder {what} (default: the Python stdlib sources)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per batch")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (at most the model's context)")
    p.add_argument("--eval-batches", type=int, default=16, help="held-out batches to evaluate on")
    p.add_argument("--calib-batches", type=int, default=8, help="training-split batches to calibrate static scales on")


def _source(args: argparse.Namespace):
    from minifloat.infer.pipeline import TextSource

    for name in ("batch_size", "seq_len", "eval_batches", "calib_batches"):
        if getattr(args, name) < 1:
            raise MinifloatError(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    return TextSource(data=getattr(args, "data", None) or getattr(args, "calib", None), batch_size=args.batch_size,
                      seq_len=args.seq_len, eval_batches=args.eval_batches, calib_batches=args.calib_batches)  # fmt: skip


def _head_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantize-head", action="store_true",
                   help="quantize the LM head and the input embedding too (weight-only, the config's weight scheme; "
                        "a tied pair stays one packed table)")  # fmt: skip


def add_parser(sub: argparse._SubParsersAction) -> None:
    names = ", ".join(QUANT_CONFIGS)
    p = sub.add_parser("quantize", help="quantize a trained model and write a serving checkpoint")
    p.add_argument("model", help="a `minifloat train` output folder or checkpoint, or a transformers model folder")
    p.add_argument("--scheme", required=True, choices=list(QUANT_CONFIGS), metavar="SCHEME", help=f"one of {names}")
    p.add_argument("--format", default="compressed-tensors", choices=FORMATS, help="checkpoint format")
    p.add_argument("--calib", default=None, help="text to calibrate static scales on (default: the Python stdlib sources)")
    p.add_argument("--out", required=True, help="the checkpoint folder to write")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--json", action="store_true", help="print the per-layer summary as JSON")
    _head_argument(p)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per calibration batch")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--calib-batches", type=int, default=8, help="calibration batches")
    p.set_defaults(run=run_quantize, eval_batches=1)

    e = sub.add_parser("eval", help="perplexity, KL and top-1 of a model against a reference")
    e.add_argument("model", help="the model to evaluate (any folder `quantize` takes, or a quantized checkpoint)")
    e.add_argument("--reference", default=None, help="the model to compare with (KL, top-1, Δ perplexity)")
    e.add_argument("--scheme", default=None, choices=list(QUANT_CONFIGS), metavar="SCHEME",
                   help="quantize MODEL with this config first (then --reference defaults to MODEL itself)")  # fmt: skip
    _text_arguments(e, "to evaluate on (its held-out split)")
    _head_argument(e)
    e.add_argument("--json", action="store_true", help="print JSON instead of the table")
    e.set_defaults(run=run_eval)

    c = sub.add_parser("ptq-compare", help="quantize a model with several configs; report quality and cost")
    c.add_argument("model", help="a `minifloat train` output folder or checkpoint, or a transformers model folder")
    c.add_argument("--schemes", default="fp8-dynamic,fp8-block,mxfp8,mxfp6,mxfp4,nvfp4", help=f"comma-separated: {names}")
    _text_arguments(c, "to calibrate (training split) and evaluate (held-out split) on")
    c.add_argument("--out", default="runs/ptq", help="output folder (metrics.json, report.md, quality.png)")
    c.add_argument("--no-torchao", action="store_true", help="skip torchao's quantization of the same model")
    _head_argument(c)
    c.add_argument("--no-plots", action="store_true", help="skip quality.png")
    c.add_argument("--json", action="store_true", help="print metrics.json instead of the table")
    c.set_defaults(run=run_ptq_compare)


def run_quantize(args: argparse.Namespace) -> int:
    from minifloat.infer.pipeline import quantize_checkpoint

    summary = quantize_checkpoint(args.model, args.scheme, args.out, format=args.format, source=_source(args),
                                  overwrite=args.overwrite, quantize_head=args.quantize_head)  # fmt: skip
    print(jsonio.dumps(summary.to_dict(), indent=2) if args.json else f"{summary}\ncheckpoint: {args.out}")
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from minifloat.infer.pipeline import evaluate_paths

    if args.quantize_head and not args.scheme:
        raise MinifloatError("--quantize-head goes with --scheme (it quantizes the head with that config)")
    m = evaluate_paths(args.model, args.reference, scheme=args.scheme, source=_source(args), quantize_head=args.quantize_head)
    if args.json:
        print(jsonio.dumps(m, indent=2))
        return 0
    print(f"perplexity {m['ppl']:.4f} over {m['tokens']:,} tokens; weights {m['weight_bytes']:,} bytes; "
          f"{m['tokens_per_s']:,.0f} tokens/s")  # fmt: skip
    if "ppl_ref" in m:
        print(f"reference perplexity {m['ppl_ref']:.4f}: Δppl {m['delta_ppl_pct']:+.3f} %, KL {m['kl']:.3e}, "
              f"top-1 agreement {m['top1']:.4f}")  # fmt: skip
    return 0


def run_ptq_compare(args: argparse.Namespace) -> int:
    from minifloat.experiments.ptq_compare import ptq_compare
    from minifloat.report.ptq import ptq_table

    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    metrics = ptq_compare(args.model, schemes, args.out, source=_source(args), torchao=not args.no_torchao,
                          plots=not args.no_plots, echo=(lambda s: None) if args.json else print,
                          quantize_head=args.quantize_head)  # fmt: skip
    print_result(metrics, ptq_table(metrics), args.out, args.json)
    return 0
