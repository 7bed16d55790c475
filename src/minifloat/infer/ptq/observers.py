"""Observers: the statistics of a Linear's input that PTQ algorithms calibrate on, each a small
object fed every calibration batch (`observe`) and read once (`result`).

- `AmaxObserver`: the largest |x| (``"max"``), or per batch the `percentile`-th percentile of |x|
  and the largest of those (``"percentile"``: clips outliers) — a calibrated input scale.
- `ChannelAmaxObserver`: per input channel, the largest |x| (K,) — what smoothing divides by.
- `HessianObserver`: ``H = XᵀX / n`` (K, K) over the n input rows, accumulated in float64 — the
  second moment GPTQ's error compensation reads (``2 XᵀX`` up to a scale it does not depend on).
- `ReferenceObserver`: ``C = (X_ref − X)ᵀ X / n`` (K, K), X_ref the full-precision model's inputs
  of the same rows (given to it, batch by batch) — what asymmetric GPTQ fits the weight to.

`observe(model, batches, kinds)` runs the model once over `batches` without gradients and feeds
every Linear's input to one observer of each kind (`OBSERVERS`), by layer name.

Example:
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    >>> stats = observe(model, [torch.tensor([[1.0, -2.0, 0.0, 0.5]])], ("amax", "channel_amax", "hessian"))
    >>> float(stats["0"]["amax"]), stats["0"]["channel_amax"].tolist(), float(stats["0"]["hessian"][1, 1])
    (2.0, [1.0, 2.0, 0.0, 0.5], 4.0)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from minifloat.errors import MinifloatError

CALIBRATION_METHODS = ("max", "percentile")


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """`x` (..., K) as float32 rows (n, K); a NaN is an error naming the layer."""
    x = x.detach().float().reshape(-1, x.shape[-1])
    if torch.isnan(x).any():
        raise MinifloatError(f"calibration: the input of {name} holds a NaN; check the model and data")
    return x


class AmaxObserver:
    """See the module docstring; `result()` is a float32 0-d tensor on the CPU."""

    def __init__(self, method: str = "max", percentile: float = 99.99) -> None:
        if method not in CALIBRATION_METHODS:
            raise MinifloatError(f"unknown calibration method {method!r}; use one of {', '.join(CALIBRATION_METHODS)}")
        if not 0 < percentile <= 100:
            raise MinifloatError(f"percentile must be in (0, 100], got {percentile}")
        self.method, self.percentile, self.value = method, percentile, None

    def observe(self, x: torch.Tensor, name: str = "") -> None:
        a = _rows(x, name).abs().flatten()
        if self.method == "max":
            v = a.max()
        else:  # torch.quantile takes at most 2**24 values: a random sample of them beyond
            sample = a if a.numel() <= 1 << 24 else a[torch.randperm(a.numel(), device=a.device)[: 1 << 24]]
            v = torch.quantile(sample, self.percentile / 100.0)
        v = v.cpu()
        self.value = v if self.value is None else torch.maximum(self.value, v)

    def result(self) -> torch.Tensor | None:
        return self.value


class ChannelAmaxObserver:
    """Per input channel, the largest |x| (K,) float32."""

    def __init__(self) -> None:
        self.value = None

    def observe(self, x: torch.Tensor, name: str = "") -> None:
        v = _rows(x, name).abs().amax(0).cpu()
        self.value = v if self.value is None else torch.maximum(self.value, v)

    def result(self) -> torch.Tensor | None:
        return self.value


class HessianObserver:
    """``XᵀX / n`` (K, K) float64 over every input row seen."""

    def __init__(self) -> None:
        self.sum, self.rows = None, 0

    def observe(self, x: torch.Tensor, name: str = "") -> None:
        r = _rows(x, name).double()
        xtx = (r.t() @ r).cpu()
        self.sum = xtx if self.sum is None else self.sum + xtx
        self.rows += r.shape[0]

    def result(self) -> torch.Tensor | None:
        return None if self.sum is None else self.sum / self.rows


class ReferenceObserver:
    """``(X_ref − X)ᵀ X / n`` (K, K) float64: X the inputs observed, X_ref `reference`'s entries
    in the same order (one per observed batch, the same rows: `transform` applied to each first,
    as the layer transforms its input). None when a batch's rows are not the reference's: a MoE
    expert, whose router may send it other tokens in the quantized model, gets no reference."""

    def __init__(self, reference: Sequence[torch.Tensor], transform: Callable | None = None) -> None:
        self.reference, self.transform = list(reference), transform
        self.sum, self.rows, self.batches, self.aligned = None, 0, 0, True

    def observe(self, x: torch.Tensor, name: str = "") -> None:
        r = _rows(x, name)
        ref = self.reference[self.batches] if self.batches < len(self.reference) else None
        self.batches += 1
        if ref is not None:
            ref = ref.detach().float().reshape(-1, ref.shape[-1])
            ref = self.transform(ref) if self.transform is not None else ref
        if not self.aligned or ref is None or ref.shape != r.shape:
            self.aligned = False
            return
        rd = r.double()
        c = ((ref.double() - rd).t() @ rd).cpu()
        self.sum = c if self.sum is None else self.sum + c
        self.rows += r.shape[0]

    def result(self) -> torch.Tensor | None:
        whole = self.aligned and self.batches == len(self.reference) and self.sum is not None
        return self.sum / self.rows if whole else None


class RowsObserver:
    """How many input rows (tokens) the layer saw: a MoE expert sees the ones its router sends it."""

    def __init__(self) -> None:
        self.rows = 0

    def observe(self, x: torch.Tensor, name: str = "") -> None:
        self.rows += x.numel() // max(x.shape[-1], 1)

    def result(self) -> int:
        return self.rows


OBSERVERS: dict[str, Callable[[], object]] = {
    "amax": AmaxObserver,
    "rows": RowsObserver,
    "channel_amax": ChannelAmaxObserver,
    "hessian": HessianObserver,
}
"""Observer kinds by name: a factory of an object with ``observe(x, name)`` and ``result()``."""


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


def observe(model: torch.nn.Module, batches: Iterable, kinds: Sequence[str] | Mapping[str, Callable[[], object]], *,
            layers: Callable[[str, torch.nn.Module], bool] | None = None) -> dict[str, dict[str, object]]:  # fmt: skip
    """Run `model` on `batches` (token-id tensors, or dicts of model inputs) without gradients;
    per Linear (those `layers(name, module)` accepts, every one by default) and per observer kind
    (names of `OBSERVERS`, or a mapping of names to factories), the result of the observer fed
    every input of that Linear. A layer the batches never reached is absent."""
    unknown = [k for k in (kinds if not isinstance(kinds, Mapping) else ()) if k not in OBSERVERS]
    if unknown:
        raise MinifloatError(f"unknown observer {unknown[0]!r}; use one of {', '.join(OBSERVERS)}")
    factories = {k: OBSERVERS[k] for k in kinds} if not isinstance(kinds, Mapping) else dict(kinds)
    seen: dict[str, dict[str, object]] = {}

    def hook(name):
        def record(module, args):
            x = args[0]
            if not x.is_floating_point() or x.numel() == 0:
                return
            obs = seen.setdefault(name, {k: f() for k, f in factories.items()})
            for o in obs.values():
                o.observe(x, name)

        return record

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and (layers is None or layers(name, m))]  # fmt: skip
    n = 0
    try:
        with torch.no_grad(), eval_mode(model):
            for batch in batches:
                model(**batch) if isinstance(batch, Mapping) else model(batch)
                n += 1
    finally:
        for h in handles:
            h.remove()
    if n == 0:
        raise MinifloatError("calibration got no batches; pass an iterable of token-id tensors")
    return {name: {k: o.result() for k, o in obs.items()} for name, obs in seen.items()}
