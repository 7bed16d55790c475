"""A GGUF written from a transformers folder (not from a source GGUF): the metadata and tokenizer
llama.cpp's converter would write, made from the folder. Oracles: the folder's own tokenizer
(its ids, merges, special tokens, chat template), transformers' GGUF reader (the file read as the
model quantized in memory, so every name, head count and Q / K order is placed right), and
llama.cpp where it is installed (it tokenizes text as the folder's tokenizer does: the
pre-tokenizer named right; its logits are the FP4 model's)."""

import json

import pytest
import torch

import minifloat
from minifloat.cli import main
from minifloat.infer import load_model
from minifloat.infer.checkpoints import gguf_file
from tests.families.tiny import gguf_config, random_weights
from tests.finetune.tiny import TEMPLATE
from tests.gguf_writer import llama_cpp_logits

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXT = ("The quick brown fox can't jump over 12345 lazy dogs; they'll re-run it in 2026.\n\n"
        "    def f(x):\n        return x ** 2  # squares\nÜber naïve café — ok?!  Yes: 3.14159, 42, 7.\n")  # fmt: skip
# The pre-tokenizers of real byte-level BPE tokenizers, as their tokenizer.json spells them
# (Llama 3's and Qwen 2's Split expressions; SmolLM's digits first; GPT-2's ByteLevel alone).
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
          r"\s+(?!\S)|\s+")  # fmt: skip
QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
CASES = [("llama", "smollm"), ("llama", "llama-bpe"), ("qwen2", "qwen2"), ("qwen3", "qwen2"), ("gpt2", "gpt-2")]


def _pre_tokenizer(style: str):
    pt = tokenizers.pre_tokenizers
    if style == "gpt-2":
        return pt.ByteLevel(add_prefix_space=False)
    if style == "smollm":
        return pt.Sequence([pt.Digits(individual_digits=True), pt.ByteLevel(add_prefix_space=False)])
    regex = {"llama-bpe": LLAMA3, "qwen2": QWEN2}[style]
    return pt.Sequence([pt.Split(tokenizers.Regex(regex), behavior="isolated"),
                        pt.ByteLevel(add_prefix_space=False, use_regex=False)])  # fmt: skip


def bpe_tokenizer(style: str):
    """A byte-level BPE with real merges (trained on `TEXT`), the `style` pre-tokenizer, ChatML's
    special tokens and a chat template."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = _pre_tokenizer(style)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=330, special_tokens=SPECIAL, show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator([TEXT] * 4, trainer)
    if style == "llama-bpe":  # Llama 3 puts BOS in front of every text
        tok.post_processor = tokenizers.processors.TemplateProcessing(single=f"{SPECIAL[0]} $A",
                                                                      special_tokens=[(SPECIAL[0], 0)])  # fmt: skip
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIAL[0], eos_token=SPECIAL[2],
                                                pad_token=SPECIAL[0])  # fmt: skip
    fast.chat_template = TEMPLATE
    return fast


def _folder(path, family: str, style: str):
    tokenizer = bpe_tokenizer(style)
    torch.manual_seed(0)
    cfg = gguf_config(family, len(tokenizer) + 3)  # three ids the tokenizer lacks: [PAD<id>] in the file
    model = random_weights(transformers.AutoModelForCausalLM.from_config(cfg), family).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(c))
def written(request, tmp_path_factory):
    """(family, style, folder, the MXFP4 GGUF `minifloat quantize` wrote from it)."""
    family, style = request.param
    root = tmp_path_factory.mktemp(f"hf-{family}-{style}")
    folder, out = _folder(root / "model", family, style), root / "m.gguf"
    assert main(["quantize", str(folder), "--scheme", "mxfp4-weight-only", "--format", "gguf", "--gguf-rest", "f32",
                 "--out", str(out)]) == 0  # fmt: skip
    return family, style, folder, out


def test_the_file_carries_the_folders_tokenizer_as_llama_cpps_converter_writes_it(written):
    family, style, folder, out = written
    f = gguf.GGUFReader(out).fields
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    vocab = transformers.AutoConfig.from_pretrained(folder).vocab_size
    assert f["general.architecture"].contents() == family
    assert f["tokenizer.ggml.model"].contents() == "gpt2"
    assert f["tokenizer.ggml.pre"].contents() == style
    tokens = f["tokenizer.ggml.tokens"].contents()
    assert tokens[: len(tok)] == tok.convert_ids_to_tokens(list(range(len(tok))))
    assert tokens[len(tok) :] == [f"[PAD{i}]" for i in range(len(tok), vocab)]
    types = f["tokenizer.ggml.token_type"].contents()
    assert [types[tok.convert_tokens_to_ids(s)] for s in SPECIAL] == [gguf.TokenType.CONTROL] * 3
    assert types[len(tok) :] == [gguf.TokenType.UNUSED] * 3
    assert types[tok.convert_tokens_to_ids("Ġthe")] == gguf.TokenType.NORMAL
    merges = json.loads((folder / "tokenizer.json").read_text())["model"]["merges"]
    assert f["tokenizer.ggml.merges"].contents() == [m if isinstance(m, str) else " ".join(m) for m in merges]
    assert f["tokenizer.ggml.eos_token_id"].contents() == tok.eos_token_id
    assert f["tokenizer.ggml.bos_token_id"].contents() == tok.bos_token_id
    assert f["tokenizer.chat_template"].contents() == TEMPLATE
    assert f["tokenizer.ggml.add_bos_token"].contents() == (style == "llama-bpe")
    assert f["tokenizer.ggml.add_eos_token"].contents() is False


def test_transformers_reads_the_file_as_the_model_quantized_in_memory(written):
    """Every tensor named and ordered right, every hyper-parameter under its key: transformers'
    reader builds the model from the file alone and computes what minifloat's FP4 model does."""
    _, _, folder, out = written
    model = load_model(folder)
    minifloat.quantize_model(model, "mxfp4-weight-only", export_format="gguf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out.parent, gguf_file=out.name).eval()
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids).logits
        torch.testing.assert_close(theirs(ids).logits, ours, rtol=0, atol=1e-5)
        assert torch.equal(load_model(out)(ids).logits, ours)


def test_the_bits_planned_from_a_folder_are_the_files(written):
    _, _, folder, out = written
    every = gguf_file.tensor_bits(out)[1]
    assert gguf_file.dense_bits(folder, "f32") == (32 * every, every)


@pytest.mark.llamacpp
def test_llama_cpp_tokenizes_as_the_folder_does_and_computes_the_fp4_model(written):
    llama_cpp = pytest.importorskip("llama_cpp")
    _, _, folder, out = written
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=256, n_threads=2, verbose=False, vocab_only=True)
    for text in (TEXT, "x'S 1234567 ÜÜ\r\n\n  end", "<|im_start|>user"):
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == tok(text, add_special_tokens=False)["input_ids"]
        assert llm.tokenize(text.encode(), add_bos=True, special=True) == tok(text)["input_ids"]  # the file's add_bos
    model = load_model(folder)
    minifloat.quantize_model(model, "mxfp4-weight-only", export_format="gguf")
    ids = tok(TEXT, add_special_tokens=False)["input_ids"][:36]
    theirs = llama_cpp_logits(out, ids)
    with torch.no_grad():
        ours = model(torch.tensor([ids])).logits[0]
        full = load_model(folder)(torch.tensor([ids])).logits[0]
    assert (theirs - ours).abs().max() < 0.3 * (full - ours).abs().max()


def _one_line_error(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, err


def test_what_a_folder_cannot_give_a_gguf_is_refused_before_any_work(tmp_path, capsys):
    out = ["--scheme", "mxfp4-weight-only", "--format", "gguf", "--out", str(tmp_path / "x.gguf")]
    folder = _folder(tmp_path / "llama", "llama", "gpt-2")
    data = json.loads((folder / "tokenizer.json").read_text())

    data["pre_tokenizer"] = {"type": "Whitespace"}
    (folder / "tokenizer.json").write_text(json.dumps(data))
    _one_line_error(capsys, ["quantize", str(folder), *out], "pre_tokenizer", "convert_hf_to_gguf.py")
    data["model"]["byte_fallback"] = True  # a SentencePiece-style BPE (Llama 2, Gemma)
    (folder / "tokenizer.json").write_text(json.dumps(data))
    _one_line_error(capsys, ["quantize", str(folder), *out], "not a byte-level BPE", "convert_hf_to_gguf.py")
    (folder / "tokenizer.json").unlink()
    _one_line_error(capsys, ["quantize", str(folder), *out], "no tokenizer.json")

    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}))
    _one_line_error(capsys, ["quantize", str(folder), *out], "RoPE scaling 'linear'")

    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"steps": 4}')  # a config.json, not a transformers model's
    _one_line_error(capsys, ["quantize", str(tmp_path / "odd"), *out], "config.json is not a transformers model's")

    gemma = tmp_path / "gemma"
    transformers.AutoModelForCausalLM.from_config(gguf_config("gemma3", 300)).save_pretrained(gemma)
    _one_line_error(capsys, ["quantize", str(gemma), *out], "model_type 'gemma3_text'", "convert_hf_to_gguf.py")
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.llamacpp
def test_bench_llamacpp_takes_a_transformers_folder(written, tmp_path, capsys):
    """llama.cpp's own files made from the F32 GGUF minifloat writes from the folder: llama.cpp's
    perplexity of it is minifloat's of the folder's model, and its quantizer makes Q8_0 from it."""
    import sys

    pytest.importorskip("llama_cpp")
    family, style, folder, _ = written
    if (family, style) != ("llama", "llama-bpe"):
        pytest.skip("one family is enough for the command")
    out = tmp_path / "b"
    assert main(["bench", "llamacpp", str(folder), "--llamacpp-python", sys.executable, "--out", str(out), "--batch-size", "2",
                 "--seq-len", "32", "--eval-batches", "1", "--calib-batches", "1", "--new-tokens", "4", "--reps", "1",
                 "--methods", "rtn", "--configs", "mxfp4-weight-only", "--llama-types", "F32,Q8_0", "--json"]) == 0  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    rows = {r["file"]: r for r in result["rows"]}
    assert list(rows) == ["llama.cpp F32", "llama.cpp Q8_0", "minifloat mxfp4-weight-only rtn"]
    assert rows["llama.cpp F32"]["ppl"] == pytest.approx(result["minifloat_f32_ppl"], rel=1e-4)
    assert gguf.GGUFReader(rows["llama.cpp Q8_0"]["path"]).fields["tokenizer.ggml.pre"].contents() == style
