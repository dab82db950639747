"""Reading a teacher's parts: `PartReader`, the reader beside `writer.PartWriter`.

A reader serves a set of a teacher's index rows (`TeacherRows`, e.g. one split of the samples) part
by part: `read(part)` holds the part's stored arrays in memory (`PartData`), and `samples(...)` cuts
token ranges of any rows out of the parts held and decodes them in one `codec.decode` call. Its
caller (the stream, `logitstore.streaming`) never names a path, an array or a Zarr internal.

- **Whole or ranges.** A part is read whole (`rawread.read_packed`: one request for a packed part;
  `rawread.read_whole`: two rounds of concurrent requests for one object per array) when the rows hold at least half of its bytes, else just the rows' element ranges (the eval split),
  nearby ranges merged into one request (`MERGE_GAP`).
- **Damage.** A part that fails to read whole (a chunk failing its CRC32C) is read sample by sample,
  so one bad chunk costs only its samples; every sample is then checked against the index and the
  vocabulary in vectorised passes (the decode kernel indexes without bounds checks), and against its
  content hash (`_hash_differs`: what no member table can show, such as two members' shards swapped).
  Unusable samples are listed in `PartData.damaged`, never raised: the caller decides (`--on-error`).
  An outage (`StorageError`) is never damage: it is raised.
- **Student tokens** (teachers with student tokenizers): the content hash covers every student
  tokenizer's ids and groups, so each part's are read with it (damage there is damage of the part's
  samples: no per-sample recovery); since store format 4 they are members of the part's packed object,
  read whole in the same request. A reader made for one student tokenizer hands its tokens on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import numba
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from zarr.core.sync import sync

from logitstore.errors import DamagedDataError, StorageError
from logitstore.format import codec, layout
from logitstore.format.codec import EncodedSamples
from logitstore.format.layout import read_values
from logitstore.format.samples import SparseSamples
from logitstore.format.zarr_codec import as_codes
from logitstore.storage import packed
from logitstore.storage.bounded import read_errors
from logitstore.storage.rawread import read_packed, read_whole
from logitstore.store.index import digests, digests_of, part_pieces, student_pieces
from logitstore.store.version import StoreVersion

# Read through a gap of at most this many elements rather than issue another request (sliced reads):
# on object storage a request costs more than a few KB of extra bytes.
MERGE_GAP = 4096
# Errors that mean a bug, never damaged data: they keep their traceback.
_BUGS = (TypeError, AttributeError, NameError, AssertionError, ImportError)
# The index's per-student list columns, taken at one student tokenizer's place.
_STUDENT_COLUMNS = ("student_start", "n_student_tokens", "group_start", "n_groups")


class _Damaged(DamagedDataError):
    """Stored arrays that read without error but contradict the index or the vocabulary."""


@dataclass
class TeacherRows:
    """Some of one teacher's index rows (sorted by sample id), as numpy columns."""

    sample_ids: list[str]
    part: np.ndarray  # int64 code into `parts`
    parts: list[str]
    n_tokens: np.ndarray
    token_start: np.ndarray
    position_start: np.ndarray
    entry_start: np.ndarray
    n_entries: np.ndarray
    content_hash: np.ndarray  # uint8 [n, 16]: each row's content hash (`index.digests_of`)
    # Every student tokenizer's columns (`_STUDENT_COLUMNS`), int64 [n, K] in the teacher's order: the
    # content hash covers their tokens. K is 0 for a teacher without student tokenizers.
    student_columns: dict[str, np.ndarray]
    # One student tokenizer's columns (`_STUDENT_COLUMNS`), for a reader of its student tokens.
    students: dict[str, np.ndarray] | None = None

    @classmethod
    def of(
        cls,
        view: StoreVersion,
        *,
        teacher: str,
        keep: Callable[[list[str]], np.ndarray] | None = None,
        student: str | None = None,
    ) -> TeacherRows:
        """The teacher's rows whose sample ids `keep` (a bool mask over ids sorted by id; default all),
        with the columns of `student`'s tokens when given."""
        idx = view.index.filter(pc.equal(view.index["teacher"], teacher)).sort_by("sample_id")
        if keep is not None:
            idx = idx.filter(pa.array(keep(idx["sample_id"].to_pylist()), type=pa.bool_()))
        parts, codes = np.unique(np.asarray(idx["part"].to_pylist(), dtype=str), return_inverse=True)
        column = lambda name: idx[name].to_numpy().astype(np.int64)
        names = view.teachers[teacher].student_names
        student_columns = {
            c: np.stack([pc.list_element(idx[c], k).to_numpy().astype(np.int64) for k in range(len(names))], axis=1)
            if names
            else np.zeros((idx.num_rows, 0), np.int64)
            for c in _STUDENT_COLUMNS
        }
        students = None
        if student is not None:
            k = names.index(student)
            students = {c: student_columns[c][:, k] for c in _STUDENT_COLUMNS}
        return cls(
            sample_ids=idx["sample_id"].to_pylist(),
            part=np.asarray(codes, dtype=np.int64).reshape(-1),
            parts=[str(p) for p in parts],
            n_tokens=column("n_tokens"),
            token_start=column("token_start"),
            position_start=column("position_start"),
            entry_start=column("entry_start"),
            n_entries=column("n_entries"),
            content_hash=digests_of(idx["content_hash"].to_pylist()),
            student_columns=student_columns,
            students=students,
        )

    def __post_init__(self) -> None:
        # Rows sorted by (part, place in it), and where each part's run starts: `in_part` in O(1).
        self._by_part = np.lexsort((self.token_start, self.part))
        self._part_start = np.concatenate([[0], np.cumsum(np.bincount(self.part, minlength=len(self.parts)))])

    def in_part(self, code: int) -> np.ndarray:
        """The rows held by part `code`, sorted by their place in the part."""
        return self._by_part[self._part_start[code] : self._part_start[code + 1]]

    def spans(self, rows: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per axis (`layout.AXIS`), the [start, stop) of each row's elements."""
        return layout.spans(
            token_start=self.token_start[rows],
            position_start=self.position_start[rows],
            entry_start=self.entry_start[rows],
            n_tokens=self.n_tokens[rows],
            n_entries=self.n_entries[rows],
        )


@dataclass
class PartData:
    """One part of one teacher in memory: its encoded arrays (all of it, or just some samples' ranges
    at their places in full-length arrays), entry offsets per position, and the unusable samples."""

    arrays: EncodedSamples
    entry_cum: np.ndarray  # int64 [positions + 1]: entries before each position (within a sample, exact)
    damaged: dict[int, Exception]  # row -> why it cannot be used
    students: tuple | None = None  # a student tokenizer's (ids, groups[, loss_mask]) of the whole part


class PartReader:
    """Reads one teacher's parts for a set of its rows: whole when the rows hold at least half of a
    part's bytes, else just the rows' samples, and checks every sample against the index and the
    vocabulary in vectorised passes. With `student`, also each part's tokens of that student tokenizer."""

    def __init__(self, view: StoreVersion, *, teacher: str, rows: TeacherRows, student: str | None = None):
        meta = view.teachers[teacher]
        self.view, self.teacher, self.rows, self.student = view, teacher, rows, student
        assert student is None or rows.students is not None, "rows with the student's columns"
        self.vocab_size, self.params = meta.vocab_size, meta.codec
        self.sampled, self.packed = meta.sampled, meta.packed
        self.masked = meta.loss_mask is not None  # chat data: a per-token loss_mask in every part
        self.names = layout.part_arrays(sampled=self.sampled, chat=self.masked)
        # Every student tokenizer's arrays (paths in the part, the teacher's order), which the content
        # hash covers: read whole with the part's own where they lie alike, members of its packed object
        # (store format 4: one request) or arrays of their own (before format 3). Format 3 packs the
        # part's own arrays only: its student arrays come apart. `student`'s are handed on.
        self.hashed_names = tuple(n for st in meta.student_names for n in layout.student_arrays(st, chat=self.masked))
        self.per_student = len(self.hashed_names) // max(1, len(meta.student_names))  # 2, or 3 with a loss mask
        at = meta.student_names.index(student) * self.per_student if student is not None else 0
        self.student_at = slice(at, at + self.per_student)
        self.together = bool(self.hashed_names) and meta.packs(self.hashed_names[0]) == self.packed
        self.grid = meta.grid
        # Here, not lazily in threads; int32 as the decode kernel takes it (no copy per batch).
        self.id_of_code = view.id_of_code(teacher).astype(np.int32)
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
        self.whole = split_bytes * 2 >= whole_bytes  # read the part whole, else the rows' ranges only
        self.bytes = np.where(self.whole, whole_bytes, split_bytes)

    def _bytes(self, n_tokens, n_entries, part, n_parts) -> np.ndarray:
        """Bytes in memory per part of the given samples: the encoded arrays plus `entry_cum`."""
        per_sample = (
            n_tokens * (self.id_bytes + self.masked)
            + (n_tokens - 1) * (6 + 8)
            + n_entries * (self.id_bytes + 2 + (2 if self.sampled else 0))
        )
        return np.bincount(part, weights=per_sample, minlength=n_parts).astype(np.int64)

    # -- reading a part ------------------------------------------------------------------------------

    def read(self, code: int) -> PartData:
        """Part `code` in memory (in a reader thread); its unusable samples in `damaged`."""
        rows = self.rows.in_part(code)
        part = self.rows.parts[code]
        damaged: dict[int, Exception] = {}
        students = None
        try:
            with read_errors(f"part {part} of teacher {self.teacher!r}"):
                if self.whole[code]:
                    arrays, students = self._whole(part)
                else:
                    arrays = self._ranges(part, rows)
        except StorageError:
            raise
        except DamagedDataError:  # one bad chunk: read sample by sample to lose only its samples
            arrays, damaged = self._by_sample(part, rows)
        entry_cum = np.concatenate([[0], np.cumsum(arrays.n_entries, dtype=np.int64)])
        if self.hashed_names and students is None and len(damaged) < len(rows):
            try:
                students = self._student_arrays(part)
            except DamagedDataError as e:  # the content hash cannot be checked: no sample of the part is usable
                damaged.update({row: e for row in rows.tolist()})
        if len(damaged) == len(rows):  # nothing of the part is usable: nothing to check or to add
            return PartData(arrays=arrays, entry_cum=entry_cum, damaged=damaged)
        damaged.update(self._check(arrays, entry_cum, rows, skip=damaged, students=students or ()))
        mine = students[self.student_at] if students is not None and self.student is not None else None
        return PartData(arrays=arrays, entry_cum=entry_cum, damaged=damaged, students=mine)

    def warm(self, code: int) -> None:
        """Ask storage now for what a later `read(code)` needs first, so that read is one request deep:
        on Icechunk, a packed part's manifest (one small request; the chunk is not fetched). Best
        effort, for parts the memory budget does not let the caller read yet: a failure is left to the read."""
        if not (self.packed and self.whole[code]):
            return
        part = self.rows.parts[code]
        paths = [layout.packed_path(self.teacher, part)]
        if not self.together:  # store format 3: the student arrays are arrays of their own, each its manifest
            paths += [f"{layout.part_path(self.teacher, part)}/{name}" for name in self.hashed_names]
        store = self.view.root.store

        async def every() -> None:
            await asyncio.gather(*(store.exists(packed.chunk_key(path)) for path in paths))

        with contextlib.suppress(StorageError, DamagedDataError):
            sync(every())

    def _whole(self, part: str) -> tuple[EncodedSamples, tuple | None]:
        """The part's arrays, and every student tokenizer's where they come in the same request (else None)."""
        store = self.view.root.store
        names = [*self.names, *(self.hashed_names if self.together else ())]
        if self.packed:  # store format 3 and 4: one object, one request
            path = layout.packed_path(self.teacher, part)
            arrays = read_packed(store, path, names, params=self.params, grid=self.grid)
        else:
            base = layout.part_path(self.teacher, part)
            arrays = read_whole(store, [f"{base}/{name}" for name in names], params=self.params)
        n = len(self.names)
        return EncodedSamples(**dict(zip(self.names, arrays[:n]))), tuple(arrays[n:]) or None

    def _ranges(self, part: str, rows: np.ndarray) -> EncodedSamples:
        """Just these rows' elements, at their places in zero-filled full-length arrays (np.zeros maps
        untouched pages lazily, so the memory used is the rows' own)."""
        out = {}
        by_axis = self.rows.spans(rows)
        for name in self.names:
            starts, stops = by_axis[layout.AXIS[name]]
            array = self.view.array(self.teacher, part, name)
            full = np.zeros(array.shape[0], dtype=_stored_dtype(array))
            for s, e in _merged(starts, stops):  # one request per run of nearby samples
                values = as_codes(read_values(array, slice(s, e)), self.params)
                if len(values) != e - s:  # Zarr clamps slices silently: an index beyond the stored array
                    raise _Damaged(f"index range [{s}, {e}) lies outside the stored array of {array.shape[0]}")
                full[s:e] = values
            out[name] = full
        return EncodedSamples(**out)

    def _by_sample(self, part: str, rows: np.ndarray) -> tuple[EncodedSamples, dict[int, Exception]]:
        try:
            with read_errors(f"part {part} of teacher {self.teacher!r}"):
                found = {name: self.view.array(self.teacher, part, name) for name in self.names}
        except DamagedDataError as e:  # the part's own metadata (its member table): every sample is lost
            return self._lost(rows), {row: e for row in rows.tolist()}
        arrays = {name: np.zeros(array.shape[0], dtype=_stored_dtype(array)) for name, array in found.items()}
        damaged: dict[int, Exception] = {}
        for row in rows.tolist():  # one step per sample, only for a part with a damaged chunk
            try:
                with read_errors(f"sample {self.rows.sample_ids[row]!r}"):
                    one = self._ranges(part, np.array([row]))
                    for name in self.names:
                        arrays[name] += getattr(one, name)  # disjoint ranges: adding places them
            except (*_BUGS, StorageError):
                raise
            except Exception as e:
                damaged[row] = e
        return EncodedSamples(**arrays), damaged

    def _lost(self, rows: np.ndarray) -> EncodedSamples:
        """Zeros in place of a part's arrays whose every sample is damaged, long enough for these rows'
        ranges (np.zeros maps no page it does not touch); only the entry counts are read from them."""
        by_axis = self.rows.spans(rows)
        ends = {axis: int(stops.max(initial=0)) for axis, (_, stops) in by_axis.items()}
        return EncodedSamples(**{name: np.zeros(ends[layout.AXIS[name]], np.uint16) for name in self.names})

    def _student_arrays(self, part: str) -> tuple:
        """Every student tokenizer's (ids, groups), and loss mask for chat data, of the part, read on
        their own (format 3: objects of their own; or the part read in ranges or after damage)."""
        base = layout.part_students_path(self.teacher, part)
        with read_errors(f"the student tokens in {base}"):  # no per-sample recovery: the part's samples are lost
            return tuple(read_values(self.view.array(self.teacher, part, name)) for name in self.hashed_names)

    # -- checks ----------------------------------------------------------------------------------------

    def _check(
        self, arrays: EncodedSamples, entry_cum: np.ndarray, rows: np.ndarray, *, skip: dict, students: tuple
    ) -> dict[int, Exception]:
        """Rows whose stored arrays contradict the index or the vocabulary (the decode kernel indexes
        without bounds checks), or their content hash. Vectorised over the part, but for the hash."""
        r = self.rows
        n, ts, ps, es, ne = (c[rows] for c in (r.n_tokens, r.token_start, r.position_start, r.entry_start, r.n_entries))
        bad: dict[int, Exception] = {}

        def flag(mask: np.ndarray, why: str) -> None:
            for row in rows[mask].tolist():  # one step per damaged sample
                if row not in skip and row not in bad:
                    bad[row] = _Damaged(why)

        inside = (
            (ts + n <= len(arrays.input_ids))
            & (ps + n - 1 <= len(arrays.n_entries))
            & (es + ne <= len(arrays.entry_codes))
        )
        flag(~inside, "index range lies outside the stored arrays")
        ps_in, end_in = np.where(inside, ps, 0), np.where(inside, ps + n - 1, 0)
        counts_ok = entry_cum[end_in] - entry_cum[ps_in] == ne
        flag(inside & ~counts_ok, "stored entry counts disagree with the index")
        token_bad = np.flatnonzero(arrays.input_ids >= self.vocab_size)
        flag(_rows_touching(token_bad, ts, n), "a stored token id lies outside the vocabulary")
        good = inside & counts_ok
        flag(
            self._bad_codes(arrays.entry_codes, entry_cum, ps=ps[good], n=n[good], es=es[good], where=good),
            "a stored entry code lies outside the vocabulary",
        )
        unhashed = good & ~np.isin(rows, [*skip, *bad])
        flag(
            self._hash_differs(arrays, students, rows, where=unhashed),
            "its stored arrays do not hash to the index's content hash",
        )
        return bad

    def _hash_differs(self, arrays: EncodedSamples, students: tuple, rows: np.ndarray, *, where) -> np.ndarray:
        """Mask over `rows` (`where` marks the ones to check): the row's stored arrays do not hash to its
        content hash. The one check that sees bytes in the wrong place (a member table naming another
        member's shards, or none) where every size and checksum holds. It costs a blake2b pass over the
        rows' encoded bytes (~1.3 GB/s on one core here: ~0.2 us per token at top-64, about a third of
        the part's read and decode; reader threads hash in parallel, blake2b releases the GIL for
        slices over 2 KiB) and ~3 us of Python per sample."""
        r, checked = self.rows, rows[where]
        pieces = part_pieces(arrays, r.spans(checked))
        k = self.per_student
        for s in range(len(students) // max(1, k)):  # one step per student tokenizer
            ids, groups, *mask = students[s * k : (s + 1) * k]
            cols = {c: r.student_columns[c][checked, s] for c in _STUDENT_COLUMNS}
            t0, g0 = cols["student_start"], cols["group_start"]
            pieces += student_pieces(
                ids,
                groups,
                mask[0] if mask else None,
                tokens=(t0, t0 + cols["n_student_tokens"]),
                group_rows=(g0, g0 + cols["n_groups"]),
            )
        held = np.frombuffer(b"".join(digests(pieces, len(checked))), np.uint8).reshape(-1, 16)
        out = np.zeros(len(rows), dtype=bool)
        out[np.flatnonzero(where)] = (held != r.content_hash[checked]).any(axis=1)
        return out

    def _bad_codes(self, codes: np.ndarray, entry_cum: np.ndarray, *, ps, n, es, where: np.ndarray) -> np.ndarray:
        """Mask over all rows (`where` marks the ones given) holding an entry code beyond the vocabulary."""
        mask = np.zeros(len(where), dtype=bool)
        bad = np.zeros(len(ps), dtype=np.bool_)
        if len(ps) and len(codes):
            _codes_beyond(codes, entry_cum, ps, n, es, self.vocab_size, bad)
        mask[np.flatnonzero(where)[bad]] = True
        return mask

    # -- samples out of the parts held -------------------------------------------------------------------

    def samples(self, parts: dict[int, PartData], rows: np.ndarray, a: np.ndarray, b: np.ndarray) -> SparseSamples:
        """Tokens [a, b) of each row (positions [a, b - 1)), decoded, in the given order; `parts` must
        hold the rows' parts. Sample ids are left empty."""
        return codec.decode(
            self._gather(parts, rows, a, b), params=self.params, id_of_code=self.id_of_code, n_tokens=b - a
        )

    def _gather(self, parts: dict[int, PartData], rows: np.ndarray, a: np.ndarray, b: np.ndarray) -> EncodedSamples:
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
        spans = {"token": (ts + a, ts + b), "position": (ps + a, ps + b - 1), "entry": (e0, e1)}
        held = [parts[c].arrays for c in code.tolist()]
        bounds = {axis: (lo.tolist(), hi.tolist()) for axis, (lo, hi) in spans.items()}
        out = {}
        for name in self.names:  # one slice per row: views, so the only copy is the concatenation
            lo, hi = bounds[layout.AXIS[name]]
            pieces = [getattr(arrays, name)[s:e] for arrays, s, e in zip(held, lo, hi)]
            out[name] = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)  # no rows: empty
        return EncodedSamples(**out)

    def damage(self, parts: dict[int, PartData], rows: np.ndarray) -> list[Exception | None]:
        """Why each row cannot be used, or None; `parts` must hold the rows' parts."""
        codes = self.rows.part[rows].tolist()
        return [parts[c].damaged.get(r) for r, c in zip(rows.tolist(), codes)]  # one step per row

    def student_tokens(self, parts: dict[int, PartData], rows: np.ndarray) -> list[tuple]:
        """Each row's student ids [n] and alignment groups [g, 4] (and its loss mask, chat data), from
        its part's arrays; `parts` must hold the rows' parts, read by a reader made for the student."""
        r = self.rows
        assert r.students is not None  # a reader made for a student tokenizer
        cols = r.students
        out = []
        for row in rows.tolist():  # one step per sample: slicing only
            arrays = parts[int(r.part[row])].students
            assert arrays is not None  # read by this reader, which reads the student arrays
            ids, groups, *mask = arrays
            s0, n = cols["student_start"][row], cols["n_student_tokens"][row]
            g0, g = cols["group_start"][row], cols["n_groups"][row]
            if s0 + n > len(ids) or 4 * (g0 + g) > len(groups) or any(len(m) != len(ids) for m in mask):
                raise DamagedDataError(
                    f"the student tokens of sample {r.sample_ids[row]!r} lie outside the stored arrays"
                )
            out.append(
                (
                    ids[s0 : s0 + n].astype(np.int64),
                    groups[4 * g0 : 4 * (g0 + g)].astype(np.int64).reshape(-1, 4),
                    *(m[s0 : s0 + n] for m in mask),
                )
            )
        return out


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
