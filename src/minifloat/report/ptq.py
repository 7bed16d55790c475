"""The `minifloat ptq-compare` report: a table per config (minifloat's and torchao's beside it)
and a plot of quality against bits per weight."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from minifloat.io.atomic import atomic_path
from minifloat.report import require_matplotlib, save_figure
from minifloat.report.table import cell, markdown_table


def ptq_table(metrics: dict) -> str:
    """The configs as a Markdown table: minifloat's rows, then torchao's and llm-compressor's that ran."""
    head = ("config", "method", "by", "Δppl %", "KL", "top-1", "bits/weight", "all bits/weight", "model MiB", "quantize s",
            "tokens/s")  # fmt: skip
    rows = []
    ref = metrics["reference"]

    def mib(m):
        return cell(m["model_bytes"] / 2**20, ".1f") if m.get("model_bytes") else "—"

    rows.append(("reference", "—", "—", f"ppl {ref['ppl']:.4f}", "—", "—", cell(ref["bits_per_weight"], ".2f"),
                 cell(ref.get("bits_per_weight_all"), ".2f"), mib(ref), "—", cell(ref["tokens_per_s"], ",.0f")))  # fmt: skip
    groups = (("minifloat", metrics["runs"]), ("torchao", [p for p in metrics["torchao"] if p["status"] == "ok"]),
              ("llm-compressor", [p for p in metrics.get("llmcompressor", []) if p["status"] == "ok"]))  # fmt: skip
    for who, group in groups:
        for m in group:
            name = m["config"] + (" + head" if m.get("quantize_head") else "")
            rows.append((name, m.get("method", "rtn"), who, cell(m["delta_ppl_pct"], "+.3f"), cell(m["kl"], ".2e"), cell(m["top1"], ".4f"),
                         cell(m.get("bits_per_weight"), ".2f"), cell(m.get("bits_per_weight_all"), ".2f"), mib(m),
                         cell(m.get("quantize_seconds"), ".1f"), cell(m["tokens_per_s"], ",.0f")))  # fmt: skip
    return markdown_table(head, rows)


def plot_quality(metrics: dict, path: Path) -> None:
    """Δ perplexity and KL against bits per weight, one point per config (torchao's hollow)."""
    plt = require_matplotlib()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "delta_ppl_pct", "Δ perplexity (%)"), (axes[1], "kl", "KL(reference ‖ quantized)")):
        for who, group, style in (("minifloat", metrics["runs"], "o"),
                                  ("torchao", [p for p in metrics["torchao"] if p["status"] == "ok"], "s")):  # fmt: skip
            for m in group:
                ax.plot(m["bits_per_weight"], m[key], style, mfc="none" if who == "torchao" else None, label=f"{m['config']} ({who})")
                ax.annotate(m["config"], (m["bits_per_weight"], m[key]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("bits per weight (codes + scales)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[1].set_yscale("log")
    save_figure(fig, path, plt)


def write_ptq_report(metrics: dict, out: str | Path, *, plots: bool = True) -> Path:
    """``report.md`` (and ``quality.png``) under `out`; a plot that fails is named, not fatal."""
    out = Path(out)
    failed = None
    if plots:
        try:
            plot_quality(metrics, out / "quality.png")
        except Exception as err:  # noqa: BLE001 - the text must still be written
            failed = f"quality.png: {type(err).__name__}: {err}"
            warnings.warn(f"minifloat ptq-compare: the plot was not drawn ({failed})", stacklevel=2)
    d = metrics["data"]
    lines = [
        "# minifloat ptq-compare",
        "",
        f"`{metrics['model']}` quantized after training with each config, evaluated against the unquantized model on "
        f"{d['tokens']:,} held-out tokens ({d['eval_batches']} batches of {d['batch_size']} × {d['seq_len']}; data: "
        f"{d['data'] or 'the Python standard library sources'}; {d.get('text', 'byte tokens')}); calibrated on "
        f"{('the training split of ' + d['calib']) if d.get('calib') else 'the training split'} (static input scales, and "
        f"every layer's statistics for GPTQ, rotations and smoothing, layer by layer).",
        "",
        ptq_table(metrics),
        "",
        "Δppl: perplexity change against the reference. KL: mean per-token KL(reference ‖ quantized). top-1: how often "
        "both pick the same next token. method: rtn (round to nearest) or gptq, with the scale observer, rotation and "
        "smoothing it used. bits/weight: the Linears' weights at rest (codes and scales; layers kept in "
        "high precision at their dtype), the LM head and the embedding not counted; all bits/weight: every weight, head "
        "and embedding included (a tied pair once). model MiB: every tensor the model holds. quantize s: the seconds "
        "quantization took. tokens/s: forward passes on this machine.",
        "",
    ]
    if plots and not failed:
        lines += ["## Quality against bits per weight", "", "![quality](quality.png)", ""]
    if failed:
        lines += ["## Plots that were not drawn", "", f"- {failed}", ""]
    not_run = [p for p in metrics["torchao"] if p["status"] != "ok"]
    if not_run:
        lines += ["## torchao configs that did not run here", ""]
        lines += [f"- `{p['config']}`: {p['status']} — {p['why']}" for p in not_run] + [""]
    lc_not_run = [p for p in metrics.get("llmcompressor", []) if p["status"] != "ok"]
    if lc_not_run:
        lines += ["## llm-compressor runs that did not run here", ""]
        lines += [f"- `{p['config']}` ({p['method']}): {p['status']} — {p['reason']}" for p in lc_not_run] + [""]
    skipped = {m["config"]: m["skipped"] for m in metrics["runs"] if m.get("skipped")}
    if skipped:
        lines += ["## Layers kept in high precision", ""]
        lines += [f"- `{c}`: " + ", ".join(f"{k} ({v})" for k, v in s.items()) for c, s in skipped.items()] + [""]
    lines += ["## Environment", "", "```json", json.dumps(metrics["env"], indent=2), "```", ""]
    path = out / "report.md"
    with atomic_path(path) as tmp:
        tmp.write_text("\n".join(lines))
    return path
