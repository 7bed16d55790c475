"""GPT-2's ``Conv1D`` held as an ``nn.Linear``, so that every walk over Linears (quantization,
GPTQ, smoothing, sensitivity, LoRA) sees it.

transformers' ``Conv1D`` computes ``x W + b`` with its weight stored (in_features, out_features):
an ``nn.Linear`` whose weight is the transpose. `Conv1DLinear` holds ``Wᵀ`` as a Linear does and
writes and reads its state dict in Conv1D's layout, so ``save_pretrained``, an export's dense
tensors and a reload stay GPT-2's. A checkpoint reader quantizes ``nn.Linear`` only, so an export
keeps these layers in high precision (`minifloat.infer.quantize`).

Example:
    >>> from transformers.pytorch_utils import Conv1D
    >>> conv = Conv1D(6, 4)  # nf=6 outputs, nx=4 inputs
    >>> lin = Conv1DLinear.from_conv1d(conv)
    >>> x = torch.randn(2, 4)
    >>> torch.allclose(lin(x), conv(x)), tuple(lin.weight.shape), tuple(lin.state_dict()["weight"].shape)
    (True, (6, 4), (4, 6))
"""

from __future__ import annotations

import torch


class Conv1DLinear(torch.nn.Linear):
    """An ``nn.Linear`` that was a transformers ``Conv1D`` (its state dict in Conv1D's layout)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._register_state_dict_hook(_to_conv1d_layout)
        self._register_load_state_dict_pre_hook(_from_conv1d_layout)

    @classmethod
    def from_conv1d(cls, conv: torch.nn.Module) -> Conv1DLinear:
        nx, nf = conv.weight.shape
        lin = cls(nx, nf, bias=conv.bias is not None, device="meta", dtype=conv.weight.dtype)
        lin.weight = torch.nn.Parameter(conv.weight.detach().t().contiguous(), requires_grad=conv.weight.requires_grad)
        if conv.bias is not None:
            lin.bias = conv.bias
        return lin


def _to_conv1d_layout(module, state_dict, prefix, local_metadata):
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = state_dict[key].t()
    return state_dict


def _from_conv1d_layout(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = state_dict[key].t()


def linears_from_conv1d(model: torch.nn.Module) -> int:
    """Replace every transformers ``Conv1D`` of `model` by its `Conv1DLinear`, in place; how many."""
    n = 0
    for name, module in list(model.named_modules()):
        if type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers"):
            model.set_submodule(name, Conv1DLinear.from_conv1d(module))
            n += 1
    return n
