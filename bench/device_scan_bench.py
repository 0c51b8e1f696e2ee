"""The device scan of one FSDP rank's rows (:mod:`deltarl.weightsync.codec.device_scan`):
seconds to find the changes and the compact encoder's context scans of every tensor, on one GPU.

The rows are those of one rank of Qwen2.5-7B under 4-way FSDP (339 tensors, 1.9 G bf16 elements,
row-sharded), random weights with 2% of the elements moved. Each repetition times, interleaved:

* ``queued``: :func:`start_changes_and_scans` for every tensor, then every ``result()`` (what
  :class:`~deltarl.trainer.publish.sharded.ShardedPublisher` does);
* ``one_by_one``: ``start(...).result()`` per tensor;
* ``ref`` (with ``--ref FILE``): ``changes_and_scans`` of another implementation of the module,
  e.g. an earlier revision::

      git show 67290ad:weightsync/codec/device_scan.py > /tmp/scan_ref.py
      python bench/device_scan_bench.py --ref /tmp/scan_ref.py

``--scale 0.01`` shrinks every tensor's rows (a CPU smoke run: ``--device cpu --scale 0.001``).
Prints one JSON line per repetition and a summary (medians).

Runs on any machine with a CUDA GPU and the ``weights`` extra. The result (the lines and the
summary) goes to ``bench/results/device_scan_<gpu>_qwen2.5-7b-rank.json`` (``--json`` for another
path; scaled or CPU runs write only with ``--json``), which a rerun overwrites.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from common import gpu_tag, meta, result_path, write_json

from deltarl.weightsync.codec import device_scan


def rank_shapes(scale: float) -> list[tuple[int, ...]]:
    """One rank's row shards of Qwen2.5-7B under 4-way FSDP (``encode_rank_bench.py``'s),
    rows scaled by ``scale``."""
    spec = importlib.util.spec_from_file_location(
        "encode_rank_bench", Path(__file__).with_name("encode_rank_bench.py")
    )
    assert spec is not None and spec.loader is not None
    shapes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shapes)
    return [(max(1, int(s[0] * scale)), *s[1:]) for s in shapes.rank_shapes("7b").values()]


def state(
    device: str, scale: float, moved: float, seed: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(seed)
    olds, news = [], []
    for s in rank_shapes(scale):
        o = (torch.randn(s, device=device, generator=g) * 0.02).to(torch.bfloat16)
        m = torch.rand(s, device=device, generator=g) < moved
        n = torch.where(m, o.float() * 1.01 + 1e-5, o.float()).to(torch.bfloat16)
        olds.append(o)
        news.append(n)
    return olds, news


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--scale", type=float, default=1.0, help="rows of every tensor x this")
    ap.add_argument("--moved", type=float, default=0.02, help="share of elements that move")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--ref", type=Path, help="another device_scan.py to time the same way")
    ap.add_argument("--json", type=Path, default=None, help="default: see the docstring")
    a = ap.parse_args()
    ref: Any = None
    if a.ref is not None:
        spec = importlib.util.spec_from_file_location("device_scan_ref", a.ref)
        assert spec is not None and spec.loader is not None
        ref = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ref)
    olds, news = state(a.device, a.scale, a.moved, 0)
    pairs = list(zip(olds, news, strict=True))
    numel = sum(o.numel() for o in olds)

    def queued() -> None:
        for p in [device_scan.start_changes_and_scans(o, n) for o, n in pairs]:
            p.result()

    def one_by_one() -> None:
        for o, n in pairs:
            device_scan.start_changes_and_scans(o, n).result()

    def reference() -> None:
        for o, n in pairs:
            ref.changes_and_scans(o, n)

    runs = {"queued": queued, "one_by_one": one_by_one}
    if ref is not None:
        runs["ref"] = reference
    times: dict[str, list[float]] = {k: [] for k in runs}
    lines = []
    for rep in range(a.reps):
        line: dict[str, Any] = {"rep": rep}
        for name, fn in runs.items():
            _sync(a.device)
            t0 = time.perf_counter()
            fn()
            _sync(a.device)
            times[name].append(time.perf_counter() - t0)
            line[f"{name}_s"] = times[name][-1]
        print(json.dumps(line), flush=True)
        lines.append(line)
    summary = {
        "summary": True,
        "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device,
        "tensors": len(pairs),
        "elements": numel,
        "moved": a.moved,
        # the first repetition warms up (allocator, kernels); medians of the rest
        **{f"{k}_s_median": statistics.median(v[1:] or v) for k, v in times.items()},
    }
    print(json.dumps(summary), flush=True)
    cuda = a.device.startswith("cuda")
    if a.json is None and cuda and a.scale == 1.0:
        a.json = result_path("device_scan", gpu_tag(1), "qwen2.5-7b-rank")
    if a.json is not None:
        write_json(a.json, {"meta": meta(gpus=int(cuda)), "reps": lines, "summary": summary})


if __name__ == "__main__":
    main()
