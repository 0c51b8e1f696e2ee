"""EnvClient / SyncEnvClient: typed results, errors, retries, import isolation; live-server
robustness (concurrent steps on one session, oversized WS frames, WS time-out)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable

import httpx
import pytest
import websockets.sync.client as ws_client
from env_helpers import answer, settings
from support import LiveServer
from websockets.exceptions import ConnectionClosed

from deltarl.env_server.core.app import create_app
from deltarl.env_server.core.client import EnvClient, SyncEnvClient
from deltarl.env_server.core.models import EnvError, ErrorCode, StepResult
from deltarl.env_server.wordle.models import WordleState


class DropFirstStepAnswer(httpx.AsyncBaseTransport):
    """Delivers the first /step request to the server, then loses its answer (a network fault)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.dropped = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path == "/step" and self.dropped == 0:
            self.dropped += 1
            raise httpx.ReadError("connection reset", request=request)
        return response


def test_async_client_game_and_idempotent_retry() -> None:
    transport = DropFirstStepAnswer(httpx.ASGITransport(app=create_app(settings())))

    async def play() -> None:
        async with EnvClient("http://env", transport=transport, backoff_s=0.001) as env:
            assert (await env.health()).status == "healthy"
            assert (await env.metadata()).name == "wordle"
            async with env.episode(seed=1) as ep:
                assert isinstance(ep.first, StepResult) and ep.first.observation.answer is None
                result = await ep.step(
                    "[crane]"
                )  # answer lost once, retried with the same request_id
                assert transport.dropped == 1
                assert [g.word for g in result.observation.history] == ["crane"]
                state = await ep.state()
                assert isinstance(state, WordleState) and state.step_count == 1
                result = await ep.step("[cobra]")
                assert result.done and result.reward == 1.0 and result.observation.answer == "cobra"
                with pytest.raises(EnvError) as err:
                    await ep.step("[cobra]")
                assert err.value.code is ErrorCode.GAME_OVER and err.value.http_status == 409
                sid = ep.session_id
            with pytest.raises(EnvError) as err:  # episode() closed the session
                await env.state(sid)
            assert err.value.code is ErrorCode.UNKNOWN_SESSION
            assert await env.close_session(sid) is False

    asyncio.run(play())


def test_sync_client_errors_and_token() -> None:
    app = create_app(settings(token="tok-tok-tok-tok-tok", max_sessions=1))
    with LiveServer(app) as server:  # httpx's ASGITransport is async-only
        with SyncEnvClient(server.url, token="wrong", retries=0) as env:
            with pytest.raises(EnvError) as err:
                env.reset()
            assert err.value.code is ErrorCode.UNAUTHORIZED
            assert env.health().status == "healthy"
        with SyncEnvClient(
            server.url, token="tok-tok-tok-tok-tok", retries=1, backoff_s=0.01
        ) as env:
            with env.episode(seed=2) as ep:
                result = ep.step("[" + answer(2) + "]")
                assert result.done and result.observation.won
                with pytest.raises(EnvError) as err:  # capacity 1, retried once, then raised
                    env.reset()
                assert err.value.code is ErrorCode.CAPACITY_REACHED
            first = env.reset(seed=3)
            assert first.session_id is not None
            again = env.reset(session_id=first.session_id, seed=4)
            assert again.session_id == first.session_id
            assert env.close_session(first.session_id) is True


def test_client_never_imports_the_server() -> None:
    code = (
        "import sys; import deltarl.env_server.core.client; "
        "bad = [m for m in ('fastapi', 'uvicorn', 'starlette', 'torch', 'deltarl.env_server.core.app', "
        "'deltarl.env_server.core.sessions', 'deltarl.env_server.wordle.game') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.network
def test_concurrent_steps_on_one_session(live_server: Callable[..., LiveServer]) -> None:
    server = live_server(max_invalid_moves=100)
    words = [
        "crane",
        "slate",
        "pious",
        "dumpy",
        "fight",
        "blown",
        "tulip",
        "ghost",
        "money",
        "water",
    ]

    async def hammer() -> None:
        async with httpx.AsyncClient(base_url=server.url) as http:
            sid = (await http.post("/reset", json={"seed": 7})).json()["session_id"]
            other = (await http.post("/reset", json={"seed": 1})).json()["session_id"]
            calls = [
                http.post("/step", json={"session_id": sid, "action": {"message": f"[{w}]"}})
                for w in words * 3
            ]
            calls.append(
                http.post("/step", json={"session_id": other, "action": {"message": "[crane]"}})
            )
            answers = await asyncio.wait_for(asyncio.gather(*calls), timeout=20)
            statuses = [r.status_code for r in answers]
            assert set(statuses) <= {200, 409}, statuses
            assert all(
                r.json()["code"] in ("GAME_OVER", "SESSION_BUSY")
                for r in answers
                if r.status_code == 409
            )
            state = (await http.get("/state", params={"session_id": sid})).json()
            assert state["step_count"] == statuses[:-1].count(200)
            assert len(state["history"]) <= 6 and state["done"]
            assert answers[-1].status_code == 200  # the other session was not disturbed
            assert answers[-1].json()["observation"]["history"][0]["pattern"] == "GYYXX"

    asyncio.run(hammer())


@pytest.mark.network
def test_oversized_ws_frame_closes_only_that_socket(live_server: Callable[..., LiveServer]) -> None:
    server = live_server(max_body_bytes=4096)
    url = server.url.replace("http", "ws") + "/ws"
    with ws_client.connect(url) as good, ws_client.connect(url, max_size=None) as bad:
        good.send(json.dumps({"type": "reset", "data": {"seed": 1}}))
        assert json.loads(good.recv(timeout=5))["type"] == "observation"
        bad.send("x" * 100_000)
        with pytest.raises(ConnectionClosed) as closed:
            bad.recv(timeout=5)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009  # message too big
        good.send(json.dumps({"type": "step", "data": {"message": "[crane]"}}))
        assert json.loads(good.recv(timeout=5))["type"] == "observation"


@pytest.mark.network
def test_idle_ws_session_times_out(live_server: Callable[..., LiveServer]) -> None:
    server = live_server(session_timeout_s=0.3)
    url = server.url.replace("http", "ws") + "/ws"
    with ws_client.connect(url) as ws:
        ws.send(json.dumps({"type": "reset", "data": {"seed": 1}}))
        ws.recv(timeout=5)
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=5)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4408
    assert len(server.app.state.store) == 0
