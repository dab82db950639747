"""A packed part that storage holds shorter than the version says (emptied, cut short, a link to
/dev/zero), or whose member table disagrees with its arrays (a tampered or buggy commit), is damage of
that part's samples: `verify` and `show` exit 1 naming them, `--on-error skip` trains without them,
`report` counts them, and nothing else is lost. Never an outage (exit 2), never trained on, never a
traceback.

One synthetic store of four parts (`logitstore.testing.stores.trainer_view`), copied per test on local
disk and written afresh on S3 (moto)."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest
import zarr

from logitstore.errors import DamagedDataError
from logitstore.format import layout
from logitstore.storage import packed
from logitstore.store.reader import PartReader, TeacherRows
from logitstore.store.store import Store
from logitstore.testing.cli import one_line_error, run
from logitstore.testing.stores import trainer_view

TEACHER = "teacher-a"


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("template") / "store"
    trainer_view(str(path))
    return path


def local_copy(template: Path, tmp_path: Path) -> str:
    shutil.copytree(template, tmp_path / "store")
    return str(tmp_path / "store")


def victim_part(uri: str) -> tuple[str, list[str]]:
    """A part of the store, and the ids of its samples."""
    index = Store.open(uri).read().index
    part = sorted(set(index["part"].to_pylist()))[1]
    return part, sorted(s for s, p in zip(index["sample_id"].to_pylist(), index["part"].to_pylist()) if p == part)


def packed_bytes(uri: str, part: str) -> int:
    """The length of a part's packed object, as its version records it."""
    return Store.open(uri).read().root[layout.packed_path(TEACHER, part)].shape[0]


def shorten(uri: str, part: str, how: str) -> None:
    """Storage holds the part's one object shorter than its version says: emptied, cut to half, or (on
    disk) replaced by a link to /dev/zero. Found by its length, which no other object of the store has."""
    size = packed_bytes(uri, part)
    if uri.startswith("s3://"):
        import boto3

        bucket, prefix = uri[len("s3://") :].split("/", 1)
        s3 = boto3.client("s3")
        objects = s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/chunks/")["Contents"]
        (key,) = [o["Key"] for o in objects if o["Size"] == size]
        body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        s3.put_object(Bucket=bucket, Key=key, Body=b"" if how == "empty" else body[: size // 2])
        return
    path = part_file(uri, part)
    path.chmod(0o644)
    if how == "zero":
        path.unlink()
        os.symlink("/dev/zero", path)
    else:
        path.write_bytes(b"" if how == "empty" else path.read_bytes()[: size // 2])


def part_file(uri: str, part: str) -> Path:
    """The chunk file on disk that holds a part's one object (the one of its length)."""
    size = packed_bytes(uri, part)
    (path,) = [p for p in Path(uri, "chunks").iterdir() if p.stat().st_size == size]
    return path


def damaged_names(result) -> list[str]:
    return sorted(json.loads(result.stdout)["damaged"])


def assert_damage_of(uri: str, part: str, ids: list[str], *, why: str) -> None:
    """Every reader names or skips exactly the part's samples, as damage, and reads the rest."""
    result = run("verify", uri, "--json")
    assert result.exit_code == 1, (result.stdout, result.stderr)  # was: 2, an outage naming no sample
    assert damaged_names(result) == [f"{TEACHER}/{i}" for i in ids]
    error = one_line_error(run("show", uri, ids[0]), 1)  # was: 2, or 0 printing another array's values
    assert why in error, error
    others = sorted(set(Store.open(uri).read().index["sample_id"].to_pylist()) - set(ids))
    assert run("show", uri, others[0]).exit_code == 0
    out = Path(uri).parent / "report.md" if not uri.startswith("s3://") else Path(f"/tmp/{uuid.uuid4().hex}.md")
    result = run("report", uri, "--out", out)
    assert result.exit_code == 0, result.stderr  # was: 2, or a report that counted nothing
    assert f"| samples left out as damaged (see verify) | {len(ids)} |" in out.read_text()
    view = Store.open(uri).read()
    assert stream_skips(view, on_error="skip") == len(ids)  # was: StorageError, or 0 (trained on)
    with pytest.raises(DamagedDataError):
        stream_skips(view, on_error="raise")
    # the eval split's path: a few samples' ranges of each part, not the part whole
    rows = TeacherRows.of(view, teacher=TEACHER, keep=lambda sids: np.isin(sids, [ids[0], others[0], others[-1]]))
    reader = PartReader(view, teacher=TEACHER, rows=rows)
    assert not reader.whole.any()
    damaged = {rows.sample_ids[r] for code in range(len(rows.parts)) for r in reader.read(code).damaged}
    assert damaged == {ids[0]}


def stream_skips(view, *, on_error: str) -> int:
    """Samples the trainer's stream leaves out over one epoch."""
    from logitstore.streaming.spec import StreamSpec
    from logitstore.streaming.stream import store_stream

    spec = StreamSpec(seq_len=32, micro_batch=4, rank=0, world_size=1, seed=1, on_error=on_error, eval_fraction=0)
    stream = store_stream(view, spec)
    try:
        it = iter(stream)
        for _ in range(stream.steps_per_epoch):
            next(it)
    finally:
        stream.close()
    return stream.skipped_samples


# -- an object shorter than its version says ------------------------------------------------------------


@pytest.mark.parametrize("how", ["empty", "half", "zero"])
def test_a_part_object_shorter_than_its_version_says_is_damage_of_its_samples(template, tmp_path, how):
    uri = local_copy(template, tmp_path)
    part, ids = victim_part(uri)
    shorten(uri, part, how)
    why = "is damaged" if how == "half" else "a stored object is shorter than the version says"
    assert_damage_of(uri, part, ids, why=why)


def test_a_part_object_that_is_a_symbolic_link_loop_is_damage_of_its_samples(template, tmp_path):
    uri = local_copy(template, tmp_path)
    part, ids = victim_part(uri)
    path = part_file(uri, part)
    path.unlink()
    os.symlink(path.name, path)  # no read of it can ever succeed
    assert_damage_of(uri, part, ids, why="a symbolic link that leads back to itself")  # was: 2, an outage


def test_an_emptied_part_object_on_s3_is_damage_of_its_samples(s3_endpoint):
    uri = f"s3://logitstore-test/{uuid.uuid4().hex[:12]}"
    trainer_view(uri)
    part, ids = victim_part(uri)
    shorten(uri, part, "empty")
    assert_damage_of(uri, part, ids, why="a stored object is shorter than the version says")  # was: 2, InvalidRange


def test_training_on_a_store_whose_every_part_is_damaged_is_refused_with_skip(template, tmp_path):
    uri = local_copy(template, tmp_path)
    for part in sorted(set(Store.open(uri).read().index["part"].to_pylist())):
        shorten(uri, part, "empty")
    out = tmp_path / "run"
    args = ["--steps", 3, "--seq-len", 32, "--micro-batch", 2, "--eval-fraction", 0, "--on-error", "skip"]
    error = one_line_error(run("train", "--store", uri, "--out", out, *args), 1)
    assert "step 1: every sample of it is damaged" in error and "nothing left to train on" in error, error
    assert not (out / "final").exists()  # was: 3 steps on 0 tokens at loss 0.0000, and final/ written


# -- a member table that disagrees with its arrays --------------------------------------------------------


def tamper_members(uri: str, part: str, change) -> None:
    """Commit the part's member table as `change` leaves it, keeping the version's index: what a
    tampered or buggy commit leaves."""
    store = Store.open(uri)
    metadata = store.repo.lookup_snapshot(store.resolve()).metadata
    session = store.repo.writable_session("main")
    array = zarr.open_array(session.store, path=layout.packed_path(TEACHER, part), mode="r+")
    members = json.loads(json.dumps(dict(array.attrs)[layout.MEMBERS]))
    change(members)
    array.attrs[layout.MEMBERS] = members
    session.commit("tamper", metadata=metadata)


def another_arrays_bytes(members: dict) -> None:
    members["tail"]["objects"] = members["target_logprobs"]["objects"]  # same dtype and length


def no_tail(members: dict) -> None:
    del members["tail"]


def negative_offset(members: dict) -> None:
    members["tail"]["objects"][0][0] = -members["tail"]["objects"][0][1]


@pytest.mark.parametrize("change", [another_arrays_bytes, no_tail, negative_offset])
def test_a_member_table_that_disagrees_with_its_arrays_is_damage_of_its_samples(template, tmp_path, change):
    uri = local_copy(template, tmp_path)
    part, ids = victim_part(uri)
    tamper_members(uri, part, change)
    assert_damage_of(uri, part, ids, why="member table")  # was: wrong entries shown and trained on, or a traceback


# -- a member table whose every size and checksum holds, but not its arrays' places or grid -----------------


def tail_and_target_swapped(members: dict) -> None:
    members["tail"], members["target_logprobs"] = members["target_logprobs"], members["tail"]  # alike but for bytes


def codes_and_logprobs_swapped(members: dict) -> None:  # both uint16 codes of one length, as stored
    codes, logprobs = members["entry_codes"], members["entry_logprobs"]
    codes["objects"], logprobs["objects"] = logprobs["objects"], codes["objects"]


def tail_shard_left_out(members: dict) -> None:
    members["tail"]["objects"] = [None]  # what Zarr writes for a shard of fill values only


def another_grid(members: dict) -> None:
    sharding = members["entry_logprobs"]["zarr"]["codecs"][0]["configuration"]
    sharding["codecs"][0]["configuration"]["fine_step"] *= 10  # still a valid grid: every code decodes otherwise


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (tail_and_target_swapped, "content hash"),
        (codes_and_logprobs_swapped, "content hash"),
        (tail_shard_left_out, "content hash"),
        (another_grid, "member table of teachers/teacher-a/parts/"),
    ],
)
def test_a_member_table_that_passes_its_own_checks_but_misplaces_arrays_is_damage(template, tmp_path, change, why):
    uri = local_copy(template, tmp_path)
    part, ids = victim_part(uri)
    tamper_members(uri, part, change)
    assert_damage_of(uri, part, ids, why=why)  # was: verify 1, but show 0 with wrong values, trained on, not counted


def test_the_member_table_checks_and_what_they_cost(template):
    view = Store.open(str(template)).read()
    part = victim_part(str(template))[0]
    array = view.root[layout.packed_path(TEACHER, part)]
    document = {"shape": list(array.shape), "attributes": dict(array.attrs)}
    names = layout.part_arrays(sampled=False, chat=False)
    assert packed.checked_members(document, names=names, where="p", grid=view.teachers[TEACHER].grid).keys() == set(
        names
    )  # as written: passes
    members = document["attributes"][layout.MEMBERS]
    size = array.shape[0]
    tail = members["tail"]["objects"][0]
    grid = view.teachers[TEACHER].grid

    def fails(message: str, **change) -> None:
        bad = json.loads(json.dumps(members))
        for path, value in change.items():
            name, field = path.split("__")
            if field == "objects":
                bad[name]["objects"] = value
            else:
                bad[name]["zarr"][field] = value
        with pytest.raises(ValueError, match=message):
            packed.checked_members(
                {"shape": [size], "attributes": {layout.MEMBERS: bad}}, names=names, where="p", grid=grid
            )

    fails("past the object's", tail__objects=[[size - 1, tail[1]]])
    fails("two shards on the same bytes", tail__objects=members["target_logprobs"]["objects"])
    fails("not a non-negative integer", tail__objects=[[-1, tail[1]]])
    fails("not a non-negative integer", tail__objects=[[float(tail[0]), tail[1]]])
    fails("data type 'int64'", tail__data_type="int64")
    fails("position axis two lengths", tail__shape=[members["tail"]["zarr"]["shape"][0] + 1])
    fails("shards listed", tail__objects=[tail, None])
    regridded = json.loads(json.dumps(members))
    another_grid(regridded)
    with pytest.raises(ValueError, match="at entry_logprobs .value grid fine_step 0.5, coarse_step 0.5, not its teach"):
        packed.checked_members(
            {"shape": [size], "attributes": {layout.MEMBERS: regridded}}, names=names, where="p", grid=grid
        )
    with pytest.raises(ValueError, match="at entry_logprobs .a value grid where its teacher stores uint16 codes"):
        packed.checked_members(
            {"shape": [size], "attributes": {layout.MEMBERS: members}}, names=names, where="p", grid=None
        )
    with pytest.raises(ValueError, match="holds no tail"):
        packed.checked_members(
            {"shape": [size], "attributes": {layout.MEMBERS: {k: v for k, v in members.items() if k != "tail"}}},
            names=names,
            where="p",
            grid=grid,
        )
