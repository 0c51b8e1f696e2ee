"""bench/fsdp_publish_bench.py runs (tiny preset, 2 gloo ranks) and reports what it claims,
bf16 and (``--fp8 64``) block-fp8 versions of the same steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import free_port

BENCH = Path(__file__).resolve().parents[2] / "bench" / "fsdp_publish_bench.py"


@pytest.mark.slow
def test_tiny_preset_publishes_and_applies(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(BENCH),
        *("--preset", "tiny", "--steps", "2", "--apply", "--device", "cpu"),
        *("--bucket", str(tmp_path / "bucket"), "--fp8", "64"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    steps, summary = lines[:-1], lines[-1]
    assert [s["step"] for s in steps] == [1, 2] and summary["summary"]
    for s in steps:
        assert len(s["detect_s"]) == len(s["encode_s"]) == len(s["memory_bytes"]) == 2
        assert 0 < s["changed"] < s["numel"] and s["bytes"] > 0
        assert s["bits_per_changed"] == pytest.approx(8 * s["bytes"] / s["changed"])
        # each rank holds its rows twice in bf16 (snapshot + new), never the whole state
        assert all(m == 2 * 2 * s["numel"] / 2 for m in s["memory_bytes"])
        fp8 = s["fp8"]  # the same step in fp8: e4m3 bytes and scales, its own delta
        assert 0 < fp8["changed"] < fp8["numel"] and fp8["bytes"] > 0
        assert fp8["numel"] > s["numel"]  # the scales are elements of the version too
        assert all(m8 < m for m8, m in zip(fp8["memory_bytes"], s["memory_bytes"], strict=True))
    assert summary["fp8"]["block"] == 64 and summary["fp8"]["bits_per_changed_median"] > 0
    assert summary["apply_version"] == 2 and summary["apply_kind"] == "delta"
    assert 0 < summary["paused_apply_s"] <= summary["fetch_to_applied_s"]
    manifests = sorted((tmp_path / "bucket" / "manifests").iterdir())
    assert len(manifests) == 3  # the anchor and two deltas
    assert len(list((tmp_path / "bucket-fp8" / "manifests").iterdir())) == 3
