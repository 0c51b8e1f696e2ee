"""The whole system on one machine from command-line arguments, for experiments and
benchmarks on GPUs: every service its own process on loopback, exactly as in a deployment.

Order of operations (:func:`run`):

1. the run config from the arguments (:func:`run_config`: the same derivation as ``deltarl
   run`` and the fault suite; ``--set`` overrides apply last);
2. start the coordinator (embedded SQLite), the env server, ``--workers`` rollout workers (the
   transformers or the vLLM engine; ``--worker-gpus`` pins worker ``i`` to a GPU; vLLM workers
   sharing a GPU start one after another, workers on GPUs of their own side by side) and the
   trainer (under ``torchrun`` with ``--trainer-nproc`` > 1), sharing a local-directory bucket;
3. every 5 s: the workers' generated tokens, the env server's games, the coordinator's status;
4. after ``--duration`` seconds from the trainer's start (or ``--steps`` optimizer steps) stop
   the trainer with SIGTERM (it finishes its step, checkpoints and exits), wait until every
   worker holds the final version with verified weights, stop everything else;
5. write ``summary.json`` and ``reward.png`` into the run directory (:mod:`deltarl.run.summary`:
   reward signals per step and per window, throughput, every weight sync's pause and publish to
   applied, the env server's games per window, the final check).

The Wordle variant (all env-server settings, see docs/env_server.md): ``--max-guesses`` valid
guesses per game, ``--max-invalid`` invalid replies tolerated. The reward (``--reward``) is by
default ``shaped`` (:data:`SHAPED`: 1 for the winning move, 0.2 x greens/5 + 0.1 x yellows/5 +
0.05 for every other valid guess; a repeated or invalid guess earns nothing, so a policy cannot
farm credit by repeating one well-formed word); ``--reward final`` pays the game's end only: 1 on
a win, else ``--format-credit`` x valid moves / moves plus the partial credit of the last valid
guess, 0 after a forfeit. ``--model DIR`` (or ``--set run.model=DIR``) starts from a model
directory, e.g. ``deltarl sft``'s output, instead of the prepared ``--model-kind``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx

from deltarl.cluster import ProcessGroup, free_port, wait_healthy
from deltarl.demo.plan import new_token
from deltarl.run.config import RunConfig
from deltarl.run.derive import Endpoints, RunLayout, Tokens
from deltarl.run.summary import (
    final_check,
    game_windows,
    plot,
    scrape_games,
    scrape_tokens,
    summarise,
    wordle_summary,
)
from deltarl.services.common.models import prepare_model

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
# --reward shaped (the default): the env server's per-move weights. A repeated guess is an
# invalid move (repeats are not allowed), and an invalid move earns 0: no format, letters or
# penalty term reaches it (repetition and invalid are 0)
SHAPED: dict[str, Any] = {
    "reward": "shaped",
    "allow_repeats": False,
    "shaping_win": 1.0,
    "shaping_greens": 0.2,
    "shaping_yellows": 0.1,
    "shaping_format": 0.05,
    "shaping_repetition": 0.0,
    "shaping_invalid": 0.0,
    "shaping_consistent": 0.0,
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache/deltarl/demo")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=1000, help="stop after this many steps")
    ap.add_argument(
        "--duration",
        type=float,
        default=480.0,
        help="stop this many seconds after the trainer starts",
    )
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--groups-per-step", type=int, default=4)
    ap.add_argument(
        "--micro-batch-size",
        type=int,
        default=16,
        help="sequences per forward/backward pass (64 Wordle games of ~460 tokens in one pass "
        "need ~57 GB, which beside a vLLM worker on an 80 GB GPU runs out of memory)",
    )
    ap.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=None,
        help="also at most this many padded tokens per pass (trainer.batch.micro_batch_tokens)",
    )
    ap.add_argument("--max-staleness", type=int, default=2)
    ap.add_argument("--max-guesses", type=int, default=3)
    ap.add_argument("--max-invalid", type=int, default=2)
    ap.add_argument(
        "--reward",
        choices=["shaped", "final"],
        default="shaped",
        help="Wordle reward: 'shaped' (every move scored, a repeated or invalid guess earns "
        "nothing; SHAPED) or 'final' (the game's end only; --format-credit applies)",
    )
    ap.add_argument(
        "--format-credit",
        type=float,
        default=0.0,
        help="env, --reward final: share of a loss earned by valid moves",
    )
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--in-flight-groups", type=int, default=4)
    ap.add_argument("--anchor-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--window", type=int, default=10, help="steps per window in the summary")
    ap.add_argument("--task", choices=["wordle", "charset"], default="wordle")
    ap.add_argument(
        "--model-kind", choices=["smollm2", "smollm2-moe", "tiny-bytes"], default="smollm2"
    )
    ap.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a model directory to start from (e.g. `deltarl sft`'s out) instead of "
        "--model-kind; a `--set run.model=DIR` naming a directory does the same",
    )
    ap.add_argument(
        "--env-window-s",
        type=float,
        default=60.0,
        help="seconds per window of the env server's game outcomes (win rate) in the summary",
    )
    ap.add_argument(
        "--trainer-nproc", type=int, default=1, help="trainer ranks (torchrun, one GPU each)"
    )
    ap.add_argument("--max-turns", type=int, default=None, help="default: guesses + invalid")
    ap.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.2, help="vllm, per worker")
    ap.add_argument("--worker-gpus", type=int, nargs="*", default=None, help="GPU of worker i")
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help='run-config override, as `deltarl run --set` (e.g. rollout.hints.mode="env")',
    )
    return ap


def parse_args(argv: list[str] | None, ap: argparse.ArgumentParser | None = None) -> Any:
    """The arguments (``ap``: :func:`build_parser`'s parser, perhaps with more options)."""
    ap = ap or build_parser()
    a = ap.parse_args(argv)
    if a.task == "wordle" and a.reward == "shaped" and a.format_credit:
        ap.error("--format-credit is a term of --reward final; the shaped reward has its own")
    return a


def run_config(a: argparse.Namespace) -> RunConfig:
    """The run these arguments start, as a run config (deltarl/run): the same derivation as
    ``deltarl run`` and the fault suite."""
    env: dict[str, Any] = {"task": a.task}
    engine: dict[str, Any] = {"type": a.engine}
    if a.engine == "vllm":  # vLLM's GPU: the worker's CUDA_VISIBLE_DEVICES
        engine["gpu_memory_utilization"] = a.gpu_memory_utilization
    else:
        engine["device"] = a.device
    episodes: dict[str, Any] = {
        "max_turns": a.max_turns if a.max_turns is not None else a.max_guesses + a.max_invalid,
        "sampling": {"max_new_tokens": a.max_new_tokens},
    }
    rollout: dict[str, Any] = {
        "workers": a.workers,
        "in_flight_groups": a.in_flight_groups,
        "shutdown_grace_s": 2.0,
        "submit_timeout_s": 10.0,
        "engine": engine,
        "episodes": episodes,
    }
    if a.task == "charset":
        episodes["system_prompt"] = ""  # the env's own instructions, not the Wordle player prompt
    else:
        env |= {
            "max_guesses": a.max_guesses,
            "max_invalid_moves": a.max_invalid,
            "allow_non_words": True,
        }
        env |= SHAPED if a.reward == "shaped" else {"format_credit": a.format_credit}
    config = RunConfig.model_validate(
        {
            "run": {
                "group_size": a.group_size,
                "max_staleness": a.max_staleness,
                "seed": a.seed,
            },
            "env": env,
            "coordinator": {"target_queue_groups": 2 * a.groups_per_step},
            "rollout": rollout,
            "trainer": {
                "device": a.device,
                "max_steps": a.steps,
                "optimizer": {"lr": a.lr, "warmup_steps": a.warmup},
                "batch": {
                    "groups_per_step": a.groups_per_step,
                    "micro_batch_size": a.micro_batch_size,
                    **(
                        {}
                        if a.micro_batch_tokens is None
                        else {"micro_batch_tokens": a.micro_batch_tokens}
                    ),
                },
                "publish": {"anchor_every": a.anchor_every},
                "checkpoint": {"every": 0, "keep": 1},
            },
        }
    )
    return config.with_overrides(a.overrides) if a.overrides else config


def start_all(
    a: argparse.Namespace, rd: Path, model_dir: Path
) -> tuple[ProcessGroup, str, dict[str, str], tuple[str, str]]:
    """Start every service; the process group, the coordinator's URL, each worker's metrics
    URL and the env server's (URL, token)."""
    common = {
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "2",
        "DELTARL_LOG_LEVEL": "INFO",
        "PYTHONUNBUFFERED": "1",
    }
    endpoints = Endpoints(HOST, free_port(HOST), free_port(HOST))
    tokens = Tokens(
        trainer=new_token(), worker=new_token(), env=new_token(), worker_key=new_token()
    )
    layout = RunLayout(run_config(a), rd, str(model_dir), endpoints, tokens, str(rd / "bucket"))
    group = ProcessGroup(rd / "logs")
    coordinator, env = layout.coordinator(), layout.env()
    coord = group.start(coordinator.name, coordinator.args, common | coordinator.env)
    env_child = group.start(env.name, env.args, common | env.env)
    curl = endpoints.coordinator_url
    wait_healthy(f"{curl}/health", coord)
    wait_healthy(f"{endpoints.env_url}/health", env_child)
    metrics: dict[str, str] = {}
    # every worker on a GPU of its own (and not the trainer's first one)
    own_gpus = bool(a.worker_gpus) and len(set(a.worker_gpus[: a.workers])) == a.workers
    own_gpus = own_gpus and 0 not in a.worker_gpus[: a.workers]
    for i in range(a.workers):
        w = layout.worker(i, worker_id=f"gpu-worker-{i + 1}")
        port = free_port(HOST)
        metrics[w.name] = f"http://{HOST}:{port}/metrics"
        pinned = (
            {"CUDA_VISIBLE_DEVICES": visible_gpu(a.worker_gpus[i % len(a.worker_gpus)])}
            if a.worker_gpus
            else {}
        )
        group.start(
            w.name,
            [*w.args, "--host", HOST, "--port", str(port)],
            common
            | w.env
            | pinned
            | {"DELTARL_ROLLOUT_SYNC_LOG": str(rd / f"{w.name}.syncs.jsonl")},
        )
        if a.engine == "vllm" and not own_gpus:
            # one vLLM start at a time: its memory profiling sees the GPU
            wait_logged(group.children[-1], "vllm engine:", 600.0)
    if a.engine == "vllm" and own_gpus:  # one GPU each: they start side by side
        for child in group.children[-a.workers :]:
            wait_logged(child, "vllm engine:", 600.0)
    launcher: list[str] = []
    if a.trainer_nproc > 1:
        # a port of its own: torchrun's default (29500) is taken by any other run on the host
        launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(a.trainer_nproc)]
        launcher += ["--master-port", str(free_port(HOST))]
    t = layout.trainer()
    group.start(t.name, t.args, common | t.env, python_args=launcher)
    return group, curl, metrics, (endpoints.env_url, tokens.env)


def visible_gpu(index: int) -> str:
    """GPU ``index`` as the caller sees it: the ``index``-th entry of the caller's
    ``CUDA_VISIBLE_DEVICES`` when that is set (``--worker-gpus 1 2`` under
    ``CUDA_VISIBLE_DEVICES=4,5,6`` pins to 5 and 6), else ``index`` itself."""
    visible = [
        d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()
    ]
    if visible and 0 <= index < len(visible):
        return visible[index]
    return str(index)


def resolve_model(a: argparse.Namespace) -> Path:
    """The run's model directory: ``--model``, else ``run.model`` when an override names an
    existing directory, else the prepared ``--model-kind``."""
    if a.model is not None:
        return Path(a.model).resolve()
    configured = Path(run_config(a).run.model)
    if configured.is_dir():
        return configured.resolve()
    return prepare_model(a.model_kind, a.cache_dir)


def wait_logged(child: Any, text: str, timeout_s: float) -> None:
    """Wait until ``child``'s log holds ``text`` (raises if it exits or the time runs out)."""
    deadline = time.monotonic() + timeout_s
    while text not in child.log.read_text(errors="replace"):
        if child.exit_code() is not None:
            raise RuntimeError(f"{child.name} exited with {child.exit_code()} (log: {child.log})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{child.name} did not log {text!r} in {timeout_s:.0f} s")
        time.sleep(1)


def run(a: argparse.Namespace) -> dict[str, Any]:
    """Run the system as the arguments say (the module docstring's steps); its summary, also
    written to ``RUN_DIR/summary.json``."""
    rd = a.run_dir.resolve()
    rd.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(a)
    t0 = time.monotonic()
    group, curl, metrics, (env_url, env_token) = start_all(a, rd, model_dir)
    env_metrics = f"{env_url}/metrics"
    game_scrapes: list[dict[str, Any]] = []
    # --duration counts from the trainer's start: vLLM workers start one after another and
    # may take minutes
    t_train = time.monotonic()
    trainer = next(c for c in group.children if c.name == "trainer")
    status: Any = None
    train_s: float | None = None  # from the trainer's start to its end
    scrapes: dict[str, list[tuple[float, float]]] = {wid: [] for wid in metrics}
    try:
        while time.monotonic() - t_train < a.duration and trainer.exit_code() is None:
            group.check_alive({"trainer": 0})
            time.sleep(5)
            for wid, url in metrics.items():
                got = scrape_tokens(url)
                if got:  # generating (0 before the first version)
                    scrapes[wid].append((time.monotonic(), got))
            got_games = scrape_games(env_metrics, env_token)
            if got_games is not None:
                version = status.get("latest_version") if isinstance(status, dict) else None
                game_scrapes.append(
                    {"t": time.monotonic() - t_train, "version": version, "games": got_games}
                )
            try:
                status = httpx.get(f"{curl}/v1/status", timeout=5).json()
                log.info("[%6.0fs] version %s", time.monotonic() - t0, status.get("latest_version"))
            except (httpx.HTTPError, ValueError) as err:
                log.warning("status poll failed: %s", err)
        if trainer.exit_code() is None:
            os.kill(trainer.proc.pid, signal.SIGTERM)
            trainer.proc.wait(timeout=120)
        train_s = time.monotonic() - t_train
        status = final_check(curl, status)
    finally:
        elapsed = time.monotonic() - t0
        if train_s is None:
            train_s = elapsed - (t_train - t0)
        group.stop_all(timeout_s=30.0, first=[c.name for c in group.children if "worker" in c.name])
    summary = summarise(vars(a), rd, elapsed, status, train_s, a.window)
    summary["worker_tokens_per_s"] = {
        wid: (xs[-1][1] - xs[0][1]) / (xs[-1][0] - xs[0][0]) if len(xs) >= 2 else None
        for wid, xs in scrapes.items()
    }
    summary["wordle"] = wordle_summary(summary, game_windows(game_scrapes, a.env_window_s))
    summary["model_dir"] = str(model_dir)
    (rd / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, rd)
    return summary


def headline(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary's headline numbers (what a terminal shows)."""
    status = summary["coordinator_status"] or {}
    keys = (
        "steps",
        "elapsed_s",
        "train_s",
        "first_vs_last_window",
        "trainer_p50",
        "episodes_trained_per_s",
        "worker_tokens_per_s",
        "sync",
    )
    return (
        {k: summary.get(k) for k in keys}
        | {"wordle": summary["wordle"]}
        | {k: status.get(k) for k in ("final_version", "workers", "all_workers_verified_at_final")}
    )
