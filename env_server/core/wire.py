"""The task-independent wire schemas of the environment server (OpenEnv-compatible): requests,
errors and the TextArena observation base that every task extends. pydantic only.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deltarl.services.common.client_headers import TOKEN_HEADER as TOKEN_HEADER  # re-exported

SESSION_HEADER = "X-Deltarl-Session"  # optional alternative to the session_id body/query field


class ErrorCode(StrEnum):
    """Every error the server returns. OpenEnv's seven WS codes come first; the rest are ours."""

    INVALID_JSON = "INVALID_JSON"  # body / message is not JSON (or not UTF-8)
    UNKNOWN_TYPE = "UNKNOWN_TYPE"  # WS message type not reset|step|state|close
    VALIDATION_ERROR = "VALIDATION_ERROR"  # JSON, but fields missing / wrong type / out of range
    EXECUTION_ERROR = "EXECUTION_ERROR"  # OpenEnv's catch-all; we never raise it ourselves
    CAPACITY_REACHED = "CAPACITY_REACHED"  # max_sessions sessions are open; retry later
    FACTORY_ERROR = "FACTORY_ERROR"  # OpenEnv's env-construction error; never raised here
    SESSION_ERROR = "SESSION_ERROR"  # OpenEnv's catch-all; we never raise it ourselves
    UNAUTHORIZED = "UNAUTHORIZED"  # token missing or wrong (private deployments)
    SESSION_REQUIRED = "SESSION_REQUIRED"  # HTTP /step or /close without a session id
    UNKNOWN_SESSION = "UNKNOWN_SESSION"  # no such session: never created, closed or timed out
    NOT_STARTED = "NOT_STARTED"  # WS step/state before the first reset
    GAME_OVER = "GAME_OVER"  # step after done: reset to play again
    SESSION_BUSY = "SESSION_BUSY"  # another step of the same session is in progress
    PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"  # body > max_body_bytes or message > max_message_chars
    NOT_FOUND = "NOT_FOUND"  # no such route
    METHOD_NOT_ALLOWED = "METHOD_NOT_ALLOWED"  # route exists, wrong HTTP method
    INTERNAL_ERROR = "INTERNAL_ERROR"  # a bug: reported as 500 and logged with a traceback


HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_JSON: 400,
    ErrorCode.UNKNOWN_TYPE: 400,
    ErrorCode.VALIDATION_ERROR: 422,
    ErrorCode.EXECUTION_ERROR: 500,
    ErrorCode.CAPACITY_REACHED: 503,
    ErrorCode.FACTORY_ERROR: 500,
    ErrorCode.SESSION_ERROR: 500,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.SESSION_REQUIRED: 400,
    ErrorCode.UNKNOWN_SESSION: 404,
    ErrorCode.NOT_STARTED: 409,
    ErrorCode.GAME_OVER: 409,
    ErrorCode.SESSION_BUSY: 409,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.INTERNAL_ERROR: 500,
}


class WireModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ErrorResponse(WireModel):
    """HTTP error body. ``detail`` is FastAPI's customary field, so generic clients print it."""

    code: ErrorCode = Field(description="Machine-readable error code (see the errors table).")
    detail: str = Field(description="What went wrong and how to fix it, for humans.")


# --- requests ---------------------------------------------------------------------------------


class TextAction(BaseModel):
    """One move: the player's reply as free text; the task reads what it needs from it (Wordle:
    the first bracketed run of letters, ``"I'd say [Crane]."`` guesses ``crane``; charset: every
    character). ``metadata`` exists for OpenEnv's ``Action`` base class; it is accepted and
    ignored.
    """

    model_config = ConfigDict(extra="forbid")

    message: str = Field(description="The model's reply; any text.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Ignored (OpenEnv field).")


class ResetRequest(WireModel):
    """``POST /reset`` body (all optional) and ``WS reset`` data. Unknown fields are ignored,
    as OpenEnv does."""

    seed: int | None = Field(
        default=None, ge=0, description="Same seed, same answer. None draws a random answer."
    )
    episode_id: str | None = Field(
        default=None, max_length=255, description="Label echoed in the state; None: a new uuid4."
    )
    session_id: str | None = Field(
        default=None,
        max_length=64,
        description="HTTP only: reset this existing session instead of opening a new one.",
    )
    options: dict[str, Any] | None = Field(
        default=None,
        description="Per-session options of this episode, as the served task defines them "
        "(Wordle: max_guesses, reward shaping; /metadata names the model, /schema gives it); "
        "None or empty: the server's settings.",
    )
    policy_version: int | None = Field(
        default=None,
        ge=0,
        description="The policy version the episode's group started under (rollout workers "
        "send it); a task may adapt its episodes to it (Wordle's guess curriculum). None: "
        "unknown.",
    )


class StepRequest(WireModel):
    """``POST /step`` body. OpenEnv's fields plus ``session_id`` (required over HTTP)."""

    action: TextAction = Field(description="The move.")
    session_id: str | None = Field(
        default=None, max_length=64, description="Session returned by /reset (or the header)."
    )
    timeout_s: float | None = Field(default=None, gt=0, description="Ignored: steps are instant.")
    request_id: str | None = Field(
        default=None,
        max_length=255,
        description="Idempotency key: repeating the last step's request_id returns that step's "
        "result again without playing twice (safe retries).",
    )


class CloseRequest(WireModel):
    """``POST /close`` body: frees the session now instead of waiting for its time-out."""

    session_id: str | None = Field(default=None, max_length=64, description="Session to close.")


# --- responses --------------------------------------------------------------------------------


class TextMessage(WireModel):
    """One entry of the transcript, as TextArena / OpenEnv's ``TextArenaMessage``."""

    sender_id: int = Field(description="-1: the game; 0: the player.")
    content: str = Field(description="Human-readable text.")
    category: str = Field(description="PROMPT | PLAYER_ACTION | GAME_MESSAGE.")


MAX_HINT_CHARS = 600


class TaskHint(WireModel):
    """Where the episode so far first went wrong, in the task's own terms, and how to do that
    move right: the environment's hint for hinted self-distillation (``hint_mode = "env"``)."""

    turn: int = Field(ge=0, description="The player's move (0-based) that went wrong.")
    text: str = Field(
        min_length=1,
        max_length=MAX_HINT_CHARS,
        description="What to do at that move instead (an imperative, at most three sentences).",
    )


class TextArenaObservation(WireModel):
    """OpenEnv TextArena's observation fields, common to every task of this server, and the
    task's hint (deltarl's addition)."""

    prompt: str = Field(description="Task instructions (constant within an episode).")
    messages: list[TextMessage] = Field(description="Transcript so far, prompt first.")
    current_player_id: int = Field(default=0, description="Always 0 (single player).")
    legal_players: list[int] = Field(default_factory=lambda: [0], description="Always [0].")
    info: dict[str, Any] = Field(
        default_factory=dict,
        description="Facts of the episode that the reset decided and a trainer may want to "
        "follow (numbers; Wordle: max_guesses, which a guess curriculum varies); empty if none.",
    )
    hint: TaskHint | None = Field(
        default=None,
        description="The first mistake of the episode so far and how to avoid it, by the "
        "task's rules (never shown to the player: not in messages); None: none found, or a "
        "task without hints.",
    )


class HealthResponse(WireModel):
    """``GET /health`` (OpenEnv): ``{"status": "healthy"}``; needs no token."""

    status: Literal["healthy"] = "healthy"


class EnvMetadata(WireModel):
    """``GET /metadata`` (OpenEnv ``EnvironmentMetadata``)."""

    name: str
    description: str
    readme_content: str | None = None
    version: str | None = None
    author: str | None = None
    documentation_url: str | None = None
    # deltarl's additions (absent from an older server or another OpenEnv server: None)
    system_prompt: str | None = Field(
        default=None,
        description="The instructions a chat model needs to play, as a system turn; None: the "
        "observations say everything.",
    )
    max_turns: int | None = Field(
        default=None,
        ge=1,
        description="Most replies an episode can take with this server's settings.",
    )


class SchemaResponse(WireModel):
    """``GET /schema`` (OpenEnv): JSON schemas of action, observation and state."""

    action: dict[str, Any]
    observation: dict[str, Any]
    state: dict[str, Any]
    # deltarl's addition: the served task's reset options (None: it takes none)
    options: dict[str, Any] | None = None


class CloseResponse(WireModel):
    """``POST /close``."""

    closed: bool = Field(description="True: the session existed and is gone now.")


class EnvError(Exception):
    """An error with a wire code: raised by the server's handlers and by the client on a non-2xx
    answer or a WS ``error`` message."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @property
    def http_status(self) -> int:
        return HTTP_STATUS.get(self.code, 500)
