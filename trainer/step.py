"""One optimizer step on a collated batch: micro-batches, gradient accumulation, clipping.

The model is any ``torch.nn.Module`` called as ``model(input_ids=[B, T] int64,
attention_mask=[B, T] bool)`` that returns causal-LM logits ``[B, T, V]`` (position ``t``
predicts token ``t + 1``), either as a tensor or as an object with ``.logits`` (Hugging Face
models). Its parameters are the fp32 master weights; with ``precision="bf16"`` the forward and
backward run under ``torch.autocast`` in bf16.

Order inside :func:`train_step`: zero the gradients; for each micro-batch: forward, per-token
logprobs, :func:`~.loss.grpo_loss` with the *whole step's* normaliser, backward; clip the global
gradient norm; if it is finite, ``optimizer.step()`` then ``scheduler.step()``, else skip the
update (counted in ``step/skipped``). The weights change only in ``optimizer.step()``, so the
caller publishes right after this function returns.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

import torch
from torch import Tensor

from .batch import TrainBatch, batch_metrics, micro_batches
from .loss import LossStats, advantage_metrics, grpo_loss, token_logprobs
from .optim import clip_gradients
from .settings import ExperimentSettings

__all__ = ["forward_logits", "step_normalizer", "train_step"]


def forward_logits(model: torch.nn.Module, tokens: Tensor, attention_mask: Tensor) -> Tensor:
    """``[B, T, V]`` logits of ``model`` for ``tokens`` (see the module docstring)."""
    out: Any = model(input_ids=tokens, attention_mask=attention_mask)
    logits = out.logits if hasattr(out, "logits") else out
    if not isinstance(logits, Tensor) or logits.dim() != 3 or logits.shape[:2] != tokens.shape:
        raise ValueError(
            "the model must return [B, T, V] logits (or an object with .logits) for [B, T] "
            f"input_ids; got {type(logits).__name__} {getattr(logits, 'shape', '')}"
        )
    return logits


def step_normalizer(batch: TrainBatch, settings: ExperimentSettings) -> float:
    """Denominator of the loss for the whole step (see ``grpo_loss(normalizer=...)``)."""
    agg = settings.loss.aggregation
    if agg == "token_mean":
        return float(max(batch.num_tokens, 1))
    if agg == "sequence_mean":
        return float(max(len(batch), 1))
    return settings.loss.sum_normalizer


def _autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _on(device: torch.device, t: Tensor) -> Tensor:
    return t.to(device, non_blocking=True)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: TrainBatch,
    settings: ExperimentSettings,
    *,
    ref_model: torch.nn.Module | None = None,
    entropy: bool = True,
) -> dict[str, float]:
    """Train on ``batch`` for one optimizer step; return the step's metrics (floats).

    ``ref_model``: the frozen reference policy, required when ``settings.loss.kl_coef > 0``.
    ``entropy``: also compute the policy entropy metric (one extra pass over the logits).
    Metrics: every :class:`~.loss.LossStats` entry, ``advantage_metrics``, ``batch_metrics``,
    ``step/grad_norm``, ``step/lr`` (the lr this step used), ``step/skipped`` (1 when the
    gradient was not finite), ``time/compute_s`` and ``step/tokens_per_s``.
    """
    if settings.loss.kl_coef > 0 and ref_model is None:
        raise ValueError("loss.kl_coef > 0 needs ref_model (the frozen reference policy)")
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    model.train()
    optimizer.zero_grad(set_to_none=True)
    normalizer = step_normalizer(batch, settings)
    stats = LossStats()
    for part in micro_batches(batch, settings.batch.micro_batch_size):
        tokens, attn = _on(device, part.tokens), _on(device, part.attention_mask)
        with _autocast(device, settings.precision):
            logits = forward_logits(model, tokens, attn)
            ref_lp = None
            if ref_model is not None:
                with torch.no_grad():
                    ref_lp = token_logprobs(forward_logits(ref_model, tokens, attn), tokens)
        out = grpo_loss(
            token_logprobs(logits, tokens),
            _on(device, part.behaviour_logprobs),
            _on(device, part.advantages),
            _on(device, part.loss_mask),
            settings.loss,
            ref_logprobs=ref_lp,
            logits=logits.detach() if entropy else None,
            normalizer=normalizer,
        )
        out.loss.backward()
        stats = stats.merge(out.stats)
        del logits, out
    lr = optimizer.param_groups[0]["lr"]
    grad_norm = clip_gradients(model.parameters(), settings.optimizer)
    skipped = not math.isfinite(grad_norm)
    if skipped:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
        scheduler.step()
    elapsed = time.perf_counter() - t0
    metrics = stats.summary()
    metrics.update(advantage_metrics(batch.rewards, batch.group_index, batch.advantages))
    metrics.update(batch_metrics(batch))
    metrics.update(
        {
            "step/grad_norm": grad_norm,
            "step/lr": float(lr),
            "step/skipped": float(skipped),
            "time/compute_s": elapsed,
            "step/tokens_per_s": float(batch.attention_mask.sum()) / max(elapsed, 1e-9),
        }
    )
    return metrics
