"""What a KV cache is, as a value: `KVSpec` (frozen, validated once), the formats a cache stores
tokens in (`KV_FORMATS`), and the text form the command line takes (``FORMAT[+RECENT][@OPTION…]``,
`KVSpec.parse`). The defaults of every cache option are written here and nowhere else.

A KV format names an element format and the one way a cache scales it: per head's row of
head_dim values (``fp8``, ``fp8_e5m2``: an FP32 scale per row; ``mxfp8`` / ``mxfp6`` / ``mxfp4``:
E8M0 scales per 32 values, exponent rounded up; ``nvfp4``: E4M3 per 16 and an FP32 scale per
appended chunk) — not a `minifloat.SCHEMES` name (whose ``fp8`` is per tensor).

Example:
    >>> KVSpec.parse("nvfp4+bf16@channel")
    KVSpec(format='nvfp4', budget_bytes=None, pressure_format='nvfp4', sink_tokens=4, recent_tokens=32, recent_format='bf16', drop=False, rotate=None, key_scales='channel', pre_rope=False)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minifloat.errors import MinifloatError
from minifloat.naming import canonical, lookup
from minifloat.scaling.schemes import Scheme, get_scheme


def _schemes() -> dict[str, Scheme | torch.dtype]:
    rceil = {n: get_scheme(s).replace(name=f"kv_{n}", scale_rule="rceil")
             for n, s in (("mxfp8", "mxfp8"), ("mxfp6", "mxfp6_e2m3"), ("mxfp4", "mxfp4"))}  # fmt: skip
    return {
        "fp32": torch.float32,
        "bf16": torch.bfloat16,
        "fp8": get_scheme("fp8_rowwise"),
        "fp8_e5m2": Scheme(name="fp8_e5m2_rowwise", element="e5m2", granularity="row"),
        **rceil,
        "nvfp4": get_scheme("nvfp4"),
    }


KV_FORMATS: dict[str, Scheme | torch.dtype] = _schemes()
"""KV-cache formats by name: a dtype (stored as is) or the scheme each head's row is quantized with."""


def kv_format(name: str) -> Scheme | torch.dtype:
    return lookup(KV_FORMATS, name, "KV-cache format")


def canonical_kv_format(name: str) -> str:
    """`name` as `KV_FORMATS` spells it (an unknown one: an error listing them)."""
    return canonical(KV_FORMATS, name, "KV-cache format")


KV_ROTATIONS = (None, "k", "kv")
KEY_SCALES = ("token", "channel")


@dataclass(frozen=True, kw_only=True)
class KVSpec:
    """A KV cache's options (`minifloat.infer.KVCache`'s docstring says what each does).

    Attributes:
        format: the format tokens are stored in (a `KV_FORMATS` name).
        budget_bytes: the bytes the whole cache may hold; past them the oldest tokens move to
            `pressure_format` (but the `sink_tokens` first and the `recent_tokens` last).
        recent_format: the sinks and the recent window stay in it; tokens move to `format` as they age.
        drop: past the budget even in `pressure_format`, drop the oldest tokens after the sinks.
        rotate: a Hadamard rotation of the head dimension for keys (``"k"``) or both (``"kv"``).
        key_scales: ``"token"`` (a scale per head's row) or ``"channel"`` (KIVI).
        pre_rope: keys stored before the rotary embedding (KVQuant).
    """

    format: str = "bf16"
    budget_bytes: int | None = None
    pressure_format: str = "nvfp4"
    sink_tokens: int = 4
    recent_tokens: int = 32
    recent_format: str | None = None
    drop: bool = False
    rotate: str | None = None
    key_scales: str = "token"
    pre_rope: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "format", canonical_kv_format(self.format))
        object.__setattr__(self, "pressure_format", canonical_kv_format(self.pressure_format))
        if self.recent_format is not None:
            object.__setattr__(self, "recent_format", canonical_kv_format(self.recent_format))
        if self.budget_bytes is not None and self.budget_bytes < 1:
            raise MinifloatError(f"the KV budget must be ≥ 1 byte, got {self.budget_bytes}")
        if self.sink_tokens < 0 or self.recent_tokens < 0:
            raise MinifloatError(f"sink_tokens and recent_tokens must be ≥ 0, got {self.sink_tokens} and {self.recent_tokens}")
        if self.drop and self.budget_bytes is None:
            raise MinifloatError("drop=True drops tokens to keep within a budget: give budget_bytes too")
        if self.rotate not in KV_ROTATIONS:
            raise MinifloatError(f"rotate={self.rotate!r}: use None, 'k' (keys) or 'kv' (keys and values)")
        if self.key_scales not in KEY_SCALES:
            raise MinifloatError(f"key_scales={self.key_scales!r}: use 'token' or 'channel' (KIVI)")
        if self.key_scales == "channel":
            if isinstance(self.store, torch.dtype):
                raise MinifloatError(f"key_scales='channel' quantizes keys; format {self.format!r} stores them as they are")
            if self.recent_format is None or self.budget_bytes is not None:
                raise MinifloatError("key_scales='channel' groups tokens before it quantizes them: it needs a "
                                     "high-precision recent window (recent_format='bf16', KIVI's residual) and no budget")  # fmt: skip
        if self.pre_rope and self.drop:
            raise MinifloatError("pre_rope=True needs a cache that keeps every token's position (drop=False)")

    @property
    def store(self) -> Scheme | torch.dtype:
        """What `format` stores a head's row as: a dtype, or the scheme it is quantized with."""
        return KV_FORMATS[self.format]

    @property
    def pressure(self) -> Scheme | torch.dtype:
        return KV_FORMATS[self.pressure_format]

    @property
    def entry_format(self) -> str:
        """The format new tokens enter in: the recent window's, else `format`."""
        return self.format if self.recent_format is None else self.recent_format

    @property
    def group(self) -> int:
        """Tokens a channel group holds: the format's block width along the tokens (32 for per-row FP8)."""
        return self.store.block[1] if not isinstance(self.store, torch.dtype) and self.store.block else 32

    @classmethod
    def parse(cls, text: str, **fields) -> KVSpec:
        """A spec from ``FORMAT[+RECENT][@OPTION…]`` (`parse_kv_spec`), with `fields` (the rest)."""
        name, options = parse_kv_spec(text)
        return cls(format=name, **{**fields, **options})


KV_SPEC_OPTIONS = {"hadamard": {"rotate": "k"}, "hadamard-kv": {"rotate": "kv"}, "channel": {"key_scales": "channel"},
                   "pre-rope": {"pre_rope": True}}  # fmt: skip


def parse_kv_spec(spec: str) -> tuple[str, dict]:
    """A cache written as ``FORMAT[+RECENT][@OPTION…]`` — e.g. ``nvfp4+bf16@channel@hadamard`` —
    as (format, `KVCache` options): RECENT the sinks' and the last tokens' format, each OPTION one
    of ``hadamard`` (keys rotated), ``hadamard-kv``, ``channel`` (KIVI's per-channel key scales),
    ``pre-rope`` (keys quantized before RoPE).

    Example:
        >>> parse_kv_spec("nvfp4+bf16@channel")
        ('nvfp4', {'recent_format': 'bf16', 'key_scales': 'channel'})
    """
    head, *options = str(spec).strip().split("@")
    name, _, recent = head.partition("+")
    kw: dict = {"recent_format": canonical_kv_format(recent)} if recent else {}
    for o in options:
        if o.strip().lower() not in KV_SPEC_OPTIONS:
            raise MinifloatError(f"unknown KV-cache option {o!r} in {spec!r}; use {', '.join(KV_SPEC_OPTIONS)}")
        kw |= KV_SPEC_OPTIONS[o.strip().lower()]
    return canonical_kv_format(name), kw
