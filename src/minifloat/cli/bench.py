"""`minifloat bench quantize|train`: side-by-side timings, medians of interleaved repetitions."""

from __future__ import annotations

import argparse
import json
import sys

from minifloat.errors import MinifloatError


def _size(text: str) -> tuple[int, int]:
    try:
        r, c = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size must look like 4096x8192, got {text!r}") from None
    return r, c


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="side-by-side timings")
    p.add_argument("what", choices=["quantize", "train"], help="what to time")
    p.add_argument("--size", type=_size, default=(4096, 8192), help="quantize: input ROWSxCOLS (default 4096x8192)")
    p.add_argument("--schemes", default=None, help="quantize: comma-separated schemes (default: all)")
    p.add_argument("--recipes", default=None, help="train: comma-separated recipes (default: fp8,fp8-current,mxfp8,nvfp4)")
    p.add_argument("--layers", type=int, default=4, help="train: MLP blocks (default 4)")
    p.add_argument("--dim", type=int, default=1024, help="train: model width (default 1024)")
    p.add_argument("--hidden", type=int, default=4096, help="train: hidden width (default 4096)")
    p.add_argument("--tokens", type=int, default=2048, help="train: tokens per step (default 2048)")
    p.add_argument("--no-bf16", action="store_true", help="train: skip the BF16 autocast baseline (slow on CPUs without BF16 units)")
    p.add_argument("--reps", type=int, default=None, help="interleaved repetitions (default 9 quantize, 3 train)")
    p.add_argument("--default-allocator", action="store_true",
                   help="leave glibc's malloc as it is: large outputs are page-faulted in again on every call")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    reps = args.reps if args.reps is not None else (9 if args.what == "quantize" else 3)
    if reps < 1:
        raise MinifloatError(f"--reps must be ≥ 1, got {reps}")
    if args.what == "train":
        return _train(args, reps)
    from minifloat.bench import DEFAULT_SCHEMES, bench_quantize
    from minifloat.schemes import get_scheme

    schemes = DEFAULT_SCHEMES if not args.schemes else tuple(get_scheme(s).name for s in args.schemes.split(","))
    out = bench_quantize(*args.size, schemes=schemes, reps=reps)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"input {out['shape'][0]}x{out['shape'][1]} float32, {out['threads']} threads, "
          f"median of {out['reps']}; read bound (sum) {out['read_bound_gelem_s']:.2f} Gelem/s")
    print("allocator: " + ("freed buffers stay in the heap (minifloat.kernels.allocator)" if out["keeps_freed_memory"]
                           else "glibc default (outputs above 32 MiB are page-faulted in on every call)"))
    if not out["torchao"]:
        print("torchao is not installed: no comparison (pip install 'minifloat[bench]')")
    print(f"{'scheme':18} {'quant Gelem/s':>13} {'x read':>7} {'dequant Gelem/s':>15} {'x read':>7} {'torchao':>8} {'speedup':>8}")
    for r in out["results"]:
        ta = "-" if r["torchao_gelem_s"] is None else f"{r['torchao_gelem_s']:.3f}"
        sp = "-" if r["speedup_vs_torchao"] is None else f"{r['speedup_vs_torchao']:.1f}x"
        print(f"{r['scheme']:18} {r['quantize_gelem_s']:13.2f} {r['quantize_vs_read']:7.2f} "
              f"{r['dequantize_gelem_s']:15.2f} {r['dequantize_vs_read']:7.2f} {ta:>8} {sp:>8}")
    return 0


def _train(args: argparse.Namespace, reps: int) -> int:
    from minifloat.bench import TRAIN_DEFAULT_RECIPES, bench_train
    from minifloat.recipes import get_recipe

    recipes = TRAIN_DEFAULT_RECIPES if not args.recipes else tuple(args.recipes.split(","))
    for r in recipes:
        get_recipe(r)  # unknown names fail before minutes of timing
    baselines = ("fp32", "torchao") if args.no_bf16 else ("bf16", "fp32", "torchao")
    progress = None if args.json else (lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))
    out = bench_train(recipes, layers=args.layers, dim=args.dim, hidden=args.hidden, tokens=args.tokens,
                      reps=reps, baselines=baselines, progress=progress)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    m = out["mlp"]
    print(f"{m['layers']} x ({m['dim']}->{m['hidden']}->{m['dim']}) MLP, {m['tokens']} tokens, "
          f"{out['threads']} threads, median of {out['reps']} (forward + backward + SGD step)")
    print(f"{'model':16} {'step s':>9} {'x bf16':>7} {'x fp32':>7} {'tokens/s':>10}")
    for r in out["results"]:
        vb = "-" if r["vs_bf16"] is None else f"{r['vs_bf16']:.2f}"
        vf = "-" if r["vs_fp32"] is None else f"{r['vs_fp32']:.2f}"
        print(f"{r['model']:16} {r['step_s']:9.3f} {vb:>7} {vf:>7} {r['tokens_per_s']:10.0f}")
    return 0
