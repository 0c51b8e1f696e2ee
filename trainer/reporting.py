"""Where each step's metrics are shown: the console (rich or plain) and experiment trackers.

:func:`build_reporter` composes, from ``settings.report``:

* :class:`~.metrics.MetricsLog`: ``<run_dir>/metrics.jsonl``, always (the source of truth);
* the console: with ``console = "rich"`` (or ``"auto"`` and stdout a terminal),
  :class:`RichProgress` prints one table row per step (progress, ETA, the headline numbers);
  otherwise :class:`~.metrics.MetricsLog` logs one plain line per step;
* one :class:`TrackerSink` per entry of ``report.to`` (``"trackio"``, ``"wandb"``): the module is
  imported only then; :func:`check_trackers` fails early, with the package to install, when it
  is missing.

The :class:`Reporter` is itself a :data:`~.metrics.MetricsSink` (``reporter(step, metrics)``);
call :meth:`Reporter.close` at the end (it finishes the trackers' runs). Torch-free.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deltarl.trainer.metrics import MetricsLog, MetricsSink
from deltarl.trainer.settings import ExperimentSettings

logger = logging.getLogger(__name__)

__all__ = ["Reporter", "RichProgress", "TrackerSink", "build_reporter", "check_trackers"]

# shown by RichProgress, in this order, when present: (metric, header, format)
_COLUMNS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("loss", "loss", "{:+.4f}"),
    ("entropy", "entropy", "{:.3f}"),
    ("mismatch/kl", "mm_kl", "{:.1e}"),
    ("clip/frac", "clip", "{:.3f}"),
    ("step/grad_norm", "gnorm", "{:.3f}"),
    ("step/tokens_per_s", "tok/s", "{:.0f}"),
    ("time/data_wait_s", "data", "{:.2f}s"),
    ("time/compute_s", "compute", "{:.2f}s"),
    ("time/publish_wait_s", "publish", "{:.2f}s"),
    ("publish/delta_bytes", "delta", "{}"),
    ("publish/density", "density", "{:.2%}"),
)

_PACKAGES = {"trackio": "trackio", "wandb": "wandb"}  # tracker -> package to install


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    raise AssertionError("unreachable")


class RichProgress:
    """One rich table row per step: ``step/max``, ETA, and the numbers of :data:`_COLUMNS`.

    Rows are printed (not redrawn in place), so log lines interleave cleanly; the header comes
    back every ``header_every`` rows.
    """

    def __init__(self, max_steps: int, console: Any = None, header_every: int = 20) -> None:
        from rich.console import Console

        self.console = console if console is not None else Console()
        self.max_steps = max_steps
        self.header_every = header_every
        self._rows = 0
        self._t0: float | None = None
        self._first_step: int | None = None

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        from rich.table import Table

        now = time.monotonic()
        if self._t0 is None or self._first_step is None:
            self._t0, self._first_step = now, step - 1
        done = step - self._first_step
        eta = (now - self._t0) / max(done, 1) * max(self.max_steps - step, 0)
        table = Table(box=None, show_header=self._rows % self.header_every == 0, pad_edge=False)
        table.add_column("step", justify="right", min_width=len(str(self.max_steps)) * 2 + 1)
        table.add_column("eta", justify="right", min_width=7)
        cells = [f"{step}/{self.max_steps}", f"{eta / 60:.1f}m" if now > self._t0 else "-"]
        for key, header, fmt in _COLUMNS:
            table.add_column(header, justify="right", min_width=max(len(header), 8))
            value = metrics.get(key)
            if value is None or not math.isfinite(value):
                cells.append("-")
            elif key == "publish/delta_bytes":
                cells.append(_bytes(value))
            else:
                cells.append(fmt.format(value))
        table.add_row(*cells)
        self.console.print(table)
        self._rows += 1


def check_trackers(targets: list[str]) -> None:
    """Raise ``ValueError`` naming the package to install for each tracker that is missing."""
    missing = [
        t
        for t in targets
        if _PACKAGES[t] not in sys.modules and importlib.util.find_spec(_PACKAGES[t]) is None
    ]
    if missing:
        raise ValueError(
            f"report.to lists {', '.join(missing)} but it is not installed: pip install "
            f"{' '.join(_PACKAGES[t] for t in missing)} (or remove it from report.to)"
        )


class TrackerSink:
    """Logs every step to an experiment tracker with the ``init``/``log``/``finish`` API that
    trackio and wandb share: ``init(project=, name=, config=)`` once (the resolved settings are
    the config), ``log(metrics, step=step)`` per step (non-finite values left out),
    ``finish()`` on :meth:`close`."""

    def __init__(self, name: str, settings: ExperimentSettings) -> None:
        check_trackers([name])
        self.name = name
        self.module: Any = importlib.import_module(_PACKAGES[name])
        run_name = settings.report.run_name or Path(settings.run_dir).name
        kwargs: dict[str, Any] = {
            "project": settings.report.project,
            "name": run_name,
            "config": settings.model_dump(mode="json"),
        }
        if name == "wandb":
            kwargs["dir"] = settings.run_dir
        self.module.init(**kwargs)

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: v for k, v in metrics.items() if math.isfinite(v)}
        self.module.log(clean, step=step)

    def close(self) -> None:
        self.module.finish()


class Reporter:
    """Calls every sink in order; :meth:`close` closes those that can be closed. A failing
    tracker is logged and dropped (the JSONL file is the source of truth; a tracker outage
    must not stop training)."""

    def __init__(self, sinks: list[MetricsSink]) -> None:
        self.sinks = list(sinks)

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        for sink in list(self.sinks):
            if isinstance(sink, TrackerSink):
                try:
                    sink(step, metrics)
                except Exception:
                    logger.exception("%s failed: no more metrics go to it", sink.name)
                    self.sinks.remove(sink)
            else:
                sink(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            close: Callable[[], None] | None = getattr(sink, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:
                    logger.exception("closing %s failed", type(sink).__name__)

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _use_rich(mode: str, stream: Any) -> bool:
    if mode == "auto":
        return bool(getattr(stream, "isatty", lambda: False)())
    return mode == "rich"


def build_reporter(settings: ExperimentSettings, *, console: Any = None) -> Reporter:
    """The sinks of ``settings.report`` (see the module docstring). ``console``: a
    ``rich.console.Console`` to print to (tests); None: stdout."""
    rich = _use_rich(settings.report.console, sys.stdout) or console is not None
    sinks: list[MetricsSink] = [MetricsLog(settings.run_dir, log_headline=not rich)]
    if rich:
        sinks.append(RichProgress(settings.max_steps, console))
    for target in dict.fromkeys(settings.report.to):
        sinks.append(TrackerSink(target, settings))
    return Reporter(sinks)
