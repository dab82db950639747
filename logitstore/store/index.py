"""The sample index: one Parquet file per version, keyed by (teacher, sample_id).

Users read it with polars or pyarrow alone (`logitstore info --json` prints its path as `index_path`):

    sample_id     string   as given to the build, or a content hash of the text
    teacher       string   teacher name (a store may hold several)
    part          string   the Zarr group under teachers/<teacher>/parts/ that holds the rows
    n_tokens      int32    T, tokens the teacher saw; T - 1 positions follow
    token_start   int64    first row in the part's input_ids
    position_start int64   first row in the part's per-position arrays (tail, target_logprobs, n_entries)
    entry_start   int64    first row in the part's per-entry arrays (entry_codes, entry_logprobs, ...)
    n_entries     int64    entries over all positions of the sample
    content_hash  string   blake2b-128 of the sample's stored (encoded) arrays; `verify` and `diff` use it
    source_hash   string   optional hash of the source text, null when unknown

Per student tokenizer of the teacher (list columns, one element per name in the teacher's
`students`, in that order; empty lists for a teacher without student tokenizers):

    n_student_tokens list<int32>  the sample's student token ids
    student_start    list<int64>  first row in the part's students/<name>/ids
    n_groups         list<int32>  alignment groups of the sample
    group_start      list<int64>  first row (of 4 int32) in the part's students/<name>/groups

`content_hash` covers the student arrays too. An index without these columns (written by a
logitstore without cross-tokenizer support) reads as empty lists.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from typing import cast

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from logitstore.errors import DamagedDataError
from logitstore.format import layout
from logitstore.format.codec import EncodedSamples
from logitstore.format.samples import StudentTokens
from logitstore.storage.blobs import BlobStore

SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("teacher", pa.string()),
        ("part", pa.string()),
        ("n_tokens", pa.int32()),
        ("token_start", pa.int64()),
        ("position_start", pa.int64()),
        ("entry_start", pa.int64()),
        ("n_entries", pa.int64()),
        ("content_hash", pa.string()),
        ("source_hash", pa.string()),
        ("n_student_tokens", pa.list_(pa.int32())),
        ("student_start", pa.list_(pa.int64())),
        ("n_groups", pa.list_(pa.int32())),
        ("group_start", pa.list_(pa.int64())),
    ]
)
STUDENT_COLUMNS = ("n_student_tokens", "student_start", "n_groups", "group_start")


def empty_index() -> pa.Table:
    return SCHEMA.empty_table()


def part_rows(
    *,
    sample_ids: list[str],
    teacher: str,
    part: str,
    enc: EncodedSamples,
    n_tokens: np.ndarray,
    source_hashes: list[str | None] | None = None,
    students: Sequence[StudentTokens] = (),
) -> pa.Table:
    """Index rows for one freshly encoded part (its arrays start at row 0). `students` follow the
    order of the teacher's student tokenizers."""
    token_off, position_off, entry_off = encoded_offsets(enc, n_tokens)
    per_student = [(st.n_ids, _offsets(st.n_ids)[:-1], st.n_groups, _offsets(st.n_groups)[:-1]) for st in students]
    columns = {
        name: [[int(cols[k][s]) for cols in per_student] for s in range(len(sample_ids))]
        for k, name in enumerate(STUDENT_COLUMNS)
    }
    return pa.table(
        {
            "sample_id": sample_ids,
            "teacher": [teacher] * len(sample_ids),
            "part": [part] * len(sample_ids),
            "n_tokens": n_tokens.astype(np.int32),
            "token_start": token_off[:-1],
            "position_start": position_off[:-1],
            "entry_start": entry_off[:-1],
            "n_entries": np.diff(entry_off),
            "content_hash": sample_hashes(enc, n_tokens, students=students),
            "source_hash": source_hashes if source_hashes is not None else [None] * len(sample_ids),
            **columns,
        },
        schema=SCHEMA,
    )


def encoded_offsets(enc: EncodedSamples, n_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-sample [S + 1] starts into the token, position and entry arrays of a part."""
    token_off = np.concatenate([[0], np.cumsum(n_tokens, dtype=np.int64)])
    position_off = np.concatenate([[0], np.cumsum(np.asarray(n_tokens, dtype=np.int64) - 1)])
    entries_at = np.concatenate([[0], np.cumsum(enc.n_entries, dtype=np.int64)])
    return token_off, position_off, entries_at[position_off]


def _offsets(counts) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))])


# An array and each sample's [start, stop) in it.
Piece = tuple[np.ndarray, np.ndarray, np.ndarray]


def sample_hashes(enc: EncodedSamples, n_tokens: np.ndarray, *, students: Sequence[StudentTokens] = ()) -> list[str]:
    """blake2b-128 of each sample's encoded arrays (and its student tokens and alignment, if any), as
    hex: what the index's `content_hash` holds for freshly encoded samples (their arrays start at 0)."""
    token_off, position_off, entry_off = encoded_offsets(enc, n_tokens)
    spans = {"token": token_off, "position": position_off, "entry": entry_off}
    pieces = part_pieces(enc, {axis: (off[:-1], off[1:]) for axis, off in spans.items()})
    for st in students:
        id_off, group_off = _offsets(st.n_ids), _offsets(st.n_groups)
        pieces += student_pieces(
            st.ids,
            st.groups,
            st.loss_mask,
            tokens=(id_off[:-1], id_off[1:]),
            group_rows=(group_off[:-1], group_off[1:]),
        )
    return [d.hex() for d in digests(pieces, len(n_tokens))]


def part_pieces(enc: EncodedSamples, spans: dict[str, tuple[np.ndarray, np.ndarray]]) -> list[Piece]:
    """The part's arrays a content hash covers, with each sample's [start, stop) per axis (`layout.spans`)."""
    return [(a, *spans[layout.AXIS[name]]) for name in layout.HASHED_ARRAYS if (a := getattr(enc, name)) is not None]


def student_pieces(ids, groups, loss_mask, *, tokens: tuple, group_rows: tuple) -> list[Piece]:
    """One student tokenizer's arrays a content hash covers: its ids (int32) and loss mask (uint8) with
    each sample's [start, stop) `tokens`, its alignment groups (rows of 4 int32, flat or not) with each
    sample's rows `group_rows`."""
    (t0, t1), (g0, g1) = tokens, group_rows
    out = [
        (np.asarray(ids).astype(np.int32, copy=False), t0, t1),
        (np.asarray(groups).astype(np.int32, copy=False).reshape(-1), 4 * np.asarray(g0), 4 * np.asarray(g1)),
    ]
    if loss_mask is not None:
        out.append((np.asarray(loss_mask).astype(np.uint8, copy=False), t0, t1))
    return out


def digests(pieces: list[Piece], n: int) -> list[bytes]:
    """blake2b-128 of each of `n` samples' slices of the pieces, in order (`content_hash` as bytes).
    One Python iteration per sample, not per token; slices go to blake2b as buffers, not copies."""
    bounds = [(a, lo.tolist(), hi.tolist()) for a, lo, hi in pieces]
    out = []
    for s in range(n):
        h = hashlib.blake2b(digest_size=16)
        for a, lo, hi in bounds:
            h.update(np.ascontiguousarray(a[lo[s] : hi[s]]).data)
        out.append(h.digest())
    return out


def digests_of(content_hashes: list) -> np.ndarray:
    """uint8 [n, 16]: the index's hex `content_hash` values as bytes (zeros for one that is not 32 hex
    digits, which no read matches). One join and one hex decode for the column."""
    ok = [isinstance(h, str) and len(h) == 32 for h in content_hashes]
    out = np.zeros((len(content_hashes), 16), dtype=np.uint8)
    try:
        out[np.array(ok, dtype=bool)] = np.frombuffer(
            bytes.fromhex("".join(h for h, good in zip(content_hashes, ok) if good)), np.uint8
        ).reshape(-1, 16)
    except ValueError:  # a value of 32 characters that are not hex: left as zeros, one by one
        for i in np.flatnonzero(ok).tolist():  # one step per sample, for a damaged index only
            try:
                out[i] = np.frombuffer(bytes.fromhex(content_hashes[i]), np.uint8)
            except ValueError:
                out[i] = 0
    return out


def write_index(blobs: BlobStore, table: pa.Table) -> str:
    """Write the table as a content-addressed Parquet file; returns its key."""
    table = table.sort_by([("teacher", "ascending"), ("sample_id", "ascending")])
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    data = buf.getvalue()
    key = f"{hashlib.sha256(data).hexdigest()[:40]}.parquet"
    if not blobs.exists(key):
        blobs.put(key, data)
    return key


def read_index(blobs: BlobStore, key: str | None) -> pa.Table:
    if key is None:
        return empty_index()
    try:
        data = blobs.get(key)
    except KeyError:
        raise DamagedDataError(f"the sample index {blobs.url(key)} is missing") from None
    if not key.startswith(hashlib.sha256(data).hexdigest()[:40]):
        raise DamagedDataError(f"the sample index {blobs.url(key)} is damaged (its checksum does not match its name)")
    table = pq.ParquetFile(pa.BufferReader(_arrow_owned(data))).read(use_threads=False)
    for name in STUDENT_COLUMNS:  # an index without the per-student columns: no student tokenizer
        if name not in table.column_names:
            table = table.append_column(name, pa.array([[]] * table.num_rows, type=SCHEMA.field(name).type))
    return table.select(SCHEMA.names).cast(SCHEMA)


def _arrow_owned(data: bytes) -> pa.Buffer:
    """`data` copied into memory Arrow owns. Parquet read from Python bytes (a `BytesIO`, `py_buffer`) leaves
    buffers that hold the bytes object, and Arrow's thread pool may drop the last of them after the command
    returned: taking the GIL while Python finalizes kills that C++ thread and aborts the process (`ls` exits
    134, "terminate called without an active exception", in ~2 runs of 100 without the copy; tests/test_exit.py). One
    copy of the index (kilobytes to a few MB) is the cost."""
    sink = pa.BufferOutputStream()
    sink.write(data)
    return sink.getvalue()


def diff_indexes(a: pa.Table, b: pa.Table) -> dict[str, list[dict]]:
    """Samples added, removed and changed (content hash differs) from version a to version b."""
    import polars as pl  # here, not at the top: 0.13 s at every command's start, and only diff needs it

    key = ["teacher", "sample_id"]
    # From a Table, always a DataFrame (polars types any Arrow input; pyarrow has no types here).
    left = cast(pl.DataFrame, pl.from_arrow(a)).select(*key, "content_hash")
    right = cast(pl.DataFrame, pl.from_arrow(b)).select(*key, "content_hash")
    added = right.join(left, on=key, how="anti").select(key)
    removed = left.join(right, on=key, how="anti").select(key)
    both = left.join(right, on=key, how="inner", suffix="_b")
    changed = both.filter(pl.col("content_hash") != pl.col("content_hash_b")).select(key)
    return {
        name: df.sort(key).to_dicts() for name, df in (("added", added), ("removed", removed), ("changed", changed))
    }
