"""Fine-tuning a pretrained causal LM: the `Task` that `minifloat train MODEL` runs.

MODEL is a transformers folder, a ``.gguf`` file (through `minifloat.models.loading`) or the
output folder of an earlier fine-tune (its ``model/`` or ``merged/`` folder). The text is the
model's own tokenizer's: continued pretraining on `--data` (`minifloat.data.tokens`: documents
separated by EOS, BOS where the tokenizer adds one, the last 10 % held out), or SFT on `--sft`
records (`minifloat.data.sft`: the loss on the responses only, packed with attention inside each
record; the last 10 % of the records held out).

A full fine-tune converts the Linear layers of the decoder layers to the recipe (`--precision`,
`minifloat.convert`), keeps the first / last N decoder layers, the head, the embedding and the
norms in high precision by default (`--quantize-head` converts the head too), and writes the
result as a transformers folder (``out/model``: ``save_pretrained`` with the FP32 master weights
and the tokenizer) that `quantize`, `eval`, `generate` and transformers load.

A LoRA run (`--lora RANK`) freezes the base, held as `--base` says (`minifloat.finetune.lora`),
trains the adapters and writes them as a PEFT adapter (``out/adapter``), and with `--merge`
the merged model (``out/merged``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from minifloat import checkpoint
from minifloat.data.corpus import read_documents, stdlib_documents
from minifloat.data.sft import block_causal_mask, load_sft, pack
from minifloat.data.text import tokenizer_for
from minifloat.data.tokens import tokenize_documents, window_batch
from minifloat.errors import MinifloatError
from minifloat.finetune import lora
from minifloat.io.atomic import make_dir_beside, remove, replace_dir
from minifloat.models.loading import is_transformers, load_model, logits_of, require_transformers
from minifloat.nn import rounded
from minifloat.nn.convert import convert
from minifloat.optim import bf16_parameters
from minifloat.recipes import RECIPES
from minifloat.train.config import TrainConfig
from minifloat.train.task import Task, cross_entropy

CALIBRATION_BATCHES = 8  # training batches a GPTQ'd (or residual-initialized) packed base calibrates on


def resolve(path: str | Path) -> Path:
    """The model file or folder `path` names: a fine-tune's output folder stands for its model, a
    fine-tune's checkpoint for the model it fine-tuned (whose tokenizer it uses)."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        pretrained = json.loads((path / "manifest.json").read_text()).get("config", {}).get("pretrained")
        if pretrained:
            return resolve(pretrained)
    if checkpoint.run_model(path) is not None:
        return checkpoint.run_model(path)
    if path.is_dir() and (path / "adapter" / "adapter_config.json").is_file():
        raise MinifloatError(f"{path}: a LoRA run's output holds adapters, not a model; train it again with --merge "
                             f"(out/merged), or load its adapter onto the base model with peft")  # fmt: skip
    return path


def load_pretrained(path: str | Path) -> torch.nn.Module:
    """The transformers causal LM at `path` (`resolve`), in FP32, with the KV cache off (training);
    a full fine-tune's checkpoint (``ckpt-N``): the model it fine-tuned with the checkpoint's weights."""
    own = _fine_tune_checkpoint(Path(path))
    if own is not None:
        return own
    model = load_model(resolve(path))
    if not is_transformers(model):
        raise MinifloatError(f"{path}: a built-in GPT; fine-tuning takes a pretrained transformers model or GGUF "
                             f"(continue a GPT run with minifloat train --resume)")  # fmt: skip
    _plain(model)
    torch.nn.Module.float(model).train()
    model.config.use_cache = False
    return model


def _fine_tune_checkpoint(path: Path) -> torch.nn.Module | None:
    """A ``ckpt-N`` folder of a full fine-tune as its model, or None for any other path."""
    if not (path / "manifest.json").is_file():
        return None
    manifest, weights, _ = checkpoint.load_checkpoint(path)
    config = manifest.get("config", {})
    if not config.get("pretrained"):
        return None
    if config.get("lora_rank"):
        raise MinifloatError(f"{path}: a LoRA run's checkpoint holds adapters only; use its run's --merge output "
                             f"(out/merged) or load out/adapter onto {config['pretrained']} with peft")  # fmt: skip
    model = load_pretrained(config["pretrained"])
    keys = plain_keys(model)
    missing = [k for k in keys if k not in weights]
    if missing:
        raise MinifloatError(f"{path}: the checkpoint lacks {missing[:3]} of {config['pretrained']}")
    model.load_state_dict({k: weights[k].float() for k in keys}, strict=False)
    return model


def _plain(model: torch.nn.Module) -> None:
    """A model transformers read from GGUF holds plain dequantized tensors but calls itself quantized
    (it refuses ``.float()``, and would save a GGUF quantization config): make it a plain model."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return
    if "gguf" not in type(quantizer).__name__.lower():
        raise MinifloatError(f"a {type(quantizer).__name__} model: its weights are held by a quantization library; "
                             "fine-tune the unquantized model (or its GGUF)")  # fmt: skip
    model.hf_quantizer, model.is_quantized = None, False
    if hasattr(model, "quantization_method"):
        model.quantization_method = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def decoder_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """(path, list) of the model's decoder layers: ``model.layers`` (Llama, Qwen, Mistral, Gemma,
    Phi-3 …), else the module list as long as the config's layer count."""
    n = getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", None)
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) == n and name.endswith("layers"):
            return name, m
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) == n:
            return name, m
    raise MinifloatError(f"{type(model).__name__}: no list of {n} decoder layers found")


def head_name(model: torch.nn.Module) -> str | None:
    head = model.get_output_embeddings()
    return next((n for n, m in model.named_modules() if m is head), None)


def plain_keys(model: torch.nn.Module) -> list[str]:
    """The state-dict keys that a transformers folder stores: a tied weight once (its first name)."""
    seen, keys = set(), []
    for k, v in model.state_dict().items():
        if v.untyped_storage().data_ptr() in seen:
            continue
        seen.add(v.untyped_storage().data_ptr())
        keys.append(k)
    return keys


class PretrainedTask(Task):
    """A pretrained model fine-tuned on its own tokenizer's text (see the module docstring)."""

    name = "pretrained"
    evaluate_before = True

    def describe(self, c: TrainConfig) -> str:
        return f"the model {c.pretrained}"

    # -- data --------------------------------------------------------------------------------
    def prepare(self, c: TrainConfig) -> None:
        self.config = c
        require_transformers()  # a clear error without the extra, before the tokenizer's import
        if not Path(c.pretrained).exists():
            raise MinifloatError(f"{c.pretrained}: no such model folder or file")
        self.tokenizer = tokenizer_for(resolve(c.pretrained))
        if self.tokenizer is None:
            raise MinifloatError(f"{c.pretrained}: no tokenizer beside the model (tokenizer.json), which fine-tuning "
                                 f"needs to read the text as the model does")  # fmt: skip
        if c.sft is not None:
            examples = load_sft(c.sft, self.tokenizer)
            if len(examples) < 2:
                raise MinifloatError(f"--sft {c.sft}: {len(examples)} record; at least 2 are needed (the last "
                                     f"10 % are held out for the validation loss)")  # fmt: skip
            n_val = max(1, len(examples) // 10)
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
            self.sft_train = pack(examples[:-n_val], c.seq_len, pad)
            self.sft_val = pack(examples[-n_val:], c.seq_len, pad)
            self.source = f"{c.sft} ({len(examples)} records)"
            return
        docs = stdlib_documents(c.max_bytes) if c.data is None else read_documents(c.data, c.max_bytes)
        self.stream = tokenize_documents(docs, self.tokenizer, c.data or "the Python stdlib sources")
        self.source = self.stream.source

    def batch(self, c: TrainConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
        if c.sft is not None:
            idx = torch.randint(0, len(self.sft_train), (c.batch_size,), generator=generator)
            return _sft_batch([self.sft_train[i] for i in idx.tolist()])
        x, y = window_batch(self.stream.train, c.batch_size, c.seq_len, generator, bos=self.stream.bos)
        return {"input_ids": x, "labels": y}

    def val_batches(self, c: TrainConfig) -> list[dict[str, torch.Tensor]]:
        if c.sft is not None:
            rows = self.sft_val
            return [_sft_batch(rows[i : i + c.batch_size]) for i in range(0, min(len(rows), c.eval_batches * c.batch_size),
                                                                            c.batch_size)]  # fmt: skip
        g = torch.Generator().manual_seed(10_000 + c.seed)
        out = []
        for _ in range(c.eval_batches):
            x, y = window_batch(self.stream.val, c.batch_size, c.seq_len, g, bos=self.stream.bos)
            out.append({"input_ids": x, "labels": y})
        return out

    # -- model -------------------------------------------------------------------------------
    def build_model(self, c: TrainConfig) -> torch.nn.Module:
        torch.manual_seed(c.seed)
        model = load_pretrained(c.pretrained)
        context = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        if context and c.seq_len > context:
            raise MinifloatError(f"--seq-len {c.seq_len} exceeds the model's context of {context} tokens")
        self.plain_keys = plain_keys(model)
        self.layers_prefix, layers = decoder_layers(model)
        n = len(layers)
        for end in ("first", "last"):
            if getattr(c, f"high_precision_{end}") > n:
                raise MinifloatError(f"--high-precision-{end} {getattr(c, f'high_precision_{end}')}: the model has {n} decoder layers")
        self.head = head_name(model)
        torch.manual_seed(c.seed)  # the adapters' initial weights: the seed's, whatever loading drew
        if c.lora_rank:
            return self._attach_lora(model, c)
        high = {f"{self.layers_prefix}.{i}." for i in range(n) if i < c.high_precision_first or i >= n - c.high_precision_last}

        def keep(fqn: str, m) -> bool:  # True: convert this Linear
            if fqn == self.head:
                return c.quantize_head
            return fqn.startswith(self.layers_prefix + ".") and not any(fqn.startswith(h) for h in high)

        if c.precision in RECIPES:
            convert(model, c.recipe(), filter=keep)
        else:
            rounded.to_high_precision(model, c.precision, keep)
        return bf16_parameters(model) if c.master != "fp32" else model

    def _attach_lora(self, model: torch.nn.Module, c: TrainConfig) -> torch.nn.Module:
        names = lora.target_names(model, self.layers_prefix, c.lora_targets)
        calibration, originals = None, None
        if c.precision in lora.PACKED_BASES:
            from minifloat.infer.ptq.method import resolve_method
            from minifloat.infer.quantize import quantize_model

            if c.base_method == "gptq" or c.lora_init == "residual":  # calibration windows of the training text
                g = torch.Generator().manual_seed(20_000 + c.seed)
                calibration = [self.batch(c, g)["input_ids"] for _ in range(CALIBRATION_BATCHES)]
            if c.lora_init == "residual":  # what the packed base's error is measured against
                originals = {n: model.get_submodule(n).weight.detach().clone() for n in names}
            # GPTQ's recommended pipeline, its Hadamard rotation kept online in the packed layers (the frozen
            # base is never exported; `lora.effective_weight` undoes the rotation for merging and the backward):
            # SmolLM2's NVFP4 base with the head 3.476 → 3.458 before training, MXFP4 ≈3.60 → 3.532 (fp32: 3.369)
            config = lora.PACKED_BASES[c.precision]
            # without norm tuning: training fits the adapters to the packed base
            method = resolve_method("gptq", config, tune_norms=0) if c.base_method == "gptq" else "rtn"
            if c.base_keep or c.base_policy:  # first match wins: the kept globs in FP8, the policy's, then the base's format
                config = lora.base_policy(c.precision, c.base_keep, c.base_policy)
            with torch.no_grad():
                quantize_model(model, config, method=method, calibration=calibration, quantize_head=c.quantize_head)
        if c.precision != "fp32":
            model.to(torch.bfloat16)  # the frozen rest: BF16 (a packed layer keeps its codes and FP32 scales)
        adapters = lora.attach(model, names, c.lora_rank, c.lora_alpha, c.lora_dropout, lora.ADAPTER_DTYPES[c.adapter_dtype],
                               lora.compute_dtype(c.base_compute))  # fmt: skip
        if originals is not None:
            from minifloat.finetune.residual_init import init_from_residual

            self.residual_captured = init_from_residual(model, adapters, originals, calibration)
        return model

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return cross_entropy(logits_of(model(**inputs, use_cache=False)), batch["labels"])

    def blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return list(decoder_layers(model)[1])

    def num_params(self, model: torch.nn.Module) -> int:
        return sum(p.numel() for p in model.parameters() if p.requires_grad)

    # -- checkpoints and the result ----------------------------------------------------------
    def checkpoint_weights(self, model, weights):
        if self.config.lora_rank:  # the adapters: the base is rebuilt from MODEL on resume
            trained = {n for n, p in model.named_parameters() if p.requires_grad}
            return super().checkpoint_weights(model, {k: v for k, v in weights.items() if k in trained})
        seen, kept = set(), {}
        for k, v in weights.items():  # a tied weight once, under its first name
            ptr = v.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                kept[k] = v
        return super().checkpoint_weights(model, kept)

    def load_weights(self, model, weights, path):
        if self.config.lora_rank:
            trained = {n for n, p in model.named_parameters() if p.requires_grad}
            if set(weights) != trained:
                raise MinifloatError(f"{path}: its adapters do not fit this run's (missing {sorted(trained - set(weights))[:3]}, "
                                     f"unexpected {sorted(set(weights) - trained)[:3]})")  # fmt: skip
            model.load_state_dict(weights, strict=False)
            return
        _, unexpected = model.load_state_dict(weights, strict=False)
        absent = [k for k in self.plain_keys if k not in weights]
        if absent or unexpected:
            raise MinifloatError(f"{path}: weights do not fit {self.describe(self.config)} (missing {absent[:3]}, "
                                 f"unexpected {unexpected[:3]})")  # fmt: skip

    def finish(self, model: torch.nn.Module, out: Path, c: TrainConfig) -> dict:
        """The fine-tuned model as a transformers folder (``out/model``), or the adapters (``out/adapter``)
        and with `c.merge` the merged model (``out/merged``)."""
        written = {}
        if c.lora_rank:
            written["adapter"] = str(lora.save_adapter(model, out / "adapter", base_model=str(Path(c.pretrained).resolve())))
            if c.merge:
                written["merged"] = str(self._save_pretrained(model, out / "merged", lora.merged_state_dict(model, self.plain_keys)))
            return written
        latest = checkpoint.latest_checkpoint(out / "checkpoints")  # its weights: the FP32 masters, not BF16 parameters
        _, weights, _ = checkpoint.load_checkpoint(latest)
        state = {k: weights[k].float() for k in self.plain_keys}
        written["model"] = str(self._save_pretrained(model, out / "model", state))
        return written

    def _save_pretrained(self, model: torch.nn.Module, folder: Path, state: dict) -> Path:
        """`state` saved as a transformers folder with the model's config and the tokenizer, atomically
        (written beside `folder`, then renamed over it)."""
        tmp = make_dir_beside(folder, "save-tmp-")
        try:
            model.config.use_cache = True
            model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
            self.tokenizer.save_pretrained(tmp)
            (tmp / "minifloat.json").write_text(json.dumps({"fine_tuned_from": str(self.config.pretrained),
                                                            "config": self.config.to_dict()}, indent=2))  # fmt: skip
            replace_dir(tmp, folder)
        finally:
            model.config.use_cache = False
            if tmp.exists():
                remove(tmp)
        return folder


def _sft_batch(rows) -> dict[str, torch.Tensor]:
    seg = torch.stack([r.segment_ids for r in rows])
    return {"input_ids": torch.stack([r.input_ids for r in rows]), "labels": torch.stack([r.labels for r in rows]),
            "position_ids": torch.stack([r.position_ids for r in rows]), "attention_mask": block_causal_mask(seg)}  # fmt: skip
