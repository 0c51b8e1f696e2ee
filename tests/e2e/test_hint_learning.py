"""Evidence for hinted targeted self-distillation: on the charset task, a student that
can read the environment's hints learns the task in fewer steps with them (``rollout.hints.mode =
"env"``, ``trainer.loss.hint_coef``) than with GRPO alone, same seeds and budget.

A random tiny model cannot read a hint, so the student first gets that ability the way a real
instruct model has it, from a short supervised warm start (``deltarl sft``) on synthetic
hint-following conversations (:mod:`deltarl.env_server.charset.transcripts`): the charset prompt for one
of FAMILY's sets, then either :func:`~deltarl.env_server.charset.hints.charset_hint`'s hint as a second
user turn and a reply in that set, or no hint and a reply of random letters and digits. Its
unhinted replies therefore ignore the target; hinted, it answers in the set the hint names.

Then, per seed, two runs of ``deltarl run examples/charset-tiny.toml`` (real processes:
coordinator, env server, 2 workers, trainer) from that model, target TARGET: GRPO alone, and
GRPO + the env hints scored by the worker's own policy (``hint_coef`` HINT_COEF, ``hint_beta``
HINT_BETA: the forward KL to the hinted distribution), all else equal. Asserted over the SEEDS
(means, since one GRPO run can find the target early by chance): the hinted runs' mean reward
over the last LATE steps is at least LATE_GAP above GRPO alone's, and they reach THRESHOLD (a
WINDOW-step running mean of the trained batches' reward) in fewer steps (a run that never reaches
it counts as STEPS + 1); per seed, every step of the hinted run with a failed reply trained on
hints (``hint/loss`` logged) while GRPO's had none. Measured in this setting over 5-6 runs of
seeds 0 and 1 (an earlier warm start): steps 7-10 gap 0.27-0.56, steps to the threshold 7-8
with hints against 9-11 without. The current warm start reads the hint less sharply (the hinted
arm's hint/kl_teacher starts at 0.3-0.5, was 0.6-0.8) and the gap is smaller: per seed 0.10,
0.15, 0.13 in one run (threshold at 10, 9, 10 with hints, never without), 0.10, -0.02, 0.17 in
another; one arm of one seed varies by up to ~0.16 between runs, so a per-seed assertion is too
strict for 10 steps of real processes, hence the means over three seeds and a LATE_GAP of 0.05.
With the default reverse KL the gap was 0.21-0.52 (3 runs per seed, the earlier warm start),
hence the forward KL here. Numbers and what they show: docs/distillation.md, docs/evidence.md.
"""

from __future__ import annotations

import json
import os
import string
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean

import pytest
from e2e_runs import BackgroundRun

from deltarl.env_server.charset.transcripts import HintData, hint_transcripts
from deltarl.env_server.core.render import write_transcripts

pytestmark = [pytest.mark.network, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
FAMILY = (string.ascii_uppercase, string.ascii_lowercase, string.digits)
TARGET = string.digits
SFT = {"steps": 100, "batch_size": 16, "lr": 1e-2, "transcripts": 2000}
STEPS = 10
SEEDS = (0, 1, 2)
LR = 3e-3
HINT_COEF = 5.0
HINT_BETA = 0.0  # forward KL: the wider gap in the runs measured (docs/evidence.md)
WINDOW = 3
THRESHOLD = 0.5
LATE = 4  # steps 7-10
LATE_GAP = 0.05


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("DELTARL_")}


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> tuple[Path, Path]:
    """(the warm-started student's directory, the model cache), built once per module; the
    session's model cache, whose ``tiny-bytes`` the other e2e runs built already."""
    root = tmp_path_factory.mktemp("hint-warm")
    data = root / "hints.jsonl"
    records = hint_transcripts(SFT["transcripts"], seed=0, data=HintData(targets=FAMILY))
    write_transcripts(data, records)
    out, cache = root / "student", model_cache
    t0 = time.monotonic()
    sets = {
        "model": "tiny-bytes",
        "cache_dir": cache,
        "data": data,
        "out": out,
        "steps": SFT["steps"],
        "batch_size": SFT["batch_size"],
        "lr": SFT["lr"],
        "device": "cpu",
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "deltarl",
            "sft",
            *(x for k, v in sets.items() for x in ("--set", f"{k}={v}")),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env(),
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    print(f"warm start: {time.monotonic() - t0:.0f} s, {proc.stdout.strip()}")
    return out, cache


def start(root: Path, name: str, model: Path, cache: Path, seed: int, *sets: str) -> BackgroundRun:
    """Start one ``deltarl run examples/charset-tiny.toml`` run from ``model`` (in the
    background: the two arms of a seed run side by side, as measured)."""
    run_dir = root / name
    overrides = [
        f'run.model="{model}"',
        f'env.charset_target="{TARGET}"',
        f"trainer.max_steps={STEPS}",
        f"trainer.optimizer.lr={LR}",
        "trainer.batch.groups_per_step=1",
        f"run.seed={seed}",
        "rollout.submit_timeout_s=60",  # hinted groups are scored before they are submitted
        *sets,
    ]
    log = (root / f"{name}.log").open("w")
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "deltarl", "run", str(ROOT / "examples" / "charset-tiny.toml")),
            *(x for o in overrides for x in ("--set", o)),
            *("--run-dir", str(run_dir), "--cache-dir", str(cache)),
            *("--no-live", "--timeout", "400"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env(),
    )
    return BackgroundRun(name, run_dir, proc, time.monotonic(), root / f"{name}.log")


def steps_to(rewards: list[float], target: float) -> int:
    """First step (1-based) whose WINDOW-step running mean reaches ``target``; len + 1 if none."""
    for i in range(WINDOW, len(rewards) + 1):
        if mean(rewards[i - WINDOW : i]) >= target:
            return i
    return len(rewards) + 1


def hint_steps(run_dir: Path) -> set[int]:
    """The trainer steps that logged a hint loss."""
    lines = (run_dir / "trainer" / "metrics.jsonl").read_text().splitlines()
    return {m["step"] for m in map(json.loads, lines) if "hint/loss" in m}


def test_env_hints_make_a_hint_reading_student_learn_faster(
    tmp_path: Path, warm_model: tuple[Path, Path]
) -> None:
    model, cache = warm_model
    results = {}
    for seed in SEEDS:
        grpo = start(tmp_path, f"grpo-{seed}", model, cache, seed)
        hinted = start(
            tmp_path,
            f"hints-{seed}",
            model,
            cache,
            seed,
            'rollout.hints.mode="env"',
            f"trainer.loss.hint_coef={HINT_COEF}",
            f"trainer.loss.hint_beta={HINT_BETA}",
        )
        try:
            grpo_rewards, hinted_rewards = grpo.rewards(), hinted.rewards()
        finally:
            for r in (grpo, hinted):
                r.stop()
        # every hinted step with a failed reply trained on hints (a batch at full marks has none)
        failed = {step for step, r in enumerate(hinted_rewards, 1) if r < 1.0}
        assert not hint_steps(grpo.run_dir) and failed <= hint_steps(hinted.run_dir), failed
        late = mean(hinted_rewards[-LATE:]) - mean(grpo_rewards[-LATE:])
        results[seed] = (
            steps_to(grpo_rewards, THRESHOLD),
            steps_to(hinted_rewards, THRESHOLD),
            round(late, 3),
        )
    print(f"steps to a {WINDOW}-step mean of {THRESHOLD} (grpo, hints) and late gap: {results}")
    grpo_steps, hinted_steps, late = (mean(r[i] for r in results.values()) for i in range(3))
    assert late >= LATE_GAP, results
    assert hinted_steps < grpo_steps, results
