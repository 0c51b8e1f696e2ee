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

from deltarl.buckets.local import LocalBucket
from deltarl.services.coordinator.client import CoordinatorClient
from deltarl.services.coordinator.schemas import Trajectory, TrajectoryGroup, WorkerRegistration
from deltarl.trainer.metrics import read_metrics
from deltarl.weightsync.reader import BucketReader

VOCAB = 16


def tiny_llama(path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tiny_llama_config(VOCAB)).save_pretrained(path)


def fed_coordinator(tmp_path: Path, groups: int) -> tuple[LiveServer, threading.Event]:
    """A live coordinator, and a worker thread feeding it ``groups`` scripted groups once
    version 0 exists (:func:`feed`); set the event and stop the server when done."""
    server = LiveServer(coordinator_settings(tmp_path))
    stop = threading.Event()
    worker = CoordinatorClient(server.url, WORKER_TOKEN, retries=0)
    threading.Thread(target=feed, args=(worker, groups, stop), daemon=True).start()
    return server, stop


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


def follow(bucket: LocalBucket, model_dir: Path, version: int) -> None:
    """A worker follows the bucket to ``version`` (verified bit-exactly against the trainer's
    digests by WeightSync itself)."""
    transformers = pytest.importorskip("transformers")
    from deltarl.rollout.sync.weights import WeightSync

    class Engine:
        device = torch.device("cpu")

        def __init__(self) -> None:
            model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
            self.tensors = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}

        def named_parameters(self) -> dict[str, torch.Tensor]:
            return self.tensors

    sync = WeightSync(Engine(), BucketReader(bucket))  # type: ignore[arg-type]
    assert sync.sync_to(version).version == version


def trainer_env(url: str, bucket: Path) -> dict[str, str]:
    """The environment of a CPU ``deltarl train`` against the coordinator at ``url``."""
    return {
        **os.environ,
        "DELTARL_TRAINER_COORDINATOR_URL": url,
        "DELTARL_TRAINER_TOKEN": TRAINER_TOKEN,
        "DELTARL_TRAINER_DEVICE": "cpu",
        "DELTARL_TRAINER_DATA_TIMEOUT_S": "60",
        "DELTARL_TRAINER_DIST_TIMEOUT_S": "120",
        "DELTARL_BUCKET_URI": str(bucket),
        "OMP_NUM_THREADS": "1",
    }


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_deltarl_train_under_torchrun(tmp_path: Path, parallel: str) -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    launcher = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    tiny_llama(tmp_path / "model")
    groups = 6 if parallel == "fsdp" else 4  # fsdp: 2 more for a resumed third step
    server, stop = fed_coordinator(tmp_path, groups)
    run_dir = tmp_path / "run"
    env = trainer_env(server.url, tmp_path / "bucket")
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
        f"parallel={parallel}",
        "checkpoint.every=1",
    ]
    if parallel == "fsdp":  # the KL reference policy, sharded like the policy on every rank
        args.append("loss.kl_coef=0.05")
    cmd = [
        *launcher,
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
        assert (queue.acked_total, queue.depth, queue.leased) == (4, groups - 4, 0)
        if parallel == "fsdp":  # --resume from the sharded checkpoint of step 2, one more step
            resume = [*cmd, "--set", "max_steps=3", "--resume"]
            resume[resume.index("--master_port") + 1] = str(free_port())
            again = subprocess.run(resume, env=env, capture_output=True, text=True, timeout=240)
            assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-5000:]
            # v3: the resumed weights (an anchor), v4: step 3
            assert [v.version for v in trainer.versions()] == [0, 1, 2, 3, 4]
            assert "restored step 2" in again.stderr
    finally:
        stop.set()
        server.stop()
    latest = 2 if parallel == "ddp" else 4
    assert BucketReader(LocalBucket(tmp_path / "bucket")).latest_version() == latest
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows][:2] == [1, 2]  # one writer: rank 0
    assert rows[-1]["batch/trajectories"] == 4  # metrics of the whole batch, both shares
    assert ("kl_ref" in rows[-1]) == (parallel == "fsdp")
    max_steps = 2 if parallel == "ddp" else 3  # the resumed run wrote its own settings
    assert json.loads((run_dir / "settings.json").read_text())["max_steps"] == max_steps
    assert "rank 1 of 2" in proc.stderr and "rank 0 stopped" in proc.stderr
    follow(LocalBucket(tmp_path / "bucket"), tmp_path / "model", latest)
    if parallel == "fsdp":  # every rank's shards in the run's checkpoint directory
        files = {p.name for p in (run_dir / "checkpoints" / "step_000002").iterdir()}
        assert {"model.rank00000.safetensors", "model.rank00001.safetensors"} <= files
        layout = BucketReader(LocalBucket(tmp_path / "bucket")).manifest(2).layout
        assert layout is not None and "lm_head.weight[0:8]" in layout
