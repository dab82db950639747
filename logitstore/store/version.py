"""Reading one version of a store: `StoreVersion` (index, teachers, samples, stored bytes), opened
read-only from a snapshot by `Store.read`.
"""

from __future__ import annotations

from typing import Protocol, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import zarr
from tokenizers import Tokenizer

from logitstore.errors import (
    DamagedDataError,
    LogitstoreError,
    SampleNotFoundError,
    VersionNotFoundError,
)
from logitstore.format import codec, layout
from logitstore.format.codec import EncodedSamples
from logitstore.format.layout import array_at, group_at, json_attr, read_values, root_attrs
from logitstore.format.samples import SparseSamples, StudentTokens
from logitstore.format.zarr_codec import as_codes
from logitstore.storage.blobs import BlobStore
from logitstore.storage.bounded import BoundedRepository, read_errors, storage_errors
from logitstore.storage.location import Location
from logitstore.storage.packed import PackedStore, array_members
from logitstore.store import answers
from logitstore.store.generation import (
    GENERATIONS_ATTR,
    generation_of,
    parse_answer_id,
    prompt_messages,
    read_prompt_lines,
)
from logitstore.store.index import sample_hashes
from logitstore.store.meta import TeacherMeta


class StoreHandle(Protocol):
    """What a version and a writer use of the `store.Store` they belong to (named here by what it does,
    as `store.py` imports this module): its location, its repository, its index files."""

    location: Location
    repo: BoundedRepository
    blobs: BlobStore

    def read_index(self, snapshot_id: str) -> pa.Table: ...

    def index_key(self, snapshot_id: str) -> str | None: ...


class StoreVersion:
    """A read-only view of one version: its index, its teachers, and decoded samples."""

    def __init__(self, store: StoreHandle, snapshot_id: str):
        self.store = store
        self.snapshot_id = snapshot_id
        with storage_errors(f"cannot read version {snapshot_id} of {store.location.uri}"):
            store.repo.lookup_snapshot(snapshot_id)  # a damaged snapshot raises here; through zarr it would look empty
            session = store.repo.readonly_session(snapshot_id=snapshot_id)
            if "logitstore" not in root_attrs(session):
                raise VersionNotFoundError(f"version {snapshot_id} predates the creation of store {store.location.uri}")
            self.root = zarr.open_group(session.store, mode="r")
            self.teachers = read_teachers(self.root)
        self.index = store.read_index(snapshot_id)
        self._rows: dict[tuple[str, str], int] | None = None
        self._arrays: dict[tuple[str, str, str], zarr.Array] = {}
        self._packed: dict[tuple[str, str], PackedStore] = {}
        self._id_of_code: dict[str, np.ndarray] = {}
        self._prompts: dict[tuple[str, str], dict[str, dict]] = {}

    @property
    def index_path(self) -> str | None:
        key = self.store.index_key(self.snapshot_id)
        return None if key is None else self.store.blobs.url(key)

    def info(self) -> dict:
        """Summary: the fields of `logitstore info --json`."""
        idx = self.index
        tokens = int(pc.sum(idx["n_tokens"]).as_py() or 0)
        stored = self.stored_bytes()
        teachers = []
        for name, meta in sorted(self.teachers.items()):
            rows = idx.filter(pc.equal(idx["teacher"], name))
            teachers.append(
                {
                    "name": name,
                    "vocab_size": meta.vocab_size,
                    "sparsity": meta.sparsity.to_json(),
                    "sparsity_mode": meta.sparsity.mode,
                    "samples": rows.num_rows,
                    "tokens": int(pc.sum(rows["n_tokens"]).as_py() or 0),
                    "content_hash": meta.content_hash,
                    "tokenizer_hash": meta.tokenizer_hash,
                    "codec": meta.codec.to_json(),
                    "student_tokenizers": [self.student_info(name, s) for s in meta.student_names],
                    "engine": meta.engine,
                    "dtype": meta.dtype,
                    "engine_version": meta.engine_version,
                    "generations": list(self.generations(name).values()),
                }
            )
        return {
            "samples": idx.num_rows,
            "tokens": tokens,
            "stored_bytes": stored,
            "bytes_per_token": stored / tokens if tokens else None,
            "teachers": teachers,
            "version": self.snapshot_id,
            "index_path": self.index_path,
        }

    def stored_bytes(self) -> int:
        """Compressed bytes of the parts this version's index references (per-store metadata excluded)."""
        parts = set(zip(self.index["teacher"].to_pylist(), self.index["part"].to_pylist()))
        return sum(int(cast(int, self.part_group(t, p).attrs["stored_bytes"])) for t, p in parts)

    def teacher_name(self, teacher: str | None) -> str:
        if teacher is not None:
            if teacher not in self.teachers:
                raise LogitstoreError(
                    f"this version has no teacher {teacher!r} (teachers: {', '.join(sorted(self.teachers)) or 'none'})"
                )
            return teacher
        if len(self.teachers) == 1:
            return next(iter(self.teachers))
        if not self.teachers:
            raise SampleNotFoundError("this version holds no samples")
        raise LogitstoreError(
            f"this version has several teachers ({', '.join(sorted(self.teachers))}); name one with --teacher"
        )

    def row_of(self, sample_id: str, *, teacher: str | None = None) -> int:
        teacher = self.teacher_name(teacher)
        if self._rows is None:
            keys = zip(self.index["teacher"].to_pylist(), self.index["sample_id"].to_pylist())
            self._rows = {k: i for i, k in enumerate(keys)}
        row = self._rows.get((teacher, sample_id))
        if row is None:
            raise SampleNotFoundError(f"no sample {sample_id!r} for teacher {teacher!r} in version {self.snapshot_id}")
        return row

    def sample(self, sample_id: str, *, teacher: str | None = None) -> SparseSamples:
        return self.decode_row(self.row_of(sample_id, teacher=teacher))

    def decode_row(self, row: int) -> SparseSamples:
        r = self.index.slice(row, 1).to_pylist()[0]
        meta = self.teachers[r["teacher"]]
        enc = self.encoded_row(r)
        out = codec.decode(
            enc, params=meta.codec, id_of_code=self.id_of_code(r["teacher"]), n_tokens=np.array([r["n_tokens"]])
        )
        out.sample_ids = [r["sample_id"]]
        return out

    def encoded_row(self, r: dict, *, checked: bool = True) -> EncodedSamples:
        """The stored integer arrays of one index row (a dict from `index.to_pylist()`), `checked` against
        the row's lengths and content hash (`verify` checks them itself, to say which one differs): a
        member table that puts another member's bytes, or none, in an array's place is damage here,
        never wrong values. The check reads the row's student tokens too and hashes its few bytes."""
        t, p = r["teacher"], r["part"]
        params = self.teachers[t].codec
        what = f"sample {r['sample_id']!r} of teacher {t!r} (part {p})"
        with read_errors(what):
            names = self.part_names(t, p)
            enc = slice_row(
                r, lambda name, rows: as_codes(read_values(self.array(t, p, name), rows), params), names=names
            )
            if checked:
                problem = row_problem(r, enc, self.row_students(r))
                if problem:
                    raise DamagedDataError(f"{what} is damaged: {problem}; run `logitstore verify`")
        return enc

    def row_students(self, r: dict) -> list[StudentTokens]:
        """The row's student ids and groups (and loss mask, chat data) for each of its teacher's student
        tokenizers, in order. A range past the stored arrays raises `ValueError` (damage)."""
        out = []
        meta = self.teachers[r["teacher"]]
        array = lambda name: self.array(r["teacher"], r["part"], name)
        for k, student in enumerate(meta.student_names):
            s0, n, g0, g = (r[c][k] for c in ("student_start", "n_student_tokens", "group_start", "n_groups"))
            # chat data holds a loss mask per student tokenizer (the writer refuses it otherwise)
            ids_name, groups_name, *mask_name = layout.student_arrays(student, chat=meta.loss_mask is not None)
            ids = read_values(array(ids_name), slice(s0, s0 + n))
            groups = read_values(array(groups_name), slice(4 * g0, 4 * (g0 + g)))
            mask = read_values(array(mask_name[0]), slice(s0, s0 + n)) if mask_name else None
            if len(ids) != n or len(groups) != 4 * g or (mask is not None and len(mask) != n):
                raise ValueError("index points outside the stored student arrays")
            out.append(
                StudentTokens(
                    ids=ids, n_ids=np.array([n]), groups=groups.reshape(-1, 4), n_groups=np.array([g]), loss_mask=mask
                )
            )
        return out

    def part_group(self, teacher: str, part: str) -> zarr.Group:
        return group_at(self.root, layout.part_path(teacher, part))

    def part_names(self, teacher: str, part: str) -> list[str]:
        """The arrays a part holds (of `layout.PART_ARRAYS`, in that order), however it is stored."""
        if self.teachers[teacher].packed:
            held = set(self.packed_store(teacher, part).names)
        else:
            group = self.part_group(teacher, part)
            held = {n for n in layout.PART_ARRAYS if n in group}
        return [n for n in layout.PART_ARRAYS if n in held]

    def packed_store(self, teacher: str, part: str) -> PackedStore:
        """A packed part's arrays as a Zarr store of their own (store format 3, `storage/packed.py`)."""
        if (teacher, part) not in self._packed:
            path = layout.packed_path(teacher, part)
            meta = self.teachers[teacher]
            names = layout.part_arrays(sampled=meta.sampled, chat=meta.loss_mask is not None)
            members = array_members(array_at(self.root, path), names=names, where=path, grid=meta.grid)
            self._packed[(teacher, part)] = PackedStore(self.root.store, path=path, members=members)
        return self._packed[(teacher, part)]

    def array(self, teacher: str, part: str, name: str) -> zarr.Array:
        """One array of a part, `name` its path in the part (`layout.PART_ARRAYS`, `layout.student_arrays`):
        a view of its bytes in the packed object where the teacher's layout packs it."""
        key = (teacher, part, name)
        if key not in self._arrays:
            if self.teachers[teacher].packs(name):
                self._arrays[key] = zarr.open_array(self.packed_store(teacher, part), path=name, mode="r")
            else:
                self._arrays[key] = array_at(self.root, f"{layout.part_path(teacher, part)}/{name}")
        return self._arrays[key]

    def id_of_code(self, teacher: str) -> np.ndarray:
        if teacher not in self._id_of_code:
            with read_errors(
                f"the id order of teacher {teacher!r} ({layout.teacher_path(teacher)}/{layout.CODE_OF_ID})"
            ):
                group = group_at(self.root, layout.teacher_path(teacher))
                codes = read_values(array_at(group, layout.CODE_OF_ID)) if layout.CODE_OF_ID in group else None
            if codes is not None:
                self._id_of_code[teacher] = codec.invert_permutation(codes)
            else:
                self._id_of_code[teacher] = codec.identity_order(self.teachers[teacher].vocab_size)
        return self._id_of_code[teacher]

    # -- student tokenizers (cross-tokenizer distillation) -------------------------------------------

    def student_group(self, teacher: str, student: str) -> zarr.Group:
        teacher = self.teacher_name(teacher)
        names = self.teachers[teacher].student_names
        if student not in names:
            raise LogitstoreError(
                f"teacher {teacher!r} has no student tokenizer {student!r} "
                f"(it has: {', '.join(names) or 'none'}; see build --student-tokenizer)"
            )
        return group_at(self.root, layout.student_path(teacher, student))

    def student_info(self, teacher: str, student: str) -> dict:
        """name, tokenizer_hash, vocab_size, mapped_ids, and `mapped_mass`: the mean share of the
        teacher's probability per position on tokens with an exact student counterpart (its stored
        entries only: the tail counts as unmapped), estimated on `mapped_mass_positions` positions."""
        return dict(json_attr(self.student_group(teacher, student), "logitstore_student"))

    def vocab_map(self, teacher: str, student: str) -> np.ndarray:
        group = self.student_group(teacher, student)
        with read_errors(f"the vocabulary map of student tokenizer {student!r} ({group.path}/{layout.VOCAB_MAP})"):
            return read_values(array_at(group, layout.VOCAB_MAP))

    def student_tokenizer(self, teacher: str, student: str):
        return Tokenizer.from_str(self.student_tokenizer_json(teacher, student))

    def student_tokenizer_json(self, teacher: str, student: str) -> str:
        """The tokenizer.json of a teacher's student tokenizer, as stored."""
        group = self.student_group(teacher, student)
        return _read_text(group, layout.TOKENIZER, what=f"student tokenizer {student!r}")

    def student_tokens(self, sample_id: str, *, teacher: str | None, student: str) -> tuple[np.ndarray, np.ndarray]:
        """(student ids [n], alignment groups [g, 4]) of one sample."""
        teacher = self.teacher_name(teacher)
        self.student_group(teacher, student)  # refuses an unknown name with a clear message
        k = self.teachers[teacher].student_names.index(student)
        r = self.index.slice(self.row_of(sample_id, teacher=teacher), 1).to_pylist()[0]
        base = layout.part_student_path(teacher, r["part"], student)
        ids_name, groups_name = layout.student_arrays(student, chat=False)
        with read_errors(f"student tokens of sample {sample_id!r} ({base})"):
            s0, n = r["student_start"][k], r["n_student_tokens"][k]
            g0, g = r["group_start"][k], r["n_groups"][k]
            ids = read_values(self.array(teacher, r["part"], ids_name), slice(s0, s0 + n))
            groups = read_values(self.array(teacher, r["part"], groups_name), slice(4 * g0, 4 * (g0 + g)))
            groups = groups.reshape(-1, 4)
        return ids.astype(np.int64), groups.astype(np.int64)

    def generations(self, teacher: str | None = None) -> dict[str, dict]:
        """The generations whose answers the teacher's samples hold (`build --generate`), by id: the
        generator, engine, sampling settings, seed and round (`logitstore.store.generation`)."""
        group = group_at(self.root, layout.teacher_path(self.teacher_name(teacher)))
        return json_attr(group, GENERATIONS_ATTR) if GENERATIONS_ATTR in group.attrs else {}

    def answer(self, sample_id: str, *, teacher: str | None = None) -> dict | None:
        """A generated answer (`build --generate`): `{"prompt_id", "sample", "token_ids", "text",
        "prompt_text", "messages", "generation"}` (texts where the store keeps the teacher's tokenizer;
        `messages` the prompt's turns as given, `generation.prompt_messages`: None where a store written
        before prompts were kept cannot give them), or None for a sample that is no answer."""
        row = self.index.slice(self.row_of(sample_id, teacher=teacher), 1).to_pylist()[0]
        generation, key = generation_of(row["source_hash"]), parse_answer_id(sample_id)
        if generation is None or key is None:
            return None
        s = self.sample(sample_id, teacher=teacher)
        mask = np.asarray(s.loss_mask, dtype=bool) if s.loss_mask is not None else np.zeros(len(s.input_ids), bool)
        tokenizer = self.tokenizer(row["teacher"])
        decode = (lambda ids: tokenizer.decode(ids.tolist(), skip_special_tokens=False)) if tokenizer else None
        prompt_text = decode(s.input_ids[~mask]) if decode else None
        stored = self.prompts(row["teacher"], row["part"]).get(sample_id)
        return {
            "prompt_id": key[0],
            "sample": key[1],
            "token_ids": s.input_ids[mask].tolist(),
            "text": decode(s.input_ids[mask]) if decode else None,
            "prompt_text": prompt_text,
            "messages": prompt_messages(stored, source_hash=row["source_hash"], prompt_text=prompt_text),
            "generation": self.generations(row["teacher"]).get(generation, {"id": generation}),
        }

    def prompts(self, teacher: str, part: str) -> dict[str, dict]:
        """The prompts of a part's answers as given (`layout.PROMPTS`), by sample id: `{"messages"}` or
        `{"text"}`; empty for a part without (no answers, or written before prompts were kept)."""
        if (teacher, part) not in self._prompts:
            path = f"{layout.part_path(teacher, part)}/{layout.PROMPTS}"
            with read_errors(f"the prompts of part {part} of teacher {teacher!r} ({path})"):
                held = layout.PROMPTS in self.part_group(teacher, part)
                data = bytes(read_values(self.array(teacher, part, layout.PROMPTS))) if held else b""
                self._prompts[(teacher, part)] = read_prompt_lines(data)
        return self._prompts[(teacher, part)]

    def answers_dataset(self, *, teacher: str | None = None):
        """Every generated answer of the teacher as a chat row of a `datasets.Dataset` (TRL's
        conversational format): `{"prompt_id", "sample", "messages": [the prompt's turns..., {"role":
        "assistant", "content": the answer}], "generation": id}` (`store/answers.py`)."""
        return answers.answers_dataset(self, teacher=teacher)

    def tokenizer(self, teacher: str | None = None):
        """The teacher's `tokenizers.Tokenizer` if the store keeps one, else None."""
        name = self.teacher_name(teacher)
        group = group_at(self.root, layout.teacher_path(name))
        if layout.TOKENIZER not in group:
            return None
        return Tokenizer.from_str(_read_text(group, layout.TOKENIZER, what=f"the tokenizer of teacher {name!r}"))


def _read_text(group: zarr.Group, name: str, *, what: str) -> str:
    """A stored UTF-8 document (a tokenizer.json), as text."""
    with read_errors(f"{what} ({group.path}/{name})"):
        data = bytes(read_values(array_at(group, name)))
        return data.decode("utf-8")


def row_problem(row: dict, enc: EncodedSamples, students: list[StudentTokens]) -> str | None:
    """What is wrong with one index row's stored arrays (`enc`, its student tokens): lengths the index
    does not give, or bytes that do not hash to its content hash; None when nothing is."""
    n_pos = row["n_tokens"] - 1
    if len(enc.input_ids) != row["n_tokens"] or len(enc.tail) != n_pos or len(enc.entry_codes) != row["n_entries"]:
        return "index points outside the stored arrays"
    if int(enc.n_entries.astype(np.int64).sum()) != row["n_entries"]:
        return "entry counts disagree with the index"
    if sample_hashes(enc, np.array([row["n_tokens"]]), students=students)[0] != row["content_hash"]:
        return "content hash mismatch"
    return None


def slice_row(row: dict, read, *, names) -> EncodedSamples:
    """One sample's `EncodedSamples`, with `read(name, slice)` fetching rows of a part's array."""
    return EncodedSamples(**{name: read(name, rows) for name, rows in layout.row_slices(row, names).items()})


def read_teachers(root: zarr.Group) -> dict[str, TeacherMeta]:
    if layout.TEACHERS not in root:
        return {}
    return {
        name: TeacherMeta.from_json(json_attr(g, "logitstore_teacher"))
        for name, g in group_at(root, layout.TEACHERS).groups()
    }
