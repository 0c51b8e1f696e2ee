"""What the generic server knows of a task: the :class:`Task` a task folder declares, the
:class:`TaskSpec` it builds from the settings, and the :class:`TextEnvironment` each session
plays. The core never names a task: :mod:`deltarl.env_server.tasks` finds them (every folder
of ``env_server/`` with a ``task.py`` that defines ``TASK``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel

from deltarl.env_server.core.wire import TextArenaObservation

if TYPE_CHECKING:
    from deltarl.env_server.core.models import StepResult
    from deltarl.env_server.settings import EnvSettings

Outcome = Literal["won", "lost", "forfeit"]


class TextEnvironment(Protocol):
    """One session's environment: text in, observation + reward out."""

    def reset(  # options: the task's options model, validated by the server
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        options: Any = None,
        policy_version: int | None = None,  # the version the episode's group started under
    ) -> StepResult[TextArenaObservation]: ...

    def step(self, message: str) -> StepResult[TextArenaObservation]: ...

    def state(self) -> BaseModel: ...

    @property
    def outcome(self) -> Outcome | None:
        """How the episode ended (for the ``games`` metric); None while it runs."""
        ...


@dataclass(frozen=True)
class TaskSpec:
    """What a task's settings make of it (its :class:`Task` declares the rest)."""

    description: str  # for /metadata
    factory: Callable[[], TextEnvironment]  # a fresh environment per session
    empty_state: Callable[[], BaseModel]  # GET /state without a session
    max_turns: int  # for /metadata: most replies an episode can take
    system_prompt: str | None = None  # for /metadata: a chat model's instructions, if any


@dataclass(frozen=True)
class Task:
    """What a task folder declares as ``TASK`` in its ``task.py``: its name (the value of
    ``DELTARL_ENV_TASK`` and the ``task`` tag of its observations and states), its wire
    models, its settings (a class of fields that the server's settings take, declared in the
    folder) and how it is built from the server's settings."""

    name: str
    summary: str  # one line, for the settings' reference
    observation: type[TextArenaObservation]  # for /schema and the routes' response models
    state: type[BaseModel]  # for /schema and GET /state
    settings: type[BaseModel]  # a base of EnvSettings
    build: Callable[[EnvSettings], TaskSpec]
    options: type[BaseModel] | None = None  # a reset's options; None: the task takes none
