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

A stopped rank, its run put away (its `finally` blocks ran: stream, teacher, process group, metrics),
ends at once as SIGINT ends a process (`end_stopped`), not through the interpreter's teardown (torch's and
Icechunk's, 1-2 s here and several times that on a loaded machine), which its launcher and a peer rank
blocked in a collective with it would wait for.

If the launcher itself is killed (SIGKILL), its ranks end too (`die_with_launcher`): torch gives a rank
SIGINT as its parent-death signal, but only once the rank runs its code, seconds after it starts
(importing torch); a rank whose launcher died before then finds another parent and ends, and a watchdog
thread does what the signal does where there is none (not Linux) and kills a rank that does not end
within `GRACE_SECONDS` of its launcher's death (one stuck in a collective).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from multiprocessing.process import BaseProcess

from logitstore.errors import INTERRUPTED

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# A rank ends within one step of SIGINT (its Python code sees it between operations); one stuck in a
# collective whose peer is gone may not, and is killed after this long (as torch's own join does).
GRACE_SECONDS = 30.0
# How often a rank's watchdog looks for its launcher: one getppid() a second.
WATCH_SECONDS = 1.0


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


_interrupted = threading.Event()  # a rank's first SIGINT came (`interrupted_once`)


def interrupted_once() -> None:
    """In a rank: the first SIGINT raises KeyboardInterrupt, later ones are ignored while it unwinds."""

    def interrupt(signum, frame):
        _interrupted.set()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)


def stopped(error: BaseException) -> bool:
    """Whether a rank's `error` is its stop: KeyboardInterrupt, or anything raised after its SIGINT came,
    which is what the interrupt became on its way out (torch's checkpointing gathers it from every rank
    into a `CheckpointException`; a peer that ended first fails a collective)."""
    return isinstance(error, KeyboardInterrupt) or _interrupted.is_set()


def end_stopped() -> None:
    """In a rank whose run was stopped and put away: end now, killed by SIGINT as the launcher expects of
    a stopped rank, without the interpreter's teardown (see the module docstring)."""
    _before_exit()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)  # delivered before kill() returns: the calling thread does not block it
    os._exit(128 + signal.SIGINT)  # not reached


@contextlib.contextmanager
def ended_when_stopped() -> Iterator[None]:
    """For the `train` and `rounds` commands, not a library call (a notebook lives on): a launch that a
    stop signal ended (its ranks ended, its folder put away as the block unwound) ends the process at once,
    with 130 or 143, without the interpreter's teardown (see the module docstring)."""
    try:
        yield
    except KeyboardInterrupt:
        _before_exit()
        os._exit(INTERRUPTED)
    except SystemExit as e:
        if e.code == 128 + signal.SIGTERM:  # `Stops.end`
            _before_exit()
            os._exit(e.code)
        raise


def _before_exit() -> None:
    """What sys.exit would do before the interpreter's teardown: the exit handlers (logitstore's wait
    for Icechunk's threads, multiprocessing's, which unlink the named semaphores numcodecs' Blosc made)
    and flushing the output."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


def die_with_launcher(launcher: int) -> None:
    """In a rank: SIGINT when the launcher (pid `launcher`, this process's parent) is gone, and SIGKILL
    `GRACE_SECONDS` later (see the module docstring). Called after torch set the parent-death signal,
    so a launcher gone by now is seen here: its rank was handed to another parent."""
    if os.getppid() != launcher:
        raise KeyboardInterrupt  # the launcher died before this rank ran: stop before anything starts

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(WATCH_SECONDS)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(GRACE_SECONDS)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="logitstore-launcher-watch", daemon=True).start()
