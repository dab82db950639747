"""A packed part (store format 3 and 4) seen as ordinary Zarr arrays again: `PackedStore`.

Since format 3 a part's arrays are one object: `parts/<part>/packed`, a uint8 Zarr array of one
chunk that holds every array's shards end to end (`rawwrite.pack`). On object storage that is one
request per part instead of one per array (7-8), which is what a reader on S3 pays per part. Its
attribute `layout.MEMBERS` keeps, for each array, the zarr.json it would have as an array of its own
and where its shards lie in the packed chunk, so nothing about the arrays themselves changed: their
bytes are the same shards, with the same codecs and checksums. Since format 4 a cross-tokenizer
teacher's student-token arrays are members too, named by their path in the part (`students/<s>/ids`).

`PackedStore` is a read-only Zarr store whose keys are those arrays' keys (`<name>/zarr.json`,
`<name>/c/<shard>`): a shard is a byte range of the packed chunk, so Zarr's own sharded reads (the
shard index, then the inner chunks a slice needs) become ranged reads of the one object. Everything
that slices a part's arrays (one sample's read, the eval split's ranges, `verify`) goes through it;
the stream's whole-part read (`rawread.read_packed`) fetches the object once and splits it itself.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable

from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype

from logitstore import layout


def chunk_key(path: str) -> str:
    """The key of a packed array's one chunk (Zarr's default chunk key encoding, one chunk)."""
    return f"{path}/c/0"


def member_range(members: dict, name: str, shard: int) -> tuple[int, int] | None:
    """(offset, length) of one shard of one member in the packed chunk; None where Zarr wrote none."""
    objects = members[name]["objects"]
    if shard >= len(objects) or objects[shard] is None:
        return None
    offset, length = objects[shard]
    return int(offset), int(length)


class PackedStore(Store):
    """The arrays of one packed part, read-only, as keys of a Zarr store (see the module docstring).
    `store` is the version's store (logitstore's `BoundedStore`, so deadlines and error mapping hold),
    `path` the packed array's path in it, `members` its `layout.MEMBERS` attribute."""

    def __init__(self, store: Store, *, path: str, members: dict):
        super().__init__(read_only=True)
        self._store, self._path, self._members = store, path, members

    @property
    def names(self) -> list[str]:
        """The arrays it holds."""
        return list(self._members)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PackedStore) and (other._store, other._path) == (self._store, self._path)

    def __hash__(self) -> int:
        return hash((id(self._store), self._path))

    async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        name, shard = _split_key(key)
        if name not in self._members:
            return None
        if shard is None:
            document = json.dumps(self._members[name]["zarr"]).encode()
            return prototype.buffer.from_bytes(document if byte_range is None else _cut(document, byte_range))
        where = member_range(self._members, name, shard)
        if where is None:
            return None
        offset, length = where
        start, stop = _bounds(byte_range, length)
        return await self._store.get(chunk_key(self._path), prototype, RangeByteRequest(offset + start, offset + stop))

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        return list(await asyncio.gather(*(self.get(key, prototype, byte_range) for key, byte_range in key_ranges)))

    async def exists(self, key: str) -> bool:
        return key in set(self._keys())

    @property
    def supports_writes(self) -> bool:
        return False

    @property
    def supports_deletes(self) -> bool:
        return False

    @property
    def supports_listing(self) -> bool:
        return True

    async def set(self, key: str, value: Buffer) -> None:
        raise NotImplementedError("a packed part is immutable")

    async def delete(self, key: str) -> None:
        raise NotImplementedError("a packed part is immutable")

    def _keys(self) -> list[str]:
        keys = []
        for name, member in self._members.items():
            keys.append(f"{name}/zarr.json")
            keys += [f"{name}/c/{i}" for i, o in enumerate(member["objects"]) if o is not None]
        return keys

    async def list(self) -> AsyncIterator[str]:
        for key in self._keys():
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        for key in self._keys():
            if key.startswith(prefix):
                yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        prefix = prefix.rstrip("/")
        seen = set()
        for key in self._keys():
            if prefix and not key.startswith(prefix + "/"):
                continue
            child = key[len(prefix) + 1 if prefix else 0 :].split("/", 1)[0]
            if child not in seen:
                seen.add(child)
                yield child


def _split_key(key: str) -> tuple[str, int | None]:
    """(member, shard number) of a chunk's key, (member, None) of a zarr.json's; ("", None) for any other.
    A member's name may hold slashes (a student tokenizer's arrays: `students/<s>/ids`)."""
    if key.endswith("/zarr.json"):
        return key[: -len("/zarr.json")], None
    name, _, shard = key.rpartition("/c/")
    return (name, int(shard)) if shard.isdigit() else ("", None)


def _bounds(byte_range: ByteRequest | None, length: int) -> tuple[int, int]:
    """[start, stop) within an object of `length` bytes."""
    if byte_range is None:
        return 0, length
    if isinstance(byte_range, RangeByteRequest):
        return min(byte_range.start, length), min(byte_range.end, length)
    if isinstance(byte_range, OffsetByteRequest):
        return min(byte_range.offset, length), length
    if isinstance(byte_range, SuffixByteRequest):
        return max(0, length - byte_range.suffix), length
    raise TypeError(f"unexpected byte range {byte_range!r}")


def _cut(data: bytes, byte_range: ByteRequest) -> bytes:
    start, stop = _bounds(byte_range, len(data))
    return data[start:stop]


def members_of(attrs: dict) -> dict:
    """A packed array's member table, from its attributes."""
    return dict(attrs[layout.MEMBERS])
