"""Reward shaping and per-session reset options: the shaped per-turn rewards and
their sum, the server-wide defaults, options over HTTP and WS, refused options that leave the
session unharmed, and the default (unshaped) behaviour unchanged."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from env_helpers import answer, settings, wrong_guesses
from fastapi.testclient import TestClient
from pydantic import ValidationError

from deltarl.env_server.settings import EnvSettings
from deltarl.env_server.wordle.curriculum import GuessCurriculum
from deltarl.env_server.wordle.environment import WordleEnvironment, apply_options
from deltarl.env_server.wordle.game import (
    Shaping,
    WordleGame,
    WordleRules,
    WordLists,
    consistent,
    score_guess,
)
from deltarl.env_server.wordle.models import WordleObservation
from deltarl.env_server.wordle.options import ResetOptions

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
    m = g.play(f"[{secret}]")  # the win: win + greens + format, and the one unplayed guess
    assert m.reward == pytest.approx(1.0 + 0.5 + 0.1 + (0.5 + 0.1))
    rewards.append(m.reward)
    assert g.won and g.done
    assert g.total_reward == pytest.approx(sum(rewards))
    # without fill_unplayed the unplayed guess earns nothing
    g = WordleGame(
        WordleRules(max_guesses=4, shaping=Shaping(greens=0.5, format=0.1, fill_unplayed=False)),
        WordLists.load(),
        seed=SEED,
    )
    assert g.play(f"[{secret}]").reward == pytest.approx(1.0 + 0.5 + 0.1)


# the weights of bench/gpu_wordle_full.sh's REWARD=consistent arms
CONSISTENT = {"greens": 0.2, "yellows": 0.1, "format": 0.05, "repetition": 0.2, "invalid": 0.1}


@pytest.mark.parametrize("fill", [True, False])
def test_a_win_outscores_playing_on_only_with_fill_unplayed(fill: bool) -> None:
    """Six valid losing guesses, each consistent with the feedback before it, against the same
    first two guesses and then the answer: without fill_unplayed the per-move terms pay for
    lasting and the loss scores more than the win."""
    words = WordLists.load()
    shaping = Shaping(**CONSISTENT, consistent=0.3, fill_unplayed=fill)
    rules = WordleRules(max_guesses=6, shaping=shaping)
    seed = 8  # "filly": six words from the end of the list fit the feedback without winning
    secret = answer(seed)
    loser = WordleGame(rules, words, seed=seed)
    played: list[tuple[str, str]] = []
    for word in sorted(words.allowed, reverse=True):  # each next guess fits all earlier feedback
        if loser.done:
            break
        if word != secret and word not in dict(played) and consistent(word, played):
            move = loser.play(f"[{word}]")
            assert move.valid and (move.consistent or not played)
            played.append((word, move.pattern or ""))
    assert len(played) == 6 and not loser.won
    winner = WordleGame(rules, words, seed=seed)
    for word, _ in played[:2]:
        winner.play(f"[{word}]")
    assert winner.play(f"[{secret}]").valid and winner.won
    if fill:  # at least the win weight more, whatever the losing moves earned
        assert winner.total_reward >= loser.total_reward + shaping.win
    else:
        assert winner.total_reward < loser.total_reward


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


def test_a_weight_out_of_bounds_is_refused() -> None:
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
        {"shaping": {"consistent": -0.1}},
        {"shaping": {"consistent": 10.5}},
        {"shaping": {"consistent": "lots"}},
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


def test_curriculum_values() -> None:
    linear = GuessCurriculum(start=2, end=6, over_versions=8)
    assert [linear.guesses(v, 0) for v in (None, 0, 2, 4, 8, 100)] == [2, 2, 3, 4, 6, 6]
    down = GuessCurriculum(start=6, end=1, over_versions=5)
    assert down.guesses(5, 0) == 1 and down.most == 6
    rnd = GuessCurriculum(mode="random", start=5, end=2)
    draws = {rnd.guesses(None, s) for s in range(200)}
    assert draws == {2, 3, 4, 5}
    assert rnd.guesses(7, 123) == rnd.guesses(0, 123)  # the seed decides


def test_the_servers_curriculum_follows_the_resets_policy_version(
    make_client: Callable[..., TestClient],
) -> None:
    """The server picks an episode's guesses from the policy version its reset names (HTTP and
    WebSocket alike); a reset's own max_guesses wins; /metadata's turn limit covers the most
    guesses the curriculum gives, and every observation's info says the episode's guesses."""
    client = make_client(guesses_start=2, guesses_end=6, guesses_over_versions=4)
    meta = client.get("/metadata").json()
    assert meta["max_turns"] == 6 + 1  # the most guesses + the tolerated invalid move
    assert "2-6 guesses by policy version" in meta["description"]
    for version, guesses in ((None, 2), (0, 2), (2, 4), (4, 6), (40, 6)):
        body: dict[str, Any] = {"seed": SEED} | (
            {} if version is None else {"policy_version": version}
        )
        first = client.post("/reset", json=body).json()
        assert first["observation"]["guesses_left"] == guesses, version
        assert first["observation"]["info"] == {"max_guesses": guesses}
    own = client.post("/reset", json={"policy_version": 4, "options": {"max_guesses": 3}}).json()
    assert own["observation"]["guesses_left"] == 3
    bad = client.post("/reset", json={"policy_version": -1})
    assert bad.status_code == 422 and "policy_version" in bad.json()["detail"]
    with client.websocket_connect("/ws") as ws:
        ws.send_text(json.dumps({"type": "reset", "data": {"seed": SEED, "policy_version": 2}}))
        assert json.loads(ws.receive_text())["data"]["observation"]["guesses_left"] == 4
    plain = make_client()
    first = plain.post("/reset", json={"seed": SEED, "policy_version": 3}).json()
    assert first["observation"]["guesses_left"] == 6  # no curriculum: the server's game


def test_curriculum_settings_are_checked() -> None:
    with pytest.raises(ValidationError, match="guesses_end needs guesses_start"):
        EnvSettings(guesses_end=4)
    with pytest.raises(ValidationError, match="guesses_start"):
        EnvSettings(guesses_start=0)
    assert EnvSettings(guesses_start=3).curriculum() == GuessCurriculum(start=3, end=3)
    assert EnvSettings().curriculum() is None


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


# --- the consistency term: a valid guess that could still be the answer given all earlier
# feedback. Seed 1's answer is "cobra": crane -> GYYXX (c first, an r and an a elsewhere, no n,
# no e), error -> XYXYX (exactly one r, not 2nd, 3rd or 5th; an o, not 4th).
COBRA = 1


def test_the_games_behind_the_consistency_cases() -> None:
    assert answer(COBRA) == "cobra"
    assert score_guess("crane", "cobra") == "GYYXX"
    assert score_guess("error", "cobra") == "XYXYX"
    words = WordLists.load().allowed
    assert {"coral", "slate", "error", "board", "roars"} <= words and "corab" not in words
    crane = [("crane", "GYYXX")]
    assert consistent("coral", crane) and consistent("corab", crane)
    assert not consistent("slate", crane)
    # the repeated-letter trap: "roars" has every letter the feedback allows, but two r's where
    # "error"'s pattern (one r yellow, two grey) says the answer holds exactly one
    assert consistent("board", [("error", "XYXYX")])
    assert not consistent("roars", [("error", "XYXYX")])


def consistency_env(**rules: Any) -> WordleEnvironment:
    env = WordleEnvironment(WordleRules(max_invalid_moves=2, **rules), WordLists.load())
    options = ResetOptions.model_validate(
        {"shaping": {"win": 0.0, "consistent": 0.5, "fill_unplayed": False}}
    )
    env.reset(seed=COBRA, options=options)
    return env


@pytest.mark.parametrize(
    ("messages", "paid", "rules"),
    [
        # the first guess has no feedback to use: never paid
        (["[crane]", "[coral]"], [0, 1], {}),
        (["[crane]", "[slate]"], [0, 0], {}),
        # consistent with the first guess's feedback but not with the second's (no l)
        (["[crane]", "[slate]", "[coral]", "[cobra]"], [0, 0, 0, 1], {}),
        (["[crane]", "[coral]", "[cobra]"], [0, 1, 1], {}),
        # repeated letters: one r allowed, "roars" has two
        (["[error]", "[board]"], [0, 1], {}),
        (["[error]", "[roars]"], [0, 0], {}),
        # an invalid move earns nothing, even when its word would fit the feedback
        (["[crane]", "[corab]", "no guess"], [0, 0, 0], {}),
        (["[crane]", "[corab]"], [0, 1], {"allow_non_words": True}),
        # an invalid move before the first valid guess: that guess still has no feedback
        (["no guess", "[crane]", "[coral]"], [0, 0, 1], {}),
        # a repeat can never be consistent (its earlier pattern was not all green)
        (["[crane]", "[crane]"], [0, 0], {"allow_repeats": True}),
    ],
)
def test_consistent_term_is_paid_exactly_for_guesses_fitting_all_feedback(
    messages: list[str], paid: list[int], rules: dict[str, Any]
) -> None:
    env = consistency_env(**rules)
    rewards, signals = [], []
    for message in messages:
        result = env.step(message)
        obs = result.observation
        assert isinstance(obs, WordleObservation) and obs.reward_signals is not None
        signals.append(obs.reward_signals.consistent)
        rewards.append(result.reward)
    assert signals == [float(p) for p in paid]
    assert rewards == [0.5 * p for p in paid]
    assert env.game is not None and env.game.total_reward == pytest.approx(0.5 * sum(paid))


def test_consistent_adds_to_the_other_terms() -> None:
    weights = Shaping(win=1.0, greens=0.2, format=0.1, repetition=0.3, consistent=0.3)
    g = WordleGame(WordleRules(shaping=weights), WordLists.load(), seed=COBRA)
    first, second, third = g.play("[crane]"), g.play("[coral]"), g.play("[cobra]")
    assert (first.consistent, second.consistent, third.consistent) == (False, True, True)
    assert first.reward == pytest.approx(0.2 * 1 / 5 + 0.1)
    assert second.reward == pytest.approx(0.2 * 2 / 5 + 0.1 + 0.3)  # coral: GGYYX
    # the win, and for each of the three guesses it left unplayed greens + format + consistent
    assert third.reward == pytest.approx(1.0 + 0.2 + 0.1 + 0.3 + 3 * (0.2 + 0.1 + 0.3))
    assert g.won and g.total_reward == pytest.approx(first.reward + second.reward + third.reward)


def test_consistent_weight_0_by_default_changes_nothing() -> None:
    assert Shaping().consistent == 0.0
    assert settings().shaping_consistent == 0.0
    assert settings(shaping_format=0.1).shaping() == Shaping(format=0.1)
    assert apply_options(
        WordleRules(), ResetOptions.model_validate({"shaping": {"greens": 0.5}}), Shaping()
    ).shaping == Shaping(greens=0.5, consistent=0.0)
    # shaped without the term: the old formula, though the move is consistent
    weights = Shaping(win=1.0, greens=0.5, yellows=0.25, format=0.1)
    g = WordleGame(WordleRules(shaping=weights), WordLists.load(), seed=COBRA)
    g.play("[crane]")
    move = g.play("[coral]")
    assert move.consistent and move.reward == pytest.approx(
        pattern_reward(weights, "coral", "cobra")
    )
    # unshaped: 0 until the end; the signal is reported all the same
    env = WordleEnvironment(WordleRules(max_guesses=2), WordLists.load())
    env.reset(seed=COBRA)
    env.step("[crane]")
    last = env.step("[coral]")
    obs = last.observation
    assert isinstance(obs, WordleObservation) and obs.reward_signals is not None
    assert obs.reward_signals.consistent == 1.0
    assert last.done and last.reward == pytest.approx((2 + 0.5 * 2) / 5)  # final: GGYYX


def test_bad_consistent_weights_are_refused_clearly(client: TestClient) -> None:
    with pytest.raises(ValueError, match=r"shaping weight consistent must be in \[0, 10\], got 11"):
        Shaping(consistent=11.0)
    with pytest.raises(ValidationError, match="shaping_consistent"):
        settings(shaping_consistent=-0.5)
    with pytest.raises(ValidationError, match=r"shaping\.consistent"):
        ResetOptions.model_validate({"shaping": {"consistent": 10.5}})
    bad = client.post("/reset", json={"options": {"shaping": {"consistent": 10.5}}})
    assert bad.status_code == 422 and bad.json()["code"] == "VALIDATION_ERROR"
    detail = bad.json()["detail"]
    assert "options.shaping.consistent" in detail and "less than or equal to 10" in detail


def test_consistent_over_http_per_session_and_server_wide(
    client: TestClient, make_client: Callable[..., TestClient]
) -> None:
    options = {"shaping": {"consistent": 0.5}}  # win stays the server's 1.0, the rest 0
    sid = client.post("/reset", json={"seed": COBRA, "options": options}).json()["session_id"]
    got = []
    for word in ("crane", "coral", "slate", "cobra"):
        res = client.post("/step", json={"session_id": sid, "action": {"message": f"[{word}]"}})
        body = res.json()
        got.append((body["reward"], body["observation"]["reward_signals"]["consistent"]))
    # slate: inconsistent with crane's feedback; cobra: consistent with all three, the win and
    # its two unplayed guesses (0.5 each: only consistent is weighted)
    assert got == [(0.0, 0.0), (0.5, 1.0), (0.0, 0.0), (2.5, 1.0)]
    options["shaping"]["fill_unplayed"] = False  # type: ignore[index]
    sid = client.post("/reset", json={"seed": COBRA, "options": options}).json()["session_id"]
    for word in ("crane", "coral", "slate", "cobra"):
        res = client.post("/step", json={"session_id": sid, "action": {"message": f"[{word}]"}})
    assert res.json()["reward"] == 1.5
    server = make_client(reward="shaped", shaping_win=0.0, shaping_consistent=0.4)
    sid = server.post("/reset", json={"seed": COBRA}).json()["session_id"]
    for word, expected in (("crane", 0.0), ("coral", 0.4)):
        res = server.post("/step", json={"session_id": sid, "action": {"message": f"[{word}]"}})
        assert res.json()["reward"] == pytest.approx(expected)
