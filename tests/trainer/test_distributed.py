"""Data-parallel training on CPU (gloo): 2 ranks publish exactly what 1 rank publishes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from test_loop import FakeQueue
from test_step import Bigram
from test_weight_publisher import FakeCoordinator, assert_bit_identical, rebuild

from deltarl.services.buckets.local import LocalBucket
from deltarl.services.weightsync.reader import BucketReader
from deltarl.trainer.batch import collate
from deltarl.trainer.distributed import (
    DistContext,
    init_distributed,
    shard_rows,
    shutdown_distributed,
)
from deltarl.trainer.loop import train
from deltarl.trainer.replica import train_replica
from deltarl.trainer.settings import ExperimentSettings
from deltarl.trainer.weights import WeightPublisher

STEPS = 3


def make_settings(run_dir: Path) -> ExperimentSettings:
    # 2 groups of 8 = 16 rows: 1 rank runs 2 micro-batches of 8, each of 2 ranks runs 1
    return ExperimentSettings.load(
        None,
        [
            f"max_steps={STEPS}",
            "optimizer.lr=0.2",
            "batch.groups_per_step=2",
            "batch.micro_batch_size=8",
            "publish.background=false",
            f"run_dir={run_dir}",
        ],
    )


def run_rank0(model: Bigram, root: Path, dist: DistContext | None) -> tuple[int, int]:
    """Rank 0 (or the single process): the queue, the bucket, the coordinator."""
    settings = make_settings(root / "run")
    bucket = LocalBucket(root / "bucket")
    coordinator = FakeCoordinator()
    with WeightPublisher(bucket, settings.publish, register=coordinator) as pub:
        last = train(model, settings, FakeQueue(bucket), pub, poll_s=0.0, dist=dist)
    return last, len(coordinator.manifests)


def rank_main(rank: int, root: str) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"})
    torch.set_num_threads(1)
    # a file rendezvous: no port to race for with other processes on this machine
    ctx, device = init_distributed("cpu", timeout_s=120, init_method=f"file://{root}/rendezvous")
    assert device == "cpu" and ctx.world_size == 2
    torch.manual_seed(0)
    model = Bigram()
    out = Path(root) / f"rank{rank}"
    out.mkdir()
    if ctx.is_main:
        last, registered = run_rank0(model, out, ctx)
    else:
        last, registered = train_replica(model, make_settings(out / "run"), ctx), 0
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, out / "final.pt")
    (out / "result.json").write_text(json.dumps({"last": last, "registered": registered}))
    shutdown_distributed(ctx)


@pytest.mark.slow
def test_two_ranks_publish_bit_identical_weights_to_one(tmp_path: Path, one_thread: None) -> None:
    torch.manual_seed(0)
    single = Bigram()
    last, registered = run_rank0(single, tmp_path / "single", None)
    assert last == STEPS and registered == STEPS + 1

    mp.spawn(rank_main, args=(str(tmp_path),), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}" / "result.json").read_text()) for r in (0, 1)]
    assert results == [{"last": STEPS, "registered": STEPS + 1}, {"last": STEPS, "registered": 0}]
    # only rank 0 published: rank 1 has no bucket at all
    assert not (tmp_path / "rank1" / "bucket").exists()
    one, two = (
        BucketReader(LocalBucket(p / "bucket")) for p in (tmp_path / "single", tmp_path / "rank0")
    )
    assert one.latest_version() == two.latest_version() == STEPS
    for v in range(STEPS + 1):  # every version, not only the last, is the same state
        assert one.manifest(v).state_digest == two.manifest(v).state_digest, v
    assert_bit_identical(
        rebuild(LocalBucket(tmp_path / "rank0" / "bucket"))[0],
        rebuild(LocalBucket(tmp_path / "single" / "bucket"))[0],
    )
    # the fp32 master weights (and so the next steps) agree too, on both ranks
    for r in (0, 1):
        final = torch.load(tmp_path / f"rank{r}" / "final.pt")
        assert torch.equal(final["table.weight"], single.table.weight.detach())


def test_rows_are_shared_out_and_rank_roles_are_enforced(tmp_path: Path) -> None:
    from test_step import rollout

    batch = collate(rollout(Bigram(), torch.Generator().manual_seed(0), 3, 3, 0))  # 9 rows
    shards = [shard_rows(batch, DistContext(r, 2)) for r in (0, 1)]
    assert [len(s) for s in shards] == [4, 5]
    assert torch.equal(torch.cat([s.rewards for s in shards]), batch.rewards)
    with pytest.raises(ValueError, match="cannot feed 16 ranks"):
        shard_rows(batch, DistContext(0, 16))
    settings = make_settings(tmp_path)
    with pytest.raises(ValueError, match="only rank 0 runs train"):
        queue = FakeQueue(LocalBucket(tmp_path))
        train(Bigram(), settings, queue, None, dist=DistContext(1, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ranks 1\.\.N-1"):
        train_replica(Bigram(), settings, DistContext(0, 2))
