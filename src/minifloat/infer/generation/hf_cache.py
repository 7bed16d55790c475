"""The KV cache for transformers models: a ``transformers.Cache`` whose layers are those of one
`KVCache` (packed FP8 / MX / NVFP4, one memory-pressure budget over every layer), handed to the
model as ``past_key_values``. transformers is an optional integration: nothing here imports it
until a cache is built.

Example (with transformers installed)::

    cache = quantized_cache(model.config, "fp8")
    logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
"""

from __future__ import annotations

import functools

from minifloat.errors import MinifloatError
from minifloat.infer.generation.kvcache import KVCache


@functools.cache
def _classes():
    try:
        from transformers.cache_utils import Cache, DynamicLayer
    except ImportError:  # pragma: no cover - an optional integration
        raise MinifloatError("a KV cache for transformers models needs transformers: pip install transformers") from None

    class MinifloatCacheLayer(DynamicLayer):
        """Layer `index` of the cache's one `KVCache`. It keeps no float copy: ``keys`` /
        ``values`` stay empty tensors that tell the model's dtype and device, and each `update`
        returns the layer's K and V decoded for that attention call. A sliding-window layer
        (`window`) holds only the last ``window - 1 + slack`` tokens — what its next queries see,
        and `slack` more that a rejected speculation may roll back to — once past an eighth of a
        window more (dropped together, so a decode step does not copy the held tokens), and
        tells the attention mask where they start, as transformers' own sliding layer does."""

        def __init__(self, cache, index: int, window: int | None = None, slack: int = 0) -> None:
            super().__init__()
            self.cache, self.index, self.window, self.slack = cache, index, window, slack
            self.is_sliding = window is not None
            self.seen = 0  # tokens this layer has been given (its sequence length)

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            k, v = self.cache.kv.update(self.index, key_states, value_states)
            self.seen += key_states.shape[-2]
            if self.window is not None:  # in steps of an eighth of the window: not a copy of the held tokens per step
                keep = self.window - 1 + self.slack
                if self.cache.kv.length(self.index) > keep + max(1, self.window // 8):
                    self.cache.kv.drop_oldest(self.index, self.cache.kv.length(self.index) - keep)
            # the model's dtype is the incoming states' (transformers 5.24 no longer keeps `self.dtype`)
            return k.to(key_states.device, key_states.dtype), v.to(value_states.device, value_states.dtype)

        def get_seq_length(self) -> int:
            return self.seen

        def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
            """(keys the next call attends over, the position of the first): the held tokens and the query's."""
            q = args[0] if args else next(iter(kwargs.values()))
            q = q.shape[0] if hasattr(q, "shape") else int(q)
            held = self.cache.kv.length(self.index)
            return held + q, self.seen - held

        def crop(self, tokens_to_remove: int) -> None:
            """This layer only: transformers' ``Cache.crop`` calls every layer's (a max length, or
            a negative count of tokens to remove from the end)."""
            self.keep(self.seen - abs(tokens_to_remove) if tokens_to_remove < 0 else tokens_to_remove)

        def keep(self, keep: int) -> None:
            """Keep the first `keep` tokens of the sequence (a rejected speculation's rollback)."""
            front = self.seen - self.cache.kv.length(self.index)
            if keep < front:
                raise MinifloatError(f"a sliding-window layer holds tokens from {front} on; rolling back to {keep} needs "
                                     f"the ones it dropped (speculate at most {self.slack} tokens ahead)")  # fmt: skip
            self.cache.kv.truncate(keep - front, self.index)
            self.seen = min(self.seen, keep)

        def reset(self) -> None:
            super().reset()
            self.seen = 0
            if self.index == 0:
                self.cache.kv = KVCache(self.cache.kv.n_layer, **self.cache.kv.settings())

    class MinifloatCache(Cache):
        """A transformers ``Cache`` whose layers are those of one `KVCache` (``.kv``: its budget
        counts every layer, as for the built-in GPT); `nbytes`, `truncate`, `events`,
        `precisions`, `keys_values` and `tensors` are the `KVCache`'s."""

        def __init__(self, n_layer: int, windows=None, slack: int = 0, **kv) -> None:
            self.kv = KVCache(n_layer, **kv)
            windows = windows or [None] * n_layer
            super().__init__(layers=[MinifloatCacheLayer(self, i, windows[i], slack) for i in range(n_layer)])

        @property
        def n_layer(self) -> int:
            return self.kv.n_layer

        def nbytes(self) -> int:
            return self.kv.nbytes()

        def tensors(self) -> list:
            return self.kv.tensors()

        def keys_values(self, layer: int):
            return self.kv.keys_values(layer)

        def length(self, layer: int = 0) -> int:
            """Tokens seen (the sequence length), whatever a sliding-window layer still holds."""
            return self.layers[layer].get_seq_length()

        def truncate(self, n: int) -> None:
            for layer in self.layers:
                layer.keep(n)

        @property
        def events(self) -> list[dict]:
            return self.kv.events

        def precisions(self, layer: int = 0) -> list[str]:
            return self.kv.precisions(layer)

    return MinifloatCache


def sliding_windows(config) -> list[int | None]:
    """Each decoder layer's sliding window (None: it attends to every earlier token), as
    transformers' own cache reads the config (``layer_types``, else ``sliding_window``)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    n = int(text.num_hidden_layers)
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if not window:
        return [None] * n
    if types is None:
        return [int(window)] * n
    return [int(window) if t == "sliding_attention" else None for t in types[:n]]


def quantized_cache(config, format: str | None = None, *, slack: int = 0, **kv):
    """A transformers ``Cache`` for a model with `config` (its decoder layers), storing K and V in
    `format`; `kv` are `KVCache`'s arguments (a `KVSpec`'s fields, ``spec=``, ``scales=``,
    ``rope=``): `budget_bytes` counts the whole cache (each layer keeps to its equal share).
    Sliding-window layers hold their window only (`sliding_windows`), plus `slack` tokens a
    speculative decoder may roll back."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    fmt = {"format": format} if format is not None else {}
    return _classes()(int(text.num_hidden_layers), windows=sliding_windows(config), slack=slack, **fmt, **kv)
