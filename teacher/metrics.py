"""Prometheus metrics of the teacher (``GET /metrics``), one registry per app."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from deltarl.teacher.batcher import BatchReport

_SECONDS = (1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_TOKENS = (64, 256, 1024, 4096, 16384, 65536, 262144)


class TeacherMetrics:
    def __init__(self, queued_tokens: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        requests = Counter(
            "deltarl_teacher_requests",
            "POST /v1/logprobs answered without error, by request format",
            ["format"],
            registry=r,
        )
        self.requests = {f: requests.labels(f) for f in ("binary", "json")}
        self.sequences = Counter("deltarl_teacher_sequences", "Sequences scored", registry=r)
        self.tokens_scored = Counter(
            "deltarl_teacher_tokens_scored", "Positions scored (len - prompt_len)", registry=r
        )
        self.tokens_in = Counter(
            "deltarl_teacher_tokens", "Tokens of the scored sequences (prompt included)", registry=r
        )
        self.errors = Counter(
            "deltarl_teacher_errors", "Error responses by code", ["code"], registry=r
        )
        self.request_seconds = Histogram(
            "deltarl_teacher_request_seconds",
            "Server-side time of POST /v1/logprobs: parse, wait for the batch, score, encode",
            buckets=_SECONDS,
            registry=r,
        )
        self.batches = Counter("deltarl_teacher_batches", "Engine batches run", registry=r)
        self.batch_sequences = Histogram(
            "deltarl_teacher_batch_sequences", "Sequences per batch", buckets=_SIZES, registry=r
        )
        self.batch_requests = Histogram(
            "deltarl_teacher_batch_requests",
            "Requests served by one batch",
            buckets=_SIZES,
            registry=r,
        )
        self.batch_tokens = Histogram(
            "deltarl_teacher_batch_padded_tokens",
            "Padded tokens (sequences x longest) per batch",
            buckets=_TOKENS,
            registry=r,
        )
        self.forward_seconds = Histogram(
            "deltarl_teacher_batch_seconds",
            "Engine time per batch (forward + log_softmax + top-k)",
            buckets=_SECONDS,
            registry=r,
        )
        queued = Gauge("deltarl_teacher_queued_tokens", "Tokens waiting to be scored", registry=r)
        queued.set_function(lambda: queued_tokens())

    def batch(self, report: BatchReport) -> None:
        self.batches.inc()
        self.batch_sequences.observe(report.sequences)
        self.batch_requests.observe(report.requests)
        self.batch_tokens.observe(report.padded_tokens)
        self.forward_seconds.observe(report.seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
