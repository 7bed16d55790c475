"""`minifloat quantize`, `minifloat eval` and `minifloat ptq-compare`: post-training quantization
from the command line (the work is in `minifloat.infer` and `minifloat.measure.ptq_compare`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from minifloat.cli.defaults import print_result
from minifloat.errors import MinifloatError
from minifloat.infer.checkpoints import gguf_file
from minifloat.infer.checkpoints.export import EXPORT_FORMATS
from minifloat.infer.checkpoints.gguf_file import REST_TYPES
from minifloat.infer.ptq.config import QUANT_CONFIGS, get_quant_config
from minifloat.io import jsonio


def _text_arguments(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--data", default=None, help=f"UTF-8 text file or folder {what} (default: the Python stdlib sources)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per batch")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (at most the model's context)")
    p.add_argument("--eval-batches", type=int, default=16, help="held-out batches to evaluate on")
    p.add_argument("--calib-batches", type=int, default=8, help="training-split batches to calibrate static scales on")


def _source(args: argparse.Namespace):
    from minifloat.data.text import TextSource

    for name in ("batch_size", "seq_len", "eval_batches", "calib_batches"):
        if getattr(args, name) < 1:
            raise MinifloatError(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    return TextSource(data=getattr(args, "data", None), calib=getattr(args, "calib", None), batch_size=args.batch_size,
                      seq_len=args.seq_len, eval_batches=args.eval_batches, calib_batches=args.calib_batches)  # fmt: skip


def _method_arguments(p: argparse.ArgumentParser, methods: bool = False) -> None:
    if methods:
        p.add_argument("--methods", default="rtn", help="comma-separated PTQ methods to compare: rtn, gptq")
    else:
        p.add_argument("--method", default="rtn", choices=("rtn", "gptq"),
                       help="rtn: round to nearest (default); gptq: GPTQ with the config's recommended pipeline")  # fmt: skip
    p.add_argument("--observer", default=None, choices=("minmax", "mse", "4over6"),
                   help="block scale observer (default: the method's; 4over6: NVFP4 only)")  # fmt: skip
    p.add_argument("--rotate", default=None, metavar="hadamard:N",
                   help="Hadamard rotation of each Linear's input, N in 16, 32, 64, 128, or none (default: the method's)")  # fmt: skip
    p.add_argument("--smooth", type=float, default=None, metavar="ALPHA",
                   help="SmoothQuant α in [0, 1] for configs that quantize the input; -1: none (default: the method's)")  # fmt: skip
    p.add_argument("--damp", type=float, default=None, help="GPTQ damping, a fraction of the mean Hessian diagonal (0.01)")
    p.add_argument("--asymmetric", type=float, default=None, metavar="RIDGE",
                   help="GPTQ fits the full-precision model's outputs, not the quantized predecessors' (asymmetric "
                        "calibration); RIDGE a fraction of the mean Hessian diagonal, e.g. 1; -1: none "
                        "(default: the method's)")  # fmt: skip
    p.add_argument("--tune-norms", type=int, default=None, metavar="STEPS",
                   help="after quantizing, distill the normalization gains toward the unquantized model for STEPS "
                        "steps of 4 training windows (about 3 s a step on a 135M model on 2 cores; the gains stay "
                        "in high precision in every checkpoint); 0: none (default: the method's)")  # fmt: skip
    p.add_argument("--keep-channels", type=int, default=None, metavar="K",
                   help="keep each Linear's K input channels of largest calibration mean square out of the quantized "
                        "product, multiplied in BF16 (massive activations; in memory only: no checkpoint reader "
                        "applies it); 0: none (default: the method's)")  # fmt: skip


def _method(args: argparse.Namespace, method: str, scheme: str | None, export: bool = False):
    """The `PTQMethod` of `method` for `scheme` with the command line's overrides (`export`: the
    recommended pipeline a checkpoint can hold)."""
    from minifloat.infer.ptq.method import resolve_method

    return resolve_method(method, scheme or "fp8-dynamic", export=export, observer=args.observer, rotation=args.rotate,
                          smooth=args.smooth, damp=args.damp, asymmetric=args.asymmetric,
                          tune_norms=args.tune_norms, keep_channels=args.keep_channels)  # fmt: skip


def _head_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantize-head", action="store_true",
                   help="quantize the LM head and the input embedding too (weight-only, the config's weight scheme; "
                        "a tied pair stays one packed table)")  # fmt: skip


def add_parser(sub: argparse._SubParsersAction) -> None:
    names = ", ".join(QUANT_CONFIGS)
    p = sub.add_parser("quantize", help="quantize a trained model and write a serving checkpoint")
    p.add_argument("model", help="a `minifloat train` output folder or checkpoint, or a transformers model folder")
    p.add_argument("--scheme", required=True, choices=list(QUANT_CONFIGS), metavar="SCHEME", help=f"one of {names}")
    p.add_argument("--format", default="compressed-tensors", choices=EXPORT_FORMATS,
                   help="checkpoint format; gguf: one file llama.cpp runs (MXFP4 / NVFP4 blocks; MODEL a .gguf)")  # fmt: skip
    p.add_argument("--gguf-rest", default="q8_0", choices=REST_TYPES,
                   help="--format gguf: the type of the 2-D tensors not in FP4 (embedding, an unquantized head); "
                        "norms are F32 (default q8_0, as llama.cpp's own 4-bit files)")  # fmt: skip
    p.add_argument("--calib", default=None, help="text to calibrate on (default: the Python stdlib sources)")
    p.add_argument("--out", required=True, help="the checkpoint folder to write (the .gguf file with --format gguf)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--keep", default="", metavar="GLOB[,GLOB]",
                   help="layers kept in high precision besides the head, e.g. '*.down_proj' (a GGUF writes them as "
                        "--gguf-rest)")  # fmt: skip
    p.add_argument("--budget-bits", type=float, default=None, metavar="BITS",
                   help="--format gguf: keep layers out of FP4 (in --gguf-rest) until the file's tensors hold BITS per "
                        "weight, those whose Fisher-estimated KL costs most per bit first (e.g. 6.1: below Q4_K_M's "
                        "size)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the per-layer summary as JSON")
    _head_argument(p)
    _method_arguments(p)
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
    e.add_argument("--calib", default=None, help="text to calibrate on (default: --data's training split)")
    _head_argument(e)
    _method_arguments(e)
    e.add_argument("--json", action="store_true", help="print JSON instead of the table")
    e.set_defaults(run=run_eval)

    c = sub.add_parser("ptq-compare", help="quantize a model with several configs; report quality and cost")
    c.add_argument("model", help="a `minifloat train` output folder or checkpoint, or a transformers model folder")
    c.add_argument("--schemes", default="fp8-dynamic,fp8-block,mxfp8,mxfp6,mxfp4,nvfp4", help=f"comma-separated: {names}")
    _text_arguments(c, "to calibrate (training split) and evaluate (held-out split) on")
    c.add_argument("--out", default="runs/ptq", help="output folder (metrics.json, report.md, quality.png)")
    c.add_argument("--calib", default=None, help="text to calibrate on (default: --data's training split)")
    c.add_argument("--no-torchao", action="store_true", help="skip torchao's quantization of the same model")
    c.add_argument("--llmcompressor", default=None, metavar="PYTHON",
                   help="the Python of a venv with llm-compressor: its GPTQ (and RTN) of the same model beside "
                        "minifloat's, compared through the checkpoints it writes")  # fmt: skip
    _head_argument(c)
    _method_arguments(c, methods=True)
    c.add_argument("--no-plots", action="store_true", help="skip quality.png")
    c.add_argument("--json", action="store_true", help="print metrics.json instead of the table")
    c.set_defaults(run=run_ptq_compare)


def run_quantize(args: argparse.Namespace) -> int:
    from minifloat.infer.evaluation.pipeline import quantize_checkpoint

    keep = tuple(g.strip() for g in args.keep.split(",") if g.strip())
    plan = _budget_plan(args, keep) if args.budget_bits is not None else None
    if plan is not None:
        keep += plan.keep
        if not args.json:
            print(plan)
    summary = quantize_checkpoint(args.model, args.scheme, args.out, format=args.format, source=_source(args),
                                  ignore=("lm_head", *keep),
                                  overwrite=args.overwrite, quantize_head=args.quantize_head,
                                  method=_method(args, args.method, args.scheme, export=True), gguf_rest=args.gguf_rest)  # fmt: skip
    written = gguf_file.tensor_bits(args.out) if args.format == gguf_file.NAME else None
    if args.json:
        out = summary.to_dict()
        if plan is not None:
            out["budget"] = {"budget_bits": plan.budget, "planned_bits": plan.bits, "keep": list(plan.keep),
                             "tensor_bits_per_weight": written[0] / written[1], "estimate": plan.estimate}  # fmt: skip
        print(jsonio.dumps(out, indent=2))
        return 0
    print(f"{summary}\ncheckpoint: {args.out}")
    if written is not None:
        size = Path(args.out).stat().st_size
        print(f"{written[0] / written[1]:.3f} bits per weight in its tensors ({size * 8 / written[1]:.3f} with the "
              f"metadata and tokenizer, as file bytes × 8 / parameters)")  # fmt: skip
    in_memory, written = _method(args, args.method, args.scheme), _method(args, args.method, args.scheme, export=True)
    left = ([f"rotates each layer's input ({in_memory.rotation})"] if in_memory.rotation and not written.rotation else []) + (
        [f"keeps {in_memory.keep_channels} input channels per layer in BF16"] if in_memory.keep_channels and not written.keep_channels else [])  # fmt: skip
    if left:
        print(f"note: {args.method}'s recommended pipeline for {args.scheme} {' and '.join(left)}; a checkpoint cannot "
              f"hold that (no reader applies it), so it was left out: `eval --method {args.method}` measures the "
              f"pipeline with it, this file the one without")  # fmt: skip
    return 0


def _budget_plan(args: argparse.Namespace, keep: tuple[str, ...]):
    """`--budget-bits`: the layers to keep, chosen after what can fail is checked."""
    from minifloat.adapt.keep import gguf_keep

    if args.format != gguf_file.NAME:
        raise MinifloatError(f"--budget-bits plans a GGUF file's bits per weight: add --format gguf (--format "
                             f"{args.format}: `minifloat adapt` chooses a precision per layer)")  # fmt: skip
    gguf_file.check_request(args.model, get_quant_config(args.scheme), args.gguf_rest)
    if Path(args.out).exists() and not args.overwrite:
        raise MinifloatError(f"{args.out} exists; pass --overwrite to replace it, or choose another file")
    return gguf_keep(args.model, args.scheme, _source(args), args.budget_bits, rest=args.gguf_rest,
                     ignore=("lm_head", *keep))  # fmt: skip


def run_eval(args: argparse.Namespace) -> int:
    from minifloat.infer.evaluation.pipeline import evaluate_paths

    if args.quantize_head and not args.scheme:
        raise MinifloatError("--quantize-head goes with --scheme (it quantizes the head with that config)")
    flags = (args.observer, args.rotate, args.smooth, args.damp, args.asymmetric, args.tune_norms, args.keep_channels)
    if not args.scheme and (args.method != "rtn" or any(v is not None for v in flags)):
        raise MinifloatError("--method / --observer / --rotate / --smooth / --asymmetric / --tune-norms / --keep-channels "
                             "go with --scheme "
                             "(they say how to quantize with it)")  # fmt: skip
    method = _method(args, args.method, args.scheme) if args.scheme else "rtn"
    m = evaluate_paths(args.model, args.reference, scheme=args.scheme, source=_source(args), quantize_head=args.quantize_head,
                       method=method)  # fmt: skip
    if args.json:
        print(jsonio.dumps(m, indent=2))
        return 0
    print(f"perplexity {m['ppl']:.4f} over {m['tokens']:,} tokens ({m['text']}); weights {m['weight_bytes']:,} bytes; "
          f"{m['tokens_per_s']:,.0f} tokens/s")  # fmt: skip
    if "ppl_ref" in m:
        print(f"reference perplexity {m['ppl_ref']:.4f}: Δppl {m['delta_ppl_pct']:+.3f} %, KL {m['kl']:.3e}, "
              f"top-1 agreement {m['top1']:.4f}")  # fmt: skip
    return 0


def run_ptq_compare(args: argparse.Namespace) -> int:
    from minifloat.measure.ptq_compare import ptq_compare
    from minifloat.report.ptq import ptq_table

    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in ("rtn", "gptq"):
            raise MinifloatError(f"--methods: unknown method {m!r}; use rtn, gptq (comma-separated)")
    overrides = {"observer": args.observer, "rotation": args.rotate, "smooth": args.smooth, "damp": args.damp,
                 "asymmetric": args.asymmetric, "tune_norms": args.tune_norms, "keep_channels": args.keep_channels}  # fmt: skip
    metrics = ptq_compare(args.model, schemes, args.out, source=_source(args), torchao=not args.no_torchao,
                          plots=not args.no_plots, echo=(lambda s: None) if args.json else print,
                          quantize_head=args.quantize_head, methods=methods, overrides=overrides,
                          llmcompressor=args.llmcompressor)  # fmt: skip
    print_result(metrics, ptq_table(metrics), args.out, args.json)
    return 0
