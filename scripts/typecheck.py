"""Type-check the package the way it installs: `python scripts/typecheck.py` (CI runs it before the tests).

The top-level folders pipelines/, trainer/ and cli/ install as logitstore.pipelines, logitstore.trainer and
logitstore.cli (pyproject.toml's package-dir). mypy names a module by its path, so run on the folders as they
lie it would check `pipelines.build`, not `logitstore.pipelines.build`, and no import between them resolves.
This script builds that installed shape out of symbolic links under build/typecheck/ (no copy to go stale, a
second or less), runs mypy there with the [tool.mypy] settings of pyproject.toml, and prints each finding
with the path of the file you edit. Extra arguments go to mypy.
"""

import os
import shutil
import sys
import tomllib
from pathlib import Path

from mypy import api

ROOT = Path(__file__).resolve().parent.parent
LINKS = ROOT / "build" / "typecheck"


def package_folders() -> dict[str, Path]:
    """Each package's folder as pyproject.toml maps it: {'logitstore.pipelines': ROOT / 'pipelines', ...}."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = setuptools["package-dir"]

    def folder(name: str) -> Path:
        # As setuptools does: the longest mapped parent, then the rest of the name as folders
        # (logitstore.pipelines.engines -> pipelines/engines).
        parts = name.split(".")
        mapped = max((n for n in range(1, len(parts) + 1) if ".".join(parts[:n]) in mapping), default=0)
        base = mapping[".".join(parts[:mapped])] if mapped else ""
        return ROOT.joinpath(base, *parts[mapped:])

    return {name: folder(name) for name in setuptools["packages"]}


def link_tree(folders: dict[str, Path]) -> Path:
    """build/typecheck/logitstore/... with one link per module file, laid out by import name."""
    shutil.rmtree(LINKS, ignore_errors=True)  # removes the links, not what they point to
    for name, folder in folders.items():
        target = LINKS.joinpath(*name.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for module in folder.glob("*.py"):
            (target / module.name).symlink_to(module)
    return LINKS / "logitstore"


def source_paths(report: str, folders: dict[str, Path]) -> str:
    """Rewrites build/typecheck/logitstore/pipelines/x.py to pipelines/x.py in mypy's report."""
    for name, folder in sorted(folders.items(), key=lambda item: -len(item[0])):
        linked = LINKS.joinpath(*name.split(".")).relative_to(ROOT).as_posix() + "/"
        report = report.replace(linked, folder.relative_to(ROOT).as_posix() + "/")
    return report


def main(argv: list[str]) -> int:
    os.chdir(ROOT)  # mypy reports paths relative to the working folder
    folders = package_folders()
    package = link_tree(folders)
    config = ["--config-file", str(ROOT / "pyproject.toml")]
    stdout, stderr, status = api.run([*config, *argv, str(package.relative_to(ROOT))])
    sys.stdout.write(source_paths(stdout, folders))
    sys.stderr.write(stderr)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
