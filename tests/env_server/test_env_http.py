"""HTTP routes: stateful sessions, rewards on the wire, secrecy, errors, token, capacity, time-outs."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from env_helpers import answer, wrong_guesses
from fastapi.testclient import TestClient


def reset(client: TestClient, **body: Any) -> dict[str, Any]:
    r = client.post("/reset", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def step(client: TestClient, sid: str, message: str, **extra: Any) -> dict[str, Any]:
    r = client.post("/step", json={"session_id": sid, "action": {"message": message}, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def expect_error(response: Any, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["code"] == code and body["detail"]
    return body


def without_prompt(body: dict[str, Any]) -> str:
    """The answer body minus the constant instructions (which contain ordinary words)."""
    obs = body.get("observation", body)
    obs = {**obs, "prompt": "", "messages": obs.get("messages", [])[1:]}
    return json.dumps({**body, "observation": obs})


def test_full_game_win(client: TestClient) -> None:
    first = reset(client, seed=1, episode_id="ep-1")
    sid = first["session_id"]
    obs = first["observation"]
    assert first["done"] is False and first["reward"] == 0.0
    assert obs["answer"] is None and obs["history"] == [] and obs["guesses_left"] == 6
    assert obs["messages"][0]["category"] == "PROMPT" and "[apple]" in obs["prompt"]
    r = step(client, sid, "My guess: [crane]")
    obs = r["observation"]
    assert obs["history"] == [{"word": "crane", "pattern": "GYYXX"}]
    assert obs["last_move"] == {
        "guess": "crane",
        "valid": True,
        "invalid_reason": None,
        "repeated": False,
    }
    assert obs["reward_signals"] == {
        "correct": 0.0,
        "greens": 0.2,
        "yellows": 0.4,
        "format": 1.0,
        "valid": 1.0,
        "repetition": 0.0,
        "invalid": 0.0,
        "consistent": 0.0,
    }
    assert "Feedback:\nC R A N E\nG Y Y X X" in obs["messages"][-1]["content"]
    assert obs["messages"][-2] == {
        "sender_id": 0,
        "content": "[crane]",
        "category": "PLAYER_ACTION",
    }
    r = step(client, sid, "[cobra]")
    assert r["done"] is True and r["reward"] == 1.0
    assert r["observation"]["won"] is True and r["observation"]["answer"] == "cobra"
    assert r["observation"]["reward_signals"]["correct"] == 1.0
    assert r["observation"]["reward_signals"]["consistent"] == 1.0  # fits crane's GYYXX
    state = client.get("/state", params={"session_id": sid}).json()
    assert state["episode_id"] == "ep-1" and state["step_count"] == 2 and state["seed"] == 1
    assert state["done"] and state["won"] and state["answer"] == "cobra"
    expect_error(
        client.post("/step", json={"session_id": sid, "action": {"message": "[x]"}}),
        409,
        "GAME_OVER",
    )
    # reset the same session: a new episode, same session id
    again = reset(client, session_id=sid, seed=2)
    assert again["session_id"] == sid and again["observation"]["history"] == []
    assert client.post("/close", json={"session_id": sid}).json() == {"closed": True}
    assert client.post("/close", json={"session_id": sid}).json() == {"closed": False}
    expect_error(client.get("/state", params={"session_id": sid}), 404, "UNKNOWN_SESSION")


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_answer_never_leaks_while_playing(client: TestClient, seed: int) -> None:
    secret = answer(seed)
    first = reset(client, seed=seed)
    sid = first["session_id"]
    bodies = [without_prompt(first)]
    for word in wrong_guesses(seed, 5):
        bodies.append(without_prompt(step(client, sid, f"[{word}]")))
        bodies.append(client.get("/state", params={"session_id": sid}).text)
    bodies.append(without_prompt(step(client, sid, "[xxxxx]")))  # invalid, not the answer
    assert not any(secret in b for b in bodies)
    last = step(client, sid, "[" + wrong_guesses(seed, 6)[-1] + "]")
    assert last["done"] and last["observation"]["answer"] == secret
    assert f"The word was [{secret}]" in last["observation"]["messages"][-1]["content"]


def test_debug_reveal_answer(make_client: Callable[..., TestClient]) -> None:
    client = make_client(debug_reveal_answer=True)
    assert reset(client, seed=1)["observation"]["answer"] == "cobra"


def test_same_seed_same_game(client: TestClient) -> None:
    a, b = reset(client, seed=42), reset(client, seed=42)
    ra = step(client, a["session_id"], "[crane]")["observation"]["history"]
    rb = step(client, b["session_id"], "[crane]")["observation"]["history"]
    assert ra == rb and a["session_id"] != b["session_id"]


def test_invalid_moves_and_forfeit_on_the_wire(client: TestClient) -> None:
    sid = reset(client, seed=1)["session_id"]
    r = step(client, sid, "I have no idea")
    obs = r["observation"]
    assert r["done"] is False and obs["invalid_moves_left"] == 0 and obs["guesses_left"] == 6
    assert obs["last_move"]["invalid_reason"] == "no_guess"
    assert obs["reward_signals"]["invalid"] == 1.0 and obs["reward_signals"]["format"] == 0.0
    step(client, sid, "[crane]")
    r = step(client, sid, "[crane]")  # repeated: second invalid move forfeits
    assert r["done"] and r["reward"] == 0.0
    assert r["observation"]["last_move"]["invalid_reason"] == "repeated_guess"
    assert r["observation"]["reward_signals"]["repetition"] == 1.0
    assert r["observation"]["answer"] == "cobra"


def test_loss_partial_credit_on_the_wire(make_client: Callable[..., TestClient]) -> None:
    client = make_client(max_guesses=1, partial_credit=0.5)
    sid = reset(client, seed=1)["session_id"]
    r = step(client, sid, "[crane]")
    assert r["done"] and r["reward"] == pytest.approx(0.5 * 0.4)


def test_request_id_makes_step_idempotent(client: TestClient) -> None:
    sid = reset(client, seed=1)["session_id"]
    a = step(client, sid, "[crane]", request_id="r1")
    b = step(client, sid, "[crane]", request_id="r1")  # a retry: not played twice
    assert a == b and len(b["observation"]["history"]) == 1
    c = step(client, sid, "[slate]", request_id="r2")
    assert len(c["observation"]["history"]) == 2


def test_session_header_and_empty_state(client: TestClient) -> None:
    sid = reset(client, seed=1)["session_id"]
    r = client.post(
        "/step", json={"action": {"message": "[crane]"}}, headers={"X-Deltarl-Session": sid}
    )
    assert r.status_code == 200
    assert client.get("/state", headers={"X-Deltarl-Session": sid}).json()["step_count"] == 1
    assert client.get("/state").json()["episode_id"] is None  # OpenEnv: state of a fresh env


def test_reset_without_body_and_ignores_unknown_fields(client: TestClient) -> None:
    assert client.post("/reset").status_code == 200
    assert client.post("/reset", json={"seed": 3, "whatever": 1}).status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status", "code"),
    [
        ("post", "/step", {"content": b"{not json"}, 400, "INVALID_JSON"),
        ("post", "/reset", {"content": b"\xff\xfe\x00"}, 400, "INVALID_JSON"),
        ("post", "/step", {"json": {"action": {}}}, 422, "VALIDATION_ERROR"),
        ("post", "/step", {"json": {"action": {"message": 5}}}, 422, "VALIDATION_ERROR"),
        ("post", "/step", {"json": [1, 2]}, 422, "VALIDATION_ERROR"),
        (
            "post",
            "/step",
            {"json": {"action": {"message": "x", "extra": 1}}},
            422,
            "VALIDATION_ERROR",
        ),
        ("post", "/reset", {"json": {"seed": -1}}, 422, "VALIDATION_ERROR"),
        ("post", "/reset", {"json": {"seed": "abc"}}, 422, "VALIDATION_ERROR"),
        ("post", "/step", {"json": {"action": {"message": "[crane]"}}}, 400, "SESSION_REQUIRED"),
        (
            "post",
            "/step",
            {"json": {"session_id": "nope", "action": {"message": "x"}}},
            404,
            "UNKNOWN_SESSION",
        ),
        ("post", "/reset", {"json": {"session_id": "nope"}}, 404, "UNKNOWN_SESSION"),
        ("get", "/state", {"params": {"session_id": "nope"}}, 404, "UNKNOWN_SESSION"),
        ("post", "/close", {"json": {}}, 400, "SESSION_REQUIRED"),
        ("get", "/nowhere", {}, 404, "NOT_FOUND"),
        ("get", "/step", {}, 405, "METHOD_NOT_ALLOWED"),
        ("post", "/step", {"content": b"x" * 300_000}, 413, "PAYLOAD_TOO_LARGE"),
    ],
)
def test_error_codes(
    client: TestClient, method: str, path: str, kwargs: dict[str, Any], status: int, code: str
) -> None:
    expect_error(getattr(client, method)(path, **kwargs), status, code)


def test_message_limits_and_odd_characters(make_client: Callable[..., TestClient]) -> None:
    client = make_client(max_message_chars=1000)
    sid = reset(client, seed=1)["session_id"]
    r = client.post("/step", json={"session_id": sid, "action": {"message": "a" * 1001}})
    expect_error(r, 413, "PAYLOAD_TOO_LARGE")
    # a refused message does not count as a move
    assert client.get("/state", params={"session_id": sid}).json()["step_count"] == 0

    def chunks() -> Any:
        for _ in range(100):
            yield b" " * 5000

    r = client.post("/reset", content=chunks())  # chunked body, no Content-Length
    expect_error(r, 413, "PAYLOAD_TOO_LARGE")
    weird = "\x00\x01\u200b\u202e 日本 🎉 [\tcrane\t] \x7f"
    r = client.post(
        "/step",
        content=json.dumps({"session_id": sid, "action": {"message": weird}}).encode(),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 200 and r.json()["observation"]["last_move"]["guess"] == "crane"
    played = step(client, sid, "\x1b[31m[slate]\x1b[0m")
    assert played["observation"]["last_move"]["guess"] == "slate"
    # a lone surrogate is not Unicode: refused as invalid JSON, the session is unaffected
    lone = json.dumps({"session_id": sid, "action": {"message": "[crane]\ud800"}}).encode()
    expect_error(client.post("/step", content=lone), 400, "INVALID_JSON")
    assert client.get("/state", params={"session_id": sid}).json()["step_count"] == 2


def test_token(make_client: Callable[..., TestClient]) -> None:
    client = make_client(token="s3cret-s3cret-s3cret")
    assert client.get("/health").status_code == 200
    expect_error(client.post("/reset"), 401, "UNAUTHORIZED")
    expect_error(client.post("/reset", headers={"X-Deltarl-Token": "wrong"}), 401, "UNAUTHORIZED")
    expect_error(
        client.get("/metrics", headers={"Authorization": "Bearer s3cret-s3cret-s3cret"}),
        401,
        "UNAUTHORIZED",
    )
    r = client.post("/reset", headers={"X-Deltarl-Token": "s3cret-s3cret-s3cret"})
    assert r.status_code == 200
    with pytest.raises(Exception), client.websocket_connect("/ws") as ws:  # noqa: B017
        ws.receive_text()
    with client.websocket_connect("/ws", headers={"X-Deltarl-Token": "s3cret-s3cret-s3cret"}) as ws:
        ws.send_text(json.dumps({"type": "reset", "data": {"seed": 1}}))
        assert json.loads(ws.receive_text())["type"] == "observation"


def test_capacity(make_client: Callable[..., TestClient]) -> None:
    client = make_client(max_sessions=2)
    a = reset(client)["session_id"]
    reset(client)
    body = expect_error(client.post("/reset"), 503, "CAPACITY_REACHED")
    assert "max_sessions" in body["detail"]
    with client.websocket_connect("/ws") as ws:
        err = json.loads(ws.receive_text())
        assert err["type"] == "error" and err["data"]["code"] == "CAPACITY_REACHED"
        assert err["data"]["max_sessions"] == 2
    client.post("/close", json={"session_id": a})
    assert client.post("/reset").status_code == 200


def test_session_timeout(make_client: Callable[..., TestClient]) -> None:
    client = make_client(session_timeout_s=0.2, max_sessions=2)
    store = client.app.state.store  # type: ignore[attr-defined]
    a = reset(client)["session_id"]
    b = reset(client)["session_id"]
    time.sleep(0.1)
    step(client, b, "[crane]")  # activity keeps b alive
    time.sleep(0.15)
    expect_error(client.get("/state", params={"session_id": a}), 404, "UNKNOWN_SESSION")
    assert client.get("/state", params={"session_id": b}).status_code == 200
    time.sleep(0.25)
    store.reap()  # the background reaper (every timeout/4) has usually done it already
    assert len(store) == 0
    assert "deltarl_env_sessions_expired 2.0" in client.get("/metrics").text
    # expired sessions free capacity even before the reaper runs
    reset(client)
    reset(client)
    time.sleep(0.25)
    assert client.post("/reset").status_code == 200


def test_games_given_up_are_counted_apart(make_client: Callable[..., TestClient]) -> None:
    # a client that gives up on a game (closes its session, lets it time out, resets it
    # mid-game, drops its socket) leaves a game that is neither won, lost nor forfeited:
    # counted as unfinished, so a win rate over ended games can be read with it
    client = make_client(session_timeout_s=0.3)
    store = client.app.state.store  # type: ignore[attr-defined]

    def unfinished() -> float:
        text = client.get("/metrics").text
        return float(text.split("\ndeltarl_env_games_unfinished ")[1].split()[0])

    assert unfinished() == 0
    won = reset(client, seed=1)["session_id"]
    step(client, won, f"[{answer(1)}]")
    client.post("/close", json={"session_id": won})
    assert unfinished() == 0  # ended, then closed
    closed = reset(client, seed=2)["session_id"]
    step(client, closed, f"[{wrong_guesses(2, 1)[0]}]")
    client.post("/close", json={"session_id": closed})
    assert unfinished() == 1
    again = reset(client, seed=3)["session_id"]
    reset(client, session_id=again, seed=4)  # the first game given up
    assert unfinished() == 2
    time.sleep(0.35)
    store.reap()  # the second game of that session timed out
    assert unfinished() == 3
    with client.websocket_connect("/ws") as ws:
        ws.send_text(json.dumps({"type": "reset", "data": {"seed": 5}}))
        assert json.loads(ws.receive_text())["type"] == "observation"
    assert unfinished() == 4  # the socket closed mid-game
    assert 'deltarl_env_games_total{outcome="won"} 1.0' in client.get("/metrics").text


def test_info_routes(client: TestClient) -> None:
    assert client.get("/health").json() == {"status": "healthy"}
    meta = client.get("/metadata").json()
    assert meta["name"] == "wordle" and "SCOWL" in meta["description"]
    schema = client.get("/schema").json()
    assert schema["action"]["properties"]["message"]["type"] == "string"
    assert (
        "history" in schema["observation"]["properties"]
        and "answer" in schema["state"]["properties"]
    )
    sid = reset(client, seed=1)["session_id"]
    step(client, sid, "[cobra]")
    client.post("/step", json={"action": {"message": "x"}})
    text = client.get("/metrics").text
    assert 'deltarl_env_requests_total{op="step",transport="http"} 1.0' in text
    assert 'deltarl_env_games_total{outcome="won"} 1.0' in text
    assert 'deltarl_env_errors_total{code="SESSION_REQUIRED"} 1.0' in text
    assert 'deltarl_env_sessions{transport="http"} 1.0' in text
    openapi = client.get("/openapi.json").json()
    assert {"/reset", "/step", "/state", "/close", "/health", "/metadata", "/schema"} <= set(
        openapi["paths"]
    )


def test_openapi_documents_request_bodies(client: TestClient) -> None:
    openapi = client.get("/openapi.json").json()
    body = openapi["paths"]["/step"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/StepRequest"}
    schemas = set(openapi["components"]["schemas"])
    assert {"StepRequest", "TextAction", "ResetRequest", "ErrorResponse"} <= schemas
    assert any(name.startswith("StepResult") for name in schemas), schemas
