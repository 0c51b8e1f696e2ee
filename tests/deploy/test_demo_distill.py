"""``deltarl demo --distill`` end to end: the teacher service runs beside the system, the
workers ask it for every group, and the trainer trains with ``loss.distill = "jsd"`` on teacher
data covering every trained token (tiny byte-level model, charset task, 2 steps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.network, pytest.mark.slow]  # ~60 s alone, 130 s on a busy machine

STEPS = 2


def test_demo_with_a_teacher(tmp_path: Path, model_cache: Path) -> None:
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTARL_")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "deltarl",
            "demo",
            "--tiny",
            "--task",
            "charset",
            "--distill",
            "--steps",
            str(STEPS),
            "--run-dir",
            str(run_dir),
            "--cache-dir",
            str(model_cache),
            "--no-live",
            "--timeout",
            "240",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ok"] is True and summary["final_version"] == STEPS
    assert sorted(summary["workers"]) == ["worker-1", "worker-2"]  # the teacher is no worker
    run = json.loads((run_dir / "run.json").read_text())
    assert run["teacher"] is not None and run["trainer"]["loss"]["distill"] == "jsd"
    steps = [json.loads(line) for line in (run_dir / "trainer" / "metrics.jsonl").open()]
    steps = [s for s in steps if "distill/coverage" in s]
    assert len(steps) == STEPS
    # every trained token came with the teacher's top-k (teacher data is required by default)
    assert all(s["distill/coverage"] == 1.0 for s in steps), steps
    assert all(s["distill/loss"] >= 0.0 for s in steps)
    assert (run_dir / "logs" / "teacher.log").is_file()
    # a worker checks the teacher's vocabulary as its episode loop starts; on a busy machine the
    # trainer may finish its steps on one worker's groups before the other's loop began
    worker_logs = [(run_dir / "logs" / f"{w}.log").read_text() for w in ("worker-1", "worker-2")]
    assert any("(vocabulary 259)" in text for text in worker_logs), worker_logs
    assert not any("teacher and student must share a tokenizer" in t for t in worker_logs)
    processes = json.loads((run_dir / "processes.json").read_text())
    assert "teacher" in processes
    for info in processes.values():  # every child, the teacher too, was stopped
        with pytest.raises(ProcessLookupError):
            os.kill(info["pid"], 0)
