"""The sections of docs/benchmarks.md on running the system: the vLLM engine, the whole system on
GPUs, the trainer's memory, learning Wordle and hinted self-distillation."""

from __future__ import annotations

import statistics
from typing import Any

from report_format import (
    MODELS,
    Lines,
    Result,
    hardware_words,
    label,
    lr,
    mb,
    num,
    pct,
    spread,
    table,
)


def vllm_check(results: list[Result]) -> Lines:
    rows = []
    for r in results:
        d = r.data
        s, w = d["sync"], d["wire"]
        diffs = "; ".join(
            f"{k}: {num(v['mean'], 4)} / {num(v['max'], 4)}"
            for k, v in d["logprob_abs_diff"].items()
        )
        rows += [
            [label(r), "versions followed, each bit-identical", str(s["versions"])],
            [
                label(r),
                "paused apply p50 / max ms",
                f"{num(s['pause_ms_p50'])} / {num(s['pause_ms_max'])}",
            ],
            [label(r), "verify p50 ms", num(s["verify_ms_p50"], 1)],
            [
                label(r),
                "vLLM's weight-update API: apply ms, verified",
                f"{num(1e3 * w['apply_s'])}, {'yes' if w['verified'] else 'no'}",
            ],
            [label(r), "\\|logprob\\| difference to transformers, mean / max", diffs],
            [label(r), "failures", ", ".join(d["failures"]) or "none"],
        ]
    return table(["model, hardware", "measure", "value"], rows)


def vllm_speed(results: list[Result]) -> Lines:
    out: Lines = []
    for r in results:
        d = r.data
        columns = d["columns"]
        ratios = [f"engine/{c}" for c in columns if c != "engine"]
        rows = []
        for workload, entry in d["summary"].items():
            if "warm-up" in workload or workload.startswith("diag:"):
                continue
            cells = [spread((entry["columns"].get(c) or {}).get("values", []), 0) for c in columns]
            cells += [
                spread((entry["ratios"].get(k) or {}).get("values", []), 0, 100) + "%"
                if entry["ratios"].get(k)
                else "-"
                for k in ratios
            ]
            rounds = max((v.get("n", 0) for v in entry["columns"].values()), default=0)
            rows.append([workload, str(rounds), *cells])
        out += [f"{label(r)}:", ""]
        out += table(["workload", "rounds", *columns, *ratios], rows)
        if d.get("stopped"):
            out += ["", f"The run stopped early: {d['stopped']}."]
        out.append("")
    return [
        *out,
        "Tokens/s, each column in a fresh process, the columns interleaved round by round; a "
        "ratio is computed per round. `engine`: deltarl's vLLM engine behind its weight-sync "
        "gate; `llm_same`: `vllm.LLM.generate` with the engine's settings; `llm_default`: vLLM's "
        "defaults.",
    ]


def vllm_tp(results: list[Result]) -> Lines:
    rows = []
    for r in results:
        d = r.data
        for run in d["runs"]:
            tps = run.get("tokens_per_s", {})
            rows.append(
                [
                    f"{MODELS.get(r.model, r.model)}, {hardware_words(r.hardware)}",
                    str(run["tp"]),
                    f"{run['verified_version']} of {d['versions']}",
                    str(run["generations_spanning_a_sync"]),
                    f"{num(run['pause_ms']['p50'])} / {num(run['pause_ms']['p99'])}",
                    num(run["wait_ms"]["p50"]),
                    f"{num(run['stage_ms']['p50'], 0)} / {num(run['stage_ms']['max'], 0)}",
                    " / ".join(num(tps[b]["tokens_per_s"], 0) for b in sorted(tps, key=int)),
                ]
            )
    header = [
        "model, hardware",
        "TP",
        "versions verified",
        "generations spanning a sync",
        "paused apply p50 / p99 ms",
        "drain of the forward in flight p50 ms",
        "staging p50 / max ms",
        "tokens/s (batch 32 / 256)",
    ]
    return table(
        header,
        rows,
        after=(
            f"One engine per TP value on the same GPUs and bucket, {results[0].data['density']:.0%} "
            "of the elements changed per version; at TP 2 every rank's shard is patched in the same "
            "pause and verified."
        ),
    )


def system(results: list[Result]) -> Lines:
    rows = []
    for r in results:
        d, a = r.data, r.data["args"]
        sync, status = d.get("sync") or {}, d["coordinator_status"] or {}
        trainer = "1 GPU"
        if int(a.get("trainer_nproc", 1)) > 1:
            kind = "FSDP2" if "fsdp" in a.get("overrides", "") else "DDP"
            trainer = f"{kind}, {a['trainer_nproc']} ranks"
        engine = a.get("engine", "transformers")
        model = MODELS.get(r.model.split("-" + engine)[0], a.get("model_kind", ""))
        tokens = [v for v in (d.get("worker_tokens_per_s") or {}).values() if v]
        reward = d["window_means"].get("reward/mean") or []
        syncs = "-"
        if sync.get("pause_ms"):
            syncs = (
                " / ".join(num(sync["pause_ms"][k]) for k in ("p50", "p99", "max"))
                + " ms; "
                + " / ".join(num(sync["publish_to_applied_s"][k]) for k in ("p50", "p99"))
                + " s"
            )
        task = a.get("task", "wordle")
        if task == "wordle":
            credit = float(a.get("format_credit") or 0)
            task += f" ({a.get('reward', 'final')} reward"
            task += f", format credit {credit:g})" if credit else ")"
        overrides = a.get("overrides", "").replace(" ", "")
        if "run.routing_replay=true" in overrides:
            task += ", routing replay"
        if "run.max_staleness=0" in overrides:
            task += ", on-policy (`run.max_staleness = 0`)"
        valid = d["window_means"].get("reward/valid/mean") or []
        rows.append(
            [
                f"{model}, {task}",
                f"{engine} x {a['workers']}, {hardware_words(r.hardware)}",
                trainer,
                f"{d['steps']} in {num(d.get('train_s') or float(a['duration']), 0)} s",
                num(d["episodes_trained_per_s"], 1),
                " / ".join(num(t, 0) for t in tokens) or "-",
                f"{sync['deltas_applied']} ({pct(sync['chained_share'], 0)} chained)"
                if sync.get("deltas_applied")
                else "-",
                syncs,
                mb(sync.get("bytes_per_version_downloaded_p50")),
                f"{num(reward[0])} -> {num(reward[-1])}" if reward else "-",
                f"{pct(valid[0], 0)} -> {pct(valid[-1], 0)}" if valid else "-",
                _gap(d.get("trainer_p50") or {}),
                f"v{status.get('final_version')}: "
                + ("yes" if status.get("all_workers_verified_at_final") else "no"),
            ]
        )
    header = [
        "model, task",
        "workers, GPUs",
        "trainer",
        "optimizer steps",
        "trained episodes/s",
        "tokens/s per worker",
        "deltas applied",
        "paused per sync p50 / p99 / max; publish to applied p50 / p99",
        "downloaded per version p50",
        "reward, first -> last window of steps",
        "valid moves, first -> last window",
        "trainer vs worker logprobs: mean / max abs difference; importance weight (p50 of steps)",
        "every worker verified at the final version",
    ]
    return table(
        header,
        rows,
        after=(
            "Coordinator (SQLite), env server, rollout workers, trainer and a local-directory "
            "bucket, each its own process. Wordle: 6 guesses, one invalid reply tolerated, 24 new "
            "tokens per reply, GRPO 4 groups of 8 per step at lr 1e-5 from SmolLM2 as published "
            "(no warm start; about 1.3% of the elements change per version). The final reward "
            "with format credit gave credit to a repeated well-formed guess; the shaped reward "
            "(the default) pays only valid new guesses and their feedback. In 150 s neither "
            "teaches a game a user would accept: valid moves rise, but the games end by "
            "forfeit (a valid first guess, then repeats); the warm-started recipe below is what "
            "wins games. Charset: a tiny byte-level Llama at lr 1e-2. The upcycled mixture of "
            "experts (SmolLM2's MLP copied into 8 experts with 2% noise, top-2, random router: "
            "`--model-kind smollm2-moe`) is served by vLLM in bf16 like the dense model; its "
            "trainer-vs-worker logprob difference starts at the dense model's level and grows "
            "to several times it within ~20 steps; routing replay (every trajectory replayed) "
            "leaves it unchanged, so routing flips are not its cause. On-policy (every trained "
            "trajectory sampled by the version that scores it: no policy lag) it is 0.08 per "
            "token over 17 steps, about twice the dense model's with staleness up to 2: the "
            "engines' forward passes differ more on the MoE, and most of the stale runs' 0.29 "
            "over 70 steps is lag or later training (docs/trainer.md)."
        ),
    )


def _gap(p50: dict[str, float]) -> str:
    """The per-step medians of the trainer's logprob mismatch against the workers."""
    mean, top = p50.get("mismatch/abs_logprob_diff/mean"), p50.get("mismatch/abs_logprob_diff/max")
    if mean is None or top is None:
        return "-"
    w = p50.get("is/weight/mean")
    return f"{num(mean, 3)} / {num(top)}" + (f"; {num(w, 3)}" if w is not None else "")


def trainer_memory(results: list[Result]) -> Lines:
    rows = []
    for r in results:
        for row in r.data["rows"]:
            size, _, tokens = row["config"].partition(":")
            what = f"{size} sequences" + (
                f", at most {int(tokens):,} padded tokens" if tokens else ""
            )
            rows.append([label(r), what, num(row["peak_gib"], 1), num(row["step_s"])])
    first = results[0].data["rows"][0]
    return table(
        ["model, GPU", "micro-batches of", "peak allocated GiB", "step s"],
        rows,
        after=(
            f"One GRPO step of {first['sequences']} Wordle-shaped episodes ({first['tokens']:,} "
            f"tokens, {first['trained_tokens']:,} of them trained) through `train_step`: fp32 master "
            "weights, bf16 autocast, AdamW; the second of two steps."
        ),
    )


def wordle_grpo(results: list[Result]) -> Lines:
    rows = []
    solver = results[0].data["prep"]["pipeline"].get("solver")
    if solver:
        name = f"reference solver ({solver['games']:,} games)"
        rows.append([name, "", "1.00", "1.00", f"**{num(solver['win_rate'], 3)}**", "0", ""])
    for i, r in enumerate(results):
        prep, arms = r.data["prep"], r.data["arms"]
        summary = any(
            "feedback_summary=true" in a["args"].get("overrides", "") for a in arms.values()
        )
        render = "feedback summary" if summary else "plain feedback"
        if i == 0:
            rows.append(wordle_row("SmolLM2-135M-Instruct, untrained", "", prep["eval_untrained"]))
        steps = prep["pipeline"]["sft"]["steps"]
        rows.append(wordle_row(f"{render}: `deltarl sft`, {steps} steps", "", prep["eval_sft"]))
        for name, arm in arms.items():
            games = arm["wordle"]["env_games_per_window"]
            rows.append(
                wordle_row(
                    f"{render}: + GRPO at lr {lr(arm['args']['lr'])} (`{name}`)",
                    str(arm["steps"]),
                    arm["eval_grpo"],
                    thirds(games),
                )
            )
    header = [
        "model (200 games per evaluation)",
        "GRPO steps",
        "valid moves, greedy / T = 1",
        "consistent with the feedback (greedy)",
        "**wins**, greedy / T = 1",
        "forfeits (greedy)",
        "training games' win rate per minute, first -> last third",
    ]
    syncs = [a["sync"] for r in results for a in r.data["arms"].values()]
    deltas = [s["deltas_applied"] for s in syncs]
    return [
        *table(header, rows),
        "",
        f"Weight sync during the {len(syncs)} GRPO runs: every version applied "
        f"({min(deltas)}-{max(deltas)} deltas per run), paused per sync p50 "
        f"{spread((s['pause_ms']['p50'] for s in syncs), 2)} ms, p99 "
        f"{spread((s['pause_ms']['p99'] for s in syncs), 1)} ms.",
        "",
        "The [GPU recipe](wordle.md#the-gpu-recipe-benchgpu_wordle_fullsh): solver games, "
        "`deltarl sft` on them, then GRPO through the whole system (each run a trainer and its "
        "vLLM worker on one GPU; the shaped reward with the consistency term, a win earning its "
        "unplayed guesses; 8 groups of 8 games per step; 13 minutes of training), each model "
        "evaluated by `deltarl eval` on the same 200 games (seeds from 1,000,000) under the "
        "real rules, greedy and sampled at T = 1. One warm start per rendering of the feedback: "
        "plain, and with the [feedback summary](wordle.md#feedback-summary). 200 games give "
        "about +-0.035 on a win rate.",
    ]


def wordle_row(name: str, steps: str, e: dict[str, Any], games: str = "") -> list[str]:
    """One evaluation's row of the Wordle table (greedy, and sampled when the report has it)."""
    s = e.get("sampled") or {}
    valid, wins = num(e["valid_move_rate"], 3), f"**{num(e['win_rate'], 3)}**"
    if s:
        valid += f" / {num(s['valid_move_rate'], 3)}"
        wins += f" / {num(s['win_rate'], 3)}"
    consistent = e.get("consistent_rate")
    return [
        name,
        steps,
        valid,
        "-" if consistent is None else num(consistent, 2),
        wins,
        num(e["forfeit_rate"], 3),
        games,
    ]


def thirds(games: list[dict[str, Any]]) -> str:
    """The mean of the per-minute win rates in the first and in the last third of the run's
    full minutes (the last window, cut short by the run's end, left out)."""
    full = [g["win_rate"] for g in games if g["games"]]
    full = full[:-1] if len(full) > 3 else full
    third = max(1, len(full) // 3)
    return f"{num(statistics.fmean(full[:third]), 3)} -> {num(statistics.fmean(full[-third:]), 3)}"


def hints_wordle(results: list[Result]) -> Lines:
    rows = []
    for r in results:
        arms = {k: v for k, v in r.data.items() if isinstance(v, dict) and "per_step" in v}
        common = min(len(v["per_step"]["reward/mean"]) for v in arms.values())
        for arm, v in arms.items():
            rewards = v["per_step"]["reward/mean"][:common]
            windows = [statistics.fmean(rewards[i : i + 5]) for i in range(0, common, 5)]
            tokens = v["worker_tokens_per_s"].values()
            rows.append(
                [
                    arm,
                    f"{v['steps']} in {num(v['elapsed_s'], 0)} s",
                    num(v["episodes_trained_per_s"], 1),
                    " / ".join(num(t, 0) for t in tokens),
                    f"{num(v['pause_ms']['p50'])} / {num(v['pause_ms']['p99'])}",
                    " ".join(num(w, 3) for w in windows),
                ]
            )
    header = [
        "arm",
        "optimizer steps",
        "trained episodes/s",
        "tokens/s per worker",
        "paused per sync p50 / p99 ms",
        "mean reward per 5 steps (the steps both arms ran)",
    ]
    return table(
        header,
        rows,
        after=(
            "SmolLM2-135M-Instruct on 6-guess Wordle (final reward with format credit 0.5), two "
            "transformers workers and the trainer on one GPU, seed 0, 240 s of training per arm. "
            "The hints arm: every episode below reward 1 gets the environment's hint for its first "
            "move that ignored the feedback, scored once by the worker, and the trainer adds the "
            "reverse KL to that hinted distribution (`loss.hint_coef` 1.0)."
        ),
    )


def _capitals_ab(results: list[Result], about: str) -> Lines:
    """bench/gpu_capitals_ab.sh's two arms per seed (the hints results predate the gap
    columns)."""
    rows, gaps = [], False
    for r in results:
        last = r.data["last"]
        for seed, row in r.data["seeds"].items():
            for arm in r.data.get("arms", ["grpo", "hints"]):
                a = row[arm]
                gaps = gaps or "logprob_gap_median" in a
                rows.append(
                    [
                        seed,
                        arm,
                        " ".join(f"{x:.2f}".lstrip("0") for x in a["rewards"]) or "(failed)",
                        num(a["last_mean"], 3),
                        num(a.get("logprob_gap_median"), 3),
                        num(a.get("is_weight_median"), 3),
                    ]
                )
    header = ["seed", "arm", "trained batches' mean reward per step", f"mean of the last {last}"]
    if gaps:
        header += ["logprob gap, median over steps", "importance weight, median"]
    else:
        rows = [row[:4] for row in rows]
    return [*table(header, rows), "", about]


def hints_capitals(results: list[Result]) -> Lines:
    return _capitals_ab(
        results,
        "The capitals task (charset env, target A-Z: reply in capital letters), "
        "SmolLM2-135M-Instruct, two transformers workers and the trainer on one GPU, 15 steps "
        "of 2 groups of 6, lr 1e-4; the hints arm adds the environment's hint scored by the "
        "worker's policy and `loss.hint_coef` 1.0.",
    )


def fp8_capitals(results: list[Result]) -> Lines:
    return _capitals_ab(
        results,
        "The capitals task, SmolLM2-135M-Instruct, one vllm worker and the trainer per run, the "
        "two arms of a seed side by side on one GPU, 15 steps of 2 groups of 6, lr 1e-4, "
        "staleness up to 2; the fp8 arm's worker serves every version in 64 x 64 block fp8 "
        "(`[run] fp8`, `fp8_block = 64`), verified bit for bit like the bf16 one. The logprob "
        "gap is the mean |trainer - worker| per token of a step's trained tokens (the trainer "
        "scores in bf16, so the fp8 arm's gap includes the quantization; at this learning rate "
        "both include the policy lag of stale trajectories); a missing value: not recorded.",
    )
