"""GPU benchmark of the weight-sync path on a model of Qwen3-0.6B size (needs CUDA).

A Qwen3-0.6B-shaped model (random init, tied embeddings, 0.6B parameters) is trained for a few
AdamW steps at lr 1e-6 on random tokens (fp32 master weights, bf16 autocast); after each step its
bf16 cast is the new published state. For each step it measures, on the trainer side:

* detect + extract: bit comparison of old and new bf16 on the GPU, flat indices and new values,
  copied to the host (what goes into any sparse format);
* result digests (device-to-host copy + xxh3 of every tensor);
* compact encode on the CPU threads (the old state is the trainer's host mirror);

and on the rollout-worker side:

* compact decode on the CPU (against the worker's host mirror);
* staging the patch on the GPU (pinned host-to-device copies, while inference still runs);
* the in-place apply (``apply_staged``: one store-kernel launch, or one ``index_copy_`` per
  changed tensor with ``DELTARL_ROLLOUT_APPLY_KERNEL=torch``): the only part that pauses
  inference; reported as p50/p99 over repetitions;
* verification of the applied GPU weights against the trainer's digests.

Runs on any machine with a CUDA GPU and the ``weights`` and ``model`` extras. The rows go to
``bench/results/codec_gpu_<gpu>_qwen3-0.6b.json`` (``--json`` for another path; ``--tiny``, a CPU
smoke test, writes only with ``--json``).

Usage::

    python bench/codec_gpu_bench.py --steps 10
"""

# ruff: noqa: B023  (the timed lambdas run immediately, inside their loop iteration)
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from common import gpu_tag, meta, result_path, write_json

from deltarl.weightsync import (
    apply_staged,
    compute_delta,
    stage_delta,
    state_digests,
    verify_result,
)
from deltarl.weightsync.codec.bits import bits_view
from deltarl.weightsync.codec.compact import decode_compact, encode_compact
from deltarl.weightsync.codec.trl_format import encode_trl
from deltarl.weightsync.stats import delta_stats


def qwen3_06b_like(device: torch.device, tiny: bool = False) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=VOCAB if not tiny else 1000,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28 if not tiny else 1,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).to(device=device, dtype=torch.float32)


def bf16_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.named_parameters()}


VOCAB = 151936


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):  # type: ignore[no-untyped-def]
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t


def detect_extract(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> int:
    total = 0
    for name, n in new.items():
        ob, nb = bits_view(old[name]), bits_view(n)
        idx = torch.nonzero(ob != nb).view(-1)
        vals = nb[idx]
        total += int(idx.numel())
        idx.cpu(), vals.cpu()
    return total


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--apply-reps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument(
        "--json", type=Path, help="default bench/results/codec_gpu_<gpu>_qwen3-0.6b.json"
    )
    ap.add_argument("--tiny", action="store_true", help="one layer, small vocab (a CPU smoke test)")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = qwen3_06b_like(dev, args.tiny)
    vocab = model.config.vocab_size
    numel = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    gen = torch.Generator(device=dev).manual_seed(1)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"# codec benchmark on {name}: Qwen3-0.6B-shaped model, {numel:,} parameters")

    # warm-up: jit the numba kernels, CUDA context
    small = {"w": torch.randn(4096).bfloat16()}
    small2 = {"w": (small["w"].float() + 1e-3).bfloat16()}
    decode_compact(encode_compact(compute_delta(small, small2), small), small)

    prev = bf16_state(model)
    prev_host = {k: v.cpu() for k, v in prev.items()}  # trainer's / worker's host mirror
    prev_digests = state_digests(prev_host)
    worker_gpu = {k: v.clone() for k, v in prev.items()}  # the inference engine's weights
    rows = []
    for step in range(1, args.steps + 1):
        ids = torch.randint(0, vocab, (args.batch, args.seq_len), device=dev, generator=gen)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        new = bf16_state(model)

        changed, t_detect = timed(lambda: detect_extract(prev, new))
        _, t_detect2 = timed(lambda: detect_extract(prev, new))
        digests, t_digest = timed(lambda: state_digests(new))
        delta, t_delta = timed(
            lambda: compute_delta(prev, new, step - 1, step, old_digests=prev_digests)
        )
        blob, t_encode = timed(lambda: encode_compact(delta, prev_host, threads=args.threads))
        gap = len(encode_trl(delta, "gap_delta"))
        decoded, t_decode = timed(
            lambda: decode_compact(blob, prev_host, base_digests=prev_digests, threads=args.threads)
        )
        staged, t_stage = timed(lambda: stage_delta(decoded, dev, worker_gpu))
        pauses = []
        for _ in range(args.apply_reps):  # idempotent: absolute values
            _, t = timed(lambda: apply_staged(worker_gpu, staged))
            pauses.append(t)
        _, t_verify = timed(lambda: verify_result(worker_gpu, decoded))
        s = delta_stats(delta, prev_host)
        pauses.sort()
        row = {
            "step": step,
            "density": s.density,
            "changed": changed,
            "compact_bytes": len(blob),
            "bits_per_changed": len(blob) * 8 / max(changed, 1),
            "conditional_floor_bits": s.conditional_floor_bits,
            "trl_gap_bytes": gap,
            "full_bytes": s.dense_bytes,
            "detect_extract_s": min(t_detect, t_detect2),
            "result_digests_s": t_digest,
            "compute_delta_s": t_delta,
            "encode_s": t_encode,
            "decode_s": t_decode,
            "stage_h2d_s": t_stage,
            "apply_p50_ms": 1e3 * statistics.median(pauses),
            "apply_p99_ms": 1e3 * pauses[min(len(pauses) - 1, int(0.99 * len(pauses)))],
            "verify_s": t_verify,
            "changed_tensors": len(staged.parts),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        prev, prev_digests = new, digests
        prev_host = {k: v.cpu() for k, v in new.items()}
    gpus = 1 if dev.type == "cuda" else 0
    out = {"meta": meta(gpus=gpus), "device": name, "numel": numel, "rows": rows}
    if args.json is None and not args.tiny and gpus:
        args.json = result_path("codec_gpu", gpu_tag(1), "qwen3-0.6b")
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
