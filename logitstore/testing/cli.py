"""The command line as the tests drive it: in this process (`run`, typer's runner) or in a child
(`CLI`, `run_in_child`), the arguments of a small build, the inputs it reads, and the one-line error
check every refusal meets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from logitstore.cli.app import app
from logitstore.data import SAMPLE_CORPUS

CLI = [sys.executable, "-m", "logitstore.cli.app"]  # the command in a child process, as a user runs it

LONG = "The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill. " * 4
OTHER = "A completely different text about storage engines, versioned arrays and their many commits. " * 3


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def without_progress(stderr: str) -> str:
    """stderr less the build's progress lines ("build: ..."): what a test of error messages looks at."""
    return "\n".join(line for line in stderr.strip().splitlines() if not line.startswith("build: "))


def one_line_error(result, code: int) -> str:
    assert result.exit_code == code, (result.stdout, result.stderr, result.exception)
    stderr = without_progress(result.stderr)
    assert "Traceback" not in stderr and len(stderr.splitlines()) == 1, result.stderr
    return stderr


def small_build(teacher, store, data, *extra, id_column: str | None = "id") -> list[str]:
    """`build` arguments for a small store the tests read: 32-token windows, 64-token units."""
    ids = ["--id-column", id_column] if id_column else []
    common = ["--teacher", teacher, "--store", store, "--data", data, *ids, "--max-length", 32, "--unit-tokens", 64]
    return ["build", *(str(a) for a in [*common, *extra])]


def build(teacher: str, store, data, *extra):
    return run(*small_build(teacher, store, data, "--json", *extra))


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sample_corpus_head(path, *, docs: int, chars: int, first_chars: int | None = None):
    """The first `docs` documents of the shipped sample corpus cut to `chars` characters (the first one to
    `first_chars` when given), written as JSONL with their ids: real prose, small enough for a test."""
    rows = [json.loads(line) for line in SAMPLE_CORPUS.read_text().splitlines()[:docs]]
    cuts = [first_chars or chars] + [chars] * (len(rows) - 1)
    path.write_text("".join(json.dumps({"id": r["id"], "text": r["text"][:cut]}) + "\n" for r, cut in zip(rows, cuts)))
    return path


# A command in a child interpreter that reports, at its exit, what it had imported by then: tests check
# the order of things (an error comes before torch loads), never the clock.
IN_ORDER = """
import sys
from logitstore.cli.app import main
sys.argv = ["logitstore", *sys.argv[1:]]
try:
    main()
except SystemExit as e:
    print(e.code, "transformers" in sys.modules, "torch" in sys.modules)
"""


def run_in_child(*args, cwd=None) -> tuple[list[str], str]:
    """(exit code, whether transformers was imported, whether torch was) as strings, and stderr."""
    done = subprocess.run(
        [sys.executable, "-c", IN_ORDER, *map(str, args)], capture_output=True, text=True, timeout=300, cwd=cwd
    )
    return done.stdout.split(), done.stderr
