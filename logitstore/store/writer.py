"""Writing a store: `StoreWriter`, one transaction on a branch: teachers, parts (each by a `PartWriter`,
part_writer.py), merges, and the commit with its index.
"""

from __future__ import annotations

import contextlib
from collections import ChainMap
from collections.abc import Sequence
from dataclasses import dataclass, field

import icechunk
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import zarr

from logitstore.errors import (
    ConflictError,
    DuplicateSampleError,
    IncompatibleStoreError,
    LogitstoreError,
)
from logitstore.format import codec, layout
from logitstore.format.grid import CodecParams
from logitstore.format.layout import group_at, json_attr
from logitstore.format.samples import SparseSamples, StudentTokens, concat
from logitstore.storage.bounded import (
    storage_errors,
)
from logitstore.storage.location import commit_lock
from logitstore.store import index
from logitstore.store.documents import Decision, decide, document_id, document_ids
from logitstore.store.generation import GENERATIONS_ATTR
from logitstore.store.meta import (
    FORMAT_VERSION,
    ON_DUPLICATE,
    WRITER,
    StudentTokenizer,
    TeacherMeta,
    mismatch_message,
    now,
)
from logitstore.store.part_writer import PartWriter, WrittenPart, new_part_name
from logitstore.store.version import StoreHandle, read_teachers


class StoreWriter:
    """One transaction on a branch. Nothing is visible until `commit`; leaving the `with` block
    without committing (or crashing) discards everything written.

    `on_duplicate` decides what happens to a sample id the branch already holds for that teacher:
    "error" (default) refuses the write, "replace" makes the new sample win, "skip" keeps the old one
    and drops the new (what a resumed build wants). With "skip", `on_changed` decides for a sample whose
    document is stored with other text (both source hashes known, and different), under its id or other
    window ids (`documents.decide`): "error" (default) raises `ChangedTextError`, "skip" keeps the stored
    one (`CommitResult.changed`), "replace" makes the new one win and drops the document's other stored
    windows. The same rule holds for samples the base version holds and for samples a concurrent writer
    committed first (found when `commit` rebases onto it).
    """

    def __init__(self, store: StoreHandle, *, branch: str, on_duplicate: str, on_changed: str = "error"):
        for name, value in (("on_duplicate", on_duplicate), ("on_changed", on_changed)):
            if value not in ON_DUPLICATE:
                raise ValueError(f"{name} must be 'error', 'replace' or 'skip', got {value!r}")
        self.store = store
        self.branch = branch
        self.on_duplicate = on_duplicate
        self.on_changed = on_changed
        with storage_errors(f"cannot write to {store.location.uri}"):
            self.session = store.repo.writable_session(branch)
            self.root = zarr.open_group(self.session.store, mode="r+")
        self.base_snapshot = self.session.snapshot_id
        self.teachers = read_teachers(self.root)
        # (teacher, sample id) -> source hash of what the base version holds, less what `remove` drops
        self._base_index = store.read_index(self.base_snapshot)
        self._base_keys = _sources(self._base_index)
        self._documents: set[tuple[str, str]] | None = None  # `_base_documents`
        self._new_rows: list[pa.Table] = []
        self._new_keys: set[tuple[str, str]] = set()
        self._committed: str | None = None
        self._fork_source: icechunk.Session | None = None
        self._added_teachers: list[str] = []
        self._removed: set[tuple[str, str]] = set()
        self._dropped = 0  # samples left out as stored already with the same text (at write, merge or commit)
        self._changed: list[str] = []  # sample ids stored with other text, left out or replaced (`on_changed`)
        self._part_bytes: dict[tuple[str, str], int] = {}  # (teacher, part) -> compressed bytes, parts staged
        self.result: CommitResult | None = None  # what `commit` made visible
        # Each teacher's id order (`code_of_id`), shared by every part writer and fork of this writer:
        # read once, not once per part (reading it costs ~14 ms, a third of a 16k-token part's write).
        self._codes: dict[str, np.ndarray] = {}

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, *exc) -> None:
        if self._committed is None and self.session.has_uncommitted_changes:
            self.session.discard_changes()

    # -- teachers --------------------------------------------------------------------------------

    def add_teacher(
        self,
        meta: TeacherMeta,
        *,
        tokenizer_json: str | None = None,
        code_of_id: np.ndarray | None = None,
        students: Sequence[StudentTokenizer] = (),
    ) -> TeacherMeta:
        """Register a teacher (with its student tokenizers), or check that `meta` matches the one
        already in the store. `meta.students` is filled from `students`."""
        meta = TeacherMeta.from_json({**meta.to_json(), "students": [st.summary() for st in students]})
        existing = self.teachers.get(meta.name)
        if existing is not None:
            if not existing.same_teacher(meta):
                raise IncompatibleStoreError(mismatch_message(existing, meta))
            return existing
        meta = TeacherMeta.from_json({**meta.to_json(), "created": now(), "writer": WRITER})
        group = self.root.require_group(layout.TEACHERS).create_group(meta.name)
        group.attrs["logitstore_teacher"] = meta.to_json()
        group.create_group(layout.PARTS)  # here, not in forks: two forks creating it would conflict
        self._added_teachers.append(meta.name)
        if json_attr(self.root, "logitstore").get("format", 1) < meta.format:
            # an older store gains a newer teacher: a logitstore that does not know its format refuses it in one line
            self.root.attrs["logitstore"] = {**json_attr(self.root, "logitstore"), "format": meta.format}
        if meta.codec.id_order == "frequency":
            assert code_of_id is not None and len(code_of_id) == meta.vocab_size, "frequency order needs code_of_id"
            write_array(group, layout.CODE_OF_ID, np.asarray(code_of_id, dtype=np.uint32))
            self._codes[meta.name] = np.asarray(code_of_id, dtype=np.uint32)
        if tokenizer_json is not None:
            write_array(group, layout.TOKENIZER, np.frombuffer(tokenizer_json.encode("utf-8"), dtype=np.uint8))
        for st in students:
            sub = group.require_group(layout.STUDENTS).create_group(st.name)
            sub.attrs["logitstore_student"] = {
                **st.summary(),
                "mapped_mass": st.mapped_mass,
                "mapped_mass_positions": st.mapped_mass_positions,
                "mapped_ids": int((st.vocab_map >= 0).sum()),
            }
            write_array(sub, layout.TOKENIZER, np.frombuffer(st.tokenizer_json.encode("utf-8"), dtype=np.uint8))
            write_array(sub, layout.VOCAB_MAP, np.asarray(st.vocab_map, dtype=np.int32))
        self.teachers[meta.name] = meta
        return meta

    def record_generation(self, teacher: str, record: dict) -> None:
        """Keep a generation's record (`logitstore.store.generation`) on the teacher's group, once: a record
        already there is not written again, so checkpoint commits do not touch the group."""
        group = group_at(self.root, layout.teacher_path(teacher))
        known = json_attr(group, GENERATIONS_ATTR) if GENERATIONS_ATTR in group.attrs else {}
        if record["id"] not in known:
            group.attrs[GENERATIONS_ATTR] = {**known, record["id"]: record}

    # -- samples -----------------------------------------------------------------------------------

    def write(
        self,
        samples: SparseSamples,
        *,
        teacher: str,
        source_hashes: list[str | None] | None = None,
        students: dict[str, StudentTokens] | None = None,
    ) -> int:
        """Encode and stage `samples` as one new part. Returns how many samples were staged."""
        if teacher not in self.teachers:
            raise LogitstoreError(f"teacher {teacher!r} is not in the store; add_teacher first")
        keep = self._apply_duplicate_rule(teacher, samples.sample_ids, source_hashes or [None] * len(samples))
        if not keep:
            return 0
        if len(keep) < len(samples):
            samples, source_hashes = _subset(samples, keep, source_hashes)
            students = None if students is None else {n: st.select(keep) for n, st in students.items()}
        written = self.part_writer().write(samples, teacher=teacher, source_hashes=source_hashes, students=students)
        self._add_rows(written.rows, teacher=teacher, sample_ids=samples.sample_ids, stored_bytes=written.stored_bytes)
        return len(samples)

    def part_writer(self) -> PartWriter:
        """A writer of parts into this transaction, in this process."""
        return PartWriter(self.session, teachers=self.teachers, where=self.store.location.uri, codes=self._codes)

    def fork(self) -> PartWriter:
        """A picklable writer of parts for another process, Ray worker or thread; hand its
        `WrittenPart`s back to `merge`, in any order.

        Icechunk forks only a session without uncommitted changes, so forks come from a second,
        untouched session on the branch while merges land in this one. That session may sit on a newer
        version than this one's base when another writer committed meanwhile: a fork adds only a new
        part group under its teacher's `parts`, which both versions hold (teachers must be committed
        before forking: a fork cannot create the shared teacher groups), and the commit rebases as
        for any concurrent writer."""
        assert not self._added_teachers, "commit newly added teachers before forking"
        with storage_errors(f"cannot fork a writer on {self.store.location.uri}"):
            if self._fork_source is None:
                self._fork_source = self.store.repo.writable_session(self.branch)
                # Forks travel with the id orders (a few hundred KB each), so workers read none of them.
                reader = PartWriter(
                    self.session, teachers=self.teachers, where=self.store.location.uri, codes=self._codes
                )
                for name in self.teachers:
                    with contextlib.suppress(LogitstoreError):  # unreadable: the worker that needs it says so
                        reader.code_of_id(name)
            return PartWriter(
                self._fork_source.fork(), teachers=self.teachers, where=self.store.location.uri, codes=self._codes
            )

    def merge(self, written: WrittenPart) -> int:
        """Take a forked writer's part into this transaction. Returns the samples it adds. A part none
        of whose samples is added (all stored already, with on_duplicate="skip") is left out: its
        arrays never reach the branch, and a transaction of such parts alone commits nothing."""
        rows = written.rows
        if not rows.num_rows:
            return 0
        teacher, sample_ids = rows["teacher"][0].as_py(), rows["sample_id"].to_pylist()
        keep = self._apply_duplicate_rule(teacher, sample_ids, rows["source_hash"].to_pylist())
        if len(keep) < len(sample_ids):
            rows = rows.take(pa.array(keep, type=pa.int64()))  # typed: an empty list would be null-typed
            sample_ids = [sample_ids[i] for i in keep]
        if not rows.num_rows:
            return 0
        if written.fork is not None:
            with storage_errors(f"cannot merge a forked writer into {self.store.location.uri}"):
                self.session.merge(written.fork)
        self._add_rows(rows, teacher=teacher, sample_ids=sample_ids, stored_bytes=written.stored_bytes)
        return rows.num_rows

    def remove(self, teacher: str, sample_ids: list[str]) -> None:
        """Drop these samples of the base version from the index at commit (their parts stay, unreferenced:
        older versions still read them). A removed id may then be written again in this transaction."""
        removed = {(teacher, sid) for sid in sample_ids} & self._base_keys.keys()
        for key in removed:
            del self._base_keys[key]
        self._removed |= removed

    @property
    def has_changes(self) -> bool:
        """Anything to commit: written or merged parts, or removals."""
        return self.session.has_uncommitted_changes or bool(self._removed)

    def _add_rows(self, rows: pa.Table, *, teacher: str, sample_ids: list[str], stored_bytes: int) -> None:
        """Stage one part's index rows: `teacher`'s samples `sample_ids`, the rows' own, in order."""
        self._new_rows.append(rows)
        self._new_keys.update((teacher, sid) for sid in sample_ids)
        if rows.num_rows:
            self._part_bytes[(teacher, rows["part"][0].as_py())] = stored_bytes

    def _apply_duplicate_rule(self, teacher: str, sample_ids: list[str], sources: list[str | None]) -> list[int]:
        """Which of these samples to stage, by `on_duplicate` and, for one whose document is stored with
        other text, `on_changed` (`documents.decide`, against the base version and what is staged)."""
        keys = [(teacher, sid) for sid in sample_ids]
        dup = [i for i, key in enumerate(keys) if key in self._base_keys or key in self._new_keys]
        if dup and self.on_duplicate == "error":
            first = [sample_ids[i] for i in dup[:3]]
            raise DuplicateSampleError(
                f"{len(dup)} sample id(s) already stored for teacher {teacher!r}, e.g. {first}; "
                "pass on_duplicate='replace' or 'skip'"
            )
        in_txn = [sample_ids[i] for i in dup if keys[i] in self._new_keys]
        if self.on_duplicate == "replace":
            if in_txn:
                raise DuplicateSampleError(f"sample id {in_txn[0]!r} written twice in one transaction")
            return list(range(len(sample_ids)))
        # Only a sample whose document the base holds or this write stages again can meet a stored one:
        # the rest skip `decide` (~10 us a sample, in the driver's thread on a build's every unit).
        held, restaged = self._base_documents(), {document_id(sid) for sid in in_txn}
        documents = [document_id(sid) for sid in sample_ids]
        meets = [i for i, doc in enumerate(documents) if doc in restaged or (teacher, doc) in held]
        if not meets:
            return list(range(len(sample_ids)))
        stored = ChainMap(self._new_sources(teacher, in_txn), self._base_keys)
        decision = decide(
            [keys[i] for i in meets], [sources[i] for i in meets], stored=stored, on_changed=self.on_changed
        )
        self.remove(teacher, [sid for t, sid in decision.dropped])  # a replaced document's other windows
        self._count_left_out(decision.left_out, decision.changed)
        return [i for i, key in enumerate(keys) if key not in decision.left_out]

    def _base_documents(self) -> set[tuple[str, str]]:
        """(teacher, document id) of every sample the base version holds, found once (a sample `remove`
        drops leaves its document here: a few samples more meet `decide`, which looks them up itself)."""
        if self._documents is None:
            docs = document_ids(self._base_index["sample_id"]).to_pylist()  # one vectorised pass
            self._documents = set(zip(self._base_index["teacher"].to_pylist(), docs))
        return self._documents

    def _count_left_out(self, left_out: set[tuple[str, str]], changed: list[str]) -> None:
        """Count once what a write, a merge or the commit that succeeds left out or replaced."""
        self._dropped += len(left_out) - (len(changed) if self.on_changed == "skip" else 0)
        self._changed += changed

    def _new_sources(self, teacher: str, sample_ids: list[str]) -> dict[tuple[str, str], str | None]:
        """Source hashes of samples staged in this transaction (a duplicate within it is rare: read on demand)."""
        if not sample_ids:
            return {}
        wanted = {(teacher, sid) for sid in sample_ids}
        return {key: value for key, value in _sources(pa.concat_tables(self._new_rows)).items() if key in wanted}

    # -- commit ----------------------------------------------------------------------------------

    def commit(self, message: str, *, max_attempts: int = 20) -> str:
        """Make everything staged visible as one new version. If another writer committed to the
        branch meanwhile, rebase onto it and merge the indexes; fail with `ConflictError` only when
        both wrote the same Zarr paths or the same sample ids. Returns the new version id."""
        assert self._committed is None, "a StoreWriter commits once"
        if not self.session.has_uncommitted_changes:
            if not self._removed:  # e.g. every sample skipped as already stored
                return self._nothing_to_commit()
            self._record_removal()  # Icechunk commits only a changed tree
        new_rows = pa.concat_tables(self._new_rows) if self._new_rows else index.empty_index()
        for _ in range(max_attempts):
            base = self.store.read_index(self.session.snapshot_id)
            attempt = self._merge(base, new_rows)
            merged, kept = attempt.index, attempt.kept
            self._drop_parts_without_rows(staged=new_rows, kept=kept)
            if not kept.num_rows and not self._removed and not self._added_teachers:
                # a concurrent writer committed every sample first: no commit of orphaned parts
                self.session.discard_changes()
                self._count_left_out(attempt.left_out, attempt.changed)
                return self._nothing_to_commit()
            key = index.write_index(self.store.blobs, merged)
            meta = {
                "index": key,
                "samples": merged.num_rows,
                "tokens": int(pc.sum(merged["n_tokens"]).as_py() or 0),
                "format": FORMAT_VERSION,
                "writer": WRITER,
            }
            try:
                with storage_errors(f"cannot commit to {self.store.location.uri}"), commit_lock(self.store.location):
                    self._committed = self.session.commit(message, metadata={"logitstore": meta})
                self._count_left_out(attempt.left_out, attempt.changed)
                self.result = self._result(self._committed, kept=kept)
                return self._committed
            except icechunk.ConflictError:
                self._rebase()
        raise ConflictError(f"branch {self.branch!r} kept moving; gave up after {max_attempts} attempts")

    def _result(self, version: str, *, kept: pa.Table) -> CommitResult:
        parts = set(zip(kept["teacher"].to_pylist(), kept["part"].to_pylist()))
        return CommitResult(
            version=version,
            samples=kept.num_rows,
            tokens=int(pc.sum(kept["n_tokens"]).as_py() or 0),
            stored_bytes=sum(self._part_bytes.get(p, 0) for p in parts),
            dropped=self._dropped,
            changed=list(self._changed),
            removed=len(self._removed),
        )

    def _nothing_to_commit(self) -> str:
        self._committed = self.session.snapshot_id
        self.result = CommitResult(
            version=self._committed, dropped=self._dropped, changed=list(self._changed), committed=False
        )
        return self._committed

    def _drop_parts_without_rows(self, *, staged: pa.Table, kept: pa.Table) -> None:
        """Delete the staged parts whose every sample a concurrent writer committed first (dropped by
        `_merge`), so the commit holds no part that its index does not reference."""
        orphans = set(zip(staged["teacher"].to_pylist(), staged["part"].to_pylist())) - set(
            zip(kept["teacher"].to_pylist(), kept["part"].to_pylist())
        )
        with storage_errors(f"cannot write to {self.store.location.uri}"):
            for teacher, part in sorted(orphans):
                parts = group_at(self.root, layout.parts_path(teacher))
                if part in parts:
                    del parts[part]
                self._part_bytes.pop((teacher, part), None)

    def _record_removal(self) -> None:
        """A removal alone changes only the index: record it as an empty part of its own, a new path
        that no concurrent writer touches."""
        teacher = sorted(self._removed)[0][0]
        with storage_errors(f"cannot write to {self.store.location.uri}"):
            group = group_at(self.root, layout.parts_path(teacher)).create_group(new_part_name())
            group.attrs.update({"samples": 0, "tokens": 0, "stored_bytes": 0, "removed": len(self._removed)})

    def _rebase(self) -> None:
        try:
            with storage_errors(f"cannot commit to {self.store.location.uri}"):
                self.session.rebase(icechunk.ConflictDetector())
        except icechunk.RebaseFailedError as e:
            paths = sorted({c.path for c in e.conflicts})
            raise ConflictError(
                f"another writer committed to branch {self.branch!r} first and changed the same "
                f"paths ({', '.join(paths[:5])}); nothing of this write was committed"
            ) from None

    def _merge(self, base: pa.Table, new_rows: pa.Table) -> _Merged:
        """The branch's new index, and the rows of this write it holds (with on_duplicate="skip", less
        those a concurrent writer committed first, by the rule `write` and `merge` apply to the base's)."""
        present = _keys(base) - self._removed  # what the branch holds and this write does not remove
        added = present - self._base_keys.keys()  # what a concurrent writer added meanwhile
        clash = added & _keys(new_rows)
        if clash and self.on_duplicate == "error":
            raise ConflictError(f"a concurrent write added sample(s) {sorted(clash)[:3]} that this write also holds")
        decision = Decision()
        if added and self.on_duplicate == "skip":  # by document: the other writer's text may have other windows
            keys = list(zip(new_rows["teacher"].to_pylist(), new_rows["sample_id"].to_pylist()))
            theirs = _sources(base.filter(_key_mask(base, added)))
            decision = decide(keys, new_rows["source_hash"].to_pylist(), stored=theirs, on_changed=self.on_changed)
            new_rows = new_rows.filter(pc.invert(_key_mask(new_rows, decision.left_out)))
        kept = base.filter(pc.invert(_key_mask(base, _keys(new_rows) | self._removed | decision.dropped)))
        return _Merged(pa.concat_tables([kept, new_rows]), new_rows, decision.left_out, decision.changed)


@dataclass
class _Merged:
    """A commit attempt's index: the branch's new index, the rows of this write it holds, and what it
    leaves out of this write as a concurrent writer's (counted once the attempt commits)."""

    index: pa.Table
    kept: pa.Table
    left_out: set[tuple[str, str]]
    changed: list[str]


@dataclass
class CommitResult:
    """What a `StoreWriter.commit` made visible (`StoreWriter.result`): counts of the commit itself, after
    a rebase dropped what a concurrent writer stored first."""

    version: str  # the new version, or the branch's tip when there was nothing to commit
    samples: int = 0  # index rows this commit added
    tokens: int = 0
    stored_bytes: int = 0  # compressed bytes of the parts it holds
    dropped: int = 0  # samples left out as stored already with the same text (on_duplicate="skip")
    changed: list[str] = field(
        default_factory=list
    )  # sample ids left out as stored with other text (on_changed="skip")
    removed: int = 0  # samples it dropped from the index (`remove`)
    committed: bool = True  # False: nothing was left to commit, and no commit was made


def _keys(table: pa.Table) -> set[tuple[str, str]]:
    return set(zip(table["teacher"].to_pylist(), table["sample_id"].to_pylist()))


def _sources(table: pa.Table) -> dict[tuple[str, str], str | None]:
    """(teacher, sample id) -> source hash, of index rows."""
    keys = zip(table["teacher"].to_pylist(), table["sample_id"].to_pylist())
    return dict(zip(keys, table["source_hash"].to_pylist()))


def _key_mask(table: pa.Table, keys: set[tuple[str, str]]) -> pa.Array:
    joined = pc.binary_join_element_wise(table["teacher"], table["sample_id"], "\x00")
    return pc.is_in(joined, value_set=pa.array([f"{t}\x00{s}" for t, s in keys], pa.string()))


def _subset(samples: SparseSamples, keep: list[int], source_hashes):
    picked = concat([samples.select(i) for i in keep])
    return picked, None if source_hashes is None else [source_hashes[i] for i in keep]


def write_array(group: zarr.Group, name: str, values: np.ndarray, *, grid: CodecParams | None = None) -> int:
    """Write a 1-D array sharded for object storage; returns its compressed size in bytes. Through Zarr:
    for the per-teacher arrays, written once; parts go through `rawwrite` in the same layout. With
    `grid`, `values` are uint16 codes, written as the float32 log-probabilities they stand for."""
    array = group.create_array(name, **layout.array_kwargs(values, grid=grid))
    if len(values):
        array[:] = values if grid is None else codec.dequantize(values, params=grid)
    return int(array.nbytes_stored())
