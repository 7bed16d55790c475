"""A decode step without per-op overhead: a Llama-shaped transformers model (Llama, Mistral,
Qwen2, Qwen3) run by one C call per step (``mf_decode`` in kernels/_decode.c) over its own
weights — float32 Linears read as they are, weight-only packed ones by the decode kernels with
the plans their layers already hold — and a KV cache it owns (float32 or bfloat16).

Why C and not the eager model: on SmolLM2-135M (30 layers) an eager step runs ~600 torch
operations through transformers' Python, each paying the interpreter and the dispatcher; at
decode sizes that costs more than the products (`minifloat bench decode --profile` measures it).

Invariants: `FusedDecoder.forward` returns the eager model's logits up to float32 summation order
(the same formulas in the same order: RMSNorm, rotary embedding from the model's own tables,
softmax attention, SiLU-gated MLP); the decoder holds the model's tensors, not copies, so it is
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
from minifloat.infer.generation.hf_cache import sliding_windows
from minifloat.infer.generation.kvspec import KVSpec
from minifloat.infer.modules.linear import QuantizedLinear
from minifloat.infer.ptq.rotation import HadamardRotation
from minifloat.quant.hadamard import hadamard_signs
from minifloat.kernels import cpu, gemv

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # model types whose decoder layer mf_decode computes
KV_FORMATS = ("fp32", "bf16")  # caches mf_decode keeps (no options: a window, a budget, scales run eagerly)
MAX_HEAD_DIM = 512  # the rotary embedding's scratch in _decode.c
PROFILE_KINDS = ("gemv", "attention", "norms_rope_activations")  # T_* of _decode.c: the products; attention and the cache; the rest
_P, _L, _F, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int32
_NONE, _DENSE, _PACKED = 0, 1, 2


class Linear(ctypes.Structure):
    """``mf_lin_t`` of _decode.c, field for field."""

    _fields_ = [("w", _P), ("bias", _P), ("rot_signs", _P), ("g", gemv.GemvArgs), ("N", _L), ("K", _L), ("rot_n", _L),
                ("kind", _I), ("pad", _I)]  # fmt: skip


_LINEARS = ("q", "k", "v", "o", "gate", "up", "down")


class Layer(ctypes.Structure):
    """``mf_layer_t`` of _decode.c, field for field."""

    _fields_ = [*((n, Linear) for n in _LINEARS), *((n, _P) for n in ("attn_norm", "mlp_norm", "q_norm", "k_norm")),
                ("window", _L)]  # fmt: skip


class Model(ctypes.Structure):
    """``mf_model_t`` of _decode.c, field for field."""

    _fields_ = [
        *((n, _L) for n in ("n_layer", "hidden", "n_head", "n_kv", "head_dim", "inter", "vocab", "capacity")),
        ("eps", _F), ("scale", _F), *((n, _I) for n in ("kv_bf16", "nthreads", "isa", "serial_below")),
        ("cos", _P), ("sin", _P), ("layers", _P), ("final_norm", _P), ("head", Linear), ("k_cache", _P), ("v_cache", _P),
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
        sizes = (_L * 4)()
        lib.mf_decode_sizes(sizes)
        mine = (ctypes.sizeof(Linear), ctypes.sizeof(Layer), ctypes.sizeof(Model), Model.timers.offset)
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
    if type(lin) is torch.nn.Linear:
        ok = _is_float32_cpu(lin.weight) and (lin.bias is None or _is_float32_cpu(lin.bias))
        return None if ok else f"{name} is not a float32 CPU Linear"
    if isinstance(lin, QuantizedLinear):
        if lin.config.activation is not None:
            return f"{name} quantizes its input ({lin.config.name})"
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
    if kv is not None and (kv.format not in KV_FORMATS or kv != KVSpec(format=kv.format) or kv_scales is not None):
        return f"the KV cache {kv.format!r} with options runs eagerly (the fused step keeps {' or '.join(KV_FORMATS)}, plain)"
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        return f"model type {kind!r} (the fused step runs {', '.join(FAMILIES)})"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or getattr(inner, "rotary_emb", None) is None or getattr(inner, "norm", None) is None:
        return "the model is not laid out as transformers' Llama (model.layers, model.rotary_emb, model.norm)"
    text = _text_config(model)
    if getattr(text, "hidden_act", "silu") != "silu":
        return f"activation {text.hidden_act!r} (the fused step computes SiLU)"
    for attr in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(text, attr, None):
            return f"{attr} (the fused step does not cap logits)"
    head_dim = _head_dim(text)
    if head_dim > MAX_HEAD_DIM or head_dim % 2:
        return f"head_dim {head_dim}"
    eps = None
    for i, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = [(f"layers.{i}.self_attn.{p}_proj", getattr(attn, f"{p}_proj", None)) for p in ("q", "k", "v", "o")]
        names += [(f"layers.{i}.mlp.{p}_proj", getattr(mlp, f"{p}_proj", None)) for p in ("gate", "up", "down")]
        for name, lin in names:
            if (why := _linear_problem(name, lin)) is not None:
                return why
        if type(getattr(mlp, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
            return f"layers.{i}.mlp.act_fn is not SiLU"
        if float(getattr(attn, "scaling", head_dim**-0.5)) != head_dim**-0.5:
            return f"layers.{i} scales attention scores by {attn.scaling}"
        norms = [layer.input_layernorm, layer.post_attention_layernorm] + [
            n for n in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if n is not None]  # fmt: skip
        for n in norms:
            if not type(n).__name__.endswith("RMSNorm") or not _is_float32_cpu(n.weight):
                return f"a norm of layers.{i} is a {type(n).__name__} (the fused step computes float32 RMSNorm)"
            eps = float(n.variance_epsilon) if eps is None else eps
            if float(n.variance_epsilon) != eps:
                return "the norms' epsilons differ"
    if (why := _linear_problem("lm_head", getattr(model, "lm_head", None))) is not None:
        return why
    if not _is_float32_cpu(inner.norm.weight) or float(inner.norm.variance_epsilon) != eps:
        return "the final norm is not a float32 RMSNorm with the layers' epsilon"
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return "a module has forward hooks (the fused step would not run them)"
    return None


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
        text = _text_config(model)
        inner = model.model
        self.keep: list[torch.Tensor] = []  # tensors whose addresses the structs hold
        layers = (Layer * len(inner.layers))()
        windows = sliding_windows(model.config)
        for i, layer in enumerate(inner.layers):
            a, m = layer.self_attn, layer.mlp
            mods = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
            for name, lin in zip(_LINEARS, mods, strict=True):
                setattr(layers[i], name, self._linear(lin))
            qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
            layers[i].attn_norm = self._hold(layer.input_layernorm.weight)
            layers[i].mlp_norm = self._hold(layer.post_attention_layernorm.weight)
            layers[i].q_norm = None if qn is None else self._hold(qn.weight)
            layers[i].k_norm = None if kn is None else self._hold(kn.weight)
            layers[i].window = windows[i] or 0
        self.layers = layers
        self.n_layer = len(inner.layers)
        self.n_kv = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
        self.head_dim = _head_dim(text)
        self.vocab = int(model.lm_head.out_features)
        self.template = Model(
            n_layer=self.n_layer, hidden=int(text.hidden_size), n_head=int(text.num_attention_heads), n_kv=self.n_kv,
            head_dim=self.head_dim, inter=int(inner.layers[0].mlp.gate_proj.out_features), vocab=self.vocab,
            eps=float(inner.norm.variance_epsilon), scale=self.head_dim**-0.5, serial_below=cpu.SERIAL_BELOW,
            isa=gemv.ISAS.index(gemv.best_isa()), layers=ctypes.cast(layers, _P), final_norm=self._hold(inner.norm.weight),
            head=self._linear(model.lm_head),
        )  # fmt: skip

    def _hold(self, t: torch.Tensor) -> int:
        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        self.keep.append(t)
        return t.data_ptr()

    def _linear(self, lin) -> Linear:
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

    def new_cache(self, kv_format: str = "fp32", capacity: int = 2048) -> FusedCache:
        """An empty cache of `capacity` positions in `kv_format` (one of `KV_FORMATS`)."""
        if kv_format not in KV_FORMATS:
            raise MinifloatError(f"the fused decode step keeps a {' or '.join(KV_FORMATS)} KV cache, not {kv_format!r}")
        return FusedCache(self, kv_format, capacity)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, cache: FusedCache, last: int = 1) -> torch.Tensor:
        """The logits (last, vocab) of the last `last` tokens of `ids` (1, T), which continue
        what `cache` holds (it takes their K and V)."""
        T = ids.shape[-1]
        if not 1 <= last <= T:
            raise MinifloatError(f"last must be in 1 … {T}, got {last}")
        if cache.length() + T > cache.capacity:
            raise MinifloatError(f"the cache holds {cache.capacity} positions; {cache.length()} + {T} do not fit")
        x = self.model.get_input_embeddings()(ids.reshape(1, T))[0].float().contiguous()
        out = torch.empty(last, self.vocab, dtype=torch.float32)
        step = gemv.MAX_ROWS
        for a in range(0, T, step):
            b = min(a + step, T)
            rows = max(0, b - max(a, T - last))  # of the chunk's rows, those whose logits are asked for
            dst = out[last - (T - b) - rows :] if rows else out
            rc = self.lib.mf_decode(ctypes.byref(cache.struct), x[a].data_ptr(), cache.length(), b - a, rows, dst.data_ptr())
            if rc == -1:
                raise MemoryError("mf_decode: no memory for its scratch")
            if rc != 0:
                raise MinifloatError(f"mf_decode refused rows {a} … {b} at position {cache.length()} (capacity {cache.capacity})")
            cache.filled += b - a
        return out


class FusedCache:
    """The KV cache `FusedDecoder` owns: layer × KV head × position × head_dim keys (rotated) and
    values, float32 or bfloat16, allocated for `capacity` positions (what `nbytes` counts)."""

    def __init__(self, decoder: FusedDecoder, kv_format: str, capacity: int) -> None:
        self.format, self.capacity, self.filled = kv_format, int(capacity), 0
        dtype = torch.float32 if kv_format == "fp32" else torch.bfloat16
        shape = (decoder.n_layer, decoder.n_kv, self.capacity, decoder.head_dim)
        self.k, self.v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        rot = decoder.model.model.rotary_emb
        cos, sin = rot(torch.empty(0, dtype=torch.float32), torch.arange(self.capacity)[None])
        self.cos, self.sin = cos[0].float().contiguous(), sin[0].float().contiguous()
        if self.cos.shape != (self.capacity, decoder.head_dim):
            raise MinifloatError(f"the rotary embedding gives tables of {tuple(self.cos.shape)}; the fused step needs (positions, head_dim)")
        self.struct = Model.from_buffer_copy(decoder.template)
        self.struct.capacity, self.struct.kv_bf16 = self.capacity, int(kv_format == "bf16")
        self.struct.nthreads = torch.get_num_threads()
        self.struct.cos, self.struct.sin = self.cos.data_ptr(), self.sin.data_ptr()
        self.struct.k_cache, self.struct.v_cache = self.k.data_ptr(), self.v.data_ptr()
        self.decoder = decoder  # the tensors the struct points at live as long as the cache
        self.n_layer = decoder.n_layer
        self.events: list[dict] = []

    def length(self, layer: int = 0) -> int:
        return self.filled

    def start_profile(self) -> None:
        """From now on mf_decode adds up its seconds per kind of work (`stop_profile` reads them)."""
        self._timers = (ctypes.c_double * len(PROFILE_KINDS))()
        self.struct.timers = ctypes.addressof(self._timers)

    def stop_profile(self) -> dict[str, float]:
        """Seconds per kind of work (`PROFILE_KINDS`) since `start_profile`; timing off again."""
        self.struct.timers = None
        return dict(zip(PROFILE_KINDS, self._timers, strict=True))

    def truncate(self, n: int) -> None:
        """Forget every position from `n` on (a speculative decoder's rejected drafts)."""
        self.filled = min(self.filled, int(n))

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def precisions(self, layer: int = 0) -> list[str]:
        return [self.format] * self.filled

    def keys_values(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values (1, KV heads, length, head_dim) in float32."""
        n = self.filled
        return self.k[layer, :, :n].float()[None], self.v[layer, :, :n].float()[None]
