"""The one back-off policy of deltarl's HTTP clients (coordinator, env server, teacher).

Each client decides *what* it retries (connection errors, time-outs, the statuses and error codes
that mean "try again"); :class:`Backoff` decides *how long* to wait: exponential with full jitter
(AWS's "Exponential Backoff And Jitter"), attempt ``a`` sleeping ``uniform(0, min(cap_s,
base_s * 2**a))``, so that many clients refused at once (a restarting coordinator, an env server
at capacity) do not come back in step. ``retries`` bounds the attempts, ``deadline_s`` (optional)
the time. Clients keep their own defaults (how patient each one should be), not their own formula.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """``retries`` retries after the first attempt, waits of ``uniform(0, min(cap_s, base_s *
    2**attempt))``, and at most ``deadline_s`` seconds from the first attempt (None: no bound)."""

    retries: int = 3
    base_s: float = 0.2
    cap_s: float = 5.0
    deadline_s: float | None = None
    rng: random.Random = field(default_factory=random.Random, repr=False)

    def __post_init__(self) -> None:
        if self.retries < 0 or self.base_s < 0 or self.cap_s < 0:
            raise ValueError(f"retries, base_s and cap_s must be >= 0: {self}")

    def delay(self, attempt: int) -> float:
        """The wait before retry ``attempt + 1`` (``attempt`` counts from 0)."""
        return self.rng.uniform(0.0, min(self.cap_s, self.base_s * 2.0**attempt))

    def gives_up(self, attempt: int, started: float) -> bool:
        """Whether retry ``attempt + 1`` is past the budget (``started``: ``time.monotonic()``
        of the first attempt)."""
        if attempt >= self.retries:
            return True
        return self.deadline_s is not None and time.monotonic() - started >= self.deadline_s

    def wait_before(self, attempt: int, started: float) -> float:
        """:meth:`delay`, cut so that the wait ends by the deadline."""
        wait = self.delay(attempt)
        if self.deadline_s is not None:
            wait = min(wait, max(0.0, self.deadline_s - (time.monotonic() - started)))
        return wait
