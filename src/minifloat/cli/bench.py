"""`minifloat bench quantize|gemm|train`: side-by-side timings, medians of interleaved repetitions."""

from __future__ import annotations

import argparse
import sys

from minifloat.cli.defaults import keyword_defaults
from minifloat.errors import MinifloatError
from minifloat.io import jsonio
from minifloat.measure import bench
from minifloat.report.table import cell

QUANTIZE, GEMM, TRAIN = (keyword_defaults(f) for f in (bench.bench_quantize, bench.bench_gemm, bench.bench_train))
_WEIGHTS = ("fp32", "fp8-weight-only", "mxfp4-weight-only", "nvfp4-weight-only")  # bench_decode.WEIGHT_CONFIGS


def _dims(example: str, what: str):
    """An argparse type for 'AxBx...' with as many positive integers as `example` has."""
    count = example.count("x") + 1

    def parse(text: str) -> tuple[int, ...]:
        try:
            dims = tuple(int(v) for v in text.lower().split("x"))
        except ValueError:
            dims = ()
        if len(dims) != count or min(dims) < 1:
            raise argparse.ArgumentTypeError(f"{what} must look like {example}, got {text!r}")
        return dims

    return parse


def _counts(text: str, option: str) -> list[int]:
    """Comma-separated positive integers, in the order given ('' or spaces alone: none)."""
    try:
        counts = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        counts = [0]
    if any(c < 1 for c in counts):
        raise MinifloatError(f"{option} takes comma-separated positive integers, e.g. 1,2,4; got {text!r}")
    return counts


def _fmt(v: float | None, spec: str, suffix: str = "") -> str:
    """A terminal table cell (`minifloat.report.table.cell`), '-' when there is no figure."""
    return cell(v, spec, missing="-", suffix=suffix)


_gemv_shape = _dims("2048x8192", "a GEMV shape (KxN)")
_size = _dims(f"{QUANTIZE['rows']}x{QUANTIZE['cols']}", "size")
_mnk = _dims("4096x4096x4096", "shape (MxNxK)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="side-by-side timings")
    p.add_argument("what", choices=["quantize", "gemm", "train", "decode", "llamacpp"], help="what to time")
    p.add_argument("model", nargs="?", default=None, help="decode: a `minifloat train` output folder or checkpoint, a transformers model folder or a .gguf file; llamacpp: a .gguf file or a transformers folder")
    p.add_argument("--weights", default=None,
                   help="decode: comma-separated PTQ configs to time greedy decoding with, fp32 the baseline ('' for none; "
                        "default: fp32 and the fp8, mxfp4 and nvfp4 weight-only configs)")
    p.add_argument("--no-quantize-head", dest="quantize_head", action="store_false",
                   help="decode: keep the LM head (and a tied embedding) in float; by default they are quantized weight-only too")
    p.add_argument("--decode-steps", default="auto",
                   help="decode: comma-separated ways to run a step for --weights: fused (one C call), eager (the model's "
                        "own forward), auto (fused where it runs); each is timed")
    p.add_argument("--profile", action="store_true",
                   help="decode: where a decode step's time goes (GEMV, attention, norms / RoPE / activations, Python and "
                        "dispatch) for each of --weights under each of --decode-steps")
    p.add_argument("--llamacpp", action="store_true",
                   help="decode: llama.cpp's own F32 / Q8_0 / Q4_0 files of the .gguf MODEL decode the same prompts in the "
                        "same interleaved rounds (llama-cpp-python's venv: --llamacpp-python, --build-venv; files in --out; "
                        "--threads for both)")
    p.add_argument("--verify-rows", default="1,2,4,8,16",
                   help="decode: comma-separated M: one forward of M tokens after a prompt, every row's logits (a speculative "
                        "verification of M − 1 drafted tokens), timed for each of --weights (and llama.cpp's files with "
                        "--llamacpp) against one row, beside the floor the CPU's float32 multiply-add rate sets ('' for none)")
    p.add_argument("--gemv", default="2048x8192", help="decode: comma-separated KxN decode GEMVs to time against torch's int4 / int8 kernels ('' for none)")
    p.add_argument("--kv-formats", default=None,
                   help="decode: comma-separated KV caches, FORMAT[+RECENT][@OPTION…] with OPTION hadamard, hadamard-kv, "
                        "channel (KIVI's per-channel keys) or pre-rope, e.g. nvfp4+bf16@channel (default: every format)")  # fmt: skip
    p.add_argument("--data", default=None, help="decode: UTF-8 text file or folder whose held-out split it reads (default: the Python stdlib sources)")
    p.add_argument("--contexts", default="128", help="decode: comma-separated window lengths (≤ the model's context)")
    p.add_argument("--drafts", default="nvfp4,mxfp4",
                   help="decode: FP4 drafts for speculative decoding, nvfp4 or mxfp4, each optionally -gptq (a copy "
                        "quantized by GPTQ on --draft-calib-batches of the training split) ('' for none)")
    p.add_argument("--draft-calib-batches", type=int, default=8, help="decode: calibration batches (4 × 128 tokens) of a -gptq draft")
    p.add_argument("--draft-tokens", default="2,4,8", help="decode: comma-separated k")
    p.add_argument("--new-tokens", type=int, default=64, help="decode: tokens per speculative generation")
    p.add_argument("--windows", type=int, default=4, help="decode: held-out windows (or prompts) per context")
    p.add_argument("--kv-text", default="generated", choices=["generated", "text"],
                   help="decode: the KV formats decode the model's own greedy continuations of held-out prompts, "
                        "or the held-out text itself")  # fmt: skip
    p.add_argument("--size", type=_size, default=(QUANTIZE["rows"], QUANTIZE["cols"]),
                   help=f"quantize: input ROWSxCOLS (default {QUANTIZE['rows']}x{QUANTIZE['cols']})")
    p.add_argument("--schemes", default=None,
                   help="quantize, gemm: comma-separated schemes (default: all for quantize; for gemm "
                        f"{', '.join(GEMM['schemes'])})")
    p.add_argument("--shape", type=_mnk, default=None,
                   help="gemm: MxNxK (default 4096x4096x4096 on CUDA, 1024x1024x1024 on CPU)")
    p.add_argument("--device", default=None, help="gemm: cpu or cuda[:i] (default: cuda when there is one); decode: where the model runs (default cpu)")
    p.add_argument("--recipes", default=None, help=f"train: comma-separated recipes (default: {','.join(TRAIN['recipes'])})")
    p.add_argument("--layers", type=int, default=TRAIN["layers"], help="train: MLP blocks")
    p.add_argument("--dim", type=int, default=TRAIN["dim"], help="train: model width")
    p.add_argument("--hidden", type=int, default=TRAIN["hidden"], help="train: hidden width")
    p.add_argument("--tokens", type=int, default=TRAIN["tokens"], help="train: tokens per step")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="gemm, train: time the BF16 baseline (default: gemm always; train when BF16 "
                        "matmuls are native here, as a short probe shows: without BF16 units a step "
                        "takes minutes)")
    p.add_argument("--reps", type=int, default=None, help=f"interleaved repetitions (default {QUANTIZE['reps']} quantize, {GEMM['reps']} gemm, {TRAIN['reps']} train)")
    p.add_argument("--default-allocator", action="store_true",
                   help="leave glibc's malloc as it is: large outputs are page-faulted in again on every call")
    g = p.add_argument_group("llamacpp: minifloat's GGUF files beside llama.cpp's own, measured by llama.cpp")
    g.add_argument("--llamacpp-python", default=None,
                   help="the Python of a venv with llama-cpp-python (default: $MINIFLOAT_LLAMACPP_PYTHON, else "
                        "~/.cache/minifloat/llamacpp-venv)")  # fmt: skip
    g.add_argument("--build-venv", action="store_true",
                   help="make ~/.cache/minifloat/llamacpp-venv first (pip compiles llama.cpp: about 15 min on 2 cores)")
    g.add_argument("--configs", default="mxfp4-weight-only,nvfp4-weight-only",
                   help="minifloat's configs to write, each CONFIG[:GLOB;GLOB][@BITS]: the layers it keeps in the "
                        "rest type, its bits per weight (see quantize --budget-bits)")
    g.add_argument("--methods", default="rtn,gptq", help="comma-separated: rtn, gptq")
    g.add_argument("--llama-types", default="F32,Q8_0,Q4_0,Q4_K_M,MXFP4",
                   help="llama.cpp's own files to make (F32 always: the reference)")
    g.add_argument("--gguf-rest", default="q8_0", help="minifloat's files: the type of the embedding / head")
    g.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    g.add_argument("--batch-size", type=int, default=4, help="held-out windows per batch")
    g.add_argument("--seq-len", type=int, default=256, help="tokens per window")
    g.add_argument("--eval-batches", type=int, default=4, help="held-out batches")
    g.add_argument("--calib-batches", type=int, default=8, help="GPTQ's calibration batches (training split)")
    g.add_argument("--out", default="runs/llamacpp", help="folder for the files and metrics.json")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.what == "decode":
        return _decode(args)
    if args.what == "llamacpp":
        return _llamacpp(args)
    reps = args.reps if args.reps is not None else {"quantize": QUANTIZE, "gemm": GEMM, "train": TRAIN}[args.what]["reps"]
    if reps < 1:
        raise MinifloatError(f"--reps must be ≥ 1, got {reps}")
    if args.what == "train":
        return _train(args, reps)
    if args.what == "gemm":
        return _gemm(args, reps)
    from minifloat.scaling.schemes import get_scheme

    schemes = QUANTIZE["schemes"] if not args.schemes else tuple(get_scheme(s).name for s in args.schemes.split(","))
    out = bench.bench_quantize(*args.size, schemes=schemes, reps=reps)
    if args.json:
        print(jsonio.dumps(out, indent=2))
        return 0
    lo, hi = out["read_bound_gelem_s_range"]
    print(f"input {out['shape'][0]}x{out['shape'][1]} float32, {out['threads']} threads, "
          f"median of {out['reps']}; read bound (sum) {out['read_bound_gelem_s']:.2f} Gelem/s "
          f"({lo:.2f}-{hi:.2f} over the rounds)")
    if out["torch_cast_gelem_s"] is not None:
        print(f"for context, torch's own cast x.to(torch.float8_e4m3fn) (no amax, no scale): "
              f"{out['torch_cast_gelem_s']:.2f} Gelem/s, {out['torch_cast_vs_read']:.2f} x read")
    print("allocator: " + ("freed buffers stay in the heap (minifloat.kernels.allocator)" if out["keeps_freed_memory"]
                           else "glibc default (outputs above 32 MiB are page-faulted in on every call)"))
    if not out["torchao"]:
        print("torchao is not installed: no comparison (pip install 'minifloat[bench]')")
    elif out["torchao_stock"]:
        print("torchao: in this process (with its allocator settings); stock: in a fresh process with "
              "torch's defaults (no huge pages, glibc malloc)")
    print("x read: the ratio to the read bound, and in brackets its quartiles over the rounds")
    print(f"{'scheme':18} {'quant Gelem/s':>13} {'x read':>17} {'dequant Gelem/s':>15} {'x read':>17} "
          f"{'torchao':>8} {'speedup':>8} {'stock':>7} {'speedup':>8}")
    for r in out["results"]:
        peer = [(_fmt(r[k], ".3f"), _fmt(r[s], ".1f", "x"))
                for k, s in (("torchao_gelem_s", "speedup_vs_torchao"), ("torchao_stock_gelem_s", "speedup_vs_torchao_stock"))]
        q, d = (f"{r[k]:.2f} [{r[k + '_iqr'][0]:.2f}-{r[k + '_iqr'][1]:.2f}]" for k in ("quantize_vs_read", "dequantize_vs_read"))
        print(f"{r['scheme']:18} {r['quantize_gelem_s']:13.2f} {q:>17} "
              f"{r['dequantize_gelem_s']:15.2f} {d:>17} "
              f"{peer[0][0]:>8} {peer[0][1]:>8} {peer[1][0]:>7} {peer[1][1]:>8}")
    return 0


def _train(args: argparse.Namespace, reps: int) -> int:
    from minifloat.recipes import get_recipe

    recipes = TRAIN["recipes"] if not args.recipes else tuple(args.recipes.split(","))
    for r in recipes:
        get_recipe(r)  # unknown names fail before minutes of timing
    baselines, note = bench.train_baselines(args.bf16)
    progress = None if args.json else (lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))
    out = bench.bench_train(recipes, layers=args.layers, dim=args.dim, hidden=args.hidden, tokens=args.tokens,
                      reps=reps, baselines=baselines, progress=progress)
    out["bf16_skipped"] = note
    if args.json:
        print(jsonio.dumps(out, indent=2))
        return 0
    if note:
        print(note)
    m = out["mlp"]
    print(f"{m['layers']} x ({m['dim']}->{m['hidden']}->{m['dim']}) MLP, {m['tokens']} tokens, "
          f"{out['threads']} threads, median of {out['reps']} (forward + backward + SGD step)")
    print(f"{'model':16} {'step s':>9} {'x bf16':>7} {'x fp32':>7} {'tokens/s':>10}")
    for r in out["results"]:
        vb = "-" if r["vs_bf16"] is None else f"{r['vs_bf16']:.2f}"
        vf = "-" if r["vs_fp32"] is None else f"{r['vs_fp32']:.2f}"
        print(f"{r['model']:16} {r['step_s']:9.3f} {vb:>7} {vf:>7} {r['tokens_per_s']:10.0f}")
    return 0


def _gemm(args: argparse.Namespace, reps: int) -> int:
    import torch

    from minifloat.scaling.schemes import get_scheme

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise MinifloatError(f"--device {args.device}: this torch sees no CUDA device; use --device cpu")
    shape = args.shape or ((4096, 4096, 4096) if device.type == "cuda" else (1024, 1024, 1024))
    schemes = GEMM["schemes"] if not args.schemes else tuple(get_scheme(s).name for s in args.schemes.split(","))
    out = bench.bench_gemm(*shape, schemes, device=device, reps=reps, bf16=args.bf16 is not False)
    if args.json:
        print(jsonio.dumps(out, indent=2))
        return 0
    m, n, k = out["shape"]
    bf16 = _fmt(out["bf16_tflops"], ".2f")
    print(f"a·bᵀ {m}x{k} · ({n}x{k})ᵀ on {out['device']} ({out['device_name']}), {out['threads']} threads, "
          f"median of {out['reps']}; FP32 {out['fp32_tflops']:.2f} TFLOP/s, BF16 {bf16} TFLOP/s")
    print(f"{'scheme':14} {'emulated TF/s':>13} {'x bf16 time':>11} {'native TF/s':>11} {'x bf16 time':>11} {'rel err':>9}")
    why: dict[str, list[str]] = {}
    for r in out["results"]:
        print(f"{r['scheme']:14} {r['emulated_tflops']:13.3f} {_fmt(r['emulated_vs_bf16'], '.2f'):>11} "
              f"{_fmt(r['native_tflops'], '.3f'):>11} {_fmt(r['native_vs_bf16'], '.2f'):>11} "
              f"{_fmt(r['native_rel_error'], '.1e'):>9}")
        if r["native_unavailable"]:
            why.setdefault(r["native_unavailable"], []).append(r["scheme"])
    for reason, names in why.items():
        print(f"no native GEMM for {', '.join(names)}: {reason}")
    if out["bf16_tflops"] is not None and not out["bf16_native"]:
        print("BF16 here is torch's emulation: this CPU has no BF16 units (no avx512_bf16 or amx_bf16 in "
              "`minifloat info`), so the x bf16 columns do not compare with a real BF16 GEMM")
    return 0


def _decode(args: argparse.Namespace) -> int:
    from minifloat.data.corpus import load_corpus, stdlib_corpus
    from minifloat.data.text import token_ids, tokenizer_for
    from minifloat.infer import load_model
    from minifloat.infer.ptq.config import get_quant_config
    from minifloat.measure import bench_decode as decode
    from minifloat.models.adapter import adapter_for

    if args.model is None:
        raise MinifloatError("bench decode needs a model: minifloat bench decode MODEL (a run folder, a transformers folder, a .gguf)")
    weights = list(_WEIGHTS) if args.weights is None else [w.strip() for w in args.weights.split(",") if w.strip()]
    for w in weights:  # a bad name fails before the model runs
        if w != "fp32":
            get_quant_config(w)
    from minifloat.infer.generation.decoding import DECODE_STEPS, check_draft

    steps = [s.strip() for s in args.decode_steps.split(",") if s.strip()]
    for s in steps:
        if s not in DECODE_STEPS:
            raise MinifloatError(f"--decode-steps {s!r}: use some of {', '.join(DECODE_STEPS)}")
    llama = None  # (the Python of llama-cpp-python's venv, the folder for its files): found before any work
    if args.llamacpp:
        from minifloat.measure import llamacpp

        if (args.device or "cpu") != "cpu":
            raise MinifloatError("--llamacpp compares CPU decoding: leave --device out (or cpu)")
        if not str(args.model).endswith(".gguf"):
            raise MinifloatError(f"--llamacpp makes llama.cpp's files from a .gguf model; {args.model} is not one")
        python = llamacpp.build_venv(progress=print) if args.build_venv else llamacpp.llamacpp_python(args.llamacpp_python)
        llama = (python, args.out)
    try:
        gemvs = [_gemv_shape(s.strip()) for s in args.gemv.split(",") if s.strip()]
    except argparse.ArgumentTypeError as err:
        raise MinifloatError(f"--gemv: {err}") from None
    counts = sorted(set(_counts(args.verify_rows, "--verify-rows")) | {1})
    contexts = _counts(args.contexts, "--contexts")
    ks = _counts(args.draft_tokens, "--draft-tokens")
    import torch

    device = torch.device(args.device or "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise MinifloatError(f"--device {args.device}: this torch sees no CUDA device; use --device cpu")
    model = load_model(args.model).to(device)
    context = adapter_for(model).context_length
    formats = decode.DEFAULT_FORMATS if args.kv_formats is None else tuple(f.strip() for f in args.kv_formats.split(",") if f.strip())
    from minifloat.infer.generation.kvcache import parse_kv_spec

    for f in formats:  # a bad name fails before the model runs
        parse_kv_spec(f)
    bad = [c for c in contexts if not 17 < c <= context]
    if bad:
        raise MinifloatError(f"--contexts {bad[0]}: each must be in (17, {context}] (the model's context)")
    drafts = [d.strip() for d in args.drafts.split(",") if d.strip()]
    for d in drafts:  # a bad name fails before the model runs
        check_draft(d)
    corpus = stdlib_corpus() if args.data is None else load_corpus(args.data)
    text = token_ids(bytes(corpus.val.numpy()), tokenizer_for(args.model))
    echo = (lambda s: None) if args.json else print
    out = {}
    prompts = [text[s : s + 16].reshape(1, -1).to(device) for s in range(0, len(text) - 16, max((len(text) - 16) // args.windows, 1))][: args.windows]
    verify = None
    if args.verify_rows.strip():
        if 16 + counts[-1] > context:
            raise MinifloatError(f"--verify-rows {counts[-1]}: a 16-token prompt and {counts[-1]} rows pass the model's context of {context}")
        verify = (text[16 : 16 + counts[-1]].reshape(1, -1).to(device), counts)
    if weights:
        new = min(args.new_tokens, context - 16)
        echo(f"greedy decoding per weight format, {len(prompts)} prompts × {new} tokens, "
             f"{'head quantized too' if args.quantize_head else 'head in float'}, FP32 KV cache:")  # fmt: skip
        out["weights"] = decode.weight_speed(args.model, prompts, weights, new_tokens=new, quantize_head=args.quantize_head,
                                             device=device, decode_steps=steps, repeats=args.reps or 3, llamacpp=llama,
                                             threads=args.threads if args.llamacpp else None, verify=verify, echo=echo)  # fmt: skip
    if args.profile:
        from minifloat.infer import quantize_model

        echo(f"where a decode step's time goes (ms per token; {torch.get_num_threads()} threads, FP32 KV cache, "
             f"32 steps after a {prompts[0].shape[1]}-token prompt):")  # fmt: skip
        echo(f"  {'config':<20} {'step':<6} {'ms/token':>8} {'unprofiled':>10} {'gemv':>13} {'attention':>13} "
             f"{'norms/rope/act':>14} {'python/dispatch':>15}")  # fmt: skip
        out["profile"] = []
        for w in weights:
            m = load_model(args.model).to(device)
            if w != "fp32":
                quantize_model(m, w, quantize_head=args.quantize_head)
            for s in steps:
                r = decode.profile_decode(m, prompts[0], decode_step=s) | {"config": w, "asked": s}
                out["profile"].append(r)
                cells = " ".join(f"{r['ms'][k]:7.2f} {100 * r['share'][k]:4.0f}%" for k in r["ms"])
                echo(f"  {w:<20} {r['decode_step']:<6} {r['ms_per_token']:8.2f} {r['unprofiled_ms_per_token']:10.2f} {cells}")
            del m
    if gemvs and device.type == "cpu":  # the decode kernels and torch's int4 / int8 peers are CPU kernels
        out["gemv"] = decode.gemv_peers(gemvs, echo=echo)
    if formats:
        echo(f"KV-cache formats against an FP32 cache, teacher-forced over {args.windows} windows per context "
             f"({'greedy continuations of held-out prompts' if args.kv_text == 'generated' else 'held-out text'}):")
        out["kv"] = decode.kv_quality(model, text, formats, contexts, windows=args.windows, source=args.kv_text, echo=echo)
    if drafts and ks:
        new = min(args.new_tokens, context - 16)
        echo(f"speculative greedy decoding, {len(prompts)} prompts × {new} tokens, each right after plain greedy decoding of the same prompt:")
        calibration = None
        if any(d.endswith("-gptq") for d in drafts):
            from minifloat.data.text import TextSource, batches_for

            source = TextSource(data=args.data, batch_size=4, calib_batches=args.draft_calib_batches)
            calibration = batches_for(model, source, "train", tokenizer_for(args.model))
        out["speculative"] = decode.speculative(model, prompts, drafts, ks, new_tokens=new, calibration=calibration, echo=echo)
    if args.json:
        print(jsonio.dumps(out, indent=2))
    return 0


def _llamacpp(args: argparse.Namespace) -> int:
    from minifloat.data.text import TextSource
    from minifloat.measure import llamacpp

    if args.model is None:
        raise MinifloatError("bench llamacpp takes a model: minifloat bench llamacpp MODEL.gguf (or a transformers folder)")
    for name in ("threads", "batch_size", "seq_len", "eval_batches", "calib_batches", "new_tokens"):
        if getattr(args, name) < 1:
            raise MinifloatError(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    def say(msg: str) -> None:
        print(f"  {msg}", file=sys.stderr, flush=True)

    python = llamacpp.build_venv(progress=say) if args.build_venv else llamacpp.llamacpp_python(args.llamacpp_python)
    source = TextSource(data=args.data, batch_size=args.batch_size, seq_len=args.seq_len, eval_batches=args.eval_batches,
                        calib_batches=args.calib_batches)  # fmt: skip
    def split(text: str) -> list[str]:
        return [v.strip() for v in text.split(",") if v.strip()]

    out = llamacpp.bench_llamacpp(args.model, python=python, source=source, out=args.out, configs=split(args.configs),
                                  methods=split(args.methods), llama_types=split(args.llama_types), rest=args.gguf_rest,
                                  threads=args.threads, new_tokens=args.new_tokens, repeats=args.reps or 3,
                                  progress=say)  # fmt: skip
    if args.json:
        print(jsonio.dumps(out, indent=2))
        return 0
    print(f"{out['model']}: {out['windows'][0]} held-out windows of {out['windows'][1] - 1} tokens ({out['text']}); "
          f"llama.cpp with {out['threads']} threads, greedy {out['new_tokens']} tokens, best of {out['repeats']} "
          f"interleaved; minifloat's own F32 perplexity {out['minifloat_f32_ppl']:.4f}")  # fmt: skip
    print(f"{'file':56} {'bits/w':>6} {'ppl':>9} {'Δppl':>8} {'tok/s':>6} {'×Q4_0':>6} {'minifloat ppl':>13} "
          f"{'its Δppl':>8} {'llama.cpp vs it':>15} {'vs it, Q8_0 inputs':>18}")  # fmt: skip
    for r in out["rows"]:
        mine = (f"{r['minifloat_ppl']:13.4f} {r['minifloat_delta_ppl_pct']:+7.2f}% {r['llamacpp_vs_minifloat_pct']:+14.2f}% "
                f"{r['llamacpp_vs_minifloat_q8_0_inputs_pct']:+17.2f}%" if "minifloat_ppl" in r else "")  # fmt: skip
        print(f"{r['file']:56} {r['bits_per_weight']:6.2f} {r['ppl']:9.4f} {cell(r['delta_ppl_pct'], '+7.2f', suffix='%')} "
              f"{r['tokens_per_s']:6.0f} {cell(r['speed_vs_q4_0'], '6.2f')} {mine}")  # fmt: skip
    print("llama.cpp vs it: llama.cpp's perplexity of minifloat's file against minifloat's own; Q8_0 inputs: against "
          "minifloat's with every quantized layer's input rounded to Q8_0, as ggml's CPU dot products round it")
    print(f"files and metrics.json: {args.out}")
    return 0
