"""`train --nproc N`'s launcher and its ranks: a signal to the launcher alone stops every rank before the
run goes on (SIGINT: exit 130, SIGTERM: 143), the launcher ends after its ranks, and a rank killed from
outside (as the OOM killer does) ends the run with one line, exit 2."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from logitstore.testing.cli import CLI

STEPS = 30  # a run the signal must cut short (unstopped, the ranks train on to step 30 and export final/)


def ranks_of(launcher: int) -> list[int]:
    children = subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_the_launcher_stops_its_ranks_first(chat_store, tmp_path, signum, code):  # noqa: F811
    out = tmp_path / "run"
    args = ["train", "--store", chat_store, "--out", out, "--steps", STEPS, "--seq-len", 32, "--micro-batch", 1]
    launcher = subprocess.Popen(
        [*CLI, *map(str, args), "--nproc", "2", "--eval-fraction", "0"], stderr=subprocess.PIPE, text=True
    )
    ranks: list[int] = []
    for line in launcher.stderr:  # the ranks train: signal the launcher alone, as `kill -INT <launcher>` does
        if line.startswith("step "):
            ranks = ranks_of(launcher.pid)
            launcher.send_signal(signum)
            break
    rest = launcher.stderr.read()
    assert launcher.wait(timeout=300) == code, rest[-2000:]  # SIGINT was: 130 only after the last step
    assert len(ranks) == 2 and not any(map(running, ranks)), ranks  # no rank outlives the launcher
    steps = [line for line in rest.splitlines() if line.startswith("step ")]
    assert len(steps) < STEPS - 1 and not (out / "final").exists(), steps[-1:]  # was: trained on, exported
    assert "Traceback" not in rest, rest[-2000:]


@pytest.mark.slow
def test_a_train_rank_killed_from_outside_is_one_line_exit_2(chat_store, tmp_path):
    out = tmp_path / "run"
    args = ["train", "--store", chat_store, "--out", out, "--steps", "100000", "--seq-len", "32", "--micro-batch", "1"]
    child = subprocess.Popen(
        [*CLI, *map(str, args), "--nproc", "2", "--eval-fraction", "0"], stderr=subprocess.PIPE, text=True
    )
    for line in child.stderr:  # the ranks train: kill one of them as the OOM killer would
        if line.startswith("step "):
            ranks = [
                int(p)
                for p in subprocess.run(["pgrep", "-P", str(child.pid)], capture_output=True, text=True).stdout.split()
            ]
            os.kill(max(ranks), signal.SIGKILL)
            break
    rest = child.stderr.read()
    assert child.wait(timeout=300) == 2, rest[-2000:]  # was: a traceback, exit 1 (the code for damaged data)
    errors = [line for line in rest.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "was killed by SIGKILL" in errors[0] and "--resume" in errors[0], rest[-2000:]
    assert "Traceback" not in rest and "Terminating process" not in rest, rest[-2000:]
