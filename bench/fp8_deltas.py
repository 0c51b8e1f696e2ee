"""fp8 versions beside bf16 ones on the same REAL SmolLM2-135M AdamW steps (CPU).

For every optimizer step cached by ``bench/real_deltas.py`` (generated on first use), the bf16
state the trainer publishes and its block-fp8 version (``publish.fp8``: every linear weight
quantized to e4m3 with one float32 scale per 128x128 block, or 64x64 with ``--block 64``,
``weightsync/fp8.py``; the tied embedding stays bf16) are diffed against the step before, and reported side by side:

* changed fraction: of the bf16 elements; of the e4m3 elements, and of the *same* tensors in
  bf16 (the quantized ones: apples to apples);
* scale changes: changed block scales out of all, and the e4m3 bytes that changed in those
  blocks;
* bits per changed element and bytes per version: compact standalone and chained (on the step
  before), for the whole version and for the quantized tensors alone (with their scales), with
  the entropy floor given tensor and old exponent (weightsync/stats.py);
* anchor bytes, plain and zstd;
* CPU time of the quantization (the trainer's extra work per version) and of the encode.

Runs on any machine with the ``weights`` and ``model`` extras. Every number goes to
``bench/results/fp8_deltas_cpu<N>_smollm2-135m.json`` (``--json`` for another path), which a rerun
on the same number of cores overwrites.

Usage::

    python bench/fp8_deltas.py --steps 6
    python bench/fp8_deltas.py --steps 6 --block 64
    python bench/fp8_deltas.py --lr 1e-6 --steps 3      # quicker

SmolLM2's hidden size (576) is not a multiple of 128, so vLLM can serve it in block fp8 only in
64 x 64 blocks (``--block 64``, what its fp8 workers serve); 128 x 128 is the layout of larger
models, measured here by the same rule on SmolLM2's tensors (edge blocks included).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import real_deltas  # bench/real_deltas.py (the script's own folder is on sys.path)
import torch
from common import cpu_tag, meta, result_path, write_json

from deltarl.weightsync import DeltaContext, compute_delta, fp8
from deltarl.weightsync.anchor import encode_anchor
from deltarl.weightsync.codec.compact import TRAILER, encode_compact
from deltarl.weightsync.delta import Delta
from deltarl.weightsync.stats import delta_stats


def sub_delta(delta: Delta, names: set[str]) -> Delta:
    return Delta(delta.base_version, delta.version, {n: delta.patches[n] for n in sorted(names)})


def sub_state(state: dict[str, torch.Tensor], names: set[str]) -> dict[str, torch.Tensor]:
    return {n: state[n] for n in names}


def coded(
    delta: Delta,
    base: dict[str, torch.Tensor],
    threads: int,
    context: DeltaContext | None,
) -> dict[str, Any]:
    """Bytes and bits per changed element of ``delta`` (standalone and, with ``context``,
    chained), and its conditional entropy floor."""
    t0 = time.perf_counter()
    blob = encode_compact(delta, base, threads=threads)
    encode_s = time.perf_counter() - t0
    chained = (
        len(encode_compact(delta, base, threads=threads, context=context))
        if context is not None
        else None
    )
    k = max(delta.changed, 1)
    s = delta_stats(delta, base)
    # the footer lists every tensor with its 128-bit result digest: a fixed cost per version
    footer = TRAILER.unpack(blob[-TRAILER.size :])[0] + TRAILER.size
    return {
        "changed": delta.changed,
        "numel": delta.numel,
        "density": delta.density,
        "bytes": len(blob),
        "footer_bytes": footer,
        "chained_bytes": chained,
        "bits_per_changed": 8 * len(blob) / k,
        "bits_per_changed_without_footer": 8 * (len(blob) - footer) / k,
        "chained_bits_per_changed": None if chained is None else 8 * chained / k,
        "conditional_floor_bits": s.conditional_floor_bits,
        "encode_s": encode_s,
    }


def scale_changes(
    delta: Delta, old: dict[str, torch.Tensor], quantized: list[str], side: int
) -> dict:
    """Changed block scales, and the e4m3 bytes that changed inside those blocks."""
    changed = total = bytes_in_changed_blocks = 0
    for name in quantized:
        sp = delta.patches[fp8.scale_name(name)]
        grid = tuple(old[fp8.scale_name(name)].shape)
        total += int(torch.Size(grid).numel())
        changed += sp.changed
        if not sp.changed:
            continue
        rows, cols = old[name].shape[-2:]
        blocks = set(sp.index.tolist())
        idx = torch.from_numpy(delta.patches[name].index)
        lead, rc = idx // (rows * cols), idx % (rows * cols)
        block = (lead * grid[-2] + (rc // cols) // side) * grid[-1] + (rc % cols) // side
        bytes_in_changed_blocks += sum(1 for b in block.tolist() if b in blocks)
    return {"changed": changed, "total": total, "bytes_in_changed_blocks": bytes_in_changed_blocks}


def anchors(state: dict[str, torch.Tensor]) -> dict[str, int]:
    return {
        "plain": len(encode_anchor(state, 0, False)),
        "zstd": len(encode_anchor(state, 0, True)),
    }


def bench_lr(lr: float, steps: int, threads: int, side: int) -> list[dict[str, Any]]:
    states = real_deltas.load_steps(lr)[: steps + 1]
    quantized = sorted(n for n, t in states[0].items() if fp8.is_quantized(n, t.shape, t.dtype))
    qset = set(quantized)
    fp8_names = qset | {fp8.scale_name(n) for n in quantized}
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    block = fp8.block_of(side)
    prev_q = fp8.quantize_state(states[0], block)
    first_quantize_s = time.perf_counter() - t0
    bf16_ctx = fp8_ctx = None
    for step in range(1, len(states)):
        old, new = states[step - 1], states[step]
        t0 = time.perf_counter()
        new_q = fp8.quantize_state(new, block)
        quantize_s = time.perf_counter() - t0
        old_q = prev_q
        d16 = compute_delta(old, new, step - 1, step)
        d8 = compute_delta(old_q, new_q, step - 1, step)
        row: dict[str, Any] = {
            "step": step,
            "quantize_s": quantize_s,
            "bf16": coded(d16, old, threads, bf16_ctx),
            "bf16_quantized_tensors": coded(
                sub_delta(d16, qset), sub_state(old, qset), threads, None
            ),
            "fp8_version": coded(d8, old_q, threads, fp8_ctx),
            "fp8_quantized_tensors": coded(
                sub_delta(d8, fp8_names), sub_state(old_q, fp8_names), threads, None
            ),
            "fp8_values_only": {
                "changed": sum(d8.patches[n].changed for n in quantized),
                "numel": sum(d8.patches[n].numel for n in quantized),
            },
            "scales": scale_changes(d8, old_q, quantized, side),
        }
        v = row["fp8_values_only"]
        v["density"] = v["changed"] / v["numel"]
        steps_pm1 = 0
        for n in quantized:
            p = d8.patches[n]
            if p.changed:
                oldb = old_q[n].reshape(-1).view(torch.int8)[torch.from_numpy(p.index)]
                d = torch.from_numpy(p.value).to(torch.int16) - oldb.to(torch.int16)
                steps_pm1 += int((d.abs() == 1).sum())
        v["share_one_step"] = steps_pm1 / max(v["changed"], 1)
        bf16_ctx = DeltaContext.of(d16, old)
        fp8_ctx = DeltaContext.of(d8, old_q)
        prev_q = new_q
        rows.append(row)
        b, f = row["bf16"], row["fp8_version"]
        bq, fq = row["bf16_quantized_tensors"], row["fp8_quantized_tensors"]
        print(
            f"lr={lr:.0e} step {step}: bf16 {b['density'] * 100:.3f}% {b['bytes']:,} B "
            f"({b['bits_per_changed']:.2f} b/chg) | fp8 version {f['bytes']:,} B "
            f"| quantized tensors: bf16 {bq['density'] * 100:.3f}% {bq['bytes']:,} B, "
            f"e4m3 {v['density'] * 100:.3f}% {fq['bytes']:,} B ({fq['bits_per_changed']:.2f} "
            f"b/chg; {fq['bits_per_changed_without_footer']:.2f} without the "
            f"{fq['footer_bytes']:,} B footer; floor {fq['conditional_floor_bits']:.2f}) | scales "
            f"{row['scales']['changed']}/{row['scales']['total']} | quantize {quantize_s:.2f} s",
            flush=True,
        )
    rows[0]["first_quantize_s"] = first_quantize_s
    last, last_q = states[len(states) - 1], prev_q
    rows.append(
        {
            "anchor_bytes": {
                "bf16": anchors(last),
                "fp8_version": anchors(last_q),
                "bf16_quantized_tensors": anchors(sub_state(last, qset)),
                "fp8_quantized_tensors": anchors(sub_state(last_q, fp8_names)),
            },
            "quantized_tensors": len(quantized),
            "quantized_elements": sum(last[n].numel() for n in quantized),
            "elements": sum(t.numel() for t in last.values()),
        }
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lr", type=float, action="append", help="learning rate (repeatable)")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per learning rate")
    ap.add_argument("--threads", type=int, default=2, help="codec threads")
    ap.add_argument(
        "--block", type=int, choices=fp8.BLOCK_SIDES, default=128, help="side of the fp8 blocks"
    )
    ap.add_argument(
        "--json",
        type=Path,
        help="default: bench/results/fp8_deltas_cpu<N>_smollm2-135m[-block64].json",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lrs = args.lr or [1e-6, 3e-6]
    for lr in lrs:
        try:
            real_deltas.step_paths(lr)
        except FileNotFoundError:
            real_deltas.train(lr, args.steps, real_deltas.DEFAULT_OUT, 4, 256, 0, 0.0)
    results = {f"{lr:.0e}": bench_lr(lr, args.steps, args.threads, args.block) for lr in lrs}
    about = meta(model="SmolLM2-135M-Instruct (GGUF Q4_1 dequantized), AdamW, fp32 masters")
    about["block"] = [args.block, args.block]
    name = "smollm2-135m" + ("" if args.block == 128 else f"-block{args.block}")
    out = args.json or result_path("fp8_deltas", cpu_tag(), name)
    write_json(out, {"meta": about, "results": results})


if __name__ == "__main__":
    main()
