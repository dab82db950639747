"""A build's progress in tokens (`Progress`): a tqdm bar on a terminal, else a line on a clock."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from tqdm import tqdm

from logitstore.pipelines import inputs
from logitstore.pipelines.config import BuildConfig
from logitstore.pipelines.plan import Planned


class Progress:
    """Build progress in tokens: a tqdm bar on a terminal, else a line every `every` seconds on a clock
    (logs, CI, a pipe; also while the input is read and tokenized, before the teacher computes), one at
    the first teacher batch, and a last line at the end.

    Tokens are counted as the teacher computes them (`batch`, from the in-process executor's workers,
    so the first line comes with the first batch) or, for executors in other processes, as units are
    merged (`update`). The ETA is the remaining tokens over the measured tokens/s; the tokens to compute
    are estimated from the planner's count (`Planned`: the windows of the documents read so far, less
    what is stored) times the input's document count over the documents read, when that count is cheap
    to know. A long document counts whole as soon as it is tokenized.
    """

    def __init__(
        self, cfg: BuildConfig, *, log: Callable[[str], None], every: float = 10.0, planned: Planned | None = None
    ):
        self.log, self.every = log, every
        self.enabled = cfg.progress
        self.planned = planned if planned is not None else Planned()
        self.total_documents = inputs.count_documents(cfg.data) if cfg.progress else None
        if self.total_documents is not None and cfg.limit is not None:
            self.total_documents = min(self.total_documents, cfg.limit)
        self.start = time.monotonic()
        self.last: float | None = None  # when the last line was printed; None: no line yet
        self.computed = self.tokens = self.samples = self.documents = 0
        self._lock = threading.Lock()  # the teacher's threads report batches, the clock ticks
        self.on_tokens: Callable[[], None] = lambda: None  # told whenever tokens are reported (any thread)
        self.bar = None
        if self.enabled and sys.stderr.isatty():
            self.bar = tqdm(total=None, unit="tok", unit_scale=True, desc="build", dynamic_ncols=True)
        self._stop = threading.Event()
        self._clock = threading.Thread(target=self._tick, name="logitstore-progress", daemon=True)
        if self.enabled and every > 0:
            self._clock.start()

    def _tick(self) -> None:
        while not self._stop.wait(self.every):
            with self._lock:
                self._report()

    def batch(self, tokens: int) -> None:
        """The teacher computed `tokens` more tokens (any thread)."""
        self.on_tokens()
        with self._lock:
            first = self.computed == 0
            self.computed += tokens
            self._report(now=first)

    def update(self, *, tokens: int, samples: int, documents: int) -> None:
        """A unit was merged: its tokens count now if no batch reported them."""
        self.on_tokens()
        with self._lock:
            self.tokens += tokens
            self.samples += samples
            self.documents += documents
            self._report()

    def _done(self) -> int:
        return max(self.computed, self.tokens)

    def _total(self) -> int | None:
        read, tokens = self.planned.documents, self.planned.tokens
        if not self.total_documents or not read:
            return None
        return max(self._done(), tokens, int(tokens / read * self.total_documents))

    def _report(self, *, final: bool = False, now: bool = False) -> None:
        if not self.enabled:
            return
        clock = time.monotonic()
        rate = self._done() / max(clock - self.start, 1e-9)
        if self.bar is not None:
            self.bar.total = self._done() if final else self._total()
            self.bar.n = self._done()
            self.bar.set_postfix(samples=self.samples, refresh=False)
            self.bar.refresh()
            return
        due = clock - (self.last if self.last is not None else self.start) >= self.every
        if final or now or due:
            self.last = clock
            self.log(self._line(final=final, rate=rate))

    def _line(self, *, final: bool, rate: float) -> str:
        """Tokens computed (of the estimate), samples written so far, documents read so far."""
        total = None if final else self._total()
        eta = "" if total is None or not rate else f", ETA {(total - self._done()) / rate / 60:.1f} min"
        of = f" of ~{total:,}" if total else ""
        documents = max(self.documents, self.planned.documents)
        waiting = ""
        if not final and not self._done():
            waiting = (
                "; the teacher's first batch is not done yet" if documents else "; reading and tokenizing the input"
            )
        generated = self.planned.generated
        answers = (
            f", {generated.tokens:,} tokens generated ({generated.tokens / generated.seconds:,.0f} tokens/s)"
            if generated is not None and generated.seconds
            else ""
        )
        return (
            f"build: {self._done():,}{of} tokens, {self.samples:,} samples written, {documents:,} documents read, "
            f"{rate:,.0f} tokens/s{answers}{eta}{waiting}"
        )

    def finish(self) -> None:
        """The build is done: the bar to 100%, or a last line with the totals."""
        with self._lock:
            self._report(final=True)

    def close(self) -> None:
        self._stop.set()
        if self._clock.is_alive():
            self._clock.join()
        if self.bar is not None:
            self.bar.close()
