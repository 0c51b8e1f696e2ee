"""WeightSync with chained compact deltas: planned and decoded with the context it keeps of the
last delta it applied, standalone after an anchor, a refused context falls back while healthy."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from rollout_helpers import FakeTrainer, clone_state, same_bits, tiny_engine

from deltarl.buckets.local import LocalBucket
from deltarl.rollout.engines import SamplingParams
from deltarl.rollout.engines.transformers_engine import TransformersEngine
from deltarl.rollout.sync.weights import WeightSync
from deltarl.weightsync.anchor import encode_anchor
from deltarl.weightsync.codec.context import DeltaContext
from deltarl.weightsync.codec.formats import FORMAT_TAGS, encode_delta
from deltarl.weightsync.delta import compute_delta
from deltarl.weightsync.digest import state_digest
from deltarl.weightsync.manifest import ObjectRef
from deltarl.weightsync.planner import CatchUpPlan
from deltarl.weightsync.reader import BucketReader
from deltarl.weightsync.writer import NewObject

COMPACT = FORMAT_TAGS["compact"]
PARAMS = SamplingParams(max_new_tokens=4, seed=0)


class ChainedTrainer(FakeTrainer):
    """Versions whose elements keep moving the same way (momentum): the same 20% of every
    tensor moves by the same 1-3 bit steps at every version, so that a chained delta, which
    predicts each move from the previous one, is much smaller than the standalone one.

    ``step(chained=True)`` publishes, next to the standalone delta ``v-1 -> v``, the delta
    ``v-1 -> v`` chained on the context of the delta ``v-2 -> v-1``."""

    def __init__(self, bucket: LocalBucket, state: dict[str, torch.Tensor]) -> None:
        super().__init__(bucket, state)
        g = torch.Generator().manual_seed(7)
        self._moves = {}
        for name, t in state.items():
            mask = torch.rand(t.shape, generator=g) < 0.2
            step = torch.randint(1, 4, t.shape, generator=g).to(torch.int16)
            self._moves[name] = torch.where(mask, step, torch.zeros_like(step))

    def state_at(self, version: int) -> dict[str, torch.Tensor]:
        s0 = self.states[0]
        return {
            n: (t.view(torch.int16) + version * self._moves[n]).view(t.dtype) for n, t in s0.items()
        }

    def step(self, *, anchor: bool = False, chained: bool = False, delta: bool = True) -> int:
        v = self.latest + 1
        old, new = self.states[v - 1], self.state_at(v)
        objects = []
        if anchor:
            objects.append(NewObject("anchor", "safetensors", encode_anchor(new, v)))
        if delta:
            d = compute_delta(old, new, v - 1, v)
            blob = encode_delta(d, old, "compact")
            objects.append(NewObject("delta", COMPACT, blob, v - 1, d.base_digest, d.changed))
        if chained:
            ctx = DeltaContext.of(
                compute_delta(self.states[v - 2], old, v - 2, v - 1), self.states[v - 2]
            )
            d = compute_delta(old, new, v - 1, v)
            blob = encode_delta(d, old, "compact", context=ctx)
            objects.append(
                NewObject(
                    "delta", COMPACT, blob, v - 1, d.base_digest, d.changed, context_version=v - 2
                )
            )
        numel = sum(t.numel() for t in new.values())
        self.publisher.publish(
            v, objects, state_digest=state_digest(new), numel=numel, full_bytes=2 * numel
        )
        self.states[v] = new
        return v

    def refs(self, version: int) -> tuple[ObjectRef, ObjectRef]:
        """(standalone, chained) deltas of ``version``."""
        objs = self.publisher.reader.manifest(version).objects
        standalone = next(o for o in objs if o.kind == "delta" and o.context_version is None)
        chained = next(o for o in objs if o.context_version is not None)
        return standalone, chained


def setup(
    bucket: LocalBucket, **kwargs: object
) -> tuple[ChainedTrainer, TransformersEngine, WeightSync, list[CatchUpPlan]]:
    """Versions 0 (anchor), 1 (standalone delta), 2 and 3 (standalone + chained deltas); a
    worker with different random weights whose plans are recorded."""
    trainer = ChainedTrainer(bucket, clone_state(dict(tiny_engine(seed=1).named_parameters())))
    trainer.step()
    trainer.step(chained=True)
    trainer.step(chained=True)
    for v in (2, 3):
        standalone, chained = trainer.refs(v)
        assert chained.context_version == v - 2 and chained.size < standalone.size
    engine = tiny_engine(seed=2)
    ws = WeightSync(engine, BucketReader(bucket), **kwargs)  # type: ignore[arg-type]
    return trainer, engine, ws, record_plans(ws)


def record_plans(ws: WeightSync) -> list[CatchUpPlan]:
    plans: list[CatchUpPlan] = []
    real: Callable[..., CatchUpPlan] = ws._plan

    def plan(*args: object) -> CatchUpPlan:
        p = real(*args)
        plans.append(p)
        return p

    ws._plan = plan  # type: ignore[method-assign]
    return plans


def weights(engine: TransformersEngine) -> dict[str, torch.Tensor]:
    return dict(engine.named_parameters())


def at(ws: WeightSync, engine: TransformersEngine, trainer: ChainedTrainer, v: int) -> None:
    """Healthy, bit-identical to the trainer's version ``v`` (tensors and digests)."""
    assert ws.healthy and ws.version == v
    assert same_bits(weights(engine), trainer.states[v])
    assert ws.verified_digest() == (v, trainer.publisher.reader.manifest(v).state_digest)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"host_mirror": True},
        {"host_mirror": True, "verify_before_resume": True},
        {"host_mirror": True, "decode_process": True},
    ],
    ids=["engine-tensors", "mirror", "verify-before-resume", "decode-process"],
)
def test_step_by_step_worker_uses_the_chained_deltas(
    bucket: LocalBucket, kwargs: dict[str, object]
) -> None:
    trainer, engine, ws, plans = setup(bucket, **kwargs)
    try:
        child_calls: list[bool] = []
        if ws._decoder is not None:
            real = ws._decoder.decode

            def decode(data: bytes, digests: dict[str, str], **kw: object) -> object:
                child_calls.append(kw.get("context") is not None)
                return real(data, digests, **kw)  # type: ignore[arg-type]

            ws._decoder.decode = decode  # type: ignore[method-assign]
        assert [s.kind for s in ws.sync_to(0).steps] == ["anchor"] and ws._context is None
        report = ws.sync_to(1)
        (step,) = report.steps
        assert step.kind == "delta" and not step.chained
        assert ws._context is not None and (ws._context.base_version, ws._context.version) == (0, 1)
        at(ws, engine, trainer, 1)
        for v in (2, 3):
            report = ws.sync_to(v)
            (plan,) = plans[-1:]
            assert [s.context_version for s in plan.steps] == [v - 2]
            assert plan.steps[0] == trainer.refs(v)[1]
            assert not report.failures and [s.chained for s in report.steps] == [True]
            assert report.downloaded_bytes == report.planned_bytes == trainer.refs(v)[1].size
            assert ws._context is not None and ws._context.version == v
            at(ws, engine, trainer, v)
        out = ws.generate([[1, 2, 3]], PARAMS)[0]
        assert out.version_min == out.version_max == 3 and ws.check(out) == "verified"
        if ws._decoder is not None:  # the child decoded every delta, the chained ones included
            assert child_calls == [False, True, True]
    finally:
        ws.close()


def test_catching_up_chains_through_several_versions(bucket: LocalBucket) -> None:
    trainer, engine, ws, plans = setup(bucket)
    ws.sync_to(1)
    report = ws.sync_to(3)
    assert [s.context_version for s in plans[-1].steps] == [0, 1]
    assert [s.chained for s in report.steps] == [True, True]
    assert report.downloaded_bytes == report.planned_bytes
    at(ws, engine, trainer, 3)


def test_after_an_anchor_the_first_delta_is_standalone(bucket: LocalBucket) -> None:
    trainer, engine, ws, plans = setup(bucket)
    trainer.step(anchor=True, chained=True)  # v4: anchor, standalone, chained on 2
    trainer.step(chained=True)  # v5: standalone, chained on 3
    ws.sync_to(4)  # from nothing: the anchor of v4 is the cheapest
    assert [s.kind for s in plans[-1].steps] == ["anchor"] and ws._context is None
    report = ws.sync_to(5)
    assert [s.context_version for s in plans[-1].steps] == [None]
    assert [s.chained for s in report.steps] == [False] and not report.failures
    assert report.downloaded_bytes == report.planned_bytes == trainer.refs(5)[0].size
    assert ws._context is not None and ws._context.version == 5
    at(ws, engine, trainer, 5)


def test_a_refused_context_falls_back_to_the_standalone_delta(bucket: LocalBucket) -> None:
    trainer, engine, ws, plans = setup(bucket)
    ws.sync_to(2)
    ctx = ws._context
    assert ctx is not None and (ctx.base_version, ctx.version) == (1, 2)
    # a context with the right versions but other contents (what an odd bucket could cause)
    wrong = DeltaContext.build(
        ctx.base_version,
        ctx.version,
        ctx.index,
        {n: b + 1 for n, b in ctx.before.items()},
        ctx.dtypes,
    )
    assert wrong.digest != ctx.digest
    ws._context = wrong
    seq = ws.status().seq
    report = ws.sync_to(3)
    first, second = plans[-2:]
    assert [s.context_version for s in first.steps] == [1]  # planned chained, refused
    assert [s.context_version for s in second.steps] == [None]  # then the standalone delta
    assert len(report.failures) == 1 and "chained on" in report.failures[0]
    assert [s.chained for s in report.steps] == [False]
    assert ws.status().seq == seq + 1  # one apply: nothing was written for the refused one
    assert ws.healthy and ws._failed_seqs == {0}
    at(ws, engine, trainer, 3)
    assert ws._context is not None and ws._context.version == 3  # the new delta's context


def test_failed_verification_and_anchor_reload_clear_the_context(bucket: LocalBucket) -> None:
    trainer, engine, ws, _ = setup(bucket)
    ws.sync_to(3)
    assert ws._context is not None
    trainer.step(anchor=True, chained=True)  # v4: anchor, standalone, chained on 2
    with torch.no_grad():  # silent drift of the engine's copy: verification of v4 fails
        weights(engine)["lm_head.weight"].view(torch.int16).view(-1)[:64] += 1
    report = ws.sync_to(4)
    assert report.failures and [(s.kind, s.chained) for s in report.steps][-1] == ("anchor", False)
    assert ws._context is None
    at(ws, engine, trainer, 4)
    trainer.step(chained=True)  # v5: standalone + chained on 3: not usable after the anchor
    report = ws.sync_to(5)
    assert [s.chained for s in report.steps] == [False]
    at(ws, engine, trainer, 5)


def test_context_is_the_one_the_trainer_chains_on(bucket: LocalBucket) -> None:
    """The worker's context (built from its host state) has the digest the trainer coded the
    chained delta against, whichever object brought it there."""
    trainer, _, ws, _ = setup(bucket)
    ws.sync_to(1)
    assert ws._context is not None
    want = DeltaContext.of(compute_delta(trainer.states[0], trainer.states[1]), trainer.states[0])
    assert ws._context.digest == want.digest
    assert (ws._context.base_version, ws._context.version) == (0, 1)


def test_chained_deltas_are_counted_in_the_metrics(bucket: LocalBucket) -> None:
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from deltarl.rollout.service.metrics import RolloutMetrics

    _, _, ws, _ = setup(bucket)
    ws.sync_to(1)
    ws.sync_to(3)  # chained 2, chained 3
    m = RolloutMetrics()
    m._worker = SimpleNamespace(sync=ws)  # type: ignore[assignment]
    values = {
        s.name: s.value
        for f in text_string_to_metric_families(m.render().decode())
        for s in f.samples
        if not s.labels or s.labels.get("kind") == "delta"
    }
    assert values["deltarl_rollout_weight_chained_deltas_total"] == 2
    assert values["deltarl_rollout_weight_updates_total"] == 3
