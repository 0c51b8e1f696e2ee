"""Bounds of the teacher's wire format shared by the settings and the codec (standard library
only: ``deltarl --help`` and the light service images import the settings without numpy)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_TOP_K = 128
"""Hard upper bound of top-k, whatever the settings say (a row of the answer is 8 K bytes)."""
MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 100.0
DEFAULT_TOP_K = -1
"""A sequence's ``top_k`` on the wire meaning "the server's default" (``DELTARL_TEACHER_TOP_K``)."""


@dataclass(frozen=True)
class Limits:
    """Bounds a decoder enforces (the server's settings; clients decode answers unbounded)."""

    max_sequences: int = 4096
    max_tokens: int = 1 << 20
    max_seq_len: int = 1 << 16
    max_top_k: int = MAX_TOP_K
    vocab_size: int | None = None
