"""``deltarl eval``: play Wordle games with a model directory and report how it plays.

Only typer and the standard library are imported here; torch and transformers are imported by
:func:`deltarl.eval.wordle.run_eval` after the arguments are parsed.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from deltarl.services.common.models import DEFAULT_CACHE


def eval_wordle(
    model: str = typer.Option(
        ..., "--model", help="A model directory, or a prepared model: smollm2, tiny, tiny-bytes."
    ),
    out: Path | None = typer.Option(None, "--out", help="Write the whole report here (JSON)."),
    label: str = typer.Option("", "--label", help="A name for the report."),
    games: int = typer.Option(200, "--games", help="Games to play."),
    seed_start: int = typer.Option(
        1_000_000, "--seed-start", help="Play the answers of seeds seed-start, seed-start+1, ..."
    ),
    max_guesses: int = typer.Option(6, "--max-guesses", help="Guesses per game."),
    max_invalid: int = typer.Option(1, "--max-invalid", help="Invalid replies tolerated."),
    allow_non_words: bool = typer.Option(
        False, "--allow-non-words", help="Any 5 letters count as a guess (no dictionary)."
    ),
    feedback_summary: bool = typer.Option(
        False,
        "--feedback-summary",
        help="Each feedback also states what all the feedback so far shows (play as a run "
        "trained with env.feedback_summary).",
    ),
    max_new_tokens: int = typer.Option(12, "--max-new-tokens", help="Tokens per reply."),
    temperature: float = typer.Option(0.0, "--temperature", help="0: greedy."),
    also_temperature: float | None = typer.Option(
        None,
        "--also-temperature",
        help="Play the same games again sampling at this temperature (the run's): the "
        "report's `sampled` block.",
    ),
    batch_size: int = typer.Option(256, "--batch-size", help="Games generated together."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:1, ..."),
    seed: int = typer.Option(0, "--seed", help="torch seed (sampling)."),
    show: int = typer.Option(5, "--show", help="Games whose moves the report lists."),
    export_from: Path | None = typer.Option(
        None,
        "--export-from",
        help="A finished run's directory: play its final version, rebuilt from its bucket on "
        "--model's config and tokenizer.",
    ),
    export_to: Path | None = typer.Option(
        None, "--export-to", help="Where the rebuilt model goes (default RUN_DIR/final-policy)."
    ),
    version: int | None = typer.Option(
        None, "--version", help="With --export-from: this version instead of the final one."
    ),
    cache_dir: Path = typer.Option(
        DEFAULT_CACHE,
        "--cache-dir",
        help="Where prepared models are kept.",
    ),
) -> None:
    """Play Wordle games with a model under the env server's own rules, tokenized exactly as a
    rollout worker's episodes, and report valid moves, wins, greens and yellows, forfeits and
    the guesses consistent with the feedback."""
    from deltarl.eval.wordle import WordleEval, brief, export_policy, resolve_model, run_eval

    settings = WordleEval(
        games=games,
        seed_start=seed_start,
        max_guesses=max_guesses,
        max_invalid=max_invalid,
        allow_non_words=allow_non_words,
        feedback_summary=feedback_summary,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        batch_size=batch_size,
    )
    model_dir = resolve_model(model, cache_dir)
    exported = {}
    if export_from is not None:
        to = export_to or export_from / "final-policy"
        model_dir, v = export_policy(export_from, model_dir, to, version)
        exported = {"exported_from": str(export_from), "version": v}
    report = run_eval(
        model_dir,
        settings,
        label=label,
        also_temperature=also_temperature,
        device=device,
        seed=seed,
        show=show,
        exported=exported,
    )
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
    typer.echo(json.dumps(brief(report)))
