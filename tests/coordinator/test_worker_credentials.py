"""Per-worker credentials (``worker_key``): a worker's own token acts only for that worker id on
every worker route; the shared worker token and forged tokens are refused."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

from deltarl.services.coordinator.auth import token_worker, worker_token_for
from deltarl.services.coordinator.client import CoordinatorClient, CoordinatorError
from deltarl.services.coordinator.schemas import WorkerHeartbeat, WorkerRegistration

from .conftest import TRAINER_TOKEN, WORKER_TOKEN, LiveServer
from .helpers import group, manifest

KEY = "worker-key-for-the-tests-0123456789"


def reg(worker_id: str) -> WorkerRegistration:
    return WorkerRegistration(worker_id=worker_id, engine="hf", model="m", capacity=2)


def refused(call: Callable[[], object], status: int = 403) -> CoordinatorError:
    with pytest.raises(CoordinatorError) as e:
        call()
    assert e.value.status_code == status, e.value
    return e.value


def test_tokens_are_bound_to_their_worker() -> None:
    t1 = worker_token_for(KEY, "w1")
    assert t1.startswith("dw1/w1/") and t1 != worker_token_for(KEY, "w2")
    assert token_worker(KEY, t1) == "w1"
    assert token_worker(KEY, worker_token_for("another-key-0123456789", "w1")) is None
    assert token_worker(KEY, t1[:-1] + ("0" if t1[-1] != "0" else "1")) is None
    assert token_worker(KEY, t1.replace("dw1/w1/", "dw1/w2/")) is None
    for junk in ("", "dw1/", "dw1//x", "w1", WORKER_TOKEN, "dw1/space:ns:a/" + "0" * 64):
        assert token_worker(KEY, junk) is None
    colon = worker_token_for(KEY, "space:ns:a.b@c")  # ids with ':' '.' '@' round-trip
    assert token_worker(KEY, colon) == "space:ns:a.b@c"


def test_a_worker_acts_only_for_itself(make_server: Callable[..., LiveServer]) -> None:
    server = make_server(worker_key=KEY, public_reads=False)
    trainer = CoordinatorClient(server.url, TRAINER_TOKEN, retries=0)
    w1 = CoordinatorClient(server.url, worker_token_for(KEY, "w1"), retries=0)
    shared = CoordinatorClient(server.url, WORKER_TOKEN, retries=0)
    forged = CoordinatorClient(server.url, "dw1/w1/" + "0" * 64, retries=0)
    trainer.publish_version(manifest(0))

    for client in (shared, forged):  # not a per-worker token of this coordinator
        err = refused(lambda c=client: c.register(reg("w1")))  # type: ignore[misc]
        assert "worker token" in err.message
    assert w1.register(reg("w1")).worker.worker_id == "w1"
    trainer_as_worker = CoordinatorClient(server.url, TRAINER_TOKEN, retries=0)
    refused(lambda: trainer_as_worker.register(reg("w1")))

    # every worker route, acting for another worker: refused
    err = refused(lambda: w1.register(reg("w2")))
    assert "belongs to worker 'w1'" in err.message
    refused(lambda: w1.heartbeat("w2", WorkerHeartbeat(applied_version=0)))
    refused(lambda: w1.prove("w2", "a" * 64, "b" * 64))
    refused(lambda: w1.remove_worker("w2"))
    refused(lambda: w1.admission("w2", want=1, applied_version=0))
    refused(lambda: w1.submit(group("k-2", worker="w2")))
    # and for itself: accepted
    assert w1.heartbeat("w1", WorkerHeartbeat(applied_version=0)).worker.applied_version == 0
    assert w1.admission("w1", want=1, applied_version=0).grant >= 0
    assert not w1.submit(group("k-1", worker="w1")).duplicate
    refused(lambda: w1.prove("w1", "a" * 64, "b" * 64), 409)  # authorized, no challenge
    # private reads: a worker's own token reads (workers need versions and plans)
    assert w1.status().latest_version == 0
    refused(lambda: forged.status())
    w1.remove_worker("w1")


@pytest.mark.slow
def test_cli_prints_the_token(tmp_path: object) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "deltarl", "worker-token", "w7"],
        env={"DELTARL_COORDINATOR_WORKER_KEY": KEY, "PATH": "/usr/bin:/bin", "COLUMNS": "300"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == worker_token_for(KEY, "w7")
    bad = subprocess.run(
        [sys.executable, "-m", "deltarl", "worker-token", "a/b"],
        env={"DELTARL_COORDINATOR_WORKER_KEY": KEY, "PATH": "/usr/bin:/bin", "COLUMNS": "300"},
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "worker id" in bad.stderr
    weak = subprocess.run(
        [sys.executable, "-m", "deltarl", "worker-token", "w7"],
        env={"DELTARL_COORDINATOR_WORKER_KEY": "short", "PATH": "/usr/bin:/bin", "COLUMNS": "300"},
        capture_output=True,
        text=True,
    )
    assert weak.returncode == 2 and "16 printable" in weak.stderr and "short" not in weak.stdout
