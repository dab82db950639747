"""A packed part (store format 3 and 4) seen as ordinary Zarr arrays again: `PackedStore`.

Since format 3 a part's arrays are one object: `parts/<part>/packed`, a uint8 Zarr array of one
chunk that holds every array's shards end to end (`rawwrite.pack`). On object storage that is one
request per part instead of one per array (7-8), which is what a reader on S3 pays per part. Its
attribute `layout.MEMBERS` keeps, for each array, the zarr.json it would have as an array of its own
and where its shards lie in the packed chunk, so the arrays themselves are as they would be alone: their
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

import numpy as np
from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype

from logitstore.format import layout
from logitstore.format.grid import CodecParams
from logitstore.format.zarr_codec import grid_of, same_grid


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


def checked_members(document: dict, *, names: Iterable[str], where: str, grid: CodecParams | None) -> dict:
    """A packed array's member table, from its zarr.json (`shape` and `attributes` are what it reads),
    checked against what its arrays must be before any of them is read: every array of `names` held;
    each member a 1-D array of a data type its name allows, with no more shards than its shape has; the
    log-probability arrays (`layout.GRID_ARRAYS`) on the teacher's value grid `grid` (its
    `TeacherMeta.grid`: float32 through the grid codec with these steps, or uint16 codes where None); the
    part's arrays of one axis (`layout.AXIS`) of one length; every shard a range of whole bytes inside
    the object, no two overlapping. A table that fails (a tampered or buggy commit) raises `ValueError`,
    which `read_errors` makes damage of the part's samples. Runs once per part opened: a loop over its
    few members and one sort of its few shards' ranges (~30 us for a part of 8 arrays). What no table
    can show (two members' shards swapped, a shard left out as if it held only fill values) the
    samples' content hashes catch where the part is read (`reader.PartReader`)."""
    try:
        members = dict(document["attributes"][layout.MEMBERS])
        size = _whole_number(document["shape"][0])
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise ValueError(f"{where}/zarr.json holds no member table ({type(e).__name__})") from None
    if missing := [name for name in names if name not in members]:
        raise ValueError(f"{where} holds no {', '.join(missing)} in its member table")
    spans: list[tuple[int, int]] = []
    lengths: dict[str, dict[int, str]] = {}  # axis -> {length: a member of that length}
    for name, member in members.items():  # a few members per part
        try:
            length, held = _member(name, member, grid=grid)
        except (KeyError, TypeError, IndexError, ValueError, AttributeError) as e:
            raise ValueError(f"the member table of {where} is damaged at {name} ({e or type(e).__name__})") from None
        spans += held
        if name in layout.AXIS:
            lengths.setdefault(layout.AXIS[name], {})[length] = name
    if disagree := next((axis for axis, seen in lengths.items() if len(seen) > 1), None):
        pair = ", ".join(f"{name} of {n}" for n, name in sorted(lengths[disagree].items()))
        raise ValueError(f"the member table of {where} gives the {disagree} axis two lengths ({pair})")
    _check_spans(np.array(spans, dtype=np.int64).reshape(-1, 2), size=size, where=where)
    return members


def array_members(array, *, names: Iterable[str], where: str, grid: CodecParams | None) -> dict:
    """`checked_members` of an opened packed array (a `zarr.Array`)."""
    document = {"shape": list(array.shape), "attributes": dict(array.attrs)}
    return checked_members(document, names=names, where=where, grid=grid)


def _member(name: str, member: dict, *, grid: CodecParams | None) -> tuple[int, list[tuple[int, int]]]:
    """A member's length and its shards' (offset, length), checked (ValueError names what is wrong)."""
    meta = member["zarr"]
    if not isinstance(meta["shape"], list) or len(meta["shape"]) != 1:
        raise ValueError(f"shape {meta['shape']!r} is not 1-D")
    length = _whole_number(meta["shape"][0])
    if meta["data_type"] not in layout.data_types(name):
        raise ValueError(f"data type {meta['data_type']!r} is not one of {layout.data_types(name)}")
    if name in layout.GRID_ARRAYS:
        _check_grid(meta, grid=grid)
    per_object = _whole_number(meta["chunk_grid"]["configuration"]["chunk_shape"][0])
    objects = member["objects"]
    if not isinstance(objects, list) or len(objects) > -(-length // max(per_object, 1)):
        raise ValueError(f"{len(objects)} shards listed for {length} elements")
    if any(not isinstance(o, list) or len(o) != 2 for o in objects if o is not None):
        raise ValueError("a shard is not [offset, length]")
    held = [(_whole_number(o[0]), _whole_number(o[1])) for o in objects if o is not None]
    if any(n == 0 for _, n in held):  # a shard holds at least its index and checksum
        raise ValueError("a shard of 0 bytes")
    return length, held


def _check_grid(meta: dict, *, grid: CodecParams | None) -> None:
    """A log-probability member on its teacher's value grid: the same steps (another grid decodes every
    code to another value), or uint16 codes without a grid where the teacher stores codes."""
    held = grid_of(meta)
    if grid is None and (held is not None or meta["data_type"] != "uint16"):
        raise ValueError("a value grid where its teacher stores uint16 codes")
    if grid is not None and (held is None or meta["data_type"] != "float32" or not same_grid(held, grid)):
        steps = lambda g: "none" if g is None else f"fine_step {g.fine_step}, coarse_step {g.coarse_step}"
        raise ValueError(f"value grid {steps(held)}, not its teacher's {steps(grid)}")


def _whole_number(value) -> int:
    """A non-negative integer of the JSON (not a bool, a float or a string)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{value!r} is not a non-negative integer")
    return value


def _check_spans(spans: np.ndarray, *, size: int, where: str) -> None:
    """Shards' [offset, offset + length) inside an object of `size` bytes and disjoint (vectorised)."""
    ends = spans[:, 0] + spans[:, 1]
    if len(spans) and int(ends.max()) > size:
        raise ValueError(f"the member table of {where} puts a shard past the object's {size} bytes")
    order = np.argsort(spans[:, 0], kind="stable")
    if np.any(spans[order[1:], 0] < ends[order[:-1]]):
        raise ValueError(f"the member table of {where} puts two shards on the same bytes")
