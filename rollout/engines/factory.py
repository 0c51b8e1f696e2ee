"""Build the engine a worker's settings name (the interface is base.py; engines import it, never
this module, so the interface and the engines have no import cycle)."""

from __future__ import annotations

from deltarl.rollout.engines.base import Engine, TransformersEngineSettings, VllmEngineSettings


def make_engine(settings: TransformersEngineSettings | VllmEngineSettings) -> Engine:
    """Build the engine ``settings.type`` names (heavy imports happen here, not at import)."""
    if settings.type == "transformers":
        from deltarl.rollout.engines.transformers_engine import TransformersEngine

        assert isinstance(settings, TransformersEngineSettings)
        return TransformersEngine.from_settings(settings)
    if settings.type == "vllm":
        from deltarl.rollout.engines.vllm_engine import VllmEngine

        assert isinstance(settings, VllmEngineSettings)
        return VllmEngine.from_settings(settings)
    raise ValueError(f"unknown engine type {settings.type!r}; choose 'transformers' or 'vllm'")
