"""The built-in GPT for serving (as transformers' OPT), `evaluate` against a float64 oracle, and
the `quantize` / `eval` / `ptq-compare` commands on a model minifloat trained."""

import json
import math

import numpy as np
import pytest
import torch

import minifloat
from minifloat.cli import main
from minifloat.infer import (
    QuantizedLinear,
    evaluate,
    gpt_to_transformers,
    load_gpt,
    load_model,
    quantize_model,
    token_batches,
)
from minifloat.models.gpt import GPT, GPTConfig
from minifloat.train.config import TrainConfig
from minifloat.train.loop import train

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny GPT trained for a few steps by `minifloat train` (its output folder)."""
    out = tmp_path_factory.mktemp("run")
    c = TrainConfig(model="tiny", steps=4, batch_size=4, seq_len=32, eval_every=0, eval_batches=1, max_bytes=200_000, warmup=1)
    train(c, out, progress=False)
    return out


def test_the_gpt_as_opt_gives_the_same_logits():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=128)).eval()
    opt = gpt_to_transformers(gpt)
    ids = torch.randint(0, 256, (2, 64))
    with torch.no_grad():
        assert torch.allclose(opt(ids).logits, gpt(ids), rtol=0, atol=1e-5)
    assert opt.lm_head.weight.data_ptr() == opt.model.decoder.embed_tokens.weight.data_ptr()  # tied, as the GPT's


def test_a_trained_gpt_is_exported_and_read_by_transformers(trained, tmp_path):
    gpt = load_gpt(trained)
    assert isinstance(gpt, GPT) and not gpt.training
    opt = gpt_to_transformers(gpt)
    quantize_model(opt, "mxfp8")
    out = minifloat.infer.export(opt, tmp_path / "ckpt")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, quantization_config=transformers.utils.quantization_config.CompressedTensorsConfig(dequantize=True))  # fmt: skip
    sd = hf.state_dict()
    for n, m in opt.named_modules():
        if isinstance(m, QuantizedLinear):
            assert torch.equal(sd[f"{n}.weight"], m.weight.dequantize()), n


def _log_softmax64(logits: torch.Tensor) -> np.ndarray:
    x = logits.double().numpy()
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_evaluate_against_a_float64_oracle():
    torch.manual_seed(1)
    ref = GPT(GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=64)).eval()
    model = GPT(GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=64)).eval()
    model.load_state_dict(ref.state_dict())
    with torch.no_grad():
        model.blocks[0].mlp.fc.weight.add_(0.05 * torch.randn_like(model.blocks[0].mlp.fc.weight))
    batches = token_batches(bytes(range(256)) * 20, batch_size=3, seq_len=40, n_batches=2)
    m = evaluate(model, ref, batches)
    nll = nll_ref = kl = agree = n = 0.0
    for b in batches:
        with torch.no_grad():
            lq, lr = _log_softmax64(model(b[:, :-1])), _log_softmax64(ref(b[:, :-1]))
        t = b[:, 1:].numpy()
        nll -= np.take_along_axis(lq, t[..., None], -1).sum()
        nll_ref -= np.take_along_axis(lr, t[..., None], -1).sum()
        kl += (np.exp(lr) * (lr - lq)).sum()
        agree += (lq.argmax(-1) == lr.argmax(-1)).sum()
        n += t.size
    assert m["tokens"] == n == 2 * 3 * 40
    assert m["ppl"] == pytest.approx(np.exp(nll / n), rel=1e-5)
    assert m["delta_ppl_pct"] == pytest.approx(100 * (np.exp((nll - nll_ref) / n) - 1), abs=1e-3)
    assert m["kl"] == pytest.approx(kl / n, rel=1e-3) and m["kl"] > 0
    assert m["top1"] == agree / n
    assert m["weight_bytes"] == 4 * sum(lin.weight.numel() for lin in model.modules()
                                        if isinstance(lin, torch.nn.Linear) and lin is not model.lm_head)  # fmt: skip
    with pytest.raises(minifloat.MinifloatError, match="need at least"):
        token_batches(b"short", batch_size=2, seq_len=8, n_batches=2)


def test_quantize_eval_and_ptq_compare_commands(trained, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", str(trained), "--scheme", "nvfp4", "--out", str(out), "--calib-batches", "2",
                 "--batch-size", "2", "--seq-len", "32"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "model.decoder.layers.0.fc1" in printed and "ignored (matches 'lm_head')" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "opt" and config["quantization_config"]["format"] == "nvfp4-pack-quantized"
    # a second run does not overwrite by accident, and says so before any work
    assert main(["quantize", str(trained), "--scheme", "nvfp4", "--out", str(out)]) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err

    assert main(["eval", str(out), "--reference", str(trained), "--eval-batches", "2", "--batch-size", "2",
                 "--seq-len", "32", "--json"]) == 0  # fmt: skip
    m = json.loads(capsys.readouterr().out)
    assert m["delta_ppl_pct"] > -50 and 0 <= m["top1"] <= 1 and m["kl"] > 0

    report = tmp_path / "ptq"
    assert main(["ptq-compare", str(trained), "--schemes", "fp8-dynamic,mxfp8", "--eval-batches", "2", "--batch-size", "2",
                 "--seq-len", "32", "--out", str(report)]) == 0  # fmt: skip
    metrics = json.loads((report / "metrics.json").read_text())
    assert [r["config"] for r in metrics["runs"]] == ["fp8-dynamic", "mxfp8"]
    assert {p["config"]: p["status"] for p in metrics["torchao"]}["fp8-dynamic"] == "not run"
    text = (report / "report.md").read_text()
    assert "| mxfp8" in text and "torchao configs that did not run here" in text and (report / "quality.png").is_file()

    assert main(["quantize", str(trained), "--scheme", "fp8-block", "--out", str(tmp_path / "b")]) == 0
    printed = capsys.readouterr().out  # the tiny model's K = 64 is one partial 128-wide block: quantized too
    assert "fp8-block: 12 of 13 Linears quantized" in printed and "ignored (matches 'lm_head')" in printed
    assert main(["quantize", str(trained), "--scheme", "mxfp8", "--format", "hf-fp8", "--out", str(tmp_path / "c")]) == 2
    assert "format 'hf-fp8' holds fp8-block weights" in capsys.readouterr().err


def test_a_transformers_model_folder_goes_through_the_commands(tmp_path, capsys):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    out = tmp_path / "q"
    assert main(["quantize", str(tmp_path / "llama"), "--scheme", "fp8-static", "--out", str(out),
                 "--calib-batches", "1", "--batch-size", "2", "--seq-len", "32"]) == 0  # fmt: skip
    assert "fp8-static: 14 of 15 Linears quantized" in capsys.readouterr().out
    model = minifloat.infer.load_model(out)
    assert sum(isinstance(m, QuantizedLinear) for m in model.modules()) == 14
    assert all(float(m.input_amax) > 0 for m in model.modules() if isinstance(m, QuantizedLinear))
    assert main(["eval", str(tmp_path / "llama"), "--scheme", "mxfp4", "--eval-batches", "1", "--batch-size", "2",
                 "--seq-len", "32"]) == 0  # fmt: skip
    assert "reference perplexity" in capsys.readouterr().out
    assert main(["generate", str(out), "--prompt", "hi", "--max-new-tokens", "6", "--kv-cache", "fp8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["new_tokens"] == 6  # the quantized checkpoint decodes, FP8 cache
    with pytest.raises(minifloat.MinifloatError, match="not a model minifloat loads .a GGUF file .* a `minifloat train` output"):
        minifloat.infer.load_model(tmp_path)


def test_generate_command_streams_and_reports(trained, capsys):
    assert main(["generate", str(trained), "--prompt", "def f(", "--max-new-tokens", "12", "--kv-cache", "fp8",
                 "--draft", "nvfp4", "--draft-tokens", "3"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert out.startswith("def f(") and "12 tokens in" in out and "KV cache fp8" in out and "acceptance per position" in out
    assert main(["generate", str(trained), "--prompt", "x", "--max-new-tokens", "5", "--json", "--temperature", "0.7"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["new_tokens"] == 5 and stats["kv_cache"] == "bf16"
    assert main(["generate", str(trained), "--prompt", "abc", "--max-new-tokens", "40", "--kv-cache", "fp8",
                 "--kv-budget", "40KB"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "KV budget 40,000 bytes: tokens held" in out and "nvfp4" in out
    assert main(["generate", str(trained), "--prompt", "abc", "--max-new-tokens", "40", "--kv-budget", "1KB"]) == 2
    assert "nothing was dropped" in capsys.readouterr().err
    assert main(["generate", str(trained), "--prompt", "x" * 60, "--max-new-tokens", "10"]) == 2
    assert "exceeds the model's context of 64 tokens" in capsys.readouterr().err


def test_generate_with_a_gptq_draft_keeps_the_model_s_greedy_text(trained, tmp_path, capsys):
    text = tmp_path / "calib.txt"
    text.write_text("def add(a, b):\n    return a + b\n\n" * 400)
    assert main(["generate", str(trained), "--prompt", "def f(", "--max-new-tokens", "12", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["generate", str(trained), "--prompt", "def f(", "--max-new-tokens", "12", "--json", "--draft", "nvfp4-gptq",
                 "--draft-data", str(text), "--draft-calib-batches", "1", "--draft-tokens", "3"]) == 0  # fmt: skip
    spec = json.loads(capsys.readouterr().out)
    assert spec["text"] == plain["text"] and spec["draft_tokens"] == 3 and spec["mean_accepted"] > 0
    assert main(["generate", str(trained), "--prompt", "x", "--draft", "nvfp4", "--draft-data", str(text)]) == 2
    assert "calibrate a GPTQ draft: add --draft nvfp4-gptq" in capsys.readouterr().err
    assert main(["generate", str(trained), "--prompt", "x", "--draft", "nvfp4-gptq", "--draft-data", str(tmp_path / "no")]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def test_bench_decode_reports_kv_formats_and_drafts(trained, capsys):
    assert main(["bench", "decode", str(trained), "--kv-formats", "fp32,fp8,nvfp4", "--contexts", "40", "--windows", "2",
                 "--draft-tokens", "2", "--drafts", "nvfp4", "--new-tokens", "8", "--weights", "fp32,nvfp4-weight-only",
                 "--gemv", "64x48", "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    fp32, fp4 = out["weights"]["runs"]
    model = load_model(trained)
    linear = {id(m.weight): m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert fp32["weight_bytes_per_token"] == sum(w.nbytes for w in linear.values()) + sum(
        m.bias.nbytes for m in model.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None)
    nk = sum(w.numel() for w in linear.values())  # codes 4 bits, an E4M3 scale per 16, an FP32 scale per tensor
    biases = fp32["weight_bytes_per_token"] - 4 * nk
    assert fp4["weight_bytes_per_token"] == nk // 2 + nk // 16 + 4 * len(linear) + biases
    assert fp32["vs_fp32"] == 1.0 and fp4["tokens_per_s"] > 0 and fp4["bound_tokens_per_s"] > fp32["bound_tokens_per_s"]
    kernels = {r["kernel"] for r in out["gemv"]}
    assert {"fp32", "minifloat nvfp4", "minifloat nvfp4 (kernel)", "minifloat mxfp4", "torch int4 (bf16 x)",
            "torch int8 (fp32 x)"} <= kernels
    kv = {r["format"]: r for r in out["kv"]}
    assert kv["fp32"]["kl"] == 0.0 and kv["fp32"]["top1"] == 1.0  # the reference against itself
    assert kv["fp8"]["kv_bytes"] < kv["fp32"]["kv_bytes"] / 3 and kv["nvfp4"]["kv_bytes"] < kv["fp8"]["kv_bytes"]
    (run,) = out["speculative"]["runs"]
    assert run["draft"] == "nvfp4" and run["k"] == 2 and 0 <= run["token_acceptance"] <= 1
    assert main(["bench", "decode", str(trained), "--contexts", "500"]) == 2
    assert "must be in (17, 64]" in capsys.readouterr().err


def test_adapt_and_sensitivity_commands(trained, tmp_path, capsys):
    out = tmp_path / "adapt"
    assert main(["adapt", str(trained), "--candidates", "fp8-dynamic,mxfp4", "--budget-bits", "5", "--calib-batches", "1",
                 "--eval-batches", "1", "--batch-size", "2", "--seq-len", "32", "--out", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "| auto 5 bits" in printed and "| heuristic" not in printed and "| first/last blocks" in printed
    assert "| first+last layers fp8-dynamic to 5 bits, rest mxfp4" in printed and "| last layers fp8-dynamic" in printed
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["auto"][0]["average_bits"] <= 5 and {u["name"] for u in metrics["uniform"]} == {"fp8-dynamic", "mxfp4"}
    assert (out / "pareto.png").is_file() and (out / "sensitivity.png").is_file() and "Spearman" in (out / "report.md").read_text()
    assert main(["sensitivity", str(trained), "--candidates", "mxfp4", "--calib-batches", "1", "--eval-batches", "1",
                 "--batch-size", "2", "--seq-len", "32", "--out", str(tmp_path / "s"), "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["auto"] == []
    assert main(["adapt", str(trained), "--candidates", "fp9", "--out", str(tmp_path / "x")]) == 2
    capsys.readouterr()
    assert main(["adapt", str(trained), "--candidates", "fp8-dynamic,mxfp4", "--budget-bits", "4,5", "--out", str(tmp_path / "y")]) == 2
    out, err = capsys.readouterr()
    assert "--budget-bits 4: the cheapest candidate takes 4.25 bits" in err and "sensitivity" not in out  # before any work
    assert main(["adapt", str(trained), "--candidates", "fp8-dynamic,nvfp4-weight-only", "--budget-bits", "6", "--method", "gptq",
                 "--calib-batches", "1", "--eval-batches", "1", "--batch-size", "2", "--seq-len", "32", "--no-plots",
                 "--out", str(tmp_path / "g"), "--json"]) == 0  # fmt: skip
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["method"] == "gptq" and metrics["measure"] == "all" and metrics["sensitivity"]["method"] == "gptq"
    assert "nvfp4-weight-only: gptq+asym1" in (tmp_path / "g" / "report.md").read_text()  # each candidate's method named
    assert metrics["auto"][0]["average_bits"] <= 6
    assert main(["adapt", str(trained), "--strategy", "layer", "--method", "gptq", "--out", str(tmp_path / "z")]) == 2
    assert "--method gptq goes with --strategy auto" in capsys.readouterr().err


@pytest.mark.parametrize("strategy", ["layer", "token", "confidence", "memory"])
def test_adapt_strategies_write_their_tradeoff(trained, tmp_path, capsys, strategy):
    out = tmp_path / strategy
    assert main(["adapt", str(trained), "--strategy", strategy, "--high", "fp8-dynamic", "--low", "mxfp4",
                 "--calib-batches", "1", "--eval-batches", "2", "--batch-size", "2", "--seq-len", "24", "--out", str(out)]) == 0  # fmt: skip
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["strategy"] == strategy and len(metrics["rows"]) >= 4
    for r in metrics["rows"]:
        assert r["kl"] >= 0 and 0 <= r["top1"] <= 1 and math.isfinite(r["delta_ppl_pct"])
    if strategy == "memory":
        assert all(r["peak_bytes"] <= r["budget_bytes"] for r in metrics["rows"])
    if strategy == "token":
        costs = {r["name"]: r["cost"] for r in metrics["rows"]}
        assert costs["all mxfp4"] == 4.25 and costs["all fp8-dynamic"] > 8 > costs["top 5 % rows by amax"] > 4.25
    assert (out / "tradeoff.png").is_file() and f"--strategy {strategy}" in (out / "report.md").read_text()
    assert "| strategy" in capsys.readouterr().out


def test_a_registered_loader_and_the_adapters(tmp_path):
    from minifloat.models import loading as models
    from minifloat.models.adapter import adapter_for

    transformers = pytest.importorskip("transformers")
    (tmp_path / "m.tiny").write_text("tiny")
    with pytest.raises(minifloat.MinifloatError, match="not a model minifloat loads"):
        minifloat.infer.load_model(tmp_path / "m.tiny")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=99)  # fmt: skip
    models.register_loader("tiny", lambda p: p.suffix == ".tiny", lambda p: transformers.LlamaForCausalLM(cfg), "a .tiny file")
    try:
        model = minifloat.infer.load_model(tmp_path / "m.tiny")
    finally:
        models.LOADERS.pop(0)
    a = adapter_for(model)
    assert (a.kind, tuple(vars(a.kv_geometry).values()), a.context_length) == ("transformers", (3, 1, 16), 99)
    with pytest.raises(minifloat.MinifloatError, match="inference runs the built-in GPT and transformers causal LMs; got Linear"):
        adapter_for(torch.nn.Linear(2, 2))
