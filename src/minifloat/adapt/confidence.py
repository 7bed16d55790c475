"""Confidence-based precision: a cascade in which the FP4 model predicts every token and a token
whose confidence is below a threshold is recomputed by the FP8 (or BF16) model.

Confidence of a prediction: its top probability (``"top_prob"``) or its negative entropy
(``"entropy"``). The cascade's token agrees with the high model's wherever the high model
recomputed it, so it disagrees only where the low model was confident and wrong.

`calibrate_cascade` sets the threshold on held-out text for a target agreement with the high
model (CALM's setting for early exits), with a statistical guarantee: thresholds on a fixed grid
are tested from the strictest (recompute everything) towards accepting more, and the scan stops at the first threshold whose
Clopper–Pearson upper bound (confidence 1 − `delta`) on the disagreement rate exceeds
1 − target (fixed-sequence testing, as Learn-then-Test does: no correction for the scan is
needed). With probability ≥ 1 − delta over the calibration text, the true agreement is then at
least the target; on fresh text of n tokens the measured agreement falls below it by more than
`fresh_margin(n)` (3 binomial standard deviations) only rarely.

Cost: every token pays the low model, the recomputed ones the high model too:
``low_cost_ratio + (1 − low_fraction)`` relative to the high model alone. The ratio is an
assumption about the hardware (0.5: FP4 GEMMs at twice the FP8 rate, Blackwell's dense figures),
not a measurement here — on a CPU both run the same emulation.

Example:
    >>> low = torch.tensor([[[4.0, 0.0], [0.1, 0.0]]])   # confident, then unsure
    >>> high = torch.tensor([[[3.0, 0.0], [0.0, 1.0]]])
    >>> cascade_predictions(low, high, threshold=0.9).tolist()
    [[0, 1]]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minifloat.errors import MinifloatError
from minifloat.models.loading import logits_of

MEASURES = ("top_prob", "entropy")


def confidence(logits: torch.Tensor, measure: str = "top_prob") -> torch.Tensor:
    """Per position, higher is more confident: the top probability, or minus the entropy (nats)."""
    if measure not in MEASURES:
        raise MinifloatError(f"confidence measure {measure!r}: use one of {', '.join(MEASURES)}")
    logp = F.log_softmax(logits.float(), -1)
    if measure == "top_prob":
        return logp.max(-1).values.exp()
    return (logp.exp() * logp).sum(-1)


def cascade_predictions(low: torch.Tensor, high: torch.Tensor, threshold: float, measure: str = "top_prob") -> torch.Tensor:
    """The cascade's next-token ids from both models' logits: the low model's where its
    confidence is ≥ `threshold`, the high model's elsewhere."""
    keep = confidence(low, measure) >= threshold
    return torch.where(keep, low.argmax(-1), high.argmax(-1))


def binomial_upper(k: int, n: int, delta: float) -> float:
    """Clopper–Pearson upper bound: the p at which P(X ≤ k; n, p) = delta (bisection on the exact
    binomial CDF in float64).

    >>> round(binomial_upper(0, 100, 0.05), 4)   # the "rule of three": ≈ 3/n
    0.0295
    """
    if k >= n:
        return 1.0
    i = torch.arange(k + 1, dtype=torch.float64)
    logc = torch.lgamma(torch.tensor(n + 1.0, dtype=torch.float64)) - torch.lgamma(i + 1) - torch.lgamma(n - i + 1)

    def cdf(p: float) -> float:
        return float(torch.exp(logc + i * math.log(p) + (n - i) * math.log1p(-p)).sum())

    lo, hi = k / n, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if mid <= 0 or cdf(mid) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def fresh_margin(target: float, n: int) -> float:
    """How far below `target` the agreement measured on n fresh tokens may fall by sampling
    alone: 3 binomial standard deviations."""
    return 3.0 * math.sqrt(target * (1.0 - target) / max(n, 1))


@dataclass(frozen=True)
class Cascade:
    threshold: float  # recompute where confidence < threshold (inf: recompute every token)
    measure: str
    target: float  # the agreement with the high model asked for
    delta: float
    calib_tokens: int
    calib_low_fraction: float
    calib_agreement: float
    upper_disagreement: float  # the Clopper–Pearson bound at the chosen threshold

    def to_dict(self) -> dict:
        return dict(vars(self))


@torch.no_grad()
def _both(low: torch.nn.Module, high: torch.nn.Module, data: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position (flattened over the batches): the low model's logits and the high model's argmax."""
    lo, hi = [], []
    for m, out in ((low, lo), (high, hi)):
        was = m.training
        m.eval()
        try:
            for b in data:
                out.append(logits_of(m(b[:, :-1])).float().flatten(0, -2))
        finally:
            m.train(was)
    return torch.cat(lo), torch.cat(hi).argmax(-1)


def calibrate_cascade(
    low: torch.nn.Module,
    high: torch.nn.Module,
    data: Sequence[torch.Tensor],
    *,
    target: float = 0.99,
    measure: str = "top_prob",
    delta: float = 0.05,
) -> Cascade:
    """The most permissive threshold whose agreement with `high` on `data` (token-id batches
    (B, T + 1)) is ≥ `target` with confidence 1 − `delta` (module docstring)."""
    if not 0.0 < target < 1.0:
        raise MinifloatError(f"target is an agreement in (0, 1), e.g. 0.99; got {target}")
    if not 0.0 < delta < 1.0:
        raise MinifloatError(f"delta is a probability in (0, 1), e.g. 0.05; got {delta}")
    if not data:
        raise MinifloatError("calibrate_cascade needs held-out batches (B, T + 1)")
    lo_logits, hi_top = _both(low, high, data)
    conf = confidence(lo_logits, measure)
    wrong = lo_logits.argmax(-1) != hi_top
    n = conf.numel()
    order = conf.argsort(descending=True)
    wrong_sorted = wrong[order].long().cumsum(0)  # disagreements when the first j+1 most confident are kept
    # a grid of acceptance counts, strictest first: 0, then ~1 % steps of the tokens
    grid = sorted({0, *(min(n, math.ceil(n * f / 100)) for f in range(1, 101))})
    chosen, bound = 0, 0.0
    for j in grid:
        k = int(wrong_sorted[j - 1]) if j else 0
        ub = binomial_upper(k, n, delta)
        if ub > 1.0 - target:
            break
        chosen, bound = j, ub
    if chosen == 0:
        threshold = math.inf
    elif chosen == n:
        threshold = float(conf.min())
    else:  # between the last kept and the first recomputed confidence
        threshold = float((conf[order[chosen - 1]] + conf[order[chosen]]) / 2) if conf[order[chosen - 1]] > conf[order[chosen]] \
            else float(torch.nextafter(conf[order[chosen - 1]], torch.tensor(math.inf)))  # fmt: skip
    keep = conf >= threshold
    agreement = 1.0 - float((keep & wrong).sum()) / n
    return Cascade(threshold, measure, target, delta, n, float(keep.float().mean()), agreement, bound)


def evaluate_cascade(
    low: torch.nn.Module,
    high: torch.nn.Module,
    data: Sequence[torch.Tensor],
    cascade: Cascade,
    *,
    low_cost_ratio: float = 0.5,
) -> dict:
    """On `data` (fresh text): the fraction of tokens the low model decides, the agreement with
    the high model, the margin the target allows there, and the cost relative to the high model."""
    lo_logits, hi_top = _both(low, high, data)
    keep = confidence(lo_logits, cascade.measure) >= cascade.threshold
    n = keep.numel()
    agreement = 1.0 - float((keep & (lo_logits.argmax(-1) != hi_top)).sum()) / n
    f = float(keep.float().mean())
    return {"tokens": n, "low_fraction": f, "agreement": agreement, "target": cascade.target,
            "margin": fresh_margin(cascade.target, n), "low_alone_agreement": float((lo_logits.argmax(-1) == hi_top).float().mean()),
            "relative_cost": low_cost_ratio + (1.0 - f), "low_cost_ratio": low_cost_ratio}  # fmt: skip
