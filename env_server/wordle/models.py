"""Wire schemas of the Wordle task: its observation, state and per-step reward signals."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from deltarl.env_server.core.wire import TextArenaObservation, WireModel


class GuessFeedback(WireModel):
    """A valid guess and its pattern."""

    word: str = Field(description="The guess, 5 lowercase letters.")
    pattern: str = Field(description="5 chars: G right place, Y elsewhere in the word, X absent.")


class LastMove(WireModel):
    """What the latest step did with the message."""

    guess: str | None = Field(description="Extracted word (lowercase); None: no [word] found.")
    valid: bool = Field(description="The move was accepted and scored as a guess.")
    invalid_reason: str | None = Field(
        description="no_guess | wrong_length | not_a_word | repeated_guess; None when valid."
    )
    repeated: bool = Field(description="The word had already been guessed this episode.")


class RewardSignals(WireModel):
    """Per-step signals for reward shaping (all floats in [0, 1]); see docs/env_server.md."""

    correct: float = Field(description="1.0 if this guess is the answer.")
    greens: float = Field(description="Greens of this guess / 5 (0 if invalid).")
    yellows: float = Field(description="Yellows of this guess / 5 (0 if invalid).")
    format: float = Field(description="1.0 if the message held a bracketed 5-letter word.")
    valid: float = Field(description="1.0 if the move was accepted as a guess.")
    repetition: float = Field(description="1.0 if the word was guessed before (a penalty cue).")
    invalid: float = Field(description="1.0 if the move was invalid (1 - valid).")
    consistent: float = Field(
        description="1.0 if the move was a valid guess consistent with every earlier guess's "
        "feedback (0 for the first valid guess, which has none, and for an invalid move)."
    )


class WordleObservation(TextArenaObservation):
    """What the Wordle player sees: TextArena's fields, then ours."""

    task: Literal["wordle"] = Field(default="wordle", description="Which task: always wordle.")
    history: list[GuessFeedback] = Field(description="Valid guesses so far, oldest first.")
    guesses_left: int = Field(description="Guesses still available.")
    invalid_moves_left: int = Field(description="Invalid moves still tolerated before forfeit.")
    last_move: LastMove | None = Field(description="None right after reset.")
    reward_signals: RewardSignals | None = Field(description="None right after reset.")
    won: bool = Field(description="The answer was guessed.")
    answer: str | None = Field(
        description="The secret word: None while the game is on (unless the server runs with "
        "debug_reveal_answer), revealed once done."
    )


class WordleState(WireModel):
    """``GET /state`` and ``WS state``: OpenEnv's ``State`` (episode_id, step_count) plus ours."""

    task: Literal["wordle"] = Field(default="wordle", description="Which task: always wordle.")
    episode_id: str | None = Field(default=None, description="None before the first reset.")
    step_count: int = Field(default=0, description="Steps taken this episode, invalid included.")
    seed: int | None = Field(default=None, description="Seed given at reset (None if random).")
    max_guesses: int = Field(default=6, description="Guesses per episode.")
    guesses_left: int = Field(default=6, description="Guesses still available.")
    invalid_moves: int = Field(default=0, description="Invalid moves made this episode.")
    history: list[GuessFeedback] = Field(default_factory=list, description="Valid guesses.")
    done: bool = Field(default=False, description="The episode ended.")
    won: bool = Field(default=False, description="The answer was guessed.")
    answer: str | None = Field(default=None, description="Hidden (None) until done.")
