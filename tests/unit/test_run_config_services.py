"""``deltarl <service> --run-config exp.toml``: a service started on its own gets from the run
config what ``deltarl run`` gives it, and the environment cannot contradict the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deltarl.cli import app
from deltarl.rollout.settings import WorkerExperiment
from deltarl.run.config import RunConfigError, load_run_config
from deltarl.run.derive import Endpoints, RunLayout, Tokens
from deltarl.run.services import apply, service_env, worker_config, worker_seed

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
in_flight_groups = 2
submit_timeout_s = 30.0
episodes.sampling.max_new_tokens = 16

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


def launcher_env(path: Path, service: str, run_dir: Path = Path("/tmp/unused")) -> dict[str, str]:
    """What ``deltarl run`` sets for ``service``, deployment left out."""
    layout = RunLayout(
        load_run_config(path),
        run_dir,
        "tiny-bytes",
        Endpoints("127.0.0.1", 1, 2),
        Tokens("t" * 32, "w" * 32, "e" * 32),
        "file:///tmp/unused",
    )
    launch = layout.worker(0) if service == "rollout" else getattr(layout, service)()
    deployment = ("_URL", "_TOKEN", "_WORKER_ID", "_SQLITE_PATH", "DELTARL_BUCKET_URI")
    return {k: v for k, v in launch.env.items() if not k.endswith(deployment)}


@pytest.mark.parametrize("service", ["coordinator", "env"])
def test_a_service_gets_what_deltarl_run_gives_it(exp: Path, service: str) -> None:
    config = load_run_config(exp)
    mine = service_env(config, service)
    assert mine == launcher_env(exp, service) and mine


def test_a_worker_gets_what_deltarl_run_gives_it(exp: Path, tmp_path: Path) -> None:
    """The same experiment file and deployment variables, but for the engine seed: the
    launcher's by worker index, here by worker id."""
    config = load_run_config(exp)
    mine = worker_config(config, tmp_path / "w1.json", "w1")
    theirs = launcher_env(exp, "rollout", tmp_path)
    assert mine == theirs == {"DELTARL_ROLLOUT_SUBMIT_TIMEOUT_S": "30.0"}
    ours = json.loads((tmp_path / "w1.json").read_text())
    launcher = json.loads((tmp_path / "worker-1.json").read_text())
    assert ours["engine"].pop("seed") == worker_seed(5, "w1")
    assert launcher["engine"].pop("seed") == 5 * 3 + 0
    assert ours == launcher
    experiment = WorkerExperiment.load(tmp_path / "w1.json")
    assert experiment.episodes.sampling.temperature == 0.7
    assert experiment.episodes.group_size == 4 and experiment.in_flight_groups == 2
    assert "workers" not in ours and "submit_timeout_s" not in ours


def test_workers_of_one_file_sample_differently_and_restart_alike() -> None:
    seeds = {worker_seed(5, f"w{i}") for i in range(64)}
    assert len(seeds) == 64 and all(0 <= s < 2**31 for s in seeds)
    assert worker_seed(5, "w1") == worker_seed(5, "w1") != worker_seed(6, "w1")


def test_the_environment_cannot_contradict_the_file(exp: Path, tmp_path: Path) -> None:
    environ = {"DELTARL_ENV_CHARSET_TARGET": "abc", "DELTARL_ROLLOUT_ENV_URL": "http://e:1"}
    with pytest.raises(
        RunConfigError, match=r"DELTARL_ENV_CHARSET_TARGET='abc' \(the file: '0123456789'\)"
    ):
        apply(exp, lambda c: service_env(c, "env"), environ)
    assert environ["DELTARL_ENV_CHARSET_TARGET"] == "abc"  # nothing was set
    environ["DELTARL_ENV_CHARSET_TARGET"] = "0123456789"  # the same value: fine
    values = apply(exp, lambda c: service_env(c, "env"), environ)
    assert environ["DELTARL_ENV_TASK"] == "charset" == values["DELTARL_ENV_TASK"]
    # a worker's deployment keys of [rollout] too; its experiment is the file's alone
    environ["DELTARL_ROLLOUT_SUBMIT_TIMEOUT_S"] = "99"
    with pytest.raises(RunConfigError, match=r"SUBMIT_TIMEOUT_S='99' \(the file: '30.0'\)"):
        apply(exp, lambda c: worker_config(c, tmp_path / "w.json", "w1"), environ)
    assert environ["DELTARL_ROLLOUT_ENV_URL"] == "http://e:1"  # deployment stays the environment's


def test_an_invalid_file_names_the_section(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(EXP.replace("in_flight_groups = 2", "in_flight_groupz = 2"))
    with pytest.raises(RunConfigError, match=r"\[rollout\] unknown setting\(s\): in_flight_groupz"):
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
        env={"DELTARL_ROLLOUT_SUBMIT_TIMEOUT_S": "8", "COLUMNS": "400"},
    )
    assert result.exit_code == 2
    assert "DELTARL_ROLLOUT_SUBMIT_TIMEOUT_S='8' (the file: '30.0')" in " ".join(
        result.output.split()
    )
    both = CliRunner().invoke(
        app,
        ["rollout", "--run-config", str(exp), "--config", str(exp)],
        env={"COLUMNS": "400"},
    )
    assert both.exit_code == 2 and "give one or the other" in " ".join(both.output.split())


def test_train_takes_one_config_file(exp: Path) -> None:
    result = CliRunner().invoke(
        app,
        ["train", "--run-config", str(exp), "--config", str(exp), "--dry-run"],
        env={"COLUMNS": "400"},
    )
    assert result.exit_code == 2
    assert "--config and --run-config: give one or the other" in " ".join(result.output.split())
