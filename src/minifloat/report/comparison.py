"""The report of `minifloat compare`: the summary table, ``report.md`` and three plots.

- ``loss.png``: training loss (smoothed), its difference to the reference precision's, and
  validation loss per step, every precision;
- ``scales.png``: amax and scale per step of a few operands of the first transformer block,
  for each quantized precision (from the run's telemetry; for block formats the encode scale
  of the block with the largest amax);
- ``speed_memory.png``: step time, weights at rest and peak memory per precision.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

from minifloat.io.atomic import atomic_path
from minifloat.report import require_matplotlib, save_figure
from minifloat.report.table import cell, markdown_table, mib
from minifloat.train.runlog import read_log

# Operands whose amax/scale history is drawn: one activation, one weight, one gradient.
SCALE_OPERANDS = ("blocks.0.attn.qkv:input", "blocks.0.mlp.fc:weight", "blocks.0.mlp.proj:grad_output")


def _what_text(c: dict) -> str:
    if not c.get("pretrained"):
        return f"The `{c['model']}` GPT"
    lora = f" with LoRA adapters of rank {c['lora_rank']} on a frozen base (the precision names the base's format)" if c.get("lora_rank") else ""
    return f"The pretrained model `{c['pretrained']}`{lora}"


def _sizes_text(metrics: dict) -> str:
    if not metrics["config"].get("pretrained"):
        return ("Weights: quantized Linear weights packed with their scales, the rest in BF16 (FP32 for fp32); every run "
                f"also keeps a master copy ({_masters_text(metrics['runs'])}). Peak RSS: the whole training process.")  # fmt: skip
    return ("Base val: the validation loss before the first step (for a packed base, the quantized model's). Weights: the "
            "parameters and buffers as training held them (with LoRA, the frozen base: its frozen parameters and "
            "buffers, a packed layer's codes and scales); state: those, the optimizer state and the gradients — both "
            "counted from the tensors themselves. RSS training: the process's resident memory after the first step; "
            "peak RSS: the whole process, loading the model included.")  # fmt: skip


def summary_table(metrics: dict) -> str:
    """The runs as a Markdown table (readable as plain text too)."""
    finetune = any(m.get("base_val_loss") is not None for m in metrics["runs"])  # a pretrained model's runs
    lora = bool(metrics.get("config", {}).get("lora_rank"))  # the frozen base, and its size against the first run's
    first = metrics["runs"][0].get("frozen_bytes")
    head = ("precision", "status", *(("base val",) if finetune else ()), "final train", "final val",
            "Δ val vs " + metrics["runs"][0]["precision"], "step s", "× step time", "tokens/s", "weights MiB",
            *(("frozen base MiB", "× frozen base") if lora else ()),
            *(("state MiB", "RSS training MiB") if finetune else ()), "peak RSS MiB", "skipped", "non-finite")  # fmt: skip
    rows = []
    for i, m in enumerate(metrics["runs"]):
        frozen = m.get("frozen_bytes")
        rows.append((
            m["precision"], m["status"], *((cell(m.get("base_val_loss"), ".4f"),) if finetune else ()),
            cell(m.get("final_train_loss"), ".4f"), cell(m.get("final_val_loss"), ".4f"),
            delta_cell(m, reference=i == 0), cell(m.get("step_time_s"), ".3f"),
            cell(m.get("step_time_ratio"), ".2f"), cell(m.get("tokens_per_s"), ",.0f"), mib(m.get("weight_bytes")),
            *((mib(frozen), cell(frozen / first if frozen and first else None, ".3f")) if lora else ()),
            *((mib(m.get("state_bytes")), mib(m.get("rss_after_first_step_bytes"))) if finetune else ()),
            mib(m.get("peak_rss_bytes")), str(m.get("skipped_steps", "—")), str(m.get("nonfinite_steps", "—")),
        ))  # fmt: skip
    return markdown_table(head, rows)


def delta_cell(m: dict, *, reference: bool = False) -> str:
    """The Δ val cell: ``+0.23 %``; over several seeds ``+0.23 ± 0.10 %`` (mean ± standard
    deviation of the paired Δ), with ``≈`` where it is within noise (not on the reference).

    Example:
        >>> delta_cell({"val_loss_delta_pct": 0.5, "val_loss_delta_pct_std": 0.25, "val_loss_delta_within_noise": True})
        '+0.50 ± 0.25 % ≈'
    """
    delta = m.get("val_loss_delta_pct")
    if delta is None:
        return "—"
    std = m.get("val_loss_delta_pct_std")
    if std is None:
        return f"{delta:+.2f} %"
    return f"{delta:+.2f} ± {std:.2f} %" + (" ≈" if m.get("val_loss_delta_within_noise") and not reference else "")


def _smooth(values: list[float], half: int) -> list[float]:
    """Centred moving average over ``2·half + 1`` steps (shorter at the ends): no lag, unlike
    an EMA, where the loss falls fast. A series holding a non-finite value is returned as it is."""
    if half < 1 or not all(math.isfinite(v) for v in values):
        return list(values)
    prefix = [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)
    n = len(values)
    return [(prefix[min(n, i + half + 1)] - prefix[max(0, i - half)]) / (min(n, i + half + 1) - max(0, i - half)) for i in range(n)]


def loss_curves(metrics: dict) -> list[dict]:
    """What `plot_loss` draws, per run with a log: ``label`` (the precision, and its status
    unless ok), ``steps``, ``raw`` and ``smooth`` training losses, ``delta`` (smoothed loss
    minus the reference's over the steps both have; None when the reference, the first run,
    has no log), ``val`` as (step, loss) pairs, and ``band``: None for one seed; over several
    seeds (a run's ``logs``) the curves are means over the seeds, over the steps every seed
    logged, and ``band`` is the (lowest, highest) smoothed loss of the seeds at each step."""
    ref = None
    curves = []
    for i, m in enumerate(metrics["runs"]):
        if m.get("log") is None:  # a peer's run: figures, no per-step log
            continue
        logs = [read_log(Path(log)) for log in m.get("logs", [m["log"]])]
        n = min(len(recs) for recs in logs)
        if not n:
            continue
        raws = [[r["loss"] for r in recs[:n]] for recs in logs]
        smooths = [_smooth(raw, n // 50) for raw in raws]
        smooth = _mean_columns(smooths)
        if i == 0:
            ref = smooth
        vals = [[(r["step"], r["val_loss"]) for r in recs[:n] if "val_loss" in r] for recs in logs]
        curves.append({
            "label": m["precision"] + ("" if m["status"] == "ok" else f" ({m['status']})"),
            "steps": [r["step"] for r in logs[0][:n]],
            "raw": _mean_columns(raws),
            "smooth": smooth,
            "delta": None if ref is None else [a - b for a, b in zip(smooth, ref, strict=False)],
            "val": list(zip([s for s, _ in vals[0]], _mean_columns([[v for _, v in vs] for vs in vals]), strict=True)),
            "band": None if len(logs) == 1 else ([min(c) for c in zip(*smooths, strict=True)], [max(c) for c in zip(*smooths, strict=True)]),
        })  # fmt: skip
    return curves


def _mean_columns(rows: list[list[float]]) -> list[float]:
    """The mean of each column of equally long `rows` (one row: the row itself, bit for bit)."""
    return list(rows[0]) if len(rows) == 1 else [sum(c) / len(c) for c in zip(*rows, strict=True)]


def plot_loss(metrics: dict, path: Path) -> None:
    plt = require_matplotlib()
    fig, (ax_t, ax_d, ax_v) = plt.subplots(1, 3, figsize=(19, 5))
    for c in loss_curves(metrics):
        (line,) = ax_t.plot(c["steps"], c["smooth"], lw=1.6, label=c["label"])
        ax_t.plot(c["steps"], c["raw"], lw=0.5, alpha=0.25, color=line.get_color())
        if c["band"] is not None:  # the spread of the seeds
            ax_t.fill_between(c["steps"], *c["band"], color=line.get_color(), alpha=0.15, lw=0)
        if c["delta"] is not None:
            ax_d.plot(c["steps"][: len(c["delta"])], c["delta"], lw=1.4, color=line.get_color(), label=c["label"])
        if c["val"]:
            ax_v.plot(*zip(*c["val"], strict=True), marker="o", ms=3, lw=1.4, color=line.get_color(), label=c["label"])
    seeds = metrics["config"].get("seeds")
    ax_t.set_title("training loss (smoothed; raw faint)" + (f"; mean of {len(seeds)} seeds, band: their range" if seeds else ""))
    ax_v.set_title("validation loss (fixed held-out windows)")
    ax_d.set_title(f"smoothed training loss minus {metrics['runs'][0]['precision']}'s")
    ax_d.axhline(0.0, color="k", lw=0.6)
    for ax in (ax_t, ax_d, ax_v):
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/byte)")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    save_figure(fig, path, plt)


def scale_series(metrics: dict) -> dict[str, list[dict]]:
    """What `plot_scales` draws: per operand of `SCALE_OPERANDS`, one series per run that
    recorded it (``precision``, ``steps``, ``amax``, ``scale``). On the log axes an amax of 0
    is drawn at 1e-30, and a scale that is 0 or not finite (none recorded) is a gap (NaN)."""
    series: dict[str, list[dict]] = {operand: [] for operand in SCALE_OPERANDS}
    for m in metrics["runs"]:
        recs = [r for r in read_log(Path(m["log"])) if r.get("telemetry", {}).get("amax")]
        for operand, runs in series.items():
            pts = [(r["step"], r["telemetry"]["amax"].get(operand), r["telemetry"]["scale"].get(operand)) for r in recs]
            pts = [p for p in pts if p[1] is not None]
            if pts:
                runs.append({
                    "precision": m["precision"],
                    "steps": [p[0] for p in pts],
                    "amax": [max(p[1], 1e-30) for p in pts],
                    "scale": [p[2] if p[2] and math.isfinite(p[2]) else float("nan") for p in pts],
                })  # fmt: skip
    return series


def plot_scales(metrics: dict, path: Path) -> bool:
    """Amax and scale histories; False (and no file) when no run recorded telemetry."""
    series = scale_series(metrics)
    if not any(series.values()):
        return False
    plt = require_matplotlib()
    fig, axes = plt.subplots(2, len(SCALE_OPERANDS), figsize=(5 * len(SCALE_OPERANDS), 7.5), squeeze=False)
    for col, (operand, runs) in enumerate(series.items()):
        for run in runs:
            axes[0][col].semilogy(run["steps"], run["amax"], lw=1.2, label=run["precision"])
            axes[1][col].semilogy(run["steps"], run["scale"], lw=1.2, label=run["precision"])
        axes[0][col].set_title(f"{operand}: amax", fontsize=10)
        axes[1][col].set_title(f"{operand}: scale", fontsize=10)
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xlabel("step")
            ax.grid(True, which="major", alpha=0.3)
            if runs:
                ax.legend(fontsize=8)
    save_figure(fig, path, plt)
    return True


def speed_memory_panels(metrics: dict) -> list[tuple[str, list[float]]]:
    """What `plot_speed_memory` draws: (title, one bar per run) for the median step time, the
    weights at rest and the peak RSS; a run without the figure (it failed) gets a bar of 0."""
    runs = metrics["runs"]
    return [
        ("step time (s, median)", [m.get("step_time_s") or 0 for m in runs]),
        ("weights at rest (MiB)", [(m.get("weight_bytes") or 0) / 2**20 for m in runs]),
        ("peak RSS of the run (MiB)", [(m.get("peak_rss_bytes") or 0) / 2**20 for m in runs]),
    ]


def plot_speed_memory(metrics: dict, path: Path) -> None:
    plt = require_matplotlib()
    names = [m["precision"] for m in metrics["runs"]]
    panels = speed_memory_panels(metrics)
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4.5))
    for ax, (title, values) in zip(axes, panels, strict=True):
        bars = ax.bar(names, values, color=[f"C{i}" for i in range(len(names))])
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
    save_figure(fig, path, plt)


def _masters_text(runs: list[dict]) -> str:
    """The master copies' sizes: one figure when every run keeps the same (FP32, say)."""
    sizes = {m["precision"]: mib(m["master_weight_bytes"]) for m in runs if m.get("master_weight_bytes") is not None}
    if len(set(sizes.values())) <= 1:
        return f"{next(iter(sizes.values()), '—')} MiB"
    return ", ".join(f"`{p}` {size} MiB" for p, size in sizes.items())


def _seeds_text(config: dict) -> str:
    seeds = config.get("seeds")
    if not seeds:
        return "with the same seed, initial weights and data order."
    return (
        f"once with each of the seeds {', '.join(map(str, seeds))}: a seed's initial weights and data order are the "
        "same in every precision. Δ val is paired by seed, as mean ± standard deviation over the seeds; ≈ marks a Δ "
        "within noise (its 95 % Student-t interval contains 0). The other figures are means over the seeds."
    )


def write_report(metrics: dict, out: str | Path, *, plots: bool = True) -> Path:
    """Write ``report.md`` (and the plots, unless `plots` is False) under `out`.

    A plot that fails (matplotlib missing, a file that cannot be written) is named in the
    report and in a warning; the report's text is written all the same, so that a long
    comparison never ends without it."""
    out = Path(out)
    figures, failed = [], []
    if plots:
        for title, name, draw in (
            ("Loss", "loss.png", plot_loss),
            ("Amax and scales (first block)", "scales.png", plot_scales),
            ("Speed and memory", "speed_memory.png", plot_speed_memory),
        ):
            try:
                if draw(metrics, out / name) is not False:  # plot_scales: False when there is nothing to draw
                    figures.append((title, name))
            except Exception as err:  # noqa: BLE001 - any failure: the text must still be written
                failed.append(f"{name}: {type(err).__name__}: {err}")
        for why in failed:
            warnings.warn(f"minifloat compare: a plot was not drawn ({why}); report.md lists it", stacklevel=2)
    c, env = metrics["config"], metrics["env"]
    ref = metrics["runs"][0]["precision"]
    lines = [
        "# minifloat compare",
        "",
        f"{_what_text(c)} trained for {c['steps']} steps of {c['batch_size']}×{c['seq_len']} tokens "
        f"(×{c['grad_accum']} accumulation) in each precision, " + _seeds_text(c)
        + f" Data: {c.get('sft') or c['data'] or 'the Python standard library sources on this machine'}.",
        "",
        summary_table(metrics),
        "",
        f"Δ val and × step time are relative to `{ref}`. Final train loss: mean of the last 10 % of steps. "
        "Step time: median after the first 10 % of steps. " + _sizes_text(metrics),
        "",
    ]
    bad = [m for m in metrics["runs"] if m["status"] != "ok"]
    if bad:
        lines += ["## Runs that did not finish cleanly", ""]
        for m in bad:
            why = m.get("error") or (
                f"non-finite steps: {m.get('nonfinite_steps')}, first non-finite layer: {m.get('first_nonfinite')}, "
                f"final train loss {m.get('final_train_loss')} vs first {m.get('first_train_loss')}"
            )
            lines += [f"- **{m['precision']}: {m['status']}** — {why}"]
        lines.append("")
    for title, name in figures:
        lines += [f"## {title}", "", f"![{title}]({name})", ""]
    if failed:
        lines += ["## Plots that were not drawn", "", *(f"- {why}" for why in failed), ""]
    lines += [
        "## Quantization telemetry",
        "",
        "| precision | max fraction saturated | max fraction flushed to zero |",
        "|---|---|---|",
    ]
    for m in metrics["runs"]:
        lines.append(
            f"| {m['precision']} | {cell(m.get('max_saturated'), '.2e')} | {cell(m.get('max_flushed'), '.2e')} |"
        )
    lines += ["", "## Recipes", ""]
    for m in metrics["runs"]:
        lines += [f"- `{m['precision']}`: `{json.dumps(m['recipe'])}`"]
    lines += ["", "## Configuration", "", "```json", json.dumps(c, indent=2), "```", "", "## Environment", "",
              "```json", json.dumps(env, indent=2), "```", ""]  # fmt: skip
    path = out / "report.md"
    with atomic_path(path) as tmp:
        tmp.write_text("\n".join(lines))
    return path
