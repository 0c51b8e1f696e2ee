"""``deltarl demo`` end to end: the whole system as processes on loopback (tiny model, Wordle, one
step: the anchor and a delta; a Wordle step of this model takes ~40 s of CPU, and long delta
chains followed bit-exactly are tests/e2e/test_learning.py's, 20 versions), and the demo's
process handling (a child that dies is reported with its log)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import httpx
import pytest
from support import GENEROUS_S

from deltarl.cluster import Child, ProcessDiedError, ProcessGroup, free_port, wait_healthy
from deltarl.demo.report import WorkerLog, plain_png, rebuild_digest

pytestmark = pytest.mark.network

STEPS = 1
WORKERS = 2


@pytest.fixture(scope="module")
def demo_run(
    tmp_path_factory: pytest.TempPathFactory, model_cache: Path
) -> tuple[subprocess.CompletedProcess[str], Path]:
    root = tmp_path_factory.mktemp("demo")
    run_dir = root / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTARL_")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "deltarl",
            "demo",
            "--tiny",
            "--task",
            "wordle",
            "--steps",
            str(STEPS),
            "--workers",
            str(WORKERS),
            "--run-dir",
            str(run_dir),
            "--cache-dir",
            str(model_cache),
            "--no-live",
            "--timeout",
            "240",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    return proc, run_dir


def test_demo_tiny_end_to_end(demo_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, run_dir = demo_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "status page: http://127.0.0.1:" in out
    assert f"versions published: {STEPS + 1} (v0..v{STEPS})" in out
    assert f"{WORKERS}/{WORKERS} workers bit-identical to the trainer's final weights" in out
    assert "reward curve:" in out

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ok"] is True
    assert summary["final_version"] == STEPS
    assert summary["bytes"]["versions"] == STEPS + 1
    assert summary["bytes"]["anchors"] == 1
    # real deltas (the tiny model's weight decay changes ~2% of the elements per step), far
    # smaller than full syncs
    assert 1000 * STEPS < summary["bytes"]["delta_bytes"] < summary["bytes"]["full_model_bytes"]
    assert summary["bytes"]["published_bytes"] < summary["bytes"]["full_sync_bytes_per_version"]
    assert sorted(summary["workers_identical"]) == sorted(summary["workers"])
    assert len(summary["workers"]) == WORKERS
    # the trainer hands out weight challenges by default: every worker proved the final weights
    proof = summary["proof"]
    assert proof["method"] == "weight-challenge", proof
    assert proof["proven_versions"] == {w: STEPS for w in summary["workers"]}
    assert proof["trainer_digest"] == proof["published_digest"] == proof["rebuilt_digest"]
    # the bucket-rebuild proof on its own: the chain in the bucket gives the trainer's weights
    digest, keys = rebuild_digest(str(run_dir / "bucket"), STEPS)
    assert digest == proof["trainer_digest"]
    assert len(keys) == STEPS + 1
    # every worker followed every version (anchor, then one delta per step)
    assert all(n == STEPS + 1 for n in summary["received"]["objects_per_worker"].values())

    image = Path(summary["reward_image"])
    assert image.parent == run_dir
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    logs = {p.name for p in (run_dir / "logs").iterdir()}
    assert {"coordinator.log", "env.log", "trainer.log", "demo.log"} <= logs
    assert {f"worker-{i + 1}.log" for i in range(WORKERS)} <= logs


def test_demo_stops_every_process(demo_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    """No child outlives the demo: every port it used is free again."""
    proc, _ = demo_run
    assert proc.returncode == 0
    url = proc.stdout.split("status page: ", 1)[1].split()[0]

    with pytest.raises(httpx.TransportError):
        httpx.get(url + "health", timeout=2.0)


def test_dead_child_is_reported_with_its_log(tmp_path: Path) -> None:
    """A service that exits at start (here: a coordinator without tokens) raises
    ProcessDiedError naming it, and its log says why."""
    group = ProcessGroup(tmp_path / "logs")
    env = {"DELTARL_COORDINATOR_INSECURE": "false"}
    for key in ("DELTARL_COORDINATOR_TRAINER_TOKEN", "DELTARL_COORDINATOR_WORKER_TOKEN"):
        env[key] = ""
    port = free_port()
    child = group.start("coordinator", ["coordinator", "--port", str(port)], env)
    try:
        with pytest.raises(ProcessDiedError) as info:
            wait_healthy(f"http://127.0.0.1:{port}/health", child, timeout_s=60)
        assert info.value.child.name == "coordinator"
        assert info.value.code != 0
        assert "DELTARL_COORDINATOR_TRAINER_TOKEN" in child.log.read_text()
    finally:
        group.stop_all(timeout_s=5)


def test_stop_all_kills_what_ignores_sigterm(tmp_path: Path) -> None:
    """SIGTERM first, SIGKILL after the timeout."""
    group = ProcessGroup(tmp_path / "logs")
    child = group.start("exited", ["--version"], {})
    child.proc.wait(timeout=60)  # a child that already exited is left alone
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    group.children.append(Child("ignores-sigterm", proc, tmp_path / "none.log"))
    t0 = time.monotonic()
    codes = group.stop_all(timeout_s=1.0)
    assert codes["ignores-sigterm"] == -9
    assert time.monotonic() - t0 < GENEROUS_S  # it sleeps 60 s unless killed


def test_an_interrupt_while_stopping_kills_every_child(tmp_path: Path) -> None:
    """Ctrl-C again while stop_all waits for a slow client: every child still running, the
    services not yet signalled included, is killed at once and the interrupt goes through (a
    demo interrupted twice left its coordinator and env server running)."""
    group = ProcessGroup(tmp_path / "logs")
    ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN)"
    for name in ("coordinator", "trainer"):
        proc = subprocess.Popen(
            [sys.executable, "-c", f"{ignore}; print('ready', flush=True); time.sleep(60)"],
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        group.children.append(Child(name, proc, tmp_path / f"{name}.log"))

    def second_interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, second_interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5)  # during the 30 s wait for the trainer
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            group.stop_all(timeout_s=30.0, first={"trainer"})
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - t0 < GENEROUS_S  # not the 30 s wait
    assert {c.name: c.exit_code() for c in group.children} == {"coordinator": -9, "trainer": -9}


def test_worker_log_reads_applied_objects_incrementally(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_text(
        "x INFO deltarl.rollout.sync.weights: weights at v0 via anchor (6443632 bytes): paused 0.71 "
        "ms, download 3.3 ms, decode 4.2 ms, verify 0.7 ms\n"
    )
    w = WorkerLog(log)
    w.update()
    with log.open("a") as fh:
        fh.write(
            "x INFO deltarl.rollout.sync.weights: weights at v1 via delta (55339 bytes): paused 0.52 "
            "ms, download 0.1 ms\nx ERROR deltarl.rollout.sync.weights: weights unhealthy: drift\n"
            "partial line without newl"
        )
    w.update()
    assert w.applied == [(0, "anchor", 6443632, 0.71), (1, "delta", 55339, 0.52)]
    assert w.received_bytes == 6443632 + 55339
    assert w.pauses_ms == [0.52] and w.last_pause_ms == 0.52
    assert len(w.failures) == 1


def test_plain_png_without_matplotlib(tmp_path: Path) -> None:
    path = tmp_path / "r.png"
    plain_png(path, [[(1, 0.0), (2, 0.5), (3, 0.25)], [(0, 0.1)]], w=64, h=32)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    idat = data.index(b"IDAT")
    size = int.from_bytes(data[idat - 4 : idat], "big")
    assert len(zlib.decompress(data[idat + 4 : idat + 4 + size])) == 32 * (1 + 64 * 3)


def test_demo_reports_a_dead_worker_and_stops_the_rest(tmp_path: Path, model_cache: Path) -> None:
    """kill -9 of a worker mid-run: the demo names it, shows its log, stops every other process
    and exits with 1. On the charset task (byte-level tiny model, no tokenizer to parse per
    process): ~30 s against ~80 s on Wordle, whose demo test_demo_tiny_end_to_end runs."""
    run_dir = tmp_path / "run"
    out_path = tmp_path / "out.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTARL_")}
    with out_path.open("w") as out:
        demo = subprocess.Popen(
            [
                *(sys.executable, "-m", "deltarl", "demo", "--tiny", "--task", "charset"),
                *("--steps", "50", "--no-live"),
                *("--run-dir", str(run_dir), "--cache-dir", str(model_cache)),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + 120
        # the first delta's status line (the line shows the newest version: v1 may be skipped)
        while not re.search(r" v\d+: delta", out_path.read_text()):
            assert demo.poll() is None, out_path.read_text()
            assert time.monotonic() < deadline, out_path.read_text()
            time.sleep(0.5)
        pids = {
            k: v["pid"] for k, v in json.loads((run_dir / "processes.json").read_text()).items()
        }
        os.kill(pids["worker-2"], 9)
        assert demo.wait(timeout=90) == 1
    finally:
        if demo.poll() is None:
            demo.kill()
    text = out_path.read_text()
    assert "worker-2 died (exit code -9)" in text
    assert "registered as worker-2" in text  # the tail of its log
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # every child is gone


def test_bytes_summary_counts_what_a_follower_downloads() -> None:
    """Per version the cheapest delta from the version before (a chained one where published),
    the first version's anchor; everything stored is reported apart."""
    from coordinator.helpers import manifest

    from deltarl.demo.report import bytes_summary

    manifests = []
    for v in range(4):
        m = manifest(v, delta_size=1000, anchor_size=50_000)
        if v >= 2:  # a chained twin, 600 bytes
            twin = m.objects[-1].model_copy(
                update={"key": f"{m.objects[-1].key}.c", "size": 600, "context_version": v - 2}
            )
            m = m.model_copy(update={"objects": (*m.objects, twin)})
        manifests.append(m)
    b = bytes_summary(manifests, workers=2)
    assert b["follower_bytes"] == 50_000 + 1000 + 600 + 600
    assert b["delta_bytes"] == 2200 and b["delta_versions"] == 3
    assert b["published_bytes"] == 50_000 + 3 * 1000 + 2 * 600
    assert b["stored_delta_bytes"] == 4200
    assert b["ratio"] == pytest.approx(4 * manifests[-1].full_bytes / 52_200)
