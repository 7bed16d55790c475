"""`AdamW` with its moments stored in fewer bytes (`minifloat.optim.states`).

The update is torch's AdamW (decoupled weight decay, bias correction) computed in float32 from
the decoded moments; the new moments are encoded again after the step. ``state_format``:

- ``"fp32"``: 8 bytes a parameter (torch's AdamW);
- ``"bf16"``: 4 bytes;
- ``"fp8"``: E4M3 codes with a float32 scale per `block` values, about 2.06 bytes; the second
  moment is stored as its square root (half the dynamic range in the log domain, and the
  quantity the update divides by);
- ``"fp8-dre"``: as ``"fp8"``, each block's magnitudes first expanded over E4M3's range (COAT),
  about 2.19 bytes (E4M3 codes, the scale, and the block's centre and exponent).

``master``: what the parameters are. ``"fp32"``: as they come (float32: the FP32 master). With
BF16 parameters: ``"bf16-sr"`` rounds each updated weight to BF16 stochastically (unbiased; the
random bits a function of `seed`, the step, the parameter's index and its shard, so a resumed run
draws the same); ``"bf16+remainder"`` keeps the low 16 bits of the FP32 weight as an int16 state beside the
BF16 parameter (its nearest BF16), so the FP32 master is exact at 2 + 2 bytes a parameter.

Every state entry is a plain tensor, so ``state_dict()`` / ``load_state_dict()`` round-trip
through `torch.save` (``weights_only=True``) and minifloat's checkpoints, and a resumed run
continues bit for bit.

Under FSDP2 the parameters and gradients are DTensors sharded by rows: each process updates its
own shard and keeps that shard's states only (blocks of `block` values cut from the shard), so
the states are sharded as the parameters are; ``state_dict()`` is then this process's part, and
a resume loads each process's part into the same number of processes (`minifloat.train` saves
every rank's part in its checkpoint and refuses another world size).

Example:
    >>> p = torch.nn.Parameter(torch.randn(300))
    >>> opt = AdamW([p], lr=1e-2, state_format="fp8-dre")
    >>> p.grad = torch.randn(300)
    >>> opt.step()
    >>> sorted(opt.state[p])
    ['exp_avg.codes', 'exp_avg.dre_c', 'exp_avg.dre_k', 'exp_avg.scale', 'exp_avg_sq.codes', 'exp_avg_sq.dre_c', 'exp_avg_sq.dre_k', 'exp_avg_sq.scale', 'step']
"""

from __future__ import annotations

import functools

import torch

from minifloat.errors import MinifloatError
from minifloat.nn import Linear as QuantizedLinear
from minifloat.optim.states import (
    MASTERS,
    STATE_FORMATS,
    bf16_stochastic,
    decode_state,
    encode_state,
    join_remainder,
    split_remainder,
)


def bf16_parameters(model: torch.nn.Module, compute_dtype: torch.dtype | None = torch.float32) -> torch.nn.Module:
    """`model` with its floating-point parameters (not its buffers: amax histories stay float32)
    in bfloat16, in place — the parameters a BF16 master (``"bf16-sr"``, ``"bf16+remainder"``)
    updates. Tied parameters stay tied (each Parameter is converted once).

    The parameters are *stored* in BF16; with `compute_dtype` (float32 by default) the model still
    *computes* in it: each module holding BF16 parameters sees them cast to `compute_dtype` during
    its forward (a cast inside autograd, so gradients reach the BF16 parameter), except minifloat's
    quantized Linears, which quantize the BF16 weight directly and return their input's dtype. So
    the activations, norms and the high-precision head stay float32, as with an FP32 master, and
    only the weights' storage changes. ``compute_dtype=None``: the model computes in BF16."""
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(torch.bfloat16)
    if compute_dtype is not None:
        for module in model.modules():
            held = [n for n, p in module.named_parameters(recurse=False) if p.dtype == torch.bfloat16]
            if held and not isinstance(module, QuantizedLinear) and not getattr(module, "_minifloat_casts", False):
                module._minifloat_casts = True  # a second call adds no second pair of hooks
                module.register_forward_pre_hook(functools.partial(_cast_parameters, held, compute_dtype))
                module.register_forward_hook(_restore_parameters, always_call=True)
    return model


def _cast_parameters(names: list[str], dtype: torch.dtype, module: torch.nn.Module, args) -> None:
    # Invariant: between forwards module._parameters holds the BF16 Parameters; during one, their casts.
    module._minifloat_stored = {n: module._parameters[n] for n in names}
    for n, p in module._minifloat_stored.items():
        module._parameters[n] = p.to(dtype)


def _restore_parameters(module: torch.nn.Module, args, output) -> None:
    stored = module.__dict__.pop("_minifloat_stored", None)
    if stored:
        module._parameters.update(stored)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of `t`: the local shard of a DTensor (FSDP2's sharded parameters and
    their gradients), else `t` itself. The update and the states work on it alone."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _shard_index(p: torch.Tensor) -> int:
    """Which shard of `p` this process holds (0 for a whole tensor): part of the SR stream."""
    mesh = getattr(p, "device_mesh", None)
    return 0 if mesh is None else int(mesh.get_coordinate()[0])


class AdamW(torch.optim.Optimizer):
    """AdamW with quantized moments; see the module docstring."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, state_format: str = "fp32", master: str = "fp32", block: int = 128,
                 seed: int = 0) -> None:  # fmt: skip
        if state_format not in STATE_FORMATS:
            raise MinifloatError(f"state_format {state_format!r}: use one of {', '.join(STATE_FORMATS)}")
        if master not in MASTERS:
            raise MinifloatError(f"master {master!r}: use one of {', '.join(MASTERS)}")
        self.master, self.seed = master, int(seed)
        if not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1:
            raise MinifloatError(f"betas must be in [0, 1), got {betas}")
        if lr < 0 or eps <= 0 or weight_decay < 0 or block < 1:
            raise MinifloatError(f"lr ≥ 0, eps > 0, weight_decay ≥ 0 and block ≥ 1, got {lr}, {eps}, {weight_decay}, {block}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, state_format=state_format, block=block)
        super().__init__(params, defaults)
        if master != "fp32":
            bad = [tuple(p.shape) for g in self.param_groups for p in g["params"] if p.dtype != torch.bfloat16]
            if bad:
                raise MinifloatError(f"master {master!r} keeps the weights in bfloat16 parameters; got others (shapes {bad[:3]}): "
                                     "convert the model with .to(torch.bfloat16) first, or use master='fp32'")  # fmt: skip

    def _moment(self, state: dict, name: str, fmt: str, like: torch.Tensor) -> torch.Tensor:
        prefix = name + "."
        stored = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if not stored:
            return torch.zeros_like(like, dtype=torch.float32)
        return decode_state(stored, fmt, like.shape)

    def moments(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`p`'s first and second moments as the state holds them, decoded to float32 (zeros before
        its first step); of a sharded `p`, those of this process's shard."""
        fmt = next(g["state_format"] for g in self.param_groups if any(q is p for q in g["params"]))
        m, v = (self._moment(self.state[p], name, fmt, _local(p)) for name in ("exp_avg", "exp_avg_sq"))
        return m, v * v if fmt.startswith("fp8") else v  # fp8: stored as √v

    def _store(self, state: dict, name: str, x: torch.Tensor, fmt: str, block: int) -> None:
        for k in [k for k in state if k.startswith(name + ".")]:
            del state[k]
        for k, v in encode_state(x, fmt, block).items():
            state[f"{name}.{k}"] = v

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = -1  # the parameter's position over all groups: part of its stochastic-rounding seed
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd, fmt, block = group["lr"], group["eps"], group["weight_decay"], group["state_format"], group["block"]
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise MinifloatError("minifloat.optim.AdamW does not take sparse gradients")
                state = self.state[p]
                step = int(state.get("step", torch.tensor(0.0)).item()) + 1
                local, shard = _local(p), _shard_index(p)
                g = _local(p.grad).float()
                m = self._moment(state, "exp_avg", fmt, local)
                v = self._moment(state, "exp_avg_sq", fmt, local)
                if fmt.startswith("fp8"):
                    v = v * v  # stored as √v (`moments`)
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                bc1, bc2 = 1 - beta1**step, 1 - beta2**step
                denom = (v.sqrt() / bc2**0.5).add_(eps)
                update = (m / bc1) / denom
                w = join_remainder(local, state["remainder"]) if "remainder" in state else local.float()
                if wd:
                    w.mul_(1 - lr * wd)
                w.add_(update, alpha=-lr)
                if self.master == "bf16-sr":  # each shard of a sharded parameter draws its own bits
                    local.copy_(bf16_stochastic(w, ((self.seed * 1_000_003 + step) * 65_537 + index) * 4099 + shard))
                elif self.master == "bf16+remainder":
                    high, state["remainder"] = split_remainder(w)
                    local.copy_(high)
                else:
                    local.copy_(w)
                self._store(state, "exp_avg", m, fmt, block)
                self._store(state, "exp_avg_sq", v.sqrt() if fmt.startswith("fp8") else v, fmt, block)
                state["step"] = torch.tensor(float(step))
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, except that state tensors keep their dtypes: torch casts floating-point state to
        the parameter's dtype, which would turn E4M3 codes and BF16 moments into float32."""
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params, strict=True):
            for k, v in state_dict["state"].get(i, {}).items():
                if isinstance(v, torch.Tensor):
                    self.state[p][k] = v.to(p.device, copy=True)

    def master_weight(self, p: torch.Tensor) -> torch.Tensor:
        """`p`'s master weight in float32: exact with ``"bf16+remainder"`` (the BF16 parameter and
        its remainder joined), else the parameter itself as float32. A sharded `p` (an FSDP2
        DTensor) gives a DTensor of the same placements (``.full_tensor()`` gathers it)."""
        rem = self.state[p].get("remainder")
        local = _local(p).detach()
        w = join_remainder(local, rem) if rem is not None else local.float()
        if not hasattr(p, "device_mesh"):  # a whole tensor
            return w
        return type(p).from_local(w, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())

    def state_nbytes(self) -> int:
        """Bytes the moments and step counters hold."""
        return sum(t.nbytes for s in self.state.values() for t in s.values() if isinstance(t, torch.Tensor))
