"""The package layout: the top-level folders are the ``deltarl.*`` subpackages without links,
and no module imports itself back through another at import time."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from setup import PACKAGE_DIRS, packages  # noqa: E402

sys.path.remove(str(ROOT))


def test_no_links_in_the_source_tree() -> None:
    for folder in PACKAGE_DIRS.values():
        for path in [ROOT / folder, *(ROOT / folder).rglob("*")]:
            assert not path.is_symlink(), f"{path.relative_to(ROOT)} is a link"


@pytest.mark.parametrize(("name", "folder"), sorted(PACKAGE_DIRS.items()))
def test_each_folder_is_its_package(name: str, folder: str) -> None:
    module = importlib.import_module(name)
    assert Path(module.__file__ or "").resolve() == ROOT / folder / "__init__.py"


def test_the_package_map_lists_every_python_package() -> None:
    listed = set(packages())
    for name, folder in PACKAGE_DIRS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            assert ".".join([name, *rel.parts]) in listed, init


def _module_names() -> dict[str, Path]:
    out = {}
    for name, folder in PACKAGE_DIRS.items():
        for path in (ROOT / folder).rglob("*.py"):
            if not (path.parent / "__init__.py").is_file():
                continue
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([name, *parts])] = path
    return out


def _import_time_edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module-level imports only: those inside functions and ``if TYPE_CHECKING:`` blocks run
    later or never."""
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        found: set[str] = set()
        for node in tree.body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    break
                if isinstance(sub, ast.Import):
                    found |= {a.name for a in sub.names}
                elif isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
                    found.add(sub.module)
                    found |= {f"{sub.module}.{a.name}" for a in sub.names}
        edges[name] = {m for m in found if m in modules and m != name}
    return edges


def test_no_import_cycles() -> None:
    modules = _module_names()
    edges = _import_time_edges(modules)
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                cycles.append([*stack[stack.index(n) :], n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(modules):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_top_level_folders_do_not_import_on_their_own() -> None:
    """Only the installed names exist: ``trainer.loop`` cannot load beside
    ``deltarl.trainer.loop`` as a second copy."""
    code = "import importlib.util as u; print([n for n in ('trainer', 'services', 'rollout', 'env_server', 'teacher') if u.find_spec(n)])"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True
    )
    assert out.stdout.strip() == "[]"
