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
