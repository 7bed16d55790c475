"""GGUF files of a mixture-of-experts model (Qwen3-MoE, from a transformers folder): every expert
packed as ggml's MXFP4 / NVFP4 blocks in llama.cpp's stacked ``ffn_{gate,up,down}_exps`` tensors
(NVFP4's per-expert tensor scales in one ``.scale`` of n_expert values). Oracles: `gguf`'s own
dequantization of each expert's slice, transformers' GGUF reader (the file read as the model
quantized in memory), llama.cpp where it is installed."""

import numpy as np
import pytest
import torch

import minifloat
from minifloat.cli import main
from minifloat.errors import MinifloatError
from minifloat.infer import QuantizedLinear, load_model
from minifloat.infer.checkpoints.export import export
from minifloat.models.loading import gguf_config
from tests.families.tiny import EXPERTS, moe_config
from tests.gguf_writer import llama_cpp_logits

from .test_gguf_from_folder import bpe_tokenizer

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

CONFIGS = ("mxfp4-weight-only", "nvfp4-weight-only")
PROJ = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def qwen3moe_folder(path, **changes):
    """A tiny random Qwen3-MoE (8 experts of 64, top 2, routing weights renormalized as llama.cpp's
    graph computes them) with a byte-level BPE tokenizer."""
    tokenizer = bpe_tokenizer("qwen2")
    cfg = moe_config("qwen3moe", len(tokenizer))
    cfg.norm_topk_prob = True
    for k, v in changes.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return qwen3moe_folder(tmp_path_factory.mktemp("qwen3moe") / "model")


@pytest.fixture(scope="module", params=CONFIGS)
def written(request, folder, tmp_path_factory):
    """(config, the model quantized in memory, the file `minifloat quantize` wrote from the folder)."""
    out = tmp_path_factory.mktemp("qwen3moe-gguf") / "m.gguf"
    assert main(["quantize", str(folder), "--scheme", request.param, "--format", "gguf", "--gguf-rest", "f32",
                 "--out", str(out)]) == 0  # fmt: skip
    model = load_model(folder)
    minifloat.quantize_model(model, request.param, export_format="gguf")
    return request.param, model, out


def test_every_expert_is_its_slice_of_the_stacked_tensor_as_gguf_dequantizes_it(written):
    config, model, out = written
    reader = gguf.GGUFReader(out)
    tensors = {t.name: t for t in reader.tensors}
    assert reader.fields["general.architecture"].contents() == "qwen3moe"
    assert reader.fields["qwen3moe.expert_count"].contents() == EXPERTS
    assert reader.fields["qwen3moe.expert_used_count"].contents() == 2
    assert reader.fields["qwen3moe.expert_feed_forward_length"].contents() == 64
    seen = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, QuantizedLinear) or ".experts." not in name:
            continue
        parts = name.split(".")  # model.layers.L.mlp.experts.E.proj
        g = f"blk.{parts[2]}.{PROJ[parts[6]]}"
        t, e = tensors[f"{g}.weight"], int(parts[5])
        assert t.tensor_type.name == ("MXFP4" if config.startswith("mx") else "NVFP4")
        assert tuple(int(x) for x in reversed(t.shape)) == (EXPERTS, *layer.checkpoint_weight().shape)
        got = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())[e]
        q = layer.checkpoint_weight()
        if q.tensor_scale is not None:  # llama.cpp multiplies expert e's product by .scale[e]
            scale = np.asarray(tensors[f"{g}.scale"].data, dtype=np.float32).reshape(-1)
            assert scale.shape == (EXPERTS,) and scale[e] == q.tensor_scale.item()
            q = minifloat.QuantizedTensor(q.data, q.scale, torch.tensor(1.0), q.shape, q.scheme)
        assert not torch.isnan(got).any()
        assert torch.equal(got, q.dequantize()), name
        seen += 1
    assert seen == 2 * EXPERTS * 3
    router = model.model.layers[0].mlp.gate.weight.detach()  # the router stays in high precision
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
    assert np.array_equal(np.asarray(tensors["blk.0.ffn_gate_inp.weight"].data), router.numpy())


def test_the_file_reads_back_with_every_experts_codes_intact(written):
    config, model, out = written
    back = load_model(out)
    pairs = [(n, a, back.get_submodule(n)) for n, a in model.named_modules() if isinstance(a, QuantizedLinear)]
    assert sum(".experts." in n for n, _, _ in pairs) == 2 * EXPERTS * 3
    for name, a, b in pairs:
        assert isinstance(b, QuantizedLinear) and b.config.name == config, name
        qa, qb = a.checkpoint_weight(), b.checkpoint_weight()
        assert torch.equal(qa.data, qb.data) and torch.equal(qa.scale, qb.scale), name
        assert (qa.tensor_scale is None) == (qb.tensor_scale is None)
        if qa.tensor_scale is not None:
            assert qa.tensor_scale.item() == qb.tensor_scale.item()
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)


def test_transformers_reads_the_file_as_the_model_quantized_in_memory(written):
    """transformers' own reader of the stacked experts (its Qwen-MoE tensor processor) with the
    config the file says (its reader takes no expert width: `gguf_config` reads it): MXFP4, where
    no tensor scale is left for transformers to drop."""
    config, model, out = written
    if config != "mxfp4-weight-only":
        pytest.skip("transformers' reader does not apply NVFP4's .scale tensors")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out.parent, gguf_file=out.name,
                                                                config=gguf_config(out)).eval()  # fmt: skip
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.llamacpp
def test_llama_cpp_computes_with_the_experts_minifloat_wrote(written, folder):
    """llama.cpp's logits of the file are the FP4 model's up to its 8-bit activations, position by
    position far closer to them than the FP4 model is to the float one — but where those 8 bits tip
    a token to another expert (routing is a top-k: a step, not a slope), as at one or two of these
    16 positions (seen: 0.39 there against 0.02–0.04 elsewhere)."""
    pytest.importorskip("llama_cpp")
    config, model, out = written
    ids = [5, 17, 100, 200, 33, 9, 250, 1, 64, 128, 7, 3, 77, 210, 40, 2]
    theirs = llama_cpp_logits(out, ids)
    with torch.no_grad():
        ours = model(torch.tensor([ids])).logits[0]
        full = load_model(folder)(torch.tensor([ids])).logits[0]
    close = (theirs - ours).abs().amax(-1) < 0.3 * (full - ours).abs().amax(-1)
    assert close.sum() >= len(ids) - 2, close
    assert (theirs.argmax(-1) == ours.argmax(-1)).sum() >= len(ids) - 2


def test_what_llama_cpps_qwen3moe_graph_would_compute_otherwise_is_refused(tmp_path, capsys):
    args = ["--scheme", "mxfp4-weight-only", "--format", "gguf", "--out", str(tmp_path / "x.gguf")]
    plain = qwen3moe_folder(tmp_path / "plain", norm_topk_prob=False)
    assert main(["quantize", str(plain), *args]) == 2
    assert "norm_topk_prob is false" in capsys.readouterr().err
    dense = qwen3moe_folder(tmp_path / "dense", mlp_only_layers=[1])
    assert main(["quantize", str(dense), *args]) == 2
    assert "dense MLP layers among the MoE ones" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()


def test_a_layers_experts_quantized_unalike_are_refused_naming_the_tensor(folder, tmp_path):
    model = load_model(folder)
    minifloat.quantize_model(model, "mxfp4-weight-only", ignore=["*.layers.0.mlp.experts.3.*"])
    with pytest.raises(MinifloatError, match=r"blk\.0\.ffn_(gate|up|down)_exps.weight: experts \[3\] of 8 are not quantized"):
        export(model, tmp_path / "m.gguf", format="gguf", gguf_source=folder)
    assert not (tmp_path / "m.gguf").exists()


def test_experts_kept_in_high_precision_are_written_stacked_and_read_back(folder, tmp_path):
    """Every expert kept (an ignore pattern naming them all): the stacked tensors in the rest type,
    each expert read back as its slice, the attention layers in MXFP4 beside them."""
    model = load_model(folder)
    minifloat.quantize_model(model, "mxfp4-weight-only", ignore=["*.experts.*", "lm_head"])
    out = export(model, tmp_path / "m.gguf", format="gguf", gguf_source=folder, gguf_rest="f32")
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    assert tensors["blk.1.ffn_down_exps.weight"].tensor_type.name == "F32"
    assert tensors["blk.1.attn_q.weight"].tensor_type.name == "MXFP4"
    back = load_model(out)
    want = model.model.layers[1].mlp.experts[5].down_proj.weight
    assert torch.equal(back.model.layers[1].mlp.experts[5].down_proj.weight, want)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
