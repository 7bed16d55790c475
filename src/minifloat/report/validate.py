"""The `minifloat validate` report: failures first, then each example's table, the speed-up
analysis, the environment; plots of the speed-ups. Rendered from ``metrics.json`` alone, so
``--generate-report DIR`` redraws it without running anything."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

from minifloat.io.atomic import atomic_path
from minifloat.report import require_matplotlib, save_figure
from minifloat.report.table import markdown_table


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        a = abs(v)
        return f"{v:.3g}" if a == 0 or 1e-3 <= a < 1e5 else f"{v:.2e}"
    return str(v)


def rows_table(rows: list[dict]) -> str:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    return markdown_table(cols, [[_fmt(r.get(c)) for c in cols] for r in rows])


def summary_table(metrics: dict) -> str:
    head = ("example", "result", "checks passed", "wall s", "memory")
    rows = []
    for e in metrics["examples"]:
        ok = sum(c["passed"] for c in e["checks"])
        mem = e["memory"]
        m = (f"peak {mem['cuda_peak'] / 2**20:.0f} MiB CUDA" if "cuda_peak" in mem
             else f"RSS peak {mem['peak_rss'] / 2**20:.0f} MiB (+{mem['peak_rss_growth'] / 2**20:.0f})")  # fmt: skip
        m += f", tensors {mem['tensor_bytes'] / 2**20:.1f} MiB"
        rows.append((e["name"], "pass" if e["passed"] else "**FAIL**", f"{ok}/{len(e['checks'])}", f"{e['wall_s']:.1f}", m))
    return markdown_table(head, rows)


def speedup_lines(metrics: dict) -> list[str]:
    """One line per timed example: the fastest low-precision case against FP32 and BF16."""
    lines = []
    by = {e["name"]: e for e in metrics["examples"]}
    for name, key in (("gemm", "precision"), ("transformer_layer", "precision"), ("training", "precision")):
        e = by.get(name)
        if not e or not e["rows"]:
            continue
        low = [r for r in e["rows"] if r[key] not in ("fp32", "bf16", "fp16")]
        if not low:
            continue
        best = max(low, key=lambda r: r["speedup_vs_fp32"])
        lines.append(f"- {name}: fastest low-precision case `{best[key]}` at {best['speedup_vs_fp32']:.2f}× FP32 and "
                     f"{best['speedup_vs_bf16']:.2f}× BF16 (medians, interleaved runs).")  # fmt: skip
    env = metrics.get("env", {})
    dev = metrics.get("device", "cpu")
    if dev == "cpu":
        lines.append("- On a CPU the low-precision GEMMs are the exact emulation: dequantize, then multiply in FP32. "
                     "They cannot beat the FP32 GEMM they end in; the figures show the overhead of exactness, "
                     "and where the CPU has BF16 units, how BF16 compares.")  # fmt: skip
    if env.get("bf16_native") is False:
        lines.append("- This CPU has no BF16 units: its BF16 baseline converts element by element and is not the BF16 a "
                     "GPU or an AMX CPU would run.")  # fmt: skip
    return lines


def plot_speedups(metrics: dict, path: Path) -> None:
    plt = require_matplotlib()
    shown = [e for e in metrics["examples"] if e["rows"] and "speedup_vs_fp32" in e["rows"][0]]
    if not shown:
        return
    fig, axes = plt.subplots(1, len(shown), figsize=(4.5 * len(shown), 3.8), squeeze=False)
    for ax, e in zip(axes[0], shown, strict=True):
        key = next(k for k in ("precision", "case") if k in e["rows"][0])
        names = [str(r[key]) for r in e["rows"] if "speedup_vs_fp32" in r]
        vals = [r["speedup_vs_fp32"] for r in e["rows"] if "speedup_vs_fp32" in r]
        ax.bar(range(len(vals)), vals, color=["#4c72b0" if v >= 1 else "#dd8452" for v in vals])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=7)
        ax.set_title(e["name"])
        ax.set_ylabel("speed-up against FP32")
    save_figure(fig, path, plt)


def write_validate_report(metrics: dict, out: str | Path, *, plots: bool = True) -> Path:
    out = Path(out)
    failed = [(e["name"], c) for e in metrics["examples"] for c in e["checks"] if not c["passed"]]
    lines = ["# minifloat validate", "",
             f"{len(metrics['examples'])} examples at size `{metrics['size']}` on `{metrics['device']}`, "
             f"{metrics['reps']} interleaved repetitions each; {metrics['wall_s']:.0f} s in all.", ""]  # fmt: skip
    lines += ["## Failures", ""]
    if failed:
        lines += [f"- **{n}**: {c['name']}: measured {_fmt(c['measured'])}, needs {c['op']} {_fmt(c['threshold'])}"
                  + (f" — {c['detail']}" if c["detail"] else "") for n, c in failed]  # fmt: skip
    else:
        lines.append("None: every check passed.")
    lines += ["", "## Summary", "", summary_table(metrics), "", "## Speed-up analysis", "", *speedup_lines(metrics), ""]
    if plots:
        try:
            (out / "plots").mkdir(parents=True, exist_ok=True)
            plot_speedups(metrics, out / "plots" / "speedups.png")
            if (out / "plots" / "speedups.png").is_file():
                lines += ["![speed-ups](plots/speedups.png)", ""]
        except Exception as err:  # noqa: BLE001 - the text must still be written
            warnings.warn(f"minifloat validate: the plot was not drawn ({type(err).__name__}: {err})", stacklevel=2)
    for e in metrics["examples"]:
        lines += [f"## {e['name']}: {e['title']}", ""]
        if e["rows"]:
            lines += [rows_table(e["rows"]), ""]
        lines += ["Checks:", ""]
        lines += [f"- {'pass' if c['passed'] else '**FAIL**'}: {c['name']}: {_fmt(c['measured'])} {c['op']} {_fmt(c['threshold'])}"
                  for c in e["checks"]]  # fmt: skip
        lines += [f"- note: {n}" for n in e["notes"] if not n.startswith("Traceback")]
        if e.get("trace"):
            lines.append(f"- profiler trace: `{Path(e['trace']).relative_to(out) if Path(e['trace']).is_relative_to(out) else e['trace']}`")
        lines.append("")
    lines += ["## Environment", "", "```json", json.dumps(metrics.get("env", {}), indent=2), "```", ""]
    path = out / "report.md"
    with atomic_path(path) as tmp:
        tmp.write_text("\n".join(lines))
    return path
