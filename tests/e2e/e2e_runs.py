"""Runs shared by the e2e evidence tests (tests/e2e/conftest.py runs each once per session):
``deltarl demo --tiny --task charset``, GRPO alone, the preset that is examples/charset-tiny.toml."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORKERS = 2


@dataclass(frozen=True)
class CharsetRun:
    """One finished run: its exit code, output, run directory and wall time."""

    code: int
    output: str
    run_dir: Path
    seconds: float

    def summary(self) -> dict[str, Any]:
        assert self.code == 0, self.output[-6000:]
        return json.loads((self.run_dir / "summary.json").read_text())

    def rewards(self) -> list[float]:
        """The trained batches' mean reward per step."""
        return [r for _, r in self.summary()["reward"]["trained"]]


@dataclass
class BackgroundRun:
    """One ``deltarl run`` started in the background (its output in ``log``)."""

    name: str
    run_dir: Path
    proc: subprocess.Popen[bytes]
    started: float
    log: Path

    def stop(self) -> None:
        """Stop the run if it still runs (SIGTERM: ``deltarl run`` stops its services)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def rewards(self) -> list[float]:
        """Wait for the run; the trained batches' mean reward per step."""
        code = self.proc.wait(timeout=450)
        assert code == 0, self.log.read_text()[-6000:]
        summary = json.loads((self.run_dir / "summary.json").read_text())
        rewards = [r for _, r in summary["reward"]["trained"]]
        took = time.monotonic() - self.started
        print(f"{self.name}: {took:.0f} s, rewards {[round(r, 2) for r in rewards]}")
        return rewards


def run_charset_demo(root: Path, cache: Path, seed: int, steps: int) -> CharsetRun:
    """``deltarl demo --tiny --task charset`` with WORKERS workers, in a subprocess."""
    run_dir = root / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTARL_")}
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "deltarl", "demo", "--tiny", "--task", "charset"),
            *("--steps", str(steps), "--workers", str(WORKERS), "--seed", str(seed)),
            *("--run-dir", str(run_dir), "--cache-dir", str(cache)),
            *("--no-live", "--timeout", "400"),
        ],
        capture_output=True,
        text=True,
        timeout=450,
        env=env,
    )
    return CharsetRun(proc.returncode, proc.stdout + proc.stderr, run_dir, time.monotonic() - t0)
