"""Game logic: two-pass feedback, guess extraction, rules, rewards, seeds, word lists."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import GENEROUS_S

from deltarl.env_server.wordle import derive_wordlists
from deltarl.env_server.wordle.game import (
    InvalidReason,
    WordleGame,
    WordleRules,
    WordLists,
    answer_for_seed,
    extract_guess,
    score_guess,
)

WORDS = WordLists.load()
DATA = Path(derive_wordlists.__file__).parent / "data"


@pytest.mark.parametrize(
    ("guess", "answer", "pattern"),
    [
        ("crane", "crane", "GGGGG"),
        ("eerie", "crane", "XXYXG"),  # one E in the answer: the green one takes it
        ("eerie", "lever", "YGYXX"),  # two Es: one green, one yellow, the third grey
        ("speed", "abide", "XXYXY"),  # repeated E in the guess, one E in the answer
        ("llama", "hello", "YYXXX"),  # two Ls in both: both yellow, no third
        ("allee", "eagle", "YYXYG"),
        ("abbey", "kebab", "YYGYX"),
        ("mamma", "maxim", "GGYXX"),  # three Ms guessed, two in the answer
    ],
)
def test_score_guess_known_cases(guess: str, answer: str, pattern: str) -> None:
    assert score_guess(guess, answer) == pattern


letters = st.text(alphabet="abcdez", min_size=5, max_size=5)  # small alphabet: many repeats


@given(letters, letters)
def test_score_guess_invariants(guess: str, answer: str) -> None:
    pattern = score_guess(guess, answer)
    assert all((p == "G") == (g == a) for p, g, a in zip(pattern, guess, answer, strict=True))
    # per letter, G + Y marks equal min(count in guess, count in answer): the real game's rule
    marked = Counter(g for g, p in zip(guess, pattern, strict=True) if p != "X")
    assert marked == Counter(guess) & Counter(answer)
    # yellows go to the leftmost unmatched copies
    for i, (g, p) in enumerate(zip(guess, pattern, strict=True)):
        if p == "X":
            later_yellow = any(guess[j] == g and pattern[j] == "Y" for j in range(i + 1, 5))
            assert not later_yellow


@pytest.mark.parametrize(
    ("text", "guess"),
    [
        ("[crane]", "crane"),
        ("I think [CRANE] or maybe [slate]", "crane"),
        ("[ Crane ]", "crane"),
        ("[cr4ne] then [toast]", "toast"),
        ("[x]", "x"),
        ("crane", None),
        ("", None),
        ("[]", None),
        ("[crané]", None),
        ("\x00[\x07crane\x1b]", None),
        ("日本語 [étoile] [ABBEY]", "abbey"),
    ],
)
def test_extract_guess(text: str, guess: str | None) -> None:
    assert extract_guess(text) == guess


@given(st.text(max_size=300))
def test_extract_guess_total(text: str) -> None:
    got = extract_guess(text)
    assert got is None or (got.isascii() and got.isalpha() and got.islower())
    if got is not None:
        assert got in text.lower()


def test_extract_guess_is_linear_on_adversarial_input() -> None:
    import time

    # 400,000 characters: linear time is milliseconds, quadratic backtracking would be minutes
    for text in ("[" * 400_000, "[" + "a" * 400_000, "[a" * 200_000, "[ " * 200_000 + "]"):
        started = time.perf_counter()
        extract_guess(text)
        assert time.perf_counter() - started < GENEROUS_S


def game(seed: int | None = 1, **rules: Any) -> WordleGame:
    return WordleGame(WordleRules(**rules), WORDS, seed=seed)


def test_seed_is_reproducible_and_pinned() -> None:
    assert game(1).answer == game(1).answer == "cobra"  # pinned: changing the draw breaks evals
    assert answer_for_seed(WORDS, 0) == "mixer"
    assert len({answer_for_seed(WORDS, s) for s in range(200)}) > 150
    assert len({game(seed=None).answer for _ in range(20)}) > 1


def test_win_on_third_guess() -> None:
    g = game()
    assert g.play("[crane]").pattern == "GYYXX"
    move = g.play("[slate]")
    assert move.valid and move.reward == 0.0 and not g.done
    move = g.play("Final answer: [COBRA]")
    assert move.pattern == "GGGGG" and g.won and g.done and move.reward == 1.0
    assert g.guesses_left == 3


def test_loss_gives_partial_credit_of_last_guess() -> None:
    g = game()
    for word in ("fight", "blown", "tulip", "pious", "dumpy"):
        assert g.play(f"[{word}]").reward == 0.0
    move = g.play("[crane]")  # GYYXX against cobra: (1 + 0.5 * 2) / 5
    assert g.done and not g.won
    assert move.reward == pytest.approx(0.4)
    assert game(partial_credit=0.0).final_reward() == 0.0


def test_format_credit_shapes_losses_and_forfeits_but_not_wins() -> None:
    g = game(format_credit=0.25)
    assert g.play("no guess here").reward == 0.0  # tolerated invalid move
    for word in ("fight", "blown", "tulip", "pious", "dumpy"):
        assert g.play(f"[{word}]").reward == 0.0
    move = g.play("[crane]")  # 6 valid moves of 7, last guess GYYXX: credit 0.4
    assert g.done and move.reward == pytest.approx(0.25 * 6 / 7 + 0.75 * 0.4)
    forfeit = game(format_credit=0.25, max_invalid_moves=0)
    forfeit.play("[crane]")
    move = forfeit.play("[zzzzz]")  # forfeits: keeps what its one valid move of two earned
    assert forfeit.forfeited and move.reward == pytest.approx(0.25 * 1 / 2)
    win = game(format_credit=0.25)
    win.play("hello")
    assert win.play("[cobra]").reward == 1.0
    with pytest.raises(ValueError, match="format_credit"):
        WordleRules(format_credit=1.0)


def test_invalid_moves_tolerance_and_forfeit() -> None:
    g = game()
    move = g.play("no brackets here")
    assert move.invalid_reason is InvalidReason.NO_GUESS and not g.done
    assert g.guesses_left == 6 and g.invalid_moves_left == 0
    move = g.play("[crane]")
    assert move.valid
    move = g.play("[abcde]")  # second invalid move: forfeit
    assert move.invalid_reason is InvalidReason.NOT_A_WORD
    assert g.done and g.forfeited and move.reward == 0.0


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ("hello", InvalidReason.NO_GUESS),
        ("[cat]", InvalidReason.WRONG_LENGTH),
        ("[catcher]", InvalidReason.WRONG_LENGTH),
        ("[zzzzz]", InvalidReason.NOT_A_WORD),
    ],
)
def test_invalid_reasons(message: str, reason: InvalidReason) -> None:
    assert game().play(message).invalid_reason is reason


def test_repeats_and_options() -> None:
    g = game(max_invalid_moves=3)
    g.play("[crane]")
    move = g.play("[crane]")
    assert move.invalid_reason is InvalidReason.REPEATED_GUESS and move.repeated
    g = game(allow_repeats=True)
    g.play("[crane]")
    move = g.play("[crane]")
    assert move.valid and move.repeated and g.guesses_left == 4
    assert game(allow_non_words=True).play("[zzzzz]").valid
    g = game(invalid_costs_guess=True)
    g.play("[zzzzz]")
    assert g.guesses_left == 5
    g = game(max_invalid_moves=0)
    g.play("oops")
    assert g.done and g.forfeited


def test_word_lists() -> None:
    assert set(WORDS.answers) <= WORDS.allowed
    assert all(len(w) == 5 and w.isascii() and w.isalpha() and w.islower() for w in WORDS.allowed)
    assert list(WORDS.answers) == sorted(WORDS.answers)
    assert len(WORDS.answers) == 2945 and len(WORDS.allowed) == 4667
    assert "boats" not in WORDS.answers and "boats" in WORDS.allowed  # plural of a word
    assert "glass" in WORDS.answers and "crane" in WORDS.answers
    for name in ("WORDLISTS.md", "SCOWL-COPYRIGHT.txt"):
        assert (DATA / name).is_file()


@pytest.mark.skipif(
    not Path("/usr/share/dict/american-english").exists(), reason="needs apt-get install wamerican"
)
def test_derivation_reproduces_shipped_lists(tmp_path: Path) -> None:
    derive_wordlists.main(["/usr/share/dict/american-english", "--out", str(tmp_path)])
    for name in ("answers.txt", "allowed.txt"):
        assert (tmp_path / name).read_text() == (DATA / name).read_text()
