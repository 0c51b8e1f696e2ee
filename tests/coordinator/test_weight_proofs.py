"""Weight proofs through the API: only a fresh, correct answer to a
challenge the trainer prepared sets ``weights_verified``; a copied digest, a guess, a replayed
or late answer, or a proof at another version does not."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
import torch

from deltarl.services.coordinator.client import CoordinatorClient, CoordinatorError
from deltarl.services.coordinator.schemas import (
    ChallengePair,
    ChallengePool,
    WeightChallenge,
    WorkerHeartbeat,
    WorkerRegistration,
)
from deltarl.weightsync.proof import ProofSpec, make_challenges, proof_answer

from .conftest import TRAINER_TOKEN, WORKER_TOKEN, LiveServer
from .helpers import manifest

SPEC = ProofSpec(chunk_bytes=64, chunks=16)


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
        "layer.0.w": torch.randn(16, 16, generator=g).to(torch.bfloat16),
        "norm.weight": torch.randn(16, generator=g).to(torch.bfloat16),
    }


def clients(s: LiveServer) -> tuple[CoordinatorClient, CoordinatorClient, CoordinatorClient]:
    return (
        CoordinatorClient(s.url, TRAINER_TOKEN, retries=0),
        CoordinatorClient(s.url, WORKER_TOKEN, retries=0),
        CoordinatorClient(s.url, retries=0),
    )


def upload(trainer: CoordinatorClient, version: int, state: dict[str, torch.Tensor], n: int):
    pairs = make_challenges(state, version, SPEC, n)
    pool = ChallengePool(
        chunk_bytes=SPEC.chunk_bytes,
        chunks=SPEC.chunks,
        items=[ChallengePair(nonce=a, answer=b) for a, b in pairs],
    )
    return trainer.add_challenges(version, pool), pairs


def answer(state: dict[str, torch.Tensor], ch: WeightChallenge) -> str:
    spec = ProofSpec(ch.chunk_bytes, ch.chunks)
    return proof_answer(state, bytes.fromhex(ch.nonce), ch.version, spec)


def heartbeat(worker: CoordinatorClient, version: int, worker_id: str = "w1"):
    return worker.heartbeat(worker_id, WorkerHeartbeat(applied_version=version))


def test_only_a_holder_of_the_weights_is_verified(make_server: Callable[..., LiveServer]) -> None:
    clock = Clock()
    server = make_server(clock=clock, proof_ttl_s=30.0)
    trainer, worker, anon = clients(server)
    trainer.publish_version(manifest(0))
    trainer.publish_version(manifest(1))
    worker.register(WorkerRegistration(worker_id="w1", engine="hf", model="m", capacity=1))
    real = weights(1)
    result, pairs = upload(trainer, 1, real, 3)
    assert (result.added, result.pool_size) == (3, 3)
    assert (
        trainer.add_challenges(
            1,
            ChallengePool(
                chunk_bytes=64,
                chunks=16,
                items=[ChallengePair(nonce=pairs[0][0], answer=pairs[0][1])],
            ),
        ).added
        == 0
    )  # a nonce already in the pool is not added twice

    # a liar copies the public digest and guesses: refused, and the challenge is used up
    hb = worker.heartbeat(
        "w1",
        WorkerHeartbeat(applied_version=1, weights_digest=anon.get_version(1).state_digest),
    )
    ch = hb.challenge
    assert ch is not None and ch.version == 1 and hb.worker.weights_verified is None
    assert heartbeat(worker, 1).challenge == ch  # re-sent until answered
    assert not worker.prove("w1", ch.nonce, "0" * 64).verified
    info = anon.worker("w1")
    assert info.weights_verified is False and info.proof_failures == 1
    with pytest.raises(CoordinatorError) as e:  # used once, right or wrong
        worker.prove("w1", ch.nonce, answer(real, ch))
    assert e.value.status_code == 409 and e.value.code == "unknown_challenge"

    # weights of another version (or anything but the trainer's) give a wrong answer
    ch = heartbeat(worker, 1).challenge
    assert ch is not None and ch.nonce not in {pairs[0][0]}
    assert not worker.prove("w1", ch.nonce, answer(weights(0), ch)).verified

    # the holder of the real weights answers right: verified at that version
    ch = heartbeat(worker, 1).challenge
    assert ch is not None
    res = worker.prove("w1", ch.nonce, answer(real, ch))
    assert res.verified and res.version == 1
    info = anon.worker("w1")
    assert info.weights_verified is True and info.weights_proven_version == 1
    assert info.proof_failures == 2 and info.weights_proven_at == clock.t
    hb = heartbeat(worker, 1)
    assert hb.challenge is None and hb.worker.weights_verified is True  # proven: no new one

    # the pool of v1 is empty now; a proof says nothing about the next version
    trainer.publish_version(manifest(2))
    hb = heartbeat(worker, 2)
    assert hb.worker.weights_verified is None and hb.challenge is None  # no pool for v2 yet
    upload(trainer, 2, weights(2), 1)
    ch = heartbeat(worker, 2).challenge
    assert ch is not None and ch.version == 2
    assert worker.prove("w1", ch.nonce, answer(weights(2), ch)).verified
    assert anon.worker("w1").weights_verified is True

    # a restart forgets every proof
    worker.register(WorkerRegistration(worker_id="w1", engine="hf", model="m", capacity=1))
    hb = heartbeat(worker, 2)
    assert hb.worker.weights_verified is None and hb.worker.proof_failures == 0

    # no read route ever shows an answer
    texts = [
        httpx.get(server.url + path).text
        for path in ("/v1/status", "/v1/workers", "/v1/versions/1", "/v1/versions", "/metrics")
    ]
    assert not any(a in t for _, a in pairs for t in texts)


def test_late_answers_and_foreign_challenges_are_refused(
    make_server: Callable[..., LiveServer],
) -> None:
    clock = Clock()
    server = make_server(clock=clock, proof_ttl_s=10.0)
    trainer, worker, anon = clients(server)
    trainer.publish_version(manifest(0))
    for wid in ("w1", "w2"):
        worker.register(WorkerRegistration(worker_id=wid, engine="hf", model="m", capacity=1))
    real = weights(0)
    upload(trainer, 0, real, 4)
    ch1 = heartbeat(worker, 0, "w1").challenge
    ch2 = heartbeat(worker, 0, "w2").challenge
    assert ch1 is not None and ch2 is not None and ch1.nonce != ch2.nonce  # never issued twice
    # w2 cannot answer w1's challenge
    with pytest.raises(CoordinatorError) as e:
        worker.prove("w2", ch1.nonce, answer(real, ch1))
    assert e.value.code == "unknown_challenge"
    # too late: refused even though right
    clock.t += 11.0
    res = worker.prove("w1", ch1.nonce, answer(real, ch1))
    assert not res.verified and anon.worker("w1").weights_verified is False
    # an expired outstanding challenge is replaced by a fresh one at the next heartbeat
    clock.t += 11.0
    fresh = heartbeat(worker, 0, "w2").challenge
    assert fresh is not None and fresh.nonce != ch2.nonce
    assert worker.prove("w2", fresh.nonce, answer(real, fresh)).verified
    # unknown workers and unknown versions
    with pytest.raises(CoordinatorError) as e:
        worker.prove("nobody", fresh.nonce, "a" * 64)
    assert e.value.status_code == 404
    with pytest.raises(CoordinatorError) as e:
        upload(trainer, 7, real, 1)
    assert e.value.status_code == 404 and e.value.code == "unknown_version"


def test_roles_and_bad_bodies(server: LiveServer) -> None:
    trainer, worker, anon = clients(server)
    trainer.publish_version(manifest(0))
    worker.register(WorkerRegistration(worker_id="w1", engine="hf", model="m", capacity=1))
    pool = {"chunk_bytes": 64, "chunks": 16, "items": [{"nonce": "a" * 64, "answer": "b" * 64}]}
    for client, status in ((worker, 403), (anon, 401)):
        r = client._http.post("/v1/versions/0/challenges", json=pool)
        assert r.status_code == status
    r = trainer._http.post("/v1/workers/w1/proof", json={"nonce": "a" * 64, "answer": "b" * 64})
    assert r.status_code == 403
    for bad in (
        {**pool, "items": []},
        {**pool, "chunks": -1},
        {**pool, "chunk_bytes": 0},
        {**pool, "items": [{"nonce": "A" * 64, "answer": "b" * 64}]},
        {**pool, "items": [{"nonce": "a" * 63, "answer": "b" * 64}]},
        {**pool, "items": [{"nonce": "a" * 64, "answer": "b" * 64, "x": 1}]},
    ):
        r = trainer._http.post("/v1/versions/0/challenges", json=bad)
        assert r.status_code == 422, bad
    r = worker._http.post("/v1/workers/w1/proof", json={"nonce": "zz", "answer": "b" * 64})
    assert r.status_code == 422
