"""Shared-memory segments in /dev/shm: what a process leaves behind there (live mode's rings and queues
must leave nothing)."""

from __future__ import annotations

import os
import re
import time


def cuda_driver_file(pid: int) -> re.Pattern:
    """The name of the file the CUDA driver keeps in /dev/shm for process `pid`: `cuda.shm.<n>.<pid hex>.<n>`."""
    return re.compile(rf"cuda\.shm\.\d+\.{pid:x}\.\d+")


def shm_entries() -> set[str]:
    """/dev/shm, less this (still running) process's own CUDA driver file, removed when it exits."""
    own = cuda_driver_file(os.getpid())
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return {name for name in names if not own.fullmatch(name)}


def leaked_shm(before: set[str], *, grace: float = 10.0) -> set[str]:
    """Segments created since `before` that are still there after a grace period (queues' semaphores
    go away when their owner's finalizers run)."""
    deadline = time.monotonic() + grace
    while (new := shm_entries() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    return new
