"""SIGINT (Ctrl-C) and SIGTERM to `train --nproc N`: one mechanism for both.

The launcher's ranks are processes of its own that are not daemons (a rank starts processes itself:
a live teacher, the stream's readers), so the launcher's exit waits for them: a signal that ends the
launcher alone would leave them training to the last step. While the ranks run, the launcher
(`stopping_ranks`) takes either signal, forwards it to every rank as SIGINT, waits for them, kills a
rank still running `GRACE_SECONDS` later, and then ends as the signal says: SIGINT as an interrupt (exit
130, as any command), SIGTERM as 128 + 15 = 143. A rank (`interrupted_once`) turns its first SIGINT
into KeyboardInterrupt and ignores the rest, so its `finally` blocks run to the end when Ctrl-C in a
terminal reaches it twice (from the terminal and from the launcher). Nothing a rank leaves half-written
counts: checkpoints and `final/` are renamed into place whole.

If the launcher itself is killed (SIGKILL), torch's parent-death signal (SIGINT) still stops the ranks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator, Sequence
from multiprocessing.process import BaseProcess

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# A rank ends within one step of SIGINT (its Python code sees it between operations); one stuck in a
# collective whose peer is gone may not, and is killed after this long (as torch's own join does).
GRACE_SECONDS = 30.0


class Stops:
    """The stop signals the launcher received: the first one decides how it ends."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._ranks: Sequence[BaseProcess] = ()
        self._forwarded = False
        self._deadline: threading.Timer | None = None

    def __call__(self, signum: int, frame) -> None:
        """The handler (in the main thread, between bytecodes; a blocking wait resumes after it)."""
        if self.signum is None:
            self.signum = signum
            self._forward()

    def watch(self, ranks: Sequence[BaseProcess]) -> None:
        """The ranks to forward to, once started; a signal that came during their start is forwarded now."""
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # the handler waits until the ranks are set
        try:
            self._ranks = ranks
            if self.signum is not None:
                self._forward()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    def end(self) -> None:
        """After the ranks ended: end the launcher as its signal says (nothing when none came)."""
        if self.signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.signum is not None:
            raise SystemExit(128 + self.signum)

    def _forward(self) -> None:
        if self._forwarded or not self._ranks:
            return
        self._forwarded = True
        for rank in self._ranks:
            if rank.exitcode is None and rank.pid is not None:
                os.kill(rank.pid, signal.SIGINT)
        self._deadline = threading.Timer(GRACE_SECONDS, self._kill)
        self._deadline.daemon = True
        self._deadline.start()

    def _kill(self) -> None:
        for rank in self._ranks:
            rank.kill()  # a no-op for a rank already ended (its exit status is known)

    def close(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()


@contextlib.contextmanager
def stopping_ranks() -> Iterator[Stops]:
    """SIGINT and SIGTERM forwarded to the ranks `Stops.watch` names while the block runs (in the main
    thread; elsewhere signals cannot be caught and nothing changes)."""
    stops = Stops()
    if threading.current_thread() is not threading.main_thread():
        yield stops
        return
    previous = {signum: signal.signal(signum, stops) for signum in STOP_SIGNALS}
    try:
        yield stops
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        stops.close()


def interrupted_once() -> None:
    """In a rank: the first SIGINT raises KeyboardInterrupt, later ones are ignored while it unwinds."""

    def interrupt(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
