"""The sections of docs/benchmarks.md on the services: the teacher, the env server, the
coordinator, object hashing, and the GPU test runs."""

from __future__ import annotations

from typing import Any

from report_format import (
    Lines,
    Result,
    hardware_words,
    label,
    num,
    pct,
    spread,
    table,
)


def teacher_engine(results: list[Result]) -> Lines:
    rows = []
    for r in results:
        d = r.data
        rows.append(
            [
                label(r),
                d["dtype"],
                f"{d['batch']} x {d['scored_positions'] // max(d['batch'], 1)}",
                f"{d['scored_positions_per_s']:,.0f}",
                num(d["batch_seconds_median"], 3),
                f"{d['max_abs_diff_batched_vs_alone']:.2g} ({d['max_abs_diff_if_shifted_by_one']:.2g})",
            ]
        )
    header = [
        "model, hardware",
        "dtype",
        "sequences x scored positions",
        "scored positions/s",
        "batch s",
        "batched vs alone, max difference (if shifted by one)",
    ]
    return table(header, rows)


def teacher_vllm(results: list[Result]) -> Lines:
    rows = []
    for r in results:
        d = r.data
        rows.append(
            [
                hardware_words(r.hardware),
                d["dtype"],
                "eager" if d.get("eager") else "compiled",
                num(d.get("embed_scale"), 0),
                f"{num(d['sampled_abs_diff']['mean'], 4)} / {num(d['sampled_abs_diff']['max'], 3)}",
                num(d["top1_agreement"], 3),
                pct(d["within_bf16_bound"], 0) if "within_bf16_bound" in d else "-",
                f"{num(d['started_s'], 0)} / {num(d['request_s'])}",
            ]
        )
    header = [
        "GPU",
        "dtype",
        "vLLM",
        "embedding scale",
        "\\|logprob difference\\| mean / max",
        "top-1 agreement",
        "within bf16 rounding",
        "started / answered s",
    ]
    return table(
        header,
        rows,
        after=(
            "`deltarl teacher` with its vLLM engine end to end against the transformers engine on "
            "the same weights: a random SmolLM2-135M-shaped Llama, 16 sequences of random ids, "
            "2,408 scored positions, top-20. The embedding scale sets the largest logit (5: ~14, "
            "20: ~130)."
        ),
    )


def teacher_wire(results: list[Result]) -> Lines:
    rows = []
    for r in results:
        for row in r.data["rows"]:
            rows.append(
                [
                    str(row["k"]),
                    row["format"],
                    f"{row['bytes']:,}",
                    f"{row['vs_binary']:.2f}x",
                    num(row["encode_ms"], 1),
                    num(row["decode_ms"], 1),
                ]
            )
    m = results[0].data["meta"]
    return table(
        ["top-K", "format", "bytes", "vs binary", "encode ms", "decode ms"],
        rows,
        after=(
            f"One answer of `POST /v1/logprobs`: {m['batch']} sequences x {m['positions']} scored "
            "positions, each the sampled token's logprob and the top-K ids and logprobs; median of "
            f"{m['repeats']} runs on one thread. *binary*: deltarl's format; *json*: the same "
            "numbers as JSON; *b64-json*: base64 arrays in JSON; *vllm-json*: vLLM's "
            "`prompt_logprobs` shape."
        ),
    )


def env_server(results: list[Result]) -> Lines:
    out: Lines = []
    for r in results:
        d = r.data
        rows = [
            [
                row["transport"].upper(),
                row["target_steps_per_s"],
                f"{row['steps_per_s']:,}",
                f"{row['games_per_s']:,}",
                num(row["step_p50_ms"]),
                num(row["step_p99_ms"]),
                str(row["errors"]),
            ]
            for row in d["runs"]
        ]
        out += table(
            [
                "transport",
                "offered steps/s",
                "steps/s",
                "games/s",
                "step p50 ms",
                "step p99 ms",
                "errors",
            ],
            rows,
        )
        rep = d.get("repeats")
        if rep:
            out += [
                "",
                f"Over {len(rep['http_step_p99_ms_at_2000'])} runs: step p99 at 2,000 steps/s "
                f"{spread(rep['http_step_p99_ms_at_2000'], 1)} ms over HTTP, "
                f"{spread(rep['ws_step_p99_ms_at_2000'], 1)} ms over WS; saturation "
                f"{spread(rep['http_max_steps_per_s'], 0)} steps/s over HTTP, "
                f"{spread(rep['ws_max_steps_per_s'], 0)} over WS.",
            ]
        mem = d["memory"]
        out += [
            "",
            f"Server memory per session: {mem['bytes_per_session_after_reset']:,} B right after "
            f"reset, {mem['bytes_per_session_after_5_guesses']:,} B after 5 guesses (over "
            f"{mem['idle_sessions']:,} sessions; the empty server {mem['rss_before_mb']} MB). "
            f"Server stack: {d.get('server', '-')}.",
        ]
    return [
        *out,
        "",
        "One env server process pinned to one core, the load generator on another: each player "
        "holds a session and plays games back to back (~4.8 steps and a reset per game), waiting "
        "an exponential think time between requests so the offered load is the given rate "
        "(`max`: no think time). Latency is the client's, from sending a step to reading its "
        "whole answer.",
    ]


def coordinator(results: list[Result]) -> Lines:
    rows = []
    for r in results:
        d, q = r.data, r.data["requests"]

        def lat(kind: str, q: dict[str, Any] = q) -> str:
            keys = ("p50_ms", "p99_ms", "max_ms")
            return " / ".join(num(q[kind][k], 1) for k in keys if k in q[kind])

        once = d["leased_unique"] == d["leased_total"] == d["accepted"] == d["acked"]
        rows.append(
            [
                d["store"],
                str(d["server_workers"]),
                lat("heartbeat"),
                lat("submit"),
                lat("status"),
                lat("ack"),
                str(sum(v.get("errors", 0) for v in q.values())),
                f"{d['server_cpu_percent']:.0f}%",
                f"{d['redis_cpu_percent']:.0f}%" if d.get("redis_cpu_percent") else "-",
                f"{d['accepted']:,}: {'yes' if once else 'no'}",
            ]
        )
    header = [
        "store",
        "server processes",
        "heartbeat p50 / p99 / max ms",
        "submit p50 / p99 / max ms",
        "status p50 / p99 ms",
        "ack p50 / p99 ms",
        "errors",
        "server CPU (of one core)",
        "Redis CPU",
        "groups accepted: each leased and acked once",
    ]
    d = results[0].data
    return table(
        header,
        rows,
        after=(
            f"One coordinator on 2 cores under {d['workers']:,} workers heartbeating at 1 Hz, "
            f"{d['submit_rate']:g} trajectory-group submissions/s (~22 KB each), a trainer "
            "leasing batches of up to 64 groups and publishing a version every 2 s, and "
            f"{d['readers']} status readers at 1 Hz; the load generator on another core."
        ),
    )


def object_hash(results: list[Result]) -> Lines:
    rows = []
    for r in results:
        d = r.data
        per = d["per_core_mb_s"]
        best = max(d["sha256_parallel_parts"], key=lambda p: p["aggregate_mb_s"])
        x = d["extrapolated"]
        rows.append(
            [
                hardware_words(r.hardware),
                f"{per['sha256']:,.0f} / {per['blake2b']:,.0f} / {per['xxh3_128']:,.0f}",
                f"{best['aggregate_mb_s']:,.0f} ({best['parts']} parts, {best['threads']} threads)",
                f"{num(x['anchor_7b_bf16_sha256_one_core_s'], 1)} / "
                f"{num(x['anchor_7b_bf16_sha256_best_parts_here_s'], 1)}",
                num(x["delta_7b_1.3_bytes_per_changed_sha256_s"], 3),
            ]
        )
    header = [
        "CPU",
        "MB/s per core: SHA-256 / BLAKE2b / xxh3-128",
        "SHA-256 in parts, MB/s",
        "a 7B bf16 anchor (14 GB), SHA-256 s: one core / in parts",
        "a 7B delta (91 MB), SHA-256 s",
    ]
    return table(
        header,
        rows,
        after=(
            "What binding every bucket object by SHA-256 (signed versions) costs beside the xxh3 "
            "digests every object already has. The 7B columns scale the measured rates to those "
            "sizes."
        ),
    )


def gpu_tests(results: list[Result]) -> Lines:
    rows = []
    for r in results:
        for run in r.data["runs"]:
            date = run.get("date", r.meta["date"])
            printed = run.get("printed") or []
            printed = [printed] if isinstance(printed, str) else printed
            notes = [run["note"]] if run.get("note") else []
            result = "; ".join([run["result"], *(f"`{p}`" for p in printed), *notes])
            cells = [f"`{run['command']}`", result]  # a | in a cell ends it, even in code
            rows.append([hardware_words(r.hardware), date, *(c.replace("|", "\\|") for c in cells)])
    return table(
        ["GPUs", "date", "command", "result"],
        rows,
        after=(
            "The last run of each command on each kind of GPU "
            "(`python bench/gpu_tests_result.py` records a suite's logs); the result files list "
            "the failed tests by name."
        ),
    )
