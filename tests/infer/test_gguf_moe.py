"""GGUF files of mixture-of-experts models (Qwen3-MoE, Qwen2-MoE with its shared expert, from a
transformers folder): every expert
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

# the FP4 configs each family's file is written in (llama.cpp's qwen2moe graph applies no NVFP4 tensor scale)
FAMILIES = {"qwen3moe": ("mxfp4-weight-only", "nvfp4-weight-only"), "qwen2moe": ("mxfp4-weight-only",)}
CASES = [(f, c) for f, configs in FAMILIES.items() for c in configs]
PROJ = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
NORM_TOPK = {"qwen3moe": True, "qwen2moe": False}  # what llama.cpp's graph of each does with the top-k weights


def moe_folder(path, family: str = "qwen3moe", **changes):
    """A tiny random Qwen3-MoE or Qwen2-MoE (8 experts of 64, top 2; Qwen2-MoE's shared expert of
    128 and its gate; routing weights renormalized or not as llama.cpp's graph of each computes
    them) with a byte-level BPE tokenizer."""
    tokenizer = bpe_tokenizer("qwen2")
    if family == "qwen3moe":
        cfg = moe_config("qwen3moe", len(tokenizer))
    else:
        cfg = transformers.Qwen2MoeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                                          num_experts_per_tok=2, num_experts=EXPERTS, moe_intermediate_size=64,
                                          shared_expert_intermediate_size=128)  # fmt: skip
    cfg.norm_topk_prob = NORM_TOPK[family]
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


_FOLDERS: dict = {}


def _family_folder(family, tmp_path_factory):
    if family not in _FOLDERS:
        _FOLDERS[family] = moe_folder(tmp_path_factory.mktemp(family) / "model", family)
    return _FOLDERS[family]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return _family_folder("qwen3moe", tmp_path_factory)


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(c))
def written(request, tmp_path_factory):
    """(family, config, the model quantized in memory, the file `minifloat quantize` wrote from the folder)."""
    family, config = request.param
    src = _family_folder(family, tmp_path_factory)
    out = tmp_path_factory.mktemp(f"{family}-gguf") / "m.gguf"
    assert main(["quantize", str(src), "--scheme", config, "--format", "gguf", "--gguf-rest", "f32",
                 "--out", str(out)]) == 0  # fmt: skip
    model = load_model(src)
    minifloat.quantize_model(model, config, export_format="gguf")
    return family, config, model, out


def test_every_expert_is_its_slice_of_the_stacked_tensor_as_gguf_dequantizes_it(written):
    family, config, model, out = written
    reader = gguf.GGUFReader(out)
    tensors = {t.name: t for t in reader.tensors}
    assert reader.fields["general.architecture"].contents() == family
    assert reader.fields[f"{family}.expert_count"].contents() == EXPERTS
    assert reader.fields[f"{family}.expert_used_count"].contents() == 2
    assert reader.fields[f"{family}.expert_feed_forward_length"].contents() == 64
    if family == "qwen2moe":  # the shared expert: its width, its Linears packed, its gate one row of F32
        assert reader.fields["qwen2moe.expert_shared_feed_forward_length"].contents() == 128
        assert tensors["blk.0.ffn_up_shexp.weight"].tensor_type.name == "MXFP4"
        gate = model.model.layers[0].mlp.shared_expert_gate.weight.detach()
        assert tuple(tensors["blk.0.ffn_gate_inp_shexp.weight"].shape) == (64,)
        assert np.array_equal(np.asarray(tensors["blk.0.ffn_gate_inp_shexp.weight"].data), gate.reshape(-1).numpy())
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
    _, config, model, out = written
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
    _, config, model, out = written
    if config != "mxfp4-weight-only":
        pytest.skip("transformers' reader does not apply NVFP4's .scale tensors")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out.parent, gguf_file=out.name,
                                                                config=gguf_config(out)).eval()  # fmt: skip
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.llamacpp
def test_llama_cpp_computes_with_the_experts_minifloat_wrote(written, tmp_path_factory):
    """llama.cpp's logits of the file are the FP4 model's up to its 8-bit activations, position by
    position far closer to them than the FP4 model is to the float one — but where those 8 bits tip
    a token to another expert (routing is a top-k: a step, not a slope), as at one or two of these
    16 positions (seen: 0.39 there against 0.02–0.04 elsewhere)."""
    pytest.importorskip("llama_cpp")
    family, _, model, out = written
    folder = _family_folder(family, tmp_path_factory)
    ids = [5, 17, 100, 200, 33, 9, 250, 1, 64, 128, 7, 3, 77, 210, 40, 2]
    theirs = llama_cpp_logits(out, ids)
    with torch.no_grad():
        ours = model(torch.tensor([ids])).logits[0]
        full = load_model(folder)(torch.tensor([ids])).logits[0]
    close = (theirs - ours).abs().amax(-1) < 0.3 * (full - ours).abs().amax(-1)
    assert close.sum() >= len(ids) - 2, close
    assert (theirs.argmax(-1) == ours.argmax(-1)).sum() >= len(ids) - 2


@pytest.mark.parametrize("family", FAMILIES)
def test_what_llama_cpps_moe_graph_would_compute_otherwise_is_refused(family, tmp_path, capsys):
    args = ["--scheme", "mxfp4-weight-only", "--format", "gguf", "--out", str(tmp_path / "x.gguf")]
    other = moe_folder(tmp_path / "other", family, norm_topk_prob=not NORM_TOPK[family])
    assert main(["quantize", str(other), *args]) == 2
    assert f"norm_topk_prob is {str(not NORM_TOPK[family]).lower()}" in capsys.readouterr().err
    dense = moe_folder(tmp_path / "dense", family, mlp_only_layers=[1])
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
