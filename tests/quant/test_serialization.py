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
    with pytest.raises(CorruptFileError, match="not written by minifloat.save") as err:
        load(tmp_path / "f.safetensors")
    assert "loads with safetensors.torch.load_file" in str(err.value)  # what does load it


def test_save_is_atomic_and_keeps_the_old_file_on_failure(tmp_path):
    path = _saved(tmp_path)
    before = path.read_bytes()
    with pytest.raises(MinifloatError, match="save takes QuantizedTensors or tensors, got list"):
        save(path, {"a": quantize(torch.randn(2, 32), "fp8"), "b": [1, 2]})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]
    with pytest.raises(MinifloatError, match="non-empty strings"):
        save(path, {"": torch.zeros(1)})


def test_missing_file_a_folder_and_a_list_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        minifloat.load("/nonexistent/x.safetensors")
    with pytest.raises(MinifloatError, match="is a directory; pass the path of a file minifloat.save wrote"):
        minifloat.load(tmp_path)
    with pytest.raises(MinifloatError, match="save takes a mapping of names to tensors.*got list"):
        save(tmp_path / "l.safetensors", [torch.ones(2)])


def test_tied_weights_and_views_round_trip(tmp_path):
    # a tied embedding / LM head is one tensor under two names; safetensors refuses shared memory
    emb, x = torch.randn(16, 8), torch.randn(4, 32)
    tensors = {"embed.weight": emb, "lm_head.weight": emb, "row": emb[3], "q": quantize(x, "mxfp8"), "x": x}
    save(tmp_path / "t.safetensors", tensors)
    back = minifloat.load(tmp_path / "t.safetensors")
    for name in ("embed.weight", "lm_head.weight", "row", "x"):
        assert torch.equal(back[name], tensors[name])
    assert torch.equal(back["q"].dequantize(), tensors["q"].dequantize())


def test_module_style_names_with_dots_round_trip(tmp_path):
    tensors = {"blocks.0.fc.weight": torch.randn(4, 4), "blocks.0.fc": quantize(torch.randn(2, 32), "mxfp4")}
    save(tmp_path / "m.safetensors", tensors)
    back = minifloat.load(tmp_path / "m.safetensors")
    assert torch.equal(back["blocks.0.fc.weight"], tensors["blocks.0.fc.weight"])
    assert torch.equal(back["blocks.0.fc"].data, tensors["blocks.0.fc"].data)


def _rewrite(path, edit=lambda m: m, edit_tensors=lambda t: t):
    """Re-save the file at `path` with its metadata passed through `edit` and its tensors
    through `edit_tensors` (a forger who rewrites the header, or a writer of another version)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file(edit_tensors(tensors), str(path), metadata=edit(metadata))


@pytest.mark.parametrize(
    ("edit", "stored"),
    [(lambda t: t.reshape(6, 4), "torch.float32 of shape \\[6, 4\\]"), (lambda t: t.view(torch.int32), "torch.int32 of shape")],
)
def test_a_tensor_stored_with_another_shape_or_dtype_is_rejected(tmp_path, edit, stored):
    """The same bytes under another header shape or dtype pass the checksum of the bytes; the
    shape and dtype recorded at save time catch them (a plain tensor has no geometry to check)."""
    path = tmp_path / "w.safetensors"
    save(path, {"b": torch.randn(4, 6)})
    _rewrite(path, edit_tensors=lambda t: {**t, "b.tensor": edit(t["b.tensor"])})
    with pytest.raises(CorruptFileError, match=f"tensor 'b.tensor' is {stored}.*; it was saved as float32 of shape \\[4, 6\\]"):
        load(path)


def test_every_single_bit_flip_is_rejected(tmp_path):
    """Anywhere in the file (header, metadata, tensor bytes): a flipped bit never loads."""
    import random

    path = tmp_path / "w.safetensors"
    save(path, {"w": quantize(torch.randn(33, 70), "nvfp4"), "b": torch.randn(3), "r": quantize(torch.randn(5, 7), "fp8_rowwise")})
    raw = path.read_bytes()
    rng = random.Random(0)
    for pos in rng.sample(range(len(raw)), 300):
        bad = bytearray(raw)
        bad[pos] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(bad))
        with pytest.raises(CorruptFileError):
            load(path)


def test_edited_metadata_is_rejected(tmp_path):
    """A valid-looking edit of the metadata (another shape, within the same padding) is caught
    by the metadata's own checksum."""
    import json

    path = tmp_path / "w.safetensors"
    save(path, {"w": quantize(torch.randn(4, 70), "nvfp4")})  # 70 columns are padded to 80

    def edit(m):
        entries = json.loads(m["entries"])
        entries["w"]["shape"] = [4, 71]
        return {**m, "entries": json.dumps(entries)}

    _rewrite(path, edit)
    with pytest.raises(CorruptFileError, match="metadata does not match its checksum"):
        load(path)


def test_forged_geometry_is_rejected(tmp_path):
    """Metadata rewritten with a consistent checksum but parts that do not fit the shape (the
    kernels would read past them): rejected, naming the part and the expected geometry."""
    import hashlib
    import json

    path = tmp_path / "w.safetensors"
    save(path, {"w": quantize(torch.randn(4, 64), "mxfp4")})

    def edit(m):
        entries = json.loads(m["entries"])
        entries["w"]["shape"] = [4, 96]
        text = json.dumps(entries)
        return {**m, "entries": text, "entries_sha256": hashlib.sha256(text.encode()).hexdigest()}

    _rewrite(path, edit)
    with pytest.raises(CorruptFileError, match=r"the data of a mxfp4 QuantizedTensor of shape \(4, 96\) must be torch.uint8 of shape \(4, 48\)"):
        load(path)


def test_files_of_the_first_layout_still_load(tmp_path):
    """minifloat/1 files (tensor checksums only) written by earlier versions load as before."""
    import json

    path = tmp_path / "old.safetensors"
    q, b = quantize(torch.randn(3, 40), "nvfp4"), torch.randn(2)
    save(path, {"q": q, "b": b})

    def to_v1(m):
        entries = json.loads(m["entries"])
        for e in entries.values():
            e["sha256"] = {part: spec["sha256"] for part, spec in e.pop("parts").items()}
        return {"format": "minifloat/1", "entries": json.dumps(entries)}

    _rewrite(path, to_v1)
    back = load(path)
    assert torch.equal(back["b"], b)
    assert torch.equal(back["q"].dequantize().view(torch.int32), q.dequantize().view(torch.int32))


def test_quantized_tensor_of_the_wrong_geometry_is_refused():
    """A hand-built QuantizedTensor whose parts do not fit its shape is refused before any kernel
    reads it, and cannot be saved."""
    q = quantize(torch.randn(4, 64), "mxfp8")
    wrong = minifloat.QuantizedTensor(q.data[:2], q.scale, None, q.shape, q.scheme)
    with pytest.raises(MinifloatError, match=r"the data of a mxfp8 QuantizedTensor of shape \(4, 64\) must be torch.uint8 of shape \(4, 64\); got torch.uint8 of shape \(2, 64\)"):
        wrong.dequantize()
    with pytest.raises(MinifloatError, match="the scale of a mxfp8"):
        minifloat.QuantizedTensor(q.data, q.scale.float(), None, q.shape, q.scheme).dequantize()
    with pytest.raises(MinifloatError, match="has no tensor_scale"):
        save("/nonexistent/never-written.safetensors", {"w": minifloat.QuantizedTensor(q.data, q.scale, torch.tensor(1.0), q.shape, q.scheme)})
