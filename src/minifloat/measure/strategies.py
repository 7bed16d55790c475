"""`minifloat adapt --strategy layer|token|confidence|memory`: each runtime strategy's quality and
cost against uniform `high` (FP8) and uniform `low` (FP4) on the same held-out text.

Every row has the same quality columns (against the unquantized model: Δppl %, mean per-token
KL, top-1 agreement) and the strategy's own cost:
- layer: average bits per weight of the quantized layers (the documents' "attention FP8, FFN
  FP4", its reverse, the first-and-last-blocks heuristic);
- token: average activation bits (rows run in FP8 or FP4 by a `TokenPolicy`);
- confidence: the fraction of tokens the FP4 model decides and the relative cost of the cascade
  (threshold calibrated on one half of the held-out text, reported on the other half);
- memory: the served bytes (weights + KV) against the budget, while decoding token by token
  under budgets between all-FP8 and all-FP4.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch

from minifloat.adapt import evaluate_policy, heuristic_policy, sensitivity
from minifloat.adapt.confidence import calibrate_cascade, evaluate_cascade
from minifloat.adapt.memory import MemoryPolicy, moves
from minifloat.adapt.sensitivity import quantizable
from minifloat.adapt.token import TokenPolicy, token_precision
from minifloat.errors import MinifloatError
from minifloat.infer.evaluation.metrics import Quality, evaluate
from minifloat.infer.quantize import calibrate, quantize_model

QUALITY = ("delta_ppl_pct", "kl", "top1")


def _q(m: dict) -> dict:
    return {k: m[k] for k in QUALITY}


def layer_strategy(model, train, val, high: str, low: str, echo: Callable[[str], None] = print) -> dict:
    """Uniform high / low against the documents' layer rule, its reverse and the heuristic."""
    layers = quantizable(model, [high, low])
    policies = {
        f"uniform {high}": {"*": high},
        f"uniform {low}": {"*": low},
        f"attention {high}, MLP {low} (the documents' rule)": {"*attn*": high, "*mlp*": low, "*": low},
        f"attention {low}, MLP {high}": {"*attn*": low, "*mlp*": high, "*": high},
        f"first/last blocks {high}, rest {low}": heuristic_policy(layers, high, low),
    }
    rows = []
    for name, policy in policies.items():
        policy = {"lm_head": None, **policy}  # first match wins: the head stays in high precision
        m = evaluate_policy(model, policy, val, calib=train)
        rows.append({"name": name, "cost": m["average_bits"], **_q(m)})
        echo(f"  {name}: {m['average_bits']:.2f} bits, Δppl {m['delta_ppl_pct']:+.2f} %, KL {m['kl']:.2e}")
    return {"strategy": "layer", "cost_label": "average weight bits", "rows": rows}


def token_strategy(model, train, val, high: str, low: str, echo: Callable[[str], None] = print,
                   policies: Sequence[TokenPolicy] | None = None) -> dict:  # fmt: skip
    """All-low, all-high (the same mechanism at 0 % and 100 %) and importance policies between."""
    cal = calibrate(model, [b[:, :-1] for b in train])
    policies = policies or [TokenPolicy(outlier_pct=0.0), TokenPolicy(outlier_pct=100.0), TokenPolicy(sink_tokens=4),
                            TokenPolicy(outlier_pct=5.0), TokenPolicy(outlier_pct=10.0, outlier_by="norm"),
                            TokenPolicy(outlier_pct=10.0), TokenPolicy(outlier_pct=10.0, sink_tokens=4),
                            TokenPolicy(outlier_pct=25.0)]  # fmt: skip
    rows = []
    for p in policies:
        q = copy.deepcopy(model)
        tp = token_precision(q, p, high=high, low=low, calibration=cal)
        m = evaluate(q, model, val)
        name = {0.0: f"all {low}", 100.0: f"all {high}"}.get(p.outlier_pct, None) if not p.sink_tokens else None
        name = name or p.describe()
        rows.append({"name": name, "cost": tp.average_activation_bits(), "high_fraction": tp.high_fraction(), **_q(m)})
        echo(f"  {name}: {rows[-1]['cost']:.2f} activation bits ({100 * tp.high_fraction():.1f} % rows {high}), "
             f"Δppl {m['delta_ppl_pct']:+.2f} %, KL {m['kl']:.2e}")  # fmt: skip
    return {"strategy": "token", "cost_label": "average activation bits", "high": high, "low": low, "rows": rows}


def _quantized(model, config: str, train) -> torch.nn.Module:
    q = copy.deepcopy(model)
    quantize_model(q, config, calibration=calibrate(model, [b[:, :-1] for b in train]))
    return q.eval()


def confidence_strategy(model, train, val, high: str, low: str, echo: Callable[[str], None] = print,
                        targets: Sequence[float] = (0.95, 0.98, 0.99), low_cost_ratio: float = 0.5) -> dict:  # fmt: skip
    """The FP4 → FP8 cascade, calibrated on the first half of `val`, reported on the second."""
    if len(val) < 2:
        raise MinifloatError("the confidence strategy splits the held-out batches in two: give --eval-batches ≥ 2")
    calib, fresh = val[: len(val) // 2], val[len(val) // 2 :]
    lo_m, hi_m = _quantized(model, low, train), _quantized(model, high, train)
    rows = []
    for name, m, cost in ((f"all {low}", lo_m, low_cost_ratio), (f"all {high}", hi_m, 1.0)):
        e = evaluate(m, model, fresh)
        rows.append({"name": name, "cost": cost, "low_fraction": float(m is lo_m), **_q(e)})
    for measure in ("top_prob", "entropy"):
        for t in targets:
            c = calibrate_cascade(lo_m, hi_m, calib, target=t, measure=measure)
            r = evaluate_cascade(lo_m, hi_m, fresh, c, low_cost_ratio=low_cost_ratio)
            q = _cascade_quality(model, lo_m, hi_m, fresh, c)
            rows.append({"name": f"cascade {measure} ≥ {t:g} agreement", "cost": r["relative_cost"],
                         "low_fraction": r["low_fraction"], "agreement": r["agreement"], "target": t,
                         "margin": r["margin"], "threshold": c.threshold, "calib_agreement": c.calib_agreement, **q})  # fmt: skip
            echo(f"  cascade {measure} target {t:g}: {100 * r['low_fraction']:.1f} % tokens {low}, agreement "
                 f"{r['agreement']:.4f} (calibration {c.calib_agreement:.4f}), cost {r['relative_cost']:.2f}")  # fmt: skip
    return {"strategy": "confidence", "cost_label": f"cost relative to {high} (FP4 = {low_cost_ratio:g} × FP8, assumed)",
            "rows": rows, "calib_tokens": sum(b[:, 1:].numel() for b in calib)}  # fmt: skip


def _quality(triples) -> dict:
    """Δppl %, mean per-token KL and top-1 of logits against the unquantized model's, from
    (reference logits, logits, targets) per batch."""
    q = Quality()
    for ref, logits, y in triples:
        q.add(logits, y, ref)
    r = q.result()
    return {"delta_ppl_pct": r["delta_ppl_pct"], "kl": r["kl"], "top1": r["top1"]}


@torch.no_grad()
def _cascade_quality(model, lo_m, hi_m, batches, cascade) -> dict:
    """Quality of the cascade's token distribution (the low model's where it is confident, the
    high model's elsewhere) against the unquantized model."""
    from minifloat.adapt.confidence import confidence
    from minifloat.models.loading import logits_of

    def triples():
        for b in batches:
            x, y = b[:, :-1], b[:, 1:]
            ref, lo, hi = (logits_of(m(x)).float() for m in (model, lo_m, hi_m))
            yield ref, torch.where((confidence(lo, cascade.measure) >= cascade.threshold)[..., None], lo, hi), y

    return _quality(triples())


@torch.no_grad()
def _decode_under(policy: MemoryPolicy, reference, seqs) -> dict:
    """Teacher-forced token-by-token decoding of `seqs` under the policy, scored against the
    unquantized model's full-sequence logits."""

    def triples():
        for s in seqs:
            policy.new_sequence()
            x, y = s[:, :-1], s[:, 1:]
            logits = torch.cat([policy.forward(x[:, t : t + 1]) for t in range(x.shape[1])], 1).float()
            yield reference(x).float(), logits, y

    return _quality(triples())


def memory_strategy(model, train, val, high: str, low: str, echo: Callable[[str], None] = print,
                    fractions: Sequence[float] = (1.0, 0.75, 0.5, 0.25, 0.1), sequences: int = 2) -> dict:  # fmt: skip
    """Budgets from all-`high` with a full KV cache (1.0) down to all-`low` with the KV at its
    least (0.0; the lowest default, 0.1, leaves the per-chunk NVFP4 scales room); layers ordered by their
    measured sensitivity."""
    model.eval()
    cal = calibrate(model, [b[:, :-1] for b in train])
    sens = sensitivity(model, train[:2], [high, low])
    seqs = [b[i : i + 1] for b in val for i in range(b.shape[0])][:sequences]
    t = seqs[0].shape[1] - 1
    probe = MemoryPolicy(copy.deepcopy(model), 2**62, order=sens, high=high, low=low, calibration=cal)
    probe.kv.expect(*probe._shape)
    top = probe.served_bytes(0) + t * probe.kv.token_bytes(probe.kv.store) * probe.kv.n_layer
    bottom = probe.served_bytes(len(probe.order)) + probe.kv.least_bytes(t)
    rows = []
    for f in fractions:
        budget = int(bottom + f * (top - bottom))
        p = MemoryPolicy(copy.deepcopy(model), budget, order=sens, high=high, low=low, calibration=cal, headroom_tokens=8)
        q = _decode_under(p, model, seqs)
        mv = moves(p.events)
        rows.append({"name": f"budget {budget:,} B ({f:.0%})", "cost": p.peak_bytes,
                     "budget_bytes": budget, "peak_bytes": p.peak_bytes, "within_budget": p.peak_bytes <= budget,
                     "layers_low_at_end": p.level, "layers": len(p.order), **mv, **q})  # fmt: skip
        echo(f"  budget {budget:,} B: peak {p.peak_bytes:,} B, {mv['weight_down']} layer moves down, {mv['weight_up']} up, "
             f"{mv['kv']} KV moves; Δppl {q['delta_ppl_pct']:+.2f} %, KL {q['kl']:.2e}")  # fmt: skip
    return {"strategy": "memory", "cost_label": "peak served bytes (weights + KV)", "context_tokens": t,
            "order": probe.order, "rows": rows}  # fmt: skip


STRATEGIES = {"layer": layer_strategy, "token": token_strategy, "confidence": confidence_strategy, "memory": memory_strategy}
