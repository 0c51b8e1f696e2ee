"""bench/decode_host_bench.py and bench/encode_rank_bench.py run at a tiny size and report what
they claim (the GPU hosts' runs use the same code at 4 G elements and a Qwen3-30B-A3B rank)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_moe_benches import run


@pytest.mark.slow
def test_the_decoder_bench_times_every_thread_count_mode_and_neighbour(tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    run(
        "decode_host_bench.py",
        *("--elements", "4e6", "--tensors", "8", "--threads", "1", "2", "--rounds", "2"),
        *("--modes", "gaps", "--pinned", "--json", str(out)),
    )
    result = json.loads(out.read_text())
    rows = result["results"]
    assert sorted(rows) == ["gaps/1", "gaps/1+busy", "gaps/2", "gaps/2+busy"]
    assert 0.005 < result["changed"] / result["numel"] < 0.02  # --density 0.01
    for key, row in rows.items():
        med = row["decode_s"]["median"]
        assert row["threads"] == int(key.split("/")[1].split("+")[0])
        assert len(row["decode_s"]["all"]) == 2
        assert row["thread_ns_per_change"] == pytest.approx(
            row["threads"] * med / result["changed"] * 1e9
        )
        assert 6 < row["bits_per_changed"] < 16

    parts = tmp_path / "parts.json"
    run(
        "decode_host_bench.py",
        *("--elements", "4e6", "--tensors", "8", "--parts", "2", "--threads", "2"),
        *("--rounds", "2", "--no-busy", "--json", str(parts)),
    )
    assert sorted(json.loads(parts.read_text())["results"]) == [
        "at once/2",
        "one after another/2",
    ]


@pytest.mark.slow
def test_the_encoder_bench_encodes_a_moe_rank_from_its_scans_as_gaps(tmp_path: Path) -> None:
    out = tmp_path / "encode.json"
    run(
        "encode_rank_bench.py",
        *("--preset", "moe", "--layers", "1", "--moved", "0.01", "--positions", "gaps"),
        *("--threads", "1", "2", "--reps", "1", "--json", str(out)),
    )
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert 0.005 < summary["changed"] / 311_363_136 < 0.02  # one layer's rows, embeddings, head
    assert set(summary) >= {"encode_s_median_1_threads", "encode_s_median_2_threads"}
    timed = [r for r in result["reps"] if r["rep"]]
    assert [r["threads"] for r in timed] == [1, 2]
    for r in timed:  # the one-call gap analysis is what ran, and it was timed
        assert r["analyse_scan_by_gaps_s"] > 0 and "analyse_chunk_s" not in r
