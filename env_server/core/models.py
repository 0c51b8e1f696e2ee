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

from enum import StrEnum
from typing import Annotated, Any, Literal

from deltarl.services.coordinator.schemas.common import TOKEN_HEADER as TOKEN_HEADER  # re-exported
from pydantic import BaseModel, ConfigDict, Discriminator, Field, RootModel, Tag

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


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ErrorResponse(_Wire):
    """HTTP error body. ``detail`` is FastAPI's customary field, so generic clients print it."""

    code: ErrorCode = Field(description="Machine-readable error code (see the errors table).")
    detail: str = Field(description="What went wrong and how to fix it, for humans.")


# --- requests ---------------------------------------------------------------------------------


class WordleAction(BaseModel):
    """One move: free text that should contain the guess in square brackets, e.g. ``"[crane]"``.

    Only the first bracketed run of letters counts (``"I'd say [Crane]."`` guesses ``crane``).
    ``metadata`` exists for OpenEnv's ``Action`` base class; it is accepted and ignored.
    """

    model_config = ConfigDict(extra="forbid")

    message: str = Field(
        description="Model output holding the guess as [word]; any text, any case."
    )
    metadata: dict[str, Any] = Field(default_factory=dict, description="Ignored (OpenEnv field).")


class ResetRequest(_Wire):
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


class StepRequest(_Wire):
    """``POST /step`` body. OpenEnv's fields plus ``session_id`` (required over HTTP)."""

    action: WordleAction = Field(description="The move.")
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


class CloseRequest(_Wire):
    """``POST /close`` body: frees the session now instead of waiting for its time-out."""

    session_id: str | None = Field(default=None, max_length=64, description="Session to close.")


# --- responses --------------------------------------------------------------------------------


class TextMessage(_Wire):
    """One entry of the transcript, as TextArena / OpenEnv's ``TextArenaMessage``."""

    sender_id: int = Field(description="-1: the game; 0: the player.")
    content: str = Field(description="Human-readable text.")
    category: str = Field(description="PROMPT | PLAYER_ACTION | GAME_MESSAGE.")


class GuessFeedback(_Wire):
    """A valid guess and its pattern."""

    word: str = Field(description="The guess, 5 lowercase letters.")
    pattern: str = Field(description="5 chars: G right place, Y elsewhere in the word, X absent.")


class LastMove(_Wire):
    """What the latest step did with the message."""

    guess: str | None = Field(description="Extracted word (lowercase); None: no [word] found.")
    valid: bool = Field(description="The move was accepted and scored as a guess.")
    invalid_reason: str | None = Field(
        description="no_guess | wrong_length | not_a_word | repeated_guess; None when valid."
    )
    repeated: bool = Field(description="The word had already been guessed this episode.")


class RewardSignals(_Wire):
    """Per-step signals for reward shaping (all floats in [0, 1]); see docs/env_server.md."""

    correct: float = Field(description="1.0 if this guess is the answer.")
    greens: float = Field(description="Greens of this guess / 5 (0 if invalid).")
    yellows: float = Field(description="Yellows of this guess / 5 (0 if invalid).")
    format: float = Field(description="1.0 if the message held a bracketed 5-letter word.")
    valid: float = Field(description="1.0 if the move was accepted as a guess.")
    repetition: float = Field(description="1.0 if the word was guessed before (a penalty cue).")
    invalid: float = Field(description="1.0 if the move was invalid (1 - valid).")


class TextArenaObservation(_Wire):
    """OpenEnv TextArena's observation fields, common to every task of this server."""

    prompt: str = Field(description="Task instructions (constant within an episode).")
    messages: list[TextMessage] = Field(description="Transcript so far, prompt first.")
    current_player_id: int = Field(default=0, description="Always 0 (single player).")
    legal_players: list[int] = Field(default_factory=lambda: [0], description="Always [0].")
    info: dict[str, Any] = Field(default_factory=dict, description="Reserved; empty.")


class WordleObservation(TextArenaObservation):
    """What the Wordle player sees: TextArena's fields, then ours."""

    task: Literal["wordle"] = Field(default="wordle", description="Which task: always wordle.")
    history: list[GuessFeedback] = Field(description="Valid guesses so far, oldest first.")
    guesses_left: int = Field(description="Guesses still available.")
    invalid_moves_left: int = Field(description="Invalid moves still tolerated before forfeit.")
    last_move: LastMove | None = Field(description="None right after reset.")
    reward_signals: RewardSignals | None = Field(description="None right after reset.")
    won: bool = Field(description="The answer was guessed.")
    answer: str | None = Field(
        description="The secret word: None while the game is on (unless the server runs with "
        "debug_reveal_answer), revealed once done."
    )


class CharsetSignals(_Wire):
    """Per-step signals of the charset task (all in [0, 1]); see docs/env_server.md."""

    in_set: float = Field(description="Share of the reply's characters in the target set.")
    length: float = Field(description="Reply length / min_chars, capped at 1.")


class CharsetObservation(TextArenaObservation):
    """What the charset player sees: TextArena's fields, then ours."""

    task: Literal["charset"] = Field(description="Which task: always charset.")
    target: str = Field(description="The characters that score, e.g. 'abc...xyz'.")
    min_chars: int = Field(description="Replies shorter than this count as this long.")
    reply: str | None = Field(description="The reply scored (None right after reset).")
    reward_signals: CharsetSignals | None = Field(description="None right after reset.")


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


class StepResult(_Wire):
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


class WordleState(_Wire):
    """``GET /state`` and ``WS state``: OpenEnv's ``State`` (episode_id, step_count) plus ours."""

    task: Literal["wordle"] = Field(default="wordle", description="Which task: always wordle.")
    episode_id: str | None = Field(default=None, description="None before the first reset.")
    step_count: int = Field(default=0, description="Steps taken this episode, invalid included.")
    seed: int | None = Field(default=None, description="Seed given at reset (None if random).")
    max_guesses: int = Field(default=6, description="Guesses per episode.")
    guesses_left: int = Field(default=6, description="Guesses still available.")
    invalid_moves: int = Field(default=0, description="Invalid moves made this episode.")
    history: list[GuessFeedback] = Field(default_factory=list, description="Valid guesses.")
    done: bool = Field(default=False, description="The episode ended.")
    won: bool = Field(default=False, description="The answer was guessed.")
    answer: str | None = Field(default=None, description="Hidden (None) until done.")


class CharsetState(_Wire):
    """``GET /state`` and ``WS state`` of the charset task: OpenEnv's ``State`` plus ours."""

    task: Literal["charset"] = Field(default="charset", description="Always charset.")
    episode_id: str | None = Field(default=None, description="None before the first reset.")
    step_count: int = Field(default=0, description="Steps taken this episode (0 or 1).")
    seed: int | None = Field(default=None, description="Seed given at reset (None if random).")
    done: bool = Field(default=False, description="The episode ended (after one reply).")
    reward: float | None = Field(default=None, description="The reply's score once done.")


EnvState = Annotated[
    Annotated[WordleState, Tag("wordle")] | Annotated[CharsetState, Tag("charset")],
    Discriminator(_task_tag),
]
"""The state of any task, told apart by its ``task`` tag."""


class StateResponse(RootModel[EnvState]):
    """``GET /state`` of any task (what :class:`~.client.EnvClient` validates)."""


class HealthResponse(_Wire):
    """``GET /health`` (OpenEnv): ``{"status": "healthy"}``; needs no token."""

    status: Literal["healthy"] = "healthy"


class EnvMetadata(_Wire):
    """``GET /metadata`` (OpenEnv ``EnvironmentMetadata``)."""

    name: str
    description: str
    readme_content: str | None = None
    version: str | None = None
    author: str | None = None
    documentation_url: str | None = None


class SchemaResponse(_Wire):
    """``GET /schema`` (OpenEnv): JSON schemas of action, observation and state."""

    action: dict[str, Any]
    observation: dict[str, Any]
    state: dict[str, Any]


class CloseResponse(_Wire):
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
