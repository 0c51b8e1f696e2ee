"""Wire schemas of the charset task: its observation, state and per-step signals."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from deltarl.env_server.core.wire import TextArenaObservation, WireModel


class CharsetSignals(WireModel):
    """Per-step signals of the charset task (all in [0, 1]); see docs/env_server.md."""

    in_set: float = Field(description="Share of the reply's characters in the target set.")
    length: float = Field(description="Reply length / min_chars, capped at 1.")


class CharsetObservation(TextArenaObservation):
    """What the charset player sees: TextArena's fields, then ours."""

    task: Literal["charset"] = Field(description="Which task: always charset.")
    target: str = Field(description="The characters that score, e.g. 'abc...xyz'.")
    min_chars: int = Field(description="Replies shorter than this count as this long.")
    reply: str | None = Field(description="The reply scored (None right after reset).")
    reward_signals: CharsetSignals | None = Field(description="None right after reset.")


class CharsetState(WireModel):
    """``GET /state`` and ``WS state`` of the charset task: OpenEnv's ``State`` plus ours."""

    task: Literal["charset"] = Field(default="charset", description="Always charset.")
    episode_id: str | None = Field(default=None, description="None before the first reset.")
    step_count: int = Field(default=0, description="Steps taken this episode (0 or 1).")
    seed: int | None = Field(default=None, description="Seed given at reset (None if random).")
    done: bool = Field(default=False, description="The episode ended (after one reply).")
    reward: float | None = Field(default=None, description="The reply's score once done.")
