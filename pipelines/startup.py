"""How long a build takes to start: from the command to the teacher's first batch, in phases.

`StartupClock` marks the phases as the build passes them; `BuildSummary.startup_seconds` (the `--json`
field) holds them, each the seconds since the phase before:

    process       the process's start to the build's (Python, imports, the command line, the input's check)
    plan          the teacher described (tokenizer, config, weights' hash), the store opened, the units planned
    first_unit    the input's first documents read and tokenized into the first unit
    teacher       the teacher loaded onto its device (the executor and its engines made)
    first_batch   the first batch through the teacher (forward pass, selection, copy to the host)
    total         the command to the first batch: their sum

`process` is read from the operating system (Linux's /proc); where it cannot be, it is left out and
`total` starts at the build's own start.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

PHASES = ("process", "plan", "first_unit", "teacher", "first_batch")


def seconds_since_process_start() -> float | None:
    """Seconds since this process started, from /proc (clock ticks: 10 ms); None where unknown."""
    try:
        stat = Path("/proc/self/stat").read_text()
        started = int(stat.rsplit(")", 1)[1].split()[19])  # field 22 of proc(5): start time, in clock ticks
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - started / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class StartupClock:
    """Marks the build's start-up phases in order (`mark`); the first batch may be marked from any thread.
    A phase marked twice keeps its first time (a second teacher's pass starts up again, uncounted)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = time.perf_counter()
        before = seconds_since_process_start()
        self.seconds: dict[str, float] = {} if before is None else {"process": before}

    def mark(self, phase: str) -> None:
        assert phase in PHASES, f"unknown start-up phase {phase!r}"
        with self._lock:
            if phase in self.seconds:
                return
            now = time.perf_counter()
            self.seconds[phase] = now - self._last
            self._last = now

    def to_json(self) -> dict[str, float] | None:
        """The phases marked so far, rounded to milliseconds, and their total; None before the first batch."""
        if "first_batch" not in self.seconds:
            return None
        out = {phase: round(self.seconds[phase], 3) for phase in PHASES if phase in self.seconds}
        return {**out, "total": round(sum(self.seconds.values()), 3)}
