"""`deltarl sft`: solver transcripts, the assistant-only mask, the loss falls on a tiny
random Llama, and the saved directory loads as the trainer loads its model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from smollm2_helpers import smollm2_tokenizer
from typer.testing import CliRunner

from deltarl.cli import app
from deltarl.env_server.core.render import write_transcripts
from deltarl.env_server.wordle.game import WordleRules
from deltarl.env_server.wordle.prompt import SYSTEM_PROMPT as WORDLE_SYSTEM_PROMPT
from deltarl.env_server.wordle.transcripts import solver_transcripts
from deltarl.rollout.episodes.chat_format import ChatFormat
from deltarl.trainer.supervised.sft import (
    SftSettings,
    _transcripts,
    encode_transcript,
    load_transcripts,
    run_sft,
)

IM_END = "<|im_end|>"


def tiny_model(vocab: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    return transformers.LlamaForCausalLM(cfg)


def test_transcripts_have_the_episode_shape(tmp_path: Path) -> None:
    records = list(solver_transcripts(5, seed=0, rules=WordleRules(max_guesses=6)))
    for r in records:
        roles = [m["role"] for m in r["messages"]]
        assert roles[:2] == ["system", "user"] and roles[-1] == "assistant"
        assert r["messages"][0]["content"] == WORDLE_SYSTEM_PROMPT
        assert r["messages"][1]["content"].startswith("You are Player 0 in Wordle.")
        replies = [m["content"] for m in r["messages"] if m["role"] == "assistant"]
        assert replies[0] == "[crane]" and len(replies) == r["guesses"]
        assert all(len(x) == 7 and x[0] == "[" and x[-1] == "]" for x in replies)
        feedback = [m["content"] for m in r["messages"][3::2]]
        assert all(f.startswith("You submitted [") for f in feedback)
    assert sum(r["won"] for r in records) >= 4
    path = tmp_path / "games.jsonl"
    assert write_transcripts(path, iter(records)) == 5
    assert load_transcripts(path) == [r["messages"] for r in records]
    three = next(solver_transcripts(1, seed=3, rules=WordleRules(max_guesses=2)))
    assert "You have 2 attempts" in three["messages"][1]["content"]


@pytest.mark.usefixtures("smollm2_tok")  # loaded in setup, not in the timed call
def test_bad_transcripts_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match="no assistant turn"):
        load_transcripts(path)
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        load_transcripts(path)
    fmt = ChatFormat(smollm2_tokenizer())
    with pytest.raises(ValueError, match="a transcript is"):
        encode_transcript(fmt, [{"role": "assistant", "content": "[crane]"}])


@pytest.mark.usefixtures("smollm2_tok")  # loaded in setup, not in the timed call
def test_mask_covers_exactly_the_assistant_replies() -> None:
    tok = smollm2_tokenizer()
    (record,) = solver_transcripts(1, seed=5)
    enc = encode_transcript(ChatFormat(tok), record["messages"])
    assert len(enc.tokens) == len(enc.mask)
    trained = [t for t, m in zip(enc.tokens, enc.mask, strict=True) if m]
    replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
    assert tok.decode(trained) == "".join(r + IM_END for r in replies)
    # everything else is the chat template rendering the whole conversation
    full = tok.apply_chat_template(record["messages"], tokenize=False)
    assert tok.decode(enc.tokens) == full.rstrip("\n")


@pytest.mark.slow  # ~1-2 min on 2 busy cores (a 49k-token output layer)
def test_loss_falls_and_the_model_loads(tmp_path: Path) -> None:
    tok = smollm2_tokenizer()
    chats = [r["messages"] for r in solver_transcripts(6, seed=0)]
    model = tiny_model(len(tok))
    out = tmp_path / "warm"
    settings = SftSettings(out=out, steps=20, batch_size=3, lr=1e-2, device="cpu")
    result = run_sft(settings, model=model, tokenizer=tok, transcripts=chats)
    assert len(result.losses) == 20 and result.transcripts == 6
    first, last = sum(result.losses[:3]) / 3, sum(result.losses[-3:]) / 3
    assert last < 0.7 * first, result.losses
    # the trainer's way of loading its model: the warm-started weights, bit for bit
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    reloaded = transformers.AutoTokenizer.from_pretrained(str(out))
    assert ChatFormat(reloaded).prompt_ids(chats[0][:2]) == ChatFormat(tok).prompt_ids(chats[0][:2])
    assert json.loads((out / "sft.json").read_text())["losses"] == result.losses


@pytest.mark.parametrize("summary", [False, True])
def test_generated_games_follow_feedback_summary(summary: bool) -> None:
    chats = _transcripts(SftSettings(games=2, feedback_summary=summary))
    later = [m["content"] for chat in chats for m in chat[3::2]]
    assert later and all(("Known so far:" in text) is summary for text in later)


def test_help_lists_the_settings() -> None:
    result = CliRunner().invoke(app, ["sft", "--help"])
    assert result.exit_code == 0, result.output
    for name in ("DELTARL_SFT_STEPS", "DELTARL_SFT_DATA", "DELTARL_SFT_OUT", "DELTARL_SFT_LR"):
        assert name in result.output
    bad = CliRunner().invoke(app, ["sft", "--set", "stepz=3"])
    assert bad.exit_code != 0 and "stepz" in bad.output
