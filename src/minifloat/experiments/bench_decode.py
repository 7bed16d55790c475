"""`minifloat bench decode`: what a KV-cache format costs in decoding, and what an FP4 draft buys.

KV formats: along windows of each context length — the model's own greedy continuations of
held-out prompts (``source="generated"``, what a served model decodes), or held-out text itself
(``"text"``) — the model decodes token by token (teacher-forced: every format sees the same
tokens) with each cache format; its next-token distributions are compared with those of an FP32 cache: mean
per-token KL(fp32 ‖ format) and top-1 agreement, the KV bytes held at the window's end, and
decode tokens/s.

Speculative decoding: greedy generation from held-out prompts with each draft and k, against
plain greedy decoding in the same run: per-position acceptance, mean accepted length, target
forwards per token, measured tokens/s and speed-up (on this machine, where an FP4 draft runs no
faster than the model), and the speed-up the measured acceptance implies where the draft's
forward costs `cost_ratio` of the target's (the standard formula: α the per-token acceptance,
(1 − α^(k+1)) / ((1 − α)(k·c + 1)); Leviathan et al., 2023).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from minifloat.errors import MinifloatError
from minifloat.infer import generate
from minifloat.infer.adapter import adapter_for
from minifloat.infer.decoding import draft_model
from minifloat.infer.kvcache import parse_kv_spec
from minifloat.infer.metrics import Quality

DEFAULT_FORMATS = ("bf16", "fp8", "fp8+bf16", "fp8_e5m2", "mxfp8", "mxfp6", "mxfp4", "nvfp4", "nvfp4+fp8")
FP4_COST_RATIO = 0.25  # an FP4 draft's forward against a BF16 target's: a quarter of the weight bytes (memory-bound decode)


@torch.no_grad()
def _decode_logits(model, window: torch.Tensor, fmt: str, prefill: int) -> tuple[torch.Tensor, float, int]:
    """`fmt`: a KV format, or ``FORMAT+RECENT`` (e.g. ``fp8+bf16``: the sinks and the last 32
    tokens in RECENT, older ones in FORMAT), with ``@OPTION``s (`parse_kv_spec`)."""
    name, kw = parse_kv_spec(fmt)
    adapter = adapter_for(model)
    cache = adapter.new_cache(name, **kw)
    rows = [adapter.forward(window[:, :prefill], cache)[0, -1:]]
    t0 = time.perf_counter()
    for t in range(prefill, window.shape[1] - 1):
        rows.append(adapter.forward(window[:, t : t + 1], cache)[0, -1:])
    return torch.cat(rows).float(), time.perf_counter() - t0, cache.nbytes()


def kv_quality(model, text: torch.Tensor, formats: Sequence[str] = DEFAULT_FORMATS, contexts: Sequence[int] = (128,),
               windows: int = 4, prefill: int = 16, source: str = "generated",
               echo: Callable[[str], None] = print) -> list[dict]:  # fmt: skip
    """Per format and context length: ``kl``, ``top1``, ``kv_bytes``, ``tokens_per_s`` (see the
    module docstring); `text` a 1-D tensor of token ids."""
    if source not in ("generated", "text"):
        raise MinifloatError(f"source must be 'generated' or 'text', got {source!r}")
    rows = []
    for ctx in contexts:
        starts = torch.linspace(0, len(text) - ctx - 1, windows).long().tolist()
        ws = [text[s : s + ctx].reshape(1, -1).long() for s in starts]
        if source == "generated":  # the prompt, then the model's own greedy tokens (FP32 cache)
            ws = [generate(model, w[:, :prefill], ctx - prefill, kv_cache="fp32").tokens for w in ws]
        ref = [_decode_logits(model, w, "fp32", prefill)[0] for w in ws]
        for fmt in formats:
            q, secs = Quality(), 0.0
            for w, r in zip(ws, ref, strict=True):
                lg, s, nbytes = _decode_logits(model, w, fmt, prefill)
                q.add(lg, reference=r)
                secs += s
            n, quality = q.tokens, q.result()
            row = {"format": fmt, "context": ctx, "source": source, "tokens": int(n), "kl": quality["kl"], "top1": quality["top1"],
                   "kv_bytes": nbytes, "tokens_per_s": (n - len(ws)) / secs if secs else float("inf")}  # fmt: skip
            rows.append(row)
            echo(f"  ctx {ctx:>4} {fmt:<22} KL {row['kl']:.2e}  top-1 {row['top1']:.4f}  KV {nbytes:,} B  "
                 f"{row['tokens_per_s']:,.0f} tok/s")  # fmt: skip
    return rows


def implied_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Expected speed-up of speculative decoding with per-token acceptance `alpha`, `k` draft
    tokens and a draft forward costing `cost_ratio` of the target's.

    >>> round(implied_speedup(0.8, 4, 0.25), 3)
    1.681
    """
    tokens = (k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * cost_ratio + 1)


def speculative(model, prompts: Sequence[torch.Tensor], drafts: Sequence[str] = ("nvfp4", "mxfp4"),
                ks: Sequence[int] = (2, 4, 8), new_tokens: int = 64, kv_cache: str = "bf16",
                cost_ratio: float = FP4_COST_RATIO, echo: Callable[[str], None] = print) -> dict:  # fmt: skip
    """Plain greedy against speculative greedy per draft and k (see the module docstring)."""
    plain_s = plain_n = 0.0
    for p in prompts:
        g = generate(model, p, new_tokens, kv_cache=kv_cache)
        plain_s += g.seconds
        plain_n += g.new_tokens
    plain_tps = plain_n / plain_s
    rows = []
    for name in drafts:
        d = draft_model(model, name)
        for k in ks:
            secs = n = forwards = 0.0
            accepted = proposed = 0
            per_pos = [0.0] * k
            kept = []
            for p in prompts:
                g = generate(model, p, new_tokens, kv_cache=kv_cache, draft=d, draft_tokens=k)
                secs += g.seconds
                n += g.new_tokens
                forwards += g.target_forwards
                kept.append(g.mean_accepted)
                per_pos = [a + b / len(prompts) for a, b in zip(per_pos, g.accepted_per_position, strict=True)]
                accepted += g.accepted
                proposed += g.proposed
            alpha = accepted / proposed if proposed else 0.0
            row = {"draft": name, "k": k, "acceptance_per_position": per_pos, "token_acceptance": alpha,
                   "mean_accepted": sum(kept) / len(kept), "target_forwards_per_token": forwards / n,
                   "tokens_per_s": n / secs, "speedup_here": (n / secs) / plain_tps,
                   "implied_speedup": implied_speedup(alpha, k, cost_ratio)}  # fmt: skip
            rows.append(row)
            echo(f"  draft {name} k={k}: acceptance {alpha:.3f}, mean accepted {row['mean_accepted']:.2f}, "
                 f"{row['target_forwards_per_token']:.2f} target forwards/token, ×{row['speedup_here']:.2f} here, "
                 f"×{row['implied_speedup']:.2f} implied (draft cost {cost_ratio})")  # fmt: skip
    return {"plain_tokens_per_s": plain_tps, "cost_ratio": cost_ratio, "kv_cache": kv_cache, "runs": rows}
