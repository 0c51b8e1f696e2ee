"""``deltarl demo``: the whole disaggregated system on this machine, as separate processes.

Order of operations (:func:`run_demo`):

1. create the run directory (``runs/demo-<timestamp>/``): ``bucket/`` (the local-directory
   bucket), ``trainer/`` (settings, metrics, checkpoints), ``logs/<process>.log``,
   ``coordinator.sqlite3``;
2. prepare the model directory once (:mod:`deltarl.demo.model`, cached in ``--cache-dir``);
3. start the coordinator (embedded SQLite, trainer and worker tokens generated for this run) and
   the env server (``--task``: Wordle, or the charset task; a token too) on free loopback ports
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
import json
import logging
import os
import secrets
import signal
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import typer

from deltarl.demo.model import ModelKind

__all__ = ["DemoPlan", "DemoTask", "demo", "demo_environment", "new_token"]

DemoTask = Literal["wordle", "charset"]

logger = logging.getLogger(__name__)

EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class DemoPlan:
    """The experiment the demo runs (chosen to finish within minutes on 2 CPU cores)."""

    model_kind: ModelKind
    steps: int
    workers: int
    task: DemoTask = "wordle"
    # worker i samples with engine seed seed * workers + i; the trainer gets this seed too
    seed: int = 0
    group_size: int = 6
    groups_per_step: int = 2
    max_new_tokens: int = 32
    # One scored guess per game (partial credit: greens + yellows/2 of 5 letters), and one
    # invalid reply tolerated before it (a warning, then a second turn): every episode ends with
    # the environment's reward, none is cut by max_turns.
    env_max_guesses: int = 1
    max_turns: int = 2
    max_staleness: int = 2
    lr: float = 1e-6
    # AdamW's decoupled decay moves weights even when every advantage is 0 (a random --tiny
    # model never scores): it keeps --tiny's deltas realistic in density.
    weight_decay: float = 0.0
    anchor_every: int = 0  # only version 0 carries an anchor

    @classmethod
    def for_model(
        cls, tiny: bool, steps: int | None, workers: int, task: DemoTask = "wordle"
    ) -> DemoPlan:
        """The default experiment of SmolLM2 (``tiny`` false) or of the tiny random model, on
        Wordle or on the charset task."""
        if task == "charset" and tiny:
            # A random Llama over bytes: a reply of 16 byte tokens, about 10% of them in the
            # target set a-z at first. lr 1e-2 (not SmolLM2's 1e-6): a random 91k-parameter
            # model has no pretrained knowledge to preserve, and AdamW moves each weight by
            # about lr per step, so 1e-2 shifts a logit by O(0.1-1) per step and the reward
            # rises within a few dozen steps (1e-3 needs hundreds).
            return cls(
                model_kind="tiny-bytes",
                steps=steps if steps is not None else 30,
                workers=workers,
                task="charset",
                group_size=8,
                groups_per_step=2,
                max_new_tokens=16,
                max_turns=1,
                lr=1e-2,
            )
        if task == "charset":
            return cls(
                model_kind="smollm2",
                steps=steps if steps is not None else 8,
                workers=workers,
                task="charset",
                max_new_tokens=32,
                max_turns=1,
            )
        if tiny:
            return cls(
                model_kind="tiny",
                steps=steps if steps is not None else 3,
                workers=workers,
                group_size=4,
                max_new_tokens=16,
                lr=1e-3,
                weight_decay=0.1,
            )
        return cls(
            model_kind="smollm2",
            steps=steps if steps is not None else 8,
            workers=workers,
            group_size=6,
            max_new_tokens=32,
        )

    def trainer_overrides(self, model_dir: Path, trainer_dir: Path) -> list[str]:
        """``--set`` arguments of ``deltarl train``."""
        values: dict[str, Any] = {
            "model": str(model_dir),
            "run_dir": str(trainer_dir),
            "seed": self.seed,
            "max_steps": self.steps,
            "optimizer.lr": self.lr,
            "optimizer.weight_decay": self.weight_decay,
            "batch.group_size": self.group_size,
            "batch.groups_per_step": self.groups_per_step,
            "batch.micro_batch_size": self.group_size * self.groups_per_step,
            "batch.max_staleness": self.max_staleness,
            "publish.anchor_every": self.anchor_every,
            "checkpoint.every": 0,
            "checkpoint.keep": 1,
        }
        out: list[str] = []
        for key, value in values.items():
            out += ["--set", f"{key}={json.dumps(value)}"]
        return out


def _run_dir(base: Path | None) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    d = base if base is not None else Path("runs") / f"demo-{stamp}"
    if d.exists() and any(d.iterdir()):
        raise typer.BadParameter(f"{d} exists and is not empty: choose another --run-dir")
    d.mkdir(parents=True, exist_ok=True)
    return d.resolve()


def _quiet_console_logging(log_file: Path) -> None:
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
        help="A random tiny Llama (SmolLM2's tokenizer; with --task charset a byte-level "
        "tokenizer): fast; learns nothing on Wordle, learns the charset task.",
    ),
    task: str = typer.Option(
        "wordle",
        "--task",
        help="Environment task: 'wordle', or 'charset' (one reply, scored by its share of "
        "a-z characters: a tiny model learns it within a few dozen steps).",
    ),
    steps: int | None = typer.Option(
        None,
        "--steps",
        min=1,
        help="Optimizer steps (default: 8, or 3 with --tiny, 30 with --tiny --task charset).",
    ),
    workers: int = typer.Option(2, "--workers", min=1, max=8, help="Rollout workers."),
    seed: int = typer.Option(
        0, "--seed", min=0, help="Sampling seeds of the workers (seed x workers + i) and trainer."
    ),
    run_dir: Path | None = typer.Option(
        None, "--run-dir", help="Run directory (default: runs/demo-<timestamp>)."
    ),
    cache_dir: Path = typer.Option(
        Path.home() / ".cache" / "deltarl" / "demo",
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
) -> None:
    """Run the whole system locally: coordinator, env server, rollout workers, trainer and a
    local-directory bucket, each its own process on loopback; show live progress, then prove
    that every worker ends with the trainer's exact weights and draw the reward curve."""
    from rich.console import Console

    console = Console(soft_wrap=True)
    if task not in ("wordle", "charset"):
        raise typer.BadParameter(f"unknown task {task!r}: choose wordle or charset")
    plan = DemoPlan.for_model(tiny, steps, workers, "charset" if task == "charset" else "wordle")
    plan = dataclasses.replace(plan, seed=seed)
    rd = _run_dir(run_dir)
    (rd / "logs").mkdir(exist_ok=True)
    _quiet_console_logging(rd / "logs" / "demo.log")
    use_live = console.is_terminal if live is None else live

    from deltarl.demo.runner import DemoFailedError, run_demo

    signal.signal(signal.SIGTERM, _interrupt)  # stop the children as on Ctrl-C

    try:
        summary = run_demo(plan, rd, cache_dir, console, timeout_s=timeout_s, live=use_live)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: every process was stopped[/yellow]")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except DemoFailedError as exc:
        console.print(f"[red]demo failed:[/red] {exc}")
        if exc.log_tail:
            console.print(exc.log_tail, markup=False, highlight=False)
        raise typer.Exit(1) from None
    if not summary["ok"]:
        raise typer.Exit(1)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def new_token() -> str:
    """A random token for one run's roles (URL-safe, 43 characters)."""
    return secrets.token_urlsafe(32)


def demo_environment(rd: Path) -> dict[str, str]:
    """Environment shared by every child: the bucket, quiet tokenizers, one thread each
    (two workers, a trainer and two services share the cores)."""
    return {
        "DELTARL_BUCKET_URI": str(rd / "bucket"),
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "DELTARL_LOG_LEVEL": "INFO",
        "PYTHONUNBUFFERED": "1",
    }


def plan_dict(plan: DemoPlan) -> dict[str, Any]:
    """The plan as JSON-ready values (written into summary.json)."""
    return asdict(plan)


def elapsed(t0: float) -> float:
    """Seconds since ``t0`` (``time.monotonic``)."""
    return time.monotonic() - t0
