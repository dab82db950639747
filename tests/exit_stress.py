"""Run logitstore commands many times each and report every run that did not exit 0 (tests/test_exit.py's
stress test: an abort at interpreter exit shows in a few runs of a hundred, never in one).

Each run is a fresh process that runs the command as `logitstore ...` does and leaves through the
interpreter's own teardown, where those aborts happened. To make 200 runs of each command affordable,
the runs are forked from this interpreter after it has imported logitstore, torch and transformers once
(~8 s per process otherwise) and before it has touched any store, so no Icechunk, Zarr or torch thread
exists yet: a child starts its own, as a fresh process does. `--parallel` children run at once, since
the aborts came when a process ran late on a busy machine.

    python -m tests.exit_stress SPEC.json

SPEC: {"runs": N, "parallel": P, "imports": [modules], "commands": {name: [args...]}}. "{i}" in an
argument becomes the run's number. `imports` are what the commands import (importing torch when a
command does not would slow its exit: a process with torch and transformers loaded takes ~4 s more to
tear down here). Prints one JSON object: per command, the failed runs
(number, exit status or -signal, the end of stderr), the seconds all its runs took and the CPU
seconds of a run.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
import time


def failures_of(spec: dict) -> dict:
    """Fork the runs, `parallel` at a time; per command the failed runs and its seconds."""
    report: dict = {}
    for name, args in spec["commands"].items():
        started, failed, running, cpu = time.monotonic(), [], {}, []
        for i in range(spec["runs"]):
            while len(running) >= spec["parallel"]:
                cpu.append(_reap(running, failed))
            running.update(_fork(args, i))
        while running:
            cpu.append(_reap(running, failed))
        report[name] = {
            "failed": failed,
            "seconds": round(time.monotonic() - started, 1),
            "cpu_seconds_per_run": round(sum(cpu) / len(cpu), 3),
        }
        print(json.dumps({name: report[name]}), file=sys.stderr, flush=True)  # progress, command by command
    return report


def _fork(args: list[str], i: int) -> dict:
    err = tempfile.NamedTemporaryFile(prefix="exit-stress-", suffix=".err", delete=False)
    pid = os.fork()
    if pid == 0:  # the child: the command, then the interpreter's normal exit (SystemExit unwinds to the top)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(err.fileno(), 2)
        sys.argv = ["logitstore", *(a.replace("{i}", str(i)) for a in args)]
        from logitstore.cli.app import main

        main()
        sys.exit(0)
    err.close()
    return {pid: (i, err.name)}


def _reap(running: dict, failed: list) -> float:
    """Wait for a child; record it if it failed. Returns the CPU seconds it used."""
    pid, status, usage = os.wait4(-1, 0)
    i, err = running.pop(pid)
    code = os.waitstatus_to_exitcode(status)
    with open(err) as f:
        tail = f.read()[-600:]
    os.unlink(err)
    if code != 0:
        failed.append({"run": i, "status": code, "stderr": tail})
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    spec = json.loads(open(sys.argv[1]).read())
    for module in spec["imports"]:  # starts no thread that a fork would lose: BLAS and allocator pools only
        importlib.import_module(module)
    if "numba" in sys.modules:  # what a command's first cached kernel loads: numba's implementations (~1.4 s)
        from numba.core.registry import cpu_target

        cpu_target.target_context.refresh()
    print(json.dumps(failures_of(spec)))
