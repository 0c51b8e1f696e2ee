"""The trainer's peak GPU memory and step time for one GRPO step of Wordle-shaped episodes,
by micro-batch setting: why a micro-batch of the whole step ran out of memory beside vLLM.

    python bench/trainer_memory_bench.py --configs 64 16 8 64:8192 64:4096

The model is a random Llama shaped like SmolLM2-135M (bench/teacher_engine_bench.py: 30 layers,
hidden 576, vocabulary 49,152), fp32 master weights, bf16 autocast, AdamW, as ``deltarl train``
runs it. The step is ``groups x group_size`` episodes on the wire schema, collated by the
trainer: each of 250-520 tokens (a 6-guess Wordle game is ~460), the model's moves 8 tokens
after each 70 tokens of prompt or feedback (~10% of the tokens; ~6% in real 6-guess games),
rewards at random. Each config is
``SIZE`` (``batch.micro_batch_size``) or ``SIZE:TOKENS`` (plus ``batch.micro_batch_tokens``);
per config: two steps (the first warms up), then the peak memory allocated by torch during
the second step (``torch.cuda.max_memory_allocated``; on a CPU: not measured) and its seconds.
``--tiny``: a 2-layer model and short episodes, to check the script on a CPU.

Runs on any machine with a CUDA GPU and the ``weights`` and ``model`` extras. The rows go to
``bench/results/trainer_memory_<gpu>_smollm2-135m.json`` (``--json`` for another path; ``--tiny``
and CPU runs write only with ``--json``), which a rerun on the same GPU overwrites.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import torch
from common import gpu_tag, meta, result_path, write_json

from deltarl.services.coordinator.schemas import Trajectory, TrajectoryGroup
from deltarl.trainer.learn.batch import collate
from deltarl.trainer.learn.optim import build_optimizer
from deltarl.trainer.learn.step import train_step
from deltarl.trainer.settings import ExperimentSettings


def episode(gen: torch.Generator, vocab: int, length: int, move: int, feedback: int) -> Trajectory:
    """One episode: a prompt, then (move, feedback) turns until ``length`` tokens."""
    tokens = torch.randint(0, vocab, (length,), generator=gen).tolist()
    mask = [0] * length
    pos = 120  # system prompt and rules
    while pos + move <= length:
        mask[pos : pos + move] = [1] * move
        pos += move + feedback
    logprobs = [-1.0 if m else 0.0 for m in mask]
    return Trajectory(
        tokens=tokens,
        logprobs=logprobs,
        mask=mask,
        prompt_len=120,
        reward=float(torch.rand((), generator=gen)),
        version_min=0,
        version_max=0,
    )


def step_groups(a: argparse.Namespace, vocab: int) -> list[TrajectoryGroup]:
    gen = torch.Generator().manual_seed(0)
    lo, hi = (130, 200) if a.tiny else (250, 520)
    return [
        TrajectoryGroup(
            idempotency_key=f"g{g}",
            worker_id="bench",
            group_id=f"g{g}",
            trajectories=[
                episode(gen, vocab, int(torch.randint(lo, hi, (1,), generator=gen)), 8, 70)
                for _ in range(a.group_size)
            ],
        )
        for g in range(a.groups)
    ]


def smollm2_model(device: str, tiny: bool) -> torch.nn.Module:
    """bench/teacher_engine_bench.py's SmolLM2-shaped Llama (``tiny``: 2 layers of 72), fp32
    (master weights), train mode."""
    spec = importlib.util.spec_from_file_location(
        "teacher_engine_bench", Path(__file__).with_name("teacher_engine_bench.py")
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    shape = {"hidden_size": 72, "intermediate_size": 128, "num_hidden_layers": 2} if tiny else {}
    return bench.smollm2_shaped(torch.float32, device, 1.0, **shape).train()


def measure(a: argparse.Namespace, config: str) -> dict[str, Any]:
    size, _, tokens = config.partition(":")
    batch_settings: dict[str, Any] = {"micro_batch_size": int(size)}
    if tokens:
        batch_settings["micro_batch_tokens"] = int(tokens)
    settings = ExperimentSettings.model_validate(
        {
            "precision": "bf16" if a.device.startswith("cuda") else "fp32",
            "batch": batch_settings,
            # the episodes' logprobs are made up: no check against the trainer's
            "sampling": {"max_onpolicy_mismatch_kl": None},
        }
    )
    model = smollm2_model(a.device, a.tiny)
    opt, sched = build_optimizer(model.parameters(), settings.optimizer, max_steps=10)
    vocab = model.config.vocab_size
    batch = collate(step_groups(a, vocab), policy_version=0)
    cuda = a.device.startswith("cuda")
    out: dict[str, Any] = {
        "config": config,
        "sequences": len(batch),
        "tokens": int(batch.attention_mask.sum()),
        "trained_tokens": batch.num_tokens,
        "longest": int(batch.attention_mask.sum(-1).max()),
    }
    for i in range(2):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        train_step(model, opt, sched, batch, settings, entropy=True)
        if cuda:
            torch.cuda.synchronize()
        if i == 1:
            out["step_s"] = round(time.perf_counter() - t0, 3)
            if cuda:
                out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del model, opt, sched
    if cuda:
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--configs", nargs="+", default=["64", "16", "8", "64:8192", "64:4096"])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="default: see the docstring")
    a = ap.parse_args()
    rows = []
    for config in a.configs:
        row = measure(a, config)
        print(json.dumps(row), flush=True)
        rows.append(row)
    cuda = a.device.startswith("cuda")
    if a.json is None and cuda and not a.tiny:
        a.json = result_path("trainer_memory", gpu_tag(1), "smollm2-135m")
    if a.json:
        write_json(a.json, {"meta": meta(gpus=int(cuda)), "device": a.device, "rows": rows})


if __name__ == "__main__":
    main()
