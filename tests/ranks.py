"""Spawn the ranks of a CPU process group (``torch.multiprocessing.spawn``) so that a rank that
dies of a signal (SIGABRT from gloo, SIGSEGV) leaves its Python stacks behind: each rank writes
:mod:`faulthandler`'s dump to ``root/fault-rank{r}.txt`` and a failed spawn re-raises with them."""

from __future__ import annotations

import faulthandler
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

__all__ = ["spawn_ranks"]


def _rank(rank: int, fn: Callable[..., None], root: str, args: tuple[Any, ...]) -> None:
    with open(Path(root) / f"fault-rank{rank}.txt", "w") as dump:
        faulthandler.enable(file=dump, all_threads=True)
        try:
            fn(rank, root, *args)
        finally:  # the file closes next: no dump may go to its descriptor after that
            faulthandler.disable()


def spawn_ranks(fn: Callable[..., None], root: str | Path, nprocs: int, *args: Any) -> None:
    """``fn(rank, root, *args)`` in ``nprocs`` spawned processes; raise with the ranks' fault
    dumps when one fails."""
    try:
        mp.spawn(_rank, args=(fn, str(root), args), nprocs=nprocs, join=True)
    except mp.ProcessExitedException as exc:
        dumps = []
        for r in range(nprocs):
            path = Path(root) / f"fault-rank{r}.txt"
            text = path.read_text() if path.is_file() else ""
            if text.strip():
                dumps.append(f"--- rank {r} ---\n{text}")
        raise AssertionError(f"{exc}\n" + "\n".join(dumps)) from exc
