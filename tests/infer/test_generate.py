"""Decoding with KV caches: cached equals uncached, each format stores what the reference
quantizer gives, speculative greedy equals plain greedy, and the rejection sampler keeps the
target's distribution (a statistical test that can fail)."""

import copy
import dataclasses
import math

import pytest
import torch

import minifloat
from minifloat.infer import KV_FORMATS, KVCache, generate
from minifloat.infer.generation.decoding import probabilities
from minifloat.kernels import reference
from minifloat.models.gpt import GPT, GPTConfig
from tests.conftest import requires_cuda
from tests.reachable import reachable_storage_bytes


def gpt(seed=0, n_embd=128, n_head=2, n_layer=2):
    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=128, n_layer=n_layer, n_head=n_head, n_embd=n_embd)).eval()


def prompt(seed, n=12):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_cached_decoding_equals_the_uncached_logits(fmt):
    model = gpt()
    seq = prompt(1, 40)
    with torch.no_grad():
        full = model(seq)[0]
        cache = KVCache(2, fmt)
        steps = [model(seq[:, :10], cache)[0]]
        for t in range(10, 40):
            steps.append(model(seq[:, t : t + 1], cache)[0])
    cached = torch.cat(steps)
    tol = 1e-5 if fmt == "fp32" else 2e-2  # bf16: K and V rounded to 8 significant bits
    assert torch.allclose(cached, full, rtol=0, atol=tol)
    assert cache.length() == 40 and cache.nbytes() == 2 * 2 * 40 * 128 * (4 if fmt == "fp32" else 2)


@pytest.mark.parametrize("fmt", [f for f in KV_FORMATS if f not in ("fp32", "bf16")])
def test_each_format_stores_what_the_reference_quantizer_gives(fmt):
    cache = KVCache(1, fmt)
    k = torch.randn(2, 4, 7, 64) * torch.exp(torch.randn(2, 4, 7, 64))
    v = torch.randn(2, 4, 7, 64)
    K, V = cache.update(0, k, v)
    (kq, vq), = cache.stored(0)
    scheme = KV_FORMATS[fmt]
    for stored, x, full in ((kq, k, K), (vq, v, V)):
        rows = x.permute(2, 0, 1, 3).reshape(-1, 64)  # token-major rows of one head's values
        data, scale, ts = reference.quantize(rows, scheme)
        assert torch.equal(stored.data, data) and torch.equal(stored.scale.view(torch.uint8), scale.view(torch.uint8))
        assert (ts is None) == (stored.tensor_scale is None) and (ts is None or torch.equal(ts, stored.tensor_scale))
        want = reference.dequantize(data, scale, ts, rows.shape, scheme).reshape(7, 2, 4, 64).permute(1, 2, 0, 3)
        assert torch.equal(full, want)
    bits = scheme.element_format.bits
    per_row = 64 * bits // 8 + {"row": 4}.get(scheme.granularity, 0) + (64 // scheme.block[1] if scheme.granularity == "block" else 0)
    assert cache.nbytes() == 2 * (7 * 2 * 4 * per_row + (4 if scheme.is_nvfp4 else 0))


def test_truncation_keeps_whole_tokens_exactly():
    cache = KVCache(1, "nvfp4")
    k = torch.randn(1, 2, 6, 32)
    K, _ = cache.update(0, k, k)
    K2, _ = cache.update(0, k[:, :, :3], k[:, :, :3])
    cache.truncate(8)
    assert cache.length() == 8 and torch.equal(cache.keys_values(0)[0], K2[:, :, :8])
    (a, _), (b, _) = cache.stored(0)
    assert b.shape == (2 * 2, 32) and torch.equal(b.dequantize().reshape(2, 1, 2, 32).permute(1, 2, 0, 3), K2[:, :, 6:8])


@pytest.mark.parametrize("kv", ["fp32", "fp8"])
@pytest.mark.parametrize("draft", ["nvfp4", "mxfp4"])
def test_speculative_greedy_equals_plain_greedy(kv, draft):
    model = gpt(seed=3)
    for seed in range(3):
        ids = prompt(seed)
        plain = generate(model, ids, 40, kv_cache=kv)
        for k in (1, 3, 5):
            spec = generate(model, ids, 40, kv_cache=kv, draft=draft, draft_tokens=k)
            assert torch.equal(spec.tokens, plain.tokens), (seed, k)
            assert spec.new_tokens == 40 and spec.target_forwards <= 40 and len(spec.accepted_per_position) == k


def test_greedy_with_another_draft_model_still_equals_the_target():
    model, other = gpt(seed=3), gpt(seed=4)  # a draft that disagrees often
    ids = prompt(7)
    spec = generate(model, ids, 30, kv_cache="fp32", draft=other, draft_tokens=3)
    assert torch.equal(spec.tokens, generate(model, ids, 30, kv_cache="fp32").tokens)
    assert spec.mean_accepted < 3


def test_speculative_sampling_keeps_the_target_distribution():
    """The first new token of speculative sampling, over many seeds, against the target's own
    distribution: a chi-square test at significance 1e-3 (fails for a sampler that keeps
    drafts too often, or resamples from p instead of the residual)."""
    model = gpt(seed=5, n_embd=64)
    other = copy.deepcopy(model)  # a draft sharper than the target: q > p on its favourite, so it must be rejected sometimes
    other.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() * 3.0)
    ids = prompt(2, 8)
    with torch.no_grad():
        p = probabilities(model(ids)[0, -1], 1.0, 6, None)
    support = torch.nonzero(p).flatten().tolist()
    counts = dict.fromkeys(support, 0)
    n = 1500
    for s in range(n):
        out = generate(model, ids, 2, kv_cache="fp32", temperature=1.0, top_k=6, seed=s, draft=other, draft_tokens=1)
        counts[int(out.tokens[0, ids.shape[1]])] += 1
    chi2 = sum((counts[t] - n * float(p[t])) ** 2 / (n * float(p[t])) for t in support)
    # 5 degrees of freedom: P(chi2 > 20.52) = 0.001
    assert chi2 < 20.52, (chi2, counts, [round(float(p[t]), 3) for t in support])


def test_sampling_controls():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    p = probabilities(logits, 1.0, None, None)
    assert torch.allclose(p, torch.softmax(logits.double(), 0))
    assert (probabilities(logits, 1.0, 2, None)[2:] == 0).all()
    top_p = probabilities(logits, 1.0, None, 0.7)  # 0.64 + 0.24 reaches 0.7: two tokens
    assert (top_p[2:] == 0).all() and math.isclose(float(top_p.sum()), 1.0)
    model = gpt()
    a = generate(model, prompt(0), 10, temperature=0.8, top_p=0.9, seed=1)
    assert torch.equal(a.tokens, generate(model, prompt(0), 10, temperature=0.8, top_p=0.9, seed=1).tokens)


@pytest.mark.parametrize(
    ("kw", "message"),
    [(dict(kv_cache="fp7"), "unknown KV-cache format 'fp7'"),
     (dict(max_new_tokens=200), "exceeds the model's context of 128 tokens"),
     (dict(kv_cache="fp7", max_new_tokens=200), "unknown KV-cache format 'fp7'"),  # the name's error first
     (dict(kv_cache="fp8@hadamrd", max_new_tokens=200), "unknown KV-cache option 'hadamrd'"),
     (dict(temperature=-1.0), "temperature must be ≥ 0"),
     (dict(draft="int4"), "unknown draft 'int4'")],
)  # fmt: skip
def test_bad_input_is_a_clear_error(kw, message):
    args = dict(max_new_tokens=5) | kw
    with pytest.raises(minifloat.MinifloatError, match=message):
        generate(gpt(), prompt(0), **args)


def test_memory_pressure_moves_old_tokens_to_fp4_within_the_budget():
    model = gpt()  # 2 layers, 2 heads of 64: an FP8 token takes 2·2·(64 + 4) = 272 bytes a layer, NVFP4 2·2·(32 + 4) = 144
    ids = prompt(3, 20)
    budget = 2 * (20 * 272 + 80 * 144 + 600)  # room for 99 tokens only if most move to FP4 (+ its chunks' tensor scales)
    g = generate(model, ids, 80, kv_cache="fp8", kv_budget_bytes=budget, kv_sink_tokens=4, kv_recent_tokens=16)
    assert g.new_tokens == 80 and len(g.kv_precisions) == 99  # the last token is not fed back: nothing lost
    assert g.kv_bytes <= budget and g.kv_events
    cache = KVCache(2, "fp8", budget_bytes=budget, sink_tokens=4, recent_tokens=16)
    fed = []  # layer 0's keys as given, (1, 2, T, 64) each
    for t in range(80):  # the budget is never exceeded: after every token of every layer (20 + 79 = 99 tokens)
        for layer in range(2):
            x = torch.randn(1, 2, 1 if t else 20, 64)
            fed += [x] if layer == 0 else []
            cache.update(layer, x, x)
            held = reachable_storage_bytes(cache)  # counted independently: every storage the cache reaches
            assert held == cache.nbytes() and held <= budget, (t, layer, held)
    assert cache.length(1) == 99 and "nvfp4" in cache.precisions(1)
    p = g.kv_precisions
    assert p[:4] == ["fp8"] * 4 and p[-16:] == ["fp8"] * 16 and "nvfp4" in p[4:-16]
    moved = [t for e in g.kv_events if e["layer"] == 0 for t in range(*e["tokens"])]
    assert sorted(moved) == [i for i, f in enumerate(p) if f == "nvfp4"]  # each token moved once, oldest first
    # the values the cache holds: each token's FP8 values (E4M3, a scale per head's row), and a moved
    # token's those FP8 values quantized again to NVFP4, as one chunk per move (its own tensor scale)
    rows = lambda k: k[0].permute(1, 0, 2).reshape(-1, 64)  # noqa: E731 - (heads, T, 64) → token-major rows
    fp8 = minifloat.quantize(rows(torch.cat(fed, dim=2)), "fp8_rowwise").dequantize().reshape(99, 2, 64)
    held = rows(cache.keys_values(0)[0]).reshape(99, 2, 64)
    kept = [i for i, f in enumerate(cache.precisions(0)) if f == "fp8"]
    assert torch.equal(held[kept], fp8[kept])
    events = [e for e in cache.events if e["layer"] == 0]
    assert events and all(e["from"] == "fp8" and e["to"] == "nvfp4" for e in events)
    for e in events:
        a, b = e["tokens"]
        want = minifloat.quantize(fp8[a:b].reshape(-1, 64), "nvfp4").dequantize().reshape(b - a, 2, 64)
        assert torch.equal(held[a:b], want), (a, b)
    plain = generate(model, ids, 80, kv_cache="fp8")  # without the budget: more than it
    assert plain.kv_bytes > budget


def test_a_budget_too_small_for_even_fp4_is_an_error_before_anything_is_lost():
    cache = KVCache(1, "fp8", budget_bytes=2000, sink_tokens=1, recent_tokens=1)
    k = torch.randn(1, 2, 4, 64)
    cache.update(0, k, k)  # 4 tokens fit (2 in FP8, 2 in NVFP4)
    held = cache.precisions()
    with pytest.raises(minifloat.MinifloatError, match="cannot hold 14 tokens .* nothing was dropped"):
        cache.update(0, torch.randn(1, 2, 10, 64), torch.randn(1, 2, 10, 64))
    assert cache.length() == 4 and cache.precisions() == held and cache.nbytes() <= 2000


def test_dropping_is_explicit_keeps_the_budget_and_the_positions():
    model = gpt()  # 2 layers, 2 heads of 64: an FP32 token takes 2·2·64·4 = 1024 bytes a layer
    seq = prompt(5, 50)
    budget = 2 * 1024 * 24  # 24 tokens; the sequence has 50
    cache = KVCache(2, "fp32", budget_bytes=budget, pressure_format="fp32", sink_tokens=4, recent_tokens=8, drop=True)
    with torch.no_grad():
        model(seq[:, :10], cache)
        for t in range(10, 50):
            model(seq[:, t : t + 1], cache)
            assert cache.nbytes() <= budget
        ref = KVCache(2, "fp32")
        model(seq, ref)
    assert cache.position() == 50 and cache.length() == 50 - cache.dropped and cache.dropped >= 26
    assert all(e["to"] == "dropped" for e in cache.events)
    kept = list(range(4)) + list(range(4 + cache.dropped, 50))  # the sinks, then the newest tokens
    # layer 0's keys depend on the token and its position only: equal to the full run's at the kept positions
    K, K_ref = cache.keys_values(0)[0], ref.keys_values(0)[0]
    assert torch.allclose(K, K_ref[:, :, kept], rtol=0, atol=1e-5)  # GEMM order only
    assert not torch.allclose(K[:, :, 4:], K_ref[:, :, 4 : 50 - cache.dropped], atol=1e-2)
    assert reachable_storage_bytes(cache) == cache.nbytes() <= budget
    with pytest.raises(minifloat.MinifloatError, match="cannot roll back"):
        cache.truncate(10)
    with pytest.raises(minifloat.MinifloatError, match="kv_drop works with plain decoding"):
        generate(model, seq[:, :5], 4, kv_budget_bytes=budget, kv_drop=True, draft="nvfp4")
    g = generate(model, seq[:, :10], 50, kv_cache="fp8", kv_budget_bytes=2 * 272 * 30, kv_recent_tokens=8, kv_drop=True)
    assert g.new_tokens == 50 and g.kv_bytes <= 2 * 272 * 30 and any(e["to"] == "dropped" for e in g.kv_events)


def tiny_llama(seed=0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("fmt", ["fp32", "fp8", "nvfp4"])
def test_a_transformers_llama_decodes_with_the_quantized_cache(fmt):
    from minifloat.infer.generation.hf_cache import quantized_cache

    model = tiny_llama()
    seq = prompt(4, 30)
    cache = quantized_cache(model.config, fmt)
    with torch.no_grad():
        full = model(seq).logits[0]
        steps = [model(input_ids=seq[:, :10], past_key_values=cache, use_cache=True).logits[0]]
        for t in range(10, 30):
            steps.append(model(input_ids=seq[:, t : t + 1], past_key_values=cache, use_cache=True).logits[0])
    cached = torch.cat(steps)
    if fmt == "fp32":
        assert torch.allclose(cached, full, atol=1e-5)
    else:  # K and V as the format stores them: close, not equal
        assert (cached.argmax(-1) == full.argmax(-1)).float().mean() >= 0.8  # a random model: near-flat logits
    (kq, _), *_ = cache.kv.stored(0)
    assert cache.length() == 30 and cache.nbytes() == reachable_storage_bytes(cache)  # no float copy beside the store
    cache.crop(-3)  # transformers' rollback: every layer loses its last 3 tokens, once
    assert [cache.length(i) for i in range(2)] == [27, 27] and cache.get_seq_length() == 27
    if fmt != "fp32":  # 2 KV heads of 32 values: what the reference quantizer gives
        scheme = KV_FORMATS[fmt]
        with torch.no_grad():
            x = model.model.embed_tokens(seq[:, :10])
            x = model.model.layers[0].input_layernorm(x)
            k = model.model.layers[0].self_attn.k_proj(x).view(1, 10, 2, 32).transpose(1, 2)
            cos, sin = model.model.rotary_emb(x, torch.arange(10)[None])
            k = k * cos[:, None] + torch.cat((-k[..., 16:], k[..., :16]), -1) * sin[:, None]
        data, scale, _ = reference.quantize(k.permute(2, 0, 1, 3).reshape(-1, 32), scheme)
        n = data.shape[0]  # the prompt's rows: the first of the run (FP8) or the first chunk (NVFP4)
        assert torch.equal(kq.data[:n], data) and torch.equal(kq.scale[:n].view(torch.uint8), scale.view(torch.uint8))


def test_a_transformers_llama_generates_and_speculates():
    model = tiny_llama(seed=2)
    ids = prompt(5)
    plain = generate(model, ids, 30, kv_cache="fp8")
    spec = generate(model, ids, 30, kv_cache="fp8", draft="nvfp4", draft_tokens=3)
    assert torch.equal(spec.tokens, plain.tokens) and spec.target_forwards < 30
    budget = generate(model, ids, 60, kv_cache="fp8", kv_budget_bytes=15_000, kv_recent_tokens=8)
    assert budget.kv_bytes <= 15_000 and "nvfp4" in budget.kv_precisions  # FP8 throughout: 20,448 bytes


def test_a_calibrated_fp8_cache_for_the_gpt():
    from minifloat.infer import calibrate_kv

    model = gpt()
    scales = calibrate_kv(model, [prompt(s, 40) for s in range(3)])
    g = generate(model, prompt(9, 10), 20, kv_cache="fp8", kv_scales=scales)
    assert g.new_tokens == 20
    cache = KVCache(2, "fp8", scales=scales)
    x = torch.randn(1, 2, 3, 64)
    cache.update(1, x, x)
    (kq, _), = cache.stored(1)
    data, scale, _ = reference.quantize(x.permute(2, 0, 1, 3).reshape(-1, 64), minifloat.get_scheme("fp8"),
                                        amax=torch.tensor(scales[1][0]).reshape(1, 1))  # fmt: skip
    assert torch.equal(kq.data, data) and torch.equal(kq.scale, scale)
    with pytest.raises(minifloat.MinifloatError, match="calibrated KV scales are per-tensor FP8"):
        KVCache(2, "nvfp4", scales=scales)


def test_a_high_precision_recent_window():
    cache = KVCache(1, "fp8", recent_format="bf16", sink_tokens=2, recent_tokens=3)
    k = torch.randn(1, 2, 10, 64)
    for t in range(10):
        cache.update(0, k[:, :, t : t + 1], k[:, :, t : t + 1])
    assert cache.precisions() == ["bf16"] * 2 + ["fp8"] * 5 + ["bf16"] * 3
    K = cache.keys_values(0)[0]
    bf = k.bfloat16().float()
    assert torch.equal(K[:, :, 7:], bf[:, :, 7:]) and torch.equal(K[:, :, :2], bf[:, :, :2])
    rows = bf[:, :, 2:7].permute(2, 0, 1, 3).reshape(-1, 64)  # aged: the bf16 values, quantized to FP8
    want = reference.dequantize(*reference.quantize(rows, KV_FORMATS["fp8"]), rows.shape, KV_FORMATS["fp8"])
    assert torch.equal(K[:, :, 2:7], want.reshape(5, 1, 2, 64).permute(1, 2, 0, 3))
    g = generate(gpt(), prompt(0), 30, kv_cache="fp8", kv_recent_format="bf16", kv_recent_tokens=8)
    assert g.kv_precisions.count("bf16") == 4 + 8


@pytest.mark.slow
def test_a_quantized_cache_holds_less_memory_than_an_fp32_one():
    """The process's own peak memory (VmHWM, reset after a warm-up) over a long decode (1,200 tokens of a random 4-layer Llama,
    8 KV heads of 64; each format in a fresh process): a quantized cache must cost less than an
    FP32 one, as its packed bytes do (before, its FP32 working copy made FP8 cost 2.2× FP32)."""
    import os
    import subprocess
    import sys

    growth, counted = {}, {}
    # glibc's adaptive mmap threshold would make the peak depend on heap fragmentation (±50 % from
    # run to run); a fixed one makes it what the decode allocates, the same in every run
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    for fmt in ("fp32", "fp8", "nvfp4"):
        out = subprocess.run([sys.executable, "-m", "tests.infer.kv_memory_worker", fmt, "1200"], capture_output=True,
                             text=True, timeout=300, check=True, env=env)  # fmt: skip
        growth[fmt], counted[fmt] = map(int, out.stdout.split()[-2:])
    assert counted["fp32"] == 4 * 2 * 8 * 64 * 4 * 1200  # layers × K/V × heads × head_dim × bytes × tokens
    assert growth["fp32"] >= counted["fp32"]  # the store itself, at least
    # measured 0.47× and 0.40× (one layer's K and V decoded for attention weigh more at 4 layers than at 8)
    assert growth["fp8"] <= 0.6 * growth["fp32"] and growth["nvfp4"] <= 0.5 * growth["fp32"], (growth, counted)


@requires_cuda
@pytest.mark.parametrize("config", ["fp8-static", "nvfp4-weight-only"])
def test_a_model_on_a_gpu_runs_from_a_prompt_and_a_calibration_made_on_the_cpu(config):
    """A calibration kept on the CPU serves a model on the GPU, whose logits are the CPU model's —
    to FP32 summation order with the same weight codes (weight-only); with FP8 activations a
    sum in another order can move an activation's code by one E4M3 step (an H200 measured
    ~1 % of the largest logit), so there within 3 % of the logits' norm (a broken path is ~100 %) —
    and a prompt made on the CPU drives its decoding."""
    model = gpt()
    cal = minifloat.infer.calibrate(model, [prompt(s, 64) for s in range(2)])
    cpu, gpu = copy.deepcopy(model), copy.deepcopy(model).cuda()
    for m in (cpu, gpu):
        minifloat.infer.quantize_model(m, config, calibration=cal)
    ids = prompt(3, 64)
    with torch.no_grad():
        want, got = cpu(ids), gpu(ids.cuda()).cpu()
    if config == "fp8-static":
        assert torch.linalg.norm(got - want) <= 0.03 * torch.linalg.norm(want)
    else:
        assert torch.allclose(got, want, rtol=0, atol=1e-4 * want.abs().max().item())
    for kv in ("fp32", "fp8", "nvfp4"):
        g = generate(gpu, prompt(7), 16, kv_cache=kv)
        assert g.tokens.device.type == "cuda" and g.tokens.shape == (1, 7 + 16)
        if config != "fp8-static":  # the same codes: the same greedy tokens
            assert torch.equal(g.tokens.cpu(), generate(cpu, prompt(7), 16, kv_cache=kv).tokens)


def test_the_cache_options_not_given_are_the_spec_s_own_defaults():
    """generate, new_cache and MemoryPolicy leave every option they are not given to KVSpec."""
    from minifloat.infer.generation.cache import new_cache
    from minifloat.infer.generation.kvcache import KVSpec
    from minifloat.models import adapter_for

    cache = new_cache(adapter_for(gpt()), "fp8", budget_bytes=10**6)
    assert cache.spec == KVSpec(format="fp8", budget_bytes=10**6)
    assert (cache.pressure_format, cache.sink_tokens, cache.recent_tokens) == ("nvfp4", 4, 32)  # the documented defaults
    with pytest.raises(dataclasses.FrozenInstanceError):
        cache.spec.sink_tokens = 0
