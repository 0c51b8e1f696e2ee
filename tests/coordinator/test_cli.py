"""``deltarl coordinator`` / ``deltarl status`` / ``python -m deltarl.services.coordinator``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from deltarl.cli import app
from deltarl.services.coordinator.client import CoordinatorClient
from deltarl.services.coordinator.schemas import WorkerHeartbeat, WorkerRegistration

from .conftest import TRAINER_TOKEN, WORKER_TOKEN, LiveServer, free_port
from .helpers import manifest


def test_help_lists_every_setting() -> None:
    from deltarl.services.coordinator.settings import CoordinatorSettings

    result = CliRunner().invoke(app, ["coordinator", "--help"], terminal_width=200)
    assert result.exit_code == 0
    for name in CoordinatorSettings.model_fields:
        assert f"DELTARL_COORDINATOR_{name.upper()}" in result.output
    assert "--host" in result.output and "--port" in result.output


def test_refuses_to_start_without_tokens(monkeypatch: object) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTARL_COORDINATOR_")}
    result = CliRunner().invoke(app, ["coordinator", "--port", "1"], env=env)
    assert result.exit_code != 0
    assert "DELTARL_COORDINATOR_TRAINER_TOKEN" in result.output


def test_status_command(server: LiveServer) -> None:
    CoordinatorClient(server.url, TRAINER_TOKEN).publish_version(manifest(0))
    w = CoordinatorClient(server.url, WORKER_TOKEN)
    w.register(WorkerRegistration(worker_id="gpu-7", engine="vllm", model="m", capacity=2))
    w.heartbeat("gpu-7", WorkerHeartbeat(applied_version=0, last_error="oom once"))
    result = CliRunner().invoke(app, ["status", server.url], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for text in ("latest version", "gpu-7", "oom once", "anchor", "48.8 KiB"):
        assert text in result.output
    as_json = CliRunner().invoke(app, ["status", server.url, "--json"])
    assert '"latest_version": 0' in as_json.output
    down = CliRunner().invoke(app, ["status", f"http://127.0.0.1:{free_port()}"])
    assert down.exit_code != 0 and "cannot reach" in down.output


@pytest.mark.slow
def test_python_m_runs_the_service_with_two_workers(tmp_path: Path) -> None:
    port = free_port()
    env = {
        **os.environ,
        "DELTARL_COORDINATOR_INSECURE": "1",
        "DELTARL_COORDINATOR_SQLITE_PATH": str(tmp_path / "db.sqlite3"),
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deltarl.services.coordinator",
            "--port",
            str(port),
            "--workers",
            "2",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        assert r.json()["status"] == "healthy"
        for _ in range(10):  # both worker processes answer (the kernel spreads connections)
            assert httpx.get(f"http://127.0.0.1:{port}/v1/status", timeout=5).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=10)
