"""Wire schemas of the environment server (OpenEnv-compatible), shared by server and client.

This module imports pydantic only: never the server (FastAPI, sessions) nor torch. Shapes follow
OpenEnv 0.3 (``openenv.core.env_server.types``) and its TextArena Wordle observation, so that
OpenEnv's own client and TRL's Wordle example read our responses unchanged; fields we add are
optional for them.

HTTP ``POST /reset`` and ``POST /step`` answer a :class:`StepResult`; ``WS /ws`` answers
``{"type": "observation", "data": StepResult}``. Errors carry an :class:`ErrorCode` (HTTP body
:class:`ErrorResponse`; WS ``{"type": "error", "data": {"code", "message"}}``).

Tasks: the server plays one task (``DELTARL_ENV_TASK``): ``wordle`` (:class:`WordleObservation`,
:class:`WordleState`) or ``charset`` (:class:`CharsetObservation`, :class:`CharsetState`). Both
observations extend OpenEnv's TextArena observation (:class:`TextArenaObservation`: prompt and
transcript) and carry a ``task`` tag; :data:`Observation` and :data:`EnvState` are the tagged
unions that :class:`StepResult` and the client use (a body without the tag is Wordle's).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Discriminator, Field, RootModel, Tag

from deltarl.env_server.charset.models import CharsetObservation, CharsetState
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
    ResetOptions,
    ResetRequest,
    SchemaResponse,
    ShapingOptions,
    StepRequest,
    TextAction,
    TextArenaObservation,
    TextMessage,
    WireModel,
)
from deltarl.env_server.wordle.models import WordleObservation, WordleState

__all__ = [
    "HTTP_STATUS",
    "SESSION_HEADER",
    "TOKEN_HEADER",
    "CloseRequest",
    "CloseResponse",
    "EnvError",
    "EnvMetadata",
    "EnvState",
    "ErrorCode",
    "ErrorResponse",
    "HealthResponse",
    "Observation",
    "ResetOptions",
    "ResetRequest",
    "SchemaResponse",
    "ShapingOptions",
    "StateResponse",
    "StepRequest",
    "StepResult",
    "TextAction",
    "TextArenaObservation",
    "TextMessage",
]


def _task_tag(value: Any) -> str:
    """The ``task`` tag of an observation or state (a dict or a model); Wordle when absent, so
    bodies of servers older than the tag still parse."""
    if isinstance(value, dict):
        return str(value.get("task", "wordle"))
    return str(getattr(value, "task", "wordle"))


Observation = Annotated[
    Annotated[WordleObservation, Tag("wordle")] | Annotated[CharsetObservation, Tag("charset")],
    Discriminator(_task_tag),
]
"""The observation of any task, told apart by its ``task`` tag."""


class StepResult(WireModel):
    """Answer to reset and step (OpenEnv ``ResetResponse`` / ``StepResponse`` + ``session_id``)."""

    observation: Observation
    reward: float | None = Field(
        description="Wordle: 0.0 until the game ends, then the final reward (see "
        "WordleGame.final_reward). Charset: 0.0 at reset, then the reply's score."
    )
    done: bool = Field(description="The episode ended (win, out of guesses or forfeit).")
    session_id: str | None = Field(
        default=None, description="HTTP: the session to pass to step/state/close. WS: None."
    )


EnvState = Annotated[
    Annotated[WordleState, Tag("wordle")] | Annotated[CharsetState, Tag("charset")],
    Discriminator(_task_tag),
]
"""The state of any task, told apart by its ``task`` tag."""


class StateResponse(RootModel[EnvState]):
    """``GET /state`` of any task (what :class:`~.client.EnvClient` validates)."""
