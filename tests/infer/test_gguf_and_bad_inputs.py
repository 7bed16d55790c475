"""GGUF models through transformers' reader (a tiny GGUF written here with `gguf`), and the bad
inputs a user meets with real models: each one line naming the file or tensor, no traceback."""

import json
from pathlib import Path

import pytest
import torch

import minifloat
from minifloat.cli import main
from minifloat.infer import load_model

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

H, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 259


def _gpt2_bytes() -> list[str]:
    """GPT-2's byte-to-unicode table (the published mapping): the 256 byte tokens of a byte-level BPE."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, map(chr, cs), strict=True))
    return [table[b] for b in range(256)]


def _rope_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's order of the Q / K rows (its converter permutes them; transformers undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, arch: str = "llama", inter: int = INTER):
    """A random Llama (GQA, SwiGLU, RMSNorm, untied head) written as GGUF F32 tensors as llama.cpp's
    converter lays them out; returns it. ``arch="qwen2"``: a Qwen2 (Q / K / V biases, rows in
    transformers' order)."""
    torch.manual_seed(0)
    family = transformers.Qwen2Config if arch == "qwen2" else transformers.LlamaConfig
    cfg = family(vocab_size=VOCAB, hidden_size=H, intermediate_size=inter, num_hidden_layers=LAYERS,
                 num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                 rms_norm_eps=1e-5, tie_word_embeddings=False)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(128)
    w.add_embedding_length(H)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(inter)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(H // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([*_gpt2_bytes(), "<s>", "<|endoftext|>", "ĠĠ"])  # llama.cpp wants a merge: "Ġ Ġ" makes "ĠĠ"
    w.add_token_types([1] * 256 + [3, 3, 1])
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_merges(["Ġ Ġ"])
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    names = {"input_layernorm": "attn_norm", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}  # fmt: skip
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for hf, gg in names.items():
            w.add_tensor(f"blk.{i}.{gg}.weight", sd[p + hf + ".weight"])
        if arch == "qwen2":  # llama.cpp keeps Qwen2's rows as they are, and its Q / K / V biases
            for proj, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v")):
                w.add_tensor(f"blk.{i}.{gg}.bias", sd[f"{p}self_attn.{proj}.bias"])
            w.add_tensor(f"blk.{i}.attn_q.weight", sd[p + "self_attn.q_proj.weight"])
            w.add_tensor(f"blk.{i}.attn_k.weight", sd[p + "self_attn.k_proj.weight"])
            continue
        w.add_tensor(f"blk.{i}.attn_q.weight", _rope_permute(torch.from_numpy(sd[p + "self_attn.q_proj.weight"]), HEADS).numpy())
        w.add_tensor(f"blk.{i}.attn_k.weight", _rope_permute(torch.from_numpy(sd[p + "self_attn.k_proj.weight"]), KV_HEADS).numpy())
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


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
