"""The package map: the top-level folders are the ``deltarl.*`` subpackages, without links.

``deltarl.services`` is ``services/``, ``deltarl.trainer`` is ``trainer/``, and so on; everything
else about the project is in pyproject.toml. Type checkers and IDEs follow these imports through
the editable install's path map (tools/typecheck.py hands mypy each module under its name).
"""

from setuptools import find_namespace_packages, setup

# import name -> folder, relative to the repository root
PACKAGE_DIRS = {
    "deltarl": "deltarl",
    "deltarl.services": "services",
    "deltarl.weightsync": "weightsync",
    "deltarl.buckets": "buckets",
    "deltarl.trainer": "trainer",
    "deltarl.rollout": "rollout",
    "deltarl.env_server": "env_server",
    "deltarl.teacher": "teacher",
}


def packages() -> list[str]:
    found = []
    for name, folder in PACKAGE_DIRS.items():
        found.append(name)
        # namespace packages too: data folders (static/, data/) ship as package data
        subs = find_namespace_packages(folder, exclude=["*__pycache__*"])
        found += [f"{name}.{sub}" for sub in subs]
    return found


if __name__ == "__main__":  # setuptools runs this file as __main__; tools/typecheck.py imports it
    setup(package_dir=PACKAGE_DIRS, packages=packages())
