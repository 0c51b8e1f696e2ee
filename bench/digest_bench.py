"""Verification digests of a large state: one tensor at a time against ``state_digests``' threads.

A worker proves each version by hashing every tensor a delta changed, which at 1% density on an
MoE is every tensor: 61 GB for Qwen3-30B-A3B's shapes, 10-11 s per version one tensor at a time
(``bench/moe_scale.py``). This hashes ``--tensors`` tensors shaped like one layer's stacked
experts (``[experts, rows, cols]`` bf16, ~800 MB each at the default shape) on ``--device``,
alternating the two ways ``--repeats`` times, checks both give the same digests (and, on a GPU,
the CPU copy's), and reports the median and spread of each in GB/s.

Usage::

    python bench/digest_bench.py --device cuda --tensors 16   # one GPU, ~13 GB
    python bench/digest_bench.py --device cpu --tensors 4     # any machine

Output: ``bench/results/digest_<hardware>.json`` (``--json`` for another path).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from common import cpu_tag, gpu_tag, meta, result_path, write_json

from deltarl.weightsync import digest


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--shape", default="128,1536,2048", help="one tensor's shape (bf16)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split(","))
    g = torch.Generator(device=args.device).manual_seed(0)
    state = {
        f"model.layers.{i}.mlp.experts.gate_up_proj": torch.randn(
            shape, generator=g, device=args.device, dtype=torch.bfloat16
        )
        for i in range(args.tensors)
    }
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    ways = {
        "one_at_a_time": lambda: {n: digest.tensor_digest(t) for n, t in state.items()},
        "threads": lambda: digest.state_digests(state),
    }
    seconds: dict[str, list[float]] = {w: [] for w in ways}
    got: dict[str, dict[str, str]] = {}
    for _ in range(args.repeats):
        for way, run in ways.items():  # interleaved
            t0 = time.perf_counter()
            got[way] = run()
            seconds[way].append(time.perf_counter() - t0)
    assert got["threads"] == got["one_at_a_time"], "threaded digests differ"
    first = next(iter(state))
    assert got["threads"][first] == digest.tensor_digest(state[first].cpu()), "not the CPU digest"
    gpus = 1 if args.device.startswith("cuda") else 0
    result = {
        "meta": meta(gpus=gpus),
        "settings": {**vars(args), "json": None, "threads": digest.DIGEST_THREADS},
        "bytes": nbytes,
        "ways": {
            w: {
                "seconds": s,
                "median_s": statistics.median(s),
                "gb_per_s_median": nbytes / statistics.median(s) / 1e9,
            }
            for w, s in seconds.items()
        },
    }
    for w, r in result["ways"].items():
        print(f"{w}: {r['median_s']:.2f} s median ({r['gb_per_s_median']:.1f} GB/s), {seconds[w]}")
    hardware = gpu_tag(1) if gpus else cpu_tag()
    write_json(args.json or result_path("digest", hardware, "stacked-experts"), result)
    return result


if __name__ == "__main__":
    main()
