"""Supervised fine-tuning data: JSONL records rendered with a model's tokenizer, the loss on the
responses only, packed into windows whose attention stays inside each record.

A record is one JSON object a line, either
``{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}`` — rendered
with the tokenizer's chat template — or ``{"prompt": "...", "completion": "..."}`` — the prompt's
tokens (after the special tokens the tokenizer puts in front of a text: BOS), then the
completion's and the tokenizer's EOS.

Which tokens count (`render`): the completion's, or every assistant turn's. A turn's tokens are
found from the template itself: the conversation rendered up to the turn with the generation
prompt, and up to the end of the turn; the tokens between the two are the response (the
template's end-of-turn marker included, so the model learns to stop). Every other token's label
is `IGNORE` (-100, cross-entropy's ``ignore_index``), so it gets no gradient.

Packing (`pack`): records in order, each kept whole, into windows of `seq_len` tokens; every
token carries its record's number in the window (`segment_ids`) and its position inside the
record (`position_ids`), and `block_causal_mask` lets a token attend to the earlier tokens of its
own record only. A record longer than a window is an error naming its line, not a silent cut.

Example:
    >>> rows = pack([Example([5, 6, 7], [IGNORE, 6, 7], 1), Example([8, 9], [IGNORE, 9], 2)], seq_len=6, pad_id=0)
    >>> rows[0].input_ids.tolist(), rows[0].segment_ids.tolist(), rows[0].position_ids.tolist()
    ([5, 6, 7, 8, 9, 0], [0, 0, 0, 1, 1, -1], [0, 1, 2, 0, 1, 0])
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from minifloat.errors import MinifloatError

IGNORE = -100  # the label of a token the loss does not count (torch's cross_entropy ignore_index)
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Example:
    """One rendered record: its token ids, the labels (the id where the loss counts it, else
    `IGNORE`), and its line in the file (for errors)."""

    input_ids: list[int]
    labels: list[int]
    line: int


@dataclass(frozen=True)
class Packed:
    """One window of packed records (each tensor (seq_len,)); padding has segment -1 and label `IGNORE`."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    segment_ids: torch.Tensor


def read_records(path: str | os.PathLike[str], option: str = "--sft") -> list[tuple[int, dict]]:
    """The records of a JSONL file as (line number, record), each checked for one of the two
    shapes; `option` names the command-line option in the errors."""
    path = Path(path)
    if not path.is_file():
        raise MinifloatError(f"{option} {path}: no such file")
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise MinifloatError(f"{option} {path}, line {n}: not JSON ({err.msg} at column {err.colno})") from None
            _check(record, f"{option} {path}, line {n}")
            out.append((n, record))
    if not out:
        raise MinifloatError(f"{option} {path}: no records")
    return out


def _check(record, where: str) -> None:
    if not isinstance(record, dict):
        raise MinifloatError(f"{where}: a record is a JSON object with 'messages', or 'prompt' and 'completion'")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise MinifloatError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise MinifloatError(f"{where}: message {i} must be {{'role': one of {', '.join(ROLES)}, 'content': text}}")
        if not any(m["role"] == "assistant" for m in messages):
            raise MinifloatError(f"{where}: no assistant message, so nothing to learn")
    elif isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        if not record["completion"]:
            raise MinifloatError(f"{where}: an empty completion, so nothing to learn")
    else:
        raise MinifloatError(f"{where}: a record needs 'messages', or 'prompt' and 'completion' (text); "
                             f"it has {sorted(record)}")  # fmt: skip


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _template(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def render(record: dict, tokenizer, line: int = 0) -> Example:
    """`record` as token ids and labels (see the module docstring)."""
    if "messages" in record:
        if not getattr(tokenizer, "chat_template", None):
            raise MinifloatError("the tokenizer has no chat template, which 'messages' records need: use 'prompt' / "
                                 "'completion' records, or a model whose tokenizer has one")  # fmt: skip
        messages = record["messages"]
        ids = _template(tokenizer, messages, generation_prompt=False)
        labels = [IGNORE] * len(ids)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = len(_template(tokenizer, messages[:i], generation_prompt=True))
            end = len(_template(tokenizer, messages[: i + 1], generation_prompt=False))
            if ids[:start] != _template(tokenizer, messages[:i], generation_prompt=True) or not start < end <= len(ids):
                raise MinifloatError(f"line {line}: the chat template does not render a conversation as the sum of "
                                     f"its turns, so the response tokens cannot be found")  # fmt: skip
            labels[start:end] = ids[start:end]
        return Example(ids, labels, line)
    # the prompt as the tokenizer encodes a text: with the special tokens it puts in front (BOS)
    plain = _ids(tokenizer, record["prompt"])
    special = list(tokenizer(record["prompt"])["input_ids"])
    lead = special[: len(special) - len(plain)] if special[len(special) - len(plain) :] == plain else []
    prompt, completion = lead + plain, _ids(tokenizer, record["completion"])
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids = prompt + completion + eos
    return Example(ids, [IGNORE] * len(prompt) + completion + eos, line)


def load_sft(path: str | os.PathLike[str], tokenizer) -> list[Example]:
    """Every record of the JSONL file `path`, rendered (`render`)."""
    return [render(record, tokenizer, n) for n, record in read_records(path)]


def pack(examples: list[Example], seq_len: int, pad_id: int) -> list[Packed]:
    """The examples in order, each whole, in windows of `seq_len` tokens (see the module docstring).
    Labels are the next token's: a window's label at t is the id at t + 1 where that token counts
    and belongs to the same record."""
    rows, current = [], []
    for ex in examples:
        if len(ex.input_ids) > seq_len:
            raise MinifloatError(f"the record on line {ex.line} has {len(ex.input_ids)} tokens, more than the "
                                 f"{seq_len} of a window: shorten it or raise --seq-len (up to the model's context)")  # fmt: skip
        if sum(len(e.input_ids) for e in current) + len(ex.input_ids) > seq_len:
            rows.append(_window(current, seq_len, pad_id))
            current = []
        current.append(ex)
    if current:
        rows.append(_window(current, seq_len, pad_id))
    return rows


def _window(examples: list[Example], seq_len: int, pad_id: int) -> Packed:
    ids, labels, pos, seg = [], [], [], []
    for s, ex in enumerate(examples):
        ids += ex.input_ids
        labels += ex.labels[1:] + [IGNORE]  # next-token labels; a record's last token predicts nothing
        pos += list(range(len(ex.input_ids)))
        seg += [s] * len(ex.input_ids)
    pad = seq_len - len(ids)
    return Packed(torch.tensor(ids + [pad_id] * pad), torch.tensor(labels + [IGNORE] * pad),
                  torch.tensor(pos + [0] * pad), torch.tensor(seg + [-1] * pad))  # fmt: skip


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool, True where query t may attend to key u: u ≤ t in the same record
    (padding attends to itself only, so no row is empty)."""
    seg = segment_ids if segment_ids.dim() == 2 else segment_ids[None]
    t = seg.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    same = seg[:, :, None] == seg[:, None, :]
    return ((same & causal) | torch.eye(t, dtype=torch.bool))[:, None]
