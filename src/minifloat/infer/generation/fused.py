"""A decode step without per-op overhead: a Llama-shaped transformers model (Llama, Mistral,
Qwen2, Qwen3; Phi-3 with its one qkv and one gate-up product, and LongRoPE's short or long tables
chosen per call as transformers chooses them; Gemma 2 and 3 with their (1 + w)
norms around each sublayer and GeGLU, Gemma 2's capped scores and logits, Gemma 3's two rotary tables; Mixtral, Qwen2-MoE, Qwen3-MoE and GPT-OSS with
their routers and experts, Qwen2-MoE's shared expert, GPT-OSS's attention sinks), GPT-2 (its Conv1D layers held as
Linears, as `minifloat.load_model` holds them), OPT (the built-in GPT's export) or the built-in GPT
run by one C call per step (``mf_decode`` in kernels/_decode.c) over its own
weights — float32 Linears read as they are, weight-only packed ones by the decode kernels with
the plans their layers already hold (Hadamard-rotated inputs rotated in C) — and a KV cache it
owns: float32, bfloat16, or FP8 / NVFP4 / MXFP4 rows packed as `KVCache` packs them (each call's
rows one chunk; with a bfloat16 window of sinks and recent tokens, each call's aged tokens one
chunk), read in place by the attention, with one of `KVCache`'s key options: a Hadamard rotation
of K (and V) rows (met by rotating the queries), pre-RoPE keys (RoPE given to each key as it is
read), or KIVI's per-channel key scales (keys aged a block of tokens at a time, scored a block at
a time).

Why C and not the eager model: on SmolLM2-135M (30 layers) an eager step runs ~600 torch
operations through transformers' Python, each paying the interpreter and the dispatcher; at
decode sizes that costs more than the products (`minifloat bench decode --profile` measures it).

Invariants: `FusedDecoder.forward` returns the eager model's logits up to float32 summation order
(the same formulas in the same order: RMSNorm, rotary embedding from the model's own tables,
softmax attention, SiLU-gated MLP; over a packed cache, up to the codes a last-bit difference in
K or V moves), and each row's as it would be alone (rows verified together equal single steps,
bit for bit, but where a packed window ages them as one chunk); the decoder holds the model's tensors, not copies, so it is
built for one generation (`generate` builds one per call) and reads the weights as they are then.
`unsupported` names, for any other model or cache, why the eager path runs instead.

Example:
    >>> import transformers
    >>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> model = transformers.LlamaForCausalLM(cfg).eval()
    >>> dec = FusedDecoder(model)
    >>> cache = dec.new_cache("fp32", capacity=16)
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> torch.allclose(dec.forward(ids, cache, last=3), model(ids).logits[0], atol=1e-5)
    True
"""

from __future__ import annotations

import ctypes
import os

import torch

from minifloat.errors import MinifloatError
from minifloat.formats.codec import value_table
from minifloat.formats.registry import get_format
from minifloat.infer.generation.hf_cache import sliding_windows
from minifloat.infer.generation.kvspec import KVSpec
from minifloat.infer.generation.kvtransforms import hadamard
from minifloat.infer.modules.linear import QuantizedLinear
from minifloat.infer.ptq.rotation import HadamardRotation
from minifloat.kernels import cpu, gemv
from minifloat.models.conv1d import Conv1DLinear
from minifloat.models.gpt import GPT
from minifloat.quant.hadamard import hadamard_signs

# model types whose decoder layer mf_decode computes
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")
_MOE_SOFTMAX_TOPK, _MOE_GPT_OSS = 0, 1  # MOE_* of _decode.c
FUSED_PROJECTIONS = {"phi3": ("qkv_proj", "gate_up_proj")}  # one product for q, k, v ([q | k | v]) and for gate, up
KV_KINDS = {"fp32": 0, "bf16": 1, "fp8": 2, "nvfp4": 3, "mxfp4": 4}  # KV_* of _decode.c: the formats it keeps
PACKED_BLOCK = {"fp8": 1, "nvfp4": 16, "mxfp4": 32}  # head_dim must be a multiple (whole blocks, whole bytes)
MAX_HEAD_DIM = 512  # the rotary embedding's scratch in _decode.c
PROFILE_KINDS = ("gemv", "attention", "norms_rope_activations")  # T_* of _decode.c: the products; attention and the cache; the rest
_P, _L, _F, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int32
_ABSENT, _DENSE, _PACKED = 0, 1, 2  # LIN_* of _decode.c
_NORM_RMS, _NORM_LAYER = 0, 1  # NORM_* of _decode.c
_ACT_DEFAULT, _ACT_GELU_TANH, _ACT_RELU = 0, 1, 2  # ACT_* of _decode.c
OPT_ACTS = {"gelu": _ACT_DEFAULT, "relu": _ACT_RELU}  # OPT's activation_function
GPT2_GELUS = {"gelu": _ACT_DEFAULT, "gelu_new": _ACT_GELU_TANH, "gelu_pytorch_tanh": _ACT_GELU_TANH}  # GPT-2's activation_function
GATED_ACTS = {"silu": _ACT_DEFAULT, "gelu_pytorch_tanh": _ACT_GELU_TANH}  # a gated MLP's (hidden_act / hidden_activation)
ACT_MODULES = {"SiLU": "silu", "SiLUActivation": "silu", "GELUTanh": "gelu_pytorch_tanh", "PytorchGELUTanh": "gelu_pytorch_tanh"}
SANDWICH = ("gemma2", "gemma3_text")  # (1 + w) RMSNorms, before and after each sublayer
TWO_ROPES = ("gemma3_text",)  # sliding layers with their own rotary tables


class Linear(ctypes.Structure):
    """``mf_lin_t`` of _decode.c, field for field."""

    _fields_ = [("w", _P), ("bias", _P), ("rot_signs", _P), ("g", gemv.GemvArgs), ("N", _L), ("K", _L), ("rot_n", _L),
                ("kind", _I), ("pad", _I)]  # fmt: skip


_LINEARS = ("q", "k", "v", "o", "gate", "up", "down")


class Layer(ctypes.Structure):
    """``mf_layer_t`` of _decode.c, field for field."""

    _fields_ = [*((n, Linear) for n in _LINEARS),
                *((n, _P) for n in ("attn_norm", "mlp_norm", "attn_norm_b", "mlp_norm_b", "q_norm", "k_norm",
                                    "attn_out_norm", "mlp_out_norm")),
                ("window", _L), ("rope2", _L), ("router", Linear), ("experts", _P),
                ("n_expert", _L), ("top_k", _L), ("norm_topk", _L), ("moe_kind", _L), ("swiglu_alpha", _F),
                ("swiglu_limit", _F), ("sinks", _P), ("shared_gate", Linear)]  # fmt: skip


class KV(ctypes.Structure):
    """``mf_kv_t`` of _decode.c, field for field."""

    _fields_ = [
        ("kind", _I), ("window", _I), ("sinks", _L), ("recent", _L), ("aged", _P), ("k", _P), ("v", _P), ("kc", _P),
        ("vc", _P), ("ks", _P), ("vs", _P), ("kts", _P), ("vts", _P), ("ksink", _P), ("vsink", _P), ("kring", _P),
        ("vring", _P), ("e4m3", _P), ("e8m0", _P), ("e2m1", _P), ("rot", _P), ("rot_t", _P), ("rot_v", _I),
        ("pre_rope", _I), ("channel", _I), ("pad", _I), ("group", _L), ("blocks", _L), ("cos_t", _P), ("sin_t", _P),
    ]  # fmt: skip


class Model(ctypes.Structure):
    """``mf_model_t`` of _decode.c, field for field."""

    _fields_ = [
        *((n, _L) for n in ("n_layer", "hidden", "n_head", "n_kv", "head_dim", "inter", "vocab", "capacity")),
        ("eps", _F), ("scale", _F), ("attn_softcap", _F), ("logit_softcap", _F), *((n, _I) for n in ("nthreads", "isa", "serial_below", "norm", "gate_up", "act")),
        ("cos", _P), ("sin", _P), ("cos2", _P), ("sin2", _P), ("layers", _P), ("final_norm", _P), ("final_norm_b", _P), ("head", Linear), ("kv", KV),
        ("timers", _P),
    ]  # fmt: skip


def _library():
    lib = gemv._library()
    if lib is None:
        return None
    if not getattr(lib, "_mf_decode_declared", False):
        lib.mf_decode.restype = ctypes.c_int
        lib.mf_decode.argtypes = [ctypes.POINTER(Model), _P, _L, _L, _L, _P]
        lib.mf_decode_sizes.restype = _L
        sizes = (_L * 5)()
        lib.mf_decode_sizes(sizes)
        mine = (ctypes.sizeof(Linear), ctypes.sizeof(Layer), ctypes.sizeof(Model), Model.timers.offset, ctypes.sizeof(KV))
        if tuple(sizes) != mine:
            raise RuntimeError(f"fused.Linear / Layer / Model do not mirror _decode.c's structs ({mine} against {tuple(sizes)})")
        lib._mf_decode_declared = True
    return lib


def _text_config(model):
    c = model.config
    return c.get_text_config(decoder=True) if hasattr(c, "get_text_config") else c


def _is_float32_cpu(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu"


def _linear_problem(name: str, lin) -> str | None:
    if type(lin) in (torch.nn.Linear, Conv1DLinear):
        ok = _is_float32_cpu(lin.weight) and (lin.bias is None or _is_float32_cpu(lin.bias))
        return None if ok else f"{name} is not a float32 CPU Linear"
    if isinstance(lin, QuantizedLinear):
        if lin.config.activation is not None:
            return f"{name} quantizes its input ({lin.config.name})"
        if lin.kept_index is not None:
            return f"{name} {lin.beyond_weight()} (the fused step reads the packed weight alone)"
        t = lin.input_transform
        if t is not None and not (type(t) is HadamardRotation and lin.in_features % t.size == 0):
            return f"{name} transforms its input by a {type(t).__name__} (the fused step applies Hadamard rotations only)"
        if not lin._prepacked.decodes(torch.empty(1, lin.in_features)):
            return f"{name}'s {lin.config.name} weight is not one the decode kernels read"
        if lin.bias is not None and not _is_float32_cpu(lin.bias):
            return f"{name}'s bias is not float32"
        return None
    return f"{name} is a {type(lin).__name__}"


def unsupported(model: torch.nn.Module, kv: KVSpec | None = None, kv_scales=None) -> str | None:
    """Why `FusedDecoder` cannot run `model` with a cache of `kv` (None: it can)."""
    if os.environ.get("MINIFLOAT_DECODE", "").strip() == "eager":
        return "MINIFLOAT_DECODE=eager"
    if _library() is None:
        return "the compiled kernels are not built"
    if kv is not None and (why := _kv_problem(kv, kv_scales)) is not None:
        return why
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return "a module has forward hooks (the fused step would not run them)"
    if isinstance(model, GPT):
        return _gpt_problem(model, kv)
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind == "gpt2":
        return _gpt2_problem(model, kv)
    if kind == "opt":
        return _opt_problem(model, kv)
    if kind not in FAMILIES:
        what = f"model type {kind!r}" if kind is not None else f"a {type(model).__name__}, not a transformers model"
        return f"{what} (the fused step runs transformers' {', '.join(FAMILIES)})"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or getattr(inner, "rotary_emb", None) is None or getattr(inner, "norm", None) is None:
        return "the model is not laid out as transformers' Llama (model.layers, model.rotary_emb, model.norm)"
    text = _text_config(model)
    if (act := _activation(text)) not in GATED_ACTS:
        return f"activation {act!r} (the fused step computes {', '.join(GATED_ACTS)})"
    head_dim = _head_dim(text)
    if head_dim > MAX_HEAD_DIM or head_dim % 2:
        return f"head_dim {head_dim}"
    if kv is not None and (why := _kv_problem(kv, kv_scales, head_dim)) is not None:
        return why
    if kv is not None and kv.pre_rope and kv.key_scales == "channel" and kind in TWO_ROPES:
        return "pre-RoPE keys scaled per channel in a model whose layers have two rotary embeddings run eagerly"
    heads, kv_heads = int(text.num_attention_heads), int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    if heads % kv_heads or heads // kv_heads > 64:
        return f"{heads} query heads over {kv_heads} KV heads"
    eps = None
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if float(rope.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        return "a partial rotary embedding (the fused step rotates the whole head)"
    if rope.get("rope_type", rope.get("type")) == "dynamic":
        return "dynamic NTK RoPE (its frequencies change with each call's last position)"
    if kv is not None and kv.pre_rope and _longrope_switch(model) is not None:
        return "pre-RoPE keys of a LongRoPE model run eagerly (their rotation depends on the call that reads them)"
    for i, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        moe = _is_moe(mlp)
        for slot, (name, lin) in _projections(kind, attn, mlp, f"layers.{i}.").items():
            if moe and slot in ("gate", "up", "down"):
                continue
            if (why := _linear_problem(name, lin)) is not None:
                return why
        sinks = getattr(attn, "sinks", None)
        if sinks is not None and not (_is_float32_cpu(sinks) and sinks.numel() == heads):
            return f"layers.{i}.self_attn.sinks are not float32, one per head"
        if moe:
            if (why := _moe_problem(f"layers.{i}.mlp", mlp, act)) is not None:
                return why
        else:
            act_fn = getattr(mlp, "activation_fn" if kind in FUSED_PROJECTIONS else "act_fn", None)
            if ACT_MODULES.get(type(act_fn).__name__) != act:
                return f"layers.{i}.mlp's activation is a {type(act_fn).__name__}, not the config's {act}"
        if float(getattr(attn, "scaling", head_dim**-0.5)) != _attention_scale(text):
            return f"layers.{i} scales attention scores by {attn.scaling}"
        for n in _norms(kind, layer):
            if not type(n).__name__.endswith("RMSNorm") or not _is_float32_cpu(n.weight):
                return f"a norm of layers.{i} is a {type(n).__name__} (the fused step computes float32 RMSNorm)"
            eps = _eps(n) if eps is None else eps
            if _eps(n) != eps:
                return "the norms' epsilons differ"
    if (why := _linear_problem("lm_head", getattr(model, "lm_head", None))) is not None:
        return why
    if not _is_float32_cpu(inner.norm.weight) or _eps(inner.norm) != eps:
        return "the final norm is not a float32 RMSNorm with the layers' epsilon"
    return None


def _router(mlp):
    """A mixture-of-experts block's router (Mixtral's and Qwen's `gate`, GPT-OSS's `router`), or None."""
    router = getattr(mlp, "gate", None) or getattr(mlp, "router", None)
    return router if hasattr(mlp, "experts") and type(router).__name__.endswith("TopKRouter") else None


def _is_moe(mlp) -> bool:
    return _router(mlp) is not None


def _fused(experts) -> bool:
    """Whether `experts` are transformers' fused 3-D parameters (not minifloat's `ExpertLinears`)."""
    return isinstance(getattr(experts, "gate_up_proj", None), torch.nn.Parameter)


def _is_gpt_oss(mlp) -> bool:
    """GPT-OSS's experts: one gate-up product (rows alternating), a clamped SwiGLU, biases."""
    experts = mlp.experts
    if _fused(experts):
        return getattr(experts, "gate_up_proj_bias", None) is not None
    return type(experts).__name__ == "ExpertLinears" and getattr(experts[0], "names", ()) is None


def _expert_weights(experts, e: int):
    """Expert `e`'s (gate, up, down) as float32 (out, in) weights or Linears: from transformers'
    fused 3-D parameters (gate rows first in gate_up_proj) or from `ExpertLinears`."""
    if _fused(experts):
        gu, inter = experts.gate_up_proj, experts.gate_up_proj.shape[1] // 2
        return gu[e, :inter], gu[e, inter:], experts.down_proj[e]
    x = experts[e]
    return tuple(getattr(x, n) for n in x.names)


def _moe_problem(name: str, mlp, act: str) -> str | None:
    """Why the fused step cannot run the mixture-of-experts block `mlp` (None: it can): a router
    without bias in float32, experts SiLU-gated without biases, fused float32 or `ExpertLinears`."""
    router, experts = _router(mlp), mlp.experts
    oss = _is_gpt_oss(mlp)
    if not _is_float32_cpu(router.weight) or (getattr(router, "bias", None) is not None and not oss):
        return f"{name}'s router is not a float32 router without bias"
    if oss:  # minifloat's per-expert Linears (load_model unfuses); transformers' fused ones hold them transposed
        if type(experts).__name__ != "ExpertLinears":
            return f"{name}.experts are transformers' fused GPT-OSS experts (load the model with minifloat.load_model)"
        for e, x in enumerate(experts):
            for n in ("gate_up_proj", "down_proj"):
                if (why := _linear_problem(f"{name}.experts.{e}.{n}", getattr(x, n))) is not None:
                    return why
        return None
    if _fused(experts):
        if experts.gate_up_proj.dim() != 3 or getattr(experts, "gate_up_proj_bias", None) is not None:
            return f"{name}.experts are not Mixtral-style fused experts (gate rows first, no biases)"
        if not (_is_float32_cpu(experts.gate_up_proj) and _is_float32_cpu(experts.down_proj)):
            return f"{name}.experts are not float32"
        act_fn = experts.act_fn
    else:
        if type(experts).__name__ != "ExpertLinears" or any(getattr(x, "names", None) is None for x in experts):
            return f"{name}.experts are a {type(experts).__name__} (the fused step runs SiLU-gated experts)"
        for e, x in enumerate(experts):
            for n in x.names:
                if (why := _linear_problem(f"{name}.experts.{e}.{n}", getattr(x, n))) is not None:
                    return why
        act_fn = experts[0].act
    if ACT_MODULES.get(type(act_fn).__name__) != "silu" or act != "silu":
        return f"{name}'s experts' activation is a {type(act_fn).__name__} (the fused step computes SiLU experts)"
    return _shared_expert_problem(name, mlp)


def _shared_expert(mlp):
    """Qwen2-MoE's shared expert (a SiLU-gated MLP) and its one-output gate, or None."""
    shared, gate = getattr(mlp, "shared_expert", None), getattr(mlp, "shared_expert_gate", None)
    return None if shared is None and gate is None else (shared, gate)


def _shared_expert_problem(name: str, mlp) -> str | None:
    """Why the fused step cannot add `mlp`'s shared expert (None: it can, or there is none)."""
    if (pair := _shared_expert(mlp)) is None:
        return None
    shared, gate = pair
    if shared is None or gate is None or getattr(gate, "out_features", None) != 1 or getattr(gate, "bias", None) is not None:
        return f"{name}'s shared expert is not a gated MLP with a one-output gate without bias (Qwen2-MoE's)"
    if ACT_MODULES.get(type(getattr(shared, "act_fn", None)).__name__) != "silu":
        return f"{name}.shared_expert's activation is a {type(getattr(shared, 'act_fn', None)).__name__} (the fused step computes SiLU)"
    for n, lin in (("gate_proj", getattr(shared, "gate_proj", None)), ("up_proj", getattr(shared, "up_proj", None)),
                   ("down_proj", getattr(shared, "down_proj", None)), ("", gate)):  # fmt: skip
        what = f"{name}.shared_expert.{n}" if n else f"{name}.shared_expert_gate"
        if (why := _linear_problem(what, lin)) is not None:
            return why
    return None


def _inter(mlp) -> int:
    """The width of `mlp`'s hidden layer (a mixture of experts: an expert's)."""
    if _is_moe(mlp) and _is_gpt_oss(mlp):
        return int(mlp.experts[0].down_proj.in_features)
    if _is_moe(mlp):
        gate = _expert_weights(mlp.experts, 0)[0]
        return int(gate.shape[0] if isinstance(gate, torch.Tensor) else gate.out_features)
    return int(mlp.down_proj.in_features)


def _activation(text) -> str:
    return getattr(text, "hidden_activation", None) or getattr(text, "hidden_act", "silu")


def _attention_scale(text) -> float:
    """The scale of the attention scores: 1/√head_dim, or Gemma's 1/√query_pre_attn_scalar."""
    scalar = getattr(text, "query_pre_attn_scalar", None)
    return float(scalar) ** -0.5 if scalar else _head_dim(text) ** -0.5


def _eps(norm) -> float:
    eps = getattr(norm, "variance_epsilon", None)
    return float(norm.eps if eps is None else eps)


def _norms(kind: str, layer) -> list:
    """A decoder layer's RMSNorms: before attention and MLP (Gemma: and after each), QK-norm."""
    attn = layer.self_attn
    around = [layer.input_layernorm, layer.post_attention_layernorm]
    if kind in SANDWICH:
        around += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
    return around + [n for n in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if n is not None]


def _gpt_problem(gpt: GPT, kv: KVSpec | None) -> str | None:
    """Why the fused step cannot run the built-in GPT `gpt` (None: it can): LayerNorms, a fused
    qkv, GELU, learned positions, every Linear float32 or weight-only packed."""
    c = gpt.config
    linears = {f"blocks.{i}.{n}": lin for i, b in enumerate(gpt.blocks)
               for n, lin in (("attn.qkv", b.attn.qkv), ("attn.proj", b.attn.proj), ("mlp.fc", b.mlp.fc), ("mlp.proj", b.mlp.proj))}  # fmt: skip
    return _layer_norm_problem(c.n_embd // c.n_head, kv, [gpt.ln_f] + [n for b in gpt.blocks for n in (b.ln1, b.ln2)],
                               {**linears, "lm_head": gpt.lm_head})  # fmt: skip


def _layer_norm_problem(d: int, kv: KVSpec | None, norms, linears: dict) -> str | None:
    """Why a GPT-shaped model (learned positions) of head_dim `d` with a cache of `kv`, its
    `norms` (the final one first) and `linears` (name → module) is not what the fused step
    computes (None: it is)."""
    if d > MAX_HEAD_DIM:
        return f"head_dim {d} (the fused step takes ≤ {MAX_HEAD_DIM})"
    if kv is not None and (why := _kv_problem(kv, None, d)) is not None:
        return why
    if kv is not None and kv.pre_rope:
        return "pre-RoPE keys need a rotary embedding; this model learns positions"
    if any(type(n) is not torch.nn.LayerNorm or n.weight is None or n.bias is None or not _is_float32_cpu(n.weight)
           or float(n.eps) != float(norms[0].eps) for n in norms):  # fmt: skip
        return "a norm is not a float32 LayerNorm with weight, bias and the model's epsilon"
    for name, lin in linears.items():
        if (why := _linear_problem(name, lin)) is not None:
            return why
    return None


def _opt_blocks(model) -> list[tuple]:
    """OPT's decoder layers as the GPT-shaped builder takes them: (norm 1, (q, k, v), out_proj, norm 2, fc1, fc2)."""
    return [(b.self_attn_layer_norm, (b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj), b.self_attn.out_proj,
             b.final_layer_norm, b.fc1, b.fc2) for b in model.model.decoder.layers]  # fmt: skip


def _opt_problem(model, kv: KVSpec | None) -> str | None:
    """Why the fused step cannot run transformers' OPT `model` (None: it can): pre-norm LayerNorm
    blocks (``do_layer_norm_before``), no projection of the embeddings, GELU or ReLU, learned
    positions (offset by 2) — the layout the built-in GPT is exported in."""
    c, d = model.config, model.config.hidden_size // model.config.num_attention_heads
    if not c.do_layer_norm_before or getattr(model.model.decoder, "project_in", None) is not None:
        return "OPT with post-norm blocks or projected embeddings (OPT-350m's layout)"
    if c.activation_function not in OPT_ACTS:
        return f"activation {c.activation_function!r} (the fused step computes {', '.join(OPT_ACTS)})"
    linears = {f"layers.{i}.{n}": lin for i, (_, qkv, o, _, fc1, fc2) in enumerate(_opt_blocks(model))
               for n, lin in (("q_proj", qkv[0]), ("k_proj", qkv[1]), ("v_proj", qkv[2]), ("out_proj", o), ("fc1", fc1), ("fc2", fc2))}  # fmt: skip
    norms = [model.model.decoder.final_layer_norm] + [n for b in _opt_blocks(model) for n in (b[0], b[3])]
    return _layer_norm_problem(d, kv, norms, {**linears, "lm_head": model.lm_head})


def _gpt2_problem(model, kv: KVSpec | None) -> str | None:
    """Why the fused step cannot run transformers' GPT-2 `model` (None: it can): the built-in GPT's
    layout (LayerNorms with biases, one qkv product, a GELU MLP, learned positions) with its Conv1D
    layers held as Linears (`minifloat.load_model` does that) and GELU exact or tanh-approximated."""
    c = model.config
    if c.activation_function not in GPT2_GELUS:
        return f"activation {c.activation_function!r} (the fused step computes {', '.join(GPT2_GELUS)})"
    if not c.scale_attn_weights or c.scale_attn_by_inverse_layer_idx or c.reorder_and_upcast_attn:
        return "GPT-2's attention scaled other than by 1/√head_dim"
    t = model.transformer
    linears = {f"h.{i}.{n}": lin for i, b in enumerate(t.h)
               for n, lin in (("attn.c_attn", b.attn.c_attn), ("attn.c_proj", b.attn.c_proj), ("mlp.c_fc", b.mlp.c_fc),
                              ("mlp.c_proj", b.mlp.c_proj))}  # fmt: skip
    if any(type(m).__name__ == "Conv1D" for m in linears.values()):
        return "its layers are transformers' Conv1D (load the model with minifloat.load_model: Conv1D as Linear)"
    return _layer_norm_problem(c.n_embd // c.n_head, kv, [t.ln_f] + [n for b in t.h for n in (b.ln_1, b.ln_2)],
                               {**linears, "lm_head": model.lm_head})  # fmt: skip


def _longrope_switch(model) -> int | None:
    """The pretraining length past which LongRoPE takes its long factors (Phi-3.5, Phi-3-128k), or None."""
    text = _text_config(model)
    rope = getattr(text, "rope_parameters", None) or {}
    if rope.get("rope_type", rope.get("type")) != "longrope":
        return None
    orig = rope.get("original_max_position_embeddings", getattr(text, "original_max_position_embeddings", None))
    return int(orig) if orig else None


def _kv_problem(kv: KVSpec, kv_scales, head_dim: int | None = None) -> str | None:
    """Why the fused step cannot keep a cache of `kv` (None: it can): a format of `KV_KINDS`,
    with a bfloat16 recent window or none, and one of: keys (and values) Hadamard-rotated, keys
    stored before RoPE, keys scaled per channel; no budget or calibrated scales."""
    handled = KVSpec(format=kv.format, sink_tokens=kv.sink_tokens, recent_tokens=kv.recent_tokens,
                     recent_format=kv.recent_format, rotate=kv.rotate, pre_rope=kv.pre_rope,
                     key_scales=kv.key_scales)  # fmt: skip
    if kv.format not in KV_KINDS or kv != handled or kv_scales is not None:
        return (f"the KV cache {kv.format!r} with these options runs eagerly (the fused step keeps "
                f"{', '.join(KV_KINDS)}, with a bf16 recent window or none, @hadamard, @hadamard-kv, @pre-rope or "
                "@channel; not budgets or calibrated scales)")  # fmt: skip
    if kv.rotate and (kv.pre_rope or kv.key_scales == "channel"):
        return "rotated keys that are also pre-RoPE or channel-scaled run eagerly (the fused step takes @hadamard alone)"
    if kv.rotate and head_dim is not None and head_dim & (head_dim - 1):
        return f"a Hadamard rotation of the head dimension needs a power of two; head_dim is {head_dim}"
    if kv.format in PACKED_BLOCK and head_dim is not None and head_dim % PACKED_BLOCK[kv.format]:
        return f"head_dim {head_dim} is not whole {kv.format} blocks of {PACKED_BLOCK[kv.format]}"
    if kv.recent_format not in (None, "bf16") or (kv.recent_format is not None and kv.format not in PACKED_BLOCK):
        return f"a {kv.recent_format} recent window before {kv.format} runs eagerly (the fused step keeps a bf16 one before a packed format)"
    return None


def _projections(kind: str, attn, mlp, prefix: str = "") -> dict[str, tuple[str, object]]:
    """A layer's Linears by `_LINEARS` slot: (name, module). Phi-3's one qkv product and one gate-up
    product sit in q's and up's slots, k, v and gate absent (as the built-in GPT's qkv)."""
    if kind in FUSED_PROJECTIONS:
        qkv, gate_up = FUSED_PROJECTIONS[kind]
        parts = {"q": ("self_attn", qkv), "o": ("self_attn", "o_proj"), "up": ("mlp", gate_up), "down": ("mlp", "down_proj")}
    else:
        parts = {p: ("self_attn", f"{p}_proj") for p in ("q", "k", "v", "o")} | {p: ("mlp", f"{p}_proj") for p in ("gate", "up", "down")}
    owners = {"self_attn": attn, "mlp": mlp}
    return {slot: (f"{prefix}{part}.{name}", getattr(owners[part], name, None)) for slot, (part, name) in parts.items()}


def _head_dim(text) -> int:
    return int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedDecoder:
    """`model`'s decoder as ``mf_decode`` takes it; see the module docstring."""

    def __init__(self, model: torch.nn.Module) -> None:
        why = unsupported(model)
        if why is not None:
            raise MinifloatError(f"the fused decode step cannot run this model: {why}")
        self.model = model
        self.lib = _library()
        self.keep: list[torch.Tensor] = []  # tensors whose addresses the structs hold
        if isinstance(model, GPT):
            self._gpt(model)
            return
        if model.config.model_type == "gpt2":
            self._gpt2(model)
            return
        if model.config.model_type == "opt":
            self._opt(model)
            return
        text = _text_config(model)
        inner = model.model
        kind = model.config.model_type
        layers = (Layer * len(inner.layers))()
        windows = sliding_windows(model.config)
        sandwich = kind in SANDWICH

        def norm(n) -> int | None:  # Gemma computes x̂ · (1 + w) in float32: the C step gets 1 + w
            return None if n is None else self._hold(n.weight.detach().float() + 1 if sandwich else n.weight)

        for i, layer in enumerate(inner.layers):
            a, m = layer.self_attn, layer.mlp
            mods, moe = _projections(kind, a, m), _is_moe(m)
            for slot in _LINEARS:
                here = slot in mods and not (moe and slot in ("gate", "up", "down"))
                setattr(layers[i], slot, self._linear(mods[slot][1]) if here else Linear(kind=_ABSENT))
            if moe:
                self._experts(layers[i], m, text)
                if (pair := _shared_expert(m)) is not None:  # in the gate, up and down slots the experts leave empty
                    shared, gate = pair
                    layers[i].gate, layers[i].up, layers[i].down = (self._linear(x) for x in (shared.gate_proj, shared.up_proj, shared.down_proj))
                    layers[i].shared_gate = self._linear(gate)
            layers[i].attn_norm = norm(layer.input_layernorm)
            layers[i].q_norm, layers[i].k_norm = norm(getattr(a, "q_norm", None)), norm(getattr(a, "k_norm", None))
            if sandwich:
                layers[i].attn_out_norm, layers[i].mlp_norm = norm(layer.post_attention_layernorm), norm(layer.pre_feedforward_layernorm)
                layers[i].mlp_out_norm = norm(layer.post_feedforward_layernorm)
                layers[i].rope2 = int(kind in TWO_ROPES and text.layer_types[i] == "sliding_attention")
            else:
                layers[i].mlp_norm = norm(layer.post_attention_layernorm)
            layers[i].window = windows[i] or 0
            if getattr(a, "sinks", None) is not None:  # GPT-OSS: a learned logit per head in the softmax
                layers[i].sinks = self._hold(a.sinks.detach().float())
        self.layers = layers
        self.n_layer = len(inner.layers)
        self.n_kv = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
        self.head_dim = _head_dim(text)
        self.vocab = int(model.lm_head.out_features)
        self.template = Model(
            n_layer=self.n_layer, hidden=int(text.hidden_size), n_head=int(text.num_attention_heads), n_kv=self.n_kv,
            head_dim=self.head_dim, inter=max(_inter(layer.mlp) for layer in inner.layers), gate_up=int(kind in FUSED_PROJECTIONS), vocab=self.vocab,
            eps=_eps(inner.norm), scale=_attention_scale(text), attn_softcap=float(getattr(text, "attn_logit_softcapping", None) or 0),
            logit_softcap=float(getattr(text, "final_logit_softcapping", None) or 0), serial_below=cpu.SERIAL_BELOW, act=GATED_ACTS[_activation(text)],
            isa=gemv.ISAS.index(gemv.best_isa()), layers=ctypes.cast(layers, _P), final_norm=norm(inner.norm),
            head=self._linear(model.lm_head),
        )  # fmt: skip

    def _gpt(self, gpt: GPT) -> None:
        """The built-in GPT: LayerNorms with biases, one qkv product (in `q`; k and v absent), a
        GELU MLP (up = fc, no gate), positions added to the embedding (`embed`), no rotary tables."""
        blocks = [(b.ln1, b.attn.qkv, b.attn.proj, b.ln2, b.mlp.fc, b.mlp.proj) for b in gpt.blocks]
        self._layer_norm_model(blocks, gpt.ln_f, gpt.lm_head, gpt.config.n_head, _ACT_DEFAULT)

    def _gpt2(self, model) -> None:
        """transformers' GPT-2 as the built-in GPT's layout: c_attn the qkv product, c_fc and c_proj
        the MLP, its GELU exact or tanh-approximated, positions added in `embed`."""
        blocks = [(b.ln_1, b.attn.c_attn, b.attn.c_proj, b.ln_2, b.mlp.c_fc, b.mlp.c_proj) for b in model.transformer.h]
        self._layer_norm_model(blocks, model.transformer.ln_f, model.lm_head, model.config.n_head,
                               GPT2_GELUS[model.config.activation_function])  # fmt: skip

    def _opt(self, model) -> None:
        """transformers' OPT (the built-in GPT's export) as the GPT-shaped layout: q, k and v
        products, fc1 and fc2 the MLP, ReLU or GELU, positions (offset by 2) added in `embed`."""
        c = model.config
        self._layer_norm_model(_opt_blocks(model), model.model.decoder.final_layer_norm, model.lm_head,
                               c.num_attention_heads, OPT_ACTS[c.activation_function])  # fmt: skip

    def _layer_norm_model(self, blocks, final_norm, head, n_head: int, act: int) -> None:
        """A GPT-shaped model from its blocks' (norm 1, qkv — one product, or (q, k, v) —, attention
        output, norm 2, fc, MLP output)."""
        layers = (Layer * len(blocks))()
        for i, (ln1, qkv, proj, ln2, fc, out) in enumerate(blocks):
            q, k, v = (self._linear(m) for m in qkv) if isinstance(qkv, tuple) else (self._linear(qkv), None, None)
            layers[i].q, layers[i].k, layers[i].v = q, k or Linear(kind=_ABSENT), v or Linear(kind=_ABSENT)
            layers[i].o, layers[i].up, layers[i].down = (self._linear(m) for m in (proj, fc, out))
            layers[i].gate = Linear(kind=_ABSENT)
            layers[i].attn_norm, layers[i].attn_norm_b = self._hold(ln1.weight), self._hold(ln1.bias)
            layers[i].mlp_norm, layers[i].mlp_norm_b = self._hold(ln2.weight), self._hold(ln2.bias)
        hidden = int(final_norm.weight.numel())
        self.layers, self.n_layer, self.n_kv = layers, len(blocks), n_head
        self.head_dim, self.vocab = hidden // n_head, int(head.out_features)
        self.template = Model(
            n_layer=len(blocks), hidden=hidden, n_head=n_head, n_kv=n_head, head_dim=self.head_dim,
            inter=int(blocks[0][4].out_features), vocab=self.vocab, eps=float(final_norm.eps), scale=self.head_dim**-0.5,
            serial_below=cpu.SERIAL_BELOW, isa=gemv.ISAS.index(gemv.best_isa()), norm=_NORM_LAYER, act=act,
            layers=ctypes.cast(layers, _P), final_norm=self._hold(final_norm.weight), final_norm_b=self._hold(final_norm.bias),
            head=self._linear(head),
        )  # fmt: skip

    def _positions(self) -> tuple[torch.nn.Embedding, int] | None:
        """The learned position embedding (the built-in GPT's, GPT-2's, OPT's) and the offset of
        position 0 in it (OPT's 2), or None (RoPE)."""
        if isinstance(self.model, GPT):
            return self.model.wpe, 0
        kind = self.model.config.model_type
        if kind == "opt":
            return self.model.model.decoder.embed_positions, 2
        return (self.model.transformer.wpe, 0) if kind == "gpt2" else None

    def embed(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        """The input rows (T, hidden) float32 of `ids` (1, T) at positions pos …: the token
        embedding, plus the learned position's for the built-in GPT (as its forward adds them)."""
        T = ids.shape[-1]
        wte = self.model.wte if isinstance(self.model, GPT) else self.model.get_input_embeddings()
        x = wte(ids.reshape(1, T))
        if (learned := self._positions()) is not None:
            wpe, offset = learned
            if pos + T > wpe.num_embeddings - offset:
                raise MinifloatError(f"positions {pos} … {pos + T - 1}: the model learned {wpe.num_embeddings - offset}")
            x = x + torch.nn.functional.embedding(torch.arange(pos + offset, pos + offset + T, device=ids.device), wpe.weight)
        return x[0].float().contiguous()

    def rope_tables(self, capacity: int, layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rotary embedding's (cos, sin) (capacity, head_dim), from the model's own module (of the
        layers of `layer_type`, for a model whose layers have two: Gemma 3's full and sliding); None
        for a model with learned positions. Computed in one call over the `capacity` positions: a
        LongRoPE module gives its long factors' tables when that passes its pretraining length."""
        if self._positions() is not None:
            return None
        if self.model.config.model_type in TWO_ROPES:
            layer_type = layer_type or "full_attention"
        extra = () if layer_type is None else (layer_type,)
        cos, sin = self.model.model.rotary_emb(torch.empty(0, dtype=torch.float32), torch.arange(capacity)[None], *extra)
        cos, sin = cos[0].float(), sin[0].float()
        if cos.shape[-1] * 2 == self.head_dim:  # GPT-OSS's half tables (x₁ cos − x₂ sin, x₂ cos + x₁ sin): rotate-half's, halved
            cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        cos, sin = cos.contiguous(), sin.contiguous()
        if cos.shape != (capacity, self.head_dim):
            raise MinifloatError(f"the rotary embedding gives tables of {tuple(cos.shape)}; the fused step needs (positions, head_dim)")
        return cos, sin

    def _hold(self, t: torch.Tensor) -> int:
        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        self.keep.append(t)
        return t.data_ptr()

    def _experts(self, layer: Layer, mlp, text) -> None:
        """A mixture-of-experts block into `layer`: its router and every expert's gate, up and down."""
        n = mlp.experts.gate_up_proj.shape[0] if _fused(mlp.experts) else len(mlp.experts)
        router, experts = _router(mlp), (Linear * (3 * n))()
        if _is_gpt_oss(mlp):  # slot 0 the gate-up product, slot 1 absent, slot 2 down; its SwiGLU's constants
            for e, x in enumerate(mlp.experts):
                experts[3 * e], experts[3 * e + 1], experts[3 * e + 2] = self._linear(x.gate_up_proj), Linear(kind=_ABSENT), self._linear(x.down_proj)
            fused = mlp.experts[0].act.__self__  # the bound _apply_gate of transformers' experts module
            layer.moe_kind, layer.swiglu_alpha, layer.swiglu_limit = _MOE_GPT_OSS, float(fused.alpha), float(fused.limit)
        else:
            for e in range(n):
                for j, w in enumerate(_expert_weights(mlp.experts, e)):
                    experts[3 * e + j] = self._linear(w)
        self.keep.append(experts)
        layer.router, layer.experts = self._linear(router.weight), ctypes.cast(experts, _P)
        if getattr(router, "bias", None) is not None:
            layer.router.bias = self._hold(router.bias.float())
        layer.n_expert, layer.top_k = n, int(router.top_k)
        layer.norm_topk = int(getattr(router, "norm_topk_prob", True))  # Mixtral's router always renormalizes

    def _linear(self, lin) -> Linear:
        """A Linear (float32 or packed) or a float32 (out, in) weight as ``mf_lin_t``."""
        if isinstance(lin, torch.Tensor):
            return Linear(N=lin.shape[0], K=lin.shape[1], kind=_DENSE, w=self._hold(lin))
        out = Linear(N=lin.out_features, K=lin.in_features, kind=_DENSE)
        if isinstance(lin, QuantizedLinear):
            lin._prepacked.decodes(torch.empty(1, lin.in_features))  # a stale plan made again
            plan = lin._prepacked.plan
            self.keep.append(plan)  # holds the parts its addresses point at
            out.kind, out.g = _PACKED, gemv.GemvArgs.from_buffer_copy(plan.args)
            if (t := lin.input_transform) is not None:  # a Hadamard rotation (`unsupported` refuses others)
                out.rot_signs, out.rot_n = self._hold(hadamard_signs(t.size, t.seed)), t.size
        else:
            out.w = self._hold(lin.weight)
        if lin.bias is not None:
            out.bias = self._hold(lin.bias.float())
        return out

    def new_cache(self, kv: str | KVSpec = "fp32", capacity: int = 2048) -> FusedCache:
        """An empty cache of `capacity` positions: a `KV_KINDS` format, or a `KVSpec` (a bf16
        recent window before a packed format, as `KVCache` keeps it)."""
        spec = kv if isinstance(kv, KVSpec) else KVSpec(format=kv)
        why = _kv_problem(spec, None, self.head_dim)
        if why is None and spec.pre_rope and self._positions() is not None:
            why = "pre-RoPE keys need a rotary embedding; this model learns positions"
        if why is None and spec.pre_rope and spec.key_scales == "channel" and getattr(self.model.config, "model_type", None) in TWO_ROPES:
            why = "pre-RoPE keys scaled per channel in a model whose layers have two rotary embeddings run eagerly"
        if why is None and spec.pre_rope and _longrope_switch(self.model) is not None:
            why = "pre-RoPE keys of a LongRoPE model run eagerly (their rotation depends on the call that reads them)"
        if why is not None:
            raise MinifloatError(f"the fused decode step cannot keep this cache: {why}")
        return FusedCache(self, spec, capacity)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, cache: FusedCache, last: int = 1) -> torch.Tensor:
        """The logits (last, vocab) of the last `last` tokens of `ids` (1, T), which continue
        what `cache` holds (it takes their K and V)."""
        T = ids.shape[-1]
        if not 1 <= last <= T:
            raise MinifloatError(f"last must be in 1 … {T}, got {last}")
        if cache.length() + T > cache.capacity:
            raise MinifloatError(f"the cache holds {cache.capacity} positions; {cache.length()} + {T} do not fit")
        x = self.embed(ids, cache.length())
        out = torch.empty(last, self.vocab, dtype=torch.float32)
        # all T rows in one call: a packed cache stores them as one chunk, as KVCache stores one update
        cache.select_rope(cache.length() + T)
        rc = self.lib.mf_decode(ctypes.byref(cache.struct), x.data_ptr(), cache.length(), T, last, out.data_ptr())
        if rc == -1:
            raise MemoryError("mf_decode: no memory for its scratch")
        if rc != 0:
            raise MinifloatError(f"mf_decode refused {T} rows at position {cache.length()} (capacity {cache.capacity})")
        cache.filled += T
        return out


class FusedCache:
    """The KV cache `FusedDecoder` owns, allocated for `capacity` positions (what `nbytes`
    counts): keys (rotated) and values per layer × KV head × position — float32 or bfloat16 rows,
    or packed ones (codes, scales and NVFP4's per-chunk tensor scales), with a bfloat16 window
    (the first `sink_tokens`, and a ring of the last `recent_tokens`) before a packed format."""

    def __init__(self, decoder: FusedDecoder, spec: KVSpec, capacity: int) -> None:
        self.spec, self.format, self.capacity, self.filled = spec, spec.format, int(capacity), 0
        self.channel = False
        L, G, C, d = decoder.n_layer, decoder.n_kv, self.capacity, decoder.head_dim
        self.struct = Model.from_buffer_copy(decoder.template)
        kv = self.struct.kv
        kv.kind = KV_KINDS[self.format]
        self.held: dict[str, torch.Tensor] = {}  # every tensor the cache holds, by name (its bytes: nbytes)

        def hold(name: str, shape, dtype) -> int:
            self.held[name] = torch.zeros(shape, dtype=dtype)
            return self.held[name].data_ptr()

        if self.format in ("fp32", "bf16"):
            dtype = torch.float32 if self.format == "fp32" else torch.bfloat16
            kv.k, kv.v = hold("k", (L, G, C, d), dtype), hold("v", (L, G, C, d), dtype)
        else:
            rb = d if self.format == "fp8" else d // 2
            scale = torch.float32 if self.format == "fp8" else torch.uint8
            ns = () if self.format == "fp8" else (d // PACKED_BLOCK[self.format],)
            self.channel = spec.key_scales == "channel"
            if self.channel:  # keys by blocks of `group` positions after the sinks, a channel's block its codes
                group = spec.group
                kv.channel, kv.group = 1, group
                kv.blocks = -(-(C - spec.sink_tokens) // group) if C > spec.sink_tokens else 0
                cb = group if self.format == "fp8" else group // 2
                kv.kc, kv.ks = hold("kc", (L, G, kv.blocks, d, cb), torch.uint8), hold("ks", (L, G, kv.blocks, d), scale)
            else:
                kv.kc, kv.ks = hold("kc", (L, G, C, rb), torch.uint8), hold("ks", (L, G, C, *ns), scale)
            kv.vc, kv.vs = hold("vc", (L, G, C, rb), torch.uint8), hold("vs", (L, G, C, *ns), scale)
            if self.format == "nvfp4":
                kv.kts, kv.vts = hold("kts", (L, C), torch.float32), hold("vts", (L, C), torch.float32)
            self.window = spec.recent_format is not None
            self.sinks = spec.sink_tokens if self.window else 0
            kv.window, kv.sinks, kv.recent = int(self.window), self.sinks, spec.recent_tokens if self.window else 0
            if self.window:
                kv.ksink, kv.vsink = (hold(n, (L, G, self.sinks, d), torch.bfloat16) for n in ("ksink", "vsink"))
                ring = kv.recent + (spec.group if self.channel else 0)  # channel keys: and a block not yet aged
                kv.kring, kv.vring = (hold(n, (L, G, ring, d), torch.bfloat16) for n in ("kring", "vring"))
            self.aged = torch.tensor([self.sinks], dtype=torch.int64)  # not the cache's bytes: mf_decode's counter
            kv.aged = self.aged.data_ptr()
            self.tables = [value_table(get_format(f), torch.float32).contiguous() for f in ("e4m3", "e8m0", "e2m1")]
            kv.e4m3, kv.e8m0, kv.e2m1 = (t.data_ptr() for t in self.tables)
        if spec.rotate:  # KVCache's rotation (the same matrix); like the tables, not the cache's bytes
            self.rotation = hadamard(d).contiguous(), hadamard(d).T.contiguous()
            kv.rot, kv.rot_t = (t.data_ptr() for t in self.rotation)
            kv.rot_v = int(spec.rotate == "kv")
        kv.pre_rope = int(spec.pre_rope)
        self.tables_rope = decoder.rope_tables(self.capacity)  # None: no rotary embedding (the GPT)
        self.struct.capacity = self.capacity
        self.struct.nthreads = torch.get_num_threads()
        # LongRoPE: transformers chooses the short or long factors per call, by whether the call's last
        # position passes the pretraining length `switch`; the same choice per mf_decode call
        self.switch = _longrope_switch(decoder.model) if self.tables_rope is not None else None
        if self.switch is not None and self.capacity > self.switch:
            long = self.tables_rope  # one call over every position: the long factors
            short = decoder.rope_tables(self.switch)  # the last: leaves the module's own frequencies short
            self.tables_long = long
            self.tables_rope = tuple(torch.cat([a, b[self.switch :]]).contiguous() for a, b in zip(short, long, strict=True))
        else:
            self.switch = None
        if self.tables_rope is not None:
            self.struct.cos, self.struct.sin = (t.data_ptr() for t in self.tables_rope)
            if getattr(decoder.model.config, "model_type", None) in TWO_ROPES:  # the sliding layers' tables
                self.tables_rope2 = decoder.rope_tables(self.capacity, "sliding_attention")
                self.struct.cos2, self.struct.sin2 = (t.data_ptr() for t in self.tables_rope2)
            if self.channel and spec.pre_rope:  # blocks of positions per channel: the tables by channel
                self.tables_by_channel = tuple(t.T.contiguous() for t in self.tables_rope)
                kv.cos_t, kv.sin_t = (t.data_ptr() for t in self.tables_by_channel)
        self.decoder = decoder  # the tensors the struct points at live as long as the cache
        self.n_layer = L
        self.events: list[dict] = []

    def length(self, layer: int = 0) -> int:
        return self.filled

    def select_rope(self, end: int) -> None:
        """The rotary tables of a call whose last position is `end` − 1: LongRoPE's long ones past
        its pretraining length, else the short ones (other models: one set, nothing to choose)."""
        if self.switch is not None:
            tables = self.tables_long if end > self.switch else self.tables_rope
            self.struct.cos, self.struct.sin = (t.data_ptr() for t in tables)

    def start_profile(self) -> None:
        """From now on mf_decode adds up its seconds per kind of work (`stop_profile` reads them)."""
        self._timers = (ctypes.c_double * len(PROFILE_KINDS))()
        self.struct.timers = ctypes.addressof(self._timers)

    def stop_profile(self) -> dict[str, float]:
        """Seconds per kind of work (`PROFILE_KINDS`) since `start_profile`; timing off again."""
        self.struct.timers = None
        return dict(zip(PROFILE_KINDS, self._timers, strict=True))

    def truncate(self, n: int) -> None:
        """Forget every position from `n` on (a speculative decoder's rejected drafts). Tokens
        that left the window stay packed, as `KVCache` keeps them."""
        if self.format in PACKED_BLOCK and self.channel and int(n) < int(self.aged[0]):
            raise MinifloatError(f"the fused cache cannot roll back to {n} tokens: keys up to {int(self.aged[0])} are "
                                 "scaled per channel in whole blocks; keep recent_tokens above the draft tokens")  # fmt: skip
        self.filled = min(self.filled, int(n))
        if self.format in PACKED_BLOCK:
            self.aged[0] = max(self.sinks, min(int(self.aged[0]), self.filled)) if self.window else self.filled

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.held.values())

    def precisions(self, layer: int = 0) -> list[str]:
        if self.format not in PACKED_BLOCK or not self.window:
            return [self.format] * self.filled
        aged = int(self.aged[0])
        return [self.format if self.sinks <= p < aged else self.spec.recent_format for p in range(self.filled)]
