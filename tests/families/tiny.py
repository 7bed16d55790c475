"""Tiny random causal LMs of every family users bring, each built from transformers' own config
class and saved as a model folder with a byte-level tokenizer (tests/finetune/tiny.py's)."""

from pathlib import Path

import torch

from tests.finetune.tiny import byte_tokenizer

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3", "phi3", "mistral", "gpt2")
WINDOW = 24  # the sliding window of Mistral and of Gemma 3's local layers: shorter than the tests' contexts


def config(family: str, vocab: int):
    """The family's transformers config: 2 decoder layers, what makes the family itself kept."""
    import transformers

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)  # fmt: skip
    if family == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=True)
    if family == "qwen2":  # q/k/v biases, an untied head
        return transformers.Qwen2Config(**common, tie_word_embeddings=False)
    if family == "qwen3":  # QK-norm
        return transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)
    if family == "mistral":  # every layer a sliding window
        return transformers.MistralConfig(**common, sliding_window=WINDOW)
    if family == "phi3":  # fused qkv_proj and gate_up_proj
        return transformers.Phi3Config(**common, pad_token_id=0)
    if family == "gemma3":  # GeGLU, (1 + w) RMSNorm, QK-norm, one KV head of 32 (256 at scale), local + global layers
        return transformers.Gemma3TextConfig(**{**common, "num_key_value_heads": 1}, head_dim=32, sliding_window=WINDOW,
                                             layer_types=["sliding_attention", "full_attention"],
                                             query_pre_attn_scalar=32, tie_word_embeddings=True)  # fmt: skip
    if family == "gpt2":  # Conv1D layers, LayerNorm with biases, learned positions
        return transformers.GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=1,
                                       eos_token_id=2)  # fmt: skip
    raise ValueError(family)


GGUF_FAMILIES = ("llama", "qwen2", "qwen3", "phi3", "gemma3", "gpt2")  # what transformers' GGUF reader knows


def gguf_config(family: str, vocab: int = 259):
    """`config(family)` with what transformers' GGUF reader assumes where the file has no key for
    it: Qwen3's and Gemma 3's head_dim (128 / 256, their real models'), Gemma 3's every sixth layer
    global (six layers: five local, one global) and its query scale, GPT-2's 1024 positions; Gemma's
    vocabulary one more, for the ``<mask>`` its tokenizer holds. (Mistral:
    llama.cpp writes it as a Llama, without its sliding window.)"""
    cfg = config(family, vocab + (family == "gemma3"))  # Gemma's tokenizer has a <mask> token
    if family == "qwen3":
        cfg.head_dim = 128
    if family == "gemma3":
        cfg = type(cfg)(**{**cfg.to_dict(), "num_hidden_layers": 6, "layer_types": None, "head_dim": 256,
                           "query_pre_attn_scalar": 256})  # fmt: skip
    if family == "gpt2":
        cfg.n_positions = 1024
    return cfg


def random_weights(model: torch.nn.Module, family: str) -> torch.nn.Module:
    """Weights of a trained model's size: N(0, 0.08) matrices, Gemma's (1 + w) norms w around 0."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif family == "gemma3" and p.dim() == 1:  # not the 1 a Llama norm holds
                p.normal_(0, 0.1)
    return model


def tiny_family(folder: Path, family: str, seed: int = 0) -> Path:
    """A random `family` model and its tokenizer in `folder` (weights of a trained model's size)."""
    import transformers

    tokenizer = byte_tokenizer(bos=family in ("llama", "gemma3", "mistral", "phi3"))
    if family.startswith("qwen"):  # Qwen's tokenizer class pads with <|endoftext|>: give it one
        tokenizer.add_special_tokens({"pad_token": "<|endoftext|>"})
    torch.manual_seed(seed)
    model = random_weights(transformers.AutoModelForCausalLM.from_config(config(family, len(tokenizer))), family)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


MOE_FAMILIES = ("mixtral", "qwen3moe", "gptoss")
EXPERTS = 8


def moe_config(family: str, vocab: int):
    """Tiny mixtures of experts (8 experts, top 2), their experts fused 3-D parameters in transformers 5."""
    import transformers

    common = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, bos_token_id=1, eos_token_id=2, num_experts_per_tok=2)  # fmt: skip
    if family == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=64, num_local_experts=EXPERTS)
    if family == "qwen3moe":
        return transformers.Qwen3MoeConfig(**common, head_dim=16, moe_intermediate_size=64, num_experts=EXPERTS,
                                           decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
    if family == "qwen2moe":  # a shared expert (its own width, a sigmoid gate), a dense layer of another width
        return transformers.Qwen2MoeConfig(**common, moe_intermediate_size=64, shared_expert_intermediate_size=96,
                                           intermediate_size=80, num_experts=EXPERTS, decoder_sparse_step=1,
                                           mlp_only_layers=[1], norm_topk_prob=False)  # fmt: skip
    if family == "gptoss":  # experts with biases, gate and up interleaved, a router with a bias
        return transformers.GptOssConfig(**common, head_dim=16, intermediate_size=64, num_local_experts=EXPERTS,
                                         layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW)  # fmt: skip
    raise ValueError(family)


def tiny_moe(folder: Path, family: str, seed: int = 0, never_routed: int | None = None) -> Path:
    """A random MoE `family` model in `folder`; GPT-OSS's expert `never_routed` (if given) a router
    bias no token overcomes."""
    import transformers

    tokenizer = byte_tokenizer(bos=True)
    if family.startswith("qwen"):
        tokenizer.add_special_tokens({"pad_token": "<|endoftext|>"})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(moe_config(family, len(tokenizer)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif "bias" in name:
                p.zero_()
        if never_routed is not None:
            for layer in model.model.layers:
                layer.mlp.router.bias[never_routed] = -1e4
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
