"""Play Wordle games with a model and measure how it plays.

Each game runs through the env server's own rules in this process
(:class:`~deltarl.env_server.wordle.environment.WordleEnvironment`) and is tokenized exactly as a
rollout worker's episode (:class:`~deltarl.rollout.episodes.chat_format.ChatFormat`: the system prompt
``WORDLE_SYSTEM_PROMPT``, the first observation with the generation prompt, then each reply's
tokens and the template text with the env's feedback). All running games of a round are
generated as one left-padded batch with transformers ``generate`` (greedy at temperature 0, else
sampling at that temperature over the full softmax, as the workers sample); each reply stops at
the end-of-turn or EOS token or after ``max_new_tokens``.

:func:`summarize` reports: games; moves; ``valid_move_rate`` (moves the env scored: a bracketed
5-letter word, in the dictionary unless ``allow_non_words``, not repeated); ``format_rate`` (a
bracketed 5-letter word at all); ``win_rate``; ``forfeit_rate``; per valid guess the mean greens
and yellows (0-5) and per move their /5 values (the env's ``greens``/``yellows`` signals);
``consistent_rate`` (valid guesses after a game's first that could still be the answer given all
the feedback before them, the solver's skill); ``mean_guesses`` and ``mean_guesses_won``; the
mean return under the rules' reward; ``dictionary_rate``; and ``won_seeds``, the seeds of the
games won, so two reports over the same seeds compare game by game.

torch and transformers are imported inside the functions that need them.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class WordleEval:
    """What to play: ``games`` games on the answers of seeds ``seed_start`` onwards (away from
    the solver games' 0...), under these rules, replies of at most ``max_new_tokens`` tokens
    sampled at ``temperature`` (0: greedy), ``batch_size`` games generated together."""

    games: int = 200
    seed_start: int = 1_000_000
    max_guesses: int = 6
    max_invalid: int = 1
    allow_non_words: bool = False
    feedback_summary: bool = False
    max_new_tokens: int = 12
    temperature: float = 0.0
    batch_size: int = 256


def resolve_model(name: str, cache_dir: Path) -> Path:
    """A model directory: ``name`` itself, or a prepared model's (``services.common.models``)."""
    from deltarl.services.common.models import resolve_model as resolve

    return Path(resolve(name, cache_dir))


def final_version(run_dir: Path) -> int:
    """The last published version of a finished run (its ``summary.json``'s coordinator
    status)."""
    status = json.loads((run_dir / "summary.json").read_text())["coordinator_status"] or {}
    version = status.get("final_version")
    if version is None:
        version = (status.get("status") or {}).get("latest_version")
    if version is None:
        raise ValueError(f"{run_dir}/summary.json names no final version")
    return int(version)


def export_policy(run_dir: Path, base: Path, out: Path, version: int | None) -> tuple[Path, int]:
    """Rebuild version ``version`` (default: the final one) of the run in ``run_dir`` from its
    ``bucket/`` as a model directory ``out`` on the config and tokenizer of ``base``."""
    from deltarl.demo.report import export_version

    v = final_version(run_dir) if version is None else version
    out.mkdir(parents=True, exist_ok=True)
    export_version(str(run_dir / "bucket"), v, base, out)
    return out, v


class Game:
    """One game: its env, its chat so far and its token ids (as the worker holds them)."""

    def __init__(self, env: Any, seed: int, fmt: Any, system_prompt: str) -> None:
        from deltarl.rollout.episodes.runner import observation_text

        self.env, self.seed, self.fmt = env, seed, fmt
        self.result = env.reset(seed=seed)
        self.messages = [
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": observation_text(None, self.result)},
        ]
        self.ids: list[int] = fmt.prompt_ids(self.messages)
        self.moves: list[dict[str, Any]] = []

    def play(
        self, reply_ids: list[int], stop_token: int | None, dictionary: frozenset[str]
    ) -> None:
        from deltarl.env_server.wordle.game import extract_guess
        from deltarl.rollout.episodes.runner import observation_text

        text = self.fmt.reply_text(reply_ids)
        previous = self.result
        self.result = self.env.step(text)
        sig = self.result.observation.reward_signals
        last = self.result.observation.last_move
        guess = extract_guess(text)
        self.moves.append(
            {
                "reply": text,
                "guess": guess,
                "valid": bool(last.valid),
                "format": sig.format,
                "greens": round(sig.greens * 5),
                "yellows": round(sig.yellows * 5),
                "repeated": bool(last.repeated),
                "word": guess in dictionary if guess else False,
                "pattern": self.env.game.guesses[-1][1] if last.valid else None,
                # a valid guess after the game's first: could it still be the answer given all
                # the feedback before it (the env's `consistent` signal)?
                "later": bool(last.valid) and len(self.env.game.guesses) > 1,
                "consistent": bool(sig.consistent),
                "reward": self.result.reward,
            }
        )
        self.ids += reply_ids
        self.messages.append({"role": "assistant", "content": text})
        if not self.result.done:
            feedback = observation_text(previous, self.result)
            self.ids += self.fmt.continuation_ids(self.messages, feedback, stop_token)
            self.messages.append({"role": "user", "content": feedback})

    def record(self) -> dict[str, Any]:
        game = self.env.game
        return {
            "seed": self.seed,
            "answer": game.answer,
            "won": game.won,
            "forfeit": game.forfeited,
            "guesses": len(game.guesses),
            "return": game.total_reward,
            "moves": self.moves,
        }


def generate_round(
    model: Any, games: list[Game], stops: tuple[int, ...], settings: WordleEval, pad: int
) -> list[tuple[list[int], int | None]]:
    """One reply per game (left-padded batch): its token ids up to and including the stop
    token, and that stop token (None: cut by length)."""
    import torch

    device = next(model.parameters()).device
    width = max(len(g.ids) for g in games)
    ids = torch.full((len(games), width), pad, dtype=torch.long)
    attn = torch.zeros((len(games), width), dtype=torch.long)
    for i, g in enumerate(games):
        ids[i, width - len(g.ids) :] = torch.tensor(g.ids)
        attn[i, width - len(g.ids) :] = 1
    sampling = settings.temperature > 0
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=attn.to(device),
            max_new_tokens=settings.max_new_tokens,
            do_sample=sampling,
            temperature=settings.temperature if sampling else None,
            top_k=0 if sampling else None,
            top_p=1.0 if sampling else None,
            eos_token_id=list(stops),
            pad_token_id=pad,
        )
    replies = []
    for row in out[:, width:].tolist():
        reply: list[int] = []
        stop = None
        for t in row:
            reply.append(int(t))
            if t in stops:
                stop = int(t)
                break
        replies.append((reply, stop))
    return replies


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The report's numbers over every game's record (see the module docstring)."""
    moves = [m for r in records for m in r["moves"]]
    valid = [m for m in moves if m["valid"]]
    won = [r for r in records if r["won"]]

    def mean(xs: list[float]) -> float | None:
        return statistics.fmean(xs) if xs else None

    return {
        "games": len(records),
        "moves": len(moves),
        "valid_move_rate": len(valid) / len(moves) if moves else None,
        "format_rate": mean([m["format"] for m in moves]),
        "repeat_rate": mean([float(m["repeated"]) for m in moves]),
        "dictionary_rate": mean([float(m["word"]) for m in valid]),
        "win_rate": len(won) / len(records) if records else None,
        "forfeit_rate": mean([float(r["forfeit"]) for r in records]),
        "greens_per_guess": mean([m["greens"] for m in valid]),
        "yellows_per_guess": mean([m["yellows"] for m in valid]),
        "consistent_rate": mean([float(m["consistent"]) for m in moves if m.get("later")]),
        "greens_per_move_over_5": mean([m["greens"] / 5 for m in moves]),
        "yellows_per_move_over_5": mean([m["yellows"] / 5 for m in moves]),
        "mean_guesses": mean([r["guesses"] for r in records]),
        "mean_guesses_won": mean([r["guesses"] for r in won]),
        "mean_return": mean([r["return"] for r in records]),
        "distinct_first_guesses": len({r["moves"][0]["guess"] for r in records if r["moves"]}),
        # the games won, by seed: two models' reports over the same seeds compare pairwise
        "won_seeds": [r["seed"] for r in won],
    }


def evaluate(
    model: Any, tokenizer: Any, settings: WordleEval
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Play ``settings.games`` games with ``model``; the summary and every game's record."""
    from deltarl.env_server.wordle.environment import WordleEnvironment
    from deltarl.env_server.wordle.game import WordleRules, WordLists
    from deltarl.env_server.wordle.prompt import SYSTEM_PROMPT as WORDLE_SYSTEM_PROMPT
    from deltarl.rollout.episodes.chat_format import ChatFormat

    words = WordLists.load()
    dictionary = frozenset(words.allowed)
    rules = WordleRules(
        max_guesses=settings.max_guesses,
        max_invalid_moves=settings.max_invalid,
        allow_non_words=settings.allow_non_words,
        feedback_summary=settings.feedback_summary,
    )
    fmt = ChatFormat(tokenizer)
    stops = fmt.stop_token_ids()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    records: list[dict[str, Any]] = []
    seeds = list(range(settings.seed_start, settings.seed_start + settings.games))
    for at in range(0, len(seeds), settings.batch_size):
        games = [
            Game(WordleEnvironment(rules, words), s, fmt, WORDLE_SYSTEM_PROMPT)
            for s in seeds[at : at + settings.batch_size]
        ]
        running = games
        while running:
            replies = generate_round(model, running, stops, settings, pad)
            for g, (reply, stop) in zip(running, replies, strict=True):
                g.play(reply, stop, dictionary)
            running = [g for g in running if not g.result.done]
        records += [g.record() for g in games]
    return summarize(records), records


def run_eval(
    model_dir: Path,
    settings: WordleEval,
    *,
    label: str = "",
    also_temperature: float | None = None,
    device: str = "auto",
    seed: int = 0,
    show: int = 5,
    exported: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load ``model_dir`` (float32) and play; the report: label, settings, the summary, with
    ``also_temperature`` the same games sampled at that temperature (``sampled``), the time
    taken and the first ``show`` games' replies and patterns."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = model.to(auto if device == "auto" else device)
    model.eval()
    summary, records = evaluate(model, tokenizer, settings)
    sampled: dict[str, Any] = {}
    if also_temperature is not None:
        again = dataclasses.replace(settings, temperature=also_temperature)
        sampled_summary, _ = evaluate(model, tokenizer, again)
        sampled = {"sampled": {"temperature": also_temperature, **sampled_summary}}
    return {
        "label": label,
        "model": str(model_dir),
        **(exported or {}),
        "settings": dataclasses.asdict(settings) | {"device": device, "seed": seed},
        **summary,
        **sampled,
        "seconds": round(time.perf_counter() - started, 1),
        "examples": [
            {
                "answer": r["answer"],
                "won": r["won"],
                "moves": [[m["reply"], m["pattern"]] for m in r["moves"]],
            }
            for r in records[:show]
        ],
    }


def brief(report: dict[str, Any]) -> dict[str, Any]:
    """The report without its long parts (examples, settings, won seeds), for a terminal."""
    quiet = ("examples", "settings", "won_seeds")
    return {k: brief(v) if k == "sampled" else v for k, v in report.items() if k not in quiet}
