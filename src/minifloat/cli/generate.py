"""`minifloat generate`: stream a continuation of a prompt from a trained built-in GPT, with a
(quantized) KV cache and optionally an FP4 draft; then the statistics."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from minifloat.io import jsonio


def add_parser(sub: argparse._SubParsersAction) -> None:
    from minifloat.infer.generation.decoding import DRAFT_NAMES
    from minifloat.infer.generation.kvcache import KV_FORMATS, KVSpec

    p = sub.add_parser("generate", help="generate text with a KV cache (FP8 / FP4 caches, FP4 self-speculative drafts)")
    p.add_argument("model", help="a `minifloat train` output folder or checkpoint, a transformers model folder or a .gguf file")
    p.add_argument("--scheme", default=None, help="quantize the model in memory with this PTQ config first (e.g. nvfp4-weight-only)")
    p.add_argument("--quantize-head", action="store_true", help="with --scheme: the LM head and the embedding too (weight-only)")
    p.add_argument("--prompt", required=True, help="the text to continue (the folder's tokenizer, else UTF-8 bytes)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    p.add_argument("--chat", action="store_true",
                   help="the prompt is a user message: render it with the tokenizer's chat template and stop at the end of the answer (EOS)")
    p.add_argument("--kv-cache", default="bf16", metavar="FORMAT[+RECENT][@OPTION]",
                   help=f"KV-cache format ({', '.join(KV_FORMATS)}), optionally +RECENT (e.g. +bf16: the sinks and last tokens "
                        f"in it) and @hadamard, @hadamard-kv, @channel (KIVI's per-channel keys), @pre-rope")  # fmt: skip
    p.add_argument("--kv-recent", default=None, choices=list(KV_FORMATS), metavar="FORMAT",
                   help="keep the first 4 and the last 32 tokens' K/V in this format (e.g. bf16), older ones in --kv-cache")
    p.add_argument("--kv-budget", type=_bytes, default=None, metavar="SIZE",
                   help="KV-cache budget (e.g. 64MB, 512KiB): old tokens move to --kv-pressure-format to stay within it")
    p.add_argument("--kv-pressure-format", default=KVSpec().pressure_format, choices=list(KV_FORMATS), help="the format under memory pressure")
    p.add_argument("--kv-drop", action="store_true",
                   help="with --kv-budget: drop the oldest tokens (after the sinks) when even the pressure format cannot fit")
    p.add_argument("--draft", default=None, choices=list(DRAFT_NAMES),
                   help="speculative decoding with this FP4 copy of the model as draft (-gptq: quantized by GPTQ on "
                        "--draft-calib-batches of --draft-data's training split; greedy output stays the model's own)")  # fmt: skip
    p.add_argument("--draft-data", default=None, help="a -gptq draft's calibration text: UTF-8 file or folder (default: the Python stdlib sources)")
    p.add_argument("--draft-calib-batches", type=int, default=8, help="a -gptq draft's calibration batches (4 × 128 tokens)")
    p.add_argument("--draft-tokens", type=int, default=4, help="tokens the draft proposes per verification")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample from the smallest set holding this probability")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--json", action="store_true", help="print the statistics as JSON (no streaming)")
    p.set_defaults(run=run)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def _bytes(text: str) -> int:
    """'64MB' → 64·10^6, '512KiB' → 512·2^10, '1000' → 1000."""
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    try:
        value = float(num) * _UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 64MB, 512KiB, 1000)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a budget must be ≥ 1 byte, got {text!r}")
    return int(value)


def run(args: argparse.Namespace) -> int:
    import torch

    from minifloat.data.text import tokenizer_for
    from minifloat.errors import MinifloatError
    from minifloat.infer import generate, load_model
    from minifloat.infer.evaluation.pipeline import quantize_in_memory
    from minifloat.infer.generation.kvcache import parse_kv_spec

    if not args.prompt:
        raise MinifloatError("--prompt is empty; give some text to continue")
    gptq_draft = bool(args.draft and args.draft.endswith("-gptq"))
    if (args.draft_data is not None or args.draft_calib_batches != 8) and not gptq_draft:
        raise MinifloatError("--draft-data and --draft-calib-batches calibrate a GPTQ draft: add --draft nvfp4-gptq (or mxfp4-gptq)")
    if args.draft_data is not None and not Path(args.draft_data).exists():
        raise MinifloatError(f"--draft-data {args.draft_data}: no such file or folder")
    if args.draft_calib_batches < 1:
        raise MinifloatError(f"--draft-calib-batches must be ≥ 1, got {args.draft_calib_batches}")
    parse_kv_spec(args.kv_cache)  # a typo in --kv-cache: an error before the model loads
    if args.scheme:
        from minifloat.infer import get_quant_config

        get_quant_config(args.scheme)  # an unknown name: an error before the model loads
    elif args.quantize_head:
        raise MinifloatError("--quantize-head goes with --scheme (it quantizes the head with that config)")
    model = load_model(args.model)
    tokenizer = tokenizer_for(args.model)
    if args.scheme:
        quantize_in_memory(model, args.scheme, tokenizer, quantize_head=args.quantize_head)
    draft = args.draft
    if gptq_draft:
        from minifloat.data.text import TextSource, batches_for
        from minifloat.infer.generation.decoding import draft_model

        source = TextSource(data=args.draft_data, batch_size=4, calib_batches=args.draft_calib_batches)
        draft = draft_model(model, args.draft, batches_for(model, source, "train", tokenizer))
    stop: list[int] = []
    if args.chat:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise MinifloatError(f"--chat renders the prompt with the model's chat template; {args.model} has "
                                 f"{'no tokenizer' if tokenizer is None else 'a tokenizer without one'}")  # fmt: skip
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        ids = torch.tensor([list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)])
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        stop = sorted({tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None})
    else:
        ids = torch.tensor([tokenizer.encode(args.prompt) if tokenizer else list(args.prompt.encode("utf-8"))])
    pending: list[int] = []

    def text_of(tokens: list[int]) -> str:
        return tokenizer.decode(tokens) if tokenizer else bytes(tokens).decode("utf-8", "strict")

    def stream(tok: int) -> None:  # a token may end inside a character: print what decodes whole
        pending.append(tok)
        try:
            piece = text_of(pending)
        except UnicodeDecodeError:
            if len(pending) < 4:
                return
            piece = bytes(pending).decode("utf-8", "replace")
        if piece.endswith("\ufffd") and len(pending) < 4:
            return
        sys.stdout.write(piece)
        sys.stdout.flush()
        pending.clear()

    if not args.json and not args.chat:
        sys.stdout.write(args.prompt)
    g = generate(model, ids, args.max_new_tokens, kv_cache=args.kv_cache, temperature=args.temperature, top_k=args.top_k,
                 top_p=args.top_p, seed=args.seed, draft=draft, draft_tokens=args.draft_tokens,
                 kv_budget_bytes=args.kv_budget, kv_pressure_format=args.kv_pressure_format, kv_recent_format=args.kv_recent, kv_drop=args.kv_drop,
                 stream=None if args.json else stream, stop_tokens=stop)  # fmt: skip
    stats = g.to_dict()
    if args.json:
        new = g.tokens[0, ids.shape[1] :].tolist()
        text = tokenizer.decode(new) if tokenizer else bytes(new).decode("utf-8", "replace")
        print(jsonio.dumps({"text": text, **stats}, indent=2))
        return 0
    print(f"\n\n{g.new_tokens} tokens in {g.seconds:.2f} s ({g.tokens_per_s:,.1f} tokens/s); KV cache {args.kv_cache}: "
          f"{g.kv_bytes:,} bytes; {stats['target_forwards_per_token']:.2f} target forwards per token")  # fmt: skip
    if args.kv_budget:
        mix = ", ".join(f"{n} {f}" for f, n in stats["kv_precision_mix"].items())
        print(f"KV budget {args.kv_budget:,} bytes: tokens held {mix}; {stats['kv_events']} moves to {args.kv_pressure_format}")
    if args.draft:
        rates = ", ".join(f"{r:.2f}" for r in g.accepted_per_position)
        print(f"draft {args.draft}, k = {args.draft_tokens}: acceptance per position {rates}; "
              f"mean accepted {g.mean_accepted:.2f}")  # fmt: skip
    return 0
