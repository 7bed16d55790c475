"""Adaptive precision: the knapsack against brute force, sensitivity against a single-layer
quantization measured independently, the automatic assignment within its budget."""

import copy
import itertools
import random

import pytest
import torch

import minifloat
from minifloat.adapt import (
    Sensitivity,
    auto_precision,
    choose,
    fill_policy,
    heuristic_policy,
    sensitivity,
    solve,
)
from minifloat.adapt.auto import uniform_bits
from minifloat.infer import evaluate, quantize_model
from minifloat.models.gpt import GPT, GPTConfig


def brute(options, budget):
    best = None
    for picks in itertools.product(*(range(len(g)) for g in options)):
        cost = sum(g[i][0] for g, i in zip(options, picks, strict=True))
        loss = sum(g[i][1] for g, i in zip(options, picks, strict=True))
        if cost <= budget and (best is None or loss < best[0] - 1e-12):
            best = (loss, picks)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_the_knapsack_equals_brute_force_and_keeps_the_budget(seed):
    rng = random.Random(seed)
    options = [[(rng.randint(1, 9), rng.random()) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 6))]
    least = sum(min(c for c, _ in g) for g in options)
    budget = rng.randint(least, least + 15)
    picks = solve(options, budget)
    cost = sum(g[i][0] for g, i in zip(options, picks, strict=True))
    loss = sum(g[i][1] for g, i in zip(options, picks, strict=True))
    assert cost <= budget and loss == pytest.approx(brute(options, budget)[0], abs=1e-12)
    with pytest.raises(minifloat.MinifloatError, match="below the cheapest"):
        solve(options, least - 1)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64)).eval()
    data = [torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    return model, data, sensitivity(model, data, ["fp8-dynamic", "mxfp4", "nvfp4"])


def test_a_layers_sensitivity_equals_its_single_layer_kl(tiny):
    model, data, s = tiny
    assert len(s.layers) == 8 and s.candidates == ["fp8-dynamic", "mxfp4", "nvfp4"]
    for name in ("blocks.0.attn.qkv", "blocks.1.mlp.proj"):
        for c in ("fp8-dynamic", "nvfp4"):
            q = copy.deepcopy(model)
            quantize_model(q, {name: c}, calibration=[b[:, :-1] for b in data], ignore=())
            m = evaluate(q, model, data)
            assert s.kl[name][c] == pytest.approx(m["kl"], rel=1e-3)  # the same KL, float32 sums in another order
    fc = model.get_submodule("blocks.0.mlp.fc")  # FP8 per row: 8 bits + one float32 scale per row of K weights
    assert s.bits["blocks.0.mlp.fc"]["mxfp4"] == 4.25 and s.bits["blocks.0.mlp.fc"]["fp8-dynamic"] == 8 + 32 / fc.in_features
    assert -1 <= s.spearman <= 1 and all(v >= 0 for d in s.estimate.values() for v in d.values())


def test_auto_precision_is_the_best_assignment_within_the_budget(tiny):
    model, data, s = tiny
    budget = 5.5
    chosen = choose(s, budget)
    best = None
    for picks in itertools.product(s.candidates, repeat=len(s.layers)):
        a = dict(zip(s.layers, picks, strict=True))
        bits = sum(s.bits[n][c] * s.params[n] for n, c in a.items()) / sum(s.params.values())
        kl = sum(s.kl[n][c] for n, c in a.items())
        if bits <= budget and (best is None or kl < best - 1e-12):
            best = kl
    assert sum(s.kl[n][c] for n, c in chosen.items()) == pytest.approx(best, abs=1e-12)
    r = auto_precision(model, data, s.candidates, budget, sens=s)
    assert r.average_bits <= budget and r.metrics["kl"] >= 0 and r.assignment == chosen
    with pytest.raises(minifloat.MinifloatError, match="the cheapest candidate takes 4.25 bits"):
        choose(s, 4.0)


def test_the_heuristic_keeps_the_first_and_last_blocks_high():
    layers = [f"blocks.{i}.{p}" for i in range(4) for p in ("attn.qkv", "mlp.fc")]
    h = heuristic_policy(layers)
    assert [h[n] for n in layers] == ["fp8-dynamic"] * 2 + ["nvfp4"] * 4 + ["fp8-dynamic"] * 2


def test_uniform_bits_follow_the_formats_layouts(tiny):
    model, _, s = tiny
    # MXFP4: 4-bit codes + one 8-bit E8M0 scale per 32; NVFP4: + one E4M3 per 16, and per layer two float32
    # global scales (the weight's, and the calibrated input's)
    assert uniform_bits(model, s.layers, "mxfp4") == 4.25
    weights = sum(s.params.values())
    assert uniform_bits(model, s.layers, "nvfp4") == pytest.approx(4.5 + 64 * len(s.layers) / weights, rel=1e-12)
    for n in s.layers:  # each layer alone, by the same layout
        assert s.bits[n]["nvfp4"] == pytest.approx(4.5 + 64 / s.params[n], rel=1e-12)


def test_the_budget_heuristic_fills_from_the_ends_within_the_budget():
    # weights 3, 1, 4, 4 (as qkv, proj, fc, proj); 8 bits high, 4.5 low: 54 bits in all low, 72 allowed at 6 bits
    layers = ["l0", "l1", "l2", "l3"]
    params = dict(zip(layers, (3, 1, 4, 4), strict=True))
    s = Sensitivity(layers, ["hi", "lo"], params, {n: {"hi": 8.0, "lo": 4.5} for n in layers})

    def high_layers(budget, end="both"):
        return sorted(n for n, c in fill_policy(s, budget, "hi", "lo", end).items() if c == "hi")

    high = {end: high_layers(6.0, end) for end in ("first", "last", "both")}
    # first: l0 (+10.5) fits, l1 (+3.5) fits, l2 (+14) and l3 do not; last: l3 (+14), then l1; both walks l0, l3, l1, l2
    assert high == {"first": ["l0", "l1"], "last": ["l1", "l3"], "both": ["l0", "l1"]}
    assert high_layers(7.0) == ["l0", "l1", "l3"] and high_layers(4.5) == []
    with pytest.raises(minifloat.MinifloatError, match="already takes 4.50 bits"):
        fill_policy(s, 4.0, "hi", "lo")
    with pytest.raises(minifloat.MinifloatError, match="end='middle'"):
        fill_policy(s, 6.0, "hi", "lo", "middle")


def test_the_lagrangian_solver_is_feasible_and_its_gap_bounds_the_optimum():
    import itertools
    import random

    from minifloat.adapt.knapsack import lagrangian, solve, solve_bounded

    rng = random.Random(0)
    for trial in range(30):
        options = [[(rng.randint(1, 20), rng.random()) for _ in range(3)] for _ in range(6)]
        budget = rng.randint(sum(min(c for c, _ in g) for g in options), sum(max(c for c, _ in g) for g in options))
        # the oracle: every one of the 3^6 assignments
        best = min(sum(g[i][1] for g, i in zip(options, p, strict=True)) for p in itertools.product(range(3), repeat=6)
                   if sum(g[i][0] for g, i in zip(options, p, strict=True)) <= budget)  # fmt: skip
        lag = lagrangian(options, budget)
        assert lag.cost <= budget and lag.cost == sum(g[i][0] for g, i in zip(options, lag.picks, strict=True))
        assert lag.lower_bound <= best + 1e-12 <= lag.loss + 2e-12, trial  # weak duality; the solution is feasible
        exact = solve(options, budget)
        assert sum(g[i][1] for g, i in zip(options, exact, strict=True)) == pytest.approx(best, abs=1e-12)
    # hundreds of layers at 1/64-bit costs: too large for the exact programme, solved with a small stated gap
    options = [[(64 * 45 * (w := rng.randint(50, 400)), rng.random() * 1e-3), (64 * 85 * w, rng.random() * 1e-5)]
               for _ in range(300)]  # fmt: skip
    budget = sum(g[0][0] for g in options) * 12 // 10
    sol = solve_bounded(options, budget)
    assert sol.method == "lagrangian" and sol.cost <= budget and 0 <= sol.gap <= 0.05 * sol.loss


def test_close_layers_are_those_near_the_knapsacks_margin():
    from minifloat.adapt.auto import close_layers

    layers = [f"l{i}" for i in range(6)]
    params = dict.fromkeys(layers, 100)
    bits = {n: {"hi": 8.0, "lo": 4.0} for n in layers}
    # KL saved per bit by "hi": 1e-5 × 2^i / 400 — the budget buys the three most efficient upgrades
    kl = {n: {"hi": 0.0, "lo": 1e-5 * 2**i} for i, n in enumerate(layers)}
    s = Sensitivity(layers, ["hi", "lo"], params, bits, kl=kl)
    assert minifloat.adapt.choose(s, 6.0) == {n: "hi" if i >= 3 else "lo" for i, n in enumerate(layers)}
    # the margin lies between l2 (left down) and l3 (moved up): 2^2.5 ≈ 5.7; within 1.5×: 4 and 8, within 3×: 2 … 16
    assert close_layers(s, 6.0, factor=1.5) == ["l2", "l3"]
    assert close_layers(s, 6.0, factor=3.0) == ["l1", "l2", "l3", "l4"]
    assert close_layers(s, 6.0, factor=3.0, most=2) == ["l2", "l3"]  # the nearest the margin, in the model's order


def test_measuring_only_the_close_layers(tiny):
    from minifloat.adapt.sensitivity import refine

    model, data, full = tiny
    r = auto_precision(model, data, ["fp8-dynamic", "mxfp4", "nvfp4"], 6.0, measure="close")
    assert r.average_bits <= 6.0 and r.metrics["kl"] >= 0
    s = sensitivity(model, data, ["fp8-dynamic", "mxfp4", "nvfp4"], measure="none")
    assert s.measured == [] and s.kl == s.estimate  # nothing measured: the estimate itself
    refine(s, model, data, ["blocks.0.attn.qkv"])
    assert s.measured == ["blocks.0.attn.qkv"] and s.kl["blocks.0.attn.qkv"] == full.kl["blocks.0.attn.qkv"]
    ratio = sorted(full.kl["blocks.0.attn.qkv"][c] / s.estimate["blocks.0.attn.qkv"][c] for c in s.candidates)[1]
    assert s.kl["blocks.1.mlp.fc"]["mxfp4"] == pytest.approx(s.estimate["blocks.1.mlp.fc"]["mxfp4"] * ratio, rel=1e-12)


def test_gptq_candidates_are_the_uniform_gptq_models_layers(tiny):
    """With method="gptq" every candidate's layers come from the model GPTQ'd whole (the exported
    pipeline without rotation or smoothing: NVFP4's asymmetric calibration kept); the uniform
    policy rebuilt from them is that model, and the auto assignment is scored on those layers."""
    from minifloat.adapt.auto import evaluate_policy
    from minifloat.infer.ptq.config import get_quant_config
    from minifloat.infer.ptq.gptq import GPTQConfig
    from minifloat.infer.ptq.method import PTQMethod

    model, data, _ = tiny
    s = sensitivity(model, data, ["fp8-dynamic", "nvfp4-weight-only"], method="gptq")
    assert s.method == "gptq" and s.to_dict()["method"] == "gptq"
    # each candidate's method named as the report writes it: NVFP4's asymmetric calibration, FP8's plain GPTQ
    assert s.to_dict()["labels"] == {"fp8-dynamic": "gptq", "nvfp4-weight-only": "gptq+asym1"}
    q = copy.deepcopy(model)  # independently: the library's quantize_model with a hand-built plain GPTQ method
    quantize_model(q, "nvfp4-weight-only", calibration=data, method=PTQMethod(method="gptq", gptq=GPTQConfig(asymmetric=1.0)))
    uniform = evaluate_policy(model, {n: "nvfp4-weight-only" for n in s.layers}, data, sens=s)
    assert uniform["kl"] == pytest.approx(evaluate(q, model, data)["kl"], rel=1e-6)
    rtn = sensitivity(model, data, ["nvfp4-weight-only"], method="rtn")
    err = {m: sum(float((x.built[n]["nvfp4-weight-only"].weight.dequantize() - model.get_submodule(n).weight).square().sum())
                  for n in s.layers) for m, x in (("gptq", s), ("rtn", rtn))}  # fmt: skip
    assert err["gptq"] > err["rtn"]  # GPTQ trades weight error for output error: the weights moved more …
    assert s.kl["blocks.0.mlp.fc"]["nvfp4-weight-only"] < rtn.kl["blocks.0.mlp.fc"]["nvfp4-weight-only"]  # … the outputs less
    r = auto_precision(model, data, s.candidates, 6.0, sens=s)
    assert r.average_bits <= 6.0 and r.metrics["kl"] >= 0
    with pytest.raises(minifloat.MinifloatError, match="method='awq'"):
        sensitivity(model, data, ["fp8-dynamic"], method="awq")
    assert get_quant_config("nvfp4-weight-only").activation is None


def test_sensitivity_memory_does_not_grow_with_batches(tmp_path):
    """Peak RSS of `sensitivity` on a 64k vocabulary: 8 batches against 1 (keeping every batch's
    reference logits and each variant's, as it did, cost 1.2 GB more here)."""
    import subprocess
    import sys
    import textwrap

    pytest.importorskip("transformers")
    script = textwrap.dedent("""
        import resource, sys, torch, transformers
        from minifloat.adapt import sensitivity
        n = int(sys.argv[1])
        cfg = transformers.LlamaConfig(vocab_size=65536, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).eval()
        batches = [torch.randint(0, 65536, (4, 65)) for _ in range(n)]
        sensitivity(model, batches[:1], ["fp8-dynamic"], estimate_batches=1)  # warm: the allocator's first arenas
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        s = sensitivity(model, batches, ["fp8-dynamic"], estimate_batches=1)
        assert len(s.measured) == 7, s.measured
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
    """)
    grown = {n: int(subprocess.run([sys.executable, "-c", script, str(n)], capture_output=True, text=True, check=True,
                                   cwd=tmp_path).stdout.split()[-1]) for n in (1, 8)}  # fmt: skip
    assert grown[8] - grown[1] < 150 * 2**20, grown
