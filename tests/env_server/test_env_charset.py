"""The charset task: its reward, one-reply episodes, the server serving it
(``DELTARL_ENV_TASK=charset``) over HTTP and WS, the typed client, and the episode loop's
rendering of its observations. Wordle stays the default."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from support import LiveServer

from deltarl.env_server.charset.environment import CharsetEnvironment, CharsetRules, score_reply
from deltarl.env_server.charset.models import CharsetObservation, CharsetState
from deltarl.env_server.core.client import EnvClient, SyncEnvClient
from deltarl.env_server.core.models import EnvError, ErrorCode
from deltarl.env_server.settings import EnvSettings
from deltarl.env_server.tasks import AnyStepResult
from deltarl.env_server.wordle.models import WordleObservation, WordleState
from deltarl.rollout.episodes.runner import observation_text

RULES = CharsetRules()  # a-z, full marks from 8 characters


@pytest.mark.parametrize(
    ("reply", "reward"),
    [
        ("abcdefgh", 1.0),
        ("abcdefghijklmnop", 1.0),
        ("abc", 3 / 8),  # short replies count as 8 characters long
        ("", 0.0),
        ("ABCDEFGH", 0.0),
        ("hello world!", 10 / 12),  # the space and "!" are outside the set
        ("caf\u00e9 \ufffd\ufffd\ufffd\ufffd", 3 / 9),
        ("\n\nabcdefgh", 8 / 10),
    ],
)
def test_reward(reply: str, reward: float) -> None:
    got, signals = score_reply(reply, RULES)
    assert got == pytest.approx(reward)
    assert 0.0 <= signals.in_set <= 1.0 and 0.0 <= signals.length <= 1.0
    if reply:
        assert signals.in_set == pytest.approx(sum(c in RULES.target for c in reply) / len(reply))


def test_reward_is_monotone_in_characters_moved_into_the_set() -> None:
    """Replacing any character outside the set by one inside raises the reward: the signal is
    dense, every character counts."""
    reply = "#" * 16
    last = score_reply(reply, RULES)[0]
    for i in range(len(reply)):
        reply = reply[:i] + "q" + reply[i + 1 :]
        now = score_reply(reply, RULES)[0]
        assert now > last
        last = now
    assert last == 1.0


def test_rules_are_checked() -> None:
    with pytest.raises(ValueError, match="at least one character"):
        CharsetRules(target="")
    with pytest.raises(ValueError, match="min_chars"):
        CharsetRules(min_chars=0)


def test_one_reply_per_episode() -> None:
    env = CharsetEnvironment(CharsetRules(target="xyz", min_chars=4))
    with pytest.raises(EnvError) as info:
        env.step("x")
    assert info.value.code == ErrorCode.NOT_STARTED
    first = env.reset(seed=3, episode_id="e1")
    assert not first.done and first.reward == 0.0 and env.outcome is None
    assert isinstance(first.observation, CharsetObservation)
    assert "xyz" in first.observation.prompt and first.observation.reply is None
    result = env.step("xyzzy!")
    assert result.done and result.reward == pytest.approx(5 / 6)
    assert isinstance(result.observation, CharsetObservation)
    assert result.observation.reply == "xyzzy!"
    assert result.observation.messages[-1].content.startswith("5 of your 6 characters")
    assert env.outcome == "lost"
    assert env.state() == CharsetState(
        episode_id="e1", step_count=1, seed=3, done=True, reward=5 / 6
    )
    with pytest.raises(EnvError) as info:
        env.step("x")
    assert info.value.code == ErrorCode.GAME_OVER
    env.reset()
    assert env.step("xyzx").reward == 1.0 and env.outcome == "won"


def test_task_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert EnvSettings.model_validate({}).task == "wordle"
    monkeypatch.setenv("DELTARL_ENV_TASK", "charset")
    monkeypatch.setenv("DELTARL_ENV_CHARSET_TARGET", "01")
    monkeypatch.setenv("DELTARL_ENV_CHARSET_MIN_CHARS", "3")
    s = EnvSettings()
    assert s.task == "charset" and s.charset_rules() == CharsetRules(target="01", min_chars=3)
    monkeypatch.setenv("DELTARL_ENV_TASK", "chess")
    with pytest.raises(ValueError, match="task"):
        EnvSettings()


def test_http_server_serves_the_charset_task(make_client: Callable[..., TestClient]) -> None:
    client = make_client(task="charset", charset_min_chars=4)
    meta = client.get("/metadata").json()
    assert meta["name"] == "charset" and "min_chars" not in meta["description"]
    schema = client.get("/schema").json()
    assert "target" in schema["observation"]["properties"]
    assert schema["state"]["properties"]["task"]["default"] == "charset"
    assert client.get("/state").json()["task"] == "charset"
    first = client.post("/reset", json={"seed": 1}).json()
    sid = first["session_id"]
    assert first["observation"]["task"] == "charset" and first["done"] is False
    step = client.post("/step", json={"session_id": sid, "action": {"message": "ab cd"}})
    body = step.json()
    assert body["done"] is True and body["reward"] == pytest.approx(4 / 5)
    assert body["observation"]["reward_signals"] == {"in_set": 0.8, "length": 1.0}
    again = client.post("/step", json={"session_id": sid, "action": {"message": "x"}})
    assert again.status_code == 409 and again.json()["code"] == "GAME_OVER"
    state = client.get("/state", params={"session_id": sid}).json()
    assert state["task"] == "charset" and state["done"] is True
    metrics = client.get("/metrics").text
    assert 'deltarl_env_games_total{outcome="lost"} 1.0' in metrics


def test_ws_plays_the_charset_task(make_client: Callable[..., TestClient]) -> None:
    client = make_client(task="charset")
    with client.websocket_connect("/ws") as ws:
        ws.send_json({"type": "reset", "data": {"seed": 2}})
        first = ws.receive_json()
        assert first["type"] == "observation" and first["data"]["observation"]["task"] == "charset"
        ws.send_json({"type": "step", "data": {"message": "abcdefghij"}})
        answer = ws.receive_json()["data"]
        assert answer["done"] is True and answer["reward"] == 1.0
        ws.send_json({"type": "state"})
        assert ws.receive_json()["data"]["task"] == "charset"


def test_clients_parse_either_task(live_server: Callable[..., LiveServer]) -> None:
    charset, wordle = live_server(task="charset"), live_server()
    with SyncEnvClient(charset.url) as env, env.episode(seed=5) as ep:
        assert isinstance(ep.first.observation, CharsetObservation)
        result = ep.step("hello")
        assert result.done and result.reward == pytest.approx(5 / 8)
        assert isinstance(ep.state(), CharsetState)
    with SyncEnvClient(wordle.url) as env, env.episode(seed=5) as ep:
        assert isinstance(ep.first.observation, WordleObservation)
        assert isinstance(ep.state(), WordleState)

    async def play() -> Any:
        async with EnvClient(charset.url) as env, env.episode(seed=1) as ep:
            return await ep.step("zzzzzzzz")

    assert asyncio.run(play()).reward == 1.0


def test_episode_loop_renders_charset_observations() -> None:
    """The rollout worker's default rendering (prompt first, then the game's feedback) works on
    the charset observation unchanged: it reads only TextArena's common fields."""
    env = CharsetEnvironment(RULES)
    first = env.reset()
    assert observation_text(None, first) == env.prompt
    result = env.step("abc")
    assert observation_text(first, result).startswith("3 of your 3 characters")


def test_bodies_without_a_task_tag_are_wordle() -> None:
    """Bodies of a server older than the task tag still parse (as Wordle)."""
    env = CharsetEnvironment(RULES)
    body = env.reset().model_dump(mode="json")
    assert AnyStepResult.model_validate(body).observation.task == "charset"
    wordle = {
        "prompt": "p",
        "messages": [],
        "history": [],
        "guesses_left": 6,
        "invalid_moves_left": 1,
        "last_move": None,
        "reward_signals": None,
        "won": False,
        "answer": None,
    }
    parsed = AnyStepResult.model_validate({"observation": wordle, "reward": 0.0, "done": False})
    assert isinstance(parsed.observation, WordleObservation)
