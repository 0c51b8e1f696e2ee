"""Wire schemas of the environment server (OpenEnv-compatible), shared by server and client.

This module imports pydantic only: never the server (FastAPI, sessions) nor torch. Shapes follow
OpenEnv 0.3 (``openenv.core.env_server.types``) and its TextArena Wordle observation, so that
OpenEnv's own client and TRL's Wordle example read our responses unchanged; fields we add are
optional for them.

HTTP ``POST /reset`` and ``POST /step`` answer a :class:`StepResult`; ``WS /ws`` answers
``{"type": "observation", "data": StepResult}``. Errors carry an :class:`ErrorCode` (HTTP body
:class:`ErrorResponse`; WS ``{"type": "error", "data": {"code", "message"}}``).

Tasks: the server plays one task (``DELTARL_ENV_TASK``), whose observation extends OpenEnv's
TextArena observation (:class:`TextArenaObservation`: prompt and transcript) with a ``task`` tag;
:class:`StepResult` is generic in it. The task folders and the unions of every task's models
are in :mod:`deltarl.env_server.tasks`; this module names none.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from pydantic import Field, SerializeAsAny

from deltarl.env_server.core.wire import (
    HTTP_STATUS,
    SESSION_HEADER,
    TOKEN_HEADER,
    CloseRequest,
    CloseResponse,
    EnvError,
    EnvMetadata,
    ErrorCode,
    ErrorResponse,
    HealthResponse,
    ResetRequest,
    SchemaResponse,
    StepRequest,
    TextAction,
    TextArenaObservation,
    TextMessage,
    WireModel,
)

__all__ = [
    "HTTP_STATUS",
    "SESSION_HEADER",
    "TOKEN_HEADER",
    "CloseRequest",
    "CloseResponse",
    "EnvError",
    "EnvMetadata",
    "ErrorCode",
    "ErrorResponse",
    "HealthResponse",
    "ResetRequest",
    "SchemaResponse",
    "StepRequest",
    "StepResult",
    "TextAction",
    "TextArenaObservation",
    "TextMessage",
]


ObsT = TypeVar("ObsT", bound=TextArenaObservation)


class StepResult(WireModel, Generic[ObsT]):
    """Answer to reset and step (OpenEnv ``ResetResponse`` / ``StepResponse`` + ``session_id``),
    generic in the task's observation (serialized as the task's model, whatever the parameter)."""

    observation: SerializeAsAny[ObsT]
    reward: float | None = Field(
        description="The step's reward, computed by the task (a task that rewards the whole "
        "episode answers 0.0 until it ends: see its observation's model)."
    )
    done: bool = Field(description="The episode ended (win, out of guesses or forfeit).")
    session_id: str | None = Field(
        default=None, description="HTTP: the session to pass to step/state/close. WS: None."
    )
