"""Training the built-in GPT in one precision: the loop behind ``minifloat train``.

Reads top to bottom: build data and model, convert the model to the precision, then for each
step accumulate gradients over micro-batches, unscale/clip/step, log a JSONL line, evaluate
now and then, and checkpoint. Every random draw comes from generators whose states are in the
checkpoint, so ``resume=True`` continues bit-identically.

With ``fsdp=True`` (under ``torchrun``) each transformer block and the whole model are sharded
with FSDP2 ``fully_shard`` (gloo on CPU); every rank draws the same global batch and takes its
slice, so the loss curve is that of one process. Checkpoints hold full (gathered) weights and
an FQN-keyed optimizer state either way, so sharded and single-process runs resume each other.

Precisions: ``fp32``; ``bf16``/``fp16`` (GEMM operands rounded to that dtype with FP32
accumulation — what a BF16/FP16 GEMM computes; torch's CPU autocast is used instead where the
CPU has BF16 units); and every recipe of `minifloat.RECIPES`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from minifloat import jsonio
from minifloat.atomic import atomic_path, remove
from minifloat.devices import native_bf16_cpu
from minifloat.errors import MinifloatError
from minifloat.loss_scaling import LossScaler
from minifloat.recipes import RECIPES
from minifloat.train import checkpoint
from minifloat.train.corpus import Corpus, get_batch, load_corpus, stdlib_corpus
from minifloat.train.model import GPT, get_config

HIGH_PRECISIONS = ("fp32", "bf16", "fp16")
PRECISIONS = HIGH_PRECISIONS + tuple(RECIPES)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    precision: str = "fp32"
    model: str = "small"
    steps: int = 200
    batch_size: int = 16
    seq_len: int | None = None  # None: 128, or the model's block size where that is smaller
    lr: float = 1e-3  # 3e-3 trains the small GPT unstably (BF16 val loss 1.71 vs 1.31 at 600 steps)
    warmup: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_accum: int = 1
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 50
    eval_batches: int = 8
    checkpoint_every: int = 0  # 0: only at the end
    compile: bool = False
    activation_checkpointing: bool = False
    data: str | None = None  # None: the embedded stdlib corpus
    max_bytes: int = 4_000_000
    quantize_head: bool = False
    high_precision_last: int = 0  # keep the Linears of the last N blocks unquantized (NVFP4's advice)
    fsdp: bool = False
    telemetry_every: int = 10  # steps between amax/scale/saturation records (0: off)

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise MinifloatError(f"unknown precision {self.precision!r}; use one of {', '.join(PRECISIONS)}")
        block_size = get_config(self.model).block_size
        if self.seq_len is None:
            object.__setattr__(self, "seq_len", min(128, block_size))
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "eval_batches"):
            if getattr(self, name) < 1:
                raise MinifloatError(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(self, name)}")
        if not 0 <= self.high_precision_last <= get_config(self.model).n_layer:
            raise MinifloatError(
                f"--high-precision-last {self.high_precision_last}: the {self.model} model has "
                f"{get_config(self.model).n_layer} blocks"
            )
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise MinifloatError(f"--lr must be a positive number, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise MinifloatError(f"min_lr_ratio must be in [0, 1] (the final lr as a fraction of --lr), got {self.min_lr_ratio}")
        for name in ("weight_decay", "grad_clip"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise MinifloatError(f"--{name.replace('_', '-')} must be a number ≥ 0 (0: off), got {getattr(self, name)}")
        if self.warmup < 0 or self.max_bytes < 1:
            raise MinifloatError(f"--warmup must be ≥ 0 and max_bytes ≥ 1, got {self.warmup} and {self.max_bytes}")
        if self.telemetry_every < 0 or self.eval_every < 0 or self.checkpoint_every < 0:
            raise MinifloatError(
                "--eval-every, --checkpoint-every and --telemetry-every must be ≥ 0 (0: off)"
            )
        if self.seq_len > block_size:
            raise MinifloatError(f"--seq-len {self.seq_len} exceeds the {self.model} model's block size {block_size}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, path: str | Path) -> TrainConfig:
        """Read a config written by `to_dict` (e.g. by ``minifloat compare``)."""
        try:
            fields = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise MinifloatError(f"cannot read the train config {path}: {err}") from None
        known = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(fields, dict) or set(fields) - known:
            extra = sorted(set(fields) - known) if isinstance(fields, dict) else type(fields).__name__
            raise MinifloatError(
                f"{path}: not a train config (unknown fields {extra}); known: {', '.join(sorted(known))}"
            )
        try:
            return cls(**fields)
        except TypeError as err:  # e.g. "steps": "10": the checks compare numbers
            raise MinifloatError(f"{path}: a field has the wrong type ({err}); write numbers as numbers") from None


def lr_at(step: int, c: TrainConfig) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio · lr``."""
    if step < c.warmup:
        return c.lr * (step + 1) / c.warmup
    progress = (step - c.warmup) / max(1, c.steps - c.warmup)
    return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


class _RoundedLinearFunction(torch.autograd.Function):
    """A GEMM on operands rounded to `dtype` with FP32 accumulation (BF16/FP16 emulation)."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        xr, wr = x.to(dtype).float(), weight.to(dtype).float()
        ctx.save_for_backward(xr, wr)
        ctx.dtype, ctx.has_bias = dtype, bias is not None
        out = xr @ wr.t()
        if bias is not None:
            out = out + bias.float()
        return out.to(dtype).float().to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        xr, wr = ctx.saved_tensors
        gr = g.to(ctx.dtype).float()
        g2 = gr.reshape(-1, gr.shape[-1])
        grad_x = (gr @ wr).to(ctx.dtype).float()
        grad_w = g2.t() @ xr.reshape(-1, xr.shape[-1])
        grad_b = g2.sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


class RoundedLinear(torch.nn.Linear):
    """nn.Linear computing as a BF16/FP16 GEMM with FP32 accumulation would (weights stay FP32)."""

    rounding_dtype = torch.bfloat16

    def forward(self, x):
        return _RoundedLinearFunction.apply(x, self.weight, self.bias, self.rounding_dtype)


def _swap_rounded(model: torch.nn.Module, dtype: torch.dtype, keep) -> None:
    for fqn, m in list(model.named_modules()):
        if type(m) is torch.nn.Linear and keep(fqn, m):
            parent_name, _, child = fqn.rpartition(".")
            new = RoundedLinear(m.in_features, m.out_features, m.bias is not None, device="meta")
            new.weight, new.bias, new.rounding_dtype = m.weight, m.bias, dtype
            setattr(model.get_submodule(parent_name), child, new)


def build_model(c: TrainConfig) -> GPT:
    """The GPT for `c`, initialised from `c.seed`, converted to `c.precision`."""
    torch.manual_seed(c.seed)
    model = GPT(get_config(c.model))
    n_layer = get_config(c.model).n_layer
    high = {f"blocks.{i}." for i in range(n_layer - c.high_precision_last, n_layer)}

    def keep(fqn: str, m) -> bool:  # True: quantize this Linear
        return (c.quantize_head or fqn != "lm_head") and not any(fqn.startswith(h) for h in high)

    if c.precision in RECIPES:
        from minifloat.nn.convert import convert

        convert(model, c.precision, filter=keep)
    elif c.precision in ("bf16", "fp16") and not (c.precision == "bf16" and native_bf16_cpu()):
        _swap_rounded(model, torch.bfloat16 if c.precision == "bf16" else torch.float16, keep)
    return model


def _autocast_ctx(c: TrainConfig):
    import contextlib

    if c.precision == "bf16" and native_bf16_cpu():
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def load_data(c: TrainConfig) -> Corpus:
    return stdlib_corpus(c.max_bytes) if c.data is None else load_corpus(c.data, c.max_bytes)


def _weights(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    sd = dict(sd)
    sd.pop("lm_head.weight", None)  # tied to wte.weight
    return {k: v.detach().contiguous() for k, v in sd.items()}


def _mean_over_ranks(value: float, world: int) -> float:
    t = torch.tensor(value, dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return float(t) / world


@torch.no_grad()
def evaluate(model, data: torch.Tensor, c: TrainConfig) -> float:
    """Mean loss over `eval_batches` fixed windows (the same for every precision and step)."""
    g = torch.Generator().manual_seed(10_000 + c.seed)
    model.eval()
    total = 0.0
    with _autocast_ctx(c):
        for _ in range(c.eval_batches):
            x, y = get_batch(data, c.batch_size, c.seq_len, g)
            logits = model(x)
            total += torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)
            ).item()
    model.train()
    return total / c.eval_batches


def _init_distributed(c: TrainConfig) -> tuple[int, int, bool]:
    """(rank, world size, whether we created the process group): (0, 1, False) without
    ``fsdp``; under torchrun, a gloo process group unless the caller already made one."""
    if not c.fsdp:
        return 0, 1, False
    import torch.distributed as dist

    if "WORLD_SIZE" not in os.environ and not dist.is_initialized():
        raise MinifloatError(
            "--fsdp runs under torchrun, e.g.: torchrun --nproc_per_node 2 -m minifloat train --fsdp ..."
        )
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if c.batch_size % world:
        raise MinifloatError(f"--batch-size {c.batch_size} must be a multiple of the {world} FSDP ranks")
    return rank, world, created


def _shard(model: GPT, world: int) -> None:
    """FSDP2: shard each transformer block, then the rest (embeddings, tied head) at the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _state_options(c: TrainConfig):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=c.fsdp)


def read_log(path: str | Path) -> list[dict]:
    """The JSONL records of a run (a torn last line from a killed run ends them)."""
    return [rec for _, rec in _log_lines(Path(path))]


def _log_lines(path: Path) -> list[tuple[str, dict]]:
    out = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append((line, jsonio.loads(line)))
        except json.JSONDecodeError:
            break
    return out


def _rewind_log(path: Path, step: int) -> dict:
    """On resume from the checkpoint of `step`: keep the log's records up to it and return the
    last. A run killed after logging later steps (or mid-line) would otherwise have them twice,
    and a torn line would hide every record after it."""
    keep = [(line, rec) for line, rec in _log_lines(path) if rec.get("step", 0) <= step]
    text = "".join(line + "\n" for line, _ in keep)
    if path.exists() and path.read_text() != text:
        with atomic_path(path) as tmp:
            tmp.write_text(text)
    return keep[-1][1] if keep else {}


def _resume_state(c: TrainConfig, model: GPT, ckpt_root: Path) -> dict:
    """Load the latest checkpoint's weights into the (unsharded) `model`; return its state."""
    path = checkpoint.latest_checkpoint(ckpt_root)
    if path is None:
        raise MinifloatError(f"--resume: no checkpoint under {ckpt_root}")
    manifest, weights, state = checkpoint.load_checkpoint(path)
    theirs = manifest["config"]
    for key in ("model", "batch_size", "seq_len", "grad_accum", "seed", "data", "max_bytes"):
        if theirs.get(key) != getattr(c, key):
            raise MinifloatError(
                f"{path}: checkpoint has {key}={theirs.get(key)!r}, this run {key}={getattr(c, key)!r}; "
                f"resume with the same {key}"
            )
    missing, unexpected = model.load_state_dict(weights, strict=False)
    bad = [
        k
        for k in missing
        if k != "lm_head.weight" and not k.endswith(("amax_history", "scale", "amax_steps"))
    ]
    if bad or unexpected:
        raise MinifloatError(
            f"{path}: weights do not fit the {c.model} model (missing {bad[:3]}, unexpected {unexpected[:3]})"
        )
    state["path"] = str(path)
    return state


def train(
    c: TrainConfig,
    out: str | Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    monitor: bool = True,
) -> dict:
    """Train per `c`, writing ``log.jsonl`` and checkpoints under `out`; returns a summary.

    ``log.jsonl`` holds one strict JSON record per step (a diverged loss is the string ``"nan"``,
    `minifloat.jsonio.loads` reads it back as a float).

    A fresh run (not `resume`) refuses an `out` that holds an earlier run's log or checkpoints
    unless `overwrite`, which deletes them first."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    rank, world, own_group = _init_distributed(c)
    main = rank == 0
    out = Path(out)
    ckpt_root, log_path = out / "checkpoints", out / "log.jsonl"
    if out.exists() and not out.is_dir():
        raise MinifloatError(f"--out {out} is a file; give a folder for the log and the checkpoints")
    if resume and overwrite:
        raise MinifloatError("--resume continues the run in --out and --overwrite deletes it; pass one of them")
    if not resume:
        _clear_previous_run(ckpt_root, log_path, overwrite, main)
    out.mkdir(parents=True, exist_ok=True)
    data = load_data(c)
    model = build_model(c)
    state = _resume_state(c, model, ckpt_root) if resume else None
    if c.fsdp:
        _shard(model, world)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": c.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=c.lr, betas=(0.9, 0.95), eps=1e-8,
    )  # fmt: skip
    scaler = LossScaler(enabled=c.precision == "fp16")
    data_gen = torch.Generator().manual_seed(c.seed)
    start, last = 0, {}
    if state is not None:
        try:
            set_optimizer_state_dict(model, opt, state["optimizer"], options=_state_options(c))
        except (KeyError, ValueError, RuntimeError) as err:
            raise MinifloatError(
                f"{state['path']}: the optimizer state does not fit this model ({err})"
            ) from None
        scaler.load_state_dict(state["scaler"])
        data_gen.set_state(state["data_rng"])
        rngs = state.get("torch_rng_ranks") or [state["torch_rng"]]
        torch.set_rng_state(rngs[rank] if len(rngs) == world else rngs[0])
        start = int(state["step"])
        if start > c.steps:
            raise MinifloatError(
                f"--resume: {state['path']} is at step {start}, past --steps {c.steps}; "
                f"pass --steps {start} or more (equal: nothing left to train)"
            )
        if main:
            last = _rewind_log(log_path, start)
    if c.compile:
        model = torch.compile(model)
    if c.activation_checkpointing:
        _enable_activation_checkpointing(model)

    mon = None
    if monitor and c.telemetry_every and c.precision in RECIPES:
        from minifloat.monitor import Monitor

        mon = Monitor(model, every=c.telemetry_every)
        mon.step = start
    bar = _progress(c.steps, start, progress and main)
    tokens_per_step = c.batch_size * c.seq_len * c.grad_accum
    for step in range(start, c.steps):
        t0 = time.perf_counter()
        if mon is not None:
            mon.step = step  # a skipped optimizer step (non-finite gradients) is a step here too
        lr = lr_at(step, c)
        for group in opt.param_groups:
            group["lr"] = lr
        loss_sum = 0.0
        for _ in range(c.grad_accum):
            x, y = get_batch(data.train, c.batch_size, c.seq_len, data_gen)
            if world > 1:  # every rank drew the same global batch: take this rank's rows
                per = c.batch_size // world
                x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
            with _autocast_ctx(c):
                logits = model(x)
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)
            )
            scaler.scale(loss / c.grad_accum).backward()
            loss_sum += loss.item() / c.grad_accum
        if world > 1:
            loss_sum = _mean_over_ranks(loss_sum, world)
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), c.grad_clip if c.grad_clip > 0 else float("inf")
        )
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        stepped = scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        last = {
            "step": step + 1, "loss": loss_sum, "lr": lr, "grad_norm": grad_norm, "step_time_s": dt,
            "tokens_per_s": tokens_per_step / dt, "skipped": not stepped, "skipped_steps": scaler.skipped_steps,
            "nonfinite": not math.isfinite(loss_sum),
        }  # fmt: skip
        if mon is not None:
            last["telemetry"] = _telemetry(mon)
            mon.records.clear()
        if c.eval_every and ((step + 1) % c.eval_every == 0 or step + 1 == c.steps):
            last["val_loss"] = evaluate(model, data.val, c)
        if main:
            with open(log_path, "a") as f:
                f.write(jsonio.dumps(last) + "\n")
        bar(last)
        if (c.checkpoint_every and (step + 1) % c.checkpoint_every == 0) or step + 1 == c.steps:
            # Collective under FSDP: every rank gathers, rank 0 writes.
            inner = _unwrap(model)
            weights = get_model_state_dict(inner, options=_state_options(c))
            state = {
                "optimizer": get_optimizer_state_dict(inner, opt, options=_state_options(c)),
                "scaler": scaler.state_dict(), "data_rng": data_gen.get_state(),
                "torch_rng": torch.get_rng_state(), "step": step + 1,
            }  # fmt: skip
            if world > 1:
                rngs = [None] * world
                torch.distributed.all_gather_object(rngs, torch.get_rng_state())
                state["torch_rng_ranks"] = rngs
            if main:
                checkpoint.save_checkpoint(ckpt_root, step + 1, _weights(weights), state, c.to_dict())
            if world > 1:
                torch.distributed.barrier()
    if mon is not None:
        mon.close()
    bar(None)
    if own_group:  # every rank done before the teardown (gloo can abort a rank that tears down early)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return {"config": c.to_dict(), "final": last, "log": str(log_path), "params": _unwrap(model).num_params()}


def _clear_previous_run(ckpt_root: Path, log_path: Path, overwrite: bool, main: bool) -> None:
    """Refuse to start over an earlier run's results, or (`overwrite`) delete them (rank 0)."""
    found = [p for p in (log_path, ckpt_root) if p.exists()]
    if not found:
        return
    if not overwrite:
        latest = checkpoint.latest_checkpoint(ckpt_root, verify=False)
        held = f"a checkpoint ({latest.name})" if latest is not None else " and ".join(p.name for p in found)
        raise MinifloatError(
            f"{log_path.parent} already holds a run ({held}); pass --resume to continue it, "
            "--overwrite to delete it and start over, or another --out"
        )
    if main:
        for path in found:
            remove(path)


def _unwrap(model):
    return getattr(model, "_orig_mod", model)


def _enable_activation_checkpointing(model) -> None:
    from torch.utils.checkpoint import checkpoint as ckpt

    for block in _unwrap(model).blocks:
        fwd = block.forward
        block.forward = lambda x, fwd=fwd: ckpt(fwd, x, use_reentrant=False)


def _telemetry(mon) -> dict:
    """Compact per-step telemetry: the worst saturation / flush fractions and a few amaxes."""
    recs = mon.records
    if not recs:
        return {"first_nonfinite": mon.first_nonfinite} if mon.first_nonfinite else {}
    worst_sat = max(recs, key=lambda r: r["saturated"])
    return {
        "max_saturated": worst_sat["saturated"],
        "max_saturated_at": f"{worst_sat['layer']}:{worst_sat['operand']}",
        "max_flushed": max(r["flushed"] for r in recs),
        "amax": {
            f"{r['layer']}:{r['operand']}": r["amax"] for r in recs if r["layer"].startswith("blocks.0.")
        },
        "scale": {
            f"{r['layer']}:{r['operand']}": r["scale"] for r in recs if r["layer"].startswith("blocks.0.")
        },
        "first_nonfinite": mon.first_nonfinite,
    }


def _progress(total: int, start: int, enabled: bool):
    if not enabled:
        return lambda rec: None
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None and os.environ.get("MINIFLOAT_NO_TQDM") != "1":
        pbar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

        def update(rec):
            if rec is None:
                pbar.close()
                return
            pbar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}")
            pbar.update(1)

        return update

    def plain(rec):
        if rec is not None and (rec["step"] % 10 == 0 or rec["step"] == total):
            print(
                f"step {rec['step']}/{total} loss {rec['loss']:.4f} {rec['tokens_per_s']:.0f} tok/s",
                flush=True,
            )

    return plain
