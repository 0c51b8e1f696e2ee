"""``deltarl run exp.toml``: the whole system of a run config on this machine, each service its
own process on loopback (the same launcher as ``deltarl demo``, which is one preset of it)."""

from __future__ import annotations

from pathlib import Path

import typer

from deltarl.demo.cli import launch, make_run_dir
from deltarl.services.common.models import DEFAULT_CACHE


def run(
    config_file: Path = typer.Argument(..., help="Run config (TOML); see examples/*.toml."),
    overrides: list[str] = typer.Option(
        [], "--set", "-s", help="Override a value: --set trainer.max_steps=20 (repeatable)."
    ),
    run_dir: Path | None = typer.Option(
        None, "--run-dir", help="Run directory (default: runs/<config name>-<timestamp>)."
    ),
    cache_dir: Path = typer.Option(
        DEFAULT_CACHE,
        "--cache-dir",
        help="Where prepared models (smollm2, tiny, tiny-bytes) are kept between runs.",
    ),
    timeout_s: float = typer.Option(
        3600.0, "--timeout", help="Give up (and stop everything) after this many seconds."
    ),
    live: bool | None = typer.Option(
        None, "--live/--no-live", help="Live progress table (default: on a terminal)."
    ),
    check: bool = typer.Option(
        False, "--check", help="Only read and check the config, print it resolved, and exit."
    ),
) -> None:
    """Start the coordinator, env server, rollout workers and trainer of a run config; show
    progress, then prove that every worker holds the trainer's exact final weights."""
    from rich.console import Console
    from rich.markup import escape

    from deltarl.run.config import RunConfigError, load_run_config

    console = Console(soft_wrap=True)
    try:
        config = load_run_config(config_file).with_overrides(overrides)
    except RunConfigError as err:
        console.print(f"[red]invalid run config:[/red] {escape(str(err))}", highlight=False)
        raise typer.Exit(2) from None
    if check:
        console.print_json(config.model_dump_json())
        return
    base = run_dir if run_dir is not None else _default_dir(config_file)
    launch(config, make_run_dir(base), cache_dir, console, timeout_s, live, "run")


def _default_dir(config_file: Path) -> Path:
    from datetime import datetime

    return Path("runs") / f"{config_file.stem}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
