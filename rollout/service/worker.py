"""The rollout worker service: follow the trainer's versions, play episodes, submit groups.

:class:`RolloutWorker` ties together a :class:`~deltarl.rollout.sync.weights.WeightSync` (the
engine's weights), an :class:`~deltarl.rollout.episodes.runner.EpisodeRunner` (multi-turn episodes
against the env server) and the coordinator's clients.

Order of calls (:meth:`RolloutWorker.run`)::

    serve GET /health and GET /metrics on the loop (rollout/service/http.py; 503 until verified weights)
    -> register (retried until the coordinator answers)
    -> heartbeat thread: every interval, WorkerHeartbeat(applied version or None while
       unhealthy, its verified state digest, groups in flight, last error); its answer's
       latest_version is followed too;
       an unknown_worker answer (coordinator lost its state) re-registers
    -> sync_to(the coordinator's latest version) (waits for a first version if none yet)
    -> version thread (rollout/sync/follower.py): iter_version_events (SSE) -> follow(v); when
       the stream fails, poll latest_version every sync_poll_s and reopen it
       follow(v): newest target wins; one WeightSync.sync_in_background at a time, the next
       one starts when it ends (coalescing: versions published meanwhile are skipped over)
    -> episode loop: seeds come from admission control (ask for in_flight_groups - running;
       wait admission_wait_s when nothing is granted or the weights are unhealthy);
       EpisodeRunner.stream_groups keeps the granted groups in flight; each finished group
       gets a submit task: wait while its verdict is "pending" or the weights are unhealthy,
       drop it if "failed", else score its hinted turns (hint_scorer: this engine or the
       teacher) and ask the teacher for its distillation data (if configured), then submit it
       with its idempotency key, retrying transport
       errors and 5xx answers (the coordinator de-duplicates) for up to submit_timeout_s
    SIGTERM/SIGINT (or request_stop()) -> no new groups; the groups in flight get
       shutdown_grace_s to finish (then they are cancelled; a second signal cancels them at
       once), their submissions up to submit_timeout_s more -> threads stop -> deregister
       (DELETE /v1/workers/{id}) -> the HTTP port closes

Guarantees:

* Only groups whose every token was sampled by verified weights are submitted
  (``EpisodeGroup.verdict(WeightSync.check) == "verified"``), never while the weights are
  unhealthy; each trajectory carries the versions that sampled it.
* A submission is retried with the same idempotency key (worker id + group id), so a lost
  answer never queues a group twice.
* A crash loses only the groups not yet accepted by the coordinator; a restart with the same
  worker id re-registers (a rejoin) and starts from the coordinator's latest version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx

from deltarl.env_server.core.client import EnvClient
from deltarl.env_server.core.models import EnvError
from deltarl.env_server.core.wire import EnvMetadata
from deltarl.rollout.distill.group_targets import GroupTargets, TeacherRefused
from deltarl.rollout.distill.hints import (
    HintStats,
)
from deltarl.rollout.distill.teaching import (
    TeacherStats,
)
from deltarl.rollout.engines.base import Engine
from deltarl.rollout.episodes.chat_format import ChatFormat, ChatTokenizer
from deltarl.rollout.episodes.runner import EpisodeGroup, EpisodeRunner
from deltarl.rollout.episodes.trajectories import to_submission
from deltarl.rollout.service.http import WorkerHttpServer, create_app
from deltarl.rollout.service.metrics import RolloutMetrics
from deltarl.rollout.service.view import WorkerStats
from deltarl.rollout.settings import RolloutSettings, WorkerExperiment, check_worker
from deltarl.rollout.sync.follower import VersionFollower
from deltarl.rollout.sync.weights import WeightSync
from deltarl.services.common.tls import client_verify
from deltarl.services.coordinator.client import (
    AsyncCoordinatorClient,
    CoordinatorClient,
    CoordinatorError,
)
from deltarl.services.coordinator.schemas import (
    HeartbeatAck,
    SubmitResult,
    WeightChallenge,
    WorkerHeartbeat,
    WorkerRegistration,
    encode_group,
)
from deltarl.weightsync.errors import StateMismatchError
from deltarl.weightsync.proof import ProofSpec

logger = logging.getLogger(__name__)

GIL_SWITCH_INTERVAL_S = 0.0002
"""Python's thread switch interval in a worker (Python's own: 5 ms). Decoding a delta hands the
GIL over at every compiled or numpy call, and a Python-heavy generation thread then keeps it for
up to this long each time: with 5 ms, decoding a SmolLM2 delta next to a busy thread took 14-19 s
on 2 cores, with 0.2 ms 0.8-1.5 s."""

__all__ = ["RolloutWorker", "WorkerStats"]

_VERDICT_POLL_S = 0.02  # how often a finished group asks for its verification verdict

FAILURE_BACKOFF_MAX_S = 10.0
"""Longest wait after failed groups (an engine or environment error: e.g. the GPU ran out of
memory): admission_wait_s after the first, twice as long after each further failure in a row,
at most this; a finished group resets it. Long enough that a failing worker does not burn
through games and its log, short enough that it is back within seconds of the cause going
away (an env server restarted)."""


class RolloutWorker:
    """One rollout worker process; see the module docstring for the order of calls.

    ``sync`` (the engine's :class:`WeightSync`) and ``tokenizer``: built by
    :meth:`from_settings` in the service, given directly in tests. ``model_name``: what the
    registration reports (default: the model setting). TLS certificates of the coordinator and
    the env server are checked against ``settings.ca_bundle`` (unset: ``DELTARL_CA_BUNDLE``,
    else the system's CAs; :func:`~deltarl.services.common.tls.client_verify`). ``metrics``: where
    the worker's Prometheus metrics go (default: new ones); ``GET /health`` and ``/metrics``
    are served on ``settings.host``/``settings.port`` while :meth:`run_async` runs
    (:mod:`~deltarl.rollout.service.http`).
    """

    def __init__(
        self,
        settings: RolloutSettings,
        sync: WeightSync,
        tokenizer: ChatTokenizer | ChatFormat,
        *,
        experiment: WorkerExperiment | None = None,
        model_name: str | None = None,
        metrics: RolloutMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.experiment = experiment if experiment is not None else settings.experiment()
        check_worker(settings.teacher_url, self.experiment)
        self.sync = sync
        self.engine: Engine = sync.engine
        self.format = tokenizer if isinstance(tokenizer, ChatFormat) else ChatFormat(tokenizer)
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # process-wide: see the constant
        engine_cfg = self.experiment.engine
        self.model_name = model_name or (
            engine_cfg.model if engine_cfg is not None else "smollm2-135m-instruct"
        )
        self.worker_id = settings.worker_id
        self.stats = WorkerStats()
        self._verify = client_verify(settings.ca_bundle)
        self._owns_engine = False  # from_settings built the engine: close() releases it
        # The worker's own loops retry registration, heartbeats and reads with a backoff that a
        # stop request interrupts, so the client need not ride out a restart itself: a short
        # refused wait keeps SIGTERM prompt while the coordinator is down (30 s otherwise).
        self.coordinator = CoordinatorClient(
            settings.coordinator_url,
            _secret(settings.worker_token),
            verify=self._verify,
            refused_wait_s=2.0,
        )
        self.follower = VersionFollower(
            sync,
            settings.coordinator_url,
            _secret(settings.worker_token),
            verify=self._verify,
            poll_s=settings.sync_poll_s,
            on_error=self._error,
            sync_log=settings.sync_log,
        )
        self._heartbeat_stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        self._last_error: str | None = None
        self._in_flight = 0
        self._failures_in_a_row = 0  # groups that failed since the last one that finished
        self._heartbeat_s = settings.heartbeat_interval_s or 1.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stop_requested = False
        self._drain: asyncio.Timeout | None = None
        self._async_client: AsyncCoordinatorClient | None = None
        self._registered = False
        # weight proofs run in their own thread (a whole-state proof of a large model takes
        # seconds: heartbeats go on meanwhile); at most one at a time
        self._prover = ThreadPoolExecutor(1, thread_name_prefix="rollout-proof")
        self.targets = GroupTargets(
            settings,
            self.experiment,
            self.format,
            self.sync,
            on_error=self._error,
            stop=self.request_stop,
        )
        self._proving: Future[None] | None = None
        self._proving_nonce: str | None = None
        self.metrics = metrics if metrics is not None else RolloutMetrics()
        self.metrics.watch(self)
        self.http = WorkerHttpServer(create_app(self), settings)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_settings(
        cls, settings: RolloutSettings, experiment: WorkerExperiment | None = None
    ) -> RolloutWorker:
        """Build the engine, tokenizer and weight sync the settings and the experiment
        (default: ``settings.config``'s) describe (heavy imports)."""
        from transformers import AutoTokenizer

        from deltarl.buckets import open_bucket
        from deltarl.rollout.engines import make_engine
        from deltarl.weightsync.reader import BucketReader

        experiment = experiment if experiment is not None else settings.experiment()
        check_worker(settings.teacher_url, experiment)  # before the engine is built
        model, gguf = experiment.model_source()
        tokenizer = AutoTokenizer.from_pretrained(
            model, **({} if gguf is None else {"gguf_file": gguf})
        )
        engine = make_engine(experiment.engine_settings())
        try:
            reader = BucketReader(open_bucket(settings.bucket_uri), verifier=settings.verifier())
            sync = WeightSync(engine, reader, apply_kernel=settings.apply_kernel)
            worker = cls(
                settings,
                sync,
                tokenizer,
                experiment=experiment,
                model_name=model if gguf is None else gguf,
            )
        except BaseException:
            engine.close()
            raise
        worker._owns_engine = True
        return worker

    def close(self) -> None:
        """Release the engine if this worker built it (:meth:`from_settings`): the vllm engine's
        core is a separate process holding the GPU memory, which would outlive this one (seen
        with the teacher service on an H200). The service calls it once :meth:`run` returns;
        an engine given to the constructor stays its owner's."""
        if self._owns_engine:
            self._owns_engine = False
            self.engine.close()

    # ------------------------------------------------------------------ public surface

    def run(self, *, handle_signals: bool = True) -> None:
        """Run until stopped (SIGTERM/SIGINT when ``handle_signals``, or :meth:`request_stop`)."""
        asyncio.run(self.run_async(handle_signals=handle_signals))

    def request_stop(self) -> None:
        """Begin a graceful shutdown (thread-safe; a second call changes nothing)."""
        loop = self._loop
        if loop is None:
            self._stop_requested = True
            return
        loop.call_soon_threadsafe(self._begin_stop)

    @property
    def hint_stats(self) -> HintStats:
        return self.targets.hint_stats

    @property
    def teacher_stats(self) -> TeacherStats:
        return self.targets.teacher_stats

    @property
    def in_flight(self) -> int:
        """Groups started and not finished."""
        return self._in_flight

    @property
    def last_error(self) -> str | None:
        """The latest error (failed sync, submission, ...; None after a clean submission)."""
        return self._last_error

    @property
    def stopping(self) -> bool:
        """A graceful shutdown has begun."""
        return self._stopping

    def heartbeat(self) -> HeartbeatAck:
        """Send one heartbeat now (the heartbeat thread calls this every interval).

        Reports the applied version (None while the weights are unhealthy), the state digest
        of the weights at that version once verified (the coordinator compares it with the
        trainer's: ``WorkerInfo.weights_verified``), the groups in flight and the last error
        (the unhealthy reason first); follows the answer's latest version; re-registers when
        the coordinator does not know this worker.
        """
        status = self.sync.status()
        verified = self.sync.verified_digest()
        proof = status.healthy and verified is not None and verified[0] == status.version
        hb = WorkerHeartbeat(
            applied_version=status.version if status.healthy else None,
            in_flight=self._in_flight,
            last_error=_cut(status.reason if not status.healthy else self._last_error),
            weights_digest=verified[1] if proof and verified is not None else None,
        )
        try:
            ack = self.coordinator.heartbeat(self.worker_id, hb)
        except CoordinatorError as exc:
            if exc.code != "unknown_worker":
                raise
            logger.warning("the coordinator does not know this worker: registering again")
            ack = self._register()
        self.follower.follow(ack.latest_version)
        if ack.challenge is not None:
            self._take_challenge(ack.challenge)
        return ack

    def _take_challenge(self, challenge: WeightChallenge) -> None:
        """Answer a weight challenge in the proof thread (unless that one is already being
        answered; a challenge is re-sent with every heartbeat until answered)."""
        busy = self._proving is not None and not self._proving.done()
        if busy or challenge.nonce == self._proving_nonce:
            return
        self._proving_nonce = challenge.nonce
        self._proving = self._prover.submit(self._answer, challenge)

    def _answer(self, challenge: WeightChallenge) -> None:
        try:
            spec = ProofSpec(challenge.chunk_bytes, challenge.chunks)
            answer = self.sync.prove(challenge.version, bytes.fromhex(challenge.nonce), spec)
            if answer is None:  # moved on: the next heartbeat brings a challenge for that
                self._proving_nonce = None
                return
            result = self.coordinator.prove(self.worker_id, challenge.nonce, answer)
        except Exception as exc:
            logger.warning("weight proof for v%d not delivered: %s", challenge.version, exc)
            self._proving_nonce = None  # try again with the next heartbeat's challenge
            return
        if result.verified:
            self.stats.proofs_ok += 1
            logger.info("weights proven at v%d", result.version)
        else:
            self.stats.proofs_failed += 1
            self._last_error = (
                f"weight proof at v{result.version} refused: the served weights are not the "
                "trainer's (or the answer came too late)"
            )
            logger.error(self._last_error)

    # ------------------------------------------------------------------ the run

    async def run_async(self, *, handle_signals: bool = False) -> None:
        """The whole service on the running loop (see the module docstring)."""
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if self._stop_requested:
            self._stop.set()
        if handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            await self.http.start()  # /health answers 503 until the first anchor is loaded
            try:
                ack = await self._retry("register", self._register)
            except CoordinatorError as exc:
                logger.error("the coordinator refused the registration: %s", exc)
                raise
            if ack is None:
                return
            if self.settings.heartbeat_interval_s is None:
                self._heartbeat_s = ack.heartbeat_interval_s
            self._heartbeat_thread = threading.Thread(
                target=self._heartbeat_loop, name="rollout-heartbeat", daemon=True
            )
            self._heartbeat_thread.start()
            if not await self._initial_sync(ack.latest_version):
                return
            self.follower.start()
            await self._episode_loop()
            if self.targets.fatal is not None:
                raise self.targets.fatal
        finally:
            if handle_signals:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    self._loop.remove_signal_handler(sig)
            await asyncio.to_thread(self._shutdown_threads)
            await self.targets.aclose()
            await self.http.stop()
            self._loop = None
        logger.info("rollout worker %s stopped: %s", self.worker_id, self.stats)

    def _on_signal(self, sig: signal.Signals) -> None:
        """First signal: graceful stop; a second one abandons the groups in flight now."""
        if self._stopping and self._drain is not None:
            logger.warning("%s again: abandoning the groups in flight", sig.name)
            self._drain.reschedule(asyncio.get_running_loop().time())
            return
        logger.info("%s received", sig.name)
        self._begin_stop()

    def _begin_stop(self) -> None:
        assert self._stop is not None
        if self._stop.is_set():
            return
        logger.info(
            "stopping: %d group(s) in flight get %.0f s to finish",
            self._in_flight,
            self.settings.shutdown_grace_s,
        )
        self._stop.set()
        if self._drain is not None:
            loop = asyncio.get_running_loop()
            self._drain.reschedule(loop.time() + self.settings.shutdown_grace_s)

    @property
    def _stopping(self) -> bool:
        return self._stop is not None and self._stop.is_set()

    def _failure_backoff_s(self) -> float:
        """The wait before the next group after ``_failures_in_a_row`` failed groups."""
        doublings = min(self._failures_in_a_row, 32) - 1
        wait = self.settings.admission_wait_s * 2.0**doublings
        return min(wait, FAILURE_BACKOFF_MAX_S)

    async def _sleep(self, seconds: float) -> None:
        """Sleep, waking early when a stop is requested."""
        assert self._stop is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    async def _retry(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` in a thread until it succeeds (backoff up to 5 s); None when stopped."""
        delay = 0.2
        while not self._stopping:
            try:
                return await asyncio.to_thread(fn)
            except (httpx.TransportError, CoordinatorError) as exc:
                if isinstance(exc, CoordinatorError) and exc.status_code < 500:
                    raise  # a refusal (bad token, bad registration): retrying will not help
                self._error(f"{what}: {exc}")
                await self._sleep(delay)
                delay = min(delay * 2, 5.0)
        return None

    def _register(self) -> HeartbeatAck:
        ack = self.coordinator.register(
            WorkerRegistration(
                worker_id=self.worker_id,
                engine=self.engine.type,
                model=self.model_name[-256:],
                capacity=self.experiment.in_flight_groups,
            )
        )
        self._registered = True
        logger.info(
            "registered as %s (rejoins %d); latest version %s",
            self.worker_id,
            ack.worker.rejoins,
            ack.latest_version,
        )
        return ack

    async def _initial_sync(self, latest: int | None) -> bool:
        """Load the coordinator's latest version (waiting for a first one); False if stopped."""
        delay = 0.5
        while not self._stopping:
            if latest is None:
                record = await self._retry("latest version", self.coordinator.latest_version)
                latest = None if record is None else record.version
                if latest is None:
                    await self._sleep(self.settings.sync_poll_s)
                    continue
            self.follower.follow(latest, start=False)  # the first sync is done here
            try:
                report = await asyncio.to_thread(self.sync.sync_to, latest)
            except StateMismatchError:
                raise  # the bucket's model is not the engine's: a configuration error
            except Exception as exc:  # bucket, network, failed objects: ask again, retry
                self.metrics.initial_sync(ok=False)
                self._error(f"initial sync to v{latest}: {exc}")
                await self._sleep(delay)
                delay, latest = min(delay * 2, 30.0), None
                continue
            self.metrics.initial_sync(ok=True)
            logger.info("weights at v%s (%d step(s))", report.version, len(report.steps))
            return True
        return False

    # ------------------------------------------------------------------ threads

    def _shutdown_threads(self) -> None:
        """Stop the heartbeat and version threads (a running sync finishes), deregister."""
        self._heartbeat_stop.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(timeout=5.0)
        self.follower.stop()
        self._prover.shutdown(wait=True, cancel_futures=True)
        self.sync.close()
        self._deregister()
        self.coordinator.close()

    def _deregister(self) -> None:
        if not self._registered:
            return
        # best effort at shutdown: a coordinator that is down is not waited for (the client
        # would wait up to refused_wait_s for a restart); it reports the worker lost instead
        self.coordinator.refused_wait_s = 0.0
        try:
            self.coordinator.remove_worker(self.worker_id)
            logger.info("deregistered %s", self.worker_id)
        except (httpx.TransportError, CoordinatorError) as exc:
            logger.warning("could not deregister %s: %s", self.worker_id, exc)

    def _heartbeat_loop(self) -> None:
        while not self._heartbeat_stop.wait(self._heartbeat_s):
            try:
                self.heartbeat()
            except (httpx.TransportError, CoordinatorError) as exc:
                logger.warning("heartbeat failed: %s", exc)
            self.follower.kick()  # retries a failed sync once its backoff has passed

    def _error(self, message: str) -> None:
        logger.warning("%s", message)
        self._last_error = message

    # ------------------------------------------------------------------ episodes

    @property
    def _async(self) -> AsyncCoordinatorClient:
        assert self._async_client is not None, "only inside the episode loop"
        return self._async_client

    async def _admitted_seeds(self) -> AsyncIterator[int | None]:
        """One ``None`` (a random game) per group admission control lets this worker start."""
        credit = 0
        wait = self.settings.admission_wait_s
        while not self._stopping:
            if self._failures_in_a_row:
                await self._sleep(self._failure_backoff_s())
                if self._stopping:
                    break
            if credit == 0:
                status = self.sync.status()
                if not status.healthy:
                    await self._sleep(wait)
                    continue
                want = max(1, self.experiment.in_flight_groups - self._in_flight)
                try:
                    answer = await self._async.admission(self.worker_id, want, status.version)
                except (httpx.TransportError, CoordinatorError) as exc:
                    if isinstance(exc, CoordinatorError) and exc.code == "unknown_worker":
                        await self._retry("register", self._register)
                    else:
                        self._error(f"admission: {exc}")
                        await self._sleep(wait)
                    continue
                if answer.grant == 0:
                    if answer.reason == "update_weights":
                        self.follower.follow(answer.current_version)
                    logger.debug("admission granted nothing (%s)", answer.reason)
                    await self._sleep(wait)
                    continue
                credit = answer.grant
            credit -= 1
            self._in_flight += 1
            self.stats.started += 1
            yield None

    async def _episode_loop(self) -> None:
        assert self._stop is not None
        settings = self.settings
        submits: set[asyncio.Task[None]] = set()
        await self.targets.open()
        async with (
            AsyncCoordinatorClient(
                settings.coordinator_url, _secret(settings.worker_token), verify=self._verify
            ) as self._async_client,
            EnvClient(
                settings.env_url, token=_secret(settings.env_token), verify=self._verify
            ) as env,
        ):
            episodes = self.experiment.episode_settings(await self._task_of(env))
            async with EpisodeRunner(
                self.sync, self.format, env, episodes, metrics=self.metrics
            ) as runner:
                await self._play(runner, submits)

    async def _task_of(self, env: EnvClient) -> EnvMetadata | None:
        """The env server's ``/metadata`` (its system prompt and turn limit), when the settings
        leave either to it, asked until the server answers (None: the settings set both, or
        a stop came first). A server that answers without them (another OpenEnv server) leaves
        the defaults: no system turn, 6 turns."""
        if not self.experiment.leaves_to_server():
            return None
        delay = 0.2
        while True:
            try:
                task = await env.metadata()
                break
            except EnvError as err:  # answered, but not with metadata
                logger.warning("env server's /metadata: %s; playing with the defaults", err)
                return None
            except httpx.TransportError as err:  # not up yet, or unreachable for now
                if self._stopping:
                    return None
                logger.warning("env server's /metadata: %r; asking again in %.1f s", err, delay)
                await self._sleep(delay)
                delay = min(2 * delay, 5.0)
        logger.info(
            "env task %s: %s turns at most, %s system prompt",
            task.name,
            task.max_turns,
            "its" if task.system_prompt else "no",
        )
        return task

    async def _play(self, runner: EpisodeRunner, submits: set[asyncio.Task[None]]) -> None:
        settings = self.settings
        assert self._stop is not None
        stream = runner.stream_groups(
            self._admitted_seeds(), in_flight=self.experiment.in_flight_groups
        )
        try:
            async with asyncio.timeout(None) as self._drain, contextlib.aclosing(stream):
                if self._stopping:  # stopped before the loop began
                    loop = asyncio.get_running_loop()
                    self._drain.reschedule(loop.time() + settings.shutdown_grace_s)
                async for item in stream:
                    self._in_flight -= 1
                    if isinstance(item, Exception):
                        self.stats.group_errors += 1
                        self._failures_in_a_row += 1
                        self._error(
                            f"group failed: {item!r} ({self._failures_in_a_row} in a row; "
                            f"next group in {self._failure_backoff_s():.1f} s)"
                        )
                        continue
                    self._failures_in_a_row = 0
                    task = asyncio.create_task(self._submit(item))
                    submits.add(task)
                    task.add_done_callback(submits.discard)
        except TimeoutError:
            self.stats.abandoned += self._in_flight
            logger.warning("shutdown deadline: %d group(s) in flight abandoned", self._in_flight)
        finally:
            self._drain = None
            self._in_flight = 0
        if submits:
            logger.info("waiting for %d submission(s)", len(submits))
            _, late = await asyncio.wait(submits, timeout=settings.submit_timeout_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)

    async def _submit(self, group: EpisodeGroup) -> None:
        """Wait for the group's verdict, then submit it (see the module docstring)."""
        try:
            async with asyncio.timeout(self.settings.submit_timeout_s):
                if not await self._verified(group):
                    return
                await self._send(group)
        except TimeoutError:
            self.stats.dropped_timeout += 1
            self._error(f"group {group.group_id} not submitted within submit_timeout_s")
        except asyncio.CancelledError:
            self.stats.dropped_timeout += 1
            raise

    async def _verified(self, group: EpisodeGroup) -> bool:
        while True:
            verdict = group.verdict(self.sync.check)
            if verdict == "failed":
                self.stats.dropped_failed += 1
                self._error(f"group {group.group_id} dropped: sampled by weights that failed")
                return False
            if verdict == "verified" and self.sync.healthy:
                return True
            await asyncio.sleep(_VERDICT_POLL_S)

    async def _send(self, group: EpisodeGroup) -> SubmitResult | None:
        try:
            hints, teacher = await self.targets.of(group)
        except TeacherRefused as exc:
            self.stats.dropped_refused += 1
            self._error(f"group {group.group_id} dropped: the teacher refused it: {exc}")
            return None
        payload = encode_group(to_submission(group, self.worker_id, hints=hints, teacher=teacher))
        delay = 0.2
        while True:
            try:
                result = await self._async.submit(payload)
            except httpx.TransportError as exc:
                self._error(f"submit {group.group_id}: {exc} (retrying)")
            except CoordinatorError as exc:
                if exc.code == "unknown_worker":
                    await self._retry("register", self._register)
                    continue
                if exc.status_code < 500 and exc.code != "future_version":
                    self.stats.dropped_refused += 1
                    self.metrics.group_rejected(exc.code)
                    self._error(f"group {group.group_id} refused: {exc}")
                    return None
                self._error(f"submit {group.group_id}: {exc} (retrying)")
            else:
                if result.duplicate:
                    self.stats.duplicates += 1
                else:
                    self.stats.submitted += 1
                    self.metrics.group_accepted(group.version_min, result.current_version)
                    if self.sync.healthy:
                        self._last_error = None
                logger.debug(
                    "submitted %s (v%s..v%s): queue %d",
                    group.group_id,
                    group.version_min,
                    group.version_max,
                    result.queue_depth,
                )
                return result
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


def _secret(value: Any) -> str | None:
    return None if value is None else str(value.get_secret_value())


def _cut(text: str | None, limit: int = 4000) -> str | None:
    return None if text is None else text[:limit]
