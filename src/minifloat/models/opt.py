"""The built-in GPT as a transformers model: GPT-2's architecture with ``nn.Linear`` layers, written
as an ``OPTForCausalLM`` (pre-norm LayerNorm blocks, exact GELU, learned positions, tied
embeddings; its fused qkv split into q_proj / k_proj / v_proj), whose logits equal the GPT's.
That is the model the serving checkpoints hold: every reader of OPT (transformers, vLLM) can run it.

Example:
    >>> from minifloat.models.gpt import GPT, GPTConfig
    >>> gpt = GPT(GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=64)).eval()
    >>> opt = gpt_to_transformers(gpt)
    >>> ids = torch.randint(0, 256, (1, 8))
    >>> bool((opt(ids).logits - gpt(ids)).abs().max() < 1e-5)
    True
"""

from __future__ import annotations

import torch

from minifloat.models.gpt import GPT, GPTConfig
from minifloat.models.loading import require_transformers


def gpt_to_transformers(gpt: GPT) -> torch.nn.Module:
    """The built-in GPT as a transformers ``OPTForCausalLM`` with the same weights (copies)."""
    transformers = require_transformers()
    c: GPTConfig = gpt.config
    cfg = transformers.OPTConfig(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, num_hidden_layers=c.n_layer, ffn_dim=4 * c.n_embd,
        num_attention_heads=c.n_head, max_position_embeddings=c.block_size, do_layer_norm_before=True,
        word_embed_proj_dim=c.n_embd, activation_function="gelu", dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, layerdrop=0.0, enable_bias=True, layer_norm_elementwise_affine=True,
        tie_word_embeddings=True, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    dtype = gpt.wte.weight.dtype
    opt = transformers.OPTForCausalLM(cfg).to(dtype)
    g, C = {k: v.detach() for k, v in gpt.state_dict().items()}, c.n_embd
    sd = {
        "model.decoder.embed_tokens.weight": g["wte.weight"],
        # OPT's learned positions start at index 2 (its offset for padding); rows 0-1 are never read
        "model.decoder.embed_positions.weight": torch.cat([torch.zeros(2, C, dtype=dtype), g["wpe.weight"]]),
        "model.decoder.final_layer_norm.weight": g["ln_f.weight"],
        "model.decoder.final_layer_norm.bias": g["ln_f.bias"],
    }
    pairs = [("ln1", "self_attn_layer_norm"), ("ln2", "final_layer_norm"), ("attn.proj", "self_attn.out_proj"),
             ("mlp.fc", "fc1"), ("mlp.proj", "fc2")]  # fmt: skip
    for i in range(c.n_layer):
        src, dst = f"blocks.{i}.", f"model.decoder.layers.{i}."
        for a, b in pairs:
            for t in ("weight", "bias"):
                sd[f"{dst}{b}.{t}"] = g[f"{src}{a}.{t}"]
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):  # qkv's rows: q, then k, then v
            for t in ("weight", "bias"):
                sd[f"{dst}self_attn.{name}.{t}"] = g[f"{src}attn.qkv.{t}"][j * C : (j + 1) * C]
    missing, unexpected = opt.load_state_dict(sd, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected, (missing, unexpected)  # lm_head is tied
    opt.tie_weights()
    return opt.eval()
