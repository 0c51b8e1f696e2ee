"""Episode loop against the real Wordle server: token bookkeeping, groups, batching, invalid
replies, truncation, versions, and the binary submission down to the trainer's collate."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch
import transformers
from episode_helpers import ScriptedEngine, WordleServer
from rollout_helpers import FakeTrainer, clone_state

from deltarl.buckets.local import LocalBucket
from deltarl.env_server.core.client import AsyncEpisode, EnvClient
from deltarl.env_server.core.models import EnvError, ErrorCode, StepResult
from deltarl.env_server.wordle.game import WordLists, answer_for_seed
from deltarl.env_server.wordle.prompt import SYSTEM_PROMPT
from deltarl.rollout.engines.base import SamplingParams
from deltarl.rollout.engines.transformers_engine import TransformersEngine
from deltarl.rollout.episodes.runner import (
    ChatFormat,
    Episode,
    EpisodeGroup,
    EpisodeRunner,
    EpisodeSettings,
    TokenGenerator,
)
from deltarl.rollout.episodes.trajectories import (
    idempotency_key,
    json_f32,
    payload_sizes,
    to_submission,
)
from deltarl.rollout.sync.weights import WeightSync
from deltarl.services.coordinator.schemas import decode_group, encode_group
from deltarl.services.coordinator.schemas.common import ID_PATTERN
from deltarl.trainer.learn.batch import collate
from deltarl.weightsync.reader import BucketReader

pytestmark = pytest.mark.network
IM_END = 2  # SmolLM2's <|im_end|>: end of turn and EOS
SEED = 11
WRONG = ["crane", "slate", "pious", "dumpy", "fight", "blown", "tulip"]


@pytest.fixture(scope="module")
def server() -> Iterator[WordleServer]:
    with WordleServer() as s:
        yield s


def answer(seed: int) -> str:
    return answer_for_seed(WordLists.load(), seed)


def wrong(seed: int) -> list[str]:
    return [w for w in WRONG if w != answer(seed)]


def play(
    server: WordleServer,
    tok: Any,
    generator: TokenGenerator,
    settings: EpisodeSettings,
    seeds: list[int],
    **kwargs: Any,
) -> tuple[list[EpisodeGroup], EpisodeRunner]:
    async def main() -> tuple[list[EpisodeGroup], EpisodeRunner]:
        async with (
            EnvClient(server.url) as env,
            EpisodeRunner(generator, tok, env, settings, **kwargs) as runner,
        ):
            return await runner.run_groups(seeds), runner

    return asyncio.run(main())


def tiny_llama(vocab: int) -> transformers.LlamaConfig:
    """A one-layer random Llama over the real tokenizer's vocabulary (~3 M parameters)."""
    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )


def check_bookkeeping(ep: Episode) -> None:
    """Masks cover exactly the sampled tokens; logprobs sit on them; 0 elsewhere."""
    n = len(ep.tokens)
    assert len(ep.mask) == len(ep.logprobs) == n
    expected = [0] * n
    for turn in ep.turns:
        assert ep.tokens[turn.start : turn.end] == turn.token_ids
        assert ep.logprobs[turn.start : turn.end] == turn.completion.logprobs
        expected[turn.start : turn.end] = [1] * (turn.end - turn.start)
    assert ep.mask == expected
    assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.mask, strict=True) if not m)
    assert ep.prompt_len == ep.turns[0].start
    assert ep.tokens[-1] == ep.turns[-1].token_ids[-1]  # ends with the last sampled token


def test_multi_turn_tokens_are_the_chat_template(server: WordleServer, tok: Any) -> None:
    guesses = [*wrong(SEED)[:2], answer(SEED)]
    engine = ScriptedEngine(tok, lambda row, turn: f"I pick [{guesses[turn]}]", stop=IM_END)
    settings = EpisodeSettings(
        group_size=1, sampling=SamplingParams(max_new_tokens=32), system_prompt=SYSTEM_PROMPT
    )
    [group], _ = play(server, tok, engine, settings, [SEED], policy_version=None)
    ep = group.episodes[0]
    check_bookkeeping(ep)
    assert (ep.num_turns, ep.done, ep.truncated, ep.reward) == (3, True, None, 1.0)
    # the flat sequence is exactly the template rendering of the conversation (which ends with
    # "<|im_end|>\n": the trailing newline is never generated)
    rendered = tok.apply_chat_template(ep.messages, tokenize=False)
    assert ep.tokens == tok.encode(rendered, add_special_tokens=False)[:-1]
    roles = [m["role"] for m in ep.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert "square brackets" in ep.messages[0]["content"]
    assert "Wordle" in ep.messages[1]["content"]  # the game's instructions
    assert f"You submitted [{guesses[0]}]" in ep.messages[3]["content"]
    assert f"You submitted [{guesses[1]}]" in ep.messages[5]["content"]
    assert [t.reply for t in ep.turns] == [f"I pick [{g}]" for g in guesses]
    # environment feedback is in the unmasked tokens, never in the masked ones
    env_text = tok.decode([t for t, m in zip(ep.tokens, ep.mask, strict=True) if not m])
    assert "You submitted" in env_text and "Feedback" in env_text
    model_text = tok.decode([t for t, m in zip(ep.tokens, ep.mask, strict=True) if m])
    assert "Feedback" not in model_text and model_text.count("I pick") == 3
    # per-step signals and rewards from the environment
    assert [t.reward for t in ep.turns] == [0.0, 0.0, 1.0]
    assert [t.signals["correct"] for t in ep.turns] == [0.0, 0.0, 1.0]
    assert all(t.signals["format"] == 1.0 for t in ep.turns)
    # the engine was asked to stop at the end of turn
    assert IM_END in engine.calls[0][1].stop_token_ids


def test_group_shares_the_game_and_batches_across_episodes(server: WordleServer, tok: Any) -> None:
    g = 4
    words = ["crane", "slate"]  # scored differently against the answers of SEED and SEED + 1

    def reply(key: int, turn: int) -> str:
        # episode k plays k % 3 valid guesses, then invalid replies until it forfeits
        return f"[{words[turn]}]" if turn < key % 3 else "no guess"

    engine = ScriptedEngine(tok, reply, stop=IM_END, version=5)
    settings = EpisodeSettings(
        group_size=g,
        sampling=SamplingParams(max_new_tokens=16),
        batch_wait_s=1.0,
        system_prompt=SYSTEM_PROMPT,  # messages[3]: the feedback on the first guess
    )
    groups, runner = play(server, tok, engine, settings, [SEED, SEED + 1])
    assert [grp.seed for grp in groups] == [SEED, SEED + 1]
    assert len({grp.group_id for grp in groups}) == 2
    feedback = []
    for grp in groups:
        assert re.match(ID_PATTERN, grp.group_id)
        assert [e.index for e in grp.episodes] == list(range(g))
        for ep in grp.episodes:
            check_bookkeeping(ep)
            assert (ep.done, ep.reward, ep.seed, ep.group_id) == (True, 0.0, grp.seed, grp.group_id)
            assert ep.version_min == ep.version_max == 5
            assert ep.num_turns == 2 + sum(t.signals["valid"] == 1.0 for t in ep.turns)
        # the game's answer decides the feedback: one text per group for the same guess
        texts = {
            m["content"]
            for ep in grp.episodes
            for m in ep.messages[3:4]
            if "You submitted [crane]" in m["content"]
        }
        assert len(texts) == 1
        feedback.append(texts.pop())
    assert feedback[0] != feedback[1]
    assert sorted(e.num_turns for grp in groups for e in grp.episodes).count(2) >= 2
    # the first turns of both groups share one call; later calls gather the episodes still live
    assert runner.batch_sizes[0] == 2 * g
    assert sum(runner.batch_sizes) == sum(e.num_turns for grp in groups for e in grp.episodes)
    assert len(runner.batch_sizes) == max(e.num_turns for grp in groups for e in grp.episodes)
    assert server.open_sessions == 0


def test_invalid_replies_follow_the_env_policy(server: WordleServer, tok: Any) -> None:
    engine = ScriptedEngine(tok, lambda row, turn: "hmm, no idea", stop=IM_END)
    settings = EpisodeSettings(
        group_size=2, sampling=SamplingParams(max_new_tokens=16), system_prompt=SYSTEM_PROMPT
    )
    [group], _ = play(server, tok, engine, settings, [SEED])
    for ep in group.episodes:
        check_bookkeeping(ep)
        # the server tolerates one invalid move (a warning fed back), the second forfeits
        assert (ep.num_turns, ep.done, ep.reward, ep.truncated) == (2, True, 0.0, None)
        assert "Invalid move" in ep.messages[3]["content"]
        assert [t.signals["invalid"] for t in ep.turns] == [1.0, 1.0]
        assert ep.turns[0].reply == "hmm, no idea"


def test_truncation_by_turns_and_by_tokens(server: WordleServer, tok: Any) -> None:
    words = wrong(SEED)
    engine = ScriptedEngine(tok, lambda row, turn: f"[{words[turn]}]", stop=IM_END)
    settings = EpisodeSettings(
        group_size=1, max_turns=2, sampling=SamplingParams(max_new_tokens=16)
    )
    [group], _ = play(server, tok, engine, settings, [SEED])
    ep = group.episodes[0]
    check_bookkeeping(ep)
    assert (ep.num_turns, ep.done, ep.truncated, ep.reward) == (2, False, "max_turns", 0.0)
    assert ep.messages[-1]["role"] == "assistant"  # feedback after the last turn not appended

    # token budget: room for the prompt and a few reply tokens only
    prompt_len = ep.prompt_len
    long_reply = "Let me think about it carefully first, then [crane]"
    engine = ScriptedEngine(tok, lambda row, turn: long_reply, stop=IM_END)
    settings = EpisodeSettings(
        group_size=1, max_tokens=prompt_len + 5, sampling=SamplingParams(max_new_tokens=64)
    )
    [group], _ = play(server, tok, engine, settings, [SEED])
    ep = group.episodes[0]
    check_bookkeeping(ep)
    assert (ep.num_turns, ep.truncated, len(ep.tokens)) == (1, "max_tokens", prompt_len + 5)
    assert ep.turns[0].completion.finish_reason == "length"
    assert ep.turns[0].signals["invalid"] == 1.0  # the cut reply was still played
    with pytest.raises(ValueError, match="max_tokens"):
        play(server, tok, engine, settings.model_copy(update={"max_tokens": 10}), [SEED])


def test_versions_span_a_sync(server: WordleServer, tok: Any) -> None:
    words = wrong(SEED)
    engine = ScriptedEngine(tok, lambda row, turn: f"[{words[turn]}]", stop=IM_END, version=3)
    settings = EpisodeSettings(
        group_size=1, max_turns=3, sampling=SamplingParams(max_new_tokens=16)
    )

    class Syncing:
        """Turn 2 is sampled across a sync (v3 -> v4), turn 3 after it."""

        def generate(self, prompts: Any, params: SamplingParams) -> Any:
            if len(engine.calls) == 1:
                engine.bump_during_call = True
            return engine.generate(prompts, params)

    [group], _ = play(server, tok, Syncing(), settings, [SEED])
    seqs = {c.first.seq: "verified" for c in group.completions()}
    seqs[group.completions()[-1].last.seq] = "pending"
    assert group.verdict(lambda c: seqs.get(c.last.seq, "verified")) == "pending"
    seqs[group.completions()[0].first.seq] = "failed"
    assert group.verdict(lambda c: seqs[c.first.seq]) == "failed"
    assert group.verdict(lambda c: "verified") == "verified"
    ep = group.episodes[0]
    assert [(t.version_min, t.version_max) for t in ep.turns] == [(3, 3), (3, 4), (4, 4)]
    assert (ep.version_min, ep.version_max) == (3, 4)
    traj = to_submission(group, "w1").trajectories[0]
    assert (traj.version_min, traj.version_max) == (3, 4)
    # the sampling temperature travels with the trajectory (greedy: none to report)
    assert ep.temperature == settings.sampling.temperature
    assert traj.temperature == (settings.sampling.temperature or None)

    # an engine without a weight gate: the runner reads policy_version around each call
    unmanaged = ScriptedEngine(tok, lambda row, turn: f"[{words[turn]}]", stop=IM_END)
    unmanaged.managed = False
    current = iter([7, 7, 7, 7, 8, 8, 8])  # the group's start (its resets), then each call
    [group], _ = play(
        server, tok, unmanaged, settings, [SEED], policy_version=lambda: next(current)
    )
    assert [(t.version_min, t.version_max) for t in group.episodes[0].turns] == [
        (7, 7),
        (7, 8),
        (8, 8),
    ]
    [group], _ = play(server, tok, unmanaged, settings, [SEED])
    assert group.episodes[0].version_min is None
    with pytest.raises(ValueError, match="no policy version"):
        to_submission(group, "w1")


def test_submission_round_trips_to_the_trainer(server: WordleServer, tok: Any) -> None:
    def reply(key: int, turn: int) -> str:  # the first episode wins at its second guess
        return f"[{answer(SEED)}]" if key == 0 and turn == 1 else f"[{wrong(SEED)[turn]}]"

    engine = ScriptedEngine(tok, reply, stop=IM_END, version=2)
    settings = EpisodeSettings(
        group_size=3, max_turns=3, sampling=SamplingParams(max_new_tokens=16)
    )
    [group], _ = play(server, tok, engine, settings, [SEED])
    sub = to_submission(group, "worker-1")
    assert sub.idempotency_key == idempotency_key("worker-1", group.group_id)
    assert to_submission(group, "worker-1").idempotency_key == sub.idempotency_key
    assert to_submission(group, "worker-2").idempotency_key != sub.idempotency_key
    assert re.match(ID_PATTERN, sub.idempotency_key)
    decoded = decode_group(encode_group(sub))
    assert decoded == sub  # scripted logprobs are exact in float32
    won = [i for i, t in enumerate(decoded.trajectories) if t.reward == 1.0]
    assert len(won) == 1
    win, lose = won[0], (won[0] + 1) % 3
    signals = decoded.trajectories[win].signals
    assert (signals["turns"], signals["done"], signals["truncated"]) == (2.0, 1.0, 0.0)
    signals = decoded.trajectories[lose].signals
    assert (signals["turns"], signals["done"], signals["truncated"]) == (3.0, 0.0, 1.0)
    assert signals["greens"] == pytest.approx(
        sum(t.signals["greens"] for t in group.episodes[lose].turns) / 3
    )

    batch = collate([decoded], policy_version=4)
    for i, ep in enumerate(group.episodes):
        n = len(ep.tokens)
        assert batch.tokens[i, :n].tolist() == ep.tokens
        assert batch.loss_mask[i, :n].tolist() == [bool(m) for m in ep.mask]
        assert not batch.loss_mask[i, n:].any()
        assert batch.behaviour_logprobs[i, :n].tolist() == ep.logprobs
    assert batch.rewards.tolist() == [t.reward for t in decoded.trajectories]
    assert batch.staleness.tolist() == [2, 2, 2]
    assert batch.advantages[win] > 0 > batch.advantages[lose]
    # each turn's end and reward travel too: per-turn credit gives the winner's two moves the
    # credit of the win, and the losers' third moves (nothing followed: all 0) none
    for t, ep in zip(decoded.trajectories, group.episodes, strict=True):
        assert t.turn_ends == [turn.end for turn in ep.turns]
        assert t.turn_rewards == [turn.reward for turn in ep.turns]
    assert decoded.trajectories[win].turn_rewards == [0.0, 1.0]
    per_turn = collate([decoded], policy_version=4, credit="turn")
    adv, mask = per_turn.advantages, per_turn.loss_mask
    assert (adv[win][mask[win]] > 0).all()
    first, second, last = group.episodes[lose].turns
    assert (adv[lose, first.start : second.end][mask[lose, first.start : second.end]] < 0).all()
    assert (adv[lose, last.start : last.end] == 0).all()
    overridden = to_submission(group, "worker-1", reward=lambda ep: 0.5)
    assert all(t.turn_ends is None and t.turn_rewards is None for t in overridden.trajectories)

    sizes = payload_sizes(sub)
    assert sizes.binary == len(encode_group(sub))
    assert sizes.json == len(sub.model_dump_json())
    compact = json.loads(json_f32(sub))
    assert sizes.json_f32 == len(json_f32(sub))
    assert [t["logprobs"] for t in compact["trajectories"]] == [
        t.logprobs for t in sub.trajectories
    ]
    assert sizes.binary_zstd < sizes.binary / 2  # the group's episodes share their prompt


def test_tiny_random_model_plays_through_the_transformers_engine(
    server: WordleServer, tok: Any
) -> None:
    torch.manual_seed(0)
    model: torch.nn.Module = transformers.LlamaForCausalLM(tiny_llama(len(tok)))
    engine = TransformersEngine(model.to(torch.bfloat16), seed=0)
    settings = EpisodeSettings(
        group_size=3, max_turns=3, sampling=SamplingParams(max_new_tokens=8, seed=1)
    )
    [group], runner = play(server, tok, engine, settings, [SEED], policy_version=lambda: 0)
    assert runner.batch_sizes[0] == 3
    fmt = ChatFormat(tok)
    for ep in group.episodes:
        check_bookkeeping(ep)
        assert 1 <= ep.num_turns <= 3
        for turn in ep.turns:
            assert all(lp <= 0.0 for lp in turn.completion.logprobs)
            stopped = turn.completion.finish_reason == "stop"
            assert turn.reply == fmt.reply_text(turn.token_ids)
            if turn is not ep.turns[-1]:  # the template's closing follows, once
                closing = ep.tokens[turn.end : turn.end + 2]
                assert closing == ([198] if stopped else [IM_END, 198])[: len(closing)]
                assert ep.mask[turn.end] == 0
    sub = to_submission(group, "w1")
    batch = collate([decode_group(encode_group(sub))])
    assert batch.num_tokens == sum(sum(e.mask) for e in group.episodes)
    # real logprobs (~17 digits as float64 text): the binary payload beats both JSON encodings
    sizes = payload_sizes(sub)
    assert sizes.binary < sizes.json_f32 < sizes.json


def test_engine_errors_fail_the_group_and_close_sessions(server: WordleServer, tok: Any) -> None:
    class Broken:
        def generate(self, prompts: Any, params: SamplingParams) -> Any:
            raise RuntimeError("refusing to generate: weights unhealthy")

    settings = EpisodeSettings(group_size=3)
    with pytest.raises(RuntimeError, match="unhealthy"):
        play(server, tok, Broken(), settings, [SEED, SEED + 1])
    assert server.open_sessions == 0


def test_an_env_error_stops_the_siblings_at_a_turn_boundary(server: WordleServer, tok: Any) -> None:
    words = wrong(SEED)
    engine = ScriptedEngine(tok, lambda key, turn: f"[{words[turn]}]", stop=IM_END)
    settings = EpisodeSettings(group_size=3, sampling=SamplingParams(max_new_tokens=16))

    class Session:
        def __init__(self, inner: AsyncEpisode, fail: bool) -> None:
            self.inner, self.fail, self.first = inner, fail, inner.first

        async def step(self, message: str) -> StepResult:
            if self.fail:
                raise EnvError(ErrorCode.UNKNOWN_SESSION, "session timed out")
            return await self.inner.step(message)

    class FlakyEnv:
        """Episode 1's first step fails; the others would play 6 turns."""

        def __init__(self, env: EnvClient) -> None:
            self.env = env

        @asynccontextmanager
        async def episode(
            self, *, seed: int | None = None, episode_id: str | None = None, **reset: Any
        ) -> AsyncIterator[Session]:
            async with self.env.episode(seed=seed, episode_id=episode_id, **reset) as ep:
                yield Session(ep, fail=(episode_id or "").endswith("/1"))

    async def main() -> None:
        async with (
            EnvClient(server.url) as env,
            EpisodeRunner(engine, tok, FlakyEnv(env), settings) as runner,
        ):
            await runner.run_group(seed=SEED)

    with pytest.raises(EnvError, match="timed out"):
        asyncio.run(main())
    assert server.open_sessions == 0
    assert len(engine.calls) <= 2  # the siblings stopped after at most one more turn


def test_weight_sync_between_turns_is_recorded(
    server: WordleServer, tok: Any, bucket: LocalBucket
) -> None:
    """A real WeightSync gate: a new version lands between turns; every turn is verified."""
    torch.manual_seed(3)
    model: torch.nn.Module = transformers.LlamaForCausalLM(tiny_llama(len(tok)))
    engine = TransformersEngine(model.to(torch.bfloat16), seed=0)
    trainer = FakeTrainer(bucket, clone_state(dict(engine.named_parameters())))
    sync = WeightSync(engine, BucketReader(bucket))
    sync.sync_to(0)

    class SyncAfterFirstCall:
        calls = 0

        def generate(self, prompts: Any, params: SamplingParams) -> Any:
            if self.calls == 1:
                sync.sync_to(trainer.step())
            self.calls += 1
            return sync.generate(prompts, params)

    settings = EpisodeSettings(
        group_size=2, max_turns=2, sampling=SamplingParams(max_new_tokens=6, seed=0)
    )
    [group], _ = play(server, tok, SyncAfterFirstCall(), settings, [SEED])
    for ep in group.episodes:
        check_bookkeeping(ep)
        assert [(t.version_min, t.version_max) for t in ep.turns] == [(0, 0), (1, 1)][
            : ep.num_turns
        ]
    assert group.verdict(sync.check) == "verified"
    assert {(t.version_min, t.version_max) for t in to_submission(group, "w1").trajectories} <= {
        (0, 0),
        (0, 1),
    }


class Templated:
    """The SmolLM2 tokenizer with another chat template."""

    def __init__(self, tok: Any, template: str) -> None:
        self.tok, self.chat_template = tok, template
        self.eos_token_id, self.all_special_ids = tok.eos_token_id, tok.all_special_ids

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        return self.tok.apply_chat_template(
            conversation, chat_template=self.chat_template, **kwargs
        )

    def encode(self, text: Any, **kwargs: Any) -> Any:
        return self.tok.encode(text, **kwargs)

    def decode(self, token_ids: Any, **kwargs: Any) -> Any:
        return self.tok.decode(token_ids, **kwargs)


PLAIN = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
LAST_USER_ONLY = (
    "{% for m in messages %}{% if m['role'] != 'user' or loop.index0 >= messages|length - 2 %}"
    "{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def test_chat_format_plain_and_unstable_templates(tok: Any) -> None:
    plain = ChatFormat(Templated(tok, PLAIN))
    assert plain.end_of_turn_id is None  # "\n\n" closes a turn: only EOS stops
    assert plain.stop_token_ids() == (IM_END,)
    msgs = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "[crane]"}]
    more = plain.continuation_ids(msgs, "XXGXX", stop_token=None)
    assert tok.decode(more) == "\n\nuser: XXGXX\n\nassistant: "
    chatml = ChatFormat(tok)
    assert chatml.end_of_turn_id == IM_END
    # a stop token that is the template's closing is not written twice; a cut reply is closed
    assert tok.decode(chatml.continuation_ids(msgs, "fb", IM_END)).startswith("\n<|im_start|>user")
    assert tok.decode(chatml.continuation_ids(msgs, "fb", None)).startswith("<|im_end|>\n")
    unstable = ChatFormat(Templated(tok, LAST_USER_ONLY))
    long = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    with pytest.raises(ValueError, match="prefix-stable"):
        unstable.continuation_ids(long, "e", None)


def test_a_plain_stop_token_stays_in_the_reply(server: WordleServer, tok: Any) -> None:
    [bracket] = tok.encode("]", add_special_tokens=False)
    words = wrong(SEED)
    engine = ScriptedEngine(tok, lambda key, turn: f"[{words[turn]}", stop=bracket)
    settings = EpisodeSettings(
        group_size=1,
        max_turns=2,
        sampling=SamplingParams(max_new_tokens=16, stop_token_ids=(bracket,)),
    )
    [group], _ = play(server, tok, engine, settings, [SEED])
    ep = group.episodes[0]
    check_bookkeeping(ep)
    first = ep.turns[0]
    assert first.completion.finish_reason == "stop" and first.token_ids[-1] == bracket
    assert first.reply == f"[{words[0]}]" and first.signals["valid"] == 1.0
    assert ep.tokens[first.end] == IM_END  # the template's closing is still written
    assert engine.calls[0][1].stop_token_ids == (bracket, IM_END)


def test_stream_groups_keeps_groups_in_flight_and_reports_failures(
    server: WordleServer, tok: Any
) -> None:
    words = wrong(SEED)
    inner = ScriptedEngine(tok, lambda key, turn: f"[{words[turn]}]", stop=IM_END)
    settings = EpisodeSettings(
        group_size=2, max_turns=2, sampling=SamplingParams(max_new_tokens=16), batch_wait_s=1.0
    )

    class FailsOnce:
        """With ``fail_call`` set, that generate call fails (its group fails, the stream goes on)."""

        fail_call: int | None = None

        def generate(self, prompts: Any, params: SamplingParams) -> Any:
            if len(inner.calls) == self.fail_call:
                self.fail_call = None
                raise RuntimeError("transient engine failure")
            return inner.generate(prompts, params)

    async def seeds() -> AsyncIterator[int]:
        for s in range(SEED, SEED + 5):
            yield s

    def stream(
        generator: FailsOnce, in_flight: int
    ) -> tuple[list[EpisodeGroup | Exception], EpisodeRunner]:
        async def main() -> tuple[list[EpisodeGroup | Exception], EpisodeRunner]:
            async with (
                EnvClient(server.url) as env,
                EpisodeRunner(generator, tok, env, settings) as runner,
            ):
                out = [g async for g in runner.stream_groups(seeds(), in_flight=in_flight)]
                return out, runner

        return asyncio.run(main())

    results, runner = stream(FailsOnce(), in_flight=2)
    assert {r.seed for r in results if isinstance(r, EpisodeGroup)} == set(range(SEED, SEED + 5))
    assert max(runner.batch_sizes) == 4  # two groups of 2 share calls, never more
    assert server.open_sessions == 0

    inner.calls.clear()
    failing = FailsOnce()
    failing.fail_call = 2  # the first turn of the second group (one group at a time)
    results, _ = stream(failing, in_flight=1)
    assert [type(r).__name__ for r in results] == [
        "EpisodeGroup",
        "RuntimeError",
        "EpisodeGroup",
        "EpisodeGroup",
        "EpisodeGroup",
    ]
    assert server.open_sessions == 0
