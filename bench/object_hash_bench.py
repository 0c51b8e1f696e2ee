"""What binding signed versions to their bytes costs: SHA-256 (and, for comparison, BLAKE2b and
xxh3-128) throughput per core and over parallel parts, on a real compact delta, and the cost for
a 7B-class delta and anchor.

    python bench/object_hash_bench.py [--mib 256] [--repeats 5] [--threads 1,2]
                                      [--elements 134217728] [--density 0.01] [--no-delta]

* **Throughput per core**: one hash over ``--mib`` MiB of random bytes (content does not change
  the speed of any of these hashes), median of ``repeats``; ``hashlib`` (OpenSSL) and
  ``xxhash``, the libraries deltarl uses.
* **Parallel parts**: ``t`` threads each hashing their own part of the same total at once
  (``hashlib`` releases the GIL), for each ``--threads`` count (default 1 .. the machine's
  cores), with the cores actually busy (process CPU time / wall time): what a sharded object's
  parts cost a reader (``BucketReader.fetch_parts`` hashes each part in its own thread) and what
  an FSDP trainer's ranks pay, each for its own part.
* **A real compact delta** (skipped with ``--no-delta``, which needs no torch): a random bf16
  state of ``--elements`` elements (default: SmolLM2-135M's size), ``--density`` of it moved by
  one or two ULPs, encoded with the compact codec; its size, bits per changed element, SHA-256
  time, and ``BucketReader.fetch`` of it from a local bucket with and without SHA-256.
* **7B-class extrapolations** from the measured one-core throughput: a delta of 7e9 parameters
  at ``--density`` and 1.3 bytes per changed element (91 MB; and at the measured bits per
  changed element), and a bf16 anchor of 7e9 parameters (14 GB), on one core and as parts.

Runs on any machine with the project installed (the delta part needs the ``weights`` extra).
Results: printed, and written to ``bench/results/object_hash_cpu<N>_<M>mib.json`` (``N`` cores,
``M`` = ``--mib``; ``--json`` for another path), which a rerun overwrites.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import ssl
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import cpu_tag, meta, result_path, write_json

MB = 1e6
PARAMS_7B = 7_000_000_000
HASHES: dict[str, Callable[[memoryview], object]] = {
    "sha256": lambda b: hashlib.sha256(b).digest(),
    "blake2b": lambda b: hashlib.blake2b(b).digest(),
}
XXHASH_VERSION = None
try:  # deltarl's dependency; optional so that --no-delta runs on a bare Python
    import xxhash

    HASHES["xxh3_128"] = xxhash.xxh3_128_digest
    XXHASH_VERSION = xxhash.VERSION
except ImportError:  # pragma: no cover
    pass


def median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def per_core(data: bytes, repeats: int) -> dict[str, float]:
    """MB/s of each hash over ``data`` on one thread."""
    view = memoryview(data)
    out = {}
    for name, fn in HASHES.items():
        out[name] = len(data) / median_s(functools.partial(fn, view), repeats) / MB
    return out


def parallel_parts(data: bytes, repeats: int, threads: list[int]) -> list[dict[str, Any]]:
    """SHA-256 of ``data`` cut into ``t`` parts hashed by ``t`` threads at once; ``parallelism``
    is the process's CPU time over the wall time (how many cores actually hashed at once)."""
    rows = []
    for t in threads:
        step = len(data) // t
        parts = [memoryview(data)[i * step : (i + 1) * step] for i in range(t)]
        walls, cpus = [], []
        with ThreadPoolExecutor(t) as pool:
            for _ in range(repeats):
                w, c = time.perf_counter(), time.process_time()
                list(pool.map(lambda p: hashlib.sha256(p).digest(), parts))
                walls.append(time.perf_counter() - w)
                cpus.append(time.process_time() - c)
        wall = statistics.median(walls)
        rows.append(
            {
                "threads": t,
                "parts": t,
                "aggregate_mb_s": step * t / wall / MB,
                "parallelism": statistics.median(c / w for c, w in zip(cpus, walls, strict=True)),
            }
        )
    return rows


def real_delta(elements: int, density: float, seed: int = 0) -> tuple[bytes, int]:
    """A compact delta of a random bf16 state: (its bytes, changed elements)."""
    import torch

    from deltarl.weightsync.codec.formats import encode_delta
    from deltarl.weightsync.delta import compute_delta

    g = torch.Generator().manual_seed(seed)
    rows = 4096
    old = {"w": (torch.randn(rows, elements // rows, generator=g) * 0.02).to(torch.bfloat16)}
    bits = old["w"].view(torch.int16).clone()
    mask = torch.rand(bits.shape, generator=g) < density
    # mostly one ULP, like an AdamW step in bf16; a few larger moves
    step = torch.where(torch.rand(bits.shape, generator=g) < 0.9, 1, 2).to(torch.int16)
    step = torch.where(torch.rand(bits.shape, generator=g) < 0.5, step, -step)
    bits[mask] += step[mask]
    new = {"w": bits.view(torch.bfloat16)}
    delta = compute_delta(old, new, 0, 1)
    return encode_delta(delta, old, "compact"), delta.changed


def fetch_cost(blob: bytes, repeats: int) -> dict[str, float]:
    """Seconds to fetch ``blob`` from a local bucket through BucketReader.fetch, with and
    without its SHA-256 recorded in the manifest (the file is in the page cache)."""
    import torch

    from deltarl.buckets.local import LocalBucket
    from deltarl.weightsync.digest import state_digest
    from deltarl.weightsync.reader import BucketReader
    from deltarl.weightsync.writer import BucketWriter, NewObject

    with tempfile.TemporaryDirectory() as tmp:
        bucket = LocalBucket(Path(tmp))
        state = {"w": torch.zeros(1)}
        writer = BucketWriter(bucket, anchor_every=0, sha256=True)
        t = time.perf_counter()
        m = writer.publish(
            0,
            [NewObject("anchor", "safetensors", blob)],
            state_digest=state_digest(state),
            numel=1,
            full_bytes=2,
        )
        publish_s = time.perf_counter() - t
        ref = m.objects[0]
        bare = ref.model_copy(update={"sha256": None})
        reader = BucketReader(bucket)
        reader.fetch(ref)  # warm the page cache
        return {
            "publish_with_sha256_s": publish_s,
            "fetch_xxh3_only_s": median_s(lambda: reader.fetch(bare), repeats),
            "fetch_xxh3_and_sha256_s": median_s(lambda: reader.fetch(ref), repeats),
        }


def delta_rows(args: argparse.Namespace) -> dict[str, Any]:
    """The real compact delta: its size, SHA-256 time and fetch cost (printed as well)."""
    t = time.perf_counter()
    blob, changed = real_delta(args.elements, args.density)
    encode_s = time.perf_counter() - t
    row: dict[str, Any] = {
        "elements": args.elements,
        "changed": changed,
        "bytes": len(blob),
        "bits_per_changed": 8 * len(blob) / changed,
        "encode_s": encode_s,
        "sha256_s": median_s(lambda: hashlib.sha256(blob).digest(), args.repeats),
        **fetch_cost(blob, args.repeats),
    }
    print(
        f"compact delta: {args.elements} elements, {changed} changed "
        f"({changed / args.elements:.2%}), {len(blob) / MB:.2f} MB, "
        f"{row['bits_per_changed']:.2f} bits per changed element; SHA-256 "
        f"{row['sha256_s'] * 1e3:.1f} ms; fetch from a local bucket "
        f"{row['fetch_xxh3_only_s'] * 1e3:.1f} ms (xxh3) vs "
        f"{row['fetch_xxh3_and_sha256_s'] * 1e3:.1f} ms (xxh3 + SHA-256)"
    )
    return row


def extrapolate(
    sha_mb_s: float, parts: list[dict[str, Any]], density: float, bits: float | None
) -> dict[str, float]:
    """7B-class costs from the measured SHA-256 throughput (printed as well)."""
    sha = sha_mb_s * MB  # bytes per second, one core
    changed = PARAMS_7B * density
    anchor = PARAMS_7B * 2
    best = max(parts, key=lambda r: r["aggregate_mb_s"])
    out = {
        "delta_7b_1.3_bytes_per_changed_bytes": changed * 1.3,
        "delta_7b_1.3_bytes_per_changed_sha256_s": changed * 1.3 / sha,
        "anchor_7b_bf16_bytes": anchor,
        "anchor_7b_bf16_sha256_one_core_s": anchor / sha,
        "anchor_7b_bf16_sha256_best_parts_here_s": anchor / (best["aggregate_mb_s"] * MB),
        "anchor_7b_bf16_sha256_8_parts_8_free_cores_s": anchor / sha / 8,
    }
    if bits is not None:
        out["delta_7b_measured_bits_bytes"] = changed * bits / 8
        out["delta_7b_measured_bits_sha256_s"] = changed * bits / 8 / sha
    print(
        f"7B delta at {density:.0%} and 1.3 B per changed element: {changed * 1.3 / MB:.0f} MB, "
        f"SHA-256 {changed * 1.3 / sha * 1e3:.0f} ms on one core"
    )
    print(
        f"7B bf16 anchor ({anchor / 1e9:.0f} GB): SHA-256 {anchor / sha:.1f} s on one core, "
        f"{out['anchor_7b_bf16_sha256_best_parts_here_s']:.1f} s as {best['parts']} parts here"
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB hashed per throughput run")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", default=None, help="thread counts, e.g. 1,2,4 (default 1..cores)")
    ap.add_argument("--elements", type=int, default=1 << 27, help="elements of the delta's state")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--no-delta", action="store_true", help="hash throughput only (no torch)")
    ap.add_argument("--json", type=Path, default=None, help="default: see the docstring")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    threads = (
        [int(t) for t in args.threads.split(",")] if args.threads else list(range(1, cores + 1))
    )

    data = os.urandom(args.mib << 20)
    speed = per_core(data, args.repeats)
    for name, mb_s in speed.items():
        print(f"{name:>9}: {mb_s:8.0f} MB/s on one core")
    parts = parallel_parts(data, args.repeats, threads)
    for row in parts:
        print(
            f"sha256, {row['parts']} part(s) on {row['threads']} thread(s): "
            f"{row['aggregate_mb_s']:.0f} MB/s in all ({row['parallelism']:.2f} cores busy)"
        )
    delta = None if args.no_delta else delta_rows(args)
    bits = None if delta is None else delta["bits_per_changed"]
    result = {
        "meta": meta(
            cores=cores,
            load_average=os.getloadavg(),
            openssl=ssl.OPENSSL_VERSION,
            xxhash=XXHASH_VERSION,
            mib=args.mib,
            repeats=args.repeats,
        ),
        "per_core_mb_s": speed,
        "sha256_parallel_parts": parts,
        "compact_delta": delta,
        "extrapolated": extrapolate(speed["sha256"], parts, args.density, bits),
    }
    write_json(args.json or result_path("object_hash", cpu_tag(cores), f"{args.mib}mib"), result)


if __name__ == "__main__":
    main()
