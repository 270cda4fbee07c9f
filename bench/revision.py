"""The collector of another git revision, to measure a change side by side with what it
replaced: on a shared machine, figures taken minutes apart differ by more than most
changes do, so a bench alternates requests between the two collectors instead.

    root = checkout("HEAD~1", Path(tmp))
    collector = Collector(store, argv=revision_argv(root))   # bench/ingest.py
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Runs `trainvitals` from the folder named first: this checkout's editable install would
# map every `trainvitals.*` package back to the working tree, so its finder is dropped.
_BOOT = (
    "import runpy, sys; root = sys.argv.pop(1); "
    "sys.meta_path[:] = [f for f in sys.meta_path "
    "if 'editable' not in getattr(f, '__module__', '')]; "
    "sys.path.insert(0, root); sys.argv[0] = 'trainvitals'; "
    "runpy.run_module('trainvitals', run_name='__main__')"
)


def checkout(rev: str, into: Path) -> Path:
    """The tree of `rev` (git archive) in `into`, laid out as the `trainvitals` package:
    pyproject's package-dir maps `trainvitals.collector` to `collector/` and so on."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    config = tomllib.loads((into / "pyproject.toml").read_text())
    for package, folder in config["tool"]["setuptools"]["package-dir"].items():
        if package != "trainvitals":
            (into / "trainvitals" / package.split(".", 1)[1]).symlink_to(into / folder)
    return into


def revision_argv(root: Path) -> list[str]:
    """argv prefix that runs `trainvitals` from `root` (append the subcommand and flags)."""
    return [sys.executable, "-c", _BOOT, str(root)]
