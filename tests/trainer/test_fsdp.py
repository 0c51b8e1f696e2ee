"""FSDP2 training on CPU (gloo, 2 ranks) with sharded publication: the same training as one
process, every rank publishing its rows, and a worker that follows the sharded versions
bit-exactly (from nothing, across several versions, after garbage collection)."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import torch
from ranks import spawn_ranks
from safetensors.torch import load_file, save_file
from test_distributed import make_settings, run_rank0
from test_loop import FakeQueue
from test_step import Bigram
from test_weight_publisher import FakeCoordinator

from deltarl.buckets.local import LocalBucket
from deltarl.rollout.sync.weights import WeightSync
from deltarl.trainer.checkpoint.sharded import ShardedCheckpointer
from deltarl.trainer.checkpoint.store import Checkpoint, Checkpointer, CheckpointError, read_meta
from deltarl.trainer.learn.distributed import (
    DistContext,
    init_distributed,
    shard_fsdp,
    shutdown_distributed,
)
from deltarl.trainer.loop import train
from deltarl.trainer.publish import weights as publish_weights
from deltarl.trainer.publish.sharded import ShardedPublisher
from deltarl.trainer.replica import train_replica
from deltarl.trainer.settings import ExperimentSettings
from deltarl.weightsync.digest import combine_digests, tensor_digest
from deltarl.weightsync.manifest import parse_slice_key
from deltarl.weightsync.proof import ProofSpec, proof_answer
from deltarl.weightsync.reader import BucketReader
from deltarl.weightsync.retention import RetentionPolicy, collect_garbage

STEPS = 3


class DictEngine:
    """The part of an engine WeightSync uses: named bf16 tensors on the CPU."""

    device = torch.device("cpu")

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self.tensors = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}

    def named_parameters(self) -> dict[str, torch.Tensor]:
        return self.tensors


def follower(bucket: LocalBucket, child: bool = False) -> tuple[DictEngine, WeightSync]:
    """``child``: decode in a child process against a shared host mirror (the GPU workers'
    arrangement)."""
    engine = DictEngine({"table.weight": (8, 8)})
    sync = WeightSync(engine, BucketReader(bucket), host_mirror=child, decode_process=child)  # type: ignore[arg-type]
    return engine, sync


class ShardedQueue(FakeQueue):
    """FakeQueue whose worker follows the bucket through WeightSync (sharded versions)."""

    def __init__(self, bucket: LocalBucket) -> None:
        super().__init__(bucket)
        self.engine, self.sync = follower(bucket)

    def catch_up(self) -> None:
        latest = self.reader.latest_version()
        if latest is None or latest == self.applied:
            return
        self.sync.sync_to(latest)
        self.applied = latest
        self.replica = {k: v.clone() for k, v in self.engine.tensors.items()}
        self.worker.load_state_dict({k: v.float() for k, v in self.replica.items()})


def fsdp_settings(run_dir: Path) -> ExperimentSettings:
    base = make_settings(run_dir)
    return base.model_copy(
        update={
            "parallel": "fsdp",
            "publish": base.publish.model_copy(update={"anchor_every": 2}),
            "checkpoint": base.checkpoint.model_copy(update={"every": 2}),
        }
    )


def join(rank: int, root: str, world: int = 2) -> tuple[DistContext, str]:
    """Rank ``rank`` of ``world`` on CPU (gloo, a file rendezvous: no port to race for)."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)})
    torch.set_num_threads(1)
    return init_distributed("cpu", timeout_s=120, init_method=f"file://{root}/rendezvous{world}")


def sharded_bigram(ctx: DistContext, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return shard_fsdp(Bigram(), ctx, device)


def rank_main(rank: int, root: str) -> None:
    ctx, device = join(rank, root)
    # 24-byte proof chunks: 6 of the 128-byte state, one across the ranks' rows
    publish_weights.PROOF_CHUNK_BYTES = 24
    model = sharded_bigram(ctx, device)
    out = Path(root) / f"rank{rank}"
    out.mkdir()
    settings = fsdp_settings(out / "run")
    bucket = LocalBucket(Path(root) / "bucket")  # one bucket: every rank uploads its parts
    ckpt = ShardedCheckpointer(Path(root) / "ckpt", ctx)  # one shared checkpoint directory
    if ctx.is_main:
        coordinator = FakeCoordinator()
        proofs: dict[int, list[tuple[str, str]]] = {}

        def challenges(version: int, spec: object, pairs: list[tuple[str, str]]) -> None:
            proofs[version] = pairs

        pub = ShardedPublisher(
            bucket, settings.publish, ctx, register=coordinator, challenges=challenges
        )
        queue = ShardedQueue(bucket)
        last = train(model, settings, queue, pub, poll_s=0.0, dist=ctx, checkpointer=ckpt)
        registered = len(coordinator.manifests)
        (out / "proofs.json").write_text(json.dumps(proofs))
    else:
        # rank 1 finds and scans its changes the device way (in place, one tensor at a time)
        # on its CPU rows, rank 0 the host way: the worker must follow both bit-exactly
        pub = ShardedPublisher(bucket, None, ctx, scan_on_device=True)
        last = train_replica(model, settings, ctx, publisher=pub, checkpointer=ckpt)
        registered = 0
    full = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}  # the test only
    if ctx.is_main:
        torch.save(full, out / "final.pt")
    (out / "result.json").write_text(json.dumps({"last": last, "registered": registered}))
    shutdown_distributed(ctx)


@pytest.mark.slow
def test_fsdp_trains_like_one_process_and_a_worker_follows_its_sharded_versions(
    tmp_path: Path, one_thread: None
) -> None:
    torch.manual_seed(0)
    single = Bigram()
    assert run_rank0(single, tmp_path / "single", None) == (STEPS, STEPS + 1)

    spawn_ranks(rank_main, tmp_path, 2)
    results = [json.loads((tmp_path / f"rank{r}" / "result.json").read_text()) for r in (0, 1)]
    assert results == [{"last": STEPS, "registered": STEPS + 1}, {"last": STEPS, "registered": 0}]
    # checkpoints at step 2 (every=2) and at the end, each rank's shards in one directory
    ckpts = ShardedCheckpointer(tmp_path / "ckpt", DistContext(0, 2))
    assert [s for s, _ in ckpts.committed()] == [2, 3]
    meta = ckpts.load().meta
    assert meta.world_size == 2 and meta.version == STEPS
    assert sorted(meta.files) == sorted(
        f"{k}.rank0000{r}.safetensors" for k in ("model", "optimizer", "rng") for r in (0, 1)
    )

    # training: the FSDP2 run ends where one process ends (gloo's reduce-scatter of two
    # micro-batch gradients is the same single addition)
    final = torch.load(tmp_path / "rank0" / "final.pt")
    torch.testing.assert_close(final["table.weight"], single.table.weight.detach(), rtol=0, atol=0)

    bucket = LocalBucket(tmp_path / "bucket")
    reader = BucketReader(bucket)
    assert reader.latest_version() == STEPS
    want = {k: v.to(torch.bfloat16) for k, v in final.items()}
    manifests = reader.manifests()
    for v, m in manifests.items():
        layout = m.layout
        assert layout == ("table.weight[0:4]", "table.weight[4:8]"), layout
        for o in m.objects:  # every object is split over both ranks
            assert o.parts is not None and len(o.parts) == 2
        assert m.has_anchor == (v % 2 == 0), v  # anchor_every=2
    # the state digest over the layout, from the gathered weights
    last = manifests[STEPS]
    digests = {}
    for key in last.layout or ():
        name, lo, hi = parse_slice_key(key)
        digests[key] = tensor_digest(want[name][lo:hi])
    assert combine_digests(digests) == last.state_digest

    # weight challenges: computed from the bytes of the sampled chunks each rank holds; a worker
    # holding the weights answers alike
    proofs = json.loads((tmp_path / "rank0" / "proofs.json").read_text())
    assert sorted(proofs) == [str(v) for v in range(STEPS + 1)]
    spec = ProofSpec(24, 256)
    for nonce, answer in proofs[str(STEPS)]:
        assert proof_answer(want, bytes.fromhex(nonce), STEPS, spec) == answer
    assert len(proofs[str(STEPS)]) == 8

    # a worker from nothing, then one that lags: catch-up across several versions by deltas,
    # every part decoded in the decoding child (against the mirror's row views)
    engine, sync = follower(bucket, child=True)
    assert sync._decoder is not None
    layouts: list[object] = []
    decode = sync._decoder.decode

    def spy(data: bytes, digests: dict[str, str], **kw: object) -> object:
        layouts.append(kw.get("layout"))
        return decode(data, digests, **kw)  # type: ignore[arg-type]

    sync._decoder.decode = spy  # type: ignore[method-assign]
    try:
        sync.sync_to(1)
        report = sync.sync_to(STEPS)
        assert [s.kind for s in report.steps] == ["delta"] * (STEPS - 1)
        assert torch.equal(
            engine.tensors["table.weight"].view(torch.int16), want["table.weight"].view(torch.int16)
        )
        assert sync.verified_digest() == (STEPS, last.state_digest)
        # v0's anchor, then deltas to v1 .. v3: two parts each (two ranks), with their layout
        assert len(layouts) == 2 * STEPS and all(layouts), layouts
    finally:
        sync.close()

    # GC keeps the newest anchor (v2) and after; every part of v0 and v1 goes
    before = {o.key for o in bucket.list("objects/")}
    gc = collect_garbage(
        bucket,
        RetentionPolicy(keep_anchors=1, orphan_grace_s=0),
        now=datetime.now(UTC) + timedelta(hours=1),
    )
    assert gc.deleted_versions == [0, 1]
    left = {o.key for o in bucket.list("objects/")}
    gone = {k for v in (0, 1) for o in manifests[v].objects for k in o.keys}
    assert gone and gone <= before and not gone & left
    fresh_engine, fresh = follower(bucket)
    assert [s.kind for s in fresh.sync_to(STEPS).steps] == ["anchor", "delta"]
    assert torch.equal(fresh_engine.tensors["table.weight"], engine.tensors["table.weight"])


def checkpoint_rank(rank: int, root: str) -> None:
    """Train 2 steps, checkpoint, train a third; then a fresh model resumed from the checkpoint
    takes the same third step: every rank's shards must come out bit-identical."""
    from test_step import rollout

    from deltarl.trainer.learn.batch import collate
    from deltarl.trainer.learn.distributed import broadcast
    from deltarl.trainer.learn.optim import build_optimizer
    from deltarl.trainer.learn.step import train_step

    ctx, device = join(rank, root)
    base = make_settings(Path(root) / "run")
    # batches of the initial weights, trained on by later weights: not on-policy
    sampling = base.sampling.model_copy(update={"max_onpolicy_mismatch_kl": None})
    settings = base.model_copy(update={"sampling": sampling})
    gen = torch.Generator().manual_seed(3)
    batches = [collate(rollout(Bigram(), gen, 2, 8, 0), 0) for _ in range(3)]

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
        model = sharded_bigram(ctx, device)
        opt, sched = build_optimizer(model.parameters(), settings.optimizer, settings.max_steps)
        return model, opt, sched

    ckpt = ShardedCheckpointer(Path(root) / "ckpt", ctx)
    model, opt, sched = fresh()
    for b in batches[:2]:
        train_step(model, opt, sched, b, settings, dist=ctx)
    if ctx.is_main:
        ckpt.save(2, model, opt, sched, version=2)
    else:
        assert broadcast(None, ctx) == ("checkpoint", 2)  # rank 0's control message
        ckpt.save_local(2, model, opt, sched)
    full = full_state(model, opt)  # the test's reference for the resharding tests
    if ctx.is_main:
        save_file(full, str(Path(root) / "full2.safetensors"))
    train_step(model, opt, sched, batches[2], settings, dist=ctx)
    want = model.table.weight.to_local().clone()

    resumed, opt2, sched2 = fresh()
    assert not torch.equal(resumed.table.weight.to_local(), want)
    ckpt.load().restore(resumed, opt2, sched2)  # type: ignore[arg-type]
    train_step(resumed, opt2, sched2, batches[2], settings, dist=ctx)
    assert torch.equal(resumed.table.weight.to_local(), want), rank

    # the whole-model loader assembles the ranks' files (checked in the test itself)
    assert isinstance(Checkpointer(Path(root) / "ckpt").load(), Checkpoint)
    (Path(root) / f"ok{rank}").write_text("ok")
    shutdown_distributed(ctx)


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The whole weights and AdamW state of a sharded Bigram (a collective; the test only)."""
    p = model.table.weight
    state = opt.state[p]
    out = {"table.weight": p.full_tensor().detach().clone()}
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = state[key].full_tensor().clone()
    out["step"] = state["step"].detach().clone().reshape(1)
    return out


def plain_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    p = model.table.weight
    state = opt.state[p]
    return {
        "table.weight": p.detach(),
        "exp_avg": state["exp_avg"],
        "exp_avg_sq": state["exp_avg_sq"],
        "step": state["step"].reshape(1),
    }


def reshard_rank(rank: int, root: str, world: int) -> None:
    """A job of ``world`` ranks resumes the 2-rank checkpoint and the whole-model one: every
    rank's rows of the weights and of the AdamW state are those rows of the saved state, and
    training goes on."""
    from test_step import rollout

    from deltarl.trainer.learn.batch import collate
    from deltarl.trainer.learn.optim import build_optimizer
    from deltarl.trainer.learn.step import train_step

    ctx, device = join(rank, root, world)
    settings = make_settings(Path(root) / f"run{world}")
    full = load_file(str(Path(root) / "full2.safetensors"))
    for source in ("ckpt", "whole"):
        model = sharded_bigram(ctx, device)
        opt, sched = build_optimizer(model.parameters(), settings.optimizer, settings.max_steps)
        loaded = ShardedCheckpointer(Path(root) / source, ctx).load()
        assert loaded.resharded_from == (2 if source == "ckpt" else 1)
        loaded.restore(model, opt, sched)  # type: ignore[arg-type]
        p = model.table.weight
        local = p.to_local()
        chunk = -(-8 // world)  # FSDP2's rows of an 8-row table on this rank
        lo, hi = min(8, rank * chunk), min(8, (rank + 1) * chunk)
        assert local.shape[0] == hi - lo
        assert torch.equal(local, full["table.weight"][lo:hi]), (source, rank)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key].to_local(), full[key][lo:hi]), (source, key)
        assert float(opt.state[p]["step"]) == float(full["step"][0])
        assert sched.last_epoch == 2  # type: ignore[attr-defined]
        gen = torch.Generator().manual_seed(3)
        batch = collate(rollout(Bigram(), gen, 2, 8, 0), 0)
        sampling = settings.sampling.model_copy(update={"max_onpolicy_mismatch_kl": None})
        train_step(
            model, opt, sched, batch, settings.model_copy(update={"sampling": sampling}), dist=ctx
        )
        assert float(opt.state[p]["step"]) == float(full["step"][0]) + 1
    (Path(root) / f"reshard{world}-{rank}").write_text("ok")
    shutdown_distributed(ctx)


@pytest.mark.slow
def test_sharded_checkpoint_resumes_bit_exactly_and_on_other_world_sizes(tmp_path: Path) -> None:
    spawn_ranks(checkpoint_rank, tmp_path, 2)
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()
    meta = read_meta(tmp_path / "ckpt" / "step_000002")
    assert meta.world_size == 2 and meta.shard_rows == {"table.weight": [4, 4]}
    full = load_file(str(tmp_path / "full2.safetensors"))

    # one process: the whole weights and AdamW state, concatenated from both ranks' files
    from deltarl.trainer.learn.optim import build_optimizer

    settings = make_settings(tmp_path / "run1")
    model = Bigram()
    opt, sched = build_optimizer(model.parameters(), settings.optimizer, settings.max_steps)
    whole = Checkpointer(tmp_path / "ckpt").load()
    assert whole.resharded_from == 2
    whole.restore(model, opt, sched)
    got = plain_state(model, opt)
    assert all(torch.equal(got[k], full[k]) for k in full), [
        k for k in full if not torch.equal(got[k], full[k])
    ]
    Checkpointer(tmp_path / "whole").save(2, model, opt, sched, version=2)

    # 3 ranks from the 2-rank checkpoint (rows 4+4 -> 3+3+2) and from the whole-model one
    spawn_ranks(reshard_rank, tmp_path, 3, 3)
    assert all((tmp_path / f"reshard3-{r}").exists() for r in range(3))

    files = sorted(p.name for p in (tmp_path / "ckpt" / "step_000002").iterdir())
    assert files == sorted(
        [
            f"{kind}.rank0000{r}.safetensors"
            for kind in ("model", "optimizer", "rng")
            for r in (0, 1)
        ]
        + ["trainer.json"]
    )

    # a damaged file that a reshard reads is refused by its digest, nothing restored
    target = tmp_path / "ckpt" / "step_000002" / "optimizer.rank00001.safetensors"
    data = bytearray(target.read_bytes())
    data[-1] ^= 1
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"optimizer\.rank00001\.safetensors: xxh3-128"):
        Checkpointer(tmp_path / "ckpt").load()
