"""Rich rendering of a :class:`StatusSummary` for ``deltarl status``."""

from __future__ import annotations

from rich.console import Group
from rich.panel import Panel
from rich.table import Table

from deltarl.services.coordinator.schemas import StatusSummary


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _ago(t: float, now: float) -> str:
    s = max(0.0, now - t)
    return f"{s:.1f}s" if s < 120 else f"{s / 60:.1f}m" if s < 7200 else f"{s / 3600:.1f}h"


def render_status(s: StatusSummary, url: str) -> Group:
    q = s.queue
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("latest version", f"{s.latest_version} (trainer step {s.trainer_step})")
    head.add_row("latest anchor", str(s.latest_anchor))
    head.add_row("max staleness", f"{s.max_staleness} versions")
    oldest = "-" if q.oldest_age_s is None else f"{q.oldest_age_s:.1f}s"
    head.add_row("queue", f"{q.depth} waiting, {q.leased} leased, oldest {oldest}")
    head.add_row(
        "groups",
        f"{q.submitted_total} accepted, {q.acked_total} acked, {q.duplicates_total} duplicates",
    )
    drops = ", ".join(f"{k} {v}" for k, v in sorted(q.dropped.items())) or "none"
    head.add_row("dropped", drops)
    if q.dead_letters or q.rejected:
        refused = ", ".join(f"{k} {v}" for k, v in sorted(q.rejected.items())) or "none"
        head.add_row(
            "refused by the trainer",
            f"{refused}; {q.dead_letters} dead letters (GET /v1/dead-letters)",
        )
    suspect = f", [bold red]{s.workers_suspect} SUSPECT[/]" if s.workers_suspect else ""
    head.add_row(
        "workers",
        f"{s.workers_active} active, {s.workers_lost} lost, {s.in_flight} in flight{suspect}",
    )
    pool = s.challenges
    if pool is not None and pool.posted:
        head.add_row(
            "weight challenges",
            f"{pool.pool_size} left at v{pool.version} ({pool.workers_challenged} workers "
            f"challenged, {pool.wanted} wanted), workers waiting for one: "
            f"{s.workers_waiting_for_challenge}",
        )
    if s.staleness_hist:
        hist = "  ".join(
            f"{k}:{v}" for k, v in sorted(s.staleness_hist.items(), key=lambda kv: int(kv[0]))
        )
        head.add_row("staleness at submit", hist)
    if s.rewards:
        r = s.rewards[-1]
        head.add_row("reward", f"{r.mean_reward:.3f} at version {r.version} ({r.groups} groups)")
    parts: list[Panel | Table] = [Panel(head, title=f"deltarl coordinator — {url}", expand=False)]

    if s.versions:
        vt = Table(title="recent versions", expand=False)
        for col in ("version", "kind", "step", "download", "full", "ratio", "age"):
            vt.add_column(col, justify="right")
        for v in s.versions[-8:]:
            ratio = f"{v.bytes / v.full_bytes:.2%}" if v.full_bytes else "-"
            vt.add_row(
                str(v.version),
                v.kind,
                str(v.trainer_step),
                _bytes(v.bytes),
                _bytes(v.full_bytes),
                ratio,
                _ago(v.recorded_at, s.now),
            )
        parts.append(vt)
    if s.workers:
        wt = Table(title="workers (suspect first, then laggiest)", expand=False)
        for col in (
            "worker",
            "state",
            "engine",
            "version",
            "weights",
            "lag",
            "lag s",
            "in flight",
            "seen",
            "refused",
            "error",
        ):
            wt.add_column(col)
        for w in s.workers:
            style = "red" if w.state == "lost" or w.suspect else None
            wt.add_row(
                w.worker_id,
                "SUSPECT" if w.suspect else w.state,
                w.engine,
                str(w.applied_version),
                (
                    (
                        "unproven"
                        if w.weights_proven_version is None
                        else f"proven v{w.weights_proven_version}"
                    )
                    if w.weights_verified is None
                    else ("proven" if w.weights_verified else "PROOF FAILED")
                ),
                str(w.lag_versions),
                "-" if w.lag_seconds is None else f"{w.lag_seconds:.1f}",
                str(w.in_flight),
                _ago(w.last_seen, s.now) + " ago",
                str(w.rejected_groups) if w.rejected_groups else "",
                (w.last_error or "")[:40],
                style=style,
            )
        parts.append(wt)
    return Group(*parts)


__all__ = ["render_status"]
