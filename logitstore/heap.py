"""The interpreter's heap while a long job runs: what was there before it is left out of the cyclic
garbage collector's passes.

A process that imported torch, transformers and numba and loaded a teacher holds ~10^6 objects the
collector tracks. Its full passes (generation 2, which CPython starts on its own once enough objects
survived the younger ones) walk all of them: ~0.2 s each on this project's 2-core machine, during which
the thread that triggered one holds the GIL and every other thread waits. In a build at a GPU's pace that
is ~0.2 s of a teacher left idle (`benchmarks/build.py`). Frozen (`gc.freeze`), those objects are skipped;
what the job allocates is collected as before.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0  # nested jobs (a build of several teachers runs several builds): the outermost thaws


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze what the collector tracks now, for the block; thawed after it (the outermost block)."""
    global _depth
    with _lock:
        if _depth == 0:
            gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.unfreeze()
