"""Norm tuning after PTQ: the normalization gains of a quantized model distilled toward the
full-precision model's next-token distributions, everything else frozen (the idea of Norm
Tweaking, Li et al., arXiv 2309.02784).

Why the gains: every checkpoint format keeps them in high precision (compressed-tensors, vLLM,
GGUF's F32 norms), so what is tuned is exactly what is served, and they are few (two per block of a
Llama: 35,136 values on SmolLM2-135M). Why after GPTQ: GPTQ fits each layer's output on the
inputs the quantized layers before it produce, but not the rounding of the layer's own input
(FP8 per token: the error left after any weight method, docs/benchmarks/fp8-families-2026-11-27.md);
the gains scale those inputs channel by channel, so they can move values off the grid points
where rounding costs the model most.

`tune_norms` runs `steps` of AdamW (β 0.9 / 0.95, no weight decay, linear warm-up then a cosine to
zero) on ``KL(teacher ‖ student)`` over the vocabulary, per token, one batch of windows a step
(cycled). The student is the quantized model as a training graph sees it (each quantized layer's
exact values, its input rounded with a straight-through gradient: the caller builds it); only
`params` get gradients. It returns the mean KL on the first batches before and after, the same
windows both times (a training-window figure: held-out text is what `evaluate` is for); where the
tuned gains do not lower even that, the gains as they were are put back (`TuningResult.kept`). The
same KL is measured once on the way (after `check` of the steps): a tuning that has not lowered it
by then stops there, its gains put back — on Qwen2.5-Coder-0.5B's mxfp8 it rose over the whole run,
whose tuning is most of the time GPTQ + tuning takes (docs/guides/ptq.md).

Example:
    >>> import copy
    >>> teacher = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 16))
    >>> student = copy.deepcopy(teacher)
    >>> with torch.no_grad():
    ...     _ = student[1].weight.mul_(0.5)
    >>> r = tune_norms(student, teacher, [torch.randint(0, 16, (2, 9))], NormTuning(steps=20, lr=0.05))
    >>> r.kl_after < r.kl_before
    True
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minifloat.errors import MinifloatError
from minifloat.models.loading import logits_of

KL_BATCHES = 2  # batches the before / after KL is measured on
LOGITS_BUDGET = 1 << 25  # logit values one pass may hold (128 MB in FP32): a step's windows go through in passes this size


@dataclass(frozen=True, kw_only=True)
class NormTuning:
    """`steps` of AdamW at peak learning rate `lr` (`warmup` steps up to it, then a cosine),
    `rows` windows a step. The defaults measured best on SmolLM2-135M fp8-dynamic after GPTQ
    (docs/benchmarks/fp8-families-2026-11-27.md): 1e-3 overshoots, 150 steps gain little on 60."""

    steps: int = 60
    lr: float = 1e-4
    rows: int = 4
    warmup: int = 5
    check: float = 0.5  # the fraction of the steps after which the KL must have fallen, or the tuning stops (0: never)

    def __post_init__(self) -> None:
        if not (isinstance(self.steps, int) and self.steps > 0):
            raise MinifloatError(f"norm tuning takes a number of steps > 0, got {self.steps!r} (0: leave it out)")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise MinifloatError(f"norm tuning's learning rate must be a finite number > 0, got {self.lr!r}")
        if not 0 <= self.check < 1:
            raise MinifloatError(f"norm tuning's check is a fraction of its steps in [0, 1), got {self.check!r} (0: no check)")
        if not (isinstance(self.rows, int) and self.rows > 0) or self.warmup < 0:
            raise MinifloatError(f"norm tuning takes rows > 0 and warmup ≥ 0, got rows={self.rows!r} warmup={self.warmup!r}")


@dataclass(frozen=True)
class TuningResult:
    steps: int  # steps taken: fewer than asked where the check stopped the tuning
    parameters: int  # values tuned
    kl_before: float
    kl_after: float  # with the tuned gains, kept or not (at the check, where it stopped there)
    kept: bool = True  # False: the tuned gains did not lower kl_before, and the gains before tuning are back
    seconds: float = 0.0  # the tuning's wall time, the KL measurements included
    asked: int = 0  # the steps asked for


def norm_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The normalization layers' elementwise weights and biases (a module whose class name says
    ``norm``: LayerNorm, RMSNorm, Gemma's ``(1 + w)`` one), by name."""
    out: dict[str, torch.nn.Parameter] = {}
    for name, m in model.named_modules():
        if "norm" not in type(m).__name__.lower():
            continue
        for pn, p in m.named_parameters(recurse=False):
            if pn in ("weight", "bias") and p.dim() == 1:
                out[f"{name}.{pn}" if name else pn] = p
    return out


def _kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher ‖ student)."""
    s = F.log_softmax(student_logits.float(), -1).flatten(0, -2)
    t = F.log_softmax(teacher_logits.float(), -1).flatten(0, -2)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


def _inputs(batch: torch.Tensor) -> torch.Tensor:
    return batch[:, :-1]  # (B, T + 1) windows: the context; the last token is only a target


def _passes(x: torch.Tensor, vocab: int) -> list[torch.Tensor]:
    """`x`'s windows in groups whose logits fit `LOGITS_BUDGET` (at least one window a pass): memory
    bounded on a large vocabulary (Gemma 3's 262k: 4 × 128 tokens' logits are 0.5 GB a copy)."""
    rows = max(1, LOGITS_BUDGET // max(1, x[0].numel() * vocab))
    return list(x.split(rows))


def _mean_kl(student, teacher, x: torch.Tensor, vocab: int) -> float:
    """KL(teacher ‖ student) per token over `x`'s windows, pass by pass (no gradient)."""
    with torch.no_grad():
        return sum(float(_kl(logits_of(student(c)), logits_of(teacher(c)))) * len(c) for c in _passes(x, vocab)) / len(x)


@torch.enable_grad()  # a caller's no_grad (quantizing under it) does not stop the tuning
def _distill(student, teacher, batches, params, config: NormTuning) -> tuple[float, float, int]:
    """The tuning loop; the mean KL on the first `KL_BATCHES` batches before and after, and the
    steps taken (up to the check, where the KL had not fallen by then)."""
    probe = [_inputs(b) for b in batches[:KL_BATCHES]]
    with torch.no_grad():
        vocab = logits_of(teacher(probe[0][:1, :1])).shape[-1]

    def probe_kl() -> float:  # the before / check / after figure: the same windows each time
        return sum(_mean_kl(student, teacher, x, vocab) for x in probe) / len(probe)

    before = probe_kl()
    check = math.ceil(config.check * config.steps) if config.check else 0  # steps before the check; 0: none
    # a BF16 / FP16 gain takes its steps in an FP32 master: a 1e-4 step is below a BF16 gain's spacing
    masters = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in params]
    opt = torch.optim.AdamW(masters, lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    for step in range(config.steps):
        warm = min(1.0, (step + 1) / config.warmup) if config.warmup else 1.0
        for g in opt.param_groups:
            g["lr"] = config.lr * warm * 0.5 * (1 + math.cos(math.pi * step / config.steps))
        x = _inputs(batches[step % len(batches)])
        for p in params:  # the masters' gradients are set from these below (an FP32 gain is its own master)
            p.grad = None
        for c in _passes(x, vocab):  # the step's mean KL, its gradient summed pass by pass
            with torch.no_grad():
                target = logits_of(teacher(c))
            loss = _kl(logits_of(student(c)), target) * (len(c) / len(x))
            if not torch.isfinite(loss):
                raise MinifloatError(f"norm tuning's loss is {float(loss)} at step {step}: the quantized model's "
                                     f"logits are not finite; quantize without norm tuning")  # fmt: skip
            loss.backward()
        for p, m in zip(params, masters, strict=True):
            if m is not p:
                m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters, strict=True):
                if m is not p:
                    p.copy_(m)
        if step + 1 == check < config.steps:
            now = probe_kl()
            if not now < before:
                return before, now, check
    return before, probe_kl(), config.steps


def tune_norms(student: torch.nn.Module, teacher: torch.nn.Module, batches: Sequence[torch.Tensor],
               config: NormTuning = NormTuning(), *,  # noqa: B008 - frozen
               params: dict[str, torch.nn.Parameter] | None = None) -> TuningResult:  # fmt: skip
    """Tune `params` (default: `norm_parameters(student)`) of `student` in place toward
    `teacher`'s logits on `batches` (token windows (B, T + 1)); see the module docstring. The
    other parameters' ``requires_grad`` are restored afterwards."""
    params = norm_parameters(student) if params is None else params
    if not params:
        raise MinifloatError("norm tuning found no normalization layer with an elementwise weight to tune")
    if not batches:
        raise MinifloatError("norm tuning needs batches of token windows to distill on")
    flags = {p: p.requires_grad for p in student.parameters()}
    teacher_was, student_was = teacher.training, student.training
    teacher.eval()
    student.eval()  # dropout off: the student is the model that will be served
    try:
        student.requires_grad_(False)
        for p in params.values():
            p.requires_grad_(True)
        saved = [p.detach().clone() for p in params.values()]
        t0 = time.perf_counter()
        before, after, steps = _distill(student, teacher, batches, list(params.values()), config)
        kept = after < before  # on windows it trained on: a tuning that does not lower even that is undone
        if not kept:
            with torch.no_grad():
                for p, v in zip(params.values(), saved, strict=True):
                    p.copy_(v)
    finally:
        for p, flag in flags.items():
            p.requires_grad_(flag)
            p.grad = None
        teacher.train(teacher_was)
        student.train(student_was)
    return TuningResult(steps, sum(p.numel() for p in params.values()), before, after, kept, time.perf_counter() - t0,
                        config.steps)
