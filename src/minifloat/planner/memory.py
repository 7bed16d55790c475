"""`minifloat memory`: what training a model takes per device, by category — parameters, master
weights, gradients, gradient accumulator, optimizer states, activations — with every
assumption stated next to the figure.

Two layouts:
- ``te`` (Transformer Engine / Megatron): the weights are kept in the compute format, twice (the
  row-wise copy for the forward and the column-wise one for the backward's ``dgrad``; one copy
  for FP32 and BF16), beside FP32 master weights (``--master fp32``); the GEMMs' weight
  gradients come out in BF16 (FP32 for FP32) and are summed into an FP32 accumulator
  (``main_grad``); AdamW keeps two FP32 moments. This is the documents' 7B example:
  16 bytes a parameter in FP32 (112 GB), 20 in FP8 with FP32 masters (140 GB), and 4 on the
  GPU when the master weights and the optimizer go to the host (28 GB) — the FP32 accumulator
  goes with the master weights, as ZeRO-Offload keeps the FP32 gradients on the CPU side.
- ``minifloat`` (this library's training): FP32 parameters are the master and are quantized
  on the fly each forward; FP32 gradients; AdamW's two FP32 moments. The quantized copies are
  saved for the backward, so they count as activations. ``--master bf16-sr`` / ``bf16+remainder``
  (`minifloat.optim.AdamW`): BF16 parameters and gradients (the activations stay FP32: the
  parameters are cast on use), plus a 2-byte remainder for the exact FP32 master;
  ``--optimizer-states`` the moments' format.

Activations: Korthikanti et al. (2022), per transformer layer ``s·b·h·(34 + 5·a·s/h)`` bytes with
16-bit activations and no recomputation; the inputs of the four Linears (14 of the 34) are saved
in the compute format (FP8: 1 byte, MXFP8 1 + 1/32, NVFP4 0.5 + 1/16), FP32 doubles everything,
and the attention scores' ``5·a·s/h`` term is dropped with a fused (flash) attention; the loss
keeps the FP32 logits and their log-softmax (``8·s·b·vocab``). Against the tensors counted in a
real training state of the built-in GPTs (`measured_state`): within 2.5 % for the FP8, MXFP8 and
NVFP4 recipes and FP32 at the small and base sizes; BF16 autocast keeps casts of the Linear
inputs beside their FP32 sources, which this count does not model (35 % over at base).
With ``--world-size N`` every state is sharded N ways (FSDP2 / ZeRO-3); activations are per
device.

Example:
    >>> p = plan(params=7e9, precision="fp8", layout="te")
    >>> round(p.total_state() / 1e9), round(p.total_state(device_only=True, offload=("master", "optimizer")) / 1e9)
    (140, 28)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from minifloat.errors import MinifloatError
from minifloat.optim import MASTERS, STATE_FORMATS, AdamW, bf16_parameters, state_bytes

PRECISIONS = ("fp32", "bf16", "fp8", "mxfp8", "nvfp4")
# bytes per value of one stored copy of a weight (codes and block scales)
WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0, "mxfp8": 1 + 1 / 32, "nvfp4": 0.5 + 1 / 16}
# bytes per value of a saved Linear input (activations)
SAVED_INPUT_BYTES = WEIGHT_BYTES
# published shapes for the named sizes (Llama 2): hidden, layers, heads, vocabulary
SHAPES = {"7b": (4096, 32, 32, 32000), "13b": (5120, 40, 40, 32000), "70b": (8192, 80, 64, 32000)}
OFFLOADABLE = ("master", "optimizer")


@dataclass
class Plan:
    params: int
    precision: str
    layout: str
    master: str
    world_size: int
    rows: dict[str, float] = field(default_factory=dict)  # category → bytes per device, before offload
    assumptions: dict[str, str] = field(default_factory=dict)
    offload_moves: dict[str, tuple[str, ...]] = field(default_factory=dict)  # offload name → categories it moves

    def total_state(self, *, device_only: bool = False, offload: tuple[str, ...] = ()) -> float:
        """Bytes of everything but activations; with `device_only`, less what `offload` moves."""
        moved = {c for o in offload for c in self.offload_moves.get(o, ())} if device_only else set()
        return sum(v for k, v in self.rows.items() if k != "activations" and k not in moved)

    def table(self, offload: tuple[str, ...] = ()) -> list[dict]:
        moved = {c for o in offload for c in self.offload_moves.get(o, ())}
        out = [{"category": k, "bytes": v, "gib": v / 2**30, "where": "host" if k in moved else "device",
                "assumption": self.assumptions.get(k, "")} for k, v in self.rows.items()]  # fmt: skip
        device = sum(v for k, v in self.rows.items() if k not in moved)
        states = device - (self.rows.get("activations", 0.0) if "activations" not in moved else 0.0)
        out.append({"category": "states on the device (all but activations)", "bytes": states, "gib": states / 2**30,
                    "where": "device", "assumption": ""})  # fmt: skip
        out.append({"category": "total on the device", "bytes": device, "gib": device / 2**30, "where": "device", "assumption": ""})
        if moved:
            host = sum(v for k, v in self.rows.items() if k in moved)
            out.append({"category": "total on the host", "bytes": host, "gib": host / 2**30, "where": "host", "assumption": ""})
        return out


# Bytes a weight value takes on the wire when FSDP gathers it quantized (`minifloat.nn.all_gather`).
GATHERED_BYTES = {"fp8": 1.0, "mxfp8": 1 + 1 / 32}


def activation_bytes_per_sbh(precision: str, layout: str) -> float:
    """Saved bytes per layer and s·b·h: Korthikanti et al.'s 34 at 16 bits, of which the Linear
    inputs are 7 values (QKV, attention output, MLP in: h each; MLP out: 4h) saved in the compute
    format, the other 20 bytes in the high precision (FP32 under minifloat's training, whatever
    the masters: BF16 parameters are cast to FP32 on use; and for FP32; 16-bit otherwise)."""
    wide = 2.0 if precision == "fp32" or layout == "minifloat" else 1.0
    linear = 4.0 if precision == "fp32" else 2.0 if precision == "bf16" else SAVED_INPUT_BYTES[precision]
    return 20 * wide + 7 * linear


def weight_copy_bytes(precision: str) -> float:
    """Bytes per weight of the packed copy minifloat's Linear keeps for the backward: the recipes
    whose weight quantization does not depend on the orientation (per tensor, square blocks)
    keep it; the others re-quantize in the backward (0)."""
    from minifloat.recipes import get_recipe

    r = get_recipe(precision)
    s = r.scheme("weight")
    if not (s.granularity == "tensor" or r.weight_2d):
        return 0.0
    scale = 0.0 if s.granularity == "tensor" else (4 if s.scale_format == "fp32" else 1) / (s.block[0] * s.block[1])
    return s.element_format.bits / 8 + scale


def parse_params(text: str) -> tuple[int, str | None]:
    """``7B``, ``70b``, ``1.3B``, ``350M`` or a plain count → (parameters, the named shape's key)."""
    t = str(text).strip().lower()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmbt]?)", t)
    if not m:
        raise MinifloatError(f"--params {text!r}: give a count such as 7B, 70B, 350M or 123456")
    n = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2)]
    if n < 1:
        raise MinifloatError(f"--params must be ≥ 1, got {text!r}")
    return int(n), (t if t in SHAPES else None)


def plan(*, params: int, precision: str = "fp8", layout: str = "te", master: str = "fp32", optimizer: str = "adamw",
         optimizer_states: str = "fp32", world_size: int = 1, batch: int = 1, seq: int = 2048, hidden: int | None = None, layers: int | None = None,
         heads: int | None = None, vocab: int | None = None, flash: bool = True, fp8_all_gather: bool = False) -> Plan:  # fmt: skip
    """The per-device bytes of training a `params`-parameter model (module docstring)."""
    if precision not in PRECISIONS:
        raise MinifloatError(f"--precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    if layout not in ("te", "minifloat"):
        raise MinifloatError(f"--layout {layout!r}: use te or minifloat")
    if master not in (*MASTERS, "none") or (master == "none" and layout == "minifloat"):
        raise MinifloatError(f"--master {master!r}: use {', '.join(MASTERS)}" + (" or none (te layout)" if layout == "te" else ""))
    if master in ("bf16-sr", "bf16+remainder") and precision == "fp32":
        raise MinifloatError(f"--master {master} keeps BF16 weights, which --precision fp32 does not compute in")
    if optimizer not in ("adamw", "sgd"):
        raise MinifloatError(f"--optimizer {optimizer!r}: use adamw or sgd")
    if optimizer_states not in STATE_FORMATS or (optimizer == "sgd" and optimizer_states != "fp32"):
        raise MinifloatError(f"--optimizer-states {optimizer_states!r}: use one of {', '.join(STATE_FORMATS)} (with adamw; sgd keeps fp32)")
    if fp8_all_gather and (world_size < 2 or precision not in GATHERED_BYTES):
        raise MinifloatError(f"--fp8-all-gather gathers sharded weights as codes and scales: it needs --world-size ≥ 2 and "
                             f"--precision {' or '.join(GATHERED_BYTES)}, got {world_size} and {precision}")  # fmt: skip
    if world_size < 1 or batch < 1 or seq < 1:
        raise MinifloatError(f"--world-size, --batch and --seq must be ≥ 1, got {world_size}, {batch}, {seq}")
    p = Plan(params, precision, layout, master, world_size)
    n = params / world_size
    a = p.assumptions
    moments = {"adamw": 2, "sgd": 1}[optimizer]
    if layout == "minifloat":
        wide = 4 if master == "fp32" else 2
        p.rows["parameters"] = wide * n
        a["parameters"] = (f"{'FP32' if wide == 4 else 'BF16'}, also the master weights; quantized to the compute format on the "
                           "fly each forward")  # fmt: skip
        p.rows["master weights"] = 2 * n if master == "bf16+remainder" else 0.0
        a["master weights"] = {"fp32": "none beside the FP32 parameters",
                               "bf16-sr": "none: the BF16 parameters, updated with stochastic rounding",
                               "bf16+remainder": "the int16 remainders: BF16 parameter + remainder = the FP32 master"}[master]  # fmt: skip
        p.rows["gradients"] = wide * n
        a["gradients"] = f"{'FP32' if wide == 4 else 'BF16'} (the parameters' dtype)"
        p.rows["gradient accumulator"] = 0.0
        a["gradient accumulator"] = "none: micro-batches sum into the FP32 gradients"
        p.offload_moves = {"optimizer": ("optimizer states",), "master": ()}
    else:
        high = precision in ("fp32", "bf16")
        copies = 1 if high else 2
        p.rows["parameters"] = copies * WEIGHT_BYTES[precision] * n
        a["parameters"] = (f"{precision}, {'one copy' if copies == 1 else 'row-wise and column-wise copies (forward and dgrad)'}"
                           + (", codes and block scales" if precision in ("mxfp8", "nvfp4") else ""))  # fmt: skip
        master_bytes = 0 if precision == "fp32" else {"fp32": 4, "none": 0, "bf16-sr": 2, "bf16+remainder": 4}[master]
        p.rows["master weights"] = master_bytes * n
        a["master weights"] = ("none: the parameters are FP32" if precision == "fp32" else
                               {"fp32": "FP32", "none": "none (--master none)", "bf16-sr": "BF16, updated with stochastic rounding",
                                "bf16+remainder": "BF16 and its int16 remainder (TE's store_param_remainders): the FP32 master exactly"}[master])  # fmt: skip
        grad = 4 if precision == "fp32" else 2
        p.rows["gradients"] = grad * n
        a["gradients"] = f"{'FP32' if grad == 4 else 'BF16'}: the weight-gradient GEMMs' output"
        p.rows["gradient accumulator"] = 4 * n if precision != "fp32" else 0.0
        a["gradient accumulator"] = "FP32 main_grad the BF16 gradients sum into" if precision != "fp32" else "none: FP32 gradients sum in place"
        p.offload_moves = {"master": ("master weights", "gradient accumulator"), "optimizer": ("optimizer states",)}
    if layout == "minifloat" and precision not in ("fp32", "bf16"):
        kept = weight_copy_bytes(precision)
        linear = 12 * hidden * hidden * layers if hidden and layers else params
        p.rows["weight copies"] = kept * linear / world_size
        a["weight copies"] = (f"the packed weight saved for the backward, {kept:.3f} bytes a Linear weight"
                              f"{'' if hidden and layers else ' (every parameter counted as a Linear weight)'}" if kept
                              else "none: the recipe re-quantizes the weight along the other axis in the backward")  # fmt: skip
    p.rows["optimizer states"] = moments * state_bytes(round(n), optimizer_states)
    a["optimizer states"] = (f"{optimizer}: {moments} FP32 moment{'s' if moments > 1 else ''} a parameter" if optimizer_states == "fp32"
                             else f"{optimizer}: {moments} moments stored as {optimizer_states} (minifloat.optim.AdamW), "
                                  f"{state_bytes(round(n), optimizer_states) / n:.3f} bytes a parameter each")  # fmt: skip
    if world_size > 1:
        for k in list(p.rows):
            a[k] += f"; sharded {world_size} ways"
        wide = 2 if layout == "te" or master != "fp32" else 4  # what an unsharded weight is gathered as
        per = GATHERED_BYTES[precision] if fp8_all_gather else wide
        how = f"as codes and scales ({per:.3f} bytes a weight)" if fp8_all_gather else f"in {'BF16' if wide == 2 else 'FP32'}"
        wire = 2 * params * per * (world_size - 1) / world_size  # a forward and a backward gather of every weight
        if hidden and layers:
            p.rows["all-gather buffer"] = 12 * hidden * hidden * per
            a["all-gather buffer"] = (f"one layer's Linear weights (12·h²) unsharded at a time, gathered {how}; "
                                      f"{wire / 1e9:.3g} GB on the wire a step per device (forward and backward)")  # fmt: skip
        else:
            a["all-gather buffer"] = f"not counted without the shape; gathered {how}, {wire / 1e9:.3g} GB on the wire a step per device"
    if hidden and layers and heads:
        h, s, b = hidden, seq, batch
        per_sbh = activation_bytes_per_sbh(precision, layout)
        attn = 0 if flash else 5 * heads * s / h * (2 if precision == "fp32" or layout == "minifloat" else 1)
        # the output layer: the FP32 logits and their log-softmax, which the loss keeps
        out_layer = 2 * 4 * s * b * vocab if vocab else 0
        # BF16 masters: the head's weight cast to FP32 on use, which its matmul keeps for the backward
        cast_head = 4 * vocab * h if vocab and layout == "minifloat" and master != "fp32" else 0
        p.rows["activations"] = s * b * h * (per_sbh + attn) * layers + out_layer + cast_head
        a["activations"] = (f"Korthikanti et al. 2022: {per_sbh:.2f}·s·b·h{'' if flash else ' + 5as²b'} bytes a layer "
                            f"(the 4 Linear inputs in {precision}); h={h}, layers={layers}, heads={heads}, batch={b}, seq={s}"
                            + (", flash attention" if flash else "")
                            + (f"; the loss' FP32 logits and log-softmax, vocabulary {vocab}" if vocab else "")
                            + ("; the head's weight cast to FP32 for its matmul (BF16 masters)" if cast_head else ""))  # fmt: skip
    else:
        a["activations"] = "not counted: give the shape (--hidden, --layers, --heads) or a named size (7B, 13B, 70B)"
    return p


def saved_for_backward(model, forward):
    """(loss, activations, weight copies): `forward()`'s loss, and the bytes autograd keeps for its
    backward that are not `model`'s parameters — every saved storage once, plus the packed input
    (activations) and packed weight (copies) minifloat's Linear keeps on its autograd node, where
    the saved-tensor hooks do not see them (found by walking the graph)."""
    import torch

    saved: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
            st = t.untyped_storage()
            saved[st.data_ptr()] = max(saved.get(st.data_ptr(), 0), st.nbytes())
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    activations = sum(v for k, v in saved.items() if k not in params)
    copies, seen, stack = 0, set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if getattr(node, "xt", None) is not None:
            activations += node.xt.nbytes
        if getattr(node, "wq", None) is not None:
            copies += node.wq.nbytes
        stack.extend(f for f, _ in node.next_functions)
    return loss, activations, copies


def measured_state(size: str, precision: str, *, batch: int, seq: int, optimizer_states: str = "fp32",
                   master: str = "fp32") -> dict[str, int]:  # fmt: skip
    """Bytes of a real training state of the built-in GPT `size` under minifloat's training: the
    parameters, their gradients, the masters' remainders and AdamW's states after one step, and
    the tensors autograd saved for the backward of one forward (each storage counted once)."""
    import torch
    import torch.nn.functional as F

    from minifloat.models.gpt import GPT, get_config
    from minifloat.nn.convert import convert

    torch.manual_seed(0)
    model = GPT(get_config(size))
    if precision not in ("fp32", "bf16"):
        convert(model, precision, filter=lambda fqn, m: fqn != "lm_head")
    if master != "fp32":
        bf16_parameters(model)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-4) if optimizer_states == master == "fp32"
           else AdamW(model.parameters(), lr=1e-4, state_format=optimizer_states, master=master))  # fmt: skip
    ids = torch.randint(0, model.config.vocab_size, (batch, seq + 1))

    def forward():
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
            return F.cross_entropy(model(ids[:, :-1]).float().flatten(0, 1), ids[:, 1:].reshape(-1))

    loss, activations, copies = saved_for_backward(model, forward)
    loss.backward()
    opt.step()
    return {"parameters": sum(p.nbytes for p in model.parameters()),
            "gradients": sum(p.grad.nbytes for p in model.parameters() if p.grad is not None),
            "master weights": sum(s["remainder"].nbytes for s in opt.state.values() if "remainder" in s),
            "optimizer states": sum(t.nbytes for s in opt.state.values() for k, t in s.items()
                                    if isinstance(t, torch.Tensor) and t.dim() > 0 and k != "remainder"),
            "activations": activations, "weight copies": copies, "num_params": sum(p.numel() for p in model.parameters())}  # fmt: skip
