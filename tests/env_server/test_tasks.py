"""The task registry: tasks are found by folder, and the generic core names none."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltarl.env_server import tasks
from deltarl.env_server.core.task import Task
from deltarl.env_server.settings import EnvSettings
from deltarl.env_server.tasks import TASKS, discover, make_task

ROOT = Path(__file__).resolve().parents[2]

DICE = """
from pydantic import BaseModel
from typing import Literal
from deltarl.env_server.core.task import Task, TaskSpec
from deltarl.env_server.core.wire import TextArenaObservation

class DiceObservation(TextArenaObservation):
    task: Literal["dice"] = "dice"

class DiceState(BaseModel):
    task: Literal["dice"] = "dice"

def build(settings):
    return TaskSpec(description="roll", factory=lambda: None, empty_state=DiceState,
                    max_turns=1)

class DiceSettings(BaseModel):
    dice_sides: int = 6

TASK = Task(name="dice", summary="a die", observation=DiceObservation, state=DiceState,
            settings=DiceSettings, build=build)
"""


@pytest.fixture
def package(tmp_path: Path) -> Iterator[Path]:
    """An empty package ``taskpkg`` on sys.path with a ``core`` folder (never a task)."""
    root = tmp_path / "taskpkg"
    for folder in (root, root / "core"):
        folder.mkdir()
        (folder / "__init__.py").write_text("")
    (root / "core" / "task.py").write_text("raise AssertionError('core is not a task')\n")
    sys.path.insert(0, str(tmp_path))
    try:
        yield root
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.split(".")[0] == "taskpkg"]:
            del sys.modules[name]


def add_folder(root: Path, name: str, task_py: str | None) -> None:
    (root / name).mkdir()
    (root / name / "__init__.py").write_text("")
    if task_py is not None:
        (root / name / "task.py").write_text(task_py)


def test_the_shipped_tasks_are_found_and_build() -> None:
    assert list(TASKS) == ["charset", "wordle"]
    for name in TASKS:
        task, spec = make_task(EnvSettings(task=name))
        assert task.name == name and spec.max_turns >= 1
        first = spec.factory().reset(seed=0)
        assert first.observation.task == name  # type: ignore[attr-defined]


def test_adding_a_task_is_adding_a_folder(package: Path) -> None:
    add_folder(package, "dice", DICE)
    add_folder(package, "helpers", None)  # a folder without task.py is not a task
    found = discover("taskpkg")
    assert list(found) == ["dice"] and isinstance(found["dice"], Task)
    assert found["dice"].build(EnvSettings()).description == "roll"


def test_a_task_file_without_a_task_is_named(package: Path) -> None:
    add_folder(package, "broken", "X = 1\n")
    with pytest.raises(TypeError, match=r"taskpkg\.broken\.task defines no TASK"):
        discover("taskpkg")


def test_two_folders_claiming_one_name_are_refused(package: Path) -> None:
    add_folder(package, "dice", DICE)
    add_folder(package, "dice2", DICE)
    with pytest.raises(ValueError, match="task 'dice' is declared twice"):
        discover("taskpkg")


def test_every_task_s_settings_are_the_server_s() -> None:
    """Each task declares its settings in its folder; the server's settings take them all, so a
    task found without its place in EnvSettings fails here, and no two tasks share a field."""
    fields: dict[str, str] = {}
    for name, task in TASKS.items():
        assert issubclass(EnvSettings, task.settings), f"EnvSettings lacks {task.settings}"
        for field in task.settings.model_fields:
            assert field not in fields, f"{name} and {fields[field]} both declare {field}"
            fields[field] = name
    assert {"max_guesses", "charset_target"} <= set(fields)
    assert EnvSettings(charset_target="xyz", max_guesses=3).charset_rules().target == "xyz"


def test_an_unknown_task_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown task 'chess'; the tasks are charset, wordle"):
        EnvSettings(task="chess")


def test_the_generic_core_names_no_task() -> None:
    """``env_server/core`` imports no task folder (it reaches tasks through the registry)."""
    folders = {p.parent.name for p in (ROOT / "env_server").glob("*/task.py")} - {"core"}
    assert folders == set(TASKS)
    bad = []
    for path in sorted((ROOT / "env_server" / "core").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                if parts[:2] == ["deltarl", "env_server"] and parts[2:3] and parts[2] in folders:
                    bad.append(f"{path.name}: {node.module}")
        text = path.read_text()
        bad += [f"{path.name} names {name!r}" for name in folders if f'"{name}"' in text]
    assert bad == []
    assert tasks.UNTAGGED in TASKS


def test_reset_options_are_the_served_task_s() -> None:
    """A reset's options are validated by the served task's model: Wordle's take max_guesses,
    charset takes none (refused naming the task), and /schema gives the model."""
    from fastapi.testclient import TestClient

    from deltarl.env_server.core.app import create_app

    with TestClient(create_app(EnvSettings(task="wordle"))) as wordle:
        assert wordle.get("/schema").json()["options"]["title"] == "ResetOptions"
        ok = wordle.post("/reset", json={"seed": 1, "options": {"max_guesses": 2}})
        assert ok.status_code == 200 and ok.json()["observation"]["guesses_left"] == 2
        bad = wordle.post("/reset", json={"options": {"max_guesses": 0}})
        assert bad.status_code == 422 and bad.json()["detail"].startswith("options.max_guesses")
    with TestClient(create_app(EnvSettings(task="charset"))) as charset:
        assert charset.get("/schema").json()["options"] is None
        bad = charset.post("/reset", json={"options": {"max_guesses": 2}})
        assert bad.status_code == 422
        assert bad.json()["detail"] == (
            "options: the charset task takes no reset options (got max_guesses)"
        )
        assert charset.post("/reset", json={"options": {}}).status_code == 200


def test_a_client_checks_options_against_every_task() -> None:
    tasks.check_options({"max_guesses": 3, "shaping": {"greens": 0.5}})
    with pytest.raises(
        ValueError, match=r"shaping\.greenz: Extra inputs .* \(as wordle's options\)"
    ):
        tasks.check_options({"shaping": {"greenz": 0.5}})
