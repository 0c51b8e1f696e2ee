"""Shared fixtures: small random states in every supported dtype (tests/states.py), and the
model cache of every test that prepares the demo's models; and the fast tier's time limit.

torch is imported by the fixtures that need it, not here: collecting a suite that needs no torch
(the coordinator's, the env server's) stays quick.

The fast tier (``make test-fast``: ``DELTARL_FAST_TIER=1``, and every test not marked ``slow``,
``network``, ``docker`` or ``gpu``) has a budget per test: a test of that tier whose call takes
longer than ``DELTARL_FAST_TEST_S`` seconds (default 5) fails, with a message to make it faster
or mark it ``slow``. So the tier stays the few-minute loop it promises; the whole suite
(``make test``) runs every test without the limit.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TIER_MARKS = ("slow", "network", "docker", "gpu")  # a test with none of these is in the fast tier


def _fast_test_limit_s() -> float | None:
    if os.environ.get("DELTARL_FAST_TIER") != "1":
        return None
    return float(os.environ.get("DELTARL_FAST_TEST_S", "5"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[Any]:
    outcome = yield
    limit = _fast_test_limit_s()
    if limit is None or call.when != "call":
        return
    report = outcome.get_result()
    in_tier = not any(item.get_closest_marker(m) for m in TIER_MARKS)
    if in_tier and report.passed and call.duration > limit:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} took {call.duration:.1f} s, over the fast tier's {limit:g} s per "
            "test (DELTARL_FAST_TEST_S): make it faster, or mark it slow"
        )


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Train with one intra-op thread here too, like the subprocesses and spawned ranks."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_tok() -> Any:
    """SmolLM2's tokenizer (smollm2_helpers.smollm2_tokenizer, one per process), loaded in a
    fixture's setup: its GGUF parse (5-15 s) would otherwise fall in the call of whichever test
    of the process asks first, which the fast tier's time limit counts (with several workers, any
    of them). Tests that call ``smollm2_tokenizer()`` in their body use this fixture."""
    from smollm2_helpers import smollm2_tokenizer

    return smollm2_tokenizer()


@pytest.fixture
def state() -> dict[str, torch.Tensor]:
    from states import make_state

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
