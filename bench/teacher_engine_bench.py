"""The teacher's transformers engine alone (no HTTP): scored positions per second of one batch,
and how far a padded batch is from each sequence scored alone.

    python bench/teacher_engine_bench.py [--device cuda] [--dtype bfloat16] [--batch 64]
        [--prompt 128] [--positions 512] [--k 20] [--model DIR] [--repeats 5]

Without ``--model``: a random Llama shaped like SmolLM2-135M (30 layers, hidden 576, 9 heads,
3 KV heads, vocabulary 49,152), so no download is needed. Sequences have ``prompt`` tokens of
prompt and ``positions`` scored tokens, lengths jittered by up to 25% so that padding is real.
Batch timing: ``TransformersTeacher.score`` on all sequences at once (one forward, the engine's
post-processing, copies to the host), median of ``repeats`` after one warm-up. Equality: the
first 8 sequences scored alone vs in the batch, max |difference| of the sampled-token logprobs,
and the same against the scores shifted by one position (what a position bug would give).

Runs on any machine with the ``model`` extra, on its GPU when it has one. The result goes to
``bench/results/teacher_engine_<hardware>_<model>-<dtype>.json`` (``--json`` for another path),
which a rerun overwrites.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import cpu_tag, gpu_tag, meta, result_path, write_json

from deltarl.teacher.engines.base import ScoreJob
from deltarl.teacher.engines.transformers_engine import TransformersTeacher


def smollm2_shaped(
    dtype: torch.dtype, device: str, scale: float = 20.0, **shape: int
) -> torch.nn.Module:
    """A random Llama shaped like SmolLM2-135M (``shape`` overrides its config's sizes)."""
    import transformers

    sizes = {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
    }
    config = transformers.LlamaConfig(
        vocab_size=49_152,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
        **(sizes | shape),
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # peaked distributions, like a trained model's
        model.model.embed_tokens.weight.mul_(scale)
    return model.to(device=device, dtype=dtype).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--positions", type=int, default=512)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None, help="default: see the docstring")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.model:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device)
    else:
        model = smollm2_shaped(dtype, args.device)
    engine = TransformersTeacher(model, model_name=args.model or "smollm2-shaped-random")
    rng = np.random.default_rng(0)
    jobs = []
    for _ in range(args.batch):
        prompt = int(args.prompt * rng.uniform(0.75, 1.0))
        scored = int(args.positions * rng.uniform(0.75, 1.0))
        tokens = rng.integers(0, engine.vocab_size, prompt + scored).astype(np.int32)
        jobs.append(ScoreJob(tokens, prompt, 1.0, args.k))
    scored = sum(j.scored for j in jobs)
    tokens = sum(len(j.tokens) for j in jobs)
    padded = len(jobs) * max(len(j.tokens) for j in jobs)
    engine.score(jobs)  # warm-up
    times = []
    for _ in range(args.repeats):
        sync(args.device)
        t = time.perf_counter()
        batched = engine.score(jobs)
        sync(args.device)
        times.append(time.perf_counter() - t)
    seconds = statistics.median(times)
    diffs, shifted = [], []
    for job, got in zip(jobs[:8], batched[:8], strict=True):
        [alone] = engine.score([job])
        diffs.append(float(np.abs(alone.sampled - got.sampled).max()))
        shifted.append(float(np.abs(alone.sampled[1:] - got.sampled[:-1]).max()))
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(args.device)
        if args.device.startswith("cuda")
        else "cpu",
        "torch": torch.__version__,
        "dtype": args.dtype,
        "model": engine.model_name,
        "batch": len(jobs),
        "tokens": tokens,
        "padded_tokens": padded,
        "scored_positions": scored,
        "k": args.k,
        "batch_seconds_median": seconds,
        "batch_seconds_all": times,
        "scored_positions_per_s": scored / seconds,
        "max_abs_diff_batched_vs_alone": max(diffs),
        "max_abs_diff_if_shifted_by_one": min(shifted),
    }
    if args.device.startswith("cuda"):
        result["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(result, indent=1))
    cuda = args.device.startswith("cuda")
    model = Path(args.model).name.lower() if args.model else "smollm2-shape"
    hardware = gpu_tag(1) if cuda else cpu_tag()
    out = args.json or result_path("teacher_engine", hardware, f"{model}-{args.dtype}")
    write_json(out, {"meta": meta(gpus=int(cuda)), **result})


if __name__ == "__main__":
    main()
