"""The compose ``cpu`` profile for real, on a Docker engine (marker ``docker``).

Builds every image of the profile (coordinator, env server, rollout-cpu, which the CPU trainer
runs too), brings ``docker compose --profile cpu up`` under a project name of its own, and polls
the coordinator's REST API (``GET /v1/status``, ``GET /v1/workers``) until the rollout worker in
its container has applied and verified (``weights_verified``: its weights digest equals the
trainer's) a version after the anchor (a delta on top of it), and the trainer has acked the
batches of that step. Then it checks the trainer's log (no httpx line per lease poll) and always
ends with ``docker compose down -v`` (the containers killed at once: no graceful stop is checked
here, and the CPU trainer would finish its step first). Timings (build per image, up to healthy,
first version, each version applied) are printed; docker/README.md records them.

Base images: ``docker pull`` first (the real ``python:3.11-slim`` and ``redis:7-alpine`` where a
registry is reachable), else the local ones (the stand-ins ``tools/docker-setup.sh`` builds on a
host without Docker Hub); neither: the test fails and says so. torch for rollout-cpu: a local CPU
wheel (``$DELTARL_TORCH_WHEEL_DIR``, default ``/opt/wheels``) is linked into ``docker/wheels/``
(kept there, git-ignored, so the layer cache holds across runs); without one the image takes torch
from ``$TORCH_INDEX_URL`` (PyTorch's CPU index by default). Images build with the classic builder
(``DOCKER_BUILDKIT=0``: BuildKit may fetch its frontend from Docker Hub) and keep their layer
cache between runs. Skipped only when ``docker info`` fails (no Docker engine), and then a
failure under ``DELTARL_REQUIRE_DOCKER=1`` (CI).

The builds start in a thread of their own as soon as pytest has collected this test
(tests/deploy/conftest.py: ``start_early``), and the test runs last in the session, so that they
overlap the rest of the suite (~190 s in CI, 2 cores); the test waits for
them, and a failed build fails it with the build's log, as before.

Environment knobs: ``DELTARL_COMPOSE_TEST_TIMEOUT_S`` (the run after ``up``, default 900 s),
``DELTARL_COMPOSE_TEST_BUILD_TIMEOUT_S`` (each image build, default 1800 s).
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import free_port

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
WHEELS = ROOT / "docker" / "wheels"
BASE_IMAGES = ("python:3.11-slim", "redis:7-alpine")
# one compose service per image to build (trainer-cpu runs the rollout-cpu image)
IMAGES = {"coordinator": "coordinator", "env": "env", "rollout-cpu": "rollout-cpu"}
PROFILE = "cpu"
TRAINER, WORKER = "trainer-cpu", "rollout-cpu"
# one delta after the anchor shows the deployment works (images, network, volumes, tokens, health
# checks, the bucket shared); longer delta chains are the fault and e2e suites' (each CPU step in
# these containers takes minutes on 2 cores)
VERSIONS_AFTER_ANCHOR = 1
RUN_TIMEOUT_S = float(os.environ.get("DELTARL_COMPOSE_TEST_TIMEOUT_S", "900"))
BUILD_TIMEOUT_S = float(os.environ.get("DELTARL_COMPOSE_TEST_BUILD_TIMEOUT_S", "1800"))
POLL_S = 2.0
HEALTHY = "up to healthy (every service)"

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def _run(argv: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)


def _docker_problem() -> str | None:
    if shutil.which("docker") is None:
        return "no docker command on PATH"
    try:
        out = _run(["docker", "info"], timeout=30)
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer within 30 s"
    if out.returncode != 0:
        return f"`docker info` failed: {(out.stderr or out.stdout).strip()[-300:]}"
    return None


def _compose_command() -> list[str]:
    """``docker compose`` (the CLI plugin) or the standalone ``docker-compose``, Compose v2."""
    for argv in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(argv[0]) is None:
            continue
        out = _run([*argv, "version", "--short"], timeout=30)
        if out.returncode == 0 and out.stdout.strip().lstrip("v").startswith("2"):
            return argv
    pytest.fail(
        "Compose v2 is not installed (`docker compose` or `docker-compose`): run "
        "tools/docker-setup.sh"
    )


def _base_images() -> dict[str, str]:
    """Pull each base image (the real one where a registry answers), else use the local one."""
    origin: dict[str, str] = {}
    for image in BASE_IMAGES:
        try:
            pulled = _run(["docker", "pull", "-q", image], timeout=300).returncode == 0
        except subprocess.TimeoutExpired:
            pulled = False
        if pulled:
            origin[image] = "pulled"
        elif _run(["docker", "image", "inspect", image], timeout=30).returncode == 0:
            origin[image] = "local (no registry: a stand-in, see tools/docker-setup.sh)"
        else:
            pytest.fail(
                f"base image {image} can't be pulled and is not here: run "
                "tools/docker-setup.sh (it builds stand-ins where Docker Hub is "
                "unreachable)"
            )
    return origin


def _torch_wheels() -> str:
    """Link a local CPU torch wheel into docker/wheels/ (kept: the layer cache depends on it)."""
    have = sorted(WHEELS.glob("torch-*.whl"))
    if have:
        return f"local wheel {have[0].name} (docker/wheels/)"
    source = Path(os.environ.get("DELTARL_TORCH_WHEEL_DIR", "/opt/wheels"))
    found = sorted(source.glob("torch-*cp311*.whl")) if source.is_dir() else []
    if not found:
        index = os.environ.get("TORCH_INDEX_URL", "PyTorch's CPU index")
        return f"{index} (no local wheel in {source})"
    target = WHEELS / found[-1].name
    try:
        os.link(found[-1], target)
    except OSError:
        shutil.copy2(found[-1], target)
    return f"local wheel {target.name} (from {source})"


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def _groups_per_step() -> int:
    """``batch.groups_per_step`` from trainer-cpu's command in compose.yaml."""
    command = yaml.safe_load(COMPOSE.read_text())["services"][TRAINER]["command"]
    for key, value in itertools.pairwise(command):
        if key == "--set" and value.startswith("batch.groups_per_step="):
            return int(value.partition("=")[2])
    return 8  # BatchSettings' default


class Stack:
    """One compose project: its command line, environment and timings."""

    def __init__(self, compose: list[str]) -> None:
        self.project = f"deltarl-test-{os.getpid()}-{secrets.token_hex(3)}"
        self.base = [*compose, "-f", str(COMPOSE), "-p", self.project, "--profile", PROFILE]
        self.coordinator_port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DELTARL_", "HF_"))}
        self.env = env | {
            "DELTARL_COORDINATOR_TRAINER_TOKEN": secrets.token_urlsafe(32),
            "DELTARL_COORDINATOR_WORKER_TOKEN": secrets.token_urlsafe(32),
            "COORDINATOR_HOST_PORT": str(self.coordinator_port),
            "ENV_HOST_PORT": str(free_port()),
            "DOCKER_BUILDKIT": "0",
            "COMPOSE_DOCKER_CLI_BUILD": "0",
        }
        self.url = f"http://127.0.0.1:{self.coordinator_port}"
        self.timings: dict[str, float] = {}

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return _run([*self.base, *args], timeout=timeout, cwd=ROOT, env=self.env)

    def build(self, service: str) -> None:
        args = ["build"]
        if os.environ.get("TORCH_INDEX_URL") and service == "rollout-cpu":
            args += ["--build-arg", f"TORCH_INDEX_URL={os.environ['TORCH_INDEX_URL']}"]
        t0 = time.monotonic()
        out = self.compose(*args, service, timeout=BUILD_TIMEOUT_S)
        self.timings[f"build {IMAGES[service]}"] = time.monotonic() - t0
        assert out.returncode == 0, (
            f"building {service} failed:\n{(out.stdout + out.stderr)[-4000:]}"
        )

    def states(self) -> dict[str, dict[str, Any]]:
        """Service -> its container's ``docker compose ps`` entry (State, Health, ExitCode)."""
        out = self.compose("ps", "-a", "--format", "json", timeout=60)
        if out.returncode != 0 or not out.stdout.strip():
            return {}
        text = out.stdout.strip()
        rows = (
            json.loads(text) if text.startswith("[") else [json.loads(x) for x in text.splitlines()]
        )
        return {r["Service"]: r for r in rows}

    def memory(self) -> dict[str, float]:
        """Service -> its container's memory use now (GiB, ``docker stats``)."""
        out = _run(
            ["docker", "stats", "--no-stream", "--format", "{{.Name}} {{.MemUsage}}"], timeout=60
        )
        units = {"KiB": 2.0**-20, "MiB": 2.0**-10, "GiB": 1.0, "B": 2.0**-30}
        usage: dict[str, float] = {}
        for line in out.stdout.splitlines():
            name, _, used = line.partition(" ")
            if not name.startswith(self.project + "-"):
                continue
            value = used.split("/")[0].strip()
            for unit, scale in units.items():
                if value.endswith(unit):
                    service = name.removeprefix(self.project + "-").rsplit("-", 1)[0]
                    usage[service] = float(value.removesuffix(unit)) * scale
                    break
        return usage

    def logs(self, *services: str, tail: int = 60) -> str:
        out = self.compose("logs", "--no-color", "--tail", str(tail), *services, timeout=60)
        return out.stdout + out.stderr


class Builds:
    """The base images, the torch wheel and every image of the profile, built in a thread of
    their own: their notes and timings, or what went wrong (re-raised by ``wait``)."""

    def __init__(self) -> None:
        self.notes: dict[str, str] = {}
        self.timings: dict[str, float] = {}
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._build, name="compose-image-builds", daemon=True)
        self.thread.start()

    def _build(self) -> None:
        try:
            self.notes["base images"] = ", ".join(f"{k} {v}" for k, v in _base_images().items())
            self.notes["torch"] = _torch_wheels()
            builder = Stack(_compose_command())  # image names are compose.yaml's, not per project
            try:
                for service in IMAGES:
                    builder.build(service)
            finally:
                self.timings = builder.timings
        except BaseException as exc:  # pytest.fail's Failed too: the test re-raises it
            self.error = exc

    def wait(self) -> None:
        """Until every build is done; raises what one raised (a failed build: its log)."""
        self.thread.join()
        if self.error is not None:
            raise self.error


_builds: Builds | None = None

# conftest.py: these tests run last; start_early() is called once collection is done
STARTS_EARLY = frozenset({"test_compose_cpu_profile_trains"})


def start_early() -> None:
    """Start the builds now (no Docker engine: nothing; the fixture skips or fails)."""
    global _builds
    if _builds is None and _docker_problem() is None:
        _builds = Builds()


def _started_builds() -> Builds:
    """The builds start_early() started, else (this test alone, say) builds started now."""
    global _builds
    if _builds is None:
        _builds = Builds()
    return _builds


@pytest.fixture
def stack() -> Iterator[Stack]:
    problem = _docker_problem()
    if problem is not None:
        if os.environ.get("DELTARL_REQUIRE_DOCKER") == "1":  # CI: the engine must be there
            pytest.fail(f"DELTARL_REQUIRE_DOCKER=1 but no Docker engine: {problem}")
        pytest.skip(f"needs a Docker engine: {problem} (tools/docker-setup.sh as root)")
    s = Stack(_compose_command())
    try:
        yield s
    finally:
        s.compose("down", "-v", "--remove-orphans", "--timeout", "0", timeout=300)


def _report(stack: Stack, notes: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    with capsys.disabled():
        print(f"\ncompose {PROFILE} profile ({stack.project}):")
        for key, value in notes.items():
            print(f"  {key}: {value}")
        for key, seconds in stack.timings.items():
            print(f"  {key}: {seconds:.0f} s")


def test_compose_cpu_profile_trains(stack: Stack, capsys: pytest.CaptureFixture[str]) -> None:
    builds = _started_builds()
    notes: dict[str, str] = {}
    try:
        t0 = time.monotonic()
        try:
            builds.wait()
        finally:
            stack.timings["waiting for the builds (this test)"] = time.monotonic() - t0
            notes |= builds.notes
            stack.timings |= builds.timings
        _up_and_train(stack, notes)
    finally:
        _report(stack, notes, capsys)


def _up_and_train(stack: Stack, notes: dict[str, str]) -> None:
    t0 = time.monotonic()
    out = stack.compose("up", "-d", "--no-build", timeout=600)
    assert out.returncode == 0, (
        f"compose up failed:\n{(out.stdout + out.stderr)[-4000:]}\n" + stack.logs()
    )
    stack.timings["up -d (containers started)"] = time.monotonic() - t0
    deadline = t0 + RUN_TIMEOUT_S
    groups_per_step = _groups_per_step()
    anchor: int | None = None
    applied: dict[int, float] = {}  # version -> seconds after `up`, verified on the worker
    status: dict[str, Any] = {}
    workers: list[dict[str, Any]] = []
    peak: dict[str, float] = {}  # service -> the most memory seen (GiB)
    polls = 0
    while True:
        elapsed = time.monotonic() - t0
        polls += 1
        if polls % 5 == 1:
            for service, gib in stack.memory().items():
                peak[service] = max(gib, peak.get(service, 0.0))
        states = stack.states()
        for service in (TRAINER, WORKER):
            state = states.get(service, {})
            assert state.get("State") in ("running", "created", "restarting"), (
                f"{service} is {state.get('State')} (exit code {state.get('ExitCode')}):\n"
                + stack.logs(service, tail=80)
            )
        if (
            HEALTHY not in stack.timings
            and states
            and all(s.get("Health") == "healthy" for s in states.values())
        ):
            stack.timings[HEALTHY] = elapsed
        try:
            status = _get(f"{stack.url}/v1/status")
            workers = _get(f"{stack.url}/v1/workers")
        except OSError:
            status, workers = {}, []
        if anchor is None and status.get("latest_anchor") is not None:
            anchor = int(status["latest_anchor"])
        for w in workers:
            v = w.get("applied_version")
            if v is not None and w.get("weights_verified") is True and v not in applied:
                applied[v] = elapsed
                label = "first version" if len(applied) == 1 else "version"
                stack.timings[f"{label} v{v} applied and verified (after up)"] = elapsed
        assert not any(w.get("weights_verified") is False for w in workers), (
            f"a worker's weights differ from the trainer's: {workers}"
        )
        acked = int(status.get("queue", {}).get("acked_total", 0))
        if anchor is not None:
            target = anchor + VERSIONS_AFTER_ANCHOR
            done = [v for v in applied if v >= target]
            if done and acked >= VERSIONS_AFTER_ANCHOR * groups_per_step:
                break
        if time.monotonic() > deadline:
            pytest.fail(
                f"after {RUN_TIMEOUT_S:.0f} s: anchor {anchor}, applied and verified {applied}, "
                f"acked groups {acked} (want {VERSIONS_AFTER_ANCHOR * groups_per_step}); "
                f"status {json.dumps(status)[:1500]}\n" + stack.logs(TRAINER, WORKER)
            )
        time.sleep(POLL_S)
    notes["memory (largest sample)"] = ", ".join(
        f"{k} {v:.1f} GiB" for k, v in sorted(peak.items())
    )
    notes["versions applied and verified"] = ", ".join(f"v{v}" for v in sorted(applied))
    notes["acked groups"] = str(acked)
    trainer_log = stack.logs(TRAINER, tail=2000)
    steps = [line for line in trainer_log.splitlines() if "trainer.metrics: step " in line]
    notes["trainer steps"] = "; ".join(line.split("INFO ")[-1][:160] for line in steps)
    requests = [line for line in trainer_log.splitlines() if "HTTP Request:" in line]
    assert not requests, f"the trainer logs httpx's request lines ({len(requests)}): {requests[:3]}"
