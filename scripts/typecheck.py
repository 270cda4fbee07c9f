"""`make typecheck`: mypy over the packages as Python imports them.

The components live in top-level folders and import as trainvitals.<component>
(pyproject.toml's package-dir); mypy cannot follow setuptools' editable-install finder,
so it reads a tree of links laid out like the installed package (build/typecheck/).
Settings, and the modules not checked yet, are in pyproject.toml ([tool.mypy]).
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def link_tree(root: Path) -> Path:
    """root/trainvitals: links to trainvitals/*.py and its subpackages (trainvitals/schema/),
    and to each component's folder, as pyproject.toml's package-dir maps them
    (trainvitals.analyzer -> analyzer/)."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    package = root / "trainvitals"
    package.mkdir(parents=True, exist_ok=True)
    for old in package.iterdir():
        old.unlink()
    for module in (REPO / "trainvitals").glob("*.py"):
        (package / module.name).symlink_to(module)
    for init in (REPO / "trainvitals").glob("*/__init__.py"):
        (package / init.parent.name).symlink_to(init.parent, target_is_directory=True)
    for name, folder in setuptools["package-dir"].items():
        if name != "trainvitals":
            link = package / name.removeprefix("trainvitals.")
            link.symlink_to(REPO / folder, target_is_directory=True)
    return root


def main() -> int:
    root = link_tree(REPO / "build" / "typecheck")
    config = REPO / "pyproject.toml"
    argv = [sys.executable, "-m", "mypy", "--config-file", str(config), "-p", "trainvitals"]
    return subprocess.run([*argv, *sys.argv[1:]], cwd=root).returncode


if __name__ == "__main__":
    sys.exit(main())
