"""The tasks this server can play, and the one interface the server uses for all of them.

The server (``app.py``, ``sessions.py``) is generic: it holds one :class:`TextEnvironment` per
session and never looks inside it. ``DELTARL_ENV_TASK`` picks the task; :func:`make_task` turns
the settings into a :class:`TaskSpec` (a factory of fresh environments plus what ``/metadata``
and ``/schema`` describe). Adding a task: an environment class with the methods of
:class:`TextEnvironment`, its observation and state models in ``models.py`` (with a ``task``
tag, added to the :data:`~.models.Observation` and :data:`~.models.EnvState` unions), a branch
in :func:`make_task` and its settings in ``settings.py``.

Wire contract shared by every task: the action is free text (``action.message``), each answer a
:class:`~.models.StepResult` (observation, reward, done), rewards are computed here, never by the
client.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from pydantic import BaseModel

from deltarl.env_server.charset.environment import CharsetEnvironment
from deltarl.env_server.charset.models import CharsetObservation, CharsetState
from deltarl.env_server.core.models import ResetOptions, StepResult
from deltarl.env_server.settings import EnvSettings
from deltarl.env_server.wordle.environment import WordleEnvironment
from deltarl.env_server.wordle.game import WordLists
from deltarl.env_server.wordle.models import WordleObservation, WordleState
from deltarl.env_server.wordle.prompt import system_prompt

Outcome = Literal["won", "lost", "forfeit"]
TaskName = Literal["wordle", "charset"]


class TextEnvironment(Protocol):
    """One session's environment: text in, observation + reward out."""

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        options: ResetOptions | None = None,
    ) -> StepResult: ...

    def step(self, message: str) -> StepResult: ...

    def state(self) -> BaseModel: ...

    @property
    def outcome(self) -> Outcome | None:
        """How the episode ended (for the ``games`` metric); None while it runs."""
        ...


@dataclass(frozen=True)
class TaskSpec:
    """A task as the server sees it."""

    name: TaskName
    description: str  # for /metadata
    factory: Callable[[], TextEnvironment]  # a fresh environment per session
    observation: type[BaseModel]  # for /schema
    state: type[BaseModel]  # for /schema, and the empty state of GET /state without a session
    empty_state: Callable[[], BaseModel]
    max_turns: int  # for /metadata: most replies an episode can take
    system_prompt: str | None = None  # for /metadata: a chat model's instructions, if any


def make_task(settings: EnvSettings, words: WordLists | None = None) -> TaskSpec:
    """The task ``settings.task`` selects. ``words``: Wordle's lists (default: the shipped ones)."""
    if settings.task == "charset":
        rules = settings.charset_rules()
        return TaskSpec(
            name="charset",
            description=f"Charset: one reply, scored by the share of its characters in "
            f"{rules.target!r} (replies under {rules.min_chars} characters count as "
            f"{rules.min_chars} long).",
            factory=lambda: CharsetEnvironment(rules),
            observation=CharsetObservation,
            state=CharsetState,
            empty_state=CharsetState,
            max_turns=1,  # the observation states the task; no system turn
        )
    words = words if words is not None else WordLists.load()
    wordle = settings.rules()
    reveal = settings.debug_reveal_answer
    shaping = settings.shaping()
    return TaskSpec(
        name="wordle",
        description=f"Wordle: {wordle.max_guesses} guesses, feedback G/Y/X"
        + (" and a summary of all the feedback so far" if wordle.feedback_summary else "")
        + f"; answer list of {len(words.answers)} words, {len(words.allowed)} allowed guesses "
        "(SCOWL).",
        factory=lambda: WordleEnvironment(wordle, words, reveal_answer=reveal, shaping=shaping),
        observation=WordleObservation,
        state=WordleState,
        empty_state=lambda: WordleState(
            max_guesses=wordle.max_guesses, guesses_left=wordle.max_guesses
        ),
        # every guess, and every tolerated invalid move that does not use one up (the move
        # after the last tolerated one forfeits: it ends the game in place of a guess)
        max_turns=wordle.max_guesses
        + (0 if wordle.invalid_costs_guess else wordle.max_invalid_moves),
        system_prompt=system_prompt(wordle.max_guesses),
    )
