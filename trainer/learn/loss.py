"""The GRPO objective for asynchronous training: advantages, PPO-clip, off-policy correction.

Pure torch, no I/O. Shapes: ``B`` sequences of ``T`` token positions (prompt and completion
together, right-padded), ``V`` vocabulary entries. Every per-token tensor is aligned with the
tokens: position ``t`` holds something about token ``t`` (its logprob given the tokens before it),
the convention of the trajectory wire format, so worker logprobs need no shifting. Log
probabilities are natural logs (nats).

Three policies take part (the decoupled PPO objective of asynchronous RL):

* the **behaviour** policy ``mu``: the weights (and inference engine) that sampled the tokens;
  its logprobs come from the workers, possibly several versions old;
* the **proximal** policy ``pi_prox``: the centre of the PPO trust region;
* the **current** policy ``pi_theta``: the trainer's weights, with gradient.

Per trained token (``loss_mask`` 1), with advantage ``A``::

    r   = exp(log pi_theta - log pi_prox)                  PPO ratio
    L   = -w * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)
          + kl_coef * k3(pi_ref, pi_theta)
    k3  = exp(log pi_ref - log pi_theta) - (log pi_ref - log pi_theta) - 1

``w`` is the off-policy importance weight, from ``rho = pi_prox / mu``:

=====================  ===================================================================
``importance_sampling``  ``w``
=====================  ===================================================================
``none``               1
``token_truncate``     ``min(rho_t, C)`` per token
``token_mask``         ``rho_t`` per token, 0 where ``rho_t > C``
``sequence_truncate``  ``min(prod_t rho_t, C)``, one weight for all tokens of a sequence
``sequence_mask``      ``prod_t rho_t``, the whole sequence 0 where it exceeds ``C``
=====================  ===================================================================

(TRL's ``vllm_importance_sampling_mode`` with ``vllm_importance_sampling_cap = C``; ``w`` carries
no gradient.) The proximal policy is ``proximal_logprobs`` when given (the trainer's own logprobs
of the batch before its first update, needed when a batch serves several updates). Without it:
with ``importance_sampling="none"`` it is the behaviour policy (plain asynchronous PPO: the ratio
is taken against the workers' logprobs and the clip bounds staleness and update together); with
an importance-sampling mode it is the current policy, detached (one update per batch, as TRL):
``r`` is 1 in value and carries the gradient, ``rho = pi_theta / mu``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from deltarl.trainer.settings import AdvantageScale, LossSettings

__all__ = [
    "LossOutput",
    "LossStats",
    "advantage_metrics",
    "group_advantages",
    "grpo_loss",
    "token_entropy",
    "token_logprobs",
]


# ---------------------------------------------------------------------------------------------
# advantages


def group_advantages(
    rewards: Tensor, group_ids: Tensor, *, scale: AdvantageScale = "group", eps: float = 1e-4
) -> Tensor:
    """Group-normalised advantages of ``N`` samples.

    ``rewards`` [N] (reward units), ``group_ids`` [N] integers: samples with the same id answer
    the same prompt (groups may differ in size). Returns [N] float32::

        A_i = (r_i - mean_g(r)) / (std + eps)

    where ``std`` is the unbiased std of the sample's group (``scale="group"``, GRPO), of all
    ``N`` rewards (``"batch"``), or no division at all (``"none"``, DR-GRPO). A group of one
    sample has std 0 and advantage 0; a group whose rewards are all equal gets advantage 0.
    """
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be [N]; got {list(rewards.shape)} and "
            f"{list(group_ids.shape)}"
        )
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    r = rewards.detach().to(torch.float32)
    if r.numel() == 0:
        return r
    _, inv = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inv.max()) + 1
    count = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(
        0, inv, torch.ones_like(r)
    )
    mean = torch.zeros_like(count).index_add_(0, inv, r) / count
    centered = r - mean[inv]
    if scale == "none":
        return centered
    if scale == "group":
        sq = torch.zeros_like(count).index_add_(0, inv, centered * centered)
        std = (sq / (count - 1).clamp(min=1)).sqrt()[inv]
    else:
        std = r.std() if r.numel() > 1 else r.new_zeros(())
    return centered / (std + eps)


def advantage_metrics(
    rewards: Tensor, group_ids: Tensor, advantages: Tensor, loss_mask: Tensor | None = None
) -> dict[str, float]:
    """Per-step reward and advantage statistics (floats, for logging).

    ``reward/mean``, ``reward/std`` (unbiased), ``advantage/{mean,std,min,max}`` and
    ``reward/zero_std_group_frac``: fraction of groups whose rewards are all equal (they carry
    no learning signal under GRPO). ``advantages``: [N] per sequence, or [N, T] per token
    (per-turn credit), whose statistics are then over the trained tokens (``loss_mask``).
    """
    r = rewards.detach().double()
    a = advantages.detach().double()
    if a.dim() == 2:
        if loss_mask is None or loss_mask.shape != a.shape:
            raise ValueError("per-token advantages need the [N, T] loss_mask of their tokens")
        a = a[loss_mask.bool()]
        if a.numel() == 0:
            a = a.new_zeros(1)
    if r.numel() == 0:
        return {}
    _, inv = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inv.max()) + 1
    hi = torch.full((n_groups,), -math.inf, dtype=r.dtype, device=r.device).scatter_reduce(
        0, inv, r, "amax"
    )
    lo = torch.full((n_groups,), math.inf, dtype=r.dtype, device=r.device).scatter_reduce(
        0, inv, r, "amin"
    )
    many = r.numel() > 1
    return {
        "reward/mean": float(r.mean()),
        "reward/std": float(r.std()) if many else 0.0,
        "reward/zero_std_group_frac": float((hi == lo).double().mean()),
        "advantage/mean": float(a.mean()),
        "advantage/std": float(a.std()) if a.numel() > 1 else 0.0,
        "advantage/min": float(a.min()),
        "advantage/max": float(a.max()),
    }


# ---------------------------------------------------------------------------------------------
# logprobs and entropy from logits


Temperature = float | Tensor
"""One sampling temperature for every row, or a [B] tensor of one per row (sequence)."""


def _rows(
    logits: Tensor, tokens: Tensor | None, fn: Callable[..., Tensor], temperature: Temperature
) -> Tensor:
    """Apply ``fn`` one sequence at a time (bounds the float32 copy of the logits to [T, V])."""
    temps = (
        temperature.tolist()
        if isinstance(temperature, Tensor)
        else [float(temperature)] * logits.shape[0]
    )
    if len(temps) != logits.shape[0]:
        raise ValueError(f"{len(temps)} temperatures for {logits.shape[0]} sequences")
    out = [
        fn(logits[b], None if tokens is None else tokens[b], temps[b])
        for b in range(logits.shape[0])
    ]
    return torch.stack(out) if out else logits.new_zeros(logits.shape[:2], dtype=torch.float32)


def _row_logprobs(logits: Tensor, tokens: Tensor | None, temperature: float = 1.0) -> Tensor:
    assert tokens is not None
    x = logits[:-1].float()
    if temperature != 1.0:
        x = x / temperature
    picked = x.gather(-1, tokens[1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked - torch.logsumexp(x, dim=-1), (1, 0))


def _row_entropy(logits: Tensor, _: Tensor | None, temperature: float = 1.0) -> Tensor:
    x = logits[:-1].float()
    if temperature != 1.0:
        x = x / temperature
    logp = torch.log_softmax(x, dim=-1)
    return torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (1, 0))


def _check_temperature(temperature: Temperature) -> None:
    ok = (
        bool((temperature > 0).all()) and bool(torch.isfinite(temperature).all())
        if isinstance(temperature, Tensor)
        else temperature > 0
    )
    if not ok:
        raise ValueError(
            f"temperature must be > 0, got {temperature} (greedy samples carry no logprobs to "
            "train on)"
        )


def token_logprobs(logits: Tensor, tokens: Tensor, *, temperature: Temperature = 1.0) -> Tensor:
    """Logprob of each token under a causal LM: [B, T] float32 (nats), with gradient.

    ``logits`` [B, T, V] is the model's output for ``tokens`` [B, T] (position ``t`` predicts
    token ``t + 1``). Position ``t`` of the result holds ``log p(tokens[t] | tokens[:t])``;
    position 0 (nothing predicts it) holds 0. Same alignment as the workers' logprobs.
    ``temperature``: the distribution is ``softmax(logits / temperature)`` (in float32), the
    one the workers sampled from at that temperature; a [B] tensor gives each sequence its own.
    """
    if logits.dim() != 3 or tokens.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be [B, T, V] and tokens [B, T]; got {list(logits.shape)} and "
            f"{list(tokens.shape)}"
        )
    _check_temperature(temperature)
    return _rows(logits, tokens, _row_logprobs, temperature)


@torch.no_grad()
def token_entropy(logits: Tensor, *, temperature: Temperature = 1.0) -> Tensor:
    """Entropy (nats) of the distribution that produced each token: [B, T] float32, no grad.

    Aligned as :func:`token_logprobs`: position ``t`` holds the entropy of the prediction made at
    ``t - 1`` (of ``softmax(logits / temperature)``); position 0 holds 0.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V]; got {list(logits.shape)}")
    _check_temperature(temperature)
    return _rows(logits, None, _row_entropy, temperature)


# ---------------------------------------------------------------------------------------------
# statistics that survive gradient accumulation


@dataclass(slots=True)
class LossStats:
    """Metrics of one or several micro-batches, mergeable without losing exactness.

    Each metric is a detached 0-dim tensor in one of four families: ``sums`` (added up on
    merge), ``means`` (kept as (sum, count) pairs, so merged means are weighted by tokens or
    sequences), ``mins`` and ``maxs``. :meth:`summary` turns them into floats (one host sync per
    metric; call it once per optimizer step).
    """

    sums: dict[str, Tensor] = field(default_factory=dict)
    means: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    mins: dict[str, Tensor] = field(default_factory=dict)
    maxs: dict[str, Tensor] = field(default_factory=dict)

    def add_sum(self, name: str, value: Tensor) -> None:
        v = value.detach().double()
        self.sums[name] = self.sums[name] + v if name in self.sums else v

    def add_values(self, name: str, values: Tensor, *, extrema: bool = False) -> None:
        """Record a mean of ``values`` (any shape, all counted; empty: nothing recorded)."""
        v = values.detach().double().reshape(-1)
        if v.numel() == 0:
            return
        s, c = v.sum(), v.new_tensor(float(v.numel()))
        if name in self.means:
            s0, c0 = self.means[name]
            s, c = s0 + s, c0 + c
        self.means[name] = (s, c)
        if extrema:
            lo, hi = v.min(), v.max()
            self.mins[name] = torch.minimum(self.mins[name], lo) if name in self.mins else lo
            self.maxs[name] = torch.maximum(self.maxs[name], hi) if name in self.maxs else hi

    def merge(self, other: LossStats) -> LossStats:
        """A new :class:`LossStats` holding both (``self`` and ``other`` are unchanged)."""
        out = LossStats(dict(self.sums), dict(self.means), dict(self.mins), dict(self.maxs))
        for k, v in other.sums.items():
            out.add_sum(k, v)
        for k, (s, c) in other.means.items():
            s0, c0 = out.means.get(k, (s.new_zeros(()), c.new_zeros(())))
            out.means[k] = (s0 + s, c0 + c)
        for k, v in other.mins.items():
            out.mins[k] = torch.minimum(out.mins[k], v) if k in out.mins else v
        for k, v in other.maxs.items():
            out.maxs[k] = torch.maximum(out.maxs[k], v) if k in out.maxs else v
        return out

    def summary(self) -> dict[str, float]:
        """``{name: value}``; means as ``name/mean``, extrema as ``name/min`` and ``name/max``
        (a mean without extrema keeps its bare name), sums under their own name."""
        out: dict[str, float] = {k: float(v) for k, v in self.sums.items()}
        for k, (s, c) in self.means.items():
            has_extrema = k in self.mins
            out[f"{k}/mean" if has_extrema else k] = float(s / c) if float(c) else 0.0
        for k, v in self.mins.items():
            out[f"{k}/min"] = float(v)
        for k, v in self.maxs.items():
            out[f"{k}/max"] = float(v)
        return dict(sorted(out.items()))


@dataclass(slots=True)
class LossOutput:
    """What :func:`grpo_loss` returns: the scalar to backpropagate and its metrics."""

    loss: Tensor  # 0-dim, with gradient
    stats: LossStats


# ---------------------------------------------------------------------------------------------
# the objective


MAX_LOG_RATIO = 20.0  # cap of log(pi_theta / pi_prox) in the PPO ratio (exp(20) ~ 4.9e8)


def _check(name: str, t: Tensor | None, shape: torch.Size) -> None:
    if t is not None and t.shape != shape:
        raise ValueError(
            f"{name} must have shape {list(shape)} (like logprobs), got {list(t.shape)}"
        )


def _importance_weights(
    log_rho: Tensor, mask: Tensor, mode: str, cap: float, stats: LossStats
) -> Tensor:
    """Weights ``w`` ([B, T] or [B, 1], detached) from masked log-ratios ``log(pi_prox / mu)``.

    Computed in log space, so a huge ratio never becomes ``inf`` (``inf * 0`` would be NaN).
    """
    log_cap = math.log(cap)
    if mode.startswith("sequence"):
        log_rho = log_rho.sum(-1, keepdim=True)  # product of token ratios
        counted = mask.any(-1, keepdim=True)  # sequences with at least one trained token
    else:
        counted = mask
    above = log_rho > log_cap
    w = torch.exp(log_rho.clamp(max=log_cap))
    if mode.endswith("mask"):
        w = torch.where(above, torch.zeros_like(w), w)
    stats.add_values("is/capped_frac", above[counted].double())
    stats.add_values("is/weight", w[counted], extrema=True)
    return w


def grpo_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    settings: LossSettings | None = None,
    *,
    proximal_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    logits: Tensor | None = None,
    normalizer: float | None = None,
    temperature: Temperature = 1.0,
) -> LossOutput:
    """The GRPO loss of one (micro-)batch and its metrics (see the module docstring).

    Args:
        logprobs: [B, T] ``log pi_theta`` of each token (nats), with gradient.
        behaviour_logprobs: [B, T] ``log mu`` from the workers (0 where the mask is 0).
        advantages: [B] per sequence (broadcast over its tokens) or [B, T] per token.
        loss_mask: [B, T] bool or 0/1: the tokens trained on (the policy's own tokens).
        settings: clip range, aggregation, importance sampling, KL (default: :class:`LossSettings`).
        proximal_logprobs: [B, T] ``log pi_prox`` (detached), or None (see the module docstring).
        ref_logprobs: [B, T] logprobs of the reference policy; required when ``kl_coef > 0``.
        logits: [B, T, V] model output for the same tokens; only used for the entropy metric.
        temperature: the sampling temperature ``logits`` are divided by for the entropy metric
            (``logprobs`` must already be those of ``softmax(logits / temperature)``); a float
            or a [B] tensor (one per sequence).
        normalizer: overrides the denominator of the aggregation: the number of trained tokens
            (``token_mean``) or of sequences (``sequence_mean``) of the *whole optimizer step*,
            or the constant of ``sum``. Pass it when accumulating gradients over micro-batches,
            so that the summed micro-batch losses equal the loss of the whole step.

    Values outside the mask never reach the loss or its gradient (they may be padding garbage,
    even ``-inf``). Returns :class:`LossOutput`; ``stats`` holds ``loss``, ``tokens``,
    ``sequences`` (sums), ``policy_loss``, ``ratio`` (min/mean/max), ``clip/low_frac``,
    ``clip/high_frac``, ``clip/frac``, ``mismatch/ratio`` (min/mean/max of ``pi_theta / mu``),
    ``mismatch/kl`` (k3 estimate of KL(mu || pi_theta) per token), ``mismatch/abs_logprob_diff``
    (mean/max), ``is/weight`` and ``is/capped_frac`` (with importance sampling), ``kl_ref``
    (with a reference) and ``entropy`` (with logits), all per trained token except ``is/*`` of
    the sequence modes (per sequence).
    """
    s = settings if settings is not None else LossSettings()
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got {list(logprobs.shape)}")
    shape = logprobs.shape
    _check("behaviour_logprobs", behaviour_logprobs, shape)
    _check("loss_mask", loss_mask, shape)
    _check("proximal_logprobs", proximal_logprobs, shape)
    _check("ref_logprobs", ref_logprobs, shape)
    if advantages.shape not in (shape, shape[:1]):
        raise ValueError(
            f"advantages must be [B] or [B, T] with B, T = {list(shape)}, got {list(advantages.shape)}"
        )
    if s.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (logprobs of the reference policy)")
    if normalizer is not None and not normalizer > 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")
    if logits is not None and (logits.dim() != 3 or logits.shape[:2] != shape):
        raise ValueError(
            f"logits must be [B, T, V] with B, T = {list(shape)}, got {list(logits.shape)}"
        )

    mask = loss_mask.bool()
    m = mask.to(torch.float32)

    def clean(t: Tensor) -> Tensor:  # float32, 0 outside the mask (keeps exp() finite)
        return torch.where(mask, t.to(torch.float32), torch.zeros((), device=t.device))

    lp = clean(logprobs)
    lp_det = lp.detach()
    behav = clean(behaviour_logprobs.detach())
    adv = advantages.detach().to(torch.float32)
    adv = clean(adv[:, None].expand(shape) if adv.dim() == 1 else adv)
    stats = LossStats()

    if proximal_logprobs is not None:
        prox = clean(proximal_logprobs.detach())
    elif s.importance_sampling == "none":
        prox = behav
    else:
        prox = lp_det

    # PPO clip; the log-ratio is capped so that no value a worker sent (logprobs as low as
    # -1e4 are accepted) can make it inf: past e^20 the clip has long decided, and the capped
    # tokens get no gradient (as dual-clip PPO bounds them)
    ratio = torch.exp((lp - prox).clamp(max=MAX_LOG_RATIO))
    clipped = ratio.clamp(1.0 - s.clip_low, 1.0 + s.clip_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    if s.importance_sampling != "none":
        per_token = per_token * _importance_weights(
            prox - behav, mask, s.importance_sampling, s.importance_sampling_cap, stats
        )
    stats.add_values("policy_loss", per_token.detach()[mask])
    if ref_logprobs is not None:
        d = clean(ref_logprobs.detach()) - lp
        kl = torch.exp(d) - d - 1.0
        stats.add_values("kl_ref", kl.detach()[mask])
        if s.kl_coef > 0:
            per_token = per_token + s.kl_coef * kl

    # aggregation
    total = torch.where(mask, per_token, torch.zeros((), device=per_token.device))
    if s.aggregation == "token_mean":
        denom = normalizer if normalizer is not None else m.sum().clamp(min=1.0)
        loss = total.sum() / denom
    elif s.aggregation == "sequence_mean":
        per_seq = total.sum(-1) / m.sum(-1).clamp(min=1.0)
        loss = per_seq.sum() / (normalizer if normalizer is not None else max(shape[0], 1))
    else:
        loss = total.sum() / (normalizer if normalizer is not None else s.sum_normalizer)

    # metrics
    with torch.no_grad():
        stats.add_sum("loss", loss)
        stats.add_sum("tokens", m.sum())
        stats.add_sum("sequences", mask.any(-1).sum())
        r, a = ratio.detach()[mask], adv[mask]
        low = (r < 1.0 - s.clip_low) & (a < 0)
        high = (r > 1.0 + s.clip_high) & (a > 0)
        stats.add_values("ratio", r, extrema=True)
        stats.add_values("clip/low_frac", low.double())
        stats.add_values("clip/high_frac", high.double())
        stats.add_values("clip/frac", (low | high).double())
        log_mm = (lp_det - behav)[mask]
        mm = torch.exp(log_mm)
        stats.add_values("mismatch/ratio", mm, extrema=True)
        stats.add_values("mismatch/kl", mm - log_mm - 1.0)
        stats.add_values("mismatch/abs_logprob_diff", log_mm.abs(), extrema=True)
        if logits is not None:
            stats.add_values("entropy", token_entropy(logits, temperature=temperature)[mask])
    return LossOutput(loss=loss, stats=stats)
