"""`LossScaler`: dynamic loss scaling for low-precision gradients (FP16, FP8, FP4).

Multiply the loss by a scale S so small gradients survive the narrow formats; unscale the
gradients before the optimizer; when any of its gradients is inf/NaN, skip that optimizer's
step (others step, as with torch's GradScaler) and halve S; after `growth_interval` finite
steps in a row, double S. Gradients stay in the parameters' dtype (FP32 master weights), so
accumulation over micro-batches is FP32.

Example:
    >>> model = torch.nn.Linear(4, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> scaler = LossScaler(init_scale=1024.0, growth_interval=2)
    >>> loss = model(torch.ones(2, 4)).sum()
    >>> scaler.scale(loss).backward()
    >>> scaler.step(opt), scaler.update(), scaler.get_scale()
    (True, None, 1024.0)
"""

from __future__ import annotations

import math

import torch

from minifloat.errors import MinifloatError


class LossScaler:
    """Dynamic loss scale with skip-on-overflow.

    Args:
        init_scale: starting scale S.
        growth_factor / backoff_factor: S multiplier after `growth_interval` good steps /
            after a step with non-finite gradients.
        growth_interval: finite steps in a row before S grows.
        min_scale / max_scale: bounds of S.
        enabled: False keeps S at 1 (the loss and the gradients are not scaled, S never
            changes), while a step with non-finite gradients is still skipped, so they never
            reach the weights (torch's GradScaler, disabled, would take that step).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 2.0**-24,
        max_scale: float = 2.0**64,
        enabled: bool = True,
    ) -> None:
        if not (
            0 < min_scale <= init_scale <= max_scale < math.inf
            and 1 < growth_factor < math.inf and 0 < backoff_factor < 1 and growth_interval >= 1
        ):
            raise MinifloatError(
                "LossScaler needs 0 < min_scale ≤ init_scale ≤ max_scale < inf, growth_factor > 1 (finite), "
                "0 < backoff_factor < 1 and growth_interval ≥ 1; got "
                f"init_scale={init_scale}, min_scale={min_scale}, max_scale={max_scale}, "
                f"growth_factor={growth_factor}, backoff_factor={backoff_factor}, growth_interval={growth_interval}"
            )
        self.enabled = enabled
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.min_scale, self.max_scale = min_scale, max_scale
        self._scale = float(init_scale) if enabled else 1.0
        self._growth_tracker = 0
        self.skipped_steps = 0
        self._found: dict[int, bool] = {}  # per optimizer (id) unscaled since the last update()

    def get_scale(self) -> float:
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` × S (what to call ``backward`` on)."""
        return loss * self._scale if self.enabled else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide the gradients of `optimizer`'s parameters by S (once per step, e.g. before
        gradient clipping); returns whether any of them is non-finite."""
        if id(optimizer) in self._found:
            raise MinifloatError("unscale_() was already called for this optimizer since the last update()")
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if self.enabled and grads:
            inv = 1.0 / self._scale
            for g in grads:
                g.mul_(inv)
        # one flag per gradient on its device, one transfer per device (not a sync per gradient)
        flags: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:
            local = g.to_local() if hasattr(g, "to_local") else g  # FSDP2 shards: this rank's part
            flags.setdefault(local.device, []).append((~torch.isfinite(local)).any())
        found = torch.zeros((), dtype=torch.float32)
        for fs in flags.values():
            found = torch.maximum(found, torch.stack(fs).any().float().cpu())
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX)
        self._found[id(optimizer)] = bool(found)
        return bool(found)

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs) -> bool:
        """Unscale if not done yet, then ``optimizer.step()`` unless one of its gradients is
        non-finite. Returns whether the step was taken."""
        if id(optimizer) not in self._found:
            self.unscale_(optimizer)
        if self._found[id(optimizer)]:
            self.skipped_steps += 1
            return False
        optimizer.step(*args, **kwargs)
        return True

    def update(self) -> None:
        """Adjust S after the step: back off when any optimizer's gradients overflowed, grow
        after enough good steps."""
        if not self._found:
            raise MinifloatError("update() before step(): call scaler.step(optimizer) first")
        if self.enabled:
            if any(self._found.values()):
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
                self._growth_tracker = 0
            else:
                self._growth_tracker += 1
                if self._growth_tracker == self.growth_interval:
                    self._scale = min(self._scale * self.growth_factor, self.max_scale)
                    self._growth_tracker = 0
        self._found.clear()

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self._scale, "growth_tracker": self._growth_tracker, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        try:
            scale = float(state["scale"])
            growth_tracker, skipped = int(state["growth_tracker"]), int(state["skipped_steps"])
        except (KeyError, TypeError, ValueError) as err:
            raise MinifloatError(f"not a LossScaler state ({err!r}); expected keys scale, growth_tracker, skipped_steps") from None
        if not 0 < scale < math.inf:
            raise MinifloatError(f"not a LossScaler state: scale={scale} (a loss scale is finite and > 0)")
        self._scale, self._growth_tracker, self.skipped_steps = scale, growth_tracker, skipped
