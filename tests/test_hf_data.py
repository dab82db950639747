"""`build --data` as a Hugging Face `datasets` name or dataset folder, with `--split`/`--data-config`
(offline: a local dataset folder whose files name their splits)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from logitstore.cli.app import app
from logitstore.pipelines.inputs import DataError, HubDataset, dataset_source, read_documents
from logitstore.store.store import Store
from logitstore.testing.cli import without_progress


@pytest.fixture
def dataset_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    folder = tmp_path / "corpus"
    (folder / "data").mkdir(parents=True)
    for split, n in (("train", 3), ("test", 2)):
        (folder / "data" / f"{split}.jsonl").write_text(
            "".join(
                json.dumps({"id": f"{split}-{i}", "text": f"The {split} split, document {i}."}) + "\n" for i in range(n)
            )
        )
    return folder


def test_a_split_of_a_dataset_folder_is_read_through_datasets(dataset_folder):
    source = dataset_source(str(dataset_folder), split="test")
    assert source == HubDataset(name=str(dataset_folder), split="test")
    assert [d.id for d in read_documents(source)] == ["test-0", "test-1"]
    assert dataset_source(str(dataset_folder)) == str(dataset_folder)  # no --split: our own folder reader
    assert isinstance(dataset_source("org/some-dataset"), HubDataset)  # no such path: a datasets name


def test_build_from_a_dataset_split(dataset_folder, tmp_path):
    store = str(tmp_path / "store")
    result = CliRunner().invoke(
        app,
        [
            "build",
            "--data",
            str(dataset_folder),
            "--split",
            "train",
            "--store",
            store,
            "--max-length",
            "64",
            "--top-k",
            "4",
        ],
    )
    assert result.exit_code == 0, result.stderr
    assert sorted(Store.open(store).read().index["sample_id"].to_pylist()) == ["train-0", "train-1", "train-2"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--split", "nope"], "Bad split: nope"),
        (["--split", "train", "--text-column", "body"], "no column 'body'"),
    ],
)
def test_bad_dataset_input_is_one_line_and_creates_no_store(dataset_folder, tmp_path, args, message):
    result = CliRunner().invoke(app, ["build", "--data", str(dataset_folder), "--store", str(tmp_path / "s"), *args])
    error = without_progress(result.stderr)
    assert result.exit_code == 2 and message in error and len(error.strip().splitlines()) == 1, error
    assert not (tmp_path / "s").exists()


def test_a_datasets_name_not_reachable_offline_is_one_line(dataset_folder):
    with pytest.raises(DataError, match="nosuchorg/nosuch"):
        list(read_documents(dataset_source("nosuchorg/nosuch")))
