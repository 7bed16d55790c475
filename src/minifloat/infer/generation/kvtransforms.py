"""The transforms a `KVCache` applies to key (and value) rows on the way in and undoes on the way
out, so that attention reads what it would without them but the stored rows quantize better:

- a random-sign Hadamard rotation R of the head dimension (``rotate``): rows stored as x·R, read
  as (x·R)·Rᵀ; attention sees q·(Q(kR)Rᵀ)ᵀ = (qR)·Q(kR)ᵀ, so QKᵀ is unchanged before quantization
  and the rotation spreads outlier channels over every block;
- RoPE undone before keys are stored and applied again when they are read (``pre_rope``,
  KVQuant), with the model's own rotary embedding (``rope``: positions → (cos, sin), or one such
  function per layer for a model whose layers have their own tables, as Gemma 3's sliding and
  global layers), at each held row's own position (a sliding-window layer's first held row is
  not position 0).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from minifloat.quant.hadamard import hadamard_matrix


@functools.lru_cache(maxsize=4)
def hadamard(n: int) -> torch.Tensor:
    """The rotation of a head of `n` values, made once per process (every update and read uses it;
    no cache holds it, so `nbytes` stays every byte of the tokens)."""
    return hadamard_matrix(n)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) → (−x2, x1) over the two halves of the last dim: RoPE's pairing of channels."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


@dataclass(frozen=True)
class RowTransforms:
    """The transforms of one cache: `encode` for rows on the way in, `decode` on the way out.
    `per` is the rows a token takes (batch × heads), `head_dim` a row's length."""

    rotate: str | None
    pre_rope: bool
    rope: object  # positions → (cos, sin) (T, head_dim), or a list of those, one per layer; None without pre_rope
    per: int
    head_dim: int

    def _rope_rows(self, start: int, t: int, device: torch.device, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of positions [start, start + t) in `layer`, one row per stored row (token-major)."""
        rope = self.rope[layer] if isinstance(self.rope, (list, tuple)) else self.rope
        cos, sin = rope(torch.arange(start, start + t, device=device))
        return cos.float().repeat_interleave(self.per, 0), sin.float().repeat_interleave(self.per, 0)

    def encode(self, kr: torch.Tensor, vr: torch.Tensor, start: int, t: int, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """New rows of tokens [start, start + t) of `layer` as they are stored: RoPE undone (pre-RoPE keys), then rotated."""
        if self.pre_rope:
            cos, sin = self._rope_rows(start, t, kr.device, layer)
            k = kr.float()
            kr = k * cos - rotate_half(k) * sin  # the inverse rotation: RoPE by −θ
        if self.rotate:
            r = hadamard(self.head_dim).to(kr.device)
            kr = kr.float() @ r
            vr = vr.float() @ r if self.rotate == "kv" else vr
        return kr, vr

    def decode(self, k: torch.Tensor, v: torch.Tensor, start: int = 0, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Every stored row of `layer`, the first at position `start`, as attention reads it:
        rotated back, then RoPE applied again."""
        if self.rotate:
            r = hadamard(self.head_dim).to(k.device)
            k = k @ r.T
            v = v @ r.T if self.rotate == "kv" else v
        if self.pre_rope:
            cos, sin = self._rope_rows(start, k.shape[0] // self.per, k.device, layer)
            k = k * cos + rotate_half(k) * sin
        return k, v
