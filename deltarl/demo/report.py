"""What ``deltarl demo`` shows: the live view, the proof of identical weights, the summary and
the reward curve.

Sources: the coordinator (``/v1/status``, ``/v1/workers``, ``/v1/versions``), the workers' logs
(each applied object is logged with its size and the paused window), the bucket (manifests and
objects, to rebuild the final weights), the trainer's ``metrics.jsonl`` and its final checkpoint's
``trainer.json`` (the digest of the weights it ended with). Torch is imported only by
:func:`rebuild_digest`.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import statistics
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from deltarl.services.coordinator.schemas import StatusSummary, VersionManifest, WorkerInfo

logger = logging.getLogger(__name__)

# rollout/sync/weights.py logs one line per applied object.
_APPLIED = re.compile(
    r"weights at v(?P<version>\d+) via (?P<kind>\w+) \((?P<bytes>\d+) bytes\): "
    r"paused (?P<pause_ms>[\d.]+) ms"
)
_FAILED = re.compile(r"weights unhealthy|verification failed|VerificationError", re.IGNORECASE)


def human_bytes(n: float) -> str:
    """``1234567`` -> ``'1.23 MB'`` (decimal units)."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


@dataclass
class WorkerLog:
    """What one worker's log says about its syncs, read incrementally."""

    path: Path
    offset: int = 0
    applied: list[tuple[int, str, int, float]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def update(self) -> None:
        """Read the lines appended since the last call."""
        if not self.path.is_file():
            return
        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            chunk = fh.read()
        end = chunk.rfind(b"\n")
        if end < 0:
            return
        self.offset += end + 1
        for line in chunk[: end + 1].decode("utf-8", errors="replace").splitlines():
            m = _APPLIED.search(line)
            if m:
                self.applied.append(
                    (
                        int(m["version"]),
                        m["kind"],
                        int(m["bytes"]),
                        float(m["pause_ms"]),
                    )
                )
            elif _FAILED.search(line):
                self.failures.append(line.strip())

    @property
    def received_bytes(self) -> int:
        return sum(a[2] for a in self.applied)

    @property
    def last_pause_ms(self) -> float | None:
        deltas = [a[3] for a in self.applied if a[1] == "delta"]
        return deltas[-1] if deltas else None

    @property
    def pauses_ms(self) -> list[float]:
        return [a[3] for a in self.applied if a[1] == "delta"]


def live_view(
    status: StatusSummary | None,
    workers: list[WorkerInfo],
    logs: dict[str, WorkerLog],
    *,
    elapsed_s: float,
    steps: int,
    status_url: str,
    note: str,
) -> RenderableType:
    """One frame of the live progress."""
    head = Text.assemble(
        ("deltarl demo", "bold"), f"  {elapsed_s:5.0f} s  ", (note, "cyan"), f"  {status_url}"
    )
    if status is None:
        return Group(head, Text("waiting for the coordinator ..."))
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="dim")
    grid.add_column()
    latest = status.latest_version
    grid.add_row("version", f"{latest if latest is not None else '-'} (of {steps} steps)")
    if status.versions:
        last = status.versions[-1]
        ratio = last.full_bytes / last.bytes if last.bytes else float("inf")
        grid.add_row(
            "last version",
            f"{last.kind} {human_bytes(last.bytes)} vs full {human_bytes(last.full_bytes)} "
            f"({ratio:.1f}x smaller)",
        )
        shipped = sum(v.bytes for v in status.versions)
        full = sum(v.full_bytes for v in status.versions)
        grid.add_row("all versions", f"{human_bytes(shipped)} vs full syncs {human_bytes(full)}")
    pauses = [p for w in logs.values() for p in w.pauses_ms]
    if pauses:
        grid.add_row(
            "pause per sync",
            f"p50 {statistics.median(pauses):.1f} ms, max {max(pauses):.1f} ms "
            f"({len(pauses)} delta syncs)",
        )
    q = status.queue
    grid.add_row(
        "queue",
        f"{q.depth} waiting, {q.leased} leased, {q.submitted_total} submitted, "
        f"{q.acked_total} trained, dropped {sum(q.dropped.values())}",
    )
    hist = ", ".join(f"{k}: {v}" for k, v in sorted(status.staleness_hist.items()))
    grid.add_row("staleness", f"{hist or '-'} (bound {status.max_staleness})")
    if status.rewards:
        r = status.rewards[-1]
        grid.add_row("reward", f"{r.mean_reward:.3f} (v{r.version}, {r.groups} groups)")
    table = Table(title=None, expand=False)
    for col in ("worker", "state", "version", "lag", "weights", "received", "last pause"):
        table.add_column(col)
    for w in sorted(workers, key=lambda w: w.worker_id):
        log = logs.get(w.worker_id)
        verified = {True: "proven", False: "PROOF FAILED", None: "unproven"}[w.weights_verified]
        pause = log.last_pause_ms if log else None
        table.add_row(
            w.worker_id,
            w.state,
            "-" if w.applied_version is None else str(w.applied_version),
            "-" if w.lag_versions is None else str(w.lag_versions),
            verified,
            human_bytes(log.received_bytes) if log else "-",
            "-" if pause is None else f"{pause:.1f} ms",
        )
    return Group(head, grid, table)


def rebuild_digest(bucket_uri: str, version: int) -> tuple[str, list[str]]:
    """Rebuild ``version`` from the bucket (planner from nothing: anchor, then deltas, each
    checked against its base and result digests by the codec) and return its state digest and
    the keys applied."""
    from deltarl.weightsync.digest import state_digest

    state, keys = rebuild_state(bucket_uri, version)
    return state_digest(state), keys


def export_version(bucket_uri: str, version: int, model_dir: Path, out: Path) -> Path:
    """Version ``version`` of the bucket as a Hugging Face model directory ``out`` (the config
    and tokenizer of ``model_dir``, the run's model; the weights rebuilt from the bucket, as
    published): e.g. a trained policy to serve as a teacher (``deltarl teacher``)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    state, _ = rebuild_state(bucket_uri, version)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"v{version} does not fit {model_dir}: missing {missing}, {unexpected}")
    model.save_pretrained(out, safe_serialization=True)
    for f in model_dir.iterdir():  # the tokenizer's files
        if f.is_file() and not (out / f.name).exists() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    return out


def rebuild_state(bucket_uri: str, version: int) -> tuple[dict[str, Any], list[str]]:
    """The weights of ``version`` rebuilt from the bucket (see :func:`rebuild_digest`) and the
    keys applied."""
    from deltarl.buckets import open_bucket
    from deltarl.weightsync.anchor import decode_anchor
    from deltarl.weightsync.codec.context import DeltaContext
    from deltarl.weightsync.codec.formats import decode_delta
    from deltarl.weightsync.delta import apply_delta
    from deltarl.weightsync.reader import BucketReader

    reader = BucketReader(open_bucket(bucket_uri))
    plan = reader.plan(None, version)
    state: dict[str, Any] = {}
    context: DeltaContext | None = None  # of the delta applied last (chained deltas need it)
    for ref in plan.steps:
        data = reader.fetch(ref)
        if ref.kind == "anchor":
            state, _, _ = decode_anchor(data)
            context = None
        else:
            delta = decode_delta(data, state, check_base=True, context=context)
            context = DeltaContext.of(delta, state)
            apply_delta(state, delta, check_base=True, verify=True)
    return state, plan.keys


def trainer_final(trainer_dir: Path) -> dict[str, Any] | None:
    """``{"version", "state_digest"}`` of the trainer's last checkpoint, if it wrote one."""
    ckpt = trainer_dir / "checkpoints"
    pointer = ckpt / "latest"
    if not pointer.is_file():
        return None
    meta = json.loads((ckpt / pointer.read_text().strip() / "trainer.json").read_text())
    return {"version": int(meta["version"]), "state_digest": str(meta["state_digest"])}


def reward_series(trainer_dir: Path) -> list[tuple[int, float]]:
    """(step, mean reward of the trained batch) from the trainer's ``metrics.jsonl``."""
    path = trainer_dir / "metrics.jsonl"
    out: list[tuple[int, float]] = []
    if not path.is_file():
        return out
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        row = json.loads(line)
        value = row.get("reward/mean")
        if isinstance(value, int | float):
            out.append((int(row.get("step", i)), float(value)))
    return out


def draw_reward_curve(
    path: Path,
    trained: list[tuple[int, float]],
    by_version: list[tuple[int, float]],
    task: str = "wordle",
) -> str:
    """Write the reward curve as a PNG; returns the renderer used ('matplotlib' or 'plain').

    ``trained``: (step, mean reward of the groups trained on); ``by_version``: (policy version,
    mean reward of the groups it generated), from the coordinator.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("matplotlib is not installed: drawing a plain PNG without labels")
        plain_png(path, [trained, by_version])
        return "plain"
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if trained:
        ax.plot(*zip(*trained, strict=True), marker="o", label="trained batch (by step)")
    if by_version:
        ax.plot(*zip(*by_version, strict=True), marker="s", label="generated (by policy version)")
    ax.set_xlabel("optimizer step / policy version")
    ax.set_ylabel("mean reward")
    ax.set_title(f"deltarl demo: {'Wordle' if task == 'wordle' else task} reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return "matplotlib"


def plain_png(
    path: Path, series: list[list[tuple[int, float]]], w: int = 480, h: int = 270
) -> None:
    """A labelless line chart (axes, one colour per series) as an RGB PNG, without libraries."""
    pixels = bytearray(b"\xff" * (w * h * 3))
    colours = [(31, 119, 180), (255, 127, 14)]

    def put(x: int, y: int, c: tuple[int, int, int]) -> None:
        if 0 <= x < w and 0 <= y < h:
            i = (y * w + x) * 3
            pixels[i : i + 3] = bytes(c)

    def line(x0: int, y0: int, x1: int, y1: int, c: tuple[int, int, int]) -> None:
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for k in range(n + 1):
            put(round(x0 + (x1 - x0) * k / n), round(y0 + (y1 - y0) * k / n), c)

    pad = 20
    line(pad, h - pad, w - pad, h - pad, (0, 0, 0))
    line(pad, pad, pad, h - pad, (0, 0, 0))
    points = [p for s in series for p in s]
    if points:
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        x_lo, x_hi = min(xs), max(max(xs), min(xs) + 1)
        y_lo, y_hi = min(min(ys), 0.0), max(max(ys), 1e-9)

        def scale(p: tuple[int, float]) -> tuple[int, int]:
            x = pad + round((p[0] - x_lo) / (x_hi - x_lo) * (w - 2 * pad))
            y = h - pad - round((p[1] - y_lo) / (y_hi - y_lo) * (h - 2 * pad))
            return x, y

        for s, c in zip(series, colours, strict=False):
            for a, b in itertools.pairwise(s):
                line(*scale(a), *scale(b), c)
            for p in s:
                x, y = scale(p)
                for dx in (-1, 0, 1):
                    for dy in (-1, 0, 1):
                        put(x + dx, y + dy, c)
    raw = b"".join(b"\x00" + bytes(pixels[r * w * 3 : (r + 1) * w * 3]) for r in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
    path.write_bytes(png + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def published_manifests(bucket_uri: str) -> list[VersionManifest]:
    """Every manifest in the bucket (the one record of what each version stored), ascending."""
    from deltarl.buckets import open_bucket
    from deltarl.weightsync.reader import BucketReader

    manifests = BucketReader(open_bucket(bucket_uri)).manifests()
    return [manifests[v] for v in sorted(manifests)]


def bytes_summary(versions: list[VersionManifest], workers: int) -> dict[str, Any]:
    """Bytes published, and what a follower that applies every version downloads, against full
    syncs of every version; ``versions``: the bucket's manifests, ascending.

    A follower takes, per version, the cheapest delta from the version before (the chained one
    where there is one), or else the cheapest object (the first version: its anchor).
    ``published_bytes`` counts every object stored: anchors, standalone and chained deltas."""
    published = sum(o.size for v in versions for o in v.objects)
    anchors = sum(o.size for v in versions for o in v.anchors)
    follow_deltas = follow_anchors = delta_versions = 0
    for i, cur in enumerate(versions):
        prev = versions[i - 1].version if i else None
        sizes = [o.size for o in cur.deltas if prev is not None and o.base_version == prev]
        if sizes:
            follow_deltas += min(sizes)
            delta_versions += 1
        else:
            follow_anchors += min(o.size for o in cur.objects)
    follow = follow_anchors + follow_deltas
    full_model = versions[-1].full_bytes if versions else 0
    full_per_version = full_model * len(versions)
    return {
        "versions": len(versions),
        "anchors": sum(1 for v in versions if v.has_anchor),
        "published_bytes": published,
        "anchor_bytes": anchors,
        "stored_delta_bytes": published - anchors,
        "follower_bytes": follow,
        "delta_bytes": follow_deltas,
        "full_model_bytes": full_model,
        "full_sync_bytes_per_version": full_per_version,
        "full_sync_bytes_all_workers": full_per_version * workers,
        "ratio": full_per_version / follow if follow else None,
        # the versions a follower gets as deltas, against full syncs of those same versions
        "delta_versions": delta_versions,
        "delta_ratio": full_model * delta_versions / follow_deltas if follow_deltas else None,
    }
