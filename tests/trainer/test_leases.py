"""Lease extension: a step slower than the lease keeps its groups (real coordinator over HTTP)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from coordinator.conftest import TRAINER_TOKEN, WORKER_TOKEN, LiveServer, coordinator_settings
from test_step import Bigram, rollout

from deltarl.buckets.local import LocalBucket
from deltarl.services.coordinator.client import CoordinatorClient
from deltarl.services.coordinator.schemas import LeasedBatch, WorkerRegistration
from deltarl.trainer.leases import LeaseKeeper
from deltarl.trainer.loop import train
from deltarl.trainer.metrics import MetricsLog, read_metrics
from deltarl.trainer.publish.weights import WeightPublisher
from deltarl.trainer.settings import ExperimentSettings


class SlowBigram(Bigram):
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        time.sleep(0.6)
        return super().forward(input_ids, attention_mask)


class Source:
    """The coordinator client, plus a worker that submits groups once version 0 exists."""

    def __init__(self, trainer: CoordinatorClient, worker: CoordinatorClient, n: int) -> None:
        self.trainer, self.worker, self.n = trainer, worker, n
        self.submitted = False
        self.extend = trainer.extend
        self.ack = trainer.ack
        self.nack = trainer.nack

    def lease(self, max_groups: int, lease_s: float | None = None, wait_s: float = 0.0) -> Any:
        if not self.submitted:
            self.submitted = True
            self.worker.register(
                WorkerRegistration(worker_id="w1", engine="hf", model="bigram", capacity=1)
            )
            for g in rollout(Bigram(), torch.Generator().manual_seed(0), self.n, 4, 0):
                self.worker.submit(g)
        batch: LeasedBatch = self.trainer.lease(max_groups, lease_s, wait_s)
        return batch


@pytest.mark.network
def test_a_step_longer_than_the_lease_keeps_its_groups(tmp_path: Path) -> None:
    server = LiveServer(coordinator_settings(tmp_path))
    try:
        trainer = CoordinatorClient(server.url, TRAINER_TOKEN, retries=0)
        worker = CoordinatorClient(server.url, WORKER_TOKEN, retries=0)
        settings = ExperimentSettings.load(
            None,
            [
                "max_steps=2",
                "batch.groups_per_step=2",
                "batch.micro_batch_size=4",  # 2 micro-batches of 0.6 s: a step > the lease
                "batch.lease_s=0.6",
                "publish.background=false",
                f"run_dir={tmp_path / 'run'}",
            ],
        )
        bucket = LocalBucket(tmp_path / "bucket")
        source = Source(trainer, worker, n=4)
        with WeightPublisher(bucket, settings.publish, register=trainer.publish_version) as pub:
            train(SlowBigram(), settings, source, pub, sink=MetricsLog(settings.run_dir))
        rows = read_metrics(settings.run_dir)
        assert [r["batch/ack_failures"] for r in rows] == [0, 0]
        assert float(rows[-1]["lease/extensions"] or 0) >= 2
        queue = trainer.status().queue
        assert (queue.depth, queue.leased, queue.acked_total) == (0, 0, 4)
    finally:
        server.stop()


class Refusing:
    def __init__(self, status_code: int) -> None:
        self.status_code = status_code
        self.calls: list[str] = []

    def extend(self, batch_id: str, lease_s: float) -> None:
        self.calls.append(batch_id)
        err = RuntimeError(f"HTTP {self.status_code}")
        err.status_code = self.status_code  # type: ignore[attr-defined]
        raise err


def test_keeper_drops_a_lease_that_is_gone_and_retries_others() -> None:
    gone, flaky = Refusing(409), Refusing(503)
    with LeaseKeeper(gone, 1.0, every_s=0.02) as k1, LeaseKeeper(flaky, 1.0, every_s=0.02) as k2:
        k1.hold("a")
        k2.hold("b")
        time.sleep(0.3)
        assert k1.held == [] and gone.calls == ["a"]  # refused for good: not asked again
        assert k2.held == ["b"] and len(flaky.calls) >= 2
        k2.release("b")
        assert k2.held == []
