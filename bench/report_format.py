"""What the sections of docs/benchmarks.md are made of: a result file (:class:`Result`), a
section (:class:`Section`), and the formatting every section's tables share (numbers, spreads as
``median [min-max]``, Markdown tables). bench/report.py renders the page."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Lines = list[str]


@dataclass(frozen=True)
class Result:
    """One result file: its name's parts, its data (a JSON line file: the list of its lines
    after the meta line) and its meta block."""

    path: Path
    benchmark: str
    hardware: str
    model: str
    data: Any
    meta: dict[str, Any]


def hardware_words(tag: str) -> str:
    """``cpu2`` -> ``2 CPU cores``, ``h100`` -> ``1x H100``, ``4xh200`` -> ``4x H200``."""
    if tag.startswith("cpu"):
        return f"{tag[3:]} CPU cores"
    count, _, gpu = tag.rpartition("x")
    return f"{count or 1}x {gpu.upper()}"


def by_name(r: Result) -> Any:
    return r.path.name


@dataclass(frozen=True)
class Section:
    """One section of the page: the benchmark (its files' name prefix), a title, a sentence or
    two on what it measures, the function that renders its results as lines of Markdown, and
    the order of its results (rows and runs)."""

    benchmark: str
    title: str
    about: str
    render: Callable[[list[Result]], Lines]
    key: Callable[[Result], Any] = by_name


def num(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def spread(values: Iterable[float | None], nd: int = 2, scale: float = 1.0) -> str:
    """``median [min-max]`` of the values (times ``scale``), or the one value."""
    xs = [scale * x for x in values if x is not None]
    if not xs:
        return "-"
    lo, hi, mid = min(xs), max(xs), statistics.median(xs)
    if len(xs) == 1 or num(lo, nd) == num(hi, nd):
        return num(mid, nd)
    return f"{num(mid, nd)} [{num(lo, nd)}-{num(hi, nd)}]"


def mean_spread(values: Iterable[float | None], nd: int = 2) -> str:
    """``mean [min-max]``: for the targets stated as an average."""
    xs = [x for x in values if x is not None]
    if not xs:
        return "-"
    return f"mean {num(statistics.fmean(xs), nd)} [{num(min(xs), nd)}-{num(max(xs), nd)}]"


def lr(x: float | str) -> str:
    """``1e-06`` -> ``1e-6``."""
    mantissa, _, exponent = f"{float(x):.0e}".partition("e")
    return f"{mantissa}e{int(exponent)}"


def pct(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{nd}f}%"


def pct_range(values: Iterable[float], nd: int = 2) -> str:
    xs = list(values)
    return f"{pct(min(xs), nd)}-{pct(max(xs), nd)}" if len(xs) > 1 else pct(xs[0], nd)


def mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:,.2f} MB"


def gb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:.2f} GB"


def table(header: list[str], rows: list[list[str]], after: str = "") -> Lines:
    """A Markdown table, and the paragraph ``after`` it when given."""
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]
    return [*lines, "", after] if after else lines


MODELS = {
    "smollm2-135m": "SmolLM2-135M-Instruct",
    "smollm2-135m-sft": "SmolLM2-135M-Instruct after `deltarl sft` on solver games",
    "qwen3-0.6b": "Qwen3-0.6B shape",
    "qwen3-0.6b-shape": "Qwen3-0.6B shape",
    "qwen3-0.6b-standalone": "Qwen3-0.6B shape, standalone deltas only",
    "smollm2-moe-8x135m": "SmolLM2-135M upcycled to 8 experts, top-2",
    "tiny-bytes": "tiny byte-level Llama",
    "llama-44m": "random 4-layer Llama (44.6 M)",
}


def gpus(r: Result) -> int:
    """The GPUs of a result's hardware tag (0 for CPUs)."""
    if r.hardware.startswith("cpu"):
        return 0
    count, _, _ = r.hardware.rpartition("x")
    return int(count or 1)


def label(r: Result) -> str:
    return f"{MODELS.get(r.model, r.model)}, {hardware_words(r.hardware)}"
