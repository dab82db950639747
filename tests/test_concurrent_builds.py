"""Concurrent writers of the same sample ids with other text: a write meets the rule a later build
meets (`stored with other text`), whether the branch held the ids when it began or a concurrent writer
committed them while it ran, and its summary counts what happened.

Library writers on synthetic samples on local disk and S3 (moto) show the rule at both places a write
meets stored ids (merge and commit); builds of the tiny teacher show what `build` does with it.

The same data at once: two processes creating one store make it once, two builds of the same input store
it once, and each build's summary counts what its own commits hold."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from logitstore.errors import ChangedTextError
from logitstore.pipelines import build as build_module
from logitstore.pipelines.build import BuildConfig, run_build
from logitstore.pipelines.inputs import text_hash
from logitstore.store import writer as writer_module
from logitstore.store.documents import decide
from logitstore.store.store import Store
from logitstore.store.verify import verify
from logitstore.testing.cli import CLI, LONG, build, jsonl, one_line_error, small_build
from logitstore.testing.stores import index_of, write_store
from logitstore.testing.synthetic import random_samples

IDS = ["new-0", "new-1"]


@pytest.fixture(params=["local", "s3"])
def uri(request, tmp_path) -> str:
    if request.param == "s3":
        request.getfixturevalue("s3_endpoint")
        return f"s3://logitstore-test/{uuid.uuid4().hex[:12]}"
    return str(tmp_path / "store")


def stage(writer, text: str) -> None:
    """Stage the two samples as written by a build's worker (a fork), with `text` as their source."""
    samples = random_samples(IDS, seed=len(text), max_tokens=30, k=8)
    written = writer.fork().write(samples, teacher="teacher-a", source_hashes=[text] * len(IDS))
    writer.merge(written)


def sources(store: Store) -> dict[str, str | None]:
    index = store.read().index
    return dict(zip(index["sample_id"].to_pylist(), index["source_hash"].to_pylist()))


def test_a_concurrent_commit_of_the_same_ids_with_other_text_is_refused_at_commit(uri):
    store = write_store(uri, n=3)
    first, second = (store.writer(on_duplicate="skip") for _ in range(2))  # both on the same base
    stage(first, "text-a")
    stage(second, "text-b")
    first.commit("first")
    tip = store.resolve()
    with pytest.raises(ChangedTextError, match="'new-0' of teacher 'teacher-a' is stored with other text") as e:
        second.commit("second")  # was: its samples dropped as "already stored", nothing said
    assert (e.value.stored, e.value.new, e.value.count) == ("text-a", "text-b", 2)
    assert e.value.exit_code == 2
    assert store.resolve() == tip and sources(store)["new-0"] == "text-a"
    assert verify(store.read()).unreferenced == {}


def test_the_same_rule_holds_for_ids_the_base_version_holds(uri):
    store = write_store(uri, n=3)
    with store.writer(on_duplicate="skip") as first:
        stage(first, "text-a")
        first.commit("first")
    later = store.writer(on_duplicate="skip")  # begins after the first committed: meets them at merge
    with pytest.raises(ChangedTextError, match="stored with other text"):
        stage(later, "text-b")
    same = store.writer(on_duplicate="skip")
    stage(same, "text-a")  # the same text: stored already, left out and counted
    assert not same.has_changes
    same.commit("nothing")
    assert same.result is not None and (same.result.committed, same.result.dropped) == (False, 2)


@pytest.mark.parametrize("on_changed", ["skip", "replace"])
def test_a_concurrent_commit_with_other_text_is_kept_or_replaced_as_asked(tmp_path, on_changed):
    store = write_store(str(tmp_path / "store"), n=3)
    first = store.writer(on_duplicate="skip")
    second = store.writer(on_duplicate="skip", on_changed=on_changed)
    stage(first, "text-a")
    stage(second, "text-b")
    first.commit("first")
    second.commit("second")
    result = second.result
    assert result is not None
    if on_changed == "skip":
        assert (result.committed, result.samples, result.dropped, result.changed) == (False, 0, 0, IDS)
        assert sources(store)["new-0"] == "text-a"
    else:
        assert (result.committed, result.samples, result.dropped, result.changed) == (True, 2, 0, IDS)
        assert sources(store)["new-0"] == sources(store)["new-1"] == "text-b"
    assert store.read().index.num_rows == 5 and verify(store.read()).ok


WINDOWS = ["new#w0", "new#w1"]  # the document "new" as a text of two windows


def stage_document(writer, ids: list[str], text: str) -> None:
    """Stage one document of text `text` as the samples `ids` (its one id, or its windows')."""
    samples = random_samples(ids, seed=len(ids), max_tokens=30, k=8)
    writer.merge(writer.fork().write(samples, teacher="teacher-a", source_hashes=[text] * len(ids)))


@pytest.mark.parametrize("on_changed", ["error", "skip", "replace"])
def test_a_concurrent_commit_of_a_document_with_other_text_and_other_windows_meets_the_rule(tmp_path, on_changed):
    store = write_store(str(tmp_path / "store"), n=3)
    first = store.writer(on_duplicate="skip")
    second = store.writer(on_duplicate="skip", on_changed=on_changed)  # both on the same base
    stage_document(first, ["new"], "text-a")
    stage_document(second, WINDOWS, "text-b")  # more windows: no sample id in common with the first's
    first.commit("first")
    if on_changed == "error":
        with pytest.raises(ChangedTextError, match="'new#w0' of teacher 'teacher-a' is stored with other text"):
            second.commit("second")  # was: committed beside the first's, both texts kept
        assert set(sources(store)) - {"doc-0", "doc-1", "doc-2"} == {"new"}
        return
    second.commit("second")
    result = second.result
    assert result is not None and result.changed == WINDOWS
    kept = {"skip": {"new": "text-a"}, "replace": {"new#w0": "text-b", "new#w1": "text-b"}}[on_changed]
    assert {s: h for s, h in sources(store).items() if s.startswith("new")} == kept
    assert verify(store.read()).ok


def test_a_write_meets_a_document_the_base_holds_under_other_window_ids(tmp_path):
    store = write_store(str(tmp_path / "store"), n=3)
    with store.writer(on_duplicate="skip") as first:
        stage_document(first, WINDOWS, "text-a")
        first.commit("first")
    later = store.writer(on_duplicate="skip")  # begins after the first committed: meets them at merge
    with pytest.raises(ChangedTextError, match="'new' of teacher 'teacher-a' is stored with other text"):
        stage_document(later, ["new"], "text-b")  # was: staged beside the windows of the other text
    replacing = store.writer(on_duplicate="skip", on_changed="replace")
    stage_document(replacing, ["new"], "text-b")
    replacing.commit("replace")
    assert {s: h for s, h in sources(store).items() if s.startswith("new")} == {"new": "text-b"}


def test_only_a_sample_whose_document_is_stored_or_staged_again_meets_the_rule(tmp_path, monkeypatch):
    """The rule looks up each sample's document in what is stored; the writer passes it only the samples
    that can meet something (a build's every unit is merged in the driver's thread), with the same outcome."""
    store = write_store(str(tmp_path / "store"), n=3)
    with store.writer(on_duplicate="skip") as first:
        stage_document(first, WINDOWS, "text-a")
        first.commit("first")
    met: list[list[str]] = []

    def recording(keys, sources, **kwargs):
        met.append([sample_id for _, sample_id in keys])
        return decide(keys, sources, **kwargs)

    monkeypatch.setattr(writer_module, "decide", recording)
    later = store.writer(on_duplicate="skip", on_changed="skip")
    stage_document(later, ["fresh#w0", "fresh#w1"], "text-c")  # a document the store does not hold
    stage_document(later, ["new", "other"], "text-b")  # "new": its windows are stored with other text
    stage_document(later, ["fresh#w1"], "text-c")  # staged again in this transaction
    later.commit("later")
    assert met == [["new"], ["fresh#w1"]]
    assert later.result is not None and later.result.changed == ["new"]
    held = {s: h for s, h in sources(store).items() if not s.startswith("doc-")}
    assert held == {
        "new#w0": "text-a",
        "new#w1": "text-a",
        "fresh#w0": "text-c",
        "fresh#w1": "text-c",
        "other": "text-b",
    }


# -- builds ------------------------------------------------------------------------------------------


DOCS = ["d0", "d1"]
TEXT_A = "The first build's text of this document, about foxes and dogs."
TEXT_B = "The second build's text of this document, about cats and birds."


@pytest.fixture(scope="module")
def holds_the_teacher(tiny_teacher, tmp_path_factory) -> Path:
    """A store that holds the teacher (one other document), copied by each test."""
    folder = tmp_path_factory.mktemp("seed")
    data = jsonl(folder / "seed.jsonl", [{"id": "seed", "text": TEXT_A}])
    assert build(tiny_teacher, folder / "store", data).exit_code == 0
    return folder / "store"


@pytest.fixture
def seeded(tiny_teacher, holds_the_teacher, tmp_path, request):
    """The store, and this test's build of the documents with TEXT_B (or the text the test passes as
    the fixture's parameter), before whose commit another build (run then, in this process) commits
    them with TEXT_A."""
    store = tmp_path / "store"
    shutil.copytree(holds_the_teacher, store)
    other = BuildConfig(
        store=str(store),
        teacher=tiny_teacher,
        data=str(jsonl(tmp_path / "a.jsonl", [{"id": d, "text": TEXT_A} for d in DOCS])),
        id_column="id",
        max_length=32,
        unit_tokens=64,
        progress=False,
    )
    commit = build_module._commit
    ran: list = []

    def commit_after_the_other_build(writer, *args, **kwargs):
        if not ran:
            ran.append(None)  # the other build's commits pass through here too
            ran[0] = run_build(other, log=lambda _: None)
        return commit(writer, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build_module, "_commit", commit_after_the_other_build)
        text = getattr(request, "param", TEXT_B)
        yield store, jsonl(tmp_path / "b.jsonl", [{"id": d, "text": text} for d in DOCS])
    assert ran and ran[0].samples == len(DOCS), "the other build stored the documents first"


def test_a_build_whose_documents_another_build_stored_with_other_text_meanwhile_exits_2(tiny_teacher, seeded):
    store, data = seeded
    error = one_line_error(build(tiny_teacher, store, data), 2)  # was: exit 0, its text never stored
    assert "document 'd0' is stored with other text, by another build while this one ran" in error, error
    assert "--on-duplicate replace" in error
    assert {h for s, (_, h) in index_of(store).items() if s != "seed"} == {text_hash(TEXT_A)}


@pytest.mark.parametrize("seeded", [TEXT_B * 4], indirect=True)  # windows d0#w0, d0#w1, ... where A stored d0
def test_a_concurrent_build_whose_text_makes_more_windows_exits_2(tiny_teacher, seeded):
    store, data = seeded
    error = one_line_error(build(tiny_teacher, store, data), 2)  # was: exit 0, changed 0, both texts stored
    assert "document 'd0' is stored with other text, by another build while this one ran" in error, error
    assert set(index_of(store)) == {"seed", *DOCS}
    assert {h for s, (_, h) in index_of(store).items() if s != "seed"} == {text_hash(TEXT_A)}


@pytest.mark.parametrize("on_duplicate", ["skip", "replace"])
def test_a_concurrent_build_with_other_text_keeps_or_replaces_and_counts_it(tiny_teacher, seeded, on_duplicate):
    store, data = seeded
    result = build(tiny_teacher, store, data, "--on-duplicate", on_duplicate)
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert (summary["changed"], summary["already_stored"]) == (2, 0)  # was: changed 0, nothing counted
    kept = {"skip": TEXT_A, "replace": TEXT_B}[on_duplicate]
    assert summary["samples"] == (0 if on_duplicate == "skip" else 2)
    assert {h for s, (_, h) in index_of(store).items() if s != "seed"} == {text_hash(kept)}
    assert verify(Store.open(str(store)).read()).ok


CREATE_AT = """
import sys, time
from logitstore.store.store import Store
start = float(sys.argv[1])
for i, uri in enumerate(sys.argv[2:]):  # both processes open store i at the same moment
    while time.time() < start + 0.3 * i:
        pass
    Store.open(uri, create=True)
print("ok")
"""


def test_creating_one_store_from_two_processes_at_once_is_idempotent(tmp_path):
    uris = [str(tmp_path / f"store{i}") for i in range(8)]
    start = str(time.time() + 4)  # after both interpreters have imported logitstore
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CREATE_AT, start, *uris], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0 and out.strip() == "ok", err[-2000:]
    for uri in uris:
        assert len(Store.open(uri).log()) == 1  # one "create logitstore store" commit, not two


def test_two_builds_of_the_same_data_at_once_store_it_once(tiny_teacher, tmp_path):
    rows = [{"id": f"d{i}", "text": f"Document {i}: " + LONG[: 60 + 20 * i]} for i in range(6)]
    data = jsonl(tmp_path / "d.jsonl", rows)
    reference = tmp_path / "reference"
    assert build(tiny_teacher, reference, data).exit_code == 0
    store = tmp_path / "store"
    command = [*CLI, *small_build(tiny_teacher, store, data, "--commit-every", "0.001")]
    children = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for child in children:
        _, err = child.communicate(timeout=240)
        assert child.returncode == 0 and "Traceback" not in err, err[-2000:]
    assert index_of(store) == index_of(reference)
    assert verify(Store.open(str(store)).read()).ok


def test_a_write_whose_samples_a_concurrent_writer_committed_first_commits_nothing(tmp_path):
    store = write_store(str(tmp_path / "store"), n=3)
    samples = random_samples(["new-0", "new-1"], seed=5, max_tokens=30, k=8)
    first, second = (store.writer(on_duplicate="skip") for _ in range(2))  # both on the same base
    for writer in (first, second):
        assert writer.merge(write_part(writer, samples)) == 2
    first.commit("first")
    versions = len(store.log())
    second.commit("second")  # rebases onto the first, whose commit holds both samples
    assert second.result is not None and not second.result.committed  # was: a commit adding nothing
    assert (second.result.samples, second.result.dropped) == (0, 2)
    assert len(store.log()) == versions
    later = store.writer(on_duplicate="skip")  # a build's next checkpoint transaction
    assert later.merge(write_part(later, samples)) == 0 and not later.has_changes  # was: an empty commit
    report = verify(store.read())
    assert report.ok and report.unreferenced == {}


def write_part(writer, samples):
    """A part written through a fork, as a build's worker writes it."""
    return writer.fork().write(samples, teacher="teacher-a")


def test_two_concurrent_builds_count_what_their_commits_hold(tiny_teacher, tmp_path):
    rows = [{"id": f"d{i}", "text": f"Document {i}: " + LONG[: 60 + 20 * i]} for i in range(6)]
    data = jsonl(tmp_path / "d.jsonl", rows)
    store = tmp_path / "store"
    command = [*CLI, *small_build(tiny_teacher, store, data, "--commit-every", "0.001", "--json")]
    children = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    summaries = []
    for child in children:
        out, err = child.communicate(timeout=240)
        assert child.returncode == 0, err[-2000:]
        summaries.append(json.loads(out))
    stored = Store.open(str(store)).read().index.num_rows
    assert sum(s["samples"] for s in summaries) == stored  # was: both counted what the first one stored
    counts = [v.samples or 0 for v in reversed(Store.open(str(store)).log())]  # the first: the empty store
    assert all(b > a for a, b in zip(counts, counts[1:])), counts  # every commit adds samples
    assert verify(Store.open(str(store)).read()).unreferenced == {}
