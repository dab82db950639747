"""Whole arrays of a part, read without zarr-python's per-chunk machinery: the stream's hot path.

Why not plain Zarr: reading one part's arrays through zarr-python costs ~20 ms here (7 arrays, ~17
requests, each through its async codec pipeline and shard-index logic), which caps one reader process
at ~0.6M tokens/s whatever the storage. Here a packed part (store format 3, `packed.py`) costs one
round of requests on Zarr's event loop (its document, from Icechunk's snapshot, and its one chunk:
one request to storage), a part of one object per array two (the arrays' `zarr.json`, then every
chunk or shard object whole); then a decode in the calling thread (Blosc and CRC32C release the GIL, so reader
threads decode in parallel), each chunk decompressed straight into its place in the output array.

What it reads: exactly the arrays logitstore writes (`writer.write_array`): 1-D, little-endian, codecs
`bytes -> blosc -> crc32c`, sharded (`sharding_indexed`, index at the end, `bytes -> crc32c`) or not;
for the log-probability arrays of format-2 teachers, the grid codec first (`format/zarr_codec.py`), whose
uint16 codes it returns undecoded (logitstore's decoder takes codes).
Anything else `read_arrays` leaves to Zarr (it returns None), and `read_whole` reads it through Zarr's
asynchronous API instead (`read_packed` likewise, over `packed.PackedStore`). Every chunk's CRC32C is checked (a
mismatch raises `ValueError`, as Zarr does, which `bounded.read_errors` turns into `DamagedDataError`);
the store's Zarr store is used for the requests, so timeouts and error mapping (`bounded.py`) hold.
`tests/test_rawread.py` checks it against Zarr on every array of real and synthetic stores.
"""

from __future__ import annotations

import asyncio
import json

import google_crc32c
import numpy as np
import zarr.api.asynchronous
from numcodecs import blosc
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

from logitstore.format.grid import CodecParams
from logitstore.format.zarr_codec import NAME as GRID_CODEC
from logitstore.format.zarr_codec import as_codes
from logitstore.storage import packed
from logitstore.storage.bounded import BoundedStore

_EMPTY = 2**64 - 1  # an inner chunk never written (all fill value)
_PLAIN = ({"name": "bytes", "configuration": {"endian": "little"}}, "blosc", {"name": "crc32c"})


def read_whole(store, paths: list[str], *, params: CodecParams) -> list[np.ndarray]:
    """The whole 1-D arrays at `paths` of a Zarr v3 store, as logitstore decodes them (the grid codec's
    arrays as their uint16 codes, `params` their grid): by `read_arrays`, or where any of them is laid
    out otherwise, all of them at once through Zarr's asynchronous API (about 4x slower, see above)."""
    fast = read_arrays(store, paths)
    if fast is not None:
        return fast

    async def one(path: str) -> np.ndarray:
        array = await zarr.api.asynchronous.open_array(store=store, path=path, mode="r")
        return as_codes(np.asarray(await array.getitem(slice(None))), params)

    async def every() -> list[np.ndarray]:
        return list(await asyncio.gather(*(one(path) for path in paths)))

    return sync(every())


def read_packed(
    store, path: str, names: list[str], *, params: CodecParams, grid: CodecParams | None
) -> list[np.ndarray]:
    """The arrays `names` of the packed part whose packed array is at `path` (store format 3,
    `packed.py`), as `read_whole` gives them: its document and its one chunk in one round of requests
    (on Icechunk the document comes from the snapshot: one request to storage), split and decoded here.
    A member laid out otherwise is read through Zarr, over `packed.PackedStore`. `grid` is the value
    grid its log-probability members must declare (`packed.checked_members`)."""
    document, chunk = _get_many(
        store, [f"{path}/zarr.json", packed.chunk_key(path)], what=f"reading {packed.chunk_key(path)}"
    )
    # the snapshot lists the part: a missing or unreadable document, or a member table that disagrees
    # with its arrays, is damage (a ValueError)
    metadata = json.loads(document.to_bytes()) if document is not None else None
    members = packed.checked_members(metadata if isinstance(metadata, dict) else {}, names=names, where=path, grid=grid)
    data = np.zeros(0, np.uint8) if chunk is None else np.asarray(chunk.as_numpy_array()).view(np.uint8).reshape(-1)
    stored = {name: _stored_array(members[name]["zarr"]) for name in names}
    if any(array is None for array in stored.values()):
        return read_whole(packed.PackedStore(store, path=path, members=members), names, params=params)
    out = []
    for name in names:  # a few arrays per part
        array = stored[name]
        assert array is not None  # checked above
        spans = [packed.member_range(members, name, i) for i in range(array.n_objects)]
        if any(s is not None and s[0] + s[1] > len(data) for s in spans):  # the object is shorter than its table
            raise ValueError(f"{name} lies beyond the end of {packed.chunk_key(path)}")
        out.append(array.decode([None if s is None else data[s[0] : s[0] + s[1]] for s in spans]))
    return out


def read_arrays(store, paths: list[str]) -> list[np.ndarray] | None:
    """The whole 1-D arrays at `paths` of a Zarr v3 store, or None if any of them is not laid out as
    logitstore writes it (then read them with Zarr). One hand-over to Zarr's event loop per round."""
    metadata = _get_many(store, [f"{p}/zarr.json" for p in paths], what=f"reading the metadata of {paths[0]} and more")
    found = [_stored_array(json.loads(b.to_bytes())) if b is not None else None for b in metadata]
    stored = [array for array in found if array is not None]
    if len(stored) < len(found):
        return None
    keys = [[f"{p}/c/{i}" for i in range(array.n_objects)] for p, array in zip(paths, stored)]
    fetched = iter(_get_many(store, [k for ks in keys for k in ks], what=f"reading {paths[0]} and more"))
    return [array.decode([_bytes(next(fetched)) for _ in ks]) for array, ks in zip(stored, keys)]


def _bytes(buffer) -> bytes | None:
    return None if buffer is None else buffer.to_bytes()


def _get_many(store, keys: list[str], *, what: str) -> list:
    """The objects at `keys`, requested concurrently in one hand-over to Zarr's event loop; under one
    deadline where the store is logitstore's `BoundedStore` (every store `Store.open` gives)."""
    prototype = default_buffer_prototype()
    if isinstance(store, BoundedStore):
        return sync(store.get_many(keys, prototype, what=what))

    async def every() -> list:
        return await asyncio.gather(*(store.get(key, prototype) for key in keys))

    return sync(every())


class _StoredArray:
    """What reading a stored 1-D array needs: its length, dtype, and how its objects hold its chunks."""

    def __init__(
        self, *, length: int, dtype: np.dtype, object_shape: int, chunk_shape: int, sharded: bool, fill_value: int
    ):
        self.length, self.dtype, self.fill_value = length, dtype, fill_value
        self.object_shape, self.chunk_shape, self.sharded = object_shape, chunk_shape, sharded
        self.n_objects = -(-length // object_shape) if length else 0

    def decode(self, objects: list) -> np.ndarray:
        """The array from its objects (None: never written), each chunk decompressed straight into its
        place in the output: no concatenation, which costs as much as the decompression itself."""
        out = np.empty(self.n_objects * self.object_shape, dtype=self.dtype)
        for i, data in enumerate(objects):  # one step per object: one or a few per array
            place = out[i * self.object_shape : (i + 1) * self.object_shape]
            if data is None:  # never written: fill value
                place[:] = self.fill_value
            elif self.sharded:
                self._shard(data, place)
            else:
                _chunk(data, place)
        return out[: self.length]

    def _shard(self, data, out: np.ndarray) -> None:
        n = self.object_shape // self.chunk_shape
        index_bytes = 16 * n
        index = _checked(data[len(data) - index_bytes - 4 :])
        offsets_lengths = index.view("<u8").reshape(n, 2)
        for j, (offset, size) in enumerate(offsets_lengths.tolist()):  # one step per inner chunk, a few per shard
            place = out[j * self.chunk_shape : (j + 1) * self.chunk_shape]
            if offset == _EMPTY:
                place[:] = self.fill_value
            else:
                _chunk(data[offset : offset + size], place)


def _chunk(data, out: np.ndarray) -> None:
    """Decompress one chunk into `out`, which it must fill exactly (a chunk of another size is damage)."""
    body = _checked(data)
    try:
        # Blosc would fill a larger place only in part: its header's bytes 4-8 say how many it holds
        if len(body) < 16 or int(body[4:8].view("<u4")[0]) != out.nbytes:
            raise ValueError("its size differs from the chunk's")
        blosc.decompress(body, out)
    except (RuntimeError, ValueError) as e:  # numcodecs' errors for a chunk that does not fit or decode
        raise ValueError(f"a chunk does not decode to its place: {e}") from None


def _checked(data) -> np.ndarray:
    """The bytes before a CRC32C trailer, after checking it (what Zarr's crc32c codec does)."""
    raw = np.frombuffer(data, dtype=np.uint8)  # a view: slicing it copies nothing
    body = raw[:-4]
    if google_crc32c.value(body).to_bytes(4, "little") != raw[-4:].tobytes():
        raise ValueError("Stored and computed checksum do not match")
    return body


def _stored_array(meta: dict) -> _StoredArray | None:
    """What reading a logitstore array needs, from its zarr.json; None for any other array."""
    try:
        if meta.get("zarr_format") != 3 or meta.get("node_type") != "array" or len(meta["shape"]) != 1:
            return None
        if meta["chunk_key_encoding"] != {"name": "default", "configuration": {"separator": "/"}}:
            return None
        dtype = np.dtype(meta["data_type"]).newbyteorder("<")
        fill = meta["fill_value"]
        object_shape = meta["chunk_grid"]["configuration"]["chunk_shape"][0]
        codecs = meta["codecs"]
        if meta.get("storage_transformers") or not isinstance(fill, int | float):
            return None
        if len(codecs) == 1 and codecs[0]["name"] == "sharding_indexed":
            config = codecs[0]["configuration"]
            index_ok = config["index_location"] == "end" and config["index_codecs"] == [_PLAIN[0], _PLAIN[2]]
            inner = config["codecs"]
            if inner and inner[0]["name"] == GRID_CODEC:  # float32 log-probabilities stored as uint16 codes:
                inner, dtype = inner[1:], np.dtype("<u2")  # read the codes, which is what logitstore decodes
                if fill != 0:
                    return None
                fill = 0
            if not (index_ok and _plain(inner) and isinstance(fill, int)):
                return None
            return _StoredArray(
                length=meta["shape"][0],
                dtype=dtype,
                object_shape=object_shape,
                chunk_shape=config["chunk_shape"][0],
                sharded=True,
                fill_value=fill,
            )
        if _plain(codecs) and isinstance(fill, int):
            return _StoredArray(
                length=meta["shape"][0],
                dtype=dtype,
                object_shape=object_shape,
                chunk_shape=object_shape,
                sharded=False,
                fill_value=fill,
            )
    except (KeyError, TypeError, IndexError, ValueError):
        pass
    return None


def _plain(codecs: list) -> bool:
    """bytes (little-endian; single-byte types name no endianness) -> blosc -> crc32c."""
    return (
        len(codecs) == 3
        and codecs[0] in (_PLAIN[0], {"name": "bytes"})
        and codecs[1]["name"] == "blosc"
        and codecs[2] == _PLAIN[2]
    )
