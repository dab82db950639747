"""docs/reader.py, the layout's executable definition: in an interpreter where `import logitstore` fails, it
reads every sample of a multi-part store (local and S3) as `logitstore show --json` does, reads a store
format 3 store, and refuses a format 2 store in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from logitstore.testing.cli import run
from logitstore.testing.streams import build_store

ROOT = Path(__file__).parents[1]
READER = ROOT / "docs" / "reader.py"
DATA = ROOT / "tests" / "data"

# Run in a fresh interpreter: any import of logitstore (by the reader, or by zarr loading the grid codec's
# entry point) fails there; then the reader's main, or its read_sample over every id given.
WITHOUT_LOGITSTORE = """
import importlib.abc, importlib.util, json, sys

class NoLogitstore(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "logitstore":
            raise ImportError(f"{name} is blocked in this interpreter")

sys.meta_path.insert(0, NoLogitstore())
try:
    import logitstore
    raise SystemExit("logitstore was importable")
except ImportError:
    pass
spec = importlib.util.spec_from_file_location("reader", sys.argv[1])
reader = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reader)
if sys.argv[2] == "--each":
    for sample in sys.argv[4:]:
        print(json.dumps(reader.read_sample(sys.argv[3], sample)))
    assert "logitstore" not in sys.modules
else:
    raise SystemExit(reader.main(sys.argv[2:]))
"""


def without_logitstore(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_LOGITSTORE, str(READER), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ""},
    )


def assert_reads_as_show(store: str) -> None:
    """Every sample of the store, read by the reader, against `logitstore show --json`: the same ids and
    counts, and the same log-probabilities, tails and targets (the grid's codes, decoded) to 1e-6."""
    listed = run("ls", store, "--json")
    assert listed.exit_code == 0, listed.stderr
    ids = [row["sample_id"] for row in json.loads(listed.stdout)]
    done = without_logitstore("--each", store, *ids)
    assert done.returncode == 0, done.stderr
    read = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["sample_id"] for r in read] == ids
    for got in read:
        shown = run("show", store, got["sample_id"], "--json")
        assert shown.exit_code == 0, shown.stderr
        expected = json.loads(shown.stdout)
        assert got["input_ids"] == expected["input_ids"]
        assert len(got["positions"]) == len(expected["positions"]) > 0
        for mine, theirs in zip(got["positions"], expected["positions"]):
            assert mine["ids"] == theirs["ids"]
            assert mine.get("counts") == theirs.get("counts")
            assert mine["logprobs"] == pytest.approx(theirs["logprobs"], abs=1e-6)
            assert mine["tail"] == pytest.approx(theirs["tail"], abs=1e-6)
            assert mine["target_logprob"] == pytest.approx(theirs["target_logprob"], abs=1e-6)


def test_reads_a_multi_part_sampled_store_as_show_does(tmp_path):
    store = str(tmp_path / "store")
    view = build_store(store, n=24, parts=3, mode="sampled", max_tokens=40, part_layout="packed+students")
    assert len(set(view.index["part"].to_pylist())) == 3 and view.teachers["teacher-a"].format == 4
    assert_reads_as_show(store)


def test_reads_a_store_on_s3_as_show_does(s3_endpoint):
    store = f"s3://logitstore-test/{uuid.uuid4().hex[:12]}"
    build_store(store, n=12, parts=2, max_tokens=40, part_layout="packed+students")
    assert_reads_as_show(store)


def test_reads_a_store_format_3_store_as_show_does():
    assert_reads_as_show(str(DATA / "format3-students-store"))


def test_the_script_prints_one_sample_and_refuses_what_it_cannot_read_in_one_line(tmp_path):
    store = str(DATA / "format3-students-store")
    done = without_logitstore(store, "doc-001", "--teacher", "teacher-a")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["sample_id"] == "doc-001"
    for args, says in [
        ((str(DATA / "format2-store"), "doc-000"), "stored in format 2; this reader reads formats 3 and 4"),
        ((store, "no-such-sample"), "no sample 'no-such-sample'"),
        ((store, "doc-001", "--teacher", "other"), "of teacher 'other'"),
        ((str(tmp_path / "nothing-here"), "doc-001"), "error: "),
    ]:
        refused = without_logitstore(*args)
        assert refused.returncode == 2 and refused.stdout == "", refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1 and says in refused.stderr, refused.stderr
