"""Chat template -> token ids: :class:`ChatFormat` builds an episode's flat token sequence.

The first prompt is the chat template rendered with the generation prompt and tokenized; after
each reply, :meth:`ChatFormat.continuation_ids` renders and tokenizes only the text that closes
the assistant turn and opens the next user turn, so the model's own tokens are never
re-tokenized (see :mod:`deltarl.rollout.episodes.runner` for the bookkeeping this serves).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

logger = logging.getLogger(__name__)

__all__ = ["ChatFormat", "ChatTokenizer"]

_SENTINEL = "@@DELTARL-REPLY-7f3a@@"  # stands for an assistant reply when probing the template


class ChatTokenizer(Protocol):
    """The parts of a Hugging Face tokenizer that episodes use."""

    @property
    def eos_token_id(self) -> Any: ...  # int | None (typed loosely by transformers)

    @property
    def all_special_ids(self) -> Any: ...  # list[int]

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: Any, **kwargs: Any) -> Any: ...

    def decode(self, token_ids: Any, **kwargs: Any) -> Any: ...


class ChatFormat:
    """Turns a conversation into the flat token sequence, one turn at a time.

    Built once per tokenizer; it probes the chat template with a sentinel reply to learn the
    text that closes an assistant turn (e.g. ``"<|im_end|>\\n"``) and its end-of-turn token.
    Raises ``ValueError`` if the tokenizer has no chat template, and (from
    :meth:`continuation_ids`) if the template is not prefix-stable: a conversation's rendering
    must start with the rendering of its beginning.
    """

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; use an instruct model's")
        self.tokenizer = tokenizer
        closing = self._closing([{"role": "user", "content": "x"}])
        ids = self.encode(closing)
        special = set(tokenizer.all_special_ids or [])
        eot = ids[0] if ids else None
        if eot is not None and not (eot in special or self._text([eot], skip=True) == ""):
            eot = None  # the turn ends with plain text (e.g. "\n\n"): no end-of-turn token
        self.end_of_turn_id: int | None = eot
        self.eos_token_id: int | None = tokenizer.eos_token_id
        probe: list[dict[str, str]] = [{"role": "user", "content": "x"}]
        prompt = self.render(probe, generation_prompt=True)
        answered = self.render(
            [*probe, {"role": "assistant", "content": _SENTINEL}], generation_prompt=False
        )
        if not answered.startswith(prompt + _SENTINEL):
            logger.warning(
                "the chat template writes an assistant turn differently from its generation "
                "prompt + reply; episodes keep the tokens the model saw, which a re-rendering "
                "of the conversation will not reproduce"
            )

    def render(self, messages: Sequence[dict[str, str]], *, generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt
        )
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}")
        return text

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without BOS/EOS (the template writes its own special tokens)."""
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def _text(self, ids: Sequence[int], *, skip: bool) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip))

    def reply_text(self, token_ids: Sequence[int]) -> str:
        """The action text of a reply: its tokens decoded without special tokens (so an
        end-of-turn or EOS stop token disappears; a plain stop token such as ``]`` stays)."""
        return self._text(token_ids, skip=True)

    def _closing(self, messages: list[dict[str, str]]) -> str:
        with_reply = [*messages, {"role": "assistant", "content": _SENTINEL}]
        text = self.render(with_reply, generation_prompt=False)
        at = text.rfind(_SENTINEL)
        if at < 0:
            raise ValueError("the chat template drops the assistant's reply; cannot track tokens")
        return text[at + len(_SENTINEL) :]

    def prompt_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The first prompt: ``messages`` (system?, user) rendered with the generation prompt."""
        return self.encode(self.render(messages, generation_prompt=True))

    def continuation_ids(
        self, messages: Sequence[dict[str, str]], feedback: str, stop_token: int | None
    ) -> list[int]:
        """Tokens that follow a reply: the rest of the assistant turn, then the user turn with
        ``feedback`` and the next generation prompt.

        ``messages`` is the conversation so far, ending with the assistant reply just sampled
        (its text only matters for templates that look back). ``stop_token``: the token that
        ended the reply (None: it was cut by length); if its text begins the template's closing
        text it is not written again.
        """
        history = [*messages[:-1], {"role": "assistant", "content": _SENTINEL}]
        head = self.render(history, generation_prompt=False)
        full = self.render(
            [*history, {"role": "user", "content": feedback}], generation_prompt=True
        )
        if not full.startswith(head):
            raise ValueError(
                "the chat template is not prefix-stable (adding a user turn changes the text "
                "before it); multi-turn token bookkeeping needs a template that only appends"
            )
        closing = head[head.rfind(_SENTINEL) + len(_SENTINEL) :]
        if stop_token is not None:
            written = self._text([stop_token], skip=False)
            if written and closing.startswith(written):
                closing = closing[len(written) :]
        return self.encode(closing + full[len(head) :])

    def stop_token_ids(self) -> tuple[int, ...]:
        """End-of-turn and EOS ids (those that exist)."""
        ids = [i for i in (self.end_of_turn_id, self.eos_token_id) if i is not None]
        return tuple(dict.fromkeys(int(i) for i in ids))
