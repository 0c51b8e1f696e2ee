"""Slow setup that overlaps the rest of the suite. A test module may name test functions in
``STARTS_EARLY`` and define ``start_early()``: when any of those tests is selected, they run last
in the session and ``start_early()`` is called once collection is done, so that the work it starts
in the background (test_compose_up.py: the image builds; test_containers.py: the pip resolutions)
runs while the other tests do. The tests themselves wait for that work and check it as before."""

from __future__ import annotations

from types import ModuleType

import pytest


def _starts_early(item: pytest.Item) -> ModuleType | None:
    """The item's module if the item is one of its ``STARTS_EARLY`` tests, else None."""
    module = getattr(item, "module", None)
    names = getattr(module, "STARTS_EARLY", ())
    return module if getattr(item, "originalname", None) in names else None


@pytest.hookimpl(trylast=True)  # after -m/-k deselection
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    late = [item for item in items if _starts_early(item) is not None]
    if late:
        items[:] = [item for item in items if _starts_early(item) is None] + late


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    modules: dict[str, ModuleType] = {}
    for item in session.items:
        module = _starts_early(item)
        if module is not None:
            modules.setdefault(module.__name__, module)
    for module in modules.values():
        module.start_early()
