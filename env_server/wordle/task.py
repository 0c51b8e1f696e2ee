"""The Wordle task: guesses and G/Y/X feedback over several turns (SCOWL word lists)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltarl.env_server.core.task import Task, TaskSpec
from deltarl.env_server.wordle.models import WordleObservation, WordleState
from deltarl.env_server.wordle.options import ResetOptions
from deltarl.env_server.wordle.settings import WordleSettings

if TYPE_CHECKING:
    from deltarl.env_server.settings import EnvSettings


def build(settings: EnvSettings) -> TaskSpec:
    # the game is imported here: a client that only reads the wire models never loads it
    from deltarl.env_server.wordle.environment import WordleEnvironment
    from deltarl.env_server.wordle.game import WordLists
    from deltarl.env_server.wordle.prompt import system_prompt

    words = WordLists.load()
    wordle = settings.rules()
    reveal = settings.debug_reveal_answer
    shaping = settings.shaping()
    curriculum = settings.curriculum()
    guesses = f"{wordle.max_guesses} guesses"
    if curriculum is not None:
        guesses = (
            f"{curriculum.start}-{curriculum.end} guesses by policy version ({curriculum.mode} "
            f"curriculum over {curriculum.over_versions} versions)"
            if curriculum.mode == "linear"
            else f"{curriculum.start}-{curriculum.end} guesses drawn per seed (curriculum)"
        )
    return TaskSpec(
        description=f"Wordle: {guesses}, feedback G/Y/X"
        + (" and a summary of all the feedback so far" if wordle.feedback_summary else "")
        + f"; answer list of {len(words.answers)} words, {len(words.allowed)} allowed guesses "
        "(SCOWL).",
        factory=lambda: WordleEnvironment(
            wordle, words, reveal_answer=reveal, shaping=shaping, curriculum=curriculum
        ),
        empty_state=lambda: WordleState(
            max_guesses=wordle.max_guesses, guesses_left=wordle.max_guesses
        ),
        # every guess (the curriculum's most), and every tolerated invalid move that does not
        # use one up (the move after the last tolerated one forfeits: it ends the game in place
        # of a guess)
        max_turns=settings.most_guesses()
        + (0 if wordle.invalid_costs_guess else wordle.max_invalid_moves),
        system_prompt=system_prompt(wordle.max_guesses),
    )


TASK = Task(
    name="wordle",
    summary="Wordle in max_guesses guesses with G/Y/X feedback",
    observation=WordleObservation,
    state=WordleState,
    settings=WordleSettings,
    build=build,
    options=ResetOptions,
)
