"""A transformers model written as a GGUF file the way llama.cpp's converter lays it out, for the
tests: its tensors under `gguf`'s name map of the architecture, with the changes the converter
makes and transformers' GGUF reader undoes (Llama's Q / K rows in RoPE's interleaved order,
Gemma's norms stored as 1 + w, GPT-2's Conv1D weights transposed), the hyper-parameters under the
architecture's keys, and a byte-level BPE tokenizer of 259 tokens (256 bytes, BOS, EOS, one merge)
and any more the model's vocabulary asks.

Only what the tests need; the oracle each test compares with is the model written."""

from __future__ import annotations

import numpy as np
import torch

from minifloat.infer.checkpoints.gguf_folder import hyper_parameters

VOCAB = 259  # the tokenizer below
BOS, EOS = 256, 257


def gpt2_bytes() -> list[str]:
    """GPT-2's byte-to-unicode table (the published mapping): the 256 byte tokens of a byte-level BPE."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, map(chr, cs), strict=True))
    return [table[b] for b in range(256)]


def rope_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's order of the Q / K rows (its converter permutes them; transformers undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer(w, vocab: int, pad: int | None) -> None:
    """The byte-level BPE; a vocabulary past `VOCAB` gets Gemma's ``<mask>`` (which transformers'
    Gemma tokenizer adds when the file lacks it) and unused tokens."""
    extra = ["<mask>", *(f"<unused{i}>" for i in range(vocab - VOCAB - 1))][: vocab - VOCAB]
    w.add_tokenizer_model("gpt2")
    w.add_token_list([*gpt2_bytes(), "<s>", "<|endoftext|>", "ĠĠ", *extra])  # llama.cpp wants a merge: "Ġ Ġ" makes "ĠĠ"
    w.add_token_types([1] * 256 + [3, 3, 1] + [4] * len(extra))
    w.add_token_scores([0.0] * vocab)
    w.add_token_merges(["Ġ Ġ"])
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    if pad is not None:
        w.add_pad_token_id(pad)


def _file_tensor(name: str, t: torch.Tensor, arch: str, cfg) -> np.ndarray:
    """The tensor as llama.cpp's converter stores the transformers tensor `name`."""
    if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
        t = rope_permute(t, heads)
    if arch == "gemma3" and "norm" in name:  # Gemma computes (1 + w); the file holds 1 + w
        t = t + 1
    if arch == "gpt2" and name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
        t = t.T  # Conv1D holds (in, out)
    return t.detach().float().contiguous().numpy()


def write_gguf(model: torch.nn.Module, path, arch: str) -> torch.nn.Module:
    """Write the transformers causal LM `model` (vocabulary of `VOCAB`) to `path` as a GGUF of
    `arch` (llama, qwen2, qwen3, phi3, gemma3, gpt2) with F32 tensors; returns `model`."""
    import gguf

    cfg = model.config
    assert cfg.vocab_size >= VOCAB, "the file's tokenizer has 259 tokens and more if asked"
    layers = cfg.n_layer if arch == "gpt2" else cfg.num_hidden_layers
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), layers)
    w = gguf.GGUFWriter(str(path), arch)
    hyper_parameters(w, cfg, arch)  # the library's (tested here: transformers builds the model from these keys)
    _tokenizer(w, cfg.vocab_size, getattr(cfg, "pad_token_id", None))
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    for name, t in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue  # a tied head: llama.cpp reads token_embd
        base, _, suffix = name.rpartition(".")
        mapped = names.get_name(base)
        assert mapped is not None, f"{arch}: gguf has no name for {name}"
        w.add_tensor(f"{mapped}.{suffix}", _file_tensor(name, t, arch, cfg))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def llama_cpp_logits(path, ids: list[int]) -> torch.Tensor:
    """llama.cpp's logits of every position of `ids` under the GGUF at `path` (2 threads), FP32."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, n_threads=2, verbose=False)
    llm.eval(ids)
    return torch.tensor(np.array(llm.scores[: len(ids)]), dtype=torch.float32)
