"""Bounds of the teacher's wire format shared by the settings and the codec (standard library
only: ``deltarl --help`` and the light service images import the settings without numpy)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_TOP_K = 128
"""Hard upper bound of top-k, whatever the settings say (a row of the answer is 8 K bytes)."""
MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 100.0
MAX_JSON_ANSWER_BYTES = 16 << 20
"""Largest JSON answer the service builds (16 MiB). A JSON answer is ~4x the binary one and its
Python lists take several times more memory while it is built, so a request whose JSON answer
would be larger (estimated before scoring: :func:`json_answer_bytes`) is refused with 406 and
told to ask for the binary format, or for fewer tokens or a smaller top-k."""
JSON_BYTES_PER_ENTRY = 32
"""Estimated JSON bytes of one entry of an answer (a token id and its logprob, or the sampled
token's logprob): ``"49151,"`` plus a float32 written as a Python float,
``"-12.345678329467773,"``, about 26 bytes; some logprobs take 24 characters alone."""
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


def json_answer_bytes(scored_and_k: list[tuple[int, int]]) -> int:
    """Estimated size of a JSON answer from each sequence's (scored positions, top-k): every
    position carries the sampled token's logprob and ``k`` (id, logprob) entries."""
    return sum(scored * (k + 1) for scored, k in scored_and_k) * JSON_BYTES_PER_ENTRY
