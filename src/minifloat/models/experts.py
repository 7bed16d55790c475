"""Mixture-of-experts layers as one ``nn.Linear`` per expert weight, so that every walk over
Linears — quantization per expert, GPTQ per expert on the tokens its router sends it, smoothing,
sensitivity, the bits counted per expert — sees the experts.

transformers 5 stores the experts of Mixtral, Qwen-MoE and GPT-OSS as fused 3-D parameters
(``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I); GPT-OSS's transposed, interleaved,
with biases). `unfuse_experts` replaces such a module by `ExpertLinears`: a ``ModuleList`` of one
`ExpertMLP` per expert whose Linears carry the names of the family's per-expert checkpoints
(Mixtral's ``w1`` / ``w3`` / ``w2``, Qwen's ``gate_proj`` / ``up_proj`` / ``down_proj``), and whose
forward is the fused module's, expert by expert (the arithmetic of transformers' eager loop). The
router is not touched: it stays in high precision.

Example:
    >>> import transformers
    >>> cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
    ...                                  num_attention_heads=2, num_key_value_heads=1, num_local_experts=4)
    >>> model = transformers.MixtralForCausalLM(cfg).eval()
    >>> ids = torch.randint(0, 64, (1, 8))
    >>> with torch.no_grad(): before = model(ids).logits
    >>> unfuse_experts(model)
    1
    >>> with torch.no_grad(): after = model(ids).logits
    >>> type(model.model.layers[0].mlp.experts).__name__, torch.allclose(before, after, atol=1e-5)
    ('ExpertLinears', True)
"""

from __future__ import annotations

import torch

# Per family (config.model_type): the names of one expert's gate, up and down Linears in its checkpoints
EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "minimax": ("w1", "w3", "w2")}
DEFAULT_NAMES = ("gate_proj", "up_proj", "down_proj")


def _linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.nn.Linear:
    n, k = weight.shape
    lin = torch.nn.Linear(k, n, bias=bias is not None, device="meta", dtype=weight.dtype)
    lin.weight = torch.nn.Parameter(weight.detach().clone().contiguous())
    if bias is not None:
        lin.bias = torch.nn.Parameter(bias.detach().clone())
    return lin


class ExpertMLP(torch.nn.Module):
    """One expert: ``down(act(gate(x)) · up(x))`` with separate gate and up Linears (Mixtral, Qwen),
    or ``down(glu(gate_up(x)))`` with GPT-OSS's interleaved gate_up and its clamped GLU (`glu`)."""

    def __init__(self, names: tuple[str, str, str] | None, linears: dict[str, torch.nn.Linear], act) -> None:
        super().__init__()
        self.names, self.act = names, act
        for name, lin in linears.items():
            self.add_module(name, lin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.names is None:  # GPT-OSS: the fused module's own gate (interleaved, clamped)
            return self.down_proj(self.act(self.gate_up_proj(x)))
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(self.act(gate(x)) * up(x))


class ExpertLinears(torch.nn.ModuleList):
    """The experts of one MoE layer, an `ExpertMLP` each; called as the fused module it replaces:
    ``(hidden (T, H), top-k expert indices (T, k), their routing weights (T, k)) → (T, H)``."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        index = args[0] if args else kwargs.get("top_k_index", kwargs.get("router_indices"))
        weights = args[1] if len(args) > 1 else kwargs.get("top_k_weights", kwargs.get("routing_weights"))
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self):
            token, slot = torch.where(index == e)
            if token.numel() == 0:
                continue
            y = expert(hidden_states[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


def _is_fused(module: torch.nn.Module) -> bool:
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gu, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter) and gu.dim() == 3 and down.dim() == 3


def unfused(module: torch.nn.Module, model_type: str = "") -> ExpertLinears:
    """`module`'s experts as `ExpertLinears` (see the module docstring)."""
    gu, down = module.gate_up_proj.detach(), module.down_proj.detach()
    experts = []
    if hasattr(module, "gate_up_proj_bias"):  # GPT-OSS: x @ W (H, 2I), gate and up interleaved, biases
        for e in range(gu.shape[0]):
            linears = {"gate_up_proj": _linear(gu[e].t(), module.gate_up_proj_bias[e]),
                       "down_proj": _linear(down[e].t(), module.down_proj_bias[e])}  # fmt: skip
            experts.append(ExpertMLP(None, linears, module._apply_gate))
    else:  # Mixtral, Qwen-MoE: F.linear(x, W (2I, H)), gate rows first
        names = EXPERT_NAMES.get(model_type, DEFAULT_NAMES)
        inter = gu.shape[1] // 2
        for e in range(gu.shape[0]):
            linears = dict(zip(names, (_linear(gu[e, :inter]), _linear(gu[e, inter:]), _linear(down[e])), strict=True))
            experts.append(ExpertMLP(names, linears, module.act_fn))
    return ExpertLinears(experts)


def unfuse_experts(model: torch.nn.Module) -> int:
    """Replace every fused-experts module of `model` by its `ExpertLinears`, in place; how many."""
    model_type = getattr(getattr(model, "config", None), "model_type", "")
    n = 0
    for name, module in list(model.named_modules()):
        if _is_fused(module) and not isinstance(module, ExpertLinears):
            model.set_submodule(name, unfused(module, model_type))
            n += 1
    return n
