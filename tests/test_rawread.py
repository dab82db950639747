"""`rawread` against Zarr: every array of a store, sharded or not, several chunks and shards, empty
arrays, chunks never written, a damaged chunk, and layouts it must leave to Zarr."""

from __future__ import annotations

import numpy as np
import pytest
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec

from logitstore.format.layout import GRID_ARRAYS
from logitstore.format.zarr_codec import as_codes
from logitstore.storage import rawread
from logitstore.store.store import Store
from logitstore.testing.stores import flip_chunk_of, write_store


def zarr_arrays(group: zarr.Group) -> dict[str, zarr.Array]:
    return {path: node for path, node in group.members(max_depth=None) if isinstance(node, zarr.Array)}


@pytest.mark.parametrize("part_layout", ["packed", "arrays"])
def test_every_array_of_a_store_reads_as_zarr_reads_it(tmp_path, part_layout):
    """Each array as rawread reads it and as Zarr does: in a packed part (store format 3), the arrays
    `read_packed` splits out of the one object against Zarr's reads of them over `PackedStore`."""
    view = write_store(str(tmp_path / "store"), n=40, part_layout=part_layout).read()
    arrays = zarr_arrays(view.root)
    params = next(iter(view.teachers.values())).codec
    if part_layout == "packed":
        assert len(arrays) == 3  # code_of_id, tokenizer and the packed part
        (path,) = [p for p in arrays if p.endswith("/packed")]
        teacher, part = path.split("/")[1], path.split("/")[3]
        names = view.part_names(teacher, part)
        assert len(names) == 6  # the six arrays of a top-k part
        got = rawread.read_packed(view.root.store, path, names, params=params, grid=view.teachers[teacher].grid)
        arrays = {name: view.array(teacher, part, name) for name in names}
    else:
        assert len(arrays) == 8  # code_of_id, tokenizer and the six arrays of a top-k part
        got = rawread.read_arrays(view.root.store, list(arrays))
    assert got is not None
    for (path, array), values in zip(arrays.items(), got):
        # The log-probability arrays read through Zarr as float32 (the grid codec); rawread gives their codes.
        expected = array[:]
        assert expected.dtype == (np.float32 if path.rsplit("/", 1)[-1] in GRID_ARRAYS else values.dtype), path
        np.testing.assert_array_equal(values, as_codes(expected, params), err_msg=path)
        assert values.dtype == as_codes(expected, params).dtype


@pytest.mark.parametrize(
    "length, chunk, shard",
    [
        (1000, 128, 512),  # several shards of several inner chunks, the last shard partial
        (1000, 128, None),  # no sharding: several plain chunks
        (0, 64, 256),  # empty
        (300, 1000, 1000),  # one inner chunk larger than the array
    ],
)
def test_layouts_logitstore_writes(length, chunk, shard):
    group = zarr.open_group(zarr.storage.MemoryStore(), mode="w")
    values = np.arange(length, dtype=np.uint32) * 7 % 65521
    blosc = BloscCodec(typesize=4, cname="zstd", clevel=5, shuffle="shuffle")
    kwargs = {"shards": (shard,)} if shard else {}
    array = group.create_array(
        "a",
        shape=(length,),
        dtype=np.uint32,
        chunks=(chunk,),
        compressors=[blosc, Crc32cCodec()],
        fill_value=3,
        **kwargs,
    )
    array[:] = values
    [got] = rawread.read_arrays(group.store, ["a"])
    np.testing.assert_array_equal(got, values)


def test_chunks_never_written_read_as_the_fill_value():
    group = zarr.open_group(zarr.storage.MemoryStore(), mode="w")
    blosc = BloscCodec(typesize=2, cname="zstd", clevel=5, shuffle="shuffle")
    for name, kwargs in (("sharded", {"shards": (64,)}), ("plain", {})):
        array = group.create_array(
            name,
            shape=(200,),
            dtype=np.uint16,
            chunks=(16,),
            compressors=[blosc, Crc32cCodec()],
            fill_value=9,
            **kwargs,
        )
        array[20:30] = 1  # touches one inner chunk (or chunk): the rest stays unwritten
        [got] = rawread.read_arrays(group.store, [name])
        np.testing.assert_array_equal(got, array[:])


def test_other_layouts_are_left_to_zarr():
    group = zarr.open_group(zarr.storage.MemoryStore(), mode="w")
    group.create_array("no_crc", shape=(10,), dtype=np.uint16, chunks=(5,), compressors=[BloscCodec()])
    group.create_array("two_d", shape=(4, 4), dtype=np.uint16, chunks=(2, 2), compressors=[BloscCodec(), Crc32cCodec()])
    for name in ("no_crc", "two_d"):
        assert rawread.read_arrays(group.store, [name]) is None


def test_a_damaged_chunk_fails_its_checksum(tmp_path):
    uri = str(tmp_path / "store")
    write_store(uri)
    flip_chunk_of(uri, "teachers/teacher-a/code_of_id")
    view = Store.open(uri).read()
    with pytest.raises(ValueError, match="checksum"):
        rawread.read_arrays(view.root.store, ["teachers/teacher-a/code_of_id"])


def test_a_packed_part_without_its_member_table_or_an_array_is_damage(tmp_path):
    """A packed part's document that lost its member table, or lacks an array the teacher's parts
    hold: damaged data (a ValueError, which `read_errors` makes a `DamagedDataError`), not a bug."""
    import json

    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync
    from zarr.storage import MemoryStore

    view = write_store(str(tmp_path / "store"), n=10).read()
    (path,) = [p for p in zarr_arrays(view.root) if p.endswith("/packed")]
    params = next(iter(view.teachers.values())).codec
    prototype = default_buffer_prototype()
    document = json.loads(sync(view.root.store.get(f"{path}/zarr.json", prototype)).to_bytes())
    chunk = sync(view.root.store.get(f"{path}/c/0", prototype))
    names = list(document["attributes"]["logitstore_members"])
    for broken, match in (({}, "no member table"), ({"logitstore_members": {}}, "holds no input_ids")):
        store = MemoryStore()
        sync(
            store.set(
                f"{path}/zarr.json",
                prototype.buffer.from_bytes(json.dumps({**document, "attributes": broken}).encode()),
            )
        )
        sync(store.set(f"{path}/c/0", chunk))
        with pytest.raises(ValueError, match=match):
            rawread.read_packed(store, path, names, params=params, grid=params)
