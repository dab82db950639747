"""User input the CLI refuses in one line with exit 2 (no traceback): integers past 64 bits, a store path
that is a symbolic link loop, a file or nothing at all, a `--max-length` beyond the teacher's context, a
write to a read-only filesystem, a run folder to resume that keeps no configuration, and error lines that
would quote a huge value."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from logitstore.errors import LINE_CHARACTERS, capped
from logitstore.store.store import Store
from logitstore.testing.cli import LONG, jsonl, one_line_error, run, run_in_child, small_build
from logitstore.testing.stores import write_store

HUGE = "99999999999999999999999"  # past 2**63: Arrow's slice and islice overflow on it


def test_an_integer_flag_past_64_bits_is_one_line(tiny_teacher, tmp_path):
    store = tmp_path / "store"
    write_store(str(store))
    data = jsonl(tmp_path / "d.jsonl", [{"id": "a", "text": "A short text to distil."}])
    new = tmp_path / "new"
    for args in (
        ["ls", store, "--limit", HUGE],
        [*small_build(tiny_teacher, new, data), "--limit", HUGE],
        [*small_build(tiny_teacher, new, data), "--limit", HUGE, "--dry-run"],
    ):
        error = one_line_error(run(*args), 2)
        assert error == f"error: --limit {HUGE} is out of range (at most {2**63 - 1})", error
    assert not new.exists()
    (tmp_path / "c.yaml").write_text(f"limit: {HUGE}\n")  # and from a config file
    error = one_line_error(run(*small_build(tiny_teacher, new, data), "--config", tmp_path / "c.yaml"), 2)
    assert error.endswith(f"limit: {HUGE} is out of range (at most {2**63 - 1})"), error
    listed = run("ls", store, "--limit", str(2**63 - 1))  # the largest is a limit like any other
    assert listed.exit_code == 0 and listed.stderr.strip() == "12 samples", listed.stderr


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["ls", "STORE", "--limit", "-1e23"], "Invalid value for '--limit'"),
        (["build", "--store", "STORE", "--generate", "2.5"], "Invalid value for '--generate'"),
        (["ls", "STORE", "--no-such-flag"], "No such option: --no-such-flag"),
        (["no-such-command"], "No such command 'no-such-command'"),
    ],
)
def test_a_value_the_parser_refuses_is_one_line(tmp_path, args, problem):
    """What typer refuses before a command runs (a value of the wrong type, an unknown flag or command) is
    one line naming it and the help to read, not a box under the usage."""
    command = args[0] if args[0] in ("ls", "build") else None
    result = run(*[str(tmp_path / "s") if a == "STORE" else a for a in args])
    error = one_line_error(result, 2)
    help_of = f"logitstore {command}" if command else "logitstore"
    assert error.startswith(f"error: {problem}") and error.endswith(f"(see {help_of} --help)"), error
    assert not (tmp_path / "s").exists()


def test_a_store_path_that_loops_is_one_line(tiny_teacher, tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    data = jsonl(tmp_path / "d.jsonl", [{"id": "a", "text": "A short text to distil."}])
    for args in (
        ["info", loop],
        [*small_build(tiny_teacher, loop, data), "--print-config"],
        ["train", "--store", loop, "--out", tmp_path / "run", "--steps", "1"],
    ):
        error = one_line_error(run(*args), 2)
        assert error == f"error: {loop} is a symbolic link that leads back to itself, not a store folder", error
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("config", ["missing", "a folder"])
def test_resuming_a_run_folder_without_its_configuration_says_so(tmp_path, config):
    out = tmp_path / "run"
    out.mkdir()
    (out / "logitstore-run.json").write_text("{}")
    if config == "a folder":
        (out / "config.yaml").mkdir()
    error = one_line_error(run("train", "--out", out, "--resume"), 2)
    why = "no config.yaml in it" if config == "missing" else "its config.yaml is not a file"
    assert error.startswith(f"error: --out {out} keeps no run configuration to resume from ({why})"), error


def test_an_error_line_is_capped_whatever_it_quotes(tmp_path):
    path = tmp_path / "long.toml"
    path.write_text(f"{'x' * 100_000}_steps = 3\n")  # a key no flag has: its message names it twice
    error = one_line_error(run("train", "--config", path, "--store", "s", "--out", "o"), 2)
    assert len(error) <= len("error: ") + LINE_CHARACTERS and "characters left out" in error, len(error)
    assert error.startswith(f"error: --config {path}: unknown key 'xxx") and error.endswith("xx-steps"), error[-80:]
    assert capped("short") == "short"


def test_max_length_beyond_the_teachers_context_is_refused_up_front(tiny_teacher, tmp_path):
    error = one_line_error(
        run(
            "build",
            "--teacher",
            tiny_teacher,
            "--store",
            tmp_path / "s",
            "--max-length",
            "1000",
            "--data",
            jsonl(tmp_path / "d.jsonl", [{"text": LONG}]),
        ),
        2,
    )
    assert "--max-length 1000 exceeds the teacher's context of 256" in error


def test_info_on_a_missing_path_creates_nothing(tmp_path):
    error = one_line_error(run("info", tmp_path / "nope"), 2)
    assert "not a logitstore store" in error and not (tmp_path / "nope").exists()


READ_ONLY = """
import subprocess, sys
store, cli = sys.argv[1], sys.argv[2:]
subprocess.run(["mount", "--bind", store, store], check=True)
subprocess.run(["mount", "-o", "remount,bind,ro", store, store], check=True)
for args in (["tag", store, "v2"], ["build", "--store", store, "--data", cli[0], "--max-length", "32", "--teacher", cli[1]]):
    r = subprocess.run([sys.executable, "-m", "logitstore.cli.app", *args], capture_output=True, text=True)
    errors = [line for line in r.stderr.strip().splitlines() if not line.startswith("build: ")]  # not progress
    print(r.returncode, " | ".join(errors))
"""


def test_writes_to_a_read_only_filesystem_are_one_line(tiny_teacher, tmp_path):
    """A real read-only mount, in a private mount namespace (`unshare -m`): nothing outside sees it."""
    uri = str(tmp_path / "store")
    write_store(uri)
    probe = ["unshare", "-m", "sh", "-c", f"mount --bind {uri} {uri} && mount -o remount,bind,ro {uri} {uri}"]
    if shutil.which("unshare") is None or subprocess.run(probe, capture_output=True).returncode:
        pytest.skip("cannot make a read-only bind mount in a private mount namespace here (needs CAP_SYS_ADMIN)")
    data = jsonl(tmp_path / "d.jsonl", [{"text": LONG}])
    result = subprocess.run(
        ["unshare", "-m", sys.executable, "-c", READ_ONLY, uri, str(data), tiny_teacher],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2, result.stdout
    for line in lines:
        code, message = line.split(" ", 1)
        assert code == "2" and message.startswith("error:") and "|" not in message and "Read-only" in message, line
    assert Store.open(uri).read().index.num_rows == 12 and not Store.open(uri).repo.list_tags()


def test_a_store_path_that_is_a_file_is_one_line_before_any_model_loads(tiny_teacher, tmp_path):
    path = tmp_path / "not-a-store"
    path.write_text("a file")
    for args in (["info", path], ["tag", path, "v1"], ["ls", f"file://{path}"]):
        error = one_line_error(run(*args), 2)  # was: a panic in Icechunk's Rust code, then exit 2
        assert "is a file, not a store folder" in error and "panicked" not in error, error
    data = jsonl(tmp_path / "d.jsonl", [{"id": "d", "text": LONG}])
    status, stderr = run_in_child("build", "--store", path / "sub", "--teacher", tiny_teacher, "--data", data)
    assert status == ["2", "False", "False"], (status, stderr)  # was: the teacher loaded first
    assert stderr.strip().splitlines() == [
        f"error: {path / 'sub'} lies under {path}, which is a file, not a store folder; give a folder's path"
    ]
    assert path.read_text() == "a file"
