"""Adaptive precision at run time: token-based rows against single-config layers on each subset,
the confidence cascade's calibrated agreement on fresh data, the memory policy's budget, memory
fitting against a real KV cache, and layer policies for training's convert."""

import copy
import math

import pytest
import torch

import minifloat
from minifloat.adapt.auto import fit_to_memory
from minifloat.adapt.confidence import (
    binomial_upper,
    calibrate_cascade,
    cascade_predictions,
    confidence,
    evaluate_cascade,
)
from minifloat.adapt.memory import MemoryPolicy, moves
from minifloat.adapt.sensitivity import sensitivity
from minifloat.adapt.token import TokenPolicy, TokenPrecisionLinear, activation_bits, token_precision
from minifloat.infer import QuantizedLinear, quantize_model
from minifloat.infer.generation.cache import kv_bytes
from minifloat.infer.generation.kvcache import KVCache
from minifloat.infer.ptq.config import get_quant_config
from minifloat.infer.quantize import model_bytes
from minifloat.models.gpt import GPT, GPTConfig
from tests.reachable import reachable_storage_bytes


def _gpt(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(**{"block_size": 64, "n_layer": 2, "n_head": 2, "n_embd": 64, **kw})).eval()


# --- token-based precision -------------------------------------------------------------------------


@pytest.mark.parametrize("low", ["mxfp4", "nvfp4"])
def test_token_rows_get_their_format_bit_for_bit(low):
    torch.manual_seed(1)
    lin = torch.nn.Linear(128, 48)
    x = torch.randn(3, 20, 128)
    x[0, 5] *= 30  # outlier rows
    x[2, 11] *= 10
    amax = x.abs().max() if get_quant_config(low).needs_calibration else None
    high_q = QuantizedLinear.from_linear(lin, "fp8-dynamic")
    low_q = QuantizedLinear.from_linear(lin, low, input_amax=amax)
    layer = TokenPrecisionLinear(copy.deepcopy(high_q), copy.deepcopy(low_q), TokenPolicy(outlier_pct=5))
    y = layer(x)
    rows = x.reshape(-1, 128)
    # the top 5 % (3 of 60) rows by amax, found here by sorting
    ranked = sorted(range(60), key=lambda i: -float(rows[i].abs().max()))
    hi = sorted(ranked[:3])
    lo = [i for i in range(60) if i not in hi]
    assert 5 in hi and 2 * 20 + 11 in hi
    y2 = y.reshape(-1, 48)
    assert torch.equal(y2[hi], high_q(rows[hi]))  # each subset: exactly the single-config layer on it
    assert torch.equal(y2[lo], low_q(rows[lo]))
    assert layer.rows == [3, 57]
    # cost: E4M3 codes + one FP32 scale per row; FP4 codes + one 8-bit scale per 32 (MX) or 16 (NVFP4) values
    assert activation_bits(get_quant_config("fp8-dynamic"), 128) == 8 + 32 / 128
    assert activation_bits(get_quant_config(low), 128) == {"mxfp4": 4 + 8 / 32, "nvfp4": 4 + 8 / 16}[low]


def test_token_policy_positions_ids_and_user_mask_route_rows():
    gpt = _gpt()
    ids = torch.randint(0, 250, (2, 16))
    ids[1, 9] = 255
    tp = token_precision(gpt, TokenPolicy(sink_tokens=2, special_ids=(255,)), high="fp8-dynamic", low="mxfp4")
    seen = {}
    qkv = gpt.blocks[0].attn.qkv
    orig = qkv.important
    qkv.important = lambda x2: seen.setdefault("m", orig(x2))
    gpt(ids)
    expect = torch.zeros(2, 16, dtype=torch.bool)
    expect[:, :2] = True
    expect[1, 9] = True
    assert torch.equal(seen["m"].reshape(2, 16), expect)
    tp.reset()
    user = torch.zeros(2, 16, dtype=torch.bool)
    user[0, 7] = True
    with tp.mask(user):
        seen.clear()
        gpt(ids)
    assert torch.equal(seen["m"].reshape(2, 16), expect | user)
    assert tp.high_fraction() == pytest.approx(6 / 32)
    with pytest.raises(minifloat.MinifloatError, match="outlier_pct"):
        TokenPolicy(outlier_pct=120)


def test_all_and_no_token_high_equal_the_uniform_models():
    gpt = _gpt()
    ids = torch.randint(0, 256, (2, 24))
    for pct, config in ((100.0, "fp8-dynamic"), (0.0, "mxfp4")):
        a, b = copy.deepcopy(gpt), copy.deepcopy(gpt)
        token_precision(a, TokenPolicy(outlier_pct=pct), high="fp8-dynamic", low="mxfp4")
        quantize_model(b, config)
        assert torch.equal(a(ids), b(ids))


# --- the confidence cascade ------------------------------------------------------------------------


class Table(torch.nn.Module):
    """A "language model" whose logits depend on the last token only: a table lookup."""

    def __init__(self, table):
        super().__init__()
        self.table = table

    def forward(self, ids):
        return self.table[ids]


def test_binomial_upper_bound_is_clopper_pearson():
    # k = 0: the closed form 1 − δ^(1/n); otherwise the exact binomial CDF at the bound is δ
    assert binomial_upper(0, 200, 0.05) == pytest.approx(1 - 0.05 ** (1 / 200), rel=1e-9)
    for k, n in ((3, 50), (20, 1000)):
        p = binomial_upper(k, n, 0.05)
        cdf = sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))
        assert cdf == pytest.approx(0.05, rel=1e-6) and p > k / n


def test_the_cascade_keeps_its_calibrated_agreement_on_fresh_data():
    g = torch.Generator().manual_seed(0)
    v = 512
    high = torch.randn(v, 32, generator=g) * 3
    low = high + torch.randn(v, 32, generator=g) * 1.5  # the "FP4" model: a noisy copy
    lo_m, hi_m = Table(low), Table(high)
    calib = [torch.randint(0, v, (64, 65), generator=g) for _ in range(4)]
    fresh = [torch.randint(0, v, (64, 65), generator=g) for _ in range(4)]
    for target in (0.9, 0.97):
        c = calibrate_cascade(lo_m, hi_m, calib, target=target)
        r = evaluate_cascade(lo_m, hi_m, fresh, c)
        assert 0.05 < r["low_fraction"] < 1.0  # a real cascade: some tokens each way
        assert r["low_alone_agreement"] < target  # the low model alone misses the target
        assert r["agreement"] >= target - r["margin"]
        assert c.upper_disagreement <= 1 - target and c.calib_agreement >= target
        assert r["relative_cost"] == pytest.approx(0.5 + 1 - r["low_fraction"])
    # the rule itself, by hand
    lo_l, hi_l = low[fresh[0][:, :-1]], high[fresh[0][:, :-1]]
    keep = lo_l.softmax(-1).max(-1).values >= c.threshold
    assert torch.equal(cascade_predictions(lo_l, hi_l, c.threshold), torch.where(keep, lo_l.argmax(-1), hi_l.argmax(-1)))
    p = lo_l.softmax(-1)
    assert torch.allclose(confidence(lo_l, "entropy"), (p * p.log()).sum(-1), atol=1e-5)


# --- memory ------------------------------------------------------------------------------------------


def test_the_memory_policy_never_exceeds_its_budget_and_moves_back_up():
    gpt = _gpt()
    prompt = torch.randint(0, 256, (1, 8))
    probe = MemoryPolicy(copy.deepcopy(gpt), 10**9, low="mxfp4")
    assert probe.usage() == probe.served_bytes(0) == model_bytes(probe.model)  # prediction = the measured bytes
    for budget in (205_000, 195_000, 185_000, 160_000):
        p = MemoryPolicy(copy.deepcopy(gpt), budget, low="mxfp4", headroom_tokens=4, recent_tokens=8)
        # decoded step by step, the memory counted independently of the policy after every forward:
        # every storage reachable from the served model and from its KV cache
        p.new_sequence()
        seq, usage = prompt, []
        for i in range(50):
            logits = p.forward(seq if i == 0 else seq[:, -1:])[0, -1]
            usage.append(reachable_storage_bytes(p.model) + reachable_storage_bytes(p.kv))
            seq = torch.cat((seq, logits.argmax().view(1, 1)), 1)
        assert seq.shape == (1, 58) and torch.equal(seq, p.generate(prompt, 50))
        assert max(usage) <= budget and p.peak_bytes <= budget
        for e in p.events:
            assert e.get("bytes_after", 0) <= budget or e["what"] == "kv"
        if budget < 200_000:
            assert moves(p.events)["weight_down"] >= 1
            assert {e["layer"] for e in p.events if e["what"] == "weight"} <= set(p.order)
        level, ups = p.level, moves(p.events)["weight_up"]
        p.generate(prompt[:, :2], 1)  # a short request: room again
        if 185_000 <= budget < 200_000:
            assert p.level < level and moves(p.events)["weight_up"] - ups == level - p.level
    p = MemoryPolicy(copy.deepcopy(gpt), 160_000, low="mxfp4", recent_tokens=8)
    p.generate(prompt, 50)
    assert moves(p.events)["kv"] >= 1  # under this budget the KV cache moves to FP4 too
    with pytest.raises(minifloat.MinifloatError, match="cannot hold the model's weights even with every layer in mxfp4"):
        MemoryPolicy(copy.deepcopy(gpt), 100_000, low="mxfp4")
    with pytest.raises(minifloat.MinifloatError, match="cannot hold the model with every layer in mxfp4"):
        MemoryPolicy(copy.deepcopy(gpt), 142_000, low="mxfp4").generate(prompt, 40)


def test_fit_to_memory_counts_a_real_kv_cache_and_fits():
    gpt = _gpt()
    data = [torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    s = sensitivity(gpt, data, ["fp8-dynamic", "mxfp4"])
    kv = KVCache(2, "fp8")
    for _ in range(3):
        kv.update(0, torch.randn(1, 2, 16, 32), torch.randn(1, 2, 16, 32))
        kv.update(1, torch.randn(1, 2, 16, 32), torch.randn(1, 2, 16, 32))
    assert kv_bytes(gpt, 48, "fp8") == reachable_storage_bytes(kv)
    for budget in (160_000, 180_000, 400_000):
        fit = fit_to_memory(gpt, budget, context_tokens=48, sens=s)
        q = copy.deepcopy(gpt)
        quantize_model(q, fit.assignment, ignore=())
        assert reachable_storage_bytes(q) + reachable_storage_bytes(kv) <= budget
        assert model_bytes(q) == fit.fixed_bytes + fit.quantized_bytes
    assert set(fit.assignment.values()) == {"fp8-dynamic"}  # room for everything in 8 bits
    with pytest.raises(minifloat.MinifloatError, match="cannot hold the model and its KV cache"):
        fit_to_memory(gpt, 150_000, context_tokens=48, sens=s)


# --- layer policies for training ------------------------------------------------------------------


def test_convert_takes_a_layer_policy_first_match_wins():
    gpt = _gpt()
    minifloat.convert(gpt, {"blocks.0.*": "mxfp8", "*.attn.*": "fp8", "*.mlp.*": "nvfp4", "lm_head": None})
    kinds = {n: m.recipe for n, m in gpt.named_modules() if isinstance(m, minifloat.Linear)}
    assert kinds["blocks.0.mlp.fc"] == minifloat.get_recipe("mxfp8")
    assert kinds["blocks.1.attn.qkv"] == minifloat.get_recipe("fp8") and kinds["blocks.1.mlp.proj"] == minifloat.get_recipe("nvfp4")
    assert "lm_head" not in kinds and type(gpt.lm_head) is torch.nn.Linear
    loss = gpt(torch.randint(0, 256, (2, 16))).float().logsumexp(-1).mean()
    loss.backward()  # it trains
    assert gpt.blocks[1].mlp.fc.weight.grad is not None


def test_a_policy_keeps_a_layer_its_recipe_cannot_take_in_high_precision():
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 12))
    minifloat.convert(model, {"*": "fp8-block"})  # 48: partial 128×128 blocks, taken; 12: below the 16 a GEMM takes
    assert isinstance(model[0], minifloat.Linear) and type(model[2]) is torch.nn.Linear
    minifloat.convert(model, {"0": "fp8", "*": None})
    assert model[0].recipe == minifloat.get_recipe("fp8") and type(model[2]) is torch.nn.Linear


def test_the_memory_policy_serves_a_transformers_llama_within_its_budget():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    llama = transformers.LlamaForCausalLM(cfg).eval()
    prompt = torch.randint(0, 256, (1, 8))
    probe = MemoryPolicy(copy.deepcopy(llama), 10**9, low="mxfp4")
    assert probe._shape == (1, 2, 16)  # GQA: the KV heads, not the query heads
    budget = probe.served_bytes(len(probe.order)) + 2 * 40 * 2 * 2 * 2 * (16 + 4)  # all low + 40 FP8 tokens
    p = MemoryPolicy(copy.deepcopy(llama), budget, low="mxfp4", headroom_tokens=4, recent_tokens=8)
    p.new_sequence()
    seq = prompt
    for i in range(50):
        logits = p.forward(seq if i == 0 else seq[:, -1:])[0, -1]
        # every storage reachable from the served model and its cache (the transformers Cache form)
        assert reachable_storage_bytes(p.model) + reachable_storage_bytes(p.cache) <= budget, i
        seq = torch.cat((seq, logits.argmax().view(1, 1)), 1)
    assert moves(p.events)["weight_down"] >= 1 and moves(p.events)["kv"] >= 1
