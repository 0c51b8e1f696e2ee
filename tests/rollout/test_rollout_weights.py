"""WeightSync: bit-exact following, catch-up, fallbacks, refusal while unhealthy, mid-generation sync."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from rollout_helpers import FakeTrainer, clone_state, perturb, same_bits, tiny_engine

from deltarl.buckets.local import LocalBucket
from deltarl.rollout.engines import Completion, SamplingParams, WeightsStamp
from deltarl.rollout.engines.transformers_engine import TransformersEngine
from deltarl.rollout.sync import weights as weights_module
from deltarl.rollout.sync.weights import SyncError, WeightsUnhealthyError, WeightSync
from deltarl.weightsync.errors import StateMismatchError
from deltarl.weightsync.reader import BucketReader

PARAMS = SamplingParams(max_new_tokens=4, seed=0)


def setup(
    bucket: LocalBucket, *, tied: bool = False
) -> tuple[FakeTrainer, TransformersEngine, WeightSync]:
    """A trainer at v0 (its own random init) and an engine with different random weights."""
    trainer_weights = tiny_engine(seed=1, tied=tied).named_parameters()
    trainer = FakeTrainer(bucket, clone_state(dict(trainer_weights)))
    engine = tiny_engine(seed=2, tied=tied)
    assert not same_bits(dict(engine.named_parameters()), trainer.states[0])
    return trainer, engine, WeightSync(engine, BucketReader(bucket))


def weights(engine: TransformersEngine) -> dict[str, torch.Tensor]:
    return dict(engine.named_parameters())


@pytest.mark.parametrize("host_mirror", [False, True])  # True: the GPU path's CPU mirror
def test_starts_from_nothing_and_follows_versions_bit_exactly(
    bucket: LocalBucket, host_mirror: bool
) -> None:
    trainer, engine, _ = setup(bucket)
    ws = WeightSync(engine, BucketReader(bucket), host_mirror=host_mirror)
    report = ws.sync_to()
    assert [s.kind for s in report.steps] == ["anchor"] and report.version == 0
    assert ws.healthy and ws.reason == "ok" and same_bits(weights(engine), trainer.states[0])
    for _ in range(4):
        v = trainer.step()
        report = ws.sync_to()
        assert report.version == v and not report.fell_back
        (step,) = report.steps
        assert step.kind == "delta" and step.base_version == v - 1 and step.changed
        assert step.pause_s >= 0 and step.verify_s > 0 and step.download_s > 0
        assert step.publish_to_applied_s is not None and 0 <= step.publish_to_applied_s < 60
        assert same_bits(weights(engine), trainer.states[v])
        if host_mirror:
            assert ws._mirror is not None and same_bits(ws._mirror, trainer.states[v])
            mirror = ws._mirror
            assert all(mirror[n].data_ptr() != t.data_ptr() for n, t in weights(engine).items())
        out = ws.generate([[1, 2, 3]], PARAMS)[0]
        assert out.version_min == out.version_max == v and ws.check(out) == "verified"
    assert ws.sync_to().steps == []  # already there: nothing to do
    assert set(ws.timing_summary()) >= {"pause_s", "decode_s", "verify_s"}
    assert ws.status().version == ws.status().verified_version == 4


def test_catches_up_from_far_behind_and_from_nothing(bucket: LocalBucket) -> None:
    trainer, engine, ws = setup(bucket, tied=True)  # tied embeddings: one tensor, two uses
    assert "lm_head.weight" not in weights(engine)
    ws.sync_to()
    for v in range(1, 11):
        trainer.step(anchor=v == 6)
    report = ws.sync_to()
    assert report.version == 10 and same_bits(weights(engine), trainer.states[10])
    head = engine.model.get_output_embeddings().weight
    assert torch.equal(head, trainer.states[10]["model.embed_tokens.weight"])
    assert [s.version for s in report.steps][-1] == 10
    fresh = tiny_engine(seed=3, tied=True)
    ws2 = WeightSync(fresh, BucketReader(bucket))
    report = ws2.sync_to(8)  # an explicit target, not the latest
    assert [(s.kind, s.version) for s in report.steps] == [
        ("anchor", 6),
        ("delta", 7),
        ("delta", 8),
    ]
    assert same_bits(weights(fresh), trainer.states[8])
    with pytest.raises(SyncError, match="not published"):
        ws2.sync_to(11)


@pytest.mark.parametrize("damage", ["corrupt", "delete"])
def test_missing_or_corrupt_delta_falls_back_to_an_anchor(bucket: LocalBucket, damage: str) -> None:
    trainer, engine, ws = setup(bucket)
    trainer.step()
    ws.sync_to()
    trainer.step()  # v2: delta only
    trainer.step(anchor=True)  # v3: delta + anchor
    path = trainer.object_path(2, "delta")
    if damage == "corrupt":
        blob = bytearray(path.read_bytes())
        blob[len(blob) // 2] ^= 0x40
        path.write_bytes(bytes(blob))
    else:
        path.unlink()
    report = ws.sync_to()
    assert report.fell_back and "v2" in report.failures[0]
    assert ("missing" if damage == "delete" else "xxh3") in report.failures[0]
    assert [(s.kind, s.version) for s in report.steps] == [("anchor", 3)]
    assert ws.healthy and same_bits(weights(engine), trainer.states[3])


def test_delta_whose_base_does_not_match_falls_back(bucket: LocalBucket) -> None:
    trainer, engine, ws = setup(bucket)
    ws.sync_to()
    wrong = perturb(trainer.states[0], seed=99)
    trainer.publish(1, perturb(trainer.states[0], seed=1), base=0, anchor=True, encode_from=wrong)
    report = ws.sync_to()
    assert report.fell_back and "not the base" in report.failures[0]
    assert [s.kind for s in report.steps] == ["anchor"]
    assert same_bits(weights(engine), trainer.states[1])


@pytest.mark.parametrize(
    ("tensor", "caught_by"),
    [
        ("lm_head.weight", "verification of v1 failed"),  # decodes, then the digest differs
        # a tensor wiped to zeros: the delta's positions cannot even be decoded against it
        ("model.embed_tokens.weight", "does not decode against the local weights"),
    ],
)
def test_drifted_weights_are_caught_and_recovered(
    bucket: LocalBucket, tensor: str, caught_by: str
) -> None:
    trainer, engine, ws = setup(bucket)
    ws.sync_to()
    trainer.step(anchor=True)
    with torch.no_grad():  # silent drift of the engine's copy (e.g. a buggy kernel)
        if "decode" in caught_by:
            weights(engine)[tensor].zero_()
        else:
            weights(engine)[tensor].view(torch.int16).view(-1)[:64] += 1
    before = ws.status().seq
    report = ws.sync_to()
    assert caught_by in report.failures[0]
    assert [s.kind for s in report.steps] == ["anchor"]  # the failed delta is not a step
    assert ws.healthy and same_bits(weights(engine), trainer.states[1])
    if "decode" in caught_by:
        return
    # what was sampled with the failed state is reported as such; the reloaded state is fine
    bad = WeightsStamp(1, before + 1)
    assert ws.check(Completion([5], [-1.0], "length", bad, bad)) == "failed"
    good = ws.status()
    stamp = WeightsStamp(good.version, good.seq)
    assert ws.check(Completion([5], [-1.0], "length", stamp, stamp)) == "verified"


def test_generation_is_refused_while_unhealthy(bucket: LocalBucket) -> None:
    trainer, engine, ws = setup(bucket)
    with pytest.raises(WeightsUnhealthyError, match="no weights loaded"):
        ws.generate([[1, 2]], PARAMS)
    ws.sync_to()
    trainer.step(anchor=True)
    for v in (0, 1):  # no way to recover
        trainer.object_path(v, "anchor").unlink()
    with torch.no_grad():
        weights(engine)["lm_head.weight"].view(torch.int16).view(-1)[:64] += 1
    with pytest.raises(SyncError, match=r"unhealthy|no way"):
        ws.sync_to()
    assert not ws.healthy and "verification of v1 failed" in ws.reason
    with pytest.raises(WeightsUnhealthyError, match="verification of v1 failed"):
        ws.generate([[1, 2]], PARAMS)
    assert not ws.status().healthy


def test_wrong_model_is_refused(bucket: LocalBucket) -> None:
    FakeTrainer(bucket, clone_state(dict(tiny_engine(seed=1, layers=1).named_parameters())))
    ws = WeightSync(tiny_engine(seed=2), BucketReader(bucket))
    with pytest.raises(StateMismatchError, match="not the engine's"):
        ws.sync_to()
    assert not ws.healthy


class PausingGate:
    """Wraps a WeightSync; before forward step ``at`` it waits until the test says go."""

    def __init__(self, ws: WeightSync, at: int) -> None:
        self.ws, self.at, self.steps = ws, at, 0
        self.reached, self.go = threading.Event(), threading.Event()

    @contextmanager
    def forward(self) -> Iterator[WeightsStamp]:
        if self.steps == self.at:
            self.reached.set()
            assert self.go.wait(30)
        self.steps += 1
        with self.ws.forward() as stamp:
            yield stamp


def test_a_generation_that_spans_a_sync_records_both_versions(bucket: LocalBucket) -> None:
    trainer, engine, ws = setup(bucket)
    trainer.step()
    ws.sync_to(1)
    trainer.step()
    gate = PausingGate(ws, at=3)
    result: list[list[Completion]] = []
    params = SamplingParams(max_new_tokens=8, seed=4)
    worker = threading.Thread(
        target=lambda: result.append(engine.generate([[1, 2, 3], [4, 5]], params, gate=gate))
    )
    worker.start()
    assert gate.reached.wait(30)
    report = ws.sync_to()  # runs while the generation is between two steps
    gate.go.set()
    worker.join(30)
    assert report.version == 2 and same_bits(weights(engine), trainer.states[2])
    for c in result[0]:
        assert (c.version_min, c.version_max) == (1, 2) and len(c.token_ids) == 8
        assert ws.check(c) == "verified"
    # the first 3 tokens came from v1: the same as a generation that never synced
    ws_old = tiny_engine(seed=5)
    ws_old_sync = WeightSync(ws_old, BucketReader(bucket))
    ws_old_sync.sync_to(1)
    ref = ws_old.generate([[1, 2, 3], [4, 5]], params, gate=ws_old_sync)
    for c, r in zip(result[0], ref, strict=True):
        assert c.token_ids[:3] == r.token_ids[:3]


def test_background_sync_while_generating(bucket: LocalBucket) -> None:
    trainer, engine, ws = setup(bucket)
    ws.sync_to()
    for _ in range(3):
        trainer.step()
    future = ws.sync_in_background()
    seen = set()
    while not future.done():
        for c in ws.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4)):
            seen.add((c.version_min, c.version_max))
    assert future.result(timeout=30).version == 3
    ws.close()
    assert same_bits(weights(engine), trainer.states[3])
    assert all(lo is not None and hi is not None and lo <= hi for lo, hi in seen)


def test_forward_steps_wait_while_the_delta_is_applied(
    bucket: LocalBucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer, _, ws = setup(bucket)
    ws.sync_to()
    trainer.step()
    applying, release, entered = threading.Event(), threading.Event(), threading.Event()
    real_apply = weights_module.apply_staged

    def slow_apply(*args: object) -> None:
        applying.set()
        assert release.wait(30)
        real_apply(*args)

    monkeypatch.setattr(weights_module, "apply_staged", slow_apply)
    future = ws.sync_in_background()
    assert applying.wait(30)
    stamps: list[WeightsStamp] = []

    def one_step() -> None:
        with ws.forward() as stamp:
            entered.set()
            stamps.append(stamp)

    step = threading.Thread(target=one_step)
    step.start()
    assert not entered.wait(0.3)  # the forward step waits for the apply to finish
    release.set()
    step.join(30)
    assert future.result(timeout=30).version == 1
    ws.close()
    assert stamps == [WeightsStamp(1, 2)]  # and then runs with the new weights


def test_samples_are_pending_until_the_apply_is_verified(
    bucket: LocalBucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer, _, ws = setup(bucket)
    ws.sync_to()
    trainer.step()
    verifying, release = threading.Event(), threading.Event()
    real_verify = ws._verify

    def slow_verify(*args: object) -> dict[str, str]:
        verifying.set()
        assert release.wait(30)
        return real_verify(*args)

    monkeypatch.setattr(ws, "_verify", slow_verify)
    future = ws.sync_in_background()
    assert verifying.wait(30)  # applied, not verified yet: generation runs meanwhile
    (c,) = ws.generate([[1, 2, 3]], PARAMS)
    assert c.version_min == 1 and ws.check(c) == "pending"
    assert ws.status().version == 1 and ws.status().verified_version == 0
    release.set()
    assert future.result(timeout=30).version == 1
    ws.close()
    assert ws.check(c) == "verified"


def test_verify_before_resume_has_no_pending_window(bucket: LocalBucket) -> None:
    trainer, engine, _ = setup(bucket)
    ws = WeightSync(engine, BucketReader(bucket), verify_before_resume=True)
    ws.sync_to()
    trainer.step()
    (step,) = ws.sync_to().steps
    assert 0 < step.verify_s <= step.pause_s  # verified inside the pause
    assert same_bits(weights(engine), trainer.states[1])
