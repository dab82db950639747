"""`verify`: read every stored chunk of a version and check it against the index.

Three layers catch damage: the Parquet index is content-addressed (its name is its checksum), every
Zarr chunk carries a CRC32C (a damaged chunk fails to decode), and every sample's decoded arrays must
hash to the `content_hash` the index recorded when it was written.

Besides the samples, every teacher-level array (the codec's id order, the stored tokenizers, the
student vocabulary maps) is read whole and checked for what it must be (a permutation, UTF-8 JSON, ids
in range), and every group's and array's metadata document is opened: a version that `verify` calls
whole is one that `show` and `train` can read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import pyarrow.compute as pc
import zarr

from logitstore.errors import DamagedDataError, StorageError
from logitstore.format import layout
from logitstore.format.layout import group_at, read_values
from logitstore.format.zarr_codec import as_codes
from logitstore.store.generation import generation_of
from logitstore.store.version import StoreVersion, row_problem, slice_row


@dataclass
class VerifyReport:
    version: str
    samples: int = 0
    parts: int = 0
    damaged: dict[str, str] = field(default_factory=dict)  # "teacher/sample_id" -> what is wrong
    arrays: int = 0  # teacher-level arrays read whole (id order, tokenizers, vocabulary maps)
    damaged_arrays: dict[str, str] = field(default_factory=dict)  # "teachers/<t>/code_of_id" -> what is wrong
    # "<teacher>/<part>" -> compressed bytes: parts that hold no sample of this version. Not damage: the
    # samples of older versions that --on-duplicate replace or a removal dropped, or a concurrent build's
    # parts whose samples the other build committed first (kept by writers that did not delete them at
    # commit, as `StoreWriter.commit` does).
    unreferenced: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.damaged and not self.damaged_arrays


def verify(version: StoreVersion) -> VerifyReport:
    report = VerifyReport(version=version.snapshot_id, samples=version.index.num_rows)
    _check_metadata_and_teacher_arrays(version, report)
    idx = version.index
    report.unreferenced = _unreferenced_parts(version)
    for teacher, part in sorted(set(zip(idx["teacher"].to_pylist(), idx["part"].to_pylist()))):
        rows = idx.filter(pc.and_(pc.equal(idx["teacher"], teacher), pc.equal(idx["part"], part))).to_pylist()
        report.parts += 1
        whole = _read_part(version, teacher, part)
        prompts = _prompts_problem(version, teacher, part, rows)
        for row in rows:
            problem = _check_row(version, row, whole) or prompts.get(row["sample_id"])
            if problem:
                report.damaged[f"{teacher}/{row['sample_id']}"] = problem
    return report


def _prompts_problem(version: StoreVersion, teacher: str, part: str, rows: list[dict]) -> dict[str, str]:
    """Sample id -> what is wrong with its stored prompt (`layout.PROMPTS`): unreadable, or missing from
    a part that keeps its answers' prompts. A part written before prompts were kept holds none."""
    answers = [r["sample_id"] for r in rows if generation_of(r["source_hash"]) is not None]
    if not answers:
        return {}
    try:
        stored = version.prompts(teacher, part)
    except DamagedDataError as e:
        return {sid: f"its prompt is unreadable: {e}" for sid in answers}
    return {sid: "no stored prompt" for sid in answers if stored and sid not in stored}


def _unreferenced_parts(version: StoreVersion) -> dict[str, int]:
    """Part groups that no index row of this version names, with their stored bytes (a removal's empty
    record part, which holds nothing, is not one)."""
    idx = version.index
    referenced = set(zip(idx["teacher"].to_pylist(), idx["part"].to_pylist()))
    out = {}
    for teacher in version.teachers:
        for part, group in group_at(version.root, layout.parts_path(teacher)).groups():
            attrs = dict(group.attrs)
            if (teacher, part) not in referenced and "removed" not in attrs:
                out[f"{teacher}/{part}"] = int(cast(int, attrs.get("stored_bytes", 0)))  # PartWriter writes an int
    return out


def _check_metadata_and_teacher_arrays(version: StoreVersion, report: VerifyReport) -> None:
    """Open every node's metadata, and read and check every array outside the parts (those are the
    samples' arrays, checked per sample against the index)."""
    try:
        nodes = list(version.root.members(max_depth=None))
    except StorageError:  # an outage is not damage: stop, exit 2
        raise
    except Exception as e:  # a metadata document that does not parse
        report.damaged_arrays["/"] = _problem(e)
        return
    for path, node in sorted(nodes, key=lambda item: item[0]):
        if not isinstance(node, zarr.Array) or layout.in_a_part(path):
            continue
        report.arrays += 1
        try:
            problem = _check_teacher_array(version, path, read_values(node))
        except StorageError:  # an outage is not damage: stop, exit 2
            raise
        except Exception as e:  # a damaged chunk: decompression or checksum failure
            problem = _problem(e)
        if problem:
            report.damaged_arrays[path] = problem


def _check_teacher_array(version: StoreVersion, path: str, values: np.ndarray) -> str | None:
    """What a teacher-level array must be, beyond its checksums."""
    where = layout.teacher_array(path)
    meta = version.teachers.get(where[0]) if where is not None else None
    if where is None or meta is None:
        return None
    _, student_name, name = where
    if name == layout.CODE_OF_ID:
        ok = len(values) == meta.vocab_size and np.array_equal(np.sort(values), np.arange(meta.vocab_size))
        return None if ok else "not a permutation of the teacher's vocabulary"
    if name == layout.TOKENIZER:
        try:
            json.loads(bytes(values).decode("utf-8"))
        except ValueError:
            return "not a UTF-8 JSON tokenizer"
        return None
    if name == layout.VOCAB_MAP:
        student = next((st for st in meta.students if st["name"] == student_name), None)
        ok = (
            len(values) == meta.vocab_size
            and student is not None
            and bool(((values >= -1) & (values < student["vocab_size"])).all())
        )
        return None if ok else "student ids outside the student's vocabulary"
    return None


def _problem(e: Exception) -> str:
    return f"unreadable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")


def _read_part(version: StoreVersion, teacher: str, part: str) -> dict[str, np.ndarray] | None:
    """All arrays of a part, or None when any chunk fails to read (then rows are read one by one)."""
    try:
        params = version.teachers[teacher].codec
        return {
            name: as_codes(read_values(version.array(teacher, part, name)), params)
            for name in version.part_names(teacher, part)
        }
    except StorageError:  # an outage is not damage: stop, exit 2
        raise
    except Exception:
        return None


def _check_row(version: StoreVersion, row: dict, whole: dict[str, np.ndarray] | None) -> str | None:
    try:
        if whole is not None:
            enc = slice_row(row, lambda name, rows: whole[name][rows], names=list(whole))
        else:
            enc = version.encoded_row(row, checked=False)
        students = version.row_students(row)
    except StorageError:  # an outage is not damage: stop, exit 2
        raise
    except Exception as e:  # a damaged chunk: decompression or checksum failure
        return _problem(e)
    return row_problem(row, enc, students)
