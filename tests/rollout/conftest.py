"""Fixtures for rollout tests (helpers live in rollout_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltarl.services.buckets.local import LocalBucket


@pytest.fixture
def bucket(tmp_path: Path) -> LocalBucket:
    return LocalBucket(tmp_path / "bucket")
