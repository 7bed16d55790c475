"""The models both halves stand on: minifloat's built-in GPT (`gpt`), the `KVCacheLike` protocol
its attention asks of a cache (`cache`), the adapters that make each kind of model look alike
to inference (`adapter`), the loaders of GPT checkpoints, transformers folders and GGUF files
(`loading`), and the GPT written as transformers' OPT (`opt`)."""

from minifloat.models.adapter import KVGeometry, ModelAdapter, adapter_for, register_adapter
from minifloat.models.cache import KVCacheLike
from minifloat.models.gpt import GPT, GPT_SIZES, GPTConfig, get_config
from minifloat.models.loading import LOADERS, Loader, load_gguf, load_gpt, load_model, register_loader

__all__ = [
    "GPT",
    "GPTConfig",
    "GPT_SIZES",
    "get_config",
    "KVCacheLike",
    "KVGeometry",
    "ModelAdapter",
    "adapter_for",
    "register_adapter",
    "Loader",
    "LOADERS",
    "load_model",
    "load_gpt",
    "load_gguf",
    "register_loader",
]
