"""The compact decoder on a large synthetic delta, on the host's cores: positions coded by context
rank (the decoder walks every element of a changed chunk) against positions coded as gaps (it
reads only the changed elements), with and without a busy Python thread beside it (a rollout
worker's engine thread, which the decoder's threads share the GIL with).

The state is ``--tensors`` bf16 tensors of ``--elements`` elements in all, normal with std 0.02;
``--density`` of the elements move by one ULP (uniformly at random: no exponent signal, so both
codings come out about the same size here; on real steps gaps cost ~1.5x the bytes,
see ``codec_bench.py``). Each delta is encoded once; then the decodes run interleaved, ``--rounds``
times each, the first round dropped (it compiles the kernels). Reported: median, min and max
seconds per decode, nanoseconds per element and per change, and thread-nanoseconds per change
(the median times the threads: flat while the threads scale).

``--threads`` takes several counts, decoded interleaved; ``--modes`` picks the codings (both
by default), ``--no-busy`` leaves the busy thread out, and ``--pinned`` decodes into pinned
change buffers as a rollout worker on a GPU does (``decode_compact(pinned=True)``; without
CUDA they fall back to pageable memory).

With ``--parts N`` the tensors are split among N parts, each its own object (as the ranks of
an FSDP2 trainer publish a sharded version), and positions are coded as gaps only: the parts
decoded one after another (each on its own pool of ``--threads``) against all at once on one
pool, as a rollout worker decodes them, interleaved in the same way.

Usage::

    python bench/decode_host_bench.py --elements 4e9 --tensors 128 --modes gaps \
        --threads 1 4 8 16 32 --rounds 3 --no-busy --pinned       # scaling on a GPU host
    python bench/decode_host_bench.py --elements 1e8 --threads 2    # a laptop
    python bench/decode_host_bench.py --elements 2e8 --tensors 600 --parts 4 --threads 2
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from common import meta, write_json

from deltarl.weightsync import compute_delta, state_digests
from deltarl.weightsync.codec.compact import decode_compact, encode_compact

MODES = ("contexts", "gaps")
PART_MODES = ("one after another", "at once")


def decode_parts(
    parts: list[bytes],
    bases: list[tuple[dict, dict]],
    threads: int,
    at_once: bool,
    pinned: bool = False,
) -> None:
    """Decode every part: one after another, each on a pool of ``threads``, or all at once
    (a thread each) on one shared pool of ``threads``, as ``WeightSync`` does."""
    if not at_once:
        for data, (base, digests) in zip(parts, bases, strict=True):
            decode_compact(data, base, base_digests=digests, threads=threads, pinned=pinned)
        return
    with ThreadPoolExecutor(threads) as pool, ThreadPoolExecutor(len(parts)) as starters:
        jobs = [
            starters.submit(
                decode_compact,
                data,
                base,
                base_digests=digests,
                threads=threads,
                pool=pool,
                pinned=pinned,
            )
            for data, (base, digests) in zip(parts, bases, strict=True)
        ]
        for job in jobs:
            job.result()


def make_state(elements: int, tensors: int, density: float) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(0)
    per = elements // tensors
    old, new = {}, {}
    for i in range(tensors):
        t = (torch.randn(per, generator=g) * 0.02).bfloat16()
        moved = torch.rand(per, generator=g) < density
        old[f"t{i:03d}"] = t
        new[f"t{i:03d}"] = torch.where(moved, (t.view(torch.int16) + 1).view(torch.bfloat16), t)
    return old, new


class Busy:
    """A thread that runs Python byte code until stopped (holds the GIL whenever it may)."""

    def __init__(self) -> None:
        self.stop = False
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        x = 0
        while not self.stop:
            x += 1

    def __enter__(self) -> Busy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop = True
        self.thread.join()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=float, default=1e8)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--threads", type=int, nargs="+", default=[2], help="interleaved")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--no-busy", dest="busy", action="store_false", help="skip the busy thread")
    ap.add_argument(
        "--pinned",
        action="store_true",
        help="decode into pinned change buffers, as a rollout worker on a GPU does",
    )
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--switch-interval-ms", type=float, default=0.2)
    ap.add_argument("--parts", type=int, default=1, help="objects the tensors are split into")
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    args = ap.parse_args(argv)
    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    t0 = time.perf_counter()
    old, new = make_state(int(args.elements), args.tensors, args.density)
    delta = compute_delta(old, new, 0, 1)
    digests = state_digests(old)
    setup_s = time.perf_counter() - t0
    most = max(args.threads)
    blobs, encode_s = {}, {}
    run: dict[str, Any] = {}
    if args.parts > 1:
        modes = PART_MODES
        names = sorted(old)
        groups = [names[i :: args.parts] for i in range(args.parts)]
        t0 = time.perf_counter()
        parts = [
            encode_compact(
                compute_delta({n: old[n] for n in g}, {n: new[n] for n in g}, 0, 1),
                {n: old[n] for n in g},
                threads=most,
                positions="gaps",
            )
            for g in groups
        ]
        encode_s = dict.fromkeys(modes, time.perf_counter() - t0)
        bases = [({n: old[n] for n in g}, {n: digests[n] for n in g}) for g in groups]
        for mode in modes:
            for n in args.threads:
                run[f"{mode}/{n}"] = functools.partial(
                    decode_parts, parts, bases, n, mode == "at once", args.pinned
                )
        blobs = dict.fromkeys(modes, b"".join(parts))
    else:
        modes = tuple(m for m in MODES if m in args.modes)
        for mode in modes:
            t0 = time.perf_counter()
            blobs[mode] = encode_compact(delta, old, threads=most, positions=mode)
            encode_s[mode] = time.perf_counter() - t0
            for n in args.threads:
                run[f"{mode}/{n}"] = functools.partial(
                    decode_compact,
                    blobs[mode],
                    old,
                    base_digests=digests,
                    threads=n,
                    pinned=args.pinned,
                )
    numel = sum(t.numel() for t in old.values())
    busy_ways = (False, True) if args.busy else (False,)
    times: dict[str, list[float]] = {f"{k}{b}": [] for b in ("", "+busy") for k in run}
    for _ in range(args.rounds):
        for busy in busy_ways:
            for key, decode in run.items():
                with Busy() if busy else _nothing():
                    t0 = time.perf_counter()
                    decode()
                    times[key + ("+busy" if busy else "")].append(time.perf_counter() - t0)
    rows = {}
    for key, ts in times.items():
        if not ts:
            continue
        kept = ts[1:] or ts
        med = statistics.median(kept)
        mode, threads = key.split("+")[0].split("/")
        rows[key] = {
            "threads": int(threads),
            "decode_s": {"median": med, "min": min(kept), "max": max(kept), "all": ts},
            "ns_per_element": med / numel * 1e9,
            "ns_per_change": med / max(delta.changed, 1) * 1e9,
            "thread_ns_per_change": int(threads) * med / max(delta.changed, 1) * 1e9,
            "bytes": len(blobs[mode]),
            "bits_per_changed": 8 * len(blobs[mode]) / max(delta.changed, 1),
            "encode_s": encode_s[mode],
        }
        print(
            f"{key:24s} decode {med:.3f} s [{min(kept):.3f}-{max(kept):.3f}], "
            f"{rows[key]['ns_per_change']:.1f} ns/change "
            f"({rows[key]['thread_ns_per_change']:.0f} thread-ns), "
            f"{rows[key]['bits_per_changed']:.2f} bits",
            flush=True,
        )
    result = {
        "meta": meta(settings={k: str(v) for k, v in vars(args).items()}),
        "numel": numel,
        "changed": delta.changed,
        "setup_s": setup_s,
        "results": rows,
    }
    if args.json is not None:
        write_json(args.json, result)
    return result


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    main()
