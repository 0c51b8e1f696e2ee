"""examples/wordle-shaped.toml: it checks, its shaping, curriculum and short moves
reach the services' settings, and a run config with truncated sampling is refused; the reward
presets of bench/gpu_wordle_full.sh reach the env server of the run bench/wordle_gpu_run.py starts
(deltarl.run.experiment)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from deltarl.cli import app
from deltarl.env_server.settings import EnvSettings
from deltarl.env_server.wordle.curriculum import GuessCurriculum
from deltarl.rollout.settings import RolloutSettings
from deltarl.run import experiment
from deltarl.run.config import RunConfigError, load_run_config
from deltarl.run.derive import Endpoints, RunLayout, Tokens
from deltarl.trainer.settings import ExperimentSettings

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "wordle-shaped.toml"
TOKENS = Tokens(trainer="t" * 40, worker="w" * 40, env="e" * 40)


def settings_from(env: dict[str, str], prefix: str) -> dict[str, str]:
    return {k.removeprefix(prefix).lower(): v for k, v in env.items() if k.startswith(prefix)}


def test_check_from_the_command_line() -> None:
    ok = CliRunner().invoke(app, ["run", str(EXAMPLE), "--check"])
    assert ok.exit_code == 0, ok.output
    resolved = json.loads(ok.output)
    assert resolved["env"]["guesses_start"] == 2
    assert resolved["rollout"]["episodes"]["env_options"]["shaping"]["format"] == 0.1


def test_the_services_get_shaping_curriculum_and_short_moves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load_run_config(EXAMPLE)
    layout = RunLayout(config, tmp_path, "m", Endpoints("h", 1, 2), TOKENS, "b")
    env = layout.env().env
    assert env["DELTARL_ENV_REWARD"] == "shaped"
    server = EnvSettings.model_validate(settings_from(env, "DELTARL_ENV_"))
    assert server.rules().shaping is not None and server.rules().shaping.format == 0.1
    assert server.curriculum() == GuessCurriculum(start=2, end=6, over_versions=30)
    worker = layout.worker(0)
    for key, value in worker.env.items():
        if key.startswith("DELTARL_ROLLOUT_"):
            monkeypatch.setenv(key, value)
    rollout = RolloutSettings(config=worker.args[worker.args.index("--config") + 1])
    episodes = rollout.experiment().episode_settings()
    assert episodes.env_options is not None
    assert episodes.env_options["shaping"]["greens"] == 0.2
    assert episodes.sampling.max_new_tokens == 10
    assert episodes.sampling.top_k == 0 and episodes.sampling.top_p == 1.0


@pytest.mark.parametrize(
    "override", ["rollout.episodes.sampling.top_k=20", "rollout.episodes.sampling.top_p=0.9"]
)
def test_truncated_sampling_is_refused(override: str) -> None:
    with pytest.raises(RunConfigError, match=r"top_k = 0 and top_p = 1\.0"):
        load_run_config(EXAMPLE).with_overrides([override])
    bad = CliRunner().invoke(app, ["run", str(EXAMPLE), "--check", "--set", override])
    assert bad.exit_code == 2 and "truncated sampling" in bad.output.replace("\n", " ")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.episodes.env_options={shaping={win=99}}", r"env_options\.shaping\.win"),
        ("rollout.episodes.env_options={max_guess=3}", r"env_options\.max_guess"),
        ("rollout.episodes.env_options={max_guesses=8}", r"max_turns \(7\) is below the 8 guesses"),
        ("env.guesses_start=0", r"\[env\] guesses_start"),
        ("env.shaping_format=-1", r"\[env\] shaping_format"),
        ("env.shaping_consistent=11", r"\[env\] shaping_consistent"),
        (
            "rollout.episodes.env_options={shaping={consistent=-1}}",
            r"env_options\.shaping\.consistent",
        ),
    ],
)
def test_bad_wordle_options_are_refused(override: str, message: str) -> None:
    with pytest.raises(RunConfigError, match=message):
        load_run_config(EXAMPLE).with_overrides([override])


def gpu_preset(reward: str, fill: str | None = None, summary: str | None = None) -> list[str]:
    """The ``--set`` overrides bench/gpu_wordle_full.sh passes for ``REWARD=reward`` (and
    ``FILL_UNPLAYED=fill``, ``SUMMARY=summary`` when given)."""
    script = (ROOT / "bench" / "gpu_wordle_full.sh").read_text()
    block = script[script.index("SHAPED=(") : script.index("EVAL=(")]
    out = subprocess.run(
        ["bash", "-c", block + '\nprintf "%s\\n" "${SHAPING[@]}"'],
        env={"REWARD": reward, "PATH": "/usr/bin:/bin"}
        | ({} if fill is None else {"FILL_UNPLAYED": fill})
        | ({} if summary is None else {"SUMMARY": summary}),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert out[::2] == ["--set"] * (len(out) // 2)
    return out[1::2]


@pytest.mark.parametrize(
    ("reward", "consistent", "fill"),
    [("shaped", 0.0, None), ("consistent", 0.3, None), ("consistent", 0.3, "false")],
)
def test_gpu_script_reward_presets_reach_the_env_server(
    tmp_path: Path, reward: str, consistent: float, fill: str | None
) -> None:
    sets = [arg for value in gpu_preset(reward, fill, "0") for arg in ("--set", value)]
    layout = bench_run_layout(tmp_path, *sets)
    server = EnvSettings.model_validate(settings_from(layout.env().env, "DELTARL_ENV_"))
    shaping = server.rules().shaping
    assert shaping is not None and not server.allow_non_words
    assert (shaping.win, shaping.greens, shaping.yellows, shaping.format) == (1.0, 0.2, 0.1, 0.05)
    assert (shaping.repetition, shaping.invalid, shaping.consistent) == (0.2, 0.1, consistent)
    assert shaping.fill_unplayed is (fill != "false")  # a win earns its unplayed guesses
    assert not server.feedback_summary


@pytest.mark.parametrize(("reward", "summary"), [("consistent", None), ("win", "1")])
def test_gpu_script_summary_reaches_the_env_server(
    tmp_path: Path, reward: str, summary: str | None
) -> None:
    # SUMMARY=1 is the script's default
    sets = [arg for value in gpu_preset(reward, summary=summary) for arg in ("--set", value)]
    layout = bench_run_layout(tmp_path, *sets)
    server = EnvSettings.model_validate(settings_from(layout.env().env, "DELTARL_ENV_"))
    assert server.feedback_summary and server.rules().feedback_summary


def bench_run_layout(tmp_path: Path, *argv: str) -> RunLayout:
    """The run bench/wordle_gpu_run.py builds from ``argv`` (its GPU arguments)."""
    args = experiment.parse_args(["--run-dir", str(tmp_path), "--engine", "vllm", *argv])
    config = experiment.run_config(args)
    return RunLayout(config, tmp_path, "m", Endpoints("h", 1, 2), TOKENS, "b")


@pytest.mark.parametrize(
    ("argv", "size", "tokens"),
    [((), 16, None), (("--micro-batch-size", "8", "--micro-batch-tokens", "4096"), 8, 4096)],
)
def test_gpu_run_trainer_micro_batches(
    tmp_path: Path, argv: tuple[str, ...], size: int, tokens: int | None
) -> None:
    # one micro-batch of the whole step (64 games) ran the trainer out of memory
    # beside its vLLM worker; the trainer reads what the layout writes to trainer.json
    launch = bench_run_layout(tmp_path, "--groups-per-step", "8", *argv).trainer()
    written = json.loads(Path(launch.args[launch.args.index("--config") + 1]).read_text())
    batch = ExperimentSettings.model_validate(written).batch
    assert (batch.groups_per_step, batch.micro_batch_size) == (8, size)
    assert batch.micro_batch_tokens == tokens


def suite_wordle_args() -> list[str]:
    """The arguments bench/gpu_vllm_suite.sh gives bench/wordle_gpu_run.py (its WORDLE array)."""
    script = (ROOT / "bench" / "gpu_vllm_suite.sh").read_text()
    start = script.index("WORDLE=(")
    block = script[start : script.index(")\n", start) + 2]
    return subprocess.run(
        ["bash", "-c", block + 'printf "%s\\n" "${WORDLE[@]}"'],
        env={"SECONDS_RUN": "150", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()


def test_the_suites_default_reward_pays_nothing_for_a_repeated_or_invalid_guess(
    tmp_path: Path,
) -> None:
    """The whole-system run of the GPU suite: a run whose reward paid format credit for the
    game (a valid move, then repeats until the forfeit) learned to repeat one word. Under the
    suite's default reward, as its env server answers: a new valid guess scores, a repeated
    one and an invalid one earn exactly 0, and so does the forfeit they lead to."""
    from fastapi.testclient import TestClient

    from deltarl.env_server.core.app import create_app

    args = suite_wordle_args()
    assert "--format-credit" not in args and "--reward" not in args  # the bench's default
    layout = bench_run_layout(tmp_path, *args)
    server = EnvSettings.model_validate(settings_from(layout.env().env, "DELTARL_ENV_"))
    assert server.reward == "shaped" and not server.allow_repeats
    with TestClient(create_app(server), headers={"X-Deltarl-Token": TOKENS.env}) as client:

        def play(*moves: str) -> list[tuple[float, bool]]:
            reset = client.post("/reset", json={"seed": 3})
            assert reset.status_code == 200, reset.text
            sid, out = reset.json()["session_id"], []
            for move in moves:
                got = client.post("/step", json={"session_id": sid, "action": {"message": move}})
                out.append((got.json()["reward"], got.json()["done"]))
            return out

        (first, _), (repeated, _), (forfeit, done) = play("[crane]", "[crane]", "[crane]")
        assert first >= 0.05 and repeated == 0.0 and forfeit == 0.0 and done
        (invalid, _), (new, _), (forfeit, done) = play("crane?", "[slate]", "no guess")
        assert invalid == 0.0 and new >= 0.05 and forfeit == 0.0 and done


def test_the_gpu_run_refuses_format_credit_under_the_shaped_reward(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        experiment.parse_args(["--run-dir", str(tmp_path), "--format-credit", "0.5"])
    layout = bench_run_layout(tmp_path, "--reward", "final", "--format-credit", "0.5")
    server = EnvSettings.model_validate(settings_from(layout.env().env, "DELTARL_ENV_"))
    assert (server.reward, server.format_credit) == ("final", 0.5)


def wordle_gpu_run() -> Any:
    """bench/wordle_gpu_run.py as a module (its sibling bench/common.py on the path, as when
    it runs as a script)."""
    path = ROOT / "bench" / "wordle_gpu_run.py"
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("bench_wordle_gpu_run", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_warm_started_runs_result_is_named_by_the_model_it_started_from(tmp_path: Path) -> None:
    """The suite's system step runs GRPO from a ``deltarl sft`` output: its result is
    SmolLM2's, marked ``-sft``, not the output directory's name."""
    bench = wordle_gpu_run()
    sft = tmp_path / "sft"
    sft.mkdir()
    base = tmp_path / "cache" / "smollm2-135m-instruct"
    (sft / "sft.json").write_text(json.dumps({"settings": {"model": str(base)}, "losses": []}))
    args = experiment.parse_args(["--run-dir", str(tmp_path / "run"), "--engine", "vllm"])
    assert bench.model_name(args) == "smollm2-135m"
    args.model = str(sft)
    assert bench.model_name(args) == "smollm2-135m-sft"
    args.device = "cpu"  # the hardware tag is the machine's: no GPU here
    assert bench.default_result(args).name.endswith("_smollm2-135m-sft-vllm.json")
    (sft / "sft.json").unlink()  # another model directory: its own name
    assert bench.model_name(args) == "sft"
