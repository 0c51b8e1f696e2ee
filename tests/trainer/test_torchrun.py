"""``deltarl train`` under ``torchrun --nproc_per_node 2`` (CPU, gloo) against a real coordinator:
rank 0 alone publishes, reports and acks; the run ends cleanly on every rank."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from coordinator.conftest import (
    TRAINER_TOKEN,
    WORKER_TOKEN,
    LiveServer,
    coordinator_settings,
    free_port,
)
from test_step import tiny_llama_config

from deltarl.services.buckets.local import LocalBucket
from deltarl.services.coordinator.client import CoordinatorClient
from deltarl.services.coordinator.schemas import Trajectory, TrajectoryGroup, WorkerRegistration
from deltarl.services.weightsync.reader import BucketReader
from deltarl.trainer.metrics import read_metrics

VOCAB = 16


def tiny_llama(path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tiny_llama_config(VOCAB)).save_pretrained(path)


def feed(worker: CoordinatorClient, groups: int, stop: threading.Event) -> None:
    """A worker: once version 0 exists, submit ``groups`` groups of 2 (scripted tokens)."""
    worker.register(WorkerRegistration(worker_id="w1", engine="hf", model="tiny", capacity=1))
    while worker.latest_version() is None and not stop.is_set():
        time.sleep(0.1)
    for g in range(groups):
        trajs = [
            Trajectory(
                tokens=[1, 2, 3 + i, 4 + g % 8],
                logprobs=[0.0, 0.0, -2.5, -2.5],
                mask=[0, 0, 1, 1],
                prompt_len=2,
                reward=float(i),
                version_min=0,
                version_max=0,
            )
            for i in range(2)
        ]
        worker.submit(
            TrajectoryGroup(
                idempotency_key=f"k{g}", worker_id="w1", group_id=f"g{g}", trajectories=trajs
            )
        )


@pytest.mark.slow
@pytest.mark.network
def test_deltarl_train_under_torchrun(tmp_path: Path) -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this Python")
    tiny_llama(tmp_path / "model")
    server = LiveServer(coordinator_settings(tmp_path))
    stop = threading.Event()
    worker = CoordinatorClient(server.url, WORKER_TOKEN, retries=0)
    feeder = threading.Thread(target=feed, args=(worker, 4, stop), daemon=True)
    feeder.start()
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "DELTARL_TRAINER_COORDINATOR_URL": server.url,
        "DELTARL_TRAINER_TOKEN": TRAINER_TOKEN,
        "DELTARL_TRAINER_DEVICE": "cpu",
        "DELTARL_TRAINER_DATA_TIMEOUT_S": "60",
        "DELTARL_TRAINER_DIST_TIMEOUT_S": "120",
        "DELTARL_BUCKET_URI": str(tmp_path / "bucket"),
        "OMP_NUM_THREADS": "1",
    }
    args = [
        f"model={tmp_path / 'model'}",
        f"run_dir={run_dir}",
        "max_steps=2",
        "precision=fp32",
        "batch.groups_per_step=2",
        "batch.group_size=2",
        "batch.micro_batch_size=2",
        "sampling.max_onpolicy_mismatch_kl=null",  # scripted logprobs
        "report.console=plain",
    ]
    cmd = [
        torchrun,
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "-m",
        "deltarl",
        "train",
        *[a for arg in args for a in ("--set", arg)],
    ]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        trainer = CoordinatorClient(server.url, TRAINER_TOKEN, retries=0)
        assert [v.version for v in trainer.versions()] == [0, 1, 2]
        queue = trainer.status().queue
        assert (queue.acked_total, queue.depth, queue.leased) == (4, 0, 0)
    finally:
        stop.set()
        server.stop()
    assert BucketReader(LocalBucket(tmp_path / "bucket")).latest_version() == 2
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]  # one writer: rank 0
    assert rows[-1]["batch/trajectories"] == 4  # metrics of the whole batch, both shares
    assert json.loads((run_dir / "settings.json").read_text())["max_steps"] == 2
    assert "rank 1 of 2" in proc.stderr and "rank 0 stopped" in proc.stderr
