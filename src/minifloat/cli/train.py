"""`minifloat train`: train the built-in GPT in one precision, with checkpoints and a JSONL log."""

from __future__ import annotations

import argparse
import json

from minifloat.train.trainer import PRECISIONS, TrainConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train the built-in GPT in one precision")
    p.add_argument("--precision", default="fp32", choices=PRECISIONS, metavar="{" + ",".join(PRECISIONS) + "}")
    p.add_argument("--model", default="small", choices=["tiny", "small", "base"])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: at the end)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--data", default=None, help="UTF-8 text file or folder (default: the Python stdlib sources)")
    p.add_argument("--out", default="runs/train", help="output folder (log.jsonl, checkpoints/)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def config_from_args(args: argparse.Namespace, **override) -> TrainConfig:
    fields = dict(
        precision=args.precision, model=args.model, steps=args.steps, batch_size=args.batch_size,
        seq_len=args.seq_len, lr=args.lr, warmup=args.warmup, grad_accum=args.grad_accum,
        grad_clip=args.grad_clip, seed=args.seed, eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every, compile=args.compile,
        activation_checkpointing=args.activation_checkpointing, data=args.data,
    )  # fmt: skip
    fields.update(override)
    return TrainConfig(**fields)


def run(args: argparse.Namespace) -> int:
    from minifloat.train.trainer import train

    result = train(config_from_args(args), args.out, resume=args.resume, progress=not args.quiet)
    final = {k: v for k, v in result["final"].items() if k != "telemetry"}
    print(json.dumps({"final": final, "log": result["log"], "params": result["params"]}))
    return 0
