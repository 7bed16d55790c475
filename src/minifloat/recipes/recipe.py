"""Training recipes: which scheme quantizes each operand of a Linear's three GEMMs.

A Linear computes three GEMMs; each quantizes its two operands along that GEMM's reduction
dimension (roles named as in Transformer Engine):

==============  ==========================  ===========================
GEMM            operands                    reduction dimension
==============  ==========================  ===========================
``output``      input (M,K) · weight (N,K)ᵀ  K (in_features)
``grad_input``  grad_output (M,N) · weight   N (out_features)
``grad_weight`` grad_outputᵀ · input         M (tokens)
==============  ==========================  ===========================

A recipe is a frozen value, built by name (`get_recipe("mxfp8")`) or by hand, JSON-serialisable:

- `DelayedScaling` (``"fp8"``): TE's FP8 delayed scaling — per-tensor FP32 scales from an amax
  history; ``format="hybrid"`` is E4M3 for input/weight and E5M2 for grad_output.
- `CurrentScaling` (``"fp8-current"``): per-tensor scales from the tensor's own amax.
- `Float8BlockScaling` (``"fp8-block"``): DeepSeek-V3 §3.3 — 1×128 blocks for activations and
  gradients, 128×128 blocks for weights, FP32 scales.
- `MXScaling` (``"mxfp8"``, ``"mxfp6"`` (E2M3, what measured best), ``"mxfp6-e2m3"``, ``"mxfp6-e3m2"``, ``"mxfp6-hybrid"``
  (E2M3 input and weight, E3M2 grad_output), ``"mxfp4"``): OCP MX, 32-element
  blocks along the reduction dimension with E8M0 scales, for every operand; ``"mxfp4"`` with
  Tseng et al.'s fixes and its first block kept in high precision (``"mxfp4-tseng"``: the fixes
  alone; ``"mxfp4-rtn"``: as OCP MX specifies, round to nearest everywhere).
- `NVFP4BlockScaling` (``"nvfp4"``): NVIDIA's NVFP4 pretraining recipe (arXiv 2509.25149):
  1×16 blocks with E4M3 scales and an FP32 tensor scale, 16×16 weight blocks, a 16-point
  random Hadamard transform on the weight-gradient GEMM's operands and stochastic rounding of
  gradients; each switchable.

Every recipe takes `outlier_channels` (k, default 0): in each forward GEMM the k input channels of
largest magnitude are taken out of both operands' quantization and multiplied in BF16 (TetraJet-v2's
OutControl, arXiv 2510.27527; OSC, arXiv 2604.12782): an outlier channel no longer sets the scale
of the block it shares with 15 (NVFP4) or 31 (MX) ordinary values. The backward GEMMs quantize along
out_features and the tokens, where a channel's values share no block with other channels, and are
unchanged.

Example:
    >>> r = get_recipe("fp8")
    >>> r.scheme("input").element, r.scheme("grad_output").element, r.amax_history_len
    ('e4m3', 'e5m2', 1024)
    >>> get_recipe(get_recipe("nvfp4").to_dict()) == get_recipe("nvfp4")
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from minifloat.errors import MinifloatError
from minifloat.naming import lookup
from minifloat.scaling.history import WINDOW_ALGOS
from minifloat.scaling.schemes import Scheme, get_scheme, named

ROLES = ("input", "weight", "grad_output")
# An FP8 recipe's `format`: the element of (input and weight, grad_output). The fnuz ones are AMD's
# (MI300): the same bits read with a bias one larger, no inf, no −0.
FP8_ELEMENTS = {"hybrid": ("e4m3", "e5m2"), "e4m3": ("e4m3", "e4m3"),
                "hybrid-fnuz": ("e4m3fnuz", "e5m2fnuz"), "e4m3fnuz": ("e4m3fnuz", "e4m3fnuz")}  # fmt: skip
FP8_FORMATS = tuple(FP8_ELEMENTS)


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """Base of every recipe: the scheme per operand role, and how it is applied."""

    kind: ClassVar[str] = ""
    outlier_channels: int = 0  # the forward GEMM's input channels multiplied in BF16 (module docstring)

    def __post_init__(self) -> None:
        k = self.outlier_channels
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise MinifloatError(f"{type(self).__name__}(outlier_channels=...) takes a whole number of channels ≥ 0, got {k!r}")

    def scheme(self, role: str) -> Scheme:
        """The scheme that quantizes operand `role` along a GEMM's reduction dimension
        (`_scheme`'s, remembered by the instance: every forward and backward asks, several
        times per layer)."""
        cache = self.__dict__.get("_schemes")
        if cache is None:
            cache = {}
            object.__setattr__(self, "_schemes", cache)  # not a field: eq, hash, to_dict ignore it
        if role not in cache:
            cache[role] = self._scheme(role)
        return cache[role]

    def _scheme(self, role: str) -> Scheme:
        raise NotImplementedError

    @property
    def weight_2d(self) -> bool:
        """True when the weight's blocks are square, so one quantization serves W and Wᵀ."""
        b = self.scheme("weight").block
        return b is not None and b[0] == b[1] and b[0] > 1

    @property
    def delayed(self) -> bool:
        """True when scales come from an amax history (state kept in the module)."""
        return False

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = {"recipe": self.kind}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            d[f.name] = f"<callable {getattr(v, '__qualname__', repr(v))}>" if callable(v) else v
        return d

    def replace(self, **changes) -> Recipe:
        return dataclasses.replace(self, **changes)


def _fp8_element(fmt: str, role: str) -> str:
    if fmt not in FP8_ELEMENTS:
        raise MinifloatError(f"unknown FP8 format {fmt!r}; use 'hybrid' (E4M3 forward, E5M2 gradients), 'e4m3', "
                             f"or AMD's 'hybrid-fnuz' / 'e4m3fnuz'")  # fmt: skip
    return FP8_ELEMENTS[fmt][role == "grad_output"]


def _fp8_schemes(fmt: str, role: str, margin: int) -> Scheme:
    scheme = named(get_scheme("fp8").replace(element=_fp8_element(fmt, role)))
    return scheme.replace(margin=margin) if margin else scheme


@dataclass(frozen=True, kw_only=True)
class DelayedScaling(Recipe):
    """TE's FP8 delayed scaling: ``scale = max / amax / 2**margin`` with amax reduced over
    the last `amax_history_len` steps (``"max"``, ``"most_recent"``, ``"percentile"`` (99th) or a
    callable ``history (L,) -> amax``: `minifloat.scaling.history.reduce_amax_window`); scales refresh every `interval` steps; a zero or non-finite
    amax keeps the previous scale."""

    kind: ClassVar[str] = "delayed"
    format: str = "hybrid"
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str | Callable = "max"
    interval: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        _fp8_schemes(self.format, "input", self.margin)  # validates both
        if self.amax_history_len < 1:
            raise MinifloatError(f"amax_history_len must be ≥ 1, got {self.amax_history_len}")
        if self.interval < 1:
            raise MinifloatError(f"interval must be ≥ 1 step, got {self.interval}")
        if not callable(self.amax_compute_algo) and self.amax_compute_algo not in WINDOW_ALGOS:
            raise MinifloatError(
                f"unknown amax_compute_algo {self.amax_compute_algo!r}; use one of {', '.join(WINDOW_ALGOS)} or a callable"
            )

    def _scheme(self, role: str) -> Scheme:
        return _fp8_schemes(self.format, _role(role), self.margin)

    @property
    def delayed(self) -> bool:
        return True


@dataclass(frozen=True, kw_only=True)
class CurrentScaling(Recipe):
    """Per-tensor FP8 with the scale computed from the tensor being quantized."""

    kind: ClassVar[str] = "current"
    format: str = "hybrid"
    margin: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _fp8_schemes(self.format, "input", self.margin)  # validates both

    def _scheme(self, role: str) -> Scheme:
        return _fp8_schemes(self.format, _role(role), self.margin)


@dataclass(frozen=True, kw_only=True)
class Float8BlockScaling(Recipe):
    """DeepSeek-V3 FP8: 1×128 blocks for input and grad_output, 128×128 blocks for weights."""

    kind: ClassVar[str] = "fp8_block"
    format: str = "e4m3"

    def __post_init__(self) -> None:
        super().__post_init__()
        _fp8_schemes(self.format, "input", 0)

    def _scheme(self, role: str) -> Scheme:
        role = _role(role)
        element = _fp8_element(self.format, role)
        return named(get_scheme("fp8_block128x128" if role == "weight" else "fp8_block128").replace(element=element))


@dataclass(frozen=True, kw_only=True)
class MXScaling(Recipe):
    """OCP MX block scaling of every operand: 32 elements per E8M0 scale.

    `element` quantizes input and weight, `grad_element` (default: `element`) grad_output;
    `scale_rule` is ``"floor"`` (OCP MX v1.0 §6.3), ``"rceil"`` (NVIDIA) or ``"least-error"`` (per block
    the floor exponent or the one above, whichever errs less: `Scheme`). The published fixes
    of MXFP4 training, each a switch: `rht` a random Hadamard transform (16 wide, signs from
    `rht_seed`) on both operands of the weight-gradient GEMM, as NVFP4's; `stochastic_rounding`
    of grad_output; `rht_size` the transform's width (16 as NVFP4's, or 32: one MX block);
    `grad_scale_rule` grad_output's E8M0 rule (``"rceil"``: the exponent rounded
    up, so no value is clipped and stochastic rounding stays unbiased — Tseng et al.);
    `forward_rht` the same transform on both operands of the forward GEMM along in_features, as
    Quartet does (Castro et al., arXiv 2505.14669): outliers of the input are spread over their
    group before the round to nearest (the product is unchanged in exact arithmetic);
    `high_precision_first` / `high_precision_last` the model's first / last blocks left in high
    precision (`minifloat.convert` finds the blocks: the model's longest ``nn.ModuleList``)."""

    kind: ClassVar[str] = "mx"
    element: str = "e4m3"
    grad_element: str | None = None
    scale_rule: str = "floor"
    rht: bool = False
    rht_seed: int = 0
    rht_size: int = 16
    forward_rht: bool = False
    stochastic_rounding: bool = False
    grad_scale_rule: str | None = None  # None: scale_rule
    high_precision_first: int = 0
    high_precision_last: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("rht", "forward_rht", "stochastic_rounding"):
            if not isinstance(getattr(self, name), bool):
                raise MinifloatError(f"MXScaling({name}=...) takes True or False, got {getattr(self, name)!r}")
        if self.rht_size not in (16, 32):
            raise MinifloatError(f"MXScaling(rht_size=...) takes 16 or 32 (the Hadamard transform's width), got {self.rht_size!r}")
        for name in ("high_precision_first", "high_precision_last"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise MinifloatError(f"MXScaling({name}=...) takes a whole number of blocks ≥ 0, got {n!r}")
        self.scheme("input"), self.scheme("grad_output")

    def _scheme(self, role: str) -> Scheme:
        grad = _role(role) == "grad_output"
        element = self.grad_element if (grad and self.grad_element) else self.element
        rule = self.grad_scale_rule if (grad and self.grad_scale_rule) else self.scale_rule
        scheme = named(get_scheme("mxfp8").replace(element=element, scale_rule=rule))
        if scheme.name == "custom":
            scheme = scheme.replace(name=f"mx_{element}_{rule}")
        if grad and self.stochastic_rounding:
            scheme = scheme.replace(name=f"{scheme.name}_sr", rounding="stochastic")
        return scheme


@dataclass(frozen=True, kw_only=True)
class NVFP4BlockScaling(Recipe):
    """NVIDIA's NVFP4 training recipe; `rht`, `stochastic_rounding` and `weight_2d` switch
    its three techniques. `rht_seed` fixes the Hadamard transform's random signs.
    `four_over_six` adds Four Over Six block scaling to every operand (arXiv 2512.02010;
    off by default until it measures better here; the CPU kernels do not have it yet, so it
    runs the readable reference)."""

    kind: ClassVar[str] = "nvfp4"
    rht: bool = True
    stochastic_rounding: bool = True
    weight_2d_blocks: bool = True
    rht_seed: int = 0
    four_over_six: bool = False  # per block, scale the amax to 6 or 4, whichever errs less (Scheme.scale_rule)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("rht", "stochastic_rounding", "weight_2d_blocks", "four_over_six"):
            if not isinstance(getattr(self, name), bool):
                raise MinifloatError(f"NVFP4BlockScaling({name}=...) takes True or False, got {getattr(self, name)!r}")
        if isinstance(self.rht_seed, bool) or not isinstance(self.rht_seed, int) or self.rht_seed < 0:
            raise MinifloatError(f"rht_seed must be an integer ≥ 0, got {self.rht_seed!r}")

    def _scheme(self, role: str) -> Scheme:
        role = _role(role)
        if role == "weight":
            scheme = get_scheme("nvfp4_2d" if self.weight_2d_blocks else "nvfp4")
        elif role == "grad_output" and self.stochastic_rounding:
            scheme = get_scheme("nvfp4").replace(name="nvfp4_sr", rounding="stochastic")
        else:
            scheme = get_scheme("nvfp4")
        if self.four_over_six:
            scheme = scheme.replace(name=f"{scheme.name}_4over6", scale_rule="4over6")
        return scheme


def _role(role: str) -> str:
    if role not in ROLES:
        raise MinifloatError(f"unknown operand role {role!r}; use one of {', '.join(ROLES)}")
    return role


RECIPES: dict[str, Recipe] = {
    "fp8": DelayedScaling(),
    "fp8-current": CurrentScaling(),
    "fp8-block": Float8BlockScaling(),
    "fp8-fnuz": DelayedScaling(format="hybrid-fnuz"),  # AMD MI300's FP8: E4M3FNUZ forward, E5M2FNUZ gradients
    "fp8-current-fnuz": CurrentScaling(format="hybrid-fnuz"),
    "mxfp8": MXScaling(element="e4m3"),
    # the E8M0 exponent rounded up (NVIDIA's rule, torchao's default): no block saturates its largest
    # value — what a pretrained model's outliers ask for (docs/benchmarks/finetune-smollm2.md)
    "mxfp8-rceil": MXScaling(element="e4m3", scale_rule="rceil"),
    # E2M3: the best mean Δ val and the smallest spread of the three MXFP6 variants over 3 seeds
    # (600 steps, small GPT: E2M3 -0.42 ± 1.02 %, hybrid -0.15 ± 1.92 %, E3M2 +0.96 ± 1.13 %).
    "mxfp6": MXScaling(element="e2m3"),
    "mxfp6-e2m3": MXScaling(element="e2m3"),
    "mxfp6-e3m2": MXScaling(element="e3m2"),
    "mxfp6-hybrid": MXScaling(element="e2m3", grad_element="e3m2"),  # as FP8's hybrid: precision forward, range for gradients
    # MXFP4 with the published fixes that measured best (docs/guides/training.md: 3 seeds, 600 steps, small GPT):
    # Tseng et al.'s — a random Hadamard transform on the weight-gradient GEMM, stochastic rounding
    # of gradients on rounded-up scales — and the first block left in high precision
    "mxfp4": MXScaling(element="e2m1", rht=True, stochastic_rounding=True, grad_scale_rule="rceil", high_precision_first=1),
    "mxfp4-rtn": MXScaling(element="e2m1"),  # round to nearest everywhere, floor scales: OCP MX as specified
    "mxfp4-tseng": MXScaling(element="e2m1", rht=True, stochastic_rounding=True, grad_scale_rule="rceil"),
    "mxfp4-tseng-rht32": MXScaling(element="e2m1", rht=True, rht_size=32, stochastic_rounding=True, grad_scale_rule="rceil"),
    "mxfp4-rht": MXScaling(element="e2m1", rht=True),
    "mxfp4-sr": MXScaling(element="e2m1", stochastic_rounding=True, grad_scale_rule="rceil"),
    "mxfp4-tseng-fwd": MXScaling(element="e2m1", rht=True, forward_rht=True, stochastic_rounding=True, grad_scale_rule="rceil"),
    "mxfp4-rceil": MXScaling(element="e2m1", scale_rule="rceil", rht=True, stochastic_rounding=True, high_precision_first=1),
    "mxfp4-tseng-least-error": MXScaling(element="e2m1", scale_rule="least-error", rht=True, stochastic_rounding=True, grad_scale_rule="rceil"),
    "nvfp4": NVFP4BlockScaling(),
    "nvfp4-4over6": NVFP4BlockScaling(four_over_six=True),
    # for fine-tuning a pretrained model: 1×16 weight blocks (the backward re-quantizes the weight
    # along out_features) and Four Over Six scales — SmolLM2's loss before any step +14 % → +11.7 %
    # against the pretraining recipe's +21 % (docs/benchmarks/finetune-smollm2.md)
    "nvfp4-1d-4over6": NVFP4BlockScaling(weight_2d_blocks=False, four_over_six=True),
    # `mxfp4` with the forward GEMM's operands rotated too (Quartet): SmolLM2 before any step +29 % (mxfp4 +43 %)
    "mxfp4-fwd": MXScaling(element="e2m1", rht=True, forward_rht=True, stochastic_rounding=True, grad_scale_rule="rceil",
                           high_precision_first=1),  # fmt: skip
}
"""Named recipes (what ``--precision`` accepts besides fp32/bf16/fp16)."""

_KINDS = {cls.kind: cls for cls in (DelayedScaling, CurrentScaling, Float8BlockScaling, MXScaling, NVFP4BlockScaling)}


def get_recipe(recipe: str | Recipe | dict) -> Recipe:
    """A named recipe, a recipe itself, or one rebuilt from `Recipe.to_dict()`.

    Example:
        >>> get_recipe("mxfp4").scheme("weight").name
        'mxfp4'
    """
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, str):
        return lookup(RECIPES, recipe, "recipe")
    if isinstance(recipe, dict):
        d = dict(recipe)
        kind = d.pop("recipe", None)
        if kind not in _KINDS:
            raise MinifloatError(f"not a recipe description (recipe={kind!r}); known kinds: {', '.join(_KINDS)}")
        if any(isinstance(v, str) and v.startswith("<callable") for v in d.values()):
            raise MinifloatError("this recipe used a callable amax_compute_algo; rebuild it in code")
        try:
            return _KINDS[kind](**d)
        except TypeError as err:
            raise MinifloatError(f"not a {kind} recipe description: {err}") from None
    raise MinifloatError(f"expected a recipe name, Recipe or dict, got {type(recipe).__name__}")
