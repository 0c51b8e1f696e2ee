"""Multi-turn episodes against an environment server, with token-level bookkeeping for training.

An *episode* is one game: the environment's first observation becomes the first user turn of a
chat (after a configurable system prompt), the model's reply is sent as the action, and the
environment's feedback becomes the next user turn, until the environment says ``done`` or a
limit (``max_turns``, ``max_tokens``) truncates it. Any server speaking the OpenEnv-style
protocol of :mod:`deltarl.env_server` (text action in; observation, reward, done out) plugs in
through :class:`EpisodeEnv` (:class:`~deltarl.env_server.core.client.EnvClient` is one); Wordle is
the tested one.

Token bookkeeping: an episode is ONE flat token sequence, exactly what the model saw and
sampled. The first prompt is the chat template rendered and tokenized; the model's tokens are
appended as sampled (never re-tokenized); the template text that closes the assistant turn and
opens the next user turn (with the environment's feedback) is rendered and tokenized on its
own and appended. Per token: ``mask`` 1 on sampled tokens (the stop token that ended a reply
included), 0 on prompt/template/environment tokens; ``logprobs`` the engine's behaviour
logprob of each sampled token, 0.0 where the mask is 0 (position ``t`` holds
``log p(tokens[t] | tokens[:t])``, the trainer's alignment). The sequence always ends with the
last sampled token (the final observation is not appended).

Batching: :class:`EpisodeRunner` runs any number of episodes concurrently on one event loop and
gathers the pending turns of all live episodes into one ``generate`` call (run in a worker
thread so environment I/O continues). Order of calls in the batcher, repeated::

    wait for a pending turn -> wait until every live episode has one pending, or max_batch
    are pending, or the oldest waited batch_wait_s -> ONE generate(prompts, params) in a
    thread (max_new_tokens = the largest per-episode budget; each reply is cut to its own)
    -> hand each episode its completion -> the episode steps the environment, appends the
    feedback and queues its next turn

Guarantees:

* ``sum(mask) == sum(len(turn.token_ids))``, and ``tokens[turn.start:turn.end]`` are exactly
  the tokens the engine returned for that turn (cut to the episode's budget), with their
  logprobs at the same positions.
* Versions: each turn records the policy versions of the weights that sampled its first and
  last token (the engine's :class:`~deltarl.rollout.engines.base.WeightsStamp`, i.e. the
  :class:`~deltarl.rollout.sync.weights.WeightSync` gate); an episode spans ``version_min ..
  version_max`` over its turns. When the stamps are unmanaged (no gate), ``policy_version()``
  is read before and after the generate call instead, so a sync during the call widens the span.
* The episodes of a group share the environment seed (same secret word) and the group id; a
  group is returned complete or not at all (an error in one episode stops its siblings at
  their next turn boundary; every session is closed).
* Invalid replies are sent to the environment unchanged: the environment's policy decides
  (Wordle warns once, then forfeits), and its feedback is appended like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Callable,
    Iterable,
    Sequence,
)
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deltarl.env_server.core.models import StepResult
from deltarl.env_server.core.render import observation_text
from deltarl.env_server.core.wire import TaskHint
from deltarl.rollout import fault_points
from deltarl.rollout.engines.base import Completion, SamplingParams
from deltarl.rollout.episodes.chat_format import ChatFormat, ChatTokenizer

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)

__all__ = [
    "ChatFormat",
    "ChatTokenizer",
    "EnvSession",
    "Episode",
    "EpisodeEnv",
    "EpisodeGroup",
    "EpisodeMetrics",
    "EpisodeRunner",
    "EpisodeSettings",
    "GroupAborted",
    "TokenGenerator",
    "Truncation",
    "Turn",
    "new_group_id",
    "observation_text",
]

Truncation = Literal["max_turns", "max_tokens"]


class EpisodeSettings(BaseModel):
    """How episodes are played and batched (experiment settings; one instance per worker).

    Example: ``EpisodeSettings(group_size=8, max_turns=6, sampling=SamplingParams(
    max_new_tokens=64))``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    group_size: int = Field(default=8, ge=1, description="Episodes per group (GRPO's G).")
    max_turns: int = Field(
        default=6,
        ge=1,
        description="Model replies per episode before it is truncated; unset: 6, raised to "
        "env_options' max_guesses (a worker asks the env server, WorkerExperiment.turn_limit).",
    )
    max_tokens: int = Field(
        default=2048,
        ge=2,
        description="Length of the whole flat sequence (prompt + replies + feedback), tokens; "
        "a turn that would exceed it ends the episode as truncated.",
    )
    sampling: SamplingParams = Field(
        default=SamplingParams(max_new_tokens=128),
        description="Sampling of each reply; max_new_tokens is the per-turn limit. With a seed, "
        "the n-th generate call of the runner uses seed + n (reproducible given the batching).",
    )
    system_prompt: str | None = Field(
        default=None,
        description="System turn; None: no system message (the worker passes the env "
        "server's, docs/rollout-episodes.md).",
    )
    stop_at_end_of_turn: bool = Field(
        default=True,
        description="Add the chat template's end-of-turn token and the tokenizer's EOS to "
        "sampling.stop_token_ids (the engine adds none by itself).",
    )
    max_batch: int = Field(default=256, ge=1, description="Most prompts per generate call.")
    batch_wait_s: float = Field(
        default=0.05,
        ge=0.0,
        description="Longest a pending turn waits for the other live episodes to join its "
        "generate call (seconds); the call starts as soon as every live episode is waiting. "
        "0: no waiting (for an engine that batches continuously by itself).",
    )
    env_options: dict[str, Any] | None = Field(
        default=None,
        description="Reset options sent with every episode (the env server validates them; "
        "Wordle: max_guesses, reward, shaping); None: the server's settings.",
    )
    routing_replay: bool = Field(
        default=False,
        description="Record each token's experts (mixture-of-experts models) and send them with "
        "the trajectory, for the trainer to replay (docs/rollout.md).",
    )

    @model_validator(mode="after")
    def _turns_cover_guesses(self) -> EpisodeSettings:
        most = (self.env_options or {}).get("max_guesses")
        if "max_turns" not in self.model_fields_set and isinstance(most, int):
            # the default follows the game (still "unset": a worker asks its env server)
            object.__setattr__(self, "max_turns", max(self.max_turns, most))
        if isinstance(most, int) and most > self.max_turns:
            raise ValueError(
                f"max_turns ({self.max_turns}) is below the {most} guesses a game may allow "
                "(env_options.max_guesses): episodes would be cut before the game ends; raise "
                "max_turns"
            )
        return self


# --------------------------------------------------------------------------------------------
# what the runner needs from its collaborators


class TokenGenerator(Protocol):
    """What generates replies: an :class:`~deltarl.rollout.engines.base.Engine` (unmanaged
    stamps) or a :class:`~deltarl.rollout.sync.weights.WeightSync` (gated, stamped completions).
    Called from a worker thread, one call at a time."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        routing_from: Sequence[int] | None = None,
    ) -> list[Completion]: ...


class EnvSession(Protocol):
    """One open environment session (e.g. :class:`~deltarl.env_server.core.client.AsyncEpisode`)."""

    @property
    def first(self) -> StepResult: ...

    async def step(self, message: str) -> StepResult: ...


class EpisodeMetrics(Protocol):
    """What the runner reports as it goes (e.g. :class:`~deltarl.rollout.service.metrics.RolloutMetrics`);
    called on the runner's event loop."""

    def generated(self, completions: Sequence[Completion], seconds: float) -> None: ...

    def episode_finished(self, episode: Episode) -> None: ...


class EpisodeEnv(Protocol):
    """An environment server client (e.g. :class:`~deltarl.env_server.core.client.EnvClient`)."""

    def episode(
        self, *, seed: int | None = None, episode_id: str | None = None
    ) -> AbstractAsyncContextManager[EnvSession]:
        """Open a session. The runner also passes ``options=`` when the settings ask for reset
        options, and ``policy_version=`` (the version the group started under) when it knows
        one: a client that cannot take them must be used without options and with a generator
        that reports no version."""
        ...


def _facts_of(result: StepResult) -> dict[str, float]:
    """The numeric entries of an observation's ``info`` (the episode's facts, e.g. Wordle's
    max_guesses)."""
    info = getattr(result.observation, "info", None) or {}
    return {
        str(k): float(v)
        for k, v in info.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }


def _signals_of(result: StepResult) -> dict[str, float]:
    raw = getattr(result.observation, "reward_signals", None)
    if raw is None:
        return {}
    values = raw.model_dump() if isinstance(raw, BaseModel) else dict(raw)
    return {str(k): float(v) for k, v in values.items() if isinstance(v, int | float)}


# --------------------------------------------------------------------------------------------
# records


@dataclass(frozen=True, slots=True)
class Turn:
    """One model reply and the environment's answer to it.

    ``start``/``end``: the reply's slice of the episode's flat tokens. ``completion``: what the
    engine returned, cut to the episode's token budget (pass it to ``WeightSync.check`` before
    submitting). ``reward``: the environment's reward for this step (Wordle: 0.0 until the
    game ends). ``signals``: the step's named reward signals (empty if the env sends none).
    """

    start: int
    end: int
    completion: Completion
    reply: str
    version_min: int | None
    version_max: int | None
    reward: float
    signals: dict[str, float]
    done: bool

    @property
    def token_ids(self) -> list[int]:
        return self.completion.token_ids


@dataclass(slots=True)
class Episode:
    """One finished episode: flat tokens with mask and logprobs, turns, reward, truncation.

    ``reward`` is the episode's return: the sum of its steps' rewards (:attr:`Turn.reward`).
    An environment that rewards only the last step (Wordle's default, charset) makes it that
    final reward; a shaped Wordle session (reset option ``shaping``) the sum of its per-move
    rewards, so a game cut short keeps what its moves earned.
    ``truncated``: None when the environment ended the episode; ``"max_turns"`` /
    ``"max_tokens"`` when a limit did. ``messages``: the conversation as text (for logs).
    """

    group_id: str
    index: int
    seed: int | None
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_len: int = 0
    turns: list[Turn] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    truncated: Truncation | None = None
    temperature: float | None = None  # sampling temperature of its turns (None: greedy)
    options: dict[str, Any] | None = None  # the environment's reset options (None: none sent)
    # what the reset decided that the trainer follows (the first observation's numeric info:
    # Wordle's max_guesses)
    facts: dict[str, float] = field(default_factory=dict)
    env_hint: TaskHint | None = None  # the environment's hint after the last move (hint_mode env)
    # [len(tokens) - 1, moe layers, top_k] experts of each position (routing_replay), else None
    routed_experts: np.ndarray | None = None

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def version_min(self) -> int | None:
        """Oldest policy version that sampled a token of this episode (None: unknown)."""
        known = [t.version_min for t in self.turns if t.version_min is not None]
        return min(known) if known else None

    @property
    def version_max(self) -> int | None:
        known = [t.version_max for t in self.turns if t.version_max is not None]
        return max(known) if known else None

    def _append(self, ids: Sequence[int], *, sampled: Sequence[float] | None = None) -> None:
        self.tokens.extend(ids)
        if sampled is None:
            self.mask.extend([0] * len(ids))
            self.logprobs.extend([0.0] * len(ids))
        else:
            assert len(sampled) == len(ids)
            self.mask.extend([1] * len(ids))
            self.logprobs.extend(float(x) for x in sampled)


@dataclass(slots=True)
class EpisodeGroup:
    """``G`` episodes of one prompt (same environment seed), for one GRPO group."""

    group_id: str
    seed: int | None
    episodes: list[Episode]

    @property
    def version_min(self) -> int | None:
        known = [e.version_min for e in self.episodes if e.version_min is not None]
        return min(known) if known else None

    @property
    def version_max(self) -> int | None:
        known = [e.version_max for e in self.episodes if e.version_max is not None]
        return max(known) if known else None

    def completions(self) -> list[Completion]:
        """Every completion of the group (to ask ``WeightSync.check`` before submitting)."""
        return [t.completion for e in self.episodes for t in e.turns]

    def verdict(
        self, check: Callable[[Completion], str]
    ) -> Literal["verified", "pending", "failed"]:
        """Combine ``check`` (e.g. ``WeightSync.check``) over every completion: ``"failed"`` if
        any failed (drop the group: some tokens came from weights that failed verification),
        else ``"pending"`` if any is pending (ask again after the running sync), else
        ``"verified"``."""
        verdicts = {check(c) for c in self.completions()}
        if "failed" in verdicts:
            return "failed"
        return "pending" if "pending" in verdicts else "verified"


def new_group_id(prefix: str = "g") -> str:
    """A fresh group id matching the coordinator's id pattern: ``prefix-<32 hex>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


# --------------------------------------------------------------------------------------------
# batching generate calls across episodes


@dataclass(slots=True)
class _Request:
    prompt: list[int]
    limit: int
    routing_from: int | None
    future: asyncio.Future[_Sampled]
    queued_at: float


@dataclass(frozen=True, slots=True)
class _Sampled:
    completion: Completion
    version_min: int | None
    version_max: int | None


class _Batcher:
    """Gathers pending turns into generate calls; see the module docstring for the order."""

    def __init__(
        self,
        generator: TokenGenerator,
        sampling: SamplingParams,
        *,
        max_batch: int,
        batch_wait_s: float,
        policy_version: Callable[[], int | None] | None,
        metrics: EpisodeMetrics | None = None,
    ) -> None:
        self.generator = generator
        self.metrics = metrics
        self.sampling = sampling
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s
        self.policy_version = policy_version
        self.live = 0
        self.calls = 0
        self.batch_sizes: deque[int] = deque(maxlen=10_000)  # prompts per call, latest last
        self._pending: list[_Request] = []
        self._wake = asyncio.Event()

    def nudge(self) -> None:
        self._wake.set()

    async def generate(
        self, prompt: list[int], limit: int, routing_from: int | None = None
    ) -> _Sampled:
        future: asyncio.Future[_Sampled] = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(prompt, limit, routing_from, future, time.monotonic()))
        self._wake.set()
        return await future

    async def _gather(self) -> list[_Request]:
        """Wait for a batch to be worth sending (see the module docstring)."""
        while True:
            self._pending = [r for r in self._pending if not r.future.done()]
            if self._pending:
                break
            self._wake.clear()
            await self._wake.wait()
        deadline = self._pending[0].queued_at + self.batch_wait_s
        while True:
            self._pending = [r for r in self._pending if not r.future.done()]
            if not self._pending:
                break
            full = len(self._pending) >= min(max(self.live, 1), self.max_batch)
            left = deadline - time.monotonic()
            if full or left <= 0:
                break
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                break
        batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
        return batch

    def _call(
        self,
        prompts: list[list[int]],
        limit: int,
        seed: int | None,
        routing_from: list[int] | None = None,
    ) -> list[_Sampled]:
        params = self.sampling.model_copy(update={"max_new_tokens": limit, "seed": seed})
        before = self.policy_version() if self.policy_version is not None else None
        if routing_from is None:
            completions = self.generator.generate(prompts, params)
        else:
            completions = self.generator.generate(prompts, params, routing_from=routing_from)
        after = self.policy_version() if self.policy_version is not None else None
        if len(completions) != len(prompts):
            raise RuntimeError(
                f"the generator returned {len(completions)} completions for {len(prompts)} prompts"
            )
        fallback = [v for v in (before, after) if v is not None]
        out = []
        for c in completions:
            lo, hi = c.version_min, c.version_max
            if lo is None and fallback:
                lo = min(fallback)
            if hi is None and fallback:
                hi = max(fallback)
            out.append(_Sampled(c, lo, hi))
        return out

    async def run(self) -> None:
        """Serve generate requests until cancelled."""
        while True:
            batch = await self._gather()
            if not batch:
                continue
            seed = self.sampling.seed
            seed = None if seed is None else seed + self.calls
            self.calls += 1
            self.batch_sizes.append(len(batch))
            limit = max(r.limit for r in batch)
            t0 = time.perf_counter()
            starts = [r.routing_from for r in batch]
            routing = None if any(x is None for x in starts) else [int(x) for x in starts]  # type: ignore[arg-type]
            try:
                results = await asyncio.to_thread(
                    self._call, [r.prompt for r in batch], limit, seed, routing
                )
            except Exception as exc:  # every episode of the call sees the engine's error
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(exc)
                continue
            if self.metrics is not None:
                self.metrics.generated([s.completion for s in results], time.perf_counter() - t0)
            for r, s in zip(batch, results, strict=True):
                if not r.future.done():
                    r.future.set_result(_cut(s, r.limit, len(r.prompt), r.routing_from))


def _cut(
    sampled: _Sampled, limit: int, prompt_len: int = 0, routing_from: int | None = None
) -> _Sampled:
    """The completion cut to ``limit`` tokens (finish reason "length" if anything was cut), its
    routing record (rows from ``routing_from``) to the positions left."""
    c = sampled.completion
    if len(c.token_ids) <= limit:
        return sampled
    routed = c.routed_experts
    if routed is not None and routing_from is not None:
        routed = routed[: max(0, prompt_len + limit - 1 - routing_from)]
    cut = dataclasses.replace(
        c,
        token_ids=c.token_ids[:limit],
        logprobs=c.logprobs[:limit],
        finish_reason="length",
        routed_experts=routed,
    )
    return _Sampled(cut, sampled.version_min, sampled.version_max)


# --------------------------------------------------------------------------------------------
# the runner


class GroupAborted(RuntimeError):
    """An episode stopped early because another episode of its group failed."""


def _first_error(results: Sequence[object]) -> BaseException | None:
    """The first real error among gathered results (the others are logged), else None."""
    errors = [r for r in results if isinstance(r, BaseException)]
    real = [e for e in errors if not isinstance(e, GroupAborted)] or errors
    for other in real[1:]:
        logger.warning("another episode of the failed group: %r", other)
    return real[0] if real else None


async def _aiter(
    items: Iterable[int | None] | AsyncIterable[int | None],
) -> AsyncIterator[int | None]:
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item


class EpisodeRunner:
    """Plays groups of episodes concurrently with batched generation.

    Use as an async context manager (it owns the batching task)::

        async with EnvClient(env_url) as env, EpisodeRunner(sync, tokenizer, env, settings) as r:
            group = await r.run_group(seed=17)          # G episodes of one game
            groups = await r.run_groups([1, 2, 3])      # several groups at once, batched together
            async for g in r.stream_groups(seeds, in_flight=16):  # a worker's steady state
                ...                                     # an EpisodeGroup, or the exception

    ``generator``: an engine or a ``WeightSync`` (see :class:`TokenGenerator`).
    ``policy_version``: read around each generate call when completions carry no version
    (unmanaged engine); e.g. ``lambda: sync.version``. ``render``: observation -> user text
    (default :func:`observation_text`). ``metrics``: told of every generate call and every
    episode played to its end (see :class:`EpisodeMetrics`).
    """

    def __init__(
        self,
        generator: TokenGenerator,
        tokenizer: ChatTokenizer | ChatFormat,
        env: EpisodeEnv,
        settings: EpisodeSettings | None = None,
        *,
        policy_version: Callable[[], int | None] | None = None,
        render: Callable[[StepResult | None, StepResult], str] = observation_text,
        metrics: EpisodeMetrics | None = None,
    ) -> None:
        self.settings = settings or EpisodeSettings()
        self.metrics = metrics
        self.format = tokenizer if isinstance(tokenizer, ChatFormat) else ChatFormat(tokenizer)
        self.env = env
        self.render = render
        sampling = self.settings.sampling
        if self.settings.stop_at_end_of_turn:
            stops = tuple(dict.fromkeys((*sampling.stop_token_ids, *self.format.stop_token_ids())))
            sampling = sampling.model_copy(update={"stop_token_ids": stops})
        self.sampling = sampling
        self._batcher = _Batcher(
            generator,
            sampling,
            max_batch=self.settings.max_batch,
            batch_wait_s=self.settings.batch_wait_s,
            policy_version=policy_version,
            metrics=metrics,
        )
        self._task: asyncio.Task[None] | None = None
        self._generator = generator
        self._policy_version = policy_version

    @property
    def batch_sizes(self) -> deque[int]:
        """Prompts per generate call (the latest 10,000; for metrics and tests)."""
        return self._batcher.batch_sizes

    async def __aenter__(self) -> EpisodeRunner:
        if self._task is not None:
            raise RuntimeError("the runner is already started")
        self._task = asyncio.create_task(self._batcher.run(), name="episode-batcher")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def stream_groups(
        self,
        seeds: Iterable[int | None] | AsyncIterable[int | None],
        *,
        in_flight: int,
        prefix: str = "g",
    ) -> AsyncGenerator[EpisodeGroup | Exception, None]:
        """Keep ``in_flight`` groups playing, one per seed, and yield each as it finishes.

        A new group starts as soon as one finishes, so the engine stays busy while finished
        groups are submitted; ``seeds`` may be async (e.g. a generator that waits for the
        coordinator's admission before yielding). A failed group is yielded as its exception
        (the stream goes on; stop iterating to stop it, which cancels the groups in flight).
        """
        if in_flight < 1:
            raise ValueError(f"in_flight must be >= 1, got {in_flight}")
        source = _aiter(seeds)
        running: set[asyncio.Task[EpisodeGroup]] = set()
        exhausted = False
        try:
            while True:
                while not exhausted and len(running) < in_flight:
                    try:
                        seed = await anext(source)
                    except StopAsyncIteration:
                        exhausted = True
                        break
                    running.add(asyncio.create_task(self.run_group(seed=seed, prefix=prefix)))
                if not running:
                    return
                done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    exc = task.exception()
                    if exc is not None and not isinstance(exc, Exception):
                        raise exc
                    yield exc if exc is not None else task.result()
        finally:
            for task in running:
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)

    async def run_groups(
        self, seeds: Iterable[int | None], *, prefix: str = "g"
    ) -> list[EpisodeGroup]:
        """One group per seed, all concurrently (their turns share generate calls), in order.
        Every group runs to its end; then the first error, if any, is raised (the finished
        groups are lost: call :meth:`run_group` per group to keep them apart)."""
        results = await asyncio.gather(
            *(self.run_group(seed=s, prefix=prefix) for s in seeds), return_exceptions=True
        )
        error = _first_error(results)
        if error is not None:
            raise error
        return [r for r in results if isinstance(r, EpisodeGroup)]

    async def run_group(
        self,
        *,
        seed: int | None = None,
        group_id: str | None = None,
        size: int | None = None,
        prefix: str = "g",
    ) -> EpisodeGroup:
        """Play ``size`` (default ``settings.group_size``) episodes of the game ``seed``.

        ``seed`` None draws a random one here (the group must share it, so it is never left to
        the server). The group id defaults to :func:`new_group_id`.

        Failure: the first error of an episode (e.g. ``WeightsUnhealthyError``, ``EnvError``)
        makes its siblings stop at their next turn boundary (:class:`GroupAborted`), so every
        session is closed through the normal path rather than by cancelling a request in
        flight; then that error is raised as is. (Cancelling this coroutine from outside still
        cancels requests in flight; the server frees any session left behind after its idle
        time-out.)
        """
        if self._task is None:
            raise RuntimeError("use the runner inside 'async with' (it owns the batching task)")
        n = self.settings.group_size if size is None else size
        if n < 1:
            raise ValueError(f"group size must be >= 1, got {n}")
        if seed is None:
            seed = uuid.uuid4().int & ((1 << 63) - 1)
        gid = group_id or new_group_id(prefix)
        abort = asyncio.Event()
        options, version = self.settings.env_options, self._version()
        results = await asyncio.gather(
            *(
                self.run_episode(gid, i, seed, abort=abort, options=options, policy_version=version)
                for i in range(n)
            ),
            return_exceptions=True,
        )
        error = _first_error(results)
        if error is not None:
            raise error
        return EpisodeGroup(gid, seed, [r for r in results if isinstance(r, Episode)])

    def _version(self) -> int | None:
        """The policy version a group starts at (sent with each of its resets: a task may
        adapt to it, e.g. Wordle's guess curriculum): ``policy_version()``, else the
        generator's ``version`` (a ``WeightSync``), else None."""
        if self._policy_version is not None:
            return self._policy_version()
        version = getattr(self._generator, "version", None)
        return version if isinstance(version, int) else None

    async def run_episode(
        self,
        group_id: str,
        index: int,
        seed: int | None,
        *,
        abort: asyncio.Event | None = None,
        options: dict[str, Any] | None = None,
        policy_version: int | None = None,
    ) -> Episode:
        """Play one episode (see the module docstring); errors of the env or engine propagate.

        ``abort``: checked at every turn boundary (raises :class:`GroupAborted` once set); set
        by this episode when it fails. ``options``: the environment's reset options;
        ``policy_version``: the version the episode's group started under (each passed to
        ``env.episode`` only when set).
        """
        abort = abort if abort is not None else asyncio.Event()
        batcher = self._batcher
        batcher.live += 1
        extra: dict[str, Any] = {"options": options} if options else {}
        if policy_version is not None:
            extra["policy_version"] = policy_version
        try:
            async with self.env.episode(
                seed=seed, episode_id=f"{group_id}/{index}", **extra
            ) as session:
                t = self.sampling.temperature
                ep = Episode(group_id, index, seed, temperature=t if t > 0 else None)
                ep.options = options
                ep.facts = _facts_of(session.first)
                ep = await self._play(session, ep, abort)
            if self.metrics is not None:
                self.metrics.episode_finished(ep)
            return ep
        except Exception as exc:
            if not isinstance(exc, GroupAborted):
                abort.set()
            raise
        finally:
            batcher.live -= 1
            batcher.nudge()

    async def _play(self, session: EnvSession, ep: Episode, abort: asyncio.Event) -> Episode:
        cfg, fmt = self.settings, self.format
        result = session.first
        if cfg.system_prompt is not None:
            ep.messages.append({"role": "system", "content": cfg.system_prompt})
        ep.messages.append({"role": "user", "content": self.render(None, result)})
        ep._append(fmt.prompt_ids(ep.messages))
        ep.prompt_len = len(ep.tokens)
        if ep.prompt_len >= cfg.max_tokens:
            raise ValueError(
                f"the first prompt has {ep.prompt_len} tokens, max_tokens is {cfg.max_tokens}: "
                "raise max_tokens or shorten the system prompt"
            )
        previous = result
        routing: list[np.ndarray] | None = [] if cfg.routing_replay else None
        rows = 0  # positions whose routing the episode holds
        while not result.done:
            if ep.num_turns >= cfg.max_turns:
                ep.truncated = "max_turns"
                break
            budget = cfg.max_tokens - len(ep.tokens)
            limit = min(self.sampling.max_new_tokens, budget)
            if abort.is_set():
                raise GroupAborted(f"episode {ep.group_id}/{ep.index}: its group failed")
            sampled = await self._batcher.generate(
                list(ep.tokens), limit, None if routing is None else rows
            )
            if abort.is_set():
                raise GroupAborted(f"episode {ep.group_id}/{ep.index}: its group failed")
            c = sampled.completion
            if routing is not None:
                want = len(ep.tokens) + len(c.token_ids) - 1 - rows
                got = c.routed_experts
                if got is None or len(got) != want:
                    logger.warning(
                        "episode %s/%s: the engine returned %s routing rows for %d positions; "
                        "the episode goes without routing",
                        ep.group_id,
                        ep.index,
                        None if got is None else len(got),
                        want,
                    )
                    routing = None
                else:
                    routing.append(got)
                    rows += want
            start = len(ep.tokens)
            ep._append(c.token_ids, sampled=c.logprobs)
            stopped = c.finish_reason == "stop" and bool(c.token_ids)
            reply = fmt.reply_text(c.token_ids)
            if fault_points.armed("mid_episode"):  # test-only (rollout/fault_points.py)
                await asyncio.to_thread(fault_points.hold, "mid_episode", group=ep.group_id)
            result = await session.step(reply)
            ep.turns.append(
                Turn(
                    start=start,
                    end=len(ep.tokens),
                    completion=c,
                    reply=reply,
                    version_min=sampled.version_min,
                    version_max=sampled.version_max,
                    reward=float(result.reward or 0.0),
                    signals=_signals_of(result),
                    done=result.done,
                )
            )
            ep.messages.append({"role": "assistant", "content": reply})
            ep.env_hint = result.observation.hint
            if result.done:
                break
            if ep.num_turns >= cfg.max_turns:
                ep.truncated = "max_turns"
                break
            feedback = self.render(previous, result)
            previous = result
            more = fmt.continuation_ids(ep.messages, feedback, c.token_ids[-1] if stopped else None)
            if len(ep.tokens) + len(more) >= cfg.max_tokens:
                ep.truncated = "max_tokens"  # no room left for a single sampled token
                break
            ep._append(more)
            ep.messages.append({"role": "user", "content": feedback})
        ep.done = result.done
        ep.reward = math.fsum(t.reward for t in ep.turns)
        if routing and rows == len(ep.tokens) - 1:
            import numpy as np  # not at import: the light services import these settings

            ep.routed_experts = np.concatenate(routing, axis=0)
        logger.debug(
            "episode %s/%s: %d turns, %d tokens, reward %.3f, truncated %s",
            ep.group_id,
            ep.index,
            ep.num_turns,
            len(ep.tokens),
            ep.reward,
            ep.truncated,
        )
        return ep
