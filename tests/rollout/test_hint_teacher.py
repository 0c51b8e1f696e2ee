"""Hinted turns scored by the teacher service (``hint_scorer = "teacher"``, rollout/distill/teaching.py):
the request holds exactly what the policy scorer scores, a teacher serving the policy's model
gives the policy scorer's numbers, answers that do not fit are refused, and a live worker
attaches hints computed by a real teacher service (down at first: nothing goes out without
them; not required: the group goes without them, counted; another vocabulary: a start error).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from test_teacher_worker import TOKEN, TeacherServer, reference, teacher_model
from test_worker import drain_queue
from worker_helpers import (
    CoordinatorServer,
    Trainer,
    WorkerThread,
    tiny_model,
    wait_for,
    worker_settings,
)

from deltarl.buckets.local import LocalBucket
from deltarl.rollout.distill.hints import EnvHinter, Hint, hinted_context, score_hints
from deltarl.rollout.distill.teaching import TeacherMismatch, hint_maps, hint_request
from deltarl.rollout.engines.base import UNMANAGED, Completion
from deltarl.rollout.engines.transformers_engine import TransformersEngine
from deltarl.rollout.episodes.chat_format import ChatFormat
from deltarl.rollout.episodes.runner import Episode, Turn
from deltarl.rollout.settings import WorkerExperiment, check_worker
from deltarl.teacher.client import SyncTeacherClient
from deltarl.teacher.wire import LogprobResponse
from deltarl.trainer.learn.batch import collate


def played(fmt: ChatFormat, replies: list[str], temperature: float = 0.7) -> Episode:
    """An episode of ``replies``, each answered by a feedback message, tokenized as the episode
    runner does (reply tokens trained, the rest not)."""
    ep = Episode(group_id="g", index=0, seed=None, temperature=temperature)
    ep.messages = [{"role": "user", "content": "Guess a five-letter word."}]
    ep.tokens = fmt.prompt_ids(ep.messages)
    ep.mask = [0] * len(ep.tokens)
    ep.prompt_len = len(ep.tokens)
    for i, reply in enumerate(replies):
        ids = fmt.encode(reply)
        start = len(ep.tokens)
        ep.tokens += ids
        ep.mask += [1] * len(ids)
        ep.messages.append({"role": "assistant", "content": reply})
        c = Completion(ids, [-1.0] * len(ids), "length", UNMANAGED, UNMANAGED)
        ep.turns.append(Turn(start, len(ep.tokens), c, reply, 0, 0, 0.0, {}, False))
        feedback = f"Feedback {i}: try another word."
        more = fmt.continuation_ids(ep.messages, feedback, None)
        ep.tokens += more
        ep.mask += [0] * len(more)
        ep.messages.append({"role": "user", "content": feedback})
    return ep


def test_the_request_holds_each_hinted_turn_after_its_hint(tok: Any) -> None:
    fmt = ChatFormat(tok)
    a, b = played(fmt, ["[crane]", "[slate]"]), played(fmt, ["[moist]", "[pious]"])
    hinted = [(a, Hint(1, "A is not in the word.")), (b, Hint(0, "Start with vowels."))]
    request, spans = hint_request(hinted, fmt, 5)
    assert request.n == 2
    # a: the conversation up to turn 1's feedback, the hint, the generation prompt, turn 1
    context_a = fmt.prompt_ids([*a.messages[:3], {"role": "user", "content": hinted[0][1].text}])
    turn_a = a.tokens[a.turns[1].start : a.turns[1].end]
    assert turn_a == fmt.encode("[slate]")
    assert request.sequence(0).tolist() == context_a + turn_a
    # b: the first prompt, the hint, turn 0
    context_b = fmt.prompt_ids([b.messages[0], {"role": "user", "content": hinted[1][1].text}])
    turn_b = b.tokens[b.turns[0].start : b.turns[0].end]
    assert request.sequence(1).tolist() == context_b + turn_b
    assert request.prompt_lens.tolist() == [len(context_a), len(context_b)]
    assert request.top_ks.tolist() == [5, 5]
    np.testing.assert_allclose(request.temperatures, [0.7, 0.7], rtol=1e-6)
    assert spans == [
        list(range(a.turns[1].start, a.turns[1].end)),
        list(range(b.turns[0].start, b.turns[0].end)),
    ]
    assert request.scored == len(turn_a) + len(turn_b)


def test_a_teacher_serving_the_policy_gives_the_policy_scorers_hints(tok: Any) -> None:
    fmt = ChatFormat(tok)
    model = tiny_model(len(tok), seed=3).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # peaked distributions: top-k ids are well separated
    engine = TransformersEngine(model)
    a, b = played(fmt, ["[crane]", "[slate]"]), played(fmt, ["[moist]"])
    hinted = [(a, Hint(1, "A is not in the word.")), (b, Hint(0, "Start with vowels."))]
    teacher = TeacherServer(model).start()
    try:
        request, spans = hint_request(hinted, fmt, 5)
        with SyncTeacherClient(teacher.url, TOKEN) as client:
            answer = client.score(request)
    finally:
        teacher.close()
    got = hint_maps(answer, hinted, request, spans)
    want = score_hints(hinted, fmt, engine, k=5, temperature=0.7)
    for g, w in zip(got, want, strict=True):
        assert g.positions == w.positions and g.k == w.k == 5
        assert g.temperature == pytest.approx(w.temperature)
        np.testing.assert_allclose(g.sampled, w.sampled, atol=1e-4)
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-4)
        assert g.ids == w.ids
    # and the hint matters: the same turn without it scores otherwise
    plain = score_hints([(a, Hint(1, "Think of fruit."))], fmt, engine, k=5, temperature=0.7)
    assert not np.allclose(plain[0].sampled, got[0].sampled, atol=1e-3)


def test_an_answer_that_does_not_fit_the_request_is_refused(tok: Any) -> None:
    fmt = ChatFormat(tok)
    a = played(fmt, ["[crane]", "[slate]"])
    hinted = [(a, Hint(1, "A is not in the word."))]
    request, spans = hint_request(hinted, fmt, 3)
    m = len(spans[0])

    def answer(rows: int, k: int, n: int = 1) -> LogprobResponse:
        return LogprobResponse(
            offsets=(np.arange(n + 1) * rows).astype(np.int32),
            top_ks=np.full(n, k, dtype=np.int32),
            sampled=np.full(rows * n, -1.0, dtype=np.float32),
            top_ids=np.zeros((rows * n, k), dtype=np.int32),
            top_logprobs=np.full((rows * n, k), -1.0, dtype=np.float32),
        )

    assert hint_maps(answer(m, 3), hinted, request, spans)[0].positions == spans[0]
    for bad, says in (
        (answer(m - 1, 3), f"{m - 1} positions x top-3; asked for {m} x top-3"),
        (answer(m, 2), f"{m} positions x top-2; asked for {m} x top-3"),
        (answer(m, 3, n=2), "answered 2 sequences for 1"),
    ):
        with pytest.raises(ValueError, match=says.replace("+", r"\+")):
            hint_maps(bad, hinted, request, spans)


def test_the_teacher_scorer_needs_a_teacher_and_the_vllm_engine_needs_it() -> None:
    def load(*overrides: str) -> WorkerExperiment:
        return WorkerExperiment.load(None, list(overrides))

    vllm = ["engine.type=vllm", "engine.model=m", "hints.mode=env"]
    teacher_scored = load("hints.mode=env", "hints.scorer=teacher")
    with pytest.raises(ValueError, match=r"hints\.scorer 'teacher' needs a teacher service"):
        check_worker(None, teacher_scored)
    with pytest.raises(ValueError, match=r"vllm engine scores hinted turns at temperature 1\.0"):
        load(*vllm, "episodes.sampling.temperature=0.7")
    assert load(*vllm).hints.scorer == "policy"
    with pytest.raises(ValueError, match="would never be asked"):
        check_worker("http://t", load("teacher.distill=false"))
    ok = load(*vllm, "hints.scorer=teacher", "episodes.sampling.temperature=0.7")
    check_worker("http://t", ok)
    assert ok.hints.scorer == "teacher" and ok.teacher.distill


class Recording:
    """The env hinter, remembering each episode it hinted (by its tokens)."""

    name = "env"

    def __init__(self) -> None:
        self.inner = EnvHinter()
        self.seen: dict[tuple[int, ...], tuple[Episode, Hint]] = {}

    async def hint(self, episode: Episode) -> Hint | None:
        hint = await self.inner.hint(episode)
        if hint is not None:
            self.seen[tuple(episode.tokens)] = (episode, hint)
        return hint


def hint_worker(
    coordinator: CoordinatorServer, env: Any, bucket: LocalBucket, tok: Any, url: str, **kw: Any
) -> tuple[WorkerThread, Recording]:
    values: dict[str, Any] = {
        "hint_mode": "env",
        "hint_scorer": "teacher",
        "hint_top_k": 4,
        "teacher_url": url,
        "teacher_token": TOKEN,
        "teacher_distill": False,
    }
    settings = worker_settings(coordinator, env.url, **(values | kw))
    runner = WorkerThread(settings, bucket, tok, len(tok))
    recording = Recording()
    runner.worker.targets._hinter = recording
    return runner, recording


@pytest.mark.slow
def test_a_worker_attaches_hints_scored_by_the_teacher_service(
    coordinator: CoordinatorServer, env: Any, bucket: LocalBucket, tok: Any
) -> None:
    teacher = TeacherServer(teacher_model(len(tok))).start()
    trainer = Trainer(bucket, coordinator, len(tok))
    runner, recording = hint_worker(coordinator, env, bucket, tok, teacher.url)
    try:
        with runner as worker:
            wait_for(lambda: worker.stats.submitted >= 2, 60, "no group submitted")
            runner.stop()
    finally:
        teacher.close()
    groups = drain_queue(coordinator)
    trajs = [t for g in groups for t in g.trajectories]
    hinted = [t for t in trajs if t.hint is not None]
    stats = worker.hint_stats
    # a random tiny model never wins: every episode is below 1 and gets a hint
    assert hinted and stats.hinted == len(hinted) and stats.failed == 0
    assert worker.teacher_stats.requests_ok == len(groups)  # one request per group, hints only
    fmt = worker.format
    for t in hinted:
        assert t.teacher is None  # teacher_distill off: no on-policy distillation data
        assert t.hint is not None and t.hint.k == 4 and t.hint.positions
        ep, hint = recording.seen[tuple(t.tokens)]
        assert t.hint_text == hint.text
        turn = ep.turns[hint.turn]
        assert t.hint.positions == list(range(turn.start, turn.end))
        # the numbers are the teacher model's over (hinted context + the turn's tokens)
        context = hinted_context(ep, hint, fmt)
        reply = t.tokens[turn.start : turn.end]
        ref = reference(teacher.engine.model, [*context, *reply], t.temperature or 1.0)
        rows = ref[len(context) :]
        want = [float(rows[j, tid]) for j, tid in enumerate(reply)]
        np.testing.assert_allclose(t.hint.sampled, want, atol=2e-4)
        top = torch.topk(rows, 4, dim=-1)
        lps = np.asarray(t.hint.logprobs).reshape(len(reply), 4)
        np.testing.assert_allclose(lps, top.values.numpy(), atol=2e-4)
    batch = collate(groups, trainer.publisher.last_version)
    assert batch.hint is not None and batch.teacher is None
    assert int(batch.hint.present.sum()) == sum(len(t.hint.positions or []) for t in hinted)


@pytest.mark.slow
def test_a_teacher_down_at_first_holds_the_hinted_groups_back(
    coordinator: CoordinatorServer, env: Any, bucket: LocalBucket, tok: Any
) -> None:
    teacher = TeacherServer(teacher_model(len(tok)))  # port bound, connections refused
    Trainer(bucket, coordinator, len(tok))
    runner, _ = hint_worker(
        coordinator, env, bucket, tok, teacher.url, submit_timeout_s=60.0, teacher_distill=True
    )
    try:
        with runner as worker:
            wait_for(lambda: worker.teacher_stats.waiting >= 2, 60, "no group waits")
            wait_for(lambda: worker.teacher_stats.requests_failed >= 1, 60, "no failure")
            assert worker.stats.submitted == 0  # nothing goes out without its hints
            waiting = worker.teacher_stats.waiting
            teacher.start()
            wait_for(lambda: worker.stats.submitted >= waiting + 1, 60, "the waiting groups")
            runner.stop()
    finally:
        teacher.close()
    assert worker.stats.dropped_timeout == 0 and worker.hint_stats.failed == 0
    groups = drain_queue(coordinator)
    assert len(groups) == worker.stats.submitted
    trajs = [t for g in groups for t in g.trajectories]
    assert all(t.hint is not None for t in trajs if t.reward < 1.0)
    assert all(t.teacher is not None for t in trajs)  # both requests answered (teacher_distill)


def junk_teacher(vocab: int, status: int) -> FastAPI:
    """A teacher of the right vocabulary whose answers are not the wire format (200) or
    refusals (4xx)."""
    app = FastAPI()

    @app.get("/v1/info")
    def info() -> dict[str, Any]:
        return {"model": "junk", "vocab_size": vocab}

    @app.post("/v1/logprobs")
    def logprobs() -> Response:
        if status != 200:
            return JSONResponse({"code": "too_long", "detail": "no"}, status_code=status)
        return Response(b"DRTR not a response", media_type="application/octet-stream")

    return app


@pytest.mark.parametrize("failure", ["down", "malformed", "refused"])
def test_hintless_groups_go_through_counted_when_the_teacher_fails(
    coordinator: CoordinatorServer, env: Any, bucket: LocalBucket, tok: Any, failure: str
) -> None:
    """Down or malformed with teacher_required false: after the client's budget; refused (4xx,
    required or not): at once, the hints skipped."""
    status = {"down": None, "malformed": 200, "refused": 422}[failure]
    app = None if status is None else junk_teacher(len(tok), status)
    teacher = TeacherServer(teacher_model(len(tok)), app)
    if app is not None:
        teacher.start()
    Trainer(bucket, coordinator, len(tok))
    runner, _ = hint_worker(
        coordinator,
        env,
        bucket,
        tok,
        teacher.url,
        teacher_required=failure == "refused",
        submit_timeout_s=4.0,
    )
    try:
        with runner as worker:
            wait_for(lambda: worker.stats.submitted >= 2, 60, "no group submitted")
            runner.stop()
    finally:
        teacher.close()
    groups = drain_queue(coordinator)
    assert groups and all(t.hint is None for g in groups for t in g.trajectories)
    stats = worker.hint_stats
    assert stats.hinted == 0 and stats.failed >= sum(len(g.trajectories) for g in groups)
    if failure == "refused":
        assert worker.teacher_stats.refused >= len(groups)
    else:
        assert worker.teacher_stats.requests_failed >= len(groups)
    assert worker.stats.submitted == len(groups)
    text = worker.metrics.render().decode()
    assert f'deltarl_rollout_hints_total{{result="failed"}} {float(stats.failed)}' in text


def test_a_teacher_with_another_vocabulary_stops_a_hint_worker_at_start(
    coordinator: CoordinatorServer, env: Any, bucket: LocalBucket, tok: Any
) -> None:
    teacher = TeacherServer(teacher_model(len(tok) + 64)).start()
    Trainer(bucket, coordinator, len(tok))
    runner, _ = hint_worker(coordinator, env, bucket, tok, teacher.url)
    try:
        runner.__enter__()
        runner.thread.join(30)
        assert not runner.thread.is_alive()
    finally:
        teacher.close()
    assert isinstance(runner.error, TeacherMismatch)
    assert "vocabulary of 49216 token ids, the policy 49152" in str(runner.error)
    assert runner.worker.stats.submitted == 0
