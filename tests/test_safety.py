"""Lose nothing, keep nothing stale: one regression test per data-safety defect of issue 13 (store and
build side; the run folder is tests/test_run_folder.py, storage faults tests/test_faults.py).

Small synthetic stores where a real forward pass is not the point; the default teacher where the build's
own planning is."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from benchmarks.synthetic import random_samples
from logitstore.cli.app import app
from logitstore.errors import DamagedDataError
from logitstore.format import codec
from logitstore.format.sparsity import Sparsity
from logitstore.store.meta import TeacherMeta
from logitstore.store.store import Store
from logitstore.store.verify import verify
from tests.conftest import CLI, small_build, without_progress

VOCAB = 1000


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def one_line_error(result, code: int) -> str:
    assert result.exit_code == code, (result.stdout, result.stderr, result.exception)
    stderr = without_progress(result.stderr)
    assert "Traceback" not in stderr and len(stderr.splitlines()) == 1, result.stderr
    return stderr


def word_tokenizer_json(vocab: int = VOCAB) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str()


def write_store(uri: str, *, n: int = 12, seed: int = 0, part_layout: str = "packed") -> Store:
    """A store of one top-8 part of `n` samples; `part_layout="arrays"` writes it as store format 2 did."""
    store = Store.open(uri, create=True)
    samples = random_samples([f"doc-{i}" for i in range(n)], seed=seed, max_tokens=80, k=8)
    meta = TeacherMeta(
        name="teacher-a",
        vocab_size=VOCAB,
        content_hash="w",
        tokenizer_hash="t",
        sparsity=Sparsity(k=8),
        part_layout=part_layout,
    )
    with store.writer() as w:
        w.add_teacher(
            meta,
            tokenizer_json=word_tokenizer_json(),
            code_of_id=codec.frequency_id_order(samples.entry_ids, vocab_size=VOCAB),
        )
        w.write(samples, teacher="teacher-a")
        w.commit("write")
    return store


def flip_chunk_of(uri: str, array_path: str) -> None:
    """Flip bytes in the chunk file that holds `array_path` (found by trying each chunk: Icechunk names
    chunk files by random ids, and a small store has few of them)."""
    for chunk in sorted(Path(uri, "chunks").iterdir()):
        data = chunk.read_bytes()
        damaged = bytearray(data)
        damaged[len(damaged) // 2] ^= 0xFF
        chunk.write_bytes(bytes(damaged))
        try:
            Store.open(uri).read().root[array_path][:]
        except ValueError:
            return  # this chunk holds it; leave it damaged
        chunk.write_bytes(data)
    raise AssertionError(f"no chunk file holds {array_path}")


# -- 4. verify covers every array; show and train name the damage ---------------------------------------


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


# -- 7. a tag cannot shadow a branch; tags can be deleted --------------------------------------------------


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


# -- the build: a tiny random teacher with the default teacher's tokenizer --------------------------------


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def build(teacher: str, store, data, *extra):
    return run(*small_build(teacher, store, data, "--json", *extra))


def index_of(store) -> dict[str, tuple[str, str]]:
    """sample id -> (content hash, source hash)"""
    idx = Store.open(str(store)).read().index
    return {
        s: (c, h)
        for s, c, h in zip(
            idx["sample_id"].to_pylist(), idx["content_hash"].to_pylist(), idx["source_hash"].to_pylist()
        )
    }


LONG = "The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill. " * 4
OTHER = "A completely different text about storage engines, versioned arrays and their many commits. " * 3


def test_window_ids_cannot_collide_with_input_ids(tiny_teacher, tmp_path):
    store = tmp_path / "store"
    assert build(tiny_teacher, store, jsonl(tmp_path / "a.jsonl", [{"id": "a", "text": LONG}])).exit_code == 0
    assert {"a#w0", "a#w1"} <= set(index_of(store))
    before = Store.open(str(store)).resolve()
    # in this order the short document held `a#w1` and the long one's second window was lost
    for rows in (
        [{"id": "b", "text": "short one"}, {"id": "a#w1", "text": "short two"}],
        [{"id": "a#w1", "text": "short two"}, {"id": "a", "text": LONG}],
    ):
        error = one_line_error(build(tiny_teacher, store, jsonl(tmp_path / "b.jsonl", rows)), 2)
        assert "'a#w1'" in error and "window id" in error and "row" in error
        assert Store.open(str(store)).resolve() == before


def test_an_empty_id_and_an_id_beyond_the_vocabulary_name_their_row(tiny_teacher, tmp_path):
    error = one_line_error(
        build(
            tiny_teacher,
            tmp_path / "s1",
            jsonl(tmp_path / "e.jsonl", [{"id": "x", "text": "fine"}, {"id": "", "text": "no id"}]),
        ),
        2,
    )
    assert "row 1" in error and "empty string" in error
    error = one_line_error(
        run(
            "build",
            "--teacher",
            tiny_teacher,
            "--store",
            tmp_path / "s2",
            "--ids-column",
            "ids",
            "--max-length",
            "32",
            "--data",
            jsonl(tmp_path / "i.jsonl", [{"ids": [1, 2, 3]}, {"ids": [5, 10**6]}]),
        ),
        2,
    )
    assert "input row 1" in error and "1000000" in error and "vocabulary" in error


def test_max_length_beyond_the_teachers_context_is_refused_up_front(tiny_teacher, tmp_path):
    error = one_line_error(
        run(
            "build",
            "--teacher",
            tiny_teacher,
            "--store",
            tmp_path / "s",
            "--max-length",
            "1000",
            "--data",
            jsonl(tmp_path / "d.jsonl", [{"text": LONG}]),
        ),
        2,
    )
    assert "--max-length 1000 exceeds the teacher's context of 256" in error


def test_one_long_document_fills_many_units(tiny_teacher, tmp_path):
    store = tmp_path / "store"
    result = build(tiny_teacher, store, jsonl(tmp_path / "long.jsonl", [{"id": "long", "text": LONG * 3}]))
    assert result.exit_code == 0, result.stderr
    idx = Store.open(str(store)).read().index
    parts = idx.group_by("part").aggregate([("n_tokens", "sum")])
    assert idx.num_rows >= 8 and parts.num_rows >= 3  # was: one part holding every window
    assert max(parts["n_tokens_sum"].to_pylist()) < 64 + 32


def test_changed_text_under_the_same_id_is_an_error_unless_replaced_or_skipped(tiny_teacher, tmp_path):
    store = tmp_path / "store"
    first = [{"id": "doc", "text": "The first text of this document."}, {"id": "long", "text": LONG}]
    assert build(tiny_teacher, store, jsonl(tmp_path / "a.jsonl", first)).exit_code == 0
    stored = index_of(store)
    old_windows = sorted(s for s in stored if s.startswith("long"))
    assert "doc" in stored and len(old_windows) == 3
    second = [{"id": "doc", "text": "Now the document says something else."}, {"id": "long", "text": OTHER}]
    data = jsonl(tmp_path / "b.jsonl", second)
    before = Store.open(str(store)).resolve()

    error = one_line_error(build(tiny_teacher, store, data), 2)
    assert "'doc'" in error and "stored with other text" in error and "--on-duplicate replace" in error
    assert Store.open(str(store)).resolve() == before

    result = build(tiny_teacher, store, data, "--on-duplicate", "skip")
    assert result.exit_code == 0 and json.loads(result.stdout)["changed"] == 2
    assert index_of(store) == stored

    result = build(tiny_teacher, store, data, "--on-duplicate", "replace")
    summary = json.loads(result.stdout)
    assert result.exit_code == 0 and summary["changed"] == 2
    replaced = index_of(store)
    from logitstore.pipelines.inputs import text_hash

    windows = sorted(s for s in replaced if s.startswith("long"))
    assert windows == [f"long#w{i}" for i in range(len(windows))] and len(windows) == 2  # no stale window left
    assert {h for s, (_, h) in replaced.items() if s.startswith("long")} == {text_hash(OTHER)}
    assert replaced["doc"][1] == text_hash(second[0]["text"]) != stored["doc"][1]
    assert build(tiny_teacher, store, data).exit_code == 0  # now stored as given: a rerun is a no-op
    assert index_of(store) == replaced and verify(Store.open(str(store)).read()).ok


def test_merging_a_part_whose_samples_are_all_stored_adds_nothing(tmp_path):
    store = write_store(str(tmp_path / "store"), n=3)
    samples = random_samples(["doc-0", "doc-1"], max_tokens=30)
    with store.writer(on_duplicate="skip") as w:
        written = w.part_writer().write(samples, teacher="teacher-a")
        assert w.merge(written) == 0  # was: ArrowNotImplementedError from rows.take([])


# -- 5. concurrent builds and concurrent creation ------------------------------------------------------------


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


# -- 9. the smaller ones ---------------------------------------------------------------------------------------


def test_index_files_are_readable_by_other_users(tmp_path):
    write_store(str(tmp_path / "store"))
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "store" / "logitstore-index").iterdir()}
    umask = os.umask(0o022)
    os.umask(umask)
    assert modes and all(mode == 0o666 & ~umask for mode in modes.values()), modes


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


def test_info_on_a_missing_path_creates_nothing(tmp_path):
    error = one_line_error(run("info", tmp_path / "nope"), 2)
    assert "not a logitstore store" in error and not (tmp_path / "nope").exists()


def test_file_urls_are_percent_decoded(tmp_path):
    write_store(str(tmp_path / "my store"))
    result = run("info", f"file://{tmp_path}/my%20store", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["samples"] == 12
    assert not (tmp_path / "my%20store").exists()


READ_ONLY = """
import subprocess, sys
store, cli = sys.argv[1], sys.argv[2:]
subprocess.run(["mount", "--bind", store, store], check=True)
subprocess.run(["mount", "-o", "remount,bind,ro", store, store], check=True)
for args in (["tag", store, "v2"], ["build", "--store", store, "--data", cli[0], "--max-length", "32", "--teacher", cli[1]]):
    r = subprocess.run([sys.executable, "-m", "logitstore.cli.app", *args], capture_output=True, text=True)
    errors = [line for line in r.stderr.strip().splitlines() if not line.startswith("build: ")]  # not progress
    print(r.returncode, " | ".join(errors))
"""


def test_writes_to_a_read_only_filesystem_are_one_line(tiny_teacher, tmp_path):
    """A real read-only mount, in a private mount namespace (`unshare -m`): nothing outside sees it."""
    uri = str(tmp_path / "store")
    write_store(uri)
    probe = ["unshare", "-m", "sh", "-c", f"mount --bind {uri} {uri} && mount -o remount,bind,ro {uri} {uri}"]
    if shutil.which("unshare") is None or subprocess.run(probe, capture_output=True).returncode:
        pytest.skip("cannot make a read-only bind mount in a private mount namespace here (needs CAP_SYS_ADMIN)")
    data = jsonl(tmp_path / "d.jsonl", [{"text": LONG}])
    result = subprocess.run(
        ["unshare", "-m", sys.executable, "-c", READ_ONLY, uri, str(data), tiny_teacher],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2, result.stdout
    for line in lines:
        code, message = line.split(" ", 1)
        assert code == "2" and message.startswith("error:") and "|" not in message and "Read-only" in message, line
    assert Store.open(uri).read().index.num_rows == 12 and not Store.open(uri).repo.list_tags()


def test_a_piped_build_reports_progress_in_tokens_from_the_first_batch(tiny_teacher, tmp_path):
    rows = [{"id": f"d{i}", "text": f"Document {i}: " + LONG} for i in range(8)]
    data = jsonl(tmp_path / "d.jsonl", rows)
    result = subprocess.run(
        [*CLI, *small_build(tiny_teacher, tmp_path / "store", data, "--batch-tokens", "64", "--json", id_column=None)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout)
    lines = [line for line in result.stderr.splitlines() if line.startswith("build: ")]
    assert lines[0] == "build: sample ids are the input's 'id' column (found automatically)"
    progress = lines[1:]
    assert len(progress) >= 2 and all("tokens/s" in line for line in progress)  # the first batch's, and the last
    counts = [int(line.split()[1].replace(",", "")) for line in progress]
    # on a loaded machine the clock's line can come before the first batch: it says what is awaited
    assert all("first batch is not done" in line or "reading" in line for line, n in zip(progress, counts) if n == 0)
    assert 0 < next(n for n in counts if n) <= 64  # one batch of --batch-tokens, before any unit was merged
    assert progress[-1].startswith(f"build: {summary['tokens']:,} tokens, {summary['samples']:,} samples")
    assert "stdlib" not in result.stderr and [
        r["sample_id"] for r in json.loads(run("ls", tmp_path / "store", "--json").stdout)
    ][:1] == ["d0#w0"]


def test_progress_estimates_the_remaining_tokens_from_the_documents_read(tmp_path):
    from logitstore.pipelines.build import BuildConfig, Planned, Progress

    data = jsonl(tmp_path / "d.jsonl", [{"text": f"doc {i}"} for i in range(10)])
    lines = []
    planned = Planned()
    progress = Progress(BuildConfig(store="memory://p", data=str(data)), log=lines.append, every=0, planned=planned)
    progress.batch(100)  # a line at the first batch: no documents read yet, so no ETA
    assert lines[-1].startswith("build: 100 tokens, 0 samples written, 0 documents read") and "ETA" not in lines[-1]
    planned.documents, planned.tokens = 2, 400  # 200 tokens per document read, 10 documents
    progress.update(tokens=400, samples=4, documents=2)
    assert lines[-1].startswith("build: 400 of ~2,000 tokens") and "ETA" in lines[-1]
    progress.finish()
    assert lines[-1].startswith("build: 400 tokens, 4 samples written, 2 documents read") and "ETA" not in lines[-1]
