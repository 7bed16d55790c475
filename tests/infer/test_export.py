"""Serving checkpoints, proven with the real readers: transformers + compressed-tensors (and
transformers' fine-grained FP8) load every exported folder; each weight they dequantize equals
minifloat's bit for bit, and their logits equal those of the model run on those weights."""

import copy
import dataclasses
import json

import ml_dtypes
import numpy as np
import pytest
import torch

import minifloat
from minifloat.infer import (
    QUANT_CONFIGS,
    QuantizedLinear,
    export,
    get_quant_config,
    load_quantized,
    quantize_model,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")


def tiny_llama(hidden=256, inter=384, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    # built in its dtype, as from_pretrained builds it (the rotary frequencies stay float32)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))


def dequantized_copy(model):
    """The model with every QuantizedLinear replaced by a plain Linear holding its dequantized weight."""
    plain = copy.deepcopy(model)
    for name, m in list(plain.named_modules()):
        if isinstance(m, QuantizedLinear):
            lin = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, dtype=m.weight.dtype)
            with torch.no_grad():
                lin.weight.copy_(m.weight.dequantize(torch.float32))
                if m.bias is not None:
                    lin.bias.copy_(m.bias)
            parent, _, child = name.rpartition(".")
            setattr(plain.get_submodule(parent), child, lin)
    return plain


def read_with_transformers(folder, fmt):
    if fmt == "hf-fp8":
        qc = transformers.FineGrainedFP8Config(dequantize=True)
    else:
        qc = transformers.utils.quantization_config.CompressedTensorsConfig(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=qc).eval()


@pytest.mark.parametrize("name", [*(n for n in QUANT_CONFIGS if "fnuz" not in n), "nvfp4-pow2", "nvfp4-weight-only-pow2"])
def test_compressed_tensors_export_is_read_bit_exactly_by_transformers(name, tmp_path):
    model = tiny_llama()
    if name.endswith("-pow2"):  # a power-of-two global scale: exact in every reader
        name = dataclasses.replace(QUANT_CONFIGS[name.removesuffix("-pow2")], pow2_global_scale=True)
    quantize_model(model, name, calibration=[IDS])
    out = export(model, tmp_path / "ckpt")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["ignore"] == ["lm_head"]
    hf = read_with_transformers(out, "compressed-tensors")
    sd = hf.state_dict()
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert len(layers) == 14
    nvfp4 = get_quant_config(name).weight_scheme.is_nvfp4
    for n, m in layers.items():
        mine, theirs = m.weight.dequantize(torch.float32), sd[f"{n}.weight"].float()
        if not nvfp4:
            assert torch.equal(theirs, mine), n
        else:  # compressed-tensors: bf16(code × (scale / global)); minifloat: float32 code × scale × (1 / global)
            ulp = torch.finfo(torch.bfloat16).eps * mine.abs()
            assert ((theirs - mine).abs() <= ulp).all() and (theirs == mine.bfloat16().float()).float().mean() > 0.99
    with torch.no_grad():
        want = dequantized_copy(model)(IDS).logits
        if not nvfp4:
            assert torch.equal(hf(IDS).logits, want)
        # and minifloat's own reader gives back the same quantized model
        back = load_quantized(out)
        assert torch.equal(back(IDS).logits, model(IDS).logits)
    assert sum(isinstance(m, QuantizedLinear) for m in back.modules()) == 14


def test_the_tensors_follow_compressed_tensors_conventions(tmp_path):
    """NVFP4 as compressed-tensors defines it, checked against ml_dtypes: weight_packed with the
    even column in the low nibble, weight_scale E4M3 (N, K/16), weight_global_scale stored
    inverted (value = e2m1 × e4m3 / global)."""
    from safetensors.torch import load_file

    model = tiny_llama(hidden=128, inter=256)
    quantize_model(model, "nvfp4", calibration=[IDS])
    out = export(model, tmp_path / "nv")
    t = load_file(str(out / "model.safetensors"))
    p = "model.layers.0.mlp.down_proj"
    packed, scale, g = t[f"{p}.weight_packed"], t[f"{p}.weight_scale"], t[f"{p}.weight_global_scale"]
    assert packed.dtype == torch.uint8 and packed.shape == (128, 128)
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (128, 16)
    assert g.dtype == torch.float32 and g.shape == (1,) and f"{p}.input_global_scale" in t
    nib = packed.numpy()
    codes = np.stack([nib & 0xF, nib >> 4], axis=-1).reshape(128, 256)
    vals = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    block = scale.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    want = vals * np.repeat(block, 16, axis=1) / float(g)
    got = model.get_submodule(p).weight.dequantize().double().numpy()
    np.testing.assert_allclose(got, want, rtol=2.0**-22, atol=0)  # float32: code × (scale × 1 / global), two roundings


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_fp8_export_is_read_by_transformers_fine_grained_fp8(dtype, tmp_path):
    model = tiny_llama(dtype=dtype)
    quantize_model(model, "fp8-block")
    out = export(model, tmp_path / "fp8", format="hf-fp8")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}  # fmt: skip
    hf = read_with_transformers(out, "hf-fp8")
    sd = hf.state_dict()
    for n, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            assert torch.equal(sd[f"{n}.weight"], m.weight.dequantize(torch.float32).to(sd[f"{n}.weight"].dtype)), n
    with torch.no_grad():
        assert torch.equal(hf(IDS).logits, dequantized_copy(model)(IDS).logits)
        assert torch.equal(load_quantized(out)(IDS).logits, model(IDS).logits)


def deepseek_style_checkpoint(folder, *, drop=None, bad_shape=None, bad_dtype=None, hidden=256, inter=384):
    """An FP8 checkpoint written the way DeepSeek-V3's are, without minifloat: per Linear
    ``weight`` float8_e4m3fn and ``weight_scale_inv`` float32 per 128×128 block (multiplied on
    dequantize), quantized here with ml_dtypes; returns the float64 weights they stand for."""
    from safetensors.torch import save_file

    model = tiny_llama(hidden=hidden, inter=inter, seed=5)
    tensors, want = {}, {}
    for name, t in model.state_dict().items():
        mod = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and isinstance(model.get_submodule(mod), torch.nn.Linear) and mod != "lm_head":
            w = t.double().numpy()
            n, k = w.shape
            gr, gc = -(-n // 128), -(-k // 128)
            amax = np.abs(np.pad(w, ((0, gr * 128 - n), (0, gc * 128 - k)))).reshape(gr, 128, gc, 128).max(axis=(1, 3))
            sinv = (amax / 448.0).astype(np.float32)
            full = np.repeat(np.repeat(sinv, 128, 0), 128, 1)[:n, :k].astype(np.float64)
            codes = (w / full).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
            tensors[name] = torch.from_numpy(codes.view(np.uint8).copy()).view(torch.float8_e4m3fn)
            tensors[f"{mod}.weight_scale_inv"] = torch.from_numpy(sinv)
            want[mod] = (codes.astype(np.float64) * full).astype(np.float32)  # one float32 rounding of the product
        else:
            tensors[name] = t.contiguous()
    if drop:
        tensors.pop(drop)
    if bad_shape:
        tensors[bad_shape] = tensors[bad_shape][:1].contiguous()
    if bad_dtype:
        tensors[bad_dtype] = tensors[bad_dtype].double()
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    config = model.config.to_dict() | {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                       "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, default=str))
    return want


@pytest.mark.parametrize("dims", [(256, 384), (192, 328)])  # whole blocks; partial last blocks (⌈N/128⌉ × ⌈K/128⌉)
def test_import_of_a_deepseek_style_fp8_checkpoint(tmp_path, dims):
    want = deepseek_style_checkpoint(tmp_path / "ds", hidden=dims[0], inter=dims[1])
    model = load_quantized(tmp_path / "ds")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert set(layers) == set(want)
    for n, m in layers.items():
        assert m.config.name == "fp8-block"
        np.testing.assert_array_equal(m.weight.dequantize().numpy(), want[n])
    with torch.no_grad():
        assert torch.isfinite(model(IDS).logits).all()


@pytest.mark.parametrize(
    ("kw", "message"),
    [(dict(drop="model.layers.0.mlp.up_proj.weight_scale_inv"), "'model.layers.0.mlp.up_proj.weight_scale_inv' is missing"),
     (dict(bad_shape="model.layers.1.self_attn.q_proj.weight_scale_inv"),
      r"'model.layers.1.self_attn.q_proj.weight_scale_inv' has shape \(1, 2\); expected \(2, 2\)"),
     (dict(bad_dtype="model.layers.0.mlp.down_proj.weight_scale_inv"),
      "'model.layers.0.mlp.down_proj.weight_scale_inv' is torch.float64; expected torch.float32")],
)  # fmt: skip
def test_malformed_checkpoints_name_the_tensor(tmp_path, kw, message):
    deepseek_style_checkpoint(tmp_path / "bad", **kw)
    with pytest.raises(minifloat.MinifloatError, match=message):
        load_quantized(tmp_path / "bad")


def test_unknown_formats_are_clear_errors(tmp_path):
    model = tiny_llama(hidden=128, inter=256)
    quantize_model(model, "mxfp8")
    out = export(model, tmp_path / "m")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 3
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(minifloat.MinifloatError, match="no minifloat scheme matches the checkpoint's scheme"):
        load_quantized(out)
    config["quantization_config"] = {"quant_method": "gptq"}
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(minifloat.MinifloatError, match="quant_method='gptq'"):
        load_quantized(out)
    with pytest.raises(minifloat.MinifloatError, match="no config.json"):
        load_quantized(tmp_path)


def test_sharded_export_has_an_index_and_loads(tmp_path):
    model = tiny_llama(hidden=128, inter=256)
    quantize_model(model, "fp8-dynamic")
    out = export(model, tmp_path / "sharded", max_shard_bytes=100_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    hf = read_with_transformers(out, "compressed-tensors")
    with torch.no_grad():
        assert torch.equal(hf(IDS).logits, dequantized_copy(model)(IDS).logits)
        assert torch.equal(load_quantized(out)(IDS).logits, model(IDS).logits)


def test_tokenizer_files_and_config_fields_come_along(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "tokenizer.json").write_text('{"version": "1.0"}')
    (source / "tokenizer_config.json").write_text("{}")
    model = tiny_llama(hidden=128, inter=256)
    model.config._name_or_path = str(source)
    model.config.my_field = "kept"
    quantize_model(model, "fp8-dynamic")
    out = export(model, tmp_path / "out")
    assert (out / "tokenizer.json").read_text() == '{"version": "1.0"}' and (out / "tokenizer_config.json").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["my_field"] == "kept" and config["hidden_size"] == 128
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:  # what stays dense keeps the model's dtype
        assert f.get_slice("model.norm.weight").get_dtype() == "F32"
        assert f.get_slice("model.layers.0.mlp.up_proj.weight").get_dtype() == "F8_E4M3"


def test_export_is_atomic_and_does_not_overwrite_by_accident(tmp_path):
    model = tiny_llama(hidden=128, inter=256)
    with pytest.raises(minifloat.MinifloatError, match="no QuantizedLinear: run minifloat.quantize_model"):
        export(model, tmp_path / "a")
    quantize_model(model, "mxfp8")
    export(model, tmp_path / "a")
    with pytest.raises(minifloat.MinifloatError, match="exists; pass overwrite=True"):
        export(model, tmp_path / "a")
    export(model, tmp_path / "a", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no temporary folder left behind
    with pytest.raises(minifloat.MinifloatError, match="format 'hf-fp8' holds fp8-block layers"):
        export(model, tmp_path / "b", format="hf-fp8")
    assert not (tmp_path / "b").exists()
    with pytest.raises(minifloat.MinifloatError, match="unknown export format .safetensors."):
        export(model, tmp_path / "c", format="safetensors")


def test_calibrated_kv_scales_are_exported_as_vllm_reads_them(tmp_path):
    from safetensors.torch import load_file

    from minifloat.infer import calibrate_kv
    from minifloat.infer.generation.hf_cache import quantized_cache

    model = tiny_llama(hidden=128, inter=256)
    scales = calibrate_kv(model, [IDS])
    assert set(scales) == {0, 1} and all(k > 0 and v > 0 for k, v in scales.values())
    quantize_model(model, "fp8-dynamic")
    out = export(model, tmp_path / "kv", kv_scales=scales)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"]["num_bits"] == 8 and qc["kv_cache_scheme"]["strategy"] == "tensor"
    t = load_file(str(out / "model.safetensors"))
    assert t["model.layers.1.self_attn.k_scale"].shape == (1,)
    assert float(t["model.layers.1.self_attn.v_scale"]) == pytest.approx(scales[1][1] / 448, rel=1e-7)
    # the real reader, compressed (as vLLM loads it: dequantizing drops the KV scales), takes them
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert float(hf.model.layers[1].self_attn.k_scale) == pytest.approx(scales[1][0] / 448, rel=1e-7)
    assert hf(IDS).logits.shape == (2, 24, 256)
    # the calibrated cache: per-tensor FP8 with the layer's amax, as the reference quantizer gives
    cal = quantized_cache(model.config, "fp8", scales=scales)
    with torch.no_grad():
        model(input_ids=IDS[:1], past_key_values=cal, use_cache=True)
    (kq, _), = cal.kv.stored(0)
    assert kq.scheme.granularity == "tensor" and float(kq.scale) == pytest.approx(scales[0][0] / 448, rel=1e-6)


def test_a_layer_policy_quantizes_exports_and_reads_back(tmp_path):
    model = tiny_llama(hidden=128, inter=256)
    policy = {"*.self_attn.*": "fp8-dynamic", "*.mlp.down_proj": None, "*.mlp.*": "mxfp4", "lm_head": None}
    summary = quantize_model(model, policy, ignore=())
    by = {s.name: s for s in summary.layers}
    assert by["model.layers.0.self_attn.q_proj"].config == "fp8-dynamic"
    assert by["model.layers.0.self_attn.q_proj"].rule == "*.self_attn.*"
    assert by["model.layers.1.mlp.up_proj"].config == "mxfp4" and by["model.layers.1.mlp.up_proj"].rule == "*.mlp.*"
    assert by["model.layers.1.mlp.down_proj"].reason == "rule '*.mlp.down_proj' keeps it in high precision"
    assert by["lm_head"].scheme is None and "rule '*.self_attn.*'" in str(summary)
    out = export(model, tmp_path / "mixed")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision" and len(qc["config_groups"]) == 2
    # transformers' dequantize=True path decodes every dense layer with one config group (5.23), so
    # the mixed checkpoint is read compressed and decompressed by compressed-tensors' ModelCompressor
    from compressed_tensors.compressors import ModelCompressor

    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    ModelCompressor.from_compression_config(hf.config.quantization_config).decompress_model(hf)
    sd = hf.state_dict()
    for n, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            assert torch.equal(sd[f"{n}.weight"].float(), m.weight.dequantize()), n
    back = load_quantized(out)
    assert back.model.layers[0].mlp.up_proj.config.name == "mxfp4"
    assert back.model.layers[0].self_attn.k_proj.config.name == "fp8-dynamic"
    with torch.no_grad():
        assert torch.equal(back(IDS).logits, model(IDS).logits)
    unmatched = quantize_model(tiny_llama(hidden=128, inter=256), {"*.mlp.*": "mxfp8"})
    assert {s.reason for s in unmatched.skipped} >= {"no rule of the policy matches it"}


# compressed-tensors' format of each named config's weights, as its CompressionFormat names them
# (the table export kept by config name before it derived the format from the scheme)
CT_FORMATS = {
    "fp8-weight-only": "float-quantized", "fp8-dynamic": "float-quantized", "fp8-static": "float-quantized",
    "fp8-block": "float-quantized", "mxfp8": "mxfp8-quantized", "mxfp6": "mxfp6-pack-quantized",
    "mxfp4": "mxfp4-pack-quantized", "mxfp4-weight-only": "mxfp4-pack-quantized",
    "nvfp4-weight-only": "nvfp4-pack-quantized", "nvfp4": "nvfp4-pack-quantized",
    "nvfp4-4over6-weight-only": "nvfp4-pack-quantized", "nvfp4-4over6": "nvfp4-pack-quantized",
    "fp8-block-weight-only": "float-quantized", "mxfp8-weight-only": "mxfp8-quantized",
    "mxfp6-weight-only": "mxfp6-pack-quantized",
    "fp8-dynamic-fnuz": None, "fp8-weight-only-fnuz": None,  # AMD's E4M3FNUZ: no compressed-tensors format holds it
}  # fmt: skip


def test_the_format_of_each_named_config_comes_from_its_scheme():
    from minifloat.infer.checkpoints.compressed_tensors import ct_format
    from minifloat.infer.checkpoints.hf_fp8 import holds as holds_hf_fp8

    assert set(CT_FORMATS) == set(QUANT_CONFIGS)
    for name, c in QUANT_CONFIGS.items():
        assert ct_format(c.weight_scheme) == CT_FORMATS[name], name
        assert holds_hf_fp8(c) == (name == "fp8-block"), name
    for scheme in ("fp8_e5m2", "mxfp6_e3m2", "mxfp8_e5m2", "fp6_e3m2"):  # elements compressed-tensors has no format for
        assert ct_format(minifloat.get_scheme(scheme)) is None, scheme


def test_a_hand_built_config_exports_and_reads_back_like_a_named_one(tmp_path):
    """A QuantConfig no preset names (E4M3 weights in 1×128 groups, inputs per token): the format
    comes from its schemes, transformers reads it bit for bit, minifloat's reader rebuilds it."""
    from minifloat.infer import QuantConfig

    config = QuantConfig(name="my-fp8-groups", weight="fp8_block128", activation="fp8_rowwise")
    assert config.name not in QUANT_CONFIGS
    model = tiny_llama()
    quantize_model(model, config)
    out = export(model, tmp_path / "ckpt")
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert group["format"] == "float-quantized" and group["weights"]["strategy"] == "group"
    assert group["weights"]["group_size"] == 128 and group["input_activations"]["strategy"] == "token"
    sd = read_with_transformers(out, "compressed-tensors").state_dict()
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert len(layers) == 14
    for n, m in layers.items():
        assert torch.equal(sd[f"{n}.weight"].float(), m.weight.dequantize(torch.float32)), n
    back = load_quantized(out)
    c = next(m.config for m in back.modules() if isinstance(m, QuantizedLinear))
    assert (c.weight_scheme, c.activation_scheme) == (config.weight_scheme, config.activation_scheme)
    with torch.no_grad():
        assert torch.equal(back(IDS).logits, model(IDS).logits)


def test_a_scheme_compressed_tensors_cannot_hold_stays_in_high_precision_by_name(tmp_path):
    from minifloat.infer import QuantConfig

    config = QuantConfig(name="e5m2-weights", weight="fp8_e5m2")
    model = tiny_llama(hidden=128, inter=256)
    summary = quantize_model(model, config, export_format="compressed-tensors")
    assert not summary.quantized and "compressed-tensors has no format for" in str(summary)
    quantize_model(model := tiny_llama(hidden=128, inter=256), config)
    with pytest.raises(minifloat.MinifloatError, match="which compressed-tensors has no format for"):
        export(model, tmp_path / "ckpt")


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_an_export_is_as_readable_as_the_umask_says(tmp_path, umask):
    """Every file of an export gets the mode a plain open() gives (0666 less the umask), not
    safetensors' 0600: a serving process of another user in the group reads it under 022."""
    import os

    model = tiny_llama(hidden=128, inter=256)
    quantize_model(model, "fp8-dynamic")
    old = os.umask(umask)
    try:
        out = export(model, tmp_path / "ckpt", max_shard_bytes=200_000)  # shards and an index too
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask
    files = list(out.iterdir())
    assert len(files) > 3 and all(f.stat().st_mode & 0o777 == 0o666 & ~umask for f in files), [
        (f.name, oct(f.stat().st_mode & 0o777)) for f in files]
