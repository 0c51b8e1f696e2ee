"""Gather one bench/gpu_wordle_arms.sh run (a prep, then GRPO arms from its SFT model) into a
benchmark result: the solver's win rate, the SFT numbers, the untrained and SFT models'
evaluations, and per arm its final policy's evaluation and its run's summary (steps, arguments,
the Wordle windows, the weight syncs).

Reads ``RES/prep/{pipeline,eval_untrained,eval_sft}.json`` and ``RES/<arm>/{eval_grpo,
grpo_summary}.json``; writes ``bench/results/wordle_grpo_<N>x<gpu>_smollm2-135m-<rendering>.json``
(``rendering``: ``summary`` when the runs played the feedback summary, else ``plain``; ``--out``
for another path), which a rerun overwrites. bench/gpu_wordle_arms.sh calls it when its arms
end; by hand on the GPU machine, or elsewhere with ``--hardware`` and ``--machine``::

    python bench/wordle_grpo_result.py RES --gpus 2 --command "bash bench/gpu_wordle_arms.sh ..."
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from common import gpu_tag, meta, result_path, write_json

QUIET = ("examples", "settings", "won_seeds")
RUN_KEYS = ("steps", "elapsed_s", "train_s", "args", "wordle", "first_vs_last_window", "sync")


def evaluation(path: Path) -> dict[str, Any]:
    """An evaluation report (``deltarl eval --out``) without its long parts."""
    report = json.loads(path.read_text())
    out = {k: v for k, v in report.items() if k not in QUIET}
    if "sampled" in out:
        out["sampled"] = {k: v for k, v in out["sampled"].items() if k not in QUIET}
    return out


def gather(res: Path) -> dict[str, Any]:
    prep = res / "prep"
    out: dict[str, Any] = {
        "prep": {
            "pipeline": json.loads((prep / "pipeline.json").read_text()),
            "eval_untrained": evaluation(prep / "eval_untrained.json"),
            "eval_sft": evaluation(prep / "eval_sft.json"),
        },
        "arms": {},
    }
    for arm in sorted(p for p in res.iterdir() if (p / "grpo_summary.json").exists()):
        if not (arm / "eval_grpo.json").exists():
            continue  # an arm whose final evaluation did not run
        summary = json.loads((arm / "grpo_summary.json").read_text())
        out["arms"][arm.name] = {
            "eval_grpo": evaluation(arm / "eval_grpo.json"),
            **{k: summary.get(k) for k in RUN_KEYS},
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("res", type=Path, help="bench/gpu_wordle_arms.sh's RESULTS_DIR")
    ap.add_argument("--gpus", type=int, required=True, help="GPUs the arms ran on")
    ap.add_argument("--hardware", help="e.g. 2xh100 (default: from this machine's GPU)")
    ap.add_argument("--machine", help="the machine in words (default: this one's)")
    ap.add_argument("--command", default="bash bench/gpu_wordle_arms.sh RES ARM...")
    ap.add_argument("--out", type=Path, default=None, help="default: see the docstring")
    a = ap.parse_args(argv)
    result = gather(a.res)
    if not result["arms"]:
        raise SystemExit(f"{a.res}: no arm with both grpo_summary.json and eval_grpo.json")
    overrides = " ".join(str(x["args"].get("overrides", "")) for x in result["arms"].values())
    rendering = "summary" if "feedback_summary=true" in overrides else "plain"
    hardware = a.hardware or gpu_tag(a.gpus)
    out = a.out or result_path("wordle_grpo", hardware, f"smollm2-135m-{rendering}")
    about = meta(gpus=0 if a.machine else a.gpus) | {"command": a.command}
    if a.machine:
        about["machine"] = a.machine
    write_json(out, {"meta": about, **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
