"""Plain files beside the Icechunk repository: the Parquet sample indexes.

Icechunk versions Zarr arrays, not arbitrary files, so the sample index (a Parquet file that users read
with polars or pyarrow directly) lives next to the repository under `logitstore-index/`. Index files are
content-addressed and immutable: a version's commit metadata names the file it uses, so writing a file
is never a visible change by itself, and a writer killed half-way leaves at worst an orphan file.

One tiny interface, three backends (local disk, S3, process memory), one conformance suite
(`tests/test_blobs.py`) run against all of them, in the manner of zarr-python's `storage/`.
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path

from logitstore.errors import StorageError
from logitstore.files import replace_file
from logitstore.storage.limits import StorageLimits


class BlobStore(ABC):
    """Whole-object get/put under one prefix. Every `put` is atomic: readers see all of it or nothing."""

    @abstractmethod
    def put(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def get(self, key: str) -> bytes:
        """Raises `KeyError` if the object does not exist."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Keys that start with `prefix`, sorted."""

    @abstractmethod
    def url(self, key: str) -> str:
        """Where a user can read the object with other tools (a path or an s3:// URL)."""


class LocalBlobs(BlobStore):
    def __init__(self, root: Path):
        self.root = Path(root)

    def put(self, key: str, data: bytes) -> None:
        target = self.root / key
        with _disk_errors(f"cannot write {target}"):
            target.parent.mkdir(parents=True, exist_ok=True)
            replace_file(target, data)  # a crash leaves a stray temp file, never a truncated object

    def get(self, key: str) -> bytes:
        try:
            with _disk_errors(f"cannot read {self.root / key}"):
                return (self.root / key).read_bytes()
        except FileNotFoundError:
            raise KeyError(key) from None

    def exists(self, key: str) -> bool:
        return (self.root / key).is_file()

    def list(self, prefix: str = "") -> list[str]:
        if not self.root.exists():
            return []
        keys = (p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file())
        return sorted(k for k in keys if k.startswith(prefix) and not Path(k).name.startswith(".tmp-"))

    def url(self, key: str) -> str:
        return str(self.root / key)


@contextlib.contextmanager
def _disk_errors(what: str) -> Iterator[None]:
    """A full disk, a read-only folder or an I/O error: one line (`StorageError`), not a traceback.
    A missing file stays `FileNotFoundError`, which `get` turns into `KeyError`."""
    try:
        yield
    except FileNotFoundError:
        raise
    except OSError as e:
        raise StorageError(f"{what}: {e.strerror or e}") from None


class MemoryBlobs(BlobStore):
    def __init__(self) -> None:
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes) -> None:
        with self._lock:
            self._objects[key] = bytes(data)

    def get(self, key: str) -> bytes:
        with self._lock:
            return self._objects[key]

    def exists(self, key: str) -> bool:
        with self._lock:
            return key in self._objects

    def list(self, prefix: str = "") -> list[str]:
        with self._lock:
            return sorted(k for k in self._objects if k.startswith(prefix))

    def url(self, key: str) -> str:
        return f"memory://{key}"


class S3Blobs(BlobStore):
    """S3 through boto3: a single PUT is atomic on S3, so no temp-and-rename is needed."""

    def __init__(
        self,
        *,
        bucket: str,
        prefix: str,
        endpoint_url: str | None,
        region: str | None,
        limits: StorageLimits | None = None,
    ):
        import boto3  # boto3 and botocore: 0.14 s more at every command's start, and only S3 stores need them

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        # Timeouts and retries as for the Icechunk repository beside it (LOGITSTORE_STORAGE_*).
        config = (limits or StorageLimits.from_env()).botocore_config()
        self._client = boto3.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, data: bytes) -> None:
        self._call(
            lambda: self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data),
            what=f"writing s3://{self.bucket}/{self._key(key)}",
        )

    def get(self, key: str) -> bytes:
        from botocore.exceptions import ClientError  # as boto3 above

        try:
            # the body is read inside the mapping too: a connection lost mid-body is an outage as well
            return self._call(
                lambda: self._client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read(),
                what=f"reading s3://{self.bucket}/{self._key(key)}",
            )
        except ClientError:  # only a missing key gets past `_call`
            raise KeyError(key) from None

    def exists(self, key: str) -> bool:
        try:
            self.get(key)
            return True
        except KeyError:
            return False

    def list(self, prefix: str = "") -> list[str]:
        paginator = self._client.get_paginator("list_objects_v2")
        keys: list[str] = []
        strip = len(self.prefix) + 1 if self.prefix else 0
        pages = self._call(
            lambda: list(paginator.paginate(Bucket=self.bucket, Prefix=self._key(prefix))),
            what=f"listing s3://{self.bucket}/{self._key(prefix)}",
        )
        for page in pages:
            keys.extend(obj["Key"][strip:] for obj in page.get("Contents", []))
        return sorted(keys)

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"

    def _call(self, fn, *, what: str):
        """`fn()` with boto3's failures as one-line `StorageError`s; a `ClientError` that names a
        missing key passes through, for `get` to turn into `KeyError`."""
        from botocore.exceptions import BotoCoreError, ClientError  # as boto3 above

        try:
            return fn()
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise
            raise StorageError(f"S3 error {what}: {_one_line(e)}") from None
        except BotoCoreError as e:  # no connection, a timeout, a connection lost mid-body
            raise StorageError(f"S3 error {what}: {_one_line(e)}") from None


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())
