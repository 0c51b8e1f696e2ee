"""bench/trainer_memory_bench.py on a CPU (--tiny): every config trains the same step (the same
sequences and tokens), and a token budget is a valid setting of the trainer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tiny_run_reports_each_config(tmp_path: Path) -> None:
    out = tmp_path / "mem.json"
    cmd = [sys.executable, str(ROOT / "bench" / "trainer_memory_bench.py"), "--tiny"]
    cmd += ["--device", "cpu", "--groups", "2", "--group-size", "3", "--configs", "6", "2:400"]
    subprocess.run([*cmd, "--json", str(out)], check=True, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [r["config"] for r in rows] == ["6", "2:400"]
    assert rows[0]["sequences"] == rows[1]["sequences"] == 6
    assert rows[0]["tokens"] == rows[1]["tokens"] and rows[0]["trained_tokens"] > 0
    assert all(r["step_s"] > 0 and "peak_gib" not in r for r in rows)  # no CUDA: not measured
