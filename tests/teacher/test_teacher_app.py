"""The teacher service over HTTP (in-process): routes, token, formats, errors, batching."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st
from support import LiveServer
from teacher_helpers import TOKEN, VOCAB, random_sequences, reference, settings

from deltarl.teacher.app import create_app
from deltarl.teacher.client import TeacherClient
from deltarl.teacher.engines.transformers_engine import TransformersTeacher
from deltarl.teacher.wire import (
    BINARY_MEDIA_TYPE,
    LogprobRequest,
    decode_json_response,
    decode_response,
    encode_json_request,
    encode_request,
)

AUTH = {"X-Deltarl-Token": TOKEN}
BIN = AUTH | {"Content-Type": BINARY_MEDIA_TYPE}
JSON = AUTH | {"Content-Type": "application/json"}
ATOL = 2e-4


def sample() -> LogprobRequest:
    return LogprobRequest.build([[5, 6, 7, 8, 9], [10, 11, 12]], [2, 1], [1.0, 0.5], [-1, 3])


def test_health_needs_no_token_and_the_rest_do(client: TestClient) -> None:
    assert client.get("/health").json() == {"status": "healthy"}
    for method, path in (("GET", "/v1/info"), ("GET", "/metrics"), ("POST", "/v1/logprobs")):
        r = client.request(method, path)
        assert r.status_code == 401 and r.json()["code"] == "UNAUTHORIZED"
        r = client.request(method, path, headers={"X-Deltarl-Token": "x" * len(TOKEN)})
        assert r.status_code == 401


def test_info(client: TestClient) -> None:
    info = client.get("/v1/info", headers=AUTH).json()
    assert info["model"] == "tiny-llama" and info["vocab_size"] == VOCAB
    assert info["engine"] == "transformers" and info["max_top_k"] == 128
    assert info["default_top_k"] == 20 and info["temperatures"] == "any"


def test_binary_and_json_answers_agree(client: TestClient, engine: TransformersTeacher) -> None:
    req = sample()
    r = client.post("/v1/logprobs", content=encode_request(req), headers=BIN)
    assert r.status_code == 200 and r.headers["content-type"] == BINARY_MEDIA_TYPE
    binary = decode_response(r.content)
    r = client.post("/v1/logprobs", content=encode_json_request(req), headers=JSON)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = json.loads(r.content)
    assert body["model"] == "tiny-llama" and len(body["sequences"]) == 2
    as_json = decode_json_response(r.content)
    assert binary.top_ks.tolist() == [20, 3] and binary.k == 20
    for i in range(2):
        for a, b in zip(binary.sequence(i), as_json.sequence(i), strict=True):
            np.testing.assert_array_equal(a, b)
        tokens, prompt = req.sequence(i), int(req.prompt_lens[i])
        want = reference(engine.model, tokens.tolist(), prompt, float(req.temperatures[i]))
        sampled, ids, lps = binary.sequence(i)
        np.testing.assert_allclose(
            sampled, want[np.arange(len(sampled)), tokens[prompt:]], atol=ATOL
        )
        np.testing.assert_allclose(lps, -np.sort(-want, axis=1)[:, : ids.shape[1]], atol=ATOL)
    # padding of the narrower sequence
    rows = binary.top_ids[binary.offsets[1] :]
    assert (rows[:, 3:] == -1).all() and np.isneginf(
        binary.top_logprobs[binary.offsets[1] :, 3:]
    ).all()


def test_accept_picks_the_answer_format(client: TestClient) -> None:
    r = client.post(
        "/v1/logprobs",
        content=encode_request(sample()),
        headers=BIN | {"Accept": "application/json"},
    )
    assert r.headers["content-type"] == "application/json"
    r = client.post(
        "/v1/logprobs",
        content=encode_json_request(sample()),
        headers=JSON | {"Accept": BINARY_MEDIA_TYPE},
    )
    assert r.headers["content-type"] == BINARY_MEDIA_TYPE
    decode_response(r.content)
    r = client.post("/v1/logprobs", content=encode_request(sample()), headers=AUTH)  # no type
    assert r.status_code == 200 and r.headers["content-type"] == BINARY_MEDIA_TYPE


@pytest.mark.parametrize(
    ("body", "headers", "status", "code", "words"),
    [
        (b"DRTQ", BIN, 422, "VALIDATION_ERROR", "header"),
        (b"x" * 64, BIN, 422, "VALIDATION_ERROR", "magic"),
        (b"{}", JSON, 422, "VALIDATION_ERROR", "sequences"),
        (b"{", JSON, 422, "VALIDATION_ERROR", "JSON"),
        (b"hi", AUTH | {"Content-Type": "text/plain"}, 415, "UNSUPPORTED_MEDIA_TYPE", "text/plain"),
        (
            b'{"sequences": [{"tokens": [1, 500], "prompt_len": 1}]}',
            JSON,
            422,
            "VALIDATION_ERROR",
            "sequences[0].tokens[1]",
        ),
        (
            b'{"sequences": [{"tokens": [1, 2], "prompt_len": 1, "top_k": 129}]}',
            JSON,
            422,
            "VALIDATION_ERROR",
            "sequences[0].top_k",
        ),
        (
            b'{"sequences": [{"tokens": [1, 2], "prompt_len": 3}]}',
            JSON,
            422,
            "VALIDATION_ERROR",
            "sequences[0].prompt_len",
        ),
        (
            json.dumps({"sequences": [{"tokens": [1] * 200, "prompt_len": 1}]}).encode(),
            JSON,
            413,
            "PAYLOAD_TOO_LARGE",
            "longest sequence",
        ),
        (
            json.dumps({"sequences": [{"tokens": [1, 2], "prompt_len": 1}] * 9}).encode(),
            JSON,
            413,
            "PAYLOAD_TOO_LARGE",
            "sequences",
        ),
    ],
)
def test_bad_input_is_a_clear_4xx(
    make_client: Callable[..., TestClient],
    body: bytes,
    headers: dict[str, str],
    status: int,
    code: str,
    words: str,
) -> None:
    client = make_client(max_seq_len=128, max_sequences=8)
    r = client.post("/v1/logprobs", content=body, headers=headers)
    assert r.status_code == status, r.text
    assert r.json()["code"] == code and words in r.json()["detail"], r.json()


def test_an_oversized_body_is_413_before_it_is_read(make_client: Callable[..., TestClient]) -> None:
    client = make_client(max_body_bytes=2048)
    r = client.post("/v1/logprobs", content=b"\0" * 4096, headers=BIN)
    assert r.status_code == 413 and r.json()["code"] == "PAYLOAD_TOO_LARGE"


class SpyEngine:
    """The tiny engine, counting the positions it scores; ``vocab_size`` may claim more ids than
    it has (for requests that must be refused before any scoring)."""

    def __init__(self, engine: TransformersTeacher, vocab_size: int = VOCAB) -> None:
        self.inner = engine
        self.vocab_size = vocab_size
        self.scored: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def score(self, jobs: list[Any]) -> Any:
        self.scored.append(sum(job.scored for job in jobs))
        return self.inner.score(jobs)


def test_a_json_answer_too_large_is_refused_before_scoring(engine: TransformersTeacher) -> None:
    """The attack: a 128 KiB binary request (8 x 4096 tokens, top_k 128) asking for a JSON
    answer got ~71 MB of JSON (540x the request) and grew the service by ~430 MB. It is now
    refused with 406 before anything is scored or built, and the refusal says what to do."""
    import tracemalloc

    from deltarl.teacher.limits import MAX_JSON_ANSWER_BYTES, json_answer_bytes

    spy = SpyEngine(engine, vocab_size=49152)
    rng = np.random.default_rng(0)
    attack = LogprobRequest.build(
        [rng.integers(0, VOCAB, 4096).tolist() for _ in range(8)], [1] * 8, top_ks=128
    )
    body = encode_request(attack)
    assert len(body) < 130 * 1024
    with TestClient(create_app(settings(), engine=spy)) as c:  # type: ignore[arg-type]
        tracemalloc.start()
        try:
            r = c.post("/v1/logprobs", content=body, headers=BIN | {"Accept": "application/json"})
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert r.status_code == 406, r.text
        assert r.json()["code"] == "ANSWER_TOO_LARGE"
        detail = r.json()["detail"]
        assert BINARY_MEDIA_TYPE in detail and "fewer tokens" in detail and "top_k" in detail
        assert "32,760 scored positions" in detail
        assert spy.scored == []  # nothing was scored
        assert peak < 8 << 20, peak  # nor built (the JSON alone was ~71 MB)
        # the same as JSON in, JSON out (no Accept): refused too
        r = c.post("/v1/logprobs", content=encode_json_request(attack), headers=JSON)
        assert r.status_code == 406 and spy.scored == []
        metrics = c.get("/metrics", headers=AUTH).text
        assert 'deltarl_teacher_errors_total{code="ANSWER_TOO_LARGE"} 2.0' in metrics

    # over the limit in JSON but served in binary; small JSON answers stay within the estimate
    spy = SpyEngine(engine)
    with TestClient(create_app(settings(), engine=spy)) as c:  # type: ignore[arg-type]
        seqs = [rng.integers(0, VOCAB, 2800).tolist() for _ in range(2)]
        big = LogprobRequest.build(seqs, [1, 1], top_ks=96)
        assert json_answer_bytes([(2799, 96)] * 2) > MAX_JSON_ANSWER_BYTES
        r = c.post("/v1/logprobs", content=encode_request(big), headers=BIN)
        assert r.status_code == 200 and decode_response(r.content).top_ids.shape == (5598, 96)
        r = c.post(
            "/v1/logprobs",
            content=encode_json_request(big),
            headers=JSON | {"Accept": BINARY_MEDIA_TYPE},
        )
        assert r.status_code == 200, r.text
        seqs, prompts = random_sequences(6, seed=3)
        small = LogprobRequest.build(seqs, prompts, top_ks=96)
        r = c.post("/v1/logprobs", content=encode_json_request(small), headers=JSON)
        assert r.status_code == 200, r.text
        estimate = json_answer_bytes([(len(s) - p, 96) for s, p in zip(seqs, prompts, strict=True)])
        assert len(r.content) <= estimate


def test_stopping_the_service_closes_its_engine(engine: TransformersTeacher) -> None:
    """The vllm engine frees its engine core process (and the GPU memory it holds) in close():
    a stopped service must call it, once, when it stops and not before."""
    closed: list[bool] = []

    class Closing:
        def __getattr__(self, name: str) -> Any:
            return getattr(engine, name)

        def close(self) -> None:
            closed.append(True)

    with TestClient(create_app(settings(), engine=Closing())) as c:  # type: ignore[arg-type]
        assert c.get("/health").status_code == 200
        assert closed == []
    assert closed == [True]


def test_a_full_queue_is_503(engine: TransformersTeacher) -> None:
    """Tokens waiting beyond max_queued_tokens: 503 CAPACITY_REACHED at once (clients back off)."""
    app = create_app(
        settings(max_queued_tokens=12, max_request_tokens=12, batch_window_ms=300), engine=engine
    )
    req = LogprobRequest.build([[1, 2, 3, 4, 5, 6, 7, 8]], [1])

    async def run() -> list[int]:
        with LiveServer(app) as server:
            async with httpx.AsyncClient(base_url=server.url, headers=BIN) as http:
                first = asyncio.create_task(http.post("/v1/logprobs", content=encode_request(req)))
                await asyncio.sleep(0.1)  # queued, waiting for the window
                second = await http.post("/v1/logprobs", content=encode_request(req))
                third_body = await http.post("/v1/logprobs", content=b"x")
                assert second.json()["code"] == "CAPACITY_REACHED", second.text
                return [(await first).status_code, second.status_code, third_body.status_code]

    assert asyncio.run(run()) == [200, 503, 422]


def test_metrics_count_requests_and_errors(client: TestClient) -> None:
    client.post("/v1/logprobs", content=encode_request(sample()), headers=BIN)
    client.post("/v1/logprobs", content=b"junk", headers=BIN)
    text = client.get("/metrics", headers=AUTH).text
    assert 'deltarl_teacher_requests_total{format="binary"} 1.0' in text
    assert "deltarl_teacher_sequences_total 2.0" in text
    assert "deltarl_teacher_tokens_scored_total 5.0" in text
    assert 'deltarl_teacher_errors_total{code="VALIDATION_ERROR"} 1.0' in text
    assert "deltarl_teacher_batch_sequences_bucket" in text
    assert "deltarl_teacher_request_seconds_count 1.0" in text


def test_concurrent_requests_share_batches(
    live_server: Callable[..., LiveServer], engine: TransformersTeacher
) -> None:
    """Eight workers send at once; with a 300 ms window their sequences go through one or two
    forwards, and each answer equals its sequences scored alone."""
    server = live_server(batch_window_ms=300)
    requests = [random_sequences(3, seed=s) for s in range(8)]

    async def run() -> list:
        async with TeacherClient(server.url, TOKEN) as client:
            return await asyncio.gather(
                *(
                    client.logprobs(seqs, prompts, temperature=0.8, top_k=5)
                    for seqs, prompts in requests
                )
            )

    answers = asyncio.run(run())
    stats = server.app.state.batcher.stats
    assert stats.sequences == 24 and stats.batches <= 2 and stats.largest_batch >= 12
    text = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    assert f"deltarl_teacher_batches_total {float(stats.batches)}" in text
    for (seqs, prompts), answer in zip(requests, answers, strict=True):
        for i, (s, p) in enumerate(zip(seqs, prompts, strict=True)):
            want = reference(engine.model, s, p, 0.8)
            sampled, _, lps = answer.sequence(i)
            np.testing.assert_allclose(sampled, want[np.arange(len(s) - p), s[p:]], atol=ATOL)
            np.testing.assert_allclose(lps, -np.sort(-want, axis=1)[:, :5], atol=ATOL)


def test_a_request_larger_than_a_batch_is_split(make_client: Callable[..., TestClient]) -> None:
    client = make_client(max_batch_tokens=64, max_seq_len=40)
    seqs, prompts = random_sequences(10, seed=9)
    r = client.post(
        "/v1/logprobs", content=encode_request(LogprobRequest.build(seqs, prompts)), headers=BIN
    )
    assert r.status_code == 200
    assert decode_response(r.content).n == 10
    assert client.app.state.batcher.stats.batches >= 3  # type: ignore[attr-defined]


def test_openapi_lists_the_routes(client: TestClient) -> None:
    spec = client.get("/openapi.json", headers=AUTH).json()
    assert {"/health", "/metrics", "/v1/info", "/v1/logprobs"} <= set(spec["paths"])
    assert BINARY_MEDIA_TYPE in spec["paths"]["/v1/logprobs"]["post"]["requestBody"]["content"]


@hyp_settings(
    max_examples=80, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
@given(st.data())
def test_mutated_binary_bodies_never_get_a_5xx(client: TestClient, data: st.DataObject) -> None:
    """Valid requests with a few bytes changed: a 200 with a well-formed answer, or a 4xx."""
    raw = bytearray(encode_request(sample()))
    for _ in range(data.draw(st.integers(1, 3))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    r = client.post("/v1/logprobs", content=bytes(raw), headers=BIN)
    assert r.status_code in (200, 413, 422), r.text
    if r.status_code == 200:
        resp = decode_response(r.content)
        assert resp.n == 2 and np.isfinite(resp.sampled).all() and (resp.sampled <= 0).all()
