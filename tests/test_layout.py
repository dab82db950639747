"""The project's shape: no module reaches into another's private names, and the top-level folders
resolve as `logitstore.*` subpackages."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGES = ("logitstore", "pipelines", "trainer", "cli", "benchmarks")


def test_no_module_imports_another_modules_private_names():
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("logitstore"):
                    found += [
                        f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{a.name}"
                        for a in node.names
                        if a.name.startswith("_")
                    ]
    assert not found, "make these public or keep them in their module:\n" + "\n".join(found)


def test_the_top_level_folders_import_as_logitstore_subpackages():
    import logitstore.cli.app
    import logitstore.pipelines.engines
    import logitstore.pipelines.inputs
    import logitstore.trainer.mixing

    for module, folder in [
        (logitstore.cli.app, "cli"),
        (logitstore.pipelines.inputs, "pipelines"),
        (logitstore.trainer.mixing, "trainer"),
        (logitstore.pipelines.engines, "pipelines/engines"),
    ]:
        assert Path(module.__file__).parent == ROOT / folder


@pytest.mark.slow
def test_a_non_editable_install_imports_every_subpackage(tmp_path):
    # The editable install maps the folders by a path finder; a wheel must carry them as logitstore.*.
    source = tmp_path / "source"
    for name in ("logitstore", "pipelines", "trainer", "cli"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(source),
        ],
        check=True,
    )
    code = (
        "import logitstore.trainer.train, logitstore.pipelines.engines.vllm_engine, logitstore.cli.app, "
        "logitstore.data, pathlib\n"
        "for m in (logitstore.trainer.train, logitstore.pipelines.engines.vllm_engine, logitstore.cli.app):\n"
        "    print(pathlib.Path(m.__file__).parent)"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    printed = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert printed == [str(target / "logitstore" / p) for p in ("trainer", "pipelines/engines", "cli")]
    assert (target / "logitstore" / "data" / "sample_corpus.jsonl").is_file()


def test_the_type_check_sees_every_module_under_its_import_name():
    """scripts/typecheck.py lays the package out as setuptools installs it: every module file of the
    package folders is linked once, under the name Python imports it by."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import typecheck
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    folders = typecheck.package_folders()
    assert folders["logitstore.pipelines.engines"] == ROOT / "pipelines" / "engines"
    linked = {p.resolve() for p in typecheck.link_tree(folders).rglob("*.py")}
    sources = {
        p.resolve() for root in ("logitstore", "pipelines", "trainer", "cli") for p in (ROOT / root).rglob("*.py")
    }
    assert linked == sources and all((folder / "__init__.py").exists() for folder in folders.values())


def test_every_import_inside_a_function_says_why():
    """Imports sit at the top of a module; one inside a function (an optional extra, an import cycle, a
    measured start-up cost) carries its reason in a comment on its block, or sits in a `try` that turns
    a missing optional package into one clear message. The CLI's module docstring gives its own reason."""
    unexplained = []
    for package in ("logitstore", "pipelines", "trainer"):
        for path in sorted((ROOT / package).rglob("*.py")):
            lines = path.read_text().splitlines()
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                for statement in ast.walk(node):
                    if isinstance(statement, ast.Import | ast.ImportFrom):
                        first = statement.lineno - 1  # the first line of its block of imports
                        while first > 0 and lines[first - 1].strip().startswith(("import ", "from ")):
                            first -= 1
                        block = lines[first : statement.end_lineno]
                        above = lines[first - 1].strip()
                        if not (any("#" in line for line in block) or above.startswith("#") or above == "try:"):
                            unexplained.append(
                                f"{path.relative_to(ROOT)}:{statement.lineno} {lines[statement.lineno - 1].strip()}"
                            )
    assert not unexplained, "move these to the top, or say why not:\n" + "\n".join(unexplained)


def test_the_readme_counts_the_slow_tests_pytest_deselects():
    """Issue 31: the README said eight slow tests where pytest deselected nine."""
    words = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen".split()
    said = next(w for w in words if f"{w.capitalize()} long tests" in (ROOT / "README.md").read_text())
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "slow", "tests"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    ).stdout
    assert words.index(said) == sum("::" in line for line in listed.splitlines())
