"""Routing replay, the worker's half: multi-turn episodes against the real Wordle server keep one
routing row per position (each turn asks the engine only for the rows it lacks), a reply cut to
the episode's budget cuts its rows, and the record survives the wire down to the trainer's
collate."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from episode_helpers import ROUTE_SHAPE, ScriptedEngine, WordleServer, scripted_route

from deltarl.env_server.core.client import EnvClient
from deltarl.rollout.engines.base import SamplingParams
from deltarl.rollout.episodes.runner import EpisodeGroup, EpisodeRunner, EpisodeSettings
from deltarl.rollout.episodes.trajectories import to_submission
from deltarl.services.coordinator.schemas import decode_group, encode_group
from deltarl.trainer.learn.batch import collate

pytestmark = pytest.mark.network

IM_END = 2
WORDS = ["crane", "slate", "pious", "dumpy", "fight", "blown"]


def play(env: WordleServer, tok: Any, engine: ScriptedEngine, settings: EpisodeSettings) -> Any:
    async def main() -> list[EpisodeGroup]:
        async with (
            EnvClient(env.url) as client,
            EpisodeRunner(engine, tok, client, settings) as runner,
        ):
            return await runner.run_groups([3])

    [group] = asyncio.run(main())
    return group


def expected(n: int) -> np.ndarray:
    return np.array([scripted_route(p) for p in range(n)], np.uint16).reshape(n, *ROUTE_SHAPE)


def test_each_position_keeps_the_route_of_the_turn_that_fed_it(env: WordleServer, tok: Any) -> None:
    engine = ScriptedEngine(tok, lambda key, turn: f"[{WORDS[turn]}]", stop=IM_END, version=4)
    settings = EpisodeSettings(
        group_size=2, max_turns=3, sampling=SamplingParams(max_new_tokens=16), routing_replay=True
    )
    group = play(env, tok, engine, settings)
    for ep in group.episodes:
        assert ep.num_turns == 3
        assert ep.routed_experts is not None
        assert np.array_equal(ep.routed_experts, expected(len(ep.tokens) - 1))
    # (a turn that asked again for positions the episode holds would have made the rows
    # overlap: the record would have been dropped, not equal to one row per position)

    sub = to_submission(group, "worker-1")
    back = decode_group(encode_group(sub))
    batch = collate([back])
    assert batch.routing is not None
    width = batch.tokens.shape[1]
    assert batch.routing.shape == (2, width, *ROUTE_SHAPE)
    for i, ep in enumerate(group.episodes):
        n = len(ep.tokens)
        assert np.array_equal(batch.routing[i, : n - 1].numpy(), expected(n - 1))
        assert bool((batch.routing[i, n - 1 :] == -1).all())  # the last token and the padding


def test_a_reply_cut_to_the_budget_cuts_its_rows(env: WordleServer, tok: Any) -> None:
    engine = ScriptedEngine(tok, lambda key, turn: f"[{WORDS[turn]}]", stop=IM_END)
    plain = play(env, tok, engine, EpisodeSettings(group_size=1, max_turns=1))
    prompt_len = plain.episodes[0].prompt_len
    long_reply = "Let me think about it carefully first, then [crane]"
    engine = ScriptedEngine(tok, lambda key, turn: long_reply, stop=IM_END)
    settings = EpisodeSettings(
        group_size=1,
        max_tokens=prompt_len + 5,
        sampling=SamplingParams(max_new_tokens=64),
        routing_replay=True,
    )
    ep = play(env, tok, engine, settings).episodes[0]
    assert (ep.truncated, len(ep.tokens)) == ("max_tokens", prompt_len + 5)
    assert ep.routed_experts is not None
    assert np.array_equal(ep.routed_experts, expected(prompt_len + 4))


def test_an_engine_without_routing_leaves_the_episode_without_a_record(
    env: WordleServer, tok: Any
) -> None:
    class Forgetful(ScriptedEngine):
        def generate(self, prompts: Any, params: Any, *, routing_from: Any = None) -> Any:
            return super().generate(prompts, params)  # drops the request for routing

    engine = Forgetful(tok, lambda key, turn: f"[{WORDS[turn]}]", stop=IM_END)
    settings = EpisodeSettings(group_size=1, max_turns=2, routing_replay=True)
    ep = play(env, tok, engine, settings).episodes[0]
    assert ep.num_turns == 2 and ep.routed_experts is None
    group = play(env, tok, engine, settings)
    assert to_submission(group, "worker-1").trajectories[0].routed_experts is None
