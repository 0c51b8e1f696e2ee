"""Type-check every module of the package map in setup.py under its import name.

The top-level folders are the ``deltarl.*`` subpackages without links (setup.py), so plain
``mypy -p deltarl`` would find only deltarl/ and treat the rest as missing imports. This hands
mypy each file with its module name (mypy's build API), so cross-package imports are checked as
the installed package sees them. Settings: ``[tool.mypy]`` in pyproject.toml.

    python tools/typecheck.py
"""

from __future__ import annotations

import sys
from pathlib import Path

from mypy import build
from mypy.main import process_options
from mypy.modulefinder import BuildSource

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from setup import PACKAGE_DIRS  # noqa: E402


def sources() -> list[BuildSource]:
    found = []
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if not (path.parent / "__init__.py").is_file():
                continue  # not part of the package (scripts, data)
            found.append(BuildSource(str(path), ".".join([package, *parts]), None))
    return found


def main() -> int:
    _, options = process_options(["--config-file", str(ROOT / "pyproject.toml"), "-c", "pass"])
    srcs = sources()
    try:
        result = build.build(srcs, options)
        messages = result.errors
    except build.CompileError as err:
        messages = err.messages
    for line in messages:
        print(line)
    n_files = len(srcs)
    if messages:
        print(f"Found {len(messages)} messages in {n_files} source files", file=sys.stderr)
        return 1
    print(f"Success: no issues found in {n_files} source files")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
