"""Wordle's per-session reset options (``ResetRequest.options`` when the server plays Wordle):
a curriculum's number of guesses, the reward and its shaping weights, the feedback summary.
pydantic only, so that a client validating options loads no game."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_SHAPING_WEIGHT = 10.0
"""Largest shaping weight, of the server's settings and of a session's options alike."""
MAX_GUESSES_LIMIT = 100
"""Most guesses of an episode, of the server's settings and of a session's options alike."""


class ShapingOptions(BaseModel):
    """Per-session reward-shaping weights. Each weight left out takes the server's
    default (``DELTARL_ENV_SHAPING_*``). The reward of a move is
    ``win*correct + greens*greens + yellows*yellows + format*valid + consistent*consistent
    - repetition*repetition - invalid*invalid`` of its reward signals (``consistent``: 1 for a
    valid guess, not the first, that fits the feedback of every earlier guess); the episode's
    return is the sum over its moves, a win also earning what its unplayed guesses would have at
    best (``fill_unplayed``; docs/env_server.md, Rewards)."""

    model_config = ConfigDict(extra="forbid")

    win: float | None = Field(
        default=None, ge=0, le=MAX_SHAPING_WEIGHT, description="Reward of the winning move."
    )
    greens: float | None = Field(
        default=None, ge=0, le=MAX_SHAPING_WEIGHT, description="Weight of greens/5 per guess."
    )
    yellows: float | None = Field(
        default=None, ge=0, le=MAX_SHAPING_WEIGHT, description="Weight of yellows/5 per guess."
    )
    format: float | None = Field(
        default=None, ge=0, le=MAX_SHAPING_WEIGHT, description="Reward of each valid move."
    )
    repetition: float | None = Field(
        default=None,
        ge=0,
        le=MAX_SHAPING_WEIGHT,
        description="Penalty of a move repeating an earlier guess.",
    )
    invalid: float | None = Field(
        default=None, ge=0, le=MAX_SHAPING_WEIGHT, description="Penalty of an invalid move."
    )
    consistent: float | None = Field(
        default=None, ge=0, le=MAX_SHAPING_WEIGHT, description="Reward of a consistent later guess."
    )
    fill_unplayed: bool | None = Field(
        default=None,
        description="A win also earns greens + format + consistent for each guess it left "
        "unplayed (no game pays more for lasting longer).",
    )


class ResetOptions(BaseModel):
    """Per-session options of a Wordle reset (``ResetRequest.options``). Every field left out
    keeps the server's setting; unknown keys and out-of-range values are refused
    (``VALIDATION_ERROR``) and leave the session as it was."""

    model_config = ConfigDict(extra="forbid")

    max_guesses: int | None = Field(
        default=None,
        ge=1,
        le=MAX_GUESSES_LIMIT,
        description="Guesses of this episode (a curriculum); None: the server's max_guesses.",
    )
    reward: Literal["final", "shaped"] | None = Field(
        default=None,
        description="'final': the server's final reward on the last step only; 'shaped': a "
        "reward on every move (see shaping); None: 'shaped' when shaping is given, else the "
        "server's DELTARL_ENV_REWARD.",
    )
    shaping: ShapingOptions | None = Field(
        default=None, description="Shaping weights (implies reward='shaped')."
    )
    feedback_summary: bool | None = Field(
        default=None,
        description="Each feedback also states what all the feedback so far shows (letters in "
        "place, in the word elsewhere, not in the word); None: the server's feedback_summary.",
    )

    @model_validator(mode="after")
    def _shaping_needs_shaped(self) -> ResetOptions:
        if self.shaping is not None and self.reward == "final":
            raise ValueError("shaping weights need reward='shaped' (or no reward field)")
        return self
