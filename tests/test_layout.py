"""The project's shape: no module reaches into another's private names, and the top-level folders
resolve as `logitstore.*` subpackages."""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
# The top-level folders that install as the package (pyproject.toml's package-dir), lowest first.
FOLDERS = {
    "logitstore": "logitstore",
    "pipelines": "logitstore.pipelines",
    "trainer": "logitstore.trainer",
    "live": "logitstore.live",
    "cli": "logitstore.cli",
}
PACKAGES = (*FOLDERS, "benchmarks")


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
    import logitstore.trainer.losses

    for module, folder in [
        (logitstore.cli.app, "cli"),
        (logitstore.pipelines.inputs, "pipelines/inputs"),
        (logitstore.trainer.losses, "trainer"),
        (logitstore.pipelines.engines, "pipelines/engines"),
    ]:
        assert Path(module.__file__).parent == ROOT / folder


@pytest.mark.slow
def test_a_non_editable_install_imports_every_subpackage(tmp_path):
    # The editable install maps the folders by a path finder; a wheel must carry them as logitstore.*.
    source = tmp_path / "source"
    for name in FOLDERS:
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
        "import logitstore.trainer.train, logitstore.pipelines.engines.vllm.engine, logitstore.cli.app, "
        "logitstore.data, pathlib\n"
        "for m in (logitstore.trainer.train, logitstore.pipelines.engines.vllm.engine, logitstore.cli.app):\n"
        "    print(pathlib.Path(m.__file__).parent)"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    printed = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert printed == [str(target / "logitstore" / p) for p in ("trainer", "pipelines/engines/vllm", "cli")]
    assert (target / "logitstore" / "data" / "sample_corpus.jsonl").is_file()


def test_the_type_check_sees_every_module_under_its_import_name():
    """scripts/typecheck.py lays the package out as setuptools installs it: every module file of the
    package folders is linked once, under the name Python imports it by."""
    spec = importlib.util.spec_from_file_location("typecheck", ROOT / "scripts" / "typecheck.py")
    assert spec is not None and spec.loader is not None
    typecheck = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(typecheck)
    folders = typecheck.package_folders()
    assert folders["logitstore.pipelines.engines"] == ROOT / "pipelines" / "engines"
    linked = {p.resolve() for p in typecheck.link_tree(folders).rglob("*.py")}
    sources = {p.resolve() for root in FOLDERS for p in (ROOT / root).rglob("*.py")}
    assert linked == sources and all((folder / "__init__.py").exists() for folder in folders.values())


def test_every_import_inside_a_function_says_why():
    """Imports sit at the top of a module; one inside a function (an optional extra, an import cycle, a
    measured start-up cost) carries its reason in a comment on its block, or sits in a `try` that turns
    a missing optional package into one clear message. The CLI's module docstring gives its own reason."""
    unexplained = []
    for package in ("logitstore", "pipelines", "trainer", "live"):
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


def _package_modules():
    """(path, module name) of every module of the package, with pyproject's package-dir mapping."""
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            yield path, name


def test_the_store_layout_is_spelled_out_in_one_module():
    """Part paths (`teachers/<t>/parts/<p>`, a part's `students/<s>`) and the stored arrays' names live in
    logitstore/format/layout.py; every other module asks it. Docstrings and comments may describe the tree."""
    from logitstore.format import layout

    stored_only = {layout.PART_ARRAYS[2], layout.CODE_OF_ID}  # array names that name nothing in memory
    found = []
    for path, name in _package_modules():
        if name == "logitstore.format.layout":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in docstrings:
                continue
            text = node.value
            if "parts/" in text or "/parts" in text or "students/" in text or text in stored_only:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {text!r}")
    assert not found, "spell these through logitstore/format/layout.py:\n" + "\n".join(found)


def _import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere (top, function, TYPE_CHECKING). `from p import n`
    points at the module p.n where there is one, else at p; a package's parents are not counted (every
    import of a submodule runs them)."""
    paths = dict((name, path) for path, name in _package_modules())
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1 packages
                    parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{parent}.{base}".rstrip(".")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in paths and t != name)
    return graph


def test_the_library_is_the_ground_floor():
    """Modules of logitstore/ (the store, the codec, tokenisation, the stream), its `__init__` included,
    import neither stage: not the build (pipelines/), not the trainer (trainer/), not the CLI. The tests'
    tooling (logitstore/testing/) sits above both stages and drives them."""
    upward = ("logitstore.pipelines", "logitstore.trainer", "logitstore.live", "logitstore.cli")
    found = [
        f"{name} imports {target}"
        for name, targets in sorted(_import_graph().items())
        if not name.startswith((*upward, "logitstore.testing"))
        for target in sorted(targets)
        if target.startswith(upward)
    ]
    assert not found, "\n".join(found)


def test_the_stages_meet_only_in_live_mode_and_the_cli():
    """The trainer (stage two) imports nothing from the build (stage one), nor the build from the trainer:
    live mode, which runs a teacher beside the trainer, uses both and sits above them (live/), as the CLI
    and the tests' tooling do."""
    stages = {"logitstore.trainer": "logitstore.pipelines", "logitstore.pipelines": "logitstore.trainer"}
    found = [
        f"{name} imports {target}"
        for name, targets in sorted(_import_graph().items())
        for stage, other in stages.items()
        if name.startswith(stage + ".")
        for target in sorted(targets)
        if target.startswith(other + ".") or target == other
    ]
    assert not found, "\n".join(found)


def test_each_shared_default_is_written_in_one_module():
    """The defaults several commands share (the top-k K, the teacher's batch, the default sparsities) are
    assigned in one module each and imported everywhere else, and no `Sparsity(k=64)` (the default's value) is
    written outside logitstore/format/sparsity.py, where the number would be a second copy of the default."""
    from logitstore.format.sparsity import DEFAULT_K

    names = ("DEFAULT_K", "BATCH_TOKENS", "DEFAULT_SAMPLED", "DEFAULT_TOPK")
    assigned: dict[str, list[str]] = {name: [] for name in names}
    literal_k = []
    for path, module in _package_modules():
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name) and t.id in assigned:
                        assigned[t.id].append(module)
        if module == "logitstore.format.sparsity":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Sparsity":
                literal_k += [
                    f"{path.relative_to(ROOT)}:{node.lineno}"
                    for kw in node.keywords
                    if kw.arg == "k" and isinstance(kw.value, ast.Constant) and kw.value.value == DEFAULT_K
                ]
    assert all(len(modules) == 1 for modules in assigned.values()), assigned
    assert not literal_k, "write the default K through DEFAULT_K:\n" + "\n".join(literal_k)


def test_no_import_cycles():
    """No two modules of the package import each other, directly or round a longer circle (counting
    imports inside functions and for type checking: a circle there is still two modules that cannot be
    read, or moved, one without the other)."""
    graph = _import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles:\n" + "\n".join(", ".join(c) for c in cycles)


def test_the_readme_counts_the_slow_tests_pytest_deselects():
    """Was: the README said eight slow tests where pytest deselected nine."""
    words = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen twenty".split()
    said = next(w for w in words if f"{w.capitalize()} long tests" in (ROOT / "README.md").read_text())
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "slow", "tests"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    ).stdout
    assert words.index(said) == sum("::" in line for line in listed.splitlines())


# The library's rooms, lowest first: a module imports only from its own room and the rooms before it. The
# ground floor is logitstore/'s top-level modules (errors, files, options, ...).
ROOMS = ("ground", "text", "format", "storage", "store", "streaming", "testing")


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) >= 2 and parts[1] in ROOMS else "ground"


def test_imports_between_the_librarys_rooms_point_down():
    found = [
        f"{name} ({_room(name)}) imports {target} ({_room(target)})"
        for name, targets in sorted(_import_graph().items())
        if name.startswith("logitstore.")
        and not name.startswith(("logitstore.pipelines", "logitstore.trainer", "logitstore.live", "logitstore.cli"))
        for target in sorted(targets)
        if target.startswith("logitstore.") and ROOMS.index(_room(target)) > ROOMS.index(_room(name))
    ]
    assert not found, "\n".join(found)


def test_at_most_twelve_modules_at_the_librarys_top_level():
    top = sorted(p.name for p in (ROOT / "logitstore").glob("*.py"))
    assert len(top) <= 12, f"{len(top)} modules at the top of logitstore/, put some in a room: {top}"


def _source_files():
    """Every module of the package and scripts/ (benchmarks/ and tests/ may hold long scripts and suites)."""
    for folder in (*FOLDERS, "scripts"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_no_module_is_over_500_lines():
    long = [f"{p.relative_to(ROOT)}: {n}" for p in _source_files() if (n := len(p.read_text().splitlines())) > 500]
    assert not long, "split these by job:\n" + "\n".join(long)


def test_no_class_name_is_defined_twice():
    where: dict[str, list[str]] = {}
    for path, _ in _package_modules():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twice, "one meaning per name:\n" + "\n".join(f"{n}: {', '.join(p)}" for n, p in sorted(twice.items()))


def test_no_module_shadows_the_standard_library():
    shadows = [
        str(p.relative_to(ROOT))
        for folder in FOLDERS
        for p in sorted((ROOT / folder).rglob("*"))
        if (p.suffix == ".py" and p.stem in sys.stdlib_module_names)
        or (p.is_dir() and p.name in sys.stdlib_module_names and (p / "__init__.py").exists())
    ]
    assert not shadows, "rename these, they shadow the standard library's modules:\n" + "\n".join(shadows)


def _imports_of(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.append((node.lineno, node.module or ""))
    return found


def test_tests_and_benchmarks_share_tooling_only_through_logitstore_testing():
    """Test and benchmark helpers live in logitstore/testing; no test imports another test module (its
    conftest included), no benchmark imports a test, and nothing edits sys.path to reach them."""
    found = []
    for folder in ("tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT)
            found += [
                f"{rel}:{line} imports {module}"
                for line, module in _imports_of(path)
                if module.split(".")[0] in ("tests", "benchmarks")
            ]
    for path in [*(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py"), *_source_files()]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "path"
                and isinstance(node.value, ast.Name)
                and node.value.id == "sys"
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} uses sys.path")
    assert not found, "\n".join(found)


def test_the_streams_defaults_are_written_once():
    """`eval_fraction` and `train_on` take their default from one place (the stream's spec); every other
    signature or config field that has them refers to it."""
    literal: dict[str, list[str]] = {"eval_fraction": [], "train_on": []}

    def note(name: str, default: ast.expr | None, where: str) -> None:
        if name in literal and isinstance(default, ast.Constant):
            literal[name].append(where)

    for path, _ in _package_modules():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{node.__dict__.get('lineno')}"
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = node.args
                positional = args.posonlyargs + args.args
                for arg, default in zip(positional[len(positional) - len(args.defaults) :], args.defaults):
                    note(arg.arg, default, where)
                for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults):
                    note(arg.arg, kw_default, where)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                value = node.value
                if isinstance(value, ast.Call) and value.args:  # option(0.05, ...)/field(default=...)
                    value = value.args[0]
                elif isinstance(value, ast.Call):
                    value = next((k.value for k in value.keywords if k.arg == "default"), None)
                note(node.target.id, value, where)
    assert all(len(places) == 1 for places in literal.values()), literal
