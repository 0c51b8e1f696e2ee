"""Evidence for hinted self-distillation (issue 15): on a task whose environment gives hints,
GRPO plus the hints learns faster than GRPO alone, on the same seeds and budget. Everything runs
as real processes (``deltarl run examples/demo.toml``, the default demo: SmolLM2-135M-Instruct
asked to reply in capital letters, the charset task with target A-Z, 2 CPU workers), smaller
than the demo (GROUP_SIZE x 2 groups per step, MAX_NEW_TOKENS, STEPS steps):

* GRPO alone: the demo's settings (lr 1e-4, fp32);
* hinted: the same, with ``rollout.hint_mode = "env"`` (the charset hinter: "Reply in CAPITAL
  LETTERS only, without lowercase letters or spaces, for example: HELLOWORLD", inserted before
  the reply and scored once by the worker's policy) and ``trainer.loss.hint_coef`` HINT_COEF.

Asserted, per seed: the mean reward of the last K trained batches is higher with hints by
MARGIN or more, and hints were attached to the trained batches. Measured numbers:
docs/distillation.md (Evidence so far) and docs/evidence.md. Status (2026-11-27): NOT seen to
pass, and on the runs made it would fail. Calibration runs on 2 shared CPU cores (load average
5-13 from other sessions) took 3.5-10 min each (the 4 runs of this test: 15-40 min, over the
~5 min CI budget), and at this budget (5 steps of 2 x 4 episodes; with staleness 2 the first 3
trained batches are the same in both arms) the arms were within noise: last-2-step means GRPO
vs hints 0.142 vs 0.085 (seed 0), 0.271 vs 0.242 (seed 1), 0.104 vs
0.137 (seed 2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean
from typing import Any

import pytest

pytestmark = [pytest.mark.network, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SEEDS = (0, 1)
STEPS = 5
K = 2  # last steps averaged
GROUP_SIZE = 4
MAX_NEW_TOKENS = 16
HINT_COEF = 5.0
MARGIN = 0.1
SMALL = (
    f"trainer.max_steps={STEPS}",
    f"run.group_size={GROUP_SIZE}",
    f"rollout.max_new_tokens={MAX_NEW_TOKENS}",
    f"trainer.batch.micro_batch_size={2 * GROUP_SIZE}",
    "rollout.submit_timeout_s=120.0",  # the demo's 10 s is too short on a loaded machine
)
HINTED = ('rollout.hint_mode="env"', f"trainer.loss.hint_coef={HINT_COEF}")


def run(root: Path, name: str, seed: int, *sets: str) -> tuple[list[float], list[dict[str, Any]]]:
    """One ``deltarl run examples/demo.toml`` run: the trained batches' mean reward per step and
    the trainer's metrics."""
    run_dir = root / name
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTARL_")}
    t0 = time.monotonic()
    overrides = [*SMALL, f"run.seed={seed}", *sets]
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "deltarl", "run", str(ROOT / "examples" / "demo.toml")),
            *(x for o in overrides for x in ("--set", o)),
            *("--run-dir", str(run_dir), "--no-live", "--timeout", "900"),
        ],
        capture_output=True,
        text=True,
        timeout=960,
        env=env,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    rewards = [r for _, r in summary["reward"]["trained"]]
    metrics = [json.loads(line) for line in (run_dir / "trainer" / "metrics.jsonl").open()]
    print(f"{name}: {time.monotonic() - t0:.0f} s, rewards {[round(r, 2) for r in rewards]}")
    return rewards, metrics


def test_env_hints_beat_grpo_alone_on_capitals(tmp_path: Path) -> None:
    results = {}
    for seed in SEEDS:
        grpo, _ = run(tmp_path, f"grpo-{seed}", seed)
        hinted, metrics = run(tmp_path, f"hints-{seed}", seed, *HINTED)
        assert len(grpo) == len(hinted) == STEPS, (grpo, hinted)
        hint_loss = [m["hint/loss"] for m in metrics if "hint/loss" in m]
        assert len(hint_loss) >= STEPS // 2, metrics[-1]  # the hints reached the trainer
        results[seed] = (mean(grpo[-K:]), mean(hinted[-K:]))
    print(f"last {K} steps' mean reward (grpo, hints): {results}")
    for seed, (grpo_last, hinted_last) in results.items():
        assert hinted_last - grpo_last >= MARGIN, (seed, results)
