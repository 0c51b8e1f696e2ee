"""Synthetic hint-following transcripts for the charset task: the material of a warm start that
lets a tiny model read :func:`~deltarl.env_server.charset.hints.charset_hint`'s hints, the way a
pretrained instruct model reads an instruction, while it learns nothing about any one target.

Each transcript draws a random target set (``set_min``-``set_max`` distinct characters of
``alphabet``) and shows the charset task's prompt for it
(:func:`~deltarl.env_server.charset.environment.make_prompt`) as the first user turn, after the
rollout's system prompt. Then, at random:

* **hinted** (a share ``hinted`` of them): a second user turn holding the hint
  :func:`~deltarl.env_server.charset.hints.charset_hint` gives for a random reply drawn from the alphabet
  (what an untrained policy says; the exact wording the worker's ``env`` hinter produces), and
  an assistant reply of characters drawn from the target set only: the hinted context the worker
  scores (:func:`~deltarl.rollout.distill.hints.hinted_context`), answered as the hint says. In a share
  ``recover`` of them the reply starts with the first characters of that random reply as an
  untrained ``prefill`` (:func:`~deltarl.trainer.supervised.sft.encode_transcript`) and goes on in the set:
  the worker scores the *original* reply's tokens after the hint, so what the hinted model says
  after a wrong start is the signal the student trains on;
* **unhinted**: an assistant reply drawn uniformly from the whole alphabet, whatever the prompt
  says.

A model trained on these follows a hint and, without one, replies with random characters of the
alphabet: the target set its prompt names is not used unless a hint repeats it, so GRPO alone
has to find the set from the reward, while the worker's hinted scoring already knows it (the
hint-learning evidence, ``tests/e2e/test_hint_learning.py``, docs/distillation.md). Reply lengths
are ``min_chars`` to ``min_chars + extra`` characters. One JSON object per line (JSONL), as
``deltarl sft --set data=...`` reads::

    {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": <prompt>},
                  {"role": "user", "content": <hint>}, {"role": "assistant", "content": "qkqqwk2q"}],
     "target": "kq2w", "hinted": true, "hinted_reply": "aZ3kq9Tw"}

(``hinted_reply``: the random reply the hint was given for; null when unhinted.)

Command line::

    python -m deltarl.env_server.charset.transcripts --count 4000 --out charset-hints.jsonl [--seed 0] \
        [--targets ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz 0123456789]
"""

from __future__ import annotations

import argparse
import json
import random
import string
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltarl.env_server.charset.environment import CharsetRules, make_prompt
from deltarl.env_server.charset.hints import charset_hint
from deltarl.env_server.core.render import write_transcripts

__all__ = ["HintData", "hint_transcript", "hint_transcripts"]

ALPHABET = string.ascii_letters + string.digits


@dataclass(frozen=True, slots=True)
class HintData:
    """What the transcripts draw from (module docstring)."""

    alphabet: str = ALPHABET
    set_min: int = 3
    set_max: int = 8
    min_chars: int = 8
    extra: int = 4
    hinted: float = 0.5
    recover: float = 0.0
    system_prompt: str | None = ""  # the rollout's (examples/charset-tiny.toml: "")
    targets: tuple[str, ...] = ()  # draw the target from these sets; empty: random sets

    def __post_init__(self) -> None:
        if len(set(self.alphabet)) != len(self.alphabet) or not self.alphabet:
            raise ValueError("the alphabet needs distinct characters")
        if not 1 <= self.set_min <= self.set_max < len(self.alphabet):
            raise ValueError(
                f"need 1 <= set_min <= set_max < len(alphabet); got {self.set_min}, "
                f"{self.set_max}, {len(self.alphabet)}"
            )
        if any(not t or not set(t) <= set(self.alphabet) for t in self.targets):
            raise ValueError("every target needs characters of the alphabet only")
        if self.min_chars < 2 or self.extra < 0:
            raise ValueError("need min_chars >= 2 and extra >= 0")
        if not (0.0 <= self.hinted <= 1.0 and 0.0 <= self.recover <= 1.0):
            raise ValueError("need 0 <= hinted <= 1 and 0 <= recover <= 1")


def _draw(rng: random.Random, chars: Sequence[str], data: HintData) -> str:
    n = rng.randint(data.min_chars, data.min_chars + data.extra)
    return "".join(rng.choice(chars) for _ in range(n))


def hint_transcript(rng: random.Random, data: HintData) -> dict[str, Any]:
    """One transcript record (module docstring), drawn from ``rng``."""
    if data.targets:
        target = rng.choice(data.targets)
    else:
        target = "".join(rng.sample(data.alphabet, rng.randint(data.set_min, data.set_max)))
    rules = CharsetRules(target=target, min_chars=data.min_chars)
    messages: list[dict[str, str]] = []
    if data.system_prompt is not None:
        messages.append({"role": "system", "content": data.system_prompt})
    messages.append({"role": "user", "content": make_prompt(rules)})
    hinted = rng.random() < data.hinted
    hint = first = None
    while hinted and hint is None:  # a random reply that happens to score 1.0 gets no hint
        first = _draw(rng, data.alphabet, data)
        hint = charset_hint(first, rules)
    answer: dict[str, str]
    if hint is not None and first is not None:
        messages.append({"role": "user", "content": hint})
        reply = _draw(rng, target, data)
        answer = {"role": "assistant", "content": reply}
        if data.recover and rng.random() < data.recover:  # a wrong start, back to the set
            cut = rng.randint(1, min(len(first), len(reply)) - 1)
            answer = {"role": "assistant", "prefill": first[:cut], "content": reply[cut:]}
    else:
        answer = {"role": "assistant", "content": _draw(rng, data.alphabet, data)}
    messages.append(answer)
    return {"messages": messages, "target": target, "hinted": hinted, "hinted_reply": first}


def hint_transcripts(
    count: int, *, seed: int = 0, data: HintData | None = None
) -> Iterator[dict[str, Any]]:
    """``count`` transcript records, the same for the same ``seed`` and ``data``."""
    rng = random.Random(seed)
    data = data or HintData()
    for _ in range(count):
        yield hint_transcript(rng, data)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--count", type=int, default=4000, help="transcripts to write")
    parser.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hinted", type=float, default=0.5, help="share of hinted transcripts")
    parser.add_argument(
        "--targets",
        nargs="*",
        default=[],
        help="draw each target from these sets (e.g. --targets 0123456789 "
        "abcdefghijklmnopqrstuvwxyz); default: random sets of the alphabet",
    )
    args = parser.parse_args(argv)
    data = HintData(hinted=args.hinted, targets=tuple(args.targets))
    n = write_transcripts(args.out, hint_transcripts(args.count, seed=args.seed, data=data))
    print(json.dumps({"out": str(args.out), "transcripts": n}))


if __name__ == "__main__":
    main()
