"""User input the CLI refuses in one line with exit 2 (no traceback): integers past 64 bits, a store path
that is a symbolic link loop, a run folder to resume that keeps no configuration, and error lines that
would quote a huge value."""

from __future__ import annotations

import pytest

from logitstore.errors import LINE_CHARACTERS, capped
from tests.conftest import small_build
from tests.test_safety import jsonl, one_line_error, run, write_store

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
