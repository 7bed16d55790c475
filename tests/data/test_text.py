"""Evaluation and calibration text by the tokenizer's conventions (BOS, EOS between documents,
chat-rendered conversations), and evaluation memory that does not grow with the batches."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from minifloat.data.text import TextSource, batches_for, text_conventions
from minifloat.infer.evaluation.pipeline import evaluate_paths
from minifloat.models.loading import load_model
from tests.finetune.tiny import byte_tokenizer, tiny_model

DOCS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (8 + i) for i in range(30)]


def _folder(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    for i, text in enumerate(DOCS):
        (d / f"{i:02d}.txt").write_text(text)
    return d


def _stream(tok, docs):
    """The oracle: each document's ids without special tokens, then EOS (the tokenizer itself, not our code)."""
    out = []
    for doc in docs:
        out += tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return out


def _is_slice(window: list[int], stream: list[int]) -> bool:
    n = len(window)
    return any(stream[i : i + n] == window for i in range(len(stream) - n + 1))


@pytest.mark.parametrize("bos", [True, False])
def test_windows_follow_the_tokenizer(tmp_path, bos):
    tok = byte_tokenizer(bos=bos)
    model = load_model(tiny_model(tmp_path / "m", "llama" if bos else "qwen2"))
    source = TextSource(data=str(_folder(tmp_path)), batch_size=2, seq_len=48, eval_batches=3, calib_batches=2)
    raw = b"".join(d.encode() for d in DOCS)
    cut = len(raw) - max(int(len(raw) * 0.1), 1)  # the held-out tenth of the bytes, cut into its documents
    ends = [sum(len(d) for d in DOCS[: i + 1]) for i in range(len(DOCS))]
    first = next(i for i, e in enumerate(ends) if e > cut)
    val_docs = [raw[cut : ends[first]].decode()] + DOCS[first + 1 :]
    stream = _stream(tok, val_docs)
    batches = batches_for(model, source, "val", tok)
    assert len(batches) == 3 and all(b.shape == (2, 49) for b in batches)
    for row in torch.cat(batches).tolist():
        if bos:
            assert row[0] == tok.bos_token_id and _is_slice(row[1:], stream)
        else:
            assert row[0] != tok.bos_token_id and _is_slice(row, stream)
    assert any(tok.eos_token_id in row for row in torch.cat(batches).tolist())  # documents end inside windows
    words = text_conventions(source, tok)
    assert ("starts with BOS '<s>'" in words) == bos and "EOS '</s>'" in words
    calib = batches_for(model, source, "train", tok)
    assert all((b[:, 0] == tok.bos_token_id).all() == bos for b in calib)


def test_reference_perplexity_matches_a_transformers_loop(tmp_path):
    """eval's reference perplexity against transformers' own loss on BOS-led windows (labels shifted by the model)."""
    import transformers

    folder = tiny_model(tmp_path / "m", "llama")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    source = TextSource(data=str(_folder(tmp_path)), batch_size=2, seq_len=40, eval_batches=2)
    m = evaluate_paths(folder, scheme="fp8-weight-only", source=source)
    val = _stream(tok, [d.encode().decode() for d in DOCS])  # a loose check of the content: BOS first, then text
    assert len(val) > 40
    losses = []
    for b in batches_for(load_model(folder), source, "val", tok):
        with torch.no_grad():
            losses.append(hf(input_ids=b, labels=b).loss.item())  # mean over the T next tokens of each window
    assert m["ppl_ref"] == pytest.approx(float(torch.tensor(losses).mean().exp()), rel=1e-4)
    assert "BOS" in m["text"]


def test_chat_records_are_rendered_with_the_template(tmp_path):
    tok = byte_tokenizer(bos=True)
    model = load_model(tiny_model(tmp_path / "m", "llama"))
    path = tmp_path / "chat.jsonl"
    records = [{"messages": [{"role": "user", "content": f"question {i} " * 3},
                             {"role": "assistant", "content": f"answer {i} " * 4}]} for i in range(40)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    source = TextSource(data=str(path), batch_size=2, seq_len=32, eval_batches=2)
    held = records[-4:]  # the last tenth of the records
    stream = [t for r in held for t in tok.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"]]
    batches = batches_for(model, source, "val", tok)
    assert all(_is_slice(row, stream) for row in torch.cat(batches).tolist())
    assert "chat template" in text_conventions(source, tok)


def test_evaluation_memory_does_not_grow_with_batches(tmp_path):
    """Peak RSS of `evaluate` on a 64k vocabulary: 8 batches against 1 (holding every batch's logits
    of both models, as before, costs ~1 GB more)."""
    script = textwrap.dedent("""
        import resource, sys, torch, transformers
        from minifloat.infer.evaluation.metrics import evaluate
        n = int(sys.argv[1])
        cfg = transformers.LlamaConfig(vocab_size=65536, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
        torch.manual_seed(0)
        model, ref = transformers.LlamaForCausalLM(cfg), transformers.LlamaForCausalLM(cfg)
        batches = [torch.randint(0, 65536, (4, 65)) for _ in range(n)]
        evaluate(model, ref, batches[:1])  # warm: the allocator's first arenas
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        evaluate(model, ref, batches)
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
    """)
    grown = {n: int(subprocess.run([sys.executable, "-c", script, str(n)], capture_output=True, text=True, check=True,
                                   cwd=tmp_path).stdout.split()[-1]) for n in (1, 8)}  # fmt: skip
    assert grown[8] - grown[1] < 150 * 2**20, grown
