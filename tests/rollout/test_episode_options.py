"""Per-session reset options from the rollout side: the env server's guess curriculum fed
the policy version a group starts under, shaped episodes whose reward is the sum of their
steps', the worker's settings, and solver transcripts that are exactly what an episode holds
(messages, tokens and mask)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from episode_helpers import ScriptedEngine, WordleServer
from pydantic import ValidationError

from deltarl.env_server.core.client import EnvClient
from deltarl.env_server.wordle.game import WordleRules, WordLists, answer_for_seed, score_guess
from deltarl.env_server.wordle.prompt import SYSTEM_PROMPT
from deltarl.env_server.wordle.transcripts import solver_transcripts
from deltarl.rollout.engines.base import SamplingParams
from deltarl.rollout.episodes.runner import ChatFormat, EpisodeGroup, EpisodeRunner, EpisodeSettings
from deltarl.rollout.episodes.trajectories import episode_signals
from deltarl.rollout.settings import RolloutSettings, WorkerExperiment
from deltarl.trainer.supervised.sft import encode_transcript

IM_END = 2
SEED = 11
WRONG = ["crane", "slate", "pious", "dumpy", "fight", "blown", "tulip"]


@pytest.fixture(scope="module")
def server() -> Iterator[WordleServer]:
    with WordleServer() as s:
        yield s


def wrong(seed: int) -> list[str]:
    secret = answer_for_seed(WordLists.load(), seed)
    return [w for w in WRONG if w != secret]


def run(server: WordleServer, engine: Any, tok: Any, settings: EpisodeSettings) -> EpisodeGroup:
    async def main() -> EpisodeGroup:
        async with EnvClient(server.url) as env, EpisodeRunner(engine, tok, env, settings) as r:
            return await r.run_group(seed=SEED)

    return asyncio.run(main())


def test_episode_settings_turns_cover_env_options_guesses() -> None:
    EpisodeSettings(max_turns=4, env_options={"max_guesses": 4})
    with pytest.raises(ValidationError, match="max_turns"):
        EpisodeSettings(max_turns=3, env_options={"max_guesses": 4})


@pytest.fixture(scope="module")
def curriculum_server() -> Iterator[WordleServer]:
    with WordleServer(guesses_start=2, guesses_end=6, guesses_over_versions=4) as s:
        yield s


@pytest.mark.slow
def test_shaped_curriculum_episodes(curriculum_server: WordleServer, tok: Any) -> None:
    """The server's curriculum gives each group the guesses of the version it started under
    (the worker sends it with every reset); the episodes' signals carry max_guesses."""
    server = curriculum_server
    words = wrong(SEED)
    engine = ScriptedEngine(tok, lambda key, turn: f"[{words[turn]}]", stop=IM_END, version=0)
    settings = EpisodeSettings(
        group_size=2,
        max_turns=6,
        sampling=SamplingParams(max_new_tokens=12),
        env_options={"shaping": {"format": 0.1, "greens": 1.0, "win": 1.0}},
    )
    group = run(server, engine, tok, settings)
    secret = answer_for_seed(WordLists.load(), SEED)
    for ep in group.episodes:
        assert ep.done and ep.num_turns == 2  # version 0: 2 guesses
        assert ep.facts == {"max_guesses": 2.0}
        expected = [0.1 + score_guess(w, secret).count("G") / 5 for w in words[:2]]
        assert [t.reward for t in ep.turns] == pytest.approx(expected)
        assert ep.reward == pytest.approx(sum(expected))  # the return: the sum of the steps'
        assert episode_signals(ep)["max_guesses"] == 2.0
    engine.version = 2  # halfway: 4 guesses
    group = run(server, engine, tok, settings)
    assert all(ep.num_turns == 4 and ep.done for ep in group.episodes)
    assert all(episode_signals(ep)["max_guesses"] == 4.0 for ep in group.episodes)
    # a session's own max_guesses wins over the curriculum
    fixed = settings.model_copy(update={"env_options": {"max_guesses": 3}})
    assert all(ep.num_turns == 3 for ep in run(server, engine, tok, fixed).episodes)
    assert server.open_sessions == 0


def test_unshaped_reward_is_the_final_reward(server: WordleServer, tok: Any) -> None:
    words = wrong(SEED)
    engine = ScriptedEngine(tok, lambda key, turn: f"[{words[turn]}]", stop=IM_END)
    settings = EpisodeSettings(
        group_size=1, max_turns=6, sampling=SamplingParams(max_new_tokens=12)
    )
    (ep,) = run(server, engine, tok, settings).episodes
    assert ep.options is None and ep.done and ep.num_turns == 6
    assert [t.reward for t in ep.turns[:-1]] == [0.0] * 5
    assert ep.reward == ep.turns[-1].reward > 0  # partial credit of the last guess


def test_bad_options_fail_the_group(server: WordleServer, tok: Any) -> None:
    engine = ScriptedEngine(tok, lambda key, turn: "[crane]", stop=IM_END)
    settings = EpisodeSettings(group_size=1, env_options={"shaping": {"win": 50}})
    with pytest.raises(Exception, match=r"VALIDATION_ERROR|less than or equal"):
        run(server, engine, tok, settings)
    assert server.open_sessions == 0


def test_worker_experiment_env_options() -> None:
    def load(*overrides: str) -> WorkerExperiment:
        return WorkerExperiment.load(None, list(overrides))

    eps = load('episodes.env_options={"shaping": {"format": 0.2}}').episode_settings()
    assert eps.env_options == {"shaping": {"format": 0.2}}
    with pytest.raises(ValueError, match=r"env_options\.shaping\.wins"):
        load('episodes.env_options={"shaping": {"wins": 1}}')
    seven = load('episodes.env_options={"max_guesses": 7}')
    assert seven.episode_settings().max_turns == 7  # unset: covers the guesses
    with pytest.raises(ValueError, match="max_turns"):
        load('episodes.env_options={"max_guesses": 7}', "episodes.max_turns=6")


def test_an_old_experiment_variable_is_refused_with_its_new_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DELTARL_ROLLOUT_ENV_OPTIONS", '{"max_guesses": 7}')
    with pytest.raises(
        ValidationError, match=r"DELTARL_ROLLOUT_ENV_OPTIONS: .*episodes\.env_options"
    ):
        RolloutSettings()


def test_solver_transcript_is_what_an_episode_holds(server: WordleServer, tok: Any) -> None:
    """A solver game written by the Wordle transcripts equals the same game played through the rollout
    runner (messages), and the SFT encoding of it equals the episode's tokens and mask."""
    (record,) = solver_transcripts(1, seed=SEED, rules=WordleRules())
    guesses = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
    assert record["seed"] == SEED and guesses[0] == "[crane]"
    engine = ScriptedEngine(tok, lambda key, turn: guesses[turn], stop=IM_END)
    settings = EpisodeSettings(
        group_size=1,
        max_turns=6,
        sampling=SamplingParams(max_new_tokens=12),
        system_prompt=SYSTEM_PROMPT,  # what a worker gets from the server's /metadata
    )
    (ep,) = run(server, engine, tok, settings).episodes
    assert ep.done and ep.messages == record["messages"]
    encoded = encode_transcript(ChatFormat(tok), record["messages"])
    assert encoded.tokens == ep.tokens
    assert encoded.mask == ep.mask
