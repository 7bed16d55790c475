"""`minifloat sensitivity` and `minifloat adapt --strategy auto`: per-layer sensitivity of a trained
model, and automatic precision at several bit budgets against every uniform candidate and the rules of
thumb — the first and last blocks in 8 bits, and at each budget the layers nearest the embedding,
the head or both ends in 8 bits until that budget is spent — on the same held-out text.

Sensitivity and calibration use the corpus' training split, the comparisons its held-out split.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from minifloat.adapt import (
    DEFAULT_CANDIDATES,
    auto_precision,
    evaluate_policy,
    fill_policy,
    heuristic_policy,
    sensitivity,
)
from minifloat.adapt.auto import FILL_ENDS, average_bits, close_layers, uniform_bits
from minifloat.adapt.sensitivity import METHODS, quantizable, refine
from minifloat.data.text import TextSource, batches_for, tokenizer_for
from minifloat.errors import MinifloatError
from minifloat.infer.checkpoints.loaders import load_model
from minifloat.infer.ptq.config import get_quant_config
from minifloat.io import jsonio
from minifloat.io.atomic import atomic_path
from minifloat.measure.compare import environment
from minifloat.report.adapt import write_adapt_report

# Up to this many quantizable layers --measure auto measures every one (a small model: seconds);
# past it only the close ones — SmolLM2-135M's 210 Linears: 11+ min measuring all, 4 measuring the close
MEASURE_ALL_UP_TO = 64
AUTO_MEASURE_MOST = 4  # layers measured per budget when --measure auto chose close (each: a pass per candidate)
FEW_EVAL_BATCHES = 4  # such a model's held-out batches by default: ten or so evaluations, each a pass of both models


def _progress(what: str, done: int, total: int) -> None:
    """Where the sensitivity is, on stderr (one line rewritten)."""
    sys.stderr.write(f"\r  {what} {done}/{total}" + ("\n" if done == total else ""))
    sys.stderr.flush()


def run_adapt(
    model_path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    candidates: Sequence[str] = DEFAULT_CANDIDATES,
    budgets: Sequence[float] = (4.5, 5.0, 6.0),
    source: TextSource = TextSource(calib_batches=4, eval_batches=16),  # noqa: B008 - frozen
    plots: bool = True,
    echo: Callable[[str], None] = print,
    measure: str = "auto",
    most: int | None = None,
    method: str = "rtn",
    few_eval_batches: bool = False,
) -> dict:
    """Sensitivity, then (with `budgets`) automatic precision against the uniform candidates and
    the rules of thumb; writes ``metrics.json``, ``report.md`` (+ plots) and each budget's assignment
    (``policy-auto-<bits>.json``: layer → config, as `train --base-policy` reads it) under `out`.
    `measure="close"` measures the KL of only the layers whose choice is close at each budget (the
    `most` nearest the margin, 12 by default); ``"auto"`` (the default) does so where the model has
    more than `MEASURE_ALL_UP_TO` quantizable layers (`AUTO_MEASURE_MOST` of them unless `most` is
    given: the Fisher estimate ranks SmolLM2's measured KLs with Spearman ρ = 0.994), and measures
    every layer otherwise. `method`: ``"gptq"``
    quantizes the candidates by GPTQ (`minifloat.adapt.sensitivity.sensitivity`), the uniform rows
    and the rules of thumb too. `few_eval_batches`: with ``measure="auto"`` on a model past
    `MEASURE_ALL_UP_TO` layers, evaluate on `FEW_EVAL_BATCHES` held-out batches (said in the output)."""
    for c in candidates:
        get_quant_config(c)  # an unknown name fails before any work
    if any(b <= 0 for b in budgets):
        raise MinifloatError(f"--budget-bits must be > 0, got {list(budgets)}")
    out = Path(out)
    if measure not in ("auto", "all", "close"):
        raise MinifloatError(f"--measure {measure!r}: use auto, all or close")
    if method not in METHODS:
        raise MinifloatError(f"--method {method!r}: use one of {', '.join(METHODS)}")
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(model_path)
    tok = tokenizer_for(model_path)
    layers = quantizable(model, candidates)
    large = len(layers) > MEASURE_ALL_UP_TO  # a real model: measure the close layers only, evaluate on fewer batches
    if few_eval_batches and measure == "auto" and budgets and large:
        source = dataclasses.replace(source, eval_batches=min(source.eval_batches, FEW_EVAL_BATCHES))
        echo(f"evaluating on {source.eval_batches} held-out batches (a model of more than {MEASURE_ALL_UP_TO} quantizable "
             f"layers: each comparison is a pass of it; --eval-batches N for more)")  # fmt: skip
    train, val = batches_for(model, source, "train", tok), batches_for(model, source, "val", tok)
    if budgets:  # a budget below every candidate fails now, not after the measurements
        least = min(uniform_bits(model, layers, c) for c in candidates) if layers else 0.0
        if min(budgets) < least:
            raise MinifloatError(f"--budget-bits {min(budgets):g}: the cheapest candidate takes {least:.2f} bits "
                                 f"per weight on this model; give budgets ≥ {least:.2f}")  # fmt: skip
    if measure == "auto":
        measure = "close" if large and budgets else "all"
        if measure == "close":
            most = AUTO_MEASURE_MOST if most is None else most
            echo(f"{len(layers)} quantizable layers (more than {MEASURE_ALL_UP_TO}): measuring only the {most} layers whose choice is "
                 f"closest at each budget, the Fisher estimate (scaled to them) for the rest; --measure all measures every one")  # fmt: skip
    most = 12 if most is None else most
    what = " by GPTQ (the whole model per candidate)" if method == "gptq" else ""
    echo(f"sensitivity of every layer to {', '.join(candidates)}{what} ({len(train)} batches) …")
    s = sensitivity(model, train, candidates, measure="all" if measure == "all" or not budgets else "none",
                    progress=_progress, method=method)  # fmt: skip
    if measure == "close" and budgets:
        for b in budgets:
            refine(s, model, train, close_layers(s, b, most=most), progress=_progress)
        echo(f"  {len(s.layers)} layers, {len(s.measured)} measured (close at a budget), the rest estimated")
    echo(f"  {len(s.layers)} layers; the Fisher estimate ranks the measured KL with Spearman ρ = {s.spearman:.3f}")
    metrics: dict = {"model": str(model_path), "sensitivity": s.to_dict(), "auto": [], "uniform": [], "env": environment(),
                     "method": method, "measure": measure}  # fmt: skip
    for b in budgets:
        r = auto_precision(model, train, candidates, b, sens=s, eval_data=val)
        metrics["auto"].append({"name": f"auto {b:g} bits", "budget_bits": b, "average_bits": r.average_bits,
                                "assignment": r.assignment, "solver": r.solver, "optimality_gap": r.optimality_gap,
                                **_q(r.metrics)})  # fmt: skip
        gap = "" if r.solver == "exact" else f" (Lagrangian: at most {r.optimality_gap:.2e} summed KL above the optimum)"
        policy = out / f"policy-auto-{b:g}.json"  # the assignment as a policy: `train --lora --base-policy` reads it
        with atomic_path(policy) as t:
            t.write_text(jsonio.dumps(r.assignment, indent=1))
        echo(f"  auto ≤ {b:g} bits: {r.average_bits:.2f} bits, Δppl {r.metrics['delta_ppl_pct']:+.2f} %, "
             f"KL {r.metrics['kl']:.2e}{gap} → {policy}")  # fmt: skip
    for c in candidates:
        m = evaluate_policy(model, {n: c for n in s.layers}, val, calib=train, sens=s)
        metrics["uniform"].append({"name": c, "average_bits": average_bits({n: c for n in s.layers}, s), **_q(m)})
        echo(f"  uniform {c}: Δppl {m['delta_ppl_pct']:+.2f} %, KL {m['kl']:.2e}")
    high, low = candidates[0], candidates[-1]
    rules = [(f"first/last blocks {high}, rest {low}", "blocks", heuristic_policy(s.layers, high=high, low=low))]
    for b in budgets:
        for end in FILL_ENDS:
            try:
                h = fill_policy(s, b, high, low, end)
            except MinifloatError:  # a budget below uniform `low`: no such heuristic
                break
            if high in h.values():  # else it is uniform `low`, measured above
                word = "first+last" if end == "both" else end
                rules.append((f"{word} layers {high} to {b:g} bits, rest {low}", f"{word} {b:g}", h))
    metrics["heuristics"] = []
    for name, short, h in rules:
        m = evaluate_policy(model, h, val, calib=train, sens=s)
        row = {"name": name, "short": short, "average_bits": average_bits(h, s), "assignment": h, **_q(m)}
        metrics["heuristics"].append(row)
        echo(f"  {name}: {row['average_bits']:.2f} bits, Δppl {m['delta_ppl_pct']:+.2f} %, KL {m['kl']:.2e}")
    with atomic_path(out / "metrics.json") as t:
        t.write_text(jsonio.dumps(metrics, indent=2))
    write_adapt_report(metrics, out, plots=plots)
    return metrics


def _q(m: dict) -> dict:
    return {k: m[k] for k in ("delta_ppl_pct", "kl", "top1", "ppl", "weight_bytes")}


def run_strategy(
    model_path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    strategy: str,
    *,
    high: str = "fp8-dynamic",
    low: str = "nvfp4",
    source: TextSource = TextSource(calib_batches=4, eval_batches=16),  # noqa: B008 - frozen
    plots: bool = True,
    echo: Callable[[str], None] = print,
) -> dict:
    """One runtime strategy (`minifloat.measure.strategies`) against uniform `high` and `low`;
    writes ``metrics.json`` and ``report.md`` (+ a plot) under `out`."""
    from minifloat.measure.strategies import STRATEGIES
    from minifloat.report.adapt import write_strategy_report

    if strategy not in STRATEGIES:
        raise MinifloatError(f"unknown strategy {strategy!r}; use auto or one of {', '.join(STRATEGIES)}")
    for c in (high, low):
        get_quant_config(c)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(model_path).eval()
    tok = tokenizer_for(model_path)
    train, val = batches_for(model, source, "train", tok), batches_for(model, source, "val", tok)
    echo(f"strategy {strategy}: {high} / {low} on {len(val)} held-out batches …")
    metrics = {"model": str(model_path), **STRATEGIES[strategy](model, train, val, high, low, echo=echo),
               "high": high, "low": low, "env": environment()}  # fmt: skip
    with atomic_path(out / "metrics.json") as t:
        t.write_text(jsonio.dumps(metrics, indent=2))
    write_strategy_report(metrics, out, plots=plots)
    return metrics
