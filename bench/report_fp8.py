"""The section of docs/benchmarks.md on the 1T fp8 case (bench/fp8_1t_table.py): an
extrapolation from measured rates, rendered with every input it used."""

from __future__ import annotations

from report_format import Lines, Result, num, table

GIB = 2**30


def fp8_1t(results: list[Result]) -> Lines:
    out: Lines = []
    for r in results:
        d = r.data
        m, a, ref = d["model"], d["inputs"]["assumptions"], d["reference"]
        rows = []
        for row in d["rows"]:
            if "step 1" in row["scenario"]:
                continue
            p, v, ap = row["publish"], row["version"], row["apply"]
            rows.append(
                [
                    row["scenario"],
                    str(row["gpus"]),
                    f"{row['train_state_per_gpu_gib']:,.0f} GiB",
                    f"{num(p['median']['total_s'])} ({num(p['fastest']['total_s'])}-"
                    f"{num(p['slowest']['total_s'])})",
                    f"{num(v['bytes'] / GIB)} GiB",
                    f"{num(v['bf16_bytes'] / GIB)} GiB",
                    num(ap["download_s"], 1),
                    num(ap["decode_s"], 1),
                    num(1e3 * ap["paused_s"], 1),
                    f"{ap['verify_spread_s']:,.0f} ({ap['verify_one_process_s']:,.0f})",
                    num(row["publish_to_applied_s"], 1),
                ]
            )
        first = [x for x in d["rows"] if "step 1" in x["scenario"]]
        worst = max(first, key=lambda x: x["version"]["bytes"]) if first else None
        dens = d["inputs"]["densities"]
        after = (
            f"**Extrapolated, not measured.** Model: Kimi-K2's shape ({m['params'] / 1e12:.3f} T "
            f"parameters, {m['active_params'] / 1e9:.1f} B active, {m['tensors']:,} tensors of "
            f"which {m['quantized_tensors']:,} in e4m3): fp8 state {m['fp8_bytes'] / GIB:,.0f} "
            f"GiB, bf16 {m['bf16_bytes'] / GIB:,.0f} GiB. Densities and bits per changed "
            f"element from `{dens['source']}` (SmolLM2-135M's real steps; a 1T MoE's experts "
            "may change differently); publication rates per rank from "
            + ", ".join(f"`{s['source']}`" for s in d["inputs"]["publish_rates"])
            + " (median, fastest and slowest source); apply rates from "
            f"`{d['inputs']['apply_rates']['source']}` (one vLLM replica on an H200). "
            f"Assumed: a replica of {a['replica_gpus']} GPUs downloading at "
            f"{a['download_gbit_per_s']:g} Gbit/s, the amax all-reduce at "
            f"{a['all_reduce_bus_gbyte_per_s']:g} GB/s, the quantization at {a['quantize']}, "
            f"{a['train_bytes_per_param']} bytes of training state per parameter (fp32 "
            "masters, Adam, gradients: more than an H200's 141 GB below 128 GPUs). Decode is "
            "one process (a replica can decode a sharded version's parts in parallel); verify "
            "hashes every changed tensor after inference resumed, spread over the replica's "
            "GPUs (in one process in brackets). "
        )
        if worst is not None:
            after += (
                f"The first step (Adam's warm-up) is denser: {num(worst['version']['bytes'] / GIB)} "
                f"GiB per version, decode {num(worst['apply']['decode_s'], 0)} s. "
            )
        after += (
            f"Beside it: checkpoint-engine, {ref['checkpoint_engine_s']:g} s "
            f"({ref['checkpoint_engine']}); Fireworks, {ref['fireworks_delta_gib']:g} GiB per "
            f"delta ({ref['fireworks']})."
        )
        out += table(
            [
                "density",
                "trainer GPUs",
                "training state / GPU",
                "publish per step (s)",
                "fp8 version",
                "bf16 delta, same steps",
                "download (s)",
                "decode (s)",
                "paused (ms)",
                "verify (s)",
                "publish to applied (s)",
            ],
            rows,
            after,
        )
    return out
