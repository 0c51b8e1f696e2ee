"""The teacher service's wire format: requests and answers of ``POST /v1/logprobs``.

Two encodings of the same records (byte layout: docs/formats.md, "Teacher logprobs"):

* **binary** (the default, media type :data:`BINARY_MEDIA_TYPE`): a 24-byte typed header, then
  raw little-endian arrays (int32 token ids and offsets, float32 logprobs), read with
  ``numpy.frombuffer`` after the header's counts have been checked against the body's length.
  Nothing is unpickled and nothing is allocated before the sizes are known to add up.
* **JSON** (``application/json``): the same fields as lists of numbers, for curl and for clients
  without numpy.

Every decoder validates strictly and raises :class:`WireError` naming the field (HTTP 422, or 413
when a count exceeds its limit); a well-formed message always decodes to consistent arrays.
Only numpy and pydantic are imported here (no torch), so the client and the benchmark load it
cheaply.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deltarl.teacher.limits import DEFAULT_TOP_K as DEFAULT_TOP_K  # re-exported
from deltarl.teacher.limits import MAX_TEMPERATURE as MAX_TEMPERATURE
from deltarl.teacher.limits import MAX_TOP_K as MAX_TOP_K
from deltarl.teacher.limits import MIN_TEMPERATURE as MIN_TEMPERATURE
from deltarl.teacher.limits import Limits as Limits

BINARY_MEDIA_TYPE = "application/vnd.deltarl.teacher+binary"
JSON_MEDIA_TYPE = "application/json"
REQUEST_MAGIC = b"DRTQ"
RESPONSE_MAGIC = b"DRTR"
VERSION = 1
HEADER = struct.Struct("<4sHH4BIII")  # magic, version, flags, 4 dtype codes, N, count, K
HEADER_BYTES = HEADER.size  # 24
# dtype codes of the header's four bytes: token ids, indices (offsets, prompt_len, top_k),
# floats (temperatures, logprobs), reserved
DTYPE_INT32 = 1
DTYPE_FLOAT32 = 2
DTYPE_CODES = (DTYPE_INT32, DTYPE_INT32, DTYPE_FLOAT32, 0)
I32 = np.dtype("<i4")
F32 = np.dtype("<f4")


class WireError(ValueError):
    """A malformed or out-of-bounds message. ``field`` names what is wrong; ``status`` is the
    HTTP status to answer with (422, or 413 for a count over its limit)."""

    def __init__(self, field: str, message: str, status: int = 422) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.status = status


@dataclass(frozen=True)
class LogprobRequest:
    """A batch of sequences to score. Sequence ``i`` is ``tokens[offsets[i]:offsets[i+1]]``;
    its positions ``p >= prompt_lens[i]`` are scored (the distribution after ``tokens[:p]``).
    ``top_ks[i] == -1``: the server's default."""

    tokens: np.ndarray  # int32 [T]
    offsets: np.ndarray  # int32 [N + 1]
    prompt_lens: np.ndarray  # int32 [N]
    temperatures: np.ndarray  # float32 [N]
    top_ks: np.ndarray  # int32 [N]

    @property
    def n(self) -> int:
        return len(self.prompt_lens)

    def sequence(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    @property
    def scored(self) -> int:
        """Positions scored in all (sum of ``len - prompt_len``)."""
        return int(np.diff(self.offsets).sum() - self.prompt_lens.sum())

    @classmethod
    def build(
        cls,
        sequences: list[list[int]] | list[np.ndarray],
        prompt_lens: list[int],
        temperatures: list[float] | float = 1.0,
        top_ks: list[int] | int = DEFAULT_TOP_K,
    ) -> LogprobRequest:
        """From Python lists (not validated: :func:`validate_request` does that)."""
        n = len(sequences)
        lens = [len(s) for s in sequences]
        offsets = np.zeros(n + 1, dtype=I32)
        np.cumsum(lens, out=offsets[1:])
        tokens = (
            np.concatenate([np.asarray(s, dtype=I32) for s in sequences]) if n else np.zeros(0, I32)
        )
        temps = [temperatures] * n if isinstance(temperatures, float | int) else temperatures
        ks = [top_ks] * n if isinstance(top_ks, int) else top_ks
        return cls(
            tokens=tokens,
            offsets=offsets,
            prompt_lens=np.asarray(prompt_lens, dtype=I32),
            temperatures=np.asarray(temps, dtype=F32),
            top_ks=np.asarray(ks, dtype=I32),
        )


@dataclass(frozen=True)
class LogprobResponse:
    """Scores of a :class:`LogprobRequest`. Sequence ``i`` owns the scored positions
    ``offsets[i]:offsets[i+1]`` (``len - prompt_len`` of them, in order); row ``r`` holds the
    sampled token's logprob ``sampled[r]`` and the top ``top_ks[i]`` entries of ``top_ids[r]`` /
    ``top_logprobs[r]`` (descending); entries past ``top_ks[i]`` are id -1, logprob -inf."""

    offsets: np.ndarray  # int32 [N + 1]
    top_ks: np.ndarray  # int32 [N]
    sampled: np.ndarray  # float32 [P]
    top_ids: np.ndarray  # int32 [P, K]
    top_logprobs: np.ndarray  # float32 [P, K]

    @property
    def n(self) -> int:
        return len(self.top_ks)

    @property
    def k(self) -> int:
        return int(self.top_ids.shape[1])

    def sequence(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sampled [n], top ids [n, k], top logprobs [n, k]) of sequence ``i``, trimmed to its k."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        k = int(self.top_ks[i])
        return self.sampled[a:b], self.top_ids[a:b, :k], self.top_logprobs[a:b, :k]


# --- binary ------------------------------------------------------------------------------------


def _header(data: bytes | memoryview, magic: bytes) -> tuple[int, int, int]:
    if len(data) < HEADER_BYTES:
        raise WireError(
            "header", f"the body has {len(data)} bytes, fewer than the {HEADER_BYTES}-byte header"
        )
    got, version, flags, c0, c1, c2, c3, n, count, k = HEADER.unpack_from(data, 0)
    if got != magic:
        raise WireError("magic", f"expected {magic!r}, got {bytes(got)!r}")
    if version != VERSION:
        raise WireError("version", f"version {version} is not supported (this server reads 1)")
    if flags != 0:
        raise WireError("flags", f"must be 0 in version 1, got {flags}")
    if (c0, c1, c2, c3) != DTYPE_CODES:
        raise WireError(
            "dtypes",
            f"codes {(c0, c1, c2, c3)} are not version 1's {DTYPE_CODES} "
            "(int32 ids, int32 indices, float32 values, 0)",
        )
    return n, count, k


def encode_request(req: LogprobRequest) -> bytes:
    """Binary request: header (N, T, 0), then offsets, prompt_lens, top_ks, temperatures,
    tokens."""
    head = HEADER.pack(REQUEST_MAGIC, VERSION, 0, *DTYPE_CODES, req.n, len(req.tokens), 0)
    return b"".join(
        [
            head,
            np.ascontiguousarray(req.offsets, I32).tobytes(),
            np.ascontiguousarray(req.prompt_lens, I32).tobytes(),
            np.ascontiguousarray(req.top_ks, I32).tobytes(),
            np.ascontiguousarray(req.temperatures, F32).tobytes(),
            np.ascontiguousarray(req.tokens, I32).tobytes(),
        ]
    )


def request_size(n: int, t: int) -> int:
    return HEADER_BYTES + 4 * (n + 1) + 12 * n + 4 * t


def decode_request(data: bytes | memoryview, limits: Limits | None = None) -> LogprobRequest:
    """Parse and validate a binary request (:class:`WireError` on anything malformed)."""
    limits = limits or Limits()
    n, t, reserved = _header(data, REQUEST_MAGIC)
    if reserved != 0:
        raise WireError("reserved", f"header bytes 20-23 must be 0 in a request, got {reserved}")
    _bound("sequences", n, limits.max_sequences)
    _bound("tokens", t, limits.max_tokens)
    want = request_size(n, t)
    if len(data) != want:
        raise WireError(
            "length",
            f"the header declares {n} sequences and {t} tokens, i.e. {want} bytes; the body has "
            f"{len(data)}",
        )
    pos = HEADER_BYTES

    def take(dtype: np.dtype, count: int) -> np.ndarray:
        nonlocal pos
        arr = np.frombuffer(data, dtype=dtype, count=count, offset=pos)
        pos += 4 * count
        return arr

    req = LogprobRequest(
        offsets=take(I32, n + 1),
        prompt_lens=take(I32, n),
        top_ks=take(I32, n),
        temperatures=take(F32, n),
        tokens=take(I32, t),
    )
    validate_request(req, limits)
    return req


def encode_response(resp: LogprobResponse) -> bytes:
    """Binary answer: header (N, P, K), then offsets, top_ks, sampled, top ids, top logprobs."""
    p, k = resp.top_ids.shape
    head = HEADER.pack(RESPONSE_MAGIC, VERSION, 0, *DTYPE_CODES, resp.n, p, k)
    return b"".join(
        [
            head,
            np.ascontiguousarray(resp.offsets, I32).tobytes(),
            np.ascontiguousarray(resp.top_ks, I32).tobytes(),
            np.ascontiguousarray(resp.sampled, F32).tobytes(),
            np.ascontiguousarray(resp.top_ids, I32).tobytes(),
            np.ascontiguousarray(resp.top_logprobs, F32).tobytes(),
        ]
    )


def response_size(n: int, p: int, k: int) -> int:
    return HEADER_BYTES + 4 * (n + 1) + 4 * n + 4 * p + 8 * p * k


def decode_response(data: bytes | memoryview, max_bytes: int | None = None) -> LogprobResponse:
    """Parse and validate a binary answer (:class:`WireError` on anything malformed)."""
    n, p, k = _header(data, RESPONSE_MAGIC)
    _bound("top_k", k, MAX_TOP_K)
    want = response_size(n, p, k)
    if len(data) != want or (max_bytes is not None and want > max_bytes):
        raise WireError(
            "length",
            f"the header declares {n} sequences, {p} positions and k={k}, i.e. {want} bytes; "
            f"the body has {len(data)}",
        )
    pos = HEADER_BYTES

    def take(dtype: np.dtype, count: int) -> np.ndarray:
        nonlocal pos
        arr = np.frombuffer(data, dtype=dtype, count=count, offset=pos)
        pos += 4 * count
        return arr

    resp = LogprobResponse(
        offsets=take(I32, n + 1),
        top_ks=take(I32, n),
        sampled=take(F32, p),
        top_ids=take(I32, p * k).reshape(p, k),
        top_logprobs=take(F32, p * k).reshape(p, k),
    )
    _check_offsets("offsets", resp.offsets, p)
    if n and (resp.top_ks.min() < 0 or resp.top_ks.max() > k):
        raise WireError("top_k", f"every sequence's k must be within 0..{k}")
    return resp


# --- validation ----------------------------------------------------------------------------------


def _bound(field: str, value: int, limit: int) -> None:
    if value > limit:
        raise WireError(field, f"{value} exceeds the limit of {limit}", status=413)


def _check_offsets(field: str, offsets: np.ndarray, total: int) -> None:
    if offsets[0] != 0 or offsets[-1] != total:
        raise WireError(field, f"must start at 0 and end at {total}")
    if len(offsets) > 1 and (np.diff(offsets) < 0).any():
        raise WireError(field, "must not decrease")


def validate_request(req: LogprobRequest, limits: Limits) -> None:
    """Bounds and consistency of a decoded request (both encodings end here)."""
    n = req.n
    _bound("sequences", n, limits.max_sequences)
    _bound("tokens", len(req.tokens), limits.max_tokens)
    if n == 0:
        raise WireError("sequences", "at least one sequence is needed")
    _check_offsets("offsets", req.offsets, len(req.tokens))
    lens = np.diff(req.offsets)
    longest = int(lens.max())
    if longest > limits.max_seq_len:
        i = int(lens.argmax())
        raise WireError(
            f"sequences[{i}].tokens",
            f"{longest} tokens exceed the longest sequence allowed ({limits.max_seq_len})",
            status=413,
        )
    bad = np.flatnonzero((req.prompt_lens < 1) | (req.prompt_lens > lens))
    if len(bad):
        i = int(bad[0])
        raise WireError(
            f"sequences[{i}].prompt_len",
            f"{int(req.prompt_lens[i])} is not within 1..{int(lens[i])} (the sequence's length; "
            "position 0 has no context to score it)",
        )
    bad = np.flatnonzero((req.top_ks < DEFAULT_TOP_K) | (req.top_ks > limits.max_top_k))
    if len(bad):
        i = int(bad[0])
        raise WireError(
            f"sequences[{i}].top_k",
            f"{int(req.top_ks[i])} is not within 0..{limits.max_top_k} (-1: the server's default)",
        )
    temps = req.temperatures
    bad = np.flatnonzero(
        ~np.isfinite(temps) | (temps < MIN_TEMPERATURE) | (temps > MAX_TEMPERATURE)
    )
    if len(bad):
        i = int(bad[0])
        raise WireError(
            f"sequences[{i}].temperature",
            f"{float(temps[i])} is not within {MIN_TEMPERATURE}..{MAX_TEMPERATURE}",
        )
    if len(req.tokens) and limits.vocab_size is not None:
        bad = np.flatnonzero((req.tokens < 0) | (req.tokens >= limits.vocab_size))
        if len(bad):
            j = int(bad[0])
            i = int(np.searchsorted(req.offsets, j, side="right")) - 1
            raise WireError(
                f"sequences[{i}].tokens[{j - int(req.offsets[i])}]",
                f"token id {int(req.tokens[j])} is outside the vocabulary 0..{limits.vocab_size - 1}",
            )


# --- JSON ------------------------------------------------------------------------------------------


class JsonSequence(BaseModel):
    """One sequence of a JSON request. Strict types: a token id, ``prompt_len`` or ``top_k`` is
    a JSON integer (not ``true``, ``1.0`` or ``"1"``) and a temperature a JSON number."""

    model_config = ConfigDict(extra="forbid", strict=True)

    tokens: list[int] = Field(description="Token ids: the prompt, then the sampled completion.")
    prompt_len: int = Field(
        description="Positions from here on are scored (1 <= prompt_len <= len(tokens))."
    )
    temperature: float = Field(
        default=1.0, description="Scores are log_softmax(logits / temperature)."
    )
    top_k: int | None = Field(
        default=None, description="Top entries per position; unset: the server's default."
    )


class JsonRequest(BaseModel):
    """``POST /v1/logprobs`` body as JSON (``Content-Type: application/json``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    sequences: list[JsonSequence] = Field(description="The sequences to score.")


def _json_field(loc: tuple[int | str, ...]) -> str:
    """A validation error's location as the other errors name fields: ``sequences[0].tokens[3]``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def decode_json_request(data: bytes, limits: Limits | None = None) -> LogprobRequest:
    """Parse and validate a JSON request (:class:`WireError` naming the field)."""
    limits = limits or Limits()
    try:
        body = JsonRequest.model_validate_json(data)
    except ValidationError as exc:
        errors = exc.errors(include_input=False)
        if any(e["type"] == "json_invalid" for e in errors):
            raise WireError("body", "not valid JSON (UTF-8)") from None
        e = errors[0]
        raise WireError(_json_field(e.get("loc", ())), str(e.get("msg", "invalid"))) from None
    seqs = body.sequences
    _bound("sequences", len(seqs), limits.max_sequences)
    _bound("tokens", sum(len(s.tokens) for s in seqs), limits.max_tokens)
    for i, s in enumerate(seqs):
        if s.tokens and (min(s.tokens) < -(2**31) or max(s.tokens) >= 2**31):
            raise WireError(f"sequences[{i}].tokens", "token ids must fit in int32")
        if not -(2**31) <= s.prompt_len < 2**31:
            raise WireError(f"sequences[{i}].prompt_len", "must fit in int32")
        if s.top_k is not None and not -(2**31) <= s.top_k < 2**31:
            raise WireError(f"sequences[{i}].top_k", "must fit in int32")
        if not math.isfinite(s.temperature):
            raise WireError(f"sequences[{i}].temperature", "must be a finite number")
    req = LogprobRequest.build(
        [s.tokens for s in seqs],
        [s.prompt_len for s in seqs],
        [s.temperature for s in seqs],
        [DEFAULT_TOP_K if s.top_k is None else s.top_k for s in seqs],
    )
    validate_request(req, limits)
    return req


def encode_json_request(req: LogprobRequest) -> bytes:
    seqs = []
    for i in range(req.n):
        entry: dict[str, Any] = {
            "tokens": req.sequence(i).tolist(),
            "prompt_len": int(req.prompt_lens[i]),
            "temperature": float(req.temperatures[i]),
        }
        if req.top_ks[i] != DEFAULT_TOP_K:
            entry["top_k"] = int(req.top_ks[i])
        seqs.append(entry)
    return json.dumps({"sequences": seqs}, separators=(",", ":")).encode()


def encode_json_response(resp: LogprobResponse, model: str) -> bytes:
    """``{"model", "sequences": [{"sampled_logprobs": [..], "top_ids": [[..]],
    "top_logprobs": [[..]]}]}``, each sequence's rows trimmed to its k."""
    seqs = []
    for i in range(resp.n):
        sampled, ids, lps = resp.sequence(i)
        seqs.append(
            {
                "sampled_logprobs": sampled.tolist(),
                "top_ids": ids.tolist(),
                "top_logprobs": lps.tolist(),
            }
        )
    return json.dumps({"model": model, "sequences": seqs}, separators=(",", ":")).encode()


def decode_json_response(data: bytes) -> LogprobResponse:
    """The inverse of :func:`encode_json_response` (rows padded back to the widest k)."""
    try:
        body = json.loads(data)
        seqs = body["sequences"]
        n = len(seqs)
        ks = [len(s["top_ids"][0]) if s["top_ids"] else 0 for s in seqs]
        k = max(ks, default=0)
        sampled = np.asarray([x for s in seqs for x in s["sampled_logprobs"]], dtype=F32)
        p = len(sampled)
        ids = np.full((p, k), -1, dtype=I32)
        lps = np.full((p, k), -np.inf, dtype=F32)
        offsets = np.zeros(n + 1, dtype=I32)
        row = 0
        for i, s in enumerate(seqs):
            rows = len(s["sampled_logprobs"])
            if rows and ks[i]:
                ids[row : row + rows, : ks[i]] = np.asarray(s["top_ids"], dtype=I32)
                lps[row : row + rows, : ks[i]] = np.asarray(s["top_logprobs"], dtype=F32)
            row += rows
            offsets[i + 1] = row
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise WireError("body", f"not a teacher answer: {exc}") from None
    return LogprobResponse(offsets, np.asarray(ks, dtype=I32), sampled, ids, lps)
