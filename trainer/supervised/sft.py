"""``deltarl sft``: a supervised warm start on chat transcripts (e.g. solver-played Wordle).

Cross-entropy on the assistant tokens only: each transcript (JSONL, ``{"messages": [...]}``,
as :mod:`deltarl.env_server.wordle.transcripts` writes) is tokenized exactly as a rollout episode would hold it
(:class:`~deltarl.rollout.episodes.chat_format.ChatFormat`: the first prompt rendered with the generation
prompt, each reply's tokens followed by the template's end-of-turn token, then the template text
that closes the turn and opens the next user turn), and the loss mask is 1 on the reply tokens
and their end-of-turn token (what the policy samples) and 0 on everything else (system, user,
template text). An assistant message may also hold ``prefill``, text its reply starts with
that is context, not trained (masked 0; the reply is ``prefill`` then ``content``): e.g. the
start of a wrong reply that a hint should steer back on course (:mod:`deltarl.env_server.charset.transcripts`). The
model trains for ``steps`` AdamW steps (fp32 master weights) on batches of ``batch_size``
transcripts drawn in a seeded random order, and is saved with its tokenizer as a
Hugging Face directory (``save_pretrained``): use it as the run's model (``[run] model =
"<out>"``, or the trainer's ``model``) and the trainer's first published anchor (version 0) is
the warm-started weights, which the workers load.

Without ``data``, ``games`` solver games are generated first (:func:`deltarl.env_server.wordle.transcripts.solver_transcripts`).
SmolLM2-135M at scale (a few thousand games, a few hundred steps) wants a GPU (minutes there);
on 2 CPU cores expect a step to take seconds.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import typer
from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from deltarl.services.common.settings import settings_help

if TYPE_CHECKING:
    import torch

    from deltarl.rollout.episodes.chat_format import ChatFormat

logger = logging.getLogger(__name__)

# The loss is logged at the first step, every 10th and the last: a few hundred steps make a
# readable log, and sft.json keeps every step's loss.
LOG_EVERY = 10

__all__ = ["SftResult", "SftSettings", "encode_transcript", "load_transcripts", "run_sft"]


class SftSettings(BaseSettings):
    """Settings of ``deltarl sft`` (environment ``DELTARL_SFT_*``, or ``--set key=value``)."""

    model_config = SettingsConfigDict(env_prefix="DELTARL_SFT_", extra="forbid")

    model: str = Field(
        default="smollm2",
        description="Model to start from: a Hugging Face directory or id, or a prepared model "
        "(smollm2 | tiny | tiny-bytes, built in cache_dir as deltarl run does).",
    )
    cache_dir: Path | None = Field(
        default=None,
        description="Where prepared models are built (deltarl run's --cache-dir); unset: "
        "~/.cache/deltarl/demo.",
    )
    data: Path | None = Field(
        default=None,
        description="Transcripts (JSONL of {messages: [...]}, python -m deltarl.env_server.wordle.transcripts "
        "writes them); unset: generate `games` solver games.",
    )
    games: int = Field(default=1000, ge=1, description="Solver games to generate without data.")
    max_guesses: int = Field(
        default=6, ge=1, le=100, description="Guesses of the generated games (without data)."
    )
    feedback_summary: bool = Field(
        default=False,
        description="The generated games' feedback also states what all the feedback so far "
        "shows (without data; the env server's feedback_summary, which the run must play too).",
    )
    out: Path = Field(
        default=Path("runs/sft"),
        description="Output directory: the model (save_pretrained, fp32) with its tokenizer.",
    )
    steps: int = Field(default=200, ge=1, description="Optimizer steps.")
    batch_size: int = Field(default=8, ge=1, description="Transcripts per step.")
    lr: float = Field(default=1e-5, gt=0, description="AdamW learning rate (constant).")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(default=1.0, gt=0, description="Max global gradient norm.")
    max_tokens: int = Field(
        default=2048, ge=8, description="Transcripts longer than this (tokens) are cut."
    )
    seed: int = Field(default=0, ge=0, description="Seed of the data order and of torch.")
    device: str = Field(default="auto", description="'auto' (cuda if present), 'cpu', 'cuda:1'.")
    precision: Literal["fp32", "bf16"] = Field(
        default="fp32", description="Forward/backward dtype (autocast on CUDA for bf16)."
    )


@dataclass(frozen=True)
class Encoded:
    """One transcript as token ids and the loss mask (1 on assistant tokens)."""

    tokens: list[int]
    mask: list[int]


@dataclass(frozen=True)
class SftResult:
    out: Path
    losses: list[float]  # per step, mean cross-entropy per assistant token (nats)
    transcripts: int
    seconds: float


def load_transcripts(path: Path) -> list[list[dict[str, str]]]:
    """The ``messages`` of every line of a JSONL file (ValueError naming the bad line)."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            messages = json.loads(line)["messages"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: not a transcript ({{messages: [...]}}): {exc}") from None
        if not any(m.get("role") == "assistant" for m in messages):
            raise ValueError(f"{path}:{n}: no assistant turn to train on")
        out.append(messages)
    if not out:
        raise ValueError(f"{path}: no transcripts")
    return out


def encode_transcript(fmt: ChatFormat, messages: Sequence[dict[str, str]]) -> Encoded:
    """Tokens and mask of a conversation, built as a rollout episode is (module docstring).

    ``messages``: optional system turn, then user, assistant, user, assistant, ..., ending with
    an assistant turn; the first assistant turn may follow several user turns (a hinted context,
    :func:`~deltarl.rollout.distill.hints.hinted_context`: the prompt, then the hint as one more user
    message), which are rendered together as the first prompt. An assistant message's
    ``prefill`` (optional) is encoded before its ``content`` with mask 0. Raises ``ValueError``
    for another shape.
    """
    roles = [m["role"] for m in messages]
    start = 1 if roles and roles[0] == "system" else 0
    first = roles.index("assistant") if "assistant" in roles else len(roles)
    rest = roles[first:]
    if (
        first == start
        or any(r != "user" for r in roles[start:first])
        or not rest
        or rest[-1] != "assistant"
        or any(r != ("assistant" if i % 2 == 0 else "user") for i, r in enumerate(rest))
    ):
        raise ValueError(
            "a transcript is [system], user, [user, ...], assistant, user, ..., assistant; "
            f"got {roles}"
        )
    eot = fmt.end_of_turn_id
    tokens = fmt.prompt_ids(messages[:first])
    mask = [0] * len(tokens)
    for i in range(first, len(messages), 2):
        prefill = messages[i].get("prefill", "")
        head = fmt.encode(prefill) if prefill else []
        reply = fmt.encode(messages[i]["content"]) + ([eot] if eot is not None else [])
        tokens += head + reply
        mask += [0] * len(head) + [1] * len(reply)
        if i + 1 < len(messages):
            more = fmt.continuation_ids(messages[: i + 1], messages[i + 1]["content"], eot)
            tokens += more
            mask += [0] * len(more)
    return Encoded(tokens, mask)


def _resolve_model(settings: SftSettings) -> str:
    from deltarl.services.common.models import resolve_model

    return resolve_model(settings.model, settings.cache_dir)


def _transcripts(settings: SftSettings) -> list[list[dict[str, str]]]:
    if settings.data is not None:
        return load_transcripts(settings.data)
    from deltarl.env_server.wordle.game import WordleRules
    from deltarl.env_server.wordle.transcripts import solver_transcripts

    records = solver_transcripts(
        settings.games,
        seed=settings.seed,
        rules=WordleRules(
            max_guesses=settings.max_guesses, feedback_summary=settings.feedback_summary
        ),
    )
    return [r["messages"] for r in records]


def _device(name: str) -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def sft_loss(model: torch.nn.Module, batch: Sequence[Encoded], device: torch.device) -> Any:
    """Mean cross-entropy per masked (assistant) token of a batch (right-padded)."""
    import torch

    width = max(len(e.tokens) for e in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    attn = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.float32)
    for b, e in enumerate(batch):
        n = len(e.tokens)
        ids[b, :n] = torch.tensor(e.tokens)
        attn[b, :n] = 1
        mask[b, :n] = torch.tensor(e.mask, dtype=torch.float32)
    ids, attn, mask = ids.to(device), attn.to(device), mask.to(device)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    target, weight = ids[:, 1:], mask[:, 1:]  # position t predicts token t + 1
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none"
    ).view_as(weight)
    return (nll * weight).sum() / weight.sum().clamp(min=1.0)


def run_sft(
    settings: SftSettings,
    *,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    transcripts: list[list[dict[str, str]]] | None = None,
) -> SftResult:
    """Train and save (see the module docstring). ``model``/``tokenizer``/``transcripts`` given
    (tests) replace loading ``settings.model`` and reading ``settings.data``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deltarl.rollout.episodes.chat_format import ChatFormat

    started = time.perf_counter()
    torch.manual_seed(settings.seed)
    if model is None or tokenizer is None:
        source = _resolve_model(settings)
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    assert model is not None
    fmt = ChatFormat(tokenizer)
    chats = transcripts if transcripts is not None else _transcripts(settings)
    encoded = []
    for chat in chats:
        e = encode_transcript(fmt, chat)
        if len(e.tokens) > settings.max_tokens:
            e = Encoded(e.tokens[: settings.max_tokens], e.mask[: settings.max_tokens])
        if any(e.mask):
            encoded.append(e)
    if not encoded:
        raise ValueError("no transcript has an assistant token within max_tokens")
    device = _device(settings.device)
    model.to(device=device, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    rng = random.Random(settings.seed)
    order: list[int] = []
    losses: list[float] = []
    bf16 = settings.precision == "bf16" and device.type == "cuda"
    for step in range(1, settings.steps + 1):
        batch: list[Encoded] = []
        while len(batch) < min(settings.batch_size, len(encoded)):
            if not order:
                order = list(range(len(encoded)))
                rng.shuffle(order)
            batch.append(encoded[order.pop()])
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = sft_loss(model, batch, device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
        if step % LOG_EVERY == 0 or step == 1 or step == settings.steps:
            logger.info("sft step %d/%d: loss %.4f", step, settings.steps, losses[-1])
    model.eval()
    settings.out.mkdir(parents=True, exist_ok=True)
    model.to("cpu")
    cast(Any, model).save_pretrained(settings.out)
    tokenizer.save_pretrained(settings.out)
    (settings.out / "sft.json").write_text(
        json.dumps(
            {
                "settings": json.loads(settings.model_dump_json()),
                "transcripts": len(encoded),
                "losses": losses,
            },
            indent=1,
        )
        + "\n"
    )
    return SftResult(settings.out, losses, len(encoded), time.perf_counter() - started)


def sft(
    overrides: list[str] = typer.Option(
        [], "--set", "-s", help="A setting: --set steps=300 --set out=runs/warm (repeatable)."
    ),
) -> None:
    try:
        values: dict[str, Any] = {}
        for item in overrides:
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"--set {item!r}: expected KEY=VALUE")
            values[key.strip()] = value
        settings = SftSettings(**values)
    except (ValidationError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    result = run_sft(settings)
    typer.echo(
        json.dumps(
            {
                "out": str(result.out),
                "transcripts": result.transcripts,
                "first_loss": result.losses[0],
                "last_loss": result.losses[-1],
                "seconds": round(result.seconds, 1),
            }
        )
    )


sft.__doc__ = (
    "Supervised warm start: cross-entropy on the assistant turns of chat transcripts (solver-"
    "played Wordle by default), saved as a model directory the trainer starts from.\n\n"
    + settings_help(SftSettings)
)
