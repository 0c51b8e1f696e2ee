"""Evidence for on-policy distillation: on the charset task, a teacher trained there
makes an untrained student reach the teacher's reward in fewer steps than GRPO alone, with the
same seeds. Everything runs as real processes (``deltarl run examples/charset-tiny.toml``, the
preset of ``deltarl demo --tiny --task charset``: a random byte-level Llama, 2 workers):

1. the teacher: a GRPO run of TEACHER_STEPS steps; its final version, rebuilt from the bucket,
   becomes a Hugging Face directory (:func:`~deltarl.demo.report.export_version`);
2. for each seed: the same student (the untrained tiny model) for STUDENT_STEPS steps with GRPO
   alone (``deltarl demo --tiny --task charset``, the same preset: the session's shared run,
   e2e_runs.py; seed 0's is test_learning's run), and with a ``[teacher]`` serving that
   directory (the workers ask it for every group) and ``loss.distill = "jsd"``
   (``distill_coef`` DISTILL_COEF), all else equal (asserted on the two runs' configs).

Asserted, per seed: the distilled student reaches the threshold (THRESHOLD x the teacher's
reward, over a WINDOW-step running mean of the trained batches' reward) in fewer steps than
GRPO alone, and every trained token had teacher data. Measured numbers: docs/distillation.md.

Two runs at a time, each beside another one as the hint test's arms are: the teacher beside the
GRPO runs (which do not need it), then the distilled students side by side. A run alone leaves
part of 2 cores idle (process start-up, polls), so the pairs take less time than one after the
other; every arm runs beside one other run, so the arms share the same conditions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from statistics import mean
from typing import Any

import pytest
from e2e_runs import BackgroundRun, CharsetRun

from deltarl.demo.report import export_version
from deltarl.services.common.models import prepare_model

pytestmark = [pytest.mark.network, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TEACHER_STEPS = 24  # GRPO alone reaches ~1.0 by step 20 (docs/evidence.md)
TEACHER_SEED = 7
STUDENT_STEPS = 20
SEEDS = (0, 1)
WINDOW = 3
THRESHOLD = 0.9
DISTILL_COEF = 5.0


def start(root: Path, cache: Path, name: str, steps: int, seed: int, *sets: str) -> BackgroundRun:
    """Start one ``deltarl run examples/charset-tiny.toml`` run in the background."""
    run_dir = root / name
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTARL_")}
    overrides = [f"trainer.max_steps={steps}", f"run.seed={seed}", *sets]
    log = root / f"{name}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "deltarl", "run"),
                str(ROOT / "examples" / "charset-tiny.toml"),
                *(x for o in overrides for x in ("--set", o)),
                *("--run-dir", str(run_dir), "--cache-dir", str(cache)),
                *("--no-live", "--timeout", "400"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    return BackgroundRun(name, run_dir, proc, time.monotonic(), log)


def steps_to(rewards: list[float], target: float) -> int:
    """First step (1-based) whose WINDOW-step running mean reaches ``target``; len + 1 if none."""
    for i in range(WINDOW, len(rewards) + 1):
        if mean(rewards[i - WINDOW : i]) >= target:
            return i
    return len(rewards) + 1


def without_teacher(config: dict[str, Any]) -> dict[str, Any]:
    """A run config without its teacher and loss settings (what the two students differ in)."""
    out = json.loads(json.dumps(config))
    out["teacher"] = None
    out["trainer"].pop("loss", None)
    return out


def test_a_charset_teacher_makes_the_student_learn_faster(
    tmp_path: Path, model_cache: Path, charset_grpo: Callable[[int, int], CharsetRun]
) -> None:
    prepare_model("tiny-bytes", model_cache)  # before the runs, which would each build it
    running: list[BackgroundRun] = []
    try:
        teacher = start(tmp_path, model_cache, "teacher", TEACHER_STEPS, TEACHER_SEED)
        running.append(teacher)
        grpo_runs = {seed: charset_grpo(seed, STUDENT_STEPS) for seed in SEEDS}  # beside it
        rewards = teacher.rewards()
        teacher_reward = mean(rewards[-5:])
        assert teacher_reward > 0.8, rewards  # the teacher learned the task
        teacher_dir = export_version(
            str(teacher.run_dir / "bucket"),
            TEACHER_STEPS,
            prepare_model("tiny-bytes", model_cache),
            tmp_path / "teacher-model",
        )
        students = {
            seed: start(
                tmp_path,
                model_cache,
                f"distill-{seed}",
                STUDENT_STEPS,
                seed,
                f'teacher.model="{teacher_dir}"',
                'teacher.dtype="float32"',
                'teacher.device="cpu"',
                'trainer.loss.distill="jsd"',
                f"trainer.loss.distill_coef={DISTILL_COEF}",
            )
            for seed in SEEDS
        }
        running += students.values()
        distilled = {seed: run.rewards() for seed, run in students.items()}
    finally:
        for run in running:
            run.stop()
    target = THRESHOLD * teacher_reward
    results = {}
    for seed in SEEDS:
        grpo_run, student_dir = grpo_runs[seed], students[seed].run_dir
        grpo = grpo_run.rewards()
        print(f"grpo-{seed}: {grpo_run.seconds:.0f} s, rewards {[round(r, 2) for r in grpo]}")
        distilled_config = json.loads((student_dir / "summary.json").read_text())["config"]
        assert without_teacher(distilled_config) == without_teacher(grpo_run.summary()["config"])
        metrics = [json.loads(line) for line in (student_dir / "trainer" / "metrics.jsonl").open()]
        coverage = [m["distill/coverage"] for m in metrics if "distill/coverage" in m]
        assert len(coverage) == STUDENT_STEPS and min(coverage) == 1.0, coverage
        results[seed] = (steps_to(grpo, target), steps_to(distilled[seed], target))
    print(
        f"teacher reward {teacher_reward:.3f}, target {target:.3f}; steps (grpo, distill) {results}"
    )
    for seed, (grpo_steps, distill_steps) in results.items():
        assert distill_steps < grpo_steps, (seed, results)
    assert all(d <= STUDENT_STEPS for _, d in results.values()), results
