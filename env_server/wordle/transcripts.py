"""Solver-played Wordle games as chat transcripts, the material of a supervised warm start.

Each game is played by the reference solver (:mod:`deltarl.env_server.wordle.solver`) against
the server's own :class:`~deltarl.env_server.wordle.environment.WordleEnvironment` (in this
process: the same prompt, feedback text and rules as ``deltarl env``) and written exactly as a
rollout worker's episode holds it (:mod:`deltarl.rollout.episodes.runner`): the system prompt
(``WORDLE_SYSTEM_PROMPT`` by default), the first observation rendered by
:func:`~deltarl.env_server.core.render.observation_text` as the first user turn, then each guess as
an assistant turn (``"[crane]"``) and each step's feedback as the next user turn; the last
assistant turn is the game's last guess (the final feedback is not part of an episode).

One JSON object per line (JSONL)::

    {"messages": [{"role": "system", "content": ...}, {"role": "user", "content": ...},
                  {"role": "assistant", "content": "[crane]"}, ...],
     "seed": 17, "max_guesses": 6, "won": true, "guesses": 4, "reward": 1.0}

``reward`` is the game's return under the rules it was played with. Command line::

    python -m deltarl.env_server.wordle.transcripts --games 2000 --out wordle-solver.jsonl [--max-guesses 6]
        [--feedback-summary]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from deltarl.env_server.core.render import observation_text, write_transcripts
from deltarl.env_server.wordle.environment import WordleEnvironment
from deltarl.env_server.wordle.game import WordleRules, WordLists
from deltarl.env_server.wordle.options import ResetOptions
from deltarl.env_server.wordle.prompt import SYSTEM_PROMPT as WORDLE_SYSTEM_PROMPT
from deltarl.env_server.wordle.solver import Solver

__all__ = ["solver_transcript", "solver_transcripts"]


def solver_transcript(
    env: WordleEnvironment,
    solver: Solver,
    seed: int,
    *,
    system_prompt: str | None = WORDLE_SYSTEM_PROMPT,
    options: ResetOptions | None = None,
) -> dict[str, Any]:
    """One solver-played game of answer ``seed`` as a transcript record (see the module
    docstring)."""
    messages: list[dict[str, str]] = []
    if system_prompt is not None:
        messages.append({"role": "system", "content": system_prompt})
    result = env.reset(seed=seed, options=options)
    messages.append({"role": "user", "content": observation_text(None, result)})
    previous = result
    assert env.game is not None
    while not result.done:
        reply = f"[{solver.guess(env.game.guesses)}]"
        result = env.step(reply)
        messages.append({"role": "assistant", "content": reply})
        if result.done:
            break
        messages.append({"role": "user", "content": observation_text(previous, result)})
        previous = result
    game = env.game
    return {
        "messages": messages,
        "seed": seed,
        "max_guesses": game.rules.max_guesses,
        "won": game.won,
        "guesses": len(game.guesses),
        "reward": game.total_reward,
    }


def solver_transcripts(
    games: int,
    *,
    seed: int = 0,
    rules: WordleRules | None = None,
    options: ResetOptions | None = None,
    system_prompt: str | None = WORDLE_SYSTEM_PROMPT,
    only_won: bool = False,
) -> Iterator[dict[str, Any]]:
    """``games`` transcripts of answers ``seed, seed + 1, ...`` (``only_won``: skip lost games,
    so fewer may come)."""
    words = WordLists.load()
    env = WordleEnvironment(rules or WordleRules(), words)
    solver = Solver(words, seed=seed)
    for i in range(games):
        record = solver_transcript(
            env, solver, seed + i, system_prompt=system_prompt, options=options
        )
        if record["won"] or not only_won:
            yield record


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write solver-played Wordle games as JSONL chats.")
    ap.add_argument("--games", type=int, default=1000)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-guesses", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only-won", action="store_true", help="Leave out lost games.")
    ap.add_argument(
        "--feedback-summary",
        action="store_true",
        help="Each feedback also states what all the feedback so far shows (the env server's "
        "feedback_summary; train with the rendering the run will play).",
    )
    ap.add_argument(
        "--no-system-prompt", action="store_true", help="No system turn (the env's text only)."
    )
    a = ap.parse_args(argv)
    records = solver_transcripts(
        a.games,
        seed=a.seed,
        rules=WordleRules(max_guesses=a.max_guesses, feedback_summary=a.feedback_summary),
        system_prompt=None if a.no_system_prompt else WORDLE_SYSTEM_PROMPT,
        only_won=a.only_won,
    )
    print(json.dumps({"written": write_transcripts(a.out, records), "out": str(a.out)}))


if __name__ == "__main__":
    main()
