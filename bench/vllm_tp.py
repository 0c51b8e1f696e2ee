"""The vllm engine at tensor parallelism 2 against 1 on the same machine (docs/vllm.md).

Needs ``max(--tp)`` CUDA GPUs and vLLM 0.33.0. The parent (no GPU) writes Qwen3-0.6B's shape
(random weights; ``bench/vllm_speed.py``'s config), publishes an anchor and ``--versions``
compact deltas of ``--density`` changed elements to a local bucket, then runs one child process
per ``--tp`` value. Each child starts the engine with that tensor parallelism and

1. follows the bucket version by version with ``WeightSync`` while generating (a background
   sync per version, 64 prompts of 128 tokens each time): every version verified (at TP > 1:
   every rank's shard of each changed tensor against the same slice of the host mirror, the
   mirror against the trainer's digests), then at the end every tensor of every rank against
   the mirror and the mirror's state digest against the published one;
2. reports the paused window (p50 / p99 / max), the wait for the in-flight forward, staging and
   verification times, and how many generations spanned a sync (0: the applies landed on an
   idle engine, so the pause was not measured under load);
3. times generation without syncs (``--batches``, ``--new-tokens``; median of ``--reps``).

Runs on any machine with ``max(--tp)`` CUDA GPUs and vLLM 0.33.0. The result goes to
``bench/results/vllm_tp_<N>x<gpu>_qwen3-0.6b.json`` (``--json`` for another path), which a rerun
overwrites.

Usage::

    python bench/vllm_tp.py --tp 2 1 --versions 5 --batches 32 256 --new-tokens 128 --reps 1

Exit status 1 if any version fails verification.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import gpu_tag, meta, result_path, write_json

RESULT = "deltarl-vllm-tp-result: "


def _speed_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "vllm_speed", Path(__file__).with_name("vllm_speed.py")
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def prepare(directory: Path, versions: int, density: float) -> tuple[str, Path, int]:
    """The model directory, a bucket with versions 0..``versions``, the element count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from deltarl.buckets.local import LocalBucket
    from deltarl.weightsync.anchor import encode_anchor
    from deltarl.weightsync.codec.formats import FORMAT_TAGS, encode_delta
    from deltarl.weightsync.delta import compute_delta
    from deltarl.weightsync.digest import state_digest
    from deltarl.weightsync.writer import BucketWriter, NewObject

    speed = _speed_module()
    model = speed.qwen3_0_6b(directory / "model")
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model), dtype=torch.bfloat16)
    state = {n: p.detach().clone() for n, p in hf.named_parameters()}
    del hf
    numel = sum(t.numel() for t in state.values())
    writer = BucketWriter(LocalBucket(directory / "bucket"), anchor_every=0)

    def publish(v: int, objects: list[Any], s: dict[str, torch.Tensor]) -> None:
        writer.publish(v, objects, state_digest=state_digest(s), numel=numel, full_bytes=2 * numel)

    publish(0, [NewObject("anchor", "safetensors", encode_anchor(state, 0))], state)
    g = torch.Generator().manual_seed(1)
    for v in range(1, versions + 1):
        new = {}
        for name, t in state.items():
            bits = t.view(torch.int16).clone()
            mask = torch.rand(bits.shape, generator=g) < density
            bits[mask] += 1
            new[name] = bits.view(t.dtype)
        d = compute_delta(state, new, v - 1, v)
        blob = encode_delta(d, state, "compact")
        tag = FORMAT_TAGS["compact"]
        publish(v, [NewObject("delta", tag, blob, v - 1, d.base_digest, d.changed)], new)
        state = new
    return model, directory / "bucket", numel


def child(a: argparse.Namespace) -> dict[str, Any]:
    from deltarl.buckets.local import LocalBucket
    from deltarl.rollout.engines import SamplingParams, VllmEngineSettings, make_engine
    from deltarl.rollout.sync.weights import WeightSync
    from deltarl.weightsync.digest import state_digest
    from deltarl.weightsync.reader import BucketReader

    speed = _speed_module()
    t0 = time.perf_counter()
    engine = make_engine(
        VllmEngineSettings(
            model=a.model,
            tensor_parallel_size=a.child,
            gpu_memory_utilization=a.gpu_memory_utilization,
        )
    )
    started = time.perf_counter() - t0
    reader = BucketReader(LocalBucket(a.bucket))
    sync = WeightSync(engine, reader)
    sync.sync_to(0)
    failures: list[str] = []
    prompts = speed.prompts_of(64, 32, 151936, seed=0)
    spans = 0
    latest = reader.latest_version()
    assert latest is not None
    for v in range(1, latest + 1):
        future = sync.sync_in_background(v)
        out = sync.generate(
            prompts, SamplingParams(max_new_tokens=a.sync_tokens, temperature=1.0, seed=v)
        )
        try:
            future.result()
        except Exception as err:
            failures.append(f"v{v}: {err}")
            break
        spans += sum(c.version_min != c.version_max for c in out)
        if any(sync.check(c) == "failed" for c in out):
            failures.append(f"v{v}: a completion used weights that failed verification")
    final = reader.manifest(latest).state_digest
    shards = engine.sharded_weights()
    if shards is not None:
        mirror = sync._mirror
        assert mirror is not None
        if state_digest(mirror) != final:
            failures.append("host mirror's state digest is not the trainer's")
        bad = shards.mismatches(list(mirror), mirror)  # every tensor of every rank
        if bad:
            failures.append(f"{len(bad)} shards differ at the end, e.g. {bad[:3]}")
    elif state_digest(engine.named_parameters()) != final:
        failures.append("vLLM's weights differ from the trainer's at the end")
    deltas = [t for t in sync.timings if t.kind == "delta"]

    def ms(field: str) -> dict[str, float] | None:
        vals = sorted(getattr(t, field) * 1e3 for t in deltas)
        if not vals:
            return None
        return {
            "p50": statistics.median(vals),
            "p99": vals[min(len(vals) - 1, round(0.99 * (len(vals) - 1)))],
            "max": vals[-1],
        }

    result: dict[str, Any] = {
        "tp": a.child,
        "start_s": started,
        "versions_followed": len(deltas),
        "verified_version": sync.version,
        "generations_spanning_a_sync": spans,
        "apply": sorted({t.apply for t in deltas if t.apply}),
        "pause_ms": ms("pause_s"),
        "wait_ms": ms("wait_s"),
        "stage_ms": ms("stage_s"),
        "verify_ms": ms("verify_s"),
        "decode_ms": ms("decode_s"),
    }
    speeds = {}
    for batch in a.batches:
        batch_prompts = speed.prompts_of(batch, 32, 151936, seed=batch)
        params = SamplingParams(max_new_tokens=a.new_tokens, temperature=1.0)

        def run(p: list[list[int]] = batch_prompts, sp: SamplingParams = params) -> int:
            return sum(len(c.token_ids) for c in sync.generate(p, sp))

        speeds[str(batch)] = speed.timed(run, a.reps)
    result["tokens_per_s"] = speeds
    result["failures"] = failures
    sync.close()
    engine.close()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--versions", type=int, default=8)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--sync-tokens",
        type=int,
        default=512,
        help="tokens per prompt generated while each version syncs (long enough for the apply "
        "to land mid-generation: check generations_spanning_a_sync)",
    )
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    ap.add_argument("--json", type=Path, help="default: see the docstring")
    ap.add_argument("--reuse", type=Path, help="a directory a previous run prepared")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--bucket", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        print(RESULT + json.dumps(child(a)), flush=True)
        return 0
    t0 = time.perf_counter()
    if a.reuse is not None:  # same model and bucket as the run that prepared it
        model, bucket = str(a.reuse / "model"), a.reuse / "bucket"
        known = a.reuse / "numel"
        numel = json.loads(known.read_text()) if known.exists() else None
    else:
        tmp = Path(tempfile.mkdtemp(prefix="deltarl-vllm-tp-"))
        model, bucket, numel = prepare(tmp, a.versions, a.density)
        (tmp / "numel").write_text(str(numel))
    out: dict[str, Any] = {
        "model": "Qwen3-0.6B shape, random weights",
        "numel": numel,
        "density": a.density,
        "versions": a.versions,
        "prepare_s": time.perf_counter() - t0,
        "runs": [],
    }
    rc = 0
    for tp in a.tp:
        cmd = [sys.executable, __file__, "--child", str(tp), "--model", model, "--bucket"]
        cmd += [str(bucket), "--batches", *map(str, a.batches), "--new-tokens", str(a.new_tokens)]
        cmd += ["--reps", str(a.reps), "--gpu-memory-utilization", str(a.gpu_memory_utilization)]
        cmd += ["--sync-tokens", str(a.sync_tokens)]
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        sys.stderr.write(proc.stderr[-20000:])
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
        if proc.returncode or not lines:
            out["runs"].append({"tp": tp, "error": f"exit {proc.returncode}"})
            rc = 1
            continue
        run = json.loads(lines[-1][len(RESULT) :])
        rc |= bool(run["failures"])
        out["runs"].append(run)
        print(json.dumps(run), flush=True)
    print(json.dumps(out, indent=2))
    gpus = max(a.tp)  # after the children: CUDA starts in this process only now
    out = {"meta": meta(gpus=gpus), **out}
    write_json(a.json or result_path("vllm_tp", gpu_tag(gpus), "qwen3-0.6b"), out)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
