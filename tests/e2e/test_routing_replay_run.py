"""Routing replay through the whole system on CPU: ``deltarl run examples/charset-tiny.toml`` with
a mixture of experts (the tiny byte-level Llama upcycled into a Qwen2-MoE, 4 experts, top-2) and
``run.routing_replay = true``: the workers' transformers engines record each token's experts, the
coordinator checks the records against the trainer's model, and every trajectory the trainer
trains on carries one (its metrics count them), with the run ending as a normal run does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltarl.services.common.models import TINY_SEED, prepare_model, upcycle

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


def tiny_moe(cache: Path, out: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dense_dir = prepare_model("tiny-bytes", cache)
    dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    moe = upcycle(dense, experts=4, top_k=2, noise=0.05, seed=TINY_SEED).float()
    moe.save_pretrained(out)
    AutoTokenizer.from_pretrained(dense_dir).save_pretrained(out)
    return out


def test_a_moe_run_trains_on_replayed_routes(tmp_path: Path, model_cache: Path) -> None:
    model = tiny_moe(model_cache, tmp_path / "tiny-moe")
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTARL_")}
    overrides = [
        f'run.model="{model}"',
        "run.routing_replay=true",
        f"trainer.max_steps={STEPS}",
        "trainer.optimizer.lr=1e-3",
    ]
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "deltarl", "run"),
            str(ROOT / "examples" / "charset-tiny.toml"),
            *(x for o in overrides for x in ("--set", o)),
            *("--run-dir", str(run_dir), "--cache-dir", str(model_cache)),
            *("--no-live", "--timeout", "300"),
        ],
        capture_output=True,
        text=True,
        timeout=360,
        env=env,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    steps = [
        json.loads(line)
        for line in (run_dir / "trainer" / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    trained = [s for s in steps if "batch/trajectories" in s]
    assert len(trained) == STEPS, steps[-1]
    for s in trained:
        # every trajectory carried its routes, and none was refused for them
        assert s["batch/routed_trajectories"] == s["batch/trajectories"], s
        assert s["routing/replayed_trajectories"] == s["batch/trajectories"], s
        assert s.get("batch/rejected/bad_routing", 0.0) == 0.0, s
