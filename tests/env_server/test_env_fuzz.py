"""Property-based fuzzing of the wire: any body, any message, any WS frame gets a documented
answer (a result or an error code), never a 500, and the session stays usable."""

from __future__ import annotations

import json
from typing import Any

import pytest
from env_helpers import settings
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from deltarl.env_server.core.app import create_app
from deltarl.env_server.core.models import HTTP_STATUS, ErrorCode, ErrorResponse
from deltarl.env_server.tasks import AnyStepResult

CLIENT = TestClient(create_app(settings(max_sessions=100_000, max_message_chars=2000)))
DOCUMENTED = {(code.value, status) for code, status in HTTP_STATUS.items()}
FUZZ = hsettings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
# bodies shaped like ours, with wrong values here and there
step_bodies = st.fixed_dictionaries(
    {},
    optional={
        "session_id": st.none() | st.text(max_size=70) | st.integers(),
        "action": json_values
        | st.fixed_dictionaries({"message": st.text(max_size=50) | json_values}),
        "request_id": json_values,
        "timeout_s": json_values,
    },
)
reset_bodies = st.fixed_dictionaries(
    {},
    optional={"seed": json_values, "episode_id": json_values, "session_id": json_values},
)
messages = st.text(max_size=400) | st.builds(
    lambda pre, word, post: f"{pre}[{word}]{post}",
    st.text(max_size=30),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCXYZ \t", min_size=0, max_size=8),
    st.text(max_size=30),
)


def check(response: Any) -> None:
    assert response.status_code != 500, response.text
    if response.status_code == 200:
        return
    err = ErrorResponse.model_validate_json(response.content)
    assert (err.code.value, response.status_code) in DOCUMENTED


@FUZZ
@given(body=step_bodies | json_values)
def test_fuzz_step_bodies(body: Any) -> None:
    check(CLIENT.post("/step", json=body))


@FUZZ
@given(body=reset_bodies | json_values)
def test_fuzz_reset_bodies(body: Any) -> None:
    r = CLIENT.post("/reset", json=body)
    check(r)
    if r.status_code == 200:
        CLIENT.post("/close", json={"session_id": r.json()["session_id"]})


@FUZZ
@given(raw=st.binary(max_size=200), path=st.sampled_from(["/reset", "/step", "/close"]))
def test_fuzz_raw_bytes(raw: bytes, path: str) -> None:
    check(CLIENT.post(path, content=raw, headers={"content-type": "application/json"}))


@pytest.mark.slow
@FUZZ
@given(moves=st.lists(messages, min_size=1, max_size=10), seed=st.integers(0, 2**63))
def test_fuzz_games(moves: list[str], seed: int) -> None:
    first = CLIENT.post("/reset", json={"seed": seed}).json()
    sid = first["session_id"]
    for message in moves:
        r = CLIENT.post("/step", json={"session_id": sid, "action": {"message": message}})
        check(r)
        if r.status_code != 200:
            assert r.json()["code"] == ErrorCode.GAME_OVER
            break
        result = AnyStepResult.model_validate_json(r.content)
        obs = result.observation
        assert (obs.answer is not None) == result.done
        assert len(obs.history) + obs.guesses_left <= 6
        assert all(len(h.pattern) == 5 and set(h.pattern) <= set("GYX") for h in obs.history)
        assert result.reward == 0.0 or result.done
        assert 0.0 <= (result.reward or 0.0) <= 1.0
    state = CLIENT.get("/state", params={"session_id": sid})
    assert state.status_code == 200
    CLIENT.post("/close", json={"session_id": sid})


@pytest.mark.slow
@FUZZ
@given(frames=st.lists(st.text(max_size=80) | json_values.map(json.dumps), min_size=1, max_size=8))
def test_fuzz_ws_frames(frames: list[str]) -> None:
    with CLIENT.websocket_connect("/ws") as ws:
        for frame in frames:
            ws.send_text(frame)
            try:
                decoded = json.loads(frame)
            except ValueError:
                decoded = None
            if isinstance(decoded, dict) and decoded.get("type") == "close":
                return
            reply = json.loads(ws.receive_text())
            assert reply["type"] in ("observation", "state", "error")
            if reply["type"] == "error":
                assert reply["data"]["code"] in {c.value for c in ErrorCode}
                assert reply["data"]["code"] not in (
                    "INTERNAL_ERROR",
                    "EXECUTION_ERROR",
                    "SESSION_ERROR",
                )
        ws.send_text(json.dumps({"type": "reset", "data": {"seed": 1}}))
        assert json.loads(ws.receive_text())["type"] == "observation"
