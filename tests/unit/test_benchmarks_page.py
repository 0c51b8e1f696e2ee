"""docs/benchmarks.md is generated from bench/results/ by bench/report.py and must match them;
every result file is named ``<benchmark>_<hardware>_<model>.json`` with a meta block, and a new
one renders as soon as it is there."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REPORT = ROOT / "bench" / "report.py"
RESULTS = ROOT / "bench" / "results"


def report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPORT), *args], capture_output=True, text=True, timeout=120
    )


def test_benchmarks_page_is_up_to_date() -> None:
    got = report("--check")
    assert got.returncode == 0, (
        "docs/benchmarks.md is stale or a result file is malformed: run "
        f"`python bench/report.py --write`\n{got.stderr[-3000:]}"
    )


def test_the_page_shows_each_results_date_machine_and_command() -> None:
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        meta = data.get("meta")
        if meta is None:  # written before the scripts wrote one: the page reads the top level
            continue
        assert f"[`{path.name}`]" in page
        assert meta["date"] in page and meta["machine"] in page, path.name


def copy_of_results(tmp_path: Path) -> Path:
    out = tmp_path / "results"
    shutil.copytree(RESULTS, out, ignore=shutil.ignore_patterns("*.log", "*.md", "*.tgz"))
    return out


def test_a_new_result_file_renders_without_touching_the_generator(tmp_path: Path) -> None:
    results = copy_of_results(tmp_path)
    source = results / "trainer_memory_h100_smollm2-135m.json"
    data = json.loads(source.read_text())
    data["meta"] |= {"date": "2031-01-02", "machine": "8x NVIDIA B200 of a test"}
    data["rows"] = data["rows"][:1]
    (results / "trainer_memory_8xb200_smollm2-135m.json").write_text(json.dumps(data))
    got = report("--results", str(results))
    assert got.returncode == 0, got.stderr
    assert "8x B200" in got.stdout and "2031-01-02, 8x NVIDIA B200 of a test" in got.stdout


def test_a_result_no_section_renders_or_without_meta_is_refused(tmp_path: Path) -> None:
    results = copy_of_results(tmp_path)
    (results / "warp_drive_h100_smollm2-135m.json").write_text('{"meta": {}}')
    got = report("--results", str(results))
    assert got.returncode != 0 and "no section renders" in got.stderr
    (results / "warp_drive_h100_smollm2-135m.json").unlink()
    (results / "codec_cpu2_other.json").write_text('{"results": {}}')
    got = report("--results", str(results))
    assert got.returncode != 0 and "no 'date'" in got.stderr
    (results / "codec_cpu2_other.json").unlink()
    (results / "codec_somewhere_smollm2-135m.json").write_text('{"results": {}}')
    got = report("--results", str(results))
    assert got.returncode != 0 and "hardware like cpu2, h100, 4xh100" in got.stderr


def test_gpu_test_logs_become_a_result(tmp_path: Path) -> None:
    log = tmp_path / "fp8.log"
    log.write_text(
        "=== fp8: timeout 600 python3 -m pytest -q tests/rollout/test_vllm_fp8_gpu.py\n"
        "....F\n"
        "FAILED tests/rollout/test_vllm_fp8_gpu.py::test_one[2]\n"
        "1 failed, 3 passed, 1 skipped, 14 warnings in 55.86s\n"
    )
    out = tmp_path / "gpu_tests_h200_vllm.json"
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_tests_result.py"), str(log)]
    cmd += ["--hardware", "h200", "--machine", "1x NVIDIA H200", "--date", "2031-01-02"]
    subprocess.run([*cmd, "--out", str(out)], check=True, capture_output=True, timeout=60)
    (run,) = json.loads(out.read_text())["runs"]
    assert run["command"] == "python3 -m pytest -q tests/rollout/test_vllm_fp8_gpu.py"
    assert run["result"] == "1 failed, 3 passed, 1 skipped, 56 s"
    assert run["failed"] == ["tests/rollout/test_vllm_fp8_gpu.py::test_one[2]"]
    assert run["date"] == "2031-01-02"

    # a later run of the same tests (and more) replaces it; another selection stays beside it
    log.write_text(
        "=== fp8: VLLM_USE_DEEP_GEMM=0 timeout 300 python3 -m pytest -q -o x=1 "
        "tests/rollout/test_vllm_fp8_gpu.py tests/rollout/test_fp8_sync.py\n7 passed in 9.0s\n"
    )
    other = tmp_path / "tp.log"
    other.write_text(
        "=== tp: python3 -m pytest -q tests/rollout/test_vllm_fp8_gpu.py -k tp\n2 passed in 3s\n"
    )
    subprocess.run([*cmd[:2], str(log), str(other), *cmd[3:], "--out", str(out)], check=True)
    runs = json.loads(out.read_text())["runs"]
    assert [r["result"] for r in runs] == ["7 passed, 9 s", "2 passed, 3 s"]


def test_a_wordle_arms_run_becomes_a_result_the_page_renders(tmp_path: Path) -> None:
    # a bench/gpu_wordle_arms.sh results directory, rebuilt from the current plain result
    current = json.loads((RESULTS / "wordle_grpo_2xh100_smollm2-135m-plain.json").read_text())
    res = tmp_path / "res"
    (res / "prep").mkdir(parents=True)
    for name, data in current["prep"].items():
        (res / "prep" / f"{name}.json").write_text(json.dumps(data))
    for arm, data in current["arms"].items():
        (res / arm).mkdir()
        (res / arm / "eval_grpo.json").write_text(json.dumps(data["eval_grpo"] | {"examples": []}))
        summary = {k: v for k, v in data.items() if k != "eval_grpo"}
        (res / arm / "grpo_summary.json").write_text(json.dumps(summary))
    results = copy_of_results(tmp_path)
    out = results / "wordle_grpo_2xh100_smollm2-135m-plain.json"
    cmd = [sys.executable, str(ROOT / "bench" / "wordle_grpo_result.py"), str(res)]
    cmd += ["--gpus", "2", "--hardware", "2xh100", "--machine", "2x H100", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)
    written = json.loads(out.read_text())
    assert written["arms"].keys() == current["arms"].keys()
    assert "examples" not in written["arms"]["long"]["eval_grpo"]
    got = report("--results", str(results))
    assert got.returncode == 0, got.stderr
    assert "plain feedback: + GRPO at lr 1e-5 (`long`) | 228 |" in got.stdout


@pytest.mark.slow
def test_the_1t_extrapolation_reruns_to_its_committed_numbers(tmp_path: Path) -> None:
    """bench/fp8_1t_table.py computes from named result files: a rerun gives the committed
    result's inputs and rows (only the date and the note can differ)."""
    out = tmp_path / "fp8_1t.json"
    cmd = [sys.executable, str(ROOT / "bench" / "fp8_1t_table.py"), "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120, cwd=ROOT / "bench")
    got = json.loads(out.read_text())
    committed = json.loads((RESULTS / "fp8_1t_h200_kimi-k2-extrapolated.json").read_text())
    assert got["inputs"] == committed["inputs"] and got["rows"] == committed["rows"]
