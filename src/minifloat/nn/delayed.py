"""Delayed-scaling state of a module: amax histories and scales for input, weight, grad_output.

Semantics (Transformer Engine's ``DelayedScaling``):

- Every forward/backward in training records the operand's amax into a *pending* slot, the
  max over all micro-batches of the step (NaN and ±inf are ignored, so one bad micro-batch
  does not poison the history).
- When an optimizer steps (any ``torch.optim`` optimizer: minifloat registers a global
  optimizer step post-hook) every module with pending amaxes whose weight it updates (or
  that no optimizer updates) rolls its history once: the pending amax goes in front
  (max-reduced across ranks under ``torch.distributed``), the oldest falls off. So a step of
  8 micro-batches is one history entry, a step the `LossScaler` skips adds none, and of two
  models with their own optimizers each rolls at its own optimizer's step.
- Every `interval` steps the scale becomes ``max / reduce(history) / 2**margin``; a zero or
  non-finite result keeps the previous scale (`minifloat.scale_from_amax`).
- The state is three buffers — ``amax_history`` (3, L), ``scale`` (3,), ``amax_steps`` — in
  the module's ``state_dict``, so a resumed run continues with the same scales.

One deliberate difference from TE: before the first history entry exists, an operand is
scaled from its own amax (current scaling) rather than with scale 1, which would flush most
gradients to zero in the first step.

Why not three `minifloat.AmaxHistory` objects: the histories must be buffers of the module —
in its ``state_dict`` (checkpoints, resume), moved by ``.to()``, sharded and gathered by FSDP —
and every module rolls at the optimizer step with one all-reduce for the whole model. The
window reduction is the same function (`minifloat.scaling.history.reduce_amax_window`).
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from minifloat.recipes import ROLES, DelayedScaling
from minifloat.scaling.history import reduce_amax_window
from minifloat.scaling.rules import scale_from_amax

_MODULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # keys in registration order
_OPTIMIZERS: weakref.WeakSet = weakref.WeakSet()  # every optimizer that has stepped
_HOOK = None


def _on_optimizer_step(optimizer, args, kwargs) -> None:
    _OPTIMIZERS.add(optimizer)
    roll_all(modules_to_roll(optimizer, [m for m in list(_MODULES) if m.amax_pending_steps]))


def modules_to_roll(optimizer, pending: list) -> list:
    """The modules of `pending` that `optimizer`'s step ends the step of: those whose weight it
    updates, and those whose weight no optimizer updates (frozen layers). A module another
    optimizer updates waits for that one: two models stepped by their own optimizers (a GAN, a
    distillation) each roll once per their own step."""
    if not pending:
        return []
    mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if all(id(m.weight) in mine for m in pending):
        return pending
    others = {id(p) for opt in list(_OPTIMIZERS) if opt is not optimizer
              for group in opt.param_groups for p in group["params"]}  # fmt: skip
    return [m for m in pending if id(m.weight) in mine or id(m.weight) not in others]


def register(module) -> None:
    """Track `module` so optimizer steps roll its history (idempotent). `record` calls it too,
    so a module made without ``__init__`` (``copy.deepcopy``, unpickling) is tracked as well."""
    global _HOOK
    if module not in _MODULES:
        _MODULES[module] = None
    if _HOOK is None:
        _HOOK = register_optimizer_step_post_hook(_on_optimizer_step)


def roll_all(modules: list) -> None:
    """Roll `modules` (in the same order on every rank) with one max all-reduce in all."""
    if not modules:
        return
    pending = torch.stack([m.amax_pending.to(m.amax_history.device) for m in modules])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(pending, op=torch.distributed.ReduceOp.MAX)
    for module, amax in zip(modules, pending, strict=True):
        roll(module, amax)


FP32_BUFFERS = ("amax_history", "scale")  # float32 whatever the model's dtype (Linear._apply)


def init_buffers(module, recipe: DelayedScaling, device=None) -> None:
    n, f32 = len(ROLES), torch.float32
    module.register_buffer("amax_history", torch.zeros(n, recipe.amax_history_len, dtype=f32, device=device))
    module.register_buffer("scale", torch.ones(n, dtype=f32, device=device))
    module.register_buffer("amax_steps", torch.zeros((), dtype=torch.int64, device=device))
    module.amax_pending = torch.zeros(n, dtype=f32, device=device)
    module.amax_pending_steps = 0


def record(module, role: str, amax: torch.Tensor) -> None:
    """Fold this micro-batch's amax of `role` into the pending slot."""
    i = ROLES.index(role)
    pending = module.amax_pending
    if pending.device != amax.device:
        pending = module.amax_pending = pending.to(amax.device)
    pending[i] = torch.fmax(pending[i], torch.where(torch.isfinite(amax), amax, 0.0))
    if not module.amax_pending_steps:  # the step's first record
        register(module)
        module.amax_pending_steps = 1


def steps(module) -> int:
    """``module.amax_steps`` as a Python int: read from the buffer once (on a GPU, a device
    sync), then kept in step by `roll`, so that quantizing an operand never waits for the
    device. Loading a state_dict forgets it (`forget_steps`)."""
    n = module.__dict__.get("amax_steps_int")
    if n is None:
        n = module.__dict__["amax_steps_int"] = int(module.amax_steps)
    return n


def forget_steps(module) -> None:
    module.__dict__.pop("amax_steps_int", None)


def current_scale(module, role: str) -> torch.Tensor | None:
    """The scale to quantize `role` with, or None (no history yet: use the tensor's own amax)."""
    if steps(module) == 0:
        return None
    return module.scale[ROLES.index(role)]


def roll(module, pending: torch.Tensor) -> None:
    """End of a step: push the (rank-reduced) `pending` amaxes into the history, maybe
    refresh the scales."""
    recipe: DelayedScaling = module.recipe
    n = steps(module) + 1  # read before the buffer moves on
    with torch.no_grad():
        module.amax_history.copy_(torch.roll(module.amax_history, 1, dims=1))
        module.amax_history[:, 0] = pending
        module.amax_steps += 1
        module.__dict__["amax_steps_int"] = n
        if (n - 1) % recipe.interval == 0:
            seen = module.amax_history[:, : min(n, module.amax_history.shape[1])]
            amax = reduce_amax_window(seen, recipe.amax_compute_algo)
            for i, role in enumerate(ROLES):
                fmt = recipe.scheme(role).element_format
                module.scale[i] = scale_from_amax(amax[i], fmt, recipe.margin, previous=module.scale[i])
    module.amax_pending = torch.zeros_like(module.amax_pending)
    module.amax_pending_steps = 0
