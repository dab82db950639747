"""A new part's arrays, written without zarr-python's per-array machinery: the build's hot path.

Why not plain Zarr: writing one 16k-token part through zarr-python costs ~50 ms of overhead here beyond
the compression itself (per array: existence checks, its parents' documents, one hand-over to Zarr's
event loop for creating it and one for writing it, then its shard through the async codec pipeline),
which caps one process at ~190k tokens/s at sampled-16. Here a part costs its compression (inner
chunks spread over a few threads: Blosc and CRC32C release the GIL) and two concurrent rounds of
requests on Zarr's event loop: every metadata document, then every shard.

What it writes: exactly what `writer.write_array` writes through Zarr, object for object and byte for
byte (`tests/test_store.py` compares the two): each array's zarr.json is made by Zarr itself (from a
template array per layout, with the shape set), its shards are `sharding_indexed` with the index at
the end (`bytes -> crc32c`) over inner chunks `bytes -> blosc -> crc32c`, the last chunk padded with
the fill value; an inner chunk holding only the fill value is left out of its shard, and a shard of
only such chunks is not written, as Zarr does (`write_empty_chunks` off). `rawread.py` is its reader.
Requests go through the store given (logitstore's `BoundedStore`), so deadlines and error mapping hold.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import cast

import google_crc32c
import numpy as np
import zarr
from numcodecs import Blosc
from zarr.codecs import BloscCodec, Crc32cCodec, ShardingCodec
from zarr.core.buffer import default_buffer_prototype
from zarr.core.chunk_grids import RegularChunkGrid
from zarr.core.group import GroupMetadata
from zarr.core.metadata import ArrayV3Metadata
from zarr.core.sync import sync

from logitstore.format.layout import MEMBERS
from logitstore.format.zarr_codec import LogprobGrid

_EMPTY = np.uint64(2**64 - 1)  # the shard index's offset and length of an inner chunk not written
# Threads that compress a part's inner chunks: a 16k-token part at top-64 has ~25 of 256 KiB.
_THREADS = max(1, min(8, os.cpu_count() or 1))
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


@dataclasses.dataclass
class EncodedArray:
    """One array as the objects it is stored as: its zarr.json and its shards (by shard number)."""

    document: bytes
    shards: dict[int, bytes]

    @property
    def nbytes(self) -> int:
        """What Zarr's `nbytes_stored` reports for it: the document and every shard."""
        return len(self.document) + sum(len(s) for s in self.shards.values())


class PendingArrays:
    """Arrays being compressed in the background; `result()` waits for them. The caller meanwhile does
    other work (the index rows' hashes), which the compressing threads do not hold up."""

    def __init__(self, arrays: dict[str, tuple[np.ndarray, dict]]):
        self._parts = {path: _start(values, create_kwargs) for path, (values, create_kwargs) in arrays.items()}

    def result(self) -> dict[str, EncodedArray]:
        out = {}
        for path, (document, chunking, chunks) in self._parts.items():
            shards: dict[int, bytes] = {}
            for shard_number, shard_chunks in enumerate(_batches(chunks, chunking.chunks_per_shard)):
                blob = _shard([c.result() for c in shard_chunks], chunking.chunks_per_shard)
                if blob is not None:
                    shards[shard_number] = blob
            out[path] = EncodedArray(document=document, shards=shards)
        return out


def encode_arrays(arrays: dict[str, tuple[np.ndarray, dict]]) -> PendingArrays:
    """Start compressing 1-D arrays, each given with the keyword arguments `zarr.create_array` would get
    for it (shape, dtype, chunks, shards, compressors, fill_value: see `layout.array_kwargs`)."""
    return PendingArrays(arrays)


def group_document(attributes: dict) -> bytes:
    """A group's zarr.json, as Zarr writes it for a group with these attributes."""
    return GroupMetadata(attributes=attributes).to_buffer_dict(default_buffer_prototype())["zarr.json"].to_bytes()


@dataclasses.dataclass(frozen=True)
class Member:
    """One array of a packed part: its zarr.json as Zarr rendered it, and [offset, length] of each of its
    objects in the packed chunk (None: not written)."""

    document: bytes
    objects: list[list[int] | None]


def pack(arrays: dict[str, EncodedArray]) -> tuple[bytes, dict[str, Member]]:
    """Arrays (by name) as one packed chunk (store format 3, `packed.py`): their shards end to end, and
    the member table (`layout.MEMBERS`) that says where each lies and holds each array's zarr.json."""
    pieces: list[bytes] = []
    members: dict[str, Member] = {}
    offset = 0
    for name, array in arrays.items():
        n_objects = max(array.shards, default=-1) + 1
        objects: list[list[int] | None] = [None] * n_objects
        for number, blob in sorted(array.shards.items()):  # a shard or a few per array
            objects[number] = [offset, len(blob)]
            pieces.append(blob)
            offset += len(blob)
        members[name] = Member(array.document, objects)
    return b"".join(pieces), members


def packed_document(length: int, members: dict[str, Member]) -> bytes:
    """The zarr.json of a packed array of `length` bytes: uint8, one chunk, no codec beyond `bytes` (its
    members are compressed and checksummed already), the member table as its attribute. Byte for byte
    what Zarr renders (`zarr_packed_document`), spliced: Zarr's rendering of the template around the
    member table, and the table made of the members' own documents, re-indented. Zarr's rendering of the
    whole table re-encodes every member's document through Python's JSON encoder with an indent, ~2 ms a
    part holding the GIL, on the write's critical path."""
    if length == 0:  # the shape and the chunk's differ (0 and 1): no splice
        return zarr_packed_document(length, members)
    before, after, indent = _packed_splice()
    table = _members_text(members, indent=indent)
    mark, value = str(_LENGTH_MARK).encode(), str(length).encode()
    return before.replace(mark, value) + table + after.replace(mark, value)


def zarr_packed_document(length: int, members: dict[str, Member]) -> bytes:
    """`packed_document` as Zarr renders it whole (the reference the splice is tested against)."""
    table = {name: {"zarr": json.loads(m.document), "objects": m.objects} for name, m in members.items()}
    return (
        dataclasses.replace(
            _packed_template(),
            shape=(length,),
            chunk_grid=RegularChunkGrid(chunk_shape=(max(1, length),)),
            attributes={MEMBERS: table},
        )
        .to_buffer_dict(default_buffer_prototype())["zarr.json"]
        .to_bytes()
    )


_TABLE_MARK = "logitstore-member-table-goes-here"


@functools.lru_cache(maxsize=1)
def _packed_splice() -> tuple[bytes, bytes, int]:
    """Zarr's packed document around its member table: (text before the table, text after, the indent of
    the table's line); the length appears as `_LENGTH_MARK` in the shape and the chunk's shape."""
    metadata = dataclasses.replace(
        _packed_template(),
        shape=(_LENGTH_MARK,),
        chunk_grid=RegularChunkGrid(chunk_shape=(_LENGTH_MARK,)),
        attributes={MEMBERS: _TABLE_MARK},
    )
    text = metadata.to_buffer_dict(default_buffer_prototype())["zarr.json"].to_bytes()
    mark = json.dumps(_TABLE_MARK).encode()
    assert text.count(mark) == 1, "the member table's place appears once in the packed document"
    before, after = text.split(mark)
    return before, after, _line_indent(before)


def _line_indent(before: bytes) -> int:
    """The indent of the line the text `before` ends in (the member table's key)."""
    line = before[before.rfind(b"\n") + 1 :]
    return len(line) - len(line.lstrip(b" "))


def _members_text(members: dict[str, Member], *, indent: int) -> bytes:
    """The member table as `json.dumps(table, indent=2)` renders it nested at `indent` spaces: each
    member's document (rendered by Zarr with indent 2) re-indented, not re-encoded."""
    if not members:
        return b"{}"
    pad = b" " * indent
    rows = []
    for name, member in members.items():
        inner = pad + b"    "
        document = member.document.replace(b"\n", b"\n" + inner)
        objects = json.dumps(member.objects, indent=2).encode().replace(b"\n", b"\n" + inner)
        key = json.dumps(name).encode()
        rows.append(
            pad
            + b"  "
            + key
            + b": {\n"
            + inner
            + b'"zarr": '
            + document
            + b",\n"
            + inner
            + b'"objects": '
            + objects
            + b"\n"
            + pad
            + b"  }"
        )
    return b"{\n" + b",\n".join(rows) + b"\n" + pad + b"}"


@functools.lru_cache(maxsize=1)
def _packed_template() -> ArrayV3Metadata:
    array = zarr.create_array(
        zarr.storage.MemoryStore(), shape=(1,), dtype=np.uint8, chunks=(1,), compressors=None, fill_value=0
    )
    assert isinstance(array.metadata, ArrayV3Metadata)  # create_array's default format
    return array.metadata


def write_objects(
    store, *, documents: dict[str, bytes], arrays: dict[str, EncodedArray], objects: dict[str, bytes] | None = None
) -> None:
    """Write the documents (groups' and arrays' zarr.json, by key) and then the arrays' shards and the
    other chunk `objects` (by key), each round as concurrent requests in one hand-over to Zarr's event
    loop (Icechunk takes an array's chunks only once its document is there)."""
    prototype = default_buffer_prototype()
    docs = {**documents, **{f"{path}/zarr.json": a.document for path, a in arrays.items()}}
    shards = {f"{path}/c/{n}": blob for path, a in arrays.items() for n, blob in a.shards.items()}
    shards.update(objects or {})

    async def put(objects: dict[str, bytes]) -> None:
        await asyncio.gather(*(store.set(key, prototype.buffer.from_bytes(blob)) for key, blob in objects.items()))

    async def both() -> None:
        await put(docs)
        await put(shards)

    sync(both())


# -- encoding -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Chunking:
    """How a new array is cut into inner chunks and shards, and how each chunk is compressed."""

    chunk: int  # elements per inner chunk
    chunks_per_shard: int
    blosc: Blosc
    fill_value: int


def _start(values: np.ndarray, create_kwargs: dict) -> tuple[bytes, _Chunking, list[Future]]:
    values = np.ascontiguousarray(values, dtype=np.asarray(values).dtype.newbyteorder("<"))
    chunking, (before, after) = _template(**_template_key(values, create_kwargs))
    document = before + str(len(values)).encode() + after
    pool = _threads()
    chunks = []
    for start in range(0, len(values), chunking.chunk):  # one step per 256 KiB inner chunk
        chunks.append(pool.submit(_chunk, values[start : start + chunking.chunk], chunking))
    # Zarr writes whole shards: inner chunks past the array's end (in its last shard) hold only the
    # fill value and are left out like any such chunk.
    return document, chunking, chunks


def _template_key(values: np.ndarray, kwargs: dict) -> dict:
    # A grid-coded array (`format/zarr_codec.py`) is declared float32 and written from its uint16 codes.
    filters = kwargs.get("filters") or []
    stored = np.dtype(np.uint16) if filters else np.dtype(kwargs["dtype"]).newbyteorder("<")
    if tuple(kwargs["shape"]) != values.shape or stored != values.dtype:
        raise ValueError(
            f"arguments for a {kwargs['dtype']} array of shape {kwargs['shape']}, "
            f"values {values.dtype} of shape {values.shape}"
        )
    blosc, crc = kwargs["compressors"]
    return {
        "dtype": np.dtype(kwargs["dtype"]).str,
        "chunk": kwargs["chunks"][0],
        "shard": kwargs["shards"][0],
        "blosc": json.dumps(blosc.to_dict(), sort_keys=True),
        "crc": json.dumps(crc.to_dict(), sort_keys=True),
        "fill_value": kwargs["fill_value"],
        "filters": json.dumps([f.to_dict() for f in filters], sort_keys=True),
    }


# A length no array has: the template's document is rendered with it, and an array's document is the text
# around it with the array's length in its place. Zarr renders metadata through Python's JSON encoder with
# an indent (~0.1-2.5 ms a document, holding the GIL; a part has 6-8 of them); the splice costs a
# concatenation. The length appears once, as the shape's one number (checked at the template).
_LENGTH_MARK = 918_273_645_546_372_819


@functools.lru_cache(maxsize=64)
def _template(*, dtype: str, chunk: int, shard: int, blosc: str, crc: str, fill_value, filters: str):
    """How to encode chunks for this layout, and Zarr's own zarr.json for it (an array made once in memory)
    around its length: (chunking, (text before the length, text after))."""
    blosc_codec = BloscCodec.from_dict(json.loads(blosc))
    grid = [LogprobGrid.from_dict(f) for f in json.loads(filters)]
    array = zarr.create_array(
        zarr.storage.MemoryStore(),
        shape=(shard,),
        dtype=np.dtype(dtype),
        chunks=(chunk,),
        shards=(shard,),
        compressors=[blosc_codec, Crc32cCodec.from_dict(json.loads(crc))],
        fill_value=fill_value,
        filters=grid or None,
    )
    metadata = array.metadata
    assert isinstance(metadata, ArrayV3Metadata)  # create_array's default format
    (sharding,) = metadata.codecs
    assert isinstance(sharding, ShardingCodec)  # with `shards`, zarr puts every other codec inside this one
    inner = [c.to_dict() for c in sharding.codecs[len(grid) :]]  # the grid codec, if any, comes first
    expected = ["bytes", "blosc", "crc32c"]
    if (
        [c["name"] for c in inner] != expected
        or sharding.index_location.value != "end"
        or [c.to_dict()["name"] for c in sharding.index_codecs] != ["bytes", "crc32c"]
    ):
        raise NotImplementedError(f"zarr laid the array out as {inner}; rawwrite writes {expected} only")
    config = cast(dict, inner[1]["configuration"])  # BloscCodec.to_dict's, a JSON object
    shuffle = {"noshuffle": Blosc.NOSHUFFLE, "shuffle": Blosc.SHUFFLE, "bitshuffle": Blosc.BITSHUFFLE}[
        config["shuffle"]
    ]
    # As zarr's BloscCodec builds its numcodecs codec (typesize passed: numcodecs >= 0.16).
    codec = Blosc.from_config(
        {
            "cname": config["cname"],
            "clevel": config["clevel"],
            "shuffle": shuffle,
            "blocksize": config["blocksize"],
            "typesize": config["typesize"],
        }
    )
    document = (
        dataclasses.replace(metadata, shape=(_LENGTH_MARK,))
        .to_buffer_dict(default_buffer_prototype())["zarr.json"]
        .to_bytes()
    )
    before, mark, after = document.partition(str(_LENGTH_MARK).encode())
    assert mark and mark not in after, "the length appears once in an array's zarr.json"
    # Chunks are encoded from the stored values: for a grid-coded array, codes, whose fill (0.0) is code 0.
    chunking = _Chunking(
        chunk=chunk, chunks_per_shard=shard // chunk, blosc=codec, fill_value=0 if grid else fill_value
    )
    return chunking, (before, after)


def _chunk(values: np.ndarray, chunking: _Chunking) -> bytes | None:
    """One inner chunk: padded with the fill value to full size, Blosc, CRC32C appended; None when it
    holds only the fill value (Zarr does not store such a chunk)."""
    if not values.any() if chunking.fill_value == 0 else (values == chunking.fill_value).all():
        return None
    if len(values) < chunking.chunk:
        values = np.concatenate(
            [values, np.full(chunking.chunk - len(values), chunking.fill_value, dtype=values.dtype)]
        )
    blob = chunking.blosc.encode(values.view(np.uint8))
    return blob + google_crc32c.value(blob).to_bytes(4, "little")


def _shard(chunks: list[bytes | None], chunks_per_shard: int) -> bytes | None:
    """Inner chunks in order, then the index of (offset, length) uint64 pairs and its CRC32C."""
    index = np.full((chunks_per_shard, 2), _EMPTY, dtype="<u8")
    offset = 0
    for i, blob in enumerate(chunks):  # one step per inner chunk
        if blob is not None:
            index[i] = (offset, len(blob))
            offset += len(blob)
    if offset == 0:
        return None
    index_bytes = index.tobytes()
    return b"".join(
        [*(c for c in chunks if c is not None), index_bytes, google_crc32c.value(index_bytes).to_bytes(4, "little")]
    )


def _batches(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _threads() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:  # writer threads of several executors may get here first at once
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="logitstore-compress")
    return _pool
