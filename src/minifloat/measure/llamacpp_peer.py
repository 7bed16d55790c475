"""llama.cpp as users run it — through llama-cpp-python in *its own* venv, never imported by
minifloat: `minifloat bench llamacpp` runs this file as a script with that venv's Python.

    PYTHON llamacpp_peer.py quantize SRC DST FTYPE [--threads N]
    PYTHON llamacpp_peer.py ppl FILE --windows windows.npy [--threads N]
    PYTHON llamacpp_peer.py decode FILE --prompt 1,2,3[;4,5,6…] [--tokens 64] [--repeats 3] [--threads N]
    PYTHON llamacpp_peer.py rows FILE --prompt 1,2,3 --next 4,5,6… --rows 1,2,4 [--repeats 3] [--threads N]

``quantize``: llama.cpp's own quantizer (``llama_model_quantize``, requantizing allowed) to the
llama_ftype number FTYPE. ``ppl``: the windows of ``windows.npy`` (rows of T + 1 token ids), each
evaluated from an empty context, every next token scored (llama.cpp's logits, a float64 log-softmax
here). ``decode``: greedy decoding of ``--tokens`` tokens after each prompt (``;`` between prompts), the
decode steps timed (the prompts' evaluation not), the best of ``--repeats`` passes over all prompts.
``rows``: after the prompt, the first M tokens of ``--next`` in one batch with every row's logits (a
speculative verification of M − 1 drafted tokens), the cache cut back to the prompt before each; the
best seconds of ``--repeats`` per M. Each prints one JSON line. This file imports nothing from
minifloat.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time


def _llama(path: str, n_ctx: int, threads: int, logits_all: bool):
    import llama_cpp

    return llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=logits_all,
                           n_threads=threads, n_threads_batch=threads, verbose=False)  # fmt: skip


def quantize(a) -> dict:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = a.ftype
    params.allow_requantize = True
    params.nthread = a.threads
    t0 = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(a.src.encode(), a.dst.encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize {a.src} -> {a.dst} (ftype {a.ftype}) returned {rc}")
    return {"file": a.dst, "seconds": time.perf_counter() - t0}


def ppl(a) -> dict:
    import numpy as np

    windows = np.load(a.windows)
    t = windows.shape[1] - 1
    llm = _llama(a.file, t, a.threads, logits_all=True)
    nll, count = 0.0, 0
    for row in windows:
        llm.reset()
        llm.eval([int(x) for x in row[:-1]])
        logits = np.asarray(llm.scores[:t], dtype=np.float64)
        logits -= logits.max(axis=-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        nll -= float(logp[np.arange(t), row[1:]].sum())
        count += t
    return {"nll": nll, "tokens": count, "ppl": float(np.exp(nll / count))}


def decode(a) -> dict:
    import numpy as np

    prompts = [[int(x) for x in p.split(",")] for p in a.prompt.split(";")]
    llm = _llama(a.file, max(map(len, prompts)) + a.tokens + 8, a.threads, logits_all=False)
    best, tokens = float("inf"), []
    for _ in range(a.repeats):
        seconds, outs = 0.0, []
        for prompt in prompts:
            llm.reset()
            llm.eval(prompt)
            out = []
            t0 = time.perf_counter()
            for _ in range(a.tokens):
                tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
                out.append(tok)
                llm.eval([tok])
            seconds += time.perf_counter() - t0
            outs.append(out)
        best, tokens = min(best, seconds), outs
    return {"tokens_per_s": a.tokens * len(prompts) / best, "tokens": tokens}


def rows(a) -> dict:
    prompt, following = ([int(x) for x in s.split(",")] for s in (a.prompt, a.next))
    counts = [int(m) for m in a.rows.split(",")]
    llm = _llama(a.file, len(prompt) + max(counts) + 8, a.threads, logits_all=True)
    llm.eval(prompt)
    start, best = llm.n_tokens, {}
    for _ in range(a.repeats):
        for m in counts:
            llm.n_tokens = start  # eval drops the cache's positions from n_tokens on first
            t0 = time.perf_counter()
            llm.eval(following[:m])
            best[m] = min(best.get(m, float("inf")), time.perf_counter() - t0)
    return {"seconds": {str(m): s for m, s in best.items()}}


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("quantize")
    q.add_argument("src")
    q.add_argument("dst")
    q.add_argument("ftype", type=int)
    e = sub.add_parser("ppl")
    e.add_argument("file")
    e.add_argument("--windows", required=True)
    d = sub.add_parser("decode")
    d.add_argument("file")
    d.add_argument("--prompt", required=True)
    d.add_argument("--tokens", type=int, default=64)
    d.add_argument("--repeats", type=int, default=3)
    r = sub.add_parser("rows")
    r.add_argument("file")
    r.add_argument("--prompt", required=True)
    r.add_argument("--next", required=True)
    r.add_argument("--rows", required=True)
    r.add_argument("--repeats", type=int, default=3)
    for s in (q, e, d, r):
        s.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    print(json.dumps({"quantize": quantize, "ppl": ppl, "decode": decode, "rows": rows}[a.cmd](a)))


if __name__ == "__main__":
    main()
