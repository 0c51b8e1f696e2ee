"""Weight challenges for every worker at every version, on both stores, over HTTP.

One worker cannot empty a version's pool: it is issued at most ``proof_attempts`` challenges
there (across failures, expiries and rejoins), and a retry only comes from the pool's surplus
over the first challenges other active workers still need. The trainer sizes each version's pool
to the fleet from the coordinator's answer (``wanted``) and tops it up while it holds the
version: 120 workers are all proven at one version."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch

from deltarl.buckets.local import LocalBucket
from deltarl.services.coordinator import service as service_module
from deltarl.services.coordinator.client import CoordinatorClient
from deltarl.services.coordinator.schemas import (
    WeightChallenge,
    WorkerHeartbeat,
    WorkerRegistration,
)
from deltarl.trainer.publish.weights import (
    WeightPublisher,
    coordinator_challenge_need,
    coordinator_challenges,
)
from deltarl.trainer.settings import PublishSettings
from deltarl.weightsync.proof import ProofSpec, proof_answer

from .conftest import TRAINER_TOKEN, WORKER_TOKEN, LiveServer


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(params=["sqlite", "redis"])
def serve(
    request: pytest.FixtureRequest, make_server: Callable[..., LiveServer]
) -> Iterator[Callable[..., LiveServer]]:
    """A coordinator on the parametrized store."""

    def make(**overrides: object) -> LiveServer:
        if request.param == "redis":
            redis = request.getfixturevalue("redis_server")
            overrides = {
                "store": "redis",
                "redis_url": redis.url,
                "redis_prefix": "t" + uuid.uuid4().hex[:12],
                **overrides,
            }
        return make_server(**overrides)

    yield make


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 16, generator=g),
        "layer.0.w": torch.randn(16, 16, generator=g),
        "norm.weight": torch.randn(16, generator=g),
    }


def served(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a worker holding the published version serves (the bf16 cast)."""
    return {n: t.to(torch.bfloat16) for n, t in state.items()}


def answer(state: dict[str, torch.Tensor], ch: WeightChallenge) -> str:
    spec = ProofSpec(ch.chunk_bytes, ch.chunks)
    return proof_answer(state, bytes.fromhex(ch.nonce), ch.version, spec)


def register(worker: CoordinatorClient, worker_id: str) -> None:
    worker.register(WorkerRegistration(worker_id=worker_id, engine="hf", model="m", capacity=1))


def heartbeat(worker: CoordinatorClient, worker_id: str, version: int) -> WeightChallenge | None:
    return worker.heartbeat(worker_id, WorkerHeartbeat(applied_version=version)).challenge


def publisher(tmp_path: Path, trainer: CoordinatorClient) -> WeightPublisher:
    """The trainer's publisher, as ``deltarl train`` wires it (top-ups called by the test)."""
    settings = PublishSettings(background=False, proof_chunks=16, proof_topup_s=0)
    return WeightPublisher(
        LocalBucket(tmp_path / f"bucket-{uuid.uuid4().hex[:8]}"),
        settings,
        register=trainer.publish_version,
        challenges=coordinator_challenges(trainer),
        challenge_need=coordinator_challenge_need(trainer),
    )


def test_one_worker_cannot_empty_a_version_s_challenges(
    serve: Callable[..., LiveServer], tmp_path: Path
) -> None:
    clock = Clock()
    server = serve(clock=clock, proof_ttl_s=30.0, lost_after_s=1000.0)
    trainer = CoordinatorClient(server.url, TRAINER_TOKEN, retries=0)
    worker = CoordinatorClient(server.url, WORKER_TOKEN, retries=0)
    anon = CoordinatorClient(server.url, retries=0)
    honest = [f"w{i:02d}" for i in range(12)]
    evil = ["evil", *(f"evil-{i}" for i in range(3))]  # a shared worker token: several ids
    for wid in honest + evil:
        register(worker, wid)
    state = weights(0)
    with publisher(tmp_path, trainer) as pub:
        v = pub.publish(state)  # registers v0 and sizes its pool to the 16 workers
    pool = anon.challenge_pool(v)
    assert pool.posted and pool.workers_active == 16 and pool.wanted == 0
    assert pool.pool_size == 16 + 8 + 4  # one each, the margin, a quarter for retries

    # the attack: 20 heartbeats per evil id, each after a wrong answer, a rejoin, or an
    # expired challenge; its ids get at most proof_attempts (3) challenges each at v0
    seen: dict[str, set[str]] = {wid: set() for wid in evil}
    for i in range(20):
        for wid in evil:
            ch = heartbeat(worker, wid, v)
            if ch is None:
                continue
            seen[wid].add(ch.nonce)
            if i % 3 == 0:
                assert not worker.prove(wid, ch.nonce, "0" * 64).verified
            elif i % 3 == 1:
                register(worker, wid)  # a rejoin forgets the outstanding challenge
        clock.t += 31.0 if i % 3 == 2 else 1.0  # every third round: let challenges expire
    assert all(1 <= len(nonces) <= 3 for nonces in seen.values()), seen

    # every honest worker still gets its challenge and is proven
    for wid in honest:
        ch = heartbeat(worker, wid, v)
        assert ch is not None, wid
        assert worker.prove(wid, ch.nonce, answer(served(state), ch)).verified
    assert all(anon.worker(wid).weights_verified for wid in honest)
    status = anon.status()
    assert status.workers_waiting_for_challenge == 0
    assert status.challenges is not None and status.challenges.workers_challenged == 16
    assert sum(map(len, seen.values())) + len(honest) + status.challenges.pool_size == 28


@pytest.mark.slow
def test_a_fleet_of_120_workers_is_proven_at_one_version(
    serve: Callable[..., LiveServer], tmp_path: Path
) -> None:
    """120 workers, of which 10 fail their first answer (a stale engine, then fixed) and 10
    join after the publish: every one is proven at v1; the operator saw who waited."""
    clock = Clock()
    server = serve(clock=clock, proof_ttl_s=30.0, lost_after_s=1000.0)
    trainer = CoordinatorClient(server.url, TRAINER_TOKEN, retries=0)
    worker = CoordinatorClient(server.url, WORKER_TOKEN, retries=0)
    anon = CoordinatorClient(server.url, retries=0)
    ids = [f"worker-{i:03d}" for i in range(120)]
    early, late = ids[:110], ids[110:]
    for wid in early:
        register(worker, wid)
    state0, state1 = weights(0), weights(1)
    with publisher(tmp_path, trainer) as pub:
        assert pub.publish(state0) == 0
        assert pub.publish(state1) == 1
        pool = anon.challenge_pool(1)
        # sized for the fleet at publish time: 110 + 8 + ceil(110 / 4)
        assert (pool.pool_size, pool.wanted, pool.workers_unchallenged) == (146, 0, 110)

        # 10 workers still serve v0's weights under v1's number: wrong answers, then right
        for wid in early[:10]:
            ch = heartbeat(worker, wid, 1)
            assert ch is not None
            assert not worker.prove(wid, ch.nonce, answer(served(state0), ch)).verified
        for wid in early:
            ch = heartbeat(worker, wid, 1)
            assert ch is not None, wid
            assert worker.prove(wid, ch.nonce, answer(served(state1), ch)).verified
        # 10 workers join after the pool was drawn down by the retries: what is left covers
        # them (the spare), and the trainer's top-up restores the spare
        for wid in late:
            register(worker, wid)
            ch = heartbeat(worker, wid, 1)
            assert ch is not None, wid
            assert worker.prove(wid, ch.nonce, answer(served(state1), ch)).verified
        pool = anon.challenge_pool(1)
        assert pool.pool_size == 146 - 130 and pool.wanted == 8 + 30 - 16
        assert pub.top_up() == 22
        assert anon.challenge_pool(1).wanted == 0
    infos = anon.workers()
    assert len(infos) == 120 and all(w.weights_verified for w in infos)
    assert sum(w.proof_failures for w in infos) == 10
    status = anon.status()
    assert status.workers_waiting_for_challenge == 0
    assert status.challenges is not None and status.challenges.workers_challenged == 120
    metrics = httpx.get(server.url + "/metrics").text
    assert "deltarl_coordinator_workers_waiting_for_challenge 0.0" in metrics
    assert "deltarl_coordinator_weight_challenges_left 38.0" in metrics


def test_a_starved_worker_is_shown_and_fed_by_a_top_up(
    serve: Callable[..., LiveServer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the pool is used up (more workers joined than the spare covers), the waiting
    workers show on /v1/status, /metrics and the version's pool; the trainer's next top-up
    serves them."""
    monkeypatch.setattr(service_module, "PROOF_POOL_MARGIN", 0)
    clock = Clock()
    server = serve(clock=clock, lost_after_s=1000.0)
    trainer = CoordinatorClient(server.url, TRAINER_TOKEN, retries=0)
    worker = CoordinatorClient(server.url, WORKER_TOKEN, retries=0)
    anon = CoordinatorClient(server.url, retries=0)
    register(worker, "first")
    state = weights(0)
    with publisher(tmp_path, trainer) as pub:
        pub.publish(state)  # proof_challenges (8) >= 1 + 0 + 1: no second hand-over
        assert anon.challenge_pool(0).pool_size == 8
        ids = [f"joined-{i}" for i in range(10)]
        for wid in ids:
            register(worker, wid)
        got = {wid: heartbeat(worker, wid, 0) for wid in ids}
        starved = [wid for wid, ch in got.items() if ch is None]
        assert len(starved) == 2
        pool = anon.challenge_pool(0)
        assert (pool.pool_size, pool.workers_waiting) == (0, 2)
        assert anon.status().workers_waiting_for_challenge == 2
        metrics = httpx.get(server.url + "/metrics").text
        assert "deltarl_coordinator_workers_waiting_for_challenge 2.0" in metrics
        assert pool.wanted == 3 + 0 + 3  # "first" and the 2 starved, plus a quarter of 11
        assert pub.top_up() == 6
    for wid in starved:
        ch = heartbeat(worker, wid, 0)
        assert ch is not None and worker.prove(wid, ch.nonce, answer(served(state), ch)).verified
    assert anon.status().workers_waiting_for_challenge == 0
