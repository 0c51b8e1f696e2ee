"""Throughput, step latency and memory per session of the Wordle environment server on loopback.

    python bench/env_bench.py --sessions 1000 --rates 1000,2000,3000,max --duration 15 \
        --warmup 4 --idle-sessions 5000

Runs on any Linux machine with the project installed and at least 2 cores (``--pin``, the default
there, gives the server one core and the load generator another). The result goes to
``bench/results/env_server_cpu2_wordle.json`` (pinned; ``cpu<N>`` unpinned; ``--json`` for another
path), which a rerun overwrites.

What it does:

1. starts ``python -m deltarl.env_server`` as a subprocess (pinned to CPU 0 with ``--pin``; this
   process then runs on CPU 1), so server and load generator each get one core;
2. memory per idle session: server RSS before and after opening ``--idle-sessions`` HTTP
   sessions (each reset, then left idle), divided by their number;
3. for each transport (HTTP with stateful sessions, WS) and each target rate: ``--sessions``
   players each hold one session and play games back to back (reset, then guesses until done;
   the answer of a seeded game is known here, so about half the games are won on a random turn).
   Between two requests a player "thinks" for an exponential time of mean sessions / rate, like
   a rollout worker waiting for its model: the offered load is about ``rate`` steps/s.
   ``--rates`` may contain ``max``: no think time (closed loop, every session always has a request
   in flight), which measures saturation throughput; its latency is mostly queueing.

Latency is measured by the client from sending a step to having read the whole answer; the HTTP
client is a minimal keep-alive HTTP/1.1 client on asyncio streams (httpx would be the
bottleneck), the WS client is ``websockets``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import importlib.util
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import websockets
from common import cpu_tag, meta, result_path, write_json

from deltarl.cluster import free_port
from deltarl.env_server.wordle.game import WordLists, answer_for_seed

WORDS = WordLists.load()
GUESSES = sorted(WORDS.allowed)[::37]


@dataclass
class Stats:
    """What one run measured."""

    transport: str
    target_rate: str
    sessions: int
    duration_s: float = 0.0
    steps: int = 0
    resets: int = 0
    games: int = 0
    errors: int = 0
    step_latencies: list[float] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        lat = sorted(self.step_latencies) or [float("nan")]

        def pct(p: float) -> float:
            return 1000 * lat[min(len(lat) - 1, int(p * len(lat)))]

        return {
            "transport": self.transport,
            "target_steps_per_s": self.target_rate,
            "sessions": self.sessions,
            "steps_per_s": round(self.steps / self.duration_s),
            "requests_per_s": round((self.steps + self.resets) / self.duration_s),
            "games_per_s": round(self.games / self.duration_s, 1),
            "step_p50_ms": round(pct(0.50), 2),
            "step_p99_ms": round(pct(0.99), 2),
            "step_mean_ms": round(1000 * statistics.fmean(lat), 2),
            "errors": self.errors,
        }


def moves_for(seed: int, rng: random.Random) -> list[str]:
    """A game plan: random guesses, the answer on a random turn in about half the games."""
    plan = [f"[{w}]" for w in rng.sample(GUESSES, 6)]
    if rng.random() < 0.5:
        plan[rng.randrange(6)] = f"[{answer_for_seed(WORDS, seed)}]"
    return plan


class RawHttp:
    """Keep-alive HTTP/1.1 POST over one connection; just enough for this benchmark."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader
        self.writer: asyncio.StreamWriter

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def post(self, path: str, payload: bytes) -> tuple[int, bytes]:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        ).encode()
        self.writer.write(head + payload)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        status = int(raw[9:12])
        i = raw.lower().find(b"content-length:")
        length = int(raw[i + 15 : raw.find(b"\r\n", i)])
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()


async def think(rng: random.Random, mean_s: float) -> None:
    if mean_s > 0:
        await asyncio.sleep(rng.expovariate(1.0 / mean_s))


async def http_player(
    pid: int, host: str, port: int, stats: Stats, stop: asyncio.Event, think_s: float
) -> None:
    rng = random.Random(pid)
    conn = RawHttp(host, port)
    await conn.connect()
    sid = None
    game = 0
    try:
        while not stop.is_set():
            seed = pid * 100_000 + game
            body: dict[str, Any] = (
                {"seed": seed} if sid is None else {"seed": seed, "session_id": sid}
            )
            status, raw = await conn.post("/reset", json.dumps(body).encode())
            if status != 200:
                stats.errors += 1
                return
            sid = json.loads(raw)["session_id"]
            stats.resets += 1
            for move in moves_for(seed, rng):
                await think(rng, think_s)
                if stop.is_set():
                    return
                payload = json.dumps({"session_id": sid, "action": {"message": move}}).encode()
                started = time.perf_counter()
                status, raw = await conn.post("/step", payload)
                stats.step_latencies.append(time.perf_counter() - started)
                stats.steps += 1
                if status != 200:
                    stats.errors += 1
                    break
                if b'"done":true' in raw:
                    stats.games += 1
                    break
            game += 1
    finally:
        if sid is not None:
            await conn.post("/close", json.dumps({"session_id": sid}).encode())
        conn.close()


async def ws_player(pid: int, url: str, stats: Stats, stop: asyncio.Event, think_s: float) -> None:
    rng = random.Random(pid)
    game = 0
    async with websockets.connect(url, max_size=None) as ws:
        while not stop.is_set():
            seed = pid * 100_000 + game
            await ws.send(json.dumps({"type": "reset", "data": {"seed": seed}}))
            await ws.recv()
            stats.resets += 1
            for move in moves_for(seed, rng):
                await think(rng, think_s)
                if stop.is_set():
                    return
                started = time.perf_counter()
                await ws.send(json.dumps({"type": "step", "data": {"message": move}}))
                raw = await ws.recv()
                stats.step_latencies.append(time.perf_counter() - started)
                stats.steps += 1
                if '"type":"error"' in raw:
                    stats.errors += 1
                    break
                if '"done":true' in raw:
                    stats.games += 1
                    break
            game += 1


async def run_load(
    transport: str, host: str, port: int, sessions: int, rate: str, duration: float, warmup: float
) -> Stats:
    think_s = 0.0 if rate == "max" else sessions / float(rate)
    stats = Stats(transport, rate, sessions)
    stop = asyncio.Event()
    if transport == "http":
        players = [http_player(i, host, port, stats, stop, think_s) for i in range(sessions)]
    else:
        url = f"ws://{host}:{port}/ws"
        players = [ws_player(i, url, stats, stop, think_s) for i in range(sessions)]
    tasks = [asyncio.create_task(p) for p in players]
    await asyncio.sleep(warmup)  # connections opened, think times spread out
    stats.steps = stats.resets = stats.games = stats.errors = 0
    stats.step_latencies.clear()
    started = time.perf_counter()
    await asyncio.sleep(duration)
    stats.duration_s = time.perf_counter() - started
    snapshot = Stats(
        transport,
        rate,
        sessions,
        stats.duration_s,
        stats.steps,
        stats.resets,
        stats.games,
        stats.errors,
        list(stats.step_latencies),
    )
    stop.set()
    await asyncio.wait(tasks, timeout=30)
    return snapshot


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def idle_memory(host: str, port: int, pid: int, n: int) -> dict[str, Any]:
    """Server RSS growth per session: right after reset, then after 5 guesses each."""
    conn = RawHttp(host, port)
    await conn.connect()
    for _ in range(200):  # warm allocator and caches first
        _, raw = await conn.post("/reset", b"{}")
        await conn.post(
            "/close", json.dumps({"session_id": json.loads(raw)["session_id"]}).encode()
        )
    before = rss_bytes(pid)
    sids = []
    for i in range(n):
        _, raw = await conn.post("/reset", json.dumps({"seed": i}).encode())
        sids.append(json.loads(raw)["session_id"])
    after_reset = rss_bytes(pid)
    for sid in sids:
        for word in ("crane", "pious", "dumpy", "fight", "blown"):
            body = {"session_id": sid, "action": {"message": f"[{word}]"}}
            await conn.post("/step", json.dumps(body).encode())
    after_play = rss_bytes(pid)
    for sid in sids:
        await conn.post("/close", json.dumps({"session_id": sid}).encode())
    conn.close()
    return {
        "idle_sessions": n,
        "rss_before_mb": round(before / 2**20, 1),
        "bytes_per_session_after_reset": round((after_reset - before) / n),
        "bytes_per_session_after_5_guesses": round((after_play - before) / n),
    }


def server_stack() -> str:
    """What uvicorn's "auto" picks in this environment (the server inherits it)."""
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    return f"uvicorn {importlib.metadata.version('uvicorn')} ({http}, {loop}), websockets {websockets.__version__}"


def start_server(port: int, pin: bool) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "DELTARL_ENV_PORT": str(port),
        "DELTARL_ENV_HOST": "127.0.0.1",
        "DELTARL_ENV_MAX_SESSIONS": "100000",
        "DELTARL_LOG_LEVEL": "WARNING",
    }
    cmd = [sys.executable, "-m", "deltarl.env_server"]
    if pin:
        cmd = ["taskset", "-c", "0", *cmd]
    proc = subprocess.Popen(cmd, env=env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the env server did not start")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}, {platform.system()} {platform.release()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--rates", default="1000,2000,3000,max", help="target steps/s, or max")
    parser.add_argument("--transports", default="http,ws")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds measured per run")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--idle-sessions", type=int, default=5000)
    parser.add_argument(
        "--pin", action=argparse.BooleanOptionalAction, default=(os.cpu_count() or 1) >= 2
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="default: bench/results/env_server_...json"
    )
    args = parser.parse_args()

    port = free_port()
    server = start_server(port, args.pin)
    if args.pin:
        os.sched_setaffinity(0, {1})
    results: dict[str, Any] = {
        "meta": meta() | {"machine": machine()},
        "server": server_stack(),
        "runs": [],
    }
    try:
        results["memory"] = asyncio.run(
            idle_memory("127.0.0.1", port, server.pid, args.idle_sessions)
        )
        print(json.dumps(results["memory"]), flush=True)
        for transport in args.transports.split(","):
            for rate in args.rates.split(","):
                stats = asyncio.run(
                    run_load(
                        transport,
                        "127.0.0.1",
                        port,
                        args.sessions,
                        rate,
                        args.duration,
                        args.warmup,
                    )
                )
                results["runs"].append(stats.row())
                print(json.dumps(stats.row()), flush=True)
        results["load_average"] = os.getloadavg()
    finally:
        server.terminate()
        server.wait(10)
    hardware = cpu_tag(2) if args.pin else cpu_tag()
    write_json(args.json or result_path("env_server", hardware, "wordle"), results)
    cols = list(results["runs"][0]) if results["runs"] else []
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in results["runs"]:
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
