"""`KVCacheLike`: what the built-in GPT's attention asks of a KV cache, so that the model needs no
knowledge of how one stores tokens (`minifloat.infer.generation.kvcache.KVCache` packs them in
FP8 / FP4, a test may keep plain tensors).

Invariants a cache keeps: `update` returns every token the cache holds for the layer, the new
ones last, as (B, heads, held, head_dim); `length` counts the tokens held, `position` the tokens
seen (held plus any the cache dropped), which is where the next token's position starts.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class KVCacheLike(Protocol):
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `k`, `v` (B, heads, T, head_dim) to `layer`; return all its held K and V."""
        ...

    def length(self, layer: int = 0) -> int:
        """Tokens `layer` holds."""
        ...

    def position(self, layer: int = 0) -> int:
        """Tokens `layer` has seen, dropped ones included."""
        ...
