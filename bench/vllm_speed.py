"""Tokens/s of the vllm engine next to plain vLLM and transformers, one GPU, one run.

Each column runs in its own process (vLLM does not give all its GPU memory back in-process), on
the same random-initialized model (default: Qwen3-0.6B's shape), prompts of ``--prompt-len``
random token ids, ``--new-tokens`` sampled tokens each (no early stop), temperature 1:

* ``engine``: :class:`VllmEngine` ``.generate`` with its default settings (CUDA graphs, async
  scheduling), gated by a real :class:`WeightSync` that loaded the weights from a bucket anchor:
  every guarantee on (stamps, pause between forward steps, verified weights, processed logprobs);
* ``engine_sync`` (on request): the same with ``async_scheduling=False`` (what async
  scheduling buys);
* ``llm_same``: ``vllm.LLM.generate`` with the engine's own ``LLM`` arguments and per-request
  sampling parameters (``llm_kwargs``, ``request_params``): what our step loop costs;
* ``llm_default``: ``vllm.LLM.generate`` with vLLM's defaults (engine core in its own process,
  no logprobs, raw logprobs mode, prefix caching on): what the engine's settings cost;
* ``hf``: transformers ``generate`` (bf16, SDPA) on the same GPU;
* ``llm_inproc`` (on request): vLLM's defaults but in-process, as the engine runs it.

Usage (a GPU machine with vLLM 0.33.0)::

    python bench/vllm_speed.py --json bench/results/vllm_speed_h100.json

Prints one table (batch x column, tokens/s) and the engine's share of plain vLLM's speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

COLUMNS = ("engine", "llm_same", "llm_default", "hf")  # the table's four
EXTRA = ("engine_sync", "llm_inproc")  # on request: what async scheduling, a process buy
RESULT = "deltarl-vllm-speed-result: "


# Qwen3-0.6B's shape (also bench/rollout_sync_bench.py's 0.6B model)
QWEN3_0_6B: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": True,
}


def qwen3_0_6b(directory: Path) -> str:
    """Qwen3-0.6B's configuration (random weights are made from it)."""
    import transformers

    transformers.Qwen3Config(
        **QWEN3_0_6B,
        max_position_embeddings=4096,
        rope_theta=1000000.0,
        torch_dtype="bfloat16",
        architectures=["Qwen3ForCausalLM"],  # without it vLLM takes Qwen3 for a pooling model
    ).save_pretrained(directory)
    return str(directory)


def prompts_of(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(batch)]


def timed(run: Any, reps: int) -> dict[str, float]:
    """Run once to warm up, then ``reps`` times; tokens/s of each timed run."""
    run()
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        tokens = run()
        rates.append(tokens / (time.perf_counter() - t0))
    return {"tokens_per_s": statistics.median(rates), "runs": rates}


def publish_anchor(model: str, directory: Path) -> None:
    """A bucket whose version 0 is the model's random initial weights (for the engine columns)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from deltarl.services.buckets.local import LocalBucket
    from deltarl.services.weightsync.anchor import encode_anchor
    from deltarl.services.weightsync.digest import state_digest
    from deltarl.services.weightsync.writer import BucketWriter, NewObject

    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        hf = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(model), dtype=torch.bfloat16
        )
    state = {n: p.detach().cpu() for n, p in hf.named_parameters()}
    del hf
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the columns' processes need the memory
    numel = sum(t.numel() for t in state.values())
    BucketWriter(LocalBucket(directory), anchor_every=0).publish(
        0,
        [NewObject("anchor", "safetensors", encode_anchor(state, 0))],
        state_digest=state_digest(state),
        numel=numel,
        full_bytes=2 * numel,
    )


def column(name: str, model: str, batch: int, a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from deltarl.rollout.engines import SamplingParams, VllmEngineSettings
    from deltarl.rollout.engines.vllm_engine import request_params

    vocab = (
        151936
        if a.model is None
        else int(json.loads(Path(model, "config.json").read_text())["vocab_size"])
    )
    prompts = prompts_of(batch, a.prompt_len, vocab, seed=batch)
    params = SamplingParams(max_new_tokens=a.new_tokens, temperature=1.0)
    settings = VllmEngineSettings(
        model=model,
        gpu_memory_utilization=a.gpu_memory_utilization,
        async_scheduling=name != "engine_sync",
    )
    if name in ("engine", "engine_sync"):
        from deltarl.rollout.engines import make_engine
        from deltarl.rollout.weights import WeightSync
        from deltarl.services.buckets.local import LocalBucket
        from deltarl.services.weightsync.reader import BucketReader

        engine = make_engine(settings)
        sync = WeightSync(engine, BucketReader(LocalBucket(a.bucket)))
        sync.sync_to()

        def run() -> int:
            out = sync.generate(prompts, params)
            assert all(c.version_min == 0 for c in out)
            return sum(len(c.token_ids) for c in out)

        result = timed(run, a.reps)
        engine.close()
        return result
    if name == "hf":
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        with torch.device("cuda"):
            hf = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(model), dtype=torch.bfloat16, attn_implementation="sdpa"
            ).eval()
        ids = torch.tensor(prompts, device="cuda")

        def run() -> int:
            with torch.no_grad():
                out = hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=True,
                    top_k=0,
                    max_new_tokens=a.new_tokens,
                    min_new_tokens=a.new_tokens,
                )
            torch.cuda.synchronize()
            return int((out.shape[1] - ids.shape[1]) * out.shape[0])

        return timed(run, a.reps)
    import vllm

    from deltarl.rollout.engines.vllm_engine import llm_kwargs
    from deltarl.rollout.engines.vllm_transfer import register

    register()
    if name == "llm_same":  # in-process, as the engine runs it
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        llm = vllm.LLM(**llm_kwargs(settings))
        sp = [vllm.SamplingParams(**request_params(params, i)) for i in range(batch)]
    else:  # llm_default: vLLM's own defaults (engine core in its own process, ...)
        if name == "llm_inproc":
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        else:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        llm = vllm.LLM(
            model=model,
            load_format="dummy",
            skip_tokenizer_init=True,
            seed=0,
            gpu_memory_utilization=a.gpu_memory_utilization,
        )
        sp = [
            vllm.SamplingParams(
                max_tokens=a.new_tokens, temperature=1.0, ignore_eos=True, detokenize=False
            )
        ] * batch
    inputs = [{"prompt_token_ids": p} for p in prompts]

    def run() -> int:
        out = llm.generate(inputs, sp, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in out)

    return timed(run, a.reps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory or id (default: Qwen3-0.6B's shape, random)")
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--columns", nargs="+", default=list(COLUMNS), choices=COLUMNS + EXTRA)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--one", nargs=2, metavar=("COLUMN", "BATCH"), help=argparse.SUPPRESS)
    ap.add_argument("--bucket", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    model = a.model or qwen3_0_6b(Path(tempfile.mkdtemp(prefix="deltarl-speed-model-")))
    if a.one:  # a child: one column, one batch size, its result on a line of its own
        print(RESULT + json.dumps(column(a.one[0], model, int(a.one[1]), a)), flush=True)
        return 0
    import torch

    bucket = Path(tempfile.mkdtemp(prefix="deltarl-speed-bucket-"))
    if {"engine", "engine_sync"} & set(a.columns):
        publish_anchor(model, bucket)

    results: dict[str, dict[str, Any]] = {}
    for batch in a.batches:
        for name in a.columns:
            cmd = [sys.executable, __file__, "--one", name, str(batch), "--model", model]
            cmd += ["--prompt-len", str(a.prompt_len), "--new-tokens", str(a.new_tokens)]
            cmd += [
                "--reps",
                str(a.reps),
                "--gpu-memory-utilization",
                str(a.gpu_memory_utilization),
                "--bucket",
                str(bucket),
            ]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stdout[-3000:], proc.stderr[-6000:], file=sys.stderr)
                results.setdefault(str(batch), {})[name] = {"error": proc.stderr[-500:]}
                continue
            (line,) = [x for x in proc.stdout.splitlines() if x.startswith(RESULT)]
            got = json.loads(line[len(RESULT) :])
            got["wall_s"] = time.perf_counter() - t0
            results.setdefault(str(batch), {})[name] = got
            print(f"batch {batch:4d} {name:12s} {got['tokens_per_s']:10,.0f} tokens/s", flush=True)
    header = "| batch | " + " | ".join(a.columns) + " | engine / llm_default |"
    lines = [header, "|" + "---|" * (len(a.columns) + 2)]
    for batch, row in results.items():
        cells = [
            f"{row[c]['tokens_per_s']:,.0f}" if "tokens_per_s" in row.get(c, {}) else "error"
            for c in a.columns
        ]
        share = "-"
        if "tokens_per_s" in row.get("engine", {}) and "tokens_per_s" in row.get("llm_default", {}):
            share = f"{row['engine']['tokens_per_s'] / row['llm_default']['tokens_per_s']:.0%}"
        lines.append(f"| {batch} | " + " | ".join(cells) + f" | {share} |")
    table = "\n".join(lines)
    print(table)
    out = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "model": a.model or "Qwen3-0.6B shape (random)",
        "prompt_len": a.prompt_len,
        "new_tokens": a.new_tokens,
        "reps": a.reps,
        "results": results,
        "table": table,
    }
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
