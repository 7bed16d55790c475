"""Accounting: bytes and bits per weight by the formats' definitions, over an explicit scope."""

import pytest
import torch

from minifloat.infer import QuantizedLinear, bits_per_weight, layer_bytes, quantize_model
from minifloat.infer.modules.accounting import linear_weight_bytes, weight_layers


def _llama(tied: bool):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("tied", [False, True])
def test_bits_per_weight_counts_its_scope(tied):
    model = _llama(tied)
    quantize_model(model, "mxfp4-weight-only")  # the head stays dense (ignore=("lm_head",))
    # the block's Linears: q, o 64×64; k, v 32×64; gate, up 128×64; down 64×128 — MXFP4: 4 + 8/32 bits
    block = 2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64
    assert bits_per_weight(model) == 4.25
    assert sum(m.weight.numel() for m in weight_layers(model).values()) == block
    head = 128 * 64  # the head: dense FP32, or (tied) the embedding table itself
    want_head = (4.25 * block + 32 * head) / (block + head)
    assert bits_per_weight(model, head=True) == pytest.approx(4.25 if tied else want_head, rel=1e-12)
    with_emb = (4.25 * block + 32 * head + (0 if tied else 32 * head)) / (block + head + (0 if tied else head))
    assert bits_per_weight(model, head=True, embedding=True) == pytest.approx(with_emb, rel=1e-12)
    assert linear_weight_bytes(model) == block * 4.25 / 8 + (0 if tied else 4 * head)


def test_layer_bytes_by_the_formats_layouts():
    lin = torch.nn.Linear(64, 32)
    q = QuantizedLinear.from_linear(lin, "nvfp4-weight-only")
    assert layer_bytes(q, bias=False) == 32 * 64 // 2 + 32 * 64 // 16 + 4  # E2M1 codes, E4M3 per 16, FP32 global
    assert layer_bytes(q) == layer_bytes(q, bias=False) + 32 * 4
    assert layer_bytes(lin) == (32 * 64 + 32) * 4
