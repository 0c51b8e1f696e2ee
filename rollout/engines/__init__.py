"""Rollout engines behind one interface (:class:`Engine`), picked by ``type`` (see base.py)."""

from deltarl.rollout.engines.base import (
    UNMANAGED,
    Completion,
    Engine,
    EngineSettings,
    EngineType,
    SamplingParams,
    TransformersEngineSettings,
    VllmEngineSettings,
    WeightsGate,
    WeightsStamp,
)
from deltarl.rollout.engines.factory import make_engine

__all__ = [
    "UNMANAGED",
    "Completion",
    "Engine",
    "EngineSettings",
    "EngineType",
    "SamplingParams",
    "TransformersEngineSettings",
    "VllmEngineSettings",
    "WeightsGate",
    "WeightsStamp",
    "make_engine",
]
