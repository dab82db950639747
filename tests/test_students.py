"""Cross-tokenizer parts (a teacher's student-token arrays): one object per part since store format 4,
format-3 stores (student arrays of their own) read as before, and the mixed source's warm-ahead."""

from __future__ import annotations

import dataclasses
import shutil
import uuid
from pathlib import Path

import pytest
import torch
from zarr.core.sync import sync

from logitstore.format import layout
from logitstore.format.layout import json_attr
from logitstore.store.reader import PartReader
from logitstore.store.store import Store
from logitstore.store.verify import verify
from logitstore.streaming.batch import PackedBatch
from logitstore.streaming.mixing import resolve_sources, student_vocabulary
from logitstore.streaming.spec import StreamSpec
from logitstore.streaming.stream import Stream, store_stream
from logitstore.testing.streams import take
from logitstore.testing.students import STUDENT, TEACHER, cross_store

FORMAT_3_STORE = Path(__file__).parent / "data" / "format3-students-store"  # make_format3_students_store.py


def cross_stream(view, *, budget_parts: int | None = None, **kw) -> Stream:
    """The stream of the student of tokenizer "s" (the mixed source); with `budget_parts`, a memory
    budget of that many of the largest parts."""
    vocab = student_vocabulary(view, teachers=[TEACHER], student_tokenizer=STUDENT, student_hash=None)
    sources = resolve_sources(view, weights={TEACHER: 1.0}, vocab=vocab)
    spec = dict(seq_len=32, micro_batch=2, rank=0, world_size=1, seed=1, **kw)
    if budget_parts is not None:
        probe = store_stream(view, StreamSpec(**spec), sources=sources)
        spec["memory_budget"] = budget_parts * int(probe.source.part_bytes().max())
        probe.close()
    return store_stream(view, StreamSpec(**spec), sources=sources)


def assert_same(x: PackedBatch, y: PackedBatch) -> None:
    for name in ("input_ids", "position_ids", "document_ids", "positions", "target_ids"):
        assert torch.equal(getattr(x, name), getattr(y, name)), name
    assert (x.n_tokens, x.segments, x.signal_counts) == (y.n_tokens, y.segments, y.signal_counts)
    assert [name for name, _ in x.signals] == [name for name, _ in y.signals]
    for (_, a), (_, b) in zip(x.signals, y.signals, strict=True):
        for field in dataclasses.fields(a):
            u, v = getattr(a, field.name), getattr(b, field.name)
            assert (u is None and v is None) or torch.equal(u, v), field.name


def part_keys(view, part: str) -> list[str]:
    """The keys (objects and documents) under one part of the teacher."""
    prefix = layout.part_path(TEACHER, part) + "/"

    async def keys() -> list[str]:
        return [k[len(prefix) :] async for k in view.root.store.list_prefix(prefix)]

    return sorted(sync(keys()))


def test_a_cross_tokenizer_part_is_one_object_since_format_4(tmp_path):
    """Store format 4: the student arrays are members of the part's packed object, so the part holds
    that object and nothing else; a format-3 part keeps a group of student arrays beside it."""
    new = cross_store(str(tmp_path / "new"))
    meta = new.teachers[TEACHER]
    assert meta.format == 4 and meta.packed_students and json_attr(new.root, "logitstore")["format"] == 4
    for part in new.index["part"].unique().to_pylist():
        assert part_keys(new, part) == ["packed/c/0", "packed/zarr.json", "zarr.json"]
        members = new.packed_store(TEACHER, part).names
        assert set(layout.student_arrays(STUDENT, chat=False)) <= set(members)
    shutil.copytree(FORMAT_3_STORE, tmp_path / "old")
    old = Store.open(str(tmp_path / "old")).read()
    part = old.index["part"][0].as_py()
    assert old.teachers[TEACHER].part_layout == "packed" and not old.teachers[TEACHER].packed_students
    assert any(key.startswith(f"{layout.STUDENTS}/{STUDENT}/") for key in part_keys(old, part))
    for view in (old, new):  # the slow paths: one sample's student tokens, and verify
        ids, groups = view.student_tokens("doc-005", teacher=None, student=STUDENT)
        assert len(ids) and groups[-1, 3] == len(ids)
        assert verify(view).ok
    for a, b in zip(*(v.student_tokens("doc-011", teacher=None, student=STUDENT) for v in (old, new)), strict=True):
        assert (a == b).all()


@pytest.mark.parametrize("windows", [False, True])
def test_a_format_3_cross_tokenizer_store_streams_as_the_same_samples_written_now(tmp_path, windows):
    """Student arrays of their own (written by logitstore at store format 3) and packed with the part
    (written now, from the same samples): the same batches through the cross-tokenizer source."""
    shutil.copytree(FORMAT_3_STORE, tmp_path / "old")
    old = Store.open(str(tmp_path / "old")).read()
    assert json_attr(old.root, "logitstore")["format"] == 3
    new = cross_store(str(tmp_path / "new"))
    a, b = (cross_stream(v, budget_parts=2 if windows else None) for v in (old, new))
    assert a.window_parts == b.window_parts == (1 if windows else a.window_parts)
    for x, y in zip(take(a, a.steps_per_epoch), take(b, b.steps_per_epoch), strict=True):
        assert_same(x, y)
    assert any(x.signal_counts["exact_positions"] for x in take(a, 2))  # the student side carried signal
    a.close(), b.close()


@pytest.mark.parametrize("part_layout", ["packed+students", "packed"])
def test_windows_of_a_cross_tokenizer_source_warm_the_parts_they_read_later(monkeypatch, part_layout):
    """The mixed source passes the engine's warm-ahead on (`MixedSource.warm_part`) to its readers:
    under windows of one part, the parts the engine warms (past the first two windows) are warmed by
    the readers that read them later, once each, and each part is still read once."""
    warmed: list[tuple[str, str]] = []
    original = PartReader.warm

    def spy(self, code: int) -> None:
        warmed.append((self.teacher, self.rows.parts[code]))
        original(self, code)

    monkeypatch.setattr(PartReader, "warm", spy)
    view = cross_store(f"memory://{uuid.uuid4().hex[:12]}", n=36, parts=6, part_layout=part_layout)
    s = cross_stream(view, budget_parts=2, prefetch=0)
    assert s.window_parts == 1
    take(s, s.steps_per_epoch)
    assert s._parts is not None and s._parts._pool is not None
    s._parts._pool.shutdown(wait=True)  # the warm-ups submitted, all run
    n_parts = len(s.table.parts)
    plan = s._plan(0).groups[0]
    first_two = {s.table.parts[p] for w in (0, 1) for p in plan.parts_of_window(w).tolist()}
    asked = sorted((TEACHER, s.table.parts[c]) for c in s._parts._warmed)  # what the engine asked to warm
    assert asked and sorted(warmed) == asked and not first_two & {p for _, p in warmed}
    assert n_parts <= s.part_reads <= n_parts + s.window_parts
    s.close()
