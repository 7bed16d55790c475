"""GGUF models through transformers' reader (a tiny GGUF written here with `gguf`), and the bad
inputs a user meets with real models: each one line naming the file or tensor, no traceback."""

import json
from pathlib import Path

import pytest
import torch

import minifloat
from minifloat.cli import main
from minifloat.infer import load_model
from tests.gguf_writer import VOCAB, write_gguf

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

H, INTER, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2


def write_tiny_gguf(path, arch: str = "llama", inter: int = INTER):
    """A random Llama (GQA, SwiGLU, RMSNorm, untied head) written as GGUF F32 tensors as llama.cpp's
    converter lays them out (tests/gguf_writer.py); returns it. ``arch="qwen2"``: a Qwen2 (Q / K / V
    biases, rows in transformers' order)."""
    torch.manual_seed(0)
    family = transformers.Qwen2Config if arch == "qwen2" else transformers.LlamaConfig
    cfg = family(vocab_size=VOCAB, hidden_size=H, intermediate_size=inter, num_hidden_layers=LAYERS,
                 num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                 rms_norm_eps=1e-5, tie_word_embeddings=False)  # fmt: skip
    return write_gguf(transformers.AutoModelForCausalLM.from_config(cfg).eval(), path, arch)


def test_a_gguf_file_loads_with_the_logits_of_the_model_written(tmp_path):
    ref = write_tiny_gguf(tmp_path / "tiny.gguf")
    model = load_model(tmp_path / "tiny.gguf")
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_every_command_takes_a_gguf_file(tmp_path, capsys):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    path = str(tmp_path / "tiny.gguf")
    small = ["--eval-batches", "1", "--batch-size", "2", "--seq-len", "32"]
    assert main(["eval", path, "--scheme", "nvfp4-weight-only", *small]) == 0
    assert "reference perplexity" in capsys.readouterr().out
    assert main(["generate", path, "--prompt", "hello", "--max-new-tokens", "5", "--kv-cache", "fp8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["new_tokens"] == 5
    assert main(["generate", path, "--scheme", "nvfp4", "--prompt", "hello", "--max-new-tokens", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["new_tokens"] == 3  # quantized in memory, its input calibrated first
    assert main(["quantize", path, "--scheme", "fp8-dynamic", "--out", str(tmp_path / "q"), "--calib-batches", "1",
                 "--batch-size", "2", "--seq-len", "32"]) == 0  # fmt: skip
    q = load_model(tmp_path / "q")
    assert sum(isinstance(m, minifloat.infer.QuantizedLinear) for m in q.modules()) == 7 * LAYERS
    capsys.readouterr()
    assert main(["bench", "decode", path, "--kv-formats", "fp8,nvfp4", "--contexts", "24", "--drafts", "", "--windows", "2",
                 "--weights", "fp32,mxfp4-weight-only", "--new-tokens", "4", "--gemv", "", "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert [r["config"] for r in out["weights"]["runs"]] == ["fp32", "mxfp4-weight-only"] and "gemv" not in out
    rows = out["kv"]
    assert [r["format"] for r in rows] == ["fp8", "nvfp4"] and all(0 <= r["kl"] and 0 <= r["top1"] <= 1 for r in rows)
    assert main(["ptq-compare", path, "--schemes", "fp8-dynamic", "--no-torchao", "--no-plots", "--json", "--out",
                 str(tmp_path / "ptq"), *small, "--calib-batches", "1"]) == 0  # fmt: skip
    run = json.loads(capsys.readouterr().out)["runs"][0]
    shapes = [(H, H), (H // 2, H), (H // 2, H), (H, H), (INTER, H), (INTER, H), (H, INTER)]  # q k v o gate up down
    nk, n = sum(a * b for a, b in shapes), sum(a for a, _ in shapes)
    # every block Linear in FP8 with one float32 scale per output row; the head and the embedding not counted
    assert run["quantized_layers"] == 7 * LAYERS and run["bits_per_weight"] == pytest.approx((8 * nk + 32 * n) / nk, rel=1e-12)


def _one_line_error(capsys, argv, match):
    capsys.readouterr()  # what the set-up printed (progress bars)
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("minifloat ")]  # beside transformers' progress bars
    assert "Traceback" not in err and len(lines) == 1 and match in lines[0], err


def test_bad_inputs_are_one_line_naming_the_file_or_tensor(tmp_path, capsys):
    (tmp_path / "fake.gguf").write_bytes(b"PK\x03\x04 not a gguf")
    _one_line_error(capsys, ["eval", str(tmp_path / "fake.gguf")], "fake.gguf: named .gguf but not a GGUF file")
    w = gguf.GGUFWriter(str(tmp_path / "enc.gguf"), "t5")  # an encoder-decoder, not a causal LM
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _one_line_error(capsys, ["eval", str(tmp_path / "enc.gguf")], "a GGUF of architecture 't5', not a causal LM")

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    folder = tmp_path / "llama"
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    st = folder / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: len(data) // 2])  # truncated, as an interrupted copy leaves it
    _one_line_error(capsys, ["quantize", str(folder), "--scheme", "fp8-dynamic", "--out", str(tmp_path / "o")],
                    "model.safetensors: not a readable safetensors file")  # fmt: skip
    st.write_bytes(data)

    # a config that says every Linear is quantized over dense float weights: refused, not evaluated dense
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                  "quantization_status": "compressed", "ignore": ["lm_head"],
                                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                      "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                                      "dynamic": False}}}}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(raw))
    _one_line_error(capsys, ["eval", str(folder)], "'model.layers.0.self_attn.q_proj.weight' is a dense torch.float32")
    del raw["quantization_config"]
    (folder / "config.json").write_text(json.dumps(raw))

    short = tmp_path / "short.txt"
    short.write_text("too short " * 5)
    _one_line_error(capsys, ["eval", str(folder), "--data", str(short), "--scheme", "fp8-dynamic"],
                    "short.txt: only 50 bytes of text")  # fmt: skip
    short.write_text("a few kilobytes of text. " * 200)  # enough to read, too little for 64 batches of 8 × 64
    _one_line_error(capsys, ["eval", str(folder), "--data", str(short), "--scheme", "fp8-dynamic", "--eval-batches", "64",
                             "--seq-len", "64"], "the evaluation text (held-out split) has")  # fmt: skip

    # calibration text is named by its own option, not as --data
    calib = ["eval", str(folder), "--scheme", "fp8-static", "--data", str(short), "--calib"]
    _one_line_error(capsys, [*calib, str(tmp_path / "missing.txt")], "--calib " + str(tmp_path / "missing.txt") + ": no such file")
    (tmp_path / "nul.txt").write_bytes(b"text\x00" * 1000)
    _one_line_error(capsys, [*calib, str(tmp_path / "nul.txt")], "--calib " + str(tmp_path / "nul.txt") + ": binary file")
    if Path("/proc/self/mem").exists():  # a file that exists and cannot be read (even by root)
        _one_line_error(capsys, [*calib, "/proc/self/mem"], "--calib /proc/self/mem: cannot be read")

    write_tiny_gguf(tmp_path / "tiny.gguf")  # a tokenizer of 259 tokens beside a 200-token model
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    cfg.vocab_size = 200
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "mismatch")
    tok.save_pretrained(tmp_path / "mismatch")
    _one_line_error(capsys, ["eval", str(tmp_path / "mismatch"), "--scheme", "fp8-dynamic"],
                    "the tokenizer has 259 tokens and the model's vocabulary 200")  # fmt: skip
