"""On-policy distillation losses over a teacher's top-k (plus one tail bucket).

The workers submit, for each trained position of a trajectory, the teacher's logprob of the
sampled token and its top-k token ids with their logprobs (``TeacherLogprobs`` of the trajectory
wire format). Two ways to use them, selected by ``loss.distill``:

* ``"jsd"``: the generalized Jensen-Shannon divergence between the teacher's distribution ``p``
  and the student's ``q`` (``softmax(logits / T)``, with gradient), both reduced to ``K + 1``
  buckets: the teacher's top-k ids and one tail bucket holding the rest of the mass
  (``1 - sum of the top-k``, for each distribution on its own). With ``beta = distill_beta``::

      beta = 0:   KL(p || q)                       (forward KL: mass covering)
      beta = 1:   KL(q || p)                       (reverse KL: mode seeking)
      otherwise:  beta * KL(p || m) + (1 - beta) * KL(q || m),  m = beta * p + (1 - beta) * q

  (TRL's ``generalized_jsd_loss`` convention.) The per-position value is aggregated like the
  policy loss (same normalizer) and added with weight ``distill_coef``.
* ``"teacher_advantage"``: no extra term; each trained token's advantage becomes
  ``A + teacher_tau * (teacher_lp - student_lp)`` (detached), the reward-plus-teacher advantage
  of prime-rl and NeMo-RL: tokens the teacher likes more than the student get pushed up.

**Hinted self-distillation** uses the same machinery: a trajectory's ``hint`` holds, for the
tokens of the turn that went wrong, the top-k the policy gave them once a hint was inserted as
a user message before that turn (one forward pass, no new decoding). The policy, without the
hint, is trained on those tokens only towards that distribution: ``hint_coef`` x the JSD with
``hint_beta`` (default 1: reverse KL, as HinT-SD), next to the RL loss; metrics ``hint/*``.

Positions without teacher data (a trajectory submitted without it) contribute nothing to the
distillation term; ``distill/coverage`` reports the share of trained tokens that had it.
Metrics, both modes: ``distill/coverage``, ``distill/teacher_logprob`` (of the sampled tokens)
and ``distill/teacher_minus_student``; with ``"jsd"`` also ``distill/loss`` (the JSD term),
``distill/kl_teacher`` (forward KL over the buckets), ``distill/topk_mass_teacher`` and
``distill/topk_mass_student`` (mass of the top-k under each).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from deltarl.trainer.learn.loss import LossStats, Temperature

_TINY = 1e-12


@dataclass(frozen=True, slots=True)
class TeacherBatch:
    """A teacher's view of a padded batch (aligned with ``TrainBatch.tokens`` [B, T])."""

    ids: Tensor  # [B, T, K] int64 top-k ids (0 where invalid)
    logprobs: Tensor  # [B, T, K] float32 teacher logprobs (0 where invalid)
    valid: Tensor  # [B, T, K] bool: a real top-k entry (k may differ between trajectories)
    sampled: Tensor  # [B, T] float32 teacher logprob of the sampled token (0 where none)
    present: Tensor  # [B, T] bool: this position has teacher data

    def select(self, rows: slice | Tensor, width: int) -> TeacherBatch:
        return TeacherBatch(
            ids=self.ids[rows, :width],
            logprobs=self.logprobs[rows, :width],
            valid=self.valid[rows, :width],
            sampled=self.sampled[rows, :width],
            present=self.present[rows, :width],
        )

    def to(self, device: torch.device) -> TeacherBatch:
        return TeacherBatch(
            ids=self.ids.to(device, non_blocking=True),
            logprobs=self.logprobs.to(device, non_blocking=True),
            valid=self.valid.to(device, non_blocking=True),
            sampled=self.sampled.to(device, non_blocking=True),
            present=self.present.to(device, non_blocking=True),
        )


def _log1mexp(lse: Tensor) -> Tensor:
    """``log(1 - exp(lse))`` for ``lse <= 0``, clamped away from ``log(0)``."""
    x = lse.clamp(max=-_TINY)
    # the two branches of the stable formula (Maechler 2012)
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def bucket_logprobs(topk_lp: Tensor, valid: Tensor) -> Tensor:
    """[..., K + 1] log-probabilities of the top-k entries and of the tail (the rest)."""
    masked = torch.where(valid, topk_lp, torch.full_like(topk_lp, -math.inf))
    lse = torch.logsumexp(masked, dim=-1, keepdim=True)
    tail = _log1mexp(lse).clamp(min=math.log(_TINY))
    return torch.cat([masked, tail], dim=-1)


def _kl(a: Tensor, b: Tensor, valid: Tensor) -> Tensor:
    """KL(a || b) over the last dim of log-probabilities (invalid buckets skipped)."""
    terms = torch.where(valid, a.exp() * (a - b), torch.zeros_like(a))
    return terms.sum(-1)


def generalized_jsd(student: Tensor, teacher: Tensor, valid: Tensor, beta: float) -> Tensor:
    """Per-position generalized JSD (module docstring) of bucket log-probabilities [..., K+1]."""
    if beta == 0.0:
        return _kl(teacher, student, valid)
    if beta == 1.0:
        return _kl(student, teacher, valid)
    mix = torch.logsumexp(
        torch.stack([student + math.log(1.0 - beta), teacher + math.log(beta)]), dim=0
    )
    return beta * _kl(teacher, mix, valid) + (1.0 - beta) * _kl(student, mix, valid)


def _student_topk(logits: Tensor, ids: Tensor, temperature: Temperature) -> Tensor:
    """[B, T, K] student logprobs of the teacher's ids, aligned as the token logprobs: the value
    at position ``t`` comes from the prediction made at ``t - 1`` (position 0: 0)."""
    b = logits.shape[0]
    temps = temperature.tolist() if isinstance(temperature, Tensor) else [float(temperature)] * b
    rows = []
    for i in range(b):
        x = logits[i, :-1].float()
        if temps[i] != 1.0:
            x = x / temps[i]
        lp = torch.log_softmax(x, dim=-1).gather(-1, ids[i, 1:])
        rows.append(torch.nn.functional.pad(lp, (0, 0, 1, 0)))
    return torch.stack(rows) if rows else logits.new_zeros(ids.shape, dtype=torch.float32)


def jsd_loss(
    logits: Tensor,
    teacher: TeacherBatch,
    loss_mask: Tensor,
    *,
    beta: float,
    temperature: Temperature,
    normalizer: float,
    stats: LossStats,
    prefix: str = "distill/",
) -> Tensor:
    """The summed JSD term over trained positions with teacher data, divided by ``normalizer``
    (the policy loss's token normalizer), with gradient; metrics go to ``stats`` (named
    ``prefix`` + ``loss``, ``kl_teacher``, ``topk_mass_teacher``, ``topk_mass_student``)."""
    where = loss_mask.bool() & teacher.present
    student_k = _student_topk(logits, teacher.ids, temperature)
    s = bucket_logprobs(student_k, teacher.valid)
    t = bucket_logprobs(teacher.logprobs.float(), teacher.valid)
    valid = torch.cat([teacher.valid, torch.ones_like(teacher.valid[..., :1])], dim=-1)
    per_pos = generalized_jsd(s, t, valid, beta)
    total = torch.where(where, per_pos, torch.zeros_like(per_pos)).sum() / normalizer
    with torch.no_grad():
        stats.add_sum(prefix + "loss", total.detach())
        if where.any():
            stats.add_values(prefix + "kl_teacher", _kl(t, s.detach(), valid)[where])
            stats.add_values(prefix + "topk_mass_teacher", (1 - t[..., -1].exp())[where])
            stats.add_values(prefix + "topk_mass_student", (1 - s.detach()[..., -1].exp())[where])
    return total


def teacher_advantages(
    advantages: Tensor,
    teacher: TeacherBatch,
    student_logprobs: Tensor,
    loss_mask: Tensor,
    tau: float,
) -> Tensor:
    """[B, T] ``A + tau * (teacher_lp - student_lp)`` on trained positions with teacher data,
    ``A`` elsewhere (detached)."""
    adv = advantages.detach().float()
    adv = adv[:, None].expand(student_logprobs.shape) if adv.dim() == 1 else adv
    where = loss_mask.bool() & teacher.present
    bonus = tau * (teacher.sampled.float() - student_logprobs.detach().float())
    return torch.where(where, adv + bonus, adv)


def teacher_stats(
    teacher: TeacherBatch, student_logprobs: Tensor, loss_mask: Tensor, stats: LossStats
) -> None:
    """Coverage, the teacher's logprob of the sampled tokens and its gap to the student's."""
    mask = loss_mask.bool()
    where = mask & teacher.present
    with torch.no_grad():
        stats.add_values("distill/coverage", where[mask].double())
        if where.any():
            stats.add_values("distill/teacher_logprob", teacher.sampled.float()[where])
            gap = teacher.sampled.float() - student_logprobs.detach().float()
            stats.add_values("distill/teacher_minus_student", gap[where])
