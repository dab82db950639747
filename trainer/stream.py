"""The stream engine: a pinned store version (or a live teacher) -> packed, fixed-length micro-batches
with the teacher's sparse targets. Deterministic, sharded across ranks, resumable mid-epoch, and
reading each stored byte about once per epoch however large the store.

One engine, `Stream`, owns order, split, packing, sharding, resume, reading and prefetch. What turns
a piece of a sample into targets is its *source*: `StoreSource` (one teacher of a store, here),
`teachers.MixedSource` (several or cross-tokenizer teachers) and `live.LiveSource` (a teacher process
beside the trainer). `store_stream` and `logitstore.stream` build the first two.

The contract (tests/test_stream.py holds the engine to it):

- **Split.** A sample is in the eval split iff `is_eval_sample(id, eval_fraction=f)`: the first 8 bytes
  of blake2b(id) read as a big-endian integer, as a fraction of 2**64, is below f. It depends on the id
  alone, so train and eval are disjoint and stable across runs, machines, versions and world sizes.
- **Epoch order: a window shuffle over parts.** A store is written in *parts* (the build's units, ~16k
  tokens each). The split's samples are sorted by id; the parts holding them are permuted by
  `default_rng([seed, epoch, 2**32])` and cut into *windows* of `window_parts` parts; the epoch visits
  the windows in that order and, inside window k, the window's samples (in id order) permuted by
  `default_rng([seed, epoch, k])`. Each part is read whole once per window, so an epoch reads each
  stored byte about once, in large sequential requests. When the whole split fits the memory budget,
  there is one window: the order is then the global shuffle `default_rng([seed, epoch]).permutation(n)`
  of all samples, and the parts, read once, stay in memory for the whole run. The order depends on
  the version, the seed, the epoch and `window_parts` only (never on the world size); `window_parts`
  follows from the memory budget, so a resumed run needs the same budget (its state says so).
  Shuffle quality: two samples of one part always land in the same window, so within an epoch they are
  at most `window_parts` parts' worth of tokens apart; samples of different windows never mix.
- **Memory.** `memory_budget` bounds the stored data held in memory (encoded, as read: about 3-10
  bytes per token): the window being read and the next one, read ahead by `read_threads` threads. So
  `window_parts = budget // (2 * largest part)`; a budget smaller than two parts is refused. A split
  that holds under half of a part's bytes (the eval split) reads just its samples' byte ranges of
  that part, not the whole part.
- **Packing.** The ordered samples are laid end to end and cut into rows of exactly `seq_len` tokens,
  which is the same as greedy filling: a sample that does not fit in the rest of a row is cut there and
  its remainder starts the next row as a new *fragment*. Row j of an epoch is tokens
  [j*seq_len, (j+1)*seq_len) of that concatenation, so any row is found without reading data. The train
  split drops the last partial row of the epoch; the eval split keeps it, padded, so every held-out
  token is evaluated however small the split. Position ids restart at 0 at every sample or fragment start;
  document ids number the segments of a row 0, 1, ... Token t of a row is *supervised* (it carries the
  teacher's distribution over token t+1) iff tokens t and t+1 lie in the same row and the same sample.
- **Sharding.** Rows are global. Each step consumes `world_size * micro_batch` consecutive global rows;
  rank r takes the r-th block of `micro_batch` of them. `steps_per_epoch = rows_per_epoch //
  (world_size*micro_batch)` is the same on every rank; the leftover rows of the epoch are dropped. The
  eval split rounds up instead: its last step's rows past the end are padding (no targets), so a split
  of one sample gives one step on every rank.
  Every rank reads every window it takes rows from (all of them), so N ranks read the store N times
  per epoch: from local disk the page cache serves the repeats, from S3 it is N times the requests.
- **State.** `state_dict()` = {"epoch", "rows_consumed", "seed", "version", "window_parts"}: global rows
  consumed in the epoch by all ranks together, counted at the batches *yielded*. It does not depend on
  the world size, so a run resumed with another world size continues at the same row.
  `load_state_dict` refuses a state from another version, seed or window (memory budget).
- **Iteration.** The train split is infinite over epochs. The eval split is one pass of epoch 0: each
  `iter()` yields from the current position to the end of the pass and then rewinds to the start.
- **DataLoader workers.** A stream is an `IterableDataset`: in a `DataLoader(stream, batch_size=None,
  num_workers=W, multiprocessing_context="spawn")` worker w yields the steps w, w + W, ... from where
  the stream stood, so the loader (in order) yields exactly the batches of one process. Each worker is
  sent the stream's recipe (store URI, snapshot, arguments, position) and opens the version itself
  (Icechunk must not be forked; memory stores and several-teacher streams cannot be sent). Each worker
  reads the parts its steps touch, so W workers read most parts W times. The parent's stream does not
  see the workers' progress: every batch carries `data_state`, the `state_dict()` after it, which
  `load_state_dict` resumes from.
- **Prefetch.** A background thread builds up to `prefetch` micro-batches ahead and asks for the parts
  of the batches after them, so reads overlap decoding; its exceptions are re-raised in the consumer;
  `close()` stops it. `wait_seconds` is the consumer's cumulative time waiting. `prefetch=0` builds
  batches in the consumer's thread.
- **Damaged data.** A sample whose arrays fail to read (a chunk failing its CRC32C) or contradict the
  index or the vocabulary raises `DamagedDataError` naming the sample. With `on_error="skip"` its
  fragment becomes padding instead (document id -1, no targets, not counted in `n_tokens`), so the row
  sequence and the step count stay the same on every rank; `skipped_samples` counts distinct ids.
  A part that fails to read whole is read sample by sample, so one bad chunk costs only its samples.
- **Outages.** A store that cannot be reached, or stops answering (`StorageLimits`), is not damage:
  the read raises `StorageError` and stops the stream whatever `on_error` says.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from collections.abc import Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, TypedDict, cast

import numba
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from zarr.core.sync import sync as zarr_sync
from zarr.types import AnyAsyncArray

from logitstore import codec
from logitstore.ahead import read_ahead
from logitstore.chat import TRAIN_ON, supervised_positions
from logitstore.codec import EncodedSamples
from logitstore.errors import DamagedDataError, LogitstoreError, StorageError
from logitstore.meta import read_values
from logitstore.rawread import read_arrays
from logitstore.sizes import DEFAULT_MEMORY_BUDGET, format_bytes, parse_bytes
from logitstore.store import ENCODED_ARRAYS, Store, StoreVersion, read_errors
from logitstore.version import ROW_AXIS
from logitstore.zarr_codec import as_codes

SPLITS = ("train", "eval")
ON_ERROR = ("raise", "skip")
READ_THREADS = 8  # parts read at once: S3 answers in 10-50 ms, so one at a time would starve decoding
LOOKAHEAD_BATCHES = 8  # micro-batches ahead whose parts are asked for: work for every reader thread
# Read through a gap of at most this many elements rather than issue another request (sliced reads):
# on object storage a request costs more than a few KB of extra bytes.
MERGE_GAP = 4096
_WINDOW_STREAM = 2**32  # the RNG stream of the part permutation, apart from the windows' 0, 1, ...


class StreamConfigError(LogitstoreError, ValueError):
    """A stream that cannot be built as asked: a bad argument, an empty or too small split, a memory
    budget below two parts, or a state from another run. A `LogitstoreError` and a `ValueError`."""


def is_eval_sample(sample_id: str, *, eval_fraction: float) -> bool:
    """True iff the sample belongs to the eval split: blake2b-64 of the id, as a fraction of 2**64,
    is below `eval_fraction`. Stable across runs, machines and Python versions (no `hash()`)."""
    digest = hashlib.blake2b(sample_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") < eval_fraction * 2.0**64


# -- the batch ---------------------------------------------------------------------------------------


@dataclass
class PackedBatch:
    """One micro-batch of `B` rows of `L` tokens, with the teacher's sparse targets flattened in
    row-major (b, t) order. `positions[p] = b*L + t` is a supervised token; it predicts token t+1."""

    input_ids: torch.Tensor  # [B, L] int64
    position_ids: torch.Tensor  # [B, L] int64, 0 at each sample or fragment start
    document_ids: torch.Tensor  # [B, L] int64, segment number within the row; padding -1
    positions: torch.Tensor  # [P] int64
    entry_ids: torch.Tensor  # [E] int64
    entry_logprobs: torch.Tensor  # [E] float32
    entry_pos: torch.Tensor  # [E] int64 in [0, P), non-decreasing
    tail: torch.Tensor  # [P] float32, teacher mass outside the entries
    target_ids: torch.Tensor  # [P] int64, = input_ids.view(-1)[positions + 1]
    target_logprobs: torch.Tensor  # [P] float32, teacher log-probability of the target
    entry_counts: torch.Tensor | None  # [E] float32 draws per entry (sampled stores), else None
    n_tokens: int  # real (non-padding) tokens
    # (sample id, first token of the fragment in the sample, flat start b*L + t, length) per segment,
    # in row-major order: for logging and tests; skipped fragments are absent.
    segments: list[tuple[str, int, int, int]] = field(default_factory=list)
    # Runs with several teachers or a cross-tokenizer teacher (`trainer/mixing.py`): per teacher,
    # (name, SparseTargets | AlignedTargets) over the same P positions, and counts for the metrics.
    # The single-teacher fields above then hold no entries.
    signals: list | None = None
    signal_counts: dict | None = None
    # The stream's `state_dict()` once this batch is consumed: resume point for a loop that reads the
    # stream through a DataLoader's worker processes, whose progress the parent's stream cannot see.
    data_state: dict | None = None

    def block_causal_mask(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[B, 1, L, L] additive mask: 0 where query may attend key (same document, key <= query),
        `finfo(dtype).min` elsewhere. A padding query attends to itself only, so softmax has no NaN."""
        doc = self.document_ids
        length = doc.shape[1]
        same = doc[:, :, None] == doc[:, None, :]
        causal = torch.ones(length, length, dtype=torch.bool, device=doc.device).tril()
        itself = torch.eye(length, dtype=torch.bool, device=doc.device)
        allowed = torch.where((doc >= 0)[:, :, None], same & causal, itself)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=doc.device)
        return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]

    def to(self, device, *, non_blocking: bool = False) -> PackedBatch:
        """A copy with every tensor on `device`."""
        moved: dict[str, Any] = {}  # field name -> value, of that field's type
        for f in fields(self):
            value = getattr(self, f.name)
            moved[f.name] = value.to(device, non_blocking=non_blocking) if isinstance(value, torch.Tensor) else value
        return PackedBatch(**moved)


# -- what a source gives the engine ------------------------------------------------------------------


@dataclass
class SplitTable:
    """The samples of one split, sorted by sample id: what the engine orders and packs."""

    sample_ids: list[str]
    n_tokens: np.ndarray  # int64 [n]: the packed length of each sample
    part: np.ndarray  # int64 [n]: the part holding it (the unit of reading), 0 for sources without parts
    parts: list[str]  # part names, by code


@dataclass
class Pieces:
    """Fragments covering a span of rows, in row-major order: sample `row` (into the split table), its
    tokens [a, b), starting at `flat` within the span, in window `window` of the epoch."""

    row: np.ndarray
    a: np.ndarray
    b: np.ndarray
    flat: np.ndarray
    window: np.ndarray


class Source(Protocol):
    """What the engine needs from a source of teacher signal."""

    table: SplitTable
    version: str  # what a state_dict pins (a store snapshot id, or live mode's fingerprint)

    def part_bytes(self) -> np.ndarray | None:
        """Bytes in memory of each part once read, or None for a source with nothing to read."""

    def read_part(self, part: int) -> object:
        """Read one part (in a reader thread); what `build` gets back in `parts`."""

    def build(self, pieces: Pieces, parts: dict[int, Any], *, stream: Stream) -> PackedBatch:
        """The batch of these pieces (`parts`: what its own `read_part` gave, by part);
        `stream.unreadable(row, error)` for a sample that cannot be used."""


def split_index(view: StoreVersion, *, teacher: str, split: str, eval_fraction: float) -> pa.Table:
    """The index rows of one teacher in one split, sorted by sample id."""
    idx = view.index.filter(pc.equal(view.index["teacher"], teacher)).sort_by("sample_id")
    in_eval = [is_eval_sample(s, eval_fraction=eval_fraction) for s in idx["sample_id"].to_pylist()]  # per sample
    return idx.filter(pa.array([e == (split == "eval") for e in in_eval], type=pa.bool_()))


# -- order and packing ---------------------------------------------------------------------------------


class EpochPlan:
    """One epoch's sample order, its windows, and its packed token stream; cuts any span of rows into
    pieces without reading data."""

    def __init__(self, table: SplitTable, *, seed: int, epoch: int, seq_len: int, window_parts: int | None):
        n_parts = len(table.parts)
        if window_parts is None or window_parts >= n_parts:  # one window: the global shuffle
            self.order = np.random.default_rng([seed, epoch]).permutation(len(table.n_tokens))
            self.window_start = np.zeros(1, dtype=np.int64)
        else:
            self.order, self.window_start = _windowed_order(table, seed=seed, epoch=epoch, window_parts=window_parts)
        self.part_sequence = table.part[self.order]  # the part of each sample, in epoch order
        lengths = table.n_tokens[self.order]
        self.ends = np.cumsum(lengths)
        self.begins = self.ends - lengths
        self.seq_len = seq_len
        self._parts_of_window: dict[int, np.ndarray] = {}

    @property
    def n_windows(self) -> int:
        return len(self.window_start)

    def pieces(self, row0: int, row1: int) -> Pieces:
        """The fragments of rows [row0, row1); tokens past the end of the epoch's stream (the eval
        split's padded last row and step) are in none: they are padding."""
        total = int(self.ends[-1]) if len(self.ends) else 0
        start, stop = min(row0 * self.seq_len, total), min(row1 * self.seq_len, total)
        if start == stop:
            empty = np.zeros(0, dtype=np.int64)
            return Pieces(row=empty, a=empty, b=empty, flat=empty, window=empty)
        first = np.searchsorted(self.ends, start, side="right")
        last = np.searchsorted(self.begins, stop, side="left")
        # Every sample boundary and every row boundary inside the span starts a new piece.
        cuts = np.concatenate(
            [self.begins[first:last], self.ends[first:last], np.arange(start, stop, self.seq_len), [stop]]
        )
        cuts = np.unique(cuts[(cuts >= start) & (cuts <= stop)])
        k = np.searchsorted(self.ends, cuts[:-1], side="right")  # position in the epoch order
        return Pieces(
            row=self.order[k],
            a=cuts[:-1] - self.begins[k],
            b=cuts[1:] - self.begins[k],
            flat=cuts[:-1] - start,
            window=np.searchsorted(self.window_start, k, side="right") - 1,
        )

    def parts_of_window(self, window: int) -> np.ndarray:
        """The window's parts in the order the epoch first needs them (the order to read them in)."""
        if window not in self._parts_of_window:
            stop = self.window_start[window + 1] if window + 1 < self.n_windows else len(self.order)
            sequence = self.part_sequence[self.window_start[window] : stop]
            _, first = np.unique(sequence, return_index=True)
            self._parts_of_window[window] = sequence[np.sort(first)]
        return self._parts_of_window[window]


def _windowed_order(table: SplitTable, *, seed: int, epoch: int, window_parts: int) -> tuple[np.ndarray, np.ndarray]:
    """(sample order, start of each window in it): parts permuted and cut into windows, samples
    permuted inside each window. One pass over the samples, one loop step per window."""
    n_parts = len(table.parts)
    part_order = np.random.default_rng([seed, epoch, _WINDOW_STREAM]).permutation(n_parts)
    window_of_part = np.empty(n_parts, dtype=np.int64)
    window_of_part[part_order] = np.arange(n_parts) // window_parts
    window_of_sample = window_of_part[table.part]
    by_window = np.argsort(window_of_sample, kind="stable")  # id order inside each window
    counts = np.bincount(window_of_sample, minlength=int(window_of_part.max()) + 1)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    order = np.empty_like(by_window)
    for k, (s, c) in enumerate(zip(starts.tolist(), counts.tolist())):  # one step per window
        order[s : s + c] = by_window[s : s + c][np.random.default_rng([seed, epoch, k]).permutation(c)]
    return order, starts[counts > 0]


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n), without a Python loop."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(np.asarray(starts, dtype=np.int64) - offsets, lengths) + np.arange(total, dtype=np.int64)


# -- reading one teacher's parts ------------------------------------------------------------------------


# Errors that mean a bug, never damaged data: they keep their traceback.
_BUGS = (TypeError, AttributeError, NameError, AssertionError, ImportError)


class _Damaged(DamagedDataError):
    """Stored arrays that read without error but contradict the index or the vocabulary."""


@dataclass
class TeacherRows:
    """One teacher's index rows of a split (sorted by sample id), as numpy columns."""

    sample_ids: list[str]
    part: np.ndarray  # int64 code into `parts`
    parts: list[str]
    n_tokens: np.ndarray
    token_start: np.ndarray
    position_start: np.ndarray
    entry_start: np.ndarray
    n_entries: np.ndarray

    @classmethod
    def of(cls, view: StoreVersion, *, teacher: str, split: str, eval_fraction: float) -> TeacherRows:
        idx = split_index(view, teacher=teacher, split=split, eval_fraction=eval_fraction)
        parts, codes = np.unique(np.asarray(idx["part"].to_pylist(), dtype=str), return_inverse=True)
        column = lambda name: idx[name].to_numpy().astype(np.int64)
        return cls(
            sample_ids=idx["sample_id"].to_pylist(),
            part=np.asarray(codes, dtype=np.int64).reshape(-1),
            parts=[str(p) for p in parts],
            n_tokens=column("n_tokens"),
            token_start=column("token_start"),
            position_start=column("position_start"),
            entry_start=column("entry_start"),
            n_entries=column("n_entries"),
        )

    def __post_init__(self) -> None:
        # Rows sorted by (part, place in it), and where each part's run starts: `in_part` in O(1).
        self._by_part = np.lexsort((self.token_start, self.part))
        self._part_start = np.concatenate([[0], np.cumsum(np.bincount(self.part, minlength=len(self.parts)))])

    def in_part(self, code: int) -> np.ndarray:
        """The rows held by part `code`, sorted by their place in the part."""
        return self._by_part[self._part_start[code] : self._part_start[code + 1]]


@dataclass
class PartData:
    """One part of one teacher in memory: its encoded arrays (all of it, or just some samples' ranges
    at their places in full-length arrays), entry offsets per position, and the unusable samples."""

    arrays: dict[str, np.ndarray]
    entry_cum: np.ndarray  # int64 [positions + 1]: entries before each position (within a sample, exact)
    damaged: dict[int, Exception]  # row -> why it cannot be used


class PartReader:
    """Reads one teacher's parts for a split: whole when the split holds at least half of a part's
    bytes, else just the split's samples (the eval split), and checks every sample against the index
    and the vocabulary in vectorised passes."""

    def __init__(self, view: StoreVersion, *, teacher: str, rows: TeacherRows):
        meta = view.teachers[teacher]
        self.view, self.teacher, self.rows = view, teacher, rows
        self.vocab_size, self.params = meta.vocab_size, meta.codec
        self.sampled = meta.sampled
        self.masked = meta.loss_mask is not None  # chat data: a per-token loss_mask in every part
        self.names = tuple(
            n for n in ENCODED_ARRAYS if (n != "entry_counts" or self.sampled) and (n != "loss_mask" or self.masked)
        )
        self.id_bytes = codec.id_dtype(meta.vocab_size).itemsize
        split_bytes = self._bytes(rows.n_tokens, rows.n_entries, rows.part, len(rows.parts))
        all_rows = view.index.filter(pc.equal(view.index["teacher"], teacher))
        codes = pc.index_in(all_rows["part"], value_set=pa.array(rows.parts, type=pa.string()))
        all_codes = codes.fill_null(-1).to_numpy().astype(np.int64)
        held = all_codes >= 0
        whole_bytes = self._bytes(
            all_rows["n_tokens"].to_numpy().astype(np.int64)[held],
            all_rows["n_entries"].to_numpy().astype(np.int64)[held],
            all_codes[held],
            len(rows.parts),
        )
        self.whole = split_bytes * 2 >= whole_bytes  # read the part whole, else the split's ranges only
        self.bytes = np.where(self.whole, whole_bytes, split_bytes)

    def _bytes(self, n_tokens, n_entries, part, n_parts) -> np.ndarray:
        """Bytes in memory per part of the given samples: the encoded arrays plus `entry_cum`."""
        per_sample = (
            n_tokens * (self.id_bytes + self.masked)
            + (n_tokens - 1) * (6 + 8)
            + n_entries * (self.id_bytes + 2 + (2 if self.sampled else 0))
        )
        return np.bincount(part, weights=per_sample, minlength=n_parts).astype(np.int64)

    def read(self, code: int) -> PartData:
        rows = self.rows.in_part(code)
        part = self.rows.parts[code]
        damaged: dict[int, Exception] = {}
        try:
            with read_errors(f"part {part} of teacher {self.teacher!r}"):
                arrays = self._whole(part) if self.whole[code] else self._ranges(part, rows)
        except StorageError:
            raise
        except DamagedDataError:  # one bad chunk: read sample by sample to lose only its samples
            arrays, damaged = self._by_sample(part, rows)
        entry_cum = np.concatenate([[0], np.cumsum(arrays["n_entries"], dtype=np.int64)])
        damaged.update(self._check(arrays, entry_cum, rows, skip=damaged))
        return PartData(arrays=arrays, entry_cum=entry_cum, damaged=damaged)

    def _whole(self, part: str) -> dict[str, np.ndarray]:
        """Every array of the part: by `rawread` (two rounds of concurrent requests, decoded here), or
        for a layout it does not know, opened and read concurrently through Zarr."""
        base = f"teachers/{self.teacher}/parts/{part}"
        fast = read_arrays(self.view.root.store, [f"{base}/{name}" for name in self.names])
        if fast is not None:
            return dict(zip(self.names, fast))
        root = self.view.root._async_group

        async def one(name: str) -> np.ndarray:
            array = cast(AnyAsyncArray, await root.getitem(f"{base}/{name}"))  # the layout's arrays
            return as_codes(cast(np.ndarray, await array.getitem(slice(None))), self.params)

        async def every() -> list:
            return await asyncio.gather(*(one(name) for name in self.names))

        return dict(zip(self.names, zarr_sync(every())))

    def _spans(self, rows: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per array, the [start, stop) of each row's elements."""
        r = self.rows
        ts, ps, es = r.token_start[rows], r.position_start[rows], r.entry_start[rows]
        n, ne = r.n_tokens[rows], r.n_entries[rows]
        spans = {
            "input_ids": (ts, ts + n),
            "loss_mask": (ts, ts + n),
            "n_entries": (ps, ps + n - 1),
            "tail": (ps, ps + n - 1),
            "target_logprobs": (ps, ps + n - 1),
            "entry_codes": (es, es + ne),
            "entry_logprobs": (es, es + ne),
            "entry_counts": (es, es + ne),
        }
        return {name: spans[name] for name in self.names}

    def _ranges(self, part: str, rows: np.ndarray) -> dict[str, np.ndarray]:
        """Just these rows' elements, at their places in zero-filled full-length arrays (np.zeros maps
        untouched pages lazily, so the memory used is the rows' own)."""
        out = {}
        for name, (starts, stops) in self._spans(rows).items():
            array = self.view.array(self.teacher, part, name)
            full = np.zeros(array.shape[0], dtype=_stored_dtype(array))
            for s, e in _merged(starts, stops):  # one request per run of nearby samples
                values = as_codes(read_values(array, slice(s, e)), self.params)
                if len(values) != e - s:  # Zarr clamps slices silently: an index beyond the stored array
                    raise _Damaged(f"index range [{s}, {e}) lies outside the stored array of {array.shape[0]}")
                full[s:e] = values
            out[name] = full
        return out

    def _by_sample(self, part: str, rows: np.ndarray) -> tuple[dict[str, np.ndarray], dict[int, Exception]]:
        arrays = {
            name: np.zeros(
                self.view.array(self.teacher, part, name).shape[0],
                dtype=_stored_dtype(self.view.array(self.teacher, part, name)),
            )
            for name in self.names
        }
        damaged: dict[int, Exception] = {}
        for row in rows.tolist():  # one step per sample, only for a part with a damaged chunk
            try:
                with read_errors(f"sample {self.rows.sample_ids[row]!r}"):
                    for name, values in self._ranges(part, np.array([row])).items():
                        arrays[name] += values  # disjoint ranges: adding places them
            except (*_BUGS, StorageError):
                raise
            except Exception as e:
                damaged[row] = e
        return arrays, damaged

    def _check(
        self, arrays: dict[str, np.ndarray], entry_cum: np.ndarray, rows: np.ndarray, *, skip: dict
    ) -> dict[int, Exception]:
        """Rows whose stored arrays contradict the index or the vocabulary (the decode kernel indexes
        without bounds checks). Vectorised over the part."""
        r = self.rows
        n, ts, ps, es, ne = (c[rows] for c in (r.n_tokens, r.token_start, r.position_start, r.entry_start, r.n_entries))
        bad: dict[int, Exception] = {}

        def flag(mask: np.ndarray, why: str) -> None:
            for row in rows[mask].tolist():  # one step per damaged sample
                if row not in skip and row not in bad:
                    bad[row] = _Damaged(why)

        inside = (
            (ts + n <= len(arrays["input_ids"]))
            & (ps + n - 1 <= len(arrays["n_entries"]))
            & (es + ne <= len(arrays["entry_codes"]))
        )
        flag(~inside, "index range lies outside the stored arrays")
        ps_in, end_in = np.where(inside, ps, 0), np.where(inside, ps + n - 1, 0)
        counts_ok = entry_cum[end_in] - entry_cum[ps_in] == ne
        flag(inside & ~counts_ok, "stored entry counts disagree with the index")
        token_bad = np.flatnonzero(arrays["input_ids"] >= self.vocab_size)
        flag(_rows_touching(token_bad, ts, n), "a stored token id lies outside the vocabulary")
        good = inside & counts_ok
        flag(
            self._bad_codes(arrays["entry_codes"], entry_cum, ps=ps[good], n=n[good], es=es[good], where=good),
            "a stored entry code lies outside the vocabulary",
        )
        return bad

    def _bad_codes(self, codes: np.ndarray, entry_cum: np.ndarray, *, ps, n, es, where: np.ndarray) -> np.ndarray:
        """Mask over all rows (`where` marks the ones given) holding an entry code beyond the vocabulary."""
        mask = np.zeros(len(where), dtype=bool)
        bad = np.zeros(len(ps), dtype=np.bool_)
        if len(ps) and len(codes):
            _codes_beyond(codes, entry_cum, ps, n, es, self.vocab_size, bad)
        mask[np.flatnonzero(where)[bad]] = True
        return mask

    def gather(self, parts: dict[int, PartData], rows: np.ndarray, a: np.ndarray, b: np.ndarray) -> EncodedSamples:
        """The encoded arrays of tokens [a, b) of each row, concatenated in the given order: one slice
        (a view) per row and array, then one concatenation per array."""
        r = self.rows
        ts, ps, es = r.token_start[rows], r.position_start[rows], r.entry_start[rows]
        code = r.part[rows]
        e0, e1 = np.empty(len(rows), np.int64), np.empty(len(rows), np.int64)
        for c in np.unique(code).tolist():  # per part, a few per batch
            sel = np.flatnonzero(code == c)
            cum, p = parts[c].entry_cum, ps[sel]
            e0[sel] = es[sel] + cum[p + a[sel]] - cum[p]
            e1[sel] = es[sel] + cum[p + b[sel] - 1] - cum[p]
        spans = {"input_ids": (ts + a, ts + b), "position": (ps + a, ps + b - 1), "entry": (e0, e1)}
        axis = {name: "input_ids" if along == "token" else along for name, along in ROW_AXIS.items()}
        held = [parts[c].arrays for c in code.tolist()]
        bounds = {k: (lo.tolist(), hi.tolist()) for k, (lo, hi) in spans.items()}
        out = {}
        for name in self.names:  # one slice per row: views, so the only copy is the concatenation
            lo, hi = bounds[axis[name]]
            out[name] = np.concatenate([arrays[name][s:e] for arrays, s, e in zip(held, lo, hi)])
        return EncodedSamples(**out)


def _stored_dtype(array) -> np.dtype:
    """The dtype of an array's stored values: uint16 codes for the grid codec's float32 log-probabilities."""
    return np.dtype(np.uint16) if array.dtype == np.float32 else array.dtype


@numba.njit(cache=True, nogil=True)
def _codes_beyond(deltas, entry_cum, ps, n, es, vocab_size, bad):
    # Codes are running sums of non-negative gaps per position, so a position's largest is its last.
    # One pass over the entries with no temporaries: numpy needs an int64 copy and a cumsum of them all.
    for r in range(len(ps)):
        base = es[r] - entry_cum[ps[r]]
        for p in range(ps[r], ps[r] + n[r] - 1):
            code = 0
            for e in range(base + entry_cum[p], base + entry_cum[p + 1]):
                code += deltas[e]
            if code >= vocab_size:
                bad[r] = True
                break


def _merged(starts: np.ndarray, stops: np.ndarray) -> list[tuple[int, int]]:
    """Runs of [start, stop) ranges closer than `MERGE_GAP`, sorted: one request each."""
    runs: list[list[int]] = []
    order = np.argsort(starts, kind="stable")
    for s, e in zip(starts[order].tolist(), stops[order].tolist()):  # one step per sample
        if e <= s:
            continue
        if runs and s <= runs[-1][1] + MERGE_GAP:
            runs[-1][1] = max(runs[-1][1], e)
        else:
            runs.append([s, e])
    return [(s, e) for s, e in runs]


def _rows_touching(elements: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Mask over rows (sorted by `starts`) whose [start, start + length) holds any of `elements`."""
    mask = np.zeros(len(starts), dtype=bool)
    if len(elements) and len(starts):
        at = np.searchsorted(starts, elements, side="right") - 1
        ok = at >= 0
        at, elements = at[ok], elements[ok]
        mask[at[elements < starts[at] + lengths[at]]] = True
    return mask


# -- the single-teacher store source --------------------------------------------------------------------


class StoreSource:
    """One teacher of a store version: pieces become `PackedBatch`es of that teacher's targets."""

    def __init__(
        self, view: StoreVersion, *, teacher: str | None, split: str, eval_fraction: float, train_on: str = "completion"
    ):
        self.view, self.teacher = view, view.teacher_name(teacher)
        self.version = view.snapshot_id
        self.completion_only = train_on == "completion"
        check_train_on(view, teacher=self.teacher, train_on=train_on)
        self.rows = TeacherRows.of(view, teacher=self.teacher, split=split, eval_fraction=eval_fraction)
        self.table = SplitTable(
            sample_ids=self.rows.sample_ids, n_tokens=self.rows.n_tokens, part=self.rows.part, parts=self.rows.parts
        )
        self.reader = PartReader(view, teacher=self.teacher, rows=self.rows)
        meta = view.teachers[self.teacher]
        # Here, not lazily in threads; int32 as the decode kernel takes it (no copy per batch).
        self.params, self.id_of_code = meta.codec, view.id_of_code(self.teacher).astype(np.int32)
        self.where = f"the {split} split of teacher {self.teacher!r} in version {view.snapshot_id}"

    def part_bytes(self) -> np.ndarray:
        return self.reader.bytes

    def read_part(self, code: int) -> PartData:
        return self.reader.read(code)

    def build(self, pieces: Pieces, parts: dict[int, PartData], *, stream: Stream) -> PackedBatch:
        codes = self.table.part[pieces.row].tolist()
        damage = [parts[c].damaged.get(r) for r, c in zip(pieces.row.tolist(), codes)]  # one step per piece
        ok = np.array([d is None for d in damage], dtype=bool)
        for i in np.flatnonzero(~ok).tolist():
            error = damage[i]
            assert error is not None  # not ok: damaged
            stream.unreadable(int(pieces.row[i]), error, part=self.table.parts[codes[i]])
        decoded = None
        if ok.any():
            enc = self.reader.gather(parts, pieces.row[ok], pieces.a[ok], pieces.b[ok])
            decoded = codec.decode(
                enc, params=self.params, id_of_code=self.id_of_code, n_tokens=(pieces.b - pieces.a)[ok]
            )
        return assemble(
            pieces,
            ok,
            decoded,
            sample_ids=self.table.sample_ids,
            micro_batch=stream.micro_batch,
            seq_len=stream.seq_len,
            sampled=self.reader.sampled,
            completion_only=self.completion_only,
        )


def check_train_on(view: StoreVersion, *, teacher: str, train_on: str) -> None:
    """`--train-on`: a known value, and prompt+completion only where the store holds entries for prompts."""
    if train_on not in TRAIN_ON:
        raise StreamConfigError(f"--train-on must be one of {', '.join(TRAIN_ON)}, got {train_on!r}")
    if train_on == "prompt+completion" and view.teachers[teacher].loss_mask == "completion":
        raise StreamConfigError(
            f"--train-on prompt+completion: teacher {teacher!r} in version {view.snapshot_id} holds "
            "entries for completion tokens only (built with --train-on completion); rebuild with "
            "build --train-on prompt+completion, or train on the completion"
        )


# -- assembling a batch -----------------------------------------------------------------------------------


@dataclass
class Layout:
    """Where the readable pieces go in the [B * L] batch."""

    flat: np.ndarray  # start of each readable piece in the flat [B * L] batch
    n: np.ndarray  # its length
    tokens: np.ndarray  # flat indices of all their tokens
    positions: np.ndarray  # flat indices of the supervised tokens (all but each piece's last)
    position_ids: np.ndarray  # [B * L]
    document_ids: np.ndarray  # [B * L]


def layout(pieces: Pieces, ok: np.ndarray, *, micro_batch: int, seq_len: int) -> Layout:
    B, L = micro_batch, seq_len
    lengths = pieces.b - pieces.a
    row_of = pieces.flat // L
    document = np.arange(len(lengths)) - np.searchsorted(row_of, row_of, side="left")
    position_ids = np.zeros(B * L, dtype=np.int64)
    document_ids = np.full(B * L, -1, dtype=np.int64)
    flat, n = pieces.flat[ok], lengths[ok]
    tokens = ranges(flat, n)
    position_ids[tokens] = tokens - np.repeat(flat, n)
    document_ids[tokens] = np.repeat(document[ok], n)
    positions = ranges(flat, n - 1)  # all but each piece's last token: the decoded positions' order
    return Layout(
        flat=flat, n=n, tokens=tokens, positions=positions, position_ids=position_ids, document_ids=document_ids
    )


class _RowTensors(TypedDict):
    """The [B, L] tensors of a `PackedBatch`, shared by the two ways `assemble` ends."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor


def assemble(
    pieces: Pieces,
    ok: np.ndarray,
    decoded,
    *,
    sample_ids: list[str],
    micro_batch: int,
    seq_len: int,
    sampled: bool,
    completion_only: bool = True,
) -> PackedBatch:
    """The batch of the readable pieces (`ok`), whose decoded samples are `decoded` in piece order. Chat
    data (`decoded.loss_mask`) with `completion_only` keeps the positions whose next token is completion."""
    B, L = micro_batch, seq_len
    lay = layout(pieces, ok, micro_batch=B, seq_len=L)
    input_ids = np.zeros(B * L, dtype=np.int64)
    empty_long, empty_float = torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float32)
    common = _RowTensors(
        input_ids=torch.from_numpy(input_ids.reshape(B, L)),
        position_ids=torch.from_numpy(lay.position_ids.reshape(B, L)),
        document_ids=torch.from_numpy(lay.document_ids.reshape(B, L)),
    )
    if decoded is None:  # every fragment was skipped: all padding, no targets
        return PackedBatch(
            **common,
            positions=empty_long,
            entry_ids=empty_long,
            entry_logprobs=empty_float,
            entry_pos=empty_long,
            tail=empty_float,
            target_ids=empty_long,
            target_logprobs=empty_float,
            entry_counts=empty_float if sampled else None,
            n_tokens=0,
        )
    input_ids[lay.tokens] = decoded.input_ids
    positions = lay.positions
    if completion_only and decoded.loss_mask is not None:
        keep = supervised_positions(decoded.loss_mask, lay.n)
        positions, decoded = positions[keep], _positions_only(decoded, keep)
    entry_pos = np.repeat(np.arange(len(positions), dtype=np.int64), decoded.n_entries)
    segments = [
        (sample_ids[r], int(a), int(f), int(m))
        for r, a, f, m in zip(pieces.row[ok].tolist(), pieces.a[ok].tolist(), lay.flat.tolist(), lay.n.tolist())
    ]
    counts = None if decoded.entry_counts is None else torch.from_numpy(decoded.entry_counts.astype(np.float32))
    return PackedBatch(
        **common,
        positions=torch.from_numpy(positions),
        entry_ids=torch.from_numpy(decoded.entry_ids.astype(np.int64)),
        entry_logprobs=torch.from_numpy(decoded.entry_logprobs),
        entry_pos=torch.from_numpy(entry_pos),
        tail=torch.from_numpy(decoded.tail.astype(np.float32)),
        target_ids=torch.from_numpy(input_ids[positions + 1]),
        target_logprobs=torch.from_numpy(decoded.target_logprobs),
        entry_counts=counts,
        n_tokens=int(lay.n.sum()),
        segments=segments,
    )


def _positions_only(decoded, keep: np.ndarray):
    """The decoded pieces' per-position and per-entry arrays at the kept positions only."""
    entries = np.repeat(keep, decoded.n_entries)
    counts = None if decoded.entry_counts is None else decoded.entry_counts[entries]
    return dataclasses.replace(
        decoded,
        n_entries=decoded.n_entries[keep],
        tail=decoded.tail[keep],
        target_logprobs=decoded.target_logprobs[keep],
        entry_ids=decoded.entry_ids[entries],
        entry_logprobs=decoded.entry_logprobs[entries],
        entry_counts=counts,
    )


# -- the parts in memory ----------------------------------------------------------------------------------


class _Parts:
    """The parts a stream holds, read by a pool of threads; `want` starts reads, `get` waits for them."""

    def __init__(self, read, *, threads: int):
        self._read = read
        self._threads = threads
        self._futures: dict[int, Future] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.reads = 0  # parts read (or being read): how often each part was fetched, for tests and benchmarks
        self.peak = 0  # the most parts held (read, or being read) at once: what the memory budget bounds

    def want(self, codes) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="logitstore-read")
        for code in codes:
            if code not in self._futures:
                self._futures[code] = self._pool.submit(self._read, code)
                self.reads += 1
        self.peak = max(self.peak, len(self._futures))

    def keep_only(self, codes: set[int]) -> None:
        for code in [c for c in self._futures if c not in codes]:
            self._futures.pop(code).cancel()

    def get(self, codes) -> dict[int, object]:
        self.want(codes)
        out = {}
        for code in codes:
            try:
                out[code] = self._futures[code].result()
            except BaseException:
                self._futures.pop(code, None)  # a later attempt (a resumed iteration) reads it again
                raise
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._futures.clear()


# -- the engine ---------------------------------------------------------------------------------------------


class Stream(torch.utils.data.IterableDataset):
    """Packed micro-batches of one rank from a source. See the module docstring for the contract. Use as
    an iterable; `state_dict`/`load_state_dict` resume mid-epoch; `close()` (or `with`) when done. An
    `IterableDataset`, so `DataLoader(stream, batch_size=None, num_workers=W, multiprocessing_context=
    "spawn")` decodes in W processes and yields the same batches in the same order."""

    def __init__(
        self,
        source: Source,
        *,
        seq_len: int,
        micro_batch: int,
        rank: int,
        world_size: int,
        seed: int,
        split: str = "train",
        prefetch: int = 4,
        on_error: str = "raise",
        memory_budget: int | str | None = None,
        read_threads: int = READ_THREADS,
    ):
        _check_arguments(
            seq_len=seq_len,
            micro_batch=micro_batch,
            rank=rank,
            world_size=world_size,
            split=split,
            prefetch=prefetch,
            on_error=on_error,
        )
        self.source, self.table = source, source.table
        self.seq_len, self.micro_batch, self.rank, self.world_size = seq_len, micro_batch, rank, world_size
        self.seed, self.split, self.prefetch, self.on_error = seed, split, prefetch, on_error
        self.n_samples = len(self.table.sample_ids)
        tokens, block = int(self.table.n_tokens.sum()), world_size * micro_batch
        if split == "eval":  # every token counts once: a padded last row and a padded last step
            self.rows_per_epoch = -(-tokens // seq_len)
            self.steps_per_epoch = -(-self.rows_per_epoch // block)
        else:
            self.rows_per_epoch = tokens // seq_len
            self.steps_per_epoch = self.rows_per_epoch // block
        self._check_size()
        self.memory_budget = parse_bytes(
            memory_budget if memory_budget is not None else DEFAULT_MEMORY_BUDGET,
            name="memory budget (--memory-budget)",
        )
        part_bytes = source.part_bytes()
        self.window_parts = (
            None if part_bytes is None else _window_parts(part_bytes, self.memory_budget, where=self._where)
        )
        self._parts = None if part_bytes is None else _Parts(source.read_part, threads=read_threads)
        self._plans: dict[int, EpochPlan] = {}
        self._held: tuple | None = None  # (epoch, window) whose parts the stream holds now
        self._epoch, self._rows = 0, 0  # the consumer's position: what has been yielded
        self._generation = 0
        self._worker: Generator | None = None  # the prefetch thread's iterator (`read_ahead`)
        self.wait_seconds = 0.0
        self.skipped_ids: set[str] = set()
        self._recipe: dict | None = None  # how `store_stream` made it: what a worker process rebuilds it from

    @property
    def _where(self) -> str:
        return getattr(self.source, "where", f"the {self.split} split")

    @property
    def skipped_samples(self) -> int:
        """Distinct samples skipped as unreadable (on_error="skip")."""
        return len(self.skipped_ids)

    @property
    def part_reads(self) -> int:
        """Parts fetched from storage so far (each read whole, or its split's ranges)."""
        return 0 if self._parts is None else self._parts.reads

    @property
    def peak_parts_held(self) -> int:
        """The most parts held in memory at once so far (read, or being read)."""
        return 0 if self._parts is None else self._parts.peak

    def _check_size(self) -> None:
        if self.n_samples == 0:
            hint = "; raise --eval-fraction to hold some out" if self.split == "eval" else ""
            raise StreamConfigError(f"{self._where} holds no samples{hint}")
        if self.steps_per_epoch == 0:
            raise StreamConfigError(
                f"{self._where} packs into {self.rows_per_epoch} rows of {self.seq_len} tokens, fewer than one "
                f"micro-batch of {self.micro_batch} rows for each of {self.world_size} ranks; lower seq_len or micro_batch"
            )

    # -- state ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Where the consumer is: global rows consumed in the epoch by all ranks together."""
        return {
            "epoch": self._epoch,
            "rows_consumed": self._rows,
            "seed": self.seed,
            "version": self.source.version,
            "window_parts": self._effective_window(),
        }

    def _effective_window(self) -> int | None:
        """`window_parts`, or None for the global shuffle (one window): what the order depends on."""
        if self.window_parts is None or self.window_parts >= len(self.table.parts):
            return None
        return self.window_parts

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (any world size). Stops a running prefetch; the next `iter()` resumes."""
        if state.get("version") != self.source.version:
            raise StreamConfigError(
                f"the data state is from store version {state.get('version')}, "
                f"this stream reads {self.source.version}; resume on the same version"
            )
        if state.get("seed") != self.seed:
            raise StreamConfigError(
                f"the data state is from seed {state.get('seed')}, this stream has seed {self.seed}"
            )
        if state.get("window_parts") != self._effective_window():
            show = lambda w: "one window (the global shuffle)" if w is None else f"windows of {w} parts"
            raise StreamConfigError(
                f"the data state was taken with {show(state.get('window_parts'))}, this stream "
                f"shuffles in {show(self._effective_window())} (its memory budget, "
                f"{format_bytes(self.memory_budget)}); resume with the same --memory-budget"
            )
        epoch, rows = int(state["epoch"]), int(state["rows_consumed"])
        if epoch < 0 or not 0 <= rows <= self.rows_per_epoch:
            raise StreamConfigError(
                f"the data state (epoch {epoch}, row {rows}) is outside this stream's "
                f"{self.rows_per_epoch} rows per epoch"
            )
        self._stop_worker()
        self._generation += 1  # an iterator from before the load must not move the restored position
        self._epoch, self._rows = epoch, rows

    # -- iteration -----------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[PackedBatch]:
        self._stop_worker()
        self._generation += 1
        generation = self._generation
        batches = self._inline() if self.prefetch == 0 else self._prefetched()
        try:
            for batch, epoch, rows in batches:
                if generation != self._generation:  # superseded by a newer iter() or a load_state_dict
                    return
                self._epoch, self._rows = epoch, rows
                batch.data_state = self.state_dict()
                yield batch
            if self.split == "eval" and generation == self._generation:
                self._epoch, self._rows = 0, 0  # the pass is over: the next iter() is a full pass again
        finally:
            if generation == self._generation:
                self._stop_worker()

    def _schedule(self, epoch: int, rows: int) -> Iterator[tuple[int, int, int]]:
        """(epoch, first global row of this rank's micro-batch, rows consumed after the step); in a
        DataLoader worker, only its share of the steps (`_worker_slice`)."""
        block = self.world_size * self.micro_batch
        worker, workers = self._worker_slice()
        step = 0
        while True:
            if self.split == "eval":  # one pass; the last step may run past the end (padding rows)
                if rows >= self.rows_per_epoch:
                    return
            elif rows + block > self.rows_per_epoch:
                epoch, rows = epoch + 1, 0
                continue
            after = min(rows + block, self.rows_per_epoch)
            if step % workers == worker:
                yield epoch, rows + self.rank * self.micro_batch, after
            rows = after
            step += 1

    def _inline(self) -> Iterator[tuple[PackedBatch, int, int]]:
        return self._batches(self._epoch, self._rows)

    def _batches(self, epoch: int, rows: int) -> Iterator[tuple[PackedBatch, int, int]]:
        for step_epoch, row0, after in self._schedule(epoch, rows):
            yield self._build(step_epoch, row0), step_epoch, after

    def _prefetched(self) -> Iterator[tuple[PackedBatch, int, int]]:
        ahead = read_ahead(self._batches(self._epoch, self._rows), depth=self.prefetch, name="logitstore-prefetch")
        self._worker = ahead  # `_stop_worker` closes it; a closed one yields nothing more
        while True:
            started = time.perf_counter()
            item = next(ahead, None)  # items are tuples: None is the end
            self.wait_seconds += time.perf_counter() - started
            if item is None:
                return
            yield item

    def _stop_worker(self) -> None:
        if self._worker is not None:
            self._worker.close()  # stops the thread and waits for the batch it is building
            self._worker = None

    def close(self) -> None:
        """Stop the prefetch thread and the readers, and drop the parts held. The stream can be iterated
        again afterwards (it reads again what it needs)."""
        self._stop_worker()
        if self._parts is not None:
            self._parts.close()
        self._held = None

    def __enter__(self) -> Stream:
        return self

    # -- DataLoader worker processes -------------------------------------------------------------------

    def __reduce__(self):
        # A stream crosses into a DataLoader worker (spawned: Icechunk must never be forked) as the recipe
        # it was made from, at its current position; the worker opens the version itself.
        if self._recipe is None:
            raise StreamConfigError(
                f"a stream of {self._where} cannot be sent to another process; only a "
                "store stream (logitstore.stream) can, for DataLoader workers"
            )
        return _stream_from_recipe, (self._recipe, self.state_dict())

    def _worker_slice(self) -> tuple[int, int]:
        """(this DataLoader worker, workers): worker w of W yields the steps w, w + W, ... counted from
        where the iteration starts, so a DataLoader (in order) yields the same batches as one process."""
        info = torch.utils.data.get_worker_info()
        return (0, 1) if info is None else (info.id, info.num_workers)

    def __exit__(self, *exc) -> None:
        self.close()

    # -- building a batch ------------------------------------------------------------------------------

    def _plan(self, epoch: int) -> EpochPlan:
        if epoch not in self._plans:
            if len(self._plans) >= 2:  # the current epoch and the next are all a stream needs
                self._plans.pop(min(self._plans))
            self._plans[epoch] = EpochPlan(
                self.table, seed=self.seed, epoch=epoch, seq_len=self.seq_len, window_parts=self.window_parts
            )
        return self._plans[epoch]

    def _build(self, epoch: int, row0: int) -> PackedBatch:
        plan = self._plan(epoch)
        pieces = plan.pieces(row0, row0 + self.micro_batch)
        parts = {}
        if self._parts is not None:
            if not len(pieces.row):  # rows past the end of the eval pass: padding only
                pass
            elif plan.n_windows > 1:  # read a window and the next whole, in order; nothing beyond (the budget)
                self._hold_windows(epoch, plan, window=int(pieces.window[0]))
            else:  # one window: read what the next batches need first; everything read stays
                self._parts.want(self._upcoming_parts(plan, row0))
            parts = self._parts.get(np.unique(self.table.part[pieces.row]).tolist())
        return self.source.build(pieces, parts, stream=self)

    def _upcoming_parts(self, plan: EpochPlan, row0: int) -> list[int]:
        """The parts this rank's next `LOOKAHEAD_BATCHES` micro-batches of the epoch touch, in order:
        what to read next while this batch is decoded (with one window, everything stays once read)."""
        step = self.world_size * self.micro_batch
        stop_row = min(row0 + LOOKAHEAD_BATCHES * step, self.rows_per_epoch)
        spans = [(r * self.seq_len, (r + self.micro_batch) * self.seq_len) for r in range(row0, stop_row, step)]
        if not spans:
            return []
        starts = np.searchsorted(plan.ends, [a for a, _ in spans], side="right")
        stops = np.searchsorted(plan.begins, [b for _, b in spans], side="left")
        sequence = plan.part_sequence[ranges(starts, stops - starts)]
        _, first = np.unique(sequence, return_index=True)
        return sequence[np.sort(first)].tolist()

    def _hold_windows(self, epoch: int, plan: EpochPlan, *, window: int) -> None:
        """Keep the parts of this window and the next (reading them ahead, in the order the epoch needs
        them); let go of the ones before. In memory: two windows at most, the budget."""
        if self._held == (epoch, window):
            return
        self._held = (epoch, window)
        here = plan.parts_of_window(window)
        if window + 1 < plan.n_windows:
            after = plan.parts_of_window(window + 1)
        elif self.split == "train":  # the next epoch's first window
            after = self._plan(epoch + 1).parts_of_window(0)
        else:
            after = np.zeros(0, dtype=np.int64)
        wanted = np.concatenate([here, after]).tolist()
        assert self._parts is not None  # windows are held only for a source with parts (`_build`)
        self._parts.keep_only(set(wanted))
        self._parts.want(wanted)

    def unreadable(self, row: int, error: Exception, *, part: str | None = None) -> None:
        """A sample that cannot be used: raise, or (on_error="skip") count it and go on."""
        if isinstance(error, StorageError):  # an outage is never a damaged sample to skip
            raise error
        sample_id = self.table.sample_ids[row]
        if self.on_error == "skip":
            self.skipped_ids.add(sample_id)
            return
        cause = str(error).splitlines()[0] if str(error) else type(error).__name__
        where = f" (part {part})" if part else ""
        raise DamagedDataError(
            f"cannot read sample {sample_id!r}{where} of {self._where}: {cause} (--on-error skip trains without it)"
        ) from error


def _window_parts(part_bytes: np.ndarray, budget: int, *, where: str) -> int:
    """Parts per window: all of them when the split fits the budget (the global shuffle), else as many
    as two windows of the largest part fit."""
    if int(part_bytes.sum()) <= budget:
        return len(part_bytes)
    largest = int(part_bytes.max())
    if 2 * largest > budget:
        raise StreamConfigError(
            f"memory budget {format_bytes(budget)} is smaller than two parts of {where} "
            f"({format_bytes(2 * largest)}: the part being read and the next); raise "
            f"--memory-budget to at least {format_bytes(2 * largest)}"
        )
    return budget // (2 * largest)


def _check_arguments(
    *, seq_len: int, micro_batch: int, rank: int, world_size: int, split: str, prefetch: int, on_error: str
) -> None:
    if seq_len < 2:
        raise StreamConfigError(f"seq_len must be at least 2 (a token and the one it predicts), got {seq_len}")
    if micro_batch < 1:
        raise StreamConfigError(f"micro_batch must be at least 1, got {micro_batch}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise StreamConfigError(f"rank {rank} is outside world size {world_size}")
    if split not in SPLITS:
        raise StreamConfigError(f"split must be one of {SPLITS}, got {split!r}")
    if prefetch < 0:
        raise StreamConfigError(f"prefetch must be >= 0, got {prefetch}")
    if on_error not in ON_ERROR:
        raise StreamConfigError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")


def check_eval_fraction(eval_fraction: float) -> None:
    if not 0 <= eval_fraction <= 1:
        raise StreamConfigError(f"eval_fraction must be in [0, 1], got {eval_fraction}")


# -- building streams ---------------------------------------------------------------------------------------


def store_stream(
    view: StoreVersion,
    *,
    teacher: str | None = None,
    sources: list | None = None,
    seq_len: int,
    micro_batch: int,
    rank: int,
    world_size: int,
    seed: int,
    split: str = "train",
    eval_fraction: float = 0.05,
    prefetch: int = 4,
    on_error: str = "raise",
    memory_budget: int | str | None = None,
    read_threads: int = READ_THREADS,
    train_on: str = "completion",
) -> Stream:
    """The stream of a store version: one teacher (`teacher`, or the version's only one), or several or
    cross-tokenizer teachers (`sources`, `trainer/mixing.py`). `train_on` (chat data, `logitstore.chat`):
    supervise the completion only, or prompt+completion."""
    check_eval_fraction(eval_fraction)
    if split not in SPLITS:
        raise StreamConfigError(f"split must be one of {SPLITS}, got {split!r}")
    source: Source
    if sources is not None and (len(sources) > 1 or sources[0].cross):
        from logitstore.trainer.mixing import MixedSource  # here: mixing imports this module

        source = MixedSource(view, sources=sources, split=split, eval_fraction=eval_fraction, train_on=train_on)
    else:
        name = sources[0].name if sources else teacher
        source = StoreSource(view, teacher=name, split=split, eval_fraction=eval_fraction, train_on=train_on)
    stream = Stream(
        source,
        seq_len=seq_len,
        micro_batch=micro_batch,
        rank=rank,
        world_size=world_size,
        seed=seed,
        split=split,
        prefetch=prefetch,
        on_error=on_error,
        memory_budget=memory_budget,
        read_threads=read_threads,
    )
    if sources is None and view.store.location.uri.split("://")[0] != "memory":
        stream._recipe = {
            "uri": view.store.location.uri,
            "snapshot": view.snapshot_id,
            "kwargs": dict(
                teacher=teacher,
                seq_len=seq_len,
                micro_batch=micro_batch,
                rank=rank,
                world_size=world_size,
                seed=seed,
                split=split,
                eval_fraction=eval_fraction,
                prefetch=prefetch,
                on_error=on_error,
                memory_budget=memory_budget,
                read_threads=read_threads,
                train_on=train_on,
            ),
        }
    return stream


def _stream_from_recipe(recipe: dict, state: dict) -> Stream:
    """The stream `store_stream` made from `recipe`, at `state`: how a stream arrives in another process."""
    view = Store.open(recipe["uri"]).read(recipe["snapshot"])
    stream = store_stream(view, **recipe["kwargs"])
    stream.load_state_dict(state)
    return stream
