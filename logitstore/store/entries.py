"""A teacher's entries as Parquet rows: `logitstore export --what entries` (`write_entries`).

One row per position (a sample of T tokens has T - 1), what another trainer, polars, DuckDB or
`datasets.load_dataset("parquet", ...)` reads without logitstore:

    sample          string          the sample's id
    position        int32           t: the row predicts token t + 1 of the sample
    token           int32           the token at t (the last one the teacher read)
    next_token      int32           token t + 1, whose log-probability `target_logprob` is
    ids             list<int32>     the stored entries' token ids, highest probability first
    logprobs        list<float32>   their log-probabilities (full-vocabulary log-softmax, on the grid)
    tail            float32         the probability mass outside the entries
    target_logprob  float32         log-probability of `next_token`, stored or not
    counts          list<int32>     draws per entry (sampled teachers only)
    loss_mask       int8            chat data only: 1 where `next_token` is a completion token

The values are the ones `logitstore show` prints (decoded from the grid's codes). The file's key-value
metadata `logitstore` holds a JSON object: the teacher, its sparsity, the grid, the vocabulary size, the
store version and the teacher's store format.

Rows come part by part, in the order the parts were first indexed, each part's samples in their stored
order. A part is read whole (or just the selected samples' ranges), decoded by the stream's own reader
(`reader.PartReader`) and turned into Arrow arrays from flat arrays and offsets, with no step per
position; row groups hold about `ROW_GROUP_POSITIONS` positions (fewer where they would hold more than
`ROW_GROUP_ENTRIES` entries), each written in a thread while the next fills, so memory holds one part
and two row groups. The file is written beside OUT and renamed over it at the end (`files.replacing`):
a failed export leaves nothing.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from logitstore.errors import DamagedDataError, SampleNotFoundError
from logitstore.files import replacing
from logitstore.format.samples import SparseSamples, row_offsets
from logitstore.store.answers import ExportError
from logitstore.store.meta import TeacherMeta
from logitstore.store.reader import PartReader, TeacherRows
from logitstore.store.version import StoreVersion

# Rows per row group: a reader's unit (one row group is one read for polars and DuckDB), and what this
# export holds in memory twice over besides one part: ~1M positions of sampled-16, ~100 MB as Arrow arrays.
ROW_GROUP_POSITIONS = 1 << 20
ROW_GROUP_ENTRIES = 1 << 24  # a top-64 row group stops at 256k positions, ~130 MB
METADATA_KEY = b"logitstore"
# Columns whose Parquet statistics a reader filters on; the list columns' would cost time for nothing.
STATISTICS = ["sample", "position", "token", "next_token", "tail", "target_logprob"]


@dataclass(frozen=True)
class EntrySelection:
    """What an export takes of a version: one teacher's samples, all or the ids of `samples`, the first
    `limit` of them in index order."""

    teacher: str | None = None
    samples: list[str] | None = None
    limit: int | None = None


def check_entries_path(out: Path, *, force: bool) -> None:
    """Refuse an OUT that cannot be written, or exists without `force`: before the store is read."""
    if out.suffix != ".parquet":
        raise ExportError(f"{out}: name a .parquet file (entries are written as Parquet)")
    if out.is_dir():
        raise ExportError(f"{out} is a folder; name a .parquet file")
    if not out.parent.is_dir():
        raise ExportError(f"{out}: its folder {out.parent} does not exist")
    if out.exists() and not force:
        raise ExportError(f"{out} exists; pass --force to replace it")


def selection_of(*, teacher: str | None, samples: str | None, limit: int | None) -> EntrySelection:
    """What `export --what entries` asks for; `samples` a file of sample ids, read here."""
    return EntrySelection(
        teacher=teacher, samples=None if samples is None else read_sample_ids(Path(samples)), limit=limit
    )


def read_sample_ids(path: Path) -> list[str]:
    """A file of sample ids, one a line (blank lines left out)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ExportError(f"cannot read the sample ids in {path}: {getattr(e, 'strerror', None) or e}") from None
    return [line.strip() for line in lines if line.strip()]


def entry_schema(meta: TeacherMeta, *, metadata: dict) -> pa.Schema:
    """The rows' columns for a teacher (`counts` for a sampled one, `loss_mask` for chat data)."""
    fields = [
        pa.field("sample", pa.string()),
        pa.field("position", pa.int32()),
        pa.field("token", pa.int32()),
        pa.field("next_token", pa.int32()),
        pa.field("ids", pa.list_(pa.int32())),
        pa.field("logprobs", pa.list_(pa.float32())),
        pa.field("tail", pa.float32()),
        pa.field("target_logprob", pa.float32()),
    ]
    if meta.sampled:
        fields.append(pa.field("counts", pa.list_(pa.int32())))
    if meta.loss_mask is not None:
        fields.append(pa.field("loss_mask", pa.int8()))
    return pa.schema(fields, metadata={METADATA_KEY: json.dumps(metadata).encode()})


def write_entries(
    view: StoreVersion,
    out: Path,
    *,
    selection: EntrySelection = EntrySelection(),
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
    row_group_positions: int = ROW_GROUP_POSITIONS,
) -> dict:
    """Write the selected entries of a version to `out` as Parquet, whole or
    not at all, and return the summary `export --json` prints. `progress(tokens_done, tokens_total)` is
    called after each part; a row group closes at the first part that brings it `row_group_positions`
    positions (or `ROW_GROUP_ENTRIES` entries)."""
    check_entries_path(out, force=force)
    name = view.teacher_name(selection.teacher)
    meta = view.teachers[name]
    rows = TeacherRows.of(view, teacher=name, keep=_keep(view, name, selection))
    reader = PartReader(view, teacher=name, rows=rows)
    metadata = {
        "teacher": name,
        "sparsity": meta.sparsity.to_json(),
        "grid": meta.codec.to_json(),
        "vocab_size": meta.vocab_size,
        "version": view.snapshot_id,
        "store_format": meta.format,
    }
    schema = entry_schema(meta, metadata=metadata)
    total = int(rows.n_tokens.sum())
    done = positions = 0
    start = time.perf_counter()
    with replacing(out) as tmp, RowGroups(tmp, schema, positions=row_group_positions) as groups:
        for code in _part_order(view, name, rows):  # one part in memory at a time
            held = rows.in_part(code)
            groups.add(_part_batch(reader, code, held, schema=schema))
            done += int(rows.n_tokens[held].sum())
            positions += int((rows.n_tokens[held] - 1).sum())
            if progress is not None:
                progress(done, total)
    seconds = time.perf_counter() - start
    return {
        "out": str(out),
        "format": "parquet",
        "what": "entries",
        "teacher": name,
        "version": view.snapshot_id,
        "samples": len(rows.sample_ids),
        "positions": positions,
        "tokens": total,
        "row_groups": groups.written,
        "seconds": seconds,
        "tokens_per_second": total / seconds if seconds > 0 else None,
    }


class RowGroups:
    """Record batches gathered into row groups of about `positions` rows, each written as it fills, in a
    thread of its own while the next one fills: Parquet's encoding and zstd (about half of an export's
    CPU) overlap the reading and decoding of the next parts, which costs a second row group in memory."""

    def __init__(self, path: Path, schema: pa.Schema, *, positions: int):
        self.path, self.schema, self.positions = path, schema, positions
        self.held: list[pa.RecordBatch] = []
        self.rows = self.entries = self.written = 0
        self.pending: concurrent.futures.Future | None = None

    def __enter__(self) -> RowGroups:
        self.writer = pq.ParquetWriter(
            self.path, self.schema, use_dictionary=["sample"], write_statistics=STATISTICS, compression="zstd"
        )
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="logitstore-export")
        return self

    def add(self, batch: pa.RecordBatch) -> None:
        self.held.append(batch)
        self.rows += batch.num_rows
        self.entries += len(batch.column("ids").values)
        if self.rows >= self.positions or self.entries >= ROW_GROUP_ENTRIES:
            self.flush()

    def flush(self) -> None:
        if self.held:
            table = pa.Table.from_batches(self.held, schema=self.schema)
            self.wait()  # the row group before: one in writing at a time
            # one row group, however many batches
            self.pending = self.pool.submit(self.writer.write_table, table, row_group_size=table.num_rows)
            self.written += 1
        self.held, self.rows, self.entries = [], 0, 0

    def wait(self) -> None:
        """Until the row group in writing is written (its error raised here)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def __exit__(self, kind, value, traceback) -> None:
        try:
            if kind is None:
                self.flush()
                self.wait()
            else:  # the error on the way out is the one to report; the file is removed anyway
                with contextlib.suppress(Exception):
                    self.wait()
        finally:
            self.pool.shutdown(wait=True)
            self.writer.close()


def _keep(view: StoreVersion, teacher: str, selection: EntrySelection) -> Callable[[list[str]], np.ndarray] | None:
    """`TeacherRows.of`'s mask over the teacher's sample ids: those of `selection`; a named id the
    version does not hold is refused, naming it."""
    if selection.samples is None and selection.limit is None:
        return None
    index = view.index.filter(pc.equal(view.index["teacher"], teacher))["sample_id"]
    wanted = index
    if selection.samples is not None:
        asked = pa.array(selection.samples, type=pa.string())
        missing = pc.filter(asked, pc.invert(pc.is_in(asked, value_set=index)))
        if len(missing):
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise SampleNotFoundError(
                f"no sample {missing[0].as_py()!r}{more} for teacher {teacher!r} in version {view.snapshot_id}"
            )
        wanted = pc.filter(index, pc.is_in(index, value_set=asked))  # index order
    if selection.limit is not None:
        wanted = wanted.slice(0, selection.limit)
    return lambda ids: pc.is_in(pa.array(ids, type=pa.string()), value_set=wanted).to_numpy(zero_copy_only=False)


def _part_order(view: StoreVersion, teacher: str, rows: TeacherRows) -> list[int]:
    """The codes of the parts `rows` hold, in the order the version's index first names them."""
    parts = view.index.filter(pc.equal(view.index["teacher"], teacher))["part"].unique().to_pylist()
    code = {part: i for i, part in enumerate(rows.parts)}
    return [code[p] for p in parts if p in code and len(rows.in_part(code[p]))]


def _part_batch(reader: PartReader, code: int, held: np.ndarray, *, schema: pa.Schema) -> pa.RecordBatch:
    """The rows of one part's selected samples (`held`, in their stored order)."""
    data = reader.read(code)
    damage = reader.damage({code: data}, held)
    if broken := next(((r, e) for r, e in zip(held.tolist(), damage) if e is not None), None):
        raise DamagedDataError(f"sample {reader.rows.sample_ids[broken[0]]!r} is damaged: {broken[1]} (see verify)")
    n_tokens = reader.rows.n_tokens[held]
    samples = reader.samples({code: data}, held, np.zeros(len(held), np.int64), n_tokens)
    ids = [reader.rows.sample_ids[r] for r in held.tolist()]  # one step per sample
    return entries_batch(samples, ids, schema=schema)


def entries_batch(s: SparseSamples, sample_ids: list[str], *, schema: pa.Schema) -> pa.RecordBatch:
    """Decoded samples as rows of `schema` (`entry_schema`): flat arrays and offsets, no step per position."""
    n_positions = s.n_tokens - 1
    which = np.repeat(np.arange(len(n_positions)), n_positions)
    position = np.arange(len(which)) - row_offsets(n_positions)[:-1][which]
    token_at = row_offsets(s.n_tokens)[:-1][which] + position
    offsets = pa.array(row_offsets(s.n_entries).astype(np.int32))
    order = by_probability(s.entry_logprobs, np.asarray(offsets))
    columns = {
        "sample": pc.take(pa.array(sample_ids, type=pa.string()), pa.array(which)),
        "position": pa.array(position.astype(np.int32)),
        "token": pa.array(s.input_ids[token_at].astype(np.int32)),
        "next_token": pa.array(s.input_ids[token_at + 1].astype(np.int32)),
        "ids": pa.ListArray.from_arrays(offsets, pa.array(s.entry_ids[order].astype(np.int32))),
        "logprobs": pa.ListArray.from_arrays(offsets, pa.array(s.entry_logprobs[order])),
        "tail": pa.array(s.tail.astype(np.float32, copy=False)),
        "target_logprob": pa.array(s.target_logprobs.astype(np.float32, copy=False)),
    }
    if "counts" in schema.names:
        assert s.entry_counts is not None, "a sampled teacher's parts hold counts"
        columns["counts"] = pa.ListArray.from_arrays(offsets, pa.array(s.entry_counts[order].astype(np.int32)))
    if "loss_mask" in schema.names:
        assert s.loss_mask is not None, "chat data's parts hold a loss mask"
        columns["loss_mask"] = pa.array(s.loss_mask[token_at + 1].astype(np.int8))
    return pa.RecordBatch.from_arrays([columns[name] for name in schema.names], schema=schema)


def by_probability(logprobs: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The order of entries that puts each position's (`offsets`) highest log-probability first, ties
    in stored order: what `show` prints (its lexsort costs ~1 s per 16M entries; this, ~0.1 s)."""
    order = np.empty(len(logprobs), dtype=np.int64)
    if len(logprobs):
        _by_probability_kernel(logprobs, offsets, order)
    return order


@numba.njit(cache=True, nogil=True)
def _by_probability_kernel(logprobs, offsets, order):
    # Per position, an insertion sort of its entries' numbers by descending log-probability (stable: a
    # tie keeps the stored order); a position holds a few dozen entries, already nearly ordered or short.
    for p in range(len(offsets) - 1):
        start, stop = offsets[p], offsets[p + 1]
        for e in range(start, stop):
            order[e] = e
        for a in range(start + 1, stop):
            entry = order[a]
            value = logprobs[entry]
            b = a - 1
            while b >= start and logprobs[order[b]] < value:
                order[b + 1] = order[b]
                b -= 1
            order[b + 1] = entry
