"""The charset task: one reply per episode, scored by the share of its characters in a target set.

A small, learnable companion to Wordle, for end-to-end tests of the RL loop: a random policy
scores a little (the target characters' share of what it samples), and every character it moves
into the set raises the reward, so the signal is dense. The reward is computed here, in the
environment, from the reply text alone::

    reward = (characters of the reply in the target set) / max(len(reply), min_chars)

so a reply of ``min_chars`` or more characters, all in the set, scores 1.0; a shorter one is
scored as if padded with characters outside the set (ending early is no shortcut); an empty
reply scores 0. Every character counts (spaces, newlines, U+FFFD from invalid bytes).

Example::

    env = CharsetEnvironment(CharsetRules(target="abc", min_chars=4))
    env.reset(seed=1)
    env.step("abca!").reward  # 4 of 5 characters in the set: 0.8
"""

from __future__ import annotations

import string
import uuid
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel

from deltarl.env_server.charset.models import CharsetObservation, CharsetSignals, CharsetState
from deltarl.env_server.core.models import (
    EnvError,
    ErrorCode,
    StepResult,
    TextMessage,
)
from deltarl.env_server.core.wire import TaskHint

GAME_ID = -1
PLAYER_ID = 0
SHOWN_REPLY_CHARS = 200  # the transcript shows at most this much of a reply


@dataclass(frozen=True, slots=True)
class CharsetRules:
    """The target set and the length a reply needs for full marks."""

    target: str = string.ascii_lowercase
    min_chars: int = 8

    def __post_init__(self) -> None:
        if not self.target:
            raise ValueError("the charset target needs at least one character")
        if self.min_chars < 1:
            raise ValueError(f"min_chars must be >= 1, got {self.min_chars}")


def score_reply(reply: str, rules: CharsetRules) -> tuple[float, CharsetSignals]:
    """(reward, signals) of ``reply`` under ``rules`` (see the module docstring)."""
    target = set(rules.target)
    hits = sum(1 for ch in reply if ch in target)
    reward = hits / max(len(reply), rules.min_chars)
    signals = CharsetSignals(
        in_set=hits / len(reply) if reply else 0.0,
        length=min(len(reply) / rules.min_chars, 1.0),
    )
    return reward, signals


def make_prompt(rules: CharsetRules) -> str:
    """The instructions shown at reset."""
    return (
        f"Reply with at least {rules.min_chars} characters, using only these: {rules.target}\n"
        "Your score is the share of your reply's characters that are among them (a reply "
        f"shorter than {rules.min_chars} characters counts as {rules.min_chars} long)."
    )


class CharsetEnvironment:
    """Reset/step/state for one session. Not thread-safe; the server serialises calls."""

    def __init__(self, rules: CharsetRules) -> None:
        self.rules = rules
        self.prompt = make_prompt(rules)
        self.started = False
        self.episode_id: str | None = None
        self.seed: int | None = None
        self.messages: list[tuple[int, str, str]] = []
        self.reply: str | None = None
        self.reward: float | None = None
        self.signals: CharsetSignals | None = None

    @property
    def done(self) -> bool:
        return self.reply is not None

    @property
    def outcome(self) -> Literal["won", "lost"] | None:
        """``won`` (full marks) or ``lost`` once done (the server's games metric); else None."""
        if self.reward is None:
            return None
        return "won" if self.reward >= 1.0 else "lost"

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        options: BaseModel | None = None,
        policy_version: int | None = None,
    ) -> StepResult:
        """Start an episode. The seed and the policy version are only recorded or ignored:
        every episode has the same task. The
        charset task takes no options (the server refuses them before a reset; so does this)."""
        if options is not None:
            raise EnvError(
                ErrorCode.VALIDATION_ERROR,
                "options: the charset task takes no reset options (max_guesses and reward "
                "shaping are Wordle's)",
            )
        self.started = True
        self.seed = seed
        self.episode_id = episode_id if episode_id is not None else uuid.uuid4().hex
        self.messages = [(GAME_ID, self.prompt, "PROMPT")]
        self.reply = self.reward = self.signals = None
        return self._result()

    def step(self, message: str) -> StepResult:
        """Score ``message``; the episode is done after this one reply."""
        if not self.started:
            raise EnvError(ErrorCode.NOT_STARTED, "call reset before step")
        if self.done:
            raise EnvError(ErrorCode.GAME_OVER, "the episode is over; call reset to play again")
        self.reward, self.signals = score_reply(message, self.rules)
        self.reply = message
        hits = round(self.signals.in_set * len(message))
        self.messages.append((PLAYER_ID, message[:SHOWN_REPLY_CHARS], "PLAYER_ACTION"))
        self.messages.append(
            (
                GAME_ID,
                f"{hits} of your {len(message)} characters are in the set: score "
                f"{self.reward:.3f}.",
                "GAME_MESSAGE",
            )
        )
        return self._result()

    def _result(self) -> StepResult:
        obs = CharsetObservation(
            task="charset",
            prompt=self.prompt,
            messages=[TextMessage(sender_id=i, content=c, category=k) for i, c, k in self.messages],
            target=self.rules.target,
            min_chars=self.rules.min_chars,
            reply=self.reply,
            reward_signals=self.signals,
            hint=self._hint(),
        )
        return StepResult(observation=obs, reward=self.reward or 0.0, done=self.done)

    def _hint(self) -> TaskHint | None:
        from deltarl.env_server.charset.hints import charset_hint  # it imports this module

        text = None if self.reply is None else charset_hint(self.reply, self.rules)
        return None if text is None else TaskHint(turn=0, text=text)

    def state(self) -> CharsetState:
        return CharsetState(
            episode_id=self.episode_id,
            step_count=1 if self.done else 0,
            seed=self.seed,
            done=self.done,
            reward=self.reward,
        )
