"""Automatic per-layer precision under a bit budget.

`auto_precision` picks one candidate config per quantizable layer so that the summed measured
single-layer KL (`sensitivity`) is least with the average bits per weight (codes and scales,
weighted by each layer's weight count) at most `budget_bits` — a multiple-choice knapsack solved
exactly (`knapsack.solve`) — then quantizes a copy of the model with that assignment and
evaluates it. `heuristic_policy` is the rule of thumb it is compared with: the first and last
blocks in 8 bits, the rest in FP4.

Example:
    >>> from minifloat.train.model import GPT, GPTConfig
    >>> torch.manual_seed(0) and None
    >>> gpt = GPT(GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64)).eval()
    >>> data = [torch.randint(0, 256, (2, 17))]
    >>> r = auto_precision(gpt, data, ["fp8-dynamic", "mxfp4"], budget_bits=6.0)
    >>> r.average_bits <= 6.0, sorted(set(r.assignment.values()))
    (True, ['fp8-dynamic', 'mxfp4'])
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minifloat.adapt.knapsack import solve
from minifloat.adapt.sensitivity import DEFAULT_CANDIDATES, Sensitivity, sensitivity
from minifloat.errors import MinifloatError
from minifloat.infer.metrics import evaluate
from minifloat.infer.ptq import calibrate, quantize_model

BIT_STEPS = 64  # costs in 1/64 bit per weight


@dataclass
class AutoPrecision:
    assignment: dict[str, str]  # layer → config
    average_bits: float
    budget_bits: float
    predicted_kl: float  # the summed single-layer KLs the knapsack minimised
    metrics: dict | None  # `evaluate` of the quantized model against the reference

    def to_dict(self) -> dict:
        return dict(vars(self))


def average_bits(assignment: dict[str, str], s: Sensitivity) -> float:
    total = sum(s.params[n] for n in assignment)
    return sum(s.bits[n][c] * s.params[n] for n, c in assignment.items()) / total


def choose(s: Sensitivity, budget_bits: float) -> dict[str, str]:
    """The assignment of least summed KL within `budget_bits` average bits per weight."""
    unit = math.gcd(*s.params.values())
    # a layer's cost: its bits (codes + scales) in 1/64 bit per weight × its weights / unit, a whole number
    options = [[(round(s.bits[n][c] * BIT_STEPS * s.params[n] / unit), s.kl[n][c]) for c in s.candidates]
               for n in s.layers]  # fmt: skip
    budget = math.floor(budget_bits * BIT_STEPS * sum(s.params.values()) // unit + 1e-9)
    least = min(min(s.bits[n].values()) for n in s.layers)
    if budget_bits < least:
        raise MinifloatError(f"budget_bits={budget_bits}: the cheapest candidate takes {least:.2f} bits per weight")
    picks = solve(options, budget)
    return {n: s.candidates[i] for n, i in zip(s.layers, picks, strict=True)}


def auto_precision(
    model: torch.nn.Module,
    data: Sequence[torch.Tensor],
    candidates: Sequence[str] = DEFAULT_CANDIDATES,
    budget_bits: float = 5.0,
    *,
    sens: Sensitivity | None = None,
    eval_data: Sequence[torch.Tensor] | None = None,
    ignore: Sequence[str] = ("lm_head",),
) -> AutoPrecision:
    """Choose and evaluate a per-layer assignment (see the module docstring); `sens` reuses a
    `sensitivity` of the same model and candidates; `eval_data` (default `data`) scores it."""
    s = sens if sens is not None else sensitivity(model, data, candidates, ignore=ignore)
    assignment = choose(s, budget_bits)
    metrics = evaluate_policy(model, assignment, eval_data or data, calib=data)
    return AutoPrecision(assignment, average_bits(assignment, s), budget_bits,
                         sum(s.kl[n][c] for n, c in assignment.items()), metrics)  # fmt: skip


def evaluate_policy(model: torch.nn.Module, policy: dict[str, str | None], data, *, calib=None) -> dict:
    """`evaluate` a copy of `model` quantized with `policy` (layer globs → configs) against it."""
    q = copy.deepcopy(model)
    cal = calibrate(model, [b[:, :-1] for b in (calib or data)])
    quantize_model(q, {**policy}, calibration=cal, ignore=())
    return evaluate(q, model, data)


def block_index(name: str) -> int | None:
    """The transformer block a layer belongs to: the first number between dots in its name."""
    m = re.search(r"\.(\d+)\.", f".{name}.")
    return int(m.group(1)) if m else None


def heuristic_policy(layers: Sequence[str], high: str = "fp8-dynamic", low: str = "nvfp4") -> dict[str, str]:
    """The rule of thumb: the first and last blocks in `high`, every other layer in `low`."""
    blocks = [b for b in (block_index(n) for n in layers) if b is not None]
    if not blocks:
        raise MinifloatError("the layers' names hold no block numbers: no first and last block to keep")
    ends = {min(blocks), max(blocks)}
    return {n: (high if block_index(n) in ends else low) for n in layers}
