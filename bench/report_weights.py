"""The sections of docs/benchmarks.md on moving weights: the codec (CPU and GPU), fp8 versions,
the device scan and the encoder, a rollout worker's sync, FSDP2 publication, mixture of experts."""

from __future__ import annotations

import statistics
from typing import Any

from report_format import (
    MODELS,
    Lines,
    Result,
    gb,
    hardware_words,
    label,
    lr,
    mb,
    mean_spread,
    num,
    pct,
    pct_range,
    spread,
    table,
)

GAPS = "standalone, positions as gaps"


def _variant_values(steps: list[dict[str, Any]], key: str) -> list[tuple[Any, ...]]:
    """The codec table's columns for the steps' other coding ``key`` (chained, gaps)."""
    return [
        (
            v["bits_per_changed"],
            v["vs_conditional_floor"],
            v["smaller_than_trl_gap"],
            v["time_s"]["encode"],
            v["time_s"]["decode_apply_verify"],
        )
        for s in steps
        if (v := s.get(key))
    ]


def codec(results: list[Result]) -> Lines:
    rows = []
    for r in results:
        every: dict[str, list[dict[str, Any]]] = {"standalone": [], "chained": [], GAPS: []}
        for rate, steps in r.data["results"].items():
            later = steps[1:]  # step 1 is Adam's warm-up step
            stand = [
                (
                    s["bits_per_changed"]["compact"],
                    s["vs_conditional_floor"],
                    s["smaller_than_trl_gap"],
                    s["time_s"]["compute_and_encode"],
                    s["time_s"]["decode_apply_verify"],
                )
                for s in later
            ]
            chain = _variant_values(later, "chained")
            by_gaps = _variant_values(later, "gaps")
            density = pct_range([s["density"] for s in later])
            for kind, values in (("standalone", stand), ("chained", chain), (GAPS, by_gaps)):
                if not values:
                    continue
                every[kind] += values  # type: ignore[arg-type]
                rows.append(
                    codec_row(
                        f"{MODELS.get(r.model, r.model)}, lr {lr(rate)}",
                        kind,
                        f"{len(values)}, {density}",
                        values,
                    )
                )
        for kind, values in every.items():
            if values and len(r.data["results"]) > 1:
                rows.append(codec_row("**all**", f"**{kind}**", str(len(values)), values))
    header = [
        "deltas",
        "kind",
        "steps, density",
        "bits per changed element",
        "x conditional floor",
        "x smaller than TRL gap_delta",
        "encode s",
        "decode + apply + verify s",
    ]
    return table(
        header,
        rows,
        after=(
            "Steps after the first (Adam's warm-up step). *Chained*: the delta coded against the "
            "step before, what a worker that applied the previous version downloads; *standalone*: "
            "the delta alone, for a worker after an anchor or a restart; *positions as gaps*: the "
            'standalone delta with `publish.positions = "gaps"` (the default from 16 G elements '
            "on), whose decoder reads only the changed elements instead of walking every one. The "
            "conditional floor is the empirical entropy of the change mask and value differences "
            "given the tensor and the old exponent."
        ),
    )


def codec_row(name: str, kind: str, steps: str, values: list[Any]) -> list[str]:
    cols = list(zip(*values, strict=True))
    return [
        name,
        kind,
        steps,
        spread(cols[0]),
        spread(cols[1], 3),
        mean_spread(cols[2]),
        spread(cols[3]),
        spread(cols[4]),
    ]


def fp8(results: list[Result]) -> Lines:
    rows = []
    for r in results:
        side = r.data["meta"].get("block", [128, 128])[0]
        for rate, entries in r.data["results"].items():
            steps = [s for s in entries if "step" in s]
            ratio = [
                s["bf16_quantized_tensors"]["density"] / s["fp8_values_only"]["density"]
                for s in steps
            ]
            nbytes = [
                s["bf16_quantized_tensors"]["bytes"] / s["fp8_quantized_tensors"]["bytes"]
                for s in steps
            ]
            whole = [s["bf16"]["bytes"] / s["fp8_version"]["bytes"] for s in steps]
            one = [s["fp8_values_only"]["share_one_step"] for s in steps]
            scales = sum(s["scales"]["changed"] for s in steps)
            total = steps[0]["scales"]["total"]
            rows.append(
                [
                    f"{MODELS.get(r.model.removesuffix(f'-block{side}'), r.model)}, lr {lr(rate)}",
                    f"{side} x {side}",
                    str(len(steps)),
                    pct_range([s["bf16_quantized_tensors"]["density"] for s in steps]),
                    pct_range([s["fp8_values_only"]["density"] for s in steps], 3),
                    spread(ratio, 1),
                    spread(one, 1, 100) + "%",
                    spread(nbytes, 1),
                    spread(whole, 2),
                    f"{scales} of {total:,} in {len(steps)} steps",
                ]
            )
    header = [
        "deltas",
        "fp8 blocks",
        "steps",
        "bf16 values changed",
        "e4m3 bytes changed",
        "x fewer changes",
        "changes of one e4m3 step",
        "x smaller delta (quantized tensors)",
        "x smaller whole version",
        "block scales changed",
    ]
    return table(
        header,
        rows,
        after=(
            "Per step, including Adam's warm-up step: the quantized tensors (the linear layers, in "
            "e4m3 with one float32 scale per block) against the same tensors in bf16; the whole "
            "version also holds the tensors that stay bf16 (embeddings, norms). SmolLM2-135M's "
            "widths are not whole 128-row blocks: vLLM serves it in 64 x 64 blocks only."
        ),
    )


def codec_gpu(results: list[Result]) -> Lines:
    rows = []
    for r in results:
        s = r.data["rows"]
        rows += [
            [label(r), "density", pct_range([x["density"] for x in s])],
            [label(r), "bits per changed element", spread(x["bits_per_changed"] for x in s)],
            [
                label(r),
                "x conditional floor",
                spread((x["bits_per_changed"] / x["conditional_floor_bits"] for x in s), 3),
            ],
            [
                label(r),
                "x smaller than TRL gap_delta",
                spread(x["trl_gap_bytes"] / x["compact_bytes"] for x in s),
            ],
            [
                label(r),
                "detect + extract on the GPU, ms",
                spread((x["detect_extract_s"] for x in s), 0, 1e3),
            ],
            [label(r), "encode, ms (host)", spread((x["encode_s"] for x in s), 0, 1e3)],
            [label(r), "decode, ms (host)", spread((x["decode_s"] for x in s), 0, 1e3)],
            [label(r), "stage (host to device), ms", spread((x["stage_h2d_s"] for x in s), 0, 1e3)],
            [
                label(r),
                "**paused apply, p50 / p99 ms**",
                f"{spread(x['apply_p50_ms'] for x in s)} / {spread(x['apply_p99_ms'] for x in s)}",
            ],
            [
                label(r),
                "verify (digests of every weight), ms",
                spread((x["verify_s"] for x in s), 0, 1e3),
            ],
        ]
    return table(
        ["deltas", f"per step ({len(results[0].data['rows'])} steps)", "median [min-max]"], rows
    )


def device_scan(results: list[Result]) -> Lines:
    rows = []
    for r in results:
        x = r.data["summary"]
        times = {k.removesuffix("_s_median"): v for k, v in x.items() if k.endswith("_s_median")}
        rows.append(
            [
                label(r),
                f"{x['tensors']}, {x['elements'] / 1e9:.2f} B",
                pct(x["moved"], 0),
                ", ".join(f"{k.replace('_', ' ')} {num(v)}" for k, v in times.items()),
            ]
        )
    return table(
        ["rows of", "tensors, elements", "moved", "seconds, median after a warm-up"],
        rows,
        after=(
            "The change detection and the encoder's context scans of one FSDP rank's rows on "
            "its GPU: *queued* starts every tensor's scan, then collects them (what the "
            "publisher does); *one by one* waits for each."
        ),
    )


def encode_rank(results: list[Result]) -> Lines:
    rows = []
    for r in results:
        x = r.data["summary"]
        for key, value in x.items():
            if key.startswith("encode_s_median_"):
                threads = key.removeprefix("encode_s_median_").removesuffix("_threads")
                rows.append([label(r), f"{x.get('changed', 0):,}", threads, num(value)])
    return table(
        ["rows of", "changed elements", "threads", "encode s (median)"],
        rows,
        after=("The compact encoder on one FSDP rank's delta from precomputed scans, on the CPU."),
    )


def decode_host(results: list[Result]) -> Lines:
    rows = []
    for r in results:
        st = r.data["meta"].get("settings", {})
        out = "pinned" if st.get("pinned") == "True" else "fresh"
        for key, x in r.data["results"].items():
            mode, _, busy = key.partition("+")
            rows.append(
                [
                    label(r),
                    f"{r.data['changed']:,} of {r.data['numel'] / 1e9:.1f} B",
                    mode.replace("/", ", ") + " threads",
                    "next to a busy Python thread" if busy else "alone",
                    out,
                    num(x["decode_s"]["median"]),
                    num(x["ns_per_change"], 1),
                    num(x.get("thread_ns_per_change"), 0),
                ]
            )
    return table(
        [
            "host",
            "changes",
            "positions, threads",
            "beside",
            "outputs",
            "decode s (median)",
            "ns per change",
            "thread-ns per change",
        ],
        rows,
        after=(
            "The compact decoder on the host, positions as gaps: one delta of `--elements` bf16 "
            "elements, 1% moved by one ULP, decoded against its base; outputs pinned as a GPU "
            "worker's (`decode_compact(pinned=True)`) or freshly allocated. Thread-ns: the "
            "median times the threads, per change (flat when the threads scale)."
        ),
    )


def rollout_sync(results: list[Result]) -> Lines:
    rows = []
    for r in results:
        d = r.data
        chained = d.get("chained_steps")
        rows.append(
            [
                label(r),
                f"{d['versions']}" + (f" ({chained} chained)" if chained is not None else ""),
                f"{num(d['pause_ms']['p50'])} / {num(d['pause_ms']['max'])}",
                num(d["wait_for_step_ms"]["p50"], 1),
                num(d["decode_s"]["p50"]),
                f"{num(d['publish_to_applied_s']['p50'])} / {num(d['publish_to_applied_s']['max'])}",
                num(d["verify_s"]["p50"]),
                mb(statistics.median(d["delta_bytes"])),
                num(d["tokens_per_s"]["while_syncing"], 0),
                "yes" if d.get("bit_identical") else "no",
            ]
        )
    header = [
        "model, hardware",
        "versions",
        "paused per sync p50 / max ms",
        "wait for the forward in flight p50 ms",
        "decode p50 s",
        "publish to applied p50 / max s",
        "verify p50 s",
        "delta p50",
        "tokens/s while syncing",
        "bit-identical at the end",
    ]
    return table(
        header,
        rows,
        after=(
            "The transformers engine generates continuously (the tokens/s column) while the worker "
            "downloads, decodes and stages each version in the background; only the in-place apply "
            "pauses generation. Trainer and worker share the machine and a local-directory bucket."
        ),
    )


PRESETS = {"0.6b": "Qwen3-0.6B", "1.7b": "Qwen3-1.7B", "7b": "Qwen2.5-7B", "14b": "Qwen2.5-14B"}


def fsdp_publish(results: list[Result]) -> Lines:
    both = [r for r in results if any("fp8" in s for s in r.data)]
    out = _fsdp_bf16([r for r in results if r not in both])
    return out + ([""] if out and both else []) + (_fsdp_fp8(both) if both else [])


def _fsdp_fp8(results: list[Result]) -> Lines:
    """Runs with ``--fp8``: each step published in bf16 and in block fp8, side by side."""
    rows = []
    for r in results:
        steps = [s for s in r.data if "step" in s]
        block = next((s["fp8"]["block"] for s in r.data if s.get("summary")), None)
        size = (
            f"{PRESETS.get(r.model.split('-')[0], r.model)} shape ({steps[0]['numel'] / 1e9:.2f} B)"
        )
        for name, lines in (
            ("bf16", steps),
            (f"fp8, {block} x {block} blocks", [s["fp8"] for s in steps]),
        ):
            rows.append(
                [
                    size,
                    hardware_words(r.hardware),
                    name,
                    pct_range([x["changed_fraction"] for x in lines], 2),
                    spread((x["bits_per_changed"] for x in lines), 2),
                    spread((x["bytes"] for x in lines), 1, 1e-6) + " MB",
                    f"{spread(x['publish_s'] for x in lines[1:])} ({len(lines) - 1} steps)",
                    gb(max(max(x["memory_bytes"]) for x in lines)),
                ]
            )
    ratios = [
        s["bytes"] / s["fp8"]["bytes"]
        for r in results
        for s in r.data
        if "fp8" in s and "step" in s
    ]
    header = [
        "model",
        "GPUs",
        "version",
        "changed per step",
        "bits per changed element",
        "delta per step",
        "publish per step after the first, s",
        "publication memory per rank",
    ]
    return table(
        header,
        rows,
        after=(
            "The same optimizer steps published twice, in bf16 and in block fp8 (`publish.fp8`: "
            "every rank quantizes its rows on its GPU, the block scales from one all-reduce of "
            "the ranks' amax grids), alternating which goes first. Changed per step counts the "
            "version's elements (fp8: e4m3 values, block scales and the tensors kept in bf16). "
            f"The bf16 delta is {spread(ratios, 1)} times the fp8 one's bytes (median [range] over "
            "steps). Random init, AdamW at lr 1e-6, one 512-token sequence per rank and step."
        ),
    )


def _fsdp_bf16(results: list[Result]) -> Lines:
    rows = []
    for r in results:
        steps = [s for s in r.data if "step" in s]
        summary = next((s for s in r.data if s.get("summary")), {})
        after = [s["publish_s"] for s in steps[1:]]
        apply = "-"
        if "paused_apply_s" in summary:
            apply = (
                f"{num(1e3 * summary['paused_apply_s'])} ms / "
                f"{num(summary['publish_to_applied_s'])} s"
            )
        rows.append(
            [
                f"{PRESETS.get(r.model, r.model)} shape ({steps[0]['numel'] / 1e9:.2f} B)",
                hardware_words(r.hardware),
                f"**{spread(after)}** ({len(after)} steps)",
                num(steps[0]["publish_s"]),
                pct_range([s["changed_fraction"] for s in steps], 1),
                spread((s["bits_per_changed"] for s in steps), 2),
                f"{gb(summary.get('memory_bytes_max_rank'))} / "
                f"{gb(summary.get('host_memory_bytes_max_rank'))}",
                gb(summary.get("peak_gpu_bytes_max_rank")),
                apply,
            ]
        )
    header = [
        "model",
        "GPUs",
        "publish per step after the first, s",
        "first step s",
        "changed per step",
        "bits per changed element",
        "publication memory per rank: GPU / pinned host",
        "training peak per GPU",
        "paused apply on a rollout GPU / publish to applied",
    ]
    return table(
        header,
        rows,
        after=(
            "Random init, AdamW at lr 1e-6, one 512-token sequence per rank and step, the same seeds "
            "on every machine (each step changes the same elements). Publish: every rank's change "
            "detection and context scan on its GPU, compact encode on the host, upload to a "
            "local-directory bucket, then the manifest; the first step's delta follows the anchor."
        ),
    )


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [a[key] for a in rows if isinstance(a.get(key), int | float)]
    return statistics.median(vals) if vals else None


POSITION_WORDS = {"contexts": "positions by context rank", "gaps": "positions as gaps"}


def _moe_row(
    r: Result,
    name: str,
    steps: list[dict[str, Any]],
    applies: list[dict[str, Any]],
    timed: list[dict[str, Any]] | None = None,
) -> list[str]:
    """One row of the MoE table from ``steps`` (published; ``timed``: those whose publish time
    counts, default all) and ``applies`` (followed)."""
    pauses = [a["paused_apply_s"] for a in applies]
    return [
        name,
        f"{r.data['summary']['numel'] / 1e9:.2f} B",
        spread(x["publish_s"] for x in (steps if timed is None else timed)),
        mb(statistics.median(x["bytes"] for x in steps)),
        pct(statistics.median(x["changed_fraction"] for x in steps), 2),
        num(statistics.median(x["bits_per_changed"] for x in steps)),
        r.data["settings"].get("engine", "-"),
        f"{num(1e3 * statistics.median(pauses))} / {num(1e3 * max(pauses))}" if pauses else "-",
        num(_median(applies, "fetch_to_applied_s")),
        num(_median(applies, "decode_s")),
        num(_median(applies, "verify_s")),
        num(_median(applies, "publish_to_applied_s")),
    ]


def moe_scale(results: list[Result]) -> Lines:
    rows = []
    # an extrapolation to the whole model is shown only while the whole model is not measured
    whole = any(r.data["settings"]["layers"] == 48 for r in results)
    fp8_names = any(r.data["settings"].get("fp8") for r in results)
    for r in results:
        s, st = r.data["summary"], r.data["settings"]
        name = (
            f"{st['layers']} layers, {st['ranks']} ranks, {hardware_words(r.hardware)}"
            + (", **block fp8**" if st.get("fp8") else "")
            + (", decoded in a child process" if st.get("decode_process") else "")
        )
        steps = r.data["publish"]["steps"]
        applies = (r.data.get("apply") or {}).get("applies") or []
        if "by_positions" in s:  # both codings, interleaved: a row each, the first version out
            for mode, m in s["by_positions"].items():
                versions = [v for v in m["versions"] if v > 1]
                rows.append(
                    _moe_row(
                        r,
                        f"{name}, {POSITION_WORDS[mode]} (versions {', '.join(map(str, versions))})",
                        [x for x in steps if x["step"] in versions],
                        [a for a in applies if a["version"] in versions],
                    )
                )
            continue
        rows.append(_moe_row(r, name, steps, applies, steps[1:] or steps))
        x = s.get("extrapolated_to_48_layers")
        if x and not whole:
            rows.append(
                [
                    "scaled to 48 layers (extrapolated, not measured)",
                    f"{x['numel'] / 1e9:.2f} B",
                    num(x["publish_s_median_after_first"]),
                    mb(x["bytes_median"]),
                    "",
                    "",
                    "",
                    num(1e3 * x["paused_apply_s_median"]) if "paused_apply_s_median" in x else "-",
                    num(x.get("fetch_to_applied_s_median")),
                    "",
                    "",
                    num(x.get("publish_to_applied_s_median")),
                ]
            )
    header = [
        "Qwen3-30B-A3B layer shapes",
        "elements",
        "publish per step after the first, s",
        "delta",
        "changed",
        "bits per changed element",
        "follower",
        "paused apply median / max ms",
        "fetch to applied s",
        "of which decode s",
        "verify after resuming s",
        "publish to applied s",
    ]
    after = ""
    if fp8_names:
        after = (
            "Block fp8 rows: the ranks quantize their experts' rows to e4m3 with one float32 scale "
            "per 128 x 128 block (`publish.fp8`) and vLLM serves the experts in fp8 through its "
            "fused MoE's block-fp8 path; elements count the e4m3 values, the scales and the "
            "tensors kept in bf16 (the router, norms, embeddings)."
        )
    return table(header, rows, after=after)


def moe_sparsity(results: list[Result]) -> Lines:
    rows = []
    for r in results:
        tokens = r.data.get("tokens_per_step")
        for run in r.data["runs"]:
            s = run["summary"]
            groups = s["changed_fraction_by_group_mean"]
            experts = s.get("experts")
            idle = "-"
            if experts:
                idle = (
                    f"{pct(experts['no_token_this_step_but_before']['changed_fraction_mean'], 2)}"
                    f" / {pct(experts['routed']['changed_fraction_mean'], 2)}"
                )
            rows.append(
                [
                    f"{run['model']}, {tokens} tokens",
                    lr(run["lr"]),
                    f"{run['parameters'] / 1e6:.1f} M ({run['active_parameters_per_token'] / 1e6:.1f} M)",
                    spread(s["changed_fraction_by_step"], 2, 100) + "%",
                    pct(groups.get("experts", groups.get("mlp")), 2),
                    idle,
                    num(s["bits_per_changed_mean"]),
                ]
            )
    header = [
        "model, tokens per step",
        "lr",
        "parameters (active per token)",
        "changed per step",
        "experts (MoE) / MLP (dense) changed",
        "expert with no token this step / routed",
        "bits per changed element",
    ]
    return table(
        header,
        rows,
        after=(
            "A random-init Qwen3-MoE-shaped model (6 layers, 64 experts, top-4) and a dense Qwen3 of "
            "the same active size, the same real AdamW steps on real text, 12 steps per run. An "
            "expert that got no token in a step still changes (AdamW's momentum); experts never "
            "routed do not."
        ),
    )


def digest(results: list[Result]) -> Lines:
    rows = []
    for r in results:
        d, st = r.data, r.data["settings"]
        ways = d["ways"]
        rows.append(
            [
                hardware_words(r.hardware),
                f"{st['tensors']} x [{st['shape'].replace(',', ', ')}] bf16 on {st['device']}",
                f"{d['bytes'] / 1e9:.1f} GB",
                f"{spread(ways['one_at_a_time']['seconds'])} "
                f"({num(ways['one_at_a_time']['gb_per_s_median'], 1)} GB/s)",
                f"{spread(ways['threads']['seconds'])} "
                f"({num(ways['threads']['gb_per_s_median'], 1)} GB/s), {st['threads']} threads",
            ]
        )
    header = ["machine", "tensors", "bytes", "one at a time, s", "on threads, s"]
    return table(
        header,
        rows,
        after=(
            "Both ways give the same digests, and the CPU copy's. The first threaded pass "
            "includes pinning each thread's two staging buffers."
        ),
    )
