"""One optimizer step on a collated batch: micro-batches, gradient accumulation, clipping.

The model is any ``torch.nn.Module`` called as ``model(input_ids=[B, T] int64,
attention_mask=[B, T] bool)`` that returns causal-LM logits ``[B, T, V]`` (position ``t``
predicts token ``t + 1``), either as a tensor or as an object with ``.logits`` (Hugging Face
models). Its parameters are the fp32 master weights; with ``precision="bf16"`` the forward and
backward run under ``torch.autocast`` in bf16.

Order inside :func:`train_step`: zero the gradients; for each micro-batch (at most
``batch.micro_batch_size`` sequences and ``batch.micro_batch_tokens`` padded tokens): forward,
per-token logprobs, :func:`~deltarl.trainer.learn.loss.grpo_loss` with the *whole step's* normaliser, backward; clip
the global gradient norm; if it is finite, ``optimizer.step()`` then ``scheduler.step()``, else
skip the update (counted in ``step/skipped``). The weights change only in ``optimizer.step()``, so
the caller publishes right after this function returns.

Before the update, each group's on-policy tokens (sampled by the very weights being trained) are
checked against the trainer's logprobs (:func:`mismatched_groups`): a group whose mismatch KL
exceeds ``sampling.max_onpolicy_mismatch_kl`` was not sampled by these weights as it claims (a
worker serving other weights, another temperature or tokenizer, or made-up logprobs). Such
groups are dropped: the gradients are zeroed and the step is computed again without them (only
when some group fails, so an honest step costs nothing more), and the caller learns which they
were, to refuse them to the coordinator. One bad group never stops training.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

from deltarl.services.common.moe_routing import replay_routing
from deltarl.trainer.learn.batch import TrainBatch, batch_metrics, without_groups
from deltarl.trainer.learn.distill import jsd_loss, teacher_advantages, teacher_stats
from deltarl.trainer.learn.distributed import (
    DistContext,
    gather_stats,
    rank_micro_batches,
    sum_over_ranks,
)
from deltarl.trainer.learn.loss import LossStats, advantage_metrics, grpo_loss, token_logprobs
from deltarl.trainer.learn.optim import clip_gradients
from deltarl.trainer.settings import ExperimentSettings

logger = logging.getLogger(__name__)

__all__ = [
    "GroupMismatch",
    "SamplingMismatchError",
    "check_reference",
    "forward_logits",
    "frozen_reference",
    "mismatched_groups",
    "step_normalizer",
    "train_step",
]


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


def frozen_reference(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` made the frozen reference policy of ``loss.kl_coef`` (in place): eval mode (no
    dropout) and no gradients. Returns ``model``."""
    model.eval()
    model.requires_grad_(False)
    return model


def check_reference(
    settings: ExperimentSettings, model: torch.nn.Module, ref_model: torch.nn.Module | None
) -> None:
    """Refuse at start (before the first version is published, not at the first step) a
    reference policy that :func:`train_step` cannot use: none while ``loss.kl_coef > 0``, one
    with trainable parameters (e.g. the policy itself: its KL would always be 0), or one on
    another device than the policy."""
    if ref_model is None:
        if settings.loss.kl_coef > 0:
            raise ValueError(
                f"loss.kl_coef = {settings.loss.kl_coef} needs ref_model (the frozen reference "
                "policy; `deltarl train` builds it from the starting model): pass one, or set "
                "loss.kl_coef = 0"
            )
        return
    if any(p.requires_grad for p in ref_model.parameters()):
        raise ValueError(
            "ref_model has trainable parameters: the reference policy must be a frozen copy of "
            "the starting model (frozen_reference), not the policy being trained"
        )
    ref_dev = next((p.device for p in ref_model.parameters()), None)
    dev = next((p.device for p in model.parameters()), None)
    if ref_dev is not None and dev is not None and ref_dev != dev:
        raise ValueError(f"ref_model is on {ref_dev}, the policy on {dev}: put both on one device")


def step_normalizer(batch: TrainBatch, settings: ExperimentSettings) -> float:
    """Denominator of the loss for the whole step (see ``grpo_loss(normalizer=...)``)."""
    agg = settings.loss.aggregation
    if agg == "token_mean":
        return float(max(batch.num_tokens, 1))
    if agg == "sequence_mean":
        return float(max(len(batch), 1))
    return settings.loss.sum_normalizer


class SamplingMismatchError(ValueError):
    """On-policy logprobs disagree with the trainer's beyond engine numerics for every worker
    of a step: the trainer, not one worker, is likely misconfigured (raised by the loop)."""


MISMATCH_HINT = (
    "set sampling.temperature to the workers' temperature, keep their top_p = 1 and top_k = 0, "
    "and check that they serve this model and tokenizer"
)


@dataclass(slots=True)
class GroupMismatch:
    """Per batch group: the summed mismatch KL (k3) of its on-policy tokens and their count."""

    kl_sum: Tensor  # [G] float64
    tokens: Tensor  # [G] float64

    @classmethod
    def zeros(cls, groups: int) -> GroupMismatch:
        return cls(
            torch.zeros(groups, dtype=torch.float64), torch.zeros(groups, dtype=torch.float64)
        )

    def add(self, group_index: Tensor, kl_sum: Tensor, tokens: Tensor) -> None:
        self.kl_sum.index_add_(0, group_index.cpu(), kl_sum.detach().double().cpu())
        self.tokens.index_add_(0, group_index.cpu(), tokens.detach().double().cpu())

    def mean(self) -> Tensor:
        """[G] mean KL per on-policy token (0 for a group without on-policy tokens)."""
        return self.kl_sum / self.tokens.clamp(min=1.0)


def mismatched_groups(mismatch: GroupMismatch, settings: ExperimentSettings) -> list[int]:
    """Batch groups whose on-policy tokens' mean mismatch KL exceeds
    ``sampling.max_onpolicy_mismatch_kl`` (none when it is None); warns when the step's
    on-policy tokens as a whole come within a fifth of the limit.

    Tokens sampled by the very weights being trained differ from the trainer's logprobs only by
    engine numerics (~1e-3 nats); far more means the group was sampled from another
    distribution than it claims. Training on it would use wrong importance ratios silently.
    """
    limit = settings.sampling.max_onpolicy_mismatch_kl
    tokens = float(mismatch.tokens.sum())
    if limit is None or not tokens:
        return []
    kl = float(mismatch.kl_sum.sum()) / tokens
    if kl > limit / 5:
        logger.warning(
            "on-policy mismatch KL %.4f nats/token over %d tokens (groups refused above %s): "
            "is sampling.temperature (%s) the workers' temperature?",
            kl,
            int(tokens),
            limit,
            settings.sampling.temperature,
        )
    bad = (mismatch.tokens > 0) & (mismatch.mean() > limit)
    return [int(g) for g in torch.nonzero(bad).flatten()]


def _autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _on(device: torch.device, t: Tensor) -> Tensor:
    return t.to(device, non_blocking=True)


def _micro_step(
    model: torch.nn.Module,
    part: TrainBatch,
    settings: ExperimentSettings,
    normalizer: float,
    scale: float,
    ref_model: torch.nn.Module | None,
    entropy: bool,
    mismatch: GroupMismatch,
) -> LossStats:
    """Forward and backward of one micro-batch; returns its statistics and adds its groups'
    on-policy mismatch to ``mismatch``."""
    device = next(model.parameters()).device
    # each trajectory's own sampling temperature where its worker reported one
    temp_arg: float | torch.Tensor = (
        settings.sampling.temperature
        if part.temperature is None
        else part.temperatures(settings.sampling.temperature)
    )
    tokens, attn = _on(device, part.tokens), _on(device, part.attention_mask)
    behaviour, mask = _on(device, part.behaviour_logprobs), _on(device, part.loss_mask)
    replay = settings.sampling.routing_replay and part.routing is not None
    routing = _on(device, part.routing) if replay else None  # type: ignore[arg-type]
    with _autocast(device, settings.precision), replay_routing(model, routing):
        logits = forward_logits(model, tokens, attn)
        ref_lp = None
        if ref_model is not None:
            with torch.no_grad():
                ref_logits = forward_logits(ref_model, tokens, attn)
                ref_lp = token_logprobs(ref_logits, tokens, temperature=temp_arg)
            if isinstance(ref_model, FSDPModule):  # no backward follows to free its root's
                ref_model.reshard()  # gathered weights (embeddings, head): free them now
    logprobs = token_logprobs(logits, tokens, temperature=temp_arg)
    advantages = _on(device, part.advantages)
    mode = settings.loss.distill
    teacher = part.teacher.to(device) if part.teacher is not None and mode != "none" else None
    distill_stats = LossStats()
    if teacher is not None:
        teacher_stats(teacher, logprobs, mask, distill_stats)
        if mode == "teacher_advantage":
            advantages = teacher_advantages(
                advantages, teacher, logprobs, mask, settings.loss.teacher_tau
            )
    out = grpo_loss(
        logprobs,
        behaviour,
        advantages,
        mask,
        settings.loss,
        ref_logprobs=ref_lp,
        logits=logits.detach() if entropy else None,
        normalizer=normalizer,
        temperature=temp_arg,
    )
    loss = out.loss
    if teacher is not None and mode == "jsd" and settings.loss.distill_coef > 0:
        with _autocast(device, settings.precision):
            jsd = jsd_loss(
                logits,
                teacher,
                mask,
                beta=settings.loss.distill_beta,
                temperature=temp_arg,
                normalizer=normalizer,
                stats=distill_stats,
            )
        loss = loss + settings.loss.distill_coef * jsd
    if part.hint is not None and settings.loss.hint_coef > 0:
        hint = part.hint.to(device)
        with _autocast(device, settings.precision):
            hinted = jsd_loss(
                logits,
                hint,
                mask,
                beta=settings.loss.hint_beta,
                temperature=temp_arg,
                normalizer=normalizer,
                stats=distill_stats,
                prefix="hint/",
            )
        loss = loss + settings.loss.hint_coef * hinted
    (loss * scale if scale != 1.0 else loss).backward()
    stats = out.stats.merge(distill_stats)
    with torch.no_grad():  # tokens sampled by exactly these weights: only numerics differ
        onpolicy = mask.bool() & (_on(device, part.staleness) == 0)[:, None]
        d = torch.where(onpolicy, logprobs.detach() - behaviour.float(), 0.0)
        k3 = torch.exp(d) - d - 1.0  # 0 where d = 0: off-policy tokens add nothing
        stats.add_values("mismatch/kl_onpolicy", k3[onpolicy])
        mismatch.add(part.group_index, k3.sum(-1), onpolicy.sum(-1))
    return stats


def _accumulate(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    settings: ExperimentSettings,
    ref_model: torch.nn.Module | None,
    entropy: bool,
    ctx: DistContext,
) -> tuple[LossStats, GroupMismatch]:
    """Zero the gradients, then forward and backward every micro-batch of this rank's share
    of ``batch``; returns the whole batch's statistics and per-group mismatch (every rank's)."""
    optimizer.zero_grad(set_to_none=True)
    normalizer = step_normalizer(batch, settings)
    # DDP and FSDP2 average gradients over ranks: scale by the world size to keep the whole
    # step's sum
    scale = float(ctx.world_size)
    size, max_tokens = settings.batch.micro_batch_size, settings.batch.micro_batch_tokens
    parts = rank_micro_batches(batch, ctx, size, max_tokens)  # as many on every rank
    stats = LossStats()
    mismatch = GroupMismatch.zeros(int(batch.group_index.max()) + 1 if len(batch) else 0)
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        sync = model.no_sync() if isinstance(model, DDP) and not last else contextlib.nullcontext()
        if isinstance(model, FSDPModule):  # reduce-scatter the gradients once, at the end
            model.set_requires_gradient_sync(last)
        with sync:
            part_stats = _micro_step(
                model, part.batch, settings, normalizer, scale, ref_model, entropy, mismatch
            )
        if not part.filler:
            stats = stats.merge(part_stats)
    stats = gather_stats(stats, ctx)
    mismatch = GroupMismatch(
        sum_over_ranks(mismatch.kl_sum, ctx), sum_over_ranks(mismatch.tokens, ctx)
    )
    return stats, mismatch


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: TrainBatch,
    settings: ExperimentSettings,
    *,
    ref_model: torch.nn.Module | None = None,
    entropy: bool = True,
    dist: DistContext | None = None,
    dropped: dict[int, float] | None = None,
) -> dict[str, float]:
    """Train on ``batch`` for one optimizer step; return the step's metrics (floats).

    ``ref_model``: the frozen reference policy (:func:`frozen_reference`), required when
    ``settings.loss.kl_coef > 0``; its logprobs give the ``kl_ref`` metric whenever it is given.
    ``entropy``: also compute the policy entropy metric (one extra pass over the logits).
    ``dist``: with several ranks (:mod:`deltarl.trainer.learn.distributed`), ``model`` is wrapped in DDP, every rank
    gets the whole ``batch`` and trains on its share of the rows in as many micro-batches as
    every other rank (:func:`~deltarl.trainer.learn.distributed.rank_micro_batches`); the metrics are those of the
    whole batch on every rank.
    ``dropped``: the batch groups refused for their on-policy mismatch (see the module
    docstring) are added to it, each with its mean mismatch KL; the step trains on the others (``batch/rejected_mismatch``
    counts them; with none left, no update: ``step/skipped`` is 1).
    Metrics: every :class:`~deltarl.trainer.learn.loss.LossStats` entry, ``advantage_metrics``, ``batch_metrics``,
    ``step/grad_norm``, ``step/lr`` (the lr this step used), ``step/skipped`` (1 when the
    gradient was not finite), ``time/compute_s`` and ``step/tokens_per_s``.
    """
    if settings.loss.kl_coef > 0 and ref_model is None:
        raise ValueError("loss.kl_coef > 0 needs ref_model (the frozen reference policy)")
    t0 = time.perf_counter()
    model.train()
    ctx = dist if dist is not None else DistContext()
    stats, mismatch = _accumulate(model, optimizer, batch, settings, ref_model, entropy, ctx)
    bad = mismatched_groups(mismatch, settings)
    if bad:
        logger.warning(
            "dropping %d of %d groups whose on-policy logprobs do not match these weights "
            "(mean mismatch KL %s > sampling.max_onpolicy_mismatch_kl = %s); computing the "
            "step again without them",
            len(bad),
            len(mismatch.tokens),
            ", ".join(f"{float(mismatch.mean()[g]):.3g}" for g in bad[:8]),
            settings.sampling.max_onpolicy_mismatch_kl,
        )
        if dropped is not None:
            dropped.update({g: float(mismatch.mean()[g]) for g in bad})
        batch = without_groups(batch, bad)
        if len(batch):
            stats, _ = _accumulate(model, optimizer, batch, settings, ref_model, entropy, ctx)
        else:  # nothing left: no update
            optimizer.zero_grad(set_to_none=True)
            stats = LossStats()
    lr = optimizer.param_groups[0]["lr"]
    grad_norm = clip_gradients(model.parameters(), settings.optimizer) if len(batch) else 0.0
    skipped = not len(batch) or not math.isfinite(grad_norm)
    if skipped:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
        scheduler.step()
    elapsed = time.perf_counter() - t0
    metrics = stats.summary()
    if len(batch):
        metrics.update(
            advantage_metrics(batch.rewards, batch.group_index, batch.advantages, batch.loss_mask)
        )
    metrics.update(batch_metrics(batch))
    if settings.sampling.routing_replay and "batch/routed_trajectories" in metrics:
        # trained with the recorded experts (the others routed by the trainer's own router)
        metrics["routing/replayed_trajectories"] = metrics["batch/routed_trajectories"]
    metrics["batch/rejected_mismatch"] = float(len(bad))
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
