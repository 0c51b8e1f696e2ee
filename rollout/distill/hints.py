"""Hinted self-distillation on the worker: find the turn that went wrong, insert a hint before
it, score that turn's tokens once with the policy (no new decoding), attach the result.

For a finished episode whose reward is below ``hint_below``, a :class:`Hinter` names the turn
where the mistake was made and a hint of at most three sentences. The worker then builds the
hinted context (the conversation up to that turn's user message, the hint as one more user
message, the generation prompt) followed by the turn's original reply tokens, runs one forward
pass of its engine over it (:meth:`Engine.score <deltarl.rollout.engines.base.Engine.score>`),
and attaches, for the turn's tokens, the top-k and the logprob of each sampled token as the
trajectory's ``hint`` (positions in the original trajectory). The trainer pulls the policy,
without the hint, towards that distribution on those tokens only (``loss.hint_coef``,
reverse KL by default: HinT-SD, arXiv 2605.17873; OpenClaw-RL's hindsight hints, 2603.10165;
SDPO, 2601.20802).

Hinters:

* :class:`EnvHinter` (``hint_mode = "env"``): the environment's own hint, computed by the env
  server from its rules and sent with every observation (``observation.hint``): Wordle's names
  the first guess that ignores what earlier feedback established (a letter known absent, a
  green moved, a yellow left out or put back where it was yellow, a repeated word) or the first
  malformed move (``env_server/wordle/hints.py``); charset's names the kinds of characters
  outside the set, or a reply too short, and shows a reply with full marks
  (``env_server/charset/hints.py``). The worker knows no task's rules.
* :class:`ChatHinter` (``hint_mode = "chat"``): any OpenAI-compatible chat endpoint (the teacher
  service, a vLLM server) asked for JSON ``{"failure_turn": int, "hint": str}``; a timeout, an
  HTTP error or an answer that is not that JSON (or names no real turn, or says more than three
  sentences) is skipped and counted, never retried into the trainer's way.

Who computes the hinted distribution (``hint_scorer``): ``policy`` (the default), the worker's
own engine (:func:`score_hints`: the policy at the version the worker holds, on a machine that
is already generating; the trainer never waits for it); ``teacher``, the teacher service, one
request per group of exactly the same sequences (:func:`hint_items`;
:func:`deltarl.rollout.distill.teaching.hint_request`, :func:`~deltarl.rollout.distill.teaching.hint_maps`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from deltarl.env_server.core.wire import MAX_HINT_CHARS
from deltarl.rollout.engines.base import Engine, WeightsGate
from deltarl.rollout.episodes.chat_format import ChatFormat
from deltarl.rollout.episodes.runner import Episode
from deltarl.services.coordinator.schemas import TeacherLogprobs

logger = logging.getLogger(__name__)

_SENTENCE_END = re.compile(r"[.!?](\s|$)")


@dataclass(frozen=True, slots=True)
class Hint:
    """``turn``: index of the model turn that went wrong (0-based); ``text``: the hint."""

    turn: int
    text: str


@dataclass(slots=True)
class HintStats:
    """Counters of one worker's hinting (for logs and metrics)."""

    asked: int = 0  # episodes given to a hinter
    hinted: int = 0  # hints attached
    none: int = 0  # the hinter found nothing to say
    malformed: int = 0  # answers that were not a valid hint (skipped)
    failed: int = 0  # hinter or scoring errors, timeouts (skipped)
    reasons: dict[str, int] = field(default_factory=dict)


class Hinter(Protocol):
    name: str

    async def hint(self, episode: Episode) -> Hint | None:
        """The turn that went wrong and a hint, or None when there is nothing to say."""
        ...


def _sentences(text: str) -> int:
    return len(_SENTENCE_END.findall(text.strip() + " ")) or 1


def check_hint(raw: object, turns: int) -> Hint:
    """A hinter's JSON answer as a :class:`Hint`; ``ValueError`` saying what is wrong."""
    if not isinstance(raw, dict):
        raise ValueError("the answer is not a JSON object")
    turn, text = raw.get("failure_turn"), raw.get("hint")
    if not isinstance(turn, int) or isinstance(turn, bool) or not 0 <= turn < turns:
        raise ValueError(f"failure_turn must be an integer within 0..{turns - 1}, got {turn!r}")
    if not isinstance(text, str) or not text.strip():
        raise ValueError("hint must be a non-empty string")
    text = text.strip()
    if len(text) > MAX_HINT_CHARS or _sentences(text) > 3:
        raise ValueError(f"hint must be at most three sentences and {MAX_HINT_CHARS} characters")
    return Hint(turn=turn, text=text)


class EnvHinter:
    """``hint_mode = "env"``: the environment's own hint, which the env server sends with every
    observation (``observation.hint``: the first mistake of the episode so far by the task's
    rules, e.g. a Wordle guess ignoring earlier feedback, a charset reply outside the set); the
    episode keeps the last one. None when the environment found none (or sends none: another
    OpenEnv server). A hint naming no turn of the episode is refused (``ValueError``)."""

    name = "env"

    async def hint(self, episode: Episode) -> Hint | None:
        found = episode.env_hint
        if found is None:
            return None
        return check_hint({"failure_turn": found.turn, "hint": found.text}, episode.num_turns)


# -- a chat model --------------------------------------------------------------------------------

_INSTRUCTIONS = (
    "You review an agent's multi-turn episode that did not succeed. Find the first turn where "
    "the agent made the mistake that cost it the episode, and write a short hint (at most three "
    "sentences) that would have made it act correctly at that turn, without giving away the "
    'final answer. Answer with JSON only: {"failure_turn": <0-based index of the agent turn>, '
    '"hint": "<text>"}.'
)


class ChatHinter:
    """Asks an OpenAI-compatible ``/v1/chat/completions`` endpoint (module docstring)."""

    name = "chat"

    def __init__(
        self,
        url: str,
        model: str,
        *,
        token: str | None = None,
        timeout_s: float = 20.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(
            base_url=url.rstrip("/"), headers=headers, timeout=timeout_s, transport=transport
        )
        self.model = model

    async def aclose(self) -> None:
        await self._http.aclose()

    @staticmethod
    def transcript(episode: Episode) -> str:
        lines = []
        turn = 0
        for m in episode.messages:
            if m["role"] == "assistant":
                lines.append(f"[agent turn {turn}] {m['content']}")
                turn += 1
            elif m["role"] == "user":
                lines.append(f"[environment] {m['content']}")
        lines.append(f"[final reward] {episode.reward:.3f}")
        return "\n".join(lines)

    async def hint(self, episode: Episode) -> Hint | None:
        body = {
            "model": self.model,
            "messages": [
                {"role": "system", "content": _INSTRUCTIONS},
                {"role": "user", "content": self.transcript(episode)},
            ],
            "temperature": 0.0,
            "max_tokens": 256,
        }
        r = await self._http.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        content = r.json()["choices"][0]["message"]["content"]
        text = content.strip()
        if text.startswith("```"):  # a fenced block: take its inside
            text = text.strip("`").removeprefix("json").strip()
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"the answer is not JSON: {content[:120]!r}") from exc
        return check_hint(raw, episode.num_turns)


# -- scoring the hinted turn ---------------------------------------------------------------------


def hinted_context(episode: Episode, hint: Hint, fmt: ChatFormat) -> list[int]:
    """Tokens of the conversation up to (not including) model turn ``hint.turn``, with the hint
    as one more user message, and the generation prompt."""
    messages, seen = [], 0
    for m in episode.messages:
        if m["role"] == "assistant":
            if seen == hint.turn:
                break
            seen += 1
        messages.append(m)
    return fmt.prompt_ids([*messages, {"role": "user", "content": hint.text}])


def hint_items(
    hinted: Sequence[tuple[Episode, Hint]], fmt: ChatFormat
) -> tuple[list[tuple[list[int], int]], list[list[int]]]:
    """What is scored for each ``(episode, hint)``: ``(hinted context + the turn's reply tokens,
    len(hinted context))``, and the positions of those reply tokens in the original trajectory.
    Both scorers (the policy's engine, the teacher service) score exactly these."""
    items, spans = [], []
    for episode, hint in hinted:
        turn = episode.turns[hint.turn]
        context = hinted_context(episode, hint, fmt)
        items.append(([*context, *episode.tokens[turn.start : turn.end]], len(context)))
        spans.append(list(range(turn.start, turn.end)))
    return items, spans


def hint_view(
    k: int,
    temperature: float,
    sampled: Iterable[float],
    ids: Iterable[int],
    logprobs: Iterable[float],
    positions: list[int],
) -> TeacherLogprobs:
    """A trajectory's ``hint`` map: ``len(positions)`` rows of ``k`` ids and logprobs, flat
    (logprobs clamped to <= 0 against rounding)."""
    return TeacherLogprobs(
        k=k,
        temperature=temperature,
        sampled=[min(0.0, float(x)) for x in sampled],
        ids=[int(i) for i in ids],
        logprobs=[min(0.0, float(x)) for x in logprobs],
        positions=positions,
    )


def score_hints(
    hinted: Sequence[tuple[Episode, Hint]],
    fmt: ChatFormat,
    engine: Engine,
    *,
    k: int,
    temperature: float,
    gate: WeightsGate | None = None,
) -> list[TeacherLogprobs]:
    """Each trajectory's ``hint``: the turn's reply tokens scored after the hinted context, all
    of them in one forward pass of ``engine`` (the ``policy`` scorer)."""
    items, spans = hint_items(hinted, fmt)
    scored = engine.score_batch(items, k, temperature, gate=gate)
    return [
        hint_view(
            k,
            temperature,
            s.sampled,
            (i for row in s.ids for i in row),
            (x for row in s.logprobs for x in row),
            positions,
        )
        for s, positions in zip(scored, spans, strict=True)
    ]


def score_hint(
    episode: Episode,
    hint: Hint,
    fmt: ChatFormat,
    engine: Engine,
    *,
    k: int,
    temperature: float,
    gate: WeightsGate | None = None,
) -> TeacherLogprobs:
    """:func:`score_hints` of one episode."""
    return score_hints([(episode, hint)], fmt, engine, k=k, temperature=temperature, gate=gate)[0]


async def hint_episodes(
    episodes: Sequence[Episode],
    hinter: Hinter,
    score: Callable[[list[tuple[Episode, Hint]]], Awaitable[list[TeacherLogprobs]]],
    stats: HintStats,
    below: float,
) -> dict[int, tuple[TeacherLogprobs, str]]:
    """Hints for the episodes of a group whose reward is below ``below``: ``{index: (hint view,
    text)}``; every failure is counted in ``stats`` and skipped. ``score``: an async callable
    scoring a list of ``(episode, hint)`` at once (one forward pass per group)."""
    found: dict[int, Hint] = {}
    for i, ep in enumerate(episodes):
        if ep.reward >= below or not ep.turns:
            continue
        stats.asked += 1
        try:
            hint = await hinter.hint(ep)
        except ValueError as exc:
            stats.malformed += 1
            logger.info("hinter answer skipped: %s", exc)
            continue
        except Exception as exc:
            stats.failed += 1
            logger.warning("hinter failed (%s): skipped", exc)
            continue
        if hint is None:
            stats.none += 1
            continue
        found[i] = hint
    if not found:
        return {}
    try:
        views = await score([(episodes[i], h) for i, h in found.items()])
    except Exception as exc:
        stats.failed += len(found)
        logger.warning("scoring %d hinted turns failed (%s): skipped", len(found), exc)
        return {}
    stats.hinted += len(found)
    return {i: (v, h.text) for (i, h), v in zip(found.items(), views, strict=True)}
