"""Writing one part: `PartWriter` encodes a batch of `SparseSamples` (format/codec.py) and writes its arrays
as a new part group, packed into one object in store formats 3 and 4 (storage/packed.py), through
`storage/rawwrite.py` rather than Zarr's array API. `StoreWriter` (writer.py) turns the rows it returns
into a commit; `PartReader` (reader.py) reads what it wrote.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

import icechunk
import numpy as np
import pyarrow as pa
import zarr

from logitstore.errors import InvalidSampleError
from logitstore.format import codec, layout
from logitstore.format.layout import array_at, group_at, read_values
from logitstore.format.samples import SparseSamples, StudentTokens
from logitstore.storage import packed, rawwrite
from logitstore.storage.bounded import bounded_store, read_errors, storage_errors
from logitstore.store import index
from logitstore.store.generation import prompt_array
from logitstore.store.meta import TeacherMeta


@dataclass
class WrittenPart:
    rows: pa.Table  # index rows of the new part
    stored_bytes: int = 0  # compressed size of the part's arrays
    fork: icechunk.ForkSession | None = None  # the fork that holds its arrays, when written in one


class PartWriter:
    """Encodes `SparseSamples` and writes each batch as a new part group into one Icechunk session or
    fork. Parts never touch existing paths, which is what lets forks merge without conflicts."""

    def __init__(
        self, session, *, teachers: dict[str, TeacherMeta], where: str, codes: dict[str, np.ndarray] | None = None
    ):
        self.session = session
        self.teachers = dict(teachers)
        self.where = where
        self._codes = codes if codes is not None else {}  # teacher -> code_of_id, shared with its StoreWriter

    def __getstate__(self) -> dict:
        return {"session": self.session, "teachers": self.teachers, "where": self.where, "codes": self._codes}

    def __setstate__(self, state: dict) -> None:
        type(self).__init__(
            self, state["session"], teachers=state["teachers"], where=state["where"], codes=state.get("codes")
        )

    def write(
        self,
        samples: SparseSamples,
        *,
        teacher: str,
        source_hashes: list[str | None] | None = None,
        students: dict[str, StudentTokens] | None = None,
        prompts: list[dict | None] | None = None,  # per sample: an answer's prompt as given (`layout.PROMPTS`)
    ) -> WrittenPart:
        meta = self.teachers[teacher]
        samples.validate(vocab_size=meta.vocab_size, duplicates=False)  # encode finds duplicate entries
        students = students or {}
        if sorted(students) != sorted(meta.student_names):
            raise InvalidSampleError(
                f"teacher {teacher!r} has student tokenizers {meta.student_names}; this write brings {sorted(students)}"
            )
        ordered = [students[s["name"]] for s in meta.students]
        for st, info in zip(ordered, meta.students):
            st.validate(n_tokens=samples.n_tokens, vocab_size=info["vocab_size"])
        if (meta.loss_mask is not None) != (samples.loss_mask is not None):
            raise InvalidSampleError(
                f"teacher {teacher!r} holds {'chat' if meta.loss_mask else 'plain text'} samples: "
                f"loss_mask must be {'given' if meta.loss_mask else 'absent'}"
            )
        if meta.sampled != (samples.entry_counts is not None):
            raise InvalidSampleError(
                f"teacher {teacher!r} is {meta.sparsity.mode}: entry_counts must be "
                f"{'given' if meta.sampled else 'absent'}"
            )
        store = bounded_store(self.session.store, where=self.where)  # a fork's store is bare
        code_of_id = self.code_of_id(teacher)
        enc = codec.encode(samples, params=meta.codec, code_of_id=code_of_id, vocab_size=meta.vocab_size)
        part = new_part_name()
        path = layout.part_path(teacher, part)
        # The same groups, arrays and bytes as writing each array with `write_array`, in ~1/4 of the
        # time (see storage/rawwrite.py): compression runs in threads while this one hashes the index rows.
        arrays = {f"{path}/{name}": values for name, values in enc.arrays().items()}
        for st, info in zip(ordered, meta.students):
            if (st.loss_mask is not None) != (meta.loss_mask is not None):
                raise InvalidSampleError(
                    f"student tokens of {info['name']!r}: loss_mask must be "
                    f"{'given' if meta.loss_mask else 'absent'} for this teacher"
                )
            values = [st.ids.astype(np.int32), st.groups.astype(np.int32).reshape(-1)]
            values += [] if st.loss_mask is None else [st.loss_mask.astype(np.uint8)]
            names = layout.student_arrays(info["name"], chat=st.loss_mask is not None)
            arrays.update({f"{path}/{name}": v for name, v in zip(names, values, strict=True)})
        arrays.update({f"{path}/{name}": v for name, v in prompt_array(samples.sample_ids, prompts).items()})
        grids = {f"{path}/{name}": meta.grid for name in layout.GRID_ARRAYS}
        pending = rawwrite.encode_arrays(
            {key: (values, layout.array_kwargs(values, grid=grids.get(key))) for key, values in arrays.items()}
        )
        rows = index.part_rows(
            sample_ids=samples.sample_ids,
            teacher=teacher,
            part=part,
            enc=enc,
            n_tokens=samples.n_tokens,
            source_hashes=source_hashes,
            students=ordered,
        )
        encoded = pending.result()
        documents, objects = {}, {}
        if meta.packed:  # store format 3 and 4: the part as one object (`storage/packed.py`)
            in_part = {key: key[len(path) + 1 :] for key in encoded}  # the arrays' paths in the part
            own = {in_part[key]: encoded.pop(key) for key in list(encoded) if meta.packs(in_part[key])}
            blob, members = rawwrite.pack(own)
            packed_path = layout.packed_path(teacher, part)
            documents[f"{packed_path}/zarr.json"] = rawwrite.packed_document(len(blob), members)
            if blob:
                objects[packed.chunk_key(packed_path)] = blob
        stored = sum(a.nbytes for a in encoded.values()) + sum(len(b) for b in (*documents.values(), *objects.values()))
        attrs = {"samples": len(samples), "tokens": int(samples.n_tokens.sum()), "stored_bytes": stored}
        documents[f"{path}/zarr.json"] = rawwrite.group_document(attrs)
        if ordered and not meta.packed_students:  # their arrays lie in groups of their own (format 3)
            documents[f"{layout.part_students_path(teacher, part)}/zarr.json"] = rawwrite.group_document({})
            documents.update(
                {
                    f"{layout.part_student_path(teacher, part, info['name'])}/zarr.json": rawwrite.group_document({})
                    for info in meta.students
                }
            )
        with storage_errors(f"cannot write to {self.where}"):
            rawwrite.write_objects(store, documents=documents, arrays=encoded, objects=objects)
        is_fork = isinstance(self.session, icechunk.ForkSession)
        return WrittenPart(rows=rows, stored_bytes=stored, fork=self.session if is_fork else None)

    def code_of_id(self, teacher: str) -> np.ndarray:
        """The teacher's id order (token id -> stored code), read once per `StoreWriter`."""
        if teacher not in self._codes:
            where = f"{layout.teacher_path(teacher)}/{layout.CODE_OF_ID}"
            with read_errors(f"the id order of teacher {teacher!r} ({where})"):
                root = zarr.open_group(bounded_store(self.session.store, where=self.where), mode="r")
                group = group_at(root, layout.teacher_path(teacher))
                codes = (
                    read_values(array_at(group, layout.CODE_OF_ID))
                    if layout.CODE_OF_ID in group
                    else codec.identity_order(self.teachers[teacher].vocab_size)
                )
            self._codes[teacher] = codes  # uint32: the encoder takes any integer type
        return self._codes[teacher]


def new_part_name() -> str:
    """Unique across processes and machines, and ordered by time for people reading the tree."""
    return f"{time.time_ns():x}-{secrets.token_hex(4)}"
