"""`KVCache`: the keys and values of the tokens a model has seen, per layer, stored packed.

What a cache is comes as a frozen `KVSpec` (`kvspec`: the formats, the options and their
defaults, the ``FORMAT[+RECENT][@OPTION…]`` text form); how tokens are stored, as packed runs of
one format (`kvstore`); which tokens move or leave as the cache grows, the eviction policy
(`kvpolicy`); and the rotations and RoPE applied on the way in and undone on the way out
(`kvtransforms`). This module holds them together: append, read, roll back, count bytes.

Formats (`KV_FORMATS`): ``fp32`` and ``bf16`` (plain tensors); ``fp8`` (E4M3) and ``fp8_e5m2``
with one FP32 scale per head and token (the row of head_dim values); ``mxfp8``, ``mxfp6``
(E2M3), ``mxfp4`` with E8M0 scales per 32 values of a head's row (scale exponent rounded up, as
the PTQ configs); ``nvfp4`` with E4M3 scales per 16 values and an FP32 scale per appended chunk.
Attention reads the exactly dequantized values, decoded from the packed store at each call and
not kept: `nbytes` counts every tensor the cache holds.

Options for low-bit keys (each measured by ``minifloat bench decode``): ``rotate="k"`` (or
``"kv"``), a Hadamard rotation of the head dimension; ``key_scales="channel"`` (KIVI, Liu et al.
2024), keys scaled per channel over a group of tokens, behind a high-precision ``recent_format``
window; ``pre_rope=True`` (KVQuant, Hooper et al. 2024), keys quantized before the rotary
embedding, which needs the model's own (``rope``, given by the model's adapter).

Example:
    >>> cache = KVCache(n_layer=1, format="fp8")
    >>> k = v = torch.randn(1, 2, 5, 64)
    >>> K, V = cache.update(0, k, v)
    >>> K.shape, cache.length(0), cache.nbytes(), 2 * (2 * 5 * 64 + 2 * 5 * 4)
    (torch.Size([1, 2, 5, 64]), 5, 1360, 1360)
"""

from __future__ import annotations

import torch

from minifloat.errors import MinifloatError
from minifloat.infer.generation.kvpolicy import KVPolicy
from minifloat.infer.generation.kvspec import KV_FORMATS, KVSpec, kv_format, parse_kv_spec
from minifloat.infer.generation.kvstore import ChannelPacked, Packed, Run, from_rows, row_bytes, to_rows
from minifloat.infer.generation.kvtransforms import RowTransforms
from minifloat.scaling.schemes import get_scheme

__all__ = ["KVCache", "KVSpec", "KV_FORMATS", "kv_format", "parse_kv_spec"]


class KVCache(KVPolicy):
    """Per-layer K/V store (see the module docstring), made from a `KVSpec`: ``KVCache(n_layer,
    spec=KVSpec(...))``, or ``KVCache(n_layer, format, **options)`` with the spec's fields as
    keyword arguments. The spec's fields read as the cache's attributes (``cache.format`` …).

    With `budget_bytes` ("FP8 normally, FP4 under memory pressure"), `recent_format` and `drop`,
    tokens move between formats or leave as `kvpolicy` says; each move is an event in `events`,
    and `precisions()` tells each token's format; `position()` keeps counting dropped tokens.
    `scales` (`calibrate_kv`'s): per-tensor FP8 with those calibrated scales (vLLM's k_scale /
    v_scale). `rope`: the model's rotary embedding, for ``pre_rope``.

    What the cache holds is its packed store and nothing else: `update` decodes the layer's
    tokens for the attention that asked (a temporary the caller drops), so `nbytes()` — the
    bytes the budget counts — is every byte of every tensor the cache keeps (`tensors()`)."""

    def __init__(self, n_layer: int, format: str | None = None, *, spec: KVSpec | None = None,
                 scales: dict[int, tuple[float, float]] | None = None, rope=None, **options) -> None:  # fmt: skip
        if n_layer < 1:
            raise MinifloatError(f"n_layer must be ≥ 1, got {n_layer}")
        if spec is not None and (format is not None or options):
            raise MinifloatError("give a KVSpec or the cache's options, not both")
        self.spec = spec if spec is not None else KVSpec(**({"format": format} if format is not None else {}), **options)
        s = self.spec
        if scales is not None and s.format != "fp8":
            raise MinifloatError(f"calibrated KV scales are per-tensor FP8 (vLLM's k_scale / v_scale); format is {s.format!r}")
        if s.recent_format is not None and scales is not None:
            raise MinifloatError("a high-precision recent window goes with dynamic scales, not calibrated ones")
        if (s.rotate or s.key_scales != "token" or s.pre_rope) and scales is not None:
            raise MinifloatError("calibrated per-tensor KV scales take no key rotation, channel scales or pre-RoPE keys")
        if s.pre_rope and rope is None:
            raise MinifloatError("pre_rope=True needs the model's rotary embedding (rope=, which the transformers adapter "
                                 "gives for a model with one of the standard form)")  # fmt: skip
        self.scales = scales  # layer → (K amax, V amax): one FP8 scale per layer and tensor, from calibration
        self.rope = rope
        self.n_layer = n_layer
        self.dropped = 0  # tokens dropped so far (positions keep counting them)
        self._front = [0] * n_layer  # tokens `drop_oldest` dropped from each layer alone (before its held ones)
        self._runs: list[list[Run]] = [[] for _ in range(n_layer)]  # oldest first; neighbours differ in format
        self._shape: tuple[int, int, int] | None = None  # (batch, heads, head_dim)
        self._transforms: RowTransforms | None = None  # made with the shape, at the first update
        self.events: list[dict] = []

    def __getattr__(self, name: str):
        """The spec's fields and properties (``format``, ``store``, ``budget_bytes`` …) as attributes."""
        if name.startswith("__") or name == "spec":
            raise AttributeError(name)
        return getattr(self.spec, name)

    def settings(self) -> dict:
        """The arguments that make an empty cache like this one."""
        return {"spec": self.spec, "scales": self.scales, "rope": self.rope}

    def length(self, layer: int = 0) -> int:
        """Tokens held for `layer`."""
        return sum(run.tokens for run in self._runs[layer])

    def position(self, layer: int = 0) -> int:
        """Tokens seen: those held and those dropped (the next token's position)."""
        return self.length(layer) + self.dropped

    def precisions(self, layer: int = 0) -> list[str]:
        """The format each held token of `layer` is stored in, oldest first."""
        return [run.fmt for run in self._runs[layer] for _ in range(run.tokens)]

    def _check_shape(self, k: torch.Tensor) -> None:
        b, nh, _, hs = k.shape
        if self._shape is None:  # a head_dim that is not a multiple of the blocks: a partial last block
            if self.rotate and hs & (hs - 1):
                raise MinifloatError(f"a Hadamard rotation of the head dimension needs a power of two; head_dim is {hs}")
            self._shape = (b, nh, hs)
            self._transforms = RowTransforms(self.rotate, self.pre_rope, self.rope, b * nh, hs)
        elif self._shape != (b, nh, hs):
            raise MinifloatError(f"the cache holds batch × heads × head_dim {self._shape}; got {(b, nh, hs)}")

    def token_bytes(self, store) -> int:
        """Bytes one token takes in one layer (K and V) in `store`."""
        b, nh, hs = self._shape
        return 2 * b * nh * row_bytes(store, hs)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the T new tokens' `k`, `v` (B, heads, T, head_dim) to `layer`; return every
        token's K and V (B, heads, length, head_dim), as stored (dequantized, float32, built for
        this call: the cache keeps only its packed store)."""
        self._check_shape(k)
        t = k.shape[2]
        if self.budget_bytes is not None and layer == 0:
            self._check_budget(t)  # before anything is stored: every layer has layer 0's sizes
        kr, vr = self._transforms.encode(to_rows(k.detach()), to_rows(v.detach()), self.length(layer) + self._front[layer], t, layer)
        if self.scales is not None:  # the calibrated per-tensor scale; values past its amax saturate
            if layer not in self.scales:
                raise MinifloatError(f"the calibrated KV scales have no entry for layer {layer}")
            ka, va = self.scales[layer]
            per_tensor = get_scheme("fp8")
            run = Run(Packed.pack(kr, per_tensor, ka), Packed.pack(vr, per_tensor, va), t, self.format)
        else:
            entry = self.spec.entry_format
            store = kv_format(entry)
            run = Run(Packed.pack(kr, store), Packed.pack(vr, store), t, entry)
        runs = self._runs[layer]
        if not (runs and runs[-1].extend(run)):
            runs.append(run)
        if self.recent_format is not None:
            self._age(layer)
        if self.budget_bytes is not None:
            self._fit(layer)
        return self.keys_values(layer)

    def keys_values(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every held token's K and V of `layer` (B, heads, length, head_dim), float32, decoded
        from the packed store on the store's device."""
        runs = self._runs[layer]
        if not runs:
            raise MinifloatError(f"layer {layer} of the KV cache holds no tokens yet")
        b, nh, _ = self._shape
        out = []
        for part in ("k", "v"):
            rows = [getattr(run, part).dequantize() for run in runs]
            out.append(rows[0] if len(rows) == 1 else torch.cat(rows))
        k, v = self._transforms.decode(out[0], out[1], self._front[layer], layer)  # a window's first row: position _front
        return from_rows(k, b, nh), from_rows(v, b, nh)

    def expect(self, batch: int, heads: int, head_dim: int) -> None:
        """Fix the shape of the rows before the first update (`least_bytes` needs it)."""
        self._check_shape(torch.empty(batch, heads, 0, head_dim))

    def _demote(self, layer: int, i: int, start: int, a: int, b: int, to: str) -> None:
        """Move tokens [a, b) of run i (which starts at token `start`) to format `to`."""
        run = self._runs[layer][i]
        per = self._shape[0] * self._shape[1]
        before = self.layer_bytes(layer)
        store = kv_format(to)
        keys = run.k.slice(a * per, b * per).dequantize()
        channel = self.key_scales == "channel" and to == self.format
        mid = Run(ChannelPacked.pack(keys, store, per) if channel else Packed.pack(keys, store),
                   Packed.pack(run.v.slice(a * per, b * per).dequantize(), store), b - a, to)  # fmt: skip
        parts = ([run.slice(0, a, per)] if a else []) + [mid] + ([run.slice(b, run.tokens, per)] if b < run.tokens else [])
        self._runs[layer][i : i + 1] = parts
        self._merge(layer)
        self.events.append({"layer": layer, "tokens": [start + a, start + b], "from": run.fmt, "to": to,
                            "layer_bytes_before": before, "layer_bytes_after": self.layer_bytes(layer)})  # fmt: skip

    def _merge(self, layer: int) -> None:
        """Join neighbouring runs of one format (fewer pieces to decode at each step)."""
        merged: list[Run] = []
        for run in self._runs[layer]:
            if not (merged and merged[-1].extend(run)):
                merged.append(run)
        self._runs[layer] = merged

    def _keep(self, layer: int, t0: int, t1: int) -> None:
        """Keep the held tokens outside [t0, t1) of `layer`."""
        per = self._shape[0] * self._shape[1]
        kept, start = [], 0
        for run in self._runs[layer]:
            a, b = max(start, t0) - start, min(start + run.tokens, t1) - start
            if a >= b:
                kept.append(run)
            else:
                if a > 0:
                    kept.append(run.slice(0, a, per))
                if b < run.tokens:
                    kept.append(run.slice(b, run.tokens, per))
            start += run.tokens
        self._runs[layer] = kept
        self._merge(layer)

    def drop_oldest(self, layer: int, n: int) -> None:
        """Drop the `n` oldest held tokens of `layer` alone (a sliding-window layer's tokens that
        no query sees again); the positions of the tokens after them stay theirs."""
        n = min(n, self.length(layer))
        if n > 0:
            self._keep(layer, 0, n)
            self._front[layer] += n

    def truncate(self, n: int, layer: int | None = None) -> None:
        """Keep the first `n` tokens of every layer, or of `layer` alone (a rejected speculation's rollback)."""
        if n < 0:
            raise MinifloatError(f"truncate keeps n ≥ 0 tokens, got {n}")
        if self.dropped:
            raise MinifloatError("a cache that dropped tokens cannot roll back (speculative decoding needs drop=False)")
        for i in range(self.n_layer) if layer is None else (layer,):
            if self.length(i) > n:
                self._keep(i, n, self.length(i))

    def layer_bytes(self, layer: int) -> int:
        return sum(run.nbytes for run in self._runs[layer])

    def nbytes(self) -> int:
        """Bytes the cache holds: codes, scales and tensor scales of every layer."""
        return sum(self.layer_bytes(layer) for layer in range(self.n_layer))

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache holds (what `nbytes` adds up)."""
        return [t for runs in self._runs for run in runs for p in (run.k, run.v) for t in p.tensors()]

    def stored(self, layer: int) -> list[tuple[object, object]]:
        """The packed K and V of `layer`, oldest first: per run of one format a plain tensor or
        a QuantizedTensor (NVFP4: one per appended chunk, each with its own tensor scale)."""
        return [pair for run in self._runs[layer] for pair in zip(run.k.pieces(), run.v.pieces(), strict=True)]
