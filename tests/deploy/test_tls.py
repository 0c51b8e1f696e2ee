"""HTTPS end to end with a throwaway CA: the coordinator and the env server serve TLS themselves
(certificate and key settings), and the typed clients verify the certificate against a custom CA
bundle; without that CA the connection is refused."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from support import free_port
from tls_helpers import make_ca_and_server_cert

from deltarl.env_server.core.client import SyncEnvClient
from deltarl.services.common.tls import client_verify
from deltarl.services.coordinator.client import CoordinatorClient
from deltarl.services.coordinator.schemas import WorkerHeartbeat, WorkerRegistration

WORKER_TOKEN = "worker-token-0123456789abcdef"
TRAINER_TOKEN = "trainer-token-0123456789abcdef"


def start(args: list[str], env: dict[str, str], url: str, ca: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltarl", *args],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{args[0]} exited: {proc.stderr.read().decode() if proc.stderr else ''}"
            )
        try:
            if httpx.get(f"{url}/health", verify=client_verify(ca), timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{args[0]} did not come up over HTTPS")


@pytest.fixture
def tls_services(tmp_path: Path):
    ca, cert, key = make_ca_and_server_cert(tmp_path)
    cport, eport = free_port(), free_port()
    curl, eurl = f"https://127.0.0.1:{cport}", f"https://localhost:{eport}"
    coord = start(
        ["coordinator", "--port", str(cport)],
        {
            "DELTARL_COORDINATOR_TLS_CERTFILE": str(cert),
            "DELTARL_COORDINATOR_TLS_KEYFILE": str(key),
            "DELTARL_COORDINATOR_SQLITE_PATH": str(tmp_path / "c.sqlite3"),
            "DELTARL_COORDINATOR_TRAINER_TOKEN": TRAINER_TOKEN,
            "DELTARL_COORDINATOR_WORKER_TOKEN": WORKER_TOKEN,
        },
        curl,
        ca,
    )
    try:
        env = start(
            ["env", "--port", str(eport)],
            {"DELTARL_ENV_TLS_CERTFILE": str(cert), "DELTARL_ENV_TLS_KEYFILE": str(key)},
            eurl,
            ca,
        )
    except Exception:
        coord.kill()
        raise
    yield ca, curl, eurl
    for p in (coord, env):
        p.terminate()
        p.wait(10)


@pytest.mark.slow
def test_whole_path_over_tls_with_a_custom_ca(tls_services, monkeypatch) -> None:
    ca, curl, eurl = tls_services
    # the CA bundle setting reaches every client through the environment
    monkeypatch.setenv("DELTARL_CA_BUNDLE", str(ca))
    with CoordinatorClient(curl, WORKER_TOKEN) as worker:
        ack = worker.register(
            WorkerRegistration(worker_id="w-tls", engine="transformers", model="tiny", capacity=1)
        )
        assert ack is not None
        worker.heartbeat("w-tls", WorkerHeartbeat(applied_version=None, in_flight=0))
        assert any(w.worker_id == "w-tls" for w in worker.workers())
    with SyncEnvClient(eurl) as env:
        first = env.reset(seed=1)
        result = env.step(first.session_id, "[crane]")
        assert result.session_id == first.session_id


@pytest.mark.slow
def test_clients_refuse_a_certificate_they_cannot_verify(tls_services, monkeypatch) -> None:
    _, curl, eurl = tls_services
    monkeypatch.delenv("DELTARL_CA_BUNDLE", raising=False)
    with CoordinatorClient(curl, WORKER_TOKEN, retries=0) as c, pytest.raises(httpx.ConnectError):
        c.health()
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{eurl}/health")


def test_half_configured_tls_is_refused(tmp_path: Path) -> None:
    _, cert, _ = make_ca_and_server_cert(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "deltarl", "env", "--port", str(free_port())],
        env={**os.environ, "DELTARL_ENV_TLS_CERTFILE": str(cert)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "tls_keyfile" in (r.stderr + r.stdout)


def test_missing_ca_bundle_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        client_verify(tmp_path / "nope.pem")
