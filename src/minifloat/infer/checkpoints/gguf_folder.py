"""A transformers folder as the source of a GGUF file: the metadata llama.cpp's converter
(``convert_hf_to_gguf.py``) writes, made from the folder's ``config.json`` and tokenizer.

What a file of these families carries, as the converter writes it:

- the architecture (llama.cpp's name: ``llama`` for Llama and Mistral, ``qwen2``, ``qwen3``,
  ``qwen2moe``, ``qwen3moe``, ``gpt2``) and its hyper-parameters under the architecture's keys
  (context, widths, heads, the RMSNorm epsilon, RoPE's base; ``rope.dimension_count`` for llama,
  ``key_length`` / ``value_length`` where a head is not hidden / heads wide; the MoE models' expert
  count, experts per token, expert width and Qwen2-MoE's shared expert's width);
- a byte-level BPE tokenizer (``tokenizer.ggml.model = gpt2``): every id below the model's
  vocabulary size with its text, ids the tokenizer lacks as ``[PAD<id>]`` (UNUSED), added tokens
  CONTROL when special and USER_DEFINED otherwise; the merges, special ids and the chat template
  by `gguf`'s own `SpecialVocab`; ``add_bos_token`` / ``add_eos_token`` as the tokenizer does
  (whether it puts them around a text); and ``tokenizer.ggml.pre``, the name of the
  pre-tokenizer llama.cpp applies before the merges (its regular expressions in llama.cpp's
  ``llama-vocab.cpp``), found from the ``pre_tokenizer`` of the folder's ``tokenizer.json``
  (`pre_tokenizer`).

What a file cannot say the same way is refused by name before any work: a SentencePiece or
other non-byte-level tokenizer (Gemma, Phi-3, Llama 2: convert those with llama.cpp's converter),
a pre-tokenizer llama.cpp has no name for here, RoPE scaling (llama.cpp holds Llama 3's as a
``rope_freqs`` tensor that transformers' GGUF reader does not read back), a MoE model that
llama.cpp's graph would compute otherwise (routing weights renormalized where it does not, or the
other way round; dense layers among the MoE ones), an architecture outside `ARCHS`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from minifloat.errors import MinifloatError
from minifloat.models.loading import GGUF_GRAPH_FIELDS

ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2_moe": "qwen2moe",
         "qwen3_moe": "qwen3moe", "gpt2": "gpt2"}  # model_type → GGUF

# The regular expressions of tokenizer.json's Split pre-tokenizers that llama.cpp names (the
# "original regex from tokenizer.json" its llama-vocab.cpp records beside each adapted one).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
_QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# A pre-tokenizer as a tuple of its steps → llama.cpp's name for it. ByteLevel with use_regex
# splits by GPT-2's expression; llama.cpp's "smollm" splits digits first, then by GPT-2's.
PRE_TOKENIZERS = {
    (("byte_level", True),): "gpt-2",
    (("digits", True), ("byte_level", True)): "smollm",
    (("split", _LLAMA3), ("byte_level", False)): "llama-bpe",
    (("split", _QWEN2), ("byte_level", False)): "qwen2",
}


def _steps(pre: dict | None) -> tuple:
    """A tokenizer.json ``pre_tokenizer`` as the steps `PRE_TOKENIZERS` is keyed by (an unknown
    step as its JSON, so that it matches nothing)."""
    if pre is None:
        return ()
    if pre.get("type") == "Sequence":
        return tuple(s for p in pre.get("pretokenizers", []) for s in _steps(p))
    kind = pre.get("type")
    if kind == "ByteLevel" and not pre.get("add_prefix_space", False):
        return (("byte_level", bool(pre.get("use_regex", True))),)
    if kind == "Digits":
        return (("digits", bool(pre.get("individual_digits", False))),)
    if kind == "Split" and pre.get("behavior") == "Isolated" and not pre.get("invert", False):
        pattern = pre.get("pattern", {})
        return (("split", pattern.get("Regex", pattern.get("String"))),)
    return ((kind, json.dumps(pre, sort_keys=True)),)


def pre_tokenizer(tokenizer_json: dict, where: str = "tokenizer.json") -> str:
    """llama.cpp's name (``tokenizer.ggml.pre``) for the byte-level BPE `tokenizer_json`; refused
    when it is not byte-level BPE or its pre-tokenizer is none llama.cpp applies as it does."""
    model, decoder = tokenizer_json.get("model") or {}, tokenizer_json.get("decoder") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or decoder.get("type") != "ByteLevel":
        raise MinifloatError(f"{where}: the tokenizer is not a byte-level BPE (model {model.get('type')!r}, decoder "
                             f"{decoder.get('type')!r}); a GGUF is written from a transformers folder for byte-level "
                             f"BPE tokenizers (Llama 3, SmolLM, Qwen, GPT-2): convert this model with llama.cpp's "
                             f"convert_hf_to_gguf.py --outtype f32 and quantize the .gguf")  # fmt: skip
    name = PRE_TOKENIZERS.get(_steps(tokenizer_json.get("pre_tokenizer")))
    if name is None:
        raise MinifloatError(f"{where}: its pre_tokenizer ({json.dumps(tokenizer_json.get('pre_tokenizer'))[:160]}) is "
                             f"none that llama.cpp applies by a name minifloat knows ({', '.join(PRE_TOKENIZERS.values())}); "
                             f"convert this model with llama.cpp's convert_hf_to_gguf.py --outtype f32")  # fmt: skip
    return name


def is_folder(path: str | os.PathLike[str]) -> bool:
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def _config(folder: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder)
    except (ValueError, KeyError, OSError) as err:
        raise MinifloatError(f"{folder}: config.json is not a transformers model's ({type(err).__name__}: "
                             f"{str(err).splitlines()[0][:160]})") from None  # fmt: skip


def arch(folder: str | os.PathLike[str]) -> str:
    """The GGUF architecture of the transformers folder, refused with the fix when the writer
    does not make this family's file from a folder (checked with the tokenizer, before any work)."""
    folder = Path(folder)
    config = _config(folder)
    found = ARCHS.get(config.model_type)
    if found is None:
        raise MinifloatError(f"{folder}: model_type {config.model_type!r}; a GGUF is written from a transformers folder "
                             f"for {', '.join(sorted(ARCHS))}: convert this model with llama.cpp's convert_hf_to_gguf.py "
                             f"--outtype f32 and quantize the .gguf")  # fmt: skip
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise MinifloatError(f"{folder}: RoPE scaling {rope.get('rope_type', rope.get('type'))!r}; llama.cpp holds it as a "
                             f"rope_freqs tensor transformers' GGUF reader does not read back, so the writer does not make "
                             f"it from a folder: convert with llama.cpp's convert_hf_to_gguf.py --outtype f32")  # fmt: skip
    if found in GGUF_GRAPH_FIELDS:
        _check_moe(folder, config, found)
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise MinifloatError(f"{folder}: no tokenizer.json; a GGUF carries the tokenizer: save the model's fast "
                             f"tokenizer beside it (tokenizer.save_pretrained)")  # fmt: skip
    pre_tokenizer(json.loads(tokenizer_file.read_text(encoding="utf-8")), str(tokenizer_file))
    return found


def _check_moe(folder: Path, config, arch: str) -> None:
    """What llama.cpp's MoE graph of `arch` computes one way only: every layer a MoE block, the
    top-k routing weights renormalized or not as `GGUF_GRAPH_FIELDS` says (``norm_topk_prob``)."""
    want = GGUF_GRAPH_FIELDS[arch]["norm_topk_prob"]
    if bool(getattr(config, "norm_topk_prob", False)) != want:
        raise MinifloatError(f"{folder}: norm_topk_prob is {str(not want).lower()}, but llama.cpp's {arch} graph "
                             f"{'renormalizes' if want else 'does not renormalize'} the top-k routing weights, so the "
                             f"file would compute another model; a GGUF is written for these models with norm_topk_prob "
                             f"{str(want).lower()}")  # fmt: skip
    if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
        raise MinifloatError(f"{folder}: dense MLP layers among the MoE ones (mlp_only_layers "
                             f"{getattr(config, 'mlp_only_layers', None)}, decoder_sparse_step "
                             f"{getattr(config, 'decoder_sparse_step', 1)}); llama.cpp's {arch} graph makes every layer a "
                             f"MoE block")  # fmt: skip


def shapes(folder: str | os.PathLike[str]) -> list[tuple[int, ...]]:
    """The shapes of the tensors a file written from the folder holds (from the safetensors
    headers; a tied head once, as llama.cpp reads the embedding for it)."""
    from safetensors import safe_open

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise MinifloatError(f"{folder}: no .safetensors weights to write a GGUF from")
    tied = bool(getattr(_config(folder).get_text_config(decoder=True), "tie_word_embeddings", False))
    out = []
    for f in files:
        with safe_open(f, "pt") as st:
            out += [tuple(st.get_slice(k).get_shape()) for k in st.keys() if not (tied and k == "lm_head.weight")]
    return out


def hyper_parameters(w, cfg, arch: str) -> None:
    """The architecture's hyper-parameter keys of the transformers text config `cfg`, as llama.cpp's
    converter writes them (Gemma 3 too: its global layers' RoPE base and its sliding window)."""
    if arch == "gpt2":
        w.add_context_length(cfg.n_positions)
        w.add_embedding_length(cfg.n_embd)
        w.add_block_count(cfg.n_layer)
        w.add_feed_forward_length(cfg.n_inner or 4 * cfg.n_embd)
        w.add_head_count(cfg.n_head)
        w.add_layer_norm_eps(cfg.layer_norm_epsilon)
        w.add_vocab_size(cfg.vocab_size)
        return
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' base (the local ones' is llama.cpp's default)
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    w.add_vocab_size(cfg.vocab_size)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    if arch in ("qwen3", "qwen3moe", "gemma3") or head_dim != cfg.hidden_size // cfg.num_attention_heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
    if arch in ("qwen3moe", "qwen2moe"):  # the experts: how many, how many a token takes, each one's width
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":  # and the shared expert's
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def _tokenizer(w, folder: Path, vocab_size: int) -> None:
    import gguf
    from transformers import AutoTokenizer

    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    tok = AutoTokenizer.from_pretrained(folder)
    by_id = {i: t for t, i in tok.get_vocab().items()}
    if max(by_id) >= vocab_size:
        raise MinifloatError(f"{folder}: the tokenizer has ids up to {max(by_id)}, past the model's vocab_size "
                             f"{vocab_size}")  # fmt: skip
    added = {a["content"]: bool(a.get("special")) for a in data.get("added_tokens", [])}
    tokens, types = [], []
    for i in range(vocab_size):
        t = by_id.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif t in added:
            tokens.append(t)
            types.append(gguf.TokenType.CONTROL if added[t] else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(t)
            types.append(gguf.TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre_tokenizer(data, str(folder / "tokenizer.json")))
    w.add_token_list(tokens)
    w.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size)
    # whether a text gets BOS / EOS: what the tokenizer does, whatever its files say
    ids = tok("a")["input_ids"]
    special.add_special_token = {"bos": tok.bos_token_id is not None and ids[:1] == [tok.bos_token_id],
                                 "eos": tok.eos_token_id is not None and ids[-1:] == [tok.eos_token_id]}  # fmt: skip
    special.add_to_gguf(w, quiet=True)


def add_metadata(w, folder: str | os.PathLike[str], arch: str) -> None:
    """The keys llama.cpp's converter writes for the folder's model and tokenizer (module docstring)."""
    folder = Path(folder)
    cfg = _config(folder).get_text_config(decoder=True)
    w.add_name(folder.resolve().name)
    hyper_parameters(w, cfg, arch)
    _tokenizer(w, folder, cfg.vocab_size)
