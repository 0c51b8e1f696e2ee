"""The body of ``deltarl demo`` (see :mod:`deltarl.demo.plan` for the order of operations)."""

from __future__ import annotations

import json
import logging
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, cast

import httpx
from rich.console import Console
from rich.live import Live

from deltarl.cluster import ProcessDiedError, ProcessGroup, free_port, tail, wait_healthy
from deltarl.demo.plan import demo_environment, elapsed, new_token
from deltarl.demo.report import (
    WorkerLog,
    bytes_summary,
    draw_reward_curve,
    human_bytes,
    live_view,
    published_manifests,
    rebuild_digest,
    reward_series,
    trainer_final,
)
from deltarl.run.config import PREPARED_MODELS, RunConfig
from deltarl.run.derive import Endpoints, Tokens, derive
from deltarl.services.common.models import ModelKind, prepare_model
from deltarl.services.coordinator.client import CoordinatorClient, CoordinatorError
from deltarl.services.coordinator.schemas import StatusSummary, VersionRecord, WorkerInfo

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
FINAL_SYNC_TIMEOUT_S = 180.0


class DemoFailedError(RuntimeError):
    """The demo could not finish; ``log_tail`` holds the end of the guilty process's log."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


def _poll(client: CoordinatorClient) -> tuple[StatusSummary | None, list[WorkerInfo]]:
    """Status and workers; (None, []) when the coordinator does not answer this time (if it
    died, the next check of the children says so)."""
    try:
        return client.status(), client.workers()
    except (CoordinatorError, httpx.HTTPError) as exc:
        logger.warning("coordinator poll failed: %s", exc)
        return None, []


def _all_versions(client: CoordinatorClient) -> list[VersionRecord]:
    out: list[VersionRecord] = []
    after: int | None = None
    while True:
        page = client.versions(after=after, limit=500)
        if not page:
            return out
        out += page
        after = page[-1].version


def run_demo(
    config: RunConfig,
    rd: Path,
    cache_dir: Path,
    console: Console,
    *,
    timeout_s: float,
    live: bool,
    title: str = "deltarl demo",
) -> dict[str, Any]:
    """Run ``config``'s system in ``rd`` (``deltarl demo`` and ``deltarl run``); returns the summary (also in ``rd/summary.json``).

    Raises :class:`DemoFailedError` when a process dies or time runs out, and lets
    ``KeyboardInterrupt`` through; every child is stopped in all cases.
    """
    t0 = time.monotonic()
    console.print(f"[bold]{title}[/bold]: run directory {rd}")
    model = config.run.model
    if model in PREPARED_MODELS:
        console.print(f"preparing the model ({model}) in {cache_dir} ...")
        try:
            model = str(prepare_model(cast(ModelKind, model), cache_dir))
        except ValueError as exc:
            raise DemoFailedError(str(exc)) from exc
        console.print(f"model directory: {model} ({elapsed(t0):.0f} s)")

    group = ProcessGroup(rd / "logs")
    servers: set[str] = set()
    try:
        return _run(
            config, rd, model, group, console, servers, t0=t0, timeout_s=timeout_s, live=live
        )
    except ProcessDiedError as exc:
        raise DemoFailedError(
            f"{exc.child.name} died (exit code {exc.code}); the end of {exc.child.log}:",
            tail(exc.child.log),
        ) from exc
    finally:
        clients = {c.name for c in group.children if c.name not in servers}
        codes = group.stop_all(timeout_s=30.0, first=clients)
        logger.info("children stopped: %s", codes)


def _run(
    config: RunConfig,
    rd: Path,
    model: str,
    group: ProcessGroup,
    console: Console,
    servers: set[str],
    *,
    t0: float,
    timeout_s: float,
    live: bool,
) -> dict[str, Any]:
    teacher = config.teacher is not None
    endpoints = Endpoints(
        HOST, free_port(HOST), free_port(HOST), free_port(HOST) if teacher else None
    )
    tokens = Tokens(
        trainer=new_token(),
        worker=new_token(),
        env=new_token(),
        worker_key=new_token(),
        teacher=new_token() if teacher else None,
    )
    launches = derive(
        config,
        run_dir=rd,
        model=model,
        endpoints=endpoints,
        tokens=tokens,
        bucket_uri=str(rd / "bucket"),
    )
    common = demo_environment()
    by_name = {launch.name: launch for launch in launches}
    children = {}
    first = [launch for launch in launches if launch.role == "server"]
    servers.update(launch.name for launch in first)
    for launch in first:  # the servers start together (a teacher loads its model meanwhile)
        children[launch.name] = group.start(launch.name, launch.args, common | launch.env)
    for launch in first:  # and are all up before any client starts
        if launch.health is not None:
            wait_healthy(launch.health, children[launch.name], timeout_s=launch.ready_s)
    console.print(
        f"status page: [link={endpoints.coordinator_url}/]{endpoints.coordinator_url}/[/link]"
    )
    for launch in launches:
        if launch.role != "server":
            children[launch.name] = group.start(launch.name, launch.args, common | launch.env)
    trainer = children["trainer"]
    coord_url = endpoints.coordinator_url
    worker_ids = [n for n, launch in by_name.items() if launch.role == "worker"]
    trainer_dir = rd / "trainer"
    steps = int(config.trainer.get("max_steps", 200))
    task = str(config.env.get("task", "wordle"))

    processes = {c.name: {"pid": c.proc.pid, "log": str(c.log)} for c in group.children}
    (rd / "processes.json").write_text(json.dumps(processes, indent=2) + "\n")
    logs = {wid: WorkerLog(rd / "logs" / f"{wid}.log") for wid in worker_ids}
    deadline = t0 + timeout_s
    final: int | None = None
    status: StatusSummary | None = None
    workers: list[WorkerInfo] = []
    printed_version: int | None = None
    with CoordinatorClient(coord_url, timeout=5.0, retries=0) as client:
        view = Live(console=console, refresh_per_second=2, transient=False) if live else None
        with view if view is not None else nullcontext():
            while True:
                if time.monotonic() > deadline:
                    raise DemoFailedError(_timeout_message(final, workers, timeout_s))
                if final is None and trainer.exit_code() == 0:
                    latest = client.latest_version()
                    if latest is None:
                        raise DemoFailedError("the trainer exited without publishing a version")
                    final = latest.version
                    logger.info("trainer done at v%d; waiting for the workers", final)
                    deadline = min(deadline, time.monotonic() + FINAL_SYNC_TIMEOUT_S)
                group.check_alive({"trainer": 0} if final is not None else None)
                status, workers = _poll(client)
                for log in logs.values():
                    log.update()
                note = (
                    "training"
                    if final is None
                    else f"trainer done (v{final}); workers syncing the final version"
                )
                if view is not None:
                    view.update(
                        live_view(
                            status,
                            workers,
                            logs,
                            elapsed_s=elapsed(t0),
                            steps=steps,
                            status_url=f"{coord_url}/",
                            note=note,
                        )
                    )
                elif status is not None and status.latest_version != printed_version:
                    printed_version = status.latest_version
                    _print_line(console, status, workers, logs, elapsed(t0))
                if final is not None and _workers_done(
                    workers, worker_ids, final, _proofs_expected(config)
                ):
                    break
                time.sleep(1.0)
        versions = _all_versions(client)
    for log in logs.values():
        log.update()
    assert final is not None
    summary = _summarize(config, task, rd, trainer_dir, final, status, workers, logs, versions, t0)
    (rd / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _print_summary(console, summary)
    return summary


def _timeout_message(final: int | None, workers: list[WorkerInfo], timeout_s: float) -> str:
    if final is None:
        return f"the trainer did not finish within {timeout_s:.0f} s (see logs/trainer.log)"
    states = ", ".join(
        f"{w.worker_id}: v{w.applied_version}, weights_verified {w.weights_verified}, "
        f"last error {w.last_error}"
        for w in workers
    )
    return (
        f"the workers did not all reach the final version v{final} within "
        f"{FINAL_SYNC_TIMEOUT_S:.0f} s of the trainer's end ({states or 'none registered'})"
    )


def _proofs_expected(config: RunConfig) -> bool:
    """Whether the trainer hands weight challenges to the coordinator (its default)."""
    publish = config.trainer.get("publish", {})
    return not (isinstance(publish, dict) and publish.get("proof_challenges") == 0)


def _workers_done(
    workers: list[WorkerInfo], ids: list[str], final: int, proofs: bool = True
) -> bool:
    """Every worker holds ``final`` and has proven it (answered a weight challenge at
    ``final``) when the trainer publishes challenges; never when a proof failed."""
    by_id = {w.worker_id: w for w in workers}
    return all(
        (w := by_id.get(i)) is not None
        and w.applied_version == final
        and (w.weights_verified is True if proofs else w.weights_verified is not False)
        for i in ids
    )


def _print_line(
    console: Console,
    status: StatusSummary,
    workers: list[WorkerInfo],
    logs: dict[str, WorkerLog],
    t: float,
) -> None:
    last = status.versions[-1] if status.versions else None
    size = f"{last.kind} {human_bytes(last.bytes)}" if last else "-"
    applied = ", ".join(
        f"{w.worker_id}=" + ("-" if w.applied_version is None else f"v{w.applied_version}")
        for w in workers
    )
    pauses = [p for log in logs.values() for p in log.pauses_ms]
    pause = f", pause p50 {statistics.median(pauses):.1f} ms" if pauses else ""
    reward = f", reward {status.rewards[-1].mean_reward:.3f}" if status.rewards else ""
    console.print(
        f"[{t:5.0f} s] v{status.latest_version}: {size}; queue {status.queue.depth}; "
        f"workers {applied or '-'}{pause}{reward}",
        highlight=False,
    )


def _summarize(
    config: RunConfig,
    task: str,
    rd: Path,
    trainer_dir: Path,
    final: int,
    status: StatusSummary | None,
    workers: list[WorkerInfo],
    logs: dict[str, WorkerLog],
    versions: list[VersionRecord],
    t0: float,
) -> dict[str, Any]:
    record = next(v for v in versions if v.version == final)
    by_id = {w.worker_id: w for w in workers}
    trainer = trainer_final(trainer_dir)
    trainer_digest = trainer["state_digest"] if trainer else record.state_digest
    reported = [by_id[i].weights_verified for i in logs]
    # Always: the bucket's chain must reproduce the trainer's final weights.
    rebuilt, keys = rebuild_digest(str(rd / "bucket"), final)
    chain_ok = rebuilt == record.state_digest == trainer_digest
    proof: dict[str, Any]
    if all(v is True for v in reported):
        proof = {
            "method": "weight-challenge",
            "detail": "each worker answered a fresh weight challenge at "
            f"v{final} correctly (WorkerInfo.weights_verified): a keyed digest, under a nonce "
            "used once, of a nonce-chosen sample of the tensors its engine serves, which the "
            "trainer computed on its own published state and only the coordinator holds; the "
            f"trainer's final checkpoint digest equals v{final}'s, and v{final} rebuilt from the "
            f"bucket ({len(keys)} objects) has it too",
            "proven_versions": {i: by_id[i].weights_proven_version for i in logs},
        }
        identical = [i for i in logs if chain_ok and by_id[i].weights_proven_version == final]
    else:
        identical = [
            i
            for i, log in logs.items()
            if chain_ok and by_id[i].applied_version == final and not log.failures
        ]
        proof = {
            "method": "bucket-rebuild",
            "detail": "the workers proved no weights (the trainer hands out no challenges): v"
            f"{final} rebuilt from the bucket ({len(keys)} objects, every delta checked against "
            "its base and result digests) has the trainer's final state digest, and every "
            "worker applied that chain to v"
            f"{final}, verifying each step against the trainer's digests, without a failure",
        }
    proof |= {
        "trainer_digest": trainer_digest,
        "published_digest": record.state_digest,
        "rebuilt_digest": rebuilt,
    }
    received = {i: log.received_bytes for i, log in logs.items()}
    applied_versions = {i: len(log.applied) for i, log in logs.items()}
    pauses = [p for log in logs.values() for p in log.pauses_ms]
    trained = reward_series(trainer_dir)
    by_version = [(r.version, r.mean_reward) for r in (status.rewards if status else [])]
    image = rd / "reward.png"
    renderer = draw_reward_curve(image, trained, by_version, task=task)
    full_model = record.full_bytes
    return {
        "ok": len(identical) == len(logs),
        "run_dir": str(rd),
        "elapsed_s": round(elapsed(t0), 1),
        "config": config.model_dump(),
        "final_version": final,
        "bytes": bytes_summary(published_manifests(str(rd / "bucket")), config.workers),
        "received": {
            "per_worker": received,
            "objects_per_worker": applied_versions,
            "full_sync_per_worker": {
                i: full_model * len({a[0] for a in log.applied}) for i, log in logs.items()
            },
        },
        "pause_ms": {
            "count": len(pauses),
            "p50": statistics.median(pauses) if pauses else None,
            "max": max(pauses) if pauses else None,
        },
        "workers_identical": identical,
        "workers": list(logs),
        # each worker's last reported weights_digest (None: it reports none)
        "worker_digests": {i: by_id[i].weights_digest for i in logs},
        "proof": proof,
        "reward": {"trained": trained, "by_version": by_version},
        "reward_image": str(image),
        "reward_renderer": renderer,
    }


def _print_summary(console: Console, s: dict[str, Any]) -> None:
    b = s["bytes"]
    console.rule("deltarl demo: summary")
    console.print(f"finished in {s['elapsed_s']:.0f} s; run directory {s['run_dir']}")
    console.print(
        f"versions published: {b['versions']} (v0..v{s['final_version']}), "
        f"{b['anchors']} anchor(s)",
        highlight=False,
    )
    ratio = f"{b['ratio']:.1f}x less" if b["ratio"] else "-"
    console.print(
        f"bytes a follower of every version needs: {human_bytes(b['follower_bytes'])} (the "
        f"first anchor + the cheapest delta of each later version) vs full syncs "
        f"{human_bytes(b['full_sync_bytes_per_version'])} (full model "
        f"{human_bytes(b['full_model_bytes'])} x {b['versions']} versions): {ratio}; stored "
        f"{human_bytes(b['published_bytes'])} (standalone and chained deltas)",
        highlight=False,
    )
    if b["delta_versions"] and b["delta_ratio"]:
        console.print(
            f"  the {b['delta_versions']} delta versions: {human_bytes(b['delta_bytes'])} "
            f"(avg {human_bytes(b['delta_bytes'] / b['delta_versions'])}) vs "
            f"{human_bytes(b['full_model_bytes'] * b['delta_versions'])} as full syncs: "
            f"{b['delta_ratio']:.0f}x less",
            highlight=False,
        )
    for wid, n in s["received"]["per_worker"].items():
        full = s["received"]["full_sync_per_worker"][wid]
        console.print(
            f"  {wid} downloaded {human_bytes(n)} (full syncs of the same versions: "
            f"{human_bytes(full)})",
            highlight=False,
        )
    p = s["pause_ms"]
    if p["count"]:
        console.print(
            f"generation paused per delta sync: p50 {p['p50']:.1f} ms, max {p['max']:.1f} ms "
            f"({p['count']} syncs)",
            highlight=False,
        )
    n, total = len(s["workers_identical"]), len(s["workers"])
    colour = "green" if s["ok"] else "red"
    console.print(
        f"[{colour}]weights: {n}/{total} workers bit-identical to the trainer's final weights "
        f"(v{s['final_version']}, digest {s['proof']['trainer_digest'][:16]}...)[/{colour}]",
        highlight=False,
    )
    console.print(f"proof: {s['proof']['method']}: {s['proof']['detail']}", highlight=False)
    console.print(f"reward curve: {s['reward_image']}", highlight=False)
