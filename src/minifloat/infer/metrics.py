"""What quantizing a model costs: `evaluate` a model against its unquantized reference.

Per token, on the same batches: perplexity (the exponential of the mean next-token
cross-entropy), its change against the reference in %, the mean KL(reference ‖ model) of the
next-token distributions, and top-1 agreement (how often both pick the same next token); plus the
bytes of the weights at rest (measured from the tensors) and forward tokens/s.

`token_batches` cuts the evaluation batches from text: byte tokens (the built-in GPT's, and any
model with at least 256 tokens built in a test), or a transformers tokenizer's; the same fixed
windows for every model evaluated.

Example:
    >>> from minifloat.train.model import GPT, GPTConfig
    >>> gpt = GPT(GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=64)).eval()
    >>> batches = token_batches(b"hello world, " * 200, batch_size=2, seq_len=32, n_batches=2)
    >>> m = evaluate(gpt, gpt, batches)
    >>> m["kl"], m["top1"], m["delta_ppl_pct"]
    (0.0, 1.0, 0.0)
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F

from minifloat.errors import MinifloatError
from minifloat.infer.linear import QuantizedLinear
from minifloat.infer.models import logits_of
from minifloat.infer.ptq import model_bytes, tensor_bytes


def token_batches(
    text: bytes | str | Sequence[int] | torch.Tensor,
    *,
    batch_size: int = 8,
    seq_len: int = 128,
    n_batches: int = 8,
    tokenizer=None,
) -> list[torch.Tensor]:
    """`n_batches` batches (batch_size, seq_len + 1) of token ids from `text`: evenly spaced
    windows (deterministic), each a context and its next tokens. Bytes are the tokens unless a
    `tokenizer` (``encode(str) -> list[int]``) is given."""
    if tokenizer is not None:
        ids = torch.tensor(tokenizer.encode(text if isinstance(text, str) else bytes(text).decode("utf-8", "replace")))
    elif isinstance(text, str):
        ids = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
    elif isinstance(text, (bytes, bytearray)):
        ids = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    else:
        ids = torch.as_tensor(text).long().flatten()
    need = batch_size * n_batches
    span = seq_len + 1
    if len(ids) < span + need - 1:
        raise MinifloatError(
            f"the evaluation text has {len(ids)} tokens; {n_batches} batches of {batch_size} × {span} need "
            f"at least {span + need - 1}: give more text, or fewer or shorter batches"
        )
    starts = torch.linspace(0, len(ids) - span, need).long()
    windows = torch.stack([ids[s : s + span] for s in starts.tolist()])
    return list(windows.view(n_batches, batch_size, span))


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every Linear's weight at rest: a QuantizedLinear's codes and scales, a dense
    Linear's weight (a tied weight counted where it is an embedding, not again), a tensor
    subclass' (torchao's) inner tensors."""
    total = 0
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            total += m.packed_nbytes()
        elif isinstance(m, torch.nn.Linear) and id(m.weight) not in embeddings:
            total += tensor_bytes(m.weight, set())
    return total


def kl_and_agreement(reference: torch.Tensor, logits: torch.Tensor) -> tuple[float, int]:
    """Summed KL(softmax(reference) ‖ softmax(logits)) over the rows (..., vocab), and how many
    rows share their argmax."""
    lr, lq = F.log_softmax(reference.float(), -1), F.log_softmax(logits.float(), -1)
    kl = (lr.exp() * (lr - lq)).sum(-1).sum().item()
    return kl, int((logits.argmax(-1) == reference.argmax(-1)).sum())


@torch.no_grad()
def _logits(model: torch.nn.Module, batches: Iterable[torch.Tensor]) -> tuple[list[torch.Tensor], float, int]:
    out, tokens = [], 0
    t0 = time.perf_counter()
    for b in batches:
        x = b[:, :-1]
        out.append(logits_of(model(x)).float())
        tokens += x.numel()
    return out, time.perf_counter() - t0, tokens


def evaluate(model: torch.nn.Module, reference: torch.nn.Module | None, batches: Sequence[torch.Tensor]) -> dict:
    """Quality and cost of `model` on `batches` (from `token_batches`: each (B, T + 1)), against
    `reference` when given. Returns ``ppl``, ``ppl_ref``, ``delta_ppl_pct``, ``kl``, ``top1``,
    ``weight_bytes``, ``model_bytes``, ``tokens_per_s``, ``tokens``."""
    if not batches:
        raise MinifloatError("evaluate needs at least one batch (minifloat.infer.token_batches cuts them from text)")
    was = model.training
    model.eval()
    try:
        logits, seconds, tokens = _logits(model, batches)
    finally:
        model.train(was)
    targets = [b[:, 1:] for b in batches]
    nll = sum(F.cross_entropy(lg.reshape(-1, lg.shape[-1]), t.reshape(-1), reduction="sum").item()
              for lg, t in zip(logits, targets, strict=True)) / tokens  # fmt: skip
    m = {"ppl": math.exp(nll), "nll": nll, "weight_bytes": weight_bytes(model), "model_bytes": model_bytes(model),
         "tokens_per_s": tokens / seconds if seconds > 0 else float("inf"), "tokens": tokens}  # fmt: skip
    if not math.isfinite(nll):
        raise MinifloatError(f"the model's loss is {nll} on the evaluation text: its outputs hold NaN or inf")
    if reference is None:
        return m
    ref_logits, _, _ = _logits(reference.eval(), batches)
    ref_nll = sum(F.cross_entropy(lg.reshape(-1, lg.shape[-1]), t.reshape(-1), reduction="sum").item()
                  for lg, t in zip(ref_logits, targets, strict=True)) / tokens  # fmt: skip
    kl = agree = 0.0
    for lq, lr in zip(logits, ref_logits, strict=True):
        k, a = kl_and_agreement(lr, lq)
        kl, agree = kl + k, agree + a
    m |= {"ppl_ref": math.exp(ref_nll), "delta_ppl_pct": 100.0 * (math.exp(nll - ref_nll) - 1.0),
          "kl": max(kl / tokens, 0.0), "top1": agree / tokens}  # fmt: skip
    return m
