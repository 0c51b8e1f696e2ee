"""``prepare_model``: processes that prepare the same model at once all get the finished
directory (each builds in its own directory, the first rename wins), and build directories
left by dead processes are removed."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest

from deltarl.services.common.models import MARKER, prepare_model


def _prepare(cache: str, out: mp.Queue) -> None:  # type: ignore[type-arg]
    out.put(str(prepare_model("tiny", Path(cache))))


@pytest.mark.slow
def test_concurrent_preparations_of_one_model_all_succeed(tmp_path: Path) -> None:
    abandoned = tmp_path / "tiny-llama-fp32.tmp-999999999"  # a pid that cannot run
    abandoned.mkdir()
    (abandoned / "junk").write_text("x")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_prepare, args=(str(tmp_path), results)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    paths = {results.get(timeout=5) for _ in procs}
    assert len(paths) == 1
    out = Path(paths.pop())
    assert json.loads((out / MARKER).read_text())["kind"] == "tiny"
    assert not abandoned.exists()
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no build directory left
