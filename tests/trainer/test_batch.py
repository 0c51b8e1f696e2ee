"""Trajectory groups to tensors: staleness filter, padding, advantages, micro-batches."""

from __future__ import annotations

import math

import pytest
import torch

from deltarl.services.coordinator.schemas import Trajectory, TrajectoryGroup
from deltarl.trainer.learn.batch import (
    batch_metrics,
    collate,
    filler,
    filter_stale,
    micro_batch_spans,
    micro_batches,
    split_spans,
)
from deltarl.trainer.learn.loss import grpo_loss
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


def test_micro_batch_spans_hold_a_token_budget_in_order() -> None:
    lengths = [3, 5, 2, 12, 4, 4, 1, 1, 1, 1]
    spans = micro_batch_spans(lengths, 3, 10)
    # 3+5 fit (2 x 5), 2 does not join them (3 x 5); 12 exceeds the budget and goes alone
    assert spans == [(0, 2), (2, 3), (3, 4), (4, 6), (6, 9), (9, 10)]
    assert [i for lo, hi in spans for i in range(lo, hi)] == list(range(len(lengths)))
    for lo, hi in spans:
        assert hi - lo <= 3 and (hi - lo == 1 or (hi - lo) * max(lengths[lo:hi]) <= 10)
    assert micro_batch_spans(lengths, 3) == [(0, 3), (3, 6), (6, 9), (9, 10)]  # size alone
    assert micro_batch_spans([], 3, 10) == []
    with pytest.raises(ValueError, match="token budget must be >= 1, got 0"):
        micro_batch_spans(lengths, 3, 0)


def test_micro_batches_by_tokens_are_trimmed_slices_of_every_row_once() -> None:
    lengths = [2, 4, 1, 3, 1, 2]
    groups = [group("a", *(traj(1, [-0.5] * (n - 1), float(n), 10) for n in lengths))]
    batch = collate(groups, 10)
    parts = micro_batches(batch, 4, max_tokens=6)
    assert [len(p) for p in parts] == [1, 1, 2, 2]
    for p in parts:
        assert p.tokens.numel() <= 6 and p.tokens.shape[1] == int(p.attention_mask.sum(-1).max())
    assert torch.equal(torch.cat([p.rewards for p in parts]), batch.rewards)
    assert len(micro_batches(batch, 4, max_tokens=100)) == 2  # the size still bounds
    with pytest.raises(ValueError, match="token budget"):
        micro_batches(batch, 4, max_tokens=-1)


def test_spans_split_the_widest_first_and_a_filler_trains_nothing() -> None:
    lengths = [2, 2, 6, 2]
    assert split_spans([(0, 2), (2, 4)], lengths, 3) == [(0, 2), (2, 3), (3, 4)]
    assert split_spans([(0, 4)], [1] * 4, 3) == [(0, 1), (1, 2), (2, 4)]
    assert split_spans([(0, 2)], lengths, 5) == [(0, 1), (1, 2)]  # single rows at most
    groups = [group("a", traj(2, [-0.5, -0.25], 1.0, 9), traj(1, [-1.0], 0.0, 10))]
    batch = collate(groups, 10)
    pad = filler(batch)
    assert len(pad) == 1 and pad.tokens.tolist() == batch.tokens[1:, :2].tolist()  # shortest
    assert pad.num_tokens == 0 and not pad.behaviour_logprobs.any()
    assert batch.num_tokens == 3  # the batch itself is untouched


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
    from deltarl.trainer.learn.loss import advantage_metrics

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
