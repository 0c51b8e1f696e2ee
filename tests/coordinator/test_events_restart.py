"""Version events (SSE) and restarts of the coordinator with either store."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support import GENEROUS_S, fast_pacing

from deltarl.services.coordinator.client import (
    AsyncCoordinatorClient,
    CoordinatorClient,
    CoordinatorError,
)
from deltarl.services.coordinator.schemas import VersionRecord, WorkerHeartbeat, WorkerRegistration

from .conftest import TRAINER_TOKEN, WORKER_TOKEN, LiveServer, RedisServer
from .helpers import group, manifest


def test_sse_delivers_each_new_version_as_it_is_published(server: LiveServer) -> None:
    """Live, not replayed later: each version reaches the listener before the next one is
    published (how fast is the coordinator benchmark's business, not a test's)."""
    trainer = CoordinatorClient(server.url, TRAINER_TOKEN)
    reader = CoordinatorClient(server.url)
    trainer.publish_version(manifest(0))
    trainer.publish_version(manifest(1))
    got: list[int] = []
    arrived = threading.Condition()

    def listen() -> None:
        for rec in reader.iter_version_events(after=0):  # replays 1, then live ones
            with arrived:
                got.append(rec.version)
                arrived.notify_all()
            if rec.version == 3:
                return

    th = threading.Thread(target=listen, daemon=True)
    th.start()
    for v in (1, 2, 3):
        if v > 1:
            trainer.publish_version(manifest(v))
        with arrived:
            assert arrived.wait_for(lambda v=v: v in got, timeout=GENEROUS_S), (v, got)
    th.join(timeout=GENEROUS_S)
    assert got == [1, 2, 3]


def test_async_client_events_and_calls(server: LiveServer) -> None:
    async def main() -> list[VersionRecord]:
        async with (
            AsyncCoordinatorClient(server.url, TRAINER_TOKEN) as trainer,
            AsyncCoordinatorClient(server.url, WORKER_TOKEN) as worker,
            AsyncCoordinatorClient(server.url) as reader,
        ):
            await trainer.publish_version(manifest(0))
            ack = await worker.register(
                WorkerRegistration(worker_id="w1", engine="e", model="m", capacity=1)
            )
            assert ack.latest_version == 0
            await worker.submit(group("a1"))
            batch = await trainer.lease(4)
            assert (await trainer.ack(batch.lease.batch_id)).acked == 1
            seen: list[VersionRecord] = []

            async def listen() -> None:
                async for rec in reader.iter_version_events(after=None):
                    seen.append(rec)
                    if rec.version == 1:
                        return

            task = asyncio.create_task(listen())
            await asyncio.sleep(0.2)
            await trainer.publish_version(manifest(1))
            await asyncio.wait_for(task, 5)
            return seen

    seen = asyncio.run(main())
    assert [r.version for r in seen] == [0, 1]


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
def test_restart_loses_nothing(
    backend: str,
    make_server: Callable[..., LiveServer],
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    overrides: dict[str, object] = {}
    if backend == "redis":
        redis_server: RedisServer = request.getfixturevalue("redis_server")
        overrides = {
            "store": "redis",
            "redis_url": redis_server.url,
            "redis_prefix": f"r{time.time_ns()}",
        }
    s1 = make_server(**overrides)
    trainer, worker = (
        CoordinatorClient(s1.url, TRAINER_TOKEN),
        CoordinatorClient(s1.url, WORKER_TOKEN),
    )
    trainer.publish_version(manifest(0))
    trainer.publish_version(manifest(1))
    worker.register(WorkerRegistration(worker_id="w1", engine="e", model="m", capacity=1))
    for i in range(5):
        worker.submit(group(f"k{i}", vmin=1))
    held = trainer.lease(2, lease_s=0.5)  # the trainer dies holding this lease
    assert len(held.groups) == 2
    s1.stop()
    if backend == "redis":  # restart the Redis server too: AOF must bring everything back
        redis_server.stop()
        redis_server.start()
    s2 = make_server(**overrides)
    trainer, worker = (
        CoordinatorClient(s2.url, TRAINER_TOKEN),
        CoordinatorClient(s2.url, WORKER_TOKEN),
    )
    assert [v.version for v in trainer.versions()] == [0, 1]
    assert worker.submit(group("k3", vmin=1)).duplicate  # idempotency survives the restart
    time.sleep(0.6)
    got: list[str] = []
    while batch := trainer.lease(10).groups:  # the expired ones come back first, each alone
        got += [g.idempotency_key for g in batch]
    assert sorted(got) == [f"k{i}" for i in range(5)]
    st = trainer.status()
    assert st.queue.submitted_total == 5 and st.workers[0].worker_id == "w1"


@pytest.mark.slow
def test_sigkill_loses_no_accepted_group(tmp_path: Path) -> None:
    """kill -9 of a coordinator process (SQLite): every answered submission is still there."""
    import os
    import signal
    import subprocess
    import sys

    from support import free_port

    env = {
        **os.environ,
        "DELTARL_COORDINATOR_TRAINER_TOKEN": TRAINER_TOKEN,
        "DELTARL_COORDINATOR_WORKER_TOKEN": WORKER_TOKEN,
        "DELTARL_COORDINATOR_SQLITE_PATH": str(tmp_path / "db.sqlite3"),
        "DELTARL_LOG_LEVEL": "WARNING",
    }

    def start() -> tuple[subprocess.Popen[bytes], str]:
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "deltarl.services.coordinator", "--port", str(port)], env=env
        )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            try:
                CoordinatorClient(url, retries=0).health()
                return proc, url
            except Exception:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)

    proc, url = start()
    trainer, worker = CoordinatorClient(url, TRAINER_TOKEN), CoordinatorClient(url, WORKER_TOKEN)
    trainer.publish_version(manifest(0))
    worker.register(WorkerRegistration(worker_id="w1", engine="e", model="m", capacity=1))
    accepted = [worker.submit(group(f"k{i}")).submission_id for i in range(20)]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    proc, url = start()
    try:
        batch = CoordinatorClient(url, TRAINER_TOKEN).lease(100)
        assert [i.submission_id for i in batch.lease.items] == accepted
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
def test_two_coordinators_share_one_store(
    backend: str, make_server: Callable[..., LiveServer], request: pytest.FixtureRequest
) -> None:
    """Two coordinator processes (as with --workers 2) on one store stay consistent: a version
    recorded through one is usable at once through the other, and each group is leased once."""
    overrides: dict[str, object] = {"pacing": fast_pacing(event_poll_s=30.0)}  # on demand only
    if backend == "redis":
        redis_server: RedisServer = request.getfixturevalue("redis_server")
        overrides |= {
            "store": "redis",
            "redis_url": redis_server.url,
            "redis_prefix": f"s{time.time_ns()}",
        }
    a, b = make_server(**overrides), make_server(**overrides)
    ta, tb = CoordinatorClient(a.url, TRAINER_TOKEN), CoordinatorClient(b.url, TRAINER_TOKEN)
    wa, wb = CoordinatorClient(a.url, WORKER_TOKEN), CoordinatorClient(b.url, WORKER_TOKEN)
    ta.publish_version(manifest(0))
    wb.register(WorkerRegistration(worker_id="w1", engine="e", model="m", capacity=1))
    ta.publish_version(manifest(1))
    assert wb.heartbeat("w1", WorkerHeartbeat(applied_version=1)).latest_version == 1
    assert not wb.submit(group("g1", vmin=1)).duplicate
    assert wa.submit(group("g1", vmin=1)).duplicate  # idempotency across processes
    tb.publish_version(manifest(2))  # b learns about 1 before checking 2's base
    with pytest.raises(CoordinatorError) as e:
        ta.publish_version(manifest(2, anchor=True))
    assert e.value.code == "version_conflict"
    for i in range(10):
        (wa if i % 2 else wb).submit(group(f"k{i}", vmin=2))
    got = [g.idempotency_key for g in ta.lease(6).groups] + [
        g.idempotency_key for g in tb.lease(20).groups
    ]
    assert sorted(got) == sorted(["g1"] + [f"k{i}" for i in range(10)])
