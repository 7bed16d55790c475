"""Post-training quantization configs: which scheme quantizes a Linear's weight, and its input.

A config is a frozen value, built by name (`get_quant_config("fp8-dynamic")`, the names the
command line takes) or by hand. The weight is quantized once, along K (in_features), and its
high-precision copy dropped; the input (activation) is quantized at every forward along K too,
per token / block from its own values (``dynamic``), or per tensor from an amax measured on
calibration data (``static``), or not at all (weight-only).

==================  ======================  ============================  ============================
name                weight                  input                         matches
==================  ======================  ============================  ============================
fp8-weight-only     E4M3 per row            high precision                torchao Float8WeightOnly
fp8-dynamic         E4M3 per row            E4M3 per token, dynamic       compressed-tensors FP8_DYNAMIC
fp8-static          E4M3 per tensor         E4M3 per tensor, calibrated   compressed-tensors FP8
fp8-block           E4M3 128×128            E4M3 1×128, dynamic           DeepSeek-V3, HF fine-grained FP8
fp8-dynamic-fnuz    E4M3FNUZ per row        E4M3FNUZ per token, dynamic   AMD MI300's FP8 (in memory only)
mxfp8/mxfp6/mxfp4   MX 1×32, E8M0           the same, dynamic             OCP MX
mxfp4-weight-only   MXFP4                   high precision                W4A16
nvfp4-weight-only   NVFP4 1×16              high precision                W4A16
nvfp4               NVFP4 1×16, E4M3 + FP32 NVFP4, calibrated global      compressed-tensors NVFP4
nvfp4-4over6[-wo]   NVFP4, Four Over Six    the same (or high precision)  NVFP4 readers (weights)
==================  ======================  ============================  ============================

Every config has a weight-only twin (`weight_only`): ``fp8-block-weight-only``,
``mxfp8-weight-only``, ``mxfp6-weight-only`` besides those above. A quantized LM head and
embedding use it: the lookup has no GEMM input to quantize, and the head's input is the model's
last hidden state, the one activation every token's logits depend on.

``mxfp6`` is E2M3, as the training recipe of that name (what measured best), and as
compressed-tensors packs MXFP6. The MX configs round the E8M0 scale exponent up (``rceil``).

Example:
    >>> c = get_quant_config("fp8-static")
    >>> c.weight, c.activation, c.needs_calibration
    ('fp8', 'fp8', True)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from minifloat.errors import MinifloatError
from minifloat.naming import lookup
from minifloat.scaling.schemes import Scheme, get_scheme

MIN_FEATURES = 16  # smaller layers stay in high precision: nothing to gain, and native GEMMs need 16


def block_k(scheme: Scheme) -> int:
    """The width along K (the last dim) of `scheme`'s blocks; 1 for tensor and row scales."""
    return scheme.block[1] if scheme.granularity == "block" else 1


@dataclass(frozen=True, kw_only=True)
class QuantConfig:
    """How `quantize_model` quantizes each Linear.

    Attributes:
        name: what reports and checkpoints call it.
        weight: the weight's scheme (a `minifloat.SCHEMES` name), quantized along K.
        activation: the input's scheme, or None for weight-only (the input stays in high
            precision and multiplies the exactly dequantized weight).
        static: the input's scale comes from a calibrated amax (per-tensor FP8; NVFP4's
            global scale), not from each input's own values.
    """

    name: str
    weight: str
    activation: str | None = None
    static: bool = False
    scale_rule: str | None = None  # MX: "floor" (OCP), "rceil" or "least-error"; NVFP4: "4over6"; None: the schemes' own
    # NVFP4 weights: a power-of-two global scale, which every reader decodes bit for bit
    # (compressed-tensors divides by it and rounds to bf16); off by default, as it costs accuracy
    # (docs/benchmarks/cpu-kernels.md)
    pow2_global_scale: bool = False

    def __post_init__(self) -> None:
        for role in ("weight", "activation"):
            value = getattr(self, role)
            if value is None and role == "activation":
                continue
            scheme = self._scheme(value)  # an unknown name: the scheme registry's error
            if scheme.rounding != "nearest":
                raise MinifloatError(
                    f"{role} scheme {value!r} rounds stochastically; inference rounds to nearest"
                )
        if not isinstance(self.pow2_global_scale, bool):
            raise MinifloatError(f"pow2_global_scale takes True or False, got {self.pow2_global_scale!r}")
        if self.static and self.activation is None:
            raise MinifloatError(f"config {self.name!r}: static=True needs an activation scheme")
        if self.static and not (
            self.activation_scheme.granularity == "tensor" or self.activation_scheme.is_nvfp4
        ):
            raise MinifloatError(
                f"config {self.name!r}: a calibrated (static) input scale is one per tensor; "
                f"{self.activation} scales each block from its own values (use static=False)"
            )
        if self.activation is not None:
            w, a = block_k(self.weight_scheme), block_k(self.activation_scheme)
            if w != 1 and a != 1 and w != a:
                raise MinifloatError(
                    f"config {self.name!r}: the weight's and input's blocks along K differ ({w} vs {a})"
                )

    @property
    def weight_scheme(self) -> Scheme:
        return self._scheme(self.weight)

    @property
    def activation_scheme(self) -> Scheme | None:
        return None if self.activation is None else self._scheme(self.activation)

    def _scheme(self, name: str) -> Scheme:
        s = get_scheme(name)
        applies = s.is_mx if self.scale_rule in ("floor", "rceil", "least-error") else s.is_nvfp4  # "4over6": NVFP4's block scales
        if self.scale_rule is None or not applies or s.scale_rule == self.scale_rule:
            return s
        return s.replace(name=f"{s.name}_{self.scale_rule}", scale_rule=self.scale_rule)

    @property
    def needs_calibration(self) -> bool:
        return self.static

    @property
    def block_k(self) -> int:
        """The width of the blocks along K that both operands share (1: no blocks along K)."""
        return max(block_k(s) for s in (self.weight_scheme, self.activation_scheme) if s is not None)

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


QUANT_CONFIGS: dict[str, QuantConfig] = {
    c.name: c
    for c in (
        QuantConfig(name="fp8-weight-only", weight="fp8_rowwise"),
        QuantConfig(name="fp8-dynamic", weight="fp8_rowwise", activation="fp8_rowwise"),
        QuantConfig(name="fp8-static", weight="fp8", activation="fp8", static=True),
        QuantConfig(name="fp8-block", weight="fp8_block128x128", activation="fp8_block128"),
        # AMD's FP8 (MI300): E4M3FNUZ, the same layout with one binade less on top (max 240)
        QuantConfig(name="fp8-dynamic-fnuz", weight="fp8_rowwise_fnuz", activation="fp8_rowwise_fnuz"),
        QuantConfig(name="fp8-weight-only-fnuz", weight="fp8_rowwise_fnuz"),
        # MX: the scale exponent rounded up (rceil, as torchao's default), not the OCP spec's floor,
        # whose largest values saturate (docs/benchmarks/cpu-kernels.md: what each costs)
        QuantConfig(name="mxfp8", weight="mxfp8", activation="mxfp8", scale_rule="rceil"),
        QuantConfig(name="mxfp6", weight="mxfp6_e2m3", activation="mxfp6_e2m3", scale_rule="rceil"),
        QuantConfig(name="mxfp4", weight="mxfp4", activation="mxfp4", scale_rule="rceil"),
        QuantConfig(name="mxfp4-weight-only", weight="mxfp4", scale_rule="rceil"),
        QuantConfig(name="nvfp4-weight-only", weight="nvfp4"),
        QuantConfig(name="nvfp4", weight="nvfp4", activation="nvfp4", static=True),
        # Four Over Six (arXiv 2512.02010): per block, the E4M3 scale that maps the amax to 6 or
        # to 4, whichever errs less — the same NVFP4 format, read by every NVFP4 reader
        QuantConfig(name="nvfp4-4over6-weight-only", weight="nvfp4", scale_rule="4over6"),
        QuantConfig(name="nvfp4-4over6", weight="nvfp4", activation="nvfp4", static=True, scale_rule="4over6"),
        # the weight-only twins of the configs above that have none (a quantized head and embedding use them)
        QuantConfig(name="fp8-block-weight-only", weight="fp8_block128x128"),
        QuantConfig(name="mxfp8-weight-only", weight="mxfp8", scale_rule="rceil"),
        QuantConfig(name="mxfp6-weight-only", weight="mxfp6_e2m3", scale_rule="rceil"),
    )
}
"""Named PTQ configs (what ``--scheme`` accepts)."""


def weight_only(config: str | QuantConfig | dict) -> QuantConfig:
    """The weight-only config with `config`'s weight scheme — a named one where there is one
    (``fp8-static``'s per-tensor weight: ``fp8-weight-only``, per row, as an LM head wants).

    Example:
        >>> weight_only("mxfp8").name, weight_only("nvfp4").name, weight_only("fp8-static").name
        ('mxfp8-weight-only', 'nvfp4-weight-only', 'fp8-weight-only')
    """
    c = get_quant_config(config)
    if c.activation is None:
        return c
    if c.weight_scheme.granularity == "tensor":
        return QUANT_CONFIGS["fp8-weight-only"]
    for w in QUANT_CONFIGS.values():
        if w.activation is None and w.weight_scheme == c.weight_scheme and w.pow2_global_scale == c.pow2_global_scale:
            return w
    return dataclasses.replace(c, name=f"{c.name}-weight-only", activation=None, static=False)


def get_quant_config(config: str | QuantConfig | dict) -> QuantConfig:
    """A named config, a config itself, or one rebuilt from `QuantConfig.to_dict()`.

    Example:
        >>> get_quant_config("fp8-block").weight
        'fp8_block128x128'
    """
    if isinstance(config, QuantConfig):
        return config
    if isinstance(config, str):
        return lookup(QUANT_CONFIGS, config, "quantization config")
    if isinstance(config, dict):
        try:
            return QuantConfig(**config)
        except TypeError as err:
            raise MinifloatError(f"not a QuantConfig description: {err}") from None
    raise MinifloatError(f"expected a config name, QuantConfig or dict, got {type(config).__name__}")
