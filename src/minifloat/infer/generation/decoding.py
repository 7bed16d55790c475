"""`generate`: incremental decoding with a (quantized) KV cache, and speculative decoding with an
FP4 draft of the same model.

Plain decoding feeds the prompt once (prefill), then one token per step; each step's logits come
from the cache's K and V (`KVCache`). Sampling: greedy at temperature 0, else softmax(logits /
T) restricted to the `top_k` most likely tokens and to the smallest set whose probability
reaches `top_p`, drawn from a generator seeded with `seed`.

Speculative decoding (`draft="nvfp4"` / ``"mxfp4"``: a copy of the model with FP4 weights, or any
model with the same vocabulary): the draft proposes `draft_tokens` tokens one by one; the target
scores them all in one forward pass. Greedy: the longest prefix the target's argmax agrees with
is kept, then the target's own next token — the output equals the target's greedy decoding.
Sampling: a draft token x with draft probability q(x) and target probability p(x) is kept with
probability min(1, p(x) / q(x)); the first one rejected is replaced by a sample of
normalize(max(0, p − q)); if all are kept, one more comes from p — the output distribution is the
target's (Leviathan et al., 2023). Each cache drops what the target rejected.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from minifloat.errors import MinifloatError
from minifloat.infer.generation.cache import new_cache
from minifloat.infer.generation.fused import FusedCache, FusedDecoder, unsupported
from minifloat.infer.generation.kvcache import KVCache, KVSpec, parse_kv_spec
from minifloat.infer.quantize import quantize_model
from minifloat.models.adapter import adapter_for

DRAFTS = {"nvfp4": "nvfp4-weight-only", "mxfp4": "mxfp4-weight-only"}  # FP4 drafts: the PTQ config of each
DRAFT_NAMES = (*DRAFTS, *(f"{n}-gptq" for n in DRAFTS))  # each by round to nearest, or by GPTQ
DECODE_STEPS = ("auto", "fused", "eager")


@dataclass
class Generation:
    """What `generate` returns: the tokens (prompt + new) and how the decoding went."""

    tokens: torch.Tensor  # (1, prompt + new)
    new_tokens: int
    seconds: float
    kv_bytes: int
    kv_cache: str
    target_forwards: int
    draft_tokens: int = 0
    accepted_per_position: list[float] = field(default_factory=list)  # acceptance rate of draft position i
    mean_accepted: float | None = None  # mean draft tokens kept per verification
    kv_events: list[dict] = field(default_factory=list)  # memory-pressure moves (KVCache.events)
    kv_precisions: list[str] = field(default_factory=list)  # each token's KV format at the end (layer 0)
    proposed: int = 0  # draft tokens the target judged (those after a rejection are not)
    accepted: int = 0  # of them kept
    decode_step: str = "eager"  # how the target's steps ran: "fused" (one C call each) or "eager"
    prefill_seconds: float | None = None  # plain decoding: until the first new token was decided

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens per second of the decode steps alone (plain decoding: the tokens after the
        first, over the time after the prefill), as engines report decode speed."""
        if self.prefill_seconds is None or self.new_tokens < 2 or self.seconds <= self.prefill_seconds:
            return None
        return (self.new_tokens - 1) / (self.seconds - self.prefill_seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("inf")

    def to_dict(self) -> dict:
        return {"new_tokens": self.new_tokens, "seconds": self.seconds, "tokens_per_s": self.tokens_per_s,
                "kv_bytes": self.kv_bytes, "kv_cache": self.kv_cache, "target_forwards": self.target_forwards,
                "target_forwards_per_token": self.target_forwards / max(self.new_tokens, 1),
                "draft_tokens": self.draft_tokens, "accepted_per_position": self.accepted_per_position,
                "mean_accepted": self.mean_accepted, "proposed": self.proposed, "accepted": self.accepted,
                "kv_events": len(self.kv_events), "decode_step": self.decode_step,
                "prefill_seconds": self.prefill_seconds, "decode_tokens_per_s": self.decode_tokens_per_s,
                "kv_precision_mix": {f: self.kv_precisions.count(f) for f in dict.fromkeys(self.kv_precisions)}}  # fmt: skip


def probabilities(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """The sampling distribution (float64) of `logits` (..., vocab): see the module docstring."""
    z = logits.double() / temperature
    if top_k is not None and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, -torch.inf)
    p = torch.softmax(z, dim=-1)
    if top_p is not None and top_p < 1.0:
        sp, idx = torch.sort(p, dim=-1, descending=True)
        before = sp.cumsum(-1) - sp  # mass of the tokens ranked above each
        sp = sp.masked_fill(before >= top_p, 0.0)
        p = torch.zeros_like(p).scatter(-1, idx, sp)
        p = p / p.sum(-1, keepdim=True)
    return p


def forward(model, ids: torch.Tensor, cache, last: int | None = None) -> torch.Tensor:
    """Logits (1, T, vocab) of `ids` continuing what `cache` holds (which takes their K and V); of
    the last `last` tokens only, (1, last, vocab), when given (a `FusedCache` computes no others)."""
    if isinstance(cache, FusedCache):
        return cache.decoder.forward(ids, cache, last=last or ids.shape[-1])[None]
    logits = adapter_for(model).forward(ids, cache)
    return logits if last is None else logits[:, -last:]


def calibrate_kv(model, batches) -> dict[int, tuple[float, float]]:
    """Per layer, the amax of the keys and values (as the cache stores them: after a rotary
    embedding) over `batches` of token ids (B, T): the scales of a calibrated FP8 cache
    (``generate(kv_cache="fp8", kv_scales=...)``), and the ``k_scale`` / ``v_scale`` (amax / 448)
    that `export` writes for vLLM."""
    amax: dict[int, list[float]] = {}
    with torch.no_grad():
        adapter = adapter_for(model)
        for batch in batches:
            cache = new_cache(adapter, "fp32")
            adapter.forward(batch, cache)
            for i in range(cache.n_layer):
                k, v = cache.keys_values(i)
                a = amax.setdefault(i, [0.0, 0.0])
                a[0], a[1] = max(a[0], float(k.abs().max())), max(a[1], float(v.abs().max()))
    if not amax:
        raise MinifloatError("calibrate_kv got no batches")
    return {i: (a[0], a[1]) for i, a in amax.items()}


def decode_cache(model, spec: KVSpec, capacity: int, *, decode_step: str = "auto", scales=None,
                 slack: int = 0) -> KVCache | FusedCache:  # fmt: skip
    """The cache `generate` decodes `model` with: the fused step's (`FusedCache`, `capacity`
    positions) where it runs the model and `spec` and `decode_step` allows it, else the eager
    model's (`new_cache`, with `scales` and `slack`); ``decode_step="fused"`` where it cannot run:
    an error saying why."""
    if decode_step not in DECODE_STEPS:
        raise MinifloatError(f"decode_step must be one of {', '.join(DECODE_STEPS)}, got {decode_step!r}")
    why = "asked" if decode_step == "eager" else unsupported(model, spec, scales)
    if why is None and spec.key_scales == "channel" and slack > spec.recent_tokens:
        why = (f"a speculative rollback of up to {slack} tokens would reach keys scaled per channel in whole blocks "
               f"(recent_tokens {spec.recent_tokens})")  # fmt: skip
    if why is None:
        return FusedDecoder(model).new_cache(spec, capacity)
    if decode_step == "fused":
        raise MinifloatError(f"decode_step='fused' cannot run this model: {why}; use decode_step='auto' or 'eager'")
    return new_cache(adapter_for(model), spec=spec, scales=scales, slack=slack)


def device_of(model: torch.nn.Module) -> torch.device:
    """Where `model` holds its weights (its first parameter or buffer; the CPU for neither)."""
    return next(itertools.chain(model.parameters(), model.buffers()), torch.empty(0)).device


def _check(model, input_ids, max_new_tokens, temperature, top_k, top_p, draft_tokens) -> None:
    context = adapter_for(model).context_length  # a model no adapter drives: a clear error
    if not (isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[0] == 1 and input_ids.shape[1] >= 1):
        raise MinifloatError("input_ids must be a (1, T) tensor of token ids with T ≥ 1 (one prompt)")
    if max_new_tokens < 1:
        raise MinifloatError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
    need = input_ids.shape[1] + max_new_tokens
    if need > context:
        raise MinifloatError(f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) = {need} exceeds "
                             f"the model's context of {context} tokens")  # fmt: skip
    if not temperature >= 0:
        raise MinifloatError(f"temperature must be ≥ 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise MinifloatError(f"top_k must be ≥ 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise MinifloatError(f"top_p must be in (0, 1], got {top_p}")
    if draft_tokens < 1:
        raise MinifloatError(f"draft_tokens must be ≥ 1, got {draft_tokens}")


def check_draft(name: str) -> None:
    """`name` is one of `DRAFT_NAMES`, or an error listing them (before any work)."""
    if name not in DRAFT_NAMES:
        raise MinifloatError(f"unknown draft {name!r}; use one of {', '.join(DRAFT_NAMES)} or a model")


def draft_model(model: torch.nn.Module, draft: str | torch.nn.Module, calibration=None) -> torch.nn.Module:
    """The draft: `model`'s copy with FP4 weights (``"nvfp4"``, ``"mxfp4"``: round to nearest;
    ``"nvfp4-gptq"``, ``"mxfp4-gptq"``: the config's recommended GPTQ pipeline on the
    `calibration` batches, which raises acceptance where round to nearest costs a real LLM
    much), or a model given."""
    if isinstance(draft, torch.nn.Module):
        if getattr(getattr(draft, "config", None), "vocab_size", None) != model.config.vocab_size:
            raise MinifloatError("the draft model must share the target's vocabulary")
        return draft
    check_draft(draft)
    gptq = draft.endswith("-gptq")
    if gptq and not calibration:
        raise MinifloatError(f"draft {draft!r} is quantized by GPTQ: it needs calibration batches "
                             f"(draft_model(model, {draft!r}, calibration) → pass the model as draft=)")  # fmt: skip
    d = copy.deepcopy(model)
    config = DRAFTS[draft.removesuffix("-gptq")]
    if gptq:
        quantize_model(d, config, ignore=(), method="gptq", calibration=list(calibration))
    else:
        quantize_model(d, config, ignore=())
    return d.eval()


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    kv_cache: str = "bf16",
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    draft: str | torch.nn.Module | None = None,
    draft_tokens: int = 4,
    kv_budget_bytes: int | None = None,
    kv_pressure_format: str | None = None,
    kv_sink_tokens: int | None = None,
    kv_recent_tokens: int | None = None,
    kv_scales: dict[int, tuple[float, float]] | None = None,
    kv_recent_format: str | None = None,
    kv_drop: bool = False,
    stream: Callable[[int], None] | None = None,
    stop_tokens: Sequence[int] = (),
    decode_step: str = "auto",
) -> Generation:
    """Continue `input_ids` (1, T) by `max_new_tokens` tokens; see the module docstring.
    `kv_cache`: a format, or ``FORMAT[+RECENT][@OPTION…]`` (`minifloat.infer.generation.kvcache.parse_kv_spec`:
    e.g. ``"nvfp4+bf16@channel"``, KIVI's per-channel keys behind a BF16 recent window).
    `kv_scales` (`calibrate_kv`'s, with ``kv_cache="fp8"``): per-tensor FP8 with those scales.
    `kv_recent_format` (e.g. ``"bf16"``): the first `kv_sink_tokens` and the last
    `kv_recent_tokens` tokens stay in it, older ones move to `kv_cache`'s format.
    `kv_budget_bytes`: the target's KV cache moves its oldest tokens (but the sinks and the
    recent window) to `kv_pressure_format` to stay within it (`KVCache`); `kv_drop=True` allows
    dropping the oldest tokens after the sinks when even that cannot fit (the built-in GPT, plain
    decoding: positions keep counting the dropped tokens). `stream` is called with each new token
    id as it is decided. Generation ends after the first of `stop_tokens` (an end of turn, EOS),
    which the result keeps. `decode_step`: ``"fused"`` runs each step as one C call
    (`minifloat.infer.generation.fused`: Llama-, Mistral-, Qwen2/3-, Phi-3-shaped transformers models and
    the built-in GPT; fp32 / bf16 / fp8 / nvfp4 / mxfp4 caches with a bf16 window and the
    hadamard, pre-rope or channel options; an error says why not for others), ``"eager"`` the model's own forward, ``"auto"``
    (default) the fused step where it runs (``MINIFLOAT_DECODE=eager`` turns it off)."""
    # the names first: a typo in kv_cache is reported as such, not as whatever else is wrong
    kv_name, kv_options = parse_kv_spec(kv_cache)  # an unknown format or option: a clear error before any work
    _check(model, input_ids, max_new_tokens, temperature, top_k, top_p, draft_tokens)
    input_ids = input_ids.to(device_of(model))  # token ids made on the CPU drive a model on a GPU
    kv_recent_format = kv_options.pop("recent_format", kv_recent_format)
    if kv_drop and (draft is not None or not adapter_for(model).drops_tokens):
        raise MinifloatError("kv_drop works with plain decoding of the built-in GPT: speculative decoding rolls "
                             "its cache back, and a transformers model counts positions from the cache's length")  # fmt: skip

    # the options given; the rest are KVSpec's defaults (written there only)
    given = dict(budget_bytes=kv_budget_bytes, pressure_format=kv_pressure_format, sink_tokens=kv_sink_tokens,
                 recent_tokens=kv_recent_tokens, recent_format=kv_recent_format, drop=kv_drop or None)  # fmt: skip
    spec = KVSpec(format=kv_name, **{k: v for k, v in given.items() if v is not None}, **kv_options)
    capacity = input_ids.shape[1] + max_new_tokens + (draft_tokens + 1 if draft is not None else 0)

    def make_cache(m) -> KVCache | FusedCache:
        return decode_cache(m, spec, capacity, decode_step=decode_step, scales=kv_scales if m is model else None,
                            slack=(draft_tokens + 1) if draft is not None else 0)  # a rejected draft's tokens roll back

    cache = make_cache(model)  # bad budget arguments, a step that cannot run: a clear error before any work
    gen = torch.Generator().manual_seed(seed if seed is not None else 0)
    was = model.training
    model.eval()
    t0 = time.perf_counter()
    try:
        if draft is None:
            seq, cache, forwards, stats = _plain(model, input_ids, max_new_tokens, cache, temperature, top_k, top_p, gen,
                                                 stream, set(stop_tokens))  # fmt: skip
        else:
            d = draft_model(model, draft)
            seq, cache, forwards, stats = _speculative(model, d, input_ids, max_new_tokens, cache, make_cache, temperature, top_k,
                                                       top_p, gen, stream, draft_tokens)  # fmt: skip
            seq = _cut_at_stop(seq, input_ids.shape[1], set(stop_tokens))
    finally:
        model.train(was)
    return Generation(seq, seq.shape[1] - input_ids.shape[1], time.perf_counter() - t0, cache.nbytes(), kv_cache,
                      forwards, kv_events=cache.events, kv_precisions=cache.precisions(),
                      decode_step="fused" if isinstance(cache, FusedCache) else "eager", **stats)  # fmt: skip


def _pick(logits: torch.Tensor, temperature, top_k, top_p, gen) -> int:
    if temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial(probabilities(logits, temperature, top_k, top_p), 1, generator=gen))


def _cut_at_stop(seq: torch.Tensor, prompt: int, stop: set[int]) -> torch.Tensor:
    """`seq` up to and with its first new token among `stop` (speculative decoding decides a few at once)."""
    new = seq[0, prompt:].tolist()
    at = next((i for i, t in enumerate(new) if t in stop), None)
    return seq if at is None else seq[:, : prompt + at + 1]


def _plain(model, ids, n, cache, temperature, top_k, top_p, gen, stream, stop=frozenset()):
    t0 = time.perf_counter()
    logits = forward(model, ids, cache, last=1)[0, -1]
    seq = ids
    forwards = 1
    prefill = None
    for i in range(n):
        tok = _pick(logits, temperature, top_k, top_p, gen)
        if prefill is None:
            prefill = time.perf_counter() - t0
        seq = torch.cat((seq, torch.tensor([[tok]], dtype=seq.dtype, device=seq.device)), 1)
        if stream:
            stream(tok)
        if tok in stop:
            break
        if i + 1 < n:
            logits = forward(model, seq[:, -1:], cache, last=1)[0, -1]
            forwards += 1
    return seq, cache, forwards, {"prefill_seconds": prefill}


def _speculative(model, draft, ids, n, target_cache, make_cache, temperature, top_k, top_p, gen, stream, k):
    draft_cache = make_cache(draft)
    seq = ids
    prompt = ids.shape[1]
    forwards = 0
    proposed = [0] * k
    accepted = [0] * k
    kept_counts = []
    while seq.shape[1] - prompt < n:
        room = n - (seq.shape[1] - prompt)
        kk = min(k, room - 1) if room > 1 else 0  # the target always adds one token of its own
        # the draft proposes kk tokens (feeding what its cache lacks first)
        drafts, qs = [], []
        if kk:
            logits = forward(draft, seq[:, draft_cache.length():], draft_cache, last=1)[0, -1]
            for i in range(kk):
                if temperature == 0:
                    tok = int(logits.argmax())
                else:
                    q = probabilities(logits, temperature, top_k, top_p)
                    tok = int(torch.multinomial(q, 1, generator=gen))
                    qs.append(q)
                drafts.append(tok)
                if i + 1 < kk:
                    logits = forward(draft, torch.tensor([[tok]], dtype=seq.dtype, device=seq.device), draft_cache, last=1)[0, -1]
        # the target scores the sequence's unseen tokens and the drafts in one pass
        base = target_cache.length()
        feed = torch.cat((seq[:, base:], torch.tensor([drafts], dtype=seq.dtype, device=seq.device).reshape(1, -1)), 1)
        first = seq.shape[1] - 1 - base  # the row of feed whose logits predict drafts[0]
        logits = forward(model, feed, target_cache, last=feed.shape[1] - first)[0]  # (kk + 1, vocab): from that row on
        forwards += 1
        n_ok, out = 0, None
        for i, tok in enumerate(drafts):
            lg = logits[i]
            proposed[i] += 1
            if temperature == 0:
                if int(lg.argmax()) != tok:
                    out = int(lg.argmax())
                    break
            else:
                p = probabilities(lg, temperature, top_k, top_p)
                if torch.rand((), generator=gen, dtype=torch.float64) >= torch.clamp(p[tok] / qs[i][tok], max=1.0):
                    residual = torch.clamp(p - qs[i], min=0.0)
                    total = residual.sum()
                    out = int(torch.multinomial(residual / total if total > 0 else p, 1, generator=gen))
                    break
            accepted[i] += 1
            n_ok += 1
        if out is None:  # every draft kept (or none proposed): one more token from the target
            out = _pick(logits[n_ok], temperature, top_k, top_p, gen)
        kept_counts.append(n_ok)
        new = drafts[:n_ok] + [out]
        seq = torch.cat((seq, torch.tensor([new], dtype=seq.dtype, device=seq.device)), 1)
        if stream:
            for tok in new:
                stream(tok)
        # both caches keep only tokens of the accepted sequence; the last token is fed next time
        target_cache.truncate(seq.shape[1] - 1)
        draft_cache.truncate(min(draft_cache.length(), seq.shape[1] - 1))
    stats = {"draft_tokens": k, "accepted_per_position": [a / p if p else 0.0 for a, p in zip(accepted, proposed, strict=True)],
             "mean_accepted": sum(kept_counts) / len(kept_counts) if kept_counts else 0.0,
             "proposed": sum(proposed), "accepted": sum(accepted)}  # fmt: skip
    return seq, target_cache, forwards, stats
