"""`minifloat memory`: per-device bytes of training a model, by category, with the assumptions
(the work is in `minifloat.planner.memory`)."""

from __future__ import annotations

import argparse
import json

from minifloat.cli.train import globs_arg, policy_arg
from minifloat.errors import MinifloatError
from minifloat.train.config import BASE_FORMATS, PACKED_FORMATS, base_policy_pairs


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("memory", help="training memory per device: parameters, master weights, gradients, "
                       "accumulator, optimizer states, activations")  # fmt: skip
    p.add_argument("pretrained", nargs="?", default=None, metavar="MODEL",
                   help="plan the fine-tune of this pretrained model (a transformers folder or .gguf): full, or --lora on a --base")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--params", help="model size: 7B, 13B, 70B (Llama 2 shapes), or a count such as 350M")
    which.add_argument("--model", choices=("tiny", "small", "base"), help="a built-in GPT (its exact shape)")
    p.add_argument("--precision", default="fp8", choices=("fp32", "bf16", "fp8", "mxfp8", "nvfp4"), help="compute format")
    p.add_argument("--layout", default=None, choices=("te", "minifloat"),
                   help="te: Transformer Engine / Megatron's; minifloat: this library's training (default: te for --params, "
                        "minifloat for --model)")  # fmt: skip
    p.add_argument("--master", default="fp32", choices=("fp32", "bf16-sr", "bf16+remainder", "none"),
                   help="the master weights: FP32; BF16 updated with stochastic rounding; BF16 and an int16 remainder "
                        "(FP32 exactly); none (te only) — train --master")  # fmt: skip
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"), help="optimizer")
    p.add_argument("--optimizer-states", default="fp32", choices=("fp32", "bf16", "fp8", "fp8-dre"),
                   help="how AdamW stores its moments (minifloat.optim.AdamW; train --optimizer-states)")
    p.add_argument("--offload", default="", help="comma-separated: master, optimizer (moved to host memory)")
    p.add_argument("--world-size", type=int, default=1, help="devices the states are sharded over (FSDP2 / ZeRO-3)")
    p.add_argument("--fp8-all-gather", action="store_true",
                   help="with --world-size ≥ 2 and fp8 / mxfp8: weights gathered as codes and scales (train --fp8-all-gather)")
    p.add_argument("--batch", type=int, default=1, help="sequences per device")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--hidden", type=int, help="hidden size (with --layers, --heads: activations for --params N)")
    p.add_argument("--layers", type=int, help="transformer layers")
    p.add_argument("--heads", type=int, help="attention heads")
    p.add_argument("--vocab", type=int, help="vocabulary size (the loss' logits)")
    p.add_argument("--no-flash", action="store_true", help="count the attention scores (no fused attention)")
    p.add_argument("--measure", action="store_true",
                   help="with --model or MODEL: build the real training state (MODEL: one training step) and compare")
    ft = p.add_argument_group("a fine-tune of MODEL")
    ft.add_argument("--lora", type=int, default=0, metavar="RANK", help="LoRA adapters of this rank on a frozen base")
    ft.add_argument("--base", default="bf16", choices=BASE_FORMATS, help="with --lora: the frozen base's format (packed: fp8 … mxfp4)")
    ft.add_argument("--quantize-head", action="store_true", help="with a packed base: the head (and a tied embedding) packed too")
    ft.add_argument("--adapter-dtype", default="fp32", choices=("fp32", "bf16"), help="the adapters' parameters")
    ft.add_argument("--base-keep", default=None, metavar="GLOBS", help="layers of a packed base held in FP8 (train's --base-keep)")
    ft.add_argument("--base-policy", default=None, metavar="JSON", help="layers of a packed base in other formats (train's --base-policy)")
    ft.add_argument("--data", default=None, help="with --measure: text for the training step (default: the Python stdlib sources)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from minifloat.planner.memory import OFFLOADABLE, SHAPES, measured_state, parse_params, plan
    from minifloat.report.table import markdown_table

    if args.pretrained is not None:
        if args.params or args.model:
            raise MinifloatError("give MODEL, --model or --params, one of them")
        return _finetune(args)
    if not (args.params or args.model):
        raise MinifloatError("what to plan: a pretrained MODEL, --model (a built-in GPT) or --params (a size)")
    offload = tuple(o.strip() for o in args.offload.split(",") if o.strip())
    for o in offload:
        if o not in OFFLOADABLE:
            raise MinifloatError(f"--offload {o!r}: use {' and/or '.join(OFFLOADABLE)}")
    if args.model:
        from minifloat.models.gpt import GPT, get_config

        c = get_config(args.model)
        n = GPT(c).num_params()
        hidden, layers, heads, vocab, layout = c.n_embd, c.n_layer, c.n_head, c.vocab_size, args.layout or "minifloat"
        if args.seq > c.block_size:
            raise MinifloatError(f"--seq {args.seq} exceeds the {args.model} GPT's context of {c.block_size}")
    else:
        n, named = parse_params(args.params)
        shape = SHAPES.get(named) if named else None
        hidden, layers, heads, vocab = ((args.hidden, args.layers, args.heads, args.vocab) if args.hidden
                                        else shape if shape else (None, None, None, None))  # fmt: skip
        layout = args.layout or "te"
    p = plan(params=n, precision=args.precision, layout=layout, master=args.master, optimizer=args.optimizer,
             optimizer_states=args.optimizer_states,
             world_size=args.world_size, batch=args.batch, seq=args.seq, hidden=hidden, layers=layers, heads=heads,
             vocab=vocab, flash=not args.no_flash, fp8_all_gather=args.fp8_all_gather)  # fmt: skip
    rows = p.table(offload)
    result = {"params": n, "precision": args.precision, "layout": layout, "offload": list(offload), "rows": rows}
    if args.measure:
        if not args.model:
            raise MinifloatError("--measure builds a built-in GPT's training state: use it with --model")
        m = measured_state(args.model, args.precision, batch=args.batch, seq=args.seq, optimizer_states=args.optimizer_states,
                           master=args.master)  # fmt: skip
        result["measured"] = {k: {"planned": p.rows.get(k, 0.0), "measured": v}
                              for k, v in m.items() if k != "num_params"}  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{n / 1e9:.3g}B parameters, {args.precision}, {layout} layout, {args.world_size} device(s), "
          f"batch {args.batch} × {args.seq} tokens" + (f", offload: {', '.join(offload)}" if offload else ""))
    print(markdown_table(("category", "GB", "GiB", "where", "assumption"),
                         [(r["category"], f"{r['bytes'] / 1e9:.3g}", f"{r['gib']:.3g}", r["where"], r["assumption"]) for r in rows]))  # fmt: skip
    if "measured" in result:
        print("\nagainst the real training state (tensors counted):")
        print(markdown_table(("category", "planned bytes", "measured bytes", "measured / planned"),
                             [(k, f"{v['planned']:,.0f}", f"{v['measured']:,}", f"{v['measured'] / v['planned']:.3f}" if v["planned"] else "")
                              for k, v in result["measured"].items()]))  # fmt: skip
    return 0


def _finetune(args: argparse.Namespace) -> int:
    """`memory MODEL`: the fine-tune's planned state (`minifloat.planner.finetune`), and with
    --measure the state of one real training step beside it."""
    from minifloat.planner.finetune import MEASURED, plan_finetune
    from minifloat.report.table import markdown_table

    full = {"fp32": "fp32", "bf16": "bf16", "fp8": "fp8", "mxfp8": "mxfp8", "nvfp4": "nvfp4"}[args.precision]
    if args.base_policy is not None and not (args.lora and args.base in PACKED_FORMATS):
        raise MinifloatError(f"--base-policy sets the formats of a LoRA run's packed base: add --lora RANK and --base "
                             f"{' / '.join(PACKED_FORMATS)} (got --lora {args.lora} --base {args.base})")  # fmt: skip
    planned = plan_finetune(args.pretrained, precision=full, lora_rank=args.lora, base=args.base, quantize_head=args.quantize_head,
                            adapter_dtype=args.adapter_dtype, master=args.master, optimizer_states=args.optimizer_states,
                            batch=args.batch, seq=args.seq, base_keep=globs_arg(args.base_keep),
                            base_policy=None if args.base_policy is None else base_policy_pairs(policy_arg(args.base_policy)))  # fmt: skip
    what = f"LoRA rank {args.lora} on a {args.base} base" if args.lora else f"full fine-tune, {full}"
    result: dict = {"model": args.pretrained, "plan": what, "planned": planned}
    if args.measure:
        result["measured"] = _measure(args, full)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{args.pretrained}: {what}; the training state and the activations of one {args.batch} × {args.seq} micro-batch")
    rows = []
    for k, v in planned.items():
        row = [k, f"{v:,}", f"{v / 2**20:,.1f}"]
        if "measured" in result:
            got = sum(result["measured"][m] for m in MEASURED[k])
            row += [f"{got:,}", f"{got / v:.3f}" if v else ""]
        rows.append(row)
    head = ("category", "planned bytes", "MiB") + (("measured bytes", "measured / planned") if "measured" in result else ())
    print(markdown_table(head, rows))
    return 0


def _measure(args: argparse.Namespace, precision: str) -> dict:
    """One training step of the fine-tune in a scratch folder; the state it held, counted."""
    import tempfile
    from pathlib import Path

    from minifloat.finetune import PretrainedTask
    from minifloat.planner.finetune import measured_activations
    from minifloat.train.config import TrainConfig
    from minifloat.train.loop import train

    c = TrainConfig(pretrained=args.pretrained, precision=args.base if args.lora else precision, lora_rank=args.lora,
                    quantize_head=args.quantize_head, adapter_dtype=args.adapter_dtype, master=args.master,
                    optimizer_states=args.optimizer_states, steps=1, batch_size=args.batch, seq_len=args.seq,
                    eval_every=0, data=args.data, checkpoint_minutes=0, telemetry_every=0, base_keep=globs_arg(args.base_keep),
                    base_policy=policy_arg(args.base_policy))  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        train(c, Path(tmp) / "run", progress=False, task=PretrainedTask())
        state = json.loads((Path(tmp) / "run" / "footprint.json").read_text())["state_bytes"]
    return {**state, "activations": measured_activations(c)}
