"""Render docs/configuration.md from the settings classes themselves (one source of truth).

    python -m deltarl.config_reference > docs/configuration.md

A test (tests/unit/test_config_reference.py) fails when the file and the classes disagree, so the
reference cannot go stale. Deployment settings are environment variables; the trainer's
experiment settings are TOML keys (``deltarl train -c exp.toml``, ``--set key=value``).
"""

from __future__ import annotations

import importlib
import sys
import types
import typing
from typing import Any

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

# (title, module, class, what it configures)
DEPLOYMENT: list[tuple[str, str, str, str]] = [
    (
        "Coordinator",
        "deltarl.services.coordinator.settings",
        "CoordinatorSettings",
        "`deltarl coordinator` ([docs/coordinator.md](coordinator.md))",
    ),
    (
        "Environment server",
        "deltarl.env_server.settings",
        "EnvSettings",
        "`deltarl env` ([docs/env_server.md](env_server.md))",
    ),
    (
        "Rollout worker",
        "deltarl.rollout.settings",
        "RolloutSettings",
        "`deltarl rollout` ([docs/rollout.md](rollout.md))",
    ),
    (
        "Teacher",
        "deltarl.teacher.settings",
        "TeacherSettings",
        "`deltarl teacher` ([docs/teacher.md](teacher.md))",
    ),
    (
        "Trainer (deployment)",
        "deltarl.trainer.settings",
        "TrainerDeployment",
        "`deltarl train`: where it connects ([docs/trainer.md](trainer.md))",
    ),
    (
        "Supervised warm start",
        "deltarl.trainer.supervised.sft",
        "SftSettings",
        "`deltarl sft` ([docs/wordle.md](wordle.md))",
    ),
    (
        "Bucket",
        "deltarl.buckets.settings",
        "BucketSettings",
        "every process that reads or writes the bucket ([docs/buckets.md](buckets.md))",
    ),
]


def _is_secret(field: FieldInfo) -> bool:
    """A field typed ``SecretStr`` (alone or in a union with None): its default is not shown.
    Decided by type, not by name (``max_new_tokens`` is no secret)."""
    annotation = field.annotation
    return annotation is SecretStr or SecretStr in getattr(annotation, "__args__", ())


def _default(name: str, field: FieldInfo) -> str:
    if field.default_factory is not None:
        return "computed"
    if field.is_required():
        return "required"
    value = field.default
    if _is_secret(field) and value:
        return "(secret)"
    if isinstance(value, BaseModel):
        return "see below"
    if value is None:
        return "unset"
    if value == "":
        return '`""`'
    if isinstance(value, tuple | list):
        return "`" + ", ".join(str(v) for v in value) + "`" if value else "empty"
    return f"`{value}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def deployment_table(cls: type[BaseModel]) -> list[str]:
    prefix = str(cls.model_config.get("env_prefix", "")).upper()
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for name, field in cls.model_fields.items():
        rows.append(
            f"| `{prefix}{name.upper()}` | {_default(name, field)} | "
            f"{_cell(field.description or '')} |"
        )
    return rows


def _model_of(field: FieldInfo) -> type[BaseModel] | None:
    ann = field.annotation
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _choices_of(field: FieldInfo) -> list[type[BaseModel]]:
    """The models of a union field (an engine: one of the engines' settings), else []."""
    members: list[Any] = []
    todo = list(typing.get_args(field.annotation))
    while todo:  # Optional[Annotated[A | B, discriminator]] -> [A, B]
        a = todo.pop(0)
        if typing.get_origin(a) is typing.Annotated:
            todo.insert(0, typing.get_args(a)[0])
        elif typing.get_origin(a) in (typing.Union, types.UnionType):
            todo[:0] = typing.get_args(a)
        elif a is not type(None):
            members.append(a)
    models = [a for a in members if isinstance(a, type) and issubclass(a, BaseModel)]
    return models if len(models) > 1 and len(models) == len(members) else []


def experiment_rows(cls: type[BaseModel], path: str = "") -> list[str]:
    rows: list[str] = []
    for name, field in cls.model_fields.items():
        key = f"{path}{name}"
        sub = _model_of(field)
        choices = _choices_of(field)
        if sub is not None:
            rows += experiment_rows(sub, key + ".")
        elif choices:
            rows.append(f"| `{key}` | {_default(name, field)} | {_cell(field.description or '')} |")
            for choice in choices:
                rows += experiment_rows(choice, key + ".")
        else:
            rows.append(f"| `{key}` | {_default(name, field)} | {_cell(field.description or '')} |")
    return rows


def render() -> str:
    out = [
        "# Configuration reference",
        "",
        "Generated from the settings classes by `python -m deltarl.config_reference >",
        "docs/configuration.md`; a test fails when this file and the code disagree.",
        "",
        "Deployment settings come from environment variables (pydantic-settings, case-insensitive;",
        "each service's `--help` lists its own). Secret defaults are never shown. Services also",
        "take `--host` and `--port`, which override their `HOST`/`PORT` variables.",
        "",
    ]
    for title, module, name, what in DEPLOYMENT:
        cls = getattr(importlib.import_module(module), name)
        out += [f"## {title}", "", f"{what}: `{module}.{name}`.", ""]
        out += deployment_table(cls)
        out.append("")
    from deltarl.trainer.settings import ExperimentSettings

    out += [
        "## Trainer experiment (TOML)",
        "",
        "`deltarl train -c exp.toml` reads these keys (dotted keys are TOML tables);",
        "`--set key=value` overrides one (the value parsed as JSON when it parses, else a",
        "string). The resolved settings are written into the run directory.",
        "",
        "| key | default | meaning |",
        "|---|---|---|",
        *experiment_rows(ExperimentSettings),
        "",
    ]
    from deltarl.rollout.settings import WorkerExperiment

    out += [
        "## Rollout worker experiment (TOML)",
        "",
        "`deltarl rollout --config worker.toml` (or `DELTARL_ROLLOUT_CONFIG`) reads these keys",
        "(dotted keys are TOML tables); in a run config they are `[rollout]`'s, beside `workers`",
        "and the worker's deployment settings above, with `engine.model`, `engine.seed`,",
        "`episodes.group_size`, `episodes.sampling.temperature` and `episodes.routing_replay`",
        "from `[run]`. The engine's keys depend on its `type` (rows of both engines below).",
        "",
        "| key | default | meaning |",
        "|---|---|---|",
        *experiment_rows(WorkerExperiment),
        "",
    ]
    from deltarl.run.config import SHARED_FIELDS, SharedSettings

    shared = {
        key: ", ".join(
            f"[{section}] {field}"
            for section, f in SHARED_FIELDS.items()
            for field, k in f.items()
            if k == key
        )
        for key in SharedSettings.model_fields
    }
    out += [
        "## Run config `[run]` (TOML)",
        "",
        "`deltarl run exp.toml` ([docs/run.md](run.md)): the values several services must agree",
        "on, declared once; the other sections (`[coordinator]`, `[env]`, `[rollout]`,",
        "`[trainer]`) take the keys above, without these.",
        "",
        "| key | default | meaning | handed to |",
        "|---|---|---|---|",
        *(
            f"| `{name}` | {_default(name, field)} | {_cell(field.description or '')} | "
            f"{shared[name]} |"
            for name, field in SharedSettings.model_fields.items()
        ),
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    del argv
    sys.stdout.write(render())


if __name__ == "__main__":
    main()


__all__: list[Any] = ["render"]
