"""Adaptive precision: per-layer sensitivity, and automatic per-layer precision under a bit budget.

- `sensitivity`: each layer's measured single-layer KL and Δloss per candidate, and the
  one-backward Fisher estimate with its rank agreement.
- `knapsack`: the multiple-choice knapsack: exact, or Lagrangian with its duality gap.
- `auto`: `auto_precision` (the assignment of least summed KL within a budget of average bits),
  `fit_to_memory` (the same within a byte budget that counts the KV cache) and the
  rules of thumb it is compared with (first and last blocks; layers from the ends to a budget).
- `token`: FP8 for important tokens, FP4 for the rest, inside each Linear (`token_precision`).
- `confidence`: the FP4 → FP8 cascade with a calibrated confidence threshold.
- `memory`: `MemoryPolicy`, which keeps weights and KV cache within a byte budget at run time.
"""

from minifloat.adapt.auto import (
    AutoPrecision,
    MemoryFit,
    auto_precision,
    choose,
    evaluate_policy,
    fill_policy,
    fit_to_memory,
    heuristic_policy,
)
from minifloat.adapt.confidence import Cascade, calibrate_cascade, evaluate_cascade
from minifloat.adapt.knapsack import Solution, lagrangian, solve, solve_bounded
from minifloat.adapt.memory import MemoryPolicy
from minifloat.adapt.sensitivity import DEFAULT_CANDIDATES, Sensitivity, sensitivity, spearman
from minifloat.adapt.token import TokenPolicy, TokenPrecisionLinear, token_precision

__all__ = [
    "DEFAULT_CANDIDATES",
    "Sensitivity",
    "sensitivity",
    "spearman",
    "solve",
    "solve_bounded",
    "lagrangian",
    "Solution",
    "AutoPrecision",
    "auto_precision",
    "choose",
    "evaluate_policy",
    "heuristic_policy",
    "fill_policy",
    "MemoryFit",
    "fit_to_memory",
    "Cascade",
    "calibrate_cascade",
    "evaluate_cascade",
    "MemoryPolicy",
    "TokenPolicy",
    "TokenPrecisionLinear",
    "token_precision",
]
