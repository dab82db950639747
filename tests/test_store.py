"""The store's contract, run against every backend: local disk, memory, and S3 (moto on loopback); on
local disk, its tags and branches, `file://` URLs, the index files' modes and a merge that adds nothing."""

from __future__ import annotations

import json
import os

import pytest

from logitstore.errors import (
    ConflictError,
    DuplicateSampleError,
    IncompatibleStoreError,
    LogitstoreError,
    SampleNotFoundError,
    StoreNotFoundError,
    VersionNotFoundError,
)
from logitstore.format import codec
from logitstore.format.grid import CodecParams
from logitstore.storage.packed import PackedStore, array_members
from logitstore.store.index import diff_indexes
from logitstore.store.store import Store
from logitstore.store.verify import verify
from logitstore.testing.cli import one_line_error, run
from logitstore.testing.stores import VOCAB, assert_matches, teacher, write, write_store
from logitstore.testing.synthetic import random_samples


@pytest.mark.parametrize("mode", ["topk", "topp", "sampled"])
def test_round_trip(store_uri, mode):
    store = Store.open(store_uri, create=True)
    samples = random_samples([f"doc-{i}" for i in range(5)], mode=mode)
    version = write(store, samples, meta=teacher(mode=mode))
    view = Store.open(store_uri).read()
    assert view.snapshot_id == version
    assert_matches(view, samples)
    info = view.info()
    assert info["samples"] == 5 and info["tokens"] == int(samples.n_tokens.sum())
    assert info["stored_bytes"] > 0 and info["bytes_per_token"] == info["stored_bytes"] / info["tokens"]
    assert info["teachers"][0]["sparsity_mode"] == mode and info["version"] == version
    assert verify(view).ok


def test_versions_tags_and_read_only_history(store_uri):
    store = Store.open(store_uri, create=True)
    first, second = random_samples(["a", "b"], seed=1), random_samples(["c"], seed=2)
    v1 = write(store, first, message="first")
    store.tag("v1")
    v2 = write(store, second, message="second")
    log = store.log()
    assert [v.id for v in log[:2]] == [v2, v1] and log[1].tags == ["v1"] and log[0].message == "second"
    assert log[0].samples == 3
    old = store.read("v1")
    assert old.snapshot_id == v1 and old.index.num_rows == 2
    with pytest.raises(SampleNotFoundError):
        old.sample("c")
    assert_matches(store.read(v2), second)
    changes = diff_indexes(store.read_index(v1), store.read_index(v2))
    assert changes["added"] == [{"teacher": "teacher-a", "sample_id": "c"}] and not changes["removed"]
    with pytest.raises(LogitstoreError, match="already exists"):
        store.tag("v1", version=v2)


def test_duplicates_error_replace_skip(store_uri):
    store = Store.open(store_uri, create=True)
    v1 = write(store, random_samples(["a", "b"], seed=1))
    replacement = random_samples(["b"], seed=9)
    with pytest.raises(DuplicateSampleError, match="already stored"):
        write(store, replacement)
    assert store.resolve() == v1  # nothing changed
    write(store, replacement, on_duplicate="skip")
    assert not any(diff_indexes(store.read_index(v1), store.read().index).values())
    write(store, replacement, on_duplicate="replace")
    changes = diff_indexes(store.read_index(v1), store.read().index)
    assert changes["changed"] == [{"teacher": "teacher-a", "sample_id": "b"}]
    assert_matches(store.read(), replacement)
    assert verify(store.read()).ok


def test_different_teacher_is_refused(store_uri):
    store = Store.open(store_uri, create=True)
    v1 = write(store, random_samples(["a"]))
    with pytest.raises(IncompatibleStoreError, match="content_hash"):
        write(store, random_samples(["b"]), meta=teacher(content_hash="weights-2"))
    assert store.resolve() == v1


def test_two_teachers_in_one_store(store_uri):
    store = Store.open(store_uri, create=True)
    a, b = random_samples(["x", "y"], seed=1), random_samples(["x"], seed=2)
    write(store, a)
    write(store, b, meta=teacher(name="teacher-b", content_hash="weights-2"))
    view = store.read()
    assert sorted(t["name"] for t in view.info()["teachers"]) == ["teacher-a", "teacher-b"]
    with pytest.raises(LogitstoreError, match="several teachers"):
        view.sample("x")
    assert_matches(view, b, teacher_name="teacher-b")


def test_concurrent_writers_merge_cleanly(store_uri):
    store = Store.open(store_uri, create=True)
    write(store, random_samples(["base"]))
    one, two = random_samples(["one"], seed=1), random_samples(["two"], seed=2)
    w1, w2 = store.writer(), store.writer()
    for w, s in ((w1, one), (w2, two)):
        w.add_teacher(teacher())
        w.write(s, teacher="teacher-a")
    w1.commit("one")
    w2.commit("two")  # the branch moved: rebases, merges both indexes
    view = store.read()
    assert sorted(view.index["sample_id"].to_pylist()) == ["base", "one", "two"]
    assert_matches(view, one)
    assert_matches(view, two)
    assert verify(view).ok


def test_concurrent_writers_of_the_same_sample_conflict(store_uri):
    store = Store.open(store_uri, create=True)
    write(store, random_samples(["base"]))
    w1, w2 = store.writer(), store.writer()
    for w, seed in ((w1, 1), (w2, 2)):
        w.add_teacher(teacher())
        w.write(random_samples(["same"], seed=seed), teacher="teacher-a")
    v = w1.commit("first wins")
    with pytest.raises(ConflictError, match="same"):
        w2.commit("second loses")
    assert store.resolve() == v
    assert_matches(store.read(), random_samples(["same"], seed=1))


def test_branches_are_independent(store_uri):
    store = Store.open(store_uri, create=True)
    v1 = write(store, random_samples(["a"]))
    store.create_branch("teacher-b-run")
    write(store, random_samples(["b"], seed=3), branch="teacher-b-run")
    assert store.resolve("main") == v1
    assert store.read("teacher-b-run").index.num_rows == 2


def test_abandoned_writer_leaves_nothing(store_uri):
    store = Store.open(store_uri, create=True)
    v1 = write(store, random_samples(["a"]))
    with pytest.raises(RuntimeError):
        with store.writer() as w:
            w.add_teacher(teacher())
            w.write(random_samples(["b"], seed=4), teacher="teacher-a")
            raise RuntimeError("crash before commit")
    assert store.resolve() == v1 and store.read().index.num_rows == 1


def test_missing_things_have_clear_errors(store_uri):
    with pytest.raises(StoreNotFoundError, match="not a logitstore store"):
        Store.open(store_uri)
    store = Store.open(store_uri, create=True)
    write(store, random_samples(["a"]))
    with pytest.raises(VersionNotFoundError, match="no version, tag or branch 'nope'"):
        store.read("nope")
    with pytest.raises(VersionNotFoundError):
        store.read("ZZZZZZZZZZZZZZZZZZZ0")
    with pytest.raises(SampleNotFoundError, match="no sample 'zzz'"):
        store.read().sample("zzz")
    with pytest.raises(LogitstoreError, match="no teacher"):
        store.read().sample("a", teacher="other")


def test_index_is_plain_parquet(tmp_path):
    import polars as pl

    store = Store.open(str(tmp_path / "s"), create=True)
    samples = random_samples(["a", "b", "c"])
    write(store, samples)
    path = store.read().info()["index_path"]
    df = pl.read_parquet(path)  # no logitstore involved
    assert df["sample_id"].to_list() == ["a", "b", "c"]
    assert df["n_tokens"].to_list() == samples.n_tokens.tolist()
    assert set(df.columns) >= {"sample_id", "teacher", "part", "n_tokens", "content_hash"}


def test_non_store_directory_is_never_written(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(StoreNotFoundError, match="refusing to write"):
        Store.open(str(tmp_path), create=True)
    assert [p.name for p in tmp_path.iterdir()] == ["precious.txt"]


def _write_in_fork(args):
    writer, ids, seed = args
    return writer.write(random_samples(ids, seed=seed), teacher="teacher-a")


def test_forked_writers_in_other_processes_merge_into_one_version(store_uri):
    import multiprocessing
    import pickle

    if store_uri.startswith("memory://"):
        pytest.skip("a memory store lives in one process")
    store = Store.open(store_uri, create=True)
    batches = [(["p0-a", "p0-b"], 1), (["p1-a"], 2)]
    with store.writer() as w:
        w.add_teacher(teacher(), code_of_id=codec.identity_order(VOCAB))
        w.commit("add the teacher")  # forks cannot create shared groups
    with store.writer() as w:
        forks = [pickle.loads(pickle.dumps(w.fork())) for _ in batches]
        with multiprocessing.get_context("spawn").Pool(2) as pool:
            written = pool.map(_write_in_fork, [(f, ids, seed) for f, (ids, seed) in zip(forks, batches)])
        for part in written:
            w.merge(part)
        version = w.commit("two forks")
    view = store.read(version)
    assert sorted(view.index["sample_id"].to_pylist()) == ["p0-a", "p0-b", "p1-a"]
    for ids, seed in batches:
        assert_matches(view, random_samples(ids, seed=seed))
    assert verify(view).ok


def _objects(store, prefix: str) -> dict[str, bytes]:
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    async def collect():
        keys = [k async for k in store.list_prefix(prefix)]
        return {k[len(prefix) :]: (await store.get(k, default_buffer_prototype())).to_bytes() for k in keys}

    return sync(collect())


@pytest.mark.parametrize(
    "case",
    ["small", "several shards", "an all-zero chunk", "student tokens", "a format-1 teacher", "a format-2 teacher"],
)
def test_a_part_is_written_as_zarr_writes_it_byte_for_byte(tmp_path, case):
    """`PartWriter` writes its arrays without zarr-python's machinery (rawwrite.py): every object, every
    byte and the stored size equal writing each array through Zarr (`write_array`), the log-probability
    arrays as float32 through the grid codec (or, for a teacher from before store format 2, as codes).
    Packed (store format 3): the packed object, seen through `PackedStore`, holds those same objects."""
    import dataclasses

    import numpy as np
    import zarr

    from logitstore.format.samples import StudentTokens, concat
    from logitstore.store.meta import StudentTokenizer
    from logitstore.store.writer import write_array

    samples = random_samples([f"d{i}" for i in range(12)], k=8)
    students, registered = None, []
    if case == "several shards":  # uint16 chunks of 128k values, 64 per shard: > 8M entries
        samples = concat(
            [
                dataclasses.replace(
                    random_samples([f"b{r}"], seed=r, min_tokens=1024, max_tokens=1024, k=64), sample_ids=[f"b{r}"]
                )
                for r in range(2)
            ]
        )
        samples = concat(
            [dataclasses.replace(samples, sample_ids=[f"{s}-{r}" for s in samples.sample_ids]) for r in range(66)]
        )
    if case == "an all-zero chunk":
        samples.input_ids[:] = 0  # Zarr leaves an all-fill-value chunk out, and then its shard
    if case == "student tokens":
        students = {
            "s": StudentTokens.from_samples(
                [(np.arange(n // 2) % 7, np.array([[0, n, 0, n // 2]])) for n in samples.n_tokens]
            )
        }
        registered = [
            StudentTokenizer(
                name="s",
                tokenizer_hash="h",
                vocab_size=7,
                tokenizer_json="{}",
                vocab_map=np.arange(VOCAB, dtype=np.int32) % 7,
            )
        ]
    from logitstore.format.layout import GRID_ARRAYS

    meta = {
        "a format-1 teacher": dataclasses.replace(teacher(), values="codes", part_layout="arrays"),
        "a format-2 teacher": dataclasses.replace(teacher(), part_layout="arrays"),
    }.get(case, teacher())
    store = Store.open(str(tmp_path / "store"), create=True)
    with store.writer() as w:
        w.add_teacher(
            meta, code_of_id=codec.frequency_id_order(samples.entry_ids, vocab_size=VOCAB), students=registered
        )
        w.commit("teacher")
    with store.writer() as w:
        part_writer = w.part_writer()
        written = part_writer.write(samples, teacher="teacher-a", students=students)
        w.merge(written)
        part = written.rows["part"][0].as_py()
        enc = codec.encode(
            samples, params=CodecParams(), code_of_id=part_writer.code_of_id("teacher-a"), vocab_size=VOCAB
        )
        group = zarr.open_group(w.session.store, mode="r+")["teachers/teacher-a/parts"].create_group("by-zarr")
        stored = sum(
            write_array(group, name, values, grid=meta.grid if name in GRID_ARRAYS else None)
            for name, values in enc.arrays().items()
        )
        for name, st in (students or {}).items():
            sub = group.require_group("students").create_group(name)
            stored += write_array(sub, "ids", st.ids.astype(np.int32))
            stored += write_array(sub, "groups", st.groups.astype(np.int32).reshape(-1))
        group.attrs.update({"samples": len(samples), "tokens": int(samples.n_tokens.sum()), "stored_bytes": stored})
        ours = _objects(w.session.store, f"teachers/teacher-a/parts/{part}/")
        theirs = _objects(w.session.store, "teachers/teacher-a/parts/by-zarr/")
        arrays = zarr.open_group(w.session.store, mode="r")[f"teachers/teacher-a/parts/{part}"].store
        if meta.packed:  # one object; through PackedStore, the same objects as one array each
            from zarr.core.buffer import default_buffer_prototype
            from zarr.core.metadata import ArrayV3Metadata

            document = ours["packed/zarr.json"]  # spliced (rawwrite.packed_document): Zarr's rendering, byte for byte
            rendered = ArrayV3Metadata.from_dict(json.loads(document)).to_buffer_dict(default_buffer_prototype())
            assert document == rendered["zarr.json"].to_bytes()
            packed_path = f"teachers/teacher-a/parts/{part}/packed"
            packed = zarr.open_array(w.session.store, path=packed_path, mode="r")
            members = array_members(packed, names=(), where=packed_path, grid=meta.grid)  # the writer's table passes
            arrays = PackedStore(w.session.store, path=packed_path, members=members)
            # the same shards, and one document (the packed array's) in place of one per array
            stored += len(ours["packed/zarr.json"]) - sum(len(theirs[f"{name}/zarr.json"]) for name in members)
            del theirs["zarr.json"], ours["zarr.json"]  # the group's: its stored_bytes differ
            if students:  # store format 4: the student arrays are members too, and no group holds them
                assert {"students/s/ids", "students/s/groups"} <= set(members)
                del theirs["students/zarr.json"], theirs["students/s/zarr.json"]
            ours = {k: v for k, v in ours.items() if not k.startswith("packed/")} | _objects(arrays, "")
            assert sorted(_objects(w.session.store, packed_path + "/")) == ["c/0", "zarr.json"]
        assert sorted(ours) == sorted(theirs)
        same = lambda key: (
            json.loads(ours[key]) == json.loads(theirs[key]) if key.endswith(".json") else ours[key] == theirs[key]
        )
        assert [key for key in ours if not same(key)] == []
        assert written.stored_bytes == stored
        tail_path = "tail" if meta.packed else f"teachers/teacher-a/parts/{part}/tail"
        kind = zarr.open_array(arrays, path=tail_path, mode="r").dtype
        assert kind == (np.float32 if meta.values == "logprobs" else np.uint16)
        if case == "several shards":
            assert "entry_codes/c/1" in ours
        if case == "an all-zero chunk":
            assert "input_ids/c/0" not in ours and "input_ids/zarr.json" in ours
        version = w.commit("write")
    view = store.read(version)
    assert_matches(view, samples)
    assert verify(view).ok


def test_a_duplicate_entry_is_refused_by_the_write(store_uri):
    samples = random_samples(["a", "b"], k=8)
    samples.entry_ids[9] = samples.entry_ids[8]  # found by the encoder's sort, not by a sort of its own
    store = Store.open(store_uri, create=True)
    with pytest.raises(LogitstoreError, match=r"token id \d+ appears twice among the entries of position 1"):
        write(store, samples)
    assert store.read().index.num_rows == 0


def test_tag_and_branch_names_never_shadow_each_other(tmp_path):
    uri = str(tmp_path / "store")
    store = write_store(uri)
    assert "is a branch" in one_line_error(run("tag", uri, "main"), 2)
    assert run("tag", uri, "v1").exit_code == 0
    with pytest.raises(Exception, match="already a tag"):
        Store.open(uri).create_branch("v1")
    assert "looks like a version id" in one_line_error(run("tag", uri, store.resolve()), 2)
    assert "use letters" in one_line_error(run("tag", uri, "../x"), 2)

    result = run("tag", uri, "v1", "--delete")
    assert result.exit_code == 0 and store.resolve() in result.stdout
    assert "v1" not in Store.open(uri).repo.list_tags() and Store.open(uri).read().index.num_rows == 12
    assert "cannot be reused" in one_line_error(run("tag", uri, "v1"), 2)
    assert "no tag 'v9'" in one_line_error(run("tag", uri, "v9", "--delete"), 2)


def test_merging_a_part_whose_samples_are_all_stored_adds_nothing(tmp_path):
    store = write_store(str(tmp_path / "store"), n=3)
    samples = random_samples(["doc-0", "doc-1"], max_tokens=30)
    with store.writer(on_duplicate="skip") as w:
        written = w.part_writer().write(samples, teacher="teacher-a")
        assert w.merge(written) == 0  # was: ArrowNotImplementedError from rows.take([])


def test_index_files_are_readable_by_other_users(tmp_path):
    write_store(str(tmp_path / "store"))
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "store" / "logitstore-index").iterdir()}
    umask = os.umask(0o022)
    os.umask(umask)
    assert modes and all(mode == 0o666 & ~umask for mode in modes.values()), modes


def test_file_urls_are_percent_decoded(tmp_path):
    write_store(str(tmp_path / "my store"))
    result = run("info", f"file://{tmp_path}/my%20store", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["samples"] == 12
    assert not (tmp_path / "my%20store").exists()
