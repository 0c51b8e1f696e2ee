"""The compact encoder on one FSDP rank's delta, from precomputed scans (what a GPU rank of
:class:`~deltarl.trainer.publish.sharded.ShardedPublisher` encodes after its device scan): seconds per
encode at a given thread count, and where the time goes (phase A, tables, phase B).

The rows are one rank's of Qwen3-1.7B under 4-way FSDP (310 tensors, 430 M bf16 elements),
with ``--preset 7b`` of Qwen2.5-7B (339 tensors, 1.9 G; needs ~20 GB of RAM), with ``--preset
moe`` of Qwen3-30B-A3B (32 of the 128 experts of every layer; 7.6 G at 48 layers, ``--layers``
for fewer); random weights with ``--moved`` of the elements changed; ``--positions gaps``
codes the positions as gaps (as the trainer does from 16 G elements in all). The scans are computed on the CPU
(:func:`~deltarl.weightsync.codec.device_scan.changes_and_scans`, slow: a minute per
1.7B rank on 2 cores), then every repetition encodes with ``encode_compact(delta, None,
scans=...)`` and the phases are timed by wrapping them.

    python bench/encode_rank_bench.py --threads 1 2
    python bench/encode_rank_bench.py --preset moe --layers 12 --moved 0.01 --positions gaps \
        --threads 8 16 32   # a GPU host's cores

Runs on any machine with the ``weights`` extra. The result (every repetition and the medians)
goes to ``bench/results/encode_rank_cpu<N>_<preset>-rank[-<L>l][-gaps].json`` (``--json`` for another path),
which a rerun on the same number of cores overwrites.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import cpu_tag, meta, result_path, write_json

from deltarl.weightsync.codec import compact
from deltarl.weightsync.codec.device_scan import changes_and_scans
from deltarl.weightsync.delta import compute_delta

FULL_LAYERS = {"1.7b": 28, "7b": 28, "moe": 48}


def rank_shapes(preset: str, layers: int = 28) -> dict[str, tuple[int, ...]]:
    """One rank's row shards under 4-way FSDP (``layers`` of the 28 decoder layers)."""
    if preset == "1.7b":
        layer = {"q": (512, 2048), "k": (256, 2048), "v": (256, 2048), "o": (512, 2048)}
        layer |= {"gate": (1536, 2048), "up": (1536, 2048), "down": (512, 6144)}
        layer |= {"in_norm": (512,), "post_norm": (512,), "q_norm": (32,), "k_norm": (32,)}
        out = {f"layers.{i}.{k}": s for i in range(layers) for k, s in layer.items()}
        return out | {"embed": (37984, 2048), "norm": (512,)}
    if preset == "7b":
        layer = {"q": (896, 3584), "k": (128, 3584), "v": (128, 3584), "o": (896, 3584)}
        layer |= {"gate": (4736, 3584), "up": (4736, 3584), "down": (896, 18944)}
        layer |= {"in_norm": (896,), "post_norm": (896,), "q_b": (896,), "k_b": (128,)}
        layer |= {"v_b": (128,)}
        out = {f"layers.{i}.{k}": s for i in range(layers) for k, s in layer.items()}
        return out | {"embed": (38016, 3584), "lm_head": (38016, 3584), "norm": (896,)}
    if preset == "moe":  # Qwen3-30B-A3B: 32 of the 128 experts per rank
        layer = {"gate_up": (32, 1536, 2048), "down": (32, 2048, 768), "router": (32, 2048)}
        layer |= {"q": (1024, 2048), "k": (128, 2048), "v": (128, 2048), "o": (512, 4096)}
        layer |= {"in_norm": (512,), "post_norm": (512,), "q_norm": (32,), "k_norm": (32,)}
        out = {f"layers.{i}.{k}": s for i in range(layers) for k, s in layer.items()}
        return out | {"embed": (37984, 2048), "lm_head": (37984, 2048), "norm": (512,)}
    raise ValueError(f"unknown preset {preset!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="1.7b", choices=["1.7b", "7b", "moe"])
    ap.add_argument("--moved", type=float, default=0.02)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: all)")
    ap.add_argument("--positions", default="contexts", choices=["contexts", "gaps"])
    ap.add_argument("--json", type=Path, default=None, help="default: see the docstring")
    a = ap.parse_args()
    a.layers = a.layers or FULL_LAYERS[a.preset]
    torch.manual_seed(0)
    old, new = {}, {}
    for k, s in rank_shapes(a.preset, a.layers).items():
        o = (torch.randn(s) * 0.02).to(torch.bfloat16)
        moved = torch.rand(s) < a.moved
        old[k], new[k] = o, torch.where(moved, o.float() * 1.01 + 1e-5, o.float()).to(o.dtype)
    delta = compute_delta(old, new, 0, 1)
    scans = {}
    for k in old:
        scans.update(((k, s), sc) for s, sc in changes_and_scans(old[k], new[k])[2].items())
    del old, new
    print(json.dumps({"preset": a.preset, "changed": delta.changed, "chunks": len(scans)}))

    phases: dict[str, float] = {}

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:  # summed over the pool's threads: CPU seconds, not wall
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0

        return run

    timed_names = ("analyse_chunk", "analyse_scan_by_gaps", "shared_tables", "code_chunk")
    originals = {n: getattr(compact, n) for n in timed_names}
    for name, fn in originals.items():
        setattr(compact, name, timed(name, fn))
    summary: dict[str, Any] = {"summary": True, "changed": delta.changed, "chunks": len(scans)}
    lines = []
    try:
        for threads in a.threads:
            walls = []
            for rep in range(a.reps + 1):  # the first compiles the kernels
                phases.clear()
                t0 = time.perf_counter()
                compact.encode_compact(
                    delta, None, scans=scans, threads=threads, positions=a.positions
                )
                wall = time.perf_counter() - t0
                line = {"threads": threads, "rep": rep, "encode_s": wall}
                line["ns_per_change"] = wall / max(delta.changed, 1) * 1e9
                line |= {f"{k}_s": v for k, v in phases.items()}
                print(json.dumps(line), flush=True)
                lines.append(line)
                if rep:
                    walls.append(wall)
            summary[f"encode_s_median_{threads}_threads"] = statistics.median(walls)
    finally:
        for name, fn in originals.items():
            setattr(compact, name, fn)
    print(json.dumps(summary))
    name = (
        f"{a.preset}-rank" if a.layers == FULL_LAYERS[a.preset] else f"{a.preset}-rank-{a.layers}l"
    )
    name += "-gaps" if a.positions == "gaps" else ""
    out = a.json or result_path("encode_rank", cpu_tag(), name)
    write_json(out, {"meta": meta(), "reps": lines, "summary": summary})


if __name__ == "__main__":
    main()
