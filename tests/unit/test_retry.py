"""services/common/retry.py: the clients' one back-off policy."""

from __future__ import annotations

import random
import time

import pytest

from deltarl.services.common.retry import Backoff


def test_waits_grow_exponentially_under_the_cap_with_full_jitter() -> None:
    policy = Backoff(retries=10, base_s=0.1, cap_s=1.0, rng=random.Random(0))
    for attempt in range(10):
        bound = min(1.0, 0.1 * 2**attempt)
        waits = [policy.delay(attempt) for _ in range(200)]
        assert all(0.0 <= w <= bound for w in waits)
        assert max(waits) > 0.8 * bound and min(waits) < 0.2 * bound  # spread over [0, bound]


def test_the_budget_is_retries_and_the_deadline() -> None:
    now = time.monotonic()
    policy = Backoff(retries=2)
    assert not policy.gives_up(0, now) and not policy.gives_up(1, now)
    assert policy.gives_up(2, now)
    timed = Backoff(retries=100, deadline_s=5.0)
    assert not timed.gives_up(0, now)
    assert timed.gives_up(0, now - 6.0)  # started six seconds ago
    assert timed.wait_before(8, now - 4.9) <= 0.1 + 1e-6  # never past the deadline


def test_a_negative_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        Backoff(retries=-1)
