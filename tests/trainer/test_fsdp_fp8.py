"""fp8 versions under FSDP2 (2 gloo ranks on CPU, and 2 NCCL ranks on 2 GPUs): every rank quantizes its own rows, and the
version is the same bytes as one process's ``publish.fp8`` version of the same weights, although
128-row blocks straddle the ranks (their scales come from the amax reduced over both ranks, and
the rank holding a block's first row publishes its scale). A worker follows the sharded versions
bit-exactly; a rank with non-finite rows fails the version on every rank, without a hang."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from fp8_states import SHAPES, adam_like_step, bf16_model, same_bytes
from ranks import spawn_ranks
from test_fsdp import join
from test_weight_publisher import rebuild

from deltarl.buckets.local import LocalBucket
from deltarl.rollout.sync.weights import WeightSync
from deltarl.trainer.learn.distributed import (
    broadcast,
    init_distributed,
    shard_fsdp,
    shutdown_distributed,
)
from deltarl.trainer.publish.sharded import ShardedPublisher, local_rows
from deltarl.trainer.publish.sharded_fp8 import straddled
from deltarl.trainer.publish.weights import PublishFailedError, WeightPublisher
from deltarl.trainer.settings import PublishSettings
from deltarl.weightsync import fp8
from deltarl.weightsync.digest import combine_digests, state_digest, tensor_digest
from deltarl.weightsync.manifest import parse_slice_key
from deltarl.weightsync.reader import BucketReader

# fp8_states' shapes split over 2 ranks: 300, 320 and 192 rows split inside a block (150, 160,
# 96), k_proj's 128 rows are one block over both ranks (rank 1 owns no scale row); 512 rows split
# on a block boundary (quantized locally); stacked experts split by expert
MODEL_SHAPES = SHAPES | {"model.layers.1.self_attn.v_proj.weight": (512, 192)}
VERSIONS = 6
SETTINGS = PublishSettings(fp8=True, anchor_every=4, background=False, proof_challenges=0)


def masters(step: int) -> dict[str, torch.Tensor]:
    """The fp32 master weights after ``step`` Adam-like steps (the same on every process)."""
    base = bf16_model(0) | {
        n: (torch.randn(s, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
        for n, s in MODEL_SHAPES.items()
        if n not in SHAPES
    }
    master = {n: t.float() for n, t in base.items()}
    for s in range(step):
        adam_like_step(master, 3e-4, seed=s)
    return master


class Params(torch.nn.Module):
    """A module holding ``tensors`` under their dotted names (nested submodules)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, t in tensors.items():
            owner: torch.nn.Module = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(leaf, torch.nn.Parameter(t.clone()))


def rank_main(rank: int, root: str, on: str = "cpu") -> None:
    if on == "cuda":  # NCCL: the amax reduction and the scans on the GPUs
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"})
        ctx, device = init_distributed("cuda", timeout_s=120, init_method=f"file://{root}/rv")
    else:
        ctx, device = join(rank, root)
    model = shard_fsdp(Params(masters(0)), ctx, device)
    bucket = LocalBucket(Path(root) / "bucket")

    def at(step: int, poison: bool = False) -> dict[str, torch.Tensor]:
        rows = local_rows(model, ctx)
        full = masters(step)
        with torch.no_grad():
            for key, t in rows.items():
                name, lo, hi = parse_slice_key(key)
                t.copy_(full[name][lo:hi])
                if poison and name.endswith("up_proj.weight"):
                    t[0, 0] = float("nan")  # rank 1's rows of a straddled tensor
        return rows

    if ctx.is_main:
        pub = ShardedPublisher(bucket, SETTINGS, ctx)
        for step in range(VERSIONS):
            assert pub.publish(at(step), step=step) == step
        with pytest.raises(PublishFailedError):  # rank 1's rows hold a NaN: the version fails
            pub.publish(at(VERSIONS), step=VERSIONS)
        assert pub.publish(at(VERSIONS), step=VERSIONS, anchor=True) == VERSIONS
        broadcast(("stop", None), ctx)
    else:
        # this rank finds and scans its changes the device way (in place, one tensor at a time)
        pub = ShardedPublisher(bucket, SETTINGS, ctx, scan_on_device=True)
        committed: list[bool] = []
        while True:
            kind, payload = broadcast(None, ctx)
            if kind == "stop":
                break
            version, step, anchor = payload
            rows = at(step, poison=len(committed) == VERSIONS)
            committed.append(pub.publish_local(rows, version, step, anchor))
        (Path(root) / "rank1.json").write_text(json.dumps(committed))
    shutdown_distributed(ctx)


def layout_digest(state: dict[str, torch.Tensor], layout: tuple[str, ...]) -> str:
    """The state digest of ``state`` over a sharded version's slice keys."""
    digests = {}
    for key in layout:
        name, lo, hi = parse_slice_key(key)
        digests[key] = tensor_digest(state[name][lo:hi])
    return combine_digests(digests)


class DictEngine:
    """The part of an engine WeightSync uses: named tensors on the CPU, laid out as ``specs``."""

    device = torch.device("cpu")

    def __init__(self, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
        self.tensors = {n: torch.zeros(s, dtype=d) for n, (d, s) in specs.items()}

    def named_parameters(self) -> dict[str, torch.Tensor]:
        return self.tensors


@pytest.mark.parametrize(
    "on",
    [
        pytest.param("cpu", marks=pytest.mark.slow),
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
            ],
        ),
    ],
)
def test_fsdp_fp8_versions_are_one_process_bytes_with_blocks_across_ranks(
    tmp_path: Path, one_thread: None, on: str
) -> None:
    """On CUDA the ranks quantize on their GPUs and reduce the amax grids over NCCL: the bytes
    are still one CPU process's."""
    spawn_ranks(rank_main, tmp_path, 2, on)
    assert json.loads((tmp_path / "rank1.json").read_text()) == [True] * VERSIONS + [False, True]

    # one process publishing the same weights
    single = LocalBucket(tmp_path / "single")
    pub = WeightPublisher(single, SETTINGS)
    for step in range(VERSIONS + 1):
        pub.publish(masters(step), step=step)
    pub.close()

    sharded, one = BucketReader(LocalBucket(tmp_path / "bucket")), BucketReader(single)
    assert sorted(sharded.manifests()) == list(range(VERSIONS + 1))  # the failed one left none
    states = []
    for v in range(VERSIONS + 1):
        state = fp8.quantize_state({n: t.to(torch.bfloat16) for n, t in masters(v).items()})
        states.append(state)
        m, ref = sharded.manifest(v), one.manifest(v)
        assert ref.state_digest == state_digest(state)  # one process: that quantization
        assert m.layout is not None and layout_digest(state, m.layout) == m.state_digest, v
        assert (m.numel, m.full_bytes) == (ref.numel, ref.full_bytes)
        if 0 < v < VERSIONS:  # a delta of the same changed elements (e4m3 bytes and scales)
            mine = [o.changed for o in m.deltas if not o.chained]
            theirs = [o.changed for o in ref.deltas if not o.chained]
            assert mine == theirs and mine[0], v
    got, _ = rebuild(single)
    assert same_bytes(got, states[-1])

    # the layout: e4m3 rows by FSDP shard, scale rows by the rank holding each block's first row
    layout = set(sharded.manifest(VERSIONS).layout or ())
    q = "model.layers.0.self_attn.q_proj.weight"
    k = "model.layers.0.self_attn.k_proj.weight"
    v_ = "model.layers.1.self_attn.v_proj.weight"
    e = "model.layers.1.mlp.experts.gate_up_proj"
    assert {f"{q}[0:96]", f"{q}[96:192]", f"{q}_scale_inv[0:1]", f"{q}_scale_inv[1:2]"} <= layout
    assert {f"{k}[0:64]", f"{k}[64:128]", f"{k}_scale_inv[0:1]"} <= layout
    assert [x for x in layout if x.startswith(f"{k}_scale_inv")] == [f"{k}_scale_inv[0:1]"]
    assert {f"{v_}_scale_inv[0:2]", f"{v_}_scale_inv[2:4]"} <= layout
    assert {f"{e}[0:2]", f"{e}[2:4]", f"{e}_scale_inv[0:2]", f"{e}_scale_inv[2:4]"} <= layout
    assert straddled([(0, 96), (96, 192)]) and not straddled([(0, 256), (256, 512)])
    # the steps move the scale of q_proj's first block, whose rows both ranks hold: a block
    # re-sent across the ranks is part of what the comparisons above check
    moved = [
        v
        for v in range(1, VERSIONS)
        if states[v][f"{q}_scale_inv"][0, 0] != states[v - 1][f"{q}_scale_inv"][0, 0]
    ]
    assert moved

    # a worker follows the sharded versions: from nothing, then by deltas; bit-exact
    specs = fp8.fp8_layout({n: (torch.bfloat16, s) for n, s in MODEL_SHAPES.items()})
    engine = DictEngine(specs)
    sync = WeightSync(engine, sharded)  # type: ignore[arg-type]
    sync.sync_to(1)
    report = sync.sync_to(VERSIONS - 1)
    assert [s.kind for s in report.steps] == ["delta"] * (VERSIONS - 2)
    assert same_bytes(engine.tensors, states[VERSIONS - 1])
    assert sync.verified_digest() == (VERSIONS - 1, sharded.manifest(VERSIONS - 1).state_digest)
    sync.sync_to(VERSIONS)
    assert same_bytes(engine.tensors, states[VERSIONS])


SETTINGS_64 = SETTINGS.model_copy(update={"fp8_block": 64})


def rank_main_64(rank: int, root: str) -> None:
    """Three versions in 64 x 64 blocks (``publish.fp8_block = 64``) from two ranks."""
    ctx, device = join(rank, root)
    model = shard_fsdp(Params(masters(0)), ctx, device)
    pub = ShardedPublisher(LocalBucket(Path(root) / "bucket"), SETTINGS_64, ctx)
    for step in range(3):
        rows = local_rows(model, ctx)
        with torch.no_grad():
            for key, t in rows.items():
                name, lo, hi = parse_slice_key(key)
                t.copy_(masters(step)[name][lo:hi])
        if ctx.is_main:  # tells the other rank what to publish (as the trainer's loop does)
            assert pub.publish(rows, step=step) == step
        else:
            _, (version, at_step, anchor) = broadcast(None, ctx)
            assert pub.publish_local(rows, version, at_step, anchor)
    shutdown_distributed(ctx)


@pytest.mark.slow
def test_fsdp_fp8_in_64_blocks_is_one_process_bytes(tmp_path: Path, one_thread: None) -> None:
    """The block side reaches every rank: the ranks' boundary at q_proj's row 96 falls inside
    the 64-row block of rows 64-127 (rank 0 owns its scale), and the bytes are one process's."""
    spawn_ranks(rank_main_64, tmp_path, 2)
    sharded = BucketReader(LocalBucket(tmp_path / "bucket"))
    q = "model.layers.0.self_attn.q_proj.weight"
    for v in range(3):
        state = fp8.quantize_state(
            {n: t.to(torch.bfloat16) for n, t in masters(v).items()}, (64, 64)
        )
        m = sharded.manifest(v)
        assert m.layout is not None and layout_digest(state, m.layout) == m.state_digest, v
    assert {f"{q}_scale_inv[0:2]", f"{q}_scale_inv[2:3]"} <= set(m.layout)
    specs = fp8.fp8_layout({n: (torch.bfloat16, s) for n, s in MODEL_SHAPES.items()}, (64, 64))
    engine = DictEngine(specs)
    WeightSync(engine, sharded).sync_to(2)  # type: ignore[arg-type]
    assert same_bytes(engine.tensors, state)
