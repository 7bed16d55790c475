"""`TrainConfig`: everything one training run depends on, validated once; and its learning-rate
schedule."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from minifloat.errors import MinifloatError
from minifloat.models.gpt import get_config
from minifloat.nn.rounded import HIGH_PRECISIONS
from minifloat.optim.states import MASTERS, STATE_FORMATS
from minifloat.recipes import RECIPES, Recipe, get_recipe

PRECISIONS = HIGH_PRECISIONS + tuple(RECIPES)
# What the frozen base of a LoRA run is held in (`precision` names it): the high precisions as
# plain weights, the others packed (weight-only, `minifloat.finetune.lora`)
BASE_FORMATS = ("fp32", "bf16", "fp8", "mxfp8", "mxfp6", "nvfp4", "mxfp4")
PACKED_FORMATS = BASE_FORMATS[2:]  # a LoRA base held packed, weight-only (the PTQ configs `<format>-weight-only`)
BASE_METHODS = ("rtn", "gptq")
# How LoRA adapters start: PEFT's (B = 0: the run starts from the frozen base), or the calibrated
# best rank-r correction of a packed base's quantization error (`minifloat.finetune.residual_init`)
LORA_INITS = ("zero", "residual")
ADAPTER_DTYPES = ("fp32", "bf16")
BASE_COMPUTES = ("auto", "fp32", "bf16")  # a packed base's products: auto = bf16 where the CPU multiplies BF16 natively


def base_policy_pairs(policy) -> tuple[tuple[str, str], ...]:
    """A LoRA base's policy (a mapping, or pairs as JSON gives them back) as (glob, format) pairs in
    order; a format is one of `PACKED_FORMATS` or its PTQ config ``<format>-weight-only`` (as
    `minifloat adapt` names them), given back as the format."""
    items = list(policy.items()) if isinstance(policy, dict) else list(policy) if isinstance(policy, list | tuple) else [policy]
    pairs = []
    for item in items:
        if not (isinstance(item, list | tuple) and len(item) == 2 and all(isinstance(v, str) for v in item)):
            raise MinifloatError(f"--base-policy maps layer names or globs to formats, e.g. "
                                 f'{{"model.layers.11.mlp.*": "mxfp6"}}; got the entry {item!r}')  # fmt: skip
        glob, fmt = item
        name = fmt.removesuffix("-weight-only")
        if name not in PACKED_FORMATS:
            raise MinifloatError(f"--base-policy: {glob!r} → {fmt!r} is not a packed base format; use one of "
                                 f"{', '.join(PACKED_FORMATS)} (or its `-weight-only` config)")  # fmt: skip
        pairs.append((glob, name))
    if not pairs:
        raise MinifloatError("--base-policy: the policy names no layer")
    return tuple(pairs)


DEFAULT_LRS = {"gpt": 1e-3, "full": 3e-5, "lora": 2e-4}  # the peak learning rate when --lr is not given


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    precision: str = "fp32"
    model: str = "small"
    steps: int = 200
    batch_size: int = 16
    seq_len: int | None = None  # None: 128, or the model's block size where that is smaller
    # None: 1e-3 for the built-in GPT from scratch (3e-3 trains the small GPT unstably: BF16 val loss
    # 1.71 vs 1.31 at 600 steps), 3e-5 for a full fine-tune, 2e-4 for LoRA adapters
    lr: float | None = None
    warmup: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_accum: int = 1
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 50
    eval_batches: int = 8
    checkpoint_every: int = 0  # steps between checkpoints (0: by time only, and at the end)
    checkpoint_minutes: float = 5.0  # minutes between checkpoints, so a killed run loses at most this (0: off)
    keep_checkpoints: int = 3  # the newest checkpoints kept; older ones are removed
    optimizer_states: str = "fp32"  # AdamW's moments: fp32 (torch's AdamW), bf16, fp8, fp8-dre (minifloat.optim)
    master: str = "fp32"  # the master weights: fp32, bf16-sr, bf16+remainder (BF16 parameters; minifloat.optim)
    compile: bool = False
    activation_checkpointing: bool = False
    data: str | None = None  # None: the embedded stdlib corpus
    max_bytes: int = 4_000_000
    quantize_head: bool = False
    high_precision_first: int = 0  # keep the Linears of the first N blocks unquantized
    high_precision_last: int = 0  # keep the Linears of the last N blocks unquantized (NVFP4's advice)
    # The last fraction of the steps trained in BF16 (every GEMM of a recipe's Linears), as NVIDIA's
    # NVFP4 pretraining closes what is left of its gap ("precision switching"); 0: the recipe throughout
    precision_switch: float = 0.0
    # In each forward GEMM of a recipe's Linears, this many input channels of largest magnitude are
    # multiplied in BF16 instead of the recipe's format (`Recipe.outlier_channels`; 0: off)
    outlier_channels: int = 0
    fsdp: bool = False
    fp8_all_gather: bool = False  # FSDP2 gathers the quantized Linear weights as codes and scales (fp8-current, mxfp8)
    telemetry_every: int = 10  # steps between amax/scale/saturation records (0: off)
    # Fine-tuning a pretrained model (`minifloat.finetune`): its path (a transformers folder, a
    # .gguf, a fine-tune's output) replaces `model`; `data` is continued-pretraining text, or
    # `sft` a JSONL of instruction records
    pretrained: str | None = None
    sft: str | None = None
    lora_rank: int = 0  # > 0: train LoRA adapters of this rank on a frozen base held in `precision` (BASE_FORMATS)
    lora_alpha: float = 16.0  # the adapters' scale is alpha / rank (PEFT's convention)
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] | None = None  # module-name globs; None: every Linear of the decoder layers
    base_method: str = "rtn"  # how a packed base is quantized: rtn, gptq
    base_keep: tuple[str, ...] | None = None  # layer globs of a packed FP4 / MXFP8 base held in FP8 (fp8-weight-only) instead
    # (layer name or glob, packed format) pairs, first match wins (after `base_keep`): the base's
    # layers in other formats than `precision`, e.g. the assignment `minifloat adapt` chose
    base_policy: tuple[tuple[str, str], ...] | None = None
    adapter_dtype: str = "fp32"  # the adapters' parameters: fp32, bf16
    base_compute: str = "auto"  # BASE_COMPUTES: the dtype a packed base's weight is dequantized to per product (QLoRA's compute dtype)
    lora_init: str = "zero"  # LORA_INITS
    merge: bool = False  # a LoRA run also writes the merged model (out/merged)

    def __post_init__(self) -> None:
        for name in ("lora_targets", "base_keep"):  # JSON gives a list back; one glob may come as a string
            globs = getattr(self, name)
            if isinstance(globs, list | str):
                object.__setattr__(self, name, tuple([globs] if isinstance(globs, str) else globs))
        if self.base_policy is not None:
            object.__setattr__(self, "base_policy", base_policy_pairs(self.base_policy))
        self._check_finetune()
        if self.lr is None:
            object.__setattr__(self, "lr", DEFAULT_LRS["lora" if self.lora_rank else "full" if self.pretrained else "gpt"])
        if self.precision not in PRECISIONS and not (self.lora_rank and self.precision in BASE_FORMATS):
            raise MinifloatError(f"unknown precision {self.precision!r}; use one of {', '.join(PRECISIONS)}")
        self._check_switch()
        self._check_outliers()
        if self.pretrained is not None:  # the model's own context bounds seq_len, checked where it is loaded
            if self.seq_len is None:
                object.__setattr__(self, "seq_len", 128)
            for name in ("high_precision_first", "high_precision_last"):
                if getattr(self, name) < 0:
                    raise MinifloatError(f"--{name.replace('_', '-')} must be ≥ 0, got {getattr(self, name)}")
            self._check_common()
            return
        block_size = get_config(self.model).block_size
        if self.seq_len is None:
            object.__setattr__(self, "seq_len", min(128, block_size))
        for end in ("first", "last"):
            n = getattr(self, f"high_precision_{end}")
            if not 0 <= n <= get_config(self.model).n_layer:
                raise MinifloatError(
                    f"--high-precision-{end} {n}: the {self.model} model has {get_config(self.model).n_layer} blocks"
                )
        self._check_common()
        if self.seq_len > block_size:
            raise MinifloatError(f"--seq-len {self.seq_len} exceeds the {self.model} model's block size {block_size}")

    def _check_finetune(self) -> None:
        """The fine-tuning fields: only with `pretrained`, LoRA's within their ranges."""
        if self.pretrained is None:  # and the LoRA options, which would otherwise go unused
            used = [f"--{n.replace('_', '-')}" for n in ("sft", "lora_rank", "base_keep", "base_policy", "merge") if getattr(self, n)]
            used += ["--base-compute"] if self.base_compute != "auto" else []
            if used:
                raise MinifloatError(f"{' and '.join(used)} fine-tune a pretrained model: name it (minifloat train MODEL ...)")
            return
        if self.sft is not None and self.data is not None:
            raise MinifloatError("--sft trains on instruction records, --data on plain text: pass one of them")
        if self.lora_rank < 0:
            raise MinifloatError(f"--lora must be a rank ≥ 1 (0: a full fine-tune), got {self.lora_rank}")
        if not self.lora_rank:
            if self.base_keep:
                raise MinifloatError("--base-keep holds layers of a LoRA run's packed base in FP8: it needs --lora RANK")
            if self.base_policy:
                raise MinifloatError("--base-policy sets the formats of a LoRA run's packed base: it needs --lora RANK")
            if self.merge:
                raise MinifloatError("--merge folds LoRA adapters into the base: it needs --lora RANK")
            if self.base_compute != "auto":
                raise MinifloatError("--base-compute sets the products of a LoRA run's packed base: it needs --lora RANK")
            return
        if self.precision not in BASE_FORMATS:
            raise MinifloatError(f"--base {self.precision!r}: a LoRA run holds its frozen base in one of {', '.join(BASE_FORMATS)}")
        if self.base_policy and self.precision not in PACKED_FORMATS:
            raise MinifloatError(f"--base-policy sets the formats of a packed base's layers; --base {self.precision} is not "
                                 f"packed: pass --base {' / '.join(PACKED_FORMATS)} (the format of the layers it does not name)")  # fmt: skip
        if not (math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise MinifloatError(f"--lora-alpha must be a number > 0, got {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            raise MinifloatError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if self.base_method not in BASE_METHODS:
            raise MinifloatError(f"--base-method {self.base_method!r}: use one of {', '.join(BASE_METHODS)}")
        if self.adapter_dtype not in ADAPTER_DTYPES:
            raise MinifloatError(f"--adapter-dtype {self.adapter_dtype!r}: use one of {', '.join(ADAPTER_DTYPES)}")
        if self.base_compute not in BASE_COMPUTES:
            raise MinifloatError(f"--base-compute {self.base_compute!r}: use one of {', '.join(BASE_COMPUTES)}")
        if self.base_compute != "auto" and self.precision not in PACKED_FORMATS:
            raise MinifloatError(f"--base-compute sets the products of a packed base; --base {self.precision} is not packed "
                                 f"(pass --base {' / '.join(PACKED_FORMATS)}, or leave --base-compute auto)")  # fmt: skip
        if self.lora_init not in LORA_INITS:
            raise MinifloatError(f"--lora-init {self.lora_init!r}: use one of {', '.join(LORA_INITS)}")
        if self.lora_init == "residual" and self.precision in ("fp32", "bf16"):
            raise MinifloatError(f"--lora-init residual corrects a packed base's quantization error; --base {self.precision} "
                                 f"is not packed (use --base fp8, mxfp8, nvfp4 or mxfp4, or --lora-init zero)")  # fmt: skip
        if self.optimizer_states != "fp32" or self.master != "fp32" or self.fsdp:
            raise MinifloatError("a LoRA run trains a few million adapter weights at most: it keeps FP32 optimizer states "
                                 "and masters and runs in one process (drop --optimizer-states, --master and --fsdp)")  # fmt: skip

    def _check_switch(self) -> None:
        f = self.precision_switch
        if not (isinstance(f, int | float) and math.isfinite(f) and 0 <= f < 1):
            raise MinifloatError(f"--precision-switch is the fraction of the steps trained in BF16 at the end, in [0, 1), got {f!r}")
        if f:
            self._check_recipe_option("--precision-switch", "moves a recipe's training to BF16 for its last steps",
                                      "trains its last steps on")  # fmt: skip
        switched = round(f * self.steps)
        if f and self.steps >= 1 and not 0 < switched < self.steps:
            raise MinifloatError(f"--precision-switch {f} of --steps {self.steps} switches {switched} steps to BF16; it must "
                                 f"leave at least one step of each: pass a fraction between {1 / self.steps:.3g} and "
                                 f"{1 - 1 / self.steps:.3g}, or 0 for none")  # fmt: skip

    def _check_outliers(self) -> None:
        k = self.outlier_channels
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise MinifloatError(f"--outlier-channels is a whole number of input channels ≥ 0, got {k!r}")
        if k:
            self._check_recipe_option("--outlier-channels", "takes input channels out of a recipe's forward GEMMs",
                                      "multiplies its channels from")  # fmt: skip

    def _check_recipe_option(self, option: str, does: str, reads: str) -> None:
        """An `option` that changes how a recipe's GEMMs compute, set: a LoRA run (whose base is frozen and
        whose adapters train in high precision) and a high precision have no such GEMMs, and
        `fp8_all_gather` gathers the weights it `reads` from the BF16 copy of as FP8 codes."""
        if self.lora_rank or self.precision not in RECIPES:
            raise MinifloatError(f"{option} {does}; --precision {self.precision}{' with --lora' if self.lora_rank else ''} "
                                 f"trains no recipe's GEMMs (use it with a recipe, fully trained: fp8, mxfp8, nvfp4, mxfp4, …)")  # fmt: skip
        if self.fp8_all_gather:
            raise MinifloatError(f"{option} {reads} the BF16 weights, which --fp8-all-gather gathers as FP8 codes: "
                                 "pass one of them")  # fmt: skip

    def recipe(self) -> Recipe:
        """The recipe that `precision` names, with `outlier_channels` (a recipe precision only)."""
        recipe = get_recipe(self.precision)
        return recipe.replace(outlier_channels=self.outlier_channels) if self.outlier_channels else recipe

    def switch_step(self) -> int:
        """The first step trained in BF16 under `precision_switch` (`steps` when there is none): the
        last ``round(precision_switch · steps)`` steps switch (at least one, never all: checked)."""
        return self.steps - round(self.precision_switch * self.steps)

    def _check_common(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "eval_batches"):
            if getattr(self, name) < 1:
                raise MinifloatError(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(self, name)}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise MinifloatError(f"--lr must be a positive number, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise MinifloatError(f"min_lr_ratio must be in [0, 1] (the final lr as a fraction of --lr), got {self.min_lr_ratio}")
        for name in ("weight_decay", "grad_clip"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise MinifloatError(f"--{name.replace('_', '-')} must be a number ≥ 0 (0: off), got {getattr(self, name)}")
        if self.warmup < 0 or self.max_bytes < 1:
            raise MinifloatError(f"--warmup must be ≥ 0 and max_bytes ≥ 1, got {self.warmup} and {self.max_bytes}")
        if self.telemetry_every < 0 or self.eval_every < 0 or self.checkpoint_every < 0:
            raise MinifloatError(
                "--eval-every, --checkpoint-every and --telemetry-every must be ≥ 0 (0: off)"
            )
        if not (math.isfinite(self.checkpoint_minutes) and self.checkpoint_minutes >= 0):
            raise MinifloatError(f"--checkpoint-minutes must be a number ≥ 0 (0: off), got {self.checkpoint_minutes}")
        if self.keep_checkpoints < 1:
            raise MinifloatError(f"--keep-checkpoints must be ≥ 1 (the checkpoint a run resumes from), got {self.keep_checkpoints}")
        if self.optimizer_states not in STATE_FORMATS:
            raise MinifloatError(f"--optimizer-states {self.optimizer_states!r}: use one of {', '.join(STATE_FORMATS)}")
        if self.master not in MASTERS:
            raise MinifloatError(f"--master {self.master!r}: use one of {', '.join(MASTERS)}")
        if self.master != "fp32" and self.precision in ("fp32", "fp16"):
            raise MinifloatError(f"--master {self.master} keeps the weights in BF16, which --precision {self.precision} does not "
                                 "compute in; use it with bf16 or a low-precision recipe (fp8, mxfp8, nvfp4, …)")  # fmt: skip
        if self.fp8_all_gather and not (self.fsdp and self.precision in ("fp8-current", "mxfp8")):
            raise MinifloatError(f"--fp8-all-gather gathers FSDP2 shards as codes and scales: it needs --fsdp and a precision whose "
                                 f"weights a shard can quantize alone (fp8-current, mxfp8), got --precision {self.precision}"
                                 + ("" if self.fsdp else " without --fsdp"))  # fmt: skip

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, path: str | Path) -> TrainConfig:
        """Read a config written by `to_dict` (e.g. by ``minifloat compare``)."""
        try:
            fields = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise MinifloatError(f"cannot read the train config {path}: {err}") from None
        known = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(fields, dict) or set(fields) - known:
            extra = sorted(set(fields) - known) if isinstance(fields, dict) else type(fields).__name__
            raise MinifloatError(
                f"{path}: not a train config (unknown fields {extra}); known: {', '.join(sorted(known))}"
            )
        try:
            return cls(**fields)
        except TypeError as err:  # e.g. "steps": "10": the checks compare numbers
            raise MinifloatError(f"{path}: a field has the wrong type ({err}); write numbers as numbers") from None


def lr_at(step: int, c: TrainConfig) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio · lr``."""
    if step < c.warmup:
        return c.lr * (step + 1) / c.warmup
    progress = (step - c.warmup) / max(1, c.steps - c.warmup)
    return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))
