"""`train --nproc N`'s launcher and its ranks: a signal to the launcher alone stops every rank before the
run goes on (SIGINT: exit 130, SIGTERM: 143; quietly, even mid-checkpoint), the launcher ends after its
ranks, a launcher killed outright (SIGKILL) takes its ranks along and holds its --out until then, and a
rank killed from outside (as the OOM killer does) ends the run with one line, exit 2."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from logitstore.testing.cli import CLI, one_line_error, run
from logitstore.trainer import checkpoint, run_folder

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
    started = time.monotonic()
    launcher = subprocess.Popen(
        [*CLI, *map(str, args), "--nproc", "2", "--eval-fraction", "0", "--checkpoint-every", "1"],
        stderr=subprocess.PIPE,
        text=True,
    )
    stderr: list[str] = []
    reader = threading.Thread(target=lambda: stderr.extend(launcher.stderr), daemon=True)
    reader.start()
    while not (out / "step-2").is_dir() or not list(out.glob("step-*.partial")):  # signal it while ranks save
        assert launcher.poll() is None, "".join(stderr)[-2000:]
        time.sleep(0.001)
    start_up = time.monotonic() - started
    ranks = ranks_of(launcher.pid)
    launcher.send_signal(signum)  # the launcher alone, as `kill -INT <launcher>` does
    signalled = time.monotonic()
    assert launcher.wait(timeout=300) == code, "".join(stderr)[-2000:]  # SIGINT was: 130 only after the last step
    stop = time.monotonic() - signalled
    reader.join(timeout=60)
    rest = "".join(stderr)
    assert len(ranks) == 2 and not any(map(running, ranks)), ranks  # no rank outlives the launcher
    steps = [line for line in rest.splitlines() if line.startswith("step ")]
    assert len(steps) < STEPS - 1 and not (out / "final").exists(), steps[-1:]  # was: trained on, exported
    assert "Traceback" not in rest and "Exception" not in rest, rest[-2000:]  # was: CheckpointException, twice
    latest = checkpoint.latest(out)  # the save the signal cut short never counts
    assert latest is not None and checkpoint.train_state(latest)["step"] <= len(steps)
    # Not the interpreters' teardown (1-2 s a process here, the launcher's and each rank's one after the other:
    # 4-9 s, 9-20 s on a loaded machine) but at once; measured against the run's own start-up, which
    # imports the same modules under the same load: was over a fifth of it, now a fiftieth.
    assert stop < start_up / 5, (stop, start_up)


@pytest.mark.slow
def test_a_launcher_killed_as_its_ranks_start_takes_them_along_and_holds_its_out_until_then(chat_store, tmp_path):
    out = tmp_path / "run"
    args = ["train", "--store", chat_store, "--out", out, "--steps", 100000, "--seq-len", 32, "--micro-batch", 1]
    launcher = subprocess.Popen([*CLI, *map(str, args), "--nproc", "2", "--eval-fraction", "0"], stderr=subprocess.PIPE)
    ranks: list[int] = []
    try:
        while len(ranks := ranks_of(launcher.pid)) < 2:  # the ranks exist, importing torch: seconds before they run
            assert launcher.poll() is None, launcher.stderr.read() if launcher.stderr else ""
            time.sleep(0.01)
        second = run(*args[:-6], "--steps", 1, "--seq-len", 32, "--eval-fraction", 0)  # a second launcher, meanwhile
        assert f"is in use by another train (pid {launcher.pid})" in one_line_error(second, 2)  # was: both trained
        launcher.kill()  # SIGKILL: it forwards nothing
        launcher.wait(timeout=60)
        deadline = time.monotonic() + 240  # as long as a rank may take to start here: it ends once it runs
        while any(map(running, ranks)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not any(map(running, ranks)), ranks  # was: orphans training into the folder for hours
    finally:  # a failed test leaves nothing running
        for pid in [launcher.pid, *ranks]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
    with run_folder.held(out):  # the dead launcher's lock is stale: taken over
        assert (out / run_folder.LOCK).read_text() == f"{os.getpid()}\n"
    assert not (out / "final").exists()


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
