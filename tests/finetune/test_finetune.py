"""Fine-tuning pretrained transformers models (tiny random Llama and Qwen2 with a real byte-level
tokenizer): full fine-tunes in the recipes with a transformers folder as the result, continued
pretraining windows that follow the tokenizer, SFT's loss on the responses of packed records
against each record run alone, bit-exact resume, and LoRA on a packed base whose adapters the
real peft loads with the same logits."""

import dataclasses
import json

import pytest
import torch

import minifloat
from minifloat import checkpoint
from minifloat.cli import main
from minifloat.train.config import TrainConfig
from minifloat.train.loop import train
from minifloat.train.runlog import read_log

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from minifloat.data.sft import IGNORE  # noqa: E402
from minifloat.data.tokens import tokenize_documents  # noqa: E402
from minifloat.finetune import PretrainedTask  # noqa: E402
from minifloat.finetune.lora import FrozenPacked, LoRALinear, PackedMatmul  # noqa: E402
from tests.finetune.tiny import byte_tokenizer, tiny_model  # noqa: E402

TEXT = ("The list type is a mutable sequence. Lists hold items of any type, in order. " * 4 + "\n\n") * 60


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("llama") / "model", "llama")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("qwen") / "model", "qwen2", tied=False)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    folder = tmp_path_factory.mktemp("docs")
    for i in range(4):
        (folder / f"doc{i}.txt").write_text(f"Document {i}. " + TEXT)
    return str(folder)


def _cfg(model, **kw):
    fields = dict(pretrained=str(model), steps=4, batch_size=4, seq_len=48, warmup=1, eval_every=4, eval_batches=2,
                  lr=5e-3, checkpoint_minutes=0, telemetry_every=0)  # fmt: skip
    return TrainConfig(**{**fields, **kw})


def _run(c, out, **kw):
    return train(c, out, progress=False, task=PretrainedTask(), **kw)


@pytest.mark.parametrize(("family", "precision"), [("llama", "nvfp4"), ("qwen2", "mxfp8")])
def test_a_full_fine_tune_converts_the_decoder_layers_and_writes_a_transformers_folder(
    family, precision, llama, qwen, text, tmp_path
):
    model_path = llama if family == "llama" else qwen
    c = _cfg(model_path, precision=precision, data=text)
    task = PretrainedTask()
    task.prepare(c)
    model = task.build_model(c)
    kinds = {n: type(m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert all(t is minifloat.nn.Linear for n, t in kinds.items() if ".layers." in n)
    assert kinds["lm_head"] is torch.nn.Linear  # the head in high precision by default
    result = _run(c, tmp_path / "run")
    log = read_log(tmp_path / "run" / "log.jsonl")
    footprint = json.loads((tmp_path / "run" / "footprint.json").read_text())
    assert log[-1]["val_loss"] < footprint["base_val_loss"]  # the fine-tune helps
    # the result: a transformers folder holding the checkpoint's FP32 master weights and the tokenizer
    loaded = transformers.AutoModelForCausalLM.from_pretrained(result["model"])
    _, weights, _ = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(tmp_path / "run" / "checkpoints"))
    state = loaded.state_dict()
    assert all(torch.equal(state[k], weights[k].float()) for k in weights)
    assert loaded.config.tie_word_embeddings == (family == "llama")
    assert transformers.AutoTokenizer.from_pretrained(result["model"]).encode("list") == byte_tokenizer(family == "llama").encode("list")
    # and minifloat's own commands take it (the output folder stands for its model)
    assert main(["quantize", str(tmp_path / "run"), "--scheme", "mxfp8", "--out", str(tmp_path / "q")]) == 0
    # a checkpoint of the run is a model to fine-tune further: the base's architecture, the checkpoint's weights
    from minifloat.finetune import load_pretrained

    ckpt = checkpoint.latest_checkpoint(tmp_path / "run" / "checkpoints")
    again = load_pretrained(ckpt)
    assert all(torch.equal(again.state_dict()[k], state[k]) for k in weights)
    _run(_cfg(ckpt, precision="bf16", data=text, steps=1, eval_every=0), tmp_path / "again")


def test_quantize_head_and_high_precision_layers_choose_which_linears_convert(llama, text):
    c = _cfg(llama, precision="mxfp8", data=text, quantize_head=True, high_precision_last=1)
    task = PretrainedTask()
    task.prepare(c)
    kinds = {n: type(m) for n, m in task.build_model(c).named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds["lm_head"] is minifloat.nn.Linear
    assert kinds["model.layers.0.mlp.up_proj"] is minifloat.nn.Linear and kinds["model.layers.1.mlp.up_proj"] is torch.nn.Linear


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_pretraining_windows_follow_the_tokenizers_conventions(family, tmp_path):
    """Documents joined with EOS; a window starts with BOS where the tokenizer puts one in front of
    a text (the byte Llama tokenizer), with no BOS where it does not (the Qwen one)."""
    tok = byte_tokenizer(bos=family == "llama")
    docs = [b"first document " * 30, b"second one " * 40]
    stream = tokenize_documents(docs, tok, "two docs")
    whole = torch.cat([stream.train, stream.val]).tolist()
    expect = tok.encode(docs[0].decode(), add_special_tokens=False) + [2] + tok.encode(docs[1].decode(), add_special_tokens=False) + [2]
    assert whole == expect and len(stream.val) == len(whole) // 10
    assert stream.bos == (1 if family == "llama" else None)
    model = tiny_model(tmp_path / "m", family)
    (tmp_path / "d.txt").write_text(TEXT)
    c = _cfg(model, data=str(tmp_path / "d.txt"))
    task = PretrainedTask()
    task.prepare(c)
    batch = task.batch(c, torch.Generator().manual_seed(0))
    x, y = batch["input_ids"], batch["labels"]
    assert x.shape == y.shape == (4, 48) and torch.equal(x[:, 1:], y[:, :-1])
    assert bool((x[:, 0] == 1).all()) == (family == "llama")


def test_sft_loss_counts_the_responses_of_packed_records_as_each_record_alone(llama, tmp_path):
    """The packed batch's loss (block-causal attention, positions restarting per record, labels on
    the responses) equals the loss over the response tokens of each record run by itself."""
    records = [{"messages": [{"role": "user", "content": f"what is {w}?"}, {"role": "assistant", "content": f"{w} is a word."}]}
               for w in ("list", "dict", "set", "tuple", "str", "int", "bytes", "float", "range", "map")]  # fmt: skip
    records.append({"prompt": "say hi", "completion": " hi"})
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    c = _cfg(llama, sft=str(path), seq_len=96, precision="fp32")
    task = PretrainedTask()
    task.prepare(c)
    model = task.build_model(c).eval()
    from minifloat.finetune.pretrained import _sft_batch

    rows = task.sft_train[:3]
    batch = _sft_batch(rows)
    assert int((batch["input_ids"][0] != 0).sum()) > 0 and int(batch["position_ids"][0].eq(0).sum()) >= 2  # ≥ 2 records a row
    with torch.no_grad():
        packed = task.loss(model, batch).item()
        total, count = 0.0, 0
        for row in rows:
            for s in range(int(row.segment_ids.max()) + 1):
                idx = (row.segment_ids == s).nonzero().flatten()
                ids, labels = row.input_ids[idx][None], row.labels[idx]
                logits = model(input_ids=ids).logits[0].double()
                keep = labels != IGNORE
                total += torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum").item()
                count += int(keep.sum())
    assert packed == pytest.approx(total / count, rel=1e-5)
    # the prompt's tokens are not labels: a record's counted labels are its response's (and the end marker)
    tok = task.tokenizer
    counted = tok.decode(rows[0].labels[(rows[0].labels != IGNORE) & (rows[0].segment_ids == 0)])
    assert counted == "list is a word.</s>"


def test_sft_errors_name_the_line_and_the_fix(llama, tmp_path):
    long = {"prompt": "x" * 200, "completion": "y"}
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" + json.dumps(long) + "\n")
    with pytest.raises(minifloat.MinifloatError, match="the record on line 2 has 20[0-9] tokens, more than the 48 of a window"):
        _run(_cfg(llama, sft=str(path)), tmp_path / "run")
    with pytest.raises(minifloat.MinifloatError, match="--sft trains on instruction records, --data on plain text"):
        _cfg(llama, sft=str(path), data=str(path))
    with pytest.raises(minifloat.MinifloatError, match="fine-tune a pretrained model: name it"):
        TrainConfig(lora_rank=4)


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_fine_tune_resumes_bit_identically(kind, llama, text, tmp_path):
    extra = dict(precision="mxfp8", master="bf16-sr") if kind == "full" else dict(precision="nvfp4", lora_rank=4, lora_targets=("q_proj", "*.mlp.*"))
    _run(_cfg(llama, data=text, steps=4, eval_every=2, **extra), tmp_path / "whole")
    _run(_cfg(llama, data=text, steps=2, eval_every=2, **extra), tmp_path / "half")
    _run(_cfg(llama, data=text, steps=4, eval_every=2, **extra), tmp_path / "half", resume=True)
    a, b = read_log(tmp_path / "whole" / "log.jsonl"), read_log(tmp_path / "half" / "log.jsonl")
    assert [(r["loss"], r.get("val_loss")) for r in a] == [(r["loss"], r.get("val_loss")) for r in b]
    wa = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(tmp_path / "whole" / "checkpoints"))[1]
    wb = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(tmp_path / "half" / "checkpoints"))[1]
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    if kind == "lora":  # a LoRA checkpoint holds the adapters only: the base is rebuilt from MODEL
        assert wa and all(".lora_A." in k or ".lora_B." in k for k in wa)


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotation", [None, 16])
def test_the_packed_base_passes_the_input_gradient_of_its_dequantized_weight(rotation, compute):
    """The input gradient of a packed layer (behind a Hadamard rotation T or not) is float64
    autograd's through ``x ↦ (x T) Q_Tᵀ``; the merged weight is ``Q_T Tᵀ``. Computing in BF16
    (QLoRA's compute dtype) is the float64 product of the BF16-rounded operands (torch's rounding
    of the float64 values, not minifloat's kernels), rounded to BF16 as a BF16 GEMM returns it
    (to within one BF16 step: the GEMM sums in FP32)."""
    from minifloat.finetune.lora import effective_weight
    from minifloat.infer.modules.linear import QuantizedLinear
    from minifloat.infer.ptq.rotation import HadamardRotation

    torch.manual_seed(0)
    rot = HadamardRotation(rotation, seed=3) if rotation else None
    transform = (lambda w, stats: (rot.fold(w), rot)) if rot else None
    layer = QuantizedLinear.from_linear(torch.nn.Linear(64, 48), "nvfp4-weight-only", transform=transform)
    x = torch.randn(5, 64, requires_grad=True)
    g = torch.randn(5, 48)
    y = PackedMatmul.apply(x, layer, compute)
    (gx,) = torch.autograd.grad(y, x, g)
    w = layer.weight.dequantize(torch.float64)  # the weight the forward multiplies by, in float64
    # T as the forward applies it (the rotation of the identity's rows); the backward builds Tᵀ its own way
    t = rot(torch.eye(64)).double() if rot else torch.eye(64, dtype=torch.float64)
    if compute == torch.bfloat16:
        def r(v):
            return v.to(torch.bfloat16).double()

        xt = r((x.detach().double() @ t).float())  # the input rotated in FP32, then rounded
        step = 2.0**-8  # one BF16 step, relative
        assert torch.allclose(y.double(), r(xt @ r(w).T) + layer.bias.double(), rtol=step, atol=1e-3)
        assert torch.allclose(gx.double(), r(r(g.double()) @ r(w)) @ t.T, rtol=step, atol=1e-3)
        assert not torch.equal(r(w), w)  # NVFP4 values times an FP32 tensor scale: rounded, so this tests the path
        if rot is None:  # the GEMM's own output: BF16 values (an FP32 GEMM's would not be)
            assert torch.equal(gx, gx.bfloat16().float())
        return
    ref = x.detach().double().requires_grad_()
    (gref,) = torch.autograd.grad(torch.nn.functional.linear(ref @ t, w), ref, g.double())
    assert torch.allclose(gx.double(), gref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(y.double(), x.detach().double() @ t @ w.T + layer.bias.double(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(effective_weight(layer).double(), w @ t.T, atol=1e-6)


def test_lora_adapters_load_in_peft_with_the_same_logits_and_merge(llama, text, tmp_path):
    peft = pytest.importorskip("peft")
    c = _cfg(llama, data=text, precision="fp32", lora_rank=4, lora_alpha=8, merge=True, lr=2e-2)
    task = PretrainedTask()
    result = train(c, tmp_path / "run", progress=False, task=task)
    ids = torch.randint(6, 200, (2, 24), generator=torch.Generator().manual_seed(1))
    ours = PretrainedTask()
    ours.prepare(c)
    model = ours.build_model(c).eval()
    _, weights, _ = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(tmp_path / "run" / "checkpoints"))
    model.load_state_dict(weights, strict=False)
    assert any(float(m.lora_B.weight.abs().max()) > 0 for m in model.modules() if isinstance(m, LoRALinear))  # trained
    with torch.no_grad():
        expect = model(input_ids=ids).logits
        base = transformers.AutoModelForCausalLM.from_pretrained(llama)
        theirs = peft.PeftModel.from_pretrained(base, result["adapter"]).eval()(input_ids=ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(result["merged"]).eval()(input_ids=ids).logits
    assert torch.allclose(theirs, expect, atol=1e-5) and torch.allclose(merged, expect, atol=1e-4)
    config = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


@pytest.mark.parametrize("base", ["nvfp4", "mxfp4", "fp8"])
def test_lora_on_a_packed_base_holds_it_packed_and_trains(base, llama, text, tmp_path):
    """The frozen base in packed layers (with the head quantized too: the tied table stays one
    packed table), by an independent count of the model's storages, against the BF16 base's
    bytes; the adapters train (the loss falls) and nothing else gets a gradient."""
    from minifloat.infer.modules.embedding import QuantizedEmbedding

    c = _cfg(llama, data=text, precision=base, lora_rank=4, quantize_head=True, base_method="gptq" if base == "nvfp4" else "rtn")
    task = PretrainedTask()
    task.prepare(c)
    model = task.build_model(c)
    assert isinstance(model.lm_head, FrozenPacked) and isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert model.model.embed_tokens.tied_to is model.lm_head.layer
    seen, frozen = set(), 0
    for t in [*model.buffers(), *(p for p in model.parameters() if not p.requires_grad)]:
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            frozen += t.untyped_storage().nbytes()
    bf16 = 2 * sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(llama).parameters())
    limit = {"nvfp4": 0.36, "mxfp4": 0.36, "fp8": 0.6}[base]  # tiny layers: norms and scales weigh more than in a real model
    assert frozen < limit * bf16
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, _ in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}  # fmt: skip
    _run(c, tmp_path / "run")
    log = read_log(tmp_path / "run" / "log.jsonl")
    assert log[-1]["val_loss"] < json.loads((tmp_path / "run" / "footprint.json").read_text())["base_val_loss"]
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()


def test_base_keep_and_base_policy_hold_the_named_layers_in_their_formats(llama, text, tmp_path):
    """--base-keep: the named layers packed in E4M3 (the dequantized weight on fp8-weight-only's
    grid, ml_dtypes' E4M3 the oracle); --base-policy: its layers in its formats (MXFP6: every block
    of 32 on ml_dtypes' E2M3 grid times a power of two), the keep globs first; every other layer in
    NVFP4, the head too."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    import numpy as np

    from minifloat.finetune.lora import effective_weight
    from minifloat.infer.modules.linear import QuantizedLinear

    policy = {"model.layers.1.mlp.*": "mxfp6-weight-only", "model.layers.0.self_attn.k_proj": "mxfp4"}
    c = _cfg(llama, data=text, precision="nvfp4", lora_rank=4, quantize_head=True, base_keep=("*.k_proj", "*.v_proj"),
             base_policy=policy)  # fmt: skip
    task = PretrainedTask()
    task.prepare(c)
    model = task.build_model(c)
    packed = {n.removesuffix(".base_layer.layer"): m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    kept = {n for n in packed if n.endswith(("k_proj", "v_proj"))}
    mlp = {n for n in packed if n.startswith("model.layers.1.mlp.")}
    assert len(kept) == 4 and len(mlp) == 3 and len(packed) == 15  # 7 Linears in each of 2 layers, and the head
    for name, layer in packed.items():
        want = "fp8-weight-only" if name in kept else "mxfp6-weight-only" if name in mlp else "nvfp4-weight-only"
        assert layer.config.name == want, name
    w = effective_weight(packed["model.layers.0.self_attn.k_proj"]).numpy()
    row_scale = np.abs(w).max(axis=1, keepdims=True) / 448
    on_grid = (w / row_scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * row_scale
    np.testing.assert_allclose(on_grid, w, rtol=1e-6, atol=0)
    blocks = effective_weight(packed["model.layers.1.mlp.down_proj"]).numpy().reshape(-1, 32)
    top = np.floor(np.log2(np.abs(blocks).max(axis=1, keepdims=True)))  # 2^top ≤ a block's largest value < 2^(top+1)
    fits = np.zeros(len(blocks), dtype=bool)
    for e in (2, 3):  # E2M3's largest binade is 2^2: the block scale is 2^(top - 2), or 2^(top - 3) when it rounded up
        s = np.exp2(top - e)
        fits |= np.all((blocks / s).astype(ml_dtypes.float6_e2m3fn).astype(np.float32) * s == blocks, axis=1)
    assert fits.all()  # every block on the grid at one of its two possible scales
    with pytest.raises(minifloat.MinifloatError, match="--base-keep .* needs --lora RANK"):
        _cfg(llama, data=text, precision="bf16", base_keep=("*.k_proj",))
    with pytest.raises(minifloat.MinifloatError, match="--base bf16 is not packed"):
        _cfg(llama, data=text, precision="bf16", lora_rank=4, base_policy=policy)
    with pytest.raises(minifloat.MinifloatError, match="'nvfp3' is not a packed base format"):
        _cfg(llama, data=text, precision="nvfp4", lora_rank=4, base_policy={"*": "nvfp3"})


def test_a_base_policy_is_read_first_match_wins():
    """The keep globs first, then the policy in its order, the base's format last — a policy's own
    catch-all rule included (the base does not replace it)."""
    from minifloat.finetune.lora import base_policy

    assert list(base_policy("nvfp4", ("*.k_proj",), (("*.k_proj", "mxfp4"), ("*", "mxfp6"))).items()) == [
        ("*.k_proj", "fp8-weight-only"), ("*", "mxfp6-weight-only")]  # fmt: skip
    assert list(base_policy("mxfp4", None, (("lm_head", "mxfp6"),)).items()) == [
        ("lm_head", "mxfp6-weight-only"), ("*", "mxfp4-weight-only")]  # fmt: skip


def test_adapt_chooses_a_base_policy_that_train_reads(llama, text, tmp_path, capsys):
    """`adapt` writes each budget's assignment as a policy file; `train --lora --base-policy` packs
    the base by it, and a policy file that is not one is refused with its path."""
    from minifloat.infer.modules.linear import QuantizedLinear

    assert main(["adapt", str(llama), "--data", text, "--candidates", "mxfp6-weight-only,nvfp4-weight-only", "--budget-bits", "5",
                 "--calib-batches", "1", "--eval-batches", "1", "--batch-size", "2", "--seq-len", "32", "--no-plots",
                 "--out", str(tmp_path / "adapt")]) == 0  # fmt: skip
    capsys.readouterr()
    policy_file = tmp_path / "adapt" / "policy-auto-5.json"
    policy = json.loads(policy_file.read_text())
    assert set(policy.values()) == {"mxfp6-weight-only", "nvfp4-weight-only"}  # 5 bits: some of each
    argv = ["train", str(llama), "--data", text, "--steps", "1", "--batch-size", "2", "--seq-len", "32", "--eval-every", "0",
            "--quiet", "--lora", "4", "--base", "nvfp4", "--out", str(tmp_path / "run")]  # fmt: skip
    assert main([*argv, "--base-policy", str(policy_file)]) == 0
    capsys.readouterr()
    manifest = json.loads((tmp_path / "run" / "checkpoints" / "ckpt-00000001" / "manifest.json").read_text())
    c = TrainConfig(**manifest["config"])  # the run's config, as its checkpoint holds it
    task = PretrainedTask()
    task.prepare(c)
    model = task.build_model(c)
    packed = {n.removesuffix(".base_layer.layer"): m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert {n: m.config.name for n, m in packed.items()} == policy
    (tmp_path / "bad.json").write_text('["model.layers.0.mlp.up_proj", "mxfp6"]')
    assert main([*argv, "--overwrite", "--base-policy", str(tmp_path / "bad.json")]) == 2
    assert f"--base-policy {tmp_path / 'bad.json'}: holds a list, not an object" in capsys.readouterr().err
    assert main(["memory", str(llama), "--base-policy", str(policy_file)]) == 2  # a plan without a packed LoRA base
    assert "--base-policy sets the formats of a LoRA run's packed base: add --lora RANK" in capsys.readouterr().err


def test_the_command_line_fine_tunes_and_refuses_what_does_not_fit(llama, text, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", str(llama), "--data", text, "--steps", "2", "--batch-size", "2", "--seq-len", "32", "--eval-every", "2",
            "--eval-batches", "1", "--quiet", "--out", str(out)]  # fmt: skip
    assert main([*argv, "--lora", "4", "--base", "mxfp4", "--merge"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["adapter"].endswith("adapter") and printed["merged"].endswith("merged")
    assert main(["eval", str(out), "--batch-size", "1", "--seq-len", "16", "--eval-batches", "1"]) == 0  # the merged model
    capsys.readouterr()
    assert main([*argv, "--base", "nvfp4", "--overwrite"]) == 2
    assert "--base is the frozen base of a LoRA run: add --lora RANK" in capsys.readouterr().err
    assert main([*argv, "--lora", "4", "--precision", "fp8", "--overwrite"]) == 2
    assert "pass --base instead" in capsys.readouterr().err
    assert main([*argv, "--lora", "4", "--lora-targets", "nothing_here", "--overwrite"]) == 2
    assert "--lora-targets nothing_here matches no Linear" in capsys.readouterr().err


def test_a_gguf_file_fine_tunes(tmp_path):
    pytest.importorskip("gguf")
    from tests.infer.test_gguf_and_bad_inputs import write_tiny_gguf

    write_tiny_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "d.txt").write_text(TEXT)
    result = _run(_cfg(tmp_path / "tiny.gguf", data=str(tmp_path / "d.txt"), precision="fp8", seq_len=24), tmp_path / "run")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(result["model"])
    assert "quantization_config" not in loaded.config.to_dict()  # a plain model, not a GGUF-quantized one


def test_an_sft_model_answers_in_the_templates_format(llama, tmp_path, capsys):
    """SFT on question / answer records, then `generate --chat`: the prompt rendered with the chat
    template, the answer the records taught, ended by the end-of-turn token (generation stops there)."""
    words = ("list", "dict", "set", "tuple", "str", "int", "bytes", "float")
    records = [{"messages": [{"role": "user", "content": f"what is {w}?"}, {"role": "assistant", "content": f"{w} is a type."}]}
               for w in words] * 3  # fmt: skip
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "run"
    assert main(["train", str(llama), "--sft", str(path), "--steps", "60", "--batch-size", "4", "--seq-len", "64", "--lr", "1e-2",
                 "--warmup", "5", "--eval-every", "0", "--quiet", "--out", str(out)]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["generate", str(out), "--chat", "--prompt", "what is dict?", "--max-new-tokens", "40", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["text"] == "dict is a type.</s>" and answer["new_tokens"] == len("dict is a type.") + 1


@pytest.mark.parametrize("options", [["--precision", "fp8"], ["--precision", "bf16", "--master", "bf16+remainder"],
                                     ["--lora", "8", "--base", "nvfp4", "--quantize-head"], ["--lora", "4", "--base", "fp8"],
                                     ["--lora", "4", "--base", "mxfp4", "--base-keep", "*.k_proj,*.v_proj"],
                                     ["--lora", "4", "--base", "nvfp4", "--base-policy", "POLICY"]])  # fmt: skip
def test_memory_plans_a_fine_tune_within_ten_percent_of_the_measured_state(options, llama, text, tmp_path, capsys):
    """The plan from the shapes alone (meta device; the activations on a fake model) against one
    real training step's state and one real forward's saved tensors, counted by their storages:
    every category within 10 %, the activations among them."""
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"model.layers.1.mlp.*": "mxfp6", "*.k_proj": "fp8-weight-only"}))
    options = [str(policy) if o == "POLICY" else o for o in options]
    assert main(["memory", str(llama), *options, "--measure", "--batch", "2", "--seq", "32", "--data", text, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    from minifloat.planner.finetune import MEASURED

    assert result["planned"]["activations"] > 0.2 * result["planned"]["total"]  # counted, and not small here
    for category, planned in result["planned"].items():
        measured = sum(result["measured"][k] for k in MEASURED[category])
        assert measured == pytest.approx(planned, rel=0.10, abs=256), category


def test_fsdp2_fine_tunes_a_transformers_model_as_one_process_does(llama, text, tmp_path):
    """`torchrun … train MODEL --fsdp --fp8-all-gather`: each decoder layer sharded, the Linear
    weights gathered as MXFP8 codes and scales; the losses follow one process's, and the result
    is the same transformers folder."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    args = [str(llama), "--precision", "mxfp8", "--data", text, "--steps", "3", "--batch-size", "4", "--seq-len", "32",
            "--eval-every", "3", "--eval-batches", "1", "--warmup", "1", "--lr", "5e-3", "--quiet"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(root / "src"), OMP_NUM_THREADS="1")
    sharded = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
                              "minifloat", "train", "--fsdp", "--fp8-all-gather", "--out", str(tmp_path / "fsdp"), *args],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    assert main(["train", "--out", str(tmp_path / "one"), *args]) == 0
    a, b = read_log(tmp_path / "fsdp" / "log.jsonl"), read_log(tmp_path / "one" / "log.jsonl")
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-2)  # reduction order, amplified by the lr
    assert (tmp_path / "fsdp" / "model" / "model.safetensors").is_file()


def test_activation_checkpointing_recomputes_decoder_layers_and_changes_no_number(llama, text, tmp_path):
    c = _cfg(llama, data=text, precision="fp8", steps=2, eval_every=2)
    _run(c, tmp_path / "plain")
    _run(_cfg(llama, data=text, precision="fp8", steps=2, eval_every=2, activation_checkpointing=True), tmp_path / "ckpt")
    a, b = read_log(tmp_path / "plain" / "log.jsonl"), read_log(tmp_path / "ckpt" / "log.jsonl")
    assert [(r["loss"], r["grad_norm"], r.get("val_loss")) for r in a] == [(r["loss"], r["grad_norm"], r.get("val_loss")) for r in b]


def test_compare_runs_the_peft_peer_on_the_same_windows(llama, text, tmp_path):
    """`compare MODEL --lora --peers peft-bf16`: PEFT's LoRA in its own process (here this venv's
    python, which has peft), on the windows minifloat's runs draw: the same BF16 base scores the
    same held-out batches to rounding before training, and both fine-tunes are reported."""
    import sys

    pytest.importorskip("peft")
    from minifloat.measure.compare import compare

    c = _cfg(llama, data=text, precision="bf16", lora_rank=4, steps=3, eval_every=3)
    metrics = compare(["bf16"], c, tmp_path / "cmp", plots=False, peers=["peft-bf16"], peer_python=sys.executable, echo=lambda s: None)
    ours, peer = metrics["runs"]
    assert peer["precision"] == "peft-bf16" and peer["status"] == "ok", peer.get("error")
    assert peer["base_val_loss"] == pytest.approx(ours["base_val_loss"], rel=2e-3)
    assert peer["final_val_loss"] == pytest.approx(ours["final_val_loss"], rel=2e-2)
    assert peer["state_bytes"] > 0 and "peft-bf16" in (tmp_path / "cmp" / "report.md").read_text()
    with pytest.raises(minifloat.MinifloatError, match="--peers runs PEFT's LoRA beside minifloat's: it needs MODEL, --lora RANK"):
        compare(["bf16"], _cfg(llama, data=text), tmp_path / "x", plots=False, peers=["peft-bf16"], peer_python=sys.executable)


def test_residual_factors_reach_the_eckart_young_optimum_in_the_inputs_metric():
    """The calibrated initialisation's rank-r update leaves exactly the tail of the singular values
    of E·H½ (H½ the symmetric root, from an eigendecomposition in numpy: not the Cholesky route the
    code takes), and beats any other rank-r update tried."""
    import numpy as np

    from minifloat.finetune.residual_init import residual_factors

    rng = np.random.default_rng(0)
    x = rng.standard_normal((400, 48)) * np.exp(rng.standard_normal(48))  # anisotropic inputs, as an LLM's
    gram = x.T @ x / len(x)
    error = rng.standard_normal((32, 48)) * 0.1
    b, a, captured = residual_factors(torch.from_numpy(error), torch.from_numpy(gram), rank=5, damp=0.0)
    w, v = np.linalg.eigh(gram)
    root = (v * np.sqrt(w)) @ v.T
    s = np.linalg.svd(error @ root, compute_uv=False)
    delta = error - (b @ a).numpy()
    achieved = np.trace(delta @ gram @ delta.T)
    assert achieved == pytest.approx((s[5:] ** 2).sum(), rel=1e-9)
    assert captured == pytest.approx((s[:5] ** 2).sum() / (s**2).sum(), rel=1e-9)
    plain = np.linalg.svd(error)  # the unweighted best rank 5 (LoftQ's, weight space) does worse
    loftq = error - (plain[0][:, :5] * plain[1][:5]) @ plain[2][:5]
    assert achieved < np.trace(loftq @ gram @ loftq.T)


def test_a_residual_initialisation_starts_the_packed_base_closer_to_the_unquantized_model(llama, text, tmp_path):
    """Adapters initialised from the packed base's error (nvfp4, round to nearest) bring the
    model's logits closer to the unquantized model's than PEFT's zero start, and the run trains."""
    c = _cfg(llama, data=text, precision="nvfp4", lora_rank=8, lora_alpha=8)
    ids = torch.randint(6, 200, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(llama).eval()(input_ids=ids).logits.float()
    gaps = {}
    for init in ("zero", "residual"):
        task = PretrainedTask()
        task.prepare(c)
        model = task.build_model(dataclasses.replace(c, lora_init=init)).eval()
        with torch.no_grad():
            gaps[init] = float(((model(input_ids=ids).logits.float() - ref) ** 2).mean())
    assert gaps["residual"] < 0.85 * gaps["zero"], gaps  # 0.76 here: rank 8 of 64-wide layers with white-noise weights
    assert all(0 < v <= 1 for v in task.residual_captured.values()) and len(task.residual_captured) == 7 * 2
    _run(dataclasses.replace(c, lora_init="residual"), tmp_path / "run")
    assert read_log(tmp_path / "run" / "log.jsonl")[-1]["val_loss"] < json.loads((tmp_path / "run" / "footprint.json").read_text())["base_val_loss"]
    with pytest.raises(minifloat.MinifloatError, match="not packed"):
        dataclasses.replace(c, precision="bf16", lora_init="residual")
