"""Training the built-in GPT in one precision: the loop behind ``minifloat train``.

The pieces it calls live beside it: `config` (TrainConfig, the learning-rate schedule),
`model` (the GPT), `corpus`, `runlog` (log.jsonl, refuse-or-overwrite), `checkpoint` and
`distributed` (FSDP2).

Reads top to bottom: build data and model, convert the model to the precision, then for each
step accumulate gradients over micro-batches, unscale/clip/step, log a JSONL line, evaluate
now and then, and checkpoint. Every random draw comes from generators whose states are in the
checkpoint, so ``resume=True`` continues bit-identically.

With ``fsdp=True`` (under ``torchrun``) each transformer block and the whole model are sharded
with FSDP2 ``fully_shard`` (gloo on CPU); every rank draws the same global batch and takes its
slice, so the loss curve is that of one process. Checkpoints hold full (gathered) weights and
an FQN-keyed optimizer state either way, so sharded and single-process runs resume each other.

Precisions: ``fp32``, ``bf16``, ``fp16`` (how each computes here: `minifloat.nn.rounded`) and
every recipe of `minifloat.RECIPES`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from pathlib import Path

import torch

from minifloat import checkpoint
from minifloat.data.corpus import Corpus
from minifloat.errors import MinifloatError
from minifloat.io.atomic import atomic_path
from minifloat.models.gpt import GPT
from minifloat.nn import rounded
from minifloat.nn.autocast import autocast as recipe_autocast
from minifloat.nn.loss_scaling import LossScaler
from minifloat.nn.monitor import Monitor
from minifloat.optim import AdamW
from minifloat.recipes import RECIPES
from minifloat.train.config import TrainConfig, lr_at
from minifloat.train.distributed import init_distributed, mean_over_ranks, shard, state_options
from minifloat.train.runlog import append_record, clear_previous, rewind_log
from minifloat.train.task import GPTTask, Task, build_gpt, load_data  # noqa: F401 - load_data: the GPT's corpus, re-exported


def build_model(c: TrainConfig) -> GPT:
    """The GPT for `c` (`minifloat.train.task.build_gpt`)."""
    return build_gpt(c)


@contextlib.contextmanager
def computing(c: TrainConfig, step: int):
    """The context step `step` of `c` computes in: the precision's, or from `c.switch_step()` on
    BF16 — a recipe's Linears in high precision (`minifloat.autocast(enabled=False)`) under
    torch.autocast, the GEMMs a GPU switched to BF16 runs."""
    if step < c.switch_step():
        with rounded.autocast(c.precision):
            yield
    else:
        with recipe_autocast(enabled=False), torch.autocast("cpu", dtype=torch.bfloat16):
            yield


@torch.no_grad()
def evaluate(model, data: torch.Tensor | list[dict], c: TrainConfig, task: Task | None = None, *, step: int = 0) -> float:
    """Mean loss over the fixed held-out batches: `data` itself (a task's `val_batches`), or
    `eval_batches` windows of the built-in GPT's validation split `data` (the same for every
    precision and step), computed as step `step` trains (`computing`: after a precision switch,
    in BF16)."""
    if isinstance(data, torch.Tensor):
        task = GPTTask()
        task.data = Corpus(data[:0], data, "validation split", "")
        data = task.val_batches(c)
    model.eval()
    total = 0.0
    with computing(c, step):
        for batch in data:
            total += task.loss(model, batch).item()
    model.train()
    return total / len(data)


def _resume_state(c: TrainConfig, task: Task, model, ckpt_root: Path) -> dict:
    """Load the latest checkpoint's weights into the (unsharded) `model`; return its state."""
    path = checkpoint.latest_checkpoint(ckpt_root)
    if path is None:
        raise MinifloatError(f"--resume: no checkpoint under {ckpt_root}")
    manifest, weights, state = checkpoint.load_checkpoint(path)
    theirs = manifest["config"]
    # the optimizer state's layout follows the state format and the master (absent from older checkpoints: the defaults)
    for key in RESUME_KEYS:
        had = theirs.get(key, RESUME_DEFAULTS[key])
        had = tuple(had) if isinstance(had, list) else had  # JSON holds a tuple (lora_targets) as a list
        if had != getattr(c, key):
            raise MinifloatError(
                f"{path}: checkpoint has {key}={had!r}, this run {key}={getattr(c, key)!r}; resume with the same {key}"
            )
    task.load_weights(model, weights, path)
    state["path"] = str(path)
    return state


# What a resumed run must share with its checkpoint (the data order, the model, the state layout);
# fields absent from older checkpoints read as their defaults here.
RESUME_KEYS = ("model", "batch_size", "seq_len", "grad_accum", "seed", "data", "max_bytes", "optimizer_states", "master",
               "pretrained", "sft", "lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "adapter_dtype", "base_method")  # fmt: skip
RESUME_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}


def train(
    c: TrainConfig,
    out: str | Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    monitor: bool = True,
    task: Task | None = None,
) -> dict:
    """Train per `c`, writing ``log.jsonl`` and checkpoints under `out`; returns a summary.

    ``log.jsonl`` holds one strict JSON record per step (a diverged loss is the string ``"nan"``,
    `minifloat.io.jsonio.loads` reads it back as a float).

    A fresh run (not `resume`) refuses an `out` that holds an earlier run's log or checkpoints
    unless `overwrite`, which deletes them first.

    `task` says what is trained on which data (`minifloat.train.task`); the built-in GPT by default."""
    task = task or GPTTask()
    rank, world, own_group = init_distributed(c)
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

    # Data, model, optimizer; on resume, the checkpoint's weights, optimizer, scaler and RNGs.
    task.prepare(c)
    model = task.build_model(c)
    val = task.val_batches(c) if c.eval_every else []
    state = _resume_state(c, task, model, ckpt_root) if resume else None
    if c.fsdp:
        shard(model, task.blocks(model), world, quantized_gather=c.fp8_all_gather)
    opt = _optimizer(model, c)
    scaler = LossScaler(enabled=c.precision == "fp16")
    data_gen = torch.Generator().manual_seed(c.seed)
    start, last = 0, {}
    if state is not None:
        start = _restore(state, c, model, opt, scaler, data_gen, rank, world)
        if main:
            last = rewind_log(log_path, start)
    if c.compile:
        model = torch.compile(model)
    if c.activation_checkpointing:
        _enable_activation_checkpointing(model, task.blocks(_unwrap(model)))
    recipe = c.precision in RECIPES and not c.lora_rank  # a LoRA run's precision names its frozen base's format
    mon = Monitor(model, every=c.telemetry_every) if monitor and c.telemetry_every and recipe else None
    if start == 0 and c.eval_every and task.evaluate_before:  # where the fine-tune starts from (collective under FSDP)
        base_val_loss = evaluate(model, val, c, task)
        if main:
            footprint(out, base_val_loss=base_val_loss)
    bar = _progress(c.steps, start, progress and main)
    saved_at = time.monotonic()  # the last checkpoint (or the start): the time-interval clock

    for step in range(start, c.steps):
        t0 = time.perf_counter()
        if mon is not None:
            mon.step = step  # a skipped optimizer step (non-finite gradients) is a step here too
        lr = lr_at(step, c)
        for group in opt.param_groups:
            group["lr"] = lr
        loss, grad_norm, stepped = _step(task, model, opt, scaler, data_gen, c, rank, world, step)
        if step == start and main:
            footprint(out, state_bytes=state_bytes(_unwrap(model), opt), rss_after_first_step=resident_bytes())
        dt = time.perf_counter() - t0
        last = {
            "step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm, "step_time_s": dt,
            "tokens_per_s": c.batch_size * c.seq_len * c.grad_accum / dt, "skipped": not stepped,
            "skipped_steps": scaler.skipped_steps, "nonfinite": not math.isfinite(loss),
        }  # fmt: skip
        if step >= c.switch_step():  # a precision switch's steps say so (validation after them is in BF16 too)
            last["computed_in"] = "bf16"
        if mon is not None:
            last["telemetry"] = _telemetry(mon)
            mon.records.clear()
        if c.eval_every and ((step + 1) % c.eval_every == 0 or step + 1 == c.steps):
            last["val_loss"] = evaluate(model, val, c, task, step=step)
        if main:
            append_record(log_path, last)
        bar(last)
        due = bool(c.checkpoint_every and (step + 1) % c.checkpoint_every == 0) or step + 1 == c.steps
        if c.checkpoint_minutes and not due:
            due = _time_is_up(saved_at, c.checkpoint_minutes, world)
        if due:
            _save(ckpt_root, step + 1, c, task, model, opt, scaler, data_gen, main, world)
            saved_at = time.monotonic()

    if mon is not None:
        mon.close()
    bar(None)
    delivered = task.finish(_unwrap(model), out, c) if main else {}
    if own_group:  # every rank done before the teardown (gloo can abort a rank that tears down early)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return {"config": c.to_dict(), "final": last, "log": str(log_path), "params": task.num_params(_unwrap(model)), **delivered}


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """The training state's bytes, counted from the tensors themselves (each storage once):
    parameters (trained and frozen), buffers (a packed base's codes and scales), optimizer state
    (moments, masters) and gradients (one per trained parameter, as at the optimizer step)."""
    seen: set[int] = set()

    def count(tensors) -> int:
        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            t = _local(t)  # an FSDP2 shard: this rank's part
            try:
                key, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
            except RuntimeError:  # a wrapper subclass (the quantized all-gather's) has no storage of its own
                key, size = id(t), t.numel() * t.element_size()
            if key not in seen:
                seen.add(key)
                total += size
        return total

    params = list(model.parameters())
    out = {"trained_parameters": count(p for p in params if p.requires_grad),
           "frozen_parameters": count(p for p in params if not p.requires_grad),
           "buffers": count(model.buffers()),
           "optimizer": count(v for st in opt.state.values() for v in st.values()),
           "gradients": sum(_local(p).numel() * p.element_size() for p in params if p.requires_grad)}  # fmt: skip
    out["total"] = sum(out.values())
    return out


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux: /proc/self/statm), after handing freed heap back
    to the system (glibc's malloc_trim), so that what loading a model freed does not count."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, AttributeError, ValueError):
        return None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def footprint(out: Path, **figures) -> None:
    """Add `figures` to the run's ``footprint.json`` (what `minifloat compare` reports beside the log)."""
    path = out / "footprint.json"
    held = json.loads(path.read_text()) if path.is_file() else {}
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps({**held, **figures}, indent=2))


def _optimizer(model: torch.nn.Module, c: TrainConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on the matrices only (not on norms and biases): torch's with FP32
    moments and FP32 parameters, else `minifloat.optim.AdamW` with the moments stored as
    `c.optimizer_states` and the master weights as `c.master` say."""
    trained = [p for p in model.parameters() if p.requires_grad]  # a LoRA run: the adapters only
    decay = [p for p in trained if p.dim() >= 2]
    no_decay = [p for p in trained if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": c.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if c.optimizer_states != "fp32" or c.master != "fp32":
        return AdamW(groups, lr=c.lr, betas=(0.9, 0.95), eps=1e-8, state_format=c.optimizer_states, master=c.master, seed=c.seed)
    return torch.optim.AdamW(groups, lr=c.lr, betas=(0.9, 0.95), eps=1e-8)


def _step(task: Task, model, opt, scaler: LossScaler, data_gen: torch.Generator, c: TrainConfig,
          rank: int, world: int, step: int) -> tuple[float, float, bool]:  # fmt: skip
    """One optimizer step over `grad_accum` micro-batches: (mean loss, gradient norm before
    clipping, whether the optimizer stepped)."""
    loss_sum = 0.0
    for _ in range(c.grad_accum):
        batch = task.batch(c, data_gen)  # input_ids, labels (B, T), …
        if world > 1:  # every rank drew the same global batch: take this rank's rows
            per = c.batch_size // world
            batch = {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}
        with computing(c, step):
            loss = task.loss(model, batch)
        scaler.scale(loss / c.grad_accum).backward()
        loss_sum += loss.item() / c.grad_accum
    if world > 1:
        loss_sum = mean_over_ranks(loss_sum, world)
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], c.grad_clip if c.grad_clip > 0 else float("inf"))
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    stepped = scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return loss_sum, grad_norm, stepped


def _restore(state: dict, c: TrainConfig, model, opt, scaler: LossScaler, data_gen: torch.Generator,
             rank: int, world: int) -> int:  # fmt: skip
    """Load a checkpoint's optimizer, scaler and RNG states; returns the step it was saved at."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    shards = state.get("optimizer_shards")
    if (shards is not None) != (isinstance(opt, AdamW) and c.fsdp):
        saved = "sharded over FSDP ranks" if shards is not None else "whole"
        raise MinifloatError(f"{state['path']}: its optimizer states are {saved}; resume it "
                             + ("with --fsdp" if shards is not None else "without --fsdp"))  # fmt: skip
    if shards is not None and len(shards) != world:
        raise MinifloatError(f"{state['path']}: its {c.optimizer_states} optimizer states are sharded over {len(shards)} FSDP "
                             f"ranks, this run has {world}; resume with torchrun --nproc_per_node {len(shards)}")  # fmt: skip
    try:
        if shards is not None:
            opt.load_state_dict(shards[rank])
        else:
            set_optimizer_state_dict(model, opt, state["optimizer"], options=state_options(c))
    except (KeyError, ValueError, RuntimeError) as err:
        raise MinifloatError(f"{state['path']}: the optimizer state does not fit this model ({err})") from None
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
    return start


def _save(ckpt_root: Path, step: int, c: TrainConfig, task: Task, model, opt, scaler: LossScaler,
          data_gen: torch.Generator, main: bool, world: int) -> None:  # fmt: skip
    """Checkpoint after `step`: full weights and an FQN-keyed optimizer state. Collective under
    FSDP: every rank gathers, rank 0 writes."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    inner = _unwrap(model)
    weights = get_model_state_dict(inner, options=state_options(c))
    state = {"scaler": scaler.state_dict(), "data_rng": data_gen.get_state(), "torch_rng": torch.get_rng_state(), "step": step}
    if isinstance(opt, AdamW):
        weights |= _master_weights(inner, opt, weights)
    if isinstance(opt, AdamW) and c.fsdp:  # each rank's own shard of the states, gathered on rank 0
        shards = [None] * world if main else None
        torch.distributed.gather_object(opt.state_dict(), shards, dst=0)
        state["optimizer_shards"] = shards
    else:
        state["optimizer"] = get_optimizer_state_dict(inner, opt, options=state_options(c))
    if world > 1:
        rngs = [None] * world
        torch.distributed.all_gather_object(rngs, torch.get_rng_state())
        state["torch_rng_ranks"] = rngs
    if main:
        checkpoint.save_checkpoint(ckpt_root, step, task.checkpoint_weights(inner, weights), state, c.to_dict(),
                                   keep=c.keep_checkpoints)
    if world > 1:
        torch.distributed.barrier()


def _master_weights(inner: torch.nn.Module, opt: AdamW, weights: dict) -> dict[str, torch.Tensor]:
    """The float32 master weights (exact with a remainder), to save instead of the BF16 parameters.
    Collective under FSDP: every rank gathers each sharded master (rank 0 alone holds `weights`)."""
    masters = {}
    for name, p in inner.named_parameters():
        if opt.state.get(p):
            w = opt.master_weight(p)
            w = w.full_tensor() if hasattr(w, "full_tensor") else w
            if name in weights:
                masters[name] = w.cpu()
    return masters


def _time_is_up(since: float, minutes: float, world: int) -> bool:
    """Whether `minutes` have passed since `since` — on rank 0's clock, so that every rank of a
    sharded run takes the (collective) checkpoint at the same step."""
    up = time.monotonic() - since >= 60 * minutes
    if world > 1:
        flag = torch.tensor([float(up)])
        torch.distributed.broadcast(flag, src=0)
        up = bool(flag.item())
    return up


def _clear_previous_run(ckpt_root: Path, log_path: Path, overwrite: bool, main: bool) -> None:
    """Refuse to start over an earlier run's results, or (`overwrite`) delete them (rank 0)."""
    found = [p for p in (log_path, ckpt_root) if p.exists()]
    latest = checkpoint.latest_checkpoint(ckpt_root, verify=False) if found else None
    held = f"a checkpoint ({latest.name})" if latest is not None else " and ".join(p.name for p in found)
    if found and (log_path.parent / "footprint.json").exists():  # the run's counted sizes go with it
        found.append(log_path.parent / "footprint.json")
    clear_previous(found, overwrite, held=f"a run ({held})", delete=main,
                   remedy="--resume to continue it, --overwrite to delete it and start over, or another --out")  # fmt: skip


def _unwrap(model):
    return getattr(model, "_orig_mod", model)


def _enable_activation_checkpointing(model, blocks: list[torch.nn.Module] | None = None) -> None:
    """Recompute each of `blocks` (the built-in GPT's by default) in backward."""
    from torch.utils.checkpoint import checkpoint as ckpt

    for block in _unwrap(model).blocks if blocks is None else blocks:
        fwd = block.forward
        block.forward = lambda *args, fwd=fwd, **kwargs: ckpt(fwd, *args, use_reentrant=False, **kwargs)


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
