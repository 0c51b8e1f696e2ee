"""Where per-step metrics go: a JSONL file in the run directory and a log line.

A sink is any ``Callable[[int, dict[str, float]], None]`` called once per optimizer step with the
step number and that step's metrics; :class:`MetricsLog` writes both.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

MetricsSink = Callable[[int, dict[str, float]], None]
METRICS_NAME = "metrics.jsonl"

# shown in the one-line summary, in this order, when present
_HEADLINE = (
    ("reward/mean", "reward", "{:.3f}"),
    ("loss", "loss", "{:+.4f}"),
    ("entropy", "entropy", "{:.3f}"),
    ("mismatch/kl", "mm_kl", "{:.2e}"),
    ("clip/frac", "clip", "{:.3f}"),
    ("step/grad_norm", "gnorm", "{:.3f}"),
    ("step/tokens_per_s", "tok_s", "{:.0f}"),
    ("publish/delta_bytes", "delta_B", "{:.0f}"),
    ("publish/chained_bytes", "chained_B", "{:.0f}"),
    ("publish/density", "density", "{:.4f}"),
    ("time/data_wait_s", "wait_data", "{:.2f}s"),
    ("time/compute_s", "compute", "{:.2f}s"),
    ("time/publish_wait_s", "wait_pub", "{:.2f}s"),
)


class MetricsLog:
    """Appends one JSON object per step to ``<run_dir>/metrics.jsonl`` (``step``, ``time`` in
    Unix seconds, then every metric; non-finite values are written as ``null``) and logs a
    headline at INFO (unless ``log_headline`` is off: a rich console shows it instead). The file is flushed after every line, so a crash loses nothing."""

    def __init__(self, run_dir: str | Path, *, log_headline: bool = True) -> None:
        self.path = Path(run_dir) / METRICS_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.log_headline = log_headline

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        row: dict[str, float | int | None] = {"step": step, "time": time.time()}
        row.update({k: (v if math.isfinite(v) else None) for k, v in metrics.items()})
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row, separators=(",", ":")) + "\n")
        if self.log_headline:
            logger.info("step %d %s", step, headline(metrics))


def headline(metrics: dict[str, float]) -> str:
    """The few numbers worth a glance, e.g. ``reward=0.412 loss=-0.0123 ...``."""
    return " ".join(
        f"{label}={fmt.format(metrics[key])}" for key, label, fmt in _HEADLINE if key in metrics
    )


def read_metrics(run_dir: str | Path) -> list[dict[str, float | int | None]]:
    """Every row of a run's metrics file (for tests, notebooks and reports)."""
    path = Path(run_dir) / METRICS_NAME
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
