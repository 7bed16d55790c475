"""`minifloat compare`: train the same GPT in several precisions and measure what each costs.

Each precision trains in its own process (``python -m minifloat train --config ...``), with the
same seed, so the same initial weights and the same data order; a child that crashes or
diverges does not take the others down, and its peak resident memory is its own (from
``wait4``). The parent reads each run's ``log.jsonl`` and derives the metrics below, then the
report (`minifloat.report.comparison`) draws the plots and writes ``report.md``.

Metrics of one run (``metrics.json`` → ``runs[i]``; strict JSON, a non-finite figure such as
a diverged run's loss written as the string ``"nan"`` / ``"inf"``, see `minifloat.io.jsonio`):

- ``final_train_loss``: mean training loss of the last 10 % of steps (at least one step);
- ``final_val_loss``: the validation loss after the last step (fixed held-out windows);
- ``val_loss_delta_pct``: ``100 · (val − val_ref) / val_ref``, the reference being the first
  precision; ``step_time_ratio`` likewise for the step time;
- ``step_time_s``: median over the steps after the first 10 % (compilation, allocator warm-up);
- ``weight_bytes``: the model's weights at rest in that precision — quantized Linear weights
  packed with their scales, everything else in BF16 (FP32 for ``fp32``);
  ``master_weight_bytes`` the master copy (FP32: 4 bytes a parameter; ``bf16-sr`` 2,
  ``bf16+remainder`` 2 + 2);
- ``peak_rss_bytes``: the child process's peak resident memory;
- ``status``: ``ok``, ``diverged`` (a non-finite loss, or a final loss above the first step's; a
  fine-tune: a final validation loss above the base model's)
  or ``failed`` (the process exited with an error, whose last lines are in ``error``).

A precision may name training options after ``@``: ``fp8@states=fp8-dre@master=bf16-sr`` trains
the fp8 recipe with FP8 (COAT) optimizer states and BF16 masters (`VARIANT_OPTIONS`; ``init``
is a LoRA run's ``lora_init``); the options it does not name are the command line's (its
defaults), so ``fp8`` beside it is the FP32-state run.

With ``seeds`` > 1 (``--seeds N``) each seed's runs are compared with the reference's run of
the same seed (same initial weights, same data order), and a run's entry holds the mean of
every figure over the seeds, ``val_loss_delta_pct_std`` (the sample standard deviation of the
paired Δ val), ``val_loss_delta_within_noise`` (the 95 % Student-t interval of the mean Δ
contains 0: `within_noise`), the worst ``status``, ``logs`` and ``per_seed`` (each seed's own
figures).

Example:
    >>> from minifloat.train import TrainConfig
    >>> weight_bytes(TrainConfig(precision="mxfp8", model="tiny", seq_len=32))["weight_bytes"] > 0
    True
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from minifloat.data.corpus import load_corpus
from minifloat.errors import MinifloatError
from minifloat.io import jsonio
from minifloat.io.atomic import atomic_path
from minifloat.measure.devices import describe
from minifloat.nn import rounded
from minifloat.nn.linear import Linear
from minifloat.quant.api import quantize
from minifloat.recipes import RECIPES
from minifloat.report import require_matplotlib
from minifloat.report.comparison import write_report
from minifloat.train.config import PACKED_FORMATS, PRECISIONS, TrainConfig
from minifloat.train.loop import build_model
from minifloat.train.runlog import clear_previous, read_log

DEFAULT_PRECISIONS = ("bf16", "fp8", "mxfp8", "nvfp4")
HALF_PRECISIONS = ("bf16", "fp16")


# A precision's ``@key=value`` options → the TrainConfig fields they set (unnamed ones: the defaults).
VARIANT_OPTIONS = {"states": "optimizer_states", "master": "master", "first": "high_precision_first",
                   "last": "high_precision_last", "init": "lora_init", "compute": "base_compute", "switch": "precision_switch",
                   "outliers": "outlier_channels"}  # fmt: skip
_INT_FIELDS = ("high_precision_first", "high_precision_last", "outlier_channels")
_FLOAT_FIELDS = ("precision_switch",)


def run_fields(label: str, base: TrainConfig | None = None) -> dict:
    """The TrainConfig fields of a precision as `parse_precisions` takes it: those its ``@``
    options name, the others as `base` (the command line's) has them, or TrainConfig's defaults.

    Example:
        >>> run_fields("fp8@states=fp8-dre@master=bf16-sr@last=1")
        {'precision': 'fp8', 'optimizer_states': 'fp8-dre', 'master': 'bf16-sr', 'high_precision_first': 0, 'high_precision_last': 1, 'lora_init': 'zero', 'base_compute': 'auto', 'precision_switch': 0.0, 'outlier_channels': 0}
    """
    name, *options = label.split("@")
    fields = {"precision": name, **{f: getattr(base if base is not None else TrainConfig, f) for f in VARIANT_OPTIONS.values()}}
    if name not in PACKED_FORMATS:  # the command line's compute dtype is the packed bases' (an @compute= still names its own)
        fields["base_compute"] = "auto"
    if name not in RECIPES:  # and its precision switch the recipes' (the high precisions have nothing to switch)
        fields["precision_switch"], fields["outlier_channels"] = 0.0, 0
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in VARIANT_OPTIONS or not value:
            raise MinifloatError(f"{label!r}: options after @ are key=value with a key among {', '.join(VARIANT_OPTIONS)} "
                                 "(e.g. fp8@states=fp8-dre@master=bf16-sr)")  # fmt: skip
        field = VARIANT_OPTIONS[key]
        if field in _INT_FIELDS and not value.isdigit():
            raise MinifloatError(f"{label!r}: {key}= takes a whole number of {'channels' if key == 'outliers' else 'blocks'}, got {value!r}")
        if field in _FLOAT_FIELDS:
            try:
                value = float(value)
            except ValueError:
                raise MinifloatError(f"{label!r}: {key}= takes a fraction of the steps, e.g. 0.1; got {value!r}") from None
        fields[field] = int(value) if field in _INT_FIELDS else value
    if base is not None and base.base_policy and name not in PACKED_FORMATS:  # a LoRA base's policy: the packed bases'
        fields["base_policy"] = None
    return fields


def parse_precisions(text: str | Sequence[str]) -> list[str]:
    """``"bf16,fp8"`` → ``["bf16", "fp8"]``, checking each name (and its ``@`` options) and refusing repeats."""
    names = [p.strip() for p in text.split(",")] if isinstance(text, str) else list(text)
    names = [p for p in names if p]
    unknown = [p for p in names if run_fields(p)["precision"] not in PRECISIONS]
    if unknown:
        raise MinifloatError(
            f"unknown precision {unknown[0]!r} in --precisions; use any of {', '.join(PRECISIONS)}"
        )
    if len(names) < 1 or len(set(names)) != len(names):
        raise MinifloatError(f"--precisions needs distinct names, got {','.join(names) or 'none'}")
    return names


def weight_bytes(c: TrainConfig) -> dict[str, int]:
    """Bytes of the model's weights at rest in `c.precision` (see the module docstring)."""
    model = build_model(c)
    rest = 4 if c.precision == "fp32" else 2
    master = {"fp32": 4, "bf16-sr": 2, "bf16+remainder": 4}[c.master]
    quantized, seen, total = 0, set(), 0
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Linear):
                q = quantize(m.weight.detach(), m.recipe.scheme("weight"))
                total += q.nbytes
                quantized += m.weight.numel()
                seen.add(id(m.weight))
        params = 0
        for p in model.parameters():  # parameters() yields a tied weight once
            params += p.numel()
            if id(p) not in seen:
                total += p.numel() * rest
    return {
        "weight_bytes": total,
        "master_weight_bytes": master * params,
        "params": params,
        "quantized_params": quantized,
    }


def held_bytes(run_dir: Path) -> dict:
    """A fine-tune's sizes, as its run counted them (``footprint.json``, `minifloat.train.loop.state_bytes`):
    ``weight_bytes`` the model as training held it (parameters and buffers: a packed base's codes
    and scales), ``state_bytes`` that plus the optimizer state and the gradients, and
    ``base_val_loss``, the model's validation loss before the first step, and
    ``rss_after_first_step_bytes``, the process's resident memory then (what training holds,
    without the peak of loading the model in FP32)."""
    path = run_dir / "footprint.json"
    held = json.loads(path.read_text()) if path.is_file() else {}
    state = held.get("state_bytes", {})
    out = {"base_val_loss": held.get("base_val_loss"), "rss_after_first_step_bytes": held.get("rss_after_first_step")}
    if state:
        out |= {"weight_bytes": state["trained_parameters"] + state["frozen_parameters"] + state["buffers"],
                "frozen_bytes": state["frozen_parameters"] + state["buffers"], "state_bytes": state["total"],
                "optimizer_bytes": state["optimizer"]}  # fmt: skip
    return out


def run_metrics(records: list[dict], c: TrainConfig) -> dict:
    """The per-run metrics (module docstring) from the JSONL `records` of one run."""
    n = len(records)
    if n == 0:
        return {"steps_completed": 0}
    tail = records[-max(1, n // 10) :]
    timed = records[min(n - 1, max(1, n // 10)) :]
    step_time = statistics.median(r["step_time_s"] for r in timed)
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    tel = [r["telemetry"] for r in records if r.get("telemetry")]
    tokens = c.batch_size * c.seq_len * c.grad_accum
    final_train = sum(r["loss"] for r in tail) / len(tail)
    return {
        "steps_completed": n,
        "first_train_loss": records[0]["loss"],
        "final_train_loss": final_train,
        "final_val_loss": vals[-1] if vals else None,
        "step_time_s": step_time,
        "tokens_per_s": tokens / step_time,
        "skipped_steps": int(records[-1].get("skipped_steps", 0)),
        "nonfinite_steps": sum(1 for r in records if r.get("nonfinite") or not math.isfinite(r["loss"])),
        "max_saturated": max((t.get("max_saturated", 0.0) for t in tel), default=None),
        "max_flushed": max((t.get("max_flushed", 0.0) for t in tel), default=None),
        "first_nonfinite": next((t["first_nonfinite"] for t in tel if t.get("first_nonfinite")), None),
    }


def _diverged(m: dict) -> bool:
    values = [m.get("final_train_loss"), m.get("final_val_loss")]
    if any(v is None or not math.isfinite(v) for v in values) or m.get("nonfinite_steps", 0) > 0:
        return True
    base = m.get("base_val_loss")
    if base is not None and math.isfinite(base):  # a fine-tune: worse than the model it started from (its first
        return m["final_val_loss"] > base  # batch's loss may sit below later batches' by the text alone)
    return m["final_train_loss"] > m["first_train_loss"]


def _run_child(cmd: list[str], echo: Callable[[str], None]) -> tuple[int, int, list[str]]:
    """Run one child (a ``minifloat train``, a peer); returns (exit code, peak RSS bytes, last lines)."""
    env = dict(os.environ, MINIFLOAT_NO_TQDM="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    last: deque[str] = deque(maxlen=20)
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        last.append(line)
        if not line.startswith("{"):  # the final JSON summary is read from the log instead
            echo(line)
    proc.stdout.close()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss * 1024, list(last)


def environment() -> dict:
    """Where the comparison ran: versions, CPU, threads, and each recipe's GEMM backend."""
    info = describe()
    cpu = info["devices"][0]
    return {
        "minifloat": info["minifloat"], "torch": torch.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "cpu": cpu["name"], "cpu_detail": cpu["detail"],
        "fast_kernels": cpu["fast_kernels"], "threads": torch.get_num_threads(),
        "backends": {r["recipe"]: r["backend"] for r in cpu["recipes"]},
        "cuda": [d["name"] for d in info["devices"][1:]],
    }  # fmt: skip


def recipe_description(precision: str) -> dict:
    """The exact recipe of `precision` (its dataclass fields), or how a high precision runs."""
    if precision in RECIPES:
        return RECIPES[precision].to_dict()
    return {"recipe": precision, "gemm": rounded.describe(precision)}


def compare(
    precisions: Sequence[str],
    base: TrainConfig,
    out: str | Path,
    *,
    echo: Callable[[str], None] = print,
    plots: bool = True,
    overwrite: bool = False,
    seeds: int = 1,
    peers: Sequence[str] = (),
    peer_python: str | None = None,
) -> dict:
    """Train `base` in each of `precisions` and write ``metrics.json``, ``report.md`` and the
    plots under `out`; returns the metrics. The first precision is the reference.

    With `seeds` > 1 every precision trains with the seeds ``base.seed``, ``base.seed + 1``, …
    (the same ones for every precision), and each run's entry holds the mean of every figure,
    the Δ val's standard deviation over the seeds and whether it is within noise, and each
    seed's own figures (module docstring).

    `peers` (with a LoRA `base` and `peer_python`, the Python of a venv with transformers, peft
    and bitsandbytes): the LoRA runs users know, on the same windows (`PEERS`, `peft_peer`).

    An `out` that holds an earlier comparison (its report or runs) is refused unless
    `overwrite`, which deletes that comparison first."""
    precisions = parse_precisions(precisions)
    for p in precisions:  # every run's options checked before minutes of training
        dataclasses.replace(base, **run_fields(p, base))
    _check_peers(peers, peer_python, base)
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise MinifloatError(f"--seeds must be a whole number ≥ 1, got {seeds!r}")
    if plots:  # checked before minutes of training, not after
        try:
            require_matplotlib()
        except MinifloatError as err:
            raise MinifloatError(f"{err}, or pass --no-plots (plots=False)") from None
    if not base.eval_every:
        base = dataclasses.replace(base, eval_every=base.steps)  # a final val loss is needed
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise MinifloatError(f"--out {out} is a file; give a folder for the report and the runs")
    if base.pretrained is not None and not Path(base.pretrained).exists():
        raise MinifloatError(f"{base.pretrained}: no such model folder or file")
    if base.sft is not None:
        from minifloat.data.sft import read_records

        read_records(base.sft)  # a malformed record fails here once, naming its line
    if base.data is not None:  # a bad --data fails here once, not in every run
        load_corpus(base.data, base.max_bytes)
    _clear_previous(out, overwrite)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    seed_list = [base.seed + k for k in range(seeds)]
    by_seed: list[list[dict]] = []  # [seed][precision]
    for k, seed in enumerate(seed_list):
        runs = []
        for i, precision in enumerate(precisions):
            c = dataclasses.replace(base, **run_fields(precision, base), seed=seed)
            run_dir = out / "runs" / precision / (f"seed{seed}" if seeds > 1 else "")
            of = f"[{k * len(precisions) + i + 1}/{seeds * len(precisions)}] {precision}"
            what = f"{c.model} model" if c.pretrained is None else c.pretrained + (f", LoRA rank {c.lora_rank}" if c.lora_rank else "")
            echo(f"{of}: {what}, {c.steps} steps" + (f", seed {seed}" if seeds > 1 else ""))
            runs.append(_run(c, run_dir, lambda line, p=precision: echo(f"  [{p}] {line}"), label=precision))
        for name in peers:
            c = dataclasses.replace(base, **run_fields(precisions[0], base), seed=seed)
            echo(f"peer {name}" + (f", seed {seed}" if seeds > 1 else ""))
            runs.append(_peer_run(c, name, peer_python, out / "runs" / name / (f"seed{seed}" if seeds > 1 else "")))
        _relative_to_first(runs)
        by_seed.append(runs)
    runs = by_seed[0] if seeds == 1 else [_over_seeds(list(per), seed_list) for per in zip(*by_seed, strict=True)]
    metrics = {"runs": runs, "config": {**base.to_dict(), "precisions": precisions}, "env": environment()}
    metrics["config"].pop("precision")
    if seeds > 1:
        metrics["config"]["seeds"] = seed_list
    with atomic_path(out / "metrics.json") as tmp:
        tmp.write_text(jsonio.dumps(metrics, indent=2))  # a diverged run's NaN loss as "nan"
    write_report(metrics, out, plots=plots)
    return metrics


def _run(c: TrainConfig, run_dir: Path, echo: Callable[[str], None], label: str) -> dict:
    """Train `c` in a child process in `run_dir`; its metrics (module docstring), named `label`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.json"
    with atomic_path(config_path) as tmp:
        tmp.write_text(json.dumps(c.to_dict(), indent=2))
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "minifloat", "train", "--config", str(config_path), "--out", str(run_dir)]
    code, rss, last = _run_child(cmd, echo)
    records = read_log(run_dir / "log.jsonl")
    sizes = weight_bytes(c) if c.pretrained is None else held_bytes(run_dir)
    m = {"precision": label, **run_metrics(records, c), **sizes, "peak_rss_bytes": rss,
         "wall_time_s": time.perf_counter() - t0, "log": str(run_dir / "log.jsonl"),
         "recipe": recipe_description(c.precision)}  # fmt: skip
    if c.switch_step() < c.steps:
        m["recipe"]["precision_switch"] = f"steps {c.switch_step() + 1}–{c.steps} and the validation after them in BF16"
    if c.outlier_channels:
        m["recipe"]["outlier_channels"] = c.outlier_channels  # the field of the recipe the run trained with
    if code != 0 or m["steps_completed"] < c.steps:
        m["status"], m["error"] = "failed", "\n".join(last[-8:]) or f"exit code {code}"
    else:
        m["status"] = "diverged" if _diverged(m) else "ok"
    return m


# The LoRA runs users know, run by their own venv (`peft_peer`): the base each holds
PEERS = {"peft-bf16": "bf16", "bnb-nf4": "nf4"}


def _check_peers(peers: Sequence[str], python: str | None, base: TrainConfig) -> None:
    if not peers:
        return
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise MinifloatError(f"--peers {unknown[0]!r}: use {', '.join(PEERS)}")
    if not base.lora_rank or base.sft is not None:
        raise MinifloatError("--peers runs PEFT's LoRA beside minifloat's: it needs MODEL, --lora RANK and --data text "
                             "(plain windows, not packed SFT records)")  # fmt: skip
    if python is None or not Path(python).is_file():
        raise MinifloatError(f"--peers needs --peer-python: the python of a venv with transformers, peft (and bitsandbytes "
                             f"for bnb-nf4), got {python!r}")  # fmt: skip


def _peer_run(c: TrainConfig, name: str, python: str, run_dir: Path) -> dict:
    """A peer's LoRA fine-tune (`peft_peer`, in its own process and venv) on the windows `c`'s runs
    draw: the same training batches step by step and the same held-out batches."""
    import numpy as np

    from minifloat.finetune import PretrainedTask
    from minifloat.measure import peft_peer

    run_dir.mkdir(parents=True, exist_ok=True)
    task = PretrainedTask()
    task.prepare(c)
    gen = torch.Generator().manual_seed(c.seed)  # the loop's data generator: the same draws
    train = [[task.batch(c, gen) for _ in range(c.grad_accum)] for _ in range(c.steps)]
    val = task.val_batches(c)
    windows = run_dir / "windows.npz"
    np.savez(windows, train_ids=np.stack([[b["input_ids"].numpy() for b in s] for s in train]),
             train_labels=np.stack([[b["labels"].numpy() for b in s] for s in train]),
             val_ids=np.stack([b["input_ids"].numpy() for b in val]), val_labels=np.stack([b["labels"].numpy() for b in val]))  # fmt: skip
    cmd = [python, peft_peer.__file__, c.pretrained, "--windows", str(windows), "--base", PEERS[name], "--rank", str(c.lora_rank),
           "--alpha", str(c.lora_alpha), "--lr", str(c.lr), "--warmup", str(c.warmup), "--min-lr-ratio", str(c.min_lr_ratio),
           "--weight-decay", str(c.weight_decay), "--grad-clip", str(c.grad_clip), "--seed", str(c.seed)]  # fmt: skip
    t0 = time.perf_counter()
    code, rss, last = _run_child(cmd, lambda line: None)
    m = {"precision": name, "recipe": {"peer": name, "python": python}, "log": None, "peak_rss_bytes": rss,
         "wall_time_s": time.perf_counter() - t0}  # fmt: skip
    result = next((json.loads(line) for line in reversed(last) if line.startswith("{")), None)
    if code != 0 or result is None:
        return {**m, "status": "failed", "error": "\n".join(last[-8:]) or f"exit code {code}"}
    state = result["state_bytes"]
    return {**m, "status": "ok", "base_val_loss": result["base_val_loss"], "final_val_loss": result["final_val_loss"],
            "step_time_s": result["step_time_s"], "tokens_per_s": result["tokens_per_s"], "state_bytes": state["total"],
            "weight_bytes": state["trained_parameters"] + state["frozen_parameters"] + state["buffers"],
            "frozen_bytes": state["frozen_parameters"] + state["buffers"], "optimizer_bytes": state["optimizer"],
            "steps_completed": result["steps"], "nonfinite_steps": 0, "skipped_steps": 0}  # fmt: skip


# Student's t at 95 % (two-sided) by degrees of freedom; 2.0 past 10.
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def within_noise(deltas: list[float]) -> bool | None:
    """Whether the 95 % confidence interval of the mean of paired `deltas` (one per seed)
    contains 0: the difference is not told apart from seed noise. None with fewer than two.

    Example:
        >>> within_noise([0.1, -0.2, 0.15]), within_noise([1.0, 1.2, 0.9])
        (True, False)
    """
    d = [v for v in deltas if v is not None and math.isfinite(v)]
    if len(d) < 2:
        return None
    half = T95.get(len(d) - 1, 2.0) * statistics.stdev(d) / math.sqrt(len(d))
    return abs(statistics.fmean(d)) <= half


def _over_seeds(per_seed: list[dict], seeds: list[int]) -> dict:
    """One precision's entry over its seeds: the mean of every figure, the Δ val's standard
    deviation and `within_noise`, the worst status, and each seed's own figures."""
    first = per_seed[0]
    m: dict = {"precision": first["precision"], "recipe": first["recipe"], "log": first["log"],
               "logs": [r["log"] for r in per_seed]}  # fmt: skip
    for key, value in first.items():
        if isinstance(value, int | float) and not isinstance(value, bool) and key not in m:
            values = [r.get(key) for r in per_seed]
            mean = None if any(v is None for v in values) else statistics.fmean(values)
            whole = mean is not None and all(isinstance(v, int) for v in values) and mean.is_integer()
            m[key] = int(mean) if whole else mean  # counts that agree stay counts (0 skipped steps, not 0.0)
    deltas = [r.get("val_loss_delta_pct") for r in per_seed]
    finite = [d for d in deltas if d is not None and math.isfinite(d)]
    m["val_loss_delta_pct_std"] = statistics.stdev(finite) if len(finite) >= 2 else None
    m["val_loss_delta_within_noise"] = within_noise(deltas)
    statuses = [r["status"] for r in per_seed]
    m["status"] = next((s for s in ("failed", "diverged") if s in statuses), "ok")
    errors = [f"seed {seed}: {r['error']}" for seed, r in zip(seeds, per_seed, strict=True) if r.get("error")]
    if errors:
        m["error"] = "\n".join(errors)
    m["per_seed"] = [{"seed": seed, **r} for seed, r in zip(seeds, per_seed, strict=True)]
    return m


# What a comparison writes under its --out (besides runs/).
REPORT_FILES = ("metrics.json", "report.md", "loss.png", "scales.png", "speed_memory.png")


def _clear_previous(out: Path, overwrite: bool) -> None:
    """Refuse an earlier comparison in `out`, or (`overwrite`) delete it: its runs, whose
    checkpoints and logs must not mix with this one's, and its report files."""
    runs = out / "runs"
    found = [out / name for name in REPORT_FILES if (out / name).exists()]
    if runs.is_dir() and any(runs.iterdir()):
        found.append(runs)
    clear_previous(found, overwrite, held=f"a comparison ({', '.join(p.name for p in found)})",
                   remedy="--overwrite to delete it and run again, or another --out")  # fmt: skip


def _relative_to_first(runs: list[dict]) -> None:
    ref = runs[0]

    def ratio(key: str, m: dict, pct: bool) -> float | None:
        a, b = m.get(key), ref.get(key)
        if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or b == 0:
            return None
        return 100.0 * (a - b) / b if pct else a / b

    for m in runs:
        m["val_loss_delta_pct"] = ratio("final_val_loss", m, True)
        m["train_loss_delta_pct"] = ratio("final_train_loss", m, True)
        m["step_time_ratio"] = ratio("step_time_s", m, False)
        m["weight_bytes_ratio"] = ratio("weight_bytes", m, False)
