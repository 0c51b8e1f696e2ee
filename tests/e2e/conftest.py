"""The e2e evidence tests' shared runs (e2e_runs.py): each distinct ``deltarl demo --tiny --task
charset`` run once per session. test_learning's run (seed 0, 20 steps) is also
test_distill_learning's GRPO baseline of seed 0: the same command, run once (~60 s on 2 cores)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from e2e_runs import CharsetRun, run_charset_demo


@pytest.fixture(scope="session")
def charset_grpo(
    tmp_path_factory: pytest.TempPathFactory, model_cache: Path
) -> Callable[[int, int], CharsetRun]:
    """``(seed, steps) -> CharsetRun``: each distinct run once per session."""
    runs: dict[tuple[int, int], CharsetRun] = {}

    def get(seed: int, steps: int) -> CharsetRun:
        if (seed, steps) not in runs:
            root = tmp_path_factory.mktemp(f"charset-grpo-{seed}-{steps}")
            run = run_charset_demo(root, model_cache, seed, steps)
            print(f"charset GRPO seed {seed}, {steps} steps: {run.seconds:.0f} s")
            runs[seed, steps] = run
        return runs[seed, steps]

    return get
