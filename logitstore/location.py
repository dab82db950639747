"""Where a store lives: a local path, `file://`, `s3://bucket/prefix` or `memory://name`.

A location yields two things: the Icechunk `Storage` that holds the versioned Zarr arrays, and the
`BlobStore` beside it that holds the Parquet sample indexes (see `blobs.py`).
S3 settings come from the standard AWS environment variables (`AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ENDPOINT_URL`; an `http://` endpoint is allowed).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator
from urllib.parse import urlparse

import icechunk

from logitstore.blobs import BlobStore, LocalBlobs, MemoryBlobs, S3Blobs
from logitstore.errors import StorageError

INDEX_PREFIX = "logitstore-index"

# Icechunk warns on every local open that its local storage lacks atomic compare-and-swap; logitstore
# serialises local commits with a file lock (`commit_lock`), so the warning would only be noise.
if "ICECHUNK_LOG" not in os.environ:
    icechunk.set_logs_filter("icechunk=error")

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
        if parsed.scheme == "file":
            return cls(text, "file", str(Path(parsed.path).resolve()))
        if parsed.scheme and len(parsed.scheme) > 1:  # one letter would be a Windows drive
            raise StorageError(f"{text}: unsupported scheme {parsed.scheme!r} (use a path, file://, s3:// or memory://)")
        return cls(text, "file", str(Path(text).expanduser().resolve()))

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
        if endpoint:
            check_endpoint_reachable(endpoint)
        storage = icechunk.s3_storage(
            bucket=self.bucket,
            prefix=self.prefix or None,
            region=region,
            endpoint_url=endpoint,
            allow_http=bool(endpoint and endpoint.startswith("http://")),
            # Custom endpoints (MinIO, moto, Ceph) rarely support virtual-host-style bucket addressing.
            force_path_style=bool(endpoint),
            from_env=True,
        )
        index_prefix = f"{self.prefix}/{INDEX_PREFIX}" if self.prefix else INDEX_PREFIX
        blobs = S3Blobs(bucket=self.bucket, prefix=index_prefix, endpoint_url=endpoint, region=region)
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
    import fcntl

    with open(Path(location.path) / ".logitstore-commit.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def check_endpoint_reachable(endpoint: str, *, timeout_s: float = 5.0) -> None:
    """Fail in seconds with a clear message; Icechunk's own retries take ~40 s to give up."""
    parsed = urlparse(endpoint)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=timeout_s):
            pass
    except OSError as e:
        raise StorageError(f"cannot reach the S3 endpoint {endpoint} (AWS_ENDPOINT_URL): {e}") from None
