"""Helpers of the rollout worker tests: a live coordinator, a trainer publishing a tiny Llama,
and a worker running in a thread."""

from __future__ import annotations

import atexit
import json
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
import uvicorn
from support import fast_pacing

from deltarl.buckets.local import LocalBucket
from deltarl.rollout.engines.transformers_engine import TransformersEngine
from deltarl.rollout.service.worker import RolloutWorker
from deltarl.rollout.settings import MOVED, RolloutSettings, WorkerExperiment
from deltarl.rollout.sync.weights import WeightSync
from deltarl.services.common.tls import client_verify
from deltarl.services.coordinator.app import create_app
from deltarl.services.coordinator.client import CoordinatorClient
from deltarl.services.coordinator.settings import CoordinatorSettings
from deltarl.trainer.publish.weights import (
    WeightPublisher,
    coordinator_challenges,
    publishable_state,
)
from deltarl.trainer.settings import PublishSettings
from deltarl.weightsync.reader import BucketReader

TRAINER_TOKEN = "trainer-secret-token"
WORKER_TOKEN = "worker-secret-token"


class CoordinatorServer:
    """The real coordinator (embedded SQLite store) served by uvicorn in a thread."""

    def __init__(self, tmp: Path, *, tls: tuple[Path, Path, Path] | None = None, **overrides: Any):
        """``tls``: (CA bundle, certificate, key) to serve HTTPS with."""
        values: dict[str, Any] = {
            "sqlite_path": str(tmp / "coord.sqlite3"),
            "trainer_token": TRAINER_TOKEN,
            "worker_token": WORKER_TOKEN,
            "heartbeat_interval_s": 0.3,
        }
        values.update(overrides)
        self.app = create_app(CoordinatorSettings(**values), pacing=fast_pacing())
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        scheme = "http" if tls is None else "https"
        self.url = f"{scheme}://127.0.0.1:{self.sock.getsockname()[1]}"
        self.verify = True if tls is None else client_verify(tls[0])
        https: dict[str, Any] = {}
        if tls is not None:
            https = {"ssl_certfile": str(tls[1]), "ssl_keyfile": str(tls[2])}
        config = uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=1, **https)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> CoordinatorServer:
        self.thread.start()
        wait_for(lambda: self.server.started, 10, "the coordinator did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()

    def trainer(self) -> CoordinatorClient:
        return CoordinatorClient(self.url, TRAINER_TOKEN, verify=self.verify)


def wait_for(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def tiny_llama(vocab: int) -> transformers.LlamaConfig:
    """A one-layer random Llama over the real tokenizer's vocabulary (~3 M parameters)."""
    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )


def tiny_model(vocab: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model: torch.nn.Module = transformers.LlamaForCausalLM(tiny_llama(vocab))
    return model.to(torch.bfloat16)


class Trainer:
    """A tiny model whose versions go to the bucket and the coordinator (WeightPublisher)."""

    def __init__(self, bucket: LocalBucket, server: CoordinatorServer, vocab: int) -> None:
        self.model = tiny_model(vocab, seed=123)
        self.client = server.trainer()
        self.publisher = WeightPublisher(
            bucket,
            PublishSettings(background=False, anchor_every=0),
            register=self.client.publish_version,
            challenges=coordinator_challenges(self.client),
        )
        self.publish()

    def state(self) -> dict[str, torch.Tensor]:
        return publishable_state(self.model)

    def publish(self, *, anchor: bool = False) -> int:
        return self.publisher.publish(self.state(), anchor=anchor)

    def step(self, seed: int, *, anchor: bool = False) -> int:
        """Move ~2% of every tensor's elements (an optimizer step), then publish."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for t in self.state().values():
                mask = torch.rand(t.shape, generator=g) < 0.02
                t.add_(mask.to(t.dtype) * 0.01)
        return self.publish(anchor=anchor)

    def close(self) -> None:
        self.publisher.close()
        self.client.close()


def experiment_file(**flat: Any) -> Path:
    """A worker experiment file of ``flat`` settings, by their flat names (``group_size``,
    ``max_new_tokens``, ``hint_mode``, ``in_flight_groups``...: each goes to its place,
    :data:`~deltarl.rollout.settings.MOVED`)."""
    data: dict[str, Any] = {}
    for key, value in flat.items():
        path = MOVED.get(key, key)
        if key == "engine":
            path = "engine.type"
        node = data
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    WorkerExperiment.model_validate(data)  # a bad test setting fails here, named
    fd, name = tempfile.mkstemp(prefix="worker-experiment-", suffix=".json")
    os.close(fd)
    Path(name).write_text(json.dumps(data))
    atexit.register(Path(name).unlink, missing_ok=True)
    return Path(name)


def worker_settings(server: CoordinatorServer, env_url: str, **overrides: Any) -> RolloutSettings:
    """A worker's deployment against ``server`` and ``env_url``; experiment settings among
    ``overrides`` (flat names) go to its experiment file (``config``)."""
    values: dict[str, Any] = {
        "coordinator_url": server.url,
        "worker_token": WORKER_TOKEN,
        "env_url": env_url,
        "worker_id": "w-test",
        "heartbeat_interval_s": 0.2,
        "admission_wait_s": 0.05,
        "sync_poll_s": 0.5,
        "shutdown_grace_s": 5.0,
        "submit_timeout_s": 10.0,
    }
    flat: dict[str, Any] = {
        "group_size": 2,
        "max_turns": 2,
        "max_new_tokens": 4,
        "in_flight_groups": 2,
    }
    for key, value in overrides.items():
        if key in RolloutSettings.model_fields:
            values[key] = value
        else:
            flat[key] = value
    return RolloutSettings(**values, config=experiment_file(**flat))


class WorkerThread:
    """A :class:`RolloutWorker` on a tiny random model (not the trainer's weights) in a thread."""

    def __init__(
        self, settings: RolloutSettings, bucket: LocalBucket, tokenizer: Any, vocab: int
    ) -> None:
        engine = TransformersEngine(tiny_model(vocab, seed=7), seed=0)
        self.worker = RolloutWorker(
            settings, WeightSync(engine, BucketReader(bucket)), tokenizer, model_name="tiny"
        )
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.worker.run(handle_signals=False)
        except BaseException as exc:  # reported by stop()
            self.error = exc

    def __enter__(self) -> RolloutWorker:
        self.thread.start()
        return self.worker

    def stop(self, timeout: float = 15.0) -> None:
        self.worker.request_stop()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the worker did not stop"
        if self.error is not None:
            raise self.error

    def __exit__(self, *exc: object) -> None:
        if self.thread.is_alive():
            self.stop()
