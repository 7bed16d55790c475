"""The cache a model's forward takes, built from its adapter: a `KVCache` itself for a model
that takes a `KVCacheLike` (the built-in GPT), a transformers ``Cache`` storing into one for a
transformers causal LM (`hf_cache`). Either way `kv_of` finds the `KVCache` that holds the
tokens, and `kv_bytes` says what one holds at a given context.

Example:
    >>> from minifloat.models.gpt import GPT, GPTConfig
    >>> gpt = GPT(GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64))
    >>> cache = new_cache(adapter_for(gpt), "fp8")
    >>> # layers × tokens × (K, V) × heads × (32 E4M3 bytes + one FP32 row scale)
    >>> kv_of(cache) is cache, kv_bytes(gpt, 10, "fp8") == 2 * 10 * 2 * 2 * (32 + 4)
    (True, True)
"""

from __future__ import annotations

import dataclasses

import torch

from minifloat.errors import MinifloatError
from minifloat.infer.generation.hf_cache import quantized_cache
from minifloat.infer.generation.kvcache import KVCache, KVSpec
from minifloat.models.adapter import ModelAdapter, adapter_for


def new_cache(adapter: ModelAdapter, format: str | None = None, **kv):
    """An empty cache in `format` that `adapter.forward` takes; `kv` are `KVCache`'s arguments
    (a `KVSpec`'s fields or ``spec=``, ``scales=``, ``rope=``; the model's rotary embedding by
    default where the spec keeps keys before RoPE); ``slack``: tokens a sliding-window layer keeps
    past its window, that a speculative decoder may roll back (transformers models)."""
    slack = kv.pop("slack", 0)
    spec = kv.pop("spec", None) or KVSpec(**({"format": format} if format is not None else {}),
                                          **{k: kv.pop(k) for k in list(kv) if k in _SPEC_FIELDS})  # fmt: skip
    if spec.pre_rope and kv.get("rope") is None:
        kv["rope"] = adapter.rope()
    if adapter.cache_type == "kv":
        return KVCache(adapter.kv_geometry.n_layer, spec=spec, **kv)
    if adapter.cache_type == "transformers":
        return quantized_cache(adapter.model.config, spec=spec, slack=slack, **kv)
    raise MinifloatError(f"a {adapter.kind} model takes a cache of type {adapter.cache_type!r}; "
                         f"minifloat builds 'kv' and 'transformers' caches")  # fmt: skip


_SPEC_FIELDS = {f.name for f in dataclasses.fields(KVSpec)}


def kv_of(cache) -> KVCache:
    """The `KVCache` a cache of either type stores its tokens in."""
    return cache if isinstance(cache, KVCache) else cache.kv


def kv_bytes(model: torch.nn.Module, context_tokens: int, kv_format: str = "fp8", batch_size: int = 1) -> int:
    """Bytes of a `KVCache` in `kv_format` holding `context_tokens` tokens of every layer."""
    g = adapter_for(model).kv_geometry
    kv = KVCache(g.n_layer, kv_format)
    kv.expect(batch_size, g.kv_heads, g.head_dim)
    return g.n_layer * context_tokens * kv.token_bytes(kv.store)
