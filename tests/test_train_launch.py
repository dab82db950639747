"""`train --nproc N`'s launcher and its ranks: a signal to the launcher alone stops every rank before the
run goes on (SIGINT: exit 130, SIGTERM: 143), and the launcher ends after its ranks."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import CLI
from tests.test_exit_codes import chat_store  # noqa: F401 - the fixture: the chat sample, distilled

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
