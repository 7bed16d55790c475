"""Token-based precision: inside one Linear, the rows (tokens) judged important run in a high
config (FP8) and the rest in a low one (FP4), in the same forward.

`TokenPrecisionLinear` holds the layer in both configs (two `QuantizedLinear`s: the FP4 weight
adds about 0.56 bytes per weight to the FP8 one, counted in `packed_nbytes`). Its forward splits
the input's rows by a boolean mask and runs two GEMMs, one per subset; each subset is quantized
as its config says (dynamic scales are those of the subset's own rows and blocks; a calibrated
input scale is the layer's). Only the subsets are copied, never a dequantized whole activation.

Which rows are important (`TokenPolicy`, any of them, OR-ed):
- ``outlier_pct``: the rows whose ``amax`` (or L2 ``norm``) is in the top p % of the layer's
  input — measured per layer, per forward;
- ``sink_tokens``: the first n positions of every sequence (attention sinks);
- ``special_ids``: positions holding these token ids;
- a user mask (B, T) given for a forward with `TokenPrecision.mask`.
Positions and ids are those of the model's input (a forward pre-hook reads them), so the
position rules hold for forwards over whole sequences (evaluation, prefill), not for one-token
decode steps, where only the outlier rule and the user mask apply.

The cost is the average activation bits per element over every row the layers multiplied
(codes and their block or row scales).

Example:
    >>> from minifloat.models.gpt import GPT, GPTConfig
    >>> torch.manual_seed(0) and None
    >>> gpt = GPT(GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=64)).eval()
    >>> tp = token_precision(gpt, TokenPolicy(sink_tokens=4), high="fp8-dynamic", low="mxfp4")
    >>> _ = gpt(torch.randint(0, 256, (2, 16)))
    >>> round(tp.high_fraction(), 3), round(tp.average_activation_bits(), 2)
    (0.25, 5.26)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minifloat.errors import MinifloatError
from minifloat.infer.modules.linear import QuantizedLinear
from minifloat.infer.ptq.config import QuantConfig, get_quant_config
from minifloat.infer.quantize import calibrate, matches, why_not
from minifloat.nn.convert import swap_modules
from minifloat.quant import quantize


@dataclass(frozen=True)
class TokenPolicy:
    """Which tokens are important (see the module docstring); the rules are OR-ed."""

    outlier_pct: float = 0.0
    outlier_by: str = "amax"  # "amax" | "norm"
    sink_tokens: int = 0
    special_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 <= self.outlier_pct <= 100.0:
            raise MinifloatError(f"outlier_pct is a percentage in [0, 100], got {self.outlier_pct}")
        if self.outlier_by not in ("amax", "norm"):
            raise MinifloatError(f"outlier_by is 'amax' or 'norm', got {self.outlier_by!r}")
        if self.sink_tokens < 0:
            raise MinifloatError(f"sink_tokens must be ≥ 0, got {self.sink_tokens}")
        object.__setattr__(self, "special_ids", tuple(int(i) for i in self.special_ids))

    def describe(self) -> str:
        parts = []
        if self.outlier_pct:
            parts.append(f"top {self.outlier_pct:g} % rows by {self.outlier_by}")
        if self.sink_tokens:
            parts.append(f"first {self.sink_tokens} tokens")
        if self.special_ids:
            parts.append(f"ids {list(self.special_ids)}")
        return " + ".join(parts) or "user mask only"


def activation_bits(config: QuantConfig, k: int) -> float:
    """Bits per element of one input row of length `k` in `config`'s activation scheme: codes and
    the row's block or row scales (a per-tensor scale is shared by every row: not counted).
    Weight-only configs keep the input as it is: 16 bits (BF16 activations)."""
    scheme = config.activation_scheme
    if scheme is None:
        return 16.0
    return quantize(torch.zeros(1, k), scheme).bits_per_element


class _State:
    """What a forward of the model shares with its layers: the (B, T) important-token mask."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None
        self.user: torch.Tensor | None = None


class TokenPrecisionLinear(torch.nn.Module):
    """A Linear in two configs; each forward routes its rows by importance (module docstring)."""

    def __init__(self, high: QuantizedLinear, low: QuantizedLinear, policy: TokenPolicy, state: _State | None = None) -> None:
        super().__init__()
        if (high.in_features, high.out_features) != (low.in_features, low.out_features):
            raise MinifloatError("the high and low layers must have the same shape")
        self.high, self.low, self.policy = high, low, policy
        self.in_features, self.out_features = high.in_features, high.out_features
        self.state = state or _State()
        self.bits = (activation_bits(high.config, self.in_features), activation_bits(low.config, self.in_features))
        self.rows = [0, 0]  # rows run high, rows run low (since the last reset)

    def important(self, x2: torch.Tensor) -> torch.Tensor:
        """The (M,) mask of rows run in the high config."""
        m = x2.shape[0]
        mask = torch.zeros(m, dtype=torch.bool, device=x2.device)
        for given in (self.state.mask, self.state.user):
            if given is not None and given.numel() == m:
                mask |= given.reshape(m).to(x2.device)
        p = self.policy.outlier_pct
        if p > 0 and m:
            score = x2.abs().amax(-1) if self.policy.outlier_by == "amax" else x2.float().norm(dim=-1)
            mask[score.topk(min(m, math.ceil(p / 100.0 * m))).indices] = True
        return mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise MinifloatError(f"input has {x.shape[-1]} features, the layer takes {self.in_features}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        mask = self.important(x2)
        hi, lo = mask.nonzero().squeeze(1), (~mask).nonzero().squeeze(1)
        y = x2.new_empty(x2.shape[0], self.out_features)
        if hi.numel():
            y[hi] = self.high(x2[hi])
        if lo.numel():
            y[lo] = self.low(x2[lo])
        self.rows[0] += hi.numel()
        self.rows[1] += lo.numel()
        return y.reshape(*lead, self.out_features)

    def packed_nbytes(self) -> int:
        return self.high.packed_nbytes() + self.low.packed_nbytes()

    def extra_repr(self) -> str:
        return f"high={self.high.config.name}, low={self.low.config.name}, policy={self.policy.describe()}"


class TokenPrecision:
    """The handle `token_precision` returns: its layers, the statistics, a user mask."""

    def __init__(self, layers: dict[str, TokenPrecisionLinear], state: _State, hook) -> None:
        self.layers, self.state, self._hook = layers, state, hook

    def reset(self) -> None:
        for m in self.layers.values():
            m.rows = [0, 0]

    def high_fraction(self) -> float:
        """Of the rows every layer multiplied since the last reset, the fraction run high."""
        hi = sum(m.rows[0] for m in self.layers.values())
        total = hi + sum(m.rows[1] for m in self.layers.values())
        return hi / total if total else 0.0

    def average_activation_bits(self) -> float:
        """Activation bits per element over every row multiplied since the last reset (each layer
        weighted by its rows × in_features)."""
        num = den = 0.0
        for m in self.layers.values():
            num += (m.rows[0] * m.bits[0] + m.rows[1] * m.bits[1]) * m.in_features
            den += (m.rows[0] + m.rows[1]) * m.in_features
        return num / den if den else float("nan")

    @contextlib.contextmanager
    def mask(self, important: torch.Tensor):
        """Run the forwards inside with these (B, T) positions important too."""
        self.state.user = torch.as_tensor(important, dtype=torch.bool)
        try:
            yield
        finally:
            self.state.user = None

    def remove(self) -> None:
        """Detach the input hook (the layers stay)."""
        self._hook.remove()


def _position_mask(ids: torch.Tensor, policy: TokenPolicy) -> torch.Tensor | None:
    if not (policy.sink_tokens or policy.special_ids) or ids.dim() != 2 or ids.dtype.is_floating_point:
        return None
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    mask[:, : policy.sink_tokens] = True
    for i in policy.special_ids:
        mask |= ids == i
    return mask


def token_precision(
    model: torch.nn.Module,
    policy: TokenPolicy,
    *,
    high: str | QuantConfig = "fp8-dynamic",
    low: str | QuantConfig = "nvfp4",
    calibration=None,
    ignore: Sequence[str] = ("lm_head",),
) -> TokenPrecision:
    """Replace (in place) every Linear both configs can take by a `TokenPrecisionLinear`; a
    forward pre-hook on `model` reads each forward's token ids for the position rules.
    `calibration` (`calibrate`'s result or batches) is needed by configs with calibrated inputs."""
    high, low = get_quant_config(high), get_quant_config(low)
    if (high.needs_calibration or low.needs_calibration) and calibration is None:
        raise MinifloatError(f"{high.name if high.needs_calibration else low.name} calibrates its input: pass calibration= (batches)")
    if calibration is not None and not isinstance(calibration, dict):
        calibration = calibrate(model, calibration)
    state = _State()
    built: dict[str, TokenPrecisionLinear] = {}
    by_old: dict[int, TokenPrecisionLinear] = {}
    for name, m in model.named_modules():
        if not (isinstance(m, torch.nn.Linear) and name) or matches(name, ignore):
            continue
        if why_not(m, high) or why_not(m, low):
            continue
        amax = calibration.get(name) if calibration is not None else None
        if (high.needs_calibration or low.needs_calibration) and amax is None:
            continue
        q = [QuantizedLinear.from_linear(m, c, input_amax=amax if c.needs_calibration else None) for c in (high, low)]
        built[name] = by_old[id(m)] = TokenPrecisionLinear(q[0], q[1], policy, state)
    if not built:
        raise MinifloatError(f"no Linear of the model can take both {high.name} and {low.name}")
    swap_modules(model, list(built), lambda old: by_old[id(old)])

    def pre(module, args, kwargs):
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("idx"))
        state.mask = _position_mask(ids, policy) if isinstance(ids, torch.Tensor) else None

    hook = model.register_forward_pre_hook(pre, with_kwargs=True)
    return TokenPrecision(built, state, hook)
