"""What a finished group carries besides its trajectories: hinted self-distillation targets
(:mod:`deltarl.rollout.distill.hints`) and the teacher's logprobs (:mod:`deltarl.rollout.distill.teaching`).

The rollout worker owns one :class:`GroupTargets` and, in a group's submit task after its
weights were verified, asks it for the group's targets::

    targets = GroupTargets(settings, experiment, fmt, sync, on_error=..., stop=...)
    await targets.open()                     # the teacher client; checks its vocabulary once
    hints, teacher = await targets.of(group) # {episode: (TeacherLogprobs, hint text)}, and one
                                             # TeacherLogprobs per trajectory (or None)
    ...
    await targets.aclose()

:meth:`GroupTargets.of` raises :class:`TeacherRefused` when the teacher refuses the group's
request (the worker drops the group) or cannot score this policy at all (another vocabulary:
``fatal`` is set and ``stop`` called; the worker raises ``fatal`` when its loop ends). Failures
that a retry may cure are counted (``hint_stats``, ``teacher_stats``) and, unless
``teacher_required``, the group goes without those targets.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx

from deltarl.rollout.distill.hints import (
    ChatHinter,
    EnvHinter,
    Hint,
    Hinter,
    HintStats,
    hint_episodes,
    score_hints,
)
from deltarl.rollout.distill.teaching import (
    TeacherMismatch,
    TeacherStats,
    check_vocab,
    group_request,
    hint_maps,
    hint_request,
    teacher_maps,
)
from deltarl.rollout.episodes.chat_format import ChatFormat
from deltarl.rollout.episodes.runner import Episode, EpisodeGroup
from deltarl.rollout.settings import HintSettings, RolloutSettings, WorkerExperiment
from deltarl.rollout.sync.weights import WeightSync
from deltarl.services.coordinator.schemas import TeacherLogprobs
from deltarl.teacher.client import (
    TeacherClient,
    TeacherError,
    TeacherRequestError,
    TeacherUnavailable,
)
from deltarl.teacher.wire import LogprobRequest, LogprobResponse

logger = logging.getLogger(__name__)


class TeacherRefused(Exception):
    """The teacher refused a group's request (or cannot score this policy at all)."""


class GroupTargets:
    """Hint and teacher targets of finished groups (see the module docstring)."""

    def __init__(
        self,
        settings: RolloutSettings,
        experiment: WorkerExperiment,
        fmt: ChatFormat,
        sync: WeightSync,
        *,
        on_error: Callable[[str], None],
        stop: Callable[[], None],
    ) -> None:
        self.settings = settings
        self.hints = experiment.hints
        self.teacher = experiment.teacher
        self.format = fmt
        self.sync = sync
        self._on_error = on_error
        self._stop = stop
        self.hint_stats = HintStats()
        self.teacher_stats = TeacherStats()
        self._hinter = self._make_hinter(experiment.hints, settings)
        self._teacher: TeacherClient | None = None
        self._teacher_checked = False
        self.fatal: BaseException | None = None

    async def of(
        self, group: EpisodeGroup
    ) -> tuple[dict[int, tuple[TeacherLogprobs, str]], list[TeacherLogprobs] | None]:
        """The group's hint targets and teacher maps (raises :class:`TeacherRefused`)."""
        hints = await self._hints(group)
        return hints, await self._teacher_scores(group)

    async def aclose(self) -> None:
        if isinstance(self._hinter, ChatHinter):
            await self._hinter.aclose()
        if self._teacher is not None:
            await self._teacher.aclose()
            self._teacher = None

    @staticmethod
    def _make_hinter(hints: HintSettings, settings: RolloutSettings) -> Hinter | None:
        if hints.mode == "env":
            return EnvHinter()
        if hints.mode == "chat":
            assert hints.url is not None
            token = settings.hint_token.get_secret_value() if settings.hint_token else None
            return ChatHinter(hints.url, hints.model, token=token, timeout_s=hints.timeout_s)
        return None

    async def _hints(self, group: EpisodeGroup) -> dict[int, tuple[TeacherLogprobs, str]]:
        """Hinted self-distillation targets for the group's failed episodes (module
        :mod:`deltarl.rollout.distill.hints`), scored by the policy's engine or the teacher service
        (``hints.scorer``); failures are counted and skipped. Raises :class:`TeacherRefused`
        when the teacher cannot score this policy at all (another vocabulary)."""
        if self._hinter is None:
            return {}
        cfg = self.hints

        async def by_policy(hinted: list[tuple[Episode, Hint]]) -> list[TeacherLogprobs]:
            temperature = hinted[0][0].temperature or 1.0
            return await asyncio.to_thread(
                score_hints,
                hinted,
                self.format,
                self.sync.engine,
                k=cfg.top_k,
                temperature=temperature,
                gate=self.sync,
            )

        async def by_teacher(hinted: list[tuple[Episode, Hint]]) -> list[TeacherLogprobs]:
            request, spans = hint_request(hinted, self.format, cfg.top_k)
            answer = await self._ask_teacher(request, f"the hints of {group.group_id}")
            if answer is None:
                raise TeacherUnavailable("no answer within the retry budget")
            return hint_maps(answer, hinted, request, spans)

        score = by_teacher if cfg.scorer == "teacher" else by_policy
        found = await hint_episodes(group.episodes, self._hinter, score, self.hint_stats, cfg.below)
        if self.fatal is not None:
            raise TeacherRefused(str(self.fatal))
        return found

    async def open(self) -> None:
        """Open the teacher client (with a teacher_url) and check its vocabulary once if it
        answers now; if not, the first group's request checks it (:meth:`_teacher_scores`)."""
        cfg = self.settings
        if cfg.teacher_url is None or self._teacher is not None:
            return
        self._teacher = TeacherClient(
            cfg.teacher_url,
            None if cfg.teacher_token is None else cfg.teacher_token.get_secret_value(),
            timeout_s=self.teacher.timeout_s,
            # the retry budget of one request: half the group's submit budget (the worker's
            # own loop retries past it while teacher data is required)
            deadline_s=min(cfg.submit_timeout_s / 2, 120.0),
            ca_bundle=cfg.ca_bundle,
        )
        try:
            await self._check_teacher()
        except (httpx.TransportError, TeacherError) as exc:
            logger.warning("the teacher at %s does not answer yet (%s)", cfg.teacher_url, exc)

    async def _check_teacher(self) -> None:
        assert self._teacher is not None
        if self._teacher_checked:
            return
        try:
            info = await self._teacher.info()
        except TeacherRequestError as exc:
            if exc.status in (429, 500, 502, 503, 504):  # loading or overloaded: later
                raise TeacherUnavailable(str(exc)) from None
            raise
        check_vocab(info, getattr(self.sync.engine, "vocab_size", None), self._teacher.base_url)
        self._teacher_checked = True
        logger.info(
            "teacher %s at %s (vocabulary %s)",
            info.get("model"),
            self._teacher.base_url,
            info.get("vocab_size"),
        )

    async def _teacher_scores(self, group: EpisodeGroup) -> list[TeacherLogprobs] | None:
        """The teacher's map of each trajectory of ``group`` (None: no teacher configured or
        teacher.distill off, or it failed and teacher.required is false: counted missing)."""
        if self._teacher is None or not self.teacher.distill:
            return None
        request = group_request(group.episodes, self.teacher.top_k)
        answer = await self._ask_teacher(request, group.group_id)
        if answer is None:
            self.teacher_stats.missing += 1
            return None
        return teacher_maps(answer, group.episodes)

    async def _ask_teacher(self, request: LogprobRequest, what: str) -> LogprobResponse | None:
        """The teacher's answer to ``request`` (None: it failed after the client's retry budget
        and teacher.required is false). With teacher.required, retries until it answers (the
        submit task's submit_timeout_s ends the wait: the group is dropped). Raises
        :class:`TeacherRefused` when the teacher refuses the request (or cannot score this
        policy at all: then the worker stops)."""
        assert self._teacher is not None
        stats = self.teacher_stats
        stats.waiting += 1
        delay = 0.5
        try:
            while True:
                try:
                    await self._check_teacher()
                    answer = await self._teacher.score(request)
                except TeacherMismatch as exc:
                    self.fatal = exc
                    self._on_error(str(exc))
                    self._stop()
                    raise TeacherRefused(str(exc)) from None
                except TeacherRequestError as exc:
                    stats.refused += 1
                    raise TeacherRefused(str(exc)) from None
                except (httpx.TransportError, TeacherError) as exc:
                    stats.requests_failed += 1
                    self._on_error(f"teacher for {what}: {exc}")
                    if not self.teacher.required:
                        return None
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)
                    continue
                stats.requests_ok += 1
                return answer
        finally:
            stats.waiting -= 1
