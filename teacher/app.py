"""FastAPI app of the teacher: per-token logprobs of a teacher model for given token sequences.

Routes (docs/teacher.md):

* ``GET /health`` (no token): ``{"status": "healthy"}``.
* ``GET /metrics``: Prometheus text format.
* ``GET /v1/info``: model name, vocabulary size, engine, top-k default and limit, size limits.
* ``POST /v1/logprobs``: a batch of sequences in the binary format (the default) or JSON
  (``Content-Type: application/json``); the answer is in the request's format unless ``Accept``
  names only the other one. Wire layout: docs/formats.md.

Every route but ``/health`` needs the ``X-Deltarl-Token`` header (compared in constant time) and
bodies over ``max_body_bytes`` are refused before they are read (the env server's guard
middleware). Errors are ``{"code", "detail"}`` JSON with the status of :data:`HTTP_STATUS`; bad
input is always a 4xx naming the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from enum import StrEnum
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field
from starlette.requests import ClientDisconnect

from deltarl import __version__
from deltarl.services.common.errors import install_error_handlers
from deltarl.services.common.guard import GuardMiddleware
from deltarl.teacher.batcher import Batcher, QueueFull
from deltarl.teacher.engines.base import ScoreJob, Scores, TeacherEngine
from deltarl.teacher.limits import MAX_JSON_ANSWER_BYTES, json_answer_bytes
from deltarl.teacher.metrics import TeacherMetrics
from deltarl.teacher.settings import TeacherSettings
from deltarl.teacher.wire import (
    BINARY_MEDIA_TYPE,
    DEFAULT_TOP_K,
    F32,
    I32,
    JSON_MEDIA_TYPE,
    LogprobRequest,
    LogprobResponse,
    WireError,
    decode_json_request,
    decode_request,
    encode_json_response,
    encode_response,
)

BINARY_TYPES = (BINARY_MEDIA_TYPE, "application/octet-stream")


class ErrorCode(StrEnum):
    UNAUTHORIZED = "UNAUTHORIZED"  # token missing or wrong
    VALIDATION_ERROR = "VALIDATION_ERROR"  # malformed body, or a field out of range
    PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"  # body, sequence count, tokens or length over a limit
    UNSUPPORTED_MEDIA_TYPE = "UNSUPPORTED_MEDIA_TYPE"  # Content-Type neither binary nor JSON
    CAPACITY_REACHED = "CAPACITY_REACHED"  # too many tokens queued: retry with back-off
    ANSWER_TOO_LARGE = "ANSWER_TOO_LARGE"  # a JSON answer over MAX_JSON_ANSWER_BYTES: ask binary
    NOT_FOUND = "NOT_FOUND"
    METHOD_NOT_ALLOWED = "METHOD_NOT_ALLOWED"
    INTERNAL_ERROR = "INTERNAL_ERROR"  # a bug or an engine failure (logged with a traceback)


HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.VALIDATION_ERROR: 422,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.UNSUPPORTED_MEDIA_TYPE: 415,
    ErrorCode.CAPACITY_REACHED: 503,
    ErrorCode.ANSWER_TOO_LARGE: 406,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.INTERNAL_ERROR: 500,
}
_HTTP_CODES = {404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED}


class TeacherError(Exception):
    def __init__(self, code: ErrorCode, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


class ErrorResponse(BaseModel):
    code: ErrorCode = Field(description="Machine-readable error code.")
    detail: str = Field(description="What went wrong (names the field).")


class InfoResponse(BaseModel):
    model: str = Field(description="The teacher model's name.")
    vocab_size: int = Field(description="Valid token ids are 0 .. vocab_size - 1.")
    engine: str = Field(description="transformers | vllm")
    default_top_k: int = Field(description="top_k of a sequence that does not set one.")
    max_top_k: int = Field(description="Largest top_k accepted.")
    max_seq_len: int = Field(description="Longest sequence accepted (tokens).")
    max_sequences: int = Field(description="Sequences per request at most.")
    max_request_tokens: int = Field(description="Tokens per request at most.")
    temperatures: str = Field(description="'any' or '1.0 only' (the vllm engine).")
    formats: list[str] = Field(description="Media types POST /v1/logprobs reads and writes.")
    version: str = Field(description="deltarl version.")


def load_engine(settings: TeacherSettings) -> TeacherEngine:
    """The engine ``settings`` select, with its model loaded."""
    model, gguf, name = settings.model_source()
    if settings.engine == "vllm":
        from deltarl.teacher.engines.vllm_engine import VllmTeacher

        return VllmTeacher.load(
            model,
            dtype=settings.dtype,
            max_top_k=settings.max_top_k,
            max_seq_len=settings.max_seq_len,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            enforce_eager=settings.enforce_eager,
            name=name,
        )
    from deltarl.teacher.engines.transformers_engine import TransformersTeacher

    return TransformersTeacher.load(
        model, gguf_file=gguf, device=settings.device, dtype=settings.dtype, name=name
    )


def _media(value: str) -> str:
    return value.split(";", 1)[0].strip().lower()


def assemble(scores: list[Scores], ks: list[int]) -> LogprobResponse:
    """One answer from per-sequence scores (rows padded to the widest k: id -1, logprob -inf)."""
    n = len(scores)
    counts = [len(s.sampled) for s in scores]
    offsets = np.zeros(n + 1, dtype=I32)
    np.cumsum(counts, out=offsets[1:])
    p = int(offsets[-1])
    k = max(ks, default=0)
    top_ids = np.full((p, k), -1, dtype=I32)
    top_lps = np.full((p, k), -np.inf, dtype=F32)
    for i, s in enumerate(scores):
        a, b = int(offsets[i]), int(offsets[i + 1])
        top_ids[a:b, : ks[i]] = s.top_ids
        top_lps[a:b, : ks[i]] = s.top_logprobs
    sampled = np.concatenate([s.sampled for s in scores]) if n else np.zeros(0, F32)
    return LogprobResponse(
        offsets=offsets,
        top_ks=np.asarray(ks, dtype=I32),
        sampled=sampled.astype(F32, copy=False),
        top_ids=top_ids,
        top_logprobs=top_lps,
    )


def create_app(settings: TeacherSettings, engine: TeacherEngine | None = None) -> FastAPI:
    """Build the app; ``engine`` defaults to the one ``settings`` select (loaded here)."""
    engine = engine if engine is not None else load_engine(settings)
    limits = settings.limits(vocab_size=engine.vocab_size)
    batcher: Batcher
    metrics = TeacherMetrics(lambda: batcher.queued_tokens)
    batcher = Batcher(
        engine,
        max_batch_tokens=settings.max_batch_tokens,
        window_s=settings.batch_window_ms / 1000,
        max_queued_tokens=settings.max_queued_tokens,
        on_batch=metrics.batch,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await batcher.start()
        try:
            yield
        finally:
            await batcher.stop()
            await asyncio.to_thread(engine.close)

    app = FastAPI(
        title="deltarl teacher",
        version=__version__,
        description="Per-token logprobs (sampled token + top-k) of a teacher model, for "
        "on-policy distillation.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.batcher = batcher
    app.state.metrics = metrics
    app.add_middleware(
        GuardMiddleware,
        token=settings.token.get_secret_value(),
        max_body_bytes=settings.max_body_bytes,
        on_error=lambda code: metrics.errors.labels(code).inc(),
    )

    def error_response(code: ErrorCode, detail: str) -> Response:
        metrics.errors.labels(code.value).inc()
        body = ErrorResponse(code=code, detail=detail).model_dump_json()
        return Response(body, status_code=HTTP_STATUS[code], media_type=JSON_MEDIA_TYPE)

    install_error_handlers(
        app,
        error_response,
        error=TeacherError,
        code_of=lambda exc: (exc.code, exc.detail),
        http_codes=_HTTP_CODES,
        internal=ErrorCode.INTERNAL_ERROR,
        invalid=(ErrorCode.VALIDATION_ERROR, ErrorCode.VALIDATION_ERROR),
    )

    @app.get("/health", tags=["info"])
    async def health() -> dict[str, str]:
        """Liveness (never needs the token)."""
        return {"status": "healthy"}

    @app.get("/metrics", tags=["info"], response_class=Response)
    async def prometheus() -> Response:
        """Prometheus text format."""
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    info = InfoResponse(
        model=engine.model_name,
        vocab_size=engine.vocab_size,
        engine=engine.engine,
        default_top_k=min(settings.top_k, engine.vocab_size),
        max_top_k=settings.max_top_k,
        max_seq_len=settings.max_seq_len,
        max_sequences=settings.max_sequences,
        max_request_tokens=settings.max_request_tokens,
        temperatures="any" if engine.check_temperature(0.5) is None else "1.0 only",
        formats=[BINARY_MEDIA_TYPE, JSON_MEDIA_TYPE],
        version=__version__,
    )

    @app.get("/v1/info", response_model=InfoResponse, tags=["teacher"])
    async def get_info() -> InfoResponse:
        """What this teacher serves and its limits."""
        return info

    def parse(request: Request, body: bytes) -> tuple[LogprobRequest, str]:
        media = _media(request.headers.get("content-type", ""))
        try:
            if media == JSON_MEDIA_TYPE:
                return decode_json_request(body, limits), "json"
            if media in BINARY_TYPES or media == "":
                return decode_request(body, limits), "binary"
        except WireError as exc:
            code = ErrorCode.PAYLOAD_TOO_LARGE if exc.status == 413 else ErrorCode.VALIDATION_ERROR
            raise TeacherError(code, str(exc)) from None
        raise TeacherError(
            ErrorCode.UNSUPPORTED_MEDIA_TYPE,
            f"Content-Type {media!r}: send {BINARY_MEDIA_TYPE} (the default) or {JSON_MEDIA_TYPE}",
        )

    def answer_format(request: Request, request_format: str) -> str:
        accept = request.headers.get("accept", "").lower()
        binary = any(t in accept for t in BINARY_TYPES)
        json_ok = JSON_MEDIA_TYPE in accept
        if binary != json_ok:
            return "binary" if binary else "json"
        return request_format

    def jobs_of(req: LogprobRequest) -> tuple[list[ScoreJob], list[int]]:
        jobs, ks = [], []
        for i in range(req.n):
            k = int(req.top_ks[i])
            k = min(settings.top_k if k == DEFAULT_TOP_K else k, engine.vocab_size)
            temperature = float(req.temperatures[i])
            why = engine.check_temperature(temperature)
            if why is not None:
                raise TeacherError(ErrorCode.VALIDATION_ERROR, f"sequences[{i}].temperature: {why}")
            jobs.append(ScoreJob(req.sequence(i), int(req.prompt_lens[i]), temperature, k))
            ks.append(k)
        return jobs, ks

    def check_json_answer(jobs: list[ScoreJob]) -> None:
        """Refuse, before scoring, a request whose JSON answer would exceed
        MAX_JSON_ANSWER_BYTES (a 128 KiB binary request of 8 x 4096 tokens at top-k 128 would
        get ~70 MB of JSON and cost the service several hundred MB to build it)."""
        estimate = json_answer_bytes([(job.scored, job.top_k) for job in jobs])
        if estimate > MAX_JSON_ANSWER_BYTES:
            positions = sum(job.scored for job in jobs)
            raise TeacherError(
                ErrorCode.ANSWER_TOO_LARGE,
                f"the JSON answer would take about {estimate / 2**20:.0f} MiB ({positions:,} scored "
                f"positions, each with its top-k), over the {MAX_JSON_ANSWER_BYTES >> 20} MiB "
                f"limit of a JSON answer: ask for the binary format (Accept: "
                f"{BINARY_MEDIA_TYPE}), or send fewer tokens or a smaller top_k",
            )

    @app.post(
        "/v1/logprobs",
        tags=["teacher"],
        response_class=Response,
        responses={s: {"model": ErrorResponse} for s in (401, 406, 413, 415, 422, 503)},
        openapi_extra={
            "requestBody": {
                "content": {
                    BINARY_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}},
                    JSON_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/JsonRequest"}},
                }
            }
        },
    )
    async def logprobs(request: Request) -> Response:
        """Score sequences: for every position ``p >= prompt_len`` the logprob of ``tokens[p]``
        and the top-k of ``log_softmax(logits / temperature)`` after ``tokens[:p]``."""
        started = time.perf_counter()
        try:
            body = await request.body()
        except ClientDisconnect:
            raise TeacherError(
                ErrorCode.VALIDATION_ERROR, "body: not received completely"
            ) from None
        req, fmt = parse(request, body)
        jobs, ks = jobs_of(req)
        out = answer_format(request, fmt)
        if out == "json":
            check_json_answer(jobs)
        try:
            scores = await batcher.submit(jobs)
        except QueueFull as exc:
            raise TeacherError(ErrorCode.CAPACITY_REACHED, str(exc)) from None
        resp = assemble(scores, ks)
        if out == "binary":
            payload, media = encode_response(resp), BINARY_MEDIA_TYPE
        else:
            payload, media = encode_json_response(resp, engine.model_name), JSON_MEDIA_TYPE
        metrics.requests[fmt].inc()
        metrics.sequences.inc(req.n)
        metrics.tokens_in.inc(len(req.tokens))
        metrics.tokens_scored.inc(len(resp.sampled))
        metrics.request_seconds.observe(time.perf_counter() - started)
        return Response(payload, media_type=media)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            from deltarl.teacher.wire import JsonRequest

            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = spec.setdefault("components", {}).setdefault("schemas", {})
            schema = JsonRequest.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas["JsonRequest"] = schema
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
