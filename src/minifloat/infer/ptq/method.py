"""How a PTQ config's weights are quantized: the method (round to nearest or GPTQ), the scale
observer, a Hadamard rotation of each Linear's input, smoothing, norm tuning after it — one frozen value,
`PTQMethod`, that `quantize_model(..., method=)` takes, with the recommended pipeline of each
config (`recommended`).

Example:
    >>> m = recommended("nvfp4-weight-only")
    >>> m.method, m.observer, m.rotation
    ('gptq', 'minmax', 'hadamard:16')
    >>> resolve_method("gptq", "mxfp4-weight-only", rotation="none").rotation is None
    True
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from minifloat.errors import MinifloatError
from minifloat.infer.ptq.config import QUANT_CONFIGS, QuantConfig, get_quant_config
from minifloat.infer.ptq.gptq import GPTQConfig, gptq, refit
from minifloat.infer.ptq.norm_tuning import NormTuning
from minifloat.infer.ptq.outliers import check_count
from minifloat.infer.ptq.rotation import parse_rotation
from minifloat.infer.ptq.rtn import tensor_amax
from minifloat.infer.ptq.scales import SCALE_OBSERVERS, observe_scales
from minifloat.infer.ptq.smoothing import check_alpha
from minifloat.quant import QuantizedTensor, quantize, quantize_with_scales

METHODS = ("rtn", "gptq")


@dataclass(frozen=True, kw_only=True)
class PTQMethod:
    """`method` ``"rtn"`` (round to nearest) or ``"gptq"``; `observer` of the block scales
    (``minmax``, ``mse``, ``4over6`` for NVFP4); `rotation` ``"hadamard:N"`` or None; `smooth`
    SmoothQuant's α for configs that quantize the input (None: no smoothing); `gptq` its options;
    `norm_tuning` the normalization gains distilled toward the full-precision model after the
    weights are quantized (`minifloat.infer.ptq.norm_tuning`; None: not); `keep_channels` the
    input channels per layer (largest calibration mean square) kept out of the quantized product,
    in BF16 (`minifloat.infer.ptq.outliers`; 0: none)."""

    method: str = "rtn"
    observer: str = "minmax"
    rotation: str | None = None
    smooth: float | None = None
    gptq: GPTQConfig = GPTQConfig()  # noqa: RUF009 - frozen
    norm_tuning: NormTuning | None = None
    keep_channels: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise MinifloatError(f"unknown PTQ method {self.method!r}; use one of {', '.join(METHODS)}")
        if self.observer not in SCALE_OBSERVERS:
            raise MinifloatError(f"unknown scale observer {self.observer!r}; use one of {', '.join(SCALE_OBSERVERS)}")
        parse_rotation(self.rotation)
        check_alpha(self.smooth)
        check_count(self.keep_channels)

    @property
    def sequential(self) -> bool:
        """Whether layers are calibrated in order, on the outputs of the quantized ones before."""
        return self.method == "gptq" or self.rotation is not None or self.smooth is not None or self.keep_channels > 0

    @property
    def label(self) -> str:
        """Short, for reports: ``gptq+mse+hadamard:32+smooth0.5``."""
        parts = [self.method] + ([self.observer] if self.observer != "minmax" else [])
        parts += [self.rotation] if self.rotation else []
        parts += [f"smooth{self.smooth:g}"] if self.smooth is not None else []
        parts += [f"asym{self.gptq.asymmetric:g}"] if self.gptq.asymmetric is not None else []
        parts += [f"keep{self.keep_channels}"] if self.keep_channels else []
        parts += [f"norms{self.norm_tuning.steps}"] if self.norm_tuning is not None else []
        return "+".join(parts)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


KEEP_MXFP8 = 16  # input channels per layer MXFP8 W8A8 keeps in BF16 (`_recommended_fields`)


def _recommended_fields(c: QuantConfig) -> dict:
    """What measured best on SmolLM2-135M (docs/guides/ptq.md, "Beyond round to nearest"), by what
    the config is: the minmax observer throughout (MSE scales under GPTQ: nvfp4-weight-only
    +8.4 % against +8.0 %, and slower); a Hadamard rotation as wide as the weight's blocks where it
    helped (every MX weight, NVFP4 weight-only; NVFP4 W4A4 +29.5 % → +43 % with one) — MXFP8 too:
    a column that meets a massive input channel holds its rows' largest weights, which a per-row
    FP32 scale puts exactly on 448 and an E8M0 block scale leaves rounded to 4 significant bits,
    and that one column's error is the layer's (SmolLM2's layer-28 down_proj: 43× fp8-weight-only's);
    the rotation spreads the channel over its group (mxfp8-weight-only KL 0.0168 → 0.0056, Δppl
    +0.85 → +0.44 % on 16 held-out batches); MXFP8 W8A8 instead keeps its 16 input channels of largest
    mean square per layer in BF16 (`minifloat.infer.ptq.outliers`): a block's largest input is rounded
    to 4 significant bits too, so the massive channels cost its inputs what they cost its weights
    (with its norms tuned, 4 / 16 held-out batches: rotated KL 0.0242 / 0.0244, Δppl +1.59 / +1.03 %;
    16 channels kept, not rotated: KL 0.0147 / 0.0145, Δppl +0.56 / +0.54 %); smoothing where
    the input's outliers are what remains (MXFP4 and NVFP4 W4A4); Four Over Six block scales for
    NVFP4 W4A4; asymmetric calibration with a ridge of 1 for the FP4 configs (W4A4: nvfp4 +22.0 %
    → +17.4 %, mxfp4 +43.5 % → +32.2 %; weight-only: nvfp4 +5.3 % → +4.4 %, mxfp4 +8.6 % → +6.8 %;
    on Qwen2.5-Coder-0.5B weight-only KL lower too, nvfp4 W4A4 Δppl and top-1 better but KL 0.041 → 0.054;
    FP8 it does not help: each layer's own input rounding is its error; MXFP6 neither: KL 0.0271 →
    0.0275, Δppl +1.91 % → +1.80 %); norm tuning (`NormTuning`'s 60 steps) where FP8 inputs are
    rounded with dynamic scales — per token, per 1 × 128, per 32 values — the error left after GPTQ
    there (SmolLM2, 4 / 16 held-out batches: fp8-dynamic +1.47 / +1.52 % → +0.64 / +0.99 %, KL 0.0211 →
    0.0205; mxfp8 +1.91 / +2.23 % → +1.29 / +1.73 %, KL 0.0390 → 0.0335 on 16; fp8-block KL 0.0165 /
    0.0177 → 0.0157 / 0.0165, Δppl +1.35 / +1.13 % → +1.50 / +0.97 %; the static per-tensor input not measured).
    Other configs (FP8 weight-only, the static per-tensor input): plain GPTQ."""
    w = c.weight_scheme
    weight_only = c.activation is None
    a = None if weight_only else c.activation_scheme
    rotate = {"rotation": f"hadamard:{w.block[1]}"} if w.is_mx or w.is_nvfp4 else {}  # as wide as a block
    if a is not None and a.element_format.bits == 8 and not c.static:
        return {**({"keep_channels": KEEP_MXFP8} if w.is_mx else {}), "norm_tuning": NormTuning()}
    asym = {"gptq": GPTQConfig(asymmetric=1.0)}
    if w.is_mx:
        fp4 = w.element_format.bits == 4
        smooth = {"smooth": 0.5} if fp4 and not weight_only else {}
        return {**rotate, **smooth, **(asym if fp4 else {})}
    if w.is_nvfp4:
        if weight_only:
            return {**rotate, **asym}
        return {"smooth": 0.5, **asym} if w.scale_rule == "4over6" else {"observer": "4over6", "smooth": 0.5, **asym}
    return {}


def recommended(config: str | QuantConfig, *, export: bool = False) -> PTQMethod:
    """The recommended GPTQ pipeline of `config` (`_recommended_fields`: which, and why); with
    `export`, the one a checkpoint can hold: without a rotation or kept channels (no reader
    applies them on load)."""
    fields = _recommended_fields(get_quant_config(config))
    if export:
        fields.pop("rotation", None)
        fields.pop("keep_channels", None)
    return PTQMethod(method="gptq", **fields)


def resolve_method(method: str | PTQMethod | None, config: str | QuantConfig, *, export: bool = False,
                   **overrides) -> PTQMethod:  # fmt: skip
    """`method` as a `PTQMethod`: ``"rtn"`` plain, ``"gptq"`` the config's recommended pipeline
    (`recommended`, `export` passed on); then the `overrides` not None (``observer``,
    ``rotation`` with ``"none"`` for none, ``smooth`` with a negative α for none, ``damp``,
    ``block_size``, ``act_order``, ``asymmetric`` with a negative ridge for none, ``tune_norms``
    steps of norm tuning with 0 for none) replace its parts."""
    if isinstance(method, PTQMethod):
        m = method
    elif method is None or method == "rtn":
        m = PTQMethod()
    elif method == "gptq":
        m = recommended(config, export=export)
    else:
        raise MinifloatError(f"unknown PTQ method {method!r}; use one of {', '.join(METHODS)}")
    g = {k: overrides.pop(k) for k in ("damp", "block_size", "act_order", "asymmetric") if overrides.get(k) is not None}
    if g.get("asymmetric") is not None and g["asymmetric"] < 0:
        g["asymmetric"] = None
    elif g.get("asymmetric") is not None and m.method != "gptq":
        raise MinifloatError(f"asymmetric calibration refits the weights GPTQ rounds; method {m.method!r} has none "
                             f"(use method gptq)")  # fmt: skip
    steps = overrides.pop("tune_norms", None)
    if steps is not None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise MinifloatError(f"tune_norms takes a number of steps ≥ 0, got {steps!r} (0: no norm tuning)")
        m = dataclasses.replace(m, norm_tuning=None if steps == 0 else dataclasses.replace(m.norm_tuning or NormTuning(), steps=steps))
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if "rotation" in overrides and str(overrides["rotation"]).lower() in ("none", ""):
        overrides["rotation"] = None
    if "smooth" in overrides and isinstance(overrides["smooth"], (int, float)) and overrides["smooth"] < 0:
        overrides["smooth"] = None
    if g:
        overrides["gptq"] = dataclasses.replace(m.gptq, **g)
    return dataclasses.replace(m, **overrides)


def config_for(config: QuantConfig, method: PTQMethod) -> QuantConfig:
    """`config` as `method` quantizes it: the Four Over Six twin of an NVFP4 config for the
    ``4over6`` observer (its block scales are the format's, read by every NVFP4 reader)."""
    if method.observer != "4over6" or config.scale_rule == "4over6":
        return config
    if not config.weight_scheme.is_nvfp4:
        raise MinifloatError(f"the 4over6 observer chooses NVFP4 block scales; config {config.name!r} is "
                             f"{config.weight} (use minmax or mse)")  # fmt: skip
    twin = dataclasses.replace(config, name=f"{config.name}+4over6", scale_rule="4over6")
    # a named config that is the twin (``nvfp4`` → ``nvfp4-4over6``) lends it its name
    return next((c for c in QUANT_CONFIGS.values() if dataclasses.replace(c, name=twin.name) == twin), twin)


def refit_if_asymmetric(weight: torch.Tensor, stats: dict, method: PTQMethod, name: str = "the layer") -> torch.Tensor:
    """`weight` as float32, refit to the full-precision model's outputs (`refit`) where `method` is
    asymmetric GPTQ and the layer has a ``stats["reference"]``."""
    w = weight.detach().float()
    if method.method == "gptq" and method.gptq.asymmetric is not None and stats.get("reference") is not None:
        w = refit(w, stats["hessian"], stats["reference"], method.gptq.asymmetric, name=name)
    return w


def quantize_weight(weight: torch.Tensor, config: QuantConfig, stats: dict, method: PTQMethod, *,
                    amax: torch.Tensor | None = None, name: str = "the layer",
                    dtype: torch.dtype | None = None) -> QuantizedTensor:  # fmt: skip
    """`weight` (N, K) in `config`'s weight scheme by `method`: its observer's block scales
    (`amax`: NVFP4's tensor amax), then each element rounded to nearest, or GPTQ with the
    layer's ``stats["hessian"]`` (asymmetric: on the weight refit to ``stats["reference"]`` first,
    where the layer has one). The result's original dtype is `dtype` (`weight`'s by default)."""
    ws = config.weight_scheme
    w = refit_if_asymmetric(weight, stats, method, name)
    if amax is None:
        amax = tensor_amax([w], config)
    if method.method == "rtn" and method.observer != "mse":
        q = quantize(w, ws, amax=amax)  # minmax / 4over6: the scheme's own rule, the fast path
    else:
        scales = observe_scales(w, ws, "minmax" if method.observer == "4over6" else method.observer, amax=amax)
        if method.method == "rtn":
            q = quantize_with_scales(w, ws, scales)
        else:
            if stats.get("hessian") is None:
                raise MinifloatError(f"GPTQ needs the Hessian of {name}'s input: calibrate on batches that reach it")
            q = gptq(w, stats["hessian"], ws, scales, config=method.gptq, name=name)
    return QuantizedTensor(q.data, q.scale, q.tensor_scale, q.shape, q.scheme, dtype or weight.dtype)
