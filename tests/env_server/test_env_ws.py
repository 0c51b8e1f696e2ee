"""WS /ws: OpenEnv message types and error codes, one session per connection; hostile frames
(deep nesting) and clients that vanish mid-connection against a live server."""

from __future__ import annotations

import base64
import json
import logging
import os
import select
import socket
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import websockets.sync.client as ws_client
from env_helpers import settings
from fastapi.testclient import TestClient
from openenv.core.env_server import types as oe
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from support import LiveServer

from deltarl.env_server.core.app import create_app
from deltarl.env_server.core.models import ErrorCode
from deltarl.env_server.wordle.environment import WordleEnvironment


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
        ('{"type": "step", "data": {"message": "[crane]\\ud800"}}', ErrorCode.INVALID_JSON),
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


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("depth", [202, 1000, 100_000])  # just over the limit; the report's; 200 KB
@pytest.mark.parametrize(
    "frame",
    [
        "@",
        '{"type": @}',
        '{"type": "step", "data": @}',
        '{"type": "step", "data": {"message": @}}',
        '{"type": "step", "data": {"message": "[slate]", "metadata": {"a": @}}}',
        '{"type": "reset", "data": {"seed": @}}',
    ],
)
def test_ws_deeply_nested_frame_keeps_the_session(
    client: TestClient, frame: str, depth: int
) -> None:
    """A frame nested deeper than 200 levels (anywhere) is INVALID_JSON; it used to raise
    RecursionError, which closed the socket (code 1000, no answer) and lost the session."""
    with client.websocket_connect("/ws") as ws:
        send(ws, {"type": "reset", "data": {"seed": 1}})
        send(ws, {"type": "step", "data": {"message": "[crane]"}})
        assert error_code(send(ws, frame.replace("@", nested(depth)))) == "INVALID_JSON"
        reply = send(ws, {"type": "step", "data": {"message": "[slate]"}})
        history = reply["data"]["observation"]["history"]
        assert [h["word"] for h in history] == ["crane", "slate"]  # the same game goes on
        assert send(ws, {"type": "state"})["data"]["step_count"] == 2


def test_ws_nesting_up_to_200_levels_is_json(client: TestClient) -> None:
    with client.websocket_connect("/ws") as ws:
        assert error_code(send(ws, nested(200))) == "VALIDATION_ERROR"  # parsed: not an object
        deep_objects = '{"a":' * 200 + "1" + "}" * 200
        assert error_code(send(ws, deep_objects)) == "UNKNOWN_TYPE"
        assert error_code(send(ws, '{"a":' * 201 + "1" + "}" * 201)) == "INVALID_JSON"


def test_ws_bug_is_answered_and_logged(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug while handling a frame (here a RuntimeError, the class RecursionError belongs to) is
    answered INTERNAL_ERROR and logged with its traceback; the connection stays open."""

    def broken_step(self: WordleEnvironment, message: str) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(WordleEnvironment, "step", broken_step)
    with client.websocket_connect("/ws") as ws:
        send(ws, {"type": "reset", "data": {"seed": 1}})
        assert error_code(send(ws, {"type": "step", "data": {"message": "[crane]"}})) == (
            "INTERNAL_ERROR"
        )
        assert send(ws, {"type": "state"})["data"]["step_count"] == 0
    [record] = [r for r in caplog.records if r.exc_info]
    assert record.exc_info is not None and record.exc_info[0] is RuntimeError


# --- live server: the report's frame, clients that vanish ----------------------------------


def ws_url(server: LiveServer) -> str:
    return server.url.replace("http", "ws") + "/ws"


@pytest.mark.network
def test_ws_deeply_nested_frame_on_a_live_server(live_server: Callable[..., LiveServer]) -> None:
    """The report's reproduction: 2 KB of brackets nested 1000 deep, over uvicorn."""
    with ws_client.connect(ws_url(live_server())) as ws:
        ws.send(json.dumps({"type": "reset", "data": {"seed": 1}}))
        ws.recv(timeout=5)
        ws.send(nested(1000))
        assert error_code(json.loads(ws.recv(timeout=5))) == "INVALID_JSON"
        ws.send(json.dumps({"type": "step", "data": {"message": "[crane]"}}))
        assert json.loads(ws.recv(timeout=5))["data"]["observation"]["history"][0]["word"] == (
            "crane"
        )


class FailedSends:
    """ASGI middleware recording the sends that failed because the client was gone (uvicorn
    raises ``ClientDisconnected``, an ``OSError``): proof that a test hit that path."""

    def __init__(self, app: ASGIApp, failed: list[str]) -> None:
        self.app = app
        self.failed = failed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def spy(message: Message) -> None:
            try:
                await send(message)
            except OSError:
                self.failed.append(message["type"])
                raise

        await self.app(scope, receive, spy)


def masked_frame(text: str) -> bytes:
    """A client text frame (masked with zeros, as RFC 6455 requires of clients)."""
    data = text.encode()
    size = bytes([0x80 | len(data)]) if len(data) < 126 else b"\xfe" + struct.pack("!H", len(data))
    return b"\x81" + size + b"\0\0\0\0" + data


def raw_ws(server: LiveServer, rcvbuf: int | None = None) -> socket.socket:
    """A bare TCP client that completed the WS handshake on /ws: it can vanish at any byte."""
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", server.port))
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    assert sock.recv(4096).startswith(b"HTTP/1.1 101")
    return sock


def flood_until_blocked(sock: socket.socket) -> None:
    """Send resets without reading the answers until the server stops reading for a second: it
    is then stuck sending an answer to a client whose buffers are full (uvicorn reads the next
    message only once the app took the previous one)."""
    frames = masked_frame(json.dumps({"type": "reset", "data": {"seed": 1}})) * 1000
    pending = frames
    sock.setblocking(False)
    deadline = time.monotonic() + 30
    while select.select([], [sock], [], 1.0)[1]:
        assert time.monotonic() < deadline, "the server kept reading"
        pending = pending[sock.send(pending) :] or frames


def drop(sock: socket.socket, how: str) -> None:
    """Vanish without a close frame: ``how`` is what the client does first."""
    if how == "mid_frame":
        sock.sendall(b"\x81\xfe\x01\x00\0\0\0\0" + b"abc")  # 3 bytes of a 256-byte frame
    elif how in ("after_message", "reset"):
        sock.sendall(masked_frame(json.dumps({"type": "reset", "data": {"seed": 1}})))
    elif how == "mid_answer":
        flood_until_blocked(sock)
    if how in ("reset", "mid_answer"):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
    sock.close()


def wait_idle(server: LiveServer) -> None:
    """Until uvicorn has finished every connection's task (and logged what it logs)."""
    deadline = time.monotonic() + 10
    while server.server.server_state.tasks or len(server.app.state.store):
        assert time.monotonic() < deadline, "the server did not notice the client left"
        time.sleep(0.01)


@pytest.fixture
def server_log(caplog: pytest.LogCaptureFixture) -> Iterator[Callable[[], None]]:
    """``capture()`` sends the server's records to caplog: ours from DEBUG, uvicorn's (which do
    not propagate to caplog's root handler) from INFO, the level ``deltarl env`` runs at (at
    DEBUG uvicorn traces every frame). Call it once the server started: uvicorn's logging setup
    resets its loggers."""
    uvicorn_logger = logging.getLogger("uvicorn")

    def capture() -> None:
        uvicorn_logger.addHandler(caplog.handler)
        caplog.set_level(logging.INFO, logger="uvicorn.error")
        caplog.set_level(logging.DEBUG, logger="deltarl")

    yield capture
    uvicorn_logger.removeHandler(caplog.handler)


@pytest.mark.network
@pytest.mark.parametrize(
    "how", ["idle", "mid_frame", "after_message", "reset", "mid_answer", "websockets_lib"]
)
def test_ws_client_vanishing_logs_no_traceback(
    server_log: Callable[[], None], caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """A client that drops its TCP connection without a close frame logs at most one short
    line, never a traceback (each drop used to log a 4 KB one), and frees its session."""
    app = create_app(settings())
    failed: list[str] = []
    app.add_middleware(FailedSends, failed=failed)
    with LiveServer(app) as server:
        server_log()
        if how == "websockets_lib":
            with ws_client.connect(ws_url(server)) as client:
                client.send(json.dumps({"type": "reset", "data": {"seed": 1}}))
                client.recv(timeout=5)
                caplog.clear()
                client.socket.shutdown(socket.SHUT_RDWR)  # under the library: no close frame
        else:
            sock = raw_ws(server, rcvbuf=4096 if how == "mid_answer" else None)
            caplog.clear()
            drop(sock, how)
        wait_idle(server)
        assert len(caplog.records) <= 1, [r.getMessage() for r in caplog.records]
        for record in caplog.records:
            assert record.levelno < logging.WARNING and record.exc_info is None
            assert "\n" not in record.getMessage() and len(record.getMessage()) < 200
        if how == "mid_answer":
            assert "websocket.send" in failed  # the server was answering when the client left
        with ws_client.connect(ws_url(server)) as ws:  # the server is fine
            ws.send(json.dumps({"type": "reset", "data": {"seed": 1}}))
            assert json.loads(ws.recv(timeout=5))["type"] == "observation"


@pytest.mark.network
def test_a_non_utf8_text_frame_logs_one_line_without_traceback(
    live_server: Callable[..., LiveServer],
    server_log: Callable[[], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """uvicorn's own protocol code logs such a frame with a traceback; the app's filter keeps it
    to one INFO line, and the server keeps serving."""
    server = live_server()
    server_log()
    sock = raw_ws(server)
    caplog.clear()
    frame = bytearray(masked_frame("xx"))
    frame[-2:] = b"\xff\xfe"  # the payload (mask 0): not UTF-8
    sock.sendall(bytes(frame))
    deadline = time.monotonic() + 10
    while not any("Invalid UTF-8" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, "uvicorn logged nothing about the frame"
        time.sleep(0.01)
    sock.close()
    wait_idle(server)
    for record in caplog.records:
        assert record.levelno < logging.WARNING and record.exc_info is None, record.getMessage()
    with ws_client.connect(ws_url(server)) as ws:
        ws.send(json.dumps({"type": "reset", "data": {"seed": 1}}))
        assert json.loads(ws.recv(timeout=5))["type"] == "observation"


@pytest.mark.network
def test_ws_server_bug_still_logs_its_traceback(
    live_server: Callable[..., LiveServer],
    server_log: Callable[[], None],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Quieting vanished clients hides no genuine error: a bug is logged with its traceback."""

    def broken_state(self: WordleEnvironment) -> None:
        raise KeyError("bug")

    monkeypatch.setattr(WordleEnvironment, "state", broken_state)
    server = live_server()
    server_log()
    with ws_client.connect(ws_url(server)) as ws:
        ws.send(json.dumps({"type": "state"}))
        assert error_code(json.loads(ws.recv(timeout=5))) == "INTERNAL_ERROR"
    wait_idle(server)
    [record] = [r for r in caplog.records if r.exc_info]
    assert record.exc_info is not None and record.exc_info[0] is KeyError
