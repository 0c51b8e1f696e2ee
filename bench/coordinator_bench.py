"""Load test of the coordinator on loopback: latency, errors and CPU under 1,000 workers.

Simulates, against one coordinator process (started here, either store):

* ``--workers`` rollout workers (default 1,000) heartbeating at 1 Hz each (open loop: a late answer
  does not delay the next heartbeat, so queueing shows up as latency);
* ``--submit-rate`` trajectory-group submissions per second (default 200; each a real
  ``deltarl-traj-v1`` payload of 8 trajectories x 300 tokens, ~22 KB) from random workers;
* one trainer leasing batches of up to 64 groups (long poll) and acking them, and publishing a new
  version every 2 s (so staleness checks run against a moving version);
* ``--readers`` status readers (default 50), each ``GET /v1/status?workers=50`` once per second.

It reports throughput, p50/p99/max latency per request kind, errors (any non-2xx), the coordinator
process's CPU use, and checks that every accepted group was leased and acked exactly once.

The load generator speaks HTTP/1.1 over raw asyncio streams with keep-alive (httpx would cost more
CPU than the server on a 2-core machine). Example::

    python bench/coordinator_bench.py --store sqlite --server-workers 2 --server-cpus 0,1 \
        --load-cpus 2 --duration 20
    python bench/coordinator_bench.py --store redis --server-workers 2 --server-cpus 0,1 \
        --load-cpus 2 --duration 20

Runs on any Linux machine with the project installed (``redis-server`` on the PATH for
``--store redis``); on a machine other jobs share, compare only runs at a similar load average
(``load_average_after``). The result goes to
``bench/results/coordinator_cpu<N>_<store>-<P>proc.json`` (``N``: the cores of ``--server-cpus``,
``P``: ``--server-workers``; ``--json-out`` for another path), which a rerun overwrites.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from common import cpu_tag, meta, result_path, write_json

from deltarl.cluster import free_port
from deltarl.services.coordinator.schemas import (
    ObjectRef,
    Trajectory,
    TrajectoryGroup,
    VersionManifest,
    decode_leased_batch,
    encode_group,
)
from deltarl.weightsync.manifest import version_tag

log = logging.getLogger("coordinator_bench")
TRAINER, WORKER = "bench-trainer-token", "bench-worker-token"


class Conn:
    """One keep-alive HTTP/1.1 connection (requests are sequential on it)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        ctype: str = "application/json",
        token: str = "",
    ) -> tuple[int, bytes]:
        reused = self.writer is not None
        try:
            return await self._request(method, path, body, ctype, token)
        except (ConnectionError, asyncio.IncompleteReadError):
            if not reused:
                raise
            # the server closed an idle keep-alive connection before this request: reconnect once
            self.writer = None
            return await self._request(method, path, body, ctype, token)

    async def _request(
        self, method: str, path: str, body: bytes, ctype: str, token: str
    ) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Length: {len(body)}\r\n"
        if body:
            head += f"Content-Type: {ctype}\r\n"
        if token:
            head += f"X-Deltarl-Token: {token}\r\n"
        self.writer.write(head.encode() + b"\r\n" + body)
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError("server closed the connection")
        status = int(status_line.split()[1])
        length, chunked = 0, False
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            if name.lower() == "content-length":
                length = int(value)
            elif name.lower() == "transfer-encoding" and "chunked" in value:
                chunked = True
        if chunked:
            data = b""
            while True:
                size = int((await self.reader.readline()).strip(), 16)
                chunk = await self.reader.readexactly(size + 2)
                if size == 0:
                    break
                data += chunk[:-2]
            return status, data
        return status, await self.reader.readexactly(length)


class Pool:
    def __init__(self, host: str, port: int, size: int) -> None:
        self.q: asyncio.Queue[Conn] = asyncio.Queue()
        for _ in range(size):
            self.q.put_nowait(Conn(host, port))

    async def request(self, *args: object, **kw: object) -> tuple[int, bytes]:
        conn = await self.q.get()
        try:
            return await conn.request(*args, **kw)  # type: ignore[arg-type]
        except BaseException:
            conn.writer = None  # drop a broken connection
            raise
        finally:
            self.q.put_nowait(conn)


@dataclass
class Stats:
    latencies: dict[str, list[float]] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    error_samples: list[str] = field(default_factory=list)

    def record(
        self, kind: str, seconds: float, status: int, ok: tuple[int, ...], body: bytes
    ) -> None:
        self.latencies.setdefault(kind, []).append(seconds)
        if status not in ok:
            self.errors[kind] = self.errors.get(kind, 0) + 1
            if len(self.error_samples) < 10:
                self.error_samples.append(f"{kind} {status} {body[:200]!r}")


async def timed(
    stats: Stats, kind: str, pool: Pool, *args: object, ok: tuple[int, ...] = (200,), **kw: object
) -> tuple[int, bytes]:
    t0 = time.perf_counter()
    try:
        status, body = await pool.request(*args, **kw)
    except (OSError, asyncio.IncompleteReadError, ConnectionError) as exc:
        status, body = 0, repr(exc).encode()
    stats.record(kind, time.perf_counter() - t0, status, ok, body)
    return status, body


def manifest(version: int) -> dict[str, object]:
    tag = version_tag(version)
    dig = lambda v: f"{v + 1:032x}"  # noqa: E731
    if version == 0:
        obj = ObjectRef(
            key=f"objects/{tag}/a.safetensors",
            kind="anchor",
            format="safetensors",
            size=269_060_096,
            xxh3_128="0" * 32,
            version=0,
            result_digest=dig(0),
        )
    else:
        obj = ObjectRef(
            key=f"objects/{tag}/d.dlt",
            kind="delta",
            format="deltarl-compact-v3",
            size=1_500_000 + random.randrange(500_000),
            xxh3_128="1" * 32,
            version=version,
            base_version=version - 1,
            base_digest=dig(version - 1),
            result_digest=dig(version),
            changed=1_000_000,
        )
    m = VersionManifest(
        version=version,
        step=version,
        created_at=datetime.now(UTC),
        state_digest=dig(version),
        numel=134_530_048,
        full_bytes=269_060_096,
        objects=(obj,),
    )
    return {"manifest": m.model_dump(mode="json")}


def payload(key: str, worker: str, vmin: int, vmax: int) -> bytes:
    rng = random.Random(key)
    trajs = []
    for _ in range(8):
        n = 300
        trajs.append(
            Trajectory(
                tokens=[rng.randrange(49152) for _ in range(n)],
                logprobs=[0.0] * 100 + [-rng.random() * 3 for _ in range(n - 100)],
                mask=[0] * 100 + [1] * (n - 100),
                prompt_len=100,
                reward=rng.random(),
                signals={"greens": rng.random(), "format": 1.0},
                version_min=vmin,
                version_max=vmax,
            )
        )
    return encode_group(
        TrajectoryGroup(idempotency_key=key, worker_id=worker, group_id=key, trajectories=trajs)
    )


def cpu_seconds(pid: int) -> float:
    """CPU time of ``pid`` and its live child processes (uvicorn workers)."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if stat.parent.name == str(pid) or fields[1] == str(pid):
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def run_load(args: argparse.Namespace, port: int) -> dict[str, object]:
    host = "127.0.0.1"
    stats = Stats()
    hb_pool = Pool(host, port, args.connections)
    sub_pool = Pool(host, port, 50)
    read_pool = Pool(host, port, args.readers)
    trainer = Pool(host, port, 2)
    version = 0
    await timed(
        stats,
        "setup",
        trainer,
        "POST",
        "/v1/versions",
        json.dumps(manifest(0)).encode(),
        token=TRAINER,
        ok=(201,),
    )
    workers = [f"worker-{i:04d}" for i in range(args.workers)]
    sem = asyncio.Semaphore(50)

    async def register(w: str) -> None:
        async with sem:
            body = json.dumps(
                {"worker_id": w, "engine": "vllm", "model": "smollm2", "capacity": 8}
            ).encode()
            await timed(stats, "register", hb_pool, "POST", "/v1/workers", body, token=WORKER)

    await asyncio.gather(*(register(w) for w in workers))
    n_sub = int(args.duration * args.submit_rate)
    log.info("pre-encoding %d payloads (off the clock)", n_sub)
    # the publisher adds a version every 2 s, so at time t the latest is about t // 2: cite one
    # version less (never from the future, well within max_staleness=4)
    plan = []
    for i in range(n_sub):
        w = random.choice(workers)
        vmax = max(0, int(i / args.submit_rate) // 2 - 1)
        vmin = max(0, vmax - random.randrange(2))
        plan.append(payload(f"bench-{os.getpid()}-{i}", w, vmin, vmax))
    accepted = 0
    acked = 0
    leased_ids: list[int] = []
    stop = asyncio.Event()

    async def sleep_until(t: float) -> None:
        delay = t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)

    async def heartbeat_loop(i: int, w: str) -> None:
        t = start + i / len(workers)
        path = f"/v1/workers/{w}/heartbeat"
        while t < end:
            await sleep_until(t)
            body = json.dumps(
                {"applied_version": max(0, version - random.randrange(2)), "in_flight": 1}
            ).encode()
            await timed(stats, "heartbeat", hb_pool, "POST", path, body, token=WORKER)
            t += 1.0

    async def submit_one(data: bytes) -> None:
        nonlocal accepted
        status, _ = await timed(
            stats,
            "submit",
            sub_pool,
            "POST",
            "/v1/trajectories",
            data,
            ctype="application/msgpack",
            token=WORKER,
        )
        if status == 200:
            accepted += 1

    async def submitter() -> None:
        tasks = []
        for i, data in enumerate(plan):
            await sleep_until(start + i / args.submit_rate)
            tasks.append(asyncio.create_task(submit_one(data)))
        await asyncio.gather(*tasks)

    async def trainer_loop() -> None:
        nonlocal acked
        body = json.dumps({"max_groups": 64, "wait_s": 0.5, "lease_s": 60}).encode()
        while not stop.is_set():
            status, data = await timed(
                stats, "lease", trainer, "POST", "/v1/batches/lease", body, token=TRAINER
            )
            if status != 200:
                await asyncio.sleep(0.1)
                continue
            batch = decode_leased_batch(data)
            if batch.lease.batch_id:
                leased_ids.extend(i.submission_id for i in batch.lease.items)
                st, _ = await timed(
                    stats,
                    "ack",
                    trainer,
                    "POST",
                    f"/v1/batches/{batch.lease.batch_id}/ack",
                    token=TRAINER,
                )
                if st == 200:
                    acked += len(batch.groups)

    async def publisher() -> None:
        nonlocal version
        t = start + 2
        while t < end:
            await sleep_until(t)
            body = json.dumps(manifest(version + 1)).encode()
            status, _ = await timed(
                stats, "publish", trainer, "POST", "/v1/versions", body, token=TRAINER, ok=(201,)
            )
            if status == 201:
                version += 1
            t += 2

    async def reader(i: int) -> None:
        t = start + i / max(1, args.readers)
        while t < end:
            await sleep_until(t)
            await timed(stats, "status", read_pool, "GET", "/v1/status?workers=50")
            t += 1.0

    start = time.perf_counter() + 1.0
    end = start + args.duration
    cpu0, wall0 = cpu_seconds(args.server_pid), time.perf_counter()
    rcpu0 = cpu_seconds(args.redis_pid) if args.redis_pid else 0.0
    own0 = time.process_time()
    lags: list[float] = []

    async def lag_monitor() -> None:  # this generator's own event-loop lag (its measurement error)
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append(time.perf_counter() - t - 0.01)

    monitor_task = asyncio.create_task(lag_monitor())
    trainer_task = asyncio.create_task(trainer_loop())
    await asyncio.gather(
        submitter(),
        publisher(),
        *(reader(i) for i in range(args.readers)),
        *(heartbeat_loop(i, w) for i, w in enumerate(workers)),
    )
    cpu1, wall1 = cpu_seconds(args.server_pid), time.perf_counter()
    rcpu1 = cpu_seconds(args.redis_pid) if args.redis_pid else 0.0
    own1 = time.process_time()
    # drain: the trainer keeps pulling until everything accepted was acked
    drain_deadline = time.perf_counter() + 30
    while acked < accepted and time.perf_counter() < drain_deadline:
        await asyncio.sleep(0.2)
    stop.set()
    await trainer_task
    await monitor_task
    _, st_body = await read_pool.request("GET", "/v1/status?workers=0")
    status = json.loads(st_body)
    kinds = ["heartbeat", "submit", "status", "lease", "ack", "publish", "register"]
    table = {}
    for k in kinds:
        lat = stats.latencies.get(k, [])
        table[k] = {
            "count": len(lat),
            "per_s": round(len(lat) / args.duration, 1) if k not in ("register",) else None,
            "p50_ms": round(pct(lat, 0.5) * 1e3, 2),
            "p99_ms": round(pct(lat, 0.99) * 1e3, 2),
            "max_ms": round(max(lat, default=float("nan")) * 1e3, 2),
            "errors": stats.errors.get(k, 0),
        }
    return {
        "store": args.store,
        "duration_s": args.duration,
        "workers": args.workers,
        "submit_rate": args.submit_rate,
        "readers": args.readers,
        "requests": table,
        "server_cpu_percent": round(100 * (cpu1 - cpu0) / (wall1 - wall0), 1),
        "redis_cpu_percent": round(100 * (rcpu1 - rcpu0) / (wall1 - wall0), 1),
        "server_workers": args.server_workers,
        "load_generator_cpu_percent": round(100 * (own1 - own0) / (wall1 - wall0), 1),
        "load_generator_loop_lag_ms": {
            "p50": round(pct(lags, 0.5) * 1e3, 2),
            "p99": round(pct(lags, 0.99) * 1e3, 2),
            "max": round(max(lags, default=0.0) * 1e3, 2),
        },
        "accepted": accepted,
        "acked": acked,
        "leased_unique": len(set(leased_ids)),
        "leased_total": len(leased_ids),
        "final_status": {
            "latest_version": status["latest_version"],
            "submitted_total": status["queue"]["submitted_total"],
            "acked_total": status["queue"]["acked_total"],
            "depth": status["queue"]["depth"],
            "dropped": status["queue"]["dropped"],
        },
        "error_samples": stats.error_samples,
    }


def start_redis(tmp: Path, cpus: str | None) -> tuple[subprocess.Popen[bytes], str]:
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server not found: apt-get install -y redis-server")
    port = free_port()
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(tmp),
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--save",
            "",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            break
        except OSError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--store", choices=["sqlite", "redis"], default="sqlite")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--submit-rate", type=float, default=200.0)
    ap.add_argument("--readers", type=int, default=50)
    ap.add_argument("--connections", type=int, default=100, help="Heartbeat connection pool size.")
    ap.add_argument("--server-workers", type=int, default=1, help="Coordinator processes.")
    ap.add_argument("--server-cpus", help="Pin the coordinator (and Redis) to these CPUs, e.g. 0")
    ap.add_argument("--load-cpus", help="Pin this load generator to these CPUs, e.g. 1")
    ap.add_argument("--attach", type=int, help="Load a coordinator already on this port (debug).")
    ap.add_argument("--json-out", type=Path, help="default: bench/results/coordinator_...json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    tmp = Path(tempfile.mkdtemp(prefix="coordbench-"))
    port = free_port()
    env = {
        **os.environ,
        "DELTARL_COORDINATOR_TRAINER_TOKEN": TRAINER,
        "DELTARL_COORDINATOR_WORKER_TOKEN": WORKER,
        "DELTARL_COORDINATOR_STORE": args.store,
        "DELTARL_COORDINATOR_SQLITE_PATH": str(tmp / "coord.sqlite3"),
        "DELTARL_COORDINATOR_MAX_STALENESS": "4",
        "DELTARL_LOG_LEVEL": "WARNING",
        "DELTARL_COORDINATOR_WORKERS": str(args.server_workers),
    }
    redis_proc = None
    args.redis_pid = None
    if args.store == "redis":
        redis_proc, url = start_redis(tmp, args.server_cpus)
        args.redis_pid = redis_proc.pid
        env["DELTARL_COORDINATOR_REDIS_URL"] = url
    server = subprocess.Popen(
        [sys.executable, "-m", "deltarl.services.coordinator", "--port", str(port)], env=env
    )
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.05)
        args.server_pid = server.pid
        result = asyncio.run(run_load(args, port))
    finally:
        server.terminate()
        server.wait(timeout=10)
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    result = {"meta": meta() | {"machine": f"{os.cpu_count()} cores, {platform_name()}"}, **result}
    result["pinning"] = {"server": args.server_cpus, "load": args.load_cpus}
    result["load_average_after"] = os.getloadavg()
    sys.stdout.write(json.dumps(result, indent=2) + "\n")
    cores = len(args.server_cpus.split(",")) if args.server_cpus else None
    name = f"{args.store}-{args.server_workers}proc"
    write_json(args.json_out or result_path("coordinator", cpu_tag(cores), name), result)


def platform_name() -> str:
    import platform

    cpu = "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, Python {platform.python_version()}, {platform.system()}"


if __name__ == "__main__":
    main()
