"""`minifloat bench decode`: what a weight format buys in decoding speed, what a KV-cache format
costs, and what an FP4 draft buys.

Weight formats (`weight_speed`): per PTQ config, the model quantized in memory (the LM head too,
by default) generates greedily from held-out prompts; tokens/s, the weight bytes one token reads
(every Linear's codes and scales once, a tied table once), the bound those bytes set at the read
bandwidth measured in the same run (`read_bandwidth`), and the ratio to FP32 tokens/s. With
verification rows, the same rounds also time one forward of M tokens after a prompt, every row's
logits computed (a speculative verification of M − 1 drafted tokens), against one row: what
drafted tokens cost the target, here and in llama.cpp.
`gemv_peers` times one decode GEMV per shape, interleaved: FP32, minifloat's decode kernels
and torch's own int4 / int8 weight-only CPU kernels (the peer; bfloat16 activations, the
dtype their fast paths take, and float32).

KV formats: along windows of each context length — the model's own greedy continuations of
held-out prompts (``source="generated"``, what a served model decodes), or held-out text itself
(``"text"``) — the model decodes token by token (teacher-forced: every format sees the same
tokens) with each cache format; its next-token distributions are compared with those of an FP32 cache: mean
per-token KL(fp32 ‖ format) and top-1 agreement, the KV bytes held at the window's end, and
decode tokens/s.

Speculative decoding: greedy generation from held-out prompts with each draft and k, each
right after plain greedy decoding of the same prompt: per-position acceptance, mean accepted
length, target forwards per token, measured tokens/s and the speed-up measured side by side
(the draft's FP4 weights run on the decode kernels), and the speed-up the measured acceptance implies where the draft's
forward costs `cost_ratio` of the target's (the standard formula: α the per-token acceptance,
(1 − α^(k+1)) / ((1 − α)(k·c + 1)); Leviathan et al., 2023).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from minifloat.errors import MinifloatError
from minifloat.infer import generate, load_model, quantize_model
from minifloat.infer.evaluation.metrics import Quality
from minifloat.infer.generation.decoding import decode_cache, device_of, draft_model, forward
from minifloat.infer.generation.kvcache import parse_kv_spec
from minifloat.infer.generation.kvspec import KVSpec
from minifloat.report.table import cell

WEIGHT_CONFIGS = ("fp32", "fp8-weight-only", "mxfp4-weight-only", "nvfp4-weight-only")
DEFAULT_FORMATS = ("bf16", "fp8", "fp8+bf16", "fp8_e5m2", "mxfp8", "mxfp6", "mxfp4", "nvfp4", "nvfp4+fp8")
FP4_COST_RATIO = 0.25  # an FP4 draft's forward against a BF16 target's: a quarter of the weight bytes (memory-bound decode)


@torch.no_grad()
def _decode_logits(model, window: torch.Tensor, fmt: str, prefill: int,
                   decode_step: str = "auto") -> tuple[torch.Tensor, float, int, str]:  # fmt: skip
    """`fmt`: a KV format, or ``FORMAT+RECENT`` (e.g. ``fp8+bf16``: the sinks and the last 32
    tokens in RECENT, older ones in FORMAT), with ``@OPTION``s (`parse_kv_spec`); decoded by the
    fused step where it keeps that cache (`decode_step` ``"auto"``), else eagerly."""
    from minifloat.infer.generation.decoding import decode_cache, forward
    from minifloat.infer.generation.fused import FusedCache
    from minifloat.infer.generation.kvspec import KVSpec

    name, kw = parse_kv_spec(fmt)
    cache = decode_cache(model, KVSpec(format=name, **kw), window.shape[1], decode_step=decode_step)
    rows = [forward(model, window[:, :prefill], cache, last=1)[0]]
    t0 = time.perf_counter()
    for t in range(prefill, window.shape[1] - 1):
        rows.append(forward(model, window[:, t : t + 1], cache, last=1)[0])
    step = "fused" if isinstance(cache, FusedCache) else "eager"
    return torch.cat(rows).float(), time.perf_counter() - t0, cache.nbytes(), step


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
        ws = [text[s : s + ctx].reshape(1, -1).long().to(device_of(model)) for s in starts]
        if source == "generated":  # the prompt, then the model's own greedy tokens (FP32 cache)
            ws = [generate(model, w[:, :prefill], ctx - prefill, kv_cache="fp32").tokens for w in ws]
        ref = [_decode_logits(model, w, "fp32", prefill)[0] for w in ws]
        for fmt in formats:
            q, secs = Quality(), 0.0
            for w, r in zip(ws, ref, strict=True):
                lg, s, nbytes, step = _decode_logits(model, w, fmt, prefill)
                q.add(lg, reference=r)
                secs += s
            n, quality = q.tokens, q.result()
            row = {"format": fmt, "context": ctx, "source": source, "tokens": int(n), "kl": quality["kl"], "top1": quality["top1"],
                   "kv_bytes": nbytes, "tokens_per_s": (n - len(ws)) / secs if secs else float("inf"),
                   "decode_step": step}  # fmt: skip
            rows.append(row)
            echo(f"  ctx {ctx:>4} {fmt:<22} KL {row['kl']:.2e}  top-1 {row['top1']:.4f}  KV {nbytes:,} B  "
                 f"{row['tokens_per_s']:,.0f} tok/s ({step})")  # fmt: skip
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
                cost_ratio: float = FP4_COST_RATIO, calibration: Sequence[torch.Tensor] | None = None,
                echo: Callable[[str], None] = print) -> dict:  # fmt: skip
    """Plain greedy against speculative greedy per draft and k (see the module docstring). Each
    speculative generation runs right after a plain one of the same prompt, so the speed-up is
    a ratio measured side by side (a shared machine slows both alike)."""
    plain_s = plain_n = 0.0
    rows = []
    for name in drafts:
        d = draft_model(model, name, calibration)
        generate(model, prompts[0], 4, kv_cache=kv_cache, draft=d, draft_tokens=ks[0])  # warm: plans, tables
        for k in ks:
            secs = n = forwards = 0.0
            p_secs = p_n = 0.0
            accepted = proposed = 0
            per_pos = [0.0] * k
            kept = []
            for p in prompts:
                g0 = generate(model, p, new_tokens, kv_cache=kv_cache)
                p_secs += g0.seconds
                p_n += g0.new_tokens
                g = generate(model, p, new_tokens, kv_cache=kv_cache, draft=d, draft_tokens=k)
                secs += g.seconds
                n += g.new_tokens
                forwards += g.target_forwards
                kept.append(g.mean_accepted)
                per_pos = [a + b / len(prompts) for a, b in zip(per_pos, g.accepted_per_position, strict=True)]
                accepted += g.accepted
                proposed += g.proposed
            plain_s, plain_n = plain_s + p_secs, plain_n + p_n
            alpha = accepted / proposed if proposed else 0.0
            row = {"draft": name, "k": k, "acceptance_per_position": per_pos, "token_acceptance": alpha,
                   "mean_accepted": sum(kept) / len(kept), "target_forwards_per_token": forwards / n,
                   "tokens_per_s": n / secs, "plain_tokens_per_s": p_n / p_secs, "speedup_here": (n / secs) / (p_n / p_secs),
                   "implied_speedup": implied_speedup(alpha, k, cost_ratio)}  # fmt: skip
            rows.append(row)
            echo(f"  draft {name} k={k}: acceptance {alpha:.3f}, mean accepted {row['mean_accepted']:.2f}, "
                 f"{row['target_forwards_per_token']:.2f} target forwards/token, {row['tokens_per_s']:.1f} tok/s against "
                 f"{row['plain_tokens_per_s']:.1f} plain: ×{row['speedup_here']:.2f} here, "
                 f"×{row['implied_speedup']:.2f} implied (draft cost {cost_ratio})")  # fmt: skip
    plain_tps = plain_n / plain_s if plain_s else 0.0
    return {"plain_tokens_per_s": plain_tps, "cost_ratio": cost_ratio, "kv_cache": kv_cache, "runs": rows}


def _median_interleaved(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median seconds of each call, the calls interleaved round by round (a noisy machine slows
    them alike)."""
    for f in fns.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def read_bandwidth(nbytes: int = 256 << 20, reps: int = 5, device: torch.device | str = "cpu") -> float:
    """Bytes/s of one read-only pass over a buffer far larger than the caches (a sum) in `device`'s
    memory (``.item()`` waits for a GPU to finish)."""
    x = torch.ones(nbytes // 4, device=device)
    t = _median_interleaved({"sum": lambda: x.sum().item()}, reps)["sum"]
    return nbytes / t


def multiply_adds_per_token(model: torch.nn.Module) -> int:
    """Multiply-adds of one token through every Linear (float or packed; a tied head counted once,
    as the Linear it is): a decode step's arithmetic, attention over a short context aside."""
    from minifloat.infer.modules.linear import QuantizedLinear

    return sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, (torch.nn.Linear, QuantizedLinear)))


def float32_rows_within(one_row_s: float, macs: int, rate: float, ratio: float = 1.5, most: int = 4096) -> int:
    """The most rows of x whose float32 multiply-adds alone (rows × `macs` at `rate`) fit in `ratio`
    × one row's measured time: past it, ≤ `ratio` × one row cannot be had in float32 here,
    however the weights are read."""
    return min(most, int(ratio * one_row_s * rate // macs))


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every Linear's weight (packed codes and scales, or
    the float tensor) and bias, a table shared by tied modules once. The embedding reads one row."""
    from minifloat.infer.modules.linear import QuantizedLinear

    seen, total = set(), 0
    for mod in model.modules():
        if isinstance(mod, QuantizedLinear):
            parts = [b for n, b in mod.named_buffers() if not n.startswith("input_transform.")]
        elif isinstance(mod, torch.nn.Linear):
            parts = [p for p in (mod.weight, mod.bias) if p is not None]
        else:
            continue
        for t in parts:
            if t is not None and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.nbytes
    return total


PROFILE_GEMV = ("minifloat::gemv", "aten::linear", "aten::addmm", "aten::mm", "aten::matmul")
PROFILE_ATTENTION = ("aten::scaled_dot_product_attention", "minifloat::kv_cache")


def _labelled(fn, label: str):
    def run(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)

    return run


@torch.no_grad()
def profile_decode(model: torch.nn.Module, prompt: torch.Tensor, steps: int = 32, decode_step: str = "eager",
                   kv_cache: str = "fp32") -> dict:  # fmt: skip
    """Where `steps` greedy decode steps after `prompt` spend their time, per kind: ``gemv`` (every
    Linear's product), ``attention`` (attention and the KV cache), ``norms_rope_activations`` (the
    other tensor operations: norms, the rotary embedding, SiLU, residuals, the embedding, argmax),
    ``python_dispatch`` (the rest of the wall time: the interpreter, transformers' Python, torch's
    dispatch between operations). Eager: torch's profiler, its top-level operations by name, each
    packed Linear's kernel call and each cache update labelled for it (the profiler's own cost
    lands in python_dispatch: `unprofiled_ms` is the same loop without it). Fused: mf_decode's own
    timers (`FusedCache.start_profile`); the time outside the C call is python_dispatch."""
    from minifloat.infer.generation.decoding import decode_cache, forward
    from minifloat.infer.generation.fused import FusedCache
    from minifloat.infer.generation.kvspec import KVSpec
    from minifloat.infer.modules.linear import QuantizedLinear

    def run_steps(cache, first: int) -> float:
        tok = first
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = int(forward(model, torch.tensor([[tok]]), cache, last=1)[0, -1].argmax())
        return time.perf_counter() - t0

    def fresh():
        cache = decode_cache(model, KVSpec(format=kv_cache), prompt.shape[1] + steps + 1, decode_step=decode_step)
        logits = forward(model, prompt, cache, last=1)[0, -1]
        return cache, int(logits.argmax()), "fused" if isinstance(cache, FusedCache) else "eager"

    cache, first, taken = fresh()
    unprofiled = run_steps(cache, first)
    cache, first, _ = fresh()
    kinds = dict.fromkeys(("gemv", "attention", "norms_rope_activations", "python_dispatch"), 0.0)
    if isinstance(cache, FusedCache):
        cache.start_profile()
        wall = run_steps(cache, first)
        for k, v in cache.stop_profile().items():
            kinds[k] += v
        kinds["python_dispatch"] = wall - sum(kinds.values())
    else:
        # labels for the profiler, as instance attributes (the classes' own methods run inside them)
        undo = [(m, "forward", "minifloat::gemv") for m in model.modules() if isinstance(m, QuantizedLinear)]
        undo += [(layer, "update", "minifloat::kv_cache") for layer in getattr(cache, "layers", [])]
        for obj, name, label in undo:
            setattr(obj, name, _labelled(getattr(obj, name), label))
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                wall = run_steps(cache, first)
        finally:
            for obj, name, _ in undo:
                delattr(obj, name)
        for e in prof.events():
            if e.cpu_parent is not None:
                continue
            kind = ("gemv" if e.name in PROFILE_GEMV else "attention" if e.name in PROFILE_ATTENTION
                    else "norms_rope_activations")  # fmt: skip
            kinds[kind] += e.cpu_time_total / 1e6
        kinds["python_dispatch"] = wall - sum(kinds.values())
    per = {k: 1e3 * v / steps for k, v in kinds.items()}
    return {"decode_step": taken, "steps": steps, "ms_per_token": 1e3 * wall / steps,
            "unprofiled_ms_per_token": 1e3 * unprofiled / steps, "ms": per,
            "share": {k: v / (1e3 * wall / steps) for k, v in per.items()}}  # fmt: skip


@torch.no_grad()
def verify_seconds(model, prompt: torch.Tensor, following: torch.Tensor, rows: Sequence[int], *,
                   decode_step: str = "auto", kv_cache: str = "fp32", repeats: int = 3) -> dict[int, float]:  # fmt: skip
    """Per M in `rows`, the best of `repeats` seconds of one forward of the first M tokens of
    `following` (1, ≥ M) after `prompt` (1, P), every row's logits computed — what a speculative
    verification of M − 1 drafted tokens costs the target —, the cache cut back to the prompt
    before each."""
    name, options = parse_kv_spec(kv_cache)
    cache = decode_cache(model, KVSpec(format=name, **options), prompt.shape[1] + max(rows), decode_step=decode_step,
                         slack=max(rows))  # fmt: skip
    forward(model, prompt, cache, last=1)
    start, seconds = cache.length(), {}
    for _ in range(repeats):
        for m in rows:
            cache.truncate(start)
            t0 = time.perf_counter()
            forward(model, following[:, :m], cache, last=m)
            seconds[m] = min(seconds.get(m, float("inf")), time.perf_counter() - t0)
    return seconds


def _ids(t: torch.Tensor) -> str:
    """Token ids as `llamacpp_peer.py` takes them: ``1,2,3``."""
    return ",".join(str(int(x)) for x in t.reshape(-1).tolist())


def _rows_table(label: str, best: dict[int, float]) -> list[dict]:
    """`best` seconds per row count as rows of the verification table (× one row's time)."""
    one = best[min(best)]
    return [{"rows": m, "ms": 1e3 * s, "vs_one_row": s / one, "of": label} for m, s in sorted(best.items())]


LLAMACPP_PAIRS = {"fp32": "F32", "fp8-weight-only": "Q8_0", "mxfp4-weight-only": "Q4_0", "nvfp4-weight-only": "Q4_0"}


def weight_speed(path: str, prompts: Sequence[torch.Tensor], configs: Sequence[str] = WEIGHT_CONFIGS,
                 new_tokens: int = 32, quantize_head: bool = True, kv_cache: str = "fp32",
                 device: torch.device | str = "cpu", decode_steps: Sequence[str] = ("auto",), repeats: int = 3,
                 llamacpp: tuple[str, str] | None = None, threads: int | None = None,
                 verify: tuple[torch.Tensor, Sequence[int]] | None = None, echo: Callable[[str], None] = print) -> dict:  # fmt: skip
    """Greedy decoding speed per weight config (see the module docstring); ``"fp32"`` is the
    unquantized model, the ratios' baseline. Decode tokens/s count the decode steps alone (the
    tokens after the first over the time after the prefill, as engines report decode speed), the
    best of `repeats` rounds in which every config, under each of `decode_steps`, and every
    llama.cpp file decodes every prompt once. `llamacpp` (the Python of a venv with
    llama-cpp-python, a folder): llama.cpp's own F32 / Q8_0 / Q4_0 files of the .gguf `path`,
    made there by its quantizer, decode the same prompts in the same rounds (`llamacpp_peer.py`),
    and each config's row gets its ratio to its pair (`LLAMACPP_PAIRS`). `verify` (the tokens that
    follow the first prompt, row counts with 1 among them): in the same rounds, `verify_seconds` of
    every config and step and the same forward in each llama.cpp file (the best of 3 each round),
    in ``verify`` rows with each count's time over one row's."""
    from minifloat.measure import llamacpp as lc

    threads = threads or torch.get_num_threads()
    was_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    bandwidth = read_bandwidth(device=device)
    echo(f"  read bandwidth {bandwidth / 1e9:.1f} GB/s (one pass over 256 MiB), {threads} threads")
    rate = None  # float32 multiply-adds/s the decode kernels can reach here: the verification rows' floor
    if verify is not None and torch.device(device).type == "cpu":
        from minifloat.kernels import gemv

        rate = gemv.multiply_add_rate(threads)
        if rate:
            echo(f"  float32 multiply-adds: {rate / 1e9:.0f} G/s at most ({gemv.best_isa()} fused multiply-adds, no memory "
                 f"touched, {threads} threads)")  # fmt: skip
    files: dict[str, str] = {}
    if llamacpp is not None:
        python, folder = llamacpp
        files = lc.llamacpp_files(path, folder, python, sorted({LLAMACPP_PAIRS[c] for c in configs if c in LLAMACPP_PAIRS},
                                                               key=lc.LLAMA_TYPES.index), threads=threads, progress=echo)  # fmt: skip
    models = {}
    for cfg in configs:
        model = load_model(path).to(device)
        if cfg != "fp32":
            quantize_model(model, cfg, quantize_head=quantize_head)
        models[cfg] = model
    runs = [(cfg, step) for cfg in configs for step in decode_steps]
    steps_taken: dict[tuple[str, str], str] = {}
    for cfg, step in runs:  # warm: first calls build plans and tables
        steps_taken[cfg, step] = generate(models[cfg], prompts[0], 4, kv_cache=kv_cache, decode_step=step).decode_step
    best: dict = {}
    verified: dict = {}  # (config, step) or a llama.cpp type -> {rows: best seconds}
    prompt_arg = ";".join(_ids(p) for p in prompts)
    try:
        for rnd in range(repeats):  # interleaved: a noisy machine slows every run of a round alike
            for cfg, step in runs:
                n = secs = 0.0
                for p in prompts:
                    g = generate(models[cfg], p, new_tokens, kv_cache=kv_cache, decode_step=step)
                    n += g.new_tokens - 1
                    secs += g.seconds - g.prefill_seconds
                best[cfg, step] = max(best.get((cfg, step), 0.0), n / secs)
            for t, f in files.items():
                r = lc.peer(llamacpp[0], "decode", f, "--prompt", prompt_arg, "--tokens", str(new_tokens), "--repeats", "1",
                            "--threads", str(threads))  # fmt: skip
                best[t] = max(best.get(t, 0.0), r["tokens_per_s"])
            if verify is not None:
                following, counts = verify
                took = {(cfg, step): verify_seconds(models[cfg], prompts[0], following, counts, decode_step=step, kv_cache=kv_cache)
                        for cfg, step in runs}  # fmt: skip
                for t, f in files.items():
                    r = lc.peer(llamacpp[0], "rows", f, "--prompt", _ids(prompts[0]), "--next", _ids(following[:, : max(counts)]),
                                "--rows", ",".join(map(str, counts)), "--threads", str(threads))  # fmt: skip
                    took[t] = {int(m): s for m, s in r["seconds"].items()}
                for key, secs in took.items():
                    verified[key] = {m: min(s, verified.get(key, {}).get(m, s)) for m, s in secs.items()}
            echo(f"  round {rnd + 1}/{repeats} done")
    finally:
        torch.set_num_threads(was_threads)
    rows = []
    macs = {cfg: multiply_adds_per_token(m) for cfg, m in models.items()}
    for cfg, step in runs:
        nbytes = weight_bytes_per_token(models[cfg])
        row = {"config": cfg, "decode_step": steps_taken[cfg, step], "tokens_per_s": best[cfg, step],
               "weight_bytes_per_token": nbytes, "bound_tokens_per_s": bandwidth / nbytes}  # fmt: skip
        pair = LLAMACPP_PAIRS.get(cfg)
        if pair in best:
            row["llamacpp_file"], row["llamacpp_tokens_per_s"] = pair, best[pair]
            row["vs_llamacpp"] = best[cfg, step] / best[pair]
        rows.append(row)
    del models
    base = next((r["tokens_per_s"] for r in rows if r["config"] == "fp32"), None)
    for r in rows:
        r["vs_fp32"] = r["tokens_per_s"] / base if base else None
        echo(f"  {r['config']:<20} {r['decode_step']:<6} {r['tokens_per_s']:7.1f} tok/s  {r['weight_bytes_per_token'] / 1e6:8.1f} MB/token  "
             f"bound {r['bound_tokens_per_s']:7.1f} tok/s  " + (f"×{r['vs_fp32']:.2f} FP32" if base else "")
             + (f"  llama.cpp {r['llamacpp_file']} {r['llamacpp_tokens_per_s']:.1f} tok/s: ×{r['vs_llamacpp']:.2f}" if "vs_llamacpp" in r else ""))  # fmt: skip
    llama_rows = [{"file": t, "tokens_per_s": best[t], "path": f} for t, f in files.items()]
    table = []
    if verify is not None:
        echo(f"  one forward of M tokens after a {prompts[0].shape[1]}-token prompt, every row's logits (a speculative "
             "verification of M − 1 drafted tokens), best of 3 a round; ms and × one row:")  # fmt: skip
        labels = {(cfg, step): f"{cfg} {steps_taken[cfg, step]}" for cfg, step in runs} | {t: f"llama.cpp {t}" for t in files}
        for key, label in labels.items():
            part = _rows_table(label, verified[key])
            table += part
            echo(f"    {label:<28} " + "  ".join(f"{r['rows']:>2}: {r['ms']:7.2f} ms ×{r['vs_one_row']:.2f}" for r in part))
        if rate:  # llama.cpp's files aside: past one row it multiplies 8-bit integers, no float32 floor
            echo("  float32's floor: M rows × a row's multiply-adds at the rate above; the most rows whose floor alone "
                 "fits in 1.5× one row's time:")  # fmt: skip
            for key, label in ((k, v) for k, v in labels.items() if k not in files):
                one, n = verified[key][1], macs[key[0]]
                most = float32_rows_within(one, n, rate)
                peak = []  # the rows past the first: their multiply-adds' floor over the time they added
                for r in (r for r in table if r["of"] == label):
                    r["float32_floor_ms"], r["float32_rows_within_1_5x"] = 1e3 * r["rows"] * n / rate, most
                    if r["rows"] > 1:
                        added = r["ms"] / 1e3 - one
                        r["added_rows_at_peak"] = (r["rows"] - 1) * n / rate / added if added > 0 else None
                        peak.append(f"{r['rows']}: {cell(r['added_rows_at_peak'], '.0%')}")
                echo(f"    {label:<28} {n / 1e6:6.1f} M multiply-adds a row: {1e3 * n / rate:.2f} ms a row, "
                     f"≤ 1.5× one row ({1.5e3 * one:.2f} ms) up to {most} row{'s' if most != 1 else ''}; "
                     f"the rows past the first at {', '.join(peak) or '-'} of the peak")  # fmt: skip
    return {"read_bandwidth_bytes_per_s": bandwidth, "multiply_add_rate": rate, "quantize_head": quantize_head, "new_tokens": new_tokens,
            "prompts": len(prompts), "threads": threads, "repeats": repeats, "kv_cache": kv_cache, "runs": rows,
            "llamacpp": llama_rows, "verify": table}  # fmt: skip


GEMV_SCHEMES = ("nvfp4", "mxfp4", "fp8_rowwise")


def gemv_peers(shapes: Sequence[tuple[int, int]] = ((2048, 8192),), schemes: Sequence[str] = GEMV_SCHEMES,
               reps: int = 30, echo: Callable[[str], None] = print) -> list[dict]:  # fmt: skip
    """One decode GEMV (1 × K · (N × K)ᵀ) per shape (K, N), interleaved: FP32 ``F.linear``, the
    decode kernels per scheme (called from Python as a layer calls them, and the kernel alone:
    `Plan.bound`), torch's int4 (group 32) and int8 weight-only CPU kernels with bfloat16 and
    float32 activations. Median ms and the ratio to FP32."""
    import torch.nn.functional as F

    from minifloat.gemm import prepack
    from minifloat.quant import quantize

    rows = []
    for k, n in shapes:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(n, k, generator=g)
        x = torch.randn(1, k, generator=g)
        fns: dict[str, Callable[[], object]] = {"fp32": lambda w=w, x=x: F.linear(x, w)}
        for name in schemes:
            packed = prepack(quantize(w, name))  # as a QuantizedLinear holds it
            fns[f"minifloat {name}"] = lambda p=packed, x=x: p(x)
            if packed.plan is not None:  # the kernel alone, as a fused decode step calls it (no Python per call)
                fns[f"minifloat {name} (kernel)"] = packed.plan.bound(x, packed.isa)
        if k % 32 == 0 and n % 16 == 0 and hasattr(torch, "_weight_int4pack_mm_for_cpu"):
            codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
            packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
            sz = torch.rand(k // 32, n, 2, generator=g)
            w8, s8 = torch.randint(-128, 127, (n, k), dtype=torch.int8, generator=g), torch.rand(n, generator=g)
            for dt, tag in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
                xd, szd, s8d = x.to(dt), sz.to(dt), s8.to(dt)
                fns[f"torch int4 ({tag} x)"] = lambda xd=xd, szd=szd, p=packed: torch._weight_int4pack_mm_for_cpu(xd, p, 32, szd)
                fns[f"torch int8 ({tag} x)"] = lambda xd=xd, s8d=s8d, w8=w8: torch._weight_int8pack_mm(xd, w8, s8d)
        t = _median_interleaved(fns, reps)
        echo(f"  GEMV 1×{k} · ({n}×{k})ᵀ, median of {reps}:")
        for name, secs in t.items():
            row = {"shape": [k, n], "kernel": name, "ms": secs * 1e3, "vs_fp32": t["fp32"] / secs}
            rows.append(row)
            echo(f"    {name:<26} {row['ms']:8.3f} ms  ×{row['vs_fp32']:.2f} FP32")
    return rows
