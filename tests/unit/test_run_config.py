"""The run config (deltarl/run): one file for a whole run, shared values declared once, every
service's settings derived from it and checked by that service's own settings class."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from deltarl.cli import app
from deltarl.demo.plan import DemoPlan
from deltarl.env_server.settings import EnvSettings
from deltarl.rollout.settings import RolloutSettings, WorkerExperiment
from deltarl.run.config import (
    LAUNCHER_FIELDS,
    SHARED_FIELDS,
    RunConfig,
    RunConfigError,
    load_run_config,
)
from deltarl.run.derive import Endpoints, RunLayout, ServiceLaunch, Tokens, derive
from deltarl.services.coordinator.settings import CoordinatorSettings
from deltarl.trainer.settings import ExperimentSettings, TrainerDeployment

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))
TOKENS = Tokens(trainer="t" * 40, worker="w" * 40, env="e" * 40)


def derived(config: RunConfig, tmp_path: Path) -> dict[str, Any]:
    """The run's launches by name, derived with the tests' endpoints, tokens and bucket."""
    launches = derive(
        config,
        run_dir=tmp_path,
        model="/models/m",
        endpoints=Endpoints("127.0.0.1", 8700, 8001),
        tokens=TOKENS,
        bucket_uri=str(tmp_path / "bucket"),
    )
    return {x.name: x for x in launches}


def config_file(launch: Any) -> Path:
    """The experiment file a launch is started with (its ``--config``)."""
    return Path(launch.args[launch.args.index("--config") + 1])


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "exp.toml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_parses_and_checks(path: Path) -> None:
    config = load_run_config(path)
    assert config.workers >= 1


@pytest.mark.parametrize(
    ("name", "tiny", "task"),
    [
        ("demo.toml", False, "capitals"),
        ("demo-wordle.toml", False, "wordle"),
        ("charset-tiny.toml", True, "charset"),
    ],
)
def test_the_demo_presets_are_the_example_files(name: str, tiny: bool, task: str) -> None:
    """`deltarl demo` is a preset of the run config: its plan and the example file agree."""
    plan = DemoPlan.for_model(tiny, None, 2, task)  # type: ignore[arg-type]
    assert plan.run_config().model_dump() == load_run_config(ROOT / "examples" / name).model_dump()


@pytest.mark.parametrize(
    ("section", "key"),
    [(s, k) for s, keys in SHARED_FIELDS.items() for k in keys],
)
def test_a_shared_value_set_in_a_service_section_is_refused(
    tmp_path: Path, section: str, key: str
) -> None:
    *parents, leaf = key.split(".")
    table = ".".join([section, *parents])
    path = write(tmp_path, f"[{table}]\n{leaf} = 3\n")
    with pytest.raises(RunConfigError, match=rf"\[{section}\] {key}: declared once .* \[run\]"):
        load_run_config(path)


@pytest.mark.parametrize(
    ("section", "key"), [(s, k) for s, keys in LAUNCHER_FIELDS.items() for k in sorted(keys)]
)
def test_launcher_values_are_refused(tmp_path: Path, section: str, key: str) -> None:
    path = write(tmp_path, f'[{section}]\n{key} = "x"\n')
    with pytest.raises(RunConfigError, match=rf"\[{section}\] {key}: set by the launcher"):
        load_run_config(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[env]\nmax_gueses = 2\n", r"\[env\] unknown setting\(s\): max_gueses"),
        (
            "[rollout]\nepisodes.sampling.max_new_tokens = 0\n",
            r"\[rollout\] episodes.sampling.max_new_tokens: .*greater than",
        ),
        ("[rollout]\nmax_new_tokens = 8\n", r"\[rollout\] max_new_tokens: now episodes.sampling"),
        ("[rollout]\nhint_mode = 'env'\n", r"\[rollout\] hint_mode: now hints.mode"),
        ('[rollout]\nengine = "vllm"\n', r"\[rollout\] engine: now engine.type"),
        ("[rollout]\nengine.type = 'tpu'\n", r"\[rollout\] engine: .*tag 'tpu'"),
        ("[rollout]\nworkers = 0\n", r"\[rollout\] workers: an integer from 1 to 64"),
        ('[coordinator]\nstore = "mongo"\n', r"\[coordinator\] store: "),
        ("[trainer]\noptimizer.lr = -1\n", r"\[trainer\] optimizer.lr: .*greater than 0"),
        ("[trainer]\nbatch.group_sise = 2\n", r"\[trainer\] batch.group_sise: Extra inputs"),
        ("[run]\ngroup_size = 0\n", r"run.group_size: .*greater than or equal to 1"),
        ('[run]\nmodle = "x"\n', r"run.modle: Extra inputs"),
        ("[runn]\n", r"runn: Extra inputs"),
        ("[run\n", r"not valid TOML"),
    ],
)
def test_bad_configs_say_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(RunConfigError, match=message):
        load_run_config(write(tmp_path, text))


def test_overrides() -> None:
    config = load_run_config(ROOT / "examples" / "demo.toml")
    out = config.with_overrides(
        ["trainer.max_steps=3", 'run.model="tiny"', "trainer.optimizer.lr=1e-3", "env.task=charset"]
    )
    assert out.trainer["max_steps"] == 3 and out.run.model == "tiny"
    assert out.trainer["optimizer"]["lr"] == 1e-3 and out.env["task"] == "charset"
    assert config.trainer["max_steps"] == 10  # the original is untouched
    with pytest.raises(RunConfigError, match=r"SECTION\.KEY=VALUE"):
        config.with_overrides(["max_steps=3"])
    with pytest.raises(RunConfigError, match=r"\[rollout\] temperature: declared once"):
        config.with_overrides(["rollout.temperature=0.7"])


def test_every_service_receives_the_shared_values_from_one_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Derive a run, then read each process's environment with that service's own settings
    class (as the process would): model, temperature, group size, staleness bound, seeds,
    tokens and the bucket agree everywhere."""
    config = load_run_config(ROOT / "examples" / "demo-wordle.toml").with_overrides(
        ["run.temperature=0.7", "run.group_size=5", "run.max_staleness=3", "run.seed=2"]
    )
    by = derived(config, tmp_path)
    assert list(by) == ["coordinator", "env", "worker-1", "worker-2", "trainer"]

    def settings(cls, env):  # type: ignore[no-untyped-def]
        for name in list(__import__("os").environ):
            if name.startswith("DELTARL_"):
                monkeypatch.delenv(name)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        return cls()

    coord = settings(CoordinatorSettings, by["coordinator"].env)
    env = settings(EnvSettings, by["env"].env)
    workers = [settings(RolloutSettings, by[w].env) for w in ("worker-1", "worker-2")]
    experiments = [WorkerExperiment.load(config_file(by[w])) for w in ("worker-1", "worker-2")]
    deploy = settings(TrainerDeployment, by["trainer"].env)
    exp_file = config_file(by["trainer"])
    exp = ExperimentSettings.load(exp_file)

    assert coord.max_staleness == exp.batch.max_staleness == 3
    assert coord.trainer_token == deploy.token.get_secret_value() == TOKENS.trainer  # type: ignore[union-attr]
    assert env.token.get_secret_value() == TOKENS.env  # type: ignore[union-attr]
    assert env.max_guesses == 1 and env.task == "wordle"
    for i, (w, we) in enumerate(zip(workers, experiments, strict=True)):
        engine, episodes = we.engine_settings(), we.episodes
        assert engine.model == exp.model == "/models/m"
        assert episodes.sampling.temperature == exp.sampling.temperature == 0.7
        assert episodes.group_size == exp.batch.group_size == 5
        assert engine.seed == 2 * 2 + i and exp.seed == 2
        assert w.worker_token.get_secret_value() == coord.worker_token == TOKENS.worker  # type: ignore[union-attr]
        assert w.env_token.get_secret_value() == TOKENS.env  # type: ignore[union-attr]
        assert w.coordinator_url == "http://127.0.0.1:8700" and w.env_url == "http://127.0.0.1:8001"
        assert episodes.sampling.max_new_tokens == 32 and episodes.max_turns == 2
        assert we.turn_limit(None) == 2  # set: the env server is not asked
    for launch in by.values():
        assert launch.env["DELTARL_BUCKET_URI"] == str(tmp_path / "bucket")
    assert exp.max_steps == 8 and exp.batch.micro_batch_size == 12
    assert json.loads(exp_file.read_text())["run_dir"] == str(tmp_path / "trainer")


def test_a_layout_starts_single_services_with_their_own_ids_and_seeds(tmp_path: Path) -> None:
    config = RunConfig.model_validate({"rollout": {"workers": 3}, "run": {"seed": 1}})
    layout = RunLayout(config, tmp_path, "m", Endpoints("h", 1, 2), TOKENS, "b")
    w = layout.worker(2, worker_id="w-x")
    assert w.name == "w-x" and w.env["DELTARL_ROLLOUT_WORKER_ID"] == "w-x"

    def seed(launch: ServiceLaunch) -> int:
        path = config_file(launch)
        return WorkerExperiment.load(path).engine_settings().seed

    assert w.args[:2] == ["rollout", "--config"] and seed(w) == 1 * 3 + 2
    assert seed(layout.worker(0, seed=9)) == 9


def test_run_check_and_bad_file_from_the_command_line(tmp_path: Path) -> None:
    runner = CliRunner()
    ok = runner.invoke(app, ["run", str(ROOT / "examples" / "demo.toml"), "--check"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["run"]["group_size"] == 6
    bad = runner.invoke(
        app, ["run", str(write(tmp_path, "[rollout]\ngroup_size = 4\n")), "--check"]
    )
    assert bad.exit_code == 2
    assert "[rollout] group_size: declared once for every service as [run] group_size" in (
        bad.output.replace("\n", " ")
    )
    missing = runner.invoke(app, ["run", str(tmp_path / "nope.toml"), "--check"])
    assert missing.exit_code == 2 and "cannot read" in missing.output


def test_per_worker_credentials_give_each_worker_its_own_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from deltarl.services.coordinator.auth import token_worker

    tokens = Tokens(trainer="t" * 40, worker="w" * 40, env="e" * 40, worker_key="k" * 40)
    config = load_run_config(ROOT / "examples" / "demo.toml")
    layout = RunLayout(
        config,
        run_dir=tmp_path,
        model="/models/m",
        endpoints=Endpoints("127.0.0.1", 8700, 8001),
        tokens=tokens,
        bucket_uri=str(tmp_path / "bucket"),
    )
    coord = layout.coordinator().env
    assert coord["DELTARL_COORDINATOR_WORKER_KEY"] == "k" * 40
    assert "DELTARL_COORDINATOR_WORKER_TOKEN" not in coord  # no shared worker token
    for name in list(__import__("os").environ):
        if name.startswith("DELTARL_"):
            monkeypatch.delenv(name)
    for k, v in coord.items():
        monkeypatch.setenv(k, v)
    assert CoordinatorSettings().worker_key == "k" * 40  # starts with the key alone
    got = [layout.worker(i).env["DELTARL_ROLLOUT_WORKER_TOKEN"] for i in range(2)]
    assert [token_worker("k" * 40, t) for t in got] == ["worker-1", "worker-2"]


def test_a_teacher_section_adds_the_teacher_service_and_tells_the_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from deltarl.teacher.settings import TeacherSettings

    text = (ROOT / "examples" / "charset-tiny.toml").read_text()
    plain = load_run_config(write(tmp_path, text))
    assert plain.teacher is None
    tokens = Tokens(trainer="t" * 40, worker="w" * 40, env="e" * 40, teacher="s" * 40)
    endpoints = Endpoints("127.0.0.1", 8700, 8001, 8703)

    def launches(config: RunConfig) -> dict[str, Any]:
        out = derive(
            config,
            run_dir=tmp_path,
            model="/models/m",
            endpoints=endpoints,
            tokens=tokens,
            bucket_uri=str(tmp_path / "bucket"),
        )
        return {x.name: x for x in out}

    without = launches(plain)
    assert "teacher" not in without
    assert not any("TEACHER" in k for x in without.values() for k in x.env)

    def read(cls: Any, env: dict[str, str]) -> Any:
        for name in list(os.environ):
            if name.startswith("DELTARL_"):
                monkeypatch.delenv(name)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        return cls()

    config = load_run_config(write(tmp_path, text + '\n[teacher]\ntop_k = 8\ndtype = "float32"\n'))
    by = launches(config)
    assert list(by) == ["coordinator", "env", "teacher", "worker-1", "worker-2", "trainer"]
    assert [x.role for x in by.values()] == ["server"] * 3 + ["worker"] * 2 + ["trainer"]
    teacher = by["teacher"]
    assert teacher.args == ["teacher", "--host", "127.0.0.1", "--port", "8703"]
    assert teacher.health == "http://127.0.0.1:8703/health"
    ts = read(TeacherSettings, teacher.env)
    assert ts.model == "/models/m" and ts.top_k == 8 and ts.dtype == "float32"  # the run's model
    assert ts.token.get_secret_value() == "s" * 40
    for wid in ("worker-1", "worker-2"):
        rs = read(RolloutSettings, by[wid].env)
        assert rs.teacher_url == "http://127.0.0.1:8703"
        assert WorkerExperiment.load(rs.config or Path(by[wid].args[2])).teacher.required
        assert rs.teacher_token is not None and rs.teacher_token.get_secret_value() == "s" * 40
    other = config.with_overrides(['teacher.model="/models/teacher"'])
    assert read(TeacherSettings, launches(other)["teacher"].env).model == "/models/teacher"
    added = plain.with_overrides(['teacher.model="/models/teacher"'])
    assert added.teacher == {"model": "/models/teacher"}
    with pytest.raises(RunConfigError, match=r"\[teacher\] token: set by the launcher"):
        plain.with_overrides(['teacher.token="x"'])
    with pytest.raises(RunConfigError, match=r"\[teacher\] top_k"):
        plain.with_overrides(["teacher.top_k=-1"])
    with pytest.raises(RunConfigError, match=r"\[rollout\] teacher_url: set by the launcher"):
        plain.with_overrides(['rollout.teacher_url="http://x"'])


def test_hints_scored_by_the_teacher_need_a_teacher_section(tmp_path: Path) -> None:
    text = (ROOT / "examples" / "charset-tiny.toml").read_text()
    plain = load_run_config(write(tmp_path, text))
    hinted = ['rollout.hints.mode="env"', 'rollout.hints.scorer="teacher"']
    with pytest.raises(RunConfigError, match=r"hints.scorer = 'teacher' needs a \[teacher\]"):
        plain.with_overrides(hinted)
    config = plain.with_overrides([*hinted, "rollout.teacher.distill=false", "teacher.top_k=8"])
    layout = RunLayout(
        config,
        tmp_path,
        "/models/m",
        Endpoints("127.0.0.1", 8700, 8001, 8703),
        replace(TOKENS, teacher="s" * 40),
        str(tmp_path / "bucket"),
    )
    worker = layout.worker(0)
    experiment = WorkerExperiment.load(config_file(worker))
    assert experiment.hints.scorer == "teacher" and not experiment.teacher.distill
    assert worker.env["DELTARL_ROLLOUT_TEACHER_URL"] == "http://127.0.0.1:8703"
    # a cross-field refusal reads as its own message, not a dump of the section
    with pytest.raises(RunConfigError, match=r"\[rollout\] teacher.distill is false") as err:
        config.with_overrides(['rollout.hints.scorer="policy"'])
    assert "got {" not in str(err.value)


def test_the_distill_demo_plan_runs_a_teacher_with_the_jsd_loss() -> None:
    plan = DemoPlan.for_model(True, 4, 2, "charset")
    assert plan.run_config().teacher is None
    config = replace(plan, distill=True).run_config()
    assert config.teacher == {"device": "cpu", "dtype": "float32"}
    assert config.trainer["loss"] == {"distill": "jsd"}
    config = replace(plan, distill=True, teacher_model="/t").run_config()
    assert config.teacher is not None and config.teacher["model"] == "/t"


def test_fp8_is_declared_once_for_the_trainer_and_the_vllm_workers(tmp_path: Path) -> None:
    """[run] fp8 and fp8_block reach the trainer's publication and every worker's engine; a
    worker whose engine cannot serve fp8 is refused when the file is read."""
    base = load_run_config(ROOT / "examples" / "demo-wordle.toml")
    with pytest.raises(RunConfigError, match=r"\[rollout\].*fp8 workers need the vllm engine"):
        base.with_overrides(["run.fp8=true"])
    config = base.with_overrides(
        ["run.fp8=true", "run.fp8_block=64", 'rollout.engine={type="vllm"}']
    )
    by = derived(config, tmp_path)
    exp = ExperimentSettings.load(config_file(by["trainer"]))
    assert exp.publish.fp8 and exp.publish.fp8_block == 64
    for w in ("worker-1", "worker-2"):
        we = WorkerExperiment.load(config_file(by[w]))
        assert we.engine_settings().fp8_block == 64  # type: ignore[union-attr]
    plain = base.with_overrides(['rollout.engine={type="vllm"}'])
    assert plain.run.fp8 is False
    with pytest.raises(RunConfigError, match=r"run.fp8_block: Input should be 64 or 128"):
        base.with_overrides(["run.fp8_block=32"])
