"""hf-fp8: transformers' fine-grained FP8 (DeepSeek-V3's weights), one module for both directions.

``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128], "modules_to_not_convert": [...]}``; per quantized layer ``<p>``:
``<p>.weight`` float8_e4m3fn and ``<p>.weight_scale_inv`` float32 (⌈N/128⌉, ⌈K/128⌉), multiplied
on dequantize despite its name. It holds one config, the one `holds` accepts (fp8-block); a
partial 128×128 block is refused: transformers' loader dequantizes only whole blocks on a CPU.
"""

from __future__ import annotations

import torch

from minifloat.errors import MinifloatError
from minifloat.infer.checkpoints.tensors import FLOATS, CheckpointTensors, codes
from minifloat.infer.ptq.config import QUANT_CONFIGS, QuantConfig
from minifloat.quant import QuantizedTensor
from minifloat.scaling.schemes import Scheme

NAME = "hf-fp8"
QUANT_METHOD = "fp8"
SCALE_TENSOR = "weight_scale_inv"
CONVERTS_OUTPUT_EMBEDDING = False  # transformers' loader never converts the head, listed or not


def holds(config: QuantConfig) -> bool:
    """Whether the format holds `config`: E4M3 weights with FP32 scales per 128×128 block, inputs
    E4M3 per 1×128 group, each input's own."""
    w, a = config.weight_scheme, config.activation_scheme
    e4m3_blocks = lambda s, block: (  # noqa: E731
        s is not None and s.element == "e4m3" and s.granularity == "block" and tuple(s.block) == block
        and s.scale_format == "fp32"
    )  # fmt: skip
    return e4m3_blocks(w, (128, 128)) and e4m3_blocks(a, (1, 128)) and not config.static


def unreadable(s: Scheme, n: int, k: int) -> str | None:
    """Why transformers' fine-grained FP8 loader cannot load an (n, k) weight in `s`, or None."""
    if s.granularity == "block" and (n % s.block[0] or k % s.block[1]):
        return (f"({n}×{k}) has a partial 128×128 block, which transformers' fine-grained FP8 loader does not "
                f"dequantize on a CPU (format 'compressed-tensors' pads it)")  # fmt: skip
    return None


def layer_tensors(prefix: str, q: QuantizedTensor, config: QuantConfig, input_amax: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The tensors of one quantized layer's weight `q` (see the module docstring)."""
    if not holds(config):
        raise MinifloatError(f"format 'hf-fp8' holds fp8-block layers (E4M3 weights in 128×128 blocks, inputs in "
                             f"dynamic 1×128 groups); {prefix} is {config.name} ({config.weight}, input "
                             f"{config.activation}): use 'compressed-tensors'")  # fmt: skip
    return {f"{prefix}.weight": codes(q).view(torch.float8_e4m3fn), f"{prefix}.weight_scale_inv": q.scale.contiguous()}


def quantization_config(layers: dict[str, QuantConfig], ignore: list[str]) -> dict:
    configs = list(dict.fromkeys(layers.values()))
    if len(configs) != 1:
        raise MinifloatError(f"format 'hf-fp8' holds one config; this model mixes {[c.name for c in configs]}")
    return {"quant_method": QUANT_METHOD, "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "modules_to_not_convert": ignore}  # fmt: skip


def configs(qc: dict) -> list[tuple[list[str], QuantConfig]]:
    """The one config of an hf-fp8 ``quantization_config``, for every Linear."""
    if qc.get("fmt", "e4m3") != "e4m3" or list(qc.get("weight_block_size") or []) != [128, 128]:
        raise MinifloatError(f"hf-fp8 checkpoint with fmt={qc.get('fmt')!r}, weight_block_size="
                             f"{qc.get('weight_block_size')!r}: minifloat reads e4m3 with [128, 128] blocks")  # fmt: skip
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise MinifloatError(f"hf-fp8 activation_scheme={qc.get('activation_scheme')!r}: only 'dynamic' is read")
    return [(["Linear"], QUANT_CONFIGS["fp8-block"])]


def ignored(qc: dict) -> list[str]:
    return list(qc.get("modules_to_not_convert") or [])


def read_scales(p: str, c: QuantConfig, n: int, grid: tuple[int, int], ts: CheckpointTensors):
    return ts.get(f"{p}.weight_scale_inv", FLOATS, grid).float(), None


def read_input_amax(p: str, c: QuantConfig, ts: CheckpointTensors) -> None:
    return None  # dynamic inputs only
