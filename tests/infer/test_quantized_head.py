"""The LM head and the input embedding, quantized weight-only (`quantize_head=True`): a tied pair
stays one packed table whose lookup decodes only the rows it reads; an untied embedding gets its
own. Checked against the dequantized table (the float model holding those exact values), and the
export against transformers + compressed-tensors, the real reader."""

import copy

import pytest
import torch

import minifloat
from minifloat import SCHEMES
from minifloat.infer import (
    QuantizedLinear,
    bits_per_weight,
    export,
    load_quantized,
    model_bytes,
    quantize_model,
)
from minifloat.infer.modules.embedding import QuantizedEmbedding
from minifloat.infer.ptq.config import weight_only
from minifloat.quant import dequantize_rows, quantize
from tests.reachable import reachable_storage_bytes


@pytest.mark.parametrize("name", list(SCHEMES))
def test_dequantize_rows_equals_the_rows_of_the_dequantized_table(name):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 70, generator=g) * torch.exp(torch.randn(300, 70, generator=g) * 2)
    x[5, 3] = float("nan")  # NaN poisons its block (or row, or tensor) in the table: and in the rows read
    q = quantize(x, name)
    ids = torch.tensor([[0, 5, 299], [128, 5, 17]])  # rows of different 128-row blocks, a repeat
    got, want = dequantize_rows(q, ids), q.dequantize()[ids.reshape(-1)]
    assert torch.equal(got.nan_to_num(1234.5), want.nan_to_num(1234.5)) and torch.equal(got.isnan(), want.isnan())


def test_dequantize_rows_refuses_bad_indices():
    q = quantize(torch.randn(10, 32), "mxfp8")
    with pytest.raises(minifloat.MinifloatError, match="the table has 10 rows, got indices 0 … 10"):
        dequantize_rows(q, torch.tensor([0, 10]))
    with pytest.raises(minifloat.MinifloatError, match="row indices must be integers"):
        dequantize_rows(q, torch.tensor([0.0]))


transformers = pytest.importorskip("transformers")
IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))


def llama(tied: bool):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=192, intermediate_size=320, num_hidden_layers=2,
                                   num_attention_heads=3, num_key_value_heads=1, head_dim=64, max_position_embeddings=64,
                                   tie_word_embeddings=tied)  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def dense_copy(model):
    """The model as floats: every QuantizedLinear a Linear holding its dequantized weight, the
    embedding the dequantized table (tied to the head again when it was)."""
    plain = copy.deepcopy(model)
    for name, m in list(plain.named_modules()):
        parent, _, child = name.rpartition(".")
        if isinstance(m, QuantizedLinear):
            lin = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
            with torch.no_grad():
                lin.weight.copy_(m.weight.dequantize())
            setattr(plain.get_submodule(parent), child, lin)
    for name, m in list(plain.named_modules()):
        if isinstance(m, QuantizedEmbedding):
            parent, _, child = name.rpartition(".")
            emb = torch.nn.Embedding(m.num_embeddings, m.embedding_dim)
            with torch.no_grad():
                emb.weight.copy_(m.weight.dequantize())
            setattr(plain.get_submodule(parent), child, emb)
    return plain


@pytest.mark.parametrize("name", ["fp8-dynamic", "fp8-block", "mxfp8", "mxfp4-weight-only", "nvfp4-weight-only", "nvfp4"])
def test_a_tied_head_and_embedding_are_one_packed_table(name):
    model = llama(tied=True)
    float_bytes = model_bytes(model)
    summary = quantize_model(model, name, calibration=[IDS], quantize_head=True)
    head, emb = model.lm_head, model.model.embed_tokens
    assert isinstance(head, QuantizedLinear) and head.config == weight_only(name) and head.config.activation is None
    assert isinstance(emb, QuantizedEmbedding) and emb.tied_to is head and emb.packed_nbytes() == 0
    assert emb.weight.data.data_ptr() == head.weight.data.data_ptr()  # one table
    rows = {s.name: s for s in summary.layers}
    assert rows["lm_head"].scheme == head.config.weight and rows["model.embed_tokens"].note.startswith("tied")
    # no float table is left anywhere: what the model reaches is what model_bytes counts
    assert reachable_storage_bytes(model) == model_bytes(model) < float_bytes / 2
    dense = dense_copy(model)
    with torch.no_grad():
        # the lookup is the dequantized table's rows, exactly
        assert torch.equal(emb(IDS), dense.model.embed_tokens(IDS))
        if head.config.activation is None and summary.config.activation is None:  # weight-only throughout
            torch.testing.assert_close(model(IDS).logits, dense(IDS).logits, rtol=1e-5, atol=1e-5)
        else:  # the head alone: its logits are the dequantized table's
            h = torch.randn(3, 192)
            torch.testing.assert_close(head(h), h @ dense.lm_head.weight.T, rtol=1e-5, atol=1e-5)


def test_an_untied_embedding_gets_its_own_table_in_the_heads_scheme():
    model = llama(tied=False)
    quantize_model(model, "mxfp8", quantize_head=True)
    head, emb = model.lm_head, model.model.embed_tokens
    assert emb.tied_to is None and emb.weight.scheme == head.weight.scheme
    assert emb.packed_nbytes() == 256 * 192 + 256 * 192 // 32  # E4M3 codes + one E8M0 scale per 32
    with torch.no_grad():
        assert torch.equal(emb(IDS), emb.weight.dequantize()[IDS])
    assert bits_per_weight(model, head=True, embedding=True) == pytest.approx(8.25)
    assert model.to(torch.bfloat16).model.embed_tokens(IDS).dtype == torch.bfloat16  # the lookup's dtype follows
    assert emb.weight_scale.dtype == torch.uint8 and emb.weight.scheme.is_mx


@pytest.mark.parametrize("name", ["fp8-block", "mxfp8", "nvfp4-weight-only"])
def test_a_quantized_tied_head_exports_as_the_readers_expect(name, tmp_path):
    pytest.importorskip("compressed_tensors")
    import json

    from tests.infer.test_export import read_with_transformers

    model = llama(tied=True)
    quantize_model(model, name, calibration=[IDS], quantize_head=True)
    out = export(model, tmp_path / "ckpt")
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert config["tie_word_embeddings"] is False and qc["ignore"] == []  # the head is quantized, untied
    hf = read_with_transformers(out, "compressed-tensors")
    sd = hf.state_dict()
    want = model.lm_head.weight.dequantize()
    if model.lm_head.weight.scheme.is_nvfp4:  # compressed-tensors rounds code × (scale / global) to bf16
        assert (sd["lm_head.weight"].float() == want.bfloat16().float()).float().mean() > 0.99
    else:
        assert torch.equal(sd["lm_head.weight"].float(), want)
    assert torch.equal(sd["model.embed_tokens.weight"], model.model.embed_tokens.weight.dequantize())
    with torch.no_grad():
        if not model.lm_head.weight.scheme.is_nvfp4:
            assert torch.equal(hf(IDS).logits, dense_copy(model)(IDS).logits)
        back = load_quantized(out)
        assert isinstance(back.lm_head, QuantizedLinear)
        assert torch.equal(back(IDS).logits, model(IDS).logits)


def test_the_built_in_gpt_head_and_its_tied_embedding():
    from tests.infer.test_generate import gpt, prompt

    model = gpt()
    summary = quantize_model(model, "nvfp4-weight-only", quantize_head=True)
    assert isinstance(model.wte, QuantizedEmbedding) and model.wte.tied_to is model.lm_head
    assert "Linears and the input embedding quantized" in str(summary)
    g = minifloat.infer.generate(model, prompt(0), 4)
    assert g.new_tokens == 4


def test_quantize_head_from_the_command_line(tmp_path, capsys):
    pytest.importorskip("compressed_tensors")
    from minifloat.cli import main

    folder = tmp_path / "m"
    llama(tied=True).save_pretrained(folder)
    data = tmp_path / "text.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 400)
    assert main(["quantize", str(folder), "--scheme", "mxfp8", "--quantize-head", "--calib", str(data),
                 "--out", str(tmp_path / "q")]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "15 of 15 Linears and the input embedding quantized" in printed
    assert main(["eval", str(folder), "--quantize-head", "--data", str(data)]) == 2
    assert "--quantize-head goes with --scheme" in capsys.readouterr().err
