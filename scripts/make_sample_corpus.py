"""Generate logitstore/data/sample_corpus.jsonl from the Python standard library's docstrings.

The corpus ships with logitstore so the quick-start, tests and benchmarks have real
English technical prose to distil on without any download. One document per module:
the module docstring, then the docstrings of the public classes, methods and functions
it defines, in definition order.

License: the docstrings are part of CPython and are distributed under the Python
Software Foundation License (https://docs.python.org/3/license.html); see
logitstore/data/NOTICE.md. This script itself is under logitstore's license.

The output is deterministic for a given Python version (docstrings change between
versions); the modules below were chosen because their docstrings do not depend on
the platform. Run from the repository root:

    python scripts/make_sample_corpus.py
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import json
import re
import statistics
import sys
import warnings
from pathlib import Path

OUTPUT = Path(__file__).resolve().parents[1] / "logitstore" / "data" / "sample_corpus.jsonl"

# Prose-heavy, platform-independent modules, in the order they appear in the corpus.
# Short C modules (colorsys, keyword, bisect) give the short documents, argparse,
# logging and collections the long ones.
MODULES = [
    "json",
    "collections",
    "functools",
    "itertools",
    "pathlib",
    "argparse",
    "logging",
    "textwrap",
    "string",
    "re",
    "calendar",
    "heapq",
    "bisect",
    "difflib",
    "fractions",
    "statistics",
    "random",
    "shlex",
    "csv",
    "configparser",
    "enum",
    "dataclasses",
    "contextlib",
    "abc",
    "copy",
    "pprint",
    "reprlib",
    "weakref",
    "operator",
    "secrets",
    "hmac",
    "base64",
    "uuid",
    "ipaddress",
    "urllib.parse",
    "html",
    "html.parser",
    "gzip",
    "zipfile",
    "tempfile",
    "glob",
    "fnmatch",
    "filecmp",
    "sched",
    "queue",
    "colorsys",
    "keyword",
    "graphlib",
    "numbers",
    "getopt",
    "gettext",
    "cmd",
    "timeit",
    "tomllib",
    "wave",
    "warnings",
    "traceback",
    "linecache",
    "tokenize",
    "plistlib",
    "netrc",
    "zoneinfo",
    "shelve",
    "types",
    "codeop",
    "stringprep",
    "quopri",
    "mimetypes",
    "http.cookies",
    "email.message",
    "xml.etree.ElementTree",
    "concurrent.futures",
]

MIN_TOKENS, MAX_TOKENS = 60_000, 120_000


def main() -> int:
    """Write the corpus and report its size in tokens of the default teacher."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--skip-count", action="store_true", help="do not load the tokenizer")
    args = parser.parse_args()

    documents = list(collect_documents(MODULES))
    write_jsonl(documents, args.output)
    print(f"wrote {len(documents)} documents to {args.output}")
    if args.skip_count:
        return 0
    return report_tokens(documents)


def collect_documents(module_names):
    """Yield {"id", "text"} for every module that imports quietly and has docstrings."""
    for name in module_names:
        module = quiet_import(name)
        if module is None:
            print(f"skipped {name}: failed to import or printed on import", file=sys.stderr)
            continue
        text = module_text(module)
        if not text:
            print(f"skipped {name}: no docstrings", file=sys.stderr)
            continue
        yield {"id": f"stdlib/{name}", "text": text}


def quiet_import(name: str):
    """Import a module, or None if it fails or writes to stdout (like `this`)."""
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - any import failure just means "skip this module"
        return None
    return None if stdout.getvalue() else module


def module_text(module) -> str:
    """The module's docstring followed by those of the public objects it defines."""
    sections = [own_doc(module)]
    for name, obj in public_members(module):
        sections.append(titled(f"{module.__name__}.{name}", own_doc(obj)))
        if inspect.isclass(obj):
            for method_name, method in class_members(obj, owner=module.__name__):
                sections.append(titled(f"{name}.{method_name}", own_doc(method)))
    return clean("\n\n".join(unique_sections(sections)))


def public_members(module):
    """Public classes and functions the module defines, in `__all__` order if it has one.

    `__all__` (else sorted names) rather than `vars()` order: `vars()` also depends on
    what was imported before and on lazily created attributes (concurrent.futures).
    """
    names = getattr(module, "__all__", None) or sorted(vars(module))
    for name in names:
        obj = getattr(module, name, None)
        if not name.startswith("_") and is_own_api(obj, module.__name__):
            yield name, obj


def class_members(cls, *, owner: str):
    """Public methods and nested classes in definition order (a class body is stable)."""
    for name, obj in vars(cls).items():
        if not name.startswith("_") and is_own_api(obj, owner):
            yield name, obj


def is_own_api(obj, owner: str) -> bool:
    if not (inspect.isclass(obj) or inspect.isroutine(obj)):
        return False
    return defined_by(getattr(obj, "__module__", None) or "", owner)


def defined_by(module_name: str, owner: str) -> bool:
    """True for `owner` itself, its C accelerator (_heapq for heapq) or private submodules.

    Those are the module's own API, only implemented elsewhere; anything else is a
    re-export whose docstring belongs to another document.
    """
    package, _, leaf = owner.rpartition(".")
    accelerator = f"{package}._{leaf}" if package else f"_{leaf}"
    private_submodule = module_name.startswith(f"{owner}._")
    return module_name in (owner, accelerator) or private_submodule


def own_doc(obj) -> str:
    """The object's own docstring, dedented; unlike inspect.getdoc, never a base class's."""
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) else ""


def unique_sections(sections):
    """Drop empty sections and repeated docstrings (random.randint is Random.randint)."""
    seen = set()
    for section in sections:
        body = section.partition("\n\n")[2] or section
        if section and body not in seen:
            seen.add(body)
            yield section


def titled(title: str, doc: str) -> str:
    return f"{title}\n\n{doc}" if doc else ""


def clean(text: str) -> str:
    """Trailing spaces off, at most one blank line in a row: the prose is what matters."""
    text = "\n".join(line.rstrip() for line in text.splitlines())
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def write_jsonl(documents, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as handle:
        for document in documents:
            handle.write(json.dumps(document, ensure_ascii=False) + "\n")


def report_tokens(documents) -> int:
    """Print token counts with the default teacher's tokenizer; non-zero if out of range."""
    counts = count_tokens([d["text"] for d in documents])
    total = sum(counts)
    print(
        f"{total} tokens (default teacher tokenizer); per document "
        f"min {min(counts)}, median {statistics.median(counts):.0f}, max {max(counts)}; "
        f"{sum(c < 100 for c in counts)} under 100, {sum(c > 2000 for c in counts)} over 2000"
    )
    if not MIN_TOKENS <= total <= MAX_TOKENS:
        print(f"total outside the target {MIN_TOKENS}-{MAX_TOKENS}: edit MODULES", file=sys.stderr)
        return 1
    return 0


def count_tokens(texts) -> list[int]:
    from transformers import AutoTokenizer

    from logitstore.pipelines.teacher import resolve_teacher

    spec = resolve_teacher(None)
    tokenizer = AutoTokenizer.from_pretrained(spec.path, gguf_file=spec.gguf_file)
    return [len(ids) for ids in tokenizer(texts).input_ids]


if __name__ == "__main__":
    sys.exit(main())
