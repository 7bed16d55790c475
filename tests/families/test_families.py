"""Every family through the commands: its Linears found (GPT-2's Conv1D too), GPTQ'd, exported
and read back by transformers, smoothing folded into its norms exactly, its sliding windows kept
as windows, generation equal to transformers' own."""

import pytest
import torch

from minifloat.adapt.sensitivity import sensitivity
from minifloat.data.text import TextSource, batches_for, tokenizer_for
from minifloat.errors import MinifloatError
from minifloat.infer.checkpoints.loaders import load_model as load_quantized
from minifloat.infer.evaluation.pipeline import evaluate_paths, quantize_checkpoint, quantize_in_memory
from minifloat.infer.generation.cache import new_cache
from minifloat.infer.generation.decoding import generate
from minifloat.infer.ptq.method import resolve_method
from minifloat.infer.ptq.smoothing import fold_into_norm
from minifloat.models.adapter import adapter_for
from minifloat.models.loading import load_model
from tests.families.tiny import FAMILIES, WINDOW, tiny_family

# Linears per decoder layer (the head not counted): fused qkv / gate_up (Phi-3), Conv1D (GPT-2)
PER_LAYER = {"llama": 7, "qwen2": 7, "qwen3": 7, "gemma3": 7, "mistral": 7, "phi3": 4, "gpt2": 4}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    return request.param, tiny_family(tmp_path_factory.mktemp(request.param) / "model", request.param)


def _source(docs):
    return TextSource(data=str(docs), batch_size=2, seq_len=32, eval_batches=2, calib_batches=2)


def test_every_linear_is_quantized_by_gptq(family, docs):
    name, folder = family
    model = load_model(folder)
    summary = quantize_in_memory(model, "nvfp4-weight-only", None, source=_source(docs), method="gptq")
    assert len(summary.quantized) == 2 * PER_LAYER[name], summary
    # fp8-dynamic's pipeline tunes the norms after GPTQ (RMSNorm, Gemma's (1 + w), GPT-2's LayerNorm): a few steps here
    method = resolve_method("gptq", "fp8-dynamic", tune_norms=3)
    m = evaluate_paths(folder, scheme="fp8-dynamic", source=_source(docs), method=method)
    assert abs(m["delta_ppl_pct"]) < 5 and m["kl"] < 0.05  # FP8 on random weights: close to the reference
    fresh = load_model(folder)
    s = sensitivity(fresh, batches_for(fresh, _source(docs), "train", tokenizer_for(folder)), ["fp8-dynamic", "nvfp4"])
    assert len(s.layers) == 2 * PER_LAYER[name] and all(s.kl[n]["nvfp4"] >= 0 for n in s.layers)


def test_the_export_reads_back_in_transformers(family, docs, tmp_path):
    import transformers

    name, folder = family
    out = tmp_path / "ckpt"
    if name == "gpt2":  # no reader quantizes Conv1D: said, not written wrong
        with pytest.raises(MinifloatError, match="Conv1D"):
            quantize_checkpoint(folder, "mxfp4-weight-only", out, source=_source(docs), method="gptq")  # exact in bf16 too
        return
    quantize_checkpoint(folder, "mxfp4-weight-only", out, source=_source(docs), method="gptq")  # exact in bf16 too
    ids = torch.randint(3, 200, (1, 20), generator=torch.Generator().manual_seed(0))
    qc = transformers.utils.quantization_config.CompressedTensorsConfig(dequantize=True)  # the real reader, decompressing
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, quantization_config=qc, dtype=torch.float32).eval()
    ours = load_quantized(out).eval()  # minifloat's reader of its own export: packed weights
    with torch.no_grad():
        a, b = hf(input_ids=ids).logits, ours(input_ids=ids).logits
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def test_smoothing_folds_into_each_familys_norm_exactly(family):
    name, folder = family
    model = load_model(folder)
    norm = next(m for n, m in model.named_modules() if n.endswith(("input_layernorm", "ln_1")))
    x = torch.randn(3, 64)
    s = torch.rand(64) + 0.5
    with torch.no_grad():
        want = norm(x) / s
        assert fold_into_norm(norm, s)  # Gemma's (1 + w) too: no online division left behind
        torch.testing.assert_close(norm(x), want, rtol=1e-5, atol=1e-5)


def test_generation_equals_transformers_and_sliding_layers_hold_their_window(family):
    name, folder = family
    model = load_model(folder)
    prompt = torch.randint(3, 200, (1, 2 * WINDOW + 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.generate(input_ids=prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
    got = generate(model, prompt, 10, kv_cache="fp32")
    assert torch.equal(got.tokens, want)
    if name in ("mistral", "gemma3"):  # speculation rolls a sliding layer back within the slack it keeps
        spec = generate(model, prompt, 10, kv_cache="fp32", draft="nvfp4", draft_tokens=3)
        assert torch.equal(spec.tokens, want) and spec.proposed > 0
    adapter = adapter_for(model)
    cache = new_cache(adapter, "fp32")
    with torch.no_grad():
        adapter.forward(prompt, cache)
        adapter.forward(prompt[:, -1:], cache)
    seen = prompt.shape[1] + 1
    windows = {"mistral": [WINDOW, WINDOW], "gemma3": [WINDOW, None]}.get(name, [None, None])
    held = [cache.kv.length(i) for i in range(2)]
    for h, w in zip(held, windows, strict=True):  # a window's tokens, dropped an eighth of a window at a time
        assert (w - 1 <= h <= w - 1 + w // 8) if w else h == seen
    assert cache.length() == seen
    per_token = cache.kv.layer_bytes(held.index(max(held))) // max(held)
    assert cache.nbytes() == sum(held) * per_token  # the bytes held: the windows, not the sequence
