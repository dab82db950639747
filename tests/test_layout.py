"""The project's shape: no module reaches into another's private names, and the top-level folders
resolve as `logitstore.*` subpackages."""

from __future__ import annotations

import ast
from pathlib import Path

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
