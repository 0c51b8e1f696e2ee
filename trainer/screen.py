"""What the trainer checks before it trains on a group, so that no group can stop it.

The coordinator checks every group where it enters (:mod:`deltarl.services.coordinator.
schemas.trajectories`: the wire's bounds, and the :class:`ModelLimits` the trainer registers
with its versions). The trainer checks again, since a coordinator may be older than these checks
or run without the model's limits, and whatever it still cannot use is *refused*, never raised:

1. a payload that did not decode (:attr:`LeasedBatch.refused`, reason ``bad_payload``);
2. :func:`screen`: a group outside the model's limits (``bad_token_id``, ``too_long``);
3. :func:`collate_checked`: a group that fails collation (``collate_failed``);
4. in the step, a group whose on-policy logprobs do not match the weights it claims
   (``sampling_mismatch``, :func:`~deltarl.trainer.learn.step.mismatched_groups`).

Refused groups are named when their batch is acked (:class:`Refusals`): the coordinator keeps
them as dead letters and counts them against their worker. A failure these checks do not foresee
still raises; its lease then expires, and the coordinator sets the group aside after its second
delivery, so a restarted trainer does not fail on it again and again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from deltarl.services.common.moe_routing import UnsupportedRoutingError, routers
from deltarl.services.coordinator.schemas import (
    GroupRejection,
    ModelLimits,
    RoutingShape,
    TrajectoryGroup,
    check_model_limits,
)
from deltarl.services.coordinator.schemas.batches import MAX_DETAIL
from deltarl.services.coordinator.schemas.trajectories import (
    MAX_TOKENS_PER_TRAJECTORY,
    MAX_VOCAB_SIZE,
    OutsideLimitsError,
)
from deltarl.trainer.learn.batch import TrainBatch

logger = logging.getLogger(__name__)

__all__ = [
    "LeasedGroup",
    "Refusals",
    "collate_checked",
    "model_limits",
    "screen",
]


@dataclass(frozen=True, slots=True)
class LeasedGroup:
    """A group as the trainer holds it: which lease and submission it came from, and whose."""

    batch_id: str
    submission_id: int
    worker_id: str
    group: TrajectoryGroup


@dataclass(slots=True)
class Refusals:
    """The groups refused in one step, by the batch whose ack will name them."""

    by_batch: dict[str, list[GroupRejection]] = field(default_factory=dict)
    by_reason: dict[str, int] = field(default_factory=dict)

    def add(self, batch_id: str, submission_id: int, reason: str, detail: str) -> None:
        self.by_batch.setdefault(batch_id, []).append(
            GroupRejection(submission_id=submission_id, reason=reason, detail=detail[:MAX_DETAIL])
        )
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1

    def refuse(self, entry: LeasedGroup, reason: str, detail: str) -> None:
        logger.warning(
            "refusing group %s (submission %d) of worker %s: %s: %s",
            entry.group.group_id,
            entry.submission_id,
            entry.worker_id,
            reason,
            detail,
        )
        self.add(entry.batch_id, entry.submission_id, reason, detail)

    def __len__(self) -> int:
        return sum(self.by_reason.values())

    def metrics(self) -> dict[str, float]:
        out = {"batch/rejected_groups": float(len(self))}
        out.update({f"batch/rejected/{k}": float(v) for k, v in sorted(self.by_reason.items())})
        return out


def model_limits(model: torch.nn.Module) -> ModelLimits | None:
    """The token ids and lengths ``model`` takes: the vocabulary is the smaller of its input
    embedding's and its logits' rows (a token id indexes the first, a teacher's top-k id the
    second); the length is bounded only for learned absolute positions (:func:`_max_tokens`). Works
    on FSDP2-sharded models (a DTensor's shape is the whole tensor's). None when no embedding
    is found (a model that is not a language model: nothing to bound)."""
    rows = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        fn = getattr(model, getter, None)
        module = fn() if callable(fn) else None
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            rows.append(int(weight.shape[0]))
    if not rows:
        rows = [m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)][:1]
    if not rows:
        return None
    return ModelLimits(
        vocab_size=min(min(rows), MAX_VOCAB_SIZE),
        max_tokens=_max_tokens(model),
        routing=routing_shape(model),
    )


def routing_shape(model: torch.nn.Module) -> RoutingShape | None:
    """The MoE routing a routing record must fit (:mod:`~deltarl.services.common.moe_routing`);
    None for a dense model or a router that routing replay does not support."""
    try:
        found = routers(model)
    except UnsupportedRoutingError:
        return None
    if not found:
        return None
    first: Any = found[0]
    return RoutingShape(layers=len(found), top_k=int(first.top_k), experts=int(first.num_experts))


def _max_tokens(model: torch.nn.Module) -> int | None:
    """``config.max_position_embeddings`` for a model with learned absolute positions (an
    embedding of that many rows: a longer sequence indexes past it); None for rotary models,
    which take longer sequences (a position scaling may extend them) without failing."""
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not isinstance(positions, int) or positions <= 0:
        return None
    get_tokens = getattr(model, "get_input_embeddings", None)
    tokens = get_tokens() if callable(get_tokens) else None
    learned = any(
        isinstance(m, torch.nn.Embedding) and m.num_embeddings == positions and m is not tokens
        for m in model.modules()
    )
    return min(positions, MAX_TOKENS_PER_TRAJECTORY) if learned else None


def screen(
    entries: Sequence[LeasedGroup], limits: ModelLimits | None, refusals: Refusals
) -> list[LeasedGroup]:
    """The groups within ``limits``; the others are refused (``bad_token_id``, ``too_long``)."""
    if limits is None:
        return list(entries)
    kept = []
    for entry in entries:
        try:
            check_model_limits(entry.group, limits)
        except OutsideLimitsError as exc:
            refusals.refuse(entry, exc.reason, str(exc))
            continue
        kept.append(entry)
    return kept


def collate_checked(
    entries: Sequence[LeasedGroup],
    collate: Callable[[Sequence[TrajectoryGroup]], TrainBatch],
    refusals: Refusals,
) -> tuple[TrainBatch | None, list[LeasedGroup]]:
    """``collate`` of every group at once; if that raises, each group alone, refusing the ones
    that fail (``collate_failed``) and collating the rest. Returns the batch (None: no group
    left) and the groups in it, in batch order."""
    if not entries:
        return None, []
    try:
        return collate([e.group for e in entries]), list(entries)
    except Exception:  # found group by group below
        logger.warning("collating %d groups failed; trying each alone", len(entries))
    kept = []
    for entry in entries:
        try:
            collate([entry.group])
        except Exception as exc:  # any failure refuses the group, with its text
            refusals.refuse(entry, "collate_failed", f"{type(exc).__name__}: {exc}")
            continue
        kept.append(entry)
    if not kept:
        return None, []
    return collate([e.group for e in kept]), kept
