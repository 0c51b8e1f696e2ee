"""The sections of docs/benchmarks.md, in page order: for each benchmark its title, what it
measures and how its result files become tables (bench/report.py renders the page).

To add a benchmark: write its result with bench/common.py (``meta`` block, default file name
``bench/results/<benchmark>_<hardware>_<model>.json``), add a ``Section`` here whose render
function (in report_weights.py, report_runs.py or report_services.py) turns a list of such
results (any hardware, any model) into Markdown lines, then run ``python bench/report.py
--write``.
"""

from __future__ import annotations

from report_format import Section, gpus
from report_fp8 import fp8_1t
from report_runs import (
    fp8_capitals,
    hints_capitals,
    hints_wordle,
    system,
    trainer_memory,
    vllm_check,
    vllm_speed,
    vllm_tp,
    wordle_grpo,
)
from report_services import (
    coordinator,
    env_server,
    gpu_tests,
    object_hash,
    teacher_engine,
    teacher_vllm,
    teacher_wire,
)
from report_weights import (
    codec,
    codec_gpu,
    decode_host,
    device_scan,
    digest,
    encode_rank,
    fp8,
    fsdp_publish,
    moe_scale,
    moe_sparsity,
    rollout_sync,
)

SECTIONS = [
    Section(
        "codec",
        "Weight-sync codec on real deltas",
        "Bytes and time of the compact delta format on real AdamW steps of a pretrained model, "
        "against TRL's gap_delta format and the entropy floor; encode, then decode, apply in "
        "place and verify every result digest, on the CPU.",
        codec,
    ),
    Section(
        "fp8_deltas",
        "fp8 versions beside bf16",
        "How much sparser a block-fp8 version's delta is than the bf16 one of the same steps: "
        "changed e4m3 bytes against changed bf16 values, and their deltas' bytes.",
        fp8,
    ),
    Section(
        "fp8_1t",
        "fp8 at 1T parameters (extrapolated)",
        "A Kimi-K2-shaped model in block fp8 published by N FSDP2 GPUs and applied by a rollout "
        "replica, computed from measured per-rank publish rates, apply rates and fp8 densities: "
        "an extrapolation, with every input named.",
        fp8_1t,
    ),
    Section(
        "codec_gpu",
        "Weight-sync path on a GPU",
        "Each phase of one version's sync on a GPU: change detection on the device, encode and "
        "decode on the host, staging while inference runs, the paused in-place apply, and the "
        "digest verification after inference resumes.",
        codec_gpu,
    ),
    Section(
        "device_scan",
        "Change detection on the GPU",
        "Seconds to find one FSDP rank's changed elements and compute the encoder's context "
        "scans on its GPU.",
        device_scan,
    ),
    Section(
        "encode_rank",
        "Compact encoder on one rank's delta",
        "Seconds to encode one FSDP rank's delta on the host, by thread count.",
        encode_rank,
    ),
    Section(
        "decode_host",
        "Compact decoder on a GPU host's cores",
        "Seconds to decode a large delta coded as gaps on the host, by thread count, alone and "
        "next to a thread running Python (a rollout engine's).",
        decode_host,
    ),
    Section(
        "rollout_sync",
        "Rollout worker: weight sync under load",
        "A rollout worker following every version a trainer publishes while it generates: how "
        "long inference pauses per sync, and how long from publish to applied.",
        rollout_sync,
        lambda r: (r.hardware.startswith("cpu"), "standalone" in r.model),
    ),
    Section(
        "vllm_check",
        "vLLM engine: bit-identical sync",
        "The vLLM engine following a bucket while it generates: every version's weights "
        "bit-identical to the trainer's, the paused window, vLLM's own weight-update API, and "
        "its processed logprobs against transformers on the same weights.",
        vllm_check,
    ),
    Section(
        "vllm_speed",
        "vLLM engine: generation speed against plain vLLM",
        "What deltarl's vLLM engine (weight-sync gate, per-token logprobs, prefix caching "
        "salted per weight state) costs in generation speed against vLLM with the same settings "
        "and with its defaults.",
        vllm_speed,
    ),
    Section(
        "vllm_tp",
        "vLLM engine: tensor parallelism",
        "One vLLM engine over two GPUs following a bucket while it generates, against one GPU.",
        vllm_tp,
    ),
    Section(
        "system",
        "The whole system on GPUs",
        "Every service as its own process on one GPU machine, a model learning a task: "
        "throughput, the pause per sync and publish-to-applied under real training, with the "
        "vLLM and the transformers engine, one worker per GPU, and FSDP2 and DDP trainers.",
        system,
        lambda r: ("-transformers" in r.model, "-fsdp" in r.model, "-ddp" in r.model, gpus(r)),
    ),
    Section(
        "fsdp_publish",
        "FSDP2 sharded publication",
        "What publishing each optimizer step costs when every FSDP2 rank publishes its own rows "
        "as a part of one version, by model size, and what a rollout GPU then pays to apply it.",
        fsdp_publish,
        lambda r: ({"0.6b": 0, "1.7b": 1, "7b": 2, "14b": 3}.get(r.model, 9), r.hardware),
    ),
    Section(
        "moe_scale",
        "Mixture of experts at Qwen3-30B-A3B's shapes",
        "Publication of a sparse expert update by ranks holding whole experts, and its apply "
        "into a vLLM engine serving the same shapes.",
        moe_scale,
    ),
    Section(
        "digest",
        "Verification digests of a large state",
        "What proving a version costs the worker: the xxh3-128 digest of every changed tensor, "
        "one tensor at a time against several on threads (`state_digests`), for stacked "
        "expert tensors on a GPU.",
        digest,
    ),
    Section(
        "moe_sparsity",
        "Mixture-of-experts delta sparsity",
        "How many bf16 weights a real AdamW step changes in a mixture-of-experts model against "
        "a dense one of the same active size, and in experts that got no token.",
        moe_sparsity,
        lambda r: -r.data.get("tokens_per_step", 0),
    ),
    Section(
        "trainer_memory",
        "Trainer memory by micro-batch",
        "Peak GPU memory and step time of one GRPO step by `batch.micro_batch_size` and "
        "`batch.micro_batch_tokens`.",
        trainer_memory,
    ),
    Section(
        "wordle_grpo",
        "Learning Wordle: SFT on solver games, then GRPO",
        "SmolLM2-135M-Instruct on the full 6-guess game with the real rules, before and after a "
        "warm start on solver games and after GRPO through the whole system.",
        wordle_grpo,
    ),
    Section(
        "hints_wordle",
        "Hinted self-distillation on Wordle",
        "GRPO alone against GRPO plus the environment's hints, one run each.",
        hints_wordle,
    ),
    Section(
        "hints_capitals",
        "Hinted self-distillation on the capitals task",
        "GRPO alone against GRPO plus hints on a task SmolLM2 can read the hint for, three seeds.",
        hints_capitals,
    ),
    Section(
        "fp8_capitals",
        "Learning with fp8 workers",
        "The capitals task with bf16 workers against fp8 workers, same seeds and steps.",
        fp8_capitals,
    ),
    Section(
        "teacher_vllm",
        "Teacher service: vLLM engine against transformers",
        "How far the teacher's vLLM engine's logprobs are from the transformers engine's on "
        "the same weights.",
        teacher_vllm,
    ),
    Section(
        "teacher_engine",
        "Teacher service: the transformers engine",
        "Scored positions per second of the teacher's transformers engine on one batch, and "
        "whether a padded batch scores each sequence as it scores it alone.",
        teacher_engine,
    ),
    Section(
        "teacher_wire",
        "Teacher wire format",
        "Bytes and encode/decode time of one teacher answer in deltarl's binary format against "
        "JSON encodings of the same numbers.",
        teacher_wire,
    ),
    Section(
        "env_server",
        "Environment server (Wordle)",
        "Throughput and step latency of one Wordle env server with 1,000 concurrent sessions "
        "over HTTP and WebSocket, and its memory per session.",
        env_server,
    ),
    Section(
        "coordinator",
        "Coordinator under load",
        "Latency and CPU of one coordinator under 1,000 workers' heartbeats, submissions, "
        "leases and status reads, with each store, and whether every group was leased and "
        "acked exactly once.",
        coordinator,
        lambda r: (-r.data["server_workers"], r.data["store"] != "sqlite"),
    ),
    Section(
        "object_hash",
        "Object hashing",
        "Hashing throughput on the CPU: SHA-256 (signed versions bind every object by it) "
        "against BLAKE2b and the xxh3 digests, and SHA-256 over parts in parallel.",
        object_hash,
    ),
    Section(
        "gpu_tests",
        "GPU test runs",
        "The GPU tests (vLLM engine, apply kernel, teacher, fault suite with vLLM workers) as "
        "last run.",
        gpu_tests,
    ),
]
