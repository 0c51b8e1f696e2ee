"""Wordle game logic: pure, synchronous, no I/O besides loading the word lists once.

* :func:`score_guess` computes the G/Y/X pattern in two passes exactly like the real game.
* :func:`extract_guess` finds the first ``[word]`` in free model text.
* :class:`WordleGame` is one episode: it applies moves under :class:`WordleRules`, keeps the
  structured history and computes rewards. It never exposes the answer itself; the server decides
  what to reveal (see ``models.py``).

Example::

    game = WordleGame(WordleRules(), WordLists.load(), seed=7)
    move = game.play("I think [crane]")
    move.pattern  # e.g. "XYGXX"
"""

from __future__ import annotations

import random
import re
import secrets
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cache
from importlib import resources

from deltarl.env_server.wordle.options import MAX_SHAPING_WEIGHT

WORD_LENGTH = 5

# First bracketed run of ASCII letters, spaces allowed inside the brackets. Possessive quantifiers
# keep the scan linear on adversarial input ("[[[[", "[aaaa...").
_BRACKETED = re.compile(r"\[[ \t]*+([A-Za-z]++)[ \t]*+\]")


class InvalidReason(StrEnum):
    """Why a move was not accepted as a guess (``last_move.invalid_reason`` on the wire)."""

    NO_GUESS = "no_guess"  # no [word] of ASCII letters in the message
    WRONG_LENGTH = "wrong_length"  # a bracketed word, but not 5 letters
    NOT_A_WORD = "not_a_word"  # 5 letters, not in the allowed-guess list
    REPEATED_GUESS = "repeated_guess"  # a word already guessed in this episode


def score_guess(guess: str, answer: str) -> str:
    """G/Y/X pattern of ``guess`` against ``answer`` (both lowercase, same length).

    Pass 1 marks exact matches G and removes them from the pool of answer letters; pass 2 walks
    the guess left to right and marks a letter Y only while the pool still holds that letter, so a
    letter guessed twice but present once gets one mark (G wins over Y).
    """
    assert len(guess) == len(answer), (guess, answer)
    pattern = ["X"] * len(guess)
    pool: Counter[str] = Counter()
    for i, (g, a) in enumerate(zip(guess, answer, strict=True)):
        if g == a:
            pattern[i] = "G"
        else:
            pool[a] += 1
    for i, g in enumerate(guess):
        if pattern[i] != "G" and pool[g] > 0:
            pattern[i] = "Y"
            pool[g] -= 1
    return "".join(pattern)


def consistent(word: str, history: Sequence[tuple[str, str]]) -> bool:
    """Would ``word`` as the answer have produced every ``(guess, pattern)`` of ``history``?"""
    return all(score_guess(guess, word) == pattern for guess, pattern in history)


def known_summary(history: Sequence[tuple[str, str]]) -> str:
    """What every ``(guess, pattern)`` of ``history`` says together, as text for the player.

    Three lines, letters uppercase, positions 1-5::

        Known so far:
        Letters in place: C _ A _ _
        In the word, not in place: R (not at 2), E (not at 4, 5)
        Not in the word: N, S, T

    Only statements the feedback proves: a green fixes its position; a yellow letter is in the
    word and not where it was yellow (listed only while it is not green somewhere: a later
    green is the same letter found); a letter is absent only when no guess marked it green or
    yellow (an X beside a G or Y of the same letter only bounds how often it occurs, and is
    left out). Empty history: an empty string.
    """
    if not history:
        return ""
    placed = ["_"] * WORD_LENGTH
    yellow_at: dict[str, set[int]] = {}
    present: set[str] = set()
    marked_x: set[str] = set()
    for guess, pattern in history:
        for i, (letter, mark) in enumerate(zip(guess.upper(), pattern, strict=True)):
            if mark == "G":
                placed[i] = letter
                present.add(letter)
            elif mark == "Y":
                yellow_at.setdefault(letter, set()).add(i + 1)
                present.add(letter)
            else:
                marked_x.add(letter)
    elsewhere = [
        f"{letter} (not at {', '.join(map(str, sorted(at)))})"
        for letter, at in sorted(yellow_at.items())
        if letter not in placed
    ]
    absent = sorted(marked_x - present)
    return (
        "Known so far:\n"
        f"Letters in place: {' '.join(placed)}\n"
        f"In the word, not in place: {', '.join(elsewhere) or 'none'}\n"
        f"Not in the word: {', '.join(absent) or 'none'}"
    )


def extract_guess(message: str) -> str | None:
    """The first bracketed run of ASCII letters in ``message``, lowercased, or ``None``.

    ``"I'll try [CRANE] then [slate]"`` -> ``"crane"``; ``"[ crane ]"`` -> ``"crane"``;
    ``"[cr4ne] [toast]"`` -> ``"toast"`` (a bracket holding anything but letters is skipped);
    ``"crane"`` -> ``None``. The length is checked by the game, not here.
    """
    match = _BRACKETED.search(message)
    return match.group(1).lower() if match else None


@dataclass(frozen=True, slots=True)
class WordLists:
    """The answer list (secrets are drawn from it) and the allowed-guess list (a superset)."""

    answers: tuple[str, ...]
    allowed: frozenset[str]

    @staticmethod
    @cache
    def load() -> WordLists:
        """The lists shipped in ``env_server/wordle/data`` (see ``data/WORDLISTS.md``), loaded once."""
        data = resources.files(__package__).joinpath("data")
        answers = _read_words(data.joinpath("answers.txt").read_text("ascii"))
        allowed = frozenset(_read_words(data.joinpath("allowed.txt").read_text("ascii")))
        assert answers and allowed.issuperset(answers), (
            "answers.txt must be a subset of allowed.txt"
        )
        return WordLists(answers=answers, allowed=allowed)


def _read_words(text: str) -> tuple[str, ...]:
    return tuple(w for w in (line.strip() for line in text.splitlines()) if w and w[0] != "#")


@dataclass(frozen=True, slots=True)
class WordleRules:
    """How a game is played and scored; the server builds it from ``EnvSettings``.

    * ``max_guesses``: valid guesses per episode (6 in the real game).
    * ``max_invalid_moves``: invalid moves tolerated per episode; the next one forfeits the game
      (final reward 0). ``0`` means the first invalid move forfeits.
    * ``invalid_costs_guess``: a tolerated invalid move also uses up one of the guesses.
    * ``allow_non_words``: accept any 5 ASCII letters as a guess (no dictionary check).
    * ``allow_repeats``: score a repeated guess normally instead of treating it as invalid.
    * ``partial_credit``: weight of the partial credit on a loss (see :meth:`final_reward`);
      ``0`` gives a pure 0/1 reward.
    * ``format_credit``: share of a lost (or forfeited) game's reward earned by playing valid
      moves: ``format_credit * valid moves / moves``, the rest from the partial credit (see
      :meth:`final_reward`); a win is still 1.0. ``0`` (the default): no format term.
    * ``shaping``: ``None`` (the default) scores the game by :meth:`WordleGame.final_reward`
      alone, on its last step; a :class:`Shaping` scores every move instead (per-turn rewards,
      see :class:`Shaping`), and ``partial_credit``/``format_credit`` are then unused.
    * ``feedback_summary``: each feedback message also states what all the feedback so far
      says (:func:`known_summary`), so the player need not combine the patterns itself.
    """

    max_guesses: int = 6
    max_invalid_moves: int = 1
    invalid_costs_guess: bool = False
    allow_non_words: bool = False
    allow_repeats: bool = False
    partial_credit: float = 1.0
    format_credit: float = 0.0
    shaping: Shaping | None = None
    feedback_summary: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.format_credit < 1.0:
            raise ValueError(f"format_credit must be in [0, 1), got {self.format_credit}")
        if self.max_guesses < 1:
            raise ValueError(f"max_guesses must be >= 1, got {self.max_guesses}")


@dataclass(frozen=True, slots=True)
class Shaping:
    """Per-turn reward shaping: every move is scored, not only the game's end.

    The reward of move ``t`` (what the step that plays it answers) is a weighted sum of that
    move's reward signals (``observation.reward_signals``, each in [0, 1])::

        r_t = win * correct_t + greens * greens_t + yellows * yellows_t + format * valid_t
              + consistent * consistent_t - repetition * repetition_t - invalid * invalid_t

    with ``correct_t`` 1 when the guess is the answer, ``greens_t``/``yellows_t`` the greens /
    yellows of the guess divided by 5 (0 for an invalid move), ``valid_t`` 1 when the move was
    accepted and scored, ``consistent_t`` 1 when the move was valid and its word could still be
    the answer given every earlier (guess, pattern) of the episode (:func:`consistent`; 0 for
    the episode's first valid guess, which has no feedback to use, and for an invalid move),
    ``repetition_t`` 1 when the word had been guessed before in the episode,
    ``invalid_t = 1 - valid_t``. The episode's return is the sum of its steps' rewards,
    ``R = sum_t r_t``: a forfeit (or a game cut short) keeps what its earlier moves earned, the
    format term included. Every weight is >= 0 (the last two are penalties, subtracted).

    ``fill_unplayed`` (default on): the winning move also earns, for each guess the win left
    unplayed, what a perfect move earns besides the win, ``greens + format + consistent``.
    Without it the per-move terms pay for lasting: with ``consistent = 0.3`` six valid,
    consistent, losing guesses (about 6 x 0.45) outscore a win at the third (about 2.25), and
    GRPO learns to play on rather than to win. With it, and ``yellows <= greens``, winning at a
    move is worth at least ``win`` more than any way of not winning from there, and winning
    earlier never less than winning later.
    """

    win: float = 1.0
    greens: float = 0.0
    yellows: float = 0.0
    format: float = 0.0
    repetition: float = 0.0
    invalid: float = 0.0
    consistent: float = 0.0
    fill_unplayed: bool = True

    def __post_init__(self) -> None:
        for name in ("win", "greens", "yellows", "format", "repetition", "invalid", "consistent"):
            value = getattr(self, name)
            if not 0.0 <= value <= MAX_SHAPING_WEIGHT:
                raise ValueError(
                    f"shaping weight {name} must be in [0, {MAX_SHAPING_WEIGHT:g}], got {value}"
                )

    def move_reward(self, pattern: str | None, repeated: bool, uses_feedback: bool) -> float:
        """``r_t`` of a move: ``pattern`` its G/Y/X pattern (None if the move was invalid),
        ``uses_feedback`` its ``consistent_t`` (:attr:`Move.consistent`)."""
        valid = pattern is not None
        pattern = pattern or ""
        reward = (
            self.win * (pattern == "G" * WORD_LENGTH)
            + self.greens * pattern.count("G") / WORD_LENGTH
            + self.yellows * pattern.count("Y") / WORD_LENGTH
            + self.format * valid
            + self.consistent * (valid and uses_feedback)
            - self.repetition * repeated
            - self.invalid * (not valid)
        )
        return float(reward)

    def unplayed_reward(self, guesses_left: int) -> float:
        """What a win earns for the ``guesses_left`` guesses it left unplayed (0 without
        ``fill_unplayed``)."""
        if not self.fill_unplayed:
            return 0.0
        return float(guesses_left * (self.greens + self.format + self.consistent))


@dataclass(slots=True)
class Move:
    """The outcome of one :meth:`WordleGame.play` call."""

    guess: str | None  # extracted word (lowercase) or None when no [word] was found
    pattern: str | None  # G/Y/X pattern if the move was a valid guess
    invalid_reason: InvalidReason | None
    repeated: bool  # the extracted word had already been guessed this episode
    # a valid guess after at least one earlier valid guess, consistent with all their patterns
    consistent: bool
    reward: float  # shaped: this move's r_t; else the final reward if it ended the game, or 0

    @property
    def valid(self) -> bool:
        return self.invalid_reason is None


@dataclass(slots=True)
class WordleGame:
    """One episode. The answer comes from ``seed`` (reproducible) or from a fresh random seed."""

    rules: WordleRules
    words: WordLists
    seed: int | None = None
    answer: str = field(init=False)
    guesses: list[tuple[str, str]] = field(default_factory=list, init=False)  # (word, pattern)
    invalid_moves: int = field(default=0, init=False)
    moves: int = field(default=0, init=False)  # every play() call, valid or not
    won: bool = field(default=False, init=False)
    forfeited: bool = field(default=False, init=False)
    total_reward: float = field(default=0.0, init=False)  # sum of the moves' rewards (the return)

    def __post_init__(self) -> None:
        self.answer = answer_for_seed(self.words, self.seed)

    @property
    def done(self) -> bool:
        return self.won or self.forfeited or self.guesses_left == 0

    @property
    def guesses_left(self) -> int:
        used = len(self.guesses) + (self.invalid_moves if self.rules.invalid_costs_guess else 0)
        return max(self.rules.max_guesses - used, 0)

    @property
    def invalid_moves_left(self) -> int:
        return max(self.rules.max_invalid_moves - self.invalid_moves, 0)

    def play(self, message: str) -> Move:
        """Apply one move. The caller must not call this once :attr:`done` is true."""
        assert not self.done, "play() after the game ended"
        self.moves += 1
        guess = extract_guess(message)
        repeated = guess is not None and any(guess == g for g, _ in self.guesses)
        reason = self._invalid_reason(guess, repeated)
        if reason is not None:
            self.invalid_moves += 1
            if self.invalid_moves > self.rules.max_invalid_moves:
                self.forfeited = True
            return Move(guess, None, reason, repeated, False, self._reward(None, repeated, False))
        assert guess is not None
        uses_feedback = bool(self.guesses) and consistent(guess, self.guesses)
        pattern = score_guess(guess, self.answer)
        self.guesses.append((guess, pattern))
        self.won = guess == self.answer
        reward = self._reward(pattern, repeated, uses_feedback)
        return Move(guess, pattern, None, repeated, uses_feedback, reward)

    def _reward(self, pattern: str | None, repeated: bool, uses_feedback: bool) -> float:
        shaping = self.rules.shaping
        if shaping is not None:
            reward = shaping.move_reward(pattern, repeated, uses_feedback)
            if self.won:
                reward += shaping.unplayed_reward(self.guesses_left)
        else:
            reward = self.final_reward() if self.done else 0.0
        self.total_reward += reward
        return reward

    def _invalid_reason(self, guess: str | None, repeated: bool) -> InvalidReason | None:
        if guess is None:
            return InvalidReason.NO_GUESS
        if len(guess) != WORD_LENGTH:
            return InvalidReason.WRONG_LENGTH
        if not self.rules.allow_non_words and guess not in self.words.allowed:
            return InvalidReason.NOT_A_WORD
        if repeated and not self.rules.allow_repeats:
            return InvalidReason.REPEATED_GUESS
        return None

    def final_reward(self) -> float:
        """1.0 on a win. Otherwise ``f * valid moves / moves + (1 - f) * credit`` with ``f`` the
        rules' ``format_credit`` (0 by default) and ``credit``: 0.0 on a forfeit (too many
        invalid moves) or without a valid guess, else ``partial_credit * (greens + 0.5 *
        yellows) / 5`` of the last valid guess (OpenEnv TextArena's convention). A forfeit
        keeps what its valid moves earned."""
        if self.won:
            return 1.0
        f = self.rules.format_credit
        shaped = f * len(self.guesses) / self.moves if self.moves else 0.0
        if self.forfeited or not self.guesses:
            return shaped
        pattern = self.guesses[-1][1]
        credit = (pattern.count("G") + 0.5 * pattern.count("Y")) / WORD_LENGTH
        return shaped + (1.0 - f) * self.rules.partial_credit * credit


def answer_for_seed(words: WordLists, seed: int | None) -> str:
    """The answer an episode with this seed gets: ``random.Random(seed)`` picks from the answer
    list (stable across Python versions for integer seeds). ``None`` draws a secret seed."""
    if seed is None:
        seed = secrets.randbits(64)
    return words.answers[random.Random(seed).randrange(len(words.answers))]
