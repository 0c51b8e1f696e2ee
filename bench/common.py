"""What every benchmark writes beside its numbers, and where.

A result file is ``bench/results/<benchmark>_<hardware>_<model>.json`` (``.jsonl`` for scripts
that write one line per step): ``hardware`` names what it ran on (``cpu2``: two CPU cores;
``h100``: one GPU; ``4xh100``: four of one kind), ``model`` the model or size it measured. A rerun
on the same hardware and model writes the same file, so ``bench/results/`` holds the current
result of each benchmark, and ``python bench/report.py --write`` renders docs/benchmarks.md from
it. Every file carries a ``meta`` block: ``date``, ``machine`` and ``command`` (and, where a
reader needs it, ``note``).

The scripts run as ``python bench/<name>.py`` and import this module as ``common`` (their folder
is first on ``sys.path``).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def cpu_tag(cores: int | None = None) -> str:
    """``cpu<N>``: the CPU cores the benchmark ran on (default: those this process may use)."""
    return f"cpu{cores or len(os.sched_getaffinity(0))}"


def gpu_tag(count: int, name: str | None = None) -> str:
    """``h100`` for one GPU, ``4xh100`` for four (``name``: the device's name; default GPU 0's)."""
    if name is None:
        import torch

        name = torch.cuda.get_device_name(0)
    words = name.lower().replace("nvidia", "").replace("geforce", "")
    found = re.search(r"[a-z]*\d+", words)
    short = found.group(0) if found else "gpu"
    return short if count == 1 else f"{count}x{short}"


def result_path(benchmark: str, hardware: str, model: str, ext: str = "json") -> Path:
    """The default result file of a benchmark run (see the module docstring)."""
    return RESULTS / f"{benchmark}_{hardware}_{model}.{ext}"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(gpus: int = 0) -> str:
    """The machine in words: GPUs (when ``gpus``), CPU cores, and the versions that matter."""
    parts = []
    if gpus:
        import torch

        parts.append(f"{gpus}x {torch.cuda.get_device_name(0)}")
    parts.append(f"{os.cpu_count()} CPU cores ({cpu_model()})")
    versions = [f"Python {platform.python_version()}"]
    for module in ("torch", "vllm", "transformers"):
        if module in sys.modules:
            versions.append(f"{module} {getattr(sys.modules[module], '__version__', '?')}")
    return ", ".join(parts + versions)


def command(argv: list[str] | None = None, launcher: str = "python") -> str:
    """This run's command line, with the script's path relative to the repository root."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve()
    if script.is_relative_to(ROOT):
        argv[0] = str(script.relative_to(ROOT))
    return shlex.join([*launcher.split(), *argv])


def meta(gpus: int = 0, launcher: str = "python", **extra: Any) -> dict[str, Any]:
    """The ``meta`` block of a result: today's date (UTC), the machine and the command."""
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "machine": machine(gpus),
        "command": command(launcher=launcher),
        **extra,
    }


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON (creating the folder) and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)
