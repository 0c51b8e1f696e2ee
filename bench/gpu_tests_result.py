"""Record GPU test runs as a benchmark result: each pytest log's command and its summary line.

bench/gpu_vllm_suite.sh logs every step to ``RESULTS_DIR/<step>.log``, whose first line is
``=== <step>: <command>``. For every such log that ran pytest, this reads the command and the
final summary line (``43 passed, 6 skipped ... in 222.24s``) and the names of the failed tests,
and merges them into ``bench/results/gpu_tests_<hardware>_vllm.json`` (``--out`` for another
path): a run replaces an earlier one of the same tests (the same filters over the same test
files or fewer; environment, timeout and pytest options aside), other runs stay, so the file
holds the last run of each selection. bench/report.py renders it as the page's "GPU test runs".

On the GPU machine, after the suite (bench/gpu_vllm_suite.sh does this itself)::

    python bench/gpu_tests_result.py RESULTS_DIR/*.log

Elsewhere, from logs copied off a GPU machine, say what they ran on (and, for a log of pytest
alone, its command)::

    python bench/gpu_tests_result.py --hardware 2xh200 --date 2026-11-28 \\
        --machine "2x NVIDIA H200, torch 2.11.0+cu130, vLLM 0.33.0" \\
        --command "python3 -m pytest -q tests/rollout/test_vllm_moe_gpu.py" moe.log
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from common import gpu_tag, meta, result_path, write_json

SUMMARY = re.compile(r"^=*\s*(?P<counts>\d+ (?:passed|failed|error)[^=]*?) in (?P<s>[\d.]+)s")
COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)")


def parse_log(
    path: Path, command: str | None = None, keep: str | None = None
) -> dict[str, Any] | None:
    """The run a suite log records (None: not a pytest run, or no summary line: cut short).
    ``command``: the run's command for a log without the suite's ``=== step: command`` line;
    ``keep``: a regular expression, the lines it matches (what the tests print) are kept."""
    lines = path.read_text(errors="replace").splitlines()
    if lines and lines[0].startswith("=== "):
        command = lines[0].partition(": ")[2].strip()
    if not command or "pytest" not in command:
        return None
    summary = next((m for line in reversed(lines) if (m := SUMMARY.match(line.strip()))), None)
    if summary is None:
        return None
    counts = {kind: int(n) for n, kind in COUNT.findall(summary["counts"])}
    counts = {k.rstrip("s") if k == "errors" else k: v for k, v in counts.items()}
    shown = ", ".join(f"{n} {k}" for k, n in counts.items() if k != "deselected")
    failed = [line.split()[1] for line in lines if line.startswith("FAILED ")]
    run: dict[str, Any] = {
        "command": re.sub(r"^timeout \d+ ", "", command),
        "result": f"{shown}, {float(summary['s']):.0f} s",
        "counts": counts,
    }
    if failed:
        run["failed"] = failed
    if keep:
        run["printed"] = [line for line in lines if re.search(keep, line)]
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--hardware", help="e.g. h200, 2xh100 (default: this machine's GPUs)")
    ap.add_argument("--machine", help="the machine in words (default: this one's)")
    ap.add_argument("--date", help="YYYY-MM-DD (default: today)")
    ap.add_argument(
        "--out", type=Path, help="default: bench/results/gpu_tests_<hardware>_vllm.json"
    )
    ap.add_argument(
        "--command", help="the command of logs without the suite's `=== step: command` first line"
    )
    ap.add_argument("--keep", help="keep the log lines this regular expression matches")
    a = ap.parse_args(argv)
    runs = [run for path in a.logs if (run := parse_log(path, a.command, a.keep))]
    if not runs:
        print("no pytest run with a summary line in those logs", file=sys.stderr)
        return 1
    gpus = 0
    if a.hardware is None or a.machine is None:
        import torch

        gpus = torch.cuda.device_count()
    a.hardware = a.hardware or gpu_tag(gpus)
    out = a.out or result_path("gpu_tests", a.hardware, "vllm")
    about = meta(gpus=0 if a.machine else gpus) | {"command": "each run's command in the table"}
    about |= {k: v for k, v in (("machine", a.machine), ("date", a.date)) if v}
    for run in runs:
        run["date"] = about["date"]
    old = json.loads(out.read_text())["runs"] if out.exists() else []
    kept = [r for r in old if not any(covers(run["command"], r["command"]) for run in runs)]
    write_json(out, {"meta": about, "runs": kept + runs})
    return 0


def selection(command: str) -> tuple[frozenset[str], tuple[str, ...]]:
    """What a pytest command runs: its test paths, and its -k / -m filters."""
    words = shlex.split(command)
    words = words[words.index("pytest") + 1 :] if "pytest" in words else words
    paths, filters = set(), []
    for i, w in enumerate(words):
        if w in ("-k", "-m") and i + 1 < len(words):
            filters.append(f"{w} {words[i + 1]}")
        elif w.endswith(".py") or "::" in w:
            paths.add(w)
    return frozenset(paths), tuple(filters)


def covers(new: str, old: str) -> bool:
    """Whether a run of ``new`` supersedes one of ``old``: the same filters over the same test
    files or more (environment, timeout and pytest options aside)."""
    new_paths, new_filters = selection(new)
    old_paths, old_filters = selection(old)
    return new_filters == old_filters and bool(old_paths) and old_paths <= new_paths


if __name__ == "__main__":
    raise SystemExit(main())
