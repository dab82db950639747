"""How a process ends: the exit code table (docs/exit-codes.md) is the one the code uses, a reader that
went away is an interruption (130), not damage, and no command aborts at interpreter exit (Icechunk
requests still in flight, every command that touches a store run 200 times)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from logitstore.testing.cli import CLI, run, sample_corpus_head, small_build
from logitstore.testing.stores import write_store

ROOT = Path(__file__).resolve().parent.parent


# Icechunk requests still in flight when the interpreter exits: their results are handed over by tokio
# threads while Python finalizes, the race behind the aborts, made frequent (7 of 30 runs aborted).
IN_FLIGHT_AT_EXIT = """
import asyncio, sys
import icechunk
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync
import logitstore.storage.bounded  # what every logitstore process imports: it registers bounded.settle at exit

store = icechunk.Repository.open(icechunk.local_filesystem_storage(sys.argv[1])).readonly_session(branch="main").store

async def start():
    for _ in range(200):
        asyncio.get_running_loop().create_task(store.get("zarr.json", default_buffer_prototype()))

sync(start())
"""


def test_icechunk_requests_in_flight_at_exit_do_not_abort_the_process(tmp_path):
    uri = str(tmp_path / "store")
    write_store(uri, n=2)
    for _ in range(20):
        done = subprocess.run([sys.executable, "-c", IN_FLIGHT_AT_EXIT, uri], capture_output=True, text=True)
        assert done.returncode == 0, (done.returncode, done.stderr[-1000:])  # was: -6 (SIGABRT) or -11


# What the commands import, imported once before the forks; torch only where the commands need it (a process
# with torch and transformers loaded takes seconds longer to tear down). pandas: what pyarrow imports on its
# first conversion of Python objects; numba: the kernels' compiler.
STORE_MODULES = [
    "pandas",
    "numba",
    "logitstore.cli.app",
    "logitstore.store.store",
    "logitstore.store.verify",
    "logitstore.store.show",
    "logitstore.store.entries",
]
TORCH_MODULES = [
    *STORE_MODULES,
    "logitstore.pipelines.build",
    "logitstore.pipelines.teacher",
    "logitstore.trainer.train",
    "transformers.models.llama.modeling_llama",  # what build and train load lazily
    "matplotlib.pyplot",
]


def stress(tmp_path, *, runs: int, modules: list[str], commands: dict, in_flight: str, plant=None) -> dict:
    """tests/exit_stress.py's report: per command, the runs that did not exit 0."""
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "runs": runs,
                "parallel": 2,
                "imports": modules,
                "commands": commands,
                "in_flight": in_flight,
                "plant": plant,
            }
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "tests.exit_stress", str(spec)], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {name: r["failed"] for name, r in json.loads(done.stdout).items() if r["failed"]}


@pytest.mark.slow
def test_every_command_that_touches_a_store_exits_0_at_every_exit(tiny_teacher, tmp_path):
    """Was: `tag` exited 134 (SIGABRT at interpreter exit, after printing `tagged ...`) in ~1 run of 25
    with four at once on 2 cores: an Icechunk thread handing over a result while Python finalized
    (`bounded.settle`); then `ls` exited 134 in ~2 runs of 100 (Arrow's thread pool dropping a buffer that
    held Python bytes, `index._arrow_owned`). Every run ends with Icechunk requests in flight, so each exit
    meets the race (tests/exit_stress.py): 60 runs of each light command and 30 of each heavy one, two at
    a time, cost a tenth of 200 plain runs of each, and a missing `settle` in any command aborts a run in
    five (the test below): it would escape 30 runs once in 800, and 60 runs once in 600,000."""
    data = sample_corpus_head(tmp_path / "data.jsonl", docs=4, chars=300)
    store = str(tmp_path / "store")
    assert subprocess.run([*CLI, *small_build(tiny_teacher, store, data)], capture_output=True).returncode == 0
    first = json.loads(run("log", store, "--json").stdout)[-1]["id"]
    sample = json.loads(run("ls", store, "--json").stdout)[0]["sample_id"]
    light = {
        "info": ["info", store],
        "ls": ["ls", store],
        "show": ["show", store, sample],
        "log": ["log", store],
        "diff": ["diff", store, first, "main"],
        "tag": ["tag", store, "t{i}"],
        "verify": ["verify", store],
        "export": ["export", store, f"{tmp_path}/entries-{{i}}.parquet", "--what", "entries"],
    }
    heavy = {
        "build": small_build(tiny_teacher, f"{tmp_path}/built-{{i}}", data),
        "train": [
            *("train", "--store", store, "--out", f"{tmp_path}/run-{{i}}", "--steps", "1"),
            *("--seq-len", "32", "--micro-batch", "1", "--eval-fraction", "0"),
        ],
        "eval": ["eval", "--store", store, "--student", "llama-tiny", "--seq-len", "32", "--eval-fraction", "1"],
    }
    assert stress(tmp_path, runs=60, modules=STORE_MODULES, commands=light, in_flight=store) == {}
    assert stress(tmp_path, runs=30, modules=TORCH_MODULES, commands=heavy, in_flight=store) == {}


def test_the_stress_test_catches_an_abort_at_exit_planted_in_a_command(tmp_path):
    """The stress test's power, shown on a build that reintroduces the abort: `plant` takes `bounded.settle`
    off the exit handlers, and of 40 runs of `info` (each ending with requests in flight) some abort at exit
    (SIGABRT or SIGSEGV, after the command succeeded), where 10 runs without the plant exit 0. One run in
    five aborts here, so all 40 exiting 0 would happen about once in 7,500 test runs."""
    store = str(tmp_path / "store")
    write_store(store, n=2)
    commands = {"info": ["info", store]}
    assert stress(tmp_path, runs=10, modules=STORE_MODULES, commands=commands, in_flight=store) == {}
    planted = stress(tmp_path, runs=40, modules=STORE_MODULES, commands=commands, in_flight=store, plant="no-settle")
    statuses = {run["status"] for run in planted.get("info", [])}
    assert statuses and statuses <= {-6, -11, 134, 139}, planted  # SIGABRT, SIGSEGV


def test_the_exit_code_table_is_the_one_the_code_uses():
    from logitstore import errors

    rows = [line.split("|")[1:3] for line in (ROOT / "docs" / "exit-codes.md").read_text().splitlines()]
    table = {int(code): meaning.strip() for code, meaning in (r for r in rows if r and r[0].strip().isdigit())}
    assert table == {
        errors.OK: "ok",
        errors.DAMAGED: "damaged data",
        errors.USAGE_OR_OUTAGE: "usage error or outage",
        errors.INTERRUPTED: "interrupted",
    }
    assert errors.DamagedDataError.exit_code == errors.DAMAGED and errors.StorageError.exit_code == 2
    assert "docs/exit-codes.md" in (ROOT / "README.md").read_text()


def test_output_whose_reader_went_away_is_interrupted_not_damage(tmp_path):
    store = str(tmp_path / "store")
    write_store(store, n=12)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line: `logitstore ls STORE | head -0`
    done = subprocess.run([*CLI, "ls", store], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write)
    assert done.returncode == 130 and done.stderr == "", done.stderr  # was: 1, the code for damaged data
