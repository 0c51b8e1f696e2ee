"""Trajectory groups to tensors: staleness filter, padding, advantages, micro-batches."""

from __future__ import annotations

import math

import pytest
import torch

from deltarl.services.coordinator.schemas import Trajectory, TrajectoryGroup
from deltarl.trainer.batch import batch_metrics, collate, filter_stale, micro_batches
from deltarl.trainer.loss import grpo_loss
from deltarl.trainer.settings import LossSettings


def traj(n_prompt: int, completion: list[float], reward: float, version: int) -> Trajectory:
    n = n_prompt + len(completion)
    return Trajectory(
        tokens=list(range(1, n + 1)),
        logprobs=[0.0] * n_prompt + completion,
        mask=[0] * n_prompt + [1] * len(completion),
        prompt_len=n_prompt,
        reward=reward,
        signals={"format": reward / 2} if reward else {},
        version_min=version,
        version_max=version,
    )


def group(gid: str, *trajs: Trajectory) -> TrajectoryGroup:
    return TrajectoryGroup(
        idempotency_key=f"k-{gid}", worker_id="w1", group_id=gid, trajectories=list(trajs)
    )


def test_filter_stale_counts_whole_groups() -> None:
    fresh = group("a", traj(2, [-0.1], 1.0, 9), traj(2, [-0.2], 0.0, 10))
    old = group("b", traj(2, [-0.1], 1.0, 5), traj(2, [-0.2], 0.0, 10), traj(1, [-1.0], 0.0, 10))
    f = filter_stale([fresh, old], policy_version=10, max_staleness=4)
    assert [g.group_id for g in f.kept] == ["a"]
    assert (f.dropped_groups, f.dropped_trajectories) == (1, 3)
    assert len(filter_stale([fresh, old], 10, None).kept) == 2
    assert len(filter_stale([fresh, old], 10, 5).kept) == 2


def test_collate_pads_aligns_and_normalises_per_group() -> None:
    groups = [
        group("a", traj(2, [-0.5, -0.25], 1.0, 9), traj(1, [-1.0], 0.0, 10)),
        group("b", traj(3, [-0.1], 2.0, 10), traj(2, [-0.3], 2.0, 8)),
    ]
    b = collate(groups, policy_version=10)
    assert b.tokens.shape == (4, 4)
    assert b.tokens[1].tolist() == [1, 2, 0, 0]  # padded with pad_id 0
    assert b.attention_mask.sum(-1).tolist() == [4, 2, 4, 3]
    assert b.loss_mask[0].tolist() == [False, False, True, True]
    assert b.behaviour_logprobs[0].tolist() == [0.0, 0.0, -0.5, -0.25]
    s = math.sqrt(0.5)  # unbiased std of [1, 0]
    assert b.advantages.tolist() == pytest.approx([0.5 / (s + 1e-4), -0.5 / (s + 1e-4), 0, 0])
    assert b.group_index.tolist() == [0, 0, 1, 1]
    assert b.staleness.tolist() == [1, 0, 0, 2]
    assert b.num_tokens == 5
    fmt = b.signals["format"]
    assert fmt[0].item() == 0.5 and math.isnan(fmt[1].item())
    m = batch_metrics(b)
    assert m["staleness/0"] == 2 and m["staleness/2"] == 1 and m["batch/groups"] == 2
    assert m["reward/format/mean"] == pytest.approx((0.5 + 1 + 1) / 3)
    with pytest.raises(ValueError, match="no trajectories"):
        collate([])


def test_micro_batches_trim_and_accumulate_to_the_full_step() -> None:
    groups = [
        group("a", traj(2, [-0.5, -0.25, -2.0], 1.0, 9), traj(1, [-1.0], 0.0, 10)),
        group("b", traj(1, [-0.1], 3.0, 10), traj(1, [-0.3], 0.0, 10)),
    ]
    batch = collate(groups, 10)
    parts = micro_batches(batch, 3)
    assert [len(p) for p in parts] == [3, 1]
    assert parts[1].tokens.shape == (1, 2)  # trimmed to its own longest sequence
    settings = LossSettings(importance_sampling="token_truncate")
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(batch.tokens.shape, generator=g) * 0.1
    full_lp = (batch.behaviour_logprobs + noise).requires_grad_(True)
    full = grpo_loss(full_lp, batch.behaviour_logprobs, batch.advantages, batch.loss_mask, settings)
    total = torch.zeros(())
    row = 0
    for p in parts:
        lp = (p.behaviour_logprobs + noise[row : row + len(p), : p.tokens.shape[1]]).detach()
        out = grpo_loss(
            lp, p.behaviour_logprobs, p.advantages, p.loss_mask, settings,
            normalizer=batch.num_tokens,
        )  # fmt: skip
        total = total + out.loss
        row += len(p)
    assert total.item() == pytest.approx(full.loss.item(), rel=1e-6)
    with pytest.raises(ValueError, match="micro-batch"):
        micro_batches(batch, 0)
