"""Deployment settings of the coordinator (environment variables ``DELTARL_COORDINATOR_*``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from deltarl.services.common.settings import MIN_TOKEN_CHARS, validate_token
from deltarl.services.common.tls import TLSServerSettings


class CoordinatorSettings(TLSServerSettings):
    """Single source of truth for the coordinator's deployment settings."""

    model_config = SettingsConfigDict(
        env_prefix="DELTARL_COORDINATOR_",
        extra="ignore",
        case_sensitive=False,
        hide_input_in_errors=True,  # a refused token must not show up in a log
    )

    host: str = Field(default="127.0.0.1", description="Interface to listen on.")
    port: int = Field(default=8700, ge=0, le=65535, description="TCP port to listen on.")
    workers: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Server processes sharing the port and the store (one Python process uses "
        "one core). Each reads these settings from the environment.",
    )
    store: Literal["sqlite", "redis"] = Field(
        default="sqlite", description="State backend: 'sqlite' (embedded file) or 'redis'."
    )
    sqlite_path: str = Field(
        default="runs/coordinator.sqlite3", description="SQLite database file (store=sqlite)."
    )
    sqlite_synchronous: Literal["NORMAL", "FULL"] = Field(
        default="NORMAL",
        description="NORMAL survives a process crash; FULL also survives power loss (slower).",
    )
    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0", description="Redis URL (store=redis); run with AOF."
    )
    redis_prefix: str = Field(default="deltarl", description="Prefix of every Redis key.")
    trainer_token: str | None = Field(
        default=None,
        description="Token of the trainer role (publish versions, lease batches); at least "
        f"{MIN_TOKEN_CHARS} printable ASCII characters. Empty: unset.",
    )
    worker_token: str | None = Field(
        default=None,
        description="Token of the worker role (register, heartbeat, submit); at least "
        f"{MIN_TOKEN_CHARS} printable ASCII characters. Empty: unset.",
    )
    worker_key: str | None = Field(
        default=None,
        description="Secret from which each worker's own token is derived (per-worker "
        "credentials: 'deltarl coordinator worker-token ID' prints one). When set, worker routes "
        "accept only the token of the worker id they act for, so a worker cannot speak for "
        "another; the shared worker_token is then not accepted. At least "
        f"{MIN_TOKEN_CHARS} printable ASCII characters. Empty: unset (one shared worker token).",
    )
    read_token: str | None = Field(
        default=None,
        description="Extra token accepted for read-only endpoints when public_reads is false; at "
        f"least {MIN_TOKEN_CHARS} printable ASCII characters. Empty: unset.",
    )
    public_reads: bool = Field(
        default=True,
        description="Read-only endpoints (status, versions, workers, metrics, page) need no token.",
    )
    insecure: bool = Field(
        default=False,
        description="Allow running without trainer/worker tokens (local development only).",
    )
    max_staleness: int = Field(
        default=4,
        ge=0,
        description="Max versions between a sample's oldest policy version and the latest.",
    )
    heartbeat_interval_s: float = Field(
        default=1.0, gt=0, description="Interval at which workers are asked to heartbeat."
    )
    lost_after_s: float = Field(
        default=10.0, gt=0, description="Silence after which a worker is reported lost."
    )
    proof_ttl_s: float = Field(
        default=60.0,
        gt=0,
        le=86400,
        description="Seconds a worker has to answer a weight challenge (docs/security.md).",
    )
    proof_attempts: int = Field(
        default=3,
        ge=1,
        le=100,
        description="Weight challenges one worker id is issued per version, however often it "
        "heartbeats, fails or re-registers (a second or later one only from the pool's surplus "
        "over the first challenges other active workers still need; docs/security.md).",
    )
    default_lease_s: float = Field(default=120.0, gt=0, description="Default batch lease (s).")
    max_lease_s: float = Field(default=3600.0, gt=0, description="Longest lease allowed (s).")
    max_batch_groups: int = Field(default=1024, ge=1, description="Most groups in one lease.")
    target_queue_groups: int = Field(
        default=256,
        ge=1,
        description="Admission control: queued + in-flight groups worth having at once.",
    )
    max_body_bytes: int = Field(
        default=64 << 20, ge=1024, description="Largest request body (trajectory payloads)."
    )
    max_json_bytes: int = Field(default=1 << 20, ge=1024, description="Largest JSON request body.")
    max_group_bytes: int = Field(
        default=32 << 20,
        ge=1024,
        description="Largest trajectory group payload (413 above it). A group is decoded and "
        "checked in memory (about 15x its bytes at once), off the event loop.",
    )
    max_lease_bytes: int = Field(
        default=256 << 20,
        ge=1024,
        description="Most payload bytes in one lease answer (a larger first group still comes "
        "alone): bounds the trainer's and the coordinator's memory per lease.",
    )
    suspect_after: int = Field(
        default=3,
        ge=1,
        description="Groups the trainer refuses from one worker before it is flagged suspect "
        "(status page, deltarl status, /metrics).",
    )
    refuse_suspect_workers: bool = Field(
        default=False,
        description="Give suspect workers no admission and refuse their submissions (403 "
        "suspect_worker) until an operator clears them (DELETE /v1/workers/{id}/rejections).",
    )

    @field_validator("trainer_token", "worker_token", "read_token", "worker_key")
    @classmethod
    def _token_strength(cls, value: str | None, info: ValidationInfo) -> str | None:
        return validate_token(value, f"DELTARL_COORDINATOR_{str(info.field_name).upper()}")

    @model_validator(mode="after")
    def _tokens(self) -> CoordinatorSettings:
        if not self.insecure and (
            not self.trainer_token or not (self.worker_token or self.worker_key)
        ):
            raise ValueError(
                "set DELTARL_COORDINATOR_TRAINER_TOKEN and DELTARL_COORDINATOR_WORKER_TOKEN "
                "(or DELTARL_COORDINATOR_WORKER_KEY for per-worker tokens; or "
                "DELTARL_COORDINATOR_INSECURE=1 for local development)"
            )
        if self.trainer_token and self.trainer_token == self.worker_key:
            raise ValueError("the trainer token and the worker key must differ")
        if self.trainer_token and self.trainer_token == self.worker_token:
            raise ValueError(
                "the trainer and worker tokens must differ (they grant different roles)"
            )
        return self
