"""bench/vllm_speed.py without a GPU: its orchestration (rounds of fresh processes, results
parsed from each, per-round ratios, failures, timeouts and the time budget) with ``--dry-run``'s
stand-in generator, and its multi-turn workload against a stand-in runner."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SPEED = Path(__file__).resolve().parents[2] / "bench" / "vllm_speed.py"


def load() -> ModuleType:
    if str(SPEED.parent) not in sys.path:  # its sibling bench/common.py, as when run as a script
        sys.path.insert(0, str(SPEED.parent))
    spec = importlib.util.spec_from_file_location("bench_vllm_speed", SPEED)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def dry_run(out: Path, *argv: str, env: dict[str, str] | None = None) -> tuple[int, Any, str]:
    """The bench with ``--dry-run`` and small workloads; (exit code, its JSON, its output)."""
    cmd = [sys.executable, str(SPEED), "--dry-run", "--out-dir", str(out), "--reps", "1"]
    cmd += ["--batches", "4", "8", "--new-tokens", "4", "--mt-episodes", "6", "--mt-turns", "3"]
    proc = subprocess.run(
        [*cmd, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | (env or {}),
    )
    data = json.loads((out / "vllm_speed.json").read_text())
    return proc.returncode, data, proc.stdout + proc.stderr


def test_rounds_of_fresh_processes_give_per_round_ratios(tmp_path: Path) -> None:
    rc, data, output = dry_run(tmp_path, "--rounds", "2")
    assert rc == 0, output
    assert [r["round"] for r in data["rounds"]] == [1, 2]
    pids = {p["info"]["pid"] for r in data["rounds"] for p in r["processes"].values()}
    assert len(pids) == 6  # every column of every round in a process of its own
    for r in data["rounds"]:
        assert list(r["processes"]) == ["engine", "llm_same", "llm_default"]  # in this order
    row = data["summary"]["single b8"]
    assert row["columns"]["engine"]["n"] == 2 and row["ratios"]["engine/llm_default"]["n"] == 2
    per_round = [
        r["processes"]["engine"]["results"]["single b8"]["tokens_per_s"]
        / r["processes"]["llm_default"]["results"]["single b8"]["tokens_per_s"]
        for r in data["rounds"]
    ]
    assert row["ratios"]["engine/llm_default"]["values"] == pytest.approx(per_round)
    reuse = data["summary"]["multi-turn (reuse)"]["columns"]
    assert set(reuse) == {"engine", "llm_same", "llm_default"}
    mt = data["rounds"][0]["processes"]["engine"]["results"]
    assert mt["multi-turn (no reuse)"]["cached_prompt_tokens"] == 0
    assert mt["multi-turn (reuse)"]["cached_share"] > 0.5  # the conversations were reused
    assert mt["multi-turn (reuse)"]["turns"] == 3 and mt["multi-turn (reuse)"]["episodes"] == 6
    assert "cost" in mt["single b4"] and len(mt["single b4"]["cost"]["gc_collections"]) == 3
    table = (tmp_path / "vllm_speed.md").read_text()
    assert "| single b8 |" in table and "engine/llm_default" in table and "FAILED" not in table
    assert (tmp_path / "logs" / "r2-llm_default.log").is_file()


def test_a_failing_column_is_reported_and_the_others_measured(tmp_path: Path) -> None:
    rc, data, output = dry_run(
        tmp_path, "--rounds", "1", env={"DELTARL_SPEED_DRY_FAIL": "llm_same"}
    )
    assert rc == 1
    failed = data["rounds"][0]["processes"]["llm_same"]
    assert "exit code 1" in failed["failure"] and "r1-llm_same.log" in failed["failure"]
    assert "a start-up failure asked for by the test" in output  # the log's tail is printed
    row = data["summary"]["single b4"]
    assert "engine/llm_default" in row["ratios"] and "engine/llm_same" not in row["ratios"]
    assert "FAILED: round 1 llm_same: exit code 1" in (tmp_path / "vllm_speed.md").read_text()


def test_a_failing_workload_is_reported_and_the_rest_goes_on(tmp_path: Path) -> None:
    rc, data, _ = dry_run(
        tmp_path, "--rounds", "1", "--columns", "engine", env={"DELTARL_SPEED_DRY_FAIL": "diag"}
    )
    assert rc == 1
    proc = data["rounds"][0]["processes"]["engine"]
    assert "RuntimeError: a diagnostic that fails" in proc["errors"]["diag: dry failure"]
    assert "diag: dry diagnostic" in proc["results"] and not proc.get("failure")


def test_a_hung_process_is_killed_and_the_budget_stops_at_a_round(tmp_path: Path) -> None:
    rc, data, _ = dry_run(
        tmp_path,
        *("--rounds", "3", "--columns", "engine", "llm_default"),
        *("--child-timeout-s", "2", "--budget-s", "1"),
        env={"DELTARL_SPEED_DRY_HANG": "engine"},
    )
    assert rc == 1
    assert len(data["rounds"]) == 1 and data["stopped"].startswith("budget: 1 of 3 rounds")
    assert data["rounds"][0]["processes"]["engine"]["failure"].startswith("timed out after 2 s")
    assert data["rounds"][0]["processes"]["llm_default"]["results"]


class Echo:
    """A runner that replies ``reply`` tokens and reuses a prompt seen before (by prefix)."""

    vocab = 1000
    multi_turn = True

    def __init__(self) -> None:
        self.calls: list[list[list[int]]] = []

    def generate(
        self, prompts: list[list[int]], new_tokens: int, fresh_salts: bool
    ) -> tuple[list[list[int]], list[int | None]]:
        seen = [p for call in self.calls for p in call]
        hits = [
            0 if fresh_salts else max((len(q) for q in seen if p[: len(q)] == q), default=0)
            for p in prompts
        ]
        self.calls.append([list(p) for p in prompts])
        return [[1] * new_tokens for _ in prompts], list(hits)


def test_multi_turn_conversations_grow_by_each_reply_and_answer() -> None:
    speed = load()
    a = argparse.Namespace(mt_system=10, mt_user=3, mt_reply=2, mt_feedback=4)
    runner = Echo()
    got = speed.multi_turn(runner, a, False, count=5, turns=3)
    lengths = [[len(p) for p in call] for call in runner.calls]
    assert lengths == [[13] * 5, [19] * 5, [25] * 5]
    first, second = runner.calls[0], runner.calls[1]
    assert all(p[:10] == first[0][:10] for p in first)  # one system prompt for all episodes
    assert all(b[:13] == a_ and b[13:15] == [1, 1] for a_, b in zip(first, second, strict=True))
    assert got["generated_tokens"] == 30 and got["prompt_tokens"] == 5 * (13 + 19 + 25)
    assert got["cached_prompt_tokens"] == 5 * (13 + 19)  # each turn reuses the one before
    fresh = speed.multi_turn(Echo(), a, True, count=5, turns=3)
    assert fresh["cached_prompt_tokens"] == 0


def test_a_sigterm_kills_the_process_being_measured_and_saves_what_was_measured(
    tmp_path: Path,
) -> None:
    cmd = [sys.executable, str(SPEED), "--dry-run", "--out-dir", str(tmp_path), "--reps", "1"]
    cmd += ["--batches", "4", "--no-multi-turn", "--columns", "llm_default", "engine"]
    parent = subprocess.Popen(
        cmd, env=os.environ | {"DELTARL_SPEED_DRY_HANG": "engine"}, stdout=subprocess.PIPE
    )
    assert parent.stdout is not None
    assert parent.stdout.readline().startswith(b"round 1 llm_default")  # engine's is starting
    time.sleep(0.5)
    parent.terminate()  # what `timeout` sends
    assert parent.wait(timeout=30) == 1
    data = json.loads((tmp_path / "vllm_speed.json").read_text())
    assert data["stopped"].startswith("interrupted")
    assert data["rounds"][0]["processes"]["llm_default"]["results"]
    hung = (tmp_path / "logs" / "r1-engine.log").read_text()
    pid = json.loads(hung.split("deltarl-vllm-speed-result: ", 1)[1].splitlines()[0])["info"]["pid"]
    status = Path(f"/proc/{pid}/status")  # killed with its process group (gone, or a zombie)
    assert not status.exists() or "\tZ" in status.read_text().split("State:")[1].splitlines()[0]


def test_resume_continues_the_recorded_rounds_and_refuses_other_settings(tmp_path: Path) -> None:
    rc, first, _ = dry_run(tmp_path, "--rounds", "3", "--columns", "engine", "--budget-s", "0")
    assert rc == 0 and len(first["rounds"]) == 1 and first["stopped"].startswith("budget: 1 of 3")
    rc, data, _ = dry_run(tmp_path, "--rounds", "3", "--columns", "engine", "--resume")
    assert rc == 0 and [r["round"] for r in data["rounds"]] == [1, 2, 3]
    assert data["rounds"][0] == first["rounds"][0]  # the recorded round stands as measured
    assert "stopped" not in data and data["started"] == first["started"]
    assert data["summary"]["single b4"]["columns"]["engine"]["n"] == 3
    rc, _, output = dry_run(
        tmp_path, "--rounds", "4", "--columns", "engine", "--reps", "2", "--resume"
    )
    assert rc != 0 and "settings differ from the recorded run's: reps" in output
