"""Stage one's input: the documents of what `logitstore build --data DATA` names, streamed.

`read_documents` streams `Document`s out of a file (JSON Lines, Parquet, Arrow IPC, CSV), a folder of
those, a `datasets` `save_to_disk` folder, a `datasets` name (`HubDataset`), or nothing (the shipped sample
corpus), record batch by record batch and only the columns asked for, so memory stays bounded by a batch.
`check_input` reads the first rows as `read_documents` will: what a build checks before it loads a model.

Rooms: `sources.py` finds the files and their formats, `formats.py` reads each format into record batches,
`columns.py` checks the columns and turns a batch's rows into `Document`s. How long documents are cut into
windows is the plan's (`pipelines/plan.py`). docs/build.md "Input data" has the formats, the column rules
and where document ids come from.

Errors are `DataError`s naming the file and the problem. Path and argument errors raise when
`read_documents` is called; content errors (a missing column, a bad row) raise while iterating, when the
file is reached. Duplicate document ids are not checked here: the store refuses them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from logitstore.data import default_input
from logitstore.pipelines.inputs.columns import (
    AUTO_ID_COLUMN,
    WINDOW_SUFFIX,
    ColumnChoice,
    Document,
    batch_documents,
    effective_columns,
    ids_hash,
    text_hash,
)
from logitstore.pipelines.inputs.formats import READERS, guarded
from logitstore.pipelines.inputs.sources import (
    FORMATS,
    DataError,
    HubDataset,
    count_documents,
    dataset_source,
    resolve,
)

__all__ = [
    "AUTO_ID_COLUMN",
    "FORMATS",
    "WINDOW_SUFFIX",
    "DataError",
    "Document",
    "HubDataset",
    "check_input",
    "count_documents",
    "dataset_source",
    "ids_hash",
    "read_documents",
    "text_hash",
]


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
    columns, files = _opened(
        data,
        text_column=text_column,
        id_column=id_column,
        ids_column=ids_column,
        chat_column=chat_column,
        prompt_column=prompt_column,
    )
    if not files:
        return "content hashes"
    path, kind = files[0]
    roles = columns.roles()
    first = next(iter(guarded(path, kind, READERS[kind](path, roles))), None)  # checks the columns
    if first is not None:
        for _document in batch_documents(first.slice(0, 64), columns, path=path, file_row=0, row=0):
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
    sample corpus), `batch_rows` rows converted at a time. docs/build.md "Input data" has the formats
    and column rules. Raises `DataError` for a missing path, an unsupported format or bad arguments now,
    and for missing columns or bad rows while iterating."""
    if batch_rows < 1:
        raise ValueError(f"batch_rows must be >= 1, got {batch_rows}")
    columns, files = _opened(
        data,
        text_column=text_column,
        id_column=id_column,
        ids_column=ids_column,
        chat_column=chat_column,
        prompt_column=prompt_column,
    )
    return _iter_documents(files, columns, batch_rows)


def _opened(data, **options: str | None) -> tuple[ColumnChoice, Sequence[tuple[Path | HubDataset, str]]]:
    """The effective columns of the column options and the input's files in read order (where `data` is
    None: the shipped sample, its chat one for chat input)."""
    columns = effective_columns(data, **options)
    _root, files = resolve(data if data is not None else default_input(chat=bool(options["chat_column"])))
    return columns, files


def _iter_documents(files, columns: ColumnChoice, batch_rows: int) -> Iterator[Document]:
    """The documents of `files` (each a path or `HubDataset` and its format), `batch_rows` rows at a time."""
    row = 0
    for path, kind in files:
        file_row = 0
        for batch in guarded(path, kind, READERS[kind](path, columns.roles())):
            for offset in range(0, batch.num_rows, batch_rows):
                part = batch.slice(offset, batch_rows)
                yield from batch_documents(part, columns, path=path, file_row=file_row, row=row)
                file_row += part.num_rows
                row += part.num_rows
