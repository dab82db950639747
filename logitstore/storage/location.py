"""Where a store lives: a local path, `file://`, `s3://bucket/prefix` or `memory://name`.

A location yields two things: the Icechunk `Storage` that holds the versioned Zarr arrays, and the
`BlobStore` beside it that holds the Parquet sample indexes (see `blobs.py`).
S3 settings come from the standard AWS environment variables (`AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ENDPOINT_URL`; an `http://` endpoint is allowed).
How long storage may take and how often it is retried comes from `StorageLimits` (`LOGITSTORE_STORAGE_*`).
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import icechunk

from logitstore.errors import StorageError, StoreNotFoundError
from logitstore.storage.blobs import BlobStore, LocalBlobs, MemoryBlobs, S3Blobs
from logitstore.storage.limits import StorageLimits

INDEX_PREFIX = "logitstore-index"

# Icechunk warns on every local open that its local storage lacks atomic compare-and-swap; logitstore
# serialises local commits with a file lock (`commit_lock`), so the warning would only be noise.
if "ICECHUNK_LOG" not in os.environ:
    icechunk.set_logs_filter("icechunk=error")


def _folder_path(path: Path, *, text: str) -> str:
    """A local store is a folder: a regular file there (or on the way there), or a symbolic link that
    leads back to itself, is refused in one line here, before a model loads; Icechunk's local storage
    would panic on it ("File exists")."""
    try:
        path = path.resolve()
    except RuntimeError:  # a symbolic link loop (Python 3.13 raises OSError ELOOP instead)
        raise StoreNotFoundError(f"{text} is a symbolic link that leads back to itself, not a store folder") from None
    except OSError as e:
        raise StoreNotFoundError(f"{text} cannot be resolved: {e.strerror or e}") from None
    for at in (path, *path.parents):
        if at.exists():
            if not at.is_dir():
                where = "is a file" if at == path else f"lies under {at}, which is a file"
                raise StoreNotFoundError(f"{text} {where}, not a store folder; give a folder's path")
            break
    return str(path)


# memory:// stores live as long as the process; the registry lets a name be opened again.
_MEMORY_STORES: dict[str, tuple[icechunk.Storage, MemoryBlobs]] = {}
_MEMORY_LOCK = threading.Lock()


@dataclass(frozen=True)
class Location:
    uri: str  # as the user wrote it, for messages
    scheme: str  # "file", "s3" or "memory"
    path: str  # local path, "bucket/prefix", or memory name

    @classmethod
    def parse(cls, uri: str | os.PathLike) -> Location:
        text = os.fspath(uri)
        if not text:
            raise StorageError("the store location is empty")
        parsed = urlparse(text)
        if parsed.scheme == "memory":
            return cls(text, "memory", parsed.netloc + parsed.path)
        if parsed.scheme == "s3":
            if not parsed.netloc:
                raise StorageError(f"{text}: an S3 location needs a bucket, e.g. s3://bucket/prefix")
            return cls(text, "s3", f"{parsed.netloc}/{parsed.path.strip('/')}".rstrip("/"))
        if parsed.scheme and parsed.scheme != "file" and len(parsed.scheme) > 1:  # one letter: a Windows drive
            raise StorageError(
                f"{text}: unsupported scheme {parsed.scheme!r} (use a path, file://, s3:// or memory://)"
            )
        # a URL: "file:///data/my%20store" is the folder "/data/my store"
        path = Path(unquote(parsed.path)) if parsed.scheme == "file" else Path(text).expanduser()
        return cls(text, "file", _folder_path(path, text=text))

    @property
    def bucket(self) -> str:
        return self.path.split("/", 1)[0]

    @property
    def prefix(self) -> str:
        return self.path.split("/", 1)[1] if "/" in self.path else ""

    def storage_and_blobs(self) -> tuple[icechunk.Storage, BlobStore]:
        if self.scheme == "memory":
            with _MEMORY_LOCK:
                if self.path not in _MEMORY_STORES:
                    _MEMORY_STORES[self.path] = (icechunk.in_memory_storage(), MemoryBlobs())
                return _MEMORY_STORES[self.path]
        if self.scheme == "file":
            return icechunk.local_filesystem_storage(self.path), LocalBlobs(Path(self.path) / INDEX_PREFIX)
        return self._s3_storage_and_blobs()

    def _s3_storage_and_blobs(self) -> tuple[icechunk.Storage, BlobStore]:
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        limits = StorageLimits.from_env()
        if endpoint:
            check_endpoint_reachable(endpoint, timeout_s=min(5.0, limits.timeout_s), where=self.uri)
        storage = icechunk.s3_storage(
            bucket=self.bucket,
            prefix=self.prefix or None,
            region=region,
            endpoint_url=endpoint,
            allow_http=bool(endpoint and endpoint.startswith("http://")),
            # Custom endpoints (MinIO, moto, Ceph) rarely support virtual-host-style bucket addressing.
            force_path_style=bool(endpoint),
            from_env=True,
            # a download whose bytes stop coming; a request with no answer at all is `bounded.py`'s
            network_stream_timeout_seconds=max(1, math.ceil(limits.timeout_s)),
        )
        index_prefix = f"{self.prefix}/{INDEX_PREFIX}" if self.prefix else INDEX_PREFIX
        blobs = S3Blobs(bucket=self.bucket, prefix=index_prefix, endpoint_url=endpoint, region=region, limits=limits)
        return storage, blobs


@contextlib.contextmanager
def commit_lock(location: Location) -> Iterator[None]:
    """Serialise commits to a local store across processes.

    Icechunk's local-filesystem storage has no conditional writes, so two processes committing at
    once could both move the branch. S3 and memory storage are atomic by themselves and need no lock.
    """
    if location.scheme != "file":
        yield
        return
    import fcntl  # POSIX only, and only local stores need it

    try:
        f = open(Path(location.path) / ".logitstore-commit.lock", "a+")
    except OSError as e:  # a read-only filesystem or folder: the first write of a command lands here
        raise StorageError(f"cannot write to store {location.uri}: {e.strerror or e}") from None
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def check_endpoint_reachable(endpoint: str, *, timeout_s: float = 5.0, where: str | None = None) -> None:
    """Fail in seconds with a clear message; Icechunk's own retries take ~40 s to give up."""
    parsed = urlparse(endpoint)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=timeout_s):
            pass
    except OSError as e:
        store = f"{where}: " if where else ""
        raise StorageError(f"{store}cannot reach the S3 endpoint {endpoint} (AWS_ENDPOINT_URL): {e}") from None
