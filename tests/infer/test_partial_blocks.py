"""Partial blocks. Real models' dimensions are not multiples of the blocks (SmolLM2's 576 and 192
against DeepSeek's 128; 1,536 + 64 …): every block scheme gives the last block a partial size, its
scale grid ceil-divided as DeepSeek-V3's and compressed-tensors' readers expect. PTQ weights, the
training GEMMs' operands and KV-cache rows equal the published formula on the zero-padded tensor
(the NumPy oracle of tests/quant), and exports load bit-exactly in the real readers wherever they
read partial blocks (128×128); where they do not (K across MX / NVFP4 groups) export refuses,
naming the layer."""

import pytest
import torch

import minifloat
from minifloat.infer import (
    QUANT_CONFIGS,
    QuantizedLinear,
    export,
    get_quant_config,
    load_quantized,
    quantize_model,
)
from minifloat.infer.generation.kvcache import KVCache, kv_format
from minifloat.recipes import RECIPES, get_recipe
from tests.quant.test_quantize import oracle

BLOCK_CONFIGS = [n for n, c in QUANT_CONFIGS.items() if c.weight_scheme.granularity == "block"]
K, N, M = 200, 72, 21  # K: partial for 16, 32 and 128; N: a partial 128-row block; M: partial token blocks


def values(x: torch.Tensor, scheme) -> torch.Tensor:
    """The oracle's dequantized values of `x` under `scheme`, as a float32 tensor."""
    return torch.from_numpy(oracle(x.detach().float().numpy(), scheme))


@pytest.mark.parametrize("name", BLOCK_CONFIGS)
def test_ptq_partial_blocks_equal_the_published_formula_on_the_padded_weight(name):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(K, N))
    w = model[0].weight.detach().clone()
    x = torch.randn(M, K) * 3
    summary = quantize_model(model, name, calibration=[x], ignore=())
    assert [s.reason for s in summary.layers] == [None]  # quantized, not kept dense
    layer, c = model[0], get_quant_config(name)
    assert isinstance(layer, QuantizedLinear)
    grid = tuple(-(-d // b) for d, b in zip((N, K), c.weight_scheme.block, strict=True))
    assert tuple(layer.weight.scale.shape) == grid  # ⌈N/br⌉ × ⌈K/bc⌉
    if c.weight_scheme.scale_rule == "4over6":  # the oracle has no Four Over Six: its own tests cover it
        return
    assert torch.equal(layer.weight.dequantize(), values(w, c.weight_scheme))
    if c.activation is not None and not c.static:  # dynamic input scales: the oracle sees the same tensor
        want = values(x, c.activation_scheme) @ values(w, c.weight_scheme).T + layer.bias
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", [n for n in RECIPES if not get_recipe(n).delayed])
def test_training_gemms_with_partial_blocks_equal_the_formula(name):
    torch.manual_seed(1)
    recipe = get_recipe(name)
    layer = minifloat.nn.Linear(K, N, recipe=name)
    x = (torch.randn(M, K) * 2).requires_grad_()
    y = layer(x)
    # the oracle has neither Four Over Six, the "least-error" exponent nor a forward transform: their own tests cover them
    if recipe.scheme("input").scale_rule in ("floor", "rceil") and not getattr(recipe, "forward_rht", False):
        want = (
            values(x, recipe.scheme("input")) @ values(layer.weight, recipe.scheme("weight")).T + layer.bias
        )
        torch.testing.assert_close(y, want.detach(), rtol=1e-5, atol=1e-5)
    go = torch.randn(M, N)
    y.backward(go)
    assert torch.isfinite(x.grad).all() and torch.isfinite(layer.weight.grad).all()
    if name in ("fp8-block", "mxfp8"):  # grad_input = Q(grad_output along N) · Q(W along N)
        w_n = (
            values(layer.weight, recipe.scheme("weight"))
            if recipe.weight_2d
            else values(layer.weight.T, recipe.scheme("weight")).T
        )
        want = values(go, recipe.scheme("grad_output")) @ w_n
        torch.testing.assert_close(x.grad, want.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp6", "mxfp4", "nvfp4"])
def test_kv_cache_partial_blocks_equal_the_reference_quantizer_on_padded_rows(fmt):
    torch.manual_seed(2)
    hs = 40  # 40 = 32 + 8 = 2·16 + 8: a partial last block in every block format
    cache = KVCache(n_layer=1, format=fmt)
    k, v = torch.randn(2, 3, 5, hs), torch.randn(2, 3, 5, hs)
    got_k, got_v = cache.update(0, k, v)
    scheme = kv_format(fmt)
    for got, x in ((got_k, k), (got_v, v)):
        rows = x.permute(2, 0, 1, 3).reshape(-1, hs)  # the cache's rows: token-major, one head's values
        padded = torch.nn.functional.pad(rows, (0, 64 - hs))  # whole blocks: the reference quantizer's case
        want = minifloat.quantize(padded, scheme).dequantize()[:, :hs]
        assert torch.equal(got.permute(2, 0, 1, 3).reshape(-1, hs), want)
    held = sum(t.nbytes for t in cache.tensors())
    chunk_scales = 2 * 4 if scheme.is_nvfp4 else 0  # NVFP4: K's and V's FP32 scale of the appended chunk
    assert cache.nbytes() == held == 5 * cache.token_bytes(scheme) + chunk_scales


transformers = pytest.importorskip("transformers")
IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))


def odd_llama(inter: int):
    """Llama with SmolLM2's awkward shapes, small: hidden 192 (1.5 blocks of 128), 3 query heads
    and 1 KV head of 64 (k/v_proj N = 64), `inter` for down_proj's K."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=192, intermediate_size=inter, num_hidden_layers=2,
                                   num_attention_heads=3, num_key_value_heads=1, head_dim=64, max_position_embeddings=64)  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def test_partial_128x128_blocks_load_bit_exactly_in_transformers(tmp_path):
    pytest.importorskip("compressed_tensors")
    from safetensors.torch import load_file

    from tests.infer.test_export import dequantized_copy, read_with_transformers

    model = odd_llama(inter=328)  # K ∈ {192, 328}, N ∈ {64, 192, 328}: partial blocks both ways
    summary = quantize_model(model, "fp8-block")
    assert len(summary.quantized) == 14
    out = export(model, tmp_path / "ckpt")
    t = load_file(str(out / "model.safetensors"))
    assert t["model.layers.0.mlp.down_proj.weight"].shape == (192, 328)  # the codes are not padded
    assert t["model.layers.0.mlp.down_proj.weight_scale"].shape == (2, 3)  # ⌈192/128⌉ × ⌈328/128⌉
    hf = read_with_transformers(out, "compressed-tensors")
    sd = hf.state_dict()
    for n, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            assert torch.equal(sd[f"{n}.weight"].float(), m.weight.dequantize()), n
    with torch.no_grad():
        assert torch.equal(hf(IDS).logits, dequantized_copy(model)(IDS).logits)
        assert torch.equal(load_quantized(out)(IDS).logits, model(IDS).logits)
    # transformers' fine-grained FP8 loader dequantizes only whole blocks on a CPU: refused, not written
    with pytest.raises(
        minifloat.MinifloatError,
        match=r"'model.layers.0.self_attn.q_proj' \(192×192\) has a partial 128×128 block",
    ):
        export(model, tmp_path / "hf", format="hf-fp8")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("name", ["mxfp8", "mxfp6", "mxfp4-weight-only", "nvfp4-weight-only"])
def test_group_formats_load_bit_exactly_when_k_fills_groups_and_refuse_a_partial_group(name, tmp_path):
    pytest.importorskip("compressed_tensors")
    from tests.infer.test_export import read_with_transformers

    model = odd_llama(inter=320)  # every K a multiple of 32: N (64, 192, 320) needs no blocks
    quantize_model(model, name, calibration=[IDS])
    hf = read_with_transformers(export(model, tmp_path / "ok"), "compressed-tensors")
    sd = hf.state_dict()
    for n, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            mine = m.weight.dequantize()
            if m.weight.scheme.is_nvfp4:  # compressed-tensors rounds code × (scale / global) to bf16
                mine = mine.bfloat16().float()
                assert (sd[f"{n}.weight"].float() == mine).float().mean() > 0.99, n
            else:
                assert torch.equal(sd[f"{n}.weight"].float(), mine), n
    odd = odd_llama(inter=328)  # down_proj's K = 328: a partial group of 8
    quantize_model(odd, name, calibration=[IDS])
    with torch.no_grad():
        assert torch.isfinite(odd(IDS).logits).all()  # minifloat runs it
    with pytest.raises(
        minifloat.MinifloatError,
        match=r"layer 'model.layers.0.mlp.down_proj' in_features=328 is not a multiple",
    ):
        export(odd, tmp_path / "odd")
    assert not (tmp_path / "odd").exists()
    # quantized for that format, the layer stays dense and the summary says why; the rest exports
    odd = odd_llama(inter=328)
    summary = quantize_model(odd, name, calibration=[IDS], export_format="compressed-tensors")
    why = {s.name: s.reason for s in summary.skipped}
    assert set(why) == {"lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"}
    assert "in_features=328 is not a multiple of the" in why["model.layers.1.mlp.down_proj"]
    export(odd, tmp_path / "odd")


def test_generate_with_a_head_dim_the_blocks_do_not_divide():
    from tests.infer.test_generate import gpt, prompt

    model = gpt(n_embd=96, n_head=2)  # head_dim 48: one and a half of MX's 32
    got = minifloat.infer.generate(model, prompt(0), 6, kv_cache="mxfp8")
    # 2 layers × 17 tokens × (K, V) × 2 heads × (48 codes padded to 64 + 2 E8M0 scales)
    assert got.new_tokens == 6 and got.kv_bytes == 2 * 17 * 2 * 2 * (64 + 2)
