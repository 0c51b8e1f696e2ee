"""One bad worker cannot stop training: hostile groups against the real coordinator service
(SQLite store, wire bytes both ways) and the real trainer loop.

Every group the coordinator accepts is either trained on or refused with a reason (a dead
letter that counts against its worker); the trainer never raises on one, and a group that does
crash it is set aside after its second delivery.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from coordinator.helpers import manifest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_step import VOCAB, Bigram, rollout
from test_weight_publisher import FakeCoordinator

from deltarl.buckets.local import LocalBucket
from deltarl.services.coordinator.errors import ApiError
from deltarl.services.coordinator.schemas import (
    AdmissionRequest,
    BatchItem,
    BatchLease,
    GroupRejection,
    LeasedBatch,
    ModelLimits,
    TrajectoryGroup,
    WorkerRegistration,
    decode_leased_batch,
    encode_group,
    encode_leased_batch,
)
from deltarl.services.coordinator.service import Coordinator
from deltarl.services.coordinator.settings import CoordinatorSettings
from deltarl.services.coordinator.store.sqlite_store import SQLiteStore
from deltarl.trainer import loop
from deltarl.trainer.learn.step import train_step
from deltarl.trainer.loop import Pulled, prepare_batch, pull_groups, train
from deltarl.trainer.publish.weights import WeightPublisher
from deltarl.trainer.screen import model_limits
from deltarl.trainer.settings import BatchSettings, ExperimentSettings


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class ServiceSource:
    """The coordinator's service layer as the trainer's batch source: the lease travels as the
    wire bytes the HTTP route sends, so the trainer decodes exactly what a client would."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.c = coordinator

    def lease(self, max_groups: int, lease_s: float | None = None, wait_s: float = 0.0) -> Any:
        lease, payloads = self.c.lease(max_groups, lease_s)
        return decode_leased_batch(encode_leased_batch(lease, payloads))

    def ack(self, batch_id: str, rejected: list[GroupRejection] | None = None) -> Any:
        return self.c.ack(batch_id, False, rejected or [])

    def nack(self, batch_id: str) -> Any:
        return self.c.ack(batch_id, True)

    def extend(self, batch_id: str, lease_s: float | None = None) -> Any:
        return self.c.extend(batch_id, lease_s)


def coordinator(tmp_path: Path, limits: bool = True, **options: Any) -> Coordinator:
    s = CoordinatorSettings(insecure=True, sqlite_path=str(tmp_path / "c.sqlite3"), **options)
    c = Coordinator(SQLiteStore(s.sqlite_path), s, clock=Clock())
    c.publish(manifest(0), ModelLimits(vocab_size=VOCAB) if limits else None)
    for w in ("honest", "rogue", "other"):
        c.register(WorkerRegistration(worker_id=w, engine="e", model="m", capacity=1))
    return c


def honest_groups(n: int, version: int = 0, seed: int = 2) -> list[TrajectoryGroup]:
    torch.manual_seed(0)
    model = Bigram()
    groups = rollout(model, torch.Generator().manual_seed(seed), n, 4, version)
    return [g.model_copy(update={"worker_id": "honest"}) for g in groups]


def rogue(key: str, **changes: Any) -> bytes:
    """A rogue worker's group, with ``changes`` written into the wire map of its first
    trajectory (as a worker could send them: no client-side validation)."""
    g = honest_groups(1, seed=5)[0].model_copy(update={"worker_id": "rogue"})
    g = g.model_copy(update={"idempotency_key": key, "group_id": f"g-{key}"})
    body = msgpack.unpackb(encode_group(g), raw=False)
    body["trajectories"][0].update(changes)
    return msgpack.packb(body, use_bin_type=True)


def submit(c: Coordinator, payload: bytes) -> None:
    c.submit(payload, None, c.decode(payload))


# -- what the coordinator refuses at the door ---------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        # a token id outside the vocabulary (an IndexError in the trainer, a device assert on GPU)
        ({"tokens": struct.pack("<4i", 1, 2, 2_000_000_000, 5)}, "outside the model's vocab"),
        # > 0 in float64, 0.0 in the trainer's float32
        ({"temperature": 1e-50}, "temperature must be within"),
        # finite in float64, inf in float32: the step's advantages and loss would be NaN
        ({"reward": 1e300}, "reward must be a finite number within"),
        ({"logprobs": struct.pack("<4f", 0, -3e38, -1, -1)}, "within \\[-10000, 0\\]"),
    ],
)
def test_the_coordinator_refuses_what_the_trainer_cannot_take(
    tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    c = coordinator(tmp_path)
    payload = rogue("bad", **changes)
    with pytest.raises(ApiError, match=message) as err:
        submit(c, payload)
    assert err.value.status == 422 and err.value.code == "bad_payload"
    assert c.status().queue.depth == 0


def test_a_group_over_the_byte_bound_is_refused_before_decoding(tmp_path: Path) -> None:
    c = coordinator(tmp_path, max_group_bytes=1024)
    group = honest_groups(1)[0]
    long = group.model_copy(update={"trajectories": group.trajectories * 8})
    payload = encode_group(long)
    assert len(payload) > 1024
    with pytest.raises(ApiError, match="max_group_bytes") as err:
        c.decode(payload)
    assert err.value.status == 413


# -- what the trainer refuses, and the loop that goes on -----------------------------------------


def _pull(c: Coordinator, version: int = 0, want: int = 4) -> Pulled:
    return pull_groups(ServiceSource(c), version, BatchSettings(), want, poll_s=0.0)


def test_an_out_of_vocabulary_group_admitted_without_limits_is_refused_not_raised(
    tmp_path: Path,
) -> None:
    """A coordinator that knows no limits (an older trainer registered none) lets the group in;
    the trainer refuses it by name, trains on the rest, and it never comes back."""
    c = coordinator(tmp_path, limits=False)
    for g in honest_groups(3):
        submit(c, encode_group(g))
    submit(c, rogue("oov", tokens=struct.pack("<4i", 1, 2, 2_000_000_000, 5)))
    pulled = _pull(c)
    settings = ExperimentSettings.load(None, ["precision=fp32"])
    batch, kept = prepare_batch(pulled, 0, settings, ModelLimits(vocab_size=VOCAB))
    assert batch is not None and [e.worker_id for e in kept] == ["honest"] * 3
    assert pulled.refusals.by_reason == {"bad_token_id": 1}
    loop._ack_all(ServiceSource(c), loop.LeaseKeeper(object(), 60), pulled, pulled.refusals)
    dead = c.dead_letters(10)
    assert dead.count == 1 and dead.items[0].reason == "bad_token_id"
    assert "2000000000" in dead.items[0].detail
    assert c.worker("rogue").rejected_groups == 1
    assert c.status().queue.depth == 0 and c.lease(10, None)[0].items == []


def _forged(key: str, version: int = 0) -> bytes:
    """Made-up logprobs (every one -20) claiming the latest version: only the trainer, which
    recomputes them, can tell."""
    g = honest_groups(1, version, seed=9)[0]
    g = g.model_copy(update={"worker_id": "rogue", "idempotency_key": key, "group_id": key})
    g = g.model_copy(
        update={
            "trajectories": [
                t.model_copy(update={"logprobs": [-20.0 if m else 0.0 for m in t.mask]})
                for t in g.trajectories
            ]
        }
    )
    return encode_group(g)


def test_made_up_logprobs_are_dropped_and_their_worker_flagged_then_refused(
    tmp_path: Path,
) -> None:
    c = coordinator(tmp_path, suspect_after=2, refuse_suspect_workers=True)
    c.publish(manifest(1), ModelLimits(vocab_size=VOCAB))
    settings = ExperimentSettings.load(None, ["precision=fp32", "optimizer.lr=0.1"])
    torch.manual_seed(0)
    model = Bigram()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    for step in range(2):
        for g in honest_groups(3, version=1, seed=10 + step):
            g = g.model_copy(update={"idempotency_key": f"{g.idempotency_key}-{step}"})
            submit(c, encode_group(g))
        submit(c, _forged(f"forged-{step}", version=1))
        pulled = _pull(c, version=1)
        batch, kept = prepare_batch(pulled, 1, settings, model_limits(model))
        assert batch is not None
        dropped: dict[int, float] = {}
        metrics = train_step(model, opt, sched, batch, settings, dropped=dropped)
        assert [kept[i].worker_id for i in dropped] == ["rogue"]
        assert metrics["step/skipped"] == 0.0 and metrics["batch/groups"] == 3
        for i, kl in dropped.items():
            pulled.refusals.refuse(kept[i], "sampling_mismatch", f"kl {kl:.3g}")
        loop._ack_all(ServiceSource(c), loop.LeaseKeeper(object(), 60), pulled, pulled.refusals)
    info = c.worker("rogue")
    assert info.suspect and info.rejected_groups == 2
    assert info.last_rejection is not None and info.last_rejection.startswith("sampling_mismatch")
    assert not c.worker("honest").suspect
    status = c.status()
    assert status.workers_suspect == 1 and status.queue.rejected == {"sampling_mismatch": 2}
    assert status.workers[0].worker_id == "rogue"  # suspects lead the list
    with pytest.raises(ApiError, match="suspect") as err:
        submit(c, _forged("forged-late", version=1))
    assert err.value.status == 403
    answer = c.admission(AdmissionRequest(worker_id="rogue", want=4, applied_version=1))
    assert answer.grant == 0 and answer.reason == "suspect"
    c.clear_rejections("rogue")  # an operator vouches for it
    assert not c.worker("rogue").suspect
    assert c.admission(AdmissionRequest(worker_id="rogue", want=4, applied_version=1)).grant > 0


def test_the_loop_trains_through_hostile_groups(tmp_path: Path) -> None:
    """The real loop, the real service: rogue groups mixed into every step; every step trains,
    every rogue group ends as a dead letter, no honest one does."""
    c = coordinator(tmp_path, limits=False)  # the trainer alone must catch everything
    for g in honest_groups(12):
        submit(c, encode_group(g))
    for i in range(3):
        submit(c, rogue(f"oov{i}", tokens=struct.pack("<4i", 1, 2, VOCAB + i, 5)))
    settings = ExperimentSettings.load(
        None,
        [
            "max_steps=3",
            "precision=fp32",
            "batch.groups_per_step=5",
            "batch.max_staleness=100",
            f"run_dir={tmp_path / 'run'}",
        ],
    )
    fake = FakeCoordinator()
    with WeightPublisher(LocalBucket(tmp_path / "bucket"), settings.publish, register=fake) as pub:
        last = train(Bigram(), settings, ServiceSource(c), pub, poll_s=0.0)
    assert last == 3
    dead = c.dead_letters(10)
    assert sorted(d.submission_id for d in dead.items) == [13, 14, 15]
    assert {d.worker_id for d in dead.items} == {"rogue"}
    assert c.status().queue.depth == 0 and c.status().queue.leased == 0


def test_a_group_that_crashes_the_trainer_is_set_aside_after_one_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure no check foresaw: the trainer dies on the group twice (each restart leases it
    first), then the coordinator sets it aside and the third trainer trains on."""
    c = coordinator(tmp_path)
    clock = c.clock
    assert isinstance(clock, Clock)
    submit(c, rogue("poison", reward=-1.0))  # valid: only this trainer's step dies on it
    for g in honest_groups(4):
        submit(c, encode_group(g))
    real = loop.train_step

    def fragile(model: Any, opt: Any, sched: Any, batch: Any, *a: Any, **k: Any) -> Any:
        if bool((batch.rewards == -1.0).any()):
            raise RuntimeError("CUDA error: device-side assert triggered")
        return real(model, opt, sched, batch, *a, **k)

    monkeypatch.setattr(loop, "train_step", fragile)
    settings = ExperimentSettings.load(
        None, ["max_steps=1", "precision=fp32", "batch.groups_per_step=2", "batch.lease_s=30"]
    )
    for attempt in range(2):
        settings = settings.model_copy(update={"run_dir": str(tmp_path / f"run{attempt}")})
        fake = FakeCoordinator()
        bucket = LocalBucket(tmp_path / f"bucket{attempt}")
        with (
            pytest.raises(RuntimeError, match="device-side assert"),
            WeightPublisher(bucket, settings.publish, register=fake) as pub,
        ):
            train(Bigram(), settings, ServiceSource(c), pub, poll_s=0.0)
        clock.now += 60  # the dead trainer's lease expires
    bucket = LocalBucket(tmp_path / "bucket-last")
    with WeightPublisher(bucket, settings.publish, register=FakeCoordinator()) as pub:
        assert train(Bigram(), settings, ServiceSource(c), pub, poll_s=0.0) == 1
    dead = c.dead_letters(10)
    assert [d.group_id for d in dead.items] == ["g-poison"]
    assert dead.items[0].reason == "undelivered" and dead.items[0].deliveries == 2
    assert c.worker("rogue").rejected_groups == 0  # not counted against the worker


# -- the property: any group the coordinator accepts trains or is refused with a reason --------


FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
LOGPROB = st.one_of(
    st.floats(min_value=-30.0, max_value=0.0, width=32), FLOAT32, st.just(-1e4), st.just(0.0)
)
REWARD = st.one_of(
    st.floats(min_value=-2.0, max_value=2.0), st.floats(allow_nan=True), st.just(1e9), st.just(-1e9)
)


@st.composite
def wire_trajectory(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(1, 12))
    prompt = draw(st.integers(0, n))
    tokens = draw(
        st.lists(
            st.one_of(st.integers(0, VOCAB - 1), st.integers(0, 2**31 - 1)), min_size=n, max_size=n
        )
    )
    mask = [0] * prompt + draw(
        st.lists(st.integers(0, 1), min_size=n - prompt, max_size=n - prompt)
    )
    logprobs = [draw(LOGPROB) if m else 0.0 for m in mask]
    vmin = draw(st.integers(0, 2))
    out: dict[str, Any] = {
        "tokens": struct.pack(f"<{n}i", *tokens),
        "logprobs": struct.pack(f"<{n}f", *logprobs),
        "mask": bytes(mask),
        "prompt_len": prompt,
        "reward": draw(REWARD),
        "signals": draw(st.dictionaries(st.sampled_from(["a", "b"]), REWARD, max_size=2)),
        "version_min": vmin,
        "version_max": vmin + draw(st.integers(0, 1)),
    }
    temperature = draw(
        st.one_of(st.none(), st.floats(0.01, 100.0), st.floats(allow_nan=True), st.just(1e-50))
    )
    if temperature is not None:
        out["temperature"] = temperature
    if draw(st.booleans()):  # turns: one turn covering everything, its reward the episode's
        out["turn_ends"] = struct.pack("<1i", n)
        out["turn_rewards"] = struct.pack("<1d", out["reward"])
    return out


@st.composite
def wire_group(draw: st.DrawFn, key: str) -> bytes:
    body = {
        "format": "deltarl-traj-v1",
        "idempotency_key": key,
        "worker_id": draw(st.sampled_from(["honest", "rogue"])),
        "group_id": key,
        "trajectories": draw(st.lists(wire_trajectory(), min_size=1, max_size=4)),
    }
    return msgpack.packb(body, use_bin_type=True)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data(), limits=st.booleans())
def test_any_accepted_group_trains_or_is_refused_with_a_reason(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject, limits: bool
) -> None:
    c = coordinator(tmp_path_factory.mktemp("c"), limits=limits)
    c.publish(manifest(1), ModelLimits(vocab_size=VOCAB) if limits else None)
    c.publish(manifest(2), ModelLimits(vocab_size=VOCAB) if limits else None)
    accepted = 0
    for i in range(data.draw(st.integers(1, 5))):
        payload = data.draw(wire_group(f"k{i}"))
        try:
            submit(c, payload)
        except ApiError as exc:
            assert 400 <= exc.status < 500, exc.message
            continue
        accepted += 1
    if not accepted:
        return
    pulled = _pull(c, version=2, want=accepted)
    settings_ = ExperimentSettings.load(None, ["precision=fp32", "batch.micro_batch_size=3"])
    torch.manual_seed(0)
    model = Bigram()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    batch, kept = prepare_batch(pulled, 2, settings_, model_limits(model))
    trained = 0
    if batch is not None:
        dropped: dict[int, float] = {}
        metrics = train_step(model, opt, sched, batch, settings_, dropped=dropped)
        trained = len(kept) - len(dropped)
        assert metrics["batch/groups"] == trained
        assert all(math.isfinite(float(p.detach().abs().max())) for p in model.parameters())
        for i in dropped:
            pulled.refusals.refuse(kept[i], "sampling_mismatch", "")
    assert trained + len(pulled.refusals) + pulled.dropped_by_trainer == accepted
    assert all(r.reason for rs in pulled.refusals.by_batch.values() for r in rs)


def test_a_payload_that_no_longer_decodes_is_refused_by_the_trainer() -> None:
    """A group a coordinator older than the trainer's checks let in (here: reward 1e300) does
    not stop the lease's decoding: it comes back as a refusal."""
    good = encode_group(honest_groups(1)[0])
    bad = rogue("old", reward=1e300)
    items = [
        BatchItem(
            submission_id=i,
            worker_id="w",
            group_id="g",
            version_min=0,
            version_max=0,
            submitted_at=0.0,
            num_trajectories=1,
            num_tokens=1,
        )
        for i in (7, 8)
    ]
    lease = BatchLease(
        batch_id="b", expires_at=0.0, items=items, dropped_stale=0, current_version=0, queue_depth=0
    )
    got = decode_leased_batch(encode_leased_batch(lease, [good, bad]))
    assert isinstance(got, LeasedBatch)
    assert got.submission_ids == [7] and len(got.groups) == 1
    assert [(r.submission_id, r.reason) for r in got.refused] == [(8, "bad_payload")]
    assert "reward" in got.refused[0].detail


def test_model_limits_bound_ids_always_and_lengths_only_for_learned_positions() -> None:
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=100,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
        )
    )
    assert model_limits(llama) == ModelLimits(vocab_size=100, max_tokens=None)  # rotary
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=100,
            n_positions=40,
            n_embd=16,
            n_layer=1,
            n_head=2,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    assert model_limits(gpt2) == ModelLimits(vocab_size=100, max_tokens=40)  # learned
    assert model_limits(Bigram()) == ModelLimits(vocab_size=VOCAB)
    assert model_limits(torch.nn.Linear(3, 3)) is None
