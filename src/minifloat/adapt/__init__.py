"""Adaptive precision: per-layer sensitivity, and automatic per-layer precision under a bit budget.

- `sensitivity`: each layer's measured single-layer KL and Δloss per candidate, and the
  one-backward Fisher estimate with its rank agreement.
- `knapsack`: the exact multiple-choice knapsack solver.
- `auto`: `auto_precision` (the assignment of least summed KL within a budget of average bits)
  and the first-and-last-blocks heuristic.
"""

from minifloat.adapt.auto import AutoPrecision, auto_precision, choose, evaluate_policy, heuristic_policy
from minifloat.adapt.knapsack import solve
from minifloat.adapt.sensitivity import DEFAULT_CANDIDATES, Sensitivity, sensitivity, spearman

__all__ = [
    "DEFAULT_CANDIDATES",
    "Sensitivity",
    "sensitivity",
    "spearman",
    "solve",
    "AutoPrecision",
    "auto_precision",
    "choose",
    "evaluate_policy",
    "heuristic_policy",
]
