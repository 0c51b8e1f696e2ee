"""Sharded publication of an FSDP2 trainer: what each step's publish costs per rank, and what a
rollout GPU pays to apply it.

Under ``torchrun`` on N GPUs (or N CPU processes with gloo for ``--preset tiny``): a Qwen-shaped
model built from a configuration (random init; fp32 master weights sharded by the trainer's own
``shard_fsdp``, bf16 compute under autocast on CUDA), AdamW at ``--lr`` (1e-6) through the
trainer's ``build_optimizer``, ``--steps`` real steps on random tokens. After every step each
rank publishes its rows with :class:`~deltarl.trainer.publish.sharded.ShardedPublisher` into a
local-directory bucket (version 0 is an anchor, then compact deltas). Rank 0 prints one JSON line
per step::

    {"step": 1, "version": 1, "detect_s": [..per rank..], "encode_s": [...], "upload_s": [...],
     "publish_s": 1.23, "bytes": 123, "changed": 456, "numel": 789, "changed_fraction": 0.5,
     "bits_per_changed": 3.9, "memory_bytes": [...per rank...]}

``detect_s`` = bf16 cast of the rank's rows + delta against its bf16 snapshot; ``publish_s`` =
rank 0's whole publication (every rank's work, the manifest and latest.json), the step's wall
time of publishing; ``memory_bytes`` = what a rank holds for publication (its bf16 snapshot and the
new bf16 rows; no rank holds more than its rows). With ``--apply``, rank 0 then follows the bucket
on its device with :class:`~deltarl.rollout.sync.weights.WeightSync` (a bf16 copy of the whole model,
as a rollout GPU holds it) and prints the last delta's ``paused_apply_s`` and
``fetch_to_applied_s`` (download + decode + stage + paused apply of that delta;
publish-to-applied = ``publish_s`` + this). A ``"summary"`` line closes the run.

With ``--fp8`` (block side 128 or 64), every step is also published as block fp8
(``publish.fp8``) by a second publisher into a second bucket, the two in alternating order, and
each line gets an ``"fp8"`` object with the same fields for that version (its ``numel`` counts
the e4m3 elements, their float32 scales and the tensors kept in bf16): fp8 beside bf16 on the
same steps.

Runs on any machine with N CUDA GPUs (NCCL) and the ``weights`` and ``model`` extras; the 7b
preset needs 4 GPUs of 80 GB, the 14b one 4 of 141 GB. Rank 0 also writes the lines, after a
``{"meta": ...}`` line, to ``bench/results/fsdp_publish_<N>x<gpu>_<preset>.jsonl`` (``--out`` for
another path; the tiny preset writes only with ``--out``), which a rerun overwrites.

Usage::

    # CPU smoke test (2 processes, gloo)
    python -m torch.distributed.run --nproc_per_node 2 bench/fsdp_publish_bench.py --preset tiny --apply
    # 4 GPUs, the 7B configuration
    torchrun --nproc_per_node 4 bench/fsdp_publish_bench.py --preset 7b --steps 8
    # 2 GPUs, the 7B configuration, bf16 and block-fp8 versions of the same steps
    torchrun --nproc_per_node 2 bench/fsdp_publish_bench.py --preset 7b --steps 6 --fp8 128
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from common import gpu_tag, meta, result_path

from deltarl.buckets.local import LocalBucket
from deltarl.trainer.learn.distributed import (
    broadcast,
    init_distributed,
    shard_fsdp,
    shutdown_distributed,
)
from deltarl.trainer.learn.optim import build_optimizer
from deltarl.trainer.publish.sharded import ShardedPublisher, local_rows
from deltarl.trainer.settings import OptimizerSettings, PublishSettings
from deltarl.weightsync.manifest import parse_slice_key
from deltarl.weightsync.reader import BucketReader

_QWEN3 = {"head_dim": 128, "tie_word_embeddings": True, "vocab_size": 151936}
_QWEN25 = {"tie_word_embeddings": False, "vocab_size": 152064}
#: (transformers config class, its fields): Qwen3-0.6B/1.7B, Qwen2.5-7B/14B shapes
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny": (
        "Qwen2Config",
        {
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "tie_word_embeddings": True,
        },
    ),
    "0.6b": (
        "Qwen3Config",
        {
            **_QWEN3,
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
        },
    ),
    "1.7b": (
        "Qwen3Config",
        {
            **_QWEN3,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
        },
    ),
    "7b": (
        "Qwen2Config",
        {
            **_QWEN25,
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
        },
    ),
    "14b": (
        "Qwen2Config",
        {
            **_QWEN25,
            "hidden_size": 5120,
            "intermediate_size": 13824,
            "num_hidden_layers": 48,
            "num_attention_heads": 40,
            "num_key_value_heads": 8,
        },
    ),
}


class TensorEngine:
    """The part of a rollout engine WeightSync uses: named bf16 tensors on one device."""

    def __init__(self, shapes: dict[str, torch.Size], device: torch.device) -> None:
        self.device = device
        self.tensors = {
            n: torch.zeros(s, dtype=torch.bfloat16, device=device) for n, s in shapes.items()
        }

    def named_parameters(self) -> dict[str, torch.Tensor]:
        return self.tensors


def build_model(preset: str, device: str) -> tuple[torch.nn.Module, Any]:
    """The preset's model on the meta device (no memory), its config."""
    import transformers

    cls_name, fields = PRESETS[preset]
    cfg = getattr(transformers, cls_name)(**fields, max_position_embeddings=4096)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    return model, cfg


@torch.no_grad()
def materialize(model: torch.nn.Module, cfg: Any, device: str, seed: int) -> None:
    """Sharded meta parameters -> real ones on ``device``, random init (std 0.02, norms 1);
    rotary frequencies (non-persistent buffers) recomputed."""
    model.to_empty(device=device)
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02)
    for module in model.modules():
        if hasattr(module, "inv_freq"):
            with torch.device(device):
                fresh = type(module)(config=cfg)
            module.inv_freq = fresh.inv_freq
            if hasattr(fresh, "original_inv_freq"):
                module.original_inv_freq = fresh.original_inv_freq


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps (each one published)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank and step")
    ap.add_argument(
        "--bucket", default=None, help="bucket directory, kept (default: a temp dir, removed)"
    )
    ap.add_argument("--codec-threads", type=int, default=None)
    ap.add_argument("--apply", action="store_true", help="rank 0 follows on its device")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument(
        "--fp8",
        type=int,
        choices=(64, 128),
        default=None,
        help="also publish every step as block fp8 with this block side (see the docstring)",
    )
    ap.add_argument("--out", type=Path, default=None, help="default: see the docstring")
    args = ap.parse_args(argv)

    ctx, device = init_distributed(args.device, timeout_s=900)
    if not ctx.enabled:
        raise SystemExit("run under torchrun with --nproc_per_node >= 2 (see the docstring)")
    try:
        run(args, ctx, device)
    except Exception as err:  # one line, then end the job (torchrun stops the other ranks)
        oom = isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()
        what = "OOM" if oom else type(err).__name__
        first = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
        print(
            json.dumps({"preset": args.preset, "rank": ctx.rank, "failed": what, "error": first}),
            flush=True,
        )
        sys.stderr.flush()
        os._exit(3)
    shutdown_distributed(ctx)


def run(args: argparse.Namespace, ctx: Any, device: str) -> None:
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size)))
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local))
    bucket_dir = broadcast(args.bucket or tempfile.mkdtemp(prefix="fsdp-bench-"), ctx)
    bucket = LocalBucket(bucket_dir)
    model, cfg = build_model(args.preset, device)
    shard_fsdp(model, ctx, device)
    materialize(model, cfg, device, seed=0)
    opt, sched = build_optimizer(
        model.parameters(), OptimizerSettings(lr=args.lr, warmup_steps=0), args.steps + 1
    )
    rank_reports: list[dict[str, Any]] = []
    settings = PublishSettings(
        anchor_every=0, chained_deltas=False, codec_threads=args.codec_threads
    )
    pub = ShardedPublisher(bucket, settings, ctx, on_rank_report=rank_reports.append)
    fp8_reports: list[dict[str, Any]] = []
    pub8 = None
    if args.fp8:
        pub8 = ShardedPublisher(
            LocalBucket(f"{bucket_dir}-fp8"),
            settings.model_copy(update={"fp8": True, "fp8_block": args.fp8}),
            ctx,
            on_rank_report=fp8_reports.append,
        )
    cuda = device.startswith("cuda")

    def publish(pub: ShardedPublisher, model: torch.nn.Module, step: int, anchor: bool) -> float:
        t0 = time.perf_counter()
        if ctx.is_main:
            pub.publish(local_rows(model, ctx), step, step=step, anchor=anchor)
        else:
            kind, (version, s, with_anchor) = broadcast(None, ctx)
            assert kind == "publish"
            pub.publish_local(local_rows(model, ctx), version, s, with_anchor)
        return time.perf_counter() - t0

    publish(pub, model, 0, anchor=True)
    if pub8 is not None:
        publish(pub8, model, 0, anchor=True)
    gen = torch.Generator().manual_seed(1000 + ctx.rank)
    lines: list[dict[str, Any]] = []
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen)
        tokens = tokens.to(device)
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        step_s = time.perf_counter() - t0
        # bf16 and fp8 in alternating order: neither always pays a cold cache
        pubs = [pub] if pub8 is None else [pub, pub8]
        times = {id(p): publish(p, model, step, False) for p in pubs[:: 1 if step % 2 else -1]}
        every = gather(rank_reports[-1], pub, cuda, ctx)
        line = {"step": step, "version": step, "preset": args.preset, "ranks": ctx.world_size}
        line |= {"train_step_s": step_s, "loss": float(loss.detach())}
        line |= version_line(every, times[id(pub)])
        if pub8 is not None:
            line["fp8"] = version_line(gather(fp8_reports[-1], pub8, cuda, ctx), times[id(pub8)])
        if ctx.is_main:
            lines.append(line)
            print(json.dumps(line), flush=True)

    shapes = {n: t.shape for n, t in model.state_dict().items()}  # global shapes
    pub.close()
    if pub8 is not None:
        pub8.close()
    del model, opt, sched, pub, pub8  # the follower needs the GPU memory
    if cuda:
        torch.cuda.empty_cache()
    summary: dict[str, Any] = {"summary": True, "preset": args.preset, "ranks": ctx.world_size}
    if ctx.is_main and lines:
        summary |= medians(lines) | {"bucket": args.bucket}
        if args.fp8:
            summary["fp8"] = medians([x["fp8"] for x in lines]) | {"block": args.fp8}
    if ctx.is_main and args.apply:
        layout = BucketReader(bucket).manifest(args.steps).layout or ()
        names = {parse_slice_key(k)[0] for k in layout}
        summary.update(follow(bucket, {n: shapes[n] for n in names}, device, args.steps))
        if lines:
            last = lines[-1]["publish_s"]
            summary["publish_to_applied_s"] = last + summary["fetch_to_applied_s"]
    if ctx.is_main:
        print(json.dumps(summary), flush=True)
        write_result(args, ctx.world_size, cuda, [*lines, summary])
        if args.bucket is None:  # temp buckets: anchors of the whole model, remove them
            shutil.rmtree(bucket_dir, ignore_errors=True)
            shutil.rmtree(f"{bucket_dir}-fp8", ignore_errors=True)


def gather(report: dict[str, Any], pub: ShardedPublisher, cuda: bool, ctx: Any) -> list[Any]:
    """Every rank's report of the version ``pub`` just published (a collective)."""
    mine = {
        **report,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
        "codec_threads": pub.threads,
    }
    every: list[Any] = [None] * ctx.world_size
    tdist.all_gather_object(every, mine)
    return every


def version_line(every: list[dict[str, Any]], publish_s: float) -> dict[str, Any]:
    """One version's numbers from the ranks' reports (rank 0's wall time of the publication)."""
    changed = sum(r["changed"] for r in every)
    numel = sum(r["numel"] for r in every)
    size = sum(r["delta_bytes"] or 0 for r in every)
    return {
        "detect_s": [r["cast_s"] + r["diff_s"] for r in every],
        "encode_s": [r["encode_s"] for r in every],
        "upload_s": [r["upload_s"] for r in every],
        # detect = loop (the device queue, one tensor at a time) + wait (what still ran
        # after it: scans landing, digests, the encoder's first phase in the pool)
        "loop_s": [r.get("loop_s") for r in every],
        "wait_s": [r.get("wait_s") for r in every],
        "publish_s": publish_s,
        "bytes": size,
        "changed": changed,
        "numel": numel,
        "changed_fraction": changed / max(numel, 1),
        "bits_per_changed": 8 * size / max(changed, 1),
        "memory_bytes": [r["memory_bytes"] for r in every],
        "host_memory_bytes": [r["host_memory_bytes"] for r in every],
        "peak_gpu_bytes": [r["peak_gpu_bytes"] for r in every],
        "codec_threads": [r["codec_threads"] for r in every],
    }


def medians(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's summary of one format's version lines."""
    return {
        "publish_s_median": statistics.median(x["publish_s"] for x in lines),
        # step 1 pays one-off costs (numba compiles, first allocations)
        "publish_s_median_after_first": statistics.median(
            x["publish_s"] for x in (lines[1:] or lines)
        ),
        "publish_s_max": max(x["publish_s"] for x in lines),
        "detect_s_max": max(max(x["detect_s"]) for x in lines),
        "encode_s_max": max(max(x["encode_s"]) for x in lines),
        "upload_s_max": max(max(x["upload_s"]) for x in lines),
        "bits_per_changed_median": statistics.median(x["bits_per_changed"] for x in lines),
        "changed_fraction_median": statistics.median(x["changed_fraction"] for x in lines),
        "memory_bytes_max_rank": max(max(x["memory_bytes"]) for x in lines),
        "host_memory_bytes_max_rank": max(max(x["host_memory_bytes"]) for x in lines),
        "peak_gpu_bytes_max_rank": max(max(x["peak_gpu_bytes"]) for x in lines),
    }


def write_result(args: argparse.Namespace, ranks: int, cuda: bool, lines: list[Any]) -> None:
    """The run's lines after a meta line, to ``--out`` or (on GPUs) the default result path."""
    out = args.out
    if out is None and cuda and args.preset != "tiny":
        what = args.preset if args.fp8 is None else f"{args.preset}-fp8-block{args.fp8}"
        out = result_path("fsdp_publish", gpu_tag(ranks), what, "jsonl")
    if out is None:
        return
    gpus = ranks if cuda else 0
    head = {"meta": meta(gpus=gpus, launcher=f"torchrun --nproc_per_node {ranks}")}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(x) + "\n" for x in [head, *lines]))


def follow(
    bucket: LocalBucket, shapes: dict[str, torch.Size], device: str, last: int
) -> dict[str, Any]:
    """Rank 0 as a rollout GPU: load up to ``last - 1``, then time the last delta."""
    from deltarl.rollout.sync.weights import WeightSync

    engine = TensorEngine(shapes, torch.device(device))
    sync = WeightSync(engine, BucketReader(bucket))  # type: ignore[arg-type]
    sync.sync_to(last - 1)
    timing = sync.sync_to(last).steps[-1]
    return {
        "apply_version": timing.version,
        "apply_kind": timing.kind,
        "paused_apply_s": timing.pause_s,
        "fetch_to_applied_s": timing.download_s + timing.decode_s + timing.stage_s + timing.pause_s,
        "download_s": timing.download_s,
        "decode_s": timing.decode_s,
        "stage_s": timing.stage_s,
        "verify_s": timing.verify_s,
        "apply_path": timing.apply,
    }


if __name__ == "__main__":
    sys.exit(main())
