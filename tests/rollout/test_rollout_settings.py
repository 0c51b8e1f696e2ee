"""RolloutSettings -> EpisodeSettings."""

from __future__ import annotations

from deltarl.rollout.settings import RolloutSettings


def test_system_prompt_setting() -> None:
    """Unset: the Wordle player prompt; empty: no system turn; text: used as it is."""
    from deltarl.rollout.episodes import WORDLE_SYSTEM_PROMPT

    assert RolloutSettings().episode_settings().system_prompt == WORDLE_SYSTEM_PROMPT
    assert RolloutSettings(system_prompt="").episode_settings().system_prompt is None
    assert RolloutSettings(system_prompt="Be brief.").episode_settings().system_prompt == (
        "Be brief."
    )


def test_vllm_memory_share_reaches_the_engine_settings() -> None:
    from deltarl.rollout.engines.base import VllmEngineSettings

    for given, want in ((0.4, 0.4), (None, 0.85)):
        kw = {} if given is None else {"gpu_memory_utilization": given}
        es = RolloutSettings(engine="vllm", model="org/m", **kw).engine_settings()
        assert isinstance(es, VllmEngineSettings) and es.gpu_memory_utilization == want
