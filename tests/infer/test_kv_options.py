"""Options for low-bit keys: a Hadamard rotation of the head dimension, KIVI's per-channel key
scales, keys quantized before RoPE. In FP32 each leaves attention unchanged; quantized, the
stored values equal the published construction built here from public pieces (`quantize`, an
orthogonal Hadamard matrix, the transposed group)."""

import pytest
import torch

import minifloat
from minifloat.infer import KVCache
from minifloat.infer.generation.cache import new_cache
from minifloat.infer.generation.kvcache import parse_kv_spec
from minifloat.models.adapter import adapter_for
from minifloat.quant import hadamard_matrix, quantize
from tests.reachable import reachable_storage_bytes

transformers = pytest.importorskip("transformers")


def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


@torch.no_grad()
def decode_logits(model, ids, fmt, **kw):
    adapter = adapter_for(model)
    cache = new_cache(adapter, fmt, **kw)
    rows = [adapter.forward(ids[:, :8], cache)[0]]
    for t in range(8, ids.shape[1]):
        rows.append(adapter.forward(ids[:, t : t + 1], cache)[0])
    return torch.cat(rows), cache


IDS = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kw", [dict(rotate="k"), dict(rotate="kv"), dict(pre_rope=True), dict(rotate="k", pre_rope=True)])
def test_each_option_leaves_fp32_attention_unchanged(kw):
    model = llama()
    want, _ = decode_logits(model, IDS, "fp32")
    got, _ = decode_logits(model, IDS, "fp32", **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_pre_rope_keys_leave_sliding_and_two_table_models_unchanged(family):
    """A sliding-window layer holds only its window: its first held key is not position 0, and each
    key gets its own position's RoPE back (Mistral, a window of 8 within 40 tokens); Gemma 3's
    sliding and global layers each take their own table."""
    from tests.families.tiny import config

    cfg = config(family, 256)
    cfg.sliding_window = 8
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3)  # logits that move with a wrong rotation
    want, _ = decode_logits(model, IDS, "fp32")
    got, cache = decode_logits(model, IDS, "fp32", pre_rope=True)
    assert min(cache.kv.length(i) for i in range(cfg.num_hidden_layers)) < 40  # a layer dropped its oldest keys
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_rotation_leaves_the_built_in_gpt_unchanged_and_pre_rope_needs_rope():
    from tests.infer.test_generate import gpt

    model = gpt()
    want, _ = decode_logits(model, IDS, "fp32")
    got, _ = decode_logits(model, IDS, "fp32", rotate="kv")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(minifloat.MinifloatError, match="pre_rope=True needs the model's rotary embedding"):
        decode_logits(model, IDS, "nvfp4", pre_rope=True)


def rows(x):  # (B, heads, T, hs) → (T·B·heads, hs), the cache's token-major rows
    return x.permute(2, 0, 1, 3).reshape(-1, x.shape[-1])


def test_rotated_keys_are_the_quantized_rotation_rotated_back():
    torch.manual_seed(2)
    k, v = torch.randn(1, 2, 6, 64), torch.randn(1, 2, 6, 64)
    k[..., 5] *= 30  # an outlier channel: the rotation spreads it over every block
    cache = KVCache(1, "nvfp4", rotate="k")
    got_k, got_v = cache.update(0, k, v)
    r = hadamard_matrix(64).double()
    assert torch.allclose(r @ r.T, torch.eye(64, dtype=torch.float64), atol=1e-12)  # orthogonal
    want_k = quantize(rows(k) @ r.float(), "nvfp4").dequantize().double() @ r.T
    torch.testing.assert_close(rows(got_k).double(), want_k, rtol=1e-5, atol=1e-5)  # float32 products
    assert torch.equal(rows(got_v), quantize(rows(v), "nvfp4").dequantize())  # values as they were


def test_channel_key_scales_group_tokens_per_channel_as_kivi():
    torch.manual_seed(3)
    cache = KVCache(1, "nvfp4", key_scales="channel", recent_format="bf16", sink_tokens=2, recent_tokens=4)
    ks, vs = [], []
    for _ in range(40):
        k, v = torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64)
        k[..., 7] += 20  # a key outlier channel
        ks.append(k)
        vs.append(v)
        got_k, got_v = cache.update(0, k, v)
    k, v = torch.cat(ks, 2), torch.cat(vs, 2)
    # 2 sinks and the newest tokens in bf16; whole groups of 16 between them in nvfp4
    assert cache.precisions(0) == ["bf16"] * 2 + ["nvfp4"] * 32 + ["bf16"] * 6
    for g in range(2):
        a, b = 2 + 16 * g, 2 + 16 * (g + 1)
        group = k[0, :, a:b]  # (heads, 16 tokens, 64 channels) → one row per (head, channel)
        channels = group.permute(0, 2, 1).reshape(2 * 64, 16)
        want = quantize(channels.bfloat16().float(), "nvfp4").dequantize().reshape(2, 64, 16).permute(0, 2, 1)
        assert torch.equal(got_k[0, :, a:b], want)
        want_v = quantize(rows(v[:, :, a:b]).bfloat16().float(), "nvfp4").dequantize()
        assert torch.equal(rows(got_v[:, :, a:b]), want_v)  # values: per token, as before
    assert torch.equal(got_k[0, :, :2], k[0, :, :2].bfloat16().float())
    assert cache.nbytes() == sum(t.nbytes for t in cache.tensors()) == reachable_storage_bytes(cache)
    cache.truncate(20)  # a rollback into a group: the kept part is a group of its own
    kept = cache.keys_values(0)[0]
    assert cache.length(0) == 20 and torch.equal(kept[0, :, :18], got_k[0, :, :18])  # the sinks, group 0: as they were
    part = got_k[0, :, 18:20].permute(0, 2, 1).reshape(2 * 64, 2)  # group 1's first 2 tokens, per channel
    want = quantize(part, "nvfp4").dequantize().reshape(2, 64, 2).permute(0, 2, 1)  # quantized again as a group of 2
    assert torch.equal(kept[0, :, 18:20], want)


def test_bad_options_are_clear_errors():
    with pytest.raises(minifloat.MinifloatError, match="needs a high-precision recent window"):
        KVCache(1, "nvfp4", key_scales="channel")
    with pytest.raises(minifloat.MinifloatError, match="format 'bf16' stores them as they are"):
        KVCache(1, "bf16", key_scales="channel", recent_format="fp32")
    with pytest.raises(minifloat.MinifloatError, match="needs a power of two; head_dim is 48"):
        KVCache(1, "nvfp4", rotate="k").update(0, torch.randn(1, 1, 2, 48), torch.randn(1, 1, 2, 48))
    with pytest.raises(minifloat.MinifloatError, match="rotate='q'"):
        KVCache(1, "nvfp4", rotate="q")
    with pytest.raises(minifloat.MinifloatError, match="unknown KV-cache option 'kivi'"):
        parse_kv_spec("nvfp4@kivi")
    assert parse_kv_spec("nvfp4+bf16@channel@hadamard@pre-rope") == (
        "nvfp4", {"recent_format": "bf16", "key_scales": "channel", "rotate": "k", "pre_rope": True})  # fmt: skip


def test_bench_decode_measures_each_option():
    from minifloat.measure.bench_decode import kv_quality

    model = llama()
    text = torch.randint(0, 256, (400,), generator=torch.Generator().manual_seed(4))
    specs = ["nvfp4", "nvfp4@hadamard", "nvfp4+bf16@channel", "nvfp4@pre-rope"]
    out = kv_quality(model, text, specs, contexts=(48,), windows=1, source="text", echo=lambda s: None)
    assert [r["format"] for r in out] == specs and all(r["tokens"] == 32 for r in out)  # 48 tokens, 16 prefilled

    @torch.no_grad()
    def next_token_logits(spec):  # the prefill's last row, then each decoded token's: 32 rows
        name, kw = parse_kv_spec(spec)
        adapter = adapter_for(model)
        cache = new_cache(adapter, name, **kw)
        window = text[:48].reshape(1, -1)
        out = [adapter.forward(window[:, :16], cache)[0, -1:]]
        out += [adapter.forward(window[:, t : t + 1], cache)[0, -1:] for t in range(16, 47)]
        return torch.cat(out).double()

    ref = torch.log_softmax(next_token_logits("fp32"), -1)
    for r in out:  # KL(fp32 ‖ cache) per token and top-1 agreement, in float64 here
        q = torch.log_softmax(next_token_logits(r["format"]), -1)
        kl = float((ref.exp() * (ref - q)).sum(-1).mean())
        assert r["kl"] == pytest.approx(kl, rel=1e-3, abs=2e-7), r["format"]  # the bench sums in float32
        assert r["top1"] == float((q.argmax(-1) == ref.argmax(-1)).double().mean()), r["format"]
    assert len({round(r["kl"], 12) for r in out}) == len(out)  # each option changes what attention reads


def test_generate_takes_a_spec_with_options():
    model = llama()
    plain = minifloat.infer.generate(model, IDS[:, :8], 40, kv_cache="fp32")
    g = minifloat.infer.generate(model, IDS[:, :8], 40, kv_cache="nvfp4+bf16@channel@pre-rope", kv_recent_tokens=8)
    assert g.new_tokens == 40 and g.kv_cache == "nvfp4+bf16@channel@pre-rope"
    eager = minifloat.infer.generate(model, IDS[:, :8], 40, kv_cache="nvfp4+bf16@channel@pre-rope", kv_recent_tokens=8,
                                     decode_step="eager")  # fmt: skip
    assert torch.equal(eager.tokens, g.tokens)
    assert eager.kv_bytes < plain.kv_bytes / 3  # most of the 47 held tokens in groups of 16 NVFP4 values
    # the fused cache holds its capacity from the start, its bf16 ring the window and a block not yet aged (24 of 48)
    assert g.decode_step == "fused" and g.kv_bytes < plain.kv_bytes / 2
    with pytest.raises(minifloat.MinifloatError, match="unknown KV-cache option"):
        minifloat.infer.generate(model, IDS[:, :8], 4, kv_cache="nvfp4@rotate")
