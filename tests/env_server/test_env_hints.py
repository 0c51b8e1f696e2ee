"""The tasks' own hints (env_server/wordle/hints.py, env_server/charset/hints.py): computed by
the environment after every move and sent with the observation (``observation.hint``), never
in the messages the player sees."""

from __future__ import annotations

import pytest

from deltarl.env_server.charset.environment import CharsetEnvironment, CharsetRules
from deltarl.env_server.charset.hints import charset_hint
from deltarl.env_server.core.wire import TaskHint
from deltarl.env_server.wordle.environment import WordleEnvironment
from deltarl.env_server.wordle.game import WordleRules, WordLists
from deltarl.env_server.wordle.hints import FORMAT_HINT, move_hint


def wordle_hint(moves: list[tuple[str | None, str | None]]) -> tuple[int, str] | None:
    """(move, hint) of the first move that went wrong, as the environment finds it move by
    move: each against the scored guesses before it."""
    scored: list[tuple[str, str]] = []
    for i, (guess, pattern) in enumerate(moves):
        text = move_hint(guess, scored)
        if text is not None:
            return i, text
        if guess is not None and pattern is not None:
            scored.append((guess, pattern))
    return None


@pytest.mark.parametrize(
    ("moves", "turn", "says"),
    [
        ([("crane", "XXXXX"), ("crane", None)], 1, "already guessed"),
        ([("crane", "XXXXX"), ("slate", "XXXXX")], 1, "A is not in the word"),
        ([("crane", "GXXXX"), ("sloth", "XXXXX")], 1, "Letter 1 is known to be C"),
        ([("crane", "XYXXX"), ("moist", "XXXXX")], 1, "R is in the word"),
        ([("crane", "XYXXX"), ("prism", "XGXXX")], 1, "R was yellow at position 2"),
        ([(None, None), ("moist", "XXXXX")], 0, "square brackets"),
        ([("crane", "GXXXX"), ("cr", None)], 1, "5-letter word"),
    ],
)
def test_the_wordle_hint_names_the_move_that_ignored_the_feedback(
    moves: list[tuple[str | None, str | None]], turn: int, says: str
) -> None:
    found = wordle_hint(moves)
    assert found is not None and found[0] == turn and says in found[1], found


def test_the_wordle_hint_is_silent_on_consistent_play() -> None:
    assert wordle_hint([("crane", "GYXXG"), ("chore", "GGGGG")]) is None
    assert wordle_hint([]) is None


def test_a_wordle_observation_carries_the_hint_not_the_transcript() -> None:
    env = WordleEnvironment(WordleRules(max_invalid_moves=3), WordLists.load())
    first = env.reset(seed=3)
    assert first.observation.hint is None
    ok = env.step("[crane]")
    if ok.done:  # the answer: nothing to hint
        return
    assert ok.observation.hint is None
    again = env.step("[crane]")  # a repeat: invalid, tolerated
    assert again.observation.hint == TaskHint(
        turn=1, text="[crane] was already guessed; every guess must be a new word."
    )
    garbled = env.step("no brackets at all")
    assert garbled.observation.hint == again.observation.hint  # the first mistake stays
    shown = " ".join(m.content for m in garbled.observation.messages)
    assert "every guess must be a new word" not in shown
    assert env.reset(seed=3).observation.hint is None  # a new episode starts clean
    assert env.step("nothing").observation.hint == TaskHint(turn=0, text=FORMAT_HINT)


CAPITALS = CharsetRules(target="ABCDEFGHIJKLMNOPQRSTUVWXYZ")


@pytest.mark.parametrize(
    ("reply", "says"),
    [
        ("Hello world", "Reply in CAPITAL LETTERS only, without lowercase letters or spaces,"),
        ("HI 42!\n", "without digits, spaces, line breaks or other characters (!),"),
        ("HELLO", "Reply with at least 8 characters, in CAPITAL LETTERS only,"),
        ("", "Reply with at least 8 characters"),
    ],
)
def test_the_charset_hint_names_what_cost_points(reply: str, says: str) -> None:
    env = CharsetEnvironment(CAPITALS)
    env.reset(seed=0)
    result = env.step(reply)
    assert result.reward is not None and result.reward < 1.0
    hint = result.observation.hint
    assert hint is not None and hint.turn == 0 and says in hint.text, hint
    assert hint.text.endswith("for example: HELLOWORLD")
    assert hint.text not in " ".join(m.content for m in result.observation.messages)


def test_the_charset_hint_s_example_scores_full_marks_under_any_target() -> None:
    for rules in (CAPITALS, CharsetRules(), CharsetRules(target="xyz", min_chars=5)):
        hint = charset_hint("Oops", rules)
        assert hint is not None
        example = hint.rsplit("for example: ", 1)[1]
        env = CharsetEnvironment(rules)
        env.reset(seed=0)
        full = env.step(example)
        assert full.reward == 1.0 and full.observation.hint is None, hint
