"""Where `--data` points: a file (its format from the extension), a folder of files, a `save_to_disk` folder, a
`datasets` name (`HubDataset`), or nothing (the shipped sample). `resolve` lists the files in read order with
their formats; `count_documents` counts rows where that is cheap. docs/build.md "Input data" has the rules.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from logitstore.data import SAMPLE_CORPUS
from logitstore.errors import LogitstoreError

FORMATS: dict[str, str] = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
    ".csv": "csv",
}


class DataError(LogitstoreError):
    """The input data cannot be read: missing path or column, unsupported format, or a bad row."""


@dataclass(frozen=True)
class HubDataset:
    """A `datasets` dataset to stream: a Hub name (`org/name`) or a local dataset folder."""

    name: str
    config: str | None = None
    split: str = "train"

    def __str__(self) -> str:  # how messages name it
        return f"{self.name}" + (f" ({self.config})" if self.config else "") + f" split {self.split!r}"


# `org/name`: a Hub dataset id. Without --split/--data-config, only this shape (and no local path of that
# name, and no data file extension) is taken for a datasets name: a mistyped local path stays one.
_DATASET_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def dataset_source(data: str | None, *, split: str | None = None, config: str | None = None) -> str | HubDataset | None:
    """What `--data` (with `--split`/`--data-config`) reads: the path as given, or a `HubDataset` for an
    `org/name` that is no local path, or wherever a split or configuration was asked for."""
    if data is None:
        if split is not None or config is not None:
            raise DataError("--split and --data-config apply to a datasets name or folder given with --data")
        return None
    named = (
        _DATASET_ID.fullmatch(data)
        and Path(data).suffix.lower() not in FORMATS
        and not Path(data).expanduser().exists()
    )
    if split is None and config is None and not named:
        return data
    return HubDataset(name=data, config=config, split=split or "train")


def count_documents(data: str | os.PathLike | HubDataset | None) -> int | None:
    """Rows in the input when cheap to know (for the progress bar's ETA), else None.

    Parquet and Arrow IPC files say it in their metadata; JSONL is counted by newlines at disk
    speed. CSV (newlines inside quoted values) and Arrow streams would need a full parse: None."""
    try:
        _root, files = resolve(data)
        total = 0
        for path, kind in files:
            if isinstance(path, HubDataset):
                return None  # streamed: its rows are known only once read
            if kind == "parquet":
                total += pq.ParquetFile(path).metadata.num_rows
            elif kind == "jsonl":
                total += _count_lines(path)
            elif kind == "arrow":
                with pa.OSFile(str(path), "rb") as f:
                    total += _arrow_file_rows(f)
            else:
                return None
        return total
    except (DataError, OSError, pa.ArrowInvalid):
        return None


def _count_lines(path: Path) -> int:
    lines, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            lines += block.count(b"\n")
            last = block[-1:]
    return lines + (last != b"\n")  # a final line without a newline still counts


def _arrow_file_rows(f) -> int:
    reader = pa.ipc.open_file(f)  # raises ArrowInvalid for the stream format
    return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))


def resolve(data) -> tuple[Path, Sequence[tuple[Path | HubDataset, str]]]:
    """The input's root path and its files with their formats, in read order."""
    if data is None:
        return SAMPLE_CORPUS, [(SAMPLE_CORPUS, "jsonl")]
    if isinstance(data, HubDataset):
        return Path(data.name), [(data, "datasets")]
    root = Path(os.fspath(data)).expanduser()
    if not root.exists():
        raise DataError(f"{root}: no such file or folder")
    if root.is_dir():
        files = _hf_files(root) if _is_hf_dataset(root) else _folder_files(root)
        return root, files
    return root, [(root, _format_of(root))]


def _format_of(path: Path) -> str:
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        supported = ", ".join(FORMATS)
        raise DataError(f"{path}: unsupported file type {path.suffix or '(no extension)'!r}; supported: {supported}")
    return kind


def _folder_files(root: Path) -> list[tuple[Path, str]]:
    """Every supported, non-hidden file below `root`, sorted by relative path."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Hidden folders (.git, .ipynb_checkpoints) hold copies or metadata, not documents.
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            path = Path(dirpath, name)
            if not name.startswith(".") and path.suffix.lower() in FORMATS:
                found.append((path.relative_to(root).as_posix(), path))
    if not found:
        raise DataError(f"{root}: the folder holds no data files ({', '.join(FORMATS)})")
    return [(path, FORMATS[path.suffix.lower()]) for _rel, path in sorted(found)]


def _is_hf_dataset(root: Path) -> bool:
    if (root / "dataset_dict.json").is_file():
        try:
            splits = [str(s) for s in json.loads((root / "dataset_dict.json").read_text())["splits"]]
        except (ValueError, KeyError, TypeError):
            splits = []
        raise DataError(
            f"{root}: a Hugging Face DatasetDict (splits: {', '.join(splits)}); "
            f"give one split's folder, e.g. {root / (splits[0] if splits else 'train')}"
        )
    return (root / "state.json").is_file() and (root / "dataset_info.json").is_file()


def _hf_files(root: Path) -> list[tuple[Path, str]]:
    """The Arrow stream files of a `save_to_disk` folder, in `state.json` order."""
    try:
        state = json.loads((root / "state.json").read_text())
        names = [entry["filename"] for entry in state["_data_files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{root / 'state.json'}: not a Hugging Face datasets state file ({exc})") from exc
    files = [(root / name, "arrow") for name in names]
    for path, _kind in files:
        if not path.is_file():
            raise DataError(f"{path}: listed in {root / 'state.json'} but missing")
    if not files:
        raise DataError(f"{root / 'state.json'}: lists no data files")
    return files
