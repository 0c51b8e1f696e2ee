"""``publish.fp8``: the trainer publishes block-fp8 versions (e4m3 + scales + bf16 for the
rest), quantized from the bf16 cast of its master weights at every version; a replica rebuilds
them bit for bit from anchors, deltas and chained deltas."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fp8_states import SHAPES, adam_like_step, bf16_model, same_bytes
from test_weight_publisher import FakeCoordinator, FlakyBucket, rebuild

from deltarl.trainer.publish.weights import PublishFailedError, PublishReport, WeightPublisher
from deltarl.trainer.settings import PublishSettings
from deltarl.weightsync import fp8
from deltarl.weightsync.digest import state_digest
from deltarl.weightsync.reader import BucketReader


def on_device(pub: WeightPublisher) -> WeightPublisher:
    """``pub`` quantizing CPU tensors in its snapshot, as it does CUDA ones (the device path,
    run on the CPU)."""
    pub.QUANTIZE_ON = frozenset({"cpu", "cuda"})
    return pub


@pytest.mark.parametrize(
    ("background", "where"), [(True, "thread"), (False, "thread"), (True, "snapshot")]
)
def test_fp8_versions_are_the_quantized_bf16_cast_and_rebuild_bit_exactly(
    tmp_path: Path, background: bool, where: str
) -> None:
    """Quantized in the publishing thread (CPU weights) or in the snapshot (CUDA weights, here
    on the CPU): the same bytes."""
    bucket = FlakyBucket(tmp_path / "bucket")
    coordinator = FakeCoordinator()
    reports: list[PublishReport] = []
    settings = PublishSettings(fp8=True, anchor_every=3, background=background)
    pub = WeightPublisher(bucket, settings, register=coordinator, on_report=reports.append)
    if where == "snapshot":
        on_device(pub)
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


def test_snapshot_quantization_keeps_one_byte_buffers_and_refuses_non_finite(
    tmp_path: Path,
) -> None:
    """Quantized in the snapshot, the host holds e4m3 (and scales) for the linear weights,
    reuses the buffers from version to version, and a non-finite weight still fails the
    version in the publishing thread (the next one re-anchors)."""
    pub = on_device(WeightPublisher(FlakyBucket(tmp_path / "b"), PublishSettings(fp8=True)))
    master = {n: t.float() for n, t in bf16_model(0).items()}
    up = "model.layers.0.mlp.up_proj.weight"
    snap = pub._snapshot(master)
    assert snap.state[up].dtype == torch.float8_e4m3fn
    assert snap.state[up + "_scale_inv"].dtype == torch.float32
    assert snap.state["lm_head.weight"].dtype == torch.bfloat16
    again = fp8.quantize_state(snap.state)  # nothing left to quantize: the same tensors
    assert again.keys() == snap.state.keys() and all(again[n] is t for n, t in snap.state.items())
    pub._spare = None
    for step in range(3):
        pub.publish(master, step=step)
        adam_like_step(master, 3e-4, seed=step)
    pub.wait()
    spare = pub._spare
    assert spare is not None and spare[up].dtype == torch.float8_e4m3fn
    reused = spare[up].data_ptr()
    pub.publish(master, step=3)
    pub.wait()
    assert pub._base is not None and pub._base[up].data_ptr() == reused

    master[up][1, 2] = float("inf")
    with pytest.raises(PublishFailedError, match="non-finite"):
        pub.publish(master, step=4)
        pub.wait()
    master[up][1, 2] = 0.0
    pub.publish(master, step=5, anchor=True)
    pub.close()
    want = fp8.quantize_state({n: t.to(torch.bfloat16) for n, t in master.items()})
    reader = BucketReader(pub.bucket)
    assert reader.latest_version() == 4  # the failed version's number, now an anchor
    assert reader.manifest(4).state_digest == state_digest(want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_weights_are_quantized_on_the_gpu_to_the_cpu_bytes(tmp_path: Path) -> None:
    """CUDA master weights: quantized on the GPU before the copy, the versions are the bytes of
    the CPU quantization of the same bf16 cast."""
    pub = WeightPublisher(FlakyBucket(tmp_path / "b"), PublishSettings(fp8=True, anchor_every=0))
    master = {n: t.float() for n, t in bf16_model(0).items()}
    expected = []
    for step in range(4):
        pub.publish({n: t.cuda() for n, t in master.items()}, step=step)
        expected.append(fp8.quantize_state({n: t.to(torch.bfloat16) for n, t in master.items()}))
        adam_like_step(master, 3e-4, seed=step)
    pub.close()
    reader = BucketReader(pub.bucket)
    assert [reader.manifest(v).state_digest for v in range(4)] == [
        state_digest(x) for x in expected
    ]
    got, _ = rebuild(pub.bucket)
    assert same_bytes(got, expected[-1])
