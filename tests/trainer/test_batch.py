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


def turns_traj(prompt: int, turns: list[tuple[int, int, float]], version: int = 10) -> Trajectory:
    """A multi-turn trajectory: per turn (sampled tokens, env tokens after it, reward)."""
    mask = [0] * prompt
    ends = []
    for sampled, env, _ in turns:
        mask += [1] * sampled
        ends.append(len(mask))
        mask += [0] * env
    rewards = [r for _, _, r in turns]
    return Trajectory(
        tokens=list(range(1, len(mask) + 1)),
        logprobs=[-0.5 if m else 0.0 for m in mask],
        mask=mask,
        prompt_len=prompt,
        reward=math.fsum(rewards),
        version_min=version,
        version_max=version,
        turn_ends=ends,
        turn_rewards=rewards,
    )


def test_per_turn_credit_judges_each_move_on_what_followed_it() -> None:
    # Three episodes of one group; turn 0 returns-to-go 1.5, 0.5, 1.0; turn 1 (two reached it)
    # 1.0, 0.0 (the third ended after one turn); turn 2 only the first: advantage 0.
    a = turns_traj(2, [(2, 1, 0.5), (1, 1, 0.0), (2, 0, 1.0)])
    b = turns_traj(1, [(1, 2, 0.5), (3, 0, 0.0)])
    c = turns_traj(3, [(2, 0, 1.0)])
    batch = collate([group("g", a, b, c)], 10, credit="turn")
    eps = 1e-4
    s0 = 0.5  # unbiased std of [1.5, 0.5, 1.0]
    s1 = math.sqrt(0.5)  # of [1.0, 0.0]
    adv = batch.advantages
    assert adv.shape == batch.tokens.shape
    row_a = adv[0][batch.loss_mask[0]].tolist()
    assert row_a == pytest.approx([0.5 / (s0 + eps)] * 2 + [0.5 / (s1 + eps)] + [0.0] * 2, rel=1e-5)
    row_b = adv[1][batch.loss_mask[1]].tolist()
    assert row_b == pytest.approx([-0.5 / (s0 + eps)] + [-0.5 / (s1 + eps)] * 3, rel=1e-5)
    assert adv[2][batch.loss_mask[2]].tolist() == pytest.approx([0.0, 0.0], abs=1e-6)
    assert (adv[~batch.loss_mask] == 0).all()  # prompts, env tokens, padding
    assert batch.turn_credit is not None and batch.turn_credit.tolist() == [True] * 3
    # the episode credit of the same batch: one advantage per trajectory, every token alike
    flat = collate([group("g", a, b, c)], 10)
    assert flat.advantages.shape == (3,) and flat.turn_credit is None
    # per-token statistics in the step's metrics
    from deltarl.trainer.loss import advantage_metrics

    m = advantage_metrics(batch.rewards, batch.group_index, adv, batch.loss_mask)
    assert m["advantage/max"] == pytest.approx(0.5 / (s0 + eps), rel=1e-5)
    assert batch_metrics(batch)["batch/turn_credit_frac"] == 1.0
    with pytest.raises(ValueError, match="loss_mask"):
        advantage_metrics(batch.rewards, batch.group_index, adv)


def test_per_turn_credit_falls_back_per_group_and_slices_with_micro_batches() -> None:
    with_turns = group("a", turns_traj(1, [(1, 1, 1.0), (1, 0, 0.0)]), turns_traj(1, [(2, 0, 0.0)]))
    # group b: one trajectory without per-turn rewards -> the whole group keeps episode credit
    plain = traj(2, [-0.1, -0.2], 1.0, 10)
    mixed = group("b", turns_traj(2, [(1, 0, 0.0)]), plain)
    batch = collate([with_turns, mixed], 10, credit="turn")
    assert batch.turn_credit is not None and batch.turn_credit.tolist() == [
        True,
        True,
        False,
        False,
    ]
    episode = collate([with_turns, mixed], 10).advantages
    for row in (2, 3):
        trained = batch.advantages[row][batch.loss_mask[row]]
        assert torch.allclose(trained, episode[row].expand_as(trained))
    parts = micro_batches(batch, 3)
    assert [p.advantages.shape for p in parts] == [(3, 4), (1, 4)]
    assert torch.equal(parts[0].advantages, batch.advantages[:3, :4])
    assert parts[1].turn_credit is not None and parts[1].turn_credit.tolist() == [False]
    settings = LossSettings()
    out = grpo_loss(
        parts[0].behaviour_logprobs.clone().requires_grad_(True),
        parts[0].behaviour_logprobs,
        parts[0].advantages,
        parts[0].loss_mask,
        settings,
    )
    assert math.isfinite(out.loss.item())
    with pytest.raises(ValueError, match="credit"):
        collate([with_turns], 10, credit="move")  # type: ignore[arg-type]
