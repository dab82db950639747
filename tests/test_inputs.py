"""Stage one's input: every data format reads the same documents, errors name the file and the row,
the windowing policy covers every transition once, and JSON Lines are streamed, not loaded."""

from __future__ import annotations

import csv
import json
import resource
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from logitstore.errors import InvalidSampleError, LogitstoreError
from logitstore.pipelines import inputs
from logitstore.pipelines.inputs import (
    DataError,
    Document,
    formats,
    read_documents,
    text_hash,
)
from logitstore.pipelines.plan import window, window_ids
from logitstore.store.store import Store
from logitstore.testing.cli import LONG, OTHER, build, jsonl, one_line_error, run
from logitstore.testing.stores import index_of
from logitstore.testing.synthetic import random_samples

ROWS = [
    {"id": "a", "text": "Hello, world."},
    {"id": "b", "text": 'Two lines,\nwith "quotes" and, commas.'},
    {"id": "c", "text": "ünïcödé ✓ 漢字"},
    {"id": "d", "text": "  leading and trailing spaces  "},
    {"id": "e", "text": "last"},
]
TOKENS = [[1, 2, 3], [4], [5, 6], [0, 7, 8, 9], [10, 11]]


# ---------------------------------------------------------------------------------------------
# Writers: the same rows in every format


def _table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(_table(rows), path, row_group_size=2)  # several row groups, several batches
    return path


def write_arrow_file(path: Path, rows: list[dict]) -> Path:
    return _write_ipc(path, rows, pa.ipc.new_file)


def write_arrow_stream(path: Path, rows: list[dict]) -> Path:
    return _write_ipc(path, rows, pa.ipc.new_stream)


def _write_ipc(path: Path, rows: list[dict], open_writer) -> Path:
    table = _table(rows)
    with open_writer(path, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=2):  # several batches
            writer.write_batch(batch)
    return path


def write_csv(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for r in rows:
            writer.writerow({k: " ".join(map(str, v)) if isinstance(v, list) else v for k, v in r.items()})
    return path


def write_folder(path: Path, rows: list[dict]) -> Path:
    (path / "a").mkdir(parents=True)
    (path / "b").mkdir()
    (path / ".hidden").mkdir()
    write_jsonl(path / "a" / "part0.jsonl", rows[:2])
    write_parquet(path / "b" / "part1.parquet", rows[2:])
    write_jsonl(path / ".hidden" / "copy.jsonl", rows)  # skipped: hidden folder
    (path / "README.md").write_text("not data")  # skipped: not a data extension
    return path


def write_hf(path: Path, rows: list[dict]) -> Path:
    """What `datasets`' save_to_disk writes: Arrow stream shards listed in state.json (the state
    order differs from the names' order here, to check that state.json's order is used)."""
    path.mkdir()
    write_arrow_stream(path / "data-00001-of-00002.arrow", rows[:3])
    write_arrow_stream(path / "data-00000-of-00002.arrow", rows[3:])
    state = {
        "_data_files": [{"filename": "data-00001-of-00002.arrow"}, {"filename": "data-00000-of-00002.arrow"}],
        "_fingerprint": "0",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    (path / "state.json").write_text(json.dumps(state))
    (path / "dataset_info.json").write_text(json.dumps({"features": {}}))
    return path


WRITERS = {
    "data.jsonl": write_jsonl,
    "data.parquet": write_parquet,
    "data.arrow": write_arrow_file,
    "stream.arrow": write_arrow_stream,
    "data.csv": write_csv,
    "folder": write_folder,
    "hf_dataset": write_hf,
}


def summary(docs: list[Document]) -> list[tuple]:
    return [(d.id, d.text, d.source_hash, d.row) for d in docs]


# ---------------------------------------------------------------------------------------------
# Formats


@pytest.mark.parametrize("name", list(WRITERS))
def test_every_format_reads_the_same_documents(tmp_path, name):
    path = WRITERS[name](tmp_path / name, ROWS)
    docs = list(read_documents(path, batch_rows=2, id_column=""))  # "": content hashes as ids
    expected = [(text_hash(r["text"]), r["text"], text_hash(r["text"]), i) for i, r in enumerate(ROWS)]
    assert summary(docs) == expected
    assert all(d.token_ids is None for d in docs)

    with_ids = list(read_documents(path, id_column="id"))
    assert [d.id for d in with_ids] == [r["id"] for r in ROWS]
    assert [d.id for d in read_documents(path)] == [r["id"] for r in ROWS]  # an `id` column is found by itself
    assert [d.source_hash for d in with_ids] == [text_hash(r["text"]) for r in ROWS]


def test_text_hash_is_sha256_prefix():
    assert text_hash("abc") == "ba7816bf8f01cfea414140de5dae2223"


def test_integer_ids_become_strings(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", [{"n": 7, "text": "x"}, {"n": 12, "text": "y"}])
    assert [d.id for d in read_documents(path, id_column="n")] == ["7", "12"]


def test_csv_ids_keep_their_spelling(tmp_path):
    path = write_csv(tmp_path / "d.csv", [{"n": "007", "text": "x"}])
    assert [d.id for d in read_documents(path, id_column="n")] == ["007"]


def test_other_text_column_and_extra_columns(tmp_path):
    rows = [{"body": "one", "meta": {"x": [1, 2]}, "score": 0.5}, {"body": "two", "meta": {"x": []}, "score": 1.0}]
    path = write_jsonl(tmp_path / "d.ndjson", rows)
    assert [d.text for d in read_documents(path, text_column="body")] == ["one", "two"]


def test_sample_corpus_is_the_default():
    docs = list(read_documents(None))
    assert len(docs) >= 50
    assert all(d.text and d.id and d.id != d.source_hash for d in docs)  # ids from its id column
    assert [d.row for d in docs] == list(range(len(docs)))
    assert len({d.id for d in docs}) == len(docs)


def test_json_lines_across_chunks(tmp_path, monkeypatch):
    """Chunks of whole lines: the first fixes the types, later ones follow them."""
    monkeypatch.setattr(formats, "_JSON_CHUNK_BYTES", 64)
    rows = [{"id": i, "text": f"document number {i} " * (i % 7 + 1)} for i in range(200)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    docs = list(read_documents(path, id_column="id", batch_rows=3))
    assert [(d.id, d.text, d.row) for d in docs] == [(str(i), r["text"], i) for i, r in enumerate(rows)]


def test_csv_row_longer_than_a_block(tmp_path, monkeypatch):
    """A row that does not fit pyarrow's block: the reader restarts with larger blocks, no row twice."""
    monkeypatch.setattr(formats, "_CSV_BLOCK_BYTES", 256)
    rows = [{"id": str(i), "text": ("long\nrow " * 300 if i == 40 else f"row {i}")} for i in range(60)]
    path = write_csv(tmp_path / "d.csv", rows)
    docs = list(read_documents(path, id_column="id"))
    assert [(d.id, d.text) for d in docs] == [(r["id"], r["text"]) for r in rows]


def test_empty_files_hold_no_documents(tmp_path):
    (tmp_path / "a.jsonl").write_text("")
    (tmp_path / "b.csv").write_text("")
    assert list(read_documents(tmp_path)) == []


# ---------------------------------------------------------------------------------------------
# Pre-tokenized input


@pytest.mark.parametrize("name", ["data.jsonl", "data.parquet", "data.arrow", "data.csv", "hf_dataset"])
def test_ids_column(tmp_path, name):
    rows = [{"id": r["id"], "text": r["text"], "tok": t} for r, t in zip(ROWS, TOKENS)]
    path = WRITERS[name](tmp_path / name, rows)
    docs = list(read_documents(path, ids_column="tok", batch_rows=2, id_column=""))
    assert [d.token_ids.tolist() for d in docs] == TOKENS
    assert all(d.token_ids.dtype == np.int64 and d.text is None for d in docs)
    hashes = [inputs.ids_hash(np.array(t)) for t in TOKENS]
    assert [d.source_hash for d in docs] == hashes
    assert [d.id for d in docs] == hashes  # no id column: the content hash
    # ids win over an explicitly given text column, which is then not read at all
    both = list(read_documents(path, ids_column="tok", text_column="no-such-column", id_column="id"))
    assert [(d.id, d.token_ids.tolist(), d.text) for d in both] == [(r["id"], t, None) for r, t in zip(ROWS, TOKENS)]


def test_ids_of_other_integer_types(tmp_path):
    table = pa.table({"tok": pa.array([[1, 2], [65535]], pa.large_list(pa.uint16()))})
    pq.write_table(table, tmp_path / "d.parquet")
    docs = list(read_documents(tmp_path / "d.parquet", ids_column="tok"))
    assert [d.token_ids.tolist() for d in docs] == [[1, 2], [65535]]
    floats = write_jsonl(tmp_path / "f.jsonl", [{"tok": [1.0, 2.0]}])
    assert next(read_documents(floats, ids_column="tok")).token_ids.tolist() == [1, 2]


def test_csv_ids_spellings(tmp_path):
    path = write_csv(tmp_path / "d.csv", [{"tok": "[1, 2, 3]"}, {"tok": "4,5"}, {"tok": " 6 "}])
    assert [d.token_ids.tolist() for d in read_documents(path, ids_column="tok")] == [[1, 2, 3], [4, 5], [6]]


# ---------------------------------------------------------------------------------------------
# Errors


def raises(match: str):
    return pytest.raises(DataError, match=match)


def test_data_error_is_a_user_error():
    assert issubclass(DataError, LogitstoreError)


def test_missing_path(tmp_path):
    with raises(r"nope\.jsonl: no such file or folder"):
        read_documents(tmp_path / "nope.jsonl")


def test_unsupported_extension(tmp_path):
    (tmp_path / "d.txt").write_text("hello")
    with raises(r"d\.txt: unsupported file type '\.txt'; supported: \.jsonl"):
        read_documents(tmp_path / "d.txt")


def test_empty_folder(tmp_path):
    with raises("holds no data files"):
        read_documents(tmp_path)
    (tmp_path / "notes.md").write_text("x")
    with raises("holds no data files"):
        read_documents(tmp_path)


def test_neither_text_nor_ids(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with raises("give --text-column or --ids-column"):
        read_documents(path, text_column=None)


@pytest.mark.parametrize("name", ["data.jsonl", "data.parquet", "data.arrow", "stream.arrow", "data.csv"])
@pytest.mark.parametrize("option", ["text_column", "id_column", "ids_column"])
def test_missing_column(tmp_path, name, option):
    path = WRITERS[name](tmp_path / name, ROWS)
    flag = "--" + option.replace("_", "-")
    with raises(rf"{name}: no column 'body' \({flag}\); its columns are: 'id', 'text'"):
        list(read_documents(path, **{option: "body"}))


def test_hf_dataset_dict_is_refused(tmp_path):
    (tmp_path / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    write_hf(tmp_path / "train", ROWS)
    with raises(r"DatasetDict \(splits: train, test\); give one split's folder"):
        read_documents(tmp_path)
    assert len(list(read_documents(tmp_path / "train"))) == len(ROWS)


def test_hf_state_naming_a_missing_file(tmp_path):
    path = write_hf(tmp_path / "hf", ROWS)
    (path / "data-00000-of-00002.arrow").unlink()
    with raises(r"data-00000-of-00002\.arrow: listed in .*state\.json but missing"):
        read_documents(path)


@pytest.mark.parametrize(
    "bad, what", [(None, "null"), ("", "empty or whitespace-only"), (" \n\t ", "empty or whitespace-only")]
)
def test_bad_text_names_row_and_id(tmp_path, bad, what):
    rows = [{"id": "a", "text": "fine"}, {"id": "b", "text": "fine"}, {"id": "c", "text": bad}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with raises(rf"d\.jsonl: row 2, document 'c': text column 'text' is {what}"):
        list(read_documents(path, id_column="id"))
    with raises(rf"d\.jsonl: row 2: text column 'text' is {what}"):
        list(read_documents(path, id_column=""))


def test_empty_csv_text(tmp_path):
    path = write_csv(tmp_path / "d.csv", [{"id": "a", "text": "x"}, {"id": "b", "text": ""}])
    with raises(r"d\.csv: row 1, document 'b': text column 'text' is empty"):
        list(read_documents(path, id_column="id"))


def test_row_numbers_in_a_folder(tmp_path):
    """In a folder the row within the file comes first (to find it), the row of the input after."""
    write_jsonl(tmp_path / "a.jsonl", ROWS)
    write_jsonl(tmp_path / "b.jsonl", [{"id": "x", "text": "ok"}, {"id": "y", "text": " "}])
    with raises(r"b\.jsonl: row 1 \(input row 6\), document 'y'"):
        list(read_documents(tmp_path, id_column="id"))


def test_null_id(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "text": "x"}, {"id": None, "text": "y"}])
    with raises(r"d\.jsonl: row 1: id column 'id' is null"):
        list(read_documents(path, id_column="id"))


def test_non_text_column(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"n": 1}, {"n": 2}])
    with raises(r"d\.jsonl: text column 'n' holds int64, not text"):
        list(read_documents(path, text_column="n"))
    with raises(r"e\.jsonl: id column 'n' holds .*ids must be strings or integers"):
        list(read_documents(write_jsonl(tmp_path / "e.jsonl", [{"n": [1], "text": "x"}]), id_column="n"))


def test_invalid_utf8_jsonl(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "bad \xff\xfe here"}\n')
    with raises(r"d\.jsonl: row 1: column 'text' is not valid UTF-8"):
        list(read_documents(path))


def test_invalid_utf8_csv(tmp_path):
    path = tmp_path / "d.csv"
    path.write_bytes(b'id,text\na,fine\nb,"bad \xff here"\n')
    with raises(r"d\.csv: invalid UTF-8"):
        list(read_documents(path))


def test_invalid_utf8_parquet_binary(tmp_path):
    pq.write_table(pa.table({"text": pa.array([b"fine", b"\xc3\x28"], pa.binary())}), tmp_path / "d.parquet")
    with raises(r"d\.parquet: row 1: column 'text' is not valid UTF-8"):
        list(read_documents(tmp_path / "d.parquet"))
    # valid UTF-8 in a binary column reads as text
    pq.write_table(pa.table({"text": pa.array([b"ok"], pa.binary())}), tmp_path / "e.parquet")
    assert [d.text for d in read_documents(tmp_path / "e.parquet")] == ["ok"]


def test_invalid_utf8_arrow_string(tmp_path):
    # A string column holding bytes that are not UTF-8: pyarrow does not check this when reading.
    text = pa.array([b"fine", b"bad \xff"], pa.binary()).view(pa.string())
    write = pa.table({"text": text})
    with pa.ipc.new_file(tmp_path / "d.arrow", write.schema) as writer:
        writer.write_table(write)
    with raises(r"d\.arrow: row 1: column 'text' is not valid UTF-8"):
        list(read_documents(tmp_path / "d.arrow"))


@pytest.mark.parametrize(
    "tok, message",
    [
        ([1, -2], r"row 1: ids column 'tok' holds a negative token id -2"),
        ([1, 2.5], r"row 1: ids column 'tok' holds a non-integer token id 2\.5"),
        ([1, None], r"row 1: ids column 'tok' holds a null token id"),
        (None, r"row 1: ids column 'tok' is null"),
        ([], r"row 1: ids column 'tok' is empty"),
    ],
)
def test_bad_ids_jsonl(tmp_path, tok, message):
    path = write_jsonl(tmp_path / "d.jsonl", [{"tok": [3, 4]}, {"tok": tok}])
    with raises(rf"d\.jsonl: {message}"):
        list(read_documents(path, ids_column="tok"))


@pytest.mark.parametrize(
    "tok, message",
    [
        ("1 x 3", r"row 1, document 'b': ids column 'tok' holds a non-integer token id in '1 x 3'"),
        ("[1, -3]", r"row 1, document 'b': ids column 'tok' holds a negative token id -3"),
        ("[]", r"row 1, document 'b': ids column 'tok' is empty"),
    ],
)
def test_bad_ids_csv(tmp_path, tok, message):
    path = write_csv(tmp_path / "d.csv", [{"id": "a", "tok": "1 2"}, {"id": "b", "tok": tok}])
    with raises(rf"d\.csv: {message}"):
        list(read_documents(path, ids_column="tok", id_column="id"))


def test_ids_that_are_not_lists(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", [{"tok": 1.5}])
    with raises(r"ids column 'tok' holds double, not lists of token ids"):
        list(read_documents(path, ids_column="tok"))


def test_not_json_lines(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(ROWS))  # one JSON array, not one object per line
    with raises(r"d\.json: cannot read as jsonl"):
        list(read_documents(path))


def test_not_arrow(tmp_path):
    (tmp_path / "d.arrow").write_bytes(b"this is not arrow at all")
    with raises(r"d\.arrow: cannot read as arrow"):
        list(read_documents(tmp_path / "d.arrow"))


# ---------------------------------------------------------------------------------------------
# Windowing


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 200), max_length=st.integers(2, 40))
def test_windows_cover_every_transition_once(n, max_length):
    ids = np.arange(100, 100 + n, dtype=np.int64)  # distinct tokens: a transition is a pair of values
    windows = window(ids, max_length=max_length)
    assert all(len(w) <= max_length for w in windows)
    if n <= max_length:
        assert len(windows) == 1 and np.array_equal(windows[0], ids)
        return
    assert all(len(w) >= 2 for w in windows)
    transitions = [(int(a), int(b)) for w in windows for a, b in zip(w[:-1], w[1:])]
    assert sorted(transitions) == [(int(a), int(b)) for a, b in zip(ids[:-1], ids[1:])]
    assert len(set(transitions)) == len(transitions)
    # consecutive windows overlap by exactly one token; dropping it gives back the document
    for previous, nxt in zip(windows, windows[1:]):
        assert previous[-1] == nxt[0]
    rebuilt = np.concatenate([windows[0]] + [w[1:] for w in windows[1:]])
    assert np.array_equal(rebuilt, ids)


def test_window_examples():
    ids = np.arange(10)
    assert [w.tolist() for w in window(ids, max_length=4)] == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    # 11 tokens: the tail window [9, 10] holds the one transition left
    assert [w.tolist() for w in window(np.arange(11), max_length=4)][-1] == [9, 10]
    assert [w.tolist() for w in window(ids, max_length=10)] == [list(range(10))]
    assert [w.tolist() for w in window(ids, max_length=2)] == [[i, i + 1] for i in range(9)]


def test_window_needs_two_tokens():
    with raises("--max-length must be at least 2 tokens, got 1"):
        window(np.arange(5), max_length=1)


def test_window_ids():
    assert window_ids("doc", 1) == ["doc"]
    assert window_ids("doc", 3) == ["doc#w0", "doc#w1", "doc#w2"]


# ---------------------------------------------------------------------------------------------
# Streaming


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc for the current RSS")
def test_jsonl_is_streamed(tmp_path):
    """A ~50 MB JSONL reads with memory bounded by a chunk, not the file: Arrow's allocations and
    the process's resident memory stay far below the file size throughout."""
    path = tmp_path / "big.jsonl"
    filler = "lorem ipsum dolor sit amet " * 36
    with open(path, "w") as f:
        for start in range(0, 50_000, 1_000):
            f.write(
                "".join(
                    json.dumps({"id": f"d{i}", "text": f"{filler}{i}", "extra": i}) + "\n"
                    for i in range(start, start + 1_000)
                )
            )
    size = path.stat().st_size
    assert size > 48_000_000
    base_rss, peak_rss, peak_arrow, count = _rss_bytes(), 0, 0, 0
    for doc in read_documents(path, id_column="id"):  # noqa: B007 (the last one is checked below)
        count += 1
        if count % 500 == 0:
            peak_arrow = max(peak_arrow, pa.total_allocated_bytes())
            peak_rss = max(peak_rss, _rss_bytes() - base_rss)
    assert count == 50_000 and doc.id == "d49999"
    assert peak_arrow < size / 10, f"Arrow held {peak_arrow / 1e6:.1f} MB of a {size / 1e6:.1f} MB file"
    assert peak_rss < size / 2, f"RSS grew {peak_rss / 1e6:.1f} MB reading a {size / 1e6:.1f} MB file"


def test_an_id_column_is_used_automatically_and_check_input_says_so(tmp_path):
    from logitstore.pipelines.inputs import check_input

    path = tmp_path / "d.jsonl"
    path.write_text('{"id": "x-1", "text": "one"}\n{"id": "y-2", "text": "two"}\n')
    assert [d.id for d in read_documents(path)] == ["x-1", "y-2"]
    assert check_input(path) == "the input's 'id' column (found automatically)"
    hashed = [d.id for d in read_documents(path, id_column="")]  # "" asks for content hashes
    assert (
        hashed == [d.source_hash for d in read_documents(path)] and check_input(path, id_column="") == "content hashes"
    )
    plain = tmp_path / "p.jsonl"
    plain.write_text('{"text": "one"}\n')
    assert check_input(plain) == "content hashes"
    with pytest.raises(DataError, match="no column 'name'"):
        check_input(path, id_column="name")


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


def test_one_long_document_fills_many_units(tiny_teacher, tmp_path):
    store = tmp_path / "store"
    result = build(tiny_teacher, store, jsonl(tmp_path / "long.jsonl", [{"id": "long", "text": LONG * 3}]))
    assert result.exit_code == 0, result.stderr
    idx = Store.open(str(store)).read().index
    parts = idx.group_by("part").aggregate([("n_tokens", "sum")])
    assert idx.num_rows >= 8 and parts.num_rows >= 3  # was: one part holding every window
    assert max(parts["n_tokens_sum"].to_pylist()) < 64 + 32


def test_a_document_too_large_to_tokenize_whole_is_refused_in_one_line(tiny_teacher, tmp_path, monkeypatch):
    from logitstore.pipelines import plan

    monkeypatch.setattr(plan, "MAX_DOCUMENT_CHARS", 1000)
    data = jsonl(tmp_path / "d.jsonl", [{"id": "small", "text": "short"}, {"id": "huge", "text": "word " * 400}])
    error = one_line_error(build(tiny_teacher, tmp_path / "store", data), 2)
    assert "document 'huge' (input row 1) has 2,000 characters, more than the 1,000" in error, error
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("bad", ["line\nbreak", "nul\x00id", "tab\there", "del\x7f"])
def test_an_id_with_a_control_character_is_refused_naming_its_row(tiny_teacher, tmp_path, bad):
    data = jsonl(tmp_path / "d.jsonl", [{"id": "fine", "text": LONG}, {"id": bad, "text": OTHER}])
    error = one_line_error(build(tiny_teacher, tmp_path / "store", data), 2)  # was: stored, ls printed it raw
    assert "row 1" in error and "control character" in error and bad not in error, error
    assert not (tmp_path / "store").exists()
    samples = random_samples([bad], max_tokens=10)
    with pytest.raises(InvalidSampleError, match="without control characters"):
        samples.validate(vocab_size=1000)


def test_the_planner_tokenizes_as_the_tokenizer_itself_does(gpt2_tokenizer_dir, tmp_path):
    """`plan.encode_ids` (the Rust tokenizer's offsets-free batch) gives `tokenizer(texts)`'s ids: for the
    default teacher's tokenizer and GPT-2's, special tokens in the text, empty and odd texts; and a tokenizer
    set to truncate goes through `tokenizer(texts)` itself."""
    from transformers import AutoTokenizer

    from logitstore.data import SAMPLE_CORPUS
    from logitstore.pipelines.plan import encode_ids
    from logitstore.pipelines.teacher import describe_teacher

    texts = [json.loads(line)["text"] for line in SAMPLE_CORPUS.read_text().splitlines()[:20]]
    texts += ["<|im_start|>user hi<|im_end|>", "<|endoftext|>", "", " leading", "tab\tand\nnewline", "東京 café"]
    for tokenizer in (describe_teacher(None).tokenizer, AutoTokenizer.from_pretrained(gpt2_tokenizer_dir)):
        assert encode_ids(tokenizer, texts) == tokenizer(texts)["input_ids"]
        tokenizer._tokenizer.enable_truncation(max_length=3)  # not how __call__ runs it: the fallback
        assert encode_ids(tokenizer, texts) == tokenizer(texts)["input_ids"]
