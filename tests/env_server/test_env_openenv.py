"""Compatibility: the real openenv-core client (and TRL's feedback parsing) against a live server."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any

import pytest
from env_helpers import answer, wrong_guesses
from openenv.core.generic_client import GenericEnvClient
from support import LiveServer

pytestmark = pytest.mark.network


def trl_feedback_counts(observation: dict[str, Any]) -> tuple[int, int]:
    """What TRL's Wordle example does (via OpenEnv's textarena rewards): find the last message
    with "Feedback:", then its last line made only of G/Y/X, and count G and Y."""
    for message in reversed(observation["messages"]):
        content = message["content"].strip()
        if "Feedback:" in content:
            lines = [
                ln.strip() for ln in content.split("Feedback:", 1)[-1].split("\n") if ln.strip()
            ]
            for line in reversed(lines):
                flat = line.replace(" ", "")
                if flat and all(c in "GYX" for c in flat):
                    return flat.count("G"), flat.count("Y")
    return 0, 0


def test_openenv_client_plays_full_games(live_server: Callable[..., LiveServer]) -> None:
    server = live_server()
    with GenericEnvClient(base_url=server.url).sync() as env:
        for seed in (0, 1, 2):
            result = env.reset(seed=seed)
            obs = result.observation
            assert result.done is False and obs["answer"] is None
            assert obs["messages"][0]["category"] == "PROMPT" and obs["current_player_id"] == 0
            for word in [*wrong_guesses(seed, 3), answer(seed)]:
                result = env.step({"message": f"My guess is [{word}]."})
                history = result.observation["history"]
                greens, yellows = trl_feedback_counts(result.observation)
                assert (greens, yellows) == (
                    history[-1]["pattern"].count("G"),
                    history[-1]["pattern"].count("Y"),
                )
            assert result.done is True and result.reward == 1.0
            assert result.observation["answer"] == answer(seed)
            state = env.state()
            assert state["won"] is True and state["step_count"] == 4
        result = env.reset(seed=5)  # a lost game
        for word in wrong_guesses(5, 6):
            assert result.done is False
            result = env.step({"message": f"[{word}]"})
        assert result.done is True and 0.0 <= (result.reward or 0.0) < 1.0
        assert re.search(
            r"The word was \[[a-z]{5}\]", result.observation["messages"][-1]["content"]
        )
        with pytest.raises(RuntimeError, match="GAME_OVER"):
            env.step({"message": "[crane]"})
        result = env.reset(seed=1)  # the connection survived the error
        assert result.done is False


def test_openenv_async_client(live_server: Callable[..., LiveServer]) -> None:
    server = live_server()

    async def play() -> None:
        async with GenericEnvClient(base_url=server.url) as env:
            await env.reset(seed=1)
            result = await env.step({"message": "[crane]"})
            assert result.observation["last_move"]["valid"] is True
            with pytest.raises(RuntimeError, match="VALIDATION_ERROR"):
                await env.step({"text": "[crane]"})

    asyncio.run(play())
