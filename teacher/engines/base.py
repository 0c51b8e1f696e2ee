"""What a teacher engine is: something that scores a batch of sequences in one go.

The batcher (:mod:`deltarl.teacher.batcher`) decides which sequences share a forward; an engine
only turns one such batch into scores. Engines run in a worker thread (never on the event loop),
one batch at a time. numpy only here: torch and vLLM are imported by the engines themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class ScoreJob:
    """One sequence to score: positions ``p >= prompt_len`` of ``tokens`` (int32)."""

    tokens: np.ndarray
    prompt_len: int
    temperature: float
    top_k: int

    @property
    def scored(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass(frozen=True)
class Scores:
    """Scores of one :class:`ScoreJob`: ``n = len(tokens) - prompt_len`` rows."""

    sampled: np.ndarray  # float32 [n]: logprob of tokens[p]
    top_ids: np.ndarray  # int32 [n, top_k], most likely first
    top_logprobs: np.ndarray  # float32 [n, top_k]


class TeacherEngine(Protocol):
    """A loaded teacher model."""

    engine: str  # "transformers" | "vllm"
    model_name: str
    vocab_size: int

    def score(self, jobs: list[ScoreJob]) -> list[Scores]:
        """Score every job (one batch: one forward where the engine can), in order."""
        ...

    def check_temperature(self, temperature: float) -> str | None:
        """None when the engine can score at ``temperature``; else why not."""
        ...

    def close(self) -> None:
        """Free what the engine holds beyond this process's memory (the service calls it when
        it stops)."""
        ...
