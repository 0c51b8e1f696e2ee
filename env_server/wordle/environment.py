"""One Wordle session as the wire sees it: reset/step/state in, pydantic wire models out.

:class:`WordleEnvironment` owns a :class:`~.wordle.WordleGame`, builds the TextArena-style
transcript and the structured fields, and decides what is revealed: the answer only appears once
the game is done (or always, with ``reveal_answer`` for debugging).
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Literal

from deltarl.env_server.core.models import (
    EnvError,
    ErrorCode,
    StepResult,
    TextMessage,
)
from deltarl.env_server.core.wire import TaskHint
from deltarl.env_server.wordle.curriculum import GuessCurriculum
from deltarl.env_server.wordle.game import (
    WORD_LENGTH,
    InvalidReason,
    Move,
    Shaping,
    WordleGame,
    WordleRules,
    WordLists,
    known_summary,
)
from deltarl.env_server.wordle.hints import move_hint
from deltarl.env_server.wordle.models import (
    GuessFeedback,
    LastMove,
    RewardSignals,
    WordleObservation,
    WordleState,
)
from deltarl.env_server.wordle.options import ResetOptions

GAME_ID = -1
PLAYER_ID = 0

_INVALID_TEXT = {
    InvalidReason.NO_GUESS: "no guess found: put a 5-letter word in square brackets, e.g. [crane]",
    InvalidReason.WRONG_LENGTH: "[{guess}] does not have 5 letters",
    InvalidReason.NOT_A_WORD: "[{guess}] is not in the word list",
    InvalidReason.REPEATED_GUESS: "[{guess}] was already guessed",
}


def make_prompt(rules: WordleRules) -> str:
    """The instructions shown at reset (TextArena's wording, adapted to the rules in force)."""
    return (
        f"You are Player {PLAYER_ID} in Wordle.\n"
        f"A secret {WORD_LENGTH}-letter word has been chosen. You have {rules.max_guesses} "
        "attempts to guess it.\n"
        "For each guess, wrap your word in square brackets (e.g., [apple]).\n"
        "Feedback for each letter will be given as follows:\n"
        "  - G (green): correct letter in the correct position\n"
        "  - Y (yellow): letter exists in the word but in the wrong position\n"
        "  - X (wrong): letter is not in the word\n"
        f"Invalid guesses tolerated: {rules.max_invalid_moves}; one more ends the game.\n"
        + (
            "After each guess you are also told what all the feedback so far shows.\n"
            if rules.feedback_summary
            else ""
        )
        + "Enter your guess to begin."
    )


def apply_options(
    rules: WordleRules, options: ResetOptions | None, shaping: Shaping | None = None
) -> WordleRules:
    """The rules of one episode: the server's ``rules`` with a reset's ``options`` applied.

    ``max_guesses`` replaces the server's. The reward is shaped when ``options.reward`` is
    'shaped', or ``options.shaping`` is given, or (no ``options.reward``) the server shapes;
    the weights are ``options.shaping``'s where given, else the server's shaping (``rules
    .shaping``, else ``shaping``: the server's default weights, ``DELTARL_ENV_SHAPING_*``).
    ``options.reward == 'final'`` turns shaping off; ``feedback_summary`` replaces the server's.
    """
    if options is None:
        return rules
    guesses = options.max_guesses if options.max_guesses is not None else rules.max_guesses
    summary = (
        options.feedback_summary if options.feedback_summary is not None else rules.feedback_summary
    )
    mode = options.reward or (
        "shaped" if options.shaping is not None or rules.shaping is not None else "final"
    )
    weights: Shaping | None = None
    if mode == "shaped":
        base = rules.shaping or shaping or Shaping()
        given = options.shaping.model_dump(exclude_none=True) if options.shaping else {}
        weights = dataclasses.replace(base, **given)
    return dataclasses.replace(
        rules, max_guesses=guesses, shaping=weights, feedback_summary=summary
    )


def _signals(move: Move) -> RewardSignals:
    pattern = move.pattern or ""
    formatted = move.guess is not None and len(move.guess) == WORD_LENGTH
    return RewardSignals(
        correct=1.0 if pattern == "G" * WORD_LENGTH else 0.0,
        greens=pattern.count("G") / WORD_LENGTH,
        yellows=pattern.count("Y") / WORD_LENGTH,
        format=1.0 if formatted else 0.0,
        valid=1.0 if move.valid else 0.0,
        repetition=1.0 if move.repeated else 0.0,
        invalid=0.0 if move.valid else 1.0,
        consistent=1.0 if move.consistent else 0.0,
    )


class WordleEnvironment:
    """Reset/step/state for one session. Not thread-safe; the server serialises calls."""

    def __init__(
        self,
        rules: WordleRules,
        words: WordLists,
        *,
        reveal_answer: bool = False,
        shaping: Shaping | None = None,
        curriculum: GuessCurriculum | None = None,
    ):
        self.server_rules = rules  # the server's; a reset's options give self.rules
        self.curriculum = curriculum  # the server's guess curriculum (max_guesses at reset)
        self.rules = rules
        self.shaping = shaping  # the server's default shaping weights (for options.reward)
        self.words = words
        self.reveal_answer = reveal_answer
        self.prompt = make_prompt(rules)
        self.game: WordleGame | None = None
        self.episode_id: str | None = None
        # (sender_id, content, category) tuples, not pydantic objects: tuples of atomic values
        # are untracked by the cyclic GC, so a mid-game session holds ~9 GC-tracked objects
        # instead of ~31 and full collections stay short with thousands of sessions
        self.messages: list[tuple[int, str, str]] = []
        self.mistake: tuple[int, str] | None = None  # (move, hint) of the first mistake
        self.last_move: LastMove | None = None
        self.last_signals: RewardSignals | None = None
        self.last_reward = 0.0

    @property
    def outcome(self) -> Literal["won", "lost", "forfeit"] | None:
        """How the game ended (the server's games metric); None while it runs."""
        game = self.game
        if game is None or not game.done:
            return None
        return "won" if game.won else "forfeit" if game.forfeited else "lost"

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        options: ResetOptions | None = None,
        policy_version: int | None = None,
    ) -> StepResult:
        """A new episode; ``options`` (validated by the wire model) change its rules only (see
        :func:`apply_options`): the next reset without options plays the server's rules. With
        a guess curriculum, an episode whose options name no ``max_guesses`` gets the
        curriculum's for ``policy_version`` and ``seed``."""
        if self.curriculum is not None and (options is None or options.max_guesses is None):
            guesses = self.curriculum.guesses(policy_version, seed)
            base = options if options is not None else ResetOptions()
            options = base.model_copy(update={"max_guesses": guesses})
        rules = apply_options(self.server_rules, options, self.shaping)
        if rules != self.rules:
            self.rules = rules
            self.prompt = make_prompt(rules)
        self.game = WordleGame(rules, self.words, seed=seed)
        self.episode_id = episode_id if episode_id is not None else uuid.uuid4().hex
        self.messages = [(GAME_ID, self.prompt, "PROMPT")]
        self.mistake = None
        self.last_move = None
        self.last_signals = None
        self.last_reward = 0.0
        return self._result()

    def step(self, message: str) -> StepResult:
        game = self.game
        if game is None:
            raise EnvError(ErrorCode.NOT_STARTED, "call reset before step")
        if game.done:
            raise EnvError(ErrorCode.GAME_OVER, "the game is over; call reset to play again")
        move = game.play(message)
        shown = f"[{move.guess}]" if move.guess is not None else "(no bracketed guess)"
        self.messages.append((PLAYER_ID, shown, "PLAYER_ACTION"))
        self.messages.append((GAME_ID, self._feedback(move), "GAME_MESSAGE"))
        if self.mistake is None:  # the first mistake is the hint: later moves cannot change it
            earlier = game.guesses[:-1] if move.valid else game.guesses
            text = move_hint(move.guess, earlier)
            self.mistake = None if text is None else (game.moves - 1, text)
        self.last_move = LastMove(
            guess=move.guess,
            valid=move.valid,
            invalid_reason=move.invalid_reason.value if move.invalid_reason else None,
            repeated=move.repeated,
        )
        self.last_signals = _signals(move)
        self.last_reward = move.reward
        return self._result()

    def _feedback(self, move: Move) -> str:
        game = self.game
        assert game is not None
        if move.invalid_reason is not None:
            text = "Invalid move: " + _INVALID_TEXT[move.invalid_reason].format(guess=move.guess)
            if game.forfeited:
                return f"{text}. Too many invalid moves: you lose. The word was [{game.answer}]."
            cost = "uses up a guess" if self.rules.invalid_costs_guess else "does not use a guess"
            text = f"{text}. This {cost}; invalid moves left: {game.invalid_moves_left}."
        else:
            assert move.guess is not None and move.pattern is not None
            text = (
                f"You submitted [{move.guess}].\nFeedback:\n"
                f"{' '.join(move.guess.upper())}\n{' '.join(move.pattern)}\n"
            )
        if game.won:
            return f"{text}\nCongratulations! You guessed the word in {len(game.guesses)} guesses."
        if game.done:
            return f"{text}\nOut of guesses. The word was [{game.answer}]."
        if self.rules.feedback_summary and game.guesses:
            text = f"{text}\n{known_summary(game.guesses)}\n"
        return f"{text}\nYou have {game.guesses_left} guesses left."

    def _history(self) -> list[GuessFeedback]:
        assert self.game is not None
        return [GuessFeedback(word=w, pattern=p) for w, p in self.game.guesses]

    def _answer(self) -> str | None:
        game = self.game
        if game is None:
            return None
        return game.answer if (game.done or self.reveal_answer) else None

    def _result(self) -> StepResult:
        game = self.game
        assert game is not None
        obs = WordleObservation(
            prompt=self.prompt,
            messages=[TextMessage(sender_id=i, content=c, category=k) for i, c, k in self.messages],
            history=self._history(),
            guesses_left=game.guesses_left,
            invalid_moves_left=game.invalid_moves_left,
            last_move=self.last_move,
            reward_signals=self.last_signals,
            won=game.won,
            answer=self._answer(),
            hint=self._hint(),
            info={"max_guesses": self.rules.max_guesses},
        )
        return StepResult(observation=obs, reward=self.last_reward, done=game.done)

    def _hint(self) -> TaskHint | None:
        found = self.mistake
        return None if found is None else TaskHint(turn=found[0], text=found[1])

    def state(self) -> WordleState:
        game = self.game
        if game is None:
            return WordleState(
                max_guesses=self.rules.max_guesses, guesses_left=self.rules.max_guesses
            )
        return WordleState(
            episode_id=self.episode_id,
            step_count=game.moves,
            seed=game.seed,
            max_guesses=self.rules.max_guesses,
            guesses_left=game.guesses_left,
            invalid_moves=game.invalid_moves,
            history=self._history(),
            done=game.done,
            won=game.won,
            answer=self._answer(),
        )
