"""What the stream engine (`stream.py`) reads from: a `Source` of teacher signal (a store teacher
`teacher_source.StoreSource`, several teachers `mixing.MixedSource`, a mix of versions
`version_mix.VersionsSource`, live mode's `live.stream.LiveSource`), and `HeldParts`, the parts it holds
in memory, read ahead by a pool of threads within the memory budget.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from logitstore.streaming.batch import BatchContext, PackedBatch
from logitstore.streaming.order import Pieces, SplitTable


class Source(Protocol):
    """What the engine needs from a source of teacher signal."""

    table: SplitTable

    @property
    def version(self) -> str | dict[str, float]:
        """What a state_dict pins: a store snapshot id, a mix of them {id: weight}, or live mode's fingerprint."""

    def part_bytes(self) -> np.ndarray | None:
        """Bytes in memory of each part once read, or None for a source with nothing to read."""

    def read_part(self, part: int) -> object:
        """Read one part (in a reader thread); what `build` gets back in `parts`."""

    # Optional: `warm_part(part)`, a cheap request that makes a later `read_part(part)` one round trip
    # shallower (a store source: the part's manifest), for parts beyond what the memory budget lets
    # the engine read yet (`HeldParts.warm`).

    def build(self, pieces: Pieces, parts: dict[int, Any], *, stream: BatchContext) -> PackedBatch:
        """The batch of these pieces (`parts`: what its own `read_part` gave, by part);
        `stream.unreadable(row, error)` for a sample that cannot be used."""


class HeldParts:
    """The parts a stream holds, read by a pool of threads; `want` starts reads, `get` waits for them."""

    def __init__(self, read, *, sizes: np.ndarray, threads: int, warm=None):
        self._read, self._warm = read, warm
        self._sizes, self._threads = sizes, threads
        self._futures: dict[int, Future] = {}
        self._warmed: set[int] = set()
        self._pool: ThreadPoolExecutor | None = None
        self.reads = 0  # parts read (or being read): how often each part was fetched, for tests and benchmarks
        self.peak = 0  # the most parts held (read, or being read) at once
        self.peak_bytes = 0  # the most bytes held at once (`sizes`, in memory once read): what the budget bounds

    def want(self, codes) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="logitstore-read")
        for code in codes:
            if code not in self._futures:
                self._futures[code] = self._pool.submit(self._read, code)
                self.reads += 1
        self.peak = max(self.peak, len(self._futures))
        self.peak_bytes = max(self.peak_bytes, int(self._sizes[list(self._futures)].sum()))

    def warm(self, codes) -> None:
        """Warm parts that are neither held nor being read (once each), on the reader threads after
        the reads asked for so far. Under object storage's latency a part's read is then one round trip
        (its object) instead of two (its manifest, then its object): what hides that latency when the
        memory budget allows only a window ahead."""
        if self._warm is None or self._pool is None:
            return
        for code in codes:
            if code not in self._futures and code not in self._warmed:
                self._warmed.add(code)
                self._pool.submit(self._warm, code)

    def keep_only(self, codes: set[int]) -> None:
        for code in [c for c in self._futures if c not in codes]:
            self._futures.pop(code).cancel()

    def get(self, codes) -> dict[int, object]:
        self.want(codes)
        out = {}
        for code in codes:
            try:
                out[code] = self._futures[code].result()
            except BaseException:
                self._futures.pop(code, None)  # a later attempt (a resumed iteration) reads it again
                raise
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._futures.clear()
