"""Render docs/benchmarks.md from the result files in bench/results/.

    python bench/report.py --write     # rewrite docs/benchmarks.md
    python bench/report.py             # print the page
    python bench/report.py --check     # exit 1 if docs/benchmarks.md is not what the results give

A result file is ``<benchmark>_<hardware>_<model>.json`` (or ``.jsonl``: one JSON line per step,
the first line ``{"meta": ...}``) with a ``meta`` block: ``date``, ``machine``, ``command`` and
optionally ``note`` (what a reader must know) and ``source`` (where the numbers come from when
the run's own output was not kept). bench/common.py writes it and the default file name.

Each :class:`Section` in ``SECTIONS`` (bench/report_sections.py) names its benchmark (the file
names' prefix), a title, a sentence or two on what it measures and a function that renders the
section's tables from every result file of that benchmark, whatever its hardware or model: a
rerun overwrites its file, a run on new hardware or a new model adds a file and renders as one
more row or table. A file whose name matches no section, or whose date, machine or command cannot
be found (a ``meta`` block; older scripts wrote them at the top level), is an error; a section
with no file yet is left out of the page (``--check`` lists those). Files other than
``.json``/``.jsonl`` (a run's raw logs) are not rendered.

To add a benchmark: a script that writes its result with bench/common.py, a ``Section`` in
bench/report_sections.py, then ``python bench/report.py --write``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from report_format import Result
from report_sections import SECTIONS

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
HARDWARE = re.compile(r"^(cpu\d+|(\d+x)?[a-z]+\d+[a-z]*)$")


def read(path: Path, benchmarks: list[str]) -> Result:
    """Parse ``path`` (name and content) against the known benchmark names."""
    stem = path.name.removesuffix(".jsonl").removesuffix(".json")
    bench = next(
        (b for b in sorted(benchmarks, key=len, reverse=True) if stem.startswith(b + "_")), None
    )
    if bench is None:
        raise SystemExit(
            f"{path}: no section renders the benchmark of this file; add one to SECTIONS in "
            "bench/report_sections.py (names: <benchmark>_<hardware>_<model>.json)"
        )
    hardware, _, model = stem[len(bench) + 1 :].partition("_")
    if not HARDWARE.match(hardware) or not model:
        raise SystemExit(
            f"{path}: want <benchmark>_<hardware>_<model>.json, hardware like cpu2, h100, "
            f"4xh100 (got hardware {hardware!r}, model {model!r})"
        )
    if path.suffix == ".jsonl":
        lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        head = lines[0] if lines and "meta" in lines[0] else {}
        data: Any = lines[1:] if head else lines
        meta = dict(head.get("meta", {}))
    else:
        data = json.loads(path.read_text())
        meta = dict(data.get("meta") or fallback_meta(data))
    for key in ("date", "machine", "command"):
        if not meta.get(key):
            raise SystemExit(f"{path}: its meta block has no {key!r} (date, machine, command)")
    return Result(path, bench, hardware, model, data, meta)


def fallback_meta(data: dict[str, Any]) -> dict[str, Any]:
    """The meta of a file written before scripts wrote a ``meta`` block: top-level ``date`` (or
    ``started``), ``machine`` (or the first process's ``device``) and ``command``."""
    date = str(data.get("date") or data.get("started") or "")[:10]
    machine = data.get("machine")
    if isinstance(machine, dict):  # bench/moe_scale.py's and moe_sparsity.py's
        gpus = machine.get("gpus") or []
        parts = [f"{len(gpus)}x {gpus[0]}"] if gpus else []
        parts += [f"{machine.get('cores')} CPU cores", f"torch {machine.get('torch')}"]
        machine = ", ".join(parts)
    if not machine:  # bench/vllm_speed.py: each process records its device
        for rnd in data.get("rounds", []):
            for proc in rnd.get("processes", {}).values():
                info = proc.get("info", {})
                if info.get("device"):
                    machine = f"{info['device']}, {info.get('cpus', '?')} CPU cores"
                    break
            if machine:
                break
    command = data.get("command")
    if command:  # as the script printed it: its name alone, output paths included
        command = re.sub(r"^python3? (?!bench/)(\S+\.py)", r"python bench/\1", command)
        command = re.sub(r" --(json|out|out-dir) \S+", "", command)
    elif isinstance(data.get("args"), dict):  # bench/vllm_speed.py: its arguments
        shown = ("rounds", "budget_s")
        command = "python bench/vllm_speed.py " + " ".join(
            f"--{k.replace('_', '-')} {str(v).removesuffix('.0')}"
            for k, v in data["args"].items()
            if k in shown and v not in ("None", None)
        )
    return {"date": date, "machine": machine, "command": command}


def runs_list(results: list[Result]) -> list[str]:
    """Where the section's numbers come from: file, date, machine, command, notes."""
    out = ["", "Runs:", ""]
    for r in results:
        rel = f"bench/results/{r.path.name}"
        command = r.meta["command"]
        shown = command if command.startswith("each run's") else f"`{command}`"
        line = f"- [`{r.path.name}`](../{rel}), {r.meta['date']}, {r.meta['machine']}: {shown}"
        for key in ("note", "source"):
            if r.meta.get(key):
                line += f"; {r.meta[key]}"
        out.append(line + ".")
    return out


HEADER = """\
# Benchmarks

<!-- Generated by `python bench/report.py --write` from bench/results/: edit the result files or
bench/report_sections.py, not this page (tests/unit/test_benchmarks_page.py checks it). -->

The current result of every benchmark in [`bench/`](../bench/), rendered from its file in
[`bench/results/`](../bench/results/) (named `<benchmark>_<hardware>_<model>.json`; rerunning a
section's command on the same hardware overwrites its file, then `python bench/report.py --write`
renders this page). Where runs, steps or rounds vary, a number is their median with the minimum
and maximum in brackets, `median [min-max]`, over what the table says. Each section ends with its
runs: file, date, machine and command.
"""


def render(results_dir: Path = RESULTS) -> tuple[str, list[str]]:
    """The page, and the sections that have no result file."""
    names = [s.benchmark for s in SECTIONS]
    # results only: a run's raw logs may sit beside them, they are not rendered
    files = sorted(p for p in results_dir.iterdir() if p.suffix in (".json", ".jsonl"))
    by_bench: dict[str, list[Result]] = {}
    for path in files:
        result = read(path, names)
        by_bench.setdefault(result.benchmark, []).append(result)
    lines = [HEADER]
    missing = []
    for section in SECTIONS:
        found = by_bench.get(section.benchmark)
        if not found:
            missing.append(section.benchmark)
            continue
        found.sort(key=section.key)
        lines += [f"## {section.title}", "", section.about, ""]
        lines += section.render(found)
        lines += runs_list(found)
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n", missing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--write", action="store_true", help="rewrite docs/benchmarks.md")
    ap.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    ap.add_argument("--results", type=Path, default=RESULTS, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    page, missing = render(a.results)
    if a.check:
        if PAGE.read_text() != page:
            print(
                "docs/benchmarks.md is stale: run `python bench/report.py --write`", file=sys.stderr
            )
            return 1
        if missing:
            print(f"sections without a result file (left out): {missing}", file=sys.stderr)
        return 0
    if a.write:
        PAGE.write_text(page)
        print(f"wrote {PAGE.relative_to(ROOT)}", file=sys.stderr)
        return 0
    sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
