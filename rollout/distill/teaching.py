"""On-policy distillation on the worker: a finished group's trajectories scored by the teacher
service (``deltarl teacher``, docs/teacher.md) and shaped as ``deltarl-traj-v2``'s ``teacher``
map.

Order of calls, in the group's submit task (:meth:`RolloutWorker._send`), after its episodes
ended and its weights were verified::

    request = group_request(group.episodes)   # one request: every trajectory of the group,
                                              # prompt_len = first trained token, the episode's
                                              # sampling temperature (1.0 when greedy)
    answer = await client.score(request)      # TeacherClient: back-off and retries
    teacher = teacher_maps(answer, group.episodes, request)   # TeacherLogprobs per trajectory

Positions: the teacher scores every token from the first trained one on (environment tokens of
later turns too); :func:`~deltarl.teacher.client.trained_view` keeps the positions where the
mask is 1 and lists them in ``positions``.

Hinted turns (``hint_scorer = "teacher"``, docs/distillation.md), in the same submit task::

    request, spans = hint_request(hinted, fmt, top_k)  # one request: per hinted episode, the
                                                       # hinted context + the turn's reply tokens,
                                                       # prompt_len = len(hinted context)
    answer = await client.score(request)
    hints = hint_maps(answer, hinted, request, spans)  # TeacherLogprobs at the turn's positions
                                                       # in the original trajectory
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deltarl.rollout.distill.hints import Hint, hint_items, hint_view
from deltarl.rollout.episodes.chat_format import ChatFormat
from deltarl.rollout.episodes.runner import Episode
from deltarl.services.coordinator.schemas import TeacherLogprobs
from deltarl.teacher.client import first_trained, make_request, trained_view
from deltarl.teacher.wire import LogprobRequest, LogprobResponse

__all__ = [
    "TeacherMismatch",
    "TeacherStats",
    "group_request",
    "hint_maps",
    "hint_request",
    "teacher_maps",
]


@dataclass(slots=True)
class TeacherStats:
    """Counters of a worker's teacher requests (on-policy distillation, and hinted turns with
    ``hint_scorer = "teacher"``; also in ``/metrics``)."""

    requests_ok: int = 0  # group requests answered
    requests_failed: int = 0  # group requests that failed after the client's retry budget
    refused: int = 0  # requests the teacher refused (4xx): distillation drops the group,
    # hinted turns are skipped
    waiting: int = 0  # groups waiting for their teacher data now (a gauge)
    missing: int = 0  # groups submitted without teacher data (teacher_required false)


class TeacherMismatch(ValueError):
    """The teacher cannot score this policy's tokens (a different vocabulary)."""


def temperature_of(ep: Episode) -> float:
    """The temperature the teacher scores an episode at: its sampling temperature (greedy
    episodes: 1.0)."""
    return ep.temperature if ep.temperature and ep.temperature > 0 else 1.0


def group_request(episodes: Sequence[Episode], top_k: int) -> LogprobRequest:
    """One request holding every trajectory of a group."""
    return make_request(
        [ep.tokens for ep in episodes],
        [first_trained(ep.mask) for ep in episodes],
        [temperature_of(ep) for ep in episodes],
        top_k,
    )


def teacher_maps(response: LogprobResponse, episodes: Sequence[Episode]) -> list[TeacherLogprobs]:
    """The ``teacher`` map of each trajectory, in episode order (trained positions only)."""
    out = []
    for i, ep in enumerate(episodes):
        view = trained_view(response, i, ep.mask, first_trained(ep.mask), temperature_of(ep))
        out.append(
            TeacherLogprobs(
                k=view.k,
                temperature=view.temperature,
                sampled=view.sampled.tolist(),
                ids=view.ids.tolist(),
                logprobs=view.logprobs.tolist(),
                positions=view.positions.tolist(),
            )
        )
    return out


def hint_request(
    hinted: Sequence[tuple[Episode, Hint]], fmt: ChatFormat, top_k: int
) -> tuple[LogprobRequest, list[list[int]]]:
    """One request scoring every hinted turn of a group (what the policy scorer scores:
    :func:`~deltarl.rollout.distill.hints.hint_items`), at each episode's temperature; and the turn's
    positions in each original trajectory."""
    items, spans = hint_items(hinted, fmt)
    temperatures = [temperature_of(ep) for ep, _ in hinted]
    request = make_request([t for t, _ in items], [s for _, s in items], temperatures, top_k)
    return request, spans


def hint_maps(
    response: LogprobResponse,
    hinted: Sequence[tuple[Episode, Hint]],
    request: LogprobRequest,
    spans: Sequence[list[int]],
) -> list[TeacherLogprobs]:
    """The ``hint`` map of each hinted turn of :func:`hint_request` (``ValueError`` when the
    answer does not fit the request: another number of sequences, of positions or of top-k)."""
    if response.n != request.n:
        raise ValueError(f"the teacher answered {response.n} sequences for {request.n}")
    out = []
    for i, positions in enumerate(spans):
        sampled, ids, lps = response.sequence(i)
        k = int(request.top_ks[i])
        if len(sampled) != len(positions) or ids.shape[1] != k:
            raise ValueError(
                f"the teacher answered sequence {i} with {len(sampled)} positions x top-"
                f"{ids.shape[1]}; asked for {len(positions)} x top-{k}"
            )
        temperature = temperature_of(hinted[i][0])
        out.append(hint_view(k, temperature, sampled, ids.reshape(-1), lps.reshape(-1), positions))
    return out


def check_vocab(info: dict[str, object], policy_vocab: int | None, url: str) -> None:
    """Raise :class:`TeacherMismatch` unless the teacher's vocabulary is the policy's."""
    teacher_vocab = info.get("vocab_size")
    if policy_vocab is not None and teacher_vocab != policy_vocab:
        raise TeacherMismatch(
            f"the teacher at {url} ({info.get('model')}) has a vocabulary of {teacher_vocab} "
            f"token ids, the policy {policy_vocab}: teacher and student must share a tokenizer "
            "(the teacher scores the policy's token ids as they are)"
        )
