"""Continued-pretraining text for a pretrained model: documents tokenized with the model's own
tokenizer, in the windows that tokenizer's conventions ask for.

Each document (a file, `minifloat.data.corpus.read_documents`) is encoded without special tokens
and followed by the tokenizer's EOS, so that a window spanning two documents sees where one ends,
as in pretraining. Where the tokenizer puts a BOS in front of a text (Llama's does, Qwen's does
not), every window starts with BOS. The last `VAL_FRACTION` of the token stream is held out for
validation.

Example:
    >>> s = TokenStream(torch.arange(10, 100), torch.arange(100, 120), bos=1, source="demo")
    >>> x, y = window_batch(s.train, 2, 4, torch.Generator().manual_seed(0), bos=s.bos)
    >>> bool((x[:, 0] == 1).all()), torch.equal(x[:, 2:], y[:, 1:3])
    (True, True)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minifloat.data.corpus import VAL_FRACTION
from minifloat.errors import MinifloatError


@dataclass(frozen=True)
class TokenStream:
    """Token ids (int64) of the training and held-out text, and the BOS each window starts with (or None)."""

    train: torch.Tensor
    val: torch.Tensor
    bos: int | None
    source: str


def adds_bos(tokenizer) -> int | None:
    """The BOS id the tokenizer puts in front of an encoded text, or None where it puts none."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = list(tokenizer("a")["input_ids"])
    return bos if ids and ids[0] == bos else None


def encode_documents(documents: list[bytes], tokenizer, source: str, *, need_eos: bool = True) -> torch.Tensor:
    """The documents as one stream of token ids (int64), each encoded without special tokens and
    followed by the tokenizer's EOS (without `need_eos`, a tokenizer that has none joins them as they are)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None and need_eos:
        raise MinifloatError(f"the tokenizer has no EOS token, which separates the documents of {source}")
    ids: list[int] = []
    for doc in documents:
        ids += tokenizer(doc.decode("utf-8", "replace"), add_special_tokens=False)["input_ids"]
        if eos is not None:
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def tokenize_documents(documents: list[bytes], tokenizer, source: str) -> TokenStream:
    """The documents as one stream (each followed by EOS), split into training and held-out ids."""
    stream = encode_documents(documents, tokenizer, source)
    n_val = max(int(len(stream) * VAL_FRACTION), 1)
    return TokenStream(stream[:-n_val].clone(), stream[-n_val:].clone(), adds_bos(tokenizer), source)


def window_batch(split: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator,
                 bos: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Random windows of `split`: inputs (B, T) and their next tokens (B, T). With a `bos`, each
    input is BOS and the first T − 1 tokens of the window, whose T tokens are the targets."""
    span = seq_len if bos is not None else seq_len + 1
    if len(split) < span:
        raise MinifloatError(f"the text has {len(split)} tokens in this split; --seq-len {seq_len} needs at least {span}: "
                             "give more text or a smaller --seq-len")  # fmt: skip
    starts = torch.randint(0, len(split) - span + 1, (batch_size,), generator=generator)
    window = split[starts[:, None] + torch.arange(span)]
    if bos is None:
        return window[:, :-1], window[:, 1:]
    return torch.cat([torch.full((batch_size, 1), bos, dtype=window.dtype), window[:, :-1]], dim=1), window
