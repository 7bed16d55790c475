"""`QuantizedTensor`: packed codes + scales + the scheme that made them.

Torch functions and Tensor methods it does not implement run on its dequantized value
(``torch.add(q, 1)``, ``q @ w``, ``q == 0``, ``q[0]``, ``q.max()``, ``float(q)``), so it can
stand in for a tensor wherever exactness of the quantized representation is not needed.
``q.to(device)`` moves the codes and scales as they are, ``q.clone()`` copies them;
``q.to(dtype)`` (like ``q.float()``) gives the dequantized values. It is read-only: in-place
operations (``q.mul_(2)``, ``out=q``, ``q[0] = 1``) raise instead of changing a dequantized copy.

Example:
    >>> import minifloat
    >>> q = minifloat.quantize(torch.ones(2, 32), "mxfp8")
    >>> (q + 1).tolist()[0][:3], q.nbytes, q.max().item()
    ([2.0, 2.0, 2.0], 66, 1.0)
    >>> q.to(torch.bfloat16).dtype
    torch.bfloat16
"""

from __future__ import annotations

import torch

from minifloat import kernels
from minifloat.errors import MinifloatError
from minifloat.scaling.layout import layout_for, part_specs
from minifloat.scaling.rules import decode_scales
from minifloat.scaling.schemes import Scheme


class QuantizedTensor:
    """A tensor held as element codes and scales.

    Attributes:
        data: packed codes, uint8 of shape ``(rows_pad, cols_pad * bits / 8)``.
        scale: the decode scale of every block: float32 (FP32 schemes), uint8 E8M0 codes
            (MX) or uint8 E4M3 codes (NVFP4), shape = the scale grid.
        tensor_scale: NVFP4's float32 tensor decode scale (``1 / S_enc``), else None.
        shape: the original shape; scheme: the `Scheme`; orig_dtype: the input's dtype.
    """

    __slots__ = ("data", "scale", "tensor_scale", "shape", "scheme", "orig_dtype")

    def __init__(
        self,
        data: torch.Tensor,
        scale: torch.Tensor,
        tensor_scale: torch.Tensor | None,
        shape: torch.Size | tuple[int, ...],
        scheme: Scheme,
        orig_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.data = data
        self.scale = scale
        self.tensor_scale = tensor_scale
        self.shape = torch.Size(shape)
        self.scheme = scheme
        self.orig_dtype = orig_dtype

    # --- what it is -------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype it stands in for (that of the quantized input)."""
        return self.orig_dtype

    def numel(self) -> int:
        return self.shape.numel()

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    @property
    def nbytes(self) -> int:
        """Real bytes held: packed data + scales (+ the tensor scale)."""
        extra = self.tensor_scale.nbytes if self.tensor_scale is not None else 0
        return self.data.nbytes + self.scale.nbytes + extra

    @property
    def bits_per_element(self) -> float:
        """Element bits + block/row scale bits per element of the original shape (a single
        per-tensor scale is not counted: FP8 8.0, MXFP8 8.25, MXFP4 4.25, NVFP4 4.5)."""
        if not self.numel():
            return self.scheme.bits_per_element
        scale_bytes = 0 if self.scheme.granularity == "tensor" else self.scale.nbytes
        return 8 * (self.data.nbytes + scale_bytes) / self.numel()

    # --- conversions ------------------------------------------------------------------
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values this tensor holds, in `dtype` (NaN where a NaN was quantized)."""
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise MinifloatError(f"dequantize returns floating-point values; got dtype={dtype!r}, use e.g. torch.float32")
        check_parts(self)
        return kernels.dequantize(self.data, self.scale, self.tensor_scale, self.shape, self.scheme, dtype)

    def decode_scales(self) -> torch.Tensor:
        """The float32 decode scale of every block (the scale grid), NaN where a block is NaN."""
        return decode_scales(self.scale, self.tensor_scale, self.scheme.scale_format)

    def to(self, *args, **kwargs) -> QuantizedTensor | torch.Tensor:
        """``to(device)``: a QuantizedTensor on `device` (the codes and scales move as they are).
        With a dtype (``to(torch.bfloat16)``, ``to(device, dtype)``): the dequantized values,
        a plain tensor, as a dtype cannot hold codes and scales."""
        device, dtype, non_blocking = kwargs.pop("device", None), kwargs.pop("dtype", None), kwargs.pop("non_blocking", False)
        if kwargs:
            raise TypeError(f"QuantizedTensor.to() got unexpected arguments {sorted(kwargs)}")
        for a in args:  # as Tensor.to: a device, a dtype, or a tensor to take both from
            if isinstance(a, torch.dtype):
                dtype = a
            elif isinstance(a, torch.Tensor):
                device, dtype = a.device, a.dtype
            else:
                device = a
        if dtype is not None:
            return self.dequantize(dtype).to(device or self.device, non_blocking=non_blocking)
        if device is None:
            return self
        return self._map_parts(lambda t: t.to(device, non_blocking=non_blocking))

    def clone(self) -> QuantizedTensor:
        """A QuantizedTensor owning copies of the codes and scales (not the dequantized values)."""
        return self._map_parts(torch.Tensor.clone)

    def _map_parts(self, fn) -> QuantizedTensor:
        """The same tensor with `fn` applied to its codes and scales."""
        ts = None if self.tensor_scale is None else fn(self.tensor_scale)
        return QuantizedTensor(fn(self.data), fn(self.scale), ts, self.shape, self.scheme, self.orig_dtype)

    def cpu(self) -> QuantizedTensor:
        return self.to("cpu")

    def cuda(self, device: int | str | torch.device | None = None) -> QuantizedTensor:
        return self.to(torch.device("cuda") if device is None else torch.device("cuda", device) if isinstance(device, int) else device)

    def __repr__(self) -> str:
        return (
            f"QuantizedTensor(shape={tuple(self.shape)}, scheme={self.scheme.name!r}, "
            f"element={self.scheme.element}, bits_per_element={self.bits_per_element:.4g}, device={self.device})"
        )

    # --- everything else runs on the dequantized value --------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        outs = kwargs.get("out")
        if (
            (args and isinstance(args[0], QuantizedTensor) and (_in_place(name) or kwargs.get("inplace") is True))
            or isinstance(outs, QuantizedTensor)
            or (isinstance(outs, (list, tuple)) and any(isinstance(o, QuantizedTensor) for o in outs))
        ):
            raise _read_only(name + ("(out=q)" if outs is not None else ""))

        def unwrap(a):
            if isinstance(a, QuantizedTensor):
                return a.dequantize(a.orig_dtype)
            if isinstance(a, (list, tuple)):
                return type(a)(unwrap(b) for b in a)
            return a

        return func(*unwrap(args), **{k: unwrap(v) for k, v in kwargs.items()})

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d QuantizedTensor")
        return self.shape[0]

    def __getattr__(self, name: str):
        # Only for names the class lacks: other Tensor attributes and methods (q.max(), q.T,
        # q.numpy()) of the dequantized value. Not private or dunder names, which copy,
        # pickle and the interpreter probe for and must not see a dequantized tensor's.
        if name.startswith("_") or name in QuantizedTensor.__slots__ or not hasattr(torch.Tensor, name):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        if _in_place(name):
            raise _read_only(name)
        return getattr(self.dequantize(self.orig_dtype), name)

    def __setitem__(self, index, value) -> None:
        raise _read_only("q[...] = value")

    def __array__(self, dtype=None, copy=None):
        # NumPy 2 passes copy=: the values are dequantized into a new array, never a view
        if copy is False:
            raise ValueError("a QuantizedTensor's values are dequantized into a new array; copy=False cannot be honoured")
        a = self.dequantize(torch.float32).numpy()
        return a if dtype is None else a.astype(dtype, copy=False)


def dequantize_rows(q: QuantizedTensor, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows `index` (integers, any shape: flattened) of the 2-D `q`'s values, decoding only those
    rows: exactly ``q.dequantize(dtype)[index]`` (an embedding lookup in a packed table). Each row
    keeps its blocks' float32 decode scales (a 128×128 block's scale serves its 128 rows; NVFP4's
    E4M3 × tensor scale, the product its own decode takes) and is decoded as FP32-scaled blocks.

    Example:
        >>> from minifloat.quant import quantize
        >>> q = quantize(torch.randn(300, 64), "fp8_block128x128")
        >>> torch.equal(dequantize_rows(q, torch.tensor([7, 299])), q.dequantize()[[7, 299]])
        True
    """
    if q.dim() != 2:
        raise MinifloatError(f"dequantize_rows reads rows of a 2-D QuantizedTensor; this one has shape {tuple(q.shape)}")
    check_parts(q)
    n, k = q.shape
    idx = torch.as_tensor(index, device=q.data.device).reshape(-1)
    if idx.dtype.is_floating_point or idx.dtype == torch.bool:
        raise MinifloatError(f"row indices must be integers, got {idx.dtype}")
    if idx.numel() and not (0 <= int(idx.min()) and int(idx.max()) < n):
        raise MinifloatError(f"row index out of range: the table has {n} rows, got indices {int(idx.min())} … {int(idx.max())}")
    idx = idx.long()
    lay = layout_for(q.shape, q.scheme)
    # (rows, blocks along K): each row's decode scales, decoded from those rows' scale codes only
    per_row = decode_scales(q.scale[idx // lay.block_rows], q.tensor_scale, q.scheme.scale_format)
    rows = Scheme(element=q.scheme.element, granularity="block", block=(1, lay.block_cols))
    return kernels.dequantize(q.data[idx], per_row.contiguous(), None, (idx.numel(), k), rows, dtype)


def check_parts(q: QuantizedTensor) -> None:
    """Raise `MinifloatError` unless `q`'s parts have the dtypes and shapes its shape and scheme
    imply (`minifloat.scaling.layout.part_specs`): the kernels index them by that geometry."""
    specs = part_specs(q.shape, q.scheme)
    for part in ("data", "scale", "tensor_scale"):
        t = getattr(q, part)
        if part not in specs:
            if t is not None:
                raise MinifloatError(f"a {q.scheme.name} QuantizedTensor has no {part}; got one of shape {tuple(t.shape)}")
            continue
        dtype, shape = specs[part]
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape:
            got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise MinifloatError(
                f"the {part} of a {q.scheme.name} QuantizedTensor of shape {tuple(q.shape)} must be {dtype} of "
                f"shape {shape}; got {got}"
            )


def _in_place(name: str) -> bool:
    """torch's naming of in-place operations: ``mul_``, ``zero_``, ``copy_`` (not dunders)."""
    return name.endswith("_") and not name.startswith("_")


def _read_only(what: str) -> MinifloatError:
    return MinifloatError(
        f"a QuantizedTensor is read-only: {what} would change a dequantized copy and leave its codes "
        "as they were; work on q.dequantize() (a float tensor), and quantize the result again if needed"
    )


def _forward(name: str):
    op = getattr(torch.Tensor, name)

    def method(self, *args, **kwargs):
        return QuantizedTensor.__torch_function__(op, (), (self, *args), kwargs)

    method.__name__ = name
    return method


for _name in (
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__rtruediv__", "__matmul__", "__rmatmul__", "__neg__", "__abs__", "__pow__",
    "__rpow__", "__floordiv__", "__rfloordiv__", "__mod__", "__pos__",
    "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
    "__float__", "__int__", "__bool__", "__complex__", "__iter__", "__getitem__",
):  # dunder methods are looked up on the class, not through __getattr__
    setattr(QuantizedTensor, _name, _forward(_name))
QuantizedTensor.__hash__ = object.__hash__  # by identity, as Tensor's (a class with __eq__ loses it)
