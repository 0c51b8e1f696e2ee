"""Coalesce the sequences of many requests into engine batches.

Requests put their sequences on one queue (FIFO) and await a future; one worker task takes
sequences off the front while the padded batch (sequences x longest) stays within
``max_batch_tokens``, runs the engine on them in a thread (one forward at a time, the event loop
stays free to take more requests meanwhile), and hands each request its scores once all its
sequences are done. After the first sequence arrives the worker waits ``window_s`` for more,
unless a full batch is already waiting. A request's sequences may be split over several batches,
and one batch may serve many requests.

Back-pressure: at most ``max_queued_tokens`` tokens wait; a request that would go over is refused
at once (:class:`QueueFull`, HTTP 503) instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from deltarl.teacher.engines.base import ScoreJob, Scores, TeacherEngine

logger = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """Too many tokens are waiting; retry later."""


@dataclass(eq=False)
class _Request:
    jobs: list[ScoreJob]
    future: asyncio.Future[list[Scores]]
    results: list[Scores | None] = field(default_factory=list)
    remaining: int = 0


@dataclass
class BatchStats:
    """What the worker did (tests and /metrics read it)."""

    batches: int = 0
    sequences: int = 0
    largest_batch: int = 0


@dataclass(frozen=True)
class BatchReport:
    sequences: int
    requests: int
    tokens: int
    padded_tokens: int
    seconds: float


class Batcher:
    def __init__(
        self,
        engine: TeacherEngine,
        *,
        max_batch_tokens: int,
        window_s: float,
        max_queued_tokens: int,
        on_batch: Callable[[BatchReport], None] | None = None,
    ) -> None:
        self.engine = engine
        self.max_batch_tokens = max_batch_tokens
        self.window_s = window_s
        self.max_queued_tokens = max_queued_tokens
        self.on_batch = on_batch
        self.stats = BatchStats()
        self._queue: deque[tuple[_Request, int]] = deque()
        self._queued_tokens = 0
        self._ready: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    async def start(self) -> None:
        self._ready = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="teacher-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for req, _ in self._queue:
            if not req.future.done():
                req.future.set_exception(RuntimeError("the teacher is shutting down"))
        self._queue.clear()
        self._queued_tokens = 0

    async def submit(self, jobs: list[ScoreJob]) -> list[Scores]:
        """Scores of ``jobs``, in order (they may share forwards with other requests)."""
        if self._ready is None:
            raise RuntimeError("the batcher is not running")
        tokens = sum(len(j.tokens) for j in jobs)
        if self._queued_tokens + tokens > self.max_queued_tokens:
            raise QueueFull(
                f"{self._queued_tokens} tokens are waiting to be scored; {tokens} more would "
                f"exceed the limit of {self.max_queued_tokens}: retry later"
            )
        if not jobs:
            return []
        future: asyncio.Future[list[Scores]] = asyncio.get_running_loop().create_future()
        req = _Request(jobs, future, [None] * len(jobs), len(jobs))
        self._queue.extend((req, i) for i in range(len(jobs)))
        self._queued_tokens += tokens
        self._ready.set()
        return await future

    def _take(self) -> list[tuple[_Request, int]]:
        """Sequences from the front while the padded batch fits ``max_batch_tokens`` (always at
        least one: settings keep every sequence within it)."""
        batch: list[tuple[_Request, int]] = []
        width = 0
        while self._queue:
            req, i = self._queue[0]
            n = len(req.jobs[i].tokens)
            if batch and (len(batch) + 1) * max(width, n) > self.max_batch_tokens:
                break
            self._queue.popleft()
            if req.future.done():  # its caller went away, or an earlier batch failed it
                self._queued_tokens -= n
                continue
            batch.append((req, i))
            width = max(width, n)
        return batch

    async def _run(self) -> None:
        assert self._ready is not None
        while True:
            await self._ready.wait()
            if self.window_s > 0 and self._queued_tokens < self.max_batch_tokens:
                await asyncio.sleep(self.window_s)
            batch = self._take()
            if not self._queue:
                self._ready.clear()
            if not batch:
                continue
            jobs = [req.jobs[i] for req, i in batch]
            tokens = sum(len(j.tokens) for j in jobs)
            started = time.perf_counter()
            try:
                scores = await asyncio.to_thread(self.engine.score, jobs)
            except Exception as exc:
                logger.exception("teacher engine failed on a batch of %d sequences", len(jobs))
                for req, _ in batch:
                    if not req.future.done():
                        req.future.set_exception(exc)
                scores = None
            finally:
                self._queued_tokens -= tokens
            seconds = time.perf_counter() - started
            if scores is None:
                continue
            requests = {id(req) for req, _ in batch}
            for (req, i), s in zip(batch, scores, strict=True):
                req.results[i] = s
                req.remaining -= 1
                if req.remaining == 0 and not req.future.done():
                    req.future.set_result([r for r in req.results if r is not None])
            self.stats.batches += 1
            self.stats.sequences += len(batch)
            self.stats.largest_batch = max(self.stats.largest_batch, len(batch))
            if self.on_batch is not None:
                width = max(len(j.tokens) for j in jobs)
                self.on_batch(
                    BatchReport(len(batch), len(requests), tokens, width * len(batch), seconds)
                )
