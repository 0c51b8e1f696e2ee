"""Hinted self-distillation on the worker (rollout/distill/hints.py): the env hinter passes on the
environment's hint (the tasks' hints themselves: tests/env_server/test_env_hints.py), chat hints
are validated (malformed ones skipped and counted), the hinted turn is scored once after the
hint, and a worker attaches hints to what it submits."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
import torch
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
from deltarl.env_server.core.wire import TaskHint
from deltarl.rollout.distill.hints import (
    ChatHinter,
    EnvHinter,
    Hint,
    HintStats,
    check_hint,
    hint_episodes,
    hinted_context,
    score_hint,
    score_hints,
)
from deltarl.rollout.engines.base import UNMANAGED, Completion
from deltarl.rollout.engines.transformers_engine import TransformersEngine
from deltarl.rollout.episodes.chat_format import ChatFormat
from deltarl.rollout.episodes.runner import Episode, Turn
from deltarl.trainer.learn.batch import collate


def episode(replies: list[str], hint: TaskHint | None = None, reward: float = 0.0) -> Episode:
    """An episode as the worker records it, with the environment's last hint."""
    ep = Episode(group_id="g", index=0, seed=1, reward=reward, env_hint=hint)
    ep.messages.append({"role": "user", "content": "You are Player 0 in Wordle. ..."})
    for i, reply in enumerate(replies):
        ep.messages.append({"role": "assistant", "content": reply})
        c = Completion([1], [-0.1], "stop", UNMANAGED, UNMANAGED)
        ep.turns.append(Turn(i, i + 1, c, reply, 0, 0, 0.0, {}, False))
    return ep


def test_the_env_hinter_passes_on_the_environment_s_hint() -> None:
    """The worker knows no task's rules: it uses the hint the env server sent with the last
    observation, checked like any hinter's answer."""
    hint = TaskHint(turn=1, text="[crane] was already guessed; every guess must be a new word.")
    got = asyncio.run(EnvHinter().hint(episode(["[crane]", "[crane]"], hint)))
    assert got == Hint(1, hint.text)
    assert asyncio.run(EnvHinter().hint(episode(["[crane]"]))) is None  # none sent
    with pytest.raises(ValueError, match=r"failure_turn must be an integer within 0\.\.0"):
        asyncio.run(EnvHinter().hint(episode(["[crane]"], hint)))  # names no turn of it
    long = TaskHint(turn=0, text="One. Two. Three. Four.")
    with pytest.raises(ValueError, match="at most three sentences"):
        asyncio.run(EnvHinter().hint(episode(["[crane]"], long)))


def test_chat_hints_are_validated() -> None:
    assert check_hint({"failure_turn": 1, "hint": "Use the yellow R."}, 3) == Hint(
        1, "Use the yellow R."
    )
    for raw, message in (
        ([1, "x"], "not a JSON object"),
        ({"failure_turn": 3, "hint": "x."}, "within 0..2"),
        ({"failure_turn": True, "hint": "x."}, "integer"),
        ({"failure_turn": 0, "hint": "  "}, "non-empty"),
        ({"failure_turn": 0, "hint": "One. Two. Three. Four."}, "three sentences"),
        ({"failure_turn": 0, "hint": "x" * 700}, "600 characters"),
    ):
        with pytest.raises(ValueError, match=message):
            check_hint(raw, 3)


def test_chat_hinter_over_http_skips_and_counts_bad_answers() -> None:
    answers = iter(
        [
            '```json\n{"failure_turn": 1, "hint": "R is in the word."}\n```',
            "I think turn 1 was wrong.",
            '{"failure_turn": 9, "hint": "x."}',
        ]
    )
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization") != "Bearer tok":
            return httpx.Response(401)
        body = json.loads(request.content)
        seen.append(body)
        try:
            content = next(answers)
        except StopIteration:
            return httpx.Response(503, json={"error": "overloaded"})
        return httpx.Response(200, json={"choices": [{"message": {"content": content}}]})

    hinter = ChatHinter(
        "http://hints.test", "teacher", token="tok", transport=httpx.MockTransport(handler)
    )
    eps = [episode(["[crane]", "[moist]"]) for _ in range(5)]
    eps[4].reward = 1.0  # not below: never asked
    stats = HintStats()

    async def score(hinted: list[tuple[Episode, Hint]]) -> Any:
        return [("view", hint.turn) for _, hint in hinted]

    got = asyncio.run(hint_episodes(eps, hinter, score, stats, below=1.0))
    assert got == {0: (("view", 1), "R is in the word.")}  # type: ignore[comparison-overlap]
    assert (stats.asked, stats.hinted, stats.malformed, stats.failed) == (4, 1, 2, 1)
    assert "[agent turn 1] [moist]" in seen[0]["messages"][1]["content"]
    asyncio.run(hinter.aclose())


def test_the_hinted_turn_is_scored_once_after_the_hint(tok: Any) -> None:
    fmt = ChatFormat(tok)
    torch.manual_seed(0)
    engine = TransformersEngine(tiny_model(len(tok), seed=3))
    ep = Episode(group_id="g", index=0, seed=None)
    ep.messages = [{"role": "user", "content": "Guess a word."}]
    ep.tokens = fmt.prompt_ids(ep.messages)
    ep.mask = [0] * len(ep.tokens)
    ep.prompt_len = len(ep.tokens)
    reply = fmt.encode("[crane]")
    start = len(ep.tokens)
    ep.tokens += reply
    ep.mask += [1] * len(reply)
    ep.messages.append({"role": "assistant", "content": "[crane]"})
    c = Completion(reply, [-1.0] * len(reply), "length", UNMANAGED, UNMANAGED)
    ep.turns.append(Turn(start, len(ep.tokens), c, "[crane]", 0, 0, 0.0, {}, True))
    hint = Hint(0, "The word starts with S.")
    view = score_hint(ep, hint, fmt, engine, k=5, temperature=1.0)
    assert view.positions == list(range(start, len(ep.tokens))) and view.k == 5
    context = hinted_context(ep, hint, fmt)
    assert "The word starts with S." in tok.decode(context)
    # the same numbers as a plain forward pass over context + reply
    ids = torch.tensor([context + reply])
    with torch.no_grad():
        lp = torch.log_softmax(engine.model(input_ids=ids).logits[0].float(), -1)
    want = [float(lp[len(context) + j - 1, t]) for j, t in enumerate(reply)]
    assert view.sampled == pytest.approx(want, abs=1e-4)
    other = score_hint(ep, Hint(0, "Think of fruit."), fmt, engine, k=5, temperature=1.0)
    assert other.sampled != view.sampled  # the hint changes the distribution
    # several at once (one right-padded forward) give the same numbers
    both = score_hints(
        [(ep, hint), (ep, Hint(0, "Think of fruit."))], fmt, engine, k=5, temperature=1.0
    )
    assert both[0].sampled == pytest.approx(view.sampled, abs=1e-4)
    assert both[1].sampled == pytest.approx(other.sampled, abs=1e-4)
    assert both[0].ids == view.ids


@pytest.mark.slow
def test_a_worker_attaches_env_hints_to_failed_episodes(
    coordinator: CoordinatorServer, env: Any, bucket: LocalBucket, tok: Any
) -> None:
    trainer = Trainer(bucket, coordinator, len(tok))
    settings = worker_settings(coordinator, env.url, hint_mode="env", hint_top_k=4)
    runner = WorkerThread(settings, bucket, tok, len(tok))
    with runner as worker:
        wait_for(lambda: worker.stats.submitted >= 2, 30, "no group submitted")
        runner.stop()
    groups = drain_queue(coordinator)
    trajs = [t for g in groups for t in g.trajectories]
    hinted = [t for t in trajs if t.hint is not None]
    # a random tiny model never wins: every episode is below 1 and gets a hint
    assert hinted and worker.hint_stats.hinted == len(hinted) and worker.hint_stats.failed == 0
    for t in hinted:
        assert t.hint is not None and t.hint.positions and t.hint_text
        assert all(t.mask[p] == 1 for p in t.hint.positions) and t.hint.k == 4
    batch = collate(groups, trainer.publisher.last_version)
    assert batch.hint is not None and int(batch.hint.present.sum()) == sum(
        len(t.hint.positions or []) for t in hinted if t.hint is not None
    )
