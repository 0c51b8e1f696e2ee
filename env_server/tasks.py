"""The tasks this server can play, found by folder: every package of ``env_server/`` (besides
``core``) with a ``task.py`` that defines ``TASK`` (a :class:`~.core.task.Task`).

Adding a task is adding a folder: its environment (the methods of
:class:`~.core.task.TextEnvironment`), its observation and state models (extending
:class:`~.core.wire.TextArenaObservation`, with a ``task`` tag equal to its name) and its
``task.py``; its settings are fields of :class:`~.settings.EnvSettings`. ``DELTARL_ENV_TASK``
picks one; :func:`make_task` builds it.

The tagged unions :data:`Observation` and :data:`EnvState` of every task found, and
:data:`AnyStepResult` and :class:`StateResponse` over them, are what a client validates a
server's answers with (the server itself answers with its one task's models).

Wire contract shared by every task: the action is free text (``action.message``), each answer a
:class:`~.core.models.StepResult` (observation, reward, done), rewards are computed here, never
by the client.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, cast

from pydantic import BaseModel, Discriminator, RootModel, Tag, ValidationError

from deltarl.env_server.core.models import StepResult
from deltarl.env_server.core.task import Task, TaskSpec
from deltarl.env_server.core.wire import TextArenaObservation
from deltarl.services.common.errors import validation_text

if TYPE_CHECKING:
    from deltarl.env_server.settings import EnvSettings

PACKAGE = "deltarl.env_server"
NOT_TASKS = frozenset({"core"})
UNTAGGED = "wordle"  # the task of a body without a tag (servers older than the tag played Wordle)


def discover(package: str = PACKAGE) -> dict[str, Task]:
    """``{name: TASK}`` of every task folder of ``package``, sorted by name. A ``task.py``
    without a ``TASK``, or two folders claiming one name, is an error that names the folder."""
    found: dict[str, Task] = {}
    root = importlib.import_module(package)
    for info in sorted(pkgutil.iter_modules(root.__path__), key=lambda i: i.name):
        if not info.ispkg or info.name in NOT_TASKS:
            continue
        name = f"{package}.{info.name}.task"
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name == name:
                continue  # a folder that is not a task
            raise
        task = getattr(module, "TASK", None)
        if not isinstance(task, Task):
            raise TypeError(f"{name} defines no TASK (a deltarl.env_server.core.task.Task)")
        if task.name in found:
            raise ValueError(f"{name}: task {task.name!r} is declared twice")
        found[task.name] = task
    return dict(sorted(found.items()))


TASKS = discover()


def make_task(settings: EnvSettings) -> tuple[Task, TaskSpec]:
    """The task ``settings.task`` selects, and what the settings make of it."""
    try:
        task = TASKS[settings.task]
    except KeyError:
        raise ValueError(
            f"unknown task {settings.task!r}; this server plays {', '.join(TASKS)}"
        ) from None
    return task, task.build(settings)


def check_options(options: Mapping[str, Any]) -> None:
    """Refuse (ValueError naming the field) reset ``options`` that no task takes: what a client
    can check before it knows the served task (the server checks them against its own)."""
    errors = []
    for name, task in TASKS.items():
        if task.options is None:
            continue
        try:
            task.options.model_validate(dict(options))
            return
        except ValidationError as err:
            first = validation_text(err.errors(include_input=False), limit=1)
            errors.append(f"{first} (as {name}'s options)")
    raise ValueError("; ".join(errors) or "no task takes reset options")


def _task_tag(value: Any) -> str:
    """The ``task`` tag of an observation or state (a dict or a model); :data:`UNTAGGED` when
    absent, so bodies of servers older than the tag still parse."""
    if isinstance(value, dict):
        return str(value.get("task", UNTAGGED))
    return str(getattr(value, "task", UNTAGGED))


def _tagged(models: list[tuple[str, type[BaseModel]]]) -> Any:
    """The tagged union of ``models`` (a single model stands alone)."""
    if len(models) == 1:
        return models[0][1]
    members = tuple(Annotated[model, Tag(name)] for name, model in models)
    union = members[0]
    for member in members[1:]:
        union = union | member
    return Annotated[union, Discriminator(_task_tag)]


Observation: Any = _tagged([(n, t.observation) for n, t in TASKS.items()])
"""The observation of any task, told apart by its ``task`` tag."""

EnvState: Any = _tagged([(n, t.state) for n, t in TASKS.items()])
"""The state of any task, told apart by its ``task`` tag."""

AnyStepResult = cast(type[StepResult[TextArenaObservation]], StepResult[Observation])
"""A :class:`~.core.models.StepResult` of any task (what a client validates)."""


class StateResponse(RootModel[EnvState]):
    """``GET /state`` of any task (what :class:`~.core.client.EnvClient` validates)."""
