"""Wordle's guess curriculum: how many guesses an episode allows, chosen by the server at reset
from the policy version the episode's group started under (``ResetRequest.policy_version``)
or from the group's seed."""

from __future__ import annotations

import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from deltarl.env_server.wordle.options import MAX_GUESSES_LIMIT


class GuessCurriculum(BaseModel):
    """How many guesses an episode allows when its reset names none (``options.max_guesses``).

    ``linear``: ``start + round((end - start) * min(v, over_versions) / over_versions)`` at
    policy version ``v`` (version unknown: ``start``), so the game grows (or shrinks) from
    ``start`` to ``end`` guesses over the first ``over_versions`` versions. ``random``: a
    uniform integer in ``[min(start, end), max(start, end)]`` drawn from the episode's seed
    (reproducible). The episodes of a group share their seed and the version they started
    under, so they play the same number of guesses (GRPO compares them).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["linear", "random"] = Field(
        default="linear", description="'linear' over versions, or 'random' per seed."
    )
    start: int = Field(
        ge=1, le=MAX_GUESSES_LIMIT, description="Guesses at version 0 (linear) / range end."
    )
    end: int = Field(
        ge=1, le=MAX_GUESSES_LIMIT, description="Guesses from over_versions on / range end."
    )
    over_versions: int = Field(
        default=1, ge=1, description="Versions over which linear goes from start to end."
    )

    @property
    def most(self) -> int:
        """The most guesses an episode may get."""
        return max(self.start, self.end)

    def guesses(self, version: int | None, seed: int | None) -> int:
        """The number of guesses of an episode started at ``version`` with game ``seed``."""
        if self.mode == "random":
            lo, hi = sorted((self.start, self.end))
            return random.Random(seed).randint(lo, hi)
        v = min(max(version or 0, 0), self.over_versions)
        return self.start + round((self.end - self.start) * v / self.over_versions)
