"""``loss.kl_coef > 0``: the trainer trains against a frozen reference policy (the starting
model), which ``deltarl train`` builds itself; a run that cannot have one stops before it
publishes anything."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from coordinator.conftest import (
    TRAINER_TOKEN,
)
from ranks import spawn_ranks
from test_fsdp import ShardedQueue, join
from test_loop import FakeQueue
from test_step import Bigram
from test_torchrun import fed_coordinator, tiny_llama, trainer_env
from test_weight_publisher import FakeCoordinator
from torch.distributed.tensor import DTensor

from deltarl.buckets.local import LocalBucket
from deltarl.services.coordinator.client import CoordinatorClient
from deltarl.trainer.learn.distributed import DistContext, shard_fsdp, shutdown_distributed
from deltarl.trainer.learn.step import frozen_reference
from deltarl.trainer.loop import train
from deltarl.trainer.metrics import read_metrics
from deltarl.trainer.publish.sharded import ShardedPublisher
from deltarl.trainer.publish.weights import WeightPublisher
from deltarl.trainer.replica import train_replica
from deltarl.trainer.settings import ExperimentSettings
from deltarl.weightsync.reader import BucketReader

STEPS = 4


def kl_settings(run_dir: Path, kl_coef: float = 0.5, *extra: str) -> ExperimentSettings:
    # 2 groups of 8 = 16 rows: 1 process runs 2 micro-batches of 8, each of 2 ranks runs 1
    return ExperimentSettings.load(
        None,
        [
            f"max_steps={STEPS}",
            "optimizer.lr=0.2",
            "batch.groups_per_step=2",
            "batch.micro_batch_size=8",
            "publish.background=false",
            f"loss.kl_coef={kl_coef}",
            f"run_dir={run_dir}",
            *extra,
        ],
    )


def run_single(
    root: Path, kl_coef: float, ref: torch.nn.Module | None
) -> tuple[Bigram, list[dict[str, float]]]:
    """One process: a zero Bigram trained ``STEPS`` steps; returns it and each step's metrics."""
    torch.manual_seed(0)
    model = Bigram()
    settings = kl_settings(root / "run", kl_coef)
    bucket = LocalBucket(root / "bucket")
    rows: list[dict[str, float]] = []
    with WeightPublisher(bucket, settings.publish, register=FakeCoordinator()) as pub:
        last = train(
            model,
            settings,
            FakeQueue(bucket),
            pub,
            sink=lambda step, m: rows.append(m),
            ref_model=ref,
            poll_s=0.0,
        )
    assert last == STEPS and len(rows) == STEPS
    return model, rows


def test_a_missing_or_trainable_reference_is_refused_before_version_0(tmp_path: Path) -> None:
    settings = kl_settings(tmp_path / "run", 0.05)
    bucket = LocalBucket(tmp_path / "bucket")
    coordinator = FakeCoordinator()
    model = Bigram()
    for ref, why in ((None, "needs ref_model"), (model, "trainable parameters")):
        with (
            WeightPublisher(bucket, settings.publish, register=coordinator) as pub,
            pytest.raises(ValueError, match=why),
        ):
            train(model, settings, FakeQueue(bucket), pub, ref_model=ref, poll_s=0.0)
        # nothing published, nothing registered: workers never saw a run that cannot train
        assert BucketReader(bucket).latest_version() is None and not coordinator.manifests
        with pytest.raises(ValueError, match=why):  # a replica refuses before any collective
            train_replica(model, settings, DistContext(rank=1, world_size=2), ref_model=ref)
    # without KL no reference is needed
    ok = kl_settings(tmp_path / "run", 0.0).model_copy(update={"max_steps": 1})
    with WeightPublisher(bucket, ok.publish, register=coordinator) as pub:
        assert train(model, ok, FakeQueue(bucket), pub, poll_s=0.0) == 1


def test_kl_is_measured_and_trained_against_a_frozen_starting_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ref = frozen_reference(Bigram())  # the starting weights (zeros), as the policy's
    start = ref.table.weight.detach().clone()
    model, rows = run_single(tmp_path / "kl", 0.5, ref)
    kl = [m["kl_ref"] for m in rows]
    assert kl[0] == pytest.approx(0.0, abs=1e-7), kl  # the policy is the reference at step 1
    assert all(k > 1e-4 for k in kl[1:]), kl  # then moves away from it
    # the reference never moved, never got a gradient and stays in eval mode; the policy moved
    assert torch.equal(ref.table.weight, start) and ref.table.weight.grad is None
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    assert not torch.equal(model.table.weight.detach(), start)

    # the KL term pulls the policy towards the reference: without it (the same data at step 1,
    # as the gradient of k3 is 0 where the policies agree) the policy ends further away
    free, free_rows = run_single(tmp_path / "free", 0.0, None)
    assert "kl_ref" not in free_rows[0]
    assert free_rows[0]["loss"] == pytest.approx(rows[0]["loss"], abs=1e-7)
    dist_kl = float((model.table.weight.detach() - start).norm())
    dist_free = float((free.table.weight.detach() - start).norm())
    assert dist_kl < dist_free, (dist_kl, dist_free)


def fsdp_rank(rank: int, root: str) -> None:
    ctx, device = join(rank, root)
    torch.manual_seed(0)
    ref = shard_fsdp(frozen_reference(Bigram()), ctx, device)  # sharded like the policy
    torch.manual_seed(0)
    model = shard_fsdp(Bigram(), ctx, device)
    out = Path(root) / f"rank{rank}"
    out.mkdir()
    settings = kl_settings(out / "run", 0.5, "parallel=fsdp")
    bucket = LocalBucket(Path(root) / "bucket")
    rows: list[dict[str, float]] = []
    if ctx.is_main:
        pub = ShardedPublisher(bucket, settings.publish, ctx, register=FakeCoordinator())
        last = train(
            model,
            settings,
            ShardedQueue(bucket),
            pub,
            sink=lambda step, m: rows.append(m),
            ref_model=ref,
            poll_s=0.0,
            dist=ctx,
        )
    else:
        pub = ShardedPublisher(bucket, None, ctx)
        last = train_replica(model, settings, ctx, ref_model=ref, publisher=pub)
    # the reference's gathered weights were freed after each forward (no backward does it)
    assert isinstance(ref.table.weight, DTensor), type(ref.table.weight)
    final = {
        "model": model.table.weight.full_tensor().clone(),
        "ref": ref.table.weight.full_tensor().clone(),
        "ref_local": ref.table.weight.to_local().shape[0],
        "kl": [m["kl_ref"] for m in rows],
        "last": last,
    }
    torch.save(final, out / "final.pt")
    shutdown_distributed(ctx)


@pytest.mark.slow
def test_fsdp_shards_the_reference_and_trains_like_one_process(
    tmp_path: Path, one_thread: None
) -> None:
    torch.manual_seed(0)
    single, rows = run_single(tmp_path / "single", 0.5, frozen_reference(Bigram()))
    spawn_ranks(fsdp_rank, tmp_path, 2)
    for r in (0, 1):
        got = torch.load(tmp_path / f"rank{r}" / "final.pt")
        assert got["last"] == STEPS
        assert got["ref_local"] == 4  # each rank holds half of the reference's rows
        assert torch.equal(got["ref"], torch.zeros(8, 8))  # never trained
        # the same training as one process (one micro-batch per rank: the same single addition)
        torch.testing.assert_close(got["model"], single.table.weight.detach(), rtol=0, atol=0)
    kl = torch.load(tmp_path / "rank0" / "final.pt")["kl"]
    assert kl == [m["kl_ref"] for m in rows] and kl[0] == 0.0 and kl[-1] > 1e-4, kl


@pytest.mark.slow
@pytest.mark.network
def test_deltarl_train_builds_its_reference_and_keeps_it_on_resume(tmp_path: Path) -> None:
    """A real ``deltarl train`` with ``loss.kl_coef > 0`` against a live coordinator: it steps,
    logs ``kl_ref`` (0 at the first step), and after ``--resume`` the KL is still to the
    starting model (not ~0, as it would be to the resumed weights)."""
    tiny_llama(tmp_path / "model")
    server, stop = fed_coordinator(tmp_path, 3)
    run_dir = tmp_path / "run"
    env = trainer_env(server.url, tmp_path / "bucket")
    args = [
        f"model={tmp_path / 'model'}",
        f"run_dir={run_dir}",
        "max_steps=2",
        "optimizer.lr=0.01",
        "loss.kl_coef=0.05",
        "batch.groups_per_step=1",
        "batch.group_size=2",
        "sampling.max_onpolicy_mismatch_kl=null",  # scripted logprobs
        "report.console=plain",
        "checkpoint.every=1",
    ]
    deltarl = shutil.which("deltarl", path=str(Path(sys.executable).parent))
    cmd = [deltarl] if deltarl else [sys.executable, "-m", "deltarl"]
    cmd += ["train", *[a for arg in args for a in ("--set", arg)]]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        assert "reference policy for loss.kl_coef = 0.05" in proc.stderr
        again = subprocess.run(
            [*cmd, "--set", "max_steps=3", "--resume"],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-5000:]
        trainer = CoordinatorClient(server.url, TRAINER_TOKEN, retries=0)
        # v3: the resumed weights (an anchor), v4: step 3
        assert [v.version for v in trainer.versions()] == [0, 1, 2, 3, 4]
    finally:
        stop.set()
        server.stop()
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    kl = [float(r["kl_ref"] or 0) for r in rows]
    assert kl[0] == pytest.approx(0.0, abs=1e-7), kl
    assert kl[1] > 1e-6 and kl[2] > 1e-6, kl
    assert json.loads((run_dir / "settings.json").read_text())["loss"]["kl_coef"] == 0.05
