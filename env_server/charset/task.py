"""The charset task: one reply, scored by the share of its characters in a target set."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltarl.env_server.charset.models import CharsetObservation, CharsetState
from deltarl.env_server.charset.settings import CharsetSettings
from deltarl.env_server.core.task import Task, TaskSpec

if TYPE_CHECKING:
    from deltarl.env_server.settings import EnvSettings


def build(settings: EnvSettings) -> TaskSpec:
    # the environment is imported here: a client that only reads the wire models never loads it
    from deltarl.env_server.charset.environment import CharsetEnvironment

    rules = settings.charset_rules()
    return TaskSpec(
        description=f"Charset: one reply, scored by the share of its characters in "
        f"{rules.target!r} (replies under {rules.min_chars} characters count as "
        f"{rules.min_chars} long).",
        factory=lambda: CharsetEnvironment(rules),
        empty_state=CharsetState,
        max_turns=1,  # the observation states the task; no system turn
    )


TASK = Task(
    name="charset",
    summary="one reply, scored by the share of its characters in charset_target; a small "
    "learnable task for end-to-end tests",
    observation=CharsetObservation,
    state=CharsetState,
    settings=CharsetSettings,
    build=build,
)
