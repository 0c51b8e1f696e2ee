"""Regression tests of a black-box security review: each test replays one attack against a live
coordinator and checks that it gets a clear 4xx (never a 5xx) and changes nothing."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import httpx
import msgpack
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from deltarl.cli import app
from deltarl.services.coordinator.schemas import WorkerHeartbeat, encode_group

from .conftest import TRAINER_TOKEN, WORKER_TOKEN, LiveServer, coordinator_settings
from .helpers import group, manifest
from .test_api import clients, error_of, reg

T = {"X-Deltarl-Token": TRAINER_TOKEN}
W = {"X-Deltarl-Token": WORKER_TOKEN}
HUGE = 2**63  # one past the largest SQLite INTEGER


# -- 1. integers past 64 bits ------------------------------------------------------------------
def _huge_requests(url: str) -> list[tuple[str, httpx.Response]]:
    """One request per integer input of the API, each carrying an integer >= 2**63."""
    published = manifest(1).model_dump(mode="json")
    payload = msgpack.unpackb(encode_group(group("huge-1")))
    payload["trajectories"][0]["version_max"] = HUGE
    post = httpx.post
    return [
        ("GET /versions/{v} (no token needed)", httpx.get(f"{url}/v1/versions/{HUGE}")),
        ("GET /versions?after", httpx.get(f"{url}/v1/versions", params={"after": HUGE})),
        ("GET /versions/events?after", httpx.get(f"{url}/v1/versions/events?after={HUGE}")),
        (
            "Last-Event-ID",
            httpx.get(f"{url}/v1/versions/events", headers={"Last-Event-ID": str(HUGE)}),
        ),
        ("GET /status?workers", httpx.get(f"{url}/v1/status", params={"workers": HUGE})),
        (
            "heartbeat in_flight",
            post(f"{url}/v1/workers/w1/heartbeat", json={"in_flight": HUGE}, headers=W),
        ),
        (
            "heartbeat applied_version",
            post(f"{url}/v1/workers/w1/heartbeat", json={"applied_version": HUGE}, headers=W),
        ),
        (
            "registration capacity",
            post(f"{url}/v1/workers", json={**reg().model_dump(), "capacity": HUGE}, headers=W),
        ),
        (
            "admission want",
            post(f"{url}/v1/admission", json={"worker_id": "w1", "want": HUGE}, headers=W),
        ),
        (
            "admission applied_version",
            post(
                f"{url}/v1/admission",
                json={"worker_id": "w1", "want": 1, "applied_version": HUGE},
                headers=W,
            ),
        ),
        ("lease max_groups", post(f"{url}/v1/batches/lease", json={"max_groups": HUGE}, headers=T)),
        *(
            (
                f"manifest {field}",
                post(
                    f"{url}/v1/versions", json={"manifest": {**published, field: HUGE}}, headers=T
                ),
            )
            for field in ("version", "step", "numel", "full_bytes")
        ),
        (
            "manifest object size",
            post(
                f"{url}/v1/versions",
                json={
                    "manifest": {
                        **published,
                        "objects": [{**published["objects"][0], "size": HUGE}],
                    }
                },
                headers=T,
            ),
        ),
        (
            "trajectory version_max",
            post(
                f"{url}/v1/trajectories",
                content=msgpack.packb(payload, use_bin_type=True),
                headers={**W, "Content-Type": "application/msgpack"},
            ),
        ),
    ]


def test_integers_past_64_bits_are_422_never_500(server: LiveServer) -> None:
    trainer, worker, anon = clients(server)
    trainer.publish_version(manifest(0))
    worker.register(reg())
    for what, r in _huge_requests(server.url):
        status, code, _ = error_of(r)
        assert status == 422 and code in {"validation_error", "bad_payload", "bad_event_id"}, (
            what,
            r.text,
        )
    st = anon.status()
    assert (st.latest_version, st.queue.depth, st.in_flight) == (0, 0, 0)
    assert [(w.worker_id, w.capacity, w.applied_version) for w in st.workers] == [("w1", 4, None)]


# -- 2. one worker's in_flight claim starves admission ------------------------------------------
def test_one_workers_in_flight_claim_cannot_stop_admission(server: LiveServer) -> None:
    trainer, worker, _ = clients(server)
    trainer.publish_version(manifest(0))
    worker.register(reg("greedy"))
    worker.register(reg("honest"))
    r = httpx.post(
        f"{server.url}/v1/workers/greedy/heartbeat",
        json={"applied_version": 0, "in_flight": 2**63 - 1},
        headers=W,
    )
    assert error_of(r)[:2] == (422, "validation_error") and "100000" in error_of(r)[2]
    with pytest.raises(ValidationError, match="100000"):
        WorkerHeartbeat(in_flight=100_001)
    # the largest claim allowed still leaves every other worker its fair share of the budget
    worker.heartbeat("greedy", WorkerHeartbeat(applied_version=0, in_flight=100_000))
    a = worker.admission("honest", 5, applied_version=0)
    assert (a.grant, a.reason, a.in_flight) == (5, "ok", 100_000)
    a = worker.admission("greedy", 5, applied_version=0)
    assert (a.grant, a.reason) == (0, "queue_full")


# -- 3. admission skipped the heartbeat's checks ------------------------------------------------
def test_admission_refuses_what_a_heartbeat_refuses(server: LiveServer) -> None:
    trainer, worker, _ = clients(server)
    trainer.publish_version(manifest(0))
    url = server.url
    future = {"worker_id": "ghost", "want": 5, "applied_version": 999_999}
    assert error_of(httpx.post(f"{url}/v1/admission", json=future, headers=W))[:2] == (
        409,
        "future_version",
    )
    ghost = {"worker_id": "ghost", "want": 5, "applied_version": 0}
    assert error_of(httpx.post(f"{url}/v1/admission", json=ghost, headers=W))[:2] == (
        404,
        "unknown_worker",
    )
    worker.register(reg())
    for path, body in (
        ("/v1/admission", {**future, "worker_id": "w1"}),
        ("/v1/workers/w1/heartbeat", {"applied_version": 999_999}),
    ):
        assert error_of(httpx.post(url + path, json=body, headers=W))[:2] == (
            409,
            "future_version",
        )
    assert worker.admission("w1", 5, applied_version=0).grant == 5


# -- 4. worker ids that are not path-safe ------------------------------------------------------
def test_worker_ids_are_path_safe(server: LiveServer) -> None:
    _, worker, anon = clients(server)
    for bad in ("a/b", "../w1", "w 1", "w%2F1", "/w1"):
        r = httpx.post(
            f"{server.url}/v1/workers", json={**reg().model_dump(), "worker_id": bad}, headers=W
        )
        assert error_of(r)[:2] == (422, "validation_error"), bad
    odd = "Node-7.gpu_0:a@b"  # every allowed character: usable in every per-worker route
    worker.register(reg(odd))
    assert worker.heartbeat(odd, WorkerHeartbeat(in_flight=1)).worker.in_flight == 1
    assert anon.worker(odd).worker_id == odd
    worker.remove_worker(odd)
    assert anon.workers() == []


# -- 10. weak tokens -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ({"trainer_token": "t"}, "TRAINER_TOKEN needs at least 16"),
        ({"worker_token": "w" * 15}, "WORKER_TOKEN needs at least 16"),
        ({"trainer_token": " " * 20}, "TRAINER_TOKEN is blank"),
        ({"worker_token": "\t\n"}, "WORKER_TOKEN is blank"),
        ({"worker_token": " " + WORKER_TOKEN}, "WORKER_TOKEN needs"),  # headers drop the space
        ({"read_token": "read-token-with-é-inside"}, "READ_TOKEN needs"),
        ({"read_token": "short"}, "READ_TOKEN needs at least 16"),
        ({"worker_key": "k" * 15}, "WORKER_KEY needs at least 16"),
        ({"worker_key": TRAINER_TOKEN}, "trainer token and the worker key must differ"),
    ],
)
def test_weak_tokens_are_refused_at_start(
    tmp_path: Path, tokens: dict[str, str], message: str
) -> None:
    with pytest.raises(ValidationError, match=message) as e:
        coordinator_settings(tmp_path, **tokens)
    assert "input_value" not in str(e.value)  # the refused token is not echoed


def test_insecure_mode_still_refuses_blank_tokens(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="WORKER_TOKEN is blank"):
        coordinator_settings(tmp_path, insecure=True, trainer_token=None, worker_token="  ")
    # empty is unset (as in the env server): an open role, allowed in insecure mode only
    settings = coordinator_settings(tmp_path, insecure=True, trainer_token="", worker_token="")
    assert (settings.trainer_token, settings.worker_token) == (None, None)  # type: ignore[attr-defined]
    with pytest.raises(ValidationError, match="DELTARL_COORDINATOR_TRAINER_TOKEN and"):
        coordinator_settings(tmp_path, trainer_token="")


def test_cli_refuses_a_one_character_token(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    def serve(*_: object, **__: object) -> None:
        raise AssertionError("the coordinator started with a one-character token")

    monkeypatch.setattr(uvicorn, "run", serve)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTARL_COORDINATOR_")}
    env |= {"DELTARL_COORDINATOR_TRAINER_TOKEN": "x", "DELTARL_COORDINATOR_WORKER_TOKEN": "y" * 20}
    result = CliRunner().invoke(app, ["coordinator", "--port", "1"], env=env)
    assert result.exit_code == 2, result.exception  # typer's bad-parameter exit, not a start
    assert "DELTARL_COORDINATOR_TRAINER_TOKEN needs at least 16" in " ".join(result.output.split())


# -- 11. the error contract ---------------------------------------------------------------------
def test_non_utf8_and_unparsable_json_bodies_are_422(server: LiveServer) -> None:
    json_w = {**W, "Content-Type": "application/json"}
    for body in (
        b'{"worker_id": "\xff\xfe", "engine": "x", "model": "m", "capacity": 1}',
        b"[" * 100_000,  # deeper than the JSON decoder's recursion limit
        b'{"capacity": ' + b"9" * 5000 + b"}",  # more digits than int() converts
    ):
        r = httpx.post(f"{server.url}/v1/workers", content=body, headers=json_w)
        status, code, message = error_of(r)
        assert (status, code) == (422, "validation_error") and "not valid JSON" in message
        assert r.json()["error"]["detail"][0]["type"] == "json_invalid"


def test_chunked_json_over_the_limit_is_413(make_server: Callable[..., LiveServer]) -> None:
    s = make_server()  # max_json_bytes: 1 MiB
    body = b'{"worker_id": "w1", "pad": "' + b"y" * (1 << 20) + b'"}'
    r = httpx.post(
        f"{s.url}/v1/workers",
        content=iter([body[: 1 << 19], body[1 << 19 :]]),  # no Content-Length: chunked
        headers={**W, "Content-Type": "application/json"},
    )
    assert "content-length" not in r.request.headers
    assert error_of(r) == (413, "body_too_large", "request body exceeds 1048576 bytes")
    assert r.json()["error"]["detail"] is None


def test_405_names_the_allowed_methods(server: LiveServer) -> None:
    for method, path, allow in (
        ("PUT", "/v1/workers", "GET, POST"),
        ("PATCH", "/v1/workers/w1", "DELETE, GET"),
        ("GET", "/v1/admission", "POST"),  # was a 404 from the status page's static files
        ("DELETE", "/v1/versions/3", "GET"),
        ("POST", "/v1/status", "GET"),
        ("POST", "/index.html", "GET, HEAD"),  # the status page itself
    ):
        r = httpx.request(method, server.url + path, headers=W)
        assert error_of(r)[:2] == (405, "method_not_allowed"), (method, path)
        assert r.headers["allow"] == allow, (method, path)


# -- per-worker tokens whatever the body's Content-Type ----------------------------------------
WORKER_KEY = "worker-key-for-the-content-type-tests"
# Every spelling FastAPI (or a lenient client) may read as JSON, and a few it reads as bytes.
CONTENT_TYPES: list[list[tuple[str, str]]] = [
    [("Content-Type", ctype)]
    for ctype in (
        "application/json",
        "application/x+json",
        "application/vnd.deltarl+json",
        "application/problem+json; charset=utf-8",
        "application/json; charset=utf-8",
        "Application/JSON",
        "application/json ;charset=utf-8",
        "application/json,text/plain",
        "application/x-json",
        "text/json",
        "text/plain",
        "application/octet-stream",
        "application/x-www-form-urlencoded",
        "application/msgpack",
    )
] + [
    [],  # no Content-Type at all
    [("Content-Type", "application/x+json"), ("Content-Type", "application/msgpack")],
    [("Content-Type", "application/msgpack"), ("Content-Type", "application/x+json")],
]


@pytest.mark.slow
def test_a_worker_token_cannot_act_for_another_worker_by_any_content_type(
    make_server: Callable[..., LiveServer],
) -> None:
    """Register and admission name their worker in the JSON body: a per-worker token must not
    act for another worker by a Content-Type that FastAPI parses as JSON but a check keyed on
    ``application/json`` skips (re-registering w2 wiped its applied version and proofs; fake ids
    shrank every worker's admission share). Every write route that carries a worker id is tried
    with every Content-Type: refused, and nothing changes."""
    import json

    from deltarl.services.coordinator.auth import worker_token_for
    from deltarl.services.coordinator.client import CoordinatorClient

    s = make_server(worker_key=WORKER_KEY)
    url = s.url
    CoordinatorClient(url, TRAINER_TOKEN, retries=0).publish_version(manifest(0))
    w1_token, w2_token = (worker_token_for(WORKER_KEY, w) for w in ("w1", "w2"))
    w1, w2 = (CoordinatorClient(url, t, retries=0) for t in (w1_token, w2_token))
    w1.register(reg("w1"))
    w2.register(reg("w2"))
    w2.heartbeat("w2", WorkerHeartbeat(applied_version=0))
    before = w2.worker("w2")
    assert before.applied_version == 0

    as_w2 = json.dumps({**reg("w2").model_dump(), "capacity": 1}).encode()
    bodies = {
        "/v1/workers": as_w2,
        "/v1/admission": json.dumps({"worker_id": "w3", "want": 5, "applied_version": 0}).encode(),
        "/v1/workers/w2/heartbeat": json.dumps({"applied_version": None}).encode(),
        "/v1/workers/w2/proof": json.dumps(
            {"nonce": "a" * 64, "answer": "b" * 64, "version": 0}
        ).encode(),
        "/v1/trajectories": encode_group(group("k-w2", worker="w2")),
    }
    for path, body in bodies.items():
        for ctype in CONTENT_TYPES:
            headers = [("X-Deltarl-Token", w1_token), *ctype]
            r = httpx.post(url + path, content=body, headers=headers)
            assert r.status_code in (403, 415, 422), (path, ctype, r.status_code, r.text)
            if r.status_code == 403:
                assert "belongs to worker 'w1'" in r.json()["error"]["message"], (path, ctype)
        r = httpx.delete(f"{url}/v1/workers/w2", headers={"X-Deltarl-Token": w1_token})
        assert r.status_code == 403

    after = w2.worker("w2")
    assert after.applied_version == 0 and after.capacity == before.capacity  # not re-registered
    assert after.registered_at == before.registered_at
    assert sorted(w.worker_id for w in w2.workers()) == ["w1", "w2"]  # no fake admission id
    assert w2.status().queue.submitted_total == 0  # no group submitted as w2
    # the worker itself, with the same content types: what FastAPI reads as JSON is accepted
    ok = httpx.post(
        f"{url}/v1/workers",
        content=json.dumps(reg("w1").model_dump()).encode(),
        headers={"X-Deltarl-Token": w1_token, "Content-Type": "application/x+json"},
    )
    assert ok.status_code == 200, ok.text


def test_a_json_body_without_a_json_content_type_gets_the_json_limit(server: LiveServer) -> None:
    """Only a msgpack body (trajectory groups) may use the larger body limit: a body FastAPI
    may parse as JSON cannot get it by leaving out or doubling its Content-Type."""
    body = b'{"worker_id": "w1", "pad": "' + b"y" * (1 << 20) + b'"}'
    for ctype in (
        [],
        [("Content-Type", "application/x+json")],
        [("Content-Type", "application/json"), ("Content-Type", "application/msgpack")],
        [("Content-Type", "text/plain")],
    ):
        r = httpx.post(f"{server.url}/v1/workers", content=body, headers=[*W.items(), *ctype])
        assert error_of(r)[:2] == (413, "body_too_large"), ctype


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        ({"worker_token": None, "worker_key": WORKER_KEY}, []),
        ({}, []),
        (
            {"trainer_token": None, "worker_token": None, "worker_key": WORKER_KEY},
            ["no trainer token: anyone can publish versions and lease batches"],
        ),
        (
            {"worker_token": None},
            ["no worker token or worker key: anyone can register, heartbeat and submit"],
        ),
        (
            {"trainer_token": None, "worker_token": None},
            ["no trainer token", "no worker token or worker key"],
        ),
    ],
)
def test_the_start_log_names_exactly_the_open_roles(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    tokens: dict[str, object],
    expected: list[str],
) -> None:
    """Per-worker credentials alone (no shared worker token) are not insecure mode: nothing is
    logged when every write role is protected, and each open role is named otherwise."""
    import logging

    from fastapi.testclient import TestClient

    from deltarl.services.coordinator.app import create_app

    settings = coordinator_settings(tmp_path, insecure=True, **tokens)
    with (
        caplog.at_level(logging.WARNING, logger="deltarl.services.coordinator"),
        TestClient(create_app(settings)),  # type: ignore[arg-type]
    ):
        pass
    lines = [
        r.getMessage() for r in caplog.records if r.name.startswith("deltarl.services.coordinator")
    ]
    assert len(lines) == len(expected), lines
    for line, want in zip(lines, expected, strict=True):
        assert line.startswith("insecure mode: " + want), line
