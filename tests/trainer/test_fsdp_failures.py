"""A sharded publication that fails on one rank: nothing becomes visible, deltas are refused
until an anchor-only version, and a worker still follows. With the host scan every rank keeps
its snapshot; with the device scan (snapshot overwritten in place) the anchor rebuilds it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ranks import spawn_ranks
from test_fsdp import follower, join, sharded_bigram

from deltarl.buckets.local import LocalBucket
from deltarl.trainer.learn.distributed import (
    broadcast,
    shutdown_distributed,
)
from deltarl.trainer.publish.sharded import ShardedPublisher, local_rows
from deltarl.trainer.publish.weights import PublishFailedError
from deltarl.trainer.settings import PublishSettings
from deltarl.weightsync.reader import BucketReader


class FailOnce(LocalBucket):
    """Refuses the first upload of an object of version 2."""

    failed = False

    def put_bytes(self, key: str, data: bytes, *, overwrite: bool = True) -> None:
        if "v000000000002/" in key and not self.failed:
            self.failed = True
            raise OSError("injected upload failure")
        super().put_bytes(key, data, overwrite=overwrite)


def rank_main(rank: int, root: str, on_device: bool, positions: str = "auto") -> None:
    ctx, device = join(rank, root)
    model = sharded_bigram(ctx, device)
    bucket_dir = Path(root) / "bucket"
    pub = ShardedPublisher(
        FailOnce(bucket_dir) if rank == 1 else LocalBucket(bucket_dir),
        # gaps: the device scan makes no ranks (no sorts), the encoder codes positions as gaps
        PublishSettings(positions=positions),
        ctx,
        scan_on_device=on_device,  # True: the snapshot is overwritten before the upload fails
    )

    start = model.table.weight.to_local().detach().clone()

    def at(step: int) -> dict[str, torch.Tensor]:
        """The rows of ``step`` (every rank moves its own rows alike), as published."""
        with torch.no_grad():
            model.table.weight.to_local().copy_(start + 0.25 * step)
        return local_rows(model, ctx)

    if ctx.is_main:
        events: list[str] = []
        pub.publish(at(0), step=0)  # v0: the anchor
        pub.publish(at(1), step=1)  # v1: a delta
        with pytest.raises(PublishFailedError, match="failed on some rank"):
            pub.publish(at(2), step=2)  # v2: rank 1's upload fails
        events.append(f"latest {BucketReader(LocalBucket(bucket_dir)).latest_version()}")
        with pytest.raises(PublishFailedError, match="re-anchors"):
            pub.publish(at(2), step=2)
        events.append(f"v{pub.publish(at(2), step=2, anchor=True)} anchor")
        events.append(f"v{pub.publish(at(3), step=3)} delta")
        broadcast(("stop", None), ctx)
        full = model.table.weight.full_tensor().to(torch.bfloat16)
        torch.save(full, Path(root) / "final.pt")
        (Path(root) / "events.json").write_text(json.dumps(events))
    else:
        while True:
            kind, payload = broadcast(None, ctx)
            if kind == "stop":
                break
            version, step, anchor = payload
            pub.publish_local(at(step), version, step, anchor)
        model.table.weight.full_tensor()  # rank 0 gathers the final weights
    shutdown_distributed(ctx)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("on_device", "positions"),
    [(False, "auto"), (True, "auto"), (True, "gaps")],
    ids=["host-scan", "device-scan", "device-scan-gaps"],
)
def test_a_failed_rank_upload_leaves_the_bucket_intact_and_forces_an_anchor(
    tmp_path: Path, on_device: bool, positions: str
) -> None:
    spawn_ranks(rank_main, tmp_path, 2, on_device, positions)
    events = json.loads((tmp_path / "events.json").read_text())
    assert events == ["latest 1", "v2 anchor", "v3 delta"]
    reader = BucketReader(LocalBucket(tmp_path / "bucket"))
    assert [m.has_anchor for _, m in sorted(reader.manifests().items())] == [
        True,
        False,
        True,
        False,
    ]
    assert not reader.manifest(2).deltas  # anchor-only after the failure
    engine, sync = follower(LocalBucket(tmp_path / "bucket"))
    sync.sync_to(1)
    report = sync.sync_to(3)  # the delta 1 -> 2 does not exist: through the anchor of v2
    assert [s.kind for s in report.steps] == ["anchor", "delta"]
    assert torch.equal(engine.tensors["table.weight"], torch.load(tmp_path / "final.pt"))
