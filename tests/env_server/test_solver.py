"""The reference Wordle player (env_server/wordle/solver.py): consistent guesses, never a repeat, wins."""

from __future__ import annotations

import pytest

from deltarl.env_server.wordle.game import WordleGame, WordleRules, WordLists, score_guess
from deltarl.env_server.wordle.solver import Solver, consistent, win_rate

WORDS = WordLists.load()


def test_consistency_is_the_feedback_the_answer_would_give() -> None:
    history = [("crane", score_guess("crane", "cobra")), ("slate", score_guess("slate", "cobra"))]
    assert consistent("cobra", history)
    assert not consistent("crane", history)
    assert all(consistent(w, history) for w in Solver().candidates(history))
    assert "cobra" in Solver().candidates(history)


@pytest.mark.parametrize("seed", [1, 7, 42])
def test_every_guess_is_consistent_new_and_valid(seed: int) -> None:
    game = WordleGame(WordleRules(), WORDS, seed=seed)
    solver = Solver(seed=seed)
    while not game.done:
        guess = solver.guess(game.guesses)
        assert guess in WORDS.allowed and guess not in {g for g, _ in game.guesses}
        assert consistent(guess, game.guesses)
        move = game.play(f"[{guess}]")
        assert move.valid
    assert game.won and game.answer in {g for g, _ in game.guesses}


@pytest.mark.slow
def test_win_rate_is_high_with_six_guesses_and_lower_with_three() -> None:
    six = win_rate(WordleRules(max_guesses=6), games=30, seed=100)
    three = win_rate(WordleRules(max_guesses=3), games=30, seed=100)
    assert six["win_rate"] >= 0.9 and 3.0 <= six["mean_guesses_when_won"] <= 5.0
    assert three["win_rate"] < six["win_rate"]
