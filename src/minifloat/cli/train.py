"""`minifloat train`: train the built-in GPT in one precision, or fine-tune a pretrained model
(MODEL: full, SFT, LoRA on a packed base), with checkpoints and a JSONL log."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from minifloat.cli.defaults import keyword_defaults
from minifloat.errors import MinifloatError
from minifloat.io import jsonio
from minifloat.models.gpt import GPT_SIZES
from minifloat.optim.states import MASTERS, STATE_FORMATS
from minifloat.train.config import (
    ADAPTER_DTYPES,
    BASE_COMPUTES,
    BASE_FORMATS,
    BASE_METHODS,
    LORA_INITS,
    PRECISIONS,
    TrainConfig,
)

DEFAULTS = keyword_defaults(TrainConfig)  # the flags' defaults are TrainConfig's


INTEGER_FLAGS = {
    "steps": "optimizer steps",
    "batch_size": "sequences per micro-batch",
    "warmup": "steps of linear lr warmup before the cosine decay",
    "grad_accum": "micro-batches per optimizer step",
    "seed": "initial weights, data order and stochastic rounding",
    "eval_every": "steps between validation losses, and one after the last step",
}


def add_training_arguments(p: argparse.ArgumentParser, eval_zero: str) -> None:
    """The options `train` and `compare` share: model, schedule, data (defaults: `TrainConfig`'s).
    `eval_zero` says what ``--eval-every 0`` does in the command."""
    p.add_argument("pretrained", nargs="?", default=None, metavar="MODEL",
                   help="fine-tune this pretrained model (a transformers folder, a .gguf file, or an earlier fine-tune's "
                        "output) instead of training the built-in GPT (--model) from scratch")  # fmt: skip
    p.add_argument("--model", default=DEFAULTS["model"], choices=list(GPT_SIZES), help="GPT size (without MODEL)")
    for name, text in INTEGER_FLAGS.items():
        text += f"; 0 for {eval_zero}" if name == "eval_every" else ""
        p.add_argument("--" + name.replace("_", "-"), type=int, default=DEFAULTS[name], help=text)
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 128, or the model's block size if smaller)")
    p.add_argument("--lr", type=float, default=None,
                   help="peak AdamW learning rate (default 1e-3 from scratch, 3e-5 for a full fine-tune, 2e-4 for LoRA)")
    p.add_argument("--grad-clip", type=float, default=DEFAULTS["grad_clip"], help="largest gradient norm, 0 for no clipping")
    p.add_argument("--eval-batches", type=int, default=DEFAULTS["eval_batches"], help="held-out batches per evaluation")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each block's activations in backward")
    p.add_argument(
        "--telemetry-every", type=int, default=DEFAULTS["telemetry_every"], help="steps between amax/scale records, 0 for none"
    )
    p.add_argument(
        "--quantize-head", action="store_true", help="quantize the LM head too (default: high precision)"
    )
    p.add_argument(
        "--high-precision-first", type=int, default=DEFAULTS["high_precision_first"], metavar="N",
        help="keep the first N transformer blocks in high precision",
    )  # fmt: skip
    p.add_argument(
        "--high-precision-last", type=int, default=DEFAULTS["high_precision_last"], metavar="N",
        help="keep the last N transformer blocks in high precision (the NVFP4 recipe's advice)",
    )  # fmt: skip
    p.add_argument(
        "--precision-switch", type=float, default=DEFAULTS["precision_switch"], metavar="FRACTION",
        help="train the last FRACTION of the steps in BF16 (a recipe's every GEMM), as NVIDIA's NVFP4 recipe closes "
             "what is left of its gap; validation after the switch is in BF16 too; 0: off",
    )  # fmt: skip
    p.add_argument(
        "--outlier-channels", type=int, default=DEFAULTS["outlier_channels"], metavar="K",
        help="in each forward GEMM of a recipe's Linears, multiply the K input channels of largest magnitude in BF16 "
             "(TetraJet-v2's OutControl): an outlier no longer sets the scale of the FP4 block it shares",
    )  # fmt: skip
    p.add_argument(
        "--data", default=None, help="UTF-8 text file or folder (default: the Python stdlib sources)"
    )
    ft = p.add_argument_group("fine-tuning a pretrained MODEL")
    ft.add_argument("--sft", default=None, metavar="JSONL",
                    help="supervised fine-tuning on these records ('messages' with the chat template, or 'prompt' / "
                         "'completion'); the loss counts the responses only")  # fmt: skip
    ft.add_argument("--lora", dest="lora_rank", type=int, default=0, metavar="RANK",
                    help="train LoRA adapters of this rank on the frozen base (--base) instead of every weight")
    ft.add_argument("--lora-alpha", type=float, default=DEFAULTS["lora_alpha"], help="the adapters' scale is alpha / rank")
    ft.add_argument("--lora-dropout", type=float, default=DEFAULTS["lora_dropout"], help="dropout on the adapters' input")
    ft.add_argument("--lora-targets", default=None, metavar="GLOBS",
                    help="comma-separated module names or globs to adapt (default: every Linear of the decoder layers)")
    ft.add_argument("--base-method", default=DEFAULTS["base_method"], choices=BASE_METHODS,
                    help="how a packed LoRA base is quantized: round to nearest, or GPTQ on the training text")
    ft.add_argument("--base-keep", default=None, metavar="GLOBS",
                    help="comma-separated layer names or globs of a packed base held in FP8 (fp8-weight-only) instead, "
                         "e.g. '*.k_proj,*.v_proj'")  # fmt: skip
    ft.add_argument("--base-policy", default=None, metavar="JSON",
                    help="a JSON object of layer names or globs → packed formats (first match wins; --base for the rest), "
                         "e.g. the policy-auto-*.json that `minifloat adapt` writes for a bit budget")  # fmt: skip
    ft.add_argument("--adapter-dtype", default=DEFAULTS["adapter_dtype"], choices=ADAPTER_DTYPES,
                    help="the adapters' parameters")
    ft.add_argument("--base-compute", default=DEFAULTS["base_compute"], choices=BASE_COMPUTES,
                    help="the dtype a packed base's weight is dequantized to for each product (QLoRA's compute dtype; "
                         "auto: bf16 where the CPU multiplies BF16 natively, as `minifloat info` says, else fp32)")  # fmt: skip
    ft.add_argument("--lora-init", default=DEFAULTS["lora_init"], choices=LORA_INITS,
                    help="how the adapters start: zero (PEFT's: from the frozen base) or residual (a packed base: the "
                         "best rank-r correction of its quantization error on calibration windows of the text, CLoQ's)")  # fmt: skip


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train the built-in GPT in one precision, or fine-tune a pretrained MODEL")
    p.add_argument(
        "--precision", default=None, choices=PRECISIONS, metavar="{" + ",".join(PRECISIONS) + "}",
        help=f"the number formats of the run (`minifloat info`: how each computes here; default {DEFAULTS['precision']})",
    )
    add_training_arguments(p, eval_zero="none")
    p.add_argument("--base", default=None, choices=BASE_FORMATS,
                   help="with --lora: the frozen base's format (default bf16; fp8 … mxfp4: packed, weight-only)")
    p.add_argument("--merge", action="store_true", help="with --lora: also write the merged model (out/merged)")
    p.add_argument(
        "--checkpoint-every", type=int, default=DEFAULTS["checkpoint_every"], help="steps between checkpoints, 0 for none by steps"
    )
    p.add_argument(
        "--checkpoint-minutes", type=float, default=DEFAULTS["checkpoint_minutes"],
        help="minutes between checkpoints, so that a killed run loses at most this; 0 for none by time (one is always written at the end)",
    )  # fmt: skip
    p.add_argument("--keep-checkpoints", type=int, default=DEFAULTS["keep_checkpoints"], help="the newest checkpoints kept")
    p.add_argument("--optimizer-states", default=DEFAULTS["optimizer_states"], choices=list(STATE_FORMATS),
                   help="how AdamW stores its moments: fp32 (torch's AdamW), bf16, fp8 (E4M3, a scale per 128), "
                        "fp8-dre (COAT's dynamic range expansion first); minifloat.optim.AdamW")  # fmt: skip
    # --master-weights: the same option under torchrun, whose own parser takes "--master" for an
    # abbreviation of its --master-addr / --master-port and stops there.
    p.add_argument("--master", "--master-weights", dest="master", default=DEFAULTS["master"], choices=list(MASTERS),
                   help="the master weights: fp32 (FP32 parameters), bf16-sr (BF16 parameters, updates rounded "
                        "stochastically), bf16+remainder (BF16 parameters and an int16 remainder: the FP32 master exactly); "
                        "bf16-* store the parameters and gradients in BF16; the model still computes in FP32 (casts on use). "
                        "Under torchrun spell it --master-weights (torchrun takes --master for its own options)")  # fmt: skip
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (run under torchrun; gloo on CPU)")
    p.add_argument("--fp8-all-gather", action="store_true",
                   help="with --fsdp and fp8-current or mxfp8: all-gather the quantized Linear weights as codes and scales "
                        "(half the bytes of a BF16 all-gather)")  # fmt: skip
    p.add_argument("--config", default=None, metavar="JSON",
                   help="a TrainConfig as JSON (as `minifloat compare` writes); of the other flags only --out, --resume, --overwrite and --quiet apply")  # fmt: skip
    p.add_argument("--out", default="runs/train", help="output folder (log.jsonl, checkpoints/)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--overwrite", action="store_true", help="delete an earlier run's log and checkpoints in --out first")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def globs_arg(arg: str | None) -> tuple[str, ...] | None:
    """A comma-separated list of globs (`--lora-targets`, `--base-keep`) as a tuple; None stays None."""
    return None if arg is None else tuple(t.strip() for t in arg.split(",") if t.strip())


def policy_arg(path: str | None) -> dict | None:
    """The JSON object in the file `path` (`--base-policy`), checked to be one; None stays None
    (`TrainConfig` checks its formats)."""
    if path is None:
        return None
    try:
        policy = jsonio.loads(Path(path).read_text())
    except OSError as err:
        raise MinifloatError(f"--base-policy {path}: cannot read it ({err.strerror or err})") from None
    except ValueError as err:
        raise MinifloatError(f"--base-policy {path}: not JSON ({err})") from None
    if not isinstance(policy, dict):
        raise MinifloatError(f"--base-policy {path}: holds a {type(policy).__name__}, not an object of layer globs → formats")
    return policy


def config_from_args(args: argparse.Namespace, **override) -> TrainConfig:
    """The TrainConfig the flags describe (`override` sets fields the command fixes itself)."""
    if getattr(args, "config", None) is not None:
        return TrainConfig.from_json(args.config)
    fields = dict(
        model=args.model, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
        warmup=args.warmup, grad_accum=args.grad_accum, grad_clip=args.grad_clip, seed=args.seed,
        eval_every=args.eval_every, eval_batches=args.eval_batches, compile=args.compile, activation_checkpointing=args.activation_checkpointing,
        data=args.data, quantize_head=args.quantize_head, high_precision_first=args.high_precision_first, high_precision_last=args.high_precision_last,
        precision_switch=args.precision_switch, outlier_channels=args.outlier_channels, telemetry_every=args.telemetry_every,
        pretrained=args.pretrained, sft=args.sft, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
        lora_targets=globs_arg(args.lora_targets), base_keep=globs_arg(args.base_keep), base_policy=policy_arg(args.base_policy),
        base_method=args.base_method, adapter_dtype=args.adapter_dtype, lora_init=args.lora_init, base_compute=args.base_compute,
    )  # fmt: skip
    precision, base = getattr(args, "precision", None), getattr(args, "base", None)
    if base is not None and not args.lora_rank:
        raise MinifloatError("--base is the frozen base of a LoRA run: add --lora RANK (a full fine-tune takes --precision)")
    if args.lora_rank and precision is not None:
        raise MinifloatError("with --lora the base is frozen and --base names its format; --precision is a full "
                             "fine-tune's recipe: pass --base instead")  # fmt: skip
    if args.lora_rank and hasattr(args, "base"):
        fields["precision"] = base or "bf16"
    elif precision is not None:
        fields["precision"] = precision
    for name in ("merge", "checkpoint_every", "checkpoint_minutes", "keep_checkpoints", "optimizer_states", "master", "fsdp", "fp8_all_gather"):
        if hasattr(args, name):
            fields[name] = getattr(args, name)
    fields.update(override)
    return TrainConfig(**fields)


def run(args: argparse.Namespace) -> int:
    from minifloat.train.loop import train

    c = config_from_args(args)
    task = None
    if c.pretrained is not None:
        from minifloat.finetune import PretrainedTask

        task = PretrainedTask()
    result = train(c, args.out, resume=args.resume, overwrite=args.overwrite, progress=not args.quiet, task=task)
    final = {k: v for k, v in result["final"].items() if k != "telemetry"}
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for the run
        delivered = {k: result[k] for k in ("model", "adapter", "merged") if k in result}
        print(jsonio.dumps({"final": final, "log": result["log"], "params": result["params"], **delivered}))
    if c.fsdp and getattr(args, "owns_process", False):
        _leave_without_teardown()
    return 0


def _leave_without_teardown() -> None:
    """End a torchrun rank now that its files are written and its process group destroyed,
    without the interpreter's teardown: there gloo's threads can still hold work objects and abort
    the rank ("terminate called without an active exception", pytorch/pytorch#179291; seen in CI
    on a 2-rank run that had finished), which torchrun reports as the whole run failing."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
