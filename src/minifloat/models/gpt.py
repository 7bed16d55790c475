"""A small GPT, readable top to bottom (after nanoGPT): pre-norm blocks of causal
self-attention (``scaled_dot_product_attention``) and a GELU MLP, tied embeddings.

Example:
    >>> model = GPT(GPT_SIZES["tiny"])
    >>> logits = model(torch.zeros(2, 16, dtype=torch.long))
    >>> logits.shape
    torch.Size([2, 16, 256])
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minifloat.errors import MinifloatError
from minifloat.models.cache import KVCacheLike


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128  # longest sequence
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise MinifloatError(f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")


GPT_SIZES = {
    "tiny": GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64),  # tests: ~0.1M parameters
    "small": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=256),  # demo: ~3.3M
    "base": GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384),  # ~10.8M
}


def get_config(size: str) -> GPTConfig:
    if size not in GPT_SIZES:
        raise MinifloatError(f"unknown model size {size!r}; use one of {', '.join(GPT_SIZES)}")
    return GPT_SIZES[size]


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.n_head = c.n_head
        self.qkv = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.proj = nn.Linear(c.n_embd, c.n_embd)

    def forward(self, x: torch.Tensor, cache: KVCacheLike | None = None, layer: int = 0) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # (B, T, C) each
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        else:  # incremental decoding: the cache returns every position's K and V, these T last
            k, v = cache.update(layer, k, v)  # (B, nh, held, hs): the held tokens, these T last
            # query i sees every held key up to its own (a cache may have dropped old ones)
            past = k.shape[2] - T
            mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
            y = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(c.n_embd, 4 * c.n_embd)
        self.proj = nn.Linear(4 * c.n_embd, c.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(c.n_embd), CausalSelfAttention(c)
        self.ln2, self.mlp = nn.LayerNorm(c.n_embd), MLP(c)

    def forward(self, x: torch.Tensor, cache: KVCacheLike | None = None, layer: int = 0) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cache, layer)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied embeddings
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, cache: KVCacheLike | None = None) -> torch.Tensor:
        """Logits (B, T, vocab) of `idx` (B, T). With `cache` (a `KVCacheLike`, such as
        `minifloat.infer.KVCache`), `idx` continues the sequence the cache has seen."""
        B, T = idx.shape
        # positions count every token seen, also those a cache dropped (KVCache(drop=True))
        past = 0 if cache is None else cache.position(0)
        if past + T > self.config.block_size:
            raise MinifloatError(f"sequence of {past + T} tokens exceeds the model's block_size {self.config.block_size}")
        x = self.wte(idx) + self.wpe(torch.arange(past, past + T, device=idx.device))  # (B, T, C)
        for i, block in enumerate(self.blocks):
            x = block(x) if cache is None else block(x, cache, i)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def to_dict(self) -> dict:
        return dataclasses.asdict(self.config)
