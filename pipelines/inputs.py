"""Stage one's input side: documents out of a data file or folder, and how long ones are windowed.
(Longer than ~600 lines on purpose: every format's reader shares the column checks and the batch-by-batch
`Document` stream here; split by format, each file would repeat them.)

`read_documents` streams `Document`s out of what `logitstore build --data DATA` names:

- a file, its format from the extension: JSON Lines (`.jsonl`, `.json`, `.ndjson`; one object per
  line), Parquet (`.parquet`, `.pq`), Arrow IPC (`.arrow`, `.feather`, `.ipc`; file or stream
  format, whichever it is) or CSV (`.csv`, with a header row; quoted values may span lines);
- a folder: every file of those extensions below it, recursively, in the order of their relative
  paths (formats may be mixed; hidden files and folders, named ".*", are skipped);
- a folder written by Hugging Face `datasets`' `save_to_disk` (it holds `state.json` and
  `dataset_info.json`): its `data-*.arrow` files in the order `state.json` lists them;
- nothing (`None`): the shipped sample corpus, with its `id` column as document ids (with a chat
  column: the shipped chat sample, `logitstore/data/sample_chat.jsonl`);
- a `HubDataset` (`build --data NAME --split S --data-config C`): a Hugging Face `datasets` name or a
  local dataset folder, through `datasets.load_dataset(..., streaming=True)` (the optional `datasets`
  package), 1,024 rows at a time. `dataset_source` decides: a name that is no local path, or any
  `--split`/`--data-config`, goes through `datasets`; a plain local file or folder does not.

Everything is read record batch by record batch, and only the columns asked for, so memory stays
bounded by a batch (a few MB), not by the size of the data.

Columns. Text input (the default) reads `text_column`. Pre-tokenized input reads `ids_column`:
a list of non-negative integers per row, or, where the format has no lists (CSV), a string of
integers separated by commas or spaces, optionally in brackets ("[1, 2, 3]"). When `ids_column`
is given the ids win and `text_column` is not read, even when it was given too. Document ids come
from `id_column` (strings or integers, converted to `str`); with no `id_column` (None), from a column
named `id` in any file that has one (`AUTO_ID_COLUMN`); else, and with `id_column=""`, they are
content hashes: the text's for text input, the token ids' for pre-tokenized input.
Chat input reads `chat_column` (`build --chat-column messages`): a list of `{"role", "content"}`
messages per row, or its JSON text (CSV); `logitstore.text.chat` checks and later renders it, and its
content hash is the conversation's canonical JSON's.

Errors are `DataError`s naming the file and the problem. Path and argument errors raise when
`read_documents` is called; content errors (a missing column, a bad row) raise while iterating,
when the file is reached. Duplicate document ids are not checked here: the store refuses them.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json
import pyarrow.parquet as pq
from pyarrow import csv as pa_csv

from logitstore.data import SAMPLE_CORPUS, default_input
from logitstore.errors import LogitstoreError
from logitstore.format.samples import CONTROL_CHARACTERS
from logitstore.text.chat import as_messages, conversation_hash_text, message_problem

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

# JSON Lines are cut into chunks of whole lines and each chunk parsed on its own: pyarrow's
# streaming JSON reader keeps ~35 blocks in flight and fails on a row longer than a block, this
# keeps one chunk (plus one line) in memory and never splits a row.
_JSON_CHUNK_BYTES = 1 << 20
# CSV values may hold newlines, so CSV cannot be cut by lines; pyarrow's streaming reader it is,
# restarted with larger blocks when one row does not fit a block (see `_restarting`).
_CSV_BLOCK_BYTES = 1 << 20
_MAX_BLOCK_BYTES = 1 << 30
_INT64_MAX = np.iinfo(np.int64).max


class DataError(LogitstoreError):
    """The input data cannot be read: missing path or column, unsupported format, or a bad row."""


@dataclass(frozen=True)
class Document:
    """One input document.

    id: from the id column (as str), else `source_hash`. text: None for pre-tokenized input.
    token_ids: int64, only for pre-tokenized input. source_hash: `text_hash(text)`, or for
    pre-tokenized input the sha256 of the int64 (little-endian) ids, first 32 hex digits.
    row: 0-based row number in the whole input, in read order.
    """

    id: str
    text: str | None
    token_ids: np.ndarray | None
    source_hash: str
    row: int
    messages: list[dict] | None = None  # chat input (--chat-column): the conversation; text is None


AUTO_ID_COLUMN = "id"  # gives the document ids, where a file has it, when no --id-column is given
_AUTOMATIC = "the automatic id column"


@dataclass(frozen=True)
class _Columns:
    """The effective column choice: `ids` set means pre-tokenized input and `text` is None."""

    text: str | None
    id: str | None
    ids: str | None
    id_automatic: bool = False  # `id` is AUTO_ID_COLUMN, read where a file has it
    chat: str | None = None  # the conversations' column (--chat-column): then text and ids are None
    text_option: str = "--text-column"  # the flag that named `text` (--prompt-column for prompts to answer)

    def roles(self) -> dict[str, str]:
        """Column name -> the option that named it, for the columns to read. The automatic id column is
        read where a file has it (`_check_columns` drops it where not)."""
        id_option = _AUTOMATIC if self.id_automatic else "--id-column"
        named = [
            (self.id, id_option),
            (self.text, self.text_option),
            (self.ids, "--ids-column"),
            (self.chat, "--chat-column"),
        ]
        out: dict[str, str] = {}
        for column, option in named:
            if column is not None:
                out.setdefault(column, option)
        return out


class _BadRow(Exception):
    """A converter found a bad value at `index` of a batch; the caller adds file, row and id."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index
        self.message = message


class _BadColumn(Exception):
    """A whole column has the wrong type."""


# ---------------------------------------------------------------------------------------------
# Public API


def text_hash(text: str) -> str:
    """sha256 of the text's UTF-8 bytes, first 32 hex digits: default document id and source hash."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def ids_hash(token_ids: np.ndarray) -> str:
    """sha256 of the ids as little-endian int64 bytes, first 32 hex digits (pre-tokenized input)."""
    return hashlib.sha256(np.ascontiguousarray(token_ids, dtype="<i8").tobytes()).hexdigest()[:32]


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


def check_input(
    data: str | os.PathLike | HubDataset | None,
    *,
    text_column: str | None = "text",
    id_column: str | None = None,
    ids_column: str | None = None,
    chat_column: str | None = None,
    prompt_column: str | None = None,
) -> str:
    """Read the first rows of the first file, as `read_documents` will, and return where document ids
    come from ("the input's 'id' column", or "content hashes"). Raises `DataError` for a missing path,
    a missing column or bad first rows: what a build checks before it loads a model."""
    columns = _effective_columns(
        data,
        text_column=text_column,
        id_column=id_column,
        ids_column=ids_column,
        chat_column=chat_column,
        prompt_column=prompt_column,
    )
    _root, files = _resolve(data if data is not None else default_input(chat=bool(chat_column)))
    if not files:
        return "content hashes"
    path, kind = files[0]
    roles = columns.roles()
    first = next(iter(_guarded(path, kind, _READERS[kind](path, roles))), None)  # checks the columns
    if first is not None:
        for _document in _documents(first.slice(0, 64), columns, path=path, file_row=0, row=0):
            pass  # converts the first rows: bad ids or texts fail here
    if columns.id is not None and columns.id in roles:
        return f"the input's {columns.id!r} column" + (" (found automatically)" if columns.id_automatic else "")
    return "content hashes"


def read_documents(
    data: str | os.PathLike | HubDataset | None,
    *,
    text_column: str | None = "text",
    id_column: str | None = None,
    ids_column: str | None = None,
    chat_column: str | None = None,
    prompt_column: str | None = None,
    batch_rows: int = 1024,
) -> Iterator[Document]:
    """Stream the documents of `data` (a file, a folder, a `save_to_disk` folder, or None for the
    sample corpus), `batch_rows` rows converted at a time. See the module docstring for formats and
    column rules. Raises `DataError` for a missing path, an unsupported format or bad arguments now,
    and for missing columns or bad rows while iterating."""
    if batch_rows < 1:
        raise ValueError(f"batch_rows must be >= 1, got {batch_rows}")
    columns = _effective_columns(
        data,
        text_column=text_column,
        id_column=id_column,
        ids_column=ids_column,
        chat_column=chat_column,
        prompt_column=prompt_column,
    )
    _root, files = _resolve(data if data is not None else default_input(chat=bool(chat_column)))
    return _iter_documents(files, columns, batch_rows)


def window(token_ids: np.ndarray, *, max_length: int) -> list[np.ndarray]:
    """Cut a document's tokens into the windows the teacher sees, at most `max_length` tokens each.

    A document of <= max_length tokens is one window, itself. A longer one is cut into windows of
    max_length tokens starting every max_length - 1 tokens, so consecutive windows share exactly one
    token and every next-token transition (t -> t+1) is predicted in exactly one window. The model's
    context restarts at each window: the first predictions of a later window see at most a short
    context. The last window may be shorter, but always holds at least 2 tokens (a 1-token tail would
    hold no transition that the previous window does not already predict). Windows are views into
    `token_ids`. Raises `DataError` if max_length < 2 (a window must hold a transition).
    """
    if max_length < 2:
        raise DataError(f"--max-length must be at least 2 tokens, got {max_length}")
    token_ids = np.asarray(token_ids)
    if token_ids.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {token_ids.shape}")
    n = len(token_ids)
    if n <= max_length:
        return [token_ids]
    # Window k predicts transitions k*(L-1) .. k*(L-1)+L-2; starts stop before the last token so
    # the final window always holds at least one transition.
    starts = np.arange(0, n - 1, max_length - 1)
    return [token_ids[s : s + max_length] for s in starts]


def window_ids(doc_id: str, n_windows: int) -> list[str]:
    """Sample ids of a document's windows: the document id itself for one window, else
    `<doc_id>#w<i>` for window i = 0 .. n_windows-1. Document ids that end like a window id are
    refused on input (`WINDOW_SUFFIX`), so a sample id names one document and one window."""
    if n_windows < 1:
        raise ValueError(f"n_windows must be >= 1, got {n_windows}")
    if n_windows == 1:
        return [doc_id]
    return [f"{doc_id}#w{i}" for i in range(n_windows)]


# The suffix `window_ids` gives the windows of a long document. Reserved: an input id ending in it
# could be a window of another document (ids `a#w1`, then a long `a`), and one would hide the other.
WINDOW_SUFFIX = r"#w[0-9]+$"


def document_ids(sample_ids: pa.Array) -> pa.Array:
    """The document id of each sample id (its window suffix removed), vectorised."""
    return pc.replace_substring_regex(sample_ids, pattern=WINDOW_SUFFIX, replacement="")


def count_documents(data: str | os.PathLike | HubDataset | None) -> int | None:
    """Rows in the input when cheap to know (for the progress bar's ETA), else None.

    Parquet and Arrow IPC files say it in their metadata; JSONL is counted by newlines at disk
    speed. CSV (newlines inside quoted values) and Arrow streams would need a full parse: None."""
    try:
        _root, files = _resolve(data)
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


# ---------------------------------------------------------------------------------------------
# Arguments and paths


def _effective_columns(data, *, text_column, id_column, ids_column, chat_column=None, prompt_column=None) -> _Columns:
    """Resolve the column options: ids win over text; the sample corpus has an `id` column; prompts to
    answer (`build --generate`) are read as text from their own column."""
    if prompt_column:
        return _Columns(text=prompt_column, ids=None, text_option="--prompt-column", **_id_column(id_column))
    if chat_column:
        if ids_column:
            raise DataError(
                "--chat-column and --ids-column exclude each other: conversations are rendered "
                "with the teacher's chat template, so they cannot be pre-tokenized"
            )
        return _Columns(text=None, ids=None, chat=chat_column, **_id_column(id_column))
    if ids_column:
        return _Columns(text=None, ids=ids_column, **_id_column(id_column))
    if not text_column:
        raise DataError("no text column and no ids column: give --text-column or --ids-column")
    return _Columns(text=text_column, ids=None, **_id_column(id_column))


def _id_column(id_column: str | None) -> dict:
    """None -> the automatic `id` column; "" -> content hashes; else the column named."""
    if id_column is None:
        return {"id": AUTO_ID_COLUMN, "id_automatic": True}
    return {"id": id_column or None}


def _resolve(data) -> tuple[Path, Sequence[tuple[Path | HubDataset, str]]]:
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


# ---------------------------------------------------------------------------------------------
# Reading: each format yields record batches holding exactly the asked-for columns


def _iter_documents(files, columns: _Columns, batch_rows: int) -> Iterator[Document]:
    row = 0
    for path, kind in files:
        file_row = 0
        for batch in _guarded(path, kind, _READERS[kind](path, columns.roles())):
            for offset in range(0, batch.num_rows, batch_rows):
                part = batch.slice(offset, batch_rows)
                yield from _documents(part, columns, path=path, file_row=file_row, row=row)
                file_row += part.num_rows
                row += part.num_rows


def _guarded(path: Path | HubDataset, kind: str, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Turn pyarrow's and the OS's read errors into one-line `DataError`s naming the file."""
    try:
        yield from batches
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "utf8" in detail.lower().replace("-", ""):
            raise DataError(f"{path}: invalid UTF-8 ({detail})") from exc
        raise DataError(f"{path}: cannot read as {kind}: {detail}") from exc


def _check_columns(
    path: Path | HubDataset, names: list[str], roles: dict[str, str], *, header_row: bool = False
) -> None:
    """Refuse a file without a named column; drop the automatic id column from `roles` where absent."""
    for column, option in list(roles.items()):
        if column in names:
            continue
        if option == _AUTOMATIC:
            del roles[column]
            continue
        header = " (the first row is taken as the header)" if header_row else ""
        raise DataError(f"{path}: no column {column!r} ({option}); its columns are: {_names(names)}{header}")


def _names(names: list[str], *, most: int = 8, width: int = 30) -> str:
    """Column names for a one-line message: a header row of text must not fill the screen."""
    cut = [n if len(n) <= width else n[: width - 3] + "..." for n in names[:most]]
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(repr(n) for n in cut) + more


def _jsonl_batches(path: Path, roles: dict[str, str]) -> Iterator[pa.RecordBatch]:
    schema = None
    with open(path, "rb") as f:
        while chunk := _read_lines(f, _JSON_CHUNK_BYTES):
            if schema is None:
                # Types come from the first chunk and are then fixed, so every chunk agrees and
                # the other fields are skipped, not parsed into columns.
                inferred = _parse_json(chunk, None).schema
                _check_columns(path, inferred.names, roles)
                schema = pa.schema([_json_field(inferred.field(c), c, roles[c]) for c in roles])
            yield from _parse_json(chunk, schema).to_batches()


def _read_lines(f, size: int) -> bytes:
    """About `size` bytes of whole lines."""
    chunk = f.read(size)
    if chunk and not chunk.endswith(b"\n"):
        chunk += f.readline()
    return chunk


def _parse_json(chunk: bytes, schema: pa.Schema | None) -> pa.Table:
    # One block, so no row straddles two; and one thread, as one block cannot be split anyway.
    read_options = pa_json.ReadOptions(block_size=len(chunk) + 1, use_threads=False)
    if schema is None:
        return pa_json.read_json(io.BytesIO(chunk), read_options=read_options)
    parse_options = pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    return pa_json.read_json(io.BytesIO(chunk), read_options=read_options, parse_options=parse_options)


def _json_field(field: pa.Field, column: str, option: str) -> pa.Field:
    """A column all null in the first chunk was inferred as null; give it the type it should have."""
    if not pa.types.is_null(field.type):
        return field
    return pa.field(column, pa.list_(pa.int64()) if option == "--ids-column" else pa.string())  # chat: JSON text


def _csv_batches(path: Path, roles: dict[str, str]) -> Iterator[pa.RecordBatch]:
    header = _csv_header(path)
    if header is None:
        return  # an empty file holds no documents
    _check_columns(path, header, roles, header_row=True)
    # Everything as strings: ids like "007" stay as written, and the ids column is parsed later.
    convert = pa_csv.ConvertOptions(
        include_columns=list(roles),
        column_types={c: pa.string() for c in roles},
        strings_can_be_null=False,
        quoted_strings_can_be_null=False,
    )

    def open_at(block_size: int) -> Iterator[pa.RecordBatch]:
        reader = pa_csv.open_csv(
            path,
            read_options=pa_csv.ReadOptions(block_size=block_size),
            parse_options=pa_csv.ParseOptions(newlines_in_values=True),
            convert_options=convert,
        )
        try:
            yield from reader
        finally:
            reader.close()

    yield from _restarting(open_at, _CSV_BLOCK_BYTES)


def _csv_header(path: Path) -> list[str] | None:
    with open(path, "rb") as raw:
        text = io.TextIOWrapper(raw, encoding="utf-8-sig", newline="")
        return next(csv.reader(text), None)


def _restarting(open_at: Callable[[int], Iterator[pa.RecordBatch]], block_size: int) -> Iterator[pa.RecordBatch]:
    """Batches of `open_at(block_size)`; when a row does not fit in a block, reopen with 4x larger
    blocks and skip the rows already yielded. Small blocks by default keep memory low: pyarrow's
    streaming readers hold a few dozen blocks in flight."""
    done = 0
    while True:
        seen = 0
        try:
            for batch in open_at(block_size):
                skip = done - seen  # rows of this batch yielded before the restart
                seen += batch.num_rows
                if seen > done:
                    done = seen
                    yield batch.slice(skip) if skip > 0 else batch
            return
        except pa.ArrowInvalid as exc:
            if "straddl" not in str(exc) or block_size >= _MAX_BLOCK_BYTES:
                raise
            block_size *= 4


def _parquet_batches(path: Path, roles: dict[str, str]) -> Iterator[pa.RecordBatch]:
    with pq.ParquetFile(path) as parquet:
        _check_columns(path, parquet.schema_arrow.names, roles)
        yield from parquet.iter_batches(columns=list(roles))


def _arrow_batches(path: Path, roles: dict[str, str]) -> Iterator[pa.RecordBatch]:
    # Memory-mapped: batches are zero-copy views, and only the pages of the read columns load.
    with pa.memory_map(str(path)) as source:
        try:
            reader = pa.ipc.open_file(source)
        except pa.ArrowInvalid:
            source.seek(0)  # not the IPC file format: the stream format (what `datasets` writes)
            reader = pa.ipc.open_stream(source)
        _check_columns(path, reader.schema.names, roles)
        if isinstance(reader, pa.ipc.RecordBatchFileReader):
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i).select(list(roles))
        else:
            for batch in reader:
                yield batch.select(list(roles))


def _datasets_batches(source: HubDataset, roles: dict[str, str]) -> Iterator[pa.RecordBatch]:
    """Rows of a `datasets` dataset, streamed 1,024 at a time, only the columns asked for."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"--data {source.name!r}: reading a datasets name needs the datasets package (pip install 'logitstore[hf]')"
        ) from None
    try:
        stream = datasets.load_dataset(source.name, source.config, split=source.split, streaming=True)
        names = list(stream.features) if stream.features is not None else None
        if names is None:  # features unknown until read: the first row's keys
            names = list(next(iter(stream), {}).keys())
        _check_columns(source, names, roles)
        for batch in stream.iter(batch_size=1024):
            yield pa.RecordBatch.from_pydict({column: batch[column] for column in roles})
    except DataError:
        raise
    except Exception as exc:  # datasets raises ValueError, ConnectionError, FileNotFoundError, ... for one bad name
        detail = " ".join(str(exc).split())[:240] or type(exc).__name__
        raise DataError(f"--data {source}: {detail}") from None


# A format's reader takes the source its files hold: a `Path`, or for "datasets" a `HubDataset`.
_READERS: dict[str, Callable[[Any, dict[str, str]], Iterator[pa.RecordBatch]]] = {
    "jsonl": _jsonl_batches,
    "csv": _csv_batches,
    "parquet": _parquet_batches,
    "arrow": _arrow_batches,
    "datasets": _datasets_batches,
}


# ---------------------------------------------------------------------------------------------
# Converting a batch into documents


def _documents(
    batch: pa.RecordBatch, columns: _Columns, *, path: Path | HubDataset, file_row: int, row: int
) -> Iterator[Document]:
    n = batch.num_rows

    def fail(index: int, message: str, doc_ids: list[str] | None) -> DataError:
        where = f"{path}: row {file_row + index}"
        if row != file_row:
            where += f" (input row {row + index})"
        if doc_ids is not None:
            where += f", document {doc_ids[index]!r}"
        return DataError(f"{where}: {message}")

    doc_ids = None
    tokens: list[np.ndarray] | list[None]
    texts: list[str | None]
    try:
        if columns.id is not None and columns.id in batch.schema.names:  # the automatic one may be absent
            doc_ids = _id_values(_column(batch, columns.id), columns.id)
        if columns.chat is not None:
            return (yield from _conversations(batch, columns.chat, doc_ids, fail, row=row))
        if columns.ids is not None:
            tokens, texts = _ids_values(_column(batch, columns.ids), columns.ids), [None] * n
        else:
            assert columns.text is not None, "_effective_columns names a text column where no ids or chat one"
            tokens, texts = [None] * n, _text_values(_column(batch, columns.text), columns.text)
    except _BadRow as bad:
        raise fail(bad.index, bad.message, doc_ids) from None
    except _BadColumn as bad:
        raise DataError(f"{path}: {bad}") from None
    for i in range(n):
        text, token_ids = texts[i], tokens[i]
        if token_ids is not None:
            source = ids_hash(token_ids)
        elif text is None or not text.strip():
            what = "null" if text is None else "empty or whitespace-only"
            raise fail(i, f"text column {columns.text!r} is {what}", doc_ids)
        else:
            source = text_hash(text)
        doc_id = doc_ids[i] if doc_ids is not None else source
        yield Document(id=doc_id, text=text, token_ids=token_ids, source_hash=source, row=row + i)


def _conversations(batch: pa.RecordBatch, name: str, doc_ids, fail, *, row: int) -> Iterator[Document]:
    """Chat rows of column `name`: a list of {"role", "content"} per row (or its JSON text, as CSV holds it)."""
    column = _column(batch, name)
    t = column.type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t) or _is_text_type(t) or pa.types.is_null(t)):
        raise DataError(f"chat column {name!r} holds {t}; each row must be a list of {{'role', 'content'}} messages")
    for i, value in enumerate(column.to_pylist()):  # one step per conversation
        problem = "is null" if value is None else message_problem(value)
        if problem:
            raise fail(i, f"chat column {name!r} {problem}", doc_ids)
        messages = as_messages(value)
        source = text_hash(conversation_hash_text(messages))
        doc_id = doc_ids[i] if doc_ids is not None else source
        yield Document(id=doc_id, text=None, token_ids=None, source_hash=source, row=row + i, messages=messages)


def _column(batch: pa.RecordBatch, name: str) -> pa.Array:
    column = batch.column(batch.schema.get_field_index(name))
    # Dictionary-encoded strings (Parquet, Arrow) read like plain ones.
    return column.dictionary_decode() if pa.types.is_dictionary(column.type) else column


def _is_text_type(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_binary_type(t: pa.DataType) -> bool:
    return (
        pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_binary_view(t)
        or pa.types.is_fixed_size_binary(t)
    )


def _as_utf8(column: pa.Array, name: str) -> pa.Array:
    """The column as valid UTF-8 strings; `_BadRow` at the first invalid value."""
    try:
        if _is_text_type(column.type):
            column.validate(full=True)  # pyarrow does not check UTF-8 when reading JSON, Parquet, Arrow
            return column
        return pc.cast(column, pa.string())
    except pa.ArrowInvalid:
        raise _BadRow(_first_invalid_utf8(column), f"column {name!r} is not valid UTF-8") from None


def _first_invalid_utf8(column: pa.Array) -> int:
    raw = column.cast(pa.large_binary()) if _is_text_type(column.type) else column
    for i, value in enumerate(raw.to_pylist()):
        try:
            if value is not None:
                value.decode("utf-8")
        except UnicodeDecodeError:
            return i
    return 0


def _first_null(column: pa.Array) -> int:
    return _first_true(column.is_null())


# Ids refused, naming the first row that holds one: (a pattern the id matches, why).
_ID_REFUSALS = (
    (
        CONTROL_CHARACTERS,
        "has a control character (a newline, tab, NUL, ...): ls would print it raw and show could not be "
        "given it; clean the id",
    ),
    (WINDOW_SUFFIX, "ends like a window id ('#w' and digits, reserved for the windows of long documents); rename it"),
)


def _id_values(column: pa.Array, name: str) -> list[str]:
    t = column.type
    if not (_is_text_type(t) or _is_binary_type(t) or pa.types.is_integer(t) or pa.types.is_null(t)):
        raise _BadColumn(f"id column {name!r} holds {t}; ids must be strings or integers")
    if column.null_count:
        raise _BadRow(_first_null(column), f"id column {name!r} is null")
    values = pc.cast(column, pa.string()) if pa.types.is_integer(t) else _as_utf8(column, name)
    empty = pc.equal(pc.utf8_length(values), 0)
    if pc.any(empty).as_py():
        raise _BadRow(_first_true(empty), f"id column {name!r} is an empty string")
    for pattern, why in _ID_REFUSALS:
        found = pc.match_substring_regex(values, pattern=pattern)
        if pc.any(found).as_py():
            i = _first_true(found)
            raise _BadRow(i, f"id column {name!r} holds {values[i].as_py()[:80]!r}, which {why}")
    return values.to_pylist()


def _first_true(mask: pa.Array) -> int:
    return int(np.flatnonzero(mask.to_numpy(zero_copy_only=False))[0])


def _text_values(column: pa.Array, name: str) -> list[str | None]:
    t = column.type
    if pa.types.is_null(t):
        return [None] * len(column)
    if not (_is_text_type(t) or _is_binary_type(t)):
        raise _BadColumn(f"text column {name!r} holds {t}, not text")
    return _as_utf8(column, name).to_pylist()


def _ids_values(column: pa.Array, name: str) -> list[np.ndarray]:
    """One int64 array per row, from a list column or (CSV) a string column."""
    t = column.type
    if column.null_count:
        raise _BadRow(_first_null(column), f"ids column {name!r} is null")
    if _is_text_type(t):
        return [_parse_ids(value, i, name) for i, value in enumerate(column.to_pylist())]
    if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
        raise _BadColumn(f"ids column {name!r} holds {t}, not lists of token ids")
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    values = _integer_values(pc.list_flatten(column), offsets, name)
    if (lengths == 0).any():
        raise _BadRow(int(np.flatnonzero(lengths == 0)[0]), f"ids column {name!r} is empty")
    return [values[offsets[i] : offsets[i + 1]].copy() for i in range(len(column))]


def _integer_values(flat: pa.Array, offsets: np.ndarray, name: str) -> np.ndarray:
    """The flattened ids as int64, checked in one vectorised pass; `_BadRow` names the row."""

    def bad(value_index: int, message: str) -> _BadRow:
        return _BadRow(int(np.searchsorted(offsets, value_index, side="right") - 1), message)

    t = flat.type
    if flat.null_count:
        raise bad(_first_null(flat), f"ids column {name!r} holds a null token id")
    if pa.types.is_null(t) or len(flat) == 0:
        return np.zeros(0, dtype=np.int64)
    if not (pa.types.is_integer(t) or pa.types.is_floating(t)):
        raise _BadColumn(f"ids column {name!r} holds lists of {t}, not integers")
    values = flat.to_numpy(zero_copy_only=False)
    if pa.types.is_floating(t):
        fractional = ~np.isfinite(values) | (values != np.round(values))
        if fractional.any():
            i = int(np.flatnonzero(fractional)[0])
            raise bad(i, f"ids column {name!r} holds a non-integer token id {float(values[i])}")
    if pa.types.is_unsigned_integer(t):
        too_big = values > _INT64_MAX
        if too_big.any():
            raise bad(int(np.flatnonzero(too_big)[0]), f"ids column {name!r} holds a token id beyond int64")
    elif (values < 0).any():
        i = int(np.flatnonzero(values < 0)[0])
        raise bad(i, f"ids column {name!r} holds a negative token id {int(values[i])}")
    return values.astype(np.int64)


def _parse_ids(value: str, index: int, name: str) -> np.ndarray:
    """'1 2 3', '1,2,3' or '[1, 2, 3]' -> int64 ids (how CSV, which has no lists, holds them)."""
    parts = value.strip().removeprefix("[").removesuffix("]").replace(",", " ").split()
    if not parts:
        raise _BadRow(index, f"ids column {name!r} is empty")
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise _BadRow(index, f"ids column {name!r} holds a non-integer token id in {value[:40]!r}") from None
    if min(ids) < 0:
        raise _BadRow(index, f"ids column {name!r} holds a negative token id {min(ids)}")
    if max(ids) > _INT64_MAX:
        raise _BadRow(index, f"ids column {name!r} holds a token id beyond int64")
    return np.array(ids, dtype=np.int64)
