"""``deltarl demo``: the whole disaggregated system on this machine, as separate processes.

Order of operations (:func:`run_demo`):

1. create the run directory (``runs/demo-<timestamp>/``): ``bucket/`` (the local-directory
   bucket), ``trainer/`` (settings, metrics, checkpoints), ``logs/<process>.log``,
   ``coordinator.sqlite3``;
2. prepare the model directory once (:mod:`deltarl.services.common.models`, cached in ``--cache-dir``);
3. start the coordinator (embedded SQLite, trainer and worker tokens generated for this run) and
   the env server (``--task``: the charset task scoring capital letters, Wordle, or the charset task
   on a-z; a token too) on free loopback ports
   and wait for their health checks;
4. start the rollout workers (transformers engine, CPU) and the trainer, which publishes version
   0 (an anchor) and one delta per optimizer step to the bucket;
5. poll the coordinator every second for the live view, and the children for an unexpected exit
   (the demo stops and shows the tail of that process's log);
6. when the trainer has finished its steps, wait for every worker to hold the final version,
   then prove that their weights equal the trainer's (the coordinator's ``weights_verified``
   when the workers report digests; otherwise a rebuild of the final version from the bucket,
   compared with the trainer's digests), draw the reward curve and print the summary (also
   written to ``summary.json``);
7. stop every child: SIGTERM, then SIGKILL after a timeout (also on Ctrl-C and on failure).

Only typer and the standard library are imported at module level; torch (for the model and the
proof) and the clients are imported inside :func:`demo`.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
from datetime import datetime
from pathlib import Path
from typing import cast, get_args

import typer
from rich.console import Console

from deltarl.demo.plan import DemoPlan, DemoTask
from deltarl.run.config import RunConfig
from deltarl.services.common.models import DEFAULT_CACHE

EXIT_INTERRUPTED = 130


def make_run_dir(base: Path | None) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    d = base if base is not None else Path("runs") / f"demo-{stamp}"
    if d.exists() and any(d.iterdir()):
        raise typer.BadParameter(f"{d} exists and is not empty: choose another --run-dir")
    d.mkdir(parents=True, exist_ok=True)
    return d.resolve()


def quiet_console_logging(log_file: Path) -> None:
    """Send this process's log records to ``log_file``; keep only warnings on the terminal
    (the live view owns it)."""
    root = logging.getLogger()
    for handler in root.handlers:
        handler.setLevel(logging.WARNING)
    fh = logging.FileHandler(log_file)
    fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    fh.setLevel(logging.INFO)
    root.addHandler(fh)
    root.setLevel(min(root.getEffectiveLevel(), logging.INFO))
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def demo(
    tiny: bool = typer.Option(
        False,
        "--tiny",
        help="A random tiny Llama (with --task capitals or charset a byte-level tokenizer, "
        "with --task wordle SmolLM2's): fast; learns the character tasks, nothing on Wordle.",
    ),
    task: str = typer.Option(
        "capitals",
        "--task",
        help="Environment task: 'capitals' (one reply, scored by its share of capital letters: "
        "SmolLM2 learns it within 10 steps), 'wordle' (one scored guess), or 'charset' (one "
        "reply, scored by its share of a-z characters).",
    ),
    steps: int | None = typer.Option(
        None,
        "--steps",
        min=1,
        help="Optimizer steps (default: 10 on capitals, 8 on wordle and charset; with --tiny "
        "30, or 3 on wordle).",
    ),
    workers: int = typer.Option(2, "--workers", min=1, max=8, help="Rollout workers."),
    seed: int = typer.Option(
        0, "--seed", min=0, help="Sampling seeds of the workers (seed x workers + i) and trainer."
    ),
    run_dir: Path | None = typer.Option(
        None, "--run-dir", help="Run directory (default: runs/demo-<timestamp>)."
    ),
    cache_dir: Path = typer.Option(
        DEFAULT_CACHE,
        "--cache-dir",
        help="Where the converted model directory is kept between runs.",
    ),
    timeout_s: float = typer.Option(
        1200.0, "--timeout", help="Give up (and stop everything) after this many seconds."
    ),
    live: bool | None = typer.Option(
        None,
        "--live/--no-live",
        help="Live progress table (default: when the output is a terminal); --no-live prints "
        "one line per version instead.",
    ),
    distill: bool = typer.Option(
        False,
        "--distill",
        help="On-policy distillation: also run a teacher service (the run's model, or "
        "--teacher-model) that the workers ask for every group, and train with "
        'loss.distill = "jsd" (docs/distillation.md).',
    ),
    teacher_model: str | None = typer.Option(
        None,
        "--teacher-model",
        help="With --distill: the teacher's model directory or Hub id (it must share the "
        "policy's tokenizer); default: the run's model.",
    ),
) -> None:
    """Run the whole system locally: coordinator, env server, rollout workers, trainer and a
    local-directory bucket, each its own process on loopback; show live progress, then prove
    that every worker ends with the trainer's exact weights and draw the reward curve."""
    console = Console(soft_wrap=True)
    if task not in get_args(DemoTask):
        raise typer.BadParameter(f"unknown task {task!r}: choose capitals, wordle or charset")
    plan = DemoPlan.for_model(tiny, steps, workers, cast(DemoTask, task))
    if teacher_model is not None and not distill:
        raise typer.BadParameter("--teacher-model goes with --distill")
    plan = dataclasses.replace(plan, seed=seed, distill=distill, teacher_model=teacher_model)
    launch(plan.run_config(), make_run_dir(run_dir), cache_dir, console, timeout_s, live, "demo")


def launch(
    config: RunConfig,
    rd: Path,
    cache_dir: Path,
    console: Console,
    timeout_s: float,
    live: bool | None,
    name: str,
) -> None:
    """Run ``config`` in ``rd`` (``deltarl demo`` and ``deltarl run``): logs to
    ``rd/logs/<name>.log``, SIGTERM and Ctrl-C stop every child; exits non-zero on failure."""
    (rd / "logs").mkdir(exist_ok=True)
    (rd / "run.json").write_text(config.model_dump_json(indent=2) + "\n")
    quiet_console_logging(rd / "logs" / f"{name}.log")
    use_live = console.is_terminal if live is None else live

    from deltarl.demo.runner import DemoFailedError, run_demo

    signal.signal(signal.SIGTERM, interrupt)  # stop the children as on Ctrl-C
    try:
        summary = run_demo(
            config,
            rd,
            cache_dir,
            console,
            timeout_s=timeout_s,
            live=use_live,
            title=f"deltarl {name}",
        )
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: every process was stopped[/yellow]")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except DemoFailedError as exc:
        console.print(f"[red]{name} failed:[/red] {exc}")
        if exc.log_tail:
            console.print(exc.log_tail, markup=False, highlight=False)
        raise typer.Exit(1) from None
    if not summary["ok"]:
        raise typer.Exit(1)


def interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
