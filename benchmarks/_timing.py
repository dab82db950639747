"""What every benchmark here shares: the best of several timed runs (these machines are noisy)."""

from __future__ import annotations

import time


def timed(fn, *, repeat: int = 3):
    """(best seconds, last result) over `repeat` calls of `fn`."""
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result
