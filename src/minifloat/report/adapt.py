"""The `minifloat adapt` report: automatic precision against the uniform schemes and the rules of thumb,
a sensitivity heat map and a Pareto plot of quality against average bits."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

from minifloat.io.atomic import atomic_path
from minifloat.report import require_matplotlib, save_figure
from minifloat.report.table import cell, markdown_table


def adapt_rows(metrics: dict) -> list[dict]:
    return [*metrics["auto"], *metrics["uniform"], *metrics["heuristics"]]


def adapt_table(metrics: dict) -> str:
    head = ("assignment", "avg bits", "Δppl %", "KL", "top-1")
    rows = [(r["name"], cell(r["average_bits"], ".2f"), cell(r["delta_ppl_pct"], "+.3f"), cell(r["kl"], ".2e"),
             cell(r["top1"], ".4f")) for r in adapt_rows(metrics)]  # fmt: skip
    return markdown_table(head, rows)


def plot_heatmap(metrics: dict, path: Path) -> None:
    plt = require_matplotlib()
    s = metrics["sensitivity"]
    grid = [[math.log10(max(s["kl"][n][c], 1e-12)) for c in s["candidates"]] for n in s["layers"]]
    fig, ax = plt.subplots(figsize=(2 + 1.2 * len(s["candidates"]), 1 + 0.28 * len(s["layers"])))
    im = ax.imshow(grid, aspect="auto", cmap="viridis")
    ax.set_xticks(range(len(s["candidates"])), s["candidates"])
    ax.set_yticks(range(len(s["layers"])), s["layers"], fontsize=7)
    fig.colorbar(im, ax=ax, label="log10 KL (that layer alone quantized)")
    save_figure(fig, path, plt)


def plot_pareto(metrics: dict, path: Path) -> None:
    plt = require_matplotlib()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "kl", "KL(reference ‖ quantized)"), (axes[1], "delta_ppl_pct", "Δ perplexity (%)")):
        for group, style in ((metrics["auto"], "o-"), (metrics["uniform"], "s"), (metrics["heuristics"], "^")):
            xs, ys = [r["average_bits"] for r in group], [r[key] for r in group]
            ax.plot(xs, ys, style, label={"o-": "auto", "s": "uniform", "^": "heuristic"}[style])
            for r in group:
                tag = r.get("short", r["name"])  # the table names the heuristics in full
                ax.annotate(tag, (r["average_bits"], r[key]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("average bits per weight")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].legend()
    save_figure(fig, path, plt)


def write_adapt_report(metrics: dict, out: str | Path, *, plots: bool = True) -> Path:
    out = Path(out)
    failed = []
    drawn = []
    if plots:
        for title, name, draw in (("Quality against average bits", "pareto.png", plot_pareto),
                                  ("Sensitivity", "sensitivity.png", plot_heatmap)):  # fmt: skip
            try:
                draw(metrics, out / name)
                drawn.append((title, name))
            except Exception as err:  # noqa: BLE001 - the text must still be written
                failed.append(f"{name}: {type(err).__name__}: {err}")
                warnings.warn(f"minifloat adapt: a plot was not drawn ({failed[-1]})", stacklevel=2)
    s = metrics["sensitivity"]
    # each candidate's method by its label (`Sensitivity.labels`); a metrics file from before labels: the method alone
    labels = s.get("labels") or {}
    weights = ("GPTQ, each candidate the model quantized whole (" + ", ".join(f"{c}: {v}" for c, v in labels.items()) + ")"
               if metrics.get("method") == "gptq" and labels else "GPTQ" if metrics.get("method") == "gptq"
               else "round to nearest")  # fmt: skip
    lines = [
        "# minifloat adapt", "",
        f"`{metrics['model']}`: one candidate per layer chosen to minimise the summed single-layer KL within a budget "
        f"of average bits per weight (codes and scales), against every uniform candidate and the rules of thumb "
        f"(the first and last blocks in 8 bits; at each budget, the layers nearest the embedding, the head or both ends "
        f"in 8 bits until the budget is spent), on held-out text. The Fisher estimate ranks the measured single-layer KLs with Spearman "
        f"ρ = {s['spearman']:.3f}. Weights: "
        f"{weights}"
        f"; {len(s['measured'])} of {len(s['layers'])} layers measured, the rest estimated.", "",
        adapt_table(metrics), "",
    ]  # fmt: skip
    for title, name in drawn:
        lines += [f"## {title}", "", f"![{title}]({name})", ""]
    if failed:
        lines += ["## Plots that were not drawn", "", *(f"- {f}" for f in failed), ""]
    lines += ["## Assignments", ""]
    for r in metrics["auto"]:
        counts: dict[str, int] = {}
        for c in r["assignment"].values():
            counts[c] = counts.get(c, 0) + 1
        lines.append(f"- {r['name']}: " + ", ".join(f"{n} × {c}" for c, n in counts.items()))
    lines += ["", "## Environment", "", "```json", json.dumps(metrics["env"], indent=2), "```", ""]
    path = out / "report.md"
    with atomic_path(path) as tmp:
        tmp.write_text("\n".join(lines))
    return path


STRATEGY_TEXT = {
    "layer": "Per-layer-type rules: every Linear but the head in one config by its name's rule. Cost: average bits "
             "per weight (codes and scales).",
    "token": "Inside each Linear, the rows (tokens) a policy judges important run in the high config, the rest in "
             "the low one, as two GEMMs. Cost: average activation bits per element (codes and scales).",
    "confidence": "The low model predicts every token; where its confidence is below a threshold the high model "
                  "recomputes it. Thresholds calibrated on one half of the held-out text for a target agreement with "
                  "the high model (Clopper–Pearson bound, δ = 0.05), reported on the other half. Cost: the low model "
                  "on every token plus the high model on the recomputed ones, relative to the high model alone, with "
                  "FP4 assumed to cost half of FP8 (Blackwell's dense rates; not measured here).",
    "memory": "Token-by-token decoding under a byte budget for the served weights and the KV cache: the KV cache "
              "moves old tokens to FP4 first, then layers move to the low config in sensitivity order (least KL per "
              "byte saved first). Budgets run from 100 % (every layer high, the full KV cache) to 0 % (every layer low, "
              "the KV cache at its least). Cost: the peak of served bytes, always within the budget.",
}


def strategy_table(metrics: dict) -> str:
    extra = {"token": ("high_fraction", "rows high", ".3f"), "confidence": ("low_fraction", "low fraction", ".3f"),
             "memory": ("layers_low_at_end", "layers low", "d")}.get(metrics["strategy"])  # fmt: skip
    head = ["strategy", metrics["cost_label"], *([extra[1]] if extra else []), "Δppl %", "KL", "top-1"]
    if metrics["strategy"] == "confidence":
        head.append("agreement with high (target)")
    rows = []
    for r in metrics["rows"]:
        cost = f"{r['cost']:,}" if isinstance(r["cost"], int) else cell(r["cost"], ".3f")
        row = [r["name"], cost, *([cell(r.get(extra[0]), extra[2])] if extra else []),
               cell(r["delta_ppl_pct"], "+.3f"), cell(r["kl"], ".2e"), cell(r["top1"], ".4f")]  # fmt: skip
        if metrics["strategy"] == "confidence":
            row.append(f"{r['agreement']:.4f} ({r['target']:g} − {r['margin']:.4f})" if "agreement" in r else "")
        rows.append(row)
    return markdown_table(head, rows)


def plot_strategy(metrics: dict, path: Path) -> None:
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for r in metrics["rows"]:
        ax.plot(r["cost"], max(r["kl"], 1e-12), "o")
        ax.annotate(r["name"], (r["cost"], max(r["kl"], 1e-12)), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel(metrics["cost_label"])
    ax.set_ylabel("KL(reference ‖ strategy)")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.set_title(f"{metrics['strategy']} strategy: quality against cost")
    save_figure(fig, path, plt)


def write_strategy_report(metrics: dict, out: str | Path, *, plots: bool = True) -> Path:
    out = Path(out)
    lines = [f"# minifloat adapt --strategy {metrics['strategy']}", "",
             f"`{metrics['model']}`, high `{metrics['high']}`, low `{metrics['low']}`. "
             + STRATEGY_TEXT[metrics["strategy"]], "", strategy_table(metrics), ""]  # fmt: skip
    if plots:
        try:
            plot_strategy(metrics, out / "tradeoff.png")
            lines += ["![quality against cost](tradeoff.png)", ""]
        except Exception as err:  # noqa: BLE001 - the text must still be written
            warnings.warn(f"minifloat adapt: the plot was not drawn ({type(err).__name__}: {err})", stacklevel=2)
            lines += [f"(the plot was not drawn: {type(err).__name__}: {err})", ""]
    if metrics["strategy"] == "memory":
        lines += ["Layers in the order they move down: " + ", ".join(f"`{n}`" for n in metrics["order"]), ""]
    lines += ["## Environment", "", "```json", json.dumps(metrics["env"], indent=2), "```", ""]
    path = out / "report.md"
    with atomic_path(path) as tmp:
        tmp.write_text("\n".join(lines))
    return path
