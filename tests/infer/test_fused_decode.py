"""The fused decode step (one C call per step, minifloat.infer.generation.fused) against the
oracle it replaces: transformers' own forward of the same model (float32 weights), and the eager
path over the same packed weights (weight-only configs). Tiny random models of each family it
runs: Llama (with biases), Qwen2 (q/k/v biases), Qwen3 (QK-norm), Mistral (a sliding window),
Phi-3, Gemma 2 and 3, Mixtral, Qwen3-MoE and GPT-OSS, GPT-2, OPT and the built-in GPT."""

from __future__ import annotations

import itertools

import pytest
import torch

from minifloat.errors import MinifloatError
from minifloat.infer import generate, quantize_model
from minifloat.infer.generation.fused import FusedDecoder, unsupported
from minifloat.infer.generation.kvspec import KVSpec
from minifloat.kernels import gemv
from minifloat.models.gpt import GPT, GPTConfig

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not gemv.isas(), reason="the compiled kernels are not built")

VOCAB = 96


def tiny(family: str, seed: int = 0, heads: int = 4, kv_heads: int = 2, hidden: int = 64):
    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=96, num_hidden_layers=3, num_attention_heads=heads,
              num_key_value_heads=kv_heads, max_position_embeddings=128)  # fmt: skip
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "mistral": transformers.MistralConfig}[family]  # fmt: skip
    if family == "llama":
        kw.update(attention_bias=True, mlp_bias=True)
    if family == "mistral":
        kw.update(sliding_window=6)
    model = transformers.AutoModelForCausalLM.from_config(cls(**kw)).eval()
    with torch.no_grad():  # norms away from 1 and biases away from 0: a missed one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if name.endswith("weight") else 0.0))
    return model


def bound(ref: torch.Tensor) -> float:
    """float32 summation-order differences over a few layers: a few ulps of the largest logit."""
    return 1e-5 * float(ref.abs().max()) + 1e-6


def prefill_then_steps(dec, ids, cache, prompt: int) -> torch.Tensor:
    """The logits of every row of `ids`: its first `prompt` tokens in one call, then one step per token."""
    rows = [dec.forward(ids[:, :prompt], cache, last=prompt)]
    rows += [dec.forward(ids[:, t : t + 1], cache) for t in range(prompt, ids.shape[1])]
    return torch.cat(rows)


def fused_matches(model, n: int, prompt: int, kvs: tuple[str, ...], new: int = 30):
    """The fused step's logits of n random tokens (`prompt` of them in one call, then one step per
    token) are the model's own forward's, and its greedy tokens eager's for each cache in `kvs`;
    returns the decoder."""
    assert unsupported(model) is None
    ids = torch.randint(0, VOCAB, (1, n))
    dec = FusedDecoder(model)
    got = prefill_then_steps(dec, ids, dec.new_cache("fp32", n), prompt)
    with torch.no_grad():
        ref = model(ids).logits[0]
    assert (got - ref).abs().max() <= bound(ref)
    for kv in kvs:
        fused = generate(model, ids[:, :5], new, kv_cache=kv)
        assert fused.decode_step == "fused"
        assert torch.equal(fused.tokens, generate(model, ids[:, :5], new, kv_cache=kv, decode_step="eager").tokens)
    return dec


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_fused_logits_equal_transformers_forward(family):
    """Prefill in chunks (40 tokens: more than the 16 rows of one call), then single steps: every
    row's logits are those of transformers' forward over the whole sequence."""
    model = tiny(family)
    assert unsupported(model) is None
    ids = torch.randint(0, VOCAB, (1, 44))
    dec = FusedDecoder(model)
    cache = dec.new_cache("fp32", capacity=64)
    parts = [dec.forward(ids[:, :40], cache, last=40)]
    parts += [dec.forward(ids[:, t : t + 1], cache, last=1) for t in range(40, 44)]
    got = torch.cat(parts)
    with torch.no_grad():
        ref = model(ids).logits[0]
    assert cache.length() == 44
    assert (got - ref).abs().max() <= bound(ref)


def test_the_last_rows_only_and_a_full_cache():
    model = tiny("llama")
    dec = FusedDecoder(model)
    ids = torch.randint(0, VOCAB, (1, 20))
    with torch.no_grad():
        ref = model(ids).logits[0]
    cache = dec.new_cache("fp32", capacity=20)
    got = dec.forward(ids, cache, last=3)
    assert got.shape == (3, VOCAB) and (got - ref[-3:]).abs().max() <= bound(ref)
    with pytest.raises(MinifloatError, match="holds 20 positions"):
        dec.forward(ids[:, :1], cache)
    cache.truncate(17)  # a rejected draft's positions are written again
    again = dec.forward(ids[:, 17:], cache, last=3)
    assert torch.equal(again, got)


def test_a_bf16_cache_rounds_as_torch_does():
    """The bfloat16 cache holds torch's round-to-nearest-even of the float32 cache's keys and values."""
    model = tiny("qwen2")
    dec = FusedDecoder(model)
    ids = torch.randint(0, VOCAB, (1, 24))
    c32, c16 = dec.new_cache("fp32", 32), dec.new_cache("bf16", 32)
    dec.forward(ids[:, :1], c32), dec.forward(ids[:, :1], c16)  # layer 0's first keys: the same inputs in both
    assert torch.equal(c16.held["k"][0, :, :1], c32.held["k"][0, :, :1].to(torch.bfloat16))
    assert torch.equal(c16.held["v"][0, :, :1], c32.held["v"][0, :, :1].to(torch.bfloat16))


@pytest.mark.parametrize("kv", ["fp32", "bf16"])
@pytest.mark.parametrize("config", [None, "nvfp4-weight-only", "mxfp4-weight-only", "fp8-weight-only"])
def test_greedy_tokens_equal_the_eager_path(kv, config):
    model = tiny("llama", seed=1)
    if config:
        quantize_model(model, config, quantize_head=True)
    ids = torch.randint(0, VOCAB, (1, 12))
    fused = generate(model, ids, 24, kv_cache=kv, decode_step="fused")
    eager = generate(model, ids, 24, kv_cache=kv, decode_step="eager")
    assert (fused.decode_step, eager.decode_step) == ("fused", "eager")
    assert torch.equal(fused.tokens, eager.tokens)
    assert fused.decode_tokens_per_s > 0 and 0 < fused.prefill_seconds < fused.seconds


def test_packed_weights_are_read_in_place_by_every_isa_path(monkeypatch):
    model = tiny("qwen3", seed=2)
    quantize_model(model, "nvfp4-weight-only", quantize_head=True)
    ids = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        ref = model(ids).logits[0]  # the eager path: the same kernels, layer by layer
    for isa in gemv.isas():
        monkeypatch.setenv("MINIFLOAT_GEMV_ISA", isa)
        dec = FusedDecoder(model)
        got = dec.forward(ids, dec.new_cache("fp32", 16), last=9)
        assert (got - ref).abs().max() <= bound(ref), isa


def test_speculative_decoding_on_the_fused_step_equals_plain_greedy():
    model = tiny("mistral", seed=3)
    ids = torch.randint(0, VOCAB, (1, 10))
    plain = generate(model, ids, 30, kv_cache="fp32", decode_step="eager")
    spec = generate(model, ids, 30, kv_cache="fp32", draft="nvfp4", draft_tokens=3)
    assert spec.decode_step == "fused" and torch.equal(spec.tokens, plain.tokens)


def test_nan_stays_nan():
    model = tiny("llama")
    with torch.no_grad():
        model.model.embed_tokens.weight[5, 0] = float("nan")
    dec = FusedDecoder(model)
    logits = dec.forward(torch.tensor([[3, 5]]), dec.new_cache("fp32", 8), last=2)
    assert torch.isfinite(logits[0]).all() and torch.isnan(logits[1]).all()


def test_what_it_does_not_run_is_said_and_runs_eagerly(monkeypatch):
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2)).eval()
    ids = torch.randint(0, VOCAB, (1, 4))
    with pytest.raises(MinifloatError, match="cannot run this model: its layers are transformers' Conv1D"):
        generate(gpt2, ids, 2, decode_step="fused")
    assert generate(gpt2, ids, 2).decode_step == "eager"
    relu = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2,
                                                                activation_function="relu"))  # fmt: skip
    assert "activation 'relu'" in unsupported(relu)
    gpt = GPT(GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32, vocab_size=VOCAB))
    with pytest.raises(MinifloatError, match="with these options runs eagerly"):  # StreamingLLM's dropping
        generate(gpt, ids, 2, kv_cache="fp8", kv_budget_bytes=10**6, kv_drop=True, decode_step="fused")
    model = tiny("llama")
    with pytest.raises(MinifloatError, match="rotated keys that are also pre-RoPE or channel-scaled run eagerly"):
        generate(model, ids, 2, kv_cache="nvfp4+bf16@channel@hadamard", decode_step="fused")
    assert generate(model, ids, 2, kv_cache="fp8_e5m2").decode_step == "eager"
    assert generate(model, ids, 2, kv_cache="nvfp4", kv_budget_bytes=10**6).decode_step == "eager"
    with pytest.raises(MinifloatError, match="head_dim 16 is not whole mxfp4 blocks of 32"):
        FusedDecoder(model).new_cache("mxfp4", 8)
    assert generate(model, ids, 2, kv_cache="mxfp4").decode_step == "eager"
    with pytest.raises(MinifloatError, match="decode_step must be one of auto, fused, eager"):
        generate(model, ids, 2, decode_step="compiled")
    monkeypatch.setenv("MINIFLOAT_DECODE", "eager")
    assert generate(model, ids, 2).decode_step == "eager"
    monkeypatch.delenv("MINIFLOAT_DECODE")
    handle = model.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    assert "forward hooks" in unsupported(model)
    handle.remove()
    w8a8 = tiny("llama")
    quantize_model(w8a8, "fp8-dynamic", quantize_head=False)
    assert "quantizes its input (fp8-dynamic)" in unsupported(w8a8)


def test_bench_decode_times_both_steps_and_profiles_them(tmp_path, capsys):
    import json

    from minifloat.cli import main
    from tests.infer.test_gguf_and_bad_inputs import write_tiny_gguf

    write_tiny_gguf(tmp_path / "tiny.gguf")
    assert main(["bench", "decode", str(tmp_path / "tiny.gguf"), "--kv-formats", "", "--drafts", "", "--gemv", "",
                 "--windows", "1", "--new-tokens", "6", "--weights", "fp32,nvfp4-weight-only", "--reps", "1",
                 "--decode-steps", "fused,eager", "--profile", "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    runs = [(r["config"], r["decode_step"]) for r in out["weights"]["runs"]]
    assert runs == [("fp32", "fused"), ("fp32", "eager"), ("nvfp4-weight-only", "fused"), ("nvfp4-weight-only", "eager")]
    assert all(r["tokens_per_s"] > 0 for r in out["weights"]["runs"])
    prof = out["profile"]
    assert [(r["config"], r["decode_step"]) for r in prof] == runs
    for r in prof:
        assert set(r["ms"]) == {"gemv", "attention", "norms_rope_activations", "python_dispatch"}
        assert r["ms"]["gemv"] > 0 and r["ms"]["attention"] > 0
        assert sum(r["ms"].values()) == pytest.approx(r["ms_per_token"], rel=1e-9)  # the kinds add up to the wall time
    verify = out["weights"]["verify"]  # --verify-rows' default: 1, 2, 4, 8, 16 rows in one forward per run
    assert [(r["of"], r["rows"]) for r in verify] == [(f"{c} {s}", m) for c, s in runs for m in (1, 2, 4, 8, 16)]
    for r in verify:
        one = next(o for o in verify if o["of"] == r["of"] and o["rows"] == 1)
        assert r["ms"] > 0 and r["vs_one_row"] == pytest.approx(r["ms"] / one["ms"])
    # float32's floor: M rows × a token's multiply-adds, counted from the config (q, o: H × H; k, v: H × H / 2 with
    # GQA 4 / 2; gate, up, down: H × INTER; the untied head: VOCAB × H), at the measured float32 rate
    from tests.gguf_writer import VOCAB
    from tests.infer.test_gguf_and_bad_inputs import INTER, LAYERS, H

    macs = LAYERS * (3 * H * H + 3 * H * INTER) + VOCAB * H
    rate = out["weights"]["multiply_add_rate"]
    assert rate > 1e8
    for r in verify:
        one = next(o for o in verify if o["of"] == r["of"] and o["rows"] == 1)
        assert r["float32_floor_ms"] == pytest.approx(1e3 * r["rows"] * macs / rate)
        most = r["float32_rows_within_1_5x"]  # the most rows whose floor fits in 1.5 × one row's time
        assert most * macs / rate <= 1.5e-3 * one["ms"] < (most + 1) * macs / rate or most == 4096
        if r["rows"] > 1 and r["ms"] > one["ms"]:  # the rows past the first: their floor over the time they added
            assert r["added_rows_at_peak"] == pytest.approx((r["rows"] - 1) * macs / rate / (1e-3 * (r["ms"] - one["ms"])))
    from minifloat.measure.bench_decode import float32_rows_within

    assert float32_rows_within(3.3e-3, 134_500_000, 258e9) == 9  # SmolLM2's FP4 row: 4.95 ms hold 9.5 rows' 0.52 ms
    assert main(["bench", "decode", str(tmp_path / "tiny.gguf"), "--decode-steps", "compiled"]) == 2
    assert "--decode-steps 'compiled': use some of auto, fused, eager" in capsys.readouterr().err
    for bad, says in [("0,2", "--verify-rows takes comma-separated positive integers"),
                      ("4096", "--verify-rows 4096: a 16-token prompt and 4096 rows pass the model's context")]:  # fmt: skip
        assert main(["bench", "decode", str(tmp_path / "tiny.gguf"), "--verify-rows", bad]) == 2
        assert says in capsys.readouterr().err


@pytest.mark.parametrize("heads", [(4, 2), (2, 1)])  # head_dim 16, and 32 (AVX-512's attention in registers)
@pytest.mark.parametrize("config", [None, "nvfp4-weight-only", "mxfp4-weight-only", "fp8-weight-only"])
def test_rows_verified_together_equal_single_steps_bit_for_bit(monkeypatch, config, heads):
    """Every row is summed as it would be alone (kernels, attention, norms), so a speculative
    verification of k + 1 rows gives exactly the logits of k + 1 single steps: its greedy
    tokens are plain greedy's, not only up to rounding."""
    model = tiny("llama", seed=4, heads=heads[0], kv_heads=heads[1])
    if config:
        quantize_model(model, config, quantize_head=True)
    ids = torch.randint(0, VOCAB, (1, 14))
    for isa, n in itertools.product(gemv.isas(), (9, 7, 6)):  # rows of x by 4: the last tile 1, 3 or 2 rows
        monkeypatch.setenv("MINIFLOAT_GEMV_ISA", isa)
        dec = FusedDecoder(model)
        together, alone = dec.new_cache("bf16", 16), dec.new_cache("bf16", 16)
        dec.forward(ids[:, :5], together), dec.forward(ids[:, :5], alone)
        rows = dec.forward(ids[:, 5 : 5 + n], together, last=n)
        single = torch.cat([dec.forward(ids[:, t : t + 1], alone) for t in range(5, 5 + n)])
        assert torch.equal(rows, single), (isa, n)
        assert all(torch.equal(together.held[k], alone.held[k]) for k in ("k", "v"))


def test_hadamard_rotated_layers_run_fused_as_the_eager_path_computes_them():
    """GPTQ's recommended NVFP4 pipeline rotates every layer's input (hadamard:16): the fused
    step rotates as minifloat.kernels.reference.rht does, and equals the eager path."""
    model = tiny("qwen2", seed=5)
    calib = [torch.randint(0, VOCAB, (2, 16)) for _ in range(2)]
    quantize_model(model, "nvfp4-weight-only", method="gptq", calibration=calib, quantize_head=False)
    rotated = [m for m in model.modules() if getattr(m, "input_transform", None) is not None]
    assert rotated and unsupported(model) is None
    ids = torch.randint(0, VOCAB, (1, 10))
    with torch.no_grad():
        ref = model(ids).logits[0]
    dec = FusedDecoder(model)
    got = dec.forward(ids, dec.new_cache("fp32", 16), last=10)
    assert (got - ref).abs().max() <= bound(ref)
    eager = generate(model, ids, 12, kv_cache="fp32", decode_step="eager")
    assert torch.equal(generate(model, ids, 12, kv_cache="fp32", decode_step="fused").tokens, eager.tokens)


def _layer0_rows(dec, ids, steps):
    """Layer 0's keys of every token, float32, token-major (T · KV heads, head_dim): they depend
    only on the tokens, so every cache format computes the same ones."""
    c = dec.new_cache("fp32", ids.shape[1])
    dec.forward(ids[:, : ids.shape[1] - steps], c)
    for t in range(ids.shape[1] - steps, ids.shape[1]):
        dec.forward(ids[:, t : t + 1], c)
    return c.held["k"][0].permute(1, 0, 2).reshape(-1, c.held["k"].shape[-1])


def _packed_rows(cache, name, t0, t1):
    """Positions t0 … t1 − 1 of layer 0's packed `name` (codes or scales), token-major."""
    x = cache.held[name][0][:, t0:t1]
    return x.permute(1, 0, *range(2, x.dim())).reshape(-1, *x.shape[2:])


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
def test_packed_kv_holds_minifloat_s_own_quantization(fmt):
    """A prompt is one chunk, each step another, as KVCache stores updates: codes, scales and
    NVFP4's chunk tensor scale equal minifloat.quant.quantize of the same rows in the KV format's
    scheme, bit for bit."""
    from minifloat.infer.generation.kvspec import kv_format
    from minifloat.quant import quantize

    model = tiny("llama", seed=6, heads=2, kv_heads=1)  # head_dim 32: whole MXFP4 blocks
    dec = FusedDecoder(model)
    ids = torch.randint(0, VOCAB, (1, 11))
    rows = _layer0_rows(dec, ids, steps=2)
    c = dec.new_cache(fmt, 16)
    dec.forward(ids[:, :9], c), dec.forward(ids[:, 9:10], c), dec.forward(ids[:, 10:11], c)
    G = c.held["kc"].shape[1]
    for t0, t1 in ((0, 9), (9, 10), (10, 11)):
        q = quantize(rows[t0 * G : t1 * G], kv_format(fmt))
        assert torch.equal(_packed_rows(c, "kc", t0, t1), q.data[: (t1 - t0) * G])
        scales = _packed_rows(c, "ks", t0, t1)
        assert torch.equal(scales.reshape(q.scale.shape) if fmt == "fp8" else scales, q.scale[: (t1 - t0) * G])
        if fmt == "nvfp4":
            assert torch.equal(c.held["kts"][0, t0:t1], q.tensor_scale.expand(t1 - t0))


def test_a_bf16_window_before_nvfp4_ages_tokens_as_kvcache_does():
    """Sinks 2, window 4: a 12-token prompt keeps tokens 0–1 and 8–11 in bfloat16 and packs 2–7 as one
    chunk (from their bfloat16 values); each step packs the token that leaves the window."""
    from minifloat.infer.generation.kvspec import KVSpec, kv_format
    from minifloat.quant import quantize

    model = tiny("qwen2", seed=7)
    dec = FusedDecoder(model)
    ids = torch.randint(0, VOCAB, (1, 14))
    rows = _layer0_rows(dec, ids, steps=2).to(torch.bfloat16)
    G = model.config.num_key_value_heads
    c = dec.new_cache(KVSpec(format="nvfp4", recent_format="bf16", sink_tokens=2, recent_tokens=4), 16)
    dec.forward(ids[:, :12], c)
    assert c.precisions() == ["bf16"] * 2 + ["nvfp4"] * 6 + ["bf16"] * 4
    assert torch.equal(c.held["ksink"][0].permute(1, 0, 2).reshape(-1, rows.shape[1]), rows[: 2 * G])
    assert torch.equal(c.held["kring"][0].permute(1, 0, 2).reshape(-1, rows.shape[1]), rows[8 * G : 12 * G])  # slots 8 % 4 …
    dec.forward(ids[:, 12:13], c), dec.forward(ids[:, 13:14], c)
    assert c.precisions() == ["bf16"] * 2 + ["nvfp4"] * 8 + ["bf16"] * 4
    for t0, t1 in ((2, 8), (8, 9), (9, 10)):
        q = quantize(rows[t0 * G : t1 * G].float(), kv_format("nvfp4"))
        assert torch.equal(_packed_rows(c, "kc", t0, t1), q.data[: (t1 - t0) * G])
        assert torch.equal(_packed_rows(c, "ks", t0, t1), q.scale[: (t1 - t0) * G])
        assert torch.equal(c.held["kts"][0, t0:t1], q.tensor_scale.expand(t1 - t0))
    c.truncate(11)  # a rollback keeps what left the window packed, as KVCache does
    assert c.precisions() == ["bf16"] * 2 + ["nvfp4"] * 8 + ["bf16"]


@pytest.mark.parametrize("kv", ["fp8", "nvfp4", "mxfp4", "nvfp4+bf16", "fp8+bf16", "nvfp4+bf16@hadamard", "mxfp4@hadamard-kv",
                                "fp8@pre-rope", "nvfp4+bf16@pre-rope", "nvfp4+bf16@channel", "mxfp4+bf16@channel",
                                "fp8+bf16@channel", "nvfp4+bf16@channel@pre-rope", "fp8+bf16@channel@pre-rope"])
def test_packed_caches_decode_as_the_eager_quantized_cache(kv, monkeypatch):
    """Greedy tokens and every token's format equal the eager path's over the same quantized
    cache, with its key options (each ISA path's decoding of the packed rows; head_dim 32: a
    power of two, whole MXFP4 blocks, AVX-512's attention in registers)."""
    model = tiny("llama", seed=8, heads=2, kv_heads=1)
    ids = torch.randint(0, VOCAB, (1, 40))
    eager = generate(model, ids, 20, kv_cache=kv, kv_sink_tokens=4, kv_recent_tokens=8, decode_step="eager")
    for isa in gemv.isas():
        monkeypatch.setenv("MINIFLOAT_GEMV_ISA", isa)
        fused = generate(model, ids, 20, kv_cache=kv, kv_sink_tokens=4, kv_recent_tokens=8, decode_step="fused")
        assert fused.decode_step == "fused" and torch.equal(fused.tokens, eager.tokens), isa
    assert fused.kv_precisions == eager.kv_precisions
    fp32 = generate(model, ids, 20, kv_cache="fp32")
    # a channel cache's bfloat16 ring also holds a block not yet aged (here 24–40 of 60 positions)
    assert fused.kv_bytes < fp32.kv_bytes / (1 if "@channel" in kv else 3 if kv.startswith("fp8") and "+" not in kv else 2)


@pytest.mark.parametrize("kv", ["fp32", "nvfp4+bf16", "nvfp4+bf16@channel", "mxfp4+bf16@channel@pre-rope"])
def test_long_rows_split_into_parts_still_equal_transformers(kv):
    """Past 512 positions a row's attention runs in parts merged by rescaling: 1,100 tokens; an
    NVFP4 cache with its window decodes them (head_dim 32: AVX-512's attention in registers;
    channel keys' blocks of 16 positions straddle the parts' bounds)."""
    model = tiny("llama", seed=9, heads=2, kv_heads=1)
    model.config.max_position_embeddings = 2048
    ids = torch.randint(0, VOCAB, (1, 1100))
    dec = FusedDecoder(model)
    spec = KVSpec.parse(kv)
    cache = dec.new_cache(spec, 1100)
    got = prefill_then_steps(dec, ids, cache, 1090)
    with torch.no_grad():
        ref = model(ids).logits[0]
    if kv == "fp32":
        assert (got - ref).abs().max() <= 2 * bound(ref)
    else:  # the quantized keys and values: near, not equal
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.95
    if kv == "fp32":  # rows together = single steps (a packed window would age them as one chunk, as KVCache does)
        again = dec.new_cache(spec, 1100)
        dec.forward(ids[:, :1090], again)
        assert torch.equal(dec.forward(ids[:, 1090:], again, last=10), got[-10:])


@pytest.mark.parametrize("config", [None, "nvfp4-weight-only"])
def test_the_built_in_gpt_runs_fused(config):
    """LayerNorms, one qkv product, GELU, learned positions: its own forward's logits, eager's tokens."""
    torch.manual_seed(10)
    gpt = GPT(GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64, vocab_size=VOCAB)).eval()
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.1)
    if config:
        quantize_model(gpt, config, quantize_head=True)
    assert unsupported(gpt) is None
    ids = torch.randint(0, VOCAB, (1, 30))
    dec = FusedDecoder(gpt)
    cache = dec.new_cache("fp32", 30)
    got = prefill_then_steps(dec, ids, cache, 25)
    with torch.no_grad():
        ref = gpt(ids)[0]
    assert (got - ref).abs().max() <= bound(ref)
    rotated = dec.new_cache(KVSpec.parse("fp32@hadamard-kv"), 30)  # no RoPE: the rotation alone
    assert (dec.forward(ids, rotated, last=30) - ref).abs().max() <= 2 * bound(ref)
    for kv in ("bf16", "nvfp4+bf16", "nvfp4+bf16@channel", "mxfp4+bf16@hadamard"):
        fused = generate(gpt, ids[:, :5], 40, kv_cache=kv)
        assert fused.decode_step == "fused"
        assert torch.equal(fused.tokens, generate(gpt, ids[:, :5], 40, kv_cache=kv, decode_step="eager").tokens)


@pytest.mark.parametrize("config", [None, "nvfp4-weight-only"])
def test_gemma3_runs_fused_with_its_sandwich_norms_geglu_and_two_rotary_tables(config):
    """Gemma 3: (1 + w) RMSNorms before and after each sublayer, GeGLU (tanh GELU), QK-norm, the
    query scale 1/√query_pre_attn_scalar, a sliding layer (its own RoPE base, a 24-token window)
    and a global one, a scaled embedding: transformers' logits past the window, eager's tokens."""
    from tests.families.tiny import config as family_config

    cfg = family_config("gemma3", VOCAB)
    cfg.rope_parameters = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                           "full_attention": {"rope_type": "default", "rope_theta": 1e6}}  # fmt: skip
    torch.manual_seed(12)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # norms' w away from 0 (the (1 + w) shows), weights of a trained model's size
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if name.endswith("norm.weight") else 0.08))
    if config:
        quantize_model(model, config, quantize_head=True)
    dec = fused_matches(model, 60, 40, ("fp32", "nvfp4+bf16@hadamard", "nvfp4+bf16@pre-rope"), new=50)
    # keys stored before RoPE, each layer's own table applied as they are read: the same logits
    ids = torch.randint(0, VOCAB, (1, 40))
    with torch.no_grad():
        ref = model(ids).logits[0]
    got = prefill_then_steps(dec, ids, dec.new_cache(KVSpec.parse("fp32@pre-rope"), 40), 30)
    assert (got - ref).abs().max() <= bound(ref)
    assert "two rotary embeddings" in unsupported(model, KVSpec.parse("nvfp4+bf16@channel@pre-rope"))


@pytest.mark.parametrize("family", ["mixtral", "qwen3moe", "qwen2moe", "gptoss"])
@pytest.mark.parametrize("experts", ["fused", "linears", "nvfp4-weight-only"])
def test_mixtures_of_experts_run_fused(family, experts):
    """Mixtral (weights renormalized over the top 2), Qwen3-MoE (not renormalized), Qwen2-MoE (a
    sigmoid-gated shared expert of its own width, a dense layer of a third width, q/k/v biases) and
    GPT-OSS (the top 2 logits' softmax, a router bias, one gate-up product with a clamped SwiGLU,
    biases, attention sinks, sliding and full layers), their experts as transformers' fused 3-D parameters, as
    minifloat's per-expert Linears, or packed: every row's logits are transformers' forward's (40
    tokens: rows choose different experts), the greedy tokens eager's."""
    from minifloat.models.experts import unfuse_experts
    from tests.families.tiny import moe_config

    torch.manual_seed(13)
    model = transformers.AutoModelForCausalLM.from_config(moe_config(family, VOCAB)).eval()
    with torch.no_grad():  # GPT-OSS's biases and sinks too: a missed one shows
        for p in model.parameters():
            if p.dim() >= 2 or family in ("gptoss", "qwen2moe"):
                p.normal_(0, 0.08 if p.dim() >= 2 else 0.3)
    if experts == "fused" and family == "gptoss":  # held transposed and interleaved: load_model unfuses them
        assert "load the model with minifloat.load_model" in unsupported(model)
        return
    if experts != "fused":
        unfuse_experts(model)
    if experts == "nvfp4-weight-only":
        quantize_model(model, experts, quantize_head=True)
    fused_matches(model, 40, 30, ("nvfp4+bf16",))


def test_gemma2_runs_fused_with_its_capped_scores_and_logits():
    """Gemma 2: Gemma 3's sandwich norms and GeGLU with one rotary table, attention scores and
    final logits capped as cap · tanh(x / cap) (caps small enough to bite): transformers' logits
    past the sliding window, eager's tokens, NVFP4 weights too."""
    torch.manual_seed(15)
    cfg = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=24,
                                    query_pre_attn_scalar=16, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if name.endswith("norm.weight") else 0.2))
    fused_matches(model, 60, 40, ("fp32",), new=50)
    quantize_model(model, "nvfp4-weight-only", quantize_head=True)
    fused_matches(model, 60, 40, ("nvfp4+bf16",), new=50)


@pytest.mark.parametrize("act", ["relu", "gelu"])
@pytest.mark.parametrize("config", [None, "nvfp4-weight-only"])
def test_opt_runs_fused_as_the_built_in_gpt_is_exported(act, config):
    """OPT (separate q, k, v with biases, LayerNorms, ReLU or GELU, positions offset by 2): its own
    forward's logits and eager's tokens; the built-in GPT exported as OPT decodes fused; OPT-350m's
    post-norm layout is refused by name."""
    from minifloat.models.opt import gpt_to_transformers

    torch.manual_seed(14)
    cfg = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                                 max_position_embeddings=48, activation_function=act, word_embed_proj_dim=64)  # fmt: skip
    model = transformers.OPTForCausalLM(cfg).eval()
    with torch.no_grad():  # biases away from 0, LayerNorm weights away from 1: a missed one shows
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.08) + (1.0 if "layer_norm.weight" in name else 0.0))
    if config:
        quantize_model(model, config, quantize_head=True)
    fused_matches(model, 30, 25, ("fp32", "nvfp4+bf16"))
    gpt = GPT(GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64, vocab_size=VOCAB)).eval()
    fused_matches(gpt_to_transformers(gpt).eval(), 30, 25, ("bf16",))
    post = transformers.OPTForCausalLM(transformers.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=1,
                                                              num_attention_heads=4, do_layer_norm_before=False))  # fmt: skip
    assert "post-norm" in unsupported(post)


@pytest.mark.parametrize("act", ["gelu_new", "gelu"])
@pytest.mark.parametrize("config", [None, "nvfp4-weight-only"])
def test_gpt2_runs_fused_as_the_built_in_gpt_does(act, config):
    """GPT-2 with its Conv1D layers as Linears (as `load_model` holds them): transformers' forward's
    logits (GELU tanh-approximated or exact; biases everywhere), eager's greedy tokens."""
    from minifloat.models.conv1d import linears_from_conv1d

    torch.manual_seed(11)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=48, activation_function=act,
                                  bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("ln_1.weight"):
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("weight") else 0.0))
    assert linears_from_conv1d(model) == 8
    if config:
        quantize_model(model, config, quantize_head=True)
    dec = fused_matches(model, 30, 25, ("fp32", "nvfp4+bf16"))
    with pytest.raises(MinifloatError, match="positions 40 … 49: the model learned 48"):
        dec.forward(torch.randint(0, VOCAB, (1, 10)), _filled(dec, 40))


def _filled(dec, n: int):
    cache = dec.new_cache("fp32", 64)
    dec.forward(torch.zeros(1, n, dtype=torch.long), cache)
    return cache


@pytest.mark.parametrize("kv", ["fp32@hadamard-kv", "fp32@pre-rope", "bf16@hadamard"])
def test_rotated_and_pre_rope_caches_keep_transformers_logits(kv):
    """Keys (and values) stored Hadamard-rotated, or before RoPE: attention reads what it read
    without them (queries rotated to meet the keys, outputs rotated back; RoPE given at read), so
    a float32 cache's logits are still transformers' own; the rows held are the model's keys
    times the rotation (the kvtransforms matrix), or before their rotary embedding."""
    from minifloat.infer.generation.kvtransforms import hadamard, rotate_half

    model = tiny("llama", seed=11, heads=2, kv_heads=1)
    dec = FusedDecoder(model)
    ids = torch.randint(0, VOCAB, (1, 24))
    spec = KVSpec.parse(kv)
    cache = dec.new_cache(spec, 32)
    got = prefill_then_steps(dec, ids, cache, 20)
    with torch.no_grad():
        ref = model(ids).logits[0]
    tol = 2 * bound(ref) if spec.format == "fp32" else 0.05 * float(ref.abs().max())
    assert (got - ref).abs().max() <= tol
    if spec.format != "fp32":
        return
    keys = _layer0_rows(dec, ids, steps=4)  # the plain cache's: after RoPE, not rotated
    held = cache.held["k"][0][:, :24].permute(1, 0, 2).reshape(keys.shape)
    if spec.rotate:
        assert torch.allclose(held, keys @ hadamard(keys.shape[1]), atol=1e-5)
        values = FusedDecoder(model).new_cache("fp32", 32)
        dec.forward(ids, values)
        assert torch.allclose(cache.held["v"][0, 0, :24], values.held["v"][0, 0, :24] @ hadamard(keys.shape[1]), atol=1e-5)
    else:  # RoPE undone by the inverse rotation gives the stored (pre-RoPE) keys
        cos, sin = dec.rope_tables(24)
        assert torch.allclose(held, keys * cos - rotate_half(keys) * sin, atol=1e-5)


def test_kv_options_the_fused_step_leaves_to_the_eager_path():
    model = tiny("llama", seed=8, heads=2, kv_heads=1)
    assert "rotated keys that are also pre-RoPE" in unsupported(model, KVSpec.parse("nvfp4+bf16@hadamard@pre-rope"))
    assert "not budgets" in unsupported(model, KVSpec.parse("nvfp4", budget_bytes=10**6))
    odd = tiny("llama", seed=8, heads=4, kv_heads=2, hidden=96)  # head_dim 24
    assert "needs a power of two; head_dim is 24" in unsupported(odd, KVSpec.parse("fp8@hadamard"))
    gpt = GPT(GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32, vocab_size=VOCAB))
    assert "learns positions" in unsupported(gpt, KVSpec.parse("fp8@pre-rope"))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8"])
def test_channel_keys_hold_kivi_s_quantization(fmt):
    """@channel (KIVI): keys age a whole block of tokens at a time, each chunk quantized per
    channel as KVCache's ChannelPacked does — a channel's values of the chunk one row of
    minifloat.quant.quantize in the format's scheme (FP8 a scale per channel and chunk, FP4 per
    block of tokens, NVFP4 a tensor scale per chunk): codes and scales bit for bit."""
    from minifloat.infer.generation.kvspec import kv_format
    from minifloat.quant import quantize

    model = tiny("qwen2", seed=12, heads=2, kv_heads=1)  # head_dim 32
    dec = FusedDecoder(model)
    spec = KVSpec.parse(f"{fmt}+bf16@channel", sink_tokens=2, recent_tokens=4)
    G = spec.group
    ids = torch.randint(0, VOCAB, (1, 2 + 3 * G + 4 + 3))
    n = ids.shape[1]
    rows = _layer0_rows(dec, ids, steps=G + 3).to(torch.bfloat16).float()  # (n, head_dim): one KV head
    c = dec.new_cache(spec, n)
    prompt = 2 + 2 * G + 4 + 1  # ages 2 blocks, keeps 5 in the window (one short of a third block's turn)
    dec.forward(ids[:, :prompt], c)
    assert c.precisions() == ["bf16"] * 2 + [fmt] * (2 * G) + ["bf16"] * 5
    for t in range(prompt, n):
        dec.forward(ids[:, t : t + 1], c)
    assert c.precisions() == ["bf16"] * 2 + [fmt] * (3 * G) + ["bf16"] * (n - 2 - 3 * G)
    for b0, b1 in ((0, 2), (2, 3)):  # the prompt's chunk of two blocks, then a step's one block
        chunk = rows[2 + b0 * G : 2 + b1 * G]  # (t, head_dim) → channels (head_dim, t)
        q = quantize(chunk.T.contiguous(), kv_format(fmt))
        codes = c.held["kc"][0, 0, b0:b1]  # (blocks, head_dim, block bytes)
        assert torch.equal(codes.permute(1, 0, 2).reshape(q.data.shape), q.data)
        scales = c.held["ks"][0, 0, b0:b1]
        if fmt == "fp8":
            assert torch.equal(scales, q.scale.reshape(1, -1).expand(b1 - b0, -1))
        else:
            assert torch.equal(scales.T, q.scale.reshape(scales.T.shape))
        if fmt == "nvfp4":
            assert torch.equal(c.held["kts"][0, 2 + b0 * G : 2 + b1 * G], q.tensor_scale.expand((b1 - b0) * G))
    with pytest.raises(MinifloatError, match="keep recent_tokens above the draft tokens"):
        c.truncate(2 + 3 * G - 1)
    ids = torch.randint(0, VOCAB, (1, 8))  # a draft's rollback could reach the blocks: the eager cache, or the reason
    assert generate(model, ids, 6, kv_cache=f"{fmt}+bf16@channel", kv_recent_tokens=3, draft="nvfp4").decode_step == "eager"
    with pytest.raises(MinifloatError, match="rollback of up to 5 tokens would reach keys scaled per channel"):
        generate(model, ids, 6, kv_cache=f"{fmt}+bf16@channel", kv_recent_tokens=3, draft="nvfp4", decode_step="fused")


def _longrope_phi3(orig: int = 12):
    """A tiny Phi-3 whose LongRoPE switches from the short to the long factors past `orig` positions."""
    torch.manual_seed(17)
    half = 8  # head_dim 16
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": orig,
            "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [2.0 + 0.5 * i for i in range(half)]}
    cfg = transformers.Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * orig,
                                  original_max_position_embeddings=orig, rope_parameters=rope,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize(("prompt", "total"), [(5, 30), (20, 30), (8, 10)])
def test_longrope_tables_switch_per_call_as_transformers_does(prompt, total):
    """Phi-3's LongRoPE takes the long factors for a whole call once the call reaches past the
    pretraining length (12 here), the short ones before: the fused step's logits are those of
    transformers' own cached calls (the prompt in one call, then one token a call) — a prompt
    shorter and one longer than 12, and a sequence that never crosses — and greedy tokens eager's."""
    model = _longrope_phi3()
    assert unsupported(model) is None
    ids = torch.randint(0, VOCAB, (1, total))
    dec = FusedDecoder(model)
    got = prefill_then_steps(dec, ids, dec.new_cache("fp32", 48), prompt)
    with torch.no_grad():
        cache = transformers.DynamicCache(config=model.config)
        ref = [model(ids[:, :prompt], past_key_values=cache, use_cache=True).logits[0]]
        ref += [model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[0] for t in range(prompt, total)]
        ref = torch.cat(ref)
        whole = model(ids).logits[0]
    assert (got - ref).abs().max() <= bound(ref)
    if prompt <= 12 < total:  # the whole sequence in one call takes the long factors everywhere: not what this decode computes
        assert (whole[:12] - ref[:12]).abs().max() > bound(ref)
    fused = generate(model, ids[:, :prompt], 24, kv_cache="bf16")
    assert fused.decode_step == "fused"
    assert torch.equal(fused.tokens, generate(model, ids[:, :prompt], 24, kv_cache="bf16", decode_step="eager").tokens)


def test_dynamic_rope_and_pre_rope_keys_with_longrope_run_eagerly():
    model = _longrope_phi3()
    assert "pre-RoPE keys" in unsupported(model, KVSpec(format="nvfp4", recent_format="bf16", pre_rope=True))
    model.config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    assert "dynamic" in unsupported(model)


def test_phi3_runs_fused_with_its_qkv_and_gate_up_products():
    """Phi-3: one qkv product and one gate-up product ([gate | up]) per layer: transformers' logits, eager's tokens."""
    torch.manual_seed(13)
    cfg = transformers.Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    assert unsupported(model) is None
    ids = torch.randint(0, VOCAB, (1, 30))
    dec = FusedDecoder(model)
    cache = dec.new_cache("fp32", 30)
    got = prefill_then_steps(dec, ids, cache, 25)
    with torch.no_grad():
        ref = model(ids).logits[0]
    assert (got - ref).abs().max() <= bound(ref)
    quantize_model(model, "nvfp4-weight-only", quantize_head=False)
    for kv in ("bf16", "nvfp4+bf16"):
        fused = generate(model, ids[:, :5], 30, kv_cache=kv)
        assert fused.decode_step == "fused"
        assert torch.equal(fused.tokens, generate(model, ids[:, :5], 30, kv_cache=kv, decode_step="eager").tokens)
    cfg.rope_parameters = {**cfg.rope_parameters, "partial_rotary_factor": 0.5}
    assert "partial rotary embedding" in unsupported(model)
