"""What each service of a run gets: command-line arguments and ``DELTARL_*`` variables, derived
from one :class:`~deltarl.run.config.RunConfig`.

The launcher (``deltarl run``, ``deltarl demo``), the GPU benchmark scripts and compose.yaml's
check (tests/deploy) all go through :func:`derive`, so a value declared in ``[run]`` reaches
every service that uses it by one path. Only the standard library and pydantic are imported
here; the settings classes are imported inside :func:`check_services`.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, create_model

from deltarl.run.config import LAUNCHER_FIELDS, SHARED_FIELDS, RunConfig, _flatten

ENV_PREFIX = {
    "coordinator": "DELTARL_COORDINATOR_",
    "env": "DELTARL_ENV_",
    "rollout": "DELTARL_ROLLOUT_",
    "teacher": "DELTARL_TEACHER_",
}
# stand-ins for the launcher's per-run tokens while a config is checked
_PLACEHOLDERS: dict[str, dict[str, str]] = {
    "coordinator": {"trainer_token": "t" * 32, "worker_token": "w" * 32},
    "env": {"token": "e" * 32},
    "rollout": {"worker_token": "w" * 32, "env_token": "e" * 32},
    "teacher": {"token": "s" * 32},
}
TRAINER_DEPLOYMENT = frozenset({"device"})  # [trainer] keys that are TrainerDeployment's
ROLLOUT_LAUNCH = frozenset({"workers"})  # [rollout] keys the launcher reads itself


@dataclass(frozen=True)
class Tokens:
    """One token per role, generated once per run. With ``worker_key``, each worker gets its
    own token derived from it (per-worker credentials) and the coordinator accepts no shared
    worker token."""

    trainer: str
    worker: str
    env: str
    worker_key: str | None = None
    teacher: str | None = None  # the teacher service's (only with a [teacher] section)

    def coordinator_env(self) -> dict[str, str]:
        if self.worker_key is not None:
            return {"DELTARL_COORDINATOR_WORKER_KEY": self.worker_key}
        return {"DELTARL_COORDINATOR_WORKER_TOKEN": self.worker}

    def for_worker(self, worker_id: str) -> str:
        if self.worker_key is None:
            return self.worker
        from deltarl.services.coordinator.auth import worker_token_for

        return worker_token_for(self.worker_key, worker_id)


@dataclass(frozen=True)
class Endpoints:
    """Where the launcher puts the servers (the teacher's only with a [teacher] section)."""

    host: str
    coordinator_port: int
    env_port: int
    teacher_port: int | None = None

    @property
    def coordinator_url(self) -> str:
        return f"http://{self.host}:{self.coordinator_port}"

    @property
    def env_url(self) -> str:
        return f"http://{self.host}:{self.env_port}"

    @property
    def teacher_url(self) -> str:
        if self.teacher_port is None:
            raise ValueError("a [teacher] section needs a teacher port (Endpoints.teacher_port)")
        return f"http://{self.host}:{self.teacher_port}"


@dataclass(frozen=True)
class ServiceLaunch:
    """One process: ``deltarl <args>`` with ``env`` added to the launcher's environment.

    ``role``: ``server`` (the coordinator, the env server, the teacher: started first and waited
    for at ``health``, stopped last), ``worker`` or ``trainer`` (clients)."""

    name: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    role: Literal["server", "worker", "trainer"] = "worker"
    health: str | None = None  # URL answering 200 once the server is ready
    ready_s: float = 60.0  # how long the launcher waits for ``health``


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


def experiment_env(config: RunConfig, section: str, *, model: str) -> dict[str, str]:
    """The ``DELTARL_*`` variables of a server's experiment settings: its section and the
    ``[run]`` values it shares, ``model`` as the process loads it; no deployment (the
    launcher's and ``--run-config``'s common ground). A worker's experiment is a file
    (:func:`worker_experiment`); the deployment its ``[rollout]`` section may give it,
    :func:`worker_env`."""
    if section == "coordinator":
        return section_env(section, config.coordinator | shared_values(config, section))
    if section == "env":
        return section_env(section, config.env)
    if section == "teacher":
        if config.teacher is None:
            raise ValueError("the run config has no [teacher] section: no teacher to start")
        return section_env(section, {"model": model} | config.teacher)
    raise ValueError(f"no service section [{section}]")


@functools.cache
def rollout_deployment() -> frozenset[str]:
    """``[rollout]`` keys that are the worker's deployment settings (``RolloutSettings``:
    pacing, timeouts, the apply kernel ...), handed over as ``DELTARL_ROLLOUT_*``; the
    launcher's own and ``config`` excluded."""
    from deltarl.rollout.settings import RolloutSettings

    return frozenset(RolloutSettings.model_fields) - LAUNCHER_FIELDS["rollout"] - {"config"}


def worker_env(config: RunConfig) -> dict[str, str]:
    """The deployment variables a run config's ``[rollout]`` gives every worker."""
    deployment = rollout_deployment()
    return section_env("rollout", {k: v for k, v in config.rollout.items() if k in deployment})


def worker_experiment(
    config: RunConfig, *, model: str, engine_seed: int | None = None
) -> dict[str, Any]:
    """A worker's experiment (nested, as ``deltarl rollout --config`` reads it): ``[rollout]``
    without the launcher's and the deployment's keys, with the ``[run]`` values it shares at
    their places, ``model`` as the worker loads it and its ``engine_seed``."""
    skip = ROLLOUT_LAUNCH | rollout_deployment()
    data = copy.deepcopy({k: v for k, v in config.rollout.items() if k not in skip})
    if not isinstance(data.setdefault("engine", {}), dict):
        raise ValueError("[rollout] engine: a table ([rollout.engine] type = ...)")
    data["engine"].setdefault("type", "transformers")
    values = shared_values(config, "rollout") | {"engine.model": model}
    if engine_seed is not None:
        values["engine.seed"] = engine_seed
    for key, value in values.items():
        _put(data, key, value, "rollout")
    return data


def write_worker_experiment(
    config: RunConfig, out: Path, *, model: str, engine_seed: int | None
) -> None:
    """Write a worker's experiment to ``out`` (what ``deltarl rollout --config`` reads)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    data = worker_experiment(config, model=model, engine_seed=engine_seed)
    out.write_text(json.dumps(data, indent=2) + "\n")


def write_experiment(config: RunConfig, out: Path, *, model: str, run_dir: Path) -> None:
    """Write the trainer's experiment settings to ``out`` (what ``deltarl train --config``
    reads)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    data = experiment(config, model=model, run_dir=run_dir)
    out.write_text(json.dumps(data, indent=2) + "\n")


def experiment(config: RunConfig, *, model: str, run_dir: Path) -> dict[str, Any]:
    """The trainer's experiment settings (nested, as ``deltarl train --config`` reads them)."""
    data: dict[str, Any] = {}
    values = {k: v for k, v in _flatten(config.trainer).items() if k not in TRAINER_DEPLOYMENT}
    values |= shared_values(config, "trainer") | {"model": model, "run_dir": str(run_dir)}
    for key, value in values.items():
        _put(data, key, value, "trainer")
    return data


def _put(data: dict[str, Any], key: str, value: Any, section: str) -> None:
    """Set the dotted ``key`` of the nested ``data`` to ``value``."""
    node = data
    *parents, leaf = key.split(".")
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):  # e.g. "optimizer" = 1 and "optimizer.lr" = 2
            raise ValueError(f"[{section}] {key}: {p} is a value, not a table")
    node[leaf] = value


@dataclass(frozen=True)
class RunLayout:
    """Where one run's services live and what each receives (one method per service).

    ``model``: the model as the processes load it (a prepared directory, or
    ``config.run.model`` itself). The launcher of a run (``deltarl run``/``demo``), the GPU
    benchmark scripts and the fault suite all start their processes from these launches,
    adding only what is theirs (a fault hook, a GPU pin, a port for metrics).
    """

    config: RunConfig
    run_dir: Path
    model: str
    endpoints: Endpoints
    tokens: Tokens
    bucket_uri: str

    @property
    def common(self) -> dict[str, str]:
        return {"DELTARL_BUCKET_URI": self.bucket_uri}

    def coordinator(self) -> ServiceLaunch:
        c, e = self.config, self.endpoints
        return ServiceLaunch(
            "coordinator",
            ["coordinator", "--host", e.host, "--port", str(e.coordinator_port)],
            self.common
            | experiment_env(c, "coordinator", model=self.model)
            | {
                "DELTARL_COORDINATOR_SQLITE_PATH": str(self.run_dir / "coordinator.sqlite3"),
                "DELTARL_COORDINATOR_TRAINER_TOKEN": self.tokens.trainer,
            }
            | self.tokens.coordinator_env(),
            role="server",
            health=f"{e.coordinator_url}/health",
        )

    def env(self) -> ServiceLaunch:
        e = self.endpoints
        return ServiceLaunch(
            "env",
            ["env", "--host", e.host, "--port", str(e.env_port)],
            self.common
            | experiment_env(self.config, "env", model=self.model)
            | {"DELTARL_ENV_TOKEN": self.tokens.env},
            role="server",
            health=f"{e.env_url}/health",
        )

    def teacher(self) -> ServiceLaunch | None:
        """The teacher service of a ``[teacher]`` section (None without one): ``[teacher]
        model``, else the run's model (as the processes load it)."""
        section, e = self.config.teacher, self.endpoints
        if section is None:
            return None
        if self.tokens.teacher is None:
            raise ValueError("a [teacher] section needs a teacher token (Tokens.teacher)")
        return ServiceLaunch(
            "teacher",
            ["teacher", "--host", e.host, "--port", str(e.teacher_port)],
            experiment_env(self.config, "teacher", model=self.model)
            | {"DELTARL_TEACHER_TOKEN": self.tokens.teacher},
            role="server",
            health=f"{e.teacher_url}/health",
            ready_s=600.0,  # loads its model first (SmolLM2 on 2 CPU cores: ~35 s)
        )

    def worker(
        self, index: int, worker_id: str | None = None, seed: int | None = None
    ) -> ServiceLaunch:
        """Worker ``index`` (0-based): id ``worker-<index+1>`` unless given; engine seed
        ``run.seed * workers + index`` unless given. Writes its experiment to
        ``run_dir/<id>.json`` (``--config``)."""
        c, e = self.config, self.endpoints
        wid = worker_id if worker_id is not None else f"worker-{index + 1}"
        engine_seed = seed if seed is not None else c.run.seed * c.workers + index
        exp_file = self.run_dir / f"{wid}.json"
        write_worker_experiment(c, exp_file, model=self.model, engine_seed=engine_seed)
        return ServiceLaunch(
            wid,
            ["rollout", "--config", str(exp_file)],
            self.common
            | worker_env(c)
            | {
                "DELTARL_ROLLOUT_COORDINATOR_URL": e.coordinator_url,
                "DELTARL_ROLLOUT_WORKER_TOKEN": self.tokens.for_worker(wid),
                "DELTARL_ROLLOUT_ENV_URL": e.env_url,
                "DELTARL_ROLLOUT_ENV_TOKEN": self.tokens.env,
                "DELTARL_ROLLOUT_WORKER_ID": wid,
            }
            | self._teacher_env(),
        )

    def _teacher_env(self) -> dict[str, str]:
        if self.config.teacher is None or self.tokens.teacher is None:
            return {}
        return {
            "DELTARL_ROLLOUT_TEACHER_URL": self.endpoints.teacher_url,
            "DELTARL_ROLLOUT_TEACHER_TOKEN": self.tokens.teacher,
        }

    def trainer(self) -> ServiceLaunch:
        """Writes the resolved experiment to ``run_dir/trainer.json`` (``--config``)."""
        exp_file = self.run_dir / "trainer.json"
        write_experiment(self.config, exp_file, model=self.model, run_dir=self.run_dir / "trainer")
        return ServiceLaunch(
            "trainer",
            ["train", "--config", str(exp_file)],
            self.common
            | {
                "DELTARL_TRAINER_COORDINATOR_URL": self.endpoints.coordinator_url,
                "DELTARL_TRAINER_TOKEN": self.tokens.trainer,
                "DELTARL_TRAINER_DEVICE": str(self.config.trainer.get("device", "cpu")),
            },
            role="trainer",
        )

    def all(self) -> list[ServiceLaunch]:
        """Every service in start order: coordinator, env, the teacher (with a ``[teacher]``
        section), the workers, the trainer."""
        workers = [self.worker(i) for i in range(self.config.workers)]
        teacher = self.teacher()
        servers = [self.coordinator(), self.env(), *([teacher] if teacher else [])]
        return [*servers, *workers, self.trainer()]


def derive(
    config: RunConfig,
    *,
    run_dir: Path,
    model: str,
    endpoints: Endpoints,
    tokens: Tokens,
    bucket_uri: str,
) -> list[ServiceLaunch]:
    """Every service of ``config`` in start order (:meth:`RunLayout.all`)."""
    return RunLayout(config, run_dir, model, endpoints, tokens, bucket_uri).all()


def check_services(config: RunConfig) -> None:
    """Validate every section with its service's settings class (ValueError naming the
    section and key): unknown keys, wrong types, out-of-range values."""
    from pydantic import ValidationError

    from deltarl.env_server.settings import EnvSettings
    from deltarl.services.coordinator.settings import CoordinatorSettings
    from deltarl.teacher.settings import TeacherSettings
    from deltarl.trainer.settings import ExperimentSettings

    classes: dict[str, type[BaseModel]] = {
        "coordinator": CoordinatorSettings,
        "env": EnvSettings,
        "teacher": TeacherSettings,
    }
    check_worker_section(config)
    for section, cls in classes.items():
        if getattr(config, section) is None:
            continue
        values = dict(getattr(config, section))
        unknown = sorted(set(values) - set(cls.model_fields) - LAUNCHER_FIELDS[section])
        if unknown:
            raise ValueError(f"[{section}] unknown setting(s): {', '.join(unknown)}")
        values |= shared_values(config, section) | _PLACEHOLDERS.get(section, {})
        try:
            _validate_strictly(cls, values)
        except ValidationError as err:
            raise ValueError(_first_error(section, err)) from None
    check_sampling(config)
    data = experiment(config, model=config.run.model, run_dir=Path("run"))
    try:
        _validate_strictly(ExperimentSettings, data)
    except ValidationError as err:
        raise ValueError(_first_error("trainer", err)) from None
    device = config.trainer.get("device", "cpu")
    if not isinstance(device, str):
        raise ValueError(f"[trainer] device: a string such as 'cpu' or 'cuda', got {device!r}")


# the worker's flat names of the [run] values it shares (before its settings were nested)
SHARED_BEFORE = {
    "model": "model",
    "engine_seed": "seed",
    "temperature": "temperature",
    "group_size": "group_size",
    "routing_replay": "routing_replay",
}


def check_worker_section(config: RunConfig) -> None:
    """Validate ``[rollout]``: ``workers``, the deployment keys with ``RolloutSettings``, the
    rest as the worker's experiment (``WorkerExperiment``, with the ``[run]`` values)."""
    from pydantic import ValidationError

    from deltarl.rollout.settings import MOVED, RolloutSettings, WorkerExperiment, check_worker

    values = dict(config.rollout)
    workers = values.pop("workers", 2)
    if not isinstance(workers, int) or isinstance(workers, bool) or not 1 <= workers <= 64:
        raise ValueError(f"[rollout] workers: an integer from 1 to 64, got {workers!r}")
    for key in values:
        if key in SHARED_BEFORE:
            raise ValueError(
                f"[rollout] {key}: declared once for every service as [run] {SHARED_BEFORE[key]}"
            )
        if key in MOVED and not (key == "engine" and isinstance(values[key], dict)):
            raise ValueError(f"[rollout] {key}: now {MOVED[key]} (docs/rollout.md, Settings)")
    deployment = {k: v for k, v in values.items() if k in rollout_deployment()}
    unknown = sorted(set(values) - set(deployment) - set(WorkerExperiment.model_fields))
    if unknown:
        raise ValueError(f"[rollout] unknown setting(s): {', '.join(unknown)}")
    try:
        _validate_strictly(RolloutSettings, deployment | _PLACEHOLDERS["rollout"])
        data = worker_experiment(config, model=config.run.model, engine_seed=0)
        _validate_strictly(WorkerExperiment, data)
        experiment = WorkerExperiment.model_validate(data)
    except ValidationError as err:
        raise ValueError(_first_error("rollout", err)) from None
    if experiment.hints.scorer == "teacher" and config.teacher is None:
        raise ValueError(
            "[rollout] hints.scorer = 'teacher' needs a [teacher] section (the teacher "
            "service that scores the hinted turns)"
        )
    # the launcher hands every worker the teacher's URL with a [teacher] section
    teacher_url = None if config.teacher is None else "http://127.0.0.1:1"
    try:
        check_worker(teacher_url, experiment)
    except ValueError as err:
        raise ValueError(f"[rollout] {err}") from None


def _validate_strictly(cls: Any, values: dict[str, Any]) -> None:
    """Validate TOML values with a service's settings class, types first and strictly: the
    settings classes read strings from the environment and convert (``"8"``, ``8.0``, even
    ``1e15`` or ``true`` become an integer), but a run config has typed values, so an integer
    setting takes a TOML integer only, a boolean ``true``/``false`` only, a number a number.
    pydantic-settings ignores ``strict=True`` (its ``__init__`` validates again), so the types
    are checked by :func:`_strict_twin` of the class (same annotations and bounds, strict JSON
    mode: the values were checked by ``check_values``, so they are JSON), then the class itself
    runs its validators."""
    _strict_twin(cls).model_validate_json(json.dumps(values))
    cls.model_validate(values)


@functools.cache
def _strict_twin(cls: type[BaseModel]) -> type[BaseModel]:
    """A plain model with ``cls``'s fields (annotations and constraints, nested settings
    classes replaced by their twins), every field optional, strict, unknown keys ignored (the
    class itself refuses those)."""
    fields: dict[str, Any] = {}
    for name, info in cls.model_fields.items():
        annotation: Any = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            annotation = _strict_twin(annotation)
        if info.metadata:  # bounds: Ge, Le, MaxLen...
            annotation = Annotated[annotation, *info.metadata]
        fields[name] = (annotation | None, None)
    config = ConfigDict(strict=True, extra="ignore", arbitrary_types_allowed=True)
    return create_model(f"{cls.__name__}Types", __config__=config, **fields)


def check_sampling(config: RunConfig) -> None:
    """Refuse sampling the trainer cannot score: its importance correction computes each
    sampled token's logprob under ``softmax(logits / T)`` over the whole vocabulary, so the
    workers must sample from exactly that (``top_k = 0``, ``top_p = 1``); a truncated
    distribution would make every ratio wrong (docs/trainer.md, Sampling)."""
    episodes = config.rollout.get("episodes", {})
    sampling = episodes.get("sampling", {}) if isinstance(episodes, dict) else {}
    sampling = sampling if isinstance(sampling, dict) else {}
    top_k = sampling.get("top_k", 0)
    top_p = sampling.get("top_p", 1.0)
    if top_k or top_p != 1.0:
        raise ValueError(
            f"[rollout] episodes.sampling: top_k = {top_k!r}, top_p = {top_p!r}: a training run "
            "samples from the "
            "full softmax(logits / temperature), which the trainer's importance correction "
            "reproduces; truncated sampling (top_k > 0 or top_p < 1) it cannot. Keep top_k = 0 "
            "and top_p = 1.0, shorten replies with max_new_tokens and sharpen them with "
            "[run] temperature"
        )


def _first_error(section: str, err: Any) -> str:
    e = err.errors()[0]
    where = ".".join(str(p) for p in e["loc"])
    if not where:  # a check across fields: its message says what to change
        return f"[{section}] {e['msg'].removeprefix('Value error, ')}"
    return f"[{section}] {where}: {e['msg']} (got {e.get('input')!r})"
