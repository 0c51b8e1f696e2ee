"""Synthetic hint-following transcripts for the charset task (``deltarl.env_server.charset.transcripts``):
their shape, that a hinted one is exactly the context the worker's env hinter scores, and that
``deltarl sft`` encodes it with the hint as a second user turn."""

from __future__ import annotations

import asyncio
import json
import string
from pathlib import Path

import pytest
from smollm2_helpers import smollm2_tokenizer
from test_sft import IM_END

from deltarl.env_server.charset.environment import (
    CharsetEnvironment,
    CharsetRules,
    make_prompt,
    score_reply,
)
from deltarl.env_server.charset.transcripts import HintData, hint_transcripts, main
from deltarl.env_server.core.render import write_transcripts
from deltarl.rollout.distill.hints import EnvHinter, hinted_context
from deltarl.rollout.engines.base import UNMANAGED, Completion
from deltarl.rollout.episodes.chat_format import ChatFormat
from deltarl.rollout.episodes.runner import Episode, Turn
from deltarl.trainer.supervised.sft import encode_transcript, load_transcripts

FAMILY = (string.ascii_uppercase, string.ascii_lowercase, string.digits)


def test_hinted_replies_keep_to_the_set_and_unhinted_ones_do_not() -> None:
    data = HintData(recover=0.5)
    records = list(hint_transcripts(400, seed=3, data=data))
    hinted = [r for r in records if r["hinted"]]
    assert 150 < len(hinted) < 250  # hinted = 0.5
    assert 50 < sum("prefill" in r["messages"][-1] for r in hinted) < 150  # recover = 0.5
    for r in records:
        target, messages = r["target"], r["messages"]
        assert data.set_min <= len(target) <= data.set_max and len(set(target)) == len(target)
        assert messages[0] == {"role": "system", "content": ""}
        rules = CharsetRules(target=target, min_chars=data.min_chars)
        assert messages[1] == {"role": "user", "content": make_prompt(rules)}
        answer = messages[-1]
        prefill, reply = answer.get("prefill", ""), answer["content"]
        assert answer["role"] == "assistant"
        assert data.min_chars <= len(prefill + reply) <= data.min_chars + data.extra
        assert set(prefill + reply) <= set(data.alphabet)
        if r["hinted"]:
            assert [m["role"] for m in messages] == ["system", "user", "user", "assistant"]
            assert set(reply) <= set(target) and reply
            assert score_reply(r["hinted_reply"], rules)[0] < 1.0
            assert r["hinted_reply"].startswith(prefill)  # the wrong start the hint was for
        else:
            assert len(messages) == 3 and r["hinted_reply"] is None and not prefill
    # unhinted replies are the whole alphabet at random: a quarter of their characters or less
    # fall in the prompt's set on average (sets of 3-8 of 62 characters)
    plain = [r for r in records if not r["hinted"]]
    share = sum(
        score_reply(r["messages"][-1]["content"], CharsetRules(r["target"]))[0] for r in plain
    )
    assert share / len(plain) < 0.25
    assert list(hint_transcripts(50, seed=3, data=data)) == records[:50]  # seeded
    assert list(hint_transcripts(50, seed=4, data=data)) != records[:50]


def test_a_family_of_targets_and_no_system_prompt() -> None:
    data = HintData(targets=FAMILY, system_prompt=None, hinted=1.0)
    records = list(hint_transcripts(60, seed=0, data=data))
    assert {r["target"] for r in records} == set(FAMILY)
    assert all(r["hinted"] and r["messages"][0]["role"] == "user" for r in records)
    with pytest.raises(ValueError, match="set_max"):
        HintData(set_min=3, set_max=2)
    with pytest.raises(ValueError, match="distinct"):
        HintData(alphabet="aab")
    with pytest.raises(ValueError, match="alphabet only"):
        HintData(targets=("ab!",))
    with pytest.raises(ValueError, match="recover"):
        HintData(recover=1.5)


@pytest.mark.usefixtures("smollm2_tok")  # loaded in setup, not in the timed call
def test_a_hinted_transcript_is_what_the_env_hinter_scores() -> None:
    """The hint is the one the charset environment sends for the recorded random reply, and
    ``deltarl sft`` trains the reply after exactly the tokens the worker scores a hinted turn
    after (``hinted_context``)."""
    fmt = ChatFormat(smollm2_tokenizer())
    records = [r for r in hint_transcripts(20, seed=1, data=HintData(recover=0.5)) if r["hinted"]]
    assert any("prefill" in r["messages"][-1] for r in records)
    assert any("prefill" not in r["messages"][-1] for r in records)
    for r in records:
        system, prompt, hint_message, answer = r["messages"]
        env = CharsetEnvironment(CharsetRules(target=r["target"], min_chars=HintData().min_chars))
        assert env.reset(seed=0).observation.prompt == prompt["content"]
        sent = env.step(r["hinted_reply"]).observation.hint
        ep = Episode(group_id="g", index=0, seed=0, reward=0.0, env_hint=sent)
        ep.messages += [system, prompt, {"role": "assistant", "content": r["hinted_reply"]}]
        c = Completion([1], [-0.1], "stop", UNMANAGED, UNMANAGED)
        ep.turns.append(Turn(0, 1, c, r["hinted_reply"], 0, 0, 0.0, {}, True))
        hint = asyncio.run(EnvHinter().hint(ep))
        assert hint is not None and hint.text == hint_message["content"]
        enc = encode_transcript(fmt, r["messages"])
        context = hinted_context(ep, hint, fmt)
        prefill = fmt.encode(answer.get("prefill", ""))
        assert enc.tokens[: len(context) + len(prefill)] == context + prefill
        assert not any(enc.mask[: len(context) + len(prefill)])
        trained = [t for t, m in zip(enc.tokens, enc.mask, strict=True) if m]
        assert fmt.tokenizer.decode(trained) == answer["content"] + IM_END
        assert all(enc.mask[len(context) + len(prefill) :])


@pytest.mark.usefixtures("smollm2_tok")  # loaded in setup, not in the timed call
def test_several_user_turns_only_before_the_first_reply() -> None:
    fmt = ChatFormat(smollm2_tokenizer())
    u, a = {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}
    encode_transcript(fmt, [u, u, u, a, u, a])
    for bad in ([u, u], [a, u, a], [u, a, u, u, a], [u, a, a]):
        with pytest.raises(ValueError, match="a transcript is"):
            encode_transcript(fmt, bad)


def test_the_command_line_writes_what_deltarl_sft_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hints.jsonl"
    main(["--count", "12", "--out", str(out), "--seed", "2"])
    assert json.loads(capsys.readouterr().out) == {"out": str(out), "transcripts": 12}
    expected = list(hint_transcripts(12, seed=2))
    assert load_transcripts(out) == [r["messages"] for r in expected]
    assert write_transcripts(tmp_path / "again.jsonl", iter(expected)) == 12
    main(["--count", "30", "--out", str(out), "--targets", *FAMILY])
    capsys.readouterr()
    family = list(hint_transcripts(30, seed=0, data=HintData(targets=FAMILY)))
    assert load_transcripts(out) == [r["messages"] for r in family]
