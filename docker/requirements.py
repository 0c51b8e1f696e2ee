"""deltarl's requirements from pyproject.toml, for a dependency layer of its own in the images.

    python requirements.py pyproject.toml [EXTRA ...] [--only NAME]

Prints one requirement a line: the core dependencies, then those of each named extra, with the
extras' references to deltarl's own extras (``deltarl[weights]``) expanded, duplicates dropped.
``--only NAME`` prints just the requirement(s) of the distribution NAME (e.g. ``torch``: the range
the CPU image installs from PyTorch's index or a local wheel).

The Dockerfiles copy pyproject.toml and this script first and install what it prints before
they copy the source: a change to the code then reuses the (large) dependency layers, and only
pyproject.toml invalidates them. The wheel installed afterwards with the same extras must find
every requirement already satisfied (``tests/deploy`` checks that this list equals the wheel's
metadata). Standard library only (the builder stage has nothing else yet).
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

SELF = re.compile(r"^deltarl\[([\w,\s-]+)\]$")
NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    """Core dependencies plus those of ``extras`` (self-references expanded), in order."""
    project = tomllib.loads(pyproject.read_text())["project"]
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})
    out: list[str] = []
    seen: set[str] = set()

    def add(items: list[str]) -> None:
        for item in items:
            m = SELF.match(item.replace(" ", ""))
            if m:
                for extra in m.group(1).split(","):
                    if extra not in seen:
                        seen.add(extra)
                        add(optional[extra])
            elif item not in out:
                out.append(item)

    add(list(project.get("dependencies", [])))
    for extra in extras:
        if extra not in optional:
            raise SystemExit(f"pyproject.toml has no extra {extra!r} (has {sorted(optional)})")
        if extra not in seen:
            seen.add(extra)
            add(optional[extra])
    return out


def dist_name(requirement: str) -> str:
    m = NAME.match(requirement)
    return m.group(1).lower().replace("_", "-") if m else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pyproject", type=Path)
    parser.add_argument("extras", nargs="*")
    parser.add_argument("--only", help="Print only the requirement(s) of this distribution.")
    args = parser.parse_args(argv)
    reqs = requirements(args.pyproject, args.extras)
    if args.only:
        reqs = [r for r in reqs if dist_name(r) == args.only.lower()]
        if not reqs:
            raise SystemExit(f"no requirement on {args.only} in {args.extras or 'the core'}")
    print("\n".join(reqs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
