"""Damaged stores, read: a teacher's arrays with a flipped byte, a chunk that storage lost, a snapshot
cut short, a branch's ref file: `verify` names the damage, commands stop with one line naming it
(exit 1), tags of undamaged versions stay readable, and training can skip the lost samples.

Small synthetic stores (`logitstore.testing.stores`); a packed part's own damage is
tests/test_damaged_parts.py."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from logitstore.errors import DamagedDataError
from logitstore.store.store import Store
from logitstore.store.verify import verify
from logitstore.testing.cli import one_line_error, run
from logitstore.testing.stores import flip_chunk_of, trainer_view, write_store
from logitstore.testing.synthetic import random_samples


@pytest.mark.parametrize("array", ["code_of_id", "tokenizer"])
def test_verify_reads_teacher_arrays_and_show_names_the_damage(tmp_path, array):
    uri = str(tmp_path / "store")
    write_store(uri)
    assert verify(Store.open(uri).read()).ok
    flip_chunk_of(uri, f"teachers/teacher-a/{array}")

    report = verify(Store.open(uri).read())
    assert not report.ok and list(report.damaged_arrays) == [f"teachers/teacher-a/{array}"]
    result = run("verify", uri)
    assert result.exit_code == 1 and f"damaged: teachers/teacher-a/{array}: unreadable" in result.stderr
    assert run("verify", uri, "--json").exit_code == 1

    error = one_line_error(run("show", uri, "doc-3"), 1)
    assert f"teachers/teacher-a/{array}" in error and "damaged" in error and "verify" in error


def test_train_stops_with_one_line_on_a_damaged_id_order(tmp_path):
    uri = str(tmp_path / "store")
    write_store(uri)
    flip_chunk_of(uri, "teachers/teacher-a/code_of_id")
    with pytest.raises(DamagedDataError, match="code_of_id"):
        Store.open(uri).read().sample("doc-1")
    result = run(
        "train",
        "--store",
        uri,
        "--out",
        tmp_path / "run",
        "--steps",
        "1",
        "--seq-len",
        "32",
        "--micro-batch",
        "1",
        "--eval-fraction",
        "0.1",
    )
    error = one_line_error(result, 1)
    assert "teachers/teacher-a/code_of_id" in error and "damaged" in error


def test_a_damaged_tip_keeps_tags_readable_and_is_named(tmp_path):
    uri = str(tmp_path / "store")
    store = write_store(uri)
    store.tag("v1")
    samples = random_samples(["late"], max_tokens=20)
    with store.writer() as w:
        w.write(samples, teacher="teacher-a")
        tip = w.commit("late")
    snapshot = tmp_path / "store" / "snapshots" / tip
    data = snapshot.read_bytes()
    snapshot.write_bytes(data[: len(data) // 2])  # cut short (a flipped byte may land where nothing checks it)

    assert run("info", uri, "--version", "v1").exit_code == 0  # was: "not a logitstore store" for every version
    error = one_line_error(run("info", uri), 1)
    assert tip in error and "a repository file is damaged" in error


def test_a_damaged_main_ref_is_named(tmp_path):
    uri = str(tmp_path / "store")
    write_store(uri)
    (tmp_path / "store" / "refs" / "branch.main" / "ref.json").write_text('{"snapshot": "')
    error = one_line_error(run("info", uri, "--version", "v1"), 1)
    assert "refs/branch.main/ref.json" in error and "damaged" in error


def delete_largest_chunk(uri: str) -> None:
    """Delete the largest chunk object (a part's entries) behind Icechunk's back: on disk or on S3."""
    if uri.startswith("s3://"):
        import boto3

        bucket, prefix = uri[len("s3://") :].split("/", 1)
        s3 = boto3.client("s3")
        objects = s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/chunks/")["Contents"]
        s3.delete_object(Bucket=bucket, Key=max(objects, key=lambda o: o["Size"])["Key"])
    else:
        max(Path(uri, "chunks").iterdir(), key=lambda p: p.stat().st_size).unlink()


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_a_missing_chunk_is_damage_that_verify_names_and_train_can_skip(backend, tmp_path, request):
    from logitstore.streaming.spec import StreamSpec
    from logitstore.streaming.stream import store_stream

    if backend == "s3":
        request.getfixturevalue("s3_endpoint")
        uri = f"s3://logitstore-test/{uuid.uuid4().hex[:12]}"
    else:
        uri = str(tmp_path / "store")
    view = trainer_view(uri)
    delete_largest_chunk(uri)

    result = run("verify", uri)
    assert result.exit_code == 1, (result.stdout, result.stderr)  # was: 2, "storage failed ... No such file"
    damaged = [line for line in result.stderr.splitlines() if line.startswith("damaged: teacher-a/doc-")]
    assert damaged and all("a stored object is missing" in line for line in damaged), result.stderr
    error = one_line_error(run("show", uri, damaged[0].split("/")[1].split(":")[0]), 1)
    assert "a stored object is missing" in error

    stream = store_stream(view, StreamSpec(seq_len=32, micro_batch=4, rank=0, world_size=1, seed=1, on_error="skip"))
    try:
        batches = [next(iter_) for iter_ in [iter(stream)] for _ in range(stream.steps_per_epoch)]
    finally:
        stream.close()
    assert batches and 0 < stream.skipped_samples < 24  # was: StorageError, whatever --on-error said
