"""The format readers: each yields record batches holding exactly the asked-for columns (`READERS`, by
format), a batch at a time, so memory stays bounded by a batch and not by the size of the data.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq
from pyarrow import csv as pa_csv

from logitstore.pipelines.inputs.columns import check_columns
from logitstore.pipelines.inputs.sources import DataError, HubDataset

# JSON Lines are cut into chunks of whole lines and each chunk parsed on its own: pyarrow's
# streaming JSON reader keeps ~35 blocks in flight and fails on a row longer than a block, this
# keeps one chunk (plus one line) in memory and never splits a row.
_JSON_CHUNK_BYTES = 1 << 20
# CSV values may hold newlines, so CSV cannot be cut by lines; pyarrow's streaming reader it is,
# restarted with larger blocks when one row does not fit a block (see `_restarting`).
_CSV_BLOCK_BYTES = 1 << 20
_MAX_BLOCK_BYTES = 1 << 30


def guarded(path: Path | HubDataset, kind: str, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Turn pyarrow's and the OS's read errors into one-line `DataError`s naming the file."""
    try:
        yield from batches
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "utf8" in detail.lower().replace("-", ""):
            raise DataError(f"{path}: invalid UTF-8 ({detail})") from exc
        raise DataError(f"{path}: cannot read as {kind}: {detail}") from exc


def _jsonl_batches(path: Path, roles: dict[str, str]) -> Iterator[pa.RecordBatch]:
    schema = None
    with open(path, "rb") as f:
        while chunk := _read_lines(f, _JSON_CHUNK_BYTES):
            if schema is None:
                # Types come from the first chunk and are then fixed, so every chunk agrees and
                # the other fields are skipped, not parsed into columns.
                inferred = _parse_json(chunk, None).schema
                check_columns(path, inferred.names, roles)
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
    check_columns(path, header, roles, header_row=True)
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
        check_columns(path, parquet.schema_arrow.names, roles)
        yield from parquet.iter_batches(columns=list(roles))


def _arrow_batches(path: Path, roles: dict[str, str]) -> Iterator[pa.RecordBatch]:
    # Memory-mapped: batches are zero-copy views, and only the pages of the read columns load.
    with pa.memory_map(str(path)) as source:
        try:
            reader = pa.ipc.open_file(source)
        except pa.ArrowInvalid:
            source.seek(0)  # not the IPC file format: the stream format (what `datasets` writes)
            reader = pa.ipc.open_stream(source)
        check_columns(path, reader.schema.names, roles)
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
        check_columns(source, names, roles)
        for batch in stream.iter(batch_size=1024):
            yield pa.RecordBatch.from_pydict({column: batch[column] for column in roles})
    except DataError:
        raise
    except Exception as exc:  # datasets raises ValueError, ConnectionError, FileNotFoundError, ... for one bad name
        detail = " ".join(str(exc).split())[:240] or type(exc).__name__
        raise DataError(f"--data {source}: {detail}") from None


# A format's reader takes the source its files hold: a `Path`, or for "datasets" a `HubDataset`.
READERS: dict[str, Callable[[Any, dict[str, str]], Iterator[pa.RecordBatch]]] = {
    "jsonl": _jsonl_batches,
    "csv": _csv_batches,
    "parquet": _parquet_batches,
    "arrow": _arrow_batches,
    "datasets": _datasets_batches,
}
