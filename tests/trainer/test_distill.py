"""On-policy distillation losses (trainer/learn/distill.py): the math against plain formulas, the batch
layout, and that distilling from a teacher beats GRPO alone where the reward is sparse."""

from __future__ import annotations

import math

import pytest
import torch
from test_step import COMPLETION, TARGET, VOCAB, Bigram

from deltarl.services.coordinator.schemas import TeacherLogprobs, Trajectory, TrajectoryGroup
from deltarl.trainer.learn.batch import collate, micro_batches
from deltarl.trainer.learn.distill import (
    TeacherBatch,
    bucket_logprobs,
    generalized_jsd,
    jsd_loss,
    teacher_advantages,
)
from deltarl.trainer.learn.loss import LossStats
from deltarl.trainer.learn.optim import build_optimizer
from deltarl.trainer.learn.step import train_step
from deltarl.trainer.settings import ExperimentSettings


def _buckets(p: torch.Tensor, ids: list[int]) -> torch.Tensor:
    top = p[ids]
    return torch.cat([top, (1 - top.sum()).reshape(1)])


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_generalized_jsd_matches_the_formula(beta: float) -> None:
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(7, generator=g, dtype=torch.float64), 0)
    q = torch.softmax(torch.randn(7, generator=g, dtype=torch.float64), 0)
    ids = [4, 0, 2]
    pb, qb = _buckets(p, ids), _buckets(q, ids)

    def kl(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a * (a / b).log()).sum())

    if beta == 0.0:
        want = kl(pb, qb)
    elif beta == 1.0:
        want = kl(qb, pb)
    else:
        m = beta * pb + (1 - beta) * qb
        want = beta * kl(pb, m) + (1 - beta) * kl(qb, m)
    valid = torch.ones(3, dtype=torch.bool)
    s = bucket_logprobs(q.log()[ids], valid)
    t = bucket_logprobs(p.log()[ids], valid)
    got = generalized_jsd(s, t, torch.ones(4, dtype=torch.bool), beta)
    assert float(got) == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert float(generalized_jsd(t, t, torch.ones(4, dtype=torch.bool), beta)) == pytest.approx(
        0.0, abs=1e-12
    )


def test_padding_entries_count_for_nothing() -> None:
    lp = torch.log(torch.tensor([0.5, 0.2, 0.1], dtype=torch.float64))
    full = bucket_logprobs(lp[:2], torch.ones(2, dtype=torch.bool))
    padded = bucket_logprobs(lp, torch.tensor([True, True, False]))
    assert torch.allclose(padded[[0, 1, 3]], full) and padded[2] == -math.inf
    assert math.isclose(float(full[-1].exp()), 0.3, rel_tol=1e-12)


def teacher_table(strength: float = 4.0) -> torch.Tensor:
    """A teacher that prefers TARGET after every token."""
    table = torch.zeros(VOCAB, VOCAB)
    table[:, TARGET] = strength
    return table


@torch.no_grad()
def rollout(
    student: Bigram,
    teacher: torch.Tensor | None,
    gen: torch.Generator,
    k: int,
    version: int,
    hints: bool = False,
) -> list[TrajectoryGroup]:
    """Groups of 8; reward 1 only when every completion token is TARGET (sparse: GRPO alone
    rarely sees a signal); with ``teacher``, its top-k at each sampled position attached, or with
    ``hints``, only on failed trajectories and only at the first wrong token (the "turn that went
    wrong"): the distribution of a policy that read the hint (here: the teacher table's)."""
    groups = []
    for gi in range(4):
        prompt = int(torch.randint(0, VOCAB, (1,), generator=gen))
        trajs = []
        for _ in range(8):
            tokens, logprobs, sampled, ids, lps = [prompt], [0.0], [], [], []
            for _ in range(COMPLETION):
                logp = torch.log_softmax(student.table.weight[tokens[-1]], -1)
                tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
                if teacher is not None:
                    tlp = torch.log_softmax(teacher[tokens[-1]], -1)
                    top = torch.topk(tlp, k)
                    ids += top.indices.tolist()
                    lps += top.values.tolist()
                    sampled.append(float(tlp[tok]))
                tokens.append(tok)
                logprobs.append(float(logp[tok]))
            view = (
                None
                if teacher is None
                else TeacherLogprobs(k=k, temperature=1.0, sampled=sampled, ids=ids, logprobs=lps)
            )
            wrong = [p for p in range(1, len(tokens)) if tokens[p] != TARGET]
            hint = None
            if hints and view is not None and wrong:
                j = wrong[0] - 1  # index among the trained positions
                hint = TeacherLogprobs(
                    k=k,
                    temperature=1.0,
                    sampled=[sampled[j]],
                    ids=ids[j * k : (j + 1) * k],
                    logprobs=lps[j * k : (j + 1) * k],
                    positions=[wrong[0]],
                )
            trajs.append(
                Trajectory(
                    tokens=tokens,
                    logprobs=logprobs,
                    mask=[0] + [1] * COMPLETION,
                    prompt_len=1,
                    reward=float(all(t == TARGET for t in tokens[1:])),
                    version_min=version,
                    version_max=version,
                    teacher=None if hints else view,
                    hint=hint,
                    hint_text="play the target" if hint is not None else None,
                )
            )
        groups.append(
            TrajectoryGroup(
                idempotency_key=f"v{version}-{gi}",
                worker_id="w",
                group_id=f"g{gi}",
                trajectories=trajs,
            )
        )
    return groups


def train(mode: str, seed: int, steps: int = 30) -> list[float]:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    settings = ExperimentSettings.load(
        None,
        [
            f"max_steps={steps}",
            "optimizer.lr=0.1",
            "batch.micro_batch_size=16",
            f"loss.distill={'none' if mode == 'hint' else mode}",
            "loss.distill_beta=0.5",
            "loss.teacher_tau=1.0",
        ],
    )
    student = Bigram()
    opt, sched = build_optimizer(student.parameters(), settings.optimizer, steps)
    teacher = None if mode == "none" else teacher_table()
    success = []
    for step in range(steps):
        groups = rollout(student, teacher, gen, 3, step, hints=mode == "hint")
        batch = collate(groups, step)
        metrics = train_step(student, opt, sched, batch, settings)
        success.append(float(batch.rewards.mean()))
        if mode == "hint":
            assert "hint/loss" in metrics and "distill/coverage" not in metrics
        elif mode != "none":
            assert metrics["distill/coverage"] == 1.0
            assert "distill/teacher_minus_student" in metrics
            if mode == "jsd":
                assert 0.0 < metrics["distill/topk_mass_teacher"] <= 1.0
                assert metrics["distill/kl_teacher"] >= 0.0
    return success


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["jsd", "teacher_advantage", "hint"])
def test_distillation_beats_grpo_alone_on_a_sparse_reward(mode: str) -> None:
    """Same seeds, same steps: with the teacher the student learns to play TARGET; GRPO alone,
    which needs a whole completion of TARGETs to see any reward, stays near chance."""
    for seed in (0, 1, 2):
        alone, distilled = train("none", seed), train(mode, seed)
        late_alone, late_distilled = sum(alone[-10:]) / 10, sum(distilled[-10:]) / 10
        assert late_distilled > 0.5 and late_distilled > late_alone + 0.3, (
            seed,
            alone,
            distilled,
        )


def test_collate_places_teacher_data_on_trained_positions() -> None:
    gen = torch.Generator().manual_seed(0)
    groups = rollout(Bigram(), teacher_table(), gen, 2, 0)
    plain = rollout(Bigram(), None, gen, 2, 0)
    batch = collate([groups[0], plain[0]], 0)
    t = batch.teacher
    assert t is not None and t.ids.shape == (16, COMPLETION + 1, 2)
    assert torch.equal(t.present, batch.loss_mask & torch.arange(16)[:, None].lt(8))
    assert bool((t.ids[:8, 1:, 0] == TARGET).all())  # the teacher's top-1 everywhere
    first = groups[0].trajectories[0].teacher
    assert first is not None and t.sampled[0, 1:].tolist() == pytest.approx(first.sampled)
    parts = micro_batches(batch, 5)
    assert [p.teacher.ids.shape[0] for p in parts if p.teacher is not None] == [5, 5, 5, 1]


def test_teacher_advantage_and_jsd_gradient_direction() -> None:
    adv = torch.tensor([0.5])
    teacher = TeacherBatch(
        ids=torch.tensor([[[0], [1]]]),
        logprobs=torch.tensor([[[0.0], [-0.1]]]),
        valid=torch.ones(1, 2, 1, dtype=torch.bool),
        sampled=torch.tensor([[0.0, -0.5]]),
        present=torch.tensor([[False, True]]),
    )
    student = torch.tensor([[0.0, -2.0]])
    mask = torch.tensor([[False, True]])
    got = teacher_advantages(adv, teacher, student, mask, tau=0.5)
    assert got[0].tolist() == pytest.approx([0.5, 0.5 + 0.5 * 1.5])
    # the JSD gradient raises the student's logit of the teacher's token
    logits = torch.zeros(1, 2, 3, requires_grad=True)
    loss = jsd_loss(
        logits, teacher, mask, beta=0.5, temperature=1.0, normalizer=1.0, stats=LossStats()
    )
    loss.backward()
    assert logits.grad is not None and float(logits.grad[0, 0, 1]) < 0.0
