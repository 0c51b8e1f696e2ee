"""A Wordle reference player: every guess is consistent with all feedback so far.

It plays the same :class:`~.wordle.WordleGame` the server runs, so its win rate under given
:class:`~.wordle.WordleRules` is the bar a trained policy can be held to, and its games are
the material of a supervised warm start. Strategy: open with ``first`` (default "crane"); then,
among the answers still consistent with every pattern seen, play the one that splits the
remaining candidates into the most distinct feedback patterns (ties broken by the seeded
generator; with more than ``exhaustive_up_to`` candidates, a seeded random consistent one, to
stay fast). Example::

    from deltarl.env_server.wordle.solver import Solver, win_rate
    Solver(seed=0).play(WordleGame(WordleRules(), WordLists.load(), seed=7))
    win_rate(WordleRules(max_guesses=6), games=200)   # {"win_rate": ..., "mean_guesses": ...}

``python -m deltarl.env_server.wordle.solver --games 500 --max-guesses 6`` prints the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from deltarl.env_server.wordle.game import (
    WordleGame,
    WordleRules,
    WordLists,
    consistent,
    score_guess,
)


@dataclass
class Solver:
    """Picks guesses consistent with all feedback (see the module docstring)."""

    words: WordLists = field(default_factory=WordLists.load)
    seed: int = 0
    first: str = "crane"
    exhaustive_up_to: int = 200
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def candidates(self, history: Sequence[tuple[str, str]]) -> list[str]:
        return [w for w in self.words.answers if consistent(w, history)]

    def guess(self, history: Sequence[tuple[str, str]]) -> str:
        """The next guess after ``history`` (never a word guessed before)."""
        if not history:
            return self.first
        seen = {g for g, _ in history}
        left = [w for w in self.candidates(history) if w not in seen]
        if not left:  # the answer is not in the list (cannot happen with the server's answers)
            left = sorted(self.words.allowed - seen)
        if len(left) > self.exhaustive_up_to:
            return self._rng.choice(left)
        splits = [len({score_guess(w, answer) for answer in left}) for w in left]
        best = max(splits)
        return self._rng.choice([w for w, s in zip(left, splits, strict=True) if s == best])

    def play(self, game: WordleGame) -> WordleGame:
        """Play ``game`` to its end (bracketed guesses, as a model must write them)."""
        while not game.done:
            game.play(f"[{self.guess(game.guesses)}]")
        return game


def win_rate(rules: WordleRules, games: int, *, seed: int = 0) -> dict[str, float]:
    """Play ``games`` games (answers from seeds ``seed .. seed + games - 1``)."""
    words = WordLists.load()
    solver = Solver(words, seed=seed)
    played = [solver.play(WordleGame(rules, words, seed=seed + i)) for i in range(games)]
    won = [g for g in played if g.won]
    return {
        "games": games,
        "max_guesses": rules.max_guesses,
        "win_rate": len(won) / games,
        "mean_guesses_when_won": statistics.fmean(len(g.guesses) for g in won) if won else 0.0,
        "mean_final_reward": statistics.fmean(g.final_reward() for g in played),
    }


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Win rate of the reference Wordle player.")
    ap.add_argument("--games", type=int, default=500)
    ap.add_argument("--max-guesses", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(json.dumps(win_rate(WordleRules(max_guesses=a.max_guesses), a.games, seed=a.seed)))


if __name__ == "__main__":
    main()
