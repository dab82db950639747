"""One teacher of a store version as a source of the stream engine: `StoreSource` reads its parts
with the store's part reader (`logitstore/store/reader.py`) and lays decoded pieces out in batches.
"""

from __future__ import annotations

import numpy as np

from logitstore.store.reader import PartData, PartReader, TeacherRows
from logitstore.store.version import StoreVersion
from logitstore.streaming.batch import BatchContext, PackedBatch, assemble
from logitstore.streaming.order import Pieces, SplitTable, in_split
from logitstore.streaming.spec import StreamConfigError, StreamSpec
from logitstore.text.chat import TRAIN_ON


def split_rows(view: StoreVersion, *, teacher: str, split: str, eval_fraction: float, student: str | None = None):
    """One teacher's index rows of one split, sorted by sample id (with `student`'s token columns)."""
    keep = lambda ids: in_split(ids, split=split, eval_fraction=eval_fraction)
    return TeacherRows.of(view, teacher=teacher, keep=keep, student=student)


class StoreSource:
    """One teacher of a store version: pieces become `PackedBatch`es of that teacher's targets."""

    def __init__(
        self,
        view: StoreVersion,
        *,
        teacher: str | None,
        split: str,
        eval_fraction: float,
        train_on: str = StreamSpec.train_on,
    ):
        self.view, self.teacher = view, view.teacher_name(teacher)
        self.version = view.snapshot_id
        self.completion_only = train_on == "completion"
        check_train_on(view, teacher=self.teacher, train_on=train_on)
        self.rows = split_rows(view, teacher=self.teacher, split=split, eval_fraction=eval_fraction)
        self.table = SplitTable(
            sample_ids=self.rows.sample_ids, n_tokens=self.rows.n_tokens, part=self.rows.part, parts=self.rows.parts
        )
        self.reader = PartReader(view, teacher=self.teacher, rows=self.rows)
        self.where = f"the {split} split of teacher {self.teacher!r} in version {view.snapshot_id}"

    def part_bytes(self) -> np.ndarray:
        return self.reader.bytes

    def read_part(self, code: int) -> PartData:
        return self.reader.read(code)

    def warm_part(self, code: int) -> None:
        self.reader.warm(code)

    def build(self, pieces: Pieces, parts: dict[int, PartData], *, stream: BatchContext) -> PackedBatch:
        ok = readable(self.reader, parts, pieces.row, table=self.table, table_rows=pieces.row, stream=stream)
        decoded = None
        if ok.any():
            decoded = self.reader.samples(parts, pieces.row[ok], pieces.a[ok], pieces.b[ok])
        return one_teacher_batch(pieces, ok, decoded, source=self, sampled=self.reader.sampled, stream=stream)


def readable(
    reader: PartReader, parts: dict[int, PartData], rows: np.ndarray, *, table: SplitTable, table_rows, stream
) -> np.ndarray:
    """bool [n]: which of the reader's `rows` can be read; each damaged one is reported to the stream
    (`unreadable`: raises, or counts it skipped) as its row `table_rows[i]` of the source's `table`."""
    damage = reader.damage(parts, rows)
    ok = np.array([d is None for d in damage], dtype=bool)
    for i in np.flatnonzero(~ok).tolist():
        error = damage[i]
        assert error is not None  # not ok: damaged
        row = int(table_rows[i])
        stream.unreadable(row, error, part=table.parts[table.part[row]])
    return ok


def one_teacher_batch(
    pieces: Pieces, ok: np.ndarray, decoded, *, source, sampled: bool, stream: BatchContext
) -> PackedBatch:
    """The batch of one teacher's readable pieces (`assemble`), for a source of one teacher (its
    `teacher`, `table` and `completion_only`): `StoreSource` and `version_mix.VersionsSource`."""
    return assemble(
        pieces,
        ok,
        decoded,
        teacher=source.teacher,
        sample_ids=source.table.sample_ids,
        micro_batch=stream.micro_batch,
        seq_len=stream.seq_len,
        sampled=sampled,
        completion_only=source.completion_only,
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
