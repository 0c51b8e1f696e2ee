"""Wire cost of the teacher's answers: bytes, encode and decode time per batch.

    python bench/teacher_wire_bench.py [--batch 64] [--positions 512] [--k 8,20,100]
                                       [--repeats 3]

One answer holds, for ``batch`` sequences of ``positions`` scored positions each, the sampled
token's logprob and the top-k ids and logprobs (float32 logprobs of a real log_softmax over a
49,152-token vocabulary, so that their decimal forms are as long as real ones). Four encodings
of the same numbers:

* ``binary``: deltarl's format (docs/formats.md, "Teacher logprobs"): raw little-endian arrays
  behind a 24-byte header, numpy on both ends;
* ``json``: the same fields as JSON numbers (the service's JSON fallback, stdlib ``json``);
* ``b64-json``: raw float32/int32 arrays as base64 strings inside a JSON object, as TRL 1.1-1.10
  sent logprobs (dropped in TRL 1.11);
* ``vllm-json``: vLLM's ``prompt_logprobs`` shape as JSON (per position, a map from token id to
  ``{"logprob", "rank", "decoded_token"}`` over the top-k plus the sampled token), which TRL
  1.16 reads; ``decoded_token`` is null here (vLLM fills in text, so real ones are larger).

Encode = from numpy arrays to bytes; decode = from bytes back to numpy arrays of the same shape.
Times are the median of ``repeats`` runs, one thread.

Runs on any machine with the project and numpy installed. The rows go to
``bench/results/teacher_wire_cpu<N>_<batch>x<positions>.json`` (``--json`` for another path),
which a rerun on the same number of cores overwrites.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from common import cpu_tag, meta, result_path, write_json

from deltarl.teacher.wire import (
    F32,
    I32,
    LogprobResponse,
    decode_json_response,
    decode_response,
    encode_json_response,
    encode_response,
)

VOCAB = 49_152


def make_answer(batch: int, positions: int, k: int, seed: int = 0) -> LogprobResponse:
    rng = np.random.default_rng(seed)
    p = batch * positions
    # top-k of a log_softmax: k sorted values below the max, log-normalised like a real one
    logits = rng.standard_normal((p, k)).astype(np.float32) * 2.0
    logits = -np.sort(-logits, axis=1)
    top_lps = (logits - np.log(np.exp(logits).sum(1, keepdims=True) + VOCAB / 50)).astype(F32)
    # distinct ids per row (a stride coprime with the vocabulary size)
    top_ids = ((rng.integers(0, VOCAB, (p, 1)) + np.arange(k) * 7919) % VOCAB).astype(I32)
    pick = rng.integers(0, k, p)
    sampled = top_lps[np.arange(p), pick].copy()
    offsets = (np.arange(batch + 1) * positions).astype(I32)
    return LogprobResponse(offsets, np.full(batch, k, I32), sampled, top_ids, top_lps)


def b64_encode(resp: LogprobResponse) -> bytes:
    def b64(a: np.ndarray) -> str:
        return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")

    body = {
        "shape": list(resp.top_ids.shape),
        "offsets": b64(resp.offsets),
        "sampled_logprobs": b64(resp.sampled),
        "top_ids": b64(resp.top_ids),
        "top_logprobs": b64(resp.top_logprobs),
    }
    return json.dumps(body).encode()


def b64_decode(data: bytes) -> tuple[np.ndarray, ...]:
    body = json.loads(data)
    p, k = body["shape"]
    return (
        np.frombuffer(base64.b64decode(body["offsets"]), I32),
        np.frombuffer(base64.b64decode(body["sampled_logprobs"]), F32),
        np.frombuffer(base64.b64decode(body["top_ids"]), I32).reshape(p, k),
        np.frombuffer(base64.b64decode(body["top_logprobs"]), F32).reshape(p, k),
    )


def vllm_encode(resp: LogprobResponse, sampled_ids: np.ndarray) -> bytes:
    ids, lps = resp.top_ids.tolist(), resp.top_logprobs.tolist()
    sampled, chosen = resp.sampled.tolist(), sampled_ids.tolist()
    seqs = []
    for i in range(resp.n):
        rows: list[Any] = [None]
        for r in range(int(resp.offsets[i]), int(resp.offsets[i + 1])):
            entry = {
                str(t): {"logprob": v, "rank": c + 1, "decoded_token": None}
                for c, (t, v) in enumerate(zip(ids[r], lps[r], strict=True))
            }
            entry.setdefault(
                str(chosen[r]), {"logprob": sampled[r], "rank": 1, "decoded_token": None}
            )
            rows.append(entry)
        seqs.append({"prompt_logprobs": rows})
    return json.dumps(seqs).encode()


def vllm_decode(data: bytes, k: int, sampled_ids: np.ndarray) -> tuple[np.ndarray, ...]:
    seqs = json.loads(data)
    p = sum(len(s["prompt_logprobs"]) - 1 for s in seqs)
    ids = np.empty((p, k), I32)
    lps = np.empty((p, k), F32)
    sampled = np.empty(p, F32)
    r = 0
    for s in seqs:
        for entry in s["prompt_logprobs"][1:]:
            ranked = sorted(entry.items(), key=lambda e: e[1]["rank"])[:k]
            ids[r] = [int(t) for t, _ in ranked]
            lps[r] = [v["logprob"] for _, v in ranked]
            sampled[r] = entry[str(int(sampled_ids[r]))]["logprob"]
            r += 1
    return sampled, ids, lps


def median_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def run(batch: int, positions: int, ks: list[int], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for k in ks:
        resp = make_answer(batch, positions, k)
        sampled_ids = resp.top_ids[np.arange(len(resp.sampled)), 0]
        codecs: dict[str, tuple[Callable[[], bytes], Callable[[bytes], Any]]] = {
            "binary": (lambda r=resp: encode_response(r), decode_response),
            "json": (lambda r=resp: encode_json_response(r, "teacher"), decode_json_response),
            "b64-json": (lambda r=resp: b64_encode(r), b64_decode),
            "vllm-json": (
                lambda r=resp, s=sampled_ids: vllm_encode(r, s),
                lambda d, k=k, s=sampled_ids: vllm_decode(d, k, s),
            ),
        }
        base = None
        for name, (enc, dec) in codecs.items():
            t_enc, data = median_time(enc, repeats)
            t_dec, back = median_time(lambda d=data, f=dec: f(d), repeats)
            got = back.top_logprobs if isinstance(back, LogprobResponse) else back[-1]
            assert np.array_equal(
                np.asarray(got).reshape(resp.top_logprobs.shape), resp.top_logprobs
            )
            base = base or len(data)
            rows.append(
                {
                    "k": k,
                    "format": name,
                    "bytes": len(data),
                    "vs_binary": len(data) / base,
                    "encode_ms": 1000 * t_enc,
                    "decode_ms": 1000 * t_dec,
                }
            )
            print(
                f"K={k:<4} {name:<10} {len(data) / 1e6:9.2f} MB {len(data) / base:6.2f}x "
                f"encode {1000 * t_enc:9.1f} ms  decode {1000 * t_dec:9.1f} ms",
                flush=True,
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--positions", type=int, default=512)
    ap.add_argument("--k", default="8,20,100")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None, help="default: see the docstring")
    args = ap.parse_args()
    ks = [int(x) for x in args.k.split(",")]
    print(f"B={args.batch} sequences x T={args.positions} scored positions, K in {ks}")
    rows = run(args.batch, args.positions, ks, args.repeats)
    print()
    print("| K | format | bytes | vs binary | encode ms | decode ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['k']} | {r['format']} | {r['bytes']:,} | {r['vs_binary']:.2f}x | "
            f"{r['encode_ms']:.1f} | {r['decode_ms']:.1f} |"
        )
    about = meta(
        batch=args.batch, positions=args.positions, repeats=args.repeats, numpy=np.__version__
    )
    name = f"{args.batch}x{args.positions}"
    write_json(
        args.json or result_path("teacher_wire", cpu_tag(), name), {"meta": about, "rows": rows}
    )


if __name__ == "__main__":
    main()
