"""WeightPublisher on a directory bucket: replicas rebuild the trainer's bf16 weights exactly."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from deltarl.buckets import ObjectInfo
from deltarl.buckets.local import LocalBucket
from deltarl.trainer.publish.weights import (
    PublishFailedError,
    PublishReport,
    WeightPublisher,
    publishable_state,
)
from deltarl.trainer.settings import PublishSettings
from deltarl.weightsync.anchor import decode_anchor
from deltarl.weightsync.codec import formats
from deltarl.weightsync.codec.context import ContextMismatchError, DeltaContext
from deltarl.weightsync.codec.formats import AUTO_GAPS_ELEMENTS, decode_delta, describe
from deltarl.weightsync.delta import apply_delta
from deltarl.weightsync.digest import state_digest
from deltarl.weightsync.manifest import ObjectRef, VersionManifest
from deltarl.weightsync.reader import BucketReader


class FlakyBucket(LocalBucket):
    """A directory bucket that fails (or slows down) writes whose key matches a pattern."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.fail_pattern: str | None = None
        self.delay_s = 0.0
        self.gate = threading.Event()  # writes wait until it is set
        self.gate.set()

    def _check(self, key: str) -> None:
        assert self.gate.wait(timeout=30), "the test never opened the bucket's gate"
        time.sleep(self.delay_s)
        if self.fail_pattern is not None and re.fullmatch(self.fail_pattern, key):
            raise OSError(f"simulated upload failure for {key}")

    def put_bytes(self, key: str, data: bytes, *, overwrite: bool = True) -> ObjectInfo:
        self._check(key)
        return super().put_bytes(key, data, overwrite=overwrite)

    def put_file(self, key: str, path: str | Path, *, overwrite: bool = True) -> ObjectInfo:
        self._check(key)
        return super().put_file(key, path, overwrite=overwrite)


class FakeCoordinator:
    """Records manifests like the coordinator does: strictly increasing versions."""

    def __init__(self) -> None:
        self.manifests: list[VersionManifest] = []
        self.fail_on: int | None = None
        self.thread_names: set[str] = set()

    def __call__(self, manifest: VersionManifest) -> None:
        self.thread_names.add(threading.current_thread().name)
        if manifest.version == self.fail_on:
            raise ConnectionError("coordinator unreachable")
        assert not self.manifests or manifest.version > self.manifests[-1].version
        self.manifests.append(manifest)


class TinyModel:
    """fp32 master weights of a few tensors, moved like small optimizer steps."""

    def __init__(self, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        g = self.gen
        self.params = {
            "embed.weight": torch.randn(64, 32, generator=g) * 0.02,
            "layers.0.mlp.weight": torch.randn(32, 96, generator=g) * 0.02,
            "layers.0.norm.weight": torch.ones(32),
            "lm_head.bias": torch.zeros(17),
        }

    def step(self, lr: float = 2e-4) -> None:
        for t in self.params.values():
            t.add_(torch.randn(t.shape, generator=self.gen).sign() * lr)

    def drift(self, lr: float = 2e-4) -> None:
        """A step along a fixed direction per element (like Adam's momentum): consecutive
        deltas move the same elements alike, which chained deltas code more cheaply."""
        if not hasattr(self, "direction"):
            self.direction = {
                n: torch.randn(t.shape, generator=self.gen) for n, t in self.params.items()
            }
        for n, t in self.params.items():
            t.add_(self.direction[n] * lr)

    def bf16(self) -> dict[str, torch.Tensor]:
        return {n: t.to(torch.bfloat16) for n, t in self.params.items()}


def rebuild(
    bucket: LocalBucket, current: dict[str, torch.Tensor] | None = None, at: int | None = None
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """What a fresh replica does: plan from ``at`` (None: nothing), fetch, apply, verify.

    Keeps the context of the last delta it applied, for chained deltas (kinds: ``"anchor"``,
    ``"delta"`` or ``"chained"``)."""
    reader = BucketReader(bucket)
    plan = reader.plan(at)
    state = None if current is None else {n: t.clone() for n, t in current.items()}
    context: DeltaContext | None = None
    kinds: list[str] = []
    for ref in plan.steps:
        data = reader.fetch(ref)
        kinds.append("chained" if ref.chained else ref.kind)
        if ref.kind == "anchor":
            state, context = decode_anchor(data)[0], None
        else:
            assert state is not None
            delta = decode_delta(data, state, context=context)
            context = DeltaContext.of(delta, state)
            apply_delta(state, delta)
    assert state is not None
    assert state_digest(state) == reader.manifest(plan.target).state_digest
    return state, kinds


def deltas_of(manifest: VersionManifest) -> tuple[list[ObjectRef], list[ObjectRef]]:
    """(standalone, chained) deltas of a version."""
    return (
        [o for o in manifest.deltas if not o.chained],
        [o for o in manifest.deltas if o.chained],
    )


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].dtype == b[n].dtype == torch.bfloat16
        assert torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)), n


@pytest.fixture
def bucket(tmp_path: Path) -> FlakyBucket:
    return FlakyBucket(tmp_path / "bucket")


@pytest.fixture
def coordinator() -> FakeCoordinator:
    return FakeCoordinator()


@pytest.mark.parametrize("fmt", ["compact", "trl-gap"])
@pytest.mark.parametrize("background", [True, False])
def test_publish_versions_and_rebuild_bit_identically(
    bucket: FlakyBucket, coordinator: FakeCoordinator, fmt: str, background: bool
) -> None:
    model = TinyModel()
    reports: list[PublishReport] = []
    settings = PublishSettings(format=fmt, anchor_every=3, background=background)  # type: ignore[arg-type]
    pub = WeightPublisher(bucket, settings, register=coordinator, on_report=reports.append)
    states = []
    for step in range(6):
        pub.publish(model.params, step=step)
        states.append(model.bf16())
        model.step()  # mutating the master weights right away must not affect the snapshot
    pub.close()
    assert pub.last_version == 5 and [m.version for m in coordinator.manifests] == list(range(6))
    assert [r.anchor for r in reports] == [True, False, False, True, False, False]
    assert [r.base_version for r in reports] == [None, 0, 1, 2, 3, 4]
    for r in reports[1:]:
        assert r.delta_format is not None and r.delta_bytes and r.changed
        assert 0 < (r.density or 0) < 1 and r.full_bytes == 2 * r.numel
        assert r.total_s >= r.diff_s >= 0 and r.upload_s > 0
        assert "publish/delta_bytes" in r.metrics()
    if background:
        assert coordinator.thread_names == {"deltarl-publish_0"}

    # a replica from nothing: newest anchor (v3) + chain; one at v0: whichever is cheaper
    got, kinds = rebuild(bucket)
    assert_bit_identical(got, states[-1])
    assert kinds[0] == "anchor"
    got, _ = rebuild(bucket, states[0], at=0)
    assert_bit_identical(got, states[-1])
    # every intermediate version is reachable and exact too
    reader = BucketReader(bucket)
    for v in range(6):
        assert reader.manifest(v).state_digest == state_digest(states[v])


def test_delta_against_unchanged_state_and_dtypes(bucket: FlakyBucket) -> None:
    model = TinyModel()
    with WeightPublisher(bucket, PublishSettings(background=False)) as pub:
        pub.publish(model.params)
        pub.publish(model.params)  # nothing changed: an empty delta is still a version
        report = pub.wait()
        assert report is not None and report.changed == 0 and not report.anchor
        pub.publish({n: t.to(torch.bfloat16) for n, t in model.params.items()})  # bf16 input
        assert pub.last_version == 2
    got, _ = rebuild(bucket)
    assert_bit_identical(got, model.bf16())
    with pytest.raises(ValueError, match="floating-point"):
        WeightPublisher(bucket).publish({"step": torch.tensor([1])})


def test_failed_upload_leaves_chain_intact_and_requires_reanchor(
    bucket: FlakyBucket, coordinator: FakeCoordinator
) -> None:
    model = TinyModel()
    pub = WeightPublisher(bucket, PublishSettings(anchor_every=0), register=coordinator)
    for _ in range(2):
        pub.publish(model.params)
        model.step()
    pub.wait()
    v1 = rebuild(bucket)[0]
    bucket.fail_pattern = r"objects/v000000000002/.*"
    pub.publish(model.params)  # version 2: fails in the background
    with pytest.raises(PublishFailedError, match="version 2 failed") as info:
        pub.wait()
    assert isinstance(info.value.__cause__, OSError)
    assert pub.failed and pub.last_version == 1
    reader = BucketReader(bucket)
    assert reader.latest_version() == 1 and [m.version for m in coordinator.manifests] == [0, 1]
    assert_bit_identical(rebuild(bucket)[0], v1)

    bucket.fail_pattern = None
    model.step()
    with pytest.raises(PublishFailedError, match="anchor=True"):
        pub.publish(model.params)  # a delta is refused until the publisher re-anchors
    assert pub.next_version() == 2  # version 2 never reached the bucket: it can be reused
    pub.publish(model.params, anchor=True)
    report = pub.wait()
    assert report is not None and report.version == 2 and report.anchor
    assert report.base_version is None and report.delta_bytes is None  # anchor only
    assert not pub.failed
    model.step()
    pub.publish(model.params)  # deltas again
    pub.close()
    final = model.bf16()
    assert_bit_identical(rebuild(bucket)[0], final)
    # a replica still at version 1 cannot take a delta to 2: the plan uses the new anchor
    got, kinds = rebuild(bucket, v1, at=1)
    assert kinds == ["anchor", "delta"]
    assert_bit_identical(got, final)


def test_registration_failure_after_commit(
    bucket: FlakyBucket, coordinator: FakeCoordinator
) -> None:
    model = TinyModel()
    pub = WeightPublisher(bucket, register=coordinator)
    pub.publish(model.params)
    model.step()
    coordinator.fail_on = 1
    pub.publish(model.params)
    with pytest.raises(PublishFailedError, match="ConnectionError"):
        pub.wait()
    # the bucket committed version 1, the coordinator never heard of it
    assert BucketReader(bucket).latest_version() == 1
    assert pub.next_version() == 2
    with pytest.raises(ValueError, match="strictly increase"):
        pub.publish(model.params, 1, anchor=True)
    model.step()
    pub.publish(model.params, anchor=True)
    pub.close()
    assert [m.version for m in coordinator.manifests] == [0, 2]
    assert coordinator.manifests[-1].has_anchor and not coordinator.manifests[-1].deltas
    assert_bit_identical(rebuild(bucket)[0], model.bf16())


def test_state_mismatch_is_a_failure_too(bucket: FlakyBucket) -> None:
    model = TinyModel()
    pub = WeightPublisher(bucket, PublishSettings(background=False))
    pub.publish(model.params)
    grown = {**model.params, "extra.weight": torch.zeros(3)}
    with pytest.raises(PublishFailedError, match="tensors differ"):
        pub.publish(grown)
    pub.publish(grown, anchor=True)
    assert_bit_identical(rebuild(bucket)[0], {n: t.to(torch.bfloat16) for n, t in grown.items()})


def test_background_overlaps_and_counts_waiting(bucket: FlakyBucket) -> None:
    model = TinyModel()
    pub = WeightPublisher(bucket)
    bucket.gate.clear()  # no write (objects, manifest, pointer) can finish yet
    pub.publish(model.params)  # returns after the snapshot only: it would hang otherwise
    assert pub.last_version is None  # nothing committed yet
    bucket.gate.set()
    bucket.delay_s = 0.05  # every write is slow
    model.step()
    pub.publish(model.params)  # waits for version 0 first
    waited = pub.waited_s
    assert waited > 0.1
    pub.wait()
    assert pub.waited_s > waited and pub.last_version == 1
    with pytest.raises(ValueError, match="strictly increase"):
        pub.publish(model.params, 1)
    pub.close()


def test_resume_anchors_first_and_continues_numbering(bucket: FlakyBucket) -> None:
    model = TinyModel()
    with WeightPublisher(bucket) as pub:
        for _ in range(3):
            pub.publish(model.params)
            model.step()
    resumed = WeightPublisher(bucket, register=None)
    assert resumed.next_version() == 3
    resumed.publish(model.params)
    report = resumed.wait()
    assert report is not None and report.version == 3 and report.anchor
    assert report.base_version is None  # no mirror after a restart: anchor only
    model.step()
    resumed.publish(model.params)
    resumed.close()
    assert_bit_identical(rebuild(bucket)[0], model.bf16())


def test_large_anchor_goes_through_a_temp_file(bucket: FlakyBucket, tmp_path: Path) -> None:
    model = TinyModel()
    staging = tmp_path / "staging"
    staging.mkdir()
    settings = PublishSettings(anchor_in_memory_max_bytes=0, anchor_compress=True)
    with WeightPublisher(bucket, settings, tmp_dir=staging) as pub:
        pub.publish(model.params)
        report = pub.wait()
    assert report is not None and report.anchor_bytes
    manifest = BucketReader(bucket).manifest(0)
    assert manifest.anchors[0].format == "safetensors+zstd"
    assert manifest.anchors[0].key.endswith(".safetensors.zst")
    assert list(staging.iterdir()) == []  # the temp file is gone
    assert_bit_identical(rebuild(bucket)[0], model.bf16())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_weights(bucket: FlakyBucket) -> None:
    model = TinyModel()
    params = {n: t.cuda() for n, t in model.params.items()}
    with WeightPublisher(bucket) as pub:
        for _ in range(3):
            expected = {n: t.to(torch.bfloat16).cpu() for n, t in params.items()}
            pub.publish(params)
            for t in params.values():  # in-place update right after the (async) snapshot
                t.add_(1e-2)
    assert_bit_identical(rebuild(bucket)[0], expected)


def test_publishable_state_keeps_float_weights_only() -> None:
    model = torch.nn.Linear(2, 3)
    model.register_buffer("position_ids", torch.arange(4))
    model.register_buffer("scale", torch.ones(1))
    assert sorted(publishable_state(model)) == ["bias", "scale", "weight"]


def test_publishable_state_lists_tied_weights_once() -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

    state = publishable_state(Tied())
    assert list(state) == ["embed.weight"]
    assert {n for n, _ in Tied().named_parameters()} == set(state)


def test_chained_deltas_published_and_decode_bit_identically(
    bucket: FlakyBucket, coordinator: FakeCoordinator
) -> None:
    model = TinyModel()
    reports: list[PublishReport] = []
    settings = PublishSettings(anchor_every=0)
    pub = WeightPublisher(bucket, settings, register=coordinator, on_report=reports.append)
    states = []
    for step in range(4):
        pub.publish(model.params, step=step)
        states.append(model.bf16())
        model.drift()
    pub.close()
    reader = BucketReader(bucket)
    # version 1, the first delta after the anchor-only start: nothing to chain on
    standalone, chained = deltas_of(reader.manifest(1))
    assert len(standalone) == 1 and chained == []
    assert reports[1].chained_bytes is None and "publish/chained_bytes" not in reports[1].metrics()
    for w in (2, 3):
        manifest = reader.manifest(w)
        standalone, chained = deltas_of(manifest)
        assert len(standalone) == 1 and len(chained) == 1
        ref = chained[0]
        assert ref.base_version == w - 1 and ref.context_version == w - 2
        assert ref.base_digest == standalone[0].base_digest and ref.changed == standalone[0].changed
        assert ref.format == standalone[0].format == "deltarl-compact-v3"
        assert reports[w].chained_bytes == ref.size and reports[w].delta_bytes == standalone[0].size
        assert reports[w].metrics()["publish/chained_bytes"] == ref.size
        assert ref.size < standalone[0].size  # the drift repeats the previous moves
        # a replica at w-1 that got there by the delta w-2 -> w-1 decodes the chained delta
        prev_ref = deltas_of(reader.manifest(w - 1))[0][0]
        prev = decode_delta(reader.fetch(prev_ref), states[w - 2])
        context = DeltaContext.of(prev, states[w - 2])
        blob = reader.fetch(ref)
        state = {n: t.clone() for n, t in states[w - 1].items()}
        apply_delta(state, decode_delta(blob, state, context=context))
        assert_bit_identical(state, states[w])
        with pytest.raises(ContextMismatchError):
            decode_delta(blob, states[w - 1])  # without the context: refused
    assert coordinator.manifests[-1].deltas[-1].context_version == 1  # registered as well
    # the planner takes the chained deltas where the replica holds their context
    got, kinds = rebuild(bucket, states[0], at=0)
    assert kinds == ["delta", "chained", "chained"]
    assert_bit_identical(got, states[-1])


@pytest.mark.parametrize(
    ("positions", "lowered", "want"),
    [
        ("gaps", False, "gaps"),
        ("contexts", False, "contexts"),
        ("auto", False, "contexts"),
        ("auto", True, "gaps"),
    ],
)
def test_the_position_coding_setting_reaches_every_chunk_of_both_deltas(
    bucket: FlakyBucket,
    monkeypatch: pytest.MonkeyPatch,
    positions: str,
    lowered: bool,
    want: str,
) -> None:
    """``publish.positions``: 'auto' codes positions as gaps from AUTO_GAPS_ELEMENTS elements
    of published state on (lowered here to this tiny model's size); the standalone and the
    chained delta both follow it and decode bit-identically."""
    assert sum(t.numel() for t in TinyModel().params.values()) < AUTO_GAPS_ELEMENTS
    if lowered:
        monkeypatch.setattr(
            formats, "AUTO_GAPS_ELEMENTS", sum(t.numel() for t in TinyModel().params.values())
        )
    model = TinyModel()
    states = []
    with WeightPublisher(bucket, PublishSettings(anchor_every=0, positions=positions)) as pub:
        for step in range(3):
            pub.publish(model.params, step=step)
            states.append(model.bf16())
            model.drift()
    standalone, chained = deltas_of(BucketReader(bucket).manifest(2))
    for ref in (*standalone, *chained):
        counts = describe(BucketReader(bucket).fetch(ref))["positions"]
        assert counts[want] > 0 and sum(counts.values()) == counts[want], counts
    got, kinds = rebuild(bucket, states[0], at=0)
    assert kinds == ["delta", "chained"]
    assert_bit_identical(got, states[-1])


def test_no_chained_delta_after_an_anchor_only_version_or_a_resume(bucket: FlakyBucket) -> None:
    model = TinyModel()
    with WeightPublisher(bucket, PublishSettings(anchor_every=3)) as pub:
        for _ in range(4):
            pub.publish(model.params)
            model.drift()
    reader = BucketReader(bucket)
    assert [len(deltas_of(reader.manifest(v))[1]) for v in range(4)] == [0, 0, 1, 1]
    assert reader.manifest(3).has_anchor  # an anchor next to the deltas keeps the chain going
    with WeightPublisher(bucket, PublishSettings(anchor_every=0)) as resumed:
        for _ in range(3):
            resumed.publish(model.params)  # 4: anchor only; 5: delta; 6: delta + chained
            last = model.bf16()
            model.drift()
    layout = [
        (reader.manifest(v).has_anchor, [o.context_version for o in reader.manifest(v).deltas])
        for v in (4, 5, 6)
    ]
    assert layout == [(True, []), (False, [None]), (False, [None, 4])]
    got, kinds = rebuild(bucket)
    assert kinds == ["anchor", "delta", "chained"]
    assert_bit_identical(got, last)


def test_a_chained_delta_that_is_not_smaller_is_not_published(
    bucket: FlakyBucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    import deltarl.trainer.publish.weights as publisher_module

    real = publisher_module.encode_delta

    def bloated(*args: Any, **kwargs: Any) -> bytes:
        blob = real(*args, **kwargs)
        return blob + bytes(len(blob)) if kwargs.get("context") is not None else blob

    monkeypatch.setattr(publisher_module, "encode_delta", bloated)
    model = TinyModel()
    reports: list[PublishReport] = []
    with WeightPublisher(bucket, PublishSettings(anchor_every=0), on_report=reports.append) as pub:
        for _ in range(4):
            pub.publish(model.params)
            last = model.bf16()
            model.drift()
    reader = BucketReader(bucket)
    assert [len(reader.manifest(v).deltas) for v in range(4)] == [0, 1, 1, 1]
    assert all(r.chained_bytes is None for r in reports)
    assert_bit_identical(rebuild(bucket)[0], last)


@pytest.mark.parametrize("fmt", ["compact", "trl-gap"])
def test_chained_deltas_can_be_switched_off(bucket: FlakyBucket, fmt: str) -> None:
    model = TinyModel()
    reports: list[PublishReport] = []
    settings = PublishSettings(format=fmt, chained_deltas=fmt != "compact")  # type: ignore[arg-type]
    with WeightPublisher(bucket, settings, on_report=reports.append) as pub:
        for _ in range(4):
            pub.publish(model.params)
            last = model.bf16()
            model.drift()
    reader = BucketReader(bucket)
    assert all(not o.chained for v in range(4) for o in reader.manifest(v).objects)
    assert [len(reader.manifest(v).deltas) for v in range(4)] == [0, 1, 1, 1]
    assert all(r.chained_bytes is None for r in reports)
    assert_bit_identical(rebuild(bucket)[0], last)


def test_no_chained_delta_after_a_failure(bucket: FlakyBucket) -> None:
    model = TinyModel()
    states = []
    pub = WeightPublisher(bucket, PublishSettings(anchor_every=0))
    for _ in range(3):
        pub.publish(model.params)
        states.append(model.bf16())
        model.drift()
    pub.wait()
    bucket.fail_pattern = r"objects/v000000000003/.*"
    pub.publish(model.params)  # version 3 fails
    with pytest.raises(PublishFailedError):
        pub.wait()
    bucket.fail_pattern = None
    pub.publish(model.params, anchor=True)  # 3 again: anchor only
    model.drift()
    for _ in range(2):
        pub.publish(model.params)  # 4: delta only; 5: delta + chained on 3 -> 4
        last = model.bf16()
        model.drift()
    pub.close()
    reader = BucketReader(bucket)
    contexts = {v: [o.context_version for o in reader.manifest(v).deltas] for v in range(6)}
    assert contexts == {0: [], 1: [None], 2: [None, 0], 3: [], 4: [None], 5: [None, 3]}
    got, kinds = rebuild(bucket, states[2], at=2)
    assert kinds == ["anchor", "delta", "chained"]
    assert_bit_identical(got, last)


def test_each_version_hands_over_weight_challenges(bucket: FlakyBucket) -> None:
    """After registration, ``proof_challenges`` fresh (nonce, answer) pairs computed on exactly
    the published state; a failing hand-over costs only the proofs, never the version."""
    from deltarl.weightsync.proof import proof_answer

    model = TinyModel()
    got: list[tuple[int, Any, list[tuple[str, str]]]] = []
    settings = PublishSettings(background=False, proof_challenges=3, proof_chunks=8)
    with WeightPublisher(
        bucket, settings, challenges=lambda v, spec, pairs: got.append((v, spec, pairs))
    ) as pub:
        pub.publish(model.params)
        published = {n: t.to(torch.bfloat16) for n, t in model.params.items()}
    assert [(v, spec.chunks, len(pairs)) for v, spec, pairs in got] == [(0, 8, 3)]
    _, spec, pairs = got[0]
    for nonce, answer in pairs:
        assert proof_answer(published, bytes.fromhex(nonce), 0, spec) == answer

    def broken(*_: object) -> None:
        raise ConnectionError("coordinator down")

    with WeightPublisher(bucket, settings, challenges=broken) as pub:
        pub.publish(model.params)
        report = pub.wait()
    assert report is not None and report.version == 1  # published all the same
    off = PublishSettings(background=False, proof_challenges=0)
    with WeightPublisher(bucket, off, challenges=broken) as pub:
        pub.publish(model.params)  # 0: no challenge computed, the callback never called


class FakePool:
    """A coordinator's challenge pools: it aims at ``target`` unused pairs per version and
    answers each hand-over with how many more it wants (as ``ChallengePoolResult``)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.posts: list[tuple[int, Any, list[tuple[str, str]]]] = []
        self.size: dict[int, int] = {}

    def __call__(self, version: int, spec: Any, pairs: list[tuple[str, str]]) -> Any:
        from types import SimpleNamespace

        self.posts.append((version, spec, pairs))
        self.size[version] = self.size.get(version, 0) + len(pairs)
        return SimpleNamespace(target=self.target, wanted=self.need(version))

    def need(self, version: int) -> int:
        return max(0, self.target - self.size.get(version, 0))

    def sizes(self, version: int) -> list[int]:
        return [len(p) for v, _, p in self.posts if v == version]


def test_the_challenge_pool_is_sized_by_the_coordinator(bucket: FlakyBucket) -> None:
    """The first hand-over of a version has ``proof_challenges`` pairs (or the pool size the
    coordinator aimed at for the version before); then as many as its answer asks for, within
    ``proof_challenges_max`` per version; every pair is fresh and right."""
    from deltarl.weightsync.proof import proof_answer

    model = TinyModel()
    pool = FakePool(target=25)
    settings = PublishSettings(
        background=False, proof_challenges=4, proof_chunks=8, proof_challenges_max=40
    )
    states = []
    with WeightPublisher(bucket, settings, challenges=pool) as pub:
        for target in (25, 25, 100):
            pool.target = target
            pub.publish(model.params)
            states.append({n: t.to(torch.bfloat16) for n, t in model.params.items()})
            model.step()
    assert pool.sizes(0) == [4, 21]  # 4, then what the fleet needs
    assert pool.sizes(1) == [25]  # the fleet's size known: one hand-over
    assert pool.sizes(2) == [25, 15]  # capped at proof_challenges_max
    nonces = [n for _, _, pairs in pool.posts for n, _ in pairs]
    assert len(set(nonces)) == len(nonces) == 90
    for v, spec, pairs in pool.posts:
        for nonce, answer in pairs[:3]:
            assert proof_answer(states[v], bytes.fromhex(nonce), v, spec) == answer


def test_the_challenge_pool_is_topped_up_from_the_held_state(bucket: FlakyBucket) -> None:
    """Workers that join or retry after the publish: ``top_up`` (also every ``proof_topup_s``
    in a thread) hands over what the coordinator wants for the newest version, computed on the
    state the publisher still holds."""
    from deltarl.weightsync.proof import proof_answer

    model = TinyModel()
    pool = FakePool(target=4)
    settings = PublishSettings(
        background=False, proof_challenges=4, proof_chunks=8, proof_topup_s=0
    )
    with WeightPublisher(bucket, settings, challenges=pool, challenge_need=pool.need) as pub:
        assert pub.top_up() == 0  # nothing published yet
        pub.publish(model.params)
        published = {n: t.to(torch.bfloat16) for n, t in model.params.items()}
        assert pub.top_up() == 0  # the pool is full
        pool.target = 7  # three workers joined
        assert pub.top_up() == 3 and pool.sizes(0) == [4, 3]
        model.step()
        pub.publish(model.params)  # 4 (v0's first target), then 3 more for the fleet of 7
        assert pool.sizes(1) == [4, 3]
        pool.target = 9  # v1 replaced v0: top-ups are for v1 now
        assert pub.top_up() == 2 and pool.sizes(1) == [4, 3, 2] and pool.sizes(0) == [4, 3]
    _, spec, pairs = pool.posts[1]
    for nonce, answer in pairs:
        assert proof_answer(published, bytes.fromhex(nonce), 0, spec) == answer

    # the background thread does the same
    pool = FakePool(target=4)
    threaded = settings.model_copy(update={"proof_topup_s": 0.02})
    with WeightPublisher(bucket, threaded, challenges=pool, challenge_need=pool.need) as pub:
        v = pub.publish(model.params)
        pool.target = 6
        deadline = time.monotonic() + 10
        while pool.sizes(v) != [4, 2] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.sizes(v) == [4, 2]
