"""`QuantizedEmbedding`: an embedding lookup in a packed table, decoding only the rows it reads.

Tied to a quantized LM head (``tied_to=head``, the head a `QuantizedLinear` over the same table),
it holds no tensor of its own: the head and the lookup read one packed table, as the tied pair
shared one float table. Untied, it holds the table's parts as buffers (``weight_data``,
``weight_scale``, ``weight_tensor_scale`` for NVFP4), which ``.to(device)`` and ``state_dict``
carry. Either way a lookup of T tokens decodes T rows (`minifloat.quant.dequantize_rows`), exactly
the rows of the dequantized table, in the embedding's dtype.

Example:
    >>> from minifloat.quant import quantize
    >>> table = quantize(torch.randn(100, 32), "mxfp8")
    >>> emb = QuantizedEmbedding(table)
    >>> ids = torch.tensor([[3, 99]])
    >>> torch.equal(emb(ids), table.dequantize()[ids])
    True
"""

from __future__ import annotations

import torch

from minifloat.errors import MinifloatError
from minifloat.infer.modules.linear import QuantizedLinear, apply_keeping_dtype
from minifloat.quant import QuantizedTensor, dequantize_rows


class QuantizedEmbedding(torch.nn.Module):
    """``table[ids]`` from a packed table; see the module docstring."""

    _EXACT = ("weight_scale", "weight_tensor_scale")  # float32 by the formats' definition

    def __init__(self, weight: QuantizedTensor | None = None, *, tied_to: QuantizedLinear | None = None,
                 dtype: torch.dtype = torch.float32, padding_idx: int | None = None) -> None:  # fmt: skip
        super().__init__()
        if (weight is None) == (tied_to is None):
            raise MinifloatError("QuantizedEmbedding takes a packed table (weight) or the head it is tied to (tied_to), one of them")
        # not a submodule: the head is the model's own module, listed (and moved) where it lives
        object.__setattr__(self, "tied_to", tied_to)
        if weight is not None:
            if not isinstance(weight, QuantizedTensor) or weight.dim() != 2:
                raise MinifloatError("QuantizedEmbedding takes a 2-D QuantizedTensor table (num_embeddings, embedding_dim)")
            self._meta = (weight.shape, weight.scheme, weight.orig_dtype)
            self.register_buffer("weight_data", weight.data)
            self.register_buffer("weight_scale", weight.scale)
            self.register_buffer("weight_tensor_scale", weight.tensor_scale)
        self.num_embeddings, self.embedding_dim = self.weight.shape
        self.dtype, self.padding_idx = dtype, padding_idx

    @property
    def weight(self) -> QuantizedTensor:
        """The packed table (the head's own, when tied)."""
        if self.tied_to is not None:
            return self.tied_to.weight
        return QuantizedTensor(self.weight_data, self.weight_scale, self.weight_tensor_scale, *self._meta)

    def _apply(self, fn, recurse=True):
        """``.to(device)`` moves every part; a dtype conversion changes only the output dtype:
        rounding a float32 scale would change the values the codes stand for."""
        apply_keeping_dtype(self, fn, recurse, self._EXACT)
        probe = fn(torch.empty(0, dtype=self.dtype))
        if probe.dtype.is_floating_point:
            self.dtype = probe.dtype
        return self

    def packed_nbytes(self) -> int:
        """Bytes this module holds for the table (0 when tied: the head holds it)."""
        return sum(b.nbytes for b in self.buffers())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize_rows(self.weight, ids, self.dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        tied = ", tied to the LM head" if self.tied_to is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}, scheme={self.weight.scheme.name}{tied}"
