"""Settings of the environment server: ``DELTARL_ENV_*`` environment variables (the run
config's ``[env]``).

The server's own fields are declared here; each task's are declared in its folder
(``wordle/settings.py``: ``max_guesses`` ...; ``charset/settings.py``: ``charset_*``) and
:class:`EnvSettings` takes them all, so one variable sets one field whatever the task. ``task``
picks what the server plays; the other tasks' fields are unused. A task folder's settings class
is a base of :class:`EnvSettings` (a test checks every task found has its place here).
"""

from __future__ import annotations

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import SettingsConfigDict

from deltarl.env_server.charset.settings import CharsetSettings
from deltarl.env_server.tasks import TASKS
from deltarl.env_server.wordle.settings import WordleSettings
from deltarl.services.common.settings import validate_token
from deltarl.services.common.tls import TLSServerSettings


class EnvSettings(WordleSettings, CharsetSettings, TLSServerSettings):
    """Single source of truth for ``deltarl env`` (listed by ``deltarl env --help``)."""

    model_config = SettingsConfigDict(
        env_prefix="DELTARL_ENV_", extra="ignore", case_sensitive=False
    )

    host: str = Field(
        default="127.0.0.1", description="Interface to bind (0.0.0.0 in a container)."
    )
    port: int = Field(default=8001, ge=0, le=65535, description="TCP port (7860 on a Space).")
    token: SecretStr | None = Field(
        default=None,
        description="Shared secret (at least 16 characters); when set, every route but /health "
        "needs the header X-Deltarl-Token. Unset or empty: open server (local use only).",
    )
    max_sessions: int = Field(
        default=4096, ge=1, description="Open sessions (HTTP + WS) before CAPACITY_REACHED."
    )
    session_timeout_s: float = Field(
        default=600.0, gt=0, description="Seconds of inactivity after which a session is freed."
    )
    max_body_bytes: int = Field(
        default=262_144, ge=1024, description="Largest HTTP body / WS message accepted, in bytes."
    )
    max_message_chars: int = Field(
        default=32_768, ge=16, description="Longest action message accepted, in characters."
    )
    task: str = Field(
        default="wordle",
        description="Task served, one of the env server's task folders: "
        + "; ".join(f"'{name}' ({task.summary})" for name, task in TASKS.items())
        + ".",
    )

    @field_validator("task")
    @classmethod
    def _known_task(cls, value: str) -> str:
        if value not in TASKS:
            raise ValueError(f"unknown task {value!r}; the tasks are {', '.join(TASKS)}")
        return value

    @field_validator("token")
    @classmethod
    def _token_strength(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return None
        checked = validate_token(value.get_secret_value(), "DELTARL_ENV_TOKEN")
        return None if checked is None else value
