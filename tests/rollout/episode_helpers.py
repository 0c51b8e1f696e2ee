"""Helpers of the episode tests: a live Wordle server, a scripted engine (the SmolLM2 tokenizer:
smollm2_helpers.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from support import LiveServer

from deltarl.env_server.core.app import create_app
from deltarl.env_server.settings import EnvSettings
from deltarl.rollout.engines.base import Completion, FinishReason, SamplingParams, WeightsStamp


class WordleServer(LiveServer):
    """The real Wordle env server (uvicorn in a thread) on a free loopback port."""

    def __init__(self, **overrides: Any) -> None:
        super().__init__(create_app(EnvSettings.model_validate(overrides)))

    @property
    def open_sessions(self) -> int:
        return len(self.app.state.store)


Reply = Callable[[int, int], str]  # (episode key, turn index) -> reply text


def turn_index(prompt: Sequence[int], assistant_start: Sequence[int]) -> int:
    """How many assistant turns ``prompt`` opens (the last one is being generated)."""
    n, k = len(prompt), len(assistant_start)
    return sum(1 for i in range(n - k + 1) if list(prompt[i : i + k]) == list(assistant_start)) - 1


class ScriptedEngine:
    """A deterministic generator: replies given by a script, tokenized, closed by ``stop``.

    Each prompt is traced back to the episode it continues (the earlier prompt + reply it
    extends); new episodes get keys 0, 1, ... in the order their first turn arrives.

    Logprobs are exact in float32 (``-0.25 * (position + 1)``). Versions: every completion is
    stamped with :attr:`version`; with :attr:`bump_during_call`, the version moves by one
    between the first and the last token of the next call (a sync mid-generation). With
    ``managed=False`` the stamps carry no version (an engine without a weight gate).
    """

    def __init__(
        self,
        tokenizer: Any,
        reply: Reply,
        *,
        stop: int,
        version: int = 0,
        managed: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.reply = reply
        self.stop = stop
        self.version = version
        self.managed = managed
        self.bump_during_call = False
        self.calls: list[tuple[int, SamplingParams]] = []
        self.prompts: list[list[int]] = []
        self._seq = 0
        self._open: list[tuple[list[int], int]] = []  # (prompt + reply so far, episode key)
        self._keys = 0
        self._assistant = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)

    def _episode(self, prompt: list[int]) -> int:
        for i, (prefix, key) in enumerate(self._open):
            if prompt[: len(prefix)] == prefix:
                del self._open[i]  # consumed: twin episodes with equal histories stay apart
                return key
        self._keys += 1
        return self._keys - 1

    def _stamp(self) -> WeightsStamp:
        self._seq += 1
        return WeightsStamp(self.version if self.managed else None, self._seq)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        routing_from: Sequence[int] | None = None,
    ) -> list[Completion]:
        self.calls.append((len(prompts), params))
        first = self._stamp()
        if self.bump_during_call:
            self.version += 1
            self.bump_during_call = False
        last = self._stamp()
        out = []
        for i, raw in enumerate(prompts):
            prompt = list(raw)
            self.prompts.append(prompt)
            key = self._episode(prompt)
            text = self.reply(key, turn_index(prompt, self._assistant))
            ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.stop]
            ids = ids[: params.max_new_tokens]
            self._open.append(([*prompt, *ids], key))
            reason: FinishReason = "stop" if ids[-1] in params.stop_token_ids else "length"
            logprobs = [-0.25 * (j + 1) for j in range(len(ids))]
            routed = None
            if routing_from is not None:
                positions = range(routing_from[i], len(prompt) + len(ids) - 1)
                routed = np.array([scripted_route(p) for p in positions], np.uint16)
                routed = routed.reshape(len(positions), *ROUTE_SHAPE)
            out.append(Completion(ids, logprobs, reason, first, last, routed))
        return out


ROUTE_SHAPE = (2, 2)  # the scripted engine's MoE layers and top_k


def scripted_route(position: int) -> list[list[int]]:
    """The experts :class:`ScriptedEngine` reports for ``position``: distinct per row."""
    return [[position % 5, 5 + position % 3], [position % 7, 7 + position % 2]]
