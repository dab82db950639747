"""What a store records: its format version and writer, the names it accepts, and the metadata of its
teachers, student tokenizers and versions. `store.py` (the repository), `version.py` (reading one
version) and `writer.py` (writing parts) build on it; where things lie in the tree is `format/layout.py`.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from logitstore.errors import (
    InvalidSampleError,
)
from logitstore.format.grid import CodecParams
from logitstore.format.sparsity import Sparsity, SparsityError

# 2: a teacher of this format or later holds its log-probability arrays as float32 through the grid codec
# (`format/zarr_codec.py`; `TeacherMeta.values`); a format-1 teacher holds plain uint16 codes, read as stored.
# 3: a teacher of this format or later stores each part as one object, its arrays packed into one Zarr
# array (`layout.PACKED`; `TeacherMeta.part_layout`): one request per part on object storage instead of
# one per array. A teacher of an earlier format keeps one object per array, read as stored.
# 4: a teacher of this format packs a part's student-token arrays (cross-tokenizer) into that one object
# too ("packed+students"): a cross-tokenizer part is one object. A format-3 teacher keeps its student
# arrays one object each, read as stored.

FORMAT_VERSION = 4
WRITER = "logitstore 0.1.0"
DEFAULT_BRANCH = "main"
# What a write does with a sample id the branch holds (`StoreWriter`'s on_duplicate and on_changed), and a
# build with a document stored under its id with other text (`--on-duplicate`): refuse, replace, or keep.
OnDuplicate = Literal["error", "replace", "skip"]
ON_DUPLICATE: tuple[OnDuplicate, ...] = get_args(OnDuplicate)
RUN_MARKER = "logitstore-run.json"  # marks a `logitstore train` run's folder (trainer/run_folder.py)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # teachers, student tokenizers, tags and branches
PART_LAYOUTS = ("packed+students", "packed", "arrays")  # `TeacherMeta.part_layout`, newest first
SNAPSHOT_ID = re.compile(r"[0-9A-Z]{20}")  # Icechunk's snapshot ids: 20 Crockford base32 characters


@dataclass(frozen=True)
class TeacherMeta:
    """What a store records about one teacher; fixed when the teacher is first written."""

    name: str
    vocab_size: int
    content_hash: str
    tokenizer_hash: str
    # Which entries are kept, and the value grid (stored apart, as the teacher's `codec`).
    sparsity: Sparsity
    created: str = ""
    writer: str = WRITER
    # Student tokenizers, fixed with the teacher: ({"name", "tokenizer_hash", "vocab_size"}, ...) in the
    # order of the index's per-student list columns.
    students: tuple = ()
    # Chat data (`logitstore.text.chat`): None for plain text; else every part holds a per-token `loss_mask`
    # and this says which positions hold teacher entries: "completion" or "prompt+completion" (all).
    loss_mask: str | None = None
    # How the log-probability arrays are declared to Zarr: "logprobs" (float32 through the grid codec,
    # readable by plain zarr; store format 2) or "codes" (uint16, teachers written before format 2).
    # The bytes stored are the same uint16 codes either way.
    values: str = "logprobs"
    # What computed the entries (`pipelines/engines/`): the engine's name, the teacher's dtype there and
    # the engine's package version. None where the metadata does not record them (stores of earlier
    # logitstore versions). Parts from
    # another engine or dtype are refused (their values differ by more than the grid's bound).
    engine: str | None = None
    dtype: str | None = None
    engine_version: str | None = None
    # How a part's arrays lie in storage (`PART_LAYOUTS`): "packed+students" (one object per part, its
    # student-token arrays included; store format 4), "packed" (the teacher's own arrays in one object,
    # each student-token array an object of its own; format 3) or "arrays" (one Zarr array, so one
    # object, per array; teachers written before format 3). `packs` says where one array lies.
    part_layout: str = "packed+students"
    # A teacher behind a server (`--engine server`): {"model", "version", "k", "urls"} (the served model's
    # name, the server's /version, the prompt log-probabilities asked, the URLs less any credentials).
    # None otherwise, and then left out of the JSON, so readers that do not know the field read every other
    # store.
    server: dict | None = None

    def __post_init__(self) -> None:
        if not NAME.fullmatch(self.name):
            raise InvalidSampleError(f"teacher name {self.name!r}: use letters, digits, '.', '_' and '-'")
        if self.vocab_size < 1:
            raise InvalidSampleError(f"teacher {self.name}: vocab_size must be positive, got {self.vocab_size}")
        if self.part_layout not in PART_LAYOUTS:
            raise InvalidSampleError(f"teacher {self.name}: part_layout must be one of {PART_LAYOUTS}")

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "vocab_size": self.vocab_size,
            "content_hash": self.content_hash,
            "tokenizer_hash": self.tokenizer_hash,
            "sparsity": self.sparsity.to_json(),
            "codec": self.codec.to_json(),
            "created": self.created,
            "writer": self.writer,
            "students": [dict(s) for s in self.students],
            "loss_mask": self.loss_mask,
            "values": self.values,
            "engine": self.engine,
            "dtype": self.dtype,
            "engine_version": self.engine_version,
            "part_layout": self.part_layout,
        } | ({"server": dict(self.server)} if self.server is not None else {})

    @classmethod
    def from_json(cls, meta: dict) -> TeacherMeta:
        students = tuple(dict(s) for s in meta.get("students", ()))
        try:
            sparsity = Sparsity.from_meta(meta["sparsity"], CodecParams.from_json(meta["codec"]))
        except SparsityError as e:
            raise InvalidSampleError(f"teacher {meta.get('name')}: {e}") from None
        fields = {k: v for k, v in meta.items() if k != "codec"}
        return cls(**{"values": "codes", "part_layout": "arrays", **fields, "sparsity": sparsity, "students": students})

    @property
    def codec(self) -> CodecParams:
        """The value grid (and the id order) the teacher's parts are encoded with: the sparsity's grid."""
        return self.sparsity.grid

    @property
    def grid(self) -> CodecParams | None:
        """The grid codec's parameters where the log-probability arrays go through it, else None."""
        return self.codec if self.values == "logprobs" else None

    @property
    def format(self) -> int:
        """The store format this teacher needs a reader to know (see `FORMAT_VERSION`)."""
        return {"packed+students": 4, "packed": 3}.get(self.part_layout) or (2 if self.values == "logprobs" else 1)

    @property
    def packed(self) -> bool:
        """Each part's own arrays are one object (`layout.PACKED`), not one per array."""
        return self.part_layout != "arrays"

    @property
    def packed_students(self) -> bool:
        """Each part's student-token arrays are members of its one object too (store format 4)."""
        return self.part_layout == "packed+students"

    def packs(self, name: str) -> bool:
        """Whether a part's array `name` (its path in the part: `layout.PART_ARRAYS`, a student
        tokenizer's `layout.student_arrays`, or `layout.PROMPTS`) lies in the part's packed object."""
        from logitstore.format import (
            layout,  # here: layout imports the codec (numba), which the CLI's start-up must not
        )

        if name == layout.PROMPTS:  # read by an export only: outside the object the trainer reads
            return False
        return self.packed_students if layout.is_student_array(name) else self.packed

    @property
    def student_names(self) -> list[str]:
        return [s["name"] for s in self.students]

    @property
    def sampled(self) -> bool:
        """Entries are draws with counts (read from the mode alone, so hand-written metadata reads too)."""
        return self.sparsity.sampled

    def same_teacher(self, other: TeacherMeta) -> bool:
        keys = ("vocab_size", "content_hash", "tokenizer_hash", "sparsity", "students", "loss_mask")
        return all(getattr(self, k) == getattr(other, k) for k in keys) and self.same_computation(other)

    def same_computation(self, other: TeacherMeta) -> bool:
        """Same engine and dtype, where both say (metadata that does not record them says neither)."""
        return all(
            getattr(self, k) is None or getattr(other, k) is None or getattr(self, k) == getattr(other, k)
            for k in ("engine", "dtype")
        )


@dataclass(frozen=True)
class StudentTokenizer:
    """A student tokenizer registered with a teacher: written once, with the teacher."""

    name: str
    tokenizer_hash: str
    vocab_size: int
    tokenizer_json: str
    vocab_map: np.ndarray  # int32 [teacher vocab]: student id with identical bytes, or -1
    mapped_mass: float | None = None  # mean teacher mass per position on mapped ids (of the first unit)
    mapped_mass_positions: int = 0  # positions that estimate was taken over

    def __post_init__(self) -> None:
        if not NAME.fullmatch(self.name):
            raise InvalidSampleError(f"student tokenizer name {self.name!r}: use letters, digits, '.', '_' and '-'")

    def summary(self) -> dict:
        return {"name": self.name, "tokenizer_hash": self.tokenizer_hash, "vocab_size": self.vocab_size}


@dataclass(frozen=True)
class VersionInfo:
    id: str
    message: str
    written_at: dt.datetime
    parent_id: str | None
    tags: list[str]
    samples: int | None
    tokens: int | None


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def mismatch_message(old: TeacherMeta, new: TeacherMeta) -> str:
    shown = lambda meta, key: meta.sparsity.to_json() if key == "sparsity" else getattr(meta, key)  # as stored
    for key in ("content_hash", "tokenizer_hash", "vocab_size", "sparsity"):
        if shown(old, key) != shown(new, key):
            return (
                f"the store's teacher {old.name!r} was written with {key}={shown(old, key)!r}, "
                f"this write has {shown(new, key)!r}; use another teacher name or another store"
            )
    if old.student_names != new.student_names or old.students != new.students:
        return (
            f"the store's teacher {old.name!r} was written with student tokenizers {old.student_names or 'none'}, "
            f"this build has {new.student_names or 'none'} (--student-tokenizer must match, same files); "
            "use another teacher name, branch or store"
        )
    if old.loss_mask != new.loss_mask:

        def kind(m):
            return "plain text" if m is None else f"chat data with teacher entries for {m} tokens"

        return (
            f"the store's teacher {old.name!r} holds {kind(old.loss_mask)}, this build brings {kind(new.loss_mask)} "
            "(--chat-column and --train-on must match); use another teacher name, branch or store"
        )
    if not old.same_computation(new):
        return (
            f"the store's teacher {old.name!r} was computed by the {old.engine} engine in {old.dtype}, this build "
            f"runs the {new.engine} engine in {new.dtype}; their values would mix in one teacher. Use the same "
            "--engine and --dtype, or store this one as another teacher (--teacher-name)"
        )
    return f"the store's teacher {old.name!r} uses codec {old.codec}, this write {new.codec}"
