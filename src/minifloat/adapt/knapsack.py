"""The multiple-choice knapsack that automatic precision solves: pick one option per layer
(a candidate config, with a cost in bits and a loss) to minimise the total loss with the total
cost at most the budget. Solved exactly by dynamic programming over integer costs (`solve`), or,
for instances too large for that (hundreds of layers at fine costs), by Lagrangian relaxation
with its duality gap reported (`lagrangian`); `solve_bounded` picks.

Example:
    >>> solve([[(4, 1.0), (8, 0.1)], [(4, 2.0), (8, 0.5)]], budget=12)
    [0, 1]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from minifloat.errors import MinifloatError

MAX_CELLS = 50_000_000  # layers × budget states: beyond, the costs are too fine to solve exactly here


def solve(options: Sequence[Sequence[tuple[int, float]]], budget: int) -> list[int]:
    """The index of the chosen option of each group (``options[g] = [(cost, loss), ...]``, costs
    whole numbers ≥ 0) minimising the summed loss with the summed cost ≤ `budget`; among equal
    losses the cheaper. An error when even the cheapest choice exceeds the budget."""
    if budget < 0 or any(not g for g in options):
        raise MinifloatError("every group needs at least one option, and the budget must be ≥ 0")
    least = sum(min(c for c, _ in g) for g in options)
    if least > budget:
        raise MinifloatError(f"the budget {budget} is below the cheapest assignment's cost {least}")
    if len(options) * (budget + 1) > MAX_CELLS:
        raise MinifloatError(f"{len(options)} groups × a budget of {budget} is too large to solve exactly here")
    inf = float("inf")
    best = [0.0] + [inf] * budget  # best[b]: least loss of the groups so far at cost exactly b
    choice: list[list[int]] = []
    for g in options:
        new = [inf] * (budget + 1)
        pick = [-1] * (budget + 1)
        for b, loss in enumerate(best):
            if loss == inf:
                continue
            for i, (c, l2) in enumerate(g):
                if b + c <= budget and loss + l2 < new[b + c]:
                    new[b + c], pick[b + c] = loss + l2, i
        best = new
        choice.append(pick)
    end = min(range(budget + 1), key=lambda b: (best[b], b))
    out = []
    for g, pick in zip(reversed(options), reversed(choice), strict=True):
        i = pick[end]
        out.append(i)
        end -= g[i][0]
    return out[::-1]


@dataclass(frozen=True)
class Solution:
    """A choice per group, its summed loss and cost, and a lower bound on the least loss any
    choice within the budget has: ``gap = loss - lower_bound`` bounds how far from optimal it is
    (0 for the exact solver)."""

    picks: list[int]
    loss: float
    cost: int
    lower_bound: float
    method: str  # "exact" (dynamic programming) or "lagrangian"

    @property
    def gap(self) -> float:
        return max(self.loss - self.lower_bound, 0.0)


def _cost(options, picks) -> int:
    return sum(g[i][0] for g, i in zip(options, picks, strict=True))


def _loss(options, picks) -> float:
    return sum(g[i][1] for g, i in zip(options, picks, strict=True))


def _relaxed(options, lam: float) -> tuple[list[int], float]:
    """Per group the option of least loss + λ·cost (the cheaper among equals), and Σ min (loss + λ·cost)."""
    picks, total = [], 0.0
    for g in options:
        i = min(range(len(g)), key=lambda j: (g[j][1] + lam * g[j][0], g[j][0]))
        picks.append(i)
        total += g[i][1] + lam * g[i][0]
    return picks, total


def lagrangian(options: Sequence[Sequence[tuple[int, float]]], budget: int, *, iters: int = 64) -> Solution:
    """The multiple-choice knapsack by Lagrangian relaxation, for instances too large for the
    exact solver: for a price λ ≥ 0 per unit of cost each group independently takes the option of
    least loss + λ·cost; bisection finds the least λ whose choice fits the budget, then the
    leftover budget buys the upgrades of most loss saved per unit of cost that still fit.
    Every λ gives the lower bound L(λ) = Σ_g min_i (loss + λ·cost) − λ·budget ≤ the optimum
    (weak duality); the best one seen is the solution's `lower_bound`."""
    least = sum(min(c for c, _ in g) for g in options)
    if budget < 0 or least > budget:
        raise MinifloatError(f"the budget {budget} is below the cheapest assignment's cost {least}")
    picks, total = _relaxed(options, 0.0)
    bound = total
    if _cost(options, picks) > budget:
        # costs are whole numbers: past the widest loss spread per unit of cost the cheapest wins
        losses = [loss for g in options for _, loss in g]
        lo, hi = 0.0, 2 * (max(losses) - min(losses)) + 1.0
        picks = _relaxed(options, hi)[0]
        for _ in range(iters):
            mid = (lo + hi) / 2
            p, total = _relaxed(options, mid)
            bound = max(bound, total - mid * budget)
            if _cost(options, p) <= budget:
                hi, picks = mid, p
            else:
                lo = mid
        bound = max(bound, _relaxed(options, hi)[1] - hi * budget)
    picks = list(picks)
    cost = _cost(options, picks)
    while True:  # spend what is left on the upgrade of most loss saved per unit of cost that fits
        best = None
        for k, g in enumerate(options):
            c0, l0 = g[picks[k]]
            for j, (c, loss) in enumerate(g):
                if loss < l0 and cost - c0 + c <= budget:
                    rate = (l0 - loss) / max(c - c0, 1e-12)
                    if best is None or rate > best[0]:
                        best = (rate, k, j)
        if best is None:
            break
        _, k, j = best
        cost += options[k][j][0] - options[k][picks[k]][0]
        picks[k] = j
    loss = _loss(options, picks)
    return Solution(picks, loss, cost, min(bound, loss), "lagrangian")


def solve_bounded(options: Sequence[Sequence[tuple[int, float]]], budget: int) -> Solution:
    """The exact solution where the dynamic programme fits (`MAX_CELLS`), else the Lagrangian
    one with its duality gap: either way the answer says how far from optimal it can be."""
    if len(options) * (budget + 1) <= MAX_CELLS:
        picks = solve(options, budget)
        loss = _loss(options, picks)
        return Solution(picks, loss, _cost(options, picks), loss, "exact")
    return lagrangian(options, budget)
