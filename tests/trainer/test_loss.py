"""GRPO loss against hand-computed values: advantages, PPO clip, importance sampling, KL."""

from __future__ import annotations

import math

import pytest
import torch

from deltarl.trainer.learn.loss import (
    LossStats,
    advantage_metrics,
    group_advantages,
    grpo_loss,
    token_entropy,
    token_logprobs,
)
from deltarl.trainer.settings import LossSettings

EPS = 1e-4
ln = math.log


def lp_tensor(*probs: float, grad: bool = True) -> torch.Tensor:
    """[1, T] logprobs; position 0 is a prompt token (garbage -inf, masked out)."""
    t = torch.tensor([[-math.inf, *(ln(p) for p in probs)]])
    return t.requires_grad_(grad)


def mask_for(n: int) -> torch.Tensor:
    return torch.tensor([[False] + [True] * n])


# ---------------------------------------------------------------------------------------------
# advantages


def test_group_advantages_group_std() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    a = group_advantages(rewards, groups)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]: 4 * 0.25 / 3
    expected = [0.5 / (std + EPS), -0.5 / (std + EPS), -0.5 / (std + EPS), 0.5 / (std + EPS)]
    assert a.tolist() == pytest.approx([*expected, 0.0, 0.0], rel=1e-6)
    assert a.dtype == torch.float32


def test_group_advantages_dr_grpo_and_batch() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    assert group_advantages(rewards, groups, scale="none").tolist() == [
        0.5,
        -0.5,
        -0.5,
        0.5,
        0.0,
        0.0,
    ]
    std = math.sqrt(0.8)  # unbiased std of all six rewards: deviations 0,1,1,0,1,1 from mean 1
    got = group_advantages(rewards, groups, scale="batch")
    assert got.tolist() == pytest.approx(
        [0.5 / (std + EPS), -0.5 / (std + EPS), -0.5 / (std + EPS), 0.5 / (std + EPS), 0, 0],
        rel=1e-6,
    )


def test_group_advantages_any_ids_and_sizes() -> None:
    # interleaved, non-contiguous ids; a group of one gets 0
    rewards = torch.tensor([3.0, 1.0, 5.0, 2.0, 9.0])
    groups = torch.tensor([7, 3, 7, 3, 42])
    a = group_advantages(rewards, groups)
    s7, s3 = math.sqrt(2.0), math.sqrt(0.5)  # std of [3, 5] and of [1, 2]
    assert a.tolist() == pytest.approx(
        [-1 / (s7 + EPS), -0.5 / (s3 + EPS), 1 / (s7 + EPS), 0.5 / (s3 + EPS), 0.0], rel=1e-6
    )
    with pytest.raises(ValueError, match="scale"):
        group_advantages(rewards, groups, scale="rank")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\[N\]"):
        group_advantages(rewards, groups[:3])


def test_advantage_metrics() -> None:
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0])
    groups = torch.tensor([0, 0, 1, 1])
    adv = group_advantages(rewards, groups)
    m = advantage_metrics(rewards, groups, adv)
    assert m["reward/mean"] == pytest.approx(1.25)
    assert m["reward/zero_std_group_frac"] == 0.5
    assert m["advantage/max"] == pytest.approx(0.5 / (math.sqrt(0.5) + EPS))
    assert m["advantage/mean"] == pytest.approx(0.0, abs=1e-7)


# ---------------------------------------------------------------------------------------------
# PPO clip against the behaviour logprobs (no importance sampling)

PPO = LossSettings(importance_sampling="none", clip_low=0.2, clip_high=0.2)


def test_ppo_clip_positive_advantage() -> None:
    lp = lp_tensor(0.5, 0.2)
    behav = torch.tensor([[0.0, ln(0.4), ln(0.4)]])
    out = grpo_loss(lp, behav, torch.tensor([1.0]), mask_for(2), PPO)
    # ratios 1.25 and 0.5; A > 0: min(1.25, 1.2) = 1.2 (clipped), min(0.5, 0.8) = 0.5
    assert out.loss.item() == pytest.approx(-(1.2 + 0.5) / 2)
    out.loss.backward()
    assert lp.grad is not None
    # clipped token: no gradient; d/dlp of -r*A/2 is -r/2 = -0.25; masked token: exactly 0
    assert lp.grad[0].tolist() == pytest.approx([0.0, 0.0, -0.25])
    s = out.stats.summary()
    assert s["clip/high_frac"] == 0.5 and s["clip/low_frac"] == 0.0 and s["clip/frac"] == 0.5
    assert s["ratio/min"] == pytest.approx(0.5) and s["ratio/max"] == pytest.approx(1.25)
    assert s["tokens"] == 2 and s["sequences"] == 1


def test_ppo_clip_negative_advantage() -> None:
    lp = lp_tensor(0.5, 0.2)
    behav = torch.tensor([[0.0, ln(0.4), ln(0.4)]])
    out = grpo_loss(lp, behav, torch.tensor([-1.0]), mask_for(2), PPO)
    # A < 0: min(-1.25, -1.2) = -1.25 (unclipped), min(-0.5, -0.8) = -0.8 (clipped)
    assert out.loss.item() == pytest.approx((1.25 + 0.8) / 2)
    out.loss.backward()
    assert lp.grad is not None
    assert lp.grad[0].tolist() == pytest.approx([0.0, 1.25 / 2, 0.0])
    s = out.stats.summary()
    assert s["clip/low_frac"] == 0.5 and s["clip/high_frac"] == 0.0


def test_clip_higher() -> None:
    lp = lp_tensor(0.5)
    behav = torch.tensor([[0.0, ln(0.4)]])
    s = LossSettings(importance_sampling="none", clip_low=0.2, clip_high=0.28)
    out = grpo_loss(lp, behav, torch.tensor([1.0]), mask_for(1), s)
    assert out.loss.item() == pytest.approx(-1.25)  # 1.25 < 1.28: not clipped


# ---------------------------------------------------------------------------------------------
# importance sampling (TRL modes), proximal policy = current policy detached


def is_loss(mode: str, cap: float = 3.0) -> tuple[float, list[float], dict[str, float]]:
    lp = lp_tensor(0.5, 0.2)
    behav = torch.tensor([[0.0, ln(0.1), ln(0.4)]])  # token ratios 5 and 0.5, product 2.5
    s = LossSettings(importance_sampling=mode, importance_sampling_cap=cap)  # type: ignore[arg-type]
    out = grpo_loss(lp, behav, torch.tensor([1.0]), mask_for(2), s)
    out.loss.backward()
    assert lp.grad is not None
    return out.loss.item(), lp.grad[0, 1:].tolist(), out.stats.summary()


def test_token_truncate() -> None:
    loss, grad, s = is_loss("token_truncate")
    # ratio r = 1 (value) carries the gradient; w = min(5, 3) = 3 and 0.5
    assert loss == pytest.approx(-(3 + 0.5) / 2)
    assert grad == pytest.approx([-1.5, -0.25])
    assert s["is/weight/max"] == pytest.approx(3.0) and s["is/weight/min"] == pytest.approx(0.5)
    assert s["is/capped_frac"] == 0.5
    assert s["mismatch/ratio/max"] == pytest.approx(5.0)
    assert s["mismatch/ratio/mean"] == pytest.approx(2.75)
    assert s["ratio/mean"] == pytest.approx(1.0)


def test_token_mask() -> None:
    loss, grad, s = is_loss("token_mask")
    assert loss == pytest.approx(-0.5 / 2)
    assert grad == pytest.approx([0.0, -0.25])
    assert s["is/weight/min"] == 0.0


def test_sequence_truncate_and_mask() -> None:
    loss, grad, s = is_loss("sequence_truncate")
    assert loss == pytest.approx(-2.5)  # one weight 5 * 0.5 = 2.5 < 3 for both tokens
    assert grad == pytest.approx([-1.25, -1.25])
    assert s["is/capped_frac"] == 0.0
    loss, _, _ = is_loss("sequence_truncate", cap=2.0)
    assert loss == pytest.approx(-2.0)
    loss, grad, s = is_loss("sequence_mask", cap=2.0)
    assert loss == 0.0 and grad == [0.0, 0.0]
    assert s["is/capped_frac"] == 1.0  # per sequence
    loss, _, _ = is_loss("sequence_mask", cap=3.0)
    assert loss == pytest.approx(-2.5)


def test_huge_ratios_stay_finite() -> None:
    lp = torch.tensor([[ln(0.9)] * 200], requires_grad=True)
    behav = torch.full((1, 200), -30.0)  # sequence ratio exp(~6000): inf in float32
    for mode in ("sequence_truncate", "sequence_mask", "token_mask"):
        s = LossSettings(importance_sampling=mode)
        out = grpo_loss(lp, behav, torch.tensor([1.0]), torch.ones(1, 200, dtype=torch.bool), s)
        out.loss.backward()
        assert torch.isfinite(out.loss) and lp.grad is not None and torch.isfinite(lp.grad).all()
        lp.grad = None


def test_proximal_logprobs_decouple_clip_and_importance_weight() -> None:
    lp = lp_tensor(0.5)
    prox = torch.tensor([[0.0, ln(0.4)]])
    behav = torch.tensor([[0.0, ln(0.1)]])
    s = LossSettings(importance_sampling="token_truncate", importance_sampling_cap=3.0)
    out = grpo_loss(lp, behav, torch.tensor([1.0]), mask_for(1), s, proximal_logprobs=prox)
    # PPO ratio 0.5/0.4 = 1.25 -> clipped at 1.2; weight min(0.4/0.1, 3) = 3
    assert out.loss.item() == pytest.approx(-3.6)


# ---------------------------------------------------------------------------------------------
# aggregation and gradient accumulation


def two_sequences() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    lp = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, 0.0]], requires_grad=True)
    mask = torch.tensor([[False, True, True], [False, True, False]])
    return lp, lp.detach().clone(), torch.tensor([1.0, 3.0]), mask


@pytest.mark.parametrize(
    ("aggregation", "normalizer", "expected"),
    [
        ("token_mean", None, -5 / 3),  # -(1 + 1 + 3) / 3 tokens
        ("sequence_mean", None, -2.0),  # -(mean(1, 1) + mean(3)) / 2
        ("sum", None, -5.0),
        ("token_mean", 10.0, -0.5),
        ("sequence_mean", 4.0, -1.0),
        ("sum", 10.0, -0.5),
    ],
)
def test_aggregation(aggregation: str, normalizer: float | None, expected: float) -> None:
    lp, behav, adv, mask = two_sequences()
    s = LossSettings(importance_sampling="none", aggregation=aggregation)  # type: ignore[arg-type]
    out = grpo_loss(lp, behav, adv, mask, s, normalizer=normalizer)
    assert out.loss.item() == pytest.approx(expected)


def test_sum_normalizer_setting_and_per_token_advantages() -> None:
    lp, behav, _, mask = two_sequences()
    s = LossSettings(importance_sampling="none", aggregation="sum", sum_normalizer=4.0)
    adv = torch.tensor([[9.0, 1.0, 2.0], [9.0, 4.0, 9.0]])  # 9 = never trained on
    out = grpo_loss(lp, behav, adv, mask, s)
    assert out.loss.item() == pytest.approx(-(1 + 2 + 4) / 4)


def test_micro_batches_with_a_global_normalizer_match_the_full_batch() -> None:
    g = torch.Generator().manual_seed(0)
    lp = (torch.rand(4, 6, generator=g) * -3).requires_grad_(True)
    behav = lp.detach() + torch.randn(4, 6, generator=g) * 0.3
    adv = torch.randn(4, generator=g)
    mask = torch.rand(4, 6, generator=g) < 0.7
    s = LossSettings(importance_sampling="token_truncate", importance_sampling_cap=1.5)
    full = grpo_loss(lp, behav, adv, mask, s)
    full.loss.backward()
    assert lp.grad is not None
    want = lp.grad.clone()
    lp.grad = None
    n = float(mask.sum())
    parts = [
        grpo_loss(lp[i : i + 2], behav[i : i + 2], adv[i : i + 2], mask[i : i + 2], s, normalizer=n)
        for i in (0, 2)
    ]
    total = parts[0].loss + parts[1].loss
    total.backward()
    assert total.item() == pytest.approx(full.loss.item(), rel=1e-6)
    assert lp.grad is not None and torch.allclose(lp.grad, want, atol=1e-7)
    merged = parts[0].stats.merge(parts[1].stats).summary()
    ref = full.stats.summary()
    for key in ("tokens", "loss", "is/weight/mean", "is/weight/max", "mismatch/kl", "clip/frac"):
        assert merged[key] == pytest.approx(ref[key], rel=1e-6), key


# ---------------------------------------------------------------------------------------------
# KL to a reference, masking, entropy, logprobs


def test_kl_to_reference_k3() -> None:
    lp = lp_tensor(0.5)
    ref = torch.tensor([[0.0, ln(0.25)]])
    s = LossSettings(importance_sampling="none", kl_coef=0.1)
    out = grpo_loss(lp, lp.detach(), torch.tensor([0.0]), mask_for(1), s, ref_logprobs=ref)
    k3 = 0.5 - ln(0.5) - 1  # exp(d) - d - 1 with d = ln(0.25 / 0.5)
    assert out.loss.item() == pytest.approx(0.1 * k3)
    out.loss.backward()
    assert lp.grad is not None
    assert lp.grad[0, 1].item() == pytest.approx(0.1 * (1 - 0.5))  # d k3 / d lp = 1 - exp(d)
    assert out.stats.summary()["kl_ref"] == pytest.approx(k3)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(lp, lp.detach(), torch.tensor([0.0]), mask_for(1), s)


def test_masked_garbage_never_reaches_loss_or_gradient() -> None:
    lp = torch.tensor([[math.nan, -math.inf, ln(0.5)]], requires_grad=True)
    behav = torch.tensor([[math.inf, math.nan, ln(0.5)]])
    mask = torch.tensor([[0, 0, 1]])
    for mode in ("none", "token_truncate", "sequence_mask"):
        s = LossSettings(importance_sampling=mode, kl_coef=0.1)
        ref = torch.tensor([[math.nan, math.nan, ln(0.5)]])
        adv = torch.tensor([[math.nan, math.inf, 2.0]])  # per-token, garbage where masked
        out = grpo_loss(lp, behav, adv, mask, s, ref_logprobs=ref)
        out.loss.backward()
        assert out.loss.item() == pytest.approx(-2.0)
        assert lp.grad is not None and lp.grad.tolist()[0][:2] == [0.0, 0.0]
        assert all(math.isfinite(v) for v in out.stats.summary().values())
        lp.grad = None


def test_mismatch_kl_metric() -> None:
    lp = lp_tensor(0.5)
    behav = torch.tensor([[0.0, ln(0.4)]])
    out = grpo_loss(lp, behav, torch.tensor([1.0]), mask_for(1), PPO)
    s = out.stats.summary()
    assert s["mismatch/kl"] == pytest.approx(1.25 - ln(1.25) - 1)
    assert s["mismatch/abs_logprob_diff/max"] == pytest.approx(ln(1.25))


def test_token_logprobs_and_entropy() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 7, generator=g, requires_grad=True)
    tokens = torch.randint(0, 7, (2, 5), generator=g)
    lp = token_logprobs(logits, tokens)
    ref = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    assert lp.shape == (2, 5) and lp[:, 0].tolist() == [0.0, 0.0]
    assert torch.allclose(lp[:, 1:], ref)
    lp.sum().backward()  # differentiable
    uniform = torch.zeros(1, 3, 4)
    assert token_entropy(uniform)[0].tolist() == pytest.approx([0.0, ln(4), ln(4)])
    out = grpo_loss(
        lp.detach().requires_grad_(True),
        lp.detach(),
        torch.tensor([1.0, -1.0]),
        torch.tensor([[0, 1, 1, 1, 1]] * 2),
        logits=logits.detach(),
    )
    ent = token_entropy(logits.detach())[:, 1:].mean().item()
    assert out.stats.summary()["entropy"] == pytest.approx(ent)
    with pytest.raises(ValueError, match="tokens"):
        token_logprobs(logits, tokens[:, :3])


def test_shape_errors() -> None:
    lp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        grpo_loss(lp, torch.zeros(2, 4), torch.zeros(2), mask)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(lp, torch.zeros(2, 3), torch.zeros(3), mask)
    with pytest.raises(ValueError, match="logits"):
        grpo_loss(lp, torch.zeros(2, 3), torch.zeros(2), mask, logits=torch.zeros(2, 4, 5))
    with pytest.raises(ValueError, match="normalizer"):
        grpo_loss(lp, torch.zeros(2, 3), torch.zeros(2), mask, normalizer=0.0)


def test_empty_mask_gives_zero_loss() -> None:
    lp = torch.zeros(2, 3, requires_grad=True)
    out = grpo_loss(lp, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3, dtype=torch.bool))
    out.loss.backward()
    assert out.loss.item() == 0.0
    s = out.stats.summary()
    assert s["tokens"] == 0 and "ratio/mean" not in s


def test_stats_merge_keeps_inputs_unchanged() -> None:
    a, b = LossStats(), LossStats()
    a.add_values("x", torch.tensor([1.0, 2.0]), extrema=True)
    b.add_values("x", torch.tensor([6.0]), extrema=True)
    a.add_sum("n", torch.tensor(2.0))
    merged = a.merge(b).summary()
    assert merged == {"n": 2.0, "x/max": 6.0, "x/mean": 3.0, "x/min": 1.0}
    assert a.summary()["x/mean"] == 1.5
