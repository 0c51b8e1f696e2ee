"""The feedback summary: what all the feedback so far shows, stated in every feedback
when the server setting or the reset option ``feedback_summary`` asks for it. Every statement it
makes holds for the answer; it is off by default (the feedback text unchanged); it travels over
HTTP and WS per session; the solver's transcripts and the evaluation render it the same way."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from env_helpers import answer, settings, wrong_guesses
from fastapi.testclient import TestClient

from deltarl.env_server.wordle import transcripts
from deltarl.env_server.wordle.environment import WordleEnvironment, apply_options
from deltarl.env_server.wordle.game import WordleRules, WordLists, known_summary, score_guess
from deltarl.env_server.wordle.options import ResetOptions
from deltarl.rollout.episodes.runner import observation_text

SEED = 3
HEAD = "Known so far:"


def parse(summary: str) -> tuple[list[str], dict[str, set[int]], set[str]]:
    """(placed letters or '_', {letter: positions it is not at}, absent letters) of a summary."""
    lines = summary.splitlines()
    assert lines[0] == HEAD and len(lines) == 4, summary
    placed = lines[1].removeprefix("Letters in place: ").split(" ")
    elsewhere: dict[str, set[int]] = {}
    rest = lines[2].removeprefix("In the word, not in place: ")
    if rest != "none":
        for item in rest.split("), "):
            letter, at = item.rstrip(")").split(" (not at ")
            elsewhere[letter] = {int(x) for x in at.split(", ")}
    absent_text = lines[3].removeprefix("Not in the word: ")
    absent = set() if absent_text == "none" else set(absent_text.split(", "))
    return placed, elsewhere, absent


def test_known_summary_of_a_game() -> None:
    # answer "fluff": crane all X, split one yellow L, could a green U and a yellow L
    history = [(w, score_guess(w, "fluff")) for w in ("crane", "split", "could")]
    assert known_summary(history) == (
        "Known so far:\n"
        "Letters in place: _ _ U _ _\n"
        "In the word, not in place: L (not at 3, 4)\n"
        "Not in the word: A, C, D, E, I, N, O, P, R, S, T"
    )
    assert known_summary([]) == ""


def test_repeated_letters_and_a_yellow_found_later() -> None:
    # "geese" against "those": the first two E are X (only one E, and it is green at 5), the
    # S is green; E is in the word, so it is not listed as absent
    history = [("geese", score_guess("geese", "those"))]
    assert history[0][1] == "XXXGG"
    placed, elsewhere, absent = parse(known_summary(history))
    assert placed == ["_", "_", "_", "S", "E"] and "E" not in absent and absent == {"G"}
    # a yellow R later found green at 2 is no longer listed as elsewhere
    history = [("tears", score_guess("tears", "arose")), ("arose", "GGGGG")]
    assert history[0][1][3] == "Y"
    placed, elsewhere, _ = parse(known_summary(history))
    assert placed == list("AROSE") and elsewhere == {}


@pytest.mark.parametrize("seed", range(40))
def test_every_statement_holds_for_the_answer(seed: int) -> None:
    words = WordLists.load()
    rng = random.Random(seed)
    secret = rng.choice(words.answers)
    guesses = rng.sample(sorted(words.allowed), 5)
    history: list[tuple[str, str]] = []
    for guess in guesses:
        history.append((guess, score_guess(guess, secret)))
        placed, elsewhere, absent = parse(known_summary(history))
        up = secret.upper()
        for i, letter in enumerate(placed):
            assert letter in ("_", up[i]), (secret, history)
        for letter, at in elsewhere.items():
            assert letter in up and all(up[i - 1] != letter for i in at), (secret, history)
        assert not absent & set(up), (secret, history)
        # and it says all the greens and every absent letter the feedback proves
        greens = {(i, g[i].upper()) for g, p in history for i, m in enumerate(p) if m == "G"}
        assert all(placed[i] == letter for i, letter in greens)
        proven_absent = {
            c.upper() for g, p in history for c, m in zip(g, p, strict=True) if m == "X"
        } - {c.upper() for g, p in history for c, m in zip(g, p, strict=True) if m != "X"}
        assert absent == proven_absent


def play(env: WordleEnvironment, words: list[str]) -> list[str]:
    """The feedback text (as a worker renders it) after each of ``words``."""
    previous = env.reset(seed=SEED)
    texts = []
    for word in words:
        result = env.step(f"[{word}]" if word else "no guess")
        texts.append(observation_text(previous, result))
        previous = result
    return texts


def test_off_by_default_and_on_with_the_rule() -> None:
    words = WordLists.load()
    guesses = wrong_guesses(SEED, 2)
    plain = WordleEnvironment(WordleRules(), words)
    off = play(plain, [*guesses, answer(SEED)])
    assert not any(HEAD in t for t in off) and "what all the feedback" not in plain.prompt
    assert off[0].endswith("You have 5 guesses left.")

    summary = WordleEnvironment(WordleRules(feedback_summary=True), words)
    on = play(summary, [guesses[0], "", guesses[1], answer(SEED)])
    assert "what all the feedback so far shows" in summary.prompt
    history = [(w, score_guess(w, answer(SEED))) for w in guesses]
    # the plain feedback, then the summary of every guess so far, then the guesses left
    assert on[0].startswith(off[0].split("\n\nYou have")[0])
    assert f"\n\n{known_summary(history[:1])}\n\nYou have 5 guesses left." in on[0]
    assert known_summary(history[:1]) in on[1]  # an invalid move: the same knowledge again
    assert f"{known_summary(history)}\n\nYou have 4 guesses left." in on[2]
    assert HEAD not in on[3] and "Congratulations" in on[3]  # the game is over: no summary


def test_reset_option_per_episode() -> None:
    server = WordleRules()
    assert apply_options(server, ResetOptions(feedback_summary=True)).feedback_summary
    assert not apply_options(server, ResetOptions(max_guesses=2)).feedback_summary
    on = WordleRules(feedback_summary=True)
    assert not apply_options(on, ResetOptions(feedback_summary=False)).feedback_summary
    assert apply_options(on, ResetOptions(reward="final")).feedback_summary


def test_setting_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from deltarl.env_server.settings import EnvSettings

    assert not settings().rules().feedback_summary
    monkeypatch.setenv("DELTARL_ENV_FEEDBACK_SUMMARY", "true")
    assert EnvSettings().rules().feedback_summary


def test_http_and_ws(client: TestClient, make_client: Callable[..., TestClient]) -> None:
    (word,) = wrong_guesses(SEED, 1)
    body = {"seed": SEED, "options": {"feedback_summary": True}}
    sid = client.post("/reset", json=body).json()["session_id"]
    step = client.post("/step", json={"session_id": sid, "action": {"message": f"[{word}]"}})
    assert HEAD in step.json()["observation"]["messages"][-1]["content"]
    # the next reset without options plays the server's rules again
    client.post("/reset", json={"session_id": sid, "seed": SEED})
    step = client.post("/step", json={"session_id": sid, "action": {"message": f"[{word}]"}})
    assert HEAD not in step.json()["observation"]["messages"][-1]["content"]
    bad = client.post("/reset", json={"options": {"feedback_summary": [1]}})
    assert bad.status_code == 422 and "feedback_summary" in bad.text

    server = make_client(feedback_summary=True)
    assert "summary" in server.get("/metadata").json()["description"]
    assert "summary" not in client.get("/metadata").json()["description"]
    sid = server.post("/reset", json={"seed": SEED}).json()["session_id"]
    step = server.post("/step", json={"session_id": sid, "action": {"message": f"[{word}]"}})
    assert HEAD in step.json()["observation"]["messages"][-1]["content"]
    with client.websocket_connect("/ws") as ws:
        ws.send_text(json.dumps({"type": "reset", "data": body}))
        ws.receive_json()
        ws.send_text(json.dumps({"type": "step", "data": {"message": f"[{word}]"}}))
        messages = ws.receive_json()["data"]["observation"]["messages"]
        assert HEAD in messages[-1]["content"]


def test_charset_refuses_the_option(make_client: Callable[..., TestClient]) -> None:
    bad = make_client(task="charset").post("/reset", json={"options": {"feedback_summary": True}})
    assert bad.status_code == 422


def test_solver_transcripts_carry_it(tmp_path: Path) -> None:
    out = tmp_path / "games.jsonl"
    transcripts.main(["--games", "3", "--out", str(out), "--feedback-summary"])
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(records) == 3
    for r in records:
        users = [m["content"] for m in r["messages"] if m["role"] == "user"]
        assert "what all the feedback so far shows" in users[0]
        assert all(HEAD in u for u in users[1:]) and len(users) == r["guesses"]
        guesses = [m["content"].strip("[]") for m in r["messages"] if m["role"] == "assistant"]
        history = [(g, score_guess(g, answer(r["seed"]))) for g in guesses]
        assert known_summary(history[:1]) in users[1]
    plain = tmp_path / "plain.jsonl"
    transcripts.main(["--games", "2", "--out", str(plain)])
    assert HEAD not in plain.read_text()
