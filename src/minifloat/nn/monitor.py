"""`minifloat.monitor(model)`: per layer and step telemetry of the quantized operands.

For each operand (input, weight, grad_output) of every minifloat Linear it records the amax,
the scale, the fraction *saturated* (|x| above the largest value its block can represent,
clipped) and the fraction *flushed* (non-zero, quantized to zero); and it names the first
layer whose output or input gradient went non-finite. The statistics are a few elementwise
passes over each operand — small next to the GEMM that consumes it.

``scale`` is the encode multiplier for per-tensor schemes (TE's ``scale``), and for block
schemes that of the block with the largest decode scale.

Example:
    >>> import minifloat
    >>> model = minifloat.convert(torch.nn.Sequential(torch.nn.Linear(32, 32)), "fp8-current")
    >>> with minifloat.monitor(model) as mon:
    ...     model(torch.randn(8, 32)).sum().backward()
    >>> sorted({r["operand"] for r in mon.records}), mon.first_nonfinite
    (['grad_output', 'input', 'weight'], None)
"""

from __future__ import annotations

import collections
import warnings

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from minifloat.errors import MinifloatError
from minifloat.nn.linear import Linear
from minifloat.scaling.layout import layout_for


def _element_decode_scales(q, grid: torch.Tensor) -> torch.Tensor:
    """The decode-scale `grid` of `q` broadcast to one value per element (rows, cols)."""
    lay = layout_for(q.shape, q.scheme)
    grid = grid.reshape(lay.grid)
    full = grid[:, None, :, None].expand(lay.tiles).reshape(lay.rows_pad, lay.cols_pad)
    return full[: lay.rows, : lay.cols]


class Monitor:
    """Telemetry of a model's minifloat Linears (see the module docstring).

    Attributes:
        records: one dict per layer, operand and forward/backward: ``step``, ``layer``,
            ``operand``, ``amax``, ``scale``, ``saturated``, ``flushed``; the newest
            `max_records` of them (a deque: a monitor left on does not grow without bound).
        first_nonfinite: ``{"step", "layer", "where"}`` of the first non-finite output or
            input gradient seen, else None.
        step: training steps of `model` seen since the monitor started (set it when
            resuming): optimizer steps that update a parameter of `model` after it ran, so
            two optimizers stepping one model after one backward count once, and another
            model's optimizer not at all.
        every: record operands on every `every`-th step only (non-finite outputs and
            gradients are checked on every step); 1 records all.

    The non-finite checks keep their flags on the tensors' device and read them once per
    optimizer step (or when `first_nonfinite` is read): no device sync per layer.
    """

    def __init__(self, model: torch.nn.Module, *, every: int = 1, max_records: int = 100_000) -> None:
        if not isinstance(model, torch.nn.Module):
            raise MinifloatError(f"monitor() takes a torch.nn.Module, got {type(model).__name__}")
        if every < 1:
            raise MinifloatError(f"Monitor(every={every}): record every ≥ 1 steps")
        if max_records < 1:
            raise MinifloatError(f"Monitor(max_records={max_records}): keep at least 1 record")
        self.records: collections.deque[dict] = collections.deque(maxlen=max_records)
        self._first_nonfinite: dict | None = None
        self._pending: list[tuple[dict, torch.Tensor]] = []  # (where, flag "not all finite")
        self.step = 0
        self.every = every
        self._model = model
        self._ran = False  # the model ran forward since the last counted step
        self._names = {id(m): name for name, m in model.named_modules() if isinstance(m, Linear)}
        self._modules = [m for m in model.modules() if isinstance(m, Linear)]
        for m in self._modules:
            if m._monitor is not None:  # one slot per layer: a second monitor would silence the first
                raise MinifloatError(
                    f"layer {self._names[id(m)] or '<root>'} is already watched by another monitor; "
                    "close that one first (or read its records)"
                )
        if not self._modules:
            warnings.warn(
                "minifloat.nn.monitor: the model has no minifloat Linear layers, so nothing will be "
                "recorded; convert it first (minifloat.convert(model, recipe))",
                stacklevel=3,
            )
        for m in self._modules:
            m._monitor = self
        self._hook = register_optimizer_step_post_hook(self._on_step)

    def _on_step(self, optimizer, args, kwargs) -> None:
        if not self._ran:
            return
        mine = {id(p) for p in self._model.parameters()}
        if any(id(p) in mine for group in optimizer.param_groups for p in group["params"]):
            self._resolve()
            self.step += 1
            self._ran = False

    @property
    def first_nonfinite(self) -> dict | None:
        self._resolve()
        return self._first_nonfinite

    def _resolve(self) -> None:
        """Read the pending non-finite flags (one transfer per device), keep the first set."""
        pending, self._pending = self._pending, []
        if self._first_nonfinite is not None or not pending:
            return
        by_device: dict[torch.device, list[int]] = {}
        for i, (_, flag) in enumerate(pending):
            by_device.setdefault(flag.device, []).append(i)
        bad = set()
        for idx in by_device.values():
            flags = torch.stack([pending[i][1] for i in idx]).tolist()
            bad.update(i for i, f in zip(idx, flags, strict=True) if f)
        if bad:
            self._first_nonfinite = pending[min(bad)][0]

    @torch.no_grad()
    def observe(self, layer, operand: str, x: torch.Tensor, q) -> None:
        self._ran = True
        if self.step % self.every:
            return
        fmt = q.scheme.element_format
        x2 = x.reshape(-1, x.shape[-1]).float()
        grid = q.decode_scales().float()
        dec = _element_decode_scales(q, grid)
        values = q.dequantize(torch.float32).reshape(x2.shape)
        ax = x2.abs()
        n = max(x2.numel(), 1)
        finite = torch.isfinite(ax)
        top = grid[torch.isfinite(grid)].max() if torch.isfinite(grid).any() else torch.tensor(float("nan"))
        self.records.append(
            {
                "step": self.step,
                "layer": self._names.get(id(layer), "?"),
                "operand": operand,
                "amax": float(torch.where(finite, ax, 0.0).max()) if x2.numel() else 0.0,
                "scale": float(1.0 / top) if top > 0 else float("nan"),
                # A block whose scale underflowed to 0 is flushed, not saturated.
                "saturated": float(((ax > fmt.max * dec) & (dec > 0)).sum()) / n,
                "flushed": float(((x2 != 0) & (values == 0)).sum()) / n,
            }
        )

    @torch.no_grad()
    def check(self, layer, where: str, t: torch.Tensor) -> None:
        self._ran = True
        if self._first_nonfinite is not None:
            return
        at = {"step": self.step, "layer": self._names.get(id(layer), "?"), "where": where}
        self._pending.append((at, ~torch.isfinite(t).all()))
        if len(self._pending) >= 4096:  # no optimizer steps (inference): read them now and then
            self._resolve()

    def latest(self) -> dict[tuple[str, str], dict]:
        """The newest record per (layer, operand)."""
        out = {}
        for r in self.records:
            out[(r["layer"], r["operand"])] = r
        return out

    def close(self) -> None:
        """Detach from the model (records and `first_nonfinite` stay readable)."""
        self._resolve()
        for m in self._modules:
            if m._monitor is self:
                m._monitor = None
        self._hook.remove()
        self._model = None

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def monitor(model: torch.nn.Module, *, every: int = 1, max_records: int = 100_000) -> Monitor:
    """Start recording telemetry of `model`'s minifloat Linears (on every `every`-th step,
    keeping the newest `max_records`); use as a context manager or call ``.close()``."""
    return Monitor(model, every=every, max_records=max_records)
