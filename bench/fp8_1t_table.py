"""The 1T case made concrete: a Kimi-K2-shaped model in block fp8, published by FSDP2 ranks and
applied by rollout replicas, **extrapolated** from measured rates (nothing here ran at 1T).

    python bench/fp8_1t_table.py            # prints the tables, writes the result JSON

The inputs are named result files (``--densities``, ``--publish``, ``--apply``; the defaults are
the committed result's), so a rerun computes the same table until they are changed on purpose.

Inputs, each named in the result:

* the model: Kimi-K2's public ``config.json`` (moonshotai/Kimi-K2-Instruct, DeepSeek-V3
  architecture: 61 layers, the first dense, 384 routed experts + 1 shared, top-8, hidden 7168,
  MoE intermediate 2048, dense intermediate 18432, MLA attention with 64 heads, q LoRA rank
  1536, kv LoRA rank 512, vocabulary 163840, untied head), expanded into the Hugging Face
  tensors and sized with deltarl's own fp8 rule (``weightsync/fp8.py``: which tensors are
  e4m3, their scales, what stays bf16);
* fp8 densities and bits per changed element: bench/results/fp8_deltas_*.json (real SmolLM2
  AdamW steps, lr 1e-6: one small dense model; the MoE experts of a 1T model may change
  differently);
* per-rank publication rates: bench/results/fsdp_publish_*.jsonl (FSDP2 ranks on H100/H200s,
  bf16 versions) and moe_scale_*.json (Qwen3-30B-A3B layer shapes on an H200): change detection
  in elements per second, encoding in changed elements per second, upload in bytes per second
  (to a local directory), and the commit's overhead;
* per-replica apply rates: moe_scale_*.json's vLLM apply (decode, stage and the paused store per
  changed element, digest verification per byte);
* assumptions, named in the output: the download bandwidth of a replica, the GPUs of a replica,
  and the fp8 quantization on the trainer's GPUs (not measured on a GPU: estimated from its
  memory traffic).

Beside them: checkpoint-engine (Kimi-K2 fp8 on 256 H20s in 16 s, a dense in-cluster broadcast)
and Fireworks (20.3 GiB per delta of 1,024 GiB fp8 checkpoints).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import common
import torch

from deltarl.weightsync import fp8

KIMI_K2: dict[str, int] = {
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 1,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "num_attention_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}
"""Kimi-K2's shape (its public config.json); the untied LM head is implied."""

GIB = 2**30
CHECKPOINT_ENGINE_S = 16.0  # Kimi-K2 fp8 onto 256 H20s, dense, in-cluster (Moonshot)
FIREWORKS_DELTA_GIB = 20.3  # average delta of 1,024 GiB fp8 checkpoints (Fireworks)
TRAIN_BYTES_PER_PARAM = 16  # fp32 master + fp32 Adam moments + fp32 gradient
QUANTIZE_BYTES_PER_ELEMENT = 80  # memory traffic of sharded_fp8's unfused quantization, estimated
HBM_BYTES_PER_S = 2.4e12  # half of an H200's 4.8 TB/s


def kimi_specs(c: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """Every tensor of the Hugging Face checkpoint (DeepSeek-V3 names) and its shape."""
    d, heads = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    specs: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab_size"], d)}

    def mlp(pre: str, inter: int) -> None:
        specs[f"{pre}.gate_proj.weight"] = (inter, d)
        specs[f"{pre}.up_proj.weight"] = (inter, d)
        specs[f"{pre}.down_proj.weight"] = (d, inter)

    for i in range(c["num_hidden_layers"]):
        pre = f"model.layers.{i}"
        att = f"{pre}.self_attn"
        specs |= {
            f"{pre}.input_layernorm.weight": (d,),
            f"{pre}.post_attention_layernorm.weight": (d,),
            f"{att}.q_a_proj.weight": (c["q_lora_rank"], d),
            f"{att}.q_a_layernorm.weight": (c["q_lora_rank"],),
            f"{att}.q_b_proj.weight": (heads * qk, c["q_lora_rank"]),
            f"{att}.kv_a_proj_with_mqa.weight": (c["kv_lora_rank"] + c["qk_rope_head_dim"], d),
            f"{att}.kv_a_layernorm.weight": (c["kv_lora_rank"],),
            f"{att}.kv_b_proj.weight": (
                heads * (c["qk_nope_head_dim"] + c["v_head_dim"]),
                c["kv_lora_rank"],
            ),
            f"{att}.o_proj.weight": (d, heads * c["v_head_dim"]),
        }
        if i < c["first_k_dense_replace"]:
            mlp(f"{pre}.mlp", c["intermediate_size"])
            continue
        specs[f"{pre}.mlp.gate.weight"] = (c["n_routed_experts"], d)
        specs[f"{pre}.mlp.gate.e_score_correction_bias"] = (c["n_routed_experts"],)
        for e in range(c["n_routed_experts"]):
            mlp(f"{pre}.mlp.experts.{e}", c["moe_intermediate_size"])
        mlp(f"{pre}.mlp.shared_experts", c["moe_intermediate_size"] * c["n_shared_experts"])
    specs["model.norm.weight"] = (d,)
    specs["lm_head.weight"] = (c["vocab_size"], d)
    return specs


def model_sizes(specs: dict[str, tuple[int, ...]], c: dict[str, int]) -> dict[str, Any]:
    """Elements and bytes of the bf16 and the block-fp8 versions, by deltarl's fp8 rule."""

    def numel(shape: tuple[int, ...]) -> int:
        n = 1
        for s in shape:
            n *= s
        return n

    layout = fp8.fp8_layout({n: (torch.bfloat16, s) for n, s in specs.items()})
    quantized = sum(numel(s) for n, (d, s) in layout.items() if d == fp8.FP8_DTYPE)
    scales = sum(numel(s) for n, (d, s) in layout.items() if n.endswith(fp8.SCALE_SUFFIX))
    params = sum(numel(s) for s in specs.values())
    kept = params - quantized
    expert = 3 * c["hidden_size"] * c["moe_intermediate_size"]
    routed = (c["num_hidden_layers"] - c["first_k_dense_replace"]) * c["n_routed_experts"]
    inactive = routed * expert * (1 - c["num_experts_per_tok"] / c["n_routed_experts"])
    embed = c["vocab_size"] * c["hidden_size"]
    return {
        "tensors": len(specs),
        "quantized_tensors": sum(1 for d, _ in layout.values() if d == fp8.FP8_DTYPE),
        "params": params,
        "active_params": int(params - inactive - embed),  # the input embedding is a lookup
        "quantized_elements": quantized,
        "kept_bf16_elements": kept,
        "scales": scales,
        "bf16_bytes": 2 * params,
        "fp8_bytes": quantized + 4 * scales + 2 * kept,
        "scale_grid_bytes": 4 * scales,
    }


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def densities(path: Path) -> dict[str, dict[str, float]]:
    """Per learning rate and scenario (the median step after the first; the first step, Adam's
    warm-up): changed fraction and bits per changed element of the quantized tensors'
    e4m3 bytes and of the tensors kept in bf16 in an fp8 version, the scale changes, and the
    bf16 version of the same steps."""
    data = json.loads(path.read_text())

    def summary(group: list[dict[str, Any]]) -> dict[str, float]:
        rows = []
        for s in group:
            q, whole, b = s["fp8_quantized_tensors"], s["fp8_version"], s["bf16"]
            kept_n, kept_c = whole["numel"] - q["numel"], whole["changed"] - q["changed"]
            rows.append(
                {
                    "fp8_density": q["density"],
                    "fp8_bits": q["bits_per_changed"],
                    "kept_density": kept_c / kept_n,
                    "kept_bits": 8 * (whole["bytes"] - q["bytes"]) / max(kept_c, 1),
                    "scale_change_fraction": s["scales"]["changed"] / s["scales"]["total"],
                    "bf16_density": b["density"],
                    "bf16_bits": b["bits_per_changed"],
                }
            )
        return {k: median([r[k] for r in rows]) for k in rows[0]}

    out = {}
    for rate, entries in data["results"].items():
        steps = [s for s in entries if "step" in s]
        last = max(s["step"] for s in steps)
        out[f"lr {float(rate):g}, steps 2-{last}"] = summary([s for s in steps if s["step"] > 1])
        out[f"lr {float(rate):g}, step 1"] = summary([s for s in steps if s["step"] == 1])
    return out


def publish_rates(paths: list[Path]) -> list[dict[str, Any]]:
    """Per source: the median over its steps after the first of each per-rank rate (the
    slowest rank of each step), and the commit's overhead beyond the slowest rank."""
    out = []
    for path in paths:
        if path.suffix == ".jsonl":
            lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
            steps = [x for x in lines if "detect_s" in x and "step" in x]
            ranks = steps[0]["ranks"]
            gpus = path.stem.split("_")[2]
        else:
            data = json.loads(path.read_text())
            steps = data["publish"]["steps"]
            ranks = data["settings"]["ranks"]
            tag = path.stem.split("_")[2]  # moe_scale_<hardware>_...: h200, 4xh200
            count = int(tag.split("x")[0]) if "x" in tag else 1
            gpus = f"{count} GPU for {ranks} ranks"
        steps = [s for s in steps if s["step"] > 1] or steps
        rows = []
        for s in steps:
            per = [
                d + e + u
                for d, e, u in zip(s["detect_s"], s["encode_s"], s["upload_s"], strict=True)
            ]
            rows.append(
                {
                    "detect_elements_per_s": s["numel"] / ranks / max(s["detect_s"]),
                    "encode_changed_per_s": s["changed"] / ranks / max(s["encode_s"]),
                    "upload_bytes_per_s": s["bytes"] / ranks / max(s["upload_s"]),
                    "overhead_s": max(0.0, s["publish_s"] - max(per)),
                    "changed_fraction": s["changed"] / s["numel"],
                    "elements_per_rank": s["numel"] / ranks,
                }
            )
        out.append(
            {
                "source": path.name,
                "gpus": gpus,
                **{k: median([r[k] for r in rows]) for k in rows[0]},
            }
        )
    return out


def apply_rates(path: Path) -> dict[str, Any]:
    """Per changed element (decode, stage, paused store) and per byte of the changed tensors
    (digest verification, after inference resumed), medians over the measured deltas."""
    data = json.loads(path.read_text())
    steps = {s["step"]: s for s in data["publish"]["steps"]}
    numel = data["summary"]["numel"]
    rows = []
    for a in data["apply"]["applies"]:
        changed = steps[a["version"]]["changed"]
        rows.append(
            {
                "decode_changed_per_s": changed / a["decode_s"],
                "stage_changed_per_s": changed / a["stage_s"],
                "pause_changed_per_s": changed / a["paused_apply_s"],
                "verify_bytes_per_s": 2 * numel / a["verify_s"],  # bf16 state hashed
            }
        )
    return {"source": path.name, **{k: median([r[k] for r in rows]) for k in rows[0]}}


def version_bytes(sizes: dict[str, Any], d: dict[str, float]) -> dict[str, float]:
    """Changed elements and bytes of one fp8 version's delta (and the bf16 delta of the same
    step), from the densities."""
    q_changed = d["fp8_density"] * sizes["quantized_elements"]
    kept_changed = d["kept_density"] * sizes["kept_bf16_elements"]
    # a changed scale re-sends its block: the scale and up to 128 x 128 e4m3 bytes
    scale_changed = d["scale_change_fraction"] * sizes["scales"]
    block = fp8.BLOCK[0] * fp8.BLOCK[1]
    changed = q_changed + kept_changed + scale_changed * (1 + block)
    nbytes = (
        q_changed * d["fp8_bits"] / 8
        + kept_changed * d["kept_bits"] / 8
        + scale_changed * (4 + block * d["fp8_bits"] / 8)
    )
    bf16_changed = d["bf16_density"] * sizes["params"]
    return {
        "changed": changed,
        "bytes": nbytes,
        "bf16_changed": bf16_changed,
        "bf16_bytes": bf16_changed * d["bf16_bits"] / 8,
    }


def publish_step(
    sizes: dict[str, Any], v: dict[str, float], gpus: int, rates: dict[str, Any], bus: float
) -> dict[str, float]:
    """Seconds of one FSDP2 publication on ``gpus`` ranks (every parameter sharded by rows)."""
    elements = (sizes["quantized_elements"] + sizes["kept_bf16_elements"] + sizes["scales"]) / gpus
    quantize = sizes["params"] / gpus * QUANTIZE_BYTES_PER_ELEMENT / HBM_BYTES_PER_S
    # one all-reduce(MAX) of the amax grids of the blocks that straddle ranks (all, at these
    # rank counts): a ring moves twice the grid
    amax = 2 * sizes["scale_grid_bytes"] / bus
    detect = elements / rates["detect_elements_per_s"]
    encode = v["changed"] / gpus / rates["encode_changed_per_s"]
    upload = v["bytes"] / gpus / rates["upload_bytes_per_s"]
    total = quantize + amax + detect + encode + upload + rates["overhead_s"]
    return {
        "quantize_s": quantize,
        "amax_all_reduce_s": amax,
        "detect_s": detect,
        "encode_s": encode,
        "upload_s": upload,
        "overhead_s": rates["overhead_s"],
        "total_s": total,
    }


def apply_replica(
    sizes: dict[str, Any], v: dict[str, float], a: dict[str, Any], net: float, gpus: int
) -> dict[str, float]:
    """Seconds for one replica to take a version: download, decode and stage (inference
    running), the paused store, and the digest check after inference resumed (every changed
    tensor hashed: at these densities, all of them), by one process or spread over the
    replica's GPUs."""
    verify = sizes["fp8_bytes"] / a["verify_bytes_per_s"]
    return {
        "download_s": v["bytes"] / net,
        "decode_s": v["changed"] / a["decode_changed_per_s"],
        "stage_s": v["changed"] / a["stage_changed_per_s"],
        "paused_s": v["changed"] / a["pause_changed_per_s"],
        "verify_one_process_s": verify,
        "verify_spread_s": verify / gpus,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--replica-gpus", type=int, default=16, help="GPUs of one replica")
    parser.add_argument(
        "--download-gbit", type=float, default=25.0, help="a replica's download, Gbit/s"
    )
    parser.add_argument(
        "--bus-gbyte", type=float, default=50.0, help="all-reduce bus bandwidth, GB/s"
    )
    parser.add_argument("--out", type=Path, default=None)
    # the inputs by name (in bench/results/): a rerun computes from the same files
    parser.add_argument("--densities", default="fp8_deltas_cpu2_smollm2-135m.json")
    parser.add_argument(
        "--publish",
        nargs="+",
        default=[
            "fsdp_publish_4xh200_14b.jsonl",
            "fsdp_publish_4xh200_7b.jsonl",
            "moe_scale_h200_qwen3-30b-a3b-4layers.json",
        ],
        help="sources of per-rank publication rates (fsdp_publish_*.jsonl, moe_scale_*.json)",
    )
    parser.add_argument("--apply", default="moe_scale_h200_qwen3-30b-a3b-4layers.json")
    args = parser.parse_args(argv)

    res = common.RESULTS
    dens_file = res / args.densities
    pub_files = [res / name for name in args.publish]
    apply_file = res / args.apply

    sizes = model_sizes(kimi_specs(KIMI_K2), KIMI_K2)
    scenarios = densities(dens_file)
    sources = publish_rates(pub_files)
    applies = apply_rates(apply_file)
    net = args.download_gbit * 1e9 / 8

    def pick(key: str, fastest: bool) -> dict[str, Any]:
        """The rates of the fastest (or slowest) source for the figure ``key``."""
        return (max if fastest else min)(sources, key=lambda s: s[key])

    slowest = {
        k: min(s[k] for s in sources)
        for k in ("detect_elements_per_s", "encode_changed_per_s", "upload_bytes_per_s")
    } | {"overhead_s": max(s["overhead_s"] for s in sources)}
    fastest = {
        k: max(s[k] for s in sources)
        for k in ("detect_elements_per_s", "encode_changed_per_s", "upload_bytes_per_s")
    } | {"overhead_s": min(s["overhead_s"] for s in sources)}
    mid = {k: median([s[k] for s in sources]) for k in slowest}

    rows = []
    for name, d in scenarios.items():
        v = version_bytes(sizes, d)
        a = apply_replica(sizes, v, applies, net, args.replica_gpus)
        for gpus in args.gpus:
            p = {
                label: publish_step(sizes, v, gpus, r, args.bus_gbyte * 1e9)
                for label, r in (("median", mid), ("slowest", slowest), ("fastest", fastest))
            }
            train = sizes["params"] * TRAIN_BYTES_PER_PARAM / gpus
            rows.append(
                {
                    "scenario": name,
                    "gpus": gpus,
                    "train_state_per_gpu_gib": train / GIB,
                    "elements_per_rank": sizes["params"] / gpus,
                    "publish": p,
                    "version": v,
                    "apply": a,
                    "publish_to_applied_s": p["median"]["total_s"]
                    + a["download_s"]
                    + a["decode_s"]
                    + a["stage_s"]
                    + a["paused_s"],
                }
            )
    result = {
        "meta": common.meta(
            note="An extrapolation, not a measurement: nothing ran at 1T. Computed on the CPU "
            "from rates measured on H200s and fp8 densities measured on SmolLM2-135M; every "
            "input and assumption is listed under 'inputs'"
        ),
        "model": {"name": "Kimi-K2 shape", "config": KIMI_K2, **sizes},
        "inputs": {
            "densities": {"source": dens_file.name, **scenarios},
            "publish_rates": sources,
            "apply_rates": applies,
            "assumptions": {
                "replica_gpus": args.replica_gpus,
                "download_gbit_per_s": args.download_gbit,
                "all_reduce_bus_gbyte_per_s": args.bus_gbyte,
                "quantize": f"{QUANTIZE_BYTES_PER_ELEMENT} bytes of memory traffic per "
                f"parameter at {HBM_BYTES_PER_S / 1e12:.1f} TB/s (not measured on a GPU)",
                "train_bytes_per_param": TRAIN_BYTES_PER_PARAM,
                "detect and encode": "rates measured on bf16 versions at 1-4% density, "
                "applied per element / per changed element to e4m3 versions",
                "upload": "measured to a local directory; an object store adds its latency",
            },
        },
        "reference": {
            "checkpoint_engine_s": CHECKPOINT_ENGINE_S,
            "checkpoint_engine": "Kimi-K2 fp8 onto 256 H20s, dense, in-cluster",
            "fireworks_delta_gib": FIREWORKS_DELTA_GIB,
            "fireworks": "average delta of 1,024 GiB fp8 checkpoints (1.98%)",
        },
        "rows": rows,
    }
    out = args.out or common.result_path("fp8_1t", "h200", "kimi-k2-extrapolated")
    common.write_json(out, result)
    print(
        f"Kimi-K2 shape: {sizes['params'] / 1e12:.3f} T params ({sizes['active_params'] / 1e9:.1f}"
        f" B active), fp8 state {sizes['fp8_bytes'] / GIB:,.0f} GiB, bf16 {sizes['bf16_bytes'] / GIB:,.0f} GiB"
    )
    for r in rows:
        p, v, a = r["publish"], r["version"], r["apply"]
        print(
            f"{r['scenario']:>20} {r['gpus']:>4} GPUs: publish {p['median']['total_s']:.2f} s "
            f"[{p['fastest']['total_s']:.2f}-{p['slowest']['total_s']:.2f}], version "
            f"{v['bytes'] / GIB:.2f} GiB (bf16 delta {v['bf16_bytes'] / GIB:.2f} GiB), apply: "
            f"download {a['download_s']:.1f} s decode {a['decode_s']:.1f} s paused "
            f"{a['paused_s'] * 1e3:.1f} ms verify {a['verify_spread_s']:.0f} s "
            f"({a['verify_one_process_s']:.0f} s in one process)"
        )


if __name__ == "__main__":
    main()
