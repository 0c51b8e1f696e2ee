"""Shared fixtures: small random states in every supported dtype (tests/states.py), and the
model cache of every test that prepares the demo's models."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from states import make_state

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Train with one intra-op thread here too, like the subprocesses and spawned ranks."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def state() -> dict[str, torch.Tensor]:
    return make_state()


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ``--cache-dir`` for the session: the demo's models (``tiny``, ``tiny-bytes``) are
    built there once, by whichever test asks first (``deltarl demo``/``run`` or
    ``prepare_model``), and found there by every later one. A build parses SmolLM2's GGUF twice
    (its tokenizer and config), ~25 s on 2 cores; a fresh cache per test redid it six times.
    ``DELTARL_TEST_MODEL_CACHE=<dir>`` reuses a cache across sessions."""
    cache = os.environ.get("DELTARL_TEST_MODEL_CACHE")
    return Path(cache) if cache else tmp_path_factory.mktemp("model-cache")
