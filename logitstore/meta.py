"""What a store records and shares between its reader and its writer: the format constants, the
metadata of teachers, student tokenizers and versions, and how storage failures become logitstore's
errors. `store.py` (the repository), `version.py` (reading one version) and `writer.py` (writing parts)
build on it; `logitstore.store` re-exports every public name.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import cast

import icechunk
import numpy as np
import zarr

from logitstore.bounded import (
    icechunk_failure,
    is_panic,
    read_failure,
    root_cause,
)
from logitstore.codec import CodecParams
from logitstore.errors import (
    DamagedDataError,
    InvalidSampleError,
    LogitstoreError,
    StorageError,
)
from logitstore.sparsity import MODES

# 2: teachers registered since hold their log-probability arrays as float32 through the grid codec
# (`zarr_codec.py`; `TeacherMeta.values`); format-1 teachers keep plain uint16 codes and read as before.

FORMAT_VERSION = 2
WRITER = "logitstore 0.1.0"
DEFAULT_BRANCH = "main"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # teachers, student tokenizers, tags and branches
SNAPSHOT_ID = re.compile(r"[0-9A-Z]{20}")  # Icechunk's snapshot ids: 20 Crockford base32 characters

# Chunking, measured in benchmarks/codec.py: an inner chunk (the unit of reading) holds 256 KiB of
# encoded values, about 2k tokens of top-64 entries, so one sample's read touches a few chunks; a
# shard (the unit of writing, one object) holds up to 64 of them, a few MB compressed: large enough
# that object-store request overhead is small, small enough that a part's last shard wastes little.
CHUNK_BYTES = 256 * 1024
CHUNKS_PER_SHARD = 64
# zstd level inside Blosc (byte-shuffle first, which suits small uint16 codes). Measured on the default
# teacher at top-64, one core: level 3 97.8 B/token at 434k tokens/s, 5 95.3 at 225k, 7 93.6 at 77k.
BLOSC_LEVEL = 5


@dataclass(frozen=True)
class TeacherMeta:
    """What a store records about one teacher; fixed when the teacher is first written."""

    name: str
    vocab_size: int
    content_hash: str
    tokenizer_hash: str
    sparsity: dict  # {"mode": "topk"|"topp"|"sampled", "k": .., "p": .., "n": .., "temperature": ..}
    codec: CodecParams = field(default_factory=CodecParams)
    created: str = ""
    writer: str = WRITER
    # Student tokenizers, fixed with the teacher: ({"name", "tokenizer_hash", "vocab_size"}, ...) in the
    # order of the index's per-student list columns.
    students: tuple = ()
    # Chat data (`logitstore.chat`): None for plain text; else every part holds a per-token `loss_mask`
    # and this says which positions hold teacher entries: "completion" or "prompt+completion" (all).
    loss_mask: str | None = None
    # How the log-probability arrays are declared to Zarr: "logprobs" (float32 through the grid codec,
    # readable by plain zarr; store format 2) or "codes" (uint16, teachers written before format 2).
    # The bytes stored are the same uint16 codes either way.
    values: str = "logprobs"
    # What computed the entries (`pipelines/engines/`): the engine's name, the teacher's dtype there and
    # the engine's package version. None for teachers written before they were recorded. Parts from
    # another engine or dtype are refused (their values differ by more than the grid's bound).
    engine: str | None = None
    dtype: str | None = None
    engine_version: str | None = None

    def __post_init__(self) -> None:
        if not NAME.fullmatch(self.name):
            raise InvalidSampleError(f"teacher name {self.name!r}: use letters, digits, '.', '_' and '-'")
        if self.vocab_size < 1:
            raise InvalidSampleError(f"teacher {self.name}: vocab_size must be positive, got {self.vocab_size}")
        if self.sparsity.get("mode") not in MODES:
            raise InvalidSampleError(f"teacher {self.name}: sparsity mode must be one of {', '.join(MODES)}")

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "vocab_size": self.vocab_size,
            "content_hash": self.content_hash,
            "tokenizer_hash": self.tokenizer_hash,
            "sparsity": self.sparsity,
            "codec": self.codec.to_json(),
            "created": self.created,
            "writer": self.writer,
            "students": [dict(s) for s in self.students],
            "loss_mask": self.loss_mask,
            "values": self.values,
            "engine": self.engine,
            "dtype": self.dtype,
            "engine_version": self.engine_version,
        }

    @classmethod
    def from_json(cls, meta: dict) -> TeacherMeta:
        students = tuple(dict(s) for s in meta.get("students", ()))
        return cls(**{"values": "codes", **meta, "codec": CodecParams.from_json(meta["codec"]), "students": students})

    @property
    def grid(self) -> CodecParams | None:
        """The grid codec's parameters where the log-probability arrays go through it, else None."""
        return self.codec if self.values == "logprobs" else None

    @property
    def student_names(self) -> list[str]:
        return [s["name"] for s in self.students]

    @property
    def sampled(self) -> bool:
        """Entries are draws with counts (read from the mode alone, so hand-written metadata reads too)."""
        return self.sparsity["mode"] == "sampled"

    def same_teacher(self, other: TeacherMeta) -> bool:
        keys = ("vocab_size", "content_hash", "tokenizer_hash", "sparsity", "students", "loss_mask")
        return (
            all(getattr(self, k) == getattr(other, k) for k in keys)
            and self.codec == other.codec
            and self.same_computation(other)
        )

    def same_computation(self, other: TeacherMeta) -> bool:
        """Same engine and dtype, where both say (teachers from before these were recorded say neither)."""
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


@contextlib.contextmanager
def storage_errors(what: str) -> Iterator[None]:
    """Turn Icechunk's multi-line Rust errors into one line that names the store: damaged repository
    files (a ref or snapshot that does not parse) are `DamagedDataError`, anything else an outage."""
    try:
        yield
    except icechunk.ConflictError:
        raise
    except icechunk.IcechunkError as e:
        raise icechunk_failure(what, e) from None
    except BaseException as e:  # a panic in Icechunk's Rust code on a failed request is no Exception
        if is_panic(e):
            raise StorageError(f"{what}: {root_cause(e)}") from None
        raise


@contextlib.contextmanager
def read_errors(what: str) -> Iterator[None]:
    """Reads of stored arrays: an unreachable or stalled store is an outage (`StorageError`, exit 2,
    run again later); bytes that fail their CRC32C or do not decode are damage (`DamagedDataError`,
    exit 1, what `verify` reports). `what` names the data, e.g. "the id order of teacher 'x'"."""
    try:
        yield
    except LogitstoreError:
        raise
    except icechunk.IcechunkError as e:
        raise read_failure(f"cannot read {what}", e) from None
    except (ValueError, RuntimeError) as e:  # zarr's CRC32C mismatch is a ValueError, a Blosc failure a RuntimeError
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DamagedDataError(f"{what} is damaged ({cause[:120]}); run `logitstore verify`") from None


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def mismatch_message(old: TeacherMeta, new: TeacherMeta) -> str:
    for key in ("content_hash", "tokenizer_hash", "vocab_size", "sparsity"):
        if getattr(old, key) != getattr(new, key):
            return (
                f"the store's teacher {old.name!r} was written with {key}={getattr(old, key)!r}, "
                f"this write has {getattr(new, key)!r}; use another teacher name or another store"
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


# zarr types every member of a group as an array or a group, every read of an array as any array-like or
# scalar, and every attribute as any JSON value; the store's layout fixes which one each is.


def group_at(parent: zarr.Group, path: str) -> zarr.Group:
    """`parent[path]`, where the store's layout puts a group."""
    return cast(zarr.Group, parent[path])


def array_at(parent: zarr.Group, path: str) -> zarr.Array:
    """`parent[path]`, where the store's layout puts an array."""
    return cast(zarr.Array, parent[path])


def read_values(array: zarr.Array, rows: slice = slice(None)) -> np.ndarray:
    """`array[rows]` of a 1-D array: a numpy array."""
    return cast(np.ndarray, array[rows])


def json_attr(node: zarr.Group | zarr.Array, key: str) -> dict:
    """An attribute that logitstore writes as a JSON object (its "logitstore", "logitstore_teacher", ...)."""
    return cast(dict, node.attrs[key])


def root_attrs(session: icechunk.Session) -> dict:
    try:
        return dict(zarr.open_group(session.store, mode="r").attrs)
    except zarr.errors.GroupNotFoundError:
        return {}
