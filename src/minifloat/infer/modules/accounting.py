"""What a model holds, counted once: bytes of tensors, of a model, of a layer, of a KV cache, and
bits per weight over an explicit scope. Every report and policy takes its figures from here.

- `model_bytes`: every parameter and buffer (a tensor shared by two names once; a tensor
  subclass, such as torchao's quantized weights, by the tensors it holds) and what a
  `QuantizedLinear`'s compute layout adds (the 128×128 blocks' padding rows).
- `layer_bytes(layer, bias=)`: a Linear's weight as stored — a `QuantizedLinear`'s codes, scales
  and input scale, a dense Linear's weight tensor — with or without its bias.
- `bits_per_weight(model, head=, embedding=)`: 8 × the stored weight bytes / the weights, over
  the model's Linears; the LM head and the embedding tables count only when asked (a head tied
  to the embedding is the embedding). One scope for every report, so two reports agree.

Example:
    >>> from minifloat.infer.modules.linear import QuantizedLinear
    >>> q = QuantizedLinear.from_linear(torch.nn.Linear(64, 32), "mxfp4-weight-only")
    >>> layer_bytes(q, bias=False), layer_bytes(q), 32 * 64 // 2 + 32 * 64 // 32
    (1088, 1216, 1088)
"""

from __future__ import annotations

import torch

from minifloat.infer.modules.embedding import QuantizedEmbedding
from minifloat.infer.modules.linear import QuantizedLinear


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer of `model` and of its compute layouts (a tensor shared
    by two names counted once; a tensor subclass, such as torchao's quantized weights, by the
    tensors it holds)."""
    seen: set = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        total += tensor_bytes(t, seen)
    # what a QuantizedLinear's compute layout holds beyond its buffers (block padding made real)
    return total + sum(m.compute_extra_nbytes() for m in model.modules() if isinstance(m, QuantizedLinear))


def tensor_bytes(t: torch.Tensor, seen: set) -> int:
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is not None and type(t) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n), seen) for n in names if isinstance(getattr(t, n), torch.Tensor))
    key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) if t.device.type != "meta" else id(t)
    if key in seen:
        return 0
    seen.add(key)
    return t.nbytes


def layer_bytes(layer: torch.nn.Module, *, bias: bool = True, compute: bool = False) -> int:
    """Bytes of a Linear's stored weight (a `QuantizedLinear`: codes, scales, input scale; a
    dense Linear or an embedding table: its weight tensor), of its bias when `bias`, and with `compute` what a
    `QuantizedLinear`'s compute layout adds (what the process holds for the layer)."""
    b = getattr(layer, "bias", None)
    extra = b.nbytes if bias and b is not None else 0
    if isinstance(layer, QuantizedLinear):
        return layer.packed_nbytes() + extra + (layer.compute_extra_nbytes() if compute else 0)
    if isinstance(layer, QuantizedEmbedding):  # tied: the head's table, which it reads
        return layer_bytes(layer.tied_to, bias=False, compute=compute) if layer.tied_to is not None else layer.packed_nbytes()
    return tensor_bytes(layer.weight, set()) + extra


def _is_head(name: str, module: torch.nn.Module, model: torch.nn.Module) -> bool:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return name.rpartition(".")[2] == "lm_head" or (head is not None and module is head)


def weight_layers(model: torch.nn.Module, *, head: bool = False, embedding: bool = False) -> dict[str, torch.nn.Module]:
    """The layers whose weights `bits_per_weight` counts: every Linear (dense or quantized), the
    head only when `head`, the embedding tables only when `embedding` (a Linear tied to an
    embedding is that embedding)."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    tied = {id(m.tied_to) for m in model.modules() if isinstance(m, QuantizedEmbedding) and m.tied_to is not None}
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.Embedding, QuantizedEmbedding)):
            if embedding:
                out[name] = m
        elif isinstance(m, QuantizedLinear) and id(m) in tied:
            continue  # the table of a tied embedding: counted as the embedding
        elif isinstance(m, (QuantizedLinear, torch.nn.Linear)) and id(getattr(m, "weight", None)) not in tables:
            if head or not _is_head(name, m, model):
                out[name] = m
    return out


def bits_per_weight(model: torch.nn.Module, *, head: bool = False, embedding: bool = False) -> float:
    """Stored bits per weight (codes and scales, weighted by weight count) over `weight_layers`."""
    layers = weight_layers(model, head=head, embedding=embedding).values()
    params = sum(m.weight.numel() for m in layers)
    return 8 * sum(layer_bytes(m, bias=False) for m in layers) / params if params else float("nan")


def linear_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every Linear's stored weight but the ones tied to an embedding (the head
    included): the ``weight_bytes`` of `evaluate`."""
    return sum(layer_bytes(m, bias=False) for m in weight_layers(model, head=True).values())
