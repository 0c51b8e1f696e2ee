"""The Wordle task's settings: fields of the env server's settings (``DELTARL_ENV_*``, the
run config's ``[env]``), declared here, where the game is."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field, model_validator

from deltarl.env_server.wordle.curriculum import GuessCurriculum
from deltarl.env_server.wordle.options import MAX_GUESSES_LIMIT, MAX_SHAPING_WEIGHT

if TYPE_CHECKING:  # the game loads with the task, not with the client's wire models
    from deltarl.env_server.wordle.game import Shaping, WordleRules


class WordleSettings(BaseModel):
    """Rules, reward and shaping of the games the server plays when ``task = "wordle"``."""

    max_guesses: int = Field(
        default=6, ge=1, le=MAX_GUESSES_LIMIT, description="Guesses per episode."
    )
    max_invalid_moves: int = Field(
        default=1, ge=0, description="Invalid moves tolerated per episode; one more forfeits."
    )
    invalid_costs_guess: bool = Field(
        default=False, description="A tolerated invalid move also uses up a guess."
    )
    allow_non_words: bool = Field(
        default=False, description="Accept any 5 letters as a guess (no dictionary check)."
    )
    allow_repeats: bool = Field(
        default=False, description="Score repeated guesses instead of treating them as invalid."
    )
    feedback_summary: bool = Field(
        default=False,
        description="Each feedback also states what all the feedback so far shows: letters in "
        "place, letters in the word but not in place, letters not in the word.",
    )
    partial_credit: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="Weight of (greens + 0.5 yellows)/5 of the last guess in the final reward on "
        "a loss; 0 gives a 0/1 reward.",
    )
    format_credit: float = Field(
        default=0.0,
        ge=0.0,
        lt=1.0,
        description="Share of a lost or forfeited game's reward earned by valid moves "
        "(format_credit * valid moves / moves; the rest is the partial credit); a win stays 1.0. "
        "0: no format term.",
    )
    reward: Literal["final", "shaped"] = Field(
        default="final",
        description="Wordle reward: 'final' (0 on every step, the final reward on the last; "
        "partial_credit and format_credit apply) or 'shaped' (a reward on every move, the "
        "weighted sum of its signals with the shaping_* weights; the return is their sum). A "
        "session may choose at reset (options.reward, options.shaping).",
    )
    shaping_win: float = Field(
        default=1.0, ge=0, le=MAX_SHAPING_WEIGHT, description="Shaped reward of the winning move."
    )
    shaping_greens: float = Field(
        default=0.0,
        ge=0,
        le=MAX_SHAPING_WEIGHT,
        description="Shaped reward per guess: this weight times greens/5.",
    )
    shaping_yellows: float = Field(
        default=0.0,
        ge=0,
        le=MAX_SHAPING_WEIGHT,
        description="Shaped reward per guess: this weight times yellows/5.",
    )
    shaping_format: float = Field(
        default=0.0,
        ge=0,
        le=MAX_SHAPING_WEIGHT,
        description="Shaped reward of each valid move (a forfeit keeps what it earned).",
    )
    shaping_repetition: float = Field(
        default=0.0,
        ge=0,
        le=MAX_SHAPING_WEIGHT,
        description="Shaped penalty of a move repeating an earlier guess (subtracted).",
    )
    shaping_invalid: float = Field(
        default=0.0,
        ge=0,
        le=MAX_SHAPING_WEIGHT,
        description="Shaped penalty of an invalid move (subtracted).",
    )
    shaping_consistent: float = Field(
        default=0.0,
        ge=0,
        le=MAX_SHAPING_WEIGHT,
        description="Shaped reward of a valid guess that could still be the answer given every "
        "earlier guess's feedback of the episode (the first guess, without feedback, earns "
        "nothing): rewards using the feedback.",
    )
    shaping_fill_unplayed: bool = Field(
        default=True,
        description="Shaped reward: a win also earns, for each guess it left unplayed, what a "
        "perfect move earns besides the win (shaping_greens + shaping_format + "
        "shaping_consistent), so that no game pays more for lasting longer; false: unplayed "
        "guesses earn nothing (a game that plays on can outscore a win).",
    )
    guesses_start: int | None = Field(
        default=None,
        ge=1,
        le=MAX_GUESSES_LIMIT,
        description="Guess curriculum: guesses of an episode at policy version 0 (linear) or "
        "one end of the range (random), when its reset names no max_guesses; the version is "
        "the reset's policy_version (rollout workers send the version their group started "
        "under). Unset: no curriculum (max_guesses).",
    )
    guesses_end: int | None = Field(
        default=None,
        ge=1,
        le=MAX_GUESSES_LIMIT,
        description="Guess curriculum: guesses from guesses_over_versions on (linear) or the "
        "other end of the range (random); unset: guesses_start.",
    )
    guesses_over_versions: int = Field(
        default=1,
        ge=1,
        description="Guess curriculum (linear): policy versions over which the guesses go from "
        "guesses_start to guesses_end.",
    )
    guesses_mode: Literal["linear", "random"] = Field(
        default="linear",
        description="Guess curriculum: 'linear' in the policy version, or 'random' (uniform in "
        "the range, drawn from the episode's seed: the same for a group's episodes).",
    )
    debug_reveal_answer: bool = Field(
        default=False, description="Put the answer in every observation and state (debug only)."
    )

    @model_validator(mode="after")
    def _curriculum_needs_start(self) -> WordleSettings:
        if self.guesses_start is None and self.guesses_end is not None:
            raise ValueError("guesses_end needs guesses_start (the guess curriculum)")
        return self

    def curriculum(self) -> GuessCurriculum | None:
        """The guess curriculum these settings select (None: none)."""
        if self.guesses_start is None:
            return None
        return GuessCurriculum(
            mode=self.guesses_mode,
            start=self.guesses_start,
            end=self.guesses_end if self.guesses_end is not None else self.guesses_start,
            over_versions=self.guesses_over_versions,
        )

    def most_guesses(self) -> int:
        """The most guesses an episode may get from the server's settings (max_guesses, or
        the curriculum's largest)."""
        curriculum = self.curriculum()
        return self.max_guesses if curriculum is None else curriculum.most

    def shaping(self) -> Shaping:
        """The server's shaping weights (used when the reward is 'shaped', by default or by a
        session's choice)."""
        from deltarl.env_server.wordle.game import Shaping

        return Shaping(
            win=self.shaping_win,
            greens=self.shaping_greens,
            yellows=self.shaping_yellows,
            format=self.shaping_format,
            repetition=self.shaping_repetition,
            invalid=self.shaping_invalid,
            consistent=self.shaping_consistent,
            fill_unplayed=self.shaping_fill_unplayed,
        )

    def rules(self) -> WordleRules:
        """The Wordle rules these settings select."""
        from deltarl.env_server.wordle.game import WordleRules

        return WordleRules(
            max_guesses=self.max_guesses,
            max_invalid_moves=self.max_invalid_moves,
            invalid_costs_guess=self.invalid_costs_guess,
            allow_non_words=self.allow_non_words,
            allow_repeats=self.allow_repeats,
            partial_credit=self.partial_credit,
            format_credit=self.format_credit,
            shaping=self.shaping() if self.reward == "shaped" else None,
            feedback_summary=self.feedback_summary,
        )
