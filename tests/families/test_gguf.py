"""Each family transformers' GGUF reader knows, as a GGUF file written the way llama.cpp's converter
writes it (tests/gguf_writer.py): read by minifloat as the model written, through every command;
quantized to MXFP4 and written back as a GGUF that transformers' reader, minifloat's and (where
installed) llama.cpp compute with. The oracle is the transformers model the file was written from."""

import json

import numpy as np
import pytest
import torch

import minifloat
from minifloat.cli import main
from minifloat.infer import QuantizedLinear, load_model
from minifloat.infer.checkpoints.export import export
from tests.families.tiny import GGUF_FAMILIES, WINDOW, gguf_config, random_weights
from tests.gguf_writer import VOCAB, llama_cpp_logits, write_gguf

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

TOKENS = 2 * WINDOW  # past the sliding window of Gemma 3's local layers


@pytest.fixture(scope="module", params=GGUF_FAMILIES)
def family_gguf(request, tmp_path_factory):
    family = request.param
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(gguf_config(family, VOCAB)).eval()
    path = tmp_path_factory.mktemp(f"gguf-{family}") / "model.gguf"
    return family, path, write_gguf(random_weights(model, family), path, family)


def _ids(n: int = TOKENS) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(1))


def test_each_family_reads_as_the_model_written(family_gguf):
    _, path, written = family_gguf
    model = load_model(path)
    with torch.no_grad():
        assert torch.equal(model(_ids()).logits, written(_ids()).logits)


def test_each_family_goes_through_the_commands(family_gguf, docs, tmp_path, capsys):
    _, path, _ = family_gguf
    small = ["--data", str(docs), "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1", "--calib-batches", "2"]
    assert main(["eval", str(path), "--scheme", "nvfp4-weight-only", "--method", "gptq", "--json", *small]) == 0
    out = json.loads(capsys.readouterr().out)
    assert np.isfinite(out["ppl"]) and out["ppl_ref"] > 0
    assert main(["generate", str(path), "--prompt", "The fox", "--max-new-tokens", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["new_tokens"] == 4


def _mxfp4_file(path, tmp_path):
    model = load_model(path)
    summary = minifloat.quantize_model(model, "mxfp4-weight-only", export_format="gguf")
    out = export(model, tmp_path / "m.gguf", format="gguf", gguf_source=path, gguf_rest="f32")
    return model, summary, out


def test_each_family_writes_an_mxfp4_gguf_its_readers_compute_with(family_gguf, tmp_path):
    """Every Linear in FP4 blocks (GPT-2's Conv1D too, as the (out, in) rows the file holds);
    transformers' reader and minifloat's read it as the model that wrote it, codes intact."""
    family, path, _ = family_gguf
    model, summary, out = _mxfp4_file(path, tmp_path)
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(summary.quantized) == len(linears) > 0
    assert all(r.name.endswith("lm_head") for r in summary.layers if r.scheme is None and r.reason)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf").eval()
    back = load_model(out)
    assert sum(isinstance(m, QuantizedLinear) for m in back.modules()) == len(linears)
    with torch.no_grad():
        ours = model(_ids()).logits
        torch.testing.assert_close(theirs(_ids()).logits, ours, rtol=0, atol=1e-5)
        assert torch.equal(back(_ids()).logits, ours)
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.architecture"].contents() == family
    norms = [t for t in reader.tensors if t.name.endswith("norm.weight")]
    assert norms and all(t.tensor_type.name == "F32" for t in norms)


@pytest.mark.llamacpp
def test_llama_cpp_computes_each_family_with_the_weights_minifloat_wrote(family_gguf, tmp_path):
    """llama.cpp's logits of the MXFP4 file are minifloat's FP4 model's up to its 8-bit activations:
    far closer to them than the FP4 model is to the float model it came from."""
    pytest.importorskip("llama_cpp")
    _, path, written = family_gguf
    model, _, out = _mxfp4_file(path, tmp_path)
    ids = _ids(36)[0].tolist()
    theirs = llama_cpp_logits(out, ids)
    with torch.no_grad():
        ours, full = model(torch.tensor([ids])).logits[0], written(torch.tensor([ids])).logits[0]
    assert (theirs - ours).abs().max() < 0.3 * (full - ours).abs().max()
    assert (theirs.argmax(-1) == ours.argmax(-1)).float().mean() >= 0.9  # a random model's near ties aside
