"""GGUF, llama.cpp's model file, both ways: FP4 weights written as ggml's own ``MXFP4`` / ``NVFP4``
blocks, exactly (the same E2M1 codes and scales), and read back with the codes intact.

ggml's two FP4 block types (the ``gguf`` package's `quants` reads both):

========  =====================================================================================
MXFP4     32 values in 17 bytes: one E8M0 exponent byte e, then 16 bytes whose low nibbles are
          values 0–15 and high nibbles values 16–31. ggml stores each E2M1 value doubled
          (``0, 1, 2, 3, 4, 6, 8, 12``, bit 3 the sign) and halves the scale (``2^(e−128)``):
          value = E2M1 · 2^(e−127), OCP MX exactly.
NVFP4     64 values in 36 bytes: four unsigned E4M3 scale bytes (one per 16 values), then four
          8-byte groups, group j's low nibbles values 16j…16j+7, high nibbles 16j+8…16j+15;
          value = E2M1 · E4M3 (ggml again doubles the code and halves the scale). NVFP4's FP32
          tensor scale is the per-tensor ``<name>.scale`` tensor (F32, shape {1}) llama.cpp
          loads beside the weight and multiplies the product by.
========  =====================================================================================

What ggml cannot hold exactly is refused, naming the layer: other element formats or block
sizes (2-D blocks: ggml's blocks lie along a row), a row that is not whole blocks (NVFP4's
block is 64 values), a NaN block (ggml reads E8M0 255 as 2^127 and E4M3 0x7F as 0), an input
quantized by the config (llama.cpp quantizes activations its own way: export the config's
``-weight-only`` twin), and a layer with an input transform (no reader applies a rotation or
online smoothing; folded smoothing is in the weights and is written).

The file is the source GGUF's, rewritten — its metadata (architecture, tokenizer, chat template)
and tensor names as llama.cpp's converter wrote them — or, from a transformers folder, the same
keys made from its config and tokenizer (`gguf_folder`); either way each of the model's tensors in its place
(FP4 blocks, else `REST_TYPES`: the 2-D rest — embedding, an unquantized head or layer — in the
type the user picks, ``q8_0`` by default as llama.cpp's own 4-bit files keep it, made by
``gguf``'s quantizer; norms and biases F32), tensors the model does not hold (``rope_freqs``)
copied as they were. What llama.cpp's converter changes and transformers' reader undoes is
put back: Llama's Q and K rows in RoPE's interleaved order, Gemma 2 / 3's norms stored as
``1 + w``, GPT-2's Conv1D weights as (out, in) rows (where FP4 blocks lie anyway). ``minifloat.quantization`` records each FP4
tensor's config, so a file read back keeps them (a config that disagrees with the block type is
refused). Mixture-of-experts layers (`MOE_ARCHS`: Qwen3-MoE, Qwen2-MoE) are written as llama.cpp's
converter stacks them: each layer's ``ffn_{gate,up,down}_exps`` of (n_expert, rows, columns), one
block type for all experts, NVFP4's per-expert tensor scales as one ``.scale`` of n_expert values;
read back, expert e is the e-th slice. Written beside the target and renamed into place.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from minifloat.errors import MinifloatError
from minifloat.infer.checkpoints import gguf_folder
from minifloat.infer.ptq.config import QUANT_CONFIGS, QuantConfig
from minifloat.models.conv1d import linears_from_conv1d
from minifloat.models.experts import unfuse_experts
from minifloat.models.loading import gguf_config
from minifloat.quant import QuantizedTensor
from minifloat.scaling.layout import part_specs
from minifloat.scaling.schemes import Scheme

NAME = "gguf"
BLOCK = {"MXFP4": 32, "NVFP4": 64}  # values per ggml block
BLOCK_BYTES = {"MXFP4": 17, "NVFP4": 36}
READ_AS = {"MXFP4": "mxfp4-weight-only", "NVFP4": "nvfp4-weight-only"}  # a file without minifloat's record
REST_TYPES = ("f32", "f16", "bf16", "q8_0")
PERMUTED_ARCHS = ("llama",)  # llama.cpp's converter reorders these archs' Q / K rows for its RoPE
NORM_OFFSET_ARCHS = ("gemma2", "gemma3")  # norms computing (1 + w): the file holds 1 + w
CONV1D_ARCHS = ("gpt2",)  # Conv1D (in, out) weights: the file holds them as (out, in)
CONV1D_TENSORS = ("attn_qkv.weight", "attn_output.weight", "ffn_up.weight", "ffn_down.weight")
# Architectures whose llama.cpp graph multiplies every Linear's output by NVFP4's ``.scale`` (checked in
# llama-cpp-python 0.3.36's sources and by running it): qwen2's passes NULL scales to its FFN, so an NVFP4
# file of it computes with weights off by the tensor scale (NaN logits, seen on Qwen2.5-Coder-0.5B).
NVFP4_ARCHS = ("llama", "qwen3moe")
# Mixture-of-experts architectures whose experts the file holds stacked, as llama.cpp's converter writes
# them: ``blk.L.ffn_{gate,up,down}_exps`` of (n_expert, rows, columns), NVFP4's tensor scales as one
# ``.scale`` of n_expert values (llama.cpp multiplies expert e's product by the e-th).
MOE_ARCHS = ("qwen3moe", "qwen2moe")
# 1-D in the file, (1, n) in transformers (its reader adds the dimension): Qwen2-MoE's shared-expert gate
ROW_VECTORS = {"qwen2moe": ("ffn_gate_inp_shexp.weight",)}
EXPERT_LINEAR = re.compile(r"^(?P<pre>.+\.experts)\.(?P<e>\d+)\.(?P<proj>[^.]+)$")  # minifloat.models.experts' names
RECORD_KEY = "minifloat.quantization"
_FTYPE = {"MXFP4": 38, "NVFP4": 39}  # llama_ftype MOSTLY_MXFP4_MOE, MOSTLY_NVFP4
_E4M3_NAN = 0x7F


def ggml_type(s: Scheme) -> str | None:
    """The ggml block type that holds weights in scheme `s` exactly, or None."""
    if s.element_format.name != "e2m1" or s.granularity != "block" or s.block[0] != 1:
        return None
    if s.is_mx and s.block[1] == 32:
        return "MXFP4"
    if s.is_nvfp4 and s.block[1] == 16:
        return "NVFP4"
    return None


def unreadable(s: Scheme, n: int, k: int) -> str | None:
    """Why llama.cpp cannot load an (n, k) weight in `s` as it is, or None."""
    t = ggml_type(s)
    if t is None:
        over = f"{s.block[0]}×{s.block[1]} blocks" if s.granularity == "block" else f"a {s.granularity}"
        return (f"is {s.name} ({s.element} with {s.scale_format} scales over {over}), which "
                f"ggml has no type for: it holds E2M1 with an E8M0 scale per 32 values of a row (MXFP4) or an E4M3 "
                f"scale per 16 (NVFP4)")  # fmt: skip
    if k % BLOCK[t]:
        return f"in_features={k} is not a multiple of ggml's {BLOCK[t]}-value {t} block"
    return None


def _weight_only_twin(config: QuantConfig) -> str:
    twin = f"{config.name}-weight-only"
    return twin if twin in QUANT_CONFIGS else "a -weight-only config"


def refusal(name: str, config: QuantConfig, q: QuantizedTensor, beyond: str | None) -> str | None:
    """Why the quantized layer `name` cannot be written to GGUF, or None (`beyond`: what the layer
    computes besides its weight's product, `QuantizedLinear.beyond_weight`)."""
    if beyond is not None:
        return (f"layer {name!r} {beyond}; no GGUF reader applies that: quantize without a rotation, online "
                f"smoothing or kept channels to write GGUF")  # fmt: skip
    if config.activation_scheme is not None:
        return (f"layer {name!r} is {config.name}, which quantizes its input; llama.cpp quantizes activations its own "
                f"way (8-bit), so the file would not compute what the config does: use {_weight_only_twin(config)}")  # fmt: skip
    why = unreadable(q.scheme, *q.shape)
    return None if why is None else f"layer {name!r} {why}"


def check_request(model_path: str | os.PathLike[str], config: QuantConfig, rest: str) -> None:
    """What a GGUF export of the model at `model_path` in `config` needs, checked before any work:
    a source GGUF of an architecture the writer places, a weight-only FP4 config, a rest type."""

    if rest not in REST_TYPES:
        raise MinifloatError(f"--gguf-rest {rest!r}: use one of {', '.join(REST_TYPES)}")
    if config.activation_scheme is not None:
        raise MinifloatError(f"--scheme {config.name} quantizes activations, which a GGUF file cannot say (llama.cpp "
                             f"quantizes them its own way): use {_weight_only_twin(config)}")  # fmt: skip
    if ggml_type(config.weight_scheme) is None:
        raise MinifloatError(f"--scheme {config.name}: its weights ({config.weight_scheme.name}) are no ggml type; GGUF "
                             f"holds mxfp4-weight-only and nvfp4-weight-only (and nvfp4-4over6-weight-only) exactly")  # fmt: skip
    check_nvfp4(open_source(model_path).arch, config.name, ggml_type(config.weight_scheme))


@dataclass(frozen=True)
class Source:
    """What a written file takes from where the model came from: a GGUF (`reader`: its metadata,
    tokenizer and the tensors transformers does not hold, as llama.cpp's converter wrote them) or
    a transformers folder (`reader` None: the same keys made by `gguf_folder`)."""

    path: Path
    arch: str
    reader: object | None = None

    def shapes(self) -> list[tuple[int, ...]]:
        if self.reader is None:
            return gguf_folder.shapes(self.path)
        return [tuple(int(x) for x in reversed(t.shape)) for t in self.reader.tensors]

    def add_metadata(self, writer) -> None:
        if self.reader is None:
            gguf_folder.add_metadata(writer, self.path, self.arch)
        else:
            copy_metadata(self.reader, writer, skip=("general.quantization_version", RECORD_KEY))

    def extra_tensors(self):
        """(name, data, ggml type) of the source's tensors the model does not hold (``rope_freqs``)."""
        return [] if self.reader is None else [(t.name, np.asarray(t.data), t.tensor_type) for t in self.reader.tensors]


def open_source(path: str | os.PathLike[str]) -> Source:
    """The source of a file written from the model at `path` (a .gguf or a transformers folder),
    refused with the fix when the writer cannot take llama.cpp's metadata, tokenizer and names from
    it."""
    try:
        import gguf
        import transformers  # noqa: F401 - check_arch and the names need it
    except ImportError as err:
        raise MinifloatError(f"writing GGUF needs the gguf and transformers packages ({err.name} is missing): "
                             f"pip install 'minifloat[gguf]'") from None  # fmt: skip

    src = Path(path)
    if gguf_folder.is_folder(src):
        return Source(src, gguf_folder.arch(src))
    if not (src.is_file() and src.suffix.lower() == ".gguf"):
        raise MinifloatError(f"{src}: writing GGUF takes llama.cpp's metadata, tokenizer and tensor names from the GGUF "
                             f"or the transformers folder the model comes from; this is neither")  # fmt: skip
    try:
        reader = gguf.GGUFReader(src)
    except (ValueError, OSError, IndexError, KeyError) as err:
        raise MinifloatError(f"{src}: not a readable GGUF file ({type(err).__name__}: {err})") from None
    check_arch(arch := _arch(reader))
    return Source(src, arch, reader)


def check_nvfp4(arch: str, what: str, t: str | None) -> None:
    """Refuse NVFP4 weights for an architecture whose llama.cpp graph ignores their tensor scale."""
    if t == "NVFP4" and arch not in NVFP4_ARCHS:
        raise MinifloatError(f"{what}: llama.cpp's {arch} graph does not apply NVFP4's per-tensor scale to every layer "
                             f"(its FFN gets none), so the file would compute with wrong weights; NVFP4 GGUF files are "
                             f"written for {', '.join(NVFP4_ARCHS)}: use mxfp4-weight-only for {arch}")  # fmt: skip


# --- blocks ----------------------------------------------------------------------------------------


def _nibbles(q: QuantizedTensor) -> torch.Tensor:
    """The (n, k) E2M1 codes, one per byte (minifloat packs the even column in the low nibble)."""
    n, k = q.shape
    packed = q.data[:n, : k // 2]
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(n, k)


def to_blocks(q: QuantizedTensor) -> tuple[str, np.ndarray, float | None]:
    """`q` as ggml blocks: (type, uint8 array (n, bytes per row), NVFP4's tensor scale or None).
    Raises ValueError for what ggml would read as another value (NaN scales)."""
    t = ggml_type(q.scheme)
    if t is None or len(q.shape) != 2 or q.shape[1] % BLOCK[t]:
        raise ValueError(f"{q.scheme.name} {tuple(q.shape)} is not whole {t or 'ggml FP4'} blocks")
    n, k = q.shape
    codes, scale = _nibbles(q), q.scale[:n, : k // (BLOCK[t] if t == "MXFP4" else 16)]
    if t == "MXFP4":
        if bool((scale == 255).any()):
            raise ValueError("a block holds NaN (E8M0 scale 255), which ggml would read as 2^127")
        c = codes.reshape(n, k // 32, 2, 16)
        qs = c[:, :, 0] | (c[:, :, 1] << 4)
        out = torch.cat((scale.reshape(n, k // 32, 1), qs), dim=-1)
        return t, out.reshape(n, -1).numpy(), None
    if bool(((scale & 0x7F) == _E4M3_NAN).any()):
        raise ValueError("a block holds NaN (E4M3 scale 0x7F), which ggml would read as 0")
    if bool((scale & 0x80).any()):
        raise ValueError("a block scale is negative; ggml's NVFP4 scales are unsigned E4M3")
    ts = float(q.tensor_scale)
    if not (np.isfinite(ts) and ts > 0):
        raise ValueError(f"the tensor scale is {ts}; llama.cpp needs a finite positive one")
    c = codes.reshape(n, k // 64, 4, 2, 8)
    qs = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).reshape(n, k // 64, 32)
    out = torch.cat((scale.reshape(n, k // 64, 4), qs), dim=-1)
    return t, out.reshape(n, -1).numpy(), ts


def from_blocks(t: str, raw: np.ndarray, k: int, scheme: Scheme, tensor_scale: float | None,
                dtype: torch.dtype = torch.float32) -> QuantizedTensor:  # fmt: skip
    """The QuantizedTensor (codes and scales as they are) of ggml blocks `raw` (n, bytes per row)."""
    raw = torch.from_numpy(np.array(raw, dtype=np.uint8)).reshape(raw.shape[0], k // BLOCK[t], BLOCK_BYTES[t])
    n = raw.shape[0]
    if t == "MXFP4":
        scale, qs = raw[:, :, :1].reshape(n, k // 32), raw[:, :, 1:]
        codes = torch.stack((qs & 0xF, qs >> 4), dim=2)  # (n, blocks, 2, 16)
    else:
        scale, qs = raw[:, :, :4].reshape(n, k // 16), raw[:, :, 4:].reshape(n, k // 64, 4, 8)
        codes = torch.stack((qs & 0xF, qs >> 4), dim=3)  # (n, blocks, 4, 2, 8)
    codes = codes.reshape(n, k // 2, 2)
    specs = part_specs((n, k), scheme)
    data = torch.zeros(specs["data"][1], dtype=torch.uint8)
    data[:n, : k // 2] = codes[..., 0] | (codes[..., 1] << 4)
    grid = torch.zeros(specs["scale"][1], dtype=torch.uint8)
    grid[:n, : scale.shape[1]] = scale
    ts = (
        None
        if t == "MXFP4"
        else torch.tensor(1.0 if tensor_scale is None else tensor_scale, dtype=torch.float32)
    )
    return QuantizedTensor(data, grid, ts, (n, k), scheme, dtype)


def rope_rows(n: int, heads: int) -> torch.Tensor:
    """llama.cpp's order of a Q or K projection's `n` rows for `heads` heads: row i of its file is
    row ``rope_rows(n, heads)[i]`` of transformers' weight (each head's two halves interleaved)."""
    return torch.arange(n).reshape(heads, 2, n // heads // 2).transpose(1, 2).reshape(n)


def rest_tensor(t: np.ndarray, rest: str):
    """A dense tensor as written: (array, ggml raw type or None for a plain float array)."""
    import gguf

    t = np.ascontiguousarray(t, dtype=np.float32)
    if t.ndim < 2 or rest == "f32":
        return t, None
    if rest == "f16":
        return t.astype(np.float16), None
    qtype = gguf.GGMLQuantizationType.BF16 if rest == "bf16" else gguf.GGMLQuantizationType.Q8_0
    if t.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return t, None  # not whole Q8_0 blocks: kept exact
    return gguf.quants.quantize(t, qtype), qtype


def rest_bits(shape: tuple[int, ...], rest: str) -> int:
    """Bits `rest_tensor` writes a dense tensor of `shape` in (ggml's block sizes: Q8_0 is 32
    values in 34 bytes)."""
    n = math.prod(shape)
    if len(shape) < 2 or rest == "f32":
        return 32 * n
    if rest in ("f16", "bf16"):
        return 16 * n
    return 34 * 8 * n // 32 if shape[-1] % 32 == 0 else 32 * n


def fp4_bits(config: QuantConfig, n: int, k: int) -> int:
    """Bits an (n, k) weight takes written in `config`'s ggml blocks (NVFP4: with its ``.scale``)."""
    t = ggml_type(config.weight_scheme)
    if t is None:
        raise MinifloatError(f"{config.name} writes no ggml FP4 block type")
    tensor_scale = 32 if config.weight_scheme.is_nvfp4 else 0
    return 8 * BLOCK_BYTES[t] * n * k // BLOCK[t] + tensor_scale


def dense_bits(source: str | os.PathLike[str], rest: str) -> tuple[int, int]:
    """(bits, values) of the tensors a GGUF written from `source` would hold with no layer in FP4:
    every 2-D tensor in the `rest` type, the others in F32 — what a file's bits per weight are
    counted from, as llama.cpp prints a model's BPW (tensor data; the metadata and tokenizer add
    to the file)."""
    shapes = open_source(source).shapes()
    return sum(rest_bits(sh, rest) for sh in shapes), sum(math.prod(sh) for sh in shapes)


def tensor_bits(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(bits, values) of the tensor data of the GGUF at `path` (what its bits per weight count)."""
    import gguf

    tensors = gguf.GGUFReader(path).tensors
    return sum(8 * int(t.n_bytes) for t in tensors), sum(int(t.n_elements) for t in tensors if not t.name.endswith(".scale"))


# --- names -----------------------------------------------------------------------------------------


def _arch(reader) -> str:
    field = reader.fields.get("general.architecture")
    if field is None:
        raise MinifloatError("the GGUF has no general.architecture")
    return field.contents()


def name_map(arch: str, layers: int):
    """gguf's map from transformers module names to this architecture's GGUF tensor names."""
    import gguf

    found = [k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch]
    if not found:
        raise MinifloatError(f"gguf {gguf.__version__} does not know architecture {arch!r}")
    return gguf.get_tensor_name_map(found[0], layers)


def check_arch(arch: str) -> None:
    """Refuse an architecture whose tensors transformers converts on reading in a way the writer
    does not invert (Qwen2-MoE's shared experts, GPT-OSS, …); Llama's Q / K order, Gemma's norm
    offset, GPT-2's Conv1D and Qwen3-MoE's stacked experts are inverted."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, LlamaTensorProcessor

    proc = TENSOR_PROCESSORS.get(arch)
    if proc is not None and proc is not LlamaTensorProcessor and arch not in (*NORM_OFFSET_ARCHS, *CONV1D_ARCHS, *MOE_ARCHS):
        raise MinifloatError(f"writing GGUF for architecture {arch!r} is not supported: transformers converts its "
                             f"tensors on reading ({proc.__name__}) and the writer does not invert that yet; "
                             f"architectures it writes: llama, qwen2, qwen3, qwen3moe, phi3, gemma2, gemma3, gpt2 and "
                             f"the like")  # fmt: skip


def expert_slot(module: str) -> tuple[str, int] | None:
    """An expert Linear's name without its index, and the index (``…experts.3.gate_proj`` →
    ``(…experts.gate_proj, 3)``: the name gguf's map places as the stacked ``ffn_gate_exps``), or None."""
    m = EXPERT_LINEAR.match(module)
    return None if m is None else (f"{m['pre']}.{m['proj']}", int(m["e"]))


def expert_count(config) -> int:
    return int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0) or 0)


def _stack(g: str, by_expert: dict[int, object], n_expert: int, what: str) -> list:
    """Expert 0 … n_expert - 1's parts of the stacked tensor `g`, all of them or refused."""
    if sorted(by_expert) != list(range(n_expert)):
        missing = sorted(set(range(n_expert)) - set(by_expert))
        raise MinifloatError(f"{g}: experts {missing[:8]} of {n_expert} are not {what} like the others; a GGUF holds a "
                             f"layer's experts as one tensor of one type: quantize all of a layer's experts or none "
                             f"(an ignore pattern that names some of them)")  # fmt: skip
    return [by_expert[e] for e in range(n_expert)]


def transposed(arch: str, gguf_name: str) -> bool:
    """Whether the file holds this tensor transposed from transformers' (GPT-2's Conv1D)."""
    return arch in CONV1D_ARCHS and gguf_name.endswith(CONV1D_TENSORS)


def row_vector(arch: str, gguf_name: str) -> bool:
    """Whether the file holds this (1, n) tensor of transformers' as n values (`ROW_VECTORS`)."""
    return gguf_name.endswith(ROW_VECTORS.get(arch, ()))


def file_values(arr: np.ndarray, arch: str, gguf_name: str, *, reading: bool = False) -> np.ndarray:
    """A dense tensor's values as the file holds them (`reading`: back as transformers holds them):
    Gemma's norms offset by one, GPT-2's Conv1D weights transposed, Qwen2-MoE's shared-expert gate
    one row, anything else as it is."""
    if row_vector(arch, gguf_name):
        return arr.reshape(1, -1) if reading else arr.reshape(-1)
    if arch in NORM_OFFSET_ARCHS and gguf_name.endswith("norm.weight"):
        return arr - 1 if reading else arr + 1
    if transposed(arch, gguf_name):
        return np.ascontiguousarray(arr.T)
    return arr


def file_rows(arr: np.ndarray, arch: str, config, gguf_name: str, *, reading: bool = False) -> np.ndarray:
    """The rows of a tensor (codes, blocks or values) in the file's order (`reading`: back in
    transformers'): llama's Q / K reordered by their head counts, anything else as it is."""
    if arch not in PERMUTED_ARCHS:
        return arr
    if gguf_name.endswith("attn_q.weight"):
        heads = config.num_attention_heads
    elif gguf_name.endswith("attn_k.weight"):
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    else:
        return arr
    order = rope_rows(arr.shape[0], heads)
    return arr[(torch.argsort(order) if reading else order).numpy()]


def gguf_name(nmap, hf_name: str) -> str | None:
    base, _, suffix = hf_name.rpartition(".")
    found = nmap.get_name(base)
    return None if found is None else f"{found}.{suffix}"


# --- writing ---


def copy_metadata(reader, writer, skip: tuple[str, ...] = ()) -> None:
    """Every key of a GGUF `reader` into `writer` with its type, but the reader's own bookkeeping
    (``GGUF.*``), the architecture (the writer is made with it), the file type and `skip`."""
    import gguf

    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type", *skip):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)


def write(model: torch.nn.Module, out: str | os.PathLike[str], *, source: str | os.PathLike[str],
          rest: str = "q8_0", overwrite: bool = False, dense: bool = False) -> Path:  # fmt: skip
    """Write the quantized transformers `model` (loaded from `source`, a GGUF or a transformers
    folder) to the GGUF file `out`; `dense`: a model with no quantized layer too (every tensor in
    `rest`: with ``"f32"`` the F32 file llama.cpp's own quantizer starts from)."""
    import gguf

    from minifloat.infer.modules.embedding import QuantizedEmbedding
    from minifloat.infer.modules.linear import QuantizedLinear
    from minifloat.io.atomic import atomic_path

    if rest not in REST_TYPES:
        raise MinifloatError(f"gguf rest type {rest!r}: use one of {', '.join(REST_TYPES)}")
    out = Path(out)
    if out.exists() and not overwrite:
        raise MinifloatError(
            f"{out} exists; pass overwrite=True (--overwrite) to replace it, or choose another file"
        )
    src = open_source(source)
    arch, config = src.arch, model.config
    nmap = name_map(arch, config.num_hidden_layers)

    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    if not quantized and not dense:
        raise MinifloatError(
            "the model has no QuantizedLinear: run minifloat.quantize_model(model, config) first"
        )
    embeddings = {n for n, m in model.named_modules() if isinstance(m, QuantizedEmbedding)}
    tensors: dict[str, tuple[np.ndarray, object]] = {}
    record: dict[str, str] = {}
    types: set[str] = set()

    def place(hf_name: str) -> str:
        found = gguf_name(nmap, hf_name)
        if found is None:
            raise MinifloatError(f"tensor {hf_name!r} has no GGUF name in gguf's map for {arch!r}; the writer "
                                 f"cannot place it")  # fmt: skip
        return found

    def slot(module: str) -> tuple[str, int] | None:
        found = expert_slot(module)
        if found is not None and arch not in MOE_ARCHS:
            raise MinifloatError(f"{module}: a MoE expert; GGUF files with experts are written for "
                                 f"{', '.join(MOE_ARCHS)}, not {arch}")  # fmt: skip
        return found

    n_expert = expert_count(config)
    experts: dict[str, dict[int, tuple]] = {}  # stacked GGUF name → expert → (blocks, type, tensor scale, config)
    for name, layer in quantized.items():
        q = layer.checkpoint_weight()
        if (why := refusal(name, layer.config, q, layer.beyond_weight())) is not None:
            raise MinifloatError(f"{why}; keep it in high precision (ignore=[{name!r}]; quantize_model(..., "
                                 f"export_format='gguf') does so itself)")  # fmt: skip
        expert = slot(name)
        g = place(f"{expert[0] if expert else name}.weight")
        check_nvfp4(arch, f"layer {name!r}", ggml_type(q.scheme))
        try:
            t, blocks, ts = to_blocks(q)
        except ValueError as err:
            raise MinifloatError(f"layer {name!r}: {err}") from None
        if expert is not None:
            if layer.bias is not None:
                raise MinifloatError(f"layer {name!r}: an expert with a bias, which {arch}'s file has no tensor for")
            experts.setdefault(g, {})[expert[1]] = (blocks, t, ts, layer.config.name)
            types.add(t)
            continue
        tensors[g] = (file_rows(blocks, arch, config, g), getattr(gguf.GGMLQuantizationType, t))
        if ts is not None:
            tensors[g.removesuffix(".weight") + ".scale"] = (np.array([ts], dtype=np.float32), None)
        if layer.bias is not None:
            tensors[place(f"{name}.bias")] = (layer.bias.detach().float().numpy(), None)
        record[g] = layer.config.name
        types.add(t)
    for g, by_expert in experts.items():  # (n_expert, rows, block bytes): one type, one config
        parts = _stack(g, by_expert, n_expert, "quantized")
        kinds = {(t, c) for _, t, _, c in parts}
        if len(kinds) > 1:
            raise MinifloatError(f"{g}: its experts are quantized differently ({sorted(kinds)}); a GGUF holds a layer's "
                                 f"experts as one tensor of one type")  # fmt: skip
        (t, record[g]), = kinds
        tensors[g] = (np.stack([b for b, _, _, _ in parts]), getattr(gguf.GGMLQuantizationType, t))
        if any(ts is not None for _, _, ts, _ in parts):
            scales = [1.0 if ts is None else ts for _, _, ts, _ in parts]
            tensors[g.removesuffix(".weight") + ".scale"] = (np.array(scales, dtype=np.float32), None)
    for prefix in embeddings:  # a packed table: llama.cpp looks tokens up in its values, as the rest type
        tensors[place(f"{prefix}.weight")] = rest_tensor(
            model.get_submodule(prefix).weight.dequantize(torch.float32).numpy(), rest
        )
    skip = tuple(f"{p}." for p in (*quantized, *embeddings))
    seen: set[tuple] = set()
    dense_experts: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, t in model.state_dict().items():
        if hf_name.startswith(skip):
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:  # a tied head: llama.cpp reads token_embd when the file has no output.weight
            continue
        seen.add(key)
        module, _, suffix = hf_name.rpartition(".")
        if (expert := slot(module)) is not None:
            g = place(f"{expert[0]}.{suffix}")
            if g in experts:
                raise MinifloatError(f"{g}: some of its experts are quantized and expert {expert[1]} is not; a GGUF holds "
                                     f"a layer's experts as one tensor of one type")  # fmt: skip
            dense_experts.setdefault(g, {})[expert[1]] = t.detach().float().numpy()
            continue
        g = place(hf_name)
        arr = file_values(file_rows(t.detach().float().numpy(), arch, config, g), arch, g)
        tensors[g] = rest_tensor(arr, rest)
    for g, by_expert in dense_experts.items():
        tensors[g] = rest_tensor(np.stack(_stack(g, by_expert, n_expert, "kept in high precision")), rest)
    for name, data, qtype in src.extra_tensors():  # what transformers does not hold (rope_freqs), as it was
        if name not in tensors:
            tensors[name] = (data, qtype)

    with atomic_path(out) as tmp:
        w = gguf.GGUFWriter(str(tmp), arch)
        src.add_metadata(w)
        plain = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}  # fmt: skip
        w.add_file_type(_FTYPE[types.pop()] if len(types) == 1 else plain[rest] if not types else gguf.LlamaFileType.GUESSED)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_string(RECORD_KEY, json.dumps({"version": importlib.metadata.version("minifloat"), "configs": record}, sort_keys=True))
        for g, (arr, qtype) in tensors.items():
            if qtype is None:
                w.add_tensor(g, arr)
            else:
                w.add_tensor(g, arr, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return out


# --- reading ---------------------------------------------------------------------------------------


def fp4_tensors(path: str | os.PathLike[str]) -> bool:
    """Whether the GGUF at `path` holds MXFP4 or NVFP4 blocks (read with the codes intact); False
    for a file gguf cannot read (the plain GGUF loader then says why, naming it)."""
    import gguf

    try:
        return any(t.tensor_type.name in BLOCK for t in gguf.GGUFReader(path).tensors)
    except (ValueError, OSError, IndexError, KeyError):
        return False


def load(path: str | os.PathLike[str]) -> torch.nn.Module:
    """The causal LM in the GGUF file `path`, its MXFP4 / NVFP4 weights as `QuantizedLinear` layers
    holding the file's codes and scales as they are (with NVFP4's ``.scale``), every other tensor
    dequantized by ``gguf`` into transformers' model of the architecture (config and tokenizer
    from transformers' reading of the file's metadata); in eval mode. Every tensor the model needs
    is checked (present, shape, a record that agrees with the block type) before it is used."""
    import gguf
    from transformers import AutoModelForCausalLM

    from minifloat.infer.modules.linear import QuantizedLinear
    from minifloat.nn.convert import swap_modules

    path = Path(path)
    reader = gguf.GGUFReader(path)
    arch = _arch(reader)
    check_arch(arch)
    record = {}
    if (field := reader.fields.get(RECORD_KEY)) is not None:
        try:
            record = json.loads(field.contents())["configs"]
        except (ValueError, KeyError, TypeError):
            raise MinifloatError(
                f"{path}: {RECORD_KEY} is not minifloat's record of the tensors' configs"
            ) from None
    config = gguf_config(path)  # with what transformers' reader misses (an expert's width)
    model = AutoModelForCausalLM.from_config(config)
    linears_from_conv1d(model)  # GPT-2's Conv1D as the Linear its FP4 blocks are rows of
    unfuse_experts(model)  # one Linear per expert weight: expert e's rows are the e-th of the stacked tensor
    n_expert = expert_count(config)
    by_name = {t.name: t for t in reader.tensors}
    nmap = name_map(arch, config.num_hidden_layers)
    used: set[str] = set()

    def tensor(g: str, hf_name: str, shape: tuple[int, ...]):
        if g not in by_name:
            raise MinifloatError(f"{path}: tensor {g!r} ({hf_name}) is missing")
        rt = by_name[g]
        if tuple(int(x) for x in reversed(rt.shape)) != tuple(shape):
            raise MinifloatError(
                f"{path}: tensor {g!r} has shape {tuple(reversed(rt.shape))}; {hf_name} needs {shape}"
            )
        used.add(g)
        return rt

    def place(hf_name: str) -> tuple[str | None, int | None]:
        """The file's name of `hf_name` and, for an expert's, its index in the stacked tensor."""
        module, _, suffix = hf_name.rpartition(".")
        expert = expert_slot(module) if arch in MOE_ARCHS else None
        if expert is None:
            return gguf_name(nmap, hf_name), None
        return gguf_name(nmap, f"{expert[0]}.{suffix}"), expert[1]

    swaps: dict[str, torch.nn.Module] = {}
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear):
            continue
        g, e = place(f"{name}.weight")
        if g not in by_name or (t := by_name[g].tensor_type.name) not in BLOCK:
            continue
        n, k = m.out_features, m.in_features
        rt = tensor(g, f"{name}.weight", (n, k) if e is None else (n_expert, n, k))
        cname = record.get(g, READ_AS[t])
        qc = QUANT_CONFIGS.get(cname)
        if qc is None or ggml_type(qc.weight_scheme) != t or qc.activation_scheme is not None:
            raise MinifloatError(f"{path}: tensor {g!r} holds {t} blocks but the file records config {cname!r}, which "
                                 f"does not write them: the file claims one thing and holds another")  # fmt: skip
        ts = None
        if t == "NVFP4" and (sg := g.removesuffix(".weight") + ".scale") in by_name:
            scales = tensor(sg, f"{name} tensor scale", (1,) if e is None else (n_expert,)).data
            ts = float(np.asarray(scales, dtype=np.float32).reshape(-1)[e or 0])
        data = np.asarray(rt.data)
        raw = file_rows((data if e is None else data[e]).reshape(n, -1), arch, config, g, reading=True)
        weight = from_blocks(t, raw, k, qc.weight_scheme, ts, m.weight.dtype)
        swaps[name] = QuantizedLinear(weight, m.bias, qc)
    dense = {}
    stacked: dict[str, np.ndarray] = {}  # a dense stacked tensor, dequantized once for all its experts
    for hf_name, p in model.state_dict().items():
        prefix = hf_name.rpartition(".")[0]
        if prefix in swaps and hf_name.endswith(".weight"):
            continue
        g, e = place(hf_name)
        if g is None:
            raise MinifloatError(f"{path}: {arch} tensor {hf_name!r} has no GGUF name in gguf's map")
        if g not in by_name and hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        shape = tuple(reversed(p.shape)) if transposed(arch, g) else tuple(p.shape)
        shape = (p.numel(),) if row_vector(arch, g) else shape
        rt = tensor(g, hf_name, shape if e is None else (n_expert, *shape))
        if e is None:
            arr = gguf.quants.dequantize(rt.data, rt.tensor_type).reshape(shape)
        else:
            if g not in stacked:
                stacked[g] = gguf.quants.dequantize(rt.data, rt.tensor_type).reshape(n_expert, *shape)
            arr = stacked[g][e]
        arr = file_rows(arr, arch, config, g, reading=True)
        arr = file_values(arr, arch, g, reading=True)
        dense[hf_name] = torch.from_numpy(np.array(arr, dtype=np.float32)).to(p.dtype)
    by_old = {id(model.get_submodule(n)): q for n, q in swaps.items()}
    swap_modules(model, list(swaps), lambda old: by_old[id(old)])
    model.load_state_dict(dense, strict=False)
    if config.tie_word_embeddings and hasattr(model, "tie_weights"):
        model.tie_weights()
    if unused := sorted(g for g, rt in by_name.items() if g not in used and rt.tensor_type.name in BLOCK):
        raise MinifloatError(
            f"{path}: FP4 tensors {unused[:4]} match no Linear of the {arch} model transformers built"
        )
    return model.eval()
