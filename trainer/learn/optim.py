"""AdamW on fp32 master weights, the learning-rate schedule and gradient clipping.

The schedule is a pure function of the step (:func:`lr_factor`), so a resumed run gets exactly the
learning rate it would have had without the restart (the scheduler's state is the step count).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from deltarl.trainer.settings import OptimizerSettings

__all__ = ["build_optimizer", "clip_gradients", "lr_factor"]


def lr_factor(step: int, settings: OptimizerSettings, max_steps: int) -> float:
    """Multiplier of ``settings.lr`` for optimizer step ``step`` (0-based).

    Linear warm-up over ``warmup_steps`` (step 0 gets ``1 / warmup_steps``, never 0, so the first
    step is not wasted), then ``constant``, or ``linear`` / ``cosine`` decay from 1 to
    ``min_lr_ratio`` at ``max_steps``.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    warm = settings.warmup_steps
    if step < warm:
        return (step + 1) / warm
    if settings.schedule == "constant":
        return 1.0
    span = max(max_steps - warm, 1)
    progress = min((step - warm) / span, 1.0)
    floor = settings.min_lr_ratio
    if settings.schedule == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    params: Iterable[torch.nn.Parameter], settings: OptimizerSettings, max_steps: int
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``params`` (keep them fp32: they are the master weights) and its schedule.

    Call ``scheduler.step()`` after each ``optimizer.step()``.
    """
    params = list(params)
    low = [p for p in params if p.dtype != torch.float32]
    if low:
        raise ValueError(
            f"{len(low)} parameter(s) are {low[0].dtype}, not float32: keep fp32 master weights "
            "and compute in bf16 with autocast"
        )
    opt = torch.optim.AdamW(
        params,
        lr=settings.lr,
        betas=settings.betas,
        eps=settings.eps,
        weight_decay=settings.weight_decay,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, settings, max_steps))
    return opt, sched


def clip_gradients(params: Iterable[torch.nn.Parameter], settings: OptimizerSettings) -> float:
    """Clip the global L2 norm of the gradients to ``grad_clip`` (if set); return the norm
    before clipping (``inf``/``nan`` when a gradient is not finite: skip that step)."""
    max_norm = settings.grad_clip if settings.grad_clip is not None else math.inf
    norm = torch.nn.utils.clip_grad_norm_(list(params), max_norm)
    if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor, the norm over every rank's shards
        norm = norm.full_tensor()
    return float(norm)
