"""The rollout worker against a real coordinator, a real Wordle server and a bucket that a
trainer (WeightPublisher on a tiny random Llama) publishes to: registration, versioned
submissions, following a new version through the event stream bit-exactly, heartbeats,
restarts without duplicates, graceful shutdown (in-process and by SIGTERM)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from episode_helpers import WordleServer
from rollout_helpers import same_bits
from support import GENEROUS_S
from tls_helpers import make_ca_and_server_cert
from typer.testing import CliRunner
from worker_helpers import (
    WORKER_TOKEN,
    CoordinatorServer,
    Trainer,
    WorkerThread,
    tiny_llama,
    wait_for,
    worker_settings,
)

from deltarl.buckets.local import LocalBucket
from deltarl.cli import app
from deltarl.rollout.engines.base import Completion, WeightsStamp
from deltarl.rollout.engines.transformers_engine import TransformersEngine
from deltarl.rollout.episodes.runner import Episode, EpisodeGroup, Turn
from deltarl.rollout.service import worker as worker_module
from deltarl.rollout.service.worker import RolloutWorker
from deltarl.rollout.settings import RolloutSettings
from deltarl.rollout.sync.records import Verdict
from deltarl.services.coordinator.client import AsyncCoordinatorClient, CoordinatorError
from deltarl.services.coordinator.schemas import TrajectoryGroup, WorkerInfo
from deltarl.weightsync.reader import BucketReader

pytestmark = [pytest.mark.network, pytest.mark.slow]


@pytest.fixture
def trainer(bucket: LocalBucket, coordinator: CoordinatorServer, tok: Any) -> Iterator[Trainer]:
    t = Trainer(bucket, coordinator, len(tok))
    yield t
    t.close()


def info(coordinator: CoordinatorServer, worker_id: str = "w-test") -> WorkerInfo | None:
    with coordinator.trainer() as c:
        try:
            return c.worker(worker_id)
        except CoordinatorError as exc:
            assert exc.status_code == 404
            return None


def drain_queue(coordinator: CoordinatorServer) -> list[TrajectoryGroup]:
    with coordinator.trainer() as c:
        batch = c.lease(max_groups=1000)
        if batch.lease.items:
            c.ack(batch.lease.batch_id)
        return batch.groups


def test_worker_submits_follows_a_new_version_and_shuts_down(
    coordinator: CoordinatorServer,
    env: WordleServer,
    trainer: Trainer,
    bucket: LocalBucket,
    tok: Any,
) -> None:
    # heartbeats and polling slow: a version reaching the worker quickly came through the SSE
    settings = worker_settings(coordinator, env.url, heartbeat_interval_s=30.0, sync_poll_s=30.0)
    runner = WorkerThread(settings, bucket, tok, len(tok))
    with runner as worker:
        wait_for(lambda: worker.stats.submitted >= 2, 20, "no group submitted at v0")
        assert worker.sync.version == 0
        assert same_bits(dict(worker.engine.named_parameters()), trainer.state())
        v1 = trainer.step(seed=1)
        wait_for(lambda: worker.sync.version == v1, 3, "v1 did not arrive through the stream")
        assert same_bits(dict(worker.engine.named_parameters()), trainer.state())
        before = worker.stats.submitted
        wait_for(lambda: worker.stats.submitted >= before + 2, 20, "no group submitted at v1")
        ack = worker.heartbeat()  # brings a weight challenge for v1, answered in a thread
        assert ack.challenge is not None and ack.challenge.version == v1
        wait_for(lambda: worker.stats.proofs_ok >= 1, 5, "the weight challenge was not answered")
        seen = info(coordinator)
        assert seen is not None and seen.applied_version == v1 and seen.state == "active"
        assert seen.last_error is None and seen.capacity == 2
        # proven: a fresh challenge answered from the served tensors, not a copied digest
        assert seen.weights_verified is True and seen.weights_proven_version == v1
        assert seen.digest_matches is True and worker.stats.proofs_failed == 0
        runner.stop()
    assert info(coordinator) is None  # deregistered
    groups = drain_queue(coordinator)
    stats = runner.worker.stats
    assert len(groups) == stats.submitted >= 4 and stats.duplicates == 0
    assert stats.dropped_failed == stats.dropped_refused == stats.group_errors == 0
    assert len({g.group_id for g in groups}) == len(groups)
    spans = set()
    for g in groups:
        assert g.worker_id == "w-test" and len(g.trajectories) == 2
        for t in g.trajectories:
            assert 0 <= t.version_min <= t.version_max <= v1
            assert sum(t.mask) > 0
            spans.add((t.version_min, t.version_max))
            # the system turn is the one the env server's /metadata gives
            assert "expert Wordle player" in tok.decode(t.tokens[: t.prompt_len])
    assert (0, 0) in spans and (v1, v1) in spans


def test_polls_when_the_event_stream_is_refused_and_coalesces_versions(
    coordinator: CoordinatorServer,
    env: WordleServer,
    trainer: Trainer,
    bucket: LocalBucket,
    tok: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opened: list[int | None] = []

    async def refused(self: AsyncCoordinatorClient, after: int | None = None) -> Any:
        opened.append(after)
        raise CoordinatorError(503, "unavailable", "event stream disabled by a proxy")
        yield  # an async generator, like the real one

    monkeypatch.setattr(AsyncCoordinatorClient, "iter_version_events", refused)
    settings = worker_settings(coordinator, env.url, heartbeat_interval_s=30.0, sync_poll_s=0.2)
    runner = WorkerThread(settings, bucket, tok, len(tok))
    with runner as worker:
        wait_for(lambda: worker.sync.version == 0 and opened, 20, "the worker did not start")
        latest = [trainer.step(seed=10 + i) for i in range(3)][-1]
        wait_for(lambda: worker.sync.version == latest, 5, "polling did not find the versions")
        assert same_bits(dict(worker.engine.named_parameters()), trainer.state())
        assert len(opened) >= 2  # the stream was tried again after each poll
        runner.stop()
    assert runner.worker.follower.failures == 0


def test_heartbeats_report_the_applied_version_and_restart_does_not_duplicate(
    coordinator: CoordinatorServer,
    env: WordleServer,
    trainer: Trainer,
    bucket: LocalBucket,
    tok: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the first answer to a submission is lost: the worker retries with the same key
    original = AsyncCoordinatorClient.submit
    lost: list[str] = []

    async def lossy(self: AsyncCoordinatorClient, group: Any) -> Any:
        result = await original(self, group)
        if not lost:
            lost.append("answer")
            raise httpx.ReadError("connection reset while reading the answer")
        return result

    monkeypatch.setattr(AsyncCoordinatorClient, "submit", lossy)
    settings = worker_settings(coordinator, env.url)
    first = WorkerThread(settings, bucket, tok, len(tok))
    with first as worker:
        wait_for(lambda: worker.stats.submitted >= 2, 20, "no group submitted")
        # the retried submission was recognised as the same group
        wait_for(lambda: worker.stats.duplicates == 1, 3, "the retry was not a duplicate")
        seen = wait_for(
            lambda: (i := info(coordinator)) is not None and i.applied_version == 0 and i,
            5,
            "heartbeats did not report v0",
        )
        first.stop()
    # a new version while the worker is down; the restart rejoins at it
    v1 = trainer.step(seed=2)
    second = WorkerThread(settings, bucket, tok, len(tok))
    with second as worker:
        wait_for(lambda: worker.stats.submitted >= 1, 20, "no group submitted after restart")
        seen = wait_for(
            lambda: (i := info(coordinator)) is not None and i.applied_version == v1 and i,
            5,
            "heartbeats did not report v1",
        )
        assert [s.kind for s in worker.sync.timings][:1] == ["anchor"]
        second.stop()
    groups = drain_queue(coordinator)
    # every group once: the one whose answer was lost counts as a duplicate on the worker
    a, b = first.worker.stats, second.worker.stats
    total = a.submitted + a.duplicates + b.submitted
    assert b.duplicates == 0
    assert len(groups) == total and len({g.group_id for g in groups}) == total
    restarted = groups[a.submitted + a.duplicates :]  # the queue keeps submission order
    assert all(t.version_min == v1 for g in restarted for t in g.trajectories)
    assert seen.applied_version == v1


def test_no_submission_while_unhealthy_and_the_heartbeat_says_why(
    coordinator: CoordinatorServer,
    env: WordleServer,
    trainer: Trainer,
    bucket: LocalBucket,
    tok: Any,
) -> None:
    """The engine's weights drift silently; the next delta fails verification and, with the
    only anchor gone, cannot be recovered until the trainer publishes a new anchor."""
    settings = worker_settings(coordinator, env.url)
    runner = WorkerThread(settings, bucket, tok, len(tok))
    with runner as worker:
        wait_for(lambda: worker.stats.submitted >= 1, 20, "no group submitted at v0")
        anchor = next(o for o in BucketReader(bucket).manifest(0).objects if o.kind == "anchor")
        (bucket.root / anchor.key).unlink()
        with torch.no_grad():  # a silent corruption of the engine's copy
            weights = worker.engine.named_parameters()["lm_head.weight"]
            weights.view(torch.int16).view(-1)[:64] += 1
        v1 = trainer.step(seed=3)
        seen = wait_for(
            lambda: (i := info(coordinator)) is not None and i.last_error is not None and i,
            5,
            "the heartbeat did not report the failure",
        )
        assert seen.applied_version is None and "verification of v1 failed" in seen.last_error
        assert seen.weights_verified is None
        assert not worker.sync.healthy
        v2 = trainer.step(seed=4, anchor=True)  # the trainer re-anchors: the worker recovers
        wait_for(lambda: worker.sync.healthy and worker.sync.version == v2, 5, "no recovery")
        before = worker.stats.submitted
        wait_for(lambda: worker.stats.submitted > before, 20, "no group submitted at v2")
        runner.stop()
    assert same_bits(dict(runner.worker.engine.named_parameters()), trainer.state())
    versions = {
        v
        for g in drain_queue(coordinator)
        for t in g.trajectories
        for v in (t.version_min, t.version_max)
    }
    assert v1 not in versions and v2 in versions  # nothing sampled by the failed weights


def one_episode_group(version: int) -> EpisodeGroup:
    stamp = WeightsStamp(version, 1)
    completion = Completion([5, 6], [-1.0, -0.5], "stop", stamp, stamp)
    turn = Turn(1, 3, completion, "[crane]", version, version, 1.0, {}, True)
    ep = Episode("g-" + "ab" * 16, 0, 3, [1, 5, 6], [0, 1, 1], [0.0, -1.0, -0.5], 1, [turn])
    ep.done, ep.reward = True, 1.0
    return EpisodeGroup(ep.group_id, 3, [ep])


def test_pending_groups_wait_unhealthy_weights_hold_and_failed_groups_are_dropped(
    coordinator: CoordinatorServer,
    env: WordleServer,
    trainer: Trainer,
    bucket: LocalBucket,
    tok: Any,
) -> None:
    worker = WorkerThread(worker_settings(coordinator, env.url), bucket, tok, len(tok)).worker
    worker._register()
    worker.sync.sync_to(0)
    verdicts: list[Verdict] = ["pending"] * 5

    def check(completion: Completion) -> Verdict:
        return verdicts.pop(0) if verdicts else "verified"

    worker.sync.check = check  # type: ignore[method-assign]

    def queued() -> int:
        with coordinator.trainer() as c:
            return c.status().queue.depth

    async def main() -> None:
        async with AsyncCoordinatorClient(coordinator.url, WORKER_TOKEN) as client:
            worker._async_client = client
            # pending: held until verified
            task = asyncio.create_task(worker._submit(one_episode_group(0)))
            await asyncio.sleep(0.05)
            assert not task.done() and queued() == 0
            await task
            assert worker.stats.submitted == 1 and queued() == 1
            # unhealthy weights: held, even with a "verified" verdict, until a sync recovers
            worker.sync._set_unhealthy("test: weights poisoned")
            group = one_episode_group(0)
            group.group_id = group.episodes[0].group_id = "g-" + "cd" * 16
            task = asyncio.create_task(worker._submit(group))
            await asyncio.sleep(0.1)
            assert not task.done() and queued() == 1
            await asyncio.to_thread(worker.sync.sync_to, 0)  # reloads the anchor
            await task
            assert worker.stats.submitted == 2 and queued() == 2
            # failed: dropped
            verdicts.append("failed")
            group.group_id = group.episodes[0].group_id = "g-" + "ef" * 16
            await worker._submit(group)
            assert worker.stats.dropped_failed == 1 and queued() == 2

    asyncio.run(main())
    worker.sync.close()


def test_sigterm_finishes_in_flight_groups_and_deregisters(
    coordinator: CoordinatorServer,
    env: WordleServer,
    trainer: Trainer,
    bucket: LocalBucket,
    tok: Any,
    tmp_path: Path,
) -> None:
    """``python -m deltarl.rollout`` with the model from a directory (config + tokenizer)."""
    model_dir = tmp_path / "model"
    tiny_llama(len(tok)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    experiment = tmp_path / "worker.toml"
    experiment.write_text(
        f'in_flight_groups = 2\n[engine]\nmodel = "{model_dir}"\ndevice = "cpu"\n'
        "[episodes]\ngroup_size = 2\nmax_turns = 2\n"
    )
    env_vars = {
        **os.environ,
        "DELTARL_ROLLOUT_COORDINATOR_URL": coordinator.url,
        "DELTARL_ROLLOUT_WORKER_TOKEN": WORKER_TOKEN,
        "DELTARL_ROLLOUT_ENV_URL": env.url,
        "DELTARL_ROLLOUT_BUCKET_URI": str(bucket.root),
        "DELTARL_ROLLOUT_WORKER_ID": "w-sub",
        # the experiment: a file (TOML) and --set
        "DELTARL_ROLLOUT_CONFIG": str(experiment),
        "DELTARL_ROLLOUT_ADMISSION_WAIT_S": "0.05",
        "DELTARL_ROLLOUT_SHUTDOWN_GRACE_S": "5",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltarl.rollout", "--set", "episodes.sampling.max_new_tokens=4"],
        env=env_vars,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(
            lambda: (
                proc.poll() is not None
                or ((i := info(coordinator, "w-sub")) is not None and i.submitted >= 1)
            ),
            60,  # a fresh interpreter imports torch + transformers: seconds on a loaded box
            "the worker process submitted nothing",
        )
        assert proc.poll() is None, proc.communicate()[0]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    assert "stopping" in out and "deregistered w-sub" in out and "abandoned=0" in out
    assert info(coordinator, "w-sub") is None
    assert len(drain_queue(coordinator)) >= 1


def test_tls_with_a_custom_ca_bundle(
    env: WordleServer, bucket: LocalBucket, tok: Any, tmp_path: Path
) -> None:
    ca, cert, key = make_ca_and_server_cert(tmp_path)
    with CoordinatorServer(tmp_path, tls=(ca, cert, key)) as coordinator:
        assert coordinator.url.startswith("https://")
        trainer = Trainer(bucket, coordinator, len(tok))
        # without the CA the worker cannot even register (and says why)
        untrusting = WorkerThread(worker_settings(coordinator, env.url), bucket, tok, len(tok))
        with untrusting as worker:
            wait_for(lambda: worker._last_error, 5, "no error without the CA")
            assert "CERTIFICATE_VERIFY_FAILED" in str(worker._last_error)
            untrusting.stop()
        assert info(coordinator) is None
        settings = worker_settings(coordinator, env.url, ca_bundle=str(ca))
        with WorkerThread(settings, bucket, tok, len(tok)) as worker:
            wait_for(lambda: worker.stats.submitted >= 1, 20, "nothing submitted over TLS")
        trainer.close()


def test_help_lists_the_settings_and_bad_settings_are_refused() -> None:
    result = CliRunner().invoke(app, ["rollout", "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0
    for name in ("COORDINATOR_URL", "BUCKET_URI", "CA_BUNDLE", "CONFIG", "SYNC_POLL_S"):
        assert f"DELTARL_ROLLOUT_{name}" in result.output
    assert "--config" in result.output and "--set" in result.output
    assert "DELTARL_ROLLOUT_IN_FLIGHT_GROUPS" not in result.output  # the experiment's
    moved = CliRunner().invoke(
        app, ["rollout"], env={"COLUMNS": "300", "DELTARL_ROLLOUT_GROUP_SIZE": "4"}
    )
    assert moved.exit_code != 0 and "episodes.group_size" in moved.output
    unknown = CliRunner().invoke(
        app, ["rollout", "--set", "episodes.sampling.max_new_tokenz=4"], env={"COLUMNS": "300"}
    )
    assert unknown.exit_code != 0 and "max_new_tokenz" in unknown.output
    bad = CliRunner().invoke(
        app, ["rollout", "--worker-id", "no spaces allowed"], env={"COLUMNS": "300"}
    )
    assert bad.exit_code != 0 and "worker id" in bad.output
    with pytest.raises(ValueError, match="CA bundle"):
        RolloutSettings(ca_bundle="/nonexistent/ca.pem")
    settings = RolloutSettings.model_validate({"worker_id": "", "worker_token": ""})
    assert settings.worker_id.endswith(f"-{os.getpid()}") and settings.worker_token is None


def test_the_service_closes_the_engine_it_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """`deltarl rollout` releases its engine when the worker stops, normally or not (the vllm
    engine's core is a separate process holding the GPU memory: a stopped teacher service once
    left two of them running on an H200); an engine given to the constructor is not closed."""
    from deltarl.rollout.service.worker import RolloutWorker

    closed: list[str] = []

    class Engine:
        type = "fake"

        def close(self) -> None:
            closed.append("engine")

    def built(outcome: BaseException | None) -> Any:
        def from_settings(settings: RolloutSettings, experiment: Any = None) -> RolloutWorker:
            worker = object.__new__(RolloutWorker)
            worker.engine = Engine()  # type: ignore[assignment]
            worker._owns_engine = True

            def run(**_: Any) -> None:
                if outcome is not None:
                    raise outcome

            worker.run = run  # type: ignore[method-assign]
            return worker

        return from_settings

    for outcome in (None, CoordinatorError(403, "FORBIDDEN", "refused")):
        closed.clear()
        monkeypatch.setattr(RolloutWorker, "from_settings", built(outcome))
        result = CliRunner().invoke(app, ["rollout"], env={"COLUMNS": "300"})
        assert result.exit_code == (0 if outcome is None else 1), result.output
        assert closed == ["engine"], outcome
    worker = object.__new__(RolloutWorker)
    worker.engine, worker._owns_engine = Engine(), False  # type: ignore[assignment]
    closed.clear()
    worker.close()
    assert closed == []


def test_sigterm_is_prompt_while_the_coordinator_is_down(
    bucket: LocalBucket, tok: Any, tmp_path: Path
) -> None:
    """A worker retrying its registration against a coordinator that refuses connections stops
    within seconds of SIGTERM (the client's own refused wait is short; the worker's retry loop
    is what rides out an outage, and a stop request interrupts it)."""
    import socket

    model_dir = tmp_path / "model"
    tiny_llama(len(tok)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    env_vars = {
        **os.environ,
        "DELTARL_ROLLOUT_COORDINATOR_URL": dead,
        "DELTARL_ROLLOUT_WORKER_TOKEN": WORKER_TOKEN,
        "DELTARL_ROLLOUT_ENV_URL": dead,
        "DELTARL_ROLLOUT_BUCKET_URI": str(bucket.root),
        "DELTARL_ROLLOUT_WORKER_ID": "w-down",
        "DELTARL_ROLLOUT_PORT": "0",
    }
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                *("-m", "deltarl.rollout"),
                *("--set", f"engine.model={model_dir}", "--set", "engine.device=cpu"),
            ],
            env=env_vars,
            stdout=out,
            stderr=out,
        )
    try:
        wait_for(lambda: "register:" in log.read_text(), 90, "no registration attempt logged")
        time.sleep(1.0)  # the next attempt (after a 0.2 s backoff) is now waiting on the client
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, log.read_text()[-2000:]
    # not the client's 30 s wait for a refused coordinator
    assert took < GENEROUS_S, f"SIGTERM took {took:.1f} s with the coordinator down"


def test_failing_groups_back_off_and_the_next_good_group_resets_it(
    coordinator: CoordinatorServer,
    env: WordleServer,
    trainer: Trainer,
    bucket: LocalBucket,
    tok: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a worker whose GPU ran out of memory failed ~3,900 groups in minutes, each a
    # log warning and a game opened for nothing; now each failure in a row doubles the wait
    failing = {"left": 5}
    real_generate = TransformersEngine.generate

    def generate(self: TransformersEngine, *args: Any, **kwargs: Any) -> Any:
        if failing["left"] > 0:
            failing["left"] -= 1
            raise RuntimeError("CUDA out of memory (test)")
        return real_generate(self, *args, **kwargs)

    waits: list[tuple[int, float]] = []  # (failures in a row, backoff) at each wait
    real_backoff = RolloutWorker._failure_backoff_s

    def backoff(self: RolloutWorker) -> float:
        seconds = real_backoff(self)
        waits.append((self._failures_in_a_row, seconds))
        return seconds

    monkeypatch.setattr(TransformersEngine, "generate", generate)
    monkeypatch.setattr(RolloutWorker, "_failure_backoff_s", backoff)
    monkeypatch.setattr(worker_module, "FAILURE_BACKOFF_MAX_S", 0.2)
    settings = worker_settings(coordinator, env.url, admission_wait_s=0.05, in_flight_groups=1)
    with WorkerThread(settings, bucket, tok, len(tok)) as worker:
        wait_for(lambda: worker.stats.submitted >= 2, 30, "no group after the failures")
        errors = worker.stats.group_errors
        assert errors >= 1 and worker._failures_in_a_row == 0  # reset by the good groups
    # one group at a time: the k-th failure in a row waits 0.05 * 2^(k-1) s, at most 0.2
    expected = {k: min(0.05 * 2 ** (k - 1), 0.2) for k in range(1, errors + 1)}
    assert waits and all(seconds == expected[k] for k, seconds in waits)
    assert {k for k, _ in waits} == set(range(1, errors + 1))
