"""`logitstore export --what entries`: one Parquet row per position holding what `show` prints, read by
polars and `datasets`; the selection flags; row groups written as they fill; bad input refused in one
line with nothing written; damage found half-way leaves nothing either."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import polars as pl
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from logitstore.errors import DamagedDataError
from logitstore.store.entries import write_entries
from logitstore.store.store import Store
from logitstore.testing.cli import one_line_error, run
from logitstore.testing.streams import build_store

TEACHER = "teacher-a"


@pytest.fixture(scope="module")
def sampled_store(tmp_path_factory) -> str:
    """A sampled teacher's store of 24 samples in 3 parts."""
    uri = str(tmp_path_factory.mktemp("sampled") / "store")
    build_store(uri, n=24, parts=3, mode="sampled", max_tokens=40, part_layout="packed+students")
    return uri


def export(store: str, out: Path, *flags) -> dict:
    result = run("export", store, out, "--what", "entries", "--json", *flags)
    assert result.exit_code == 0, result.stderr
    assert "tokens/s" in result.stderr  # the progress line
    return json.loads(result.stdout)


def test_a_row_per_position_holds_what_show_prints(sampled_store, tmp_path):
    out = tmp_path / "entries.parquet"
    summary = export(sampled_store, out)
    rows = pl.read_parquet(out)
    view = Store.open(sampled_store).read()
    ids = view.index["sample_id"].to_pylist()
    assert summary["samples"] == len(ids) and summary["positions"] == rows.height
    assert rows.schema["ids"] == pl.List(pl.Int32) and rows.schema["logprobs"] == pl.List(pl.Float32)
    assert rows.schema["counts"] == pl.List(pl.Int32)
    for sample_id in ids:
        shown = json.loads(run("show", sampled_store, sample_id, "--json").stdout)
        mine = rows.filter(pl.col("sample") == sample_id)
        assert mine["position"].to_list() == list(range(len(shown["positions"])))
        assert mine["token"].to_list() + mine["next_token"].to_list()[-1:] == shown["input_ids"]
        columns = ("ids", "logprobs", "counts", "tail", "target_logprob")
        assert mine.select(columns).to_dicts() == [{c: p[c] for c in columns} for p in shown["positions"]]
    metadata = json.loads(pq.read_schema(out).metadata[b"logitstore"])
    meta = view.teachers[TEACHER]
    assert metadata == {
        "teacher": TEACHER,
        "sparsity": meta.sparsity.to_json(),
        "grid": meta.codec.to_json(),
        "vocab_size": meta.vocab_size,
        "version": view.snapshot_id,
        "store_format": 4,
    }
    loaded = datasets.load_dataset("parquet", data_files=str(out), split="train")
    assert loaded.num_rows == rows.height and loaded[0]["ids"] == rows["ids"][0].to_list()


def test_samples_and_limit_select_in_index_order(sampled_store, tmp_path):
    ids = Store.open(sampled_store).read().index["sample_id"].to_pylist()
    asked = tmp_path / "ids.txt"
    asked.write_text(f"{ids[7]}\n\n{ids[2]}\n{ids[20]}\n")
    out = tmp_path / "some.parquet"
    assert export(sampled_store, out, "--samples", asked, "--limit", 2)["samples"] == 2
    assert pl.read_parquet(out)["sample"].unique(maintain_order=True).to_list() == [ids[2], ids[7]]
    export(sampled_store, out, "--limit", 5, "--force")
    assert pl.read_parquet(out)["sample"].unique(maintain_order=True).to_list() == ids[:5]


def test_row_groups_are_written_as_they_fill(sampled_store, tmp_path):
    view = Store.open(sampled_store).read()
    per_part = view.index.group_by("part").aggregate([("n_tokens", "sum"), ("n_tokens", "count")])
    part_positions = max(pc.subtract(per_part["n_tokens_sum"], per_part["n_tokens_count"]).to_pylist())
    out = tmp_path / "groups.parquet"
    summary = write_entries(view, out, row_group_positions=100)
    meta = pq.read_metadata(out)
    assert meta.num_row_groups == summary["row_groups"] >= 3  # a part's rows close a group past 100 positions
    assert meta.num_rows == summary["positions"]
    assert all(meta.row_group(i).num_rows < 100 + part_positions for i in range(meta.num_row_groups))


@pytest.mark.parametrize(
    "flags, says",
    [
        (("--teacher", "nobody"), "no teacher 'nobody'"),
        (("--version", "no-such-version"), "no version, tag or branch 'no-such-version'"),
        (("--samples", "IDS"), "no sample 'doc-999'"),
        (("--samples", "MISSING"), "cannot read the sample ids"),
        ((), "exists; pass --force"),
        (("--what", "answers", "--limit", "3"), "--samples and --limit select entries"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(sampled_store, tmp_path, flags, says):
    (tmp_path / "ids.txt").write_text("doc-001\ndoc-999\n")
    out = tmp_path / "entries.parquet"
    if says.startswith("exists"):
        out.write_bytes(b"keep me")
    flags = [
        str(tmp_path / "ids.txt") if f == "IDS" else str(tmp_path / "none.txt") if f == "MISSING" else f for f in flags
    ]
    before = sorted(p.name for p in tmp_path.iterdir())
    message = one_line_error(run("export", sampled_store, out, "--what", "entries", *flags), 2)
    assert says in message
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no file, no temporary file beside it
    if out.exists():
        assert out.read_bytes() == b"keep me"


def test_damage_found_half_way_leaves_nothing(tmp_path):
    """A part damaged after the first row group is written: exit 1 naming the sample, and neither OUT
    nor the temporary file it was being written to is left."""
    uri = str(tmp_path / "store")
    view = build_store(uri, n=24, parts=3, max_tokens=40)
    last = view.index["sample_id"].to_pylist()[-1]
    damage_part_of(uri, last)
    out = tmp_path / "out" / "entries.parquet"
    out.parent.mkdir()
    with pytest.raises(DamagedDataError, match="is damaged"):
        write_entries(Store.open(uri).read(), out, row_group_positions=1)
    assert list(out.parent.iterdir()) == []
    assert "is damaged" in one_line_error(run("export", uri, out, "--what", "entries"), 1)


def damage_part_of(uri: str, sample_id: str) -> None:
    """Flip a byte in the middle of the chunk file whose damage makes `sample_id` unreadable."""
    for chunk in sorted(Path(uri, "chunks").iterdir()):
        data = chunk.read_bytes()
        chunk.write_bytes(data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1 :])
        try:
            Store.open(uri).read().sample(sample_id)
        except DamagedDataError:
            return
        chunk.write_bytes(data)
    raise AssertionError(f"no chunk file holds {sample_id}")


def test_chat_data_exports_the_loss_mask_of_each_next_token(chat_store, tmp_path):
    out = tmp_path / "chat.parquet"
    export(chat_store, out)
    rows = pl.read_parquet(out)
    first = rows["sample"][0]
    shown = json.loads(run("show", chat_store, first, "--json").stdout)
    assert rows.filter(pl.col("sample") == first)["loss_mask"].to_list() == shown["loss_mask"][1:]
    assert 0 < rows["loss_mask"].sum() < rows.height  # prompts and completions both
