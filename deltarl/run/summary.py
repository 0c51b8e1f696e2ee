"""What a finished local run did, from its run directory and its services' metrics: the
trainer's metrics per window of steps, the weight syncs of every worker (pause, publish to
applied, bytes), the env server's games per window of time, and whether every worker holds the
final version (:func:`summarise`, :func:`final_check`). :mod:`deltarl.run.experiment` writes it
as the run's ``summary.json``.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from deltarl.services.common.client_headers import client_headers

# the Wordle view of a run's trainer metrics: name in the summary -> metric key
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


def scrape_tokens(url: str) -> float | None:
    """A rollout worker's generated tokens so far (its ``/metrics``), None if down."""
    try:
        text = httpx.get(url, timeout=5).text
    except httpx.HTTPError:
        return None
    m = re.search(r"^deltarl_rollout_tokens_generated_total ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else None


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
    """Means of ``key`` over consecutive windows of ``w`` rows (missing and NaN values left
    out)."""
    vals = [float(r[key]) for r in rows if key in r and r[key] is not None]
    vals = [v for v in vals if not math.isnan(v)]
    return [statistics.fmean(vals[i : i + w]) for i in range(0, len(vals), w) if vals[i : i + w]]


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile of ``values``."""
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def sync_summary(rd: Path) -> dict[str, Any]:
    """Pauses, publish-to-applied and bytes of every delta the workers applied (their sync logs,
    ``*.syncs.jsonl`` in the run directory)."""
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


def summarise(
    args: dict[str, Any],
    rd: Path,
    elapsed: float,
    status: Any,
    train_s: float | None = None,
    window: int = 10,
) -> dict[str, Any]:
    """The run's summary. ``args``: the run's arguments (recorded as given); ``elapsed``: the
    whole run, services' start-up included (vLLM workers take minutes); ``train_s``: since the
    trainer started (default ``elapsed``), what the trained episodes and tokens per second are
    divided by; ``window``: steps per window of the trainer's metrics."""
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
    out: dict[str, Any] = {
        "args": {k: str(v) for k, v in args.items()},
        "elapsed_s": elapsed,
        "train_s": train_s,
        "startup_s": elapsed - train_s,
        "steps": len(rows),
        "windows_of_steps": window,
        "window_means": {k: window_means(rows, k, window) for k in keys},
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
        # the trainer's logprobs against the workers' (behaviour) ones, and what the importance
        # correction made of the difference
        "mismatch/abs_logprob_diff/mean",
        "mismatch/abs_logprob_diff/max",
        "mismatch/kl",
        "is/weight/mean",
        "is/capped_frac",
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
    """``reward.png`` in the run directory: each reward signal per step (needs matplotlib; no
    plot without it)."""
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
    for k, name in shown.items():
        series = summary["per_step"].get(k)
        if not series:
            continue
        ys = [math.nan if v is None else float(v) for v in series]
        ax.plot(range(1, len(ys) + 1), ys, label=name, linewidth=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean over the step's batch")
    ax.set_title("reward signals per step (deltarl)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(rd / "reward.png", dpi=110)
