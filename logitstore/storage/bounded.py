"""Storage calls with a deadline: an endpoint that stalls ends in `StorageError`, never in a hang.

Icechunk 1.1's S3 client has no timeout for a request that was sent but gets no answer (its
`network_stream_timeout_seconds` only covers a body stream that stops half-way), and it retries a
refused connection 10 times, for up to a minute, whatever the repository's retry settings say. So
logitstore bounds every storage call itself, in two places that every read and write goes through:

- `BoundedStore`, the Zarr store under every group and array logitstore opens: each request
  (get, set, list, ...) must finish within `StorageLimits.deadline_s`.
- `BoundedRepository` and `BoundedSession`, around the Icechunk repository and its sessions: each
  call that touches storage (open, lookups, history, sessions, commit, rebase) is run through its
  `*_async` twin under the same deadline.

A call past its deadline is cancelled, not abandoned: cancelling an Icechunk future drops the request
in Rust, so a write that was reported failed does not land later. Both wrappers also turn Icechunk's
`IcechunkError` (Zarr requests only) and a Rust panic (`pyo3_runtime.PanicException`, a
`BaseException`, or `pyo3_async_runtimes.RustPanic`) into one-line `StorageError`s naming the store;
a read of an object that storage does not have is `DamagedDataError` instead (`read_failure`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import re
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any

import icechunk
from zarr.abc.store import ByteRequest, Store
from zarr.core import sync as zarr_sync
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.core.sync import sync
from zarr.storage import WrapperStore

from logitstore.errors import DamagedDataError, LogitstoreError, StorageError
from logitstore.storage.limits import StorageLimits

# How a panic in Icechunk's Rust code reaches Python: PyO3's `PanicException` (a `BaseException`) from a
# blocking call, `RustPanic` from an awaited one. Neither can be imported (each extension has its own).
_PANICS = {("pyo3_runtime", "PanicException"), ("pyo3_async_runtimes", "RustPanic")}


def is_panic(e: BaseException) -> bool:
    return (type(e).__module__, type(e).__name__) in _PANICS


def root_cause(e: BaseException) -> str:
    """The last line of Icechunk's multi-line error report that says what went wrong."""
    lines = [ln.strip(" |`->x") for ln in str(e).splitlines() if ln.strip(" |")]
    causes = [ln for ln in lines if ln and not ln.startswith(("context:", "at ", "with ")) and not ln[0].isdigit()]
    return causes[-1] if causes else (str(e).strip() or type(e).__name__)


def icechunk_failure(what: str, e: BaseException) -> LogitstoreError:
    """The one-line error for an `IcechunkError`: a repository file that does not parse is damage
    (`DamagedDataError`), anything else an outage (`StorageError`). `what` starts the message."""
    sign = next((sign for sign in DAMAGE_SIGNS if sign in str(e)), None)
    if sign is None:
        return StorageError(f"{what}: {root_cause(e)}")
    branch = re.search(r'fetch_branch[\s|]+with name="([^"]+)"', str(e))
    where = f" of branch {branch.group(1)!r} (refs/branch.{branch.group(1)}/ref.json)" if branch else ""
    detail = "" if root_cause(e) == sign else f": {root_cause(e)}"
    return DamagedDataError(f"{what}: a repository file is damaged ({sign}{where}{detail})")


def read_failure(what: str, e: BaseException) -> LogitstoreError:
    """The one-line error for a failed read of stored bytes. An object that the snapshot lists but
    storage does not have (a chunk file deleted on disk, a 404 NoSuchKey on S3), or holds shorter than
    the version says (a range past its end: emptied or cut short), is lost data: `DamagedDataError`
    (exit 1; `verify` names its samples, `--on-error skip` trains without them), not an outage that a
    retry could fix. Anything else as `icechunk_failure` (unreachable stays an outage)."""
    lost = next((what_is_lost for signs, what_is_lost in LOST if any(re.search(s, str(e)) for s in signs)), None)
    if lost is not None:
        return DamagedDataError(f"{what}: {lost} ({root_cause(e)})")
    return icechunk_failure(what, e)


def _request_failure(where: str, what: str, e: BaseException) -> LogitstoreError:
    return icechunk_failure(f"{where}: storage failed ({what})", e)


def _read_failure(where: str, what: str, e: BaseException) -> LogitstoreError:
    error = read_failure(f"{where}: {what}", e)
    return error if isinstance(error, DamagedDataError) else _request_failure(where, what, e)


# How Icechunk 1.1 says that an object it asked for is absent (an error, never an empty read): object_store's
# NotFound (local disk, and the other object_store backends) and the S3 client's NoSuchKey (the code S3 and
# S3-compatible services give a GET of a missing key). Collected by deleting chunk files and objects.
MISSING_SIGNS = (r"Object at location \S+ not found", r"\bNoSuchKey\b")
# How it says that an object is shorter than a range the version asks of it: object_store's range error
# (local disk; an empty file or a link to /dev/zero reads as 0 bytes long) and S3's 416 InvalidRange (a
# range that starts past the object's end; one that ends past it comes back short, and its checksum fails).
SHORT_SIGNS = (r"Wanted range starting at \d+, but object was only \d+ bytes long", r"\bInvalidRange\b")
# How it says that a local object is a symbolic link that leads back to itself (ELOOP): no read of it
# can ever succeed, so its data is as lost as a deleted file's, never an outage that a retry could end.
LOOP_SIGNS = (r"Too many levels of symbolic links \(os error 40\)",)
LOST = (
    (MISSING_SIGNS, "a stored object is missing, its data is lost"),
    (SHORT_SIGNS, "a stored object is shorter than the version says, its data is lost"),
    (LOOP_SIGNS, "a stored object is a symbolic link that leads back to itself, its data is lost"),
)


# How Icechunk 1.1 says that a file it read does not parse (a ref, a snapshot), as opposed to failing
# to reach it; collected by damaging snapshot files (flipped bytes, cut short, replaced). Icechunk
# cannot open a repository whose main ref is damaged, whatever version is asked for, and its snapshot
# files carry no checksum: about 1 flipped byte in 10 goes unnoticed.
DAMAGE_SIGNS = (
    "Invalid Icechunk metadata file",
    "cannot serialize ref json",
    "error during metadata file deserialization",
    "invalid magic numbers in file",
    "Data corruption detected",
    "incomplete frame",
    "early eof",
)


async def _within(
    awaitable: Awaitable,
    *,
    where: str,
    what: str,
    limits: StorageLimits,
    failure: Callable[[str, str, BaseException], LogitstoreError] | None,
):
    """`awaitable` under the deadline; an `IcechunkError` becomes `failure(where, what, e)`, or passes (None)."""
    try:
        return await asyncio.wait_for(awaitable, limits.deadline_s)
    except TimeoutError:
        raise StorageError(
            f"{where}: no answer from storage within {limits.deadline_s:g} s ({what}); "
            f"the endpoint stalls or is unreachable ({limits.describe()})"
        ) from None
    except icechunk.IcechunkError as e:
        if failure is None:
            raise
        raise failure(where, what, e) from None
    except BaseException as e:
        if is_panic(e):
            raise StorageError(f"{where}: storage failed ({what}): {root_cause(e)}") from None
        raise


def run(make: Callable[[], Awaitable], *, where: str, what: str, limits: StorageLimits) -> Any:
    """Run an Icechunk coroutine from synchronous code under the deadline. Icechunk's own errors pass
    through unchanged: callers tell a conflict or a missing snapshot from an outage."""

    async def bounded():
        return await _within(make(), where=where, what=what, limits=limits, failure=None)

    try:
        return sync(bounded())  # Zarr's event loop thread, where the Zarr requests run too
    except BaseException as e:
        if is_panic(e):
            raise StorageError(f"{where}: storage failed ({what}): {root_cause(e)}") from None
        raise


# -- the Zarr store ---------------------------------------------------------------------------------


class BoundedStore(WrapperStore):
    """A Zarr store whose every request ends within the deadline; Icechunk failures become
    `StorageError`s naming the store and the key."""

    def __init__(self, store: Store, *, where: str, limits: StorageLimits):
        super().__init__(store)
        self.where = where
        self.limits = limits

    def _with_store(self, store: Store) -> BoundedStore:
        return type(self)(store, where=self.where, limits=self.limits)

    def __reduce__(self):
        return (_rebuild, (type(self), self._store, self.where, self.limits))

    async def _call(self, what: str, awaitable: Awaitable):
        return await _within(awaitable, where=self.where, what=what, limits=self.limits, failure=_request_failure)

    async def _read(self, what: str, awaitable: Awaitable):
        """A read of stored objects: one the snapshot lists but storage lacks is damage (`read_failure`)."""
        return await _within(awaitable, where=self.where, what=what, limits=self.limits, failure=_read_failure)

    async def _iterate(self, what: str, items: AsyncIterator[str]) -> AsyncIterator[str]:
        items = aiter(items)
        while True:  # each step is a request (a page of a listing), so each gets the deadline
            try:
                item = await self._call(what, anext(items))
            except StopAsyncIteration:
                return
            yield item

    async def get_many(self, keys: list[str], prototype: BufferPrototype, *, what: str) -> list[Buffer | None]:
        """Whole objects, requested at once under one deadline for them all: for a reader that fetches
        many objects together (`rawread`), one timer instead of one per request (~0.25 ms each here)."""
        return await self._read(what, asyncio.gather(*(self._store.get(key, prototype) for key in keys)))

    # Requests. The rest of `WrapperStore` (properties, opening) passes through unchanged.

    async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        return await self._read(f"reading {key}", self._store.get(key, prototype, byte_range))

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        key_ranges = list(key_ranges)
        keys = sorted({key for key, _ in key_ranges})
        what = f"reading {', '.join(keys[:2])}{' and more' if len(keys) > 2 else ''}"
        return await self._read(what, self._store.get_partial_values(prototype, key_ranges))

    async def exists(self, key: str) -> bool:
        return await self._call(f"looking up {key}", self._store.exists(key))

    async def set(self, key: str, value: Buffer) -> None:
        await self._call(f"writing {key}", self._store.set(key, value))

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        await self._call(f"writing {key}", self._store.set_if_not_exists(key, value))

    async def delete(self, key: str) -> None:
        await self._call(f"deleting {key}", self._store.delete(key))

    async def delete_dir(self, prefix: str) -> None:
        await self._call(f"deleting {prefix}", self._store.delete_dir(prefix))

    async def is_empty(self, prefix: str) -> bool:
        return await self._call(f"listing {prefix or '/'}", self._store.is_empty(prefix))

    async def clear(self) -> None:
        await self._call("clearing the store", self._store.clear())

    async def getsize(self, key: str) -> int:
        return await self._call(f"sizing {key}", self._store.getsize(key))

    async def getsize_prefix(self, prefix: str) -> int:
        return await self._call(f"sizing {prefix}", self._store.getsize_prefix(prefix))

    def list(self) -> AsyncIterator[str]:
        return self._iterate("listing the store", self._store.list())

    def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        return self._iterate(f"listing {prefix}", self._store.list_prefix(prefix))

    def list_dir(self, prefix: str) -> AsyncIterator[str]:
        return self._iterate(f"listing {prefix or '/'}", self._store.list_dir(prefix))

    # Through this store's bounded get/set (WrapperStore hands these to the inner store directly).
    _get_many = Store._get_many
    _set_many = Store._set_many

    @property
    def supports_consolidated_metadata(self) -> bool:
        return self._store.supports_consolidated_metadata

    def __repr__(self) -> str:
        return f"BoundedStore({self._store!r}, where={self.where!r})"


def bounded_store(store: Store, *, where: str, limits: StorageLimits | None = None) -> BoundedStore:
    if isinstance(store, BoundedStore):
        return store
    return BoundedStore(store, where=where, limits=limits or StorageLimits.from_env())


# -- the repository and its sessions ------------------------------------------------------------------


class _Bounded:
    """Forwards everything to an Icechunk object, running each method that has an `*_async` twin (the
    ones that touch storage) through the twin under the deadline."""

    def __init__(self, target, *, where: str, limits: StorageLimits):
        self._target = target
        self.where = where
        self.limits = limits

    def __getattr__(self, name: str):
        if name.startswith("_"):  # also keeps a half-built object (while unpickling) from recursing here
            raise AttributeError(name)
        value = getattr(self._target, name)
        twin = f"{name}_async"
        if not callable(value) or not hasattr(self._target, twin):
            return value

        def call(*args, **kwargs):
            result = run(
                lambda: getattr(self._target, twin)(*args, **kwargs), where=self.where, what=name, limits=self.limits
            )
            return self._wrap(result)

        return call

    def _wrap(self, result):
        if isinstance(result, icechunk.Session) and not isinstance(result, icechunk.ForkSession):
            return BoundedSession(result, where=self.where, limits=self.limits)
        return result

    def __reduce__(self):
        return (_rebuild, (type(self), self._target, self.where, self.limits))


class BoundedRepository(_Bounded):
    """An `icechunk.Repository` whose storage calls end within the deadline (see the module docstring)."""

    def ancestry(self, **kwargs) -> list:
        async def collect():
            return [snap async for snap in self._target.async_ancestry(**kwargs)]

        return run(collect, where=self.where, what="reading the history", limits=self.limits)


class BoundedSession(_Bounded):
    """An `icechunk.Session` whose commit, rebase, merge and Zarr store are bounded. Its forks are
    plain `ForkSession`s (they travel to other processes); `PartWriter` bounds their stores."""

    @property
    def store(self) -> BoundedStore:
        return bounded_store(self._target.store, where=self.where, limits=self.limits)

    def merge(self, *forks: icechunk.ForkSession) -> None:
        """Icechunk joins the forks' change sets in memory: no storage request to bound, so no hop through
        Zarr's event loop either (which a build's part writes keep busy: ~4 ms a merge, in the driver)."""
        self._target.merge(*forks)


def _rebuild(cls, target, where: str, limits: StorageLimits):
    return cls(target, where=where, limits=limits)


# -- opening ------------------------------------------------------------------------------------------


def repository_exists(storage: icechunk.Storage, *, where: str, limits: StorageLimits | None = None) -> bool:
    return run(
        lambda: icechunk.Repository.exists_async(storage),
        where=where,
        what="opening",
        limits=limits or StorageLimits.from_env(),
    )


def create_repository(
    storage: icechunk.Storage, *, where: str, limits: StorageLimits | None = None
) -> BoundedRepository:
    limits = limits or StorageLimits.from_env()
    repo = run(lambda: icechunk.Repository.create_async(storage), where=where, what="creating", limits=limits)
    # reopen (no request), not create(config=...): that would store these per-process settings in the repository
    return BoundedRepository(repo.reopen(config=limits.icechunk_config()), where=where, limits=limits)


def open_repository(storage: icechunk.Storage, *, where: str, limits: StorageLimits | None = None) -> BoundedRepository:
    limits = limits or StorageLimits.from_env()
    repo = run(
        lambda: icechunk.Repository.open_async(storage, config=limits.icechunk_config()),
        where=where,
        what="opening",
        limits=limits,
    )
    return BoundedRepository(repo, where=where, limits=limits)


# -- exit -----------------------------------------------------------------------------------------------
#
# Icechunk answers every `*_async` call and every Zarr request from a tokio thread: pyo3-async-runtimes
# attaches that thread to Python and hands the result over with `loop.call_soon_threadsafe`, which queues
# the callback and then writes the loop's wake-up byte with the GIL released. The awaiting code can resume
# (and the command end) before that thread has the GIL back. If the interpreter is finalizing by then,
# CPython 3.11 ends the thread with pthread_exit, whose forced unwind cannot pass its Rust frames: the
# process aborts (SIGABRT, exit 134) after a command that succeeded (about 4 `tag` runs in 100 with four
# at once on 2 cores; the core dump's aborting thread is in `pyo3_async_runtimes::set_result`). So
# logitstore does not let the interpreter finalize while Icechunk may still enter Python: at exit (atexit
# runs before finalization, while such threads can still take the GIL) it waits until no request is
# pending on Zarr's event loop (a `gather` that failed leaves its siblings running) and no thread that
# Python did not start is inside Python. Usually no wait at all; at most `SETTLE_S`.

SETTLE_S = 5.0


def settle(*, limit_s: float = SETTLE_S) -> bool:
    """Wait until Icechunk has no request pending and none of its threads is inside Python; returns
    whether that happened within `limit_s`. Registered to run at exit; callable any time."""
    deadline = time.monotonic() + limit_s
    while True:
        if not _pending_requests() and not _foreign_threads_in_python():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)  # releases the GIL to the thread that waits for it


def _pending_requests() -> int:
    """Unfinished tasks on Zarr's event loop thread, where every Icechunk request of logitstore runs."""
    loop = zarr_sync.loop[0]  # None until the first request (zarr.core.sync keeps its loop in this list)
    if loop is None or loop.is_closed():
        return 0
    return sum(not task.done() for task in asyncio.all_tasks(loop))


def _foreign_threads_in_python() -> set[int]:
    """Threads running Python code that Python did not start (tokio's, attached by pyo3)."""
    started = {t.ident for t in threading.enumerate() if not isinstance(t, threading._DummyThread)}
    return set(sys._current_frames()) - started


atexit.register(settle)  # after Zarr's own handler is registered (imported above), so it runs before it


# -- failures as logitstore's errors -------------------------------------------------------------------


@contextlib.contextmanager
def storage_errors(what: str) -> Iterator[None]:
    """Turn Icechunk's multi-line Rust errors into one line that names the store: damaged repository
    files (a ref or snapshot that does not parse) are `DamagedDataError`, anything else an outage."""
    try:
        yield
    except icechunk.ConflictError:
        raise
    except icechunk.IcechunkError as e:
        raise icechunk_failure(what, e) from None
    except BaseException as e:  # a panic in Icechunk's Rust code on a failed request is no Exception
        if is_panic(e):
            raise StorageError(f"{what}: {root_cause(e)}") from None
        raise


@contextlib.contextmanager
def read_errors(what: str) -> Iterator[None]:
    """Reads of stored arrays: an unreachable or stalled store is an outage (`StorageError`, exit 2,
    run again later); bytes that fail their CRC32C or do not decode are damage (`DamagedDataError`,
    exit 1, what `verify` reports). `what` names the data, e.g. "the id order of teacher 'x'"."""
    try:
        yield
    except LogitstoreError:
        raise
    except icechunk.IcechunkError as e:
        raise read_failure(f"cannot read {what}", e) from None
    except (ValueError, RuntimeError) as e:  # zarr's CRC32C mismatch is a ValueError, a Blosc failure a RuntimeError
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DamagedDataError(f"{what} is damaged ({cause[:120]}); run `logitstore verify`") from None
