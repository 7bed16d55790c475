"""GGUF files llama.cpp runs: FP4 weights written as ggml's MXFP4 / NVFP4 blocks, checked with
the real readers — `gguf`'s own dequantization of every tensor, transformers' GGUF reader of the
whole file (names, Q / K order, metadata), llama.cpp itself where it is installed — and read
back by minifloat with the codes intact."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import minifloat
from minifloat.cli import main
from minifloat.errors import MinifloatError
from minifloat.infer import QuantizedLinear, load_model
from minifloat.infer.checkpoints.export import export
from minifloat.infer.checkpoints.load import load_quantized
from tests.gguf_writer import VOCAB, llama_cpp_logits, rope_permute

from .test_gguf_and_bad_inputs import HEADS, KV_HEADS, LAYERS, write_tiny_gguf

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

FP4 = ("mxfp4-weight-only", "nvfp4-weight-only", "nvfp4-4over6-weight-only")
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}  # fmt: skip


def _quantized(src, config, **kw):
    model = load_model(src)
    summary = minifloat.quantize_model(model, config, export_format="gguf", **kw)
    return model, summary


def _file_tensors(path):
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    write_tiny_gguf(d / "tiny.gguf")
    return d / "tiny.gguf"


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf-qwen2")
    write_tiny_gguf(d / "tiny.gguf", arch="qwen2")
    return d / "tiny.gguf"


FAMILIES = {"llama": "tiny", "qwen2": "tiny_qwen2"}  # the fixture of each family's tiny GGUF
# every FP4 config on Llama; Qwen2 in MXFP4 (llama.cpp's qwen2 graph ignores NVFP4's tensor scale: refused)
CASES = [*(("llama", c) for c in FP4), ("qwen2", "mxfp4-weight-only")]


@pytest.mark.parametrize(("family", "config"), CASES)
def test_ggufs_own_dequantization_of_every_fp4_tensor_equals_minifloats_weight(request, tmp_path, config, family):
    tiny = request.getfixturevalue(FAMILIES[family])
    model, _ = _quantized(tiny, config)
    out = export(model, tmp_path / "m.gguf", format="gguf", gguf_source=tiny, gguf_rest="f32")
    tensors = _file_tensors(out)
    seen = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, QuantizedLinear):
            continue
        block, proj = name.split(".")[2], name.rsplit(".", 1)[1]
        g = f"blk.{block}.{GGUF_NAMES[proj]}"
        t = tensors[f"{g}.weight"]
        assert t.tensor_type.name == ("MXFP4" if config.startswith("mx") else "NVFP4")
        got = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        q = layer.checkpoint_weight()
        if q.tensor_scale is not None:  # llama.cpp multiplies the product by the tensor's .scale
            scale = np.asarray(tensors[f"{g}.scale"].data, dtype=np.float32).reshape(-1)
            assert scale.shape == (1,) and scale[0] == q.tensor_scale.item()
            q = minifloat.QuantizedTensor(q.data, q.scale, torch.tensor(1.0), q.shape, q.scheme)
        want = q.dequantize()
        if proj in ("q_proj", "k_proj") and family == "llama":  # Qwen2's rows stay in transformers' order
            want = rope_permute(want, HEADS if proj == "q_proj" else KV_HEADS)
        if layer.bias is not None:
            assert np.array_equal(np.asarray(tensors[f"{g}.bias"].data), layer.bias.detach().numpy())
        assert not torch.isnan(got).any()
        assert torch.equal(got, want), name  # every code and block scale, exactly (ggml has no −0: +0 == −0)
        seen += 1
    assert seen == 7 * LAYERS


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_reads_the_file_as_the_model_that_wrote_it(request, tmp_path, family):
    """transformers' own GGUF reader (names, Q / K order, config, tokenizer) sees the weights minifloat
    computes with: an MXFP4 file (no .scale tensors, which transformers' Llama reader cannot take)."""
    tiny = request.getfixturevalue(FAMILIES[family])
    model, _ = _quantized(tiny, "mxfp4-weight-only")
    export(model, tmp_path / "m.gguf", format="gguf", gguf_source=tiny, gguf_rest="f32")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf").eval()
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, model(ids).logits, rtol=0, atol=1e-5)
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    assert reader.fields["general.architecture"].contents() == family
    assert (
        reader.fields["tokenizer.ggml.tokens"].contents()
        == gguf.GGUFReader(tiny).fields["tokenizer.ggml.tokens"].contents()
    )
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_MXFP4_MOE
    record = json.loads(reader.fields["minifloat.quantization"].contents())["configs"]
    assert set(record.values()) == {"mxfp4-weight-only"} and len(record) == 7 * LAYERS


@pytest.mark.parametrize(("family", "config"), CASES)
def test_the_file_reads_back_with_its_codes_intact(request, tmp_path, config, family):
    tiny = request.getfixturevalue(FAMILIES[family])
    model, _ = _quantized(tiny, config)
    out = export(model, tmp_path / "m.gguf", format="gguf", gguf_source=tiny, gguf_rest="f32")
    back = load_model(out)
    pairs = [
        (a, b) for a, b in zip(model.modules(), back.modules(), strict=True) if isinstance(a, QuantizedLinear)
    ]
    assert len(pairs) == 7 * LAYERS and all(isinstance(b, QuantizedLinear) for _, b in pairs)
    for a, b in pairs:
        qa, qb = a.checkpoint_weight(), b.checkpoint_weight()
        n, k = qa.shape
        assert torch.equal(qa.data[:n, : k // 2], qb.data[:n, : k // 2]) and torch.equal(
            qa.scale[:n], qb.scale[:n]
        )
        assert b.config.name == config  # the file's record of the config, not a guess from the block type
        assert (qa.tensor_scale is None) == (qb.tensor_scale is None)
        if qa.tensor_scale is not None:
            assert qa.tensor_scale.item() == qb.tensor_scale.item()
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
        assert torch.equal(load_quantized(out)(ids).logits, model(ids).logits)


def test_the_rest_is_written_in_the_type_asked_and_norms_in_f32(tiny, tmp_path):
    model, _ = _quantized(tiny, "nvfp4-weight-only")
    for rest, want in (("q8_0", "Q8_0"), ("f16", "F16"), ("bf16", "BF16"), ("f32", "F32")):
        out = export(model, tmp_path / f"{rest}.gguf", format="gguf", gguf_source=tiny, gguf_rest=rest)
        t = _file_tensors(out)
        assert t["token_embd.weight"].tensor_type.name == want and t["output.weight"].tensor_type.name == want
        assert (
            t["blk.0.attn_norm.weight"].tensor_type.name == "F32"
            and t["blk.0.attn_q.scale"].tensor_type.name == "F32"
        )
        emb = model.model.embed_tokens.weight.detach().numpy()
        got = gguf.quants.dequantize(t["token_embd.weight"].data, t["token_embd.weight"].tensor_type)
        if (
            rest == "q8_0"
        ):  # Q8_0's published formula: per 32 values d = amax / 127, codes round(x / d), d kept in FP16
            blocks = emb.reshape(VOCAB, -1, 32)
            d = np.abs(blocks).max(-1, keepdims=True) / 127
            want = np.round(blocks / d) * d.astype(np.float16).astype(np.float32)
            np.testing.assert_allclose(got.reshape(blocks.shape), want, rtol=0, atol=1e-9)
        elif rest == "f32":
            assert np.array_equal(got, emb)


def test_a_layer_ggml_cannot_hold_stays_dense_and_a_direct_write_is_refused_naming_it(tmp_path):
    write_tiny_gguf(tmp_path / "t.gguf", inter=96)  # down_proj rows of 96: whole MXFP4 blocks, not NVFP4's 64
    model, summary = _quantized(tmp_path / "t.gguf", "nvfp4-weight-only")
    kept = {r.name: r.reason for r in summary.layers if r.reason and "gguf" in r.reason}
    assert set(kept) == {f"model.layers.{i}.mlp.down_proj" for i in range(LAYERS)}
    assert "not a multiple of ggml's 64-value NVFP4 block" in kept["model.layers.0.mlp.down_proj"]
    out = export(model, tmp_path / "m.gguf", format="gguf", gguf_source=tmp_path / "t.gguf")
    assert _file_tensors(out)["blk.0.ffn_down.weight"].tensor_type.name == "Q8_0"
    mx, _ = _quantized(tmp_path / "t.gguf", "mxfp4-weight-only")
    assert isinstance(mx.model.layers[0].mlp.down_proj, QuantizedLinear)

    model = load_model(tmp_path / "t.gguf")
    minifloat.quantize_model(model, "nvfp4-weight-only")  # not told the format: the layer is quantized anyway
    with pytest.raises(MinifloatError, match="model.layers.0.mlp.down_proj.*64-value NVFP4 block"):
        export(model, tmp_path / "x.gguf", format="gguf", gguf_source=tmp_path / "t.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_what_the_file_cannot_say_is_refused(tiny, tmp_path):
    model = load_model(tiny)
    minifloat.quantize_model(model, "fp8-weight-only")
    with pytest.raises(MinifloatError, match="ggml has no type for"):
        export(model, tmp_path / "a.gguf", format="gguf", gguf_source=tiny)
    model = load_model(tiny)
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight[3, 5] = float("nan")
    minifloat.quantize_model(model, "mxfp4-weight-only")
    with pytest.raises(MinifloatError, match=r"model.layers.1.self_attn.o_proj.*NaN"):
        export(model, tmp_path / "b.gguf", format="gguf", gguf_source=tiny)
    model = load_model(tiny)
    minifloat.quantize_model(model, "nvfp4-weight-only", method=minifloat.infer.ptq.method.resolve_method(
        "rtn", "nvfp4-weight-only", rotation="hadamard:16"), calibration=[torch.randint(0, VOCAB, (2, 16))])  # fmt: skip
    with pytest.raises(MinifloatError, match="transforms its input"):
        export(model, tmp_path / "c.gguf", format="gguf", gguf_source=tiny)
    with pytest.raises(MinifloatError, match="gguf_source"):
        export(model, tmp_path / "d.gguf", format="gguf")
    assert not list(tmp_path.glob("*.gguf"))


def test_the_command_line_writes_gguf_and_refuses_what_it_cannot_write(tiny, tmp_path, capsys):
    small = ["--calib-batches", "1", "--batch-size", "2", "--seq-len", "32"]
    out = tmp_path / "m.gguf"
    assert main(["quantize", str(tiny), "--scheme", "nvfp4-weight-only", "--method", "gptq", "--format", "gguf",
                 "--out", str(out), *small]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert f"checkpoint: {out}" in printed and "(hadamard:16); a checkpoint cannot hold that" in printed
    assert sum(t.tensor_type.name == "NVFP4" for t in _file_tensors(out).values()) == 7 * LAYERS
    assert (
        main(
            [
                "eval",
                str(out),
                "--reference",
                str(tiny),
                "--eval-batches",
                "1",
                "--batch-size",
                "2",
                "--seq-len",
                "32",
            ]
        )
        == 0
    )
    assert "Δppl" in capsys.readouterr().out
    for args, message in (
        (["--scheme", "nvfp4"], "quantizes activations, which a GGUF file cannot say"),
        (["--scheme", "fp8-block-weight-only"], "are no ggml type"),
        (["--scheme", "mxfp4-weight-only", "--rotate", "hadamard:32"], "rotation"),
    ):
        assert (
            main(
                ["quantize", str(tiny), "--format", "gguf", "--out", str(tmp_path / "x.gguf"), *args, *small]
            )
            == 2
        )
        assert message in capsys.readouterr().err
    hf = tmp_path / "hf"
    write_tiny_gguf(tmp_path / "again.gguf").save_pretrained(hf)
    assert (
        main(
            [
                "quantize",
                str(hf),
                "--scheme",
                "mxfp4-weight-only",
                "--format",
                "gguf",
                "--out",
                str(tmp_path / "x.gguf"),
            ]
        )
        == 2
    )
    assert "no tokenizer.json; a GGUF carries the tokenizer" in capsys.readouterr().err  # a folder without one
    (tmp_path / "plain.bin").write_bytes(b"0")
    assert main(["quantize", str(tmp_path / "plain.bin"), "--scheme", "mxfp4-weight-only", "--format", "gguf",
                 "--out", str(tmp_path / "x.gguf")]) == 2  # fmt: skip
    assert "GGUF or the transformers folder the model comes from" in capsys.readouterr().err
    assert (
        main(["quantize", str(tiny), "--scheme", "mxfp4-weight-only", "--format", "gguf", "--out", str(out)])
        == 2
    )
    assert "exists" in capsys.readouterr().err


@pytest.mark.llamacpp
@pytest.mark.parametrize(("family", "config"), [("llama", "mxfp4-weight-only"), ("llama", "nvfp4-weight-only"),
                                               ("qwen2", "mxfp4-weight-only")])  # fmt: skip
def test_llama_cpp_computes_with_the_weights_minifloat_wrote(request, tmp_path, config, family):
    """llama.cpp's logits of the file are minifloat's FP4 model's, up to its 8-bit activations:
    far closer to them than the FP4 model is to the float model it came from."""
    pytest.importorskip("llama_cpp")
    tiny = request.getfixturevalue(FAMILIES[family])
    model, _ = _quantized(tiny, config)
    out = export(model, tmp_path / "m.gguf", format="gguf", gguf_source=tiny, gguf_rest="f32")
    ref = load_model(tiny)
    ids = [5, 17, 100, 200, 33, 9, 250, 1, 64, 128, 7, 3]
    theirs = llama_cpp_logits(out, ids)
    with torch.no_grad():
        ours, full = model(torch.tensor([ids])).logits[0], ref(torch.tensor([ids])).logits[0]
    assert (theirs - ours).abs().max() < 0.3 * (full - ours).abs().max()
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))


def test_bench_llamacpp_says_how_to_get_llama_cpp_where_there_is_none(tiny, tmp_path, capsys, monkeypatch):
    from minifloat.measure import llamacpp

    monkeypatch.setenv("MINIFLOAT_LLAMACPP_PYTHON", str(tmp_path / "nowhere" / "python"))
    monkeypatch.setattr(llamacpp, "VENV", tmp_path / "venv")
    assert main(["bench", "llamacpp", str(tiny), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "no llama-cpp-python found" in err and "--build-venv" in err and "15 minutes" in err
    assert not (tmp_path / "b").exists()  # nothing started


@pytest.mark.llamacpp
def test_bench_llamacpp_measures_every_file_in_llama_cpp(tiny, tmp_path, capsys):
    import sys

    pytest.importorskip("llama_cpp")
    out = tmp_path / "b"
    assert main(["bench", "llamacpp", str(tiny), "--llamacpp-python", sys.executable, "--out", str(out), "--batch-size", "2",
                 "--seq-len", "32", "--eval-batches", "1", "--calib-batches", "1", "--new-tokens", "4", "--reps", "1",
                 "--methods", "rtn", "--configs", "mxfp4-weight-only,nvfp4-weight-only:*.down_proj", "--json"]) == 0  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    assert result == json.loads((out / "metrics.json").read_text())
    rows = {r["file"]: r for r in result["rows"]}
    assert list(rows) == ["llama.cpp F32", "llama.cpp Q8_0", "llama.cpp Q4_0", "llama.cpp Q4_K_M", "llama.cpp MXFP4",
                          "minifloat mxfp4-weight-only rtn", "minifloat nvfp4-weight-only rtn keep *.down_proj"]  # fmt: skip
    f32 = rows["llama.cpp F32"]
    assert f32["ppl"] == pytest.approx(result["minifloat_f32_ppl"], rel=1e-4)  # llama.cpp and minifloat agree on F32
    for r in rows.values():
        assert r["bits_per_weight"] == pytest.approx(Path(r["path"]).stat().st_size * 8 / result["parameters"])
        assert r["tokens_per_s"] > 0 and r["speed_vs_q4_0"] > 0
    kept = _file_tensors(rows["minifloat nvfp4-weight-only rtn keep *.down_proj"]["path"])
    assert kept["blk.0.ffn_down.weight"].tensor_type.name == "Q8_0" and kept["blk.0.ffn_up.weight"].tensor_type.name == "NVFP4"
    for name in ("minifloat mxfp4-weight-only rtn", "minifloat nvfp4-weight-only rtn keep *.down_proj"):
        assert abs(rows[name]["llamacpp_vs_minifloat_pct"]) < 1.0  # llama.cpp's reading of the file is minifloat's
        assert rows[name]["minifloat_q8_0_inputs_ppl"] > 0


def test_nvfp4_is_refused_where_llama_cpp_drops_its_tensor_scale(tiny_qwen2, tmp_path, capsys):
    model = load_model(tiny_qwen2)
    minifloat.quantize_model(model, "nvfp4-weight-only")
    with pytest.raises(MinifloatError, match="llama.cpp's qwen2 graph does not apply NVFP4's per-tensor scale"):
        export(model, tmp_path / "q.gguf", format="gguf", gguf_source=tiny_qwen2)
    assert main(["quantize", str(tiny_qwen2), "--scheme", "nvfp4-weight-only", "--format", "gguf", "--out",
                 str(tmp_path / "q.gguf")]) == 2  # fmt: skip
    assert "use mxfp4-weight-only for qwen2" in capsys.readouterr().err and not (tmp_path / "q.gguf").exists()


def test_an_architecture_transformers_converts_on_reading_is_refused_by_name():
    from minifloat.infer.checkpoints import gguf_file

    for arch in ("llama", "qwen2", "qwen3", "phi3", "gemma3", "gpt2", "qwen3moe", "qwen2moe"):
        gguf_file.check_arch(arch)  # read as written, or converted in a way the writer inverts (tests/families, test_gguf_moe)
    with pytest.raises(MinifloatError, match="'gpt_oss' is not supported: transformers converts its tensors"):
        gguf_file.check_arch("gpt_oss")  # its reader splits experts into names llama.cpp's files do not use


def test_q8_0_inputs_round_as_ggufs_own_q8_0():
    from minifloat.measure.llamacpp import q8_0_inputs

    x = torch.randn(5, 96) * torch.logspace(-3, 2, 96)
    x[1, :32] = 0  # an all-zero block stays zero
    want = gguf.quants.dequantize(gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0),
                                  gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
    np.testing.assert_array_equal(q8_0_inputs(x).numpy(), want)


def test_bench_decode_beside_llama_cpp_checks_for_it_first(tiny, tmp_path, capsys, monkeypatch):
    from minifloat.measure import llamacpp

    monkeypatch.setenv("MINIFLOAT_LLAMACPP_PYTHON", str(tmp_path / "nowhere" / "python"))
    monkeypatch.setattr(llamacpp, "VENV", tmp_path / "venv")
    assert main(["bench", "decode", str(tiny), "--llamacpp", "--out", str(tmp_path / "b")]) == 2
    assert "no llama-cpp-python found" in capsys.readouterr().err
    assert main(["bench", "decode", str(tmp_path / "a-transformers-folder"), "--llamacpp"]) == 2
    assert "from a .gguf model" in capsys.readouterr().err


@pytest.mark.llamacpp
def test_bench_decode_times_llama_cpp_beside_minifloat(tiny, tmp_path, capsys):
    """The same prompts through minifloat's fused step and llama.cpp's own F32 and Q4_0 files, each row with its pair."""
    pytest.importorskip("llama_cpp")
    assert main(["bench", "decode", str(tiny), "--llamacpp", "--llamacpp-python", sys.executable, "--out", str(tmp_path / "b"),
                 "--weights", "fp32,nvfp4-weight-only", "--decode-steps", "fused", "--drafts", "", "--kv-formats", "",
                 "--gemv", "", "--windows", "2", "--new-tokens", "6", "--reps", "1", "--verify-rows", "1,4",
                 "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)["weights"]
    assert [r["file"] for r in out["llamacpp"]] == ["F32", "Q4_0"] and all(r["tokens_per_s"] > 0 for r in out["llamacpp"])
    fp32, fp4 = out["runs"]
    assert (fp32["llamacpp_file"], fp4["llamacpp_file"]) == ("F32", "Q4_0")
    assert fp32["vs_llamacpp"] == fp32["tokens_per_s"] / out["llamacpp"][0]["tokens_per_s"]
    assert fp4["decode_step"] == "fused" and fp4["vs_llamacpp"] > 0
    rows = {(r["of"], r["rows"]) for r in out["verify"]}  # the same verification forward in llama.cpp's files
    assert {("llama.cpp F32", 4), ("llama.cpp Q4_0", 4), ("nvfp4-weight-only fused", 4)} <= rows
    assert all(r["ms"] > 0 for r in out["verify"])


@pytest.mark.parametrize("package", ["gguf", "transformers"])
def test_writing_gguf_without_its_packages_says_which_extra(tiny, tmp_path, capsys, monkeypatch, package):
    """A plain `pip install minifloat` has neither: one line naming the extra, before any work."""
    monkeypatch.setitem(sys.modules, package, None)  # `import` raises ImportError, as where it is not installed
    for extra in ([], ["--budget-bits", "6"]):
        capsys.readouterr()
        assert main(["quantize", str(tiny), "--scheme", "nvfp4-weight-only", "--format", "gguf", "--out",
                     str(tmp_path / "m.gguf"), *extra]) == 2  # fmt: skip
        err = capsys.readouterr().err
        assert "Traceback" not in err and f"({package} is missing): pip install 'minifloat[gguf]'" in err
    assert not (tmp_path / "m.gguf").exists()
