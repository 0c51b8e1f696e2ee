"""bench/moe_scale.py and bench/moe_sparsity.py run at a tiny size on CPU and report what they
claim (the GPU runs use the same code at Qwen3-30B-A3B's shapes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run(script: str, *args: str, timeout: int = 600) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(BENCH / script), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.mark.slow
def test_moe_scale_publishes_a_sparse_expert_update_and_applies_it(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    # the worker decodes the ranks' parts in its decoding child
    run("moe_scale.py", "--tiny", "--steps", "2", "--decode-process", "--json", str(out))
    result = json.loads(out.read_text())
    assert result["settings"]["decode_process"] is True
    steps = result["publish"]["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert len(s["detect_s"]) == len(s["encode_s"]) == 2  # both ranks published
        assert 0.005 < s["changed_fraction"] < 0.02  # --density 0.01
        assert s["bits_per_changed"] == pytest.approx(8 * s["bytes"] / s["changed"])
    applied = result["apply"]
    assert applied["verified_version"] == 2
    assert [a["kind"] for a in applied["applies"]] == ["delta", "delta"]
    for a in applied["applies"]:
        assert 0 < a["paused_apply_s"] <= a["fetch_to_applied_s"] < a["publish_to_applied_s"]
    assert result["summary"]["changed_fraction_median"] > 0
    assert result["meta"]["date"] and result["meta"]["command"] and result["meta"]["machine"]


@pytest.mark.slow
def test_moe_sparsity_measures_per_expert_changes_against_routed_tokens(tmp_path: Path) -> None:
    out = tmp_path / "sparsity.json"
    run(
        "moe_sparsity.py",
        *("--steps", "2", "--layers", "1", "--hidden", "32", "--heads", "2"),
        *("--experts", "8", "--top-k", "2", "--moe-inter", "16", "--batch", "1"),
        *("--seq-len", "16", "--lr", "1e-4", "--max-text-chars", "20000"),
        *("--json", str(out)),
    )
    result = json.loads(out.read_text())
    assert [(r["model"], r["lr"]) for r in result["runs"]] == [("moe", 1e-4), ("dense", 1e-4)]
    moe, dense = result["runs"]
    for step in moe["steps"]:
        assert len(step["per_expert"]) == 1 and len(step["per_expert"][0]) == 8
        # 16 tokens, top-2: 32 expert slots a step
        assert sum(e[1] for e in step["per_expert"][0]) == 32
        assert 0 < step["changed_fraction"] < 1
    assert moe["active_parameters_per_token"] == dense["active_parameters_per_token"] + sum(
        v for k, v in moe["parameters_by_group"].items() if k == "router"
    )
    assert "experts" in moe["summary"] and "experts" not in dense["summary"]


@pytest.mark.slow
def test_moe_scale_in_fp8_applies_verified_e4m3_deltas(tmp_path: Path) -> None:
    out = tmp_path / "scale-fp8.json"
    run("moe_scale.py", "--tiny", "--steps", "2", "--fp8", "--json", str(out))
    result = json.loads(out.read_text())
    assert result["settings"]["fp8"] is True
    steps = result["publish"]["steps"]
    # 1-ULP bf16 moves at 1%: only those crossing an e4m3 rounding boundary change a byte (the
    # embeddings, half of this tiny model, stay bf16 and change at 1%)
    assert all(0 < s["changed_fraction"] < 0.008 for s in steps)
    assert result["apply"]["verified_version"] == 2
