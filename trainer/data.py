"""The trainer's data pipeline: a pinned store version -> packed, fixed-length micro-batches with the
teacher's sparse targets. Deterministic, sharded across ranks, resumable mid-epoch.

The contract (tests/test_train_data.py holds the stream to it):

- **Split.** A sample is in the eval split iff `is_eval_sample(id, eval_fraction=f)`: the first 8 bytes
  of blake2b(id) read as a big-endian integer, as a fraction of 2**64, is below f. It depends on the id
  alone, so train and eval are disjoint and stable across runs, machines, versions and world sizes.
  Only the rows of one teacher are used (`teacher`, or the version's only teacher).
- **Epoch order.** The split's samples sorted by sample id (Arrow's byte order, as the index stores
  them) and permuted by `numpy.random.default_rng([seed, epoch]).permutation(n)`. The order depends on
  the version, the seed and the epoch only.
- **Packing.** The shuffled samples are laid end to end and cut into rows of exactly `seq_len` tokens,
  which is the same as greedy filling: a sample that does not fit in the rest of a row is cut there and
  its remainder starts the next row as a new *fragment*. Row j of an epoch is tokens
  [j*seq_len, (j+1)*seq_len) of that concatenation, so any row is found without reading data; the last
  partial row of the epoch is dropped. Position ids restart at 0 at every sample or fragment start;
  document ids number the segments of a row 0, 1, ... Token t of a row is *supervised* (it carries the
  teacher's distribution over token t+1) iff tokens t and t+1 lie in the same row and the same sample:
  a cut loses exactly one transition (the one across the row boundary), and the last token of every
  sample has no target anyway.
- **Sharding.** Rows are global. Each step consumes `world_size * micro_batch` consecutive global rows;
  rank r takes the r-th block of `micro_batch` of them, so micro-batch i of rank r is global rows
  (i*world_size + r)*micro_batch ... + micro_batch. `steps_per_epoch = rows_per_epoch //
  (world_size*micro_batch)` is the same on every rank (no collective waits on a rank that ran dry); the
  leftover rows of the epoch are dropped.
- **State.** `state_dict()` = {"epoch", "rows_consumed", "seed", "version"}: global rows consumed in the
  epoch by all ranks together, counted at the batches *yielded* (not the ones prefetched). It does not
  depend on the world size, so a run resumed with another world size continues at the same row (its
  remaining steps in that epoch are `(rows_per_epoch - rows_consumed) // (world_size*micro_batch)`).
  `load_state_dict` refuses a state from another store version or seed.
- **Iteration.** The train split is infinite over epochs. The eval split is one pass of epoch 0: each
  `iter()` yields from the current position to the end of the pass and then rewinds to the start.
- **Reading.** The whole store is never loaded at once. Per micro-batch, the pieces (sample fragments)
  are grouped by part; each part's arrays are read with one Zarr slice per run of nearby pieces (runs
  closer than `MERGE_GAP` elements are merged), only the fragment's own entries are fetched, parts are
  read concurrently, and the whole batch is decoded with one `codec.decode` call. Nothing loops per
  token or per entry in Python. Exception: a teacher whose encoded arrays (before zstd, estimated from
  the index) fit in `cache_bytes` (default 512 MiB) has each part read whole on first use and kept in
  memory, so a small store costs one read per array and part for the whole run; with shuffled samples
  a bounded part cache over a larger store would rarely hit, so there is no eviction mode.
- **Prefetch.** A background thread keeps up to `prefetch` micro-batches ready; its exceptions are
  re-raised in the consumer; `close()` stops it. `wait_seconds` is the consumer's cumulative time waiting
  on the queue. `prefetch=0` builds batches in the consumer's thread.
- **Damaged data.** A sample whose arrays fail to read (a Zarr chunk failing its CRC32C, an index range
  outside the stored arrays, entry counts that disagree with the index, codes or token ids outside the
  vocabulary) raises `DamagedDataError` naming the sample id. With `on_error="skip"` its fragment becomes
  padding instead (document id -1, no targets, not counted in `n_tokens`), so the row sequence and the
  step count stay the same on every rank; `skipped_samples` counts distinct skipped ids.
- **Outages.** A store that cannot be reached, or stops answering (`StorageLimits`), is not damage:
  every read raises `StorageError` and stops the stream whatever `on_error` says, so a run never trains
  on a store with holes punched by a network failure; it resumes from its last checkpoint.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from logitstore import codec
from logitstore.codec import EncodedSamples
from logitstore.errors import DamagedDataError, LogitstoreError, StorageError
from logitstore.store import StoreVersion, read_errors

SPLITS = ("train", "eval")
ON_ERROR = ("raise", "skip")
# Read through a gap of at most this many elements rather than issue another request: on object
# storage a request costs more than a few KB of extra bytes.
MERGE_GAP = 4096
# A teacher whose encoded arrays (before zstd) fit in this many bytes is read part by part, whole, and
# kept in memory: a small store then costs one read per array and part for the whole run.
DEFAULT_CACHE_BYTES = 512 << 20
READ_THREADS = 8  # parts read concurrently per micro-batch (matters on S3, harmless locally)
_PUT_POLL_SECONDS = 0.1


class StreamConfigError(LogitstoreError, ValueError):
    """A stream that cannot be built as asked: a bad argument, an empty or too small split, or a
    state from another run. Both a `LogitstoreError` (the CLI prints one line) and a `ValueError`."""


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
    # Runs with several teachers or a cross-tokenizer teacher (`trainer/teachers.py`): per teacher,
    # (name, SparseTargets | AlignedTargets) over the same P positions, and counts for the metrics.
    # The single-teacher fields above then hold no entries.
    signals: list | None = None
    signal_counts: dict | None = None

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
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            moved[f.name] = value.to(device, non_blocking=non_blocking) if isinstance(value, torch.Tensor) else value
        return PackedBatch(**moved)


# -- the samples of a split --------------------------------------------------------------------------


@dataclass
class _SplitTable:
    """One teacher's index rows for one split, sorted by sample id, as numpy columns."""

    sample_ids: list[str]
    parts: list[str]
    part: np.ndarray  # int64 index into `parts`
    n_tokens: np.ndarray
    token_start: np.ndarray
    position_start: np.ndarray
    entry_start: np.ndarray
    n_entries: np.ndarray


def split_index(view: StoreVersion, *, teacher: str, split: str, eval_fraction: float) -> pa.Table:
    """The index rows of one teacher in one split, sorted by sample id."""
    idx = view.index.filter(pc.equal(view.index["teacher"], teacher)).sort_by("sample_id")
    in_eval = [is_eval_sample(s, eval_fraction=eval_fraction) for s in idx["sample_id"].to_pylist()]
    return idx.filter(pa.array([e == (split == "eval") for e in in_eval], type=pa.bool_()))


def _split_table(view: StoreVersion, *, teacher: str, split: str, eval_fraction: float) -> _SplitTable:
    idx = split_index(view, teacher=teacher, split=split, eval_fraction=eval_fraction)
    parts, part_codes = np.unique(np.asarray(idx["part"].to_pylist(), dtype=str), return_inverse=True)
    column = lambda name: idx[name].to_numpy().astype(np.int64)
    return _SplitTable(
        sample_ids=idx["sample_id"].to_pylist(), parts=[str(p) for p in parts],
        part=np.asarray(part_codes, dtype=np.int64).reshape(-1),
        n_tokens=column("n_tokens"), token_start=column("token_start"), position_start=column("position_start"),
        entry_start=column("entry_start"), n_entries=column("n_entries"),
    )


# -- packing -----------------------------------------------------------------------------------------


@dataclass
class _Pieces:
    """Fragments covering a span of rows, in row-major order: sample `row` (into the split table),
    its tokens [a, b), starting at `flat` within the span."""

    row: np.ndarray
    a: np.ndarray
    b: np.ndarray
    flat: np.ndarray


class _EpochPlan:
    """The packed token stream of one epoch; cuts any span of rows into pieces without reading data."""

    def __init__(self, n_tokens: np.ndarray, *, seed: int, epoch: int, seq_len: int):
        self.order = np.random.default_rng([seed, epoch]).permutation(len(n_tokens))
        lengths = n_tokens[self.order]
        self.ends = np.cumsum(lengths)
        self.begins = self.ends - lengths
        self.seq_len = seq_len

    def pieces(self, row0: int, row1: int) -> _Pieces:
        start, stop = row0 * self.seq_len, row1 * self.seq_len
        first = np.searchsorted(self.ends, start, side="right")
        last = np.searchsorted(self.begins, stop, side="left")
        # Every sample boundary and every row boundary inside the span starts a new piece.
        cuts = np.concatenate([self.begins[first:last], self.ends[first:last],
                               np.arange(start, stop + 1, self.seq_len)])
        cuts = np.unique(cuts[(cuts >= start) & (cuts <= stop)])
        k = np.searchsorted(self.ends, cuts[:-1], side="right")
        return _Pieces(row=self.order[k], a=cuts[:-1] - self.begins[k], b=cuts[1:] - self.begins[k],
                       flat=cuts[:-1] - start)


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n), without a Python loop."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(np.asarray(starts, dtype=np.int64) - offsets, lengths) + np.arange(total, dtype=np.int64)


# -- reading -----------------------------------------------------------------------------------------


# Errors that mean a bug in this module, never damaged data: they keep their traceback.
_BUGS = (TypeError, AttributeError, NameError, AssertionError, ImportError)


class _Damaged(DamagedDataError):
    """Stored arrays that read without error but contradict the index or the vocabulary."""


def _gather(array, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The elements [starts[i], stops[i]) of a 1-D Zarr array, concatenated in request order, and the
    [n + 1] offsets of each request in the result. One read per run of nearby requests."""
    lengths = stops - starts
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    order = np.argsort(starts, kind="stable")
    runs: list[list[int]] = []
    for s, e in zip(starts[order].tolist(), stops[order].tolist()):  # one iteration per piece
        if runs and s <= runs[-1][1] + MERGE_GAP:
            runs[-1][1] = max(runs[-1][1], e)
        else:
            runs.append([s, e])
    chunks = []
    for s, e in runs:
        values = array[s:e] if e > s else np.zeros(0, dtype=array.dtype)
        if len(values) != e - s:  # Zarr clamps slices silently: an index beyond the stored array
            raise _Damaged(f"index range [{s}, {e}) lies outside the stored array of {array.shape[0]}")
        chunks.append(values)
    if not runs:
        return np.zeros(0, dtype=array.dtype), offsets
    run_starts = np.array([s for s, _ in runs], dtype=np.int64)
    run_offsets = np.cumsum([0] + [e - s for s, e in runs])
    which = np.searchsorted(run_starts, starts, side="right") - 1  # the run holding each request
    at = run_offsets[which] + starts - run_starts[which]
    return np.concatenate(chunks)[_ranges(at, lengths)], offsets


def _encoded_bytes(view: StoreVersion, *, teacher: str, sampled: bool) -> int:
    """Bytes of the teacher's encoded arrays in memory (before zstd), from the index alone."""
    rows = view.index.filter(pc.equal(view.index["teacher"], teacher))
    tokens = int(pc.sum(rows["n_tokens"]).as_py() or 0)
    positions = tokens - rows.num_rows
    entries = int(pc.sum(rows["n_entries"]).as_py() or 0)
    id_bytes = codec.id_dtype(view.teachers[teacher].vocab_size).itemsize
    return tokens * id_bytes + positions * 6 + entries * (id_bytes + 2 + (2 if sampled else 0))


class _Reader:
    """Reads pieces of one teacher's samples part by part and returns their `EncodedSamples`.

    Two modes, chosen once: when the teacher's encoded arrays fit in `cache_bytes`, each part is read
    whole on first use and kept (later epochs read nothing); otherwise every batch slices just its
    pieces out of the Zarr arrays, since with shuffled samples a part cache would rarely hit."""

    def __init__(self, view: StoreVersion, *, teacher: str, table: _SplitTable, cache_bytes: int):
        meta = view.teachers[teacher]
        self.view, self.teacher, self.table = view, teacher, table
        self.vocab_size = meta.vocab_size
        sampled = meta.sparsity["mode"] == "sampled"
        self.entry_names = ("entry_codes", "entry_logprobs") + (("entry_counts",) if sampled else ())
        self.cache_whole = _encoded_bytes(view, teacher=teacher, sampled=sampled) <= cache_bytes
        self._arrays: dict[tuple[str, str], object] = {}
        self._sliced: set[str] = set()  # parts that failed to read whole: sliced, to isolate the damage
        self._lock = threading.Lock()
        self._part_locks: dict[str, threading.Lock] = {}
        self._pool: ThreadPoolExecutor | None = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def read(self, pieces: _Pieces) -> list[EncodedSamples | Exception]:
        """Per piece, in order: its encoded arrays, or the exception that made it unreadable."""
        part_of = self.table.part[pieces.row]
        codes = np.unique(part_of)
        groups = [np.flatnonzero(part_of == p) for p in codes]
        if len(groups) > 1 and self._reads_storage(codes):
            if self._pool is None:
                self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="logitstore-read")
            results = list(self._pool.map(lambda g: self._read_part_safely(pieces, g), groups))
        else:
            results = [self._read_part_safely(pieces, g) for g in groups]
        out: list = [None] * len(pieces.row)
        for group, encoded in zip(groups, results):
            for i, enc in zip(group.tolist(), encoded):
                out[i] = enc
        return out

    def _reads_storage(self, part_codes: np.ndarray) -> bool:
        """Whether reading these parts touches storage (worth threads) rather than the in-memory cache."""
        if not self.cache_whole:
            return True
        names = ("input_ids",) + self.entry_names
        return any((self.table.parts[c], "whole", n) not in self._arrays for c in part_codes.tolist() for n in names)

    def _read_part_safely(self, pieces: _Pieces, group: np.ndarray) -> list[EncodedSamples | Exception]:
        try:
            return self._read_classified(pieces, group)
        except (*_BUGS, StorageError):  # an outage stops the stream: it is never damage to skip
            raise
        except Exception:
            if len(group) == 1:
                return [self._read_one(pieces, group[0])]
            # Read the pieces one by one to name the damaged ones; the others stay usable.
            return [self._read_one(pieces, i) for i in group]

    def _read_one(self, pieces: _Pieces, i: int) -> EncodedSamples | Exception:
        try:
            return self._read_classified(pieces, np.array([i]))[0]
        except (*_BUGS, StorageError):
            raise
        except Exception as e:  # damaged data: the stream names the sample or skips it
            return e

    def _read_classified(self, pieces: _Pieces, group: np.ndarray) -> list[EncodedSamples]:
        """`_read_part` with failures sorted as the store's own reads sort them: `StorageError` for an
        outage, `DamagedDataError` for bytes that fail their checksum or do not decode."""
        part = self.table.parts[int(self.table.part[pieces.row[group[0]]])]
        with read_errors(f"part {part} of teacher {self.teacher!r}"):
            return self._read_part(pieces, group)

    def _array(self, part: str, name: str):
        """The part's array: a Zarr array to slice, or in cache mode the whole array in memory."""
        if not self.cache_whole or part in self._sliced:
            return self._zarr_array(part, name)
        with self._lock:
            part_lock = self._part_locks.setdefault(part, threading.Lock())
        with part_lock:  # one load per part; other parts load concurrently
            if (part, "whole", name) not in self._arrays:
                try:
                    self._arrays[(part, "whole", name)] = self._zarr_array(part, name)[:]
                except StorageError:  # an outage: the part is not damaged, and the stream stops anyway
                    raise
                except Exception:
                    self._sliced.add(part)
                    raise
            return self._arrays[(part, "whole", name)]

    def _zarr_array(self, part: str, name: str):
        with self._lock:  # opening reads Zarr metadata; once per array, not per read
            if (part, name) not in self._arrays:
                self._arrays[(part, name)] = self.view.array(self.teacher, part, name)
            return self._arrays[(part, name)]

    def _read_part(self, pieces: _Pieces, group: np.ndarray) -> list[EncodedSamples]:
        t = self.table
        rows, a, b = pieces.row[group], pieces.a[group], pieces.b[group]
        part = t.parts[int(t.part[rows[0]])]
        ts, ps, es = t.token_start[rows], t.position_start[rows], t.entry_start[rows]
        read = lambda name, starts, stops: _gather(self._array(part, name), starts, stops)
        tokens, tok_off = read("input_ids", ts + a, ts + b)
        tail, pos_off = read("tail", ps + a, ps + b - 1)
        target, _ = read("target_logprobs", ps + a, ps + b - 1)
        # Entry counts from the sample's first position: the fragment's entries start after them.
        counts, cnt_off = read("n_entries", ps, ps + b - 1)
        before = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        e0 = before[cnt_off[:-1] + a] - before[cnt_off[:-1]]
        e1 = before[cnt_off[:-1] + b - 1] - before[cnt_off[:-1]]
        whole = b == t.n_tokens[rows]
        if (e1 > t.n_entries[rows]).any() or (e1[whole] != t.n_entries[rows][whole]).any():
            raise _Damaged("stored entry counts disagree with the index")
        entries = {name: read(name, es + e0, es + e1) for name in self.entry_names}
        out = []
        for j in range(len(group)):  # one iteration per piece: slicing only
            c0 = cnt_off[j] + a[j]
            enc = EncodedSamples(
                input_ids=tokens[tok_off[j]:tok_off[j + 1]],
                n_entries=counts[c0:c0 + b[j] - 1 - a[j]],
                tail=tail[pos_off[j]:pos_off[j + 1]],
                target_logprobs=target[pos_off[j]:pos_off[j + 1]],
                **{name: values[off[j]:off[j + 1]] for name, (values, off) in entries.items()},
            )
            _check_ranges(enc, vocab_size=self.vocab_size)
            out.append(enc)
        return out


def _check_ranges(enc: EncodedSamples, *, vocab_size: int) -> None:
    """Token ids and entry codes inside the vocabulary: the decode kernel indexes without bounds checks."""
    if len(enc.input_ids) and int(enc.input_ids.max()) >= vocab_size:
        raise _Damaged("a stored token id lies outside the vocabulary")
    counts = enc.n_entries.astype(np.int64)
    deltas = enc.entry_codes.astype(np.int64)
    if int(counts.sum()) != len(deltas):
        raise _Damaged("stored entry counts disagree with the stored entries")
    if not len(deltas):
        return
    # Codes are running sums of non-negative gaps, so a position's largest code is its last one.
    running = np.cumsum(deltas)
    ends = np.cumsum(counts)[counts > 0] - 1
    starts = ends - counts[counts > 0] + 1
    if int((running[ends] - running[starts] + deltas[starts]).max()) >= vocab_size:
        raise _Damaged("a stored entry code lies outside the vocabulary")


# -- the stream --------------------------------------------------------------------------------------

_END = object()


@dataclass
class _Failure:
    error: BaseException


class PackedStream:
    """Packed micro-batches of one rank from a pinned store version. See the module docstring for the
    contract. Use as an iterable; `state_dict`/`load_state_dict` resume mid-epoch; `close()` when done."""

    def __init__(self, view: StoreVersion, *, teacher: str | None, seq_len: int, micro_batch: int, rank: int,
                 world_size: int, seed: int, split: str = "train", eval_fraction: float = 0.05,
                 prefetch: int = 4, on_error: str = "raise", cache_bytes: int = DEFAULT_CACHE_BYTES):
        _check_arguments(seq_len=seq_len, micro_batch=micro_batch, rank=rank, world_size=world_size, split=split,
                         eval_fraction=eval_fraction, prefetch=prefetch, on_error=on_error)
        self.view = view
        self.teacher = view.teacher_name(teacher)
        self.seq_len, self.micro_batch, self.rank, self.world_size = seq_len, micro_batch, rank, world_size
        self.seed, self.split, self.eval_fraction = seed, split, eval_fraction
        self.prefetch, self.on_error = prefetch, on_error
        self.table = _split_table(view, teacher=self.teacher, split=split, eval_fraction=eval_fraction)
        self.n_samples = len(self.table.sample_ids)
        self.rows_per_epoch = int(self.table.n_tokens.sum()) // seq_len
        self.steps_per_epoch = self.rows_per_epoch // (world_size * micro_batch)
        self._check_size()
        meta = view.teachers[self.teacher]
        self._params, self._id_of_code = meta.codec, view.id_of_code(self.teacher)  # here: not lazily in threads
        self._reader = _Reader(view, teacher=self.teacher, table=self.table, cache_bytes=cache_bytes)
        self._plans: dict[int, _EpochPlan] = {}
        self._epoch, self._rows = 0, 0  # the consumer's position: what has been yielded
        self._generation = 0
        self._worker: tuple[threading.Thread, threading.Event] | None = None
        self.wait_seconds = 0.0
        self.skipped_ids: set[str] = set()

    @property
    def skipped_samples(self) -> int:
        """Distinct samples skipped as unreadable (on_error="skip")."""
        return len(self.skipped_ids)

    def _check_size(self) -> None:
        what = f"the {self.split} split of teacher {self.teacher!r} in version {self.view.snapshot_id}"
        if self.n_samples == 0:
            raise StreamConfigError(f"{what} holds no samples (eval_fraction={self.eval_fraction})")
        if self.steps_per_epoch == 0:
            raise StreamConfigError(
                f"{what} packs into {self.rows_per_epoch} rows of {self.seq_len} tokens, fewer than one micro-batch "
                f"of {self.micro_batch} rows for each of {self.world_size} ranks; lower seq_len or micro_batch")

    # -- state ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Where the consumer is: global rows consumed in the epoch by all ranks together."""
        return {"epoch": self._epoch, "rows_consumed": self._rows, "seed": self.seed, "version": self.view.snapshot_id}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (any world size). Stops a running prefetch; the next `iter()` resumes."""
        if state.get("version") != self.view.snapshot_id:
            raise StreamConfigError(f"the data state is from store version {state.get('version')}, "
                                    f"this stream reads {self.view.snapshot_id}; resume on the same version")
        if state.get("seed") != self.seed:
            raise StreamConfigError(f"the data state is from seed {state.get('seed')}, this stream has seed {self.seed}")
        epoch, rows = int(state["epoch"]), int(state["rows_consumed"])
        if epoch < 0 or not 0 <= rows <= self.rows_per_epoch:
            raise StreamConfigError(f"the data state (epoch {epoch}, row {rows}) is outside this stream's "
                                    f"{self.rows_per_epoch} rows per epoch")
        self._stop_worker()
        self._generation += 1  # an iterator from before the load must not move the restored position
        self._epoch, self._rows = epoch, rows

    # -- iteration -----------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[PackedBatch]:
        self._stop_worker()
        self._generation += 1
        generation = self._generation
        source = self._inline() if self.prefetch == 0 else self._prefetched()
        try:
            for batch, epoch, rows in source:
                if generation != self._generation:  # superseded by a newer iter() or a load_state_dict
                    return
                self._epoch, self._rows = epoch, rows
                yield batch
            if self.split == "eval" and generation == self._generation:
                self._epoch, self._rows = 0, 0  # the pass is over: the next iter() is a full pass again
        finally:
            if generation == self._generation:
                self._stop_worker()

    def _schedule(self, epoch: int, rows: int) -> Iterator[tuple[int, int, int]]:
        """(epoch, first global row of this rank's micro-batch, rows consumed after the step)."""
        block = self.world_size * self.micro_batch
        while True:
            if rows + block > self.rows_per_epoch:
                if self.split == "eval":
                    return
                epoch, rows = epoch + 1, 0
                continue
            yield epoch, rows + self.rank * self.micro_batch, rows + block
            rows += block

    def _inline(self) -> Iterator[tuple[PackedBatch, int, int]]:
        for epoch, row0, after in self._schedule(self._epoch, self._rows):
            yield self._build(epoch, row0), epoch, after

    def _prefetched(self) -> Iterator[tuple[PackedBatch, int, int]]:
        items: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        thread = threading.Thread(target=self._produce, args=(items, stop, self._epoch, self._rows),
                                  name="logitstore-prefetch", daemon=True)
        self._worker = (thread, stop)
        thread.start()
        while True:
            started = time.perf_counter()
            item = items.get()
            self.wait_seconds += time.perf_counter() - started
            if item is _END:
                return
            if isinstance(item, _Failure):
                raise item.error
            yield item

    def _produce(self, items: queue.Queue, stop: threading.Event, epoch: int, rows: int) -> None:
        try:
            for epoch, row0, after in self._schedule(epoch, rows):
                if not _put(items, (self._build(epoch, row0), epoch, after), stop):
                    return
            _put(items, _END, stop)
        except BaseException as e:  # handed to the consumer, which re-raises it with its traceback
            _put(items, _Failure(e), stop)

    def _stop_worker(self) -> None:
        if self._worker is not None:
            thread, stop = self._worker
            stop.set()
            thread.join()
            self._worker = None

    def close(self) -> None:
        """Stop the prefetch thread and the read pool. The stream can be iterated again afterwards."""
        self._stop_worker()
        self._reader.close()

    def __enter__(self) -> PackedStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- building a batch ------------------------------------------------------------------------------

    def _plan(self, epoch: int) -> _EpochPlan:
        if epoch not in self._plans:
            if len(self._plans) >= 2:  # the current epoch and the next are all a stream needs
                self._plans.pop(min(self._plans))
            self._plans[epoch] = _EpochPlan(self.table.n_tokens, seed=self.seed, epoch=epoch, seq_len=self.seq_len)
        return self._plans[epoch]

    def _build(self, epoch: int, row0: int) -> PackedBatch:
        pieces = self._plan(epoch).pieces(row0, row0 + self.micro_batch)
        encoded = self._reader.read(pieces)
        ok = np.array([not isinstance(e, Exception) for e in encoded], dtype=bool)
        for i in np.flatnonzero(~ok):
            self._unreadable(int(pieces.row[i]), encoded[i])
        decoded = self._decode([e for e, good in zip(encoded, ok) if good], (pieces.b - pieces.a)[ok])
        return self._assemble(pieces, ok, decoded)

    def _unreadable(self, row: int, error: Exception) -> None:
        if isinstance(error, StorageError):  # an outage is never a damaged sample to skip
            raise error
        sample_id = self.table.sample_ids[row]
        if self.on_error == "skip":
            self.skipped_ids.add(sample_id)
            return
        part = self.table.parts[int(self.table.part[row])]
        cause = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise DamagedDataError(f"cannot read sample {sample_id!r} of teacher {self.teacher!r} (part {part}) in version "
                               f"{self.view.snapshot_id}: {cause} (--on-error skip trains without it)") from error

    def _decode(self, encoded: list[EncodedSamples], n_tokens: np.ndarray):
        """All pieces of the batch in one vectorised decode (each piece is a valid sample on its own:
        ids are delta-coded per position, so a run of positions decodes independently)."""
        names = ("input_ids", "n_entries", "entry_codes", "entry_logprobs", "tail", "target_logprobs", "entry_counts")
        if not encoded:
            return None
        joined = {}
        for name in names:
            values = [getattr(e, name) for e in encoded]
            joined[name] = None if values[0] is None else np.concatenate(values)
        return codec.decode(EncodedSamples(**joined), params=self._params, id_of_code=self._id_of_code,
                            n_tokens=n_tokens)

    def _layout(self, pieces: _Pieces, ok: np.ndarray) -> _Layout:
        """Where the readable pieces go in the [B * L] batch: their tokens, position and document ids."""
        B, L = self.micro_batch, self.seq_len
        lengths = pieces.b - pieces.a
        row_of = pieces.flat // L
        document = np.arange(len(lengths)) - np.searchsorted(row_of, row_of, side="left")
        position_ids = np.zeros(B * L, dtype=np.int64)
        document_ids = np.full(B * L, -1, dtype=np.int64)
        flat, n = pieces.flat[ok], lengths[ok]
        tokens = _ranges(flat, n)
        position_ids[tokens] = tokens - np.repeat(flat, n)
        document_ids[tokens] = np.repeat(document[ok], n)
        positions = _ranges(flat, n - 1)  # all but each piece's last token: the decoded positions' order
        return _Layout(flat=flat, n=n, tokens=tokens, positions=positions, position_ids=position_ids,
                       document_ids=document_ids)

    def _assemble(self, pieces: _Pieces, ok: np.ndarray, decoded) -> PackedBatch:
        B, L = self.micro_batch, self.seq_len
        lay = self._layout(pieces, ok)
        flat, n, tokens, positions = lay.flat, lay.n, lay.tokens, lay.positions
        position_ids, document_ids = lay.position_ids, lay.document_ids
        input_ids = np.zeros(B * L, dtype=np.int64)
        if decoded is None:
            return self._empty_targets(input_ids, position_ids, document_ids, B, L)
        input_ids[tokens] = decoded.input_ids
        entry_pos = np.repeat(np.arange(len(positions), dtype=np.int64), decoded.n_entries)
        segments = [(self.table.sample_ids[r], int(a), int(f), int(m))
                    for r, a, f, m in zip(pieces.row[ok], pieces.a[ok], flat, n)]
        counts = None if decoded.entry_counts is None else torch.from_numpy(decoded.entry_counts.astype(np.float32))
        return PackedBatch(
            input_ids=torch.from_numpy(input_ids.reshape(B, L)),
            position_ids=torch.from_numpy(position_ids.reshape(B, L)),
            document_ids=torch.from_numpy(document_ids.reshape(B, L)),
            positions=torch.from_numpy(positions),
            entry_ids=torch.from_numpy(decoded.entry_ids.astype(np.int64)),
            entry_logprobs=torch.from_numpy(decoded.entry_logprobs),
            entry_pos=torch.from_numpy(entry_pos),
            tail=torch.from_numpy(decoded.tail.astype(np.float32)),
            target_ids=torch.from_numpy(input_ids[positions + 1]),
            target_logprobs=torch.from_numpy(decoded.target_logprobs),
            entry_counts=counts,
            n_tokens=int(n.sum()),
            segments=segments,
        )

    def _empty_targets(self, input_ids, position_ids, document_ids, B: int, L: int) -> PackedBatch:
        """A batch whose every fragment was skipped: all padding, no targets."""
        sampled = "entry_counts" in self._reader.entry_names
        empty_long, empty_float = torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float32)
        return PackedBatch(
            input_ids=torch.from_numpy(input_ids.reshape(B, L)), position_ids=torch.from_numpy(position_ids.reshape(B, L)),
            document_ids=torch.from_numpy(document_ids.reshape(B, L)), positions=empty_long, entry_ids=empty_long,
            entry_logprobs=empty_float, entry_pos=empty_long, tail=empty_float, target_ids=empty_long,
            target_logprobs=empty_float, entry_counts=empty_float if sampled else None, n_tokens=0,
        )


@dataclass
class _Layout:
    flat: np.ndarray  # start of each readable piece in the flat [B * L] batch
    n: np.ndarray  # its length
    tokens: np.ndarray  # flat indices of all their tokens
    positions: np.ndarray  # flat indices of the supervised tokens (all but each piece's last)
    position_ids: np.ndarray  # [B * L]
    document_ids: np.ndarray  # [B * L]


def _put(items: queue.Queue, item, stop: threading.Event) -> bool:
    """Put unless the consumer asked to stop; False when it did."""
    while not stop.is_set():
        try:
            items.put(item, timeout=_PUT_POLL_SECONDS)
            return True
        except queue.Full:
            continue
    return False


def _check_arguments(*, seq_len: int, micro_batch: int, rank: int, world_size: int, split: str,
                     eval_fraction: float, prefetch: int, on_error: str) -> None:
    if seq_len < 2:
        raise StreamConfigError(f"seq_len must be at least 2 (a token and the one it predicts), got {seq_len}")
    if micro_batch < 1:
        raise StreamConfigError(f"micro_batch must be at least 1, got {micro_batch}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise StreamConfigError(f"rank {rank} is outside world size {world_size}")
    if split not in SPLITS:
        raise StreamConfigError(f"split must be one of {SPLITS}, got {split!r}")
    if not 0 <= eval_fraction <= 1:
        raise StreamConfigError(f"eval_fraction must be in [0, 1], got {eval_fraction}")
    if prefetch < 0:
        raise StreamConfigError(f"prefetch must be >= 0, got {prefetch}")
    if on_error not in ON_ERROR:
        raise StreamConfigError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
