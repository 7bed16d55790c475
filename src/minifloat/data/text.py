"""Text for calibration and evaluation, as token ids: where it comes from (`TextSource`: a corpus
from `minifloat.data.corpus`, the Python standard library's sources by default), how it becomes
ids (bytes, the built-in GPT's vocabulary, or a transformers tokenizer saved beside the model)
and the fixed windows every model is scored on (`token_batches`).

Calibration windows come from a corpus's training split, evaluation windows from its held-out
split, so that a model is never scored on the text its scales were fitted to.

Example:
    >>> batches = token_batches(b"hello world, " * 200, batch_size=2, seq_len=32, n_batches=2)
    >>> len(batches), tuple(batches[0].shape)
    (2, (2, 33))
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from minifloat import checkpoint
from minifloat.data.corpus import VAL_FRACTION, Corpus, load_corpus, stdlib_corpus
from minifloat.data.tokens import adds_bos, encode_documents
from minifloat.errors import MinifloatError


@dataclasses.dataclass(frozen=True)
class TextSource:
    """Where evaluation and calibration text comes from, and how it becomes token ids."""

    data: str | None = None  # a text file or folder; None: the Python stdlib sources
    calib: str | None = None  # text to calibrate on (its training split); None: `data`'s training split
    max_bytes: int = 4_000_000
    batch_size: int = 8
    seq_len: int = 128
    eval_batches: int = 16
    calib_batches: int = 8

    def corpus(self, split: str = "val") -> Corpus:
        """The corpus a split's windows come from: `calib` for calibration (``"train"``) if given."""
        if split == "train" and self.calib is not None:
            return load_corpus(self.calib, self.max_bytes, option="--calib")
        return stdlib_corpus(self.max_bytes) if self.data is None else load_corpus(self.data, self.max_bytes)


def tokenizer_for(path: str | os.PathLike[str] | None):
    """The transformers tokenizer saved in the model folder `path` or held by the GGUF file
    `path`, or None (byte tokens); a fine-tune's output folder: its model's."""
    if path is not None and checkpoint.run_model(path) is not None:
        path = checkpoint.run_model(path)
    if path is not None and Path(path).is_file() and Path(path).suffix.lower() == ".gguf":
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(Path(path).parent, gguf_file=Path(path).name)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise MinifloatError(f"{path}: its tokenizer could not be read ({type(err).__name__}: {err})") from None
    if path is None or not any((Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer  # a tokenizer file says transformers wrote the folder

    return AutoTokenizer.from_pretrained(path)


def _check_vocab(model: torch.nn.Module, tokenizer) -> None:
    vocab = getattr(model.config, "vocab_size", None)
    if tokenizer is not None:
        if vocab is not None and len(tokenizer) > vocab:
            raise MinifloatError(f"the tokenizer has {len(tokenizer):,} tokens and the model's vocabulary {vocab:,}: "
                                 f"they do not belong together (token ids past {vocab - 1} have no embedding)")  # fmt: skip
        return
    if vocab < 256:
        raise MinifloatError(f"the model's vocabulary has {vocab} tokens and its folder no tokenizer: byte tokens need ≥ 256")


def _path(source: TextSource, split: str) -> str | None:
    return source.calib if split == "train" and source.calib is not None else source.data


def is_chat(source: TextSource, split: str = "val") -> bool:
    """Whether the split's text is conversations (a ``.jsonl`` file of SFT records) rather than documents."""
    path = _path(source, split)
    return path is not None and Path(path).suffix.lower() == ".jsonl"


def text_ids(source: TextSource, split: str, tokenizer) -> tuple[torch.Tensor, int | None]:
    """The split's token ids as one stream, by `tokenizer`'s conventions, and the BOS each window
    starts with (None: none). Documents: each encoded and followed by EOS, BOS in front of a window
    where the tokenizer puts one in front of a text. Conversations (``.jsonl``): each record
    rendered with the chat template (which places BOS itself), the last 10 % of the records held out."""
    if is_chat(source, split):
        from minifloat.data.sft import read_records, render

        path = _path(source, split)
        records = read_records(path, option="--calib" if split == "train" and source.calib else "--data")
        n_val = max(int(len(records) * VAL_FRACTION), 1)
        part = records if split == "train" and source.calib is not None else (
            records[-n_val:] if split == "val" else records[:-n_val])  # fmt: skip
        return torch.tensor([t for n, r in part for t in render(r, tokenizer, n).input_ids], dtype=torch.long), None
    corpus = source.corpus(split)
    return encode_documents(corpus.documents(split), tokenizer, corpus.source, need_eos=False), adds_bos(tokenizer)


def text_conventions(source: TextSource, tokenizer) -> str:
    """How the text became windows, in words, for the report."""
    if tokenizer is None:
        return "byte tokens, windows anywhere in the text"
    if is_chat(source):
        return "conversations rendered with the tokenizer's chat template, one stream"
    eos, bos = tokenizer.eos_token_id, adds_bos(tokenizer)
    start = f"each window starts with BOS {tokenizer.convert_ids_to_tokens(bos)!r}" if bos is not None else \
        "windows without BOS (the tokenizer puts none in front of a text)"  # fmt: skip
    end = f"documents end with EOS {tokenizer.convert_ids_to_tokens(eos)!r}" if eos is not None else \
        "documents joined as they are (the tokenizer has no EOS)"  # fmt: skip
    return f"{end}; {start}"


def batches_for(model: torch.nn.Module, source: TextSource, split: str, tokenizer=None) -> list[torch.Tensor]:
    """Evaluation (``split="val"``) or calibration (``"train"``) batches of the model's context,
    cut by the tokenizer's conventions (`text_ids`), or from the bytes."""
    _check_vocab(model, tokenizer)
    context = getattr(model.config, "block_size", None) or getattr(model.config, "max_position_embeddings", None)
    seq_len = min(source.seq_len, context - 1) if context else source.seq_len
    n = source.eval_batches if split == "val" else source.calib_batches
    what = "evaluation text (held-out split)" if split == "val" else "calibration text (training split)"
    if tokenizer is None:
        corpus = source.corpus(split)
        text, bos = bytes(corpus.val.numpy()) if split == "val" else bytes(corpus.train.numpy()), None
    else:
        text, bos = text_ids(source, split, tokenizer)
    return token_batches(text, batch_size=source.batch_size, seq_len=seq_len, n_batches=n, what=what,
                         disjoint=split == "train", bos=bos)


def token_ids(text: bytes | str | Sequence[int] | torch.Tensor, tokenizer=None) -> torch.Tensor:
    """`text` as a 1-D tensor of token ids: its bytes, or a `tokenizer`'s ids (``encode(str)``)."""
    if tokenizer is not None:
        return torch.tensor(tokenizer.encode(text if isinstance(text, str) else bytes(text).decode("utf-8", "replace")))
    if isinstance(text, str):
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
    if isinstance(text, (bytes, bytearray)):
        return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    return torch.as_tensor(text).long().flatten()


def token_batches(
    text: bytes | str | Sequence[int] | torch.Tensor,
    *,
    batch_size: int = 8,
    seq_len: int = 128,
    n_batches: int = 8,
    tokenizer=None,
    what: str = "evaluation text",
    disjoint: bool = False,
    bos: int | None = None,
) -> list[torch.Tensor]:
    """`n_batches` batches (batch_size, seq_len + 1) of token ids from `text`: evenly spaced
    windows (deterministic), each a context and its next tokens. Bytes are the tokens unless a
    `tokenizer` (``encode(str) -> list[int]``) is given; `what` names the text in the error; `disjoint`:
    the windows may not overlap (calibration samples: each one new text); with a `bos`, each
    window is BOS and `seq_len` tokens of the text (BOS is never a target)."""
    ids = token_ids(text, tokenizer)
    need = batch_size * n_batches
    span = seq_len + 1 if bos is None else seq_len
    least = need * span if disjoint else span + need - 1
    if len(ids) < least:
        raise MinifloatError(
            f"the {what} has {len(ids)} tokens; {n_batches} batches of {batch_size} × {span} need "
            f"at least {least}{' (samples that do not overlap)' if disjoint else ''}: give more text, or fewer or shorter batches"
        )
    starts = torch.linspace(0, len(ids) - span, need).long()
    windows = torch.stack([ids[s : s + span] for s in starts.tolist()])
    if bos is not None:
        windows = torch.cat([torch.full((need, 1), bos, dtype=windows.dtype), windows], dim=1)
    return list(windows.view(n_batches, batch_size, windows.shape[1]))
