"""Reward shaping and per-session reset options (issue 14): the shaped per-turn rewards and
their sum, the server-wide defaults, options over HTTP and WS, refused options that leave the
session unharmed, and the default (unshaped) behaviour unchanged."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from env_helpers import answer, wrong_guesses
from fastapi.testclient import TestClient

from deltarl.env_server.core import wire
from deltarl.env_server.core.models import ResetOptions
from deltarl.env_server.wordle import game as game_mod
from deltarl.env_server.wordle.environment import WordleEnvironment, apply_options
from deltarl.env_server.wordle.game import (
    Shaping,
    WordleGame,
    WordleRules,
    WordLists,
    score_guess,
)

SEED = 3


def pattern_reward(weights: Shaping, guess: str, secret: str, repeated: bool = False) -> float:
    p = score_guess(guess, secret)
    return (
        weights.win * (p == "GGGGG")
        + weights.greens * p.count("G") / 5
        + weights.yellows * p.count("Y") / 5
        + weights.format
        - weights.repetition * repeated
    )


def test_shaped_rewards_per_turn_and_their_sum() -> None:
    weights = Shaping(win=1.0, greens=0.5, yellows=0.25, format=0.1, repetition=0.3, invalid=0.2)
    rules = WordleRules(max_guesses=4, allow_repeats=True, shaping=weights)
    secret = answer(SEED)
    g = WordleGame(rules, WordLists.load(), seed=SEED)
    (a,) = wrong_guesses(SEED, 1)
    rewards = []
    m = g.play(f"[{a}]")
    assert m.reward == pytest.approx(pattern_reward(weights, a, secret))
    rewards.append(m.reward)
    m = g.play("no brackets")  # invalid: -invalid, no format
    assert m.reward == pytest.approx(-0.2)
    rewards.append(m.reward)
    m = g.play(f"[{a}]")  # repeated (allowed, scored): the penalty applies
    assert m.reward == pytest.approx(pattern_reward(weights, a, secret, repeated=True))
    rewards.append(m.reward)
    m = g.play(f"[{secret}]")  # the win: win + greens + format
    assert m.reward == pytest.approx(1.0 + 0.5 + 0.1)
    rewards.append(m.reward)
    assert g.won and g.done
    assert g.total_reward == pytest.approx(sum(rewards))


def test_forfeit_keeps_what_the_format_earned() -> None:
    weights = Shaping(win=1.0, format=0.1)
    g = WordleGame(WordleRules(max_invalid_moves=1, shaping=weights), WordLists.load(), seed=SEED)
    (a,) = wrong_guesses(SEED, 1)
    assert g.play(f"[{a}]").reward == pytest.approx(0.1)
    assert g.play("x").reward == 0.0
    last = g.play("y")
    assert g.forfeited and last.reward == 0.0
    assert g.total_reward == pytest.approx(0.1)


def test_no_shaping_is_unchanged() -> None:
    """Without shaping the steps are 0 until the final reward, which is final_reward()."""
    rules = WordleRules(max_guesses=2)
    g = WordleGame(rules, WordLists.load(), seed=SEED)
    a, b = wrong_guesses(SEED, 2)
    assert g.play(f"[{a}]").reward == 0.0
    last = g.play(f"[{b}]")
    assert last.reward == pytest.approx(g.final_reward()) and g.done
    assert g.total_reward == last.reward


def test_bounds_agree_with_the_wire() -> None:
    assert wire.MAX_SHAPING_WEIGHT == game_mod.MAX_SHAPING_WEIGHT
    with pytest.raises(ValueError, match="shaping weight win"):
        Shaping(win=-1.0)


def test_apply_options() -> None:
    server = WordleRules(max_guesses=6)
    defaults = Shaping(win=2.0, format=0.3)
    assert apply_options(server, None, defaults) is server
    r = apply_options(server, ResetOptions(max_guesses=2), defaults)
    assert r.max_guesses == 2 and r.shaping is None
    r = apply_options(server, ResetOptions(reward="shaped"), defaults)
    assert r.shaping == defaults
    r = apply_options(server, ResetOptions.model_validate({"shaping": {"greens": 0.5}}), defaults)
    assert r.shaping == Shaping(win=2.0, format=0.3, greens=0.5)
    shaped_server = WordleRules(shaping=Shaping(format=0.7))
    assert apply_options(shaped_server, ResetOptions(reward="final")).shaping is None
    assert apply_options(shaped_server, ResetOptions(max_guesses=3)).shaping == Shaping(format=0.7)


def test_server_default_shaping_from_settings(make_client: Callable[..., TestClient]) -> None:
    client = make_client(reward="shaped", shaping_format=0.25, shaping_win=1.0)
    first = client.post("/reset", json={"seed": SEED}).json()
    (a,) = wrong_guesses(SEED, 1)
    r = client.post(
        "/step", json={"session_id": first["session_id"], "action": {"message": f"[{a}]"}}
    )
    assert r.json()["reward"] == pytest.approx(0.25)


def test_http_options_shape_and_set_guesses(client: TestClient) -> None:
    options = {"max_guesses": 2, "shaping": {"format": 0.1, "greens": 1.0}}
    first = client.post("/reset", json={"seed": SEED, "options": options}).json()
    sid = first["session_id"]
    assert first["observation"]["guesses_left"] == 2
    assert "You have 2 attempts" in first["observation"]["prompt"]
    a, b = wrong_guesses(SEED, 2)
    for word in (a, b):
        body = client.post("/step", json={"session_id": sid, "action": {"message": f"[{word}]"}})
        res = body.json()
        expected = 0.1 + score_guess(word, answer(SEED)).count("G") / 5
        assert res["reward"] == pytest.approx(expected)
    assert res["done"]
    assert client.get("/state", params={"session_id": sid}).json()["max_guesses"] == 2
    # the next reset without options plays the server's rules again
    again = client.post("/reset", json={"session_id": sid, "seed": SEED}).json()
    assert again["observation"]["guesses_left"] == 6


@pytest.mark.parametrize(
    "options",
    [
        {"max_guesses": 0},
        {"max_guesses": 101},
        {"shaping": {"win": -1}},
        {"shaping": {"win": 11}},
        {"shaping": {"wins": 1}},
        {"reward": "dense"},
        {"reward": "final", "shaping": {"format": 0.1}},
        {"guesses": 3},
        [1, 2],
    ],
)
def test_bad_options_are_refused_and_the_session_is_unharmed(
    client: TestClient, options: Any
) -> None:
    opened = client.post("/reset", json={"seed": SEED, "options": {"max_guesses": 3}}).json()
    sid = opened["session_id"]
    (a,) = wrong_guesses(SEED, 1)
    client.post("/step", json={"session_id": sid, "action": {"message": f"[{a}]"}})
    sessions = len(client.app.state.store)  # type: ignore[attr-defined]
    bad = client.post("/reset", json={"seed": SEED, "options": options})
    assert bad.status_code == 422 and bad.json()["code"] == "VALIDATION_ERROR"
    assert "options" in bad.json()["detail"]
    bad = client.post("/reset", json={"session_id": sid, "options": options})
    assert bad.status_code == 422
    assert len(client.app.state.store) == sessions  # type: ignore[attr-defined]
    state = client.get("/state", params={"session_id": sid}).json()
    assert state["max_guesses"] == 3 and len(state["history"]) == 1 and not state["done"]


def test_ws_options_and_errors(client: TestClient) -> None:
    with client.websocket_connect("/ws") as ws:
        ws.send_text(json.dumps({"type": "reset", "data": {"options": {"max_guesses": 0}}}))
        err = json.loads(ws.receive_text())
        assert err["type"] == "error" and err["data"]["code"] == "VALIDATION_ERROR"
        data = {"seed": SEED, "options": {"max_guesses": 1, "shaping": {"format": 0.5}}}
        ws.send_text(json.dumps({"type": "reset", "data": data}))
        obs = json.loads(ws.receive_text())["data"]
        assert obs["observation"]["guesses_left"] == 1
        (a,) = wrong_guesses(SEED, 1)
        ws.send_text(json.dumps({"type": "step", "data": {"message": f"[{a}]"}}))
        res = json.loads(ws.receive_text())["data"]
        assert res["done"] and res["reward"] == pytest.approx(0.5)


def test_charset_refuses_options(make_client: Callable[..., TestClient]) -> None:
    client = make_client(task="charset")
    bad = client.post("/reset", json={"options": {"max_guesses": 2}})
    assert bad.status_code == 422 and "charset" in bad.json()["detail"]
    assert len(client.app.state.store) == 0  # type: ignore[attr-defined]
    assert client.post("/reset", json={"options": {}}).status_code == 200


def test_environment_reset_options_direct() -> None:
    env = WordleEnvironment(WordleRules(), WordLists.load(), shaping=Shaping(format=0.2))
    res = env.reset(seed=SEED, options=ResetOptions(reward="shaped", max_guesses=4))
    assert res.observation.guesses_left == 4  # type: ignore[union-attr]
    (a,) = wrong_guesses(SEED, 1)
    assert env.step(f"[{a}]").reward == pytest.approx(0.2)
    assert env.state().max_guesses == 4
