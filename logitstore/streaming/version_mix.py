"""Several versions of one store as one source of the stream engine: a weighted mix of versions
(`train --version-weight round-1=0.5 --version-weight round-2=1`, on-policy rounds that mix earlier
rounds' answers).

- **Samples.** The samples of every version, one teacher's; a sample id held by two versions is two
  samples (two rounds' answers to one prompt), each read with its own version's index row. The split
  stays by sample id hash, so one prompt's answers are all train or all eval.
- **Weights** are multiplicities per epoch: a sample of a version with weight W appears floor(W) times,
  and once more iff the blake2b-64 of its id, keyed by the version's snapshot id, falls below frac(W)
  as a fraction of 2**64: reproducible, independent of the world size, and another subset per version.
- **Reading.** Parts are never deleted (a replaced sample's part stays in the tree, unreferenced), so
  a version whose tree holds every part of the others (the newest of one history) reads them all:
  one `PartReader` over the rows of every version, and a part two versions share is read once. A
  version whose parts that tree lacks (another branch's) gets a reader of its own.
- **The pinned version** (`version`, what a state_dict and a run's records hold) is the mix itself,
  {snapshot id: weight}; a mix of one version at weight 1 is that version (`store_stream` reads it
  with `StoreSource`).

Costs: one hash per sample and version at start (as the split's); a batch decodes once per reader.
"""

from __future__ import annotations

import copy
import hashlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from logitstore.format import layout
from logitstore.format.samples import concat
from logitstore.store.reader import PartData, PartReader, TeacherRows
from logitstore.store.version import StoreVersion
from logitstore.streaming.batch import BatchContext, PackedBatch
from logitstore.streaming.order import Pieces, SplitTable
from logitstore.streaming.spec import StreamConfigError, StreamSpec
from logitstore.streaming.teacher_source import check_train_on, one_teacher_batch, readable, split_rows


@dataclass(frozen=True)
class WeightedVersion:
    """One version of a mix and its weight (samples per stored sample per epoch, on average)."""

    view: StoreVersion
    weight: float


# A mix's epoch is one table row per sample and repeat, in every process (~150 bytes each: its index
# columns, its id, its place in the order), so a weight that asks for more rows than this (~300 GB) is a
# typo, refused before anything is allocated.
MAX_EPOCH_ROWS = 2**31


def snapshot_weights(store, weights: dict[str, float]) -> dict[str, float]:
    """{snapshot id: weight} of `--version-weight`'s {version: weight} (tags, branches, ids of `store`);
    two names of one version (a tag and its snapshot id) are refused, not summed or merged."""
    out: dict[str, float] = {}
    named: dict[str, str] = {}
    for name, weight in weights.items():
        snapshot = store.resolve(name)
        if snapshot in out:
            raise StreamConfigError(
                f"--version-weight: {named[snapshot]!r} and {name!r} name one version ({snapshot}); give it once"
            )
        out[snapshot], named[snapshot] = weight, name
    return out


def mix_version(mix: list[WeightedVersion]) -> dict[str, float] | str:
    """What a mix pins (`pinned`)."""
    return pinned({w.view.snapshot_id: w.weight for w in mix})


def pinned(weights: dict[str, float]) -> dict[str, float] | str:
    """What a mix of snapshots pins: {snapshot id: weight} sorted by id, or the snapshot id of a mix of
    one version at weight 1 (that version)."""
    if len(weights) == 1 and next(iter(weights.values())) == 1:
        return next(iter(weights))
    return dict(sorted(weights.items()))


def shown(version: dict[str, float] | str) -> str:
    """A pinned version or mix in words: `ID` or `ID=0.5, ID=1`."""
    return version if isinstance(version, str) else ", ".join(f"{v}={w:g}" for v, w in version.items())


def multiplicity(sample_ids: list[str], *, version: str, weight: float) -> np.ndarray:
    """int64 [n]: how often each sample of `version` appears per epoch at `weight`."""
    whole, share = math.floor(weight), weight - math.floor(weight)
    out = np.full(len(sample_ids), whole, dtype=np.int64)
    if share > 0:
        key = version.encode("utf-8")[:64]  # blake2b keys hold 64 bytes; snapshot ids are 20
        drawn = [  # one hash per sample, at start
            int.from_bytes(hashlib.blake2b(s.encode("utf-8"), digest_size=8, key=key).digest(), "big")
            for s in sample_ids
        ]
        out += np.array(drawn, dtype=np.uint64) < np.uint64(int(share * 2.0**64))
    return out


@dataclass
class _Reader:
    """One reader of the mix: the rows it serves (every version it reads, each row repeated by its
    multiplicity) and where its parts and rows start in the source's table."""

    reader: PartReader
    rows: TeacherRows
    part0: int
    row0: int


class VersionsSource:
    """A weighted mix of versions of one store, one teacher: pieces become `PackedBatch`es of that
    teacher's targets, read from each sample's own version."""

    def __init__(
        self,
        mix: list[WeightedVersion],
        *,
        teacher: str | None,
        split: str,
        eval_fraction: float,
        train_on: str = StreamSpec.train_on,
    ):
        mix = sorted(mix, key=lambda w: w.view.snapshot_id)  # the order is the mix's, not the flags'
        self.version = mix_version(mix)
        self.teacher = teacher = mix[-1].view.teacher_name(teacher)
        _check_versions(mix, teacher=teacher)
        self.completion_only = train_on == "completion"
        rows = [
            _weighted_rows(w, teacher=teacher, split=split, eval_fraction=eval_fraction, train_on=train_on) for w in mix
        ]
        self._readers: list[_Reader] = []
        part0 = row0 = 0
        for view, members in _reading_views(mix, teacher=teacher):
            joined = _join([rows[k] for k in members])
            reader = PartReader(_with_index(view, [mix[k].view for k in members]), teacher=teacher, rows=joined)
            self._readers.append(_Reader(reader, joined, part0, row0))
            part0, row0 = part0 + len(joined.parts), row0 + len(joined.sample_ids)
        self._part0 = np.array([r.part0 for r in self._readers], dtype=np.int64)
        self._row0 = np.array([r.row0 for r in self._readers], dtype=np.int64)
        self.table = SplitTable(
            sample_ids=[s for r in self._readers for s in r.rows.sample_ids],
            n_tokens=np.concatenate([r.rows.n_tokens for r in self._readers]),
            part=np.concatenate([r.rows.part + r.part0 for r in self._readers]),
            parts=[p for r in self._readers for p in r.rows.parts],
        )
        self.sampled = self._readers[0].reader.sampled
        self.where = f"the {split} split of teacher {teacher!r} in versions {shown(self.version)}"

    def _of_part(self, code: int) -> _Reader:
        return self._readers[int(np.searchsorted(self._part0, code, side="right")) - 1]

    def part_bytes(self) -> np.ndarray:
        return np.concatenate([r.reader.bytes for r in self._readers])

    def read_part(self, code: int) -> PartData:
        r = self._of_part(code)
        return r.reader.read(code - r.part0)

    def warm_part(self, code: int) -> None:
        r = self._of_part(code)
        r.reader.warm(code - r.part0)

    def build(self, pieces: Pieces, parts: dict[int, PartData], *, stream: BatchContext) -> PackedBatch:
        which = np.searchsorted(self._row0, pieces.row, side="right") - 1  # the reader of each piece
        ok = np.ones(len(pieces.row), dtype=bool)
        decoded, order = [], []
        for k, r in enumerate(self._readers):  # one step per reader
            at = np.flatnonzero(which == k)
            if not len(at):
                continue
            own = {c - r.part0: data for c, data in parts.items() if r.part0 <= c < r.part0 + len(r.rows.parts)}
            rows = pieces.row[at] - r.row0
            ok[at] = readable(r.reader, own, rows, table=self.table, table_rows=pieces.row[at], stream=stream)
            good = at[ok[at]]
            if len(good):
                decoded.append(r.reader.samples(own, pieces.row[good] - r.row0, pieces.a[good], pieces.b[good]))
                order.append(good)
        samples = None
        if decoded:
            samples = concat(decoded)
            if len(decoded) > 1:  # back in piece order: the k-th readable piece is the fragment at place[k]
                place = np.argsort(np.concatenate(order), kind="stable")
                samples = samples.cut(place, np.zeros(len(place), np.int64), samples.n_tokens[place])
        return one_teacher_batch(pieces, ok, samples, source=self, sampled=self.sampled, stream=stream)


def _weighted_rows(w: WeightedVersion, *, teacher: str, split: str, eval_fraction: float, train_on: str) -> TeacherRows:
    """The version's rows of the split, each repeated by its multiplicity at the version's weight."""
    check_train_on(w.view, teacher=teacher, train_on=train_on)
    own = split_rows(w.view, teacher=teacher, split=split, eval_fraction=eval_fraction)
    if w.weight * len(own.sample_ids) > MAX_EPOCH_ROWS:
        raise StreamConfigError(
            f"--version-weight: weight {w.weight:g} repeats the {len(own.sample_ids):,} samples of version "
            f"{w.view.snapshot_id} past {MAX_EPOCH_ROWS:,} rows per epoch; give a weight of at most "
            f"{MAX_EPOCH_ROWS // len(own.sample_ids):,}"
        )
    times = multiplicity(own.sample_ids, version=w.view.snapshot_id, weight=w.weight)
    return _take(own, np.repeat(np.arange(len(own.sample_ids)), times))


def _check_versions(mix: list[WeightedVersion], *, teacher: str) -> None:
    """One teacher, stored alike in every version: its tokenizer, its kind of entries and chat mask (a
    version read through another's tree is of its history, where the teacher's metadata is fixed)."""
    seen = {w.view.snapshot_id for w in mix}
    if len(seen) < len(mix):
        raise StreamConfigError("--version-weight: one version given twice (by two of its names)")
    last = mix[-1].view
    alike = lambda meta: (meta.tokenizer_hash, meta.vocab_size, meta.sampled, meta.loss_mask)
    for w in mix:
        if teacher not in w.view.teachers:
            raise StreamConfigError(f"--version-weight: version {w.view.snapshot_id} holds no teacher {teacher!r}")
        if alike(w.view.teachers[teacher]) != alike(last.teachers[teacher]):
            raise StreamConfigError(
                f"--version-weight: teacher {teacher!r} is stored otherwise in version {w.view.snapshot_id} than "
                f"in {last.snapshot_id} (its tokenizer, sampled entries or chat mask); mix versions of one teacher"
            )


def _reading_views(mix: list[WeightedVersion], *, teacher: str) -> list[tuple[StoreVersion, list[int]]]:
    """(the view that reads them, the versions of the mix it reads): the version whose tree holds the most
    of the mix's parts reads every version whose parts it holds; each other version reads its own."""
    needed = [set(w.view.index.filter(pc.equal(w.view.index["teacher"], teacher))["part"].to_pylist()) for w in mix]
    held = [_parts_in(w.view, teacher=teacher) for w in mix]
    every = set().union(*needed)
    main = max(range(len(mix)), key=lambda k: (len(held[k] & every), k))
    joined = [k for k in range(len(mix)) if needed[k] <= held[main]]
    return [(mix[main].view, joined)] + [(mix[k].view, [k]) for k in range(len(mix)) if k not in joined]


def _parts_in(view: StoreVersion, *, teacher: str) -> set[str]:
    """The teacher's parts in the version's tree (referenced or not): one listing of Icechunk's snapshot."""
    path = layout.parts_path(teacher)
    return set(layout.group_at(view.root, path).group_keys()) if path in view.root else set()


def _with_index(view: StoreVersion, versions: list[StoreVersion]) -> StoreVersion:
    """`view` for a `PartReader` of several versions: its index the rows of every one of them (the columns
    the reader sizes parts by), each stored sample once, so a part is sized by the rows it holds in any
    of them (a replaced sample's part is in no newer index)."""
    if len(versions) == 1 and versions[0] is view:
        return view
    out = copy.copy(view)
    rows = pa.concat_tables(
        [v.index.select(["teacher", "part", "token_start", "n_tokens", "n_entries"]) for v in versions]
    )
    out.index = rows.group_by(["teacher", "part", "token_start"]).aggregate([("n_tokens", "max"), ("n_entries", "max")])
    out.index = out.index.rename_columns(
        [{"n_tokens_max": "n_tokens", "n_entries_max": "n_entries"}.get(c, c) for c in out.index.column_names]
    )
    return out


# The index columns a reader needs of each row (beside its id and part).
_COLUMNS = ("n_tokens", "token_start", "position_start", "entry_start", "n_entries", "content_hash")


def _take(rows: TeacherRows, at: np.ndarray) -> TeacherRows:
    """Rows `at` of `rows` (repeats allowed), their parts renumbered over the parts they use."""
    used, code = np.unique(rows.part[at], return_inverse=True)
    columns: dict[str, Any] = {name: getattr(rows, name)[at] for name in _COLUMNS}
    columns["student_columns"] = {c: values[at] for c, values in rows.student_columns.items()}
    ids = [rows.sample_ids[i] for i in at.tolist()]
    return TeacherRows(ids, code.reshape(-1).astype(np.int64), [rows.parts[c] for c in used.tolist()], **columns)


def _join(rows: list[TeacherRows]) -> TeacherRows:
    """The rows of several versions as one reader's: a part two of them use is one part."""
    columns: dict[str, Any] = {name: np.concatenate([getattr(r, name) for r in rows]) for name in _COLUMNS}
    columns["student_columns"] = {
        c: np.concatenate([r.student_columns[c] for r in rows]) for c in rows[0].student_columns
    }
    offsets = np.cumsum([0] + [len(r.parts) for r in rows])[:-1]
    parts, code = np.unique(np.asarray([p for r in rows for p in r.parts], dtype=str), return_inverse=True)
    part = code.reshape(-1).astype(np.int64)[np.concatenate([r.part + o for r, o in zip(rows, offsets)])]
    return TeacherRows([s for r in rows for s in r.sample_ids], part, [str(p) for p in parts], **columns)
