"""Helpers of the environment-server tests (imported by conftest.py and the test modules)."""

from __future__ import annotations

from typing import Any

from deltarl.env_server.settings import EnvSettings
from deltarl.env_server.wordle.game import WordLists, answer_for_seed


def settings(**overrides: Any) -> EnvSettings:
    """Settings independent of the caller's DELTARL_ENV_* environment."""
    return EnvSettings.model_validate(overrides)


def answer(seed: int) -> str:
    return answer_for_seed(WordLists.load(), seed)


def wrong_guesses(seed: int, n: int) -> list[str]:
    """``n`` distinct allowed words that are not the answer of ``seed`` nor in the prompt."""
    secret = answer(seed)
    picks = [
        w for w in ("crane", "slate", "pious", "dumpy", "fight", "blown", "tulip") if w != secret
    ]
    return picks[:n]
