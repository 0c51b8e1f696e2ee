"""``deltarl eval`` (deltarl.eval.wordle): games played through the env's rules with a scripted
model, counted as the report says; the run summaries of deltarl.run.experiment and
deltarl.run.summary."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from smollm2_helpers import smollm2_tokenizer

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from deltarl.env_server.wordle.game import (  # noqa: E402
    WordLists,
    answer_for_seed,
    consistent,
    score_guess,
)
from deltarl.eval.wordle import WordleEval, evaluate  # noqa: E402
from deltarl.run import experiment, summary  # noqa: E402

HERE = Path(__file__).resolve().parent


REPLIES = ["[crane]", "[slate]", "no idea"]  # valid, valid, invalid (a forfeit with 0 tolerated)


class Scripted(torch.nn.Module):
    """A 'model' whose n-th reply in a game is REPLIES[n] (it counts the assistant turns of
    its prompt), each followed by the end-of-turn token; checks the left padding."""

    def __init__(self, tok: Any) -> None:
        super().__init__()
        self.tok = tok
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.eot = tok.convert_tokens_to_ids("<|im_end|>")

    def generate(self, input_ids: Any, attention_mask: Any, **kw: Any) -> Any:
        assert self.eot in kw["eos_token_id"]
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            first = mask.index(1)
            assert all(mask[first:]) and not any(mask[:first])  # left padded
            text = self.tok.decode(ids[first:])
            n = text.count("<|im_start|>assistant") - 1  # the generation prompt is one
            reply = [*self.tok.encode(REPLIES[n], add_special_tokens=False), self.eot]
            rows.append(ids + reply + [self.eot] * (kw["max_new_tokens"] - len(reply)))
        return torch.tensor(rows)


@pytest.mark.usefixtures("smollm2_tok")  # loaded in setup, not in the timed call
def test_scripted_games_are_counted_as_the_env_scores_them() -> None:
    a = WordleEval(games=5, batch_size=2, max_invalid=0, seed_start=10)
    report, records = evaluate(Scripted(smollm2_tokenizer()), smollm2_tokenizer(), a)
    words = WordLists.load()
    answers = [answer_for_seed(words, s) for s in range(10, 15)]
    assert [r["answer"] for r in records] == answers
    assert not any(x in ("crane", "slate") for x in answers)  # else pick other seeds
    patterns = [(score_guess("crane", x), score_guess("slate", x)) for x in answers]
    for r, (p1, p2) in zip(records, patterns, strict=True):
        assert [m["reply"] for m in r["moves"]] == REPLIES
        assert [m["pattern"] for m in r["moves"]] == [p1, p2, None]
        assert r["forfeit"] and not r["won"] and r["guesses"] == 2
    assert report["games"] == 5 and report["moves"] == 15
    assert report["valid_move_rate"] == pytest.approx(2 / 3)
    assert report["win_rate"] == 0.0 and report["forfeit_rate"] == 1.0
    assert report["won_seeds"] == []
    greens = [p.count("G") for pair in patterns for p in pair]
    assert report["greens_per_guess"] == pytest.approx(sum(greens) / 10)
    assert report["dictionary_rate"] == 1.0 and report["mean_guesses"] == 2
    # [slate] is each game's one later guess: consistent when "crane"'s pattern fits slate
    fits = [score_guess("crane", "slate") == p1 for p1, _ in patterns]
    assert [r["moves"][1]["consistent"] for r in records] == fits
    assert report["consistent_rate"] == pytest.approx(sum(fits) / 5)


@pytest.mark.usefixtures("smollm2_tok")  # loaded in setup, not in the timed call
def test_consistent_rate_counts_later_guesses_that_fit_the_feedback() -> None:
    REPLIES[1] = "[posit]"  # no c, r, a, n, e: fits "soppy"'s XXXXX after crane, not the others
    try:
        a = WordleEval(games=5, max_invalid=0, seed_start=10)
        report, records = evaluate(Scripted(smollm2_tokenizer()), smollm2_tokenizer(), a)
    finally:
        REPLIES[1] = "[slate]"
    fits = [consistent("posit", [("crane", score_guess("crane", r["answer"]))]) for r in records]
    assert [r["moves"][1]["consistent"] for r in records] == fits and 0 < sum(fits) < 5
    assert not any(r["moves"][0]["consistent"] or r["moves"][0]["later"] for r in records)
    assert report["consistent_rate"] == pytest.approx(sum(fits) / 5)


@pytest.mark.usefixtures("smollm2_tok")  # loaded in setup, not in the timed call
def test_feedback_summary_is_rendered_to_the_model() -> None:
    seen: list[str] = []

    class Reading(Scripted):
        def generate(self, input_ids: Any, attention_mask: Any, **kw: Any) -> Any:
            seen.extend(self.tok.decode(row) for row in input_ids.tolist())
            return super().generate(input_ids, attention_mask, **kw)

    for flag in (False, True):
        seen.clear()
        a = WordleEval(games=2, max_invalid=0, feedback_summary=flag)
        evaluate(Reading(smollm2_tokenizer()), smollm2_tokenizer(), a)
        assert any("Known so far:" in text for text in seen) == flag


@pytest.mark.usefixtures("smollm2_tok")  # loaded in setup, not in the timed call
def test_the_winning_reply_wins() -> None:
    words = WordLists.load()
    answer = answer_for_seed(words, 7)
    REPLIES.insert(0, f"[{answer}]")
    try:
        a = WordleEval(games=1, seed_start=7)
        report, records = evaluate(Scripted(smollm2_tokenizer()), smollm2_tokenizer(), a)
    finally:
        REPLIES.pop(0)
    assert report["win_rate"] == 1.0 and records[0]["guesses"] == 1
    assert report["won_seeds"] == [7]
    assert report["greens_per_guess"] == 5 and report["mean_guesses_won"] == 1


def test_run_summary_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert [experiment.visible_gpu(i) for i in (0, 1, 2, 3)] == ["4", "5", "6", "3"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert experiment.visible_gpu(1) == "1"
    scrapes = [
        {"t": 0.0, "version": 0, "games": {}},
        {"t": 30.0, "version": 3, "games": {"won": 1.0, "lost": 5.0}},
        {"t": 61.0, "version": 6, "games": {"won": 2.0, "lost": 6.0, "forfeit": 2.0}},
        {"t": 90.0, "version": 9, "games": {"won": 6.0, "lost": 8.0, "forfeit": 2.0}},
    ]
    scrapes[-1]["games"]["unfinished"] = 7.0  # given up, apart from the games that ended
    windows = summary.game_windows(scrapes, 60.0)
    assert [w["games"] for w in windows] == [10.0, 6.0]
    assert [w["unfinished"] for w in windows] == [0.0, 7.0]
    assert windows[0]["win_rate"] == 0.2 and windows[1]["win_rate"] == pytest.approx(4 / 6)
    assert windows[1]["versions"] == [6, 9]
    means = {"window_means": {"reward/valid/mean": [0.5, 0.9]}}
    empty = {"games": 0.0, "win_rate": None}
    out = summary.wordle_summary(means, [empty, *windows])
    assert out["per_window_of_steps"]["valid_move_rate"] == [0.5, 0.9]
    assert out["win_rate_first_last"] == [0.2, pytest.approx(4 / 6)]
    # --model and a run.model override naming a directory replace the prepared model
    a = experiment.parse_args(["--run-dir", "x", "--model", str(HERE)])
    assert experiment.resolve_model(a) == HERE
    a = experiment.parse_args(["--run-dir", "x", "--set", f'run.model="{HERE}"'])
    assert experiment.resolve_model(a) == HERE
    assert isinstance(a, argparse.Namespace)


def test_scrape_games_reads_the_env_servers_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastapi.testclient import TestClient

    from deltarl.env_server.core.app import create_app
    from deltarl.env_server.settings import EnvSettings

    with TestClient(create_app(EnvSettings.model_validate({}))) as client:
        won = client.post("/reset", json={"seed": 1}).json()["session_id"]
        move = {
            "session_id": won,
            "action": {"message": f"[{answer_for_seed(WordLists.load(), 1)}]"},
        }
        assert client.post("/step", json=move).json()["done"]
        given_up = client.post("/reset", json={"seed": 2}).json()["session_id"]
        client.post("/close", json={"session_id": given_up})
        monkeypatch.setattr(summary.httpx, "get", lambda url, **kw: client.get("/metrics"))
        games = {"won": 1.0, "lost": 0.0, "forfeit": 0.0, "unfinished": 1.0}
        assert summary.scrape_games("http://env/metrics", None) == games


def test_trained_episodes_per_second_count_from_the_trainers_start(tmp_path: Path) -> None:
    # the vLLM workers' start-up is not training time
    (tmp_path / "trainer").mkdir()
    rows = [{"sequences": 32, "tokens": 3200, "reward/mean": 0.1}] * 10
    (tmp_path / "trainer" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    a = experiment.parse_args(["--run-dir", str(tmp_path)])
    out = summary.summarise(vars(a), tmp_path, 200.0, {}, train_s=80.0, window=a.window)
    assert out["episodes_trained_per_s"] == pytest.approx(320 / 80.0)
    assert out["tokens_trained_per_s"] == pytest.approx(32000 / 80.0)
    assert (out["elapsed_s"], out["train_s"], out["startup_s"]) == (200.0, 80.0, 120.0)
