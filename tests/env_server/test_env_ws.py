"""WS /ws: OpenEnv message types and error codes, one session per connection."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from openenv.core.env_server import types as oe

from deltarl.env_server.models import ErrorCode


def send(ws: Any, message: Any) -> dict[str, Any]:
    ws.send_text(message if isinstance(message, str) else json.dumps(message))
    return json.loads(ws.receive_text())


def error_code(reply: dict[str, Any]) -> str:
    assert reply["type"] == "error", reply
    assert reply["data"]["message"]
    return str(reply["data"]["code"])


def test_ws_full_game_matches_openenv_types(client: TestClient) -> None:
    with client.websocket_connect("/ws") as ws:
        reply = send(ws, {"type": "reset", "data": {"seed": 1}})
        assert reply["type"] == "observation"
        oe.WSObservationResponse.model_validate(reply)
        oe.ResetResponse.model_validate(reply["data"])  # extra="forbid": exactly OpenEnv's shape
        assert reply["data"]["observation"]["answer"] is None
        reply = send(ws, {"type": "step", "data": {"message": "[crane]"}})
        oe.StepResponse.model_validate(reply["data"])
        assert reply["data"]["observation"]["history"] == [{"word": "crane", "pattern": "GYYXX"}]
        state = send(ws, {"type": "state"})
        assert state["type"] == "state"
        oe.State.model_validate(state["data"])
        assert state["data"]["step_count"] == 1 and state["data"]["answer"] is None
        reply = send(ws, {"type": "step", "data": {"message": "[cobra]", "metadata": {}}})
        assert reply["data"]["done"] is True and reply["data"]["reward"] == 1.0
        assert error_code(send(ws, {"type": "step", "data": {"message": "[cobra]"}})) == "GAME_OVER"
        reply = send(ws, {"type": "reset", "data": {"seed": 2}})  # play again on the same socket
        assert reply["data"]["observation"]["history"] == []
        ws.send_text(json.dumps({"type": "close"}))
    assert len(client.app.state.store) == 0  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("{oops", ErrorCode.INVALID_JSON),
        ("", ErrorCode.INVALID_JSON),
        ("[1, 2]", ErrorCode.VALIDATION_ERROR),
        ('"reset"', ErrorCode.VALIDATION_ERROR),
        ({"type": "dance"}, ErrorCode.UNKNOWN_TYPE),
        ({"data": {}}, ErrorCode.UNKNOWN_TYPE),
        ({"type": "step"}, ErrorCode.VALIDATION_ERROR),
        ({"type": "step", "data": {"msg": "[crane]"}}, ErrorCode.VALIDATION_ERROR),
        ({"type": "step", "data": {"message": None}}, ErrorCode.VALIDATION_ERROR),
        ({"type": "reset", "data": {"seed": -5}}, ErrorCode.VALIDATION_ERROR),
        ({"type": "reset", "data": [1]}, ErrorCode.VALIDATION_ERROR),
        ({"type": "step", "data": {"message": "x" * 40_000}}, ErrorCode.PAYLOAD_TOO_LARGE),
        ("x" * 300_000, ErrorCode.PAYLOAD_TOO_LARGE),
    ],
)
def test_ws_errors_keep_the_connection(client: TestClient, message: Any, code: ErrorCode) -> None:
    with client.websocket_connect("/ws") as ws:
        assert error_code(send(ws, message)) == code
        assert send(ws, {"type": "reset", "data": {"seed": 1}})["type"] == "observation"


def test_ws_step_or_state_before_reset(client: TestClient) -> None:
    with client.websocket_connect("/ws") as ws:
        assert (
            error_code(send(ws, {"type": "step", "data": {"message": "[crane]"}})) == "NOT_STARTED"
        )
        state = send(ws, {"type": "state"})
        assert state["type"] == "state" and state["data"]["episode_id"] is None


def test_ws_binary_frames(client: TestClient) -> None:
    with client.websocket_connect("/ws") as ws:
        ws.send_bytes(json.dumps({"type": "reset", "data": {"seed": 1}}).encode())
        assert json.loads(ws.receive_text())["type"] == "observation"
        ws.send_bytes(b"\xff\xfe")
        assert error_code(json.loads(ws.receive_text())) == "INVALID_JSON"


def test_ws_sessions_count_and_free(make_client: Callable[..., TestClient]) -> None:
    client = make_client(max_sessions=3)
    store = client.app.state.store  # type: ignore[attr-defined]
    with client.websocket_connect("/ws") as a, client.websocket_connect("/ws") as b:
        send(a, {"type": "reset", "data": {"seed": 1}})
        send(b, {"type": "reset", "data": {"seed": 1}})
        assert store.count("ws") == 2
        # WS sessions are not reachable over HTTP
        assert client.post("/reset").status_code == 200
        assert client.post("/reset").status_code == 503
    assert store.count("ws") == 0
