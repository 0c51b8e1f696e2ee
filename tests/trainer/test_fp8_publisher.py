"""``publish.fp8``: the trainer publishes block-fp8 versions (e4m3 + scales + bf16 for the
rest), quantized from the bf16 cast of its master weights at every version; a replica rebuilds
them bit for bit from anchors, deltas and chained deltas."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fp8_states import SHAPES, adam_like_step, bf16_model, same_bytes
from test_weight_publisher import FakeCoordinator, FlakyBucket, rebuild

from deltarl.trainer.publish.weights import PublishReport, WeightPublisher
from deltarl.trainer.settings import PublishSettings
from deltarl.weightsync import fp8
from deltarl.weightsync.digest import state_digest
from deltarl.weightsync.reader import BucketReader


@pytest.mark.parametrize("background", [True, False])
def test_fp8_versions_are_the_quantized_bf16_cast_and_rebuild_bit_exactly(
    tmp_path: Path, background: bool
) -> None:
    bucket = FlakyBucket(tmp_path / "bucket")
    coordinator = FakeCoordinator()
    reports: list[PublishReport] = []
    settings = PublishSettings(fp8=True, anchor_every=3, background=background)
    pub = WeightPublisher(bucket, settings, register=coordinator, on_report=reports.append)
    master = {n: t.float() for n, t in bf16_model(0).items()}
    expected = []
    for step in range(7):
        pub.publish(master, step=step)  # fp32 master weights, as the trainer's model
        expected.append(fp8.quantize_state({n: t.to(torch.bfloat16) for n, t in master.items()}))
        adam_like_step(master, 3e-4, seed=step)  # mutated right away: the snapshot is a copy
    pub.close()

    reader = BucketReader(bucket)
    for v, want in enumerate(expected):
        assert reader.manifest(v).state_digest == state_digest(want)
    v6 = expected[-1]
    assert v6["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert v6["lm_head.weight"].dtype == torch.bfloat16
    full = sum(t.numel() * t.element_size() for t in v6.values())
    bf16_full = sum(2 * torch.Size(s).numel() for s in SHAPES.values())
    assert reports[-1].full_bytes == full < 0.7 * bf16_full
    assert [r.anchor for r in reports] == [True, False, False, True, False, False, True]
    assert all(r.changed and r.delta_bytes for r in reports[1:])
    assert any(r.chained_bytes for r in reports[2:])  # fp8 deltas chain on the previous one

    got, kinds = rebuild(bucket)  # from nothing: the newest anchor
    assert same_bytes(got, v6) and kinds == ["anchor"]
    got, kinds = rebuild(bucket, expected[1], at=1)  # from v1: deltas (chained after the first)
    assert same_bytes(got, v6) and kinds[0] == "delta" and "anchor" not in kinds


def test_fp8_block_64_publishes_64_blocks(tmp_path: Path) -> None:
    bucket = FlakyBucket(tmp_path / "bucket")
    settings = PublishSettings(fp8=True, fp8_block=64, anchor_every=0, background=False)
    pub = WeightPublisher(bucket, settings)
    master = {n: t.float() for n, t in bf16_model(0).items()}
    expected = []
    for step in range(3):
        pub.publish(master, step=step)
        expected.append(
            fp8.quantize_state({n: t.to(torch.bfloat16) for n, t in master.items()}, (64, 64))
        )
        adam_like_step(master, 3e-4, seed=step)
    pub.close()
    reader = BucketReader(bucket)
    assert [reader.manifest(v).state_digest for v in range(3)] == [
        state_digest(s) for s in expected
    ]
    up = "model.layers.0.mlp.up_proj.weight"
    assert expected[0][up + "_scale_inv"].shape == fp8.scale_shape(SHAPES[up], (64, 64))
    got, kinds = rebuild(bucket, expected[0], at=0)
    assert same_bytes(got, expected[-1]) and kinds and "anchor" not in kinds
    with pytest.raises(ValueError, match="fp8_block"):
        PublishSettings(fp8=True, fp8_block=96)  # type: ignore[arg-type]
