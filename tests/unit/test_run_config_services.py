"""``deltarl <service> --run-config exp.toml``: a service started on its own gets from the run
config what ``deltarl run`` gives it, and the environment cannot contradict the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deltarl.cli import app
from deltarl.run.config import RunConfigError, load_run_config
from deltarl.run.derive import Endpoints, RunLayout, Tokens
from deltarl.run.services import apply, service_env, worker_seed

EXP = """
[run]
model = "tiny-bytes"
temperature = 0.7
group_size = 4
max_staleness = 3
seed = 5

[env]
task = "charset"
charset_target = "0123456789"

[coordinator]
target_queue_groups = 4

[rollout]
workers = 3
max_new_tokens = 16

[trainer]
device = "cpu"
max_steps = 7
optimizer.lr = 1e-2
"""


@pytest.fixture
def exp(tmp_path: Path) -> Path:
    path = tmp_path / "exp.toml"
    path.write_text(EXP)
    return path


def launcher_env(path: Path, service: str) -> dict[str, str]:
    """What ``deltarl run`` sets for ``service``, deployment left out."""
    layout = RunLayout(
        load_run_config(path),
        Path("/tmp/unused"),
        "tiny-bytes",
        Endpoints("127.0.0.1", 1, 2),
        Tokens("t" * 32, "w" * 32, "e" * 32),
        "file:///tmp/unused",
    )
    launch = layout.worker(0) if service == "rollout" else getattr(layout, service)()
    deployment = ("_URL", "_TOKEN", "_WORKER_ID", "_SQLITE_PATH", "DELTARL_BUCKET_URI")
    return {k: v for k, v in launch.env.items() if not k.endswith(deployment)}


@pytest.mark.parametrize("service", ["coordinator", "env", "rollout"])
def test_a_service_gets_what_deltarl_run_gives_it(exp: Path, service: str) -> None:
    config = load_run_config(exp)
    mine = service_env(config, service, worker_id="w1")
    theirs = launcher_env(exp, service)
    if service == "rollout":  # each worker's engine seed: the launcher's by index, here by id
        assert mine.pop("DELTARL_ROLLOUT_ENGINE_SEED") == str(worker_seed(5, "w1"))
        theirs.pop("DELTARL_ROLLOUT_ENGINE_SEED")
        assert mine["DELTARL_ROLLOUT_TEMPERATURE"] == "0.7"
        assert mine["DELTARL_ROLLOUT_GROUP_SIZE"] == "4"
        assert "DELTARL_ROLLOUT_WORKERS" not in mine
    assert mine == theirs and mine


def test_workers_of_one_file_sample_differently_and_restart_alike() -> None:
    seeds = {worker_seed(5, f"w{i}") for i in range(64)}
    assert len(seeds) == 64 and all(0 <= s < 2**31 for s in seeds)
    assert worker_seed(5, "w1") == worker_seed(5, "w1") != worker_seed(6, "w1")


def test_the_environment_cannot_contradict_the_file(exp: Path) -> None:
    environ = {"DELTARL_ROLLOUT_TEMPERATURE": "1.0", "DELTARL_ROLLOUT_ENV_URL": "http://e:1"}
    with pytest.raises(
        RunConfigError, match=r"DELTARL_ROLLOUT_TEMPERATURE='1.0' \(the file: '0.7'\)"
    ):
        apply(exp, lambda c: service_env(c, "rollout", worker_id="w1"), environ)
    assert environ["DELTARL_ROLLOUT_TEMPERATURE"] == "1.0"  # nothing was set
    environ["DELTARL_ROLLOUT_TEMPERATURE"] = "0.7"  # the same value: fine
    values = apply(exp, lambda c: service_env(c, "rollout", worker_id="w1"), environ)
    assert (
        environ["DELTARL_ROLLOUT_MAX_NEW_TOKENS"]
        == "16"
        == values["DELTARL_ROLLOUT_MAX_NEW_TOKENS"]
    )
    assert environ["DELTARL_ROLLOUT_ENV_URL"] == "http://e:1"  # deployment stays the environment's


def test_an_invalid_file_names_the_section(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(EXP.replace("max_new_tokens = 16", "max_new_tokenz = 16"))
    with pytest.raises(RunConfigError, match=r"\[rollout\] unknown setting\(s\): max_new_tokenz"):
        apply(bad, lambda c: service_env(c, "env"), {})


def test_a_teacher_needs_its_section(exp: Path) -> None:
    with pytest.raises(RunConfigError, match=r"no \[teacher\] section"):
        apply(exp, lambda c: service_env(c, "teacher"), {})


def test_deltarl_train_takes_the_run_config(exp: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "trainer"
    result = CliRunner().invoke(
        app,
        ["train", "--run-config", str(exp), "--dry-run", "--set", f"run_dir={run_dir}"],
        env={"DELTARL_TRAINER_DEVICE": "cpu"},
    )
    assert result.exit_code == 0, result.output
    settings = json.loads((run_dir / "settings.json").read_text())
    assert settings["model"] == "tiny-bytes" and settings["max_steps"] == 7
    assert settings["batch"]["group_size"] == 4 and settings["batch"]["max_staleness"] == 3
    assert settings["sampling"]["temperature"] == 0.7 and settings["seed"] == 5
    assert settings["optimizer"]["lr"] == 1e-2


def test_deltarl_rollout_refuses_a_contradicting_environment_before_starting(exp: Path) -> None:
    result = CliRunner().invoke(
        app,
        ["rollout", "--run-config", str(exp), "--worker-id", "w1"],
        env={"DELTARL_ROLLOUT_GROUP_SIZE": "8", "COLUMNS": "400"},
    )
    assert result.exit_code == 2
    assert "DELTARL_ROLLOUT_GROUP_SIZE='8' (the file: '4')" in " ".join(result.output.split())


def test_train_takes_one_config_file(exp: Path) -> None:
    result = CliRunner().invoke(
        app,
        ["train", "--run-config", str(exp), "--config", str(exp), "--dry-run"],
        env={"COLUMNS": "400"},
    )
    assert result.exit_code == 2
    assert "--config and --run-config: give one or the other" in " ".join(result.output.split())
