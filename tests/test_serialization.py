import pytest
import torch

import minifloat
from minifloat import SCHEMES, CorruptFileError, MinifloatError, load, quantize, save


def test_every_scheme_round_trips_bit_exact(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {f"t_{name}": quantize(torch.randn(5, 70, generator=g), name) for name in SCHEMES}
    tensors["plain"] = torch.randn(3, dtype=torch.bfloat16)
    tensors["half_input"] = quantize(torch.randn(2, 3, 32).half(), "nvfp4")
    path = tmp_path / "q.safetensors"
    save(path, tensors)
    back = load(path)
    assert set(back) == set(tensors)
    for name, q in tensors.items():
        if isinstance(q, torch.Tensor):
            assert torch.equal(back[name].view(torch.uint8), q.view(torch.uint8))
            continue
        b = back[name]
        assert b.scheme == q.scheme and b.shape == q.shape and b.orig_dtype == q.orig_dtype
        assert torch.equal(b.data.view(torch.uint8), q.data.view(torch.uint8))
        assert torch.equal(b.scale.reshape(-1).view(torch.uint8), q.scale.reshape(-1).view(torch.uint8))
        assert torch.equal(b.dequantize().view(torch.int32), q.dequantize().view(torch.int32))


def _saved(tmp_path):
    path = tmp_path / "w.safetensors"
    save(path, {"w": quantize(torch.randn(4, 64), "mxfp4")})
    return path


def test_tampered_file_is_rejected(tmp_path):
    path = _saved(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x10  # flip one bit of the stored tensors
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptFileError, match=r"tensor 'w\.\w+' does not match its checksum; the file was modified"):
        load(path)


def test_truncated_file_is_rejected(tmp_path):
    path = _saved(tmp_path)
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(CorruptFileError, match="not a readable safetensors file"):
        load(path)


def test_foreign_safetensors_file_is_rejected(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "f.safetensors"))
    with pytest.raises(CorruptFileError, match="not written by minifloat.save"):
        load(tmp_path / "f.safetensors")


def test_save_is_atomic_and_keeps_the_old_file_on_failure(tmp_path):
    path = _saved(tmp_path)
    before = path.read_bytes()
    with pytest.raises(MinifloatError, match="save takes QuantizedTensors or tensors, got list"):
        save(path, {"a": quantize(torch.randn(2, 32), "fp8"), "b": [1, 2]})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]
    with pytest.raises(MinifloatError, match="non-empty strings"):
        save(path, {"": torch.zeros(1)})


def test_missing_file():
    with pytest.raises(FileNotFoundError):
        minifloat.load("/nonexistent/x.safetensors")


def test_module_style_names_with_dots_round_trip(tmp_path):
    tensors = {"blocks.0.fc.weight": torch.randn(4, 4), "blocks.0.fc": quantize(torch.randn(2, 32), "mxfp4")}
    save(tmp_path / "m.safetensors", tensors)
    back = minifloat.load(tmp_path / "m.safetensors")
    assert torch.equal(back["blocks.0.fc.weight"], tensors["blocks.0.fc.weight"])
    assert torch.equal(back["blocks.0.fc"].data, tensors["blocks.0.fc"].data)
