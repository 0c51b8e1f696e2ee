"""The rollout worker's GET /health and GET /metrics (rollout/service/http.py, rollout/service/metrics.py)."""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
from episode_helpers import WordleServer
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from tls_helpers import make_ca_and_server_cert
from typer.testing import CliRunner
from worker_helpers import CoordinatorServer, Trainer, WorkerThread, wait_for, worker_settings

from deltarl.buckets.local import LocalBucket
from deltarl.cli import app
from deltarl.rollout.service.http import BindError, WorkerHttpServer
from deltarl.rollout.settings import DEFAULT_PORT, RolloutSettings
from deltarl.services.common.tls import client_verify

pytestmark = [pytest.mark.network, pytest.mark.slow]


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of GET /metrics, parsed: (name, sorted labels) -> value."""
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def test_health_is_503_until_the_first_anchor_and_metrics_follow_the_work(
    coordinator: CoordinatorServer, env: WordleServer, bucket: LocalBucket, tok: Any
) -> None:
    settings = worker_settings(coordinator, env.url, worker_id="w-http", port=0)
    runner = WorkerThread(settings, bucket, tok, len(tok))
    with runner as worker:
        url = wait_for(lambda: worker.http.url, 10, "the HTTP server did not start")
        r = httpx.get(url + "/health")  # nothing published yet: no weights
        assert r.status_code == 503
        body = r.json()
        assert body["status"] == "starting" and body["healthy"] is False
        assert body["worker_id"] == "w-http" and body["version"] is None
        assert "no weights" in body["reason"]
        m = scrape(url)
        assert value(m, "deltarl_rollout_weights_healthy") == 0
        assert value(m, "deltarl_rollout_weights_version") == -1
        assert total(m, "deltarl_rollout_episodes_total") == 0

        trainer = Trainer(bucket, coordinator, len(tok))  # publishes v0 with its anchor
        try:
            wait_for(lambda: httpx.get(url + "/health").status_code == 200, 20, "never healthy")
            body = httpx.get(url + "/health").json()
            assert body["status"] == "ok" and body["healthy"] is True and body["reason"] == "ok"
            assert body["version"] == 0 and body["in_flight_groups"] >= 0
            wait_for(lambda: worker.stats.submitted >= 2, 20, "no group submitted at v0")
            before = scrape(url)
            v1 = trainer.step(seed=1)
            wait_for(lambda: worker.sync.version == v1, 10, "v1 did not arrive")
            submitted = worker.stats.submitted
            wait_for(lambda: worker.stats.submitted >= submitted + 2, 20, "nothing at v1")
            after = scrape(url)
        finally:
            trainer.close()
        assert httpx.get(url + "/health").json()["version"] == v1
        runner.stop()

    episodes = total(after, "deltarl_rollout_episodes_total")
    assert episodes > total(before, "deltarl_rollout_episodes_total") >= 2 * 2  # group_size 2
    assert value(after, "deltarl_rollout_episode_reward_count") == episodes
    assert value(after, "deltarl_rollout_tokens_generated_total") > value(
        before, "deltarl_rollout_tokens_generated_total"
    )
    assert value(after, "deltarl_rollout_generate_seconds_count") > 0
    assert value(after, "deltarl_rollout_groups_started_total") >= value(
        after, "deltarl_rollout_groups_submitted_total"
    )
    accepted = value(after, "deltarl_rollout_groups_submitted_total")
    assert accepted > value(before, "deltarl_rollout_groups_submitted_total") >= 2
    assert value(after, "deltarl_rollout_submitted_staleness_versions_count") == accepted
    assert value(after, "deltarl_rollout_groups_dropped_total", reason="rejected") == 0
    # the anchor, then v1's delta through the follower
    assert value(after, "deltarl_rollout_weight_updates_total", kind="anchor") == 1
    assert value(after, "deltarl_rollout_weight_updates_total", kind="delta") == 1
    assert value(after, "deltarl_rollout_weight_update_bytes_total", kind="delta") > 0
    assert value(after, "deltarl_rollout_weight_pause_seconds_count", kind="delta") == 1
    assert value(after, "deltarl_rollout_weight_phase_seconds_count", kind="delta", phase="decode")
    assert value(after, "deltarl_rollout_weight_publish_to_applied_seconds_count", kind="anchor")
    assert value(after, "deltarl_rollout_weight_syncs_total", result="ok") >= 2  # + no-ops
    assert value(after, "deltarl_rollout_weight_syncs_total", result="failed") == 0
    assert value(after, "deltarl_rollout_weights_version") == v1
    assert value(after, "deltarl_rollout_weights_verified_version") == v1
    assert value(after, "deltarl_rollout_weights_healthy") == 1
    info = value(
        after,
        "deltarl_rollout_worker_info",
        worker_id="w-http",
        engine="transformers",
        model="tiny",
    )
    assert info == 1
    with pytest.raises(httpx.ConnectError):  # the port closed with the worker
        httpx.get(url + "/health")


def test_a_taken_default_port_falls_back_and_a_taken_explicit_port_stops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def start(settings: RolloutSettings) -> int | None:
        server = WorkerHttpServer(FastAPI(), settings)
        await server.start()
        port = server.port
        await server.stop()
        return port

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(BindError, match=f"127.0.0.1:{port}"):
            asyncio.run(start(RolloutSettings(port=port)))
        as_default = RolloutSettings.model_construct(_fields_set=set(), port=port)
        with caplog.at_level(logging.WARNING, logger="deltarl.rollout.service.http"):
            got = asyncio.run(start(as_default))
        assert got not in (None, 0, port)
        assert f"port {port} is taken" in caplog.text


def test_serves_https_with_the_tls_settings(tmp_path: Path) -> None:
    ca, cert, key = make_ca_and_server_cert(tmp_path)
    settings = RolloutSettings(port=0, tls_certfile=cert, tls_keyfile=key)

    async def get() -> int:
        server = WorkerHttpServer(FastAPI(), settings)
        await server.start()
        try:
            assert server.url is not None and server.url.startswith("https://127.0.0.1:")
            async with httpx.AsyncClient(verify=client_verify(ca)) as client:
                return (await client.get(server.url + "/nothing")).status_code
        finally:
            await server.stop()

    assert asyncio.run(get()) == 404  # a TLS handshake with the CA's certificate, then FastAPI


def test_help_lists_host_port_and_their_variables() -> None:
    result = CliRunner().invoke(app, ["rollout", "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0
    for text in (
        "--host",
        "--port",
        "DELTARL_ROLLOUT_HOST",
        f"DELTARL_ROLLOUT_PORT (default {DEFAULT_PORT})",
        "DELTARL_ROLLOUT_TLS_CERTFILE",
        "/health",
        "/metrics",
    ):
        assert text in result.output
    bad = CliRunner().invoke(app, ["rollout", "--port", "70000"], env={"COLUMNS": "300"})
    assert bad.exit_code != 0
