"""Run logitstore commands many times each and report every run that did not exit 0 (tests/test_exit.py's
stress test: an abort at interpreter exit shows in a few runs of a hundred, never in one).

Each run is a small process that has loaded what its command loads, runs the command as `logitstore ...`
does, and leaves through the interpreter's own teardown, where those aborts happened. Three things make a
run cheap without making the check weaker:
- the runs are forked from this interpreter after it has imported the command's modules once (~8 s per
  process otherwise) and before it has touched any store, so no Icechunk, Zarr or torch thread exists yet:
  a child starts its own, as a fresh process does;
- this interpreter's objects are frozen (`gc.freeze`) before the forks: a child's teardown then does not
  walk, and so copy page by page, the heap it shares with this one (5x less CPU per exit here);
- every run ends with `IN_FLIGHT` Icechunk requests started and not awaited, so the race behind the aborts
  (tokio threads handing results over while Python finalizes) is under way at every exit instead of in
  ~1 run of 25: without `bounded.settle`, 1 run in 5 aborts (`plant`, below).
`--parallel` children run at once, since the aborts came when a process ran late on a busy machine.

    python -m tests.exit_stress SPEC.json

SPEC: {"runs": N, "parallel": P, "imports": [modules], "commands": {name: [args...]}, "in_flight": STORE,
"plant": null}. "{i}" in an argument becomes the run's number. `imports` are what the commands import
(importing torch when a command does not would slow its exit). `in_flight`: a local Icechunk store the
requests left in flight read. `plant`: "no-settle" takes `bounded.settle` off the exit handlers in every
child, the abort this stress test exists to catch (tests/test_exit.py shows that it does). Prints one
JSON object: per command, the failed runs (number, exit status or -signal, the end of stderr), the seconds
all its runs took and the CPU seconds of a run.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import importlib
import json
import os
import sys
import tempfile
import time

IN_FLIGHT = 200  # requests left in flight at exit: 7 aborts in 30 runs without `settle` (was 1 in 25 with none)
PLANTS = ("no-settle",)


def failures_of(spec: dict) -> dict:
    """Fork the runs, `parallel` at a time; per command the failed runs and its seconds."""
    report: dict = {}
    for name, args in spec["commands"].items():
        started, failed, running, cpu = time.monotonic(), [], {}, []
        for i in range(spec["runs"]):
            while len(running) >= spec["parallel"]:
                cpu.append(_reap(running, failed))
            running.update(_fork(args, i, in_flight=spec.get("in_flight"), plant=spec.get("plant")))
        while running:
            cpu.append(_reap(running, failed))
        report[name] = {
            "failed": failed,
            "seconds": round(time.monotonic() - started, 1),
            "cpu_seconds_per_run": round(sum(cpu) / len(cpu), 3),
        }
        print(json.dumps({name: report[name]}), file=sys.stderr, flush=True)  # progress, command by command
    return report


def _fork(args: list[str], i: int, *, in_flight: str | None, plant: str | None) -> dict:
    err = tempfile.NamedTemporaryFile(prefix="exit-stress-", suffix=".err", delete=False)
    pid = os.fork()
    if pid == 0:  # the child: the command, then the interpreter's normal exit (SystemExit unwinds to the top)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(err.fileno(), 2)
        if plant == "no-settle":
            from logitstore.storage import bounded

            atexit.unregister(bounded.settle)
        code = _command(args, i)
        if in_flight:
            _leave_requests_in_flight(in_flight)
        sys.exit(code)
    err.close()
    return {pid: (i, err.name)}


def _command(args: list[str], i: int) -> int | str | None:
    """The command as `logitstore` runs it; its exit code."""
    sys.argv = ["logitstore", *(a.replace("{i}", str(i)) for a in args)]
    from logitstore.cli.app import main

    try:
        main()
    except SystemExit as done:
        return done.code
    return 0


def _leave_requests_in_flight(path: str) -> None:
    """`IN_FLIGHT` reads of the store's root started on Zarr's event loop (where logitstore's Icechunk
    requests run) and never awaited: their results arrive from tokio threads while the process exits."""
    import icechunk
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    store = icechunk.Repository.open(icechunk.local_filesystem_storage(path)).readonly_session(branch="main").store

    async def start() -> None:
        loop = asyncio.get_running_loop()
        for _ in range(IN_FLIGHT):
            loop.create_task(store.get("zarr.json", default_buffer_prototype()))

    sync(start())


def _reap(running: dict, failed: list) -> float:
    """Wait for a child; record it if it failed. Returns the CPU seconds it used."""
    pid, status, usage = os.wait4(-1, 0)
    i, err = running.pop(pid)
    code = os.waitstatus_to_exitcode(status)
    with open(err, errors="replace") as f:
        tail = f.read()[-600:]
    os.unlink(err)
    if code != 0:
        failed.append({"run": i, "status": code, "stderr": tail})
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    spec = json.loads(open(sys.argv[1]).read())
    assert spec.get("plant") in (None, *PLANTS), spec.get("plant")
    for module in spec["imports"]:  # starts no thread that a fork would lose: BLAS and allocator pools only
        importlib.import_module(module)
    if "numba" in sys.modules:  # what a command's first cached kernel loads: numba's implementations (~1.4 s)
        from numba.core.registry import cpu_target

        cpu_target.target_context.refresh()
    gc.collect()
    gc.freeze()
    print(json.dumps(failures_of(spec)))
