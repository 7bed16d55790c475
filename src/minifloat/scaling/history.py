"""Amax histories: the rolling window of per-step amaxes that delayed scaling reduces to the
amax of the next scale (Transformer Engine's ``amax_history``), and the window reductions.

`reduce_amax_window` is the one reduction: `AmaxHistory` (one operand) and the delayed-scaling
buffers of `minifloat.nn.Linear` (three operands in one (3, L) buffer, kept in the module's
``state_dict``) both call it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from minifloat.errors import MinifloatError

WINDOW_ALGOS = ("max", "most_recent", "percentile")
"""The reductions of a window of amaxes (`reduce_amax_window`); a callable is accepted too."""
AMAX_ALGOS = (*WINDOW_ALGOS, "ema")
"""`AmaxHistory`'s algorithms: the window reductions, and an exponential moving average."""


def reduce_amax_window(seen: torch.Tensor, algo, percentile: float = 99.0) -> torch.Tensor:
    """Reduce amax windows `seen` (..., n), newest first, to one amax each with `algo`:
    ``"max"``, ``"most_recent"``, ``"percentile"`` or a callable ``window (n,) -> amax``.

    Example:
        >>> reduce_amax_window(torch.tensor([[3.0, 5.0], [2.0, 1.0]]), "max").tolist()
        [5.0, 2.0]
    """
    if callable(algo):
        rows = seen.reshape(-1, seen.shape[-1])
        out = torch.stack([torch.as_tensor(algo(row), dtype=torch.float32) for row in rows])
        return out.reshape(seen.shape[:-1])
    if algo == "most_recent":
        return seen[..., 0]
    if algo == "percentile":
        return torch.quantile(seen, percentile / 100.0, dim=-1)
    if algo == "max":
        return seen.amax(dim=-1)
    raise MinifloatError(f"unknown amax algorithm {algo!r}; use one of {', '.join(WINDOW_ALGOS)} or a callable")


@dataclass
class AmaxHistory:
    """A rolling window of amax values (TE's ``amax_history``) and how to reduce it.

    ``algo``: ``"max"`` (largest in the window), ``"most_recent"``, ``"ema"`` (exponential
    moving average with weight `ema_decay` on the past), ``"percentile"`` (the `percentile`-th
    percentile of the window), or a callable ``history (len,) -> amax``.

    Example:
        >>> h = AmaxHistory(length=3)
        >>> for a in [9.0, 5.0, 2.0, 3.0]:  # 9.0 has left the window of 3
        ...     h.update(torch.tensor(a))
        >>> h.amax().item(), h.history.tolist()
        (5.0, [3.0, 2.0, 5.0])
    """

    length: int = 1024
    algo: str | Callable[[torch.Tensor], torch.Tensor] = "max"
    ema_decay: float = 0.9
    percentile: float = 99.0
    history: torch.Tensor = field(default=None, repr=False)  # type: ignore[assignment]
    steps: int = 0

    def __post_init__(self) -> None:
        if self.length < 1:
            raise MinifloatError(f"amax history length must be ≥ 1, got {self.length}")
        if not callable(self.algo) and self.algo not in AMAX_ALGOS:
            raise MinifloatError(f"unknown amax algorithm {self.algo!r}; use one of {', '.join(AMAX_ALGOS)} or a callable")
        if not 0 <= self.ema_decay < 1:
            raise MinifloatError(f"ema_decay must be in [0, 1), got {self.ema_decay}")
        if not 0 <= self.percentile <= 100:
            raise MinifloatError(f"percentile must be in [0, 100], got {self.percentile}")
        if self.history is None:
            self.history = torch.zeros(self.length, dtype=torch.float32)
        self._ema = torch.zeros((), dtype=torch.float32)

    def update(self, amax: torch.Tensor) -> None:
        """Record this step's amax (newest first, the oldest falls off)."""
        amax = amax.detach().float().reshape(()).to(self.history.device)
        self.history = torch.roll(self.history, 1)
        self.history[0] = amax
        self._ema = amax if self.steps == 0 else self.ema_decay * self._ema + (1 - self.ema_decay) * amax
        self.steps += 1

    def amax(self) -> torch.Tensor:
        """The reduced amax the next scale is computed from."""
        seen = self.history[: min(self.steps, self.length)]
        if callable(self.algo):
            return torch.as_tensor(self.algo(seen), dtype=torch.float32)
        if self.steps == 0:
            return torch.zeros((), dtype=torch.float32)
        if self.algo == "ema":
            return self._ema.clone()
        return reduce_amax_window(seen, self.algo, self.percentile)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"history": self.history.clone(), "steps": torch.tensor(self.steps), "ema": self._ema.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state["history"].shape != self.history.shape:
            raise MinifloatError(
                f"amax history of length {state['history'].numel()} does not fit length {self.length}"
            )
        self.history = state["history"].clone().float()
        self.steps = int(state["steps"])
        self._ema = state["ema"].clone().float()
