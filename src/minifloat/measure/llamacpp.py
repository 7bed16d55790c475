"""`minifloat bench llamacpp`: minifloat's GGUF files beside llama.cpp's own, every number measured
by llama.cpp itself in one run (`llamacpp_peer.py`, run by llama-cpp-python's own venv).

From a GGUF model it makes llama.cpp's files with llama.cpp's own tools — F32 (the source
dequantized by ``llama_model_quantize``), then Q8_0 / Q4_0 / Q4_K_M from F32 by the same tool (it
refuses NVFP4 as an output type: "invalid output file type 39"), and MXFP4 (every layer's weight in MXFP4 blocks, the embedding Q8_0) by llama.cpp's
``gguf`` package, whose MXFP4 quantizer is ggml's reference one (its ``MXFP4_MOE`` file type puts
MXFP4 on experts only, so a dense model would get none) — and minifloat's files
(`minifloat.infer.evaluation.pipeline.quantize_checkpoint` with ``format="gguf"``, each config by
each method). For every file: bits per weight as llama.cpp's files count them (file bytes × 8 /
parameters), llama.cpp's perplexity on the same held-out windows minifloat evaluates on (Δ against
llama.cpp's F32 file), llama.cpp's greedy decode tokens/s (best of the repeats, the files
interleaved round by round), and for minifloat's files minifloat's own perplexity of the file read
back (Δ against minifloat's evaluation of the F32 model). A config may name layers kept in high
precision (``nvfp4-weight-only:*.down_proj``: written in the rest type, as `quantize --keep` does)
and a budget of bits per weight (``nvfp4-weight-only@6.1``: the layers kept chosen as `quantize
--budget-bits` chooses them, `minifloat.adapt.keep`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from minifloat.errors import MinifloatError
from minifloat.io import jsonio
from minifloat.io.atomic import atomic_path

PEER = Path(__file__).with_name("llamacpp_peer.py")
VENV = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "minifloat" / "llamacpp-venv"
LLAMA_FTYPES = {"F32": 0, "Q8_0": 7, "Q4_0": 2, "Q4_K_M": 15}  # llama_ftype numbers
LLAMA_TYPES = ("F32", "Q8_0", "Q4_0", "Q4_K_M", "MXFP4")  # llama.cpp 0.3.36's quantizer makes no NVFP4 file
BUILD_NOTE = "pip compiles llama.cpp from source: about 15 minutes on 2 cores"


def llamacpp_python(explicit: str | None = None) -> str:
    """The Python of a venv with llama-cpp-python: `explicit`, else $MINIFLOAT_LLAMACPP_PYTHON,
    else `VENV`'s; an error saying how to make one when none imports llama_cpp."""
    tried = [
        p for p in (explicit, os.environ.get("MINIFLOAT_LLAMACPP_PYTHON"), str(VENV / "bin" / "python")) if p
    ]
    for python in tried if explicit is None else tried[:1]:
        if Path(python).is_file() and _imports_llama_cpp(python):
            return python
    raise MinifloatError(f"no llama-cpp-python found (tried {', '.join(tried)}): make its venv with "
                         f"`minifloat bench llamacpp MODEL --build-venv` ({BUILD_NOTE}), or pass --llamacpp-python "
                         f"the Python of a venv that has it")  # fmt: skip


def _imports_llama_cpp(python: str) -> bool:
    try:
        r = subprocess.run([python, "-c", "import llama_cpp, numpy"], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def build_venv(folder: Path = VENV, progress: Callable[[str], None] | None = None) -> str:
    """Make `folder` a venv with llama-cpp-python and numpy (compiled by pip); its Python."""
    say = progress or (lambda msg: None)
    python = folder / "bin" / "python"
    if not python.is_file():
        say(f"creating the venv {folder}")
        subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    say(f"pip install llama-cpp-python numpy ({BUILD_NOTE})")
    t0 = time.perf_counter()
    r = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "llama-cpp-python", "numpy"])
    if r.returncode != 0:
        raise MinifloatError(f"pip could not install llama-cpp-python into {folder} (exit {r.returncode}); it needs a "
                             f"C++ compiler and cmake")  # fmt: skip
    say(f"built in {time.perf_counter() - t0:.0f} s")
    return str(python)


def peer(python: str, *args: str) -> dict:
    """One run of `llamacpp_peer.py` with the venv's Python; its JSON line."""
    r = subprocess.run([python, str(PEER), *args], capture_output=True, text=True)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise MinifloatError(f"llama.cpp ({' '.join(args[:2])}) failed: {' | '.join(tail)}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def llamacpp_files(model, folder, python: str, types: Sequence[str], threads: int = 2,
                   progress: Callable[[str], None] | None = None) -> dict[str, str]:  # fmt: skip
    """llama.cpp's own files of `model` in `folder` (F32 from the source — by ``llama_model_quantize``
    from a GGUF, by minifloat's GGUF writer from a transformers folder, as llama.cpp's converter
    would lay it out —, the others from F32 by ``llama_model_quantize``), one per llama.cpp type in
    `types` (`LLAMA_FTYPES`)."""
    from minifloat.infer.checkpoints import gguf_folder

    model, folder = Path(model), Path(folder)
    if model.suffix != ".gguf" and not gguf_folder.is_folder(model):
        raise MinifloatError(f"{model}: llama.cpp's files are made from a .gguf model or a transformers folder; pass one")
    bad = [t for t in types if t not in LLAMA_FTYPES]
    if bad:
        raise MinifloatError(f"llama.cpp type {bad[0]!r}: use some of {', '.join(LLAMA_FTYPES)}")
    folder.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda msg: None)
    f32 = folder / "llamacpp-F32.gguf"
    if model.suffix == ".gguf":
        say("  llama.cpp: F32 from the source (llama_model_quantize)")
        peer(python, "quantize", str(model), str(f32), str(LLAMA_FTYPES["F32"]), "--threads", str(threads))
    else:
        from minifloat.infer.checkpoints import gguf_file
        from minifloat.infer.checkpoints.loaders import load_model

        say("  F32 GGUF from the transformers folder (minifloat's writer)")
        gguf_file.write(load_model(model), f32, source=model, rest="f32", overwrite=True, dense=True)
    out = {}
    for t in types:
        path = folder / f"llamacpp-{t}.gguf"
        if t != "F32":
            say(f"  llama.cpp: {t} (llama_model_quantize)")
            peer(python, "quantize", str(f32), str(path), str(LLAMA_FTYPES[t]), "--threads", str(threads))
        out[t] = str(path)
    return out


def llamacpp_mxfp4(f32: Path, out: Path) -> Path:
    """llama.cpp's MXFP4 of a dense model: every 2-D weight of the blocks in MXFP4 by ``gguf``'s
    quantizer (ggml's reference algorithm: E8M0 = ⌊log2 amax⌋ − 2, nearest E2M1), the embedding
    and head Q8_0, the rest as the F32 file has it; metadata as it was."""
    import gguf

    from minifloat.infer.checkpoints.gguf_file import copy_metadata

    reader = gguf.GGUFReader(f32)
    w = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    copy_metadata(reader, w)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.tensor_type.name == "F32" and data.ndim == 2:
            qtype = (
                gguf.GGMLQuantizationType.MXFP4
                if t.name.startswith("blk.")
                else gguf.GGMLQuantizationType.Q8_0
            )
            if data.shape[-1] % 32 == 0:
                w.add_tensor(t.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
                continue
        w.add_tensor(t.name, data, raw_dtype=t.tensor_type if t.tensor_type.name != "F32" else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def q8_0_inputs(x: torch.Tensor) -> torch.Tensor:
    """`x` rounded as ggml's CPU dot products round activations against a quantized weight (Q8_0:
    per 32 values d = amax / 127, codes round(x / d), the value code · FP16(d)); what llama.cpp
    computes that minifloat's evaluation of the same file does not."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    codes = torch.where(d > 0, torch.round(blocks / torch.where(d > 0, d, 1.0)), 0.0)
    return (codes * d.half().float()).reshape(x.shape).to(x.dtype)


def with_q8_0_inputs(model: torch.nn.Module, dense_too: bool) -> list:
    """Hooks rounding the input of every quantized Linear (and of every dense one: `dense_too`, for
    a Q8_0 rest) to Q8_0, as llama.cpp does; the hook handles, to remove."""
    from minifloat.infer.modules.linear import QuantizedLinear

    kinds = (QuantizedLinear, torch.nn.Linear) if dense_too else (QuantizedLinear,)
    return [m.register_forward_pre_hook(lambda _, args: (q8_0_inputs(args[0]), *args[1:]))
            for m in model.modules() if isinstance(m, kinds) and m.in_features % 32 == 0]  # fmt: skip


def _spec(config: str) -> tuple[str, tuple[str, ...], float | None]:
    """``CONFIG[:GLOB;GLOB][@BITS]``: the config, the layers it keeps, its budget of bits per weight."""
    head, _, budget = config.partition("@")
    name, _, globs = head.partition(":")
    try:
        bits = float(budget) if budget else None
    except ValueError:
        raise MinifloatError(f"--configs {config!r}: the budget after @ is bits per weight, e.g. {name}@6.1") from None
    return name, tuple(g for g in globs.split(";") if g), bits


def bench_llamacpp(
    model: str | os.PathLike[str],
    *,
    python: str,
    source,
    out: str | os.PathLike[str],
    configs: Sequence[str] = (
        "mxfp4-weight-only",
        "nvfp4-weight-only",
    ),  # each CONFIG[:GLOB;GLOB][@BITS] (layers kept, a budget)
    methods: Sequence[str] = ("rtn", "gptq"),
    llama_types: Sequence[str] = LLAMA_TYPES,
    rest: str = "q8_0",
    threads: int = 2,
    new_tokens: int = 64,
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """The table `minifloat bench llamacpp` prints (see the module docstring), as a dict."""
    from minifloat.adapt.keep import gguf_keep
    from minifloat.data.text import batches_for, tokenizer_for
    from minifloat.infer.checkpoints import gguf_file
    from minifloat.infer.checkpoints.loaders import load_model
    from minifloat.infer.evaluation.metrics import evaluate
    from minifloat.infer.evaluation.pipeline import quantize_checkpoint
    from minifloat.infer.ptq.config import get_quant_config

    say = progress or (lambda msg: None)
    model, out = Path(model), Path(out)
    for t in llama_types:
        if t not in (*LLAMA_FTYPES, "MXFP4"):
            raise MinifloatError(f"llama.cpp type {t!r}: use some of {', '.join((*LLAMA_FTYPES, 'MXFP4'))}")
    specs = [_spec(c) for c in configs]
    for c, _, _ in specs:
        gguf_file.check_request(model, get_quant_config(c), rest)
    for m in methods:
        if m not in ("rtn", "gptq"):
            raise MinifloatError(f"method {m!r}: use rtn, gptq")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer_for(model)
    ref = load_model(model)
    windows = torch.cat(batches_for(ref, source, "val", tokenizer)).numpy().astype(np.int64)
    np.save(out / "windows.npy", windows)
    batches = list(torch.from_numpy(windows).split(source.batch_size))
    ref_eval = evaluate(ref, None, batches)
    del ref
    prompt = ",".join(str(int(x)) for x in windows[0, :32])

    files: dict[str, dict] = {}
    made = llamacpp_files(model, out, python, [t for t in llama_types if t in LLAMA_FTYPES], threads=threads, progress=say)
    f32 = out / "llamacpp-F32.gguf"  # made always: the reference, and MXFP4's source
    for t in llama_types:
        path = Path(made.get(t, out / f"llamacpp-{t}.gguf"))
        if t == "MXFP4":
            say("llama.cpp: MXFP4 (gguf's quantizer)")
            llamacpp_mxfp4(f32, path)
        files[f"llama.cpp {t}"] = {"path": path, "by": "llama.cpp"}
    params = gguf_file.tensor_bits(f32)[1]  # the F32 file's values: the parameters, as llama.cpp counts them
    for c, keep, budget in specs:
        kept = keep
        if budget is not None:
            say(f"minifloat: {c}, the layers to keep within {budget:g} bits per weight")
            plan = gguf_keep(model, c, source, budget, rest=rest, ignore=("lm_head", *keep))
            say(str(plan))
            kept = (*keep, *plan.keep)
        for m in methods:
            label = f"{c} {m}" + (f" keep {';'.join(keep)}" if keep else "") + (f" @{budget:g} bits" if budget else "")
            path = out / (f"minifloat-{c}-{m}{'-keep' + str(len(keep)) if keep else ''}"
                          f"{'-at' + format(budget, 'g') if budget else ''}.gguf")  # fmt: skip
            say(f"minifloat: {label}")
            quantize_checkpoint(model, c, path, format="gguf", source=source, overwrite=True, method=m, gguf_rest=rest,
                                ignore=("lm_head", *kept))  # fmt: skip
            back = load_model(path)
            mine = evaluate(back, None, batches)
            with_q8_0_inputs(back, dense_too=rest == "q8_0")
            q8 = evaluate(back, None, batches)
            files[f"minifloat {label}"] = {"path": path, "by": "minifloat", "minifloat_ppl": mine["ppl"],
                                           "minifloat_q8_0_inputs_ppl": q8["ppl"]}  # fmt: skip
    for name, f in files.items():
        say(f"llama.cpp perplexity: {name}")
        r = peer(
            python, "ppl", str(f["path"]), "--windows", str(out / "windows.npy"), "--threads", str(threads)
        )
        f["ppl"], f["bits_per_weight"] = r["ppl"], f["path"].stat().st_size * 8 / params
    best: dict[str, float] = {}
    for rnd in range(repeats):  # interleaved: every file once per round
        for name, f in files.items():
            say(f"decode round {rnd + 1}/{repeats}: {name}")
            r = peer(python, "decode", str(f["path"]), "--prompt", prompt, "--tokens", str(new_tokens), "--repeats", "1",
                     "--threads", str(threads))  # fmt: skip
            best[name] = max(best.get(name, 0.0), r["tokens_per_s"])
    base = files["llama.cpp F32"]["ppl"] if "llama.cpp F32" in files else None
    q4 = best.get("llama.cpp Q4_0")
    rows = []
    for name, f in files.items():
        row = {"file": name, "bits_per_weight": f["bits_per_weight"], "ppl": f["ppl"], "tokens_per_s": best[name],
               "path": str(f["path"])}  # fmt: skip
        row["delta_ppl_pct"] = None if base is None else 100 * (f["ppl"] / base - 1)
        row["speed_vs_q4_0"] = None if q4 is None else best[name] / q4
        if f["by"] == "minifloat":
            row["minifloat_ppl"] = f["minifloat_ppl"]
            row["minifloat_delta_ppl_pct"] = 100 * (f["minifloat_ppl"] / ref_eval["ppl"] - 1)
            row["llamacpp_vs_minifloat_pct"] = 100 * (f["ppl"] / f["minifloat_ppl"] - 1)
            row["minifloat_q8_0_inputs_ppl"] = f["minifloat_q8_0_inputs_ppl"]  # llama.cpp's activation rounding
            row["llamacpp_vs_minifloat_q8_0_inputs_pct"] = 100 * (f["ppl"] / f["minifloat_q8_0_inputs_ppl"] - 1)
        rows.append(row)
    result = {"model": str(model), "text": str(source.data or "the Python stdlib sources"),
              "windows": list(windows.shape), "threads": threads, "new_tokens": new_tokens, "repeats": repeats,
              "parameters": params, "minifloat_f32_ppl": ref_eval["ppl"], "rest": rest, "rows": rows}  # fmt: skip
    with atomic_path(out / "metrics.json") as tmp:
        tmp.write_text(jsonio.dumps(result, indent=2) + "\n")
    return result
