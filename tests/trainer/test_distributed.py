"""Data-parallel training on CPU (gloo): 2 ranks publish exactly what 1 rank publishes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from ranks import spawn_ranks
from test_loop import FakeQueue
from test_step import Bigram, steps_of, varied_groups
from test_weight_publisher import FakeCoordinator, assert_bit_identical, rebuild

from deltarl.buckets.local import LocalBucket
from deltarl.trainer.learn.batch import TrainBatch, collate
from deltarl.trainer.learn.distributed import (
    DistContext,
    MicroBatch,
    init_distributed,
    rank_micro_batches,
    shard_fsdp,
    shard_rows,
    shutdown_distributed,
    wrap_ddp,
)
from deltarl.trainer.learn.optim import build_optimizer
from deltarl.trainer.learn.step import train_step
from deltarl.trainer.loop import train
from deltarl.trainer.publish.weights import WeightPublisher
from deltarl.trainer.replica import train_replica
from deltarl.trainer.settings import ExperimentSettings
from deltarl.weightsync.reader import BucketReader

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

    spawn_ranks(rank_main, tmp_path, 2)
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


def passes(batch: TrainBatch, size: int, max_tokens: int | None = None) -> list[list[MicroBatch]]:
    return [rank_micro_batches(batch, DistContext(r, 2), size, max_tokens) for r in (0, 1)]


def real_rows(parts: list[list[MicroBatch]]) -> torch.Tensor:
    return torch.cat([p.batch.rewards for rank in parts for p in rank if not p.filler])


def test_every_rank_runs_as_many_micro_batches() -> None:
    batch = collate(varied_groups([[3] * 17]))  # shares of 8 and 9 rows
    parts = passes(batch, 8)
    assert [[len(p.batch) for p in rank] for rank in parts] == [[4, 4], [8, 1]]
    assert torch.equal(real_rows(parts), batch.rewards)  # every row once, in order
    # a token budget: rank 1's long rows go one by one, rank 0's 4 short rows are split as far
    # as they go (into single rows) and a filler makes up the fifth pass
    batch = collate(varied_groups([[2, 3, 2, 2, 9, 8, 9, 9, 7]]))
    parts = passes(batch, 8, max_tokens=12)
    assert [[len(p.batch) for p in rank] for rank in parts] == [[1] * 5, [1] * 5]
    assert [[p.filler for p in rank] for rank in parts] == [[False] * 4 + [True], [False] * 5]
    assert parts[0][-1].batch.num_tokens == 0
    assert torch.equal(real_rows(parts), batch.rewards)
    # one process: the greedy micro-batches as they are
    one = rank_micro_batches(batch, DistContext(), 8, 12)
    assert [len(p.batch) for p in one] == [4, 1, 1, 1, 1, 1] and not any(p.filler for p in one)


BUDGET_ARGS = ["batch.micro_batch_size=8", "batch.micro_batch_tokens=16"]


def budget_batches() -> list[TrainBatch]:
    """Shares of 4 short and 5 long rows (5 passes each: 4 split + a filler on rank 0), then
    of 8 and 9 rows of one length (rank 0's one micro-batch split in two)."""
    return [
        collate(varied_groups([[3, 2, 3, 3, 9, 8, 9, 9, 7]], seed=0)),
        collate(varied_groups([[2] * 17], seed=1)),
    ]


def budget_rank(rank: int, root: str) -> None:
    """DDP and FSDP2 train the same two steps; rank 0 saves both models and metrics."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"})
    torch.set_num_threads(1)
    ctx, device = init_distributed("cpu", timeout_s=60, init_method=f"file://{root}/rendezvous")
    base = ["precision=fp32", "optimizer.lr=0.2", "sampling.max_onpolicy_mismatch_kl=null"]
    settings = ExperimentSettings.load(None, [*base, *BUDGET_ARGS])
    out: dict[str, object] = {}
    for name in ("ddp", "fsdp"):
        model = Bigram()
        torch.nn.init.normal_(model.table.weight, generator=torch.Generator().manual_seed(0))
        wrapped = wrap_ddp(model, ctx) if name == "ddp" else shard_fsdp(model, ctx, device)
        opt, sched = build_optimizer(model.parameters(), settings.optimizer, 10)
        metrics = [train_step(wrapped, opt, sched, b, settings, dist=ctx) for b in budget_batches()]
        weight = model.table.weight.detach()
        full = weight.full_tensor() if name == "fsdp" else weight  # type: ignore[attr-defined]
        out[name] = (full.clone(), metrics)
    if ctx.is_main:
        torch.save(out, Path(root) / "result.pt")
    shutdown_distributed(ctx)


@pytest.mark.slow
def test_uneven_shards_and_a_token_budget_train_like_one_process(
    tmp_path: Path, one_thread: None
) -> None:
    weights, metrics = steps_of(budget_batches(), BUDGET_ARGS)
    spawn_ranks(budget_rank, tmp_path, 2)
    result = torch.load(tmp_path / "result.pt")
    for name in ("ddp", "fsdp"):
        got, got_metrics = result[name]
        torch.testing.assert_close(got, weights, rtol=1e-6, atol=1e-7)
        for m, g in zip(metrics, got_metrics, strict=True):
            g = {k: v for k, v in g.items() if not k.startswith(("time/", "step/tok"))}
            assert g == pytest.approx(m, rel=1e-5, abs=1e-7), name
