"""Iterating in a background thread, a bounded number of items ahead of the consumer.

One mechanism for the build's planner (units read and tokenized ahead of the teacher) and the stream's
prefetch (batches read and decoded ahead of the training step).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Generator, Iterable
from typing import TypeVar

T = TypeVar("T")
_POLL_SECONDS = 0.1  # how soon a blocked producer notices that the consumer left
_ITEM, _END, _ERROR = range(3)


def read_ahead(items: Iterable[T], *, depth: int, name: str, eager: bool = False) -> Generator[T, None, None]:
    """The items of `items`, produced by a daemon thread named `name` up to `depth` items ahead. The
    thread starts at the first `next()` (`eager`: at once, so items are produced before the first is
    asked for). An exception in the producer is raised here, after the items before it, with its
    traceback. Closing the iterator (or leaving a loop over it) stops the thread and waits for the item
    it is producing."""
    ahead: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(entry) -> bool:
        while not stop.is_set():  # a consumer that left never takes it: check, then wait again
            try:
                ahead.put(entry, timeout=_POLL_SECONDS)
                return True
            except queue.Full:
                pass
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put((_ITEM, item)):
                    return
            put((_END, None))
        except BaseException as e:  # handed to the consumer, which raises it in its own thread
            put((_ERROR, e))

    thread = threading.Thread(target=produce, name=name, daemon=True)
    consumer = _consumed(ahead, stop, thread, eager=eager)
    if eager:
        thread.start()
        next(consumer)  # inside its `try` from here: closing it before the first item stops the producer
    return consumer


def _consumed(ahead: queue.Queue, stop: threading.Event, thread: threading.Thread, *, eager: bool) -> Generator:
    try:
        if eager:
            yield None  # taken by `read_ahead` itself
        else:
            thread.start()
        while True:
            kind, value = ahead.get()
            if kind == _END:
                return
            if kind == _ERROR:
                raise value
            yield value
    finally:
        stop.set()
        if thread.ident is not None:
            thread.join()
