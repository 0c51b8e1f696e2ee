"""From leased trajectory groups to padded training tensors and micro-batches.

Order per optimizer step: :func:`filter_stale` (drop groups whose oldest token is too many
versions behind the weights being trained, and count them), :func:`collate` (pad, align, compute
group-normalised advantages over whole groups), then :func:`micro_batches` (split by sequences
and optionally by padded tokens, independent of how workers grouped their generation). The
number of trained tokens of the whole step (:attr:`TrainBatch.num_tokens`) is the
``normalizer`` to give :func:`~.loss.grpo_loss` for each micro-batch, so that accumulated
gradients equal those of the whole step.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from deltarl.services.coordinator.schemas import TeacherLogprobs, Trajectory, TrajectoryGroup
from deltarl.trainer.learn.distill import TeacherBatch
from deltarl.trainer.learn.loss import group_advantages
from deltarl.trainer.settings import AdvantageScale, CreditMode

__all__ = [
    "StaleFilter",
    "TrainBatch",
    "batch_metrics",
    "collate",
    "filler",
    "filter_stale",
    "micro_batch_spans",
    "micro_batches",
    "sequence_lengths",
    "split_spans",
    "turn_advantages",
    "without_groups",
]


@dataclass(frozen=True, slots=True)
class StaleFilter:
    """Result of :func:`filter_stale`: what is kept and what was dropped (for the metrics)."""

    kept: list[TrajectoryGroup]
    dropped_groups: int
    dropped_trajectories: int


def filter_stale(
    groups: Sequence[TrajectoryGroup], policy_version: int | None, max_staleness: int | None
) -> StaleFilter:
    """Keep the groups whose ``version_min`` is at most ``max_staleness`` versions behind
    ``policy_version`` (the version of the weights being trained). Whole groups are kept or
    dropped, so advantages are always computed over complete groups. ``None`` for either
    argument keeps everything."""
    if max_staleness is None or policy_version is None:
        return StaleFilter(list(groups), 0, 0)
    kept = [g for g in groups if policy_version - g.version_min <= max_staleness]
    dropped = [g for g in groups if policy_version - g.version_min > max_staleness]
    return StaleFilter(kept, len(dropped), sum(len(g.trajectories) for g in dropped))


@dataclass(frozen=True, slots=True)
class TrainBatch:
    """``B`` trajectories padded on the right to ``T`` tokens (per-token tensors aligned with
    ``tokens``, as :mod:`.loss` expects).

    Example: ``collate(groups, policy_version=12)`` on 2 groups of 8 gives ``B = 16``.
    """

    tokens: Tensor  # [B, T] int64 token ids, pad_id after the end
    attention_mask: Tensor  # [B, T] bool: real tokens
    loss_mask: Tensor  # [B, T] bool: tokens sampled from the policy (trained on)
    behaviour_logprobs: Tensor  # [B, T] float32 nats, 0 outside loss_mask
    advantages: Tensor  # [B] float32, group-normalised; [B, T] per token with per-turn credit
    rewards: Tensor  # [B] float32
    signals: dict[str, Tensor]  # name -> [B] float32, NaN where a trajectory lacks the signal
    group_index: Tensor  # [B] int64: index of the trajectory's group in this batch
    staleness: Tensor  # [B] int64: policy_version - version_min (0 without a policy version)
    temperature: Tensor | None = None  # [B] float32 sampling temperature, NaN: not reported
    teacher: TeacherBatch | None = None  # a teacher's top-k at trained positions, if any
    hint: TeacherBatch | None = None  # hinted self-distillation targets (one turn), if any
    turn_credit: Tensor | None = None  # [B] bool: credited per turn (None: episode credit)
    # [B, T, moe layers, top_k] int64 experts of each position where it was sampled, -1 where
    # not recorded (routing replay); None: no trajectory carries a record
    routing: Tensor | None = None

    def temperatures(self, default: float) -> Tensor:
        """[B] float32: each trajectory's reported sampling temperature, ``default`` where
        none was reported."""
        if self.temperature is None:
            return torch.full((len(self),), float(default), dtype=torch.float32)
        return torch.nan_to_num(self.temperature, nan=float(default))

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_tokens(self) -> int:
        """Trained tokens (loss-mask ones) in the batch."""
        return int(self.loss_mask.sum())

    def select(self, rows: slice | Tensor) -> TrainBatch:
        """The trajectories in ``rows`` (a slice, or a [B] bool tensor), with padding trimmed
        to their longest sequence."""
        picked = self.attention_mask[rows]
        width = int(picked.sum(-1).max()) if picked.shape[0] else 0
        return TrainBatch(
            tokens=self.tokens[rows, :width],
            attention_mask=self.attention_mask[rows, :width],
            loss_mask=self.loss_mask[rows, :width],
            behaviour_logprobs=self.behaviour_logprobs[rows, :width],
            advantages=self.advantages[rows]
            if self.advantages.dim() == 1
            else self.advantages[rows, :width],
            rewards=self.rewards[rows],
            signals={k: v[rows] for k, v in self.signals.items()},
            group_index=self.group_index[rows],
            staleness=self.staleness[rows],
            temperature=None if self.temperature is None else self.temperature[rows],
            teacher=None if self.teacher is None else self.teacher.select(rows, width),
            hint=None if self.hint is None else self.hint.select(rows, width),
            turn_credit=None if self.turn_credit is None else self.turn_credit[rows],
            routing=None if self.routing is None else self.routing[rows, :width],
        )


def without_groups(batch: TrainBatch, groups: Sequence[int]) -> TrainBatch:
    """``batch`` without the trajectories of the batch groups ``groups`` (indices into
    ``group_index``), the rest renumbered ``0..`` in order. Advantages are not recomputed: they
    were normalised within each group, and every group left is whole."""
    drop = torch.isin(batch.group_index, torch.tensor(list(groups), dtype=torch.int64))
    kept = batch.select(~drop)
    if not len(kept):
        return kept
    return replace(kept, group_index=torch.unique(kept.group_index, return_inverse=True)[1])


def collate(
    groups: Sequence[TrajectoryGroup],
    policy_version: int | None = None,
    *,
    scale: AdvantageScale = "group",
    eps: float = 1e-4,
    pad_id: int = 0,
    credit: CreditMode = "episode",
) -> TrainBatch:
    """Pad the trajectories of ``groups`` into one :class:`TrainBatch` (CPU tensors).

    Advantages are normalised within each group (:func:`~.loss.group_advantages`): one per
    trajectory, or with ``credit="turn"`` one per turn (:func:`turn_advantages`, [B, T]).
    Trajectories keep their group order. ``ValueError`` if there is nothing to train on.
    """
    trajs = [(gi, t) for gi, g in enumerate(groups) for t in g.trajectories]
    if not trajs:
        raise ValueError("no trajectories to collate")
    b, width = len(trajs), max(len(t.tokens) for _, t in trajs)
    tokens = torch.full((b, width), pad_id, dtype=torch.int64)
    attention = torch.zeros((b, width), dtype=torch.bool)
    loss_mask = torch.zeros((b, width), dtype=torch.bool)
    logprobs = torch.zeros((b, width), dtype=torch.float32)
    names = sorted({k for _, t in trajs for k in t.signals})
    signals = {k: torch.full((b,), math.nan, dtype=torch.float32) for k in names}
    for i, (_, t) in enumerate(trajs):
        n = len(t.tokens)
        tokens[i, :n] = torch.tensor(t.tokens, dtype=torch.int64)
        attention[i, :n] = True
        m = torch.tensor(t.mask, dtype=torch.bool)
        loss_mask[i, :n] = m
        logprobs[i, :n] = torch.where(m, torch.tensor(t.logprobs, dtype=torch.float32), 0.0)
        for k, v in t.signals.items():
            signals[k][i] = v
    rewards = torch.tensor([t.reward for _, t in trajs], dtype=torch.float32)
    group_index = torch.tensor([gi for gi, _ in trajs], dtype=torch.int64)
    staleness = torch.tensor(
        [0 if policy_version is None else policy_version - t.version_min for _, t in trajs],
        dtype=torch.int64,
    )
    reported = [t.temperature for _, t in trajs]
    temperature = (
        torch.tensor([math.nan if v is None else v for v in reported], dtype=torch.float32)
        if any(v is not None for v in reported)
        else None
    )
    advantages = group_advantages(rewards, group_index, scale=scale, eps=eps)
    turn_credit = None
    if credit == "turn":
        advantages, turn_credit = turn_advantages(
            [t for _, t in trajs], group_index, loss_mask, advantages, scale=scale, eps=eps
        )
    elif credit != "episode":
        raise ValueError(f"credit must be 'episode' or 'turn', got {credit!r}")
    return TrainBatch(
        routing=_collate_routing([t for _, t in trajs], width),
        teacher=_collate_teacher([t.teacher for _, t in trajs], [t for _, t in trajs], width),
        hint=_collate_teacher([t.hint for _, t in trajs], [t for _, t in trajs], width),
        tokens=tokens,
        attention_mask=attention,
        loss_mask=loss_mask,
        behaviour_logprobs=logprobs,
        advantages=advantages,
        turn_credit=turn_credit,
        rewards=rewards,
        signals=signals,
        group_index=group_index,
        staleness=staleness,
        temperature=temperature,
    )


def turn_advantages(
    trajs: Sequence[Trajectory],
    group_index: Tensor,
    loss_mask: Tensor,
    episode: Tensor,
    *,
    scale: AdvantageScale = "group",
    eps: float = 1e-4,
) -> tuple[Tensor, Tensor]:
    """Per-turn credit: ([B, T] per-token advantages, [B] bool credited per turn), ``loss_mask``
    the batch's [B, T] trained tokens.

    Turn ``k`` of an episode (its tokens up to ``turn_ends[k]``) is worth its return to go,
    ``G_k = r_k + r_{k+1} + ...`` (the rewards of that turn and every later one), and its
    advantage is ``G_k`` normalised among the episodes of the same group that reached turn
    ``k`` (:func:`~.loss.group_advantages` with ``(group, k)`` as the group): a move is judged
    against the other episodes' moves at the same point of the game, on what followed it.
    A turn that only one episode of its group reached gets 0, like a group of one.

    A group in which some trajectory has no per-turn rewards keeps ``episode`` (its [B]
    episode advantages, broadcast over the tokens): it is not credited per turn.
    """
    adv = episode.to(torch.float32)[:, None].expand(loss_mask.shape).clone()
    groups = group_index.tolist()
    missing = {g for g, t in zip(groups, trajs, strict=True) if t.turn_rewards is None}
    credited = torch.tensor([g not in missing for g in groups], dtype=torch.bool)
    values: list[float] = []
    keys: list[int] = []
    slots: dict[tuple[int, int], int] = {}
    spans: list[tuple[int, int, int]] = []  # (row, start, end) of each value
    for i, (g, t) in enumerate(zip(groups, trajs, strict=True)):
        if g in missing or t.turn_ends is None or t.turn_rewards is None:
            continue
        adv[i].zero_()
        to_go = 0.0
        returns = []
        for r in reversed(t.turn_rewards):
            to_go += r
            returns.append(to_go)
        start = t.prompt_len
        for k, (end, g_k) in enumerate(zip(t.turn_ends, reversed(returns), strict=True)):
            keys.append(slots.setdefault((g, k), len(slots)))
            values.append(g_k)
            spans.append((i, start, end))
            start = end
    if values:
        per_turn = group_advantages(
            torch.tensor(values, dtype=torch.float32),
            torch.tensor(keys, dtype=torch.int64),
            scale=scale,
            eps=eps,
        )
        for (i, start, end), a in zip(spans, per_turn.tolist(), strict=True):
            adv[i, start:end] = a
    # 0 on the environment's tokens between the turns
    adv = torch.where(credited[:, None] & ~loss_mask, torch.zeros(()), adv)
    return adv, credited


def _collate_routing(trajs: Sequence[Trajectory], width: int) -> Tensor | None:
    """[B, T, layers, top_k] experts of the trajectories' recorded positions (-1 elsewhere:
    the last token of each, the padding, trajectories without a record); None if none has
    one. Records of different shapes cannot come from one model: ``ValueError``."""
    records = [t.routed_experts for t in trajs]
    present = [r for r in records if r is not None]
    if not present:
        return None
    shapes = {(r.layers, r.top_k) for r in present}
    if len(shapes) > 1:
        raise ValueError(f"routing records of several shapes in one batch: {sorted(shapes)}")
    ((layers, top_k),) = shapes
    out = torch.full((len(trajs), width, layers, top_k), -1, dtype=torch.int64)
    for i, r in enumerate(records):
        if r is not None and r.rows:
            out[i, : r.rows] = torch.from_numpy(r.array().astype(np.int64))
    return out


def _collate_teacher(
    views: Sequence[TeacherLogprobs | None], trajs: Sequence[Trajectory], width: int
) -> TeacherBatch | None:
    """Top-k views (a teacher's, or a hint's) scattered to their positions (the trained ones in
    order unless listed); None when no trajectory has one."""
    with_teacher = [v for v in views if v is not None]
    if not with_teacher:
        return None
    b, k = len(trajs), max(t.k for t in with_teacher)
    ids = torch.zeros((b, width, k), dtype=torch.int64)
    logprobs = torch.zeros((b, width, k), dtype=torch.float32)
    valid = torch.zeros((b, width, k), dtype=torch.bool)
    sampled = torch.zeros((b, width), dtype=torch.float32)
    present = torch.zeros((b, width), dtype=torch.bool)
    for i, (teacher, t) in enumerate(zip(views, trajs, strict=True)):
        if teacher is None:
            continue
        if teacher.positions is not None:
            pos = torch.tensor(teacher.positions, dtype=torch.int64)
        else:
            pos = torch.nonzero(torch.tensor(t.mask, dtype=torch.bool)).squeeze(-1)
        m, tk = len(teacher.sampled), teacher.k
        ids[i, pos, :tk] = torch.tensor(teacher.ids, dtype=torch.int64).view(m, tk)
        logprobs[i, pos, :tk] = torch.tensor(teacher.logprobs, dtype=torch.float32).view(m, tk)
        valid[i, pos, :tk] = True
        sampled[i, pos] = torch.tensor(teacher.sampled, dtype=torch.float32)
        present[i, pos] = True
    return TeacherBatch(ids=ids, logprobs=logprobs, valid=valid, sampled=sampled, present=present)


def _fits(rows: int, longest: int, size: int, max_tokens: int | None) -> bool:
    return rows <= size and (max_tokens is None or rows * longest <= max_tokens)


def micro_batch_spans(
    lengths: Sequence[int], size: int, max_tokens: int | None = None
) -> list[tuple[int, int]]:
    """Row spans ``(start, stop)`` of the greedy micro-batches of sequences of ``lengths`` real
    tokens: consecutive, each grown while it holds at most ``size`` sequences and at most
    ``max_tokens`` padded tokens (its sequences x its longest length); one sequence always fits.
    ``max_tokens=None``: ``size`` alone decides."""
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"micro-batch token budget must be >= 1, got {max_tokens}")
    spans: list[tuple[int, int]] = []
    start, longest = 0, 0
    for i, n in enumerate(lengths):
        longest = max(longest, n)
        if i > start and not _fits(i + 1 - start, longest, size, max_tokens):
            spans.append((start, i))
            start, longest = i, n
    if lengths:
        spans.append((start, len(lengths)))
    return spans


def split_spans(
    spans: Sequence[tuple[int, int]], lengths: Sequence[int], count: int
) -> list[tuple[int, int]]:
    """``spans`` (of :func:`micro_batch_spans`) split until there are ``count`` of them or each
    holds one sequence: the span with the most padded tokens is halved, again and again. Halves
    keep every limit their span kept."""
    out = list(spans)
    while len(out) < count:
        wide = [j for j, (lo, hi) in enumerate(out) if hi - lo > 1]
        if not wide:
            break
        j = max(wide, key=lambda j: (out[j][1] - out[j][0]) * max(lengths[slice(*out[j])]))
        lo, hi = out[j]
        out[j : j + 1] = [(lo, (lo + hi) // 2), ((lo + hi) // 2, hi)]
    return out


def sequence_lengths(batch: TrainBatch) -> list[int]:
    """Real tokens of each sequence of ``batch``."""
    return batch.attention_mask.sum(-1).tolist()


def micro_batches(batch: TrainBatch, size: int, max_tokens: int | None = None) -> list[TrainBatch]:
    """Consecutive slices of at most ``size`` trajectories and ``max_tokens`` padded tokens
    (:func:`micro_batch_spans`), each trimmed to its own length."""
    spans = micro_batch_spans(sequence_lengths(batch), size, max_tokens)
    return [batch.select(slice(lo, hi)) for lo, hi in spans]


def filler(batch: TrainBatch) -> TrainBatch:
    """A micro-batch that trains nothing: the shortest sequence of ``batch`` with an all-False
    loss mask and zero behaviour logprobs. Its forward and backward run only to match other
    ranks' collectives; its gradient is exactly zero (every loss term is masked), and its
    statistics are to be dropped."""
    lengths = sequence_lengths(batch)
    i = lengths.index(min(lengths))
    row = batch.select(slice(i, i + 1))
    return replace(
        row,
        loss_mask=torch.zeros_like(row.loss_mask),
        behaviour_logprobs=torch.zeros_like(row.behaviour_logprobs),
    )


def batch_metrics(batch: TrainBatch) -> dict[str, float]:
    """Reward per signal (mean, std), tokens and staleness of a batch (floats, for logging):
    ``staleness/<k>`` counts the trajectories ``k`` versions behind, plus ``staleness/mean`` and
    ``staleness/max``."""
    out: dict[str, float] = {
        "batch/trajectories": float(len(batch)),
        "batch/groups": float(int(batch.group_index.max()) + 1 if len(batch) else 0),
        "batch/trained_tokens": float(batch.num_tokens),
        "batch/tokens": float(batch.attention_mask.sum()),
    }
    if batch.turn_credit is not None and len(batch):
        out["batch/turn_credit_frac"] = float(batch.turn_credit.double().mean())
    if batch.routing is not None:  # trajectories that carry a routing record (routing replay)
        out["batch/routed_trajectories"] = float((batch.routing[:, 0, 0, 0] >= 0).sum())
    for name, values in batch.signals.items():
        present = values[~values.isnan()]
        if present.numel():
            out[f"reward/{name}/mean"] = float(present.mean())
            out[f"reward/{name}/std"] = float(present.std()) if present.numel() > 1 else 0.0
    for lag, count in sorted(Counter(batch.staleness.tolist()).items()):
        out[f"staleness/{lag}"] = float(count)
    if len(batch):
        out["staleness/mean"] = float(batch.staleness.double().mean())
        out["staleness/max"] = float(batch.staleness.max())
    return out
