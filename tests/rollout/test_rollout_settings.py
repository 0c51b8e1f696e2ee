"""The worker's settings: its experiment -> the engine's and the episodes' settings."""

from __future__ import annotations

import pytest

from deltarl.rollout.settings import RolloutSettings, WorkerExperiment


def exp(*overrides: str) -> WorkerExperiment:
    return WorkerExperiment.load(None, list(overrides))


def test_the_env_server_gives_what_the_settings_leave_unset() -> None:
    """Unset: the env server's system prompt and turn limit (its /metadata: Wordle's player
    prompt and guesses (its curriculum's most) + tolerated invalid moves; charset: none and 1),
    raised to env_options' guesses; empty: no system turn; text: used as it is."""
    from fastapi.testclient import TestClient

    from deltarl.env_server.core.app import create_app
    from deltarl.env_server.core.wire import EnvMetadata
    from deltarl.env_server.settings import EnvSettings

    def metadata(**env: object) -> EnvMetadata:
        with TestClient(create_app(EnvSettings.model_validate(env))) as client:
            return EnvMetadata.model_validate(client.get("/metadata").json())

    wordle, charset = metadata(max_guesses=8), metadata(task="charset")
    eps = exp().episode_settings(wordle)
    assert wordle.system_prompt is not None and "at most 8 guesses" in wordle.system_prompt
    assert (eps.system_prompt, eps.max_turns) == (wordle.system_prompt, 8 + 1)
    eps = exp().episode_settings(charset)
    assert (eps.system_prompt, eps.max_turns) == (None, 1)
    # the server's guess curriculum: its turn limit covers the most guesses it gives
    curriculum = metadata(guesses_start=3, guesses_end=12, guesses_over_versions=5)
    assert exp().episode_settings(curriculum).max_turns == 12 + 1
    # env_options asking for more guesses than the server's game: the limit follows
    more = exp('episodes.env_options={"max_guesses": 10}').episode_settings(wordle)
    assert more.max_turns == 10
    # set here: the settings win over the server's
    eps = exp("episodes.system_prompt=Be brief.", "episodes.max_turns=4").episode_settings(wordle)
    assert (eps.system_prompt, eps.max_turns) == ("Be brief.", 4)
    assert exp('episodes.system_prompt=""').episode_settings(wordle).system_prompt is None
    # a server that says nothing (another OpenEnv server): no system turn, 6 turns
    eps = exp().episode_settings(None)
    assert (eps.system_prompt, eps.max_turns) == (None, 6)


def test_vllm_memory_share_reaches_the_engine_settings() -> None:
    from deltarl.rollout.engines.base import VllmEngineSettings

    for given, want in ((0.4, 0.4), (None, 0.85)):
        kw = [] if given is None else [f"engine.gpu_memory_utilization={given}"]
        es = exp("engine.type=vllm", "engine.model=org/m", *kw).engine_settings()
        assert isinstance(es, VllmEngineSettings) and es.gpu_memory_utilization == want


@pytest.mark.usefixtures("smollm2_tok")  # loaded in setup, not in the timed call
def test_worker_sets_the_gil_switch_interval(tmp_path) -> None:
    """Decoding next to a Python-heavy generation thread needs a short switch interval."""
    import sys

    from rollout.worker_helpers import tiny_model
    from smollm2_helpers import smollm2_tokenizer

    from deltarl.buckets.local import LocalBucket
    from deltarl.rollout.engines.transformers_engine import TransformersEngine
    from deltarl.rollout.service.worker import GIL_SWITCH_INTERVAL_S, RolloutWorker
    from deltarl.rollout.sync.weights import WeightSync
    from deltarl.weightsync.reader import BucketReader

    before = sys.getswitchinterval()
    try:
        sync = WeightSync(
            TransformersEngine(tiny_model(64, seed=1), seed=0), BucketReader(LocalBucket(tmp_path))
        )
        sys.setswitchinterval(0.005)
        RolloutWorker(RolloutSettings(), sync, smollm2_tokenizer(), model_name="t")
        assert abs(sys.getswitchinterval() - GIL_SWITCH_INTERVAL_S) < 1e-9
        assert GIL_SWITCH_INTERVAL_S == 0.0002
    finally:
        sys.setswitchinterval(before)


def test_apply_kernel_setting(monkeypatch) -> None:
    """DELTARL_ROLLOUT_APPLY_KERNEL reaches the settings; WeightSync refuses unknown modes."""
    import pytest
    import torch
    from pydantic import ValidationError

    from deltarl.rollout.sync.weights import WeightSync

    assert RolloutSettings().apply_kernel == "auto"
    monkeypatch.setenv("DELTARL_ROLLOUT_APPLY_KERNEL", "torch")
    assert RolloutSettings().apply_kernel == "torch"
    monkeypatch.setenv("DELTARL_ROLLOUT_APPLY_KERNEL", "cuda")
    with pytest.raises(ValidationError):
        RolloutSettings()

    class CpuEngine:
        device = torch.device("cpu")

    with pytest.raises(ValueError, match="apply_kernel must be one of"):
        WeightSync(CpuEngine(), None, apply_kernel="fast")  # type: ignore[arg-type]
    for mode in ("auto", "torch"):  # a CPU engine: index_copy_
        assert WeightSync(CpuEngine(), None, apply_kernel=mode).apply_kernel == mode  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not CUDA"):
        WeightSync(CpuEngine(), None, apply_kernel="triton")  # type: ignore[arg-type]
