"""The packages' layering: each package imports only from the layers below it.

From the bottom: the shared scaffolding of every service (``services/common``: headers, TLS,
the request guard, model sources), the buckets, the weight-sync library; then the services (the
coordinator; the env server and the teacher, which know nothing of the rest); the rollout worker
(a client of the coordinator, the env server and the teacher); the trainer; and on top the
``deltarl`` command and its tools (demo, run, eval) and the deploy tool (``deltarl/spaces``),
which may use anything. An import that is not on this list is a sideways one: this test names it.
Imports inside functions count too (they are how heavy modules are loaded late).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# layer -> the layers it may import (besides itself and the ``deltarl`` package's root module)
ALLOWED: dict[str, set[str]] = {
    "services.common": set(),
    "buckets": {"services.common"},
    "weightsync": {"services.common", "buckets"},
    "services.coordinator": {"services.common", "buckets", "weightsync"},
    "env_server": {"services.common"},
    "teacher": {"services.common"},
    "rollout": {
        "services.common",
        "buckets",
        "weightsync",
        "services.coordinator",
        "env_server",
        "teacher",
    },
    "trainer": {
        "services.common",
        "buckets",
        "weightsync",
        "services.coordinator",
        "env_server",
        "rollout",
    },
}
TOOLS = ("deltarl",)  # may import anything; nothing below imports them
FOLDERS = (
    "services",
    "weightsync",
    "buckets",
    "env_server",
    "teacher",
    "rollout",
    "trainer",
    "deltarl",
)


def layer_of_module(module: str) -> str | None:
    """The layer of an imported ``deltarl.*`` module (None: not the project's, or its root)."""
    parts = module.split(".")
    if parts[0] != "deltarl" or len(parts) == 1:
        return None
    if parts[1] == "services":
        return "services" if len(parts) == 2 else f"services.{parts[2]}"
    if parts[1] in ("weightsync", "buckets", "env_server", "teacher", "rollout", "trainer"):
        return parts[1]
    return "deltarl"


def layer_of_file(path: Path) -> str:
    parts = path.relative_to(ROOT).parts
    if parts[0] == "services":
        return "services" if len(parts) == 2 else f"services.{parts[1]}"
    return parts[0]


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every ``deltarl.*`` import in ``path``, wherever it is."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return [(line, m) for line, m in found if m.split(".")[0] == "deltarl"]


def sideways_imports() -> list[str]:
    bad = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            source = layer_of_file(path)
            for line, module in imports(path):
                target = layer_of_module(module)
                if target is None or target == source or source in TOOLS:
                    continue
                if target not in ALLOWED.get(source, set()):
                    bad.append(f"{path.relative_to(ROOT)}:{line} ({source}) imports {module}")
    return bad


def test_no_package_imports_sideways() -> None:
    assert sideways_imports() == []


def test_every_layer_is_known() -> None:
    """A new package folder gets a place in the layering (else it would pass unchecked)."""
    layers = {layer_of_file(p) for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")}
    assert layers <= set(ALLOWED) | set(TOOLS) | {"services"}, layers


def test_the_check_finds_a_sideways_import(tmp_path: Path) -> None:
    """The teacher reaching into the rollout worker is named (the test can fail)."""
    assert "rollout" not in ALLOWED["teacher"]
    assert layer_of_module("deltarl.rollout.settings") == "rollout"
    assert layer_of_module("deltarl.services.common.models") == "services.common"
    assert layer_of_module("deltarl") is None
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from deltarl.rollout.settings import x\n")
    assert imports(sample) == [(2, "deltarl.rollout.settings")]


# Inside the worker and the trainer: each subpackage (or top-level module) imports only the
# rooms below it. A module name is its first part under the package (``service`` for
# ``rollout/service/worker.py``, ``loop`` for ``trainer/loop.py``).
ROOMS: dict[str, dict[str, set[str]]] = {
    "rollout": {
        "fault_points": set(),  # test-only hold points
        "engines": set(),
        "sync": {"engines", "fault_points"},  # weight sync: follow versions, apply deltas
        "episodes": {"engines", "fault_points"},  # play games, flat token bookkeeping
        "settings": {"engines", "episodes"},
        "distill": {"engines", "episodes", "sync", "settings"},  # teacher and hint targets
        "service": {"engines", "sync", "episodes", "settings", "distill", "fault_points"},
        "cli": {"service", "settings"},
        "__main__": {"cli"},
    },
    "trainer": {
        "settings": set(),
        "metrics": set(),
        "leases": set(),
        "learn": {"settings"},  # batches, losses, one optimizer step, data parallelism
        "publish": {"learn", "settings"},  # every step becomes a published version
        "checkpoint": {"learn", "publish", "settings"},
        "supervised": {"settings"},  # deltarl sft
        "screen": {"learn"},
        "reporting": {"metrics", "settings"},
        "loop": {"checkpoint", "learn", "leases", "metrics", "publish", "screen", "settings"},
        "replica": {"checkpoint", "learn", "publish", "settings"},
        "cli": {
            "checkpoint",
            "learn",
            "loop",
            "publish",
            "replica",
            "reporting",
            "screen",
            "settings",
        },
    },
}


def room_of(package: str, module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["deltarl", package] or len(parts) < 3:
        return None
    return parts[2]


def rooms_broken(package: str, root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root / package).parts
        source = rel[0].removesuffix(".py")
        if source == "__init__":
            continue
        for line, module in imports(path):
            target = room_of(package, module)
            if target is None or target == source:
                continue
            if target not in ROOMS[package].get(source, set()):
                bad.append(f"{path.relative_to(root)}:{line} ({source}) imports {module}")
    return bad


def test_rooms_import_only_rooms_below() -> None:
    assert rooms_broken("rollout") == []
    assert rooms_broken("trainer") == []


def test_every_room_is_known() -> None:
    """A new subpackage or module gets a place among the rooms (else it would pass unchecked)."""
    for package, rooms in ROOMS.items():
        found = {
            p.relative_to(ROOT / package).parts[0].removesuffix(".py")
            for p in (ROOT / package).rglob("*.py")
        } - {"__init__"}
        assert found == set(rooms), (package, found ^ set(rooms))


def test_the_room_check_finds_an_upward_import(tmp_path: Path) -> None:
    """Episodes reaching up into the worker service is named (the test can fail)."""
    sample = tmp_path / "rollout" / "episodes" / "runner.py"
    sample.parent.mkdir(parents=True)
    sample.write_text(
        "from deltarl.rollout.engines.base import Engine\n"
        "from deltarl.rollout.service.worker import RolloutWorker\n"
    )
    assert rooms_broken("rollout", tmp_path) == [
        "rollout/episodes/runner.py:2 (episodes) imports deltarl.rollout.service.worker"
    ]
