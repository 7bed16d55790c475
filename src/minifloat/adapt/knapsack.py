"""The multiple-choice knapsack that automatic precision solves: pick one option per layer
(a candidate config, with a cost in bits and a loss) to minimise the total loss with the total
cost at most the budget. Solved exactly by dynamic programming over integer costs.

Example:
    >>> solve([[(4, 1.0), (8, 0.1)], [(4, 2.0), (8, 0.5)]], budget=12)
    [0, 1]
"""

from __future__ import annotations

from collections.abc import Sequence

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
