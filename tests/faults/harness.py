"""The fault suite's harness: a deltarl deployment as real processes on loopback.

:class:`Cluster` starts ``python -m deltarl coordinator|env|rollout|train`` children
(:class:`deltarl.cluster.ProcessGroup`), each with its own log file per incarnation
(``w1.1.log``, ``w1.2.log`` after a restart), on fixed ports so that a restarted coordinator is
found at the same URL. Faults are ``kill -9`` (:meth:`Cluster.kill`) and damaged bucket objects;
every wait is a poll with a deadline (:func:`wait_for`), never a fixed sleep.

:class:`Ledger` counts what happened to the trajectories the coordinator accepted, from its own
API (``/v1/status``) and the trainer's checkpoint: accepted = acked + queued + leased, nothing
dropped, acked = trained by the trainer's surviving lineage.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sqlite3
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from deltarl.cluster import Child, ProcessGroup, free_port, tail, wait_healthy
from deltarl.run.config import RunConfig
from deltarl.run.derive import Endpoints, RunLayout, ServiceLaunch, Tokens
from deltarl.services.coordinator.client import CoordinatorClient, CoordinatorError
from deltarl.services.coordinator.schemas import StatusSummary, WorkerInfo

HOST = "127.0.0.1"
TRAINER_TOKEN = "faults-trainer-token-0123456789abcdef"
WORKER_TOKEN = "faults-worker-token-0123456789abcdef"
ENV_TOKEN = "faults-env-token-0123456789abcdef"
GROUP_SIZE = 2
GROUPS_PER_STEP = 1


TRAINER_OUTAGE_BUG = (
    "the trainer died of the coordinator restart (a transport error escaped its loop; "
    "pull_groups retries lease requests through an outage since this was fixed); restarted "
    "with --resume, nothing was lost"
)


TIMEOUT_SCALE = float(os.environ.get("DELTARL_TEST_TIMEOUT_SCALE", "1"))
FAULTS_DIR = Path(__file__).resolve().parent


def _with_path(folder: Path) -> str:
    """PYTHONPATH with ``folder`` first (the children import fast_coordinator from it)."""
    rest = os.environ.get("PYTHONPATH")
    return os.pathsep.join([str(folder), *([rest] if rest else [])])


def wait_for(cond: Callable[[], Any], timeout: float, what: str | Callable[[], str]) -> Any:
    """Poll ``cond`` every 50 ms until it returns something truthy; fail after ``timeout`` s
    (times ``DELTARL_TEST_TIMEOUT_SCALE``: vLLM workers take a minute or more to start)."""
    timeout *= TIMEOUT_SCALE
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout:.0f} s: " + (what if isinstance(what, str) else what())
            )
        time.sleep(0.05)


def checkpoint_meta(trainer_dir: Path) -> dict[str, Any] | None:
    """``trainer.json`` of the trainer's newest committed checkpoint (None: none yet)."""
    ckpt = trainer_dir / "checkpoints"
    pointer = ckpt / "latest"
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        return dict(json.loads((ckpt / name / "trainer.json").read_text()))
    return None


@dataclass
class Ledger:
    """Where every accepted group is, from the coordinator's counters (``/v1/status``)."""

    accepted: int
    acked: int
    queued: int
    leased: int
    dropped: dict[str, int]
    idempotent_retries: int

    @classmethod
    def read(cls, client: CoordinatorClient) -> Ledger:
        q = client.status().queue
        return cls(
            q.submitted_total, q.acked_total, q.depth, q.leased, dict(q.dropped), q.duplicates_total
        )

    @property
    def lost(self) -> int:
        """Accepted groups that are neither acknowledged, queued nor leased (must be 0)."""
        return self.accepted - self.acked - self.queued - self.leased

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"lost": self.lost}


@dataclass
class Cluster:
    """Coordinator, env server, rollout workers and trainer of one run, as processes."""

    root: Path
    model_dir: Path
    store: str = "sqlite"  # or "redis"
    redis_url: str | None = None
    redis_prefix: str = "faults"
    # extra settings of each section of the run config (test knobs)
    coordinator_settings: dict[str, Any] = field(default_factory=dict)
    rollout_settings: dict[str, Any] = field(default_factory=dict)
    trainer_settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.group = ProcessGroup(self.root / "logs")
        self.bucket = self.root / "bucket"
        self.trainer_dir = self.root / "trainer"
        self.sqlite_path = self.root / "coordinator.sqlite3"
        endpoints = Endpoints(HOST, free_port(HOST), free_port(HOST))
        self.coord_port, self.env_port = endpoints.coordinator_port, endpoints.env_port
        self.url, self.env_url = endpoints.coordinator_url, endpoints.env_url
        # the services' settings come from one run config, like `deltarl run`'s (deltarl/run)
        self.layout = RunLayout(
            self.run_config(),
            self.root,
            str(self.model_dir),
            endpoints,
            Tokens(trainer=TRAINER_TOKEN, worker=WORKER_TOKEN, env=ENV_TOKEN),
            str(self.bucket),
        )
        self.coordinator: Child | None = None
        self.env: Child | None = None
        self.trainer: Child | None = None
        self.workers: dict[str, Child] = {}
        self.fault_dirs: dict[str, Path] = {}
        self._incarnations: dict[str, int] = {}
        self._ended: set[str] = set()  # children this test stopped or killed on purpose
        self.client = CoordinatorClient(self.url, TRAINER_TOKEN, timeout=5.0, retries=0)

    def run_config(self) -> RunConfig:
        coordinator: dict[str, Any] = {
            "store": self.store,
            "heartbeat_interval_s": 0.25,
            "lost_after_s": 5.0,
            "target_queue_groups": 6,
        }
        if self.redis_url is not None:
            coordinator |= {"redis_url": self.redis_url, "redis_prefix": self.redis_prefix}
        engine: dict[str, Any] = {"device": "cpu"}
        if os.environ.get("DELTARL_TEST_ROLLOUT_ENGINE") == "vllm":  # the suite on a GPU box
            engine = {"type": "vllm", "gpu_memory_utilization": 0.12}
        rollout: dict[str, Any] = {
            "engine": engine,
            "episodes": {"max_turns": 2, "sampling": {"max_new_tokens": 6}},
            "in_flight_groups": 1,
            "heartbeat_interval_s": 0.2,
            "sync_poll_s": 0.5,
            "admission_wait_s": 0.1,
            "shutdown_grace_s": 2.0,
            "submit_timeout_s": 60.0,
        }
        trainer: dict[str, Any] = {
            "device": "cpu",
            "max_steps": 100000,
            "optimizer": {
                "lr": 1e-3,
                # AdamW's decay moves a random model's weights although every advantage is 0:
                # real, sparse deltas at every step
                "weight_decay": 0.1,
            },
            "batch": {
                "groups_per_step": GROUPS_PER_STEP,
                "micro_batch_size": GROUP_SIZE * GROUPS_PER_STEP,
                "lease_s": 3.0,
            },
            "publish": {"anchor_every": 0},
            "checkpoint": {"every": 1, "keep": 2},
        }
        return RunConfig.model_validate(
            {
                # no group is ever dropped as stale: every accepted group is trained or queued
                "run": {"group_size": GROUP_SIZE, "max_staleness": 100000},
                "env": {"max_guesses": 1, "max_invalid_moves": 1, "allow_non_words": True},
                "coordinator": coordinator | self.coordinator_settings,
                "rollout": rollout | self.rollout_settings,
                "trainer": trainer | self.trainer_settings,
            }
        )

    # ------------------------------------------------------------------ processes

    def common_env(self) -> dict[str, str]:
        return {
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
            "DELTARL_LOG_LEVEL": "INFO",
            "PYTHONUNBUFFERED": "1",
        }

    def _start(
        self,
        launch: ServiceLaunch,
        extra_env: dict[str, str] | None = None,
        module: str = "deltarl",
    ) -> Child:
        name = launch.name
        n = self._incarnations[name] = self._incarnations.get(name, 0) + 1
        env = self.common_env() | launch.env | (extra_env or {})
        return self.group.start(f"{name}.{n}", launch.args, env, module=module)

    def start_coordinator(self, wait: bool = True) -> Child:
        # `deltarl coordinator` with the tests' pacing (fast_coordinator.py): the audits read
        # /v1/status and need it uncached
        launch = self.layout.coordinator()
        args = launch.args[launch.args.index("coordinator") + 1 :]
        self.coordinator = self._start(
            ServiceLaunch(launch.name, args, launch.env),
            {"PYTHONPATH": _with_path(FAULTS_DIR)},
            module="fast_coordinator",
        )
        if wait:
            wait_healthy(f"{self.url}/health", self.coordinator)
        return self.coordinator

    def start_env(self) -> Child:
        self.env = self._start(self.layout.env())
        wait_healthy(f"{self.env_url}/health", self.env)
        return self.env

    def start_worker(self, wid: str, seed: int = 0) -> Child:
        fault_dir = self.fault_dirs.setdefault(wid, self.root / "faults" / wid)
        fault_dir.mkdir(parents=True, exist_ok=True)
        launch = self.layout.worker(0, worker_id=wid, seed=seed)
        self.workers[wid] = self._start(launch, {"DELTARL_TEST_FAULT_DIR": str(fault_dir)})
        return self.workers[wid]

    def start_trainer(self, *, resume: bool = False) -> Child:
        launch = self.layout.trainer()
        if resume:
            launch = ServiceLaunch(launch.name, [*launch.args, "--resume"], launch.env)
        self.trainer = self._start(launch)
        return self.trainer

    def kill(self, child: Child, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to the child's process group and wait for its exit code."""
        self._ended.add(child.name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.proc.pid, sig)
        return child.proc.wait(timeout=30)

    def stop(self, child: Child, timeout: float = 30.0) -> int:
        """SIGTERM and wait (SIGKILL after ``timeout``)."""
        self._ended.add(child.name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.proc.pid, signal.SIGTERM)
        try:
            return child.proc.wait(timeout=timeout)
        except Exception:
            return self.kill(child)

    def close(self) -> None:
        """Kill every child still running (the scenarios checked what they needed already)."""
        self.client.close()
        for child in reversed(self.group.children):
            if child.exit_code() is None:
                self.kill(child)

    def check_alive(self) -> None:
        """Fail with the log's tail if a current child died."""
        for child in [self.coordinator, self.env, self.trainer, *self.workers.values()]:
            if (
                child is not None
                and child.name not in self._ended
                and child.exit_code() is not None
            ):
                raise AssertionError(
                    f"{child.name} exited with {child.exit_code()}:\n{tail(child.log, 40)}"
                )

    def restart_coordinator(self) -> tuple[Ledger, Ledger]:
        """``kill -9`` the coordinator and start it again on the same port, with the workers
        frozen (SIGSTOP) meanwhile, so that no submission changes the count of accepted groups
        around the restart (the trainer keeps running). Returns the ledger read just before the
        kill (once two reads in a row agree) and just after the restart."""
        assert self.coordinator is not None
        frozen = [w for w in self.workers.values() if w.exit_code() is None]
        for w in frozen:
            os.killpg(w.proc.pid, signal.SIGSTOP)
        try:
            last: list[int] = []

            def settled() -> Ledger | None:
                led = self.ledger()
                same = bool(last) and last[-1] == led.accepted
                last.append(led.accepted)
                return led if same else None

            before: Ledger = wait_for(settled, 10, "the accepted count did not settle")
            assert self.kill(self.coordinator, signal.SIGKILL) == -signal.SIGKILL
            self.start_coordinator()
            after = self.ledger()
        finally:
            for w in frozen:
                os.killpg(w.proc.pid, signal.SIGCONT)
        return before, after

    def trainer_outage_death(self) -> str | None:
        """If the trainer process died of a coordinator outage (a transport error escaping its
        loop: fixed, so the restart scenarios fail on it), the error line of its log; else
        None."""
        t = self.trainer
        if t is None or t.name in self._ended or t.exit_code() is None:
            return None
        lines = tail(t.log, 60).splitlines()
        errors = [ln for ln in lines if re.match(r"httpx\.(\w+Error): ", ln.strip())]
        if not errors or not any(
            "source.lease(" in ln or "source.ack(" in ln or "extend" in ln for ln in lines
        ):
            return None
        self._ended.add(t.name)
        where = next(
            (
                ln.strip()
                for ln in reversed(lines)
                if ln.strip().startswith("File ") and "deltarl/trainer" in ln
            ),
            "",
        )
        return f"{t.name} exited with {t.exit_code()}: {errors[-1].strip()} ({where})"

    def wait_progress_after_restart(self, version: int, timeout: float = 120.0) -> str | None:
        """Wait for a version newer than ``version``. A trainer that died of the coordinator's
        restart (:meth:`trainer_outage_death`) is restarted with ``--resume`` (what an operator
        would do) and the reason returned, so the caller can fail with it."""
        died: list[str] = []

        def newer() -> bool:
            if not died and (why := self.trainer_outage_death()) is not None:
                died.append(why)
                self.start_trainer(resume=True)
            self.check_alive()
            v = self.latest()
            return v is not None and v > version

        wait_for(newer, timeout, f"no version after v{version}")
        return died[0] if died else None

    # ------------------------------------------------------------------ reads

    def status(self) -> StatusSummary:
        return self.client.status()

    def worker(self, wid: str) -> WorkerInfo | None:
        try:
            return self.client.worker(wid)
        except CoordinatorError:
            return None

    def latest(self) -> int | None:
        rec = self.client.latest_version()
        return None if rec is None else rec.version

    def ledger(self) -> Ledger:
        return Ledger.read(self.client)

    def wait_versions(self, at_least: int, timeout: float = 60.0) -> int:
        """Wait until the coordinator records a version >= ``at_least``."""

        def newer() -> int | None:
            self.check_alive()
            v = self.latest()
            return v if v is not None and v >= at_least else None

        return int(wait_for(newer, timeout, f"no version >= {at_least}"))

    def wait_accepted(self, at_least: int, timeout: float = 60.0) -> Ledger:
        def enough() -> Ledger | None:
            self.check_alive()
            led = self.ledger()
            return led if led.accepted >= at_least else None

        return wait_for(enough, timeout, f"fewer than {at_least} groups accepted")  # type: ignore[no-any-return]

    def wait_submitted(self, wid: str, more_than: int, timeout: float = 60.0) -> WorkerInfo:
        """Wait until ``wid`` had more than ``more_than`` groups accepted."""

        def more() -> WorkerInfo | None:
            self.check_alive()
            w = self.worker(wid)
            return w if w is not None and w.submitted > more_than else None

        return wait_for(  # type: ignore[no-any-return]
            more, timeout, lambda: f"{wid} submitted nothing new: {self.worker(wid)}"
        )

    def wait_verified(
        self, wid: str, version: int | None = None, timeout: float = 60.0, min_rejoins: int = 0
    ) -> WorkerInfo:
        """Wait until ``wid`` reports weights verified by the coordinator at ``version`` (or at
        the latest version at each poll)."""

        def ok() -> WorkerInfo | None:
            self.check_alive()
            w = self.worker(wid)
            want = version if version is not None else self.latest()
            if w is None or w.applied_version is None or w.applied_version != want:
                return None
            if w.rejoins < min_rejoins:  # still the record of a killed incarnation
                return None
            return w if w.weights_verified is True and w.state == "active" else None

        return wait_for(  # type: ignore[no-any-return]
            ok, timeout, lambda: f"{wid} not verified at v{version}: {self.worker(wid)}"
        )

    def store_rows(self) -> tuple[int, list[tuple[str, str, int, int]]]:
        """(idempotency keys the store remembers, (worker id, group id, version_min,
        version_max) of every group it still describes). SQLite keeps a row per accepted group
        after the ack (without its payload): every group. Redis keeps the key of every accepted
        group but the metadata of unacknowledged ones only."""
        if self.store == "sqlite":
            rows = self.submissions()
            return len(rows), rows
        import redis

        assert self.redis_url is not None
        r = redis.Redis.from_url(self.redis_url)
        try:
            keys = int(r.hlen(f"{self.redis_prefix}:idem"))
            metas = [
                json.loads(m)
                for k in r.scan_iter(f"{self.redis_prefix}:s:*")
                if (m := r.hget(k, "meta")) is not None
            ]
        finally:
            r.close()
        return keys, [
            (m["worker_id"], m["group_id"], int(m["version_min"]), int(m["version_max"]))
            for m in metas
        ]

    def losses(self, before: Ledger | None = None) -> dict[str, Any]:
        """What a scenario lost: the coordinator's counters, the store's rows, the workers'
        logs. Every count but the ledger must be 0."""
        # the workers keep submitting: compare the store with a ledger read on both sides of
        # it that did not move meanwhile (the store's submit is one atomic script)
        for _ in range(50):
            led = self.ledger()
            keys, rows = self.store_rows()
            if self.ledger().accepted == led.accepted:
                break
            time.sleep(0.05)
        pairs = [(w, g) for w, g, _, _ in rows]
        unverified = self.unverified(rows)
        out: dict[str, Any] = {
            "ledger": led.as_dict(),
            "accepted_but_lost": led.lost,
            "dropped": sum(led.dropped.values()),
            "duplicated": len(pairs) - len(set(pairs)),
            "store_keys_vs_accepted": keys - led.accepted,
            "unverified_submissions": len(unverified),
            "groups_audited_for_verification": len(rows),
        }
        if unverified:
            out["unverified_examples"] = unverified[:5]
        if before is not None:
            out["accepted_went_backwards"] = max(0, before.accepted - led.accepted)
            out["acked_went_backwards"] = max(0, before.acked - led.acked)
        return out

    def unverified(self, rows: list[tuple[str, str, int, int]]) -> list[tuple[str, str, int, int]]:
        """Groups that cite a version their worker never applied and verified (per its logs,
        every incarnation)."""
        logs: dict[str, list[Path]] = {}
        for child in self.group.children:
            wid = child.name.rsplit(".", 1)[0]
            if wid in self.workers:
                logs.setdefault(wid, []).append(child.log)
        verified = {wid: verified_versions(paths) for wid, paths in logs.items()}
        return [r for r in rows if not {r[2], r[3]} <= verified.get(r[0], set())]

    def submissions(self) -> list[tuple[str, str, int, int]]:
        """(worker id, group id, version_min, version_max) of every accepted group (SQLite
        store only: rows are kept after the ack, without their payloads)."""
        con = sqlite3.connect(f"file:{self.sqlite_path}?mode=ro", uri=True, timeout=10)
        try:
            rows = con.execute(
                "SELECT worker_id, group_id, version_min, version_max FROM submissions"
            ).fetchall()
        finally:
            con.close()
        return [(str(a), str(b), int(c), int(d)) for a, b, c, d in rows]


class FaultReport:
    """What every scenario lost (must be zero), gathered into one JSON file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.t0 = time.monotonic()
        self.scenarios: dict[str, dict[str, Any]] = {}

    def add(self, name: str, **values: Any) -> str:
        """Record a scenario; returns the JSON text (for assertion messages)."""
        self.scenarios[name] = values
        self.write()
        return json.dumps(values, sort_keys=True, default=str)

    def write(self) -> None:
        body = {"elapsed_s": round(time.monotonic() - self.t0, 1), "scenarios": self.scenarios}
        self.path.write_text(json.dumps(body, indent=2, sort_keys=True, default=str) + "\n")


def assert_nothing_lost(report: FaultReport, name: str, values: dict[str, Any]) -> None:
    text = report.add(name, **values)
    for key in (
        "accepted_but_lost",
        "dropped",
        "duplicated",
        "store_keys_vs_accepted",
        "unverified_submissions",
        "accepted_went_backwards",
        "acked_went_backwards",
        "acked_not_in_lineage",
        "acked_twice",
        "workers_not_identical",
        "chain_inconsistent",
    ):
        assert values.get(key, 0) == 0, f"{name}: {key} = {values.get(key)}: {text}"


# ---------------------------------------------------------------------- fault points


def arm(fault_dir: Path, point: str) -> None:
    """Make the worker block at ``point`` (rollout/fault_points.py) the next time it gets there."""
    (fault_dir / f"{point}.reached").unlink(missing_ok=True)
    (fault_dir / f"{point}.hold").write_text("")


def reached(fault_dir: Path, point: str) -> dict[str, Any] | None:
    path = fault_dir / f"{point}.reached"
    if not path.is_file():
        return None
    return dict(json.loads(path.read_text()))


def disarm(fault_dir: Path, point: str) -> None:
    (fault_dir / f"{point}.hold").unlink(missing_ok=True)
    (fault_dir / f"{point}.reached").unlink(missing_ok=True)


# ---------------------------------------------------------------------- worker logs

_VERIFIED = re.compile(r"weights at v(\d+) via (anchor|delta) \((\d+) bytes\)")
_SYNC = re.compile(
    r"sync v(\S+) -> v(\d+): planned (\d+) bytes, downloaded (\d+) bytes, (\d+) failure"
)


def verified_versions(logs: list[Path]) -> set[int]:
    """Versions a worker applied and verified, from its logs (every incarnation)."""
    out: set[int] = set()
    for log in logs:
        if log.is_file():
            out |= {int(m.group(1)) for m in _VERIFIED.finditer(log.read_text(errors="replace"))}
    return out


def sync_lines(log: Path) -> list[dict[str, int | None]]:
    """Every ``sync ... planned ... downloaded ...`` line of a worker log."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    return [
        {
            "from": None if m.group(1) == "None" else int(m.group(1)),
            "to": int(m.group(2)),
            "planned": int(m.group(3)),
            "downloaded": int(m.group(4)),
            "failures": int(m.group(5)),
        }
        for m in _SYNC.finditer(text)
    ]


def health_ok(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.TransportError:
        return False
