"""What quantizing a model costs: `evaluate` a model against its unquantized reference.

Per token, on the same batches: perplexity (the exponential of the mean next-token
cross-entropy), its change against the reference in %, the mean KL(reference ‖ model) of the
next-token distributions, and top-1 agreement (how often both pick the same next token); plus the
bytes of the weights at rest (measured from the tensors) and forward tokens/s.

`minifloat.data.text.token_batches` cuts the evaluation batches from text: byte tokens (the built-in GPT's, and any
model with at least 256 tokens built in a test), or a transformers tokenizer's; the same fixed
windows for every model evaluated.

Example:
    >>> from minifloat.models.gpt import GPT, GPTConfig
    >>> from minifloat.data.text import token_batches
    >>> gpt = GPT(GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=64)).eval()
    >>> batches = token_batches(b"hello world, " * 200, batch_size=2, seq_len=32, n_batches=2)
    >>> m = evaluate(gpt, gpt, batches)
    >>> m["kl"], m["top1"], m["delta_ppl_pct"]
    (0.0, 1.0, 0.0)
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from minifloat.errors import MinifloatError
from minifloat.infer.modules.accounting import linear_weight_bytes, model_bytes
from minifloat.models.loading import logits_of

ELEMENTS_AT_ONCE = 1 << 24  # logits scored at once (64 MiB in float32): the bound on evaluation's working memory


def kl_and_agreement(reference: torch.Tensor, logits: torch.Tensor) -> tuple[float, int]:
    """Summed KL(softmax(reference) ‖ softmax(logits)) over the rows (..., vocab), and how many
    rows share their argmax."""
    lr, lq = F.log_softmax(reference.float(), -1), F.log_softmax(logits.float(), -1)
    kl = (lr.exp() * (lr - lq)).sum(-1).sum().item()
    return kl, int((logits.argmax(-1) == reference.argmax(-1)).sum())


class Quality:
    """The one accumulator of the quality figures, fed batch by batch (`add`), read once
    (`result`). Definitions: perplexity = exp(mean next-token NLL); Δppl % = 100·(ppl / ppl_ref −
    1); KL(reference ‖ model) per token, averaged, clamped at 0 (two equal distributions can sum
    to −1e-9 in float32); top-1 agreement = share of positions whose argmaxes match.

    Example:
        >>> q = Quality()
        >>> q.add(torch.tensor([[0.0, 2.0]]), targets=torch.tensor([1]), reference=torch.tensor([[0.0, 2.0]]))
        >>> r = q.result()
        >>> round(r["ppl"], 4), r["kl"], r["top1"], r["delta_ppl_pct"]
        (1.1353, 0.0, 1.0, 0.0)
    """

    def __init__(self) -> None:
        self.nll = self.ref_nll = self.kl = 0.0
        self.agree = self.tokens = 0
        self.scored = self.compared = False

    def add(self, logits: torch.Tensor, targets: torch.Tensor | None = None, reference: torch.Tensor | None = None) -> None:
        """One batch: `logits` (..., vocab), the next tokens `targets` (...) for perplexity, the
        unquantized model's `reference` logits for KL and top-1. Scored `ELEMENTS_AT_ONCE` logits
        at a time (whole rows), so that a large vocabulary's float32 softmaxes stay bounded."""
        vocab = logits.shape[-1]
        lg = logits.reshape(-1, vocab)
        tg = targets.reshape(-1) if targets is not None else None
        ref = reference.reshape(-1, vocab) if reference is not None else None
        step = max(1, ELEMENTS_AT_ONCE // vocab)
        for i in range(0, lg.shape[0], step):
            rows = slice(i, i + step)
            self._add_rows(lg[rows], tg[rows] if tg is not None else None, ref[rows] if ref is not None else None)

    def _add_rows(self, logits: torch.Tensor, targets: torch.Tensor | None, reference: torch.Tensor | None) -> None:
        lg = logits.float()
        if targets is not None:
            self.nll += F.cross_entropy(lg, targets, reduction="sum").item()
            self.scored = True
        if reference is not None:
            ref = reference.float()
            k, a = kl_and_agreement(ref, lg)
            self.kl, self.agree, self.compared = self.kl + k, self.agree + a, True
            if targets is not None:
                self.ref_nll += F.cross_entropy(ref, targets, reduction="sum").item()
        self.tokens += lg.shape[0]

    def result(self) -> dict:
        """``tokens``; with targets ``nll``, ``ppl``; with a reference ``kl``, ``top1``; with both
        ``nll_ref``, ``ppl_ref``, ``delta_ppl_pct``."""
        if not self.tokens:
            raise MinifloatError("no tokens were scored: give at least one batch")
        n, out = self.tokens, {"tokens": self.tokens}
        if self.scored:
            out |= {"nll": self.nll / n, "ppl": math.exp(self.nll / n)}
        if self.compared:
            out |= {"kl": max(self.kl / n, 0.0), "top1": self.agree / n}
            if self.scored:
                out |= {"nll_ref": self.ref_nll / n, "ppl_ref": math.exp(self.ref_nll / n),
                        "delta_ppl_pct": 100.0 * (math.exp(self.nll / n - self.ref_nll / n) - 1.0)}  # fmt: skip
        return out


def _pieces(batch: torch.Tensor, vocab: int | None) -> list[torch.Tensor]:
    """`batch` (B, T + 1) split along B so that one forward's logits hold about `ELEMENTS_AT_ONCE`."""
    if not vocab:
        return [batch]
    rows = max(1, ELEMENTS_AT_ONCE // (vocab * max(batch.shape[1] - 1, 1)))
    return list(batch.split(rows))


def evaluate(model: torch.nn.Module, reference: torch.nn.Module | None, batches: Sequence[torch.Tensor]) -> dict:
    """Quality and cost of `model` on `batches` (from `token_batches`: each (B, T + 1)), against
    `reference` when given. Returns ``ppl``, ``ppl_ref``, ``delta_ppl_pct``, ``kl``, ``top1``
    (`Quality`), ``weight_bytes``, ``model_bytes``, ``tokens_per_s``, ``tokens``.

    Both models run on one batch (or a piece of it: a large vocabulary's logits are cut along the
    batch) and it is scored before the next, so memory does not grow with the number of batches;
    tokens/s counts the model's forwards only."""
    if not batches:
        raise MinifloatError("evaluate needs at least one batch (minifloat.infer.token_batches cuts them from text)")
    was, ref_was = model.training, reference.training if reference is not None else False
    model.eval()
    if reference is not None:
        reference.eval()
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    q, seconds, tokens = Quality(), 0.0, 0
    try:
        with torch.no_grad():
            for batch in batches:
                for piece in _pieces(batch, vocab):
                    x = piece[:, :-1]
                    t0 = time.perf_counter()
                    logits = logits_of(model(x))
                    seconds += time.perf_counter() - t0
                    tokens += x.numel()
                    ref = logits_of(reference(x)) if reference is not None else None
                    q.add(logits, piece[:, 1:], ref)
                    del logits, ref
    finally:
        model.train(was)
        if reference is not None:
            reference.train(ref_was)
    r = q.result()
    if not math.isfinite(r["nll"]):
        raise MinifloatError(f"the model's loss is {r['nll']} on the evaluation text: its outputs hold NaN or inf")
    m = {"ppl": r["ppl"], "nll": r["nll"], "weight_bytes": linear_weight_bytes(model), "model_bytes": model_bytes(model),
         "tokens_per_s": tokens / seconds if seconds > 0 else float("inf"), "tokens": tokens}  # fmt: skip
    if reference is not None:
        m |= {k: r[k] for k in ("ppl_ref", "delta_ppl_pct", "kl", "top1")}
    return m
