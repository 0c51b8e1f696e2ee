"""Checkpoints and resume: bit-exact continuation, atomic writes, damage detection, re-anchoring.

The data source is scripted (the groups of lease ``i`` are a function of ``i``), so a resumed run
sees exactly the groups an uninterrupted run sees, and the model has dropout, so the RNG state
is part of what must come back."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_weight_publisher import FakeCoordinator, assert_bit_identical, rebuild

import deltarl.trainer.checkpoint.store as ckpt_mod
from deltarl.buckets.local import LocalBucket
from deltarl.services.coordinator.schemas import (
    BatchItem,
    BatchLease,
    LeasedBatch,
    Trajectory,
    TrajectoryGroup,
)
from deltarl.trainer.checkpoint.store import Checkpoint, Checkpointer, CheckpointError
from deltarl.trainer.learn.optim import build_optimizer
from deltarl.trainer.loop import GracefulStop, train
from deltarl.trainer.metrics import MetricsLog, read_metrics
from deltarl.trainer.publish.weights import WeightPublisher
from deltarl.trainer.settings import ExperimentSettings
from deltarl.weightsync.reader import BucketReader

VOCAB = 11
HERE = Path(__file__).parent


class Tiny(torch.nn.Module):
    """Embedding -> dropout -> linear, with an integer buffer (not published, but checkpointed)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.drop = torch.nn.Dropout(0.3)
        self.head = torch.nn.Linear(16, VOCAB)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.embed(input_ids)))


def scripted_groups(index: int, n: int, size: int = 4) -> list[TrajectoryGroup]:
    """The groups of lease ``index``: random tokens, behaviour logprobs and rewards."""
    g = torch.Generator().manual_seed(1000 + index)
    groups = []
    for j in range(n):
        trajs = []
        for _ in range(size):
            length = int(torch.randint(3, 7, (1,), generator=g))
            lp = (-0.1 - 2 * torch.rand(length - 1, generator=g)).tolist()
            trajs.append(
                Trajectory(
                    tokens=torch.randint(0, VOCAB, (length,), generator=g).tolist(),
                    logprobs=[0.0, *lp],
                    mask=[0] + [1] * (length - 1),
                    prompt_len=1,
                    reward=float(torch.rand((), generator=g)),
                    version_min=0,
                    version_max=0,
                )
            )
        key = f"l{index}-g{j}"
        groups.append(
            TrajectoryGroup(idempotency_key=key, worker_id="w", group_id=key, trajectories=trajs)
        )
    return groups


class ScriptedSource:
    """A queue whose ``i``-th lease (counting from ``start``) holds ``scripted_groups(i)``."""

    def __init__(self, start: int = 0, delay_s: float = 0.0) -> None:
        self.index = start
        self.delay_s = delay_s
        self.acked: list[str] = []
        self.nacked: list[str] = []

    def lease(
        self, max_groups: int, lease_s: float | None = None, wait_s: float = 0.0
    ) -> LeasedBatch:
        time.sleep(self.delay_s)
        groups = scripted_groups(self.index, max_groups)
        bid = f"b{self.index}"
        self.index += 1
        items = [
            BatchItem(
                submission_id=i,
                worker_id=g.worker_id,
                group_id=g.group_id,
                version_min=0,
                version_max=0,
                submitted_at=time.time(),
                num_trajectories=len(g.trajectories),
                num_tokens=g.num_tokens,
            )
            for i, g in enumerate(groups)
        ]
        lease = BatchLease(
            batch_id=bid,
            expires_at=time.time() + 60,
            items=items,
            dropped_stale=0,
            current_version=0,
            queue_depth=0,
        )
        return LeasedBatch(lease=lease, groups=groups)

    def ack(self, batch_id: str) -> None:
        self.acked.append(batch_id)

    def nack(self, batch_id: str) -> None:
        self.nacked.append(batch_id)


def make_settings(run_dir: Path, max_steps: int = 6, every: int = 2) -> ExperimentSettings:
    return ExperimentSettings.load(
        None,
        [
            f"max_steps={max_steps}",
            "precision=fp32",
            "optimizer.lr=0.05",
            "optimizer.warmup_steps=2",
            "optimizer.schedule=cosine",
            "optimizer.weight_decay=0.01",
            "batch.groups_per_step=2",
            "batch.group_size=4",
            "batch.micro_batch_size=3",
            "batch.max_staleness=null",
            "sampling.max_onpolicy_mismatch_kl=null",  # scripted logprobs: no model sampled them
            "publish.anchor_every=4",
            f"checkpoint.every={every}",
            "checkpoint.keep=2",
            f"run_dir={run_dir}",
        ],
    )


def run(
    run_dir: Path,
    bucket_dir: Path,
    *,
    max_steps: int = 6,
    every: int = 2,
    resume: bool = False,
    **kwargs: Any,
) -> tuple[Tiny, int, FakeCoordinator]:
    """Train (or resume) a Tiny model; return it, the last version and the registrations."""
    settings = make_settings(run_dir, max_steps, every)
    ckpt = Checkpointer(settings.checkpoint_dir(), keep=settings.checkpoint.keep)
    start = ckpt.load() if resume else None
    torch.manual_seed(0 if start is None else 99)  # a resumed model's init must not matter
    model = Tiny()
    source = ScriptedSource(0 if start is None else start.meta.step)
    coordinator = FakeCoordinator()
    kwargs.setdefault("sink", MetricsLog(run_dir))
    with WeightPublisher(LocalBucket(bucket_dir), settings.publish, register=coordinator) as pub:
        last = train(
            model, settings, source, pub, poll_s=0.0, checkpointer=ckpt, resume=start, **kwargs
        )
    return model, last, coordinator


def assert_same_checkpoint(a: Checkpoint, b: Checkpoint) -> None:
    """Weights, optimizer moments, scheduler and RNG states are bit-identical."""
    for x, y in ((a.model, b.model), (a.optimizer, b.optimizer), (a.rng, b.rng)):
        assert x.keys() == y.keys()
        for n in x:
            assert x[n].dtype == y[n].dtype and torch.equal(x[n], y[n]), n
    assert a.meta.step == b.meta.step and a.meta.state_digest == b.meta.state_digest
    assert a.meta.scheduler == b.meta.scheduler and a.meta.param_groups == b.meta.param_groups
    assert a.meta.python_rng == b.meta.python_rng and a.meta.numpy_rng == b.meta.numpy_rng
    assert a.meta.groups_trained == b.meta.groups_trained


def bf16(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.to(torch.bfloat16) for n, t in model.state_dict().items() if t.is_floating_point()}


class Crash(RuntimeError):
    pass


def crash_at(step: int, run_dir: Path) -> Any:
    log = MetricsLog(run_dir)

    def sink(s: int, metrics: dict[str, float]) -> None:
        log(s, metrics)
        if s == step:
            raise Crash(f"simulated crash in step {s}")

    return sink


# ---------------------------------------------------------------------------------------------


def test_resume_continues_bit_exactly_and_reanchors(tmp_path: Path) -> None:
    full, full_last, _ = run(tmp_path / "a", tmp_path / "bucket-a")
    assert full_last == 6

    # crash during step 5: checkpoint of step 4 (version 4), but version 5 reached the bucket
    with pytest.raises(Crash):
        run(tmp_path / "b", tmp_path / "bucket-b", sink=crash_at(5, tmp_path / "b"))
    ckpt = Checkpointer(tmp_path / "b" / "checkpoints")
    assert ckpt.load().meta.step == 4 and ckpt.load().meta.version == 4
    assert BucketReader(LocalBucket(tmp_path / "bucket-b")).latest_version() == 5

    resumed, last, coordinator = run(tmp_path / "b", tmp_path / "bucket-b", resume=True)
    # the resumed weights are a fresh anchor-only version after the bucket's newest (5)
    versions = [m.version for m in coordinator.manifests]
    assert versions == [6, 7, 8] and last == 8
    first = coordinator.manifests[0]
    assert first.has_anchor and not first.deltas and first.step == 4
    assert all(m.deltas for m in coordinator.manifests[1:])

    # steps 5-6 after the resume are those of the uninterrupted run, bit for bit
    for (n, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    assert_same_checkpoint(
        Checkpointer(tmp_path / "a" / "checkpoints").load(),
        Checkpointer(tmp_path / "b" / "checkpoints").load(),
    )
    # a fresh reader of the bucket rebuilds the trainer's weights; keep=2 pruned step 2
    state, kinds = rebuild(LocalBucket(tmp_path / "bucket-b"))
    assert kinds[0] == "anchor"
    assert_bit_identical(state, bf16(resumed))
    assert [s for s, _ in ckpt.committed()] == [4, 6]
    steps = [r["step"] for r in read_metrics(tmp_path / "b")]
    assert steps == [1, 2, 3, 4, 5, 5, 6]  # step 5 ran twice: once lost to the crash


class ExpiringSource(ScriptedSource):
    """The ack of lease ``b1`` fails as the coordinator's does for a lease that expired."""

    def ack(self, batch_id: str) -> None:
        if batch_id == "b1":
            raise RuntimeError(f"batch {batch_id} is expired: its groups went back to the queue")
        super().ack(batch_id)


def test_checkpoint_counts_the_groups_its_acks_acknowledged(tmp_path: Path) -> None:
    """``groups_trained`` counts every group trained; ``groups_acked`` only those whose ack the
    coordinator took (what its acked total counts): a lease that expired mid-step is trained
    but not acked, and its groups come back to be trained again."""
    settings = make_settings(tmp_path, max_steps=4, every=2)
    ckpt = Checkpointer(settings.checkpoint_dir(), keep=settings.checkpoint.keep)
    source = ExpiringSource()
    with WeightPublisher(LocalBucket(tmp_path / "bucket"), settings.publish) as pub:
        train(Tiny(), settings, source, pub, poll_s=0.0, checkpointer=ckpt)
    meta = ckpt.load().meta
    assert source.acked == ["b0", "b2", "b3"]
    assert (meta.step, meta.groups_trained, meta.groups_acked) == (4, 8, 6)


def test_stop_finishes_the_step_then_checkpoints(tmp_path: Path) -> None:
    stopper = GracefulStop()

    def sink(step: int, metrics: dict[str, float]) -> None:
        if step == 3:
            stopper.event.set()

    model, last, coordinator = run(
        tmp_path / "run", tmp_path / "bucket", every=0, sink=sink, stop=stopper.event
    )
    assert last == 3 and [m.version for m in coordinator.manifests] == [0, 1, 2, 3]
    loaded = Checkpointer(tmp_path / "run" / "checkpoints").load()
    assert loaded.meta.step == 3 and loaded.meta.version == 3
    assert loaded.meta.bucket_version in (2, 3)  # version 3 may still have been in flight
    assert all(torch.equal(loaded.model[n], t) for n, t in model.state_dict().items())


def test_graceful_stop_handles_signals() -> None:
    previous = signal.getsignal(signal.SIGTERM)
    with GracefulStop() as stopper:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stopper.event.wait(5) and stopper.signum == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises in the main thread before this ends
    assert signal.getsignal(signal.SIGTERM) is previous


def _trained(tmp_path: Path) -> tuple[Tiny, torch.optim.AdamW, Any]:
    settings = make_settings(tmp_path)
    torch.manual_seed(0)
    model = Tiny()
    opt, sched = build_optimizer(model.parameters(), settings.optimizer, settings.max_steps)
    for _ in range(2):
        ids = torch.arange(VOCAB)[None]
        model(ids, torch.ones_like(ids)).logsumexp(-1).sum().backward()
        opt.step()
        sched.step()
    return model, opt, sched


def _save(ckpt: Checkpointer, step: int, model: Tiny, opt: Any, sched: Any) -> Path:
    return ckpt.save(step, model, opt, sched, version=step)


def test_round_trip_restores_everything(tmp_path: Path) -> None:
    model, opt, sched = _trained(tmp_path)
    ckpt = Checkpointer(tmp_path / "ckpt")
    _save(ckpt, 2, model, opt, sched)
    expect = (torch.rand(4), np.random.rand(3), random.random())

    fresh = Tiny()
    opt2, sched2 = build_optimizer(fresh.parameters(), make_settings(tmp_path).optimizer, 6)
    ckpt.load().restore(fresh, opt2, sched2)
    assert all(map(torch.equal, model.parameters(), fresh.parameters()))
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], opt2.state[q][key]), key
    assert sched2.state_dict() == sched.state_dict()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert torch.equal(torch.rand(4), expect[0])
    assert np.array_equal(np.random.rand(3), expect[1]) and random.random() == expect[2]
    # no pickle anywhere: the directory holds safetensors and JSON only
    latest = ckpt.latest()
    assert latest is not None
    names = sorted(p.name for p in latest.iterdir())
    assert names == [
        "model.safetensors",
        "optimizer.safetensors",
        "rng.safetensors",
        "trainer.json",
    ]


def test_crash_mid_write_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt, sched = _trained(tmp_path)
    ckpt = Checkpointer(tmp_path / "ckpt", keep=2)
    _save(ckpt, 1, model, opt, sched)
    good = ckpt.load()

    write = ckpt_mod.write_safetensors
    calls = []

    def failing(path: Path, tensors: Any) -> Any:
        calls.append(path.name)
        if len(calls) == 2:
            raise OSError("disk full (simulated) between files")
        return write(path, tensors)

    torch.nn.init.ones_(model.head.weight)  # the state moved on
    monkeypatch.setattr(ckpt_mod, "write_safetensors", failing)
    with pytest.raises(OSError, match="between files"):
        _save(ckpt, 2, model, opt, sched)
    monkeypatch.undo()
    assert ckpt.latest() == tmp_path / "ckpt" / "step_000001"
    assert_same_checkpoint(ckpt.load(), good)

    # a crash after the rename, before the pointer moved: step_000002 exists, uncommitted
    real_replace = os.replace

    def no_pointer(src: Any, dst: Any) -> None:
        raise OSError("killed before the pointer moved (simulated)")

    monkeypatch.setattr(os, "replace", no_pointer)
    with pytest.raises(OSError, match="pointer"):
        _save(ckpt, 2, model, opt, sched)
    monkeypatch.setattr(os, "replace", real_replace)
    assert (tmp_path / "ckpt" / "step_000002").is_dir()
    assert ckpt.load().meta.step == 1 and [s for s, _ in ckpt.committed()] == [1]

    # what a kill -9 leaves: a temp directory; the next save cleans up and commits
    (tmp_path / "ckpt" / ".tmp-step_000003-deadbeef").mkdir()
    (tmp_path / "ckpt" / ".tmp-step_000003-deadbeef" / "model.safetensors").write_bytes(b"x")
    for step in (2, 3, 4):
        _save(ckpt, step, model, opt, sched)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "latest",
        "step_000003",
        "step_000004",
    ]
    assert ckpt.load().meta.step == 4
    assert torch.equal(ckpt.load().model["head.weight"], torch.ones(VOCAB, 16))

    # a damaged pointer fails loading, and the next save repairs it
    (tmp_path / "ckpt" / "latest").write_text("garbage\n")
    with pytest.raises(CheckpointError, match="not a checkpoint name"):
        ckpt.load()
    _save(ckpt, 5, model, opt, sched)
    assert ckpt.load().meta.step == 5


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda d: _flip_byte(d / "model.safetensors"), "xxh3-128 .* differs"),
        (lambda d: _flip_byte(d / "rng.safetensors"), "xxh3-128 .* differs"),
        (
            lambda d: (d / "optimizer.safetensors").write_bytes(
                (d / "optimizer.safetensors").read_bytes()[:-100]
            ),
            "truncated",
        ),
        (lambda d: (d / "rng.safetensors").unlink(), "missing"),
        (
            lambda d: (d / "trainer.json").write_text(
                (d / "trainer.json").read_text().replace('"step": 2', '"step": 3')
            ),
            "checksum mismatch",
        ),
        (lambda d: (d / "trainer.json").write_text("{"), "not valid JSON"),
        (lambda d: (d.parent / "latest").write_text("step_000009\n"), "missing"),
    ],
)
def test_damaged_checkpoint_is_detected(tmp_path: Path, damage: Any, match: str) -> None:
    model, opt, sched = _trained(tmp_path)
    ckpt = Checkpointer(tmp_path / "ckpt")
    path = _save(ckpt, 2, model, opt, sched)
    damage(path)
    with pytest.raises(CheckpointError, match=match):
        ckpt.load()


def test_checkpoint_of_another_model_is_refused_before_any_change(tmp_path: Path) -> None:
    model, opt, sched = _trained(tmp_path)
    ckpt = Checkpointer(tmp_path / "ckpt")
    _save(ckpt, 2, model, opt, sched)
    other = Tiny()
    other.head = torch.nn.Linear(16, VOCAB + 1)
    before = {n: t.clone() for n, t in other.state_dict().items()}
    opt2, sched2 = build_optimizer(other.parameters(), make_settings(tmp_path).optimizer, 6)
    with pytest.raises(CheckpointError, match=r"head.weight: checkpoint torch.float32\[11, 16\]"):
        ckpt.load().restore(other, opt2, sched2)
    assert all(torch.equal(before[n], t) for n, t in other.state_dict().items())
    assert not opt2.state


# ---------------------------------------------------------------------------------------------
# a real process: SIGTERM (graceful), then kill -9, then --resume


def child_main(run_dir: str, bucket_dir: str, resume: str) -> None:
    """Entry point of the training subprocess (see the test below)."""
    logging.basicConfig(level=logging.INFO)
    settings = make_settings(Path(run_dir), max_steps=12, every=1)
    ckpt = Checkpointer(settings.checkpoint_dir(), keep=2)
    start = ckpt.load() if resume == "1" else None
    torch.manual_seed(0)
    model = Tiny()
    source = ScriptedSource(0 if start is None else start.meta.step, delay_s=0.05)
    with GracefulStop() as stopper, WeightPublisher(LocalBucket(bucket_dir), settings.publish) as p:
        train(
            model,
            settings,
            source,
            p,
            poll_s=0.0,
            stop=stopper.event,
            checkpointer=ckpt,
            resume=start,
            sink=MetricsLog(run_dir),
        )
    if stopper.signum is not None:
        sys.exit(128 + stopper.signum)


def _spawn(run_dir: Path, bucket_dir: Path, resume: bool) -> subprocess.Popen[bytes]:
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_checkpoint as t; "
        "t.child_main(*sys.argv[1:])"
    )
    args = [sys.executable, "-c", code, str(run_dir), str(bucket_dir), "1" if resume else "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # 2 shared cores: threads only add contention
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)


def _wait_for_step(run_dir: Path, proc: subprocess.Popen[bytes], at_least: int) -> int:
    pointer = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if pointer.is_file():
            step = int(pointer.read_text().strip().removeprefix("step_") or 0)
            if step >= at_least:
                return step
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr is not None else ""
            raise AssertionError(f"child exited early ({proc.returncode}): {err[-2000:]}")
        time.sleep(0.02)
    raise AssertionError("no checkpoint in time")


@pytest.mark.slow
def test_sigterm_then_kill_9_then_resume(tmp_path: Path, one_thread: None) -> None:
    run_dir, bucket_dir = tmp_path / "run", tmp_path / "bucket"
    child = _spawn(run_dir, bucket_dir, resume=False)
    _wait_for_step(run_dir, child, 2)
    child.send_signal(signal.SIGTERM)
    assert child.wait(30) == 128 + signal.SIGTERM
    ckpt = Checkpointer(run_dir / "checkpoints")
    stopped = ckpt.load().meta
    last_row = read_metrics(run_dir)[-1]["step"]
    # the step in progress finished, was published and checkpointed
    assert stopped.step == last_row and stopped.version == stopped.step
    assert stopped.bucket_version in (stopped.step, stopped.step - 1)
    assert BucketReader(LocalBucket(bucket_dir)).latest_version() == stopped.step

    child = _spawn(run_dir, bucket_dir, resume=True)
    _wait_for_step(run_dir, child, stopped.step + 2)
    child.kill()  # SIGKILL: maybe mid-step, mid-publish or mid-checkpoint
    child.wait(30)
    killed = ckpt.load().meta
    assert killed.step >= stopped.step + 2 and killed.version > stopped.version

    # the in-process resume finishes the run; it matches an uninterrupted one bit for bit
    resumed, last, coordinator = run(run_dir, bucket_dir, max_steps=12, every=1, resume=True)
    full, _, _ = run(tmp_path / "full", tmp_path / "bucket-full", max_steps=12, every=1)
    for (n, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    assert coordinator.manifests[0].has_anchor and not coordinator.manifests[0].deltas
    reader = BucketReader(LocalBucket(bucket_dir))
    assert max(reader.manifests()) == reader.latest_version() == last
    state, _ = rebuild(LocalBucket(bucket_dir))
    assert_bit_identical(state, bf16(resumed))
    latest = ckpt.latest()
    assert latest is not None
    meta = json.loads((latest / "trainer.json").read_text())
    assert meta["step"] == 12 and meta["version"] == last


class DryAfter(ScriptedSource):
    """Serves ``steps`` leases, then nothing (workers gone)."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps

    def lease(
        self, max_groups: int, lease_s: float | None = None, wait_s: float = 0.0
    ) -> LeasedBatch:
        if self.index >= self.steps:
            return LeasedBatch(lease=super().lease(0).lease, groups=[])
        return super().lease(max_groups, lease_s, wait_s)


def test_data_timeout_checkpoints_before_raising(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = make_settings(tmp_path / "run", every=0)
    ckpt = Checkpointer(settings.checkpoint_dir())
    with (
        WeightPublisher(LocalBucket(tmp_path / "bucket"), settings.publish) as pub,
        pytest.raises(TimeoutError, match="timed out"),
    ):
        train(
            Tiny(), settings, DryAfter(2), pub, poll_s=0.0, data_timeout_s=0.05, checkpointer=ckpt
        )
    assert ckpt.load().meta.step == 2
    # a resume with changed settings says which ones
    changed = make_settings(tmp_path / "run", max_steps=3, every=0)
    with (
        WeightPublisher(LocalBucket(tmp_path / "bucket"), changed.publish) as pub,
        caplog.at_level(logging.WARNING),
    ):
        last = train(Tiny(), changed, ScriptedSource(2), pub, poll_s=0.0, resume=ckpt.load())
    assert last == 4  # 3: the anchor of step 2's weights, 4: step 3
    assert "['max_steps']" in caplog.text
