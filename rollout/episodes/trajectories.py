"""Finished episode groups -> the coordinator's submission (``deltarl-traj-v1``, binary).

Order of calls on a worker, per group::

    group = await runner.run_group(seed=...)            # rollout/episodes/runner.py
    (drop it if any WeightSync.check(completion) == "failed"; wait while "pending")
    sub = to_submission(group, worker_id)               # TrajectoryGroup (validated)
    client.submit(sub)                                  # encode_group(sub): msgpack, raw arrays

Guarantees: the idempotency key depends only on ``(worker_id, group_id)``, so re-submitting the
same group after a lost answer or a restart is accepted once; every trajectory carries the
episode's version span; the payload holds no JSON floats (arrays are raw little-endian bytes,
scalars msgpack float64). :func:`payload_sizes` compares it with JSON encodings of the same
group (docs/rollout-episodes.md has measured numbers).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import zstandard

from deltarl.rollout.episodes.runner import Episode, EpisodeGroup
from deltarl.services.coordinator.schemas import (
    RoutedExperts,
    TeacherLogprobs,
    Trajectory,
    TrajectoryGroup,
    encode_group,
)

__all__ = [
    "PayloadSizes",
    "episode_signals",
    "idempotency_key",
    "json_f32",
    "payload_sizes",
    "to_submission",
    "to_trajectory",
]


def idempotency_key(worker_id: str, group_id: str) -> str:
    """``traj-<32 hex>``: a digest of worker and group ids (stable across retries/restarts)."""
    digest = hashlib.sha256(f"{worker_id}\x00{group_id}".encode()).hexdigest()[:32]
    return f"traj-{digest}"


def episode_signals(ep: Episode) -> dict[str, float]:
    """Named reward components of an episode, as floats.

    Each per-step signal of the environment averaged over the episode's steps (Wordle:
    ``format``, ``valid``, ``greens`` ... the fraction of well-formed / valid replies, the mean
    greens), plus ``turns`` (model replies), ``truncated`` (1.0 if a limit ended it) and
    ``done`` (1.0 if the environment ended it), and the facts its reset decided (the first
    observation's numeric ``info``: Wordle's ``max_guesses``, which a guess curriculum
    varies). The per-step values stay in ``ep.turns``.
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for turn in ep.turns:
        for k, v in turn.signals.items():
            sums[k] = sums.get(k, 0.0) + v
            counts[k] = counts.get(k, 0) + 1
    out = {k: sums[k] / counts[k] for k in sums}
    out.update(
        turns=float(ep.num_turns),
        truncated=1.0 if ep.truncated else 0.0,
        done=1.0 if ep.done else 0.0,
    )
    for k, v in ep.facts.items():
        out.setdefault(k, v)
    return out


def to_trajectory(
    ep: Episode,
    *,
    reward: float | None = None,
    hint: tuple[TeacherLogprobs, str] | None = None,
    teacher: TeacherLogprobs | None = None,
) -> Trajectory:
    """One episode as a wire :class:`Trajectory` (``reward`` overrides ``ep.reward``; ``hint``:
    the hinted turn's scores and the hint's text, :mod:`deltarl.rollout.distill.hints`; ``teacher``: the
    teacher's scores at the trained positions, :mod:`deltarl.rollout.distill.teaching`).

    Each turn's end and reward travel with it (``turn_ends``/``turn_rewards``, the trainer's
    per-turn credit) unless ``reward`` overrides the episode's: the turns' rewards would then
    not add up to it.

    Raises ``ValueError`` if the episode has no versions (an unmanaged engine without
    ``policy_version``) or no sampled token.
    """
    lo, hi = ep.version_min, ep.version_max
    if lo is None or hi is None:
        raise ValueError(
            f"episode {ep.group_id}/{ep.index} has no policy version: generate through a "
            "WeightSync, or give the runner policy_version="
        )
    if not ep.turns:
        raise ValueError(f"episode {ep.group_id}/{ep.index} has no model turn to train on")
    return Trajectory(
        tokens=ep.tokens,
        logprobs=ep.logprobs,
        mask=ep.mask,
        prompt_len=ep.prompt_len,
        reward=ep.reward if reward is None else reward,
        signals=episode_signals(ep),
        version_min=lo,
        version_max=hi,
        temperature=ep.temperature,
        turn_ends=[t.end for t in ep.turns] if reward is None else None,
        turn_rewards=[t.reward for t in ep.turns] if reward is None else None,
        hint=None if hint is None else hint[0],
        hint_text=None if hint is None else hint[1],
        teacher=teacher,
        routed_experts=None if ep.routed_experts is None else RoutedExperts.of(ep.routed_experts),
    )


def to_submission(
    group: EpisodeGroup,
    worker_id: str,
    *,
    reward: Callable[[Episode], float] | None = None,
    key: str | None = None,
    hints: Mapping[int, tuple[TeacherLogprobs, str]] | None = None,
    teacher: Sequence[TeacherLogprobs] | None = None,
) -> TrajectoryGroup:
    """The group as the coordinator's :class:`TrajectoryGroup` (validated by pydantic).

    ``reward``: optional shaping, episode -> scalar (default: the environment's final reward).
    ``key``: idempotency key (default :func:`idempotency_key` of worker and group).
    ``hints``: by episode index, the hinted turn's scores and the hint (hinted self-distillation).
    ``teacher``: the teacher's map of each episode, in order (on-policy distillation).
    """
    if teacher is not None and len(teacher) != len(group.episodes):
        raise ValueError(f"{len(teacher)} teacher maps for {len(group.episodes)} episodes")
    return TrajectoryGroup(
        idempotency_key=key or idempotency_key(worker_id, group.group_id),
        worker_id=worker_id,
        group_id=group.group_id,
        trajectories=[
            to_trajectory(
                ep,
                reward=None if reward is None else reward(ep),
                hint=None if hints is None else hints.get(i),
                teacher=None if teacher is None else teacher[i],
            )
            for i, ep in enumerate(group.episodes)
        ],
    )


@dataclass(frozen=True, slots=True)
class PayloadSizes:
    """Bytes of one group in several encodings.

    ``binary``: the ``deltarl-traj-v1`` msgpack payload that is sent. ``json``: the same group
    as pydantic writes it (each logprob as float64 text, up to 17 significant digits).
    ``json_f32``: compact JSON with each logprob in its shortest float32 text (the smallest
    faithful JSON). ``binary_zstd`` / ``json_f32_zstd``: those compressed with zstd level 3 (not
    sent today; the G episodes of a group share their prompt, which zstd removes).
    """

    binary: int
    json: int
    json_f32: int
    binary_zstd: int
    json_f32_zstd: int

    @property
    def ratio(self) -> float:
        """``json / binary``: how many times smaller the payload is than pydantic's JSON."""
        return self.json / self.binary


def json_f32(group: TrajectoryGroup) -> bytes:
    """``group`` as compact JSON with each logprob in its shortest float32 text (what
    :attr:`PayloadSizes.json_f32` measures; ``json.loads`` gives back the same float32 values)."""
    body = group.model_dump(mode="json")
    texts = []
    for i, t in enumerate(body["trajectories"]):
        values = np.asarray(t["logprobs"], dtype=np.float32)
        texts.append(",".join(str(v) for v in values))  # shortest text that round-trips
        t["logprobs"] = f"@@LOGPROBS{i}@@"
    text = json.dumps(body, separators=(",", ":"))
    for i, floats in enumerate(texts):
        text = text.replace(f'"@@LOGPROBS{i}@@"', f"[{floats}]", 1)
    return text.encode()


def payload_sizes(group: TrajectoryGroup) -> PayloadSizes:
    """Sizes of ``group`` as the binary payload and as JSON (see :class:`PayloadSizes`)."""
    binary, compact = encode_group(group), json_f32(group)
    zstd = zstandard.ZstdCompressor(level=3)
    return PayloadSizes(
        binary=len(binary),
        json=len(group.model_dump_json()),
        json_f32=len(compact),
        binary_zstd=len(zstd.compress(binary)),
        json_f32_zstd=len(zstd.compress(compact)),
    )
