"""On-policy distillation on the worker (rollout/distill/teaching.py): a live worker sends each finished
group to a real teacher service (a tiny Llama over SmolLM2's vocabulary) and submits the
teacher's top-k at exactly the trained positions; a teacher that is down at first loses nothing
and lets nothing through without teacher data (required), or is counted and skipped (not
required); a teacher with another vocabulary is a clear error at start."""

from __future__ import annotations

import socket
import threading
from typing import Any

import numpy as np
import pytest
import torch
import uvicorn
from fastapi import FastAPI
from test_worker import drain_queue
from worker_helpers import (
    CoordinatorServer,
    Trainer,
    WorkerThread,
    tiny_model,
    wait_for,
    worker_settings,
)

from deltarl.buckets.local import LocalBucket
from deltarl.rollout.distill.teaching import TeacherMismatch
from deltarl.teacher.app import create_app
from deltarl.teacher.engines.transformers_engine import TransformersTeacher
from deltarl.teacher.settings import TeacherSettings
from deltarl.trainer.learn.batch import collate

TOKEN = "teacher-test-token-0123456789"


class TeacherServer:
    """The real teacher app served by uvicorn in a thread; its port is bound at once (refusing
    connections) and served from :meth:`start`."""

    def __init__(self, model: torch.nn.Module, app: FastAPI | None = None) -> None:
        """``app``: serve this instead of the teacher app over ``model`` (a broken teacher)."""
        self.engine = TransformersTeacher(model, model_name="tiny-teacher")
        settings = TeacherSettings.model_validate({"token": TOKEN, "batch_window_ms": 0})
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        app = app if app is not None else create_app(settings, engine=self.engine)
        config = uvicorn.Config(app, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def start(self) -> TeacherServer:
        self.thread.start()
        wait_for(lambda: self.server.started, 10, "the teacher did not start")
        return self

    def close(self) -> None:
        if self.thread.is_alive():
            self.server.should_exit = True
            self.thread.join(10)
        self.sock.close()


def teacher_model(vocab: int) -> torch.nn.Module:
    return tiny_model(vocab, seed=11).float().eval()


def reference(model: torch.nn.Module, tokens: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) predicting each token from its prefix: row p is for token p."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, -1)
    return torch.cat([torch.zeros(1, lp.shape[1]), lp[:-1]])


@pytest.mark.slow
def test_a_worker_submits_teacher_data_at_the_trained_positions(
    coordinator: CoordinatorServer, env: Any, bucket: LocalBucket, tok: Any
) -> None:
    teacher = TeacherServer(teacher_model(len(tok))).start()
    trainer = Trainer(bucket, coordinator, len(tok))
    settings = worker_settings(
        coordinator, env.url, teacher_url=teacher.url, teacher_token=TOKEN, teacher_top_k=5
    )
    runner = WorkerThread(settings, bucket, tok, len(tok))
    try:
        with runner as worker:
            wait_for(lambda: worker.stats.submitted >= 2, 60, "no group submitted")
            runner.stop()
    finally:
        teacher.close()
    groups = drain_queue(coordinator)
    trajs = [t for g in groups for t in g.trajectories]
    assert trajs and worker.teacher_stats.requests_ok >= len(groups)
    assert worker.teacher_stats.requests_failed == 0 and worker.teacher_stats.waiting == 0
    for t in trajs:
        assert t.teacher is not None and t.teacher.k == 5
        trained = [p for p, m in enumerate(t.mask) if m == 1]
        assert t.teacher.positions == trained  # exactly the trained positions, in order
        temperature = t.temperature or 1.0
        assert t.teacher.temperature == pytest.approx(temperature)
        ref = reference(teacher.engine.model, t.tokens, temperature)
        want = [float(ref[p, t.tokens[p]]) for p in trained]
        np.testing.assert_allclose(t.teacher.sampled, want, atol=2e-4)
        ids = np.asarray(t.teacher.ids).reshape(len(trained), 5)
        lps = np.asarray(t.teacher.logprobs).reshape(len(trained), 5)
        top = torch.topk(ref[trained], 5, dim=-1)
        np.testing.assert_allclose(lps, top.values.numpy(), atol=2e-4)
        assert (ids[:, 0] == top.indices[:, 0].numpy()).all()
    batch = collate(groups, trainer.publisher.last_version)
    assert batch.teacher is not None
    assert int(batch.teacher.present.sum()) == sum(sum(t.mask) for t in trajs)


@pytest.mark.slow
def test_a_teacher_down_at_first_loses_nothing_and_lets_nothing_through(
    coordinator: CoordinatorServer, env: Any, bucket: LocalBucket, tok: Any
) -> None:
    teacher = TeacherServer(teacher_model(len(tok)))  # port bound, connections refused
    Trainer(bucket, coordinator, len(tok))
    settings = worker_settings(
        coordinator, env.url, teacher_url=teacher.url, teacher_token=TOKEN, submit_timeout_s=60.0
    )
    runner = WorkerThread(settings, bucket, tok, len(tok))
    try:
        with runner as worker:
            wait_for(lambda: worker.teacher_stats.waiting >= 2, 60, "no group waits")
            wait_for(lambda: worker.teacher_stats.requests_failed >= 1, 60, "no failure")
            assert worker.stats.submitted == 0  # nothing goes out without its teacher data
            waiting = worker.teacher_stats.waiting
            teacher.start()
            wait_for(lambda: worker.stats.submitted >= waiting + 1, 60, "the waiting groups")
            runner.stop()
    finally:
        teacher.close()
    assert worker.stats.dropped_timeout == 0 and worker.teacher_stats.missing == 0
    groups = drain_queue(coordinator)
    assert len(groups) == worker.stats.submitted
    assert all(t.teacher is not None for g in groups for t in g.trajectories)


def test_without_required_teacher_data_groups_go_through_and_are_counted(
    coordinator: CoordinatorServer, env: Any, bucket: LocalBucket, tok: Any
) -> None:
    teacher = TeacherServer(teacher_model(len(tok)))  # never served
    Trainer(bucket, coordinator, len(tok))
    settings = worker_settings(
        coordinator,
        env.url,
        teacher_url=teacher.url,
        teacher_token=TOKEN,
        teacher_required=False,
        submit_timeout_s=4.0,  # the client's budget is half of it
    )
    runner = WorkerThread(settings, bucket, tok, len(tok))
    try:
        with runner as worker:
            wait_for(lambda: worker.stats.submitted >= 2, 60, "no group submitted")
            runner.stop()
    finally:
        teacher.close()
    groups = drain_queue(coordinator)
    assert groups and all(t.teacher is None for g in groups for t in g.trajectories)
    stats = worker.teacher_stats
    assert stats.missing >= len(groups) and stats.requests_failed >= stats.missing
    text = worker.metrics.render().decode()
    assert f"deltarl_rollout_teacher_missing_groups_total {float(stats.missing)}" in text


def test_a_teacher_with_another_vocabulary_is_refused_at_start(
    coordinator: CoordinatorServer, env: Any, bucket: LocalBucket, tok: Any
) -> None:
    teacher = TeacherServer(teacher_model(len(tok) + 64)).start()
    Trainer(bucket, coordinator, len(tok))
    settings = worker_settings(coordinator, env.url, teacher_url=teacher.url, teacher_token=TOKEN)
    runner = WorkerThread(settings, bucket, tok, len(tok))
    try:
        runner.__enter__()
        runner.thread.join(30)
        assert not runner.thread.is_alive()
    finally:
        teacher.close()
    assert isinstance(runner.error, TeacherMismatch)
    assert "vocabulary of 49216 token ids, the policy 49152" in str(runner.error)
    assert runner.worker.stats.submitted == 0
