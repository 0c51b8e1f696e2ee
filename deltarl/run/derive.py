"""What each service of a run gets: command-line arguments and ``DELTARL_*`` variables, derived
from one :class:`~deltarl.run.config.RunConfig`.

The launcher (``deltarl run``, ``deltarl demo``), the GPU benchmark scripts and compose.yaml's
check (tests/deploy) all go through :func:`derive`, so a value declared in ``[run]`` reaches
every service that uses it by one path. Only the standard library and pydantic are imported
here; the settings classes are imported inside :func:`check_services`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltarl.run.config import LAUNCHER_FIELDS, SHARED_FIELDS, RunConfig, _flatten

ENV_PREFIX = {
    "coordinator": "DELTARL_COORDINATOR_",
    "env": "DELTARL_ENV_",
    "rollout": "DELTARL_ROLLOUT_",
}
# stand-ins for the launcher's per-run tokens while a config is checked
_PLACEHOLDERS: dict[str, dict[str, str]] = {
    "coordinator": {"trainer_token": "t" * 32, "worker_token": "w" * 32},
    "env": {"token": "e" * 32},
    "rollout": {"worker_token": "w" * 32, "env_token": "e" * 32},
}
TRAINER_DEPLOYMENT = frozenset({"device"})  # [trainer] keys that are TrainerDeployment's
ROLLOUT_LAUNCH = frozenset({"workers"})  # [rollout] keys the launcher reads itself


@dataclass(frozen=True)
class Tokens:
    """One token per role, generated once per run."""

    trainer: str
    worker: str
    env: str


@dataclass(frozen=True)
class Endpoints:
    """Where the launcher puts the two servers."""

    host: str
    coordinator_port: int
    env_port: int

    @property
    def coordinator_url(self) -> str:
        return f"http://{self.host}:{self.coordinator_port}"

    @property
    def env_url(self) -> str:
        return f"http://{self.host}:{self.env_port}"


@dataclass(frozen=True)
class ServiceLaunch:
    """One process: ``deltarl <args>`` with ``env`` added to the launcher's environment."""

    name: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)


def env_value(value: Any) -> str:
    """A setting as pydantic-settings reads it from the environment."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def section_env(section: str, values: dict[str, Any]) -> dict[str, str]:
    """``{"max_guesses": 1}`` of ``[env]`` -> ``{"DELTARL_ENV_MAX_GUESSES": "1"}``."""
    prefix = ENV_PREFIX[section]
    return {prefix + key.upper(): env_value(v) for key, v in values.items() if v is not None}


def shared_values(config: RunConfig, section: str) -> dict[str, Any]:
    """The ``[run]`` values a section receives, under that service's own field names."""
    run = config.run.model_dump()
    return {f: run[k] for f, k in SHARED_FIELDS[section].items()}


def experiment(config: RunConfig, *, model: str, run_dir: Path) -> dict[str, Any]:
    """The trainer's experiment settings (nested, as ``deltarl train --config`` reads them)."""
    data: dict[str, Any] = {}
    values = {k: v for k, v in _flatten(config.trainer).items() if k not in TRAINER_DEPLOYMENT}
    values |= shared_values(config, "trainer") | {"model": model, "run_dir": str(run_dir)}
    for key, value in values.items():
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return data


def derive(
    config: RunConfig,
    *,
    run_dir: Path,
    model: str,
    endpoints: Endpoints,
    tokens: Tokens,
    bucket_uri: str,
) -> list[ServiceLaunch]:
    """The coordinator, the env server, ``workers`` rollout workers and the trainer, in start
    order. ``model``: the model as the processes load it (a prepared directory, or
    ``config.run.model`` itself). Writes the trainer's resolved experiment to
    ``run_dir/trainer.json``."""
    common = {"DELTARL_BUCKET_URI": bucket_uri}
    coordinator = ServiceLaunch(
        "coordinator",
        ["coordinator", "--host", endpoints.host, "--port", str(endpoints.coordinator_port)],
        common
        | section_env("coordinator", config.coordinator | shared_values(config, "coordinator"))
        | {
            "DELTARL_COORDINATOR_SQLITE_PATH": str(run_dir / "coordinator.sqlite3"),
            "DELTARL_COORDINATOR_TRAINER_TOKEN": tokens.trainer,
            "DELTARL_COORDINATOR_WORKER_TOKEN": tokens.worker,
        },
    )
    env = ServiceLaunch(
        "env",
        ["env", "--host", endpoints.host, "--port", str(endpoints.env_port)],
        common | section_env("env", config.env) | {"DELTARL_ENV_TOKEN": tokens.env},
    )
    rollout = {k: v for k, v in config.rollout.items() if k not in ROLLOUT_LAUNCH}
    shared = shared_values(config, "rollout") | {"model": model}
    workers = []
    for i in range(config.workers):
        wid = f"worker-{i + 1}"
        values = rollout | shared | {"engine_seed": config.run.seed * config.workers + i}
        workers.append(
            ServiceLaunch(
                wid,
                ["rollout"],
                common
                | section_env("rollout", values)
                | {
                    "DELTARL_ROLLOUT_COORDINATOR_URL": endpoints.coordinator_url,
                    "DELTARL_ROLLOUT_WORKER_TOKEN": tokens.worker,
                    "DELTARL_ROLLOUT_ENV_URL": endpoints.env_url,
                    "DELTARL_ROLLOUT_ENV_TOKEN": tokens.env,
                    "DELTARL_ROLLOUT_WORKER_ID": wid,
                },
            )
        )
    trainer_dir = run_dir / "trainer"
    exp_file = run_dir / "trainer.json"
    run_dir.mkdir(parents=True, exist_ok=True)
    exp_file.write_text(
        json.dumps(experiment(config, model=model, run_dir=trainer_dir), indent=2) + "\n"
    )
    trainer = ServiceLaunch(
        "trainer",
        ["train", "--config", str(exp_file)],
        common
        | {
            "DELTARL_TRAINER_COORDINATOR_URL": endpoints.coordinator_url,
            "DELTARL_TRAINER_TOKEN": tokens.trainer,
            "DELTARL_TRAINER_DEVICE": str(config.trainer.get("device", "cpu")),
        },
    )
    return [coordinator, env, *workers, trainer]


def check_services(config: RunConfig) -> None:
    """Validate every section with its service's settings class (ValueError naming the
    section and key): unknown keys, wrong types, out-of-range values."""
    from pydantic import BaseModel, ValidationError

    from deltarl.env_server.settings import EnvSettings
    from deltarl.rollout.settings import RolloutSettings
    from deltarl.services.coordinator.settings import CoordinatorSettings
    from deltarl.trainer.settings import ExperimentSettings

    classes: dict[str, type[BaseModel]] = {
        "coordinator": CoordinatorSettings,
        "env": EnvSettings,
        "rollout": RolloutSettings,
    }
    for section, cls in classes.items():
        values = dict(getattr(config, section))
        if section == "rollout":
            workers = values.pop("workers", 2)
            if not isinstance(workers, int) or isinstance(workers, bool) or not 1 <= workers <= 64:
                raise ValueError(f"[rollout] workers: an integer from 1 to 64, got {workers!r}")
        unknown = sorted(set(values) - set(cls.model_fields) - LAUNCHER_FIELDS[section])
        if unknown:
            raise ValueError(f"[{section}] unknown setting(s): {', '.join(unknown)}")
        values |= shared_values(config, section) | _PLACEHOLDERS.get(section, {})
        try:
            cls.model_validate(values)
        except ValidationError as err:
            raise ValueError(_first_error(section, err)) from None
    data = experiment(config, model=config.run.model, run_dir=Path("run"))
    try:
        ExperimentSettings.model_validate(data)
    except ValidationError as err:
        raise ValueError(_first_error("trainer", err)) from None
    device = config.trainer.get("device", "cpu")
    if not isinstance(device, str):
        raise ValueError(f"[trainer] device: a string such as 'cpu' or 'cuda', got {device!r}")


def _first_error(section: str, err: Any) -> str:
    e = err.errors()[0]
    where = ".".join(str(p) for p in e["loc"])
    return f"[{section}] {where}: {e['msg']} (got {e.get('input')!r})"
