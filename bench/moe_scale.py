"""Qwen3-30B-A3B-shaped weight sync: what publishing a sparse expert update costs per step, and
what a vLLM engine serving the same shapes pays to apply it.

The layer shapes of Qwen3-30B-A3B (hidden 2048, 32 query / 4 KV heads of 128, 128 experts, top-8,
``moe_intermediate_size`` 768, vocabulary 151,936; 48 layers, ``--layers`` for fewer), random
init in bf16. There is no optimizer: the weights a trainer would publish are the bf16 state
itself, and every step moves a realistic sparse part of it (``--density`` of every tensor,
1% by default as measured on Qwen3-30B-A3B; within a layer's experts the rate follows a skewed
load, lognormal with ``--expert-skew``, mean ``--density``; each move 1 ULP, sometimes 2, as
AdamW's small steps are). The state is split by rows over ``--ranks`` processes (FSDP2's
``Shard(0)`` split: whole experts per rank), each publishing its rows with the trainer's own
:class:`~deltarl.trainer.publish.sharded.ShardedPublisher` (change detection and the encoder's context
scan where the rows are, compact encode on the host, upload to a local-directory bucket; version
0 an anchor); ranks take the GPUs round-robin (several ranks may share one GPU; their collectives
run over gloo, so that works), or the CPU with ``--device cpu``.

Then the main process follows the bucket as a rollout worker (:class:`~deltarl.rollout.sync.weights.
WeightSync`) with ``--engine``: ``vllm`` (vLLM 0.33 serving the same config with random
``dummy`` weights, replaced by the anchor; deltas mapped onto its stacked expert tensors and
applied in one pause, while it generates), ``tensors`` (plain bf16 tensors on the device, the
apply path without an engine) or ``transformers``. Per delta: paused apply, fetch-to-applied
(download + decode + stage + wait + pause) and publish-to-applied (that version's publish +
fetch-to-applied, the trainer and the worker on one machine through a local bucket). The
following process sets Python's thread switch interval as a rollout worker does (0.2 ms,
``--switch-interval-ms``): with Python's 5 ms the decoder's threads wait for the GIL behind the
engine's generating thread at every hand-off.

Output: one JSON with the settings, machine, date and command, a line per published step (publish seconds, detect / encode / upload per rank, bytes, changed fraction, bits per
changed element), a line per applied delta, a summary and, with fewer than 48 layers, the
per-step numbers scaled to 48 layers (publish work and bytes grow with the elements; stated as
an extrapolation, not a measurement). It goes to
``bench/results/moe_scale_<hardware>_qwen3-30b-a3b-<L>layers[-fp8].json`` (``L`` layers; ``--json``
for another path; ``--tiny`` writes only with ``--json``), which a rerun overwrites.

``--positions``: how the compact deltas code their changed positions (``publish.positions``;
``auto`` codes them as gaps from 16 G elements on, i.e. at all 48 layers); ``alternate`` codes
odd versions as gaps and even ones by context rank, and the summary's ``by_positions`` gives each
way's medians, measured interleaved on one machine.

``--fp8``: the ranks publish every version in block fp8 (``publish.fp8``, 128 x 128 blocks,
every rank quantizing its rows) and the engine serves it (vLLM with the engine's ``fp8_block``:
its fused experts in fp8; or tensors in the fp8 layout). The steps still move bf16 values by
1-2 ULPs, of which the e4m3 bytes see only those that cross a rounding boundary: the changed
fraction counts changed e4m3 bytes in the quantized tensors (far fewer than ``--density``) and
changed values in those that stay bf16 (embeddings, LM head, norms, routers: ``--density``).

Runs on any machine with CUDA GPUs, the ``weights`` and ``model`` extras and, for ``--engine
vllm``, vLLM 0.33.0.

Usage::

    python bench/moe_scale.py --tiny --json /tmp/moe_scale_tiny.json          # CPU, ~1 min
    python bench/moe_scale.py --layers 8 --ranks 2 --steps 4 --engine vllm    # one GPU
    python bench/moe_scale.py --layers 48 --ranks 4 --steps 4 --engine tensors  # 4 GPUs
    python bench/moe_scale.py --layers 8 --ranks 2 --steps 4 --engine vllm --fp8  # fp8, one GPU
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import cpu_tag, gpu_tag, meta, result_path

FULL_LAYERS = 48
QWEN3_30B_A3B = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
}
TINY = {
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
}


def model_config(args: argparse.Namespace) -> Any:
    import transformers

    fields = TINY if args.tiny else QWEN3_30B_A3B
    return transformers.Qwen3MoeConfig(
        **fields,
        num_hidden_layers=args.layers,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        architectures=["Qwen3MoeForCausalLM"],
    )


def tensor_specs(cfg: Any) -> dict[str, tuple[int, ...]]:
    """What the trainer publishes for ``cfg`` (names and shapes; all bf16 for Qwen3-MoE)."""
    import transformers

    from deltarl.weightsync.model_state import fp32_names, publishable_state

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    state = publishable_state(model)
    assert not fp32_names(model, torch.bfloat16), "Qwen3-MoE publishes every tensor in bf16"
    return {n: tuple(t.shape) for n, t in state.items()}


def rows_of(n: int, rank: int, ranks: int) -> tuple[int, int]:
    """FSDP2's ``Shard(0)`` split (``torch.chunk``): ``ceil(n / ranks)`` rows per rank."""
    per = -(-n // ranks)
    return min(n, rank * per), min(n, (rank + 1) * per)


def expert_rates(gen: torch.Generator, experts: int, density: float, skew: float) -> torch.Tensor:
    """Per expert of one layer, the share of its elements that move this step: a lognormal load
    (``skew`` its sigma) scaled to mean ``density``."""
    load = torch.exp(torch.randn(experts, generator=gen) * skew)
    return (density * load / load.mean()).clamp(max=1.0)


@torch.no_grad()
def sparse_step(
    rows: dict[str, torch.Tensor], gen: torch.Generator, args: argparse.Namespace, step: int
) -> int:
    """Move a sparse part of this rank's rows in place (see the module docstring); returns the
    elements moved. The expert loads of a layer are drawn from a generator every rank seeds
    alike, so all ranks agree on them."""
    from deltarl.weightsync.manifest import parse_slice_key

    moved = 0
    for key, t in rows.items():
        name, lo, _ = parse_slice_key(key)
        bits = t.view(torch.int16)
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            layer = int(name.split(".")[2])
            shared = torch.Generator().manual_seed(args.seed * 7919 + step * 131 + layer)
            rates = expert_rates(shared, args.experts_total, args.density, args.expert_skew)
            rate = rates[lo : lo + t.shape[0]].to(t.device)
            block = max(1, (1 << 24) // max(1, t[0].numel()))  # ~16 M elements at a time
            for a in range(0, t.shape[0], block):
                part = bits[a : a + block]
                r = rate[a : a + block].view(-1, *([1] * (t.dim() - 1)))
                moved += _move(part, r, gen)
        else:
            moved += _move(bits, torch.tensor(args.density, device=t.device), gen)
    return moved


def _move(bits: torch.Tensor, rate: torch.Tensor, gen: torch.Generator) -> int:
    u = torch.rand(bits.shape, generator=gen, device=bits.device)
    mask = u < rate
    # +-1 ULP, +-2 for a tenth of them (the same uniform draw decides, no second one), on the
    # magnitude with the sign kept: a value never crosses zero into a NaN pattern (0x0000 - 1)
    # or grows past the largest finite one, as no step of a finite weight does (block fp8
    # refuses non-finite weights)
    step = torch.where(u < rate * 0.05, 2, 1) * torch.where(u < rate * 0.5, 1, -1)
    mag = (bits & 0x7FFF).to(torch.int32)
    new = (mag + torch.where(mask, step, 0)).clamp_(0, 0x7F7F)
    moved = int((new != mag).sum())
    bits.copy_((bits & -0x8000) | new.to(torch.int16))
    return moved


def host_memory_gb() -> dict[str, float]:
    """The host's memory as /proc/meminfo has it after a step's publish (GB): what is free,
    the page cache, and what the bucket's files have not yet written back (a local-directory
    bucket on the publishing machine)."""
    keys = {"MemAvailable", "Cached", "Dirty", "Writeback"}
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in keys:
                out[name] = round(int(rest.split()[0]) / 1e6, 2)
    except OSError:
        pass
    return out


def positions_of(args: argparse.Namespace, step: int) -> str:
    """``publish.positions`` of ``step``: ``--positions``, or with ``alternate`` gaps for odd
    steps and contexts for even ones (both ways measured interleaved in one run)."""
    if args.positions == "alternate":
        return "gaps" if step % 2 else "contexts"
    return str(args.positions)


def rank_main(rank: int, root: str, args: argparse.Namespace) -> None:
    """One publishing rank: its rows, an anchor, then ``steps`` sparse steps each published."""
    import torch.distributed as tdist

    from deltarl.buckets.local import LocalBucket
    from deltarl.trainer.learn.distributed import DistContext, broadcast
    from deltarl.trainer.publish.sharded import ShardedPublisher
    from deltarl.trainer.settings import PublishSettings
    from deltarl.weightsync.codec.formats import resolve_positions
    from deltarl.weightsync.manifest import slice_key

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank)})
    os.environ.update({"WORLD_SIZE": str(args.ranks), "LOCAL_WORLD_SIZE": str(args.ranks)})
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // args.ranks))
    ctx = DistContext(rank=rank, world_size=args.ranks, local_rank=rank)
    tdist.init_process_group(
        "gloo",
        init_method=f"file://{root}/rendezvous",
        rank=rank,
        world_size=args.ranks,
        timeout=dt.timedelta(seconds=1800),
    )
    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    specs = tensor_specs(model_config(args))
    gen = torch.Generator(device=device).manual_seed(args.seed * 1000 + rank)
    rows: dict[str, torch.Tensor] = {}
    for name, shape in specs.items():
        lo, hi = rows_of(shape[0], rank, args.ranks)
        if hi > lo:
            t = torch.empty((hi - lo, *shape[1:]), dtype=torch.bfloat16, device=device)
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            else:
                t.normal_(0.0, 0.02, generator=gen)
            rows[slice_key(name, lo, hi)] = t
    reports: list[dict[str, Any]] = []
    settings = PublishSettings(
        anchor_every=0, chained_deltas=False, fp8=args.fp8, positions=positions_of(args, 1)
    )
    pub = ShardedPublisher(LocalBucket(args.bucket), settings, ctx, on_rank_report=reports.append)

    def publish(step: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        faults[0] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        if ctx.is_main:
            pub.publish(rows, step, step=step, anchor=step == 0)
        else:
            kind, (version, s, anchor) = broadcast(None, ctx)
            assert kind == "publish"
            pub.publish_local(rows, version, s, anchor)
        return time.perf_counter() - t0

    lines = []
    faults = [0]
    anchor_s = publish(0)
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        moved = sparse_step(rows, gen, args, step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        update_s = time.perf_counter() - t0
        pub.settings = settings.model_copy(update={"positions": positions_of(args, step)})
        publish_s = publish(step)
        mine = {**reports[-1], "moved": moved, "update_s": update_s}
        mine["minor_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults[0]
        mine["peak_gpu_bytes"] = (
            torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        )
        every: list[Any] = [None] * args.ranks
        tdist.all_gather_object(every, mine)
        if ctx.is_main:
            changed = sum(r["changed"] for r in every)
            numel = sum(r["numel"] for r in every)
            size = sum(r["delta_bytes"] or 0 for r in every)
            lines.append(
                {
                    "step": step,
                    "positions": resolve_positions(positions_of(args, step), numel),
                    "publish_s": publish_s,
                    "detect_s": [r["cast_s"] + r["diff_s"] for r in every],
                    # detect = cast + loop (queueing the scans, the snapshot's overwrite) +
                    # wait (the scans landing, the digests of the new rows, the delta)
                    "loop_s": [r.get("loop_s") for r in every],
                    "wait_s": [r.get("wait_s") for r in every],
                    "minor_faults": [r["minor_faults"] for r in every],
                    "host_memory_gb": host_memory_gb(),
                    "encode_s": [r["encode_s"] for r in every],
                    "upload_s": [r["upload_s"] for r in every],
                    "bytes": size,
                    "changed": changed,
                    "numel": numel,
                    "changed_fraction": changed / max(numel, 1),
                    "bits_per_changed": 8 * size / max(changed, 1),
                    "memory_bytes": [r["memory_bytes"] for r in every],
                    "peak_gpu_bytes": [r["peak_gpu_bytes"] for r in every],
                    "update_s": max(r["update_s"] for r in every),
                }
            )
            print(
                f"step {step}: publish {publish_s:.2f} s, {size / 1e6:.1f} MB, changed "
                f"{changed / numel * 100:.3f}%, {8 * size / max(changed, 1):.2f} bits/changed",
                flush=True,
            )
    pub.close()
    if ctx.is_main:
        Path(root, "publish.json").write_text(
            json.dumps({"anchor_publish_s": anchor_s, "steps": lines, "threads": pub.threads})
        )
    tdist.barrier()
    tdist.destroy_process_group()
    # Everything this rank reports is written. Leave without the interpreter's teardown: on a
    # loaded machine gloo's worker threads were still being destroyed there and one rank
    # aborted ("terminate called without an active exception") after a complete run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class TensorEngine:
    """The part of a rollout engine WeightSync uses: named tensors on one device (bf16, or the
    block-fp8 layout of the same shapes)."""

    def __init__(
        self, shapes: dict[str, tuple[int, ...]], device: torch.device, fp8: bool = False
    ) -> None:
        from deltarl.weightsync.fp8 import fp8_layout

        self.device = device
        specs = {n: (torch.bfloat16, s) for n, s in shapes.items()}
        self.tensors = {
            n: torch.zeros(s, dtype=d, device=device)
            for n, (d, s) in (fp8_layout(specs) if fp8 else specs).items()
        }

    def named_parameters(self) -> dict[str, torch.Tensor]:
        return self.tensors


def follow(
    args: argparse.Namespace, cfg: Any, publish_lines: list[dict[str, Any]]
) -> dict[str, Any]:
    """The rollout side: load the anchor, then time every delta (generating meanwhile when the
    engine generates)."""
    from deltarl.buckets.local import LocalBucket
    from deltarl.rollout.engines.base import SamplingParams
    from deltarl.rollout.sync.weights import WeightSync
    from deltarl.weightsync.reader import BucketReader

    if args.switch_interval_ms > 0:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    engine: Any
    t0 = time.perf_counter()
    if args.engine == "vllm":
        from deltarl.rollout.engines import VllmEngineSettings, make_engine

        model_dir = Path(args.bucket).parent / "model"
        cfg.save_pretrained(model_dir)
        engine = make_engine(
            VllmEngineSettings(
                model=str(model_dir),
                gpu_memory_utilization=args.gpu_memory_utilization,
                max_model_len=1024,
                enforce_eager=not args.cuda_graphs,
                fp8_block=128 if args.fp8 else None,
            )
        )
    elif args.engine == "transformers":
        import transformers

        from deltarl.rollout.engines.transformers_engine import TransformersEngine

        with device:
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        engine = TransformersEngine(model)
    else:
        engine = TensorEngine(tensor_specs(cfg), device, args.fp8)
    start_s = time.perf_counter() - t0
    generates = args.engine != "tensors"
    try:
        sync = WeightSync(
            engine,  # type: ignore[arg-type]
            BucketReader(LocalBucket(args.bucket)),
            host_mirror=True if args.decode_process else None,
            decode_process=args.decode_process,
            decode_threads=args.decode_threads,
        )
        t0 = time.perf_counter()
        sync.sync_to(0)
        anchor_s = time.perf_counter() - t0
        prompts = [[11 + i, 23, 7, 101 + i] for i in range(args.prompts)]
        params = SamplingParams(max_new_tokens=args.new_tokens, seed=0)
        applies = []
        for v in range(1, args.steps + 1):
            spanning = 0
            if generates:
                future = sync.sync_in_background(v)
                while True:
                    done = future.done()
                    out = sync.generate(prompts, params)
                    spanning += sum(c.version_min != c.version_max for c in out)
                    if done:
                        break
                report = future.result()
            else:
                report = sync.sync_to(v)
            s = report.steps[-1]
            fetch = s.download_s + s.decode_s + s.stage_s + s.wait_s + s.pause_s
            publish_s = publish_lines[v - 1]["publish_s"] if v <= len(publish_lines) else None
            applies.append(
                {
                    "version": v,
                    "positions": publish_lines[v - 1]["positions"] if publish_s else None,
                    "kind": s.kind,
                    "apply": s.apply,
                    "paused_apply_s": s.pause_s,
                    "wait_s": s.wait_s,
                    "download_s": s.download_s,
                    "decode_s": s.decode_s,
                    "stage_s": s.stage_s,
                    "verify_s": s.verify_s,
                    "fetch_to_applied_s": fetch,
                    "publish_to_applied_s": None if publish_s is None else publish_s + fetch,
                    "completions_spanning_the_sync": spanning,
                }
            )
            print(
                f"v{v}: paused apply {s.pause_s * 1e3:.2f} ms ({s.apply}), fetch to applied "
                f"{fetch:.2f} s, verified {sync.verified_digest() is not None}",
                flush=True,
            )
        verified = sync.verified_digest()
    finally:
        if hasattr(engine, "close"):
            engine.close()
    return {
        "engine": args.engine,
        "engine_start_s": start_s,
        "anchor_load_s": anchor_s,
        "verified_version": None if verified is None else verified[0],
        "applies": applies,
    }


def summarize(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    steps = result["publish"]["steps"]
    after_first = steps[1:] or steps
    out: dict[str, Any] = {
        "publish_s_median": statistics.median(s["publish_s"] for s in steps),
        "publish_s_median_after_first": statistics.median(s["publish_s"] for s in after_first),
        "publish_s_max": max(s["publish_s"] for s in steps),
        "bytes_median": statistics.median(s["bytes"] for s in steps),
        "changed_fraction_median": statistics.median(s["changed_fraction"] for s in steps),
        "bits_per_changed_median": statistics.median(s["bits_per_changed"] for s in steps),
        "numel": steps[0]["numel"],
    }
    applies = (result.get("apply") or {}).get("applies") or []
    if applies:
        pauses = sorted(a["paused_apply_s"] for a in applies)
        out.update(
            {
                "paused_apply_s_median": statistics.median(pauses),
                "paused_apply_s_max": pauses[-1],
                "fetch_to_applied_s_median": statistics.median(
                    a["fetch_to_applied_s"] for a in applies
                ),
                "publish_to_applied_s_median": statistics.median(
                    a["publish_to_applied_s"] for a in applies if a["publish_to_applied_s"]
                ),
            }
        )
    modes = sorted({s["positions"] for s in steps})
    if len(modes) > 1:  # --positions alternate: each way's versions on their own
        out["by_positions"] = {
            m: _medians(
                [s for s in steps if s["positions"] == m],
                [a for a in applies if a.get("positions") == m],
            )
            for m in modes
        }
    if not args.tiny and args.layers < FULL_LAYERS:
        # per-layer work and bytes are the same in every layer; embeddings and head once
        cfg = model_config(args)
        specs = tensor_specs(cfg)
        per_layer = sum(math.prod(s) for n, s in specs.items() if n.startswith("model.layers.0."))
        once = sum(math.prod(s) for n, s in specs.items() if ".layers." not in n)
        full = once + FULL_LAYERS * per_layer
        factor = full / (once + args.layers * per_layer)
        out["extrapolated_to_48_layers"] = {
            "note": "scaled by elements (an extrapolation, not a measurement): publish work, "
            "bytes and fetch grow with the elements at a fixed density; the paused apply grows "
            "with the changed elements (one store launch)",
            "factor": factor,
            "numel": full,
            "publish_s_median_after_first": out["publish_s_median_after_first"] * factor,
            "bytes_median": out["bytes_median"] * factor,
            **(
                {
                    "paused_apply_s_median": out["paused_apply_s_median"] * factor,
                    "fetch_to_applied_s_median": out["fetch_to_applied_s_median"] * factor,
                    "publish_to_applied_s_median": out["publish_to_applied_s_median"] * factor,
                }
                if applies
                else {}
            ),
        }
    return out


def _medians(steps: list[dict[str, Any]], applies: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of one position coding's published steps and applied versions."""

    def med(rows: list[dict[str, Any]], key: str) -> float | None:
        vals = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    return {
        "versions": [s["step"] for s in steps],
        "publish_s_median": med(steps, "publish_s"),
        "bytes_median": med(steps, "bytes"),
        "bits_per_changed_median": med(steps, "bits_per_changed"),
        "decode_s_median": med(applies, "decode_s"),
        "fetch_to_applied_s_median": med(applies, "fetch_to_applied_s"),
        "publish_to_applied_s_median": med(applies, "publish_to_applied_s"),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny model on CPU (a smoke test)")
    ap.add_argument("--layers", type=int, default=None, help=f"default {FULL_LAYERS} (tiny: 2)")
    ap.add_argument(
        "--ranks", type=int, default=None, help="publishing ranks (default: GPUs, >= 2)"
    )
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--expert-skew", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None)
    ap.add_argument("--engine", choices=["vllm", "tensors", "transformers", "none"], default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    ap.add_argument("--cuda-graphs", action="store_true", help="vLLM with CUDA graphs")
    ap.add_argument("--prompts", type=int, default=32, help="generated during each sync")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--bucket", default=None, help="bucket directory (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the bucket")
    ap.add_argument(
        "--decode-process",
        action="store_true",
        help="the worker decodes in a child process (WeightSync's decode_process)",
    )
    ap.add_argument(
        "--decode-threads", type=int, default=None, help="the decoder's threads (its default)"
    )
    ap.add_argument(
        "--switch-interval-ms",
        type=float,
        default=0.2,
        help="sys.setswitchinterval of the following process, as a rollout worker sets it "
        "(GIL_SWITCH_INTERVAL_S; 0: Python's 5 ms): the decoder hands the GIL back and forth "
        "with the engine's Python threads",
    )
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="publish block fp8 (128 x 128) and apply it into an fp8 engine (vllm or tensors)",
    )
    ap.add_argument(
        "--positions",
        choices=["auto", "contexts", "gaps", "alternate"],
        default="auto",
        help="publish.positions of every step; alternate: gaps for odd steps, contexts for "
        "even ones, and the summary's by_positions compares them",
    )
    ap.add_argument("--json", type=Path, default=None, help="default: see the docstring")
    args = ap.parse_args(argv)
    if args.fp8 and args.engine == "transformers":
        ap.error("--fp8: the transformers engine serves bf16 only (use vllm or tensors)")
    cuda = torch.cuda.is_available() and not args.tiny
    args.device = args.device or ("cuda" if cuda else "cpu")
    args.layers = args.layers or (2 if args.tiny else FULL_LAYERS)
    args.ranks = args.ranks or max(2, torch.cuda.device_count() if args.device == "cuda" else 2)
    args.engine = args.engine or ("vllm" if args.device == "cuda" else "tensors")
    args.experts_total = (TINY if args.tiny else QWEN3_30B_A3B)["num_experts"]
    root = Path(tempfile.mkdtemp(prefix="moe-scale-"))
    args.bucket = args.bucket or str(root / "bucket")
    cfg = model_config(args)
    gpus = min(args.ranks, torch.cuda.device_count()) if args.device == "cuda" else 0
    if args.json is None and not args.tiny:
        hardware = gpu_tag(gpus) if gpus else cpu_tag()
        name = f"qwen3-30b-a3b-{args.layers}layers" + ("-fp8" if args.fp8 else "")
        args.json = result_path("moe_scale", hardware, name)
    result: dict[str, Any] = {
        "meta": meta(gpus=gpus),
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "config": {k: getattr(cfg, k) for k in (*QWEN3_30B_A3B, "num_hidden_layers")},
    }
    try:
        t0 = time.perf_counter()
        mp.spawn(rank_main, args=(str(root), args), nprocs=args.ranks, join=True)
        result["publish"] = json.loads((root / "publish.json").read_text())
        result["publish"]["wall_s"] = time.perf_counter() - t0
        if args.engine != "none":
            result["apply"] = follow(args, cfg, result["publish"]["steps"])
        result["summary"] = summarize(result, args)
    finally:
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1) + "\n")
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result["summary"], indent=1))
    return result


if __name__ == "__main__":
    main()
